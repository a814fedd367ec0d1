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

use crate::cache::mutation::{self, Mutant};
use crate::oracle::recorder::{Record, Recorder, StepInfo, Values};
use crate::oracle::{
    diff_full, output_dtype, parse_results, parse_solo, parse_values, record, recorded_traces, Class, Measure,
};
use crate::sim::trace::{Outcome, Trace};
use crate::sim::DeviceChoice;

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
    clean: crate::oracle::Recording,
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

/// One trace under `mutant` with the checks off: (changed, unclassified, kvsim checks fired, cut short, the rules
/// of the classified divergences the clean run does not have).
fn one(t: &Loaded, mutant: Mutant) -> (bool, bool, bool, bool, BTreeSet<String>) {
    let mut rec = Recorder::new(&t.trace.config, false);
    let (r, fired) = crate::sim::check::checks_off(|| {
        crate::sim::run_observed(
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
    if let Some(i) = (0..cut).find(|&i| !same_call(&rec.infos[i], &t.clean.infos[i])) {
        cut = i;
    }
    if let Outcome::Fail { op_index, .. } = &r.trace.outcome {
        if let Some(i) = t.clean.infos.iter().position(|s| s.op >= *op_index && s.t != "config") {
            cut = cut.min(i);
        }
    }
    let full = cut == t.clean.infos.len() && rec.infos.len() == t.clean.infos.len();
    let keep = |rs: &[Record]| -> Vec<Record> { rs.iter().filter(|r| r.step < cut).cloned().collect() };
    let (kv, clean_kv, oracle) = (keep(&rec.results), keep(&t.clean.results), keep(&t.oracle));
    let changed = kv != clean_kv || !full;
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
    (changed, unclassified, !fired.is_empty() || !matches!(r.trace.outcome, Outcome::Pass), !full, absorbed)
}

/// `kvsim oracle teeth` over the recorded set in `dir`, for `mutants` (every mutant of the catalog when empty).
/// `log` gets one line per mutant as it finishes.
pub fn teeth(dir: &Path, mutants: &[Mutant], log: &mut dyn FnMut(String)) -> Result<Vec<MutantTeeth>, String> {
    if !mutation::ENABLED {
        return Err("kvsim was built without the `mutants` feature: no mutant can be armed".into());
    }
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
            absorbed_by: BTreeMap::new(),
            caught_in: vec![],
            reason: String::new(),
        };
        for t in &set {
            let (changed, unclassified, fired, cut, absorbed) = one(t, m);
            row.changed_traces += changed as usize;
            row.unclassified_traces += unclassified as usize;
            row.kvsim_checks_fired += fired as usize;
            row.cut_short += cut as usize;
            if changed && !unclassified {
                for r in absorbed {
                    *row.absorbed_by.entry(r).or_insert(0) += 1;
                }
            }
            if unclassified && row.caught_in.len() < 5 {
                row.caught_in.push(t.name.clone());
            }
        }
        row.reason = reason(m, &row, set.len());
        log(format!(
            "{:<36} changed {:>3}  unclassified {:>3}  kvsim checks {:>3}  cut short {:>3}  {}",
            row.name, row.changed_traces, row.unclassified_traces, row.kvsim_checks_fired, row.cut_short, row.reason
        ));
        out.push(row);
    }
    Ok(out)
}

fn reason(m: Mutant, row: &MutantTeeth, traces: usize) -> String {
    if row.unclassified_traces > 0 {
        return format!("caught by the oracle alone in {} of {traces} traces", row.unclassified_traces);
    }
    if row.changed_traces == 0 {
        let where_ = match m.layout() {
            "persist" => "persistence (save / load), which no recorded trace exercises: mlx-lm's cache API has no \
                          counterpart in the protocol"
                .to_string(),
            _ => format!("{} ({})", m.describe(), m.layout()),
        };
        return format!(
            "not visible through mlx-lm's API on the recorded set: no result kvsim reports changed ({where_}); \
             kvsim's own checks fired in {} traces",
            row.kvsim_checks_fired
        );
    }
    let rules: Vec<String> = row.absorbed_by.iter().map(|(r, n)| format!("{r} x{n}")).collect();
    format!(
        "NOT CAUGHT: kvsim's results changed in {} traces, all classified ({})",
        row.changed_traces,
        if rules.is_empty() { "the changed steps were explained by earlier roots".into() } else { rules.join(", ") }
    )
}

/// The JSON line `kvsim oracle teeth --json` ends with.
pub fn json_line(rows: &[MutantTeeth]) -> String {
    serde_json::json!({ "mutants": rows }).to_string()
}
