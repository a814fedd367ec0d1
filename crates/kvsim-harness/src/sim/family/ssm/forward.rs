//! The recurrent family's forward passes: a window (or decode) on every batch row and on a request outside the
//! batch, every layer, with each row's outputs checked against its twin (bytes) and the f64 model (ULPs), and the
//! guarantees table's counts.

use mlx_rs::Dtype;

use super::{emit, mlx, pick, same_slice, words, worst_ulp, Cache, LayerDef, Recurrent, Res, RowIn, Rows, SCALE};
use crate::sim::check::{self, Failure};
use crate::sim::family::Cx;
use crate::sim::observe::{Call, Read};
use kvsim_cache::bytes::ArrayBytes;
use kvsim_cache::{Masks, SerialCache, SsmCache};
use kvsim_reference::{SsmRowModel, SsmToken, SsmWeights};

impl Recurrent {
    // ----- reads -----------------------------------------------------------------------------------------------

    /// Outputs of one row vs the twin's (bytes) and the model (ULPs): `yb` holds `[.., s, Hv*Dv]` row-major, the row's
    /// real positions start at word `base`; `tb` is the twin's output over exactly those positions.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn check_row_output(
        &mut self,
        layer: u32,
        what: &str,
        yb: &ArrayBytes,
        base: usize,
        tb: &ArrayBytes,
        model: &mut SsmRowModel,
        weights: &SsmWeights,
        tokens: &[SsmToken],
    ) -> Res {
        let dtype = self.dtype();
        self.counters.checks += 1;
        if !same_slice(yb, base, tb) {
            return crate::sim::check::fail(Failure::new(
                "ssm_output_vs_twin",
                format!("layer {layer} {what}: outputs at real positions differ from the solo run"),
            ));
        }
        self.record("ssm_output_vs_twin", 1);
        let per = self.set.dims.heads_v * self.set.dims.dv;
        for (t, tok) in tokens.iter().enumerate() {
            let e = model.step(weights, tok);
            let w = worst_ulp(yb, base + t * per, &e, dtype);
            let r = &mut self.counters.recurrent;
            r.model_max_ulp_output = r.model_max_ulp_output.max(w);
            self.counters.checks += 1;
            if w > self.bound() {
                return crate::sim::check::fail(Failure::new(
                    "ssm_output_vs_model",
                    format!("layer {layer} {what} position {t}: {w:.1} ULPs from the f64 model"),
                ));
            }
        }
        Ok(())
    }

    /// `n` byte-identical comparisons of class `class` (the family's guarantees table and `bit_exact`).
    /// A comparison that is measured, not promised (a batch's attention output on a GPU outside exact mode): counted
    /// in the class whether or not the bytes agree, with the distance in ULPs at output scale when they do not.
    pub(super) fn record_measured(&mut self, class: &str, out: &ArrayBytes, twin: &ArrayBytes) {
        let dt = if self.dtype() == Dtype::Bfloat16 { "bf16" } else { "f32" };
        let worst = check::max_ulp_at_scale(out, twin);
        let e = self.counters.table.entry(format!("{class}/{dt}")).or_default();
        e.compared += 1;
        if worst == 0 {
            e.bit_exact += 1;
            self.counters.bit_exact_state += 1;
        } else {
            e.max_ulp = e.max_ulp.max(worst);
        }
    }

    pub(super) fn record(&mut self, class: &str, n: u64) {
        let dt = if self.dtype() == Dtype::Bfloat16 { "bf16" } else { "f32" };
        let e = self.counters.table.entry(format!("{class}/{dt}")).or_default();
        e.compared += n;
        e.bit_exact += n;
        self.counters.bit_exact_state += n;
    }

    /// A window of `s` positions on every batch row, every layer: row `r` has real positions `real[r]`; with
    /// `draft`, a verify window whose row `r` accepts `draft[r]` (the models step only those). Twins run each
    /// row's real part (inside a round of their own when `draft`).
    pub(super) fn batch_forward(
        &mut self,
        cx: &mut Cx<'_>,
        s: usize,
        real: &[(usize, usize)],
        draft: Option<&[usize]>,
    ) -> Res {
        let roster = cx.roster;
        let rows: Vec<RowIn> = roster
            .rows()
            .iter()
            .enumerate()
            .map(|(r, id)| (*id as u64, self.reqs[id].pos, real[r].0, real[r].1))
            .collect();
        let masks = Masks::new();
        let per = self.set.dims.heads_v * self.set.dims.dv;
        for li in 0..self.layers.len() {
            let idx = li as u32;
            match &self.layers[li] {
                LayerDef::DeltaNet { params, weights } => {
                    let (params, weights) = (params.clone(), weights.clone());
                    let [q, a, b] = self.ssm_inputs(idx, &rows, s, draft);
                    let Rows::Ssm(batch) = &mut self.batch[li] else { unreachable!() };
                    let decode = s == 1 && draft.is_none() && batch.padding().is_none();
                    let y = if decode { batch.decode(&q, &a, &b, &params) } else { batch.window(&q, &a, &b, &params) }
                        .map_err(|e| mlx("ssm window", e))?;
                    if cx.observer.wants_calls() {
                        let read = if decode { Read::Decode } else { Read::Window };
                        let reqs = roster.rows().to_vec();
                        emit(
                            cx,
                            Call::SsmCall {
                                req: None,
                                layer: li,
                                read,
                                reqs: &reqs,
                                qkv: &q,
                                a: &a,
                                b: &b,
                                out: &y,
                                spans: real,
                            },
                        )?;
                    }
                    let yb = words(&y)?;
                    cx.hasher.update(&yb.digest());
                    for (r, &(st, en)) in real.iter().enumerate() {
                        if en == st {
                            continue;
                        }
                        let id = roster.rows()[r];
                        let n_model = draft.map_or(en - st, |k| k[r]);
                        let tokens = self.tokens(idx, id as u64, rows[r].1, n_model);
                        let req = self.reqs.get_mut(&id).unwrap();
                        let Cache::Ssm(twin) = &mut req.twin[li] else { unreachable!() };
                        if draft.is_some() {
                            twin.spec_round_begin().map_err(|e| mlx("twin begin", e))?;
                        }
                        let (pq, pa, pb) = (pick(&q, r, st, en, 1)?, pick(&a, r, st, en, 1)?, pick(&b, r, st, en, 1)?);
                        let ty = twin.window(&pq, &pa, &pb, &params).map_err(|e| mlx("twin window", e))?;
                        let tb = words(&ty)?;
                        let mut model = req.models[li].take().unwrap();
                        let got = self.check_row_output(
                            idx,
                            &format!("row {r}"),
                            &yb,
                            (r * s + st) * per,
                            &tb,
                            &mut model,
                            &weights,
                            &tokens,
                        );
                        self.reqs.get_mut(&id).unwrap().models[li] = Some(model);
                        got?;
                    }
                }
                LayerDef::Attention { .. } => {
                    let [k, v, q] = self.attn_inputs(idx, &rows, s, draft);
                    let Rows::Attn(batch) = &mut self.batch[li] else { unreachable!() };
                    let decode = s == 1 && draft.is_none() && !batch.is_pending();
                    let (out, _) = if decode {
                        batch.decode(&k, &v, &q, SCALE, &masks)
                    } else {
                        batch.window(&k, &v, &q, SCALE, &masks)
                    }
                    .map_err(|e| mlx("attention read", e))?;
                    cx.hasher.update(&words(&out)?.digest());
                    for (r, &(st, en)) in real.iter().enumerate() {
                        if en == st {
                            continue;
                        }
                        let id = roster.rows()[r];
                        let Cache::Attn(twin) = &mut self.reqs.get_mut(&id).unwrap().twin[li] else { unreachable!() };
                        let (pk, pv, pq) = (pick(&k, r, st, en, 2)?, pick(&v, r, st, en, 2)?, pick(&q, r, st, en, 2)?);
                        let (to, _) = if decode {
                            twin.decode(&pk, &pv, &pq, SCALE, &Masks::new())
                        } else {
                            twin.window(&pk, &pv, &pq, SCALE, &Masks::new())
                        }
                        .map_err(|e| mlx("twin attention read", e))?;
                        // Attention outputs of padded reads are measured by the attention family; here the set's
                        // attention layers are checked by their state bytes (check_state).
                        self.record_measured(
                            "hybrid_attention_output_vs_twin",
                            &words(&pick(&out, r, st, en, 2)?)?,
                            &words(&to)?,
                        );
                    }
                }
            }
        }
        // The forward's attention layers shared one mask memo: each family built once.
        check::mask_memo("hybrid batch forward", &masks.families())?;
        self.counters.mask_memo += 1;
        self.counters.checks += 1;
        Ok(())
    }

    /// `s` positions of request `id` outside the batch, every layer (`decode`: the decode path).
    pub(super) fn solo_forward(&mut self, cx: &mut Cx<'_>, id: u32, s: usize, decode: bool) -> Res {
        let p0 = self.reqs[&id].pos;
        let rows = [(id as u64, p0, 0, s)];
        for li in 0..self.layers.len() {
            let idx = li as u32;
            match &self.layers[li] {
                LayerDef::DeltaNet { params, weights } => {
                    let (params, weights) = (params.clone(), weights.clone());
                    let [q, a, b] = self.ssm_inputs(idx, &rows, s, None);
                    let tokens = self.tokens(idx, id as u64, p0, s);
                    let req = self.reqs.get_mut(&id).unwrap();
                    let (Cache::Ssm(prod), Cache::Ssm(twin)) = (&mut req.solo[li], &mut req.twin[li]) else {
                        unreachable!()
                    };
                    let call = |c: &mut SsmCache| {
                        if decode {
                            c.decode(&q, &a, &b, &params)
                        } else {
                            c.window(&q, &a, &b, &params)
                        }
                    };
                    let y = call(prod).map_err(|e| mlx("solo call", e))?;
                    let ty = call(twin).map_err(|e| mlx("twin call", e))?;
                    if cx.observer.wants_calls() {
                        let read = if decode { Read::Decode } else { Read::Window };
                        emit(
                            cx,
                            Call::SsmCall {
                                req: Some(id),
                                layer: li,
                                read,
                                reqs: &[id],
                                qkv: &q,
                                a: &a,
                                b: &b,
                                out: &y,
                                spans: &[(0, s)],
                            },
                        )?;
                    }
                    let (yb, tb) = (words(&y)?, words(&ty)?);
                    cx.hasher.update(&yb.digest());
                    let mut model = req.models[li].take().unwrap();
                    let got = self.check_row_output(idx, "solo", &yb, 0, &tb, &mut model, &weights, &tokens);
                    self.reqs.get_mut(&id).unwrap().models[li] = Some(model);
                    got?;
                }
                LayerDef::Attention { .. } => {
                    let [k, v, q] = self.attn_inputs(idx, &rows, s, None);
                    let req = self.reqs.get_mut(&id).unwrap();
                    let (Cache::Attn(prod), Cache::Attn(twin)) = (&mut req.solo[li], &mut req.twin[li]) else {
                        unreachable!()
                    };
                    let call = |c: &mut SerialCache| {
                        if decode {
                            c.decode(&k, &v, &q, SCALE, &Masks::new())
                        } else {
                            c.window(&k, &v, &q, SCALE, &Masks::new())
                        }
                    };
                    let (o, _) = call(prod).map_err(|e| mlx("solo attention", e))?;
                    let (to, _) = call(twin).map_err(|e| mlx("twin attention", e))?;
                    let ob = words(&o)?;
                    cx.hasher.update(&ob.digest());
                    self.counters.checks += 1;
                    if ob != words(&to)? {
                        return crate::sim::check::fail(Failure::new(
                            "hybrid_output_vs_twin",
                            format!("layer {li}: solo read differs"),
                        ));
                    }
                    self.record("hybrid_attention_output_vs_twin", 1);
                }
            }
        }
        self.reqs.get_mut(&id).unwrap().pos += s;
        Ok(())
    }
}
