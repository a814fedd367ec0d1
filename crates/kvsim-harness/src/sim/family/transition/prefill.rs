//! The transitioning rows' `batch_prefill`: fresh requests' prompts in chunks (as siblings deliver them), or a
//! prepared (right-padded) prefill of a cohort whose rows are handed back and committed row by row.

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use super::{bytes_of, model_fail, row_of, sibling_split, unexpected, Res, TransitionFamily};
use crate::sim::check::{self, Failure};
use crate::sim::family::Cx;
use kvsim_cache::transition::{Bf16FirstCache, TransitioningKvRows};
use kvsim_cache::Masks;
use kvsim_reference::transition::RowsModel;
use kvsim_reference::Tok;

impl TransitionFamily {
    /// Fresh requests `ids` (prompt lengths `lens`) prefilled as a cohort, then entering the batch (module docs).
    pub(super) fn batch_prefill(
        &mut self,
        cx: &mut Cx<'_>,
        ids: &[u32],
        lens: &[usize],
        chunk: usize,
        uncommitted: &[u32],
    ) -> Res<()> {
        // The requests that never commit a chunk of their own: the prefill's end commits them.
        let skip: Vec<bool> = ids.iter().map(|id| uncommitted.contains(id)).collect();
        if self.padded_prefill {
            return self.batch_prefill_padded(cx, ids, lens, chunk, &skip);
        }
        let n = ids.len();
        let common = *lens.iter().min().unwrap();
        let scale = self.cfg.scale();
        let mut cohort = Vec::with_capacity(self.cfg.layers);
        for layer in 0..self.cfg.layers {
            let legos: Vec<Bf16FirstCache> = ids.iter().map(|id| self.reqs[id].solo[layer].clone()).collect();
            let mut c = TransitioningKvRows::merge(self.spec, self.max_size(), self.t, legos)
                .map_err(|e| unexpected("cohort merge", e))?;
            c.begin_prefill().map_err(|e| unexpected("begin_prefill", e))?;
            cohort.push(c);
        }
        let sources = ids.iter().map(|id| self.reqs[id].model.row.clone()).collect();
        let mut model = RowsModel::merge(self.ts, sources).map_err(|e| model_fail("cohort merge", e))?;
        model.begin_prefill().map_err(|e| model_fail("begin_prefill", e))?;
        let mut done = 0;
        while done < common {
            let planned = chunk.min(common - done);
            let parts = sibling_split(planned);
            // Twins: each chunk a lego round committed with its request; an uncommitted request's round spans
            // every chunk and ends with the prefill.
            for layer in 0..self.cfg.layers {
                for (r, &id) in ids.iter().enumerate() {
                    if skip[r] && done > 0 {
                        continue;
                    }
                    let twin = &mut self.reqs.get_mut(&id).unwrap().twin[layer];
                    twin.round_begin().map_err(|e| unexpected("twin chunk", e))?;
                }
            }
            for &l in &parts {
                let toks: Vec<Vec<Tok>> = (0..n).map(|r| Self::toks_from(ids[r], model.rows[r].offset(), l)).collect();
                let (reads, mconv) = model.append(&toks, false).map_err(|e| model_fail("cohort append", e))?;
                if !mconv.is_empty() {
                    return Err(Failure::new("model", "the model converted inside a prefill chunk"));
                }
                let (masks, twin_masks) = (Masks::new(), Masks::new());
                let mut first_layer_builds = 0;
                for layer in 0..self.cfg.layers {
                    let (k, v, q) = self.kvq(layer, &toks);
                    let packed = cohort[layer].is_packed();
                    let (out, conv) =
                        cohort[layer].window(&k, &v, &q, scale, &masks).map_err(|e| unexpected("cohort read", e))?;
                    if layer == 0 {
                        first_layer_builds = masks.builds();
                    }
                    if !conv.is_empty() {
                        return Err(Failure::new(
                            "conversion",
                            format!("rows {conv:?} converted inside a prefill chunk"),
                        ));
                    }
                    let ob = bytes_of(&out)?;
                    cx.hasher.update(&ob.digest());
                    for r in 0..n {
                        let twin = &mut self.reqs.get_mut(&ids[r]).unwrap().twin[layer];
                        let (tw, _) = twin
                            .window(&row_of(&k, r), &row_of(&v, r), &row_of(&q, r), scale, &twin_masks)
                            .map_err(|e| unexpected("twin chunk read", e))?;
                        let tb = bytes_of(&tw)?;
                        self.read_vs_model(layer, &ob, r, &toks[r], &reads[r])?;
                        self.read_vs_twin(&ob, r, &tb, l, false, packed, false)?;
                    }
                }
                self.check_one_mask_per_forward("cohort chunk", first_layer_builds, &masks)?;
            }
            // Each request commits its own chunk boundary (except the uncommitted ones).
            for r in (0..n).filter(|&r| !skip[r]) {
                let mconv = model.commit_prefill(&[r]).map_err(|e| model_fail("commit_prefill", e))?;
                for layer in 0..self.cfg.layers {
                    let got = cohort[layer].commit_prefill(&[r]).map_err(|e| unexpected("commit_prefill", e))?;
                    if got != mconv {
                        return Err(Failure::new("conversion", format!("commit of row {r}: {got:?}, model {mconv:?}")));
                    }
                    let twin = &mut self.reqs.get_mut(&ids[r]).unwrap().twin[layer];
                    let did = twin.round_commit().map_err(|e| unexpected("twin chunk commit", e))?;
                    check::flag("twin conversion at the chunk's commit", did, !mconv.is_empty())?;
                }
                self.counters.conversions += (mconv.len() * self.cfg.layers) as u64;
                self.counters.prefill_conversions += (mconv.len() * self.cfg.layers) as u64;
            }
            done += planned;
        }
        // The end commits the requests that did not commit their chunks: the rows due convert, as the model says,
        // and so do their twins at the end of their rounds.
        let mconv = model.end_prefill().map_err(|e| model_fail("end_prefill", e))?;
        for c in cohort.iter_mut() {
            let got = c.end_prefill().map_err(|e| unexpected("end_prefill", e))?;
            if got != mconv {
                return Err(Failure::new("conversion", format!("end_prefill: {got:?}, model {mconv:?}")));
            }
        }
        if mconv.iter().any(|&r| !skip[r]) {
            return Err(Failure::new("model", format!("end_prefill converted committed rows {mconv:?}")));
        }
        for r in (0..n).filter(|&r| skip[r] && done > 0) {
            for layer in 0..self.cfg.layers {
                let twin = &mut self.reqs.get_mut(&ids[r]).unwrap().twin[layer];
                let did = twin.round_commit().map_err(|e| unexpected("twin prefill end", e))?;
                check::flag("twin conversion at the prefill's end", did, mconv.contains(&r))?;
            }
        }
        if skip.iter().any(|&s| s) {
            self.counters.prefills_ended_uncommitted += 1;
        }
        self.counters.conversions += (mconv.len() * self.cfg.layers) as u64;
        self.counters.prefill_conversions += (mconv.len() * self.cfg.layers) as u64;
        self.hand_back_cohort(&cohort, &model, ids)?;
        self.check_before_entering(cx, ids)?;
        // The longer requests' tails: solo lego windows.
        for (r, id) in ids.iter().enumerate() {
            if lens[r] > common {
                self.lego_append(cx, *id, lens[r] - common, false)?;
            }
        }
        self.enter_ids(cx.roster, ids)
    }

    /// The state check in the middle of a prefill, the cohort `ids` handed back and not yet in the batch (the
    /// roster's last rows): they are checked as the requests outside it.
    fn check_before_entering(&mut self, cx: &mut Cx<'_>, ids: &[u32]) -> Res<()> {
        let roster = cx.roster;
        let rows = &roster.rows()[..roster.rows().len() - ids.len()];
        let mut solo: Vec<u32> = roster.solo().chain(ids.iter().copied()).collect();
        solo.sort_unstable();
        self.check_layouts(cx, &solo, rows)
    }

    /// `BatchPrefill` as a right-padded prefill: the fresh requests' legos merged into a cohort,
    /// `prepare(lengths)`, then windows of `chunk` positions each delivered as two forwards (a sibling's split) until
    /// the longest prompt is in; row `r` stores only its next `min(pending_r, L)` real positions of each window. A
    /// request commits (`commit_prefill`) at the end of the planned chunk where its prompt ends, except those ending
    /// in the last chunk, which `finalize` commits; nothing converts before its request commits. Twins: legos fed
    /// each row's real positions inside a lego round committed at the same point. Then the cohort enters the batch.
    fn batch_prefill_padded(
        &mut self,
        cx: &mut Cx<'_>,
        ids: &[u32],
        lens: &[usize],
        chunk: usize,
        skip: &[bool],
    ) -> Res<()> {
        let n = ids.len();
        let longest = *lens.iter().max().unwrap();
        let scale = self.cfg.scale();
        let mut cohort = Vec::with_capacity(self.cfg.layers);
        for layer in 0..self.cfg.layers {
            let legos: Vec<Bf16FirstCache> = ids.iter().map(|id| self.reqs[id].solo[layer].clone()).collect();
            let mut c = TransitioningKvRows::merge(self.spec, self.max_size(), self.t, legos)
                .map_err(|e| unexpected("cohort merge", e))?;
            c.prepare(lens).map_err(|e| unexpected("prepare", e))?;
            cohort.push(c);
        }
        let sources = ids.iter().map(|id| self.reqs[id].model.row.clone()).collect();
        let mut model = RowsModel::merge(self.ts, sources).map_err(|e| model_fail("cohort merge", e))?;
        model.prepare(lens).map_err(|e| model_fail("prepare", e))?;
        for layer in 0..self.cfg.layers {
            for id in ids {
                let twin = &mut self.reqs.get_mut(id).unwrap().twin[layer];
                twin.round_begin().map_err(|e| unexpected("twin prefill", e))?;
            }
        }
        let mut done = 0;
        let mut committed = vec![false; n];
        while done < longest {
            let planned = chunk.min(longest - done);
            let parts = sibling_split(planned);
            for &l in &parts {
                let pending: Vec<usize> = model.pending.clone().unwrap_or_default();
                let toks: Vec<Vec<Tok>> = (0..n).map(|r| Self::toks_from(ids[r], model.rows[r].offset(), l)).collect();
                let (reads, mconv) = model.append(&toks, false).map_err(|e| model_fail("prepared window", e))?;
                if !mconv.is_empty() {
                    return Err(Failure::new("model", "the model converted at a prepared window"));
                }
                let (masks, twin_masks) = (Masks::new(), Masks::new());
                let mut first_layer_builds = 0;
                for layer in 0..self.cfg.layers {
                    let (k, v, q) = self.kvq(layer, &toks);
                    let packed = cohort[layer].is_packed();
                    let (out, conv) = cohort[layer]
                        .window(&k, &v, &q, scale, &masks)
                        .map_err(|e| unexpected("prepared window", e))?;
                    if layer == 0 {
                        first_layer_builds = masks.builds();
                    }
                    if !conv.is_empty() {
                        return Err(Failure::new(
                            "conversion",
                            format!("rows {conv:?} converted at a prepared window"),
                        ));
                    }
                    let ob = bytes_of(&out)?;
                    cx.hasher.update(&ob.digest());
                    for r in 0..n {
                        let real = pending[r].min(l);
                        if real == 0 {
                            continue;
                        }
                        let c = |a: &Array| a.index((r as i32..r as i32 + 1, .., 0..real as i32, ..));
                        let twin = &mut self.reqs.get_mut(&ids[r]).unwrap().twin[layer];
                        let (tw, _) = twin
                            .window(&c(&k), &c(&v), &c(&q), scale, &twin_masks)
                            .map_err(|e| unexpected("twin prefill read", e))?;
                        let tb = bytes_of(&tw)?;
                        self.read_vs_model(layer, &ob, r, &toks[r], &reads[r])?;
                        self.read_vs_twin(&ob, r, &tb, real, false, packed, false)?;
                    }
                }
                self.check_one_mask_per_forward("prepared window", first_layer_builds, &masks)?;
            }
            done += planned;
            // The requests whose prompt ended in this chunk commit (those of the last chunk, and the uncommitted
            // ones: `finalize`).
            if done < longest {
                for r in 0..n {
                    if !committed[r] && !skip[r] && lens[r] <= done {
                        committed[r] = true;
                        let mconv = model.commit_prefill(&[r]).map_err(|e| model_fail("commit_prefill", e))?;
                        self.commit_padded_row(&mut cohort, ids, r, &mconv, Some(r))?;
                    }
                }
            }
        }
        let mconv = model.finalize().map_err(|e| model_fail("finalize", e))?;
        let mut got = None;
        for c in cohort.iter_mut() {
            let conv = c.finalize().map_err(|e| unexpected("finalize", e))?;
            if *got.get_or_insert_with(|| conv.clone()) != conv || conv != mconv {
                return Err(Failure::new("conversion", format!("finalize converted {conv:?}, model {mconv:?}")));
            }
        }
        for r in (0..n).filter(|&r| !committed[r]) {
            self.commit_padded_row(&mut cohort, ids, r, &mconv, None)?;
        }
        self.hand_back_cohort(&cohort, &model, ids)?;
        self.counters.prepared_prefills += 1;
        if skip.iter().any(|&s| s) {
            self.counters.prefills_ended_uncommitted += 1;
        }
        self.check_before_entering(cx, ids)?;
        self.enter_ids(cx.roster, ids)
    }

    /// A prefill cohort's rows go back to serial use: each request's lego of every layer and its model row, and, when
    /// a cohort of several rows packed (it hands its rows back de-rolled to temporal order), its twins de-rolled too.
    fn hand_back_cohort(&mut self, cohort: &[TransitioningKvRows], model: &RowsModel, ids: &[u32]) -> Res<()> {
        for (layer, c) in cohort.iter().enumerate() {
            for (r, id) in ids.iter().enumerate() {
                let lego = c.extract(r).map_err(|e| unexpected("cohort extract", e))?;
                self.reqs.get_mut(id).unwrap().solo[layer] = lego;
            }
        }
        let packed = ids.len() > 1 && cohort.first().is_some_and(|c| c.is_packed());
        for (r, id) in ids.iter().enumerate() {
            let m = model.extract(r).map_err(|e| model_fail("cohort extract", e))?;
            self.reqs.get_mut(id).unwrap().model = m;
            if packed {
                for layer in 0..self.cfg.layers {
                    let t = self.deroll_twin(&self.reqs[id].twin[layer])?;
                    self.reqs.get_mut(id).unwrap().twin[layer] = t;
                }
            }
        }
        Ok(())
    }

    /// One request of a right-padded prefill commits: `commit` `Some(r)` calls `commit_prefill(&[r])` on every
    /// layer's cohort (which must convert what the model's `mconv` says), `None` means `finalize` already did; the
    /// row's twins end their lego round, converting exactly when the model converted the row.
    fn commit_padded_row(
        &mut self,
        cohort: &mut [TransitioningKvRows],
        ids: &[u32],
        r: usize,
        mconv: &[usize],
        commit: Option<usize>,
    ) -> Res<()> {
        let converts = mconv.contains(&r);
        for (layer, c) in cohort.iter_mut().enumerate() {
            if let Some(row) = commit {
                let got = c.commit_prefill(&[row]).map_err(|e| unexpected("commit_prefill", e))?;
                if got != mconv {
                    return Err(Failure::new("conversion", format!("commit of row {r}: {got:?}, model {mconv:?}")));
                }
            }
            let twin = &mut self.reqs.get_mut(&ids[r]).unwrap().twin[layer];
            let did = twin.round_commit().map_err(|e| unexpected("twin prefill commit", e))?;
            check::flag("twin conversion at the request's commit", did, converts)?;
        }
        if converts {
            self.counters.conversions += self.cfg.layers as u64;
            self.counters.prefill_conversions += self.cfg.layers as u64;
        }
        Ok(())
    }
}
