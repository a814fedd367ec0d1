//! Seed campaigns: many seeds, their typed summary, and mutant hunts. Shared by the CLI (`kvsim sim`, `kvsim
//! mutants`) and the tests, so that neither repeats the other.
//!
//! A campaign is a fold of per-seed results ([`SeedResult`]) into a [`Summary`]: every counter is a sum (or a max),
//! and the campaign's `result_hash` is blake3 of the ordered per-seed result hashes. So seeds run in shards or on
//! several threads merge into the same summary as long as they are folded in seed order.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::shard::{SeedHash, Shard, ShardError};
use crate::sim::config::SimConfig;
use crate::sim::summary::{ClassCount, Counters, LayoutStats};
use crate::sim::trace::Outcome;
use crate::sim::{self, DeviceChoice, RunResult};
use kvsim_cache::faults::Mutant;

/// A failed seed of a campaign.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FailedSeed {
    pub seed: u64,
    pub op_index: usize,
    pub check: String,
    pub message: String,
    /// Where the failing trace was written (set by whoever writes it).
    pub trace: String,
}

/// One seed's run, reduced to what a summary needs (plus the run itself, for writing a failing trace).
#[derive(Debug, Clone)]
pub struct SeedResult {
    pub seed: u64,
    pub config: SimConfig,
    pub run: RunResult,
}

impl SeedResult {
    /// The failure, when the seed failed.
    pub fn failure(&self) -> Option<FailedSeed> {
        match &self.run.trace.outcome {
            Outcome::Pass => None,
            Outcome::Fail { op_index, check, message } => Some(FailedSeed {
                seed: self.seed,
                op_index: *op_index,
                check: check.clone(),
                message: message.clone(),
                trace: String::new(),
            }),
        }
    }
}

/// Runs one seed of a campaign.
pub fn run_seed(seed: u64, device: DeviceChoice) -> SeedResult {
    run_seed_armed(seed, device, None)
}

/// [`run_seed`] with catalog mutant `mutant` armed (a planted failure; its trace records the mutant and replays it).
pub fn run_seed_armed(seed: u64, device: DeviceChoice, mutant: Option<Mutant>) -> SeedResult {
    let config = SimConfig::from_seed(seed);
    let run = sim::run(seed, config.clone(), None, device, mutant);
    SeedResult { seed, config, run }
}

/// [`run_seed_armed`], keeping the seed's ops in the op journal at `journal` (when given) as they start
/// ([`crate::shard::OpJournal`]: what a worker process leaves behind when it dies). The journal changes no result.
pub fn run_seed_journaled(
    seed: u64,
    device: DeviceChoice,
    mutant: Option<Mutant>,
    journal: Option<&std::path::Path>,
) -> SeedResult {
    match journal {
        Some(path) => {
            let config = SimConfig::from_seed(seed);
            let mut j = crate::shard::OpJournal::start(path, seed);
            let run = sim::run_observed(seed, config.clone(), None, device, mutant, &mut j);
            SeedResult { seed, config, run }
        }
        None => run_seed_armed(seed, device, mutant),
    }
}

/// Byte-identical comparisons with the solo twin, per output class (and states).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BitExact {
    pub state: u64,
    pub decode: u64,
    pub decode_unpadded: u64,
    pub decode_padded: u64,
    pub window: u64,
}

/// Rows compared with the solo twin, per output class.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Compared {
    pub decode_unpadded: u64,
    pub decode_padded: u64,
    pub window: u64,
}

/// Largest ULP distance to the solo twin, per output class.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MaxUlp {
    pub decode_unpadded_vs_solo: u64,
    pub decode_padded_vs_solo: u64,
    pub window_vs_solo: u64,
}

/// Largest scaled-ULP error against the f64 model, per dtype.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ModelUlp {
    pub bf16: f64,
    pub f32: f64,
}

/// Comparisons against the reference model.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Reference {
    pub checks: u64,
    /// Failed seeds whose failing check compares production with the model ([`sim::check::Failure::against_model`]).
    pub failures: u64,
    pub max_ulp: ModelUlp,
}

/// A campaign's summary: a fold of per-seed results. Every count is held once, in `counters`; its JSON form
/// ([`SummaryJson`], the last line of `kvsim sim --json`) shows them under the names summaries have always used.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(into = "SummaryJson", from = "SummaryJson")]
pub struct Summary {
    pub seeds: u64,
    pub ops: u64,
    pub skipped_ops: u64,
    pub failures: u64,
    pub ops_by_kind: BTreeMap<String, u64>,
    /// Applied ops per public operation / parameter class (`sim::ops::API_CLASSES`); a 0 is an input class the
    /// generator never produced.
    pub api_coverage: BTreeMap<String, u64>,
    /// Per class of `api_coverage`: the runs that reached it at least once (the coverage floor of rare classes is
    /// a share of runs, not of ops).
    pub api_runs: BTreeMap<String, u64>,
    /// Every count of the campaign's runs, summed (checks, comparisons, the guarantees table, conversions, ...).
    pub counters: Counters,
    /// Failed seeds whose failing check compares production with the model ([`sim::check::Failure::against_model`]).
    pub model_failures: u64,
    pub device: String,
    pub mlx_version: String,
    /// Which read the attention outputs went through, when not MLX's fused SDPA (`Exact`: `--exact-read`); parts of
    /// different modes never merge.
    pub read_mode: Option<kvsim_cache::ReadMode>,
    /// [`crate::shard::ordered_hash`] of the ordered per-seed result hashes.
    pub result_hash: String,
    pub failed_seeds: Vec<FailedSeed>,
    pub seconds: f64,
    /// Per storage-kind family (`"kv:plain"`, `"kv:rotating-plain"`, ...): ops, checks, failures, bit-exact
    /// comparisons and its guarantees table.
    pub layouts: BTreeMap<String, LayoutStats>,
    /// The ordered per-seed result hashes the campaign hash is made of (not part of the JSON).
    pub seed_hashes: Vec<String>,
    /// The seeds of `seed_hashes`, in the same order (not part of the JSON).
    pub seeds_run: Vec<u64>,
    /// Stopped early (Ctrl-C): the summary covers the seeds that ran.
    pub interrupted: bool,
    /// Seeds whose worker process died running them (`kvsim sim --jobs`: a signal, an abort, an out-of-memory kill).
    /// Each is a failure (in `failures` and `failed_seeds`, check [`CRASH_CHECK`]) and not in `seeds`: it left no
    /// result, so no result hash.
    pub crashed: u64,
}

/// The check of a [`FailedSeed`] whose worker process died running it.
pub const CRASH_CHECK: &str = "crash";

impl From<Summary> for SummaryJson {
    fn from(s: Summary) -> SummaryJson {
        let t = &s.counters;
        SummaryJson {
            seeds: s.seeds,
            ops: s.ops,
            skipped_ops: s.skipped_ops,
            checks: t.checks,
            failures: s.failures,
            ops_by_kind: s.ops_by_kind.clone(),
            api_coverage: s.api_coverage.clone(),
            api_runs: s.api_runs.clone(),
            ill_formed_rejected: t.ill_formed_rejected.clone(),
            bit_exact: BitExact {
                state: t.bit_exact_state,
                decode: t.decode_unpadded.bit_exact + t.decode_padded.bit_exact,
                decode_unpadded: t.decode_unpadded.bit_exact,
                decode_padded: t.decode_padded.bit_exact,
                window: t.window.bit_exact,
            },
            compared: Compared {
                decode_padded: t.decode_padded.compared,
                decode_unpadded: t.decode_unpadded.compared,
                window: t.window.compared,
            },
            max_ulp: MaxUlp {
                decode_padded_vs_solo: t.decode_padded.max_ulp,
                decode_unpadded_vs_solo: t.decode_unpadded.max_ulp,
                window_vs_solo: t.window.max_ulp,
            },
            reference: Reference {
                checks: t.model_checks,
                failures: s.model_failures,
                max_ulp: ModelUlp { bf16: t.model_max_ulp_bf16, f32: t.model_max_ulp_f32 },
            },
            expected_errors: t.expected_errors,
            persist_roundtrips: t.persist_roundtrips,
            persist_batches: t.persist_batches,
            prepared_prefills: t.prepared_prefills,
            prefills_ended_uncommitted: t.prefills_ended_uncommitted,
            damaged_files_refused: t.damaged_files_refused,
            layer_sets: t.layer_sets,
            lying_files_refused: t.lying_files_refused,
            conversions: t.conversions,
            prefill_conversions: t.prefill_conversions,
            rounds: t.rounds,
            rollbacks_across_wrap: t.rollbacks_across_wrap,
            reuses: t.reuses,
            trims_below_start: t.trims_below_start,
            recurrent: t.recurrent,
            device: s.device,
            mlx_version: s.mlx_version,
            read_mode: s.read_mode,
            result_hash: s.result_hash,
            failed_seeds: s.failed_seeds,
            seconds: s.seconds,
            guarantees: t.table.clone(),
            layouts: s.layouts,
            interrupted: s.interrupted,
            crashed: s.crashed,
        }
    }
}

impl From<SummaryJson> for Summary {
    /// The summary a JSON line describes; its counters are those the JSON shows (what is promised on the device,
    /// `Counters::guarantees`, is not part of it and comes back as the default).
    fn from(j: SummaryJson) -> Summary {
        let class = |compared, bit_exact, max_ulp| ClassCount { compared, bit_exact, max_ulp };
        let counters = Counters {
            checks: j.checks,
            expected_errors: j.expected_errors,
            persist_roundtrips: j.persist_roundtrips,
            persist_batches: j.persist_batches,
            prepared_prefills: j.prepared_prefills,
            prefills_ended_uncommitted: j.prefills_ended_uncommitted,
            damaged_files_refused: j.damaged_files_refused,
            layer_sets: j.layer_sets,
            lying_files_refused: j.lying_files_refused,
            conversions: j.conversions,
            prefill_conversions: j.prefill_conversions,
            rounds: j.rounds,
            rollbacks_across_wrap: j.rollbacks_across_wrap,
            reuses: j.reuses,
            trims_below_start: j.trims_below_start,
            bit_exact_state: j.bit_exact.state,
            decode_unpadded: class(
                j.compared.decode_unpadded,
                j.bit_exact.decode_unpadded,
                j.max_ulp.decode_unpadded_vs_solo,
            ),
            decode_padded: class(j.compared.decode_padded, j.bit_exact.decode_padded, j.max_ulp.decode_padded_vs_solo),
            window: class(j.compared.window, j.bit_exact.window, j.max_ulp.window_vs_solo),
            model_max_ulp_f32: j.reference.max_ulp.f32,
            model_max_ulp_bf16: j.reference.max_ulp.bf16,
            model_checks: j.reference.checks,
            table: j.guarantees,
            recurrent: j.recurrent,
            ill_formed_rejected: j.ill_formed_rejected,
            ..Counters::default()
        };
        Summary {
            seeds: j.seeds,
            ops: j.ops,
            skipped_ops: j.skipped_ops,
            failures: j.failures,
            ops_by_kind: j.ops_by_kind,
            api_coverage: j.api_coverage,
            api_runs: j.api_runs,
            counters,
            model_failures: j.reference.failures,
            device: j.device,
            mlx_version: j.mlx_version,
            read_mode: j.read_mode,
            result_hash: j.result_hash,
            failed_seeds: j.failed_seeds,
            seconds: j.seconds,
            layouts: j.layouts,
            seed_hashes: vec![],
            seeds_run: vec![],
            interrupted: j.interrupted,
            crashed: j.crashed,
        }
    }
}

/// The JSON form of a [`Summary`] (the last line of `kvsim sim --json`): its counts under the names summaries have
/// always used, derived from the one [`Counters`] it holds.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SummaryJson {
    pub seeds: u64,
    pub ops: u64,
    pub skipped_ops: u64,
    pub checks: u64,
    pub failures: u64,
    pub ops_by_kind: BTreeMap<String, u64>,
    /// Applied ops per public operation / parameter class (`sim::ops::API_CLASSES`); a 0 is an input class the
    /// generator never produced.
    #[serde(default)]
    pub api_coverage: BTreeMap<String, u64>,
    /// Per class of `api_coverage`: the runs that reached it at least once.
    #[serde(default)]
    pub api_runs: BTreeMap<String, u64>,
    /// Generated ill-formed inputs refused with the expected typed error and nothing changed, per input class.
    #[serde(default)]
    pub ill_formed_rejected: BTreeMap<String, u64>,
    pub bit_exact: BitExact,
    pub compared: Compared,
    pub max_ulp: MaxUlp,
    pub reference: Reference,
    pub expected_errors: u64,
    /// Rows saved and restored mid-run (`src/persist`) before continuing, checked like every other state.
    pub persist_roundtrips: u64,
    /// Running batches saved and restored mid-run (every layer, kvsim's format), each row then checked.
    #[serde(default)]
    pub persist_batches: u64,
    /// bf16-first rows: right-padded prefills of a cohort.
    #[serde(default)]
    pub prepared_prefills: u64,
    /// bf16-first rows: prefills that the prefill's end committed for some request (`sim::summary::Counters`).
    #[serde(default)]
    pub prefills_ended_uncommitted: u64,
    /// Damaged copies of the saved kvsim files refused with a typed error (`sim::summary::Counters`).
    #[serde(default)]
    pub damaged_files_refused: u64,
    /// Model cache sets of differing layers saved and restored layer by layer (`sim::summary::Counters`).
    #[serde(default)]
    pub layer_sets: u64,
    /// Saved files made to lie under valid checksums and refused with a typed error (`sim::summary::Counters`).
    #[serde(default)]
    pub lying_files_refused: u64,
    /// The bf16-first families: conversions to affine storage (one per row or lego and per layer), of
    /// which at a prefill chunk's commit; speculative rounds with unequal per-row accepts; rollbacks across the
    /// ring's wrap; prefix reuses of a stored entry; trims of a converted lego below `start`
    /// (`sim::summary::Counters` says exactly what each counts).
    #[serde(default)]
    pub conversions: u64,
    #[serde(default)]
    pub prefill_conversions: u64,
    #[serde(default)]
    pub rounds: u64,
    #[serde(default)]
    pub rollbacks_across_wrap: u64,
    #[serde(default)]
    pub reuses: u64,
    #[serde(default)]
    pub trims_below_start: u64,
    /// The recurrent family's speculative rounds, rollbacks (with unequal per-row keeps) and replays, summed over
    /// its runs (absent when no run held it).
    #[serde(default, skip_serializing_if = "crate::sim::summary::Recurrent::is_zero")]
    pub recurrent: crate::sim::summary::Recurrent,
    pub device: String,
    pub mlx_version: String,
    /// Which read the attention outputs went through, when not MLX's fused SDPA (`Exact`: `--exact-read`, the
    /// batch-invariant kernels of `cache::exact`); absent in the default mode. Parts of different modes never merge.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub read_mode: Option<kvsim_cache::ReadMode>,
    /// blake3 of the ordered per-seed result hashes.
    pub result_hash: String,
    pub failed_seeds: Vec<FailedSeed>,
    pub seconds: f64,
    /// `class/dtype` -> {compared, bit_exact, max_ulp} against the solo twin (README "Guarantees").
    pub guarantees: BTreeMap<String, ClassCount>,
    /// Per storage-kind family (`"kv:plain"`, `"kv:rotating-plain"`, ...): ops, checks, failures, bit-exact
    /// comparisons and its guarantees table.
    pub layouts: BTreeMap<String, LayoutStats>,
    /// Stopped early (Ctrl-C): the summary covers the seeds that ran. Absent from the JSON when false.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub interrupted: bool,
    /// Seeds whose worker process died running them (always present; 0 in a campaign without one).
    #[serde(default)]
    pub crashed: u64,
}

impl Summary {
    pub fn new(device: DeviceChoice) -> Summary {
        let read_mode = Some(kvsim_cache::read_mode()).filter(|&m| m != kvsim_cache::ReadMode::Fused);
        Summary { device: device.name().into(), mlx_version: sim::mlx_version(), read_mode, ..Summary::default() }
    }

    /// Folds one seed in (seeds must be folded in order for the campaign hash to be the same).
    pub fn add(&mut self, r: &SeedResult, failed: Option<FailedSeed>) {
        let run = &r.run;
        self.seeds += 1;
        self.ops += run.trace.ops.len() as u64 - run.skipped;
        self.skipped_ops += run.skipped;
        for (k, v) in &run.ops_by_kind {
            *self.ops_by_kind.entry(k.clone()).or_insert(0) += v;
        }
        for (k, v) in &run.api_coverage {
            *self.api_coverage.entry(k.clone()).or_insert(0) += v;
            *self.api_runs.entry(k.clone()).or_insert(0) += u64::from(*v > 0);
        }
        self.counters.add(&run.counters);
        for (k, v) in &run.layouts {
            self.layouts.entry(k.clone()).or_default().add(v);
        }
        self.seed_hashes.push(run.trace.result_hash.clone());
        self.seeds_run.push(r.seed);
        if let Some(f) = failed {
            self.failures += 1;
            if run.failure.as_ref().is_some_and(|f| f.failure.against_model()) {
                self.model_failures += 1;
            }
            self.failed_seeds.push(f);
        }
        self.refresh();
    }

    /// Folds in a seed whose worker process died running it (`f.check` is [`CRASH_CHECK`]): a failure without a
    /// result.
    pub fn add_crash(&mut self, f: FailedSeed) {
        self.failures += 1;
        self.crashed += 1;
        self.failed_seeds.push(f);
        self.failed_seeds.sort_by_key(|f| f.seed);
    }

    /// The verdict a user reads first, at most 15 lines: the totals, the reads against the solo twin and the f64
    /// model, one line per layout family (a family's rotating layout beside its linear one), the weakest guarantee
    /// class (the largest ULP distance to the twin; then the smallest bit-exact share), and the failing seeds.
    /// [`Summary::lines`] is the full table.
    pub fn verdict(&self) -> Vec<String> {
        let (s, t) = (self, &self.counters);
        let verdict = if s.failures == 0 { "PASS" } else { "FAIL" };
        let crashed = if s.crashed > 0 { format!(" ({} crashed)", s.crashed) } else { String::new() };
        let mut lines = vec![format!(
            "kvsim sim: {verdict}: {} seeds, {} ops, {} checks, {} failures{crashed}, {:.1}s on {}{}",
            s.seeds,
            s.ops,
            t.checks,
            s.failures,
            s.seconds,
            s.device,
            if s.read_mode.is_some() { " (exact read)" } else { "" }
        )];
        let reads = [t.decode_unpadded, t.decode_padded, t.window];
        let (compared, exact) = reads.iter().fold((0, 0), |(c, e), r| (c + r.compared, e + r.bit_exact));
        let max_ulp = reads.iter().map(|r| r.max_ulp).max().unwrap_or(0);
        lines.push(format!(
            "  vs solo twin: {exact} of {compared} reads byte-identical (max {max_ulp} ULP), {} states byte-identical",
            t.bit_exact_state
        ));
        lines.push(format!(
            "  vs f64 model: max {:.2} ULP (f32), {:.2} ULP (bf16) over {} reads",
            t.model_max_ulp_f32, t.model_max_ulp_bf16, t.model_checks
        ));
        let mut families: BTreeMap<String, (Vec<&str>, LayoutStats)> = BTreeMap::new();
        for (k, l) in &s.layouts {
            let f = families.entry(k.replace("rotating-", "")).or_default();
            f.0.push(k);
            f.1.ops += l.ops;
            f.1.checks += l.checks;
            f.1.failures += l.failures;
        }
        for (name, (kinds, l)) in &families {
            let label = if kinds.len() > 1 { format!("{name} (+rotating)") } else { name.clone() };
            lines.push(format!("  {label:<34} {:>9} ops {:>10} checks {:>3} failures", l.ops, l.checks, l.failures));
        }
        let weakest = t.table.iter().max_by(|(_, a), (_, b)| {
            let share = |c: &ClassCount| c.bit_exact as f64 / c.compared.max(1) as f64;
            a.max_ulp.cmp(&b.max_ulp).then(share(b).total_cmp(&share(a)))
        });
        if let Some((k, c)) = weakest {
            lines.push(format!(
                "  weakest guarantee class: {k} ({} of {} byte-identical, max {} ULP; `--verbose` for all)",
                c.bit_exact, c.compared, c.max_ulp
            ));
        }
        if !s.failed_seeds.is_empty() {
            let seeds: Vec<String> = s.failed_seeds.iter().take(8).map(|f| f.seed.to_string()).collect();
            let more = s.failed_seeds.len().saturating_sub(8);
            let more = if more > 0 { format!(" and {more} more") } else { String::new() };
            lines.push(format!("  failing seeds: {}{more} (traces: `kvsim replay TRACE`)", seeds.join(" ")));
        }
        lines
    }

    /// The full table (`kvsim sim --verbose`): every output class, the guarantees table, every layout, ops by kind,
    /// API coverage and the ill-formed inputs rejected.
    pub fn lines(&self) -> Vec<String> {
        let s = self;
        let t = &s.counters;
        let mut lines = vec![];
        lines.push(format!(
            "kvsim sim: {} seeds, {} ops ({} skipped), {} checks, {} failures, {:.1}s on {}{}",
            s.seeds,
            s.ops,
            s.skipped_ops,
            t.checks,
            s.failures,
            s.seconds,
            s.device,
            if s.read_mode.is_some() { " (exact read)" } else { "" }
        ));
        lines.push(format!(
            "  {:<28} {:>10} {:>12} {:>10}",
            "output class vs solo twin", "compared", "bit-exact", "max ULP"
        ));
        for (name, c) in [
            ("decode (unpadded rows)", t.decode_unpadded),
            ("decode (padded rows)", t.decode_padded),
            ("window", t.window),
        ] {
            lines.push(format!("  {:<28} {:>10} {:>12} {:>10}", name, c.compared, c.bit_exact, c.max_ulp));
        }
        lines.push(format!("  state comparisons byte-identical: {}", t.bit_exact_state));
        lines.push("  guarantees table (vs solo twin; ULPs at output scale):".into());
        for (k, c) in &t.table {
            lines.push(format!(
                "    {:<40} {:>9} compared {:>9} bit-exact  max {} ULP",
                k, c.compared, c.bit_exact, c.max_ulp
            ));
        }
        lines.push(format!(
            "  vs f64 model: max {:.2} ULP (f32), {:.2} ULP (bf16) over {} reads",
            t.model_max_ulp_f32, t.model_max_ulp_bf16, t.model_checks
        ));
        for (k, l) in &s.layouts {
            lines.push(format!(
                "  layout {k:<20} {} ops, {} checks, {} bit-exact, {} failures",
                l.ops, l.checks, l.bit_exact, l.failures
            ));
        }
        let kinds: Vec<String> = s.ops_by_kind.iter().map(|(k, v)| format!("{k}={v}")).collect();
        lines.push(format!("  ops by kind: {}", kinds.join(" ")));
        let never: Vec<&str> = s.api_coverage.iter().filter(|(_, &v)| v == 0).map(|(k, _)| k.as_str()).collect();
        if !never.is_empty() {
            lines.push(format!("  api classes never generated: {}", never.join(" ")));
        }
        let rejected: Vec<String> = t.ill_formed_rejected.iter().map(|(k, v)| format!("{k}={v}")).collect();
        lines.push(format!("  ill-formed inputs rejected (typed error, nothing changed): {}", rejected.join(" ")));
        lines
    }

    /// Recomputes the campaign hash from the ordered seed hashes.
    pub(crate) fn refresh(&mut self) {
        self.result_hash = crate::shard::ordered_hash(self.seed_hashes.iter().map(String::as_str));
    }
}

/// Runs `seeds` in order (stopping before a seed once `time` seconds have passed). `on_seed` sees each result
/// before it is folded and may return where it wrote a failing trace.
pub fn run_seeds(
    seeds: &[u64],
    device: DeviceChoice,
    time: Option<f64>,
    on_seed: impl FnMut(&SeedResult) -> Option<String>,
) -> Summary {
    run_seeds_until(seeds.iter().copied(), device, time, &AtomicBool::new(false), None, on_seed)
}

/// [`run_seeds`], also stopping before the next seed once `stop` is set (Ctrl-C); the summary then covers the seeds
/// that ran and says `interrupted`. `mutant`, when given, is armed in every run (`KVSIM_MUTANT`: a planted failure).
pub fn run_seeds_until(
    seeds: impl IntoIterator<Item = u64>,
    device: DeviceChoice,
    time: Option<f64>,
    stop: &AtomicBool,
    mutant: Option<Mutant>,
    on_seed: impl FnMut(&SeedResult) -> Option<String>,
) -> Summary {
    run_seeds_journaled(seeds, device, time, stop, mutant, None, on_seed)
}

/// [`run_seeds_until`], keeping each seed's ops in the op journal at `journal` as they start
/// ([`crate::shard::OpJournal`]: what a `--jobs` worker leaves behind when it dies). The journal changes no result.
pub fn run_seeds_journaled(
    seeds: impl IntoIterator<Item = u64>,
    device: DeviceChoice,
    time: Option<f64>,
    stop: &AtomicBool,
    mutant: Option<Mutant>,
    journal: Option<&std::path::Path>,
    mut on_seed: impl FnMut(&SeedResult) -> Option<String>,
) -> Summary {
    let start = Instant::now();
    let mut summary = Summary::new(device);
    for seed in seeds {
        if time.is_some_and(|t| start.elapsed().as_secs_f64() > t) {
            break;
        }
        if stop.load(Ordering::SeqCst) {
            summary.interrupted = true;
            break;
        }
        let r = run_seed_journaled(seed, device, mutant, journal);
        let written = on_seed(&r);
        let failed = r.failure().map(|mut f| {
            f.trace = written.unwrap_or_default();
            f
        });
        summary.add(&r, failed);
    }
    summary.seconds = start.elapsed().as_secs_f64();
    summary
}

/// The trace of a seed whose worker process died in op `ops.len() - 1` (the ops it had started, from its op journal):
/// it expects that failure, check [`CRASH_CHECK`], so `kvsim replay` of it in another process runs the same ops up
/// to the one that killed the worker (and, when that still kills the process, dies there too). `config` is the run's
/// (`SimConfig::from_seed(seed)` for kvsim's own campaigns) and `mutant` the one armed in it (a mutant hunt's).
pub fn crash_trace(
    seed: u64,
    config: SimConfig,
    mutant: Option<Mutant>,
    ops: Vec<crate::sim::ops::Op>,
    device: DeviceChoice,
    how: &str,
) -> sim::trace::Trace {
    let op_index = ops.len().saturating_sub(1);
    sim::trace::Trace {
        format: sim::trace::FORMAT.to_string(),
        version: sim::trace::VERSION,
        seed,
        config,
        mlx_version: sim::mlx_version(),
        device: device.name().to_string(),
        mutant,
        ops,
        digests: vec![],
        result_hash: String::new(),
        outcome: Outcome::Fail {
            op_index,
            check: CRASH_CHECK.into(),
            message: format!("the worker process running this seed was {how} in op {op_index}"),
        },
        expect: sim::trace::Expect::Fail,
        note: format!("a worker process was {how} running seed {seed}: the ops it had started"),
    }
}

/// What merging needs beyond the summary: the campaign's seed range, the shard, every seed's result hash and the
/// summed counters. `kvsim sim --shard I/N --json` prints this (the summary's fields plus these); `kvsim merge` folds
/// parts back into the [`Summary`] an unsharded run prints.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Part {
    #[serde(flatten)]
    pub summary: Summary,
    pub first: u64,
    /// Seeds of the whole campaign (`first .. first + requested`), of which this part ran its shard's.
    pub requested: u64,
    pub shard: Option<Shard>,
    pub seed_hashes: Vec<SeedHash>,
    pub counters: Counters,
}

impl Part {
    /// The part of a summary (which must carry its seeds: [`Summary::seeds_run`]).
    pub fn of(summary: &Summary, first: u64, requested: u64, shard: Option<Shard>) -> Part {
        let seed_hashes = summary
            .seeds_run
            .iter()
            .zip(&summary.seed_hashes)
            .map(|(&seed, hash)| SeedHash { seed, hash: hash.clone() })
            .collect();
        Part { summary: summary.clone(), first, requested, shard, seed_hashes, counters: summary.counters.clone() }
    }

    /// Reads a part from a `kvsim sim --json` output (its last JSON line).
    pub fn from_output(name: &str, text: &str) -> Result<Part, ShardError> {
        let bad = |message: String| ShardError::BadPart { part: name.to_string(), message };
        let v = crate::shard::last_json_line(text).ok_or_else(|| bad("no JSON summary line".into()))?;
        serde_json::from_value(v)
            .map_err(|e| bad(format!("not a part of a sharded run (`kvsim sim --shard I/N --json`): {e}")))
    }
}

/// Folds parts into one summary: the same summary (every field but `seconds`, the slowest part's) and the same
/// `result_hash` as one run over all their seeds. Refuses parts of another device, MLX version or read mode, another
/// campaign range, and a seed run twice.
pub fn merge(parts: &[Part]) -> Result<Summary, ShardError> {
    let first = parts.first().ok_or(ShardError::Empty)?;
    let mut out = Summary {
        device: first.summary.device.clone(),
        mlx_version: first.summary.mlx_version.clone(),
        read_mode: first.summary.read_mode,
        ..Summary::default()
    };
    let mut hashes: Vec<SeedHash> = vec![];
    for p in parts {
        let s = &p.summary;
        for (what, a, b) in
            [("device", &first.summary.device, &s.device), ("mlx_version", &first.summary.mlx_version, &s.mlx_version)]
        {
            if a != b {
                return Err(ShardError::Mismatch { what, a: a.clone(), b: b.clone() });
            }
        }
        if s.read_mode != first.summary.read_mode {
            let mode = |m: Option<kvsim_cache::ReadMode>| format!("{:?}", m.unwrap_or(kvsim_cache::ReadMode::Fused));
            return Err(ShardError::Mismatch {
                what: "read_mode",
                a: mode(first.summary.read_mode),
                b: mode(s.read_mode),
            });
        }
        if (p.first, p.requested) != (first.first, first.requested) {
            return Err(ShardError::Mismatch {
                what: "campaign seeds (first, count)",
                a: format!("{:?}", (first.first, first.requested)),
                b: format!("{:?}", (p.first, p.requested)),
            });
        }
        if p.seed_hashes.len() as u64 != s.seeds {
            return Err(ShardError::BadPart {
                part: p.shard.map_or("(unsharded)".into(), |x| x.to_string()),
                message: format!("{} seeds but {} seed hashes", s.seeds, p.seed_hashes.len()),
            });
        }
        out.seeds += s.seeds;
        out.ops += s.ops;
        out.skipped_ops += s.skipped_ops;
        out.failures += s.failures;
        out.model_failures += s.model_failures;
        out.interrupted |= s.interrupted;
        out.crashed += s.crashed;
        out.seconds = out.seconds.max(s.seconds);
        for (k, v) in &s.ops_by_kind {
            *out.ops_by_kind.entry(k.clone()).or_insert(0) += v;
        }
        for (k, v) in &s.api_coverage {
            *out.api_coverage.entry(k.clone()).or_insert(0) += v;
        }
        for (k, v) in &s.api_runs {
            *out.api_runs.entry(k.clone()).or_insert(0) += v;
        }
        for (k, v) in &s.layouts {
            out.layouts.entry(k.clone()).or_default().add(v);
        }
        out.counters.add(&p.counters);
        out.failed_seeds.extend(s.failed_seeds.iter().cloned());
        hashes.extend(p.seed_hashes.iter().cloned());
    }
    crate::shard::campaign_hash(&mut hashes)?;
    out.failed_seeds.sort_by_key(|f| f.seed);
    out.seeds_run = hashes.iter().map(|h| h.seed).collect();
    out.seed_hashes = hashes.into_iter().map(|h| h.hash).collect();
    out.refresh();
    Ok(out)
}

/// The first of seeds `0..budget` whose run with mutant `m` armed fails (on CPU), with that run. Seeds whose config
/// cannot reach the mutant's hook ([`mutant_reachable`]) are skipped, not run: the catching seed is the same, the
/// hunt shorter.
pub fn hunt_mutant(m: Mutant, budget: u64) -> Option<(u64, RunResult)> {
    hunt_seeds(m, budget).find_map(|seed| {
        let r = sim::run_seed(seed, DeviceChoice::Cpu, Some(m));
        r.failed().then_some((seed, r))
    })
}

/// The seeds a hunt of mutant `m` runs, in order: those of `0..budget` that can reach its hook
/// ([`mutant_reachable`]).
pub fn hunt_seeds(m: Mutant, budget: u64) -> impl Iterator<Item = u64> {
    (0..budget).filter(move |&seed| mutant_reachable(m, &SimConfig::from_seed(seed)))
}

/// Whether a run of `cfg` can reach mutant `m`'s hook at all: a necessary condition read off the config alone (its
/// families, layout and op weights). `true` for the mutants without one. A condition that is wrong does not hide a
/// mutant: its hunt then goes on past the seed that would have caught it, and `cargo test` sees the survivor.
pub fn mutant_reachable(m: Mutant, cfg: &SimConfig) -> bool {
    use crate::sim::family::{attention, paged, quant, transition};
    let holds = |name: &str| cfg.families.iter().any(|f| f == name);
    match m {
        // `RowBatch::merge_planes` runs only in the attention families' merge op, and only a window leaves a row's
        // temporal slice shorter than its offset (linear rows' slices are their whole history).
        Mutant::MergeSlicesByOffset => {
            (holds(attention::NAME) || holds(quant::NAME))
                && cfg.layout.max_size().is_some()
                && cfg.weight(crate::sim::ops::OpKind::Merge) > 0
        }
        // Only rings drop an oversize; the attention and quantized families check their batch's capacity after every
        // op, the bf16-first family its rows' once they packed.
        Mutant::BatchRingKeepsOversize => {
            (holds(attention::NAME) || holds(quant::NAME) || holds(transition::NAME)) && cfg.layout.max_size().is_some()
        }
        // Only an encoder read reaches the encoder's mask, and only the quantized family converts.
        Mutant::EncoderWindowFromCache => cfg.weight(crate::sim::ops::OpKind::EncoderRead) > 0,
        Mutant::QuantConvertEmptyIgnoresStorage => {
            holds(quant::NAME) && cfg.weight(crate::sim::ops::OpKind::Quantize) > 0
        }
        // The bf16-first hooks live in `TransitioningKv` and its rows, which only these two families run.
        Mutant::TkvConvertUncommitted
        | Mutant::TkvPackBeforeAllConverted
        | Mutant::TkvRollbackDropsKept
        | Mutant::TkvFloorLostByExtract
        | Mutant::TkvEndPrefillLeavesDue
        | Mutant::TkvReuseBelowFloor
        | Mutant::TkvSplitMovesBoundary => holds(transition::NAME) || holds(transition::LEGO_NAME),
        // The rows' own calls: only the rows family runs `TransitioningKvRows` (`adopt`, the softcapped fetch).
        Mutant::TkvAdoptDropsBoundary | Mutant::TkvFetchConvertsFirstDue => holds(transition::NAME),
        // mlx-lm files whose recurrent layers differ, or whose empty layers do, are written only by the save/restore
        // op: the recurrent family's sets (`sim::family::ssm::persist`), the attention families' layer sets.
        Mutant::MlxlmSsmOffsetsFromFirst => {
            holds(crate::sim::family::ssm::NAME) && cfg.weight(crate::sim::ops::OpKind::Persist) > 0
        }
        Mutant::MlxlmEmptySpecFromFirst => cfg.weight(crate::sim::ops::OpKind::Persist) > 0,
        // The paged hooks live in `PagedStore`, which only the paged family runs.
        Mutant::PagedCowSkipped
        | Mutant::PagedRefLeak
        | Mutant::PagedDoubleFree
        | Mutant::PagedPartialMatch
        | Mutant::PagedEvictReferenced
        | Mutant::PagedRollbackKeepsTable
        | Mutant::PagedMatchIgnoresParent => holds(paged::NAME),
        // The paged family's prefill reads plain rows through the mask this hook picks; affine rows go one by one.
        Mutant::PagedPrefillCausalByLength => {
            paged::PagedChoice::of(cfg).is_some_and(|c| c.quant.is_none())
                && cfg.weight(crate::sim::ops::OpKind::Prepare) + cfg.weight(crate::sim::ops::OpKind::BatchPrefill) > 0
        }
        // Only an affine pool has scales and biases to copy.
        Mutant::PagedAffineCowPackedOnly => paged::PagedChoice::of(cfg).is_some_and(|c| c.quant.is_some()),
        _ => true,
    }
}

/// The seed budget of each mutant: the one table `kvsim mutants` (by default) and `cargo test` hunt with (README
/// "Mutation catalog" lists the measured catch seed).
pub fn mutant_budget(m: Mutant) -> u64 {
    match m {
        // The bf16-first mutants live in the two bf16-first families, which about two fifths of the seeds hold.
        // Measured catch seeds: 26, 2, 2 and 2.
        Mutant::TkvConvertUncommitted
        | Mutant::TkvPackBeforeAllConverted
        | Mutant::TkvRollbackDropsKept
        | Mutant::TkvFloorLostByExtract => 60,
        // Needs a chunked prefill cohort of the bf16-first rows that crosses `start` with a request that never
        // commits its chunks: measured catch seed 1 since an admission is followed by a prefill (`gen::FollowUp`;
        // 234 before, when only about one prefill in ten transition runs crossed `start` uncommitted).
        Mutant::TkvEndPrefillLeavesDue => 40,
        // Measured catch seed 41 (prefix reuse below the floor of a stored entry).
        Mutant::TkvReuseBelowFloor => 100,
        // Needs a prefill cohort whose planned chunk crosses `start` and is split: measured catch seed 1 since an
        // admission is followed by a prefill (40 before).
        Mutant::TkvSplitMovesBoundary => 40,
        // Needs an encoder read some query of which the encoder's window, not the cache's, decides (about one run in
        // seven, `encoder_read/window_decides`): measured catch seed 7.
        Mutant::EncoderWindowFromCache => 60,
        // Needs a conversion to other parameters than a quantized family already holds while a request holds no
        // position (`to_quantized/empty_beside_quantized`, about one run in six; the refusal is caught in about one
        // in eighteen): measured catch seed 9.
        Mutant::QuantConvertEmptyIgnoresStorage => 100,
        // Measured catch seeds with the current generator (README "Mutation catalog"): 2 and 4.
        Mutant::PrefillPadStored | Mutant::FilterPartialOnError => 60,
        // Measured catch seeds 4 (adopt) and 2 (the row phase, read by the `contract` check after every op).
        Mutant::AdoptDropsPhase | Mutant::RowPhaseIgnoresOversize => 60,
        // Needs a merge of windowed rows whose temporal slices are shorter than their offsets and than the widest
        // row's (a ring rolled back after it wrapped, beside a full one). Measured catch seed 856: the class is rare
        // (2 of seeds 0..300 before the paged family went to two fifths of the runs and the conversion op to every
        // run of the quantized family, 0 of 300 after), and those changes moved the runs that reached it (73
        // before them; 1460 before a solo window was followed by its rollback and a rollback by a merge,
        // `gen::FollowUp`). Only the seeds that can reach it run (`mutant_reachable`, about 57% of them).
        Mutant::MergeSlicesByOffset => 900,
        // The recurrent family's left-padding mutants: reached only by seeds that hold it (swarm probability 0.4)
        // with the `ssm` set and a left-padded prefill (measured catch seed 2 for both).
        Mutant::SsmMaskIgnoresLeftPadding | Mutant::SsmFilterShiftsEmptyPadding => 100,
        // Needs a run of the quantized family that starts plain and converts a ring after it wrapped (measured
        // catch seed 2).
        Mutant::QuantConvertTemporalOrder => 60,
        // Reached only by the save/restore op (about half the runs draw it) on a solo cache with spare capacity
        // (measured catch seed 10).
        Mutant::CodecSavesWholeBuffer => 60,
        // Needs a save of a request outside the batch that holds a position: its set of differing layers
        // (`sim::family::layer_set`) is the only save whose layers disagree. Measured catch seed 9.
        Mutant::FirstLayerBookkeeping => 40,
        // Reached by an adopt of bf16-first rows holding a row converted before its offset (measured catch seed 11,
        // 24 of seeds 0..300), a fetch after a merge or join that takes several bf16 rows past their boundary
        // (seed 2, 16 of 300), and the recurrent family's save of a set whose recurrent layers and empty layers
        // differ (seed 15 for both, 33 of 300).
        Mutant::TkvAdoptDropsBoundary
        | Mutant::TkvFetchConvertsFirstDue
        | Mutant::MlxlmSsmOffsetsFromFirst
        | Mutant::MlxlmEmptySpecFromFirst => 100,
        // The paged family's mutants: reached only by seeds that hold it (swarm probability 0.4); the hunt skips
        // the others (`mutant_reachable`).
        Mutant::PagedCowSkipped
        | Mutant::PagedRefLeak
        | Mutant::PagedDoubleFree
        | Mutant::PagedPartialMatch
        | Mutant::PagedEvictReferenced
        | Mutant::PagedRollbackKeepsTable
        | Mutant::PagedMatchIgnoresParent
        | Mutant::PagedAffineCowPackedOnly
        | Mutant::PagedPrefillCausalByLength => 100,
        _ => 20,
    }
}

/// One mutant's hunt (`kvsim mutants`): the first catching seed within the budget, the check that caught it, and
/// its shrunk trace.
#[derive(Debug, Clone, Serialize)]
pub struct MutantHunt {
    #[serde(skip)]
    pub mutant: Mutant,
    pub name: &'static str,
    pub caught: bool,
    /// Seeds run (the catching seed + 1, or the whole budget).
    pub seeds: u64,
    /// Wall seconds from the hunt's start to its catching seed's verdict (the whole budget's when it survived):
    /// the time a user waits for the catch. The shrink's are apart ([`MutantHunt::shrink_seconds`]).
    pub seconds_to_catch: f64,
    /// Wall seconds the shrink of the catching run took (0 when it survived).
    pub shrink_seconds: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub check: Option<String>,
    pub shrunk_ops: Option<usize>,
    #[serde(skip)]
    pub seed: Option<u64>,
    #[serde(skip)]
    pub shrunk: Option<crate::sim::trace::Trace>,
    /// The hunt's process died (`kvsim mutants` hunts in a worker process): how, in words. The mutant is then
    /// caught by the crash, at `seed`, check [`CRASH_CHECK`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub crash: Option<String>,
    /// Where the catching seed's trace was written (a crash's: the ops up to the one the process died in).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace: Option<String>,
}

impl MutantHunt {
    /// A hunt of `m` over `budget` seeds that caught nothing (yet).
    pub fn new(m: Mutant, budget: u64) -> MutantHunt {
        MutantHunt {
            mutant: m,
            name: m.name(),
            caught: false,
            seeds: budget,
            seconds_to_catch: 0.0,
            shrink_seconds: 0.0,
            check: None,
            shrunk_ops: None,
            seed: None,
            shrunk: None,
            crash: None,
            trace: None,
        }
    }

    /// The hunt in this process ([`hunt_mutant`], then the shrink of the catching run).
    pub fn run(m: Mutant, budget: u64, shrink_budget: usize) -> MutantHunt {
        let mut h = MutantHunt::new(m, budget);
        let start = std::time::Instant::now();
        let found = hunt_mutant(m, budget);
        h.seconds_to_catch = start.elapsed().as_secs_f64();
        if let Some((seed, r)) = found {
            let start = std::time::Instant::now();
            let shrunk = sim::shrink::shrink(&r.trace, DeviceChoice::Cpu, shrink_budget).ok().map(|s| s.trace);
            h.shrink_seconds = start.elapsed().as_secs_f64();
            h.caught = true;
            h.seeds = seed + 1;
            h.seed = Some(seed);
            h.check = Some(r.failure.as_ref().map(|f| f.failure.check.clone()).unwrap_or_default());
            h.shrunk_ops = Some(shrunk.as_ref().map_or(r.trace.ops.len(), |t| t.ops.len()));
            h.shrunk = shrunk;
        }
        h
    }

    /// The shrunk trace as a corpus entry (expected to fail, with a note naming the mutant).
    pub fn corpus_trace(&self) -> Option<crate::sim::trace::Trace> {
        self.shrunk.clone().map(|mut t| {
            t.expect = crate::sim::trace::Expect::Fail;
            t.note = format!("mutant {}: {}", self.name, self.mutant.describe());
            t
        })
    }

    pub fn line(&self) -> String {
        match (self.seed, &self.crash) {
            (Some(seed), Some(how)) => format!(
                "{:<26} caught  seed {:>4}  {:>6.1} s  [{CRASH_CHECK}] the hunt's process was {how} in op {}; trace {}",
                self.name,
                seed,
                self.seconds_to_catch,
                self.shrunk_ops.unwrap_or(0).saturating_sub(1),
                self.trace.as_deref().unwrap_or("(none)")
            ),
            (Some(seed), None) => format!(
                "{:<26} caught  seed {:>4}  {:>6.1} s  [{}]  shrunk to {} ops",
                self.name,
                seed,
                self.seconds_to_catch,
                self.check.as_deref().unwrap_or(""),
                self.shrunk_ops.unwrap_or(0)
            ),
            (None, _) => format!("{:<26} SURVIVED {} seeds in {:.1} s", self.name, self.seeds, self.seconds_to_catch),
        }
    }
}

/// Seconds to catch over a catalog's hunts: the median and the slowest (with its mutant), of the caught ones.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct CatchTimes {
    pub caught: usize,
    pub median_seconds: f64,
    pub slowest_seconds: f64,
    pub slowest: Option<&'static str>,
}

impl CatchTimes {
    pub fn of(hunts: &[MutantHunt]) -> CatchTimes {
        let mut caught: Vec<&MutantHunt> = hunts.iter().filter(|h| h.caught).collect();
        caught.sort_by(|a, b| a.seconds_to_catch.total_cmp(&b.seconds_to_catch));
        let n = caught.len();
        let median_seconds = match n {
            0 => 0.0,
            _ if n % 2 == 1 => caught[n / 2].seconds_to_catch,
            _ => (caught[n / 2 - 1].seconds_to_catch + caught[n / 2].seconds_to_catch) / 2.0,
        };
        CatchTimes {
            caught: n,
            median_seconds,
            slowest_seconds: caught.last().map_or(0.0, |h| h.seconds_to_catch),
            slowest: caught.last().map(|h| h.name),
        }
    }

    pub fn line(&self) -> String {
        format!(
            "time to catch: median {:.1} s, slowest {:.1} s ({}), over {} caught mutants",
            self.median_seconds,
            self.slowest_seconds,
            self.slowest.unwrap_or("none"),
            self.caught
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hunt(name: &'static str, caught: bool, seconds: f64) -> MutantHunt {
        MutantHunt {
            mutant: Mutant::ALL[0],
            name,
            caught,
            seeds: 1,
            seconds_to_catch: seconds,
            shrink_seconds: 0.0,
            check: None,
            shrunk_ops: None,
            seed: caught.then_some(0),
            shrunk: None,
            crash: None,
            trace: None,
        }
    }

    #[test]
    fn catch_times_are_the_median_and_slowest_of_the_caught_hunts() {
        let odd = [hunt("a", true, 3.0), hunt("b", true, 1.0), hunt("c", false, 99.0), hunt("d", true, 7.0)];
        let t = CatchTimes::of(&odd);
        assert_eq!((t.caught, t.median_seconds, t.slowest_seconds, t.slowest), (3, 3.0, 7.0, Some("d")));
        let even = [hunt("a", true, 4.0), hunt("b", true, 1.0)];
        assert_eq!(CatchTimes::of(&even).median_seconds, 2.5);
        let none = CatchTimes::of(&[hunt("a", false, 5.0)]);
        assert_eq!((none.caught, none.median_seconds, none.slowest), (0, 0.0, None));
        assert!(none.line().contains("over 0 caught"));
    }
}
