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

/// The hunt's reach conditions are necessary ones: every recorded mutant trace of `corpus/` (a run that did reach
/// its mutant's hook) passes its mutant's condition, and the conditions leave runs to hunt in.
#[test]
fn every_recorded_catch_is_reachable() {
    use kvsim::campaign::mutant_reachable;
    use kvsim::sim::config::SimConfig;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let mut n = 0;
    for p in std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()) {
        if p.extension().is_none_or(|x| x != "json") {
            continue;
        }
        let t = kvsim::sim::trace::Trace::load(&p).unwrap();
        if let Some(m) = t.mutant {
            assert!(mutant_reachable(m, &t.config), "{}: {} judged unreachable", p.display(), m.name());
            n += 1;
        }
    }
    assert!(n >= 30, "only {n} mutant traces in corpus/");
    for &m in Mutant::ALL {
        let reachable = (0..mutant_budget(m)).filter(|&s| mutant_reachable(m, &SimConfig::from_seed(s))).count();
        assert!(reachable > 0, "{}: no seed of its budget can reach it", m.name());
        eprintln!("{}: {reachable} of {} seeds reachable", m.name(), mutant_budget(m));
    }
}
