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

/// The trace a fuzz input runs (its config seed, config and ops, with the outcome it reaches now), so a fuzz crash
/// can be replayed and shrunk like any simulator failure. `None` when the bytes do not decode to a case.
pub fn case_to_trace(data: &[u8]) -> Option<Trace> {
    let mut u = Unstructured::new(data);
    let mut case = FuzzCase::arbitrary(&mut u).ok()?;
    case.ops.truncate(64);
    let cfg = SimConfig::from_seed(case.config_seed as u64);
    let mut t = run(case.config_seed as u64, cfg, Some(case.ops.clone()), DeviceChoice::Cpu, None).trace;
    // Keep every op of the case, also those after a failure, so that the trace replays exactly what the fuzzer ran.
    t.ops = case.ops;
    Some(t)
}

/// Arbitrary bytes as a cache file (either format): [`kvsim_persist::inspect::inspect_bytes`] must give a
/// description or a typed error, never a panic. When the bytes load as kvsim layouts, saving them again in both
/// formats must give files that load back with the same per-layer kinds (a failure panics: a crash for the fuzzer).
/// Returns the number of layers described.
pub fn cache_file(data: &[u8]) -> Result<usize, String> {
    use kvsim_persist::inspect::{inspect_bytes, load_any, save_as, Format};
    let info = inspect_bytes(data).map_err(|e| e.to_string())?;
    if let Ok((md, caches)) = load_any(data) {
        for to in [Format::Kvsim, Format::MlxLm] {
            if let Ok(bytes) = save_as(to, &md, &caches) {
                let (_, again) =
                    load_any(&bytes).unwrap_or_else(|e| panic!("a file kvsim wrote ({to:?}) does not load: {e}"));
                let kinds =
                    |c: &[kvsim_persist::Persisted]| c.iter().map(|p| p.cache.storage_kind()).collect::<Vec<_>>();
                assert_eq!(kinds(&again), kinds(&caches), "storage kinds changed through {to:?}");
            }
        }
    }
    Ok(info.layers.len())
}

/// Arbitrary bytes as an engine's output: the first byte picks the run's geometry (dtype, heads, head dim, plain or
/// 4-bit quantized in groups of 32 over a head dim of 32) and whether the output is read as binary frames, each
/// following line is decoded as the reply to every request kvsim sends ([`crate::byoc::engine_check::decode_any`]): typed
/// `EngineFailure`s or values, never a panic. Returns the decodes that succeeded.
pub fn engine_reply(data: &[u8]) -> usize {
    let Some((&pick, rest)) = data.split_first() else { return 0 };
    let quant = (pick & 16 != 0).then_some(crate::byoc::QuantGeometry { bits: 4, group_size: 32 });
    let g = crate::byoc::Geometry {
        heads_kv: 1 + usize::from(pick & 1),
        heads_q: 2 + 2 * usize::from(pick & 1),
        head_dim: if quant.is_some() { 32 } else { [1, 2, 4, 8][usize::from(pick >> 1 & 3)] },
        dtype: if pick & 8 == 0 { mlx_rs::Dtype::Float32 } else { mlx_rs::Dtype::Bfloat16 },
        max_size: None,
        quant,
    };
    if pick & 32 != 0 {
        // Binary frames (oracles/PROTOCOL.md, "Binary frames"): each frame's line decoded against its own bytes.
        use crate::byoc::engine::frame::{next_frame, set_blob, Line};
        let mut r = std::io::Cursor::new(rest);
        let mut ok = 0;
        while let Line::Full(line, blob) = next_frame(&mut r, true) {
            set_blob(blob);
            ok += crate::byoc::engine_check::decode_any(&line, &g);
        }
        set_blob(vec![]);
        return ok;
    }
    let text = String::from_utf8_lossy(rest);
    text.split_inclusive('\n').map(|line| crate::byoc::engine_check::decode_any(line, &g)).sum()
}
