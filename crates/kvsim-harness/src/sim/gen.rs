//! The op stream: the workload stream of a seed, drawn against the current world (mostly valid ops, with a few
//! impossible ones on purpose: trims of wrapped rings, extracts of missing rows).

use rand::Rng;
use rand_chacha::ChaCha8Rng;

use crate::sim::config::SimConfig;
use crate::sim::family::Registry;
use crate::sim::ops::{IllInput, Op, OpKind, PagedAction};
use crate::sim::rng::{stream, Stream};
use crate::sim::roster::View;

/// Draws ops for one seed.
pub struct Generator {
    work: ChaCha8Rng,
    spec: ChaCha8Rng,
    /// Which prefilled requests leave their chunks to the prefill's end ([`Stream::Prefill`]).
    prefill: ChaCha8Rng,
    /// The kinds whose ops a family draws itself, with its draw.
    drawers: Vec<(OpKind, fn(&SimConfig, &mut ChaCha8Rng) -> Op)>,
    /// Whether the next op is a contract op ([`Stream::Contract`]), and its parameters.
    contract: ChaCha8Rng,
    /// Whether the next op is the rows' softcapped fetch ([`Stream::Fetch`]), and its length.
    fetch: ChaCha8Rng,
    /// Whether the next op is an adopt of the bf16-first rows ([`Stream::RowsAdopt`]).
    rows_adopt: ChaCha8Rng,
    /// The families' registry, for which contract ops the run's families support.
    registry: Registry,
    /// Whether the next op follows up the last one ([`Stream::FollowUp`]), and its parameters.
    follow: ChaCha8Rng,
    /// The follow-up the last op asks for, if any.
    pending: Option<FollowUp>,
    /// Ops since requests last entered the running batch by a merge or a join (0: the last op did), counted up to
    /// [`FETCH_AFTER_ENTRY_OPS`].
    since_entry: usize,
}

/// A step of a request's life that consumes the state the op before it left, drawn right after that op (at
/// [`FOLLOW_UP_CHANCE`]) rather than left to the weights. The states these steps read are short-lived: an admitted
/// request stays fresh only until its first write, a window until the next op on its request, a rolled-back ring
/// only until its next write, and by weight alone the op that reads them seldom comes first (a prefill cohort that
/// crosses a boundary with an uncommitted request; a merge of a ring rolled back after it wrapped beside a full one,
/// bug catalog #4). Only kinds the run draws by weight are followed up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FollowUp {
    /// After an admission: a batch prefill of the fresh requests (a server prefills what it admits); in a run that
    /// converts its storage mid-run and holds other requests, at [`CONVERT_AFTER_ADMIT_CHANCE`] the conversion
    /// instead, while the fresh request holds no position yet.
    Prefill,
    /// After a window of `len` positions written into request `req` outside the batch: its speculative rollback
    /// (a bypass trim of the whole window, or of part of it), as a rejected draft leaves it.
    Rollback(u32, u32),
    /// After a speculative rollback of request `req` outside the batch: a merge (or join, by their weights) of it
    /// with other requests outside the batch, before any write moves its ring on.
    Merge(u32),
}

/// The chance that the op a lifecycle step asks for ([`FollowUp`]) comes next.
pub const FOLLOW_UP_CHANCE: f64 = 0.5;

/// The chance that an admission's follow-up, in a run that draws the conversion op and beside requests admitted
/// before, is the conversion (drawn by the family that owns it) rather than the prefill: a conversion while a
/// request holds no position, which the weights alone reach in under one run in a hundred.
pub const CONVERT_AFTER_ADMIT_CHANCE: f64 = 0.5;

/// The chance, per op with a running batch in a run that may draw it, that the generator draws the bf16-first
/// rows' softcapped fetch ([`Op::Fetch`]) instead.
pub const FETCH_CHANCE: f64 = 0.04;

/// The chance of the softcapped fetch in the [`FETCH_AFTER_ENTRY_OPS`] ops after requests entered a running batch
/// of several rows by a merge or a join: rows that entered together are the ones most likely still bf16 side by
/// side, so a fetch then is where several rows come due in one call.
pub const FETCH_AFTER_ENTRY_CHANCE: f64 = 0.5;

/// How many ops after requests entered the running batch draw the fetch at [`FETCH_AFTER_ENTRY_CHANCE`].
pub const FETCH_AFTER_ENTRY_OPS: usize = 1;

/// The chance that a fetch drawn after an entry is a long one (past every boundary a run draws,
/// `TransitionChoice::draw`) rather than a chunk: every row still bf16 comes due in the one call. The other fetches
/// are chunks (a long fetch everywhere would take the rows past their boundaries before the rounds that must cross
/// them).
pub const LONG_FETCH_CHANCE: f64 = 0.8;

/// The chance, per op with a running batch in a run that holds the bf16-first rows and may draw adopt, that the
/// generator draws an adopt of the rows ([`Op::Adopt`]) beside the weights: the rows' conversions, floors and padding
/// change op by op, and one adopt in a run sees few of them.
pub const ROWS_ADOPT_CHANCE: f64 = 0.05;

/// The chance, per op with a running batch, that the generator draws one of the contract ops instead.
pub const CONTRACT_OP_CHANCE: f64 = 0.03;

impl Generator {
    /// A contract op, drawn only from [`Stream::Contract`] (the workload stream is not touched): with a running
    /// batch, at [`CONTRACT_OP_CHANCE`], one the run's families all support.
    fn contract_op(&mut self, cfg: &SimConfig, v: &View) -> Option<Op> {
        if v.rows.is_empty() || !self.contract.random_bool(CONTRACT_OP_CHANCE) {
            return None;
        }
        let names = if cfg.families.is_empty() { crate::sim::config::default_families() } else { cfg.families.clone() };
        let c = &mut self.contract;
        let op = if c.random_bool(0.5) {
            Op::CompiledBatchStep
        } else {
            // Unequal lengths (0 allowed), at least one row committing.
            let mut lens: Vec<u32> = v.rows.iter().map(|_| c.random_range(0..=cfg.max_chunk.min(4) as u32)).collect();
            if lens.iter().all(|&l| l == 0) {
                lens[0] = 1;
            }
            Op::CommitKnownSpans { lens }
        };
        self.registry.all_support(&names, op.kind()).then_some(op)
    }

    /// The softcapped fetch, drawn only from [`Stream::Fetch`] and only in runs whose families all support it and
    /// hold its owner (the workload stream is not touched): with a running batch, at [`FETCH_CHANCE`], a chunk of
    /// positions; in the [`FETCH_AFTER_ENTRY_OPS`] ops after requests entered a batch of several rows by a merge or
    /// a join, at [`FETCH_AFTER_ENTRY_CHANCE`], long at [`LONG_FETCH_CHANCE`].
    fn fetch_op(&mut self, cfg: &SimConfig, v: &View) -> Option<Op> {
        let names = if cfg.families.is_empty() { crate::sim::config::default_families() } else { cfg.families.clone() };
        let allowed =
            self.registry.all_support(&names, OpKind::Fetch) && self.registry.owners_present(&names, OpKind::Fetch);
        // Several rows can come due together only in a batch of several.
        let after_entry = self.since_entry < FETCH_AFTER_ENTRY_OPS && v.rows.len() >= 2;
        let chance = if after_entry { FETCH_AFTER_ENTRY_CHANCE } else { FETCH_CHANCE };
        if v.rows.is_empty() || !allowed || !self.fetch.random_bool(chance) {
            return None;
        }
        let len = if after_entry && self.fetch.random_bool(LONG_FETCH_CHANCE) {
            // Past the farthest boundary a run draws (`TransitionChoice::draw`: at most 3 * max(max_prompt, 4)).
            let far = 3 * cfg.max_prompt.max(4) as u32;
            self.fetch.random_range(far + 1..=far + 4)
        } else {
            self.fetch.random_range(1..=cfg.max_chunk.max(1) as u32)
        };
        Some(Op::Fetch { len })
    }

    /// An adopt of the bf16-first rows, drawn only from [`Stream::RowsAdopt`] (the workload stream is not touched):
    /// with a running batch, in runs that hold the rows family and whose families all support adopt, at
    /// [`ROWS_ADOPT_CHANCE`] (a fifth of them the invalid one).
    fn rows_adopt_op(&mut self, cfg: &SimConfig, v: &View) -> Option<Op> {
        let names = if cfg.families.is_empty() { crate::sim::config::default_families() } else { cfg.families.clone() };
        let rows_family = names.iter().any(|n| n == crate::sim::family::transition::NAME);
        if v.rows.is_empty() || !rows_family || !self.registry.all_support(&names, OpKind::Adopt) {
            return None;
        }
        let r = &mut self.rows_adopt;
        r.random_bool(ROWS_ADOPT_CHANCE).then(|| Op::Adopt { invalid: r.random_bool(0.2) })
    }

    /// The generator of `seed` over kvsim's own families.
    pub fn new(seed: u64) -> Generator {
        Generator::new_in(seed, Registry::builtin())
    }

    /// The generator of `seed` over the families of `registry` (for the kinds they draw themselves).
    pub fn new_in(seed: u64, registry: &Registry) -> Generator {
        let drawers = registry.op_drawers();
        let (work, spec, prefill) =
            (stream(seed, Stream::Workload), stream(seed, Stream::Speculation), stream(seed, Stream::Prefill));
        let (contract, fetch) = (stream(seed, Stream::Contract), stream(seed, Stream::Fetch));
        let follow = stream(seed, Stream::FollowUp);
        let rows_adopt = stream(seed, Stream::RowsAdopt);
        Generator {
            work,
            spec,
            prefill,
            drawers,
            contract,
            fetch,
            rows_adopt,
            registry: registry.clone(),
            follow,
            pending: None,
            since_entry: FETCH_AFTER_ENTRY_OPS,
        }
    }

    /// The follow-up the last op asked for ([`FollowUp`]), drawn only from [`Stream::FollowUp`] (and the prefill's
    /// uncommitted requests from [`Stream::Prefill`]), when it still applies to `v`.
    fn follow_up(&mut self, cfg: &SimConfig, v: &View) -> Option<Op> {
        let want = self.pending.take()?;
        let room = cfg.max_batch.saturating_sub(v.rows.len());
        let solo = |req: u32| v.solo.iter().any(|s| s.0 == req);
        if !self.follow.random_bool(FOLLOW_UP_CHANCE) {
            return None;
        }
        let f = &mut self.follow;
        if matches!(want, FollowUp::Prefill)
            && v.live > 1
            && cfg.weight(OpKind::Quantize) > 0
            && f.random_bool(CONVERT_AFTER_ADMIT_CHANCE)
        {
            if let Some((_, draw)) = self.drawers.iter().find(|d| d.0 == OpKind::Quantize) {
                return Some(draw(cfg, f));
            }
        }
        match want {
            FollowUp::Rollback(req, len) => solo(req).then(|| Op::SoloTrim {
                req,
                n: if f.random_bool(0.5) { len } else { f.random_range(0..=len) },
                bypass: true,
            }),
            _ if room == 0 => None,
            FollowUp::Prefill if cfg.weight(OpKind::BatchPrefill) == 0 => None,
            FollowUp::Prefill => {
                let fresh: Vec<u32> = v.solo.iter().filter(|s| s.1 == 0).map(|s| s.0).collect();
                (!fresh.is_empty()).then(|| batch_prefill(cfg, f, &mut self.prefill, &fresh, room))
            }
            FollowUp::Merge(req) => {
                if !solo(req) {
                    return None;
                }
                let others: Vec<u32> = v.solo.iter().map(|s| s.0).filter(|&r| r != req).collect();
                let (merge, join) = (cfg.weight(OpKind::Merge), cfg.weight(OpKind::Join));
                let kind = if f.random_range(0..merge + join) < merge { OpKind::Merge } else { OpKind::Join };
                // The rolled-back request first, then as many of the others as fit, in a shuffled order.
                let mut reqs = vec![req];
                reqs.extend(shuffled(f, others));
                reqs.truncate(room);
                Some(if kind == OpKind::Merge { Op::Merge { reqs } } else { Op::Join { reqs, order: vec![] } })
            }
        }
    }

    /// The follow-up `op` asks for, if the run draws its kind by weight.
    fn asks_for(cfg: &SimConfig, op: &Op) -> Option<FollowUp> {
        match op {
            Op::Admit { .. } if cfg.weight(OpKind::BatchPrefill) + cfg.weight(OpKind::Quantize) > 0 => {
                Some(FollowUp::Prefill)
            }
            Op::SoloWindow { req, len } if cfg.weight(OpKind::SoloTrim) > 0 => Some(FollowUp::Rollback(*req, *len)),
            Op::SoloTrim { req, bypass: true, .. } if cfg.weight(OpKind::Merge) + cfg.weight(OpKind::Join) > 0 => {
                Some(FollowUp::Merge(*req))
            }
            _ => None,
        }
    }

    /// The next op for `view`: a follow-up of the last op ([`FollowUp`]), a contract op, the fetch, or one drawn by
    /// weight. Kinds that cannot apply now are left out of the draw.
    pub fn next(&mut self, cfg: &SimConfig, v: &View) -> Op {
        let op = self.draw(cfg, v);
        self.pending = Self::asks_for(cfg, &op);
        self.since_entry = if matches!(op, Op::Merge { .. } | Op::Join { .. }) {
            0
        } else {
            (self.since_entry + 1).min(FETCH_AFTER_ENTRY_OPS)
        };
        op
    }

    fn draw(&mut self, cfg: &SimConfig, v: &View) -> Op {
        if let Some(op) = self.follow_up(cfg, v) {
            return op;
        }
        let rows = v.rows.len();
        if let Some(op) = self.contract_op(cfg, v) {
            return op;
        }
        if let Some(op) = self.fetch_op(cfg, v) {
            return op;
        }
        if let Some(op) = self.rows_adopt_op(cfg, v) {
            return op;
        }
        let fresh: Vec<u32> = v.solo.iter().filter(|s| s.1 == 0).map(|s| s.0).collect();
        let room = cfg.max_batch.saturating_sub(rows);
        let applicable = |k: OpKind| -> bool {
            match k {
                OpKind::Admit => v.live < cfg.max_requests,
                OpKind::SoloWindow | OpKind::SoloDecode | OpKind::SoloTrim => !v.solo.is_empty(),
                OpKind::Merge | OpKind::Join => !v.solo.is_empty() && room > 0,
                OpKind::BatchPrefill => !fresh.is_empty() && room > 0,
                OpKind::Decode | OpKind::Window | OpKind::Append | OpKind::Verify | OpKind::CommitSpan => rows > 0,
                OpKind::Extract | OpKind::Filter | OpKind::Trim => rows > 0,
                OpKind::ReadBlock | OpKind::BidirPrefill | OpKind::CompiledStep => !v.solo.is_empty(),
                OpKind::TrainingForward | OpKind::PrefixSharedForward | OpKind::TrainingRefusal => true,
                OpKind::PrefixReuse => true,
                OpKind::PlainRead => rows > 0,
                OpKind::Adopt | OpKind::Prepare => rows > 0,
                OpKind::DecodePhase | OpKind::IllFormed => rows > 0 || !v.solo.is_empty(),
                OpKind::Quantize => true,
                OpKind::Paged => v.live > 0,
                // Never by weight: `contract_op`.
                OpKind::CompiledBatchStep | OpKind::CommitKnownSpans | OpKind::Fetch => false,
                OpKind::Persist => !v.solo.is_empty(),
                OpKind::EncoderRead => rows > 0 || !v.solo.is_empty(),
            }
        };
        let choices: Vec<(OpKind, u32)> = OpKind::ALL
            .iter()
            .map(|&k| (k, if applicable(k) { cfg.weight(k) } else { 0 }))
            .filter(|c| c.1 > 0)
            .collect();
        let total: u32 = choices.iter().map(|c| c.1).sum();
        if total == 0 {
            return Op::Admit { req: v.next_id };
        }
        let mut pick = self.work.random_range(0..total);
        let kind = choices
            .iter()
            .find(|c| {
                if pick < c.1 {
                    true
                } else {
                    pick -= c.1;
                    false
                }
            })
            .unwrap()
            .0;
        let chunk = |r: &mut ChaCha8Rng| r.random_range(1..=cfg.max_chunk as u32);
        let w = &mut self.work;
        match kind {
            OpKind::Admit => Op::Admit { req: v.next_id },
            OpKind::SoloWindow => Op::SoloWindow { req: v.solo[w.random_range(0..v.solo.len())].0, len: chunk(w) },
            OpKind::SoloDecode => Op::SoloDecode { req: v.solo[w.random_range(0..v.solo.len())].0 },
            OpKind::SoloTrim => {
                let (req, _, last) = v.solo[w.random_range(0..v.solo.len())];
                match last {
                    // A speculative rollback of the whole window (or part of it): the full rollback leaves a ring with
                    // fewer live positions than min(offset, W), the geometry bug-catalog #4 (merge by offset) needs.
                    Some(l) if w.random_bool(0.6) => Op::SoloTrim {
                        req,
                        n: if w.random_bool(0.5) { l as u32 } else { w.random_range(0..=l as u32) },
                        bypass: true,
                    },
                    _ => Op::SoloTrim { req, n: w.random_range(0..=3), bypass: w.random_bool(0.5) },
                }
            }
            OpKind::Merge | OpKind::Join => {
                // Half the time everything that fits: merges of several histories (wrapped, post-window, rolled back,
                // empty) side by side are where merge geometry bugs live (bug catalog #4, #5).
                let most = room.min(v.solo.len());
                let n = if w.random_bool(0.5) { most } else { w.random_range(1..=most) };
                let mut reqs = shuffled(w, v.solo.iter().map(|s| s.0).collect());
                reqs.truncate(n);
                if kind == OpKind::Merge {
                    Op::Merge { reqs }
                } else {
                    // Half the joins list the running batch's rows in a shuffled order (join keeps any order).
                    let mut order: Vec<u32> = vec![];
                    if rows > 1 && w.random_bool(0.5) {
                        order = (0..rows as u32).collect();
                        for i in (1..order.len()).rev() {
                            order.swap(i, w.random_range(0..=i));
                        }
                    }
                    Op::Join { reqs, order }
                }
            }
            OpKind::BatchPrefill => batch_prefill(cfg, w, &mut self.prefill, &fresh, room),
            OpKind::Decode => Op::Decode,
            OpKind::Window => Op::Window { len: chunk(w) },
            OpKind::Append => Op::Append { len: chunk(w) },
            OpKind::Verify => {
                let gamma = self.spec.random_range(1..=cfg.max_gamma as u32);
                let accept = (0..rows).map(|_| self.spec.random_range(0..=gamma)).collect();
                Op::Verify { gamma, accept }
            }
            OpKind::CommitSpan => Op::CommitSpan { len: w.random_range(1..=3) },
            OpKind::Extract => {
                // One in twenty asks for a row that does not exist: a typed error is the expected answer.
                let row = if w.random_bool(0.05) {
                    rows as u32 + w.random_range(0..3)
                } else {
                    w.random_range(0..rows as u32)
                };
                Op::Extract { row, finish: w.random_bool(0.5) }
            }
            OpKind::Filter => {
                let mut keep: Vec<u32> = (0..rows as u32).filter(|_| w.random_bool(0.8)).collect();
                if w.random_bool(0.3) {
                    keep.reverse();
                }
                Op::Filter { keep }
            }
            OpKind::Trim => {
                // Half the batch trims take the speculative-rollback path: right after a batch window of L >= n
                // positions it is valid for every row, otherwise it must be the typed error with nothing changed.
                let n = self.spec.random_range(1..=3);
                Op::Trim { n, bypass: self.spec.random_bool(0.5) }
            }
            OpKind::ReadBlock => {
                Op::ReadBlock { req: v.solo[w.random_range(0..v.solo.len())].0, len: w.random_range(1..=8) }
            }
            OpKind::BidirPrefill => {
                // Mostly a fresh request (offset 0, the only place it is defined); sometimes one that holds positions,
                // where the typed error is the expected answer.
                let req = if !fresh.is_empty() && w.random_bool(0.85) {
                    fresh[w.random_range(0..fresh.len())]
                } else {
                    v.solo[w.random_range(0..v.solo.len())].0
                };
                Op::BidirPrefill { req, len: w.random_range(1..=cfg.max_prompt as u32), image: w.random() }
            }
            OpKind::CompiledStep => Op::CompiledStep { req: v.solo[w.random_range(0..v.solo.len())].0 },
            OpKind::CompiledBatchStep => Op::CompiledBatchStep,
            OpKind::CommitKnownSpans => Op::CommitKnownSpans { lens: vec![1; rows] },
            OpKind::Fetch => Op::Fetch { len: 1 },
            OpKind::TrainingForward => {
                let len = w.random_range(1..=12u32);
                let rows = w.random_range(1..=3);
                let mut lengths: Vec<u32> =
                    (0..rows).map(|_| if w.random_bool(0.3) { len } else { w.random_range(0..=len) }).collect();
                if w.random_bool(0.05) {
                    lengths[0] = len + 1; // a row longer than the forward: BadLengths
                }
                let window = if w.random_bool(0.5) { 0 } else { w.random_range(1..=6) };
                Op::TrainingForward { lengths, len, window }
            }
            OpKind::PrefixSharedForward => {
                let (prompt, chosen) = (w.random_range(0..=4u32), w.random_range(0..=3u32));
                let rejected = w.random_range(u32::from(prompt + chosen == 0)..=3);
                let n = prompt + chosen + rejected;
                // One in ten has the wrong length: PrefixSharedSize.
                let len = if w.random_bool(0.1) {
                    if w.random_bool(0.5) {
                        n + 1
                    } else {
                        n - 1
                    }
                } else {
                    n
                };
                let window = if w.random_bool(0.5) { 0 } else { w.random_range(1..=5) };
                Op::PrefixSharedForward { prompt, chosen, rejected, len, window }
            }
            OpKind::TrainingRefusal => Op::TrainingRefusal { persist: w.random_bool(0.5) },
            OpKind::PrefixReuse => {
                // Prompts around the stored entry's length: usable prefixes below its floor (refused), at it, above.
                let most = 3 * cfg.max_prompt as u32 + 4;
                Op::PrefixReuse {
                    common: w.random_range(0..=most),
                    prompt: w.random_range(0..=most),
                    extra: w.random_range(0..=cfg.max_chunk as u32),
                }
            }
            OpKind::PlainRead => Op::PlainRead,
            OpKind::Adopt => Op::Adopt { invalid: w.random_bool(0.2) },
            OpKind::DecodePhase => Op::DecodePhase,
            OpKind::Prepare => {
                // A quarter of the rows take no position; a third of the ops finalize before every chunk arrived.
                let lengths: Vec<u32> = (0..rows)
                    .map(|_| if w.random_bool(0.25) { 0 } else { w.random_range(1..=cfg.max_prompt as u32) })
                    .collect();
                let chunk = chunk(w);
                let longest = lengths.iter().copied().max().unwrap_or(0);
                let needed = longest.div_ceil(chunk);
                let chunks = if needed > 0 && w.random_bool(0.33) { w.random_range(0..needed) } else { needed };
                Op::Prepare { lengths, chunk, chunks }
            }
            OpKind::IllFormed => {
                let input = IllInput::ALL[w.random_range(0..IllInput::ALL.len())];
                let batch = rows > 0 && (v.solo.is_empty() || w.random_bool(0.5));
                let req = if v.solo.is_empty() { v.next_id } else { v.solo[w.random_range(0..v.solo.len())].0 };
                Op::IllFormed { req, batch, input, variant: w.random() }
            }
            // Drawn by the family that owns it (its weight is 0 in runs without one).
            OpKind::Quantize => match self.drawers.iter().find(|d| d.0 == OpKind::Quantize) {
                Some((_, draw)) => draw(cfg, w),
                None => Op::Quantize { bits: 4, group: 64, mid_round: false },
            },
            // Drawn by the family that owns it; a fork's request is a live one of the view.
            OpKind::Paged => {
                let mut op = match self.drawers.iter().find(|d| d.0 == OpKind::Paged) {
                    Some((_, draw)) => draw(cfg, w),
                    None => Op::Paged { action: PagedAction::Evict { blocks: 1 } },
                };
                if let Op::Paged { action: PagedAction::Fork { req, .. } } = &mut op {
                    let live: Vec<u32> = v.rows.iter().copied().chain(v.solo.iter().map(|s| s.0)).collect();
                    *req = live.get(w.random_range(0..live.len().max(1))).copied().unwrap_or(v.next_id);
                }
                op
            }
            OpKind::Persist => {
                Op::Persist { req: v.solo[w.random_range(0..v.solo.len())].0, mlxlm: w.random_bool(0.5) }
            }
            OpKind::EncoderRead => {
                // Half on the running batch's rows (when there are any), blocks past the cache's window, and the
                // encoder's own window below, at and past it (a quarter unbounded).
                let batch = rows > 0 && (v.solo.is_empty() || w.random_bool(0.5));
                let req = if v.solo.is_empty() { v.next_id } else { v.solo[w.random_range(0..v.solo.len())].0 };
                let wide = cfg.layout.max_size().unwrap_or(8) as u32;
                let len = w.random_range(1..=(cfg.max_prompt as u32).max(wide + 2));
                let window = if w.random_bool(0.25) { 0 } else { w.random_range(1..=2 * wide + 2) };
                Op::EncoderRead { req, len, window, batch }
            }
        }
    }
}

/// `v` in a random order (Fisher-Yates).
fn shuffled(r: &mut ChaCha8Rng, mut v: Vec<u32>) -> Vec<u32> {
    for i in (1..v.len()).rev() {
        v.swap(i, r.random_range(0..=i));
    }
    v
}

/// A batch prefill of the first fresh requests that fit in `room` (`fresh` not empty, `room` > 0): their prompt
/// lengths and chunk from `w`, which of them leave their chunks uncommitted from `prefill`.
fn batch_prefill(cfg: &SimConfig, w: &mut ChaCha8Rng, prefill: &mut ChaCha8Rng, fresh: &[u32], room: usize) -> Op {
    let n = w.random_range(1..=room.min(fresh.len()));
    let reqs: Vec<u32> = fresh[..n].to_vec();
    let lengths = (0..n).map(|_| w.random_range(1..=cfg.max_prompt as u32)).collect();
    let chunk = w.random_range(1..=cfg.max_chunk as u32);
    // Every legal end of a prefill: every request commits its chunks, none does, or every other one (from the
    // first or the second, so that a cohort of one leaves its chunks uncommitted in half the prefills).
    let uncommitted = match prefill.random_range(0..3) {
        0 => vec![],
        1 => reqs.clone(),
        _ => {
            let from = prefill.random_range(0..2);
            reqs.iter().skip(from).step_by(2).copied().collect()
        }
    };
    Op::BatchPrefill { reqs, lengths, chunk, uncommitted }
}
