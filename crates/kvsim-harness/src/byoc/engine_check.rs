//! `kvsim check-engine`: seeds run against an engine process on every layer it serves (its K/V caches through the
//! simulator's swarm, its block pool through [`super::pool`], its prefix cache through [`super::prefix`], its
//! recurrent state through [`super::recurrent`]), failures
//! classed by the check that failed first, each class shrunk through the engine and handed over with the engine's
//! standalone reproducer. The process and the protocol are [`super::engine`]'s.

use std::time::Duration;

use super::engine::{
    calls, dtype_name, install, parse_hello, parse_reply, tensor_from, uninstall, usize_of, with_engine, Engine,
    EngineCache, EngineFailure, Hello,
};
use super::Geometry;

/// Decodes one line from an engine as the reply to every request kvsim sends (the `hello`, each K/V reply's tensors
/// of geometry `g` and counts, a batch's `rows_info` and per-row trim counts, each block-pool reply's fields), the way a run decodes it; returns how many decodes
/// succeeded. Any bytes give typed failures, never a panic: the `engine_reply` fuzz target's entry point.
pub fn decode_any(line: &str, g: &Geometry) -> usize {
    let Ok(v) = parse_reply("fuzz", line) else { return 0 };
    let mut ok = usize::from(parse_hello("fuzz", &v).is_ok());
    let (h, hq, d) = (g.heads_kv as i64, g.heads_q as i64, g.head_dim as i64);
    let any = |_: &[i64]| true;
    let kv = |s: &[i64]| s.len() == 4 && s[0] == 1 && s[1] == h && s[3] == d;
    let out = |s: &[i64]| s.len() == 4 && s[1] == hq && s[3] == d;
    for (field, fits) in [("out", &out as &dyn Fn(&[i64]) -> bool), ("k", &kv), ("v", &kv), ("q", &any)] {
        ok += usize::from(tensor_from("fuzz", &v, field, g.dtype, "any", fits).is_ok());
    }
    for field in ["trimmed", "offset", "rows"] {
        ok += usize::from(usize_of("fuzz", &v, field).is_ok());
    }
    ok += usize::from(super::engine::decode_info(&v).is_ok());
    ok += usize::from(super::engine::decode_trimmed(&v, 3).is_ok());
    if g.quant.is_some() {
        ok += usize::from(super::engine::decode_planes("fuzz", &v, g).is_ok());
    }
    ok += usize::from(super::pool::decode_reply(&v));
    let cfg = super::prefix::PrefixConfig {
        layers: vec![None, Some(3)],
        heads_kv: g.heads_kv,
        head_dim: g.head_dim,
        dtype: dtype_name(g.dtype).into(),
        block_size: 2,
        vocab: 2,
        ops: 0,
    };
    ok += usize::from(super::prefix::decode_reply(&v, &cfg));
    ok += usize::from(super::recurrent::decode_reply(&v, dtype_name(g.dtype)));
    ok
}

/// The checks whose divergence an engine's reproducer re-establishes on its own calls: a batch row's output against
/// the same request on its own serial cache (`rows_vs_solo`), the rows' trim against their own caches' trims
/// (`rows_trim_vs_solo`), a call the engine's cache raised on (`adapter_error`), an `extract` of a row the batch does
/// not have that returned a cache (`missing_row_accepted`; the rows each batch holds follow from the calls), and
/// every block-pool check (the
/// pool's invariants restated over the calls and replies alone).
pub const REPRODUCIBLE: &[&str] = &[
    "rows_vs_solo",
    "rows_trim_vs_solo",
    "adapter_error",
    "missing_row_accepted",
    "pool_refs",
    "pool_tables",
    "pool_cow",
    "pool_storage",
    "pool_lookup",
    "pool_refusal",
    "pool_count",
    "prefix_count",
    "prefix_offset",
    "prefix_warm_cold",
    "prefix_model",
    "rec_state",
    "rec_rows",
    "rec_rollback",
    "rec_missing_row",
];

/// The shortest failing run of a class: a K/V run (kvsim's ordinary trace) or a block-pool run.
#[derive(Debug, Clone)]
pub enum Shortest {
    Kv(Box<crate::sim::trace::Trace>),
    Pool(Box<super::pool::PoolTrace>),
    Prefix(Box<super::prefix::PrefixTrace>),
    Recurrent(Box<super::recurrent::RecTrace>),
}

impl Shortest {
    /// Its ops.
    pub fn ops(&self) -> usize {
        match self {
            Shortest::Kv(t) => t.ops.len(),
            Shortest::Pool(t) => t.ops.len(),
            Shortest::Prefix(t) => t.ops.len(),
            Shortest::Recurrent(t) => t.ops.len(),
        }
    }
    pub fn seed(&self) -> u64 {
        match self {
            Shortest::Kv(t) => t.seed,
            Shortest::Pool(t) => t.seed,
            Shortest::Prefix(t) => t.seed,
            Shortest::Recurrent(t) => t.seed,
        }
    }
    /// The trace file (a K/V trace expects the failure it records, so a corpus replay keeps it failing).
    pub fn to_json(&self) -> String {
        match self {
            Shortest::Kv(t) => {
                let mut t = t.as_ref().clone();
                t.expect = crate::sim::trace::Expect::Fail;
                t.to_json()
            }
            Shortest::Pool(t) => t.to_json(),
            Shortest::Prefix(t) => t.to_json(),
            Shortest::Recurrent(t) => t.to_json(),
        }
    }
    pub fn kv(&self) -> Option<&crate::sim::trace::Trace> {
        match self {
            Shortest::Kv(t) => Some(t),
            _ => None,
        }
    }
    pub fn pool(&self) -> Option<&super::pool::PoolTrace> {
        match self {
            Shortest::Pool(t) => Some(t),
            _ => None,
        }
    }
    pub fn prefix(&self) -> Option<&super::prefix::PrefixTrace> {
        match self {
            Shortest::Prefix(t) => Some(t),
            _ => None,
        }
    }
    pub fn recurrent(&self) -> Option<&super::recurrent::RecTrace> {
        match self {
            Shortest::Recurrent(t) => Some(t),
            _ => None,
        }
    }
}

/// One class of failures: the check that failed first.
#[derive(Debug, Clone)]
pub struct Class {
    pub name: String,
    /// The first failing seed's message.
    pub message: String,
    pub failing_seeds: Vec<u64>,
    /// The shortest shrunk trace of the class.
    pub shortest: Shortest,
    /// The engine's standalone reproducer of it (`Err`: why there is none).
    pub reproducer: Result<String, String>,
}

/// What [`check_engine`] found.
#[derive(Debug, Clone)]
pub struct EngineReport {
    pub hello: Hello,
    pub seeds: u64,
    /// Failing runs (a seed runs once per layer the engine serves: K/V, block pool).
    pub failures: u64,
    pub applied: u64,
    pub checks: u64,
    /// Applied ops by kind, over every seed.
    pub ops_by_kind: std::collections::BTreeMap<String, u64>,
    pub classes: Vec<Class>,
}

/// The engine broke during a check: the failure, and the trace of the run it broke in.
#[derive(Debug, Clone)]
pub struct Broken {
    pub failure: EngineFailure,
    pub trace: Option<Box<Shortest>>,
}

/// Runs seeds `0..opts.seeds` against the engine `command` (each run with a fresh `reset`): the K/V swarm where the
/// engine serves K/V caches, a block-pool run where it serves a pool ([`super::pool`]). Classes the failing runs by
/// the check that failed first, shrinks up to `shrinks` runs per class through the engine (keeping the shortest),
/// and asks the engine for a reproducer of each class it can reproduce ([`REPRODUCIBLE`]). The engine process is
/// stopped before this returns, whatever happens.
pub fn check_engine(
    command: &str,
    timeout: Duration,
    opts: super::CheckOptions,
    shrinks: usize,
) -> Result<EngineReport, Broken> {
    check_engine_only(command, timeout, opts, shrinks, &[])
}

/// The layers of an engine a check can run: its K/V caches, its block pool, its prefix cache.
pub const LAYERS: &[&str] = &["kv", "pool", "prefix", "recurrent"];

/// [`check_engine`] on the named layers only ([`LAYERS`]; empty: every layer the engine serves). A layer the engine
/// does not serve is not run.
pub fn check_engine_only(
    command: &str,
    timeout: Duration,
    opts: super::CheckOptions,
    shrinks: usize,
    only: &[&str],
) -> Result<EngineReport, Broken> {
    check_engine_fed(command, timeout, opts, &Shrinks::First(shrinks), only, SeedFeed::range(opts.seeds), true)
}

/// Where a check's seeds come from and what it says of each: `kvsim check-engine` runs its check in a worker
/// process, which takes its seeds from the parent's feed, keeps each seed's K/V ops in an op journal and reports
/// each finished seed (so that a process that dies is a failure of its seed, and the other seeds run).
pub struct SeedFeed<'a> {
    pub seeds: Box<dyn Iterator<Item = u64> + 'a>,
    /// The op journal ([`crate::shard::OpJournal`]): started for each seed, with its K/V run's ops as they start;
    /// started again, empty, once that run (and its shrink) is over, so that a process that dies in another layer
    /// leaves the seed and no ops.
    pub journal: Option<&'a std::path::Path>,
    /// Called after each seed with the seed, the ops it applied and whether a run of it failed.
    pub on_seed: Box<dyn FnMut(u64, u64, bool) + 'a>,
}

impl SeedFeed<'static> {
    /// Seeds `0..seeds`, no journal, nothing said.
    pub fn range(seeds: u64) -> SeedFeed<'static> {
        SeedFeed { seeds: Box::new(0..seeds), journal: None, on_seed: Box::new(|_, _, _| {}) }
    }
}

/// [`check_engine_only`] over the seeds of `feed` (the report's `seeds` counts those that ran); `reproduce: false`
/// asks the engine for no reproducer (each class's is `Err`), for a run that only classes its seeds.
pub fn check_engine_fed(
    command: &str,
    timeout: Duration,
    opts: super::CheckOptions,
    shrinks: &Shrinks,
    only: &[&str],
    feed: SeedFeed<'_>,
    reproduce: bool,
) -> Result<EngineReport, Broken> {
    let engine = Engine::start(command, timeout).map_err(|failure| Broken { failure, trace: None })?;
    let mut hello = engine.hello().clone();
    if !only.is_empty() {
        hello.kv &= only.contains(&"kv");
        hello.pool &= only.contains(&"pool");
        hello.prefix &= only.contains(&"prefix");
        hello.recurrent &= only.contains(&"recurrent");
    }
    install(engine);
    let result = check_installed(opts, shrinks, hello, feed, reproduce);
    uninstall();
    result
}

fn broken_now(trace: impl FnOnce() -> Shortest) -> Result<(), Broken> {
    let failure = match with_engine(|e| e.broken().cloned()) {
        Ok(None) => return Ok(()),
        Ok(Some(f)) | Err(f) => f,
    };
    Err(Broken { failure, trace: Some(Box::new(trace())) })
}

fn broke(failure: EngineFailure, seed: u64, cfg: super::pool::PoolConfig) -> Broken {
    let t = super::pool::PoolTrace {
        format: super::pool::FORMAT.into(),
        version: 1,
        seed,
        config: cfg,
        ops: super::pool::generate(seed, &cfg),
        outcome: crate::sim::trace::Outcome::Pass,
    };
    Broken { failure, trace: Some(Box::new(Shortest::Pool(Box::new(t)))) }
}

/// Which failing runs of each class a check shrinks (keeping the shortest).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Shrinks {
    /// Each class's first `n` failing runs, in the order its seeds run.
    First(usize),
    /// Exactly these seeds of each class (by class name), shrunk when `shrink` (else a class keeps its first planned
    /// seed's run as it failed). A class's shortest is then one of its planned seeds' runs wherever this check ran
    /// one: the seeds one worker would shrink can be shared among several, each of which shrinks its part, and the
    /// shortest of their shortest (the earlier seed on a tie) is the one worker's.
    Planned { seeds: std::collections::BTreeMap<String, Vec<u64>>, shrink: bool },
}

impl Shrinks {
    /// Whether `seed`'s failing run of class `name` is one this check shrinks (or keeps, unshrunk, as planned).
    pub fn plans(&self, name: &str, seed: u64) -> bool {
        match self {
            Shrinks::First(_) => true,
            Shrinks::Planned { seeds, .. } => seeds.get(name).is_some_and(|s| s.contains(&seed)),
        }
    }
}

/// Adds a failing run to its class (made on first sight); returns the class's index and whether to shrink it.
fn classify(
    report: &mut EngineReport,
    tried: &mut std::collections::BTreeMap<String, usize>,
    shrinks: &Shrinks,
    check: &str,
    message: &str,
    seed: u64,
    run: Shortest,
) -> (usize, bool) {
    report.failures += 1;
    // A refusal is classed by the call that raised (`adapter_error/row_state`): each is its own bug.
    let name = match check {
        "adapter_error" => format!("adapter_error/{}", message.split(':').next().unwrap_or("?").replace(' ', "_")),
        _ => check.to_string(),
    };
    // `n`: the class's runs shrunk so far (`First`) or planned runs met so far (`Planned`). `take`: this run starts
    // the class's shortest (on first sight, or, under a plan, at its first planned seed).
    let n = tried.entry(name.clone()).or_insert(0);
    let (take, shrink, counted) = match shrinks {
        Shrinks::First(k) => (false, *n < *k, *n < *k),
        Shrinks::Planned { shrink, .. } => {
            let planned = shrinks.plans(&name, seed);
            (planned && *n == 0, planned && *shrink, planned)
        }
    };
    *n += counted as usize;
    let idx = match report.classes.iter().position(|c| c.name == name) {
        Some(i) => {
            if take {
                report.classes[i].shortest = run;
            }
            i
        }
        None => {
            report.classes.push(Class {
                name: name.clone(),
                message: message.to_string(),
                failing_seeds: vec![],
                shortest: run,
                reproducer: Err("not written yet".into()),
            });
            report.classes.len() - 1
        }
    };
    report.classes[idx].failing_seeds.push(seed);
    (idx, shrink)
}

/// One seed's recurrent-state run ([`super::recurrent`]), classed and shrunk like the other layers'.
fn recurrent_seed(
    report: &mut EngineReport,
    tried: &mut std::collections::BTreeMap<String, usize>,
    seed: u64,
    opts: super::CheckOptions,
    shrinks: &Shrinks,
) -> Result<(), Broken> {
    use super::recurrent as rec;
    use crate::sim::trace::Outcome;
    let cfg = rec::RecConfig::from_seed(seed, opts.ops, report.hello.rec_spec, report.hello.rec_prefill);
    let broke_at = |failure| {
        let t = rec::RecTrace {
            format: rec::FORMAT.into(),
            version: 1,
            seed,
            config: cfg.clone(),
            ops: rec::generate(seed, &cfg),
            outcome: Outcome::Pass,
        };
        Broken { failure, trace: Some(Box::new(Shortest::Recurrent(Box::new(t)))) }
    };
    let r = rec::run(seed, cfg.clone(), None).map_err(broke_at)?;
    report.applied += r.applied;
    report.checks += r.checks;
    for (k, n) in &r.ops_by_kind {
        *report.ops_by_kind.entry(format!("rec_{k}")).or_insert(0) += n;
    }
    if let Outcome::Fail { check, message, .. } = &r.trace.outcome {
        let run = Shortest::Recurrent(Box::new(r.trace.clone()));
        let (idx, shrink) = classify(report, tried, shrinks, check, message, seed, run);
        if shrink {
            let s = rec::shrink(&r.trace, opts.shrink_budget).map_err(broke_at)?;
            if s.ops.len() < report.classes[idx].shortest.ops() {
                report.classes[idx].shortest = Shortest::Recurrent(Box::new(s));
            }
        }
    }
    Ok(())
}

fn check_installed(
    opts: super::CheckOptions,
    shrinks: &Shrinks,
    hello: Hello,
    mut feed: SeedFeed<'_>,
    reproduce: bool,
) -> Result<EngineReport, Broken> {
    use super::pool;
    use crate::shard::OpJournal;
    use crate::sim::trace::Outcome;
    let mut report = EngineReport {
        hello,
        seeds: 0,
        failures: 0,
        applied: 0,
        checks: 0,
        ops_by_kind: Default::default(),
        classes: vec![],
    };
    let mut tried: std::collections::BTreeMap<String, usize> = Default::default();
    for seed in feed.seeds.by_ref() {
        let (applied, failures) = (report.applied, report.failures);
        let mut journal = feed.journal.map(|p| OpJournal::start(p, seed));
        if report.hello.kv {
            let r = match journal.as_mut() {
                Some(j) => super::run_seed_observed::<EngineCache>(seed, opts.ops, opts.device, j),
                None => super::run_seed::<EngineCache>(seed, opts.ops, opts.device),
            };
            broken_now(|| Shortest::Kv(Box::new(r.trace.clone())))?;
            report.applied += r.ops_by_kind.values().sum::<u64>();
            report.checks += r.counters.checks;
            for (k, n) in &r.ops_by_kind {
                *report.ops_by_kind.entry(k.clone()).or_insert(0) += n;
            }
            if let Outcome::Fail { check, message, .. } = &r.trace.outcome {
                let run = Shortest::Kv(Box::new(r.trace.clone()));
                let (idx, shrink) = classify(&mut report, &mut tried, shrinks, check, message, seed, run);
                if shrink {
                    let shrunk = super::shrink::<EngineCache>(&r.trace, opts.device, opts.shrink_budget);
                    broken_now(|| Shortest::Kv(Box::new(r.trace.clone())))?;
                    if let Ok(s) = shrunk {
                        if s.trace.ops.len() < report.classes[idx].shortest.ops() {
                            report.classes[idx].shortest = Shortest::Kv(Box::new(s.trace));
                        }
                    }
                }
            }
        }
        drop(journal);
        if let Some(p) = feed.journal.filter(|_| report.hello.kv) {
            // The K/V run is over: a death from here on is in another layer, with no K/V op to blame.
            OpJournal::start(p, seed);
        }
        if report.hello.pool {
            let cfg = pool::PoolConfig::from_seed(seed, opts.ops);
            let r = pool::run(seed, cfg, None).map_err(|f| broke(f, seed, cfg))?;
            report.applied += r.applied;
            report.checks += r.checks;
            for (k, n) in &r.ops_by_kind {
                *report.ops_by_kind.entry(format!("pool_{k}")).or_insert(0) += n;
            }
            if let Outcome::Fail { check, message, .. } = &r.trace.outcome {
                let run = Shortest::Pool(Box::new(r.trace.clone()));
                let (idx, shrink) = classify(&mut report, &mut tried, shrinks, check, message, seed, run);
                if shrink {
                    let s = pool::shrink(&r.trace, opts.shrink_budget).map_err(|f| broke(f, seed, cfg))?;
                    if s.ops.len() < report.classes[idx].shortest.ops() {
                        report.classes[idx].shortest = Shortest::Pool(Box::new(s));
                    }
                }
            }
        }
        if report.hello.prefix {
            let cfg = super::prefix::PrefixConfig::from_seed(seed, opts.ops);
            let broke_at = |failure| {
                let ops = super::prefix::generate(seed, &cfg);
                let t = super::prefix::PrefixTrace {
                    format: super::prefix::FORMAT.into(),
                    version: 1,
                    seed,
                    config: cfg.clone(),
                    ops,
                    outcome: Outcome::Pass,
                };
                Broken { failure, trace: Some(Box::new(Shortest::Prefix(Box::new(t)))) }
            };
            let r = super::prefix::run(seed, cfg.clone(), None).map_err(broke_at)?;
            report.applied += r.applied;
            report.checks += r.checks;
            *report.ops_by_kind.entry("prefix_hit".into()).or_insert(0) += r.hits;
            for (k, n) in &r.ops_by_kind {
                *report.ops_by_kind.entry(format!("prefix_{k}")).or_insert(0) += n;
            }
            if let Outcome::Fail { check, message, .. } = &r.trace.outcome {
                let run = Shortest::Prefix(Box::new(r.trace.clone()));
                let (idx, shrink) =
                    classify(&mut report, &mut tried, shrinks, check.as_str(), message.as_str(), seed, run);
                if shrink {
                    let s = super::prefix::shrink(&r.trace, opts.shrink_budget).map_err(broke_at)?;
                    if s.ops.len() < report.classes[idx].shortest.ops() {
                        report.classes[idx].shortest = Shortest::Prefix(Box::new(s));
                    }
                }
            }
        }
        if report.hello.recurrent {
            recurrent_seed(&mut report, &mut tried, seed, opts, shrinks)?;
        }
        report.seeds += 1;
        (feed.on_seed)(seed, report.applied - applied, report.failures > failures);
    }
    for c in report.classes.iter_mut().filter(|_| reproduce) {
        let check = c.name.split('/').next().unwrap_or_default().to_string();
        if !shrinks.plans(&c.name, c.shortest.seed()) {
            c.reproducer = Err(format!("[{}]: none of its planned seeds ran here", c.name));
            continue;
        }
        if matches!(c.shortest, Shortest::Prefix(_)) && check == "prefix_model" {
            // The engine's own cold run shares this difference: a script of its calls alone cannot restate it.
            c.reproducer = Err(format!(
                "[{}] is a difference from kvsim's values that the engine's own cold run shares: judged by kvsim's \
                 model, not restated by a script of the engine's calls",
                c.name
            ));
            continue;
        }
        if !REPRODUCIBLE.contains(&check.as_str()) {
            c.reproducer = Err(format!(
                "[{}] is judged by kvsim's model, which a script of the engine's calls alone cannot restate",
                c.name
            ));
            continue;
        }
        // Replay the shortest run so the engine's log holds exactly its calls.
        let again = match &c.shortest {
            Shortest::Kv(t) => {
                let again = super::replay::<EngineCache>(t, opts.device);
                broken_now(|| c.shortest.clone())?;
                again.trace.outcome
            }
            Shortest::Pool(t) => {
                pool::replay(t)
                    .map_err(|failure| Broken { failure, trace: Some(Box::new(c.shortest.clone())) })?
                    .trace
                    .outcome
            }
            Shortest::Prefix(t) => {
                super::prefix::replay(t)
                    .map_err(|failure| Broken { failure, trace: Some(Box::new(c.shortest.clone())) })?
                    .trace
                    .outcome
            }
            Shortest::Recurrent(t) => {
                super::recurrent::replay(t)
                    .map_err(|failure| Broken { failure, trace: Some(Box::new(c.shortest.clone())) })?
                    .trace
                    .outcome
            }
        };
        let calls = calls();
        let title = format!(
            "{} {}: [{}] after {} scheduler ops (kvsim seed {})",
            report.hello.engine,
            report.hello.version,
            c.name,
            c.shortest.ops(),
            c.shortest.seed()
        );
        c.reproducer = match &again {
            Outcome::Fail { check: got, .. } if *got == check => {
                with_engine(|e| e.reproducer(&calls, &check, &title)).unwrap_or_else(|e| Err(e.to_string()))
            }
            other => Err(format!("the shortest trace did not fail the same way on replay: {other:?}")),
        };
    }
    Ok(report)
}
