use super::*;
use crate::mask::{MaskKey, MaskKind};
use crate::testutil::{data, pin_cpu};
use crate::{KvDtype, KvSpec, Masks, RotatingKvCache};

/// Deterministic f32 values in [-1, 1).
fn vals(seed: u64, n: usize) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let mut z = (i ^ seed.rotate_left(23)).wrapping_add(seed).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            z ^= z >> 31;
            z = z.wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z ^= z >> 29;
            (z >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

fn key(kind: MaskKind, lens: &[usize], real: &[usize], queries: usize, window: Option<usize>) -> MaskKey {
    let cols = lens.iter().copied().max().unwrap_or(0).max(1);
    MaskKey { kind, lens: lens.to_vec(), real: real.to_vec(), queries, window, cols }
}

/// The `[lo, hi)` pairs of every query, flattened (one interval each, or more where the mask has holes).
fn flat(v: &Visibility) -> Vec<Vec<i32>> {
    (0..v.queries()).map(|q| v.intervals(q).flat_map(|(a, b)| [a as i32, b as i32]).collect()).collect()
}

#[test]
fn ranges_of_no_mask_causal_and_masks() {
    assert_eq!(flat(&visible_ranges(2, 1, 5, None, false).unwrap()), vec![vec![0, 5], vec![0, 5]]);
    // Bottom-right causal: 3 queries over 5 columns see [0, 3), [0, 4), [0, 5).
    assert_eq!(flat(&visible_ranges(1, 3, 5, None, true).unwrap()), vec![vec![0, 3], vec![0, 4], vec![0, 5]]);
    let m = MaskSpec::build(&key(MaskKind::Window, &[6], &[3], 3, Some(4)));
    assert_eq!(flat(&visible_ranges(1, 3, 6, Some(&m), false).unwrap()), vec![vec![0, 4], vec![1, 5], vec![2, 6]]);
    let d = MaskSpec::build(&key(MaskKind::Decode, &[2, 4], &[1, 1], 1, None));
    assert_eq!(flat(&visible_ranges(2, 1, 4, Some(&d), true).unwrap()), vec![vec![0, 2], vec![0, 4]], "mask wins");
    // Padded queries of a prepared prefill see column 0 only.
    let p = MaskSpec::build(&key(MaskKind::Window, &[2, 5], &[1, 3], 3, Some(8)));
    let want = vec![vec![0, 2], vec![0, 1], vec![0, 1], vec![0, 3], vec![0, 4], vec![0, 5]];
    assert_eq!(flat(&visible_ranges(2, 3, 5, Some(&p), false).unwrap()), want);
    // Every kvsim mask matches the intervals column by column.
    for spec in [&m, &d, &p] {
        let r = visible_ranges(spec.rows, spec.queries, spec.cols, Some(spec), false).unwrap();
        for b in 0..spec.rows {
            for i in 0..spec.queries {
                let seen: Vec<usize> = (0..spec.cols).filter(|&c| r.sees(b * spec.queries + i, c)).collect();
                assert_eq!(spec.visible_columns(b, i), seen);
            }
        }
    }
}

/// A mask with holes (a prefix-shared pair's second response skipping the first) gives several intervals; one mask
/// for every row (rows 1) is broadcast; a mask of another shape is a typed error.
#[test]
fn masks_with_holes_broadcast_masks_and_misshapen_masks() {
    let holes = MaskSpec { rows: 1, queries: 1, cols: 5, visible: vec![true, false, true, true, false] };
    assert_eq!(flat(&visible_ranges(1, 1, 5, Some(&holes), false).unwrap()), vec![vec![0, 1, 2, 4]]);
    assert_eq!(flat(&visible_ranges(3, 1, 5, Some(&holes), false).unwrap()), vec![vec![0, 1, 2, 4]; 3]);
    assert!(matches!(visible_ranges(2, 2, 5, Some(&holes), false), Err(crate::CacheError::ShapeMismatch { .. })));
    let none = MaskSpec { rows: 1, queries: 1, cols: 2, visible: vec![false, false] };
    assert_eq!(flat(&visible_ranges(1, 1, 2, Some(&none), false).unwrap()), vec![Vec::<i32>::new()]);
}

/// The emulated read with holes equals the read of the same query over only its visible columns, moved together
/// (the skipped columns add nothing), and a query that sees nothing reads 0.
#[test]
fn emulated_read_with_holes_skips_the_holes() {
    let (hq, hkv, d) = (2usize, 1usize, 8usize);
    let n = 300;
    let (q, k, v) = (vals(7, hq * d), vals(8, hkv * n * d), vals(9, hkv * n * d));
    let mut visible = vec![false; n];
    for c in (0..40).chain(270..300) {
        visible[c] = true;
    }
    let mask = MaskSpec { rows: 1, queries: 1, cols: n, visible };
    let dims = ReadDims { rows: 1, heads_q: hq, heads_kv: hkv, queries: 1, cols: n, head_dim: d, kv_bytes: 4 };
    let out = emulate(&q, &k, &v, dims, &visible_ranges(1, 1, n, Some(&mask), false).unwrap(), 0.5);
    let nan_holes: Vec<f32> =
        k.iter().enumerate().map(|(x, &val)| if mask.visible[x / d] { val } else { f32::NAN }).collect();
    let again = emulate(&q, &nan_holes, &v, dims, &visible_ranges(1, 1, n, Some(&mask), false).unwrap(), 0.5);
    let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&out), bits(&again), "a key the query does not see never enters the arithmetic");
    assert!(out.iter().all(|x| x.is_finite()));
    let blind = MaskSpec { rows: 1, queries: 1, cols: n, visible: vec![false; n] };
    let zero = emulate(&q, &k, &v, dims, &visible_ranges(1, 1, n, Some(&blind), false).unwrap(), 0.5);
    assert!(zero.iter().all(|&x| x == 0.0));
}

/// Row `r` of a batch (random neighbours of other lengths, masked by `c < len`) gives the bits it gives alone,
/// across chunk boundaries and for windowed reads, in the emulated kernel order.
#[test]
fn emulated_read_is_batch_invariant() {
    let (hq, hkv, d) = (4usize, 2usize, 16usize);
    let scale = 0.25f32;
    for (case, &(len, window, l)) in
        [(37usize, None, 1usize), (300, None, 1), (600, Some(200), 3), (257, Some(64), 5)].iter().enumerate()
    {
        let alone_dims =
            ReadDims { rows: 1, heads_q: hq, heads_kv: hkv, queries: l, cols: len, head_dim: d, kv_bytes: 2 };
        let q = vals(10 + case as u64, hq * l * d);
        let k = vals(20 + case as u64, hkv * len * d);
        let v = vals(30 + case as u64, hkv * len * d);
        let kind = if l == 1 { MaskKind::Decode } else { MaskKind::Window };
        let solo = MaskSpec::build(&key(kind, &[len], &[l], l, window));
        let solo_ranges = visible_ranges(1, l, len, Some(&solo), false).unwrap();
        let alone = emulate(&q, &k, &v, alone_dims, &solo_ranges, scale);
        for (b, at) in [(2usize, 1usize), (5, 0), (8, 7)] {
            let lens: Vec<usize> = (0..b).map(|r| if r == at { len } else { 1 + (r * 97 + case * 13) % 700 }).collect();
            let n = *lens.iter().max().unwrap();
            let dims = ReadDims { rows: b, heads_q: hq, heads_kv: hkv, queries: l, cols: n, head_dim: d, kv_bytes: 2 };
            let mut bq = vals(40 + b as u64, b * hq * l * d);
            let mut bk = vals(50 + b as u64, b * hkv * n * d);
            let mut bv = vals(60 + b as u64, b * hkv * n * d);
            bq[at * hq * l * d..(at + 1) * hq * l * d].copy_from_slice(&q);
            for h in 0..hkv {
                let (src, dst) = (h * len * d, (at * hkv + h) * n * d);
                bk[dst..dst + len * d].copy_from_slice(&k[src..src + len * d]);
                bv[dst..dst + len * d].copy_from_slice(&v[src..src + len * d]);
            }
            let spec = MaskSpec::build(&key(kind, &lens, &vec![l; b], l, window));
            let ranges = visible_ranges(b, l, n, Some(&spec), false).unwrap();
            let out = emulate(&bq, &bk, &bv, dims, &ranges, scale);
            let row = &out[at * hq * l * d..(at + 1) * hq * l * d];
            let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
            assert_eq!(bits(row), bits(&alone), "case {case}: row {at} of {b} differs from its solo read");
        }
    }
}

/// The emulated order is an accurate softmax attention: within a few f32 ULPs of f64 (relative to output scale).
#[test]
fn emulated_read_matches_f64_attention() {
    let (hq, hkv, d, n, l) = (4usize, 1usize, 32usize, 700usize, 2usize);
    let (q, k, v) = (vals(1, hq * l * d), vals(2, hkv * n * d), vals(3, hkv * n * d));
    let ranges = visible_ranges(1, l, n, None, true).unwrap();
    let dims = ReadDims { rows: 1, heads_q: hq, heads_kv: hkv, queries: l, cols: n, head_dim: d, kv_bytes: 4 };
    let out = emulate(&q, &k, &v, dims, &ranges, 0.5);
    let mut worst = 0f64;
    for h in 0..hq {
        for i in 0..l {
            let hi = ranges.intervals(i).map(|(_, hi)| hi).max().unwrap_or(0);
            let s: Vec<f64> = (0..hi)
                .map(|c| (0..d).map(|x| q[(h * l + i) * d + x] as f64 * k[c * d + x] as f64).sum::<f64>() * 0.5)
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
            let z: f64 = w.iter().sum();
            for x in 0..d {
                let e = (0..hi).map(|c| w[c] * v[c * d + x] as f64).sum::<f64>() / z;
                let got = out[(h * l + i) * d + x] as f64;
                // ULP of f32 at the output's scale (magnitudes below 2^-6 in the ULP of 2^-6).
                let ulp = (e.abs().max(1.0 / 64.0)).log2().floor().exp2() * f64::from(f32::EPSILON);
                worst = worst.max((got - e).abs() / ulp);
            }
        }
    }
    assert!(worst < 64.0, "emulated exact read is {worst} f32 ULPs from f64");
}

/// On the CPU the exact mode keeps MLX's SDPA (already batch-invariant there): the same bytes in both modes.
#[test]
fn exact_mode_on_cpu_reads_as_fused() {
    let _g = crate::testutil::testlock::shared();
    pin_cpu();
    assert!(!default_device_is_gpu());
    let spec = KvSpec { heads_kv: 2, head_dim: 8, dtype: KvDtype::F32 };
    let run = |mode: ReadMode| {
        set_read_mode(mode);
        assert!(!exact_kernels_active());
        let mut c = RotatingKvCache::new(spec, 6).unwrap();
        let masks = Masks::new();
        let mut outs = vec![];
        for t in 0..9u64 {
            let (k, v, q) = (
                data(t, 1, 2, 1, 8, spec.dtype),
                data(t + 50, 1, 2, 1, 8, spec.dtype),
                data(t + 99, 1, 4, 1, 8, spec.dtype),
            );
            outs.push(crate::bytes::ArrayBytes::of(&c.decode(&k, &v, &q, 0.3, &masks).unwrap().0).unwrap());
        }
        set_read_mode(ReadMode::Fused);
        outs
    };
    assert_eq!(run(ReadMode::Exact), run(ReadMode::Fused));
    assert_eq!(read_mode(), ReadMode::Fused, "the default is restored");
}

/// Malformed inputs to the GPU read are typed errors before anything reaches MLX (runs on any device).
#[test]
fn exact_attend_rejects_bad_shapes() {
    pin_cpu();
    let q = data(1, 1, 4, 1, 8, KvDtype::F32);
    let k = data(2, 1, 3, 5, 8, KvDtype::F32);
    let one = visible_ranges(1, 1, 5, None, false).unwrap();
    assert!(matches!(exact_attend(&q, &k, &k, 0.3, &one), Err(crate::CacheError::ShapeMismatch { .. })));
    let k = data(2, 1, 2, 5, 8, KvDtype::F32);
    let two = visible_ranges(2, 1, 5, None, false).unwrap();
    assert!(matches!(exact_attend(&q, &k, &k, 0.3, &two), Err(crate::CacheError::ShapeMismatch { .. })));
    let kb = data(2, 1, 2, 5, 8, KvDtype::Bf16);
    assert!(matches!(exact_attend(&q, &kb, &kb, 0.3, &one), Err(crate::CacheError::ShapeMismatch { .. })));
}

/// The `meta` cache hands back arrays holding exactly the bytes asked for, keeps at most `META_CACHE` entries, and
/// starts again when full.
#[test]
fn cached_meta_holds_exactly_the_requested_values() {
    METAS.with(|m| m.borrow_mut().clear());
    for round in 0..2 {
        for i in 0..(META_CACHE + 3) as i32 {
            let want = vec![i, i + 1, 7 * i, round];
            let a = cached_meta(want.clone());
            a.eval().unwrap();
            assert_eq!(a.as_slice::<i32>(), want.as_slice());
            assert!(METAS.with(|m| m.borrow().len()) <= META_CACHE);
        }
    }
    let again = cached_meta(vec![0, 1, 0, 1]);
    again.eval().unwrap();
    assert_eq!(again.as_slice::<i32>(), &[0, 1, 0, 1]);
}
