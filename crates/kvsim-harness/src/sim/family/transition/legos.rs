//! The serial legos as a family of their own (`bf16-first`; `layouts` keys `kv:bf16-first-quant` and
//! `kv:bf16-first-rotating-quant`, the prefixes of the legos' kinds `kv:bf16-first-quant:<bits>:<group>:<start>` /
//! `kv:bf16-first-rotating-quant:<W>:<bits>:<group>:<start>`).
//!
//! Every request is a serial lego per layer (`Bf16FirstQuantizedKvCache` / `Bf16FirstRotatingQuantizedKvCache`),
//! with its twin (a second lego) and its [`LegoModel`]. The scheduler's batch is only membership here: a batch op
//! is one serial call per row's lego. How the op stream maps:
//! - `SoloWindow`, `SoloDecode`, `Decode`, `Window`, `BatchPrefill` (each fresh request's prompt in chunks of
//!   `chunk`, one window each): appends, so `start` is crossed between appends, inside one multi-token append, and
//!   right after the first append for `start` 0. Each read against the model (f64 over bf16 values, or over the
//!   dequantized affine ones once converted; the family's ULP bounds) and against the twin fed the same call (bytes).
//! - `CommitSpan { len }`: `Bf16FirstCache::commit_span` on every row; the twin takes the ordinary path, one
//!   `decode` per position, and every position's output and the state after must be byte-identical.
//! - `Verify { gamma, accept }`: a lego round (`round_begin`, a verify window, `round_commit` or
//!   `round_rollback(keep)`); a rollback keeping more than the round wrote is tried first and must be
//!   `KeepTooLong` with the lego's bytes and lifecycle unchanged. The twin takes the independent path: a plain
//!   window of the kept positions only (the state a bypass rollback leaves is the state that window leaves), so the
//!   conversion at the round's end must match a conversion at the end of an ordinary append; with nothing kept, the
//!   same round.
//! - `SoloTrim`, `Trim` (every row): the serial trim (R-C-5); a trim below `start` keeps affine storage and the floor
//!   (counted in `trims_below_start`); an impossible trim is the model's typed error with the bytes unchanged.
//! - `Merge`/`Join` (membership only), `Extract` (back outside the batch; `finish` stores the lego as the prefix
//!   cache entry), `Filter`, `PrefixReuse` (as the rows family), `PlainRead` (each lego's dense fetch against its
//!   twin's), `Persist` (as the rows family: the request's legos saved, dropped and restored).
//!
//! After every op every lego's state is checked as the rows family checks its legos (`check_lego`: planes against
//! the twin's in physical order, bytes; temporal view against the model's tokens; lifecycle, `max_append_tokens`,
//! the storage kind and the lego's own kind parsed back).

use super::*;

impl TransitionFamily {
    pub(super) fn apply_legos(&mut self, op: &Op, cx: &mut Cx<'_>) -> Res<bool> {
        let roster = cx.roster;
        match op {
            // Lifecycle ops that change nothing were skipped by the roster, but for an extract of a missing row:
            // no rows layout to ask, the scheduler's out-of-range row changes nothing (checked after the op).
            Op::Admit { .. } | Op::Merge { .. } | Op::Join { .. } | Op::BatchPrefill { .. } | Op::Filter { .. } => {
                Ok(false)
            }
            Op::Extract { .. } => Ok(true),
            Op::SoloWindow { req, len } => self.solo_append(cx, *req, *len as usize, false),
            Op::SoloDecode { req } => self.solo_append(cx, *req, 1, true),
            Op::SoloTrim { req, n, bypass } => {
                if !roster.is_solo(*req) {
                    return Ok(false);
                }
                self.lego_trim(&[*req], *n as usize, *bypass)?;
                Ok(true)
            }
            Op::Decode => self.lego_rows_append(cx, 1, true),
            Op::Window { len } => self.lego_rows_append(cx, *len as usize, false),
            Op::Verify { gamma, accept } => self.lego_verify(cx, *gamma as usize, accept),
            Op::CommitSpan { len } => self.lego_span(cx, *len as usize),
            Op::Trim { n, bypass } => {
                if roster.rows().is_empty() {
                    return Ok(false);
                }
                self.lego_trim(roster.rows(), *n as usize, *bypass)?;
                Ok(true)
            }
            Op::PrefixReuse { common, prompt, extra } => {
                self.prefix_reuse(cx, *common as usize, *prompt as usize, *extra as usize)
            }
            Op::PlainRead => self.lego_dense(cx),
            Op::Fetch { len } => self.lego_fetch(cx, *len as usize),
            Op::Persist { req, mlxlm } => self.persist(cx.roster, *req, *mlxlm),
            Op::TrainingForward { .. } | Op::PrefixSharedForward { .. } | Op::TrainingRefusal { .. } => Ok(true),
            _ => Ok(false),
        }
    }

    /// What a lifecycle op did to the roster: the batch is only membership here, so entering it changes no lego;
    /// a prefill appends each fresh request's prompt in windows of `chunk` positions; a finished request's lego
    /// becomes the prefix-cache entry; filtered-out requests end.
    pub(super) fn lego_carry_out(&mut self, cx: &mut Cx<'_>, change: &Change) -> Res<()> {
        match change {
            Change::Admit { req } => self.admit(*req)?,
            Change::Enter { .. } => {}
            Change::Prefill { ids, lens, chunk, .. } => {
                for (&id, &len) in ids.iter().zip(lens) {
                    let mut done = 0;
                    while done < len {
                        let l = (*chunk).min(len - done);
                        self.lego_append(cx, id, l, false)?;
                        done += l;
                    }
                }
            }
            Change::Extract { req, finish, .. } => {
                if *finish {
                    let r = self.reqs.remove(req).unwrap();
                    self.stored = Some(Stored { lego: r.solo, twin: r.twin, model: r.model });
                }
            }
            Change::Filter { dropped, .. } => {
                for id in dropped {
                    self.reqs.remove(id);
                }
            }
        }
        Ok(())
    }

    fn lego_rows_append(&mut self, cx: &mut Cx<'_>, len: usize, decode: bool) -> Res<bool> {
        let roster = cx.roster;
        if roster.rows().is_empty() || len == 0 {
            return Ok(false);
        }
        for id in roster.rows().to_vec() {
            self.lego_append(cx, id, len, decode)?;
        }
        Ok(true)
    }

    /// A lego's bytes and lifecycle, for "nothing changed" comparisons.
    fn lego_snapshot(lego: &Bf16FirstCache) -> Res<(Vec<ArrayBytes>, (Option<usize>, usize, usize))> {
        let planes = planes_bytes(&lego.inner().physical_planes().map_err(|e| unexpected("planes", e))?)?;
        Ok((planes, (lego.converted_at(), lego.minimum_reusable_offset(), lego.offset())))
    }

    /// The serial trim on each of these requests' legos (R-C-5), against the model's answer.
    fn lego_trim(&mut self, ids: &[u32], n: usize, bypass: bool) -> Res<()> {
        for &id in ids {
            let mut model = self.reqs[&id].model.clone();
            let expected = match model.trim(n, bypass) {
                Ok(()) => Ok(()),
                Err(TransitionError::Model(e)) => Err(e),
                Err(e) => return Err(model_fail("lego trim", e)),
            };
            let below = model.row.converted_at.is_some() && self.t.start.is_some_and(|s| model.row.offset() < s);
            for layer in 0..self.cfg.layers {
                let r = self.reqs.get_mut(&id).unwrap();
                let before = Self::lego_snapshot(&r.solo[layer])?;
                let got = r.solo[layer].trim(n, bypass).map(|_| ());
                check::error_matches("lego trim", &expected, &got)?;
                if expected.is_ok() {
                    let t = r.twin[layer].trim(n, bypass).map(|_| ());
                    check::error_matches("twin trim", &expected, &t)?;
                    if below {
                        check::flag(
                            "a trim below start keeps affine storage",
                            cache::kind::is_quantized(&r.solo[layer].storage_kind()),
                            true,
                        )?;
                        self.counters.trims_below_start += 1;
                    }
                } else {
                    check::flag(
                        "a refused trim changes nothing",
                        Self::lego_snapshot(&r.solo[layer])? == before,
                        true,
                    )?;
                    self.counters.expected_errors += 1;
                }
            }
            self.reqs.get_mut(&id).unwrap().model = model;
        }
        Ok(())
    }

    /// A committed span on every row's lego: one decode per position; the twin decodes position by position.
    fn lego_span(&mut self, cx: &mut Cx<'_>, len: usize) -> Res<bool> {
        let roster = cx.roster;
        if roster.rows().is_empty() || len == 0 {
            return Ok(false);
        }
        let scale = self.cfg.scale();
        let masks = Masks::new();
        for id in roster.rows().to_vec() {
            let mut model = self.reqs[&id].model.clone();
            let toks = Self::toks_from(id, model.row.offset(), len);
            let was = model.row.converted_at;
            let mut reads = Vec::with_capacity(len);
            for t in &toks {
                reads.push(model.append(std::slice::from_ref(t), true).map_err(|e| model_fail("lego span", e))?.0);
            }
            let converted = was.is_none() && model.row.converted_at.is_some();
            for layer in 0..self.cfg.layers {
                let (k, v, q) = self.kvq(layer, std::slice::from_ref(&toks));
                let r = self.reqs.get_mut(&id).unwrap();
                let before = r.solo[layer].converted_at();
                let out = r.solo[layer].commit_span(&k, &v, &q, scale, &masks).map_err(|e| unexpected("span", e))?;
                let did = before.is_none() && r.solo[layer].converted_at().is_some();
                check::flag("lego conversion inside a span vs the model", did, converted)?;
                let mut twin_outs = Vec::with_capacity(len);
                for i in 0..len as i32 {
                    let c = |a: &Array| a.index((.., .., i..i + 1, ..));
                    let (o, _) = r.twin[layer]
                        .decode(&c(&k), &c(&v), &c(&q), scale, &masks)
                        .map_err(|e| unexpected("twin decode", e))?;
                    twin_outs.push(o);
                }
                for (i, tw) in twin_outs.iter().enumerate() {
                    let i32_ = i as i32;
                    let ob = bytes_of(&out.index((.., .., i32_..i32_ + 1, ..)))?;
                    cx.hasher.update(&ob.digest());
                    self.read_vs_model(layer, &ob, 0, &toks[i..i + 1], &reads[i])?;
                    self.read_vs_twin(&ob, 0, &bytes_of(tw)?, 1, true, false, true)?;
                }
                if did {
                    self.counters.conversions += 1;
                }
            }
            self.reqs.get_mut(&id).unwrap().model = model;
        }
        Ok(true)
    }

    /// A lego round per row (module docs).
    fn lego_verify(&mut self, cx: &mut Cx<'_>, gamma: usize, accept: &[u32]) -> Res<bool> {
        let roster = cx.roster;
        if roster.rows().is_empty() || gamma == 0 {
            return Ok(false);
        }
        let scale = self.cfg.scale();
        let masks = Masks::new();
        let rows = roster.rows().to_vec();
        let keeps: Vec<usize> =
            (0..rows.len()).map(|r| (accept.get(r).copied().unwrap_or(gamma as u32) as usize).min(gamma)).collect();
        let mut across_wrap = false;
        for (&id, &keep) in rows.iter().zip(&keeps) {
            let mut model = self.reqs[&id].model.clone();
            model.round_begin().map_err(|e| model_fail("round_begin", e))?;
            let toks = Self::toks_from(id, model.row.offset(), gamma);
            let (read, c) = model.append(&toks, false).map_err(|e| model_fail("verify window", e))?;
            if c {
                return Err(Failure::new("model", "the lego model converted inside an armed round"));
            }
            let Some(want) = model.clone().round_rollback(gamma + 1).err() else {
                return Err(Failure::new("model", "the lego model accepted a rollback keeping more than it wrote"));
            };
            let window_offset = model.row.offset();
            let was = model.row.converted_at;
            if keep == gamma { model.round_commit() } else { model.round_rollback(keep) }
                .map_err(|e| model_fail("round end", e))?;
            let mconv = was.is_none() && model.row.converted_at.is_some();
            across_wrap |= keep < gamma && self.max_size().is_some_and(|w| window_offset > w);
            for layer in 0..self.cfg.layers {
                let (k, v, q) = self.kvq(layer, std::slice::from_ref(&toks));
                let r = self.reqs.get_mut(&id).unwrap();
                let lego = &mut r.solo[layer];
                lego.round_begin().map_err(|e| unexpected("round_begin", e))?;
                let conv_before = lego.converted_at();
                let (out, _) = lego.window(&k, &v, &q, scale, &masks).map_err(|e| unexpected("verify window", e))?;
                check::flag("no lego conversion inside an armed round", lego.converted_at() == conv_before, true)?;
                // Bad input first: keeping more than the round wrote; refused, nothing changed.
                let before = Self::lego_snapshot(lego)?;
                match lego.round_rollback(gamma + 1) {
                    Err(e) if same_error(&e, &want) => {}
                    other => {
                        return Err(Failure::new(
                            "errors",
                            format!(
                                "lego rollback keeping {}: expected {want}, got {:?}",
                                gamma + 1,
                                other.map(|_| ())
                            ),
                        ))
                    }
                }
                check::flag("a refused lego rollback changes nothing", Self::lego_snapshot(lego)? == before, true)?;
                let did = if keep == gamma { lego.round_commit() } else { lego.round_rollback(keep) }
                    .map_err(|e| unexpected("round end", e))?;
                check::flag("lego conversion at the round's end vs the model", did, mconv)?;
                // The twin: a plain window of the kept positions (nothing kept: the same round).
                let twin = &mut r.twin[layer];
                let tw = if keep > 0 {
                    let kk = keep as i32;
                    let c = |a: &Array| a.index((.., .., 0..kk, ..));
                    let (o, _) =
                        twin.window(&c(&k), &c(&v), &c(&q), scale, &masks).map_err(|e| unexpected("twin", e))?;
                    Some(o)
                } else {
                    twin.round_begin().map_err(|e| unexpected("twin round", e))?;
                    twin.window(&k, &v, &q, scale, &masks).map_err(|e| unexpected("twin window", e))?;
                    twin.round_rollback(0).map_err(|e| unexpected("twin rollback", e))?;
                    None
                };
                check::flag(
                    "twin conversion at the end of its window vs the round's end",
                    twin.converted_at().is_some(),
                    lego.converted_at().is_some(),
                )?;
                let ob = bytes_of(&out)?;
                cx.hasher.update(&ob.digest());
                self.read_vs_model(layer, &ob, 0, &toks, &read)?;
                if keep == gamma {
                    // The same window shape: the committed round's read is the twin's plain window read.
                    if let Some(tw) = tw {
                        self.read_vs_twin(&ob, 0, &bytes_of(&tw)?, gamma, false, false, true)?;
                    }
                }
                self.counters.expected_errors += 1;
                if did {
                    self.counters.conversions += 1;
                }
            }
            self.reqs.get_mut(&id).unwrap().model = model;
        }
        if keeps.iter().any(|&k| k != keeps[0]) {
            self.counters.rounds += 1;
        }
        if across_wrap {
            self.counters.rollbacks_across_wrap += 1;
        }
        Ok(true)
    }

    /// Each lego's dense fetch against its twin's (bytes) and, while bf16, against the model's tokens.
    /// The softcapped fetch (R-TKV-4) on each row's lego and its twin (`Bf16FirstCache::fetch` of the same `len`
    /// positions): bytes equal, bf16 bytes against the model's tokens, each conversion against the model's.
    fn lego_fetch(&mut self, cx: &mut Cx<'_>, len: usize) -> Res<bool> {
        let roster = cx.roster;
        if roster.rows().is_empty() || len == 0 {
            return Ok(false);
        }
        for id in roster.rows().to_vec() {
            let mut model = self.reqs[&id].model.clone();
            let bf16 = model.row.converted_at.is_none();
            let toks = Self::toks_from(id, model.row.offset(), len);
            let (_, converted) = model.append(&toks, false).map_err(|e| model_fail("lego fetch", e))?;
            let cols = model.row.ring.cols.clone();
            for layer in 0..self.cfg.layers {
                let (k, v, _) = self.kvq(layer, std::slice::from_ref(&toks));
                let r = self.reqs.get_mut(&id).unwrap();
                let ((lk, lv), did) = r.solo[layer].fetch(&k, &v).map_err(|e| unexpected("lego fetch", e))?;
                let ((tk, tv), twin_did) = r.twin[layer].fetch(&k, &v).map_err(|e| unexpected("twin fetch", e))?;
                check::flag("lego conversion at the fetch vs the model", did, converted)?;
                check::flag("twin conversion at the fetch vs the model", twin_did, converted)?;
                let (kb, vb) = (bytes_of(&lk)?, bytes_of(&lv)?);
                check::bytes_equal("lego fetch keys vs the twin", &kb, &bytes_of(&tk)?)?;
                check::bytes_equal("lego fetch values vs the twin", &vb, &bytes_of(&tv)?)?;
                cx.hasher.update(&kb.digest());
                if bf16 {
                    self.planes_vs_model(layer, &format!("request {id} fetch"), &[kb, vb], &cols, false)?;
                }
                if did {
                    self.counters.conversions += 1;
                }
                self.counters.record_state(mlx_rs::Dtype::Bfloat16, 2);
                self.counters.bit_exact_state += 2;
            }
            self.reqs.get_mut(&id).unwrap().model = model;
        }
        Ok(true)
    }

    fn lego_dense(&mut self, cx: &mut Cx<'_>) -> Res<bool> {
        let roster = cx.roster;
        if roster.rows().is_empty() {
            return Ok(true);
        }
        let ids: Vec<u32> = self.reqs.keys().copied().collect();
        for id in ids {
            for layer in 0..self.cfg.layers {
                let r = &self.reqs[&id];
                let (k, v) = r.solo[layer].dense().map_err(|e| unexpected("dense", e))?;
                let (tk, tv) = r.twin[layer].dense().map_err(|e| unexpected("twin dense", e))?;
                let (kb, vb) = (bytes_of(&k)?, bytes_of(&v)?);
                check::bytes_equal("lego dense keys vs the twin", &kb, &bytes_of(&tk)?)?;
                check::bytes_equal("lego dense values vs the twin", &vb, &bytes_of(&tv)?)?;
                if r.model.row.converted_at.is_none() {
                    let toks = r.model.row.ring.cols.clone();
                    self.planes_vs_model(layer, &format!("request {id} dense fetch"), &[kb.clone(), vb], &toks, false)?;
                }
                cx.hasher.update(&kb.digest());
                self.counters.record_state(mlx_rs::Dtype::Bfloat16, 2);
                self.counters.bit_exact_state += 2;
            }
        }
        Ok(true)
    }
}
