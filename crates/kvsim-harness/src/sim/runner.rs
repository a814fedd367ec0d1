//! The run loop's world: the run's one [`Roster`] (the scheduler's picture), one instance of every layout family of
//! the run (`sim::family`), the run's digest, and per-family tallies. For each op it has the roster resolve and
//! commit what the op does to the membership, dispatches the op to every family, then has each check its whole
//! state, then (when an observer watches) has each describe its state. It knows no family's internals and no
//! observer's purpose.

use std::collections::BTreeMap;

use crate::sim::check::Failure;
use crate::sim::config::SimConfig;
use crate::sim::family::{self, Cx, Family, Registry};
use crate::sim::observe::RunObserver;
use crate::sim::ops::Op;
use crate::sim::roster::{Resolved, Roster, View};
use crate::sim::summary::Counters;

/// A failed check, attributed to the family whose check it was (`None`: the runner's own, e.g. setup).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FamilyFailure {
    pub family: Option<&'static str>,
    pub failure: Failure,
}

/// The simulated world of one run.
pub struct World {
    pub cfg: SimConfig,
    /// The families this run may hold (the config names which of them it does).
    pub registry: Registry,
    /// The scheduler's picture: the one owner of which requests live, the batch rows and the next id.
    pub roster: Roster,
    /// One instance per family of `cfg.families`, in that order.
    pub families: Vec<Box<dyn Family>>,
    /// Running digest of every byte the checks read (states and outputs), chained across ops.
    pub hasher: blake3::Hasher,
    /// Applied ops per family key.
    pub ops: BTreeMap<&'static str, u64>,
    /// Applied ops per family key and op kind (the summary's `layouts.<key>.ops_by_kind`).
    pub ops_by_kind: BTreeMap<&'static str, BTreeMap<&'static str, u64>>,
    /// The coverage classes the last op reached through some family's state ([`Family::take_reached`]).
    reached: Vec<&'static str>,
}

impl World {
    /// The world of a run of `cfg`, one instance of each of its families, built from their registrations in
    /// `registry` (a family the registry does not know is a `setup` failure).
    pub fn new(cfg: SimConfig, registry: &Registry) -> Result<World, Failure> {
        let names = if cfg.families.is_empty() { family::default_families() } else { cfg.families.clone() };
        let mut families = vec![];
        for n in &names {
            let reg = registry
                .get(n)
                .ok_or_else(|| Failure::new("setup", format!("unknown layout family {n:?} in the config")))?;
            families.push((reg.build)(&cfg)?);
        }
        let registry = registry.clone();
        let (hasher, ops, ops_by_kind) = (blake3::Hasher::new(), BTreeMap::new(), BTreeMap::new());
        Ok(World { cfg, registry, roster: Roster::default(), families, hasher, ops, ops_by_kind, reached: vec![] })
    }

    /// The generator's view: the roster, with the positions the run's first family's model gives.
    pub fn view(&self) -> View {
        self.roster.view(|id| self.position(id))
    }

    /// A live request's (offset, last window width), as the run's first family's model has it.
    fn position(&self, req: u32) -> (usize, Option<usize>) {
        self.families.first().and_then(|f| f.position(req)).unwrap_or((0, None))
    }

    /// The coverage classes the last op reached through the families' state, each once, in the families' order.
    pub fn take_reached(&mut self) -> Vec<&'static str> {
        std::mem::take(&mut self.reached)
    }

    /// Every family's counters, summed.
    pub fn counters(&self) -> Counters {
        let mut total = Counters::default();
        for f in &self.families {
            total.add(f.counters());
        }
        total
    }

    /// Sets what is promised on this device in every family's counters.
    pub fn set_guarantees(&mut self, g: crate::sim::check::Guarantees) {
        for f in &mut self.families {
            f.counters_mut().guarantees = g;
        }
    }

    /// Applies one op to every family. `Ok(false)`: skipped (out of limits, a kind some family does not support, a
    /// kind owned by a family the run does not hold, or references that do not exist). `Err`: a check failed. The
    /// families that own the op's kind (where the run holds one) must agree on whether it was skipped; where no
    /// registered family owns it, every family must (check `families`).
    pub fn apply(&mut self, op: &Op, observer: &mut dyn RunObserver) -> Result<bool, FamilyFailure> {
        let names = self.family_names();
        // The generator never draws an op whose owner the run lacks (`Registry::owners_present`); a trace written by
        // hand or by a fuzzer may hold one, and no family of the run can judge it.
        if !op_within_limits(op)
            || !self.registry.all_support(&names, op.kind())
            || !self.registry.owners_present(&names, op.kind())
        {
            return Ok(false);
        }
        let change = match self.roster.resolve(op, |id| self.position(id).0) {
            Resolved::Skip => return Ok(false),
            Resolved::Unchanged => None,
            Resolved::Change(c) => Some(c),
        };
        if let Some(c) = &change {
            self.roster.commit(c);
        }
        self.reached.clear();
        let names = self.family_names();
        let watched: Vec<bool> = names.iter().map(|n| observer.watches(n)).collect();
        // Who decides whether the op was skipped: the run's families that own its kind, where any does (an op of the
        // bf16-first rows touches no attention cache: the attention family has no say in it); else every family.
        let kind = op.kind();
        let owners: Vec<bool> = names.iter().map(|n| self.registry.get(n).is_some_and(|r| (r.owns)(kind))).collect();
        let voters: Vec<bool> = if owners.contains(&true) { owners } else { vec![true; names.len()] };
        let mut quiet = crate::sim::observe::NoObserver;
        let mut applied = None;
        let held: Vec<usize> = self.roster.rows().iter().map(|&id| self.position(id).0).collect();
        for (i, f) in self.families.iter_mut().enumerate() {
            let key = f.key();
            let obs: &mut dyn RunObserver = if watched[i] { &mut *observer } else { &mut quiet };
            let mut cx = Cx {
                hasher: &mut self.hasher,
                observer: obs,
                roster: &self.roster,
                change: change.as_ref(),
                held: &held,
            };
            let a = f.apply(op, &mut cx).map_err(|failure| FamilyFailure { family: Some(key), failure })?;
            if voters[i] && *applied.get_or_insert(a) != a {
                return Err(FamilyFailure {
                    family: Some(key),
                    failure: Failure::new(
                        "families",
                        format!("{key} disagrees with the first family that decides on skipping"),
                    ),
                });
            }
            for c in f.take_reached() {
                if !self.reached.contains(&c) {
                    self.reached.push(c);
                }
            }
        }
        let applied = applied.unwrap_or(false);
        if change.is_some() && !applied {
            let failure = Failure::new("families", format!("the families skipped {op:?}, which changes the roster"));
            return Err(FamilyFailure { family: None, failure });
        }
        if applied {
            for (i, f) in self.families.iter_mut().enumerate() {
                *self.ops.entry(f.key()).or_insert(0) += 1;
                *self.ops_by_kind.entry(f.key()).or_default().entry(op.kind().name()).or_insert(0) += 1;
                let key = f.key();
                let obs: &mut dyn RunObserver = if watched[i] { &mut *observer } else { &mut quiet };
                let mut cx =
                    Cx { hasher: &mut self.hasher, observer: obs, roster: &self.roster, change: None, held: &[] };
                f.check_state(&mut cx).map_err(|failure| FamilyFailure { family: Some(key), failure })?;
            }
            if observer.wants_calls() {
                for (_, f) in self.families.iter_mut().enumerate().filter(|(i, _)| watched[*i]) {
                    let key = f.key();
                    let mut cx = Cx {
                        hasher: &mut self.hasher,
                        observer: &mut *observer,
                        roster: &self.roster,
                        change: None,
                        held: &[],
                    };
                    f.observe_state(&mut cx).map_err(|failure| FamilyFailure { family: Some(key), failure })?;
                }
            }
        }
        Ok(applied)
    }

    fn family_names(&self) -> Vec<String> {
        if self.cfg.families.is_empty() {
            family::default_families()
        } else {
            self.cfg.families.clone()
        }
    }
}

/// Largest length, count or row index an op may carry (replayed and fuzzed traces are untrusted input).
pub const MAX_OP_LEN: u32 = 512;

fn op_within_limits(op: &Op) -> bool {
    let ok = |x: u32| x <= MAX_OP_LEN;
    match op {
        Op::SoloWindow { len, .. } | Op::Window { len } | Op::Append { len } | Op::CommitSpan { len } => ok(*len),
        Op::SoloTrim { n, .. } | Op::Trim { n, .. } => ok(*n),
        Op::Verify { gamma, accept } => ok(*gamma) && accept.len() <= MAX_OP_LEN as usize,
        Op::BatchPrefill { reqs, lengths, chunk, uncommitted } => {
            ok(*chunk)
                && reqs.len() <= 64
                && lengths.len() <= 64
                && uncommitted.len() <= 64
                && lengths.iter().all(|&l| ok(l))
        }
        Op::Merge { reqs } => reqs.len() <= 64,
        Op::Join { reqs, order } => reqs.len() <= 64 && order.len() <= MAX_OP_LEN as usize,
        Op::Filter { keep } => keep.len() <= MAX_OP_LEN as usize,
        Op::Extract { row, .. } => ok(*row),
        // Request ids index the world's maps and positions are u32: keep them far from overflow.
        Op::Admit { req } => *req <= 1 << 20,
        Op::SoloDecode { .. } | Op::Decode | Op::CompiledStep { .. } | Op::TrainingRefusal { .. } => true,
        Op::CompiledBatchStep => true,
        Op::CommitKnownSpans { lens } => lens.len() <= 64 && lens.iter().all(|&l| ok(l)),
        Op::PlainRead => true,
        Op::Fetch { len } => ok(*len) && *len >= 1,
        Op::PrefixReuse { common, prompt, extra } => ok(*common) && ok(*prompt) && ok(*extra),
        Op::Adopt { .. } | Op::DecodePhase | Op::IllFormed { .. } => true,
        Op::Prepare { lengths, chunk, chunks } => {
            ok(*chunk) && ok(*chunks) && lengths.len() <= 64 && lengths.iter().all(|&l| ok(l))
        }
        Op::Quantize { bits, group, .. } => ok(*bits) && ok(*group),
        Op::Persist { .. } => true,
        Op::Paged { action: crate::sim::ops::PagedAction::Fork { n, len, .. } } => *n <= 8 && ok(*len),
        Op::Paged { action: crate::sim::ops::PagedAction::Evict { blocks } } => ok(*blocks),
        Op::Paged { action: crate::sim::ops::PagedAction::SameEnd { extra, chunk } } => ok(*extra) && ok(*chunk),
        Op::ReadBlock { len, .. } | Op::BidirPrefill { len, .. } => ok(*len),
        Op::EncoderRead { len, window, .. } => ok(*len) && ok(*window),
        Op::TrainingForward { lengths, len, window } => {
            ok(*len) && ok(*window) && lengths.len() <= 64 && lengths.iter().all(|&l| ok(l))
        }
        Op::PrefixSharedForward { prompt, chosen, rejected, len, window } => {
            [*prompt, *chosen, *rejected, *len, *window].into_iter().all(ok)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::family::{Registration, Registry};
    use crate::sim::observe::NoObserver;

    /// A family that keeps no state and skips every op: a lifecycle op the roster applied must not pass it.
    struct Skipper(Counters);

    impl Family for Skipper {
        fn key(&self) -> &'static str {
            "test:skipper"
        }
        fn apply(&mut self, _op: &Op, _cx: &mut Cx<'_>) -> Result<bool, Failure> {
            Ok(false)
        }
        fn check_state(&mut self, _cx: &mut Cx<'_>) -> Result<(), Failure> {
            Ok(())
        }
        fn observe_state(&mut self, _cx: &mut Cx<'_>) -> Result<(), Failure> {
            Ok(())
        }
        fn position(&self, _req: u32) -> Option<(usize, Option<usize>)> {
            None
        }
        fn counters(&self) -> &Counters {
            &self.0
        }
        fn counters_mut(&mut self) -> &mut Counters {
            &mut self.0
        }
    }

    #[test]
    fn a_family_skipping_a_roster_change_fails_the_run() {
        let reg = Registration::plain("skipper", |_| true, 1.0, |_| Ok(Box::new(Skipper(Counters::default()))));
        let registry = Registry::empty().with(reg).unwrap();
        let cfg = SimConfig { families: vec!["skipper".to_string()], ..SimConfig::from_seed(0) };
        let mut world = World::new(cfg, &registry).unwrap();
        // An op the roster leaves alone: the family may skip it.
        assert_eq!(world.apply(&Op::Decode, &mut NoObserver), Ok(false));
        // An admit the roster applies: skipping it is a failure of the run, not of any one family.
        let err = world.apply(&Op::Admit { req: 0 }, &mut NoObserver).unwrap_err();
        assert_eq!((err.family, err.failure.check.as_str()), (None, "families"));
        // A lifecycle op whose references do not exist never reaches the family.
        assert_eq!(world.apply(&Op::Extract { row: 0, finish: true }, &mut NoObserver), Ok(false));
        assert_eq!(world.view().live, 1, "the admit was committed before the families ran");
    }
}
