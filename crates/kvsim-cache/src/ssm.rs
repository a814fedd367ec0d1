//! The gated-DeltaNet recurrent cache ([`SsmCache`], storage kind [`SSM`]): one layer's
//! convolution tail and recurrent state for `B` rows, the layer's cache-side arithmetic on MLX, prepared prefill
//! padding, and speculative rounds (R-SSM-1..4, R-C-4, R-C-5, R-C-6).
//!
//! # Layout
//! - `conv` `[B, K-1, conv_dim]` in the input dtype: the last `K-1` real `qkv` rows each row has seen (zeros before
//!   its first `K-1` positions).
//! - `recurrent` `[B, Hv, Dv, Dk]` in f32.
//! - Per-row `offsets` (positions each row has consumed). A serial cache is a cache of one row.
//!
//! # The layer call (`decode` / `window`), following mlx-lm 0.32.2 (`mlx_lm/models/qwen3_5.py`,
//! `GatedDeltaNet.__call__`; `mlx_lm/models/gated_delta.py`, `normalize_qk`, `compute_g`, `gated_delta_ops`,
//! `_gated_delta_step_ops`)
//! 1. padded positions of `qkv` are zeroed;
//! 2. each row's convolution input is its *own stream*: its `K-1` conv-state rows followed directly by its real
//!    `qkv` rows. Without left padding this is exactly mlx-lm's `concat(conv_state, qkv)`; with left padding it
//!    still is for a fresh row (its conv state is zeros, as the zeroed padding is), and it stays right for a row
//!    that already has history (mlx-lm would put the zeroed padding between the history and the new tokens);
//! 3. the depthwise convolution `sum_j x[t+j] * w[j]` in f32 in ascending `j` from `+0` (the order of MLX's CPU
//!    `conv1d`, an explicit GEMM per group), one rounding to the input dtype, then `silu`;
//! 4. each row's new conv tail is the last `K-1` rows of its stream (its real end, never the padded end);
//! 5. `q`, `k`, `v` split; `normalize_qk` (`fast::rms_norm` with `eps * Dk^-1`, then the scalars `Dk^-1` for q and
//!    `Dk^-1/2` for k rounded to the input dtype, as Python's weak scalars are); `beta = sigmoid(b)`,
//!    `g = exp(-exp(f32(A_log)) * softplus(a + dt_bias))`;
//! 6. the recurrence, one step per position, with state `[B, Hv, Dv, Dk]` f32: `S = g S; kv = sum_k S k;
//!    delta = (v - kv) beta; S = S + k delta; y = sum_k S q`; a masked step (a padded position) keeps the state's
//!    bytes (`where(mask, S_new, S_old)`);
//! 7. both states replaced; each row's offset advances by its real count.
//!
//! # What is guaranteed
//! - **Batch = solo, byte for byte, on CPU**: every op above is elementwise, a copy, or a reduction along an axis
//!   inside one row (never across rows), so a row's state bytes and its outputs at real positions equal those of
//!   the same request run alone (measured by the tests here, both states and outputs, with left and right padding,
//!   merge, filter and extract). This is a property of MLX's CPU kernels, measured, and the simulator checks it.
//! - **Padded positions change neither state** (bytes kept by a select), and outputs there are unspecified.
//! - **Replay = fresh prefix, byte for byte**: `rollback(keep)` restores the pre-round snapshot (the same arrays)
//!   and replays the recorded, padding-zeroed inputs of the first `keep_b` positions through the same arithmetic,
//!   so state bytes equal a fresh forward over only the accepted prefix (identical arithmetic prefix).
//! - **Typed errors, nothing lost**: every refused request returns a [`CacheError`] before any state changes.
//! - `bytes_per_token() == 0` (the state does not grow); `trim` is always [`CacheError::RecurrentNotTrimmable`].

use mlx_rs::ops::indexing::{take_along_axis, TryIndexOp};
use mlx_rs::{Array, Dtype};

use super::error::{invalid, shape, CacheError};
use super::kind::{StorageKind, SSM};
use super::util::{dim, eval, index_array, zeros};
use super::{KvDtype, Result};

/// The geometry of one gated-DeltaNet layer's cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct SsmSpec {
    /// Convolution kernel width `K` (mlx-lm's `linear_conv_kernel_dim`, 4 in Qwen3.5); at least 1.
    pub kernel: usize,
    /// Key heads `Hk` (q and k).
    pub heads_k: usize,
    /// Value heads `Hv` (a positive multiple of `Hk`).
    pub heads_v: usize,
    /// Key head dim `Dk`.
    pub dk: usize,
    /// Value head dim `Dv`.
    pub dv: usize,
    /// The input dtype (qkv, a, b, conv state, outputs).
    pub dtype: KvDtype,
}

impl SsmSpec {
    /// `2 Hk Dk + Hv Dv`: the width of `qkv` (`q | k | v`, contiguous).
    pub fn conv_dim(&self) -> usize {
        2 * self.heads_k * self.dk + self.heads_v * self.dv
    }

    /// Bytes of one row's state: the conv tail in the input dtype plus the f32 recurrent state.
    pub fn state_bytes_per_row(&self) -> usize {
        (self.kernel - 1) * self.conv_dim() * self.dtype.itemsize() + self.heads_v * self.dv * self.dk * 4
    }

    fn validate(&self) -> Result<()> {
        let SsmSpec { kernel, heads_k, heads_v, dk, dv, .. } = *self;
        if kernel == 0 || heads_k == 0 || heads_v == 0 || dk == 0 || dv == 0 {
            return Err(invalid(format!("ssm spec with a zero dimension: {self:?}")));
        }
        if heads_v % heads_k != 0 {
            return Err(invalid(format!("Hv = {heads_v} is not a multiple of Hk = {heads_k}")));
        }
        dim(self.conv_dim() * kernel)?;
        dim(heads_v * dv * dk)?;
        Ok(())
    }
}

/// The layer's own weights that the cache-side arithmetic needs (the projections are not the cache's business).
/// Cloning shares the arrays (MLX arrays are immutable), which is how an armed round keeps the layer borrowed until
/// it resolves (R-SSM-2).
#[derive(Debug, Clone)]
pub struct GdnParams {
    /// Depthwise conv weight `[conv_dim, K, 1]` (mlx-lm's `conv1d.weight` after `sanitize`).
    pub conv_weight: Array,
    /// `A_log` `[Hv]` (any float dtype; cast to f32 as mlx-lm does).
    pub a_log: Array,
    /// `dt_bias` `[Hv]`.
    pub dt_bias: Array,
}

/// Prepared prefill padding (per row; decremented by each chunk's width, as mlx-lm's `ArraysCache.advance`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SsmPadding {
    /// Columns of left padding still ahead (may go negative once consumed).
    pub left: Vec<i64>,
    /// Columns before the trailing padding still ahead, left padding included (may go negative).
    pub lengths: Vec<i64>,
}

impl SsmPadding {
    /// Row `b`'s real window positions `[start, end)` in a chunk of width `n`: `pos >= left_b && pos < lengths_b`.
    fn real(&self, b: usize, n: usize) -> (usize, usize) {
        let n = n as i64;
        let start = self.left[b].clamp(0, n);
        let end = self.lengths[b].clamp(0, n).max(start);
        (start as usize, end as usize)
    }

    fn advance(&mut self, n: usize) {
        for x in self.left.iter_mut().chain(self.lengths.iter_mut()) {
            *x -= n as i64;
        }
    }
}

/// What an armed round's call recorded (R-C-6): the pre-round snapshot and the position-local inputs.
#[derive(Debug, Clone)]
struct Recorded {
    conv: Array,
    recurrent: Array,
    offsets: Vec<usize>,
    /// `qkv` after padding zeroing, `[B, S, conv_dim]`.
    qkv: Array,
    a: Array,
    b: Array,
    params: GdnParams,
    window: usize,
}

/// A speculative round: armed by `spec_round_begin`, recorded by the next layer call, resolved by commit or
/// rollback.
#[derive(Debug, Clone)]
struct Round {
    recorded: Option<Recorded>,
}

/// What the last call (or rollback) did, for the harness's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SsmStats {
    /// Rollbacks that replayed at least one position.
    pub replays: u64,
    /// Recurrence steps replayed, summed over rows.
    pub replayed_steps: u64,
}

/// One gated-DeltaNet layer's cache for `B` rows (see the module docs for the layout and guarantees).
#[derive(Debug, Clone)]
pub struct SsmCache {
    spec: SsmSpec,
    conv: Array,
    recurrent: Array,
    offsets: Vec<usize>,
    padding: Option<SsmPadding>,
    round: Option<Round>,
    stats: SsmStats,
}

/// A zero scalar of `dtype` (Python's weakly typed `0` keeps the array's dtype).
fn scalar(x: f64, dtype: Dtype) -> Result<Array> {
    Ok(Array::from_f32(x as f32).as_dtype(dtype)?)
}

fn shape_of(a: &Array) -> Vec<usize> {
    a.shape().iter().map(|&d| d.max(0) as usize).collect()
}

impl SsmCache {
    /// A fresh cache of `rows` rows: zero states, offsets 0.
    pub fn new(spec: SsmSpec, rows: usize) -> Result<Self> {
        spec.validate()?;
        let d = spec.dtype.to_mlx();
        let conv = zeros(&[rows, spec.kernel - 1, spec.conv_dim()], d)?;
        let recurrent = zeros(&[rows, spec.heads_v, spec.dv, spec.dk], Dtype::Float32)?;
        Ok(SsmCache {
            spec,
            conv,
            recurrent,
            offsets: vec![0; rows],
            padding: None,
            round: None,
            stats: SsmStats::default(),
        })
    }

    /// A cache holding these states (owned arrays) and offsets; shapes and dtypes are checked
    /// ([`CacheError::ShapeMismatch`]).
    pub fn from_states(spec: SsmSpec, conv: Array, recurrent: Array, offsets: Vec<usize>) -> Result<Self> {
        spec.validate()?;
        let rows = offsets.len();
        let want_conv = [rows, spec.kernel - 1, spec.conv_dim()];
        let want_rec = [rows, spec.heads_v, spec.dv, spec.dk];
        if shape_of(&conv) != want_conv || conv.dtype() != spec.dtype.to_mlx() {
            return Err(shape(format!("conv state {:?} {:?}, expected {want_conv:?}", conv.shape(), conv.dtype())));
        }
        if shape_of(&recurrent) != want_rec || recurrent.dtype() != Dtype::Float32 {
            return Err(shape(format!(
                "recurrent state {:?} {:?}, expected {want_rec:?} f32",
                recurrent.shape(),
                recurrent.dtype()
            )));
        }
        Ok(SsmCache { spec, conv, recurrent, offsets, padding: None, round: None, stats: SsmStats::default() })
    }

    /// The geometry.
    pub fn spec(&self) -> SsmSpec {
        self.spec
    }

    /// Number of rows `B`.
    pub fn rows(&self) -> usize {
        self.offsets.len()
    }

    /// Per-row offsets (positions consumed).
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }

    /// The scalar offset: the largest row offset (0 for an empty batch).
    pub fn offset(&self) -> usize {
        self.offsets.iter().copied().max().unwrap_or(0)
    }

    /// The conv state `[B, K-1, conv_dim]` (input dtype).
    pub fn conv(&self) -> &Array {
        &self.conv
    }

    /// The recurrent state `[B, Hv, Dv, Dk]` (f32).
    pub fn recurrent(&self) -> &Array {
        &self.recurrent
    }

    /// Row `r`'s two states as `[1, ...]` views.
    pub fn row_states(&self, r: usize) -> Result<(Array, Array)> {
        self.check_row(r)?;
        let (a, b) = (dim(r)?, dim(r + 1)?);
        Ok((self.conv.try_index((a..b, .., ..))?, self.recurrent.try_index((a..b, .., .., ..))?))
    }

    /// R-C-1: `ssm`.
    pub fn storage_kind(&self) -> StorageKind {
        StorageKind::new(SSM)
    }

    /// R-C-4: 0 (the state does not grow with the sequence).
    pub fn bytes_per_token(&self) -> usize {
        0
    }

    /// R-C-5: never (the recurrent state cannot drop positions; use speculative rounds).
    pub fn is_trimmable(&self) -> bool {
        false
    }

    /// R-C-5: always [`CacheError::RecurrentNotTrimmable`], state unchanged.
    pub fn trim(&mut self, _n: usize) -> Result<usize> {
        Err(CacheError::RecurrentNotTrimmable)
    }

    /// The prepared padding, if a prefill is pending.
    pub fn padding(&self) -> Option<&SsmPadding> {
        self.padding.as_ref()
    }

    /// Whether a prepared prefill is pending.
    pub fn is_pending(&self) -> bool {
        self.padding.is_some()
    }

    /// Whether a speculative round is armed (recorded or not).
    pub fn in_round(&self) -> bool {
        self.round.is_some()
    }

    /// Whether the armed round has recorded its call.
    pub fn round_recorded(&self) -> bool {
        self.round.as_ref().is_some_and(|r| r.recorded.is_some())
    }

    /// Replay counters since this cache was made.
    pub fn stats(&self) -> SsmStats {
        self.stats
    }

    fn check_row(&self, r: usize) -> Result<()> {
        if r >= self.rows() {
            return Err(CacheError::NoSuchRow { row: r, rows: self.rows() });
        }
        Ok(())
    }

    fn no_round(&self) -> Result<()> {
        if self.round.is_some() {
            return Err(CacheError::SpecRoundActive);
        }
        Ok(())
    }

    /// Merge sources' rows, in order, into a new cache (sources borrowed). Sources must share the spec
    /// ([`CacheError::ShapeMismatch`]) and have no pending prefill or armed round. A fresh source's zero states
    /// are its rows' states (mlx-lm's `ArraysCache.merge` zero-fills a source without state).
    pub fn merge(spec: SsmSpec, sources: &[&SsmCache]) -> Result<Self> {
        spec.validate()?;
        for s in sources {
            if s.spec != spec {
                return Err(shape(format!("merge source spec {:?} differs from {spec:?}", s.spec)));
            }
            if s.padding.is_some() {
                return Err(CacheError::PendingPrefill);
            }
            s.no_round()?;
        }
        if sources.is_empty() {
            return Self::new(spec, 0);
        }
        let convs: Vec<&Array> = sources.iter().map(|s| &s.conv).collect();
        let recs: Vec<&Array> = sources.iter().map(|s| &s.recurrent).collect();
        let conv = mlx_rs::ops::concatenate(&convs, 0)?;
        let recurrent = mlx_rs::ops::concatenate(&recs, 0)?;
        eval(&[&conv, &recurrent])?;
        let offsets = sources.iter().flat_map(|s| s.offsets.iter().copied()).collect();
        Self::from_states(spec, conv, recurrent, offsets)
    }

    /// Keep these rows, in this order ([`CacheError::NoSuchRow`], [`CacheError::DuplicateRow`]); a pending
    /// prefill's padding is filtered with its rows. Refused during a round.
    pub fn filter(&mut self, keep: &[usize]) -> Result<()> {
        self.no_round()?;
        let mut seen = vec![false; self.rows()];
        for &r in keep {
            self.check_row(r)?;
            if std::mem::replace(&mut seen[r], true) {
                return Err(CacheError::DuplicateRow { row: r });
            }
        }
        let idx = index_array(keep, &[keep.len()])?;
        let conv = self.conv.take_axis(&idx, 0)?;
        let recurrent = self.recurrent.take_axis(&idx, 0)?;
        eval(&[&conv, &recurrent])?;
        let offsets: Vec<usize> = keep.iter().map(|&r| self.offsets[r]).collect();
        let padding = self.padding.as_ref().map(|p| {
            let mut left: Vec<i64> = keep.iter().map(|&r| p.left[r]).collect();
            let mut lengths: Vec<i64> = keep.iter().map(|&r| p.lengths[r]).collect();
            if fault!(SsmFilterShiftsEmptyPadding) && offsets.iter().all(|&o| o == 0) {
                // The planted bug (mlx-lm#1736's class): an empty batch's filter shifts the shared left padding
                // off, as if leading columns had been dropped.
                let shift = left.iter().copied().min().unwrap_or(0).max(0);
                left.iter_mut().for_each(|x| *x -= shift);
                lengths.iter_mut().for_each(|x| *x -= shift);
            }
            SsmPadding { left, lengths }
        });
        self.conv = conv;
        self.recurrent = recurrent;
        self.offsets = offsets;
        self.padding = padding;
        Ok(())
    }

    /// Row `r` as a one-row cache: compact copies (gathered, so their memory is the row's own), `offsets =
    /// [offset_r]`. Refused during a round or a pending prefill.
    pub fn extract(&self, r: usize) -> Result<SsmCache> {
        self.check_row(r)?;
        self.no_round()?;
        if self.padding.is_some() {
            return Err(CacheError::PendingPrefill);
        }
        let idx = index_array(&[r], &[1])?;
        let conv = self.conv.take_axis(&idx, 0)?;
        let recurrent = self.recurrent.take_axis(&idx, 0)?;
        eval(&[&conv, &recurrent])?;
        Self::from_states(self.spec, conv, recurrent, vec![self.offsets[r]])
    }

    /// Prepared prefill padding (R-SSM-3): `lengths[b]` counts input columns before row `b`'s trailing padding,
    /// left padding included; `left_padding[b] <= lengths[b]` (empty = no left padding). The next window calls
    /// consume it; [`SsmCache::finalize`] ends it. Refused while one is pending or during a round.
    pub fn prepare(&mut self, lengths: &[usize], left_padding: &[usize]) -> Result<()> {
        self.no_round()?;
        if self.padding.is_some() {
            return Err(CacheError::PendingPrefill);
        }
        let left: Vec<usize> = if left_padding.is_empty() { vec![0; self.rows()] } else { left_padding.to_vec() };
        if lengths.len() != self.rows() || left.len() != self.rows() {
            return Err(CacheError::BadLengths {
                what: format!("{} lengths and {} left paddings for {} rows", lengths.len(), left.len(), self.rows()),
            });
        }
        if let Some(b) = (0..self.rows()).find(|&b| left[b] > lengths[b]) {
            return Err(CacheError::BadLengths {
                what: format!("row {b}: left padding {} exceeds length {}", left[b], lengths[b]),
            });
        }
        let to_i64 = |v: &[usize]| v.iter().map(|&x| i64::try_from(x).unwrap_or(i64::MAX)).collect::<Vec<_>>();
        self.padding = Some(SsmPadding { left: to_i64(&left), lengths: to_i64(lengths) });
        Ok(())
    }

    /// End a prepared prefill. Nothing to roll: padded positions never entered either state, and offsets advanced
    /// by real counts only.
    pub fn finalize(&mut self) -> Result<()> {
        if self.padding.take().is_none() {
            return Err(CacheError::NoPendingPrefill);
        }
        Ok(())
    }

    /// Decode: one position per row, no prefill pending ([`CacheError::PendingPrefill`]). Returns `y [B, 1, Hv, Dv]`.
    pub fn decode(&mut self, qkv: &Array, a: &Array, b: &Array, params: &GdnParams) -> Result<Array> {
        if self.padding.is_some() {
            return Err(CacheError::PendingPrefill);
        }
        let s = self.check_inputs(qkv, a, b, params)?;
        if s != 1 {
            return Err(shape(format!("decode takes one position per row, got {s}")));
        }
        self.call(qkv, a, b, params)
    }

    /// A committed span (R-ROT-7, `decode_by_position`): the `S` positions of every row go through the layer one
    /// step at a time (`S` calls of [`SsmCache::decode`]), so every output and both states after the span are
    /// byte-identical to `S` single decodes: each position keeps the single-step conv and recurrence. Returns the
    /// outputs concatenated, `y [B, S, Hv, Dv]`. Refused before any change: a pending prefill
    /// ([`CacheError::PendingPrefill`]), an armed speculative round ([`CacheError::SpecRoundActive`]: a span is
    /// committed, never speculative), inputs of another shape ([`CacheError::ShapeMismatch`]).
    pub fn commit_span(&mut self, qkv: &Array, a: &Array, b: &Array, params: &GdnParams) -> Result<Array> {
        if self.padding.is_some() {
            return Err(CacheError::PendingPrefill);
        }
        if self.in_round() {
            return Err(CacheError::SpecRoundActive);
        }
        let s = self.check_inputs(qkv, a, b, params)?;
        let mut outs = Vec::with_capacity(s);
        for i in 0..s {
            let t = dim(i)?;
            let at = |x: &Array| x.try_index((.., t..t + 1, ..));
            outs.push(self.decode(&at(qkv)?, &at(a)?, &at(b)?, params)?);
        }
        Ok(mlx_rs::ops::concatenate(&outs, 1)?)
    }

    /// Window: S positions per row (prefill chunks, verify windows, committed spans), consuming prepared padding.
    /// Returns `y [B, S, Hv, Dv]`; outputs at padded positions are unspecified.
    pub fn window(&mut self, qkv: &Array, a: &Array, b: &Array, params: &GdnParams) -> Result<Array> {
        self.check_inputs(qkv, a, b, params)?;
        self.call(qkv, a, b, params)
    }

    fn check_inputs(&self, qkv: &Array, a: &Array, b: &Array, params: &GdnParams) -> Result<usize> {
        let sp = &self.spec;
        let d = sp.dtype.to_mlx();
        let q = shape_of(qkv);
        if q.len() != 3 || q[0] != self.rows() || q[2] != sp.conv_dim() || q[1] == 0 || qkv.dtype() != d {
            return Err(shape(format!(
                "qkv {:?} {:?}, expected [{}, S >= 1, {}] {:?}",
                qkv.shape(),
                qkv.dtype(),
                self.rows(),
                sp.conv_dim(),
                sp.dtype
            )));
        }
        let s = q[1];
        for (name, x) in [("a", a), ("b", b)] {
            if shape_of(x) != [self.rows(), s, sp.heads_v] || x.dtype() != d {
                return Err(shape(format!(
                    "{name} {:?} {:?}, expected [{}, {s}, {}]",
                    x.shape(),
                    x.dtype(),
                    self.rows(),
                    sp.heads_v
                )));
            }
        }
        if shape_of(&params.conv_weight) != [sp.conv_dim(), sp.kernel, 1] || params.conv_weight.dtype() != d {
            return Err(shape(format!(
                "conv weight {:?}, expected [{}, {}, 1]",
                params.conv_weight.shape(),
                sp.conv_dim(),
                sp.kernel
            )));
        }
        for (name, x) in [("A_log", &params.a_log), ("dt_bias", &params.dt_bias)] {
            if shape_of(x) != [sp.heads_v] || !matches!(x.dtype(), Dtype::Float32 | Dtype::Bfloat16 | Dtype::Float16) {
                return Err(shape(format!("{name} {:?} {:?}, expected [{}] float", x.shape(), x.dtype(), sp.heads_v)));
            }
        }
        if self.round_recorded() {
            return Err(CacheError::SpecRoundAlreadyRecorded);
        }
        Ok(s)
    }

    /// The checked call: real ranges from the padding, the forward, the round's recording, the state swap.
    fn call(&mut self, qkv: &Array, a: &Array, b: &Array, params: &GdnParams) -> Result<Array> {
        let s = shape_of(qkv)[1];
        let rows = self.rows();
        let real: Vec<(usize, usize)> = match &self.padding {
            Some(p) => (0..rows).map(|r| p.real(r, s)).collect(),
            None => vec![(0, s); rows],
        };
        let recurrent_real: Vec<(usize, usize)> = if fault!(SsmMaskIgnoresLeftPadding) {
            // The planted bug (bug catalog #1): the recurrent mask is `pos < lengths` only, so left padding steps
            // are folded into the state (the conv input is still zeroed and taken right).
            real.iter().map(|&(_, e)| (0, e)).collect()
        } else {
            real.clone()
        };
        let tail_at_padded_end = fault!(SsmConvTailAtPaddedEnd) && self.padding.is_some();
        let out = forward(
            &self.spec,
            &self.conv,
            &self.recurrent,
            qkv,
            a,
            b,
            params,
            &real,
            &recurrent_real,
            tail_at_padded_end,
        )?;
        if let Some(round) = self.round.as_mut() {
            round.recorded = Some(Recorded {
                conv: self.conv.clone(),
                recurrent: self.recurrent.clone(),
                offsets: self.offsets.clone(),
                qkv: out.qkv_zeroed.clone(),
                a: a.clone(),
                b: b.clone(),
                params: params.clone(),
                window: s,
            });
        }
        let padded_offsets = fault!(SsmFinalizeKeepsPaddedHistory) && self.padding.is_some();
        for (r, &(st, en)) in real.iter().enumerate() {
            self.offsets[r] += if padded_offsets { s } else { en - st };
        }
        if let Some(p) = self.padding.as_mut() {
            p.advance(s);
        }
        self.conv = out.conv;
        self.recurrent = out.recurrent;
        if super::ring::eval_after_write() {
            eval(&[&self.conv, &self.recurrent])?;
        }
        Ok(out.y)
    }

    /// R-C-6: arm a speculative round before the verify forward. Refused while a round is armed
    /// ([`CacheError::SpecRoundActive`]) or a prefill is pending.
    pub fn spec_round_begin(&mut self) -> Result<()> {
        self.no_round()?;
        if self.padding.is_some() {
            return Err(CacheError::PendingPrefill);
        }
        self.round = Some(Round { recorded: None });
        Ok(())
    }

    /// Full accept: keep the post-round state, drop the snapshot and recordings. [`CacheError::NoSpecRound`]
    /// without an armed round.
    pub fn spec_round_commit(&mut self) -> Result<()> {
        if self.round.take().is_none() {
            return Err(CacheError::NoSpecRound);
        }
        Ok(())
    }

    /// Partial accept, one `keep` for every row: restore the snapshot and replay the first `keep` positions.
    pub fn spec_round_rollback(&mut self, keep: usize) -> Result<()> {
        let keeps = vec![keep; self.rows()];
        self.spec_round_rollback_rows(&keeps)
    }

    /// Partial accept per row: restore the snapshot and replay exactly `keep[b]` positions of row `b` (0 leaves the
    /// row's restored state untouched). Errors, state unchanged: [`CacheError::NoSpecRound`],
    /// [`CacheError::SpecRoundNotRecorded`], [`CacheError::BadLengths`] (wrong count),
    /// [`CacheError::KeepOutsideWindow`].
    pub fn spec_round_rollback_rows(&mut self, keep: &[usize]) -> Result<()> {
        let round = self.round.as_ref().ok_or(CacheError::NoSpecRound)?;
        let rec = round.recorded.as_ref().ok_or(CacheError::SpecRoundNotRecorded)?;
        if keep.len() != self.rows() {
            return Err(CacheError::BadLengths { what: format!("{} keeps for {} rows", keep.len(), self.rows()) });
        }
        if let Some(&k) = keep.iter().find(|&&k| k > rec.window) {
            return Err(CacheError::KeepOutsideWindow { keep: k, window: rec.window });
        }
        let keep: Vec<usize> = keep
            .iter()
            .map(|&k| match (fault!(SsmReplayOneMore), fault!(SsmReplayOneFewer)) {
                (true, _) => (k + 1).min(rec.window),
                (false, true) => k.saturating_sub(1),
                (false, false) => k,
            })
            .collect();
        let count = keep.iter().copied().max().unwrap_or(0);
        let (mut conv, mut recurrent, mut offsets) = (rec.conv.clone(), rec.recurrent.clone(), rec.offsets.clone());
        if fault!(SsmRollbackNeighbourSnapshot) && self.rows() > 1 {
            // The planted bug: each row gets its neighbour's pre-round states.
            let n = self.rows();
            let idx = index_array(&(0..n).map(|b| (b + 1) % n).collect::<Vec<_>>(), &[n])?;
            conv = conv.take_axis(&idx, 0)?;
            recurrent = recurrent.take_axis(&idx, 0)?;
        }
        if count > 0 {
            let c = dim(count)?;
            let qkv = rec.qkv.try_index((.., 0..c, ..))?;
            let a = rec.a.try_index((.., 0..c, ..))?;
            let b = rec.b.try_index((.., 0..c, ..))?;
            let real: Vec<(usize, usize)> = keep.iter().map(|&k| (0, k)).collect();
            let out = forward(&self.spec, &conv, &recurrent, &qkv, &a, &b, &rec.params, &real, &real, false)?;
            eval(&[&out.conv, &out.recurrent])?;
            conv = out.conv;
            recurrent = out.recurrent;
            for (o, &k) in offsets.iter_mut().zip(&keep) {
                *o += k;
            }
            self.stats.replays += 1;
            self.stats.replayed_steps += keep.iter().map(|&k| k as u64).sum::<u64>();
        }
        self.conv = conv;
        self.recurrent = recurrent;
        self.offsets = offsets;
        self.round = None;
        Ok(())
    }
}

/// The results of one forward.
struct Forward {
    y: Array,
    conv: Array,
    recurrent: Array,
    qkv_zeroed: Array,
}

/// A `[B, n]` bool mask from per-row real ranges; `None` when every position is real.
fn range_mask(real: &[(usize, usize)], n: usize) -> Result<Option<Array>> {
    if real.iter().all(|&(s, e)| s == 0 && e == n) {
        return Ok(None);
    }
    let v: Vec<bool> = real.iter().flat_map(|&(s, e)| (0..n).map(move |t| t >= s && t < e)).collect();
    Ok(Some(Array::from_slice(&v, &[dim(real.len())?, dim(n)?])))
}

/// The layer's cache-side arithmetic for rows whose real window positions are `real[b] = [start, end)` (conv and
/// zeroing) and `recurrent_real[b]` (the recurrence's mask; equal to `real` except under a mutant).
#[allow(clippy::too_many_arguments)]
fn forward(
    spec: &SsmSpec,
    conv_state: &Array,
    state: &Array,
    qkv: &Array,
    a: &Array,
    b: &Array,
    params: &GdnParams,
    real: &[(usize, usize)],
    recurrent_real: &[(usize, usize)],
    tail_at_padded_end: bool,
) -> Result<Forward> {
    let rows = real.len();
    let s = shape_of(qkv)[1];
    let (k, c) = (spec.kernel, spec.conv_dim());
    let (hk, hv, dk, dv) = (spec.heads_k, spec.heads_v, spec.dk, spec.dv);
    let dtype = spec.dtype.to_mlx();
    let (bi, si, ci) = (dim(rows)?, dim(s)?, dim(c)?);

    // 1. Zero padded positions (mlx-lm: `qkv = where(mask[..., None], qkv, 0)`).
    let mask = range_mask(real, s)?;
    let qkv_zeroed = match &mask {
        Some(m) => mlx_rs::ops::select(&m.reshape(&[bi, si, 1])?, qkv, &scalar(0.0, dtype)?)?,
        None => qkv.clone(),
    };

    // 2. Each row's stream: conv rows then its real qkv rows. Index into concat(conv, qkv) along axis 1.
    let cat = mlx_rs::ops::concatenate(&[conv_state, &qkv_zeroed], 1)?;
    let stream = |r: usize, i: usize| if i < k - 1 { i } else { i + real[r].0 };
    let mut win_idx = Vec::with_capacity(rows * s * k);
    for (r, &(st, en)) in real.iter().enumerate() {
        for t in 0..s {
            if t >= st && t < en {
                win_idx.extend((0..k).map(|j| stream(r, t - st + j)));
            } else if stream(r, k - 1) < k - 1 + s {
                // A padded position: its output is discarded and its state step masked; it reads the first `k`
                // rows of the row's stream.
                win_idx.extend((0..k).map(|j| stream(r, j)));
            } else {
                // A row with no real position in this window (its real range starts at `s`): its stream holds only
                // the conv rows, so it reads the `k` rows ending at its own zeroed input, inside `cat` (`k - 1 + s`
                // rows). Reading the stream from its start ran one row past the end, and MLX's gather then read
                // memory outside the array: padded outputs, and the run hash, varied run to run (seed 46).
                win_idx.extend((0..k).map(|j| t + j));
            }
        }
    }
    let win = take_along_axis(&cat, index_array(&win_idx, &[rows, s * k, 1])?, 1)?.reshape(&[bi, si, dim(k)?, ci])?;

    // 3. Depthwise conv: f32 products summed in ascending j from +0, one rounding, then silu.
    let w = params.conv_weight.reshape(&[ci, dim(k)?])?.as_dtype(Dtype::Float32)?;
    let mut acc = zeros(&[rows, s, c], Dtype::Float32)?;
    for j in 0..k {
        let jj = dim(j)?;
        let x = win.try_index((.., .., jj, ..))?.as_dtype(Dtype::Float32)?;
        let wj = w.try_index((.., jj))?;
        acc = acc.add(x.multiply(&wj)?)?;
    }
    let conv_out = acc.as_dtype(dtype)?;
    let conv_out = conv_out.multiply(mlx_rs::ops::sigmoid(&conv_out)?)?;

    // 4. New conv tail: the last K-1 rows of each row's stream (its real end).
    let tail_idx: Vec<usize> = real
        .iter()
        .enumerate()
        .flat_map(|(r, &(st, en))| {
            let n = en - st;
            (0..k - 1).map(move |j| if tail_at_padded_end { s + j } else { stream(r, n + j) })
        })
        .collect();
    let new_conv = take_along_axis(&cat, index_array(&tail_idx, &[rows, k - 1, 1])?, 1)?;

    // 5. Split and normalize (mlx-lm `normalize_qk`: inv = Dk^-1/2; rms eps = 1e-6 inv^2; scalars in q's dtype).
    let kd = dim(hk * dk)?;
    let q = conv_out.try_index((.., .., 0..kd))?.reshape(&[bi, si, dim(hk)?, dim(dk)?])?;
    let kk = conv_out.try_index((.., .., kd..2 * kd))?.reshape(&[bi, si, dim(hk)?, dim(dk)?])?;
    let v = conv_out.try_index((.., .., 2 * kd..ci))?.reshape(&[bi, si, dim(hv)?, dim(dv)?])?;
    let inv = (dk as f64).powf(-0.5);
    let rms_eps = (1e-6 * inv * inv) as f32;
    let q = scalar(inv * inv, dtype)?.multiply(mlx_rs::fast::rms_norm(&q, None, rms_eps)?)?;
    let kk = scalar(inv, dtype)?.multiply(mlx_rs::fast::rms_norm(&kk, None, rms_eps)?)?;
    // Repeat key heads for the value heads (mlx-lm `mx.repeat(q, Hv // Hk, -2)`: head h reads key head h / rep).
    let (q, kk) = if hv > hk {
        let rep = hv / hk;
        let idx = index_array(&(0..hv).map(|h| h / rep).collect::<Vec<_>>(), &[hv])?;
        (q.take_axis(&idx, 2)?, kk.take_axis(&idx, 2)?)
    } else {
        (q, kk)
    };

    // Gates: beta = sigmoid(b); g = exp(-exp(f32(A_log)) * softplus(a + dt_bias)), softplus = logaddexp(x, 0).
    let beta = mlx_rs::ops::sigmoid(b)?;
    let x = a.add(&params.dt_bias)?;
    let softplus = mlx_rs::ops::logaddexp(&x, scalar(0.0, x.dtype())?)?;
    let g = params.a_log.as_dtype(Dtype::Float32)?.exp()?.negative()?.multiply(&softplus)?.exp()?;

    // 6. The recurrence, one step per position; masked steps keep the state's bytes.
    let rmask = range_mask(recurrent_real, s)?;
    let mut st = state.clone();
    let mut ys = Vec::with_capacity(s);
    for t in 0..s {
        let ti = dim(t)?;
        let q_t = q.try_index((.., ti, .., ..))?; // [B, Hv, Dk]
        let k_t = kk.try_index((.., ti, .., ..))?.expand_dims(2)?; // [B, Hv, 1, Dk]
        let v_t = v.try_index((.., ti, .., ..))?; // [B, Hv, Dv]
        let g_t = g.try_index((.., ti, ..))?.reshape(&[bi, dim(hv)?, 1, 1])?;
        let beta_t = beta.try_index((.., ti, ..))?.expand_dims(2)?; // [B, Hv, 1]
        let old = st.clone();
        let decayed = st.multiply(&g_t)?;
        let kv_mem = decayed.multiply(&k_t)?.sum_axis(-1, None)?;
        let delta = v_t.subtract(&kv_mem)?.multiply(&beta_t)?;
        let new = decayed.add(k_t.multiply(delta.expand_dims(3)?)?)?;
        let y = new.multiply(q_t.expand_dims(2)?)?.sum_axis(-1, None)?;
        st = match &rmask {
            Some(m) => {
                let col = m.try_index((.., ti))?.reshape(&[bi, 1, 1, 1])?;
                mlx_rs::ops::select(&col, &new, &old)?
            }
            None => new,
        };
        ys.push(y.as_dtype(dtype)?);
    }
    let y = mlx_rs::ops::stack(&ys, 1)?;
    Ok(Forward { y, conv: new_conv, recurrent: st, qkv_zeroed })
}

#[cfg(test)]
mod tests;
