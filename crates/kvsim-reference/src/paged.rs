//! The paged pool's model: which physical block holds each logical block of every sequence, every block's
//! reference count, the free list and the prefix index, under the allocation policy docs/paged.md states
//! (free list first, then growth, then eviction of the least recently used unreferenced index leaf).
//!
//! Formulated apart from the production store: the index is a map from whole prefixes (token ids from position 0
//! to the end of a block) to their block, a block's children are the entries one block longer, and counts are
//! recomputed from the tables and the index rather than kept.

use std::collections::BTreeMap;

/// A sequence as the model has it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SeqModel {
    /// Physical block of each logical block.
    pub table: Vec<u32>,
    /// Token id of every position.
    pub tokens: Vec<u32>,
    /// Positions of the last write when it was a window.
    pub last_window: Option<usize>,
}

impl SeqModel {
    pub fn offset(&self) -> usize {
        self.tokens.len()
    }
}

/// What the model says an impossible request is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolVerdict {
    /// More blocks needed than free, growable and evictable together.
    Exhausted {
        needed: usize,
        available: usize,
    },
    TrimTooLong,
    BypassNotAfterWindow,
}

/// The pool's limits (the production `PoolSpec`'s fields).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolLimits {
    pub block_size: usize,
    pub initial_blocks: usize,
    pub max_blocks: usize,
    pub grow_by: usize,
    pub index_budget: usize,
}

/// The model of one layer's store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolModel {
    pub limits: PoolLimits,
    /// Blocks the pool holds.
    pub capacity: usize,
    /// Bottom to top; the top is handed out next.
    pub free: Vec<u32>,
    pub seqs: BTreeMap<u64, SeqModel>,
    pub rows: Vec<u64>,
    /// Prefix (a multiple of the block size long) -> (block, last used).
    pub index: BTreeMap<Vec<u32>, (u32, u64)>,
    pub clock: u64,
    pub next_seq: u64,
}

impl PoolModel {
    pub fn new(limits: PoolLimits) -> PoolModel {
        PoolModel {
            limits,
            capacity: 0,
            free: vec![],
            seqs: BTreeMap::new(),
            rows: vec![],
            index: BTreeMap::new(),
            clock: 0,
            next_seq: 0,
        }
    }

    /// Every block's reference count: tables listing it, plus one when the index holds it.
    pub fn refs(&self) -> Vec<u32> {
        let mut r = vec![0u32; self.capacity];
        for b in self.seqs.values().flat_map(|s| s.table.iter()).chain(self.index.values().map(|(b, _)| b)) {
            r[*b as usize] += 1;
        }
        r
    }

    pub fn open(&mut self) -> u64 {
        let id = self.next_seq;
        self.next_seq += 1;
        self.seqs.insert(id, SeqModel::default());
        id
    }

    /// The longest chain of cached prefixes of `prompt[..max]`, in blocks.
    pub fn hit_blocks(&self, prompt: &[u32], max: usize) -> usize {
        let bs = self.limits.block_size;
        let usable = &prompt[..prompt.len().min(max)];
        (1..=usable.len() / bs).take_while(|k| self.index.contains_key(&usable[..k * bs])).count()
    }

    /// A new sequence holding the longest cached prefix; returns (id, positions).
    pub fn open_with_prefix(&mut self, prompt: &[u32], max: usize) -> (u64, usize) {
        let bs = self.limits.block_size;
        let k = self.hit_blocks(prompt, max);
        self.clock += 1;
        let mut table = vec![];
        for j in 1..=k {
            let e = self.index.get_mut(&prompt[..j * bs]).expect("matched");
            e.1 = self.clock;
            table.push(e.0);
        }
        let id = self.open();
        let s = self.seqs.get_mut(&id).expect("opened");
        s.table = table;
        s.tokens = prompt[..k * bs].to_vec();
        (id, k * bs)
    }

    pub fn fork(&mut self, src: u64) -> u64 {
        let mut s = self.seqs[&src].clone();
        s.last_window = None;
        let id = self.open();
        self.seqs.insert(id, s);
        id
    }

    fn is_leaf(&self, prefix: &[u32]) -> bool {
        let bs = self.limits.block_size;
        !self.index.keys().any(|k| k.len() == prefix.len() + bs && k.starts_with(prefix))
    }

    /// The index entries only the index references, whose whole subtree only the index references.
    pub fn evictable(&self) -> usize {
        let refs = self.refs();
        self.index
            .iter()
            .filter(|(p, _)| {
                self.index.iter().filter(|(q, _)| q.starts_with(p)).all(|(_, (b, _))| refs[*b as usize] == 1)
            })
            .count()
    }

    /// Evicts up to `n` least recently used unreferenced leaves (ties: the lower block); returns how many.
    pub fn evict(&mut self, n: usize) -> usize {
        let mut done = 0;
        while done < n {
            let refs = self.refs();
            let victim = self
                .index
                .iter()
                .filter(|(p, (b, _))| refs[*b as usize] == 1 && self.is_leaf(p))
                .min_by_key(|(_, (b, used))| (*used, *b))
                .map(|(p, _)| p.clone());
            let Some(p) = victim else { break };
            let (b, _) = self.index.remove(&p).expect("victim");
            self.free.push(b);
            done += 1;
        }
        done
    }

    fn drop_table_ref(&mut self, b: u32) {
        // Called after the reference left its table: free when nothing lists it any more.
        if self.refs()[b as usize] == 0 {
            self.free.push(b);
        }
    }

    /// Whether writing `l` positions to each of `writes` fits; the blocks the writes need.
    pub fn check_write(&self, writes: &[(u64, usize)]) -> Result<(), PoolVerdict> {
        let bs = self.limits.block_size;
        let refs = self.refs();
        let mut needed = 0;
        for &(s, l) in writes {
            let seq = &self.seqs[&s];
            let off = seq.offset();
            if !off.is_multiple_of(bs) && refs[*seq.table.last().expect("partial") as usize] > 1 {
                needed += 1;
            }
            needed += (off + l).div_ceil(bs) - seq.table.len();
        }
        let available = self.free.len() + (self.limits.max_blocks - self.capacity) + self.evictable();
        if needed > available {
            return Err(PoolVerdict::Exhausted { needed, available });
        }
        Ok(())
    }

    fn alloc(&mut self) -> u32 {
        let room = self.limits.max_blocks - self.capacity;
        if self.free.is_empty() && room > 0 {
            let want = if self.capacity == 0 { self.limits.initial_blocks.max(1) } else { self.limits.grow_by };
            let n = want.min(room);
            let old = self.capacity as u32;
            self.capacity += n;
            self.free.extend((old..old + n as u32).rev());
        }
        if self.free.is_empty() {
            self.evict(1);
        }
        self.free.pop().expect("check_write made room")
    }

    /// The write of `tokens[i]` to `writes[i]`, after [`PoolModel::check_write`]: copy-on-write of a shared
    /// partial last block, then new blocks, sequence by sequence.
    pub fn write(&mut self, writes: &[u64], tokens: &[Vec<u32>], window: bool) {
        let bs = self.limits.block_size;
        for (s, t) in writes.iter().zip(tokens) {
            let off = self.seqs[s].offset();
            let last = self.seqs[s].table.last().copied();
            if !off.is_multiple_of(bs) && self.refs()[last.expect("partial") as usize] > 1 {
                let nb = self.alloc();
                let seq = self.seqs.get_mut(s).expect("live");
                let at = seq.table.len() - 1;
                seq.table[at] = nb;
            }
            let new = (off + t.len()).div_ceil(bs) - self.seqs[s].table.len();
            for _ in 0..new {
                let nb = self.alloc();
                self.seqs.get_mut(s).expect("live").table.push(nb);
            }
            let seq = self.seqs.get_mut(s).expect("live");
            seq.tokens.extend_from_slice(t);
            seq.last_window = window.then_some(t.len());
        }
    }

    pub fn check_trim(&self, s: u64, n: usize, bypass: bool) -> Result<(), PoolVerdict> {
        let seq = &self.seqs[&s];
        let available = if bypass { seq.last_window.ok_or(PoolVerdict::BypassNotAfterWindow)? } else { seq.offset() };
        if n > available {
            return Err(PoolVerdict::TrimTooLong);
        }
        Ok(())
    }

    /// A checked trim.
    pub fn trim(&mut self, s: u64, n: usize, bypass: bool) {
        let bs = self.limits.block_size;
        let seq = self.seqs.get_mut(&s).expect("live");
        let off = seq.offset() - n;
        seq.tokens.truncate(off);
        seq.last_window = if bypass { seq.last_window.map(|w| w - n) } else { None };
        let dropped: Vec<u32> = seq.table.drain(off.div_ceil(bs)..).collect();
        for b in dropped {
            self.drop_table_ref(b);
        }
    }

    /// Drops a sequence's references.
    pub fn release(&mut self, s: u64) {
        let seq = self.seqs.remove(&s).expect("live");
        for b in seq.table {
            self.drop_table_ref(b);
        }
    }

    /// Ends a sequence: its full blocks whose prefix is not cached enter the index, then it is released and the
    /// index evicts down to its budget. Returns the blocks inserted.
    pub fn finish(&mut self, s: u64) -> usize {
        let bs = self.limits.block_size;
        let seq = self.seqs[&s].clone();
        self.clock += 1;
        let mut inserted = 0;
        for k in 1..=seq.tokens.len() / bs {
            let p = seq.tokens[..k * bs].to_vec();
            let e = self.index.entry(p).or_insert_with(|| {
                inserted += 1;
                (seq.table[k - 1], 0)
            });
            e.1 = self.clock;
        }
        self.release(s);
        while self.index.len() > self.limits.index_budget {
            if self.evict(1) == 0 {
                break;
            }
        }
        inserted
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> PoolLimits {
        PoolLimits { block_size: 2, initial_blocks: 1, max_blocks: 4, grow_by: 1, index_budget: 8 }
    }

    #[test]
    fn sharing_copy_on_write_and_pressure() {
        let mut m = PoolModel::new(limits());
        let a = m.open();
        m.check_write(&[(a, 3)]).unwrap();
        m.write(&[a], &[vec![1, 2, 3]], true);
        assert_eq!(m.seqs[&a].table, vec![0, 1]);
        let b = m.fork(a);
        assert_eq!(m.refs(), vec![2, 2]);
        m.check_write(&[(b, 1)]).unwrap();
        m.write(&[b], &[vec![9]], true);
        assert_eq!(m.seqs[&b].table, vec![0, 2], "the shared partial block was copied");
        m.release(b);
        assert_eq!(m.finish(a), 1);
        assert_eq!(m.index.len(), 1);
        assert_eq!(m.free, vec![2, 1]);
        let (c, hit) = m.open_with_prefix(&[1, 2, 3], 2);
        assert_eq!((hit, m.seqs[&c].table.clone()), (2, vec![0]));
        // 4 blocks at most: 2 free + 1 growable; the shared one is not evictable.
        assert_eq!(m.check_write(&[(c, 6)]), Ok(()));
        assert_eq!(m.check_write(&[(c, 8)]), Err(PoolVerdict::Exhausted { needed: 4, available: 3 }));
        assert_eq!(m.check_trim(c, 1, true), Err(PoolVerdict::BypassNotAfterWindow));
        assert_eq!(m.check_trim(c, 3, false), Err(PoolVerdict::TrimTooLong));
    }
}
