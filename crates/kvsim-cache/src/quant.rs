//! The affine-quantized family: [`QuantizedKvCache`] (`kv:quant:<bits>:<group>`) and
//! [`RotatingQuantizedKvCache`] (`kv:rotating-quant:<bits>:<group>`), their row batches, and the quantized read.
//!
//! A quantized cache is the serial core of [`super::ring`] (or the rows of [`super::batch`]) with another
//! [`Storage`]: every K and V plane is stored as MLX's affine triple `(packed u32, scales, biases)`, so a cache holds
//! six planes `[kq, ks, kb, vq, vs, vb]`, each `[B, H_kv, cap, ·]` with the token axis at 2. Groups run along
//! head_dim (never tokens), so every column op of the plain layouts (slices, scatters, gathers, concatenations) is
//! byte-safe on the six planes, and the ring/row bookkeeping is exactly the plain one (`RingState`, `RowState`).
//!
//! Facts (MLX 0.32.2 / mlx-lm 0.32.2, cited where used):
//! - `mx.quantize(w, group_size, bits)` (affine; `mlx/ops.cpp` `affine_quantize`) allows bits {2, 3, 4, 5, 6, 8} and
//!   group {32, 64, 128} and needs the last axis divisible by the group. Packed width is `D * bits / 32` u32 words;
//!   scales and biases are `[.., D / group]` in the input dtype.
//! - mlx-lm's `QuantizedKVCache.update_and_fetch` allocates the packed plane as `dim // (32 // bits)` words, wrong for
//!   3, 5 and 6 bits when `D` is 128 (20 vs 21, 24 vs 25: its broadcast error); kvsim uses `D * bits / 32`
//!   ([`packed_width`]), so 5 and 6 bits work here.
//! - Reads follow mlx-lm's `quantized_scaled_dot_product_attention` (`mlx_lm/models/base.py`): queries scaled in
//!   their own dtype, GQA reshape to `(B, H_kv, rep, L, D)` with the triples expanded at axis -3,
//!   `quantized_matmul(transpose=True)`, a boolean mask applied as `where(mask, scores, finfo(dtype).min)`,
//!   `softmax(precise=True)`, `quantized_matmul(transpose=False)`. Causal reads build mlx-lm's
//!   `q_idx >= k_idx` mask with `q_idx = arange(kL - qL, kL)`.
//!
//! # What is guaranteed
//! - **Stored bytes**: every write quantizes its incoming block through MLX (`quantize`), so stored bytes are MLX's;
//!   since quantization is per (position, head, group), a position's triple bytes do not depend on what else was
//!   in the block, and a row's six planes are byte-identical to a serial quantized cache fed the same blocks,
//!   in the same physical order (and to a plain cache of the same history converted by `to_quantized`).
//! - **Decode outputs** of unpadded rows: the quantized matmuls and softmax are row-independent on CPU, so they are
//!   byte-identical to the serial twin's (measured by the tests here; a property of MLX's CPU kernels, not of this
//!   module). Padded reads (a row masked, a window read) are measured in ULPs against the twin and the f64 model.

use mlx_rs::Array;

use super::error::{shape, CacheError};
use super::util::dim;
use super::{KvSpec, Result};

/// The affine bit widths MLX's `quantize` accepts.
pub const QUANT_BITS: [usize; 6] = [2, 3, 4, 5, 6, 8];
/// The group sizes MLX's `quantize` accepts.
pub const QUANT_GROUPS: [usize; 3] = [32, 64, 128];

/// Affine quantization parameters: `bits` per element, one (scale, bias) per `group` elements of head_dim.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct QuantSpec {
    /// Bits per quantized element, one of [`QUANT_BITS`]; a packed row is [`packed_width`] u32 words.
    pub bits: usize,
    /// Elements of head_dim sharing one scale and one bias, one of [`QUANT_GROUPS`]; must divide `head_dim`.
    pub group: usize,
}

impl QuantSpec {
    /// Valid parameters for this head dim, else [`CacheError::InvalidQuant`]: bits in [`QUANT_BITS`], group in
    /// [`QUANT_GROUPS`], `head_dim` a multiple of the group (MLX's own rules, `mlx/ops.cpp` `affine_quantize`).
    pub fn validate(&self, head_dim: usize) -> Result<()> {
        let bad = |what: &str| {
            Err(CacheError::InvalidQuant { bits: self.bits, group: self.group, head_dim, what: what.to_string() })
        };
        if !QUANT_BITS.contains(&self.bits) {
            return bad("bits must be one of 2, 3, 4, 5, 6, 8");
        }
        if !QUANT_GROUPS.contains(&self.group) {
            return bad("group must be one of 32, 64, 128");
        }
        if !head_dim.is_multiple_of(self.group) {
            return bad("head_dim is not a multiple of the group");
        }
        Ok(())
    }
}

/// How a cache stores K and V.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum Storage {
    /// K and V as they are, in the spec's dtype: two planes `[k, v]`.
    #[default]
    Plain,
    /// MLX affine triples: six planes `[kq, ks, kb, vq, vs, vb]`.
    Affine(QuantSpec),
}

/// u32 words of one packed row of `head_dim` elements at `bits`: `D * bits / 32` (`quantize`'s output width; 3-,
/// 5- and 6-bit chunks run across word boundaries). Mutation hook `Mutant::QuantPackedWidthDivides` (mlx-lm's
/// `D // (32 // bits)`).
pub fn packed_width(head_dim: usize, bits: usize) -> usize {
    if fault!(QuantPackedWidthDivides) {
        head_dim / (32 / bits)
    } else {
        head_dim * bits / 32
    }
}

impl Storage {
    /// Valid storage for this spec (see [`QuantSpec::validate`]).
    pub fn validate(&self, spec: &KvSpec) -> Result<()> {
        match self {
            Storage::Plain => Ok(()),
            Storage::Affine(q) => q.validate(spec.head_dim),
        }
    }

    /// The quantization parameters, if quantized.
    pub fn quant(&self) -> Option<QuantSpec> {
        match self {
            Storage::Plain => None,
            Storage::Affine(q) => Some(*q),
        }
    }

    /// Planes per cache (2 plain, 6 quantized); K's come first.
    pub fn planes(&self) -> usize {
        match self {
            Storage::Plain => 2,
            Storage::Affine(_) => 6,
        }
    }

    /// Last-axis width and dtype of every plane.
    pub fn plane_layout(&self, spec: &KvSpec) -> Vec<(usize, mlx_rs::Dtype)> {
        let dt = spec.dtype.to_mlx();
        match self {
            Storage::Plain => vec![(spec.head_dim, dt); 2],
            Storage::Affine(q) => {
                let side = [
                    (packed_width(spec.head_dim, q.bits), mlx_rs::Dtype::Uint32),
                    (spec.head_dim / q.group, dt),
                    (spec.head_dim / q.group, dt),
                ];
                side.iter().chain(side.iter()).copied().collect()
            }
        }
    }

    /// Bytes one token costs one row: both sides' planes (R-C-4). Plain: `2 * H_kv * D * itemsize`; quantized:
    /// `2 * H_kv * (4 * D * bits / 32 + 2 * (D / group) * itemsize)` (packed words, scales and biases).
    pub fn bytes_per_token(&self, spec: &KvSpec) -> usize {
        let itemsize = |d: mlx_rs::Dtype| if d == mlx_rs::Dtype::Uint32 { 4 } else { spec.dtype.itemsize() };
        self.plane_layout(spec).iter().map(|&(w, d)| spec.heads_kv * w * itemsize(d)).sum()
    }

    /// A write's incoming block as planes: `[k, v]`, or each quantized through MLX's `quantize` **on the CPU
    /// stream** (per block), so the stored bytes are MLX's CPU quantizer's on every device: MLX's CUDA quantizer
    /// rounds some groups differently (measured on an H200: packed words and scales that differ from the CPU's), and
    /// a cache whose bytes depended on the device could not be checked against one reference model, nor persisted
    /// to the same file. On a GPU this costs a CPU hop per write of quantized storage.
    pub fn encode(&self, k: &Array, v: &Array) -> Result<Vec<Array>> {
        match self {
            Storage::Plain => Ok(vec![k.clone(), v.clone()]),
            Storage::Affine(q) => {
                let (g, b) = (dim(q.group)?, dim(q.bits)?);
                // The CPU's default stream (`with_device` would create a new stream, and MLX a new thread, per
                // call: a long GPU run then fails with "Resource temporarily unavailable").
                mlx_rs::with_stream(&mlx_rs::Stream::cpu(), || {
                    let (kq, ks, kb) = mlx_rs::ops::quantize(k, g, b)?;
                    let (vq, vs, vb) = mlx_rs::ops::quantize(v, g, b)?;
                    Ok(vec![kq, ks, kb, vq, vs, vb])
                })
            }
        }
    }

    /// Dense K and V of planes: the planes themselves, or MLX's `dequantize` of each triple (CPU: `q * scale` then
    /// `+ bias`, each rounded to the dtype; MLX's CPU `affine_quantize`).
    pub fn dense(&self, planes: &[Array]) -> Result<(Array, Array)> {
        check_planes(self, planes)?;
        match self {
            Storage::Plain => Ok((planes[0].clone(), planes[1].clone())),
            Storage::Affine(q) => {
                let (g, b) = (dim(q.group)?, dim(q.bits)?);
                if planes[0].size() == 0 {
                    // MLX's dequantize cannot reshape an empty array: a view of no positions is the empty dense
                    // array of the planes' shape with the head dim unpacked.
                    let mut shape = planes[0].shape().to_vec();
                    if let Some(last) = shape.last_mut() {
                        *last = *last * 32 / b;
                    }
                    let dt = planes[1].dtype();
                    let empty = mlx_rs::ops::zeros_dtype(&shape, dt)?;
                    return Ok((empty.clone(), empty));
                }
                let k = mlx_rs::ops::dequantize(&planes[0], &planes[1], &planes[2], g, b)?;
                let v = mlx_rs::ops::dequantize(&planes[3], &planes[4], &planes[5], g, b)?;
                Ok((k, v))
            }
        }
    }

    /// Planes of this storage from plain K and V buffers, as laid out (every column, padding included, as mlx-lm's
    /// `KVCache.to_quantized` quantizes the whole allocated buffer).
    pub(crate) fn convert(&self, planes: &[Array]) -> Result<Vec<Array>> {
        if planes.len() != 2 {
            return Err(shape(format!("conversion takes plain planes, {} given", planes.len())));
        }
        self.encode(&planes[0], &planes[1])
    }
}

/// The read of any storage: MLX's fused SDPA over `[k, v]` (`super::mask::attend`) or [`quantized_attend`]; in
/// [`super::ReadMode::Exact`] on a GPU, the exact read over `[k, v]`; on a GPU, quantized planes are dequantized
/// first.
pub(crate) fn attend_planes(
    storage: &Storage,
    q: &Array,
    planes: &[Array],
    scale: f32,
    mask: Option<(&super::mask::MaskSpec, &Array)>,
    causal: bool,
) -> Result<Array> {
    check_planes(storage, planes)?;
    match storage {
        Storage::Plain => super::read::attend(q, &planes[0], &planes[1], scale, mask, causal),
        // On a GPU: MLX's `dequantize` (elementwise: each value a function of its own code, scale and bias, whatever
        // else is in the batch), then the read of dense K/V (`super::read::attend`: fused SDPA, or in exact mode the
        // batch-invariant kernels of `super::exact`). MLX 0.32.2's CUDA `quantized_matmul` has no kernel for most of
        // the small shapes a simulator draws (measured on an H200: "No implementation for problem shape" for 4-,
        // 5- and 6-bit reads of head dim 128 over a handful of keys), so mlx-lm's quantized read cannot run there.
        Storage::Affine(_) if super::exact::default_device_is_gpu() => {
            let (k, v) = storage.dense(planes)?;
            super::read::attend(q, &k, &v, scale, mask, causal)
        }
        Storage::Affine(quant) => quantized_attend(q, planes, *quant, scale, mask.map(|m| m.1), causal),
    }
}

/// Check planes given to a cache: this storage's count, each `[rows, H_kv, L, width_i]` of the plane's dtype, one
/// `L` for all; returns `L`.
pub(crate) fn check_planes_shape(spec: &KvSpec, storage: &Storage, planes: &[Array], rows: usize) -> Result<usize> {
    check_planes(storage, planes)?;
    let mut len = None;
    for (i, (p, (w, dt))) in planes.iter().zip(storage.plane_layout(spec)).enumerate() {
        let d: Vec<usize> = p.shape().iter().map(|&x| x.max(0) as usize).collect();
        if d.len() != 4 || d[0] != rows || d[1] != spec.heads_kv || d[3] != w || p.dtype() != dt {
            return Err(shape(format!(
                "plane {i} has shape {:?} and dtype {:?}, expected [{rows}, {}, L, {w}] of {dt:?}",
                p.shape(),
                p.dtype(),
                spec.heads_kv
            )));
        }
        if *len.get_or_insert(d[2]) != d[2] {
            return Err(shape(format!("plane {i} has {} columns, plane 0 has {len:?}", d[2])));
        }
    }
    Ok(len.unwrap_or(0))
}

fn check_planes(storage: &Storage, planes: &[Array]) -> Result<()> {
    if planes.len() != storage.planes() {
        return Err(shape(format!("{} planes given, {:?} storage has {}", planes.len(), storage, storage.planes())));
    }
    Ok(())
}

/// The quantized read (mlx-lm 0.32.2 `mlx_lm/models/base.py`, `quantized_scaled_dot_product_attention`): `q`
/// `[B, H_q, L, D]` over the six planes `[B, H_kv, S, ·]`; `mask` a bool `[B, 1, L, S]` (true = visible); `causal`
/// (without a mask) builds `q_idx >= k_idx` with `q_idx = arange(S - L, S)`. Output `[B, H_q, L, D]` in q's dtype.
pub(crate) fn quantized_attend(
    q: &Array,
    planes: &[Array],
    quant: QuantSpec,
    scale: f32,
    mask: Option<&Array>,
    causal: bool,
) -> Result<Array> {
    check_planes(&Storage::Affine(quant), planes)?;
    let (g, bits) = (dim(quant.group)?, dim(quant.bits)?);
    let qs = q.shape().to_vec();
    let (b, hq, l, d) = (qs[0], qs[1], qs[2], qs[3]);
    let hkv = planes[0].shape()[1];
    let s = planes[0].shape()[2];
    let rep = if hkv > 0 { hq / hkv } else { 1 };
    // `queries *= scale`: the Python float is weakly typed, so it is first rounded to the query dtype.
    let scale_arr = Array::from_f32(scale).as_dtype(q.dtype())?;
    let mut queries = q.multiply(&scale_arr)?;
    let mut p: Vec<Array> = planes.to_vec();
    if rep > 1 {
        queries = queries.reshape(&[b, hkv, rep, l, d])?;
        p = p.iter().map(|x| x.expand_dims(-3)).collect::<std::result::Result<_, _>>()?;
    }
    let scores = mlx_rs::ops::quantized_matmul(&queries, &p[0], &p[1], &p[2], true, g, bits)?;
    let built;
    let mask = match (mask, causal) {
        (Some(m), _) => Some(m),
        (None, true) => {
            let (lu, su) = (l.max(0) as usize, s.max(0) as usize);
            let mut vis = Vec::with_capacity(lu * su);
            for i in 0..lu {
                let qi = su.saturating_sub(lu) + i;
                vis.extend((0..su).map(|c| qi >= c));
            }
            built = Array::from_slice(&vis, &[1, 1, l, s]);
            Some(&built)
        }
        (None, false) => None,
    };
    let scores = match mask {
        None => scores,
        Some(m) => {
            // A `[B, 1, L, S]` mask must gain the `rep` axis to line up with `[B, H_kv, rep, L, S]` (mlx-lm#1322,
            // #1558). Mutation hook `Mutant::QuantGqaMaskWrongAxis`: left as is, it broadcasts from the right, so
            // its batch axis lands on the kv-head axis.
            let m = if rep > 1 && !fault!(QuantGqaMaskWrongAxis) { m.expand_dims(2)? } else { m.clone() };
            let min = scores.dtype().finfo_min().map_err(|e| CacheError::Mlx(format!("{e:?}")))?;
            let fill = Array::from_f32(min as f32).as_dtype(scores.dtype())?;
            mlx_rs::ops::select(&m, &scores, &fill)?
        }
    };
    let weights = mlx_rs::ops::softmax_axis(&scores, -1, true)?;
    let out = mlx_rs::ops::quantized_matmul(&weights, &p[3], &p[4], &p[5], false, g, bits)?;
    if rep > 1 {
        Ok(out.reshape(&[b, hq, l, d])?)
    } else {
        Ok(out)
    }
}

/// Constructor of the linear quantized cache (`kv:quant:<bits>:<group>`; mlx-lm's `QuantizedKVCache`).
#[derive(Debug, Clone, Copy)]
pub struct QuantizedKvCache;

impl QuantizedKvCache {
    /// An empty cache; invalid parameters are [`CacheError::InvalidQuant`].
    #[allow(clippy::new_ret_no_self)]
    pub fn new(spec: KvSpec, quant: QuantSpec) -> Result<super::SerialCache> {
        super::SerialCache::with_storage(spec, None, Storage::Affine(quant))
    }
}

/// Constructor of the quantized ring (`kv:rotating-quant:<bits>:<group>`, keep = 0; the seeds'
/// `RotatingQuantizedKVCache`): the bf16 ring's write rules, six planes.
#[derive(Debug, Clone, Copy)]
pub struct RotatingQuantizedKvCache;

impl RotatingQuantizedKvCache {
    /// An empty ring of window `max_size`.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(spec: KvSpec, max_size: usize, quant: QuantSpec) -> Result<super::SerialCache> {
        super::SerialCache::with_storage(spec, Some(max_size), Storage::Affine(quant))
    }
}

/// Constructors of a batch of quantized rows (linear or rotating, by `max_size`).
#[derive(Debug, Clone, Copy)]
pub struct BatchQuantizedKvCache;

impl BatchQuantizedKvCache {
    /// A batch of `rows` empty quantized rows.
    pub fn with_rows(spec: KvSpec, max_size: Option<usize>, quant: QuantSpec, rows: usize) -> Result<super::RowBatch> {
        super::RowBatch::with_rows_storage(spec, max_size, Storage::Affine(quant), rows)
    }

    /// R-BROT-4 from per-row temporal plane slices `(planes, offset)`.
    pub fn merge(
        spec: KvSpec,
        max_size: Option<usize>,
        quant: QuantSpec,
        rows: &[(Vec<Array>, usize)],
    ) -> Result<super::RowBatch> {
        super::RowBatch::merge_planes(spec, max_size, Storage::Affine(quant), rows)
    }
}

#[cfg(test)]
mod tests;
