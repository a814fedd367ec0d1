//! Expected attention in f64, rounding, and ULP distances.
//!
//! [`attention_f64`] computes `softmax(q · kᵀ · scale) · v` in f64 from the dtype-rounded values of
//! [`ValueSpace`], with grouped-query attention (query head `h` reads kv head `h / (heads_q / heads_kv)`). It is the
//! model's answer to "what should this read return", independent of key order up to f64 rounding; the production
//! read's output is measured against it in ULPs of the storage dtype ([`max_ulp`]).

use crate::reference::values::{RefDtype, Tensor, Tok, ValueSpace};

/// Expected attention output of `q_tok`'s query over `keys` (K and V of those tokens) on `layer`:
/// `[heads_q, head_dim]` row-major, in f64.
///
/// Guarantees: uses exactly the dtype-rounded values that [`ValueSpace::column_f32`] gives; numerically stable
/// softmax (max subtracted); GQA head mapping `h -> h / (heads_q / heads_kv)`. Returns all-NaN when there is no
/// key to attend (`keys` empty) or the shapes are invalid ([`ValueSpace::validate`]): attention is then undefined
/// and any comparison against it reports the maximal distance.
pub fn attention_f64(vs: &ValueSpace, layer: u32, q_tok: Tok, keys: &[Tok], scale: f64) -> Vec<f64> {
    let d = vs.head_dim;
    let out_len = vs.heads_q * d;
    if keys.is_empty() || vs.validate().is_err() {
        return vec![f64::NAN; out_len];
    }
    let q = vs.column_f32(layer, Tensor::Q, q_tok);
    let ks: Vec<Vec<f32>> = keys.iter().map(|&t| vs.column_f32(layer, Tensor::K, t)).collect();
    let vs_: Vec<Vec<f32>> = keys.iter().map(|&t| vs.column_f32(layer, Tensor::V, t)).collect();
    attention_over(vs, &q, &ks, &vs_, scale)
}

/// f64 softmax attention of one query column `q` (`[heads_q * D]`) over explicit key and value columns
/// (`[heads_kv * D]` each), GQA head mapping as [`attention_f64`]. `keys` must be non-empty.
pub(crate) fn attention_over(vs: &ValueSpace, q: &[f32], ks: &[Vec<f32>], vs_: &[Vec<f32>], scale: f64) -> Vec<f64> {
    let d = vs.head_dim;
    let group = vs.heads_q / vs.heads_kv;
    let mut out = vec![0.0f64; vs.heads_q * d];
    for h in 0..vs.heads_q {
        let kv = h / group;
        let qh = &q[h * d..(h + 1) * d];
        let scores: Vec<f64> = ks
            .iter()
            .map(|k| {
                let kh = &k[kv * d..(kv + 1) * d];
                qh.iter().zip(kh).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * scale
            })
            .collect();
        let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
        let z: f64 = w.iter().sum();
        for (wj, v) in w.iter().zip(vs_) {
            let vh = &v[kv * d..(kv + 1) * d];
            for (o, &x) in out[h * d..(h + 1) * d].iter_mut().zip(vh) {
                *o += wj / z * x as f64;
            }
        }
    }
    out
}

/// `x` rounded to `d`, round-to-nearest-even, as storage bits (f32 bits, or bf16 bits in the low 16 bits).
///
/// Guarantees: a single correct rounding from f64 (bf16 goes through f32 with round-to-odd, which cannot
/// double-round); overflow gives infinity; NaN gives a quiet NaN of the same sign.
pub fn round_to(d: RefDtype, x: f64) -> u32 {
    match d {
        RefDtype::F32 => (x as f32).to_bits(),
        RefDtype::Bf16 => f32_bits_to_bf16_rne(f64_to_f32_round_odd(x).to_bits()) as u32,
    }
}

/// f64 -> f32 rounding to odd: truncate toward zero, then set the last bit when inexact.
fn f64_to_f32_round_odd(x: f64) -> f32 {
    if x.is_nan() || x.is_infinite() {
        return x as f32;
    }
    let f = x as f32; // nearest-even; may overflow to infinity
    if f.is_finite() && f as f64 == x {
        return f;
    }
    let mut b = if f.is_infinite() { f32::MAX.copysign(f).to_bits() } else { f.to_bits() };
    if (f32::from_bits(b) as f64).abs() > x.abs() {
        b -= 1; // one step toward zero (the magnitude bits are > 0 here)
    }
    f32::from_bits(b | 1)
}

/// f32 bits -> bf16 bits, round-to-nearest-even.
fn f32_bits_to_bf16_rne(b: u32) -> u16 {
    if f32::from_bits(b).is_nan() {
        return ((b >> 16) as u16) | 0x0040;
    }
    let bias = 0x7fff + ((b >> 16) & 1);
    ((b as u64 + bias as u64) >> 16) as u16
}

/// Maps float bits to a monotone integer line: `-x` below `+x`, `-0` immediately below `+0`.
fn ordered(bits: u64, sign: u64) -> u64 {
    if bits & sign != 0 {
        // Negative: larger magnitude -> smaller key; -0 maps to sign - 1.
        !bits & (sign | (sign - 1))
    } else {
        bits | sign
    }
}

/// Distance in ULPs of f32 between `a` and `b`, counted on the monotone integer line of float bits.
///
/// Guarantees: `0` exactly when the bits are equal; `+0` and `-0` are 1 apart (they are different bytes), and a
/// distance across zero counts that extra step; any NaN gives `u64::MAX`.
pub fn ulp_f32(a: f32, b: f32) -> u64 {
    if a.is_nan() || b.is_nan() {
        return u64::MAX;
    }
    let (x, y) = (ordered(a.to_bits() as u64, 1 << 31), ordered(b.to_bits() as u64, 1 << 31));
    x.abs_diff(y)
}

/// Distance in ULPs of bf16 between the bf16 bit patterns `a` and `b` (same rules as [`ulp_f32`]).
pub fn ulp_bf16(a: u16, b: u16) -> u64 {
    let nan = |x: u16| x & 0x7f80 == 0x7f80 && x & 0x007f != 0;
    if nan(a) || nan(b) {
        return u64::MAX;
    }
    ordered(a as u64, 1 << 15).abs_diff(ordered(b as u64, 1 << 15))
}

/// ULP distance between two storage bit patterns of dtype `d` (bf16 bits in the low 16 bits).
pub fn ulp_bits(d: RefDtype, a: u32, b: u32) -> u64 {
    match d {
        RefDtype::F32 => ulp_f32(f32::from_bits(a), f32::from_bits(b)),
        RefDtype::Bf16 => ulp_bf16(a as u16, b as u16),
    }
}

/// The largest ULP distance between `expected` (rounded to `d` first, see [`round_to`]) and the `found` storage
/// bits, element by element. `u64::MAX` when the lengths differ or any element is NaN; `0` for two empty slices.
pub fn max_ulp(d: RefDtype, expected: &[f64], found: &[u32]) -> u64 {
    if expected.len() != found.len() {
        return u64::MAX;
    }
    expected.iter().zip(found).map(|(&e, &f)| ulp_bits(d, round_to(d, e), f)).max().unwrap_or(0)
}

/// Expected attention output as storage bits of `vs.dtype` ([`attention_f64`] then [`round_to`]).
pub fn attention_bits(vs: &ValueSpace, layer: u32, q_tok: Tok, keys: &[Tok], scale: f64) -> Vec<u32> {
    attention_f64(vs, layer, q_tok, keys, scale).into_iter().map(|x| round_to(vs.dtype, x)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::values::bits_to_f32;
    use proptest::prelude::*;

    fn vs(dtype: RefDtype) -> ValueSpace {
        ValueSpace { seed: 11, heads_kv: 2, heads_q: 4, head_dim: 4, dtype }
    }

    #[test]
    fn one_key_returns_its_value() {
        for dtype in [RefDtype::F32, RefDtype::Bf16] {
            let v = vs(dtype);
            let k = Tok::new(0, 3);
            let out = attention_f64(&v, 0, Tok::new(0, 3), &[k], 0.5);
            let val = v.column_f32(0, Tensor::V, k);
            for h in 0..4 {
                for d in 0..4 {
                    // GQA: query heads 0,1 -> kv head 0; 2,3 -> kv head 1.
                    assert_eq!(out[h * 4 + d], val[(h / 2) * 4 + d] as f64);
                }
            }
        }
    }

    #[test]
    fn zero_scale_averages_values_and_order_is_irrelevant() {
        let v = vs(RefDtype::F32);
        let keys: Vec<Tok> = (0..5).map(|p| Tok::new(1, p)).collect();
        let out = attention_f64(&v, 2, Tok::new(1, 4), &keys, 0.0);
        for d in 0..4 {
            let mean: f64 = keys.iter().map(|&k| v.value(2, Tensor::V, k, 1, d) as f64).sum::<f64>() / 5.0;
            assert!((out[3 * 4 + d] - mean).abs() < 1e-12);
        }
        let mut rev = keys.clone();
        rev.reverse();
        let out2 = attention_f64(&v, 2, Tok::new(1, 4), &rev, 0.7);
        let out1 = attention_f64(&v, 2, Tok::new(1, 4), &keys, 0.7);
        assert!(out1.iter().zip(&out2).all(|(a, b)| (a - b).abs() < 1e-12));
    }

    #[test]
    fn no_keys_or_bad_shapes_give_nan() {
        let v = vs(RefDtype::F32);
        assert!(attention_f64(&v, 0, Tok::new(0, 0), &[], 1.0).iter().all(|x| x.is_nan()));
        let bad = ValueSpace { heads_q: 3, ..v };
        let out = attention_f64(&bad, 0, Tok::new(0, 0), &[Tok::new(0, 0)], 1.0);
        assert_eq!(out.len(), 12);
        assert!(out.iter().all(|x| x.is_nan()));
        assert_eq!(max_ulp(RefDtype::F32, &out, &[0; 12]), u64::MAX);
    }

    #[test]
    fn round_to_bf16_is_single_rounding() {
        assert_eq!(round_to(RefDtype::Bf16, 1.0), 0x3f80);
        assert_eq!(round_to(RefDtype::Bf16, -2.0), 0xc000);
        // Exactly halfway between 1 and 1 + 2^-7: ties to even (1.0).
        assert_eq!(round_to(RefDtype::Bf16, 1.0 + 2f64.powi(-8)), 0x3f80);
        // Halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (1 + 2^-6).
        assert_eq!(round_to(RefDtype::Bf16, 1.0 + 3.0 * 2f64.powi(-8)), 0x3f82);
        // Just above the midpoint by less than an f32 ulp: double rounding via f32 would give 1.0.
        let x = 1.0 + 2f64.powi(-8) + 2f64.powi(-30);
        assert_eq!(half::bf16::from_f32(x as f32).to_bits(), 0x3f80, "the double-rounding trap");
        assert_eq!(round_to(RefDtype::Bf16, x), 0x3f81);
        assert_eq!(round_to(RefDtype::Bf16, 1e300), 0x7f80);
        assert_eq!(round_to(RefDtype::Bf16, -1e300), 0xff80);
        assert_eq!(round_to(RefDtype::Bf16, f64::INFINITY), 0x7f80);
        assert!(bits_to_f32(RefDtype::Bf16, round_to(RefDtype::Bf16, f64::NAN)).is_nan());
        assert_eq!(round_to(RefDtype::Bf16, 0.0), 0);
        assert_eq!(round_to(RefDtype::Bf16, -0.0), 0x8000);
        assert_eq!(round_to(RefDtype::F32, 0.1), 0.1f32.to_bits());
    }

    #[test]
    fn ulp_distances() {
        assert_eq!(ulp_f32(1.0, 1.0), 0);
        assert_eq!(ulp_f32(1.0, f32::from_bits(1.0f32.to_bits() + 3)), 3);
        assert_eq!(ulp_f32(-1.0, f32::from_bits((-1.0f32).to_bits() + 2)), 2);
        assert_eq!(ulp_f32(0.0, -0.0), 1, "+0 and -0 are different bytes: 1 apart");
        assert_eq!(ulp_f32(f32::from_bits(1), -f32::from_bits(1)), 3);
        assert_eq!(ulp_f32(f32::NAN, f32::NAN), u64::MAX);
        assert_eq!(ulp_f32(1.0, f32::NAN), u64::MAX);
        assert_eq!(ulp_f32(f32::MAX, f32::INFINITY), 1);
        assert_eq!(ulp_bf16(0x3f80, 0x3f81), 1);
        assert_eq!(ulp_bf16(0x3f81, 0x3f80), 1);
        assert_eq!(ulp_bf16(0x0000, 0x8000), 1);
        assert_eq!(ulp_bf16(0xbf80, 0xbf82), 2);
        assert_eq!(ulp_bf16(0x7fc0, 0x3f80), u64::MAX);
        assert_eq!(ulp_bits(RefDtype::Bf16, 0x3f80, 0x3f84), 4);
        assert_eq!(max_ulp(RefDtype::Bf16, &[1.0, 2.0], &[0x3f80, 0x4001]), 1);
        assert_eq!(max_ulp(RefDtype::Bf16, &[1.0], &[0x3f80, 0x4001]), u64::MAX);
        assert_eq!(max_ulp(RefDtype::F32, &[], &[]), 0);
    }

    proptest! {
        #[test]
        fn ulp_f32_is_monotone_and_zero_iff_equal(a in any::<u32>(), b in any::<u32>()) {
            let (x, y) = (f32::from_bits(a), f32::from_bits(b));
            prop_assume!(!x.is_nan() && !y.is_nan());
            let d = ulp_f32(x, y);
            prop_assert_eq!(d == 0, a == b);
            prop_assert_eq!(d, ulp_f32(y, x));
            if x < y { prop_assert!(ordered(a as u64, 1 << 31) < ordered(b as u64, 1 << 31)); }
        }

        #[test]
        fn round_to_bf16_matches_half_on_f32_inputs(a in any::<u32>()) {
            let x = f32::from_bits(a);
            prop_assume!(!x.is_nan());
            prop_assert_eq!(round_to(RefDtype::Bf16, x as f64), half::bf16::from_f32(x).to_bits() as u32);
        }
    }
}
