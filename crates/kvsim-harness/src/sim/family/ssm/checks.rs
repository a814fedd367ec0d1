//! The recurrent family's state checks after every op: each row's DeltaNet states against twin and model, the
//! attention layers against their serial twins.

use mlx_rs::Array;

use super::{mlx, same_slice, words, worst_ulp, Cache, Recurrent, Res, Rows};
use crate::sim::check::Failure;
use crate::sim::family::Cx;
use kvsim_cache::bytes::ArrayBytes;

impl Recurrent {
    // ----- state checks ----------------------------------------------------------------------------------------

    /// One row's DeltaNet states (`conv`, `rec` words of this row, offset) against twin and model.
    #[allow(clippy::too_many_arguments)]
    fn check_ssm_row(
        &mut self,
        cx: &mut Cx<'_>,
        li: usize,
        what: &str,
        conv: (&ArrayBytes, usize),
        rec: (&ArrayBytes, usize),
        offset: usize,
        id: u32,
    ) -> Res {
        let req = &self.reqs[&id];
        let (Cache::Ssm(twin), Some(model)) = (&req.twin[li], &req.models[li]) else { unreachable!() };
        self.counters.checks += 1;
        if offset != twin.offsets()[0] || offset != model.offset || offset != req.pos {
            return crate::sim::check::fail(Failure::new(
                "ssm_offsets",
                format!(
                    "layer {li} {what}: production {offset}, twin {}, model {}, fed {}",
                    twin.offsets()[0],
                    model.offset,
                    req.pos
                ),
            ));
        }
        let (tc, tr) = (words(twin.conv())?, words(twin.recurrent())?);
        cx.hasher.update(&tc.digest());
        cx.hasher.update(&tr.digest());
        self.counters.checks += 2;
        if !same_slice(conv.0, conv.1, &tc) {
            return crate::sim::check::fail(Failure::new(
                "ssm_state_vs_twin",
                format!("layer {li} {what}: conv state differs from the solo run"),
            ));
        }
        if !same_slice(rec.0, rec.1, &tr) {
            return crate::sim::check::fail(Failure::new(
                "ssm_state_vs_twin",
                format!("layer {li} {what}: recurrent state differs from the solo run"),
            ));
        }
        let want = model.conv_bits();
        self.counters.checks += 1;
        if !(0..want.len()).all(|i| conv.0.words.get(conv.1 + i) as u32 == want[i]) {
            return crate::sim::check::fail(Failure::new(
                "ssm_conv_vs_model",
                format!("layer {li} {what}: conv tail is not the last K-1 real inputs"),
            ));
        }
        let w = worst_ulp(rec.0, rec.1, &model.state, self.dtype());
        self.counters.recurrent.model_max_ulp_state = self.counters.recurrent.model_max_ulp_state.max(w);
        self.counters.checks += 1;
        if w > self.bound() {
            return crate::sim::check::fail(Failure::new(
                "ssm_state_vs_model",
                format!("layer {li} {what}: recurrent state {w:.1} ULPs from the f64 model"),
            ));
        }
        self.record("ssm_state_vs_twin", 2);
        Ok(())
    }

    fn check_attn(
        &mut self,
        cx: &mut Cx<'_>,
        li: usize,
        what: &str,
        id: u32,
        prod: (kvsim_cache::RingState, Array, Array),
    ) -> Res {
        let Cache::Attn(twin) = &self.reqs[&id].twin[li] else { unreachable!() };
        let pos = self.reqs[&id].pos;
        let (tk, tv) = twin.physical().map_err(|e| mlx("twin", e))?;
        self.counters.checks += 1;
        if &prod.0 != twin.state() || prod.0.offset != pos {
            return crate::sim::check::fail(Failure::new(
                "hybrid_consistency",
                format!("layer {li} {what}: attention state {:?}, twin {:?}, set offset {pos}", prod.0, twin.state()),
            ));
        }
        let (pk, pv) = (words(&prod.1)?, words(&prod.2)?);
        cx.hasher.update(&pk.digest());
        cx.hasher.update(&pv.digest());
        if pk != words(&tk)? || pv != words(&tv)? {
            return crate::sim::check::fail(Failure::new(
                "hybrid_state_vs_twin",
                format!("layer {li} {what}: attention columns differ from the twin"),
            ));
        }
        self.record("hybrid_attention_state_vs_twin", 1);
        Ok(())
    }

    pub(super) fn check_all(&mut self, cx: &mut Cx<'_>) -> Res {
        let roster = cx.roster;
        let n = roster.rows().len();
        for li in 0..self.layers.len() {
            match &self.batch[li] {
                Rows::Ssm(b) => {
                    if b.rows() != n {
                        return crate::sim::check::fail(Failure::new(
                            "rows",
                            format!("layer {li}: {} rows for {n} requests", b.rows()),
                        ));
                    }
                    let (conv, rec) = (words(b.conv())?, words(b.recurrent())?);
                    let offsets = b.offsets().to_vec();
                    let (cw, rw) = (conv.words.len() / n.max(1), rec.words.len() / n.max(1));
                    for r in 0..n {
                        let id = roster.rows()[r];
                        self.check_ssm_row(
                            cx,
                            li,
                            &format!("row {r}"),
                            (&conv, r * cw),
                            (&rec, r * rw),
                            offsets[r],
                            id,
                        )?;
                    }
                }
                Rows::Attn(b) => {
                    let mut prods = vec![];
                    for r in 0..n {
                        let (k, v) = b.row_physical(r).map_err(|e| mlx("row", e))?;
                        prods.push((b.row_states()[r].ring.clone(), k, v));
                    }
                    for (r, p) in prods.into_iter().enumerate() {
                        self.check_attn(cx, li, &format!("row {r}"), roster.rows()[r], p)?;
                    }
                }
            }
        }
        let solo: Vec<u32> = roster.solo().collect();
        for id in solo {
            for li in 0..self.layers.len() {
                match self.reqs[&id].solo[li].clone() {
                    Cache::Ssm(c) => {
                        let (conv, rec) = (words(c.conv())?, words(c.recurrent())?);
                        self.check_ssm_row(
                            cx,
                            li,
                            &format!("request {id}"),
                            (&conv, 0),
                            (&rec, 0),
                            c.offsets()[0],
                            id,
                        )?;
                    }
                    Cache::Attn(c) => {
                        let (k, v) = c.physical().map_err(|e| mlx("solo", e))?;
                        self.check_attn(cx, li, &format!("request {id}"), id, (c.state().clone(), k, v))?;
                    }
                }
            }
        }
        Ok(())
    }
}
