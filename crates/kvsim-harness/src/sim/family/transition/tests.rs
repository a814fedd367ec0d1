use super::*;
use crate::sim::{run, DeviceChoice};

/// The first `n` seeds whose swarm config holds this family.
fn seeds_with_family(n: usize) -> Vec<(u64, SimConfig)> {
    (0..).map(|s| (s, SimConfig::from_seed(s))).filter(|(_, c)| c.families.iter().any(|f| f == NAME)).take(n).collect()
}

#[test]
fn choices_are_valid_and_cover_start_zero_infinity_and_crossed_values() {
    let mut zero = 0;
    let mut inf = 0;
    for s in 0..400u64 {
        let cfg = SimConfig::from_seed(s);
        let c = TransitionChoice::draw(&cfg);
        assert_eq!(c.head_dim % c.group, 0);
        QuantSpec { bits: c.bits, group: c.group }.validate(c.head_dim).unwrap();
        zero += usize::from(c.start == Some(0));
        inf += usize::from(c.start.is_none());
        assert_eq!(c, TransitionChoice::draw(&cfg), "one seed, one choice");
    }
    assert!(zero > 0 && inf > 0);
}

#[test]
fn runs_holding_the_family_pass_and_count_its_events() {
    let mut total = Counters::default();
    let mut spans = 0;
    for (seed, cfg) in seeds_with_family(6) {
        let r = run(seed, cfg, None, DeviceChoice::Cpu, None);
        assert!(!r.failed(), "seed {seed}: {:?}", r.failure);
        let key = r.layouts.keys().find(|k| k.starts_with("kv:delayed")).cloned();
        let key = key.unwrap_or_else(|| panic!("seed {seed}: {:?}", r.layouts.keys()));
        spans += r.layouts[&key].ops_by_kind.get("commit_span").copied().unwrap_or(0);
        total.add(&r.counters);
    }
    assert!(total.conversions > 0 && spans > 0, "{total:?}, {spans} spans");
}

/// The first `n` seeds whose swarm config holds the lego family.
fn seeds_with_legos(n: usize) -> Vec<(u64, SimConfig)> {
    (0..)
        .map(|s| (s, SimConfig::from_seed(s)))
        .filter(|(_, c)| c.families.iter().any(|f| f == LEGO_NAME))
        .take(n)
        .collect()
}

#[test]
fn lego_runs_pass_under_their_own_key_and_count_their_events() {
    let mut total = Counters::default();
    let mut spans = 0;
    for (seed, cfg) in seeds_with_legos(6) {
        let r = run(seed, cfg, None, DeviceChoice::Cpu, None);
        assert!(!r.failed(), "seed {seed}: {:?}", r.failure);
        let key = r.layouts.keys().find(|k| k.starts_with("kv:bf16-first")).cloned();
        let key = key.unwrap_or_else(|| panic!("seed {seed}: {:?}", r.layouts.keys()));
        assert_eq!(r.layouts[&key].failures, 0);
        spans += r.layouts[&key].ops_by_kind.get("commit_span").copied().unwrap_or(0);
        total.add(&r.counters);
    }
    assert!(total.conversions > 0 && spans > 0, "{total:?}");
}
