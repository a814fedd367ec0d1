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
use crate::mask::{MaskKey, MaskKind, MaskUse, Masks};
use crate::quant::{attend_planes, Storage};
use crate::util::{check_kv, check_q, cols, dim, eval, index_array, zeros};
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

/// One node of the prefix index: a full block of token ids under its parent's prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Node {
    parent: Option<usize>,
    key: Vec<u32>,
    block: u32,
    children: BTreeMap<Vec<u32>, usize>,
    last_used: u64,
}

/// One entry of the prefix index as [`PagedStore::index_entries`] lists it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(deny_unknown_fields))]
pub struct IndexEntry {
    /// The token ids from the first position to the end of this block.
    pub prefix: Vec<u32>,
    /// The physical block holding the block's K/V.
    pub block: u32,
    /// The index clock when the entry was last matched or inserted (least recently used goes first).
    pub last_used: u64,
}

/// The radix tree over full blocks of token ids.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct PrefixIndex {
    nodes: Vec<Option<Node>>,
    roots: BTreeMap<Vec<u32>, usize>,
    clock: u64,
}

impl PrefixIndex {
    fn live(&self) -> impl Iterator<Item = (usize, &Node)> {
        self.nodes.iter().enumerate().filter_map(|(i, n)| n.as_ref().map(|n| (i, n)))
    }

    fn len(&self) -> usize {
        self.live().count()
    }

    fn node(&self, i: usize) -> &Node {
        self.nodes[i].as_ref().expect("index node ids are live")
    }

    fn children_of(&self, parent: Option<usize>) -> &BTreeMap<Vec<u32>, usize> {
        match parent {
            None => &self.roots,
            Some(p) => &self.node(p).children,
        }
    }

    /// The nodes along the longest cached chain of full blocks of `tokens`.
    fn matching(&self, tokens: &[u32], bs: usize) -> Vec<usize> {
        let mut at = None;
        let mut out = vec![];
        for chunk in tokens.chunks_exact(bs) {
            match self.children_of(at).get(chunk).copied() {
                Some(n) => {
                    out.push(n);
                    at = Some(n);
                }
                None => break,
            }
        }
        if crate::fault!(PagedPartialMatch) {
            // Mutation hook `Mutant::PagedPartialMatch`: a block that agrees with the prompt's next tokens on a part
            // of itself only (a partial last block, or a block the prompt leaves midway) matches as a whole.
            let rest = &tokens[out.len() * bs..];
            let agree = |key: &Vec<u32>| key.iter().zip(rest).take_while(|(a, b)| a == b).count();
            if let Some((_, &n)) = self.children_of(at).iter().find(|(key, _)| (1..bs).contains(&agree(key))) {
                out.push(n);
            }
        }
        out
    }

    fn touch(&mut self, ids: &[usize]) {
        self.clock += 1;
        for &i in ids {
            if let Some(n) = self.nodes[i].as_mut() {
                n.last_used = self.clock;
            }
        }
    }

    /// The least recently used leaf whose block only the index references (ties: the lower block).
    fn lru_leaf(&self, refs: &[u32]) -> Option<usize> {
        self.live()
            .filter(|(_, n)| {
                n.children.is_empty() && (refs[n.block as usize] == 1 || crate::fault!(PagedEvictReferenced))
            })
            .min_by_key(|(_, n)| (n.last_used, n.block))
            .map(|(i, _)| i)
    }

    fn remove(&mut self, i: usize) -> u32 {
        let n = self.nodes[i].take().expect("removing a live node");
        match n.parent {
            None => self.roots.remove(&n.key),
            Some(p) => self.nodes[p].as_mut().expect("parent is live").children.remove(&n.key),
        };
        n.block
    }

    /// How many blocks evictions could free: nodes whose block and whole subtree only the index references.
    fn evictable(&self, refs: &[u32]) -> usize {
        fn walk(ix: &PrefixIndex, i: usize, refs: &[u32]) -> (bool, usize) {
            let n = ix.node(i);
            let mut all = refs[n.block as usize] == 1;
            let mut count = 0;
            for &c in n.children.values() {
                let (ok, k) = walk(ix, c, refs);
                all &= ok;
                count += k;
            }
            (all, count + usize::from(all))
        }
        self.roots.values().map(|&r| walk(self, r, refs).1).sum()
    }

    fn prefix_of(&self, i: usize) -> Vec<u32> {
        let mut chain = vec![];
        let mut at = Some(i);
        while let Some(n) = at {
            chain.push(n);
            at = self.node(n).parent;
        }
        chain.iter().rev().flat_map(|&n| self.node(n).key.iter().copied()).collect()
    }
}

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
            for p in &mut planes {
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

    /// Sequences outside the batch join it at its end, in this order (nothing moves: rows are block tables).
    pub fn join(&mut self, seqs: &[SeqId]) -> Result<()> {
        self.no_round()?;
        self.no_pending()?;
        for (i, s) in seqs.iter().enumerate() {
            self.seq(*s)?;
            self.not_a_row(*s)?;
            if seqs[..i].contains(s) {
                return Err(CacheError::DuplicateRow { row: self.rows.len() + i });
            }
        }
        self.rows.extend_from_slice(seqs);
        Ok(())
    }

    /// Reorders the running batch's rows: `order` lists every row index once.
    pub fn reorder(&mut self, order: &[usize]) -> Result<()> {
        self.no_round()?;
        self.no_pending()?;
        check_rows(order, self.rows.len())?;
        if order.len() != self.rows.len() {
            return Err(CacheError::BadLengths { what: format!("{} rows, order of {}", self.rows.len(), order.len()) });
        }
        self.rows = order.iter().map(|&r| self.rows[r]).collect();
        Ok(())
    }

    /// Row `row` leaves the batch and goes on as a sequence outside it.
    pub fn extract(&mut self, row: usize) -> Result<SeqId> {
        self.no_round()?;
        self.no_pending()?;
        if row >= self.rows.len() {
            return Err(CacheError::NoSuchRow { row, rows: self.rows.len() });
        }
        Ok(self.rows.remove(row))
    }

    /// Keeps only these rows, in this order; returns the sequences of the others (still live, outside the batch).
    pub fn filter(&mut self, keep: &[usize]) -> Result<Vec<SeqId>> {
        self.no_round()?;
        self.no_pending()?;
        check_rows(keep, self.rows.len())?;
        let out: Vec<SeqId> = (0..self.rows.len()).filter(|r| !keep.contains(r)).map(|r| self.rows[r]).collect();
        self.rows = keep.iter().map(|&r| self.rows[r]).collect();
        Ok(out)
    }

    /// One decode step for every row (`k`, `v` `[B, H_kv, 1, D]`, `q` `[B, H_q, 1, D]`, one token per row), then
    /// the rows are attended: plain rows over `[0, max len_r)`, no mask when every row has the same length, else
    /// `c < len_r`; affine rows one by one over their own positions. [`CacheError::PendingPrefill`] during a
    /// prepared prefill.
    pub fn rows_decode(
        &mut self,
        tokens: &[u32],
        k: &Array,
        v: &Array,
        q: &Array,
        scale: f32,
        masks: &Masks,
    ) -> Result<(Array, MaskUse)> {
        self.no_pending()?;
        let b = self.rows.len();
        let l = check_kv(&self.spec, k, v, b, 1)?;
        if l != 1 {
            return Err(shape(format!("decode writes one position per row, {l} given")));
        }
        check_q(&self.spec, q, b, 1)?;
        check_tokens(tokens.len(), b)?;
        if b == 0 {
            return Err(invalid("decode on a batch with no rows"));
        }
        let writes: Vec<(SeqId, usize)> = self.rows.iter().map(|&s| (s, 1)).collect();
        let plan = self.plan(&writes)?;
        let per: Vec<&[u32]> = tokens.chunks(1).collect();
        let (fk, fv) = (flat_rows(k)?, flat_rows(v)?);
        self.write(&plan, &per, &fk, &fv)?;
        for s in self.rows.clone() {
            self.seqs.get_mut(&s).expect("row").last_window = None;
        }
        if self.storage != Storage::Plain {
            return Ok((self.rows_one_by_one(q, &vec![1; b], false, scale)?, MaskUse::None));
        }
        let rows = self.rows.clone();
        let (planes, lens) = self.gather(&rows)?;
        if lens.iter().all(|&n| n == lens[0]) {
            return Ok((attend_planes(&self.storage, q, &planes, scale, None, false)?, MaskUse::None));
        }
        let width = lens.iter().copied().max().unwrap_or(1);
        let key = crate::batch::decode_mask_key(lens, None, width);
        let (spec, arr) = masks.get(&key)?;
        Ok((attend_planes(&self.storage, q, &planes, scale, Some((&spec, &arr)), false)?, MaskUse::Array(spec)))
    }

    /// A window read of `L` positions for every row (`tokens[r]` the row's `L` ids), then every row attended
    /// causally. Plain rows: `Causal` when every row has the same length and took all `L`, else the per-row causal
    /// mask of a [`crate::RowBatch`]. Affine rows: one by one, each row's real queries over its own positions. During
    /// a prepared prefill row `r` takes only its first `min(pending_r, L)` positions; outputs at the other query
    /// positions are unspecified (zeros for affine rows).
    pub fn rows_window(
        &mut self,
        tokens: &[Vec<u32>],
        k: &Array,
        v: &Array,
        q: &Array,
        scale: f32,
        masks: &Masks,
    ) -> Result<(Array, MaskUse)> {
        let b = self.rows.len();
        let l = check_kv(&self.spec, k, v, b, 1)?;
        check_q(&self.spec, q, b, l)?;
        let real = self.rows_append(tokens, k, v)?;
        if self.storage != Storage::Plain {
            return Ok((self.rows_one_by_one(q, &real, true, scale)?, MaskUse::Causal));
        }
        let rows = self.rows.clone();
        let (planes, lens) = self.gather(&rows)?;
        if real.iter().all(|&n| n == l) && lens.iter().all(|&n| n == lens[0]) {
            return Ok((attend_planes(&self.storage, q, &planes, scale, None, true)?, MaskUse::Causal));
        }
        let width = lens.iter().copied().max().unwrap_or(1);
        let key = MaskKey { kind: MaskKind::Window, lens, real, queries: l, window: None, cols: width };
        let (spec, arr) = masks.get(&key)?;
        Ok((attend_planes(&self.storage, q, &planes, scale, Some((&spec, &arr)), false)?, MaskUse::Array(spec)))
    }

    /// Row by row: row `r`'s first `real[r]` queries (`q` `[B, H_q, L, D]`) over exactly its own positions (causal
    /// for a window, no mask for a decode), the serial cache's own read; queries past `real[r]` give zeros.
    fn rows_one_by_one(&self, q: &Array, real: &[usize], causal: bool, scale: f32) -> Result<Array> {
        let qs: Vec<usize> = q.shape().iter().map(|&x| x.max(0) as usize).collect();
        let (hq, l, d) = (qs[1], qs[2], qs[3]);
        let mut outs = vec![];
        for (r, (&s, &n)) in self.rows.iter().zip(real).enumerate() {
            let qr = q.take_axis(&index_array(&[r], &[1])?, 0)?;
            let mut out = if n == 0 {
                zeros(&[1, hq, l, d], q.dtype())?
            } else {
                let qr = if n < l { cols(&qr, 0, n)? } else { qr };
                attend_planes(&self.storage, &qr, &self.fetch_planes(s)?, scale, None, causal)?
            };
            if n > 0 && n < l {
                out = mlx_rs::ops::concatenate(&[&out, &zeros(&[1, hq, l - n, d], q.dtype())?], 2)?;
            }
            outs.push(out);
        }
        if outs.len() == 1 {
            return Ok(outs.pop().expect("one"));
        }
        Ok(mlx_rs::ops::concatenate(&outs.iter().collect::<Vec<_>>(), 0)?)
    }

    /// Appends `L` positions to every row without attending (during a prepared prefill, row `r` takes its first
    /// `min(pending_r, L)`; a row that takes none is untouched). Returns the positions each row took.
    pub fn rows_append(&mut self, tokens: &[Vec<u32>], k: &Array, v: &Array) -> Result<Vec<usize>> {
        let b = self.rows.len();
        let l = check_kv(&self.spec, k, v, b, 1)?;
        check_tokens(tokens.len(), b)?;
        for t in tokens {
            check_tokens(t.len(), l)?;
        }
        if b == 0 {
            return Err(invalid("a write on a batch with no rows"));
        }
        let real: Vec<usize> = match &self.pending {
            Some(p) => p.iter().map(|&n| n.min(l)).collect(),
            None => vec![l; b],
        };
        let writes: Vec<(SeqId, usize)> = self.rows.iter().zip(&real).map(|(&s, &n)| (s, n)).collect();
        let plan = self.plan(&writes)?;
        let per: Vec<&[u32]> = tokens.iter().zip(&real).map(|(t, &n)| &t[..n]).collect();
        let (fk, fv) = if real.iter().all(|&n| n == l) {
            (flat_rows(k)?, flat_rows(v)?)
        } else {
            // Each row's real positions only, in plan order.
            let at: Vec<usize> = real.iter().enumerate().flat_map(|(r, &n)| (0..n).map(move |i| r * l + i)).collect();
            let at = index_array(&at, &[at.len()])?;
            (flat_rows(k)?.take_axis(&at, 2)?, flat_rows(v)?.take_axis(&at, 2)?)
        };
        self.write(&plan, &per, &fk, &fv)?;
        for (s, &n) in self.rows.clone().iter().zip(&real) {
            if n > 0 {
                self.seqs.get_mut(s).expect("row").last_window = Some(n);
            }
        }
        if let Some(p) = self.pending.as_mut() {
            for (left, &n) in p.iter_mut().zip(&real) {
                *left -= n;
            }
        }
        Ok(real)
    }

    /// A right-padded prefill of the running batch: row `r` takes `lengths[r]` more real positions, delivered by
    /// the next window chunks ([`PagedStore::rows_window`], [`PagedStore::rows_append`]). Errors, nothing changed:
    /// [`CacheError::PendingPrefill`] (one is pending), [`CacheError::SpecRoundActive`], [`CacheError::BadLengths`]
    /// (one length per row).
    pub fn rows_prepare(&mut self, lengths: &[usize]) -> Result<()> {
        self.no_pending()?;
        self.no_round()?;
        if lengths.len() != self.rows.len() {
            return Err(CacheError::BadLengths {
                what: format!("{} lengths for {} rows", lengths.len(), self.rows.len()),
            });
        }
        self.pending = Some(lengths.to_vec());
        Ok(())
    }

    /// Ends a prepared prefill; positions not yet delivered are forgotten (no pool block was taken for them).
    /// [`CacheError::NoPendingPrefill`] if none is pending.
    pub fn rows_finalize(&mut self) -> Result<()> {
        self.pending.take().map(|_| ()).ok_or(CacheError::NoPendingPrefill)
    }

    /// Whether a prepared prefill is pending.
    pub fn is_pending(&self) -> bool {
        self.pending.is_some()
    }

    fn no_pending(&self) -> Result<()> {
        match self.pending {
            Some(_) => Err(CacheError::PendingPrefill),
            None => Ok(()),
        }
    }

    /// Per-row trims (`n[r]` positions from row `r`; speculative rollback with per-row accepts when `bypass`):
    /// every row is checked first, nothing changes on an error.
    pub fn rows_trim(&mut self, n: &[usize], bypass: bool) -> Result<()> {
        self.no_round()?;
        self.no_pending()?;
        if n.len() != self.rows.len() {
            return Err(CacheError::BadLengths { what: format!("{} trims for {} rows", n.len(), self.rows.len()) });
        }
        for (s, &k) in self.rows.iter().zip(n) {
            check_trim(&self.seqs[s], k, bypass)?;
        }
        for (s, &k) in self.rows.clone().iter().zip(n) {
            self.trim_unchecked(*s, k, bypass);
        }
        Ok(())
    }

    // ----- speculative rounds (R-C-6) ---------------------------------------------------------------------------

    /// Whether a speculative round is armed.
    pub fn in_round(&self) -> bool {
        self.round.is_some()
    }

    /// Arms a speculative round over the running batch before its verify window: each row's offset is recorded.
    /// While it is armed, the rows' writes and reads go on as usual, and `join`, `reorder`, `extract`, `filter`,
    /// `rows_trim` and `to_parts` are refused ([`CacheError::SpecRoundActive`], nothing changed); so is a second
    /// `round_begin`.
    pub fn round_begin(&mut self) -> Result<()> {
        self.no_round()?;
        self.no_pending()?;
        self.round = Some(self.rows.iter().map(|s| self.seqs[s].offset).collect());
        Ok(())
    }

    /// Ends the round keeping every position it wrote. [`CacheError::NoSpecRound`] without one.
    pub fn round_commit(&mut self) -> Result<()> {
        self.round.take().map(|_| ()).ok_or(CacheError::NoSpecRound)
    }

    /// Ends the round keeping the first `keep[r]` of the positions it wrote into row `r`: the rest go as a
    /// rollback trim does (`trim(n, bypass = true)`), their tail blocks back to the pool. Errors, nothing changed:
    /// [`CacheError::NoSpecRound`], [`CacheError::BadLengths`] (one count per row),
    /// [`CacheError::KeepOutsideWindow`] (more than the round wrote).
    pub fn round_rollback(&mut self, keep: &[usize]) -> Result<()> {
        let at = self.round.as_ref().ok_or(CacheError::NoSpecRound)?;
        if keep.len() != self.rows.len() {
            return Err(CacheError::BadLengths { what: format!("{} keeps for {} rows", keep.len(), self.rows.len()) });
        }
        let wrote: Vec<usize> = self.rows.iter().zip(at).map(|(s, &o)| self.seqs[s].offset - o).collect();
        if let Some((&k, &w)) = keep.iter().zip(&wrote).find(|(&k, &w)| k > w) {
            return Err(CacheError::KeepOutsideWindow { keep: k, window: w });
        }
        for (s, (&w, &k)) in self.rows.clone().iter().zip(wrote.iter().zip(keep)) {
            self.trim_unchecked(*s, w - k, true);
        }
        self.round = None;
        Ok(())
    }

    fn no_round(&self) -> Result<()> {
        match self.round {
            Some(_) => Err(CacheError::SpecRoundActive),
            None => Ok(()),
        }
    }

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
    /// armed ([`CacheError::SpecRoundActive`]) or a prefill pending ([`CacheError::PendingPrefill`]): what they
    /// wrote is not committed, and neither is a part.
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

#[cfg(test)]
mod tests;
