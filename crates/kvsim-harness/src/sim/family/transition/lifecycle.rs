//! The transitioning rows' lifecycle ops: `admit`, requests entering the running batch (`merge` / `join`, the
//! twins re-laid out as the rows are), and rows leaving it (`extract`, `filter`). The rows layout is driven
//! through the spec's row-layout contract ([`RowLayout`]: merge, extract, filter), as any row layout would be.

use super::{model_fail, same_error, unexpected, Req, Res, Stored, TransitionFamily};
use crate::sim::check::{self, Failure};
use crate::sim::family::Cx;
use crate::sim::roster::{Change, Roster};
use kvsim_cache::transition::{Bf16FirstCache, TransitioningKvRows};
use kvsim_cache::{LegoGeometry, RowLayout};
use kvsim_reference::transition::{LegoModel, RowsModel};

impl TransitionFamily {
    /// Carries out on the rows layout what a lifecycle op did to the roster.
    pub(super) fn carry_out(&mut self, cx: &mut Cx<'_>, change: &Change) -> Res<()> {
        let roster = cx.roster;
        match change {
            Change::Admit { req } => self.admit(*req),
            Change::Enter { ids, perm } => {
                if perm.iter().enumerate().any(|(i, &r)| i != r) {
                    // The running rows reordered first (a filter keeping every row in that order).
                    self.filter_rows(perm)?;
                }
                self.enter_ids(roster, ids)
            }
            Change::Prefill { ids, lens, chunk, uncommitted, .. } => {
                self.batch_prefill(cx, ids, lens, *chunk, uncommitted)
            }
            Change::Extract { row, req, finish, keep } => self.extract(*row, *req, *finish, keep),
            Change::Filter { kept, dropped } => {
                self.filter_rows(kept)?;
                for id in dropped {
                    self.reqs.remove(id);
                }
                Ok(())
            }
        }
    }

    pub(super) fn admit(&mut self, req: u32) -> Res<()> {
        let layers = self.cfg.layers;
        let solo = (0..layers).map(|_| self.new_lego()).collect::<Res<Vec<_>>>()?;
        let twin = (0..layers).map(|_| self.new_lego()).collect::<Res<Vec<_>>>()?;
        let model = LegoModel::new(self.ts).map_err(|e| model_fail("lego", e))?;
        self.reqs.insert(req, Req { solo, twin, model });
        Ok(())
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

    /// Rows `ids` (requests outside the batch, the last rows of `roster`) enter the batch: every running row is
    /// handed back to its lego and merged with theirs (`Merge` and `Join` alike: the rows layout has one merge).
    pub(super) fn enter_ids(&mut self, roster: &Roster, ids: &[u32]) -> Res<()> {
        let total = roster.rows().len();
        let n_old = total - ids.len();
        for layer in 0..self.cfg.layers {
            let mut legos = Vec::with_capacity(total);
            if let Some(b) = &self.batch.get(layer).and_then(|b| b.as_ref()) {
                for i in 0..n_old {
                    legos.push(RowLayout::extract(*b, i).map_err(|e| unexpected("extract for merge", e))?);
                }
            }
            for id in ids {
                legos.push(self.reqs[id].solo[layer].clone());
            }
            let merged = <TransitioningKvRows as RowLayout>::merge(&self.geometry(), legos)
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
            self.reqs.get_mut(id).unwrap().solo.clear();
        }
        if total > 1 {
            for &id in roster.rows() {
                for layer in 0..self.cfg.layers {
                    let t = self.relayout_twin(&self.reqs[&id].twin[layer])?;
                    self.reqs.get_mut(&id).unwrap().twin[layer] = t;
                }
            }
        }
        Ok(())
    }

    /// The rows' geometry (the row-layout contract's `Geometry`).
    fn geometry(&self) -> LegoGeometry {
        LegoGeometry { spec: self.spec, max_size: self.max_size(), transition: self.t }
    }

    /// An extract of a row the batch does not have: every layer must refuse it as the model does.
    pub(super) fn extract_missing(&mut self, row: usize) -> Res<bool> {
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
        Ok(true)
    }

    /// Row `row` (request `id`) handed back to serial use (`keep`: the other rows); a finished request's lego is
    /// kept as the run's prefix-cache entry.
    fn extract(&mut self, row: usize, id: u32, finish: bool, keep: &[usize]) -> Res<()> {
        let model = self.rows_model.extract(row).map_err(|e| model_fail("extract", e))?;
        let mut legos = Vec::with_capacity(self.cfg.layers);
        let packed = self.batch_rows(0)?.is_packed();
        for layer in 0..self.cfg.layers {
            legos.push(RowLayout::extract(self.batch_rows(layer)?, row).map_err(|e| unexpected("extract", e))?);
        }
        self.filter_rows(keep)?;
        let mut r = self.reqs.remove(&id).unwrap();
        if packed {
            for layer in 0..self.cfg.layers {
                r.twin[layer] = self.deroll_twin(&r.twin[layer])?;
            }
        }
        if finish {
            self.stored = Some(Stored { lego: legos, twin: r.twin, model });
        } else {
            r.solo = legos;
            r.model = model;
            self.reqs.insert(id, r);
        }
        Ok(())
    }

    fn filter_rows(&mut self, kept: &[usize]) -> Res<()> {
        for layer in 0..self.cfg.layers {
            RowLayout::filter(self.batch_mut(layer)?, kept).map_err(|e| unexpected("filter", e))?;
        }
        self.rows_model.filter(kept).map_err(|e| model_fail("filter", e))?;
        if kept.is_empty() {
            self.batch.clear();
            self.rows_model = RowsModel::new(self.ts).map_err(|e| model_fail("reset", e))?;
        }
        Ok(())
    }
}
