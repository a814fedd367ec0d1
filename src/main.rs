//! The kvsim command line: `doctor`, `sim`, `replay`, `shrink`, `mutants`, `oracle`, `bench`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

use clap::{Parser, Subcommand};
use kvsim::cache::mutation::Mutant;
use kvsim::sim::summary::{Counters, Summary};
use kvsim::sim::trace::{Expect, Outcome, Trace};
use kvsim::sim::{self, DeviceChoice};

#[derive(Parser)]
#[command(name = "kvsim", version, about = "KV-cache layouts on MLX, checked bit-exactly against solo runs")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// MLX version, loaded library, devices, and a bf16 SDPA checked against an f64 reference on each device.
    Doctor,
    /// Run seeded simulations (default: 100 seeds from 0).
    Sim {
        /// Number of seeds, starting at --first.
        #[arg(long, default_value_t = 100)]
        seeds: u64,
        /// First seed.
        #[arg(long, default_value_t = 0)]
        first: u64,
        /// Run exactly this seed (overrides --seeds/--first).
        #[arg(long)]
        seed: Option<u64>,
        #[arg(long, value_enum, default_value_t = DeviceChoice::Cpu)]
        device: DeviceChoice,
        /// Stop starting new seeds after this many seconds.
        #[arg(long)]
        time: Option<f64>,
        /// Print a JSON summary as the last line.
        #[arg(long)]
        json: bool,
        /// Where failing traces are written.
        #[arg(long, default_value = "target/kvsim-failures")]
        out: PathBuf,
    },
    /// Replay a trace and report the first divergence (exit 1 when it does not do what the trace expects).
    Replay {
        trace: PathBuf,
        #[arg(long, value_enum, default_value_t = DeviceChoice::Cpu)]
        device: DeviceChoice,
    },
    /// Minimize a failing trace and write it (default: into corpus/).
    Shrink {
        trace: PathBuf,
        #[arg(long)]
        out: Option<PathBuf>,
        #[arg(long, default_value_t = 3000)]
        budget: usize,
        #[arg(long, value_enum, default_value_t = DeviceChoice::Cpu)]
        device: DeviceChoice,
    },
    /// Speed against the mlx-lm anchor measured in the same run (ratios); results saved under bench/results/.
    Bench {
        #[arg(long, value_enum, default_value_t = DeviceChoice::Cpu)]
        device: DeviceChoice,
        /// sim, step, or all.
        #[arg(long, default_value = "all")]
        what: String,
        /// Python with mlx + mlx-lm 0.32.2 (default: oracles/mlx_lm/.venv, set up on demand).
        #[arg(long)]
        python: Option<String>,
        /// The anchor script (default: $KVSIM_ANCHOR, else ../shared/anchors/mlxlm_bench.py).
        #[arg(long)]
        anchor: Option<String>,
        /// Skip the anchor (kvsim numbers only).
        #[arg(long)]
        no_anchor: bool,
        /// Fewer, smaller runs.
        #[arg(long)]
        quick: bool,
        #[arg(long, default_value = "bench/results")]
        out: PathBuf,
        #[arg(long)]
        json: bool,
    },
    /// Turn a cargo-fuzz input of the `sim_trace` target into a trace (for `replay` and `shrink`).
    FuzzCase {
        input: PathBuf,
        #[arg(long, default_value = "target/kvsim-failures")]
        out: PathBuf,
    },
    /// Run the mutation catalog: each mutant must be caught within its seed budget.
    Mutants {
        /// Seeds tried per mutant.
        #[arg(long, default_value_t = 200)]
        budget: u64,
        /// Shrink each caught mutant's trace (replays per mutant).
        #[arg(long, default_value_t = 600)]
        shrink_budget: usize,
        /// Only this mutant (by name).
        #[arg(long)]
        only: Option<String>,
        /// Write each shrunk trace to corpus/mutant-<name>.json.
        #[arg(long)]
        save: bool,
        #[arg(long)]
        json: bool,
    },
    /// The differential oracle against mlx-lm (oracles/README.md): record, diff, check.
    Oracle {
        #[command(subcommand)]
        cmd: OracleCmd,
    },
}

#[derive(Subcommand)]
enum OracleCmd {
    /// Pick seeds, run kvsim's side and the mlx-lm driver (setting up its venv), write NAME.trace.json and
    /// NAME.oracle.jsonl (the driver's results) per trace into --out.
    Record {
        /// How many traces to record.
        #[arg(long, default_value_t = 56)]
        seeds: usize,
        /// Seeds scanned for the choice (0..scan).
        #[arg(long, default_value_t = 600)]
        scan: u64,
        /// Record exactly these seeds (repeatable; overrides the choice).
        #[arg(long)]
        seed: Vec<u64>,
        /// Seeds the choice always takes: 21 (a window read of a left-padded row whose mlx-lm batch output differs:
        /// `row-layout` on a window read) and 76 (solo decodes after a one-position window on a wrapped ring).
        #[arg(long, value_delimiter = ',', default_value = "21,76")]
        include: Vec<u64>,
        #[arg(long, default_value = "oracles/recorded")]
        out: PathBuf,
        /// Also write NAME.steps.jsonl (the protocol steps; for debugging, never part of the recorded set).
        #[arg(long)]
        keep_steps: bool,
        /// Only print the chosen seeds (and what each covers); record nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Re-run kvsim's side of one recorded trace and compare it with the stored oracle results, op by op.
    Diff { trace: PathBuf },
    /// Compare the whole recorded set (exit 1 when a divergence is unclassified).
    Check {
        #[arg(long, default_value = "oracles/recorded")]
        dir: PathBuf,
        /// Print `{"traces", "agree", "classified", "unclassified"}` as the last line.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    // MLX's CUDA backend keeps LRU caches of captured graphs and SDPA kernels and raises an error ("Cache thrashing
    // is happening") once a run cycles through more shapes than they hold (400 / 256 by default, MLX 0.32.2). A
    // simulator exercises many shapes on purpose, so both are raised here unless the user set them. No effect on CPU.
    for (var, value) in [("MLX_CUDA_GRAPH_CACHE_SIZE", "100000"), ("MLX_CUDA_SDPA_CACHE_SIZE", "100000")] {
        if std::env::var_os(var).is_none() {
            std::env::set_var(var, value);
        }
    }
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Doctor => doctor(),
        Cmd::Sim { seeds, first, seed, device, time, json, out } => {
            let list: Vec<u64> = match seed {
                Some(s) => vec![s],
                None => (first..first.saturating_add(seeds)).collect(),
            };
            sim_cmd(&list, device, time, json, &out)
        }
        Cmd::Replay { trace, device } => replay_cmd(&trace, device),
        Cmd::Shrink { trace, out, budget, device } => shrink_cmd(&trace, out, budget, device),
        Cmd::Mutants { budget, shrink_budget, only, save, json } => {
            mutants_cmd(budget, shrink_budget, only, save, json)
        }
        Cmd::FuzzCase { input, out } => fuzz_case_cmd(&input, &out),
        Cmd::Bench { device, what, python, anchor, no_anchor, quick, out, json } => {
            bench_cmd(device, &what, python, anchor, no_anchor, quick, &out, json)
        }
        Cmd::Oracle { cmd } => match cmd {
            OracleCmd::Record { seeds, scan, seed, include, out, keep_steps, dry_run } => {
                if dry_run {
                    oracle_choose_cmd(seeds, scan, &include)
                } else {
                    oracle_record_cmd(seeds, scan, &seed, &include, &out, keep_steps)
                }
            }
            OracleCmd::Diff { trace } => oracle_diff_cmd(&trace),
            OracleCmd::Check { dir, json } => oracle_check_cmd(&dir, json),
        },
    }
}

fn oracle_record_cmd(
    count: usize,
    scan: u64,
    explicit: &[u64],
    include: &[u64],
    out: &Path,
    keep_steps: bool,
) -> ExitCode {
    use kvsim::sim::oracle;
    let python = match oracle::setup_driver() {
        Ok(p) => p,
        Err(e) => {
            eprintln!("kvsim oracle record: {e}");
            return ExitCode::FAILURE;
        }
    };
    let seeds: Vec<u64> = if explicit.is_empty() {
        match oracle::choose_seeds(count, scan, include) {
            Ok(s) => s,
            Err(e) => {
                eprintln!("kvsim oracle record: {e}");
                return ExitCode::FAILURE;
            }
        }
    } else {
        explicit.to_vec()
    };
    if let Err(e) = std::fs::create_dir_all(out) {
        eprintln!("kvsim oracle record: {}: {e}", out.display());
        return ExitCode::FAILURE;
    }
    if explicit.is_empty() {
        // A fresh choice replaces the recorded set.
        for p in kvsim::sim::oracle::recorded_traces(out).unwrap_or_default() {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("").trim_end_matches(".trace.json").to_string();
            let _ = std::fs::remove_file(&p);
            let _ = std::fs::remove_file(out.join(format!("{name}.oracle.jsonl")));
        }
    }
    let work = std::env::temp_dir().join(format!("kvsim-oracle-{}", std::process::id()));
    let mut failed = false;
    for seed in seeds {
        let name = format!("seed-{seed}");
        let r = sim::run_seed(seed, DeviceChoice::Cpu, None);
        if r.failed() {
            eprintln!("{name}: the kvsim run fails; not recorded");
            failed = true;
            continue;
        }
        let mut trace = r.trace;
        trace.note = "oracle: recorded against mlx-lm 0.32.2 (kvsim oracle record)".into();
        let rec = match oracle::record(&trace, true) {
            Ok(x) => x,
            Err(e) => {
                eprintln!("{name}: {e}");
                failed = true;
                continue;
            }
        };
        let (_, text) = match oracle::run_driver(&python, &rec.steps_jsonl(), &work, &name) {
            Ok(x) => x,
            Err(e) => {
                eprintln!("{name}: {e}");
                failed = true;
                continue;
            }
        };
        if keep_steps {
            let _ = std::fs::write(out.join(format!("{name}.steps.jsonl")), rec.steps_jsonl());
        }
        let tp = out.join(format!("{name}.trace.json"));
        let op = out.join(format!("{name}.oracle.jsonl"));
        if let Err(e) =
            std::fs::write(&tp, serde_json::to_string(&trace).unwrap() + "\n").and_then(|_| std::fs::write(&op, &text))
        {
            eprintln!("{name}: {e}");
            failed = true;
            continue;
        }
        let rep = oracle::diff_recorded(&tp);
        println!("{}", rep.summary_line());
    }
    let _ = std::fs::remove_dir_all(&work);
    if let Ok(report) = kvsim::sim::oracle::check_dir(out) {
        println!(
            "recorded set {}: {} traces, {} agree, {} classified, {} unclassified",
            out.display(),
            report.traces.len(),
            report.count("agree"),
            report.count("classified"),
            report.count("unclassified")
        );
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn oracle_choose_cmd(count: usize, scan: u64, include: &[u64]) -> ExitCode {
    match kvsim::sim::oracle::choose_seeds(count, scan, include) {
        Ok(seeds) => {
            for s in &seeds {
                let r = sim::run_seed(*s, DeviceChoice::Cpu, None);
                let feats = kvsim::sim::oracle::record(&r.trace, false)
                    .map(|rec| kvsim::sim::oracle::features(&r.trace.config, &rec.infos))
                    .unwrap_or_default();
                let special: Vec<&String> =
                    feats.iter().filter(|f| f.starts_with("geometry/") || f.starts_with("config/")).collect();
                println!("seed {s}: {}", special.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(" "));
            }
            println!("{}", seeds.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(" "));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kvsim oracle record: {e}");
            ExitCode::FAILURE
        }
    }
}

fn print_divergences(rep: &kvsim::sim::oracle::TraceReport) {
    for d in &rep.divergences {
        println!(
            "  step {:>5}  op {:>3} {:<13} {:<34} {}\n             {}",
            d.step,
            d.op,
            d.op_kind,
            d.what,
            d.class.describe(),
            d.detail
        );
    }
}

fn oracle_diff_cmd(path: &Path) -> ExitCode {
    let rep = kvsim::sim::oracle::diff_recorded(path);
    if let Some(e) = &rep.error {
        eprintln!("kvsim oracle diff: {e}");
        return ExitCode::from(2);
    }
    println!("{}: {} steps, {} divergences", rep.name, rep.steps, rep.divergences.len());
    print_divergences(&rep);
    for (r, n) in rep.rules() {
        println!("  {} x{n} [{}]: {}", r.id(), r.verdict().name(), r.reason());
    }
    println!("{}", rep.summary_line());
    if rep.status() == "unclassified" {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn oracle_check_cmd(dir: &Path, json: bool) -> ExitCode {
    use kvsim::sim::oracle;
    let report = match oracle::check_dir(dir) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("kvsim oracle check: {e}");
            return ExitCode::from(2);
        }
    };
    for t in &report.traces {
        println!("{}", t.summary_line());
        if t.status() == "unclassified" {
            print_divergences(t);
        }
    }
    println!("rules:");
    for (r, (n, c, traces)) in report.rule_counts() {
        let names: Vec<&String> = traces.iter().take(6).collect();
        println!(
            "  {:<32} {:<26} {:>4} divergences, {:>4} consequences, {:>3} traces (e.g. {})",
            r.id(),
            r.verdict().name(),
            n,
            c,
            traces.len(),
            names.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
        );
    }
    let kinds = report.kinds();
    let missing: Vec<&str> = oracle::STEP_KINDS.iter().copied().filter(|k| !kinds.contains(*k)).collect();
    println!(
        "step kinds covered: {}/{}{}",
        oracle::STEP_KINDS.len() - missing.len(),
        oracle::STEP_KINDS.len(),
        if missing.is_empty() { String::new() } else { format!(" (missing: {})", missing.join(", ")) }
    );
    println!(
        "kvsim oracle check: {} traces, {} agree, {} classified, {} unclassified",
        report.traces.len(),
        report.count("agree"),
        report.count("classified"),
        report.count("unclassified")
    );
    if json {
        println!("{}", report.json_line());
    }
    if report.count("unclassified") > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn doctor() -> ExitCode {
    let version = sim::mlx_version();
    println!("mlx version     {version} (headers this build was compiled against: {})", mlx_sys::MLX_BUILD_VERSION);
    let loaded = std::fs::read_to_string("/proc/self/maps")
        .ok()
        .and_then(|m| {
            m.lines().find(|l| l.contains("libmlx")).map(|l| l.split_whitespace().last().unwrap_or("").to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    println!("library loaded  {loaded}");
    println!("build run path  {}", mlx_sys::MLX_LIB_DIR);
    let default = mlx_rs::Device::try_default().map(|d| format!("{d:?}")).unwrap_or_else(|e| format!("error: {e}"));
    println!("default device  {default}");
    let gpu = kvsim::doctor::gpu_available();
    println!("gpu available   {gpu}");
    let mut devices = vec![DeviceChoice::Cpu];
    if gpu {
        devices.push(DeviceChoice::Gpu);
    }
    let mut ok = true;
    let mut lines = vec![];
    for d in devices {
        match kvsim::doctor::sdpa_check(d) {
            Ok(r) => {
                println!(
                    "sdpa {:<4} bf16  H_q 8 / H_kv 2, D 64, 37 keys, 5 causal queries: max {:.2} ULP (bf16, at output scale) vs the f64 reference; {}/{} values correctly rounded; max raw ULP distance {}",
                    d.name(), r.max_ulp, r.exact, r.values, r.max_raw_ulp
                );
                let pass = r.max_ulp <= kvsim::doctor::SDPA_ULP_BOUND;
                ok &= pass;
                lines.push(format!("mlx {version} {} {}", d.name(), if pass { "ok" } else { "FAILED" }));
            }
            Err(e) => {
                ok = false;
                println!("sdpa {:<4} error: {e}", d.name());
                lines.push(format!("mlx {version} {} FAILED", d.name()));
            }
        }
    }
    for l in lines {
        println!("{l}");
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn write_trace(dir: &Path, name: &str, t: &Trace) -> PathBuf {
    let _ = std::fs::create_dir_all(dir);
    let p = dir.join(name);
    if let Err(e) = std::fs::write(&p, t.to_json()) {
        eprintln!("kvsim: cannot write {}: {e}", p.display());
    }
    p
}

fn sim_cmd(seeds: &[u64], device: DeviceChoice, time: Option<f64>, json: bool, out: &Path) -> ExitCode {
    let start = Instant::now();
    let bar = indicatif::ProgressBar::new(seeds.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} seeds {msg}")
            .unwrap()
            .progress_chars("=> "),
    );
    let mut total = Counters::default();
    let mut by_kind: BTreeMap<String, u64> = BTreeMap::new();
    let (mut ops, mut skipped, mut ran) = (0u64, 0u64, 0u64);
    let mut failed = vec![];
    let mut hash = blake3::Hasher::new();
    // Each seed's swarm configuration is printed before its run when there are few seeds (every trace stores it too,
    // and a failing seed's report repeats it).
    let show_configs = seeds.len() <= 10;
    for &seed in seeds {
        if time.is_some_and(|t| start.elapsed().as_secs_f64() > t) {
            break;
        }
        let config = kvsim::sim::config::SimConfig::from_seed(seed);
        if show_configs {
            bar.suspend(|| println!("config of seed {seed}: {}", serde_json::to_string(&config).unwrap()));
        }
        let r = sim::run_seed(seed, device, None);
        ran += 1;
        total.add(&r.counters);
        for (k, v) in &r.ops_by_kind {
            *by_kind.entry(k.clone()).or_insert(0) += v;
        }
        ops += r.trace.ops.len() as u64 - r.skipped;
        skipped += r.skipped;
        hash.update(r.trace.result_hash.as_bytes());
        if let Outcome::Fail { op_index, check, message } = &r.trace.outcome {
            let p = write_trace(out, &format!("seed-{seed}.json"), &r.trace);
            bar.suspend(|| {
                eprintln!("FAIL seed {seed} op {op_index} [{check}] {message}\n     trace: {}", p.display());
                eprintln!("     config: {}", serde_json::to_string(&config).unwrap());
            });
            failed.push(serde_json::json!({"seed": seed, "op_index": op_index, "check": check, "message": message, "trace": p.display().to_string()}));
        }
        bar.set_message(format!("{} failures", failed.len()));
        bar.inc(1);
    }
    bar.finish_and_clear();
    let summary = Summary {
        seeds: ran,
        ops,
        skipped_ops: skipped,
        checks: total.checks,
        failures: failed.len() as u64,
        ops_by_kind: by_kind,
        bit_exact: serde_json::json!({
            "state": total.bit_exact_state,
            "decode": total.decode_unpadded.bit_exact + total.decode_padded.bit_exact,
            "decode_unpadded": total.decode_unpadded.bit_exact,
            "decode_padded": total.decode_padded.bit_exact,
            "window": total.window.bit_exact,
        }),
        compared: serde_json::json!({
            "decode_unpadded": total.decode_unpadded.compared,
            "decode_padded": total.decode_padded.compared,
            "window": total.window.compared,
        }),
        max_ulp: serde_json::json!({
            "decode_unpadded_vs_solo": total.decode_unpadded.max_ulp,
            "decode_padded_vs_solo": total.decode_padded.max_ulp,
            "window_vs_solo": total.window.max_ulp,
        }),
        reference: serde_json::json!({
            "checks": total.model_checks,
            "failures": failed.iter().filter(|f| f["check"] == "output_vs_model" || f["check"] == "layout" || f["check"] == "mask" || f["check"] == "ring_state").count(),
            "max_ulp": {"bf16": total.model_max_ulp_bf16, "f32": total.model_max_ulp_f32},
        }),
        expected_errors: total.expected_errors,
        device: device.name().into(),
        mlx_version: sim::mlx_version(),
        result_hash: hash.finalize().to_hex().to_string(),
        failed_seeds: failed.clone(),
        seconds: start.elapsed().as_secs_f64(),
        guarantees: total.table.clone(),
    };
    println!(
        "kvsim sim: {} seeds, {} ops ({} skipped), {} checks, {} failures, {:.1}s on {}",
        ran,
        ops,
        skipped,
        total.checks,
        failed.len(),
        summary.seconds,
        device.name()
    );
    println!("  {:<28} {:>10} {:>12} {:>10}", "output class vs solo twin", "compared", "bit-exact", "max ULP");
    for (name, c) in [
        ("decode (unpadded rows)", total.decode_unpadded),
        ("decode (padded rows)", total.decode_padded),
        ("window", total.window),
    ] {
        println!("  {:<28} {:>10} {:>12} {:>10}", name, c.compared, c.bit_exact, c.max_ulp);
    }
    println!("  state comparisons byte-identical: {}", total.bit_exact_state);
    println!("  guarantees table (vs solo twin; ULPs at output scale):");
    for (k, c) in &total.table {
        println!("    {:<40} {:>9} compared {:>9} bit-exact  max {} ULP", k, c.compared, c.bit_exact, c.max_ulp);
    }
    println!(
        "  vs f64 model: max {:.2} ULP (f32), {:.2} ULP (bf16) over {} reads",
        total.model_max_ulp_f32, total.model_max_ulp_bf16, total.model_checks
    );
    println!(
        "  ops by kind: {}",
        summary.ops_by_kind.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(" ")
    );
    if json {
        println!("{}", serde_json::to_string(&summary).unwrap());
    }
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn replay_cmd(path: &Path, device: DeviceChoice) -> ExitCode {
    let trace = match Trace::load(path) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("kvsim replay: {e}");
            return ExitCode::from(2);
        }
    };
    let r = sim::replay(&trace, device);
    // First divergence of the digest chain from the recorded one (same device and MLX only).
    if let Some(i) = trace.digests.iter().zip(&r.trace.digests).position(|(a, b)| a != b) {
        println!("digest of op {i} differs from the recorded run ({:?})", trace.ops.get(i));
    }
    match &r.trace.outcome {
        Outcome::Pass => {
            println!("replay: all {} ops passed (result hash {})", r.trace.ops.len(), &r.trace.result_hash[..16])
        }
        Outcome::Fail { op_index, check, message } => {
            println!("replay: first divergence at op {op_index} {:?}\n  [{check}] {message}", r.trace.ops[*op_index])
        }
    }
    match sim::replay_matches(&trace, &r) {
        Ok(()) => {
            println!("replay matches the trace's expectation ({:?})", trace.expect);
            ExitCode::SUCCESS
        }
        Err(e) => {
            println!("replay does NOT match the trace's expectation: {e}");
            ExitCode::FAILURE
        }
    }
}

fn shrink_cmd(path: &Path, out: Option<PathBuf>, budget: usize, device: DeviceChoice) -> ExitCode {
    let trace = match Trace::load(path) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("kvsim shrink: {e}");
            return ExitCode::from(2);
        }
    };
    match sim::shrink::shrink(&trace, device, budget) {
        Ok(s) => {
            let mut t = s.trace;
            t.expect = Expect::Fail;
            let name = format!("seed-{}-{}ops.json", t.seed, t.ops.len());
            let p = match out {
                Some(p) => {
                    if let Some(d) = p.parent() {
                        let _ = std::fs::create_dir_all(d);
                    }
                    let _ = std::fs::write(&p, t.to_json());
                    p
                }
                None => write_trace(Path::new("corpus"), &name, &t),
            };
            println!("shrunk {} ops to {} in {} replays: {}", trace.ops.len(), t.ops.len(), s.runs, p.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("kvsim shrink: {e}");
            ExitCode::FAILURE
        }
    }
}

fn mutation_arm(m: Option<Mutant>) {
    kvsim::cache::mutation::arm(m);
}

fn mutants_cmd(budget: u64, shrink_budget: usize, only: Option<String>, save: bool, json: bool) -> ExitCode {
    let mut rows = vec![];
    let mut survived = 0;
    for &m in Mutant::ALL {
        if only.as_deref().is_some_and(|o| o != m.name()) {
            continue;
        }
        if m.layout() == "ssm" {
            // The recurrent family runs outside the attention swarm (sim::ssm); no shrinking there yet.
            sim::DeviceChoice::Cpu.activate();
            mutation_arm(Some(m));
            let seed = (0..budget).find(|&s| sim::ssm::run_family("ssm", s, None).is_some_and(|r| r.failure.is_some()));
            let check = seed
                .and_then(|s| sim::ssm::run_family("ssm", s, None).and_then(|r| r.failure.map(|(_, f)| f.check)))
                .unwrap_or_default();
            mutation_arm(None);
            match seed {
                Some(seed) => {
                    println!("{:<26} caught  seed {:>4}  [{check}]  (ssm family)", m.name(), seed);
                    rows.push(serde_json::json!({"name": m.name(), "caught": true, "seeds": seed + 1, "check": check, "shrunk_ops": null}));
                }
                None => {
                    survived += 1;
                    println!("{:<26} SURVIVED {budget} seeds", m.name());
                    rows.push(serde_json::json!({"name": m.name(), "caught": false, "seeds": budget, "shrunk_ops": null}));
                }
            }
            continue;
        }
        let mut caught = None;
        for seed in 0..budget {
            let r = sim::run_seed(seed, DeviceChoice::Cpu, Some(m));
            if r.failed() {
                caught = Some((seed, r));
                break;
            }
        }
        match caught {
            Some((seed, r)) => {
                let (check, shrunk) = match &r.trace.outcome {
                    Outcome::Fail { check, .. } => {
                        (check.clone(), sim::shrink::shrink(&r.trace, DeviceChoice::Cpu, shrink_budget).ok())
                    }
                    Outcome::Pass => (String::new(), None),
                };
                let shrunk_ops = shrunk.as_ref().map(|s| s.trace.ops.len()).unwrap_or(r.trace.ops.len());
                if save {
                    if let Some(s) = &shrunk {
                        let mut t = s.trace.clone();
                        t.expect = Expect::Fail;
                        t.note = format!("mutant {}: {}", m.name(), m.describe());
                        write_trace(Path::new("corpus"), &format!("mutant-{}.json", m.name()), &t);
                    }
                }
                println!("{:<26} caught  seed {:>4}  [{check}]  shrunk to {shrunk_ops} ops", m.name(), seed);
                rows.push(serde_json::json!({"name": m.name(), "caught": true, "seeds": seed + 1, "check": check, "shrunk_ops": shrunk_ops}));
            }
            None => {
                survived += 1;
                println!("{:<26} SURVIVED {budget} seeds", m.name());
                rows.push(serde_json::json!({"name": m.name(), "caught": false, "seeds": budget, "shrunk_ops": null}));
            }
        }
    }
    if json {
        println!("{}", serde_json::json!({ "mutants": rows }));
    }
    if survived == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn find_anchor(python: Option<String>, anchor: Option<String>) -> Result<kvsim::bench::Anchor, String> {
    let script = anchor
        .or_else(|| std::env::var("KVSIM_ANCHOR").ok())
        .unwrap_or_else(|| "../shared/anchors/mlxlm_bench.py".to_string());
    if !Path::new(&script).exists() {
        return Err(format!("anchor script {script} not found (pass --anchor or set KVSIM_ANCHOR)"));
    }
    let python = match python.or_else(|| std::env::var("KVSIM_ANCHOR_PYTHON").ok()) {
        Some(p) => p,
        None => {
            let venv = "oracles/mlx_lm/.venv/bin/python";
            if !Path::new(venv).exists() {
                eprintln!("kvsim bench: setting up the mlx-lm venv (oracles/mlx_lm/setup.sh)");
                let ok = std::process::Command::new("bash")
                    .arg("oracles/mlx_lm/setup.sh")
                    .status()
                    .map(|s| s.success())
                    .unwrap_or(false);
                if !ok {
                    return Err("oracles/mlx_lm/setup.sh failed".into());
                }
            }
            venv.to_string()
        }
    };
    Ok(kvsim::bench::Anchor { python, script })
}

fn machine_info() -> serde_json::Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let gpu = std::process::Command::new("nvidia-smi")
        .args(["--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    serde_json::json!({"cpu": cpu, "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0), "gpu": gpu,
        "kvsim": env!("CARGO_PKG_VERSION"), "mlx": sim::mlx_version()})
}

#[allow(clippy::too_many_arguments)]
fn bench_cmd(
    device: DeviceChoice,
    what: &str,
    python: Option<String>,
    anchor: Option<String>,
    no_anchor: bool,
    quick: bool,
    out: &Path,
    json: bool,
) -> ExitCode {
    let anchor = if no_anchor {
        None
    } else {
        match find_anchor(python, anchor) {
            Ok(a) => Some(a),
            Err(e) => {
                eprintln!("kvsim bench: no anchor ({e}); kvsim numbers only");
                None
            }
        }
    };
    let mut r = kvsim::bench::bench(device, what, anchor.as_ref(), quick);
    r["machine"] = machine_info();
    r["unix_time"] = serde_json::json!(std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0));
    if let Some(rows) = r["sim"].as_array() {
        println!("simulator throughput (H 4/2, D 16, W 8; batched decode row-steps checked against solo twins):");
        for row in rows {
            println!(
                "  {:<5} kvsim {:>9.0} row-steps/s   mlx-lm harness {:>9.0} row-steps/s   ratio {:.2}x",
                row["dtype"].as_str().unwrap_or(""),
                row["kvsim"]["row_steps_per_s"].as_f64().unwrap_or(f64::NAN),
                row["mlx_lm_harness"]["row_steps_per_s"].as_f64().unwrap_or(f64::NAN),
                row["ratio_row_steps_per_s"].as_f64().unwrap_or(f64::NAN)
            );
        }
    }
    if let Some(rows) = r["step"].as_array() {
        println!("batched rotating decode step (bf16, H 32/8, D 128), write + read, median:");
        for row in rows {
            let g = row["kvsim"]["gbps_median"].as_f64().unwrap_or(f64::NAN);
            println!(
                "  B {:>3} W {:>5}: kvsim {:>8.3} ms ({:>7.1} GB/s, {:>5.1}% of 4.8 TB/s)   mlx-lm {:>8.3} ms   speedup {:.2}x",
                row["B"], row["W"], row["kvsim"]["ms_median"].as_f64().unwrap_or(f64::NAN), g, g / 48.0,
                row["mlx_lm"]["ms_median"].as_f64().unwrap_or(f64::NAN), row["speedup_vs_mlx_lm"].as_f64().unwrap_or(f64::NAN)
            );
        }
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

fn fuzz_case_cmd(input: &Path, out: &Path) -> ExitCode {
    let data = match std::fs::read(input) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("kvsim fuzz-case: cannot read {}: {e}", input.display());
            return ExitCode::from(2);
        }
    };
    let Some(t) = kvsim::fuzzing::case_to_trace(&data) else {
        eprintln!("kvsim fuzz-case: {} does not decode to a fuzz case", input.display());
        return ExitCode::from(2);
    };
    let name = format!("fuzz-{}.json", &blake3::hash(&data).to_hex()[..12]);
    let p = write_trace(out, &name, &t);
    println!("{} ops, outcome {:?}: {}", t.ops.len(), t.outcome, p.display());
    ExitCode::SUCCESS
}
