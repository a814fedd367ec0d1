//! `kvsim oracle redrive` ([`redrive_set`]): the driver re-run over the traces already recorded (kvsim's side
//! re-recorded, each `NAME.oracle.jsonl` rewritten, the traces kept).

use std::path::Path;

use crate::driver::{run_driver, setup_driver, strip_known_values};
use crate::record::record;
use crate::report::{check_dir, diff_recorded, recorded_traces};
use kvsim_harness::sim::trace::Trace;

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
