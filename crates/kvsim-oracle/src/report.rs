//! The recorded set (`oracles/recorded/NAME.trace.json` + `NAME.oracle.jsonl`), compared without Python: one
//! trace's comparison ([`diff_recorded`], [`TraceReport`]), the whole set's ([`check_dir`], [`CheckReport`]: per-rule
//! counts, steps uncompared per root, step kinds covered against [`STEP_KINDS`]), and the lines `kvsim oracle
//! diff` / `check` print.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use crate::diff::{diff_full, output_dtype, Divergence, Measure};
use crate::driver::{parse_results, parse_solo, parse_values};
use crate::record::record;
use crate::recorder::{self, Outcome, StepInfo};
use crate::rules::{Class, Rule, RESYNCED};
use kvsim_harness::sim::config::{DtypeChoice, SimConfig};
use kvsim_harness::sim::trace::Trace;

/// The comparison of one recorded trace.
pub struct TraceReport {
    pub name: String,
    pub config: SimConfig,
    pub steps: usize,
    /// Steps compared on their own (not explained by an earlier state-changing divergence; see [`diff_counted`](crate::diff_counted)).
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
        let shape = match (recorder::oracle_family(cfg), kvsim_harness::sim::family::quant::QuantChoice::of(cfg)) {
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
