//! What the bf16-first families hand an observer after every op: each live request's temporal view (bf16, or the
//! six affine planes once its rows converted) and its ring per layer beside the lifecycle model's ring.

use std::collections::BTreeMap;

use super::*;
use crate::sim::observe::StateView;
use kvsim_cache::SerialCache;

impl TransitionFamily {
    /// Every live request (batch rows first, in row order) as [`StateView::of_serial`] describes it. Nothing when the observer
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
                let view = StateView::of_serial(&caches, &m.ring, Some(i), m.offset());
                views.insert(id, view.map_err(|e| unexpected("observed state", e))?);
            }
        }
        for (&id, r) in &self.reqs {
            if views.contains_key(&id) {
                continue;
            }
            let caches: Vec<SerialCache> = r.solo.iter().map(|l| l.inner().clone()).collect();
            let row = roster.rows().iter().position(|&x| x == id);
            let view = StateView::of_serial(&caches, &r.model.row.ring, row, r.model.row.offset());
            views.insert(id, view.map_err(|e| unexpected("observed state", e))?);
        }
        cx.observer.on_state(views).map_err(|e| mlx_fail("observe", e))
    }
}
