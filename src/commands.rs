//! The handlers of the kvsim subcommands: each calls the library and prints. Part of the binary (with `main.rs` and
//! `cli.rs`): the only code that writes to stdout or chooses exit codes.

use kvsim::cache::faults::Mutant;
use kvsim::campaign;
use kvsim::oracle;
use kvsim::shard::{self, Shard};
use kvsim::sim::trace::{Expect, Trace};
use kvsim::sim::{self, DeviceChoice};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use crate::cli::CacheCmd;

pub(crate) fn cache_cmd(cmd: CacheCmd) -> ExitCode {
    use kvsim::persist::inspect;
    match cmd {
        CacheCmd::Inspect { file, json } => match inspect::inspect_file(&file) {
            Ok(i) => {
                if json {
                    println!("{}", serde_json::to_string(&i).expect("inspection serializes"));
                } else {
                    print!("{}", inspect::render(&i));
                }
                ExitCode::SUCCESS
            }
            Err(e) => {
                eprintln!("kvsim cache inspect: {}: {e}", file.display());
                ExitCode::FAILURE
            }
        },
        CacheCmd::Convert { input, output, to, ssm_offsets } => {
            match inspect::convert_with(&input, &output, to, ssm_offsets.as_deref()) {
                Ok(()) => {
                    println!("wrote {}", output.display());
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("kvsim cache convert: {}: {e}", input.display());
                    ExitCode::FAILURE
                }
            }
        }
    }
}

pub(crate) fn oracle_record_cmd(
    family: &str,
    count: usize,
    scan: u64,
    seeds: &[u64],
    include: &[u64],
    out: &Path,
    keep: bool,
) -> ExitCode {
    let mut log = |err: bool, line: String| if err { eprintln!("{line}") } else { println!("{line}") };
    match oracle::record_set(family, count, scan, seeds, include, out, keep, &mut log) {
        Ok(all) => exit(all),
        Err(e) => fail("oracle record", e, 1),
    }
}

pub(crate) fn oracle_redrive_cmd(dir: &Path, prefix: &str, keep_steps: Option<&Path>) -> ExitCode {
    let mut log = |err: bool, line: String| if err { eprintln!("{line}") } else { println!("{line}") };
    match oracle::redrive_set(dir, prefix, keep_steps, &mut log) {
        Ok(all) => exit(all),
        Err(e) => fail("oracle redrive", e, 1),
    }
}

pub(crate) fn oracle_choose_cmd(family: &str, count: usize, scan: u64, include: &[u64]) -> ExitCode {
    match oracle::describe_choice(family, count, scan, include) {
        Ok(seeds) => {
            seeds.iter().for_each(|(s, feats)| println!("seed {s}: {}", feats.join(" ")));
            println!("{}", seeds.iter().map(|s| s.0.to_string()).collect::<Vec<_>>().join(" "));
            ExitCode::SUCCESS
        }
        Err(e) => fail("oracle record", e, 1),
    }
}

pub(crate) fn oracle_diff_cmd(path: &Path) -> ExitCode {
    let rep = oracle::diff_recorded(path);
    if let Some(e) = &rep.error {
        return fail("oracle diff", e, 2);
    }
    print_all(&rep.diff_lines());
    exit(rep.status() != "unclassified")
}

pub(crate) fn oracle_check_cmd(dir: &Path, json: bool) -> ExitCode {
    let report = match oracle::check_dir(dir) {
        Ok(r) => r,
        Err(e) => return fail("oracle check", e, 2),
    };
    print_all(&report.lines());
    if json {
        println!("{}", report.json_line());
    }
    exit(report.count("unclassified") == 0)
}

pub(crate) fn oracle_teeth_cmd(dir: &Path, names: &[String], json: bool) -> ExitCode {
    let mut mutants = vec![];
    for n in names {
        match kvsim::cache::faults::Mutant::from_name(n) {
            Some(m) => mutants.push(m),
            None => return fail("oracle teeth", format!("no mutant named {n:?}"), 2),
        }
    }
    let rows = match oracle::teeth::teeth(dir, &mutants, &mut |l| println!("{l}")) {
        Ok(r) => r,
        Err(e) => return fail("oracle teeth", e, 2),
    };
    if json {
        println!("{}", oracle::teeth::json_line(&rows));
    }
    exit(rows.iter().all(|r| r.visible_traces == 0 || r.unclassified_traces > 0))
}

pub(crate) fn doctor() -> ExitCode {
    let (lines, ok) = kvsim::doctor::report();
    print_all(&lines);
    exit(ok)
}

pub(crate) fn print_all(lines: &[String]) {
    lines.iter().for_each(|l| println!("{l}"));
}

pub(crate) fn exit(ok: bool) -> ExitCode {
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

pub(crate) fn fail(what: &str, e: impl std::fmt::Display, code: u8) -> ExitCode {
    eprintln!("kvsim {what}: {e}");
    ExitCode::from(code)
}

pub(crate) fn write_trace(dir: &Path, name: &str, t: &Trace) -> PathBuf {
    let _ = std::fs::create_dir_all(dir);
    let p = dir.join(name);
    if let Err(e) = std::fs::write(&p, t.to_json()) {
        eprintln!("kvsim: cannot write {}: {e}", p.display());
    }
    p
}

pub(crate) fn sim_cmd(a: &SimArgs) -> ExitCode {
    stop_on_ctrl_c();
    if a.gpus.is_some() && a.device != DeviceChoice::Gpu {
        return fail("sim", "--gpus places --jobs workers on GPUs: it needs --device gpu", 2);
    }
    let mutant = match planted_mutant() {
        Ok(m) => m,
        Err(e) => return fail("sim", e, 2),
    };
    if a.jobs > 1 {
        return sim_jobs_cmd(a);
    }
    // A `--jobs` worker takes its seeds from stdin, as the parent hands them out; a bad line ends the feed.
    let mut feed_error = None;
    let seeds: Box<dyn Iterator<Item = u64>> = if a.seed_feed {
        let lines = shard::read_seed_feed(std::io::stdin().lock());
        Box::new(lines.map_while(|r| r.map_err(|e| feed_error = Some(e)).ok()))
    } else {
        Box::new(shard::campaign_seeds(a.first, a.requested, a.shard).into_iter())
    };
    let n = if a.seed_feed { 0 } else { shard::campaign_seeds(a.first, a.requested, a.shard).len() };
    let bar = seed_bar(n, a.progress_lines);
    // Few seeds: each seed's swarm config is printed with its result (every trace stores it; failures repeat it).
    let (show_configs, mut failures) = (n <= 10 && !a.progress_lines, 0);
    let journal = a.op_journal.as_deref();
    let s = campaign::run_seeds_journaled(seeds, a.device, a.time, &STOP, mutant, journal, |r| {
        let config = serde_json::to_string(&r.config).unwrap();
        if show_configs {
            bar.suspend(|| println!("config of seed {}: {config}", r.seed));
        }
        let written = r.failure().map(|f| {
            failures += 1;
            let p = write_trace(&a.out, &format!("seed-{}.json", r.seed), &r.run.trace);
            let (seed, op, check, msg) = (r.seed, f.op_index, f.check, f.message);
            bar.suspend(|| {
                eprintln!(
                    "FAIL seed {seed} op {op} [{check}] {msg}\n     trace: {}\n     config: {config}\n     see it: {}",
                    p.display(),
                    show_hint(&p)
                )
            });
            p.display().to_string()
        });
        if a.progress_lines {
            let ops = r.run.trace.ops.len() as u64 - r.run.skipped;
            eprintln!("{}", shard::Progress { seed: r.seed, ops, failed: r.run.failed() }.line());
        }
        bar.set_message(format!("{failures} failures"));
        bar.inc(1);
        written
    });
    bar.finish_and_clear();
    if let Some(e) = feed_error {
        return fail("sim --seed-feed", e, 2);
    }
    print_summary(&s, a);
    exit(s.failures == 0)
}

/// The catalog mutant `KVSIM_MUTANT` arms in every run of `kvsim sim` (unset or empty: none): a planted failure, to
/// check a campaign's plumbing end to end (`deploy/test-slurm.sh` plants one in one shard). Announced on stderr;
/// every failing trace records it, so `kvsim replay` reproduces the failure. `--jobs` workers inherit it.
pub(crate) fn planted_mutant() -> Result<Option<Mutant>, String> {
    let name = std::env::var("KVSIM_MUTANT").unwrap_or_default();
    if name.is_empty() {
        return Ok(None);
    }
    match Mutant::from_name(&name).filter(|m| m.in_simulator()) {
        Some(m) => {
            eprintln!("kvsim sim: mutant {name} armed (KVSIM_MUTANT): its failures are planted");
            Ok(Some(m))
        }
        None => Err(format!("KVSIM_MUTANT={name:?} names no mutant of the simulator (`kvsim mutants` lists them)")),
    }
}

/// Set by Ctrl-C: campaigns stop before their next seed and still print the summary of what ran.
static STOP: AtomicBool = AtomicBool::new(false);

/// When the first Ctrl-C arrived (milliseconds since the Unix epoch; 0 before it).
static FIRST_STOP_MS: AtomicU64 = AtomicU64::new(0);

/// The first Ctrl-C asks for a clean stop (after the current seed); a second one at least a second later quits at
/// once (exit 130). A SIGINT repeated within that second counts as the first: `timeout -s INT` (GNU coreutils)
/// signals the command and then its whole process group, so the command gets the signal twice at once.
///
/// SIGINT through the C library's `signal` (POSIX; the handler only touches atomics and reads the clock with
/// `clock_gettime`, both async-signal-safe). The `ctrlc` crate does the same; adding it re-resolved shared
/// dependencies' features and rebuilt MLX's bindings (about 40 minutes on the 2 shared cores).
pub(crate) fn stop_on_ctrl_c() {
    extern "C" {
        fn signal(signum: i32, handler: extern "C" fn(i32)) -> usize;
        fn _exit(status: i32) -> !;
    }
    extern "C" fn on_sigint(_: i32) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(1, |d| d.as_millis() as u64)
            .max(1);
        if !STOP.swap(true, Ordering::SeqCst) {
            FIRST_STOP_MS.store(now, Ordering::SeqCst);
        } else if now.saturating_sub(FIRST_STOP_MS.load(Ordering::SeqCst)) >= 1000 {
            // SAFETY: `_exit` is async-signal-safe and ends the process without running anything else.
            unsafe { _exit(130) }
        }
    }
    const SIGINT: i32 = 2;
    // SAFETY: installs a handler that only touches atomics, reads the clock (or exits); called once, before any
    // campaign starts.
    unsafe {
        signal(SIGINT, on_sigint);
    }
}

/// A progress bar over `n` seeds: rate, ETA and failures so far (hidden for workers, which report progress lines).
pub(crate) fn seed_bar(n: usize, hidden: bool) -> indicatif::ProgressBar {
    if hidden {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(n as u64);
    let style = indicatif::ProgressStyle::with_template(
        "{elapsed_precise} [{bar:40}] {pos}/{len} seeds  {per_sec}  ETA {eta}  {msg}",
    );
    bar.set_style(style.unwrap().progress_chars("=> "));
    bar.set_message("0 failures");
    bar
}

/// The campaign `kvsim sim` was asked for.
pub(crate) struct SimArgs {
    pub(crate) first: u64,
    pub(crate) requested: u64,
    pub(crate) shard: Option<Shard>,
    pub(crate) device: DeviceChoice,
    pub(crate) time: Option<f64>,
    pub(crate) json: bool,
    pub(crate) out: PathBuf,
    pub(crate) jobs: u64,
    /// `--gpus`: the GPUs the `--jobs` workers are spread over.
    pub(crate) gpus: Option<shard::Gpus>,
    pub(crate) progress_lines: bool,
    /// Worker mode of `--jobs`: seeds come from stdin, and the summary is always a [`campaign::Part`].
    pub(crate) seed_feed: bool,
    /// Worker mode of `--jobs`: the op journal ([`shard::OpJournal`]).
    pub(crate) op_journal: Option<PathBuf>,
    /// The full table instead of the verdict.
    pub(crate) verbose: bool,
}

pub(crate) fn print_summary(s: &campaign::Summary, a: &SimArgs) {
    print_all(&if a.verbose { s.lines() } else { s.verdict() });
    if s.interrupted {
        eprintln!("kvsim sim: interrupted; the summary covers the {} seeds that ran", s.seeds);
    }
    if a.json {
        let line = match a.shard.is_some() || a.seed_feed {
            true => serde_json::to_string(&campaign::Part::of(s, a.first, a.requested, a.shard)),
            false => serde_json::to_string(s),
        };
        println!("{}", line.unwrap());
    }
}

pub(crate) fn sim_jobs_cmd(a: &SimArgs) -> ExitCode {
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => return fail("sim --jobs", e, 2),
    };
    let mut args: Vec<String> = vec!["sim".into(), "--first".into(), a.first.to_string()];
    args.extend(["--seeds".into(), a.requested.to_string(), "--device".into(), a.device.name().into()]);
    args.extend(["--json".into(), "--progress-lines".into(), "--out".into(), a.out.display().to_string()]);
    if let Some(t) = a.time {
        args.extend(["--time".into(), t.to_string()]);
    }
    if kvsim::cache::read_mode() == kvsim::cache::ReadMode::Exact {
        args.push("--exact-read".into());
    }
    if let Some(shard) = a.shard {
        args.extend(["--shard".into(), shard.to_string()]);
    }
    let gpus = match a.gpus.map(|spec| {
        let smi = || std::process::Command::new("nvidia-smi").arg("-L").output().ok().filter(|o| o.status.success());
        let env = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        let smi = env.is_none().then(smi).flatten().map(|o| String::from_utf8_lossy(&o.stdout).into_owned());
        shard::worker_gpus(spec, &shard::visible_gpus(env.as_deref(), smi.as_deref()))
    }) {
        None => vec![],
        Some(Ok(g)) => g,
        Some(Err(e)) => return fail("sim --jobs", e, 2),
    };
    let seeds = shard::campaign_seeds(a.first, a.requested, a.shard);
    let bar = seed_bar(seeds.len(), a.progress_lines);
    let mut failures = 0;
    let outs = shard::run_workers(&exe, &args, a.jobs as usize, &gpus, &seeds, &STOP, |event| match event {
        shard::WorkerEvent::Progress(p) => {
            failures += p.failed as u64;
            bar.set_message(format!("{failures} failures"));
            bar.inc(1);
            if a.progress_lines {
                eprintln!("{}", p.line());
            }
        }
        shard::WorkerEvent::Line(line) => bar.suspend(|| eprintln!("{line}")),
    });
    bar.finish_and_clear();
    let outs = match outs {
        Ok(o) => o,
        Err(e) => return fail("sim --jobs", e, 2),
    };
    let mut parts = vec![];
    let mut crashes = vec![];
    for o in outs {
        if let Some(c) = o.crash {
            // A worker that died: the seed it was running fails with the ops it had started as its trace; the
            // seeds it finished or held ran again in the worker that took its place.
            match c.seed {
                Some(seed) => {
                    let ops = c.ops.len();
                    let t = campaign::crash_trace(seed, c.ops, a.device, &c.how);
                    let p = write_trace(&a.out, &format!("seed-{seed}.json"), &t);
                    let op = ops.saturating_sub(1);
                    bar.suspend(|| {
                        eprintln!(
                            "FAIL seed {seed} op {op} [{}] worker {} was {} ({ops} ops started)\n     trace: {}\n     \
                             replay it in another process: kvsim replay {}",
                            campaign::CRASH_CHECK,
                            o.worker,
                            c.how,
                            p.display(),
                            p.display()
                        )
                    });
                    crashes.push(campaign::FailedSeed {
                        seed,
                        op_index: op,
                        check: campaign::CRASH_CHECK.into(),
                        message: format!("worker {} was {} in op {op}", o.worker, c.how),
                        trace: p.display().to_string(),
                    });
                }
                None => eprintln!("kvsim sim --jobs: worker {} was {} holding no seed", o.worker, c.how),
            }
            continue;
        }
        let part = o.summary.ok_or_else(|| format!("printed no summary (exit status {:?})", o.status)).and_then(|v| {
            serde_json::from_value::<campaign::Part>(v).map_err(|e| format!("printed an unreadable summary: {e}"))
        });
        match part {
            Ok(p) => parts.push(p),
            Err(e) => return fail("sim --jobs", format!("worker {}: {e}", o.worker), 2),
        }
    }
    // Every worker died and none took the place of the last one (every seed crashed): an empty campaign.
    let merged = if parts.is_empty() && !crashes.is_empty() {
        Ok(campaign::Summary::new(a.device))
    } else {
        campaign::merge(&parts)
    };
    match merged {
        Ok(mut s) => {
            for c in crashes {
                s.add_crash(c);
            }
            // Ctrl-C reached only this process (the workers then ran out of seeds, not interrupted): the summary
            // still says the campaign was cut short.
            s.interrupted |= STOP.load(Ordering::SeqCst) && (s.seeds as usize) < seeds.len();
            print_summary(&s, a);
            exit(s.failures == 0)
        }
        Err(e) => fail("sim --jobs", e, 2),
    }
}

pub(crate) fn merge_cmd(paths: &[PathBuf], json: bool) -> ExitCode {
    let mut parts = vec![];
    for p in paths {
        let text = match std::fs::read_to_string(p) {
            Ok(t) => t,
            Err(e) => return fail("merge", format!("{}: {e}", p.display()), 2),
        };
        match campaign::Part::from_output(&p.display().to_string(), &text) {
            Ok(part) => parts.push(part),
            Err(e) => return fail("merge", e, 2),
        }
    }
    match campaign::merge(&parts) {
        Ok(s) => {
            println!("kvsim merge: {} parts", parts.len());
            print_all(&s.lines());
            if json {
                println!("{}", serde_json::to_string(&s).unwrap());
            }
            exit(s.failures == 0)
        }
        Err(e) => fail("merge", e, 2),
    }
}

pub(crate) fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

pub(crate) fn soak_cmd(
    ops: Option<u64>,
    time: Option<f64>,
    first: u64,
    device: DeviceChoice,
    trim: bool,
    out: Option<PathBuf>,
    json: bool,
) -> ExitCode {
    use kvsim::soak::{Budget, SeedRun, SoakConfig};
    stop_on_ctrl_c();
    let budget = match (ops, time) {
        (Some(n), _) => Budget::Ops(n),
        (None, Some(t)) => Budget::Seconds(t),
        (None, None) => return fail("soak", "give --ops N or --time S", 2),
    };
    let (len, unit) = match budget {
        Budget::Ops(n) => (n, "ops"),
        Budget::Seconds(t) => (t.ceil() as u64, "s"),
    };
    let bar = indicatif::ProgressBar::new(len);
    let style = format!("{{elapsed_precise}} [{{bar:40}}] {{pos}}/{{len}} {unit}  ETA {{eta}}  {{msg}}");
    bar.set_style(indicatif::ProgressStyle::with_template(&style).unwrap().progress_chars("=> "));
    let failures_dir = PathBuf::from("target/kvsim-failures");
    let report = kvsim::soak::soak(
        SoakConfig { trim, ..SoakConfig::new(budget, first) },
        &STOP,
        |seed| {
            let r = campaign::run_seed(seed, device);
            if let Some(f) = r.failure() {
                let p = write_trace(&failures_dir, &format!("seed-{seed}.json"), &r.run.trace);
                bar.suspend(|| {
                    eprintln!(
                        "FAIL seed {seed} op {} [{}] {}\n     trace: {}\n     see it: {}",
                        f.op_index,
                        f.check,
                        f.message,
                        p.display(),
                        show_hint(&p)
                    )
                });
            }
            SeedRun { ops: r.run.trace.ops.len() as u64 - r.run.skipped, failed: r.run.failed() }
        },
        |s, failures| {
            bar.set_position(match budget {
                Budget::Ops(_) => s.ops,
                Budget::Seconds(_) => s.seconds as u64,
            });
            bar.set_message(format!(
                "{} seeds, {:.0} ops/s, MLX active {:.1} MiB, RSS {:.1} MiB, {failures} failures",
                s.seeds,
                s.ops as f64 / s.seconds.max(1e-9),
                mib(s.mlx_active),
                mib(s.rss)
            ));
        },
    );
    bar.finish_and_clear();
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
        "kvsim soak: {} seeds, {} ops in {:.1}s ({:.0} ops/s) on {}, {} failures{}",
        report.seeds,
        report.ops,
        report.seconds,
        report.ops_per_s,
        device.name(),
        report.failures,
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
    let text = serde_json::to_string(&report).unwrap();
    if let Some(p) = &out {
        if let Some(dir) = p.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        if let Err(e) = std::fs::write(p, serde_json::to_string_pretty(&report).unwrap()) {
            return fail("soak", format!("cannot write {}: {e}", p.display()), 2);
        }
        println!("  report: {}", p.display());
    }
    if json {
        println!("{text}");
    }
    exit(v.pass && report.failures == 0)
}

pub(crate) fn replay_cmd(path: &Path, device: DeviceChoice) -> ExitCode {
    match Trace::load(path) {
        Ok(trace) => {
            let (lines, ok) = sim::replay_report(&trace, device);
            print_all(&lines);
            // `replay_report` says "replay: all N ops passed" for a passing replay; any other replay failed.
            if !lines.iter().any(|l| l.starts_with("replay: all ")) {
                println!("see it: {}", show_hint(path));
            }
            exit(ok)
        }
        Err(e) => fail("replay", e, 2),
    }
}

/// The `kvsim show` command that draws a failing trace written at `trace` (the page beside it, `.html`).
pub(crate) fn show_hint(trace: &Path) -> String {
    let html = trace.with_extension("html");
    kvsim::show::show_command(&trace.display().to_string(), &html.display().to_string())
}

/// `kvsim sim --seed S --ops N`: one run of seed S's swarm config with N ops; its trace is written either way.
pub(crate) fn sim_ops_cmd(seed: u64, ops: usize, device: DeviceChoice, out: &Path) -> ExitCode {
    let mut config = kvsim::sim::config::SimConfig::from_seed(seed);
    config.ops = ops;
    let r = sim::run(seed, config, None, device, None);
    let p = write_trace(out, &format!("seed-{seed}-{ops}ops.json"), &r.trace);
    match &r.trace.outcome {
        kvsim::sim::trace::Outcome::Pass => {
            println!("seed {seed}: {ops} ops ({} skipped) passed; trace: {}", r.skipped, p.display())
        }
        kvsim::sim::trace::Outcome::Fail { op_index, check, message } => {
            eprintln!("FAIL seed {seed} op {op_index} [{check}] {message}\n     trace: {}", p.display())
        }
    }
    println!("see it: {}", show_hint(&p));
    exit(!r.failed())
}

/// `kvsim show`: replays the trace under the page's observers, then writes the page or prints the text.
pub(crate) fn show_cmd(
    path: &Path,
    html: Option<&Path>,
    op: Option<usize>,
    shrink: Option<usize>,
    shrunk: Option<&Path>,
    device: DeviceChoice,
) -> ExitCode {
    let trace = match Trace::load(path) {
        Ok(t) => t,
        Err(e) => return fail("show", e, 2),
    };
    let shrunk = match shrunk.map(|p| Trace::load(p).map(|t| (p.display().to_string(), t))).transpose() {
        Ok(s) => s,
        Err(e) => return fail("show --shrunk", e, 2),
    };
    let opts = kvsim::show::Options {
        path: path.display().to_string(),
        device,
        op,
        shrink,
        shrunk,
        kvsim_version: env!("CARGO_PKG_VERSION").to_string(),
        html: html.map(|h| h.display().to_string()),
    };
    let page = match kvsim::show::build(&trace, &opts) {
        Ok(p) => p,
        Err(e) => return fail("show", e, 1),
    };
    match html {
        Some(out) => {
            let doc = kvsim::show::html::render(&page);
            if let Err(e) = std::fs::write(out, &doc) {
                return fail("show", format!("cannot write {}: {e}", out.display()), 2);
            }
            println!("wrote {} ({} bytes): {}", out.display(), doc.len(), kvsim::show::html::title(&page));
        }
        None => print!("{}", kvsim::show::text::render(&page)),
    }
    ExitCode::SUCCESS
}

pub(crate) fn shrink_cmd(path: &Path, out: Option<PathBuf>, budget: usize, device: DeviceChoice) -> ExitCode {
    let trace = match Trace::load(path) {
        Ok(t) => t,
        Err(e) => return fail("shrink", e, 2),
    };
    match sim::shrink::shrink(&trace, device, budget) {
        Ok(s) => {
            let mut t = s.trace;
            t.expect = Expect::Fail;
            let p = match out {
                Some(p) => write_trace(
                    p.parent().unwrap_or(Path::new(".")),
                    &p.file_name().unwrap_or_default().to_string_lossy(),
                    &t,
                ),
                None => write_trace(Path::new("corpus"), &format!("seed-{}-{}ops.json", t.seed, t.ops.len()), &t),
            };
            println!("shrunk {} ops to {} in {} replays: {}", trace.ops.len(), t.ops.len(), s.runs, p.display());
            println!("see it: {} --shrunk {}", show_hint(path), p.display());
            ExitCode::SUCCESS
        }
        Err(e) => fail("shrink", e, 1),
    }
}

pub(crate) fn mutants_cmd(
    budget: Option<u64>,
    shrink_budget: usize,
    only: Option<String>,
    save: bool,
    json: bool,
) -> ExitCode {
    let mut rows = vec![];
    // The quantized mutants are hunted through the quantized family (`sim::family::quant`); the recurrent cache's
    // are hunted through the recurrent family (`sim::family::ssm`) like every other.
    for &m in Mutant::ALL.iter().filter(|m| m.in_simulator() && only.as_deref().is_none_or(|o| o == m.name())) {
        let hunt = campaign::MutantHunt::run(m, budget.unwrap_or(campaign::mutant_budget(m)), shrink_budget);
        if let (true, Some(t)) = (save, hunt.corpus_trace()) {
            write_trace(Path::new("corpus"), &format!("mutant-{}.json", m.name()), &t);
        }
        println!("{}", hunt.line());
        rows.push(hunt);
    }
    let times = campaign::CatchTimes::of(&rows);
    println!("{}", times.line());
    if json {
        println!("{}", serde_json::json!({ "mutants": rows, "time_to_catch": times }));
    }
    exit(rows.iter().all(|h| h.caught))
}

pub(crate) fn bench_cmd(
    device: DeviceChoice,
    what: &str,
    anchor: Option<kvsim::bench::Anchor>,
    quick: bool,
    out: &Path,
    json: bool,
    exact: bool,
) -> ExitCode {
    let mut r = kvsim::bench::bench(device, what, anchor.as_ref(), quick, exact);
    kvsim::bench::stamp(&mut r);
    print_all(&kvsim::bench::summary_lines(&r));
    if let Some(e) = r.get("exact") {
        println!(
            "exact read, rows byte-identical batch vs alone: exact {} / {}, fused SDPA {} / {}",
            e["exact_rows_byte_identical"], e["rows_compared"], e["fused_rows_byte_identical"], e["rows_compared"]
        );
    }
    let _ = std::fs::create_dir_all(out);
    let p = out.join(format!("bench-{}-{}.json", device.name(), r["unix_time"]));
    let _ = std::fs::write(&p, serde_json::to_string_pretty(&r).unwrap());
    println!("saved {}", p.display());
    if json {
        println!("{}", serde_json::to_string(&r).unwrap());
    }
    ExitCode::SUCCESS
}

pub(crate) fn fuzz_case_cmd(input: &Path, out: &Path) -> ExitCode {
    let data = match std::fs::read(input) {
        Ok(d) => d,
        Err(e) => return fail("fuzz-case", format!("cannot read {}: {e}", input.display()), 2),
    };
    let Some(t) = kvsim::fuzzing::case_to_trace(&data) else {
        return fail("fuzz-case", format!("{} does not decode to a fuzz case", input.display()), 2);
    };
    let p = write_trace(out, &format!("fuzz-{}.json", &blake3::hash(&data).to_hex()[..12]), &t);
    println!("{} ops, outcome {:?}: {}", t.ops.len(), t.outcome, p.display());
    ExitCode::SUCCESS
}

/// `kvsim check-engine`: the swarm against an engine process; each class's shortest trace and reproducer written
/// to `out`. Exit 0 when no seed failed, 1 when some did, 2 when the engine broke (its failure printed, the run's
/// trace saved, the process stopped).
#[allow(clippy::too_many_arguments)]
pub fn check_engine_cmd(
    driver: &str,
    seeds: u64,
    ops: usize,
    timeout_s: u64,
    shrinks: usize,
    shrink_budget: usize,
    out: &Path,
    json: bool,
    only: &[&str],
) -> ExitCode {
    use kvsim::byoc::{engine_check, CheckOptions};
    let opts = CheckOptions { seeds, ops, device: DeviceChoice::Cpu, shrink_budget };
    let timeout = std::time::Duration::from_secs(timeout_s);
    let started = std::time::Instant::now();
    let report = match engine_check::check_engine_only(driver, timeout, opts, shrinks, only) {
        Ok(r) => r,
        Err(b) => {
            eprintln!("kvsim check-engine: the engine broke [{}]: {}", b.failure.kind(), b.failure);
            if let Some(t) = &b.trace {
                let path = out.join(format!("engine-{}-seed-{}.trace.json", b.failure.kind(), t.seed()));
                match std::fs::create_dir_all(out).and_then(|_| std::fs::write(&path, t.to_json())) {
                    Ok(()) => eprintln!("the run's trace: {}", path.display()),
                    Err(e) => eprintln!("cannot write {}: {e}", path.display()),
                }
            }
            if json {
                let v =
                    serde_json::json!({"engine_failure": {"kind": b.failure.kind(), "message": b.failure.to_string()}});
                println!("{v}");
            }
            return ExitCode::from(2);
        }
    };
    if let Err(e) = std::fs::create_dir_all(out) {
        eprintln!("kvsim check-engine: {}: {e}", out.display());
        return ExitCode::from(2);
    }
    let mut classes = vec![];
    println!(
        "{} {} ({}): {} seeds, {} failed, {} ops applied, {} checks",
        report.hello.engine, report.hello.version, driver, report.seeds, report.failures, report.applied, report.checks
    );
    for c in &report.classes {
        let file = c.name.replace('/', "-");
        let trace_path = out.join(format!("{file}.trace.json"));
        if let Err(e) = std::fs::write(&trace_path, c.shortest.to_json()) {
            eprintln!("cannot write {}: {e}", trace_path.display());
        }
        let repro = match &c.reproducer {
            Ok(script) => {
                let p = out.join(format!("{file}.py"));
                match std::fs::write(&p, script) {
                    Ok(()) => Some(p.display().to_string()),
                    Err(e) => {
                        eprintln!("cannot write {}: {e}", p.display());
                        None
                    }
                }
            }
            Err(why) => {
                println!("  [{}] no reproducer: {why}", c.name);
                None
            }
        };
        println!(
            "  [{}] {} seeds (first {:?}); shortest {} ops (seed {}); trace {}{}",
            c.name,
            c.failing_seeds.len(),
            &c.failing_seeds[..c.failing_seeds.len().min(5)],
            c.shortest.ops(),
            c.shortest.seed(),
            trace_path.display(),
            repro.as_ref().map(|r| format!("; reproducer {r}")).unwrap_or_default()
        );
        classes.push(serde_json::json!({
            "name": c.name,
            "failing_seeds": c.failing_seeds,
            "message": c.message,
            "shortest_ops": c.shortest.ops(),
            "trace": trace_path.display().to_string(),
            "repro": repro,
        }));
    }
    if json {
        let v = serde_json::json!({
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
    }
    if report.failures == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}
