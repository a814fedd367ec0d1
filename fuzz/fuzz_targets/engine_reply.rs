//! Arbitrary bytes as an engine process's replies: every decode kvsim makes of them is a value or a typed
//! `EngineFailure`, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = kvsim::fuzzing::engine_reply(data);
});
