//! Paged K/V storage with shared prefix blocks: [`PagedStore`] (`kv:paged:<block_size>` for one sequence,
//! `kv:paged-rows:<block_size>` for the running batch).
//!
//! One store holds, for one layer, a **pool** of fixed-size blocks, every live sequence's **block table** (which
//! physical block holds each run of `block_size` logical positions), the running batch's rows (sequences, in row
//! order) and a **prefix index** (a radix tree over token-id blocks, like SGLang's radix cache). All of them share
//! the pool: a block is referenced by every table that lists it and by the index when it holds it, and is free
//! exactly when nothing references it.
//!
//! Layout. The pool is one plane per stored tensor, `[1, H_kv, capacity * block_size, width]` with the token axis
//! at 2, like every other layout of this crate: physical block `b` is columns `[b * block_size, (b + 1) *
//! block_size)`. [`Storage::Plain`] holds two planes `[k, v]` in the spec's dtype; [`Storage::Affine`] holds MLX's
//! six affine planes `[kq, ks, kb, vq, vs, vb]` (packed words, scales, biases), each position quantized on its own
//! (groups run along head_dim), so a block of affine planes is a run of positions like any other. (Upstream's
//! `BlockPool` stores `[num_blocks, H, block_size, D]` in bf16 or affine KV4/KV8, the same bytes up to a
//! transpose.)
//!
//! Guarantees:
//! - **Logical contents**: [`PagedStore::fetch`] of a sequence is `[1, H_kv, offset, D]` holding exactly the bytes
//!   written for its positions, in logical order, whichever physical blocks hold them, whichever sequence wrote a
//!   shared block, and whatever order the free list handed blocks out.
//! - **Reads** gather the sequence's positions in logical order, then attend through the one read every layout uses
//!   for its storage (MLX's fused SDPA for plain planes, mlx-lm's quantized read for affine ones): a decode with no
//!   mask, a window under `Causal`, like a linear [`crate::KvCache`] (or [`crate::QuantizedKvCache`]) holding the
//!   same positions. Plain rows are gathered right-padded to the longest row and masked like a
//!   [`crate::RowBatch`] (`c < len_r` for decodes, per-row causal for windows), so a plain paged read equals, byte
//!   for byte, that of a plain cache holding the same bytes wherever the plain cache's own batch invariance holds
//!   (measured on CPU by the simulator). Affine rows are read **row by row**, each over exactly its own positions:
//!   the quantized read of a padded batch is not byte-identical to the same row read alone (the quantized family
//!   measures that distance), and row by row it is the serial quantized cache's own call on the same bytes.
//! - **Stored bytes** of affine storage are MLX's CPU quantizer's of each position ([`Storage::encode`]), whichever
//!   write (one sequence, a batch, a chunk) delivered it: a sequence's planes equal a serial quantized cache's fed
//!   the same positions.
//! - **Right-padded prefill** ([`PagedStore::rows_prepare`], [`PagedStore::rows_finalize`]): row `r` takes the
//!   first `min(pending_r, L)` positions of each window chunk and nothing else; while it is pending, decodes,
//!   rounds, trims, row changes and saves are [`CacheError::PendingPrefill`].
//! - **Sharing is copy-on-write**: a write never changes a block another table or the index references; appending
//!   into a shared, partly filled block first copies it into a block of its own.
//! - **Accounting** ([`PagedStore::audit`]): every block's reference count is the number of tables listing it plus
//!   one if the index holds it; the free list holds exactly the blocks of count 0, each once.
//! - **Atomic refusals**: a write the pool cannot hold is [`CacheError::PoolExhausted`] with nothing changed; every
//!   other impossible request is a typed error with nothing changed.
//!
//! Allocation policy (deterministic, so a test can predict placement): the free list is a LIFO stack whose initial
//! order hands out low indices first (or a caller-given permutation, [`PagedStore::with_free_order`]); when it is
//! empty the pool grows by `grow_by` blocks up to `max_blocks`; at the cap the index gives up its least recently
//! used unreferenced leaf. The index keeps at most `index_budget` blocks, evicting the same way after each insert;
//! it never evicts a block a table references.

use std::collections::BTreeMap;

use mlx_rs::Array;

use crate::error::{invalid, shape};
use crate::kind::StorageKind;
use crate::quant::{attend_planes, Storage};
use crate::util::{check_kv, check_q, dim, eval, index_array, zeros};
use crate::{CacheError, KvSpec, Result};

/// Upstream's default block size (mlx-bun `paged/cache.ts`, equal to `KVCache.step`).
pub const DEFAULT_BLOCK_SIZE: usize = 256;

/// The pool's geometry and limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(deny_unknown_fields))]
pub struct PoolSpec {
    /// Positions per block (`>= 1`).
    pub block_size: usize,
    /// Blocks allocated on the first write.
    pub initial_blocks: usize,
    /// The most blocks the pool may ever hold (`>= initial_blocks`).
    pub max_blocks: usize,
    /// Blocks added per growth (`>= 1`).
    pub grow_by: usize,
    /// The most blocks the prefix index may hold.
    pub index_budget: usize,
}

impl PoolSpec {
    fn validate(&self) -> Result<()> {
        if self.block_size == 0 || self.grow_by == 0 || self.max_blocks < self.initial_blocks {
            return Err(invalid(format!("pool spec {self:?}: block_size and grow_by must be >= 1, max >= initial")));
        }
        dim(self.max_blocks.saturating_mul(self.block_size))?;
        Ok(())
    }
}

/// A sequence of a store (a request's K/V of this layer).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SeqId(pub u64);

/// A sequence's host state: its block table, its positions and the token ids they were written for.
#[derive(Debug, Clone, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(deny_unknown_fields))]
pub struct PagedSeq {
    /// Physical block of each logical block, in logical order (`ceil(offset / block_size)` entries).
    pub table: Vec<u32>,
    /// Positions held.
    pub offset: usize,
    /// The token id of every position (the prefix index's keys).
    pub tokens: Vec<u32>,
    /// Positions of the last write when it was a window (the speculative rollback's limit), else `None`.
    pub last_window: Option<usize>,
}

mod index;
mod parts;
mod rows;
#[cfg(test)]
mod tests;

pub use index::IndexEntry;
use index::{Node, PrefixIndex};
pub use parts::PagedParts;

/// What [`PagedStore::lookup`] found for a prompt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefixHit {
    /// Positions the new sequence holds from the index (a multiple of the block size).
    pub positions: usize,
    /// Blocks it shares with the index.
    pub blocks: usize,
}

/// One layer's paged storage: pool, sequences, the running batch's rows and the prefix index (module docs).
#[derive(Clone)]
pub struct PagedStore {
    spec: KvSpec,
    pool: PoolSpec,
    storage: Storage,
    /// The storage's planes, each `[1, H_kv, capacity * block_size, width]`; `None` before the first write.
    planes: Option<Vec<Array>>,
    refs: Vec<u32>,
    /// LIFO: `pop` hands out the next block.
    free: Vec<u32>,
    /// The order in which the blocks of each growth enter the free list (`None`: low indices out first).
    free_order: Option<u64>,
    seqs: BTreeMap<SeqId, PagedSeq>,
    rows: Vec<SeqId>,
    index: PrefixIndex,
    next_seq: u64,
    /// An armed speculative round: each row's offset when it was armed.
    round: Option<Vec<usize>>,
    /// A prepared (right-padded) prefill: each row's real positions still to come.
    pending: Option<Vec<usize>>,
}

impl std::fmt::Debug for PagedStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagedStore")
            .field("spec", &self.spec)
            .field("pool", &self.pool)
            .field("storage", &self.storage)
            .field("refs", &self.refs)
            .field("free", &self.free)
            .field("seqs", &self.seqs)
            .field("rows", &self.rows)
            .field("round", &self.round)
            .field("pending", &self.pending)
            .finish_non_exhaustive()
    }
}

/// What a batch or sequence write needs from the pool: one entry per sequence.
struct WritePlan {
    /// (sequence, positions, whether its partly filled last block must be copied first, new blocks).
    items: Vec<(SeqId, usize, bool, usize)>,
}

impl WritePlan {
    fn blocks(&self) -> usize {
        self.items.iter().map(|&(_, _, cow, n)| usize::from(cow) + n).sum()
    }
}

impl PagedStore {
    /// An empty store of plain planes (no pool memory until the first write).
    pub fn new(spec: KvSpec, pool: PoolSpec) -> Result<PagedStore> {
        PagedStore::with_storage(spec, pool, Storage::Plain)
    }

    /// An empty store of this storage; invalid affine parameters are [`CacheError::InvalidQuant`].
    pub fn with_storage(spec: KvSpec, pool: PoolSpec, storage: Storage) -> Result<PagedStore> {
        spec.validate()?;
        pool.validate()?;
        storage.validate(&spec)?;
        Ok(PagedStore {
            spec,
            pool,
            storage,
            planes: None,
            refs: vec![],
            free: vec![],
            free_order: None,
            seqs: BTreeMap::new(),
            rows: vec![],
            index: PrefixIndex::default(),
            next_seq: 0,
            round: None,
            pending: None,
        })
    }

    /// The same store with every growth's blocks entering the free list in an order permuted by `seed` (placement
    /// must never matter: the outputs and logical contents are those of the default order).
    pub fn with_free_order(mut self, seed: u64) -> PagedStore {
        self.free_order = Some(seed);
        self
    }

    /// The pool's planes (the storage's, K's first), `[1, H_kv, capacity * block_size, width]` each (`None` before
    /// the first write).
    pub fn pool_planes(&self) -> Option<&[Array]> {
        self.planes.as_deref()
    }

    /// How the pool stores K and V.
    pub fn storage(&self) -> Storage {
        self.storage
    }

    /// The K/V geometry and dtype.
    pub fn spec(&self) -> KvSpec {
        self.spec
    }

    /// The pool's geometry and limits.
    pub fn pool_spec(&self) -> PoolSpec {
        self.pool
    }

    /// Blocks the pool holds now.
    pub fn capacity(&self) -> usize {
        self.refs.len()
    }

    /// Every block's reference count.
    pub fn refs(&self) -> &[u32] {
        &self.refs
    }

    /// The free list, bottom to top (the last entry is handed out next).
    pub fn free_list(&self) -> &[u32] {
        &self.free
    }

    /// A live sequence's host state.
    pub fn seq(&self, s: SeqId) -> Result<&PagedSeq> {
        self.seqs.get(&s).ok_or(CacheError::NoSuchSeq { seq: s.0 })
    }

    /// Every live sequence.
    pub fn seqs(&self) -> impl Iterator<Item = (SeqId, &PagedSeq)> {
        self.seqs.iter().map(|(k, v)| (*k, v))
    }

    /// The running batch's rows, in row order.
    pub fn rows(&self) -> &[SeqId] {
        &self.rows
    }

    /// The prefix index's entries, in prefix order.
    pub fn index_entries(&self) -> Vec<IndexEntry> {
        let mut out: Vec<IndexEntry> = self
            .index
            .live()
            .map(|(i, n)| IndexEntry { prefix: self.index.prefix_of(i), block: n.block, last_used: n.last_used })
            .collect();
        out.sort();
        out
    }

    /// `kv:paged:<block_size>`, or `kv:paged:<block_size>:quant:<bits>:<group>` for affine storage.
    pub fn storage_kind(&self) -> StorageKind {
        crate::kind::paged_kind(self.pool.block_size, false, self.storage.quant())
    }

    /// `kv:paged-rows:<block_size>`, or `kv:paged-rows:<block_size>:quant:<bits>:<group>` for affine storage.
    pub fn rows_storage_kind(&self) -> StorageKind {
        crate::kind::paged_kind(self.pool.block_size, true, self.storage.quant())
    }

    /// Bytes one position costs in a full block (every plane of K and V, R-C-4: [`Storage::bytes_per_token`]).
    pub fn bytes_per_token(&self) -> usize {
        self.storage.bytes_per_token(&self.spec)
    }

    /// Bytes `n` positions of one sequence occupy: whole blocks (`ceil(n / block_size)` of them).
    pub fn bytes_for_tokens(&self, n: usize) -> usize {
        n.div_ceil(self.pool.block_size) * self.pool.block_size * self.bytes_per_token()
    }

    /// A new empty sequence (outside the batch).
    pub fn open(&mut self) -> SeqId {
        let s = SeqId(self.next_seq);
        self.next_seq += 1;
        self.seqs.insert(s, PagedSeq { table: vec![], offset: 0, tokens: vec![], last_window: None });
        s
    }

    /// What [`PagedStore::open_with_prefix`] would share for `prompt` (nothing changes).
    pub fn lookup(&self, prompt: &[u32], max_positions: usize) -> PrefixHit {
        let bs = self.pool.block_size;
        let usable = &prompt[..prompt.len().min(max_positions)];
        let n = self.index.matching(usable, bs).len();
        PrefixHit { positions: n * bs, blocks: n }
    }

    /// A new sequence holding the longest cached prefix of `prompt` of at most `max_positions` positions, in full
    /// blocks shared with the index (an engine passes `prompt.len() - 1`: the last prompt position is computed).
    pub fn open_with_prefix(&mut self, prompt: &[u32], max_positions: usize) -> (SeqId, PrefixHit) {
        let bs = self.pool.block_size;
        let usable = &prompt[..prompt.len().min(max_positions)];
        let nodes = self.index.matching(usable, bs);
        self.index.touch(&nodes);
        let table: Vec<u32> = nodes.iter().map(|&n| self.index.node(n).block).collect();
        for &b in &table {
            self.refs[b as usize] += 1;
        }
        let positions = table.len() * bs;
        let s = self.open();
        let tokens: Vec<u32> = nodes.iter().flat_map(|&n| self.index.node(n).key.iter().copied()).collect();
        let seq = self.seqs.get_mut(&s).expect("just opened");
        seq.tokens = tokens;
        seq.offset = positions;
        let blocks = table.len();
        seq.table = table;
        (s, PrefixHit { positions, blocks })
    }

    /// A new sequence sharing every block of `src` (parallel sampling): nothing is copied until one of them
    /// appends into a shared, partly filled block.
    pub fn fork(&mut self, src: SeqId) -> Result<SeqId> {
        let mut seq = self.seq(src)?.clone();
        seq.last_window = None;
        for &b in &seq.table {
            self.refs[b as usize] += 1;
        }
        let s = self.open();
        self.seqs.insert(s, seq);
        Ok(s)
    }

    /// Ends `s` (it must not be a row): its full blocks enter the prefix index under its token ids (a block whose
    /// prefix is cached already is not inserted twice), then its references go. Returns the blocks inserted.
    pub fn finish(&mut self, s: SeqId) -> Result<usize> {
        self.not_a_row(s)?;
        let seq = self.seq(s)?.clone();
        let bs = self.pool.block_size;
        let mut at: Option<usize> = None;
        let mut path = vec![];
        let mut inserted = 0;
        for (i, chunk) in seq.tokens.chunks_exact(bs).enumerate() {
            let existing = self.index.children_of(at).get(chunk).copied();
            let n = match existing {
                Some(n) => n,
                None => {
                    let block = seq.table[i];
                    self.refs[block as usize] += 1;
                    let node = Node { parent: at, key: chunk.to_vec(), block, children: BTreeMap::new(), last_used: 0 };
                    self.index.nodes.push(Some(node));
                    let n = self.index.nodes.len() - 1;
                    match at {
                        None => self.index.roots.insert(chunk.to_vec(), n),
                        Some(p) => self.index.nodes[p].as_mut().expect("live").children.insert(chunk.to_vec(), n),
                    };
                    inserted += 1;
                    n
                }
            };
            path.push(n);
            at = Some(n);
        }
        self.index.touch(&path);
        self.release(s)?;
        while self.index.len() > self.pool.index_budget {
            if self.evict(1) == 0 {
                break;
            }
        }
        Ok(inserted)
    }

    /// Drops `s` (it must not be a row) without inserting anything into the index.
    pub fn release(&mut self, s: SeqId) -> Result<()> {
        self.not_a_row(s)?;
        let seq = self.seqs.remove(&s).ok_or(CacheError::NoSuchSeq { seq: s.0 })?;
        if crate::fault!(PagedRefLeak) {
            // Mutation hook `Mutant::PagedRefLeak`: the references stay.
            return Ok(());
        }
        for b in seq.table {
            self.unref(b);
            if crate::fault!(PagedDoubleFree) && self.refs[b as usize] > 0 {
                // Mutation hook `Mutant::PagedDoubleFree`: a shared block loses a second reference.
                self.unref(b);
            }
        }
        Ok(())
    }

    /// Evicts up to `n` blocks from the prefix index, least recently used unreferenced leaves first. Returns how many.
    pub fn evict(&mut self, n: usize) -> usize {
        let mut done = 0;
        while done < n {
            let Some(i) = self.index.lru_leaf(&self.refs) else { break };
            let b = self.index.remove(i);
            if crate::fault!(PagedEvictReferenced) {
                // Mutation hook `Mutant::PagedEvictReferenced`: the block goes back to the pool whoever holds it.
                self.refs[b as usize] = 1;
            }
            self.unref(b);
            done += 1;
        }
        done
    }

    fn unref(&mut self, b: u32) {
        let r = &mut self.refs[b as usize];
        *r -= 1;
        if *r == 0 {
            self.free.push(b);
        }
    }

    fn not_a_row(&self, s: SeqId) -> Result<()> {
        match self.rows.iter().position(|&r| r == s) {
            Some(row) => Err(invalid(format!("sequence {} is row {row} of the batch: extract it first", s.0))),
            None => Ok(()),
        }
    }

    fn plan(&self, writes: &[(SeqId, usize)]) -> Result<WritePlan> {
        let bs = self.pool.block_size;
        let mut items = vec![];
        for &(s, l) in writes {
            let seq = self.seq(s)?;
            // Mutation hook `Mutant::PagedCowSkipped`: a shared partial block is written in place.
            let cow = !crate::fault!(PagedCowSkipped)
                && !seq.offset.is_multiple_of(bs)
                && l > 0
                && self.refs[*seq.table.last().expect("partial block") as usize] > 1;
            let new = (seq.offset + l).div_ceil(bs).saturating_sub(seq.table.len());
            items.push((s, l, cow, new));
        }
        let plan = WritePlan { items };
        let available = self.free.len() + (self.pool.max_blocks - self.capacity()) + self.index.evictable(&self.refs);
        if plan.blocks() > available {
            return Err(CacheError::PoolExhausted { needed: plan.blocks(), available });
        }
        Ok(plan)
    }

    /// One block for a write: the free list, else a growth, else an eviction (the plan made sure one exists).
    fn alloc(&mut self) -> Result<u32> {
        let room = self.pool.max_blocks - self.capacity();
        if self.free.is_empty() && room > 0 {
            let want = if self.capacity() == 0 { self.pool.initial_blocks.max(1) } else { self.pool.grow_by };
            self.grow(want.min(room))?;
        }
        if self.free.is_empty() {
            self.evict(1);
        }
        let b = self.free.pop().ok_or_else(|| invalid("pool accounting: no block after the plan"))?;
        self.refs[b as usize] = 1;
        Ok(b)
    }

    fn grow(&mut self, blocks: usize) -> Result<()> {
        let bs = self.pool.block_size;
        let old = self.capacity();
        let h = self.spec.heads_kv;
        let extra: Vec<Array> = self
            .storage
            .plane_layout(&self.spec)
            .into_iter()
            .map(|(w, dt)| zeros(&[1, h, blocks * bs, w], dt))
            .collect::<Result<_>>()?;
        let planes = match self.planes.take() {
            None => extra,
            Some(old) => old
                .iter()
                .zip(&extra)
                .map(|(p, e)| Ok(mlx_rs::ops::concatenate(&[p, e], 2)?))
                .collect::<Result<Vec<Array>>>()?,
        };
        self.planes = Some(planes);
        self.refs.extend(std::iter::repeat_n(0, blocks));
        let mut new: Vec<u32> = (old as u32..(old + blocks) as u32).collect();
        if let Some(seed) = self.free_order {
            permute(&mut new, seed ^ old as u64);
        }
        // Pushed in reverse, so the first of `new` is handed out first.
        self.free.extend(new.into_iter().rev());
        Ok(())
    }

    /// Physical column of each position `[from, to)` of a table.
    fn slots(&self, table: &[u32], from: usize, to: usize) -> Vec<usize> {
        let bs = self.pool.block_size;
        (from..to).map(|p| table[p / bs] as usize * bs + p % bs).collect()
    }

    /// Carries out a checked plan: copy-on-write and new blocks per sequence, then one scatter of every new
    /// position into every plane. `k`, `v` are `[1, H_kv, n, D]` with the positions in plan order (encoded here
    /// into the storage's planes).
    fn write(&mut self, plan: &WritePlan, tokens: &[&[u32]], k: &Array, v: &Array) -> Result<()> {
        let block = if plan.items.iter().any(|i| i.1 > 0) { self.storage.encode(k, v)? } else { vec![] };
        let bs = self.pool.block_size;
        let mut copies: Vec<(usize, usize)> = vec![]; // (from column, to column)
        let mut slots: Vec<usize> = vec![];
        for &(s, l, cow, new) in &plan.items {
            if cow {
                let nb = self.alloc()?;
                let seq = self.seqs.get_mut(&s).expect("planned");
                let last = seq.table.len() - 1;
                let old = seq.table[last];
                seq.table[last] = nb;
                let filled = seq.offset % bs;
                copies.extend((0..filled).map(|i| (old as usize * bs + i, nb as usize * bs + i)));
                self.unref(old);
            }
            for _ in 0..new {
                let nb = self.alloc()?;
                self.seqs.get_mut(&s).expect("planned").table.push(nb);
            }
            let seq = &self.seqs[&s];
            slots.extend(self.slots(&seq.table, seq.offset, seq.offset + l));
        }
        let mut planes = self.planes.take().ok_or_else(|| invalid("paged write without a pool"))?;
        if !copies.is_empty() {
            let from: Vec<usize> = copies.iter().map(|c| c.0).collect();
            let to: Vec<usize> = copies.iter().map(|c| c.1).collect();
            let (fi, ti) = (index_array(&from, &[from.len()])?, index_array(&to, &[1, 1, to.len(), 1])?);
            for (i, p) in planes.iter_mut().enumerate() {
                // Mutation hook `Mutant::PagedAffineCowPackedOnly`: an affine pool's copy skips the scales and
                // biases planes (`[kq, ks, kb, vq, vs, vb]`: every plane but the packed words).
                if self.storage != Storage::Plain && i % 3 != 0 && crate::fault!(PagedAffineCowPackedOnly) {
                    continue;
                }
                *p = p.put_along_axis(&ti, &p.take_axis(&fi, 2)?, 2)?;
            }
        }
        if !slots.is_empty() {
            let at = index_array(&slots, &[1, 1, slots.len(), 1])?;
            for (p, b) in planes.iter_mut().zip(&block) {
                *p = p.put_along_axis(&at, b, 2)?;
            }
        }
        if crate::ring::eval_after_write() {
            eval(&planes.iter().collect::<Vec<_>>())?;
        }
        self.planes = Some(planes);
        for (i, &(s, l, _, _)) in plan.items.iter().enumerate() {
            let seq = self.seqs.get_mut(&s).expect("planned");
            seq.offset += l;
            seq.tokens.extend_from_slice(tokens[i]);
        }
        Ok(())
    }

    /// Gathers positions `[0, len_r)` of every sequence, right-padded with zeros to the longest (at least 1):
    /// every plane `[B, H_kv, width, w]`, and the lengths.
    fn gather(&self, seqs: &[SeqId]) -> Result<(Vec<Array>, Vec<usize>)> {
        let lens: Vec<usize> = seqs.iter().map(|s| self.seqs[s].offset).collect();
        let width = lens.iter().copied().max().unwrap_or(0).max(1);
        let layout = self.storage.plane_layout(&self.spec);
        let h = self.spec.heads_kv;
        let mut per: Vec<Vec<Array>> = vec![vec![]; layout.len()];
        for (s, &len) in seqs.iter().zip(&lens) {
            let seq = &self.seqs[s];
            let at = match (&self.planes, len) {
                (Some(_), len) if len > 0 => Some(index_array(&self.slots(&seq.table, 0, len), &[len])?),
                _ => None,
            };
            for (i, &(w, dt)) in layout.iter().enumerate() {
                let got = match (&self.planes, &at) {
                    (Some(p), Some(at)) => p[i].take_axis(at, 2)?,
                    _ => zeros(&[1, h, 0, w], dt)?,
                };
                per[i].push(if len < width {
                    mlx_rs::ops::concatenate(&[&got, &zeros(&[1, h, width - len, w], dt)?], 2)?
                } else {
                    got
                });
            }
        }
        let planes = per
            .into_iter()
            .map(|mut rows| {
                if rows.len() == 1 {
                    Ok(rows.pop().expect("one"))
                } else {
                    Ok(mlx_rs::ops::concatenate(&rows.iter().collect::<Vec<_>>(), 0)?)
                }
            })
            .collect::<Result<Vec<Array>>>()?;
        Ok((planes, lens))
    }

    /// A sequence's stored planes in logical order, `[1, H_kv, offset, width]` each (K's first).
    pub fn fetch_planes(&self, s: SeqId) -> Result<Vec<Array>> {
        let len = self.seq(s)?.offset;
        if len == 0 {
            let h = self.spec.heads_kv;
            return self.storage.plane_layout(&self.spec).into_iter().map(|(w, dt)| zeros(&[1, h, 0, w], dt)).collect();
        }
        Ok(self.gather(&[s])?.0)
    }

    /// A sequence's K and V in logical order, `[1, H_kv, offset, D]` (affine storage dequantized:
    /// [`Storage::dense`]).
    pub fn fetch(&self, s: SeqId) -> Result<(Array, Array)> {
        self.storage.dense(&self.fetch_planes(s)?)
    }

    /// Appends `tokens.len()` positions to `s` (`k`, `v` `[1, H_kv, L, D]`) without attending.
    pub fn append(&mut self, s: SeqId, tokens: &[u32], k: &Array, v: &Array) -> Result<()> {
        let l = check_kv(&self.spec, k, v, 1, 1)?;
        check_tokens(tokens.len(), l)?;
        let plan = self.plan(&[(s, l)])?;
        self.write(&plan, &[tokens], k, v)?;
        self.seqs.get_mut(&s).expect("written").last_window = Some(l);
        Ok(())
    }

    /// A window read on `s` (a prefill chunk): appends the `L` positions, then attends every position under
    /// `Causal` (`q` `[1, H_q, L, D]`), as a linear [`crate::KvCache`] does.
    pub fn window(&mut self, s: SeqId, tokens: &[u32], k: &Array, v: &Array, q: &Array, scale: f32) -> Result<Array> {
        let l = check_kv(&self.spec, k, v, 1, 1)?;
        check_q(&self.spec, q, 1, l)?;
        self.append(s, tokens, k, v)?;
        attend_planes(&self.storage, q, &self.fetch_planes(s)?, scale, None, true)
    }

    /// A decode step on `s`: one position, then attends every position with no mask.
    pub fn decode(&mut self, s: SeqId, token: u32, k: &Array, v: &Array, q: &Array, scale: f32) -> Result<Array> {
        let l = check_kv(&self.spec, k, v, 1, 1)?;
        if l != 1 {
            return Err(shape(format!("decode writes one position, {l} given")));
        }
        check_q(&self.spec, q, 1, 1)?;
        let plan = self.plan(&[(s, 1)])?;
        self.write(&plan, &[&[token]], k, v)?;
        self.seqs.get_mut(&s).expect("written").last_window = None;
        attend_planes(&self.storage, q, &self.fetch_planes(s)?, scale, None, false)
    }

    /// Drops the last `n` positions of `s` (R-C-5): blocks past the new end lose this table's reference (a block
    /// nothing else references goes back to the pool). `bypass` is the speculative rollback: only right after a
    /// window of at least `n` positions. Returns `n`.
    pub fn trim(&mut self, s: SeqId, n: usize, bypass: bool) -> Result<usize> {
        if self.rows.contains(&s) {
            self.no_pending()?;
        }
        let seq = self.seq(s)?;
        check_trim(seq, n, bypass)?;
        self.trim_unchecked(s, n, bypass);
        Ok(n)
    }

    fn trim_unchecked(&mut self, s: SeqId, n: usize, bypass: bool) {
        let bs = self.pool.block_size;
        let seq = self.seqs.get_mut(&s).expect("checked");
        seq.offset -= n;
        seq.tokens.truncate(seq.offset);
        // As a ring's `last_concat`: a rollback leaves what a window of `L - n` would have left; a plain trim none.
        seq.last_window = if bypass { seq.last_window.and_then(|w| w.checked_sub(n)) } else { None };
        // Mutation hook `Mutant::PagedRollbackKeepsTable`: a rollback keeps the tail blocks.
        let keep =
            if bypass && crate::fault!(PagedRollbackKeepsTable) { seq.table.len() } else { seq.offset.div_ceil(bs) };
        let dropped: Vec<u32> = seq.table.drain(keep..).collect();
        for b in dropped {
            self.unref(b);
        }
    }
}

fn check_tokens(got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(CacheError::BadLengths { what: format!("{got} token ids for {want} positions") });
    }
    Ok(())
}

fn check_trim(seq: &PagedSeq, n: usize, bypass: bool) -> Result<()> {
    let available = if bypass {
        match seq.last_window {
            Some(w) => w,
            None => return Err(CacheError::BypassNotAfterWindow),
        }
    } else {
        seq.offset
    };
    if n > available {
        return Err(CacheError::TrimTooLong { requested: n, available });
    }
    Ok(())
}

fn check_rows(list: &[usize], rows: usize) -> Result<()> {
    for (i, &r) in list.iter().enumerate() {
        if r >= rows {
            return Err(CacheError::NoSuchRow { row: r, rows });
        }
        if list[..i].contains(&r) {
            return Err(CacheError::DuplicateRow { row: r });
        }
    }
    Ok(())
}

/// `[B, H, L, D]` as `[1, H, B * L, D]`, row-major over (row, position): the order of a batch write's slots.
fn flat_rows(a: &Array) -> Result<Array> {
    let s = a.shape().to_vec();
    let t = a.transpose_axes(&[1, 0, 2, 3])?;
    Ok(t.reshape(&[1, s[1], s[0] * s[2], s[3]])?)
}

/// A deterministic permutation of `v` (Fisher-Yates over a splitmix64 stream).
fn permute(v: &mut [u32], seed: u64) {
    let mut z = seed;
    for i in (1..v.len()).rev() {
        z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut x = z;
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^= x >> 31;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
}
