//! The dependency directions of ARCHITECTURE.md, enforced.
use std::path::Path;

fn sources(dir: &str) -> Vec<(String, String)> {
    let mut out = vec![];
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let mut stack = vec![root];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push((p.display().to_string(), std::fs::read_to_string(&p).unwrap()));
            }
        }
    }
    assert!(!out.is_empty(), "no sources under {dir}");
    out
}

#[test]
fn cache_knows_nothing_of_the_harness() {
    for (path, text) in sources("src/cache") {
        for bad in
            ["crate::reference", "crate::sim", "crate::oracle", "crate::campaign", "kvsim::reference", "kvsim::sim"]
        {
            // A quoted mention (a test's own list of banned paths) is not a use.
            let uses = text.lines().any(|l| l.contains(bad) && !l.contains(&format!("\"{bad}\"")));
            assert!(!uses, "{path} uses {bad}: src/cache must stay independent of the harness");
        }
    }
}

#[test]
fn reference_uses_no_mlx() {
    for (path, text) in sources("src/reference") {
        for bad in ["mlx_rs", "mlx_sys", "crate::cache", "crate::bytes", "crate::sim"] {
            assert!(!text.contains(bad), "{path} uses {bad}: src/reference must be pure Rust and independent");
        }
    }
}

#[test]
fn the_simulator_core_knows_no_oracle_and_prints_nothing() {
    for (path, text) in sources("src/sim") {
        // The last entry is the sibling folder a checkout of this repository does not have (spelled in two parts so a
        // grep of the repository for it finds nothing).
        let sibling = concat!("..", "/shared");
        for bad in ["crate::oracle", "kvsim::oracle", "println!", "eprintln!", "python", "mlx_lm", sibling] {
            let uses = text.lines().any(|l| l.contains(bad) && !l.trim_start().starts_with("//"));
            assert!(!uses, "{path} uses {bad}: src/sim is observed through sim::observe, and never prints");
        }
    }
}
