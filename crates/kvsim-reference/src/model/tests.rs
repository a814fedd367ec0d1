use super::*;
use proptest::prelude::*;

const R: u32 = 0;

fn t(pos: u32) -> Tok {
    Tok::new(R, pos)
}

fn positions(toks: &[Tok]) -> Vec<u32> {
    toks.iter().map(|t| t.pos).collect()
}

fn decode(m: &mut RowModel) -> usize {
    let p = m.offset as u32;
    m.try_decode_write(t(p)).unwrap()
}

fn window(m: &mut RowModel, l: u32) -> usize {
    let p = m.offset as u32;
    let toks: Vec<Tok> = (p..p + l).map(t).collect();
    m.try_window_write(&toks).unwrap()
}

// ---- R-ROT-2: the ring rotates; idx = written column + 1 ----
#[test]
fn decode_fills_then_rotates() {
    let mut m = RowModel::new(Some(3));
    let cols: Vec<usize> = (0..8).map(|_| decode(&mut m)).collect();
    assert_eq!(cols, vec![0, 1, 2, 0, 1, 2, 0, 1]);
    assert_eq!(positions(&m.cols), vec![6, 7, 5]);
    assert_eq!(m.idx, 2);
    assert_eq!(m.offset, 8);
    assert_eq!(positions(&m.temporal()), vec![5, 6, 7]);
    assert!(m.decode_phase_is_ring());
    m.check().unwrap();
}

#[test]
fn linear_cache_appends_forever() {
    let mut m = RowModel::new(None);
    for i in 0..20 {
        assert_eq!(decode(&mut m), i);
        assert!(!m.decode_phase_is_ring());
    }
    window(&mut m, 5);
    assert_eq!(m.len(), 25);
    assert_eq!(m.decode_visible().len(), 25);
    assert_eq!(m.window_visible(5, 0).len(), 21);
    m.check().unwrap();
}

// ---- R-ROT-3 / bug catalog F: the plateau W - 1 + L ----
#[test]
fn window_writes_plateau_at_w_minus_1_plus_l() {
    let mut m = RowModel::new(Some(4));
    for _ in 0..6 {
        window(&mut m, 3);
        assert!(m.len() <= 4 - 1 + 3);
        m.check().unwrap();
    }
    assert_eq!(m.len(), 6, "plateau W - 1 + L");
    assert_eq!(m.idx, 6);
    assert_eq!(m.last_concat, Some(3));
    assert_eq!(positions(&m.cols), (12..18).collect::<Vec<_>>(), "temporal order after a window write");
    // A one-position window also concatenates (the read picks the path).
    window(&mut m, 1);
    assert_eq!(positions(&m.cols), vec![15, 16, 17, 18]);
    assert_eq!(m.last_concat, Some(1));
}

// ---- R-ROT-2 step 1: decode after a window cuts back to W and writes column 0 ----
#[test]
fn decode_after_window_trims_to_w_and_writes_column_0() {
    let mut m = RowModel::new(Some(4));
    window(&mut m, 7);
    assert_eq!(m.len(), 7);
    assert!(m.decode_phase_is_ring());
    assert_eq!(decode(&mut m), 0);
    assert_eq!(positions(&m.cols), vec![7, 4, 5, 6]);
    assert_eq!(m.idx, 1);
    assert_eq!(m.last_concat, None);
    assert_eq!(decode(&mut m), 1);
    assert_eq!(positions(&m.cols), vec![7, 8, 5, 6]);
    m.check().unwrap();
    // Window write of a rotated ring: temporal order [idx, len) ++ [0, idx), keep newest W - 1.
    window(&mut m, 2);
    assert_eq!(positions(&m.cols), vec![6, 7, 8, 9, 10]);
    // A window write that lands exactly at W: the next decode overwrites column 0.
    let mut m = RowModel::new(Some(4));
    window(&mut m, 4);
    assert_eq!(decode(&mut m), 0);
    assert_eq!(positions(&m.cols), vec![4, 1, 2, 3]);
}

// ---- R-ROT-4: temporal_view is the tail ----
#[test]
fn temporal_view_is_the_tail_never_the_head() {
    let mut m = RowModel::new(Some(4));
    window(&mut m, 3);
    window(&mut m, 3);
    assert_eq!(positions(&m.cols), vec![0, 1, 2, 3, 4, 5]);
    assert_eq!(positions(&m.temporal_view()), vec![2, 3, 4, 5], "the newest W positions");
    let mut short = RowModel::new(Some(8));
    window(&mut short, 3);
    assert_eq!(positions(&short.temporal_view()), vec![0, 1, 2]);
}

// ---- R-C-2: visibility by position ----
#[test]
fn window_visibility_is_causal_and_windowed() {
    let mut m = RowModel::new(Some(4));
    for _ in 0..5 {
        decode(&mut m);
    }
    window(&mut m, 3); // keeps 3 of [1..5), appends 5, 6, 7
    assert_eq!(positions(&m.cols), vec![2, 3, 4, 5, 6, 7]);
    let vis = |i| m.window_visible(3, i).iter().map(|&c| m.cols[c].pos).collect::<Vec<_>>();
    assert_eq!(vis(0), vec![2, 3, 4, 5]);
    assert_eq!(vis(1), vec![3, 4, 5, 6]);
    assert_eq!(vis(2), vec![4, 5, 6, 7]);
    assert!(m.window_visible(3, 3).is_empty(), "no such query");
    assert_eq!(m.decode_visible(), vec![2, 3, 4, 5], "columns of positions 4..=7");
}

// ---- R-C-5 / R-ROT-6: trim legality ----
#[test]
fn trim_rules() {
    let mut m = RowModel::new(Some(4));
    window(&mut m, 3);
    assert!(m.is_trimmable());
    assert_eq!(m.trim(4, false), Err(ModelError::TrimTooLong));
    m.trim(2, false).unwrap();
    assert_eq!((m.offset, m.len(), m.idx), (1, 1, 1));
    assert_eq!(m.last_concat, None, "a plain trim ends the window history (only a bypass rollback keeps it)");
    decode(&mut m);
    assert_eq!(m.trim(1, true), Err(ModelError::BypassNotAfterWindow), "bypass needs a window last");
    for _ in 0..3 {
        decode(&mut m);
    }
    assert_eq!(m.offset, 5);
    assert!(!m.is_trimmable());
    assert_eq!(m.trim(1, false), Err(ModelError::NotTrimmable), "wrapped: R-ROT-6");
    assert_eq!(m.trim(0, false), Err(ModelError::NotTrimmable));
    // Speculative rollback after a window, even on a wrapped ring.
    window(&mut m, 3);
    let before = m.clone();
    assert_eq!(m.trim(4, true), Err(ModelError::TrimTooLong));
    assert_eq!(m, before, "unchanged on error");
    m.trim(2, true).unwrap();
    assert_eq!(positions(&m.cols), vec![2, 3, 4, 5]);
    assert_eq!((m.offset, m.idx, m.last_concat), (6, 4, Some(1)));
    m.check().unwrap();
    // Linear caches are always trimmable.
    let mut lin = RowModel::new(None);
    window(&mut lin, 10);
    decode(&mut lin);
    lin.trim(6, false).unwrap();
    assert_eq!(lin.offset, 5);
    assert_eq!(lin.last_concat, None);
    assert_eq!(lin.trim(6, false), Err(ModelError::TrimTooLong));
    // A short temporal slice: n is bounded by len as well as offset.
    let mut short = RowModel::try_from_temporal(Some(8), vec![t(5), t(6)], 7).unwrap();
    assert_eq!(short.trim(3, false), Err(ModelError::TrimTooLong));
    short.trim(2, false).unwrap();
    assert_eq!(short.offset, 5);
}

/// Found by `temporal_view_is_the_newest_positions`: a bypass trim of all L positions of a window that had
/// cut the history to W - 1 (R-ROT-3) leaves W - 1 positions, one short of min(offset, W). Reads stay right
/// (the next write needs only the newest W - 1 as history), but `temporal_view` then holds W - 1 positions:
/// a view sliced as "the last min(offset, W) columns" would underflow.
#[test]
fn full_rollback_leaves_w_minus_1_positions() {
    let mut m = RowModel::new(Some(3));
    for _ in 0..4 {
        decode(&mut m);
    }
    window(&mut m, 2);
    assert_eq!(positions(&m.cols), vec![2, 3, 4, 5]);
    m.trim(2, true).unwrap();
    assert_eq!(positions(&m.cols), vec![2, 3]);
    assert_eq!((m.offset, m.idx, m.last_concat), (4, 2, Some(0)));
    assert_eq!(positions(&m.temporal_view()), vec![2, 3], "W - 1 positions, not min(offset, W) = 3");
    let x = m.extract();
    assert_eq!(x.len(), 2);
    // The next decode appends and sees exactly the window again.
    let c = decode(&mut m);
    assert_eq!(c, 2);
    assert_eq!(m.decode_visible().len(), 3);
    assert_eq!(positions(&m.temporal_view()), vec![2, 3, 4]);
}

#[test]
fn relinearize_keeps_positions_and_restores_temporal_order() {
    let mut m = RowModel::new(Some(3));
    for _ in 0..5 {
        decode(&mut m);
    }
    assert_eq!(positions(&m.cols), vec![3, 4, 2]);
    m.relinearize();
    assert_eq!(positions(&m.cols), vec![2, 3, 4]);
    assert_eq!(m.idx, 3);
    assert_eq!(decode(&mut m), 0);
    m.check().unwrap();
}

#[test]
fn checked_writes_reject_bad_positions_and_pending() {
    let mut m = RowModel::new(Some(4));
    assert_eq!(m.try_decode_write(t(1)), Err(ModelError::PositionMismatch { expected: 0, found: 1 }));
    assert_eq!(m.try_window_write(&[t(0), t(2)]), Err(ModelError::PositionMismatch { expected: 1, found: 2 }));
    assert_eq!(m, RowModel::new(Some(4)));
    m.pending = Some(1);
    assert_eq!(m.try_decode_write(t(0)), Err(ModelError::PendingPrefill));
    assert!(RowModel::try_new(Some(0)).is_err());
    assert!(RowModel::try_from_temporal(Some(4), vec![t(1), t(2)], 2).is_err());
    assert!(RowModel::try_from_temporal(Some(4), vec![t(0), t(2)], 3).is_err());
    // W = 0 through the unchecked path never panics.
    let mut z = RowModel::new(Some(0));
    z.decode_write(t(0));
    z.window_write(&[t(1)]);
    let _ = z.trim(1, true);
    let _ = z.temporal_view();
    assert!(z.check().is_err());
}

// ---- batch: prepare / finalize (right-padded prefill) ----
#[test]
fn right_padded_prefill_stores_only_real_positions() {
    let mut b = BatchModel::merge(Some(4), &[(vec![], 0), (vec![Tok::new(1, 0), Tok::new(1, 1)], 2)]).unwrap();
    assert_eq!(b.left_padding(), vec![2, 0]);
    b.prepare(&[5, 1]).unwrap();
    assert_eq!(b.prepare(&[1, 1]), Err(ModelError::PendingPrefill));
    assert_eq!(b.decode(&[Tok::new(0, 0), Tok::new(1, 2)]), Err(ModelError::PendingPrefill));
    let chunk = |o0: u32, o1: u32| {
        vec![(o0..o0 + 3).map(|p| Tok::new(0, p)).collect::<Vec<_>>(), (o1..o1 + 3).map(|p| Tok::new(1, p)).collect()]
    };
    assert_eq!(b.window(&chunk(0, 2)).unwrap(), vec![3, 1]);
    assert_eq!(b.rows[1].pending, Some(0));
    let row1 = b.rows[1].clone();
    assert_eq!(b.window(&chunk(3, 3)).unwrap(), vec![2, 0]);
    assert_eq!(b.rows[1], row1, "a chunk with no real position leaves the row untouched");
    assert_eq!(positions(&b.rows[0].cols), vec![0, 1, 2, 3, 4], "3 kept (W - 1) + 2 real");
    assert_eq!(b.rows[0].last_concat, Some(2));
    b.finalize().unwrap();
    assert_eq!(b.finalize(), Err(ModelError::NoPendingPrefill));
    assert_eq!(b.decode(&[Tok::new(0, 5), Tok::new(1, 3)]).unwrap(), vec![0, 3]);
    b.check().unwrap();
    assert_eq!(b.rope_offsets(), vec![6, 4]);
    assert_eq!(b.offset(), 6);
    assert!(b.window(&[vec![Tok::new(0, 6)], vec![]]).is_err(), "ragged chunk");
    assert!(b.decode(&[Tok::new(0, 6)]).is_err(), "one token per row");
}

#[test]
fn batch_visibility_in_mask_layout() {
    let mut b = BatchModel::merge(Some(3), &[(vec![], 0), (vec![Tok::new(1, 0), Tok::new(1, 1)], 2)]).unwrap();
    b.prepare(&[2, 1]).unwrap();
    let stored = b.window(&[vec![Tok::new(0, 0), Tok::new(0, 1)], vec![Tok::new(1, 2), Tok::new(1, 99)]]).unwrap();
    assert_eq!(stored, vec![2, 1]);
    b.finalize().unwrap();
    let v = b.window_visibility(2, &stored).unwrap();
    assert_eq!((v.rows, v.queries, v.cols), (2, 2, 3));
    assert_eq!(v.columns(0, 0), vec![0]);
    assert_eq!(v.columns(0, 1), vec![0, 1]);
    assert_eq!(v.columns(1, 0), vec![0, 1, 2], "positions 0, 1, 2 within W = 3 of query 2");
    assert_eq!(v.columns(1, 1), vec![0], "a padded query sees column 0 only");
    assert!(b.window_visibility(1, &stored).is_err());
    b.decode(&[Tok::new(0, 2), Tok::new(1, 3)]).unwrap();
    let d = b.decode_visibility();
    assert_eq!(d.columns(0, 0), vec![0, 1, 2]);
    assert_eq!(d.columns(1, 0), vec![0, 1, 2]);
    assert_eq!(b.rows[1].cols[0], Tok::new(1, 3), "row 1 rotated onto its oldest column");
}

#[test]
fn batch_membership_rules() {
    let mut b = BatchModel::merge(None, &[(vec![t(0)], 1), (vec![t(0), t(1)], 2), (vec![], 0)]).unwrap();
    assert_eq!(b.filter(&[0, 3]), Err(ModelError::NoSuchRow { row: 3, rows: 3 }));
    assert_eq!(b.filter(&[1, 1]), Err(ModelError::DuplicateRow { row: 1 }));
    b.filter(&[2, 0]).unwrap();
    assert_eq!(b.rope_offsets(), vec![0, 1]);
    assert_eq!(
        BatchModel::merge(Some(1), &[(vec![t(0), t(1)], 2)]).map(|_| ()),
        Err(ModelError::BadLengths { what: "row 0: a temporal slice of 2 positions exceeds the window 1".into() })
    );
    let ring = BatchModel::empty(Some(4)).unwrap();
    let serial = RowModel::new(None);
    assert_eq!(
        BatchModel::join(Some(4), &[JoinModelSource::Rows(&ring, vec![]), JoinModelSource::Serial(&serial)]),
        Err(ModelError::WindowMismatch { expected: Some(4), found: None })
    );
    assert!(matches!(BatchModel::join(None, &[JoinModelSource::Rows(&b, vec![5])]), Err(ModelError::NoSuchRow { .. })));
    assert_eq!(b.extract(9), Err(ModelError::NoSuchRow { row: 9, rows: 2 }));
    let mut bad = RowModel::new(None);
    bad.idx = 3;
    assert!(matches!(BatchModel::adopt(None, vec![bad]), Err(ModelError::InvalidState { .. })));
}

// ---- R-BROT-7: join keeps every row's physical columns and phase ----
#[test]
fn join_keeps_physical_columns_and_phase() {
    let mut solo = RowModel::new(Some(3));
    for _ in 0..5 {
        decode(&mut solo);
    }
    let b = BatchModel::merge(Some(3), &[(vec![Tok::new(1, 0)], 1)]).unwrap();
    let j = BatchModel::join(Some(3), &[JoinModelSource::Rows(&b, vec![0]), JoinModelSource::Serial(&solo)]).unwrap();
    assert_eq!(j.rows[1].cols, solo.cols);
    assert_eq!(j.rows[1].idx, solo.idx);
    assert_eq!(j.left_padding(), vec![2, 0]);
    let mut j2 = j.clone();
    let mut s2 = solo.clone();
    j2.decode(&[Tok::new(1, 1), t(5)]).unwrap();
    decode(&mut s2);
    assert_eq!(j2.rows[1].cols, s2.cols, "the row stays bit-for-bit its serial twin");
    assert_eq!(j2.left_padding(), vec![1, -1], "negative after a wrap");
}

#[test]
fn batch_trim_is_all_or_nothing() {
    let mut b = BatchModel::merge(Some(4), &[(vec![t(0)], 1), (vec![t(0), t(1), t(2)], 3)]).unwrap();
    let before = b.clone();
    assert_eq!(b.trim(2, false), Err(ModelError::TrimTooLong));
    assert_eq!(b, before);
    assert_eq!(b.trim_rows(&[1, 3], false), Ok(()));
    assert_eq!(b.rope_offsets(), vec![0, 0]);
    assert!(b.trim_rows(&[1], false).is_err());
    assert!(b.is_trimmable());
}

#[test]
fn picture_is_readable() {
    let mut m = RowModel::new(Some(3));
    for _ in 0..4 {
        decode(&mut m);
    }
    assert_eq!(m.picture(), "W=3 off=4 idx=1 [r0p3 *r0p1 r0p2]");
}

// ---- Differential check against a literal transcription of ARCHITECTURE.md (idx arithmetic) ----

/// The serial core exactly as ARCHITECTURE.md words it, with columns as positions.
#[derive(Debug, Clone)]
struct SpecRing {
    w: Option<usize>,
    cols: Vec<u32>,
    offset: usize,
    idx: usize,
    last_concat: Option<usize>,
}

impl SpecRing {
    fn decode(&mut self, pos: u32) -> usize {
        if let Some(w) = self.w {
            if self.cols.len() > w {
                self.cols.drain(..self.cols.len() - w);
                self.idx = w;
            }
            if self.idx == w {
                self.idx = 0;
            }
        }
        let c = self.idx;
        if c == self.cols.len() {
            self.cols.push(pos);
        } else {
            self.cols[c] = pos;
        }
        self.idx += 1;
        self.offset += 1;
        self.last_concat = None;
        c
    }
    fn window(&mut self, pos: &[u32]) {
        let len = self.cols.len();
        let mut t: Vec<u32> = if self.idx < len {
            self.cols[self.idx..].iter().chain(&self.cols[..self.idx]).copied().collect()
        } else {
            self.cols.clone()
        };
        let keep = self.w.map_or(len, |w| len.min(w - 1));
        t.drain(..len - keep);
        t.extend_from_slice(pos);
        self.cols = t;
        self.idx = self.cols.len();
        self.offset += pos.len();
        self.last_concat = Some(pos.len());
    }
    /// Temporal order `[idx, len) ++ [0, idx)` when rotated, else `[0, len)`; then `idx = len`.
    fn relinearize(&mut self) {
        if self.idx < self.cols.len() {
            self.cols.rotate_left(self.idx);
        }
        self.idx = self.cols.len();
    }
    fn trim(&mut self, n: usize) {
        let len = self.cols.len() - n;
        self.cols.truncate(len);
        self.offset -= n;
        self.idx = len;
    }
}

#[derive(Debug, Clone)]
enum Op {
    Decode,
    Window(u32),
    Trim(usize, bool),
    Relinearize,
    Extract,
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => Just(Op::Decode),
        3 => (1u32..7).prop_map(Op::Window),
        2 => (0usize..5, any::<bool>()).prop_map(|(n, b)| Op::Trim(n, b)),
        1 => Just(Op::Relinearize),
        1 => Just(Op::Extract),
    ]
}

fn window_size() -> impl Strategy<Value = Option<usize>> {
    prop_oneof![4 => (1usize..9).prop_map(Some), 1 => Just(None)]
}

/// Applies `op` to the model (checked API), returning the stored window length when it was a window write.
fn apply(m: &mut RowModel, op: &Op) -> Option<usize> {
    match *op {
        Op::Decode => {
            decode(m);
            None
        }
        Op::Window(l) => Some(window(m, l)),
        Op::Trim(n, b) => {
            let _ = m.trim(n, b);
            None
        }
        Op::Relinearize => {
            m.relinearize();
            None
        }
        Op::Extract => {
            *m = m.extract();
            None
        }
    }
}

fn w_or_inf(m: &RowModel) -> usize {
    m.max_size.unwrap_or(usize::MAX)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// The model agrees with the literal idx-arithmetic reading of the serial core on every field and column.
    #[test]
    fn model_matches_the_architecture_transcription(w in window_size(), ops in prop::collection::vec(op(), 0..60)) {
        let mut m = RowModel::new(w);
        let mut s = SpecRing { w, cols: vec![], offset: 0, idx: 0, last_concat: None };
        for o in &ops {
            match *o {
                Op::Decode => {
                    let p = m.offset as u32;
                    prop_assert_eq!(m.decode_write(t(p)), s.decode(p));
                }
                Op::Window(l) => {
                    let p = m.offset as u32;
                    window(&mut m, l);
                    s.window(&(p..p + l).collect::<Vec<_>>());
                }
                Op::Trim(n, b) => {
                    let ok = m.trim(n, b).is_ok();
                    let legal = if b { matches!(s.last_concat, Some(l) if n <= l) }
                                else { s.w.is_none_or(|w| s.offset < w) && n <= s.offset };
                    prop_assert_eq!(ok, legal);
                    if legal { s.trim(n); s.last_concat = if b { s.last_concat.filter(|&l| n <= l).map(|l| l - n) } else { None }; }
                }
                Op::Relinearize => {
                    apply(&mut m, o);
                    s.relinearize();
                }
                Op::Extract => {
                    apply(&mut m, o);
                    s.relinearize();
                    s.last_concat = None;
                }
            }
            prop_assert_eq!(positions(&m.cols), s.cols.clone(), "{}", m.picture());
            prop_assert_eq!((m.offset, m.idx, m.last_concat), (s.offset, s.idx, s.last_concat));
            prop_assert!(m.check().is_ok(), "{:?} {}", m.check(), m.picture());
        }
    }

    /// R-ROT-4: temporal_view is always the newest min(offset, W) positions, in order: the tail. The one
    /// exception is a full speculative rollback (bypass trim of all L of a window that had cut the history
    /// to W - 1): until the next write the row holds W - 1 positions and the view is their tail (see
    /// `full_rollback_leaves_w_minus_1_positions`).
    #[test]
    fn temporal_view_is_the_newest_positions(w in window_size(), ops in prop::collection::vec(op(), 0..60)) {
        let mut m = RowModel::new(w);
        let mut full_rollback = false;
        for o in &ops {
            let before = m.clone();
            apply(&mut m, o);
            match o {
                Op::Decode | Op::Window(_) => full_rollback = false,
                Op::Trim(_, true) if m != before && m.last_concat == Some(0) => full_rollback = true,
                _ => {}
            }
            let full = m.offset.min(w_or_inf(&m));
            let view = m.temporal_view();
            if full_rollback {
                prop_assert!(view.len() + 1 >= full, "{}", m.picture());
            } else {
                prop_assert_eq!(view.len(), full, "{}", m.picture());
            }
            let want: Vec<u32> = ((m.offset - view.len()) as u32..m.offset as u32).collect();
            prop_assert_eq!(positions(&view), want);
        }
    }

    /// R-ROT-2 / R-C-2: every decode query sees exactly min(offset, W) keys, which are all live columns.
    #[test]
    fn decode_sees_min_offset_w(w in window_size(), ops in prop::collection::vec(op(), 0..60)) {
        let mut m = RowModel::new(w);
        for o in &ops {
            apply(&mut m, o);
            if matches!(o, Op::Decode) {
                let vis = m.decode_visible();
                prop_assert_eq!(vis.len(), m.offset.min(w_or_inf(&m)));
                prop_assert_eq!(vis, (0..m.len()).collect::<Vec<_>>(), "no mask: eviction enforces the window");
            }
        }
    }

    /// R-ROT-3 / R-C-2: window query i (position q) sees min(q + 1, W) keys: exactly positions q-W+1 ..= q.
    #[test]
    fn window_query_sees_its_window(w in window_size(), ops in prop::collection::vec(op(), 0..40), l in 1u32..8) {
        let mut m = RowModel::new(w);
        for o in &ops { apply(&mut m, o); }
        let l = window(&mut m, l);
        for i in 0..l {
            let q = m.offset - l + i;
            let vis = m.window_visible(l, i);
            let n = (q + 1).min(w_or_inf(&m));
            prop_assert_eq!(vis.len(), n);
            let mut got: Vec<u32> = vis.iter().map(|&c| m.cols[c].pos).collect();
            got.sort_unstable();
            prop_assert_eq!(got, ((q + 1 - n) as u32..=q as u32).collect::<Vec<_>>());
        }
    }

    /// R-BROT-4/5: from_temporal keeps the temporal order; extract after merge is the identity per row.
    #[test]
    fn extract_after_merge_is_identity(rows in prop::collection::vec(prop::collection::vec(op(), 0..40), 1..4), w in 1usize..9) {
        let mut solos = Vec::new();
        for ops in &rows {
            let mut m = RowModel::new(Some(w));
            for o in ops { apply(&mut m, o); }
            let again = RowModel::from_temporal(m.max_size, m.temporal(), m.offset);
            prop_assert_eq!(again.temporal(), m.temporal());
            prop_assert_eq!(again.temporal_view(), m.temporal_view());
            solos.push(m);
        }
        let slices: Vec<(Vec<Tok>, usize)> = solos.iter().map(|m| (m.temporal_view(), m.offset)).collect();
        let b = BatchModel::merge(Some(w), &slices).unwrap();
        b.check().unwrap();
        for (i, m) in solos.iter().enumerate() {
            let x = b.extract(i).unwrap();
            prop_assert_eq!(x.temporal(), m.temporal_view());
            prop_assert_eq!(x.temporal_view(), m.temporal_view());
            prop_assert_eq!(x.offset, m.offset);
            prop_assert_eq!(x.idx, x.len());
        }
    }

    /// R-C-5: a bypass trim of n after a window of L leaves exactly the state of a window of L - n.
    #[test]
    fn bypass_trim_equals_shorter_window(w in window_size(), ops in prop::collection::vec(op(), 0..40), l in 1u32..8, n in 0u32..8) {
        let n = n.min(l);
        let mut m = RowModel::new(w);
        for o in &ops { apply(&mut m, o); }
        let mut short = m.clone();
        window(&mut m, l);
        m.trim(n as usize, true).unwrap();
        let p = short.offset as u32;
        short.try_window_write(&(p..p + l - n).map(t).collect::<Vec<_>>()).unwrap();
        prop_assert_eq!(m, short);
    }

    /// Rows of a batch are independent serial rings: a batch decode/window equals each row's serial op.
    #[test]
    fn batch_rows_equal_serial_twins(w in window_size(), steps in prop::collection::vec((any::<bool>(), 1u32..5), 0..40)) {
        let mut b = BatchModel::merge(w, &[(vec![], 0), (vec![Tok::new(1, 0)], 1)]).unwrap();
        let mut twins = [RowModel::new(w), RowModel::from_temporal(w, vec![Tok::new(1, 0)], 1)];
        for (dec, l) in steps {
            if dec {
                let toks: Vec<Tok> = b.rows.iter().enumerate().map(|(r, m)| Tok::new(r as u32, m.offset as u32)).collect();
                let cols = b.decode(&toks).unwrap();
                for (r, tw) in twins.iter_mut().enumerate() { prop_assert_eq!(tw.try_decode_write(toks[r]).unwrap(), cols[r]); }
            } else {
                let toks: Vec<Vec<Tok>> = b.rows.iter().enumerate().map(|(r, m)| (m.offset as u32..m.offset as u32 + l).map(|p| Tok::new(r as u32, p)).collect()).collect();
                b.window(&toks).unwrap();
                for (r, tw) in twins.iter_mut().enumerate() { tw.try_window_write(&toks[r]).unwrap(); }
            }
            for (r, tw) in twins.iter().enumerate() {
                prop_assert_eq!(&b.rows[r].cols, &tw.cols);
                prop_assert_eq!(b.rows[r].idx, tw.idx);
            }
        }
    }
}
