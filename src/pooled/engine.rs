//! `kvsim check-engine`: the check runs in worker processes (`kvsim check-engine --seed-feed`), each with an engine
//! process of its own. One worker (`--jobs 1`) runs the whole check; several run in two phases whose report is the
//! one worker's:
//! 1. **Class**: `--jobs` workers (`--classes-only --shrinks 0`) take the seeds on demand and report each class's
//!    failing seeds and first message, writing nothing.
//! 2. **Shrink**: the seeds a single worker would shrink (each class's first `--shrinks` failing seeds; its first
//!    failing seed when that is 0) are run again by up to `--jobs` workers, each told which seeds of which class to
//!    shrink (`--shrink-plan`) and writing its traces and reproducers in a folder of its own. Each class's shortest
//!    is the shortest of the workers' (the earlier seed on a tie), which is the one a single worker keeps: it
//!    shrinks the same seeds and keeps a shorter trace only. Its files are moved into `--out`.
//!
//! The seeds' totals (ops, checks, ops by kind, failing seeds) and each class's message (its first failing seed's)
//! are the first phase's; every run of a seed is a function of its seed (the engine is `reset` before each).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
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
    /// Worker mode: the seeds of each class to shrink (JSON), the files written in a folder of this process's own.
    pub(crate) shrink_plan: Option<&'a str>,
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
    let mode = if a.jobs > 1 { Phase::Class } else { Phase::Whole };
    let first = phase(a, &worker_args(a, mode), a.jobs, (0..a.seeds).collect(), &bar, &mut crashes);
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
            let plan = shrink_plan(&merged, a.shrinks);
            let mut again: Vec<u64> = plan.values().flatten().copied().collect();
            again.sort_unstable();
            again.dedup();
            if !again.is_empty() {
                let hidden = indicatif::ProgressBar::hidden();
                let args = worker_args(a, Phase::Shrink(&plan));
                let done = phase(a, &args, a.jobs.min(again.len()), again, &hidden, &mut crashes);
                let reports = match done {
                    Err(code) => return code,
                    Ok(Some(Done::Broken(o))) => return broken(&o, a.json),
                    Ok(Some(Done::Reports(r))) => r,
                    Ok(None) => vec![],
                };
                if take_shrunk(&mut merged, &reports, &plan, a.out) {
                    let _ = std::fs::remove_dir_all(shrinking_dir(a.out));
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

/// What a phase's workers are asked for.
#[derive(Clone, Copy)]
enum Phase<'p> {
    /// The whole check (`--jobs 1`).
    Whole,
    /// Class the seeds only (`--classes-only --shrinks 0`).
    Class,
    /// Shrink the planned seeds of each class (`--shrink-plan`), the files under [`shrinking_dir`].
    Shrink(&'p BTreeMap<String, Vec<u64>>),
}

/// Where the shrinking phase's workers write their traces and reproducers (each in a folder of its own).
fn shrinking_dir(out: &Path) -> PathBuf {
    out.join(".shrinking")
}

/// The worker's command line: the check's options, and those of its phase.
fn worker_args(a: &CheckEngineArgs, phase: Phase) -> Vec<String> {
    let mut args: Vec<String> = vec!["check-engine".into(), "--driver".into(), a.driver.into(), "--json".into()];
    let shrinks = if matches!(phase, Phase::Class) { 0 } else { a.shrinks };
    let out = if matches!(phase, Phase::Shrink(_)) { shrinking_dir(a.out) } else { a.out.to_path_buf() };
    for (flag, v) in [
        ("--seeds", a.seeds.to_string()),
        ("--ops", a.ops.to_string()),
        ("--timeout-s", a.timeout_s.to_string()),
        ("--shrinks", shrinks.to_string()),
        ("--shrink-budget", a.shrink_budget.to_string()),
        ("--out", out.display().to_string()),
    ] {
        args.extend([flag.to_string(), v]);
    }
    if !a.only.is_empty() {
        args.extend(["--only".into(), a.only.join(",")]);
    }
    match phase {
        Phase::Whole => {}
        Phase::Class => args.push("--classes-only".into()),
        Phase::Shrink(plan) => args.extend(["--shrink-plan".into(), json!(plan).to_string()]),
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
    let outs = workers("check-engine", args, jobs, seeds, &super::worker_cpus(), bar, |p| {
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

/// The seeds one worker would shrink, by class: each class's first `shrinks` failing seeds (its first when `shrinks`
/// is 0, for its trace and reproducer).
fn shrink_plan(merged: &Value, shrinks: usize) -> BTreeMap<String, Vec<u64>> {
    let classes = merged["classes"].as_array().into_iter().flatten();
    classes
        .map(|c| {
            let name = c["name"].as_str().unwrap_or_default().to_string();
            (name, failing_seeds(c).into_iter().take(shrinks.max(1)).collect())
        })
        .collect()
}

/// Each class's shortest trace, its files and its reproducer from the shrinking phase's reports: the shortest of
/// the workers' that ran one of its planned seeds (the earlier seed on a tie), its files moved into `out`; a class
/// no worker found again says so. False when a file could not be moved (the report then names it where it is, and
/// the workers' folders are kept).
fn take_shrunk(merged: &mut Value, reports: &[Value], plan: &BTreeMap<String, Vec<u64>>, out: &Path) -> bool {
    let mut all_moved = true;
    let found: Vec<&Value> =
        reports.iter().flat_map(|r| r.get("classes").and_then(Value::as_array).into_iter().flatten()).collect();
    for c in merged["classes"].as_array_mut().into_iter().flatten() {
        let name = c["name"].as_str().unwrap_or_default().to_string();
        let seeds = plan.get(&name).map(Vec::as_slice).unwrap_or_default();
        let best = found
            .iter()
            .filter(|f| f["name"] == c["name"] && f["shortest_seed"].as_u64().is_some_and(|s| seeds.contains(&s)))
            .min_by_key(|f| (f["shortest_ops"].as_u64(), f["shortest_seed"].as_u64()));
        let Some(f) = best else {
            c["no_repro"] = json!("its seeds did not fail this way again when run alone to be shrunk");
            continue;
        };
        let Some(c) = c.as_object_mut() else { continue };
        for key in ["shortest_ops", "shortest_seed", "trace", "repro", "no_repro"] {
            match f.get(key) {
                Some(v) => c.insert(key.into(), v.clone()),
                None => c.remove(key),
            };
        }
        // the worker's files, moved to where a single worker writes them
        let file = name.replace('/', "-");
        for (key, to) in [("trace", out.join(format!("{file}.trace.json"))), ("repro", out.join(format!("{file}.py")))]
        {
            let Some(from) = f.get(key).and_then(Value::as_str) else { continue };
            match std::fs::rename(from, &to) {
                Ok(()) => c.insert(key.into(), json!(to.display().to_string())),
                Err(e) => {
                    eprintln!("cannot move {from} to {}: {e}", to.display());
                    all_moved = false;
                    continue;
                }
            };
        }
    }
    all_moved
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
    let (shrinks, out) = match a.shrink_plan.map(serde_json::from_str::<BTreeMap<String, Vec<u64>>>) {
        None => (engine_check::Shrinks::First(a.shrinks), a.out.to_path_buf()),
        Some(Ok(seeds)) => {
            let planned = engine_check::Shrinks::Planned { seeds, shrink: a.shrinks > 0 };
            (planned, a.out.join(format!("worker-{}", std::process::id())))
        }
        Some(Err(e)) => {
            eprintln!("kvsim check-engine: --shrink-plan: {e}");
            return ExitCode::from(2);
        }
    };
    let a = &CheckEngineArgs { out: &out, ..*a };
    let report = match engine_check::check_engine_fed(a.driver, timeout, opts, &shrinks, a.only, feed, reproduce) {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The shrinking phase's workers each shrink their part of the plan: a class keeps the shortest trace among them,
    /// the earlier seed on a tie, never one of a seed outside its plan; its files are moved into `out`.
    #[test]
    fn a_class_keeps_the_shortest_planned_trace_of_the_workers() {
        let out = std::env::temp_dir().join(format!("kvsim-take-shrunk-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&out);
        std::fs::create_dir_all(&out).unwrap();
        let mut merged = json!({"classes": [
            {"name": "a/x", "failing_seeds": [1, 4, 7, 9], "message": "first"},
            {"name": "b", "failing_seeds": [4], "message": "b's"},
            {"name": "c", "failing_seeds": [2], "message": "c's"},
        ]});
        let plan = shrink_plan(&merged, 3);
        assert_eq!(plan["a/x"], vec![1, 4, 7]);
        assert_eq!(plan["b"], vec![4]);
        let class = |worker: &str, name: &str, seed: u64, ops: u64| {
            let trace = out.join(format!("{worker}-{seed}.trace.json"));
            std::fs::write(&trace, format!("{worker} {seed}")).unwrap();
            json!({"name": name, "shortest_seed": seed, "shortest_ops": ops, "trace": trace.display().to_string(),
                   "no_repro": "judged by kvsim's model"})
        };
        let reports = [
            json!({"classes": [class("w1", "a/x", 7, 5), class("w1", "b", 4, 3)]}),
            json!({"classes": [class("w2", "a/x", 1, 5)]}),
            json!({"classes": [class("w3", "a/x", 9, 2)]}), // seed 9 is not a's to shrink: a single run never would
        ];
        assert!(take_shrunk(&mut merged, &reports, &plan, &out));
        let a = &merged["classes"][0];
        assert_eq!((a["shortest_seed"].as_u64(), a["shortest_ops"].as_u64()), (Some(1), Some(5)), "{a}");
        assert_eq!(a["message"], "first");
        let moved = out.join("a-x.trace.json");
        assert_eq!(a["trace"], json!(moved.display().to_string()));
        assert_eq!(std::fs::read_to_string(&moved).unwrap(), "w2 1");
        assert_eq!(merged["classes"][1]["shortest_seed"], 4);
        assert_eq!(std::fs::read_to_string(out.join("b.trace.json")).unwrap(), "w1 4");
        assert!(merged["classes"][2]["no_repro"].as_str().unwrap().contains("did not fail this way again"));
        let _ = std::fs::remove_dir_all(&out);
    }
}
