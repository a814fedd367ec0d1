//! The kvsim command line: `doctor`, `sim`, `replay`, `shrink`, `mutants`, `oracle`, `bench`. It parses arguments,
//! calls the library (`kvsim::campaign`, `kvsim::oracle`, `kvsim::bench`, ...) and prints; it is the only module
//! that writes to stdout or chooses exit codes.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Parser;
use kvsim::cache::mutation::Mutant;
use kvsim::campaign;
use kvsim::oracle;
use kvsim::sim::trace::{Expect, Trace};
use kvsim::sim::{self, DeviceChoice};

mod cli;

use cli::{Cli, Cmd, OracleCmd};

fn main() -> ExitCode {
    sim::raise_mlx_cuda_caches();
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
            let found = (!no_anchor).then(|| kvsim::bench::find_anchor(python, anchor));
            let anchor =
                found.and_then(|a| a.map_err(|e| eprintln!("kvsim bench: no anchor ({e}); kvsim numbers only")).ok());
            bench_cmd(device, &what, anchor, quick, &out, json)
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

fn oracle_record_cmd(count: usize, scan: u64, seeds: &[u64], include: &[u64], out: &Path, keep: bool) -> ExitCode {
    let mut log = |err: bool, line: String| if err { eprintln!("{line}") } else { println!("{line}") };
    match oracle::record_set(count, scan, seeds, include, out, keep, &mut log) {
        Ok(all) => exit(all),
        Err(e) => fail("oracle record", e, 1),
    }
}

fn oracle_choose_cmd(count: usize, scan: u64, include: &[u64]) -> ExitCode {
    match oracle::describe_choice(count, scan, include) {
        Ok(seeds) => {
            seeds.iter().for_each(|(s, feats)| println!("seed {s}: {}", feats.join(" ")));
            println!("{}", seeds.iter().map(|s| s.0.to_string()).collect::<Vec<_>>().join(" "));
            ExitCode::SUCCESS
        }
        Err(e) => fail("oracle record", e, 1),
    }
}

fn oracle_diff_cmd(path: &Path) -> ExitCode {
    let rep = oracle::diff_recorded(path);
    if let Some(e) = &rep.error {
        return fail("oracle diff", e, 2);
    }
    print_all(&rep.diff_lines());
    exit(rep.status() != "unclassified")
}

fn oracle_check_cmd(dir: &Path, json: bool) -> ExitCode {
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

fn doctor() -> ExitCode {
    let (lines, ok) = kvsim::doctor::report();
    print_all(&lines);
    exit(ok)
}

fn print_all(lines: &[String]) {
    lines.iter().for_each(|l| println!("{l}"));
}

fn exit(ok: bool) -> ExitCode {
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}

fn fail(what: &str, e: impl std::fmt::Display, code: u8) -> ExitCode {
    eprintln!("kvsim {what}: {e}");
    ExitCode::from(code)
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
    let bar = indicatif::ProgressBar::new(seeds.len() as u64);
    let style = indicatif::ProgressStyle::with_template("{elapsed_precise} [{bar:40}] {pos}/{len} seeds {msg}");
    bar.set_style(style.unwrap().progress_chars("=> "));
    // Few seeds: each seed's swarm config is printed with its result (every trace stores it; failures repeat it).
    let (show_configs, mut failures) = (seeds.len() <= 10, 0);
    let s = campaign::run_seeds(seeds, device, time, |r| {
        let config = serde_json::to_string(&r.config).unwrap();
        if show_configs {
            bar.suspend(|| println!("config of seed {}: {config}", r.seed));
        }
        let written = r.failure().map(|f| {
            failures += 1;
            let p = write_trace(out, &format!("seed-{}.json", r.seed), &r.run.trace);
            let (seed, op, check, msg) = (r.seed, f.op_index, f.check, f.message);
            bar.suspend(|| {
                eprintln!(
                    "FAIL seed {seed} op {op} [{check}] {msg}\n     trace: {}\n     config: {config}",
                    p.display()
                )
            });
            p.display().to_string()
        });
        bar.set_message(format!("{failures} failures"));
        bar.inc(1);
        written
    });
    bar.finish_and_clear();
    print_all(&s.lines());
    if json {
        println!("{}", serde_json::to_string(&s).unwrap());
    }
    exit(s.failures == 0)
}

fn replay_cmd(path: &Path, device: DeviceChoice) -> ExitCode {
    match Trace::load(path) {
        Ok(trace) => {
            let (lines, ok) = sim::replay_report(&trace, device);
            print_all(&lines);
            exit(ok)
        }
        Err(e) => fail("replay", e, 2),
    }
}

fn shrink_cmd(path: &Path, out: Option<PathBuf>, budget: usize, device: DeviceChoice) -> ExitCode {
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
            ExitCode::SUCCESS
        }
        Err(e) => fail("shrink", e, 1),
    }
}

fn mutants_cmd(budget: u64, shrink_budget: usize, only: Option<String>, save: bool, json: bool) -> ExitCode {
    let mut rows = vec![];
    // The recurrent cache's mutants are hunted by its family's own runs (`sim::ssm`, its tests), not this swarm yet.
    for &m in Mutant::ALL.iter().filter(|m| m.layout() == "kv" && only.as_deref().is_none_or(|o| o == m.name())) {
        let hunt = campaign::MutantHunt::run(m, budget, shrink_budget);
        if let (true, Some(t)) = (save, hunt.corpus_trace()) {
            write_trace(Path::new("corpus"), &format!("mutant-{}.json", m.name()), &t);
        }
        println!("{}", hunt.line());
        rows.push(hunt);
    }
    if json {
        println!("{}", serde_json::json!({ "mutants": rows }));
    }
    exit(rows.iter().all(|h| h.caught))
}

fn bench_cmd(
    device: DeviceChoice,
    what: &str,
    anchor: Option<kvsim::bench::Anchor>,
    quick: bool,
    out: &Path,
    json: bool,
) -> ExitCode {
    let mut r = kvsim::bench::bench(device, what, anchor.as_ref(), quick);
    kvsim::bench::stamp(&mut r);
    print_all(&kvsim::bench::summary_lines(&r));
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
        Err(e) => return fail("fuzz-case", format!("cannot read {}: {e}", input.display()), 2),
    };
    let Some(t) = kvsim::fuzzing::case_to_trace(&data) else {
        return fail("fuzz-case", format!("{} does not decode to a fuzz case", input.display()), 2);
    };
    let p = write_trace(out, &format!("fuzz-{}.json", &blake3::hash(&data).to_hex()[..12]), &t);
    println!("{} ops, outcome {:?}: {}", t.ops.len(), t.outcome, p.display());
    ExitCode::SUCCESS
}
