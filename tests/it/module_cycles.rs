//! No module of a workspace crate imports, directly or through others, a module that imports it back: each crate's
//! modules form a layered graph. Edges are the `crate::a::b` and `super::a` paths a module's non-test code names
//! (a parent declaring its children is not an edge).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// `a::b` for `src/a/b.rs` and `src/a/b/mod.rs`, `` for `lib.rs`; `None` for test files.
fn module_of(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?.with_extension("");
    let mut parts: Vec<String> = rel.iter().map(|s| s.to_string_lossy().into_owned()).collect();
    if parts.last().is_some_and(|l| l == "lib" || l == "mod") {
        parts.pop();
    }
    (!parts.iter().any(|p| p == "tests" || p == "testutil")).then(|| parts.join("::"))
}

/// The module paths named after `prefix` (`crate::` or `super::`), as identifier chains.
fn paths_after<'a>(code: &'a str, prefix: &'a str) -> impl Iterator<Item = Vec<&'a str>> + 'a {
    code.match_indices(prefix).filter_map(move |(i, _)| {
        let before = code[..i].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
            return None;
        }
        let rest = &code[i + prefix.len()..];
        let end = rest.find(|c: char| !(c.is_alphanumeric() || c == '_' || c == ':')).unwrap_or(rest.len());
        let chain: Vec<&str> = rest[..end].split("::").filter(|s| !s.is_empty()).collect();
        (!chain.is_empty()).then_some(chain)
    })
}

fn code_without_tests_and_comments(text: &str) -> String {
    let text = text.split("#[cfg(test)]\nmod tests {").next().unwrap_or("");
    text.lines().map(|l| l.split("//").next().unwrap_or("")).collect::<Vec<_>>().join("\n")
}

fn graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = vec![];
    rust_files(src, &mut files);
    let modules: BTreeMap<String, String> = files
        .iter()
        .filter_map(|f| Some((module_of(src, f)?, code_without_tests_and_comments(&std::fs::read_to_string(f).ok()?))))
        .collect();
    let mut g: BTreeMap<String, BTreeSet<String>> = modules.keys().map(|m| (m.clone(), BTreeSet::new())).collect();
    for (m, code) in &modules {
        let parent = m.rsplit_once("::").map_or("", |p| p.0).to_string();
        let mut targets = vec![];
        for chain in paths_after(code, "crate::") {
            // The longest prefix of the path that is a module.
            if let Some(k) = (1..=chain.len()).rev().find(|&k| modules.contains_key(&chain[..k].join("::"))) {
                targets.push(chain[..k].join("::"));
            }
        }
        for chain in paths_after(code, "super::") {
            let sibling = if parent.is_empty() { chain[0].to_string() } else { format!("{parent}::{}", chain[0]) };
            if modules.contains_key(&sibling) {
                targets.push(sibling);
            }
        }
        for t in targets {
            // A module naming its own descendants or ancestors is nesting, not a cycle between peers.
            let nested = t.starts_with(&format!("{m}::")) || m.starts_with(&format!("{t}::")) || t.is_empty();
            if t != *m && !nested {
                g.get_mut(m).unwrap().insert(t);
            }
        }
    }
    g
}

/// A cycle through `start`, if any (depth-first search).
fn cycle_through(g: &BTreeMap<String, BTreeSet<String>>, start: &str) -> Option<Vec<String>> {
    let mut stack = vec![(start.to_string(), vec![start.to_string()])];
    let mut seen = BTreeSet::new();
    while let Some((n, path)) = stack.pop() {
        for next in &g[&n] {
            if next == start {
                return Some(path.clone());
            }
            if seen.insert(next.clone()) {
                let mut p = path.clone();
                p.push(next.clone());
                stack.push((next.clone(), p));
            }
        }
    }
    None
}

/// **Architecture invariant**: no module import cycles in any crate of the workspace.
#[test]
fn no_module_imports_a_module_that_imports_it() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut crates: Vec<PathBuf> =
        std::fs::read_dir(root.join("crates")).unwrap().flatten().map(|e| e.path().join("src")).collect();
    crates.push(root.join("src"));
    let mut cycles = vec![];
    for src in crates {
        let g = graph(&src);
        assert!(g.len() > 1 || src.ends_with("kvsim-ulp/src"), "{} has modules", src.display());
        for m in g.keys() {
            if let Some(c) = cycle_through(&g, m) {
                cycles.push(format!("{}: {}", src.display(), c.join(" -> ")));
            }
        }
    }
    assert!(cycles.is_empty(), "module import cycles:\n{}", cycles.join("\n"));
}

/// The detector sees a cycle: two modules that name each other.
#[test]
fn the_cycle_detector_finds_a_planted_cycle() {
    let dir = std::env::temp_dir().join(format!("kvsim-cycle-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("lib.rs"), "mod a;\nmod b;\n").unwrap();
    std::fs::write(dir.join("a.rs"), "use crate::b::B;\npub struct A;\n").unwrap();
    std::fs::write(dir.join("b.rs"), "use super::a::A; // b names a\npub struct B;\n").unwrap();
    let g = graph(&dir);
    assert!(cycle_through(&g, "a").is_some(), "{g:?}");
    std::fs::write(dir.join("b.rs"), "pub struct B; // crate::a is only a comment here\n").unwrap();
    assert!(cycle_through(&graph(&dir), "a").is_none());
    let _ = std::fs::remove_dir_all(&dir);
}
