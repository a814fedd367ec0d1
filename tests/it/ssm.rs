//! The recurrent family (`sim::family::ssm`) through the public entry points: the first seeds that hold it pass, and
//! the speculative rounds are counted in the campaign summary.
use kvsim::campaign::run_seeds;
use kvsim::sim::DeviceChoice;

#[test]
fn a_campaign_counts_the_recurrent_rounds() {
    let seeds: Vec<u64> = (0..24).collect();
    let s = run_seeds(&seeds, DeviceChoice::Cpu, None, |_| None);
    assert_eq!(s.failures, 0, "{:?}", s.failed_seeds);
    let keys: Vec<&String> = s.layouts.keys().filter(|k| *k == "ssm" || k.starts_with("hybrid:")).collect();
    assert!(!keys.is_empty(), "{:?}", s.layouts.keys());
    assert!(s.counters.recurrent.rounds > 0 && s.counters.recurrent.replays > 0, "{:?}", s.counters.recurrent);
}
