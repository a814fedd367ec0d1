//! The attention family's reads and writes: a request outside the batch (`solo_window`, `solo_decode`) and the
//! running batch (`batch_prefill` and its padded chunks, `decode`, `window` / `append`, `verify`, `commit_span`),
//! with the solo twins' reads for batch ops.

use std::collections::BTreeMap;

use mlx_rs::Array;

use super::{emit, model_after_map, unexpected, Attention, Res, TwinRead};
use crate::sim::check::{self, ReadKind};
use crate::sim::family::Cx;
use crate::sim::observe::{Call, Read, TrimInfo};
use crate::sim::roster::Roster;
use kvsim_cache::{JoinSource, Masks, RowBatch};
use kvsim_reference::{RowModel, Tok};

impl Attention {
    pub(super) fn solo_window(&mut self, cx: &mut Cx<'_>, req: u32, len: usize, read: bool) -> Res<bool> {
        let roster = cx.roster;
        if !roster.is_solo(req) || len == 0 {
            return Ok(false);
        }
        let toks = self.next_toks(req, len);
        let scale = self.cfg.scale();
        let offset_before = self.reqs[&req].model.offset;
        for layer in 0..self.cfg.layers {
            let masks = Masks::new();
            let (k, v, q) = self.kvq(layer, &[toks.clone()])?;
            let r = self.reqs.get_mut(&req).unwrap();
            let got = r.solo[layer].window(&k, &v, &q, scale, &masks).map_err(|e| unexpected("solo window", e))?;
            let r = self.reqs.get_mut(&req).unwrap();
            let twin =
                r.twin[layer].window(&k, &v, &q, scale, &Masks::new()).map_err(|e| unexpected("twin window", e))?;
            if cx.observer.wants_calls() {
                let kind = if read { Read::Window } else { Read::Append };
                emit(
                    cx,
                    Call::Solo {
                        req,
                        layer,
                        read: kind,
                        k: &k,
                        v: &v,
                        q: Some(&q),
                        out: Some(&got.0),
                        offset: offset_before,
                        mask: Some(&got.1),
                        twin: Some(&twin.0),
                    },
                )?;
            }
            if read {
                let real: Vec<Tok> = toks.iter().flatten().copied().collect();
                let model_after = {
                    let mut m = self.reqs[&req].model.clone();
                    m.window_write(&real);
                    m
                };
                self.check_read(
                    cx,
                    layer,
                    ReadKind::Window,
                    &got.0,
                    &[(0, req, real.clone(), Some(&twin.0))],
                    &model_after_map(req, &model_after),
                    &got.1,
                )?;
            }
        }
        let real: Vec<Tok> = toks.iter().flatten().copied().collect();
        self.reqs.get_mut(&req).unwrap().model.window_write(&real);
        Ok(true)
    }

    pub(super) fn solo_decode(&mut self, cx: &mut Cx<'_>, req: u32) -> Res<bool> {
        let roster = cx.roster;
        if !roster.is_solo(req) {
            return Ok(false);
        }
        let toks = self.next_toks(req, 1);
        let scale = self.cfg.scale();
        let mut model_after = self.reqs[&req].model.clone();
        model_after.decode_write(toks[0].unwrap());
        for layer in 0..self.cfg.layers {
            let (k, v, q) = self.kvq(layer, &[toks.clone()])?;
            let r = self.reqs.get_mut(&req).unwrap();
            let got =
                r.solo[layer].decode(&k, &v, &q, scale, &Masks::new()).map_err(|e| unexpected("solo decode", e))?;
            let r = self.reqs.get_mut(&req).unwrap();
            let twin =
                r.twin[layer].decode(&k, &v, &q, scale, &Masks::new()).map_err(|e| unexpected("twin decode", e))?;
            if cx.observer.wants_calls() {
                let off = model_after.offset - 1;
                emit(
                    cx,
                    Call::Solo {
                        req,
                        layer,
                        read: Read::Decode,
                        k: &k,
                        v: &v,
                        q: Some(&q),
                        out: Some(&got.0),
                        offset: off,
                        mask: Some(&got.1),
                        twin: Some(&twin.0),
                    },
                )?;
            }
            let real = vec![toks[0].unwrap()];
            self.check_read(
                cx,
                layer,
                ReadKind::Decode,
                &got.0,
                &[(0, req, real, Some(&twin.0))],
                &model_after_map(req, &model_after),
                &got.1,
            )?;
        }
        self.reqs.get_mut(&req).unwrap().model = model_after;
        Ok(true)
    }

    /// The fresh requests `ids` (prompt lengths `lens`) prefilled as new rows in chunks of `chunk`, then
    /// joined after the running rows.
    pub(super) fn batch_prefill(&mut self, cx: &mut Cx<'_>, ids: &[u32], lens: &[usize], chunk: usize) -> Res<()> {
        let max = self.max_size();
        let b = ids.len();
        // Fresh rows, from the requests' own (empty) serial caches.
        let mut pre: Vec<RowBatch> = vec![];
        for layer in 0..self.cfg.layers {
            let sources: Vec<JoinSource> =
                ids.iter().map(|id| JoinSource::Serial(&self.reqs[id].solo[layer])).collect();
            let mut p = RowBatch::join_storage(self.spec, max, self.storage, &sources)
                .map_err(|e| unexpected("join (fresh rows)", e))?;
            p.prepare(lens).map_err(|e| unexpected("prepare", e))?;
            pre.push(p);
        }
        for id in ids {
            self.reqs.get_mut(id).unwrap().model.base = 0;
        }
        if cx.observer.wants_calls() {
            emit(cx, Call::Prefill { reqs: ids, lengths: lens, chunk })?;
        }
        let total = *lens.iter().max().unwrap();
        self.padded_chunks(cx, &mut pre, ids, lens, chunk, usize::MAX, true)?;
        for (layer, p) in pre.iter_mut().enumerate() {
            p.finalize().map_err(|e| unexpected("finalize", e))?;
            let all: Vec<usize> = (0..self.batch[layer].rows()).collect();
            self.batch[layer] = RowBatch::join_storage(
                self.spec,
                max,
                self.storage,
                &[JoinSource::Rows(&self.batch[layer], all), JoinSource::Rows(p, (0..b).collect())],
            )
            .map_err(|e| unexpected("join (prefilled rows)", e))?;
        }
        for id in ids {
            let r = self.reqs.get_mut(id).unwrap();
            r.history.layout_event = true;
            r.solo.clear();
        }
        if cx.observer.wants_calls() {
            emit(cx, Call::PrefillEnd { longest: total })?;
        }
        Ok(())
    }

    /// The chunks of a prepared (right-padded) prefill on `batches` (one per layer, rows `ids`, `lens[r]` real
    /// positions still to come for row `r`): at most `max_chunks` window reads of `chunk` positions, each checked
    /// row by row against the twins (fed only the row's real positions) and the model. Returns the positions
    /// delivered to the longest row. Calls are described to the observer only with `observe`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn padded_chunks(
        &mut self,
        cx: &mut Cx<'_>,
        batches: &mut [RowBatch],
        ids: &[u32],
        lens: &[usize],
        chunk: usize,
        max_chunks: usize,
        observe: bool,
    ) -> Res<usize> {
        let scale = self.cfg.scale();
        let padded = lens.iter().any(|&x| x != lens[0]);
        let total = lens.iter().copied().max().unwrap_or(0);
        let mut done = 0;
        let mut chunks = 0;
        while done < total && chunks < max_chunks {
            chunks += 1;
            let l = chunk.min(total - done);
            // Per row: the real positions of this chunk, then padding.
            let mut toks: Vec<Vec<Option<Tok>>> = vec![];
            let mut reals: Vec<Vec<Tok>> = vec![];
            for (r, id) in ids.iter().enumerate() {
                let remaining = lens[r].saturating_sub(done);
                let n = remaining.min(l);
                let off = self.reqs[id].model.offset as u32;
                let real: Vec<Tok> = (0..n as u32).map(|i| Tok { req: *id, pos: off + i }).collect();
                let mut row: Vec<Option<Tok>> = real.iter().map(|t| Some(*t)).collect();
                row.resize(l, None);
                toks.push(row);
                reals.push(real);
            }
            let mut models: BTreeMap<u32, RowModel> = BTreeMap::new();
            for (r, id) in ids.iter().enumerate() {
                let mut m = self.reqs[id].model.clone();
                if !reals[r].is_empty() {
                    m.window_write(&reals[r]);
                }
                models.insert(*id, m);
            }
            for layer in 0..self.cfg.layers {
                let masks = Masks::new();
                let (k, v, q) = self.kvq(layer, &toks)?;
                let got =
                    batches[layer].window(&k, &v, &q, scale, &masks).map_err(|e| unexpected("prefill window", e))?;
                if observe && cx.observer.wants_calls() {
                    let real: Vec<usize> = reals.iter().map(Vec::len).collect();
                    emit(
                        cx,
                        Call::PrefillChunk {
                            layer,
                            reqs: ids,
                            k: &k,
                            v: &v,
                            q: &q,
                            real: &real,
                            out: &got.0,
                            done,
                            padded,
                        },
                    )?;
                }
                let mut twin_outs = vec![];
                for (r, id) in ids.iter().enumerate() {
                    if reals[r].is_empty() {
                        twin_outs.push(None);
                        continue;
                    }
                    let one: Vec<Vec<Option<Tok>>> = vec![reals[r].iter().map(|t| Some(*t)).collect()];
                    let (tk, tv, tq) = self.kvq(layer, &one)?;
                    let t = self.reqs.get_mut(id).unwrap().twin[layer]
                        .window(&tk, &tv, &tq, scale, &Masks::new())
                        .map_err(|e| unexpected("twin window", e))?;
                    twin_outs.push(Some(t.0));
                }
                let rows: Vec<(usize, u32, Vec<Tok>, Option<&Array>)> =
                    ids.iter().enumerate().map(|(r, id)| (r, *id, reals[r].clone(), twin_outs[r].as_ref())).collect();
                self.check_read(cx, layer, ReadKind::PaddedWindow, &got.0, &rows, &models, &got.1)?;
            }
            for (id, m) in models {
                self.reqs.get_mut(&id).unwrap().model = m;
            }
            done += l;
        }
        Ok(done)
    }

    /// Every batch row's twin reads its request's next `len` positions (the same K/V/Q the row got); outputs in row
    /// order.
    fn twin_reads(&mut self, roster: &Roster, layer: usize, len: usize, how: TwinRead) -> Res<Vec<Array>> {
        let scale = self.cfg.scale();
        let mut outs = vec![];
        for id in roster.rows().to_vec() {
            let one = vec![self.next_toks(id, len)];
            let (k, v, q) = self.kvq(layer, &one)?;
            let twin = &mut self.reqs.get_mut(&id).unwrap().twin[layer];
            let out = match how {
                TwinRead::Decode => twin.decode(&k, &v, &q, scale, &Masks::new()).map(|o| o.0),
                TwinRead::Window => twin.window(&k, &v, &q, scale, &Masks::new()).map(|o| o.0),
                TwinRead::Span => twin.commit_span(&k, &v, &q, scale, &Masks::new()),
            };
            outs.push(out.map_err(|e| unexpected(&format!("twin {how:?}"), e))?);
        }
        Ok(outs)
    }

    /// One decode of the running batch: the ordinary batched decode, or (`compiled`) the batched compiled step
    /// (`prepare_rows_step`, the closure inputs with the forward's mask, `rows_decode_step`, `apply_rows_step`),
    /// checked alike: every row's output against its twin's ordinary decode (bytes) and the model (f64), its mask
    /// against the model's visibility, and the state after the op.
    pub(super) fn batch_step(&mut self, cx: &mut Cx<'_>, compiled: bool) -> Res<bool> {
        let roster = cx.roster;
        if roster.rows().is_empty() {
            return Ok(false);
        }
        let scale = self.cfg.scale();
        let toks: Vec<Vec<Option<Tok>>> = roster.rows().iter().map(|&id| self.next_toks(id, 1)).collect();
        let mut models = BTreeMap::new();
        for &id in roster.rows() {
            let mut m = self.reqs[&id].model.clone();
            m.decode_write(Tok { req: id, pos: m.offset as u32 });
            models.insert(id, m);
        }
        let rope_before = self.batch[0].rope_offsets();
        let rope_values = rope_before.values();
        // One memo for the forward: every layer reads the same geometry, built once (checked after the layers).
        let masks = Masks::new();
        for layer in 0..self.cfg.layers {
            let (k, v, q) = self.kvq(layer, &toks)?;
            let got = if compiled {
                self.compiled_rows_step(layer, &k, &v, &q, &masks)?
            } else {
                self.batch[layer].decode(&k, &v, &q, scale, &masks).map_err(|e| unexpected("decode", e))?
            };
            let twin_outs = self.twin_reads(roster, layer, 1, TwinRead::Decode)?;
            if cx.observer.wants_calls() {
                let offsets = self.row_extents(roster);
                emit(
                    cx,
                    Call::Batch {
                        layer,
                        read: Read::Decode,
                        reqs: roster.rows(),
                        rows: &offsets,
                        k: &k,
                        v: &v,
                        q: Some(&q),
                        out: Some(&got.0),
                        mask: Some(&got.1),
                        twins: &twin_outs,
                    },
                )?;
            }
            let rows: Vec<(usize, u32, Vec<Tok>, Option<&Array>)> = roster
                .rows()
                .iter()
                .enumerate()
                .map(|(r, &id)| (r, id, vec![toks[r][0].unwrap()], Some(&twin_outs[r])))
                .collect();
            self.check_read(cx, layer, ReadKind::Decode, &got.0, &rows, &models, &got.1)?;
        }
        check::rope_snapshot(
            &rope_values,
            &rope_before.values(),
            &roster.rows().iter().map(|id| self.reqs[id].model.offset).collect::<Vec<_>>(),
        )?;
        check::mask_memo("batch decode", &masks.families())?;
        self.counters.mask_memo += 1;
        self.counters.checks += 1;
        if cx.observer.wants_calls() {
            emit(cx, Call::BatchWritten { l: 1 })?;
        }
        self.counters.checks += 1;
        for (id, m) in models {
            self.reqs.get_mut(&id).unwrap().model = m;
        }
        Ok(true)
    }

    pub(super) fn batch_window(&mut self, cx: &mut Cx<'_>, len: usize, read: bool) -> Res<bool> {
        let roster = cx.roster;
        if roster.rows().is_empty() || len == 0 {
            return Ok(false);
        }
        let scale = self.cfg.scale();
        let toks: Vec<Vec<Option<Tok>>> = roster.rows().iter().map(|&id| self.next_toks(id, len)).collect();
        let mut models = BTreeMap::new();
        for (r, &id) in roster.rows().iter().enumerate() {
            let mut m = self.reqs[&id].model.clone();
            m.window_write(&toks[r].iter().flatten().copied().collect::<Vec<_>>());
            models.insert(id, m);
        }
        // One memo for the forward (checked after the layers).
        let masks = Masks::new();
        for layer in 0..self.cfg.layers {
            let (k, v, q) = self.kvq(layer, &toks)?;
            if read {
                let got = self.batch[layer].window(&k, &v, &q, scale, &masks).map_err(|e| unexpected("window", e))?;
                let twin_outs = self.twin_reads(roster, layer, len, TwinRead::Window)?;
                if cx.observer.wants_calls() {
                    let offsets = self.row_extents(roster);
                    emit(
                        cx,
                        Call::Batch {
                            layer,
                            read: Read::Window,
                            reqs: roster.rows(),
                            rows: &offsets,
                            k: &k,
                            v: &v,
                            q: Some(&q),
                            out: Some(&got.0),
                            mask: Some(&got.1),
                            twins: &twin_outs,
                        },
                    )?;
                }
                let rows: Vec<(usize, u32, Vec<Tok>, Option<&Array>)> = roster
                    .rows()
                    .iter()
                    .enumerate()
                    .map(|(r, &id)| (r, id, toks[r].iter().flatten().copied().collect(), Some(&twin_outs[r])))
                    .collect();
                self.check_read(cx, layer, ReadKind::Window, &got.0, &rows, &models, &got.1)?;
            } else {
                self.batch[layer].append(&k, &v).map_err(|e| unexpected("append", e))?;
                if cx.observer.wants_calls() {
                    let offsets = self.row_extents(roster);
                    emit(
                        cx,
                        Call::Batch {
                            layer,
                            read: Read::Append,
                            reqs: roster.rows(),
                            rows: &offsets,
                            k: &k,
                            v: &v,
                            q: None,
                            out: None,
                            mask: None,
                            twins: &[],
                        },
                    )?;
                }
                for &id in roster.rows() {
                    let one = vec![self.next_toks(id, len)];
                    let (tk, tv, _) = self.kvq(layer, &one)?;
                    self.reqs.get_mut(&id).unwrap().twin[layer]
                        .append(&tk, &tv)
                        .map_err(|e| unexpected("twin append", e))?;
                }
            }
        }
        check::mask_memo("batch window", &masks.families())?;
        self.counters.mask_memo += 1;
        self.counters.checks += 1;
        for (id, m) in models {
            self.reqs.get_mut(&id).unwrap().model = m;
        }
        if cx.observer.wants_calls() {
            emit(cx, Call::BatchWritten { l: len })?;
        }
        Ok(true)
    }

    pub(super) fn verify(&mut self, cx: &mut Cx<'_>, gamma: usize, accept: &[u32]) -> Res<bool> {
        let roster = cx.roster;
        if roster.rows().is_empty() || gamma == 0 {
            return Ok(false);
        }
        self.batch_window(cx, gamma, true)?;
        self.check_all(cx)?;
        // The oracle compares the verify window's state before the rollback (a checkpoint of its own).
        self.record_checkpoint(cx)?;
        let rollback: Vec<usize> = (0..roster.rows().len())
            .map(|r| gamma - (accept.get(r).copied().unwrap_or(gamma as u32) as usize).min(gamma))
            .collect();
        let (models, expected) = self.model_trims(roster, &rollback, true);
        let recording = cx.observer.wants_calls();
        let before: Vec<kvsim_cache::RingState> = if recording {
            self.batch.first().map(|b| b.row_states().iter().map(|s| s.ring.clone()).collect()).unwrap_or_default()
        } else {
            vec![]
        };
        let mut first: Option<Result<usize, String>> = None;
        for layer in 0..self.cfg.layers {
            let got = self.batch[layer].trim_rows(&rollback, true);
            if recording && first.is_none() {
                first = Some(
                    got.as_ref().map(|_| rollback.iter().copied().max().unwrap_or(0)).map_err(|e| format!("{e:?}")),
                );
            }
            check::error_matches("verify rollback (trim_rows bypass)", &expected, &got)?;
            for (r, &id) in roster.rows().to_vec().iter().enumerate() {
                let t = self.reqs.get_mut(&id).unwrap().twin[layer].trim(rollback[r], true);
                check::error_matches("twin rollback", &expected, &t.map(|_| ()))?;
            }
        }
        if cx.observer.wants_calls() {
            let offsets: Vec<usize> = before.iter().map(|s| s.offset).collect();
            let after_window = before.iter().zip(&rollback).all(|(s, &n)| s.last_concat.is_some_and(|l| l >= n));
            let live = before.iter().map(|s| s.len).collect();
            let trim =
                TrimInfo { n: rollback.clone(), bypass: true, kvsim: first.unwrap_or(Ok(0)), after_window, live };
            emit(cx, Call::TrimRows { reqs: roster.rows(), offsets: &offsets, trim: &trim })?;
        }
        if expected.is_ok() {
            for (r, (id, m)) in models.into_iter().enumerate() {
                let q = self.reqs.get_mut(&id).unwrap();
                q.model = m;
                let _ = r;
            }
            for (r, id) in roster.rows().to_vec().iter().enumerate() {
                if rollback[r] > 0 {
                    self.reqs.get_mut(id).unwrap().history.rolled_back = true;
                }
            }
        }
        Ok(true)
    }

    /// Layer `layer`'s batch through the batched compiled step: host plan, closure inputs (the mask from the
    /// forward's memo), the pure step, apply. Returns the output and the mask the step read under.
    fn compiled_rows_step(
        &mut self,
        layer: usize,
        k: &Array,
        v: &Array,
        q: &Array,
        masks: &Masks,
    ) -> Res<(Array, kvsim_cache::MaskUse)> {
        let b = &mut self.batch[layer];
        let plan = b.prepare_rows_step().map_err(|e| unexpected("prepare_rows_step", e))?;
        let (mut inputs, used) = b.rows_step_inputs(&plan, masks).map_err(|e| unexpected("rows_step_inputs", e))?;
        inputs.extend([q.clone(), k.clone(), v.clone(), b.rows_rope_input()]);
        let spec = match &used {
            kvsim_cache::MaskUse::Array(s) => Some(&**s),
            _ => None,
        };
        let outputs = kvsim_cache::rows_decode_step(b.storage(), spec, None, self.cfg.scale(), &inputs)
            .map_err(|e| unexpected("rows_decode_step", e))?;
        let out = outputs[0].clone();
        b.apply_rows_step(&plan, outputs).map_err(|e| unexpected("apply_rows_step", e))?;
        Ok((out, used))
    }

    /// A committed read under known spans of unequal per-row lengths (R-TKV-7): row `r` commits `lens[r]`
    /// positions (the op's list cut or padded with 0 to the batch), one decode per position. Each row's outputs at
    /// its real positions against its twin's committed span of its own length (bytes) and the model of each
    /// position's decode read (f64); rows past their span unchanged (the state check after the op).
    pub(super) fn commit_known_spans(&mut self, cx: &mut Cx<'_>, lens: &[u32]) -> Res<bool> {
        let roster = cx.roster;
        let lens: Vec<usize> = (0..roster.rows().len()).map(|r| lens.get(r).copied().unwrap_or(0) as usize).collect();
        let l = lens.iter().copied().max().unwrap_or(0);
        if roster.rows().is_empty() || l == 0 {
            return Ok(false);
        }
        let scale = self.cfg.scale();
        let toks: Vec<Vec<Option<Tok>>> = roster
            .rows()
            .iter()
            .zip(&lens)
            .map(|(&id, &n)| {
                let mut t = self.next_toks(id, n);
                t.resize(l, None);
                t
            })
            .collect();
        let mut models = BTreeMap::new();
        for (r, &id) in roster.rows().iter().enumerate() {
            let mut m = self.reqs[&id].model.clone();
            for t in toks[r].iter().flatten() {
                m.decode_write(*t);
            }
            models.insert(id, m);
        }
        for layer in 0..self.cfg.layers {
            let masks = Masks::new();
            let (k, v, q) = self.kvq(layer, &toks)?;
            let got = self.batch[layer]
                .commit_known_spans(&k, &v, &q, scale, &masks, &lens)
                .map_err(|e| unexpected("commit_known_spans", e))?;
            let mut twin_outs = Vec::with_capacity(lens.len());
            for (&id, &n) in roster.rows().iter().zip(&lens) {
                if n == 0 {
                    twin_outs.push(None);
                    continue;
                }
                let one = vec![self.next_toks(id, n)];
                let (tk, tv, tq) = self.kvq(layer, &one)?;
                let twin = &mut self.reqs.get_mut(&id).unwrap().twin[layer];
                let out =
                    twin.commit_span(&tk, &tv, &tq, scale, &Masks::new()).map_err(|e| unexpected("twin span", e))?;
                twin_outs.push(Some(out));
            }
            let rows: Vec<(usize, u32, Vec<Tok>, Option<&Array>)> = roster
                .rows()
                .iter()
                .enumerate()
                .filter(|(r, _)| lens[*r] > 0)
                .map(|(r, &id)| (r, id, toks[r].iter().flatten().copied().collect(), twin_outs[r].as_ref()))
                .collect();
            self.check_span(cx, layer, &got, &rows)?;
        }
        for (id, m) in models {
            self.reqs.get_mut(&id).unwrap().model = m;
        }
        Ok(true)
    }

    pub(super) fn commit_span(&mut self, cx: &mut Cx<'_>, len: usize) -> Res<bool> {
        let roster = cx.roster;
        if roster.rows().is_empty() || len == 0 {
            return Ok(false);
        }
        let scale = self.cfg.scale();
        let toks: Vec<Vec<Option<Tok>>> = roster.rows().iter().map(|&id| self.next_toks(id, len)).collect();
        let mut models = BTreeMap::new();
        for (r, &id) in roster.rows().iter().enumerate() {
            let mut m = self.reqs[&id].model.clone();
            for t in toks[r].iter().flatten() {
                m.decode_write(*t);
            }
            models.insert(id, m);
        }
        for layer in 0..self.cfg.layers {
            let masks = Masks::new();
            let (k, v, q) = self.kvq(layer, &toks)?;
            let got =
                self.batch[layer].commit_span(&k, &v, &q, scale, &masks).map_err(|e| unexpected("commit_span", e))?;
            let twin_outs = self.twin_reads(roster, layer, len, TwinRead::Span)?;
            if cx.observer.wants_calls() {
                let offsets = self.row_extents(roster);
                let (reqs, rows, twins) = (roster.rows(), &offsets, &twin_outs[..]);
                emit(cx, Call::BatchSpan { layer, reqs, rows, k: &k, v: &v, q: &q, out: &got, twins })?;
            }
            // Outputs: compared with the twin (bytes) and the f64 model of each position's decode read.
            let rows: Vec<(usize, u32, Vec<Tok>, Option<&Array>)> = roster
                .rows()
                .iter()
                .enumerate()
                .map(|(r, &id)| (r, id, toks[r].iter().flatten().copied().collect(), Some(&twin_outs[r])))
                .collect();
            self.check_span(cx, layer, &got, &rows)?;
        }
        for (id, m) in models {
            self.reqs.get_mut(&id).unwrap().model = m;
        }
        if cx.observer.wants_calls() {
            emit(cx, Call::BatchWritten { l: len })?;
        }
        Ok(true)
    }
}
