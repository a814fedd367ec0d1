//! A short smoke of `kvsim sim`: the default band of 100 seeds must pass every check, cover every op kind, and
//! reach every public operation and parameter class in at least 2 of its runs (the coverage floor of rare
//! geometries: a conversion while a request holds no position, a prefill ended uncommitted, a saved set whose
//! layers differ, a saved list, a damaged file), and move every counter of the paged family.
use std::collections::BTreeSet;

use kvsim::sim::{run_seed, DeviceChoice};

#[test]
fn a_hundred_seeds_pass_cover_every_op_kind_and_reach_every_class_in_two_runs() {
    let mut kinds = BTreeSet::new();
    let mut failures = vec![];
    let mut classes = std::collections::BTreeMap::<String, u64>::new();
    let mut runs = std::collections::BTreeMap::<String, u64>::new();
    let mut rejected = std::collections::BTreeMap::<String, u64>::new();
    let mut paged = kvsim::sim::summary::PagedCounts::default();
    for seed in 0..100u64 {
        let r = run_seed(seed, DeviceChoice::Cpu, None);
        paged.add(&r.counters.paged);
        kinds.extend(r.ops_by_kind.keys().cloned());
        for (c, n) in &r.api_coverage {
            *classes.entry(c.clone()).or_default() += n;
            *runs.entry(c.clone()).or_default() += u64::from(*n > 0);
        }
        for (c, n) in &r.counters.ill_formed_rejected {
            *rejected.entry(c.clone()).or_default() += n;
        }
        if r.failed() {
            failures.push(format!("seed {seed}: {:?}", r.trace.outcome));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    for k in kvsim::sim::ops::OpKind::ALL {
        assert!(kinds.contains(k.name()), "op kind {} never ran in 100 seeds", k.name());
    }
    // Every public operation / parameter class of `API_CLASSES` is applied (join permutations, bypass
    // batch trims, adopt, decode_phase, prepare on rows holding positions and with a length of 0, early finalize,
    // ill-formed inputs of every class), and every ill-formed input class was refused with nothing changed.
    let listed: BTreeSet<&str> = kvsim::sim::ops::API_CLASSES.iter().copied().collect();
    let applied: BTreeSet<&str> = classes.keys().map(String::as_str).collect();
    assert_eq!(applied, listed, "api_coverage keys are exactly API_CLASSES");
    for c in kvsim::sim::ops::API_CLASSES {
        let n = runs.get(*c).copied().unwrap_or(0);
        assert!(n >= 2, "api class {c} reached in {n} of 100 runs (the floor is 2): {runs:?}");
    }
    // The paged family cannot pass without sharing: every counter of its sharing, pressure and comparisons moved
    // (a radix mode that asserts cached tokens, as SGLang's deterministic test does).
    let counts = [
        ("prefix_hits", paged.prefix_hits),
        ("shared_blocks", paged.shared_blocks),
        ("cow_copies", paged.cow_copies),
        ("evictions", paged.evictions),
        ("pool_exhausted", paged.pool_exhausted),
        ("forks", paged.forks),
        ("warm_vs_cold", paged.warm_vs_cold),
        ("placement_compared", paged.placement_compared),
        ("pool_checks", paged.pool_checks),
        ("prefill_chunks", paged.prefill_chunks),
        ("affine_states", paged.affine_states),
    ];
    for (name, n) in counts {
        assert!(n > 0, "paged counter {name} is 0 over 100 seeds: {paged:?}");
    }
    for c in kvsim::sim::ops::IllInput::ALL.iter().map(|i| i.name()).chain(["adopt_state"]) {
        assert!(
            rejected.get(c).copied().unwrap_or(0) > 0,
            "no ill-formed {c} input rejected in 100 seeds: {rejected:?}"
        );
    }
}
