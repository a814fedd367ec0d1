//! A proptest-state-machine test of the production caches against the reference model.
//!
//! - **Reference state machine** ([`RefMachine`]): `reference::RowModel` per request (batch rows and requests
//!   outside the batch), `reference::BatchModel` for the batch-wide legality rules (trim, trim_rows, filter,
//!   prepare/finalize), and the outcome it predicts for every fallible call of the last transition.
//! - **System under test** ([`Sut`]): a production `cache::RowBatch` plus, per row, its solo twin (a
//!   `cache::SerialCache` fed only that request's real positions); requests outside the batch are production
//!   `SerialCache`s with their own twins.
//!
//! After every transition: row counts, every row's `RingState` (and `base`, `pending`, left padding, trimmability,
//! RoPE offsets, `row_decode_phase`) against the model, the batch's capacity against its live rows' bound and its
//! bytes held against `rows * cap * bytes_per_token`, `adopt` of the batch's own buffers and states; every row's physical and temporal K/V bytes against its twin's *and* against the
//! model's tokens (`kvsim::bytes::ArrayBytes`); during the transition, every read's outputs (decode, window, padded
//! prefill window, commit span) byte-identical to the twin's (CPU), and every illegal request's error kind equal to
//! the model's prediction.
//!
//! Transitions: admit, solo window/decode/trim/verify, join of serial caches, merge of temporal views, a whole-batch
//! re-merge, right-padded prefill (prepare, chunks, finalize, with illegal probes), decode, window, append, verify
//! (window + `trim_rows` bypass), commit span, extract + filter, filter, trim (legal or not). Preconditions are
//! re-checked while shrinking, so a shrunk sequence never names a row or request that no longer exists.
//!
//! Runs `cases: 48` by default; `PROPTEST_CASES=N` overrides it for longer runs. Failures are persisted to
//! `proptest-regressions/it/state_machine.txt` and replayed first.

use kvsim::cache::{CacheError, DecodePhase, JoinSource, KvDtype, KvSpec, Masks, RingState, RowBatch, SerialCache};
use kvsim::reference::{BatchModel, ModelError, RowModel, Tensor, Tok};
use proptest::prelude::*;
use proptest::test_runner::Config;
use proptest_state_machine::{prop_state_machine, ReferenceStateMachine, StateMachineTest};

use crate::common::{self, assert_row_output, assert_same_bytes, bytes, Payload};

// ----- the reference state machine ---------------------------------------------------------------------------------

/// Shapes of one case (small: `H_kv` 1-2, `D` 4 or 8, `W` 2-6 or linear, f32 or bf16, one layer).
#[derive(Debug, Clone, Copy)]
pub struct Setup {
    pub window: Option<usize>,
    pub heads_kv: usize,
    pub heads_q: usize,
    pub head_dim: usize,
    pub dtype: KvDtype,
    pub seed: u64,
}

impl Setup {
    fn spec(&self) -> KvSpec {
        KvSpec { heads_kv: self.heads_kv, head_dim: self.head_dim, dtype: self.dtype }
    }
}

/// One request: its id (the `req` of its tokens) and its layout model.
#[derive(Debug, Clone)]
pub struct Req {
    pub id: u32,
    pub m: RowModel,
}

impl Req {
    fn next(&self, n: usize) -> Vec<Tok> {
        (0..n).map(|i| Tok { req: self.id, pos: (self.m.offset + i) as u32 }).collect()
    }
}

/// An error kind both sides can name (the model's errors carry fewer fields than the production's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Kind {
    NotTrimmable,
    TrimTooLong,
    BypassNotAfterWindow,
    PendingPrefill,
    NoPendingPrefill,
    NoSuchRow { row: usize, rows: usize },
    DuplicateRow { row: usize },
    BadLengths,
    Other(String),
}

fn model_kind(r: &Result<(), ModelError>) -> Result<(), Kind> {
    r.clone().map_err(|e| match e {
        ModelError::NotTrimmable => Kind::NotTrimmable,
        ModelError::TrimTooLong => Kind::TrimTooLong,
        ModelError::BypassNotAfterWindow => Kind::BypassNotAfterWindow,
        ModelError::PendingPrefill => Kind::PendingPrefill,
        ModelError::NoPendingPrefill => Kind::NoPendingPrefill,
        ModelError::NoSuchRow { row, rows } => Kind::NoSuchRow { row, rows },
        ModelError::DuplicateRow { row } => Kind::DuplicateRow { row },
        ModelError::BadLengths { .. } => Kind::BadLengths,
        other => Kind::Other(format!("{other:?}")),
    })
}

fn cache_kind<T>(r: &Result<T, CacheError>) -> Result<(), Kind> {
    match r {
        Ok(_) => Ok(()),
        Err(e) => Err(match e.clone() {
            CacheError::NotTrimmable { .. } => Kind::NotTrimmable,
            CacheError::TrimTooLong { .. } => Kind::TrimTooLong,
            CacheError::BypassNotAfterWindow => Kind::BypassNotAfterWindow,
            CacheError::PendingPrefill => Kind::PendingPrefill,
            CacheError::NoPendingPrefill => Kind::NoPendingPrefill,
            CacheError::NoSuchRow { row, rows } => Kind::NoSuchRow { row, rows },
            CacheError::DuplicateRow { row } => Kind::DuplicateRow { row },
            CacheError::BadLengths { .. } => Kind::BadLengths,
            other => Kind::Other(format!("{other:?}")),
        }),
    }
}

/// The model side: batch rows, requests outside the batch, and the predicted outcome of each fallible call the
/// last transition makes (in call order).
#[derive(Debug, Clone)]
pub struct RefState {
    pub setup: Setup,
    pub rows: Vec<Req>,
    pub solo: Vec<Req>,
    pub next_id: u32,
    pub expect: Vec<Result<(), Kind>>,
}

impl RefState {
    fn batch_model(&self) -> BatchModel {
        BatchModel { max_size: self.setup.window, rows: self.rows.iter().map(|r| r.m.clone()).collect() }
    }

    fn set_batch_model(&mut self, b: BatchModel) {
        for (r, m) in self.rows.iter_mut().zip(b.rows) {
            r.m = m;
        }
    }

    fn fresh(&mut self) -> u32 {
        self.next_id += 1;
        self.next_id - 1
    }
}

/// One scheduler step (indices into the state's `solo` list or batch rows).
#[derive(Debug, Clone)]
pub enum Tr {
    /// A new request with an empty serial cache (outside the batch).
    Admit,
    /// A prefill chunk (window read) on a request outside the batch.
    SoloWindow {
        s: usize,
        len: usize,
    },
    SoloDecode {
        s: usize,
    },
    /// Trim of a request outside the batch; may be illegal (the model predicts the error).
    SoloTrim {
        s: usize,
        n: usize,
        bypass: bool,
    },
    /// A speculative window of `gamma` on a request outside the batch, then `trim(gamma - accept, bypass = true)`
    /// (`accept = 0`: a full rollback, which can leave `W - 1` positions of a wrapped ring).
    SoloVerify {
        s: usize,
        gamma: usize,
        accept: usize,
    },
    /// Serial caches join the batch keeping their physical columns and phase (one `join` with the running batch).
    Join {
        solos: Vec<usize>,
    },
    /// Serial caches' temporal views are merged (`RowBatch::merge`), then joined with the running batch.
    Merge {
        solos: Vec<usize>,
    },
    /// The running batch is rebuilt from its rows' temporal views (`RowBatch::merge` of every row, in order): a
    /// compaction that drops each row's oversize and rotation.
    Remerge,
    /// Fresh requests prefilled right-padded: prepare, chunks of `chunk` (window reads), finalize, join. With
    /// `probe`, the illegal calls in between (decode and prepare while pending, finalize twice).
    Prefill {
        lengths: Vec<usize>,
        chunk: usize,
        probe: bool,
    },
    Decode,
    Window {
        len: usize,
    },
    Append {
        len: usize,
    },
    /// A speculative window of `gamma`, then `trim_rows(gamma - accept[r], bypass = true)`.
    Verify {
        gamma: usize,
        accept: Vec<usize>,
    },
    CommitSpan {
        len: usize,
    },
    /// `extract(row)` then `filter` (out-of-range rows: `NoSuchRow`). Without `finish` the request continues
    /// outside the batch.
    Extract {
        row: usize,
        finish: bool,
    },
    /// `filter(keep)`; may name rows out of range or twice (the model predicts the error).
    Filter {
        keep: Vec<usize>,
    },
    /// Trim every row; may be illegal.
    Trim {
        n: usize,
        bypass: bool,
    },
}

pub struct RefMachine;

fn distinct_in_range(v: &[usize], n: usize) -> bool {
    v.iter().all(|&i| i < n) && (1..v.len()).all(|j| !v[..j].contains(&v[j]))
}

/// A non-empty subset of `0..n` in random order; all of them half the time (several requests enter together).
fn subset(n: usize) -> BoxedStrategy<Vec<usize>> {
    let some = Just((0..n).collect::<Vec<_>>())
        .prop_shuffle()
        .prop_flat_map(move |v| (1..=n).prop_map(move |k| v[..k].to_vec()));
    prop_oneof![Just((0..n).collect::<Vec<_>>()).prop_shuffle(), some].boxed()
}

impl ReferenceStateMachine for RefMachine {
    type State = RefState;
    type Transition = Tr;

    fn init_state() -> BoxedStrategy<RefState> {
        let window = prop_oneof![4 => (2usize..=6).prop_map(Some), 1 => Just(None)];
        let dtype = prop_oneof![Just(KvDtype::F32), Just(KvDtype::Bf16)];
        (window, 1usize..=2, 1usize..=2, prop_oneof![Just(4usize), Just(8)], dtype, any::<u64>())
            .prop_map(|(window, heads_kv, group, head_dim, dtype, seed)| RefState {
                setup: Setup { window, heads_kv, heads_q: heads_kv * group, head_dim, dtype, seed },
                rows: vec![],
                solo: vec![],
                next_id: 0,
                expect: vec![],
            })
            .boxed()
    }

    fn transitions(s: &RefState) -> BoxedStrategy<Tr> {
        let w = s.setup.window.unwrap_or(6);
        let (rows, solos) = (s.rows.len(), s.solo.len());
        let mut choices: Vec<(u32, BoxedStrategy<Tr>)> = vec![
            (if solos < 4 { 3 } else { 1 }, Just(Tr::Admit).boxed()),
            (
                2,
                (prop::collection::vec(0usize..=w + 2, 1..=3), 1usize..=w + 1, any::<bool>())
                    .prop_map(|(lengths, chunk, probe)| Tr::Prefill { lengths, chunk, probe })
                    .boxed(),
            ),
            (1, (0usize..=3, any::<bool>()).prop_map(|(n, bypass)| Tr::Trim { n, bypass }).boxed()),
            (1, (0usize..=rows, any::<bool>()).prop_map(|(row, finish)| Tr::Extract { row, finish }).boxed()),
            (1, prop::collection::vec(0usize..=rows, 0..=rows + 1).prop_map(|keep| Tr::Filter { keep }).boxed()),
        ];
        if solos > 0 {
            choices.extend([
                (4, (0..solos, 1usize..=w + 2).prop_map(|(s, len)| Tr::SoloWindow { s, len }).boxed()),
                (3, (0..solos).prop_map(|s| Tr::SoloDecode { s }).boxed()),
                (
                    2,
                    (0..solos, 0usize..=3, any::<bool>())
                        .prop_map(|(s, n, bypass)| Tr::SoloTrim { s, n, bypass })
                        .boxed(),
                ),
                (
                    2,
                    (0..solos, 1usize..=3)
                        .prop_flat_map(|(s, gamma)| {
                            prop_oneof![Just(0), 0..=gamma].prop_map(move |accept| Tr::SoloVerify { s, gamma, accept })
                        })
                        .boxed(),
                ),
                (3, subset(solos).prop_map(|solos| Tr::Join { solos }).boxed()),
                (3, subset(solos).prop_map(|solos| Tr::Merge { solos }).boxed()),
            ]);
        }
        if rows > 0 {
            choices.extend([
                (8, Just(Tr::Decode).boxed()),
                (2, (1usize..=w + 1).prop_map(|len| Tr::Window { len }).boxed()),
                (1, (1usize..=3).prop_map(|len| Tr::Append { len }).boxed()),
                (
                    3,
                    (1usize..=4)
                        .prop_flat_map(move |gamma| {
                            prop::collection::vec(0..=gamma, rows).prop_map(move |accept| Tr::Verify { gamma, accept })
                        })
                        .boxed(),
                ),
                (1, (1usize..=3).prop_map(|len| Tr::CommitSpan { len }).boxed()),
                (2, Just(Tr::Remerge).boxed()),
            ]);
        }
        proptest::strategy::Union::new_weighted(choices).boxed()
    }

    /// Re-checked while shrinking: a shrunk sequence may have lost the transition that created a row or request.
    fn preconditions(s: &RefState, t: &Tr) -> bool {
        let (rows, solos) = (s.rows.len(), s.solo.len());
        match t {
            Tr::Admit => true,
            Tr::SoloWindow { s: i, len } => *i < solos && *len >= 1,
            Tr::SoloDecode { s: i } | Tr::SoloTrim { s: i, .. } => *i < solos,
            Tr::SoloVerify { s: i, gamma, accept } => *i < solos && *gamma >= 1 && accept <= gamma,
            Tr::Join { solos: v } | Tr::Merge { solos: v } => !v.is_empty() && distinct_in_range(v, solos),
            Tr::Prefill { lengths, chunk, .. } => !lengths.is_empty() && *chunk >= 1,
            Tr::Decode | Tr::Remerge => rows > 0,
            Tr::Window { len } | Tr::Append { len } | Tr::CommitSpan { len } => rows > 0 && *len >= 1,
            Tr::Verify { gamma, accept } => {
                rows > 0 && *gamma >= 1 && accept.len() == rows && accept.iter().all(|a| a <= gamma)
            }
            // May be illegal: the model predicts the error.
            Tr::Extract { .. } | Tr::Filter { .. } | Tr::Trim { .. } => true,
        }
    }

    fn apply(mut s: RefState, t: &Tr) -> RefState {
        s.expect.clear();
        let w = s.setup.window;
        match t {
            Tr::Admit => {
                let id = s.fresh();
                s.solo.push(Req { id, m: RowModel::new(w) });
            }
            Tr::SoloWindow { s: i, len } => {
                let toks = s.solo[*i].next(*len);
                s.solo[*i].m.try_window_write(&toks).unwrap();
            }
            Tr::SoloDecode { s: i } => {
                let tok = s.solo[*i].next(1)[0];
                s.solo[*i].m.try_decode_write(tok).unwrap();
            }
            Tr::SoloTrim { s: i, n, bypass } => {
                let r = s.solo[*i].m.trim(*n, *bypass);
                s.expect.push(model_kind(&r));
            }
            Tr::SoloVerify { s: i, gamma, accept } => {
                let toks = s.solo[*i].next(*gamma);
                s.solo[*i].m.try_window_write(&toks).unwrap();
                let r = s.solo[*i].m.trim(gamma - accept, true);
                s.expect.push(model_kind(&r));
            }
            Tr::Join { solos } | Tr::Merge { solos } => {
                let merge = matches!(t, Tr::Merge { .. });
                let incoming: Vec<Req> = solos.iter().map(|&i| s.solo[i].clone()).collect();
                let mut gone = solos.clone();
                gone.sort_unstable();
                for &i in gone.iter().rev() {
                    s.solo.remove(i);
                }
                for mut r in incoming {
                    if merge {
                        // Layout event: the row is rebuilt from its temporal view (newest min(offset, W)).
                        r.m = RowModel::try_from_temporal(w, r.m.temporal_view(), r.m.offset).unwrap();
                    } else {
                        r.m.base = r.m.offset - r.m.len();
                    }
                    s.rows.push(r);
                }
            }
            Tr::Prefill { lengths, chunk, probe } => {
                let ids: Vec<u32> = lengths.iter().map(|_| s.fresh()).collect();
                let mut pre = BatchModel::merge(w, &vec![(vec![], 0); ids.len()]).unwrap();
                s.expect.push(model_kind(&pre.prepare(lengths)));
                if *probe {
                    let toks: Vec<Tok> = ids.iter().map(|&id| Tok { req: id, pos: 0 }).collect();
                    s.expect.push(model_kind(&pre.clone().decode(&toks).map(|_| ())));
                    s.expect.push(model_kind(&pre.clone().prepare(lengths)));
                }
                let total = lengths.iter().copied().max().unwrap_or(0);
                let mut done = 0;
                while done < total {
                    let l = (*chunk).min(total - done);
                    let toks: Vec<Vec<Tok>> = ids
                        .iter()
                        .zip(&pre.rows)
                        .map(|(&id, m)| (0..l).map(|i| Tok { req: id, pos: (m.offset + i) as u32 }).collect())
                        .collect();
                    pre.window(&toks).unwrap();
                    done += l;
                }
                s.expect.push(model_kind(&pre.finalize()));
                if *probe {
                    s.expect.push(model_kind(&pre.clone().finalize()));
                }
                for (id, m) in ids.into_iter().zip(pre.rows) {
                    s.rows.push(Req { id, m });
                }
            }
            Tr::Remerge => {
                for r in &mut s.rows {
                    r.m = RowModel::try_from_temporal(w, r.m.temporal_view(), r.m.offset).unwrap();
                }
            }
            Tr::Decode => {
                for r in &mut s.rows {
                    let tok = r.next(1)[0];
                    r.m.try_decode_write(tok).unwrap();
                }
            }
            Tr::Window { len } | Tr::Append { len } => {
                for r in &mut s.rows {
                    let toks = r.next(*len);
                    r.m.try_window_write(&toks).unwrap();
                }
            }
            Tr::Verify { gamma, accept } => {
                for r in &mut s.rows {
                    let toks = r.next(*gamma);
                    r.m.try_window_write(&toks).unwrap();
                }
                let rollback: Vec<usize> = accept.iter().map(|a| gamma - a).collect();
                let mut b = s.batch_model();
                s.expect.push(model_kind(&b.trim_rows(&rollback, true)));
                s.set_batch_model(b);
            }
            Tr::CommitSpan { len } => {
                for r in &mut s.rows {
                    for tok in r.next(*len) {
                        r.m.try_decode_write(tok).unwrap();
                    }
                }
            }
            Tr::Extract { row, finish } => {
                let b = s.batch_model();
                let r = b.extract(*row).map(|_| ());
                s.expect.push(model_kind(&r));
                if r.is_ok() {
                    let mut req = s.rows.remove(*row);
                    if !finish {
                        req.m = req.m.extract();
                        s.solo.push(req);
                    }
                }
            }
            Tr::Filter { keep } => {
                let mut b = s.batch_model();
                let r = b.filter(keep);
                s.expect.push(model_kind(&r));
                if r.is_ok() {
                    s.rows = keep.iter().map(|&i| s.rows[i].clone()).collect();
                }
            }
            Tr::Trim { n, bypass } => {
                let mut b = s.batch_model();
                let r = b.trim(*n, *bypass).map(|_| ());
                s.expect.push(model_kind(&r));
                s.set_batch_model(b);
            }
        }
        s
    }
}

// ----- the system under test -----------------------------------------------------------------------------------------

/// Production caches and their solo twins.
pub struct Sut {
    pay: Payload,
    window: Option<usize>,
    batch: RowBatch,
    /// The solo twin of each batch row.
    twins: Vec<SerialCache>,
    /// Requests outside the batch: (production serial cache, twin).
    solo: Vec<(SerialCache, SerialCache)>,
    /// The reference state before the transition being applied (ids and positions of the tokens to write).
    prev: RefState,
}

fn ring(m: &RowModel) -> RingState {
    RingState { offset: m.offset, len: m.len(), idx: m.idx, last_concat: m.last_concat }
}

#[track_caller]
fn expect_outcome(what: &str, want: &Result<(), Kind>, got: Result<(), Kind>) {
    assert_eq!(&got, want, "{what}: production outcome vs the model's prediction");
}

impl Sut {
    fn new_serial(&self) -> SerialCache {
        SerialCache::new(self.pay.spec, self.window).unwrap()
    }

    fn real(toks: &[Tok]) -> Vec<Vec<Option<Tok>>> {
        vec![toks.iter().copied().map(Some).collect()]
    }

    /// The batch-wide window write (`read`: window, else append), twins fed each row's tokens, outputs compared.
    fn batch_window(&mut self, len: usize, read: bool) {
        let toks: Vec<Vec<Tok>> = self.prev.rows.iter().map(|r| r.next(len)).collect();
        let opt: Vec<Vec<Option<Tok>>> = toks.iter().map(|t| t.iter().copied().map(Some).collect()).collect();
        let (k, v, q) = self.pay.kvq(&opt);
        let scale = self.pay.scale();
        if read {
            let (out, _) = self.batch.window(&k, &v, &q, scale, &Masks::new()).expect("window");
            let ob = bytes(&out);
            for (r, twin) in self.twins.iter_mut().enumerate() {
                let (tk, tv, tq) = self.pay.kvq1(&toks[r]);
                let (to, _) = twin.window(&tk, &tv, &tq, scale, &Masks::new()).expect("twin window");
                assert_row_output("window output", &ob, r, &to, len);
            }
        } else {
            self.batch.append(&k, &v).expect("append");
            for (r, twin) in self.twins.iter_mut().enumerate() {
                let (tk, tv, _) = self.pay.kvq1(&toks[r]);
                twin.append(&tk, &tv).expect("twin append");
            }
        }
    }

    fn decode(&mut self) {
        let toks: Vec<Tok> = self.prev.rows.iter().map(|r| r.next(1)[0]).collect();
        let opt: Vec<Vec<Option<Tok>>> = toks.iter().map(|t| vec![Some(*t)]).collect();
        let (k, v, q) = self.pay.kvq(&opt);
        let scale = self.pay.scale();
        let rope = self.batch.rope_offsets();
        let before = rope.values();
        let (out, _) = self.batch.decode(&k, &v, &q, scale, &Masks::new()).expect("decode");
        assert_eq!(rope.values(), before, "rope_offsets taken before a decode is a value, not a live view");
        let ob = bytes(&out);
        for (r, twin) in self.twins.iter_mut().enumerate() {
            let (tk, tv, tq) = self.pay.kvq1(&toks[r..=r]);
            let (to, _) = twin.decode(&tk, &tv, &tq, scale, &Masks::new()).expect("twin decode");
            assert_row_output("decode output", &ob, r, &to, 1);
        }
    }

    fn commit_span(&mut self, len: usize) {
        let toks: Vec<Vec<Tok>> = self.prev.rows.iter().map(|r| r.next(len)).collect();
        let opt: Vec<Vec<Option<Tok>>> = toks.iter().map(|t| t.iter().copied().map(Some).collect()).collect();
        let (k, v, q) = self.pay.kvq(&opt);
        let scale = self.pay.scale();
        let out = self.batch.commit_span(&k, &v, &q, scale, &Masks::new()).expect("commit_span");
        let ob = bytes(&out);
        for (r, twin) in self.twins.iter_mut().enumerate() {
            let (tk, tv, tq) = self.pay.kvq1(&toks[r]);
            let to = twin.commit_span(&tk, &tv, &tq, scale, &Masks::new()).expect("twin commit_span");
            assert_row_output("commit_span output", &ob, r, &to, len);
        }
    }

    fn prefill(&mut self, lengths: &[usize], chunk: usize, probe: bool, after: &RefState) {
        let (spec, w, scale) = (self.pay.spec, self.window, self.pay.scale());
        let first = self.prev.next_id;
        let ids: Vec<u32> = (0..lengths.len() as u32).map(|i| first + i).collect();
        let mut pre = RowBatch::with_rows(spec, w, lengths.len()).unwrap();
        let mut twins: Vec<SerialCache> = ids.iter().map(|_| self.new_serial()).collect();
        let mut expect = after.expect.iter();
        expect_outcome("prepare", expect.next().unwrap(), cache_kind(&pre.prepare(lengths)));
        if probe {
            let opt: Vec<Vec<Option<Tok>>> = ids.iter().map(|&id| vec![Some(Tok { req: id, pos: 0 })]).collect();
            let (k, v, q) = self.pay.kvq(&opt);
            expect_outcome(
                "decode while pending",
                expect.next().unwrap(),
                cache_kind(&pre.decode(&k, &v, &q, scale, &Masks::new())),
            );
            expect_outcome("prepare while pending", expect.next().unwrap(), cache_kind(&pre.prepare(lengths)));
        }
        let total = lengths.iter().copied().max().unwrap_or(0);
        let mut done = 0;
        let mut offsets = vec![0usize; lengths.len()];
        while done < total {
            let l = chunk.min(total - done);
            let mut opt = vec![];
            let mut reals = vec![];
            for (r, &id) in ids.iter().enumerate() {
                let n = lengths[r].saturating_sub(done).min(l);
                let real: Vec<Tok> = (0..n).map(|i| Tok { req: id, pos: (offsets[r] + i) as u32 }).collect();
                let mut row: Vec<Option<Tok>> = real.iter().copied().map(Some).collect();
                row.resize(l, None);
                opt.push(row);
                offsets[r] += n;
                reals.push(real);
            }
            let (k, v, q) = self.pay.kvq(&opt);
            let (out, _) = pre.window(&k, &v, &q, scale, &Masks::new()).expect("prefill window");
            let ob = bytes(&out);
            for (r, twin) in twins.iter_mut().enumerate() {
                if reals[r].is_empty() {
                    continue;
                }
                let (tk, tv, tq) = self.pay.kvq1(&reals[r]);
                let (to, _) = twin.window(&tk, &tv, &tq, scale, &Masks::new()).expect("twin prefill window");
                assert_row_output("padded prefill output (real queries)", &ob, r, &to, reals[r].len());
            }
            done += l;
        }
        expect_outcome("finalize", expect.next().unwrap(), cache_kind(&pre.finalize()));
        if probe {
            expect_outcome("finalize twice", expect.next().unwrap(), cache_kind(&pre.finalize()));
        }
        let all: Vec<usize> = (0..self.batch.rows()).collect();
        let joined = RowBatch::join(
            spec,
            w,
            &[JoinSource::Rows(&self.batch, all), JoinSource::Rows(&pre, (0..lengths.len()).collect())],
        );
        self.batch = joined.expect("join prefilled rows");
        self.twins.extend(twins);
    }

    fn enter(&mut self, solos: &[usize], merge: bool) {
        let (spec, w) = (self.pay.spec, self.window);
        let all: Vec<usize> = (0..self.batch.rows()).collect();
        if merge {
            let slices: Vec<(mlx_rs::Array, mlx_rs::Array, usize)> = solos
                .iter()
                .map(|&i| {
                    let (k, v) = self.solo[i].0.temporal_view().expect("temporal_view");
                    (k, v, self.prev.solo[i].m.offset)
                })
                .collect();
            let incoming = RowBatch::merge(spec, w, &slices).expect("merge");
            let joined = RowBatch::join(
                spec,
                w,
                &[JoinSource::Rows(&self.batch, all), JoinSource::Rows(&incoming, (0..solos.len()).collect())],
            );
            self.batch = joined.expect("join merged rows");
        } else {
            let mut sources = vec![JoinSource::Rows(&self.batch, all)];
            sources.extend(solos.iter().map(|&i| JoinSource::Serial(&self.solo[i].0)));
            let joined = RowBatch::join(spec, w, &sources);
            self.batch = joined.expect("join serial caches");
        }
        let mut moving: Vec<(usize, SerialCache)> = solos.iter().map(|&i| (i, self.solo[i].1.clone())).collect();
        let mut gone = solos.to_vec();
        gone.sort_unstable();
        for &i in gone.iter().rev() {
            self.solo.remove(i);
        }
        for (i, twin) in moving.iter_mut() {
            if merge {
                // The twin mirrors the layout event: rebuilt from its temporal view.
                let (k, v) = twin.temporal_view().unwrap();
                *twin = SerialCache::from_temporal(spec, w, &k, &v, self.prev.solo[*i].m.offset).unwrap();
            }
        }
        self.twins.extend(moving.into_iter().map(|(_, t)| t));
    }

    fn remerge(&mut self) {
        let (spec, w) = (self.pay.spec, self.window);
        let slices: Vec<(mlx_rs::Array, mlx_rs::Array, usize)> = (0..self.batch.rows())
            .map(|r| {
                let (k, v) = self.batch.row_temporal_view(r).expect("row_temporal_view");
                (k, v, self.prev.rows[r].m.offset)
            })
            .collect();
        self.batch = RowBatch::merge(spec, w, &slices).expect("merge of the batch's temporal views");
        for (twin, req) in self.twins.iter_mut().zip(&self.prev.rows) {
            let (k, v) = twin.temporal_view().unwrap();
            *twin = SerialCache::from_temporal(spec, w, &k, &v, req.m.offset).unwrap();
        }
    }

    fn extract(&mut self, row: usize, finish: bool, want: &Result<(), Kind>) {
        let got = self.batch.extract(row);
        expect_outcome("extract", want, cache_kind(&got));
        let Ok(extracted) = got else { return };
        let keep: Vec<usize> = (0..self.batch.rows()).filter(|&r| r != row).collect();
        self.batch.filter(&keep).expect("filter after extract");
        let mut twin = self.twins.remove(row);
        if !finish {
            // Layout event: extract de-rolls the row into a fresh serial cache; the twin follows.
            twin.relinearize().unwrap();
            let (k, v) = twin.physical().unwrap();
            twin = SerialCache::from_temporal(self.pay.spec, self.window, &k, &v, twin.offset()).unwrap();
            self.solo.push((extracted, twin));
        }
    }

    /// Everything the model says about one request's storage: state, physical and temporal bytes, vs the twin.
    fn check_storage(
        &self,
        what: &str,
        m: &RowModel,
        phys: (mlx_rs::Array, mlx_rs::Array),
        temporal: (mlx_rs::Array, mlx_rs::Array),
        twin: &SerialCache,
    ) {
        assert_eq!(twin.state(), &ring(m), "{what}: twin state vs model ({})", m.picture());
        let tp = twin.physical().unwrap();
        let tt = twin.temporal_view().unwrap();
        assert_same_bytes(&format!("{what}: K physical vs twin"), &phys.0, &tp.0);
        assert_same_bytes(&format!("{what}: V physical vs twin"), &phys.1, &tp.1);
        assert_same_bytes(&format!("{what}: K temporal view vs twin"), &temporal.0, &tt.0);
        assert_same_bytes(&format!("{what}: V temporal view vs twin"), &temporal.1, &tt.1);
        self.pay.assert_columns(&format!("{what}: physical ({})", m.picture()), Tensor::K, &phys.0, &m.cols);
        self.pay.assert_columns(&format!("{what}: physical ({})", m.picture()), Tensor::V, &phys.1, &m.cols);
        let view = m.temporal_view();
        self.pay.assert_columns(&format!("{what}: temporal view ({})", m.picture()), Tensor::K, &temporal.0, &view);
        self.pay.assert_columns(&format!("{what}: temporal view ({})", m.picture()), Tensor::V, &temporal.1, &view);
    }
}

pub struct CacheMachine;

impl StateMachineTest for CacheMachine {
    type SystemUnderTest = Sut;
    type Reference = RefMachine;

    fn init_test(r: &RefState) -> Sut {
        mlx_rs::Device::set_default(&mlx_rs::Device::cpu());
        let spec = r.setup.spec();
        Sut {
            pay: Payload::new(spec, r.setup.heads_q, r.setup.seed),
            window: r.setup.window,
            batch: RowBatch::empty(spec, r.setup.window).unwrap(),
            twins: vec![],
            solo: vec![],
            prev: r.clone(),
        }
    }

    fn apply(mut sut: Sut, after: &RefState, t: Tr) -> Sut {
        let scale = sut.pay.scale();
        match &t {
            Tr::Admit => {
                let pair = (sut.new_serial(), sut.new_serial());
                sut.solo.push(pair);
            }
            Tr::SoloWindow { s, len } => {
                let toks = sut.prev.solo[*s].next(*len);
                let (k, v, q) = sut.pay.kvq(&Sut::real(&toks));
                let (prod, twin) = &mut sut.solo[*s];
                let a = prod.window(&k, &v, &q, scale, &Masks::new()).expect("solo window").0;
                let b = twin.window(&k, &v, &q, scale, &Masks::new()).expect("twin window").0;
                assert_same_bytes("solo window output", &a, &b);
            }
            Tr::SoloDecode { s } => {
                let toks = sut.prev.solo[*s].next(1);
                let (k, v, q) = sut.pay.kvq(&Sut::real(&toks));
                let (prod, twin) = &mut sut.solo[*s];
                let a = prod.decode(&k, &v, &q, scale, &Masks::new()).expect("solo decode").0;
                let b = twin.decode(&k, &v, &q, scale, &Masks::new()).expect("twin decode").0;
                assert_same_bytes("solo decode output", &a, &b);
            }
            Tr::SoloTrim { s, n, bypass } => {
                let (prod, twin) = &mut sut.solo[*s];
                expect_outcome("solo trim", &after.expect[0], cache_kind(&prod.trim(*n, *bypass)));
                expect_outcome("twin trim", &after.expect[0], cache_kind(&twin.trim(*n, *bypass)));
            }
            Tr::SoloVerify { s, gamma, accept } => {
                let toks = sut.prev.solo[*s].next(*gamma);
                let (k, v, q) = sut.pay.kvq(&Sut::real(&toks));
                let (prod, twin) = &mut sut.solo[*s];
                let a = prod.window(&k, &v, &q, scale, &Masks::new()).expect("solo verify window").0;
                let b = twin.window(&k, &v, &q, scale, &Masks::new()).expect("twin verify window").0;
                assert_same_bytes("solo verify output", &a, &b);
                expect_outcome("solo rollback", &after.expect[0], cache_kind(&prod.trim(gamma - accept, true)));
                expect_outcome("twin rollback", &after.expect[0], cache_kind(&twin.trim(gamma - accept, true)));
            }
            Tr::Join { solos } => sut.enter(solos, false),
            Tr::Merge { solos } => sut.enter(solos, true),
            Tr::Prefill { lengths, chunk, probe } => sut.prefill(lengths, *chunk, *probe, after),
            Tr::Decode => sut.decode(),
            Tr::Remerge => sut.remerge(),
            Tr::Window { len } => sut.batch_window(*len, true),
            Tr::Append { len } => sut.batch_window(*len, false),
            Tr::Verify { gamma, accept } => {
                sut.batch_window(*gamma, true);
                let rollback: Vec<usize> = accept.iter().map(|a| gamma - a).collect();
                expect_outcome(
                    "verify rollback (trim_rows bypass)",
                    &after.expect[0],
                    cache_kind(&sut.batch.trim_rows(&rollback, true)),
                );
                for (twin, &n) in sut.twins.iter_mut().zip(&rollback) {
                    expect_outcome("twin rollback", &after.expect[0], cache_kind(&twin.trim(n, true)));
                }
            }
            Tr::CommitSpan { len } => sut.commit_span(*len),
            Tr::Extract { row, finish } => sut.extract(*row, *finish, &after.expect[0]),
            Tr::Filter { keep } => {
                let got = sut.batch.filter(keep);
                expect_outcome("filter", &after.expect[0], cache_kind(&got));
                if got.is_ok() {
                    sut.twins = keep.iter().map(|&i| sut.twins[i].clone()).collect();
                }
            }
            Tr::Trim { n, bypass } => {
                let got = sut.batch.trim(*n, *bypass);
                expect_outcome("batch trim", &after.expect[0], cache_kind(&got));
                if got.is_ok() {
                    assert_eq!(got, Ok(*n), "trim returns n");
                    for twin in &mut sut.twins {
                        twin.trim(*n, *bypass).expect("twin trim");
                    }
                }
            }
        }
        sut.prev = after.clone();
        sut
    }

    fn check_invariants(sut: &Sut, r: &RefState) {
        let b = &sut.batch;
        assert_eq!(b.rows(), r.rows.len(), "row count");
        assert_eq!(sut.twins.len(), r.rows.len(), "twin count");
        assert_eq!(sut.solo.len(), r.solo.len(), "requests outside the batch");
        let model = r.batch_model();
        assert_eq!(b.left_padding(), model.left_padding(), "left padding");
        assert_eq!(b.is_trimmable(), model.is_trimmable(), "batch is_trimmable");
        let rope: Vec<i32> = model.rope_offsets().iter().map(|&o| o as i32).collect();
        assert_eq!(b.rope_offsets().values(), rope, "rope offsets");
        assert_eq!(b.offset(), model.offset(), "scalar offset");
        assert_eq!(b.max_size(), r.setup.window, "window");
        assert_eq!(b.spec(), r.setup.spec(), "spec");
        for (i, req) in r.rows.iter().enumerate() {
            let what = format!("row {i} (request {})", req.id);
            let st = &b.row_states()[i];
            assert_eq!(st.ring, ring(&req.m), "{what}: RingState vs model ({})", req.m.picture());
            assert_eq!(st.base, req.m.base, "{what}: base");
            assert_eq!(st.pending, req.m.pending, "{what}: pending");
            let ring_phase = b.row_decode_phase(i).unwrap() == DecodePhase::Ring;
            assert_eq!(ring_phase, req.m.decode_phase_is_ring(), "{what}: row_decode_phase vs model");
            let phys = b.row_physical(i).unwrap();
            let temporal = b.row_temporal_view(i).unwrap();
            sut.check_storage(&what, &req.m, phys, temporal, &sut.twins[i]);
        }
        // Capacity (R-BROT-9): the buffers hold at most the live rows' bound, and the arrays the bytes accounted.
        let longest = r.rows.iter().map(|req| req.m.cols.len()).max();
        let bound = match (longest, r.setup.window) {
            (None, _) => 0,
            (Some(l), Some(w)) => w.max(l),
            (Some(l), None) => l + kvsim::cache::ring::GROW_STEP - 1,
        };
        assert!(b.cap() <= bound, "capacity: {} columns held, the live rows need {bound}\n{}", b.cap(), b.picture());
        assert_eq!(b.capacity_bound(), bound, "capacity_bound");
        assert_eq!(b.held_bytes(), b.rows() * b.cap() * b.bytes_per_token(), "held bytes");
        // `adopt` of the batch's own buffers and row states is the same batch (R-BROT-8).
        if let Some((k, v)) = b.buffers() {
            let adopted = RowBatch::adopt(b.spec(), b.max_size(), k, v, b.row_states().to_vec()).unwrap();
            assert_eq!(adopted.row_states(), b.row_states(), "adopt of the batch's own buffers and states");
        }
        for (i, req) in r.solo.iter().enumerate() {
            let what = format!("solo request {}", req.id);
            let (prod, twin) = &sut.solo[i];
            assert_eq!(prod.state(), &ring(&req.m), "{what}: RingState vs model ({})", req.m.picture());
            assert_eq!(prod.is_trimmable(), req.m.is_trimmable(), "{what}: is_trimmable");
            assert_eq!(prod.rope_offset(), req.m.offset, "{what}: rope_offset");
            assert_eq!(prod.max_size(), r.setup.window, "{what}: window");
            sut.check_storage(&what, &req.m, prod.physical().unwrap(), prod.temporal_view().unwrap(), twin);
        }
    }
}

fn cases() -> u32 {
    std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(48)
}

/// `proptest-regressions/it/state_machine.txt`, unless `PROPTEST_DISABLE_FAILURE_PERSISTENCE` is set (as it should be
/// under `cargo mutants --in-place`, whose mutants would otherwise record seeds that fail only when mutated).
fn persistence() -> Option<Box<dyn proptest::test_runner::FailurePersistence>> {
    if std::env::var_os("PROPTEST_DISABLE_FAILURE_PERSISTENCE").is_some() {
        return None;
    }
    Some(Box::new(proptest::test_runner::FileFailurePersistence::Direct(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/proptest-regressions/it/state_machine.txt"
    ))))
}

prop_state_machine! {
    #![proptest_config(Config {
        cases: cases(),
        failure_persistence: persistence(),
        ..Config::default()
    })]

    /// Production row batches and serial caches follow the reference model and their solo twins bit for bit,
    /// through every transition (legal or not).
    #[test]
    fn caches_follow_the_model_and_their_twins(sequential 1..30 => CacheMachine);
}

/// The state machine has teeth: each planted bug of the mutation catalog makes it fail within 256 cases (fixed RNG
/// seed, so the test is deterministic). `TEETH_ONLY=<mutant name>` and `TEETH_CASES=N` narrow or widen it.
#[test]
fn every_catalog_mutant_is_caught() {
    use kvsim::cache::faults::{self, Mutant};
    use proptest::test_runner::TestRunner;
    let _x = common::exclusive();
    let mut missed = vec![];
    let only = std::env::var("TEETH_ONLY").ok();
    let teeth: u32 = std::env::var("TEETH_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(256);
    // The state machine drives plain caches: the quantized and bf16-first mutants' hooks are out of its reach (the
    // simulator's quantized and transition families, `src/cache/quant/tests.rs` and `tests/it/mutants.rs` catch them).
    for &m in Mutant::ALL
        .iter()
        // `floor-not-persisted` lives in the persistence codecs, which the state machine never calls (the simulator's
        // save/restore step catches it); `encoder-window-from-cache` in the encoder read, which it never makes (the
        // simulator's encoder op catches it).
        .filter(|m| {
            m.in_simulator()
                && m.layout() == "kv"
                && !m.name().starts_with("quant-")
                && !m.name().starts_with("tkv-")
                && **m != Mutant::FloorNotPersisted
                && **m != Mutant::EncoderWindowFromCache
                && only.as_deref().is_none_or(|o| o == m.name())
        })
    {
        faults::arm(Some(m));
        let config = Config {
            cases: teeth,
            max_shrink_iters: 0,
            failure_persistence: None,
            rng_seed: proptest::test_runner::RngSeed::Fixed(0x6b_7673_696d),
            ..Config::default()
        };
        let mut runner = TestRunner::new(config.clone());
        // No shrinking and no seen-transition counter (the strategy asserts that counter is reset by a shrink).
        let result = runner.run(&RefMachine::sequential_strategy(1..30), |(init, transitions, _seen)| {
            CacheMachine::test_sequential(config.clone(), init, transitions, None);
            Ok(())
        });
        faults::arm(None);
        if result.is_ok() {
            missed.push(m.name());
        }
    }
    assert!(missed.is_empty(), "mutants the state machine did not catch: {missed:?}");
}
