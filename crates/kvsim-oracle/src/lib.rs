//! The differential oracle against mlx-lm (`oracles/PROTOCOL.md`, `oracles/README.md`).
//!
//! - [`record()`]: replays a kvsim trace with a [`Recorder`] in the runner, giving the protocol steps and kvsim's own
//!   result records.
//! - [`run_driver`]: runs the Python driver (`oracles/mlx_lm/driver.py`, in the venv `setup.sh` creates) on the
//!   steps and parses its results.
//! - [`diff()`]: compares kvsim's results with the oracle's, step by step, and classifies every divergence: a
//!   documented semantic choice, an mlx-lm bug of the catalog, an unsupported mapping, or **unclassified**. A
//!   divergence that changes state (a **root**) explains only what it touched (its requests, or the running batch
//!   and its rows until the batch is gone; a request until it finishes); everything else keeps being compared.
//!   Where the driver re-synced mlx-lm by replay (`PROTOCOL.md` decision 14), nothing is left to explain.
//! - [`check_dir`]: the recorded set (`oracles/recorded/NAME.trace.json` + `NAME.oracle.jsonl`, the driver's
//!   results), compared without Python.
#![cfg_attr(test, allow(clippy::print_stdout, clippy::print_stderr))]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

mod diff;
mod driver;
pub mod recorder;
mod rules;
pub mod teeth;

pub use diff::{diff, diff_counted, diff_full, diff_measured, output_dtype, Divergence, Measure};
pub use driver::{driver_dir, parse_results, parse_solo, parse_values, run_driver, setup_driver, strip_known_values};
pub use rules::{
    mlx_refuses_quant, padding_in_window_rows, Class, Rule, Verdict, READ_RULE_ULP_BF16, READ_RULE_ULP_F32, RESYNCED,
};

use crate::recorder::{Outcome, Record, Recorder, StepInfo, Values};
use kvsim_harness::sim::config::{DtypeChoice, SimConfig};
use kvsim_harness::sim::observe::Read;
use kvsim_harness::sim::trace::Trace;
use kvsim_harness::sim::DeviceChoice;

/// kvsim's side of one trace.
pub struct Recording {
    /// STEPS lines (empty unless recorded with `emit_steps`).
    pub steps: Vec<String>,
    pub infos: Vec<StepInfo>,
    pub results: Vec<Record>,
    /// The bytes of every read output, by sha256.
    pub values: Values,
}

impl Recording {
    pub fn steps_jsonl(&self) -> String {
        self.steps.iter().map(|l| format!("{l}\n")).collect()
    }
}

/// Replays `trace` on CPU with the recorder observing the run (the same run loop as `kvsim sim`): kvsim's steps
/// (when `emit_steps`) and result records. Every kvsim check still runs; a failing one is an error (only passing
/// traces are compared).
pub fn record(trace: &Trace, emit_steps: bool) -> Result<Recording, String> {
    if trace.mutant.is_some() {
        return Err("a mutant trace is not compared with the oracle".into());
    }
    let mut rec = Recorder::new(&trace.config, emit_steps);
    let r = kvsim_harness::sim::run_observed(
        trace.seed,
        trace.config.clone(),
        Some(trace.ops.clone()),
        DeviceChoice::Cpu,
        None,
        &mut rec,
    );
    if let kvsim_harness::sim::trace::Outcome::Fail { op_index, check, message } = &r.trace.outcome {
        let op = r.trace.ops.get(*op_index);
        return Err(format!("kvsim check failed at op {op_index} {op:?}: [{check}] {message}"));
    }
    Ok(Recording { steps: rec.steps, infos: rec.infos, results: rec.results, values: rec.values })
}

// ------------------------------------------------------------------------------------------------------------
// the recorded set
// ------------------------------------------------------------------------------------------------------------

/// The comparison of one recorded trace.
pub struct TraceReport {
    pub name: String,
    pub config: SimConfig,
    pub steps: usize,
    /// Steps compared on their own (not explained by an earlier state-changing divergence; see [`diff_counted`]).
    pub steps_compared: usize,
    /// The other steps, per rule of the root that explains them (`None`: an unclassified root).
    pub uncompared: BTreeMap<Option<Rule>, usize>,
    /// Steps where the driver re-synced mlx-lm by replay (PROTOCOL.md decision 14): its `trimmed_rows` records
    /// (a rolled-back recurrent round, a per-row trim) and the errors it re-synced after.
    pub resyncs: usize,
    /// Reads of quantized caches whose outputs agree byte for byte with mlx-lm's (`QuantizedKVCache` and
    /// `quantized_scaled_dot_product_attention`).
    pub quant_reads_agree: usize,
    /// Of those, the reads of quantized batch rows mapped row by row (`batch`, `prefill_chunk`; PROTOCOL.md decision
    /// 16), and the reads of quantized rings (the driver's `RotatingQuantizedKVCache`, decision 15).
    pub quant_batch_reads_agree: usize,
    pub quant_ring_reads_agree: usize,
    pub divergences: Vec<Divergence>,
    /// Protocol step kinds this trace exercised (`batch/decode`, `enter/join`, ...).
    pub kinds: BTreeSet<String>,
    /// Set when kvsim's side could not be recorded or the oracle results not read.
    pub error: Option<String>,
}

impl TraceReport {
    pub fn status(&self) -> &'static str {
        if self.error.is_some() || self.divergences.iter().any(|d| !d.class.is_classified()) {
            "unclassified"
        } else if self.divergences.is_empty() {
            "agree"
        } else {
            "classified"
        }
    }

    /// Rules that classified a divergence directly (not as a consequence).
    pub fn rules(&self) -> BTreeMap<Rule, usize> {
        let mut m = BTreeMap::new();
        for d in &self.divergences {
            if let Class::Rule(r) = d.class {
                *m.entry(r).or_insert(0) += 1;
            }
        }
        m
    }

    pub fn summary_line(&self) -> String {
        let cfg = &self.config;
        let shape = format!(
            "{:<4} {:<6} H {}/{} D {:<2} layers {}",
            match cfg.dtype {
                DtypeChoice::F32 => "f32",
                DtypeChoice::Bf16 => "bf16",
            },
            cfg.layout.max_size().map_or("linear".to_string(), |w| format!("W={w}")),
            cfg.heads_q,
            cfg.heads_kv,
            cfg.head_dim,
            cfg.layers
        );
        let rules: Vec<String> = self.rules().iter().map(|(r, n)| format!("{}x{n}", r.id())).collect();
        let consequences = self.divergences.iter().filter(|d| matches!(d.class, Class::Consequence { .. })).count();
        let shape = match (recorder::oracle_family(cfg), cfg.quant) {
            (Some("ssm"), _) => {
                let d = kvsim_harness::sim::family::ssm::SsmSet::of(cfg).dims;
                format!(
                    "{:<4} ssm K {} H {}/{} D {}/{}",
                    format!("{:?}", cfg.dtype).to_lowercase(),
                    d.kernel,
                    d.heads_k,
                    d.heads_v,
                    d.dk,
                    d.dv
                )
            }
            (Some("quant"), Some(q)) => format!(
                "{shape} quant {}:{} D {} {}",
                q.bits,
                q.group,
                q.head_dim,
                if q.native { "native" } else { "converted" }
            ),
            _ => shape,
        };
        let mut s = format!(
            "{:<16} {shape}  {:>5} steps ({} compared)  {}",
            self.name,
            self.steps,
            self.steps_compared,
            self.status()
        );
        if self.resyncs > 0 {
            s.push_str(&format!("  {} re-synced", self.resyncs));
        }
        if self.quant_reads_agree > 0 {
            s.push_str(&format!(
                "  {} quantized reads equal ({} batch, {} ring)",
                self.quant_reads_agree, self.quant_batch_reads_agree, self.quant_ring_reads_agree
            ));
        }
        if !rules.is_empty() {
            s.push_str(&format!("  {}", rules.join(" ")));
        }
        if consequences > 0 {
            s.push_str(&format!(" (+{consequences} consequences)"));
        }
        if let Some(e) = &self.error {
            s.push_str(&format!("  error: {e}"));
        }
        s
    }
}

/// The step kinds of a recording (`t`, with the read kind or the enter mode).
pub fn step_kinds(infos: &[StepInfo]) -> BTreeSet<String> {
    infos
        .iter()
        .map(|s| match (s.t, s.read) {
            ("solo" | "batch", Some(r)) => format!("{}/{}", s.t, r.name()),
            ("enter", _) => format!("enter/{}", s.how.unwrap_or("?")),
            (t, _) => t.to_string(),
        })
        .collect()
}

/// Compares one recorded trace (`NAME.trace.json` + `NAME.oracle.jsonl`).
pub fn diff_recorded(trace_path: &Path) -> TraceReport {
    let name =
        trace_path.file_name().and_then(|n| n.to_str()).unwrap_or("?").trim_end_matches(".trace.json").to_string();
    let fail = |config: SimConfig, e: String| TraceReport {
        name: name.clone(),
        config,
        steps: 0,
        steps_compared: 0,
        uncompared: BTreeMap::new(),
        resyncs: 0,
        quant_reads_agree: 0,
        quant_batch_reads_agree: 0,
        quant_ring_reads_agree: 0,
        divergences: vec![],
        kinds: BTreeSet::new(),
        error: Some(e),
    };
    let trace = match Trace::load(trace_path) {
        Ok(t) => t,
        Err(e) => return fail(SimConfig::from_seed(0), e.to_string()),
    };
    let oracle_path = trace_path.with_file_name(format!("{name}.oracle.jsonl"));
    let (oracle, oracle_values, solo) = match std::fs::read_to_string(&oracle_path)
        .map_err(|e| format!("{}: {e}", oracle_path.display()))
        .and_then(|t| Ok((parse_results(&t)?, parse_values(&t)?, parse_solo(&t)?)))
    {
        Ok(o) => o,
        Err(e) => return fail(trace.config.clone(), e),
    };
    let rec = match record(&trace, false) {
        Ok(r) => r,
        Err(e) => return fail(trace.config.clone(), e),
    };
    let measure =
        Measure { dtype: output_dtype(&trace.config), kvsim: &rec.values, oracle: &oracle_values, solo: &solo };
    let (divergences, steps_compared, uncompared) =
        diff_full(&rec.infos, &rec.results, &oracle, trace.config.layout.max_size(), Some(&measure));
    let kinds = step_kinds(&rec.infos);
    let oracle_rows: BTreeMap<usize, &Outcome> = oracle.iter().map(|r| (r.step, &r.outcome)).collect();
    let quant_equal: Vec<&StepInfo> = rec
        .results
        .iter()
        .filter(|r| matches!(r.outcome, Outcome::Rows(_)))
        .filter(|r| rec.infos.get(r.step).is_some_and(|i| i.quant.is_some()))
        .filter(|r| oracle_rows.get(&r.step) == Some(&&r.outcome))
        .filter_map(|r| rec.infos.get(r.step))
        .collect();
    let quant_reads_agree = quant_equal.len();
    let quant_batch_reads_agree = quant_equal.iter().filter(|i| matches!(i.t, "batch" | "prefill_chunk")).count();
    let quant_ring_reads_agree = if trace.config.layout.max_size().is_some() { quant_reads_agree } else { 0 };
    let resyncs = oracle
        .iter()
        .filter(|r| match &r.outcome {
            Outcome::TrimmedRows(_) | Outcome::Resynced { .. } => true,
            Outcome::Error(e) => e.contains(RESYNCED),
            _ => false,
        })
        .count();
    TraceReport {
        name,
        config: trace.config.clone(),
        steps: rec.infos.len(),
        steps_compared,
        uncompared,
        resyncs,
        quant_reads_agree,
        quant_batch_reads_agree,
        quant_ring_reads_agree,
        divergences,
        kinds,
        error: None,
    }
}

/// The recorded traces of `dir` (sorted by name).
pub fn recorded_traces(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.ends_with(".trace.json")))
        .collect();
    v.sort_by_key(|p| {
        let n = p.file_name().and_then(|n| n.to_str()).unwrap_or("").to_string();
        // numeric order of seed-N names
        let num: u64 = n.trim_start_matches("seed-").trim_end_matches(".trace.json").parse().unwrap_or(u64::MAX);
        (num, n)
    });
    Ok(v)
}

/// The whole recorded set.
pub struct CheckReport {
    pub traces: Vec<TraceReport>,
}

impl CheckReport {
    pub fn count(&self, status: &str) -> usize {
        self.traces.iter().filter(|t| t.status() == status).count()
    }

    /// `{"traces", "agree", "classified", "unclassified", "steps", "steps_compared"}` (steps summed over the traces).
    pub fn json_line(&self) -> String {
        format!(
            "{{\"traces\":{},\"agree\":{},\"classified\":{},\"unclassified\":{},\"steps\":{},\"steps_compared\":{}}}",
            self.traces.len(),
            self.count("agree"),
            self.count("classified"),
            self.count("unclassified"),
            self.traces.iter().map(|t| t.steps).sum::<usize>(),
            self.traces.iter().map(|t| t.steps_compared).sum::<usize>()
        )
    }

    /// Per rule: (divergences it classified directly, consequences classified with it, traces).
    pub fn rule_counts(&self) -> BTreeMap<Rule, (usize, usize, BTreeSet<String>)> {
        let mut m: BTreeMap<Rule, (usize, usize, BTreeSet<String>)> = BTreeMap::new();
        for t in &self.traces {
            for d in &t.divergences {
                match d.class {
                    Class::Rule(r) => {
                        let e = m.entry(r).or_default();
                        e.0 += 1;
                        e.2.insert(t.name.clone());
                    }
                    Class::Consequence { rule: Some(r), .. } => m.entry(r).or_default().1 += 1,
                    _ => {}
                }
            }
        }
        m
    }

    /// Steps left uncompared, per rule of the root that explains them, over all traces (`None`: unclassified).
    pub fn uncompared(&self) -> BTreeMap<Option<Rule>, usize> {
        let mut m = BTreeMap::new();
        for t in &self.traces {
            for (r, n) in &t.uncompared {
                *m.entry(*r).or_insert(0) += n;
            }
        }
        m
    }

    /// Step kinds over all traces.
    pub fn kinds(&self) -> BTreeSet<String> {
        self.traces.iter().flat_map(|t| t.kinds.iter().cloned()).collect()
    }
}

/// Every protocol step kind kvsim's runner can emit (the subset of the protocol the oracle supports that kvsim
/// uses; `solo/append` is never emitted: a solo window always reads).
pub const STEP_KINDS: &[&str] = &[
    "config",
    "admit",
    "solo/decode",
    "solo/window",
    "solo_trim",
    "enter/merge",
    "enter/join",
    "prefill",
    "prefill_chunk",
    "prefill_end",
    "batch/decode",
    "batch/window",
    "batch/append",
    "trim_rows",
    "trim",
    "extract",
    "filter",
    "quantize",
    "prepare",
    "finalize",
    "round",
    "checkpoint",
];

/// Compares every recorded trace of `dir`.
pub fn check_dir(dir: &Path) -> Result<CheckReport, String> {
    let traces = recorded_traces(dir)?.iter().map(|p| diff_recorded(p)).collect();
    Ok(CheckReport { traces })
}

// ------------------------------------------------------------------------------------------------------------
// choosing the recorded seeds
// ------------------------------------------------------------------------------------------------------------

/// What a recording exercises, for the choice of seeds: its step kinds, its dtype and layout, and the geometries
/// where kvsim and mlx-lm are expected to part (so that every rule and catalog bug gets a trace).
pub fn features(cfg: &SimConfig, infos: &[StepInfo]) -> BTreeSet<String> {
    // Only what comes before the first expected change of state is compared on its own (later divergences are
    // consequences), so only that part counts, plus the kind of that first change.
    let root = predicted_root(cfg, infos);
    let all = infos;
    let infos = &infos[..root.map_or(infos.len(), |(i, _)| i + 1)];
    let mut f = step_kinds(infos);
    if let Some((_, why)) = root {
        f.insert(format!("root/{why}"));
    }
    let wrapped_reads = infos.iter().any(|s| s.read.is_some() && s.wrapped);
    if root.is_none() && wrapped_reads {
        // Expected to agree byte for byte although its rings wrap.
        let dtype = match cfg.dtype {
            DtypeChoice::F32 => "f32",
            DtypeChoice::Bf16 => "bf16",
        };
        let one_position = infos.iter().any(|s| s.l == 1 && s.read == Some(Read::Window) && s.wrapped);
        if !one_position {
            f.insert(format!("clean-after-wrap/{dtype}"));
        }
    }
    let dtype = match cfg.dtype {
        DtypeChoice::F32 => "f32",
        DtypeChoice::Bf16 => "bf16",
    };
    let layout = if cfg.layout.max_size().is_some() { "rotating" } else { "linear" };
    f.insert(format!("config/{dtype}/{layout}"));
    let rotating = layout == "rotating";
    for s in infos {
        let one = s.l == 1 && s.read == Some(Read::Window);
        if rotating && one && s.wrapped {
            f.insert(format!("geometry/{}-one-position-window-after-wrap", s.t));
        }
        if s.t == "batch" && s.read == Some(Read::Decode) && s.wrapped {
            f.insert(format!("geometry/batch-decode-after-wrap/{dtype}"));
        }
        if s.t == "enter" && rotating && !s.emptied.is_empty() && s.nonempty > 0 {
            f.insert("geometry/merge-emptied-ring".into());
        }
        if s.t == "enter"
            && s.how == Some("join")
            && s.offsets.iter().any(|&o| cfg.layout.max_size().is_some_and(|w| o > w))
        {
            f.insert("geometry/join-wrapped-ring".into());
        }
        if s.t == "prefill_chunk" && rotating && s.l == 1 && s.padded {
            f.insert("geometry/padded-singleton-chunk".into());
        }
        if let Some(t) = &s.trim {
            let equal = t.n.iter().all(|&x| x == t.n[0]);
            if !equal {
                f.insert("geometry/per-row-trim".into());
            }
            if rotating && t.bypass && s.wrapped && t.kvsim.as_ref().is_ok_and(|&n| n > 0) && equal {
                f.insert(format!("geometry/{}-bypass-after-wrap", s.t));
            }
            if let Err(e) = &t.kvsim {
                f.insert(format!("geometry/{}-refused-{}", s.t, e.split([' ', '{', '(']).next().unwrap_or("")));
            }
        }
        if s.t == "prefill" && s.padded {
            f.insert(format!("geometry/right-padded-prefill/{layout}"));
        }
        let root_in_op = root.is_some_and(|(ri, _)| all[ri].op == s.op);
        if s.t == "prefill"
            && !root_in_op
            && cfg.layout.max_size().is_some_and(|w| !padding_in_window_rows(s, w).is_empty())
        {
            f.insert("geometry/prefill-padding-in-window".into());
        }
    }
    f
}

/// The first step where mlx-lm is expected to end up in another state than kvsim (a guess from kvsim's side
/// only, for the choice of seeds; the classification uses the oracle's results), and why.
pub fn predicted_root(cfg: &SimConfig, infos: &[StepInfo]) -> Option<(usize, &'static str)> {
    let w = cfg.layout.max_size();
    for (i, s) in infos.iter().enumerate() {
        if let Some(t) = &s.trim {
            let equal = t.n.iter().all(|&x| x == t.n[0]);
            let n = t.n.iter().copied().max().unwrap_or(0);
            match &t.kvsim {
                Ok(_) if !equal => return Some((i, "per-row-trim")),
                Ok(_) if n > 0 && w.is_some() && s.wrapped => return Some((i, "trim-after-wrap")),
                Err(_) if n > 0 && s.offsets.iter().all(|&o| o > 0) && !(w.is_some() && s.wrapped) => {
                    return Some((i, "trim-refused-by-kvsim"))
                }
                _ => {}
            }
        }
        if s.t == "prefill_chunk" && w.is_some() && s.l == 1 && s.padded {
            return Some((i, "padded-singleton-chunk"));
        }
        if s.t == "extract" && !s.batch_arrays {
            return Some((i, "extract-empty-batch"));
        }
    }
    None
}

/// Picks `count` seeds among `0..scan` (`include` first): a greedy cover of every [`features`] value (smaller traces first on ties),
/// then the smallest remaining traces round-robin over (dtype, layout), so that the set mixes f32/bf16 and
/// rotating/linear while staying small in bytes. Only passing seeds are chosen.
pub fn choose_seeds(count: usize, scan: u64, include: &[u64]) -> Result<Vec<u64>, String> {
    struct Cand {
        seed: u64,
        feats: BTreeSet<String>,
        size: usize,
        group: String,
    }
    let mut cands = vec![];
    for seed in 0..scan {
        let r = kvsim_harness::sim::run_seed(seed, DeviceChoice::Cpu, None);
        if r.failed() {
            continue;
        }
        let rec = match record(&r.trace, false) {
            Ok(x) => x,
            Err(_) => continue,
        };
        let cfg = &r.trace.config;
        let feats = features(cfg, &rec.infos);
        let size: usize = rec.results.iter().map(|r| r.to_json().to_string().len() + 1).sum();
        let group = feats.iter().find(|f| f.starts_with("config/")).cloned().unwrap_or_default();
        cands.push(Cand { seed, feats, size, group });
    }
    if cands.is_empty() {
        return Err(format!("no passing seed in 0..{scan}"));
    }
    let mut chosen: Vec<u64> = include.to_vec();
    let mut covered: BTreeSet<String> = BTreeSet::new();
    for c in cands.iter().filter(|c| include.contains(&c.seed)) {
        covered.extend(c.feats.iter().cloned());
    }
    loop {
        let best = cands
            .iter()
            .filter(|c| !chosen.contains(&c.seed))
            .map(|c| (c.feats.difference(&covered).count(), c))
            .filter(|(n, _)| *n > 0)
            .max_by(|(n1, c1), (n2, c2)| n1.cmp(n2).then(c2.size.cmp(&c1.size)));
        match best {
            Some((_, c)) if chosen.len() < count => {
                covered.extend(c.feats.iter().cloned());
                chosen.push(c.seed);
            }
            _ => break,
        }
    }
    let mut groups: BTreeMap<String, Vec<&Cand>> = BTreeMap::new();
    for c in cands.iter().filter(|c| !chosen.contains(&c.seed)) {
        groups.entry(c.group.clone()).or_default().push(c);
    }
    for g in groups.values_mut() {
        g.sort_by_key(|c| (c.size, c.seed));
        g.reverse();
    }
    while chosen.len() < count && groups.values().any(|g| !g.is_empty()) {
        for g in groups.values_mut() {
            if chosen.len() >= count {
                break;
            }
            if let Some(c) = g.pop() {
                chosen.push(c.seed);
            }
        }
    }
    chosen.sort();
    Ok(chosen)
}

// ------------------------------------------------------------------------------------------------------------
// recording a set
// ------------------------------------------------------------------------------------------------------------

/// The run of `seed` whose calls the oracle records for `family`: for `attention` the seed's swarm run (the
/// recorder watches its attention family); for another family of [`recorder::ORACLE_FAMILIES`] the seed's
/// configuration with that family alone (`None` when the seed's swarm draw does not hold it: its parameters, e.g.
/// the quantized family's bits and group, come from that draw), without the kinds listed below. `None` too when the
/// run fails or holds an op whose writes the recorder does not describe (a prepared prefill into running rows, a
/// bidirectional prefill).
pub fn family_run(seed: u64, family: &str) -> Option<kvsim_harness::sim::RunResult> {
    let r = if family == "attention" {
        kvsim_harness::sim::run_seed(seed, DeviceChoice::Cpu, None)
    } else {
        let mut cfg = SimConfig::from_seed(seed);
        if !cfg.families.iter().any(|f| f == family) {
            return None;
        }
        // The recurrent family is recorded in its `ssm` set only (two DeltaNet layers; the hybrid sets' attention
        // layers are not described).
        if family == "ssm" && kvsim_harness::sim::family::ssm::SsmSet::of(&cfg).name != "ssm" {
            return None;
        }
        cfg.families = vec![family.to_string()];
        // The other families' own kinds (training forwards, the bf16-first family's reads) touch none of this
        // family's caches, and the recorder does not describe the writes of a prepared prefill into running rows
        // or of a bidirectional prefill: none is drawn.
        use kvsim_harness::sim::ops::OpKind;
        if cfg.weight(OpKind::Admit) == 0 {
            // A family of the full draw supported none of the inference kinds (the training family's runs draw
            // only its forwards): this family's run takes every kind at its base weight.
            for w in cfg.weights.iter_mut() {
                w.1 = w.0.base_weight();
            }
        }
        for w in cfg.weights.iter_mut() {
            if w.0.is_training() || w.0.is_transition() || matches!(w.0, OpKind::Prepare | OpKind::BidirPrefill) {
                w.1 = 0;
            }
        }
        // The conversion op is drawn when the family's parameters say so (a family of the full draw that does not
        // support it had switched it off).
        if let (Some(q), true) = (cfg.quant, family == "quant") {
            match cfg.weights.iter_mut().find(|w| w.0 == OpKind::Quantize) {
                Some(w) => w.1 = w.1.max(q.convert_weight),
                None => cfg.weights.push((OpKind::Quantize, q.convert_weight)),
            }
        }
        kvsim_harness::sim::run(seed, cfg, None, DeviceChoice::Cpu, None)
    };
    let undescribed = |op: &kvsim_harness::sim::ops::Op| {
        matches!(op, kvsim_harness::sim::ops::Op::Prepare { .. } | kvsim_harness::sim::ops::Op::BidirPrefill { .. })
    };
    (!r.failed() && (family == "attention" || !r.trace.ops.iter().any(undescribed))).then_some(r)
}

/// The file-name prefix of a family's recorded traces (`seed-N` for the attention family, `quant-seed-N`, ...).
pub fn family_prefix(family: &str) -> String {
    if family == "attention" {
        "seed-".into()
    } else {
        format!("{family}-seed-")
    }
}

/// What a quantized-family recording covers besides [`features`]: its parameters, native or converted, the
/// conversion and where each quantized rule's geometry occurs (from kvsim's side only). For a recurrent-family
/// recording (its layer calls carry row spans): right / left-padded prepares, padded calls, enter, extract, filter,
/// committed and rolled-back rounds.
pub fn quant_features(cfg: &SimConfig, infos: &[StepInfo]) -> BTreeSet<String> {
    let mut f = BTreeSet::new();
    if infos.iter().any(|s| !s.spans.is_empty()) {
        // A recurrent-family recording: what it covers (its caches are not quantized).
        for s in infos {
            let what = match s.t {
                "prepare" if s.left.iter().any(|&l| l > 0) => "ssm/prepare-left",
                "prepare" => "ssm/prepare-right",
                "enter" | "extract" | "filter" | "finalize" => s.t,
                "round" if s.keep.iter().all(|&k| k == s.l) => "ssm/round-commit",
                "round" => "ssm/round-rollback",
                "solo" | "batch" => {
                    if s.spans.iter().any(|&(a, b)| b - a != s.l) {
                        "ssm/padded-call"
                    } else {
                        "ssm/full-call"
                    }
                }
                _ => continue,
            };
            f.insert(if what.starts_with("ssm/") { what.to_string() } else { format!("ssm/{what}") });
        }
        return f;
    }
    let Some(q) = cfg.quant else { return f };
    let layout = if cfg.layout.max_size().is_some() { "rotating" } else { "linear" };
    f.insert(format!("quant/bits-{}", q.bits));
    f.insert(format!("quant/group-{}", q.group));
    f.insert(format!("quant/{layout}/{}", if q.native { "native" } else { "converted" }));
    if layout == "linear" && matches!(q.bits, 5 | 6) && q.head_dim * q.bits / 32 != q.head_dim / (32 / q.bits) {
        // mlx-lm's packed-width crash: a QuantizedKVCache created quantized (native, or admitted after the conversion)
        f.insert("quant/packed-width".into());
    }
    for s in infos {
        match s.t {
            "quantize" => {
                let (b, g) = s.target.unwrap_or_default();
                let kind = if mlx_refuses_quant(b, g, s.head_dim) {
                    "invalid"
                } else if s.quant.is_some() {
                    "already"
                } else if s.batch_live {
                    "with-batch"
                } else {
                    "solo"
                };
                f.insert(format!("quant/convert-{kind}/{layout}"));
            }
            "solo" | "batch" | "prefill_chunk" if s.quant.is_some() => {
                f.insert(format!("quant/{}-read/{layout}", s.t));
            }
            "enter" | "prefill" if s.quant.is_some() => {
                f.insert(format!("quant/{}-quantized/{layout}", s.t));
            }
            _ => {}
        }
    }
    f
}

/// Seeds for a family's recorded set: among `0..scan`, the runs [`family_run`] gives, a greedy cover of
/// [`features`] and [`quant_features`] (fewer steps first on ties), then the smallest remaining ones.
pub fn choose_family_seeds(family: &str, count: usize, scan: u64) -> Result<Vec<u64>, String> {
    let mut cands: Vec<(u64, BTreeSet<String>, usize)> = vec![];
    for seed in 0..scan {
        let Some(r) = family_run(seed, family) else { continue };
        let Ok(rec) = record(&r.trace, false) else { continue };
        let mut feats = features(&r.trace.config, &rec.infos);
        feats.extend(quant_features(&r.trace.config, &rec.infos));
        cands.push((seed, feats, rec.infos.len()));
    }
    if cands.is_empty() {
        return Err(format!("no passing {family} seed in 0..{scan}"));
    }
    let mut chosen: Vec<u64> = vec![];
    let mut covered: BTreeSet<String> = BTreeSet::new();
    while chosen.len() < count {
        let best = cands
            .iter()
            .filter(|c| !chosen.contains(&c.0))
            .map(|c| (c.1.difference(&covered).count(), c))
            .filter(|(n, _)| *n > 0)
            .max_by(|(n1, c1), (n2, c2)| n1.cmp(n2).then(c2.2.cmp(&c1.2)));
        let Some((_, c)) = best else { break };
        covered.extend(c.1.iter().cloned());
        chosen.push(c.0);
    }
    let mut rest: Vec<&(u64, BTreeSet<String>, usize)> = cands.iter().filter(|c| !chosen.contains(&c.0)).collect();
    rest.sort_by_key(|c| (c.2, c.0));
    chosen.extend(rest.iter().take(count.saturating_sub(chosen.len())).map(|c| c.0));
    chosen.sort();
    Ok(chosen)
}

/// `kvsim oracle record`: records `seeds` (or, when empty, a fresh choice of `count` seeds among `0..scan` that
/// replaces the recorded set in `out`): kvsim's side, the mlx-lm driver's results, and the diff of each. Every
/// line to show goes to `log` (`true` = an error line). Returns whether every seed was recorded.
#[allow(clippy::too_many_arguments)]
pub fn record_set(
    family: &str,
    count: usize,
    scan: u64,
    seeds: &[u64],
    include: &[u64],
    out: &Path,
    keep_steps: bool,
    log: &mut dyn FnMut(bool, String),
) -> Result<bool, String> {
    if !recorder::ORACLE_FAMILIES.contains(&family) {
        return Err(format!("the oracle maps the families {:?}, not {family:?}", recorder::ORACLE_FAMILIES));
    }
    let python = setup_driver()?;
    let explicit = !seeds.is_empty();
    let seeds: Vec<u64> = match (explicit, family) {
        (true, _) => seeds.to_vec(),
        (false, "attention") => choose_seeds(count, scan, include)?,
        (false, _) => choose_family_seeds(family, count, scan)?,
    };
    let prefix = family_prefix(family);
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    if !explicit {
        // A fresh choice replaces the family's recorded traces.
        for p in recorded_traces(out).unwrap_or_default() {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("").trim_end_matches(".trace.json").to_string();
            if name.strip_prefix(&prefix).is_none_or(|n| n.parse::<u64>().is_err()) {
                continue;
            }
            let _ = std::fs::remove_file(&p);
            let _ = std::fs::remove_file(out.join(format!("{name}.oracle.jsonl")));
        }
    }
    let work = std::env::temp_dir().join(format!("kvsim-oracle-{}", std::process::id()));
    let mut all = true;
    for seed in seeds {
        let name = format!("{prefix}{seed}");
        match record_one(family, seed, &name, &python, &work, out, keep_steps) {
            Ok(line) => log(false, line),
            Err(e) => {
                log(true, format!("{name}: {e}"));
                all = false;
            }
        }
    }
    let _ = std::fs::remove_dir_all(&work);
    if let Ok(report) = check_dir(out) {
        log(
            false,
            format!(
                "recorded set {}: {} traces, {} agree, {} classified, {} unclassified",
                out.display(),
                report.traces.len(),
                report.count("agree"),
                report.count("classified"),
                report.count("unclassified")
            ),
        );
    }
    Ok(all)
}

/// `kvsim oracle redrive`: re-runs the driver over the traces recorded in `dir` whose name starts with `prefix`
/// (the traces are kept; each `NAME.oracle.jsonl` is rewritten). Whether every trace went through.
pub fn redrive_set(
    dir: &Path,
    prefix: &str,
    keep_steps: Option<&Path>,
    log: &mut dyn FnMut(bool, String),
) -> Result<bool, String> {
    let python = setup_driver()?;
    let work = std::env::temp_dir().join(format!("kvsim-oracle-{}", std::process::id()));
    let mut all = true;
    for tp in recorded_traces(dir)? {
        let name = tp.file_name().and_then(|n| n.to_str()).unwrap_or("").trim_end_matches(".trace.json").to_string();
        if !name.starts_with(prefix) {
            continue;
        }
        let one = || -> Result<String, String> {
            let trace = Trace::load(&tp).map_err(|e| e.to_string())?;
            let rec = record(&trace, true)?;
            let (_, text) = run_driver(&python, &rec.steps_jsonl(), &work, &name)?;
            if let Some(k) = keep_steps {
                let _ = std::fs::create_dir_all(k);
                let _ = std::fs::write(k.join(format!("{name}.steps.jsonl")), rec.steps_jsonl());
            }
            std::fs::write(dir.join(format!("{name}.oracle.jsonl")), strip_known_values(&text, &rec.values))
                .map_err(|e| e.to_string())?;
            Ok(diff_recorded(&tp).summary_line())
        };
        match one() {
            Ok(line) => log(false, line),
            Err(e) => {
                log(true, format!("{name}: {e}"));
                all = false;
            }
        }
    }
    let _ = std::fs::remove_dir_all(&work);
    let report = check_dir(dir)?;
    log(false, report.json_line());
    Ok(all)
}

/// Records one seed into `out`; the diff's summary line.
fn record_one(
    family: &str,
    seed: u64,
    name: &str,
    python: &Path,
    work: &Path,
    out: &Path,
    keep_steps: bool,
) -> Result<String, String> {
    let r = family_run(seed, family).ok_or_else(|| {
        format!("no {family} run of seed {seed} to record (not in its swarm draw, failing, or undescribed ops)")
    })?;
    let mut trace = r.trace;
    trace.note = "oracle: recorded against mlx-lm 0.32.2 (kvsim oracle record)".into();
    let rec = record(&trace, true)?;
    let (_, text) = run_driver(python, &rec.steps_jsonl(), work, name)?;
    if keep_steps {
        let _ = std::fs::write(out.join(format!("{name}.steps.jsonl")), rec.steps_jsonl());
    }
    let tp = out.join(format!("{name}.trace.json"));
    let op = out.join(format!("{name}.oracle.jsonl"));
    std::fs::write(&tp, serde_json::to_string(&trace).unwrap() + "\n")
        .and_then(|_| std::fs::write(&op, strip_known_values(&text, &rec.values)))
        .map_err(|e| e.to_string())?;
    Ok(diff_recorded(&tp).summary_line())
}

/// `kvsim oracle record --dry-run`: the chosen seeds, each with the geometry and config features it covers.
pub fn describe_choice(
    family: &str,
    count: usize,
    scan: u64,
    include: &[u64],
) -> Result<Vec<(u64, Vec<String>)>, String> {
    let seeds = if family == "attention" {
        choose_seeds(count, scan, include)?
    } else {
        choose_family_seeds(family, count, scan)?
    };
    Ok(seeds
        .into_iter()
        .map(|s| {
            let feats = family_run(s, family)
                .and_then(|r| {
                    record(&r.trace, false).ok().map(|rec| {
                        let mut f = features(&r.trace.config, &rec.infos);
                        f.extend(quant_features(&r.trace.config, &rec.infos));
                        f
                    })
                })
                .unwrap_or_default();
            let shown = |f: &String| {
                f.starts_with("geometry/")
                    || f.starts_with("config/")
                    || f.starts_with("quant/")
                    || f.starts_with("ssm/")
            };
            (s, feats.into_iter().filter(shown).collect())
        })
        .collect())
}

// ------------------------------------------------------------------------------------------------------------
// report lines (`kvsim oracle diff` / `check` print them)
// ------------------------------------------------------------------------------------------------------------

impl TraceReport {
    /// One line pair per divergence: step, op, what, class, detail.
    pub fn divergence_lines(&self) -> Vec<String> {
        self.divergences
            .iter()
            .map(|d| {
                format!(
                    "  step {:>5}  op {:>3} {:<13} {:<34} {}\n             {}",
                    d.step,
                    d.op,
                    d.op_kind,
                    d.what,
                    d.class.describe(),
                    match d.ulp {
                        Some(u) => format!("{} (max {u} ULP at output scale)", d.detail),
                        None => d.detail.clone(),
                    }
                )
            })
            .collect()
    }

    /// `kvsim oracle diff`'s report.
    pub fn diff_lines(&self) -> Vec<String> {
        let mut lines = vec![format!("{}: {} steps, {} divergences", self.name, self.steps, self.divergences.len())];
        lines.extend(self.divergence_lines());
        for (r, n) in self.rules() {
            lines.push(format!("  {} x{n} [{}]: {}", r.id(), r.verdict().name(), r.reason()));
        }
        lines.push(self.summary_line());
        lines
    }
}

impl CheckReport {
    /// `kvsim oracle check`'s report: each trace (with its divergences when unclassified), the rules, the step kinds
    /// covered and the totals.
    pub fn lines(&self) -> Vec<String> {
        let mut lines = vec![];
        for t in &self.traces {
            lines.push(t.summary_line());
            if t.status() == "unclassified" {
                lines.extend(t.divergence_lines());
            }
        }
        lines.push("rules:".into());
        for (r, (n, c, traces)) in self.rule_counts() {
            let names: Vec<&str> = traces.iter().take(6).map(|s| s.as_str()).collect();
            lines.push(format!(
                "  {:<32} {:<26} {:>4} divergences, {:>4} consequences, {:>3} traces (e.g. {})",
                r.id(),
                r.verdict().name(),
                n,
                c,
                traces.len(),
                names.join(", ")
            ));
        }
        let steps: usize = self.traces.iter().map(|t| t.steps).sum();
        let compared: usize = self.traces.iter().map(|t| t.steps_compared).sum();
        lines.push(format!(
            "steps compared on their own: {compared} of {steps}; the others, by the rule of their root:"
        ));
        let mut by_rule: Vec<(Option<Rule>, usize)> = self.uncompared().into_iter().collect();
        by_rule.sort_by_key(|&(r, n)| (std::cmp::Reverse(n), r));
        for (r, n) in by_rule {
            lines.push(format!("  {:<32} {n:>5} steps", r.map_or("(unclassified root)", |r| r.id())));
        }
        let kinds = self.kinds();
        let missing: Vec<&str> = STEP_KINDS.iter().copied().filter(|k| !kinds.contains(*k)).collect();
        lines.push(format!(
            "step kinds covered: {}/{}{}",
            STEP_KINDS.len() - missing.len(),
            STEP_KINDS.len(),
            if missing.is_empty() { String::new() } else { format!(" (missing: {})", missing.join(", ")) }
        ));
        lines.push(format!(
            "kvsim oracle check: {} traces, {} agree, {} classified, {} unclassified",
            self.traces.len(),
            self.count("agree"),
            self.count("classified"),
            self.count("unclassified")
        ));
        lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::diff::{detail, layout_of, show};
    use crate::recorder::TrimInfo;

    fn info(t: &'static str, reqs: &[u32]) -> StepInfo {
        StepInfo { t, reqs: reqs.to_vec(), ..Default::default() }
    }

    fn rec(step: usize, outcome: Outcome) -> Record {
        Record { step, outcome }
    }

    fn rows(h: &str) -> Outcome {
        Outcome::Rows(vec![h.to_string()])
    }

    /// Every rule names its layouts; a rule never classifies on a layout it does not name.
    #[test]
    fn rules_name_their_layouts() {
        for r in Rule::ALL {
            assert!(!r.layouts().is_empty(), "{} names no layout", r.id());
        }
        assert!(!Rule::OnePositionWindow.layouts().contains(&"linear"), "linear caches never wrap");
        assert!(!Rule::RowLayout.layouts().contains(&"ssm"));
        let quantize = StepInfo { t: "quantize", ..Default::default() };
        assert_eq!(layout_of(Some(&quantize), Some(4), false), "quant-ring");
        assert_eq!(layout_of(None, None, false), "linear");
        assert_eq!(layout_of(None, Some(4), true), "ssm");
    }

    /// `vals` must hash to their row's sha256: a file whose bytes were changed is refused, never measured; `solo`
    /// is read per step; the stored file keeps mlx-lm's bytes only where kvsim has none of the same hash.
    #[test]
    fn values_are_checked_against_their_hashes() {
        use base64::Engine;
        let bytes = vec![0u8, 0, 128, 63];
        let h = recorder::sha_hex(&bytes);
        let b64 = base64::engine::general_purpose::STANDARD.encode(&bytes);
        let good = format!("{{\"step\":3,\"rows\":[\"{h}\"],\"vals\":[\"{b64}\"],\"solo\":[\"{h}\"]}}\n");
        assert_eq!(parse_values(&good).unwrap().get(&h), Some(&bytes));
        assert_eq!(parse_solo(&good).unwrap()[&3], vec![Some(h.clone())]);
        let bad = good.replace(&b64, &base64::engine::general_purpose::STANDARD.encode([0u8, 0, 128, 191]));
        assert!(parse_values(&bad).unwrap_err().contains("do not hash"));
        assert!(parse_values("{\"step\":1,\"rows\":[\"a\"],\"vals\":[\"a\",\"b\"]}").is_err());
        let mut known = Values::new();
        assert!(strip_known_values(&good, &known).contains("vals"));
        known.insert(h.clone(), bytes.clone());
        assert!(!strip_known_values(&good, &known).contains("vals"));
        // Measured: one f32 element 1.0 vs 1.0 + 2 ULP.
        let other = vec![2u8, 0, 128, 63];
        let h2 = recorder::sha_hex(&other);
        let oracle: Values = [(h2.clone(), other)].into_iter().collect();
        let solo = BTreeMap::new();
        let m = Measure { dtype: mlx_rs::Dtype::Float32, kvsim: &known, oracle: &oracle, solo: &solo };
        assert_eq!(m.ulp(&h, &h2), Some(2));
        assert_eq!(m.ulp(&h, "unknown"), None);
    }

    /// A bug-18 rollback of the running batch (step 5), the batch filtered away (step 8) with `filter_outcome` as
    /// the driver's answer, then a new batch (steps 9-11). Returns the diff's divergences, compared count and
    /// uncompared steps per rule.
    fn batch_root_then_new_batch(
        filter_outcome: Option<Outcome>,
    ) -> (Vec<Divergence>, usize, BTreeMap<Option<Rule>, usize>) {
        let trim = TrimInfo { n: vec![1], bypass: true, kvsim: Ok(1), after_window: true, live: vec![5] };
        let mut trim_step = info("trim_rows", &[1]);
        trim_step.trim = Some(trim);
        trim_step.wrapped = true;
        let mut decode = info("batch", &[1]);
        decode.read = Some(Read::Decode);
        decode.l = 1;
        let mut filter = info("filter", &[1]);
        filter.keep = vec![];
        filter.rows_left = 0;
        let mut decode3 = decode.clone();
        decode3.reqs = vec![3];
        let infos = vec![
            info("config", &[]),
            info("admit", &[1]),
            info("admit", &[2]),
            info("enter", &[1]),
            decode.clone(),
            trim_step,
            decode,
            {
                let mut s = info("solo", &[2]);
                s.read = Some(Read::Decode);
                s.l = 1;
                s
            },
            filter,
            info("admit", &[3]),
            info("enter", &[3]),
            decode3,
        ];
        let kvsim = vec![
            rec(4, rows("a")),
            rec(5, Outcome::Trimmed(1)),
            rec(6, rows("b")),
            rec(7, rows("c")),
            rec(11, rows("d")),
        ];
        let mut oracle = vec![
            rec(4, rows("a")),
            rec(5, Outcome::Trimmed(0)),
            rec(6, rows("B")),
            rec(7, rows("c")),
            rec(11, rows("d")),
        ];
        if let Some(o) = filter_outcome {
            oracle.push(rec(8, o));
        }
        diff_measured(&infos, &kvsim, &oracle, Some(4))
    }

    /// A quantized batch of requests 1 and 2 mapped row by row (PROTOCOL.md decision 16): `step` at index 4, then a
    /// batch decode where request 1's row differs and request 2's agrees.
    fn rows_mapped_then_decode(
        step: StepInfo,
        k: Outcome,
        o: Outcome,
    ) -> (Vec<Divergence>, usize, BTreeMap<Option<Rule>, usize>) {
        let q = |mut s: StepInfo| {
            s.quant = Some((6, 64));
            s.head_dim = 128;
            s
        };
        let mut decode = q(info("batch", &[1, 2]));
        decode.read = Some(Read::Decode);
        decode.l = 1;
        decode.offsets = vec![6, 3];
        let infos = vec![
            q(info("config", &[])),
            q(info("admit", &[1])),
            q(info("admit", &[2])),
            q(info("enter", &[1, 2])),
            q(step),
            decode,
        ];
        let two = |a: &str, b: &str| Outcome::Rows(vec![a.to_string(), b.to_string()]);
        let kvsim = vec![rec(4, k), rec(5, two("a", "b"))];
        let oracle = vec![rec(4, o), rec(5, two("A", "b"))];
        diff_measured(&infos, &kvsim, &oracle, Some(4))
    }

    #[test]
    fn a_row_mapped_trim_explains_only_its_differing_rows() {
        let mut trim = info("trim_rows", &[1, 2]);
        trim.trim = Some(TrimInfo { n: vec![1, 1], bypass: true, kvsim: Ok(1), after_window: true, live: vec![4, 3] });
        trim.offsets = vec![5, 3];
        let (out, compared, uncompared) =
            rows_mapped_then_decode(trim, Outcome::TrimmedRows(vec![1, 1]), Outcome::TrimmedRows(vec![0, 1]));
        assert_eq!(out.len(), 1, "{out:?}");
        assert_eq!(out[0].class, Class::Rule(Rule::TrimNoopAfterWrap));
        // The decode is compared on request 2's row alone (request 1's row is explained).
        assert_eq!(compared, 5);
        assert!(uncompared.is_empty(), "{uncompared:?}");
        // A row that mlx-lm trimmed as kvsim did, while another was refused before the window: not bug catalog #18.
        let mut trim = info("trim_rows", &[1, 2]);
        trim.trim = Some(TrimInfo { n: vec![1, 1], bypass: true, kvsim: Ok(1), after_window: true, live: vec![3, 3] });
        trim.offsets = vec![3, 3];
        let (out, _, _) =
            rows_mapped_then_decode(trim, Outcome::TrimmedRows(vec![1, 1]), Outcome::TrimmedRows(vec![0, 1]));
        assert_eq!(out[0].class, Class::Unclassified);
    }

    #[test]
    fn a_row_mapped_crash_explains_only_its_row() {
        let mut read = info("batch", &[1, 2]);
        read.read = Some(Read::Window);
        read.l = 2;
        read.offsets = vec![0, 0];
        let crash = "error: ValueError: [broadcast_shapes] Shapes (1,2,2,24) and (1,2,2,25) cannot be broadcast.";
        let k = Outcome::Rows(vec!["a".into(), "b".into()]);
        let (out, compared, _) =
            rows_mapped_then_decode(read.clone(), k.clone(), Outcome::Rows(vec![crash.into(), "b".into()]));
        assert_eq!(out.len(), 1, "{out:?}");
        assert_eq!(out[0].class, Class::Rule(Rule::QuantPackedWidth));
        assert_eq!(compared, 5);
        // The other row differing too: not the packed-width crash alone.
        let (out, _, _) = rows_mapped_then_decode(read, k, Outcome::Rows(vec![crash.into(), "B".into()]));
        assert_eq!(out[0].class, Class::Unclassified);
    }

    #[test]
    fn a_batch_root_ends_when_the_batch_is_gone() {
        let (out, compared, uncompared) = batch_root_then_new_batch(None);
        assert_eq!(out[0].class, Class::Rule(Rule::TrimNoopAfterWrap));
        assert!(matches!(out[1].class, Class::Consequence { root: 5, .. }));
        // Steps 6 (the batch's read) and 8 (its filter) are explained; the solo request and the new batch are not.
        assert_eq!(uncompared, BTreeMap::from([(Some(Rule::TrimNoopAfterWrap), 2)]));
        assert_eq!(compared, 11 - 2);
    }

    #[test]
    fn a_batch_root_stays_when_the_driver_may_hold_other_rows() {
        // The filter failed inside mlx-lm: the driver's rows are unknown, the new batch stays explained.
        let (_, compared, uncompared) = batch_root_then_new_batch(Some(Outcome::Error("ValueError: boom".into())));
        assert_eq!(uncompared, BTreeMap::from([(Some(Rule::TrimNoopAfterWrap), 4)]));
        assert_eq!(compared, 11 - 4);
        // A DriverError is raised before the driver changes anything: the driver still holds the request (its
        // batch was not filtered), so the batch's scope stays too.
        let (_, _, uncompared) =
            batch_root_then_new_batch(Some(Outcome::Error("DriverError: no running batch".into())));
        assert_eq!(uncompared, BTreeMap::from([(Some(Rule::TrimNoopAfterWrap), 4)]));
    }

    #[test]
    fn a_request_that_joined_an_explained_batch_is_compared_again_once_the_taint_has_left() {
        let trim = TrimInfo { n: vec![1], bypass: true, kvsim: Ok(1), after_window: true, live: vec![5] };
        let mut trim_step = info("trim_rows", &[1]);
        trim_step.trim = Some(trim);
        trim_step.wrapped = true;
        let decode = |reqs: &[u32]| {
            let mut d = info("batch", reqs);
            d.read = Some(Read::Decode);
            d.l = 1;
            d
        };
        let mut extract = info("extract", &[1]);
        (extract.row, extract.finish, extract.rows_left) = (Some(0), true, 1);
        let infos = vec![
            info("config", &[]),
            info("admit", &[1]),
            info("enter", &[1]),
            trim_step,
            info("admit", &[3]),
            info("enter", &[3]),
            decode(&[1, 3]),
            extract,
            decode(&[3]),
        ];
        let kvsim = vec![rec(3, Outcome::Trimmed(1)), rec(6, rows("a")), rec(8, rows("b"))];
        let oracle = vec![rec(3, Outcome::Trimmed(0)), rec(6, rows("A")), rec(8, rows("b"))];
        let (out, compared, uncompared) = diff_measured(&infos, &kvsim, &oracle, Some(4));
        assert_eq!(out.len(), 2, "{out:?}");
        // Explained: the join of request 3 into the explained batch, the batch read and the extract of request 1;
        // the read of request 3 alone after that is compared.
        assert_eq!(uncompared, BTreeMap::from([(Some(Rule::TrimNoopAfterWrap), 3)]));
        assert_eq!(compared, 8 - 3);
    }

    #[test]
    fn a_replayed_rollback_explains_nothing() {
        let trim = TrimInfo { n: vec![2], bypass: true, kvsim: Ok(2), after_window: true, live: vec![5] };
        let mut t = info("solo_trim", &[1]);
        t.trim = Some(trim);
        t.wrapped = true;
        let mut read = info("solo", &[1]);
        read.read = Some(Read::Decode);
        read.l = 1;
        let infos = vec![info("config", &[]), info("admit", &[1]), t, read];
        let kvsim = vec![rec(2, Outcome::Trimmed(2)), rec(3, rows("a"))];
        for (replayed, explained) in [(2, 0), (1, 1)] {
            let oracle = vec![rec(2, Outcome::Resynced { trimmed: 0, replayed }), rec(3, rows("b"))];
            let (out, _, uncompared) = diff_measured(&infos, &kvsim, &oracle, Some(4));
            assert_eq!(uncompared.values().sum::<usize>(), explained, "replayed {replayed}: {out:?}");
            if replayed == 2 {
                // Bug catalog #18 stays visible; the read after it is compared (and here unclassified: it differs).
                assert_eq!(out[0].class, Class::Rule(Rule::TrimNoopAfterWrap));
                assert_eq!(out[1].class, Class::Unclassified);
            }
        }
    }

    #[test]
    fn short_or_odd_hashes_in_results_do_not_panic() {
        let (a, b) = (rows("é"), Outcome::Rows(vec!["ü".repeat(20)]));
        assert!(detail(Some(&a), Some(&b)).contains("row 0"));
        assert!(show(Some(&b)).starts_with("rows [üüüüüüüü]"));
    }

    #[test]
    fn resync_records_parse_without_panics() {
        let r = Record::parse(r#"{"step":3,"trimmed":0,"resynced":2}"#).unwrap();
        assert_eq!(r.outcome, Outcome::Resynced { trimmed: 0, replayed: 2 });
        assert_eq!(Record::parse(&r.to_json().to_string()).unwrap(), r);
        let r = Record::parse(r#"{"step":4,"trimmed_rows":[0,2,1]}"#).unwrap();
        assert_eq!(r.outcome, Outcome::TrimmedRows(vec![0, 2, 1]));
        for bad in [
            r#"{"step":4,"trimmed_rows":[0,-2]}"#,
            r#"{"step":4,"trimmed_rows":"x"}"#,
            r#"{"step":4,"trimmed":0,"resynced":"x"}"#,
        ] {
            assert!(Record::parse(bad).is_err(), "{bad}");
        }
    }
}
