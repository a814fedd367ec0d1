//! The Python driver (`oracles/mlx_lm/driver.py`): where it lives ([`driver_dir`]), its venv ([`setup_driver`]),
//! running it on a recording's STEPS ([`run_driver`]), and the protocol's RESULTS read and written back: records
//! ([`parse_results`]), output bytes checked against their hashes ([`parse_values`]), mlx-lm's own solo hashes
//! ([`parse_solo`]), and the stored file less the bytes kvsim already holds ([`strip_known_values`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::recorder::{self, Record, Values};

/// `oracles/mlx_lm` (the current directory's when it has one, else this crate's).
pub fn driver_dir() -> PathBuf {
    let local = Path::new("oracles/mlx_lm");
    if local.join("driver.py").is_file() {
        return local.to_path_buf();
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../oracles/mlx_lm")
}

/// Creates the driver's venv if needed (`setup.sh`, idempotent; offline once set up). Returns its python.
pub fn setup_driver() -> Result<PathBuf, String> {
    let dir = driver_dir();
    let out = std::process::Command::new("bash")
        .arg(dir.join("setup.sh"))
        .output()
        .map_err(|e| format!("cannot run {}/setup.sh: {e}", dir.display()))?;
    if !out.status.success() {
        return Err(format!(
            "setup.sh failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(dir.join(".venv/bin/python"))
}

/// Runs the driver on `steps` (JSON Lines) and parses its results. `work` is a scratch directory.
pub fn run_driver(python: &Path, steps: &str, work: &Path, name: &str) -> Result<(Vec<Record>, String), String> {
    std::fs::create_dir_all(work).map_err(|e| format!("{}: {e}", work.display()))?;
    let sp = work.join(format!("{name}.steps.jsonl"));
    let rp = work.join(format!("{name}.oracle.jsonl"));
    std::fs::write(&sp, steps).map_err(|e| format!("{}: {e}", sp.display()))?;
    let out = std::process::Command::new(python)
        .arg(driver_dir().join("driver.py"))
        .arg(&sp)
        .arg(&rp)
        .output()
        .map_err(|e| format!("cannot run the driver: {e}"))?;
    if !out.status.success() {
        return Err(format!("driver exited {:?}: {}", out.status.code(), String::from_utf8_lossy(&out.stderr)));
    }
    let text = std::fs::read_to_string(&rp).map_err(|e| format!("{}: {e}", rp.display()))?;
    let _ = std::fs::remove_file(&sp);
    let _ = std::fs::remove_file(&rp);
    Ok((parse_results(&text)?, text))
}

/// Parses a RESULTS file.
pub fn parse_results(text: &str) -> Result<Vec<Record>, String> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| Record::parse(l).map_err(|e| format!("line {}: {e}", i + 1)))
        .collect()
}

/// The output bytes a RESULTS file carries (`vals` beside `rows`, PROTOCOL.md "Results"), by their sha256. Each is
/// checked against the hash of its row: a file whose bytes do not match its hashes is refused, never measured.
pub fn parse_values(text: &str) -> Result<Values, String> {
    let mut out = Values::new();
    for (i, l) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(l).map_err(|e| format!("line {}: not JSON: {e}", i + 1))?;
        let (Some(rows), Some(vals)) = (v.get("rows"), v.get("vals")) else { continue };
        let (Some(rows), Some(vals)) = (rows.as_array(), vals.as_array()) else {
            return Err(format!("line {}: rows and vals must be lists", i + 1));
        };
        if rows.len() != vals.len() {
            return Err(format!("line {}: {} rows, {} vals", i + 1, rows.len(), vals.len()));
        }
        for (h, b) in rows.iter().zip(vals) {
            let Some(b) = b.as_str() else { continue };
            let bytes = base64::Engine::decode(&base64::engine::general_purpose::STANDARD, b)
                .map_err(|e| format!("line {}: vals: {e}", i + 1))?;
            let sha = recorder::sha_hex(&bytes);
            if h.as_str() != Some(sha.as_str()) {
                return Err(format!("line {}: vals do not hash to their row's sha256", i + 1));
            }
            out.insert(sha, bytes);
        }
    }
    Ok(out)
}

/// The driver's RESULTS with the `vals` kvsim's own recording already holds removed (a row whose hash equals one of
/// kvsim's outputs has exactly those bytes): what is stored keeps mlx-lm's bytes only where they are news.
pub fn strip_known_values(text: &str, kvsim: &Values) -> String {
    let mut out = String::with_capacity(text.len());
    for l in text.lines() {
        let mut v: serde_json::Value = match serde_json::from_str(l) {
            Ok(v) => v,
            Err(_) => {
                out.push_str(l);
                out.push('\n');
                continue;
            }
        };
        let rows: Vec<Option<String>> = v
            .get("rows")
            .and_then(|r| r.as_array())
            .map(|r| r.iter().map(|h| h.as_str().map(str::to_string)).collect())
            .unwrap_or_default();
        if let Some(vals) = v.get_mut("vals").and_then(|x| x.as_array_mut()) {
            for (val, h) in vals.iter_mut().zip(&rows) {
                if h.as_ref().is_some_and(|h| kvsim.contains_key(h) || h == recorder::EMPTY_SHA) {
                    *val = serde_json::Value::Null;
                }
            }
            if vals.iter().all(|x| x.is_null()) {
                v.as_object_mut().map(|o| o.remove("vals"));
            }
        }
        out.push_str(&v.to_string());
        out.push('\n');
    }
    out
}

/// The `solo` hashes a RESULTS file carries beside a batch read's `rows` (PROTOCOL.md decision 17), by step.
pub fn parse_solo(text: &str) -> Result<BTreeMap<usize, Vec<Option<String>>>, String> {
    let mut out = BTreeMap::new();
    for (i, l) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(l).map_err(|e| format!("line {}: not JSON: {e}", i + 1))?;
        let Some(solo) = v.get("solo") else { continue };
        let step = v.get("step").and_then(|s| s.as_u64()).ok_or_else(|| format!("line {}: no step", i + 1))?;
        let rows = solo.as_array().ok_or_else(|| format!("line {}: solo must be a list", i + 1))?;
        out.insert(step as usize, rows.iter().map(|h| h.as_str().map(str::to_string)).collect());
    }
    Ok(out)
}
