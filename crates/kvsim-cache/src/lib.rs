//! Production KV-cache layouts on MLX: what an MLX inference engine needs under continuous batching and
//! speculative decoding (docs/layouts.md says what each layout guarantees). This crate knows nothing of the
//! harness that proves it: its dependencies are MLX's bindings and a few small crates.
//!
//! - [`SerialCache`] ([`KvCache`], [`RotatingKvCache`]): the serial ring/linear core (R-ROT-*).
//! - [`RowBatch`] ([`BatchKvCache`], [`BatchRotatingKvCache`]): rows of serial rings in one buffer, each row keeping
//!   its own physical columns and phase (R-BROT-*).
//! - [`CompiledDecode`], [`DecodePlan`]: the compiled-decode protocol (R-C-9): host plan, pure step, apply.
//! - [`TrainingCache`], [`PrefixSharedCache`]: stateless training adapters, never admitted, merged or persisted
//!   (R-TRN-*).
//! - [`QuantizedKvCache`], [`RotatingQuantizedKvCache`], [`BatchQuantizedKvCache`]: the same core and rows with
//!   affine-quantized [`Storage`] (six planes; see [`quant`]).
//! - [`ChunkedKvCache`]: a linear cache with mlx-lm's chunk rule (front trimmed to `chunk_size` on request).
//! - [`SsmCache`]: the gated-DeltaNet recurrent cache (conv tail + recurrent state, speculative rounds; R-SSM-*).
//! - [`Masks`]: the per-forward mask memo (R-C-3). [`StorageKind`]: identity strings (R-C-1).
//! - [`bytes`]: byte views of MLX arrays, bitwise equality and ULP distance; every bit-exact claim goes through it.
//! - `faults` (only with the cargo feature `faults`, which the harness turns on): the mutation catalog's fault hooks.
//!
//! # What is guaranteed
//! - **Stored bytes**: writes are copies (slice updates, scatters, gathers, concatenations), so every live column
//!   of every row holds exactly the bytes that were written for its position, and a row's physical column order is
//!   exactly its solo serial cache's (same `RingState`).
//! - **Decode outputs**: a row's decode read runs MLX's fused SDPA over the same keys in the same physical order as
//!   its solo cache; when rows differ in `len` the batch adds a boolean mask `c < len_r`. Byte-identity to the solo
//!   output is then a property of MLX's kernel (batch invariance, all-true-mask = no-mask), measured on CPU by the
//!   tests here, not promised by this module.
//! - **Host metadata** is plain integers ([`RingState`], [`RowState`]); K/V buffers are evaluated after every
//!   write, so no lazy graph grows across steps.
//!
//! # Examples
//! A plain (linear) cache: a prompt of 5 positions through `window`, then one decode step. K and V are
//! `[B, H_kv, L, D]`, queries `[B, H_q, L, D]`; the read is MLX's fused attention over the cache's live columns.
//! ```
//! use kvsim_cache::{KvCache, KvDtype, KvSpec, Masks};
//! use mlx_rs::Array;
//!
//! let spec = KvSpec { heads_kv: 2, head_dim: 4, dtype: KvDtype::F32 };
//! let block = |l: i32, h: i32| Array::ones::<f32>(&[1, h, l, 4]).unwrap();
//! let mut cache = KvCache::new(spec).unwrap();
//! let masks = Masks::new(); // one per forward: every layer shares the masks it builds
//! let (out, _mask) = cache.window(&block(5, 2), &block(5, 2), &block(5, 4), 0.5, &masks).unwrap();
//! assert_eq!(out.shape(), &[1, 4, 5, 4]);
//! cache.decode(&block(1, 2), &block(1, 2), &block(1, 4), 0.5, &Masks::new()).unwrap();
//! assert_eq!(cache.offset(), 6);
//! assert_eq!(cache.bytes_per_token(), 2 * 2 * 4 * 4); // K and V, 2 heads of 4 f32
//! ```
//!
//! A batch of rotating rows (window 4) for continuous batching: two requests prefilled alone, joined into one
//! batch, decoded together; each row keeps its own ring, and `extract` hands a row back as a serial cache.
//! ```
//! use kvsim_cache::{JoinSource, KvDtype, KvSpec, Masks, RotatingKvCache, RowBatch};
//! use mlx_rs::Array;
//!
//! let spec = KvSpec { heads_kv: 1, head_dim: 4, dtype: KvDtype::F32 };
//! let block = |b: i32, l: i32| Array::ones::<f32>(&[b, 1, l, 4]).unwrap();
//! let mut a = RotatingKvCache::new(spec, 4).unwrap();
//! a.window(&block(1, 6), &block(1, 6), &block(1, 6), 0.5, &Masks::new()).unwrap(); // wraps the ring
//! let mut b = RotatingKvCache::new(spec, 4).unwrap();
//! b.window(&block(1, 2), &block(1, 2), &block(1, 2), 0.5, &Masks::new()).unwrap();
//! let mut rows = RowBatch::join(spec, Some(4), &[JoinSource::Serial(&a), JoinSource::Serial(&b)]).unwrap();
//! let (out, _) = rows.decode(&block(2, 1), &block(2, 1), &block(2, 1), 0.5, &Masks::new()).unwrap();
//! assert_eq!(out.shape(), &[2, 1, 1, 4]);
//! let offsets: Vec<usize> = rows.row_states().iter().map(|r| r.ring.offset).collect();
//! assert_eq!(offsets, [7, 3]);
//! assert_eq!(rows.extract(1).unwrap().offset(), 3);
//! ```
//!
//! An affine-quantized cache (4 bits, groups of 64, as mlx-lm's `QuantizedKVCache`): six planes (packed words,
//! scales and biases of K and V) instead of two, read by MLX's quantized matmuls.
//! ```
//! use kvsim_cache::{KvDtype, KvSpec, Masks, QuantSpec, QuantizedKvCache};
//! use mlx_rs::Array;
//!
//! let spec = KvSpec { heads_kv: 1, head_dim: 64, dtype: KvDtype::Bf16 };
//! let block = |l: i32| Array::ones::<f32>(&[1, 1, l, 64]).unwrap().as_dtype(mlx_rs::Dtype::Bfloat16).unwrap();
//! let mut cache = QuantizedKvCache::new(spec, QuantSpec { bits: 4, group: 64 }).unwrap();
//! cache.window(&block(3), &block(3), &block(3), 0.125, &Masks::new()).unwrap();
//! assert_eq!(cache.offset(), 3);
//! assert_eq!(cache.storage_kind().as_str(), "kv:quant:4:64");
//! ```
//!
//! # Files
//! - `ring.rs`: the serial ring/linear core, `SerialCache` (`KvCache`, `RotatingKvCache`), `RingState`, its special reads
//!   `bidir_prefill`, `encoder_read`, `read_block`, `commit_span`; `set_eval_after_write`.
//! - `batch.rs`: `RowBatch` (`BatchKvCache`, `BatchRotatingKvCache`): rows that keep their solo ring's columns and phase;
//!   merge, join, extract, filter, adopt, prepare/finalize, per-row trims, `rope_offsets`; `batch/decode.rs` its
//!   decode step (oversize drop and compaction, write, read, committed spans), `batch/capacity.rs` its capacity bound
//!   and `held_bytes`.
//! - `quant.rs`: `Storage` (plain or affine planes), the quantized read, the quantized caches (quantized-kv).
//! - `transition.rs`: the bf16-first legos (`Bf16FirstCache`) and `TransitioningKvRows` (transitioning-rows).
//! - `ssm.rs`: `SsmCache`, gated-DeltaNet conv tail and recurrent state with speculative rounds (ssm).
//! - `paged.rs`: `PagedStore`, one layer's block pool (plain or affine planes) shared by sequences, the running batch's
//!   rows and a radix prefix index (reference counts, copy-on-write, LRU eviction, typed `PoolExhausted`, speculative
//!   rounds, right-padded prefill, `audit`, `PagedParts`) (paged).
//! - `training.rs`: `TrainingCache`, `PrefixSharedCache`, `TrainingSsmCache`: stateless, no K/V or state field.
//! - `compiled.rs`: compiled decode (`DecodePlan`, `CompiledDecode`, `decode_step`; rows: `rows_decode_step`).
//! - `contract.rs`: the spec's common contract as traits (`Cache`, `AttentionCache`, `RowLayout`, `SpecRounds`);
//!   `Capabilities` from the kind string alone. `chunked.rs`: `ChunkedKvCache`. `mask.rs`: `Masks` (one per forward).
//!   `kind.rs`: `StorageKind` strings and capability predicates. `error.rs`: `CacheError`.
//! - `exact.rs`: `ReadMode`, the batch-invariant read on CUDA (kernels JIT-compiled through mlx-c's custom kernel API),
//!   its host emulation `emulate`, `visible_ranges` (docs/exact-read.md). `util.rs`: host arrays,
//!   `step_index_array` (decode write heads derived on the GPU from the last step's, checked on the host).
//! - `bytes.rs`: `ArrayBytes`, arrays as same-width unsigned integers: every bit-exact claim goes through it.
//! - `faults.rs` (feature `faults`): the mutation catalog's fault hooks, one deliberate bug per `Mutant`, armed per
//!   thread, inert unless armed. Feature `serde` derives serde on the plain enums (`KvDtype`, `KvSpec`, ...).
//!
//! # Fault hooks
//! The mutation catalog's fault hooks exist only with the cargo feature `faults`, which the harness turns on to
//! prove its checks have teeth. A build with default features has neither the hooks nor the `faults` module: this
//! does not compile there (run by `cargo test -p kvsim-cache --doc`).
#![cfg_attr(
    not(feature = "faults"),
    doc = "```compile_fail\nkvsim_cache::faults::arm(Some(kvsim_cache::faults::Mutant::TemporalHead));\n```"
)]
#![warn(missing_docs)]
#![cfg_attr(test, allow(clippy::print_stdout, clippy::print_stderr))]

/// The README's code sample, compiled and run as a doctest of this crate (`cargo test -p kvsim-cache --doc`).
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
pub struct ReadmeDoctests;

/// Whether the fault hook of the named catalog mutant fires here: the mutant is armed on this thread. The hooks of
/// this crate and of the crates built on it (persistence) use it.
#[cfg(feature = "faults")]
#[doc(hidden)]
#[macro_export]
macro_rules! fault {
    ($m:ident) => {
        $crate::faults::is($crate::faults::Mutant::$m)
    };
}

/// Without the feature `faults` every fault hook is the constant `false`, so none is compiled.
#[cfg(not(feature = "faults"))]
#[doc(hidden)]
#[macro_export]
macro_rules! fault {
    ($m:ident) => {
        false
    };
}

pub mod batch;
pub mod bytes;
pub mod chunked;
pub mod compiled;
pub mod contract;
pub mod error;
pub mod exact;
#[cfg(feature = "faults")]
pub mod faults;
pub mod kind;
pub mod mask;
pub mod paged;
pub mod quant;
mod read;
pub mod ring;
pub mod ssm;
#[cfg(any(test, feature = "testutil"))]
#[doc(hidden)]
pub mod testutil;
pub mod training;
pub mod transition;
mod util;

pub use batch::{BatchKvCache, BatchRotatingKvCache, JoinSource, RopeOffsets, RowBatch, RowState};
pub use chunked::ChunkedKvCache;
pub use compiled::{
    decode_step, int32_input, plain_decode_step, quantized_decode_step, rows_decode_step, CompiledDecode, DecodePlan,
    RowsStepPlan, StepRope,
};
pub use contract::{
    AttentionCache, BatchParts, Cache, Capabilities, Composed, KvGeometry, LegoGeometry, RowLayout, SpecRounds,
    SsmParts,
};
pub use error::CacheError;
pub use exact::{read_mode, set_read_mode, ReadMode};
pub use kind::{
    is_bf16_first, is_delayed, is_linear, is_plain_kv, is_quantized, is_rotating, is_row_batch, is_ssm, is_training,
    paged_kind, parse_bf16_first, parse_delayed, parse_paged, DelayedKind, KindRoute, PagedKind, StorageKind,
    BF16_FIRST_QUANT_PREFIX, BF16_FIRST_ROTATING_QUANT_PREFIX, CACHE_LIST, CHUNKED_PREFIX, DELAYED_QUANT_PREFIX,
    DELAYED_ROTATING_QUANT_PREFIX, KV_PLAIN, PAGED_PREFIX, PAGED_ROWS_PREFIX, PREFIX_SHARED, QUANT_PREFIX,
    ROTATING_PLAIN, ROTATING_QUANT_PREFIX, ROW_BATCH_MARKER, SSM, TRAINING, TRAINING_SSM,
};
pub use mask::{FamilyKey, MaskKey, MaskKind, MaskSpec, MaskUse, Masks};
pub use paged::{IndexEntry, PagedParts, PagedSeq, PagedStore, PoolSpec, PrefixHit, SeqId};
pub use quant::{
    packed_width, BatchQuantizedKvCache, QuantSpec, QuantizedKvCache, RotatingQuantizedKvCache, Storage, QUANT_BITS,
    QUANT_GROUPS,
};
pub use ring::{set_eval_after_write, DecodePhase, KvCache, RingState, RotatingKvCache, SerialCache};
pub use ssm::{GdnParams, SsmCache, SsmPadding, SsmSpec, SsmStats};
pub use training::{PrefixSharedCache, TrainingCache, TrainingSsmCache};
pub use transition::{
    Bf16FirstCache, Bf16FirstQuantizedKvCache, Bf16FirstRotatingQuantizedKvCache, KernelSet, RowLifecycle, RowsParts,
    RowsStep, StepSlot, Transition, TransitioningKvRows,
};

/// Result of every fallible cache operation.
pub type Result<T> = std::result::Result<T, CacheError>;

/// The element type of K, V, Q and outputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum KvDtype {
    /// 32-bit IEEE float (MLX `Float32`), 4 bytes per element.
    F32,
    /// bfloat16 (MLX `Bfloat16`), 2 bytes per element.
    Bf16,
}

impl KvDtype {
    /// Bytes per element.
    pub fn itemsize(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::Bf16 => 2,
        }
    }

    /// The MLX dtype.
    pub fn to_mlx(self) -> mlx_rs::Dtype {
        match self {
            KvDtype::F32 => mlx_rs::Dtype::Float32,
            KvDtype::Bf16 => mlx_rs::Dtype::Bfloat16,
        }
    }

    /// The `KvDtype` of an MLX dtype, if it is one.
    pub fn from_mlx(d: mlx_rs::Dtype) -> Option<Self> {
        match d {
            mlx_rs::Dtype::Float32 => Some(KvDtype::F32),
            mlx_rs::Dtype::Bfloat16 => Some(KvDtype::Bf16),
            _ => None,
        }
    }
}

impl From<KvDtype> for mlx_rs::Dtype {
    fn from(d: KvDtype) -> Self {
        d.to_mlx()
    }
}

/// The geometry of one layer's K/V: `H_kv` heads of `head_dim` elements of `dtype`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct KvSpec {
    /// `H_kv`: K/V heads (axis 1 of every K/V buffer); queries have a positive multiple of it (GQA). Non-zero.
    pub heads_kv: usize,
    /// `D`: elements per head (the last axis of K, V and Q). Non-zero; affine storage needs a multiple of the group.
    pub head_dim: usize,
    /// The element type of K, V, Q and outputs (and of the scales and biases of affine storage).
    pub dtype: KvDtype,
}

impl KvSpec {
    /// `2 * H_kv * D * itemsize`: bytes one token costs one row (K and V; R-C-4).
    pub fn bytes_per_token(&self) -> usize {
        2 * self.heads_kv * self.head_dim * self.dtype.itemsize()
    }

    pub(crate) fn validate(&self) -> Result<()> {
        if self.heads_kv == 0 || self.head_dim == 0 {
            return Err(error::invalid(format!("spec with zero heads or head_dim: {self:?}")));
        }
        if i32::try_from(self.heads_kv).is_err() || i32::try_from(self.head_dim).is_err() {
            return Err(error::invalid(format!("spec too large for MLX shapes: {self:?}")));
        }
        Ok(())
    }
}
