//! The arguments of the kvsim command line (part of the binary; `main.rs` dispatches them).

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use kvsim::sim::DeviceChoice;

#[derive(Parser)]
#[command(name = "kvsim", version, about = "KV-cache layouts on MLX, checked bit-exactly against solo runs")]
pub struct Cli {
    #[command(subcommand)]
    pub cmd: Cmd,
}

#[derive(Subcommand)]
pub enum Cmd {
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
        /// The anchor script (default: $KVSIM_ANCHOR, else bench/mlxlm_bench.py).
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
pub enum OracleCmd {
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
