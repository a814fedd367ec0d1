use super::*;
use crate::read::attend;
use crate::testutil::testlock;
use crate::testutil::*;
use crate::KvDtype;

fn f32s(a: &Array) -> Vec<f32> {
    let a = a.as_dtype(mlx_rs::Dtype::Float32).unwrap().contiguous().unwrap();
    a.eval().unwrap();
    a.as_slice::<f32>().to_vec()
}

/// Host copy of every position ever written: `[H, D]` row-major per position.
#[derive(Default)]
struct Hist {
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl Hist {
    fn push(&mut self, k: &Array, v: &Array) {
        let (h, l, d) = (k.shape()[1] as usize, k.shape()[2] as usize, k.shape()[3] as usize);
        let (kf, vf) = (f32s(k), f32s(v));
        for i in 0..l {
            let pick = |x: &[f32]| (0..h).flat_map(|hh| x[(hh * l + i) * d..(hh * l + i + 1) * d].to_vec()).collect();
            self.k.push(pick(&kf));
            self.v.push(pick(&vf));
        }
    }
}

/// f64 attention of query `i` of `q` `[1, HQ, L, D]` over `positions`; returns `[HQ, D]`.
#[allow(clippy::too_many_arguments)]
fn expected(
    h: &Hist,
    q: &[f32],
    l: usize,
    i: usize,
    positions: &[usize],
    hkv: usize,
    d: usize,
    scale: f64,
) -> Vec<f64> {
    let mut out = Vec::new();
    for hq in 0..HQ {
        let kh = hq / (HQ / hkv);
        let qv = &q[(hq * l + i) * d..(hq * l + i + 1) * d];
        let s: Vec<f64> = positions
            .iter()
            .map(|&p| (0..d).map(|x| qv[x] as f64 * h.k[p][kh * d + x] as f64).sum::<f64>() * scale)
            .collect();
        let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|x| (x - m).exp()).collect();
        let z: f64 = e.iter().sum();
        for x in 0..d {
            out.push(positions.iter().zip(&e).map(|(&p, w)| w / z * h.v[p][kh * d + x] as f64).sum());
        }
    }
    out
}

fn check_against_f64(
    out: &Array,
    q: &Array,
    h: &Hist,
    offset_after: usize,
    w: Option<usize>,
    spec: &KvSpec,
    scale: f32,
) {
    let l = q.shape()[2] as usize;
    let (qf, of) = (f32s(q), f32s(out));
    let d = spec.head_dim;
    for i in 0..l {
        let p = offset_after - l + i;
        let lo = w.map_or(0, |w| (p + 1).saturating_sub(w));
        let vis: Vec<usize> = (lo..=p).collect();
        let e = expected(h, &qf, l, i, &vis, spec.heads_kv, d, scale as f64);
        for hq in 0..HQ {
            for x in 0..d {
                let got = of[(hq * l + i) * d + x] as f64;
                let want = e[hq * d + x];
                assert!((got - want).abs() < 1e-4, "query {i} (pos {p}) head {hq} dim {x}: {got} vs {want}");
            }
        }
    }
}

/// Window and decode reads see exactly the causal sliding window (R-C-2), for rings and the linear cache.
#[test]
fn reads_match_f64_sliding_window_reference() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::F32);
    for w in [Some(1), Some(4), Some(5), None] {
        let mut c = SerialCache::new(spec, w).unwrap();
        let mut h = Hist::default();
        let masks = Masks::new();
        let script: &[(bool, usize)] =
            &[(true, 3), (false, 3), (true, 5), (false, 2), (true, 1), (false, 4), (true, 2), (true, 7), (false, 6)];
        let mut seed = 100;
        for &(is_window, l) in script {
            for _ in 0..if is_window { 1 } else { l } {
                seed += 1;
                let n = if is_window { l } else { 1 };
                let (k, v, q) = kvq(&spec, seed, 1, n);
                h.push(&k, &v);
                let (out, used) = if is_window {
                    c.window(&k, &v, &q, 0.3, &masks).unwrap()
                } else {
                    c.decode(&k, &v, &q, 0.3, &masks).unwrap()
                };
                if !is_window {
                    assert_eq!(used, MaskUse::None);
                }
                check_against_f64(&out, &q, &h, c.offset(), w, &spec, 0.3);
                c.state().validate(w).unwrap();
            }
        }
    }
}

/// MLX's `Causal` is bottom-right aligned and equals the explicit mask bit for bit on CPU.
#[test]
fn causal_equals_explicit_mask_bytes() {
    let _g = testlock::shared();
    for dtype in [KvDtype::F32, KvDtype::Bf16] {
        let spec = spec(dtype);
        let mut c = RotatingKvCache::new(spec, 8).unwrap();
        let masks = Masks::new();
        let (k, v, q) = kvq(&spec, 7, 1, 3);
        c.window(&k, &v, &q, 0.3, &masks).unwrap();
        let (k, v, q) = kvq(&spec, 8, 1, 4);
        let (out, used) = c.window(&k, &v, &q, 0.3, &masks).unwrap();
        assert_eq!(used, MaskUse::Causal);
        let key =
            MaskKey { kind: MaskKind::Window, lens: vec![7], real: vec![4], queries: 4, window: Some(8), cols: 7 };
        let (spec, arr) = masks.get(&key).unwrap();
        let (kl, vl) = c.physical().unwrap();
        let explicit = attend(&q, &kl, &vl, 0.3, Some((&spec, &arr)), false).unwrap();
        assert_same_bytes(&out, &explicit, "causal vs explicit");
    }
}

#[test]
fn decode_rotates_in_place_and_temporal_view_is_the_tail() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::Bf16);
    let mut c = RotatingKvCache::new(spec, 4).unwrap();
    let masks = Masks::new();
    let mut ks = Vec::new();
    for i in 0..6u64 {
        assert_eq!(c.decode_phase(), if i < 4 { DecodePhase::Concat } else { DecodePhase::Ring });
        let (k, v, q) = kvq(&spec, i, 1, 1);
        c.decode(&k, &v, &q, 0.3, &masks).unwrap();
        ks.push(k);
    }
    assert_eq!(c.state(), &RingState { offset: 6, len: 4, idx: 2, last_concat: None });
    assert_eq!(c.state().positions(), vec![4, 5, 2, 3]);
    assert_eq!(c.cap(), 4, "ring growth is capped at W");
    let (tk, _) = c.temporal_view().unwrap();
    assert_same_bytes(&tk, &mlx_rs::ops::concatenate(&ks[2..], 2).unwrap(), "temporal view = newest 4");
    let (pk, _) = c.physical().unwrap();
    let phys = [&ks[4], &ks[5], &ks[2], &ks[3]];
    assert_same_bytes(&pk, &mlx_rs::ops::concatenate(&phys, 2).unwrap(), "physical ring order");
    assert_eq!(c.picture(), "rotating-plain W=4 | 4 5>2 3 | off=6 len=4 idx=2");
    // The host-side column list names exactly what temporal_view gathers from the raw buffers.
    assert_eq!(c.temporal_view_columns(), vec![2, 3, 0, 1]);
    let (bk, _) = c.buffers().unwrap();
    let at = Array::from_slice(&[2i32, 3, 0, 1], &[4]);
    assert_same_bytes(&bk.take_axis(&at, 2).unwrap(), &tk, "buffers + temporal_view_columns");
}

/// R-ROT-3 / R-ROT-4: a window write keeps W - 1 columns plus the block (the plateau), and the temporal view
/// of the oversized buffer is its tail. The next decode drops the oversize.
#[test]
fn window_plateau_then_decode_drops_oversize() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::F32);
    let mut c = RotatingKvCache::new(spec, 4).unwrap();
    let masks = Masks::new();
    let mut all = Vec::new();
    for s in 0..3u64 {
        let (k, v, q) = kvq(&spec, 10 + s, 1, 3);
        c.window(&k, &v, &q, 0.3, &masks).unwrap();
        all.push(k);
    }
    assert_eq!(c.state(), &RingState { offset: 9, len: 6, idx: 6, last_concat: Some(3) });
    assert_eq!(c.state().positions(), vec![3, 4, 5, 6, 7, 8]);
    let ak = mlx_rs::ops::concatenate(&all, 2).unwrap();
    let (tk, _) = c.temporal_view().unwrap();
    assert_same_bytes(&tk, &cols(&ak, 5, 9).unwrap(), "tail of the plateau");
    assert_eq!(c.decode_phase(), DecodePhase::Ring);
    let plan = DecodePlan { fetch: DecodePhase::Ring, write_pos: 0, active_len: 4 };
    assert_eq!(c.prepare_decode_step().unwrap(), plan);
    assert_eq!(c.prepare_decode_step().unwrap(), plan, "idempotent");
    assert_eq!(c.state(), &RingState { offset: 9, len: 4, idx: 0, last_concat: None });
    let (k, v, q) = kvq(&spec, 99, 1, 1);
    c.decode(&k, &v, &q, 0.3, &masks).unwrap();
    assert_eq!(c.state().positions(), vec![9, 6, 7, 8]);
}

#[test]
fn trim_rules_and_errors() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::F32);
    let masks = Masks::new();
    let mut c = RotatingKvCache::new(spec, 4).unwrap();
    let (k, v, _) = kvq(&spec, 1, 1, 2);
    c.append(&k, &v).unwrap();
    assert!(c.is_trimmable());
    assert_eq!(c.trim(3, false), Err(CacheError::TrimTooLong { requested: 3, available: 2 }));
    assert_eq!(c.trim(1, false), Ok(1));
    assert_eq!(c.state(), &RingState { offset: 1, len: 1, idx: 1, last_concat: None });
    assert_eq!(c.trim(1, true), Err(CacheError::BypassNotAfterWindow));
    // Wrap the ring.
    for s in 0..5 {
        let (k, v, q) = kvq(&spec, 20 + s, 1, 1);
        c.decode(&k, &v, &q, 0.3, &masks).unwrap();
    }
    assert!(!c.is_trimmable());
    assert_eq!(c.trim(1, false), Err(CacheError::NotTrimmable { offset: 6, max_size: 4 }));
    assert_eq!(c.trim(1, true), Err(CacheError::BypassNotAfterWindow));
    // Bypass after a window: exactly the state a shorter window leaves.
    let before = c.clone();
    let (k, v, q) = kvq(&spec, 40, 1, 3);
    c.window(&k, &v, &q, 0.3, &masks).unwrap();
    assert_eq!(c.trim(4, true), Err(CacheError::TrimTooLong { requested: 4, available: 3 }));
    assert_eq!(c.trim(2, true), Ok(2));
    let mut shorter = before.clone();
    shorter.append(&cols(&k, 0, 1).unwrap(), &cols(&v, 0, 1).unwrap()).unwrap();
    assert_eq!(c.state(), shorter.state());
    assert_same_bytes(&c.physical().unwrap().0, &shorter.physical().unwrap().0, "bypass = shorter window");
    // Linear caches are always trimmable.
    let mut lin = KvCache::new(spec).unwrap();
    for s in 0..5 {
        let (k, v, q) = kvq(&spec, 60 + s, 1, 1);
        lin.decode(&k, &v, &q, 0.3, &masks).unwrap();
    }
    assert_eq!(lin.trim(5, false), Ok(5));
    assert_eq!(lin.trim(1, false), Err(CacheError::TrimTooLong { requested: 1, available: 0 }));
}

#[test]
fn impossible_requests_are_errors() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::F32);
    let masks = Masks::new();
    assert!(matches!(SerialCache::new(spec, Some(0)), Err(CacheError::InvalidState { .. })));
    let bad_spec = KvSpec { heads_kv: 0, ..spec };
    assert!(matches!(KvCache::new(bad_spec), Err(CacheError::InvalidState { .. })));
    let (k, v, _) = kvq(&spec, 1, 1, 3);
    assert!(matches!(SerialCache::from_temporal(spec, Some(4), &k, &v, 2), Err(CacheError::InvalidState { .. })));
    let mut c = RotatingKvCache::new(spec, 4).unwrap();
    let (k2, v2, q2) = kvq(&spec, 2, 1, 2);
    let (k1, v1, q1) = kvq(&spec, 3, 1, 1);
    let shape_err = |r: Result<(Array, MaskUse)>| matches!(r, Err(CacheError::ShapeMismatch { .. }));
    assert!(shape_err(c.decode(&k2, &v2, &q2, 0.3, &masks)), "decode of 2 positions");
    assert!(shape_err(c.decode(&k1, &v1, &q2, 0.3, &masks)), "queries of another length");
    assert!(shape_err(c.window(&k2, &v1, &q2, 0.3, &masks)), "k and v differ");
    let (kb, vb, qb) = kvq(&spec, 4, 2, 1);
    assert!(shape_err(c.decode(&kb, &vb, &qb, 0.3, &masks)), "two rows into a serial cache");
    let bf = k1.as_dtype(mlx_rs::Dtype::Bfloat16).unwrap();
    assert!(shape_err(c.decode(&bf, &bf, &q1, 0.3, &masks)), "dtype");
    let q3 = data(5, 1, 3, 1, spec.head_dim, spec.dtype);
    assert!(shape_err(c.decode(&k1, &v1, &q3, 0.3, &masks)), "H_q not a multiple of H_kv");
    let k0 = data(6, 1, spec.heads_kv, 0, spec.head_dim, spec.dtype);
    assert!(matches!(c.append(&k0, &k0), Err(CacheError::ShapeMismatch { .. })), "empty window");
    assert_eq!(c.state(), &RingState::default(), "errors change nothing");
}

#[test]
fn relinearize_and_from_temporal_keep_bytes_and_positions() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::Bf16);
    let masks = Masks::new();
    let mut c = RotatingKvCache::new(spec, 5).unwrap();
    for s in 0..8 {
        let (k, v, q) = kvq(&spec, s, 1, 1);
        c.decode(&k, &v, &q, 0.3, &masks).unwrap();
    }
    assert!(c.state().is_rotated());
    let (tk, tv) = c.temporal_view().unwrap();
    let copy = SerialCache::from_temporal(spec, Some(5), &tk, &tv, c.offset()).unwrap();
    c.relinearize().unwrap();
    assert_eq!(c.state(), copy.state());
    assert_same_bytes(&c.physical().unwrap().0, &copy.physical().unwrap().0, "relinearized = from_temporal");
    assert_same_bytes(&c.physical().unwrap().0, &tk, "relinearized = temporal view");
}

#[test]
fn linear_cache_grows_in_steps_and_commit_span_is_decodes() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::F32);
    let masks = Masks::new();
    let mut a = KvCache::new(spec).unwrap();
    let mut b = KvCache::new(spec).unwrap();
    let (k, v, q) = kvq(&spec, 1, 1, 300);
    a.append(&k, &v).unwrap();
    b.append(&k, &v).unwrap();
    assert_eq!(a.cap(), 512);
    let (k, v, q) = (cols(&k, 0, 5).unwrap(), cols(&v, 0, 5).unwrap(), cols(&q, 0, 5).unwrap());
    let span = a.commit_span(&k, &v, &q, 0.3, &masks).unwrap();
    let mut outs = Vec::new();
    for i in 0..5 {
        let s = |x: &Array| cols(x, i, i + 1).unwrap();
        outs.push(b.decode(&s(&k), &s(&v), &s(&q), 0.3, &masks).unwrap().0);
    }
    assert_same_bytes(&span, &mlx_rs::ops::concatenate(&outs, 2).unwrap(), "commit_span = decodes");
    assert_eq!(a.state(), &RingState { offset: 305, len: 305, idx: 305, last_concat: None });
    assert_eq!(a.storage_kind().as_str(), "kv-plain");
    assert_eq!(a.bytes_per_token(), 2 * 2 * 8 * 4);
    assert_eq!(a.bytes_for_tokens(1000), 1000 * 128);
    let r = RotatingKvCache::new(spec, 16).unwrap();
    assert_eq!(r.bytes_for_tokens(1000), 16 * 128);
    assert_eq!(r.storage_kind().as_str(), "rotating-plain");
}

#[cfg(feature = "faults")]
#[test]
fn mutant_temporal_head_and_concat_keeps_window_are_visible() {
    use crate::faults::Mutant;
    let spec = spec(KvDtype::F32);
    let masks = Masks::new();
    let build = || {
        let mut c = RotatingKvCache::new(spec, 4).unwrap();
        for s in 0..3 {
            let (k, v, q) = kvq(&spec, s, 1, 3);
            c.window(&k, &v, &q, 0.3, &masks).unwrap();
        }
        c
    };
    let good = {
        let _g = testlock::shared();
        let c = build();
        assert_eq!(c.state().len, 6);
        c
    };
    {
        let _m = testlock::arm(Mutant::TemporalHead);
        let (hk, _) = good.temporal_view().unwrap();
        let (pk, _) = good.physical().unwrap();
        assert_same_bytes(&hk, &cols(&pk, 0, 4).unwrap(), "the head");
        assert!(!same_bytes(&hk, &cols(&pk, 2, 6).unwrap()));
    }
    {
        let _m = testlock::arm(Mutant::ConcatKeepsWindow);
        assert_eq!(build().state().len, 7);
    }
    {
        let _m = testlock::arm(Mutant::TrimNoopAfterWrap);
        let mut c = build();
        assert_eq!(c.trim(2, true), Ok(0));
        assert_eq!(c.state().len, 6);
    }
}

/// A ring one position short of its window, at it, and one past it (R-ROT-5, R-ROT-6, R-C-5): trimmable only below
/// `W`, a plain trim there and a typed `NotTrimmable` (state unchanged) from `W` on; the next decode appends below
/// `W` and overwrites the ring head from `W` on. A bypass trim after a window write reaching exactly `W` still works
/// and makes the ring trimmable again. A linear cache is trimmable and appends at every offset.
#[test]
fn ring_boundaries_at_w_minus_one_w_and_w_plus_one() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::F32);
    let masks = Masks::new();
    for w in [2usize, 3, 5] {
        for (offset, trimmable, phase) in
            [(w - 1, true, DecodePhase::Concat), (w, false, DecodePhase::Ring), (w + 1, false, DecodePhase::Ring)]
        {
            let mut c = RotatingKvCache::new(spec, w).unwrap();
            for s in 0..offset {
                let (k, v, q) = kvq(&spec, s as u64, 1, 1);
                c.decode(&k, &v, &q, 0.3, &masks).unwrap();
            }
            let at = format!("W = {w}, offset = {offset}");
            assert_eq!(c.offset(), offset, "{at}");
            assert_eq!(c.is_trimmable(), trimmable, "{at}");
            assert_eq!(c.decode_phase(), phase, "{at}");
            let before = c.state().clone();
            if trimmable {
                assert_eq!(c.trim(1, false), Ok(1), "{at}");
                assert_eq!((c.offset(), c.state().len), (offset - 1, offset - 1), "{at}");
            } else {
                assert_eq!(c.trim(1, false), Err(CacheError::NotTrimmable { offset, max_size: w }), "{at}");
                assert_eq!(c.state().clone(), before, "{at}: a refused trim changes nothing");
                assert!(matches!(c.trim(1, true), Err(CacheError::BypassNotAfterWindow)), "{at}: no window to bypass");
            }
        }
        // A window write that reaches exactly W: not trimmable, but its bypass trim is.
        let mut c = RotatingKvCache::new(spec, w).unwrap();
        let (k, v, q) = kvq(&spec, 9, 1, w);
        c.window(&k, &v, &q, 0.3, &masks).unwrap();
        assert!(!c.is_trimmable(), "W = {w}");
        assert_eq!(c.trim(1, true), Ok(1), "W = {w}");
        assert_eq!(c.offset(), w - 1);
        assert!(c.is_trimmable(), "W = {w}: below the window again");
        assert_eq!(c.decode_phase(), DecodePhase::Concat, "W = {w}");
    }
    let mut linear = KvCache::new(spec).unwrap();
    for s in 0..7 {
        assert!(linear.is_trimmable());
        assert_eq!(linear.decode_phase(), DecodePhase::Concat);
        let (k, v, q) = kvq(&spec, s, 1, 1);
        linear.decode(&k, &v, &q, 0.3, &masks).unwrap();
    }
}

/// Every stored plane of `a` and `b` (the live columns and the temporal view), compared bit for bit through
/// `crate::bytes`.
fn same_planes(a: &SerialCache, b: &SerialCache) -> bool {
    let eq = |x: Vec<Array>, y: Vec<Array>| {
        x.len() == y.len() && x.iter().zip(&y).all(|(p, q)| crate::bytes::bit_equal(p, q).unwrap())
    };
    eq(a.physical_planes().unwrap(), b.physical_planes().unwrap())
        && eq(a.temporal_view_planes().unwrap(), b.temporal_view_planes().unwrap())
}

/// R-ROT-9b: the encoder read keeps the newest `W - 1` stored positions and every block position, even past `W`
/// (the state and bytes of the window write), and each query sees exactly the kept positions within the encoder's
/// own window, which the cache's window does not limit (f64 reference over the positions); a later decode and
/// window continue as after a window write.
#[test]
fn encoder_read_keeps_every_block_position_past_max_size_under_its_own_window() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::F32);
    for w in [Some(1), Some(4), Some(5), None] {
        for enc in [Some(1), Some(3), Some(9), None] {
            let mut c = SerialCache::new(spec, w).unwrap();
            let mut twin = SerialCache::new(spec, w).unwrap();
            let mut h = Hist::default();
            let masks = Masks::new();
            // A wrapped history: a window of 3, then 4 decodes.
            let (k, v, q) = kvq(&spec, 11, 1, 3);
            h.push(&k, &v);
            c.window(&k, &v, &q, 0.3, &masks).unwrap();
            twin.window(&k, &v, &q, 0.3, &masks).unwrap();
            for s in 0..4 {
                let (k, v, q) = kvq(&spec, 20 + s, 1, 1);
                h.push(&k, &v);
                c.decode(&k, &v, &q, 0.3, &masks).unwrap();
                twin.decode(&k, &v, &q, 0.3, &masks).unwrap();
            }
            let before = c.state().clone();
            let l = 7; // past every W here
            let (k, v, q) = kvq(&spec, 40, 1, l);
            h.push(&k, &v);
            let masks = Masks::new();
            let (out, used) = c.encoder_read(&k, &v, &q, 0.3, enc, &masks).unwrap();
            twin.window(&k, &v, &q, 0.3, &Masks::new()).unwrap();
            let kept = w.map_or(before.len, |w| before.len.min(w - 1));
            let expect = RingState { offset: before.offset + l, len: kept + l, idx: kept + l, last_concat: Some(l) };
            assert_eq!(c.state(), &expect, "W={w:?} enc={enc:?}: the state of a window write");
            assert_eq!(c.state(), twin.state());
            assert!(same_planes(&c, &twin), "W={w:?} enc={enc:?}: the bytes of a window write");
            assert!(matches!(used, MaskUse::Array(_)));
            assert_eq!(
                masks.builds_of(&FamilyKey::EncoderWindow { keys: vec![], queries: 0, window: enc }.family()),
                1
            );
            // Query i (position p) sees the kept positions p' <= p with p - p' < enc, never cut at W.
            let (qf, of) = (f32s(&q), f32s(&out));
            let first_kept = before.offset - kept;
            for i in 0..l {
                let p = before.offset + i;
                let vis: Vec<usize> = (first_kept..=p).filter(|&x| enc.is_none_or(|e| p - x < e)).collect();
                if let (Some(w), None) = (w, enc) {
                    assert!(i < w || vis.len() > w, "an unbounded encoder window sees past W");
                }
                let e = expected(&h, &qf, l, i, &vis, spec.heads_kv, spec.head_dim, 0.3);
                for hq in 0..HQ {
                    for x in 0..spec.head_dim {
                        let (got, want) = (of[(hq * l + i) * spec.head_dim + x] as f64, e[hq * spec.head_dim + x]);
                        assert!((got - want).abs() < 1e-4, "W={w:?} enc={enc:?} query {i}: {got} vs {want}");
                    }
                }
            }
            // The next decode and window go exactly as after the window write.
            for s in 0..3 {
                let (k, v, q) = kvq(&spec, 60 + s, 1, 1 + s as usize);
                let a = c.window(&k, &v, &q, 0.3, &Masks::new()).unwrap().0;
                let b = twin.window(&k, &v, &q, 0.3, &Masks::new()).unwrap().0;
                assert!(crate::bytes::bit_equal(&a, &b).unwrap());
                let (k, v, q) = kvq(&spec, 70 + s, 1, 1);
                let a = c.decode(&k, &v, &q, 0.3, &Masks::new()).unwrap().0;
                let b = twin.decode(&k, &v, &q, 0.3, &Masks::new()).unwrap().0;
                assert!(crate::bytes::bit_equal(&a, &b).unwrap());
                assert_eq!(c.state(), twin.state());
                assert!(same_planes(&c, &twin));
            }
        }
    }
}

/// The encoder read's output is the fused SDPA over the live columns under the memoized encoder-window mask, bit
/// for bit; one build per forward however many layers read the same geometry.
#[test]
fn encoder_read_is_fused_sdpa_under_one_memoized_mask() {
    let _g = testlock::shared();
    for dtype in [KvDtype::F32, KvDtype::Bf16] {
        let spec = spec(dtype);
        let masks = Masks::new();
        let mut layers: Vec<SerialCache> = (0..3).map(|_| RotatingKvCache::new(spec, 4).unwrap()).collect();
        for (i, c) in layers.iter_mut().enumerate() {
            let (k, v, q) = kvq(&spec, 5 + i as u64, 1, 6);
            c.window(&k, &v, &q, 0.3, &Masks::new()).unwrap();
        }
        let forward = Masks::new();
        for (i, c) in layers.iter_mut().enumerate() {
            let (k, v, q) = kvq(&spec, 50 + i as u64, 1, 5);
            let (out, used) = c.encoder_read(&k, &v, &q, 0.3, Some(6), &forward).unwrap();
            let key = FamilyKey::EncoderWindow { keys: vec![3 + 5], queries: 5, window: Some(6) };
            let (mspec, arr) = masks.get_family(&key).unwrap();
            assert_eq!(used, MaskUse::Array(mspec.clone()));
            let (kl, vl) = c.physical().unwrap();
            let explicit = attend(&q, &kl, &vl, 0.3, Some((&mspec, &arr)), false).unwrap();
            assert!(crate::bytes::bit_equal(&out, &explicit).unwrap(), "{dtype:?} layer {i}");
        }
        assert_eq!(forward.builds(), 1, "one build for the forward's three layers");
        assert_eq!(forward.builds_of("encoder-window:6"), 1);
    }
}

/// Impossible encoder reads are typed errors and change nothing (state and bytes).
#[test]
fn encoder_read_errors_are_typed_and_change_nothing() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::F32);
    let mut c = RotatingKvCache::new(spec, 4).unwrap();
    let (k, v, q) = kvq(&spec, 1, 1, 6);
    c.window(&k, &v, &q, 0.3, &Masks::new()).unwrap();
    let before = c.clone();
    let masks = Masks::new();
    let (k2, v2, q2) = kvq(&spec, 2, 1, 2);
    let (k3, _, q3) = kvq(&spec, 3, 1, 3);
    let shape_err = |r: Result<(Array, MaskUse)>| matches!(r, Err(CacheError::ShapeMismatch { .. }));
    assert!(shape_err(c.encoder_read(&k2, &v2, &q3, 0.3, None, &masks)), "queries of another length");
    assert!(shape_err(c.encoder_read(&k3, &v2, &q2, 0.3, None, &masks)), "k and v differ");
    let (kb, vb, qb) = kvq(&spec, 4, 2, 2);
    assert!(shape_err(c.encoder_read(&kb, &vb, &qb, 0.3, None, &masks)), "two rows into a serial cache");
    let k0 = data(6, 1, spec.heads_kv, 0, spec.head_dim, spec.dtype);
    assert!(shape_err(c.encoder_read(&k0, &k0, &k0, 0.3, None, &masks)), "an empty block");
    let bf = k2.as_dtype(mlx_rs::Dtype::Bfloat16).unwrap();
    assert!(shape_err(c.encoder_read(&bf, &bf, &q2, 0.3, None, &masks)), "dtype");
    assert!(matches!(c.encoder_read(&k2, &v2, &q2, 0.3, Some(0), &masks), Err(CacheError::InvalidState { .. })));
    assert_eq!(c.state(), before.state(), "errors change nothing");
    assert!(same_planes(&c, &before), "errors change no byte");
    assert_eq!(masks.builds(), 0, "no mask was built for a refused read");
}

/// Keys and values are validated each on its own (R-C-2): a write whose keys are right and values wrong (or the
/// other way round) in dtype, heads, head dim, batch rows or length is refused with `ShapeMismatch`, and the cache
/// (state and every live byte) is unchanged: serial caches (linear and rotating; decode, window, append) and rows. A check that looked at the keys only, and took the values' geometry from them,
/// fails here.
#[test]
fn keys_and_values_are_validated_each_on_its_own() {
    let _g = testlock::shared();
    let sp = spec(KvDtype::Bf16);
    let other = if sp.dtype == KvDtype::Bf16 { KvDtype::F32 } else { KvDtype::Bf16 };
    // Each bad variant of one tensor of `l` positions for `b` rows.
    let bad = |seed: u64, b: usize, l: usize| -> Vec<(&'static str, Array)> {
        vec![
            ("dtype", data(seed, b, sp.heads_kv, l, sp.head_dim, other)),
            ("heads", data(seed, b, sp.heads_kv + 1, l, sp.head_dim, sp.dtype)),
            ("head dim", data(seed, b, sp.heads_kv, l, sp.head_dim + 1, sp.dtype)),
            ("rows", data(seed, b + 1, sp.heads_kv, l, sp.head_dim, sp.dtype)),
            ("length", data(seed, b, sp.heads_kv, l + 1, sp.head_dim, sp.dtype)),
        ]
    };
    // Every (label, keys, values) of a write with exactly one of the two wrong.
    let one_sided = |k: &Array, v: &Array, wrongs: Vec<(&'static str, Array)>| -> Vec<(String, Array, Array)> {
        wrongs
            .into_iter()
            .flat_map(|(which, w)| {
                [
                    (format!("keys wrong ({which})"), w.clone(), v.clone()),
                    (format!("values wrong ({which})"), k.clone(), w),
                ]
            })
            .collect()
    };
    let refused = |r: Result<()>, what: &str| match r {
        Err(CacheError::ShapeMismatch { .. }) => {}
        other => panic!("{what}: {other:?}, expected ShapeMismatch"),
    };
    for max in [None, Some(4)] {
        let mut c = SerialCache::new(sp, max).unwrap();
        let (k, v, q) = kvq(&sp, 1, 1, 5);
        c.window(&k, &v, &q, 0.5, &Masks::new()).unwrap();
        let (state, planes) = (c.state().clone(), c.physical_planes().unwrap());
        for (op, l) in [("decode", 1), ("window", 2), ("append", 2)] {
            let (k, v, q) = kvq(&sp, 7, 1, l);
            for (what, kk, vv) in one_sided(&k, &v, bad(99, 1, l)) {
                let what = format!("W={max:?} {op}: {what}");
                let r = match op {
                    "decode" => c.decode(&kk, &vv, &q, 0.5, &Masks::new()).map(drop),
                    "window" => c.window(&kk, &vv, &q, 0.5, &Masks::new()).map(drop),
                    _ => c.append(&kk, &vv),
                };
                refused(r, &what);
                assert_eq!(c.state(), &state, "{what}: state changed");
                let now = c.physical_planes().unwrap();
                for (a, b) in planes.iter().zip(&now) {
                    assert_eq!(bits(a), bits(b), "{what}: bytes changed");
                }
            }
        }
        // The same for a batch of two rows.
        let rows: Vec<(Array, Array, usize)> = (0..2)
            .map(|r| {
                let (k, v, _) = kvq(&sp, 20 + r, 1, 3 + r as usize);
                (k, v, 3 + r as usize)
            })
            .collect();
        let mut b = crate::RowBatch::merge(sp, max, &rows).unwrap();
        let states = b.row_states().to_vec();
        let before: Vec<_> = (0..2).map(|r| b.row_physical(r).unwrap()).collect();
        for (op, l) in [("decode", 1), ("window", 2)] {
            let (k, v, q) = kvq(&sp, 8, 2, l);
            for (what, kk, vv) in one_sided(&k, &v, bad(98, 2, l)) {
                let what = format!("batch W={max:?} {op}: {what}");
                let r = match op {
                    "decode" => b.decode(&kk, &vv, &q, 0.5, &Masks::new()).map(drop),
                    _ => b.window(&kk, &vv, &q, 0.5, &Masks::new()).map(drop),
                };
                refused(r, &what);
                assert_eq!(b.row_states(), &states[..], "{what}: row states changed");
                for (r, (bk, bv)) in before.iter().enumerate() {
                    let (nk, nv) = b.row_physical(r).unwrap();
                    assert_eq!((bits(bk), bits(bv)), (bits(&nk), bits(&nv)), "{what}: row {r} bytes changed");
                }
            }
        }
    }
}
