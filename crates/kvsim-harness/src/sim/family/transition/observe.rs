//! What the bf16-first families hand an observer after every op: each live request's temporal view (bf16, or the
//! six affine planes once its rows converted) and its ring per layer beside the lifecycle model's ring.

use std::collections::BTreeMap;

use super::*;
use crate::sim::observe::{RingView, StateView};
use kvsim_cache::{SerialCache, Storage};
use kvsim_reference::RowModel;

/// One request's storage per layer and its model ring, as the observer is handed them.
fn view_of(caches: &[SerialCache], model: &RowModel, row: Option<usize>, offset: usize) -> Res<StateView> {
    let affine = caches.iter().any(|c| c.storage() != Storage::Plain);
    let (mut layers, mut planes, mut rings) = (vec![], vec![], vec![]);
    let mut quant = None;
    for c in caches {
        let (k, v) = if affine {
            planes.push(c.temporal_view_planes().map_err(|e| unexpected("temporal_view", e))?);
            let p = c.physical_planes().map_err(|e| unexpected("physical", e))?;
            (p[0].clone(), p[3].clone())
        } else {
            layers.push(c.temporal_view().map_err(|e| unexpected("temporal_view", e))?);
            c.physical().map_err(|e| unexpected("physical", e))?
        };
        if let Storage::Affine(q) = c.storage() {
            quant = Some((q.bits, q.group));
        }
        let (state, window, model) = (c.state().clone(), c.max_size(), model.clone());
        rings.push(RingView { k, v, state, window, left_padding: None, pending: None, model });
    }
    Ok(StateView { row, offset, layers, planes: affine.then_some(planes), rings, quant })
}

impl TransitionFamily {
    /// Every live request (batch rows first, in row order) as [`view_of`] describes it. Nothing when the observer
    /// does not watch.
    pub(super) fn observe(&mut self, cx: &mut Cx<'_>) -> Res<()> {
        if !cx.observer.wants_calls() {
            return Ok(());
        }
        let roster = cx.roster;
        let mut views = BTreeMap::new();
        let rows_here = !self.legos && self.batch.first().is_some_and(Option::is_some);
        if rows_here {
            for (i, &id) in roster.rows().iter().enumerate() {
                let mut caches = vec![];
                for b in self.batch.iter().flatten() {
                    caches.push(b.row_storage(i).map_err(|e| unexpected("row_storage", e))?);
                }
                let Some(m) = self.rows_model.rows.get(i) else { continue };
                views.insert(id, view_of(&caches, &m.ring, Some(i), m.offset())?);
            }
        }
        for (&id, r) in &self.reqs {
            if views.contains_key(&id) {
                continue;
            }
            let caches: Vec<SerialCache> = r.solo.iter().map(|l| l.inner().clone()).collect();
            let row = roster.rows().iter().position(|&x| x == id);
            views.insert(id, view_of(&caches, &r.model.row.ring, row, r.model.row.offset())?);
        }
        cx.observer.on_state(views).map_err(|e| mlx_fail("observe", e))
    }
}
