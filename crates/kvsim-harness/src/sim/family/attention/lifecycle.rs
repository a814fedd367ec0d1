//! The attention family's lifecycle ops: `admit`, requests entering the running batch (`merge`, `join`) and rows
//! leaving it (`extract`, `filter`).

use super::persist::persist_roundtrip;
use super::{emit, unexpected, Attention, History, Request, Res};
use crate::sim::check::Failure;
use crate::sim::family::Cx;
use crate::sim::observe::Call;
use crate::sim::roster::Change;
use kvsim_cache::{CacheError, JoinSource, RowBatch, SerialCache};
use kvsim_reference::RowModel;

impl Attention {
    /// Carries out on the layouts what a lifecycle op did to the roster (`merge`: a `Merge`'s temporal merge).
    pub(super) fn carry_out(&mut self, cx: &mut Cx<'_>, change: &Change, merge: bool) -> Res<bool> {
        match change {
            Change::Admit { req } => self.admit(cx, *req)?,
            Change::Enter { ids, perm } => self.enter_ordered(cx, ids, merge, perm)?,
            Change::Prefill { ids, lens, chunk, .. } => self.batch_prefill(cx, ids, lens, *chunk)?,
            Change::Extract { row, req, finish, keep } => self.extract(cx, *row, *req, *finish, keep)?,
            Change::Filter { kept, dropped } => self.filter(cx, kept, dropped)?,
        }
        Ok(true)
    }

    fn admit(&mut self, cx: &mut Cx<'_>, req: u32) -> Res<()> {
        let layers = self.cfg.layers;
        let solo = (0..layers).map(|_| self.new_serial()).collect::<Res<Vec<_>>>()?;
        let twin = (0..layers).map(|_| self.new_serial()).collect::<Res<Vec<_>>>()?;
        let model = RowModel::new(self.max_size());
        self.reqs.insert(req, Request { id: req, solo, twin, model, history: History::default() });
        if cx.observer.wants_calls() {
            emit(cx, Call::Admit { req })?;
        }
        Ok(())
    }

    /// Solo requests `ids` enter the running batch: by temporal merge (`merge = true`) or keeping their phase
    /// (join), the running rows first reordered as `perm` lists them. A permutation is first described to
    /// observers as a `filter` keeping every row in that order (mlx-lm's `filter` reorders rows alike).
    fn enter_ordered(&mut self, cx: &mut Cx<'_>, ids: &[u32], merge: bool, perm: &[usize]) -> Res<()> {
        let max = self.max_size();
        let identity = perm.iter().enumerate().all(|(i, &r)| i == r);
        if cx.observer.wants_calls() {
            if !identity {
                emit(cx, Call::Filter { keep: perm })?;
            }
            let offsets: Vec<usize> = ids.iter().map(|id| self.reqs[id].model.offset).collect();
            let sizes: Vec<usize> = ids.iter().map(|id| self.reqs[id].model.cols.len()).collect();
            emit(cx, Call::Enter { reqs: ids, merge, offsets: &offsets, sizes: &sizes })?;
        }
        for layer in 0..self.cfg.layers {
            let incoming = if merge {
                let mut slices = vec![];
                for id in ids {
                    let planes =
                        self.reqs[id].solo[layer].temporal_view_planes().map_err(|e| unexpected("temporal_view", e))?;
                    slices.push((planes, self.reqs[id].model.offset));
                }
                RowBatch::merge_planes(self.spec, max, self.storage, &slices).map_err(|e| unexpected("merge", e))?
            } else {
                let sources: Vec<JoinSource> =
                    ids.iter().map(|id| JoinSource::Serial(&self.reqs[id].solo[layer])).collect();
                RowBatch::join_storage(self.spec, max, self.storage, &sources)
                    .map_err(|e| unexpected("join (serial rows)", e))?
            };
            let joined = RowBatch::join_storage(
                self.spec,
                max,
                self.storage,
                &[
                    JoinSource::Rows(&self.batch[layer], perm.to_vec()),
                    JoinSource::Rows(&incoming, (0..ids.len()).collect()),
                ],
            )
            .map_err(|e| unexpected("join", e))?;
            self.batch[layer] = joined;
        }
        for id in ids {
            let r = self.reqs.get_mut(id).unwrap();
            r.history.layout_event = true;
            if merge {
                // Layout event: the row is rebuilt from its temporal view; the twin mirrors it.
                let view = r.model.temporal_view();
                let offset = r.model.offset;
                r.model = RowModel::from_temporal(r.model.max_size, view.clone(), offset);
                r.model.base = offset - view.len();
                for twin in r.twin.iter_mut() {
                    let planes = twin.temporal_view_planes().map_err(|e| unexpected("twin temporal_view", e))?;
                    *twin = SerialCache::from_temporal_planes(self.spec, max, self.storage, &planes, offset)
                        .map_err(|e| unexpected("twin from_temporal", e))?;
                }
            } else {
                // join keeps the row's state whole (columns, phase, last window width).
                r.model.base = r.model.offset - r.model.cols.len();
            }
            r.solo.clear();
        }
        Ok(())
    }

    /// An extract of a row the batch does not have: every layer must refuse it with `NoSuchRow`, and change
    /// nothing.
    pub(super) fn extract_missing(&mut self, row: usize) -> Res<bool> {
        let rows = self.batch.first().map_or(0, |b| b.rows());
        for layer in 0..self.cfg.layers {
            match self.batch[layer].extract(row) {
                Err(CacheError::NoSuchRow { .. }) => {}
                other => {
                    return Err(Failure::new(
                        "errors",
                        format!(
                            "extract of missing row {row} (rows {rows}): expected NoSuchRow, got {:?}",
                            other.map(|_| ())
                        ),
                    ))
                }
            }
        }
        self.counters.expected_errors += 1;
        Ok(true)
    }

    /// Row `row` (request `id`) leaves the batch (`keep`: the other rows): finished, or saved, restored and
    /// continued solo.
    fn extract(&mut self, cx: &mut Cx<'_>, row: usize, id: u32, finish: bool, keep: &[usize]) -> Res<()> {
        let mut extracted = vec![];
        for layer in 0..self.cfg.layers {
            extracted.push(self.batch[layer].extract(row).map_err(|e| unexpected("extract", e))?);
            self.batch[layer].filter(keep).map_err(|e| unexpected("filter after extract", e))?;
        }
        if cx.observer.wants_calls() {
            emit(cx, Call::Extract { row, req: id, finish, rows_left: keep.len() })?;
        }
        if finish {
            self.reqs.remove(&id);
            return Ok(());
        }
        let max = self.max_size();
        // Save/restore: the extracted row is persisted (every layer, one file), dropped and restored before it
        // continues solo; the state checks after this op and every later read compare the restored caches with
        // the twin and the model. Even requests go through kvsim's format, odd ones through an mlx-lm prompt-cache
        // file when every layer has an mlx-lm form (else kvsim's format).
        // Affine storage goes through kvsim's format (its codecs store the six planes as they are).
        let extracted = persist_roundtrip(extracted, id % 2 == 1, &mut self.counters)?;
        self.counters.persist_roundtrips += 1;
        let r = self.reqs.get_mut(&id).unwrap();
        r.history.layout_event = true;
        r.solo = extracted;
        // Layout event: extract de-rolls the row into a fresh serial cache (R-BROT-5); the twin and the model follow.
        r.model = r.model.extract();
        for twin in r.twin.iter_mut() {
            twin.relinearize().map_err(|e| unexpected("twin relinearize", e))?;
            let planes = twin.physical_planes().map_err(|e| unexpected("twin physical", e))?;
            *twin = SerialCache::from_temporal_planes(self.spec, max, self.storage, &planes, r.model.offset)
                .map_err(|e| unexpected("twin from_temporal", e))?;
        }
        Ok(())
    }

    /// Rows `kept` stay, in that order; the requests `dropped` finish.
    fn filter(&mut self, cx: &mut Cx<'_>, kept: &[usize], dropped: &[u32]) -> Res<()> {
        for layer in 0..self.cfg.layers {
            self.batch[layer].filter(kept).map_err(|e| unexpected("filter", e))?;
        }
        if cx.observer.wants_calls() {
            emit(cx, Call::Filter { keep: kept })?;
        }
        for id in dropped {
            self.reqs.remove(id);
        }
        Ok(())
    }
}
