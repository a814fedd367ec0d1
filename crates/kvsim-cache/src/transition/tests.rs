//! The bf16-first family's contract: rows equal their serial lego twins byte for byte (planes and reads) through
//! conversion, wrap, speculative rollback with unequal accepts, packing and extract; conversion happens exactly where
//! the reference lifecycle model says; bad input is a typed error with the state unchanged.

use super::*;
use crate::mask::Masks;
#[cfg(feature = "faults")]
use crate::testutil::testlock;
use crate::testutil::*;
use crate::KvDtype;

fn tspec() -> KvSpec {
    pin_cpu();
    KvSpec { heads_kv: 2, head_dim: 64, dtype: KvDtype::Bf16 }
}

fn tr(start: Option<usize>) -> Transition {
    Transition { start, quant: QuantSpec { bits: 4, group: 32 } }
}

fn planes_bits(p: &[Array]) -> Vec<Vec<u32>> {
    p.iter().map(bits).collect()
}

/// One lego per entry of `lens`, each after a window of that many positions (payload seed `seed + i`).
fn legos_after_windows(
    spec: KvSpec,
    w: Option<usize>,
    t: Transition,
    lens: &[usize],
    seed: u64,
) -> Vec<Bf16FirstCache> {
    let masks = Masks::new();
    lens.iter()
        .enumerate()
        .map(|(i, &n)| {
            let mut lego = Bf16FirstCache::new(spec, w, t).unwrap();
            let (k, v, q) = kvq(&spec, seed + i as u64, 1, n);
            lego.window(&k, &v, &q, 0.3, &masks).unwrap();
            lego
        })
        .collect()
}

#[test]
fn lego_reads_the_crossing_append_in_bf16_then_converts_at_its_end() {
    let spec = tspec();
    let masks = Masks::new();
    // Offsets after each step: 2, 3, 6, 7, 8, 10. Expected conversion offset and floor (docs/transitioning-rows.md).
    for (w, start, conv, floor) in [
        (None, Some(5), Some(6), 6),
        (Some(4), Some(3), Some(3), 3),
        (Some(4), Some(0), Some(2), 0),
        (Some(3), None, None, 0),
    ] {
        let mut lego = Bf16FirstCache::new(spec, w, tr(start)).unwrap();
        let mut plain = SerialCache::new(spec, w).unwrap();
        for (j, &(win, l)) in
            [(true, 2usize), (false, 1), (true, 3), (false, 1), (false, 1), (true, 2)].iter().enumerate()
        {
            let (k, v, q) = kvq(&spec, 40 + j as u64, 1, l);
            let bf16_before = lego.converted_at().is_none();
            let out = if win {
                lego.window(&k, &v, &q, 0.3, &masks).unwrap().0
            } else {
                lego.decode(&k, &v, &q, 0.3, &masks).unwrap().0
            };
            let plain_out = if win {
                plain.window(&k, &v, &q, 0.3, &masks).unwrap().0
            } else {
                plain.decode(&k, &v, &q, 0.3, &masks).unwrap().0
            };
            if bf16_before {
                assert_same_bytes(&out, &plain_out, "a bf16 read (the crossing append included) is the plain cache's");
            }
            let expect = conv.filter(|&c| c <= lego.offset());
            assert_eq!(lego.converted_at(), expect, "w {w:?} start {start:?} step {j}");
            assert_eq!(lego.minimum_reusable_offset(), if expect.is_some() { floor } else { 0 });
            let room = start.filter(|&s| expect.is_none() && lego.offset() < s).map(|s| s - lego.offset());
            assert_eq!(lego.max_append_tokens(), room);
            if lego.converted_at().is_some() {
                // Converted storage = the plain history quantized as laid out (per-position quantization).
                let mut conv = plain.clone();
                conv.to_quantized(tr(start).quant).unwrap();
                assert_eq!(
                    planes_bits(&lego.inner().physical_planes().unwrap()),
                    planes_bits(&conv.physical_planes().unwrap())
                );
                assert!(lego.storage_kind().0.contains("quant"));
            }
        }
    }
}

#[test]
fn conversion_is_irreversible_and_reuse_respects_the_floor() {
    let spec = tspec();
    let masks = Masks::new();
    let mut lego = Bf16FirstQuantizedKvCache::new(spec, tr(Some(4))).unwrap();
    let (k, v, q) = kvq(&spec, 7, 1, 6);
    lego.window(&k, &v, &q, 0.3, &masks).unwrap();
    assert_eq!((lego.converted_at(), lego.minimum_reusable_offset()), (Some(6), 6));
    assert!(matches!(lego.take(5, 30), Err(CacheError::BelowFloor { prefix: 5, floor: 6 })));
    assert_eq!(lego.offset(), 6, "a refused reuse changes nothing");
    let reused = lego.take(30, 7).unwrap();
    assert_eq!(reused.offset(), 6);
    lego.trim(4, false).unwrap();
    assert!(lego.storage_kind().0.starts_with("kv:quant:"), "a trim below start keeps quantized storage");
    assert_eq!(lego.minimum_reusable_offset(), 6);
}

/// Two rows and their legos: decodes, a window crossing `start`, a round with unequal accepts across the wrap, a
/// rollback, packing, extract. After every op each row's planes and read are byte-identical to its lego's.
#[test]
fn rows_equal_their_lego_twins_through_conversion_wrap_rollback_and_packing() {
    let spec = tspec();
    let masks = Masks::new();
    let w = Some(4);
    let t = tr(Some(6));
    // Histories before the merge: row 0 wrapped (offset 5), row 1 short (offset 2).
    let mut twins = legos_after_windows(spec, w, t, &[5, 2], 100);
    let mut rows = TransitioningKvRows::merge(spec, w, t, twins.clone()).unwrap();
    assert_eq!(rows.lifecycle().iter().map(|m| m.left_pad).collect::<Vec<_>>(), vec![0, 2]);
    // Layout event: the merged rows are temporal slices of their newest min(offset, W) positions.
    for tw in &mut twins {
        let planes = tw.inner().temporal_view_planes().unwrap();
        tw.cache = SerialCache::from_temporal_planes(spec, w, tw.inner().storage(), &planes, tw.offset()).unwrap();
    }
    let check = |rows: &TransitioningKvRows, twins: &[Bf16FirstCache], what: &str| {
        for (i, tw) in twins.iter().enumerate() {
            assert_eq!(rows.lifecycle()[i].converted_at, tw.converted_at(), "{what}: row {i} conversion");
            assert_eq!(rows.lifecycle()[i].floor, tw.minimum_reusable_offset(), "{what}: row {i} floor");
            assert_eq!(
                planes_bits(&rows.row_physical_planes(i).unwrap()),
                planes_bits(&tw.inner().physical_planes().unwrap()),
                "{what}: row {i} planes"
            );
        }
    };
    let step = |rows: &mut TransitioningKvRows, twins: &mut Vec<Bf16FirstCache>, seed: u64, l: usize, win: bool| {
        let (k, v, q) = kvq(&spec, seed, 2, l);
        let out = if win {
            rows.window(&k, &v, &q, 0.3, &masks).unwrap().0
        } else {
            rows.decode(&k, &v, &q, 0.3, &masks).unwrap().0
        };
        for (i, tw) in twins.iter_mut().enumerate() {
            let (ki, vi, qi) = (row(&k, i), row(&v, i), row(&q, i));
            let o = if win {
                tw.window(&ki, &vi, &qi, 0.3, &masks).unwrap().0
            } else {
                tw.decode(&ki, &vi, &qi, 0.3, &masks).unwrap().0
            };
            if !rows.is_packed() || !win {
                assert_same_bytes(&row(&out, i), &o, "row read vs its lego");
            }
        }
    };
    step(&mut rows, &mut twins, 1, 1, false);
    check(&rows, &twins, "decode");
    assert_eq!(rows.lifecycle()[0].converted_at, Some(6), "row 0 reached start 6");
    assert!(matches!(rows.check_plain_read(), Err(CacheError::MixedPrecision { row: 0 })));
    // A round: both rows get a verify window of 3, row 0 keeps 1, row 1 keeps 0 (row 1 crossed start 6 at 6? no: 3+3).
    rows.round_begin().unwrap();
    for tw in &mut twins {
        tw.round_begin().unwrap();
    }
    step(&mut rows, &mut twins, 2, 3, true);
    let before = (rows.offsets(), rows.lifecycle().to_vec());
    assert!(matches!(rows.round_rollback(&[1, 4]), Err(CacheError::KeepTooLong { row: 1, keep: 4, written: 3 })));
    assert_eq!((rows.offsets(), rows.lifecycle().to_vec()), before, "a refused rollback changes nothing");
    let (shifts, converted) = rows.round_rollback(&[1, 0]).unwrap();
    assert_eq!(shifts, vec![2, 3]);
    assert!(converted.is_empty(), "row 1's committed offset 3 < start: the uncommitted 6 did not convert it");
    twins[0].round_rollback(1).unwrap();
    twins[1].round_rollback(0).unwrap();
    assert_eq!(rows.lifecycle().iter().map(|m| m.left_pad).collect::<Vec<_>>(), vec![2, 5]);
    check(&rows, &twins, "rollback");
    for s in 0..4 {
        step(&mut rows, &mut twins, 10 + s, 1, false);
        check(&rows, &twins, "decode after rollback");
    }
    assert!(rows.is_packed(), "every row converted: packed");
    assert_eq!(rows.max_append_tokens(), None);
    step(&mut rows, &mut twins, 20, 1, false);
    check(&rows, &twins, "packed decode");
    let back = rows.extract(1).unwrap();
    // Extract de-rolls to temporal order (a layout event): compare the temporal views.
    assert_eq!(
        planes_bits(&back.inner().temporal_view_planes().unwrap()),
        planes_bits(&twins[1].inner().temporal_view_planes().unwrap())
    );
    assert_eq!(back.minimum_reusable_offset(), twins[1].minimum_reusable_offset(), "extract keeps the floor");
    let snapshot = (rows.offsets(), rows.lifecycle().to_vec());
    assert!(rows.filter(&[1, 1]).is_err());
    assert_eq!((rows.offsets(), rows.lifecycle().to_vec()), snapshot);
    rows.filter(&[1]).unwrap();
    assert_eq!(rows.minimum_reusable_offset(), twins[1].minimum_reusable_offset());
}

/// `commit_span` is `L` decodes, one per position: outputs and state byte-identical to the one-decode
/// path, with the conversion between the positions of the span (start crossed inside it, start 0, a ring wrap).
#[test]
fn lego_commit_span_is_one_decode_per_position_through_conversion_and_wrap() {
    let spec = tspec();
    let masks = Masks::new();
    for (w, start, pre, span, conv) in
        [(None, Some(4), 2usize, 5usize, Some(4)), (Some(3), Some(0), 0, 4, Some(1)), (Some(3), Some(5), 4, 4, Some(5))]
    {
        let mut a = Bf16FirstCache::new(spec, w, tr(start)).unwrap();
        if pre > 0 {
            let (k, v, q) = kvq(&spec, 3, 1, pre);
            a.window(&k, &v, &q, 0.3, &masks).unwrap();
        }
        let mut b = a.clone();
        let (k, v, q) = kvq(&spec, 9, 1, span);
        let out = a.commit_span(&k, &v, &q, 0.3, &masks).unwrap();
        for i in 0..span {
            let one = b
                .decode(
                    &cols(&k, i, i + 1).unwrap(),
                    &cols(&v, i, i + 1).unwrap(),
                    &cols(&q, i, i + 1).unwrap(),
                    0.3,
                    &masks,
                )
                .unwrap()
                .0;
            assert_same_bytes(&cols(&out, i, i + 1).unwrap(), &one, "span position vs its own decode");
        }
        assert_eq!(a.converted_at(), conv, "w {w:?} start {start:?}: converted between the span's positions");
        assert_eq!(
            (a.converted_at(), a.minimum_reusable_offset(), a.offset()),
            (b.converted_at(), b.minimum_reusable_offset(), b.offset())
        );
        assert_eq!(
            planes_bits(&a.inner().physical_planes().unwrap()),
            planes_bits(&b.inner().physical_planes().unwrap())
        );
        // Bad input: a span of queries of another length, typed error, nothing changed.
        let before = planes_bits(&a.inner().physical_planes().unwrap());
        let (k2, v2, _) = kvq(&spec, 10, 1, 2);
        let (_, _, q3) = kvq(&spec, 10, 1, 3);
        assert!(matches!(a.commit_span(&k2, &v2, &q3, 0.3, &masks), Err(CacheError::ShapeMismatch { .. })));
        assert_eq!(planes_bits(&a.inner().physical_planes().unwrap()), before);
    }
}

/// Rows: a span that converts one row between its positions and then packs, byte-identical to per-position decodes
/// of the same rows and to each row's lego twin.
#[test]
fn rows_commit_span_is_one_decode_per_position_and_packs_between_positions() {
    let spec = tspec();
    let masks = Masks::new();
    let (w, t) = (Some(4), tr(Some(5)));
    let mut legos = vec![Bf16FirstCache::new(spec, w, t).unwrap(), Bf16FirstCache::new(spec, w, t).unwrap()];
    for (i, n) in [4usize, 2].iter().enumerate() {
        let (k, v, q) = kvq(&spec, 50 + i as u64, 1, *n);
        legos[i].window(&k, &v, &q, 0.3, &masks).unwrap();
    }
    let mut rows = TransitioningKvRows::merge(spec, w, t, vec![legos[0].clone()]).unwrap();
    let mut one = rows.clone();
    let mut twin = legos[0].clone();
    let (k, v, q) = kvq(&spec, 60, 1, 3);
    let (out, converted) = rows.commit_span(&k, &v, &q, 0.3, &masks).unwrap();
    assert_eq!(converted, vec![0], "row 0 reached start 5 at the span's first position");
    assert!(rows.is_packed(), "packed between the span's positions");
    let tw = twin.commit_span(&k, &v, &q, 0.3, &masks).unwrap();
    assert_same_bytes(&out, &tw, "rows span vs the lego twin's span");
    for i in 0..3 {
        let o = one
            .decode(
                &cols(&k, i, i + 1).unwrap(),
                &cols(&v, i, i + 1).unwrap(),
                &cols(&q, i, i + 1).unwrap(),
                0.3,
                &masks,
            )
            .unwrap()
            .0;
        assert_same_bytes(&cols(&out, i, i + 1).unwrap(), &o, "rows span position vs its own decode");
    }
    assert_eq!(planes_bits(&rows.row_physical_planes(0).unwrap()), planes_bits(&one.row_physical_planes(0).unwrap()));
    assert_eq!(
        planes_bits(&rows.row_physical_planes(0).unwrap()),
        planes_bits(&twin.inner().physical_planes().unwrap())
    );
    // Two rows, unequal offsets: row 0 converts at the first position, row 1 never in this span.
    let mut rows = TransitioningKvRows::merge(spec, w, t, legos.clone()).unwrap();
    let mut one = rows.clone();
    let (k, v, q) = kvq(&spec, 61, 2, 2);
    let (out, converted) = rows.commit_span(&k, &v, &q, 0.3, &masks).unwrap();
    assert_eq!(converted, vec![0]);
    for i in 0..2 {
        let o = one
            .decode(
                &cols(&k, i, i + 1).unwrap(),
                &cols(&v, i, i + 1).unwrap(),
                &cols(&q, i, i + 1).unwrap(),
                0.3,
                &masks,
            )
            .unwrap()
            .0;
        assert_same_bytes(&cols(&out, i, i + 1).unwrap(), &o, "two rows: span position vs its own decode");
    }
    for r in 0..2 {
        assert_eq!(
            planes_bits(&rows.row_physical_planes(r).unwrap()),
            planes_bits(&one.row_physical_planes(r).unwrap())
        );
    }
    assert_eq!(rows.lifecycle(), one.lifecycle());
    // Bad input: one row's inputs for two rows, typed error, nothing changed.
    let snapshot = (rows.offsets(), rows.lifecycle().to_vec());
    let (k1, v1, q1) = kvq(&spec, 62, 1, 2);
    assert!(matches!(rows.commit_span(&k1, &v1, &q1, 0.3, &masks), Err(CacheError::ShapeMismatch { .. })));
    assert_eq!((rows.offsets(), rows.lifecycle().to_vec()), snapshot);
}

/// Right-padded prefill: each row stores only its real positions, byte-identical to its
/// lego fed them inside a lego round; a row converts only when its request commits (`commit_prefill`, `finalize`),
/// never at a sibling's window; the rows may pack inside the prefill and take the rest padded.
#[test]
fn rows_right_padded_prefill_converts_each_row_only_at_its_commit() {
    let spec = tspec();
    let masks = Masks::new();
    let (w, t) = (Some(4), tr(Some(2)));
    let fresh = || Bf16FirstCache::new(spec, w, t).unwrap();
    // Scenario 1: lengths [5, 2], chunks of 3; row 0 commits after the first chunk, row 1 at finalize.
    let mut rows = TransitioningKvRows::merge(spec, w, t, vec![fresh(), fresh()]).unwrap();
    let mut twins = vec![fresh(), fresh()];
    rows.prepare(&[5, 2]).unwrap();
    for tw in &mut twins {
        tw.round_begin().unwrap();
    }
    let snapshot = |r: &TransitioningKvRows| {
        ((0..r.rows()).map(|i| planes_bits(&r.row_physical_planes(i).unwrap())).collect::<Vec<_>>(), r.offsets())
    };
    let before = snapshot(&rows);
    let (k1, v1, q1) = kvq(&spec, 80, 2, 1);
    assert!(matches!(rows.decode(&k1, &v1, &q1, 0.3, &masks), Err(CacheError::PendingPrefill)));
    assert!(matches!(rows.prepare(&[1, 1]), Err(CacheError::PendingPrefill)));
    assert!(matches!(rows.filter(&[0]), Err(CacheError::Lifecycle { .. })));
    assert!(matches!(rows.end_prefill(), Err(CacheError::Lifecycle { .. })));
    assert_eq!(snapshot(&rows), before, "refusals while pending change nothing");
    let chunk = |rows: &mut TransitioningKvRows, twins: &mut [Bf16FirstCache], seed: u64, real: [usize; 2]| {
        let (k, v, q) = kvq(&spec, seed, 2, 3);
        let (out, conv) = rows.window(&k, &v, &q, 0.3, &masks).unwrap();
        assert!(conv.is_empty(), "nothing converts at a window of a prepared prefill");
        for (i, tw) in twins.iter_mut().enumerate() {
            if real[i] > 0 {
                let c = |a: &Array| cols(&row(a, i), 0, real[i]).unwrap();
                let o = tw.window(&c(&k), &c(&v), &c(&q), 0.3, &masks).unwrap().0;
                if !rows.is_packed() {
                    assert_same_bytes(&cols(&row(&out, i), 0, real[i]).unwrap(), &o, "real positions vs the lego");
                }
            }
        }
    };
    chunk(&mut rows, &mut twins, 81, [3, 2]);
    assert_eq!(rows.pending(), Some(&[2usize, 0][..]));
    assert_eq!(rows.lifecycle()[1].converted_at, None, "row 1 reached start 2 but its request has not committed");
    assert_eq!(rows.commit_prefill(&[0]).unwrap(), vec![0]);
    assert!(twins[0].round_commit().unwrap());
    chunk(&mut rows, &mut twins, 82, [2, 0]);
    assert_eq!(rows.finalize().unwrap(), vec![1]);
    assert!(twins[1].round_commit().unwrap());
    assert!(rows.is_packed(), "every row converted");
    for (i, tw) in twins.iter().enumerate() {
        assert_eq!(
            planes_bits(&rows.row_physical_planes(i).unwrap()),
            planes_bits(&tw.inner().physical_planes().unwrap())
        );
        assert_eq!(rows.lifecycle()[i].converted_at, tw.converted_at());
    }
    let before = snapshot(&rows);
    assert!(matches!(rows.finalize(), Err(CacheError::NoPendingPrefill)));
    assert_eq!(snapshot(&rows), before);
    // Scenario 2: both rows commit after the first chunk, pack inside the prefill, and take the rest padded.
    let mut rows = TransitioningKvRows::merge(spec, w, t, vec![fresh(), fresh()]).unwrap();
    let mut twins = vec![fresh(), fresh()];
    rows.prepare(&[4, 3]).unwrap();
    for tw in &mut twins {
        tw.round_begin().unwrap();
    }
    chunk(&mut rows, &mut twins, 90, [3, 3]);
    assert_eq!(rows.commit_prefill(&[0, 1]).unwrap(), vec![0, 1]);
    for tw in &mut twins {
        assert!(tw.round_commit().unwrap());
    }
    assert!(rows.is_packed(), "packed inside the prefill");
    chunk(&mut rows, &mut twins, 91, [1, 0]);
    assert_eq!(rows.finalize().unwrap(), Vec::<usize>::new());
    for (i, tw) in twins.iter().enumerate() {
        assert_eq!(
            planes_bits(&rows.row_physical_planes(i).unwrap()),
            planes_bits(&tw.inner().physical_planes().unwrap())
        );
    }
    assert_eq!(rows.offsets(), vec![4, 3]);
}

/// A row index past the last row is a typed error (`NoSuchRow`) for every row-addressed method, never a panic, both
/// before and after packing (a cargo-mutants survivor: `check_row` -> `Ok(())`).
#[test]
fn row_addressed_methods_refuse_a_missing_row() {
    let spec = tspec();
    let w = Some(4);
    let t = tr(Some(6));
    let twins = vec![Bf16FirstCache::new(spec, w, t).unwrap(), Bf16FirstCache::new(spec, w, t).unwrap()];
    let rows = TransitioningKvRows::merge(spec, w, t, twins).unwrap();
    let missing = |r: Result<()>| matches!(r, Err(CacheError::NoSuchRow { row: 2, rows: 2 }));
    assert!(missing(rows.row_physical_planes(2).map(|_| ())));
    assert!(missing(rows.extract(2).map(|_| ())));
    let mut prefilling = rows.clone();
    prefilling.begin_prefill().unwrap();
    assert!(missing(prefilling.commit_prefill(&[0, 2]).map(|_| ())));
    assert!(rows.row_physical_planes(1).is_ok(), "the last row exists");
}

/// `max_append_tokens` of the rows is the least of their legos' values. A row that reached its boundary inside a
/// round, not yet converted (it converts at the commit), has no room left to count: its lego says `None`, so it must
/// not pull the rows' value down to 0 (cargo-mutants' `<` -> `<=` survivor in `max_append_tokens`).
#[test]
fn rows_max_append_tokens_is_the_least_of_their_legos_inside_a_round() {
    let spec = tspec();
    let masks = Masks::new();
    let t = tr(Some(4));
    let mut twins = legos_after_windows(spec, None, t, &[3, 1], 200);
    let mut rows = TransitioningKvRows::merge(spec, None, t, twins.clone()).unwrap();
    rows.round_begin().unwrap();
    let (k, v, q) = kvq(&spec, 300, 2, 1);
    rows.decode(&k, &v, &q, 0.3, &masks).unwrap();
    for (i, tw) in twins.iter_mut().enumerate() {
        tw.round_begin().unwrap();
        tw.decode(&row(&k, i), &row(&v, i), &row(&q, i), 0.3, &masks).unwrap();
    }
    assert_eq!(rows.offsets(), vec![4, 2]);
    assert_eq!(rows.lifecycle()[0].converted_at, None, "inside the round row 0 waits at its boundary");
    let legos: Vec<Option<usize>> = twins.iter().map(Bf16FirstCache::max_append_tokens).collect();
    assert_eq!(legos, vec![None, Some(2)]);
    assert_eq!(rows.max_append_tokens(), Some(2), "the least of the legos' values");
    rows.round_commit().unwrap();
    assert_eq!(rows.lifecycle()[0].converted_at, Some(4), "the commit converts row 0 at its boundary");
    assert_eq!(rows.max_append_tokens(), Some(2));
}

/// The upstream engine's "prefill defers conversion" vector: rows at offsets `[6, 3]`, transition start 5; a prefill
/// cohort takes one 2-position window and ends with no per-request `commit_prefill`. `end_prefill` commits the
/// uncommitted requests: offsets `[8, 5]`, row 1 converts at 5 (its transition is due), the extracted lego is one
/// `Bf16FirstCache::restore` accepts, and the next decode reads exactly as rows whose requests committed first.
#[test]
fn end_prefill_converts_the_uncommitted_rows_whose_transition_is_due() {
    let spec = tspec();
    let masks = Masks::new();
    let (w, t) = (None, tr(Some(5)));
    let legos = legos_after_windows(spec, w, t, &[6, 3], 70);
    assert_eq!((legos[0].converted_at(), legos[1].converted_at()), (Some(6), None));
    let mut rows = TransitioningKvRows::merge(spec, w, t, legos.clone()).unwrap();
    let mut committed = rows.clone();
    let (k, v, q) = kvq(&spec, 71, 2, 2);
    for r in [&mut rows, &mut committed] {
        r.begin_prefill().unwrap();
        let (_, conv) = r.window(&k, &v, &q, 0.3, &masks).unwrap();
        assert!(conv.is_empty(), "no row converts inside the cohort");
    }
    assert_eq!(committed.commit_prefill(&[0, 1]).unwrap(), vec![1]);
    assert_eq!(committed.end_prefill().unwrap(), Vec::<usize>::new(), "nothing left to convert");
    assert_eq!(rows.end_prefill().unwrap(), vec![1], "the uncommitted row whose transition is due converts");
    assert_eq!(rows.offsets(), vec![8, 5]);
    assert_eq!(rows.lifecycle()[1].converted_at, Some(5));
    assert!(matches!(rows.end_prefill(), Err(CacheError::Lifecycle { .. })), "a second end changes nothing");
    let lego = rows.extract(1).unwrap();
    assert_eq!(lego.converted_at(), Some(5));
    Bf16FirstCache::restore(lego.inner().clone(), t, lego.converted_at(), lego.minimum_reusable_offset())
        .expect("the extracted lego is one its lifecycle can reach");
    for i in 0..2 {
        assert_eq!(
            planes_bits(&rows.row_physical_planes(i).unwrap()),
            planes_bits(&committed.row_physical_planes(i).unwrap()),
            "row {i}: the same planes as after a commit"
        );
    }
    let (k1, v1, q1) = kvq(&spec, 72, 2, 1);
    let a = rows.decode(&k1, &v1, &q1, 0.3, &masks).unwrap().0;
    let b = committed.decode(&k1, &v1, &q1, 0.3, &masks).unwrap().0;
    assert_same_bytes(&a, &b, "the next decode reads as after a commit");
}

/// The same vector with `end_prefill` as it was (mutant `tkv-end-prefill-leaves-due`): row 1 stays bf16 at offset 5
/// although its transition is due, and its extracted lego is one `Bf16FirstCache::restore` refuses.
#[cfg(feature = "faults")]
#[test]
fn end_prefill_without_its_commit_leaves_a_due_row_unconverted() {
    let _m = testlock::arm(crate::faults::Mutant::TkvEndPrefillLeavesDue);
    let spec = tspec();
    let (w, t) = (None, tr(Some(5)));
    let mut rows = TransitioningKvRows::merge(spec, w, t, legos_after_windows(spec, w, t, &[6, 3], 70)).unwrap();
    rows.begin_prefill().unwrap();
    let (k, v, q) = kvq(&spec, 71, 2, 2);
    rows.window(&k, &v, &q, 0.3, &Masks::new()).unwrap();
    assert_eq!(rows.end_prefill().unwrap(), Vec::<usize>::new());
    assert_eq!((rows.offsets(), rows.lifecycle()[1].converted_at), (vec![8, 5], None));
    let lego = rows.extract(1).unwrap();
    assert!(
        Bf16FirstCache::restore(lego.inner().clone(), t, lego.converted_at(), lego.minimum_reusable_offset()).is_err(),
        "a lego past its transition but not converted is not one its lifecycle reaches"
    );
}

/// R-TKV-4's aligned form: every row's columns of the one batch tensor are exactly its own dense fetch behind its
/// left padding (converted rows dequantized), the padding and the tail are zeros; a lone row is its physical columns.
#[test]
fn aligned_dense_fetch_is_each_rows_fetch_behind_its_padding() {
    let spec = tspec();
    for (w, lens) in [(Some(6), vec![5, 2, 9]), (None, vec![3, 1]), (Some(4), vec![7])] {
        let legos = legos_after_windows(spec, w, tr(Some(4)), &lens, 70);
        let mut rows = TransitioningKvRows::merge(spec, w, tr(Some(4)), legos).unwrap();
        let (k, v, q) = kvq(&spec, 71, lens.len(), 1);
        rows.decode(&k, &v, &q, 0.3, &Masks::new()).unwrap();
        let (ak, av) = rows.dense_fetch_aligned().unwrap();
        let per_row = rows.dense_fetch().unwrap();
        let width = ak.shape()[2] as usize;
        assert_eq!(ak.shape()[0] as usize, lens.len());
        for (r, ((k, v), m)) in per_row.iter().zip(rows.lifecycle()).enumerate() {
            let l = k.shape()[2] as usize;
            assert!(m.left_pad + l <= width);
            let (rk, rv) = (row(&ak, r), row(&av, r));
            assert_same_bytes(&cols(&rk, m.left_pad, m.left_pad + l).unwrap(), k, &format!("row {r} keys"));
            assert_same_bytes(&cols(&rv, m.left_pad, m.left_pad + l).unwrap(), v, &format!("row {r} values"));
            for (a, b) in [(0, m.left_pad), (m.left_pad + l, width)] {
                if b > a {
                    let z = cols(&rk, a, b).unwrap();
                    assert!(bits(&z).iter().all(|&x| x == 0), "row {r} padding [{a}, {b}) is zeros");
                }
            }
        }
        if lens.len() == 1 {
            assert_eq!(rows.lifecycle()[0].left_pad, 0, "a lone row keeps its physical columns");
            assert_eq!(width, per_row[0].0.shape()[2] as usize);
        }
    }
}

/// R-TKV-7 on the bf16-first rows: known spans of unequal lengths (0 included) commit each row exactly as its lego
/// commits a span of its own length: outputs at the real positions, planes, conversion offsets and floors, through
/// conversions inside the span and packing; bad lengths change nothing.
#[test]
fn rows_known_spans_of_unequal_lengths_commit_each_row_as_its_lego() {
    let spec = tspec();
    for (w, lens, spans) in [
        (Some(6), vec![2, 3, 1], vec![4usize, 0, 6]),
        (None, vec![3, 3], vec![1, 5]),
        (Some(4), vec![5, 3], vec![3, 3]),
    ] {
        let legos = legos_after_windows(spec, w, tr(Some(4)), &lens, 90);
        let mut rows = TransitioningKvRows::merge(spec, w, tr(Some(4)), legos.clone()).unwrap();
        let mut twins: Vec<Bf16FirstCache> = (0..lens.len()).map(|i| rows.extract(i).unwrap()).collect();
        let l = *spans.iter().max().unwrap();
        let (k, v, q) = kvq(&spec, 91, lens.len(), l);
        let before = rows.offsets();
        assert!(matches!(
            rows.commit_known_spans(&k, &v, &q, 0.3, &Masks::new(), &spans[1..]),
            Err(CacheError::BadLengths { .. })
        ));
        assert_eq!(rows.offsets(), before);
        let (out, _) = rows.commit_known_spans(&k, &v, &q, 0.3, &Masks::new(), &spans).unwrap();
        for (r, twin) in twins.iter_mut().enumerate() {
            let what = format!("W {w:?} row {r} span {}", spans[r]);
            if spans[r] > 0 {
                let s = spans[r];
                let (kr, vr, qr) = (
                    cols(&row(&k, r), 0, s).unwrap(),
                    cols(&row(&v, r), 0, s).unwrap(),
                    cols(&row(&q, r), 0, s).unwrap(),
                );
                let want = twin.commit_span(&kr, &vr, &qr, 0.3, &Masks::new()).unwrap();
                assert_same_bytes(&cols(&row(&out, r), 0, s).unwrap(), &want, &format!("{what}: output"));
            }
            let got = rows.extract(r).unwrap();
            assert_eq!(
                (got.converted_at(), got.minimum_reusable_offset(), got.offset()),
                (twin.converted_at(), twin.minimum_reusable_offset(), twin.offset()),
                "{what}: lifecycle"
            );
            assert_eq!(
                planes_bits(&rows.row_physical_planes(r).unwrap()),
                planes_bits(&twin.inner().physical_planes().unwrap()),
                "{what}: planes"
            );
        }
    }
}

/// R-TKV-6 / R-C-9: the compiled step of the bf16-first rows (one serial slot per unpacked row in its own precision,
/// the packed batch's slot once every row converted) equals the ordinary decode byte for byte: outputs, every row's
/// planes, conversions (same rows, same step) and lifecycle, through conversions, packing and the ring's wrap.
#[test]
fn rows_compiled_step_equals_the_ordinary_decode_through_conversion_packing_and_wrap() {
    use crate::compiled::{decode_step, rows_decode_step};
    let spec = tspec();
    for (w, lens) in [(Some(4), vec![1, 3, 2]), (None, vec![2, 1]), (Some(3), vec![3])] {
        let legos = legos_after_windows(spec, w, tr(Some(4)), &lens, 120);
        let mut ordinary = TransitioningKvRows::merge(spec, w, tr(Some(4)), legos).unwrap();
        let mut stepped = ordinary.clone();
        let mut saw = (false, false);
        for s in 0..7u64 {
            let (k, v, q) = kvq(&spec, 130 + s, lens.len(), 1);
            let masks = Masks::new();
            let (want, want_conv) = ordinary.decode(&k, &v, &q, 0.3, &masks).unwrap();
            let plan = stepped.prepare_step().unwrap();
            assert_eq!(stepped.prepare_step().unwrap(), plan, "idempotent");
            let slots = stepped.step_slots(&plan, &Masks::new()).unwrap();
            let mut outs = Vec::new();
            let mut parts = Vec::new();
            for (r, slot) in slots.into_iter().enumerate() {
                let o = match slot.fetch {
                    Some(fetch) => {
                        saw.0 = true;
                        let (kr, vr, qr) = (row(&k, r), row(&v, r), row(&q, r));
                        let inputs: Vec<Array> = slot.inputs.into_iter().chain([qr, kr, vr, slot.rope]).collect();
                        decode_step(slot.storage, fetch, None, 0.3, &inputs).unwrap()
                    }
                    None => {
                        saw.1 = true;
                        let spec_m = match &slot.mask {
                            MaskUse::Array(m) => Some((**m).clone()),
                            _ => None,
                        };
                        let inputs: Vec<Array> =
                            slot.inputs.into_iter().chain([q.clone(), k.clone(), v.clone(), slot.rope]).collect();
                        rows_decode_step(slot.storage, spec_m.as_ref(), None, 0.3, &inputs).unwrap()
                    }
                };
                parts.push(o[0].clone());
                outs.push(o);
            }
            let got = mlx_rs::ops::concatenate(&parts, 0).unwrap();
            let (_, conv) = stepped.apply_step(&plan, outs).unwrap();
            let what = format!("W {w:?} {lens:?} step {s}");
            assert_same_bytes(&got, &want, &format!("{what}: output"));
            assert_eq!(conv, want_conv, "{what}: conversions");
            assert_eq!(stepped.lifecycle(), ordinary.lifecycle(), "{what}: lifecycle");
            assert_eq!(stepped.is_packed(), ordinary.is_packed(), "{what}: packing");
            for r in 0..lens.len() {
                assert_eq!(
                    planes_bits(&stepped.row_physical_planes(r).unwrap()),
                    planes_bits(&ordinary.row_physical_planes(r).unwrap()),
                    "{what}: row {r} planes"
                );
            }
        }
        assert!(saw.0, "{w:?} {lens:?}: serial slots ran");
        assert!(saw.1, "{w:?} {lens:?}: the packed slot ran");
    }
    // A plan of the other store is a typed error.
    let legos = legos_after_windows(spec, Some(4), tr(Some(4)), &[1, 2], 140);
    let mut rows = TransitioningKvRows::merge(spec, Some(4), tr(Some(4)), legos).unwrap();
    let plan = rows.prepare_step().unwrap();
    assert!(matches!(rows.apply_step(&plan, vec![]), Err(CacheError::StepMismatch { .. })));
}

/// R-TKV-3 on unpacked rows: one window read of rows whose geometries differ (past the window, inside it, a lone
/// wide row) builds one mask for the whole layout before any row appends (every later layer finds it), and each row's
/// output is byte-identical to its lego's own window read under its own mask.
#[test]
fn unpacked_rows_build_one_mask_for_the_layout_before_the_append() {
    let spec = tspec();
    for (w, lens, l) in [(Some(4), vec![5, 1, 3], 3), (Some(6), vec![2, 7], 2), (None, vec![3, 1], 2)] {
        let legos = legos_after_windows(spec, w, tr(None), &lens, 120);
        let mut rows = TransitioningKvRows::merge(spec, w, tr(None), legos.clone()).unwrap();
        assert!(!rows.is_packed());
        let mut twins = legos;
        let (k, v, q) = kvq(&spec, 121, lens.len(), l);
        let masks = Masks::new();
        let out = rows.window(&k, &v, &q, 0.3, &masks).unwrap().0;
        let explicit = lens.iter().any(|&n| w.is_some_and(|w| window_keep_len(n, w) + l > w));
        assert_eq!(masks.builds(), usize::from(explicit), "w {w:?} lens {lens:?}: one layout mask, or none needed");
        // A second layer of the same forward finds it.
        let mut layer2 = TransitioningKvRows::merge(spec, w, tr(None), twins.clone()).unwrap();
        layer2.window(&k, &v, &q, 0.3, &masks).unwrap();
        assert_eq!(masks.builds(), usize::from(explicit));
        for (r, twin) in twins.iter_mut().enumerate() {
            let own = twin.window(&row(&k, r), &row(&v, r), &row(&q, r), 0.3, &Masks::new()).unwrap().0;
            assert_same_bytes(&row(&out, r), &own, &format!("w {w:?} row {r}: the lego's own read"));
        }
    }
}

fn window_keep_len(len: usize, w: usize) -> usize {
    len.min(w - 1)
}

/// R-TKV-4: the softcapped fetch appends, then answers; each row's part of the aligned tensor is its lego's own
/// fetch of the same positions (bf16, then dequantized after a conversion, then packed), the conversions after the
/// fetch are the legos'; `update_and_fetch` is refused while any row is affine; a fetch while a prepared prefill is
/// pending and bad shapes change nothing.
#[test]
fn rows_fetch_appends_then_answers_as_each_legos_fetch() {
    let spec = tspec();
    for (w, lens) in [(Some(6), vec![2, 4]), (None, vec![3, 1, 2]), (Some(4), vec![3])] {
        let t = tr(Some(5));
        let legos = legos_after_windows(spec, w, t, &lens, 130);
        let mut rows = TransitioningKvRows::merge(spec, w, t, legos.clone()).unwrap();
        let mut twins = legos;
        for step in 0..4u64 {
            let (k, v, _) = kvq(&spec, 131 + step, lens.len(), 2);
            let mixed = rows.check_plain_read().is_err();
            let before = rows.clone();
            if mixed {
                assert!(matches!(rows.update_and_fetch(&k, &v), Err(CacheError::MixedPrecision { .. })));
                assert_eq!(rows.offsets(), before.offsets(), "a refused plain read changes nothing");
            }
            let ((ak, av), conv) = rows.fetch(&k, &v).unwrap();
            let mut twin_conv = vec![];
            for (r, (twin, m)) in twins.iter_mut().zip(before.lifecycle()).enumerate() {
                let ((tk, tv), c) = twin.fetch(&row(&k, r), &row(&v, r)).unwrap();
                if c {
                    twin_conv.push(r);
                }
                let n = tk.shape()[2] as usize;
                let pad = if lens.len() == 1 { 0 } else { m.left_pad };
                assert_same_bytes(&cols(&row(&ak, r), pad, pad + n).unwrap(), &tk, &format!("row {r} keys"));
                assert_same_bytes(&cols(&row(&av, r), pad, pad + n).unwrap(), &tv, &format!("row {r} values"));
            }
            assert_eq!(conv, twin_conv, "w {w:?} step {step}: the rows converted as their legos");
            assert_eq!(rows.offsets(), twins.iter().map(Bf16FirstCache::offset).collect::<Vec<_>>());
        }
        assert!(rows.lifecycle().iter().all(|m| m.converted_at.is_some()), "every row crossed start by a fetch");
    }
    let (w, t) = (Some(6), tr(Some(5)));
    let mut rows = TransitioningKvRows::merge(spec, w, t, legos_after_windows(spec, w, t, &[2, 3], 140)).unwrap();
    let (k, v, _) = kvq(&spec, 141, 2, 1);
    let (bad, _, _) = kvq(&spec, 142, 3, 1);
    assert!(matches!(rows.fetch(&bad, &v), Err(CacheError::ShapeMismatch { .. })));
    rows.prepare(&[1, 2]).unwrap();
    assert!(matches!(rows.fetch(&k, &v), Err(CacheError::PendingPrefill)));
    assert_eq!(rows.offsets(), vec![2, 3], "refused fetches change nothing");
}

/// R-TKV-3's named kernel set: a lego takes the thread's read mode with its format when it is created, the rows
/// take their legos' set, every lego extracted carries it into the layout it joins (whatever the thread's mode is
/// by then), the composition names it, a merge of legos carrying different sets is refused, and a read leaves the
/// thread's own mode as it was.
#[test]
fn the_kernel_set_is_taken_at_build_and_carried_by_extracted_rows() {
    let spec = tspec();
    let (w, t) = (Some(6), tr(Some(4)));
    crate::set_read_mode(crate::ReadMode::Exact);
    let exact = legos_after_windows(spec, w, t, &[2, 5], 150);
    crate::set_read_mode(crate::ReadMode::Fused);
    let fused = legos_after_windows(spec, w, t, &[3], 151);
    assert_eq!(exact[0].kernel_set(), KernelSet { quant: t.quant, mode: crate::ReadMode::Exact });
    assert_eq!(exact[0].kernel_set().name(), "affine:4:32:exact");
    assert_eq!(fused[0].kernel_set().name(), "affine:4:32:fused");
    let mut rows = TransitioningKvRows::merge(spec, w, t, exact.clone()).unwrap();
    assert_eq!(rows.kernel_set(), exact[0].kernel_set(), "the rows attend with their legos' set");
    let (k, v, q) = kvq(&spec, 152, 2, 1);
    rows.decode(&k, &v, &q, 0.3, &Masks::new()).unwrap();
    assert_eq!(crate::read_mode(), crate::ReadMode::Fused, "a read restores the thread's mode");
    let out = rows.extract(1).unwrap();
    assert_eq!(out.kernel_set().mode, crate::ReadMode::Exact, "an extracted row carries the set");
    let composed = crate::contract::Cache::composed(&rows).unwrap();
    assert_eq!(composed.kernels.as_deref(), Some("affine:4:32:exact"));
    let rejoined = TransitioningKvRows::merge(spec, w, t, vec![out.clone(), exact[0].clone()]).unwrap();
    assert_eq!(rejoined.kernel_set().mode, crate::ReadMode::Exact, "into the layout it joins");
    match TransitioningKvRows::merge(spec, w, t, vec![out, fused[0].clone()]) {
        Err(CacheError::KernelSetMismatch { expected, found }) => {
            assert_eq!((expected.as_str(), found.as_str()), ("affine:4:32:exact", "affine:4:32:fused"));
        }
        other => panic!("a merge of legos with different kernel sets: {other:?}"),
    }
    assert_eq!(TransitioningKvRows::merge(spec, w, t, vec![]).unwrap().kernel_set().mode, crate::ReadMode::Fused);
}

/// Packed rows whose rings rotated after the merge hand each row over as laid out (physical columns and phase), not
/// de-rolled as `extract` hands a row back: the adopted rows hold every row's planes as before, and their next
/// decode writes the same columns.
#[test]
fn packed_rotated_rows_adopt_their_parts_as_laid_out() {
    let spec = tspec();
    let (w, t) = (Some(4), tr(Some(2)));
    let masks = Masks::new();
    let mut rows = TransitioningKvRows::merge(spec, w, t, legos_after_windows(spec, w, t, &[6, 7], 170)).unwrap();
    let (k, v, q) = kvq(&spec, 180, 2, 1);
    rows.decode(&k, &v, &q, 0.3, &masks).unwrap();
    assert!(rows.is_packed(), "every row converted: packed");
    let mut again = TransitioningKvRows::adopt(spec, w, t, rows.parts().unwrap()).unwrap();
    for step in 0..2 {
        for i in 0..2 {
            assert_eq!(
                planes_bits(&again.row_physical_planes(i).unwrap()),
                planes_bits(&rows.row_physical_planes(i).unwrap()),
                "step {step} row {i}"
            );
        }
        let (k, v, q) = kvq(&spec, 181 + step, 2, 1);
        rows.decode(&k, &v, &q, 0.3, &masks).unwrap();
        again.decode(&k, &v, &q, 0.3, &masks).unwrap();
    }
}

/// Rows adopt their own parts (unpacked and packed) as they were: offsets, lifecycles, kernel set and every row's
/// planes; parts of a lifecycle no lego reaches (a converted row said unconverted, a floor that conversion did not
/// leave) are `InvalidState`, counts that differ `BadLengths`, and a layout mid-round has no parts.
#[test]
fn rows_adopt_their_parts_and_refuse_a_lifecycle_they_cannot_reach() {
    let spec = tspec();
    for (w, lens) in [(Some(6), vec![6, 2]), (None, vec![5, 7])] {
        let t = tr(Some(4));
        let rows = TransitioningKvRows::merge(spec, w, t, legos_after_windows(spec, w, t, &lens, 160)).unwrap();
        let again = TransitioningKvRows::adopt(spec, w, t, rows.parts().unwrap()).unwrap();
        assert_eq!(again.is_packed(), rows.is_packed(), "w {w:?}: packed as before");
        assert_eq!((again.offsets(), again.lifecycle()), (rows.offsets(), rows.lifecycle()));
        assert_eq!(again.kernel_set(), rows.kernel_set());
        for i in 0..lens.len() {
            assert_eq!(
                planes_bits(&again.row_physical_planes(i).unwrap()),
                planes_bits(&rows.row_physical_planes(i).unwrap()),
                "w {w:?} row {i}"
            );
        }
        let converted = rows.lifecycle().iter().position(|m| m.converted_at.is_some()).unwrap();
        let mut lying = rows.parts().unwrap();
        lying.lifecycle[converted].converted_at = None;
        assert!(matches!(TransitioningKvRows::adopt(spec, w, t, lying), Err(CacheError::InvalidState { .. })));
        let mut floor = rows.parts().unwrap();
        floor.lifecycle[converted].floor += 1;
        assert!(matches!(TransitioningKvRows::adopt(spec, w, t, floor), Err(CacheError::InvalidState { .. })));
        let mut short = rows.parts().unwrap();
        short.lifecycle.pop();
        assert!(matches!(TransitioningKvRows::adopt(spec, w, t, short), Err(CacheError::BadLengths { .. })));
        let mut armed = rows.clone();
        armed.round_begin().unwrap();
        assert!(matches!(armed.parts(), Err(CacheError::Lifecycle { .. })));
    }
}
