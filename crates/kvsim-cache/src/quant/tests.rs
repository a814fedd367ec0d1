//! The quantized family's contract: rows of quantized rings keep their serial twins' six planes byte for byte
//! through wraps, windows, trims, merge, extract, filter and join; unpadded decode outputs are byte-identical to the
//! twins' on CPU (measured); conversion keeps the physical order; bad input is a typed error with the state unchanged.

use super::*;
use crate::batch::{JoinSource, RowBatch};
use crate::kind::StorageKind;
use crate::mask::Masks;
#[cfg(feature = "faults")]
use crate::ring::DecodePhase;
use crate::ring::SerialCache;
use crate::testutil::testlock;
use crate::testutil::*;
use crate::KvDtype;

fn qspec(dtype: KvDtype) -> KvSpec {
    pin_cpu();
    KvSpec { heads_kv: 2, head_dim: 64, dtype }
}

const Q: QuantSpec = QuantSpec { bits: 4, group: 32 };

/// Serial quantized caches with different histories (wrapped, plateau, empty, ...).
fn solo_rows(spec: KvSpec, w: Option<usize>, q: QuantSpec) -> Vec<SerialCache> {
    let masks = Masks::new();
    let scripts: &[&[(bool, usize)]] =
        &[&[(false, 2)], &[(true, 5), (false, 3)], &[(true, 3), (true, 3)], &[], &[(false, 9), (true, 2), (false, 1)]];
    let mut rows = Vec::new();
    for (i, script) in scripts.iter().enumerate() {
        let mut c = SerialCache::with_storage(spec, w, Storage::Affine(q)).unwrap();
        for (j, &(win, l)) in script.iter().enumerate() {
            let seed = 1000 + 37 * i as u64 + 5 * j as u64;
            if win {
                let (k, v, qq) = kvq(&spec, seed, 1, l);
                c.window(&k, &v, &qq, 0.35, &masks).unwrap();
            } else {
                for s in 0..l as u64 {
                    let (k, v, qq) = kvq(&spec, seed * 31 + s, 1, 1);
                    c.decode(&k, &v, &qq, 0.35, &masks).unwrap();
                }
            }
        }
        rows.push(c);
    }
    rows
}

fn joined_twin(spec: KvSpec, w: Option<usize>, q: QuantSpec) -> Twin {
    let solo = solo_rows(spec, w, q);
    let sources: Vec<JoinSource> = solo.iter().map(JoinSource::Serial).collect();
    let batch = RowBatch::join_storage(spec, w, Storage::Affine(q), &sources).unwrap();
    Twin::new(batch, solo)
}

fn drive(t: &mut Twin) {
    let mut seed = 5000;
    let mut next = || {
        seed += 1;
        seed
    };
    for _ in 0..6 {
        t.decode(next());
    }
    t.window(next(), 3);
    t.trim_rows(&[0, 1, 2, 3, 1], true);
    for _ in 0..2 {
        t.decode(next());
    }
    t.window(next(), 1);
    for _ in 0..5 {
        t.decode(next());
    }
    t.window(next(), 2);
    assert_eq!(t.batch.trim(1, true), Ok(1));
    for s in &mut t.solo {
        s.trim(1, true).unwrap();
    }
    t.check_state("trim");
    for _ in 0..3 {
        t.decode(next());
    }
}

/// Six planes byte-identical to the serial twins after every op; decode and window outputs measured.
#[test]
fn quantized_rows_match_solo_twins_byte_for_byte() {
    let _g = testlock::shared();
    for dtype in [KvDtype::F32, KvDtype::Bf16] {
        for (w, q) in
            [(Some(4), Q), (Some(6), QuantSpec { bits: 6, group: 64 }), (None, QuantSpec { bits: 3, group: 32 })]
        {
            let spec = qspec(dtype);
            let mut t = joined_twin(spec, w, q);
            assert_eq!(t.batch.storage_kind().as_str(), StorageKind::row_batch_of(w, Storage::Affine(q)).as_str());
            drive(&mut t);
            let s = &t.stats;
            // CPU: quantized matmuls and the precise softmax are row-independent, so every decode output (masked
            // or not) equals the twin's; window outputs too in practice (measured, not promised).
            assert_eq!(s.decode_same, s.decode_rows, "{dtype:?} {w:?} {q:?}: {s:?}");
            assert_eq!(s.window_same, s.window_rows, "{dtype:?} {w:?} {q:?}: {s:?}");
            assert!(s.decode_masked_rows > 0);
        }
    }
}

/// merge from temporal plane slices, extract, filter and join of batch rows keep every plane's bytes.
#[test]
fn merge_extract_filter_join_keep_planes() {
    let _g = testlock::shared();
    let spec = qspec(KvDtype::Bf16);
    let (w, q) = (Some(5), QuantSpec { bits: 5, group: 32 });
    let solo = solo_rows(spec, w, q);
    // merge: from each serial cache's temporal view (de-rolled: twins are from_temporal copies).
    let slices: Vec<(Vec<Array>, usize)> =
        solo.iter().map(|s| (s.temporal_view_planes().unwrap(), s.offset())).collect();
    let merged = BatchQuantizedKvCache::merge(spec, w, q, &slices).unwrap();
    let twins: Vec<SerialCache> = slices
        .iter()
        .map(|(p, o)| SerialCache::from_temporal_planes(spec, w, Storage::Affine(q), p, *o).unwrap())
        .collect();
    let mut t = Twin::new(merged, twins);
    drive(&mut t);
    // extract = the relinearized twin.
    for r in 0..t.batch.rows() {
        let e = t.batch.extract(r).unwrap();
        let mut twin = t.solo[r].clone();
        twin.relinearize().unwrap();
        assert_eq!(e.state(), twin.state());
        for (a, b) in e.physical_planes().unwrap().iter().zip(twin.physical_planes().unwrap().iter()) {
            assert_same_bytes(a, b, "extract");
        }
        assert_eq!(e.storage(), Storage::Affine(q));
    }
    // filter then join with a serial cache: rows keep their columns and phase.
    t.batch.filter(&[4, 1]).unwrap();
    t.solo = vec![t.solo[4].clone(), t.solo[1].clone()];
    t.check_state("filter");
    let extra = solo_rows(spec, w, q).remove(2);
    let joined = RowBatch::join_storage(
        spec,
        w,
        Storage::Affine(q),
        &[JoinSource::Rows(&t.batch, vec![1, 0]), JoinSource::Serial(&extra)],
    )
    .unwrap();
    let solo = vec![t.solo[1].clone(), t.solo[0].clone(), extra];
    let mut t2 = Twin::new(joined, solo);
    for s in 0..4 {
        t2.decode(9000 + s);
    }
    assert_eq!(t2.stats.decode_same, t2.stats.decode_rows);
}

#[cfg(feature = "faults")]
/// A plain ring that has wrapped, converted: the six planes equal a quantized ring fed the same blocks, in the
/// same physical order (ring phase kept); later writes continue identically.
#[test]
fn conversion_of_a_wrapped_ring_keeps_physical_order() {
    use crate::faults::Mutant;
    let mut _g = testlock::shared();
    for dtype in [KvDtype::F32, KvDtype::Bf16] {
        let spec = qspec(dtype);
        let masks = Masks::new();
        let mut plain = SerialCache::new(spec, Some(4)).unwrap();
        let mut quant = RotatingQuantizedKvCache::new(spec, 4, Q).unwrap();
        let (k, v, qq) = kvq(&spec, 1, 1, 3);
        plain.window(&k, &v, &qq, 0.3, &masks).unwrap();
        quant.window(&k, &v, &qq, 0.3, &masks).unwrap();
        for s in 0..6 {
            let (k, v, qq) = kvq(&spec, 10 + s, 1, 1);
            plain.decode(&k, &v, &qq, 0.3, &masks).unwrap();
            quant.decode(&k, &v, &qq, 0.3, &masks).unwrap();
        }
        assert!(plain.state().is_rotated());
        let before = plain.state().clone();
        plain.to_quantized(Q).unwrap();
        assert_eq!(plain.state(), &before, "offset, len, idx kept");
        assert_eq!(plain.storage_kind().as_str(), "kv:rotating-quant:4:32");
        assert_eq!(plain.decode_phase(), DecodePhase::Ring);
        for (a, b) in plain.physical_planes().unwrap().iter().zip(quant.physical_planes().unwrap().iter()) {
            assert_same_bytes(a, b, "converted = fed quantized");
        }
        assert_eq!(plain.to_quantized(Q), Ok(()), "idempotent");
        let (k, v, qq) = kvq(&spec, 99, 1, 1);
        let (a, _) = plain.decode(&k, &v, &qq, 0.3, &masks).unwrap();
        let (b, _) = quant.decode(&k, &v, &qq, 0.3, &masks).unwrap();
        assert_same_bytes(&a, &b, "decode after conversion");
        // The mutant converts in temporal order: planes no longer match.
        let mut p2 = SerialCache::new(spec, Some(4)).unwrap();
        for s in 0..6 {
            let (k, v, qq) = kvq(&spec, 10 + s, 1, 1);
            p2.decode(&k, &v, &qq, 0.3, &masks).unwrap();
        }
        drop(_g);
        let _m = testlock::arm(Mutant::QuantConvertTemporalOrder);
        p2.to_quantized(Q).unwrap();
        let mut q2 = RotatingQuantizedKvCache::new(spec, 4, Q).unwrap();
        for s in 0..6 {
            let (k, v, qq) = kvq(&spec, 10 + s, 1, 1);
            q2.decode(&k, &v, &qq, 0.3, &masks).unwrap();
        }
        assert!(!same_bytes(&p2.physical_planes().unwrap()[0], &q2.physical_planes().unwrap()[0]));
        drop(_m);
        _g = testlock::shared();
    }
}

/// Batch conversion: every row's planes equal its quantized twin's; mid-round (pending prefill) is an error.
#[test]
fn batch_conversion_and_mid_round_refusal() {
    let _g = testlock::shared();
    let spec = qspec(KvDtype::Bf16);
    let w = Some(4);
    // The twins: quantized rings fed the same blocks.
    let quant_twins = solo_rows(spec, w, Q);
    // The same histories, plain.
    let plain_rows: Vec<SerialCache> = {
        let masks = Masks::new();
        let scripts: &[&[(bool, usize)]] = &[
            &[(false, 2)],
            &[(true, 5), (false, 3)],
            &[(true, 3), (true, 3)],
            &[],
            &[(false, 9), (true, 2), (false, 1)],
        ];
        scripts
            .iter()
            .enumerate()
            .map(|(i, script)| {
                let mut c = SerialCache::new(spec, w).unwrap();
                for (j, &(win, l)) in script.iter().enumerate() {
                    let seed = 1000 + 37 * i as u64 + 5 * j as u64;
                    if win {
                        let (k, v, qq) = kvq(&spec, seed, 1, l);
                        c.window(&k, &v, &qq, 0.35, &masks).unwrap();
                    } else {
                        for s in 0..l as u64 {
                            let (k, v, qq) = kvq(&spec, seed * 31 + s, 1, 1);
                            c.decode(&k, &v, &qq, 0.35, &masks).unwrap();
                        }
                    }
                }
                c
            })
            .collect()
    };
    let sources: Vec<JoinSource> = plain_rows.iter().map(JoinSource::Serial).collect();
    let mut batch = RowBatch::join(spec, w, &sources).unwrap();
    // Mid-round: a prepared prefill pending refuses conversion, state unchanged.
    batch.prepare(&[1, 0, 2, 1, 0]).unwrap();
    let states = batch.row_states().to_vec();
    assert_eq!(batch.to_quantized(Q), Err(CacheError::PendingPrefill));
    assert_eq!(batch.row_states(), &states[..]);
    assert_eq!(batch.storage(), Storage::Plain);
    batch.finalize().unwrap();
    batch.to_quantized(Q).unwrap();
    let t = Twin::new(batch, quant_twins);
    t.check_state("converted batch");
    // A quantized batch does not convert to other parameters.
    let mut b = t.batch.clone();
    assert!(matches!(b.to_quantized(QuantSpec { bits: 8, group: 32 }), Err(CacheError::StorageMismatch { .. })));
}

/// Invalid bits, group, and head dims not divisible by the group are typed errors; so are mixed-storage joins;
/// nothing changes.
#[test]
fn bad_quantization_input_is_a_typed_error() {
    let _g = testlock::shared();
    let spec = qspec(KvDtype::F32);
    for (bits, group) in [(1, 32), (7, 32), (16, 64), (4, 16), (4, 256), (0, 0)] {
        let q = QuantSpec { bits, group };
        assert!(matches!(QuantizedKvCache::new(spec, q), Err(CacheError::InvalidQuant { .. })), "{q:?}");
        assert!(matches!(RotatingQuantizedKvCache::new(spec, 4, q), Err(CacheError::InvalidQuant { .. })));
        assert!(matches!(BatchQuantizedKvCache::with_rows(spec, None, q, 2), Err(CacheError::InvalidQuant { .. })));
        let mut plain = SerialCache::new(spec, Some(4)).unwrap();
        let (k, v, _) = kvq(&spec, 3, 1, 2);
        plain.append(&k, &v).unwrap();
        let before = plain.physical_planes().unwrap();
        assert!(matches!(plain.to_quantized(q), Err(CacheError::InvalidQuant { .. })));
        assert_eq!(plain.storage(), Storage::Plain);
        assert_same_bytes(&plain.physical_planes().unwrap()[0], &before[0], "unchanged");
    }
    // head_dim 48 is not a multiple of 32 (nor 64, 128).
    let odd = KvSpec { head_dim: 48, ..spec };
    assert!(matches!(QuantizedKvCache::new(odd, Q), Err(CacheError::InvalidQuant { .. })));
    // A plain source cannot join a quantized batch, nor quantized sources of other parameters.
    let plain = SerialCache::new(spec, Some(4)).unwrap();
    let other = RotatingQuantizedKvCache::new(spec, 4, QuantSpec { bits: 8, group: 32 }).unwrap();
    for src in [JoinSource::Serial(&plain), JoinSource::Serial(&other)] {
        let r = RowBatch::join_storage(spec, Some(4), Storage::Affine(Q), &[src]);
        assert!(matches!(r, Err(CacheError::StorageMismatch { .. })), "{r:?}");
    }
    // Planes of the wrong width (mlx-lm's 5-bit width at D = 128) are a shape error, not a silent cache.
    let d128 = KvSpec { heads_kv: 1, head_dim: 128, dtype: KvDtype::F32 };
    let q5 = QuantSpec { bits: 5, group: 32 };
    let wrong = vec![
        crate::util::zeros(&[1, 1, 2, 21], mlx_rs::Dtype::Uint32).unwrap(),
        crate::util::zeros(&[1, 1, 2, 4], mlx_rs::Dtype::Float32).unwrap(),
        crate::util::zeros(&[1, 1, 2, 4], mlx_rs::Dtype::Float32).unwrap(),
        crate::util::zeros(&[1, 1, 2, 21], mlx_rs::Dtype::Uint32).unwrap(),
        crate::util::zeros(&[1, 1, 2, 4], mlx_rs::Dtype::Float32).unwrap(),
        crate::util::zeros(&[1, 1, 2, 4], mlx_rs::Dtype::Float32).unwrap(),
    ];
    let r = SerialCache::from_temporal_planes(d128, None, Storage::Affine(q5), &wrong, 2);
    assert!(matches!(r, Err(CacheError::ShapeMismatch { .. })));
}

/// `bytes_per_token` counts packed words, scales and biases of K and V (and mlx-lm's packed width is caught).
#[test]
fn bytes_per_token_counts_all_three_planes() {
    let _g = testlock::shared();
    let spec = KvSpec { heads_kv: 2, head_dim: 128, dtype: KvDtype::Bf16 };
    for (bits, group) in [(4usize, 64usize), (5, 32), (6, 128), (3, 32), (8, 64), (2, 128)] {
        let c = QuantizedKvCache::new(spec, QuantSpec { bits, group }).unwrap();
        let per_side = 2 * (128 * bits / 32 * 4 + 2 * (128 / group) * 2);
        assert_eq!(c.bytes_per_token(), 2 * per_side, "bits {bits} group {group}");
    }
    assert_eq!(packed_width(128, 5), 20);
    assert_eq!(packed_width(128, 6), 24);
    drop(_g);
    #[cfg(feature = "faults")]
    {
        let _m = testlock::arm(crate::faults::Mutant::QuantPackedWidthDivides);
        assert_eq!(packed_width(128, 5), 21, "mlx-lm's width");
    }
}

/// The quantized read is mlx-lm's: close to an f64 attention over the dequantized planes (bf16/f32 rounding of
/// every product and sum), with the GQA grouping and the mask on the right axes.
#[test]
fn quantized_read_matches_dequantized_attention_and_mutants_show() {
    let _g = testlock::shared();
    let spec = qspec(KvDtype::F32);
    let masks = Masks::new();
    let mut c = QuantizedKvCache::new(spec, QuantSpec { bits: 8, group: 32 }).unwrap();
    let (k, v, qq) = kvq(&spec, 5, 1, 6);
    let (out, _) = c.window(&k, &v, &qq, 0.3, &masks).unwrap();
    let (dk, dv) = c.physical().unwrap();
    let dense = crate::read::attend(&qq, &dk, &dv, 0.3, None, true).unwrap();
    // Distance in ULPs at the output's scale (f32 ulp of the largest |output|): a measurement, not a claim of
    // exactness (the two reads round in different orders).
    let diff = out.subtract(&dense).unwrap().abs().unwrap().max(None).unwrap().item_cast::<f32>();
    let top = out.abs().unwrap().max(None).unwrap().item_cast::<f32>();
    let ulps = diff / (top * f32::EPSILON);
    assert!(ulps < 64.0, "quantized read vs fused SDPA over the dequantized planes: {ulps} ULPs at scale {top}");
}

#[cfg(feature = "faults")]
/// The batch-level quantized mutants are visible to the twin comparison.
#[test]
fn quantized_batch_mutants_have_teeth() {
    use crate::faults::Mutant;
    let spec = qspec(KvDtype::F32);
    let outputs_differ = |m: Mutant| {
        let _a = testlock::arm(m);
        let mut t = joined_twin(spec, Some(4), Q);
        t.batch.filter(&[0, 1]).unwrap();
        t.solo.truncate(2);
        t.lenient = true;
        t.decode(700);
        t.window(701, 2);
        t.stats.decode_same < t.stats.decode_rows || t.stats.window_same < t.stats.window_rows
    };
    assert!(outputs_differ(Mutant::QuantGqaMaskWrongAxis), "GQA mask on the wrong axis");
    assert!(outputs_differ(Mutant::QuantMaskFromArrayOffset), "mask from the array offset");
    // One row with history: the plain single-request path loses the context.
    let _a = testlock::arm(Mutant::QuantSinglePlainPath);
    let mut t = joined_twin(spec, Some(4), Q);
    t.batch.filter(&[1]).unwrap();
    t.solo = vec![t.solo[1].clone()];
    t.lenient = true;
    t.window(702, 2);
    assert!(t.stats.window_same < t.stats.window_rows, "single-row plain path");
    drop(_a);
    // And with no mutant, the same schedules are byte-identical.
    let _g = testlock::shared();
    let mut t = joined_twin(spec, Some(4), Q);
    t.batch.filter(&[0, 1]).unwrap();
    t.solo.truncate(2);
    t.decode(700);
    t.window(701, 2);
    assert_eq!(t.stats.decode_same, t.stats.decode_rows);
    assert_eq!(t.stats.window_same, t.stats.window_rows);
}

/// R-ROT-7 on a ring of either storage: a committed span is one decode per position (the in-place ring write and
/// unmasked read each position gets), through the first wrap and later rotations: outputs and every plane
/// byte-identical to single decodes, so each output keeps the single-position reduction order.
#[test]
fn commit_span_on_a_wrapping_ring_is_single_decodes_for_both_storages() {
    let _g = testlock::shared();
    let masks = Masks::new();
    for dtype in [KvDtype::F32, KvDtype::Bf16] {
        let spec = qspec(dtype);
        for storage in [Storage::Plain, Storage::Affine(Q), Storage::Affine(QuantSpec { bits: 6, group: 64 })] {
            let mut span = SerialCache::with_storage(spec, Some(5), storage).unwrap();
            let (k, v, q) = kvq(&spec, 40, 1, 3);
            span.window(&k, &v, &q, 0.35, &masks).unwrap();
            let mut steps = span.clone();
            for (i, l) in [4usize, 1, 7].into_iter().enumerate() {
                let (k, v, q) = kvq(&spec, 50 + i as u64, 1, l);
                let out = span.commit_span(&k, &v, &q, 0.35, &masks).unwrap();
                let mut outs = vec![];
                for t in 0..l {
                    let c = |x: &Array| crate::util::cols(x, t, t + 1).unwrap();
                    outs.push(steps.decode(&c(&k), &c(&v), &c(&q), 0.35, &masks).unwrap().0);
                }
                let what = format!("{dtype:?} {storage:?} span {i} of {l}");
                assert_same_bytes(&out, &mlx_rs::ops::concatenate(&outs, 2).unwrap(), &format!("{what}: outputs"));
                assert_eq!(span.state(), steps.state(), "{what}: state");
                for (p, (a, b)) in span.buffer_planes().unwrap().iter().zip(&steps.buffer_planes().unwrap()).enumerate()
                {
                    assert_same_bytes(a, b, &format!("{what}: plane {p}"));
                }
            }
            assert!(span.state().is_rotated() || span.offset() > 5, "the ring wrapped");
        }
    }
}

/// The dense views of a quantized cache that holds no position (fresh, or trimmed to nothing) are empty arrays of
/// the dense shape and dtype (MLX's dequantize cannot reshape an empty array; found by the mlx-lm oracle's
/// recorder, which reads every admitted request's view).
#[test]
fn dense_views_of_an_empty_quantized_cache_are_empty() {
    let _g = testlock::shared();
    for dtype in [KvDtype::F32, KvDtype::Bf16] {
        let spec = qspec(dtype);
        for w in [None, Some(4)] {
            let mut c = SerialCache::with_storage(spec, w, Storage::Affine(Q)).unwrap();
            let check = |c: &SerialCache| {
                let (k, v) = c.temporal_view().unwrap();
                for a in [&k, &v] {
                    assert_eq!(a.shape(), &[1, 2, 0, 64], "{dtype:?} {w:?}");
                    assert_eq!(a.dtype(), c.temporal_view_planes().unwrap()[1].dtype());
                }
            };
            check(&c);
            let (k, v, q) = kvq(&spec, 7, 1, 2);
            c.window(&k, &v, &q, 0.35, &Masks::new()).unwrap();
            c.trim(2, false).unwrap();
            check(&c);
        }
    }
}
