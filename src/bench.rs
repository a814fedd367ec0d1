//! `kvsim bench`: speed measured against an anchor in the same run, reported as ratios (never asserted in tests).
//!
//! - **sim**: simulator throughput on tiny shapes (H_q 4, H_kv 2, D 16, W 8): batched decode row-steps per second,
//!   each checked against its solo twin, side by side with mlx-lm's Python harness doing the same kind of schedule
//!   (`mlxlm_bench.py sim`: merge / decode / extract / filter over `BatchRotatingKVCache` with a solo
//!   `RotatingKVCache` per row and byte comparisons). kvsim additionally checks every row against the f64 model,
//!   its masks, layouts and kinds, so the ratio understates the per-check speed.
//! - **step**: one batched decode step (write + read) of `BatchRotatingKvCache` at B in {1, 8, 64}, H_q 32, H_kv 8,
//!   D 128, W in {1024, 4096}, bf16; time per step and its bandwidth as a fraction of a device copy of the same
//!   K/V timed in the same runs ([`copy_roofline`]; the spec sheet's peak is a label only), against mlx-lm's
//!   `BatchRotatingKVCache` + SDPA (`mlxlm_bench.py step`) in the same run.

use std::process::Command;
use std::time::Instant;

use mlx_rs::{Array, Dtype};
use serde_json::{json, Value};

use crate::cache::{read_mode, set_read_mode, KvDtype, KvSpec, Masks, ReadMode, RingState, RowBatch, RowState};
use crate::sim::config::{DtypeChoice, LayoutChoice, SimConfig};
use crate::sim::ops::{Op, OpKind};
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

/// The anchor harness's workload (`mlxlm_bench.py sim`), as data both sides run: requests with a prompt and a
/// generation length and the prefill chunks of each, admitted as batch rows free up (`max_batch` at most), every
/// running row decoding once per step, finished rows leaving the batch.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Schedule {
    pub window: usize,
    pub max_batch: usize,
    pub steps: usize,
    /// `(prompt, generation, prefill chunks)` per request, in admission order; the chunks sum to the prompt.
    pub requests: Vec<(usize, usize, Vec<usize>)>,
}

impl Schedule {
    /// The harness's own draws (`mlxlm_bench.py`, `run_sim`): prompt uniform in `[1, 2W + 3]`, generation uniform in
    /// `[1, max(2, 2 * steps * max_batch / requests)]`, each chunk uniform in `[1, W]` (cut at the prompt's end),
    /// from a ChaCha8 stream of `seed` (the harness draws the same distributions from Python's `random`).
    pub fn harness(seed: u64, window: usize, requests: usize, max_batch: usize, steps: usize) -> Schedule {
        use rand::{Rng, SeedableRng};
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
        let prompt_max = 2 * window + 3;
        let gen_max = (2 * steps * max_batch / requests).max(2);
        let requests = (0..requests)
            .map(|_| {
                let (p, g) = (rng.random_range(1..=prompt_max), rng.random_range(1..=gen_max));
                let mut chunks = vec![];
                let mut left = p;
                while left > 0 {
                    let l = rng.random_range(1..=window).min(left);
                    chunks.push(l);
                    left -= l;
                }
                (p, g, chunks)
            })
            .collect();
        Schedule { window, max_batch, steps, requests }
    }

    /// kvsim's ops for this schedule, step for step as the harness runs it: per step, the free rows' requests are
    /// admitted (`admit`, their chunks as `solo_window` reads, then one `merge` into the running batch), every row
    /// decodes (`decode`), and each finished row leaves (`extract` with `finish`, last row first). The harness
    /// extracts its finished rows and filters once; kvsim filters once per finished row, a little more work.
    pub fn ops(&self) -> Vec<Op> {
        let mut ops = vec![];
        let mut pending = 0..self.requests.len();
        let mut rows: Vec<(usize, usize)> = vec![]; // (request, tokens generated)
        for _ in 0..self.steps {
            if rows.is_empty() && pending.is_empty() {
                break;
            }
            let free = self.max_batch - rows.len();
            let new: Vec<usize> = pending.by_ref().take(free).collect();
            if !new.is_empty() {
                for &r in &new {
                    ops.push(Op::Admit { req: r as u32 });
                    for &l in &self.requests[r].2 {
                        ops.push(Op::SoloWindow { req: r as u32, len: l as u32 });
                    }
                    rows.push((r, 0));
                }
                ops.push(Op::Merge { reqs: new.iter().map(|&r| r as u32).collect() });
            }
            ops.push(Op::Decode);
            for row in rows.iter_mut() {
                row.1 += 1;
            }
            for i in (0..rows.len()).rev() {
                if rows[i].1 >= self.requests[rows[i].0].1 {
                    ops.push(Op::Extract { row: i as u32, finish: true });
                    rows.remove(i);
                }
            }
        }
        ops
    }

    /// Row-steps the schedule decodes (each running row's decode, checked against its solo twin on both sides).
    pub fn row_steps(&self) -> u64 {
        self.ops()
            .iter()
            .scan(0u64, |rows, op| {
                Some(match op {
                    Op::Merge { reqs } => {
                        *rows += reqs.len() as u64;
                        0
                    }
                    Op::Extract { .. } => {
                        *rows -= 1;
                        0
                    }
                    Op::Decode => *rows,
                    _ => 0,
                })
            })
            .sum()
    }
}

/// The swarm config that runs a [`Schedule`]: the anchor's shapes (H_q 4, H_kv 2, D 16, one layer), its window,
/// `dtype`, the attention family alone, every kvsim check on.
fn schedule_config(dtype: DtypeChoice, s: &Schedule) -> SimConfig {
    let mut c = sim_config(dtype, 0);
    c.layout = LayoutChoice::Rotating { window: s.window };
    c.max_batch = s.max_batch;
    c.max_requests = s.requests.len();
    c.max_prompt = s.requests.iter().map(|r| r.0).max().unwrap_or(1);
    c.ops = 0;
    c
}

/// kvsim's side of the equal-work comparison: the schedule's ops, every check on, on `device`.
pub fn schedule_throughput(dtype: DtypeChoice, device: DeviceChoice, s: &Schedule) -> Value {
    let ops = s.ops();
    let n_ops = ops.len();
    let start = Instant::now();
    let r = run(0, schedule_config(dtype, s), Some(ops), device, None);
    let wall = start.elapsed().as_secs_f64();
    let c = &r.counters;
    let row_steps = c.decode_unpadded.compared + c.decode_padded.compared;
    let failure = match &r.trace.outcome {
        crate::sim::trace::Outcome::Pass => Value::Null,
        crate::sim::trace::Outcome::Fail { op_index, check, message } => {
            json!({"op_index": op_index, "check": check, "message": message})
        }
    };
    json!({"ops": n_ops, "skipped": r.skipped, "row_steps": row_steps, "row_steps_scheduled": s.row_steps(),
           "checks": c.checks, "failure": failure, "wall_s": wall, "row_steps_per_s": row_steps as f64 / wall,
           "checks_per_s": c.checks as f64 / wall, "ops_by_kind": r.ops_by_kind})
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

/// The step bench's shape: query heads, K/V heads, head dimension (bf16).
const STEP_HEADS: (usize, usize, usize) = (32, 8, 128);

/// Bytes of the K and V rings of `b` rows of `w` columns (bf16).
fn kv_bytes(b: usize, w: usize) -> usize {
    let (_, hkv, d) = STEP_HEADS;
    2 * b * hkv * w * d * 2
}

/// Bytes one step moves at `b` rows of `w` columns: every K and V column read, one new K and V column per row
/// written, the queries read and the output written (bf16).
fn step_bytes(b: usize, w: usize) -> usize {
    let (hq, hkv, d) = STEP_HEADS;
    kv_bytes(b, w) + 2 * b * hkv * d * 2 + 2 * b * hq * d * 2
}

/// The wall times (ms, sorted) of `iters` calls of `step(i)` after 5 warm-up calls.
fn time_calls(iters: usize, mut step: impl FnMut(usize) -> Result<(), String>) -> Result<Vec<f64>, String> {
    for i in 0..5 {
        step(i)?;
    }
    let mut ts = Vec::with_capacity(iters);
    for i in 0..iters {
        let t0 = Instant::now();
        step(5 + i)?;
        ts.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    ts.sort_by(|a, b| a.total_cmp(b));
    Ok(ts)
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
    let (hq, hkv, d) = STEP_HEADS;
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
    let mut step = |i: usize| -> Result<(), String> {
        let (kk, vv, qq) = &pool[i % pool.len()];
        let masks = Masks::new();
        let (out, _) = batch.decode(kk, vv, qq, scale, &masks).map_err(|e| e.to_string())?;
        out.eval().map_err(|e| e.to_string())
    };
    // MLX memory a step allocates beyond what is live before it (0 when the write lands in place).
    step(0)?;
    let active = mlx_rs::memory::active_memory().unwrap_or(0);
    let _ = mlx_rs::memory::reset_peak_memory();
    step(1)?;
    let extra = mlx_rs::memory::peak_memory().unwrap_or(0).saturating_sub(active);
    let ts = time_calls(iters, step)?;
    let median = ts[ts.len() / 2];
    let mean = ts.iter().sum::<f64>() / ts.len() as f64;
    let kv = kv_bytes(b, w);
    let moved = step_bytes(b, w);
    Ok(
        json!({"B": b, "W": w, "Hq": hq, "Hkv": hkv, "D": d, "dtype": "bf16", "steps": ts.len(), "read_mode": read_mode(),
              "ms_median": median, "ms_mean": mean, "ms_min": ts[0], "kv_bytes_per_step": kv, "bytes_moved": moved,
              "gbps_median": moved as f64 / (median / 1e3) / 1e9, "alloc_over_kv": extra as f64 / kv as f64}),
    )
}

/// The copy roofline of a step at `b` rows of `w` columns: a device copy of K and V (the step's rings: the same
/// shapes and dtype) timed like the step (one evaluation per call, `iters` calls after 5 warm-up ones). Three copies
/// are timed and the fastest sets the roofline: `x * 1` (an elementwise kernel that moves bytes only), `astype` to
/// float16 (MLX's copy kernel) and a concatenation of K and V. A copy reads and writes every byte, so its bandwidth is
/// `2 * kv_bytes / time`.
pub fn copy_roofline(device: DeviceChoice, b: usize, w: usize, iters: usize) -> Result<Value, String> {
    device.activate();
    let (_, hkv, d) = STEP_HEADS;
    let dt = Dtype::Bfloat16;
    let shape = [b as i32, hkv as i32, w as i32, d as i32];
    let (k, v) = (pseudo_block(&shape, 1, dt)?, pseudo_block(&shape, 2, dt)?);
    let one = Array::from_f32(1.0).as_dtype(dt).map_err(|e| e.to_string())?;
    mlx_rs::transforms::eval([&k, &v, &one]).map_err(|e| e.to_string())?;
    let e = |e: mlx_rs::error::Exception| e.to_string();
    let kinds: [(&str, &dyn Fn() -> Result<(), String>); 3] = [
        ("mul1", &|| {
            mlx_rs::transforms::eval([&k.multiply(&one).map_err(e)?, &v.multiply(&one).map_err(e)?]).map_err(e)
        }),
        ("astype", &|| {
            mlx_rs::transforms::eval([&k.as_dtype(Dtype::Float16).map_err(e)?, &v.as_dtype(Dtype::Float16).map_err(e)?])
                .map_err(e)
        }),
        ("concat", &|| mlx_rs::ops::concatenate(&[&k, &v], 0).map_err(e)?.eval().map_err(e)),
    ];
    let kv = kv_bytes(b, w);
    let mut out = json!({"B": b, "W": w, "kv_bytes": kv, "bytes_moved": 2 * kv});
    let mut best: Option<(f64, &str)> = None;
    for (name, f) in kinds {
        let ts = time_calls(iters, |_| f())?;
        let med = ts[ts.len() / 2];
        out[name] = json!({"ms_median": med, "ms_min": ts[0]});
        if best.is_none_or(|(m, _)| med < m) {
            best = Some((med, name));
        }
    }
    let (med, name) = best.ok_or("no copy timed")?;
    out["ms_median"] = json!(med);
    out["fastest"] = json!(name);
    out["gbps_median"] = json!(2.0 * kv as f64 / (med / 1e3) / 1e9);
    Ok(out)
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
        out["sim"] = json!(sim_rows(device, anchor, quick));
    }
    if what == "step" || what == "all" {
        let mut rows = vec![];
        let bs: &[usize] = if quick { &[1, 8] } else { &[1, 8, 64] };
        let ws: &[usize] = if quick { &[1024] } else { &[1024, 4096] };
        for &w in ws {
            for &b in bs {
                let iters = if device == DeviceChoice::Cpu { 5 } else { 50 };
                let mut row = step_modes(device, b, w, iters, if quick { 2 } else { 4 }, exact);
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
                            let copy_gbps = row["copy"]["gbps_median"].as_f64().unwrap_or(f64::NAN);
                            let gbps =
                                step_bytes(b, w) as f64 / (t["ms_median"].as_f64().unwrap_or(f64::NAN) / 1e3) / 1e9;
                            row["mlx_lm"]["of_copy"] = json!(gbps / copy_gbps);
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
        out["step_device"] = step_device(device);
    }
    set_read_mode(before);
    out
}

/// Median and spread (min, max) of `xs` (NaN-free; `null` when empty).
fn median_spread(mut xs: Vec<f64>) -> Value {
    xs.retain(|x| x.is_finite());
    if xs.is_empty() {
        return Value::Null;
    }
    xs.sort_by(|a, b| a.total_cmp(b));
    json!({"median": xs[xs.len() / 2], "min": xs[0], "max": xs[xs.len() - 1], "runs": xs})
}

/// The anchor's arguments for its `sim` run at the bench's shapes on `device` (`--schedule FILE` replaces its
/// own draws with a [`Schedule`]).
fn anchor_sim_args(dtype: &str, device: DeviceChoice, steps: usize, schedule: Option<&std::path::Path>) -> Vec<String> {
    let mut a: Vec<String> = ["sim", "--heads-q", "4", "--heads-kv", "2", "--head-dim", "16", "--window", "8"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    a.extend(["--requests".into(), "64".into(), "--max-batch".into(), "8".into(), "--steps".into(), steps.to_string()]);
    a.extend(["--dtype".into(), dtype.into(), "--device".into(), device.name().into()]);
    if let Some(p) = schedule {
        a.extend(["--schedule".into(), p.display().to_string()]);
    }
    a
}

/// The harness's figures of one run (`row_steps_per_s` of its checked row-steps), or its error.
fn anchor_figures(t: Result<Value, String>) -> Value {
    match t {
        Ok(t) => {
            let wall = t["wall_s"].as_f64().unwrap_or(f64::NAN);
            json!({"row_steps": t["row_steps_compared"], "wall_s": wall, "cache_ops": t["cache_ops"],
                   "out_bitwise_equal": t["out_bitwise_equal"], "state_bitwise_equal": t["state_bitwise_equal"],
                   "row_steps_per_s": t["row_steps_compared"].as_f64().unwrap_or(0.0) / wall,
                   "cache_ops_per_s": t["cache_ops"].as_f64().unwrap_or(0.0) / wall})
        }
        Err(e) => json!({"error": e}),
    }
}

/// The simulator's rows: per dtype, `runs` alternating runs of (a) **equal work**: kvsim and the harness on one
/// [`Schedule`] (the same requests, lengths, chunks and batch size), and (b) **whole swarm**: kvsim's own decode-heavy
/// swarm beside the harness on its own draws. Medians and spreads of the run figures and of the per-run ratios.
fn sim_rows(device: DeviceChoice, anchor: Option<&Anchor>, quick: bool) -> Vec<Value> {
    let runs = if quick { 1 } else { 3 };
    let steps = if quick { 150 } else { 1000 };
    let schedule = Schedule::harness(0, 8, 64, 8, steps);
    let path = std::env::temp_dir().join(format!("kvsim-bench-schedule-{}.json", std::process::id()));
    let wrote = std::fs::write(&path, serde_json::to_string(&schedule).unwrap_or_default());
    let mut rows = vec![];
    for (dtype, name) in [(DtypeChoice::F32, "f32"), (DtypeChoice::Bf16, "bf16")] {
        let (mut eq_ours, mut eq_theirs, mut eq_ratio) = (vec![], vec![], vec![]);
        let (mut sw_ours, mut sw_theirs, mut sw_ratio) = (vec![], vec![], vec![]);
        let (mut last_eq, mut last_eq_anchor, mut last_sw, mut last_sw_anchor) =
            (Value::Null, Value::Null, Value::Null, Value::Null);
        for _ in 0..runs {
            let ours = schedule_throughput(dtype, device, &schedule);
            let theirs = anchor.map(|a| match &wrote {
                Ok(()) => anchor_figures(a.run(&anchor_sim_args(name, device, steps, Some(&path)))),
                Err(e) => json!({"error": format!("cannot write the schedule: {e}")}),
            });
            let o = ours["row_steps_per_s"].as_f64().unwrap_or(f64::NAN);
            eq_ours.push(o);
            if let Some(t) = &theirs {
                let t = t["row_steps_per_s"].as_f64().unwrap_or(f64::NAN);
                eq_theirs.push(t);
                eq_ratio.push(o / t);
            }
            last_eq = ours;
            last_eq_anchor = theirs.unwrap_or(Value::Null);

            let ours = sim_throughput(dtype, device, if quick { 300 } else { 3000 });
            let theirs = anchor.map(|a| anchor_figures(a.run(&anchor_sim_args(name, device, steps, None))));
            let o = ours["row_steps_per_s"].as_f64().unwrap_or(f64::NAN);
            sw_ours.push(o);
            if let Some(t) = &theirs {
                let t = t["row_steps_per_s"].as_f64().unwrap_or(f64::NAN);
                sw_theirs.push(t);
                sw_ratio.push(o / t);
            }
            last_sw = ours;
            last_sw_anchor = theirs.unwrap_or(Value::Null);
        }
        rows.push(json!({
            "dtype": name,
            "equal_work": {"kvsim": last_eq, "mlx_lm_harness": last_eq_anchor,
                           "kvsim_row_steps_per_s": median_spread(eq_ours), "harness_row_steps_per_s": median_spread(eq_theirs),
                           "ratio": median_spread(eq_ratio)},
            "whole_swarm": {"kvsim": last_sw, "mlx_lm_harness": last_sw_anchor,
                            "kvsim_row_steps_per_s": median_spread(sw_ours), "harness_row_steps_per_s": median_spread(sw_theirs),
                            "ratio": median_spread(sw_ratio)},
        }));
    }
    let _ = std::fs::remove_file(&path);
    rows
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
            "simulator throughput (H 4/2, D 16, W 8; checked row-steps per second, median [min, max] of the runs):"
                .into(),
        );
        let f = |v: &Value| -> String {
            format!(
                "{:>8.0} [{:.0}, {:.0}]",
                v["median"].as_f64().unwrap_or(f64::NAN),
                v["min"].as_f64().unwrap_or(f64::NAN),
                v["max"].as_f64().unwrap_or(f64::NAN)
            )
        };
        for row in rows {
            for (key, what) in [("equal_work", "equal work "), ("whole_swarm", "whole swarm")] {
                let x = &row[key];
                lines.push(format!(
                    "  {:<5} {what}  kvsim {}   mlx-lm harness {}   ratio {:.2}x [{:.2}, {:.2}]",
                    row["dtype"].as_str().unwrap_or(""),
                    f(&x["kvsim_row_steps_per_s"]),
                    f(&x["harness_row_steps_per_s"]),
                    x["ratio"]["median"].as_f64().unwrap_or(f64::NAN),
                    x["ratio"]["min"].as_f64().unwrap_or(f64::NAN),
                    x["ratio"]["max"].as_f64().unwrap_or(f64::NAN)
                ));
            }
        }
    }
    if let Some(rows) = r["step"].as_array() {
        let dev = &r["step_device"];
        lines.push(format!(
            "batched rotating decode step (bf16, H 32/8, D 128), write + read, on {} (spec sheet {}); median of run \
             medians, bandwidth as a fraction of a K/V copy timed in the same run:",
            dev["name"].as_str().unwrap_or("?"),
            dev["spec_peak_label"].as_str().unwrap_or("unknown")
        ));
        let ms = |v: &Value| v["ms_median"].as_f64().unwrap_or(f64::NAN);
        for row in rows {
            let mut line = format!(
                "  B {:>3} W {:>5}: copy {:>7.3} ms ({:>6.0} GB/s)",
                row["B"],
                row["W"],
                ms(&row["copy"]),
                row["copy"]["gbps_median"].as_f64().unwrap_or(f64::NAN)
            );
            for (key, what) in [("kvsim_fused", "fused"), ("kvsim_exact", "exact")] {
                if row[key].is_object() {
                    line += &format!(
                        "   {what} {:>7.3} ms ({:>5.1}% of copy)",
                        ms(&row[key]),
                        100.0 * row[key]["of_copy"].as_f64().unwrap_or(f64::NAN)
                    );
                }
            }
            if row["mlx_lm"].is_object() {
                line += &format!(
                    "   mlx-lm {:>7.3} ms   speedup {:.2}x",
                    ms(&row["mlx_lm"]),
                    row["speedup_vs_mlx_lm"].as_f64().unwrap_or(f64::NAN)
                );
            }
            lines.push(line);
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

/// `runs` alternating runs of the fused step, the exact step (with `exact`) and the copy roofline
/// ([`copy_roofline`]): per mode the median of the run medians and their spread (min, max), and each step's bandwidth
/// as a fraction of the copy's (`of_copy`); `kvsim` is the faster mode's summary, `exact_over_fastest` the exact
/// mode's cost.
fn step_modes(device: DeviceChoice, b: usize, w: usize, iters: usize, runs: usize, exact: bool) -> Value {
    let modes: &[Option<ReadMode>] =
        if exact { &[Some(ReadMode::Fused), Some(ReadMode::Exact), None] } else { &[Some(ReadMode::Fused), None] };
    let mut meds: Vec<Vec<f64>> = vec![vec![]; modes.len()];
    let mut last: Vec<Value> = vec![Value::Null; modes.len()];
    let mut errors = vec![];
    for _ in 0..runs {
        for (m, mode) in modes.iter().enumerate() {
            let r = match mode {
                Some(mode) => decode_step(device, b, w, iters, *mode),
                None => copy_roofline(device, b, w, iters),
            };
            match r {
                Ok(r) => {
                    meds[m].push(r["ms_median"].as_f64().unwrap_or(f64::NAN));
                    last[m] = r;
                }
                Err(e) => errors.push(e),
            }
        }
    }
    let summary = |m: usize| -> Value {
        let ms = median_spread(meds[m].clone());
        let Some(med) = ms["median"].as_f64() else {
            return json!({"error": errors.first().cloned().unwrap_or_default()});
        };
        let mut s = last[m].clone();
        let bytes = s["bytes_moved"].as_f64().unwrap_or(f64::NAN);
        s["ms_median"] = json!(med);
        s["ms_run_medians"] = json!(meds[m]);
        s["ms_spread"] = json!([ms["min"], ms["max"]]);
        s["gbps_median"] = json!(bytes / (med / 1e3) / 1e9);
        s
    };
    let copy = summary(modes.len() - 1);
    let copy_gbps = copy["gbps_median"].as_f64().unwrap_or(f64::NAN);
    let with_roofline = |mut s: Value| {
        s["of_copy"] = json!(s["gbps_median"].as_f64().unwrap_or(f64::NAN) / copy_gbps);
        s
    };
    let fused = with_roofline(summary(0));
    let mut row = json!({"B": b, "W": w, "copy": copy, "kvsim": fused.clone(), "kvsim_fused": fused});
    if exact {
        let exact = with_roofline(summary(1));
        let f = row["kvsim_fused"]["ms_median"].as_f64().unwrap_or(f64::NAN);
        let e = exact["ms_median"].as_f64().unwrap_or(f64::NAN);
        if e < f {
            row["kvsim"] = exact.clone();
        }
        row["exact_over_fused"] = json!(e / f);
        row["exact_over_fastest"] = json!(e / f.min(e));
        row["kvsim_exact"] = exact;
    }
    row
}

/// The device a step bench ran on, by name (the GPU's, from `nvidia-smi`, or the CPU's), and the spec sheet's memory
/// bandwidth of the cards known by name, as a label only (every fraction the bench reports is of the copy it timed).
fn step_device(device: DeviceChoice) -> Value {
    let m = machine_info();
    let name = if device == DeviceChoice::Cpu { m["cpu"].clone() } else { m["gpu"].clone() };
    let label = name.as_str().and_then(|n| {
        [
            ("H200", "4.8 TB/s (H200 spec sheet)"),
            ("H100 PCIe", "2.0 TB/s (H100 PCIe spec sheet)"),
            ("H100 NVL", "3.9 TB/s (H100 NVL spec sheet)"),
            ("H100", "3.35 TB/s (H100 SXM spec sheet)"),
        ]
        .iter()
        .find(|(k, _)| n.contains(k))
        .map(|(_, l)| *l)
    });
    json!({"name": name, "spec_peak_label": label})
}
