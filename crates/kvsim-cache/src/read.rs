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
    let out = match (mask, causal) {
        (Some(m), _) => sdpa(q, k, v, scale, ScaledDotProductAttentionMask::Array(m), None)?,
        (None, true) => sdpa(q, k, v, scale, ScaledDotProductAttentionMask::Causal, None)?,
        (None, false) => sdpa(q, k, v, scale, None, None)?,
    };
    Ok(out)
}

fn dim_of(s: &[i32], i: usize) -> usize {
    s.get(i).map_or(0, |&d| d.max(0) as usize)
}
