//! Arbitrary bytes into the trace parser: typed errors only, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = kvsim::fuzzing::trace_json(data);
});
