//! The recurrent family's lifecycle ops: `admit`, requests entering the running batch (`merge` / `join`) and rows
//! leaving it (`extract`, `filter`).

use super::persist::persist_roundtrip;
use super::{emit, mlx, Cache, LayerDef, Recurrent, Req, Res, Rows};
use crate::sim::check::Failure;
use crate::sim::family::Cx;
use crate::sim::observe::Call;
use crate::sim::roster::Change;
use kvsim_cache::{CacheError, JoinSource, RowBatch, SerialCache, SsmCache};
use kvsim_reference::SsmRowModel;

impl Recurrent {
    // ----- ops -------------------------------------------------------------------------------------------------

    /// Carries out on the layouts what a lifecycle op did to the roster.
    pub(super) fn carry_out(&mut self, cx: &mut Cx<'_>, change: &Change) -> Res {
        match change {
            Change::Admit { req } => {
                self.admit(*req)?;
                if cx.observer.wants_calls() {
                    emit(cx, Call::Admit { req: *req })?;
                }
                Ok(())
            }
            Change::Enter { ids, perm } => self.enter(cx, ids, perm),
            Change::Prefill { ids, lens, chunk, running, .. } => self.batch_prefill(cx, ids, lens, *chunk, *running),
            Change::Extract { row, req, finish, keep } => self.extract(cx, *row, *req, *finish, keep),
            Change::Filter { kept, dropped } => self.filter(cx, kept, dropped),
        }
    }

    fn admit(&mut self, id: u32) -> Res {
        let models = self
            .layers
            .iter()
            .map(|l| matches!(l, LayerDef::DeltaNet { .. }).then(|| SsmRowModel::new(self.set.dims)))
            .collect();
        let req = Req { solo: self.fresh_caches()?, twin: self.fresh_caches()?, models, pos: 0 };
        self.reqs.insert(id, req);
        Ok(())
    }

    /// Requests outside the batch enter it after the running rows, listed in `perm` order (a permutation of the
    /// batch's rows): DeltaNet layers merge the (filtered) batch and the requests' one-row caches (`SsmCache::merge`,
    /// sources borrowed); attention layers join the batch's rows in that order and the requests' serial caches.
    pub(super) fn enter(&mut self, cx: &mut Cx<'_>, ids: &[u32], perm: &[usize]) -> Res {
        let identity = perm.iter().enumerate().all(|(i, &r)| i == r);
        if cx.observer.wants_calls() {
            // A join's new row order is a filter keeping every row in that order (mlx-lm's filter reorders alike),
            // then the merge of the entering requests.
            if !identity {
                emit(cx, Call::Filter { keep: perm })?;
            }
            let offsets: Vec<usize> = ids.iter().map(|id| self.reqs[id].pos).collect();
            emit(cx, Call::Enter { reqs: ids, merge: true, offsets: &offsets, sizes: &offsets })?;
        }
        for li in 0..self.layers.len() {
            let joined = match &self.batch[li] {
                Rows::Ssm(b) => {
                    let permuted = if identity {
                        None
                    } else {
                        let mut p = b.clone();
                        p.filter(perm).map_err(|e| mlx("filter (join order)", e))?;
                        Some(p)
                    };
                    let mut src: Vec<&SsmCache> = vec![permuted.as_ref().unwrap_or(b)];
                    for id in ids {
                        let Cache::Ssm(c) = &self.reqs[id].solo[li] else { unreachable!() };
                        src.push(c);
                    }
                    Rows::Ssm(SsmCache::merge(self.spec, &src).map_err(|e| mlx("merge", e))?)
                }
                Rows::Attn(b) => {
                    let LayerDef::Attention { window } = self.layers[li] else { unreachable!() };
                    let mut src = vec![JoinSource::Rows(b, perm.to_vec())];
                    for id in ids {
                        let Cache::Attn(c) = &self.reqs[id].solo[li] else { unreachable!() };
                        src.push(JoinSource::Serial(c));
                    }
                    Rows::Attn(RowBatch::join(self.attn, window, &src).map_err(|e| mlx("join", e))?)
                }
            };
            self.batch[li] = joined;
        }
        for id in ids {
            self.reqs.get_mut(id).unwrap().solo.clear();
        }
        Ok(())
    }

    /// An extract of a row the batch does not have: every layer must refuse it with `NoSuchRow`.
    pub(super) fn extract_missing(&mut self, row: usize) -> Res<bool> {
        for b in &self.batch {
            let got = match b {
                Rows::Ssm(b) => b.extract(row).map(|_| ()),
                Rows::Attn(b) => b.extract(row).map(|_| ()),
            };
            if !matches!(got, Err(CacheError::NoSuchRow { .. })) {
                return Err(Failure::new("errors", format!("extract of missing row {row}: got {got:?}")));
            }
        }
        self.counters.expected_errors += 1;
        Ok(true)
    }

    /// Row `row` (request `id`) leaves the batch (`keep`: the other rows): finished, or saved, restored and
    /// continued solo.
    fn extract(&mut self, cx: &mut Cx<'_>, row: usize, id: u32, finish: bool, keep: &[usize]) -> Res {
        if cx.observer.wants_calls() {
            emit(cx, Call::Extract { row, req: id, finish, rows_left: keep.len() })?;
        }
        let mut out = vec![];
        for b in &mut self.batch {
            match b {
                Rows::Ssm(b) => {
                    out.push(Cache::Ssm(b.extract(row).map_err(|e| mlx("extract", e))?));
                    b.filter(keep).map_err(|e| mlx("filter after extract", e))?;
                }
                Rows::Attn(b) => {
                    out.push(Cache::Attn(b.extract(row).map_err(|e| mlx("extract", e))?));
                    b.filter(keep).map_err(|e| mlx("filter after extract", e))?;
                }
            }
        }
        if finish {
            self.reqs.remove(&id);
            return Ok(());
        }
        let out = persist_roundtrip(out, false, &mut self.counters)?;
        self.counters.persist_roundtrips += 1;
        let attn = self.attn;
        let r = self.reqs.get_mut(&id).unwrap();
        r.solo = out;
        // Layout event for the attention layers: extract de-rolls the row into a fresh serial cache (R-BROT-5).
        for (li, twin) in r.twin.iter_mut().enumerate() {
            if let (Cache::Attn(t), LayerDef::Attention { window }) = (twin, &self.layers[li]) {
                t.relinearize().map_err(|e| mlx("twin relinearize", e))?;
                let (k, v) = t.physical().map_err(|e| mlx("twin physical", e))?;
                let off = t.state().offset;
                *t =
                    SerialCache::from_temporal(attn, *window, &k, &v, off).map_err(|e| mlx("twin from_temporal", e))?;
            }
        }
        Ok(())
    }

    /// Rows `kept` stay, in that order; the requests `dropped` finish.
    fn filter(&mut self, cx: &mut Cx<'_>, kept: &[usize], dropped: &[u32]) -> Res {
        for b in &mut self.batch {
            match b {
                Rows::Ssm(b) => {
                    // A repeated row is a typed error (and changes nothing: the state checks after this op see it).
                    if b.filter(&[0, 0]) != Err(CacheError::DuplicateRow { row: 0 }) {
                        crate::sim::check::fail(Failure::new("ssm_filter_errors", "a repeated row was not refused"))?;
                    }
                    self.counters.expected_errors += 1;
                    b.filter(kept)
                }
                Rows::Attn(b) => b.filter(kept),
            }
            .map_err(|e| mlx("filter", e))?;
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
