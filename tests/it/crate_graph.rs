//! The workspace's boundaries, read from the crate graph that enforces them: what each library crate may never
//! depend on (normal dependencies, each crate built alone with its default features).

use std::collections::BTreeSet;
use std::process::Command;

/// `cargo tree -p CRATE -e normal` as the set of package names it lists (the crate itself included).
fn normal_deps(krate: &str, extra: &[&str]) -> BTreeSet<String> {
    let out = Command::new(env!("CARGO"))
        .args(["tree", "--offline", "-p", krate, "-e", "normal", "--prefix", "none", "--format", "{p}"])
        .args(extra)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo tree runs");
    assert!(out.status.success(), "cargo tree -p {krate}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

fn assert_absent(krate: &str, banned: &[&str]) {
    let deps = normal_deps(krate, &[]);
    assert!(deps.contains(krate), "cargo tree -p {krate} lists the crate itself: {deps:?}");
    for b in banned {
        assert!(!deps.contains(*b), "{krate} depends on {b} (its dependencies: {deps:?})");
    }
}

const HARNESS_SIDE: [&str; 4] = ["kvsim-harness", "kvsim-oracle", "kvsim-reference", "kvsim"];

/// **Architecture invariant**: the production caches depend on no harness, oracle, model or CLI crate, and on no
/// trace or command-line crate (serde_json, serde, clap, proptest, indicatif).
#[test]
fn the_caches_depend_on_no_harness_and_no_trace_format() {
    let mut banned = HARNESS_SIDE.to_vec();
    banned.extend(["kvsim-persist", "serde_json", "serde", "clap", "proptest", "indicatif", "rand"]);
    assert_absent("kvsim-cache", &banned);
}

/// **Architecture invariant**: a build of the caches with default features turns on no feature of theirs, so no
/// fault hook is compiled (the hooks exist only under `faults`; kvsim-cache's crate docs hold a `compile_fail`
/// example that arming one does not build, run by `cargo test -p kvsim-cache --doc`).
#[test]
fn the_caches_alone_compile_no_fault_hook() {
    let out = Command::new(env!("CARGO"))
        .args(["tree", "--offline", "-p", "kvsim-cache", "-e", "features", "-i", "kvsim-cache", "--prefix", "none"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo tree runs");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("kvsim-cache"), "cargo tree printed the crate: {text}");
    for feature in ["faults", "serde", "testutil"] {
        assert!(!text.contains(&format!("feature \"{feature}\"")), "kvsim-cache alone has `{feature}` on:\n{text}");
    }
    // And the harness is what turns the hooks on.
    let harness = Command::new(env!("CARGO"))
        .args(["tree", "--offline", "-p", "kvsim-harness", "-e", "features", "-i", "kvsim-cache", "--prefix", "none"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo tree runs");
    assert!(String::from_utf8_lossy(&harness.stdout).contains("kvsim-cache feature \"faults\""));
}

/// **Architecture invariant**: the reference model uses no array library and knows no cache.
#[test]
fn the_reference_model_uses_no_mlx() {
    let mut banned = vec!["mlx-rs", "mlx-sys", "kvsim-cache", "kvsim-persist"];
    banned.extend(HARNESS_SIDE.iter().filter(|c| **c != "kvsim-reference"));
    assert_absent("kvsim-reference", &banned);
}

/// **Architecture invariant**: persistence depends on the caches only (no model, harness, oracle or CLI crate).
#[test]
fn persistence_depends_on_the_caches_only() {
    let mut banned = HARNESS_SIDE.to_vec();
    banned.extend(["clap", "proptest", "indicatif", "rand"]);
    assert_absent("kvsim-persist", &banned);
}

/// **Architecture invariant**: the harness runs no oracle and no command line; the oracle no command line.
#[test]
fn the_harness_knows_no_oracle_and_no_command_line() {
    assert_absent("kvsim-harness", &["kvsim-oracle", "kvsim", "clap", "indicatif", "proptest"]);
    assert_absent("kvsim-oracle", &["kvsim", "clap", "indicatif", "proptest"]);
}

/// A documentation build (`DOCS_RS`, no network) compiles against `mlx-sys/docs/bindings.rs`: they must be the
/// bindings an ordinary build generates (regenerate with `cp target/*/build/mlx-sys-*/out/bindings.rs
/// mlx-sys/docs/bindings.rs` after an mlx-c or bindgen change).
#[test]
fn the_committed_docs_bindings_are_the_generated_ones() {
    let current = std::hint::black_box(mlx_sys::DOCS_BINDINGS_CURRENT);
    assert!(current, "mlx-sys/docs/bindings.rs differs from the generated bindings");
}

/// **Architecture invariant**: the bring-your-own-cache example's cache is written against mlx-rs alone: no kvsim
/// crate is among its normal dependencies (kvsim's harness reaches it from its tests only).
#[test]
fn the_example_cache_uses_no_kvsim_crate() {
    let mut banned = HARNESS_SIDE.to_vec();
    banned.extend(["kvsim-cache", "kvsim-persist", "kvsim-ulp", "kvsim-show"]);
    assert_absent("byo-cache", &banned);
}
