//! The attention family's special reads: DiffusionGemma's `read_block` and Gemma 4's `bidir_prefill` on a request
//! outside the batch, DiffusionGemma's `encoder_read` on such a request or on every row of the running batch, and
//! one decode step through the compiled-decode protocol (`compiled_step`).

use std::collections::BTreeMap;

use mlx_rs::Array;

use super::{emit, mlx_fail, unexpected, Attention, Res};
use crate::sim::check::{self, Failure, ReadKind};
use crate::sim::family::Cx;
use crate::sim::observe::{Call, Read};
use kvsim_cache::bytes::ArrayBytes;
use kvsim_cache::{decode_step, CacheError, CompiledDecode, DecodePhase, MaskUse, Masks};
use kvsim_reference::{bidirectional_visible, encoder_visible, read_block_context, RowModel, Tok};

impl Attention {
    // ----- special reads and the compiled step (R-ROT-9, R-C-9) -------------------------------------------------

    /// DiffusionGemma's canvas read on a request outside the batch: `len` block positions (tokens of request
    /// `u32::MAX - req`, so they never alias a stored position) attend the stored context and the whole block.
    /// Nothing is stored: `check_all` after the op proves every state unchanged.
    pub(super) fn solo_read_block(&mut self, cx: &mut Cx<'_>, req: u32, len: usize) -> Res<bool> {
        let roster = cx.roster;
        if !roster.is_solo(req) || len == 0 {
            return Ok(false);
        }
        let model = self.reqs[&req].model.clone();
        let off = model.offset as u32;
        let block: Vec<Tok> = (0..len as u32).map(|i| Tok { req: u32::MAX - req, pos: off + i }).collect();
        let mut keys = read_block_context(&model);
        // The context is stored (quantized, for affine storage); the block is attended as given.
        let stored = keys.len();
        keys.extend(&block);
        let scale = self.cfg.scale();
        for layer in 0..self.cfg.layers {
            let (k, v, q) = self.kvq(layer, &[block.iter().copied().map(Some).collect()])?;
            let r = &self.reqs[&req];
            let (out, _) = r.solo[layer].read_block(&k, &v, &q, scale).map_err(|e| unexpected("read_block", e))?;
            let (tw, _) = r.twin[layer].read_block(&k, &v, &q, scale).map_err(|e| unexpected("twin read_block", e))?;
            let read = ArrayBytes::read_many(&[&out, &tw]).map_err(|e| mlx_fail("read output", e))?;
            cx.hasher.update(&read[0].digest());
            for (i, t) in block.iter().enumerate() {
                self.out_vs_model(layer as u32, *t, &keys, stored, scale, &read[0], 0, i)?;
            }
            check::output_vs_twin(
                check::OutClass::Window,
                &["read_block"],
                &read[0],
                0,
                &read[1],
                len,
                &mut self.counters,
            )?;
        }
        Ok(true)
    }

    /// Gemma 4's vision prefill on a request outside the batch: only at offset 0; at any other offset production
    /// must refuse with `NotAtOffsetZero` and change nothing (the model predicts the refusal).
    pub(super) fn bidir_prefill(&mut self, cx: &mut Cx<'_>, req: u32, len: usize, image_bits: u64) -> Res<bool> {
        let roster = cx.roster;
        if !roster.is_solo(req) || len == 0 {
            return Ok(false);
        }
        let image: Vec<bool> = (0..len).map(|i| i < 64 && image_bits >> i & 1 == 1).collect();
        let model = self.reqs[&req].model.clone();
        let toks = self.next_toks(req, len);
        let scale = self.cfg.scale();
        let max_size = self.max_size();
        if model.offset > 0 {
            for layer in 0..self.cfg.layers {
                let (k, v, q) = self.kvq(layer, &[toks.clone()])?;
                let r = self.reqs.get_mut(&req).unwrap();
                match r.solo[layer].bidir_prefill(&k, &v, &q, &image, scale, &Masks::new()) {
                    Err(CacheError::NotAtOffsetZero { offset, .. }) if offset == model.offset => {}
                    other => {
                        return Err(Failure::new(
                            "errors",
                            format!(
                                "bidir_prefill at offset {}: expected NotAtOffsetZero, got {:?}",
                                model.offset,
                                other.err()
                            ),
                        ))
                    }
                }
                self.counters.expected_errors += 1;
            }
            return Ok(true);
        }
        let real: Vec<Tok> = toks.iter().map(|t| t.unwrap()).collect();
        let mut model_after = model.clone();
        model_after.window_write(&real);
        let masks = Masks::new();
        for layer in 0..self.cfg.layers {
            let (k, v, q) = self.kvq(layer, &[toks.clone()])?;
            let r = self.reqs.get_mut(&req).unwrap();
            let (out, _) = r.solo[layer]
                .bidir_prefill(&k, &v, &q, &image, scale, &masks)
                .map_err(|e| unexpected("bidir_prefill", e))?;
            let (tw, _) = r.twin[layer]
                .bidir_prefill(&k, &v, &q, &image, scale, &Masks::new())
                .map_err(|e| unexpected("twin bidir_prefill", e))?;
            let read = ArrayBytes::read_many(&[&out, &tw]).map_err(|e| mlx_fail("read output", e))?;
            cx.hasher.update(&read[0].digest());
            for (i, t) in real.iter().enumerate() {
                let keys: Vec<Tok> = bidirectional_visible(&image, max_size, i).into_iter().map(|j| real[j]).collect();
                self.out_vs_model(layer as u32, *t, &keys, keys.len(), scale, &read[0], 0, i)?;
            }
            check::output_vs_twin(
                check::OutClass::Window,
                &["bidir_prefill"],
                &read[0],
                0,
                &read[1],
                len,
                &mut self.counters,
            )?;
        }
        if masks.builds() != 1 {
            crate::sim::check::fail(Failure::new(
                "mask_memo",
                format!("bidirectional mask built {} times in one forward", masks.builds()),
            ))?;
        }
        self.reqs.get_mut(&req).unwrap().model = model_after;
        Ok(true)
    }

    /// DiffusionGemma's vision-encoder read on a request outside the batch: `len` positions appended by the window
    /// rule and attended under the encoder's own `window`. Checked per layer: the mask against the reference's
    /// `encoder_visible`, every query against the f64 model over those keys, the output against the solo twin's
    /// `encoder_read`; one mask build for the forward (`mask_memo`); the stored state by `check_all` after the op.
    /// Observers see the write as the append it is (mlx-lm has no encoder read: its output is not described).
    pub(super) fn solo_encoder_read(
        &mut self,
        cx: &mut Cx<'_>,
        req: u32,
        len: usize,
        window: Option<usize>,
    ) -> Res<bool> {
        let roster = cx.roster;
        if !roster.is_solo(req) || len == 0 {
            return Ok(false);
        }
        let toks = self.next_toks(req, len);
        let real: Vec<Tok> = toks.iter().flatten().copied().collect();
        let offset_before = self.reqs[&req].model.offset;
        let mut model_after = self.reqs[&req].model.clone();
        model_after.window_write(&real);
        let scale = self.cfg.scale();
        // One memo for the forward: every layer reads the same geometry, built once (checked after the layers).
        let masks = Masks::new();
        for layer in 0..self.cfg.layers {
            let (k, v, q) = self.kvq(layer, &[toks.clone()])?;
            let r = self.reqs.get_mut(&req).unwrap();
            let (out, used) = r.solo[layer]
                .encoder_read(&k, &v, &q, scale, window, &masks)
                .map_err(|e| unexpected("encoder_read", e))?;
            if cx.observer.wants_calls() {
                let call = Call::Solo {
                    req,
                    layer,
                    read: Read::Append,
                    k: &k,
                    v: &v,
                    q: None,
                    out: None,
                    offset: offset_before,
                    mask: None,
                    twin: None,
                };
                emit(cx, call)?;
            }
            let r = self.reqs.get_mut(&req).unwrap();
            let (tw, _) = r.twin[layer]
                .encoder_read(&k, &v, &q, scale, window, &Masks::new())
                .map_err(|e| unexpected("twin encoder_read", e))?;
            let models = BTreeMap::from([(req, model_after.clone())]);
            self.check_encoder(cx, layer, &out, &used, &[(0, req, real.clone(), tw)], &models, window)?;
        }
        check::mask_memo("encoder read", &masks.families())?;
        self.counters.checks += 1;
        self.reqs.get_mut(&req).unwrap().model = model_after;
        Ok(true)
    }

    /// [`Attention::solo_encoder_read`] on every row of the running batch (`RowBatch::encoder_read`, rows of
    /// different history lengths under one per-row mask); each row's twin makes its own solo `encoder_read` of the
    /// row's block.
    pub(super) fn batch_encoder_read(&mut self, cx: &mut Cx<'_>, len: usize, window: Option<usize>) -> Res<bool> {
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
        let masks = Masks::new();
        for layer in 0..self.cfg.layers {
            let (k, v, q) = self.kvq(layer, &toks)?;
            let (out, used) = self.batch[layer]
                .encoder_read(&k, &v, &q, scale, window, &masks)
                .map_err(|e| unexpected("batch encoder_read", e))?;
            if cx.observer.wants_calls() {
                let offsets = self.row_extents(roster);
                let call = Call::Batch {
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
                };
                emit(cx, call)?;
            }
            let mut rows = vec![];
            for (r, &id) in roster.rows().iter().enumerate() {
                let (tk, tv, tq) = self.kvq(layer, &[toks[r].clone()])?;
                let (tw, _) = self.reqs.get_mut(&id).unwrap().twin[layer]
                    .encoder_read(&tk, &tv, &tq, scale, window, &Masks::new())
                    .map_err(|e| unexpected("twin encoder_read", e))?;
                rows.push((r, id, toks[r].iter().flatten().copied().collect(), tw));
            }
            self.check_encoder(cx, layer, &out, &used, &rows, &models, window)?;
        }
        check::mask_memo("batch encoder read", &masks.families())?;
        self.counters.checks += 1;
        for (id, m) in models {
            self.reqs.get_mut(&id).unwrap().model = m;
        }
        if cx.observer.wants_calls() {
            emit(cx, Call::BatchWritten { l: len })?;
        }
        Ok(true)
    }

    /// One layer of an encoder read: for each `(row, request, block tokens, twin output)`, every block query's mask
    /// row against the reference's `encoder_visible` over the row's state after the append (`models`), its output
    /// against the f64 model over those keys, and the row's output against the twin's (bytes; recorded under
    /// `encoder_read` in the guarantees table).
    #[allow(clippy::too_many_arguments)]
    fn check_encoder(
        &mut self,
        cx: &mut Cx<'_>,
        layer: usize,
        out: &Array,
        used: &MaskUse,
        rows: &[(usize, u32, Vec<Tok>, Array)],
        models: &BTreeMap<u32, RowModel>,
        window: Option<usize>,
    ) -> Res<()> {
        let mut to_read = vec![out];
        to_read.extend(rows.iter().map(|r| &r.3));
        let read = ArrayBytes::read_many(&to_read).map_err(|e| mlx_fail("read output", e))?;
        cx.hasher.update(&read[0].digest());
        let width = rows.iter().map(|(_, id, _, _)| models[id].cols.len()).max().unwrap_or(0);
        let scale = self.cfg.scale();
        for (n, (row, id, block, _)) in rows.iter().enumerate() {
            let model = &models[id];
            for (i, t) in block.iter().enumerate() {
                let visible = encoder_visible(model, block.len(), window, i);
                // The encoder's window, not the cache's, decides what this query sees: a mask built from the
                // cache's `max_size` (or capped by it) would differ here.
                if visible != encoder_visible(model, block.len(), self.max_size(), i)
                    && !self.reached.contains(&"encoder_read/window_decides")
                {
                    self.reached.push("encoder_read/window_decides");
                }
                check::mask_row(used, *row, i, &visible, block.len(), width, ReadKind::Window).map_err(|mut f| {
                    f.message = format!("encoder read (window {window:?}): {}", f.message);
                    f
                })?;
                self.counters.checks += 1;
                let keys: Vec<Tok> = visible.iter().map(|&c| model.cols[c]).collect();
                self.out_vs_model(layer as u32, *t, &keys, keys.len(), scale, &read[0], *row, i)?;
            }
            let mut tags = self.tags(*id, model);
            tags.push("encoder_read");
            check::output_vs_twin(
                check::OutClass::Window,
                &tags,
                &read[0],
                *row,
                &read[n + 1],
                block.len(),
                &mut self.counters,
            )?;
        }
        Ok(())
    }

    /// One decode step of a request outside the batch through the compiled-decode protocol (plan, pure step of
    /// the family's storage: plain planes or the six affine planes, apply); the twin runs the ordinary decode.
    /// Promised: the plan's fetch equals `decode_phase` and the model's phase, and output and state (every plane)
    /// are byte-identical to the ordinary append (the state check after the op compares the planes with the
    /// twin's and, for affine storage, with the reference's triples).
    pub(super) fn compiled_step(&mut self, cx: &mut Cx<'_>, req: u32) -> Res<bool> {
        let roster = cx.roster;
        if !roster.is_solo(req) {
            return Ok(false);
        }
        let toks = self.next_toks(req, 1);
        let scale = self.cfg.scale();
        let mut model_after = self.reqs[&req].model.clone();
        let ring = model_after.decode_phase_is_ring();
        model_after.decode_write(toks[0].unwrap());
        for layer in 0..self.cfg.layers {
            let (k, v, q) = self.kvq(layer, &[toks.clone()])?;
            let r = self.reqs.get_mut(&req).unwrap();
            let c = &mut r.solo[layer];
            let phase = CompiledDecode::decode_phase(c);
            let plan = CompiledDecode::prepare_decode_step(c).map_err(|e| unexpected("prepare_decode_step", e))?;
            if plan.fetch != phase || (plan.fetch == DecodePhase::Ring) != ring {
                crate::sim::check::fail(Failure::new(
                    "compiled_step",
                    format!("plan {plan:?}, decode_phase {phase:?}, model ring {ring}"),
                ))?;
            }
            let mut inputs = c.step_inputs(&plan).map_err(|e| unexpected("step_inputs", e))?;
            inputs.extend([q.clone(), k.clone(), v.clone(), c.rope_input().map_err(|e| unexpected("rope_input", e))?]);
            let outputs =
                decode_step(self.storage, plan.fetch, None, scale, &inputs).map_err(|e| unexpected("step", e))?;
            let out = outputs[0].clone();
            c.apply_decode_step(&plan, outputs).map_err(|e| unexpected("apply_decode_step", e))?;
            let (tw, _) =
                r.twin[layer].decode(&k, &v, &q, scale, &Masks::new()).map_err(|e| unexpected("twin decode", e))?;
            if cx.observer.wants_calls() {
                // The compiled step is a decode (checked byte-identical to the ordinary append below): observers see
                // the ordinary decode call.
                let offset = model_after.offset - 1;
                let (k, v, q, out) = (&k, &v, Some(&q), Some(&out));
                let call =
                    Call::Solo { req, layer, read: Read::Decode, k, v, q, out, offset, mask: None, twin: Some(&tw) };
                emit(cx, call)?;
            }
            let read = ArrayBytes::read_many(&[&out, &tw]).map_err(|e| mlx_fail("read output", e))?;
            cx.hasher.update(&read[0].digest());
            check::bytes_equal("compiled step output vs the ordinary append", &read[0], &read[1])?;
            self.counters.record_twin(check::OutClass::DecodeUnpadded, &["compiled_step"], read[0].dtype, 0);
            let keys: Vec<Tok> = model_after.decode_visible().iter().map(|&c| model_after.cols[c]).collect();
            self.out_vs_model(layer as u32, toks[0].unwrap(), &keys, keys.len(), scale, &read[0], 0, 0)?;
        }
        self.reqs.get_mut(&req).unwrap().model = model_after;
        Ok(true)
    }
}
