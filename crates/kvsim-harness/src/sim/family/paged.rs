//! The paged family (`kv:paged`, docs/paged.md): one [`PagedStore`] per layer, whose pool every request, the
//! running batch's rows and the prefix index share, checked after every op against three things:
//! - a **cold twin** per request and layer: a linear serial cache of the same storage ([`KvCache`], or
//!   [`QuantizedKvCache`] for affine pools) fed the same K/V and queries, which never shares anything (a request
//!   that took a prefix from the index has its twin compute that prefix itself): every read's output and every
//!   live request's stored planes must be its twin's, bytes;
//! - a **placement twin**: a second store of layer 0 whose free list hands blocks out in a permuted order, fed the
//!   same ops: outputs and logical contents must be the same bytes (physical placement never matters);
//! - the **reference model** ([`PoolModel`]): every table, reference count, the free list, the index's entries and
//!   clock, and the verdict of every write (`PoolExhausted` with the same counts) and trim; plus every stored
//!   column's bytes against the value space's values of the token it should hold (for affine pools, against the
//!   reference quantizer's triple of those values, `kvsim_reference::quant`).
//!
//! Storage: plain planes in most runs; affine (bits and group drawn, KV4 and KV8 most often, as upstream's pools
//! hold) in about a third, with the family's own head dim (the run's is below every group MLX accepts).
//!
//! Values are **content-defined**: a position's K/V/Q are the value space's for a token that identifies the whole
//! prefix up to it (an interned hash chain of the token ids), so two requests with the same prompt prefix have the
//! same K/V there, as a model's would. Requests draw their token ids from a few prompt groups (a shared prefix of
//! drawn length, then tokens of their own), so prefix hits happen; forks (parallel sampling) share every block of
//! their request and then diverge. Token blocks repeat (most group prefixes repeat one block, most requests and
//! forks go on with one motif block after it), so equal blocks sit under different prefixes and at different
//! depths: the index must key a block on the whole chain before it.
//!
//! Lifecycle: before a request's first window, its prompt (its next `len + share_max` tokens) is looked up in the
//! index (all but its last position at most, full blocks only), and the window computes its `len` positions after
//! the prefix it got; `extract` with finish and `filter` end requests, whose full blocks enter the index. The layout is
//! linear (no window): the attention family's window does not apply to it. Prefills of the running batch are
//! right-padded (`Op::Prepare` into rows that may hold positions, `Op::BatchPrefill` of fresh requests that join as
//! rows): each row takes only its real positions of every chunk, and only those are compared with its twin.

use std::collections::{BTreeMap, HashMap};

use mlx_rs::Array;

use crate::sim::check::{self, Failure};
use crate::sim::config::SimConfig;
use crate::sim::family::attention::{payload_block, Res};
use crate::sim::family::{Cx, Family, Registration};
use crate::sim::ops::{Op, OpKind, PagedAction};
use crate::sim::summary::Counters;
use kvsim_cache::{CacheError, KvCache, KvSpec, PagedStore, QuantizedKvCache, SeqId, SerialCache, Storage};
use kvsim_reference::paged::{PoolLimits, PoolModel};
use kvsim_reference::{Tensor, Tok, ValueSpace};

/// The family's name in `SimConfig::families`.
pub const NAME: &str = "paged";

/// What the paged family executes: the attention lifecycle and reads (no batch prefill, no special reads), the
/// save/restore op (the whole store of every layer) and its own ops.
pub fn supports(k: OpKind) -> bool {
    matches!(
        k,
        OpKind::Admit
            | OpKind::SoloWindow
            | OpKind::SoloDecode
            | OpKind::SoloTrim
            | OpKind::Merge
            | OpKind::Join
            | OpKind::Decode
            | OpKind::Window
            | OpKind::Append
            | OpKind::Verify
            | OpKind::Extract
            | OpKind::Filter
            | OpKind::Trim
            | OpKind::Persist
            | OpKind::Prepare
            | OpKind::BatchPrefill
            | OpKind::Paged
    )
}

/// The paged family, in about two fifths of the runs (a fifth until its reach classes needed more: the mutants of
/// its three reach classes are caught in 19 to 27 of seeds 0..300 at two fifths, 7 to 12 at a fifth).
pub const REGISTRATION: Registration = Registration {
    name: NAME,
    supports,
    swarm_probability: 0.4,
    owns: OpKind::is_paged,
    draw_params: Some(|seed| PagedChoice::draw(seed).to_params()),
    weights_from_params: |p| PagedChoice::from_params(p).map(|c| vec![(OpKind::Paged, c.weight)]).unwrap_or_default(),
    draws_op: Some((OpKind::Paged, draw_paged)),
    build: |cfg| Ok(Box::new(Paged::new(cfg)?)),
};

mod checks;
mod choice;
mod lifecycle;
mod own;
mod prefill;
mod writes;

pub use choice::{draw_paged, PagedChoice, PagedQuant};

/// Namespace of the token owners that are forked sequences rather than requests.
const FORK_OWNER: u64 = 1 << 40;

/// One live request (or, during a fork, one forked sequence).
#[derive(Clone)]
struct Req {
    /// Its sequence in every store (the stores open sequences in the same order).
    seq: SeqId,
    /// Who its token ids belong to (the request id, or a fork's own id).
    owner: u64,
    /// Token id, prefix hash and the value space's token of every position held.
    tokens: Vec<u32>,
    chain: Vec<u64>,
    toks: Vec<Tok>,
    /// The cold twins, one per layer.
    twin: Vec<SerialCache>,
    /// Took a prefix from the index.
    warm: bool,
    /// Its first prefill chunk happened (the prefix lookup is done).
    looked_up: bool,
}

/// One run's paged layers.
pub struct Paged {
    /// The run's config, with the family's own head dim for an affine pool.
    cfg: SimConfig,
    vs: ValueSpace,
    spec: KvSpec,
    storage: Storage,
    choice: PagedChoice,
    stores: Vec<PagedStore>,
    /// Layer 0 again, with a permuted free list.
    placement: PagedStore,
    model: PoolModel,
    reqs: BTreeMap<u32, Req>,
    /// Interned prefix hashes: the `req` of a position's value-space token.
    content: HashMap<u64, u32>,
    forks: u64,
    counters: Counters,
    /// Coverage classes the current op reached through this family's state ([`Family::take_reached`]).
    reached: Vec<&'static str>,
}

fn mix(a: u64, b: u64) -> u64 {
    let mut z = a ^ b.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn cache_fail(what: &str, e: CacheError) -> Failure {
    Failure::new("errors", format!("{what}: unexpected {e:?}"))
}

fn pool_fail(what: String) -> Failure {
    Failure::new("paged_pool", what)
}

impl Paged {
    pub fn new(cfg: &SimConfig) -> Res<Paged> {
        let choice = PagedChoice::of(cfg)
            .ok_or_else(|| Failure::new("setup", "the paged family needs the config's paged parameters"))?;
        let mut cfg = cfg.clone();
        if let Some(q) = choice.quant {
            cfg.head_dim = q.head_dim;
        }
        let cfg = &cfg;
        let (spec, vs, storage) = (cfg.kv_spec(), cfg.value_space(), choice.storage());
        let pool = choice.pool();
        let setup = |e: CacheError| Failure::new("setup", e.to_string());
        let stores = (0..cfg.layers)
            .map(|_| PagedStore::with_storage(spec, pool, storage))
            .collect::<Result<Vec<_>, _>>()
            .map_err(setup)?;
        let placement = PagedStore::with_storage(spec, pool, storage).map_err(setup)?.with_free_order(cfg.payload_seed);
        let limits = PoolLimits {
            block_size: pool.block_size,
            initial_blocks: pool.initial_blocks,
            max_blocks: pool.max_blocks,
            grow_by: pool.grow_by,
            index_budget: pool.index_budget,
        };
        Ok(Paged {
            cfg: cfg.clone(),
            vs,
            spec,
            storage,
            choice,
            stores,
            placement,
            model: PoolModel::new(limits),
            reqs: BTreeMap::new(),
            content: HashMap::new(),
            forks: 0,
            counters: Counters::default(),
            reached: vec![],
        })
    }

    /// Records that the current op reached coverage class `class` (once per op).
    fn reach(&mut self, class: &'static str) {
        if !self.reached.contains(&class) {
            self.reached.push(class);
        }
    }

    fn dtype(&self) -> mlx_rs::Dtype {
        self.spec.dtype.to_mlx()
    }

    /// The token id of `owner`'s position `p`: a request's group prefix up to its divergence point, then its own;
    /// or, for three owners in four (requests and forked sequences alike), a motif after it: the same run of
    /// `block_size` ids again and again, aligned to blocks (a request's divergence point rounded down to a block),
    /// whoever the owner and wherever it diverged. Three groups in four repeat one block of ids through their
    /// prefix too. So equal token blocks sit under different prefixes (after another group's prefix, another
    /// divergence point, a fork's parent, another copy of the same block) and at different depths, and only the
    /// chain of blocks before a block tells their K/V apart (as a block hash that chains its parent's does).
    fn token(&self, owner: u64, p: usize) -> u32 {
        let seed = self.cfg.payload_seed;
        let bs = self.choice.block_size as u64;
        let motif = !mix(seed, owner * 4 + 3).is_multiple_of(4);
        if owner < FORK_OWNER {
            let group = mix(seed, owner * 4 + 1) % u64::from(self.choice.groups);
            let diverge = mix(seed, owner * 4 + 2) % (u64::from(self.choice.share_max) + 1);
            if (p as u64) < diverge {
                // Three groups in four repeat one block of ids through their prefix.
                let at = if mix(seed, group * 4 + 5).is_multiple_of(4) { p as u64 } else { p as u64 % bs };
                return ((group * 100_003 + at) & 0x7fff_ffff) as u32;
            }
        }
        if motif {
            return 0x4000_0000 | (p as u64 % bs) as u32;
        }
        0x8000_0000 | (mix(seed ^ owner, p as u64) as u32 & 0x7fff_ffff)
    }

    /// The next `n` positions of `r`: (token ids, prefix hashes, value-space tokens).
    fn next(&mut self, r: &Req, n: usize) -> (Vec<u32>, Vec<u64>, Vec<Tok>) {
        let off = r.tokens.len();
        let mut h = r.chain.last().copied().unwrap_or(self.cfg.payload_seed);
        let (mut ts, mut hs, mut toks) = (vec![], vec![], vec![]);
        for p in off..off + n {
            let t = self.token(r.owner, p);
            h = mix(h, u64::from(t));
            let next_id = self.content.len() as u32;
            let id = *self.content.entry(h).or_insert(next_id);
            ts.push(t);
            hs.push(h);
            toks.push(Tok::new(id, p as u32));
        }
        (ts, hs, toks)
    }

    fn kvq(&self, layer: usize, rows: &[Vec<Tok>]) -> Res<(Array, Array, Array)> {
        let t: Vec<Vec<Option<Tok>>> = rows.iter().map(|r| r.iter().copied().map(Some).collect()).collect();
        Ok((
            payload_block(&self.cfg, &self.vs, layer, Tensor::K, &t)?,
            payload_block(&self.cfg, &self.vs, layer, Tensor::V, &t)?,
            payload_block(&self.cfg, &self.vs, layer, Tensor::Q, &t)?,
        ))
    }

    fn new_twin(&self) -> Res<SerialCache> {
        match self.storage {
            Storage::Plain => KvCache::new(self.spec),
            Storage::Affine(q) => QuantizedKvCache::new(self.spec, q),
        }
        .map_err(|e| Failure::new("setup", e.to_string()))
    }
}

impl Family for Paged {
    fn key(&self) -> &'static str {
        "kv:paged"
    }

    fn apply(&mut self, op: &Op, cx: &mut Cx<'_>) -> Res<bool> {
        if let Some(change) = cx.change {
            return self.carry_out(cx, change);
        }
        match op {
            Op::Admit { .. } | Op::Merge { .. } | Op::Join { .. } | Op::Filter { .. } | Op::BatchPrefill { .. } => {
                Ok(false)
            }
            Op::Extract { row, .. } => {
                let row = *row as usize;
                for st in &mut self.stores {
                    match st.extract(row) {
                        Err(CacheError::NoSuchRow { .. }) => {}
                        other => {
                            return check::fail(Failure::new(
                                "errors",
                                format!("extract of missing row {row}: expected NoSuchRow, got {other:?}"),
                            ))
                            .map(|_| true)
                        }
                    }
                }
                self.counters.expected_errors += 1;
                Ok(true)
            }
            Op::SoloWindow { req, len } => self.solo_window(cx, *req, *len as usize, true),
            Op::SoloDecode { req } => self.solo_decode(cx, *req),
            Op::SoloTrim { req, n, bypass } => {
                if !cx.roster.is_solo(*req) {
                    return Ok(false);
                }
                self.trims(&[*req], &[*n as usize], *bypass, false)?;
                Ok(true)
            }
            Op::Decode => self.batch_write(cx, 0, true),
            Op::Window { len } | Op::Append { len } if *len == 0 => Ok(false),
            Op::Window { len } => self.batch_write(cx, *len as usize, true),
            Op::Append { len } => self.batch_write(cx, *len as usize, false),
            Op::Verify { gamma, accept } => self.verify(cx, *gamma as usize, accept),
            Op::Trim { n, bypass } => {
                let rows: Vec<u32> = cx.roster.rows().to_vec();
                if rows.is_empty() {
                    return Ok(false);
                }
                self.trims(&rows, &vec![*n as usize; rows.len()], *bypass, true)?;
                Ok(true)
            }
            Op::Persist { req, .. } => self.persist(cx, *req),
            Op::Prepare { lengths, chunk, chunks } => {
                let rows: Vec<u32> = cx.roster.rows().to_vec();
                // Skipped as the attention family skips it: a prefill into rows that all hold nothing is the batch
                // prefill's case (the first family's counts decide, for a prefix hit gives a paged row more).
                if rows.is_empty() || lengths.len() != rows.len() || *chunk == 0 || cx.held.iter().all(|&n| n == 0) {
                    return Ok(false);
                }
                let lens: Vec<usize> = lengths.iter().map(|&l| l as usize).collect();
                self.prefill(cx, &rows, &lens, *chunk as usize, *chunks as usize)?;
                Ok(true)
            }
            Op::Paged { action: PagedAction::Fork { req, n, len, finish } } => {
                self.fork(cx, *req, *n as usize, *len as usize, *finish)
            }
            Op::Paged { action: PagedAction::Evict { blocks } } => self.evict(*blocks as usize),
            Op::Paged { action: PagedAction::SameEnd { extra, chunk } } => {
                let rows: Vec<u32> = cx.roster.rows().to_vec();
                if rows.len() < 2 || *extra == 0 || *chunk == 0 {
                    return Ok(false);
                }
                let own: Vec<usize> = rows.iter().map(|id| self.reqs[id].tokens.len()).collect();
                let (lo, hi) = (own.iter().min().copied().unwrap_or(0), own.iter().max().copied().unwrap_or(0));
                let end = hi + *extra as usize;
                let lens: Vec<usize> = own.iter().map(|&o| end - o).collect();
                // The drawn width, widened to the first that divides the longest row's count and exceeds the rows'
                // spread: every row's last chunk is then the same one.
                let longest = end - lo;
                let chunk = ((*chunk as usize).max(hi - lo + 1)..=longest).find(|c| longest.is_multiple_of(*c));
                let chunk = chunk.unwrap_or(longest);
                self.prefill(cx, &rows, &lens, chunk, usize::MAX)?;
                Ok(true)
            }
            _ => Ok(false),
        }
    }

    fn check_state(&mut self, cx: &mut Cx<'_>) -> Res<()> {
        self.check_all(cx)
    }

    fn observe_state(&mut self, _cx: &mut Cx<'_>) -> Res<()> {
        Ok(())
    }

    fn position(&self, req: u32) -> Option<(usize, Option<usize>)> {
        let r = self.reqs.get(&req)?;
        Some((r.tokens.len(), self.model.seqs.get(&r.seq.0).and_then(|s| s.last_window)))
    }

    fn counters(&self) -> &Counters {
        &self.counters
    }

    fn counters_mut(&mut self) -> &mut Counters {
        &mut self.counters
    }

    fn take_reached(&mut self) -> Vec<&'static str> {
        std::mem::take(&mut self.reached)
    }

    fn variant(&self) -> Option<String> {
        Some(match self.storage.quant() {
            None => format!("block {}", self.choice.block_size),
            Some(q) => format!("block {} quant {}:{}", self.choice.block_size, q.bits, q.group),
        })
    }
}
