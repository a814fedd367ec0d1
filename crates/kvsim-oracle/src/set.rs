//! `kvsim oracle record` ([`record_set`]): the chosen seeds recorded on kvsim's side, driven through mlx-lm and
//! stored with the diff of each.

use std::path::Path;

use crate::choose::{choose_family_seeds, choose_seeds};
use crate::driver::{run_driver, setup_driver, strip_known_values};
use crate::record::{family_prefix, family_run, record};
use crate::recorder;
use crate::report::{check_dir, diff_recorded, recorded_traces};

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
