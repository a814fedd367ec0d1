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
//!
//! Nothing past the live columns is stored (a linear cache's spare capacity is zeros kvsim never reads), so the file
//! size follows the content. Every field that decides a later operation is stored: the ring phase (`idx`), what a
//! bypass trim may undo (`last_concat`), a pending prefill's per-row remaining positions (`pending`, so a loaded
//! batch can still `finalize`: mlx-lm 0.32.2's files lose `_right_padding` / `_lengths`, wave2 anchors d.2).
//!
//! Guarantee: `decode(encode(c))` has the same spec, window, per-row state and live bytes as `c`, so every later
//! operation (decode, window, append, trim, prepare/finalize, extract, filter, join) does exactly what it does on
//! `c` (checked by the continuation tests and the simulator's save/restore op). Loading validates the state
//! ([`crate::cache::RingState::validate`], `len <= offset`, shapes, dtypes) before building anything: an invalid
//! entry is a typed error, never a cache.
//!
//! The reuse floor (`minimum_reusable_offset`, wave2 anchors d.1) is stored beside every entry and validated on load
//! to lie in `[0, offset]`; for the plain layouts it is whatever the caller attached (0 by default).

use serde::{Deserialize, Serialize};

use super::error::{PersistError, Result};
use super::tensor::{HostTensor, TensorDtype};
use crate::cache::mutation::{self, Mutant};
use crate::cache::{
    KvDtype, KvSpec, RingState, RowBatch, RowState, SerialCache, SsmCache, SsmSpec, StorageKind, KV_PLAIN,
    ROTATING_PLAIN, ROW_BATCH_MARKER, SSM,
};

/// A cache of any persistable kind.
#[derive(Debug, Clone)]
pub enum AnyCache {
    Serial(SerialCache),
    Rows(RowBatch),
    /// The gated-DeltaNet recurrent cache (`ssm`), any number of rows.
    Ssm(SsmCache),
}

impl AnyCache {
    /// The cache's own storage kind (R-C-1): what the registry routes on.
    pub fn storage_kind(&self) -> StorageKind {
        match self {
            AnyCache::Serial(c) => c.storage_kind(),
            AnyCache::Rows(b) => b.storage_kind(),
            AnyCache::Ssm(c) => c.storage_kind(),
        }
    }

    /// Positions ever written (the maximum over rows for a batch).
    pub fn offset(&self) -> usize {
        match self {
            AnyCache::Serial(c) => c.offset(),
            AnyCache::Rows(b) => b.offset(),
            AnyCache::Ssm(c) => c.offset(),
        }
    }

    /// The K/V spec of an attention layout (`None` for the recurrent cache).
    pub fn spec(&self) -> Option<KvSpec> {
        match self {
            AnyCache::Serial(c) => Some(c.spec()),
            AnyCache::Rows(b) => Some(b.spec()),
            AnyCache::Ssm(_) => None,
        }
    }

    /// The window of an attention layout (`None` for a linear one and for the recurrent cache).
    pub fn max_size(&self) -> Option<usize> {
        match self {
            AnyCache::Serial(c) => c.max_size(),
            AnyCache::Rows(b) => b.max_size(),
            AnyCache::Ssm(_) => None,
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
    /// The exact storage kind string this codec handles.
    fn storage_kind(&self) -> &'static str;
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
                Box::new(SerialCodec { rotating: false }),
                Box::new(SerialCodec { rotating: true }),
                Box::new(RowsCodec { rotating: false }),
                Box::new(RowsCodec { rotating: true }),
                Box::new(SsmCodec),
            ],
        }
    }
}

impl Registry {
    /// Adds a codec (e.g. a layout family's) to the registry.
    pub fn register(&mut self, codec: Box<dyn Codec>) {
        self.codecs.push(codec);
    }

    /// The storage kinds this registry persists.
    pub fn kinds(&self) -> Vec<&'static str> {
        self.codecs.iter().map(|c| c.storage_kind()).collect()
    }

    /// The one codec of `kind`: none is [`PersistError::UnknownKind`], several [`PersistError::AmbiguousCodec`].
    pub fn codec(&self, kind: &str) -> Result<&dyn Codec> {
        let mut it = self.codecs.iter().filter(|c| c.storage_kind() == kind);
        match (it.next(), it.count()) {
            (Some(c), 0) => Ok(c.as_ref()),
            (None, _) => Err(PersistError::UnknownKind { kind: kind.to_string() }),
            (Some(_), n) => Err(PersistError::AmbiguousCodec { kind: kind.to_string(), matches: n + 1 }),
        }
    }

    /// The entry of a persisted cache (floor validated).
    pub fn encode(&self, p: &Persisted) -> Result<Entry> {
        let kind = p.cache.storage_kind();
        let mut e = self.codec(kind.as_str())?.encode(&p.cache)?;
        check_floor(p.minimum_reusable_offset, p.cache.offset())?;
        e.minimum_reusable_offset = if floor_dropped() { 0 } else { p.minimum_reusable_offset };
        Ok(e)
    }

    /// The persisted cache of an entry (kind routed, state and floor validated).
    pub fn decode(&self, e: &Entry) -> Result<Persisted> {
        let cache = self.codec(&e.storage_kind)?.decode(e)?;
        let kind = cache.storage_kind();
        if kind.as_str() != e.storage_kind {
            return Err(PersistError::malformed(format!("entry of kind {} decoded as {kind}", e.storage_kind)));
        }
        check_floor(e.minimum_reusable_offset, cache.offset())?;
        Ok(Persisted { cache, minimum_reusable_offset: e.minimum_reusable_offset })
    }
}

/// Mutation hook [`Mutant::FloorNotPersisted`].
fn floor_dropped() -> bool {
    mutation::is(Mutant::FloorNotPersisted)
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

/// Checks a stored K or V tensor against the spec and row count; returns its column count.
fn check_buffer(name: &str, t: &HostTensor, spec: &KvSpec, rows: usize) -> Result<usize> {
    if t.dtype != kv_dtype(spec.dtype) {
        return Err(PersistError::Dtype {
            name: name.into(),
            expected: kv_dtype(spec.dtype).to_string(),
            found: t.dtype.to_string(),
        });
    }
    let [b, h, c, d] = t.dims4(name)?;
    if b != rows || h != spec.heads_kv || d != spec.head_dim {
        return Err(PersistError::shape(
            name,
            format!("shape {:?}, expected [{rows}, {}, L, {}]", t.shape, spec.heads_kv, spec.head_dim),
        ));
    }
    Ok(c)
}

fn state_of<T: for<'de> Deserialize<'de>>(e: &Entry) -> Result<T> {
    serde_json::from_value(e.state.clone())
        .map_err(|err| PersistError::malformed(format!("state of {} entry: {err}", e.storage_kind)))
}

/// Host copies of a buffer's columns `[0, n)` (`n = 0`: an empty `[rows, H, 0, D]` tensor).
fn host_cols(
    buf: Option<(mlx_rs::Array, mlx_rs::Array)>,
    spec: &KvSpec,
    rows: usize,
    n: usize,
) -> Result<[HostTensor; 2]> {
    match buf {
        Some((k, v)) if n > 0 => {
            let mut out = Vec::with_capacity(2);
            for (name, a) in [("keys", k), ("values", v)] {
                let t = HostTensor::from_array(&a)?;
                out.push(t.cols(name, 0, n)?);
            }
            let v = out.pop().expect("two tensors");
            let k = out.pop().expect("two tensors");
            Ok([k, v])
        }
        _ => {
            let empty = HostTensor {
                dtype: kv_dtype(spec.dtype),
                shape: vec![rows, spec.heads_kv, 0, spec.head_dim],
                data: Vec::new(),
            };
            Ok([empty.clone(), empty])
        }
    }
}

/// `kv-plain` and `rotating-plain`: one serial cache.
struct SerialCodec {
    rotating: bool,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct SerialState {
    #[serde(flatten)]
    spec: SpecHeader,
    offset: usize,
    idx: usize,
    last_concat: Option<usize>,
}

impl Codec for SerialCodec {
    fn storage_kind(&self) -> &'static str {
        if self.rotating {
            ROTATING_PLAIN
        } else {
            KV_PLAIN
        }
    }

    fn encode(&self, cache: &AnyCache) -> Result<Entry> {
        let AnyCache::Serial(c) = cache else {
            return Err(PersistError::malformed(format!("{} codec given a row batch", self.storage_kind())));
        };
        let s = c.state();
        let n = if whole_buffer() { c.cap() } else { s.len };
        let [k, v] = host_cols(c.buffers(), &c.spec(), 1, n)?;
        let state = SerialState {
            spec: SpecHeader::of(c.spec(), c.max_size()),
            offset: s.offset,
            idx: s.idx,
            last_concat: s.last_concat,
        };
        Ok(Entry {
            storage_kind: self.storage_kind().to_string(),
            state: serde_json::to_value(state).map_err(|e| PersistError::malformed(e.to_string()))?,
            tensors: vec![("keys".into(), k), ("values".into(), v)],
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
        let (k, v) = (e.tensor("keys")?, e.tensor("values")?);
        let len = check_buffer("keys", k, &spec, 1)?;
        if check_buffer("values", v, &spec, 1)? != len {
            return Err(PersistError::shape("values", "keys and values differ in length"));
        }
        let ring = RingState { offset: st.offset, len, idx: st.idx, last_concat: st.last_concat };
        let cache = SerialCache::adopt(spec, st.spec.max_size, k.to_array()?, v.to_array()?, ring)?;
        Ok(AnyCache::Serial(cache))
    }
}

/// `kv-plain+row-batch` and `rotating-plain+row-batch`: a batch of rows, each keeping its columns and phase.
struct RowsCodec {
    rotating: bool,
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
}

impl Codec for RowsCodec {
    fn storage_kind(&self) -> &'static str {
        if self.rotating {
            "rotating-plain+row-batch"
        } else {
            "kv-plain+row-batch"
        }
    }

    fn encode(&self, cache: &AnyCache) -> Result<Entry> {
        let AnyCache::Rows(b) = cache else {
            return Err(PersistError::malformed(format!("{} codec given a serial cache", self.storage_kind())));
        };
        let width = b.row_states().iter().map(|r| r.ring.len).max().unwrap_or(0);
        let [k, v] = host_cols(b.buffers(), &b.spec(), b.rows(), width)?;
        let rows = b
            .row_states()
            .iter()
            .map(|r| RowHeader {
                offset: r.ring.offset,
                len: r.ring.len,
                idx: r.ring.idx,
                last_concat: r.ring.last_concat,
                base: r.base,
                pending: if pending_dropped() { None } else { r.pending },
            })
            .collect();
        let state = RowsState { spec: SpecHeader::of(b.spec(), b.max_size()), rows };
        Ok(Entry {
            storage_kind: self.storage_kind().to_string(),
            state: serde_json::to_value(state).map_err(|e| PersistError::malformed(e.to_string()))?,
            tensors: vec![("keys".into(), k), ("values".into(), v)],
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
        let (k, v) = (e.tensor("keys")?, e.tensor("values")?);
        let width = check_buffer("keys", k, &spec, st.rows.len())?;
        if check_buffer("values", v, &spec, st.rows.len())? != width {
            return Err(PersistError::shape("values", "keys and values differ in length"));
        }
        let want = st.rows.iter().map(|r| r.len).max().unwrap_or(0);
        if want != width {
            return Err(PersistError::shape("keys", format!("{width} columns stored, the rows need exactly {want}")));
        }
        let rows: Vec<RowState> = st
            .rows
            .iter()
            .map(|r| RowState {
                ring: RingState { offset: r.offset, len: r.len, idx: r.idx, last_concat: r.last_concat },
                base: r.base,
                pending: r.pending,
            })
            .collect();
        let b = RowBatch::adopt(spec, st.spec.max_size, k.to_array()?, v.to_array()?, rows)?;
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

/// Saves only the live columns (a "whole buffer" mutant is not in the catalog yet: the simulator persists extracted
/// rows, whose buffers hold exactly their live columns, so it could not catch one).
fn whole_buffer() -> bool {
    false
}

/// A pending prefill is always persisted (mlx-lm 0.32.2's files lose it; kvsim's keep it).
fn pending_dropped() -> bool {
    false
}

/// The storage kind of row batches whose rows have `serial` kind (for codecs of other families).
pub fn row_batch_kind(serial: &str) -> String {
    format!("{serial}{ROW_BATCH_MARKER}")
}
