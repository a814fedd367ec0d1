//! The handlers of the kvsim subcommands: each calls the library and prints. Part of the binary (with `main.rs` and
//! `cli.rs`): the only code that writes to stdout or chooses exit codes.

use kvsim::cache::faults::Mutant;
use kvsim::campaign;
use kvsim::oracle;
use kvsim::shard::{self, Shard};
use kvsim::sim::config::SimConfig;
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
pub(crate) static STOP: AtomicBool = AtomicBool::new(false);

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
    let pool = shard::Pool { exe: &exe, args: &args, jobs: a.jobs as usize, gpus: &gpus, env: &[], cpus: &[] };
    let outs = shard::run_workers(&pool, seeds.iter().copied(), &STOP, |event| match event {
        shard::WorkerEvent::Progress(p) => {
            failures += p.failed as u64;
            bar.set_message(format!("{failures} failures"));
            bar.inc(1);
            if a.progress_lines {
                eprintln!("{}", p.line());
            }
        }
        shard::WorkerEvent::Line(line) => bar.suspend(|| eprintln!("{line}")),
        // Said below, from the workers' outputs.
        shard::WorkerEvent::Crashed { .. } => {}
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
            let trace = |seed, ops, how: &str| {
                let t = campaign::crash_trace(seed, SimConfig::from_seed(seed), None, ops, a.device, how);
                (format!("seed-{seed}.json"), t)
            };
            crashes.extend(crash_failure("sim --jobs", &a.out, o.worker, c, true, trace));
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

/// A seed whose worker process died ([`shard::WorkerCrash`]): the ops it had started written into `out` as its trace
/// (`trace` makes it from the seed, those ops and how the process ended, with its file name:
/// [`campaign::crash_trace`] of the run's config), its FAIL line said on stderr (with the `kvsim replay` that runs it
/// in another process when `replayable`), and its failure ([`campaign::CRASH_CHECK`]) for the summary. `None`, and a
/// line said, when the worker died holding no seed.
pub(crate) fn crash_failure(
    what: &str,
    out: &Path,
    worker: usize,
    c: shard::WorkerCrash,
    replayable: bool,
    trace: impl FnOnce(u64, Vec<sim::ops::Op>, &str) -> (String, Trace),
) -> Option<campaign::FailedSeed> {
    let Some(seed) = c.seed else {
        eprintln!("kvsim {what}: worker {worker} was {} holding no seed", c.how);
        return None;
    };
    let ops = c.ops.len();
    let op = ops.saturating_sub(1);
    let (name, t) = trace(seed, c.ops, &c.how);
    let p = write_trace(out, &name, &t);
    let replay = if replayable {
        format!("\n     replay it in another process: kvsim replay {}", p.display())
    } else {
        String::new()
    };
    eprintln!(
        "FAIL seed {seed} op {op} [{}] worker {worker} was {} ({ops} ops started)\n     trace: {}{replay}",
        campaign::CRASH_CHECK,
        c.how,
        p.display(),
    );
    Some(campaign::FailedSeed {
        seed,
        op_index: op,
        check: campaign::CRASH_CHECK.into(),
        message: format!("worker {worker} was {} in op {op}", c.how),
        trace: p.display().to_string(),
    })
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
