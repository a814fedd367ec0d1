use super::*;
use proptest::prelude::*;

fn spec(max_size: Option<usize>, start: Option<usize>) -> TransitionSpec {
    TransitionSpec { max_size, start, bits: 4, group: 32 }
}

fn toks(req: u32, from: usize, n: usize) -> Vec<Tok> {
    (from..from + n).map(|p| Tok::new(req, p as u32)).collect()
}

fn lego_after(s: TransitionSpec, req: u32, blocks: &[usize]) -> LegoModel {
    let mut lego = LegoModel::new(s).unwrap();
    for &n in blocks {
        let off = lego.row.offset();
        lego.append(&toks(req, off, n), false).unwrap();
    }
    lego
}

// ---- the lego: the crossing append reads bf16, then converts; irreversible ----

#[test]
fn crossing_append_reads_bf16_then_converts() {
    let mut lego = LegoModel::new(spec(None, Some(5))).unwrap();
    let (read, converted) = lego.append(&toks(0, 0, 3), false).unwrap();
    assert_eq!((read.precision, converted), (Precision::Bf16, false));
    let (read, converted) = lego.append(&toks(0, 3, 4), false).unwrap();
    assert_eq!((read.precision, converted), (Precision::Bf16, true), "the append that reaches start reads bf16");
    assert_eq!(lego.row.converted_at, Some(7));
    assert_eq!(lego.minimum_reusable_offset(), 7, "the floor is the offset at conversion");
    let (read, _) = lego.append(&toks(0, 7, 1), true).unwrap();
    assert_eq!(read.precision, Precision::Affine);
    lego.trim(6, false).unwrap();
    assert_eq!(lego.row.precision(), Precision::Affine, "a trim below start keeps quantized storage");
    assert_eq!(lego.minimum_reusable_offset(), 7, "the floor survives the trim");
}

#[test]
fn start_zero_converts_after_the_first_append_with_no_floor() {
    let mut lego = LegoModel::new(spec(Some(4), Some(0))).unwrap();
    assert_eq!(lego.row.precision(), Precision::Bf16, "never converts while empty");
    let (read, converted) = lego.append(&toks(0, 0, 2), false).unwrap();
    assert_eq!((read.precision, converted), (Precision::Bf16, true));
    assert_eq!(lego.minimum_reusable_offset(), 0);
}

#[test]
fn infinite_start_never_converts() {
    let mut lego = lego_after(spec(Some(3), None), 0, &[5, 1, 7]);
    assert_eq!(lego.row.precision(), Precision::Bf16);
    assert_eq!(lego.max_append_tokens(), None);
    lego.append(&toks(0, 13, 1), true).unwrap();
    assert_eq!(lego.row.converted_at, None);
}

#[test]
fn split_appends_move_the_lego_conversion() {
    // Append boundaries are part of the numbers: one window of 6 converts at 6, a window of 4 then 2 at 4.
    let s = spec(None, Some(4));
    assert_eq!(lego_after(s, 0, &[6]).row.converted_at, Some(6));
    assert_eq!(lego_after(s, 0, &[4, 2]).row.converted_at, Some(4));
}

// ---- rounds: conversion never looks at an uncommitted suffix ----

#[test]
fn a_round_that_crosses_start_but_rejects_does_not_convert() {
    let s = spec(Some(8), Some(5));
    let mut lego = lego_after(s, 0, &[3]);
    lego.round_begin().unwrap();
    let (_, converted) = lego.append(&toks(0, 3, 4), false).unwrap();
    assert!(!converted, "no conversion inside an armed round");
    assert!(!lego.round_rollback(1).unwrap(), "committed offset 4 < start 5");
    assert_eq!((lego.row.offset(), lego.row.converted_at), (4, None));
    // The naive lego (append, then trim) would have converted on the uncommitted suffix:
    let mut naive = lego_after(s, 0, &[3]);
    naive.append(&toks(0, 3, 4), false).unwrap();
    naive.trim(3, true).unwrap();
    assert_eq!(naive.row.converted_at, Some(7));
}

#[test]
fn rollback_keeping_more_than_written_is_refused_unchanged() {
    let s = spec(Some(4), Some(100));
    let mut rows = RowsModel::merge(s, vec![lego_after(s, 0, &[3]).row, lego_after(s, 1, &[2]).row]).unwrap();
    rows.round_begin().unwrap();
    rows.append(&[toks(0, 3, 3), toks(1, 2, 3)], false).unwrap();
    let before = rows.clone();
    assert_eq!(rows.round_rollback(&[1, 4]), Err(TransitionError::KeepTooLong { row: 1, keep: 4, written: 3 }));
    assert_eq!(rows, before);
    assert!(matches!(rows.round_rollback(&[1]), Err(TransitionError::RowCount { .. })));
    assert_eq!(rows, before);
}

// ---- the rows ----

#[test]
fn rows_convert_each_at_its_own_boundary_and_pack_one_way() {
    let s = spec(None, Some(4));
    let mut rows = RowsModel::merge(s, vec![lego_after(s, 0, &[3]).row, lego_after(s, 1, &[1]).row]).unwrap();
    assert_eq!(rows.rows.iter().map(|r| r.left_pad).collect::<Vec<_>>(), vec![0, 2]);
    assert_eq!(rows.max_append_tokens(), Some(1));
    let (reads, conv) = rows.append(&[toks(0, 3, 1), toks(1, 1, 1)], true).unwrap();
    assert_eq!(conv, vec![0]);
    assert!(reads.iter().all(|r| r.precision == Precision::Bf16));
    assert_eq!(rows.max_append_tokens(), Some(2));
    assert_eq!(rows.check_plain_read(), Err(TransitionError::MixedPrecision { row: 0 }));
    assert!(!rows.packed);
    let (reads, conv) = rows.append(&[toks(0, 4, 2), toks(1, 2, 2)], false).unwrap();
    assert_eq!((reads[0].precision, reads[1].precision), (Precision::Affine, Precision::Bf16));
    assert_eq!(conv, vec![1]);
    assert!(rows.packed, "every row converted: packed");
    assert_eq!(rows.max_append_tokens(), None);
    assert_eq!(rows.minimum_reusable_offset(), 4);
    rows.trim(3).unwrap();
    assert!(rows.packed && rows.rows.iter().all(|r| r.precision() == Precision::Affine), "packing is one way");
}

#[test]
fn a_sibling_split_forward_does_not_move_a_boundary() {
    let s = spec(None, Some(4));
    let mut rows = RowsModel::merge(s, vec![LifecycleRow::new(None), LifecycleRow::new(None)]).unwrap();
    rows.begin_prefill().unwrap();
    // Row 0's planned chunk is 6 positions; a sibling splits the forward into 3 + 3.
    rows.append(&[toks(0, 0, 3), toks(1, 0, 3)], false).unwrap();
    rows.append(&[toks(0, 3, 3), vec![]], false).unwrap();
    assert!(rows.rows.iter().all(|r| r.converted_at.is_none()), "no conversion before the request's commit");
    assert_eq!(rows.commit_prefill(&[0]).unwrap(), vec![0]);
    assert_eq!(rows.rows[0].converted_at, lego_after(s, 0, &[6]).row.converted_at);
    assert_eq!(rows.rows[1].converted_at, None, "row 1 (offset 3) is not due");
    rows.end_prefill().unwrap();
}

#[test]
fn rotating_rollback_rolls_right_into_padding_except_a_lone_unwrapped_row() {
    let s = spec(Some(4), Some(100));
    // Two rows, one wrapped: roll right.
    let mut rows = RowsModel::merge(s, vec![lego_after(s, 0, &[6]).row, lego_after(s, 1, &[2]).row]).unwrap();
    assert_eq!(rows.rows.iter().map(|r| r.left_pad).collect::<Vec<_>>(), vec![0, 2]);
    rows.round_begin().unwrap();
    rows.append(&[toks(0, 6, 3), toks(1, 2, 3)], false).unwrap();
    let kept0: Vec<Tok> = rows.rows[0].ring.cols[..rows.rows[0].ring.len() - 2].to_vec();
    let (plan, _) = rows.round_rollback(&[1, 3]).unwrap();
    assert_eq!(plan, RollbackPlan::RollRight(vec![2, 0]));
    assert_eq!(rows.rows[0].left_pad, 2, "the rejected count rolls into the padding");
    assert_eq!(rows.rows[0].ring.cols, kept0, "kept columns untouched");
    assert_eq!(rows.rows.iter().map(|r| r.offset()).collect::<Vec<_>>(), vec![7, 5]);
    // A lone unwrapped row trims.
    let mut lone = RowsModel::merge(s, vec![lego_after(s, 0, &[1]).row]).unwrap();
    lone.round_begin().unwrap();
    lone.append(&[toks(0, 1, 2)], false).unwrap();
    assert_eq!(lone.round_rollback(&[0]).unwrap().0, RollbackPlan::Trim(vec![2]));
    assert_eq!(lone.rows[0].left_pad, 0);
}

#[test]
fn one_row_keeps_its_phase_several_rows_align_temporally() {
    let s = spec(Some(3), Some(100));
    let mut lego = lego_after(s, 0, &[2]);
    for p in 2..5 {
        lego.append(&toks(0, p, 1), true).unwrap();
    }
    let physical = lego.row.ring.cols.clone();
    assert_ne!(physical, lego.row.ring.temporal(), "the ring has wrapped");
    let one = RowsModel::merge(s, vec![lego.row.clone()]).unwrap();
    assert_eq!(one.rows[0].ring.cols, physical, "a lone row keeps its physical columns and phase");
    let two = RowsModel::merge(s, vec![lego.row.clone(), lego_after(s, 1, &[1]).row]).unwrap();
    assert_eq!(two.rows[0].ring.cols, lego.row.ring.temporal());
    assert_eq!(two.dense_fetch()[1].slots, vec![None, None, Some(Tok::new(1, 0))]);
}

#[test]
fn reuse_never_trims_below_the_floor() {
    let s = spec(None, Some(4));
    let lego = lego_after(s, 0, &[6, 2]);
    assert_eq!(lego.minimum_reusable_offset(), 6);
    assert_eq!(take(&lego, 5, 20), Err(TransitionError::BelowFloor { prefix: 5, floor: 6 }));
    assert_eq!(take(&lego, 20, 7).unwrap().row.offset(), 6, "p = min(common, prompt_len - 1) = floor: reusable");
    let reused = take(&lego, 7, 20).unwrap();
    assert_eq!((reused.row.offset(), reused.row.precision()), (7, Precision::Affine));
    // The floor survives extract, filter and merge.
    let mut rows = RowsModel::merge(s, vec![LifecycleRow::new(None), lego.row.clone()]).unwrap();
    assert_eq!(rows.minimum_reusable_offset(), 6);
    assert_eq!(rows.extract(1).unwrap().minimum_reusable_offset(), 6);
    rows.filter(&[1]).unwrap();
    assert_eq!((rows.minimum_reusable_offset(), rows.rows[0].left_pad), (6, 0));
    let before = rows.clone();
    assert!(rows.filter(&[0, 0]).is_err());
    assert_eq!(rows, before);
}

#[test]
fn signatures_follow_upstream_order() {
    assert_eq!(spec(None, Some(5)).signature(), "kv:delayed-quant:4:32:5");
    assert_eq!(spec(Some(8), None).signature(), "kv:delayed-rotating-quant:8:4:32:inf");
}

// ---- a random lifecycle against per-request lego twins ----

/// One scheduler step, interpreted against the current state (steps that do not apply are skipped, so any
/// sequence is a schedule).
#[derive(Debug, Clone)]
enum Step {
    Decode,
    Window(usize),
    /// Planned chunk per row (by index modulo), split by a sibling at `split`.
    Prefill {
        chunks: Vec<usize>,
        split: usize,
    },
    Round {
        l: usize,
        keep: Vec<usize>,
    },
    Admit(Vec<usize>),
    Filter(Vec<usize>),
    Take {
        row: usize,
        common: usize,
        prompt: usize,
    },
    BadRollback,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        2 => Just(Step::Decode),
        2 => (1usize..5).prop_map(Step::Window),
        2 => (prop::collection::vec(1usize..7, 1..4), 1usize..6).prop_map(|(chunks, split)| Step::Prefill { chunks, split }),
        3 => (1usize..5, prop::collection::vec(0usize..6, 1..4)).prop_map(|(l, keep)| Step::Round { l, keep }),
        1 => prop::collection::vec(0usize..6, 0..3).prop_map(Step::Admit),
        1 => prop::collection::vec(0usize..4, 1..4).prop_map(Step::Filter),
        1 => (0usize..4, 0usize..20, 0usize..20).prop_map(|(row, common, prompt)| Step::Take { row, common, prompt }),
        1 => Just(Step::BadRollback),
    ]
}

struct World {
    rows: RowsModel,
    twins: Vec<LegoModel>,
    reqs: Vec<u32>,
    next_req: u32,
    conversions: usize,
}

impl World {
    fn check(&self) -> std::result::Result<(), TestCaseError> {
        prop_assert_eq!(self.rows.rows.len(), self.twins.len());
        for (i, (r, t)) in self.rows.rows.iter().zip(&self.twins).enumerate() {
            prop_assert_eq!(r.converted_at, t.row.converted_at, "row {} conversion", i);
            prop_assert_eq!(r.floor, t.row.floor, "row {} floor", i);
            // The visible state (a split forward or an alignment may leave an oversized ring a different number of
            // invisible old columns, which the next write drops).
            prop_assert_eq!(r.ring.temporal_view(), t.row.ring.temporal_view(), "row {} state", i);
            prop_assert_eq!(r.ring.offset, t.row.ring.offset);
        }
        let all = !self.rows.rows.is_empty() && self.rows.rows.iter().all(|r| r.converted_at.is_some());
        prop_assert_eq!(self.rows.packed, all, "packed iff every row converted");
        let floor = self.rows.rows.iter().map(|r| r.floor).max().unwrap_or(0);
        prop_assert_eq!(self.rows.minimum_reusable_offset(), floor);
        if let Some(n) = self.rows.max_append_tokens() {
            prop_assert!(n > 0);
        }
        Ok(())
    }

    fn same_reads(reads: &[RowRead], twin: &[RowRead]) -> std::result::Result<(), TestCaseError> {
        for (a, b) in reads.iter().zip(twin) {
            prop_assert_eq!(a.precision, b.precision);
            prop_assert_eq!(a.queries.len(), b.queries.len());
            for (qa, qb) in a.queries.iter().zip(&b.queries) {
                let (mut qa, mut qb) = (qa.clone(), qb.clone());
                qa.sort_by_key(|t| t.pos);
                qb.sort_by_key(|t| t.pos);
                prop_assert_eq!(qa, qb);
            }
        }
        Ok(())
    }

    fn run(&mut self, step: &Step) -> std::result::Result<(), TestCaseError> {
        let n = self.rows.rows.len();
        let block = |w: &World, i: usize, l: usize| toks(w.reqs[i], w.twins[i].row.offset(), l);
        match step {
            Step::Decode if n > 0 => {
                let all: Vec<Vec<Tok>> = (0..n).map(|i| block(self, i, 1)).collect();
                let limit = self.rows.max_append_tokens();
                let (reads, conv) = self.rows.append(&all, true).unwrap();
                let twin: Vec<RowRead> =
                    self.twins.iter_mut().zip(&all).map(|(t, b)| t.append(b, true).unwrap().0).collect();
                Self::same_reads(&reads, &twin)?;
                if limit.is_some_and(|m| m >= 1) {
                    for &i in &conv {
                        prop_assert_eq!(self.rows.rows[i].converted_at, self.rows.spec.start, "exact boundary");
                    }
                }
                self.conversions += conv.len();
            }
            Step::Window(l) if n > 0 => {
                let all: Vec<Vec<Tok>> = (0..n).map(|i| block(self, i, *l)).collect();
                let (reads, conv) = self.rows.append(&all, false).unwrap();
                let twin: Vec<RowRead> =
                    self.twins.iter_mut().zip(&all).map(|(t, b)| t.append(b, false).unwrap().0).collect();
                Self::same_reads(&reads, &twin)?;
                self.conversions += conv.len();
            }
            Step::Prefill { chunks, split } if n > 0 => {
                self.rows.begin_prefill().unwrap();
                let planned: Vec<usize> = (0..n).map(|i| chunks[i % chunks.len()]).collect();
                let first: Vec<Vec<Tok>> = (0..n).map(|i| block(self, i, planned[i].min(*split))).collect();
                self.rows.append(&first, false).unwrap();
                let second: Vec<Vec<Tok>> = (0..n)
                    .map(|i| {
                        let from = self.twins[i].row.offset() + first[i].len();
                        toks(self.reqs[i], from, planned[i] - first[i].len())
                    })
                    .collect();
                self.rows.append(&second, false).unwrap();
                prop_assert!(self.rows.rows.iter().zip(&self.twins).all(|(r, t)| r.converted_at == t.row.converted_at));
                for (i, t) in self.twins.iter_mut().enumerate() {
                    let off = t.row.offset();
                    t.append(&toks(self.reqs[i], off, planned[i]), false).unwrap();
                }
                let all: Vec<usize> = (0..n).collect();
                self.conversions += self.rows.commit_prefill(&all).unwrap().len();
                self.rows.end_prefill().unwrap();
            }
            Step::Round { l, keep } if n > 0 => {
                self.rows.round_begin().unwrap();
                let all: Vec<Vec<Tok>> = (0..n).map(|i| block(self, i, *l)).collect();
                let (reads, conv) = self.rows.append(&all, false).unwrap();
                prop_assert!(conv.is_empty(), "no conversion inside a round");
                let mut twin = Vec::new();
                for (t, b) in self.twins.iter_mut().zip(&all) {
                    t.round_begin().unwrap();
                    twin.push(t.append(b, false).unwrap().0);
                }
                Self::same_reads(&reads, &twin)?;
                let keep: Vec<usize> = (0..n).map(|i| keep[i % keep.len()].min(*l)).collect();
                if keep.iter().all(|&k| k == *l) {
                    self.conversions += self.rows.round_commit().unwrap().len();
                    for t in &mut self.twins {
                        t.round_commit().unwrap();
                    }
                } else {
                    let (plan, conv) = self.rows.round_rollback(&keep).unwrap();
                    self.conversions += conv.len();
                    if let RollbackPlan::RollRight(shifts) = plan {
                        prop_assert!(shifts.iter().zip(&keep).all(|(s, k)| s + k == *l));
                    }
                    for (t, &k) in self.twins.iter_mut().zip(&keep) {
                        t.round_rollback(k).unwrap();
                    }
                }
            }
            Step::Admit(blocks) => {
                let req = self.next_req;
                self.next_req += 1;
                let lego = lego_after(self.rows.spec, req, blocks);
                let mut sources: Vec<LifecycleRow> = self.rows.rows.clone();
                sources.push(lego.row.clone());
                let floors: Vec<usize> = sources.iter().map(|r| r.floor).collect();
                self.rows = RowsModel::merge(self.rows.spec, sources).unwrap();
                prop_assert_eq!(self.rows.rows.iter().map(|r| r.floor).collect::<Vec<_>>(), floors);
                self.twins.push(lego);
                self.reqs.push(req);
            }
            Step::Filter(keep) if n > 0 => {
                let mut keep: Vec<usize> = keep.iter().map(|k| k % n).collect();
                keep.dedup();
                let before = self.rows.clone();
                match self.rows.filter(&keep) {
                    Ok(()) => {
                        self.twins = keep.iter().map(|&k| self.twins[k].clone()).collect();
                        self.reqs = keep.iter().map(|&k| self.reqs[k]).collect();
                    }
                    Err(_) => prop_assert_eq!(&self.rows, &before),
                }
            }
            Step::Take { row, common, prompt } if n > 0 => {
                let extracted = self.rows.extract(row % n).unwrap();
                prop_assert_eq!(extracted.row.floor, self.rows.rows[row % n].floor, "extract keeps the floor");
                match take(&extracted, *common, *prompt) {
                    Ok(reused) => {
                        prop_assert!(reused.row.offset() >= reused.minimum_reusable_offset());
                        prop_assert_eq!(reused.row.precision(), extracted.row.precision());
                    }
                    Err(TransitionError::BelowFloor { prefix, floor }) => prop_assert!(prefix < floor),
                    Err(e) => prop_assert!(matches!(e, TransitionError::Model(_)), "{e}"),
                }
            }
            Step::BadRollback if n > 0 => {
                self.rows.round_begin().unwrap();
                let all: Vec<Vec<Tok>> = (0..n).map(|i| block(self, i, 1)).collect();
                self.rows.append(&all, false).unwrap();
                let before = self.rows.clone();
                prop_assert!(self.rows.round_rollback(&vec![2; n]).is_err());
                prop_assert_eq!(&self.rows, &before);
                prop_assert!(
                    self.rows.check_plain_read().is_err() == self.rows.rows.iter().any(|r| r.converted_at.is_some())
                );
                self.rows.round_rollback(&vec![0; n]).unwrap();
                for (t, b) in self.twins.iter_mut().zip(&all) {
                    t.round_begin().unwrap();
                    t.append(b, false).unwrap();
                    t.round_rollback(0).unwrap();
                }
            }
            _ => {}
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]
    #[test]
    fn rows_match_their_lego_twins(
        window in prop_oneof![Just(None), (2usize..7).prop_map(Some)],
        start in prop_oneof![Just(None), Just(Some(0)), (1usize..12).prop_map(Some)],
        first in prop::collection::vec(prop::collection::vec(0usize..6, 0..3), 1..4),
        steps in prop::collection::vec(step(), 0..24),
    ) {
        let s = spec(window, start);
        let twins: Vec<LegoModel> = first.iter().enumerate().map(|(i, b)| lego_after(s, i as u32, b)).collect();
        let rows = RowsModel::merge(s, twins.iter().map(|t| t.row.clone()).collect()).unwrap();
        let n = twins.len() as u32;
        let mut w = World { rows, twins, reqs: (0..n).collect(), next_req: n, conversions: 0 };
        w.check()?;
        for st in &steps {
            w.run(st)?;
            w.check()?;
        }
    }
}

// ---- known spans: each row its own committed span ----

#[test]
fn known_span_positions_decode_only_the_rows_still_in_their_span() {
    // Row 0 commits 3 positions, row 1 one: row 1 is untouched after its span, and each row ends as its lego would
    // after its own decodes (row 0 reaches start 4 inside its span and converts; row 1 stops short of it).
    let s = spec(Some(6), Some(4));
    let (a, b) = (lego_after(s, 0, &[2]), lego_after(s, 1, &[2]));
    let mut rows = RowsModel::merge(s, vec![a.row.clone(), b.row.clone()]).unwrap();
    let lens = [3, 1];
    let mut converted = vec![];
    for i in 0..3 {
        let col: Vec<Option<Tok>> = [(0u32, 2usize), (1, 2)]
            .iter()
            .zip(lens)
            .map(|(&(r, off), n)| (i < n).then(|| Tok::new(r, (off + i) as u32)))
            .collect();
        let (reads, c) = rows.decode_some(&col).unwrap();
        assert_eq!(reads[1].queries.is_empty(), i >= 1, "row 1 reads only inside its span");
        converted.extend(c);
    }
    let (mut la, mut lb) = (a, b);
    for p in 2..5 {
        la.append(&[Tok::new(0, p)], true).unwrap();
    }
    lb.append(&[Tok::new(1, 2)], true).unwrap();
    assert_eq!(converted, vec![0], "row 0 converts as it reaches start, row 1 does not");
    assert_eq!(rows.rows[0].offset(), la.row.offset());
    assert_eq!(rows.rows[1].offset(), lb.row.offset());
    assert_eq!(rows.rows[0].converted_at, la.row.converted_at);
    assert_eq!(rows.rows[0].ring.temporal_view(), la.row.ring.temporal_view());
    assert_eq!(rows.rows[1].ring.temporal_view(), lb.row.ring.temporal_view());
    // A prepared prefill refuses the known-span read, nothing changed.
    rows.pending = Some(vec![1, 0]);
    let before = rows.clone();
    assert!(rows.decode_some(&[Some(Tok::new(0, 5)), None]).is_err());
    assert_eq!(rows, before);
}
