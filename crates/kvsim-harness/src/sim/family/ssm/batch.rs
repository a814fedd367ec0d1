//! The recurrent family's ops on the running batch: `batch_prefill` (a prepared prefill over the whole batch, in
//! chunks), `decode`, `window` / `append`, `commit_span` and `verify` (a speculative round with rollback and replay).

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::Array;

use super::{emit, mlx, pick, same_slice, words, Cache, LayerDef, Recurrent, Res, RowIn, Rows, SCALE};
use crate::sim::check::Failure;
use crate::sim::family::attention::mlx_fail;
use crate::sim::family::Cx;
use crate::sim::observe::{Call, Read};
use crate::sim::roster::Roster;
use kvsim_cache::{CacheError, Masks, SsmCache};

impl Recurrent {
    /// The fresh requests' caches merged into the running batch, then one prepared prefill over the whole batch
    /// (running rows: all padding), in chunks of `chunk`, then finalize.
    pub(super) fn batch_prefill(
        &mut self,
        cx: &mut Cx<'_>,
        ids: &[u32],
        lens: &[usize],
        chunk: usize,
        old: usize,
    ) -> Res {
        let roster = cx.roster;
        let left = !self.set.hybrid() && !(ids[0] as usize + chunk).is_multiple_of(3);
        self.enter(cx, ids, &(0..old).collect::<Vec<_>>())?;
        let width = *lens.iter().max().unwrap();
        // Running rows are all padding: right padding (`lengths = 0`), or with left padding `left = lengths =
        // width`, so a mask that ignored left padding would step their states (bug catalog #1).
        let mut lengths = vec![if left { width } else { 0 }; old];
        let mut lefts = vec![if left { width } else { 0 }; old];
        for &p in lens {
            lengths.push(if left { width } else { p });
            lefts.push(if left { width - p } else { 0 });
        }
        for b in &mut self.batch {
            match b {
                Rows::Ssm(b) => b.prepare(&lengths, if left { &lefts } else { &[] }),
                Rows::Attn(b) => b.prepare(&lengths),
            }
            .map_err(|e| mlx("prepare", e))?;
        }
        if cx.observer.wants_calls() {
            emit(cx, Call::SsmPrepare { lengths: &lengths, left: if left { &lefts } else { &[] } })?;
        }
        self.counters.recurrent.padded_prefills += 1;
        self.counters.recurrent.left_padded_prefills += u64::from(left);
        // A side run: the cohort alone in a fresh batch, prepared with the same padding, its longest row filtered
        // out right after `prepare` (a filter of an empty batch whose left padding is pending), then the same
        // chunks; its rows must end byte-identical to theirs in the main run.
        let side_keep: Option<Vec<usize>> = (left && ids.len() > 1).then(|| {
            let longest = (0..lens.len()).max_by_key(|&i| (lens[i], usize::MAX - i)).unwrap_or(0);
            (0..lens.len()).filter(|&r| r != longest).collect()
        });
        let mut side: Vec<Option<SsmCache>> = vec![];
        if let Some(keep) = &side_keep {
            for b in &self.batch {
                side.push(match b {
                    Rows::Ssm(_) => {
                        let mut c = SsmCache::new(self.spec, ids.len()).map_err(|e| mlx("new", e))?;
                        c.prepare(&lengths[old..], &lefts[old..]).map_err(|e| mlx("prepare (side)", e))?;
                        c.filter(keep).map_err(|e| mlx("filter (pending prefill)", e))?;
                        Some(c)
                    }
                    Rows::Attn(_) => None,
                });
            }
        }
        let mut pad: Vec<(i64, i64)> = lefts.iter().zip(&lengths).map(|(&a, &b)| (a as i64, b as i64)).collect();
        let mut done = 0;
        while done < width {
            let s = chunk.min(width - done);
            let real: Vec<(usize, usize)> = pad
                .iter()
                .map(|&(l, n)| {
                    let st = l.clamp(0, s as i64);
                    (st as usize, n.clamp(0, s as i64).max(st) as usize)
                })
                .collect();
            if let Some(keep) = &side_keep {
                let rows: Vec<RowIn> = keep
                    .iter()
                    .map(|&r| {
                        let id = roster.rows()[old + r];
                        (id as u64, self.reqs[&id].pos, real[old + r].0, real[old + r].1)
                    })
                    .collect();
                for li in 0..self.layers.len() {
                    if let (Some(c), LayerDef::DeltaNet { params, .. }) = (&mut side[li], &self.layers[li]) {
                        let [q, a, b] = self.ssm_inputs(li as u32, &rows, s, None);
                        c.window(&q, &a, &b, params).map_err(|e| mlx("side prefill", e))?;
                    }
                }
            }
            self.batch_forward(cx, s, &real, None)?;
            for (r, &(st, en)) in real.iter().enumerate() {
                let id = roster.rows()[r];
                self.reqs.get_mut(&id).unwrap().pos += en - st;
            }
            pad.iter_mut().for_each(|(l, n)| {
                *l -= s as i64;
                *n -= s as i64;
            });
            done += s;
        }
        for b in &mut self.batch {
            match b {
                Rows::Ssm(b) => b.finalize(),
                Rows::Attn(b) => b.finalize(),
            }
            .map_err(|e| mlx("finalize", e))?;
        }
        if cx.observer.wants_calls() {
            emit(cx, Call::SsmFinalize)?;
        }
        if let Some(keep) = &side_keep {
            let mut matched = 0;
            for (li, c) in side.iter_mut().enumerate() {
                let (Some(c), Rows::Ssm(b)) = (c, &self.batch[li]) else { continue };
                c.finalize().map_err(|e| mlx("side finalize", e))?;
                for (i, &r) in keep.iter().enumerate() {
                    let (sc, sr) = c.row_states(i).map_err(|e| mlx("side row", e))?;
                    let (bc, br) = b.row_states(old + r).map_err(|e| mlx("row", e))?;
                    if words(&sc)? != words(&bc)?
                        || words(&sr)? != words(&br)?
                        || c.offsets()[i] != b.offsets()[old + r]
                    {
                        crate::sim::check::fail(Failure::new(
                            "ssm_filter_pending",
                            format!("layer {li} row {r}: filtered during a pending left-padded prefill, it differs"),
                        ))?;
                    }
                    matched += 1;
                }
            }
            self.counters.checks += matched;
            self.record("ssm_filter_pending", matched);
        }
        Ok(())
    }

    pub(super) fn decode(&mut self, cx: &mut Cx<'_>) -> Res<bool> {
        let roster = cx.roster;
        if roster.rows().is_empty() {
            return Ok(false);
        }
        self.batch_forward(cx, 1, &vec![(0, 1); roster.rows().len()], None)?;
        self.advance(roster, &vec![1; roster.rows().len()]);
        Ok(true)
    }

    fn advance(&mut self, roster: &Roster, n: &[usize]) {
        for (id, &k) in roster.rows().iter().zip(n) {
            self.reqs.get_mut(id).unwrap().pos += k;
        }
    }

    pub(super) fn window(&mut self, cx: &mut Cx<'_>, len: usize) -> Res<bool> {
        let roster = cx.roster;
        if roster.rows().is_empty() || len == 0 {
            return Ok(false);
        }
        self.batch_forward(cx, len, &vec![(0, len); roster.rows().len()], None)?;
        self.advance(roster, &vec![len; roster.rows().len()]);
        Ok(true)
    }

    /// A committed span of `len` positions on every batch row, every layer: DeltaNet layers through
    /// `SsmCache::commit_span` (the positions one recurrence step at a time), attention layers through
    /// `RowBatch::commit_span`; each row's twin runs `len` single decodes. Promised: every DeltaNet output of the span
    /// byte-identical to the twin's single steps (and within the bound of the f64 model); states are compared after
    /// the op by `check_state`, as after any op. Attention outputs are recorded when byte-identical (a batch decode
    /// of rows of different lengths is a padded read, measured by the attention family).
    pub(super) fn commit_span(&mut self, cx: &mut Cx<'_>, len: usize) -> Res<bool> {
        let roster = cx.roster;
        if roster.rows().is_empty() || len == 0 {
            return Ok(false);
        }
        let rows: Vec<RowIn> = roster.rows().iter().map(|id| (*id as u64, self.reqs[id].pos, 0, len)).collect();
        let masks = Masks::new();
        let per = self.set.dims.heads_v * self.set.dims.dv;
        for li in 0..self.layers.len() {
            let idx = li as u32;
            match &self.layers[li] {
                LayerDef::DeltaNet { params, weights } => {
                    let (params, weights) = (params.clone(), weights.clone());
                    let [q, a, b] = self.ssm_inputs(idx, &rows, len, None);
                    let Rows::Ssm(batch) = &mut self.batch[li] else { unreachable!() };
                    let padded = batch.padding().is_some();
                    let y = batch.commit_span(&q, &a, &b, &params).map_err(|e| mlx("ssm commit_span", e))?;
                    if cx.observer.wants_calls() {
                        // The oracle sees the span as what it promises to equal: one decode per position.
                        let reqs = roster.rows().to_vec();
                        let spans = vec![(0usize, 1usize); reqs.len()];
                        let read = if padded { Read::Window } else { Read::Decode };
                        for t in 0..len as i32 {
                            let at = |x: &Array| {
                                x.try_index((.., t..t + 1, ..)).map_err(|e| Failure::new("mlx", format!("slice: {e}")))
                            };
                            let (qt, at_, bt, yt) = (at(&q)?, at(&a)?, at(&b)?, at(&y)?);
                            let call = Call::SsmCall {
                                req: None,
                                layer: li,
                                read,
                                reqs: &reqs,
                                qkv: &qt,
                                a: &at_,
                                b: &bt,
                                out: &yt,
                                spans: &spans,
                            };
                            emit(cx, call)?;
                        }
                    }
                    let yb = words(&y)?;
                    cx.hasher.update(&yb.digest());
                    for r in 0..roster.rows().len() {
                        let id = roster.rows()[r];
                        let tokens = self.tokens(idx, id as u64, rows[r].1, len);
                        let req = self.reqs.get_mut(&id).unwrap();
                        let Cache::Ssm(twin) = &mut req.twin[li] else { unreachable!() };
                        let mut steps = Vec::with_capacity(len);
                        for t in 0..len {
                            let (pq, pa, pb) =
                                (pick(&q, r, t, t + 1, 1)?, pick(&a, r, t, t + 1, 1)?, pick(&b, r, t, t + 1, 1)?);
                            steps.push(twin.decode(&pq, &pa, &pb, &params).map_err(|e| mlx("twin decode", e))?);
                        }
                        let ty = mlx_rs::ops::concatenate(&steps, 1).map_err(|e| mlx_fail("concatenate", e))?;
                        let tb = words(&ty)?;
                        let mut model = req.models[li].take().unwrap();
                        let got = self.check_row_output(
                            idx,
                            &format!("row {r} span of {len} vs single steps"),
                            &yb,
                            r * len * per,
                            &tb,
                            &mut model,
                            &weights,
                            &tokens,
                        );
                        self.reqs.get_mut(&id).unwrap().models[li] = Some(model);
                        got?;
                        self.record("ssm_span_vs_single_steps", 1);
                    }
                }
                LayerDef::Attention { .. } => {
                    let [k, v, q] = self.attn_inputs(idx, &rows, len, None);
                    let Rows::Attn(batch) = &mut self.batch[li] else { unreachable!() };
                    let out =
                        batch.commit_span(&k, &v, &q, SCALE, &masks).map_err(|e| mlx("attention commit_span", e))?;
                    cx.hasher.update(&words(&out)?.digest());
                    for r in 0..roster.rows().len() {
                        let id = roster.rows()[r];
                        let Cache::Attn(twin) = &mut self.reqs.get_mut(&id).unwrap().twin[li] else { unreachable!() };
                        let mut steps = Vec::with_capacity(len);
                        for t in 0..len {
                            let (pk, pv, pq) =
                                (pick(&k, r, t, t + 1, 2)?, pick(&v, r, t, t + 1, 2)?, pick(&q, r, t, t + 1, 2)?);
                            let (o, _) = twin
                                .decode(&pk, &pv, &pq, SCALE, &Masks::new())
                                .map_err(|e| mlx("twin attention decode", e))?;
                            steps.push(o);
                        }
                        let to = mlx_rs::ops::concatenate(&steps, 2).map_err(|e| mlx_fail("concatenate", e))?;
                        self.record_measured(
                            "hybrid_attention_output_vs_twin",
                            &words(&pick(&out, r, 0, len, 2)?)?,
                            &words(&to)?,
                        );
                    }
                }
            }
        }
        self.advance(roster, &vec![len; roster.rows().len()]);
        Ok(true)
    }

    /// A speculative round of `gamma` draft positions; row `r` accepts `min(accept[r], gamma)` (all when absent).
    pub(super) fn verify(&mut self, cx: &mut Cx<'_>, gamma: usize, accept: &[u32]) -> Res<bool> {
        let roster = cx.roster;
        if roster.rows().is_empty() || gamma == 0 {
            return Ok(false);
        }
        let n = roster.rows().len();
        let keep: Vec<usize> =
            (0..n).map(|r| (accept.get(r).copied().unwrap_or(gamma as u32) as usize).min(gamma)).collect();
        self.round_no += 1;
        self.counters.recurrent.rounds += 1;
        // Pre-round twins: the fresh-prefix runs start from them.
        let snapshots: Vec<Vec<Cache>> = roster.rows().iter().map(|id| self.reqs[id].twin.clone()).collect();
        for b in &mut self.batch {
            if let Rows::Ssm(b) = b {
                if b.trim(1) != Err(CacheError::RecurrentNotTrimmable) {
                    crate::sim::check::fail(Failure::new(
                        "ssm_round_errors",
                        "a trim of a recurrent state was not refused",
                    ))?;
                }
                b.spec_round_begin().map_err(|e| mlx("begin", e))?;
                if b.spec_round_begin() != Err(CacheError::SpecRoundActive) {
                    crate::sim::check::fail(Failure::new("ssm_round_errors", "a second begin was not refused"))?;
                }
                self.counters.expected_errors += 2;
            }
        }
        self.batch_forward(cx, gamma, &vec![(0, gamma); n], Some(&keep))?;
        let all = keep.iter().all(|&k| k == gamma);
        let unequal = keep.iter().any(|&k| k != keep[0]);
        for li in 0..self.layers.len() {
            match &self.layers[li] {
                LayerDef::DeltaNet { params, .. } => {
                    let params = params.clone();
                    // Inputs of the fresh-prefix runs, built before the batch is borrowed.
                    let fresh_inputs: Vec<Option<[Array; 3]>> = keep
                        .iter()
                        .enumerate()
                        .map(|(r, &k)| {
                            let id = roster.rows()[r];
                            (k > 0)
                                .then(|| self.ssm_inputs(li as u32, &[(id as u64, self.reqs[&id].pos, 0, k)], k, None))
                        })
                        .collect();
                    let Rows::Ssm(b) = &mut self.batch[li] else { unreachable!() };
                    let before = b.stats();
                    if all {
                        b.spec_round_commit().map_err(|e| mlx("commit", e))?;
                    } else {
                        let too_far = vec![gamma + 1; n];
                        if b.spec_round_rollback_rows(&too_far)
                            != Err(CacheError::KeepOutsideWindow { keep: gamma + 1, window: gamma })
                        {
                            return Err(Failure::new("ssm_round_errors", "keep beyond the window was not refused"));
                        }
                        self.counters.expected_errors += 1;
                        b.spec_round_rollback_rows(&keep).map_err(|e| mlx("rollback", e))?;
                    }
                    let after = b.stats();
                    let (hr, cr) = (words(b.recurrent())?, words(b.conv())?);
                    let offsets = b.offsets().to_vec();
                    self.counters.recurrent.replays += after.replays - before.replays;
                    self.counters.recurrent.replayed_steps += after.replayed_steps - before.replayed_steps;
                    for (r, &k) in keep.iter().enumerate() {
                        let id = roster.rows()[r];
                        let Cache::Ssm(t) = &mut self.reqs.get_mut(&id).unwrap().twin[li] else { unreachable!() };
                        if all {
                            t.spec_round_commit().map_err(|e| mlx("twin commit", e))?;
                        } else {
                            t.spec_round_rollback(k).map_err(|e| mlx("twin rollback", e))?;
                        }
                        if all {
                            continue;
                        }
                        // Replay vs a fresh run of the accepted prefix from the pre-round state.
                        let Cache::Ssm(mut fresh) = snapshots[r][li].clone() else { unreachable!() };
                        if let Some([q, a, b]) = &fresh_inputs[r] {
                            fresh.window(q, a, b, &params).map_err(|e| mlx("fresh prefix", e))?;
                        }
                        let (fr, fc) = (words(fresh.recurrent())?, words(fresh.conv())?);
                        let same = same_slice(&hr, r * fr.words.len(), &fr)
                            && same_slice(&cr, r * fc.words.len(), &fc)
                            && fresh.offsets()[0] == offsets[r];
                        self.counters.recurrent.replay_vs_fresh += 1;
                        self.counters.checks += 1;
                        if !same {
                            crate::sim::check::fail(Failure::new(
                                "ssm_replay_vs_fresh",
                                format!("layer {li} row {r}: keep {k} of {gamma}: replayed state is not the fresh prefix run"),
                            ))?;
                        }
                        self.record("ssm_replay_vs_fresh", 1);
                    }
                }
                LayerDef::Attention { .. } => {
                    let cut: Vec<usize> = keep.iter().map(|&k| gamma - k).collect();
                    if cut.iter().any(|&x| x > 0) {
                        let Rows::Attn(b) = &mut self.batch[li] else { unreachable!() };
                        b.trim_rows(&cut, true).map_err(|e| mlx("trim_rows", e))?;
                        for (r, &x) in cut.iter().enumerate() {
                            let id = roster.rows()[r];
                            let Cache::Attn(t) = &mut self.reqs.get_mut(&id).unwrap().twin[li] else { unreachable!() };
                            t.trim(x, true).map_err(|e| mlx("twin trim", e))?;
                        }
                    }
                }
            }
        }
        if all {
            self.counters.recurrent.commits += 1;
        } else {
            self.counters.recurrent.rollbacks += 1;
            self.counters.recurrent.rollbacks_unequal += u64::from(unequal);
        }
        if cx.observer.wants_calls() {
            let reqs = roster.rows().to_vec();
            emit(cx, Call::SsmRound { reqs: &reqs, gamma, keep: &keep })?;
        }
        self.advance(roster, &keep);
        Ok(true)
    }
}
