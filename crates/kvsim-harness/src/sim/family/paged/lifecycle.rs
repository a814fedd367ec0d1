//! The paged family's lifecycle: the roster's changes carried out on every store and the model (admission, rows
//! entering and leaving, filter, batch prefill of fresh requests), a request's end (its full blocks enter the
//! index), and the prefix lookup before a request's first window.

use super::{cache_fail, pool_fail, Paged, Req, Res};
use crate::sim::family::Cx;
use crate::sim::roster::Change;
use kvsim_cache::{Masks, SeqId};

impl Paged {
    pub(super) fn carry_out(&mut self, cx: &mut Cx<'_>, change: &Change) -> Res<bool> {
        match change {
            Change::Admit { req } => {
                let m = self.model.open();
                let mut ids: Vec<SeqId> = self.stores.iter_mut().map(|s| s.open()).collect();
                ids.push(self.placement.open());
                if ids.iter().any(|s| s.0 != m) {
                    return Err(pool_fail(format!("admit: sequence ids {ids:?}, the model {m}")));
                }
                let seq = SeqId(m);
                let twin = (0..self.cfg.layers).map(|_| self.new_twin()).collect::<Res<Vec<_>>>()?;
                let r = Req {
                    seq,
                    owner: u64::from(*req),
                    tokens: vec![],
                    chain: vec![],
                    toks: vec![],
                    twin,
                    warm: false,
                    looked_up: false,
                };
                self.reqs.insert(*req, r);
            }
            Change::Enter { ids, perm } => {
                let seqs: Vec<SeqId> = ids.iter().map(|id| self.reqs[id].seq).collect();
                for st in self.stores.iter_mut().chain(std::iter::once(&mut self.placement)) {
                    st.reorder(perm).map_err(|e| cache_fail("reorder", e))?;
                    st.join(&seqs).map_err(|e| cache_fail("join", e))?;
                }
                self.model.rows = perm.iter().map(|&r| self.model.rows[r]).collect();
                self.model.rows.extend(seqs.iter().map(|s| s.0));
            }
            Change::Extract { row, req, finish, .. } => {
                let want = self.reqs[req].seq;
                for st in self.stores.iter_mut().chain(std::iter::once(&mut self.placement)) {
                    let got = st.extract(*row).map_err(|e| cache_fail("extract", e))?;
                    if got != want {
                        return Err(pool_fail(format!("extract of row {row}: sequence {got:?}, expected {want:?}")));
                    }
                }
                self.model.rows.remove(*row);
                if *finish {
                    self.end(*req)?;
                }
            }
            Change::Filter { kept, dropped } => {
                let mut want: Vec<SeqId> = dropped.iter().map(|id| self.reqs[id].seq).collect();
                want.sort();
                for st in self.stores.iter_mut().chain(std::iter::once(&mut self.placement)) {
                    let mut got = st.filter(kept).map_err(|e| cache_fail("filter", e))?;
                    got.sort();
                    if got != want {
                        return Err(pool_fail(format!("filter dropped {got:?}, expected {want:?}")));
                    }
                }
                self.model.rows = kept.iter().map(|&r| self.model.rows[r]).collect();
                for id in dropped {
                    self.end(*id)?;
                }
            }
            Change::Prefill { ids, lens, chunk, .. } => {
                // Each fresh request's prompt is looked up in the index first (as before a solo window: the prefill
                // then computes its positions after the prefix it got); the requests join as rows, then one
                // right-padded prefill of the whole batch in which the running rows take no position.
                for (id, &len) in ids.iter().zip(lens) {
                    let mut r = self.reqs[id].clone();
                    if !r.looked_up && r.tokens.is_empty() {
                        r.looked_up = true;
                        self.lookup(&mut r, len + self.choice.share_max as usize)?;
                    }
                    self.reqs.insert(*id, r);
                }
                let seqs: Vec<SeqId> = ids.iter().map(|id| self.reqs[id].seq).collect();
                for st in self.stores.iter_mut().chain(std::iter::once(&mut self.placement)) {
                    st.join(&seqs).map_err(|e| cache_fail("join (fresh rows)", e))?;
                }
                self.model.rows.extend(seqs.iter().map(|s| s.0));
                let rows: Vec<u32> = cx.roster.rows().to_vec();
                let mut all = vec![0; rows.len() - ids.len()];
                all.extend_from_slice(lens);
                self.prefill(cx, &rows, &all, *chunk, usize::MAX)?;
            }
        }
        Ok(true)
    }

    /// A request ends: its full blocks enter the index (in every store and the model), its twins go.
    pub(super) fn end(&mut self, req: u32) -> Res<()> {
        let r = self.reqs.remove(&req).expect("live");
        self.finish_seq(r.seq)
    }

    pub(super) fn finish_seq(&mut self, seq: SeqId) -> Res<()> {
        let before = self.model.clone();
        let want = self.model.finish(seq.0);
        for st in self.stores.iter_mut().chain(std::iter::once(&mut self.placement)) {
            let got = st.finish(seq).map_err(|e| cache_fail("finish", e))?;
            if got != want {
                return Err(pool_fail(format!("finish inserted {got} blocks, the model {want}")));
            }
        }
        self.count_evictions(&before);
        Ok(())
    }

    /// A window (`read`) or append of `len` positions on request `id` outside the batch.
    pub(super) fn solo_window(&mut self, cx: &mut Cx<'_>, id: u32, len: usize, read: bool) -> Res<bool> {
        if !cx.roster.is_solo(id) || len == 0 {
            return Ok(false);
        }
        let mut r = self.reqs[&id].clone();
        if !r.looked_up && r.tokens.is_empty() {
            r.looked_up = true;
            self.lookup(&mut r, len + self.choice.share_max as usize)?;
        }
        self.reqs.insert(id, r);
        self.write_solo(cx, id, len, read)
    }

    /// The prefix lookup of a request's prompt before its first window: the longest cached prefix of its next
    /// `len` tokens, at most `len - 1` positions (the last prompt position is always computed), replaces its empty
    /// sequence; its twin computes those positions itself (cold). The window then computes its positions after the
    /// prefix, as an engine computes the rest of a prompt after a hit.
    pub(super) fn lookup(&mut self, r: &mut Req, len: usize) -> Res<()> {
        let (prompt, hashes, toks) = self.next(r, len);
        let (_, hit_m) = {
            let k = self.model.hit_blocks(&prompt, len - 1);
            (k, k * self.choice.block_size)
        };
        // The prompt's next block after the hit, cached under another prefix: a lookup that keyed a block on its
        // own tokens (not the chain of blocks before it) would take it.
        let bs = self.choice.block_size;
        if hit_m + bs < len {
            let (block, path) = (&prompt[hit_m..hit_m + bs], &prompt[..hit_m + bs]);
            if self.model.index.keys().any(|k| k.ends_with(block) && k.as_slice() != path) {
                self.reach("paged/same_block_other_prefix");
            }
        }
        for st in self.stores.iter().chain(std::iter::once(&self.placement)) {
            let hit = st.lookup(&prompt, len - 1);
            if hit.positions != hit_m {
                return Err(pool_fail(format!("prefix lookup of {} positions, the model {hit_m}", hit.positions)));
            }
        }
        if hit_m == 0 {
            return Ok(());
        }
        self.model.release(r.seq.0);
        let (mseq, mpos) = self.model.open_with_prefix(&prompt, len - 1);
        let mut seqs = vec![];
        for st in self.stores.iter_mut().chain(std::iter::once(&mut self.placement)) {
            st.release(r.seq).map_err(|e| cache_fail("release", e))?;
            let (s, hit) = st.open_with_prefix(&prompt, len - 1);
            if hit.positions != mpos {
                return Err(pool_fail(format!("prefix hit of {} positions, the model {mpos}", hit.positions)));
            }
            seqs.push(s);
        }
        if seqs.iter().any(|s| s.0 != mseq) {
            return Err(pool_fail(format!("prefix hit sequences {seqs:?}, the model {mseq}")));
        }
        r.seq = SeqId(mseq);
        r.tokens.extend_from_slice(&prompt[..mpos]);
        r.chain.extend_from_slice(&hashes[..mpos]);
        r.toks.extend_from_slice(&toks[..mpos]);
        r.warm = true;
        for layer in 0..self.cfg.layers {
            let (k, v, q) = self.kvq(layer, &[toks[..mpos].to_vec()])?;
            r.twin[layer].window(&k, &v, &q, self.cfg.scale(), &Masks::new()).map_err(|e| cache_fail("twin", e))?;
        }
        self.counters.paged.prefix_hits += 1;
        self.counters.paged.shared_blocks += (mpos / self.choice.block_size) as u64;
        Ok(())
    }
}
