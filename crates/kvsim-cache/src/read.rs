//! The attention read every layout uses: MLX's fused SDPA over a cache's K/V with the forward's mask, or, in
//! [`ReadMode::Exact`](crate::exact::ReadMode::Exact) on a GPU, the batch-invariant kernels of [`crate::exact`].

use mlx_rs::fast::ScaledDotProductAttentionMask;
use mlx_rs::Array;

use crate::mask::MaskSpec;
use crate::Result;

/// The read itself over `k`, `v` (`[B, H_kv, cols, D]`) with the given mask: MLX's fused SDPA, or in
/// [`crate::exact::ReadMode::Exact`] on a GPU the batch-invariant kernels of [`crate::exact`].
pub(crate) fn attend(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: Option<(&MaskSpec, &Array)>,
    causal: bool,
) -> Result<Array> {
    use mlx_rs::fast::scaled_dot_product_attention as sdpa;
    if crate::exact::exact_kernels_active() {
        let (qs, ks) = (q.shape(), k.shape());
        let (rows, queries, cols) = (dim_of(qs, 0), dim_of(qs, 2), dim_of(ks, 2));
        let ranges = crate::exact::visible_ranges(rows, queries, cols, mask.map(|m| m.0), causal)?;
        return crate::exact::exact_attend(q, k, v, scale, &ranges);
    }
    let mask = mask.map(|m| m.1);
    let folded = folded_query(q, k, mask)?;
    // A folded read has one query position, where MLX's bottom-right causal mask hides nothing.
    let (q, causal) = match &folded {
        Some(f) => (f, false),
        None => (q, causal),
    };
    let out = match (mask, causal) {
        (Some(m), _) => sdpa(q, k, v, scale, ScaledDotProductAttentionMask::Array(m), None)?,
        (None, true) => sdpa(q, k, v, scale, ScaledDotProductAttentionMask::Causal, None)?,
        (None, false) => sdpa(q, k, v, scale, None, None)?,
    };
    match folded {
        Some(_) => {
            let s = out.shape();
            Ok(out.reshape(&[s[0], s[1] * s[2], 1, s[3]])?)
        }
        None => Ok(out),
    }
}

/// On a GPU, a one-position read whose query heads share K/V heads (`H_q = G H_kv`, `G > 1`) is read as MLX's SDPA
/// of the `G` query heads of each K/V head folded into `G` query positions: this returns `q` as `[B, H_kv, G, D]`
/// ([`attend`] unfolds the output), so each K/V head is read once for its group instead of once per query head. The
/// same attention (no mask, or a mask with one row per batch row and no head or position axis, which broadcasts over
/// the fold); `None` where the read does not fold: on the CPU (whose reads stay as they were, bit for bit), for
/// several positions, or with a per-head or per-position mask. Measured on an H100
/// (`bench/results/h100-step-roofline/`): kvsim's fused decode step at B 64, W 4096, H 32/8 went from 0.67-0.76 ms to
/// 0.47-0.49 ms. The exact mode never reaches this (its own kernels already serve a query tile of the group per K/V
/// head).
fn folded_query(q: &Array, k: &Array, mask: Option<&Array>) -> Result<Option<Array>> {
    let (qs, ks) = (q.shape(), k.shape());
    if qs.len() != 4 || ks.len() != 4 || qs[2] != 1 || ks[1] <= 0 || qs[1] <= ks[1] || qs[1] % ks[1] != 0 {
        return Ok(None);
    }
    if mask.is_some_and(|m| m.ndim() != 4 || m.shape()[1] != 1 || m.shape()[2] != 1) {
        return Ok(None);
    }
    if !crate::util::default_device_is_gpu() {
        return Ok(None);
    }
    Ok(Some(q.reshape(&[qs[0], ks[1], qs[1] / ks[1], qs[3]])?))
}

fn dim_of(s: &[i32], i: usize) -> usize {
    s.get(i).map_or(0, |&d| d.max(0) as usize)
}
