//! Documented contracts of `src/cache` that `cargo mutants` found untested (see docs/cargo-mutants.md): which mask a
//! read uses, capacity growth, `adopt`'s checks, getters. Each test names the surviving mutant it kills.

use kvsim::cache::ring::GROW_STEP;
use kvsim::cache::{JoinSource, KvDtype, KvSpec, MaskUse, Masks, RingState, RowBatch, RowState, SerialCache};
use kvsim::reference::Tok;

use crate::common::Payload;

const SPEC: KvSpec = KvSpec { heads_kv: 2, head_dim: 4, dtype: KvDtype::F32 };

fn payload() -> Payload {
    Payload::new(SPEC, 2, 5)
}

fn toks(req: u32, from: usize, n: usize) -> Vec<Option<Tok>> {
    (from..from + n).map(|p| Some(Tok { req, pos: p as u32 })).collect()
}

/// The next `l` positions of every row (row `r` is request `r`).
fn block(p: &Payload, b: &RowBatch, l: usize) -> (mlx_rs::Array, mlx_rs::Array, mlx_rs::Array) {
    let rows: Vec<Vec<Option<Tok>>> =
        b.row_states().iter().enumerate().map(|(r, s)| toks(r as u32, s.ring.offset, l)).collect();
    p.kvq(&rows)
}

fn serial(p: &Payload, w: Option<usize>, req: u32, n: usize) -> SerialCache {
    let mut c = SerialCache::new(SPEC, w).unwrap();
    if n > 0 {
        let (k, v, q) = p.kvq(&[toks(req, 0, n)]);
        c.window(&k, &v, &q, p.scale(), &Masks::new()).unwrap();
    }
    c
}

/// A batch decode reads with no mask when every row has the same `len`, with the mask `c < len_r` otherwise
/// (kills `read_decode`: `==` -> `!=`, which masks every read).
#[test]
fn decode_uses_no_mask_for_equal_rows_and_a_mask_for_unequal_rows() {
    let p = payload();
    for w in [Some(4), None] {
        let solo = [serial(&p, w, 0, 2), serial(&p, w, 1, 2)];
        let sources: Vec<JoinSource> = solo.iter().map(JoinSource::Serial).collect();
        let mut b = RowBatch::join(SPEC, w, &sources).unwrap();
        let (k, v, q) = block(&p, &b, 1);
        assert_eq!(b.decode(&k, &v, &q, p.scale(), &Masks::new()).unwrap().1, MaskUse::None, "equal rows, W={w:?}");
        let one = [serial(&p, w, 0, 1)];
        let mut single = RowBatch::join(SPEC, w, &[JoinSource::Serial(&one[0])]).unwrap();
        let (k, v, q) = block(&p, &single, 1);
        assert_eq!(single.decode(&k, &v, &q, p.scale(), &Masks::new()).unwrap().1, MaskUse::None, "one row, W={w:?}");
        let solo = [serial(&p, w, 0, 3), serial(&p, w, 1, 1)];
        let sources: Vec<JoinSource> = solo.iter().map(JoinSource::Serial).collect();
        let mut b = RowBatch::join(SPEC, w, &sources).unwrap();
        let (k, v, q) = block(&p, &b, 1);
        assert!(
            matches!(b.decode(&k, &v, &q, p.scale(), &Masks::new()).unwrap().1, MaskUse::Array(_)),
            "unequal rows, W={w:?}"
        );
    }
}

/// A batch window read uses MLX's `Causal` when every row stores the whole block, rows have equal `len` and the
/// window does not bind; an explicit mask otherwise (kills `window`: `real == l` -> `!=`).
#[test]
fn window_uses_causal_exactly_when_rows_agree_and_the_window_does_not_bind() {
    let p = payload();
    let mut b = RowBatch::with_rows(SPEC, Some(8), 2).unwrap();
    let (k, v, q) = block(&p, &b, 3);
    assert_eq!(b.window(&k, &v, &q, p.scale(), &Masks::new()).unwrap().1, MaskUse::Causal);
    let (k, v, q) = block(&p, &b, 3);
    assert_eq!(b.window(&k, &v, &q, p.scale(), &Masks::new()).unwrap().1, MaskUse::Causal, "len 6 <= W 8");
    let (k, v, q) = block(&p, &b, 3);
    assert!(
        matches!(b.window(&k, &v, &q, p.scale(), &Masks::new()).unwrap().1, MaskUse::Array(_)),
        "len 9 > W 8: the window binds"
    );
    // A right-padded chunk (rows store 3 and 1 positions) is never plain causal.
    let mut pre = RowBatch::with_rows(SPEC, None, 2).unwrap();
    pre.prepare(&[3, 1]).unwrap();
    let (k, v, q) = block(&p, &pre, 3);
    assert!(matches!(pre.window(&k, &v, &q, p.scale(), &Masks::new()).unwrap().1, MaskUse::Array(_)));
}

/// Buffers grow by `GROW_STEP` columns (kills `ensure_capacity`: `new_cap - cap` -> `+`).
#[test]
fn linear_batch_capacity_grows_in_steps() {
    let p = payload();
    let mut b = RowBatch::with_rows(SPEC, None, 2).unwrap();
    let (k, v, _) = block(&p, &b, 3);
    b.append(&k, &v).unwrap();
    assert_eq!(b.cap(), 3, "a window write leaves exactly the columns it needs");
    let (k, v, q) = block(&p, &b, 1);
    b.decode(&k, &v, &q, p.scale(), &Masks::new()).unwrap();
    assert_eq!(b.cap(), 3 + GROW_STEP, "one step of growth");
    for _ in 0..3 {
        let (k, v, q) = block(&p, &b, 1);
        b.decode(&k, &v, &q, p.scale(), &Masks::new()).unwrap();
    }
    assert_eq!(b.cap(), 3 + GROW_STEP, "no growth while the columns fit");
    // Rings never grow past W by decodes.
    let solo = [serial(&p, Some(4), 0, 2)];
    let mut r = RowBatch::join(SPEC, Some(4), &[JoinSource::Serial(&solo[0])]).unwrap();
    for _ in 0..6 {
        let (k, v, q) = block(&p, &r, 1);
        r.decode(&k, &v, &q, p.scale(), &Masks::new()).unwrap();
    }
    assert_eq!(r.cap(), 4);
}

/// `adopt` accepts rows that fill the buffer exactly and refuses rows longer than the buffer, and a base beyond
/// the offset (kills `adopt`: `len > cap` -> `==` / `>=`).
#[test]
fn adopt_checks_lengths_against_the_buffer() {
    let p = payload();
    let solo = [serial(&p, Some(4), 0, 3), serial(&p, Some(4), 1, 1)];
    let sources: Vec<JoinSource> = solo.iter().map(JoinSource::Serial).collect();
    let b = RowBatch::join(SPEC, Some(4), &sources).unwrap();
    let (k, v) = b.buffers().unwrap();
    assert_eq!(b.cap(), 3);
    let states = b.row_states().to_vec();
    let adopted =
        RowBatch::adopt(SPEC, Some(4), k.clone(), v.clone(), states.clone()).expect("row 0 fills the buffer exactly");
    assert_eq!(adopted.row_states(), &states[..]);
    let mut long = states.clone();
    long[1] = RowState { ring: RingState { offset: 9, len: 4, idx: 4, last_concat: None }, base: 5, pending: None };
    assert!(matches!(
        RowBatch::adopt(SPEC, Some(4), k.clone(), v.clone(), long),
        Err(kvsim::cache::CacheError::InvalidState { .. })
    ));
    let mut base = states;
    base[1].base = base[1].ring.offset + 1;
    assert!(matches!(RowBatch::adopt(SPEC, Some(4), k, v, base), Err(kvsim::cache::CacheError::InvalidState { .. })));
}

/// Getters and the debug form (kills `max_size -> Some(0)`, `Debug::fmt -> Ok(())`).
#[test]
fn getters_and_debug_name_the_batch() {
    for w in [Some(3), None] {
        let b = RowBatch::with_rows(SPEC, w, 2).unwrap();
        assert_eq!(b.max_size(), w);
        assert_eq!(b.spec(), SPEC);
        let d = format!("{b:?}");
        assert!(d.starts_with("RowBatch") && d.contains("max_size") && d.contains("rows"), "{d}");
        let s = SerialCache::new(SPEC, w).unwrap();
        assert_eq!(s.max_size(), w);
        let d = format!("{s:?}");
        assert!(d.starts_with("SerialCache") && d.contains("state"), "{d}");
    }
}

/// Serial buffers grow by whole `GROW_STEP`s beyond what they hold (kills `grown_capacity`: `needed - cap` -> `+`,
/// and `SerialCache::ensure_capacity`: `new_cap - cap` -> `+`), and `buffers` hands them out.
#[test]
fn serial_capacity_grows_in_steps_and_buffers_are_handed_out() {
    let p = Payload::new(KvSpec { heads_kv: 1, head_dim: 4, dtype: KvDtype::Bf16 }, 1, 9);
    let mut c = SerialCache::new(p.spec, None).unwrap();
    assert!(c.buffers().is_none(), "nothing written yet");
    let (k, v, _) = p.kvq(&[toks(0, 0, 300)]);
    c.append(&k, &v).unwrap();
    assert_eq!(c.cap(), 2 * GROW_STEP);
    let (k, v, _) = p.kvq(&[toks(0, 300, 300)]);
    c.append(&k, &v).unwrap();
    assert_eq!(c.cap(), 3 * GROW_STEP, "600 columns fit in one more step");
    let (bk, bv) = c.buffers().expect("buffers after writes");
    assert_eq!(bk.shape(), &[1, 1, 3 * GROW_STEP as i32, 4]);
    assert_eq!(bv.shape(), bk.shape());
    assert_eq!(c.rope_offset(), 600);
}

/// Windows above `i32::MAX` are refused (kills `validate_max_size`'s guard -> `false`).
#[test]
fn windows_beyond_i32_are_invalid() {
    let w = i32::MAX as usize + 1;
    assert!(matches!(SerialCache::new(SPEC, Some(w)), Err(kvsim::cache::CacheError::InvalidState { .. })));
    assert!(matches!(RowBatch::with_rows(SPEC, Some(w), 1), Err(kvsim::cache::CacheError::InvalidState { .. })));
    assert!(SerialCache::new(SPEC, Some(i32::MAX as usize)).is_ok());
}

/// A batch that holds no column has no buffers, however it was built (kills `stack_rows`: `||` -> `&&`, and
/// `adopt`: `||` -> `&&`).
#[test]
fn batches_without_columns_have_no_buffers() {
    let empty = [SerialCache::new(SPEC, Some(4)).unwrap(), SerialCache::new(SPEC, Some(4)).unwrap()];
    let sources: Vec<JoinSource> = empty.iter().map(JoinSource::Serial).collect();
    let b = RowBatch::join(SPEC, Some(4), &sources).unwrap();
    assert_eq!(b.rows(), 2);
    assert!(b.buffers().is_none(), "join of empty rows");
    let z = mlx_rs::ops::zeros_dtype(&[2, 2, 0, 4], mlx_rs::Dtype::Float32).unwrap();
    let a = RowBatch::adopt(SPEC, Some(4), z.clone(), z, vec![RowState::default(); 2]).unwrap();
    assert!(a.buffers().is_none(), "adopt of zero-width buffers");
    assert_eq!(a.cap(), 0);
}

/// `RingState::validate` refuses a window history (`last_concat`) the buffer cannot hold: longer than `len`, or on
/// a rotated ring (kills `validate`: `l > len || idx != len` -> `&&`).
#[test]
fn validate_refuses_impossible_window_histories() {
    let ok = RingState { offset: 5, len: 3, idx: 3, last_concat: Some(3) };
    assert_eq!(ok.validate(Some(4)), Ok(()));
    let longer = RingState { last_concat: Some(4), ..ok.clone() };
    assert!(matches!(longer.validate(Some(4)), Err(kvsim::cache::CacheError::InvalidState { .. })));
    let rotated = RingState { offset: 6, len: 4, idx: 2, last_concat: Some(1) };
    assert!(matches!(rotated.validate(Some(4)), Err(kvsim::cache::CacheError::InvalidState { .. })));
    assert_eq!(RingState { last_concat: None, ..rotated }.validate(Some(4)), Ok(()));
}

/// `KvSpec::bytes_per_token` is the plain cost `2 * H_kv * D * itemsize` (R-C-4), and what a plain serial cache
/// reports. cargo-mutants found it untested (docs/cargo-mutants.md, "All of src/cache").
#[test]
fn spec_bytes_per_token_is_the_plain_cost() {
    for (dtype, item) in [(KvDtype::F32, 4), (KvDtype::Bf16, 2)] {
        let spec = KvSpec { heads_kv: 3, head_dim: 8, dtype };
        assert_eq!(spec.bytes_per_token(), 2 * 3 * 8 * item);
        let c = SerialCache::new(spec, None).unwrap();
        assert_eq!(c.bytes_per_token(), spec.bytes_per_token());
    }
}
