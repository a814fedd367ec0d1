//! `kvsim bench --what exact`: is the exact read ([`crate::cache::exact`]) batch-invariant where it runs, how
//! accurate is it, and what does the stock fused SDPA do in the same setting.
//!
//! For each dtype (bf16, f32) and read class (decode unmasked: every row the same length; decode masked: rows of
//! random lengths, mask `c < len_r`; window causal: L = 4 queries, unbounded window; window sliding: L = 4, W = 700,
//! rows of random lengths) and batch size B in {2, 8, 64}: random rows (H_q 32, H_kv 8, D 128, up to 2,100 keys, so
//! up to 9 chunks) are read as a batch, then each checked row again **alone** (`[1, ...]`, its own length, contiguous
//! copies); the row's output bytes in the batch are compared with its bytes alone, for the exact read and for MLX's
//! fused SDPA (alone: no mask for decode, MLX's `Causal` for an unbounded window, as kvsim's solo caches read).
//! Accuracy: every alone exact output against an f64 softmax attention on the host (max ULP at output scale) and
//! against [`crate::cache::exact::emulate`] (the same order on the host; raw ULP distance).

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{Array, Dtype};
use serde_json::{json, Value};

use crate::bytes::ArrayBytes;
use crate::cache::exact::{emulate, exact_attend, visible_ranges, ReadDims, Visibility};
use crate::cache::{MaskKey, MaskKind, MaskSpec};

const HQ: usize = 32;
const HKV: usize = 8;
const D: usize = 128;
const L_WINDOW: usize = 4;

#[derive(Clone, Copy, Debug)]
enum Class {
    DecodeUnmasked,
    DecodeMasked,
    WindowCausal,
    WindowSliding,
}

impl Class {
    fn name(self) -> &'static str {
        match self {
            Class::DecodeUnmasked => "decode_unmasked",
            Class::DecodeMasked => "decode_masked",
            Class::WindowCausal => "window_causal",
            Class::WindowSliding => "window_sliding",
        }
    }
    fn queries(self) -> usize {
        match self {
            Class::DecodeUnmasked | Class::DecodeMasked => 1,
            _ => L_WINDOW,
        }
    }
    fn window(self) -> Option<usize> {
        matches!(self, Class::WindowSliding).then_some(700)
    }
    /// The visibility of a read of rows of these lengths: `(mask, causal)`.
    fn visibility(self, lens: &[usize]) -> (Option<MaskSpec>, bool) {
        let uniform = lens.iter().all(|&l| l == lens[0]);
        let cols = lens.iter().copied().max().unwrap_or(1).max(1);
        let l = self.queries();
        let key = |kind| MaskKey {
            kind,
            lens: lens.to_vec(),
            real: vec![l; lens.len()],
            queries: l,
            window: self.window(),
            cols,
        };
        match self {
            Class::DecodeUnmasked | Class::DecodeMasked if uniform => (None, false),
            Class::DecodeUnmasked | Class::DecodeMasked => (Some(MaskSpec::build(&key(MaskKind::Decode))), false),
            Class::WindowCausal if uniform => (None, true),
            _ => (Some(MaskSpec::build(&key(MaskKind::Window))), false),
        }
    }
}

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

fn rand_array(shape: &[usize], seed: u64, dt: Dtype) -> Result<Array, String> {
    let s: Vec<i32> = shape.iter().map(|&x| x as i32).collect();
    let key = mlx_rs::random::key(seed).map_err(|e| e.to_string())?;
    let a = mlx_rs::random::uniform::<f32, f32>(-1.0, 1.0, &s[..], &key).map_err(|e| e.to_string())?;
    a.as_dtype(dt).map_err(|e| e.to_string())
}

fn host_f32(a: &Array) -> Result<Vec<f32>, String> {
    let f = a.as_dtype(Dtype::Float32).map_err(|e| e.to_string())?;
    let b = ArrayBytes::of(&f).map_err(|e| e.to_string())?;
    Ok(b.words.to_u32().into_iter().map(f32::from_bits).collect())
}

/// Distance in ULPs of the dtype at the output's scale (magnitudes below 2^-6 in the ULP of 2^-6).
fn ulp_at_scale(got: f64, want: f64, dt: Dtype) -> f64 {
    let mant = if dt == Dtype::Bfloat16 { 7 } else { 23 };
    let ulp = want.abs().max(1.0 / 64.0).log2().floor().exp2() * (-(mant as f64)).exp2();
    (got - want).abs() / ulp
}

fn raw_ulp(a: f32, b: f32, dt: Dtype) -> u64 {
    let key = |x: f32| {
        let bits = if dt == Dtype::Bfloat16 { (half::bf16::from_f32(x).to_bits() as u32) << 16 } else { x.to_bits() };
        if bits & 0x8000_0000 != 0 {
            -((bits & 0x7fff_ffff) as i64)
        } else {
            bits as i64
        }
    };
    key(a).abs_diff(key(b))
}

/// f64 attention of one row (`q [HQ, L, D]`, `k`/`v` `[HKV, len, D]`) under `vis`.
fn reference(q: &[f32], k: &[f32], v: &[f32], len: usize, l: usize, vis: &Visibility, scale: f32) -> Vec<f64> {
    let g = HQ / HKV;
    let mut out = vec![0f64; HQ * l * D];
    for h in 0..HQ {
        let kvh = h / g;
        for i in 0..l {
            let cols: Vec<usize> = (0..len).filter(|&c| vis.sees(i, c)).collect();
            let qr = &q[(h * l + i) * D..][..D];
            let s: Vec<f64> = cols
                .iter()
                .map(|&c| {
                    let kr = &k[(kvh * len + c) * D..][..D];
                    qr.iter().zip(kr).map(|(a, b)| *a as f64 * *b as f64).sum::<f64>() * scale as f64
                })
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = w.iter().sum();
            for (j, &c) in cols.iter().enumerate() {
                let vr = &v[(kvh * len + c) * D..][..D];
                for x in 0..D {
                    out[(h * l + i) * D + x] += w[j] * vr[x] as f64 / z;
                }
            }
        }
    }
    out
}

fn fused(q: &Array, k: &Array, v: &Array, scale: f32, mask: Option<&MaskSpec>, causal: bool) -> Result<Array, String> {
    use mlx_rs::fast::{scaled_dot_product_attention as sdpa, ScaledDotProductAttentionMask as M};
    let r = match (mask, causal) {
        (Some(m), _) => {
            let arr = m.to_array().map_err(|e| e.to_string())?;
            sdpa(q, k, v, scale, M::Array(&arr), None)
        }
        (None, true) => sdpa(q, k, v, scale, M::Causal, None),
        (None, false) => sdpa(q, k, v, scale, None, None),
    };
    r.map_err(|e| e.to_string())
}

/// One (dtype, class, B) cell: counts of byte-identical rows (exact and fused) and accuracy maxima.
fn cell(dt: Dtype, class: Class, b: usize, seed: u64) -> Result<Value, String> {
    let mut rng = seed;
    let l = class.queries();
    let scale = 1.0 / (D as f32).sqrt();
    let lens: Vec<usize> = match class {
        Class::DecodeUnmasked => vec![1 + (splitmix(&mut rng) % 2100) as usize; b],
        _ => (0..b).map(|_| l + (splitmix(&mut rng) % 2100) as usize).collect(),
    };
    let n = *lens.iter().max().unwrap_or(&1);
    let q = rand_array(&[b, HQ, l, D], seed ^ 1, dt)?;
    let k = rand_array(&[b, HKV, n, D], seed ^ 2, dt)?;
    let v = rand_array(&[b, HKV, n, D], seed ^ 3, dt)?;
    let (mask, causal) = class.visibility(&lens);
    let ranges = visible_ranges(b, l, n, mask.as_ref(), causal).map_err(|e| e.to_string())?;
    let ex = exact_attend(&q, &k, &v, scale, &ranges).map_err(|e| e.to_string())?;
    let fu = fused(&q, &k, &v, scale, mask.as_ref(), causal)?;
    mlx_rs::transforms::eval([&ex, &fu]).map_err(|e| e.to_string())?;
    let checked: Vec<usize> = if b <= 8 { (0..b).collect() } else { (0..8).map(|i| (i * 37 + 5) % b).collect() };
    let (mut ex_same, mut fu_same) = (0, 0);
    let (mut max_ref, mut max_emu, mut max_ex_vs_fused) = (0f64, 0u64, 0u64);
    let mut fu_worst = 0u64;
    for &r in &checked {
        let len = lens[r];
        let ri = r as i32;
        let take = |a: &Array, cols: Option<usize>| -> Result<Array, String> {
            let s = match cols {
                Some(c) => a.try_index((ri..ri + 1, .., 0..c as i32, ..)),
                None => a.try_index((ri..ri + 1, .., .., ..)),
            };
            s.and_then(|x| x.contiguous()).map_err(|e| e.to_string())
        };
        let (qa, ka, va) = (take(&q, None)?, take(&k, Some(len))?, take(&v, Some(len))?);
        let (amask, acausal) = class.visibility(&[len]);
        let aranges = visible_ranges(1, l, len, amask.as_ref(), acausal).map_err(|e| e.to_string())?;
        let ex_alone = exact_attend(&qa, &ka, &va, scale, &aranges).map_err(|e| e.to_string())?;
        // The solo caches read decode with no mask and an unbounded window with MLX's `Causal`.
        let fu_alone = match class {
            Class::DecodeUnmasked | Class::DecodeMasked => fused(&qa, &ka, &va, scale, None, false)?,
            Class::WindowCausal => fused(&qa, &ka, &va, scale, None, true)?,
            Class::WindowSliding => fused(&qa, &ka, &va, scale, amask.as_ref(), false)?,
        };
        let ex_row = take(&ex, None)?;
        let fu_row = take(&fu, None)?;
        let bytes = |a: &Array| ArrayBytes::of(a).map_err(|e| e.to_string());
        let (e1, e2, f1, f2) = (bytes(&ex_row)?, bytes(&ex_alone)?, bytes(&fu_row)?, bytes(&fu_alone)?);
        ex_same += usize::from(e1 == e2);
        fu_same += usize::from(f1 == f2);
        let (fb, fa) = (host_f32(&fu_row)?, host_f32(&fu_alone)?);
        fu_worst = fb.iter().zip(&fa).map(|(x, y)| raw_ulp(*x, *y, dt)).fold(fu_worst, u64::max);
        // Accuracy on the first two rows of B = 8 cells (the host references are slow).
        if b != 8 || r >= 2 {
            continue;
        }
        let (hq_, ha, hv) = (host_f32(&qa)?, host_f32(&ka)?, host_f32(&va)?);
        let want = reference(&hq_, &ha, &hv, len, l, &aranges, scale);
        let got = host_f32(&ex_alone)?;
        let fgot = host_f32(&fu_alone)?;
        let dims = ReadDims {
            rows: 1,
            heads_q: HQ,
            heads_kv: HKV,
            queries: l,
            cols: len,
            head_dim: D,
            kv_bytes: if dt == Dtype::Bfloat16 { 2 } else { 4 },
        };
        let emu = emulate(&hq_, &ha, &hv, dims, &aranges, scale);
        for i in 0..got.len() {
            max_ref = max_ref.max(ulp_at_scale(got[i] as f64, want[i], dt));
            max_emu = max_emu.max(raw_ulp(got[i], emu[i], dt));
            max_ex_vs_fused = max_ex_vs_fused.max(raw_ulp(got[i], fgot[i], dt));
        }
    }
    Ok(json!({"dtype": if dt == Dtype::Bfloat16 { "bf16" } else { "f32" }, "class": class.name(), "B": b,
        "keys_max": n, "queries": l, "rows_compared": checked.len(),
        "exact_rows_byte_identical": ex_same, "fused_rows_byte_identical": fu_same,
        "fused_max_raw_ulp_batch_vs_alone": fu_worst,
        "exact_max_ulp_vs_f64_at_output_scale": max_ref, "exact_max_raw_ulp_vs_host_emulation": max_emu,
        "exact_vs_fused_alone_max_raw_ulp": max_ex_vs_fused}))
}

/// Every cell (see module docs). `seeds` batches per cell.
pub fn check(seeds: u64) -> Value {
    let mut cells = vec![];
    let (mut compared, mut identical, mut fused_identical) = (0u64, 0u64, 0u64);
    for (di, dt) in [Dtype::Bfloat16, Dtype::Float32].into_iter().enumerate() {
        for (ci, class) in [Class::DecodeUnmasked, Class::DecodeMasked, Class::WindowCausal, Class::WindowSliding]
            .into_iter()
            .enumerate()
        {
            for b in [2usize, 8, 64] {
                for s in 0..seeds {
                    let seed = ((di as u64 * 4 + ci as u64) * 1000 + b as u64) * 100 + s;
                    match cell(dt, class, b, seed) {
                        Ok(c) => {
                            compared += c["rows_compared"].as_u64().unwrap_or(0);
                            identical += c["exact_rows_byte_identical"].as_u64().unwrap_or(0);
                            fused_identical += c["fused_rows_byte_identical"].as_u64().unwrap_or(0);
                            cells.push(c);
                        }
                        Err(e) => {
                            cells.push(json!({"dtype": format!("{dt:?}"), "class": class.name(), "B": b, "error": e}))
                        }
                    }
                }
            }
        }
    }
    json!({"rows_compared": compared, "exact_rows_byte_identical": identical,
           "fused_rows_byte_identical": fused_identical, "cells": cells})
}
