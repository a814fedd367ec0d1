//! The serial core (ARCHITECTURE.md "The serial core"): [`SerialCache`], which is [`RotatingKvCache`] with a window
//! `W` (keep = 0; R-ROT-1) and [`KvCache`] with `W = ∞`.
//!
//! Host state is a [`RingState`] of plain integers; K/V live in `[1, H_kv, cap, D]` buffers whose columns `[0, len)`
//! hold data. Buffers grow in steps of [`GROW_STEP`] zero columns (capped at `W` for rings, except that a window
//! write may leave up to `W - 1 + L` columns: the plateau of R-ROT-3).
//!
//! The host rules (`RingState::prepared_for_decode`, [`window_keep`], [`plan_trim`], [`temporal_view_columns`]) are
//! shared with [`super::RowBatch`], which applies them per row: that is what makes a row's physical columns and
//! phase equal its serial twin's.

use mlx_rs::Array;

use super::compiled::DecodePlan;
use super::error::{invalid, shape, CacheError};
use super::kind::StorageKind;
use super::mask::{attend, FamilyKey, MaskKey, MaskKind, MaskUse, Masks};
use super::quant::{attend_planes, check_planes_shape, QuantSpec, Storage};
use super::util::{check_kv, check_q, cols, eval, index_array, ncols, zeros};
use super::{KvSpec, Result};

/// Zero columns added per growth of a buffer (as mlx-lm's `step`).
pub const GROW_STEP: usize = 256;

/// Whether the next decode write appends a column (`Concat`) or overwrites the oldest one (`Ring`) (R-ROT-5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DecodePhase {
    Concat,
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
    pub offset: usize,
    pub len: usize,
    pub idx: usize,
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
    pub fn window(&mut self, k: &Array, v: &Array, q: &Array, scale: f32, masks: &Masks) -> Result<(Array, MaskUse)> {
        let l = check_kv(&self.spec, k, v, 1, 1)?;
        check_q(&self.spec, q, 1, l)?;
        self.write_window(k, v)?;
        let len = self.state.len;
        let live = self.live()?;
        if self.max_size.is_none_or(|w| len <= w) {
            return Ok((attend_planes(&self.storage, q, &live, scale, None, true)?, MaskUse::Causal));
        }
        let key = MaskKey {
            kind: MaskKind::Window,
            lens: vec![len],
            real: vec![l],
            queries: l,
            window: self.max_size,
            cols: len,
        };
        let (spec, arr) = masks.get(&key)?;
        Ok((attend_planes(&self.storage, q, &live, scale, Some((&spec, &arr)), false)?, MaskUse::Array(spec)))
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

    /// The physical columns a canvas block attends before itself (R-ROT-9c): the temporal view, cut to its newest
    /// `W - 1` positions on a ring; every live column of a linear cache.
    pub(crate) fn block_context_columns(&self) -> Vec<usize> {
        let view = temporal_view_columns(&self.state, self.max_size);
        let keep = self.max_size.map_or(view.len(), |w| view.len().min(w - 1));
        view[view.len() - keep..].to_vec()
    }

    /// DiffusionGemma's canvas read (R-ROT-9c): the block `k`, `v`, `q` (`L >= 1` positions) attends the stored
    /// context ([`SerialCache::block_context_columns`]: the live window in temporal order, its newest `W - 1`
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
mod tests {
    use super::*;
    use crate::mask::attend;
    use crate::testutil::testlock;
    use crate::testutil::*;
    use crate::KvDtype;

    fn f32s(a: &Array) -> Vec<f32> {
        let a = a.as_dtype(mlx_rs::Dtype::Float32).unwrap().contiguous().unwrap();
        a.eval().unwrap();
        a.as_slice::<f32>().to_vec()
    }

    /// Host copy of every position ever written: `[H, D]` row-major per position.
    #[derive(Default)]
    struct Hist {
        k: Vec<Vec<f32>>,
        v: Vec<Vec<f32>>,
    }

    impl Hist {
        fn push(&mut self, k: &Array, v: &Array) {
            let (h, l, d) = (k.shape()[1] as usize, k.shape()[2] as usize, k.shape()[3] as usize);
            let (kf, vf) = (f32s(k), f32s(v));
            for i in 0..l {
                let pick =
                    |x: &[f32]| (0..h).flat_map(|hh| x[(hh * l + i) * d..(hh * l + i + 1) * d].to_vec()).collect();
                self.k.push(pick(&kf));
                self.v.push(pick(&vf));
            }
        }
    }

    /// f64 attention of query `i` of `q` `[1, HQ, L, D]` over `positions`; returns `[HQ, D]`.
    #[allow(clippy::too_many_arguments)]
    fn expected(
        h: &Hist,
        q: &[f32],
        l: usize,
        i: usize,
        positions: &[usize],
        hkv: usize,
        d: usize,
        scale: f64,
    ) -> Vec<f64> {
        let mut out = Vec::new();
        for hq in 0..HQ {
            let kh = hq / (HQ / hkv);
            let qv = &q[(hq * l + i) * d..(hq * l + i + 1) * d];
            let s: Vec<f64> = positions
                .iter()
                .map(|&p| (0..d).map(|x| qv[x] as f64 * h.k[p][kh * d + x] as f64).sum::<f64>() * scale)
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for x in 0..d {
                out.push(positions.iter().zip(&e).map(|(&p, w)| w / z * h.v[p][kh * d + x] as f64).sum());
            }
        }
        out
    }

    fn check_against_f64(
        out: &Array,
        q: &Array,
        h: &Hist,
        offset_after: usize,
        w: Option<usize>,
        spec: &KvSpec,
        scale: f32,
    ) {
        let l = q.shape()[2] as usize;
        let (qf, of) = (f32s(q), f32s(out));
        let d = spec.head_dim;
        for i in 0..l {
            let p = offset_after - l + i;
            let lo = w.map_or(0, |w| (p + 1).saturating_sub(w));
            let vis: Vec<usize> = (lo..=p).collect();
            let e = expected(h, &qf, l, i, &vis, spec.heads_kv, d, scale as f64);
            for hq in 0..HQ {
                for x in 0..d {
                    let got = of[(hq * l + i) * d + x] as f64;
                    let want = e[hq * d + x];
                    assert!((got - want).abs() < 1e-4, "query {i} (pos {p}) head {hq} dim {x}: {got} vs {want}");
                }
            }
        }
    }

    /// Window and decode reads see exactly the causal sliding window (R-C-2), for rings and the linear cache.
    #[test]
    fn reads_match_f64_sliding_window_reference() {
        let _g = testlock::shared();
        let spec = spec(KvDtype::F32);
        for w in [Some(1), Some(4), Some(5), None] {
            let mut c = SerialCache::new(spec, w).unwrap();
            let mut h = Hist::default();
            let masks = Masks::new();
            let script: &[(bool, usize)] = &[
                (true, 3),
                (false, 3),
                (true, 5),
                (false, 2),
                (true, 1),
                (false, 4),
                (true, 2),
                (true, 7),
                (false, 6),
            ];
            let mut seed = 100;
            for &(is_window, l) in script {
                for _ in 0..if is_window { 1 } else { l } {
                    seed += 1;
                    let n = if is_window { l } else { 1 };
                    let (k, v, q) = kvq(&spec, seed, 1, n);
                    h.push(&k, &v);
                    let (out, used) = if is_window {
                        c.window(&k, &v, &q, 0.3, &masks).unwrap()
                    } else {
                        c.decode(&k, &v, &q, 0.3, &masks).unwrap()
                    };
                    if !is_window {
                        assert_eq!(used, MaskUse::None);
                    }
                    check_against_f64(&out, &q, &h, c.offset(), w, &spec, 0.3);
                    c.state().validate(w).unwrap();
                }
            }
        }
    }

    /// MLX's `Causal` is bottom-right aligned and equals the explicit mask bit for bit on CPU.
    #[test]
    fn causal_equals_explicit_mask_bytes() {
        let _g = testlock::shared();
        for dtype in [KvDtype::F32, KvDtype::Bf16] {
            let spec = spec(dtype);
            let mut c = RotatingKvCache::new(spec, 8).unwrap();
            let masks = Masks::new();
            let (k, v, q) = kvq(&spec, 7, 1, 3);
            c.window(&k, &v, &q, 0.3, &masks).unwrap();
            let (k, v, q) = kvq(&spec, 8, 1, 4);
            let (out, used) = c.window(&k, &v, &q, 0.3, &masks).unwrap();
            assert_eq!(used, MaskUse::Causal);
            let key =
                MaskKey { kind: MaskKind::Window, lens: vec![7], real: vec![4], queries: 4, window: Some(8), cols: 7 };
            let (spec, arr) = masks.get(&key).unwrap();
            let (kl, vl) = c.physical().unwrap();
            let explicit = attend(&q, &kl, &vl, 0.3, Some((&spec, &arr)), false).unwrap();
            assert_same_bytes(&out, &explicit, "causal vs explicit");
        }
    }

    #[test]
    fn decode_rotates_in_place_and_temporal_view_is_the_tail() {
        let _g = testlock::shared();
        let spec = spec(KvDtype::Bf16);
        let mut c = RotatingKvCache::new(spec, 4).unwrap();
        let masks = Masks::new();
        let mut ks = Vec::new();
        for i in 0..6u64 {
            assert_eq!(c.decode_phase(), if i < 4 { DecodePhase::Concat } else { DecodePhase::Ring });
            let (k, v, q) = kvq(&spec, i, 1, 1);
            c.decode(&k, &v, &q, 0.3, &masks).unwrap();
            ks.push(k);
        }
        assert_eq!(c.state(), &RingState { offset: 6, len: 4, idx: 2, last_concat: None });
        assert_eq!(c.state().positions(), vec![4, 5, 2, 3]);
        assert_eq!(c.cap(), 4, "ring growth is capped at W");
        let (tk, _) = c.temporal_view().unwrap();
        assert_same_bytes(&tk, &mlx_rs::ops::concatenate(&ks[2..], 2).unwrap(), "temporal view = newest 4");
        let (pk, _) = c.physical().unwrap();
        let phys = [&ks[4], &ks[5], &ks[2], &ks[3]];
        assert_same_bytes(&pk, &mlx_rs::ops::concatenate(&phys, 2).unwrap(), "physical ring order");
        assert_eq!(c.picture(), "rotating-plain W=4 | 4 5>2 3 | off=6 len=4 idx=2");
        // The host-side column list names exactly what temporal_view gathers from the raw buffers.
        assert_eq!(c.temporal_view_columns(), vec![2, 3, 0, 1]);
        let (bk, _) = c.buffers().unwrap();
        let at = Array::from_slice(&[2i32, 3, 0, 1], &[4]);
        assert_same_bytes(&bk.take_axis(&at, 2).unwrap(), &tk, "buffers + temporal_view_columns");
    }

    /// R-ROT-3 / R-ROT-4: a window write keeps W - 1 columns plus the block (the plateau), and the temporal view
    /// of the oversized buffer is its tail. The next decode drops the oversize.
    #[test]
    fn window_plateau_then_decode_drops_oversize() {
        let _g = testlock::shared();
        let spec = spec(KvDtype::F32);
        let mut c = RotatingKvCache::new(spec, 4).unwrap();
        let masks = Masks::new();
        let mut all = Vec::new();
        for s in 0..3u64 {
            let (k, v, q) = kvq(&spec, 10 + s, 1, 3);
            c.window(&k, &v, &q, 0.3, &masks).unwrap();
            all.push(k);
        }
        assert_eq!(c.state(), &RingState { offset: 9, len: 6, idx: 6, last_concat: Some(3) });
        assert_eq!(c.state().positions(), vec![3, 4, 5, 6, 7, 8]);
        let ak = mlx_rs::ops::concatenate(&all, 2).unwrap();
        let (tk, _) = c.temporal_view().unwrap();
        assert_same_bytes(&tk, &cols(&ak, 5, 9).unwrap(), "tail of the plateau");
        assert_eq!(c.decode_phase(), DecodePhase::Ring);
        let plan = DecodePlan { fetch: DecodePhase::Ring, write_pos: 0, active_len: 4 };
        assert_eq!(c.prepare_decode_step().unwrap(), plan);
        assert_eq!(c.prepare_decode_step().unwrap(), plan, "idempotent");
        assert_eq!(c.state(), &RingState { offset: 9, len: 4, idx: 0, last_concat: None });
        let (k, v, q) = kvq(&spec, 99, 1, 1);
        c.decode(&k, &v, &q, 0.3, &masks).unwrap();
        assert_eq!(c.state().positions(), vec![9, 6, 7, 8]);
    }

    #[test]
    fn trim_rules_and_errors() {
        let _g = testlock::shared();
        let spec = spec(KvDtype::F32);
        let masks = Masks::new();
        let mut c = RotatingKvCache::new(spec, 4).unwrap();
        let (k, v, _) = kvq(&spec, 1, 1, 2);
        c.append(&k, &v).unwrap();
        assert!(c.is_trimmable());
        assert_eq!(c.trim(3, false), Err(CacheError::TrimTooLong { requested: 3, available: 2 }));
        assert_eq!(c.trim(1, false), Ok(1));
        assert_eq!(c.state(), &RingState { offset: 1, len: 1, idx: 1, last_concat: None });
        assert_eq!(c.trim(1, true), Err(CacheError::BypassNotAfterWindow));
        // Wrap the ring.
        for s in 0..5 {
            let (k, v, q) = kvq(&spec, 20 + s, 1, 1);
            c.decode(&k, &v, &q, 0.3, &masks).unwrap();
        }
        assert!(!c.is_trimmable());
        assert_eq!(c.trim(1, false), Err(CacheError::NotTrimmable { offset: 6, max_size: 4 }));
        assert_eq!(c.trim(1, true), Err(CacheError::BypassNotAfterWindow));
        // Bypass after a window: exactly the state a shorter window leaves.
        let before = c.clone();
        let (k, v, q) = kvq(&spec, 40, 1, 3);
        c.window(&k, &v, &q, 0.3, &masks).unwrap();
        assert_eq!(c.trim(4, true), Err(CacheError::TrimTooLong { requested: 4, available: 3 }));
        assert_eq!(c.trim(2, true), Ok(2));
        let mut shorter = before.clone();
        shorter.append(&cols(&k, 0, 1).unwrap(), &cols(&v, 0, 1).unwrap()).unwrap();
        assert_eq!(c.state(), shorter.state());
        assert_same_bytes(&c.physical().unwrap().0, &shorter.physical().unwrap().0, "bypass = shorter window");
        // Linear caches are always trimmable.
        let mut lin = KvCache::new(spec).unwrap();
        for s in 0..5 {
            let (k, v, q) = kvq(&spec, 60 + s, 1, 1);
            lin.decode(&k, &v, &q, 0.3, &masks).unwrap();
        }
        assert_eq!(lin.trim(5, false), Ok(5));
        assert_eq!(lin.trim(1, false), Err(CacheError::TrimTooLong { requested: 1, available: 0 }));
    }

    #[test]
    fn impossible_requests_are_errors() {
        let _g = testlock::shared();
        let spec = spec(KvDtype::F32);
        let masks = Masks::new();
        assert!(matches!(SerialCache::new(spec, Some(0)), Err(CacheError::InvalidState { .. })));
        let bad_spec = KvSpec { heads_kv: 0, ..spec };
        assert!(matches!(KvCache::new(bad_spec), Err(CacheError::InvalidState { .. })));
        let (k, v, _) = kvq(&spec, 1, 1, 3);
        assert!(matches!(SerialCache::from_temporal(spec, Some(4), &k, &v, 2), Err(CacheError::InvalidState { .. })));
        let mut c = RotatingKvCache::new(spec, 4).unwrap();
        let (k2, v2, q2) = kvq(&spec, 2, 1, 2);
        let (k1, v1, q1) = kvq(&spec, 3, 1, 1);
        let shape_err = |r: Result<(Array, MaskUse)>| matches!(r, Err(CacheError::ShapeMismatch { .. }));
        assert!(shape_err(c.decode(&k2, &v2, &q2, 0.3, &masks)), "decode of 2 positions");
        assert!(shape_err(c.decode(&k1, &v1, &q2, 0.3, &masks)), "queries of another length");
        assert!(shape_err(c.window(&k2, &v1, &q2, 0.3, &masks)), "k and v differ");
        let (kb, vb, qb) = kvq(&spec, 4, 2, 1);
        assert!(shape_err(c.decode(&kb, &vb, &qb, 0.3, &masks)), "two rows into a serial cache");
        let bf = k1.as_dtype(mlx_rs::Dtype::Bfloat16).unwrap();
        assert!(shape_err(c.decode(&bf, &bf, &q1, 0.3, &masks)), "dtype");
        let q3 = data(5, 1, 3, 1, spec.head_dim, spec.dtype);
        assert!(shape_err(c.decode(&k1, &v1, &q3, 0.3, &masks)), "H_q not a multiple of H_kv");
        let k0 = data(6, 1, spec.heads_kv, 0, spec.head_dim, spec.dtype);
        assert!(matches!(c.append(&k0, &k0), Err(CacheError::ShapeMismatch { .. })), "empty window");
        assert_eq!(c.state(), &RingState::default(), "errors change nothing");
    }

    #[test]
    fn relinearize_and_from_temporal_keep_bytes_and_positions() {
        let _g = testlock::shared();
        let spec = spec(KvDtype::Bf16);
        let masks = Masks::new();
        let mut c = RotatingKvCache::new(spec, 5).unwrap();
        for s in 0..8 {
            let (k, v, q) = kvq(&spec, s, 1, 1);
            c.decode(&k, &v, &q, 0.3, &masks).unwrap();
        }
        assert!(c.state().is_rotated());
        let (tk, tv) = c.temporal_view().unwrap();
        let copy = SerialCache::from_temporal(spec, Some(5), &tk, &tv, c.offset()).unwrap();
        c.relinearize().unwrap();
        assert_eq!(c.state(), copy.state());
        assert_same_bytes(&c.physical().unwrap().0, &copy.physical().unwrap().0, "relinearized = from_temporal");
        assert_same_bytes(&c.physical().unwrap().0, &tk, "relinearized = temporal view");
    }

    #[test]
    fn linear_cache_grows_in_steps_and_commit_span_is_decodes() {
        let _g = testlock::shared();
        let spec = spec(KvDtype::F32);
        let masks = Masks::new();
        let mut a = KvCache::new(spec).unwrap();
        let mut b = KvCache::new(spec).unwrap();
        let (k, v, q) = kvq(&spec, 1, 1, 300);
        a.append(&k, &v).unwrap();
        b.append(&k, &v).unwrap();
        assert_eq!(a.cap(), 512);
        let (k, v, q) = (cols(&k, 0, 5).unwrap(), cols(&v, 0, 5).unwrap(), cols(&q, 0, 5).unwrap());
        let span = a.commit_span(&k, &v, &q, 0.3, &masks).unwrap();
        let mut outs = Vec::new();
        for i in 0..5 {
            let s = |x: &Array| cols(x, i, i + 1).unwrap();
            outs.push(b.decode(&s(&k), &s(&v), &s(&q), 0.3, &masks).unwrap().0);
        }
        assert_same_bytes(&span, &mlx_rs::ops::concatenate(&outs, 2).unwrap(), "commit_span = decodes");
        assert_eq!(a.state(), &RingState { offset: 305, len: 305, idx: 305, last_concat: None });
        assert_eq!(a.storage_kind().as_str(), "kv-plain");
        assert_eq!(a.bytes_per_token(), 2 * 2 * 8 * 4);
        assert_eq!(a.bytes_for_tokens(1000), 1000 * 128);
        let r = RotatingKvCache::new(spec, 16).unwrap();
        assert_eq!(r.bytes_for_tokens(1000), 16 * 128);
        assert_eq!(r.storage_kind().as_str(), "rotating-plain");
    }

    #[cfg(feature = "faults")]
    #[test]
    fn mutant_temporal_head_and_concat_keeps_window_are_visible() {
        use crate::faults::Mutant;
        let spec = spec(KvDtype::F32);
        let masks = Masks::new();
        let build = || {
            let mut c = RotatingKvCache::new(spec, 4).unwrap();
            for s in 0..3 {
                let (k, v, q) = kvq(&spec, s, 1, 3);
                c.window(&k, &v, &q, 0.3, &masks).unwrap();
            }
            c
        };
        let good = {
            let _g = testlock::shared();
            let c = build();
            assert_eq!(c.state().len, 6);
            c
        };
        {
            let _m = testlock::arm(Mutant::TemporalHead);
            let (hk, _) = good.temporal_view().unwrap();
            let (pk, _) = good.physical().unwrap();
            assert_same_bytes(&hk, &cols(&pk, 0, 4).unwrap(), "the head");
            assert!(!same_bytes(&hk, &cols(&pk, 2, 6).unwrap()));
        }
        {
            let _m = testlock::arm(Mutant::ConcatKeepsWindow);
            assert_eq!(build().state().len, 7);
        }
        {
            let _m = testlock::arm(Mutant::TrimNoopAfterWrap);
            let mut c = build();
            assert_eq!(c.trim(2, true), Ok(0));
            assert_eq!(c.state().len, 6);
        }
    }
}
