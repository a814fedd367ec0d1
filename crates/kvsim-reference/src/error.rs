//! The model's error type: an impossible request. Shared by `values` (shape validation) and `model` (every
//! checked operation); depends on nothing else in `reference`.

/// An impossible request to the model. The first three mirror the production `CacheError` variants of the same
/// name (R-C-5, R-ROT-6).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ModelError {
    /// A non-bypass trim of a ring that has wrapped (`offset >= W`, R-ROT-6).
    #[error("not trimmable: the ring has wrapped (offset >= window)")]
    NotTrimmable,
    /// A trim of more positions than allowed (`offset`/`len`, or the last window's `L` under bypass).
    #[error("trim too long")]
    TrimTooLong,
    /// A bypass trim whose last mutation was not a window write (R-C-5).
    #[error("bypass trim is only valid right after a window write")]
    BypassNotAfterWindow,
    /// A decode (or a new `prepare`) while a right-padded prefill is pending (R-BROT-2).
    #[error("a right-padded prefill is pending: finalize first")]
    PendingPrefill,
    /// `finalize` without a pending prefill.
    #[error("no prefill is pending")]
    NoPendingPrefill,
    /// A row index out of range.
    #[error("no row {row} (the batch has {rows} rows)")]
    NoSuchRow { row: usize, rows: usize },
    /// A row named twice in `filter`.
    #[error("row {row} named twice")]
    DuplicateRow { row: usize },
    /// A source whose window differs from the batch's.
    #[error("window mismatch: expected {expected:?}, found {found:?}")]
    WindowMismatch { expected: Option<usize>, found: Option<usize> },
    /// Per-row arguments of the wrong count or shape.
    #[error("bad lengths: {what}")]
    BadLengths { what: String },
    /// A token written at a position other than the row's next position.
    #[error("position mismatch: the row's next position is {expected}, the token has {found}")]
    PositionMismatch { expected: usize, found: u32 },
    /// A state or construction request that violates an invariant (including a window of 0).
    #[error("invalid state: {what}")]
    InvalidState { what: String },
}
