//! `kvsim check-engine`: the check runs in worker processes (`kvsim check-engine --seed-feed`), each with an engine
//! process of its own. One worker (`--jobs 1`) runs the whole check; several run in two phases whose report is the
//! one worker's:
//! 1. **Class**: `--jobs` workers (`--classes-only --shrinks 0`) take the seeds on demand and report each class's
//!    failing seeds and first message, writing nothing.
//! 2. **Shrink**: the seeds a single worker would shrink (each class's first `--shrinks` failing seeds; its first
//!    failing seed when that is 0) are run again, in seed order, by one worker with the normal arguments. A class's
//!    first `--shrinks` seeds in seed order are exactly those this worker shrinks, and its first failing seed is the
//!    first to fail it here, so its shortest trace, message and reproducer are the single worker's.
//!
//! The seeds' totals (ops, checks, ops by kind, failing seeds) are the first phase's; every run of a seed is a
//! function of its seed (the engine is `reset` before each).

use std::path::Path;
use std::process::ExitCode;
use std::time::Instant;

use kvsim::campaign;
use kvsim::shard;
use kvsim::sim::DeviceChoice;
use serde_json::{json, Value};

use super::{fed_seeds, workers, WorkerMode};
use crate::commands::{crash_failure, exit, stop_on_ctrl_c};

/// What `kvsim check-engine` was asked for.
pub(crate) struct CheckEngineArgs<'a> {
    pub(crate) driver: &'a str,
    pub(crate) seeds: u64,
    pub(crate) ops: usize,
    pub(crate) timeout_s: u64,
    pub(crate) shrinks: usize,
    pub(crate) shrink_budget: usize,
    pub(crate) out: &'a Path,
    pub(crate) json: bool,
    pub(crate) only: &'a [&'a str],
    /// Workers (each with its engine) checking seeds side by side.
    pub(crate) jobs: usize,
    /// Worker mode: class the seeds, write nothing.
    pub(crate) classes_only: bool,
}

/// `kvsim check-engine`. If kvsim's own process dies during a seed (an abort inside MLX on kvsim's side), that seed
/// fails with the K/V ops it had started as its trace (`engine-crash-seed-S.trace.json` in `out`), and a fresh worker
/// (with a fresh engine) runs the check again without it. An engine process that dies is the worker's typed
/// `EngineFailure` (exit 2). The report is printed, then the crashes; the JSON line carries `crashed` and `crashes`.
pub(crate) fn check_engine_cmd(a: &CheckEngineArgs, worker: Option<WorkerMode>) -> ExitCode {
    stop_on_ctrl_c();
    if let Some(w) = worker {
        return check_engine_worker(a, w.op_journal.as_deref());
    }
    let started = Instant::now();
    let bar = crate::commands::seed_bar(a.seeds as usize, false);
    let mut crashes = vec![];
    let first = phase(a, &worker_args(a, a.jobs > 1), a.jobs, (0..a.seeds).collect(), &bar, &mut crashes);
    bar.finish_and_clear();
    let first = match first {
        Ok(o) => o,
        Err(code) => return code,
    };
    let (mut v, code) = match first {
        None => {
            println!("kvsim check-engine: no worker finished the check; {} crashed", crashes.len());
            (json!({ "seeds": 0, "failures": 0 }), 1)
        }
        Some(Done::Broken(o)) => return broken(&o, a.json),
        Some(Done::Reports(reports)) if a.jobs <= 1 => (reports.into_iter().next().unwrap_or_default(), 0),
        Some(Done::Reports(reports)) => {
            let mut merged = merge_classes(&reports);
            let again = shrink_seeds(&merged, a.shrinks);
            if !again.is_empty() {
                let hidden = indicatif::ProgressBar::hidden();
                match phase(a, &worker_args(a, false), 1, again, &hidden, &mut crashes) {
                    Err(code) => return code,
                    Ok(Some(Done::Broken(o))) => return broken(&o, a.json),
                    Ok(Some(Done::Reports(r))) => take_shrunk(&mut merged, r.first()),
                    Ok(None) => take_shrunk(&mut merged, None),
                }
            }
            merged["seconds"] = json!(started.elapsed().as_secs_f64());
            (merged, 0)
        }
    };
    print_report(&v, a.driver);
    let crashed = crashes.len() as u64;
    if crashed > 0 {
        let seeds: Vec<u64> = crashes.iter().map(|c| c.seed).collect();
        println!("  [{}] {crashed} seeds {seeds:?}: kvsim's own process died running them", campaign::CRASH_CHECK);
    }
    let failures = v.get("failures").and_then(Value::as_u64).unwrap_or(0);
    if let Some(o) = v.as_object_mut() {
        o.insert("failures".into(), (failures + crashed).into());
        o.insert("crashed".into(), crashed.into());
        o.insert("crashes".into(), serde_json::to_value(&crashes).unwrap_or_default());
    }
    if a.json {
        println!("{v}");
    }
    match code {
        0 if failures + crashed > 0 => ExitCode::FAILURE,
        c => ExitCode::from(c as u8),
    }
}

/// The worker's command line: the check's options, and `--classes-only --shrinks 0` for the classing phase.
fn worker_args(a: &CheckEngineArgs, classes_only: bool) -> Vec<String> {
    let mut args: Vec<String> = vec!["check-engine".into(), "--driver".into(), a.driver.into(), "--json".into()];
    let shrinks = if classes_only { 0 } else { a.shrinks };
    for (flag, v) in [
        ("--seeds", a.seeds.to_string()),
        ("--ops", a.ops.to_string()),
        ("--timeout-s", a.timeout_s.to_string()),
        ("--shrinks", shrinks.to_string()),
        ("--shrink-budget", a.shrink_budget.to_string()),
        ("--out", a.out.display().to_string()),
    ] {
        args.extend([flag.to_string(), v]);
    }
    if !a.only.is_empty() {
        args.extend(["--only".into(), a.only.join(",")]);
    }
    if classes_only {
        args.push("--classes-only".into());
    }
    args
}

/// How a phase's workers ended.
enum Done {
    /// Each finished worker's JSON report.
    Reports(Vec<Value>),
    /// A worker whose engine broke (exit 2): its whole output.
    Broken(shard::WorkerOutput),
}

/// Runs `seeds` over `jobs` workers `args`; a worker that died is a crash of its seed (added to `crashes`). `None`:
/// no worker finished.
fn phase(
    a: &CheckEngineArgs,
    args: &[String],
    jobs: usize,
    seeds: Vec<u64>,
    bar: &indicatif::ProgressBar,
    crashes: &mut Vec<campaign::FailedSeed>,
) -> Result<Option<Done>, ExitCode> {
    let mut failures = 0;
    let outs = workers("check-engine", args, jobs, seeds, bar, |p| {
        failures += p.failed as u64;
        bar.set_message(format!("{failures} failures"));
        bar.inc(1);
    })?;
    let mut reports = vec![];
    for o in outs {
        match (o.crash.clone(), o.status) {
            (Some(c), _) => {
                let trace = |seed, ops, how: &str| {
                    let config = kvsim::byoc::config::<kvsim::byoc::engine::EngineCache>(seed, a.ops);
                    let t = campaign::crash_trace(seed, config, None, ops, DeviceChoice::Cpu, how);
                    (format!("engine-crash-seed-{seed}.trace.json"), t)
                };
                crashes.extend(crash_failure("check-engine", a.out, o.worker, c, false, trace));
            }
            (None, Some(2)) => return Ok(Some(Done::Broken(o))),
            (None, _) => reports.extend(o.summary),
        }
    }
    Ok((!reports.is_empty()).then_some(Done::Reports(reports)))
}

/// A worker whose engine broke: what it printed, and exit 2.
fn broken(o: &shard::WorkerOutput, json: bool) -> ExitCode {
    let json_line = o.stdout.lines().rev().find(|l| l.trim_start().starts_with('{')).unwrap_or_default();
    o.stdout.lines().filter(|l| *l != json_line || json).for_each(|l| println!("{l}"));
    ExitCode::from(2)
}

/// The classing phase's reports as one: totals summed, ops by kind summed, each class's failing seeds gathered (in
/// seed order) and its message the first failing seed's. Classes are ordered as one worker meets them: by their
/// first failing seed, then by their order in the report of the worker that ran it (the order of the layers).
fn merge_classes(reports: &[Value]) -> Value {
    let mut merged = reports.first().cloned().unwrap_or_else(|| json!({}));
    for key in ["seeds", "failures", "applied", "checks"] {
        let sum: u64 = reports.iter().filter_map(|r| r.get(key).and_then(Value::as_u64)).sum();
        merged[key] = json!(sum);
    }
    let mut by_kind = std::collections::BTreeMap::<String, u64>::new();
    for r in reports {
        for (k, n) in r.get("ops_by_kind").and_then(Value::as_object).into_iter().flatten() {
            *by_kind.entry(k.clone()).or_insert(0) += n.as_u64().unwrap_or(0);
        }
    }
    merged["ops_by_kind"] = json!(by_kind);
    // name -> (first seed, its place in its worker's report, message, failing seeds)
    let mut classes = std::collections::BTreeMap::<String, (u64, usize, Value, Vec<u64>)>::new();
    for r in reports {
        for (i, c) in r.get("classes").and_then(Value::as_array).into_iter().flatten().enumerate() {
            let name = c.get("name").and_then(Value::as_str).unwrap_or_default().to_string();
            let seeds = failing_seeds(c);
            let Some(&first) = seeds.first() else { continue };
            let message = c.get("message").cloned().unwrap_or(Value::Null);
            let e = classes.entry(name).or_insert((first, i, message.clone(), vec![]));
            if first < e.0 {
                (e.0, e.1, e.2) = (first, i, message);
            }
            e.3.extend(seeds);
        }
    }
    let mut list: Vec<_> = classes.into_iter().collect();
    list.sort_by_key(|(_, (first, i, _, _))| (*first, *i));
    merged["classes"] = list
        .into_iter()
        .map(|(name, (_, _, message, mut seeds))| {
            seeds.sort_unstable();
            seeds.dedup();
            json!({ "name": name, "failing_seeds": seeds, "message": message })
        })
        .collect();
    merged
}

/// A report class's failing seeds.
fn failing_seeds(class: &Value) -> Vec<u64> {
    class["failing_seeds"].as_array().into_iter().flatten().filter_map(Value::as_u64).collect()
}

/// The seeds one worker would shrink: each class's first `shrinks` failing seeds (its first when `shrinks` is 0, for
/// its trace and reproducer), in seed order.
fn shrink_seeds(merged: &Value, shrinks: usize) -> Vec<u64> {
    let mut seeds: Vec<u64> = merged["classes"]
        .as_array()
        .into_iter()
        .flatten()
        .flat_map(|c| failing_seeds(c).into_iter().take(shrinks.max(1)))
        .collect();
    seeds.sort_unstable();
    seeds.dedup();
    seeds
}

/// Each class's shortest trace, its files and its reproducer from the shrinking phase's report (`None`: that phase
/// finished no report); a class it did not find again says so.
fn take_shrunk(merged: &mut Value, shrunk: Option<&Value>) {
    let found = shrunk.and_then(|r| r.get("classes")).and_then(Value::as_array).cloned().unwrap_or_default();
    for c in merged["classes"].as_array_mut().into_iter().flatten() {
        match found.iter().find(|f| f["name"] == c["name"]) {
            Some(f) => {
                let Some(c) = c.as_object_mut() else { continue };
                for key in ["message", "shortest_ops", "shortest_seed", "trace", "repro", "no_repro"] {
                    match f.get(key) {
                        Some(v) => c.insert(key.into(), v.clone()),
                        None => c.remove(key),
                    };
                }
            }
            None => {
                c["no_repro"] = json!("its seeds did not fail this way again when run alone to be shrunk");
            }
        }
    }
}

/// The report's lines, from its JSON: the totals, then per class its seeds, its shortest trace and its reproducer
/// (or why there is none).
fn print_report(v: &Value, driver: &str) {
    let n = |k: &str| v.get(k).and_then(Value::as_u64).unwrap_or(0);
    let s = |c: &Value, k: &str| c.get(k).and_then(Value::as_str).unwrap_or_default().to_string();
    println!(
        "{} {} ({driver}): {} seeds, {} failed, {} ops applied, {} checks",
        s(v, "engine"),
        s(v, "version"),
        n("seeds"),
        n("failures"),
        n("applied"),
        n("checks")
    );
    for c in v.get("classes").and_then(Value::as_array).into_iter().flatten() {
        let seeds = failing_seeds(c);
        if let Some(why) = c.get("no_repro").and_then(Value::as_str) {
            println!("  [{}] no reproducer: {why}", s(c, "name"));
        }
        let repro = c.get("repro").and_then(Value::as_str).map(|r| format!("; reproducer {r}")).unwrap_or_default();
        println!(
            "  [{}] {} seeds (first {:?}); shortest {} ops (seed {}); trace {}{repro}",
            s(c, "name"),
            seeds.len(),
            &seeds[..seeds.len().min(5)],
            c["shortest_ops"],
            c["shortest_seed"],
            s(c, "trace"),
        );
    }
}

/// The check itself, in the worker process: exit 0 when no seed failed, 1 when some did, 2 when the engine broke
/// (its failure printed, the run's trace saved, the process stopped). Its JSON line is its report.
fn check_engine_worker(a: &CheckEngineArgs, journal: Option<&Path>) -> ExitCode {
    use kvsim::byoc::{engine_check, CheckOptions};
    let opts = CheckOptions { seeds: a.seeds, ops: a.ops, device: DeviceChoice::Cpu, shrink_budget: a.shrink_budget };
    let timeout = std::time::Duration::from_secs(a.timeout_s);
    let started = Instant::now();
    let feed = engine_check::SeedFeed {
        seeds: Box::new(fed_seeds()),
        journal,
        on_seed: Box::new(|seed, ops, failed| eprintln!("{}", shard::Progress { seed, ops, failed }.line())),
    };
    let reproduce = !a.classes_only;
    let report = match engine_check::check_engine_fed(a.driver, timeout, opts, a.shrinks, a.only, feed, reproduce) {
        Ok(r) => r,
        Err(b) => {
            eprintln!("kvsim check-engine: the engine broke [{}]: {}", b.failure.kind(), b.failure);
            if let Some(t) = &b.trace {
                let path = a.out.join(format!("engine-{}-seed-{}.trace.json", b.failure.kind(), t.seed()));
                match std::fs::create_dir_all(a.out).and_then(|_| std::fs::write(&path, t.to_json())) {
                    Ok(()) => eprintln!("the run's trace: {}", path.display()),
                    Err(e) => eprintln!("cannot write {}: {e}", path.display()),
                }
            }
            let v = json!({"engine_failure": {"kind": b.failure.kind(), "message": b.failure.to_string()}});
            println!("{v}");
            return ExitCode::from(2);
        }
    };
    if !a.classes_only {
        if let Err(e) = std::fs::create_dir_all(a.out) {
            eprintln!("kvsim check-engine: {}: {e}", a.out.display());
            return ExitCode::from(2);
        }
    }
    let mut classes = vec![];
    for c in &report.classes {
        let mut class = json!({
            "name": c.name,
            "failing_seeds": c.failing_seeds,
            "message": c.message,
            "shortest_ops": c.shortest.ops(),
            "shortest_seed": c.shortest.seed(),
        });
        if !a.classes_only {
            let file = c.name.replace('/', "-");
            let trace_path = a.out.join(format!("{file}.trace.json"));
            if let Err(e) = std::fs::write(&trace_path, c.shortest.to_json()) {
                eprintln!("cannot write {}: {e}", trace_path.display());
            }
            class["trace"] = json!(trace_path.display().to_string());
            class["repro"] = match &c.reproducer {
                Ok(script) => {
                    let p = a.out.join(format!("{file}.py"));
                    match std::fs::write(&p, script) {
                        Ok(()) => json!(p.display().to_string()),
                        Err(e) => {
                            eprintln!("cannot write {}: {e}", p.display());
                            Value::Null
                        }
                    }
                }
                Err(why) => {
                    class["no_repro"] = json!(why);
                    Value::Null
                }
            };
        }
        classes.push(class);
    }
    let v = json!({
        "engine": report.hello.engine,
        "version": report.hello.version,
        "protocol": report.hello.protocol,
        "seeds": report.seeds,
        "failures": report.failures,
        "applied": report.applied,
        "checks": report.checks,
        "seconds": started.elapsed().as_secs_f64(),
        "ops_by_kind": report.ops_by_kind,
        "classes": classes,
    });
    println!("{v}");
    exit(report.failures == 0)
}
