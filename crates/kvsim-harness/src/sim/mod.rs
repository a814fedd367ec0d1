//! The deterministic simulator: one `u64` seed -> swarm config -> op stream -> production caches, solo twins and the
//! reference model, checked after every op (see ARCHITECTURE.md).

pub mod check;
pub mod config;
pub mod family;
pub mod gen;
pub mod observe;
pub mod ops;
pub mod rng;
pub mod roster;
pub mod runner;
pub mod shrink;
pub mod summary;
pub mod swarm;
pub mod trace;

use std::collections::BTreeMap;

use crate::sim::check::{Failure, Guarantees};
use crate::sim::config::SimConfig;
pub use crate::sim::family::Registry;
use crate::sim::gen::Generator;
use crate::sim::observe::{NoObserver, RunObserver};
use crate::sim::ops::Op;
use crate::sim::runner::{FamilyFailure, World};
use crate::sim::summary::{Counters, LayoutStats};
use crate::sim::trace::{Expect, Outcome, Trace, FORMAT, VERSION};
use kvsim_cache::faults::{self, Mutant};

/// Where MLX runs the simulation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DeviceChoice {
    Cpu,
    Gpu,
}

impl std::fmt::Display for DeviceChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DeviceChoice {
    type Err = String;

    /// `cpu` or `gpu` (the command line's `--device`).
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "cpu" => Ok(DeviceChoice::Cpu),
            "gpu" => Ok(DeviceChoice::Gpu),
            _ => Err(format!("unknown device {s:?} (expected cpu or gpu)")),
        }
    }
}

impl DeviceChoice {
    /// The device's name on the command line and in summaries.
    pub fn name(self) -> &'static str {
        match self {
            DeviceChoice::Cpu => "cpu",
            DeviceChoice::Gpu => "gpu",
        }
    }

    /// Makes this MLX's default device for the calling thread's ops.
    pub fn activate(self) {
        let d = match self {
            DeviceChoice::Cpu => mlx_rs::Device::cpu(),
            DeviceChoice::Gpu => mlx_rs::Device::gpu(),
        };
        mlx_rs::Device::set_default(&d);
    }

    /// What is promised bit-exact on this device (README "Guarantees"): on the CPU always; on the GPU only in the
    /// calling thread's exact read mode ([`kvsim_cache::exact`]).
    pub fn guarantees(self) -> Guarantees {
        let exact = kvsim_cache::read_mode() == kvsim_cache::ReadMode::Exact;
        Guarantees { exact_unpadded_decode: self == DeviceChoice::Cpu || exact, gpu: self == DeviceChoice::Gpu }
    }
}

/// Whether inline CPU scheduling is wanted: yes unless `KVSIM_INLINE_CPU` is `off` or `0` (any other value but `on`
/// or `1` is also no, and said on stderr once by the command line).
pub fn inline_cpu_wanted() -> bool {
    matches!(std::env::var("KVSIM_INLINE_CPU").as_deref(), Err(_) | Ok("on") | Ok("1"))
}

/// Inline CPU scheduling for the calling thread: MLX's CPU stream tasks run on the thread that enqueues them, in the order MLX enqueues
/// them, instead of each being handed to the stream's worker thread (`mlx-sys/native/inline_cpu.cpp` says which MLX
/// 0.32.2 sources this relies on). The same kernels run in the same order, so the bytes are the same; only the
/// hand-off (a lock and a wake-up per task) goes. Per thread: MLX 0.32.2 gives every thread its own default CPU
/// stream, so other threads keep MLX's worker. Every CPU simulator run ([`run_in`]) turns it on for its thread unless
/// [`inline_cpu_wanted`] says no. `Err` says why it was refused: another MLX version, or an executable that does not
/// take the place of libmlx.so's scheduler.
pub fn set_inline_cpu(on: bool) -> Result<(), String> {
    // SAFETY: plain C calls with no pointers in; the refusal is a NUL-terminated string owned by the library.
    unsafe {
        if mlx_sys::kvsim_mlx_inline_cpu(on as std::os::raw::c_int) == 1 {
            return Ok(());
        }
        let why = std::ffi::CStr::from_ptr(mlx_sys::kvsim_mlx_inline_cpu_refusal());
        Err(format!("inline CPU scheduling refused: {}", why.to_string_lossy()))
    }
}

/// Whether inline CPU scheduling ([`set_inline_cpu`]) is on for the calling thread.
pub fn inline_cpu() -> bool {
    // SAFETY: a plain C call.
    unsafe { mlx_sys::kvsim_mlx_inline_cpu_active() == 1 }
}

/// MLX's CUDA backend keeps LRU caches of captured graphs and SDPA kernels and raises an error ("Cache thrashing is
/// happening") once a run cycles through more shapes than they hold (400 / 256 by default, MLX 0.32.2). A simulator
/// exercises many shapes on purpose, so both are raised here unless the user set them (call it before any MLX op,
/// while the process has one thread). No effect on CPU.
pub fn raise_mlx_cuda_caches() {
    for (var, value) in [("MLX_CUDA_GRAPH_CACHE_SIZE", "100000"), ("MLX_CUDA_SDPA_CACHE_SIZE", "100000")] {
        if std::env::var_os(var).is_none() {
            std::env::set_var(var, value);
        }
    }
}

/// The MLX version of the loaded library.
pub fn mlx_version() -> String {
    unsafe {
        let mut s = mlx_sys::mlx_string_new();
        let v = if mlx_sys::mlx_version(&mut s) == 0 {
            std::ffi::CStr::from_ptr(mlx_sys::mlx_string_data(s)).to_string_lossy().into_owned()
        } else {
            "unknown".to_string()
        };
        mlx_sys::mlx_string_free(s);
        v
    }
}

/// The result of running one op list.
#[derive(Debug, Clone)]
pub struct RunResult {
    pub trace: Trace,
    pub counters: Counters,
    pub ops_by_kind: BTreeMap<String, u64>,
    /// Applied ops per [`ops::API_CLASSES`] entry (every class present, 0 when never applied).
    pub api_coverage: BTreeMap<String, u64>,
    pub skipped: u64,
    /// Per storage-kind family of the run: its ops, checks, byte-identical comparisons and failure.
    pub layouts: BTreeMap<String, LayoutStats>,
    /// The failed check, typed, with the family it belongs to (`None` when the run passed).
    pub failure: Option<FamilyFailure>,
}

impl RunResult {
    pub fn failed(&self) -> bool {
        matches!(self.trace.outcome, Outcome::Fail { .. })
    }
}

/// Either generate ops from the seed (`ops = None`, `count` of them) or replay `ops`, over kvsim's own families.
pub fn run(
    seed: u64,
    config: SimConfig,
    ops: Option<Vec<Op>>,
    device: DeviceChoice,
    mutant: Option<Mutant>,
) -> RunResult {
    run_observed(seed, config, ops, device, mutant, &mut NoObserver)
}

/// [`run`], with `observer` watching every op and (when it asks) every production call (`oracle record` runs this
/// same loop with its recorder).
pub fn run_observed(
    seed: u64,
    config: SimConfig,
    ops: Option<Vec<Op>>,
    device: DeviceChoice,
    mutant: Option<Mutant>,
    observer: &mut dyn RunObserver,
) -> RunResult {
    run_in(Registry::builtin(), seed, config, ops, device, mutant, observer)
}

/// **The** run loop: [`run_observed`] over the families of `registry` (a crate outside kvsim registers its own
/// families there; the config names which of them the run holds).
pub fn run_in(
    registry: &Registry,
    seed: u64,
    config: SimConfig,
    ops: Option<Vec<Op>>,
    device: DeviceChoice,
    mutant: Option<Mutant>,
    observer: &mut dyn RunObserver,
) -> RunResult {
    device.activate();
    faults::arm(mutant);
    // The runner reads every buffer and output after every op (one evaluation), so per-write evaluation is redundant.
    kvsim_cache::set_eval_after_write(false);
    // A CPU run schedules MLX inline on its own thread (the same bytes, without the hand-off), unless switched off.
    let inline = device == DeviceChoice::Cpu && inline_cpu_wanted() && !inline_cpu() && set_inline_cpu(true).is_ok();
    let result = run_inner(registry, seed, config, ops, device, mutant, observer);
    if inline {
        let _ = set_inline_cpu(false);
    }
    kvsim_cache::set_eval_after_write(true);
    faults::arm(None);
    result
}

fn run_inner(
    registry: &Registry,
    seed: u64,
    config: SimConfig,
    ops: Option<Vec<Op>>,
    device: DeviceChoice,
    mutant: Option<Mutant>,
    observer: &mut dyn RunObserver,
) -> RunResult {
    let mut trace = Trace {
        format: FORMAT.to_string(),
        version: VERSION,
        seed,
        config: config.clone(),
        mlx_version: mlx_version(),
        device: device.name().to_string(),
        mutant,
        ops: vec![],
        digests: vec![],
        result_hash: String::new(),
        outcome: Outcome::Pass,
        expect: Expect::Pass,
        note: String::new(),
    };
    let mut ops_by_kind = BTreeMap::new();
    let mut api_coverage: BTreeMap<String, u64> = ops::API_CLASSES.iter().map(|c| (c.to_string(), 0)).collect();
    let mut skipped = 0;
    let mut world = match World::new(config.clone(), registry) {
        Ok(w) => w,
        Err(f) => {
            trace.outcome = Outcome::Fail { op_index: 0, check: f.check.clone(), message: f.message.clone() };
            let failure = Some(FamilyFailure { family: None, failure: f });
            return RunResult {
                trace,
                counters: Counters::default(),
                ops_by_kind,
                api_coverage,
                skipped,
                layouts: BTreeMap::new(),
                failure,
            };
        }
    };
    world.set_guarantees(device.guarantees());
    let mut failure = None;
    let mut gen = Generator::new_in(seed, registry);
    let replay = ops.is_some();
    let list = ops.unwrap_or_default();
    let count = if replay { list.len() } else { config.ops };
    for i in 0..count {
        let op = if replay { list[i].clone() } else { gen.next(&config, &world.view()) };
        trace.ops.push(op.clone());
        observer.on_op_start(i, &op);
        abort_drill(seed, i);
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| world.apply(&op, &mut *observer)));
        let result = match result {
            Ok(r) => r,
            Err(p) => {
                let msg =
                    p.downcast_ref::<String>().cloned().or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()));
                let failure = Failure::new("panic", format!("the op panicked: {}", msg.unwrap_or_default()));
                Err(FamilyFailure { family: None, failure })
            }
        };
        observer.on_op_end(i, &op, result.as_ref().copied().map_err(|f| f.failure.check.as_str()));
        // The op's JSON, streamed into the hasher (the same bytes as `serde_json::to_string`).
        serde_json::to_writer(&mut world.hasher, &op).expect("an op always serializes");
        trace.digests.push(world.hasher.clone().finalize().to_hex()[..16].to_string());
        let reached = world.take_reached();
        if !matches!(result, Ok(false)) {
            for c in op.api_classes().into_iter().chain(reached) {
                *api_coverage.entry(c.to_string()).or_insert(0) += 1;
            }
        }
        match result {
            Ok(true) => *ops_by_kind.entry(op.kind().name().to_string()).or_insert(0) += 1,
            Ok(false) => skipped += 1,
            Err(f) => {
                *ops_by_kind.entry(op.kind().name().to_string()).or_insert(0) += 1;
                trace.outcome =
                    Outcome::Fail { op_index: i, check: f.failure.check.clone(), message: f.failure.message.clone() };
                failure = Some(f);
                break;
            }
        }
    }
    let mut h = blake3::Hasher::new();
    h.update(serde_json::to_string(&trace.config).unwrap().as_bytes());
    for d in &trace.digests {
        h.update(d.as_bytes());
    }
    trace.result_hash = h.finalize().to_hex().to_string();
    let mut layouts = BTreeMap::new();
    for f in &world.families {
        let stats = LayoutStats::of(
            world.ops.get(f.key()).copied().unwrap_or(0),
            f.counters(),
            failure.as_ref().is_some_and(|x: &FamilyFailure| x.family == Some(f.key())),
        )
        .with_variant(f.variant())
        .with_ops_by_kind(world.ops_by_kind.get(f.key()).into_iter().flatten().map(|(k, n)| (*k, *n)));
        layouts.entry(f.key().to_string()).or_insert_with(LayoutStats::default).add(&stats);
    }
    RunResult { trace, counters: world.counters(), ops_by_kind, api_coverage, skipped, layouts, failure }
}

/// The environment variable of the abort drill: `KVSIM_FAULT_ABORT=SEED:OP` (or `SEED`, op 0).
pub const ABORT_ENV: &str = "KVSIM_FAULT_ABORT";

/// The abort drill: with [`ABORT_ENV`] set to `SEED:OP`, the run of seed SEED (generated or replayed) aborts the
/// whole process (`std::process::abort`, SIGABRT) as op OP starts, as a segfault inside MLX or an out-of-memory kill
/// would end it: how a campaign's survival of a dying worker is tested (`kvsim sim --jobs`, docs/campaigns.md). It is
/// not a catalog mutant (an in-process mutant hunt could not survive it). Read once per process; unset, or set to
/// anything else, it does nothing.
fn abort_drill(seed: u64, op: usize) {
    static ARMED: std::sync::OnceLock<Option<(u64, usize)>> = std::sync::OnceLock::new();
    let armed = ARMED.get_or_init(|| {
        let v = std::env::var(ABORT_ENV).ok()?;
        let (s, o) = v.split_once(':').unwrap_or((v.as_str(), "0"));
        Some((s.trim().parse().ok()?, o.trim().parse().ok()?))
    });
    if *armed == Some((seed, op)) {
        std::process::abort();
    }
}

/// Runs a seed with its generated op stream.
pub fn run_seed(seed: u64, device: DeviceChoice, mutant: Option<Mutant>) -> RunResult {
    run(seed, SimConfig::from_seed(seed), None, device, mutant)
}

/// Re-runs a trace's ops (on its config and mutant).
pub fn replay(trace: &Trace, device: DeviceChoice) -> RunResult {
    run(trace.seed, trace.config.clone(), Some(trace.ops.clone()), device, trace.mutant)
}

/// Whether a replay matches what the trace expects: `Pass` must pass; `Fail` must fail with the recorded check.
pub fn replay_matches(trace: &Trace, result: &RunResult) -> Result<(), String> {
    match (&trace.expect, &trace.outcome, &result.trace.outcome) {
        (Expect::Pass, _, Outcome::Pass) => Ok(()),
        (Expect::Pass, _, Outcome::Fail { op_index, check, message }) => {
            Err(format!("expected to pass, failed at op {op_index} [{check}] {message}"))
        }
        (Expect::Fail, Outcome::Fail { check: want, .. }, Outcome::Fail { check, .. }) if want == check => Ok(()),
        (Expect::Fail, recorded, got) => Err(format!("expected the recorded failure {recorded:?}, got {got:?}")),
    }
}

/// Replays `trace` and reports: the first op whose digest differs from the recorded run, the outcome, and whether it
/// matches what the trace expects (the returned flag).
pub fn replay_report(trace: &Trace, device: DeviceChoice) -> (Vec<String>, bool) {
    let r = replay(trace, device);
    let mut lines = vec![];
    // First divergence of the digest chain from the recorded one (same device and MLX only).
    if let Some(i) = trace.digests.iter().zip(&r.trace.digests).position(|(a, b)| a != b) {
        lines.push(format!("digest of op {i} differs from the recorded run ({:?})", trace.ops.get(i)));
    }
    lines.push(match &r.trace.outcome {
        Outcome::Pass => {
            format!("replay: all {} ops passed (result hash {})", r.trace.ops.len(), &r.trace.result_hash[..16])
        }
        Outcome::Fail { op_index, check, message } => {
            format!("replay: first divergence at op {op_index} {:?}\n  [{check}] {message}", r.trace.ops[*op_index])
        }
    });
    match replay_matches(trace, &r) {
        Ok(()) => {
            lines.push(format!("replay matches the trace's expectation ({:?})", trace.expect));
            (lines, true)
        }
        Err(e) => {
            lines.push(format!("replay does NOT match the trace's expectation: {e}"));
            (lines, false)
        }
    }
}

#[cfg(test)]
mod inline_tests {
    use super::*;

    /// The switch is reachable in this test binary (it takes the place of libmlx.so's scheduler), it is per thread,
    /// and runs give the same result hashes with it and without it.
    #[test]
    fn inline_cpu_scheduling_changes_no_byte() {
        let registry = Registry::builtin();
        let hashes = |on: bool| -> Vec<String> {
            set_inline_cpu(on).expect("the switch turns on in a kvsim binary");
            assert_eq!(inline_cpu(), on);
            assert!(!std::thread::spawn(inline_cpu).join().unwrap(), "another thread keeps MLX's worker");
            // `run_in` without its own switching, so that `on == false` runs on MLX's worker.
            DeviceChoice::Cpu.activate();
            kvsim_cache::set_eval_after_write(false);
            let h = (0..4u64)
                .map(|seed| {
                    let c = SimConfig::from_seed_in(seed, registry);
                    run_inner(registry, seed, c, None, DeviceChoice::Cpu, None, &mut NoObserver).trace.result_hash
                })
                .collect();
            kvsim_cache::set_eval_after_write(true);
            set_inline_cpu(false).unwrap();
            h
        };
        assert_eq!(hashes(true), hashes(false));
    }
}
