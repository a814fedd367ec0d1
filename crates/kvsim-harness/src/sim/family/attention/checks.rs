//! The attention family's checks: every read against the twins and the model (`check_read`, `check_span`), the
//! state check after every op (`check_all`, `check_storage`, then `check_capacity`), and the observer's checkpoint of
//! every live request.

use std::collections::BTreeMap;

use mlx_rs::Array;

use super::{mlx_fail, unexpected, Attention, Res};
use crate::sim::check::{self, ReadKind};
use crate::sim::family::Cx;
use crate::sim::observe::{RingView, StateView};
use kvsim_cache::bytes::ArrayBytes;
use kvsim_cache::{MaskUse, Storage};
use kvsim_reference::{RowModel, Tensor, Tok};

impl Attention {
    // ----- checks ----------------------------------------------------------------------------------------------

    /// Checks one read: for each `(row, request, real query tokens, twin output)`, the row's output at its real
    /// query positions against the twin's (bytes) and the model (f64, ULPs), and the mask it used against the model.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn check_read(
        &mut self,
        cx: &mut Cx<'_>,
        layer: usize,
        kind: ReadKind,
        out: &Array,
        rows: &[(usize, u32, Vec<Tok>, Option<&Array>)],
        models: &BTreeMap<u32, RowModel>,
        mask: &MaskUse,
    ) -> Res<()> {
        let mut to_read: Vec<&Array> = vec![out];
        to_read.extend(rows.iter().filter_map(|r| r.3));
        let mut read = ArrayBytes::read_many(&to_read).map_err(|e| mlx_fail("read output", e))?.into_iter();
        let out_bytes = read.next().unwrap();
        cx.hasher.update(&out_bytes.digest());
        let l = out.shape()[2] as usize;
        let width = rows.iter().map(|(_, id, _, _)| models[id].cols.len()).max().unwrap_or(0);
        for (row, id, real, twin) in rows {
            let model = &models[id];
            let padded = model.cols.len() < width || real.len() < l;
            let class = kind.class(padded);
            // The mask each real query used must be exactly the model's visibility.
            for (i, q) in real.iter().enumerate() {
                let visible = match kind {
                    ReadKind::Decode => model.decode_visible(),
                    ReadKind::Window | ReadKind::PaddedWindow => model.window_visible(real.len(), i),
                };
                check::mask_row(mask, *row, i, &visible, l, width, kind)?;
                self.counters.checks += 1;
                let keys: Vec<Tok> = visible.iter().map(|&c| model.cols[c]).collect();
                self.out_vs_model(layer as u32, *q, &keys, keys.len(), self.cfg.scale(), &out_bytes, *row, i)?;
            }
            if twin.is_some() {
                let twin_bytes = read.next().unwrap();
                let tags = self.tags(*id, model);
                check::output_vs_twin(class, &tags, &out_bytes, *row, &twin_bytes, real.len(), &mut self.counters)?;
            }
        }
        Ok(())
    }

    /// One query's output against the model: the f64 attention over `keys` (plain storage), or over their
    /// dequantized values (affine storage, where only the first `stored` keys are stored; the others are attended
    /// as given).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn out_vs_model(
        &mut self,
        layer: u32,
        q: Tok,
        keys: &[Tok],
        stored: usize,
        scale: f32,
        out: &ArrayBytes,
        row: usize,
        i: usize,
    ) -> Res<()> {
        match self.storage.quant() {
            None => check::output_vs_model(&self.vs, layer, q, keys, scale, out, row, i, &mut self.counters),
            Some(qs) => {
                let rq = kvsim_reference::RefQuant { bits: qs.bits, group: qs.group };
                check::output_vs_model_quantized(
                    &self.vs,
                    rq,
                    layer,
                    q,
                    keys,
                    stored,
                    scale,
                    out,
                    row,
                    i,
                    &mut self.counters,
                )
            }
        }
    }

    /// The guarantees-table classes a read of request `id` (state `model` after the write) also belongs to.
    pub(super) fn tags(&self, id: u32, model: &RowModel) -> Vec<&'static str> {
        let mut t = vec![];
        if model.max_size.is_some_and(|w| model.offset > w) {
            t.push("after_rotation");
        }
        let h = self.reqs.get(&id).map(|r| r.history).unwrap_or_default();
        if h.layout_event {
            t.push("after_merge_join_extract");
        }
        if h.rolled_back {
            t.push("after_speculative_rollback");
        }
        t
    }

    pub(super) fn check_span(
        &mut self,
        cx: &mut Cx<'_>,
        layer: usize,
        out: &Array,
        rows: &[(usize, u32, Vec<Tok>, Option<&Array>)],
    ) -> Res<()> {
        let out_bytes = ArrayBytes::of(out).map_err(|e| mlx_fail("read output", e))?;
        cx.hasher.update(&out_bytes.digest());
        for (row, id, real, twin) in rows {
            // Rebuild the model position by position: position i is a decode read over the state after i+1 writes.
            let mut m = self.reqs[id].model.clone();
            for (i, q) in real.iter().enumerate() {
                m.decode_write(*q);
                let keys: Vec<Tok> = m.decode_visible().iter().map(|&c| m.cols[c]).collect();
                self.out_vs_model(layer as u32, *q, &keys, keys.len(), self.cfg.scale(), &out_bytes, *row, i)?;
            }
            if let Some(twin) = twin {
                let twin_bytes = ArrayBytes::of(twin).map_err(|e| mlx_fail("read twin output", e))?;
                let tags = self.tags(*id, &m);
                check::output_vs_twin(
                    check::OutClass::DecodeUnpadded,
                    &tags,
                    &out_bytes,
                    *row,
                    &twin_bytes,
                    real.len(),
                    &mut self.counters,
                )?;
            }
        }
        Ok(())
    }

    /// Hands the observer every live request's offset, per-layer temporal K/V views and physical rings (beside the
    /// reference model's), from the production caches (batch rows first, in row order, then requests outside the
    /// batch). Nothing when it does not watch.
    pub fn record_checkpoint(&mut self, cx: &mut Cx<'_>) -> Res<()> {
        let roster = cx.roster;
        if !cx.observer.wants_calls() {
            return Ok(());
        }
        let affine = self.storage != Storage::Plain;
        let mut views = BTreeMap::new();
        for (row, id) in roster.rows().iter().enumerate() {
            let (mut layers, mut planes, mut rings) = (vec![], vec![], vec![]);
            for layer in 0..self.cfg.layers {
                let b = &self.batch[layer];
                let (k, v) = if affine {
                    planes.push(b.row_temporal_view_planes(row).map_err(|e| unexpected("row_temporal_view", e))?);
                    let p = b.row_physical_planes(row).map_err(|e| unexpected("row_physical", e))?;
                    (p[0].clone(), p[3].clone())
                } else {
                    layers.push(b.row_temporal_view(row).map_err(|e| unexpected("row_temporal_view", e))?);
                    b.row_physical(row).map_err(|e| unexpected("row_physical", e))?
                };
                let st = &b.row_states()[row];
                rings.push(RingView {
                    k,
                    v,
                    state: st.ring.clone(),
                    window: b.max_size(),
                    left_padding: b.left_padding().get(row).copied(),
                    pending: st.pending,
                    model: self.reqs[id].model.clone(),
                });
            }
            let offset = self.batch[0].row_states()[row].ring.offset;
            views.insert(
                *id,
                StateView { row: Some(row), offset, layers, planes: affine.then_some(planes), rings, quant: None },
            );
        }
        for r in roster.solo().map(|id| &self.reqs[&id]) {
            let view = StateView::of_serial(&r.solo, &r.model, None, r.solo[0].offset())
                .map_err(|e| unexpected("observed state", e))?;
            views.insert(r.id, view);
        }
        cx.observer.on_state(views).map_err(|e| mlx_fail("observe", e))
    }

    /// The common contract through `&dyn Cache` (`check::contract`) for layer `layer`'s batch rows and every solo
    /// cache, against their models.
    pub(crate) fn check_contract(&mut self, cx: &mut Cx<'_>, layer: usize) -> Res<()> {
        let roster = cx.roster;
        let rows: Vec<&RowModel> = roster.rows().iter().map(|id| &self.reqs[id].model).collect();
        let trimmable = rows.iter().all(|m| m.is_trimmable());
        let view = check::ContractView { rows, trimmable, composed: None };
        check::contract(&format!("batch layer {layer}"), &self.batch[layer], &view, &mut self.counters)?;
        for id in roster.solo() {
            let r = &self.reqs[&id];
            let view = check::ContractView { rows: vec![&r.model], trimmable: r.model.is_trimmable(), composed: None };
            check::contract(&format!("solo request {id} layer {layer}"), &r.solo[layer], &view, &mut self.counters)?;
        }
        Ok(())
    }

    /// After every op: every live request's state, bytes and kinds, in production, twin and model.
    pub fn check_all(&mut self, cx: &mut Cx<'_>) -> Res<()> {
        let roster = cx.roster;
        if self.storage != Storage::Plain {
            return self.check_all_planes(cx);
        }
        let rows_model = roster.rows().len();
        for layer in 0..self.cfg.layers {
            check::row_count(&self.batch[layer], rows_model)?;
            check::kinds_batch(&self.batch[layer], self.max_size(), self.spec)?;
            let width = roster.rows().iter().map(|id| self.reqs[id].model.cols.len()).max().unwrap_or(0);
            let expected_lp: Vec<i64> =
                roster.rows().iter().map(|id| self.reqs[id].model.left_padding(width)).collect();
            check::left_padding(&self.batch[layer].left_padding(), &expected_lp)?;
            let trimmable = roster.rows().iter().all(|id| self.reqs[id].model.is_trimmable());
            check::flag("batch is_trimmable", self.batch[layer].is_trimmable(), trimmable)?;
            self.check_contract(cx, layer)?;
        }
        // Host-side state first (cheap), then every byte with one device round trip and few MLX ops: each layer's
        // batch buffers and all rows' temporal views (one gather per tensor), each solo cache's buffers and temporal
        // view, each twin's buffers. Physical columns (and the twins' temporal views) are cut on the host from the
        // buffers' bytes, by the same column rules the caches' `physical` / `temporal_view` use: the same bytes,
        // shapes and digests as reading those views through MLX, in a fraction of the MLX ops.
        let mut items: Vec<(String, u32, usize)> = vec![];
        // Where each item's production bytes come from: (batch layer, row) or a solo cache.
        enum Src {
            /// Row `row` of the batch buffers read at `layer_at[layer]`.
            Row { layer: usize, row: usize, len: usize },
            /// A serial cache's buffers at `at` (physical = columns `[0, len)`), its temporal view at `at + 2`.
            Solo { at: usize, len: usize },
        }
        let mut srcs: Vec<Src> = vec![];
        let mut arrays: Vec<Array> = vec![];
        let mut layer_at: Vec<Option<(usize, Vec<usize>)>> = vec![None; self.cfg.layers];
        if !roster.rows().is_empty() {
            for (layer, slot) in layer_at.iter_mut().enumerate() {
                let b = &self.batch[layer];
                let (bk, bv) = match b.buffers() {
                    Some(x) => x,
                    None => continue,
                };
                let (tk, tv, counts) = b.temporal_views().map_err(|e| unexpected("temporal_views", e))?;
                *slot = Some((arrays.len(), counts));
                arrays.extend([bk, bv, tk, tv]);
            }
        }
        for (row, id) in roster.rows().iter().enumerate() {
            for layer in 0..self.cfg.layers {
                let what = format!("row {row} (request {id}) layer {layer}");
                let model = &self.reqs[id].model;
                let ring = &self.batch[layer].row_states()[row].ring;
                check::ring_state(&what, ring, model)?;
                if layer_at[layer].is_some() {
                    srcs.push(Src::Row { layer, row, len: ring.len });
                } else {
                    // No buffer yet (rows that never stored a position): the views themselves, as `Solo` reads them.
                    let b = &self.batch[layer];
                    let p = b.row_physical(row).map_err(|e| unexpected("row_physical", e))?;
                    let t = b.row_temporal_view(row).map_err(|e| unexpected("row_temporal_view", e))?;
                    srcs.push(Src::Solo { at: arrays.len(), len: 0 });
                    arrays.extend([p.0, p.1, t.0, t.1]);
                }
                items.push((what, *id, layer));
            }
        }
        let solo: Vec<u32> = roster.solo().collect();
        for id in solo {
            for layer in 0..self.cfg.layers {
                let what = format!("solo request {id} layer {layer}");
                let r = &self.reqs[&id];
                let c = &r.solo[layer];
                check::ring_state(&what, c.state(), &r.model)?;
                check::kinds_serial(c, self.max_size(), self.spec)?;
                check::flag("solo is_trimmable", c.is_trimmable(), r.model.is_trimmable())?;
                let t = c.temporal_view().map_err(|e| unexpected("temporal_view", e))?;
                let at = arrays.len();
                match c.buffers() {
                    Some((k, v)) => arrays.extend([k, v, t.0, t.1]),
                    None => {
                        let (pk, pv) = c.physical().map_err(|e| unexpected("physical", e))?;
                        arrays.extend([pk, pv, t.0, t.1]);
                    }
                }
                srcs.push(Src::Solo { at, len: c.state().len });
                items.push((what, id, layer));
            }
        }
        let mut twin_at = vec![];
        for (what, id, layer) in &items {
            let r = &self.reqs[id];
            let twin = &r.twin[*layer];
            check::ring_state(&format!("twin of {what}"), twin.state(), &r.model)?;
            twin_at.push(arrays.len());
            match twin.buffers() {
                Some((k, v)) => arrays.extend([k, v]),
                None => {
                    let (pk, pv) = twin.physical().map_err(|e| unexpected("twin physical", e))?;
                    arrays.extend([pk, pv]);
                }
            }
        }
        let refs: Vec<&Array> = arrays.iter().collect();
        let bytes = ArrayBytes::read_many(&refs).map_err(|e| mlx_fail("read state", e))?;
        let cut = |b: &ArrayBytes, row: usize, cols: &[usize]| -> Res<ArrayBytes> {
            b.select_columns(row, cols).map_err(|e| mlx_fail("cut state", e))
        };
        for (n, (what, id, layer)) in items.iter().enumerate() {
            let ours: Vec<ArrayBytes> = match srcs[n] {
                Src::Row { layer: l, row, len } => {
                    let (at, counts) =
                        layer_at[l].as_ref().ok_or_else(|| mlx_fail("read state", "a batch row without buffers"))?;
                    let phys: Vec<usize> = (0..len).collect();
                    let tv: Vec<usize> = (0..counts[row]).collect();
                    vec![
                        cut(&bytes[*at], row, &phys)?,
                        cut(&bytes[at + 1], row, &phys)?,
                        cut(&bytes[at + 2], row, &tv)?,
                        cut(&bytes[at + 3], row, &tv)?,
                    ]
                }
                Src::Solo { at, len } => {
                    let phys: Vec<usize> = (0..len).collect();
                    vec![
                        cut(&bytes[at], 0, &phys)?,
                        cut(&bytes[at + 1], 0, &phys)?,
                        bytes[at + 2].clone(),
                        bytes[at + 3].clone(),
                    ]
                }
            };
            let twin = &self.reqs[id].twin[*layer];
            let at = twin_at[n];
            let phys: Vec<usize> = (0..twin.state().len).collect();
            let tv = twin.temporal_view_columns();
            let theirs = vec![
                cut(&bytes[at], 0, &phys)?,
                cut(&bytes[at + 1], 0, &phys)?,
                cut(&bytes[at], 0, &tv)?,
                cut(&bytes[at + 1], 0, &tv)?,
            ];
            self.check_storage(cx, what, *id, *layer, &ours, &theirs)?;
        }
        self.counters.checks += items.len() as u64;
        self.check_capacity(cx)
    }

    /// The capacity guarantee of every layer's batch (`check::capacity`), after the state checks: the rows' states
    /// and bytes are the models' by then, so what fails here is the memory the batch holds and nothing else.
    pub(crate) fn check_capacity(&mut self, cx: &mut Cx<'_>) -> Res<()> {
        let lens: Vec<usize> = cx.roster.rows().iter().map(|id| self.reqs[id].model.cols.len()).collect();
        for layer in 0..self.cfg.layers {
            let what = format!("batch layer {layer}");
            check::capacity(&what, &self.batch[layer], &lens, self.max_size(), &mut self.counters)?;
        }
        Ok(())
    }

    /// Production physical columns == model tokens (bytes); == twin's physical columns (bytes, same order);
    /// temporal views equal (bytes) and equal to the model's tail. `ours`/`theirs`: physical K, V, temporal K, V.
    fn check_storage(
        &mut self,
        cx: &mut Cx<'_>,
        what: &str,
        id: u32,
        layer: usize,
        ours: &[ArrayBytes],
        theirs: &[ArrayBytes],
    ) -> Res<()> {
        let model = &self.reqs[&id].model;
        for (i, tensor) in [Tensor::K, Tensor::V].into_iter().enumerate() {
            cx.hasher.update(&ours[i].digest());
            check::columns_vs_model(what, &self.vs, layer as u32, tensor, &ours[i], &model.cols)?;
            // The labels are written only for a failure (`bytes_equal` passes exactly when the bytes are equal).
            if ours[i] != theirs[i] {
                check::bytes_equal(&format!("{what} {tensor:?} physical vs twin"), &ours[i], &theirs[i])?;
            }
            if ours[2 + i] != theirs[2 + i] {
                check::bytes_equal(&format!("{what} {tensor:?} temporal_view vs twin"), &ours[2 + i], &theirs[2 + i])?;
            }
            check::columns_vs_model(
                &format!("{what} temporal_view"),
                &self.vs,
                layer as u32,
                tensor,
                &ours[2 + i],
                &model.temporal_view(),
            )?;
            self.counters.bit_exact_state += 3;
            self.counters.record_state(ours[i].dtype, 3);
            self.counters.checks += 4;
        }
        Ok(())
    }
}
