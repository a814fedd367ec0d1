//! Expected attention in f64.
//!
//! [`attention_f64`] computes `softmax(q · kᵀ · scale) · v` in f64 from the dtype-rounded values of
//! [`ValueSpace`], with grouped-query attention (query head `h` reads kv head `h / (heads_q / heads_kv)`). It is the
//! model's answer to "what should this read return", independent of key order up to f64 rounding; the production
//! read's output is measured against it in ULPs of the storage dtype (`values::max_ulp`).
//!
//! Depends only on `values` (one direction: `values` <- `attention`, `values` <- `model` <- `compare`).

use crate::values::{round_to, Tensor, Tok, ValueSpace};

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
    let q = vs.column(layer, Tensor::Q, q_tok);
    let ks: Vec<_> = keys.iter().map(|&t| vs.column(layer, Tensor::K, t)).collect();
    let vs_: Vec<_> = keys.iter().map(|&t| vs.column(layer, Tensor::V, t)).collect();
    attention_over(vs, &q, &ks, &vs_, scale)
}

/// f64 softmax attention of one query column `q` (`[heads_q * D]`) over explicit key and value columns
/// (`[heads_kv * D]` each), GQA head mapping as [`attention_f64`]. `keys` must be non-empty.
pub(crate) fn attention_over<C: AsRef<[f32]>>(vs: &ValueSpace, q: &[f32], ks: &[C], vs_: &[C], scale: f64) -> Vec<f64> {
    let d = vs.head_dim;
    let group = vs.heads_q / vs.heads_kv;
    let mut out = vec![0.0f64; vs.heads_q * d];
    for h in 0..vs.heads_q {
        let kv = h / group;
        let qh = &q[h * d..(h + 1) * d];
        let scores: Vec<f64> = ks
            .iter()
            .map(|k| {
                let kh = &k.as_ref()[kv * d..(kv + 1) * d];
                qh.iter().zip(kh).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * scale
            })
            .collect();
        let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
        let z: f64 = w.iter().sum();
        for (wj, v) in w.iter().zip(vs_) {
            let vh = &v.as_ref()[kv * d..(kv + 1) * d];
            for (o, &x) in out[h * d..(h + 1) * d].iter_mut().zip(vh) {
                *o += wj / z * x as f64;
            }
        }
    }
    out
}

/// Expected attention output as storage bits of `vs.dtype` ([`attention_f64`] then [`round_to`]).
pub fn attention_bits(vs: &ValueSpace, layer: u32, q_tok: Tok, keys: &[Tok], scale: f64) -> Vec<u32> {
    attention_f64(vs, layer, q_tok, keys, scale).into_iter().map(|x| round_to(vs.dtype, x)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::values::{max_ulp, RefDtype};

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
}
