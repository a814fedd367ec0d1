//! `kvsim bench`: speed measured against an anchor in the same run, reported as ratios (never asserted in tests).
//!
//! - **sim**: simulator throughput on tiny shapes (H_q 4, H_kv 2, D 16, W 8): batched decode row-steps per second,
//!   each checked against its solo twin, side by side with mlx-lm's Python harness doing the same kind of schedule
//!   (`mlxlm_bench.py sim`: merge / decode / extract / filter over `BatchRotatingKVCache` with a solo
//!   `RotatingKVCache` per row and byte comparisons). kvsim additionally checks every row against the f64 model,
//!   its masks, layouts and kinds, so the ratio understates the per-check speed.
//! - **step**: one batched decode step (write + read) of `BatchRotatingKvCache` at B in {1, 8, 64}, H_q 32, H_kv 8,
//!   D 128, W in {1024, 4096}, bf16; time per step, K/V read bandwidth, against mlx-lm's `BatchRotatingKVCache` +
//!   SDPA (`mlxlm_bench.py step`) in the same run.

use std::process::Command;
use std::time::Instant;

use mlx_rs::{Array, Dtype};
use serde_json::{json, Value};

use crate::cache::{read_mode, set_read_mode, KvDtype, KvSpec, Masks, ReadMode, RingState, RowBatch, RowState};
use crate::sim::config::{DtypeChoice, LayoutChoice, SimConfig};
use crate::sim::ops::OpKind;
use crate::sim::{run, DeviceChoice};

/// The anchor harness: a Python with mlx + mlx-lm 0.32.2 and the anchor script.
#[derive(Debug, Clone)]
pub struct Anchor {
    pub python: String,
    pub script: String,
}

impl Anchor {
    fn run(&self, args: &[String]) -> Result<Value, String> {
        let out = Command::new(&self.python)
            .arg(&self.script)
            .args(args)
            .output()
            .map_err(|e| format!("cannot start {}: {e}", self.python))?;
        if !out.status.success() {
            return Err(format!("anchor failed: {}", String::from_utf8_lossy(&out.stderr)));
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let last = text.lines().rev().find(|l| l.trim_start().starts_with('{')).ok_or("anchor printed no JSON")?;
        serde_json::from_str(last).map_err(|e| e.to_string())
    }
}

/// A decode-heavy swarm config with the anchor's shapes.
fn sim_config(dtype: DtypeChoice, seed: u64) -> SimConfig {
    let mut c = SimConfig::from_seed(seed);
    c.layout = LayoutChoice::Rotating { window: 8 };
    c.dtype = dtype;
    c.heads_kv = 2;
    c.heads_q = 4;
    c.head_dim = 16;
    c.layers = 1;
    c.max_batch = 8;
    c.max_requests = 10;
    c.max_prompt = 19;
    c.max_chunk = 8;
    c.ops = 120;
    // The anchor runs the rotating attention family only: so does this side (the swarm's other families, drawn per
    // seed, would add work the anchor does not do).
    c.families = crate::sim::family::default_families();
    c.params.clear();
    c.weights = OpKind::ALL
        .iter()
        .map(|&k| {
            let w = match k {
                OpKind::Decode => 30,
                OpKind::Admit | OpKind::SoloWindow | OpKind::Merge | OpKind::Extract => 4,
                OpKind::Filter | OpKind::Join => 1,
                _ => 0,
            };
            (k, w)
        })
        .collect();
    c
}

/// kvsim's side of the throughput comparison.
pub fn sim_throughput(dtype: DtypeChoice, device: DeviceChoice, min_row_steps: u64) -> Value {
    let start = Instant::now();
    let (mut row_steps, mut ops, mut checks, mut seeds, mut failures) = (0u64, 0u64, 0u64, 0u64, 0u64);
    while row_steps < min_row_steps {
        let r = run(seeds, sim_config(dtype, seeds), None, device, None);
        let c = &r.counters;
        row_steps += c.decode_unpadded.compared + c.decode_padded.compared;
        ops += r.trace.ops.len() as u64 - r.skipped;
        checks += c.checks;
        failures += r.failed() as u64;
        seeds += 1;
    }
    let wall = start.elapsed().as_secs_f64();
    json!({"seeds": seeds, "ops": ops, "row_steps": row_steps, "checks": checks, "failures": failures, "wall_s": wall,
           "row_steps_per_s": row_steps as f64 / wall, "ops_per_s": ops as f64 / wall, "checks_per_s": checks as f64 / wall})
}

fn pseudo_block(shape: &[i32], salt: u64, dtype: Dtype) -> Result<Array, String> {
    let n: usize = shape.iter().map(|&x| x as usize).product();
    let data: Vec<f32> = (0..n as u64)
        .map(|i| {
            let mut z = (i ^ salt.rotate_left(17)).wrapping_mul(0x9e37_79b9_7f4a_7c15);
            z ^= z >> 29;
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    Array::from_slice(&data, shape).as_dtype(dtype).map_err(|e| e.to_string())
}

/// kvsim's batched rotating decode step (write + read) on full rings, each row at its own phase, in `mode`.
pub fn decode_step(device: DeviceChoice, b: usize, w: usize, iters: usize, mode: ReadMode) -> Result<Value, String> {
    device.activate();
    let before = read_mode();
    set_read_mode(mode);
    let r = decode_step_inner(b, w, iters);
    set_read_mode(before);
    r
}

fn decode_step_inner(b: usize, w: usize, iters: usize) -> Result<Value, String> {
    let (hq, hkv, d) = (32usize, 8usize, 128usize);
    let spec = KvSpec { heads_kv: hkv, head_dim: d, dtype: KvDtype::Bf16 };
    let dt = Dtype::Bfloat16;
    let k = pseudo_block(&[b as i32, hkv as i32, w as i32, d as i32], 1, dt)?;
    let v = pseudo_block(&[b as i32, hkv as i32, w as i32, d as i32], 2, dt)?;
    // Full rings; phases differ per row (each row keeps its own write head, as its solo ring would).
    let rows: Vec<RowState> = (0..b)
        .map(|r| {
            let idx = (r * 37) % w + 1;
            RowState {
                ring: RingState { offset: 10 * w + idx, len: w, idx, last_concat: None },
                base: 0,
                pending: None,
            }
        })
        .collect();
    let mut batch = RowBatch::adopt(spec, Some(w), k, v, rows).map_err(|e| e.to_string())?;
    let pool: Vec<(Array, Array, Array)> = (0..4)
        .map(|i| -> Result<_, String> {
            Ok((
                pseudo_block(&[b as i32, hkv as i32, 1, d as i32], 100 + i, dt)?,
                pseudo_block(&[b as i32, hkv as i32, 1, d as i32], 200 + i, dt)?,
                pseudo_block(&[b as i32, hq as i32, 1, d as i32], 300 + i, dt)?,
            ))
        })
        .collect::<Result<_, _>>()?;
    for (a, bb, c) in &pool {
        mlx_rs::transforms::eval([a, bb, c]).map_err(|e| e.to_string())?;
    }
    let scale = 1.0 / (d as f32).sqrt();
    let mut step = |i: usize| -> Result<f64, String> {
        let (kk, vv, qq) = &pool[i % pool.len()];
        let t0 = Instant::now();
        let masks = Masks::new();
        let (out, _) = batch.decode(kk, vv, qq, scale, &masks).map_err(|e| e.to_string())?;
        out.eval().map_err(|e| e.to_string())?;
        Ok(t0.elapsed().as_secs_f64() * 1e3)
    };
    for i in 0..5 {
        step(i)?;
    }
    let mut ts: Vec<f64> = (0..iters).map(|i| step(5 + i)).collect::<Result<_, _>>()?;
    ts.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let median = ts[ts.len() / 2];
    let mean = ts.iter().sum::<f64>() / ts.len() as f64;
    let bytes = 2 * b * hkv * w * d * 2;
    Ok(
        json!({"B": b, "W": w, "Hq": hq, "Hkv": hkv, "D": d, "dtype": "bf16", "steps": ts.len(), "read_mode": read_mode(),
              "ms_median": median, "ms_mean": mean, "ms_min": ts[0], "kv_bytes_per_step": bytes,
              "gbps_median": bytes as f64 / (median / 1e3) / 1e9}),
    )
}

/// Runs the benchmark set; `anchor` None skips the side-by-side runs (and says so in the output).
/// With `exact`, the simulator runs in [`ReadMode::Exact`] and every step row also times the exact read: `runs`
/// alternating runs of each mode (medians of their medians, and the spread of the run medians).
pub fn bench(device: DeviceChoice, what: &str, anchor: Option<&Anchor>, quick: bool, exact: bool) -> Value {
    let mut out = json!({"device": device.name(), "mlx_version": crate::sim::mlx_version(), "anchor": anchor.map(|a| a.script.clone()), "exact_read": exact, "inline_cpu": crate::sim::inline_cpu()});
    let before = read_mode();
    if exact {
        set_read_mode(ReadMode::Exact);
    }
    if what == "exact" {
        device.activate();
        out["exact"] = crate::exact_check::check(if quick { 1 } else { 3 });
    }
    if what == "sim" || what == "all" {
        let mut rows = vec![];
        for (dtype, name) in [(DtypeChoice::F32, "f32"), (DtypeChoice::Bf16, "bf16")] {
            let ours = sim_throughput(dtype, device, if quick { 300 } else { 3000 });
            let theirs = anchor.map(|a| {
                a.run(&[
                    "sim".into(),
                    "--heads-q".into(),
                    "4".into(),
                    "--heads-kv".into(),
                    "2".into(),
                    "--head-dim".into(),
                    "16".into(),
                    "--window".into(),
                    "8".into(),
                    "--requests".into(),
                    "64".into(),
                    "--max-batch".into(),
                    "8".into(),
                    "--steps".into(),
                    if quick { "150".into() } else { "1000".into() },
                    "--dtype".into(),
                    name.into(),
                    "--device".into(),
                    device.name().into(),
                ])
            });
            let mut row = json!({"dtype": name, "kvsim": ours});
            if let Some(t) = theirs {
                match t {
                    Ok(t) => {
                        let their_rate =
                            t["row_steps_compared"].as_f64().unwrap_or(0.0) / t["wall_s"].as_f64().unwrap_or(f64::NAN);
                        row["mlx_lm_harness"] = json!({"row_steps": t["row_steps_compared"], "wall_s": t["wall_s"], "cache_ops": t["cache_ops"],
                            "row_steps_per_s": their_rate, "cache_ops_per_s": t["cache_ops"].as_f64().unwrap_or(0.0) / t["wall_s"].as_f64().unwrap_or(f64::NAN)});
                        row["ratio_row_steps_per_s"] =
                            json!(row["kvsim"]["row_steps_per_s"].as_f64().unwrap_or(0.0) / their_rate);
                    }
                    Err(e) => row["mlx_lm_harness"] = json!({"error": e}),
                }
            }
            rows.push(row);
        }
        out["sim"] = json!(rows);
    }
    if what == "step" || what == "all" {
        let mut rows = vec![];
        let bs: &[usize] = if quick { &[1, 8] } else { &[1, 8, 64] };
        let ws: &[usize] = if quick { &[1024] } else { &[1024, 4096] };
        for &w in ws {
            for &b in bs {
                let iters = if device == DeviceChoice::Cpu { 5 } else { 50 };
                let mut row = json!({"B": b, "W": w});
                if exact {
                    row = step_modes(device, b, w, iters, if quick { 2 } else { 4 });
                } else {
                    match decode_step(device, b, w, iters, ReadMode::Fused) {
                        Ok(r) => row["kvsim"] = r,
                        Err(e) => row["kvsim"] = json!({"error": e}),
                    }
                }
                if let Some(a) = anchor {
                    let args: Vec<String> = [
                        "step",
                        "-B",
                        &b.to_string(),
                        "--heads-q",
                        "32",
                        "--heads-kv",
                        "8",
                        "--head-dim",
                        "128",
                        "--window",
                        &w.to_string(),
                        "--dtype",
                        "bf16",
                        "--device",
                        device.name(),
                        "--iters",
                        &iters.to_string(),
                        "--min-steps",
                        &iters.min(20).to_string(),
                        "--budget-s",
                        "3",
                    ]
                    .iter()
                    .map(|s| s.to_string())
                    .collect();
                    match a.run(&args) {
                        Ok(t) => {
                            let ratio = t["ms_median"].as_f64().unwrap_or(f64::NAN)
                                / row["kvsim"]["ms_median"].as_f64().unwrap_or(f64::NAN);
                            row["mlx_lm"] = json!({"ms_median": t["ms_median"], "gbps_median": t["gbps_median"], "sdpa_only_ms": t["sdpa_only_ms"], "update_only_ms": t["update_only_ms"]});
                            row["speedup_vs_mlx_lm"] = json!(ratio);
                            if let Some(ex) = row["kvsim_exact"]["ms_median"].as_f64() {
                                row["exact_speedup_vs_mlx_lm"] =
                                    json!(t["ms_median"].as_f64().unwrap_or(f64::NAN) / ex);
                            }
                        }
                        Err(e) => row["mlx_lm"] = json!({"error": e}),
                    }
                }
                rows.push(row);
            }
        }
        out["step"] = json!(rows);
    }
    set_read_mode(before);
    out
}

/// The anchor to measure against: `script` (default `$KVSIM_ANCHOR`, else `bench/mlxlm_bench.py`) run by `python`
/// (default `$KVSIM_ANCHOR_PYTHON`, else the oracle driver's venv, set up on demand).
pub fn find_anchor(python: Option<String>, anchor: Option<String>) -> Result<Anchor, String> {
    let script =
        anchor.or_else(|| std::env::var("KVSIM_ANCHOR").ok()).unwrap_or_else(|| "bench/mlxlm_bench.py".to_string());
    if !std::path::Path::new(&script).exists() {
        return Err(format!("anchor script {script} not found (pass --anchor or set KVSIM_ANCHOR)"));
    }
    let python = match python.or_else(|| std::env::var("KVSIM_ANCHOR_PYTHON").ok()) {
        Some(p) => p,
        None => crate::oracle::setup_driver()?.display().to_string(),
    };
    Ok(Anchor { python, script })
}

/// The machine a bench ran on (saved with its results).
pub fn machine_info() -> serde_json::Value {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_default();
    let gpu = Command::new("nvidia-smi")
        .args(["--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    serde_json::json!({"cpu": cpu, "cores": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0), "gpu": gpu,
        "kvsim": env!("CARGO_PKG_VERSION"), "mlx": crate::sim::mlx_version()})
}

/// The human-readable lines of a bench result (`kvsim bench` prints them).
pub fn summary_lines(r: &serde_json::Value) -> Vec<String> {
    let mut lines = vec![];
    if let Some(rows) = r["sim"].as_array() {
        lines.push(
            "simulator throughput (H 4/2, D 16, W 8; batched decode row-steps checked against solo twins):".into(),
        );
        for row in rows {
            lines.push(format!(
                "  {:<5} kvsim {:>9.0} row-steps/s   mlx-lm harness {:>9.0} row-steps/s   ratio {:.2}x",
                row["dtype"].as_str().unwrap_or(""),
                row["kvsim"]["row_steps_per_s"].as_f64().unwrap_or(f64::NAN),
                row["mlx_lm_harness"]["row_steps_per_s"].as_f64().unwrap_or(f64::NAN),
                row["ratio_row_steps_per_s"].as_f64().unwrap_or(f64::NAN)
            ));
        }
    }
    if let Some(rows) = r["step"].as_array() {
        lines.push("batched rotating decode step (bf16, H 32/8, D 128), write + read, median:".into());
        for row in rows {
            let g = row["kvsim"]["gbps_median"].as_f64().unwrap_or(f64::NAN);
            lines.push(format!(
                "  B {:>3} W {:>5}: kvsim {:>8.3} ms ({:>7.1} GB/s, {:>5.1}% of 4.8 TB/s)   mlx-lm {:>8.3} ms   speedup {:.2}x",
                row["B"], row["W"], row["kvsim"]["ms_median"].as_f64().unwrap_or(f64::NAN), g, g / 48.0,
                row["mlx_lm"]["ms_median"].as_f64().unwrap_or(f64::NAN), row["speedup_vs_mlx_lm"].as_f64().unwrap_or(f64::NAN)
            ));
        }
    }
    lines
}

/// Stamps a bench result with the machine (`machine`) and the time (`unix_time`) before it is saved.
pub fn stamp(r: &mut serde_json::Value) {
    r["machine"] = machine_info();
    r["unix_time"] = serde_json::json!(std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0));
}

/// `runs` alternating runs of the fused and the exact step: per mode the median of the run medians and their
/// spread (min, max); `kvsim` is the faster mode's summary, `exact_over_fastest` the exact mode's cost.
fn step_modes(device: DeviceChoice, b: usize, w: usize, iters: usize, runs: usize) -> Value {
    let mut meds: [Vec<f64>; 2] = [vec![], vec![]];
    let mut last: [Value; 2] = [Value::Null, Value::Null];
    let mut errors = vec![];
    for _ in 0..runs {
        for (m, mode) in [ReadMode::Fused, ReadMode::Exact].into_iter().enumerate() {
            match decode_step(device, b, w, iters, mode) {
                Ok(r) => {
                    meds[m].push(r["ms_median"].as_f64().unwrap_or(f64::NAN));
                    last[m] = r;
                }
                Err(e) => errors.push(e),
            }
        }
    }
    let summary = |m: usize| -> Value {
        let mut v = meds[m].clone();
        if v.is_empty() {
            return json!({"error": errors.first().cloned().unwrap_or_default()});
        }
        v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
        let med = v[v.len() / 2];
        let bytes = last[m]["kv_bytes_per_step"].as_f64().unwrap_or(f64::NAN);
        json!({"ms_median": med, "ms_run_medians": meds[m], "ms_spread": [v[0], v[v.len() - 1]],
               "gbps_median": bytes / (med / 1e3) / 1e9, "kv_bytes_per_step": bytes, "steps_per_run": last[m]["steps"],
               "read_mode": last[m]["read_mode"]})
    };
    let (fused, exact) = (summary(0), summary(1));
    let (f, e) = (fused["ms_median"].as_f64().unwrap_or(f64::NAN), exact["ms_median"].as_f64().unwrap_or(f64::NAN));
    let fastest = if e < f { exact.clone() } else { fused.clone() };
    json!({"B": b, "W": w, "kvsim": fastest, "kvsim_fused": fused, "kvsim_exact": exact,
           "exact_over_fused": e / f, "exact_over_fastest": e / f.min(e)})
}
