//! Codecs by storage kind (R-P-1): one [`Codec`] per persistable kind, chosen by exact string compare of the cache's
//! `storage_kind()`, in one [`Registry`].
//!
//! A codec turns a cache into an [`Entry`] (a kind-specific JSON state plus named [`HostTensor`]s) and back. What
//! each codec stores:
//!
//! | kind | tensors | state |
//! |---|---|---|
//! | `kv-plain`, `rotating-plain` | `keys`, `values` `[1, H_kv, len, D]`: the live columns `[0, len)` in physical order (for a ring: the ring as laid out, rotated or not) | spec, window, `offset`, `idx`, `last_concat` (`len` is the tensors' column count) |
//! | `kv-plain+row-batch`, `rotating-plain+row-batch` | `keys`, `values` `[B, H_kv, width, D]` with `width = max_r len_r`: every row's columns `[0, width)` | spec, window, per row `offset`, `len`, `idx`, `last_concat`, `base`, `pending` |
//! | `kv:quant:<bits>:<group>`, `kv:rotating-quant:<bits>:<group>` (and their `+row-batch`) | the six stored planes instead of `keys`, `values`: `keys.packed` (U32, `D * bits / 32` words), `keys.scales`, `keys.biases` (`D / group`, the spec's dtype), and the same three for `values`; columns as for the plain kinds | as for the plain kinds, plus `quant` = `{bits, group}` |
//! | `kv:bf16-first-quant:<bits>:<group>:<start>`, `kv:bf16-first-rotating-quant:<W>:<bits>:<group>:<start>` (the bf16-first legos, and so the transitioning rows through their extracted serial rows) | the storage it holds now, as its own codec stores it (`keys`, `values` before the conversion, the six planes after) | `storage` (that storage's kind), `inner` (its codec's state), `converted_at`, `floor` (the lego's own floor: it survives a trim below `start`, so it may exceed the offset) |
//! | `kv:paged-rows:<block_size>[:quant:<bits>:<group>]` (one layer's whole paged store) | `keys`, `values` `[1, H_kv, capacity * block_size, D]` (affine: the six `keys.packed` ... `values.biases` planes): the pool planes, free blocks included (absent before the first write) | the store's `PagedParts`: spec, pool limits, storage, reference counts, free list in stack order, every sequence's block table, offset, token ids and last window, the rows, the prefix index's entries and clock |
//!
//! Quantized caches are stored as quantized: the planes' bytes are exactly what MLX's `quantize` wrote, never
//! dequantized and quantized again, so a loaded cache continues byte for byte.
//!
//! Nothing past the live columns is stored (a linear cache's spare capacity is zeros kvsim never reads), so the file
//! size follows the content. Every field that decides a later operation is stored: the ring phase (`idx`), what a
//! bypass trim may undo (`last_concat`), a pending prefill's per-row remaining positions (`pending`, so a loaded
//! batch can still `finalize`: mlx-lm 0.32.2's files lose `_right_padding` / `_lengths`, mlx-lm 0.32.2 `cache.py`).
//!
//! Guarantee: `decode(encode(c))` has the same spec, window, per-row state and live bytes as `c`, so every later
//! operation (decode, window, append, trim, prepare/finalize, extract, filter, join) does exactly what it does on
//! `c` (checked by the continuation tests and the simulator's save/restore op). Loading validates the state
//! ([`kvsim_cache::RingState::validate`], `len <= offset`, shapes, dtypes) before building anything: an invalid
//! entry is a typed error, never a cache.
//!
//! The reuse floor (`minimum_reusable_offset`, the upstream engine's cache API) is stored beside every entry and validated on load
//! to lie in `[0, offset]`; for the plain layouts it is whatever the caller attached (0 by default).

use serde::{Deserialize, Serialize};

use super::error::{PersistError, Result};
use super::tensor::{HostTensor, TensorDtype};
use kvsim_cache::{
    parse_bf16_first, parse_paged, Bf16FirstCache, ChunkedKvCache, KindRoute, KvDtype, KvSpec, PagedParts, PagedStore,
    QuantSpec, RingState, RowBatch, RowState, SerialCache, SsmCache, SsmSpec, Storage, StorageKind, Transition,
    CACHE_LIST, CHUNKED_PREFIX, KV_PLAIN, ROTATING_PLAIN, ROW_BATCH_MARKER, SSM,
};

/// A cache of any persistable kind.
#[derive(Debug, Clone)]
pub enum AnyCache {
    Serial(SerialCache),
    Rows(RowBatch),
    /// The gated-DeltaNet recurrent cache (`ssm`), any number of rows.
    Ssm(SsmCache),
    /// A linear cache with mlx-lm's chunk rule (`kv-chunked:<chunk_size>`).
    Chunked(ChunkedKvCache),
    /// One layer's list of caches (`cache-list`, mlx-lm's `CacheList`), each child of its own kind.
    List(Vec<AnyCache>),
    /// A serial bf16-first lego (its layout's own kind, whichever storage it holds now).
    Bf16First(Bf16FirstCache),
    /// One layer's whole paged store (`kv:paged-rows:<block_size>`): pool, sequences, rows and prefix index.
    Paged(PagedStore),
}

impl AnyCache {
    /// The cache's own storage kind (R-C-1): what the registry routes on.
    pub fn storage_kind(&self) -> StorageKind {
        match self {
            AnyCache::Serial(c) => c.storage_kind(),
            AnyCache::Rows(b) => b.storage_kind(),
            AnyCache::Ssm(c) => c.storage_kind(),
            AnyCache::Chunked(c) => c.storage_kind(),
            AnyCache::List(_) => StorageKind::new(CACHE_LIST),
            AnyCache::Bf16First(c) => c.lego_kind(),
            AnyCache::Paged(p) => p.rows_storage_kind(),
        }
    }

    /// Positions ever written (the maximum over rows for a batch).
    pub fn offset(&self) -> usize {
        match self {
            AnyCache::Serial(c) => c.offset(),
            AnyCache::Rows(b) => b.offset(),
            AnyCache::Ssm(c) => c.offset(),
            AnyCache::Chunked(c) => c.offset(),
            AnyCache::List(v) => v.iter().map(AnyCache::offset).max().unwrap_or(0),
            AnyCache::Bf16First(c) => c.offset(),
            AnyCache::Paged(p) => p.seqs().map(|(_, s)| s.offset).max().unwrap_or(0),
        }
    }

    /// The K/V spec of an attention layout (`None` for the recurrent cache and a list).
    pub fn spec(&self) -> Option<KvSpec> {
        match self {
            AnyCache::Serial(c) => Some(c.spec()),
            AnyCache::Rows(b) => Some(b.spec()),
            AnyCache::Chunked(c) => Some(c.cache().spec()),
            AnyCache::Bf16First(c) => Some(c.inner().spec()),
            AnyCache::Paged(p) => Some(p.spec()),
            AnyCache::Ssm(_) | AnyCache::List(_) => None,
        }
    }

    /// The window of an attention layout (`None` for a linear or chunked one, the recurrent cache and a list).
    pub fn max_size(&self) -> Option<usize> {
        match self {
            AnyCache::Serial(c) => c.max_size(),
            AnyCache::Rows(b) => b.max_size(),
            AnyCache::Bf16First(c) => c.inner().max_size(),
            AnyCache::Ssm(_) | AnyCache::Chunked(_) | AnyCache::List(_) | AnyCache::Paged(_) => None,
        }
    }
}

/// One persisted cache: the cache and its reuse floor (`minimum_reusable_offset`, in `[0, offset]`).
#[derive(Debug, Clone)]
pub struct Persisted {
    pub cache: AnyCache,
    pub minimum_reusable_offset: usize,
}

impl Persisted {
    /// A cache with floor 0 (every prefix reusable).
    pub fn new(cache: AnyCache) -> Self {
        Persisted { cache, minimum_reusable_offset: 0 }
    }
}

/// A cache as a codec stores it: kind, kind-specific state, named tensors, floor.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub storage_kind: String,
    pub state: serde_json::Value,
    pub tensors: Vec<(String, HostTensor)>,
    pub minimum_reusable_offset: usize,
}

impl Entry {
    /// The tensor called `name`, else [`PersistError::Missing`].
    pub fn tensor(&self, name: &str) -> Result<&HostTensor> {
        self.tensors
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, t)| t)
            .ok_or_else(|| PersistError::Missing { name: format!("{}.{name}", self.storage_kind) })
    }
}

/// The codec of one storage kind.
pub trait Codec: Send + Sync {
    /// The storage kind this codec handles: the exact string, or for a parametrized family of kinds its pattern
    /// (e.g. `kv:quant:<bits>:<group>`).
    fn storage_kind(&self) -> &'static str;
    /// Whether this codec persists caches of `kind` (default: `kind` is exactly [`Codec::storage_kind`]).
    fn handles(&self, kind: &str) -> bool {
        kind == self.storage_kind()
    }
    /// The entry of `cache` (whose kind is [`Codec::storage_kind`]).
    fn encode(&self, cache: &AnyCache) -> Result<Entry>;
    /// The cache of a validated entry; any inconsistency is a typed error.
    fn decode(&self, entry: &Entry) -> Result<AnyCache>;
}

/// Every codec, keyed by storage kind (exact string compare; exactly one codec per kind).
pub struct Registry {
    codecs: Vec<Box<dyn Codec>>,
}

impl Default for Registry {
    fn default() -> Self {
        Registry {
            codecs: vec![
                Box::new(SerialCodec { rotating: false, quantized: false }),
                Box::new(SerialCodec { rotating: true, quantized: false }),
                Box::new(RowsCodec { rotating: false, quantized: false }),
                Box::new(RowsCodec { rotating: true, quantized: false }),
                Box::new(SerialCodec { rotating: false, quantized: true }),
                Box::new(SerialCodec { rotating: true, quantized: true }),
                Box::new(RowsCodec { rotating: false, quantized: true }),
                Box::new(RowsCodec { rotating: true, quantized: true }),
                Box::new(SsmCodec),
                Box::new(ChunkedCodec),
                Box::new(Bf16FirstCodec { rotating: false }),
                Box::new(Bf16FirstCodec { rotating: true }),
                Box::new(PagedCodec),
            ],
        }
    }
}

impl Registry {
    /// Adds a codec (e.g. a layout family's) to the registry.
    pub fn register(&mut self, codec: Box<dyn Codec>) {
        self.codecs.push(codec);
    }

    /// The storage kinds this registry persists (`cache-list` is the registry's own: a list of its other kinds).
    pub fn kinds(&self) -> Vec<&'static str> {
        self.codecs.iter().map(|c| c.storage_kind()).chain([CACHE_LIST]).collect()
    }

    /// The one codec that handles `kind`: none is [`PersistError::UnknownKind`], several
    /// [`PersistError::AmbiguousCodec`].
    pub fn codec(&self, kind: &str) -> Result<&dyn Codec> {
        let mut it = self.codecs.iter().filter(|c| c.handles(kind));
        match (it.next(), it.count()) {
            (Some(c), 0) => Ok(c.as_ref()),
            (None, _) => Err(PersistError::UnknownKind { kind: kind.to_string() }),
            (Some(_), n) => Err(PersistError::AmbiguousCodec { kind: kind.to_string(), matches: n + 1 }),
        }
    }

    /// The entry of a persisted cache (floor validated).
    pub fn encode(&self, p: &Persisted) -> Result<Entry> {
        let mut e = self.encode_cache(&p.cache)?;
        check_floor(p.minimum_reusable_offset, p.cache.offset())?;
        e.minimum_reusable_offset = if floor_dropped() { 0 } else { p.minimum_reusable_offset };
        Ok(e)
    }

    /// The entry of one cache (a list: its children's entries, nested).
    fn encode_cache(&self, cache: &AnyCache) -> Result<Entry> {
        let AnyCache::List(children) = cache else {
            return self.codec(cache.storage_kind().as_str())?.encode(cache);
        };
        let mut states = Vec::with_capacity(children.len());
        let mut tensors = Vec::new();
        for (i, c) in children.iter().enumerate() {
            let e = self.encode_cache(c)?;
            states.push(ListChild {
                storage_kind: e.storage_kind,
                state: e.state,
                tensors: e.tensors.iter().map(|(n, _)| n.clone()).collect(),
            });
            tensors.extend(e.tensors.into_iter().map(|(n, t)| (format!("{i}.{n}"), t)));
        }
        let state =
            serde_json::to_value(ListState { children: states }).map_err(|e| PersistError::malformed(e.to_string()))?;
        Ok(Entry { storage_kind: CACHE_LIST.to_string(), state, tensors, minimum_reusable_offset: 0 })
    }

    /// The cache of one entry (a list: each child decoded from its own entry; children carry no floor).
    fn decode_cache(&self, e: &Entry) -> Result<AnyCache> {
        if e.storage_kind != CACHE_LIST {
            return self.codec(&e.storage_kind)?.decode(e);
        }
        let st: ListState = state_of(e)?;
        let mut used = 0;
        let mut children = Vec::with_capacity(st.children.len());
        for (i, c) in st.children.into_iter().enumerate() {
            let mut tensors = Vec::with_capacity(c.tensors.len());
            for n in &c.tensors {
                tensors.push((n.clone(), e.tensor(&format!("{i}.{n}"))?.clone()));
            }
            used += tensors.len();
            let child = Entry { storage_kind: c.storage_kind, state: c.state, tensors, minimum_reusable_offset: 0 };
            children.push(self.decode_cache(&child)?);
        }
        if used != e.tensors.len() {
            return Err(PersistError::malformed(format!(
                "cache-list entry holds {} tensors, its children name {used}",
                e.tensors.len()
            )));
        }
        Ok(AnyCache::List(children))
    }

    /// The persisted cache of an entry (kind routed, state and floor validated).
    pub fn decode(&self, e: &Entry) -> Result<Persisted> {
        let cache = self.decode_cache(e)?;
        let kind = cache.storage_kind();
        if kind.as_str() != e.storage_kind {
            return Err(PersistError::malformed(format!("entry of kind {} decoded as {kind}", e.storage_kind)));
        }
        check_floor(e.minimum_reusable_offset, cache.offset())?;
        Ok(Persisted { cache, minimum_reusable_offset: e.minimum_reusable_offset })
    }
}

/// Mutation hook `Mutant::FloorNotPersisted`.
fn floor_dropped() -> bool {
    kvsim_cache::fault!(FloorNotPersisted)
}

fn check_floor(floor: usize, offset: usize) -> Result<()> {
    if floor > offset {
        Err(PersistError::InvalidFloor { floor, offset })
    } else {
        Ok(())
    }
}

/// The spec and window every attention codec stores.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SpecHeader {
    heads_kv: usize,
    head_dim: usize,
    dtype: KvDtype,
    max_size: Option<usize>,
}

impl SpecHeader {
    fn of(spec: KvSpec, max_size: Option<usize>) -> Self {
        SpecHeader { heads_kv: spec.heads_kv, head_dim: spec.head_dim, dtype: spec.dtype, max_size }
    }

    fn spec(&self) -> KvSpec {
        KvSpec { heads_kv: self.heads_kv, head_dim: self.head_dim, dtype: self.dtype }
    }
}

fn kv_dtype(d: KvDtype) -> TensorDtype {
    match d {
        KvDtype::F32 => TensorDtype::F32,
        KvDtype::Bf16 => TensorDtype::BF16,
    }
}

/// The tensor names of a storage's planes, in plane order.
fn plane_names(storage: &Storage) -> &'static [&'static str] {
    match storage {
        Storage::Plain => &["keys", "values"],
        Storage::Affine(_) => {
            &["keys.packed", "keys.scales", "keys.biases", "values.packed", "values.scales", "values.biases"]
        }
    }
}

/// The stored planes of an entry, each checked against the storage's plane layout (dtype, `[rows, H_kv, L, w]`,
/// one `L` for all); returns them and `L`.
fn planes_of<'a>(e: &'a Entry, spec: &KvSpec, storage: &Storage, rows: usize) -> Result<(Vec<&'a HostTensor>, usize)> {
    let mut len = None;
    let mut out = vec![];
    for (name, (w, dt)) in plane_names(storage).iter().zip(storage.plane_layout(spec)) {
        let t = e.tensor(name)?;
        let want = TensorDtype::from_mlx(dt).ok_or_else(|| PersistError::malformed(format!("{name}: dtype {dt:?}")))?;
        if t.dtype != want {
            return Err(PersistError::Dtype {
                name: (*name).into(),
                expected: want.to_string(),
                found: t.dtype.to_string(),
            });
        }
        let [b, h, c, d] = t.dims4(name)?;
        if b != rows || h != spec.heads_kv || d != w {
            return Err(PersistError::shape(
                *name,
                format!("shape {:?}, expected [{rows}, {}, L, {w}]", t.shape, spec.heads_kv),
            ));
        }
        if *len.get_or_insert(c) != c {
            return Err(PersistError::shape(*name, format!("{c} columns, the first plane has {}", len.unwrap_or(0))));
        }
        out.push(t);
    }
    Ok((out, len.unwrap_or(0)))
}

fn state_of<T: for<'de> Deserialize<'de>>(e: &Entry) -> Result<T> {
    serde_json::from_value(e.state.clone())
        .map_err(|err| PersistError::malformed(format!("state of {} entry: {err}", e.storage_kind)))
}

/// Host copies of every plane's columns `[0, n)`, named (`n = 0` or no buffer: empty `[rows, H, 0, w]` tensors).
fn host_cols(
    buf: Option<Vec<mlx_rs::Array>>,
    spec: &KvSpec,
    storage: &Storage,
    rows: usize,
    n: usize,
) -> Result<Vec<(String, HostTensor)>> {
    let names = plane_names(storage);
    match buf {
        Some(planes) if n > 0 => names
            .iter()
            .zip(planes.iter())
            .map(|(name, a)| Ok((name.to_string(), HostTensor::from_array(a)?.cols(name, 0, n)?)))
            .collect(),
        _ => names
            .iter()
            .zip(storage.plane_layout(spec))
            .map(|(name, (w, dt))| {
                let dtype = TensorDtype::from_mlx(dt).unwrap_or(kv_dtype(spec.dtype));
                Ok((name.to_string(), HostTensor { dtype, shape: vec![rows, spec.heads_kv, 0, w], data: Vec::new() }))
            })
            .collect(),
    }
}

/// The quantized storage a codec's kind names, checked against the stored `quant` state.
fn storage_of(quantized: bool, kind: &str, quant: Option<QuantSpec>) -> Result<Storage> {
    let named = StorageKind::new(kind).storage()?;
    let stored = quant.map_or(Storage::Plain, Storage::Affine);
    if named != stored || named.quant().is_some() != quantized {
        return Err(PersistError::malformed(format!("entry of kind {kind} with quant state {quant:?}")));
    }
    Ok(stored)
}

/// Whether `kind` is a quantized kind with this route (`serial` or row batch, `rotating` or linear).
fn quant_kind(kind: &str, rotating: bool, rows: bool) -> bool {
    let k = StorageKind::new(kind);
    let route_ok = match k.route() {
        Ok(KindRoute::RowBatch { rotating: r }) => rows && r == rotating,
        Ok(KindRoute::Serial { rotating: r }) => !rows && r == rotating,
        Err(_) => false,
    };
    route_ok && k.storage().is_ok_and(|s| s.quant().is_some())
}

/// `kv-plain` and `rotating-plain` (and the quantized `kv:quant:*`, `kv:rotating-quant:*`): one serial cache.
struct SerialCodec {
    rotating: bool,
    quantized: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SerialState {
    #[serde(flatten)]
    spec: SpecHeader,
    offset: usize,
    idx: usize,
    last_concat: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    quant: Option<QuantSpec>,
}

impl Codec for SerialCodec {
    fn storage_kind(&self) -> &'static str {
        match (self.rotating, self.quantized) {
            (false, false) => KV_PLAIN,
            (true, false) => ROTATING_PLAIN,
            (false, true) => "kv:quant:<bits>:<group>",
            (true, true) => "kv:rotating-quant:<bits>:<group>",
        }
    }

    fn handles(&self, kind: &str) -> bool {
        if self.quantized {
            quant_kind(kind, self.rotating, false)
        } else {
            kind == self.storage_kind()
        }
    }

    fn encode(&self, cache: &AnyCache) -> Result<Entry> {
        let AnyCache::Serial(c) = cache else {
            return Err(PersistError::malformed(format!("{} codec given a row batch", self.storage_kind())));
        };
        let s = c.state();
        let n = if whole_buffer() { c.cap() } else { s.len };
        let tensors = host_cols(c.buffer_planes(), &c.spec(), &c.storage(), 1, n)?;
        let state = SerialState {
            spec: SpecHeader::of(c.spec(), c.max_size()),
            offset: s.offset,
            idx: s.idx,
            last_concat: s.last_concat,
            quant: c.storage().quant(),
        };
        Ok(Entry {
            storage_kind: c.storage_kind().0,
            state: serde_json::to_value(state).map_err(|e| PersistError::malformed(e.to_string()))?,
            tensors,
            minimum_reusable_offset: 0,
        })
    }

    fn decode(&self, e: &Entry) -> Result<AnyCache> {
        let st: SerialState = state_of(e)?;
        if st.spec.max_size.is_some() != self.rotating {
            return Err(PersistError::malformed(format!(
                "{} entry with max_size {:?}",
                e.storage_kind, st.spec.max_size
            )));
        }
        let spec = st.spec.spec();
        let storage = storage_of(self.quantized, &e.storage_kind, st.quant)?;
        storage.validate(&spec)?;
        let (planes, len) = planes_of(e, &spec, &storage, 1)?;
        let ring = RingState { offset: st.offset, len, idx: st.idx, last_concat: st.last_concat };
        let arrays = planes.iter().map(|t| t.to_array()).collect::<Result<Vec<_>>>()?;
        let cache = SerialCache::adopt_planes(spec, st.spec.max_size, storage, arrays, ring)?;
        Ok(AnyCache::Serial(cache))
    }
}

/// `kv-plain+row-batch` and `rotating-plain+row-batch` (and the quantized kinds' row batches): a batch of rows, each
/// keeping its columns and phase.
struct RowsCodec {
    rotating: bool,
    quantized: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RowHeader {
    offset: usize,
    len: usize,
    idx: usize,
    last_concat: Option<usize>,
    base: usize,
    pending: Option<usize>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct RowsState {
    #[serde(flatten)]
    spec: SpecHeader,
    rows: Vec<RowHeader>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    quant: Option<QuantSpec>,
}

impl Codec for RowsCodec {
    fn storage_kind(&self) -> &'static str {
        match (self.rotating, self.quantized) {
            (false, false) => "kv-plain+row-batch",
            (true, false) => "rotating-plain+row-batch",
            (false, true) => "kv:quant:<bits>:<group>+row-batch",
            (true, true) => "kv:rotating-quant:<bits>:<group>+row-batch",
        }
    }

    fn handles(&self, kind: &str) -> bool {
        if self.quantized {
            quant_kind(kind, self.rotating, true)
        } else {
            kind == self.storage_kind()
        }
    }

    fn encode(&self, cache: &AnyCache) -> Result<Entry> {
        let AnyCache::Rows(b) = cache else {
            return Err(PersistError::malformed(format!("{} codec given a serial cache", self.storage_kind())));
        };
        let width = b.row_states().iter().map(|r| r.ring.len).max().unwrap_or(0);
        let tensors = host_cols(b.buffer_planes(), &b.spec(), &b.storage(), b.rows(), width)?;
        let rows = b
            .row_states()
            .iter()
            .map(|r| RowHeader {
                offset: r.ring.offset,
                len: r.ring.len,
                idx: r.ring.idx,
                last_concat: r.ring.last_concat,
                base: r.base,
                pending: r.pending,
            })
            .collect();
        let state = RowsState { spec: SpecHeader::of(b.spec(), b.max_size()), rows, quant: b.storage().quant() };
        Ok(Entry {
            storage_kind: b.storage_kind().0,
            state: serde_json::to_value(state).map_err(|e| PersistError::malformed(e.to_string()))?,
            tensors,
            minimum_reusable_offset: 0,
        })
    }

    fn decode(&self, e: &Entry) -> Result<AnyCache> {
        let st: RowsState = state_of(e)?;
        if st.spec.max_size.is_some() != self.rotating {
            return Err(PersistError::malformed(format!(
                "{} entry with max_size {:?}",
                e.storage_kind, st.spec.max_size
            )));
        }
        let spec = st.spec.spec();
        let storage = storage_of(self.quantized, &e.storage_kind, st.quant)?;
        storage.validate(&spec)?;
        let (planes, width) = planes_of(e, &spec, &storage, st.rows.len())?;
        let want = st.rows.iter().map(|r| r.len).max().unwrap_or(0);
        if want != width {
            return Err(PersistError::shape(
                plane_names(&storage)[0],
                format!("{width} columns stored, the rows need exactly {want}"),
            ));
        }
        let rows: Vec<RowState> = st
            .rows
            .iter()
            .map(|r| RowState {
                ring: RingState { offset: r.offset, len: r.len, idx: r.idx, last_concat: r.last_concat },
                base: r.base,
                // Mutation hook: mlx-lm 0.32.2's load loses a pending prefill's right padding.
                pending: if kvsim_cache::fault!(MlxlmLoadDropsRightPadding) { None } else { r.pending },
            })
            .collect();
        let arrays = planes.iter().map(|t| t.to_array()).collect::<Result<Vec<_>>>()?;
        let b = RowBatch::adopt_planes(spec, st.spec.max_size, storage, arrays, rows)?;
        Ok(AnyCache::Rows(b))
    }
}

/// `ssm`: the gated-DeltaNet recurrent cache, every row. Tensors `conv` `[B, K-1, conv_dim]` (input dtype) and
/// `recurrent` `[B, Hv, Dv, Dk]` (f32), whole (the state does not grow); state: the spec and per-row `offsets`. A
/// cache with a pending prefill or an armed speculative round is refused (neither is a resting state: finalize or
/// resolve the round first), so a loaded cache is always at rest.
struct SsmCodec;

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SsmState {
    kernel: usize,
    heads_k: usize,
    heads_v: usize,
    dk: usize,
    dv: usize,
    dtype: KvDtype,
    offsets: Vec<usize>,
}

/// A whole paged store (`kv:paged-rows:<block_size>`, `kv:paged-rows:<block_size>:quant:<bits>:<group>`): its
/// state is [`PagedParts`] (spec, pool, storage, reference counts, free list in stack order, every sequence's table,
/// offset, token ids and last window, the rows, the prefix index's entries and clock); its tensors the pool planes
/// `[1, H_kv, capacity * block_size, width]` (absent before the first write), named as every other entry of the
/// storage names them (`keys`, `values`; or `keys.packed`, `keys.scales`, ... for affine storage). Free blocks are stored as they lie (nothing reads them). Loading checks the
/// planes' shape and dtype on the host, then every count, table, row and index entry against the others
/// ([`PagedStore::from_parts`]): an impossible store is a typed error. A store with an armed speculative round is
/// not saved.
struct PagedCodec;

impl Codec for PagedCodec {
    fn storage_kind(&self) -> &'static str {
        "kv:paged-rows:<block_size>[:quant:<bits>:<group>]"
    }

    fn handles(&self, kind: &str) -> bool {
        parse_paged(&StorageKind::new(kind)).is_some_and(|p| p.rows)
    }

    fn encode(&self, cache: &AnyCache) -> Result<Entry> {
        let AnyCache::Paged(st) = cache else {
            return Err(PersistError::malformed("paged codec given another cache"));
        };
        if st.in_round() {
            return Err(PersistError::unsupported("a paged store with an armed speculative round"));
        }
        let (parts, planes) = st.to_parts()?;
        let tensors = match planes {
            None => vec![],
            Some(p) => plane_names(&parts.storage)
                .iter()
                .zip(&p)
                .map(|(n, a)| Ok(((*n).to_string(), HostTensor::from_array(a)?)))
                .collect::<Result<Vec<_>>>()?,
        };
        Ok(Entry {
            storage_kind: st.rows_storage_kind().to_string(),
            state: serde_json::to_value(parts).map_err(|e| PersistError::malformed(e.to_string()))?,
            tensors,
            minimum_reusable_offset: 0,
        })
    }

    fn decode(&self, e: &Entry) -> Result<AnyCache> {
        let parts: PagedParts = state_of(e)?;
        let kind = kvsim_cache::paged_kind(parts.pool.block_size, true, parts.storage.quant()).to_string();
        if kind != e.storage_kind {
            return Err(PersistError::malformed(format!("a {} entry holding a pool of {kind}", e.storage_kind)));
        }
        let cap = parts.refs.len();
        let names = plane_names(&parts.storage);
        let planes = if cap == 0 && e.tensors.is_empty() {
            None
        } else {
            let cols = cap.checked_mul(parts.pool.block_size).ok_or_else(|| PersistError::malformed("pool size"))?;
            let mut out = vec![];
            for (name, (w, dt)) in names.iter().zip(parts.storage.plane_layout(&parts.spec)) {
                let t = e.tensor(name)?;
                let want_dtype = TensorDtype::from_mlx(dt)
                    .ok_or_else(|| PersistError::malformed(format!("{name}: dtype {dt:?}")))?;
                if t.dtype != want_dtype {
                    return Err(PersistError::Dtype {
                        name: (*name).into(),
                        expected: want_dtype.to_string(),
                        found: t.dtype.to_string(),
                    });
                }
                let want = [1, parts.spec.heads_kv, cols, w];
                if t.dims4(name)? != want {
                    return Err(PersistError::Shape {
                        name: (*name).into(),
                        what: format!("{:?}, the pool of {cap} blocks needs {want:?}", t.shape),
                    });
                }
                out.push(t.to_array()?);
            }
            if e.tensors.len() != names.len() {
                return Err(PersistError::malformed(format!("a paged entry with {} tensors", e.tensors.len())));
            }
            Some(out)
        };
        Ok(AnyCache::Paged(PagedStore::from_parts(parts, planes)?))
    }
}

impl Codec for SsmCodec {
    fn storage_kind(&self) -> &'static str {
        SSM
    }

    fn encode(&self, cache: &AnyCache) -> Result<Entry> {
        let AnyCache::Ssm(c) = cache else {
            return Err(PersistError::malformed("ssm codec given an attention cache"));
        };
        if c.is_pending() || c.in_round() {
            return Err(PersistError::unsupported("an ssm cache with a pending prefill or an armed round"));
        }
        let sp = c.spec();
        let state = SsmState {
            kernel: sp.kernel,
            heads_k: sp.heads_k,
            heads_v: sp.heads_v,
            dk: sp.dk,
            dv: sp.dv,
            dtype: sp.dtype,
            offsets: c.offsets().to_vec(),
        };
        Ok(Entry {
            storage_kind: SSM.to_string(),
            state: serde_json::to_value(state).map_err(|e| PersistError::malformed(e.to_string()))?,
            tensors: vec![
                ("conv".into(), HostTensor::from_array(c.conv())?),
                ("recurrent".into(), HostTensor::from_array(c.recurrent())?),
            ],
            minimum_reusable_offset: 0,
        })
    }

    fn decode(&self, e: &Entry) -> Result<AnyCache> {
        let st: SsmState = state_of(e)?;
        let spec = SsmSpec {
            kernel: st.kernel,
            heads_k: st.heads_k,
            heads_v: st.heads_v,
            dk: st.dk,
            dv: st.dv,
            dtype: st.dtype,
        };
        let rows = st.offsets.len();
        let (conv, rec) = (e.tensor("conv")?, e.tensor("recurrent")?);
        for (name, t, dtype) in [("conv", conv, kv_dtype(st.dtype)), ("recurrent", rec, TensorDtype::F32)] {
            if t.dtype != dtype {
                return Err(PersistError::Dtype {
                    name: name.into(),
                    expected: dtype.to_string(),
                    found: t.dtype.to_string(),
                });
            }
        }
        // Shapes are checked on the host before any array exists (checked arithmetic: a lying header is an error).
        let dims = |v: &[usize]| v.iter().try_fold(1usize, |a, &x| a.checked_mul(x));
        let conv_dim = st
            .heads_k
            .checked_mul(st.dk)
            .and_then(|x| x.checked_mul(2))
            .and_then(|x| x.checked_add(st.heads_v.checked_mul(st.dv)?));
        let want_conv = conv_dim.map(|c| vec![rows, st.kernel.saturating_sub(1), c]);
        let want_rec = vec![rows, st.heads_v, st.dv, st.dk];
        if st.kernel == 0 || want_conv.as_deref() != Some(conv.shape.as_slice()) || dims(&conv.shape).is_none() {
            return Err(PersistError::shape("conv", format!("shape {:?} for {rows} rows of {spec:?}", conv.shape)));
        }
        if rec.shape != want_rec || dims(&rec.shape).is_none() {
            return Err(PersistError::shape("recurrent", format!("shape {:?}, expected {want_rec:?}", rec.shape)));
        }
        let c = SsmCache::from_states(spec, conv.to_array()?, rec.to_array()?, st.offsets)?;
        Ok(AnyCache::Ssm(c))
    }
}

/// One child of a `cache-list` entry: its kind, its codec state, the names of its tensors (stored in the list's
/// entry as `<child index>.<name>`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ListChild {
    storage_kind: String,
    state: serde_json::Value,
    tensors: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct ListState {
    children: Vec<ListChild>,
}

/// `kv-chunked:<chunk_size>`: the linear cache's entry (`kv-plain`'s tensors and state: the live columns
/// `[start_position, offset)`) plus `chunk_size`; the kind's number must equal the stored `chunk_size`.
struct ChunkedCodec;

impl Codec for ChunkedCodec {
    fn storage_kind(&self) -> &'static str {
        "kv-chunked:<chunk_size>"
    }

    fn handles(&self, kind: &str) -> bool {
        kind.strip_prefix(CHUNKED_PREFIX)
            .and_then(|n| n.parse::<usize>().ok())
            .is_some_and(|n| kind == format!("{CHUNKED_PREFIX}{n}"))
    }

    fn encode(&self, cache: &AnyCache) -> Result<Entry> {
        let AnyCache::Chunked(c) = cache else {
            return Err(PersistError::malformed("chunked codec given another cache"));
        };
        let mut e = SerialCodec { rotating: false, quantized: false }.encode(&AnyCache::Serial(c.cache().clone()))?;
        if let serde_json::Value::Object(m) = &mut e.state {
            m.insert("chunk_size".into(), serde_json::json!(c.chunk_size()));
        }
        e.storage_kind = c.storage_kind().0;
        Ok(e)
    }

    fn decode(&self, e: &Entry) -> Result<AnyCache> {
        let mut state = e.state.clone();
        let chunk = match &mut state {
            serde_json::Value::Object(m) => m.remove("chunk_size"),
            _ => None,
        };
        let chunk: usize = chunk
            .and_then(|v| v.as_u64())
            .and_then(|v| usize::try_from(v).ok())
            .ok_or_else(|| PersistError::Missing { name: format!("{}.chunk_size", e.storage_kind) })?;
        if e.storage_kind != format!("{CHUNKED_PREFIX}{chunk}") {
            return Err(PersistError::malformed(format!("entry of kind {} with chunk_size {chunk}", e.storage_kind)));
        }
        let inner =
            Entry { storage_kind: KV_PLAIN.into(), state, tensors: e.tensors.clone(), minimum_reusable_offset: 0 };
        let AnyCache::Serial(c) = (SerialCodec { rotating: false, quantized: false }).decode(&inner)? else {
            return Err(PersistError::malformed("chunked entry decoded as a batch"));
        };
        Ok(AnyCache::Chunked(ChunkedKvCache::from_cache(c, chunk)?))
    }
}

/// `kv:bf16-first-quant:..` and `kv:bf16-first-rotating-quant:..`: a bf16-first lego. Its storage is stored by the
/// serial codec of the storage it holds now (plain before its conversion, affine after: the planes as MLX wrote
/// them), wrapped with the lifecycle (`converted_at`, the lego's floor). The kind names the transition (window, bits,
/// group, start); decoding checks the storage against it and the lifecycle through [`Bf16FirstCache::restore`] (a
/// state the lifecycle cannot reach is an error). A lego with an armed round is refused (not a resting state).
struct Bf16FirstCodec {
    rotating: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Bf16FirstState {
    storage: String,
    inner: serde_json::Value,
    converted_at: Option<usize>,
    floor: usize,
}

impl Codec for Bf16FirstCodec {
    fn storage_kind(&self) -> &'static str {
        if self.rotating {
            "kv:bf16-first-rotating-quant:<W>:<bits>:<group>:<start>"
        } else {
            "kv:bf16-first-quant:<bits>:<group>:<start>"
        }
    }

    fn handles(&self, kind: &str) -> bool {
        parse_bf16_first(&StorageKind::new(kind)).is_some_and(|d| d.max_size.is_some() == self.rotating)
    }

    fn encode(&self, cache: &AnyCache) -> Result<Entry> {
        let AnyCache::Bf16First(c) = cache else {
            return Err(PersistError::malformed(format!("{} codec given another cache", self.storage_kind())));
        };
        if c.in_round() {
            return Err(PersistError::unsupported("a bf16-first cache with an armed round"));
        }
        let codec = SerialCodec { rotating: self.rotating, quantized: c.converted_at().is_some() };
        let inner = codec.encode(&AnyCache::Serial(c.inner().clone()))?;
        let state = Bf16FirstState {
            storage: inner.storage_kind,
            inner: inner.state,
            converted_at: c.converted_at(),
            floor: c.minimum_reusable_offset(),
        };
        Ok(Entry {
            storage_kind: c.lego_kind().0,
            state: serde_json::to_value(state).map_err(|e| PersistError::malformed(e.to_string()))?,
            tensors: inner.tensors,
            minimum_reusable_offset: 0,
        })
    }

    fn decode(&self, e: &Entry) -> Result<AnyCache> {
        let kind = parse_bf16_first(&StorageKind::new(e.storage_kind.as_str()))
            .filter(|d| d.max_size.is_some() == self.rotating)
            .ok_or_else(|| PersistError::UnknownKind { kind: e.storage_kind.clone() })?;
        let st: Bf16FirstState = state_of(e)?;
        let codec = SerialCodec { rotating: self.rotating, quantized: st.converted_at.is_some() };
        if !codec.handles(&st.storage) {
            return Err(PersistError::malformed(format!(
                "{} entry holding {} storage (converted at {:?})",
                e.storage_kind, st.storage, st.converted_at
            )));
        }
        let inner =
            Entry { storage_kind: st.storage, state: st.inner, tensors: e.tensors.clone(), minimum_reusable_offset: 0 };
        let AnyCache::Serial(cache) = codec.decode(&inner)? else {
            return Err(PersistError::malformed("bf16-first entry decoded as a batch"));
        };
        if cache.max_size() != kind.max_size {
            return Err(PersistError::malformed(format!(
                "{} entry holding a cache of window {:?}",
                e.storage_kind,
                cache.max_size()
            )));
        }
        let t = Transition { start: kind.start, quant: kind.quant };
        Ok(AnyCache::Bf16First(Bf16FirstCache::restore(cache, t, st.converted_at, st.floor)?))
    }
}

/// Mutation hook `Mutant::CodecSavesWholeBuffer`: the serial codec saves every allocated column, not `[0, len)`.
fn whole_buffer() -> bool {
    kvsim_cache::fault!(CodecSavesWholeBuffer)
}

/// The storage kind of row batches whose rows have `serial` kind (for codecs of other families).
pub fn row_batch_kind(serial: &str) -> String {
    format!("{serial}{ROW_BATCH_MARKER}")
}
