//! The per-class conversions between mlx-lm's caches and kvsim's: [`to_kvsim`] / [`to_kvsim_at`] (every class
//! onto an [`AnyCache`], with [`ssm_spec_of`] for a DeltaNet `ArraysCache`) and [`from_kvsim`] back.

use crate::codec::AnyCache;
use crate::error::{PersistError, Result};
use crate::tensor::{HostTensor, TensorDtype};
use kvsim_cache::{
    ChunkedKvCache, KvDtype, KvSpec, QuantSpec, QuantizedKvCache, RingState, RowBatch, RowState, SerialCache, SsmCache,
    SsmSpec, Storage,
};

use super::hints::{Hints, SSM_OFFSETS_KEY};
use super::MlxLayer;

// ---------------------------------------------------------------------------------------------------------------
// Conversion to and from kvsim layouts.

fn kv_dtype_of(t: &HostTensor, name: &str) -> Result<KvDtype> {
    match t.dtype {
        TensorDtype::F32 => Ok(KvDtype::F32),
        TensorDtype::BF16 => Ok(KvDtype::Bf16),
        d => Err(PersistError::unsupported(format!("{name}: kvsim layouts hold F32 or BF16, not {d}"))),
    }
}

fn usize_of(v: i64, name: &str) -> Result<usize> {
    usize::try_from(v).map_err(|_| PersistError::malformed(format!("{name} = {v} is negative")))
}

/// Keys and values of a KV-like class: same dtype and shape `[B, H, C, D]`; returns (spec, B, C).
fn kv_pair<'a>(
    keys: &'a Option<HostTensor>,
    values: &'a Option<HostTensor>,
    class: &str,
) -> Result<Option<(&'a HostTensor, &'a HostTensor, KvSpec, usize, usize)>> {
    match (keys, values) {
        (None, None) => Ok(None),
        (Some(k), Some(v)) => {
            let [b, h, c, d] = k.dims4("keys")?;
            if k.shape != v.shape || k.dtype != v.dtype {
                return Err(PersistError::shape(
                    format!("{class} values"),
                    format!("{} {:?} differs from keys {} {:?}", v.dtype, v.shape, k.dtype, k.shape),
                ));
            }
            let spec = KvSpec { heads_kv: h, head_dim: d, dtype: kv_dtype_of(k, "keys")? };
            Ok(Some((k, v, spec, b, c)))
        }
        _ => Err(PersistError::Missing { name: format!("{class}: keys and values must both be present or both None") }),
    }
}

fn rows_of(t: &HostTensor, rows: usize, name: &str) -> Result<Vec<i64>> {
    if t.shape != [rows] {
        return Err(PersistError::shape(name, format!("shape {:?}, expected [{rows}]", t.shape)));
    }
    t.to_i64s(name)
}

/// The kvsim cache that continues this mlx-lm cache exactly as mlx-lm continues it (same live bytes per row, same
/// physical order for serial rings, same offsets). `spec_hint` gives the spec of a cache that holds no array yet.
///
/// - `KVCache` (B = 1) -> `kv-plain`: columns `[0, offset)`.
/// - `QuantizedKVCache` (B = 1) -> `kv:quant:<bits>:<group>`: the six planes' columns `[0, offset)` as stored.
/// - `RotatingKVCache` (keep = 0, B = 1) -> `rotating-plain`: the ring as laid out, `len = min(offset, columns)`,
///   `idx = _idx` (mlx-lm's live columns: `keys_and_values`).
/// - `BatchKVCache` -> `kv-plain+row-batch`: row `r` = columns `[left_padding_r, _idx)` (mlx-lm's `extract`),
///   left-aligned.
/// - `BatchRotatingKVCache` -> `rotating-plain+row-batch`: row `r` = mlx-lm's `extract(r)` (temporal order, padding
///   dropped), left-aligned. A layout event for rotated rings (kvsim rows keep their own phase from then on).
///
/// A file without a pending right padding is the only kind mlx-lm 0.32.2 writes, so loaded batches are finalized.
pub fn to_kvsim(layer: &MlxLayer, spec_hint: Option<KvSpec>) -> Result<AnyCache> {
    to_kvsim_at(layer, "0", &Hints { spec: spec_hint, ..Hints::default() })
}

/// The geometry of an mlx-lm `ArraysCache` holding a gated-DeltaNet layer's `[conv, recurrent]` state (mlx-lm
/// 0.32.2 `qwen3_5.py` / `qwen3_next.py`: `cache[0]` the conv tail `[B, K-1, conv_dim]` in the input dtype,
/// `cache[1]` the recurrent state `[B, Hv, Dv, Dk]`, f32), and its row count. `Hk` follows from
/// `conv_dim = 2 Hk Dk + Hv Dv`.
///
/// An `ArraysCache` may hold any arrays (mlx-lm's layers keep what they like in it: a Mamba layer's `[B, D, N]`
/// state, a Mamba2 layer's `[B, H, Dh, N]` beside a conv tail of its own width, a per-row vector): every other
/// content is a well-formed file kvsim has no layout for, so it is [`PersistError::Unsupported`], never a shape or
/// dtype error, and the message says which array and why.
pub fn ssm_spec_of(cache: &[Option<HostTensor>]) -> Result<(SsmSpec, usize)> {
    let no = |why: String| {
        Err(PersistError::unsupported(format!(
            "{why}: kvsim's ssm layout holds a gated-DeltaNet layer's [conv tail [B, K-1, 2 Hk Dk + Hv Dv], recurrent \
             state [B, Hv, Dv, Dk] (F32)]"
        )))
    };
    let (conv, rec) = match cache {
        [Some(c), Some(r)] => (c, r),
        [None, None] => return Err(PersistError::unsupported("an ArraysCache without state carries no spec")),
        _ => {
            let set = cache.iter().filter(|t| t.is_some()).count();
            return no(format!("an ArraysCache of {} arrays, {set} of them set", cache.len()));
        }
    };
    if !matches!(conv.dtype, TensorDtype::F32 | TensorDtype::BF16) {
        return no(format!("cache.0 is {} (kvsim layouts hold F32 or BF16)", conv.dtype));
    }
    let dtype = kv_dtype_of(conv, "cache.0")?;
    let [b, km1, c] = match conv.shape.as_slice() {
        &[b, k, c] => [b, k, c],
        s => return no(format!("cache.0 is {s:?}, not a conv tail [B, K-1, conv_dim]")),
    };
    let [rb, hv, dv, dk] = match rec.shape.as_slice() {
        &[rb, hv, dv, dk] => [rb, hv, dv, dk],
        s => {
            return no(format!(
                "an ArraysCache whose recurrent state cache.1 is {s:?} (a Mamba layer's [B, D, N] state, say), not \
                 [B, Hv, Dv, Dk]"
            ))
        }
    };
    if rec.dtype != TensorDtype::F32 {
        return no(format!("the recurrent state cache.1 is {}, not F32", rec.dtype));
    }
    if rb != b {
        return no(format!("cache.1 holds {rb} rows, cache.0 {b}"));
    }
    let Some(v_width) = hv.checked_mul(dv) else {
        return no(format!("cache.1 {:?}: Hv * Dv overflows", rec.shape));
    };
    let two_dk = dk.checked_mul(2).unwrap_or(0);
    if two_dk == 0 || c <= v_width || (c - v_width) % two_dk != 0 {
        return no(format!(
            "cache.0's conv_dim {c} is not 2 Hk Dk + Hv Dv for any Hk >= 1 with the recurrent state {:?}'s Hv {hv}, \
             Dv {dv}, Dk {dk}, so the two are not one gated-DeltaNet layer's",
            rec.shape
        ));
    }
    let Some(kernel) = km1.checked_add(1) else {
        return no(format!("cache.0 {:?}: K overflows", conv.shape));
    };
    let spec = SsmSpec { kernel, heads_k: (c - v_width) / two_dk, heads_v: hv, dk, dv, dtype };
    Ok((spec, b))
}

/// [`to_kvsim`] of the layer at path `at` (`"<layer>"`, `"<layer>.<child>"`), with `hints`.
///
/// Beyond the five attention classes above:
/// - `ArraysCache` `[conv, recurrent]` -> `ssm` ([`ssm_spec_of`]); the offsets come from `hints.ssm_offsets[at]`
///   ([`PersistError::Missing`] without them: the class stores none). Only a cache at rest maps: `lengths` set, or a
///   positive `left_padding`, is a pending prefill ([`PersistError::Unsupported`]).
/// - `ChunkedKVCache` -> `kv-chunked:<chunk_size>`: columns `[0, offset - start_position)` of its buffer (mlx-lm's
///   `keys_and_values`), the start position as the linear cache's `offset - len`.
/// - `CacheList` -> a list of its children's kvsim caches.
pub fn to_kvsim_at(layer: &MlxLayer, at: &str, hints: &Hints) -> Result<AnyCache> {
    let class = layer.class_name();
    let spec_hint = hints.spec_at(at);
    match layer {
        // Its columns are exactly its positions: a KVCache whose offset is their count.
        MlxLayer::ConcatenateKvCache { keys, values } => {
            let offset = keys.as_ref().map_or(0, |k| k.shape.get(2).copied().unwrap_or(0));
            let offset = i64::try_from(offset).map_err(|_| PersistError::shape("keys", "too many columns"))?;
            to_kvsim_at(&MlxLayer::KvCache { keys: keys.clone(), values: values.clone(), offset }, at, hints)
        }
        MlxLayer::KvCache { keys, values, offset } => {
            let offset = usize_of(*offset, "offset")?;
            match kv_pair(keys, values, class)? {
                None => {
                    let spec =
                        spec_hint.ok_or_else(|| PersistError::unsupported("an empty KVCache carries no spec"))?;
                    if offset != 0 {
                        return Err(PersistError::malformed(format!("empty KVCache with offset {offset}")));
                    }
                    Ok(AnyCache::Serial(SerialCache::new(spec, None)?))
                }
                Some((k, v, spec, b, c)) => {
                    if b != 1 {
                        return Err(PersistError::unsupported(format!(
                            "KVCache with batch {b} (kvsim serial caches hold one row)"
                        )));
                    }
                    if offset > c {
                        return Err(PersistError::shape(
                            "keys",
                            format!("offset {offset} past the buffer's {c} columns"),
                        ));
                    }
                    let ring = RingState { offset, len: offset, idx: offset, last_concat: None };
                    Ok(AnyCache::Serial(SerialCache::adopt(spec, None, k.to_array()?, v.to_array()?, ring)?))
                }
            }
        }
        MlxLayer::RotatingKvCache { keys, values, offset, keep, max_size, idx } => {
            if *keep != 0 {
                return Err(PersistError::unsupported(format!(
                    "RotatingKVCache with keep = {keep} (kvsim rings keep 0)"
                )));
            }
            let w = usize_of(*max_size, "max_size")?;
            let offset = usize_of(*offset, "offset")?;
            let idx = usize_of(*idx, "_idx")?;
            match kv_pair(keys, values, class)? {
                None => {
                    let spec = spec_hint
                        .ok_or_else(|| PersistError::unsupported("an empty RotatingKVCache carries no spec"))?;
                    if offset != 0 || idx != 0 {
                        return Err(PersistError::malformed("empty RotatingKVCache with a non-zero offset or _idx"));
                    }
                    Ok(AnyCache::Serial(SerialCache::new(spec, Some(w))?))
                }
                Some((k, v, spec, b, c)) => {
                    if b != 1 {
                        return Err(PersistError::unsupported(format!("RotatingKVCache with batch {b}")));
                    }
                    let len = offset.min(c);
                    let ring = RingState { offset, len, idx, last_concat: None };
                    Ok(AnyCache::Serial(SerialCache::adopt(spec, Some(w), k.to_array()?, v.to_array()?, ring)?))
                }
            }
        }
        MlxLayer::BatchKvCache { keys, values, offset, left_padding, idx } => {
            let idx = usize_of(*idx, "_idx")?;
            batch_to_kvsim(keys, values, offset, left_padding, None, spec_hint, class, |_, lp, c| {
                let lp = usize_of(lp, "left_padding")?;
                if lp > idx || idx > c {
                    return Err(PersistError::shape(
                        "keys",
                        format!("row columns [{lp}, {idx}) outside the buffer's {c}"),
                    ));
                }
                Ok((lp..idx).collect())
            })
        }
        MlxLayer::BatchRotatingKvCache { keys, values, offset, left_padding, max_size, offset_total, idx, rotated } => {
            let w = usize_of(*max_size, "max_size")?;
            let idx = usize_of(*idx, "_idx")?;
            let _ = usize_of(*offset_total, "_offset")?;
            let rotated = *rotated;
            batch_to_kvsim(keys, values, offset, left_padding, Some(w), spec_hint, class, |_, lp, c| {
                // mlx-lm 0.32.2 `BatchRotatingKVCache.extract`: roll by -_idx when rotated (then _idx = max_size),
                // drop max(0, left_padding) columns, keep up to _idx.
                let padding = usize::try_from(lp.max(0)).unwrap_or(0);
                let (order, end): (Vec<usize>, usize) = if rotated {
                    if idx > c || c != w {
                        return Err(PersistError::shape(
                            "keys",
                            format!("a rotated ring of {c} columns, _idx {idx}, window {w}"),
                        ));
                    }
                    ((idx..c).chain(0..idx).collect(), w)
                } else {
                    if idx > c {
                        return Err(PersistError::shape("keys", format!("_idx {idx} past the buffer's {c} columns")));
                    }
                    ((0..c).collect(), idx)
                };
                if padding > end {
                    return Err(PersistError::shape(
                        "left_padding",
                        format!("padding {padding} past the row's {end} columns"),
                    ));
                }
                Ok(order[padding..end].to_vec())
            })
        }
        MlxLayer::QuantizedKvCache { keys, values, offset, group_size, bits } => {
            let offset = usize_of(*offset, "offset")?;
            let q = QuantSpec { bits: usize_of(*bits, "bits")?, group: usize_of(*group_size, "group_size")? };
            match (keys, values) {
                (None, None) => {
                    let spec = spec_hint
                        .ok_or_else(|| PersistError::unsupported("an empty QuantizedKVCache carries no spec"))?;
                    if offset != 0 {
                        return Err(PersistError::malformed(format!("empty QuantizedKVCache with offset {offset}")));
                    }
                    Ok(AnyCache::Serial(QuantizedKvCache::new(spec, q)?))
                }
                (Some(k), Some(v)) => {
                    let [b, h, c, w] = k[0].dims4("keys.0")?;
                    if b != 1 {
                        return Err(PersistError::unsupported(format!(
                            "QuantizedKVCache with batch {b} (kvsim serial caches hold one row)"
                        )));
                    }
                    // `quantize` packs D elements into D * bits / 32 words.
                    if q.bits == 0 || (w * 32) % q.bits != 0 {
                        return Err(PersistError::shape("keys.0", format!("{w} packed words at {} bits", q.bits)));
                    }
                    let spec = KvSpec { heads_kv: h, head_dim: w * 32 / q.bits, dtype: kv_dtype_of(&k[1], "keys.1")? };
                    let storage = Storage::Affine(q);
                    storage.validate(&spec)?;
                    if offset > c {
                        return Err(PersistError::shape(
                            "keys.0",
                            format!("offset {offset} past the buffer's {c} columns"),
                        ));
                    }
                    let planes = k.iter().chain(v.iter()).map(HostTensor::to_array).collect::<Result<Vec<_>>>()?;
                    let ring = RingState { offset, len: offset, idx: offset, last_concat: None };
                    Ok(AnyCache::Serial(SerialCache::adopt_planes(spec, None, storage, planes, ring)?))
                }
                _ => Err(PersistError::Missing {
                    name: format!("{class}: keys and values must both be present or both None"),
                }),
            }
        }
        MlxLayer::ArraysCache { cache, left_padding, lengths } => {
            let (spec, rows) = ssm_spec_of(cache)?;
            if lengths.is_some() {
                return Err(PersistError::unsupported(
                    "an ArraysCache with lengths set (a pending prefill: finalize it before saving)",
                ));
            }
            if let Some(lp) = left_padding {
                if rows_of(lp, rows, "left_padding")?.iter().any(|&x| x > 0) {
                    return Err(PersistError::unsupported(
                        "an ArraysCache with positive left padding (a pending prefill: finalize it before saving)",
                    ));
                }
            }
            let offsets = hints.ssm_offsets.get(at).ok_or_else(|| PersistError::Missing {
                name: format!("user metadata {SSM_OFFSETS_KEY}[{at:?}]: an mlx-lm ArraysCache carries no offsets"),
            })?;
            if offsets.len() != rows {
                return Err(PersistError::shape(
                    SSM_OFFSETS_KEY,
                    format!("{} offsets for layer {at}'s {rows} rows", offsets.len()),
                ));
            }
            let [conv, rec] = [&cache[0], &cache[1]].map(|t| t.as_ref().map(HostTensor::to_array));
            let (Some(conv), Some(rec)) = (conv, rec) else {
                return Err(PersistError::malformed("ArraysCache state vanished"));
            };
            Ok(AnyCache::Ssm(SsmCache::from_states(spec, conv?, rec?, offsets.clone())?))
        }
        MlxLayer::ChunkedKvCache { keys, values, offset, chunk_size, start_position } => {
            let offset = usize_of(*offset, "offset")?;
            let start = usize_of(*start_position, "start_position")?;
            let chunk = usize_of(*chunk_size, "chunk_size")?;
            if start > offset {
                return Err(PersistError::malformed(format!("start_position {start} past offset {offset}")));
            }
            let cache = match kv_pair(keys, values, class)? {
                None => {
                    let spec = spec_hint
                        .ok_or_else(|| PersistError::unsupported("an empty ChunkedKVCache carries no spec"))?;
                    if offset != 0 {
                        return Err(PersistError::malformed(format!("empty ChunkedKVCache with offset {offset}")));
                    }
                    SerialCache::new(spec, None)?
                }
                Some((k, v, spec, b, c)) => {
                    if b != 1 {
                        return Err(PersistError::unsupported(format!("ChunkedKVCache with batch {b}")));
                    }
                    let valid = offset - start;
                    if valid > c {
                        return Err(PersistError::shape(
                            "keys",
                            format!("{valid} live positions past the buffer's {c} columns"),
                        ));
                    }
                    let ring = RingState { offset, len: valid, idx: valid, last_concat: None };
                    SerialCache::adopt(spec, None, k.to_array()?, v.to_array()?, ring)?
                }
            };
            Ok(AnyCache::Chunked(ChunkedKvCache::from_cache(cache, chunk)?))
        }
        MlxLayer::CacheList(children) => Ok(AnyCache::List(
            children
                .iter()
                .enumerate()
                .map(|(j, c)| to_kvsim_at(c, &format!("{at}.{j}"), &Hints { spec: None, ..hints.clone() }))
                .collect::<Result<_>>()?,
        )),
    }
}

/// Rows of an mlx-lm batch cache: `columns(row, left_padding_r, buffer columns)` lists the buffer columns holding
/// row `r`'s positions, oldest first. Each row becomes a temporal serial cache, then the rows are joined.
#[allow(clippy::too_many_arguments)]
fn batch_to_kvsim(
    keys: &Option<HostTensor>,
    values: &Option<HostTensor>,
    offset: &HostTensor,
    left_padding: &HostTensor,
    max_size: Option<usize>,
    spec_hint: Option<KvSpec>,
    class: &str,
    columns: impl Fn(usize, i64, usize) -> Result<Vec<usize>>,
) -> Result<AnyCache> {
    let rows = offset.numel();
    let offsets = rows_of(offset, rows, "offset")?;
    let pads = rows_of(left_padding, rows, "left_padding")?;
    let Some((k, v, spec, b, c)) = kv_pair(keys, values, class)? else {
        // No array yet: every row is empty (an empty batch's offsets are -left_padding, mlx-lm's constructor).
        let spec = spec_hint.ok_or_else(|| PersistError::unsupported(format!("an empty {class} carries no spec")))?;
        let z = HostTensor {
            dtype: match spec.dtype {
                KvDtype::F32 => TensorDtype::F32,
                KvDtype::Bf16 => TensorDtype::BF16,
            },
            shape: vec![rows, spec.heads_kv, 0, spec.head_dim],
            data: vec![],
        }
        .to_array()?;
        return Ok(AnyCache::Rows(RowBatch::adopt(spec, max_size, z.clone(), z, vec![RowState::default(); rows])?));
    };
    if b != rows {
        return Err(PersistError::shape("keys", format!("{b} rows, offset lists {rows}")));
    }
    let (ka, va) = (k.to_array()?, v.to_array()?);
    let mut serials = Vec::with_capacity(rows);
    for r in 0..rows {
        let cols = columns(r, pads[r], c)?;
        let off = usize_of(offsets[r], "offset")?;
        if cols.len() > off {
            return Err(PersistError::shape(
                "offset",
                format!("row {r} holds {} positions but offset {off}", cols.len()),
            ));
        }
        let rk = take_row_cols(&ka, r, &cols)?;
        let rv = take_row_cols(&va, r, &cols)?;
        serials.push(SerialCache::from_temporal(spec, max_size, &rk, &rv, off)?);
    }
    let sources: Vec<kvsim_cache::JoinSource<'_>> = serials.iter().map(kvsim_cache::JoinSource::Serial).collect();
    Ok(AnyCache::Rows(RowBatch::join(spec, max_size, &sources)?))
}

fn take_row_cols(a: &mlx_rs::Array, row: usize, cols: &[usize]) -> Result<mlx_rs::Array> {
    use mlx_rs::ops::indexing::TryIndexOp;
    let r = row as i32;
    let one = a.try_index((r..r + 1, .., .., ..))?;
    let idx: Vec<i32> = cols.iter().map(|&c| c as i32).collect();
    let at = mlx_rs::Array::from_slice(&idx, &[idx.len() as i32]);
    Ok(one.take_axis(&at, 2)?.contiguous()?)
}

fn pad_cols(t: &HostTensor, name: &str, total: usize, left: usize) -> Result<HostTensor> {
    let [b, h, c, d] = t.dims4(name)?;
    if left + c > total {
        return Err(PersistError::shape(name, "padding past the target width"));
    }
    let item = t.dtype.itemsize();
    let row = d * item;
    let mut out = vec![0u8; b * h * total * row];
    for bh in 0..b * h {
        let src = &t.data[bh * c * row..(bh + 1) * c * row];
        let dst = bh * total * row + left * row;
        out[dst..dst + c * row].copy_from_slice(src);
    }
    Ok(HostTensor { dtype: t.dtype, shape: vec![b, h, total, d], data: out })
}

fn stack_rows(parts: &[HostTensor], name: &str) -> Result<HostTensor> {
    let first = parts.first().ok_or_else(|| PersistError::malformed("no rows"))?;
    let mut shape = first.shape.clone();
    shape[0] = parts.len();
    let mut data = Vec::with_capacity(first.data.len() * parts.len());
    for p in parts {
        if p.shape[1..] != first.shape[1..] {
            return Err(PersistError::shape(name, "rows of different shapes"));
        }
        data.extend_from_slice(&p.data);
    }
    Ok(HostTensor { dtype: first.dtype, shape, data })
}

fn cache_quant(cache: &AnyCache) -> Option<QuantSpec> {
    match cache {
        AnyCache::Serial(c) => c.storage().quant(),
        AnyCache::Rows(b) => b.storage().quant(),
        AnyCache::Ssm(_) | AnyCache::Chunked(_) | AnyCache::List(_) | AnyCache::Bf16First(_) | AnyCache::Paged(_) => {
            None
        }
    }
}

/// `kv:quant:<bits>:<group>` -> `QuantizedKVCache`: the six planes' columns `[0, offset)` as stored (never
/// requantized), zeros up to the next multiple of 256 as mlx-lm allocates them. mlx-lm 0.32.2 has no rotating or
/// batched quantized class, so those kinds have no mlx-lm form.
fn quantized_from_kvsim(cache: &AnyCache, q: QuantSpec) -> Result<MlxLayer> {
    let AnyCache::Serial(c) = cache else {
        return Err(PersistError::unsupported("mlx-lm 0.32.2 has no batched quantized cache class"));
    };
    if c.max_size().is_some() {
        return Err(PersistError::unsupported("mlx-lm 0.32.2 has no rotating quantized cache class"));
    }
    let s = c.state();
    if s.len != s.offset {
        return Err(PersistError::unsupported(format!(
            "a quantized cache holding {} positions at offset {} has no QuantizedKVCache form",
            s.len, s.offset
        )));
    }
    let (group_size, bits) = (i32_of(q.group, "group_size")? as i64, i32_of(q.bits, "bits")? as i64);
    if s.len == 0 {
        return Ok(MlxLayer::QuantizedKvCache { keys: None, values: None, offset: 0, group_size, bits });
    }
    let total = s.len.div_ceil(kvsim_cache::ring::GROW_STEP) * kvsim_cache::ring::GROW_STEP;
    let mut planes = vec![];
    for (i, p) in c.physical_planes()?.iter().enumerate() {
        planes.push(pad_cols(&HostTensor::from_array(p)?, &format!("plane {i}"), total, 0)?);
    }
    let v: [HostTensor; 3] = planes.split_off(3).try_into().map_err(|_| PersistError::malformed("six planes"))?;
    let k: [HostTensor; 3] = planes.try_into().map_err(|_| PersistError::malformed("six planes"))?;
    Ok(MlxLayer::QuantizedKvCache {
        keys: Some(k),
        values: Some(v),
        offset: i32_of(s.offset, "offset")? as i64,
        group_size,
        bits,
    })
}

fn i32_of(v: usize, name: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| PersistError::unsupported(format!("{name} = {v} exceeds int32")))
}

/// The mlx-lm cache object that mlx-lm continues exactly as kvsim continues `cache` (the inverse of [`to_kvsim`]).
///
/// - `kv-plain` -> `KVCache` with mlx-lm's full buffer (columns `[0, offset)`, zeros up to the next multiple of 256).
///   Requires `len == offset` (a merged row holding fewer positions than its offset has no `KVCache` form).
/// - `rotating-plain` -> `RotatingKVCache(keep = 0)`: the ring as laid out, `_idx = idx`. Requires that mlx-lm sees
///   the same live columns: `len == offset`, or `len >= W` (a full or oversized ring).
/// - row batches -> `BatchKVCache` / `BatchRotatingKVCache` as mlx-lm's `merge` lays rows out: each row's newest
///   positions (its temporal view) right-aligned at `width = max len_r`, `left_padding_r = width - len_r`,
///   `_idx = _offset = width`, `rotated = False`. A batch with a pending prefill is refused (mlx-lm's files cannot
///   carry it).
/// - Affine storage never takes the dense forms above (their dequantized values would restore a plain cache: the
///   simulator's quantized family caught that): `kv:quant:..` -> `QuantizedKVCache`, the rotating and batched
///   quantized kinds are [`PersistError::Unsupported`] (see `quantized_from_kvsim`).
/// - The bf16-first legos are [`PersistError::Unsupported`]: mlx-lm 0.32.2 has no class that converts at a boundary
///   (its `QuantizedKVCache` form would lose the transition and, before it, the bf16 storage).
pub fn from_kvsim(cache: &AnyCache) -> Result<MlxLayer> {
    if let Some(q) = cache_quant(cache) {
        return quantized_from_kvsim(cache, q);
    }
    match cache {
        // mlx-lm's `ArraysCache` carries no offsets: `file_from_kvsim` puts them in the user metadata.
        AnyCache::Ssm(c) => {
            if c.is_pending() || c.in_round() {
                return Err(PersistError::unsupported("an ssm cache with a pending prefill or an armed round"));
            }
            Ok(MlxLayer::ArraysCache {
                cache: vec![Some(HostTensor::from_array(c.conv())?), Some(HostTensor::from_array(c.recurrent())?)],
                left_padding: None,
                lengths: None,
            })
        }
        AnyCache::Chunked(c) => {
            let s = c.cache().state();
            let chunk_size = i32_of(c.chunk_size(), "chunk_size")? as i64;
            let offset = i32_of(s.offset, "offset")? as i64;
            let start_position = i32_of(c.start_position(), "start_position")? as i64;
            if s.len == 0 {
                if s.offset != 0 {
                    return Err(PersistError::unsupported(
                        "a chunked cache with no live position at a positive offset",
                    ));
                }
                return Ok(MlxLayer::ChunkedKvCache { keys: None, values: None, offset, chunk_size, start_position });
            }
            // The live columns exactly (what `maybe_trim_front` leaves; mlx-lm grows the buffer on the next write).
            let (k, v) = c.cache().physical()?;
            Ok(MlxLayer::ChunkedKvCache {
                keys: Some(HostTensor::from_array(&k)?),
                values: Some(HostTensor::from_array(&v)?),
                offset,
                chunk_size,
                start_position,
            })
        }
        AnyCache::List(children) => Ok(MlxLayer::CacheList(children.iter().map(from_kvsim).collect::<Result<_>>()?)),
        AnyCache::Bf16First(_) => Err(PersistError::unsupported("mlx-lm 0.32.2 has no bf16-first cache class")),
        AnyCache::Paged(_) => Err(PersistError::unsupported("mlx-lm 0.32.2 has no paged cache class")),
        AnyCache::Serial(c) => {
            let s = c.state();
            let (k, v) = c.physical()?;
            let (k, v) = (HostTensor::from_array(&k)?, HostTensor::from_array(&v)?);
            let empty = s.len == 0;
            match c.max_size() {
                None => {
                    if s.len != s.offset {
                        return Err(PersistError::unsupported(format!(
                            "a linear cache holding {} positions at offset {} has no KVCache form",
                            s.len, s.offset
                        )));
                    }
                    if empty {
                        return Ok(MlxLayer::KvCache { keys: None, values: None, offset: 0 });
                    }
                    let total = s.len.div_ceil(kvsim_cache::ring::GROW_STEP).max(1) * kvsim_cache::ring::GROW_STEP;
                    Ok(MlxLayer::KvCache {
                        keys: Some(pad_cols(&k, "keys", total, 0)?),
                        values: Some(pad_cols(&v, "values", total, 0)?),
                        offset: i32_of(s.offset, "offset")? as i64,
                    })
                }
                Some(w) => {
                    if !(s.len == s.offset || s.len >= w) {
                        return Err(PersistError::unsupported(format!(
                            "a ring holding {} positions at offset {} (window {w}) has no RotatingKVCache form",
                            s.len, s.offset
                        )));
                    }
                    if empty {
                        return Ok(MlxLayer::RotatingKvCache {
                            keys: None,
                            values: None,
                            offset: 0,
                            keep: 0,
                            max_size: i32_of(w, "max_size")? as i64,
                            idx: 0,
                        });
                    }
                    Ok(MlxLayer::RotatingKvCache {
                        keys: Some(k),
                        values: Some(v),
                        offset: i32_of(s.offset, "offset")? as i64,
                        keep: 0,
                        max_size: i32_of(w, "max_size")? as i64,
                        idx: i32_of(s.idx, "_idx")? as i64,
                    })
                }
            }
        }
        AnyCache::Rows(b) => {
            if b.is_pending() {
                return Err(PersistError::unsupported(
                    "a batch with a pending right-padded prefill: mlx-lm 0.32.2 files cannot carry it (finalize first)",
                ));
            }
            let n = b.rows();
            let mut views = Vec::with_capacity(n);
            for r in 0..n {
                // Every live column in temporal order (an oversized row after a window write keeps all of them,
                // as mlx-lm's concat path does).
                let (k, v) = b.extract(r)?.physical()?;
                views.push((HostTensor::from_array(&k)?, HostTensor::from_array(&v)?));
            }
            let width = views.iter().map(|(k, _)| k.shape[2]).max().unwrap_or(0);
            let mut lps = Vec::with_capacity(n);
            let mut offs = Vec::with_capacity(n);
            let (mut ks, mut vs) = (Vec::with_capacity(n), Vec::with_capacity(n));
            for (r, (k, v)) in views.iter().enumerate() {
                let len = k.shape[2];
                let st = &b.row_states()[r].ring;
                lps.push(i32_of(width - len, "left_padding")?);
                offs.push(i32_of(st.offset, "offset")?);
                ks.push(pad_cols(k, "keys", width, width - len)?);
                vs.push(pad_cols(v, "values", width, width - len)?);
            }
            let (keys, values) = if n == 0 || width == 0 {
                (None, None)
            } else {
                (Some(stack_rows(&ks, "keys")?), Some(stack_rows(&vs, "values")?))
            };
            let (offset, left_padding) = (HostTensor::vec_i32(&offs), HostTensor::vec_i32(&lps));
            let width_i = i32_of(width, "width")? as i64;
            Ok(match b.max_size() {
                None => MlxLayer::BatchKvCache { keys, values, offset, left_padding, idx: width_i },
                Some(w) => MlxLayer::BatchRotatingKvCache {
                    keys,
                    values,
                    offset,
                    left_padding,
                    max_size: i32_of(w, "max_size")? as i64,
                    offset_total: width_i,
                    idx: width_i,
                    rotated: false,
                },
            })
        }
    }
}
