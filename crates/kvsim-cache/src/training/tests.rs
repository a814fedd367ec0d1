use mlx_rs::Array;

use super::*;
use crate::testutil::testlock;
use crate::testutil::*;
use crate::util::cols;
use crate::{JoinSource, KvDtype, MaskKey, MaskKind, RowBatch};

/// R-TRN-1/2: the K/V come back exactly as given, twice, and the cache is unchanged.
#[test]
fn training_cache_passes_kv_through_and_stores_nothing() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::Bf16);
    let c = TrainingCache::new(spec, Some(4)).unwrap();
    let before = c.clone();
    let masks = Masks::new();
    let (k, v, q) = kvq(&spec, 3, 2, 6);
    let (k1, _) = c.update_and_fetch(&k, &v).unwrap();
    let (k2, v2) = c.update_and_fetch(&k, &v).unwrap();
    assert_same_bytes(&k1, &k, "keys as given");
    assert_same_bytes(&v2, &v, "values as given, second call");
    assert_same_bytes(&k1, &k2, "twice");
    let (o1, u1) = c.window(&k, &v, &q, 0.3, &masks).unwrap();
    let (o2, u2) = c.window(&k, &v, &q, 0.3, &masks).unwrap();
    assert_same_bytes(&o1, &o2, "a re-run (gradient checkpointing) reads the same");
    assert_eq!(u1, u2);
    assert_eq!(c, before, "nothing stored");
    assert_eq!(c.offset(), 0);
    assert_eq!(masks.builds(), 1, "one sliding mask per forward");
    assert_eq!(masks.builds_of("training:4"), 1);
}

/// R-TRN-3: none for decode, `Causal` while N <= W, the offset-0 sliding mask past it; padded rows always masked.
#[test]
fn training_mask_choice() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::F32);
    let masks = Masks::new();
    let c = TrainingCache::new(spec, Some(4)).unwrap();
    assert_eq!(c.mask(1, &masks).unwrap().0, MaskUse::None);
    assert_eq!(c.mask(4, &masks).unwrap().0, MaskUse::Causal);
    let (used, arr) = c.mask(5, &masks).unwrap();
    let MaskUse::Array(m) = used else { panic!("sliding mask expected") };
    assert_eq!(m.visible_columns(0, 4), vec![1, 2, 3, 4]);
    assert_eq!(arr.unwrap().shape(), &[1, 1, 5, 5]);
    let full = TrainingCache::new(spec, None).unwrap();
    assert_eq!(full.mask(300, &masks).unwrap().0, MaskUse::Causal);
    let p = TrainingCache::padded(spec, None, vec![1, 3]).unwrap();
    let (used, arr) = p.mask(1, &masks).unwrap();
    assert!(matches!(used, MaskUse::Array(_)), "padded decode takes the padded mask");
    assert_eq!(arr.unwrap().shape(), &[2, 1, 1, 1]);
    assert_eq!(masks.builds(), 2);
}

/// The padded read equals, on every real query, the unpadded forward of that row alone (CPU: masked columns
/// contribute exact zeros, so the bytes agree).
#[test]
fn padded_training_read_equals_each_row_alone() {
    let _g = testlock::shared();
    for dtype in [KvDtype::F32, KvDtype::Bf16] {
        let spec = spec(dtype);
        for window in [None, Some(3)] {
            let lengths = vec![6, 2, 4, 0];
            let c = TrainingCache::padded(spec, window, lengths.clone()).unwrap();
            let masks = Masks::new();
            let (k, v, q) = kvq(&spec, 11, 4, 6);
            let (out, used) = c.window(&k, &v, &q, 0.3, &masks).unwrap();
            assert!(matches!(used, MaskUse::Array(_)));
            for (r, &n) in lengths.iter().enumerate().filter(|(_, &n)| n > 0) {
                let solo = TrainingCache::new(spec, window).unwrap();
                let sl = |a: &Array| cols(&row(a, r), 0, n).unwrap();
                let (so, _) = solo.window(&sl(&k), &sl(&v), &sl(&q), 0.3, &masks).unwrap();
                assert_same_bytes(&sl(&out), &so, &format!("{dtype:?} W {window:?} row {r}"));
            }
        }
    }
}

/// The training sliding read equals a rotating cache's window read of the same block at offset 0.
#[test]
fn training_window_equals_a_fresh_ring_window() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::Bf16);
    let masks = Masks::new();
    for (w, n) in [(4, 3), (4, 4), (4, 9), (1, 5)] {
        let c = TrainingCache::new(spec, Some(w)).unwrap();
        let (k, v, q) = kvq(&spec, 20 + n as u64, 1, n);
        let (out, _) = c.window(&k, &v, &q, 0.3, &masks).unwrap();
        let mut ring = crate::RotatingKvCache::new(spec, w).unwrap();
        let (ro, _) = ring.window(&k, &v, &q, 0.3, &masks).unwrap();
        assert_same_bytes(&out, &ro, &format!("W {w} N {n}"));
    }
}

#[test]
fn training_errors_are_typed_and_change_nothing() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::F32);
    let masks = Masks::new();
    assert!(matches!(TrainingCache::new(spec, Some(0)), Err(CacheError::InvalidState { .. })));
    assert!(matches!(TrainingCache::padded(spec, None, vec![]), Err(CacheError::BadLengths { .. })));
    let c = TrainingCache::padded(spec, Some(4), vec![3, 7]).unwrap();
    let before = c.clone();
    let (k, v, q) = kvq(&spec, 1, 2, 5);
    assert!(matches!(c.window(&k, &v, &q, 0.3, &masks), Err(CacheError::BadLengths { .. })), "7 > N = 5");
    let (k3, v3, q3) = kvq(&spec, 1, 3, 8);
    assert!(matches!(c.window(&k3, &v3, &q3, 0.3, &masks), Err(CacheError::BadLengths { .. })), "3 rows");
    let u = TrainingCache::new(spec, None).unwrap();
    assert!(matches!(u.decode(&k, &v, &q, 0.3, &masks), Err(CacheError::ShapeMismatch { .. })));
    assert_eq!(c, before);
    assert_eq!(masks.builds(), 0, "nothing built on refusal");
    // Never admitted or merged: the kind routes nowhere, and a join refuses it.
    assert_eq!(c.storage_kind().route(), Err(CacheError::TrainingOnly { kind: TRAINING.into() }));
    let joined = RowBatch::join(spec, Some(4), &[JoinSource::Training(&c)]);
    assert!(matches!(joined, Err(CacheError::TrainingOnly { .. })));
}

#[test]
fn prefix_shared_rejected_rows_read_as_prompt_plus_rejected() {
    let _g = testlock::shared();
    for dtype in [KvDtype::F32, KvDtype::Bf16] {
        let spec = spec(dtype);
        let masks = Masks::new();
        let (p, rc, rr) = (3, 2, 3);
        let c = PrefixSharedCache::new(spec, None, p, rc, rr).unwrap();
        assert_eq!(c.rope_positions(), vec![0, 1, 2, 3, 4, 3, 4, 5]);
        let (k, v, q) = kvq(&spec, 5, 2, 8);
        let (out, _) = c.window(&k, &v, &q, 0.3, &masks).unwrap();
        // Chosen half: the causal forward of prompt ++ chosen.
        let plain = TrainingCache::new(spec, None).unwrap();
        let head = |a: &Array| cols(a, 0, p + rc).unwrap();
        let (co, _) = plain.window(&head(&k), &head(&v), &head(&q), 0.3, &masks).unwrap();
        assert_same_bytes(&head(&out), &co, "prompt ++ chosen");
        // Rejected half: the causal forward of prompt ++ rejected.
        let skip = |a: &Array| {
            mlx_rs::ops::concatenate(&[&cols(a, 0, p).unwrap(), &cols(a, p + rc, p + rc + rr).unwrap()], 2).unwrap()
        };
        let (ro, _) = plain.window(&skip(&k), &skip(&v), &skip(&q), 0.3, &masks).unwrap();
        assert_same_bytes(&cols(&out, p + rc, p + rc + rr).unwrap(), &cols(&ro, p, p + rr).unwrap(), "rejected");
        assert_eq!(masks.builds_of("prefix-shared:inf"), 1);
    }
}

#[test]
fn prefix_shared_size_mismatch_is_typed() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::F32);
    let masks = Masks::new();
    let c = PrefixSharedCache::new(spec, Some(4), 2, 2, 2).unwrap();
    let (k, v, q) = kvq(&spec, 1, 1, 5);
    assert_eq!(c.window(&k, &v, &q, 0.3, &masks).err(), Some(CacheError::PrefixSharedSize { n: 5, expected: 6 }));
    assert_eq!(c.update_and_fetch(&k, &v).err(), Some(CacheError::PrefixSharedSize { n: 5, expected: 6 }));
    assert_eq!(masks.builds(), 0);
    assert!(PrefixSharedCache::new(spec, None, 0, 0, 0).is_err());
    assert_eq!(c.storage_kind().route(), Err(CacheError::TrainingOnly { kind: PREFIX_SHARED.into() }));
    // The geometry memo and the family memo live side by side.
    let key = MaskKey { kind: MaskKind::Decode, lens: vec![3], real: vec![1], queries: 1, window: None, cols: 3 };
    masks.get(&key).unwrap();
    c.mask(6, &masks).unwrap();
    c.mask(6, &masks).unwrap();
    assert_eq!(masks.families(), vec![("decode:inf".to_string(), 1), ("prefix-shared:4".to_string(), 1)]);
}

/// The training DeltaNet cache: zero state every call (two calls, same bytes), each right-padded row's real outputs
/// equal the row run alone from the zero state, bad lengths are typed errors, the kind routes nowhere.
#[test]
fn training_ssm_cache_starts_from_zero_every_call_and_rows_equal_their_solo_runs() {
    use crate::{GdnParams, SsmSpec};
    use mlx_rs::ops::indexing::TryIndexOp;
    let _g = testlock::shared();
    let sp = SsmSpec { kernel: 3, heads_k: 1, heads_v: 2, dk: 4, dv: 2, dtype: KvDtype::F32 };
    let c = sp.conv_dim();
    let vals = |n: usize, seed: u32| -> Vec<f32> {
        (0..n).map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 20) as f32 / 4096.0) - 0.5).collect()
    };
    let params = GdnParams {
        conv_weight: Array::from_slice(&vals(c * 3, 1), &[c as i32, 3, 1]),
        a_log: Array::from_slice(&vals(2, 2), &[2]),
        dt_bias: Array::from_slice(&vals(2, 3), &[2]),
    };
    let (b, n) = (3usize, 5usize);
    let q = Array::from_slice(&vals(b * n * c, 4), &[b as i32, n as i32, c as i32]);
    let a = Array::from_slice(&vals(b * n * 2, 5), &[b as i32, n as i32, 2]);
    let g = Array::from_slice(&vals(b * n * 2, 6), &[b as i32, n as i32, 2]);
    let lengths = vec![5, 2, 0];
    let t = TrainingSsmCache::padded(sp, lengths.clone()).unwrap();
    let y1 = t.forward(&q, &a, &g, &params).unwrap();
    let y2 = t.forward(&q, &a, &g, &params).unwrap();
    assert_same_bytes(&y1, &y2, "a second call");
    for (r, &l) in lengths.iter().enumerate().filter(|(_, &l)| l > 0) {
        let (r, l) = (r as i32, l as i32);
        let pick = |x: &Array| x.try_index((r..r + 1, 0..l, ..)).unwrap();
        let solo = TrainingSsmCache::new(sp).unwrap().forward(&pick(&q), &pick(&a), &pick(&g), &params).unwrap();
        let got = y1.try_index((r..r + 1, 0..l, .., ..)).unwrap();
        assert_same_bytes(&got, &solo, &format!("row {r}"));
    }
    assert!(matches!(TrainingSsmCache::padded(sp, vec![]), Err(CacheError::BadLengths { .. })));
    let long = TrainingSsmCache::padded(sp, vec![6, 1, 1]).unwrap();
    assert!(matches!(long.forward(&q, &a, &g, &params), Err(CacheError::BadLengths { .. })));
    let few = TrainingSsmCache::padded(sp, vec![1, 1]).unwrap();
    assert!(matches!(few.forward(&q, &a, &g, &params), Err(CacheError::BadLengths { .. })));
    assert_eq!(t.storage_kind().route(), Err(CacheError::TrainingOnly { kind: "train:training-ssm".into() }));
}
