//! A short smoke of `kvsim sim`: a band of seeds must pass every check, and cover every op kind.
use std::collections::BTreeSet;

use kvsim::sim::{run_seed, DeviceChoice};

#[test]
fn forty_seeds_pass_and_cover_every_op_kind() {
    let mut kinds = BTreeSet::new();
    let mut failures = vec![];
    for seed in 0..40u64 {
        let r = run_seed(seed, DeviceChoice::Cpu, None);
        kinds.extend(r.ops_by_kind.keys().cloned());
        if r.failed() {
            failures.push(format!("seed {seed}: {:?}", r.trace.outcome));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    for k in kvsim::sim::ops::OpKind::ALL {
        assert!(kinds.contains(k.name()), "op kind {} never ran in 40 seeds", k.name());
    }
}
