//! The commands whose seeds run in a worker process (this binary again) so that they survive a process that dies (a
//! segfault or an abort inside MLX, an out-of-memory kill): `kvsim mutants` (each hunt in a `kvsim sim` worker with
//! the mutant armed), `kvsim soak` and `kvsim check-engine` (each in a worker of its own command, `--seed-feed`).
//! They share `kvsim sim --jobs`'s machinery rather than a copy of it: the pool ([`shard::run_workers`]: seeds handed
//! out on demand, a worker that dies replaced by a fresh one that runs again the seeds it had finished, then the
//! rest), the op journal ([`shard::OpJournal`]) and the crash's failure and trace ([`crash_failure`]). A seed whose
//! process died is a failure named with its seed (check `crash`), its trace the ops up to the one it died in; the
//! summary, its JSON with a `crashed` count, is always printed; the exit status is then 1.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use kvsim::cache::faults::Mutant;
use kvsim::campaign;
use kvsim::pin;
use kvsim::shard::{self, WorkerEvent};
use kvsim::sim::config::SimConfig;
use kvsim::sim::trace::Trace;
use kvsim::sim::DeviceChoice;

use crate::commands::{crash_failure, exit, fail, mib, show_hint, stop_on_ctrl_c, write_trace, STOP};

mod engine;
pub(crate) use engine::{check_engine_cmd, CheckEngineArgs};

/// Crashes in a row (no seed finished between them) after which a campaign gives up starting workers: a process that
/// dies on every seed (a broken MLX) would otherwise be replaced for ever.
const CRASHES_IN_A_ROW: u32 = 5;

/// The worker mode of `kvsim soak` and `kvsim check-engine` (hidden flags `--seed-feed`, `--op-journal FILE`): seeds
/// from stdin, a progress line per finished seed on stderr, each seed's ops kept in the op journal.
pub(crate) struct WorkerMode {
    pub(crate) op_journal: Option<PathBuf>,
}

/// The CPUs `kvsim check-engine`'s workers are bound to, worker `i` (and its engine process, and that process's
/// threads) preferring the `i mod N`-th CPU this process may use (it takes the first one from there that no other
/// kvsim worker holds: [`pin_if_told`]). A worker and its engine take turns: each round trip wakes the other side of
/// the pipe and the engine's MLX stream thread, and on the CPU it ran on a moment ago a thread wakes sooner than on
/// another one, most of all on a virtual machine whose idle CPUs sleep
/// (`bench/results/check-engine-speed/engine-speed.md`, "Each engine on a CPU of its own"). The simulator's workers
/// are not pinned: with MLX's CPU tasks inline they wait on nothing, and pinning them gained nothing there.
/// `KVSIM_PIN_CPUS=off`: none is pinned (the system places them).
pub(crate) fn worker_cpus() -> Vec<usize> {
    match std::env::var("KVSIM_PIN_CPUS").as_deref() {
        Ok("off") => vec![],
        _ => pin::allowed_cpus(),
    }
}

/// A worker started by a pool that names a CPU ([`shard::PIN_CPU_VAR`]) binds its main thread, before it starts
/// anything, to the first CPU from that one on (of those this process may use) that no other kvsim worker of the
/// machine holds, and holds it until it ends ([`pin::bind_to_claimed_cpu`]). When every one is held it runs where the
/// system places it; a CPU it cannot claim or bind to is said on stderr, and it runs unbound.
pub(crate) fn pin_if_told() {
    static CLAIM: std::sync::OnceLock<pin::CpuClaim> = std::sync::OnceLock::new();
    let Ok(told) = std::env::var(shard::PIN_CPU_VAR) else { return };
    let bound = told.parse::<usize>().map_err(|e| e.to_string()).and_then(|preferred| {
        let claim = pin::bind_to_claimed_cpu(&pin::claims_dir(), preferred).map_err(|e| e.to_string())?;
        if let Some(claim) = claim {
            let _ = CLAIM.set(claim);
        }
        Ok(())
    });
    if let Err(e) = bound {
        eprintln!("kvsim: this worker runs unbound ({e}; it was told CPU {told})");
    }
}

/// The seeds of this worker's feed (stdin), until its end or a line that is not a seed (said on stderr).
fn fed_seeds() -> impl Iterator<Item = u64> {
    shard::read_seed_feed(std::io::BufReader::new(std::io::stdin()))
        .map_while(|r| r.map_err(|e| eprintln!("kvsim: seed feed: {e}")).ok())
}

/// Runs a pool of `jobs` workers `exe ARGS...` over `seeds` (`kvsim soak`, `kvsim check-engine`), worker `i` bound to
/// a CPU from `cpus[i mod N]` on where `cpus` is not empty ([`shard::Pool::cpus`]): worker lines said
/// on stderr, `on_progress` told of each finished seed; stops respawning after [`CRASHES_IN_A_ROW`] crashes or Ctrl-C.
fn workers(
    what: &str,
    args: &[String],
    jobs: usize,
    seeds: impl IntoIterator<Item = u64>,
    cpus: &[usize],
    bar: &indicatif::ProgressBar,
    mut on_progress: impl FnMut(shard::Progress),
) -> Result<Vec<shard::WorkerOutput>, ExitCode> {
    let exe = std::env::current_exe().map_err(|e| fail(what, e, 2))?;
    let stop = AtomicBool::new(false);
    let mut in_a_row = 0;
    let pool = shard::Pool { exe: &exe, args, jobs, gpus: &[], env: &[], cpus };
    let outs = shard::run_workers(&pool, seeds, &stop, |e| {
        match e {
            WorkerEvent::Progress(p) => {
                in_a_row = 0;
                on_progress(p);
            }
            WorkerEvent::Line(line) => bar.suspend(|| eprintln!("{line}")),
            WorkerEvent::Crashed { .. } => {
                in_a_row += 1;
                if in_a_row >= CRASHES_IN_A_ROW {
                    bar.suspend(|| eprintln!("kvsim {what}: {in_a_row} workers in a row died; starting no more"));
                    stop.store(true, Ordering::SeqCst);
                }
            }
        }
        if STOP.load(Ordering::SeqCst) {
            stop.store(true, Ordering::SeqCst);
        }
    });
    outs.map_err(|e| fail(what, e, 2))
}

// ---------------------------------------------------------------------------------------------------------------
// kvsim mutants

/// Where a hunt's worker writes its failing traces (one folder per mutant, emptied when its hunt starts).
const MUTANT_TRACES: &str = "target/kvsim-failures/mutants";

pub(crate) fn mutants_cmd(
    budget: Option<u64>,
    shrink_budget: usize,
    only: Option<String>,
    save: bool,
    json: bool,
) -> ExitCode {
    stop_on_ctrl_c();
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => return fail("mutants", e, 2),
    };
    let only: Option<Vec<&str>> = only.as_deref().map(|o| o.split(',').map(str::trim).collect());
    // A name that hunts nothing would pass vacuously.
    if let Some(bad) = only.iter().flatten().find(|n| Mutant::from_name(n).is_none_or(|m| !m.in_simulator())) {
        return fail("mutants", format!("--only {bad:?} names no mutant of the simulator"), 2);
    }
    let mut rows = vec![];
    let mut crashed = 0;
    // The quantized mutants are hunted through the quantized family (`sim::family::quant`); the recurrent cache's
    // are hunted through the recurrent family (`sim::family::ssm`) like every other.
    for &m in Mutant::ALL.iter().filter(|m| m.in_simulator() && only.as_ref().is_none_or(|o| o.contains(&m.name()))) {
        if STOP.load(Ordering::SeqCst) {
            eprintln!("kvsim mutants: interrupted; the summary covers the {} hunts that ran", rows.len());
            break;
        }
        let (hunt, crashes) = hunt_in_worker(&exe, m, budget.unwrap_or(campaign::mutant_budget(m)), shrink_budget);
        crashed += crashes;
        if let (true, Some(t)) = (save, hunt.corpus_trace()) {
            write_trace(Path::new("corpus"), &format!("mutant-{}.json", m.name()), &t);
        }
        println!("{}", hunt.line());
        rows.push(hunt);
    }
    let times = campaign::CatchTimes::of(&rows);
    println!("{}", times.line());
    if crashed > 0 {
        println!("{crashed} hunt processes died (crashed): each caught its mutant at the seed it was running");
    }
    if json {
        println!("{}", serde_json::json!({ "mutants": rows, "time_to_catch": times, "crashed": crashed }));
    }
    exit(rows.iter().all(|h| h.caught) && crashed == 0)
}

/// One mutant's hunt in a worker process: `kvsim sim` over the hunt's seeds ([`campaign::hunt_seeds`], in order)
/// with the mutant armed (`KVSIM_MUTANT`), stopped at its first failing seed, whose trace `kvsim shrink` then shrinks
/// in another process. A worker that dies catches the mutant at the seed it was running (check `crash`; its trace,
/// the ops up to the crash, records the mutant, so `kvsim replay` runs them armed). Returns the hunt and the number
/// of worker processes that died in it.
fn hunt_in_worker(exe: &Path, m: Mutant, budget: u64, shrink_budget: usize) -> (campaign::MutantHunt, u64) {
    let dir = Path::new(MUTANT_TRACES).join(m.name());
    let _ = std::fs::remove_dir_all(&dir);
    let args: Vec<String> = [
        "sim",
        "--first",
        "0",
        "--seeds",
        &budget.to_string(),
        "--device",
        "cpu",
        "--json",
        "--progress-lines",
        "--out",
        &dir.display().to_string(),
    ]
    .map(String::from)
    .to_vec();
    let env = [("KVSIM_MUTANT", m.name())];
    let pool = shard::Pool { exe, args: &args, jobs: 1, gpus: &[], env: &env, cpus: &[] };
    let stop = AtomicBool::new(false);
    let start = Instant::now();
    let mut hunt = campaign::MutantHunt::new(m, budget);
    let mut caught: Option<(u64, f64)> = None;
    let mut crashes: Vec<(usize, shard::WorkerCrash, f64)> = vec![];
    let outs = shard::run_workers(&pool, campaign::hunt_seeds(m, budget), &stop, |e| {
        match e {
            WorkerEvent::Progress(p) if p.failed && caught.is_none() => {
                caught = Some((p.seed, start.elapsed().as_secs_f64()));
                stop.store(true, Ordering::SeqCst);
            }
            WorkerEvent::Progress(_) => {}
            WorkerEvent::Crashed { worker, crash } => {
                crashes.push((worker, crash, start.elapsed().as_secs_f64()));
                stop.store(true, Ordering::SeqCst);
            }
            // The worker's own FAIL lines are the catch, said below as the hunt's line; its other lines are said.
            WorkerEvent::Line(l) if l.starts_with("FAIL ") || l.starts_with("     ") || l.contains("KVSIM_MUTANT") => {}
            WorkerEvent::Line(l) => eprintln!("{l}"),
        }
        if STOP.load(Ordering::SeqCst) {
            stop.store(true, Ordering::SeqCst);
        }
    });
    hunt.seconds_to_catch = start.elapsed().as_secs_f64();
    if let Err(e) = outs {
        eprintln!("kvsim mutants: {}: {e}", m.name());
    }
    // A crash before the first failing seed (or with none) catches the mutant there. The worker holds a seed beyond
    // the one it runs, so it may die in the seed after the catch: that seed is not the hunt's, and is not counted.
    let crash = crashes.into_iter().find(|(_, c, _)| caught.is_none_or(|(s, _)| c.seed.is_some_and(|c| c < s)));
    let n = crash.is_some() as u64;
    if let Some((worker, crash, seconds)) = crash {
        let how = crash.how.clone();
        let trace = |seed, ops, how: &str| {
            let mut t = campaign::crash_trace(seed, SimConfig::from_seed(seed), Some(m), ops, DeviceChoice::Cpu, how);
            t.note = format!(
                "mutant {}: its hunt's process was {how} running seed {seed}: the ops it had started",
                m.name()
            );
            (format!("seed-{seed}.crash.json"), t)
        };
        if let Some(f) = crash_failure("mutants", &dir, worker, crash, true, trace) {
            caught = None;
            hunt.caught = true;
            hunt.seeds = f.seed + 1;
            hunt.seed = Some(f.seed);
            hunt.seconds_to_catch = seconds;
            hunt.check = Some(campaign::CRASH_CHECK.into());
            hunt.shrunk_ops = Some(f.op_index + 1);
            hunt.crash = Some(how);
            hunt.trace = Some(f.trace);
        }
    }
    if let Some((seed, seconds)) = caught {
        let path = dir.join(format!("seed-{seed}.json"));
        match Trace::load(&path) {
            Ok(t) => {
                hunt.caught = true;
                hunt.seeds = seed + 1;
                hunt.seed = Some(seed);
                hunt.seconds_to_catch = seconds;
                hunt.check = match &t.outcome {
                    kvsim::sim::trace::Outcome::Fail { check, .. } => Some(check.clone()),
                    kvsim::sim::trace::Outcome::Pass => Some(String::new()),
                };
                hunt.trace = Some(path.display().to_string());
                let started = Instant::now();
                hunt.shrunk =
                    shrink_in_worker(exe, &path, &dir.join(format!("seed-{seed}.shrunk.json")), shrink_budget);
                hunt.shrink_seconds = started.elapsed().as_secs_f64();
                hunt.shrunk_ops = Some(hunt.shrunk.as_ref().map_or(t.ops.len(), |s| s.ops.len()));
            }
            Err(e) => eprintln!("kvsim mutants: {}: seed {seed} failed but its trace is unreadable: {e}", m.name()),
        }
    }
    (hunt, n)
}

/// `kvsim shrink TRACE --out OUT` in another process (a crash there loses the shrink, not the catalog run); `None`
/// when it did not shrink (the caller keeps the unshrunk trace).
fn shrink_in_worker(exe: &Path, trace: &Path, out: &Path, budget: usize) -> Option<Trace> {
    let o = std::process::Command::new(exe)
        .arg("shrink")
        .arg(trace)
        .arg("--out")
        .arg(out)
        .args(["--budget", &budget.to_string(), "--device", "cpu"])
        .output();
    match o {
        Ok(o) if o.status.success() => Trace::load(out).ok(),
        Ok(o) => {
            eprintln!(
                "kvsim mutants: the shrink of {} ended with {}: {}",
                trace.display(),
                o.status,
                String::from_utf8_lossy(&o.stderr).trim()
            );
            None
        }
        Err(e) => {
            eprintln!("kvsim mutants: cannot start the shrink of {}: {e}", trace.display());
            None
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// kvsim soak

/// What `kvsim soak` was asked for.
pub(crate) struct SoakArgs {
    pub(crate) ops: Option<u64>,
    pub(crate) time: Option<f64>,
    pub(crate) first: u64,
    pub(crate) device: DeviceChoice,
    pub(crate) trim: bool,
    pub(crate) out: Option<PathBuf>,
    pub(crate) json: bool,
}

/// Where `kvsim soak` writes failing seeds' traces.
const SOAK_FAILURES: &str = "target/kvsim-failures";

/// `kvsim soak`: the soak runs in a worker process (`kvsim soak --seed-feed`), which measures its own memory; this
/// process hands it the seeds `first, first + 1, ...` until it ends on its budget. A worker that dies fails the seed
/// it was running; a fresh one runs the soak again without that seed (the seeds the dead one had finished first, so
/// that the memory report is one process's over every other seed; a soak `--time S` then takes longer than S).
pub(crate) fn soak_cmd(a: SoakArgs, worker: Option<WorkerMode>) -> ExitCode {
    use kvsim::soak::{Budget, SoakConfig};
    stop_on_ctrl_c();
    let budget = match (a.ops, a.time) {
        (Some(n), _) => Budget::Ops(n),
        (None, Some(t)) => Budget::Seconds(t),
        (None, None) => return fail("soak", "give --ops N or --time S", 2),
    };
    let cfg = SoakConfig { trim: a.trim, ..SoakConfig::new(budget, a.first) };
    if let Some(w) = worker {
        return soak_worker(cfg, a.device, w.op_journal.as_deref());
    }
    let (len, unit) = match budget {
        Budget::Ops(n) => (n, "ops"),
        Budget::Seconds(t) => (t.ceil() as u64, "s"),
    };
    let bar = indicatif::ProgressBar::new(len);
    let style = format!("{{elapsed_precise}} [{{bar:40}}] {{pos}}/{{len}} {unit}  ETA {{eta}}  {{msg}}");
    bar.set_style(indicatif::ProgressStyle::with_template(&style).unwrap().progress_chars("=> "));
    let mut args: Vec<String> = vec!["soak".into(), "--first".into(), a.first.to_string(), "--json".into()];
    args.extend(["--device".into(), a.device.name().into()]);
    match budget {
        Budget::Ops(n) => args.extend(["--ops".into(), n.to_string()]),
        Budget::Seconds(t) => args.extend(["--time".into(), t.to_string()]),
    }
    if a.trim {
        args.push("--trim".into());
    }
    let started = Instant::now();
    let (mut seeds, mut ops, mut failures) = (0u64, 0u64, 0u64);
    let outs = workers("soak", &args, 1, (0u64..).map(|i| a.first.wrapping_add(i)), &[], &bar, |p| {
        seeds += 1;
        ops += p.ops;
        failures += p.failed as u64;
        bar.set_position(match budget {
            Budget::Ops(_) => ops,
            Budget::Seconds(_) => started.elapsed().as_secs(),
        });
        bar.set_message(format!("{seeds} seeds, {failures} failures"));
    });
    bar.finish_and_clear();
    let outs = match outs {
        Ok(o) => o,
        Err(code) => return code,
    };
    let mut crashes = vec![];
    let mut report = None;
    for o in outs {
        match o.crash {
            Some(c) => {
                let trace = |seed, ops, how: &str| {
                    let t = campaign::crash_trace(seed, SimConfig::from_seed(seed), None, ops, a.device, how);
                    (format!("seed-{seed}.json"), t)
                };
                crashes.extend(crash_failure("soak", Path::new(SOAK_FAILURES), o.worker, c, true, trace));
            }
            None => match o.summary.map(serde_json::from_value::<kvsim::soak::SoakReport>) {
                Some(Ok(r)) => report = Some(r),
                Some(Err(e)) => eprintln!("kvsim soak: worker {} printed an unreadable report: {e}", o.worker),
                None => eprintln!("kvsim soak: worker {} printed no report", o.worker),
            },
        }
    }
    let Some(mut report) = report else {
        // No worker finished the soak (each died): the crashes are the whole report.
        let failed: Vec<u64> = crashes.iter().map(|c| c.seed).collect();
        println!("kvsim soak: no worker finished the soak; {} crashed (seeds {failed:?})", crashes.len());
        if a.json {
            let n = crashes.len();
            println!(
                "{}",
                serde_json::json!({"seeds": 0, "ops": 0, "failures": n, "failed_seeds": failed, "crashed": n})
            );
        }
        return ExitCode::FAILURE;
    };
    report.crashed = crashes.len() as u64;
    report.failures += report.crashed;
    report.failed_seeds.extend(crashes.iter().map(|c| c.seed));
    report.failed_seeds.sort_unstable();
    print_soak(&report, a.device, a.out.as_deref(), a.json)
}

/// The soak itself, in the worker process: seeds from the feed, each seed's ops journaled, a progress line per seed,
/// the report as the last line (JSON).
fn soak_worker(cfg: kvsim::soak::SoakConfig, device: DeviceChoice, journal: Option<&Path>) -> ExitCode {
    use kvsim::soak::SeedRun;
    let report = kvsim::soak::soak_seeds(
        cfg,
        fed_seeds(),
        &STOP,
        |seed| {
            let r = campaign::run_seed_journaled(seed, device, None, journal);
            if let Some(f) = r.failure() {
                let p = write_trace(Path::new(SOAK_FAILURES), &format!("seed-{seed}.json"), &r.run.trace);
                eprintln!(
                    "FAIL seed {seed} op {} [{}] {}\n     trace: {}\n     see it: {}",
                    f.op_index,
                    f.check,
                    f.message,
                    p.display(),
                    show_hint(&p)
                );
            }
            let run = SeedRun { ops: r.run.trace.ops.len() as u64 - r.run.skipped, failed: r.run.failed() };
            eprintln!("{}", shard::Progress { seed, ops: run.ops, failed: run.failed }.line());
            run
        },
        |_, _| {},
    );
    println!("{}", serde_json::to_string(&report).unwrap());
    exit(report.verdict.pass && report.failures == 0)
}

/// The soak's report, as `kvsim soak` prints it (and writes it to `out`); exit 0 when memory held and no seed failed.
fn print_soak(report: &kvsim::soak::SoakReport, device: DeviceChoice, out: Option<&Path>, json: bool) -> ExitCode {
    let counted = report.heap_counted;
    let line = |what: &str, s: &kvsim::soak::MemorySample| {
        let heap = if counted {
            format!("  heap live {:>8.2} MiB  free {:>8.2} MiB", mib(s.heap_in_use), mib(s.heap_free))
        } else {
            String::new()
        };
        println!(
            "  {what:<10} ops {:>9}  MLX active {:>8.2} MiB  cache {:>8.2} MiB  peak {:>8.2} MiB  RSS {:>8.2} MiB{heap}",
            s.ops,
            mib(s.mlx_active),
            mib(s.mlx_cache),
            mib(s.mlx_peak),
            mib(s.rss),
        )
    };
    println!(
        "kvsim soak: {} seeds, {} ops in {:.1}s ({:.0} ops/s) on {}, {} failures{}{}",
        report.seeds,
        report.ops,
        report.seconds,
        report.ops_per_s,
        device.name(),
        report.failures,
        if report.crashed > 0 { format!(" ({} crashed)", report.crashed) } else { String::new() },
        if report.interrupted { " (interrupted)" } else { "" }
    );
    line("start", &report.at_start);
    if let Some(w) = &report.at_warmup {
        line("warm-up", w);
    }
    line("end", &report.at_end);
    let v = &report.verdict;
    let heap = if counted {
        format!(
            ", live heap outside the cache {:.3}x, heap free {:.2} -> {:.2} MiB",
            v.heap_outside_cache.ratio,
            mib(v.heap_free.post_warmup),
            mib(v.heap_free.final_level)
        )
    } else {
        format!(", heap not counted ({} serves malloc)", report.allocator)
    };
    println!(
        "  growth after warm-up: MLX active {:.3}x ({:.2} -> {:.2} MiB), RSS outside MLX's cache {:.3}x ({:.2} -> \
         {:.2} MiB) [raw RSS {:.3}x, MLX cache {:.2} -> {:.2} MiB{heap}, reported only]; allowed {}x: {}",
        v.mlx_active.ratio,
        mib(v.mlx_active.post_warmup),
        mib(v.mlx_active.final_level),
        v.rss_outside_cache.ratio,
        mib(v.rss_outside_cache.post_warmup),
        mib(v.rss_outside_cache.final_level),
        v.rss.ratio,
        mib(v.mlx_cache.post_warmup),
        mib(v.mlx_cache.final_level),
        report.config.tolerance,
        if v.pass { "pass" } else { v.reason.as_deref().unwrap_or("fail") }
    );
    let text = serde_json::to_string(report).unwrap();
    if let Some(p) = out {
        if let Some(dir) = p.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        if let Err(e) = std::fs::write(p, serde_json::to_string_pretty(report).unwrap()) {
            return fail("soak", format!("cannot write {}: {e}", p.display()), 2);
        }
        println!("  report: {}", p.display());
    }
    if json {
        println!("{text}");
    }
    exit(v.pass && report.failures == 0)
}
