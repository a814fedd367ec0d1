//! The paged family's right-padded prefill of the running batch.

use mlx_rs::Array;

use super::{cache_fail, pool_fail, Paged, Res};
use crate::sim::check::{self, Failure};
use crate::sim::family::attention::{mlx_fail, payload_block};
use crate::sim::family::Cx;
use kvsim_cache::{CacheError, Masks, SerialCache};
use kvsim_reference::{Tensor, Tok};

impl Paged {
    /// A right-padded prefill of the running batch (rows `ids`, in row order): `rows_prepare(lens)` on every
    /// store; while it is pending, a decode, a second prepare, a filter, a save and a round are
    /// `PendingPrefill` with nothing changed; then at most `max_chunks` window chunks of `chunk` positions, in which
    /// row `r` takes `min(left_r, L)` real positions (only those are compared with its twin, and only those take pool
    /// blocks); then `rows_finalize` (the undelivered positions are forgotten), and a second finalize is
    /// `NoPendingPrefill`. A chunk the pool cannot hold is `PoolExhausted` with nothing changed, and ends the
    /// prefill there.
    pub(super) fn prefill(
        &mut self,
        cx: &mut Cx<'_>,
        ids: &[u32],
        lens: &[usize],
        chunk: usize,
        max_chunks: usize,
    ) -> Res<()> {
        let (h, hq, d, dt) = (self.cfg.heads_kv, self.cfg.heads_q, self.cfg.head_dim, self.dtype());
        let b = ids.len();
        let zeros = |heads: usize| mlx_rs::ops::zeros_dtype(&[b as i32, heads as i32, 1, d as i32], dt);
        let (zk, zq) = (zeros(h).map_err(|e| mlx_fail("zeros", e))?, zeros(hq).map_err(|e| mlx_fail("zeros", e))?);
        for st in self.stores.iter_mut().chain(std::iter::once(&mut self.placement)) {
            st.rows_prepare(lens).map_err(|e| cache_fail("rows_prepare", e))?;
            let before = format!("{st:?}");
            let refused = [
                st.rows_decode(&vec![0; b], &zk, &zk, &zq, 1.0, &Masks::new()).map(|_| ()),
                st.rows_prepare(lens),
                st.filter(&[]).map(|_| ()),
                st.to_parts().map(|_| ()),
                st.round_begin(),
            ];
            if refused.iter().any(|r| !matches!(r, Err(CacheError::PendingPrefill))) {
                return check::fail(Failure::new(
                    "errors",
                    format!("a decode, prepare, filter, save and round while a prefill is pending: {refused:?}"),
                ));
            }
            if format!("{st:?}") != before {
                return check::fail(pool_fail("a refused call during a prefill changed the store".to_string()));
            }
            self.counters.record_rejected("paged_pending_prefill");
        }
        let scale = self.cfg.scale();
        let masks = Masks::new();
        let total = lens.iter().copied().max().unwrap_or(0);
        let mut left = lens.to_vec();
        // Each row's count in the last chunk it took positions of, when that was only part of the chunk.
        let mut partial: Vec<Option<usize>> = vec![None; b];
        let (mut done, mut chunks) = (0, 0);
        while done < total && chunks < max_chunks {
            chunks += 1;
            let l = chunk.min(total - done);
            let real: Vec<usize> = left.iter().map(|&n| n.min(l)).collect();
            let next: Vec<(Vec<u32>, Vec<u64>, Vec<Tok>)> = ids
                .iter()
                .zip(&real)
                .map(|(id, &n)| {
                    let r = self.reqs[id].clone();
                    self.next(&r, n)
                })
                .collect();
            let written: Vec<usize> = (0..b).filter(|&r| real[r] > 0).collect();
            let writes: Vec<(u64, usize)> = written.iter().map(|&r| (self.reqs[&ids[r]].seq.0, real[r])).collect();
            let verdict = self.model.check_write(&writes);
            let before = self.model.clone();
            // Every row's chunk: its real positions, then padding (token id 0, the value space's pad values).
            let tokens: Vec<Vec<u32>> =
                next.iter().map(|x| x.0.iter().copied().chain(std::iter::repeat(0)).take(l).collect()).collect();
            let padded: Vec<Vec<Option<Tok>>> = next
                .iter()
                .map(|x| x.2.iter().copied().map(Some).chain(std::iter::repeat(None)).take(l).collect())
                .collect();
            let mut twins: Vec<Vec<SerialCache>> = ids.iter().map(|id| self.reqs[id].twin.clone()).collect();
            let mut pairs = vec![];
            let mut warm = false;
            for layer in 0..self.cfg.layers {
                let (k, v, q) = (
                    payload_block(&self.cfg, &self.vs, layer, Tensor::K, &padded)?,
                    payload_block(&self.cfg, &self.vs, layer, Tensor::V, &padded)?,
                    payload_block(&self.cfg, &self.vs, layer, Tensor::Q, &padded)?,
                );
                let got = self.stores[layer].rows_window(&tokens, &k, &v, &q, scale, &masks);
                self.write_matches("prefill chunk", &verdict, &got.as_ref().map(|_| ()).map_err(Clone::clone))?;
                if layer == 0 {
                    let p = self.placement.rows_window(&tokens, &k, &v, &q, scale, &masks);
                    self.write_matches("placement prefill", &verdict, &p.as_ref().map(|_| ()).map_err(Clone::clone))?;
                    if let (Ok(a), Ok(b)) = (&got, p) {
                        pairs.push((a.0.clone(), b.0, true));
                        self.counters.paged.placement_compared += 1;
                    }
                }
                let Ok((out, _)) = got else { continue };
                for &r in &written {
                    warm |= self.reqs[&ids[r]].warm;
                    let (k, v, q) = self.kvq(layer, &[next[r].2.clone()])?;
                    let (t, _) =
                        twins[r][layer].window(&k, &v, &q, scale, &Masks::new()).map_err(|e| cache_fail("twin", e))?;
                    let at = Array::from_slice(&[r as i32], &[1]);
                    let row = out.take_axis(&at, 0).map_err(|e| mlx_fail("row", e))?;
                    let cut: Vec<i32> = (0..real[r] as i32).collect();
                    let row =
                        row.take_axis(Array::from_slice(&cut, &[real[r] as i32]), 2).map_err(|e| mlx_fail("cut", e))?;
                    pairs.push((row, t, false));
                }
            }
            if verdict.is_err() {
                self.counters.paged.pool_exhausted += 1;
                self.counters.expected_errors += 1;
                break;
            }
            let seqs: Vec<u64> = writes.iter().map(|w| w.0).collect();
            let toks: Vec<Vec<u32>> = written.iter().map(|&r| next[r].0.clone()).collect();
            self.model.write(&seqs, &toks, true);
            self.count_write(&before, &writes);
            let refs: Vec<(&Array, &Array, bool)> = pairs.iter().map(|(a, b, p)| (a, b, *p)).collect();
            self.compare_outputs(cx, "prefill chunk against the twins", &refs, warm)?;
            // Rows that end at the same length, one of them with only part of the chunk (it started further on).
            let ends: Vec<usize> = written.iter().map(|&r| self.reqs[&ids[r]].tokens.len() + real[r]).collect();
            let same_end_partial = written
                .iter()
                .enumerate()
                .any(|(i, &r)| real[r] < l && written.iter().enumerate().any(|(j, _)| j != i && ends[j] == ends[i]));
            if same_end_partial {
                self.reach("paged/prefill_partial_same_end");
            }
            for &r in &written {
                partial[r] = (real[r] < l).then_some(real[r]);
            }
            for (r, id) in ids.iter().enumerate() {
                let (ts, hs, toks) = next[r].clone();
                let e = self.reqs.get_mut(id).expect("live");
                e.tokens.extend(ts);
                e.chain.extend(hs);
                e.toks.extend(toks);
                e.twin = std::mem::take(&mut twins[r]);
                left[r] -= real[r];
            }
            self.counters.paged.prefill_chunks += 1;
            done += l;
        }
        for st in self.stores.iter_mut().chain(std::iter::once(&mut self.placement)) {
            st.rows_finalize().map_err(|e| cache_fail("rows_finalize", e))?;
            match st.rows_finalize() {
                Err(CacheError::NoPendingPrefill) => self.counters.expected_errors += 1,
                other => {
                    return check::fail(Failure::new("errors", format!("a second finalize: {other:?}")));
                }
            }
        }
        self.probe_partial_rollbacks(ids, &partial)
    }

    /// The rollback limit of every row whose last chunk it took only in part is its own count in that chunk, not
    /// the chunk's width: on a copy of layer 0's store, a rollback of one more is `TrimTooLong` and one of exactly
    /// that many leaves the row where the model says, as the model's verdicts have it.
    fn probe_partial_rollbacks(&mut self, ids: &[u32], partial: &[Option<usize>]) -> Res<()> {
        for (id, lw) in ids.iter().zip(partial) {
            let Some(lw) = *lw else { continue };
            let seq = self.reqs[id].seq;
            let offset = self.model.seqs[&seq.0].offset();
            for n in [lw + 1, lw] {
                let verdict = self.model.check_trim(seq.0, n, true);
                let mut probe = self.stores[0].clone();
                let got = probe.trim(seq, n, true).map(|_| ());
                Paged::trim_matches("a rollback of a row that took part of its last prefill chunk", &verdict, &got)?;
                if got.is_ok() {
                    probe.audit().map_err(|e| pool_fail(format!("after a probing rollback: {e}")))?;
                    let held = probe.seq(seq).map_err(|e| cache_fail("seq", e))?.offset;
                    if held != offset - n {
                        return check::fail(pool_fail(format!(
                            "a rollback of {n} from {offset} positions left {held}, expected {}",
                            offset - n
                        )));
                    }
                } else {
                    self.counters.expected_errors += 1;
                }
                self.counters.checks += 1;
            }
        }
        Ok(())
    }
}
