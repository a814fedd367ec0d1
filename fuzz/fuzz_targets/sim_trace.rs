//! An arbitrary op stream through the runner and every check: any failing check is a crash.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Some(kvsim::sim::trace::Outcome::Fail { op_index, check, message }) = kvsim::fuzzing::sim_trace(data) {
        panic!("check failed at op {op_index}: [{check}] {message}");
    }
});
