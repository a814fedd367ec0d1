//! Canaries: every check function must fail on inputs that differ from a passing input only in the **last**
//! element, the last row, or the last byte. A check weakened to look at the first element (or the first row)
//! fails these tests, so no check is protected by another check running first.

use super::*;
use kvsim_cache::bytes::Words;
use kvsim_cache::{MaskSpec, RingState};
use kvsim_reference::{attention_bits, RefDtype, RowModel, Tensor, Tok, ValueSpace};
use std::rc::Rc;

fn ab(dtype: Dtype, shape: &[i32], words: Words) -> ArrayBytes {
    ArrayBytes { dtype, shape: shape.to_vec(), words }
}

/// `w` with its last element's lowest bit flipped.
fn flip_last(w: &Words) -> Words {
    let mut w = w.clone();
    match &mut w {
        Words::U8(v) => *v.last_mut().unwrap() ^= 1,
        Words::U16(v) => *v.last_mut().unwrap() ^= 1,
        Words::U32(v) => *v.last_mut().unwrap() ^= 1,
        Words::U64(v) => *v.last_mut().unwrap() ^= 1,
    }
    w
}

fn vs(dtype: RefDtype) -> ValueSpace {
    ValueSpace { seed: 7, heads_kv: 2, heads_q: 4, head_dim: 8, dtype }
}

#[test]
fn bytes_equal_sees_the_last_element_and_the_shape() {
    let a = ab(Dtype::Float32, &[1, 2, 3, 4], Words::U32((0..24).map(|x| (x as f32).to_bits()).collect()));
    assert!(bytes_equal("x", &a, &a.clone()).is_ok());
    let b = ab(a.dtype, &a.shape, flip_last(&a.words));
    assert_eq!(bytes_equal("x", &a, &b).unwrap_err().check, "bytes_vs_twin");
    // Same bits, another shape (the last row moved into another axis).
    let c = ab(a.dtype, &[1, 2, 4, 3], a.words.clone());
    assert!(bytes_equal("x", &a, &c).is_err());
    // The last byte of a u8 buffer.
    let d = ab(Dtype::Uint8, &[5], Words::U8(vec![1, 2, 3, 4, 5]));
    assert!(bytes_equal("x", &d, &ab(Dtype::Uint8, &[5], flip_last(&d.words))).is_err());
}

#[test]
fn error_matches_tells_every_verdict_apart() {
    use kvsim_cache::CacheError as C;
    let prod = [
        Ok(()),
        Err(C::NotTrimmable { offset: 5, max_size: 4 }),
        Err(C::TrimTooLong { requested: 3, available: 2 }),
        Err(C::BypassNotAfterWindow),
    ];
    let model =
        [Ok(()), Err(ModelError::NotTrimmable), Err(ModelError::TrimTooLong), Err(ModelError::BypassNotAfterWindow)];
    for (i, m) in model.iter().enumerate() {
        for (j, p) in prod.iter().enumerate() {
            let r = error_matches("trim", m, p);
            assert_eq!(r.is_ok(), i == j, "model {m:?} vs production {p:?}");
            if i != j {
                assert_eq!(r.unwrap_err().check, "errors");
            }
        }
    }
}

#[test]
fn rope_snapshot_sees_the_last_row() {
    assert!(rope_snapshot(&[3, 9, 4], &[3, 9, 4], &[3, 9, 4]).is_ok());
    // Differs from the model in the last row only.
    assert_eq!(rope_snapshot(&[3, 9, 5], &[3, 9, 5], &[3, 9, 4]).unwrap_err().check, "rope");
    // Moved after the op in the last row only (aliasing).
    assert_eq!(rope_snapshot(&[3, 9, 4], &[3, 9, 5], &[3, 9, 4]).unwrap_err().check, "rope");
    // A missing last row.
    assert!(rope_snapshot(&[3, 9], &[3, 9], &[3, 9, 4]).is_err());
}

#[test]
fn mask_row_sees_the_last_column_and_the_last_row() {
    let width = 4;
    // No mask: every column.
    assert!(mask_row(&MaskUse::None, 0, 0, &[0, 1, 2, 3], 1, width, ReadKind::Decode).is_ok());
    assert!(mask_row(&MaskUse::None, 0, 0, &[0, 1, 2], 1, width, ReadKind::Decode).is_err());
    // Causal with 2 queries over 4 columns: query 0 sees [0, 3), query 1 sees [0, 4).
    assert!(mask_row(&MaskUse::Causal, 0, 0, &[0, 1, 2], 2, width, ReadKind::Window).is_ok());
    assert!(mask_row(&MaskUse::Causal, 0, 1, &[0, 1, 2, 3], 2, width, ReadKind::Window).is_ok());
    assert!(mask_row(&MaskUse::Causal, 0, 1, &[0, 1, 2], 2, width, ReadKind::Window).is_err());
    // An array mask of 2 rows x 1 query x 3 columns; the expected visibility differs in the last column of the
    // last row only.
    let spec = MaskSpec { rows: 2, queries: 1, cols: 3, visible: vec![true, true, false, true, true, true] };
    let m = MaskUse::Array(Rc::new(spec.clone()));
    assert!(mask_row(&m, 1, 0, &[0, 1, 2], 1, 3, ReadKind::Decode).is_ok());
    assert_eq!(mask_row(&m, 1, 0, &[0, 1], 1, 3, ReadKind::Decode).unwrap_err().check, "mask");
    let mut last_off = spec.clone();
    *last_off.visible.last_mut().unwrap() = false;
    let m2 = MaskUse::Array(Rc::new(last_off));
    assert!(mask_row(&m2, 1, 0, &[0, 1, 2], 1, 3, ReadKind::Decode).is_err());
    // A row or query the mask does not have.
    assert!(mask_row(&m, 2, 0, &[0], 1, 3, ReadKind::Decode).is_err());
}

/// Outputs `[2, H_q, 1, D]` of two rows whose row 1 is the model's rounded attention for `q` over `keys`.
fn model_outputs(v: &ValueSpace, q: Tok, keys: &[Tok], scale: f32) -> ArrayBytes {
    let bits = attention_bits(v, 0, q, keys, scale as f64);
    let row0 = attention_bits(v, 0, Tok::new(9, 0), &[Tok::new(9, 0)], scale as f64);
    let all: Vec<u32> = row0.into_iter().chain(bits).collect();
    let shape = [2, v.heads_q as i32, 1, v.head_dim as i32];
    match v.dtype {
        RefDtype::F32 => ab(Dtype::Float32, &shape, Words::U32(all)),
        RefDtype::Bf16 => ab(Dtype::Bfloat16, &shape, Words::U16(all.into_iter().map(|b| b as u16).collect())),
    }
}

#[test]
fn output_vs_model_sees_the_last_element_of_the_last_row() {
    for dtype in [RefDtype::F32, RefDtype::Bf16] {
        let v = vs(dtype);
        let keys: Vec<Tok> = (0..5).map(|p| Tok::new(1, p)).collect();
        let q = Tok::new(1, 4);
        let out = model_outputs(&v, q, &keys, 0.35);
        let mut c = Counters::default();
        output_vs_model(&v, 0, q, &keys, 0.35, &out, 1, 0, &mut c).unwrap();
        assert_eq!((c.checks, c.model_checks), (1, 1));
        // The last element of row 1 moved by a gross amount (0.25 absolute: far above any bound).
        let mut bad = out.clone();
        let last = bad.words.len() - 1;
        let moved = |w: u64| -> u64 {
            match dtype {
                RefDtype::F32 => (f32::from_bits(w as u32) + 0.25).to_bits() as u64,
                RefDtype::Bf16 => ((f32::from_bits((w as u32) << 16) + 0.25).to_bits() >> 16) as u64,
            }
        };
        let new = moved(bad.words.get(last));
        match &mut bad.words {
            Words::U32(w) => w[last] = new as u32,
            Words::U16(w) => w[last] = new as u16,
            _ => unreachable!(),
        }
        let e = output_vs_model(&v, 0, q, &keys, 0.35, &bad, 1, 0, &mut c).unwrap_err();
        assert_eq!(e.check, "output_vs_model", "{dtype:?}");
        // The wrong key set (one key missing at the end) is seen too.
        assert!(output_vs_model(&v, 0, q, &keys[..4], 0.35, &out, 1, 0, &mut c).is_err(), "{dtype:?}");
        // A non-finite last element is its own failure.
        let mut nan = out.clone();
        match &mut nan.words {
            Words::U32(w) => *w.last_mut().unwrap() = f32::NAN.to_bits(),
            Words::U16(w) => *w.last_mut().unwrap() = 0x7fc0,
            _ => unreachable!(),
        }
        assert_eq!(output_vs_model(&v, 0, q, &keys, 0.35, &nan, 1, 0, &mut c).unwrap_err().check, "nan");
    }
}

#[test]
fn output_vs_twin_sees_a_last_bit_of_the_last_row() {
    // Production `[2, 2, 1, 4]`, twin `[1, 2, 1, 4]` equal to production row 1.
    let prod: Vec<u32> = (0..16).map(|x| (0.1f32 * x as f32).to_bits()).collect();
    let out = ab(Dtype::Float32, &[2, 2, 1, 4], Words::U32(prod.clone()));
    let twin = ab(Dtype::Float32, &[1, 2, 1, 4], Words::U32(prod[8..].to_vec()));
    let mut c = Counters::default();
    output_vs_twin(OutClass::DecodeUnpadded, &[], &out, 1, &twin, 1, &mut c).unwrap();
    assert_eq!((c.decode_unpadded.compared, c.decode_unpadded.bit_exact), (1, 1));
    let off = ab(Dtype::Float32, &[1, 2, 1, 4], flip_last(&twin.words));
    let e = output_vs_twin(OutClass::DecodeUnpadded, &[], &out, 1, &off, 1, &mut c).unwrap_err();
    assert_eq!(e.check, "decode_vs_solo");
    assert_eq!(c.decode_unpadded.bit_exact, 1, "the differing comparison is not counted bit-exact");
    assert!(c.decode_unpadded.max_ulp >= 1);
    // Classes that are measured, not promised: no failure, but the distance is recorded (a last-bit change is 1).
    for class in [OutClass::DecodePadded, OutClass::Window] {
        let mut c = Counters::default();
        output_vs_twin(class, &["tag"], &out, 1, &off, 1, &mut c).unwrap();
        let cc = if class == OutClass::Window { c.window } else { c.decode_padded };
        assert_eq!((cc.compared, cc.bit_exact, cc.max_ulp), (1, 0, 1), "{class:?}");
        assert_eq!(c.table["tag/f32"].max_ulp, 1);
    }
    // On a device where unpadded decode is measured only, the difference is recorded, not failed.
    let mut c = Counters { guarantees: Guarantees { exact_unpadded_decode: false, gpu: true }, ..Counters::default() };
    output_vs_twin(OutClass::DecodeUnpadded, &[], &out, 1, &off, 1, &mut c).unwrap();
    assert_eq!(c.decode_unpadded.max_ulp, 1);
}

#[test]
fn output_vs_twin_sees_the_last_query_of_a_window() {
    // Two queries; the twin differs in the last query's last element only.
    let prod: Vec<u16> = (0..16).map(|x| 0x3f80 + x as u16).collect();
    let out = ab(Dtype::Bfloat16, &[1, 2, 2, 4], Words::U16(prod.clone()));
    let twin = ab(Dtype::Bfloat16, &[1, 2, 2, 4], flip_last(&out.words));
    let mut c = Counters::default();
    output_vs_twin(OutClass::Window, &[], &out, 0, &twin, 2, &mut c).unwrap();
    assert_eq!(c.window.max_ulp, 1);
    // Comparing only the first query (n = 1) sees nothing: the padded query positions are unspecified.
    let mut c = Counters::default();
    output_vs_twin(OutClass::Window, &[], &out, 0, &twin, 1, &mut c).unwrap();
    assert_eq!(c.window.max_ulp, 0);
}

#[test]
fn bytes_per_token_checks_every_count() {
    let spec = KvSpec { heads_kv: 2, head_dim: 8, dtype: cache::KvDtype::Bf16 };
    let per = 2 * 2 * 8 * 2;
    assert!(bytes_per_token("x", per, |n| n.min(16) * per, Some(16), spec).is_ok());
    assert!(bytes_per_token("x", per, |n| n * per, None, spec).is_ok());
    assert_eq!(bytes_per_token("x", per + 1, |n| n * per, None, spec).unwrap_err().check, "bytes_per_token");
    // Wrong only for the last count checked (100 tokens: not capped at the window).
    assert!(bytes_per_token("x", per, |n| n * per, Some(16), spec).is_err());
    assert!(bytes_per_token("x", per, |n| if n == 100 { 0 } else { n * per }, None, spec).is_err());
    // The dtype's item size counts.
    let f32spec = KvSpec { dtype: cache::KvDtype::F32, ..spec };
    assert!(bytes_per_token("x", per, |n| n * per, None, f32spec).is_err());
}

#[test]
fn plain_checks_see_the_last_row_and_field() {
    assert!(left_padding(&[0, -3, 2], &[0, -3, 2]).is_ok());
    assert_eq!(left_padding(&[0, -3, 2], &[0, -3, 1]).unwrap_err().check, "left_padding");
    assert!(left_padding(&[0, -3], &[0, -3, 2]).is_err());
    assert!(flag("is_trimmable", true, true).is_ok());
    assert_eq!(flag("is_trimmable", false, true).unwrap_err().check, "flags");
    assert!(flag("is_trimmable", true, false).is_err());
    // Ring state: differs in the last field only.
    let mut m = RowModel::from_temporal(Some(4), (0..3).map(|p| Tok::new(0, p)).collect(), 3);
    let s = RingState { offset: 3, len: 3, idx: 3, last_concat: None };
    assert!(ring_state("row", &s, &m).is_ok());
    m.last_concat = Some(3);
    assert_eq!(ring_state("row", &s, &m).unwrap_err().check, "ring_state");
    m.last_concat = None;
    for bad in
        [RingState { offset: 4, ..s.clone() }, RingState { len: 2, ..s.clone() }, RingState { idx: 0, ..s.clone() }]
    {
        assert!(ring_state("row", &bad, &m).is_err(), "{bad:?}");
    }
}

/// Bytes `[1, H, n, D]` of `toks` as the model lays them out.
fn columns(v: &ValueSpace, t: Tensor, toks: &[Tok]) -> ArrayBytes {
    let (h, d, n) = (v.heads_kv, v.head_dim, toks.len());
    let cols: Vec<Vec<u32>> = toks.iter().map(|&tok| v.column_bits(0, t, tok)).collect();
    let mut w = vec![0u32; h * n * d];
    for (c, col) in cols.iter().enumerate() {
        for x in 0..h * d {
            w[((x / d) * n + c) * d + x % d] = col[x];
        }
    }
    let shape = [1, h as i32, n as i32, d as i32];
    match v.dtype {
        RefDtype::F32 => ab(Dtype::Float32, &shape, Words::U32(w)),
        RefDtype::Bf16 => ab(Dtype::Bfloat16, &shape, Words::U16(w.into_iter().map(|b| b as u16).collect())),
    }
}

#[test]
fn columns_vs_model_sees_the_last_byte_of_the_last_column() {
    for dtype in [RefDtype::F32, RefDtype::Bf16] {
        let v = vs(dtype);
        let toks: Vec<Tok> = (0..5).map(|p| Tok::new(2, p)).collect();
        for t in [Tensor::K, Tensor::V] {
            let got = columns(&v, t, &toks);
            columns_vs_model("row", &v, 0, t, &got, &toks).unwrap();
            let flipped = ab(got.dtype, &got.shape, flip_last(&got.words));
            assert_eq!(columns_vs_model("row", &v, 0, t, &flipped, &toks).unwrap_err().check, "layout");
            // The last column holds another token (a rotation by one), the count differs, the tensor differs.
            let mut other = toks.clone();
            *other.last_mut().unwrap() = Tok::new(2, 5);
            assert!(columns_vs_model("row", &v, 0, t, &got, &other).is_err());
            assert!(columns_vs_model("row", &v, 0, t, &got, &toks[..4]).is_err());
            let wrong = if t == Tensor::K { Tensor::V } else { Tensor::K };
            assert!(columns_vs_model("row", &v, 0, wrong, &got, &toks).is_err());
        }
    }
}

#[test]
fn mask_memo_sees_a_second_build_of_the_last_family() {
    let once = vec![("decode:4".to_string(), 1), ("window:inf".to_string(), 1)];
    assert!(mask_memo("forward", &once).is_ok());
    assert!(mask_memo("forward", &[]).is_ok());
    let mut twice = once.clone();
    twice[1].1 = 2;
    assert_eq!(mask_memo("forward", &twice).unwrap_err().check, "mask_memo");
}

/// With the checks off (`kvsim oracle teeth`) a failing comparison lets the op go on and is collected; outside it
/// the same comparison fails, and switching them off does not leak past the closure.
#[test]
fn checks_off_collects_failures_and_restores() {
    let f = |got: bool| flag("bypass", got, true);
    assert!(f(false).is_err());
    let (r, found) = checks_off(|| (f(false), f(true), left_padding(&[1], &[2])));
    assert_eq!(r, (Ok(()), Ok(()), Ok(())));
    assert_eq!(found.iter().map(|x| x.check.as_str()).collect::<Vec<_>>(), ["flags", "left_padding"]);
    assert!(f(false).is_err(), "checks stay off after checks_off returned");
    // Nested: the inner closure's failures are its own.
    let ((_, inner), outer) = checks_off(|| {
        let _ = f(false);
        checks_off(|| f(false))
    });
    assert_eq!((inner.len(), outer.len()), (1, 1));
}

#[test]
fn capacity_sees_the_last_row() {
    let spec = KvSpec { heads_kv: 2, head_dim: 8, dtype: cache::KvDtype::F32 };
    let row = |len: usize| cache::RowState {
        ring: RingState { offset: len, len, idx: len, last_concat: None },
        base: 0,
        pending: None,
    };
    let zeros = |cap: i32| mlx_rs::ops::zeros::<f32>(&[2, 2, cap, 8]).unwrap();
    let mut c = Counters::default();
    // Rings of W = 8 whose last row holds a 20-column plateau: 20 columns are its bound.
    let ring = RowBatch::adopt(spec, Some(8), zeros(20), zeros(20), vec![row(3), row(20)]).unwrap();
    assert!(capacity("x", &ring, &[3, 20], Some(8), &mut c).is_ok());
    assert_eq!(c.checks, 1, "counted");
    assert_eq!(capacity("x", &ring, &[3, 19], Some(8), &mut c).unwrap_err().check, "capacity");
    // Linear rows: one growth step ahead of the longest (adopt cuts a wider buffer to it).
    let linear = RowBatch::adopt(spec, None, zeros(400), zeros(400), vec![row(3), row(20)]).unwrap();
    assert_eq!(linear.cap(), 20 + cache::ring::GROW_STEP - 1);
    assert!(capacity("x", &linear, &[3, 20], None, &mut c).is_ok());
    assert_eq!(capacity("x", &linear, &[3, 19], None, &mut c).unwrap_err().check, "capacity");
    // The window is part of the rings' bound: short rows may hold W columns, not more.
    let short = RowBatch::adopt(spec, Some(8), zeros(8), zeros(8), vec![row(3), row(2)]).unwrap();
    assert!(capacity("x", &short, &[3, 2], Some(8), &mut c).is_ok());
    assert!(capacity("x", &short, &[3, 2], Some(7), &mut c).is_err());
}
