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
//! their request and then diverge.
//!
//! Lifecycle: before a request's first window, its prompt (its next `len + share_max` tokens) is looked up in the
//! index (all but its last position at most, full blocks only), and the window computes its `len` positions after
//! the prefix it got; `extract` with finish and `filter` end requests, whose full blocks enter the index. The layout is
//! linear (no window): the attention family's window does not apply to it. Prefills of the running batch are
//! right-padded (`Op::Prepare` into rows that may hold positions, `Op::BatchPrefill` of fresh requests that join as
//! rows): each row takes only its real positions of every chunk, and only those are compared with its twin.

use std::collections::{BTreeMap, HashMap};

use mlx_rs::Array;
use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::sim::check::{self, Failure, OutClass};
use crate::sim::config::{Params, SimConfig};
use crate::sim::family::attention::{mlx_fail, payload_block, Res};
use crate::sim::family::{persist_through_bytes, Cx, Family, Registration};
use crate::sim::ops::{Op, OpKind, PagedAction};
use crate::sim::rng::{stream, Stream};
use crate::sim::roster::Change;
use crate::sim::summary::Counters;
use kvsim_cache::bytes::ArrayBytes;
use kvsim_cache::{
    CacheError, KvCache, KvSpec, Masks, PagedStore, PoolSpec, QuantSpec, QuantizedKvCache, SeqId, SerialCache, Storage,
};
use kvsim_reference::paged::{PoolLimits, PoolModel, PoolVerdict};
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

/// The paged family, in about a fifth of the runs.
pub const REGISTRATION: Registration = Registration {
    name: NAME,
    supports,
    swarm_probability: 0.2,
    owns: OpKind::is_paged,
    draw_params: Some(|seed| PagedChoice::draw(seed).to_params()),
    weights_from_params: |p| PagedChoice::from_params(p).map(|c| vec![(OpKind::Paged, c.weight)]).unwrap_or_default(),
    draws_op: Some((OpKind::Paged, draw_paged)),
    build: |cfg| Ok(Box::new(Paged::new(cfg)?)),
};

/// The paged family's parameters of one run (drawn per seed from [`Stream::Paged`]; recorded in the trace's config).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PagedChoice {
    /// Positions per block: 1, sizes that divide nothing in particular (3, 5), powers of two.
    pub block_size: usize,
    pub initial_blocks: usize,
    pub grow_by: usize,
    /// The pool's cap in positions (`None`: practically unbounded); the cap in blocks rounds it up.
    pub cap_positions: Option<usize>,
    /// The prefix index's budget in blocks.
    pub index_budget: usize,
    /// Prompt groups requests draw from (requests of one group share a prompt prefix).
    pub groups: u32,
    /// The longest shared prompt prefix a request draws.
    pub share_max: u32,
    /// Weight of the family's own ops in this run.
    pub weight: u32,
    /// Affine storage of the pool (`None`: plain planes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quant: Option<PagedQuant>,
}

/// An affine pool's parameters and the family's head dim for it (a multiple of the group).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PagedQuant {
    pub bits: usize,
    pub group: usize,
    pub head_dim: usize,
}

impl PagedChoice {
    pub fn draw(seed: u64) -> PagedChoice {
        let mut rng = stream(seed, Stream::Paged);
        // Small blocks most often (the simulator's prompts are short: a hit needs whole blocks), 1 and sizes that
        // divide nothing in particular among them.
        let sizes = [1usize, 1, 2, 2, 3, 4, 4, 5, 8, 16];
        let block_size = sizes[rng.random_range(0..sizes.len())];
        let initial_blocks = rng.random_range(1..=4);
        let grow_by = rng.random_range(1..=4);
        let cap_positions = rng.random_bool(0.35).then(|| rng.random_range(16..=96));
        let index_budget = if rng.random_bool(0.4) { rng.random_range(1..=8) } else { 4096 };
        let groups = rng.random_range(1..=2);
        let share_max = rng.random_range(4..=32);
        let weight = rng.random_range(1..=4);
        // Drawn last, so the draws above are those of runs before affine pools existed.
        let quant = rng.random_bool(0.35).then(|| {
            let bits = [4usize, 4, 8, 8, 2, 3, 5, 6][rng.random_range(0..8)];
            let group = kvsim_cache::QUANT_GROUPS[rng.random_range(0..kvsim_cache::QUANT_GROUPS.len())];
            let dims: Vec<usize> = [32usize, 64, 128].into_iter().filter(|d| d % group == 0).collect();
            PagedQuant { bits, group, head_dim: dims[rng.random_range(0..dims.len())] }
        });
        PagedChoice {
            block_size,
            initial_blocks,
            grow_by,
            cap_positions,
            index_budget,
            groups,
            share_max,
            weight,
            quant,
        }
    }

    /// How the pool stores K and V.
    pub fn storage(&self) -> Storage {
        self.quant.map_or(Storage::Plain, |q| Storage::Affine(QuantSpec { bits: q.bits, group: q.group }))
    }

    pub fn of(cfg: &SimConfig) -> Option<PagedChoice> {
        cfg.params_of(NAME).and_then(PagedChoice::from_params)
    }

    pub fn to_params(self) -> Params {
        Params::of(&self)
    }

    pub fn from_params(p: &Params) -> Option<PagedChoice> {
        p.to()
    }

    /// The pool of every layer's store.
    pub fn pool(&self) -> PoolSpec {
        let max_blocks = match self.cap_positions {
            Some(n) => n.div_ceil(self.block_size).max(self.initial_blocks),
            None => 1 << 16,
        };
        PoolSpec {
            block_size: self.block_size,
            initial_blocks: self.initial_blocks,
            max_blocks,
            grow_by: self.grow_by,
            index_budget: self.index_budget,
        }
    }
}

/// The generator's paged op: a fork (parallel sampling) or an eviction, even odds.
pub fn draw_paged(cfg: &SimConfig, w: &mut ChaCha8Rng) -> Op {
    let action = if w.random_bool(0.5) {
        PagedAction::Fork {
            req: 0,
            n: w.random_range(1..=3),
            len: w.random_range(1..=cfg.max_chunk.max(1) as u32),
            finish: w.random_bool(0.6),
        }
    } else {
        PagedAction::Evict { blocks: w.random_range(1..=8) }
    };
    Op::Paged { action }
}

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
        })
    }

    fn dtype(&self) -> mlx_rs::Dtype {
        self.spec.dtype.to_mlx()
    }

    /// The token id of `owner`'s position `p`: a request's group prefix up to its divergence point, then its own.
    fn token(&self, owner: u64, p: usize) -> u32 {
        let seed = self.cfg.payload_seed;
        if owner < FORK_OWNER {
            let group = mix(seed, owner * 4 + 1) % u64::from(self.choice.groups);
            let diverge = mix(seed, owner * 4 + 2) % (u64::from(self.choice.share_max) + 1);
            if (p as u64) < diverge {
                return ((group * 100_003 + p as u64) & 0x7fff_ffff) as u32;
            }
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

    /// Compares outputs: `(production, other, placement)`. Against the placement store (the same calls on the same
    /// device) always byte for byte; against the twin byte for byte where the run's device promises it (CPU, and the
    /// GPU in exact mode), else (the GPU's fused kernels) the distance in ULPs at output scale is measured and
    /// recorded in the guarantees table.
    fn compare_outputs(
        &mut self,
        cx: &mut Cx<'_>,
        what: &str,
        pairs: &[(&Array, &Array, bool)],
        warm: bool,
    ) -> Res<()> {
        let arrays: Vec<&Array> = pairs.iter().flat_map(|(a, b, _)| [*a, *b]).collect();
        let bytes = ArrayBytes::read_many(&arrays).map_err(|e| mlx_fail("read outputs", e))?;
        let exact = self.counters.guarantees.exact_unpadded_decode;
        for (i, (pair, &(_, _, placement))) in bytes.chunks(2).zip(pairs).enumerate() {
            let worst = if placement || exact || pair[0].shape != pair[1].shape || pair[0].dtype != pair[1].dtype {
                check::bytes_equal(&format!("{what} (read {i})"), &pair[0], &pair[1])?;
                0
            } else {
                check::max_ulp_at_scale(&pair[0], &pair[1])
            };
            cx.hasher.update(&pair[0].digest());
            let tags: &[&'static str] = if warm { &["paged", "paged/warm"] } else { &["paged"] };
            self.counters.record_twin(OutClass::Window, tags, self.dtype(), worst);
            if warm {
                self.counters.paged.warm_vs_cold += 1;
            }
        }
        Ok(())
    }

    /// The model's verdict on a write against production's result.
    fn write_matches(
        &mut self,
        what: &str,
        verdict: &Result<(), PoolVerdict>,
        got: &Result<(), CacheError>,
    ) -> Res<()> {
        match (verdict, got) {
            (Ok(()), Ok(())) => Ok(()),
            (
                Err(PoolVerdict::Exhausted { needed, available }),
                Err(CacheError::PoolExhausted { needed: n, available: a }),
            ) if needed == n && available == a => Ok(()),
            _ => check::fail(Failure::new("errors", format!("{what}: model says {verdict:?}, production {got:?}"))),
        }
    }

    fn trim_matches(what: &str, verdict: &Result<(), PoolVerdict>, got: &Result<(), CacheError>) -> Res<()> {
        let same = matches!(
            (verdict, got),
            (Ok(()), Ok(()))
                | (Err(PoolVerdict::TrimTooLong), Err(CacheError::TrimTooLong { .. }))
                | (Err(PoolVerdict::BypassNotAfterWindow), Err(CacheError::BypassNotAfterWindow))
        );
        if same {
            Ok(())
        } else {
            check::fail(Failure::new("errors", format!("{what}: model says {verdict:?}, production {got:?}")))
        }
    }

    /// Counts what the model says a write of `writes` does: copy-on-write copies and evictions under pressure.
    fn count_write(&mut self, before: &PoolModel, writes: &[(u64, usize)]) {
        let bs = self.choice.block_size;
        let refs = before.refs();
        for &(s, _) in writes {
            let seq = &before.seqs[&s];
            if !seq.offset().is_multiple_of(bs) && refs[*seq.table.last().expect("partial") as usize] > 1 {
                self.counters.paged.cow_copies += 1;
            }
        }
        self.count_evictions(before);
    }

    fn count_evictions(&mut self, before: &PoolModel) {
        let gone = before.index.keys().filter(|k| !self.model.index.contains_key(*k)).count();
        self.counters.paged.evictions += gone as u64;
    }

    // ----- lifecycle ---------------------------------------------------------------------------------------------

    fn carry_out(&mut self, cx: &mut Cx<'_>, change: &Change) -> Res<bool> {
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
    fn end(&mut self, req: u32) -> Res<()> {
        let r = self.reqs.remove(&req).expect("live");
        self.finish_seq(r.seq)
    }

    fn finish_seq(&mut self, seq: SeqId) -> Res<()> {
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

    // ----- writes and reads --------------------------------------------------------------------------------------

    /// A window (`read`) or append of `len` positions on request `id` outside the batch.
    fn solo_window(&mut self, cx: &mut Cx<'_>, id: u32, len: usize, read: bool) -> Res<bool> {
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
    fn lookup(&mut self, r: &mut Req, len: usize) -> Res<()> {
        let (prompt, hashes, toks) = self.next(r, len);
        let (_, hit_m) = {
            let k = self.model.hit_blocks(&prompt, len - 1);
            (k, k * self.choice.block_size)
        };
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

    fn write_solo(&mut self, cx: &mut Cx<'_>, id: u32, n: usize, read: bool) -> Res<bool> {
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

    fn solo_decode(&mut self, cx: &mut Cx<'_>, id: u32) -> Res<bool> {
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
    fn batch_write(&mut self, cx: &mut Cx<'_>, len: usize, read: bool) -> Res<bool> {
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
    fn trims(&mut self, ids: &[u32], n: &[usize], bypass: bool, batch: bool) -> Res<()> {
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
    fn trim_twins_and_model(&mut self, ids: &[u32], seqs: &[u64], n: &[usize], bypass: bool) -> Res<()> {
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

    fn verify(&mut self, cx: &mut Cx<'_>, gamma: usize, accept: &[u32]) -> Res<bool> {
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

    /// A right-padded prefill of the running batch (rows `ids`, in row order): `rows_prepare(lens)` on every
    /// store; while it is pending, a decode, a second prepare, a filter, a save and a round are
    /// `PendingPrefill` with nothing changed; then at most `max_chunks` window chunks of `chunk` positions, in which
    /// row `r` takes `min(left_r, L)` real positions (only those are compared with its twin, and only those take pool
    /// blocks); then `rows_finalize` (the undelivered positions are forgotten), and a second finalize is
    /// `NoPendingPrefill`. A chunk the pool cannot hold is `PoolExhausted` with nothing changed, and ends the
    /// prefill there.
    fn prefill(&mut self, cx: &mut Cx<'_>, ids: &[u32], lens: &[usize], chunk: usize, max_chunks: usize) -> Res<()> {
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
        Ok(())
    }

    // ----- the family's own ops and save/restore -----------------------------------------------------------------

    /// Parallel sampling from request `id` (see [`PagedAction::Fork`]).
    fn fork(&mut self, cx: &mut Cx<'_>, id: u32, n: usize, len: usize, finish: bool) -> Res<bool> {
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

    fn evict(&mut self, blocks: usize) -> Res<bool> {
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
    fn persist(&mut self, cx: &mut Cx<'_>, id: u32) -> Res<bool> {
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

    // ----- state checks ------------------------------------------------------------------------------------------

    /// The pool of every store against the model, and the placement store's own accounting.
    fn check_pool(&mut self) -> Res<()> {
        let m = &self.model;
        let refs = m.refs();
        for (i, st) in self.stores.iter().enumerate() {
            st.audit().map_err(|e| pool_fail(format!("layer {i}: {e}")))?;
            let rows: Vec<u64> = st.rows().iter().map(|s| s.0).collect();
            if st.capacity() != m.capacity || st.refs() != refs.as_slice() || st.free_list() != m.free.as_slice() {
                return check::fail(pool_fail(format!(
                    "layer {i}: capacity {} refs {:?} free {:?}; the model {} {:?} {:?}",
                    st.capacity(),
                    st.refs(),
                    st.free_list(),
                    m.capacity,
                    refs,
                    m.free
                )));
            }
            if rows != m.rows {
                return check::fail(pool_fail(format!("layer {i}: rows {rows:?}, the model {:?}", m.rows)));
            }
            let seqs: Vec<(u64, &[u32], &[u32], Option<usize>)> =
                st.seqs().map(|(s, q)| (s.0, q.table.as_slice(), q.tokens.as_slice(), q.last_window)).collect();
            let want: Vec<(u64, &[u32], &[u32], Option<usize>)> =
                m.seqs.iter().map(|(s, q)| (*s, q.table.as_slice(), q.tokens.as_slice(), q.last_window)).collect();
            if seqs != want {
                return check::fail(pool_fail(format!("layer {i}: sequences {seqs:?}, the model {want:?}")));
            }
            let index: Vec<(Vec<u32>, u32, u64)> =
                st.index_entries().into_iter().map(|e| (e.prefix, e.block, e.last_used)).collect();
            let want: Vec<(Vec<u32>, u32, u64)> = m.index.iter().map(|(p, (b, u))| (p.clone(), *b, *u)).collect();
            if index != want {
                return check::fail(pool_fail(format!("layer {i}: index {index:?}, the model {want:?}")));
            }
            self.counters.paged.pool_checks += 1;
            self.counters.checks += 1;
        }
        self.placement.audit().map_err(|e| pool_fail(format!("placement store: {e}")))?;
        if self.placement.rows().iter().map(|s| s.0).collect::<Vec<_>>() != m.rows {
            return check::fail(pool_fail("placement store: rows differ from the model's".to_string()));
        }
        Ok(())
    }

    /// One request's logical contents in every layer: its stored planes against its twin's, the placement store's
    /// (layer 0) and the value space's values of the tokens it holds (plain planes: the values themselves; affine
    /// planes: the reference quantizer's triple of each), bytes.
    fn check_request(&mut self, cx: &mut Cx<'_>, r: &Req, what: &str) -> Res<()> {
        let n = self.storage.planes();
        let plain = self.storage == Storage::Plain;
        let mut arrays: Vec<Array> = vec![];
        for layer in 0..self.cfg.layers {
            arrays.extend(self.stores[layer].fetch_planes(r.seq).map_err(|e| cache_fail("fetch", e))?);
            arrays.extend(r.twin[layer].temporal_view_planes().map_err(|e| cache_fail("twin view", e))?);
            if plain && !r.toks.is_empty() {
                let t = vec![r.toks.iter().copied().map(Some).collect::<Vec<_>>()];
                arrays.push(payload_block(&self.cfg, &self.vs, layer, Tensor::K, &t)?);
                arrays.push(payload_block(&self.cfg, &self.vs, layer, Tensor::V, &t)?);
            }
            if layer == 0 {
                arrays.extend(self.placement.fetch_planes(r.seq).map_err(|e| cache_fail("placement fetch", e))?);
            }
        }
        let refs: Vec<&Array> = arrays.iter().collect();
        let b = ArrayBytes::read_many(&refs).map_err(|e| mlx_fail("read contents", e))?;
        let mut i = 0;
        for layer in 0..self.cfg.layers {
            let (mine, twin) = (&b[i..i + n], &b[i + n..i + 2 * n]);
            i += 2 * n;
            for (j, (p, t)) in mine.iter().zip(twin).enumerate() {
                check::bytes_equal(&format!("{what} layer {layer}: plane {j} against the twin"), p, t)?;
                cx.hasher.update(&p.digest());
            }
            if !r.toks.is_empty() {
                if plain {
                    let (mk, mv) = (&b[i], &b[i + 1]);
                    i += 2;
                    for (found, want, t) in [(&mine[0], mk, "K"), (&mine[1], mv, "V")] {
                        if found.first_difference(want).is_some() {
                            return check::fail(Failure::new(
                                "layout",
                                format!("{what} layer {layer}: {t} does not hold the values of the tokens it should"),
                            ));
                        }
                    }
                } else if let Some(q) = self.storage.quant() {
                    let rq = kvsim_reference::quant::RefQuant { bits: q.bits, group: q.group };
                    let w = format!("{what} layer {layer}");
                    crate::sim::family::quant::planes_vs_model(&w, &self.vs, layer as u32, rq, mine, &r.toks)?;
                    self.counters.paged.affine_states += 1;
                }
                self.counters.model_checks += 1;
            }
            if layer == 0 {
                for (j, p) in mine.iter().enumerate() {
                    check::bytes_equal(&format!("{what}: plane {j} of the placement store"), p, &b[i + j])?;
                }
                i += n;
                self.counters.paged.placement_compared += 1;
            }
            self.counters.record_state(self.dtype(), 1);
            if r.warm {
                self.counters.paged.warm_vs_cold += 1;
            }
        }
        Ok(())
    }

    fn check_all(&mut self, cx: &mut Cx<'_>) -> Res<()> {
        self.check_pool()?;
        let live: Vec<Req> = self.reqs.values().cloned().collect();
        for r in &live {
            if r.tokens.len() != self.model.seqs[&r.seq.0].offset() {
                return check::fail(pool_fail(format!("sequence {:?}: {} tokens held", r.seq, r.tokens.len())));
            }
            self.check_request(cx, r, &format!("sequence {}", r.seq.0))?;
        }
        Ok(())
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

    fn variant(&self) -> Option<String> {
        Some(match self.storage.quant() {
            None => format!("block {}", self.choice.block_size),
            Some(q) => format!("block {} quant {}:{}", self.choice.block_size, q.bits, q.group),
        })
    }
}
