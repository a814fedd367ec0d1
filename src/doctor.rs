//! `kvsim doctor`: which MLX is loaded, which devices exist, and whether MLX's fused SDPA agrees with a pure-Rust
//! f64 reference on each device (measured in bf16 ULPs).

use mlx_rs::fast::{scaled_dot_product_attention, ScaledDotProductAttentionMask};
use mlx_rs::{Array, Dtype};

use crate::bytes::{ulp_distance, ArrayBytes};
use crate::sim::DeviceChoice;

/// Largest error `doctor` accepts, in bf16 ULPs at the output's scale (see `sim::check::ulp_at`: magnitudes below
/// 2^-6 are measured in the ULP of 2^-6, since a near-zero convex combination's relative error is meaningless).
/// MLX rounds intermediates of a bf16 SDPA to bf16 (measured: 4.8 ULP on CPU), so a correct read stays well under 8;
/// a misplaced key or a wrong mask moves outputs by far more.
pub const SDPA_ULP_BOUND: f64 = 8.0;

/// Whether MLX reports a usable GPU (the CUDA runtime on Linux).
pub fn gpu_available() -> bool {
    let mut n: std::os::raw::c_int = 0;
    let rc = unsafe { mlx_sys::mlx_device_count(&mut n, mlx_sys::mlx_device_type__MLX_GPU) };
    rc == 0 && n > 0
}

/// The result of one SDPA check.
#[derive(Debug, Clone, Copy)]
pub struct SdpaCheck {
    /// Largest error in bf16 ULPs at the output's scale.
    pub max_ulp: f64,
    /// Largest raw ULP distance between the output bits and the correctly rounded f64 value (large only near zero).
    pub max_raw_ulp: u64,
    /// Output values whose bits equal the correctly rounded f64 value.
    pub exact: usize,
    pub values: usize,
}

fn pseudo(i: u64) -> f32 {
    // splitmix64 -> uniform in [-1, 1), rounded to bf16.
    let mut z = i.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    let u = (z >> 40) as f32 / (1u64 << 24) as f32;
    half::bf16::from_f32(2.0 * u - 1.0).to_f32()
}

/// A bf16 SDPA (GQA 8/2, D 64, 37 keys, 5 causal queries) on `device`, against f64 softmax attention.
pub fn sdpa_check(device: DeviceChoice) -> Result<SdpaCheck, String> {
    device.activate();
    let (hq, hk, d, n, l) = (8usize, 2usize, 64usize, 37usize, 5usize);
    let q: Vec<f32> = (0..hq * l * d).map(|i| pseudo(i as u64)).collect();
    let k: Vec<f32> = (0..hk * n * d).map(|i| pseudo(1 << 32 | i as u64)).collect();
    let v: Vec<f32> = (0..hk * n * d).map(|i| pseudo(2 << 32 | i as u64)).collect();
    let to = |x: &[f32], h: usize, len: usize| -> Result<Array, String> {
        Array::from_slice(x, &[1, h as i32, len as i32, d as i32]).as_dtype(Dtype::Bfloat16).map_err(|e| e.to_string())
    };
    let scale = 1.0 / (d as f32).sqrt();
    let out = scaled_dot_product_attention(
        to(&q, hq, l)?,
        to(&k, hk, n)?,
        to(&v, hk, n)?,
        scale,
        ScaledDotProductAttentionMask::Causal,
        None,
    )
    .map_err(|e| e.to_string())?;
    let got = ArrayBytes::of(&out).map_err(|e| e.to_string())?;
    let (mut max_ulp, mut max_raw_ulp, mut exact) = (0f64, 0u64, 0usize);
    for h in 0..hq {
        let kv = h / (hq / hk);
        for i in 0..l {
            let visible = n - l + i + 1; // bottom-right causal
            let scores: Vec<f64> = (0..visible)
                .map(|j| {
                    (0..d).map(|x| q[(h * l + i) * d + x] as f64 * k[(kv * n + j) * d + x] as f64).sum::<f64>()
                        * scale as f64
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let z: f64 = w.iter().sum();
            for x in 0..d {
                let e: f64 = (0..visible).map(|j| w[j] * v[(kv * n + j) * d + x] as f64).sum::<f64>() / z;
                let want = half::bf16::from_f64(e).to_bits() as u64;
                let found = got.words.get((h * l + i) * d + x);
                let raw = ulp_distance(Dtype::Bfloat16, found, want);
                exact += (raw == 0) as usize;
                max_raw_ulp = max_raw_ulp.max(raw);
                let value = f32::from_bits((found as u32) << 16) as f64;
                max_ulp = max_ulp.max((value - e).abs() / crate::sim::check::ulp_at(Dtype::Bfloat16, e));
            }
        }
    }
    Ok(SdpaCheck { max_ulp, max_raw_ulp, exact, values: hq * l * d })
}

/// `kvsim doctor`'s report: the lines to show, and whether every check passed.
pub fn report() -> (Vec<String>, bool) {
    let mut lines = vec![];
    let version = crate::sim::mlx_version();
    lines.push(format!(
        "mlx version     {version} (headers this build was compiled against: {})",
        mlx_sys::MLX_BUILD_VERSION
    ));
    let loaded = std::fs::read_to_string("/proc/self/maps")
        .ok()
        .and_then(|m| {
            m.lines().find(|l| l.contains("libmlx")).map(|l| l.split_whitespace().last().unwrap_or("").to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    lines.push(format!("library loaded  {loaded}"));
    // The run path linked into this binary: the MLX folder of the build, or (a wheel, KVSIM_RPATH) `$ORIGIN`-relative.
    lines.push(format!("build run path  {}", env!("KVSIM_RUN_PATH")));
    let default = mlx_rs::Device::try_default().map(|d| format!("{d:?}")).unwrap_or_else(|e| format!("error: {e}"));
    lines.push(format!("default device  {default}"));
    let gpu = gpu_available();
    lines.push(format!("gpu available   {gpu}"));
    let mut devices = vec![DeviceChoice::Cpu];
    if gpu {
        devices.push(DeviceChoice::Gpu);
    }
    let mut ok = true;
    let mut verdicts = vec![];
    for d in devices {
        match sdpa_check(d) {
            Ok(r) => {
                lines.push(format!(
                    "sdpa {:<4} bf16  H_q 8 / H_kv 2, D 64, 37 keys, 5 causal queries: max {:.2} ULP (bf16, at output scale) vs the f64 reference; {}/{} values correctly rounded; max raw ULP distance {}",
                    d.name(), r.max_ulp, r.exact, r.values, r.max_raw_ulp
                ));
                let pass = r.max_ulp <= SDPA_ULP_BOUND;
                ok &= pass;
                verdicts.push(format!("mlx {version} {} {}", d.name(), if pass { "ok" } else { "FAILED" }));
            }
            Err(e) => {
                ok = false;
                lines.push(format!("sdpa {:<4} error: {e}", d.name()));
                verdicts.push(format!("mlx {version} {} FAILED", d.name()));
            }
        }
    }
    lines.extend(verdicts);
    (lines, ok)
}
