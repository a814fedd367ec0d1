//! CI smoke of `kvsim mutants`: every mutant of the catalog is caught within its seed budget.
use kvsim::cache::mutation::Mutant;
use kvsim::sim::{run_seed, DeviceChoice};

/// Seeds each mutant may take (README "Mutation catalog" lists the measured catch seed; the budget leaves room).
fn budget(m: Mutant) -> u64 {
    match m {
        Mutant::MergeSlicesByOffset => 150,
        Mutant::PrefillPadStored => 60,
        _ => 20,
    }
}

#[test]
fn every_mutant_is_caught_within_its_budget() {
    let mut survivors = vec![];
    // The recurrent cache's mutants are caught by its own family runs (`sim::ssm` tests, `kvsim mutants`).
    for &m in Mutant::ALL.iter().filter(|m| m.layout() == "kv") {
        let caught = (0..budget(m)).find(|&seed| run_seed(seed, DeviceChoice::Cpu, Some(m)).failed());
        if caught.is_none() {
            survivors.push(m.name());
        }
    }
    assert!(survivors.is_empty(), "mutants that survived their budget: {survivors:?}");
}
