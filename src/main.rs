//! The kvsim command line: `doctor`, `sim`, `replay`, `show`, `shrink`, `mutants`, `check-engine`, `oracle`, `bench`, `cache`. It parses arguments,
//! calls the library (`kvsim::campaign`, `kvsim::oracle`, `kvsim::bench`, ...) and prints; it is the only module
//! that writes to stdout or chooses exit codes.
// The command line is the one crate that prints.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use std::process::ExitCode;

use clap::Parser;
use kvsim::sim;

mod cli;
mod commands;
mod pooled;

use cli::{Cli, Cmd, OracleCmd};

use commands::*;

/// mimalloc, with its `override` feature, also takes the place of libc's `malloc` and `free` for MLX's C++ graph
/// (the executable's definitions interpose `libmlx.so`'s calls). Allocation addresses change no byte of a run: the
/// 1000-seed `result_hash` is the same with and without it (docs/measurements.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    // The soak counts and trims the heap of the allocator that serves `malloc`: this one, which counts no live
    // bytes it could report and trims with `mi_collect`.
    kvsim::soak::use_allocator(kvsim::soak::HeapAllocator {
        name: "mimalloc",
        counters: || None,
        // SAFETY: mi_collect only returns mimalloc's free pages to the system; it touches no live allocation.
        trim: || unsafe { libmimalloc_sys::mi_collect(true) },
    });
    sim::raise_mlx_cuda_caches();
    pooled::pin_if_told();
    let cli = Cli::parse();
    inline_cpu_for(cli.cmd.device());
    match cli.cmd {
        Cmd::Doctor => doctor(),
        Cmd::Sim {
            seeds,
            first,
            seed,
            device,
            time,
            json,
            out,
            exact_read,
            shard,
            jobs,
            gpus,
            progress_lines,
            seed_feed,
            op_journal,
            verbose,
            ops,
        } => {
            if exact_read {
                kvsim::cache::set_read_mode(kvsim::cache::ReadMode::Exact);
            }
            if let (Some(seed), Some(ops)) = (seed, ops) {
                return sim_ops_cmd(seed, ops, device, &out);
            }
            let (first, requested) = seed.map_or((first, seeds), |s| (s, 1));
            let a = SimArgs {
                first,
                requested,
                shard,
                device,
                time,
                json,
                out,
                jobs,
                gpus,
                progress_lines,
                seed_feed,
                op_journal,
                verbose,
            };
            sim_cmd(&a)
        }
        Cmd::Merge { parts, json } => merge_cmd(&parts, json),
        Cmd::Soak { ops, time, first, device, trim, out, json, seed_feed, op_journal } => {
            let worker = seed_feed.then_some(pooled::WorkerMode { op_journal });
            pooled::soak_cmd(pooled::SoakArgs { ops, time, first, device, trim, out, json }, worker)
        }
        Cmd::Replay { trace, device } => replay_cmd(&trace, device),
        Cmd::Show { trace, html, op, shrink, shrunk, device } => {
            show_cmd(&trace, html.as_deref(), op, shrink, shrunk.as_deref(), device)
        }
        Cmd::Shrink { trace, out, budget, device } => shrink_cmd(&trace, out, budget, device),
        Cmd::Mutants { budget, shrink_budget, only, save, json } => {
            pooled::mutants_cmd(budget, shrink_budget, only, save, json)
        }
        Cmd::FuzzCase { input, out } => fuzz_case_cmd(&input, &out),
        Cmd::Bench { device, what, python, anchor, no_anchor, quick, out, json, exact_read } => {
            let found = (!no_anchor && what != "exact").then(|| kvsim::bench::find_anchor(python, anchor));
            let anchor =
                found.and_then(|a| a.map_err(|e| eprintln!("kvsim bench: no anchor ({e}); kvsim numbers only")).ok());
            bench_cmd(device, &what, anchor, quick, &out, json, exact_read)
        }
        Cmd::CheckEngine {
            driver,
            seeds,
            ops,
            timeout_s,
            shrinks,
            shrink_budget,
            out,
            json,
            jobs,
            classes_only,
            shrink_plan,
            only,
            seed_feed,
            op_journal,
        } => {
            let only: Vec<&str> = only.iter().map(String::as_str).collect();
            let worker = seed_feed.then_some(pooled::WorkerMode { op_journal });
            let a = pooled::CheckEngineArgs {
                driver: &driver,
                seeds,
                ops,
                timeout_s,
                shrinks,
                shrink_budget,
                out: &out,
                json,
                only: &only,
                jobs: jobs as usize,
                classes_only,
                shrink_plan: shrink_plan.as_deref(),
            };
            pooled::check_engine_cmd(&a, worker)
        }
        Cmd::Oracle { cmd } => match cmd {
            OracleCmd::Record { seeds, scan, seed, include, out, keep_steps, dry_run, family } => {
                if dry_run {
                    oracle_choose_cmd(&family, seeds, scan, &include)
                } else {
                    oracle_record_cmd(&family, seeds, scan, &seed, &include, &out, keep_steps)
                }
            }
            OracleCmd::Redrive { dir, prefix, keep_steps } => oracle_redrive_cmd(&dir, &prefix, keep_steps.as_deref()),
            OracleCmd::Diff { trace } => oracle_diff_cmd(&trace),
            OracleCmd::Check { dir, json } => oracle_check_cmd(&dir, json),
            OracleCmd::Teeth { dir, mutants, json } => oracle_teeth_cmd(&dir, &mutants, json),
        },
        Cmd::Cache { cmd } => cache_cmd(cmd),
    }
}

/// Turns MLX's inline CPU scheduling on for a command whose MLX work is on the CPU (every command but `doctor` and
/// the `--device gpu` runs), unless `KVSIM_INLINE_CPU=off`; a refusal is said once on stderr and the run goes on
/// with MLX's own scheduling (the same bytes, only slower).
fn inline_cpu_for(device: Option<kvsim::sim::DeviceChoice>) {
    if device != Some(kvsim::sim::DeviceChoice::Cpu) {
        return;
    }
    if let Ok(v) = std::env::var("KVSIM_INLINE_CPU") {
        if !matches!(v.as_str(), "on" | "1" | "off" | "0") {
            eprintln!("kvsim: KVSIM_INLINE_CPU={v} is neither on nor off; leaving MLX's scheduling as it is");
        }
    }
    if !sim::inline_cpu_wanted() {
        return;
    }
    if let Err(e) = sim::set_inline_cpu(true) {
        eprintln!("kvsim: {e}; MLX schedules as usual");
    }
}
