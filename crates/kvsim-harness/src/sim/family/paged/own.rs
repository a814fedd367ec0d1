//! The paged family's own ops (parallel sampling, eviction) and the save/restore of every store.

use mlx_rs::Array;

use super::{cache_fail, pool_fail, Paged, Res, FORK_OWNER};
use crate::sim::check::{self, Failure};
use crate::sim::family::attention::mlx_fail;
use crate::sim::family::{persist_through_bytes, Cx};
use kvsim_cache::bytes::ArrayBytes;
use kvsim_cache::{CacheError, Masks, PagedStore, SeqId};

impl Paged {
    /// Parallel sampling from request `id` (see [`PagedAction::Fork`]).
    pub(super) fn fork(&mut self, cx: &mut Cx<'_>, id: u32, n: usize, len: usize, finish: bool) -> Res<bool> {
        if !self.reqs.contains_key(&id) || n == 0 || len == 0 {
            return Ok(false);
        }
        let parent = self.reqs[&id].clone();
        for _ in 0..n {
            let m = self.model.fork(parent.seq.0);
            for st in self.stores.iter_mut().chain(std::iter::once(&mut self.placement)) {
                let s = st.fork(parent.seq).map_err(|e| cache_fail("fork", e))?;
                if s.0 != m {
                    return Err(pool_fail(format!("fork: sequence {s:?}, the model {m}")));
                }
            }
            self.forks += 1;
            self.counters.paged.forks += 1;
            let mut sib = parent.clone();
            sib.seq = SeqId(m);
            sib.owner = FORK_OWNER + self.forks;
            let (ts, hs, toks) = self.next(&sib, len);
            let verdict = self.model.check_write(&[(m, len)]);
            let before = self.model.clone();
            let scale = self.cfg.scale();
            let mut pairs = vec![];
            for layer in 0..self.cfg.layers {
                let (k, v, q) = self.kvq(layer, &[toks.clone()])?;
                let got = self.stores[layer].window(sib.seq, &ts, &k, &v, &q, scale);
                self.write_matches("fork window", &verdict, &got.as_ref().map(|_| ()).map_err(Clone::clone))?;
                if layer == 0 {
                    let p = self.placement.window(sib.seq, &ts, &k, &v, &q, scale);
                    self.write_matches("placement fork", &verdict, &p.as_ref().map(|_| ()).map_err(Clone::clone))?;
                    if let (Ok(a), Ok(b)) = (&got, p) {
                        pairs.push((a.clone(), b, true));
                        self.counters.paged.placement_compared += 1;
                    }
                }
                if let Ok(a) = got {
                    let tw = &mut sib.twin[layer];
                    let (b, _) = tw.window(&k, &v, &q, scale, &Masks::new()).map_err(|e| cache_fail("twin", e))?;
                    pairs.push((a, b, false));
                }
            }
            if verdict.is_err() {
                self.counters.paged.pool_exhausted += 1;
                self.counters.expected_errors += 1;
            } else {
                self.model.write(&[m], &[ts.clone()], true);
                self.count_write(&before, &[(m, len)]);
                let refs: Vec<(&Array, &Array, bool)> = pairs.iter().map(|(a, b, p)| (a, b, *p)).collect();
                self.compare_outputs(cx, "forked read against a copy of the twin", &refs, parent.warm)?;
                sib.tokens.extend(ts);
                sib.chain.extend(hs);
                sib.toks.extend(toks);
                self.check_request(cx, &sib, "forked sequence")?;
            }
            if finish {
                self.finish_seq(sib.seq)?;
            } else {
                self.model.release(m);
                for st in self.stores.iter_mut().chain(std::iter::once(&mut self.placement)) {
                    st.release(sib.seq).map_err(|e| cache_fail("release", e))?;
                }
            }
        }
        Ok(true)
    }

    pub(super) fn evict(&mut self, blocks: usize) -> Res<bool> {
        let want = self.model.evict(blocks);
        for st in self.stores.iter_mut().chain(std::iter::once(&mut self.placement)) {
            let got = st.evict(blocks);
            if got != want {
                return Err(pool_fail(format!("evict({blocks}) gave up {got} blocks, the model {want}")));
            }
        }
        self.counters.paged.evictions += want as u64;
        Ok(true)
    }

    /// Save/restore of the whole store of every layer (and of the placement store) through one file of kvsim's
    /// format (`kv:paged-rows:<bs>` entries, damaged copies refused): each restored store must give back the same
    /// parts and the same plane bytes, and the run goes on with the restored stores. A copy of the parts with an
    /// impossible block table must be refused (`InvalidState`) and change nothing.
    pub(super) fn persist(&mut self, cx: &mut Cx<'_>, id: u32) -> Res<bool> {
        use kvsim_persist::{AnyCache, Persisted};
        if !cx.roster.is_solo(id) {
            return Ok(false);
        }
        let all: Vec<PagedStore> = self.stores.iter().chain(std::iter::once(&self.placement)).cloned().collect();
        let mut saved = vec![];
        for st in &all {
            let (parts, planes) = st.to_parts().map_err(|e| cache_fail("to_parts", e))?;
            // An impossible table (a block past the pool) is refused and changes nothing.
            if let Some(at) = parts.seqs.iter().position(|(_, s)| !s.table.is_empty()) {
                let mut bad = parts.clone();
                bad.seqs[at].1.table[0] = parts.refs.len() as u32 + 3;
                match PagedStore::from_parts(bad, planes.clone()) {
                    Err(CacheError::InvalidState { .. }) => self.counters.record_rejected("paged_parts"),
                    other => {
                        return check::fail(Failure::new(
                            "errors",
                            format!("a block table past the pool: expected InvalidState, got {:?}", other.map(|_| ())),
                        ))
                        .map(|_| true)
                    }
                }
            }
            saved.push((parts, planes));
        }
        let persisted = all.into_iter().map(|st| Persisted::new(AnyCache::Paged(st))).collect();
        let restored = persist_through_bytes(persisted, kvsim_persist::inspect::Format::Kvsim, &mut self.counters)?;
        let mut stores = vec![];
        for (i, (c, (parts, planes))) in restored.into_iter().zip(&saved).enumerate() {
            let AnyCache::Paged(st) = c else {
                return check::fail(Failure::new("persist", "a paged store came back as another cache")).map(|_| true);
            };
            let (again, back) = st.to_parts().map_err(|e| cache_fail("to_parts", e))?;
            if &again != parts {
                return check::fail(Failure::new("persist", format!("store {i}: the restored parts differ")))
                    .map(|_| true);
            }
            match (planes, &back) {
                (None, None) => {}
                (Some(p), Some(p2)) if p.len() == p2.len() => {
                    let all: Vec<&Array> = p.iter().chain(p2).collect();
                    let bytes = ArrayBytes::read_many(&all).map_err(|e| mlx_fail("read planes", e))?;
                    let (a, b) = bytes.split_at(p.len());
                    for (j, (x, y)) in a.iter().zip(b).enumerate() {
                        check::bytes_equal(&format!("store {i}: restored plane {j}"), x, y)?;
                        cx.hasher.update(&x.digest());
                    }
                }
                _ => {
                    return check::fail(Failure::new("persist", format!("store {i}: planes lost or gained")))
                        .map(|_| true)
                }
            }
            stores.push(st);
        }
        let placement = stores.pop().expect("the placement store").with_free_order(self.cfg.payload_seed);
        self.placement = placement;
        self.stores = stores;
        self.counters.persist_roundtrips += 1;
        Ok(true)
    }
}
