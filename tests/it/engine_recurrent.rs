//! Recurrent state (protocol 2, `supports.recurrent`) of mlx-lm's `ArraysCache`, vllm-mlx's `BatchMambaCache` and
//! mlx-vlm's `ArraysCache` (with its speculation API) under `kvsim check-engine --only recurrent`: each stock class's
//! shortest trace beside its reproducer under `oracles/<engine>/repros/recurrent/`, every reproducer exiting 1 under
//! its engine, and each driver's planted `rec-neighbour` (a row that takes its neighbour's state after a filter)
//! caught by `rec_state` on seeds where the stock engine passes that check. The engines' runs need the venvs the
//! `oracles/<engine>/setup.sh` scripts create; without one they are skipped with the reason printed (the traces are
//! checked either way).
use std::path::{Path, PathBuf};
use std::time::Duration;

use kvsim::byoc::engine_check::check_engine_only;
use kvsim::byoc::recurrent::RecTrace;
use kvsim::byoc::CheckOptions;
use kvsim::sim::trace::Outcome;

const ENGINES: &[&str] = &["mlx_lm", "vllm_mlx", "mlx_vlm"];

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn repros(engine: &str) -> Vec<PathBuf> {
    let dir = root().join(format!("oracles/{engine}/repros/recurrent"));
    let mut out: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "py"))
        .collect();
    out.sort();
    out
}

fn venv(engine: &str) -> Option<PathBuf> {
    let python = root().join(format!("oracles/{engine}/.venv/bin/python"));
    if python.exists() {
        Some(python)
    } else {
        eprintln!("skipped {engine}: no {} (run oracles/{engine}/setup.sh to create it)", python.display());
        None
    }
}

fn driver(engine: &str, python: &Path, options: &str) -> String {
    format!(
        "cd {} && PYTHONPATH=python exec {} -m kvsim.drivers.{engine} {options}",
        root().display(),
        python.display()
    )
}

#[test]
fn every_recurrent_class_has_a_short_failing_trace_beside_its_reproducer() {
    for engine in ENGINES {
        let scripts = repros(engine);
        assert!(scripts.len() >= 2, "{engine}: {scripts:?}");
        for s in &scripts {
            let trace = s.with_extension("trace.json");
            let text = std::fs::read_to_string(&trace).unwrap_or_else(|e| panic!("{}: {e}", trace.display()));
            let t = RecTrace::parse(&text).unwrap_or_else(|e| panic!("{}: {e}", trace.display()));
            let Outcome::Fail { check, message, .. } = &t.outcome else { panic!("{}: passes", trace.display()) };
            let stem = s.file_stem().unwrap().to_string_lossy().to_string();
            let class = if check == "adapter_error" {
                format!("adapter_error-{}", message.split(':').next().unwrap_or("?"))
            } else {
                check.clone()
            };
            assert_eq!(stem, class, "{}", trace.display());
            assert!(t.ops.len() <= 4, "{}: {} ops", trace.display(), t.ops.len());
        }
    }
}

#[test]
fn every_recurrent_reproducer_exits_1_under_its_engine() {
    for engine in ENGINES {
        let Some(python) = venv(engine) else { continue };
        for s in repros(engine) {
            let out = std::process::Command::new(&python).arg(&s).output().unwrap();
            let said = String::from_utf8_lossy(&out.stdout);
            let stem = s.file_stem().unwrap().to_string_lossy().to_string();
            assert_eq!(out.status.code(), Some(1), "{}: {said}{}", s.display(), String::from_utf8_lossy(&out.stderr));
            let mark =
                if stem.starts_with("adapter_error") { " raised at call ".to_string() } else { format!("[{stem}]") };
            assert!(said.contains(&mark), "{}: {said}", s.display());
        }
    }
}

/// Each driver's planted neighbour row is caught by `rec_state` on a seed where the stock engine does not fail that
/// check, shrunk to a few ops, with a reproducer; the stock engine's classes are the documented ones.
#[test]
fn every_recurrent_driver_catches_its_planted_neighbour_row() {
    let opts = CheckOptions { seeds: 30, ops: 100, shrink_budget: 100, ..CheckOptions::default() };
    let timeout = Duration::from_secs(60);
    for engine in ENGINES {
        let Some(python) = venv(engine) else { continue };
        // Without prompt batches, whose own class (vllm-mlx's `rec_state`) the next test owns.
        let base = "--rec-prefill no";
        let run = |opt: &str| {
            let opt = format!("{base} {opt}");
            check_engine_only(&driver(engine, &python, &opt), timeout, opts, 1, &["recurrent"])
                .unwrap_or_else(|b| panic!("{engine} {opt}: {}", b.failure))
        };
        let stock = run("");
        assert!(stock.hello.recurrent, "{engine} serves recurrent state");
        let names: Vec<&str> = stock.classes.iter().map(|c| c.name.as_str()).collect();
        assert!(names.contains(&"rec_missing_row"), "{engine}: {names:?}");
        assert!(!names.contains(&"rec_state"), "{engine}: {names:?}");
        let planted = run("--plant rec-neighbour");
        assert!(planted.hello.version.ends_with("+plant:rec-neighbour"), "{}", planted.hello.version);
        let c = planted.classes.iter().find(|c| c.name == "rec_state").expect("the planted neighbour row is caught");
        assert!(c.shortest.ops() <= 6, "{engine}: {} ops", c.shortest.ops());
        assert!(c.reproducer.is_ok(), "{engine}: {:?}", c.reproducer);
    }
}

/// Right-padded prompt batches (`supports.rec_prefill`): mlx-lm 0.32.2's `ArraysCache` masks the padding (no
/// `rec_state`), and a driver that ignores the mask (`--plant rec-pad-unmasked`) is caught in at most 2 ops, the
/// message naming the padding step the row kept; vllm-mlx 0.6.0 (mlx-lm 0.31.3's `make_mask`) and mlx-vlm 0.7.10
/// (its own `make_mask`) keep it on the stock releases, and the hand reproducers of the root cause exit 1 there
/// (vllm-mlx's exits 0 under mlx-lm 0.32.2).
#[test]
fn recurrent_prompt_batches_are_masked_by_mlx_lm_and_not_by_vllm_mlx_or_mlx_vlm() {
    let opts = CheckOptions { seeds: 30, ops: 100, shrink_budget: 100, ..CheckOptions::default() };
    let timeout = Duration::from_secs(60);
    let run = |engine: &str, python: &Path, opt: &str| {
        check_engine_only(&driver(engine, python, opt), timeout, opts, 1, &["recurrent"])
            .unwrap_or_else(|b| panic!("{engine} {opt}: {}", b.failure))
    };
    let padded = |r: &kvsim::byoc::engine_check::EngineReport, what: &str| {
        let c = r.classes.iter().find(|c| c.name == "rec_state").unwrap_or_else(|| panic!("{what}: no rec_state"));
        assert!(c.shortest.ops() <= 2, "{what}: {} ops", c.shortest.ops());
        assert!(c.message.contains("padding step"), "{what}: {}", c.message);
        assert!(c.reproducer.is_ok(), "{what}: {:?}", c.reproducer);
    };
    let hand = root().join("oracles/vllm_mlx/repros/recurrent/by-hand/make_mask_ignores_lengths.py");
    if let Some(python) = venv("mlx_lm") {
        let stock = run("mlx_lm", &python, "");
        assert!(stock.hello.rec_prefill, "mlx-lm's driver takes prompt batches");
        assert!(stock.ops_by_kind.get("rec_prefill").copied().unwrap_or(0) > 10, "{:?}", stock.ops_by_kind);
        let names: Vec<&str> = stock.classes.iter().map(|c| c.name.as_str()).collect();
        assert!(!names.contains(&"rec_state"), "{names:?}");
        padded(&run("mlx_lm", &python, "--plant rec-pad-unmasked"), "mlx-lm planted");
        let out = std::process::Command::new(&python).arg(&hand).output().unwrap();
        assert_eq!(out.status.code(), Some(0), "{}", String::from_utf8_lossy(&out.stdout));
    }
    if let Some(python) = venv("vllm_mlx") {
        for rec in ["", "--rec arrays"] {
            padded(&run("vllm_mlx", &python, rec), &format!("vllm-mlx {rec}"));
        }
        let out = std::process::Command::new(&python).arg(&hand).output().unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(1), "{said}");
        assert!(said.contains("BatchMambaCache.merge") && said.contains("reach its state"), "{said}");
    }
    if let Some(python) = venv("mlx_vlm") {
        padded(&run("mlx_vlm", &python, ""), "mlx-vlm");
        let hand = root().join("oracles/mlx_vlm/repros/recurrent/by-hand/make_mask_ignores_lengths.py");
        let out = std::process::Command::new(&python).arg(&hand).output().unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(1), "{said}");
        assert!(said.contains("reach its state"), "{said}");
    }
}
