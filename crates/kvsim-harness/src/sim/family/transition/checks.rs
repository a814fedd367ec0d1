//! The transitioning rows' checks: every read against the model (in its own precision) and the twin, and the state
//! check after every op (each lego and row: planes against the twin's and the model's tokens, lifecycle, kinds).

use super::{planes_bytes, unexpected, Res, TransitionFamily, AFFINE_READ_BOUND, BF16_READ_BOUND};
use crate::sim::check::{self, Failure, OutClass};
use crate::sim::family::Cx;
use kvsim_cache as cache;
use kvsim_cache::bytes::ArrayBytes;
use kvsim_cache::transition::Bf16FirstCache;
use kvsim_reference::quant::{attention_f64_quantized, quantized_column};
use kvsim_reference::transition::{LegoModel, Precision, RowRead};
use kvsim_reference::{attention_f64, Tensor, Tok};

impl TransitionFamily {
    /// One read's real queries against the f64 model over what the model says each query sees (bf16 values, or
    /// the dequantized affine ones).
    pub(super) fn read_vs_model(
        &mut self,
        layer: usize,
        out: &ArrayBytes,
        row: usize,
        q0: &[Tok],
        read: &RowRead,
    ) -> Res<()> {
        let (hq, l, d) = (out.shape[1] as usize, out.shape[2] as usize, out.shape[3] as usize);
        let scale = self.cfg.scale() as f64;
        for (i, keys) in read.queries.iter().enumerate() {
            let q = q0[i];
            let (expected, mut bound) = match read.precision {
                Precision::Bf16 => (attention_f64(&self.vs, layer as u32, q, keys, scale), BF16_READ_BOUND),
                Precision::Affine => {
                    (attention_f64_quantized(&self.vs, layer as u32, q, keys, scale, self.rq()), AFFINE_READ_BOUND)
                }
            };
            if self.counters.guarantees.gpu {
                // A GPU's kernels round differently (`check::model_bound`): four times the CPU's measured bound.
                bound *= 4.0;
            }
            let mut worst = 0f64;
            for h in 0..hq {
                for k in 0..d {
                    let found = check::value_of(out.dtype, out.words.get(((row * hq + h) * l + i) * d + k));
                    let e = expected[h * d + k];
                    if !found.is_finite() || !e.is_finite() {
                        return Err(Failure::new("nan", format!("row {row} query {i}: output {found}, model {e}")));
                    }
                    worst = worst.max((found - e).abs() / check::ulp_at(out.dtype, e));
                }
            }
            self.counters.record_model_ulp(out.dtype, worst);
            let tag =
                if read.precision == Precision::Affine { "transition_affine_model" } else { "transition_bf16_model" };
            let e = self.counters.table.entry(format!("{tag}/bf16")).or_default();
            e.compared += 1;
            e.max_ulp = e.max_ulp.max(worst.ceil() as u64);
            self.counters.checks += 1;
            if worst > bound {
                return Err(Failure::new(
                    "output_vs_model",
                    format!(
                        "row {row} query {i} ({q:?}, {:?}): {worst:.1} ULPs from the f64 model over {} keys (bound {bound})",
                        read.precision,
                        keys.len()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// One row's read against its twin's: byte-identical while the row is a serial cache of its own (unpacked) and
    /// for unpadded packed decodes (CPU); measured otherwise.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn read_vs_twin(
        &mut self,
        out: &ArrayBytes,
        row: usize,
        twin: &ArrayBytes,
        n: usize,
        decode: bool,
        packed: bool,
        equal_lens: bool,
    ) -> Res<()> {
        let class = match (decode, !packed || equal_lens) {
            (true, true) => OutClass::DecodeUnpadded,
            (true, false) => OutClass::DecodePadded,
            (false, _) => OutClass::Window,
        };
        let tags: &[&'static str] = if packed { &["transition_packed"] } else { &["transition_rows"] };
        let before = self.counters.table.get(&format!("{}/bf16", tags[0])).map_or(0, |c| c.compared - c.bit_exact);
        check::output_vs_twin(class, tags, out, row, twin, n, &mut self.counters)?;
        let after = self.counters.table.get(&format!("{}/bf16", tags[0])).map_or(0, |c| c.compared - c.bit_exact);
        if !packed && after > before {
            return Err(Failure::new(
                "read_vs_lego",
                format!("row {row}: an unpacked row's read differs from its lego twin's (a row is a serial cache)"),
            ));
        }
        Ok(())
    }

    // ----- state checks ---------------------------------------------------------------------------------------

    /// A lego's (or an extracted row's) stored planes against its twin's (physical order, bytes) and its temporal
    /// view against the model's tokens (bf16 bits, or the quantized triple).
    fn check_lego(
        &mut self,
        cx: &mut Cx<'_>,
        layer: usize,
        what: &str,
        prod: &Bf16FirstCache,
        twin: &Bf16FirstCache,
        m: &LegoModel,
    ) -> Res<()> {
        let phys = planes_bytes(&prod.inner().physical_planes().map_err(|e| unexpected("planes", e))?)?;
        let tphys = planes_bytes(&twin.inner().physical_planes().map_err(|e| unexpected("twin planes", e))?)?;
        if phys.len() != tphys.len() {
            return Err(Failure::new(
                "state_vs_twin",
                format!("{what}: {} planes, the twin {}", phys.len(), tphys.len()),
            ));
        }
        for (i, (a, b)) in phys.iter().zip(&tphys).enumerate() {
            check::bytes_equal(&format!("{what}: plane {i} vs the lego twin"), a, b)?;
            cx.hasher.update(&a.digest());
        }
        let lc = (prod.converted_at(), prod.minimum_reusable_offset(), prod.offset());
        let tc = (twin.converted_at(), twin.minimum_reusable_offset(), twin.offset());
        let mc = (m.row.converted_at, m.row.floor, m.row.offset());
        if lc != mc || tc != mc {
            return Err(Failure::new(
                "lifecycle",
                format!("{what}: (converted_at, floor, offset) production {lc:?}, twin {tc:?}, model {mc:?}"),
            ));
        }
        let view = check::ContractView {
            rows: vec![&m.row.ring],
            trimmable: m.row.ring.is_trimmable(),
            composed: Some(vec![self.storage_kind_of(m.row.converted_at.is_some())]),
        };
        check::contract(what, prod, &view, &mut self.counters)?;
        if prod.max_append_tokens() != m.max_append_tokens() {
            return Err(Failure::new(
                "lifecycle",
                format!(
                    "{what}: max_append_tokens {:?} vs model {:?}",
                    prod.max_append_tokens(),
                    m.max_append_tokens()
                ),
            ));
        }
        check::flag(
            &format!("{what}: affine storage kind"),
            cache::kind::is_quantized(&prod.storage_kind()),
            m.row.converted_at.is_some(),
        )?;
        let want = cache::DelayedKind { max_size: self.max_size(), quant: self.t.quant, start: self.t.start };
        check::flag(
            &format!("{what}: the lego's kind, parsed back"),
            cache::parse_bf16_first(&prod.lego_kind()) == Some(want),
            true,
        )?;
        let toks = m.row.ring.temporal_view();
        let planes = planes_bytes(&prod.inner().temporal_view_planes().map_err(|e| unexpected("temporal", e))?)?;
        self.planes_vs_model(layer, what, &planes, &toks, m.row.converted_at.is_some())?;
        self.counters.record_state(mlx_rs::Dtype::Bfloat16, phys.len() as u64 + 1);
        self.counters.bit_exact_state += phys.len() as u64 + 1;
        self.counters.checks += 1;
        Ok(())
    }

    /// Temporal-view planes `[1, H, n, X]` against the model's tokens: bf16 K, V bits, or the affine triples.
    pub(super) fn planes_vs_model(
        &self,
        layer: usize,
        what: &str,
        planes: &[ArrayBytes],
        toks: &[Tok],
        affine: bool,
    ) -> Res<()> {
        let (vs, q, l) = (self.vs, self.rq(), layer as u32);
        // Plane order: [k, v] (bf16), or [kq, ks, kb, vq, vs, vb] (affine).
        let expect = |p: usize, tok: Tok| -> Vec<u32> {
            if affine {
                let t = if p < 3 { Tensor::K } else { Tensor::V };
                let x = quantized_column(&vs, l, t, tok, q);
                [&x.packed, &x.scales, &x.biases][p % 3].clone()
            } else {
                vs.column_bits(l, if p == 0 { Tensor::K } else { Tensor::V }, tok)
            }
        };
        let n_planes = if affine { 6 } else { 2 };
        if planes.len() != n_planes {
            return Err(Failure::new(
                "state_vs_model",
                format!("{what}: {} planes, expected {n_planes}", planes.len()),
            ));
        }
        for (p, plane) in planes.iter().enumerate() {
            let (h, n, x) = (plane.shape[1] as usize, plane.shape[2] as usize, plane.shape[3] as usize);
            if n != toks.len() {
                return Err(Failure::new(
                    "state_vs_model",
                    format!("{what}: temporal view holds {n} positions, the model {}", toks.len()),
                ));
            }
            for (c, &tok) in toks.iter().enumerate() {
                let e = expect(p, tok);
                for hh in 0..h {
                    for k in 0..x {
                        if plane.words.get((hh * n + c) * x + k) != e[hh * x + k] as u64 {
                            return Err(Failure::new(
                                "state_vs_model",
                                format!("{what}: plane {p} temporal column {c} (token {tok:?}) head {hh} word {k} differs from the model"),
                            ));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// The serial storage kind a row of this family holds: plain (bf16) before its conversion, affine after.
    fn storage_kind_of(&self, converted: bool) -> cache::StorageKind {
        let storage = if converted { cache::Storage::Affine(self.t.quant) } else { cache::Storage::Plain };
        cache::StorageKind::serial_of(self.max_size(), storage)
    }

    pub fn check_all(&mut self, cx: &mut Cx<'_>) -> Res<()> {
        let roster = cx.roster;
        if roster.rows().is_empty() {
            self.rows_stored = false;
        } else if !self.legos && !self.rows_stored {
            let b = self.batch_rows(0)?;
            let mut stored = false;
            for i in 0..b.rows() {
                stored |= b.row_storage(i).map_err(|e| unexpected("row storage", e))?.cap() > 0;
            }
            self.rows_stored = stored;
        }
        // Every request outside the batch; in the lego family every request (its rows are legos too).
        let solo: Vec<u32> = if self.legos { roster.live().collect() } else { roster.solo().collect() };
        self.check_layouts(cx, &solo, roster.rows())?;
        self.check_packed_capacity(roster)
    }

    /// Once the rows have packed into one quantized batch, its capacity guarantee (`check::capacity`) as the
    /// attention family's batch: at most the columns its live rows need (the model's), and its byte accounting the
    /// bytes its planes hold. Unpacked rows are serial caches, each under its own ring's bound.
    fn check_packed_capacity(&mut self, roster: &crate::sim::roster::Roster) -> Res<()> {
        if self.legos || roster.rows().is_empty() {
            return Ok(());
        }
        let lens: Vec<usize> = self.rows_model.rows.iter().map(|r| r.ring.cols.len()).collect();
        for layer in 0..self.cfg.layers {
            let max = self.max_size();
            let rows = self.batch.get(layer).and_then(|b| b.as_ref());
            if let Some(b) = rows.and_then(|r| r.packed_batch()) {
                check::capacity(&format!("packed rows layer {layer}"), b, &lens, max, &mut self.counters)?;
            }
        }
        Ok(())
    }

    /// Every lego of `solo` (in that order), the stored entry, and the running rows, whose requests are `rows`.
    pub(super) fn check_layouts(&mut self, cx: &mut Cx<'_>, solo: &[u32], rows: &[u32]) -> Res<()> {
        for &id in solo {
            let r = self.reqs.remove(&id).unwrap();
            let res = (0..self.cfg.layers).try_for_each(|layer| {
                self.check_lego(
                    cx,
                    layer,
                    &format!("request {id} layer {layer}"),
                    &r.solo[layer],
                    &r.twin[layer],
                    &r.model,
                )
            });
            self.reqs.insert(id, r);
            res?;
        }
        if let Some(st) = self.stored.take() {
            let res = (0..self.cfg.layers).try_for_each(|layer| {
                self.check_lego(
                    cx,
                    layer,
                    &format!("stored entry layer {layer}"),
                    &st.lego[layer],
                    &st.twin[layer],
                    &st.model,
                )
            });
            self.stored = Some(st);
            res?;
        }
        if rows.is_empty() || self.legos {
            return Ok(());
        }
        let m = self.rows_model.clone();
        for layer in 0..self.cfg.layers {
            let b = self.batch_rows(layer)?.clone();
            if b.rows() != m.rows.len() || b.is_packed() != m.packed {
                return Err(Failure::new(
                    "rows",
                    format!(
                        "layer {layer}: {} rows (packed {}), the model {} (packed {})",
                        b.rows(),
                        b.is_packed(),
                        m.rows.len(),
                        m.packed
                    ),
                ));
            }
            let kind = b.storage_kind();
            let parsed = cache::parse_delayed(&kind);
            let want = cache::DelayedKind { max_size: self.max_size(), quant: self.t.quant, start: self.t.start };
            check::flag(
                "storage kind (the model's signature, parsed back)",
                kind.0 == self.ts.signature() && parsed == Some(want),
                true,
            )?;
            if b.minimum_reusable_offset() != m.minimum_reusable_offset()
                || b.max_append_tokens() != m.max_append_tokens()
            {
                return Err(Failure::new(
                    "lifecycle",
                    format!(
                        "layer {layer}: floor {} / max_append_tokens {:?}, the model {} / {:?}",
                        b.minimum_reusable_offset(),
                        b.max_append_tokens(),
                        m.minimum_reusable_offset(),
                        m.max_append_tokens()
                    ),
                ));
            }
            let view = check::ContractView {
                rows: m.rows.iter().map(|r| &r.ring).collect(),
                trimmable: m.round.is_none() && m.rows.iter().all(|r| r.ring.is_trimmable()),
                composed: Some(m.rows.iter().map(|r| self.storage_kind_of(r.converted_at.is_some())).collect()),
            };
            check::contract(&format!("rows layer {layer}"), &b, &view, &mut self.counters)?;
            let offsets = b.offsets();
            for (i, mr) in m.rows.iter().enumerate() {
                let p = b.lifecycle()[i];
                if (p.converted_at, p.floor, p.left_pad, offsets[i])
                    != (mr.converted_at, mr.floor, mr.left_pad, mr.offset())
                {
                    return Err(Failure::new(
                        "lifecycle",
                        format!(
                            "layer {layer} row {i}: (converted_at, floor, left_pad, offset) {:?}, the model {:?}",
                            (p.converted_at, p.floor, p.left_pad, offsets[i]),
                            (mr.converted_at, mr.floor, mr.left_pad, mr.offset())
                        ),
                    ));
                }
                let id = rows[i];
                let twin = self.reqs[&id].twin[layer].clone();
                // The row's planes in physical order against its twin's.
                let planes = planes_bytes(&b.row_physical_planes(i).map_err(|e| unexpected("row planes", e))?)?;
                let tplanes = planes_bytes(&twin.inner().physical_planes().map_err(|e| unexpected("twin planes", e))?)?;
                if planes.len() != tplanes.len() {
                    return Err(Failure::new(
                        "state_vs_twin",
                        format!("row {i}: {} planes vs {}", planes.len(), tplanes.len()),
                    ));
                }
                for (j, (a, t)) in planes.iter().zip(&tplanes).enumerate() {
                    check::bytes_equal(&format!("layer {layer} row {i} plane {j} vs its lego twin"), a, t)?;
                    cx.hasher.update(&a.digest());
                }
                let tc = (twin.converted_at(), twin.minimum_reusable_offset(), twin.offset());
                if tc != (mr.converted_at, mr.floor, mr.offset()) {
                    return Err(Failure::new("lifecycle", format!("layer {layer} row {i}: twin {tc:?} vs the model")));
                }
                // The row handed back to serial use: its temporal view against the model's tokens.
                let back = b.extract(i).map_err(|e| unexpected("extract (check)", e))?;
                let tv = planes_bytes(&back.inner().temporal_view_planes().map_err(|e| unexpected("temporal", e))?)?;
                self.planes_vs_model(
                    layer,
                    &format!("layer {layer} row {i}"),
                    &tv,
                    &mr.ring.temporal_view(),
                    mr.converted_at.is_some(),
                )?;
                self.counters.record_state(mlx_rs::Dtype::Bfloat16, planes.len() as u64 + 1);
                self.counters.bit_exact_state += planes.len() as u64 + 1;
            }
            self.counters.checks += 1;
        }
        Ok(())
    }
}
