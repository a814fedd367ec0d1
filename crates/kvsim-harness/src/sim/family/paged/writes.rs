//! The paged family's writes and reads: windows, appends and decodes of one request outside the batch and of the
//! running batch, trims, and the speculative round of a verify.

use mlx_rs::Array;

use super::{cache_fail, pool_fail, Paged, Res};
use crate::sim::check::Failure;
use crate::sim::family::attention::mlx_fail;
use crate::sim::family::Cx;
use kvsim_cache::{CacheError, Masks, PagedStore, SeqId, SerialCache};
use kvsim_reference::Tok;

impl Paged {
    pub(super) fn write_solo(&mut self, cx: &mut Cx<'_>, id: u32, n: usize, read: bool) -> Res<bool> {
        let r = self.reqs[&id].clone();
        let (ts, hs, toks) = self.next(&r, n);
        let verdict = self.model.check_write(&[(r.seq.0, n)]);
        let before = self.model.clone();
        let scale = self.cfg.scale();
        let mut pairs: Vec<(Array, Array, bool)> = vec![];
        let mut twins = r.twin.clone();
        for layer in 0..self.cfg.layers {
            let (k, v, q) = self.kvq(layer, &[toks.clone()])?;
            let got = if read {
                self.stores[layer].window(r.seq, &ts, &k, &v, &q, scale).map(Some)
            } else {
                self.stores[layer].append(r.seq, &ts, &k, &v).map(|_| None)
            };
            self.write_matches("solo write", &verdict, &got.as_ref().map(|_| ()).map_err(Clone::clone))?;
            if layer == 0 {
                let p = if read {
                    self.placement.window(r.seq, &ts, &k, &v, &q, scale).map(Some)
                } else {
                    self.placement.append(r.seq, &ts, &k, &v).map(|_| None)
                };
                self.write_matches("placement store write", &verdict, &p.as_ref().map(|_| ()).map_err(Clone::clone))?;
                if let (Ok(Some(a)), Ok(Some(b))) = (&got, &p) {
                    pairs.push((a.clone(), b.clone(), true));
                    self.counters.paged.placement_compared += 1;
                }
            }
            if verdict.is_err() {
                continue;
            }
            let t = if read {
                Some(twins[layer].window(&k, &v, &q, scale, &Masks::new()).map_err(|e| cache_fail("twin", e))?.0)
            } else {
                twins[layer].append(&k, &v).map_err(|e| cache_fail("twin", e))?;
                None
            };
            if let (Ok(Some(a)), Some(b)) = (got, t) {
                pairs.push((a, b, false));
            }
        }
        if verdict.is_err() {
            self.counters.paged.pool_exhausted += 1;
            self.counters.expected_errors += 1;
            return Ok(true);
        }
        self.model.write(&[r.seq.0], &[ts.clone()], true);
        self.count_write(&before, &[(r.seq.0, n)]);
        let refs: Vec<(&Array, &Array, bool)> = pairs.iter().map(|(a, b, p)| (a, b, *p)).collect();
        self.compare_outputs(cx, "solo read against its twin", &refs, r.warm)?;
        let e = self.reqs.get_mut(&id).expect("live");
        e.tokens.extend(ts);
        e.chain.extend(hs);
        e.toks.extend(toks);
        e.twin = twins;
        Ok(true)
    }

    pub(super) fn solo_decode(&mut self, cx: &mut Cx<'_>, id: u32) -> Res<bool> {
        if !cx.roster.is_solo(id) {
            return Ok(false);
        }
        let r = self.reqs[&id].clone();
        let (ts, hs, toks) = self.next(&r, 1);
        let verdict = self.model.check_write(&[(r.seq.0, 1)]);
        let before = self.model.clone();
        let scale = self.cfg.scale();
        let mut pairs = vec![];
        let mut twins = r.twin.clone();
        for layer in 0..self.cfg.layers {
            let (k, v, q) = self.kvq(layer, &[toks.clone()])?;
            let got = self.stores[layer].decode(r.seq, ts[0], &k, &v, &q, scale);
            self.write_matches("solo decode", &verdict, &got.as_ref().map(|_| ()).map_err(Clone::clone))?;
            if layer == 0 {
                let p = self.placement.decode(r.seq, ts[0], &k, &v, &q, scale);
                self.write_matches("placement decode", &verdict, &p.as_ref().map(|_| ()).map_err(Clone::clone))?;
                if let (Ok(a), Ok(b)) = (&got, p) {
                    pairs.push((a.clone(), b, true));
                    self.counters.paged.placement_compared += 1;
                }
            }
            if let Ok(a) = got {
                let (b, _) =
                    twins[layer].decode(&k, &v, &q, scale, &Masks::new()).map_err(|e| cache_fail("twin", e))?;
                pairs.push((a, b, false));
            }
        }
        if verdict.is_err() {
            self.counters.paged.pool_exhausted += 1;
            self.counters.expected_errors += 1;
            return Ok(true);
        }
        self.model.write(&[r.seq.0], &[ts.clone()], false);
        self.count_write(&before, &[(r.seq.0, 1)]);
        let refs: Vec<(&Array, &Array, bool)> = pairs.iter().map(|(a, b, p)| (a, b, *p)).collect();
        self.compare_outputs(cx, "solo decode against its twin", &refs, r.warm)?;
        let e = self.reqs.get_mut(&id).expect("live");
        e.tokens.extend(ts);
        e.chain.extend(hs);
        e.toks.extend(toks);
        e.twin = twins;
        Ok(true)
    }

    /// One step for every row: a decode (`len == 0`), or a window / append of `len` positions.
    pub(super) fn batch_write(&mut self, cx: &mut Cx<'_>, len: usize, read: bool) -> Res<bool> {
        let rows: Vec<u32> = cx.roster.rows().to_vec();
        if rows.is_empty() {
            return Ok(false);
        }
        let decode = len == 0;
        let n = len.max(1);
        let mut next = vec![];
        for id in &rows {
            let r = self.reqs[id].clone();
            next.push(self.next(&r, n));
        }
        let seqs: Vec<u64> = rows.iter().map(|id| self.reqs[id].seq.0).collect();
        let writes: Vec<(u64, usize)> = seqs.iter().map(|&s| (s, n)).collect();
        let verdict = self.model.check_write(&writes);
        let before = self.model.clone();
        let scale = self.cfg.scale();
        let masks = Masks::new();
        let mut pairs = vec![];
        let mut warm = false;
        let mut twins: Vec<Vec<SerialCache>> = rows.iter().map(|id| self.reqs[id].twin.clone()).collect();
        let row_toks: Vec<Vec<Tok>> = next.iter().map(|x| x.2.clone()).collect();
        let tokens: Vec<Vec<u32>> = next.iter().map(|x| x.0.clone()).collect();
        let firsts: Vec<u32> = tokens.iter().map(|t| t[0]).collect();
        for layer in 0..self.cfg.layers {
            let (k, v, q) = self.kvq(layer, &row_toks)?;
            let run = |st: &mut PagedStore| -> Result<Option<Array>, CacheError> {
                if decode {
                    st.rows_decode(&firsts, &k, &v, &q, scale, &masks).map(|o| Some(o.0))
                } else if read {
                    st.rows_window(&tokens, &k, &v, &q, scale, &masks).map(|o| Some(o.0))
                } else {
                    st.rows_append(&tokens, &k, &v).map(|_| None)
                }
            };
            let got = run(&mut self.stores[layer]);
            self.write_matches("batch write", &verdict, &got.as_ref().map(|_| ()).map_err(Clone::clone))?;
            if layer == 0 {
                let p = run(&mut self.placement);
                self.write_matches("placement batch write", &verdict, &p.as_ref().map(|_| ()).map_err(Clone::clone))?;
                if let (Ok(Some(a)), Ok(Some(b))) = (&got, p) {
                    pairs.push((a.clone(), b, true));
                    self.counters.paged.placement_compared += 1;
                }
            }
            let Ok(out) = got else { continue };
            for (i, id) in rows.iter().enumerate() {
                warm |= self.reqs[id].warm;
                let (k, v, q) = self.kvq(layer, &[row_toks[i].clone()])?;
                let tw = &mut twins[i][layer];
                let t = if decode {
                    Some(tw.decode(&k, &v, &q, scale, &Masks::new()).map_err(|e| cache_fail("twin", e))?.0)
                } else if read {
                    Some(tw.window(&k, &v, &q, scale, &Masks::new()).map_err(|e| cache_fail("twin", e))?.0)
                } else {
                    tw.append(&k, &v).map_err(|e| cache_fail("twin", e))?;
                    None
                };
                if let (Some(o), Some(t)) = (&out, t) {
                    let row = o.take_axis(Array::from_slice(&[i as i32], &[1]), 0).map_err(|e| mlx_fail("row", e))?;
                    pairs.push((row, t, false));
                }
            }
        }
        if verdict.is_err() {
            self.counters.paged.pool_exhausted += 1;
            self.counters.expected_errors += 1;
            return Ok(true);
        }
        self.model.write(&seqs, &tokens, !decode);
        self.count_write(&before, &writes);
        let refs: Vec<(&Array, &Array, bool)> = pairs.iter().map(|(a, b, p)| (a, b, *p)).collect();
        self.compare_outputs(cx, "batch read against the twins", &refs, warm)?;
        for (i, id) in rows.iter().enumerate() {
            let (ts, hs, toks) = next[i].clone();
            let e = self.reqs.get_mut(id).expect("live");
            e.tokens.extend(ts);
            e.chain.extend(hs);
            e.toks.extend(toks);
            e.twin = std::mem::take(&mut twins[i]);
        }
        Ok(true)
    }

    /// Trims: `n[i]` positions of `ids[i]` (rows together, or one request outside the batch).
    pub(super) fn trims(&mut self, ids: &[u32], n: &[usize], bypass: bool, batch: bool) -> Res<()> {
        let seqs: Vec<u64> = ids.iter().map(|id| self.reqs[id].seq.0).collect();
        let verdict = seqs.iter().zip(n).map(|(&s, &k)| self.model.check_trim(s, k, bypass)).find(|v| v.is_err());
        let verdict = verdict.unwrap_or(Ok(()));
        for st in self.stores.iter_mut().chain(std::iter::once(&mut self.placement)) {
            let got = if batch { st.rows_trim(n, bypass) } else { st.trim(SeqId(seqs[0]), n[0], bypass).map(|_| ()) };
            Paged::trim_matches("trim", &verdict, &got)?;
        }
        if verdict.is_err() {
            // Nothing moved in any store; the twins are not asked (a refused trim never reaches them).
            self.counters.expected_errors += 1;
            return Ok(());
        }
        self.trim_twins_and_model(ids, &seqs, n, bypass)
    }

    /// The twins and the model follow trims the stores made.
    pub(super) fn trim_twins_and_model(&mut self, ids: &[u32], seqs: &[u64], n: &[usize], bypass: bool) -> Res<()> {
        for (id, &k) in ids.iter().zip(n) {
            let r = self.reqs.get_mut(id).expect("live");
            for tw in &mut r.twin {
                tw.trim(k, bypass).map_err(|e| cache_fail("twin trim", e))?;
            }
        }
        for (id, (&s, &k)) in ids.iter().zip(seqs.iter().zip(n)) {
            self.model.trim(s, k, bypass);
            let r = self.reqs.get_mut(id).expect("live");
            let off = r.tokens.len() - k;
            r.tokens.truncate(off);
            r.chain.truncate(off);
            r.toks.truncate(off);
        }
        Ok(())
    }

    pub(super) fn verify(&mut self, cx: &mut Cx<'_>, gamma: usize, accept: &[u32]) -> Res<bool> {
        let rows: Vec<u32> = cx.roster.rows().to_vec();
        if rows.is_empty() || gamma == 0 {
            return Ok(false);
        }
        for st in self.stores.iter_mut().chain(std::iter::once(&mut self.placement)) {
            st.round_begin().map_err(|e| cache_fail("round_begin", e))?;
        }
        let exhausted = self.counters.paged.pool_exhausted;
        self.batch_write(cx, gamma, true)?;
        if self.counters.paged.pool_exhausted > exhausted {
            // No verify window happened: the round ends with nothing to keep or drop.
            for st in self.stores.iter_mut().chain(std::iter::once(&mut self.placement)) {
                st.round_commit().map_err(|e| cache_fail("round_commit", e))?;
            }
            return Ok(true);
        }
        // A save while the round is armed is refused, and so is a change of the batch's rows.
        for st in self.stores.iter_mut().chain(std::iter::once(&mut self.placement)) {
            let before = format!("{st:?}");
            match (st.to_parts(), st.filter(&[])) {
                (Err(CacheError::SpecRoundActive), Err(CacheError::SpecRoundActive)) => {}
                (a, b) => {
                    return Err(Failure::new(
                        "errors",
                        format!(
                            "a save and a filter inside an armed round: expected SpecRoundActive twice, got {:?}, {:?}",
                            a.map(|_| ()),
                            b.map(|_| ())
                        ),
                    ))
                }
            }
            if format!("{st:?}") != before {
                return Err(pool_fail("a refused save or filter inside a round changed the store".to_string()));
            }
            self.counters.record_rejected("paged_save_in_round");
        }
        self.check_all(cx)?;
        let keep: Vec<usize> =
            (0..rows.len()).map(|r| (accept.get(r).copied().unwrap_or(gamma as u32) as usize).min(gamma)).collect();
        let rollback: Vec<usize> = keep.iter().map(|&k| gamma - k).collect();
        let seqs: Vec<u64> = rows.iter().map(|id| self.reqs[id].seq.0).collect();
        for (&s, &k) in seqs.iter().zip(&rollback) {
            if let Err(e) = self.model.check_trim(s, k, true) {
                return Err(pool_fail(format!("the model refuses the round's rollback of {k}: {e:?}")));
            }
        }
        for st in self.stores.iter_mut().chain(std::iter::once(&mut self.placement)) {
            st.round_rollback(&keep).map_err(|e| cache_fail("round_rollback", e))?;
        }
        self.trim_twins_and_model(&rows, &seqs, &rollback, true)?;
        Ok(true)
    }
}
