//! vllm-mlx 0.6.0's block pool (`PagedCacheManager`) and paged prefix cache (`BlockAwarePrefixCache`) under
//! `kvsim check-engine` over protocol 2: the classes of the stock release, each with its shortest trace and a
//! reproducer under `oracles/vllm_mlx/repros/` that exits 1, and the driver's planted bug caught. The engine's runs need the venv `oracles/vllm_mlx/setup.sh` creates; without it
//! they are skipped with the reason printed (the traces are checked either way).
use std::path::{Path, PathBuf};
use std::time::Duration;

use kvsim::byoc::engine_check::check_engine;
use kvsim::byoc::pool::PoolTrace;
use kvsim::byoc::prefix::PrefixTrace;
use kvsim::byoc::CheckOptions;
use kvsim::sim::trace::Outcome;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn repros() -> Vec<PathBuf> {
    let dir = root().join("oracles/vllm_mlx/repros");
    let mut out: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "py"))
        .collect();
    out.sort();
    out
}

fn venv() -> Option<PathBuf> {
    let python = root().join("oracles/vllm_mlx/.venv/bin/python");
    if python.exists() {
        Some(python)
    } else {
        eprintln!("skipped: no {} (run oracles/vllm_mlx/setup.sh to create it)", python.display());
        None
    }
}

fn driver(python: &Path, options: &str) -> String {
    format!(
        "cd {} && PYTHONPATH=python exec {} -m kvsim.drivers.vllm_mlx {options}",
        root().display(),
        python.display()
    )
}

#[test]
fn every_pool_class_has_a_short_failing_trace_beside_its_reproducer() {
    let scripts = repros();
    assert!(scripts.len() >= 6, "{scripts:?}");
    for s in &scripts {
        let trace = s.with_extension("trace.json");
        let text = std::fs::read_to_string(&trace).unwrap_or_else(|e| panic!("{}: {e}", trace.display()));
        let (outcome, ops) = match PoolTrace::parse(&text) {
            Ok(t) => (t.outcome, t.ops.len()),
            Err(_) => {
                let t = PrefixTrace::parse(&text).unwrap_or_else(|e| panic!("{}: {e}", trace.display()));
                (t.outcome, t.ops.len())
            }
        };
        let Outcome::Fail { check, .. } = &outcome else { panic!("{}: passes", trace.display()) };
        assert_eq!(s.file_stem().unwrap().to_string_lossy(), check.as_str());
        assert!(ops <= 4, "{}: {ops} ops", trace.display());
    }
}

#[test]
fn every_pool_reproducer_exits_1_under_vllm_mlx() {
    let Some(python) = venv() else { return };
    for s in repros() {
        let out = std::process::Command::new(&python).arg(&s).output().unwrap();
        let said = String::from_utf8_lossy(&out.stdout);
        let check = s.file_stem().unwrap().to_string_lossy().to_string();
        assert_eq!(out.status.code(), Some(1), "{}: {said}{}", s.display(), String::from_utf8_lossy(&out.stderr));
        assert!(said.contains(&format!("[{check}]")), "{}: {said}", s.display());
    }
}

/// The stock release's classes are found again, and the planted copy-on-write that keeps sharing its block is
/// caught by `pool_cow` on seeds where the stock manager passes that check (it fails them on shared storage or a
/// wrong lookup instead), and shrunk.
#[test]
fn vllm_mlx_classes_are_found_and_its_planted_bug_is_caught() {
    let Some(python) = venv() else { return };
    let opts = CheckOptions { seeds: 40, ops: 100, shrink_budget: 100, ..CheckOptions::default() };
    let timeout = Duration::from_secs(30);
    let stock = check_engine(&driver(&python, ""), timeout, opts, 1).expect("the stock driver does not break");
    let names: Vec<&str> = stock.classes.iter().map(|c| c.name.as_str()).collect();
    for want in ["pool_lookup", "pool_storage"] {
        assert!(names.contains(&want), "stock: {names:?}");
    }
    let planted =
        check_engine(&driver(&python, "--plant cow-keeps-shared"), timeout, opts, 1).expect("the planted driver");
    assert!(planted.hello.version.ends_with("+plant:cow-keeps-shared"), "{}", planted.hello.version);
    let cow = planted.classes.iter().find(|c| c.name == "pool_cow").expect("the planted bug is caught");
    let stock_cow: Vec<u64> =
        stock.classes.iter().filter(|c| c.name == "pool_cow").flat_map(|c| c.failing_seeds.clone()).collect();
    assert!(cow.failing_seeds.iter().any(|s| !stock_cow.contains(s)), "{:?} vs {stock_cow:?}", cow.failing_seeds);
    assert!(cow.shortest.ops() <= 4, "{} ops", cow.shortest.ops());
    assert!(cow.reproducer.is_ok(), "{:?}", cow.reproducer);
}

/// Every prefix-cache driver (mlx-lm's `LRUPromptCache`, vllm-mlx's `MemoryAwarePrefixCache`, mlx-vlm's
/// `APCManager`): the stock engine passes every prefix check over 20 seeds with hits checked, and the driver's planted
/// hit that restores one position fewer than it says is caught by `prefix_offset` and shrunk to 2 ops.
#[test]
fn every_prefix_driver_passes_stock_and_catches_its_planted_short_hit() {
    let opts = CheckOptions { seeds: 20, ops: 100, shrink_budget: 60, ..CheckOptions::default() };
    let timeout = Duration::from_secs(60);
    for (engine, module) in [("mlx_lm", "mlx_lm"), ("vllm_mlx", "vllm_mlx"), ("mlx_vlm", "mlx_vlm")] {
        let python = root().join(format!("oracles/{engine}/.venv/bin/python"));
        if !python.exists() {
            eprintln!("skipped {engine}: no {} (run oracles/{engine}/setup.sh)", python.display());
            continue;
        }
        let cmd = |opt: &str| {
            format!(
                "cd {} && PYTHONPATH=python exec {} -m kvsim.drivers.{module} {opt}",
                root().display(),
                python.display()
            )
        };
        // vllm-mlx's pool fails its own checks whatever the prefix cache does; the chain lookup keeps those runs long.
        let stock_opts = if engine == "vllm_mlx" { "--lookup chain" } else { "" };
        let stock =
            check_engine(&cmd(stock_opts), timeout, opts, 0).unwrap_or_else(|b| panic!("{engine}: {}", b.failure));
        assert!(stock.hello.prefix, "{engine} serves prefix caches");
        assert!(stock.ops_by_kind.get("prefix_hit").copied().unwrap_or(0) > 50, "{engine}: {:?}", stock.ops_by_kind);
        let prefix_classes: Vec<&str> =
            stock.classes.iter().map(|c| c.name.as_str()).filter(|n| n.starts_with("prefix_")).collect();
        assert!(prefix_classes.is_empty(), "{engine}: {prefix_classes:?}");
        let planted = check_engine(&cmd("--plant prefix-short"), timeout, opts, 1)
            .unwrap_or_else(|b| panic!("{engine} planted: {}", b.failure));
        let c = planted.classes.iter().find(|c| c.name == "prefix_offset").expect("the short hit is caught");
        assert!(c.shortest.ops() <= 2, "{engine}: {} ops", c.shortest.ops());
        assert!(c.reproducer.is_ok(), "{engine}: {:?}", c.reproducer);
    }
}
