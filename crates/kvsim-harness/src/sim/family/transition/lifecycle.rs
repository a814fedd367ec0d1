//! The transitioning rows' lifecycle ops: `admit`, requests entering the running batch (`merge` / `join`, the
//! twins re-laid out as the rows are), and rows leaving it (`extract`, `filter`).

use super::{model_fail, same_error, unexpected, Home, Req, Res, Stored, TransitionFamily};
use crate::sim::check::{self, Failure};
use crate::sim::family::{entering, join_permutation};
use kvsim_cache::transition::{Bf16FirstCache, TransitioningKvRows};
use kvsim_reference::transition::{LegoModel, RowsModel};

impl TransitionFamily {
    pub(super) fn admit(&mut self, req: u32) -> Res<bool> {
        if self.reqs.contains_key(&req) || req < self.next_id {
            return Ok(false);
        }
        let layers = self.cfg.layers;
        let solo = (0..layers).map(|_| self.new_lego()).collect::<Res<Vec<_>>>()?;
        let twin = (0..layers).map(|_| self.new_lego()).collect::<Res<Vec<_>>>()?;
        let model = LegoModel::new(self.ts).map_err(|e| model_fail("lego", e))?;
        self.reqs.insert(req, Req { home: Home::Solo, solo, twin, model });
        self.next_id = req + 1;
        Ok(true)
    }

    /// A twin rewritten in temporal order as a merge of several rows rewrites each row (its newest
    /// `min(offset, W)` positions), through the same public merge: two copies of the twin merged, the first handed
    /// back.
    fn relayout_twin(&self, twin: &Bf16FirstCache) -> Res<Bf16FirstCache> {
        let pair = TransitioningKvRows::merge(self.spec, self.max_size(), self.t, vec![twin.clone(), twin.clone()])
            .map_err(|e| unexpected("twin relayout merge", e))?;
        pair.extract(0).map_err(|e| unexpected("twin relayout extract", e))
    }

    /// A converted twin de-rolled as a packed layout hands a row back (every live column, temporal order): the
    /// twin alone merged (it packs, keeping its columns and phase) and handed back.
    pub(super) fn deroll_twin(&self, twin: &Bf16FirstCache) -> Res<Bf16FirstCache> {
        let one = TransitioningKvRows::merge(self.spec, self.max_size(), self.t, vec![twin.clone()])
            .map_err(|e| unexpected("twin de-roll merge", e))?;
        check::flag("a converted twin packs alone", one.is_packed(), true)?;
        one.extract(0).map_err(|e| unexpected("twin de-roll extract", e))
    }

    /// Rows `ids` (requests outside the batch) enter it: every running row is handed back to its lego and merged
    /// with theirs (`Merge` and `Join` alike: the rows layout has one merge), the running rows listed in `order`
    /// (empty: identity; anything but a permutation of the rows skips the op, as in the attention family).
    pub(super) fn enter(&mut self, reqs: &[u32], order: &[u32]) -> Res<bool> {
        let Some(perm) = join_permutation(order, self.rows.len()) else {
            return Ok(false);
        };
        let ids = entering(reqs, |r| self.solo_req(r));
        if ids.is_empty() {
            return Ok(false);
        }
        if perm.iter().enumerate().any(|(i, &r)| i != r) {
            // The running rows reordered first (a filter keeping every row in that order).
            self.filter_rows(&perm)?;
        }
        self.enter_ids(&ids)?;
        Ok(true)
    }

    pub(super) fn enter_ids(&mut self, ids: &[u32]) -> Res<()> {
        let n_old = self.rows.len();
        let total = n_old + ids.len();
        for layer in 0..self.cfg.layers {
            let mut legos = Vec::with_capacity(total);
            if let Some(b) = &self.batch.get(layer).and_then(|b| b.as_ref()) {
                for i in 0..n_old {
                    legos.push(b.extract(i).map_err(|e| unexpected("extract for merge", e))?);
                }
            }
            for id in ids {
                legos.push(self.reqs[id].solo[layer].clone());
            }
            let merged = TransitioningKvRows::merge(self.spec, self.max_size(), self.t, legos)
                .map_err(|e| unexpected("merge", e))?;
            if self.batch.len() <= layer {
                self.batch.push(Some(merged));
            } else {
                self.batch[layer] = Some(merged);
            }
        }
        let mut sources = Vec::with_capacity(total);
        for i in 0..n_old {
            sources.push(self.rows_model.extract(i).map_err(|e| model_fail("extract for merge", e))?.row);
        }
        for id in ids {
            sources.push(self.reqs[id].model.row.clone());
        }
        self.rows_model = RowsModel::merge(self.ts, sources).map_err(|e| model_fail("merge", e))?;
        for id in ids {
            let r = self.reqs.get_mut(id).unwrap();
            r.home = Home::Batch;
            r.solo.clear();
            self.rows.push(*id);
        }
        if total > 1 {
            for i in 0..self.rows.len() {
                let id = self.rows[i];
                for layer in 0..self.cfg.layers {
                    let t = self.relayout_twin(&self.reqs[&id].twin[layer])?;
                    self.reqs.get_mut(&id).unwrap().twin[layer] = t;
                }
            }
        }
        Ok(())
    }

    pub(super) fn extract(&mut self, row: usize, finish: bool) -> Res<bool> {
        if self.rows.is_empty() {
            return Ok(false);
        }
        if row >= self.rows.len() {
            let want = self.rows_model.extract(row).err().ok_or_else(|| Failure::new("model", "extract of no row"))?;
            for layer in 0..self.cfg.layers {
                match self.batch_rows(layer)?.extract(row) {
                    Err(e) if same_error(&e, &want) => self.counters.expected_errors += 1,
                    other => {
                        return Err(Failure::new(
                            "errors",
                            format!("extract of row {row}: expected {want}, got {:?}", other.map(|_| ())),
                        ))
                    }
                }
            }
            return Ok(true);
        }
        let id = self.rows[row];
        let model = self.rows_model.extract(row).map_err(|e| model_fail("extract", e))?;
        let mut legos = Vec::with_capacity(self.cfg.layers);
        let packed = self.batch_rows(0)?.is_packed();
        for layer in 0..self.cfg.layers {
            legos.push(self.batch_rows(layer)?.extract(row).map_err(|e| unexpected("extract", e))?);
        }
        let keep: Vec<usize> = (0..self.rows.len()).filter(|&r| r != row).collect();
        self.filter_rows(&keep)?;
        let mut r = self.reqs.remove(&id).unwrap();
        if packed {
            for layer in 0..self.cfg.layers {
                r.twin[layer] = self.deroll_twin(&r.twin[layer])?;
            }
        }
        if finish {
            self.stored = Some(Stored { lego: legos, twin: r.twin, model });
        } else {
            r.home = Home::Solo;
            r.solo = legos;
            r.model = model;
            self.reqs.insert(id, r);
        }
        Ok(true)
    }

    fn filter_rows(&mut self, kept: &[usize]) -> Res<()> {
        for layer in 0..self.cfg.layers {
            self.batch_mut(layer)?.filter(kept).map_err(|e| unexpected("filter", e))?;
        }
        self.rows_model.filter(kept).map_err(|e| model_fail("filter", e))?;
        self.rows = kept.iter().map(|&r| self.rows[r]).collect();
        if self.rows.is_empty() {
            self.batch.clear();
            self.rows_model = RowsModel::new(self.ts).map_err(|e| model_fail("reset", e))?;
        }
        Ok(())
    }

    pub(super) fn filter(&mut self, keep: &[u32]) -> Res<bool> {
        if self.rows.is_empty() {
            return Ok(false);
        }
        let mut kept: Vec<usize> = vec![];
        for &k in keep {
            let k = k as usize;
            if k < self.rows.len() && !kept.contains(&k) {
                kept.push(k);
            }
        }
        let dropped: Vec<u32> = (0..self.rows.len()).filter(|r| !kept.contains(r)).map(|r| self.rows[r]).collect();
        self.filter_rows(&kept)?;
        for id in dropped {
            self.reqs.remove(&id);
        }
        Ok(true)
    }
}
