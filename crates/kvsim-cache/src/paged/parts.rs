//! A [`PagedStore`]'s accounting audit and its whole state as plain data (save and restore).

use std::collections::BTreeMap;

use mlx_rs::Array;

use super::index::{IndexEntry, Node};
use super::{PagedSeq, PagedStore, PoolSpec, SeqId};
use crate::error::{invalid, shape};
use crate::quant::Storage;
use crate::util::dim;
use crate::{KvSpec, Result};

impl PagedStore {
    /// Checks the pool's accounting: every count is the number of tables listing the block plus one if the index
    /// holds it; the free list holds exactly the blocks of count 0, each once; every table covers its positions;
    /// every row is a live sequence, once. `InvalidState` names the first rule broken.
    pub fn audit(&self) -> Result<()> {
        let mut expected = vec![0u32; self.capacity()];
        let bs = self.pool.block_size;
        for (s, seq) in &self.seqs {
            if seq.table.len() != seq.offset.div_ceil(bs) || seq.tokens.len() != seq.offset {
                return Err(invalid(format!(
                    "sequence {}: {} blocks for {} positions",
                    s.0,
                    seq.table.len(),
                    seq.offset
                )));
            }
            for (i, &b) in seq.table.iter().enumerate() {
                if seq.table[..i].contains(&b) {
                    return Err(invalid(format!("sequence {}: block {b} holds two of its logical blocks", s.0)));
                }
                let e = expected.get_mut(b as usize).ok_or_else(|| invalid(format!("block {b} past the pool")))?;
                *e += 1;
            }
        }
        let mut held: Vec<u32> = self.index.live().map(|(_, n)| n.block).collect();
        held.sort_unstable();
        if held.windows(2).any(|w| w[0] == w[1]) {
            return Err(invalid("the index holds one block under two prefixes"));
        }
        for (_, n) in self.index.live() {
            let e = expected.get_mut(n.block as usize).ok_or_else(|| invalid("index block past the pool"))?;
            *e += 1;
        }
        if expected != self.refs {
            return Err(invalid(format!(
                "reference counts {:?}, the tables and the index give {expected:?}",
                self.refs
            )));
        }
        let mut free = self.free.clone();
        free.sort_unstable();
        let zero: Vec<u32> = (0..self.capacity() as u32).filter(|&b| expected[b as usize] == 0).collect();
        if free != zero {
            return Err(invalid(format!("free list {:?}, unreferenced blocks {zero:?}", self.free)));
        }
        for (i, r) in self.rows.iter().enumerate() {
            if !self.seqs.contains_key(r) || self.rows[..i].contains(r) {
                return Err(invalid(format!("row {i}: sequence {} is not a live sequence once", r.0)));
            }
        }
        Ok(())
    }

    /// The store's whole state as plain data and its pool planes (a save). Refused while a speculative round is
    /// armed ([`CacheError::SpecRoundActive`](crate::CacheError::SpecRoundActive)) or a prefill pending
    /// ([`CacheError::PendingPrefill`](crate::CacheError::PendingPrefill)): what they wrote is not committed, and
    /// neither is a part.
    pub fn to_parts(&self) -> Result<(PagedParts, Option<Vec<Array>>)> {
        self.no_round()?;
        self.no_pending()?;
        let parts = PagedParts {
            spec: self.spec,
            pool: self.pool,
            storage: self.storage,
            refs: self.refs.clone(),
            free: self.free.clone(),
            seqs: self.seqs.iter().map(|(k, v)| (k.0, v.clone())).collect(),
            rows: self.rows.iter().map(|r| r.0).collect(),
            index: self.index_entries(),
            clock: self.index.clock,
            next_seq: self.next_seq,
        };
        Ok((parts, self.planes.clone()))
    }

    /// A store from saved parts: every table, count, free list, row and index entry is checked against the others
    /// and the planes' count, shape and dtype ([`PagedStore::audit`] and more); an impossible one is
    /// `InvalidState`, planes of another layout `ShapeMismatch`.
    pub fn from_parts(parts: PagedParts, planes: Option<Vec<Array>>) -> Result<PagedStore> {
        let mut st = PagedStore::with_storage(parts.spec, parts.pool, parts.storage)?;
        let bs = parts.pool.block_size;
        let cap = parts.refs.len();
        if cap > parts.pool.max_blocks {
            return Err(invalid(format!("{cap} blocks in a pool of at most {}", parts.pool.max_blocks)));
        }
        match &planes {
            None if cap > 0 => return Err(invalid("a pool of blocks without planes")),
            Some(p) => {
                let layout = parts.storage.plane_layout(&parts.spec);
                if p.len() != layout.len() {
                    return Err(shape(format!(
                        "{} pool planes, {:?} storage has {}",
                        p.len(),
                        parts.storage,
                        layout.len()
                    )));
                }
                for (a, (w, dt)) in p.iter().zip(layout) {
                    let want = [1, parts.spec.heads_kv as i32, dim(cap * bs)?, dim(w)?];
                    if a.shape() != want || a.dtype() != dt {
                        return Err(shape(format!(
                            "pool plane {:?} {:?}, expected {want:?} {dt:?}",
                            a.shape(),
                            a.dtype()
                        )));
                    }
                }
            }
            None => {}
        }
        st.planes = planes;
        st.refs = parts.refs;
        st.free = parts.free;
        for (id, seq) in parts.seqs {
            if id >= parts.next_seq {
                return Err(invalid(format!("sequence {id} at or past the next id {}", parts.next_seq)));
            }
            st.seqs.insert(SeqId(id), seq);
        }
        st.rows = parts.rows.into_iter().map(SeqId).collect();
        st.next_seq = parts.next_seq;
        st.index.clock = parts.clock;
        for e in parts.index {
            if e.prefix.is_empty() || !e.prefix.len().is_multiple_of(bs) || e.last_used > parts.clock {
                return Err(invalid(format!("index entry of {} tokens (block size {bs})", e.prefix.len())));
            }
            let depth = e.prefix.len() / bs;
            let parent = if depth == 1 {
                None
            } else {
                let up = &e.prefix[..e.prefix.len() - bs];
                let chain = st.index.matching(up, bs);
                if chain.len() != depth - 1 {
                    return Err(invalid("index entry whose parent prefix is not in the index"));
                }
                chain.last().copied()
            };
            let key = e.prefix[e.prefix.len() - bs..].to_vec();
            if st.index.children_of(parent).contains_key(&key) {
                return Err(invalid("index entry listed twice"));
            }
            let node =
                Node { parent, key: key.clone(), block: e.block, children: BTreeMap::new(), last_used: e.last_used };
            st.index.nodes.push(Some(node));
            let n = st.index.nodes.len() - 1;
            match parent {
                None => st.index.roots.insert(key, n),
                Some(p) => st.index.nodes[p].as_mut().expect("live").children.insert(key, n),
            };
        }
        st.audit()?;
        Ok(st)
    }
}

/// A [`PagedStore`]'s host state as plain data (what a save writes beside the pool planes).
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(deny_unknown_fields))]
pub struct PagedParts {
    /// The K/V geometry and dtype.
    pub spec: KvSpec,
    /// The pool's geometry and limits.
    pub pool: PoolSpec,
    /// How the pool stores K and V (plain when a saved state does not say).
    #[cfg_attr(feature = "serde", serde(default))]
    pub storage: Storage,
    /// Every block's reference count (the pool's capacity is its length).
    pub refs: Vec<u32>,
    /// The free list, bottom to top.
    pub free: Vec<u32>,
    /// Every live sequence by id.
    pub seqs: Vec<(u64, PagedSeq)>,
    /// The running batch's rows (sequence ids), in row order.
    pub rows: Vec<u64>,
    /// The prefix index's entries.
    pub index: Vec<IndexEntry>,
    /// The index's clock.
    pub clock: u64,
    /// The id the next sequence gets.
    pub next_seq: u64,
}
