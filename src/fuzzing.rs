//! Entry points shared by the cargo-fuzz targets (`fuzz/`) and by `cargo test`, which replays the fuzz corpora on
//! stable through these same functions.

use arbitrary::{Arbitrary, Unstructured};

use crate::sim::config::SimConfig;
use crate::sim::ops::Op;
use crate::sim::trace::{Outcome, Trace};
use crate::sim::{run, DeviceChoice};

/// Arbitrary bytes into the trace parser: any input must give a trace or a typed error, never a panic.
pub fn trace_json(data: &[u8]) -> Result<Trace, String> {
    let text = std::str::from_utf8(data).map_err(|e| e.to_string())?;
    Trace::parse(text).map_err(|e| e.to_string())
}

/// The op stream a fuzzer builds from raw bytes: a config seed and up to 64 ops.
#[derive(Debug, Clone, Arbitrary)]
pub struct FuzzCase {
    pub config_seed: u16,
    pub ops: Vec<Op>,
}

/// Arbitrary bytes -> config + op stream -> the runner with every check. Returns the outcome; a fuzz target treats
/// a failure as a crash.
pub fn sim_trace(data: &[u8]) -> Option<Outcome> {
    let mut u = Unstructured::new(data);
    let mut case = FuzzCase::arbitrary(&mut u).ok()?;
    case.ops.truncate(64);
    let cfg = SimConfig::from_seed(case.config_seed as u64);
    let r = run(case.config_seed as u64, cfg, Some(case.ops), DeviceChoice::Cpu, None);
    Some(r.trace.outcome)
}
