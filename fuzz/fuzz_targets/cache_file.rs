//! Arbitrary bytes as a cache file (kvsim's format or an mlx-lm prompt cache): typed errors only, never a panic;
//! whatever loads must save and load again in both formats.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = kvsim::fuzzing::cache_file(data);
});
