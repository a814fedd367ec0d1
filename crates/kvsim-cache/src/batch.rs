//! Rows (ARCHITECTURE.md "Rows"): [`RowBatch`], which is [`BatchRotatingKvCache`] with a window `W` (R-BROT-*) and
//! [`BatchKvCache`] with `W = ∞`.
//!
//! The batch stores `[B, H_kv, cap, D]`. Row `r` occupies physical columns `[0, len_r)` **exactly as its serial ring
//! would**: every write applies the serial rules of [`super::ring`] to each row's own [`RingState`]. Decode writes are
//! one scatter (`put_along_axis` with per-row columns); window writes and oversize drops are one gather
//! (`take_along_axis` over `[buffer ++ block ++ zero column]`), so row `r`'s new columns are its kept temporal
//! columns followed by its real block positions. Padding is never stored: columns `[len_r, cap)` of a row are
//! never visible.
//!
//! Capacity: the buffer's `cap` follows the live rows, never the longest row the batch once held (see
//! [`RowBatch`], "Capacity"). The decode step cuts it to the bound as it drops an oversize; `filter`, the trims and
//! `adopt` cut it when they leave it wider.
//!
//! Files: this one holds the type, its constructors (merge, join, adopt), the row operations (filter, extract,
//! prepare/finalize, trims), the window writes and reads and the views; `batch/decode.rs` the decode step (its
//! host bookkeeping, write and read, committed spans); `batch/capacity.rs` the capacity bound and `held_bytes`.

use mlx_rs::Array;

use super::error::{invalid, shape, CacheError};
#[cfg(feature = "faults")]
use super::faults;
use super::kind::{KindRoute, StorageKind};
use super::mask::{FamilyKey, MaskKey, MaskKind, MaskUse, Masks};
use super::quant::{attend_planes, check_planes_shape, QuantSpec, Storage};
use super::ring::{
    check_encoder_window, plan_trim, render_cells, temporal_view_columns, validate_max_size, window_keep, Buf,
    DecodePhase, RingState, SerialCache,
};
use super::training::TrainingCache;
use super::util::{check_kv, check_q, cols, index_array, ncols, rows as row_slice};
use super::{KvSpec, Result};

/// One row of a [`RowBatch`].
///
/// - `ring`: the row's serial state (its physical columns and phase).
/// - `base`: the position at which the row's batch history starts (for [`RowBatch::left_padding`] only).
/// - `pending`: during a prepared (right-padded) prefill, the real positions still to come for this row.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RowState {
    /// The row's serial state (offset, len, ring head `idx`, `last_concat`): equal to its solo twin's.
    pub ring: RingState,
    /// The position the row's batch history starts at (`offset - len` when merged or joined from a serial cache;
    /// `<= offset`); read only by [`RowBatch::left_padding`].
    pub base: usize,
    /// `Some(n)` while a prepared prefill is pending: `n` real positions still to come for this row (R-BROT-2).
    pub pending: Option<usize>,
}

/// A source of rows for [`RowBatch::join`] (borrowed; R-BROT-7).
#[derive(Debug, Clone)]
pub enum JoinSource<'a> {
    /// These rows of a running batch, in this order.
    Rows(&'a RowBatch, Vec<usize>),
    /// A serial cache, as one row.
    Serial(&'a SerialCache),
    /// A training cache: routed like every source, and refused ([`CacheError::TrainingOnly`]): training caches are
    /// never admitted or merged (R-TRN-1).
    Training(&'a TrainingCache),
}

impl JoinSource<'_> {
    /// The kind the router reads (R-BROT-10).
    pub fn storage_kind(&self) -> StorageKind {
        match self {
            JoinSource::Rows(b, _) => b.storage_kind(),
            JoinSource::Serial(s) => s.storage_kind(),
            JoinSource::Training(t) => t.storage_kind(),
        }
    }

    fn spec_window_storage(&self) -> (KvSpec, Option<usize>, Storage) {
        match self {
            JoinSource::Rows(b, _) => (b.spec, b.max_size, b.storage),
            JoinSource::Serial(s) => (s.spec(), s.max_size(), s.storage()),
            JoinSource::Training(t) => (t.spec(), t.window_size(), super::quant::Storage::Plain),
        }
    }
}

#[derive(Debug, Clone)]
enum RopeRepr {
    Snapshot(Vec<i32>),
    /// Mutant only: reads whatever the last mutated batch of this thread published (`faults::publish_offsets`).
    #[cfg(feature = "faults")]
    Live,
}

/// Per-row RoPE positions (R-BROT-3): a **value** (a snapshot taken when [`RowBatch::rope_offsets`] was called),
/// never an alias of cache state (bug catalog #3). Only the mutant `Mutant::OffsetAliasing` makes it a live view.
#[derive(Debug, Clone)]
pub struct RopeOffsets(RopeRepr);

impl RopeOffsets {
    /// The positions, one per row.
    pub fn values(&self) -> Vec<i32> {
        match &self.0 {
            RopeRepr::Snapshot(v) => v.clone(),
            #[cfg(feature = "faults")]
            RopeRepr::Live => faults::aliased_offsets(),
        }
    }

    /// The positions as an int32 MLX array `[B]`.
    pub fn to_array(&self) -> Array {
        let v = self.values();
        Array::from_slice(&v, &[v.len() as i32])
    }
}

/// Rows of serial rings in one `[B, H_kv, cap, D]` buffer (module docs).
///
/// Guarantees:
/// - After every operation, row `r`'s live columns ([`RowBatch::row_physical`]) are byte-identical, in the same
///   physical order, to those of a [`SerialCache`] fed the same real positions through the same operations (decode,
///   window/append with the row's real count, encoder read, trim), and `row_states()[r].ring` equals that cache's state.
/// - A decode read attends columns `[0, max len_r)` with no mask when every row has the same `len`, else with the
///   boolean mask `c < len_r`; a window read attends with `Causal` when every row has the same `len <= W` and a full
///   block, else with the per-row causal sliding-window mask ([`MaskKind::Window`]). Byte-identity of outputs to the
///   serial twin is a property of MLX's SDPA (measured on CPU by the tests), not of this type.
///
/// Capacity (the physical columns `cap` of `[B, H_kv, cap, D]`, [`RowBatch::cap`]): after every operation
/// `cap <= `[`RowBatch::capacity_bound`], which depends on the live rows only:
/// - a ring row needs `W` columns, plus, while a multi-token write's window is in flight (after a window write,
///   append or encoder read of `L` positions, until the row's next decode step drops the oversize), up to `W - 1 + L`:
///   its `len_r`. So a batch of rings keeps `max(W, max_r len_r)` columns;
/// - a linear row needs its `len_r` columns plus the growth step ahead: `max_r len_r + GROW_STEP - 1`;
/// - a batch needs its longest **live** row, not the longest row it ever held: a decode step that drops an oversize
///   cuts the buffer to the bound in the same gather (a ring that joined with a 128-position prompt at `W = 70` holds
///   70 columns after its first decode, as its solo ring does), and `filter`, `trim`, `trim_rows` and `adopt` cut it
///   when they leave it wider.
///
/// The bytes the arrays hold ([`RowBatch::held_bytes`]) are `rows() * cap() * bytes_per_token()`. Cutting moves no
/// live column: every row's physical columns, phase and reads are unchanged by it.
#[derive(Clone)]
pub struct RowBatch {
    spec: KvSpec,
    max_size: Option<usize>,
    storage: Storage,
    rows: Vec<RowState>,
    /// Present iff there are rows and `cap > 0`; `max len_r <= cap <= capacity_bound()`.
    buf: Option<Buf>,
}

impl std::fmt::Debug for RowBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RowBatch")
            .field("spec", &self.spec)
            .field("max_size", &self.max_size)
            .field("storage", &self.storage)
            .field("rows", &self.rows)
            .field("cap", &self.cap())
            .finish()
    }
}

/// Constructors of a batch of linear rows.
#[derive(Debug, Clone, Copy)]
pub struct BatchKvCache;

impl BatchKvCache {
    /// A batch of linear rows with no rows ([`RowBatch::empty`]).
    pub fn empty(spec: KvSpec) -> Result<RowBatch> {
        RowBatch::empty(spec, None)
    }
    /// `rows` empty linear rows (offset 0), e.g. for a prepared prefill ([`RowBatch::with_rows`]).
    pub fn with_rows(spec: KvSpec, rows: usize) -> Result<RowBatch> {
        RowBatch::with_rows(spec, None, rows)
    }
    /// R-BROT-4: linear rows from per-row temporal slices `(k, v, offset)`, each in temporal order
    /// ([`RowBatch::merge`]).
    pub fn merge(spec: KvSpec, rows: &[(Array, Array, usize)]) -> Result<RowBatch> {
        RowBatch::merge(spec, None, rows)
    }
}

/// Constructors of a batch of rotating rows (window `max_size`).
#[derive(Debug, Clone, Copy)]
pub struct BatchRotatingKvCache;

impl BatchRotatingKvCache {
    /// A batch of rotating rows of window `max_size` with no rows (`0` is [`CacheError::InvalidState`]).
    pub fn empty(spec: KvSpec, max_size: usize) -> Result<RowBatch> {
        RowBatch::empty(spec, Some(max_size))
    }
    /// `rows` empty rings of window `max_size` (offset 0), e.g. for a prepared prefill ([`RowBatch::with_rows`]).
    pub fn with_rows(spec: KvSpec, max_size: usize, rows: usize) -> Result<RowBatch> {
        RowBatch::with_rows(spec, Some(max_size), rows)
    }
    /// R-BROT-4: rings of window `max_size` from per-row temporal slices `(k, v, offset)` with `L_i <= W`, each in
    /// temporal order ([`RowBatch::merge`]).
    pub fn merge(spec: KvSpec, max_size: usize, rows: &[(Array, Array, usize)]) -> Result<RowBatch> {
        RowBatch::merge(spec, Some(max_size), rows)
    }
}

/// Stack per-row live planes (`[1, H, len_r, ·]` each) into `[B, H, width, ·]` planes, zero-padded on the right.
fn stack_rows(spec: &KvSpec, storage: &Storage, parts: &[Vec<Array>], lens: &[usize]) -> Result<Option<Buf>> {
    let width = lens.iter().copied().max().unwrap_or(0);
    if parts.is_empty() || width == 0 {
        return Ok(None);
    }
    let mut per_plane: Vec<Vec<Array>> = vec![Vec::with_capacity(parts.len()); storage.planes()];
    for (planes, &len) in parts.iter().zip(lens) {
        let pad = width - len;
        let row = Buf { planes: planes.clone() }.map(|p| cols(p, 0, len))?;
        let row = if pad > 0 {
            let z = Buf::zeros(spec, storage, 1, pad)?;
            row.zip_map(&z.planes, |p, x| Ok(mlx_rs::ops::concatenate(&[p, x], 2)?))?
        } else {
            row
        };
        for (dst, p) in per_plane.iter_mut().zip(row.planes) {
            dst.push(p);
        }
    }
    let b = Buf { planes: per_plane.iter().map(|ps| Ok(mlx_rs::ops::concatenate(ps, 0)?)).collect::<Result<_>>()? };
    b.eval()?;
    Ok(Some(b))
}

impl RowBatch {
    fn build(spec: KvSpec, max_size: Option<usize>, storage: Storage, rows: Vec<RowState>, buf: Option<Buf>) -> Self {
        let mut b = RowBatch { spec, max_size, storage, rows, buf };
        b.sync();
        b
    }

    /// The per-row offsets as RoPE positions.
    fn offsets_i32(&self) -> Vec<i32> {
        self.rows.iter().map(|r| i32::try_from(r.ring.offset).unwrap_or(i32::MAX)).collect()
    }

    /// After a mutation: the hook of `Mutant::OffsetAliasing` (an aliasing handle sees the change); nothing else.
    fn sync(&mut self) {
        #[cfg(feature = "faults")]
        faults::publish_offsets(|| self.offsets_i32());
    }

    /// A batch with no rows.
    pub fn empty(spec: KvSpec, max_size: Option<usize>) -> Result<Self> {
        Self::with_rows(spec, max_size, 0)
    }

    /// A batch of `rows` empty rows (offset 0), e.g. for a prepared prefill.
    pub fn with_rows(spec: KvSpec, max_size: Option<usize>, rows: usize) -> Result<Self> {
        Self::with_rows_storage(spec, max_size, Storage::Plain, rows)
    }

    /// A batch of `rows` empty rows of this storage; invalid quantization is [`CacheError::InvalidQuant`].
    pub fn with_rows_storage(spec: KvSpec, max_size: Option<usize>, storage: Storage, rows: usize) -> Result<Self> {
        spec.validate()?;
        validate_max_size(max_size)?;
        storage.validate(&spec)?;
        Ok(Self::build(spec, max_size, storage, vec![RowState::default(); rows], None))
    }

    /// R-BROT-4 (static): from per-row temporal slices `(k, v, offset)` (`[1, H_kv, L_i, D]`, `L_i <= W`,
    /// `L_i <= offset`). Row `i` comes out in temporal order: `len = idx = L_i`, `offset = offset_i`,
    /// `base = offset_i - L_i`. A layout event for rows that had rotated.
    pub fn merge(spec: KvSpec, max_size: Option<usize>, rows: &[(Array, Array, usize)]) -> Result<Self> {
        spec.validate()?;
        for (i, (k, v, _)) in rows.iter().enumerate() {
            check_kv(&spec, k, v, 1, 0).map_err(|e| shape(format!("merge row {i}: {e}")))?;
        }
        let rows: Vec<(Vec<Array>, usize)> = rows.iter().map(|(k, v, o)| (vec![k.clone(), v.clone()], *o)).collect();
        Self::merge_planes(spec, max_size, Storage::Plain, &rows)
    }

    /// [`RowBatch::merge`] for any storage: per-row temporal plane slices `(planes, offset)` of this storage (e.g.
    /// serial caches' [`SerialCache::temporal_view_planes`]), stacked as they are.
    pub fn merge_planes(
        spec: KvSpec,
        max_size: Option<usize>,
        storage: Storage,
        rows: &[(Vec<Array>, usize)],
    ) -> Result<Self> {
        spec.validate()?;
        validate_max_size(max_size)?;
        storage.validate(&spec)?;
        let mut lens = Vec::with_capacity(rows.len());
        for (i, (planes, off)) in rows.iter().enumerate() {
            let l = check_planes_shape(&spec, &storage, planes, 1).map_err(|e| shape(format!("merge row {i}: {e}")))?;
            if let Some(w) = max_size.filter(|&w| l > w) {
                return Err(shape(format!("merge row {i}: a slice of {l} positions exceeds the window {w}")));
            }
            if l > *off {
                return Err(invalid(format!("merge row {i}: a slice of {l} positions cannot end at offset {off}")));
            }
            lens.push(l);
        }
        let width = lens.iter().copied().max().unwrap_or(0);
        let states = rows
            .iter()
            .zip(&lens)
            .map(|((_, off), &l)| {
                let len = if fault!(MergeSlicesByOffset) { (*off).min(width) } else { l };
                RowState {
                    ring: RingState { offset: *off, len, idx: len, last_concat: None },
                    base: off - len,
                    pending: None,
                }
            })
            .collect();
        let parts: Vec<Vec<Array>> = rows.iter().map(|(p, _)| p.clone()).collect();
        let buf = stack_rows(&spec, &storage, &parts, &lens)?;
        Ok(Self::build(spec, max_size, storage, states, buf))
    }

    /// R-BROT-7: a new batch from running batches' rows and serial caches, in order, keeping every row's physical
    /// columns and phase (and, for batch rows, `base` and `pending`). Sources are borrowed. Every source must have
    /// this window ([`CacheError::WindowMismatch`]) and spec ([`CacheError::ShapeMismatch`]); rows listed twice in
    /// one source are [`CacheError::DuplicateRow`]. Routing is by `storage_kind`, row batch first (R-BROT-10); an
    /// unknown kind is [`CacheError::UnknownStorageKind`], a training kind [`CacheError::TrainingOnly`].
    pub fn join(spec: KvSpec, max_size: Option<usize>, sources: &[JoinSource<'_>]) -> Result<Self> {
        Self::join_storage(spec, max_size, Storage::Plain, sources)
    }

    /// [`RowBatch::join`] into a batch of this storage: every source must have it
    /// ([`CacheError::StorageMismatch`]).
    pub fn join_storage(
        spec: KvSpec,
        max_size: Option<usize>,
        storage: Storage,
        sources: &[JoinSource<'_>],
    ) -> Result<Self> {
        spec.validate()?;
        validate_max_size(max_size)?;
        storage.validate(&spec)?;
        let mut parts = Vec::new();
        let mut states = Vec::new();
        for src in sources {
            let kind = src.storage_kind();
            let route = kind.route()?;
            let (s_spec, s_max, s_storage) = src.spec_window_storage();
            if s_storage != storage || kind.storage()? != storage {
                return Err(CacheError::StorageMismatch {
                    expected: StorageKind::serial_of(max_size, storage).0,
                    found: kind.0,
                });
            }
            if s_max != max_size {
                return Err(CacheError::WindowMismatch { expected: max_size, found: s_max });
            }
            let rotating = match route {
                KindRoute::RowBatch { rotating } | KindRoute::Serial { rotating } => rotating,
            };
            if rotating != max_size.is_some() {
                return Err(CacheError::WindowMismatch { expected: max_size, found: s_max });
            }
            if s_spec != spec {
                return Err(shape(format!("join source spec {s_spec:?} differs from {spec:?}")));
            }
            match (route, src) {
                (KindRoute::RowBatch { .. }, JoinSource::Rows(b, list)) => {
                    let mut seen = vec![false; b.rows.len()];
                    for &r in list {
                        b.check_row(r)?;
                        if std::mem::replace(&mut seen[r], true) {
                            return Err(CacheError::DuplicateRow { row: r });
                        }
                        parts.push(b.row_physical_planes(r)?);
                        states.push(b.rows[r].clone());
                    }
                }
                (KindRoute::Serial { .. }, JoinSource::Rows(b, list)) => {
                    // A batch that reports a serial kind is taken as one serial row (what a forgotten kind
                    // override does: the other rows are lost).
                    let r = *list.first().ok_or_else(|| invalid("a batch routed as a serial cache has no row"))?;
                    b.check_row(r)?;
                    parts.push(b.row_physical_planes(r)?);
                    let ring = b.rows[r].ring.clone();
                    states.push(RowState { base: ring.offset - ring.len, ring, pending: None });
                }
                (KindRoute::Serial { .. }, JoinSource::Serial(s)) => {
                    parts.push(s.physical_planes()?);
                    let ring = s.state().clone();
                    states.push(RowState { base: ring.offset - ring.len, ring, pending: None });
                }
                (KindRoute::RowBatch { .. }, JoinSource::Serial(_)) => {
                    return Err(invalid("a serial cache reported a row-batch kind"));
                }
                (_, JoinSource::Training(t)) => {
                    return Err(CacheError::TrainingOnly { kind: t.storage_kind().0 });
                }
            }
        }
        let lens: Vec<usize> = states.iter().map(|s| s.ring.len).collect();
        let buf = stack_rows(&spec, &storage, &parts, &lens)?;
        Ok(Self::build(spec, max_size, storage, states, buf))
    }

    /// R-BROT-8 (static): take owned buffers `[B, H_kv, cap, D]` plus per-row state without moving any column
    /// (columns past the rows' capacity bound, which no row holds, are cut: [`RowBatch::capacity_bound`]).
    /// A state no writes could produce, `len_r > cap` or `base > offset` is [`CacheError::InvalidState`].
    pub fn adopt(spec: KvSpec, max_size: Option<usize>, k: Array, v: Array, rows: Vec<RowState>) -> Result<Self> {
        spec.validate()?;
        check_kv(&spec, &k, &v, rows.len(), 0)?;
        Self::adopt_planes(spec, max_size, Storage::Plain, vec![k, v], rows)
    }

    /// [`RowBatch::adopt`] for any storage: owned planes `[B, H_kv, cap, ·]` of this storage.
    pub fn adopt_planes(
        spec: KvSpec,
        max_size: Option<usize>,
        storage: Storage,
        planes: Vec<Array>,
        rows: Vec<RowState>,
    ) -> Result<Self> {
        spec.validate()?;
        validate_max_size(max_size)?;
        storage.validate(&spec)?;
        let cap = check_planes_shape(&spec, &storage, &planes, rows.len())?;
        let mut rows = rows;
        if fault!(AdoptDropsPhase) {
            rows.iter_mut().for_each(|r| r.ring.idx = r.ring.len);
        }
        for (i, r) in rows.iter().enumerate() {
            r.ring.validate(max_size).map_err(|e| invalid(format!("row {i}: {e}")))?;
            if r.ring.len > cap {
                return Err(invalid(format!("row {i}: len {} exceeds the buffer's {cap} columns", r.ring.len)));
            }
            if r.base > r.ring.offset {
                return Err(invalid(format!("row {i}: base {} > offset {}", r.base, r.ring.offset)));
            }
        }
        let buf = if rows.is_empty() || cap == 0 { None } else { Some(Buf { planes }) };
        if let Some(b) = &buf {
            b.eval()?;
        }
        let mut out = Self::build(spec, max_size, storage, rows, buf);
        if let Some(cut) = out.compacted(out.rows.iter().map(|r| r.ring.len))? {
            out.buf = Some(cut);
        }
        Ok(out)
    }

    /// The K/V geometry (`H_kv`, `D`, dtype) every row shares; writes and reads are checked against it.
    pub fn spec(&self) -> KvSpec {
        self.spec
    }

    /// How K and V are stored (plain or affine triples).
    pub fn storage(&self) -> Storage {
        self.storage
    }

    /// Number of rows `B`.
    pub fn rows(&self) -> usize {
        self.rows.len()
    }

    /// Every row's host state, in row order (row `r`'s `ring` equals its solo twin's state).
    pub fn row_states(&self) -> &[RowState] {
        &self.rows
    }

    /// The window `W` (`None` = linear rows).
    pub fn max_size(&self) -> Option<usize> {
        self.max_size
    }

    /// Physical capacity of the buffers (columns).
    pub fn cap(&self) -> usize {
        self.buf.as_ref().map_or(0, Buf::cap)
    }

    /// The raw buffers `[B, H_kv, cap, D]` (every column, live or not), e.g. for [`RowBatch::adopt`] or persistence;
    /// dense (dequantized for affine storage). `None` while the batch holds no column.
    pub fn buffers(&self) -> Option<(Array, Array)> {
        self.buf.as_ref().and_then(|b| self.storage.dense(&b.planes).ok())
    }

    /// The raw planes `[B, H_kv, cap, ·]` (for [`RowBatch::adopt_planes`]). `None` while the batch holds no column.
    pub fn buffer_planes(&self) -> Option<Vec<Array>> {
        self.buf.as_ref().map(|b| b.planes.clone())
    }

    /// [`SerialCache::to_quantized`] for every row: the whole buffer as laid out, every row's state and phase kept.
    /// A prepared prefill pending (mid-round) is [`CacheError::PendingPrefill`]; errors change nothing. Mutation hook
    /// `Mutant::QuantConvertTemporalOrder` (rows that have rotated are converted in temporal order).
    pub fn to_quantized(&mut self, quant: QuantSpec) -> Result<()> {
        let target = Storage::Affine(quant);
        if self.is_pending() {
            return Err(CacheError::PendingPrefill);
        }
        if self.storage == target {
            return Ok(());
        }
        if self.storage != Storage::Plain {
            return Err(CacheError::StorageMismatch {
                expected: StorageKind::row_batch_of(self.max_size, Storage::Plain).0,
                found: self.storage_kind().0,
            });
        }
        target.validate(&self.spec)?;
        let buf = match &self.buf {
            None => None,
            Some(b) if fault!(QuantConvertTemporalOrder) && self.rows.iter().any(|r| r.ring.is_rotated()) => {
                let cap = b.cap();
                let mut idx = Vec::with_capacity(self.rows.len() * cap);
                for r in &self.rows {
                    let t = r.ring.temporal_columns();
                    idx.extend((0..cap).map(|c| t.get(c).copied().unwrap_or(c)));
                }
                let g = self.gather_rows(b, None, &idx, cap)?;
                Some(Buf { planes: target.convert(&g.planes)? })
            }
            Some(b) => Some(Buf { planes: target.convert(&b.planes)? }),
        };
        if let Some(b) = &buf {
            b.eval()?;
        }
        self.buf = buf;
        self.storage = target;
        Ok(())
    }

    /// Whether a prepared prefill is pending (some row has `pending`).
    pub fn is_pending(&self) -> bool {
        self.rows.iter().any(|r| r.pending.is_some())
    }

    fn check_row(&self, row: usize) -> Result<()> {
        if row < self.rows.len() {
            Ok(())
        } else {
            Err(CacheError::NoSuchRow { row, rows: self.rows.len() })
        }
    }

    /// R-ROT-5 for one row.
    pub fn row_decode_phase(&self, row: usize) -> Result<DecodePhase> {
        self.check_row(row)?;
        let s = &self.rows[row].ring;
        if fault!(RowPhaseIgnoresOversize) {
            return Ok(if s.idx == s.len { DecodePhase::Concat } else { DecodePhase::Ring });
        }
        Ok(s.decode_phase(self.max_size))
    }

    /// R-BROT-5: row `row` as a fresh serial cache: its `len` live columns de-rolled to temporal order (owned
    /// contiguous copies), `offset = offset_row`, `idx = len`. A layout event. The row's `pending` is dropped.
    pub fn extract(&self, row: usize) -> Result<SerialCache> {
        self.check_row(row)?;
        let st = &self.rows[row].ring;
        let planes = self.row_gather(row, &st.temporal_columns())?;
        let mut out = SerialCache::from_temporal_planes(self.spec, self.max_size, self.storage, &planes, st.offset)?;
        if fault!(PhaseKeptAfterExtract) {
            out.state_mut().idx = st.idx;
        }
        Ok(out)
    }

    /// R-BROT-6: keep these rows, in this order. Out-of-range rows are [`CacheError::NoSuchRow`], repeated rows
    /// [`CacheError::DuplicateRow`]. Kept rows' columns and state are unchanged; the buffer keeps the kept rows'
    /// capacity bound ([`RowBatch::capacity_bound`]).
    pub fn filter(&mut self, keep: &[usize]) -> Result<()> {
        let mut seen = vec![false; self.rows.len()];
        for (i, &r) in keep.iter().enumerate() {
            let bad = match self.check_row(r) {
                Err(e) => Some(e),
                Ok(()) if std::mem::replace(&mut seen[r], true) => Some(CacheError::DuplicateRow { row: r }),
                Ok(()) => None,
            };
            if let Some(e) = bad {
                if fault!(FilterPartialOnError) {
                    self.filter(&keep[..i])?;
                }
                return Err(e);
            }
        }
        let buf = match (&self.buf, keep.is_empty()) {
            (Some(b), false) => {
                // The kept rows' capacity bound: the columns only the dropped rows needed go with them.
                let width =
                    b.cap().min(capacity::capacity_bound(keep.iter().map(|&r| self.rows[r].ring.len), self.max_size));
                let at = index_array(keep, &[keep.len()])?;
                let nb = b.map(|p| Ok(cols(p, 0, width)?.take_axis(&at, 0)?))?;
                nb.eval()?;
                Some(nb)
            }
            _ => None,
        };
        self.rows = keep.iter().map(|&r| self.rows[r].clone()).collect();
        self.buf = buf;
        self.sync();
        Ok(())
    }

    /// Right-padded prefill: row `r` has `lengths[r]` more real positions, delivered in the next window chunks (each
    /// chunk of width `L` consumes `min(remaining_r, L)` real positions of row `r`, at the start of the row's
    /// block). Requires no pending prefill ([`CacheError::PendingPrefill`]) and one length per row
    /// ([`CacheError::BadLengths`]).
    pub fn prepare(&mut self, lengths: &[usize]) -> Result<()> {
        if self.is_pending() {
            return Err(CacheError::PendingPrefill);
        }
        if lengths.len() != self.rows.len() {
            return Err(CacheError::BadLengths {
                what: format!("{} lengths for {} rows", lengths.len(), self.rows.len()),
            });
        }
        for (r, &n) in self.rows.iter_mut().zip(lengths) {
            r.pending = Some(n);
        }
        Ok(())
    }

    /// End a prepared prefill (required before decode). Real positions not yet delivered are forgotten.
    /// [`CacheError::NoPendingPrefill`] if none is pending.
    pub fn finalize(&mut self) -> Result<()> {
        if !self.is_pending() {
            return Err(CacheError::NoPendingPrefill);
        }
        for r in &mut self.rows {
            r.pending = None;
        }
        Ok(())
    }

    /// New buffer `[B, H, width, D]` whose row `r`, column `j` is `source[r, :, idx[r * width + j], :]`, with
    /// `source = buffer ++ block ++ one zero column` along axis 2.
    fn gather_rows(&self, b: &Buf, block: Option<&[Array]>, idx: &[usize], width: usize) -> Result<Buf> {
        let n = self.rows.len();
        let z = Buf::zeros(&self.spec, &self.storage, n, 1)?;
        let at = index_array(idx, &[n, 1, width, 1])?;
        let mut planes = Vec::with_capacity(b.planes.len());
        for (i, (buf, zc)) in b.planes.iter().zip(&z.planes).enumerate() {
            let mut parts = vec![buf];
            if let Some(x) = block.and_then(|blk| blk.get(i)) {
                parts.push(x);
            }
            parts.push(zc);
            planes.push(mlx_rs::ops::concatenate(&parts, 2)?.take_along_axis(&at, 2)?);
        }
        let nb = Buf { planes };
        nb.eval()?;
        Ok(nb)
    }

    fn check_step(&self, k: &Array, v: &Array, q: Option<&Array>) -> Result<usize> {
        let l = check_kv(&self.spec, k, v, self.rows.len(), 1)?;
        if let Some(q) = q {
            check_q(&self.spec, q, self.rows.len(), l)?;
        }
        Ok(l)
    }

    fn empty_output(&self, q: &Array) -> Result<Array> {
        Ok(mlx_rs::ops::zeros_dtype(q.shape(), q.dtype())?)
    }

    /// A window read (R-BROT-2, R-C-2): `L >= 1` positions per row (`[B, H_kv, L, D]`, queries `[B, H_q, L, D]`).
    /// Row `r` stores its real positions of this chunk (all `L`, or `min(pending_r, L)` during a prepared prefill)
    /// by the serial window rule; a row with no real position is untouched. Then every row is attended causally
    /// within the window; outputs at padded query positions are unspecified (they see column 0 only).
    pub fn window(&mut self, k: &Array, v: &Array, q: &Array, scale: f32, masks: &Masks) -> Result<(Array, MaskUse)> {
        let l = self.check_step(k, v, Some(q))?;
        if self.rows.is_empty() {
            return Ok((self.empty_output(q)?, MaskUse::None));
        }
        let real = self.write_window(k, v)?;
        let lens: Vec<usize> = self.rows.iter().map(|r| r.ring.len).collect();
        let width = lens.iter().copied().max().unwrap_or(0).max(1);
        self.ensure_capacity(width)?;
        let b = self.buf.as_ref().ok_or_else(|| invalid("window read without a buffer"))?;
        let live = b.map(|p| cols(p, 0, width))?.planes;
        if self.rows.len() == 1 && self.storage != Storage::Plain && fault!(QuantSinglePlainPath) {
            // Mutation hook `Mutant::QuantSinglePlainPath` (mlx-vlm#1310): a one-row quantized batch takes the
            // plain single-request shortcut, which sees only this block; the quantized prompt context is lost.
            let (k, v) = self.storage.dense(&live)?;
            let (k, v) = (cols(&k, width - real[0], width)?, cols(&v, width - real[0], width)?);
            return Ok((super::read::attend(q, &k, &v, scale, None, true)?, MaskUse::Causal));
        }
        let causal = real.iter().all(|&n| n == l)
            && lens.iter().all(|&n| n == lens[0])
            && self.max_size.is_none_or(|w| lens[0] <= w);
        if causal {
            return Ok((attend_planes(&self.storage, q, &live, scale, None, true)?, MaskUse::Causal));
        }
        let key = MaskKey { kind: MaskKind::Window, lens, real, queries: l, window: self.max_size, cols: width };
        let (spec, arr) = masks.get(&key)?;
        Ok((attend_planes(&self.storage, q, &live, scale, Some((&spec, &arr)), false)?, MaskUse::Array(spec)))
    }

    /// DiffusionGemma's vision-encoder read (R-ROT-9b) for every row: each row's block of `L >= 1` positions
    /// (`[B, H_kv, L, D]`, queries `[B, H_q, L, D]`) is written by the serial window rule (its newest `min(len_r, W -
    /// 1)` positions kept, then the whole block, even past `W`: one gather), then every row is attended under the
    /// encoder's own window, row by row ([`FamilyKey::EncoderWindow`] with row `r`'s kept history plus `L` keys,
    /// built once per forward through `masks`): exactly [`SerialCache::encoder_read`] of each row's solo cache, so
    /// each row's state and stored bytes equal its solo twin's afterwards. Requires no pending prefill
    /// ([`CacheError::PendingPrefill`]); `encoder_window == Some(0)` is [`CacheError::InvalidState`]. Errors
    /// change nothing.
    pub fn encoder_read(
        &mut self,
        k: &Array,
        v: &Array,
        q: &Array,
        scale: f32,
        encoder_window: Option<usize>,
        masks: &Masks,
    ) -> Result<(Array, MaskUse)> {
        if self.is_pending() {
            return Err(CacheError::PendingPrefill);
        }
        let l = self.check_step(k, v, Some(q))?;
        check_encoder_window(encoder_window)?;
        if self.rows.is_empty() {
            return Ok((self.empty_output(q)?, MaskUse::None));
        }
        let encoder_window = if fault!(EncoderWindowFromCache) { self.max_size } else { encoder_window };
        let keys: Vec<usize> = self.rows.iter().map(|r| window_keep(r.ring.len, self.max_size) + l).collect();
        let width = keys.iter().copied().max().unwrap_or(l);
        let (spec, arr) = masks.get_family(&FamilyKey::EncoderWindow { keys, queries: l, window: encoder_window })?;
        self.write_window(k, v)?;
        self.ensure_capacity(width)?;
        let b = self.buf.as_ref().ok_or_else(|| invalid("encoder read without a buffer"))?;
        let live = b.map(|p| cols(p, 0, width))?.planes;
        Ok((attend_planes(&self.storage, q, &live, scale, Some((&spec, &arr)), false)?, MaskUse::Array(spec)))
    }

    /// The window write without the read.
    pub fn append(&mut self, k: &Array, v: &Array) -> Result<()> {
        self.check_step(k, v, None)?;
        if self.rows.is_empty() {
            return Ok(());
        }
        self.write_window(k, v).map(|_| ())
    }

    /// The window write: one gather. Returns each row's real count.
    fn write_window(&mut self, k: &Array, v: &Array) -> Result<Vec<usize>> {
        let l = ncols(k);
        let block = self.storage.encode(k, v)?;
        let real: Vec<usize> = self
            .rows
            .iter()
            .map(|r| match r.pending {
                // Mutation hook `Mutant::PendingZeroTakesAll`: 0 read as "no limit".
                Some(0) if fault!(PendingZeroTakesAll) => l,
                p => p.map_or(l, |p| p.min(l)),
            })
            .collect();
        let stored: Vec<usize> = self
            .rows
            .iter()
            .zip(&real)
            .map(|(r, &n)| if r.pending.is_some() && fault!(PrefillPadStored) { l } else { n })
            .collect();
        let cap = self.cap();
        let zero_col = cap + l;
        let mut maps = Vec::with_capacity(self.rows.len());
        for (r, &n) in self.rows.iter().zip(&stored) {
            let s = &r.ring;
            let map: Vec<usize> = if n == 0 {
                (0..s.len).collect()
            } else {
                let keep = window_keep(s.len, self.max_size);
                let t = s.temporal_columns();
                t[s.len - keep..].iter().copied().chain(cap..cap + n).collect()
            };
            maps.push(map);
        }
        let width = maps.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let mut idx = Vec::with_capacity(maps.len() * width);
        for m in &maps {
            idx.extend((0..width).map(|j| m.get(j).copied().unwrap_or(zero_col)));
        }
        let nb = match &self.buf {
            Some(b) => self.gather_rows(b, Some(block.as_slice()), &idx, width)?,
            None => {
                // No buffer yet: the block alone is the source.
                let empty = Buf { planes: block.clone() }.map(|p| cols(p, 0, 0))?;
                self.gather_rows(&empty, Some(block.as_slice()), &idx, width)?
            }
        };
        self.buf = Some(nb);
        for ((r, &n), (&rl, m)) in self.rows.iter_mut().zip(&stored).zip(real.iter().zip(&maps)) {
            if n > 0 {
                r.ring = RingState { offset: r.ring.offset + n, len: m.len(), idx: m.len(), last_concat: Some(n) };
            }
            if let Some(p) = r.pending.as_mut() {
                *p = p.saturating_sub(rl);
            }
        }
        self.sync();
        Ok(real)
    }

    /// R-C-5 on every row: all rows are checked first (an error changes nothing), then trimmed; the buffer is cut
    /// to the trimmed rows' capacity bound when it is wider (a rollback of an in-flight window). Returns `n`.
    pub fn trim(&mut self, n: usize, bypass: bool) -> Result<usize> {
        let mut plans = Vec::with_capacity(self.rows.len());
        for r in &self.rows {
            match plan_trim(&r.ring, self.max_size, n, bypass)? {
                None => return Ok(0),
                Some(s) => plans.push(s),
            }
        }
        let cut = self.compacted(plans.iter().map(|s| s.len))?;
        for (r, s) in self.rows.iter_mut().zip(plans) {
            r.ring = s;
        }
        if cut.is_some() {
            self.buf = cut;
        }
        self.sync();
        Ok(n)
    }

    /// R-C-5 per row (speculative rollback with per-row accepts): row `r` drops `n[r]` positions; all rows are
    /// checked first; the buffer is cut as by [`RowBatch::trim`]. One count per row, else [`CacheError::BadLengths`].
    pub fn trim_rows(&mut self, n: &[usize], bypass: bool) -> Result<()> {
        if n.len() != self.rows.len() {
            return Err(CacheError::BadLengths {
                what: format!("{} trim counts for {} rows", n.len(), self.rows.len()),
            });
        }
        let plans = self
            .rows
            .iter()
            .zip(n)
            .map(|(r, &k)| plan_trim(&r.ring, self.max_size, k, bypass))
            .collect::<Result<Vec<_>>>()?;
        let cut = self.compacted(self.rows.iter().zip(&plans).map(|(r, s)| s.as_ref().unwrap_or(&r.ring).len))?;
        for (r, s) in self.rows.iter_mut().zip(plans) {
            if let Some(s) = s {
                r.ring = s;
            }
        }
        if cut.is_some() {
            self.buf = cut;
        }
        self.sync();
        Ok(())
    }

    /// Every row is trimmable (R-ROT-6).
    pub fn is_trimmable(&self) -> bool {
        self.rows.iter().all(|r| r.ring.is_trimmable(self.max_size))
    }

    fn row_gather(&self, row: usize, columns: &[usize]) -> Result<Vec<Array>> {
        match &self.buf {
            Some(b) if !columns.is_empty() => {
                let at = index_array(columns, &[columns.len()])?;
                Ok(b.map(|p| Ok(row_slice(p, row, row + 1)?.take_axis(&at, 2)?))?.planes)
            }
            _ => Ok(Buf::zeros(&self.spec, &self.storage, 1, 0)?.planes),
        }
    }

    /// Row `row`'s live columns `[0, len_row)` in physical order, `[1, H_kv, len, D]`, contiguous; dense
    /// (dequantized for affine storage: [`RowBatch::row_physical_planes`] are the stored bytes).
    pub fn row_physical(&self, row: usize) -> Result<(Array, Array)> {
        self.storage.dense(&self.row_physical_planes(row)?)
    }

    /// The stored planes of row `row`'s live columns `[0, len_row)` in physical order, contiguous.
    pub fn row_physical_planes(&self, row: usize) -> Result<Vec<Array>> {
        self.check_row(row)?;
        let len = self.rows[row].ring.len;
        match &self.buf {
            Some(b) if len > 0 => Ok(b.map(|p| Ok(cols(&row_slice(p, row, row + 1)?, 0, len)?.contiguous()?))?.planes),
            _ => self.row_gather(row, &[]),
        }
    }

    /// R-ROT-4 for one row: its newest `min(len, W)` positions in temporal order; dense.
    pub fn row_temporal_view(&self, row: usize) -> Result<(Array, Array)> {
        self.storage.dense(&self.row_temporal_view_planes(row)?)
    }

    /// The stored planes of [`RowBatch::row_temporal_view`].
    pub fn row_temporal_view_planes(&self, row: usize) -> Result<Vec<Array>> {
        self.check_row(row)?;
        self.row_gather(row, &temporal_view_columns(&self.rows[row].ring, self.max_size))
    }

    /// R-ROT-4 for every row at once, with one gather per tensor: `[B, H_kv, n_max, D]` whose row `r`, columns
    /// `[0, n_r)` are exactly [`RowBatch::row_temporal_view`]`(r)` (the same columns, gathered by the same rule), and
    /// the counts `n_r`. Columns `[n_r, n_max)` of row `r` repeat its column 0 (or are zero for an empty row) and mean
    /// nothing. For callers that read every row's view (a checker): `B` views cost two MLX ops instead of `4 B`.
    pub fn temporal_views(&self) -> Result<(Array, Array, Vec<usize>)> {
        let views: Vec<Vec<usize>> = self.rows.iter().map(|r| temporal_view_columns(&r.ring, self.max_size)).collect();
        let counts: Vec<usize> = views.iter().map(Vec::len).collect();
        let width = counts.iter().copied().max().unwrap_or(0);
        let empty = || {
            super::util::zeros(
                &[self.rows.len(), self.spec.heads_kv, width, self.spec.head_dim],
                self.spec.dtype.to_mlx(),
            )
        };
        let b = match &self.buf {
            Some(b) if width > 0 => b,
            _ => {
                let z = empty()?;
                return Ok((z.clone(), z, counts));
            }
        };
        let mut idx = Vec::with_capacity(self.rows.len() * width);
        for v in &views {
            idx.extend((0..width).map(|j| v.get(j).or(v.first()).copied().unwrap_or(0)));
        }
        let at = index_array(&idx, &[self.rows.len(), 1, width, 1])?;
        let (k, v) = self.storage.dense(&b.planes)?;
        Ok((k.take_along_axis(&at, 2)?, v.take_along_axis(&at, 2)?, counts))
    }

    /// mlx-lm's `left_padding` (for compatibility and pictures): `width - (offset_r - base_r)` with
    /// `width = max_r len_r`. Negative after wraps, exactly as mlx-lm's. kvsim keeps padding physically at the right.
    pub fn left_padding(&self) -> Vec<i64> {
        let width = self.rows.iter().map(|r| r.ring.len).max().unwrap_or(0) as i64;
        self.rows.iter().map(|r| width - (r.ring.offset as i64 - r.base as i64)).collect()
    }

    /// R-BROT-3: per-row RoPE positions, a snapshot value. Mutation hook `Mutant::OffsetAliasing`.
    pub fn rope_offsets(&self) -> RopeOffsets {
        #[cfg(feature = "faults")]
        if fault!(OffsetAliasing) {
            return RopeOffsets(RopeRepr::Live);
        }
        RopeOffsets(RopeRepr::Snapshot(self.offsets_i32()))
    }

    /// The scalar offset: the maximum over rows (0 without rows; R-BROT-3).
    pub fn offset(&self) -> usize {
        self.rows.iter().map(|r| r.ring.offset).max().unwrap_or(0)
    }

    /// The serial kind plus the row-batch marker (R-BROT-10). Mutation hook `Mutant::MissingKindOverride`.
    pub fn storage_kind(&self) -> StorageKind {
        if fault!(MissingKindOverride) {
            StorageKind::serial_of(self.max_size, self.storage)
        } else {
            StorageKind::row_batch_of(self.max_size, self.storage)
        }
    }

    /// Bytes one more token costs one row (R-C-4, R-BROT-9): [`Storage::bytes_per_token`].
    pub fn bytes_per_token(&self) -> usize {
        self.storage.bytes_per_token(&self.spec)
    }

    /// Bytes `n` real tokens cost one row, capped at the window for rings (R-BROT-9).
    pub fn bytes_for_tokens(&self, n: usize) -> usize {
        self.max_size.map_or(n, |w| n.min(w)) * self.bytes_per_token()
    }

    /// A small text picture: a header, then one line per row with a cell per physical column (the stored position
    /// mod 10, `.` for a column the row does not hold), `>` before the row's write head, then the row's numbers.
    pub fn picture(&self) -> String {
        let width = self.rows.iter().map(|r| r.ring.len).max().unwrap_or(0);
        let mut out = format!(
            "{} W={} rows={} cap={}\n",
            self.storage_kind(),
            self.max_size.map_or("inf".to_string(), |w| w.to_string()),
            self.rows.len(),
            self.cap()
        );
        for ((i, r), lp) in self.rows.iter().enumerate().zip(self.left_padding()) {
            let s = &r.ring;
            out.push_str(&format!(
                "r{i} {} off={} len={} idx={} lp={lp}",
                render_cells(s, width),
                s.offset,
                s.len,
                s.idx
            ));
            if let Some(p) = r.pending {
                out.push_str(&format!(" pending={p}"));
            }
            out.push('\n');
        }
        out
    }
}

// The row layouts move between threads (a campaign may run seeds on several).
const _: () = {
    const fn assert_send<T: Send>() {}
    assert_send::<RowBatch>();
    assert_send::<SerialCache>();
};

mod capacity;
mod decode;

pub(crate) use decode::decode_mask_key;

#[cfg(test)]
mod tests;
