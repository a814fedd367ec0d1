//! The mlx-lm reproducers `kvsim check-engine` wrote (`oracles/mlx_lm/repros/`): each class's shortest trace parses
//! as a failing engine trace, and each reproducer, run with mlx-lm 0.32.2, exits 1 and prints its divergence. The
//! scripts need the venv `oracles/mlx_lm/setup.sh` creates; without it they are skipped with the reason printed.
use std::path::Path;

use kvsim::sim::trace::{Expect, Outcome, Trace};

fn repros() -> Vec<std::path::PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("oracles/mlx_lm/repros");
    let mut out: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "py"))
        .collect();
    out.sort();
    out
}

#[test]
fn every_class_has_a_failing_trace_beside_its_reproducer() {
    let scripts = repros();
    assert!(scripts.len() >= 3, "{scripts:?}");
    for s in &scripts {
        let trace = s.with_extension("trace.json");
        let t = Trace::load(&trace).unwrap_or_else(|e| panic!("{}: {e}", trace.display()));
        assert_eq!(t.expect, Expect::Fail, "{}", trace.display());
        assert_eq!(t.config.families, vec!["engine".to_string()], "{}", trace.display());
        assert!(matches!(t.outcome, Outcome::Fail { .. }), "{}", trace.display());
        assert!(t.ops.len() <= 12, "{}: {} ops", trace.display(), t.ops.len());
    }
}

#[test]
fn every_reproducer_exits_1_with_its_divergence_under_mlx_lm() {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("oracles/mlx_lm/.venv/bin/python");
    if !python.exists() {
        eprintln!("skipped: no {} (run oracles/mlx_lm/setup.sh to create it)", python.display());
        return;
    }
    for s in repros() {
        let out = std::process::Command::new(&python).arg(&s).output().unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(1), "{}: {said}{}", s.display(), String::from_utf8_lossy(&out.stderr));
        assert!(
            ["differs from the same request run alone", "mlx-lm raised", "its rows' own caches trimmed"]
                .iter()
                .any(|w| said.contains(w)),
            "{}: {said}",
            s.display()
        );
        eprintln!("{}: {}", s.file_name().unwrap().to_string_lossy(), said.trim());
    }
}
