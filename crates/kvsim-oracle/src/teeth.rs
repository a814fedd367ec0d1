//! `kvsim oracle teeth`: the oracle's own teeth, measured. Every mutant of the catalog (`cache::mutation`) is armed
//! in turn and kvsim's side of every recorded trace is re-run **with kvsim's own checks off**
//! (`sim::check::checks_off`: a comparison that finds a difference lets the op go on), then compared with the stored
//! mlx-lm results exactly as `oracle check` does. A mutant is caught by the oracle alone when some trace then holds a
//! divergence no rule classifies.
//!
//! The comparison uses the *clean* run's step infos (the geometry a correct kvsim saw), so no rule's predicate leans
//! on what the mutant made kvsim believe; the mutated run supplies only the results (outputs, views, trims). Two
//! things end a trace's comparison early, and both are reported: a step where the mutated run made another call than
//! the clean one (the mutant changed the calls themselves), and an op that stopped on a check that cannot be switched
//! off (production refused a legal op, a panic): the steps before it are compared.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use crate::recorder::{Record, Recorder, StepInfo, Values};
use crate::{
    diff_full, output_dtype, parse_results, parse_solo, parse_values, record, recorded_traces, Class, Measure,
};
use kvsim_cache::faults::Mutant;
use kvsim_harness::sim::trace::{Outcome, Trace};
use kvsim_harness::sim::DeviceChoice;

/// One mutant over the recorded set.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MutantTeeth {
    pub name: String,
    /// Traces where the mutant changed a result kvsim reports through the calls mlx-lm has.
    pub changed_traces: usize,
    /// Traces that hold a divergence no rule classifies: the oracle alone caught the mutant there.
    pub unclassified_traces: usize,
    /// Traces where kvsim's own checks (switched off) found a difference.
    pub kvsim_checks_fired: usize,
    /// Traces whose comparison stopped early: the calls changed, or an op stopped on a check that stays on.
    pub cut_short: usize,
    /// Traces where the mutant changed a result at a step the clean run agreed on with mlx-lm (so the oracle sees
    /// a new divergence there); `changed_traces` less these changed only steps the clean run already differed on or
    /// had explained by a root.
    pub visible_traces: usize,
    /// Rules that classified the changed divergences of traces that stayed classified (how a mutant got absorbed).
    pub absorbed_by: BTreeMap<String, usize>,
    /// The first traces where it was caught.
    pub caught_in: Vec<String>,
    /// Why `unclassified_traces` is what it is.
    pub reason: String,
}

/// A trace ready to be compared: the trace, mlx-lm's stored results and bytes, and the clean run.
struct Loaded {
    name: String,
    trace: Trace,
    oracle: Vec<Record>,
    known: Values,
    solo: BTreeMap<usize, Vec<Option<String>>>,
    clean: crate::Recording,
}

fn load(dir: &Path) -> Result<Vec<Loaded>, String> {
    let mut out = vec![];
    for tp in recorded_traces(dir)? {
        let name = tp.file_name().and_then(|n| n.to_str()).unwrap_or("?").trim_end_matches(".trace.json").to_string();
        let trace = Trace::load(&tp).map_err(|e| format!("{name}: {e}"))?;
        let text = std::fs::read_to_string(tp.with_file_name(format!("{name}.oracle.jsonl")))
            .map_err(|e| format!("{name}: {e}"))?;
        let oracle = parse_results(&text).map_err(|e| format!("{name}: {e}"))?;
        let clean = record(&trace, false).map_err(|e| format!("{name}: {e}"))?;
        // mlx-lm's bytes: its own stored ones, and kvsim's clean ones where the hashes are equal.
        let mut known = parse_values(&text).map_err(|e| format!("{name}: {e}"))?;
        known.extend(clean.values.iter().map(|(k, v)| (k.clone(), v.clone())));
        let solo = parse_solo(&text).map_err(|e| format!("{name}: {e}"))?;
        out.push(Loaded { name, trace, oracle, known, solo, clean });
    }
    Ok(out)
}

/// The same call: a step of the mutated run matches the clean run's.
fn same_call(a: &StepInfo, b: &StepInfo) -> bool {
    (a.t, a.op, &a.reqs, a.l, a.layer, a.read) == (b.t, b.op, &b.reqs, b.l, b.layer, b.read)
}

/// What one trace under one mutant showed.
struct One {
    changed: bool,
    visible: bool,
    unclassified: bool,
    fired: bool,
    /// The calls changed at this step (the comparison stops there).
    calls_changed: Option<usize>,
    /// An op stopped on a check that stays on: `[check] message`.
    stopped: Option<String>,
    /// The rules of the classified divergences the clean run does not have.
    absorbed: BTreeSet<String>,
}

/// One trace under `mutant` with the checks off.
fn one(t: &Loaded, mutant: Mutant) -> One {
    let mut rec = Recorder::new(&t.trace.config, false);
    let (r, fired) = kvsim_harness::sim::check::checks_off(|| {
        kvsim_harness::sim::run_observed(
            t.trace.seed,
            t.trace.config.clone(),
            Some(t.trace.ops.clone()),
            DeviceChoice::Cpu,
            Some(mutant),
            &mut rec,
        )
    });
    // Where the comparison stops: the first step whose call differs from the clean run's, or the first step of an
    // op that stopped on a check that stays on.
    let mut cut = rec.infos.len().min(t.clean.infos.len());
    let calls_changed = (0..cut)
        .find(|&i| !same_call(&rec.infos[i], &t.clean.infos[i]))
        .or((rec.infos.len() != t.clean.infos.len() && matches!(r.trace.outcome, Outcome::Pass)).then_some(cut));
    if let Some(i) = calls_changed {
        cut = i;
    }
    let mut stopped = None;
    if let Outcome::Fail { op_index, check, message } = &r.trace.outcome {
        stopped = Some(format!("[{check}] {message}"));
        if let Some(i) = t.clean.infos.iter().position(|s| s.op >= *op_index && s.t != "config") {
            cut = cut.min(i);
        }
    }
    let keep = |rs: &[Record]| -> Vec<Record> { rs.iter().filter(|r| r.step < cut).cloned().collect() };
    let (kv, clean_kv, oracle) = (keep(&rec.results), keep(&t.clean.results), keep(&t.oracle));
    let by_step = |rs: &[Record]| -> BTreeMap<usize, crate::recorder::Outcome> {
        rs.iter().map(|r| (r.step, r.outcome.clone())).collect()
    };
    let (kvm, cleanm, om) = (by_step(&kv), by_step(&clean_kv), by_step(&oracle));
    let changed = kvm != cleanm;
    // A changed result where the clean run agreed with mlx-lm: a new divergence the oracle must judge.
    let visible = (0..cut).any(|s| kvm.get(&s) != cleanm.get(&s) && cleanm.get(&s) == om.get(&s));
    let measure = Measure { dtype: output_dtype(&t.trace.config), kvsim: &rec.values, oracle: &t.known, solo: &t.solo };
    let window = t.trace.config.layout.max_size();
    let infos = &t.clean.infos[..cut];
    let (divs, _, _) = diff_full(infos, &kv, &oracle, window, Some(&measure));
    let unclassified = divs.iter().any(|d| !d.class.is_classified());
    let clean_measure = Measure { dtype: measure.dtype, kvsim: &t.clean.values, oracle: &t.known, solo: &t.solo };
    let (clean_divs, _, _) = diff_full(infos, &clean_kv, &oracle, window, Some(&clean_measure));
    let before: BTreeSet<(usize, Option<&'static str>)> =
        clean_divs.iter().map(|d| (d.step, d.class.rule().map(|r| r.id()))).collect();
    let absorbed = divs
        .iter()
        .filter(|d| !before.contains(&(d.step, d.class.rule().map(|r| r.id()))))
        .filter_map(|d| match d.class {
            Class::Unclassified => None,
            _ => d.class.rule().map(|r| r.id().to_string()),
        })
        .collect();
    One {
        changed,
        visible,
        unclassified,
        fired: !fired.is_empty() || stopped.is_some(),
        calls_changed,
        stopped,
        absorbed,
    }
}

/// `kvsim oracle teeth` over the recorded set in `dir`, for `mutants` (every mutant of the catalog when empty).
/// `log` gets one line per mutant as it finishes.
pub fn teeth(dir: &Path, mutants: &[Mutant], log: &mut dyn FnMut(String)) -> Result<Vec<MutantTeeth>, String> {
    let set = load(dir)?;
    let mutants: Vec<Mutant> = if mutants.is_empty() { Mutant::ALL.to_vec() } else { mutants.to_vec() };
    let mut out = vec![];
    for m in mutants {
        let mut row = MutantTeeth {
            name: m.name().to_string(),
            changed_traces: 0,
            unclassified_traces: 0,
            kvsim_checks_fired: 0,
            cut_short: 0,
            visible_traces: 0,
            absorbed_by: BTreeMap::new(),
            caught_in: vec![],
            reason: String::new(),
        };
        let (mut calls, mut stops) = (vec![], vec![]);
        for t in &set {
            let o = one(t, m);
            row.changed_traces += o.changed as usize;
            row.visible_traces += o.visible as usize;
            row.unclassified_traces += o.unclassified as usize;
            row.kvsim_checks_fired += o.fired as usize;
            row.cut_short += (o.calls_changed.is_some() || o.stopped.is_some()) as usize;
            if let Some(s) = o.stopped {
                stops.push(format!("{}: {s}", t.name));
            }
            if let Some(s) = o.calls_changed {
                calls.push(format!("{} step {s}", t.name));
            }
            if o.visible && !o.unclassified {
                for r in o.absorbed {
                    *row.absorbed_by.entry(r).or_insert(0) += 1;
                }
            }
            if o.unclassified && row.caught_in.len() < 5 {
                row.caught_in.push(t.name.clone());
            }
        }
        row.reason = reason(m, &row, set.len(), &calls, &stops);
        log(format!(
            "{:<36} changed {:>3}  unclassified {:>3}  kvsim checks {:>3}  cut short {:>3}  {}",
            row.name, row.changed_traces, row.unclassified_traces, row.kvsim_checks_fired, row.cut_short, row.reason
        ));
        out.push(row);
    }
    Ok(out)
}

fn reason(m: Mutant, row: &MutantTeeth, traces: usize, calls: &[String], stops: &[String]) -> String {
    if row.unclassified_traces > 0 {
        return format!("caught by the oracle alone in {} of {traces} traces", row.unclassified_traces);
    }
    if row.visible_traces > 0 {
        let rules: Vec<String> = row.absorbed_by.iter().map(|(r, n)| format!("{r} x{n}")).collect();
        return format!(
            "NOT CAUGHT: in {} traces kvsim now differs from mlx-lm where it agreed, and every such divergence was \
             classified ({})",
            row.visible_traces,
            if rules.is_empty() { "as consequences of earlier roots".into() } else { rules.join(", ") }
        );
    }
    if !calls.is_empty() {
        return format!(
            "kvsim's calls themselves change in {} traces (first: {}): the simulator routes by what the mutated \
             cache reports, so the recorded steps no longer describe the run; the oracle compares the steps before \
             that ({}), and no result there changed. kvsim's own checks fired in {} traces",
            calls.len(),
            calls[0],
            m.describe(),
            row.kvsim_checks_fired
        );
    }
    if !stops.is_empty() {
        return format!(
            "an op stops on a check that cannot be switched off in {} traces (first: {}), before any result mlx-lm \
             sees changed ({})",
            stops.len(),
            stops[0].chars().take(200).collect::<String>(),
            m.describe()
        );
    }
    if row.changed_traces > 0 {
        return format!(
            "its changes ({} traces) fall only on steps where the clean run already differs from mlx-lm or that an \
             earlier root explains (uncompared), so mlx-lm has nothing to say there ({}); kvsim's own checks fired \
             in {} traces",
            row.changed_traces,
            m.describe(),
            row.kvsim_checks_fired
        );
    }
    let where_ = match m.layout() {
        "persist" => {
            "persistence (save / load): the protocol has no save or load step, so mlx-lm sees the caches only \
                      as they come back"
                .to_string()
        }
        _ => format!("{} ({})", m.describe(), m.layout()),
    };
    format!(
        "not visible through mlx-lm's API on the recorded set: no result kvsim reports changed ({where_}); kvsim's \
         own checks fired in {} traces",
        row.kvsim_checks_fired
    )
}

/// The JSON line `kvsim oracle teeth --json` ends with.
pub fn json_line(rows: &[MutantTeeth]) -> String {
    serde_json::json!({ "mutants": rows }).to_string()
}
