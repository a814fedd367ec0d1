//! The bf16-first family end to end: seeded schedules (decodes, windows, prefill chunks split by a sibling, speculative
//! rounds with unequal accepts, admissions, filters, prefix reuse, bad input) drive `TransitioningKvRows` beside one
//! serial lego twin per request and the reference lifecycle model (`reference::transition::RowsModel`). After every
//! op: each row's conversion offset, floor, offset and packing equal the model's; each row's stored planes (temporal
//! view, bytes) equal its twin's; reads equal the twin's bytes whenever the row and the twin hold the same physical
//! columns. The schedules must cross `start` inside a window, inside a round and inside a prefill, and roll back
//! across the wrap.

use kvsim::bytes::ArrayBytes;
use kvsim::cache::transition::{Bf16FirstCache, Transition, TransitioningKvRows};
use kvsim::cache::{CacheError, KvDtype, KvSpec, Masks, QuantSpec};
use kvsim::reference::transition::{LegoModel, LifecycleRow, RowsModel, TransitionSpec};
use kvsim::reference::Tok;
use mlx_rs::Array;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

const HQ: usize = 4;

fn data(rng: &mut ChaCha8Rng, b: usize, h: usize, l: usize, d: usize) -> Array {
    let vals: Vec<f32> = (0..b * h * l * d).map(|_| rng.random_range(-2.0f32..2.0)).collect();
    Array::from_slice(&vals, &[b as i32, h as i32, l as i32, d as i32]).as_dtype(mlx_rs::Dtype::Bfloat16).unwrap()
}

fn words(a: &Array) -> ArrayBytes {
    ArrayBytes::of(a).unwrap()
}

fn planes_bytes(p: &[Array]) -> Vec<ArrayBytes> {
    p.iter().map(words).collect()
}

fn row(a: &Array, r: usize) -> Array {
    a.index((r as i32..r as i32 + 1, .., .., ..))
}

use mlx_rs::ops::indexing::IndexOp;

#[derive(Default, Debug)]
struct Seen {
    conversions: usize,
    crossed_in_window: usize,
    crossed_in_round: usize,
    crossed_in_prefill: usize,
    unequal_rounds: usize,
    rollbacks_across_wrap: usize,
    packed: usize,
    refused: usize,
}

struct World {
    spec: KvSpec,
    w: Option<usize>,
    rows: TransitioningKvRows,
    twins: Vec<Bf16FirstCache>,
    model: RowsModel,
    model_twins: Vec<LegoModel>,
    reqs: Vec<u32>,
    next_req: u32,
    rng: ChaCha8Rng,
    masks: Masks,
}

impl World {
    fn toks(&self, i: usize, l: usize) -> Vec<Tok> {
        let o = self.model_twins[i].row.offset();
        (o..o + l).map(|p| Tok::new(self.reqs[i], p as u32)).collect()
    }

    fn kvq(&mut self, b: usize, l: usize) -> (Array, Array, Array) {
        let (h, d) = (self.spec.heads_kv, self.spec.head_dim);
        (data(&mut self.rng, b, h, l, d), data(&mut self.rng, b, h, l, d), data(&mut self.rng, b, HQ, l, d))
    }

    fn check(&self, what: &str) {
        let n = self.rows.rows();
        assert_eq!(n, self.model.rows.len(), "{what}: rows");
        assert_eq!(self.rows.is_packed(), self.model.packed, "{what}: packed");
        assert_eq!(self.rows.minimum_reusable_offset(), self.model.minimum_reusable_offset(), "{what}: floor");
        assert_eq!(self.rows.max_append_tokens(), self.model.max_append_tokens(), "{what}: max_append_tokens");
        for i in 0..n {
            let (p, m) = (self.rows.lifecycle()[i], &self.model.rows[i]);
            assert_eq!((p.converted_at, p.floor, p.left_pad), (m.converted_at, m.floor, m.left_pad), "{what}: row {i}");
            assert_eq!(self.rows.offsets()[i], m.offset(), "{what}: row {i} offset");
            assert_eq!(self.twins[i].converted_at(), m.converted_at, "{what}: twin {i} conversion");
            let back = self.rows.extract(i).unwrap();
            assert_eq!(
                planes_bytes(&back.inner().temporal_view_planes().unwrap()),
                planes_bytes(&self.twins[i].inner().temporal_view_planes().unwrap()),
                "{what}: row {i} planes vs its lego twin"
            );
        }
    }

    /// Same physical columns (and storage) as the twin: reads are then required to be byte-identical.
    fn same_physical(&self) -> Vec<bool> {
        (0..self.rows.rows())
            .map(|i| {
                planes_bytes(&self.rows.row_physical_planes(i).unwrap())
                    == planes_bytes(&self.twins[i].inner().physical_planes().unwrap())
            })
            .collect()
    }

    /// One forward of `l` positions per row; twins get the same block (one append each).
    fn forward(&mut self, l: usize, decode: bool) -> Vec<usize> {
        let n = self.rows.rows();
        let same = self.same_physical();
        let (k, v, q) = self.kvq(n, l);
        let (out, conv) = if decode {
            self.rows.decode(&k, &v, &q, 0.3, &self.masks).unwrap()
        } else {
            self.rows.window(&k, &v, &q, 0.3, &self.masks).unwrap()
        };
        let toks: Vec<Vec<Tok>> = (0..n).map(|i| self.toks(i, l)).collect();
        let (_, mconv) = self.model.append(&toks, decode).unwrap();
        assert_eq!(conv, mconv, "conversions vs the model");
        let packed = self.rows.is_packed();
        for i in 0..n {
            let (ki, vi, qi) = (row(&k, i), row(&v, i), row(&q, i));
            let o = if decode {
                self.twins[i].decode(&ki, &vi, &qi, 0.3, &self.masks).unwrap().0
            } else {
                self.twins[i].window(&ki, &vi, &qi, 0.3, &self.masks).unwrap().0
            };
            self.model_twins[i].append(&toks[i], decode).unwrap();
            if same[i] && !packed {
                assert_eq!(words(&row(&out, i)), words(&o), "row {i} read vs its lego twin");
            }
        }
        conv
    }
}

fn run(seed: u64, seen: &mut Seen) {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let spec = KvSpec { heads_kv: 2, head_dim: 32, dtype: KvDtype::Bf16 };
    let w = [None, Some(4), Some(6)][rng.random_range(0..3)];
    let start = match rng.random_range(0..6) {
        0 => Some(0),
        1 => None,
        _ => Some(rng.random_range(2..10)),
    };
    let t = Transition { start, quant: QuantSpec { bits: 4, group: 32 } };
    let ts = TransitionSpec { max_size: w, start, bits: 4, group: 32 };
    let masks = Masks::new();
    let n0 = rng.random_range(1..4);
    let mut twins = Vec::new();
    let mut model_twins = Vec::new();
    for i in 0..n0 {
        let mut lego = Bf16FirstCache::new(spec, w, t).unwrap();
        let mut m = LegoModel::new(ts).unwrap();
        let l = rng.random_range(1..6);
        let (h, d) = (spec.heads_kv, spec.head_dim);
        let (k, v, q) = (data(&mut rng, 1, h, l, d), data(&mut rng, 1, h, l, d), data(&mut rng, 1, HQ, l, d));
        lego.window(&k, &v, &q, 0.3, &masks).unwrap();
        m.append(&(0..l).map(|p| Tok::new(i as u32, p as u32)).collect::<Vec<_>>(), false).unwrap();
        twins.push(lego);
        model_twins.push(m);
    }
    let rows = TransitioningKvRows::merge(spec, w, t, twins.clone()).unwrap();
    let model = RowsModel::merge(ts, model_twins.iter().map(|m| m.row.clone()).collect()).unwrap();
    let mut wd = World {
        spec,
        w,
        rows,
        twins,
        model,
        model_twins,
        reqs: (0..n0 as u32).collect(),
        next_req: n0 as u32,
        rng,
        masks,
    };
    wd.check("merge");
    for step in 0..16 {
        let n = wd.rows.rows();
        let below: Vec<bool> = (0..n).map(|i| wd.rows.lifecycle()[i].converted_at.is_none()).collect();
        match wd.rng.random_range(0..10) {
            0 | 1 => {
                seen.conversions += wd.forward(1, true).len();
            }
            2 | 3 => {
                let l = wd.rng.random_range(2..5);
                let conv = wd.forward(l, false);
                seen.crossed_in_window += conv.len();
                seen.conversions += conv.len();
            }
            4 | 5 => {
                // A round: a verify window, unequal per-row accepts, rollback (or commit on full accept).
                let l = wd.rng.random_range(2..5);
                let wrapped: Vec<bool> = wd.rows.offsets().iter().map(|&o| wd.w.is_some_and(|w| o >= w)).collect();
                wd.rows.round_begin().unwrap();
                wd.model.round_begin().unwrap();
                for i in 0..n {
                    wd.twins[i].round_begin().unwrap();
                    wd.model_twins[i].round_begin().unwrap();
                }
                let conv = wd.forward(l, false);
                assert!(conv.is_empty(), "no conversion inside a round");
                let keep: Vec<usize> = (0..n).map(|_| wd.rng.random_range(0..=l)).collect();
                // Bad input: keeping more than the round wrote changes nothing.
                let mut bad = keep.clone();
                bad[0] = l + 1;
                let before = (wd.rows.offsets(), wd.rows.lifecycle().to_vec());
                assert!(matches!(wd.rows.round_rollback(&bad), Err(CacheError::KeepTooLong { .. })));
                assert_eq!((wd.rows.offsets(), wd.rows.lifecycle().to_vec()), before);
                seen.refused += 1;
                let crossing: usize =
                    (0..n).filter(|&i| below[i] && start.is_some_and(|s| wd.rows.offsets()[i] >= s && s > 0)).count();
                let conv = if keep.iter().all(|&k| k == l) {
                    for i in 0..n {
                        wd.twins[i].round_commit().unwrap();
                        wd.model_twins[i].round_commit().unwrap();
                    }
                    wd.model.round_commit().unwrap();
                    wd.rows.round_commit().unwrap()
                } else {
                    for i in 0..n {
                        wd.twins[i].round_rollback(keep[i]).unwrap();
                        wd.model_twins[i].round_rollback(keep[i]).unwrap();
                    }
                    wd.model.round_rollback(&keep).unwrap();
                    if keep.iter().any(|&k| k != keep[0]) {
                        seen.unequal_rounds += 1;
                    }
                    if wrapped.iter().zip(&keep).any(|(&wr, &k)| wr && k < l) {
                        seen.rollbacks_across_wrap += 1;
                    }
                    wd.rows.round_rollback(&keep).unwrap().1
                };
                if crossing > 0 {
                    seen.crossed_in_round += 1;
                }
                seen.conversions += conv.len();
            }
            6 => {
                // A prefill chunk of `planned` positions per request, split by a sibling into two forwards.
                let planned = wd.rng.random_range(2..7);
                let split = wd.rng.random_range(1..planned);
                wd.rows.begin_prefill().unwrap();
                wd.model.begin_prefill().unwrap();
                let (k1, v1, q1) = wd.kvq(n, split);
                let (k2, v2, q2) = wd.kvq(n, planned - split);
                wd.rows.window(&k1, &v1, &q1, 0.3, &wd.masks).unwrap();
                wd.rows.window(&k2, &v2, &q2, 0.3, &wd.masks).unwrap();
                let t1: Vec<Vec<Tok>> = (0..n).map(|i| wd.toks(i, split)).collect();
                wd.model.append(&t1, false).unwrap();
                let t2: Vec<Vec<Tok>> = (0..n)
                    .map(|i| {
                        (split..planned)
                            .map(|j| Tok::new(wd.reqs[i], (wd.model_twins[i].row.offset() + j) as u32))
                            .collect()
                    })
                    .collect();
                wd.model.append(&t2, false).unwrap();
                assert!(wd.rows.lifecycle().iter().zip(&below).all(|(m, &b)| !b || m.converted_at.is_none()));
                for i in 0..n {
                    let k = mlx_rs::ops::concatenate(&[row(&k1, i), row(&k2, i)], 2).unwrap();
                    let v = mlx_rs::ops::concatenate(&[row(&v1, i), row(&v2, i)], 2).unwrap();
                    let q = mlx_rs::ops::concatenate(&[row(&q1, i), row(&q2, i)], 2).unwrap();
                    wd.twins[i].window(&k, &v, &q, 0.3, &wd.masks).unwrap();
                    let toks = wd.toks(i, planned);
                    wd.model_twins[i].append(&toks, false).unwrap();
                }
                let all: Vec<usize> = (0..n).collect();
                let conv = wd.rows.commit_prefill(&all).unwrap();
                assert_eq!(conv, wd.model.commit_prefill(&all).unwrap());
                wd.rows.end_prefill().unwrap();
                wd.model.end_prefill().unwrap();
                seen.crossed_in_prefill += conv.len();
                seen.conversions += conv.len();
            }
            7 => {
                // Admit a new request: every row is extracted (composed again by its lego) and merged with it.
                let mut legos: Vec<Bf16FirstCache> = (0..n).map(|i| wd.rows.extract(i).unwrap()).collect();
                let mut lego = Bf16FirstCache::new(spec, w, t).unwrap();
                let mut m = LegoModel::new(ts).unwrap();
                let l = wd.rng.random_range(1..5);
                let (k, v, q) = wd.kvq(1, l);
                lego.window(&k, &v, &q, 0.3, &wd.masks).unwrap();
                let req = wd.next_req;
                wd.next_req += 1;
                m.append(&(0..l).map(|p| Tok::new(req, p as u32)).collect::<Vec<_>>(), false).unwrap();
                legos.push(lego.clone());
                let mut sources: Vec<LifecycleRow> = wd.model.rows.clone();
                sources.push(m.row.clone());
                wd.rows = TransitioningKvRows::merge(spec, w, t, legos).unwrap();
                wd.model = RowsModel::merge(ts, sources).unwrap();
                wd.twins.push(lego);
                wd.model_twins.push(m);
                wd.reqs.push(req);
            }
            8 if n > 1 => {
                let drop = wd.rng.random_range(0..n);
                let keep: Vec<usize> = (0..n).filter(|&i| i != drop).collect();
                wd.rows.filter(&keep).unwrap();
                wd.model.filter(&keep).unwrap();
                wd.twins.remove(drop);
                wd.model_twins.remove(drop);
                wd.reqs.remove(drop);
            }
            _ => {
                // Bad input: a plain read while mixed; prefix reuse below the floor. Nothing changes.
                let before = (wd.rows.offsets(), wd.rows.lifecycle().to_vec());
                let mixed = wd.rows.lifecycle().iter().any(|m| m.converted_at.is_some());
                assert_eq!(wd.rows.check_plain_read().is_err(), mixed);
                let lego = wd.rows.extract(0).unwrap();
                let floor = lego.minimum_reusable_offset();
                if floor > 0 {
                    assert!(matches!(lego.take(floor - 1, 100), Err(CacheError::BelowFloor { .. })));
                    seen.refused += 1;
                }
                assert_eq!((wd.rows.offsets(), wd.rows.lifecycle().to_vec()), before);
            }
        }
        wd.check(&format!("seed {seed} step {step}"));
        if wd.rows.is_packed() {
            seen.packed += 1;
        }
    }
}

#[test]
fn transitioning_rows_match_lego_twins_and_the_lifecycle_model() {
    let mut seen = Seen::default();
    for seed in 0..24 {
        run(seed, &mut seen);
    }
    eprintln!("{seen:?}");
    assert!(seen.crossed_in_window > 0 && seen.crossed_in_round > 0 && seen.crossed_in_prefill > 0, "{seen:?}");
    assert!(seen.conversions > 0 && seen.refused > 0, "{seen:?}");
    assert!(seen.unequal_rounds > 0 && seen.rollbacks_across_wrap > 0 && seen.packed > 0, "{seen:?}");
}
