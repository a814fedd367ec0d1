//! The serial core (ARCHITECTURE.md "The serial core"): [`SerialCache`], which is [`RotatingKvCache`] with a window
//! `W` (keep = 0; R-ROT-1) and [`KvCache`] with `W = ∞`.
//!
//! Host state is a [`RingState`] of plain integers; K/V live in `[1, H_kv, cap, D]` buffers whose columns `[0, len)`
//! hold data. Buffers grow in steps of [`GROW_STEP`] zero columns (capped at `W` for rings, except that a window
//! write may leave up to `W - 1 + L` columns: the plateau of R-ROT-3).
//!
//! The host rules (`RingState::prepared_for_decode`, `window_keep`, `plan_trim`, `temporal_view_columns`) are
//! shared with [`super::RowBatch`], which applies them per row: that is what makes a row's physical columns and
//! phase equal its serial twin's.

use mlx_rs::Array;

use super::error::{invalid, shape, CacheError};
use super::kind::StorageKind;
use super::mask::{FamilyKey, MaskKey, MaskKind, MaskUse, Masks};
use super::quant::{attend_planes, check_planes_shape, QuantSpec, Storage};
use super::read::attend;
use super::util::{check_kv, check_q, cols, eval, index_array, ncols, zeros};
use super::{KvSpec, Result};

/// Zero columns added per growth of a buffer (as mlx-lm's `step`).
pub const GROW_STEP: usize = 256;

/// Whether the next decode write appends a column (`Concat`) or overwrites the oldest one (`Ring`) (R-ROT-5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodePhase {
    /// The write appends physical column `len` (`idx == len` after the head's bookkeeping): `len` grows by one.
    Concat,
    /// The write overwrites physical column `idx`, the ring head, which holds the oldest position; `len` stays `W`.
    Ring,
}

/// Host-side state of one serial ring (or one row of a batch): plain integers, no MLX.
///
/// - `offset`: positions ever written (the next RoPE position).
/// - `len`: live physical columns `[0, len)`.
/// - `idx`: the physical write head. `idx < len` iff the ring has rotated (then `len == W`); otherwise the buffer is
///   in temporal order and `idx == len`.
/// - `last_concat`: `Some(L)` iff the last mutation was a window write of `L` positions (or a bypass trim of one,
///   which leaves `Some(L - n)`): what a bypass trim may remove (R-C-5).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct RingState {
    /// Positions ever written: the RoPE position of the next write (R-ROT-1).
    pub offset: usize,
    /// Live physical columns: `[0, len)` hold the newest `len` positions; `len <= offset`.
    pub len: usize,
    /// The ring head (physical write column); `idx < len` iff rotated (then `len == W`), else `idx == len`.
    pub idx: usize,
    /// `Some(L)` iff the last mutation was a window write of `L` positions (less any bypass trim since): what a
    /// bypass trim may still remove (R-C-5).
    pub last_concat: Option<usize>,
}

impl RingState {
    /// Whether the ring has rotated (physical order is not temporal order).
    pub fn is_rotated(&self) -> bool {
        self.idx < self.len
    }

    /// The live physical columns, oldest position first: `[idx, len) ++ [0, idx)` when rotated, else `[0, len)`.
    pub fn temporal_columns(&self) -> Vec<usize> {
        if self.idx < self.len {
            (self.idx..self.len).chain(0..self.idx).collect()
        } else {
            (0..self.len).collect()
        }
    }

    /// The position stored in each physical column `[0, len)` (column `T[t]` of the temporal order holds position
    /// `offset - len + t`).
    pub fn positions(&self) -> Vec<usize> {
        let mut out = vec![0; self.len];
        let first = self.offset.saturating_sub(self.len);
        for (t, c) in self.temporal_columns().into_iter().enumerate() {
            out[c] = first + t;
        }
        out
    }

    /// The state after the host bookkeeping of a decode step (steps 1-2 of the decode write) and the number of
    /// oldest columns dropped (non-zero only for an oversized buffer after a window write). `idx` of the result is
    /// the target column. Idempotent.
    pub fn prepared_for_decode(&self, max_size: Option<usize>) -> (usize, RingState) {
        let mut s = self.clone();
        let mut drop = 0;
        if let Some(w) = max_size {
            if s.len > w {
                drop = s.len - w;
                s.len = w;
                s.idx = w;
                s.last_concat = None;
            }
            if s.idx == w {
                s.idx = 0;
            }
        }
        (drop, s)
    }

    /// Steps 3-4 of the decode write, after [`RingState::prepared_for_decode`]: append or overwrite at `idx`.
    pub(crate) fn after_decode_write(&mut self) {
        if self.idx == self.len {
            self.len += 1;
        }
        self.idx += 1;
        self.offset += 1;
        self.last_concat = None;
    }

    /// R-ROT-5: the non-mutating answer to "does the next decode write append or overwrite?".
    pub fn decode_phase(&self, max_size: Option<usize>) -> DecodePhase {
        let (_, s) = self.prepared_for_decode(max_size);
        if s.idx == s.len {
            DecodePhase::Concat
        } else {
            DecodePhase::Ring
        }
    }

    /// R-ROT-6 (as mlx-lm): `offset < W`; always true for a linear cache.
    pub fn is_trimmable(&self, max_size: Option<usize>) -> bool {
        max_size.is_none_or(|w| self.offset < w)
    }

    /// Whether some sequence of writes, trims and layout events could produce this state.
    pub fn validate(&self, max_size: Option<usize>) -> Result<()> {
        let bad = |what: String| Err(invalid(format!("{what} in {self:?} (W = {max_size:?})")));
        if self.len > self.offset {
            return bad("len > offset".into());
        }
        if self.idx > self.len {
            return bad("idx > len".into());
        }
        if self.idx < self.len && max_size != Some(self.len) {
            return bad("a rotated ring must hold exactly W columns".into());
        }
        if let Some(l) = self.last_concat {
            if l > self.len || self.idx != self.len {
                return bad("last_concat without a temporal buffer holding it".into());
            }
        }
        Ok(())
    }
}

/// How many temporal columns a window write keeps before appending: the newest `min(len, W - 1)` (all of them for
/// a linear cache; R-ROT-3). Mutation hook `Mutant::ConcatKeepsWindow`.
pub(crate) fn window_keep(len: usize, max_size: Option<usize>) -> usize {
    match max_size {
        None => len,
        Some(w) if fault!(ConcatKeepsWindow) => len.min(w),
        Some(w) => len.min(w - 1),
    }
}

/// The physical columns of the temporal view (R-ROT-4): the tail of the temporal order, `min(len, W)` columns
/// (= the newest `min(offset, W)` positions whenever the cache holds them). Mutation hook `Mutant::TemporalHead`.
pub(crate) fn temporal_view_columns(state: &RingState, max_size: Option<usize>) -> Vec<usize> {
    let t = state.temporal_columns();
    let n = max_size.map_or(t.len(), |w| t.len().min(w));
    if fault!(TemporalHead) {
        t[..n].to_vec()
    } else {
        t[t.len() - n..].to_vec()
    }
}

/// The state after `trim(n, bypass)` (R-C-5, R-ROT-6), or `None` for "do nothing, report 0" (only under the
/// mutant `Mutant::TrimNoopAfterWrap`). Errors leave the caller's state untouched.
pub(crate) fn plan_trim(s: &RingState, max_size: Option<usize>, n: usize, bypass: bool) -> Result<Option<RingState>> {
    if bypass {
        if fault!(TrimNoopAfterWrap) && max_size.is_some_and(|w| s.offset >= w) {
            return Ok(None);
        }
        let l = s.last_concat.ok_or(CacheError::BypassNotAfterWindow)?;
        if n > l {
            return Err(CacheError::TrimTooLong { requested: n, available: l });
        }
        let len = s.len - n;
        Ok(Some(RingState { offset: s.offset - n, len, idx: len, last_concat: Some(l - n) }))
    } else {
        if let Some(w) = max_size.filter(|_| !s.is_trimmable(max_size)) {
            return Err(CacheError::NotTrimmable { offset: s.offset, max_size: w });
        }
        if n > s.len {
            return Err(CacheError::TrimTooLong { requested: n, available: s.len });
        }
        let len = s.len - n;
        Ok(Some(RingState { offset: s.offset - n, len, idx: len, last_concat: None }))
    }
}

/// One line of a ring picture: a cell per physical column `[0, width)` showing the stored position mod 10 (`.`
/// for a column that holds nothing), with `>` just before the write head.
pub(crate) fn render_cells(state: &RingState, width: usize) -> String {
    let pos = state.positions();
    let mut s = String::with_capacity(2 * width + 2);
    s.push('|');
    for c in 0..width {
        s.push(if state.idx == c { '>' } else { ' ' });
        s.push(match pos.get(c) {
            Some(p) => char::from(b'0' + (p % 10) as u8),
            None => '.',
        });
    }
    s.push(if state.idx >= width { '>' } else { ' ' });
    s.push('|');
    s
}

/// The encoder read's own window must let a query see at least itself (`Some(0)` is [`CacheError::InvalidState`]).
pub(crate) fn check_encoder_window(window: Option<usize>) -> Result<()> {
    match window {
        Some(0) => Err(invalid("encoder window 0: a query would see no key")),
        _ => Ok(()),
    }
}

pub(crate) fn validate_max_size(max_size: Option<usize>) -> Result<()> {
    match max_size {
        Some(0) => Err(invalid("max_size 0: a ring needs at least one column")),
        Some(w) if i32::try_from(w).is_err() => Err(invalid(format!("max_size {w} exceeds i32"))),
        _ => Ok(()),
    }
}

/// New capacity for a buffer of `cap` columns that must hold `needed`: grown in [`GROW_STEP`] steps, capped at the
/// window for rings (but never below `needed`).
pub(crate) fn grown_capacity(cap: usize, needed: usize, max_size: Option<usize>) -> usize {
    if needed <= cap {
        return cap;
    }
    let steps = (needed - cap).div_ceil(GROW_STEP);
    let new_cap = cap + steps * GROW_STEP;
    match max_size {
        Some(w) => new_cap.min(w.max(needed)),
        None => new_cap,
    }
}

/// The planes of one cache, each `[B, H_kv, cap, ·]` with the token axis at 2: `[k, v]` for plain storage,
/// `[kq, ks, kb, vq, vs, vb]` for affine storage ([`Storage`]). Every column op applies to every plane alike.
#[derive(Clone)]
pub(crate) struct Buf {
    pub(crate) planes: Vec<Array>,
}

impl Buf {
    pub(crate) fn cap(&self) -> usize {
        self.planes.first().map_or(0, ncols)
    }

    /// Zero planes of `rows` rows and `n` columns (a directly grown quantized plane holds code 0, scale 0, bias 0,
    /// as mlx-lm's `QuantizedKVCache` growth).
    pub(crate) fn zeros(spec: &KvSpec, storage: &Storage, rows: usize, n: usize) -> Result<Buf> {
        let planes = storage
            .plane_layout(spec)
            .into_iter()
            .map(|(w, dt)| zeros(&[rows, spec.heads_kv, n, w], dt))
            .collect::<Result<_>>()?;
        Ok(Buf { planes })
    }

    /// Append `extra` zero columns to `buf` (creating it for `rows` rows when absent).
    pub(crate) fn grow(
        buf: Option<Buf>,
        spec: &KvSpec,
        storage: &Storage,
        rows: usize,
        extra: usize,
    ) -> Result<Option<Buf>> {
        if extra == 0 {
            return Ok(buf);
        }
        let z = Buf::zeros(spec, storage, rows, extra)?;
        Ok(Some(match buf {
            None => z,
            Some(b) => b.zip_map(&z.planes, |p, x| Ok(mlx_rs::ops::concatenate(&[p, x], 2)?))?,
        }))
    }

    /// Every plane through `f`.
    pub(crate) fn map(&self, mut f: impl FnMut(&Array) -> Result<Array>) -> Result<Buf> {
        Ok(Buf { planes: self.planes.iter().map(&mut f).collect::<Result<_>>()? })
    }

    /// Every plane with its counterpart in `other` (same plane order) through `f`.
    pub(crate) fn zip_map(&self, other: &[Array], mut f: impl FnMut(&Array, &Array) -> Result<Array>) -> Result<Buf> {
        if other.len() != self.planes.len() {
            return Err(shape(format!("{} planes paired with {}", other.len(), self.planes.len())));
        }
        Ok(Buf { planes: self.planes.iter().zip(other).map(|(p, x)| f(p, x)).collect::<Result<_>>()? })
    }

    /// Evaluates the buffers after a write, unless the calling thread deferred it ([`set_eval_after_write`]).
    pub(crate) fn eval(&self) -> Result<()> {
        if EVAL_AFTER_WRITE.with(|e| e.get()) {
            eval(&self.planes.iter().collect::<Vec<_>>())
        } else {
            Ok(())
        }
    }
}

thread_local! {
    static EVAL_AFTER_WRITE: std::cell::Cell<bool> = const { std::cell::Cell::new(true) };
}

/// The calling thread's [`set_eval_after_write`] setting.
pub(crate) fn eval_after_write() -> bool {
    EVAL_AFTER_WRITE.with(|e| e.get())
}

/// Whether caches evaluate their K/V buffers right after every write (default `true`, per thread).
///
/// Evaluating after each write keeps every cache's graph one write deep whatever the caller does (bug catalog #11).
/// A caller that evaluates each step's results itself (an engine evaluating all layers' outputs at once, or the
/// simulator, which reads every buffer after every op) can switch it off to save one device round trip per write;
/// it must then evaluate the caches' outputs or buffers every step, or the lazy graph grows. Outputs and stored
/// bytes are the same either way (the same ops run, later).
pub fn set_eval_after_write(on: bool) {
    EVAL_AFTER_WRITE.with(|e| e.set(on));
}

/// One serial cache: [`KvCache`] (`max_size == None`) or [`RotatingKvCache`] (`Some(W)`), per ARCHITECTURE.md, with
/// plain storage; [`super::QuantizedKvCache`] and [`super::RotatingQuantizedKvCache`] are the same core with affine
/// storage (six planes, [`Storage`]).
///
/// Guarantees: columns `[0, len)` of [`SerialCache::physical_planes`] hold exactly the bytes written for their
/// positions (writes are copies of the incoming block, quantized per block through MLX for affine storage), in the
/// physical order the rules of [`RingState`] dictate. `decode` attends those columns with no mask; `window` attends
/// them under MLX's `Causal` mask while `len <= W`, else an explicit boolean mask with the sliding window (affine
/// storage: mlx-lm's quantized attention with the same visibility). The output is whatever MLX computes for those
/// inputs (deterministic for a given device and build).
///
/// Capacity (the physical columns `cap` of `[1, H_kv, cap, D]`, [`SerialCache::cap`]): a ring grows to at most `W`
/// columns; a window write of `L` positions may leave `W - 1 + L` (the plateau: its `len`, the in-flight window),
/// which the next decode step's oversize drop cuts back to exactly `W`. A bypass trim keeps the columns of the window
/// it rolls back: when it leaves `len <= W`, no drop follows, and the buffer stays up to `L - 1` columns wider than
/// `W` until a later window write or oversize drop rewrites it. A linear cache grows in steps of [`GROW_STEP`]
/// columns and keeps them through trims. The bytes its arrays hold ([`SerialCache::held_bytes`]) are
/// `cap() * bytes_per_token()`. (A [`super::RowBatch`] bounds its capacity by its live rows after every operation.)
#[derive(Clone)]
pub struct SerialCache {
    spec: KvSpec,
    max_size: Option<usize>,
    storage: Storage,
    state: RingState,
    buf: Option<Buf>,
}

impl std::fmt::Debug for SerialCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SerialCache")
            .field("spec", &self.spec)
            .field("max_size", &self.max_size)
            .field("storage", &self.storage)
            .field("state", &self.state)
            .field("cap", &self.cap())
            .finish()
    }
}

/// The plan of one compiled decode step: host-side integers only.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodePlan {
    /// `Concat`: the step reads the `active_len` live columns and the new one after them (an append); `Ring`: it
    /// writes the new column into the `active_len`-column buffer at `write_pos` and reads the whole buffer (an
    /// overwrite of the oldest position).
    pub fetch: DecodePhase,
    /// The physical column the new position lands in (`== active_len` for `Concat`).
    pub write_pos: usize,
    /// Buffer columns the step takes as input (the live columns before the write).
    pub active_len: usize,
}

/// Constructor of the linear serial cache (`W = ∞`).
#[derive(Debug, Clone, Copy)]
pub struct KvCache;

impl KvCache {
    /// An empty linear cache.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(spec: KvSpec) -> Result<SerialCache> {
        SerialCache::new(spec, None)
    }
}

/// Constructor of the rotating ring (keep = 0, window `max_size`).
#[derive(Debug, Clone, Copy)]
pub struct RotatingKvCache;

impl RotatingKvCache {
    /// An empty ring of window `max_size` (`0` is [`CacheError::InvalidState`]).
    #[allow(clippy::new_ret_no_self)]
    pub fn new(spec: KvSpec, max_size: usize) -> Result<SerialCache> {
        SerialCache::new(spec, Some(max_size))
    }
}

impl SerialCache {
    /// An empty cache; `max_size == Some(0)` is [`CacheError::InvalidState`].
    pub fn new(spec: KvSpec, max_size: Option<usize>) -> Result<Self> {
        Self::with_storage(spec, max_size, Storage::Plain)
    }

    /// An empty cache of this storage; invalid quantization is [`CacheError::InvalidQuant`].
    pub fn with_storage(spec: KvSpec, max_size: Option<usize>, storage: Storage) -> Result<Self> {
        spec.validate()?;
        validate_max_size(max_size)?;
        storage.validate(&spec)?;
        Ok(SerialCache { spec, max_size, storage, state: RingState::default(), buf: None })
    }

    /// A cache holding a temporal slice `k`, `v` (`[1, H_kv, L, D]`, oldest first) whose newest position is
    /// `offset - 1`: `len = idx = L`, `last_concat = None`. `L > offset` is [`CacheError::InvalidState`]; `L > W` is
    /// accepted (the oversized temporal state a window write leaves). The buffers are contiguous copies.
    pub fn from_temporal(spec: KvSpec, max_size: Option<usize>, k: &Array, v: &Array, offset: usize) -> Result<Self> {
        spec.validate()?;
        check_kv(&spec, k, v, 1, 0)?;
        Self::from_temporal_planes(spec, max_size, Storage::Plain, &[k.clone(), v.clone()], offset)
    }

    /// [`SerialCache::from_temporal`] for any storage: `planes` are a temporal slice of this storage's planes
    /// (`[1, H_kv, L, ·]` each, e.g. another cache's [`SerialCache::temporal_view_planes`]), copied as they are.
    pub fn from_temporal_planes(
        spec: KvSpec,
        max_size: Option<usize>,
        storage: Storage,
        planes: &[Array],
        offset: usize,
    ) -> Result<Self> {
        spec.validate()?;
        validate_max_size(max_size)?;
        storage.validate(&spec)?;
        let l = check_planes_shape(&spec, &storage, planes, 1)?;
        if l > offset {
            return Err(invalid(format!("a slice of {l} positions cannot end at offset {offset}")));
        }
        let buf = if l > 0 {
            let b = Buf { planes: planes.iter().map(|p| p.contiguous()).collect::<std::result::Result<_, _>>()? };
            b.eval()?;
            Some(b)
        } else {
            None
        };
        let state = RingState { offset, len: l, idx: l, last_concat: None };
        Ok(SerialCache { spec, max_size, storage, state, buf })
    }

    /// A cache that takes owned buffers `k`, `v` (`[1, H_kv, cap, D]`) and a state without moving any column (the
    /// serial twin of [`super::RowBatch::adopt`]; used by persistence). A state no writes could produce
    /// ([`RingState::validate`]) or `len > cap` is [`CacheError::InvalidState`]; buffers of another spec are
    /// [`CacheError::ShapeMismatch`]. Columns `[len, cap)` are never read. Plain storage.
    pub fn adopt(spec: KvSpec, max_size: Option<usize>, k: Array, v: Array, state: RingState) -> Result<Self> {
        spec.validate()?;
        check_kv(&spec, &k, &v, 1, 0)?;
        Self::adopt_planes(spec, max_size, Storage::Plain, vec![k, v], state)
    }

    /// [`SerialCache::adopt`] for any storage: owned planes `[1, H_kv, cap, ·]` of this storage (shapes and dtypes
    /// checked against the storage's plane layout; invalid quantization is [`CacheError::InvalidQuant`]).
    pub fn adopt_planes(
        spec: KvSpec,
        max_size: Option<usize>,
        storage: Storage,
        planes: Vec<Array>,
        state: RingState,
    ) -> Result<Self> {
        spec.validate()?;
        validate_max_size(max_size)?;
        storage.validate(&spec)?;
        let cap = check_planes_shape(&spec, &storage, &planes, 1)?;
        state.validate(max_size)?;
        if state.len > cap {
            return Err(invalid(format!("len {} exceeds the buffer's {cap} columns", state.len)));
        }
        let buf = if cap == 0 {
            None
        } else {
            let b = Buf { planes };
            b.eval()?;
            Some(b)
        };
        Ok(SerialCache { spec, max_size, storage, state, buf })
    }

    /// The K/V geometry (`H_kv`, `D`, dtype) every write and read is checked against.
    pub fn spec(&self) -> KvSpec {
        self.spec
    }

    /// How K and V are stored (plain or affine triples).
    pub fn storage(&self) -> Storage {
        self.storage
    }

    /// The window `W` (`None` = linear).
    pub fn max_size(&self) -> Option<usize> {
        self.max_size
    }

    /// The host state: offset, len, ring head `idx` and `last_concat` (plain integers, no MLX).
    pub fn state(&self) -> &RingState {
        &self.state
    }

    pub(crate) fn state_mut(&mut self) -> &mut RingState {
        &mut self.state
    }

    /// Physical capacity of the buffers (columns).
    pub fn cap(&self) -> usize {
        self.buf.as_ref().map_or(0, Buf::cap)
    }

    /// The bytes the cache's arrays hold: the sum of every plane's `nbytes` (`cap() * bytes_per_token()`; 0 before
    /// the first write).
    pub fn held_bytes(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.planes.iter().map(|p| p.nbytes()).sum())
    }

    /// The raw planes `[1, H_kv, cap, ·]` (every column, live or not). `None` while nothing was written.
    pub fn buffer_planes(&self) -> Option<Vec<Array>> {
        self.buf.as_ref().map(|b| b.planes.clone())
    }

    /// The raw buffers `[1, H_kv, cap, D]` (every column, live or not), dense (dequantized for affine storage).
    /// `None` while nothing was written.
    pub fn buffers(&self) -> Option<(Array, Array)> {
        self.buf.as_ref().and_then(|b| self.storage.dense(&b.planes).ok())
    }

    /// Positions ever written.
    pub fn offset(&self) -> usize {
        self.state.offset
    }

    /// The RoPE position of the next write (= `offset`; R-ROT-1: RoPE uses the true position).
    pub fn rope_offset(&self) -> usize {
        self.state.offset
    }

    /// R-ROT-5: does the next decode write append (`Concat`) or overwrite (`Ring`)?
    pub fn decode_phase(&self) -> DecodePhase {
        self.state.decode_phase(self.max_size)
    }

    /// The host-side bookkeeping of a one-position decode step without the write (R-C-9): drops the oversize left
    /// by a window write, rotates the head at `W`, grows the buffer. Returns the plan of the step (see
    /// [`super::compiled`]): `fetch` (= [`SerialCache::decode_phase`] before the call), `write_pos` (the column the
    /// next decode writes) and `active_len` (the live columns before it). Idempotent; changes no live byte and no
    /// position.
    pub fn prepare_decode_step(&mut self) -> Result<DecodePlan> {
        let (drop, next) = self.state.prepared_for_decode(self.max_size);
        let mut buf = self.buf.clone();
        if drop > 0 {
            if let Some(b) = &buf {
                let end = drop + next.len;
                let nb = b.map(|p| Ok(cols(p, drop, end)?.contiguous()?))?;
                nb.eval()?;
                buf = Some(nb);
            }
        }
        let cap = buf.as_ref().map_or(0, Buf::cap);
        let new_cap = grown_capacity(cap, next.idx + 1, self.max_size);
        if new_cap > cap {
            buf = Buf::grow(buf, &self.spec, &self.storage, 1, new_cap - cap)?;
        }
        // Commit only once every fallible step has succeeded.
        self.buf = buf;
        self.state = next;
        Ok(self.plan())
    }

    /// The plan of the prepared state (`idx` is the target column).
    fn plan(&self) -> DecodePlan {
        let s = &self.state;
        let fetch = if s.idx == s.len { DecodePhase::Concat } else { DecodePhase::Ring };
        DecodePlan { fetch, write_pos: s.idx, active_len: s.len }
    }

    /// [`CacheError::StepMismatch`] unless `plan` is the plan of this (prepared) state and the buffer holds it.
    pub(crate) fn check_plan(&self, plan: &DecodePlan) -> Result<()> {
        let (drop, prepared) = self.state.prepared_for_decode(self.max_size);
        if drop > 0 || prepared != self.state || self.plan() != *plan || self.cap() < plan.write_pos + 1 {
            return Err(CacheError::StepMismatch {
                what: format!("plan {plan:?} does not match the prepared state {:?} (cap {})", self.state, self.cap()),
            });
        }
        Ok(())
    }

    pub(crate) fn buf_ref(&self) -> Option<&Buf> {
        self.buf.as_ref()
    }

    pub(crate) fn set_buf(&mut self, b: Buf) {
        self.buf = Some(b);
    }

    fn ensure_capacity(&mut self, needed: usize) -> Result<()> {
        let cap = self.cap();
        let new_cap = grown_capacity(cap, needed, self.max_size);
        if new_cap > cap {
            self.buf = Buf::grow(self.buf.take(), &self.spec, &self.storage, 1, new_cap - cap)?;
        }
        Ok(())
    }

    fn live(&self) -> Result<Vec<Array>> {
        match &self.buf {
            Some(b) if self.state.len > 0 => Ok(b.map(|p| cols(p, 0, self.state.len))?.planes),
            _ => Ok(Buf::zeros(&self.spec, &self.storage, 1, 0)?.planes),
        }
    }

    /// One decode step (R-ROT-2): `k`, `v` `[1, H_kv, 1, D]`, `q` `[1, H_q, 1, D]`; writes in place at the head,
    /// then attends columns `[0, len)` with no mask. Returns the output `[1, H_q, 1, D]` and `MaskUse::None`.
    pub fn decode(&mut self, k: &Array, v: &Array, q: &Array, scale: f32, _masks: &Masks) -> Result<(Array, MaskUse)> {
        let l = check_kv(&self.spec, k, v, 1, 1)?;
        if l != 1 {
            return Err(shape(format!("decode writes one position, {l} given")));
        }
        check_q(&self.spec, q, 1, 1)?;
        self.write_decode(k, v)?;
        let live = self.live()?;
        Ok((attend_planes(&self.storage, q, &live, scale, None, false)?, MaskUse::None))
    }

    fn write_decode(&mut self, k: &Array, v: &Array) -> Result<()> {
        let block = self.storage.encode(k, v)?;
        let t = self.prepare_decode_step()?.write_pos;
        let b = self.buf.as_ref().ok_or_else(|| invalid("no buffer after prepare_decode_step"))?;
        let at = index_array(&[t], &[1, 1, 1, 1])?;
        let nb = b.zip_map(&block, |p, x| Ok(p.put_along_axis(&at, x, 2)?))?;
        nb.eval()?;
        self.buf = Some(nb);
        self.state.after_decode_write();
        Ok(())
    }

    /// A window read (R-ROT-3, R-C-2): writes the `L >= 1` positions by concatenation in temporal order (keeping
    /// the newest `min(len, W - 1)` columns), then attends every live column, causal within the window: `Causal`
    /// while `len <= W`, else the explicit sliding-window mask from `masks`.
    /// The mask is this cache's, decided before the append (R-TKV-3): [`SerialCache::window_mask_key`].
    pub fn window(&mut self, k: &Array, v: &Array, q: &Array, scale: f32, masks: &Masks) -> Result<(Array, MaskUse)> {
        let l = check_kv(&self.spec, k, v, 1, 1)?;
        check_q(&self.spec, q, 1, l)?;
        let mask = self.window_mask_key(l).map(|key| masks.get(&key)).transpose()?;
        self.window_with_mask(k, v, q, scale, mask)
    }

    /// Live columns after a window write of `l` positions, from the state before it: the newest `min(len, W - 1)`
    /// stored columns are kept (all of them on a linear cache), then the `l` new ones.
    pub fn window_len_after(&self, l: usize) -> usize {
        window_keep(self.state.len, self.max_size) + l
    }

    /// The explicit mask a window read of `l` positions attends with, decided from the state before the write (a
    /// read's mask comes before its append): `None` while the live columns after the write fit the window (MLX's
    /// `Causal`), else the sliding-window geometry of [`SerialCache::window_len_after`] columns whose last `l` are
    /// the window's.
    pub fn window_mask_key(&self, l: usize) -> Option<MaskKey> {
        let len = self.window_len_after(l);
        if self.max_size.is_none_or(|w| len <= w) {
            return None;
        }
        Some(MaskKey {
            kind: MaskKind::Window,
            lens: vec![len],
            real: vec![l],
            queries: l,
            window: self.max_size,
            cols: len,
        })
    }

    /// The window write, then the read under `mask` (the one [`SerialCache::window_mask_key`] names, built by the
    /// caller before the write; `None`: `Causal`). Shapes are the caller's to have checked.
    pub(crate) fn window_with_mask(
        &mut self,
        k: &Array,
        v: &Array,
        q: &Array,
        scale: f32,
        mask: Option<(std::rc::Rc<super::mask::MaskSpec>, Array)>,
    ) -> Result<(Array, MaskUse)> {
        self.write_window(k, v)?;
        let live = self.live()?;
        match mask {
            None => Ok((attend_planes(&self.storage, q, &live, scale, None, true)?, MaskUse::Causal)),
            Some((spec, arr)) => {
                Ok((attend_planes(&self.storage, q, &live, scale, Some((&spec, &arr)), false)?, MaskUse::Array(spec)))
            }
        }
    }

    /// The window write without the read (appending context without attending).
    pub fn append(&mut self, k: &Array, v: &Array) -> Result<()> {
        check_kv(&self.spec, k, v, 1, 1)?;
        self.write_window(k, v)
    }

    fn write_window(&mut self, k: &Array, v: &Array) -> Result<()> {
        let l = ncols(k);
        let block = self.storage.encode(k, v)?;
        let s = &self.state;
        let keep = window_keep(s.len, self.max_size);
        let t = s.temporal_columns();
        let kept = &t[s.len - keep..];
        let in_place = kept.iter().enumerate().all(|(i, &c)| i == c);
        let nb = if in_place {
            // The kept columns already sit at [0, keep): write the block at [keep, keep + L).
            self.ensure_capacity(keep + l)?;
            let b = self.buf.as_ref().ok_or_else(|| invalid("no buffer after growth"))?;
            let span: Vec<usize> = (keep..keep + l).collect();
            let at = index_array(&span, &[1, 1, l, 1])?;
            b.zip_map(&block, |p, x| Ok(p.put_along_axis(&at, x, 2)?))?
        } else {
            let b = self.buf.as_ref().ok_or_else(|| invalid("rotated ring without a buffer"))?;
            let at = index_array(kept, &[keep])?;
            b.zip_map(&block, |p, x| Ok(mlx_rs::ops::concatenate(&[&p.take_axis(&at, 2)?, x], 2)?))?
        };
        nb.eval()?;
        self.buf = Some(nb);
        let len = keep + l;
        self.state = RingState { offset: self.state.offset + l, len, idx: len, last_concat: Some(l) };
        Ok(())
    }

    /// A committed span (R-ROT-7, `decode_by_position`): `L` decodes, one per position; the outputs concatenated
    /// (`[1, H_q, L, D]`).
    pub fn commit_span(&mut self, k: &Array, v: &Array, q: &Array, scale: f32, masks: &Masks) -> Result<Array> {
        let l = check_kv(&self.spec, k, v, 1, 1)?;
        check_q(&self.spec, q, 1, l)?;
        let mut outs = Vec::with_capacity(l);
        for i in 0..l {
            let (o, _) = self.decode(&cols(k, i, i + 1)?, &cols(v, i, i + 1)?, &cols(q, i, i + 1)?, scale, masks)?;
            outs.push(o);
        }
        Ok(mlx_rs::ops::concatenate(&outs, 2)?)
    }

    /// Gemma 4's vision prefill (R-ROT-9a): the first write of a cache at offset 0 (else
    /// [`CacheError::NotAtOffsetZero`]), attended under the bidirectional mask: query `i` sees its causal window
    /// (this cache's `W`; none for a linear cache) and, when `image[i]`, every image token of the block, earlier or
    /// later, inside the window or not ([`FamilyKey::Bidirectional`], built once per forward through `masks`). The
    /// write is the ordinary window append: on an empty ring it stores the whole block, even past `W`.
    /// `image.len() != L` is [`CacheError::BadLengths`]. Errors change nothing.
    pub fn bidir_prefill(
        &mut self,
        k: &Array,
        v: &Array,
        q: &Array,
        image: &[bool],
        scale: f32,
        masks: &Masks,
    ) -> Result<(Array, MaskUse)> {
        if self.state.offset != 0 {
            return Err(CacheError::NotAtOffsetZero { read: "bidir_prefill", offset: self.state.offset });
        }
        let l = check_kv(&self.spec, k, v, 1, 1)?;
        check_q(&self.spec, q, 1, l)?;
        if image.len() != l {
            return Err(CacheError::BadLengths { what: format!("{} image flags for {l} positions", image.len()) });
        }
        let key = FamilyKey::Bidirectional { image: image.to_vec(), window: self.max_size };
        let (spec, arr) = masks.get_family(&key)?;
        self.write_window(k, v)?;
        let live = self.live()?;
        Ok((attend_planes(&self.storage, q, &live, scale, Some((&spec, &arr)), false)?, MaskUse::Array(spec)))
    }

    /// DiffusionGemma's vision-encoder read (R-ROT-9b): the block `k`, `v`, `q` (`L >= 1` positions) is written by
    /// the ordinary concatenating window append, then attended with MLX's fused SDPA under the encoder's own
    /// window mask ([`FamilyKey::EncoderWindow`], built once per forward through `masks`).
    ///
    /// What is kept: every position of the block, even past `max_size`, after the newest `min(len, W - 1)` stored
    /// positions in temporal order (every stored position for a linear cache): upstream `#updateConcat`, the write
    /// the encoder's `updateAndFetch` makes. What each query sees: block query `i` (position `offset + i`, `offset`
    /// before the call) sees every kept position `p <= offset + i` with `offset + i - p < encoder_window` (`None`:
    /// unbounded); this cache's `W` limits only which history is kept, never the mask. The read attends exactly
    /// the live columns after the write.
    ///
    /// The cache afterwards ([`RingState`]): `offset + L`, `len = min(len, W - 1) + L` (may exceed `W`: the
    /// plateau of a window write), `idx = len` (temporal order), `last_concat = Some(L)`: exactly the state of
    /// [`SerialCache::window`] with the same block, so a later decode drops the oversize and rotates, a later
    /// window keeps the newest `W - 1`, and a bypass trim may remove up to `L` positions. Stored bytes are those
    /// of that window write. `encoder_window == Some(0)` (a query that sees nothing) is
    /// [`CacheError::InvalidState`]; bad shapes are [`CacheError::ShapeMismatch`]. Errors change nothing.
    pub fn encoder_read(
        &mut self,
        k: &Array,
        v: &Array,
        q: &Array,
        scale: f32,
        encoder_window: Option<usize>,
        masks: &Masks,
    ) -> Result<(Array, MaskUse)> {
        let l = check_kv(&self.spec, k, v, 1, 1)?;
        check_q(&self.spec, q, 1, l)?;
        check_encoder_window(encoder_window)?;
        let history = window_keep(self.state.len, self.max_size);
        let encoder_window = if fault!(EncoderWindowFromCache) { self.max_size } else { encoder_window };
        let key = FamilyKey::EncoderWindow { keys: vec![history + l], queries: l, window: encoder_window };
        let (spec, arr) = masks.get_family(&key)?;
        self.write_window(k, v)?;
        let live = self.live()?;
        Ok((attend_planes(&self.storage, q, &live, scale, Some((&spec, &arr)), false)?, MaskUse::Array(spec)))
    }

    /// The physical columns a canvas block attends before itself (R-ROT-9c): the temporal view, cut to its newest
    /// `W - 1` positions on a ring; every live column of a linear cache.
    pub(crate) fn block_context_columns(&self) -> Vec<usize> {
        let view = temporal_view_columns(&self.state, self.max_size);
        let keep = self.max_size.map_or(view.len(), |w| view.len().min(w - 1));
        view[view.len() - keep..].to_vec()
    }

    /// DiffusionGemma's canvas read (R-ROT-9c): the block `k`, `v`, `q` (`L >= 1` positions) attends the stored
    /// context (`SerialCache::block_context_columns`: the live window in temporal order, its newest `W - 1`
    /// positions once full) and the whole block, with no mask (every block query sees every context column and
    /// every block column: the decoder's mask sliced to the kept columns is all ones). Nothing is stored; offsets
    /// never move (`&self`).
    pub fn read_block(&self, k: &Array, v: &Array, q: &Array, scale: f32) -> Result<(Array, MaskUse)> {
        let l = check_kv(&self.spec, k, v, 1, 1)?;
        check_q(&self.spec, q, 1, l)?;
        let ctx = self.block_context_columns();
        let (keys, vals) = if ctx.is_empty() {
            (k.clone(), v.clone())
        } else {
            let (ck, cv) = self.storage.dense(&self.gather(&ctx)?)?;
            (mlx_rs::ops::concatenate(&[&ck, k], 2)?, mlx_rs::ops::concatenate(&[&cv, v], 2)?)
        };
        Ok((attend(q, &keys, &vals, scale, None, false)?, MaskUse::None))
    }

    /// The live columns `[0, len)` in physical order, `[1, H_kv, len, D]`, contiguous; dense (dequantized through
    /// MLX for affine storage: see [`SerialCache::physical_planes`] for the stored bytes).
    pub fn physical(&self) -> Result<(Array, Array)> {
        let (k, v) = self.storage.dense(&self.physical_planes()?)?;
        Ok((k.contiguous()?, v.contiguous()?))
    }

    /// The stored planes of the live columns `[0, len)` in physical order (`[1, H_kv, len, ·]` each), contiguous.
    pub fn physical_planes(&self) -> Result<Vec<Array>> {
        self.live()?.iter().map(|p| Ok(p.contiguous()?)).collect()
    }

    /// R-ROT-4: the newest `min(len, W)` positions in temporal order (the tail of the temporal order, never the
    /// head), `[1, H_kv, n, D]`, contiguous copies; dense (dequantized for affine storage).
    pub fn temporal_view(&self) -> Result<(Array, Array)> {
        self.storage.dense(&self.temporal_view_planes()?)
    }

    /// The stored planes of [`SerialCache::temporal_view`].
    pub fn temporal_view_planes(&self) -> Result<Vec<Array>> {
        self.gather(&temporal_view_columns(&self.state, self.max_size))
    }

    /// The physical columns [`SerialCache::temporal_view`] gathers, in order (host-side; no MLX op): a checker that
    /// already read [`SerialCache::buffers`] can cut the view from those bytes.
    pub fn temporal_view_columns(&self) -> Vec<usize> {
        temporal_view_columns(&self.state, self.max_size)
    }

    fn gather(&self, columns: &[usize]) -> Result<Vec<Array>> {
        match &self.buf {
            Some(b) if !columns.is_empty() => {
                let at = index_array(columns, &[columns.len()])?;
                Ok(b.map(|p| Ok(p.take_axis(&at, 2)?))?.planes)
            }
            _ => self.live(),
        }
    }

    /// R-ROT-6: `offset < W` (always true for a linear cache).
    pub fn is_trimmable(&self) -> bool {
        self.state.is_trimmable(self.max_size)
    }

    /// R-C-5: drop the last `n` positions. `bypass = false` requires [`SerialCache::is_trimmable`] and `n <= len`;
    /// `bypass = true` requires the last mutation to be a window write of `L >= n` positions, and leaves exactly
    /// the state a window of `L - n` positions would have left. Returns `n`. No bytes move.
    pub fn trim(&mut self, n: usize, bypass: bool) -> Result<usize> {
        match plan_trim(&self.state, self.max_size, n, bypass)? {
            None => Ok(0),
            Some(s) => {
                self.state = s;
                Ok(n)
            }
        }
    }

    /// Rewrite the buffer in temporal order (`idx = len`), keeping every live column: a layout event (the bytes of
    /// every position are unchanged; their physical columns move).
    pub fn relinearize(&mut self) -> Result<()> {
        if !self.state.is_rotated() {
            return Ok(());
        }
        let nb = Buf { planes: self.gather(&self.state.temporal_columns())? };
        nb.eval()?;
        self.buf = Some(nb);
        self.state.idx = self.state.len;
        Ok(())
    }

    /// R-ROT-8 / mlx-lm `KVCache.to_quantized`: convert plain storage to affine storage by quantizing the whole
    /// buffer **as laid out** (physical ring order, every allocated column), keeping the state (offset, `len`, ring
    /// phase `idx`, `last_concat`). Because quantization is per position, the result is byte-identical to a
    /// quantized cache fed the same blocks. Already this storage: no-op; other quantized storage:
    /// [`CacheError::StorageMismatch`]; invalid parameters: [`CacheError::InvalidQuant`]. Errors change nothing.
    /// Mutation hook `Mutant::QuantConvertTemporalOrder`.
    pub fn to_quantized(&mut self, quant: QuantSpec) -> Result<()> {
        let target = Storage::Affine(quant);
        if self.storage == target {
            return Ok(());
        }
        if fault!(QuantConvertEmptyIgnoresStorage) && self.buf.is_none() && target.validate(&self.spec).is_ok() {
            self.storage = target;
            return Ok(());
        }
        if self.storage != Storage::Plain {
            return Err(CacheError::StorageMismatch {
                expected: StorageKind::serial_of(self.max_size, Storage::Plain).0,
                found: self.storage_kind().0,
            });
        }
        target.validate(&self.spec)?;
        let buf = match &self.buf {
            None => None,
            Some(_) if fault!(QuantConvertTemporalOrder) && self.state.is_rotated() => {
                Some(Buf { planes: target.convert(&self.gather(&self.state.temporal_columns())?)? })
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

    /// `kv-plain`, `rotating-plain`, `kv:quant:<bits>:<group>` or `kv:rotating-quant:<bits>:<group>` (R-C-1).
    pub fn storage_kind(&self) -> StorageKind {
        StorageKind::serial_of(self.max_size, self.storage)
    }

    /// Bytes one token costs (R-C-4): `2 * H_kv * D * itemsize` plain; packed words, scales and biases of both
    /// sides for affine storage ([`Storage::bytes_per_token`]).
    pub fn bytes_per_token(&self) -> usize {
        self.storage.bytes_per_token(&self.spec)
    }

    /// Bytes that `n` tokens cost, capped at the window for rings (R-C-4).
    pub fn bytes_for_tokens(&self, n: usize) -> usize {
        self.max_size.map_or(n, |w| n.min(w)) * self.bytes_per_token()
    }

    /// A one-line picture of the ring (see [`super::RowBatch::picture`]).
    pub fn picture(&self) -> String {
        let s = &self.state;
        format!(
            "{} W={} {} off={} len={} idx={}",
            self.storage_kind(),
            self.max_size.map_or("inf".to_string(), |w| w.to_string()),
            render_cells(s, s.len),
            s.offset,
            s.len,
            s.idx
        )
    }
}

#[cfg(test)]
mod tests;
