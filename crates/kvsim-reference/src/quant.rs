//! Affine quantization, reproduced in pure Rust: the bytes the upstream array library (release 0.32.2) stores for
//! `quantize(w, group_size, bits)` on CPU, and the values its CPU `dequantize` returns.
//!
//! The rules (upstream `backend/cpu/quantized.cpp`, template `quantize<T, U>`; `backend/common/quantized.h`,
//! `get_pack_factor` / `get_bytes_per_pack`; the dequantize fallback of `ops.cpp` `affine_dequantize`):
//!
//! - Per group of `group` consecutive elements of the last axis, in **f32**: `w_max` / `w_min` are the true max and
//!   min (starting from -inf / +inf); `mask = |w_min| > |w_max|`; `scale = max((w_max - w_min) / n_bins, 1e-7)`
//!   with `n_bins = 2^bits - 1`, negated unless `mask` (so the scale is **negative** whenever `|max| >= |min|`);
//!   `edge = mask ? w_min : w_max`; `q0 = rint(edge / scale)` (ties to even); if `q0 != 0` then
//!   `scale = edge / q0`, `bias = edge`, else `bias = 0`. Each element's code is
//!   `clamp(rint((w - bias) / scale), 0, n_bins)`, computed with the f32 scale; the stored scale and bias are then
//!   rounded to the element dtype (bf16: round to nearest even).
//! - Packing: element `k` of a row occupies bits `[k * bits, (k + 1) * bits)` of a little-endian bit stream
//!   (least-significant first). For 2, 4 and 8 bits that is `32 / bits` codes per u32 word; for 3 and 6 bits it is
//!   3-byte chunks and for 5 bits 5-byte chunks that run straight across u32 word boundaries. The packed row has
//!   `D * bits / 32` u32 words (little-endian view of the byte stream).
//! - Dequantize (CPU): `T(code) * scale` then `+ bias`, two separate operations, each rounded to `T` (f32 math).
//!
//! Guarantee: for finite inputs, [`quantize`] returns exactly the upstream CPU bytes and [`dequantize`] exactly
//! its values (the tests in `src/cache/quant/tests.rs` compare every bits x group x dtype byte for byte, special
//! groups included). The GPU kernels round differently (half away from zero, other min/max starts) and are not
//! modelled.

use super::attention::attention_over;
use super::error::ModelError;
use std::rc::Rc;

use super::memo::Memo;
use super::values::{bits_to_f32, round_to, ColumnKey, RefDtype, Tensor, Tok, ValueSpace};

/// The affine bit widths the upstream library accepts.
pub const REF_QUANT_BITS: [usize; 6] = [2, 3, 4, 5, 6, 8];
/// The group sizes the upstream library accepts.
pub const REF_QUANT_GROUPS: [usize; 3] = [32, 64, 128];

/// Affine parameters of the reference.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RefQuant {
    pub bits: usize,
    pub group: usize,
}

impl RefQuant {
    /// Valid parameters for rows of `head_dim` elements.
    pub fn validate(&self, head_dim: usize) -> Result<(), ModelError> {
        let ok = REF_QUANT_BITS.contains(&self.bits)
            && REF_QUANT_GROUPS.contains(&self.group)
            && head_dim > 0
            && head_dim.is_multiple_of(self.group);
        if ok {
            Ok(())
        } else {
            Err(ModelError::BadLengths {
                what: format!("affine bits {} group {} for head_dim {head_dim}", self.bits, self.group),
            })
        }
    }

    /// u32 words of one packed row of `head_dim` elements: `head_dim * bits / 32`.
    pub fn packed_words(&self, head_dim: usize) -> usize {
        head_dim * self.bits / 32
    }
}

/// One quantized tensor: packed words, and per-group scales and biases as storage bits of the dtype (f32 bits, or
/// bf16 bits in the low 16 bits).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quantized {
    pub packed: Vec<u32>,
    pub scales: Vec<u32>,
    pub biases: Vec<u32>,
}

/// f32 -> storage bits of `d` (bf16: round to nearest even).
fn store(d: RefDtype, x: f32) -> u32 {
    round_to(d, x as f64)
}

/// Quantize `values` (rows of `head_dim` elements, each already representable in `dtype`), as the upstream CPU
/// kernel does (module docs).
pub fn quantize(values: &[f32], head_dim: usize, dtype: RefDtype, q: RefQuant) -> Result<Quantized, ModelError> {
    q.validate(head_dim)?;
    if !values.len().is_multiple_of(head_dim) {
        return Err(ModelError::BadLengths { what: format!("{} values are not rows of {head_dim}", values.len()) });
    }
    let n_bins = ((1u32 << q.bits) - 1) as f32;
    let eps = 1e-7f32;
    let groups = values.len() / q.group;
    let mut codes = Vec::with_capacity(values.len());
    let (mut scales, mut biases) = (Vec::with_capacity(groups), Vec::with_capacity(groups));
    for g in values.chunks(q.group) {
        let (mut w_max, mut w_min) = (f32::NEG_INFINITY, f32::INFINITY);
        for &w in g {
            // std::max(a, b) = a < b ? b : a; std::min(a, b) = b < a ? b : a.
            if w_max < w {
                w_max = w;
            }
            if w < w_min {
                w_min = w;
            }
        }
        let mask = w_min.abs() > w_max.abs();
        let mut scale = ((w_max - w_min) / n_bins).max(eps);
        if !mask {
            scale = -scale;
        }
        let edge = if mask { w_min } else { w_max };
        let q0 = (edge / scale).round_ties_even();
        let mut bias = 0.0f32;
        if q0 != 0.0 {
            scale = edge / q0;
            bias = edge;
        }
        for &w in g {
            let c = ((w - bias) / scale).round_ties_even().max(0.0).min(n_bins);
            codes.push(c as u32);
        }
        scales.push(store(dtype, scale));
        biases.push(store(dtype, bias));
    }
    Ok(Quantized { packed: pack(&codes, q.bits), scales, biases })
}

/// Pack codes into the little-endian bit stream (module docs), as u32 words.
pub fn pack(codes: &[u32], bits: usize) -> Vec<u32> {
    let total_bits = codes.len() * bits;
    let mut bytes = vec![0u8; total_bits.div_ceil(8).next_multiple_of(4)];
    for (k, &c) in codes.iter().enumerate() {
        let at = k * bits;
        let word = (c as u64 & ((1u64 << bits) - 1)) << (at % 8);
        for (i, b) in word.to_le_bytes().iter().enumerate().take(3) {
            if let Some(dst) = bytes.get_mut(at / 8 + i) {
                *dst |= b;
            }
        }
    }
    bytes.chunks(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// The codes of packed words (inverse of [`pack`] for `n` codes).
pub fn unpack(packed: &[u32], bits: usize, n: usize) -> Vec<u32> {
    let bytes: Vec<u8> = packed.iter().flat_map(|w| w.to_le_bytes()).collect();
    (0..n)
        .map(|k| {
            let at = k * bits;
            let mut word = 0u64;
            for i in 0..3 {
                word |= (bytes.get(at / 8 + i).copied().unwrap_or(0) as u64) << (8 * i);
            }
            ((word >> (at % 8)) & ((1u64 << bits) - 1)) as u32
        })
        .collect()
}

/// Dequantize as the upstream CPU fallback does: `T(code) * scale`, rounded to `T`, then `+ bias`, rounded to `T`.
/// Returns f32 values (exactly representable in `dtype`). `n` is the number of elements.
pub fn dequantize(x: &Quantized, n: usize, dtype: RefDtype, q: RefQuant) -> Result<Vec<f32>, ModelError> {
    if !n.is_multiple_of(q.group) || x.scales.len() < n / q.group || x.biases.len() < n / q.group {
        return Err(ModelError::BadLengths {
            what: format!("{n} elements, {} scales, {} biases, group {}", x.scales.len(), x.biases.len(), q.group),
        });
    }
    let codes = unpack(&x.packed, q.bits, n);
    Ok(codes
        .iter()
        .enumerate()
        .map(|(i, &c)| {
            let s = bits_to_f32(dtype, x.scales[i / q.group]);
            let b = bits_to_f32(dtype, x.biases[i / q.group]);
            let prod = bits_to_f32(dtype, store(dtype, c as f32 * s));
            bits_to_f32(dtype, store(dtype, prod + b))
        })
        .collect())
}

thread_local! {
    static QUANTIZED: Memo<(ColumnKey, RefQuant), Rc<Quantized>> = Memo::default();
    static DEQUANTIZED: Memo<(ColumnKey, RefQuant), Rc<[f32]>> = Memo::default();
}

/// The expected stored triple of one column (`tensor` of `tok` on `layer`): each of the `heads` rows of `head_dim`
/// values quantized; packed words `[heads * D * bits / 32]`, scales and biases `[heads * D / group]`. Memoized per
/// thread like [`ValueSpace::column`] (the same answer as computing it afresh).
pub fn quantized_column(vs: &ValueSpace, layer: u32, tensor: Tensor, tok: Tok, q: RefQuant) -> Rc<Quantized> {
    QUANTIZED.with(|m| {
        m.get_or((vs.column_key(layer, tensor, tok), q), || {
            let vals = vs.column(layer, tensor, tok);
            // Rows of head_dim are quantized independently: one call over the whole column gives the same bytes.
            Rc::new(quantize(&vals, vs.head_dim, vs.dtype, q).unwrap_or(Quantized {
                packed: vec![],
                scales: vec![],
                biases: vec![],
            }))
        })
    })
}

/// The dequantized values of one column (what a quantized cache's read sees), `[heads * D]`, memoized per thread.
pub fn dequantized_column(vs: &ValueSpace, layer: u32, tensor: Tensor, tok: Tok, q: RefQuant) -> Rc<[f32]> {
    let n = vs.column_len(tensor);
    if q.validate(vs.head_dim).is_err() {
        return vec![f32::NAN; n].into();
    }
    DEQUANTIZED.with(|m| {
        m.get_or((vs.column_key(layer, tensor, tok), q), || {
            let x = quantized_column(vs, layer, tensor, tok, q);
            dequantize(&x, n, vs.dtype, q).unwrap_or_else(|_| vec![f32::NAN; n]).into()
        })
    })
}

/// [`attention_f64`](super::attention_f64) over the **dequantized** keys and values: the model's answer for a read
/// of an affine-quantized cache (the query is not quantized). All-NaN without keys or with invalid parameters.
pub fn attention_f64_quantized(
    vs: &ValueSpace,
    layer: u32,
    q_tok: Tok,
    keys: &[Tok],
    scale: f64,
    q: RefQuant,
) -> Vec<f64> {
    attention_f64_partly_quantized(vs, layer, q_tok, keys, keys.len(), scale, q)
}

/// [`attention_f64_quantized`] where only the first `stored` keys come from the quantized cache (dequantized) and
/// the others are attended as given: a canvas block read beside a quantized context (R-ROT-9c) is never stored.
pub fn attention_f64_partly_quantized(
    vs: &ValueSpace,
    layer: u32,
    q_tok: Tok,
    keys: &[Tok],
    stored: usize,
    scale: f64,
    q: RefQuant,
) -> Vec<f64> {
    if keys.is_empty() || vs.validate().is_err() || q.validate(vs.head_dim).is_err() {
        return vec![f64::NAN; vs.heads_q * vs.head_dim];
    }
    let query = vs.column(layer, Tensor::Q, q_tok);
    let column = |i: usize, t: Tok, tensor: Tensor| {
        if i < stored {
            dequantized_column(vs, layer, tensor, t, q)
        } else {
            vs.column(layer, tensor, t)
        }
    };
    let ks: Vec<Rc<[f32]>> = keys.iter().enumerate().map(|(i, &t)| column(i, t, Tensor::K)).collect();
    let vals: Vec<Rc<[f32]>> = keys.iter().enumerate().map(|(i, &t)| column(i, t, Tensor::V)).collect();
    attention_over(vs, &query, &ks, &vals, scale)
}

#[cfg(test)]
mod tests {
    use super::*;

    const Q4: RefQuant = RefQuant { bits: 4, group: 32 };

    #[test]
    fn ramp_and_special_groups_follow_the_documented_table() {
        // Ramp 0..31 at 4 bits: negative scale -31/15, bias 31, codes 15, 14, ..., 0 (rounded to ties-even).
        let ramp: Vec<f32> = (0..32).map(|i| i as f32).collect();
        let r = quantize(&ramp, 32, RefDtype::F32, Q4).unwrap();
        assert_eq!(f32::from_bits(r.biases[0]), 31.0);
        assert_eq!(f32::from_bits(r.scales[0]), 31.0f32 / -15.0);
        let codes = unpack(&r.packed, 4, 32);
        assert_eq!(codes[0], 15);
        assert_eq!(codes[31], 0);
        // All zeros: scale -1e-7 (bf16 bits 0xB3D7), bias 0, codes 0.
        let z = quantize(&[0.0; 32], 32, RefDtype::Bf16, Q4).unwrap();
        assert_eq!((z.scales[0], z.biases[0]), (0xB3D7, 0));
        assert!(z.packed.iter().all(|&w| w == 0));
        // Negative ramp: positive scale, bias -31, same codes.
        let neg: Vec<f32> = (0..32).map(|i| -(i as f32)).collect();
        let n = quantize(&neg, 32, RefDtype::F32, Q4).unwrap();
        assert_eq!(f32::from_bits(n.biases[0]), -31.0);
        assert!(f32::from_bits(n.scales[0]) > 0.0);
        assert_eq!(unpack(&n.packed, 4, 32), codes);
    }

    #[test]
    fn packing_is_a_little_endian_bit_stream() {
        for bits in REF_QUANT_BITS {
            let codes: Vec<u32> = (0..64).map(|i| (i * 7 + 3) as u32 & ((1 << bits) - 1)).collect();
            let p = pack(&codes, bits);
            assert_eq!(p.len(), 64 * bits / 32, "{bits} bits");
            assert_eq!(unpack(&p, bits, 64), codes, "{bits} bits");
        }
        // 4 bits: element 0 in the low nibble.
        assert_eq!(pack(&[15, 14, 13, 12, 11, 10, 9, 8], 4), vec![0x89ab_cdef]);
        // 3 bits: the third byte of a chunk carries codes 5 (partly), 6 and 7.
        let p =
            pack(&[0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0], 3);
        assert_eq!(p[0], 0x00e0_0000);
    }

    #[test]
    fn dequantize_rounds_twice_and_invalid_parameters_are_errors() {
        let vals: Vec<f32> = (0..64).map(|i| ((i * 37 % 19) as f32 - 9.0) / 8.0).collect();
        for q in [RefQuant { bits: 8, group: 64 }, RefQuant { bits: 5, group: 32 }] {
            let x = quantize(&vals, 64, RefDtype::F32, q).unwrap();
            let d = dequantize(&x, 64, RefDtype::F32, q).unwrap();
            let step = vals.iter().cloned().fold(f32::MIN, f32::max) - vals.iter().cloned().fold(f32::MAX, f32::min);
            for (a, b) in vals.iter().zip(&d) {
                assert!((a - b).abs() <= step / ((1 << q.bits) - 1) as f32, "{a} vs {b}");
            }
        }
        assert!(RefQuant { bits: 7, group: 32 }.validate(64).is_err());
        assert!(RefQuant { bits: 4, group: 16 }.validate(64).is_err());
        assert!(RefQuant { bits: 4, group: 64 }.validate(96).is_err());
        assert!(quantize(&[0.0; 10], 64, RefDtype::F32, Q4).is_err());
    }
}
