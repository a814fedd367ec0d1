//! [`PersistError`]: every way a cache file can be unreadable, unwritable or unrepresentable. Never a panic.

use thiserror::Error;

use kvsim_cache::CacheError;

/// Why a cache could not be saved, loaded or converted. A failed load returns no cache at all (nothing half-built);
/// a failed save leaves the previous file at that path untouched (atomic write).
#[derive(Debug, Error)]
pub enum PersistError {
    /// The file system refused (open, write, fsync, rename). `kind` says why: e.g. `StorageFull` (ENOSPC),
    /// `ReadOnlyFilesystem` or `PermissionDenied` (a folder that cannot be written), `NotFound`.
    #[error("i/o error on {path}: {message}")]
    Io { path: String, kind: std::io::ErrorKind, message: String },
    /// The file ends before the structure its header announces.
    #[error("truncated file: {what}")]
    Truncated { what: String },
    /// Neither a kvsim cache file nor a safetensors file.
    #[error("not a cache file: {what}")]
    BadMagic { what: String },
    /// A kvsim file of a format version this build does not read.
    #[error("unsupported kvsim cache format version {found} (this build reads version {supported})")]
    UnsupportedVersion { found: u32, supported: u32 },
    /// The header's sha256 does not match its bytes (a flipped bit, a torn write).
    #[error("header checksum mismatch: the header is corrupt")]
    HeaderChecksum,
    /// A tensor's sha256 does not match its bytes.
    #[error("checksum mismatch in tensor {name}: the data is corrupt")]
    TensorChecksum { name: String },
    /// Syntactically or structurally malformed content (JSON, tensor table, metadata, tree of keys).
    #[error("malformed file: {what}")]
    Malformed { what: String },
    /// A tensor the kind's layout requires is absent.
    #[error("missing tensor or field {name}")]
    Missing { name: String },
    /// A tensor of the wrong dtype.
    #[error("tensor {name} has dtype {found}, expected {expected}")]
    Dtype { name: String, expected: String, found: String },
    /// A tensor of the wrong shape (or shapes that do not agree).
    #[error("tensor {name}: {what}")]
    Shape { name: String, what: String },
    /// A storage kind (kvsim files) or a class name (mlx-lm files) that no codec handles: fail closed.
    #[error("unknown cache kind {kind:?}")]
    UnknownKind { kind: String },
    /// More or fewer than one codec claims a storage kind (a broken registry).
    #[error("{matches} codecs match storage kind {kind:?}; exactly one must")]
    AmbiguousCodec { kind: String, matches: usize },
    /// A `minimum_reusable_offset` outside `[0, offset]`.
    #[error("invalid minimum reusable offset {floor} (offset {offset})")]
    InvalidFloor { floor: usize, offset: usize },
    /// A valid file (or cache) that the requested target cannot represent faithfully, e.g. an mlx-lm class kvsim
    /// has no layout for, a `RotatingKVCache` with `keep > 0`, a row with a pending prefill going to mlx-lm.
    #[error("unsupported conversion: {what}")]
    Unsupported { what: String },
    /// The state in the file is one no sequence of cache operations could produce (the cache refused to adopt it).
    #[error("invalid cache state in file: {0}")]
    Cache(#[from] CacheError),
}

impl PersistError {
    pub(crate) fn malformed(what: impl Into<String>) -> Self {
        PersistError::Malformed { what: what.into() }
    }

    pub(crate) fn unsupported(what: impl Into<String>) -> Self {
        PersistError::Unsupported { what: what.into() }
    }

    pub(crate) fn shape(name: impl Into<String>, what: impl Into<String>) -> Self {
        PersistError::Shape { name: name.into(), what: what.into() }
    }

    pub(crate) fn io(path: &std::path::Path, e: std::io::Error) -> Self {
        PersistError::Io { path: path.display().to_string(), kind: e.kind(), message: e.to_string() }
    }
}

impl From<kvsim_cache::bytes::BytesError> for PersistError {
    fn from(e: kvsim_cache::bytes::BytesError) -> Self {
        PersistError::Cache(CacheError::Mlx(e.to_string()))
    }
}

impl From<mlx_rs::error::Exception> for PersistError {
    fn from(e: mlx_rs::error::Exception) -> Self {
        PersistError::Cache(CacheError::from(e))
    }
}

/// Result of every persistence operation.
pub type Result<T> = std::result::Result<T, PersistError>;
