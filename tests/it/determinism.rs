//! One seed decides the whole run: the same seed twice gives the same trace and the same result hash.
use kvsim::sim::{run_seed, DeviceChoice};

#[test]
fn same_seed_same_trace_and_hash() {
    // Seed 46 holds the recurrent family with a row whose real range starts at the window's end: its padded
    // positions once gathered one row past the conv input (MLX read outside the array), so its hash varied per run.
    for seed in [1u64, 17, 46, 4242] {
        let a = run_seed(seed, DeviceChoice::Cpu, None);
        let b = run_seed(seed, DeviceChoice::Cpu, None);
        assert_eq!(a.trace.ops, b.trace.ops, "seed {seed}: op streams differ");
        assert_eq!(a.trace.digests, b.trace.digests, "seed {seed}: per-op digests differ");
        assert_eq!(a.trace.result_hash, b.trace.result_hash, "seed {seed}: result hashes differ");
        assert!(!a.trace.result_hash.is_empty());
    }
    // And different seeds give different runs.
    assert_ne!(
        run_seed(1, DeviceChoice::Cpu, None).trace.result_hash,
        run_seed(2, DeviceChoice::Cpu, None).trace.result_hash
    );
}
