//! CI smoke of `kvsim mutants`: every mutant of the catalog is caught within its seed budget.
use kvsim::cache::faults::Mutant;
use kvsim::campaign::{hunt_mutant, mutant_budget};

#[test]
fn every_mutant_is_caught_within_its_budget() {
    // The quantized mutants are hunted through the quantized family (`sim::family::quant`); the recurrent cache's by
    // its own runs (`tests/it/ssm.rs`).
    let survivors: Vec<&str> = Mutant::ALL
        .iter()
        .filter(|m| m.in_simulator())
        .filter(|&&m| hunt_mutant(m, mutant_budget(m)).is_none())
        .map(|m| m.name())
        .collect();
    assert!(survivors.is_empty(), "mutants that survived their budget: {survivors:?}");
}
