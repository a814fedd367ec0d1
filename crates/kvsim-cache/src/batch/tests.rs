use super::*;
#[cfg(feature = "faults")]
use crate::kind::{is_plain_kv, is_rotating, is_row_batch};
use crate::ring::GROW_STEP;
use crate::testutil::testlock;
use crate::testutil::*;
use crate::{KvCache, KvDtype, RotatingKvCache};

/// Serial caches with different histories: a short linear start, a wrapped ring, a plateau, an empty row.
fn solo_rows(spec: KvSpec, w: Option<usize>) -> Vec<SerialCache> {
    let masks = Masks::new();
    let mut rows = Vec::new();
    let scripts: &[&[(bool, usize)]] =
        &[&[(false, 2)], &[(true, 5), (false, 3)], &[(true, 3), (true, 3)], &[], &[(false, 9), (true, 2), (false, 1)]];
    for (i, script) in scripts.iter().enumerate() {
        let mut c = SerialCache::new(spec, w).unwrap();
        for (j, &(win, l)) in script.iter().enumerate() {
            let seed = 1000 + 37 * i as u64 + 5 * j as u64;
            if win {
                let (k, v, q) = kvq(&spec, seed, 1, l);
                c.window(&k, &v, &q, 0.35, &masks).unwrap();
            } else {
                for s in 0..l as u64 {
                    let (k, v, q) = kvq(&spec, seed * 31 + s, 1, 1);
                    c.decode(&k, &v, &q, 0.35, &masks).unwrap();
                }
            }
        }
        rows.push(c);
    }
    rows
}

fn joined_twin(spec: KvSpec, w: Option<usize>) -> Twin {
    let solo = solo_rows(spec, w);
    let sources: Vec<JoinSource> = solo.iter().map(JoinSource::Serial).collect();
    let batch = RowBatch::join(spec, w, &sources).unwrap();
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

/// The core guarantee: every row keeps its serial twin's state, physical bytes and order through joins,
/// decodes, windows and trims; and (measured, CPU) every decode and window output is byte-identical to the
/// twin's, masked or not.
#[test]
fn rows_match_solo_twins_byte_for_byte() {
    let _g = testlock::shared();
    for dtype in [KvDtype::F32, KvDtype::Bf16] {
        for w in [Some(1), Some(4), Some(7), None] {
            let mut t = joined_twin(spec(dtype), w);
            drive(&mut t);
            let s = &t.stats;
            eprintln!("{dtype:?} W={w:?}: {s:?}");
            assert!(s.decode_masked_rows > 0 || w == Some(1));
            assert_eq!(s.decode_same, s.decode_rows, "{dtype:?} W={w:?} decode outputs");
            assert_eq!(s.window_same, s.window_rows, "{dtype:?} W={w:?} window outputs");
        }
    }
}

/// `temporal_views` (one gather for all rows) holds, row by row, exactly the bytes of `row_temporal_view`:
/// wrapped rings, plateaus, short rows and the empty row, before and after more writes.
#[test]
fn temporal_views_equal_the_per_row_views() {
    let _g = testlock::shared();
    for dtype in [KvDtype::F32, KvDtype::Bf16] {
        for w in [Some(1), Some(4), Some(7), None] {
            let mut t = joined_twin(spec(dtype), w);
            for step in 0..2 {
                let (k, v, counts) = t.batch.temporal_views().unwrap();
                assert_eq!(counts.len(), t.batch.rows());
                for (r, &n) in counts.iter().enumerate() {
                    let (rk, rv) = t.batch.row_temporal_view(r).unwrap();
                    assert_eq!(rk.shape()[2] as usize, n, "{dtype:?} W={w:?} row {r}");
                    let cut = |a: &Array| cols(&row(a, r), 0, n).unwrap();
                    assert_same_bytes(&cut(&k), &rk, "temporal_views K");
                    assert_same_bytes(&cut(&v), &rv, "temporal_views V");
                }
                if step == 0 {
                    drive(&mut t);
                }
            }
        }
    }
    let empty = RowBatch::empty(spec(KvDtype::F32), Some(4)).unwrap();
    let (k, _, counts) = empty.temporal_views().unwrap();
    assert!(counts.is_empty());
    assert_eq!(k.shape(), &[0, 2, 0, 8]);
}

/// The same guarantee at a larger head dim and window, with many wraps, plus committed spans.
#[test]
fn rows_match_solo_twins_at_larger_shapes() {
    let _g = testlock::shared();
    for dtype in [KvDtype::F32, KvDtype::Bf16] {
        let spec = KvSpec { heads_kv: 2, head_dim: 64, dtype };
        let w = Some(32);
        let masks = Masks::new();
        let mut solo = Vec::new();
        for (i, &(win, dec)) in [(40usize, 3usize), (7, 30), (0, 0), (31, 1), (12, 50)].iter().enumerate() {
            let mut c = SerialCache::new(spec, w).unwrap();
            if win > 0 {
                let (k, v, q) = kvq(&spec, 10 * i as u64, 1, win);
                c.window(&k, &v, &q, 0.125, &masks).unwrap();
            }
            for s in 0..dec as u64 {
                let (k, v, q) = kvq(&spec, 1000 * i as u64 + s, 1, 1);
                c.decode(&k, &v, &q, 0.125, &masks).unwrap();
            }
            solo.push(c);
        }
        let sources: Vec<JoinSource> = solo.iter().map(JoinSource::Serial).collect();
        let batch = RowBatch::join(spec, w, &sources).unwrap();
        let mut t = Twin::new(batch, solo);
        t.scale = 0.125;
        for s in 0..40 {
            t.decode(20_000 + s);
        }
        t.window(30_000, 9);
        for s in 0..40 {
            t.decode(40_000 + s);
        }
        let (k, v, q) = kvq(&spec, 50_000, 5, 4);
        let span = t.batch.commit_span(&k, &v, &q, 0.125, &masks).unwrap();
        for r in 0..5 {
            let so = t.solo[r].commit_span(&row(&k, r), &row(&v, r), &row(&q, r), 0.125, &masks).unwrap();
            assert_same_bytes(&row(&span, r), &so, "commit_span row");
        }
        t.check_state("commit_span");
        let st = &t.stats;
        eprintln!("{dtype:?} D=64 W=32: {st:?}");
        assert!(st.decode_masked_rows > 0);
        assert_eq!(st.decode_same, st.decode_rows);
        assert_eq!(st.window_same, st.window_rows);
    }
}

/// R-BROT-4: merged rows come out in temporal order and then follow their from_temporal twins.
#[test]
fn merged_rows_follow_from_temporal_twins() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::Bf16);
    let w = Some(4);
    let src = solo_rows(spec, w);
    let mut slices = Vec::new();
    let mut solo = Vec::new();
    for s in &src {
        let (k, v) = s.temporal_view().unwrap();
        solo.push(SerialCache::from_temporal(spec, w, &k, &v, s.offset()).unwrap());
        slices.push((k, v, s.offset()));
    }
    let batch = RowBatch::merge(spec, w, &slices).unwrap();
    assert!(batch.row_states().iter().all(|r| r.ring.idx == r.ring.len && r.ring.len <= 4));
    let mut t = Twin::new(batch, solo);
    drive(&mut t);
    assert_eq!(t.stats.decode_same, t.stats.decode_rows);
}

/// Right-padded prefill: each row stores only its real positions; rows without any are untouched.
#[test]
fn prepared_prefill_stores_only_real_positions() {
    let _g = testlock::shared();
    for w in [Some(4), None] {
        let spec = spec(KvDtype::F32);
        let batch = RowBatch::with_rows(spec, w, 4).unwrap();
        let solo = (0..4).map(|_| SerialCache::new(spec, w).unwrap()).collect();
        let mut t = Twin::new(batch, solo);
        t.batch.prepare(&[5, 2, 0, 7]).unwrap();
        assert_eq!(t.batch.prepare(&[1, 1, 1, 1]), Err(CacheError::PendingPrefill));
        let (k, v, q) = kvq(&spec, 1, 4, 1);
        assert!(matches!(t.batch.decode(&k, &v, &q, 0.3, &Masks::new()), Err(CacheError::PendingPrefill)));
        for s in 0..3 {
            t.window(70 + s, 3);
        }
        assert_eq!(t.batch.row_states().iter().map(|r| r.pending).collect::<Vec<_>>(), vec![Some(0); 4]);
        t.batch.finalize().unwrap();
        assert_eq!(t.batch.finalize(), Err(CacheError::NoPendingPrefill));
        for s in 0..5 {
            t.decode(80 + s);
        }
        assert_eq!(t.stats.window_same, t.stats.window_rows);
        assert_eq!(t.stats.decode_same, t.stats.decode_rows);
    }
}

/// Padded query positions read column 0 only: finite outputs.
#[test]
fn padded_queries_are_finite() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::F32);
    let mut b = RowBatch::with_rows(spec, Some(4), 2).unwrap();
    b.prepare(&[1, 0]).unwrap();
    let (k, v, q) = kvq(&spec, 3, 2, 3);
    let (out, used) = b.window(&k, &v, &q, 0.3, &Masks::new()).unwrap();
    assert!(matches!(used, MaskUse::Array(_)));
    let o = out.as_dtype(mlx_rs::Dtype::Float32).unwrap().contiguous().unwrap();
    o.eval().unwrap();
    assert!(o.as_slice::<f32>().iter().all(|x| x.is_finite()));
    assert_eq!(b.row_states()[1].ring, RingState::default());
}

/// R-BROT-5: extract de-rolls a row into a serial cache equal to its relinearized twin, which then decodes
/// byte-identically.
#[test]
fn extract_is_the_relinearized_twin() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::Bf16);
    let mut t = joined_twin(spec, Some(4));
    drive(&mut t);
    let masks = Masks::new();
    for r in 0..t.batch.rows() {
        let mut e = t.batch.extract(r).unwrap();
        let mut twin = t.solo[r].clone();
        twin.relinearize().unwrap();
        assert_eq!(e.state(), twin.state(), "row {r}");
        assert_same_bytes(&e.physical().unwrap().0, &twin.physical().unwrap().0, "extracted bytes");
        for s in 0..3 {
            let (k, v, q) = kvq(&spec, 900 + s, 1, 1);
            let a = e.decode(&k, &v, &q, 0.3, &masks).unwrap().0;
            let b = twin.decode(&k, &v, &q, 0.3, &masks).unwrap().0;
            assert_same_bytes(&a, &b, "decode after extract");
        }
    }
    assert_eq!(t.batch.extract(9).unwrap_err(), CacheError::NoSuchRow { row: 9, rows: 5 });
}

/// R-BROT-7: join keeps every row's columns and phase, from batches and serial caches, in order.
#[test]
fn join_keeps_rows_and_phase() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::F32);
    let mut a = joined_twin(spec, Some(4));
    drive(&mut a);
    let s = a.solo[4].clone();
    let b = RowBatch::join(
        spec,
        Some(4),
        &[JoinSource::Rows(&a.batch, vec![2, 0]), JoinSource::Serial(&s), JoinSource::Rows(&a.batch, vec![1])],
    )
    .unwrap();
    let solo = vec![a.solo[2].clone(), a.solo[0].clone(), s, a.solo[1].clone()];
    let mut t = Twin::new(b, solo);
    assert_eq!(t.batch.row_states()[0], a.batch.row_states()[2], "base and pending kept too");
    for i in 0..4 {
        t.decode(300 + i);
    }
    // Errors: window, spec, rows.
    let other = RotatingKvCache::new(spec, 5).unwrap();
    assert_eq!(
        RowBatch::join(spec, Some(4), &[JoinSource::Serial(&other)]).unwrap_err(),
        CacheError::WindowMismatch { expected: Some(4), found: Some(5) }
    );
    let lin = KvCache::new(spec).unwrap();
    assert_eq!(
        RowBatch::join(spec, Some(4), &[JoinSource::Serial(&lin)]).unwrap_err(),
        CacheError::WindowMismatch { expected: Some(4), found: None }
    );
    let bf = RotatingKvCache::new(KvSpec { dtype: KvDtype::Bf16, ..spec }, 4).unwrap();
    assert!(matches!(RowBatch::join(spec, Some(4), &[JoinSource::Serial(&bf)]), Err(CacheError::ShapeMismatch { .. })));
    assert_eq!(
        RowBatch::join(spec, Some(4), &[JoinSource::Rows(&a.batch, vec![1, 1])]).unwrap_err(),
        CacheError::DuplicateRow { row: 1 }
    );
    assert_eq!(
        RowBatch::join(spec, Some(4), &[JoinSource::Rows(&a.batch, vec![7])]).unwrap_err(),
        CacheError::NoSuchRow { row: 7, rows: 5 }
    );
}

#[cfg(feature = "faults")]
/// R-BROT-10: the batched ring is recognised as rotating-plain + row batch; a batch that forgets the marker
/// is routed as one serial row and join drops its other rows (the mutant).
#[test]
fn batch_kind_is_rotating_plus_row_batch_and_forgetting_it_drops_rows() {
    use crate::faults::Mutant;
    let spec = spec(KvDtype::F32);
    let build = || {
        let solo = solo_rows(spec, Some(4));
        let sources: Vec<JoinSource> = solo.iter().map(JoinSource::Serial).collect();
        RowBatch::join(spec, Some(4), &sources).unwrap()
    };
    {
        let _g = testlock::shared();
        let b = build();
        let k = b.storage_kind();
        assert_eq!(k.as_str(), "rotating-plain+row-batch");
        assert!(is_row_batch(&k) && is_rotating(&k) && !is_plain_kv(&k));
        assert_eq!(k.route(), Ok(KindRoute::RowBatch { rotating: true }));
        let lk = BatchKvCache::empty(spec).unwrap().storage_kind();
        assert_eq!(lk.as_str(), "kv-plain+row-batch");
        assert!(is_row_batch(&lk) && is_plain_kv(&lk));
        let j = RowBatch::join(spec, Some(4), &[JoinSource::Rows(&b, vec![0, 1, 2, 3, 4])]).unwrap();
        assert_eq!(j.rows(), 5);
    }
    let _m = testlock::arm(Mutant::MissingKindOverride);
    let b = build();
    assert_eq!(b.storage_kind().as_str(), "rotating-plain");
    let j = RowBatch::join(spec, Some(4), &[JoinSource::Rows(&b, vec![0, 1, 2, 3, 4])]).unwrap();
    assert_eq!(j.rows(), 1, "the mutant drops rows");
}

#[test]
fn filter_keeps_rows_and_rejects_bad_lists() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::Bf16);
    let mut t = joined_twin(spec, Some(4));
    drive(&mut t);
    assert_eq!(t.batch.filter(&[0, 5]), Err(CacheError::NoSuchRow { row: 5, rows: 5 }));
    assert_eq!(t.batch.filter(&[3, 3]), Err(CacheError::DuplicateRow { row: 3 }));
    assert_eq!(t.batch.rows(), 5, "errors change nothing");
    t.batch.filter(&[4, 1, 2]).unwrap();
    t.solo = vec![t.solo[4].clone(), t.solo[1].clone(), t.solo[2].clone()];
    t.check_state("filter");
    for s in 0..3 {
        t.decode(700 + s);
    }
    t.batch.filter(&[]).unwrap();
    t.solo.clear();
    t.check_state("filter to empty");
    let (k, v, q) = kvq(&spec, 1, 0, 1);
    let (out, _) = t.batch.decode(&k, &v, &q, 0.3, &Masks::new()).unwrap();
    assert_eq!(out.shape(), &[0, HQ as i32, 1, 8]);
}

#[test]
fn batch_errors_are_typed() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::F32);
    let masks = Masks::new();
    let mut t = joined_twin(spec, Some(4));
    drive(&mut t);
    let b = &mut t.batch;
    assert_eq!(b.prepare(&[1, 2]), Err(CacheError::BadLengths { what: "2 lengths for 5 rows".into() }));
    assert!(matches!(b.trim_rows(&[1], false), Err(CacheError::BadLengths { .. })));
    assert!(!b.is_trimmable());
    assert!(matches!(b.trim(1, false), Err(CacheError::NotTrimmable { .. })));
    assert_eq!(b.trim(1, true), Err(CacheError::BypassNotAfterWindow));
    let (k, v, q) = kvq(&spec, 1, 4, 1);
    assert!(matches!(b.decode(&k, &v, &q, 0.3, &masks), Err(CacheError::ShapeMismatch { .. })), "wrong row count");
    let (k, v, q) = kvq(&spec, 1, 5, 2);
    assert!(matches!(b.decode(&k, &v, &q, 0.3, &masks), Err(CacheError::ShapeMismatch { .. })), "two positions");
    t.window(77, 3);
    assert_eq!(t.batch.trim_rows(&[0, 1, 4, 0, 0], true), Err(CacheError::TrimTooLong { requested: 4, available: 3 }));
    t.check_state("failed trims change nothing");
    assert_eq!(t.batch.row_states()[0].ring.last_concat, Some(3));
    assert!(matches!(RowBatch::with_rows(spec, Some(0), 1), Err(CacheError::InvalidState { .. })));
    let (k, v, _) = kvq(&spec, 2, 1, 5);
    assert!(matches!(
        RowBatch::merge(spec, Some(4), &[(k.clone(), v.clone(), 9)]),
        Err(CacheError::ShapeMismatch { .. })
    ));
    assert!(matches!(RowBatch::merge(spec, None, &[(k, v, 3)]), Err(CacheError::InvalidState { .. })));
}

#[test]
fn adopt_takes_buffers_without_moving_columns() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::F32);
    let mut t = joined_twin(spec, Some(4));
    drive(&mut t);
    let (k, v) = t.batch.buffers().unwrap();
    let states = t.batch.row_states().to_vec();
    let adopted = RowBatch::adopt(spec, Some(4), k.clone(), v.clone(), states.clone()).unwrap();
    let mut t2 = Twin::new(adopted, t.solo.clone());
    t2.decode(1);
    let mut bad = states.clone();
    bad[0].ring.len = bad[0].ring.offset + 1;
    assert!(matches!(RowBatch::adopt(spec, Some(4), k.clone(), v.clone(), bad), Err(CacheError::InvalidState { .. })));
    let mut bad = states.clone();
    bad[1].ring.idx = 1;
    bad[1].ring.len = 3;
    assert!(matches!(RowBatch::adopt(spec, Some(4), k.clone(), v.clone(), bad), Err(CacheError::InvalidState { .. })));
    assert!(matches!(
        RowBatch::adopt(spec, Some(4), k, v, states[..2].to_vec()),
        Err(CacheError::ShapeMismatch { .. })
    ));
}

#[cfg(feature = "faults")]
/// R-BROT-3: rope_offsets is a value; the OffsetAliasing mutant makes it follow later writes.
#[test]
fn rope_offsets_are_snapshots() {
    use crate::faults::Mutant;
    let spec = spec(KvDtype::F32);
    let run = || {
        let mut t = joined_twin(spec, Some(4));
        let before = t.batch.rope_offsets();
        let values = before.values();
        t.decode(1);
        (values, before.values(), t.batch.rope_offsets().values())
    };
    {
        let _g = testlock::shared();
        let (v0, v1, now) = run();
        assert_eq!(v0, v1);
        assert_eq!(now, v0.iter().map(|x| x + 1).collect::<Vec<_>>());
        let t = joined_twin(spec, Some(4));
        let arr = t.batch.rope_offsets().to_array();
        assert_eq!(arr.dtype(), mlx_rs::Dtype::Int32);
        assert_eq!(arr.as_slice::<i32>(), &t.batch.rope_offsets().values()[..]);
        assert_eq!(t.batch.offset(), *t.batch.rope_offsets().values().iter().max().unwrap() as usize);
    }
    let _m = testlock::arm(Mutant::OffsetAliasing);
    let (v0, v1, _) = run();
    assert_ne!(v0, v1, "the alias moved");
}

/// mlx-lm's left padding goes negative as rows wrap.
#[test]
fn left_padding_goes_negative_after_wraps() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::F32);
    let (k4, v4, _) = kvq(&spec, 1, 1, 4);
    let (k2, v2, _) = kvq(&spec, 2, 1, 2);
    let mut b = RowBatch::merge(spec, Some(4), &[(k4, v4, 4), (k2, v2, 2)]).unwrap();
    assert_eq!(b.left_padding(), vec![0, 2]);
    let masks = Masks::new();
    for s in 0..3 {
        let (k, v, q) = kvq(&spec, 10 + s, 2, 1);
        b.decode(&k, &v, &q, 0.3, &masks).unwrap();
    }
    assert_eq!(b.left_padding(), vec![-3, -1]);
}

/// R-C-3: all layers of one forward share one build per geometry.
#[test]
fn layers_share_masks() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::F32);
    let mut layers: Vec<RowBatch> = (0..4).map(|_| joined_twin(spec, Some(4)).batch).collect();
    let masks = Masks::new();
    let (k, v, q) = kvq(&spec, 3, 5, 1);
    for l in &mut layers {
        let (_, used) = l.decode(&k, &v, &q, 0.3, &masks).unwrap();
        assert!(matches!(used, MaskUse::Array(_)));
    }
    assert_eq!(masks.builds(), 1);
    let (k, v, q) = kvq(&spec, 4, 5, 3);
    for l in &mut layers {
        l.window(&k, &v, &q, 0.3, &masks).unwrap();
    }
    assert_eq!(masks.builds(), 2);
}

#[test]
fn bytes_per_token_is_per_row_and_capped_at_the_window() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::Bf16);
    let b = BatchRotatingKvCache::empty(spec, 16).unwrap();
    assert_eq!(b.bytes_per_token(), 2 * 2 * 8 * 2);
    assert_eq!(b.bytes_for_tokens(5), 5 * 64);
    assert_eq!(b.bytes_for_tokens(100), 16 * 64);
    assert_eq!(BatchKvCache::empty(spec).unwrap().bytes_for_tokens(100), 100 * 64);
}

/// A ring's solo history: a window of `prompt` positions (none for 0), then `decodes` decodes.
fn ring_after(spec: KvSpec, w: usize, seed: u64, prompt: usize, decodes: usize) -> SerialCache {
    let masks = Masks::new();
    let mut c = RotatingKvCache::new(spec, w).unwrap();
    if prompt > 0 {
        let (k, v, q) = kvq(&spec, seed, 1, prompt);
        c.window(&k, &v, &q, 0.35, &masks).unwrap();
    }
    for s in 0..decodes as u64 {
        let (k, v, q) = kvq(&spec, seed * 1000 + s, 1, 1);
        c.decode(&k, &v, &q, 0.35, &masks).unwrap();
    }
    c
}

/// Capacity is a guarantee: a ring of `W = 70` that took a 128-position prompt (a 128-column plateau) and joined a
/// batch holds 70 columns from its first decode on, as its solo ring does, alone and beside rows of other lengths
/// (empty, short, wrapped, another plateau); the arrays hold `rows x 70 x bytes_per_token` bytes, each row's share
/// the bytes of its solo ring; every row's bytes and every decode read stay byte-identical to its solo ring's
/// through 150 decodes (two wraps).
#[test]
fn a_joined_oversize_ring_holds_its_window_from_the_first_decode() {
    let _g = testlock::shared();
    let w = 70;
    for dtype in [KvDtype::F32, KvDtype::Bf16] {
        let spec = spec(dtype);
        let per = spec.heads_kv * spec.head_dim * 2 * dtype.itemsize();
        let one: &[(usize, usize)] = &[(128, 0)];
        let several: &[(usize, usize)] = &[(128, 0), (5, 0), (40, 45), (0, 0), (90, 3)];
        for prompts in [one, several] {
            let solo: Vec<SerialCache> =
                prompts.iter().enumerate().map(|(i, &(p, d))| ring_after(spec, w, 100 + i as u64, p, d)).collect();
            assert_eq!((solo[0].state().len, solo[0].cap()), (128, 128), "the plateau of a 128-position prompt");
            let sources: Vec<JoinSource> = solo.iter().map(JoinSource::Serial).collect();
            let batch = RowBatch::join(spec, Some(w), &sources).unwrap();
            assert_eq!(batch.cap(), 128, "joined: the plateau is live");
            assert_eq!(batch.capacity_bound(), 128);
            let mut t = Twin::new(batch, solo);
            for s in 0..150 {
                t.decode(9000 + s);
                let b = &t.batch;
                assert_eq!(b.cap(), w, "{dtype:?} {} rows, decode {s}: the buffer holds the window", b.rows());
                assert_eq!(b.capacity_bound(), w);
                assert_eq!(b.held_bytes(), b.rows() * w * per);
                assert_eq!(b.held_bytes(), b.rows() * b.cap() * b.bytes_per_token());
                for (r, solo) in t.solo.iter().enumerate() {
                    assert_eq!(solo.cap(), w, "solo {r}");
                    assert_eq!(b.held_bytes() / b.rows(), solo.held_bytes(), "row {r}'s bytes are its solo ring's");
                }
            }
            let st = &t.stats;
            assert_eq!(st.decode_rows, 150 * prompts.len());
            assert_eq!(
                st.decode_same, st.decode_rows,
                "{dtype:?}: every decode read byte-identical to the solo ring's"
            );
            if prompts.len() > 1 {
                assert!(st.decode_masked_rows > 0, "rows of unequal length were read under the mask");
            }
        }
    }
}

/// The bound follows the live rows through every operation that can leave the buffer wider: a window's plateau is
/// live (the in-flight window), a bypass trim of it cuts to the rows left, a decode to the window, a filter to the
/// rows kept, `adopt` of a wider buffer to its rows; linear rows keep at most one growth step ahead. Rows stay
/// byte-identical to their solo twins throughout.
#[test]
fn capacity_follows_the_live_rows() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::F32);
    let w = 8;
    let solo: Vec<SerialCache> = [(3, 0), (20, 0), (6, 9)]
        .iter()
        .enumerate()
        .map(|(i, &(p, d))| ring_after(spec, w, 10 + i as u64, p, d))
        .collect();
    let sources: Vec<JoinSource> = solo.iter().map(JoinSource::Serial).collect();
    let mut t = Twin::new(RowBatch::join(spec, Some(w), &sources).unwrap(), solo);
    assert_eq!(t.batch.cap(), 20);
    t.decode(1);
    assert_eq!(t.batch.cap(), w, "the oversize drop cuts to W");
    t.window(2, 6);
    assert_eq!((t.batch.cap(), t.batch.capacity_bound()), (w - 1 + 6, w - 1 + 6), "the in-flight window is live");
    t.trim_rows(&[5, 5, 5], true);
    assert_eq!(t.batch.cap(), w, "a rollback of the window cuts to the rows left");
    t.window(3, 12);
    t.decode(4);
    assert_eq!(t.batch.cap(), w);
    // A filter keeps the kept rows' bound: a plateau row leaves with its columns.
    t.window(5, 12);
    assert_eq!(t.batch.cap(), w - 1 + 12);
    t.trim_rows(&[0, 12, 0], true);
    assert_eq!(t.batch.cap(), w - 1 + 12, "rows 0 and 2 still hold the plateau");
    t.batch.filter(&[1]).unwrap();
    t.solo = vec![t.solo[1].clone()];
    t.check_state("filter");
    assert_eq!(t.batch.cap(), w, "the kept row needs the window");
    t.decode(6);
    // `adopt` of a wider buffer keeps its rows' bound.
    let (k, v) = t.batch.buffers().unwrap();
    let pad = |a: &Array| mlx_rs::ops::concatenate(&[a, &mlx_rs::ops::zeros_like(a).unwrap()], 2).unwrap();
    let adopted = RowBatch::adopt(spec, Some(w), pad(&k), pad(&v), t.batch.row_states().to_vec()).unwrap();
    assert_eq!(adopted.cap(), w);
    t.batch = adopted;
    t.check_state("adopt");
    // Linear rows: growth in steps, a trim of more than a step cuts to one step ahead.
    let solo: Vec<SerialCache> = (0..2).map(|_| SerialCache::new(spec, None).unwrap()).collect();
    let mut t = Twin::new(RowBatch::with_rows(spec, None, 2).unwrap(), solo);
    t.window(7, 300);
    assert_eq!(t.batch.cap(), 300);
    t.decode(8);
    assert_eq!((t.batch.cap(), t.batch.capacity_bound()), (556, 301 + GROW_STEP - 1));
    t.trim_rows(&[290, 290], false);
    assert_eq!(t.batch.cap(), 11 + GROW_STEP - 1, "one growth step ahead of the longest row");
    for s in 0..3 {
        t.decode(9 + s);
    }
    assert_eq!(t.batch.held_bytes(), 2 * t.batch.cap() * t.batch.bytes_per_token());
}

#[cfg(feature = "faults")]
/// Each batch-side mutant makes the twin check (or the API contract) fail.
#[test]
fn batch_mutants_have_teeth() {
    use crate::faults::Mutant;
    let spec = spec(KvDtype::F32);
    {
        let _m = testlock::arm(Mutant::SharedWritePointer);
        let mut t = joined_twin(spec, Some(4));
        t.lenient = true;
        t.decode(1);
        assert!(t.mismatch().is_some(), "shared write pointer");
    }
    {
        let _m = testlock::arm(Mutant::MaskIgnoresPadding);
        let mut t = joined_twin(spec, Some(4));
        t.decode(1);
        assert!(t.stats.decode_same < t.stats.decode_rows, "mask ignores padding: {:?}", t.stats);
    }
    {
        let _m = testlock::arm(Mutant::MergeSlicesByOffset);
        let (k, v, _) = kvq(&spec, 1, 1, 2);
        let (k3, v3, _) = kvq(&spec, 2, 1, 3);
        let b = RowBatch::merge(spec, Some(4), &[(k, v, 9), (k3, v3, 3)]).unwrap();
        assert_eq!(b.row_states()[0].ring.len, 3, "a padding column became live");
    }
    {
        let _m = testlock::arm(Mutant::PrefillPadStored);
        let batch = RowBatch::with_rows(spec, Some(4), 2).unwrap();
        let solo = (0..2).map(|_| SerialCache::new(spec, Some(4)).unwrap()).collect();
        let mut t = Twin::new(batch, solo);
        t.lenient = true;
        t.batch.prepare(&[3, 1]).unwrap();
        t.window(1, 3);
        assert!(t.mismatch().is_some(), "padding stored");
    }
    {
        let _m = testlock::arm(Mutant::PhaseKeptAfterExtract);
        let t = joined_twin(spec, Some(4));
        let e = t.batch.extract(1).unwrap();
        assert_ne!(e.state().idx, e.state().len, "extract kept the old head of a rotated row");
    }
    {
        let _m = testlock::arm(Mutant::BatchRingKeepsOversize);
        let solo = vec![ring_after(spec, 70, 1, 128, 0)];
        let sources: Vec<JoinSource> = solo.iter().map(JoinSource::Serial).collect();
        let mut t = Twin::new(RowBatch::join(spec, Some(70), &sources).unwrap(), solo);
        t.decode(2);
        assert_eq!((t.batch.cap(), t.batch.capacity_bound()), (128, 70), "the old width past the bound");
    }
    {
        let _m = testlock::arm(Mutant::TrimNoopAfterWrap);
        let mut t = joined_twin(spec, Some(4));
        let (k, v, q) = kvq(&spec, 1, 5, 2);
        t.batch.window(&k, &v, &q, 0.3, &Masks::new()).unwrap();
        assert_eq!(t.batch.trim(1, true), Ok(0));
    }
}

#[test]
fn pictures() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::F32);
    // Padded rows after a merge (mlx-lm's left padding shown as lp).
    let (k4, v4, _) = kvq(&spec, 1, 1, 4);
    let (k2, v2, _) = kvq(&spec, 2, 1, 2);
    let (k0, v0, _) = kvq(&spec, 3, 1, 0);
    let merged = RowBatch::merge(spec, Some(4), &[(k4, v4, 7), (k2, v2, 2), (k0, v0, 0)]).unwrap();
    insta::assert_snapshot!("merged_padded_rows", merged.picture());
    // Wrapped rings with different phases, and a plateau row, after joins and decodes.
    let mut t = joined_twin(spec, Some(4));
    insta::assert_snapshot!("joined_rows", t.batch.picture());
    for s in 0..3 {
        t.decode(s);
    }
    insta::assert_snapshot!("wrapped_rings", t.batch.picture());
    // Post-window plateau: W - 1 kept + 3.
    t.window(10, 3);
    insta::assert_snapshot!("post_window_plateau", t.batch.picture());
    // A prepared prefill in progress.
    let mut p = RowBatch::with_rows(spec, None, 3).unwrap();
    p.prepare(&[4, 1, 0]).unwrap();
    let (k, v) = (data(1, 3, 2, 2, 8, KvDtype::F32), data(2, 3, 2, 2, 8, KvDtype::F32));
    p.append(&k, &v).unwrap();
    insta::assert_snapshot!("prefill_in_progress", p.picture());
}

/// R-TKV-7 on rows: known spans of unequal per-row lengths (0 included) commit each row as its solo cache's
/// committed span of its own length: outputs at the real positions, every plane, every ring state byte-identical,
/// through wraps and plateaus, linear and rotating, plain and affine. Bad lengths change nothing.
#[test]
fn known_spans_of_unequal_lengths_commit_each_row_as_alone() {
    let _g = testlock::shared();
    let q4 = Storage::Affine(QuantSpec { bits: 4, group: 32 });
    let qspec = KvSpec { head_dim: 64, ..spec(KvDtype::Bf16) };
    for (spec, storage) in [(spec(KvDtype::F32), Storage::Plain), (qspec, q4)] {
        for w in [None, Some(4)] {
            let solos: Vec<SerialCache> = solo_rows(spec, w)
                .into_iter()
                .map(|c| {
                    let mut x = SerialCache::with_storage(spec, w, storage).unwrap();
                    if let Ok(p) = c.temporal_view() {
                        if c.offset() > 0 {
                            x = SerialCache::from_temporal_planes(
                                spec,
                                w,
                                storage,
                                &storage.encode(&p.0, &p.1).unwrap(),
                                c.offset(),
                            )
                            .unwrap();
                        }
                    }
                    x
                })
                .collect();
            let sources: Vec<JoinSource<'_>> = solos.iter().map(JoinSource::Serial).collect();
            let mut rows = RowBatch::join_storage(spec, w, storage, &sources).unwrap();
            let lens = [3usize, 0, 5, 1, 5];
            let (k, v, q) = kvq(&spec, 4242, lens.len(), 5);
            let before = rows.row_states().to_vec();
            assert!(matches!(
                rows.commit_known_spans(&k, &v, &q, 0.3, &Masks::new(), &lens[..4]),
                Err(CacheError::BadLengths { .. })
            ));
            assert!(matches!(
                rows.commit_known_spans(&k, &v, &q, 0.3, &Masks::new(), &[6, 0, 0, 0, 0]),
                Err(CacheError::BadLengths { .. })
            ));
            assert_eq!(rows.row_states(), &before[..]);
            let out = rows.commit_known_spans(&k, &v, &q, 0.3, &Masks::new(), &lens).unwrap();
            for (r, mut solo) in solos.into_iter().enumerate() {
                let what = format!("{storage:?} W {w:?} row {r} span {}", lens[r]);
                if lens[r] > 0 {
                    let (kr, vr, qr) = (
                        cols(&row(&k, r), 0, lens[r]).unwrap(),
                        cols(&row(&v, r), 0, lens[r]).unwrap(),
                        cols(&row(&q, r), 0, lens[r]).unwrap(),
                    );
                    let want = solo.commit_span(&kr, &vr, &qr, 0.3, &Masks::new()).unwrap();
                    assert_same_bytes(&cols(&row(&out, r), 0, lens[r]).unwrap(), &want, &format!("{what}: output"));
                }
                assert_eq!(&rows.row_states()[r].ring, solo.state(), "{what}: state");
                for (i, (a, b)) in
                    rows.row_physical_planes(r).unwrap().iter().zip(&solo.physical_planes().unwrap()).enumerate()
                {
                    assert_same_bytes(a, b, &format!("{what}: plane {i}"));
                }
            }
        }
    }
}

/// R-ROT-9b on rows: every row (wrapped, plateau, short, empty, linear; different history lengths, so a per-row
/// mask) stores and attends exactly as its solo cache's `encoder_read`: state and every stored byte equal, outputs
/// bit for bit (through `crate::bytes`); one mask build for the forward's layers; then the rows keep following their
/// twins. Refusals (pending prefill, window 0, shapes) are typed and change nothing.
#[test]
fn encoder_read_rows_equal_their_solo_encoder_reads() {
    let _g = testlock::shared();
    for dtype in [KvDtype::F32, KvDtype::Bf16] {
        for w in [Some(1), Some(4), Some(7), None] {
            for enc in [Some(2), Some(9), None] {
                let mut t = joined_twin(spec(dtype), w);
                drive(&mut t);
                let b = t.solo.len();
                let l = 9; // past every W here
                let forward = Masks::new();
                let mut seen = None;
                for layer in 0..2u64 {
                    let mut batch = t.batch.clone();
                    let mut solo = t.solo.clone();
                    let (k, v, q) = kvq(&t.spec, 7000 + layer, b, l);
                    let (out, used) = batch.encoder_read(&k, &v, &q, 0.35, enc, &forward).unwrap();
                    let MaskUse::Array(m) = &used else { panic!("an encoder read attends under its mask") };
                    assert_eq!(m.rows, b);
                    for r in 0..b {
                        let (so, _) = solo[r]
                            .encoder_read(&row(&k, r), &row(&v, r), &row(&q, r), 0.35, enc, &Masks::new())
                            .unwrap();
                        let sl = |a: &Array| cols(&row(a, r), 0, l).unwrap();
                        assert!(
                            crate::bytes::bit_equal(&sl(&out), &so).unwrap(),
                            "{dtype:?} W={w:?} enc={enc:?} row {r}: output"
                        );
                        assert!(solo[r].state().len >= l, "every block position is kept");
                    }
                    let twin = Twin::new(batch, solo);
                    if layer == 1 {
                        seen = Some(twin);
                    }
                }
                assert_eq!(forward.builds(), 1, "{dtype:?} W={w:?}: one build for the forward's layers");
                assert_eq!(forward.families().len(), 1);
                // The rows keep following their twins through decodes and windows.
                let mut t = seen.unwrap();
                for s in 0..4 {
                    t.decode(8000 + s);
                }
                t.window(8100, 2);
                t.decode(8200);
                assert_eq!(t.stats.decode_same, t.stats.decode_rows);
                assert_eq!(t.stats.window_same, t.stats.window_rows);
            }
        }
    }
}

/// Impossible encoder reads on rows are typed errors with the rows unchanged.
#[test]
fn encoder_read_row_errors_are_typed_and_change_nothing() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::F32);
    let mut t = joined_twin(spec, Some(4));
    drive(&mut t);
    let b = t.solo.len();
    let (k, v, q) = kvq(&spec, 9, b, 3);
    let masks = Masks::new();
    let (k1, v1, q1) = kvq(&spec, 10, b - 1, 3);
    assert!(matches!(t.batch.encoder_read(&k1, &v1, &q1, 0.3, None, &masks), Err(CacheError::ShapeMismatch { .. })));
    let (_, _, q2) = kvq(&spec, 11, b, 2);
    assert!(matches!(t.batch.encoder_read(&k, &v, &q2, 0.3, None, &masks), Err(CacheError::ShapeMismatch { .. })));
    assert!(matches!(t.batch.encoder_read(&k, &v, &q, 0.3, Some(0), &masks), Err(CacheError::InvalidState { .. })));
    let mut pending = t.batch.clone();
    pending.prepare(&vec![1; b]).unwrap();
    let before = pending.row_states().to_vec();
    assert_eq!(pending.encoder_read(&k, &v, &q, 0.3, None, &masks).unwrap_err(), CacheError::PendingPrefill);
    assert_eq!(pending.row_states(), before.as_slice());
    assert_eq!(masks.builds(), 0, "no mask was built for a refused read");
    t.check_state("refused encoder reads");
    let mut empty = RowBatch::empty(spec, Some(4)).unwrap();
    let (k0, v0, q0) = kvq(&spec, 12, 0, 3);
    let (out, used) = empty.encoder_read(&k0, &v0, &q0, 0.3, None, &masks).unwrap();
    assert_eq!((out.shape()[0], used), (0, MaskUse::None));
}
