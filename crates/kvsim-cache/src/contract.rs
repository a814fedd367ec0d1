//! The spec's common contract as traits (R-C-1..10): what generic code may ask of any layout without matching on
//! its type.
//!
//! - [`Cache`]: every layout (serial rings and rows, plain and affine, the chunked cache, the bf16-first legos and
//!   their rows, the recurrent cache, the training caches). Identity (`storage_kind`, [`Capabilities`] answered
//!   from that string alone, `composed` on wrappers), positions (`offsets` per row, by value), storage
//!   (`bytes_per_token`, `state`), trims (`is_trimmable` / `trim(n, bypass)`), the decode step's host side
//!   (`decode_phase`, `prepare_decode_step`, the RoPE input), precision boundaries (`max_committed`,
//!   `minimum_reusable_offset`) and, where they exist, speculative rounds ([`SpecRounds`], through
//!   [`Cache::rounds`]).
//! - [`AttentionCache`]: the K/V reads (decode, window, committed span), each taking the forward's [`Masks`]
//!   (R-C-3: every layer and every row layout made from a cache shares them, so each mask is built once), and
//!   the stored planes of a row in physical order (what a byte comparison reads).
//! - [`RowLayout`]: rows under continuous batching (merge, join, extract, filter, `adopt` of storage already laid
//!   out and the `parts` it takes, a right-padded prefill's prepare / finalize).
//!
//! Capability predicates answer from the storage kind only (R-C-1): a cache whose kind is unknown has no
//! capability and every router refuses it (fail closed). The traits add no behaviour: each method is the
//! layout's own inherent method of the same meaning, so the guarantees documented there hold unchanged.

use mlx_rs::Array;

use super::batch::{JoinSource, RowBatch, RowState};
use super::chunked::ChunkedKvCache;
use super::error::CacheError;
use super::kind::{self, StorageKind};
use super::mask::Masks;
use super::paged::PagedStore;
use super::quant::Storage;
use super::ring::{DecodePhase, SerialCache};
use super::ssm::{SsmCache, SsmSpec};
use super::training::{PrefixSharedCache, TrainingCache, TrainingSsmCache};
use super::transition::{Bf16FirstCache, RowsParts, Transition, TransitioningKvRows};
use super::{KvSpec, Result};

/// What a cache of some storage kind can take part in, decided from the kind string alone (R-C-1). Every field is
/// `false` for a string that is not a kind kvsim knows, so nothing routes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capabilities {
    /// Any kind kvsim knows (attention, chunked, bf16-first, recurrent, training or a cache list).
    pub known: bool,
    /// A batch of rows (the row-batch marker, or the bf16-first rows' `kv:delayed-*` kinds, or `ssm`, which holds
    /// any number of rows).
    pub row_batch: bool,
    /// A rotating ring (plain or affine), its rows, or bf16-first rings and their rows.
    pub rotating: bool,
    /// Affine-quantized storage (`kv:quant:*`, `kv:rotating-quant:*`; bf16-first layouts convert to it and answer
    /// `false`: what they hold now is in [`Cache::composed`]).
    pub quantized: bool,
    /// A layout whose precision changes at a boundary (the bf16-first legos and rows).
    pub transitioning: bool,
    /// A recurrent state (`ssm`): never trimmable, speculative rounds instead (R-C-6).
    pub recurrent: bool,
    /// Stateless training-only (`train:*`): never admitted, merged or persisted (R-TRN-1).
    pub training_only: bool,
    /// A kind the attention router sends somewhere ([`StorageKind::route`] answers `Ok`).
    pub routed: bool,
}

impl Capabilities {
    /// The capabilities of `kind`, from the string alone.
    pub fn of(kind: &StorageKind) -> Capabilities {
        let delayed = kind::parse_delayed(kind);
        let lego = kind::parse_bf16_first(kind);
        let transitioning = delayed.is_some() || lego.is_some();
        let bf16_rotating = delayed.or(lego).is_some_and(|d| d.max_size.is_some());
        let recurrent = kind::is_ssm(kind);
        let training_only = kind::is_training(kind);
        let chunked = is_chunked(kind);
        let list = kind.as_str() == kind::CACHE_LIST;
        let paged = kind::parse_paged(kind);
        Capabilities {
            known: kind::is_known(kind)
                || transitioning
                || chunked
                || list
                || recurrent
                || training_only
                || paged.is_some(),
            row_batch: kind::is_row_batch(kind) || delayed.is_some() || recurrent || paged.is_some_and(|p| p.rows),
            rotating: kind::is_rotating(kind) || bf16_rotating,
            quantized: kind::is_quantized(kind) || paged.is_some_and(|p| p.quant.is_some()),
            transitioning,
            recurrent,
            training_only,
            routed: kind.route().is_ok(),
        }
    }
}

/// `kv-chunked:<chunk_size>` written exactly as [`ChunkedKvCache::storage_kind`] writes it.
fn is_chunked(kind: &StorageKind) -> bool {
    kind.as_str()
        .strip_prefix(kind::CHUNKED_PREFIX)
        .is_some_and(|n| n.parse::<usize>().is_ok_and(|v| v > 0 && v.to_string() == n))
}

/// What a wrapper composes (R-C-10): its own kind, and the kind of the storage it holds now, per row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Composed {
    /// The wrapper's own kind (a bf16-first lego's `kv:bf16-first-*`, a chunked cache's `kv-chunked:<n>`).
    pub wrapper: StorageKind,
    /// The storage each row holds now, as a serial kind (one entry for a serial wrapper): what the row's bare
    /// storage routes as (`kv-plain`, then `kv:quant:<bits>:<group>` after a transition).
    pub storage: Vec<StorageKind>,
    /// The kernel set the wrapper's reads attend with, by name ([`crate::KernelSet::name`]; the bf16-first
    /// layouts), or `None` where the wrapper reads with its storage's own.
    pub kernels: Option<String>,
}

/// Speculative rounds (R-C-6): arm before the verify forward, then commit on full acceptance or roll back keeping
/// a prefix. Layouts whose state cannot trim (recurrent) or whose precision must not change inside a round
/// (bf16-first) have them; trimmable rings use [`Cache::trim`] with `bypass` instead.
pub trait SpecRounds {
    /// Whether a round is armed.
    fn in_round(&self) -> bool;
    /// Arms a round. A round already armed (or a pending prefill) is a typed error, nothing changed.
    fn round_begin(&mut self) -> Result<()>;
    /// Ends the round keeping every position.
    fn round_commit(&mut self) -> Result<()>;
    /// Ends the round keeping `keep[r]` of the positions it wrote into row `r` (one count per row). Errors change
    /// nothing.
    fn round_rollback(&mut self, keep: &[usize]) -> Result<()>;
}

/// The contract every layout speaks (module documentation).
pub trait Cache {
    /// R-C-1: the stable identity string every guard and codec compares.
    fn storage_kind(&self) -> StorageKind;

    /// R-C-1: what this cache may take part in, from [`Cache::storage_kind`] alone.
    fn capabilities(&self) -> Capabilities {
        Capabilities::of(&self.storage_kind())
    }

    /// R-C-10: on a cache that composes the storage it holds, the composition; `None` for a cache that is its
    /// storage.
    fn composed(&self) -> Option<Composed> {
        None
    }

    /// Rows held (1 for a serial cache; the training caches count their batch rows or 1).
    fn rows(&self) -> usize;

    /// Positions ever written, per row, by value (R-BROT-3: never an alias of the cache's state).
    fn offsets(&self) -> Vec<usize>;

    /// The scalar offset: the largest row's (0 without rows).
    fn offset(&self) -> usize {
        self.offsets().into_iter().max().unwrap_or(0)
    }

    /// R-C-4: the physical storage one more token costs one row; 0 for a recurrent state; `None` for the
    /// stateless training adapters, which may leave it out.
    fn bytes_per_token(&self) -> Option<usize>;

    /// R-C-5: whether `trim(n, false)` may drop positions now.
    fn is_trimmable(&self) -> bool;

    /// R-C-5: drop the last `n` positions of every row (`bypass`: the speculative rollback right after one window
    /// write). Returns the positions dropped; a refusal is a typed error with nothing changed.
    fn trim(&mut self, n: usize, bypass: bool) -> Result<usize>;

    /// R-ROT-5 per row: the fetch the coming decode step will take, without moving anything (`None`: a layout
    /// without a K/V decode step: recurrent, training).
    fn decode_phase(&self) -> Option<Vec<DecodePhase>>;

    /// R-C-9: the host bookkeeping of a one-token step (growth, oversize drop, rotation) without the write; each
    /// row's target column. A layout without a K/V decode step answers [`CacheError::Unsupported`].
    fn prepare_decode_step(&mut self) -> Result<Vec<usize>>;

    /// R-C-9: the RoPE offset as an int32 array input, which only compiled-decode trace adapters expose; a real
    /// cache leaves it unset (`None`: the static integer path) and says its positions through `offsets`.
    fn rope_input(&self) -> Option<Array> {
        None
    }

    /// R-C-7: positions that may be committed before this state changes precision (`None`: unbounded).
    fn max_committed(&self) -> Option<usize> {
        None
    }

    /// R-C-7: the earliest prefix whose retained representation can still resume generation (0: any).
    fn minimum_reusable_offset(&self) -> usize {
        0
    }

    /// R-C-8: the arrays that hold this cache's state (its stored planes, or its recurrent states). They are values
    /// owned by the caller: later writes to the cache never change them, and dropping them releases them without
    /// touching the cache. Empty for the stateless caches.
    fn state(&self) -> Result<Vec<Array>>;

    /// R-C-6: the speculative rounds, on layouts that have them.
    fn rounds(&mut self) -> Option<&mut dyn SpecRounds> {
        None
    }
}

/// The K/V reads of an attention layout (R-C-2), each under the forward's [`Masks`] (R-C-3). `k`, `v` are
/// `[B, H_kv, L, D]`, `q` `[B, H_q, L, D]`, `B` the layout's rows.
pub trait AttentionCache: Cache {
    /// The K/V geometry every input is checked against.
    fn spec(&self) -> KvSpec;
    /// The sliding window (`None`: full attention).
    fn max_size(&self) -> Option<usize>;
    /// One new position per row (`L = 1`).
    fn decode(&mut self, k: &Array, v: &Array, q: &Array, scale: f32, masks: &Masks) -> Result<Array>;
    /// `L` new positions per row, causal within the block.
    fn window(&mut self, k: &Array, v: &Array, q: &Array, scale: f32, masks: &Masks) -> Result<Array>;
    /// A committed span (R-ROT-7): `L` decodes, one per position; outputs concatenated on the token axis.
    fn commit_span(&mut self, k: &Array, v: &Array, q: &Array, scale: f32, masks: &Masks) -> Result<Array>;
    /// Row `row`'s stored planes (`[k, v]`, or the six affine planes), live columns in physical order.
    fn row_planes(&self, row: usize) -> Result<Vec<Array>>;
}

/// Rows under continuous batching: the row-layout contract (R-BROT-4..7, R-TKV-5, R-SSM-3).
pub trait RowLayout: Cache + Sized {
    /// What one row is when handed back to serial use (`extract`) and what `merge` / `join` take.
    type Serial;
    /// What a layout's rows share (spec, window, storage or transition).
    type Geometry: Clone;
    /// This layout's geometry.
    fn geometry(&self) -> Self::Geometry;
    /// Rows from serial caches (consumed), in order; each row's state is its source's (R-BROT-4: temporal
    /// slices behind padding for rings, R-TKV-1 for legos, R-SSM: states stacked).
    fn merge(geometry: &Self::Geometry, rows: Vec<Self::Serial>) -> Result<Self>;
    /// Rows from borrowed serial caches, in order (R-BROT-7: rings keep their physical columns and phase).
    fn join(geometry: &Self::Geometry, rows: &[&Self::Serial]) -> Result<Self>;
    /// Row `row` handed back to serial use (R-BROT-5, R-TKV-5).
    fn extract(&self, row: usize) -> Result<Self::Serial>;
    /// Keep these rows, in this order (R-BROT-6); bad or repeated rows are typed errors, nothing changed.
    fn filter(&mut self, keep: &[usize]) -> Result<()>;
    /// A right-padded prefill: row `r` has `lengths[r]` more real positions, delivered by the next windows.
    fn prepare(&mut self, lengths: &[usize]) -> Result<()>;
    /// Ends a prepared prefill.
    fn finalize(&mut self) -> Result<()>;
    /// Whether a prepared prefill is pending.
    fn is_pending(&self) -> bool;
    /// What the layout is made of when it takes storage already laid out (upstream `adopt`; R-BROT-8): owned
    /// buffers or per-row storage, and the per-row state.
    type Parts;
    /// This layout's parts, owned by the caller: [`RowLayout::adopt`] of them (with this geometry) is this layout
    /// again, every row's bytes and state. A layout mid-round or mid-prefill whose bookkeeping is not a part is a
    /// typed error.
    fn parts(&self) -> Result<Self::Parts>;
    /// The layout that takes these parts, moving no column; a state no writes could produce is
    /// [`CacheError::InvalidState`], parts of another geometry a mismatch error; nothing is built on an error.
    fn adopt(geometry: &Self::Geometry, parts: Self::Parts) -> Result<Self>;
}

/// What a [`RowBatch`] is made of ([`RowLayout::parts`]): its owned planes `[B, H_kv, cap, ·]` (zero columns when
/// it holds none) and every row's state.
#[derive(Debug, Clone)]
pub struct BatchParts {
    /// The storage's planes (`[k, v]`, or the six affine planes), every row's physical columns.
    pub planes: Vec<Array>,
    /// Row `r`'s state (ring, base, pending prefill).
    pub rows: Vec<RowState>,
}

/// What a [`SsmCache`] is made of ([`RowLayout::parts`]): its two states and every row's offset.
#[derive(Debug, Clone)]
pub struct SsmParts {
    /// The convolution state `[B, kernel - 1, conv_dim]`.
    pub conv: Array,
    /// The recurrent state `[B, H_v, D_v, D_k]` (f32).
    pub recurrent: Array,
    /// Row `r`'s offset.
    pub offsets: Vec<usize>,
}

fn unsupported(kind: StorageKind, call: &'static str) -> CacheError {
    CacheError::Unsupported { kind: kind.0, call }
}

// ---------------------------------------------------------------------------------------------------------------
// Serial rings (plain and affine) and their rows.

impl Cache for SerialCache {
    fn storage_kind(&self) -> StorageKind {
        SerialCache::storage_kind(self)
    }
    fn rows(&self) -> usize {
        1
    }
    fn offsets(&self) -> Vec<usize> {
        vec![SerialCache::offset(self)]
    }
    fn bytes_per_token(&self) -> Option<usize> {
        Some(SerialCache::bytes_per_token(self))
    }
    fn is_trimmable(&self) -> bool {
        SerialCache::is_trimmable(self)
    }
    fn trim(&mut self, n: usize, bypass: bool) -> Result<usize> {
        SerialCache::trim(self, n, bypass)
    }
    fn decode_phase(&self) -> Option<Vec<DecodePhase>> {
        Some(vec![SerialCache::decode_phase(self)])
    }
    fn prepare_decode_step(&mut self) -> Result<Vec<usize>> {
        Ok(vec![SerialCache::prepare_decode_step(self)?.write_pos])
    }
    fn state(&self) -> Result<Vec<Array>> {
        self.physical_planes()
    }
}

impl AttentionCache for SerialCache {
    fn spec(&self) -> KvSpec {
        SerialCache::spec(self)
    }
    fn max_size(&self) -> Option<usize> {
        SerialCache::max_size(self)
    }
    fn decode(&mut self, k: &Array, v: &Array, q: &Array, scale: f32, masks: &Masks) -> Result<Array> {
        Ok(SerialCache::decode(self, k, v, q, scale, masks)?.0)
    }
    fn window(&mut self, k: &Array, v: &Array, q: &Array, scale: f32, masks: &Masks) -> Result<Array> {
        Ok(SerialCache::window(self, k, v, q, scale, masks)?.0)
    }
    fn commit_span(&mut self, k: &Array, v: &Array, q: &Array, scale: f32, masks: &Masks) -> Result<Array> {
        SerialCache::commit_span(self, k, v, q, scale, masks)
    }
    fn row_planes(&self, row: usize) -> Result<Vec<Array>> {
        if row != 0 {
            return Err(CacheError::NoSuchRow { row, rows: 1 });
        }
        self.physical_planes()
    }
}

impl Cache for RowBatch {
    fn storage_kind(&self) -> StorageKind {
        RowBatch::storage_kind(self)
    }
    fn rows(&self) -> usize {
        RowBatch::rows(self)
    }
    fn offsets(&self) -> Vec<usize> {
        self.row_states().iter().map(|r| r.ring.offset).collect()
    }
    fn bytes_per_token(&self) -> Option<usize> {
        Some(RowBatch::bytes_per_token(self))
    }
    fn is_trimmable(&self) -> bool {
        RowBatch::is_trimmable(self)
    }
    fn trim(&mut self, n: usize, bypass: bool) -> Result<usize> {
        RowBatch::trim(self, n, bypass)
    }
    fn decode_phase(&self) -> Option<Vec<DecodePhase>> {
        (0..RowBatch::rows(self)).map(|r| self.row_decode_phase(r).ok()).collect()
    }
    fn prepare_decode_step(&mut self) -> Result<Vec<usize>> {
        RowBatch::prepare_decode_step(self)
    }
    fn state(&self) -> Result<Vec<Array>> {
        (0..RowBatch::rows(self)).map(|r| self.row_physical_planes(r)).collect::<Result<Vec<_>>>().map(|v| v.concat())
    }
}

impl AttentionCache for RowBatch {
    fn spec(&self) -> KvSpec {
        RowBatch::spec(self)
    }
    fn max_size(&self) -> Option<usize> {
        RowBatch::max_size(self)
    }
    fn decode(&mut self, k: &Array, v: &Array, q: &Array, scale: f32, masks: &Masks) -> Result<Array> {
        Ok(RowBatch::decode(self, k, v, q, scale, masks)?.0)
    }
    fn window(&mut self, k: &Array, v: &Array, q: &Array, scale: f32, masks: &Masks) -> Result<Array> {
        Ok(RowBatch::window(self, k, v, q, scale, masks)?.0)
    }
    fn commit_span(&mut self, k: &Array, v: &Array, q: &Array, scale: f32, masks: &Masks) -> Result<Array> {
        RowBatch::commit_span(self, k, v, q, scale, masks)
    }
    fn row_planes(&self, row: usize) -> Result<Vec<Array>> {
        self.row_physical_planes(row)
    }
}

/// The rows' shared geometry: K/V spec, window and storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvGeometry {
    /// The K/V geometry.
    pub spec: KvSpec,
    /// The window (`None`: full attention).
    pub max_size: Option<usize>,
    /// Plain or affine planes.
    pub storage: Storage,
}

impl RowLayout for RowBatch {
    type Serial = SerialCache;
    type Geometry = KvGeometry;
    fn geometry(&self) -> KvGeometry {
        KvGeometry { spec: RowBatch::spec(self), max_size: RowBatch::max_size(self), storage: self.storage() }
    }
    fn merge(g: &KvGeometry, rows: Vec<SerialCache>) -> Result<Self> {
        let parts =
            rows.iter().map(|c| Ok((c.temporal_view_planes()?, SerialCache::offset(c)))).collect::<Result<Vec<_>>>()?;
        RowBatch::merge_planes(g.spec, g.max_size, g.storage, &parts)
    }
    fn join(g: &KvGeometry, rows: &[&SerialCache]) -> Result<Self> {
        let sources: Vec<JoinSource<'_>> = rows.iter().map(|c| JoinSource::Serial(c)).collect();
        RowBatch::join_storage(g.spec, g.max_size, g.storage, &sources)
    }
    fn extract(&self, row: usize) -> Result<SerialCache> {
        RowBatch::extract(self, row)
    }
    fn filter(&mut self, keep: &[usize]) -> Result<()> {
        RowBatch::filter(self, keep)
    }
    fn prepare(&mut self, lengths: &[usize]) -> Result<()> {
        RowBatch::prepare(self, lengths)
    }
    fn finalize(&mut self) -> Result<()> {
        RowBatch::finalize(self)
    }
    fn is_pending(&self) -> bool {
        RowBatch::is_pending(self)
    }
    type Parts = BatchParts;
    fn parts(&self) -> Result<BatchParts> {
        let planes = match self.buffer_planes() {
            Some(p) => p,
            None => {
                let (spec, rows) = (RowBatch::spec(self), RowBatch::rows(self));
                let zero = |(w, dt): (usize, mlx_rs::Dtype)| super::util::zeros(&[rows, spec.heads_kv, 0, w], dt);
                self.storage().plane_layout(&spec).into_iter().map(zero).collect::<Result<Vec<_>>>()?
            }
        };
        Ok(BatchParts { planes, rows: self.row_states().to_vec() })
    }
    fn adopt(g: &KvGeometry, parts: BatchParts) -> Result<Self> {
        RowBatch::adopt_planes(g.spec, g.max_size, g.storage, parts.planes, parts.rows)
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Wrappers: the chunked cache and the bf16-first legos and rows.

impl Cache for ChunkedKvCache {
    fn storage_kind(&self) -> StorageKind {
        ChunkedKvCache::storage_kind(self)
    }
    fn composed(&self) -> Option<Composed> {
        Some(Composed {
            wrapper: ChunkedKvCache::storage_kind(self),
            storage: vec![self.cache().storage_kind()],
            kernels: None,
        })
    }
    fn rows(&self) -> usize {
        1
    }
    fn offsets(&self) -> Vec<usize> {
        vec![ChunkedKvCache::offset(self)]
    }
    fn bytes_per_token(&self) -> Option<usize> {
        Some(self.cache().bytes_per_token())
    }
    fn is_trimmable(&self) -> bool {
        self.cache().is_trimmable()
    }
    fn trim(&mut self, n: usize, bypass: bool) -> Result<usize> {
        self.cache_mut().trim(n, bypass)
    }
    fn decode_phase(&self) -> Option<Vec<DecodePhase>> {
        Some(vec![self.cache().decode_phase()])
    }
    fn prepare_decode_step(&mut self) -> Result<Vec<usize>> {
        Ok(vec![self.cache_mut().prepare_decode_step()?.write_pos])
    }
    fn state(&self) -> Result<Vec<Array>> {
        self.cache().physical_planes()
    }
}

impl Cache for Bf16FirstCache {
    fn storage_kind(&self) -> StorageKind {
        self.lego_kind()
    }
    fn composed(&self) -> Option<Composed> {
        Some(Composed {
            wrapper: self.lego_kind(),
            storage: vec![Bf16FirstCache::storage_kind(self)],
            kernels: Some(self.kernel_set().name()),
        })
    }
    fn rows(&self) -> usize {
        1
    }
    fn offsets(&self) -> Vec<usize> {
        vec![Bf16FirstCache::offset(self)]
    }
    fn bytes_per_token(&self) -> Option<usize> {
        Some(Bf16FirstCache::bytes_per_token(self))
    }
    fn is_trimmable(&self) -> bool {
        Bf16FirstCache::is_trimmable(self)
    }
    fn trim(&mut self, n: usize, bypass: bool) -> Result<usize> {
        Bf16FirstCache::trim(self, n, bypass)
    }
    fn decode_phase(&self) -> Option<Vec<DecodePhase>> {
        Some(vec![Bf16FirstCache::decode_phase(self)])
    }
    fn prepare_decode_step(&mut self) -> Result<Vec<usize>> {
        Ok(vec![Bf16FirstCache::prepare_decode_step(self)?.write_pos])
    }
    fn max_committed(&self) -> Option<usize> {
        self.max_append_tokens()
    }
    fn minimum_reusable_offset(&self) -> usize {
        Bf16FirstCache::minimum_reusable_offset(self)
    }
    fn state(&self) -> Result<Vec<Array>> {
        self.inner().physical_planes()
    }
    fn rounds(&mut self) -> Option<&mut dyn SpecRounds> {
        Some(self)
    }
}

impl SpecRounds for Bf16FirstCache {
    fn in_round(&self) -> bool {
        Bf16FirstCache::in_round(self)
    }
    fn round_begin(&mut self) -> Result<()> {
        Bf16FirstCache::round_begin(self)
    }
    fn round_commit(&mut self) -> Result<()> {
        Bf16FirstCache::round_commit(self).map(|_| ())
    }
    fn round_rollback(&mut self, keep: &[usize]) -> Result<()> {
        match keep {
            [k] => Bf16FirstCache::round_rollback(self, *k).map(|_| ()),
            _ => Err(CacheError::BadLengths { what: format!("{} keeps for 1 row", keep.len()) }),
        }
    }
}

impl AttentionCache for Bf16FirstCache {
    fn spec(&self) -> KvSpec {
        self.inner().spec()
    }
    fn max_size(&self) -> Option<usize> {
        self.inner().max_size()
    }
    fn decode(&mut self, k: &Array, v: &Array, q: &Array, scale: f32, masks: &Masks) -> Result<Array> {
        Ok(Bf16FirstCache::decode(self, k, v, q, scale, masks)?.0)
    }
    fn window(&mut self, k: &Array, v: &Array, q: &Array, scale: f32, masks: &Masks) -> Result<Array> {
        Ok(Bf16FirstCache::window(self, k, v, q, scale, masks)?.0)
    }
    fn commit_span(&mut self, k: &Array, v: &Array, q: &Array, scale: f32, masks: &Masks) -> Result<Array> {
        Bf16FirstCache::commit_span(self, k, v, q, scale, masks)
    }
    fn row_planes(&self, row: usize) -> Result<Vec<Array>> {
        if row != 0 {
            return Err(CacheError::NoSuchRow { row, rows: 1 });
        }
        self.inner().physical_planes()
    }
}

impl Cache for TransitioningKvRows {
    fn storage_kind(&self) -> StorageKind {
        TransitioningKvRows::storage_kind(self)
    }
    fn composed(&self) -> Option<Composed> {
        let wrapper = self.transition().lego_kind(TransitioningKvRows::max_size(self));
        Some(Composed { wrapper, storage: self.row_storage_kinds(), kernels: Some(self.kernel_set().name()) })
    }
    fn rows(&self) -> usize {
        TransitioningKvRows::rows(self)
    }
    fn offsets(&self) -> Vec<usize> {
        TransitioningKvRows::offsets(self)
    }
    fn bytes_per_token(&self) -> Option<usize> {
        Some(TransitioningKvRows::bytes_per_token(self))
    }
    fn is_trimmable(&self) -> bool {
        TransitioningKvRows::is_trimmable(self)
    }
    fn trim(&mut self, n: usize, bypass: bool) -> Result<usize> {
        TransitioningKvRows::trim(self, n, bypass)
    }
    fn decode_phase(&self) -> Option<Vec<DecodePhase>> {
        Some(self.decode_phases())
    }
    fn prepare_decode_step(&mut self) -> Result<Vec<usize>> {
        TransitioningKvRows::prepare_decode_step(self)
    }
    fn max_committed(&self) -> Option<usize> {
        self.max_append_tokens()
    }
    fn minimum_reusable_offset(&self) -> usize {
        TransitioningKvRows::minimum_reusable_offset(self)
    }
    fn state(&self) -> Result<Vec<Array>> {
        (0..TransitioningKvRows::rows(self))
            .map(|r| self.row_physical_planes(r))
            .collect::<Result<Vec<_>>>()
            .map(|v| v.concat())
    }
    fn rounds(&mut self) -> Option<&mut dyn SpecRounds> {
        Some(self)
    }
}

impl SpecRounds for TransitioningKvRows {
    fn in_round(&self) -> bool {
        TransitioningKvRows::in_round(self)
    }
    fn round_begin(&mut self) -> Result<()> {
        TransitioningKvRows::round_begin(self)
    }
    fn round_commit(&mut self) -> Result<()> {
        TransitioningKvRows::round_commit(self).map(|_| ())
    }
    fn round_rollback(&mut self, keep: &[usize]) -> Result<()> {
        TransitioningKvRows::round_rollback(self, keep).map(|_| ())
    }
}

/// The bf16-first rows' shared geometry: K/V spec, window and transition.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LegoGeometry {
    /// The K/V geometry.
    pub spec: KvSpec,
    /// The window (`None`: full attention).
    pub max_size: Option<usize>,
    /// When and to what the rows convert.
    pub transition: Transition,
}

impl RowLayout for TransitioningKvRows {
    type Serial = Bf16FirstCache;
    type Geometry = LegoGeometry;
    fn geometry(&self) -> LegoGeometry {
        LegoGeometry {
            spec: TransitioningKvRows::spec(self),
            max_size: TransitioningKvRows::max_size(self),
            transition: self.transition(),
        }
    }
    fn merge(g: &LegoGeometry, rows: Vec<Bf16FirstCache>) -> Result<Self> {
        TransitioningKvRows::merge(g.spec, g.max_size, g.transition, rows)
    }
    fn join(g: &LegoGeometry, rows: &[&Bf16FirstCache]) -> Result<Self> {
        TransitioningKvRows::merge(g.spec, g.max_size, g.transition, rows.iter().map(|&l| l.clone()).collect())
    }
    fn extract(&self, row: usize) -> Result<Bf16FirstCache> {
        TransitioningKvRows::extract(self, row)
    }
    fn filter(&mut self, keep: &[usize]) -> Result<()> {
        TransitioningKvRows::filter(self, keep)
    }
    fn prepare(&mut self, lengths: &[usize]) -> Result<()> {
        TransitioningKvRows::prepare(self, lengths)
    }
    fn finalize(&mut self) -> Result<()> {
        TransitioningKvRows::finalize(self).map(|_| ())
    }
    fn is_pending(&self) -> bool {
        self.pending().is_some()
    }
    type Parts = RowsParts;
    fn parts(&self) -> Result<RowsParts> {
        TransitioningKvRows::parts(self)
    }
    fn adopt(g: &LegoGeometry, parts: RowsParts) -> Result<Self> {
        TransitioningKvRows::adopt(g.spec, g.max_size, g.transition, parts)
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The recurrent state.

impl Cache for SsmCache {
    fn storage_kind(&self) -> StorageKind {
        SsmCache::storage_kind(self)
    }
    fn rows(&self) -> usize {
        SsmCache::rows(self)
    }
    fn offsets(&self) -> Vec<usize> {
        SsmCache::offsets(self).to_vec()
    }
    fn bytes_per_token(&self) -> Option<usize> {
        Some(SsmCache::bytes_per_token(self))
    }
    fn is_trimmable(&self) -> bool {
        SsmCache::is_trimmable(self)
    }
    fn trim(&mut self, n: usize, _bypass: bool) -> Result<usize> {
        SsmCache::trim(self, n)
    }
    fn decode_phase(&self) -> Option<Vec<DecodePhase>> {
        None
    }
    fn prepare_decode_step(&mut self) -> Result<Vec<usize>> {
        Err(unsupported(SsmCache::storage_kind(self), "prepare_decode_step"))
    }
    fn state(&self) -> Result<Vec<Array>> {
        Ok(vec![self.conv().clone(), self.recurrent().clone()])
    }
    fn rounds(&mut self) -> Option<&mut dyn SpecRounds> {
        Some(self)
    }
}

impl SpecRounds for SsmCache {
    fn in_round(&self) -> bool {
        SsmCache::in_round(self)
    }
    fn round_begin(&mut self) -> Result<()> {
        self.spec_round_begin()
    }
    fn round_commit(&mut self) -> Result<()> {
        self.spec_round_commit()
    }
    fn round_rollback(&mut self, keep: &[usize]) -> Result<()> {
        self.spec_round_rollback_rows(keep)
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Paged storage: the running batch of a store (its rows share the store's pool and prefix index).

impl Cache for PagedStore {
    fn storage_kind(&self) -> StorageKind {
        self.rows_storage_kind()
    }
    fn rows(&self) -> usize {
        PagedStore::rows(self).len()
    }
    fn offsets(&self) -> Vec<usize> {
        PagedStore::rows(self).iter().map(|&s| self.seq(s).map_or(0, |q| q.offset)).collect()
    }
    fn bytes_per_token(&self) -> Option<usize> {
        Some(PagedStore::bytes_per_token(self))
    }
    fn is_trimmable(&self) -> bool {
        true
    }
    /// `n` positions from every row ([`PagedStore::rows_trim`]).
    fn trim(&mut self, n: usize, bypass: bool) -> Result<usize> {
        let all = vec![n; PagedStore::rows(self).len()];
        self.rows_trim(&all, bypass).map(|_| n)
    }
    fn decode_phase(&self) -> Option<Vec<DecodePhase>> {
        None
    }
    /// Refused: a paged row's next column is chosen when the write allocates (free list, growth or eviction).
    fn prepare_decode_step(&mut self) -> Result<Vec<usize>> {
        Err(unsupported(self.rows_storage_kind(), "prepare_decode_step"))
    }
    /// The pool's planes (none before the first write).
    fn state(&self) -> Result<Vec<Array>> {
        Ok(self.pool_planes().map(|p| p.to_vec()).unwrap_or_default())
    }
    fn rounds(&mut self) -> Option<&mut dyn SpecRounds> {
        Some(self)
    }
}

impl SpecRounds for PagedStore {
    fn in_round(&self) -> bool {
        PagedStore::in_round(self)
    }
    fn round_begin(&mut self) -> Result<()> {
        PagedStore::round_begin(self)
    }
    fn round_commit(&mut self) -> Result<()> {
        PagedStore::round_commit(self)
    }
    fn round_rollback(&mut self, keep: &[usize]) -> Result<()> {
        PagedStore::round_rollback(self, keep)
    }
}

impl RowLayout for SsmCache {
    type Serial = SsmCache;
    type Geometry = SsmSpec;
    fn geometry(&self) -> SsmSpec {
        self.spec()
    }
    fn merge(g: &SsmSpec, rows: Vec<SsmCache>) -> Result<Self> {
        SsmCache::merge(*g, &rows.iter().collect::<Vec<_>>())
    }
    fn join(g: &SsmSpec, rows: &[&SsmCache]) -> Result<Self> {
        SsmCache::merge(*g, rows)
    }
    fn extract(&self, row: usize) -> Result<SsmCache> {
        SsmCache::extract(self, row)
    }
    fn filter(&mut self, keep: &[usize]) -> Result<()> {
        SsmCache::filter(self, keep)
    }
    /// A right-padded prefill: no left padding (every row's real positions start its block).
    fn prepare(&mut self, lengths: &[usize]) -> Result<()> {
        SsmCache::prepare(self, lengths, &vec![0; lengths.len()])
    }
    fn finalize(&mut self) -> Result<()> {
        SsmCache::finalize(self)
    }
    fn is_pending(&self) -> bool {
        SsmCache::is_pending(self)
    }
    type Parts = SsmParts;
    /// Refused while a prefill is pending or a round is armed (their inputs and padding are not parts).
    fn parts(&self) -> Result<SsmParts> {
        if SsmCache::is_pending(self) || self.in_round() {
            return Err(CacheError::Lifecycle { what: "parts of a recurrent cache mid-prefill or mid-round".into() });
        }
        Ok(SsmParts {
            conv: self.conv().clone(),
            recurrent: self.recurrent().clone(),
            offsets: self.offsets().to_vec(),
        })
    }
    fn adopt(g: &SsmSpec, parts: SsmParts) -> Result<Self> {
        SsmCache::from_states(*g, parts.conv, parts.recurrent, parts.offsets)
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The stateless training caches (R-TRN-1): offset 0, nothing stored, never trimmed.

macro_rules! stateless {
    ($t:ty, $rows:expr) => {
        impl Cache for $t {
            fn storage_kind(&self) -> StorageKind {
                <$t>::storage_kind(self)
            }
            fn rows(&self) -> usize {
                #[allow(clippy::redundant_closure_call)]
                ($rows)(self)
            }
            fn offsets(&self) -> Vec<usize> {
                vec![0; Cache::rows(self)]
            }
            fn bytes_per_token(&self) -> Option<usize> {
                None
            }
            fn is_trimmable(&self) -> bool {
                false
            }
            fn trim(&mut self, _n: usize, _bypass: bool) -> Result<usize> {
                Err(unsupported(<$t>::storage_kind(self), "trim"))
            }
            fn decode_phase(&self) -> Option<Vec<DecodePhase>> {
                None
            }
            fn prepare_decode_step(&mut self) -> Result<Vec<usize>> {
                Err(unsupported(<$t>::storage_kind(self), "prepare_decode_step"))
            }
            fn state(&self) -> Result<Vec<Array>> {
                Ok(Vec::new())
            }
        }
    };
}

stateless!(TrainingCache, |c: &TrainingCache| c.row_lengths().map_or(1, <[usize]>::len));
stateless!(PrefixSharedCache, |_: &PrefixSharedCache| 1);
stateless!(TrainingSsmCache, |c: &TrainingSsmCache| c.row_lengths().map_or(1, <[usize]>::len));

#[cfg(test)]
mod tests;
