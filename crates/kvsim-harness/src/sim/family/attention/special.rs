//! The attention family's special reads on a request outside the batch: DiffusionGemma's `read_block`, Gemma 4's
//! `bidir_prefill`, and one decode step through the compiled-decode protocol (`compiled_step`).

use super::{emit, mlx_fail, unexpected, Attention, Res};
use crate::sim::check::{self, Failure};
use crate::sim::family::Cx;
use crate::sim::observe::{Call, Read};
use kvsim_cache::bytes::ArrayBytes;
use kvsim_cache::{decode_step, CacheError, CompiledDecode, DecodePhase, Masks};
use kvsim_reference::{bidirectional_visible, read_block_context, Tok};

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
            if cx.observer.wants_calls() {
                // The compiled step is a decode (checked byte-identical to the ordinary append below): observers see
                // the ordinary decode call.
                let offset = model_after.offset - 1;
                let call =
                    Call::Solo { req, layer, read: Read::Decode, k: &k, v: &v, q: Some(&q), out: Some(&out), offset };
                emit(cx, call)?;
            }
            let (tw, _) =
                r.twin[layer].decode(&k, &v, &q, scale, &Masks::new()).map_err(|e| unexpected("twin decode", e))?;
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
