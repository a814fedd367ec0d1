//! [`CacheError`]: every impossible request to a cache is one of these, never a panic.

use thiserror::Error;

/// Why a cache refused a request (or MLX failed under it).
///
/// Every variant is returned *before* any state changes, except [`CacheError::Mlx`], which reports a failure of
/// the MLX runtime itself (after which the cache's host metadata is still consistent with its buffers: buffers are
/// replaced only once the new ones are built).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CacheError {
    /// `trim(n, bypass = false)` on a ring that has wrapped (`offset >= max_size`; R-ROT-6, R-C-5).
    #[error("cache is not trimmable: offset {offset} >= max_size {max_size} (the ring has wrapped)")]
    NotTrimmable {
        /// The ring's offset (positions ever written).
        offset: usize,
        /// The ring's window `W`.
        max_size: usize,
    },
    /// A trim longer than what can be dropped (live columns, or the last window's length for bypass trims).
    #[error("trim of {requested} positions requested, only {available} available")]
    TrimTooLong {
        /// The `n` of the trim.
        requested: usize,
        /// What may be dropped: the live columns `len`, or for a bypass trim `last_concat`.
        available: usize,
    },
    /// `trim(n, bypass = true)` when the last mutation was not a window write (R-C-5).
    #[error("bypass trim is only valid right after a window (concatenating) write")]
    BypassNotAfterWindow,
    /// A decode (or `prepare`) while a right-padded prefill is prepared and not finalized (R-BROT-2).
    #[error("a prepared prefill is pending: finalize() first")]
    PendingPrefill,
    /// `finalize()` with no prepared prefill.
    #[error("no prepared prefill to finalize")]
    NoPendingPrefill,
    /// A row index out of range.
    #[error("no row {row} (the batch has {rows} rows)")]
    NoSuchRow {
        /// The requested row index.
        row: usize,
        /// The number of rows the cache holds.
        rows: usize,
    },
    /// A row listed twice where each row may appear once (`filter`, `join`).
    #[error("row {row} listed twice")]
    DuplicateRow {
        /// The first row index found a second time.
        row: usize,
    },
    /// bf16-first legos that attend with different kernel sets cannot be merged into one layout (R-TKV-3).
    #[error("kernel set mismatch: the rows attend with {expected}, a lego carries {found}")]
    KernelSetMismatch {
        /// The set the layout takes (its first lego's), by name.
        expected: String,
        /// The other lego's set, by name.
        found: String,
    },
    /// Caches with different windows (`max_size`) cannot be merged or joined.
    #[error("window mismatch: expected {expected:?}, found {found:?}")]
    WindowMismatch {
        /// The window asked for (`None` = linear).
        expected: Option<usize>,
        /// The source's window.
        found: Option<usize>,
    },
    /// An input array (K, V, Q, a slice, a buffer) whose shape or dtype does not fit the cache's spec and rows.
    #[error("shape mismatch: {what}")]
    ShapeMismatch {
        /// Which input, and its shape or dtype against the expected one.
        what: String,
    },
    /// A storage kind string that no router knows: fail closed (R-C-1, R-BROT-10).
    #[error("unknown storage kind {kind:?}")]
    UnknownStorageKind {
        /// The kind string, as given.
        kind: String,
    },
    /// A constructed or adopted state that no sequence of writes could produce (e.g. `len > offset`).
    #[error("invalid cache state: {what}")]
    InvalidState {
        /// Which rule the state breaks, and the state.
        what: String,
    },
    /// A per-row length list of the wrong size or with impossible values.
    #[error("bad lengths: {what}")]
    BadLengths {
        /// What is wrong with the list (e.g. its count against the rows).
        what: String,
    },
    /// A training-only cache (`train:*`, R-TRN-1) asked to be admitted, merged, joined or persisted.
    #[error("{kind} is a training-only cache: never admitted, merged or persisted")]
    TrainingOnly {
        /// The training kind (`train:*`).
        kind: String,
    },
    /// A prefix-shared training forward whose length is not prompt + chosen + rejected.
    #[error("prefix-shared cache: N={n} != P+Rc+Rr={expected}")]
    PrefixSharedSize {
        /// `N`: positions of the K/V given.
        n: usize,
        /// `P + Rc + Rr` of the cache.
        expected: usize,
    },
    /// A read defined only at offset 0 (the bidirectional vision prefill, R-ROT-9) on a cache that holds positions.
    #[error("{read} is defined only at offset 0; the cache is at offset {offset}")]
    NotAtOffsetZero {
        /// The read's name (e.g. `bidir_prefill`).
        read: &'static str,
        /// The cache's offset (non-zero).
        offset: usize,
    },
    /// A compiled decode step applied with outputs that do not belong to its plan (count, shape or dtype), or to
    /// a cache whose state moved since the plan was made.
    #[error("compiled decode step: {what}")]
    StepMismatch {
        /// What does not fit: the step's inputs or outputs (count, shape, dtype), or the plan against the cache's
        /// prepared state.
        what: String,
    },
    /// Affine quantization parameters MLX does not accept for this head dim (bits not in {2, 3, 4, 5, 6, 8},
    /// group not in {32, 64, 128}, or `head_dim` not a multiple of the group).
    #[error("invalid quantization: bits {bits}, group {group}, head_dim {head_dim}: {what}")]
    InvalidQuant {
        /// The bits asked for.
        bits: usize,
        /// The group asked for.
        group: usize,
        /// The spec's `head_dim`.
        head_dim: usize,
        /// Which of MLX's rules fails.
        what: String,
    },
    /// Caches of different storage (plain vs quantized, or other bits/group) cannot be joined, merged or converted
    /// into one another.
    #[error("storage mismatch: expected {expected}, found {found}")]
    StorageMismatch {
        /// The storage kind the operation needs.
        expected: String,
        /// The storage kind of the cache or source it was given.
        found: String,
    },
    /// `trim` on a recurrent cache: its state cannot drop positions; speculative decoding uses rounds (R-C-5, R-C-6).
    #[error("a recurrent (ssm) cache is not trimmable; use a speculative round")]
    RecurrentNotTrimmable,
    /// A speculative round is armed: begin, merge, filter, extract and prepare wait until it resolves.
    #[error("a speculative round is armed: commit or roll it back first")]
    SpecRoundActive,
    /// Commit or rollback without an armed round.
    #[error("no armed speculative round")]
    NoSpecRound,
    /// Rollback of an armed round before its verify call recorded anything.
    #[error("rollback before the verify call recorded the round")]
    SpecRoundNotRecorded,
    /// A second layer call inside one armed round (at most one call per round, R-SSM-4).
    #[error("the speculative round already recorded its call")]
    SpecRoundAlreadyRecorded,
    /// A rollback keep larger than the recorded window.
    #[error("keep {keep} outside the recorded window of {window} positions")]
    KeepOutsideWindow {
        /// The first keep above the window.
        keep: usize,
        /// Positions the round's verify call recorded.
        window: usize,
    },
    /// A plain (dense, whole-batch) read of transitioning rows while some row is affine or the rows are packed:
    /// mixed-precision rows use their attention read.
    #[error("mixed precision rows use their attention read (row {row} is affine)")]
    MixedPrecision {
        /// The first row that has converted to affine storage.
        row: usize,
    },
    /// Prefix reuse whose usable prefix is below the entry's `minimum_reusable_offset`.
    #[error("reuse below the floor: usable prefix {prefix} < minimum_reusable_offset {floor}")]
    BelowFloor {
        /// The usable prefix: `min(common, prompt_len - 1, offset)`.
        prefix: usize,
        /// The cache's `minimum_reusable_offset`.
        floor: usize,
    },
    /// A speculative rollback keeping more positions in a row than the round wrote into it.
    #[error("row {row}: rollback keeps {keep} positions but the round wrote {written}")]
    KeepTooLong {
        /// The row (0 for a serial lego).
        row: usize,
        /// The positions the rollback asked to keep in it.
        keep: usize,
        /// The positions the round wrote into it.
        written: usize,
    },
    /// A round or prefill call out of order (commit without a round, a round inside a prefill, ...).
    #[error("lifecycle: {what}")]
    Lifecycle {
        /// Which call came out of order.
        what: String,
    },
    /// A contract call this layout does not have (a recurrent or training cache has no K/V decode step, a
    /// stateless cache no trim), nothing changed.
    #[error("{kind} has no {call}")]
    Unsupported {
        /// The cache's storage kind.
        kind: String,
        /// The call it does not have.
        call: &'static str,
    },
    /// A paged write needs more blocks than the pool can give (free, by growth up to its cap, or by evicting
    /// unreferenced prefix-index blocks); nothing changed.
    #[error("paged pool exhausted: the write needs {needed} blocks, {available} can be had")]
    PoolExhausted {
        /// Blocks the write needs (new blocks and copy-on-write copies).
        needed: usize,
        /// Blocks the pool could supply.
        available: usize,
    },
    /// A paged sequence id the store does not hold.
    #[error("no paged sequence {seq}")]
    NoSuchSeq {
        /// The id asked for.
        seq: u64,
    },
    /// The MLX runtime raised an exception.
    #[error("mlx: {0}")]
    Mlx(String),
}

impl From<mlx_rs::error::Exception> for CacheError {
    fn from(e: mlx_rs::error::Exception) -> Self {
        CacheError::Mlx(e.what().to_string())
    }
}

impl From<mlx_rs::ops::indexing::IndexUpdateError> for CacheError {
    fn from(e: mlx_rs::ops::indexing::IndexUpdateError) -> Self {
        CacheError::Mlx(e.to_string())
    }
}

/// Shorthand for a [`CacheError::ShapeMismatch`].
pub(crate) fn shape(what: impl Into<String>) -> CacheError {
    CacheError::ShapeMismatch { what: what.into() }
}

/// Shorthand for a [`CacheError::InvalidState`].
pub(crate) fn invalid(what: impl Into<String>) -> CacheError {
    CacheError::InvalidState { what: what.into() }
}
