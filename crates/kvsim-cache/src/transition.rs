//! bf16-first layouts: serial legos that store bf16 until their offset reaches `start`, then affine
//! storage ([`Bf16FirstQuantizedKvCache`], [`Bf16FirstRotatingQuantizedKvCache`] build a [`Bf16FirstCache`]), and
//! their rows under continuous batching ([`TransitioningKvRows`], `kv:delayed-quant:<bits>:<group>:<start>` and
//! `kv:delayed-rotating-quant:<W>:<bits>:<group>:<start>`). The rules and their upstream sources are in
//! `docs/transitioning-rows.md`.
//!
//! # What is guaranteed
//! - **When a cache converts**: a lego converts at the end of the append whose offset makes the transition due
//!   (`offset >= start && offset != 0`), after that append was read in bf16; never inside an armed speculative round
//!   (its commit or rollback settles on the committed offset). Rows convert only at boundaries: the end of an append
//!   outside a prefill and outside a round, a round's commit or rollback, or [`TransitioningKvRows::commit_prefill`]
//!   of that row. Conversion is irreversible and keeps every physical column and the ring phase
//!   ([`SerialCache::to_quantized`]: quantization is per position, so the converted bytes equal those of a quantized
//!   cache fed the same blocks).
//! - **Rows equal their legos**: each unpacked row *is* a serial cache driven by the serial rules, so its stored
//!   planes, physical order and reads are byte-identical to a lego fed the same blocks with the same boundaries. Once
//!   every row has converted the rows pack into one quantized [`RowBatch`] by `join` (every row keeps its physical
//!   columns and phase, one way); its decode outputs of unpadded rows are byte-identical to the serial reads on CPU
//!   (a property of MLX's CPU kernels, measured in the tests), other packed reads are measured.
//! - **Typed errors, nothing changed**: a plain read while mixed ([`CacheError::MixedPrecision`]), prefix reuse below
//!   the floor ([`CacheError::BelowFloor`]), a rollback keeping more than the round wrote
//!   ([`CacheError::KeepTooLong`]), round and prefill misuse ([`CacheError::Lifecycle`]).
//! - Alignment is bookkeeping here: kvsim's rows keep their own physical columns (ARCHITECTURE.md "Rows"), so the
//!   upstream left padding is kept as `left_pads()` (the aligned geometry of the dense fetch), and a rollback's
//!   "roll right by the rejected count into the padding" is the row's bypass trim plus `left_pad += shift`: the kept
//!   columns are never moved, dequantized or requantized.

use mlx_rs::Array;

use super::batch::{JoinSource, RowBatch};
use super::error::CacheError;
use super::kind::{DelayedKind, StorageKind};
use super::mask::{MaskUse, Masks};
use super::quant::{QuantSpec, Storage};
use super::ring::SerialCache;
use super::util::{check_kv, check_q, cols, rows as row_slice, zeros};
use super::ReadMode;
use super::{KvSpec, Result};

/// When and to what a bf16-first cache converts: `start` (`None`: never, R-TKV-2) and the affine format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Transition {
    /// The precision boundary: the transition is due once `offset >= start` (and `offset != 0`); `None`: never.
    pub start: Option<usize>,
    /// The affine format the storage converts to.
    pub quant: QuantSpec,
}

impl Transition {
    /// Upstream `transitionDue`: `offset >= start && offset != 0`.
    pub fn due(&self, offset: usize) -> bool {
        matches!(self.start, Some(s) if offset >= s && offset != 0)
    }

    /// The floor a conversion at `offset` leaves (`start` 0: none).
    pub fn floor_at(&self, offset: usize) -> usize {
        if self.start == Some(0) {
            0
        } else {
            offset
        }
    }

    /// The rows layout's storage kind (upstream parameter order; an infinite start is `inf`).
    pub fn rows_kind(&self, max_size: Option<usize>) -> StorageKind {
        DelayedKind { max_size, quant: self.quant, start: self.start }.kind()
    }

    /// The serial lego's kind (`kv:bf16-first-quant:..`, `kv:bf16-first-rotating-quant:..`; parsed strictly by
    /// `kind::parse_bf16_first`).
    pub fn lego_kind(&self, max_size: Option<usize>) -> StorageKind {
        DelayedKind { max_size, quant: self.quant, start: self.start }.lego_kind()
    }
}

/// The kernel set a bf16-first layout attends with (R-TKV-3), taken when the layout is built and named by its
/// composition ([`KernelSet::name`]): the affine format its converted rings and packed rows read (`quant`, the
/// transition's) and the read mode of every read ([`ReadMode`]: MLX's fused SDPA, or kvsim's batch-invariant
/// kernels on a GPU). A lego takes it when it is created or restored, rows when they are merged (from their legos);
/// rows a cohort extracts carry it into the layouts they join, and legos carrying different sets are not merged
/// ([`CacheError::KernelSetMismatch`]). Reads run under it whatever the thread's mode is later
/// ([`super::set_read_mode`] changes what new layouts take).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct KernelSet {
    /// The affine format of the converted storage.
    pub quant: QuantSpec,
    /// How every read of the layout attends.
    pub mode: ReadMode,
}

impl KernelSet {
    /// The set a layout of this format takes now: the calling thread's read mode ([`super::read_mode`]).
    pub fn taken_now(quant: QuantSpec) -> KernelSet {
        KernelSet { quant, mode: super::read_mode() }
    }

    /// The set's name: `affine:<bits>:<group>:fused` or `affine:<bits>:<group>:exact`.
    pub fn name(&self) -> String {
        let mode = match self.mode {
            ReadMode::Fused => "fused",
            ReadMode::Exact => "exact",
        };
        format!("affine:{}:{}:{mode}", self.quant.bits, self.quant.group)
    }

    /// This set's read mode on the calling thread until the guard drops.
    fn enter(&self) -> super::exact::ModeGuard {
        super::exact::ModeGuard::enter(self.mode)
    }
}

/// A serial bf16-first cache (the lego): a [`SerialCache`] in bf16 (the spec's dtype) that converts to affine storage
/// at its transition, with its floor and its armed round.
#[derive(Debug, Clone)]
pub struct Bf16FirstCache {
    cache: SerialCache,
    transition: Transition,
    kernels: KernelSet,
    converted_at: Option<usize>,
    floor: usize,
    round: Option<usize>,
}

/// Constructor of the full-attention lego (upstream `Bf16FirstQuantizedKVCache`).
#[derive(Debug, Clone, Copy)]
pub struct Bf16FirstQuantizedKvCache;

impl Bf16FirstQuantizedKvCache {
    /// An empty lego; invalid quantization parameters are [`CacheError::InvalidQuant`].
    #[allow(clippy::new_ret_no_self)]
    pub fn new(spec: KvSpec, transition: Transition) -> Result<Bf16FirstCache> {
        Bf16FirstCache::new(spec, None, transition)
    }
}

/// Constructor of the rotating lego (upstream `Bf16FirstRotatingQuantizedKVCache`, keep = 0).
#[derive(Debug, Clone, Copy)]
pub struct Bf16FirstRotatingQuantizedKvCache;

impl Bf16FirstRotatingQuantizedKvCache {
    /// An empty ring of window `max_size`.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(spec: KvSpec, max_size: usize, transition: Transition) -> Result<Bf16FirstCache> {
        Bf16FirstCache::new(spec, Some(max_size), transition)
    }
}

impl Bf16FirstCache {
    /// An empty lego (`max_size` `None`: full attention).
    pub fn new(spec: KvSpec, max_size: Option<usize>, transition: Transition) -> Result<Self> {
        Storage::Affine(transition.quant).validate(&spec)?;
        let cache = SerialCache::new(spec, max_size)?;
        let kernels = KernelSet::taken_now(transition.quant);
        Ok(Bf16FirstCache { cache, transition, kernels, converted_at: None, floor: 0, round: None })
    }

    /// A lego composed again over storage handed back to serial use (R-TKV-5), with its conversion, floor and the
    /// kernel set of the layout it leaves.
    fn compose(
        cache: SerialCache,
        transition: Transition,
        kernels: KernelSet,
        converted_at: Option<usize>,
        floor: usize,
    ) -> Self {
        Bf16FirstCache { cache, transition, kernels, converted_at, floor, round: None }
    }

    /// A lego restored from its parts (persistence: `persist::codec`'s bf16-first codec), at rest (no armed round).
    /// The parts must be a state the lifecycle can reach, else [`CacheError::InvalidState`] and no cache:
    /// - converted at `c`: the transition is due at `c` and the storage is affine in the transition's format, and the
    ///   floor is the one that conversion left (`Transition::floor_at(c)`; a later trim keeps both, so `c` may lie
    ///   above the offset);
    /// - not converted: plain storage, the transition not due at the offset (it would have converted at the end of
    ///   that append), and floor 0.
    ///
    /// The window and spec are the storage's own.
    pub fn restore(
        cache: SerialCache,
        transition: Transition,
        converted_at: Option<usize>,
        floor: usize,
    ) -> Result<Self> {
        Storage::Affine(transition.quant).validate(&cache.spec())?;
        let bad = |what: String| Err(CacheError::InvalidState { what });
        match converted_at {
            Some(c) => {
                if !transition.due(c) {
                    return bad(format!("converted at {c}, before its transition ({:?}) was due", transition.start));
                }
                if cache.storage() != Storage::Affine(transition.quant) {
                    return bad(format!("converted at {c} but holding {} storage", cache.storage_kind()));
                }
                if floor != transition.floor_at(c) {
                    return bad(format!("floor {floor}, a conversion at {c} leaves {}", transition.floor_at(c)));
                }
            }
            None => {
                if cache.storage() != Storage::Plain {
                    return bad(format!("not converted but holding {} storage", cache.storage_kind()));
                }
                if transition.due(cache.offset()) {
                    return bad(format!("offset {} past its transition but not converted", cache.offset()));
                }
                if floor != 0 {
                    return bad(format!("floor {floor} before any conversion"));
                }
            }
        }
        Ok(Self::compose(cache, transition, KernelSet::taken_now(transition.quant), converted_at, floor))
    }

    /// Whether a speculative round is armed (neither committed nor rolled back yet).
    pub fn in_round(&self) -> bool {
        self.round.is_some()
    }

    /// The storage this lego holds now (plain, or affine after the transition).
    pub fn inner(&self) -> &SerialCache {
        &self.cache
    }

    /// The transition parameters.
    pub fn transition(&self) -> Transition {
        self.transition
    }

    /// The offset at which the storage converted (`None`: still bf16).
    pub fn converted_at(&self) -> Option<usize> {
        self.converted_at
    }

    /// Positions ever written.
    pub fn offset(&self) -> usize {
        self.cache.offset()
    }

    /// The current storage's kind (`kv-plain`/`rotating-plain`, then `kv:quant:..`/`kv:rotating-quant:..`).
    pub fn storage_kind(&self) -> StorageKind {
        self.cache.storage_kind()
    }

    /// The layout's own kind, whichever storage it holds now: `kv:bf16-first-quant:<bits>:<group>:<start>` or
    /// `kv:bf16-first-rotating-quant:<W>:<bits>:<group>:<start>`.
    pub fn lego_kind(&self) -> StorageKind {
        self.transition.lego_kind(self.cache.max_size())
    }

    /// `minimum_reusable_offset`: prefix reuse never trims below it (kept by trims: conversion is irreversible).
    pub fn minimum_reusable_offset(&self) -> usize {
        self.floor
    }

    /// `max_append_tokens`: positions before the precision changes (`None`: unbounded).
    pub fn max_append_tokens(&self) -> Option<usize> {
        match (self.transition.start, self.converted_at) {
            (Some(s), None) if self.offset() < s => Some(s - self.offset()),
            _ => None,
        }
    }

    /// Converts if due (outside a round). Returns whether it converted.
    fn settle(&mut self) -> Result<bool> {
        if self.round.is_some() || self.converted_at.is_some() || !self.transition.due(self.offset()) {
            return Ok(false);
        }
        self.cache.to_quantized(self.transition.quant)?;
        self.converted_at = Some(self.offset());
        self.floor = self.floor.max(self.transition.floor_at(self.offset()));
        Ok(true)
    }

    /// The kernel set this lego attends with (taken when it was created or restored, or carried from the rows it
    /// was extracted from).
    pub fn kernel_set(&self) -> KernelSet {
        self.kernels
    }

    /// One decode step (the serial core's), read in the current precision under the lego's kernel set; then
    /// converts if due.
    pub fn decode(&mut self, k: &Array, v: &Array, q: &Array, scale: f32, masks: &Masks) -> Result<(Array, MaskUse)> {
        let out = {
            let _mode = self.kernels.enter();
            self.cache.decode(k, v, q, scale, masks)?
        };
        self.settle()?;
        Ok(out)
    }

    /// A window read (the serial core's), read in the current precision under the lego's kernel set; then converts
    /// if due.
    pub fn window(&mut self, k: &Array, v: &Array, q: &Array, scale: f32, masks: &Masks) -> Result<(Array, MaskUse)> {
        let out = {
            let _mode = self.kernels.enter();
            self.cache.window(k, v, q, scale, masks)?
        };
        self.settle()?;
        Ok(out)
    }

    /// A committed span (R-ROT-7): `L` decodes, one per position (each keeps the single-position
    /// reduction order), outputs concatenated along the token axis. Each decode is an ordinary append: the one that
    /// reaches `start` is read in bf16 and the storage converts right after it, so the later positions of the same
    /// span read affine (outside an armed round). Byte-identical, state and outputs, to `L` calls of
    /// [`Bf16FirstCache::decode`]. Bad shapes are typed errors with nothing changed.
    pub fn commit_span(&mut self, k: &Array, v: &Array, q: &Array, scale: f32, masks: &Masks) -> Result<Array> {
        let spec = self.cache.spec();
        let l = check_kv(&spec, k, v, 1, 1)?;
        check_q(&spec, q, 1, l)?;
        let mut next = self.clone();
        let mut outs = Vec::with_capacity(l);
        for i in 0..l {
            outs.push(next.decode(&cols(k, i, i + 1)?, &cols(v, i, i + 1)?, &cols(q, i, i + 1)?, scale, masks)?.0);
        }
        let out = mlx_rs::ops::concatenate(&outs, 2)?;
        *self = next;
        Ok(out)
    }

    /// The dense fetch: the stored live columns in physical order, dequantized once converted.
    pub fn dense(&self) -> Result<(Array, Array)> {
        self.cache.storage().dense(&self.cache.physical_planes()?)
    }

    /// The softcapped read's fetch (R-TKV-4): appends the `L >= 1` positions (the window write), then answers as
    /// [`Bf16FirstCache::dense`] (the caller owns both and attends them itself); then converts if due, as after a
    /// read. Returns `(k, v)` and whether it converted. Bad shapes change nothing.
    pub fn fetch(&mut self, k: &Array, v: &Array) -> Result<((Array, Array), bool)> {
        let mut next = self.clone();
        next.cache.append(k, v)?;
        let kv = next.dense()?;
        let converted = next.settle()?;
        *self = next;
        Ok((kv, converted))
    }

    /// R-C-5 trim; precision and floor are kept (a trim below `start` keeps quantized storage).
    pub fn trim(&mut self, n: usize, bypass: bool) -> Result<usize> {
        self.cache.trim(n, bypass)
    }

    /// R-C-5: the storage's answer (a ring stops being trimmable once it wraps).
    pub fn is_trimmable(&self) -> bool {
        self.cache.is_trimmable()
    }

    /// R-C-4: what one more token costs in the storage held now (bf16 planes, then the affine planes after the
    /// transition): [`Storage::bytes_per_token`].
    pub fn bytes_per_token(&self) -> usize {
        self.cache.bytes_per_token()
    }

    /// R-ROT-5 / R-TKV-6: the fetch of the coming decode step (the storage's ring rule), without moving anything.
    pub fn decode_phase(&self) -> super::ring::DecodePhase {
        self.cache.decode_phase()
    }

    /// R-C-9: the host bookkeeping of the coming one-position step (growth, oversize drop, rotation) on the held
    /// storage, without the write; the plan's `write_pos` is where the position lands.
    pub fn prepare_decode_step(&mut self) -> Result<super::ring::DecodePlan> {
        self.cache.prepare_decode_step()
    }

    /// Arms a speculative round: conversion waits for its commit or rollback.
    pub fn round_begin(&mut self) -> Result<()> {
        if self.round.is_some() {
            return Err(out_of_order("a round is already armed"));
        }
        self.round = Some(self.offset());
        Ok(())
    }

    /// Ends the round keeping every position; converts if due. Returns whether it converted.
    pub fn round_commit(&mut self) -> Result<bool> {
        if self.round.take().is_none() {
            return Err(out_of_order("commit without an armed round"));
        }
        self.settle()
    }

    /// Ends the round keeping `keep` of the positions it wrote (a bypass trim of the rest, no bytes move); converts
    /// if due on the committed offset. Errors change nothing.
    pub fn round_rollback(&mut self, keep: usize) -> Result<bool> {
        let before = self.round.ok_or_else(|| out_of_order("rollback without an armed round"))?;
        let written = self.offset().saturating_sub(before);
        if keep > written {
            return Err(CacheError::KeepTooLong { row: 0, keep, written });
        }
        if written > keep {
            self.cache.trim(written - keep, true)?;
        }
        self.round = None;
        self.settle()
    }

    /// Prefix reuse (`take`): a copy trimmed to the usable prefix `p = min(common, prompt_len - 1)`, keeping its
    /// precision and floor. `p < minimum_reusable_offset` is [`CacheError::BelowFloor`]; a needed trim of a
    /// wrapped ring is [`CacheError::NotTrimmable`]. `self` is never changed.
    pub fn take(&self, common: usize, prompt_len: usize) -> Result<Bf16FirstCache> {
        let p = common.min(prompt_len.saturating_sub(1)).min(self.offset());
        // Mutation hook `Mutant::TkvReuseBelowFloor`: the floor check skipped.
        if p < self.floor && !fault!(TkvReuseBelowFloor) {
            return Err(CacheError::BelowFloor { prefix: p, floor: self.floor });
        }
        let mut out = self.clone();
        out.round = None;
        let n = out.offset() - p;
        if n > 0 {
            out.cache.trim(n, false)?;
        }
        Ok(out)
    }
}

fn out_of_order(what: &str) -> CacheError {
    CacheError::Lifecycle { what: what.to_string() }
}

/// The plan of one compiled decode step of the bf16-first rows (R-TKV-6, R-C-9): while the rows are serial rings
/// each row fetches by its own ring in its own precision (`Rows`: one serial plan per row); once packed, the batch's
/// plan (`Packed`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RowsStep {
    /// One plan per row, each of the row's serial storage.
    Rows(Vec<super::ring::DecodePlan>),
    /// The packed batch's plan.
    Packed(super::compiled::RowsStepPlan),
}

/// One closure slot of a bf16-first rows step: the storage its step runs on and its inputs, in order. A `Rows` plan
/// has one slot per row (run with [`super::compiled::decode_step`] of `fetch`, the row's `[q, k, v]` and RoPE
/// offset appended); a `Packed` plan one slot (run with [`super::compiled::rows_decode_step`] under `mask`).
#[derive(Debug, Clone)]
pub struct StepSlot {
    /// The slot's storage: bf16 planes, or affine once its row converted.
    pub storage: Storage,
    /// The serial slot's fetch (`None` for the packed slot).
    pub fetch: Option<super::ring::DecodePhase>,
    /// The packed slot's mask use (`MaskUse::None` for serial slots: a lone ring reads unmasked).
    pub mask: MaskUse,
    /// The slot's inputs, in order.
    pub inputs: Vec<Array>,
    /// The RoPE offset(s) of the slot as int32 (`[1]` per serial row, `[B]` for the packed slot).
    pub rope: Array,
}

/// Per-row lifecycle bookkeeping of [`TransitioningKvRows`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RowLifecycle {
    /// The offset at which the row converted to affine storage (`None`: still bf16).
    pub converted_at: Option<usize>,
    /// The row's `minimum_reusable_offset`: prefix reuse never trims below it; kept by trims and extract.
    pub floor: usize,
    /// The row's left padding in the aligned geometry (bookkeeping only, no column stored): set by merge, grown by
    /// a rotating rollback's shift, its shared part dropped by filter.
    pub left_pad: usize,
}

#[derive(Debug, Clone)]
enum Store {
    /// One serial cache per row (plain or converted).
    Rows(Vec<SerialCache>),
    /// Every row converted: one quantized row batch (rows keep their physical columns and phase).
    Packed(RowBatch),
}

/// What bf16-first rows are made of ([`TransitioningKvRows::parts`], [`TransitioningKvRows::adopt`]), owned by the
/// holder: each row's bare storage as laid out, its lifecycle, and the kernel set the rows attend with.
#[derive(Debug, Clone)]
pub struct RowsParts {
    /// Row `r`'s storage: its ring as laid out (physical columns and phase), plain or converted.
    pub rows: Vec<SerialCache>,
    /// Row `r`'s conversion, floor and left padding.
    pub lifecycle: Vec<RowLifecycle>,
    /// The kernel set.
    pub kernels: KernelSet,
}

/// Rows of bf16-first legos under continuous batching (module docs).
#[derive(Debug, Clone)]
pub struct TransitioningKvRows {
    spec: KvSpec,
    max_size: Option<usize>,
    transition: Transition,
    kernels: KernelSet,
    store: Store,
    meta: Vec<RowLifecycle>,
    prefilling: bool,
    round: Option<Vec<usize>>,
    /// A right-padded prefill ([`TransitioningKvRows::prepare`]): each row's positions still to arrive.
    pending: Option<Vec<usize>>,
}

impl TransitioningKvRows {
    /// Merges legos (consumed) into rows: one row keeps its physical columns and phase; several are each rewritten
    /// in temporal order (their newest `min(offset, W)` positions; a layout event) behind left padding to
    /// `width = max min(offset_i, W)`. Rows keep precision and floor; they pack if every row has converted. Legos of
    /// another window or format are [`CacheError::WindowMismatch`] / [`CacheError::StorageMismatch`], legos carrying
    /// different kernel sets [`CacheError::KernelSetMismatch`]; an armed round is [`CacheError::Lifecycle`]. The rows
    /// attend with their legos' kernel set (no legos: the one [`KernelSet::taken_now`]).
    pub fn merge(
        spec: KvSpec,
        max_size: Option<usize>,
        transition: Transition,
        legos: Vec<Bf16FirstCache>,
    ) -> Result<Self> {
        Storage::Affine(transition.quant).validate(&spec)?;
        for l in &legos {
            if l.cache.max_size() != max_size {
                return Err(CacheError::WindowMismatch { expected: max_size, found: l.cache.max_size() });
            }
            if l.transition != transition || l.cache.spec() != spec {
                return Err(CacheError::StorageMismatch {
                    expected: transition.rows_kind(max_size).0,
                    found: l.transition.rows_kind(l.cache.max_size()).0,
                });
            }
            if l.round.is_some() {
                return Err(out_of_order("merge of a lego with an armed round"));
            }
        }
        let kernels = legos.first().map_or_else(|| KernelSet::taken_now(transition.quant), |l| l.kernels);
        if let Some(l) = legos.iter().find(|l| l.kernels != kernels) {
            return Err(CacheError::KernelSetMismatch { expected: kernels.name(), found: l.kernels.name() });
        }
        let w = max_size.unwrap_or(usize::MAX);
        let width = legos.iter().map(|l| l.offset().min(w)).max().unwrap_or(0);
        let several = legos.len() > 1;
        let mut caches = Vec::with_capacity(legos.len());
        let mut meta = Vec::with_capacity(legos.len());
        for l in legos {
            let left_pad = if several { width - l.offset().min(w) } else { 0 };
            let cache = if several {
                SerialCache::from_temporal_planes(
                    spec,
                    max_size,
                    l.cache.storage(),
                    &l.cache.temporal_view_planes()?,
                    l.offset(),
                )?
            } else {
                l.cache
            };
            meta.push(RowLifecycle { converted_at: l.converted_at, floor: l.floor, left_pad });
            caches.push(cache);
        }
        let mut rows = TransitioningKvRows {
            spec,
            max_size,
            transition,
            kernels,
            store: Store::Rows(caches),
            meta,
            prefilling: false,
            round: None,
            pending: None,
        };
        rows.maybe_pack()?;
        Ok(rows)
    }

    /// The storage kind (`kv:delayed-quant:..` / `kv:delayed-rotating-quant:..`).
    pub fn storage_kind(&self) -> StorageKind {
        self.transition.rows_kind(self.max_size)
    }

    /// The K/V geometry of every row.
    pub fn spec(&self) -> KvSpec {
        self.spec
    }

    /// The rows' window (`None`: full attention).
    pub fn max_size(&self) -> Option<usize> {
        self.max_size
    }

    /// The kernel set the rows attend with ([`KernelSet`]: their legos', carried into every lego extracted).
    pub fn kernel_set(&self) -> KernelSet {
        self.kernels
    }

    /// When and to what the rows convert.
    pub fn transition(&self) -> Transition {
        self.transition
    }

    /// Whether a speculative round is armed.
    pub fn in_round(&self) -> bool {
        self.round.is_some()
    }

    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.meta.len()
    }

    /// Per-row lifecycle (conversion offset, floor, left padding of the aligned geometry).
    pub fn lifecycle(&self) -> &[RowLifecycle] {
        &self.meta
    }

    /// Whether the rows have packed into one quantized batch.
    pub fn is_packed(&self) -> bool {
        matches!(self.store, Store::Packed(_))
    }

    /// The packed batch, once the rows have packed ([`TransitioningKvRows::is_packed`]): the memory it holds is the
    /// batch's, under [`RowBatch`]'s capacity bound and byte accounting ("Capacity").
    pub fn packed_batch(&self) -> Option<&RowBatch> {
        match &self.store {
            Store::Packed(b) => Some(b),
            _ => None,
        }
    }

    /// Per-row offsets.
    pub fn offsets(&self) -> Vec<usize> {
        match &self.store {
            Store::Rows(c) => c.iter().map(SerialCache::offset).collect(),
            Store::Packed(b) => b.row_states().iter().map(|s| s.ring.offset).collect(),
        }
    }

    /// `max_append_tokens`: the smallest distance from an unconverted row to its boundary (`None`: unbounded).
    pub fn max_append_tokens(&self) -> Option<usize> {
        let start = self.transition.start?;
        if self.is_packed() {
            return None;
        }
        self.offsets()
            .iter()
            .zip(&self.meta)
            .filter(|(&o, m)| m.converted_at.is_none() && o < start)
            .map(|(&o, _)| start - o)
            .min()
    }

    /// `minimum_reusable_offset`: the largest floor of any row.
    pub fn minimum_reusable_offset(&self) -> usize {
        self.meta.iter().map(|m| m.floor).max().unwrap_or(0)
    }

    fn maybe_pack(&mut self) -> Result<bool> {
        let Store::Rows(caches) = &self.store else { return Ok(false) };
        // Mutation hook `Mutant::TkvPackBeforeAllConverted`: pack once any row has converted.
        let unconverted = if fault!(TkvPackBeforeAllConverted) {
            self.meta.iter().all(|m| m.converted_at.is_none())
        } else {
            self.meta.iter().any(|m| m.converted_at.is_none())
        };
        if caches.is_empty() || unconverted {
            return Ok(false);
        }
        let mut batch = {
            let sources: Vec<JoinSource<'_>> = caches.iter().map(JoinSource::Serial).collect();
            RowBatch::join_storage(self.spec, self.max_size, Storage::Affine(self.transition.quant), &sources)?
        };
        if let Some(p) = &self.pending {
            // Packed inside a prepared prefill (every row committed a boundary): the rest still arrives padded.
            batch.prepare(p)?;
        }
        self.store = Store::Packed(batch);
        Ok(true)
    }

    /// Settles these rows (converts those due), then packs if every row has converted. Returns the rows converted.
    fn settle(&mut self, which: &[usize]) -> Result<Vec<usize>> {
        let mut converted = Vec::new();
        if let Store::Rows(caches) = &mut self.store {
            for &i in which {
                let (c, m) = (&mut caches[i], &mut self.meta[i]);
                if m.converted_at.is_none() && self.transition.due(c.offset()) {
                    c.to_quantized(self.transition.quant)?;
                    m.converted_at = Some(c.offset());
                    m.floor = m.floor.max(self.transition.floor_at(c.offset()));
                    converted.push(i);
                }
            }
        }
        self.maybe_pack()?;
        Ok(converted)
    }

    fn settle_all(&mut self) -> Result<Vec<usize>> {
        // Mutation hooks `Mutant::TkvConvertUncommitted` (settles inside a round) and
        // `Mutant::TkvSplitMovesBoundary` (settles after every append of a prefill cohort).
        let round = self.round.is_some() && !fault!(TkvConvertUncommitted);
        let prefilling = self.prefilling && !fault!(TkvSplitMovesBoundary);
        if prefilling || round {
            return Ok(Vec::new());
        }
        let all: Vec<usize> = (0..self.rows()).collect();
        self.settle(&all)
    }

    /// A read under the rows' kernel set.
    fn read(
        &mut self,
        k: &Array,
        v: &Array,
        q: &Array,
        scale: f32,
        masks: &Masks,
        decode: bool,
    ) -> Result<(Array, Vec<usize>)> {
        let _mode = self.kernels.enter();
        if self.pending.is_some() {
            if decode {
                return Err(CacheError::PendingPrefill);
            }
            return self.prepared_window(k, v, q, scale, masks);
        }
        let out = match &mut self.store {
            Store::Packed(b) => {
                if decode {
                    b.decode(k, v, q, scale, masks)?.0
                } else {
                    b.window(k, v, q, scale, masks)?.0
                }
            }
            Store::Rows(caches) => {
                let n = caches.len();
                if n == 0 {
                    return Err(CacheError::BadLengths { what: "a read of no rows".to_string() });
                }
                for a in [k, v, q] {
                    if a.shape().first().copied() != Some(n as i32) {
                        return Err(CacheError::ShapeMismatch {
                            what: format!("{n} rows, an input of shape {:?}", a.shape()),
                        });
                    }
                }
                let l = check_kv(&self.spec, k, v, n, 1)?;
                check_q(&self.spec, q, n, l)?;
                // This layout's mask, before any row appends.
                let row_masks =
                    if decode { vec![None; n] } else { layout_window_masks(caches, l, &vec![l; n], masks)? };
                // Every row reads on a copy first, so a failing row leaves all rows unchanged.
                let mut next = caches.clone();
                let mut outs = Vec::with_capacity(n);
                for ((i, c), mask) in next.iter_mut().enumerate().zip(row_masks) {
                    let (ki, vi, qi) = (row_slice(k, i, i + 1)?, row_slice(v, i, i + 1)?, row_slice(q, i, i + 1)?);
                    let o = if decode {
                        c.decode(&ki, &vi, &qi, scale, masks)?
                    } else {
                        c.window_with_mask(&ki, &vi, &qi, scale, mask)?
                    };
                    outs.push(o.0);
                }
                *caches = next;
                mlx_rs::ops::concatenate(&outs, 0)?
            }
        };
        let converted = self.settle_all()?;
        Ok((out, converted))
    }

    /// One decode step per row, each row read in its own precision (the attention read); then, outside a prefill
    /// and a round, the rows whose transition is due convert. Returns the output and the rows that converted.
    pub fn decode(
        &mut self,
        k: &Array,
        v: &Array,
        q: &Array,
        scale: f32,
        masks: &Masks,
    ) -> Result<(Array, Vec<usize>)> {
        self.read(k, v, q, scale, masks, true)
    }

    /// A window of `L` positions per row (prefill chunks, verify windows), as [`TransitioningKvRows::decode`].
    pub fn window(
        &mut self,
        k: &Array,
        v: &Array,
        q: &Array,
        scale: f32,
        masks: &Masks,
    ) -> Result<(Array, Vec<usize>)> {
        self.read(k, v, q, scale, masks, false)
    }

    /// A committed span for every row (R-ROT-7): `L` decodes, one per position, each an ordinary
    /// [`TransitioningKvRows::decode`] (rows whose transition comes due convert between the span's positions, and
    /// the rows pack as soon as every row has converted, outside a prefill and a round). Returns the outputs
    /// concatenated along the token axis and the rows converted, in order. Byte-identical to `L` decode calls;
    /// errors change nothing.
    pub fn commit_span(
        &mut self,
        k: &Array,
        v: &Array,
        q: &Array,
        scale: f32,
        masks: &Masks,
    ) -> Result<(Array, Vec<usize>)> {
        let l = check_kv(&self.spec, k, v, self.rows(), 1)?;
        check_q(&self.spec, q, self.rows(), l)?;
        let mut next = self.clone();
        let (mut outs, mut converted) = (Vec::with_capacity(l), Vec::new());
        for i in 0..l {
            let (o, c) = next.decode(&cols(k, i, i + 1)?, &cols(v, i, i + 1)?, &cols(q, i, i + 1)?, scale, masks)?;
            outs.push(o);
            converted.extend(c);
        }
        let out = mlx_rs::ops::concatenate(&outs, 2)?;
        *self = next;
        Ok((out, converted))
    }

    /// R-TKV-7: the committed read under known spans of unequal per-row lengths. Row `r` commits its first
    /// `lens[r]` positions of the block, one decode per position: at position `i` exactly the rows with
    /// `lens[r] > i` decode (each row in its own precision, as [`TransitioningKvRows::decode`]), the others are left
    /// as they are; after every position the rows whose transition came due convert (outside a prefill and a round)
    /// and the rows pack once all have. Each row's state and outputs at its real positions are its lego's
    /// [`Bf16FirstCache::commit_span`] of its own length; outputs at padded positions are unspecified. Returns the
    /// outputs and the rows converted, in order. Lengths of another count or past `L` are
    /// [`CacheError::BadLengths`], a pending prefill [`CacheError::PendingPrefill`]; errors change nothing.
    pub fn commit_known_spans(
        &mut self,
        k: &Array,
        v: &Array,
        q: &Array,
        scale: f32,
        masks: &Masks,
        lens: &[usize],
    ) -> Result<(Array, Vec<usize>)> {
        let n = self.rows();
        let l = check_kv(&self.spec, k, v, n, 1)?;
        let hq = check_q(&self.spec, q, n, l)?;
        if lens.len() != n || lens.iter().any(|&x| x > l) {
            return Err(CacheError::BadLengths {
                what: format!("span lengths {lens:?} for {n} rows of {l} positions"),
            });
        }
        if self.pending.is_some() {
            return Err(CacheError::PendingPrefill);
        }
        let _mode = self.kernels.enter();
        let mut next = self.clone();
        let (mut outs, mut converted) = (Vec::with_capacity(l), Vec::new());
        for i in 0..l {
            let active: Vec<bool> = lens.iter().map(|&x| x > i).collect();
            let (ki, vi, qi) = (cols(k, i, i + 1)?, cols(v, i, i + 1)?, cols(q, i, i + 1)?);
            if active.iter().all(|&a| a) {
                let (o, c) = next.decode(&ki, &vi, &qi, scale, masks)?;
                outs.push(o);
                converted.extend(c);
                continue;
            }
            let zero = || zeros(&[1, hq, 1, self.spec.head_dim], self.spec.dtype.to_mlx());
            let o = match &mut next.store {
                _ if !active.iter().any(|&a| a) => zeros(&[n, hq, 1, self.spec.head_dim], self.spec.dtype.to_mlx())?,
                Store::Packed(b) => b.decode_some(&ki, &vi, &qi, scale, masks, &active)?,
                Store::Rows(caches) => {
                    let mut parts = Vec::with_capacity(n);
                    for (r, c) in caches.iter_mut().enumerate() {
                        parts.push(if active[r] {
                            let (kr, vr, qr) =
                                (row_slice(&ki, r, r + 1)?, row_slice(&vi, r, r + 1)?, row_slice(&qi, r, r + 1)?);
                            c.decode(&kr, &vr, &qr, scale, masks)?.0
                        } else {
                            zero()?
                        });
                    }
                    mlx_rs::ops::concatenate(&parts, 0)?
                }
            };
            outs.push(o);
            converted.extend(next.settle_all()?);
        }
        let out = mlx_rs::ops::concatenate(&outs, 2)?;
        *self = next;
        Ok((out, converted))
    }

    /// Row `i`'s storage planes, live columns in physical order (for byte comparisons).
    pub fn row_physical_planes(&self, i: usize) -> Result<Vec<Array>> {
        self.check_row(i)?;
        match &self.store {
            Store::Rows(caches) => caches[i].physical_planes(),
            Store::Packed(b) => b.row_physical_planes(i),
        }
    }

    fn check_row(&self, i: usize) -> Result<()> {
        if i >= self.rows() {
            return Err(CacheError::NoSuchRow { row: i, rows: self.rows() });
        }
        Ok(())
    }

    /// Starts a prefill cohort: conversion waits for each request's [`TransitioningKvRows::commit_prefill`].
    pub fn begin_prefill(&mut self) -> Result<()> {
        if self.prefilling || self.round.is_some() {
            return Err(out_of_order("begin_prefill inside a prefill or a round"));
        }
        self.prefilling = true;
        Ok(())
    }

    /// Commits the planned chunk boundary of these rows' requests: exactly these rows settle (no-op once packed).
    pub fn commit_prefill(&mut self, which: &[usize]) -> Result<Vec<usize>> {
        if !self.prefilling {
            return Err(out_of_order("commit_prefill without a prefill"));
        }
        for &i in which {
            self.check_row(i)?;
        }
        self.settle(which)
    }

    /// Ends the prefill cohort (a prepared prefill ends with [`TransitioningKvRows::finalize`] instead): every
    /// request whose chunk was not committed commits now, so the rows whose transition is due convert (as at
    /// `finalize`; then the rows pack if all have). No row is left past its transition unconverted. Returns the rows
    /// converted. Without a cohort (or with a prepared prefill pending): [`CacheError::Lifecycle`], nothing changed.
    pub fn end_prefill(&mut self) -> Result<Vec<usize>> {
        if !self.prefilling || self.pending.is_some() {
            return Err(out_of_order("end_prefill without a prefill"));
        }
        let mut next = self.clone();
        next.prefilling = false;
        // Mutation hook `Mutant::TkvEndPrefillLeavesDue`: the cohort ends, nothing commits.
        let converted = if fault!(TkvEndPrefillLeavesDue) { Vec::new() } else { next.settle_all()? };
        *self = next;
        Ok(converted)
    }

    /// Arms a speculative round (records every row's committed offset).
    pub fn round_begin(&mut self) -> Result<()> {
        if self.round.is_some() || self.prefilling {
            return Err(out_of_order("round_begin inside a round or a prefill"));
        }
        self.round = Some(self.offsets());
        Ok(())
    }

    /// Ends the round keeping every position; settles every row.
    pub fn round_commit(&mut self) -> Result<Vec<usize>> {
        if self.round.take().is_none() {
            return Err(out_of_order("commit without an armed round"));
        }
        self.settle_all()
    }

    /// Ends the round keeping `keep[r]` of the positions it wrote into row `r`: each row drops its rejected
    /// positions by a bypass trim (no bytes move), and in the aligned geometry rolls right into its padding
    /// (`left_pad += shift`) unless it is a lone unwrapped row (which trims). Then every row settles on its committed
    /// offset. Returns the per-row shifts and the rows converted. A wrong count, or a row keeping more than it was
    /// written ([`CacheError::KeepTooLong`]), changes nothing.
    pub fn round_rollback(&mut self, keep: &[usize]) -> Result<(Vec<usize>, Vec<usize>)> {
        let before = self.round.clone().ok_or_else(|| out_of_order("rollback without an armed round"))?;
        if keep.len() != self.rows() {
            return Err(CacheError::BadLengths { what: format!("{} keeps for {} rows", keep.len(), self.rows()) });
        }
        let offsets = self.offsets();
        let mut shifts = Vec::with_capacity(keep.len());
        for (row, ((&o, &b), &k)) in offsets.iter().zip(&before).zip(keep).enumerate() {
            let written = o - b;
            if k > written {
                return Err(CacheError::KeepTooLong { row, keep: k, written });
            }
            shifts.push(written - k);
        }
        let mut next = self.clone();
        match &mut next.store {
            Store::Packed(b) => b.trim_rows(&shifts, true)?,
            Store::Rows(caches) => {
                for ((c, &s), &k) in caches.iter_mut().zip(&shifts).zip(keep) {
                    if s > 0 {
                        // Mutation hook `Mutant::TkvRollbackDropsKept`: one kept position dropped too.
                        let extra = usize::from(fault!(TkvRollbackDropsKept) && k > 0);
                        c.trim(s + extra, true)?;
                    }
                }
            }
        }
        let lone_unwrapped = self.rows() == 1 && self.max_size.is_none_or(|w| offsets[0] < w);
        if self.max_size.is_some() && !lone_unwrapped {
            for (m, &s) in next.meta.iter_mut().zip(&shifts) {
                m.left_pad += s;
            }
        }
        next.round = None;
        let converted = next.settle_all()?;
        *self = next;
        Ok((shifts, converted))
    }

    /// Each row's storage kind now (`kv-plain` / `rotating-plain`, `kv:quant:..` / `kv:rotating-quant:..` once
    /// converted): the storage the lego composes (R-C-10).
    pub fn row_storage_kinds(&self) -> Vec<StorageKind> {
        match &self.store {
            Store::Rows(caches) => caches.iter().map(SerialCache::storage_kind).collect(),
            Store::Packed(b) => vec![StorageKind::serial_of(self.max_size, b.storage()); b.rows()],
        }
    }

    /// R-C-4 per row: what one more token costs row `i` in the precision it holds now.
    pub fn row_bytes_per_token(&self, i: usize) -> Result<usize> {
        self.check_row(i)?;
        Ok(match &self.store {
            Store::Rows(caches) => caches[i].bytes_per_token(),
            Store::Packed(b) => b.bytes_per_token(),
        })
    }

    /// R-C-4 for the layout: the most one more token costs any row (rows of mixed precision differ; an
    /// admission budget needs the largest). **kvsim's choice**: upstream documents one value per cache. 0 without
    /// rows.
    pub fn bytes_per_token(&self) -> usize {
        (0..self.rows()).filter_map(|i| self.row_bytes_per_token(i).ok()).max().unwrap_or(0)
    }

    /// R-ROT-5 / R-TKV-6 per row: the fetch of the coming decode step, without moving any row (an unpacked row's
    /// own ring rule, or the packed rows').
    pub fn decode_phases(&self) -> Vec<super::ring::DecodePhase> {
        match &self.store {
            Store::Rows(caches) => caches.iter().map(SerialCache::decode_phase).collect(),
            Store::Packed(b) => (0..b.rows()).filter_map(|i| b.row_decode_phase(i).ok()).collect(),
        }
    }

    /// R-C-5: every row trimmable by its ring rule, outside an armed round and a prefill.
    pub fn is_trimmable(&self) -> bool {
        if self.round.is_some() {
            return false;
        }
        match &self.store {
            Store::Rows(caches) => caches.iter().all(SerialCache::is_trimmable),
            Store::Packed(b) => b.is_trimmable(),
        }
    }

    /// R-C-5 on every row: the last `n` positions dropped (precision and floors kept, as the lego's trim). Every
    /// row is checked first. Inside an armed round (its rollback is the way back) it is [`CacheError::Lifecycle`];
    /// a ring that wrapped is [`CacheError::NotTrimmable`]; nothing changed on error. Returns `n`.
    pub fn trim(&mut self, n: usize, bypass: bool) -> Result<usize> {
        if self.round.is_some() {
            return Err(out_of_order("trim inside an armed round (roll the round back instead)"));
        }
        let mut next = self.store.clone();
        match &mut next {
            Store::Rows(caches) => {
                for c in caches.iter_mut() {
                    c.trim(n, bypass)?;
                }
            }
            Store::Packed(b) => {
                b.trim(n, bypass)?;
            }
        }
        self.store = next;
        Ok(n)
    }

    /// Row `i` handed back to serial use, composed again by its lego (conversion and floor kept; R-TKV-5).
    pub fn extract(&self, i: usize) -> Result<Bf16FirstCache> {
        self.check_row(i)?;
        let cache = match &self.store {
            Store::Rows(caches) => caches[i].clone(),
            Store::Packed(b) => b.extract(i)?,
        };
        let m = self.meta[i];
        // Mutation hook `Mutant::TkvFloorLostByExtract`: the floor is not carried.
        let floor = if fault!(TkvFloorLostByExtract) { 0 } else { m.floor };
        Ok(Bf16FirstCache::compose(cache, self.transition, self.kernels, m.converted_at, floor))
    }

    /// Keeps these rows in this order (floors kept; the padding every kept row shares is shifted off); then packs if
    /// every kept row has converted. Refused inside a round or a pending prefill; bad rows are [`CacheError::NoSuchRow`] /
    /// [`CacheError::DuplicateRow`], nothing changed.
    pub fn filter(&mut self, keep: &[usize]) -> Result<()> {
        if self.round.is_some() || self.pending.is_some() {
            return Err(out_of_order("filter inside an armed round or a pending prefill"));
        }
        let mut seen = vec![false; self.rows()];
        for &k in keep {
            match seen.get_mut(k) {
                None => return Err(CacheError::NoSuchRow { row: k, rows: self.rows() }),
                Some(true) => return Err(CacheError::DuplicateRow { row: k }),
                Some(s) => *s = true,
            }
        }
        let mut next = self.clone();
        match &mut next.store {
            Store::Packed(b) => b.filter(keep)?,
            Store::Rows(caches) => *caches = keep.iter().map(|&k| caches[k].clone()).collect(),
        }
        next.meta = keep.iter().map(|&k| self.meta[k]).collect();
        let shared = next.meta.iter().map(|m| m.left_pad).min().unwrap_or(0);
        for m in &mut next.meta {
            m.left_pad -= shared;
        }
        next.maybe_pack()?;
        *self = next;
        Ok(())
    }
}

/// The unpacked rows' one mask of a window read (R-TKV-3), built through `masks` before any row appends: the
/// sliding-window geometry of every row after its write of `real[r]` of the `l` positions (`lens`: each row's
/// [`SerialCache::window_len_after`]), built only when some row's read needs an explicit mask
/// ([`SerialCache::window_mask_key`]); each such row gets its block (its `real[r]` queries over its own columns,
/// exactly the matrix its own geometry builds), the others `None` (`Causal`, as their serial read).
fn layout_window_masks(
    caches: &[SerialCache],
    l: usize,
    real: &[usize],
    masks: &Masks,
) -> Result<Vec<Option<(std::rc::Rc<super::mask::MaskSpec>, Array)>>> {
    let needs: Vec<bool> = caches.iter().zip(real).map(|(c, &r)| r > 0 && c.window_mask_key(r).is_some()).collect();
    if !needs.iter().any(|&x| x) {
        return Ok(vec![None; caches.len()]);
    }
    let lens: Vec<usize> = caches.iter().zip(real).map(|(c, &r)| c.window_len_after(r)).collect();
    let key = super::mask::MaskKey {
        kind: super::mask::MaskKind::Window,
        lens: lens.clone(),
        real: real.to_vec(),
        queries: l,
        window: caches.first().and_then(SerialCache::max_size),
        cols: lens.iter().copied().max().unwrap_or(0).max(1),
    };
    let mask = masks.get(&key)?;
    needs
        .iter()
        .enumerate()
        .map(|(r, &need)| need.then(|| super::mask::row_block(&mask, r, real[r], lens[r])).transpose())
        .collect()
}

mod dense;
mod parts;
mod prepared;
mod step;

#[cfg(test)]
mod tests;
