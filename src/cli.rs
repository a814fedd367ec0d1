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
        #[arg(long, default_value_t = DeviceChoice::Cpu)]
        device: DeviceChoice,
        /// Stop starting new seeds after this many seconds.
        #[arg(long)]
        time: Option<f64>,
        /// Print a JSON summary as the last line (always the whole summary, guarantees table included).
        #[arg(long)]
        json: bool,
        /// Print the full table (every output class, the guarantees table, ops by kind, API coverage) instead of
        /// the verdict.
        #[arg(long, short)]
        verbose: bool,
        /// Where failing traces are written.
        #[arg(long, default_value = "target/kvsim-failures")]
        out: PathBuf,
        /// Read attention with kvsim's batch-invariant kernels on the GPU (rows and twins alike; no change on CPU).
        #[arg(long)]
        exact_read: bool,
        /// Run only shard I of N of the seeds (seed s when (s - first) % N == I); the JSON summary then carries
        /// every seed's result hash, for `kvsim merge`.
        #[arg(long)]
        shard: Option<kvsim::shard::Shard>,
        /// Spread the seeds over N worker processes (this binary again), handing each the next seed as it finishes
        /// one, and merge their summaries: the same summary and result hash as a serial run.
        #[arg(long, default_value_t = 1)]
        jobs: u64,
        /// With --device gpu: spread the --jobs workers over GPUs, worker i on GPU i mod N (its own
        /// CUDA_VISIBLE_DEVICES); `all` = every visible GPU (CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`, else 1).
        #[arg(long, conflicts_with = "seed_feed")]
        gpus: Option<kvsim::shard::Gpus>,
        /// Worker mode: one progress line per seed on stderr instead of the progress bar.
        #[arg(long, hide = true)]
        progress_lines: bool,
        /// With --seed: run that seed's swarm config with this many ops instead of its drawn count, and write its
        /// trace into --out whether it passes or fails (a long trace for `kvsim show`).
        #[arg(long, requires = "seed", conflicts_with_all = ["jobs", "shard", "seed_feed"])]
        ops: Option<usize>,
        /// Worker mode of `--jobs`: run the seeds read from stdin (one per line, as the parent hands them out)
        /// instead of the campaign's, and print the summary as a part for `kvsim merge`.
        #[arg(long, hide = true)]
        seed_feed: bool,
        /// Worker mode of `--jobs`: keep the running seed's ops in this file as they start (what the parent saves
        /// as the seed's trace if this process dies).
        #[arg(long, hide = true, requires = "seed_feed")]
        op_journal: Option<PathBuf>,
    },
    /// Merge the JSON summaries of `kvsim sim --shard I/N --json` runs (their outputs) into the summary of the
    /// unsharded campaign (same fields, same result hash).
    Merge {
        /// Output files of the shards (the last JSON line of each is read).
        parts: Vec<PathBuf>,
        /// Print the merged JSON summary as the last line.
        #[arg(long)]
        json: bool,
    },
    /// One long run that samples MLX active/peak memory and the process RSS after every seed, and fails if memory
    /// grows after warm-up (final level above 1.1x the post-warm-up level).
    Soak {
        /// Run at least this many ops.
        #[arg(long, conflicts_with = "time", required_unless_present = "time")]
        ops: Option<u64>,
        /// Run for this many seconds.
        #[arg(long)]
        time: Option<f64>,
        /// First seed.
        #[arg(long, default_value_t = 0)]
        first: u64,
        #[arg(long, default_value_t = DeviceChoice::Cpu)]
        device: DeviceChoice,
        /// Return the heap's free memory to the system (mimalloc's `mi_collect`) before every sample.
        #[arg(long)]
        trim: bool,
        /// Also write the report (JSON) here.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Print the report as the last line (JSON).
        #[arg(long)]
        json: bool,
        /// Worker mode (the soak runs in a worker process that a seed that kills it does not take down): run the
        /// seeds read from stdin, a progress line per seed on stderr.
        #[arg(long, hide = true)]
        seed_feed: bool,
        /// Worker mode: keep the running seed's ops in this file as they start.
        #[arg(long, hide = true, requires = "seed_feed")]
        op_journal: Option<PathBuf>,
    },
    /// Replay a trace and report the first divergence (exit 1 when it does not do what the trace expects).
    Replay {
        trace: PathBuf,
        #[arg(long, default_value_t = DeviceChoice::Cpu)]
        device: DeviceChoice,
    },
    /// Replay a trace and draw it: ops and requests on a timeline, each op's rows and layers, the first failing
    /// check with what it compared; one self-contained HTML page with --html, else text.
    Show {
        trace: PathBuf,
        /// Write the page here (one HTML file; no network, no external script).
        #[arg(long)]
        html: Option<PathBuf>,
        /// Open with this op's pictures (default: the failing op, else the last).
        #[arg(long)]
        op: Option<usize>,
        /// Shrink a failing trace now (within this many replays) and show the result beside it.
        #[arg(long)]
        shrink: Option<usize>,
        /// Show this shrunk trace beside it.
        #[arg(long, conflicts_with = "shrink")]
        shrunk: Option<PathBuf>,
        #[arg(long, default_value_t = DeviceChoice::Cpu)]
        device: DeviceChoice,
    },
    /// Minimize a failing trace and write it (default: into corpus/).
    Shrink {
        trace: PathBuf,
        #[arg(long)]
        out: Option<PathBuf>,
        #[arg(long, default_value_t = 3000)]
        budget: usize,
        #[arg(long, default_value_t = DeviceChoice::Cpu)]
        device: DeviceChoice,
    },
    /// Speed against the mlx-lm anchor measured in the same run (ratios); results saved under bench/results/.
    Bench {
        #[arg(long, default_value_t = DeviceChoice::Cpu)]
        device: DeviceChoice,
        /// sim, step, exact (batch invariance and accuracy of the exact read), or all (sim and step).
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
        /// Also time (and run the simulator with) the exact read mode; `--what exact` checks its invariance.
        #[arg(long)]
        exact_read: bool,
    },
    /// Turn a cargo-fuzz input of the `sim_trace` target into a trace (for `replay` and `shrink`).
    FuzzCase {
        input: PathBuf,
        #[arg(long, default_value = "target/kvsim-failures")]
        out: PathBuf,
    },
    /// Run the mutation catalog: each mutant must be caught within its seed budget.
    Mutants {
        /// Seeds tried per mutant (default: the mutant's own budget, `campaign::mutant_budget`, the one `cargo test`
        /// gives it).
        #[arg(long)]
        budget: Option<u64>,
        /// Shrink each caught mutant's trace (replays per mutant).
        #[arg(long, default_value_t = 600)]
        shrink_budget: usize,
        /// Only these mutants (by name, comma-separated).
        #[arg(long)]
        only: Option<String>,
        /// Write each shrunk trace to corpus/mutant-<name>.json.
        #[arg(long)]
        save: bool,
        #[arg(long)]
        json: bool,
    },
    /// Run the simulator's swarm against a cache engine in another process, over the engine protocol
    /// (oracles/PROTOCOL.md; mlx-lm's driver: `--driver "python3 oracles/mlx_lm/engine.py"`): failures classed by the
    /// check that failed first, each class's shortest shrunk trace and a standalone reproducer written to --out.
    CheckEngine {
        /// The engine's command line (run through `sh -c`).
        #[arg(long)]
        driver: String,
        /// Seeds 0..N.
        #[arg(long, default_value_t = 500)]
        seeds: u64,
        /// Ops per seed.
        #[arg(long, default_value_t = 100)]
        ops: usize,
        /// Seconds the engine may take to answer one request before it counts as hung.
        #[arg(long, default_value_t = 60)]
        timeout_s: u64,
        /// Failing seeds shrunk per class (the shortest is kept).
        #[arg(long, default_value_t = 3)]
        shrinks: usize,
        /// Replays one shrink may take.
        #[arg(long, default_value_t = 300)]
        shrink_budget: usize,
        /// Where each class's trace (`<class>.trace.json`) and reproducer (`<class>.py`) are written.
        #[arg(long, default_value = "target/kvsim-engine")]
        out: PathBuf,
        /// Run only these layers of the engine (comma-separated: kv, pool, prefix, recurrent); default: every layer
        /// it serves.
        #[arg(long, value_delimiter = ',', value_parser = ["kv", "pool", "prefix", "recurrent"])]
        only: Vec<String>,
        /// Print the JSON summary as the last line.
        #[arg(long)]
        json: bool,
        /// Engine processes checking seeds side by side, each driven by a worker of its own. The report is the one
        /// a single process gives: the seeds' classes are gathered, then the seeds a single run would shrink are
        /// run again, shared among the workers, each class keeping the shortest trace (the one a single run keeps).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=256))]
        jobs: u64,
        /// Worker mode: class the seeds only (no trace or reproducer written; the JSON line is the report).
        #[arg(long, hide = true, requires = "seed_feed")]
        classes_only: bool,
        /// Worker mode: shrink exactly these seeds of each class (JSON: class name -> seeds), and write the traces
        /// and reproducers in a folder of this process's own under `--out`.
        #[arg(long, hide = true, requires = "seed_feed")]
        shrink_plan: Option<String>,
        /// Worker mode (the check runs in a worker process that a seed that kills it does not take down): run the
        /// seeds read from stdin, a progress line per seed on stderr.
        #[arg(long, hide = true)]
        seed_feed: bool,
        /// Worker mode: keep the running seed's K/V ops in this file as they start.
        #[arg(long, hide = true, requires = "seed_feed")]
        op_journal: Option<PathBuf>,
    },
    /// The differential oracle against mlx-lm (oracles/README.md): record, diff, check.
    Oracle {
        #[command(subcommand)]
        cmd: OracleCmd,
    },
    /// Cache files (kvsim's own format, mlx-lm prompt-cache files): inspect, convert (docs/persistence.md).
    Cache {
        #[command(subcommand)]
        cmd: CacheCmd,
    },
}

#[derive(Subcommand)]
pub enum CacheCmd {
    /// Describe a cache file (format; per layer: kind, offset, tensors with shapes and dtypes, floor), validating
    /// it fully. Exit 1 with a message on a corrupt, truncated or unknown file.
    Inspect {
        file: PathBuf,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Convert a cache file to kvsim's format or to an mlx-lm prompt-cache file (written atomically).
    Convert {
        input: PathBuf,
        output: PathBuf,
        #[arg(long)]
        to: kvsim::persist::inspect::Format,
        /// mlx-lm files: the per-row offsets (comma-separated) of every `ArraysCache` whose offsets neither the
        /// file's metadata nor its attention layers give.
        #[arg(long, value_delimiter = ',')]
        ssm_offsets: Option<Vec<usize>>,
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
        /// The layout family to record: `attention` (files seed-N), `quant` (files quant-seed-N: the seed's
        /// configuration with the quantized family alone) or `ssm` (files ssm-seed-N: the recurrent family alone, in
        /// its `ssm` set).
        #[arg(long, default_value = "attention")]
        family: String,
    },
    /// Re-run the mlx-lm driver over the traces already recorded in --dir (a driver change): the traces stay as
    /// they are, every NAME.oracle.jsonl is rewritten; prints the check's summary.
    Redrive {
        #[arg(long, default_value = "oracles/recorded")]
        dir: PathBuf,
        /// Only the traces whose name starts with this (`seed-`, `quant-seed-`, `ssm-seed-`).
        #[arg(long, default_value = "")]
        prefix: String,
        /// Also write NAME.steps.jsonl into this directory (for debugging).
        #[arg(long)]
        keep_steps: Option<PathBuf>,
    },
    /// Re-run kvsim's side of one recorded trace and compare it with the stored oracle results, op by op.
    Diff { trace: PathBuf },
    /// Every catalog mutant over the recorded set with kvsim's own checks off: how many traces the oracle alone
    /// finds unclassified (exit 1 when a mutant made kvsim differ where it agreed and every such divergence was classified).
    Teeth {
        #[arg(long, default_value = "oracles/recorded")]
        dir: PathBuf,
        /// Only these mutants (catalog names; repeatable). Default: the whole catalog.
        #[arg(long = "mutant")]
        mutants: Vec<String>,
        /// Print `{"mutants": [{"name", "unclassified_traces", "reason", ...}]}` as the last line.
        #[arg(long)]
        json: bool,
    },
    /// Compare the whole recorded set (exit 1 when a divergence is unclassified).
    Check {
        #[arg(long, default_value = "oracles/recorded")]
        dir: PathBuf,
        /// Print `{"traces", "agree", "classified", "unclassified"}` as the last line.
        #[arg(long)]
        json: bool,
    },
}

impl Cmd {
    /// The device the command runs MLX on: `None` for `doctor` (every device) and for commands without a
    /// `--device` (the CPU).
    pub fn device(&self) -> Option<DeviceChoice> {
        match self {
            Cmd::Doctor => None,
            Cmd::Sim { device, .. }
            | Cmd::Soak { device, .. }
            | Cmd::Replay { device, .. }
            | Cmd::Show { device, .. }
            | Cmd::Shrink { device, .. }
            | Cmd::Bench { device, .. } => Some(*device),
            _ => Some(DeviceChoice::Cpu),
        }
    }
}
