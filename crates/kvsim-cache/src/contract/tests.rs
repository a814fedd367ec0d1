//! The contract's tests: capabilities answer from the kind string alone; every layout answers the common calls
//! through the traits exactly as its own methods do (offsets, bytes per token against the bytes actually stored,
//! trims and their refusals with nothing changed, the decode phase against the step the host then plans); state
//! handed out is owned by the caller (R-C-8); generic row-layout code merges, extracts and filters every row
//! layout with each row's bytes unchanged.

use super::*;
use crate::bytes::ArrayBytes;
use crate::quant::QuantSpec;
use crate::ssm::GdnParams;
use crate::testutil::*;
use crate::{KvDtype, QuantizedKvCache, RotatingKvCache};

fn masks() -> Masks {
    Masks::new()
}

fn bytes_of(arrays: &[Array]) -> Vec<ArrayBytes> {
    arrays.iter().map(|a| ArrayBytes::of(a).unwrap()).collect()
}

/// Small deterministic layer parameters for the recurrent cache.
fn gdn(spec: &SsmSpec) -> GdnParams {
    let (c, hv) = (spec.conv_dim() as i32, spec.heads_v as i32);
    let small = |seed: u64, n: i32| data(seed, 1, 1, 1, n as usize, KvDtype::F32).reshape(&[n]).unwrap();
    GdnParams {
        conv_weight: (small(90, c * spec.kernel as i32) * 0.3f32).reshape(&[c, spec.kernel as i32, 1]).unwrap(),
        a_log: small(91, hv),
        dt_bias: small(92, hv),
    }
}

fn stored_bytes(arrays: &[Array]) -> usize {
    arrays.iter().map(|a| a.nbytes()).sum()
}

#[test]
fn capabilities_answer_from_the_kind_alone() {
    let caps = |s: &str| Capabilities::of(&StorageKind::new(s));
    let plain = caps("kv-plain");
    assert!(plain.known && plain.routed && !plain.row_batch && !plain.rotating && !plain.quantized);
    let rows = caps("rotating-plain+row-batch");
    assert!(rows.row_batch && rows.rotating && rows.routed);
    let quant = caps("kv:rotating-quant:4:64+row-batch");
    assert!(quant.quantized && quant.rotating && quant.row_batch);
    let lego = caps("kv:bf16-first-rotating-quant:8:4:64:16");
    assert!(lego.known && lego.transitioning && lego.rotating && !lego.row_batch && !lego.routed);
    let tkv = caps("kv:delayed-quant:4:64:inf");
    assert!(tkv.transitioning && tkv.row_batch && !tkv.rotating && !tkv.routed);
    let ssm = caps("ssm");
    assert!(ssm.recurrent && ssm.row_batch && !ssm.routed);
    let train = caps("train:training");
    assert!(train.training_only && train.known && !train.routed);
    assert!(caps("kv-chunked:256").known && !caps("kv-chunked:0256").known && !caps("kv-chunked:0").known);
    assert!(caps("cache-list").known);
    // Near misses of every kind are unknown and have no capability at all (fail closed, R-C-1).
    for s in [
        "",
        "kv-plain ",
        "Kv-plain",
        "rotating-plain+row-batch+row-batch",
        "kv:quant:7:64",
        "kv:quant:4:64:",
        "kv:delayed-quant:4:64:07",
        "ssm+row-batch",
        "train:other",
        "kv-chunked:",
    ] {
        assert_eq!(caps(s), Capabilities::default(), "{s:?} must have no capability");
    }
}

/// The common calls through `&mut dyn Cache`, against what the layout stores: positions per row, `bytes_per_token`
/// times the live columns equals the bytes of the state handed out (attention layouts), the decode phase equals the
/// fetch the host bookkeeping then plans, and a refused trim changes no byte and no offset.
fn speaks_the_contract(cache: &mut dyn Cache, live_columns: &[usize]) {
    let kind = cache.storage_kind();
    assert_eq!(cache.capabilities(), Capabilities::of(&kind), "{kind}");
    assert!(cache.capabilities().known, "{kind} must be a known kind");
    assert_eq!(cache.offsets().len(), cache.rows(), "{kind}");
    assert_eq!(cache.offset(), cache.offsets().into_iter().max().unwrap_or(0));
    assert!(cache.rope_input().is_none(), "{kind}: a real cache leaves the RoPE input unset (R-C-9)");
    let state = cache.state().unwrap();
    if let (Some(bpt), false) = (cache.bytes_per_token(), cache.capabilities().recurrent) {
        assert_eq!(bpt * live_columns.iter().sum::<usize>(), stored_bytes(&state), "{kind}: bytes_per_token");
    }
    // A trim longer than anything stored is refused, nothing changed.
    let (before, offsets) = (bytes_of(&state), cache.offsets());
    assert!(cache.trim(1 << 20, false).is_err(), "{kind}");
    assert_eq!(bytes_of(&cache.state().unwrap()), before, "{kind}: a refused trim moved bytes");
    assert_eq!(cache.offsets(), offsets, "{kind}");
    match cache.decode_phase() {
        Some(phases) => {
            assert_eq!(phases.len(), cache.rows());
            let targets = cache.prepare_decode_step().unwrap();
            assert_eq!(targets.len(), cache.rows(), "{kind}");
            assert_eq!(cache.decode_phase().unwrap(), phases, "{kind}: prepare_decode_step changed the phase");
            assert_eq!(cache.offsets(), offsets, "{kind}: prepare_decode_step moved a position");
        }
        None => assert!(matches!(cache.prepare_decode_step(), Err(CacheError::Unsupported { .. })), "{kind}"),
    }
}

#[test]
fn every_layout_speaks_the_contract() {
    let spec = spec(KvDtype::F32);
    let m = masks();
    let fill = |c: &mut SerialCache, seed: u64, n: usize| {
        let (k, v, q) = kvq(&spec, seed, 1, n);
        SerialCache::window(c, &k, &v, &q, 0.5, &m).unwrap();
    };
    let mut linear = SerialCache::new(spec, None).unwrap();
    fill(&mut linear, 1, 5);
    speaks_the_contract(&mut linear, &[5]);
    let mut ring = RotatingKvCache::new(spec, 4).unwrap();
    fill(&mut ring, 2, 6);
    let live = ring.state().len;
    speaks_the_contract(&mut ring, &[live]);
    assert!(!Cache::is_trimmable(&ring), "a wrapped ring is not trimmable");

    let qspec = KvSpec { heads_kv: 2, head_dim: 64, dtype: KvDtype::Bf16 };
    let mut quant = QuantizedKvCache::new(qspec, QuantSpec { bits: 4, group: 32 }).unwrap();
    let (k, v, q) = kvq(&qspec, 3, 1, 3);
    SerialCache::window(&mut quant, &k, &v, &q, 0.1, &m).unwrap();
    speaks_the_contract(&mut quant, &[3]);

    let mut a = RotatingKvCache::new(spec, 4).unwrap();
    fill(&mut a, 4, 6);
    let mut b = RotatingKvCache::new(spec, 4).unwrap();
    fill(&mut b, 5, 2);
    let g = KvGeometry { spec, max_size: Some(4), storage: Storage::Plain };
    let mut rows = <RowBatch as RowLayout>::join(&g, &[&a, &b]).unwrap();
    let lens: Vec<usize> = rows.row_states().iter().map(|r| r.ring.len).collect();
    speaks_the_contract(&mut rows, &lens);

    let mut chunked = ChunkedKvCache::new(spec, 8).unwrap();
    let (k, v, q) = kvq(&spec, 6, 1, 3);
    chunked.cache_mut().window(&k, &v, &q, 0.5, &m).unwrap();
    let c = Cache::composed(&chunked).unwrap();
    assert_eq!((c.wrapper.as_str(), c.storage[0].as_str()), ("kv-chunked:8", "kv-plain"));
    speaks_the_contract(&mut chunked, &[3]);

    let t = Transition { start: Some(4), quant: QuantSpec { bits: 8, group: 32 } };
    let mut lego = Bf16FirstCache::new(qspec, Some(8), t).unwrap();
    let (k, v, q) = kvq(&qspec, 7, 1, 3);
    Bf16FirstCache::window(&mut lego, &k, &v, &q, 0.1, &m).unwrap();
    let plain_bpt = Cache::bytes_per_token(&lego).unwrap();
    assert_eq!(Cache::max_committed(&lego), Some(1));
    speaks_the_contract(&mut lego, &[3]);
    let (k, v, q) = kvq(&qspec, 8, 1, 1);
    Bf16FirstCache::decode(&mut lego, &k, &v, &q, 0.1, &m).unwrap();
    let c = Cache::composed(&lego).unwrap();
    assert_eq!(c.wrapper.as_str(), "kv:bf16-first-rotating-quant:8:8:32:4");
    assert_eq!(c.storage[0].as_str(), "kv:rotating-quant:8:32", "the lego composes affine storage after converting");
    assert!(Cache::bytes_per_token(&lego).unwrap() < plain_bpt);
    assert_eq!((Cache::minimum_reusable_offset(&lego), Cache::max_committed(&lego)), (4, None));
    speaks_the_contract(&mut lego, &[4]);

    let sspec = SsmSpec { kernel: 4, heads_k: 1, heads_v: 2, dk: 8, dv: 8, dtype: KvDtype::F32 };
    let mut ssm = SsmCache::new(sspec, 2).unwrap();
    assert_eq!(Cache::bytes_per_token(&ssm), Some(0));
    assert!(matches!(Cache::trim(&mut ssm, 1, true), Err(CacheError::RecurrentNotTrimmable)));
    speaks_the_contract(&mut ssm, &[0, 0]);
    assert!(ssm.rounds().is_some());

    let mut training = TrainingCache::padded(spec, Some(4), vec![3, 2]).unwrap();
    assert_eq!((Cache::rows(&training), Cache::bytes_per_token(&training)), (2, None));
    speaks_the_contract(&mut training, &[0, 0]);
    let mut shared = PrefixSharedCache::new(spec, None, 2, 1, 1).unwrap();
    speaks_the_contract(&mut shared, &[0]);
    let mut tssm = TrainingSsmCache::new(sspec).unwrap();
    speaks_the_contract(&mut tssm, &[0]);
}

/// R-C-8: the arrays `state()` hands out are the caller's: later writes never change them, and dropping them
/// leaves the cache whole (it continues byte-identically to a twin that never handed anything out).
#[test]
fn state_handed_out_is_owned_by_the_caller() {
    let spec = spec(KvDtype::F32);
    let m = masks();
    let step = |c: &mut dyn AttentionCache, seed: u64| {
        let (k, v, q) = kvq(&spec, seed, 1, 1);
        c.decode(&k, &v, &q, 0.5, &m).unwrap()
    };
    let mut cache = RotatingKvCache::new(spec, 3).unwrap();
    let mut twin = RotatingKvCache::new(spec, 3).unwrap();
    for s in 0..2 {
        step(&mut cache, s);
        step(&mut twin, s);
    }
    let held = Cache::state(&cache).unwrap();
    let snapshot = bytes_of(&held);
    for s in 2..6 {
        step(&mut cache, s);
    }
    assert_eq!(bytes_of(&held), snapshot, "a write to the cache changed arrays handed out earlier");
    drop(held);
    for s in 2..6 {
        step(&mut twin, s);
    }
    let (a, b) = (step(&mut cache, 9), step(&mut twin, 9));
    assert_same_bytes(&a, &b, "a cache whose state was handed out and dropped reads as its twin");
    assert_eq!(bytes_of(&Cache::state(&cache).unwrap()), bytes_of(&Cache::state(&twin).unwrap()));

    let sspec = SsmSpec { kernel: 2, heads_k: 1, heads_v: 1, dk: 4, dv: 4, dtype: KvDtype::F32 };
    let params = gdn(&sspec);
    let mut ssm = SsmCache::new(sspec, 1).unwrap();
    let held = Cache::state(&ssm).unwrap();
    let snapshot = bytes_of(&held);
    let conv = sspec.conv_dim();
    let qkv = data(3, 1, 1, 1, conv, KvDtype::F32).reshape(&[1, 1, conv as i32]).unwrap();
    let ab = data(4, 1, 1, 1, 1, KvDtype::F32).reshape(&[1, 1, 1]).unwrap();
    ssm.decode(&qkv, &ab, &ab, &params).unwrap();
    assert_eq!(bytes_of(&held), snapshot, "a recurrent step changed states handed out earlier");
}

/// Generic row-layout code: merge serial caches, then every row extracted holds its source's bytes; the layout
/// adopted from its own parts is the same layout; filter keeps the kept rows' bytes; a bad filter is a typed error
/// with nothing changed.
fn rows_round_trip<R>(g: &R::Geometry, serials: Vec<R::Serial>, planes: impl Fn(&R::Serial) -> Vec<Array>)
where
    R: RowLayout,
{
    let want: Vec<Vec<ArrayBytes>> = serials.iter().map(|s| bytes_of(&planes(s))).collect();
    let mut rows = R::merge(g, serials).unwrap();
    assert_eq!(rows.rows(), want.len());
    for (i, w) in want.iter().enumerate() {
        assert_eq!(&bytes_of(&planes(&rows.extract(i).unwrap())), w, "row {i} extracted");
    }
    // `adopt` of the layout's own parts is the layout again: offsets, state and every row's bytes.
    let again = R::adopt(g, rows.parts().unwrap()).unwrap();
    assert_eq!((again.offsets(), again.storage_kind()), (rows.offsets(), rows.storage_kind()));
    assert_eq!(bytes_of(&again.state().unwrap()), bytes_of(&rows.state().unwrap()), "adopted state");
    for (i, w) in want.iter().enumerate() {
        assert_eq!(&bytes_of(&planes(&again.extract(i).unwrap())), w, "row {i} of the adopted layout");
    }
    let before = bytes_of(&rows.state().unwrap());
    assert!(rows.filter(&[0, 0]).is_err());
    assert!(rows.filter(&[want.len()]).is_err());
    assert_eq!(bytes_of(&rows.state().unwrap()), before, "a refused filter changed bytes");
    rows.filter(&[1]).unwrap();
    assert_eq!(bytes_of(&planes(&rows.extract(0).unwrap())), want[1], "the kept row after filter");
    assert!(!rows.is_pending());
}

#[test]
fn generic_row_code_drives_every_row_layout() {
    let spec = spec(KvDtype::F32);
    let m = masks();
    let ring = |seed: u64, n: usize| {
        let mut c = RotatingKvCache::new(spec, 4).unwrap();
        let (k, v, q) = kvq(&spec, seed, 1, n);
        SerialCache::window(&mut c, &k, &v, &q, 0.5, &m).unwrap();
        c
    };
    let g = KvGeometry { spec, max_size: Some(4), storage: Storage::Plain };
    rows_round_trip::<RowBatch>(&g, vec![ring(1, 3), ring(2, 2)], |c| c.temporal_view_planes().unwrap());

    let qspec = KvSpec { heads_kv: 2, head_dim: 64, dtype: KvDtype::Bf16 };
    let t = Transition { start: Some(3), quant: QuantSpec { bits: 4, group: 32 } };
    let lego = |seed: u64, n: usize| {
        let mut l = Bf16FirstCache::new(qspec, None, t).unwrap();
        let (k, v, q) = kvq(&qspec, seed, 1, n);
        Bf16FirstCache::window(&mut l, &k, &v, &q, 0.1, &m).unwrap();
        l
    };
    let lg = LegoGeometry { spec: qspec, max_size: None, transition: t };
    rows_round_trip::<TransitioningKvRows>(&lg, vec![lego(3, 4), lego(4, 2)], |l| {
        l.inner().temporal_view_planes().unwrap()
    });

    let sspec = SsmSpec { kernel: 2, heads_k: 1, heads_v: 1, dk: 4, dv: 4, dtype: KvDtype::F32 };
    let params = gdn(&sspec);
    let conv = sspec.conv_dim();
    let ssm = |seed: u64| {
        let mut c = SsmCache::new(sspec, 1).unwrap();
        let qkv = data(seed, 1, 1, 2, conv, KvDtype::F32).reshape(&[1, 2, conv as i32]).unwrap();
        let ab = data(seed + 50, 1, 1, 2, 1, KvDtype::F32).reshape(&[1, 2, 1]).unwrap();
        c.window(&qkv, &ab, &ab, &params).unwrap();
        c
    };
    rows_round_trip::<SsmCache>(&sspec, vec![ssm(5), ssm(6)], |c| Cache::state(c).unwrap());
}

/// The bf16-first rows' trims, decode phases and per-row bytes: rows trim as their legos do, a trim inside an
/// armed round is refused with nothing changed, and a row's cost per token follows its precision.
#[test]
fn bf16_first_rows_trim_and_plan_as_their_legos() {
    let qspec = KvSpec { heads_kv: 2, head_dim: 64, dtype: KvDtype::Bf16 };
    let t = Transition { start: Some(4), quant: QuantSpec { bits: 4, group: 32 } };
    let m = masks();
    let lego = |seed: u64, n: usize| {
        let mut l = Bf16FirstCache::new(qspec, Some(6), t).unwrap();
        let (k, v, q) = kvq(&qspec, seed, 1, n);
        Bf16FirstCache::window(&mut l, &k, &v, &q, 0.1, &m).unwrap();
        l
    };
    let (a, b) = (lego(1, 5), lego(2, 2));
    assert!(a.converted_at().is_some() && b.converted_at().is_none());
    let mut rows = TransitioningKvRows::merge(qspec, Some(6), t, vec![a.clone(), b.clone()]).unwrap();
    assert_eq!(rows.row_bytes_per_token(0).unwrap(), Cache::bytes_per_token(&a).unwrap());
    assert_eq!(rows.row_bytes_per_token(1).unwrap(), Cache::bytes_per_token(&b).unwrap());
    assert_eq!(Cache::bytes_per_token(&rows), Cache::bytes_per_token(&b), "the layout answers its costliest row");
    let c = Cache::composed(&rows).unwrap();
    assert_eq!(
        c.storage.iter().map(StorageKind::as_str).collect::<Vec<_>>(),
        ["kv:rotating-quant:4:32", "rotating-plain"]
    );
    assert_eq!(rows.row_storage(1).unwrap().storage_kind().as_str(), "rotating-plain");

    rows.round_begin().unwrap();
    let before = bytes_of(&Cache::state(&rows).unwrap());
    assert!(!Cache::is_trimmable(&rows));
    assert!(matches!(Cache::trim(&mut rows, 1, false), Err(CacheError::Lifecycle { .. })));
    assert_eq!(bytes_of(&Cache::state(&rows).unwrap()), before);
    rows.round_commit().unwrap();

    Cache::trim(&mut rows, 1, false).unwrap();
    let (mut ta, mut tb) = (rows.extract(0).unwrap(), rows.extract(1).unwrap());
    let (mut la, mut lb) = (a, b);
    Cache::trim(&mut la, 1, false).unwrap();
    Cache::trim(&mut lb, 1, false).unwrap();
    for (x, y) in [(&ta, &la), (&tb, &lb)] {
        assert_eq!(bytes_of(&Cache::state(x).unwrap()), bytes_of(&Cache::state(y).unwrap()));
        assert_eq!(Cache::offsets(x), Cache::offsets(y));
    }
    let phases = Cache::decode_phase(&rows).unwrap();
    assert_eq!(phases, [Cache::decode_phase(&la).unwrap()[0], Cache::decode_phase(&lb).unwrap()[0]]);
    let targets = Cache::prepare_decode_step(&mut rows).unwrap();
    assert_eq!(
        targets,
        [Cache::prepare_decode_step(&mut ta).unwrap()[0], Cache::prepare_decode_step(&mut tb).unwrap()[0]]
    );
}
