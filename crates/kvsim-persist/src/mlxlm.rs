//! mlx-lm prompt-cache files (the format of mlx-lm 0.32.2's `save_prompt_cache` / `load_prompt_cache`,
//! `mlx_lm/models/cache.py`; the full-state layout of mlx-lm PR #1778), read and written through the `safetensors`
//! crate.
//!
//! The layout, as mlx-lm writes it:
//! - tensors are named by dotted index paths into `[c.state for c in cache]` (`"<layer>.<field>[.<sub>...]"`); every
//!   non-array leaf of a state becomes an array and is listed in the `scalars` metadata: an `int` a 0-d I32, a
//!   `bool` a 0-d BOOL, a `float` a 0-d F32 (all `"scalar"`), a `str` an I32 vector of code points (`"string"`),
//!   `None` an empty F32 `[0]` (`"none"`);
//! - the safetensors `__metadata__` is `tree_flatten([user_metadata, class_names, scalars])`: `"0.<key>"` user
//!   metadata, `"1.<i>"` the class name of layer `i`, `"2.0" = ""` (a sentinel), `"2.<j>.0"` / `"2.<j>.1"` the
//!   key and type of the `j`-th converted leaf;
//! - each class's `state` tuple (the key suffix is the field's index):
//!
//! | class | state |
//! |---|---|
//! | `KVCache` | keys, values (the **full allocated buffer**, 256-column steps, zeros past `offset`), offset |
//! | `ConcatenateKVCache` | keys, values (exactly the positions written: its offset is their column count) |
//! | `RotatingKVCache` | keys, values (the ring as laid out), offset, keep, max_size, _idx |
//! | `QuantizedKVCache` | keys = (packed U32, scales, biases), values = (same), offset, group_size, bits |
//! | `ArraysCache` | cache = [arrays or None], left_padding, lengths |
//! | `BatchKVCache` | keys, values, offset (I32 `[B]`), left_padding (I32 `[B]`), _idx |
//! | `BatchRotatingKVCache` | keys, values, offset `[B]`, left_padding `[B]`, max_size, _offset, _idx, rotated (BOOL) |
//! | `ChunkedKVCache` | keys, values, offset, chunk_size, start_position |
//! | `CacheList` | [(sub-state, class name string)] |
//!
//! [`MlxFile`] is the file-level structure of every class above: typed tensors and scalars, read and written
//! faithfully (a file read and written again holds the same tensors, scalars and metadata). Continuing a cache in
//! kvsim needs a kvsim layout: [`to_kvsim`] maps every class onto [`AnyCache`] (`KVCache`, `ConcatenateKVCache`,
//! `RotatingKVCache` with
//! keep = 0, `QuantizedKVCache`, `BatchKVCache`, `BatchRotatingKVCache` onto the attention layouts, `ArraysCache`
//! onto `ssm`, `ChunkedKVCache` onto `kv-chunked:<n>`, `CacheList` onto a list); [`from_kvsim`] maps back. What has
//! no kvsim layout (keep > 0, an `ArraysCache` that is not a DeltaNet state or is mid-prefill) is readable,
//! writable and inspectable, and [`to_kvsim`] refuses it with [`PersistError::Unsupported`]. An `ArraysCache`
//! stores no offsets: they travel in the user metadata ([`SSM_OFFSETS_KEY`]).
//!
//! mlx-lm 0.32.2's own load bugs (mlx-lm 0.32.2 `cache.py`) and what kvsim does instead:
//! - a loaded `BatchKVCache` has no `_right_padding` (so `finalize()` raises) and a loaded `BatchRotatingKVCache`
//!   has no `_lengths` (so every update raises): the file format does not carry a pending right-padded prefill.
//!   kvsim loads such files as finalized batches (which is what they are once written: `state` holds no pending
//!   padding) and refuses to *write* a batch with a pending prefill ([`PersistError::Unsupported`]), since mlx-lm
//!   could not restore it;
//! - `rotated` is a BOOL scalar in 0.32.2 (older files wrote strings, which Python reads back truthy); kvsim reads it
//!   only as a 0-d BOOL or integer and refuses anything else.
//!
//! The file level lives in `parse`, the per-class conversions in `convert`, the hints and whole-file conversions in
//! `hints`; their public items are re-exported here.
//!
//! [`AnyCache`]: crate::codec::AnyCache
//! [`PersistError::Unsupported`]: crate::error::PersistError::Unsupported

use std::collections::BTreeMap;

use super::tensor::HostTensor;

mod convert;
mod files;
mod hints;
mod parse;

pub use convert::{from_kvsim, ssm_spec_of, to_kvsim, to_kvsim_at};
pub use files::{
    file_from_kvsim, file_hints, file_to_kvsim, file_to_kvsim_with, FROM_ATTENTION, FROM_ATTENTION_SPEC, FROM_CALLER,
    FROM_METADATA,
};
pub use hints::{Hints, EMPTY_SPECS_KEY, SSM_OFFSETS_KEY};
pub use parse::{looks_like_safetensors, read, write};

/// The file-level leaf of a state tree.
#[derive(Debug, Clone, PartialEq)]
pub enum Leaf {
    Tensor(HostTensor),
    Int(i64),
    Bool(bool),
    Float(f64),
    Str(String),
    None,
}

/// A state tree (mlx's `tree_unflatten` of the dotted keys).
#[derive(Debug, Clone, PartialEq)]
pub enum Node {
    Leaf(Leaf),
    List(Vec<Node>),
}

/// One mlx-lm cache object, at the file level.
#[derive(Debug, Clone, PartialEq)]
pub enum MlxLayer {
    KvCache {
        keys: Option<HostTensor>,
        values: Option<HostTensor>,
        offset: i64,
    },
    /// mlx-lm's simplest cache: exactly the positions written (`offset` is the keys' column count).
    ConcatenateKvCache {
        keys: Option<HostTensor>,
        values: Option<HostTensor>,
    },
    RotatingKvCache {
        keys: Option<HostTensor>,
        values: Option<HostTensor>,
        offset: i64,
        keep: i64,
        max_size: i64,
        idx: i64,
    },
    QuantizedKvCache {
        keys: Option<[HostTensor; 3]>,
        values: Option<[HostTensor; 3]>,
        offset: i64,
        group_size: i64,
        bits: i64,
    },
    ArraysCache {
        cache: Vec<Option<HostTensor>>,
        left_padding: Option<HostTensor>,
        lengths: Option<HostTensor>,
    },
    BatchKvCache {
        keys: Option<HostTensor>,
        values: Option<HostTensor>,
        offset: HostTensor,
        left_padding: HostTensor,
        idx: i64,
    },
    BatchRotatingKvCache {
        keys: Option<HostTensor>,
        values: Option<HostTensor>,
        offset: HostTensor,
        left_padding: HostTensor,
        max_size: i64,
        offset_total: i64,
        idx: i64,
        rotated: bool,
    },
    ChunkedKvCache {
        keys: Option<HostTensor>,
        values: Option<HostTensor>,
        offset: i64,
        chunk_size: i64,
        start_position: i64,
    },
    CacheList(Vec<MlxLayer>),
}

/// An mlx-lm prompt-cache file: user metadata and one cache object per layer.
#[derive(Debug, Clone, PartialEq)]
pub struct MlxFile {
    pub metadata: BTreeMap<String, String>,
    pub layers: Vec<MlxLayer>,
}
