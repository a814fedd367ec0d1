//! Quantized K/V over protocol 2 (`supports.quant`): mlx-optiq 0.7.7's quantized caches, mlx-lm 0.32.2's
//! `QuantizedKVCache` and mlx-vlm 0.7.10's own K/V classes (`--kv plain|quant|buffered`) under `kvsim check-engine`;
//! with them mlx-lm's other K/V configurations, `ChunkedKVCache` and `CacheList` (`--kv chunked|cachelist`). The
//! classes of the stock releases are found, each with its shortest
//! trace and a reproducer under `oracles/mlx_optiq/repros/` that exits 1, and optiq's planted bug (a quantized row
//! written at another row's column) is caught by the plane check and shrunk. The engines' runs need the venvs
//! `oracles/mlx_optiq/setup.sh` and `oracles/mlx_lm/setup.sh` create; without them they are skipped with the reason
//! printed (the committed traces are checked either way).
use std::path::{Path, PathBuf};
use std::time::Duration;

use kvsim::byoc::engine_check::{check_engine, check_engine_only};
use kvsim::byoc::CheckOptions;
use kvsim::sim::trace::{Outcome, Trace};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn repros() -> Vec<PathBuf> {
    let dir = root().join("oracles/mlx_optiq/repros");
    let mut out: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "py"))
        .collect();
    out.sort();
    out
}

/// mlx-vlm's K/V reproducers (`oracles/mlx_vlm/repros/kv/<config>-<class>.py`).
fn vlm_repros() -> Vec<PathBuf> {
    let dir = root().join("oracles/mlx_vlm/repros/kv");
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
        eprintln!("skipped: no {} (run oracles/{engine}/setup.sh to create it)", python.display());
        None
    }
}

fn driver(python: &Path, module: &str, options: &str) -> String {
    format!(
        "cd {} && PYTHONPATH=python exec {} -m kvsim.drivers.{module} {options}",
        root().display(),
        python.display()
    )
}

/// Each script, run with `python`, exits 1 and says one of `known` (its first divergence).
fn assert_exit_1(python: &Path, scripts: &[PathBuf], known: &[&str]) {
    for s in scripts {
        let out = std::process::Command::new(python).arg(s).output().unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        assert_eq!(out.status.code(), Some(1), "{}: {said}{}", s.display(), String::from_utf8_lossy(&out.stderr));
        assert!(known.iter().any(|w| said.contains(w)), "{}: {said}", s.display());
    }
}

/// 60 K/V seeds of `module` with `options` (a planted bug): caught by `check`, shrunk to at most `max_ops`.
fn assert_planted_caught(python: &Path, module: &str, options: &str, check: &str, max_ops: usize) {
    let opts = CheckOptions { seeds: 60, ops: 100, shrink_budget: 100, ..CheckOptions::default() };
    let planted = check_engine_only(&driver(python, module, options), Duration::from_secs(60), opts, 1, &["kv"])
        .expect("planted");
    let plant = options.rsplit("--plant ").next().unwrap_or("");
    assert!(planted.hello.version.ends_with(&format!("+plant:{plant}")), "{}", planted.hello.version);
    let c = planted.classes.iter().find(|c| c.name == check).unwrap_or_else(|| panic!("{options}: not caught"));
    assert!(c.shortest.ops() <= max_ops, "{options}: {} ops", c.shortest.ops());
}

#[test]
fn every_optiq_class_has_a_short_quantized_trace_beside_its_reproducer() {
    let scripts = repros();
    assert!(scripts.len() >= 3, "{scripts:?}");
    for s in &scripts {
        let trace = s.with_extension("trace.json");
        let t = Trace::load(&trace).unwrap_or_else(|e| panic!("{}: {e}", trace.display()));
        assert!(kvsim::byoc::quant_of(&t.config).is_some(), "{}: not a quantized run", trace.display());
        let Outcome::Fail { check, .. } = &t.outcome else { panic!("{}: passes", trace.display()) };
        let stem = s.file_stem().unwrap().to_string_lossy().to_string();
        assert!(stem.starts_with(check.as_str()), "{stem} is not a {check} class");
        assert!(t.ops.len() <= 4, "{}: {} ops", trace.display(), t.ops.len());
    }
}

#[test]
fn every_optiq_reproducer_exits_1_under_mlx_optiq() {
    let Some(python) = venv("mlx_optiq") else { return };
    assert_exit_1(
        &python,
        &repros(),
        &["mlx-optiq raised", "instead of raising", "differs from the same request run alone"],
    );
}

/// The stock batch path's classes are found again, and the planted row copy is caught by `state_vs_model` (the
/// planes of the row against `mx.quantize` of its own positions) and shrunk.
#[test]
fn optiq_classes_are_found_and_its_planted_row_copy_is_caught() {
    let Some(python) = venv("mlx_optiq") else { return };
    let opts = CheckOptions { seeds: 60, ops: 100, shrink_budget: 100, ..CheckOptions::default() };
    let timeout = Duration::from_secs(60);
    let stock = check_engine(&driver(&python, "mlx_optiq", ""), timeout, opts, 1).expect("the stock driver");
    assert!(stock.hello.supports.quant_only && stock.hello.supports.quant_rows, "{:?}", stock.hello.supports);
    let names: Vec<&str> = stock.classes.iter().map(|c| c.name.as_str()).collect();
    for want in ["adapter_error/row_state", "rows_vs_solo"] {
        assert!(names.contains(&want), "stock: {names:?}");
    }
    assert!(stock.classes.iter().all(|c| c.name != "state_vs_model"), "stock: {names:?}");
    let planted =
        check_engine(&driver(&python, "mlx_optiq", "--plant quant-row-copy"), timeout, opts, 1).expect("planted");
    assert!(planted.hello.version.ends_with("+plant:quant-row-copy"), "{}", planted.hello.version);
    let c = planted.classes.iter().find(|c| c.name == "state_vs_model").expect("the planted row copy is caught");
    assert!(c.shortest.ops() <= 6, "{} ops", c.shortest.ops());
}

/// `--cache rotating`: half the runs start plain and are converted by optiq's `quantize_cache_layer`; the planted
/// conversion that drops a wrapped ring's write position is caught by `state_vs_model` (planes in temporal order).
#[test]
fn optiq_conversion_of_a_wrapped_ring_keeps_its_phase_and_the_planted_loss_is_caught() {
    let Some(python) = venv("mlx_optiq") else { return };
    let opts = CheckOptions { seeds: 60, ops: 100, shrink_budget: 100, ..CheckOptions::default() };
    let timeout = Duration::from_secs(60);
    let stock = check_engine(&driver(&python, "mlx_optiq", "--cache rotating"), timeout, opts, 0).expect("stock");
    assert!(stock.hello.supports.convert, "{:?}", stock.hello.supports);
    assert!(stock.ops_by_kind.get("quantize").copied().unwrap_or(0) > 10, "{:?}", stock.ops_by_kind);
    assert!(stock.classes.iter().all(|c| c.name != "state_vs_model"), "stock converts rings with their phase");
    let planted =
        check_engine(&driver(&python, "mlx_optiq", "--cache rotating --plant convert-phase"), timeout, opts, 1)
            .expect("planted");
    let c = planted.classes.iter().find(|c| c.name == "state_vs_model").expect("the lost phase is caught");
    assert!(c.shortest.ops() <= 6, "{} ops", c.shortest.ops());
}

/// mlx-lm's `QuantizedKVCache` (serial only: mlx-lm 0.32.2 batches no quantized cache) over 30 seeds: the runs with
/// 5- or 6-bit codes fail at their first write, every other run passes every plane and read check.
#[test]
fn mlx_lm_quantized_cache_fails_only_at_five_and_six_bits() {
    let Some(python) = venv("mlx_lm") else { return };
    let opts = CheckOptions { seeds: 30, ops: 100, shrink_budget: 40, ..CheckOptions::default() };
    let r = check_engine(&driver(&python, "mlx_lm", "--kv quant"), Duration::from_secs(60), opts, 1).expect("driver");
    assert!(r.checks > 10_000, "{} checks", r.checks);
    let names: Vec<&str> = r.classes.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["adapter_error/solo_read"], "{names:?}");
    for seed in &r.classes[0].failing_seeds {
        // an engine run's quantization is the quantized family's draw of its seed
        let q = kvsim::sim::family::quant::QuantChoice::draw(*seed);
        assert!(q.bits == 5 || q.bits == 6, "seed {seed}: {} bits", q.bits);
    }
}

#[test]
fn every_mlx_vlm_kv_class_has_a_short_trace_beside_its_reproducer() {
    let scripts = vlm_repros();
    assert!(scripts.len() >= 5, "{scripts:?}");
    for s in &scripts {
        let trace = s.with_extension("trace.json");
        let t = Trace::load(&trace).unwrap_or_else(|e| panic!("{}: {e}", trace.display()));
        let Outcome::Fail { check, .. } = &t.outcome else { panic!("{}: passes", trace.display()) };
        let stem = s.file_stem().unwrap().to_string_lossy().to_string();
        let (config, class) = stem.split_once('-').unwrap_or_else(|| panic!("{stem}: not <config>-<class>"));
        assert!(class.starts_with(check.as_str()), "{stem} is not a {check} class");
        let quantized = matches!(config, "quant" | "convert");
        assert_eq!(quantized, kvsim::byoc::quant_of(&t.config).is_some(), "{}", trace.display());
        assert!(t.ops.len() <= 6, "{}: {} ops", trace.display(), t.ops.len());
    }
}

#[test]
fn every_mlx_vlm_kv_reproducer_exits_1_under_mlx_vlm() {
    let Some(python) = venv("mlx_vlm") else { return };
    assert_exit_1(
        &python,
        &vlm_repros(),
        &[
            "mlx-vlm raised",
            "instead of raising",
            "differs from the same request run alone",
            "the batch trimmed",
            "after extending with a batch of no position",
            "an empty one is accepted",
        ],
    );
}

/// mlx-vlm's `QuantizedKVCache` and the `BatchQuantizedKVCache` its `prefix_cache_merge` builds (`--kv quant`): the
/// stock release's one class is `missing_row_accepted`, and the planted row copy is caught by `state_vs_model`
/// and shrunk.
#[test]
fn mlx_vlm_quantized_batches_pass_the_plane_checks_and_the_planted_row_copy_is_caught() {
    let Some(python) = venv("mlx_vlm") else { return };
    let opts = CheckOptions { seeds: 60, ops: 100, shrink_budget: 100, ..CheckOptions::default() };
    let timeout = Duration::from_secs(60);
    let only = ["kv"];
    let stock = check_engine_only(&driver(&python, "mlx_vlm", "--kv quant"), timeout, opts, 1, &only)
        .expect("the stock driver");
    assert!(stock.hello.supports.quant_only && stock.hello.supports.quant_rows, "{:?}", stock.hello.supports);
    let names: Vec<&str> = stock.classes.iter().map(|c| c.name.as_str()).collect();
    assert_eq!(names, ["missing_row_accepted"], "stock: {names:?}");
    assert_planted_caught(&python, "mlx_vlm", "--kv quant --plant quant-row-copy", "state_vs_model", 6);
}

/// mlx-lm's `ChunkedKVCache` and `CacheList` runs (`--kv chunked`, `--kv cachelist`): their traces and reproducers
/// (`oracles/mlx_lm/repros/chunked/`, `oracles/mlx_lm/repros/cachelist/`).
fn mlx_lm_list_files(ext: &str) -> Vec<PathBuf> {
    let mut out = vec![];
    for config in ["chunked", "cachelist"] {
        let dir = root().join("oracles/mlx_lm/repros").join(config);
        out.extend(
            std::fs::read_dir(&dir)
                .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
                .map(|e| e.unwrap().path())
                .filter(|p| p.to_string_lossy().ends_with(ext)),
        );
    }
    out.sort();
    out
}

#[test]
fn every_mlx_lm_chunked_and_cachelist_class_has_a_short_trace() {
    let traces = mlx_lm_list_files(".trace.json");
    assert!(traces.len() >= 7, "{traces:?}");
    for trace in &traces {
        let t = Trace::load(trace).unwrap_or_else(|e| panic!("{}: {e}", trace.display()));
        let Outcome::Fail { check, .. } = &t.outcome else { panic!("{}: passes", trace.display()) };
        let name = trace.file_name().unwrap().to_string_lossy().to_string();
        assert!(name.starts_with(check.as_str()), "{name} is not a {check} class");
        assert!(t.ops.len() <= 6, "{}: {} ops", trace.display(), t.ops.len());
    }
}

#[test]
fn every_mlx_lm_chunked_and_cachelist_reproducer_exits_1_under_mlx_lm() {
    let Some(python) = venv("mlx_lm") else { return };
    assert_exit_1(
        &python,
        &mlx_lm_list_files(".py"),
        &["mlx-lm raised", "differs from the same request run alone", "the batch trimmed", "attends positions"],
    );
}

/// `--kv chunked`: the stock release's classes are the refused merge and `trim_count`; the planted over-trim is
/// caught by `offsets`. `--kv cachelist`: the planted sub-cache mix-up is caught by `state_vs_model`. Each shrunk.
#[test]
fn mlx_lm_chunked_and_cachelist_planted_bugs_are_caught() {
    let Some(python) = venv("mlx_lm") else { return };
    let opts = CheckOptions { seeds: 60, ops: 100, shrink_budget: 100, ..CheckOptions::default() };
    let timeout = Duration::from_secs(60);
    let only = ["kv"];
    let stock =
        check_engine_only(&driver(&python, "mlx_lm", "--kv chunked"), timeout, opts, 1, &only).expect("chunked");
    let mut names: Vec<&str> = stock.classes.iter().map(|c| c.name.as_str()).collect();
    names.sort();
    assert_eq!(names, ["adapter_error/merge", "trim_count"], "chunked: {names:?}");
    assert_planted_caught(&python, "mlx_lm", "--kv chunked --plant chunk-trim-over", "offsets", 6);
    assert_planted_caught(&python, "mlx_lm", "--kv cachelist --plant cachelist-index", "state_vs_model", 6);
}

/// Per-row rollback (`rows_trim_rows`, `--trim-rows yes`): mlx-lm's and mlx-vlm's full-attention batches roll back
/// row by row through `prepare(right_padding)` and `finalize` with no class of their own, and a rollback that drops the
/// most from every row (`--plant rollback-uniform`) is caught by the offsets check and shrunk.
#[test]
fn per_row_rollback_passes_stock_and_catches_a_uniform_rollback() {
    let opts = CheckOptions { seeds: 60, ops: 100, shrink_budget: 100, ..CheckOptions::default() };
    let timeout = Duration::from_secs(60);
    let only = ["kv"];
    for (engine, kv) in [("mlx_lm", ""), ("mlx_vlm", "--kv plain ")] {
        let Some(python) = venv(engine) else { continue };
        let stock =
            check_engine_only(&driver(&python, engine, &format!("{kv}--trim-rows yes")), timeout, opts, 1, &only)
                .expect("stock");
        let names: Vec<&str> = stock.classes.iter().map(|c| c.name.as_str()).collect();
        assert!(
            names.iter().all(|n| *n == "adapter_error/row_state" || *n == "missing_row_accepted"),
            "{engine}: {names:?}"
        );
        assert_planted_caught(&python, engine, &format!("{kv}--trim-rows yes --plant rollback-uniform"), "offsets", 6);
    }
}
