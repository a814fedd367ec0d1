//! `SsmCache` on MLX's CPU: batch rows against solo runs (both states and outputs, byte for byte), with left and
//! right padding, merge, filter and extract; replay against a fresh run of the accepted prefix for every keep;
//! typed errors for every misuse with the state unchanged.

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{Array, Dtype};

use super::*;
use crate::testutil::testlock;
use crate::testutil::{assert_same_bytes, bits, pin_cpu, same_bytes};

fn spec(dtype: KvDtype) -> SsmSpec {
    pin_cpu();
    SsmSpec { kernel: 4, heads_k: 2, heads_v: 4, dk: 8, dv: 4, dtype }
}

fn hash(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51afd7ed558ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ceb9fe1a85ec53);
    x ^ (x >> 33)
}

/// A value in `[lo, hi)` from a key.
fn val(key: u64, lo: f32, hi: f32) -> f32 {
    lo + (hash(key) >> 40) as f32 / (1u64 << 24) as f32 * (hi - lo)
}

fn params(spec: &SsmSpec, seed: u64) -> GdnParams {
    let c = spec.conv_dim();
    let w: Vec<f32> = (0..c * spec.kernel).map(|i| val(seed * 7919 + i as u64, -0.6, 0.6)).collect();
    let a_log: Vec<f32> = (0..spec.heads_v).map(|i| val(seed * 31 + 1000 + i as u64, -1.0, 1.0)).collect();
    let dt: Vec<f32> = (0..spec.heads_v).map(|i| val(seed * 37 + 2000 + i as u64, -0.5, 0.5)).collect();
    let d = spec.dtype.to_mlx();
    GdnParams {
        conv_weight: Array::from_slice(&w, &[c as i32, spec.kernel as i32, 1]).as_dtype(d).unwrap(),
        a_log: Array::from_slice(&a_log, &[spec.heads_v as i32]),
        dt_bias: Array::from_slice(&dt, &[spec.heads_v as i32]).as_dtype(d).unwrap(),
    }
}

/// The inputs of request `req` at position `pos` (a pure function of both), or poison for a padded slot.
fn token(spec: &SsmSpec, req: u64, pos: usize, padded: bool) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let key = if padded { 0xdead_0000 ^ (req << 20) ^ pos as u64 } else { (req << 32) ^ pos as u64 };
    let c = spec.conv_dim();
    let scale = if padded { 9.0 } else { 1.0 };
    let qkv = (0..c).map(|i| val(key * 131 + i as u64, -scale, scale)).collect();
    let a = (0..spec.heads_v).map(|i| val(key * 137 + 500 + i as u64, -2.0 * scale, 2.0 * scale)).collect();
    let b = (0..spec.heads_v).map(|i| val(key * 139 + 900 + i as u64, -2.0 * scale, 2.0 * scale)).collect();
    (qkv, a, b)
}

/// One window's inputs: row `r` covers `real[r] = [start, end)` with request `reqs[r]` from position `pos[r]`.
fn inputs(spec: &SsmSpec, reqs: &[u64], pos: &[usize], real: &[(usize, usize)], s: usize) -> (Array, Array, Array) {
    let (mut q, mut a, mut b) = (vec![], vec![], vec![]);
    for (r, &(st, en)) in real.iter().enumerate() {
        for t in 0..s {
            let padded = t < st || t >= en;
            let p = if padded { t } else { pos[r] + t - st };
            let (x, y, z) = token(spec, reqs[r], p, padded);
            q.extend(x);
            a.extend(y);
            b.extend(z);
        }
    }
    let d = spec.dtype.to_mlx();
    let n = real.len() as i32;
    (
        Array::from_slice(&q, &[n, s as i32, spec.conv_dim() as i32]).as_dtype(d).unwrap(),
        Array::from_slice(&a, &[n, s as i32, spec.heads_v as i32]).as_dtype(d).unwrap(),
        Array::from_slice(&b, &[n, s as i32, spec.heads_v as i32]).as_dtype(d).unwrap(),
    )
}

/// Positions `[st, en)` of row `r` of `y [B, S, Hv, Dv]`.
fn out_rows(y: &Array, r: usize, st: usize, en: usize) -> Array {
    y.try_index((r as i32..r as i32 + 1, st as i32..en as i32, .., ..)).unwrap()
}

/// A batch and its solo twins: request ids, positions consumed, and the shared layer weights.
struct Twin {
    spec: SsmSpec,
    params: GdnParams,
    batch: SsmCache,
    solo: Vec<SsmCache>,
    reqs: Vec<u64>,
    pos: Vec<usize>,
    outputs_compared: usize,
    /// The twin's own model of the prepared padding (left, lengths), independent of the batch's.
    pad: Option<(Vec<i64>, Vec<i64>)>,
}

impl Twin {
    fn prepare(&mut self, lengths: &[usize], left: &[usize]) {
        self.batch.prepare(lengths, left).unwrap();
        let left = if left.is_empty() { vec![0; lengths.len()] } else { left.to_vec() };
        self.pad = Some((left.iter().map(|&x| x as i64).collect(), lengths.iter().map(|&x| x as i64).collect()));
    }

    fn finalize(&mut self) {
        self.batch.finalize().unwrap();
        self.pad = None;
    }

    fn filter(&mut self, keep: &[usize]) {
        self.batch.filter(keep).unwrap();
        self.solo = keep.iter().map(|&r| self.solo[r].clone()).collect();
        self.reqs = keep.iter().map(|&r| self.reqs[r]).collect();
        self.pos = keep.iter().map(|&r| self.pos[r]).collect();
        if let Some((l, n)) = self.pad.as_mut() {
            *l = keep.iter().map(|&r| l[r]).collect();
            *n = keep.iter().map(|&r| n[r]).collect();
        }
        self.check("filter");
    }

    fn new(spec: SsmSpec, reqs: &[u64]) -> Self {
        let n = reqs.len();
        Twin {
            spec,
            params: params(&spec, 3),
            batch: SsmCache::new(spec, n).unwrap(),
            solo: (0..n).map(|_| SsmCache::new(spec, 1).unwrap()).collect(),
            reqs: reqs.to_vec(),
            pos: vec![0; n],
            outputs_compared: 0,
            pad: None,
        }
    }

    /// A window of width `s` on the batch (real ranges from its padding) and the real part on each solo twin;
    /// outputs at real positions must be byte-identical.
    fn window(&mut self, s: usize) {
        let real: Vec<(usize, usize)> = match self.pad.as_mut() {
            Some((l, n)) => {
                let p = SsmPadding { left: l.clone(), lengths: n.clone() };
                let real = (0..self.reqs.len()).map(|r| p.real(r, s)).collect();
                l.iter_mut().chain(n.iter_mut()).for_each(|x| *x -= s as i64);
                real
            }
            None => vec![(0, s); self.reqs.len()],
        };
        let (q, a, b) = inputs(&self.spec, &self.reqs, &self.pos, &real, s);
        let y = self.batch.window(&q, &a, &b, &self.params).unwrap();
        for (r, &(st, en)) in real.iter().enumerate() {
            if en == st {
                continue;
            }
            let (sq, sa, sb) = inputs(&self.spec, &self.reqs[r..=r], &self.pos[r..=r], &[(0, en - st)], en - st);
            let sy = self.solo[r].window(&sq, &sa, &sb, &self.params).unwrap();
            assert_same_bytes(&out_rows(&y, r, st, en), &sy, &format!("row {r} outputs"));
            self.outputs_compared += 1;
            self.pos[r] += en - st;
        }
        self.check("window");
    }

    fn decode(&mut self) {
        let n = self.reqs.len();
        let (q, a, b) = inputs(&self.spec, &self.reqs, &self.pos, &vec![(0, 1); n], 1);
        let y = self.batch.decode(&q, &a, &b, &self.params).unwrap();
        for r in 0..n {
            let (sq, sa, sb) = inputs(&self.spec, &self.reqs[r..=r], &self.pos[r..=r], &[(0, 1)], 1);
            let sy = self.solo[r].decode(&sq, &sa, &sb, &self.params).unwrap();
            assert_same_bytes(&out_rows(&y, r, 0, 1), &sy, &format!("row {r} decode output"));
            self.outputs_compared += 1;
            self.pos[r] += 1;
        }
        self.check("decode");
    }

    #[track_caller]
    fn check(&self, what: &str) {
        assert_eq!(self.batch.rows(), self.solo.len(), "{what}: rows");
        for (r, s) in self.solo.iter().enumerate() {
            let (c, rec) = self.batch.row_states(r).unwrap();
            assert_eq!(self.batch.offsets()[r], s.offsets()[0], "{what}: row {r} offset");
            assert_eq!(self.batch.offsets()[r], self.pos[r], "{what}: row {r} offset vs positions fed");
            assert_same_bytes(&c, s.conv(), &format!("{what}: row {r} conv state"));
            assert_same_bytes(&rec, s.recurrent(), &format!("{what}: row {r} recurrent state"));
        }
    }
}

#[test]
fn right_padded_prefill_then_decode_matches_solo_runs() {
    let _g = testlock::shared();
    for dtype in [KvDtype::Bf16, KvDtype::F32] {
        let mut t = Twin::new(spec(dtype), &[1, 2, 3]);
        t.prepare(&[7, 2, 5], &[]);
        t.window(4);
        t.window(4);
        t.finalize();
        assert_eq!(t.batch.offsets(), &[7, 2, 5]);
        for _ in 0..3 {
            t.decode();
        }
        t.window(3);
        assert!(t.outputs_compared >= 15);
    }
}

#[test]
fn left_padded_prefill_matches_solo_runs_and_keeps_history_right() {
    let _g = testlock::shared();
    for dtype in [KvDtype::Bf16, KvDtype::F32] {
        let mut t = Twin::new(spec(dtype), &[4, 5, 6]);
        // mlx-bun's example: lengths [7, 7, 7], left padding [4, 0, 2].
        t.prepare(&[7, 7, 7], &[4, 0, 2]);
        t.window(7);
        t.finalize();
        assert_eq!(t.batch.offsets(), &[3, 7, 5]);
        t.decode();
        // Left padding on rows that already have history: the stream keeps history next to the new tokens.
        t.prepare(&[5, 3, 5], &[2, 0, 4]);
        t.window(3);
        t.window(2);
        t.finalize();
        t.decode();
    }
}

#[test]
fn a_chunk_with_no_real_position_changes_nothing() {
    let _g = testlock::shared();
    // Bug catalog #8's trigger: prompt lengths differ by more than the chunk width.
    let mut t = Twin::new(spec(KvDtype::Bf16), &[7, 8]);
    t.prepare(&[8, 2], &[5, 0]);
    let before = (bits(t.batch.conv()), bits(t.batch.recurrent()));
    t.window(2); // row 0 all padding, row 1 real
    let (c0, r0) = t.batch.row_states(0).unwrap();
    let z = SsmCache::new(t.spec, 1).unwrap();
    assert_same_bytes(&c0, z.conv(), "row 0 conv untouched");
    assert_same_bytes(&r0, z.recurrent(), "row 0 recurrent untouched");
    assert_ne!(before.1, bits(t.batch.recurrent()), "row 1 moved");
    t.window(3);
    t.window(3);
    t.finalize();
    t.decode();
}

#[test]
fn merge_filter_extract_keep_rows_bit_exact() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::Bf16);
    let mut a = Twin::new(spec, &[10, 11]);
    a.window(3);
    a.decode();
    let mut b = Twin::new(spec, &[12]);
    b.window(5);
    let fresh = SsmCache::new(spec, 1).unwrap();
    let merged = SsmCache::merge(spec, &[&a.batch, &fresh, &b.batch]).unwrap();
    assert_eq!(merged.offsets(), &[4, 4, 0, 5]);
    let mut t = Twin {
        spec,
        params: a.params.clone(),
        batch: merged,
        solo: vec![a.solo[0].clone(), a.solo[1].clone(), fresh.clone(), b.solo[0].clone()],
        reqs: vec![10, 11, 13, 12],
        pos: vec![4, 4, 0, 5],
        outputs_compared: 0,
        pad: None,
    };
    t.check("merge");
    t.prepare(&[0, 0, 6, 0], &[]);
    t.window(3);
    t.window(3);
    t.finalize();
    t.decode();
    t.filter(&[3, 0, 2]);
    t.decode();
    for r in 0..3 {
        let e = t.batch.extract(r).unwrap();
        assert_eq!(e.offsets(), t.solo[r].offsets());
        assert_same_bytes(e.conv(), t.solo[r].conv(), "extracted conv");
        assert_same_bytes(e.recurrent(), t.solo[r].recurrent(), "extracted recurrent");
        // The copy's memory is its own: its buffer holds exactly one row.
        assert_eq!(e.recurrent().nbytes(), spec.heads_v * spec.dv * spec.dk * 4);
        let base = unsafe { mlx_sys::mlx_array_data_uint8(t.batch.recurrent().as_ptr()) } as usize;
        let own = unsafe { mlx_sys::mlx_array_data_uint8(e.recurrent().as_ptr()) } as usize;
        assert!(own < base || own >= base + t.batch.recurrent().nbytes(), "extract aliases the batch buffer");
    }
    // Filter errors leave the batch unchanged.
    let before = bits(t.batch.recurrent());
    assert_eq!(t.batch.filter(&[0, 0]), Err(CacheError::DuplicateRow { row: 0 }));
    assert_eq!(t.batch.filter(&[3]), Err(CacheError::NoSuchRow { row: 3, rows: 3 }));
    assert_eq!(bits(t.batch.recurrent()), before);
    t.check("after refused filters");
}

/// A fresh run of row `r`'s accepted prefix from `snapshot` (a one-row cache).
fn fresh_prefix(spec: &SsmSpec, p: &GdnParams, snapshot: &SsmCache, req: u64, pos: usize, keep: usize) -> SsmCache {
    let mut c = snapshot.clone();
    if keep > 0 {
        let (q, a, b) = inputs(spec, &[req], &[pos], &[(0, keep)], keep);
        c.window(&q, &a, &b, p).unwrap();
    }
    c
}

#[test]
fn rollback_replays_exactly_the_accepted_prefix_for_every_keep() {
    let _g = testlock::shared();
    for dtype in [KvDtype::Bf16, KvDtype::F32] {
        let spec = spec(dtype);
        let l = 5;
        let mut base = Twin::new(spec, &[20, 21, 22]);
        base.window(3);
        base.decode();
        for shift in 0..=l {
            // Unequal per-row keeps covering 0..=L across the rows and shifts.
            let keeps: Vec<usize> = (0..3).map(|r| (shift + 2 * r) % (l + 1)).collect();
            let mut t = base.clone_meta();
            t.batch.spec_round_begin().unwrap();
            let (q, a, b) = inputs(&spec, &t.reqs, &t.pos, &[(0, l); 3], l);
            let y = t.batch.window(&q, &a, &b, &t.params).unwrap();
            t.batch.spec_round_rollback_rows(&keeps).unwrap();
            assert!(!t.batch.in_round());
            for r in 0..3 {
                let fresh = fresh_prefix(&spec, &t.params, &t.solo[r], t.reqs[r], t.pos[r], keeps[r]);
                let (c, rec) = t.batch.row_states(r).unwrap();
                assert_eq!(t.batch.offsets()[r], fresh.offsets()[0], "keep {}: offset", keeps[r]);
                assert_same_bytes(&c, fresh.conv(), &format!("keep {}: conv", keeps[r]));
                assert_same_bytes(&rec, fresh.recurrent(), &format!("keep {}: recurrent", keeps[r]));
                if keeps[r] > 0 {
                    // The verify outputs of the accepted prefix equal the fresh prefix run's outputs.
                    let (sq, sa, sb) = inputs(&spec, &[t.reqs[r]], &[t.pos[r]], &[(0, keeps[r])], keeps[r]);
                    let sy = t.solo[r].clone().window(&sq, &sa, &sb, &t.params).unwrap();
                    assert_same_bytes(&out_rows(&y, r, 0, keeps[r]), &sy, "verify outputs of the accepted prefix");
                }
                if keeps[r] == 0 {
                    assert_same_bytes(&rec, &base.batch.row_states(r).unwrap().1, "keep 0 restores");
                }
            }
            // The same keep for every row (scalar rollback) too.
            let mut s = base.batch.clone();
            s.spec_round_begin().unwrap();
            s.window(&q, &a, &b, &t.params).unwrap();
            s.spec_round_rollback(shift).unwrap();
            for r in 0..3 {
                let fresh = fresh_prefix(&spec, &t.params, &base.solo[r], t.reqs[r], t.pos[r], shift);
                assert_same_bytes(&s.row_states(r).unwrap().1, fresh.recurrent(), "scalar keep recurrent");
                assert_same_bytes(&s.row_states(r).unwrap().0, fresh.conv(), "scalar keep conv");
            }
            assert_eq!(s.stats().replays, u64::from(shift > 0));
        }
    }
}

impl Twin {
    fn clone_meta(&self) -> Twin {
        Twin {
            spec: self.spec,
            params: self.params.clone(),
            batch: self.batch.clone(),
            solo: self.solo.clone(),
            reqs: self.reqs.clone(),
            pos: self.pos.clone(),
            outputs_compared: 0,
            pad: self.pad.clone(),
        }
    }
}

#[test]
fn commit_keeps_the_verified_state() {
    let _g = testlock::shared();
    let mut t = Twin::new(spec(KvDtype::Bf16), &[30, 31]);
    t.window(2);
    t.batch.spec_round_begin().unwrap();
    t.window(4); // the solo twins run the same 4 positions without a round
    t.batch.spec_round_commit().unwrap();
    t.check("commit");
    t.decode();
}

fn snapshot(c: &SsmCache) -> (Vec<u32>, Vec<u32>, Vec<usize>, bool, bool) {
    (bits(c.conv()), bits(c.recurrent()), c.offsets().to_vec(), c.in_round(), c.round_recorded())
}

#[test]
fn every_misuse_is_a_typed_error_with_the_state_unchanged() {
    let _g = testlock::shared();
    let spec = spec(KvDtype::Bf16);
    let p = params(&spec, 3);
    let mut c = SsmCache::new(spec, 2).unwrap();
    let (q, a, b) = inputs(&spec, &[1, 2], &[0, 0], &[(0, 3); 2], 3);
    c.window(&q, &a, &b, &p).unwrap();
    let s0 = snapshot(&c);
    assert_eq!(c.trim(1), Err(CacheError::RecurrentNotTrimmable));
    assert!(!c.is_trimmable());
    assert_eq!(c.bytes_per_token(), 0);
    assert_eq!(c.storage_kind().as_str(), "ssm");
    assert_eq!(c.spec_round_commit(), Err(CacheError::NoSpecRound));
    assert_eq!(c.spec_round_rollback(1), Err(CacheError::NoSpecRound));
    assert_eq!(c.finalize(), Err(CacheError::NoPendingPrefill));
    assert_eq!(snapshot(&c), s0);
    // Bad shapes and dtypes.
    let (q1, a1, b1) = inputs(&spec, &[1], &[0], &[(0, 3)], 3);
    assert!(matches!(c.window(&q1, &a1, &b1, &p), Err(CacheError::ShapeMismatch { .. })));
    assert!(matches!(c.decode(&q, &a, &b, &p), Err(CacheError::ShapeMismatch { .. })));
    let qf = q.as_dtype(Dtype::Float32).unwrap();
    assert!(matches!(c.window(&qf, &a, &b, &p), Err(CacheError::ShapeMismatch { .. })));
    let bad_p = GdnParams { a_log: Array::from_slice(&[0.0f32; 3], &[3]), ..p.clone() };
    assert!(matches!(c.window(&q, &a, &b, &bad_p), Err(CacheError::ShapeMismatch { .. })));
    assert_eq!(snapshot(&c), s0);
    // Padding errors.
    assert!(matches!(c.prepare(&[3], &[]), Err(CacheError::BadLengths { .. })));
    assert!(matches!(c.prepare(&[3, 3], &[4, 0]), Err(CacheError::BadLengths { .. })));
    assert_eq!(snapshot(&c), s0);
    // Rounds.
    c.spec_round_begin().unwrap();
    let s1 = snapshot(&c);
    assert_eq!(c.spec_round_begin(), Err(CacheError::SpecRoundActive));
    assert_eq!(c.spec_round_rollback(0), Err(CacheError::SpecRoundNotRecorded));
    assert_eq!(c.filter(&[0]), Err(CacheError::SpecRoundActive));
    assert!(matches!(c.extract(0), Err(CacheError::SpecRoundActive)));
    assert_eq!(c.prepare(&[1, 1], &[]), Err(CacheError::SpecRoundActive));
    assert!(matches!(SsmCache::merge(spec, &[&c]), Err(CacheError::SpecRoundActive)));
    assert_eq!(snapshot(&c), s1);
    let (q4, a4, b4) = inputs(&spec, &[1, 2], &[3, 3], &[(0, 4); 2], 4);
    c.window(&q4, &a4, &b4, &p).unwrap();
    let s2 = snapshot(&c);
    assert_eq!(c.window(&q4, &a4, &b4, &p).err(), Some(CacheError::SpecRoundAlreadyRecorded));
    assert_eq!(c.spec_round_rollback(5), Err(CacheError::KeepOutsideWindow { keep: 5, window: 4 }));
    assert_eq!(c.spec_round_rollback_rows(&[1, 5]), Err(CacheError::KeepOutsideWindow { keep: 5, window: 4 }));
    assert!(matches!(c.spec_round_rollback_rows(&[1]), Err(CacheError::BadLengths { .. })));
    assert_eq!(snapshot(&c), s2);
    c.spec_round_rollback_rows(&[0, 0]).unwrap();
    assert_eq!(snapshot(&c), (s0.0.clone(), s0.1.clone(), s0.2.clone(), false, false), "keep 0 = snapshot");
    // A round cannot start inside a prefill; decode is refused while one is pending; merge refuses mixed specs.
    c.prepare(&[2, 2], &[]).unwrap();
    assert_eq!(c.spec_round_begin(), Err(CacheError::PendingPrefill));
    let (qd, ad, bd) = inputs(&spec, &[1, 2], &[3, 3], &[(0, 1); 2], 1);
    assert_eq!(c.decode(&qd, &ad, &bd, &p).err(), Some(CacheError::PendingPrefill));
    assert!(matches!(c.extract(0), Err(CacheError::PendingPrefill)));
    let other = SsmCache::new(SsmSpec { kernel: 3, ..spec }, 1).unwrap();
    c.finalize().unwrap();
    assert!(matches!(SsmCache::merge(spec, &[&c, &other]), Err(CacheError::ShapeMismatch { .. })));
    assert!(matches!(SsmCache::new(SsmSpec { heads_v: 3, ..spec }, 1), Err(CacheError::InvalidState { .. })));
    assert_eq!(snapshot(&c), s0);
}

#[test]
fn padded_positions_never_touch_the_state_even_with_poison() {
    let _g = testlock::shared();
    // Poison at padded slots is large (|x| up to 9); the state must still equal an unpadded run's bytes.
    let mut t = Twin::new(spec(KvDtype::F32), &[40, 41]);
    t.prepare(&[6, 4], &[3, 1]);
    t.window(6);
    t.finalize();
    assert!(!same_bytes(t.batch.conv(), &SsmCache::new(t.spec, 2).unwrap().conv().clone()));
}

#[cfg(feature = "faults")]
#[test]
fn planted_bugs_change_bytes_or_offsets() {
    use crate::faults::Mutant;
    // Each SSM mutant, armed, makes a scenario that passes above diverge from its solo twins.
    let scenario = |m: Mutant| -> bool {
        let _a = testlock::arm(m);
        let spec = spec(KvDtype::F32);
        let mut t = Twin::new(spec, &[50, 51]);
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            t.prepare(&[5, 3], &[2, 0]);
            if m == Mutant::SsmFilterShiftsEmptyPadding {
                t.filter(&[0]);
            }
            t.window(5);
            t.finalize();
            t.batch.spec_round_begin().unwrap();
            let n = t.reqs.len();
            let (q, a, b) = inputs(&spec, &t.reqs, &t.pos, &vec![(0, 3); n], 3);
            t.batch.window(&q, &a, &b, &t.params).unwrap();
            let keeps: Vec<usize> = (0..n).map(|r| 1 + r).collect();
            t.batch.spec_round_rollback_rows(&keeps).unwrap();
            for r in 0..n {
                let fresh = fresh_prefix(&spec, &t.params, &t.solo[r], t.reqs[r], t.pos[r], keeps[r]);
                t.solo[r] = fresh;
                t.pos[r] += keeps[r];
            }
            t.check("after rollback");
        }));
        run.is_err()
    };
    for &m in Mutant::ALL.iter().filter(|m| m.layout() == "ssm") {
        assert!(scenario(m), "{m} went unnoticed");
    }
}

/// A committed span: the positions go through the recurrence one step at a time, so outputs and both states are
/// byte-identical to single decodes (f32 and bf16, K = 4 conv tails through and past the kernel). Refused before any
/// change inside an armed round, with a prefill pending, or with inputs of another shape.
#[test]
fn commit_span_is_single_decodes_byte_for_byte_and_refusals_change_nothing() {
    let _g = testlock::shared();
    for dtype in [KvDtype::F32, KvDtype::Bf16] {
        let spec = spec(dtype);
        let p = params(&spec, 5);
        let mut span = SsmCache::new(spec, 2).unwrap();
        let (q, a, b) = inputs(&spec, &[7, 8], &[0, 0], &[(0, 2); 2], 2);
        span.window(&q, &a, &b, &p).unwrap();
        let mut steps = span.clone();
        for (pos, l) in [(2usize, 5usize), (7, 1), (8, 3)] {
            let (q, a, b) = inputs(&spec, &[7, 8], &[pos, pos], &[(0, l); 2], l);
            let y = span.commit_span(&q, &a, &b, &p).unwrap();
            let mut ys = vec![];
            for t in 0..l {
                let (q1, a1, b1) = inputs(&spec, &[7, 8], &[pos + t, pos + t], &[(0, 1); 2], 1);
                ys.push(steps.decode(&q1, &a1, &b1, &p).unwrap());
            }
            let want = mlx_rs::ops::concatenate(&ys, 1).unwrap();
            assert_eq!(y.shape(), want.shape());
            assert_eq!(bits(&y), bits(&want), "{dtype:?} span of {l} at {pos}: outputs");
            assert_eq!(snapshot(&span), snapshot(&steps), "{dtype:?} span of {l} at {pos}: states");
        }
        // Refusals.
        let s0 = snapshot(&span);
        let (q2, a2, b2) = inputs(&spec, &[7, 8], &[11, 11], &[(0, 2); 2], 2);
        let (q1, a1, b1) = inputs(&spec, &[7], &[11], &[(0, 2)], 2);
        assert!(matches!(span.commit_span(&q1, &a1, &b1, &p), Err(CacheError::ShapeMismatch { .. })));
        span.spec_round_begin().unwrap();
        assert_eq!(span.commit_span(&q2, &a2, &b2, &p).err(), Some(CacheError::SpecRoundActive));
        span.spec_round_commit().unwrap(); // nothing was recorded: the state is the pre-round one
        let mut fresh = steps.clone();
        fresh.prepare(&[2, 2], &[]).unwrap();
        let before = snapshot(&fresh);
        assert_eq!(fresh.commit_span(&q2, &a2, &b2, &p).err(), Some(CacheError::PendingPrefill));
        assert_eq!(snapshot(&fresh), before);
        assert_eq!(snapshot(&span), s0);
    }
}

/// `state_bytes_per_row` is the bytes one row's state really occupies: the conv tail's `K - 1` rows of `conv_dim` in
/// the input dtype plus the f32 recurrent state (a cargo-mutants survivor: no cache method calls it).
#[test]
fn state_bytes_per_row_is_what_a_row_holds() {
    pin_cpu();
    for dtype in [KvDtype::F32, KvDtype::Bf16] {
        let s = spec(dtype);
        let c = SsmCache::new(s, 1).unwrap();
        let held: usize = [c.conv(), c.recurrent()].iter().map(|a| a.nbytes()).sum();
        assert_eq!(s.state_bytes_per_row(), held, "{dtype:?}");
        let by_hand = (4 - 1) * (2 * 2 * 8 + 4 * 4) * dtype.itemsize() + 4 * 4 * 8 * 4;
        assert_eq!(s.state_bytes_per_row(), by_hand);
    }
}

/// `from_states` refuses a conv state whose shape is wrong even in the right dtype, and one whose dtype is wrong even
/// in the right shape, with a typed error (a cargo-mutants survivor: `||` -> `&&` accepted either).
#[test]
fn from_states_refuses_a_wrong_shape_or_a_wrong_dtype_alone() {
    pin_cpu();
    let s = spec(KvDtype::F32);
    let rec = || mlx_rs::ops::zeros_dtype(&[1, 4, 4, 8], Dtype::Float32).unwrap();
    let conv = |shape: &[i32], dt: Dtype| mlx_rs::ops::zeros_dtype(shape, dt).unwrap();
    assert!(SsmCache::from_states(s, conv(&[1, 3, 48], Dtype::Float32), rec(), vec![0]).is_ok());
    for (shape, dt) in [([1, 2, 48], Dtype::Float32), ([1, 3, 48], Dtype::Bfloat16)] {
        let r = SsmCache::from_states(s, conv(&shape, dt), rec(), vec![0]);
        assert!(matches!(r, Err(CacheError::ShapeMismatch { .. })), "{shape:?} {dt:?}: {:?}", r.err());
    }
}
