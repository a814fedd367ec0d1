//! The exact read mode (issue #18): an attention read whose bits do not depend on the batch.
//!
//! MLX's fused SDPA on CUDA picks different kernels for one row and for a batch, and for masked and unmasked reads,
//! so a row read inside a batch and the same row read alone by its solo twin differ in their last bits (in f32 up to
//! ~2e5 ULP at output scale, README "Guarantees"). [`ReadMode::Exact`] replaces that read, **on a GPU only**, by two
//! CUDA kernels of kvsim's own (JIT-compiled by MLX through mlx-c's `mlx_fast_cuda_kernel_*`, MLX 0.32.2
//! `mlx/backend/cuda/custom_kernel.cpp`) whose reduction order is a function of the row's own columns alone:
//!
//! - Every query `(row b, query head h, position i)` attends a contiguous range of physical key columns `[lo, hi)`
//!   computed on the host from the read's visibility ([`visible_ranges`]: no mask, MLX's bottom-right `Causal`, or a
//!   [`MaskSpec`] whose visible set per query is contiguous, which every kvsim mask is). Masks never enter the
//!   arithmetic: a column outside the range is skipped, never added as `exp(-inf)`.
//! - Columns are cut into fixed chunks of [`CHUNK`] = 256 **absolute** column indices (`[256 j, 256 (j + 1))`), each
//!   chunk into [`WARPS`] = 4 slices of 64 columns; one warp walks its slice in increasing column order with an f32
//!   online softmax (score = f32 dot product `q . k` over `D`, lanes holding `d = lane + 32 e`, summed per lane in
//!   `e` order then by a fixed xor butterfly 16, 8, 4, 2, 1, times `scale`). The 4 warps of a chunk are combined in
//!   warp order, then the chunks of a query in chunk order `0, 1, 2, ...` by a second kernel. An empty chunk or slice
//!   (no visible column: beyond the row's length, or outside its window) is skipped by the combine, so a batch whose
//!   widest row has more chunks than this row gives this row exactly the bits it gets alone.
//! - GQA: query head `h` reads K/V head `h / (H_q / H_kv)`. K, V and Q are read through their strides (no copy of a
//!   sliced cache buffer). The output is `acc / l` rounded once to the K/V dtype; a query with no visible column
//!   (never produced by kvsim's reads) gives 0.
//!
//! So the bits of row `r` depend only on row `r`'s queries, its K/V in its visible ranges (in physical order), the
//! ranges themselves and `scale`: not on `B`, the other rows, the padding, the mask or the batch width. Rows keep
//! their solo twin's physical columns (ARCHITECTURE.md "Rows"), so a row and its twin read the same inputs and get
//! the same bytes. [`emulate`] is the same computation on the host in the same order (used by tests and by the GPU
//! check to verify the kernel's indexing; its bits may differ from the GPU's in the last place, since `expf` and
//! fused multiply-adds differ between the two, but never its reduction order).
//!
//! On the CPU the mode keeps MLX's SDPA: MLX's CPU SDPA is already batch-invariant (measured: every row of 1000
//! seeds byte-identical, README "Guarantees"), so [`ReadMode::Exact`] changes nothing there.
//!
//! Quantized K/V (packed `u32` + scales + biases) is not handled yet: the kernel reads K and V through one load
//! (`kv_load`), which is where a dequantize-on-load would go.

use std::cell::Cell;
use std::ffi::CString;

use mlx_rs::{Array, Dtype};

use super::error::{invalid, shape};
use super::mask::MaskSpec;
use super::Result;

/// Columns per chunk: the fixed split over keys that makes the reduction order independent of the batch.
pub const CHUNK: usize = 256;
/// Warps per chunk (each walks `CHUNK / WARPS` consecutive columns).
pub const WARPS: usize = 4;
/// Query rows (head x position pairs of one K/V head) one block of the first kernel serves.
const QTILE: usize = 4;

/// How attention reads are computed (a per-thread setting, like [`super::set_eval_after_write`]; default `Fused`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum ReadMode {
    /// MLX's fused SDPA (its kernel choice may depend on the batch size and the mask on CUDA).
    Fused,
    /// The batch-invariant read of this module on a GPU; MLX's SDPA on the CPU (already invariant there).
    Exact,
}

thread_local! {
    static MODE: Cell<ReadMode> = const { Cell::new(ReadMode::Fused) };
}

/// Sets the calling thread's read mode for every cache (rows and solo twins alike).
pub fn set_read_mode(mode: ReadMode) {
    MODE.with(|m| m.set(mode));
}

/// The calling thread's read mode.
pub fn read_mode() -> ReadMode {
    MODE.with(|m| m.get())
}

/// Whether MLX's default device (this thread's) is a GPU.
pub fn default_device_is_gpu() -> bool {
    mlx_rs::Device::try_default().and_then(|d| d.get_type()).is_ok_and(|t| matches!(t, mlx_rs::DeviceType::Gpu))
}

/// Whether reads on this thread go through the exact kernels now (exact mode on a GPU).
pub fn exact_kernels_active() -> bool {
    read_mode() == ReadMode::Exact && default_device_is_gpu()
}

/// The visible column range `[lo, hi)` of every query, `ranges[2 * (b * queries + i)..][..2]`.
///
/// `mask` (a host matrix over `cols` columns) wins over `causal`; with neither, every query sees `[0, cols)`;
/// `causal` is MLX's bottom-right alignment: query `i` sees `[0, cols - queries + i + 1)`. A mask whose visible
/// set of some query is not contiguous is [`super::CacheError::InvalidState`] (kvsim never builds one).
pub fn visible_ranges(
    rows: usize,
    queries: usize,
    cols: usize,
    mask: Option<&MaskSpec>,
    causal: bool,
) -> Result<Vec<i32>> {
    let c32 = |n: usize| i32::try_from(n).map_err(|_| shape(format!("{n} columns exceed i32")));
    let mut out = Vec::with_capacity(2 * rows * queries);
    for b in 0..rows {
        for i in 0..queries {
            let (lo, hi) = match mask {
                Some(m) => {
                    if m.rows != rows || m.queries != queries || m.cols != cols {
                        return Err(shape(format!(
                            "mask [{}, {}, {}] for a read of [{rows}, {queries}, {cols}]",
                            m.rows, m.queries, m.cols
                        )));
                    }
                    let row = &m.visible[(b * queries + i) * cols..(b * queries + i + 1) * cols];
                    let lo = row.iter().position(|&v| v).unwrap_or(0);
                    let hi = row.iter().rposition(|&v| v).map_or(lo, |p| p + 1);
                    if row[lo..hi].iter().any(|&v| !v) {
                        return Err(invalid(format!("row {b} query {i}: visible columns are not contiguous")));
                    }
                    (lo, hi)
                }
                None if causal => (0, (cols + i + 1).saturating_sub(queries).min(cols)),
                None => (0, cols),
            };
            out.push(c32(lo)?);
            out.push(c32(hi)?);
        }
    }
    Ok(out)
}

/// Dimensions of one read: `q [B, H_q, L, D]`, `k`/`v` `[B, H_kv, N, D]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadDims {
    pub rows: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub queries: usize,
    pub cols: usize,
    pub head_dim: usize,
}

/// The exact read on the host, in the kernels' order (module docs), on contiguous f32 data
/// (`q [B, H_q, L, D]`, `k`/`v` `[B, H_kv, N, D]`, `ranges` from [`visible_ranges`]). Returns `[B, H_q, L, D]` in f32
/// (before the final rounding to the K/V dtype). Used by tests and the GPU check; not a production path.
pub fn emulate(q: &[f32], k: &[f32], v: &[f32], dims: ReadDims, ranges: &[i32], scale: f32) -> Vec<f32> {
    let ReadDims { rows, heads_q, heads_kv, queries, cols, head_dim: d } = dims;
    let g = heads_q / heads_kv.max(1);
    let per_warp = CHUNK / WARPS;
    let nchunks = cols.div_ceil(CHUNK).max(1);
    let mut out = vec![0f32; rows * heads_q * queries * d];
    for b in 0..rows {
        for h in 0..heads_q {
            let kvh = h / g.max(1);
            for i in 0..queries {
                let (lo, hi) = (ranges[2 * (b * queries + i)] as usize, ranges[2 * (b * queries + i) + 1] as usize);
                let qrow = &q[((b * heads_q + h) * queries + i) * d..][..d];
                let mut total = Part::empty(d);
                for chunk in 0..nchunks {
                    let mut block = Part::empty(d);
                    for w in 0..WARPS {
                        let start = chunk * CHUNK + w * per_warp;
                        let mut p = Part::empty(d);
                        for c in start.max(lo)..(start + per_warp).min(hi).min(cols) {
                            let kv = ((b * heads_kv + kvh) * cols + c) * d;
                            let s = warp_dot(qrow, &k[kv..kv + d]) * scale;
                            p.push(s, &v[kv..kv + d]);
                        }
                        block.combine(&p);
                    }
                    total.combine(&block);
                }
                let o = &mut out[((b * heads_q + h) * queries + i) * d..][..d];
                for (x, a) in o.iter_mut().zip(&total.acc) {
                    *x = if total.l > 0.0 { a / total.l } else { 0.0 };
                }
            }
        }
    }
    out
}

/// `q . k` as a warp computes it: lane `t` sums `d = t + 32 e` in `e` order, then an xor butterfly.
fn warp_dot(q: &[f32], k: &[f32]) -> f32 {
    let mut lanes = [0f32; 32];
    for (t, lane) in lanes.iter_mut().enumerate() {
        let mut d = t;
        while d < q.len() {
            *lane = q[d].mul_add(k[d], *lane);
            d += 32;
        }
    }
    for o in [16, 8, 4, 2, 1] {
        let prev = lanes;
        for t in 0..32 {
            lanes[t] = prev[t] + prev[t ^ o];
        }
    }
    lanes[0]
}

/// An online-softmax partial: running max `m`, sum `l`, unnormalized output `acc`.
struct Part {
    m: f32,
    l: f32,
    acc: Vec<f32>,
}

impl Part {
    fn empty(d: usize) -> Self {
        Part { m: f32::NEG_INFINITY, l: 0.0, acc: vec![0.0; d] }
    }

    fn push(&mut self, s: f32, v: &[f32]) {
        if s > self.m {
            let alpha = (self.m - s).exp();
            self.l *= alpha;
            self.acc.iter_mut().for_each(|a| *a *= alpha);
            self.m = s;
        }
        let w = (s - self.m).exp();
        self.l += w;
        self.acc.iter_mut().zip(v).for_each(|(a, x)| *a = w.mul_add(*x, *a));
    }

    /// Fixed-order combine; an empty side is skipped, so empty chunks change no bit.
    fn combine(&mut self, o: &Part) {
        if o.m == f32::NEG_INFINITY {
            return;
        }
        if self.m == f32::NEG_INFINITY {
            self.m = o.m;
            self.l = o.l;
            self.acc.clone_from(&o.acc);
            return;
        }
        let m = self.m.max(o.m);
        let (s1, s2) = ((self.m - m).exp(), (o.m - m).exp());
        self.l = self.l * s1 + o.l * s2;
        self.acc.iter_mut().zip(&o.acc).for_each(|(a, b)| *a = *a * s1 + b * s2);
        self.m = m;
    }
}

/// The shared CUDA helpers (prepended to both kernels by MLX as the kernel header).
const HEADER: &str = r#"
#define KVSIM_CHUNK 256
#define KVSIM_NEG_INF (-__int_as_float(0x7f800000))
#define KVSIM_WARPS 4
#define KVSIM_QTILE 4
template <typename T> __device__ __forceinline__ float kv_load(const T* p, long long i) {
  return static_cast<float>(p[i]);
}
// Fixed-order combine of two online-softmax partials; an empty side (m = KVSIM_NEG_INF) is skipped.
template <int EPL> __device__ __forceinline__ void kvsim_combine(
    float& m, float& l, float (&a)[EPL], float m2, float l2, const float (&a2)[EPL]) {
  if (m2 == KVSIM_NEG_INF) return;
  if (m == KVSIM_NEG_INF) {
    m = m2; l = l2;
    #pragma unroll
    for (int e = 0; e < EPL; ++e) a[e] = a2[e];
    return;
  }
  float mn = fmaxf(m, m2);
  float s1 = expf(m - mn), s2 = expf(m2 - mn);
  l = l * s1 + l2 * s2;
  #pragma unroll
  for (int e = 0; e < EPL; ++e) a[e] = a[e] * s1 + a2[e] * s2;
  m = mn;
}
"#;

/// Kernel 1: one block per (chunk, K/V head x query tile, row); writes each query's chunk partial.
/// Inputs `q`, `k`, `v` (strided), `meta` (int32: the scale's f32 bits, then `[lo, hi)` per (row, query)).
/// Outputs `pacc [R, NC, D]`, `pml [R, NC, 2]` (f32), `R = B * H_q * L`. Template: `T`, `D`.
const PARTIAL_SRC: &str = r#"
  constexpr int EPL = (D + 31) / 32;
  constexpr int KPW = KVSIM_CHUNK / KVSIM_WARPS;
  constexpr int U = 4;
  const int HQ = q_shape[1], L = q_shape[2];
  const int HKV = k_shape[1], N = k_shape[2];
  const int G = HQ / HKV;
  const int NC = gridDim.x;
  const int chunk = blockIdx.x;
  const int nrows = G * L;
  const int ntiles = (nrows + KVSIM_QTILE - 1) / KVSIM_QTILE;
  const int kvh = blockIdx.y / ntiles, tile = blockIdx.y % ntiles;
  const int b = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float scale = __int_as_float(meta[0]);
  __shared__ float sm_m[KVSIM_WARPS][KVSIM_QTILE];
  __shared__ float sm_l[KVSIM_WARPS][KVSIM_QTILE];
  __shared__ float sm_a[KVSIM_WARPS][KVSIM_QTILE][EPL * 32];

  float qv[KVSIM_QTILE][EPL];
  int lo[KVSIM_QTILE], hi[KVSIM_QTILE];
  int tlo = 0x7fffffff, thi = 0;
  #pragma unroll
  for (int j = 0; j < KVSIM_QTILE; ++j) {
    const int r = tile * KVSIM_QTILE + j;
    lo[j] = 0; hi[j] = 0;
    if (r < nrows) {
      const int g = r / L, i = r % L;
      const int hq = kvh * G + g;
      lo[j] = meta[1 + 2 * (b * L + i)];
      hi[j] = meta[2 + 2 * (b * L + i)];
      if (hi[j] > N) hi[j] = N;
      if (lo[j] < hi[j]) { tlo = min(tlo, lo[j]); thi = max(thi, hi[j]); }
      const long long qb = b * q_strides[0] + hq * q_strides[1] + i * q_strides[2];
      #pragma unroll
      for (int e = 0; e < EPL; ++e) {
        const int d = lane + 32 * e;
        qv[j][e] = (d < D) ? kv_load(q, qb + d * q_strides[3]) : 0.0f;
      }
    } else {
      #pragma unroll
      for (int e = 0; e < EPL; ++e) qv[j][e] = 0.0f;
    }
  }
  float m[KVSIM_QTILE], l[KVSIM_QTILE], acc[KVSIM_QTILE][EPL];
  #pragma unroll
  for (int j = 0; j < KVSIM_QTILE; ++j) {
    m[j] = KVSIM_NEG_INF; l[j] = 0.0f;
    #pragma unroll
    for (int e = 0; e < EPL; ++e) acc[j][e] = 0.0f;
  }
  const int c0 = chunk * KVSIM_CHUNK + warp * KPW;
  const int cs = max(c0, tlo), ce = min(c0 + KPW, thi);
  const long long kb = b * k_strides[0] + kvh * k_strides[1];
  const long long vb = b * v_strides[0] + kvh * v_strides[1];
  for (int c = cs; c < ce; c += U) {
    float kk[U][EPL], vv[U][EPL];
    #pragma unroll
    for (int u = 0; u < U; ++u) {
      #pragma unroll
      for (int e = 0; e < EPL; ++e) {
        const int d = lane + 32 * e;
        const bool ok = (c + u < ce) && (d < D);
        kk[u][e] = ok ? kv_load(k, kb + (c + u) * k_strides[2] + d * k_strides[3]) : 0.0f;
        vv[u][e] = ok ? kv_load(v, vb + (c + u) * v_strides[2] + d * v_strides[3]) : 0.0f;
      }
    }
    #pragma unroll
    for (int j = 0; j < KVSIM_QTILE; ++j) {
      if (c >= hi[j] || c + U <= lo[j]) continue;
      float p[U];
      #pragma unroll
      for (int u = 0; u < U; ++u) {
        p[u] = 0.0f;
        #pragma unroll
        for (int e = 0; e < EPL; ++e) p[u] += qv[j][e] * kk[u][e];
      }
      // The xor butterfly 16, 8, 4, 2, 1 of each of the U = 4 dot products, as a reduce-scatter: every addition is
      // one the full butterfly of that key makes (same operands, same tree), so the sums have the same bits; the
      // sum of key u ends in lanes 8u..8u+7 and is broadcast from lane 8u.
      const bool h16 = (lane & 16) != 0, h8 = (lane & 8) != 0;
      const float r0 = __shfl_xor_sync(0xffffffffu, h16 ? p[0] : p[2], 16);
      const float r1 = __shfl_xor_sync(0xffffffffu, h16 ? p[1] : p[3], 16);
      const float a0 = (h16 ? p[2] : p[0]) + r0, a1 = (h16 ? p[3] : p[1]) + r1;
      float t = (h8 ? a1 : a0) + __shfl_xor_sync(0xffffffffu, h8 ? a0 : a1, 8);
      t += __shfl_xor_sync(0xffffffffu, t, 4);
      t += __shfl_xor_sync(0xffffffffu, t, 2);
      t += __shfl_xor_sync(0xffffffffu, t, 1);
      #pragma unroll
      for (int u = 0; u < U; ++u) p[u] = __shfl_sync(0xffffffffu, t, 8 * u);
      #pragma unroll
      for (int u = 0; u < U; ++u) {
        const int cc = c + u;
        if (cc >= ce || cc < lo[j] || cc >= hi[j]) continue;
        const float s = p[u] * scale;
        if (s > m[j]) {
          const float alpha = expf(m[j] - s);
          l[j] *= alpha;
          #pragma unroll
          for (int e = 0; e < EPL; ++e) acc[j][e] *= alpha;
          m[j] = s;
        }
        const float w = expf(s - m[j]);
        l[j] += w;
        #pragma unroll
        for (int e = 0; e < EPL; ++e) acc[j][e] += w * vv[u][e];
      }
    }
  }
  #pragma unroll
  for (int j = 0; j < KVSIM_QTILE; ++j) {
    if (lane == 0) { sm_m[warp][j] = m[j]; sm_l[warp][j] = l[j]; }
    #pragma unroll
    for (int e = 0; e < EPL; ++e) sm_a[warp][j][lane + 32 * e] = acc[j][e];
  }
  __syncthreads();
  if (warp != 0) return;
  #pragma unroll
  for (int j = 0; j < KVSIM_QTILE; ++j) {
    const int r = tile * KVSIM_QTILE + j;
    if (r >= nrows) continue;
    float M = sm_m[0][j], Ls = sm_l[0][j], a[EPL];
    #pragma unroll
    for (int e = 0; e < EPL; ++e) a[e] = sm_a[0][j][lane + 32 * e];
    for (int w = 1; w < KVSIM_WARPS; ++w) {
      float a2[EPL];
      #pragma unroll
      for (int e = 0; e < EPL; ++e) a2[e] = sm_a[w][j][lane + 32 * e];
      kvsim_combine<EPL>(M, Ls, a, sm_m[w][j], sm_l[w][j], a2);
    }
    const int g = r / L, i = r % L;
    const long long row = ((long long)(b * HQ + kvh * G + g)) * L + i;
    const long long slot = row * NC + chunk;
    #pragma unroll
    for (int e = 0; e < EPL; ++e) {
      const int d = lane + 32 * e;
      if (d < D) pacc[slot * D + d] = a[e];
    }
    if (lane == 0) { pml[2 * slot] = M; pml[2 * slot + 1] = Ls; }
  }
"#;

/// Kernel 2: one warp per query row; combines its chunks in chunk order and writes `acc / l` in `T`.
const COMBINE_SRC: &str = r#"
  constexpr int EPL = (D + 31) / 32;
  const long long R = pml_shape[0];
  const int NC = pml_shape[1];
  const long long row = (long long)blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= R) return;
  float M = KVSIM_NEG_INF, Ls = 0.0f, a[EPL];
  #pragma unroll
  for (int e = 0; e < EPL; ++e) a[e] = 0.0f;
  for (int c = 0; c < NC; ++c) {
    const long long slot = row * NC + c;
    float a2[EPL];
    #pragma unroll
    for (int e = 0; e < EPL; ++e) {
      const int d = lane + 32 * e;
      a2[e] = (d < D) ? pacc[slot * D + d] : 0.0f;
    }
    kvsim_combine<EPL>(M, Ls, a, pml[2 * slot], pml[2 * slot + 1], a2);
  }
  #pragma unroll
  for (int e = 0; e < EPL; ++e) {
    const int d = lane + 32 * e;
    if (d < D) out[row * D + d] = static_cast<T>(Ls > 0.0f ? a[e] / Ls : 0.0f);
  }
"#;

/// One mlx-c custom CUDA kernel (created once per thread; MLX caches the compiled module per name + template).
struct Kernel(mlx_sys::mlx_fast_cuda_kernel);

impl Drop for Kernel {
    fn drop(&mut self) {
        // SAFETY: created by mlx_fast_cuda_kernel_new, freed once.
        unsafe { mlx_sys::mlx_fast_cuda_kernel_free(self.0) };
    }
}

fn strings(names: &[&str]) -> Result<(mlx_sys::mlx_vector_string, Vec<CString>)> {
    let owned: Vec<CString> =
        names.iter().map(|n| CString::new(*n).map_err(|_| invalid("NUL in a name"))).collect::<Result<_>>()?;
    // SAFETY: plain constructor; the strings are copied by mlx-c.
    let v = unsafe { mlx_sys::mlx_vector_string_new() };
    for s in &owned {
        // SAFETY: `v` is a live vector, `s` a valid C string.
        unsafe { mlx_sys::mlx_vector_string_append_value(v, s.as_ptr()) };
    }
    Ok((v, owned))
}

impl Kernel {
    fn new(name: &str, inputs: &[&str], outputs: &[&str], source: &str) -> Result<Kernel> {
        let (vin, _a) = strings(inputs)?;
        let (vout, _b) = strings(outputs)?;
        let (name, source, header) = (
            CString::new(name).map_err(|_| invalid("NUL"))?,
            CString::new(source).map_err(|_| invalid("NUL"))?,
            CString::new(HEADER).map_err(|_| invalid("NUL"))?,
        );
        // SAFETY: all pointers are valid for the call; mlx-c copies what it keeps.
        let k = unsafe {
            let k =
                mlx_sys::mlx_fast_cuda_kernel_new(name.as_ptr(), vin, vout, source.as_ptr(), header.as_ptr(), false, 0);
            mlx_sys::mlx_vector_string_free(vin);
            mlx_sys::mlx_vector_string_free(vout);
            k
        };
        if k.ctx.is_null() {
            return Err(invalid(format!("mlx_fast_cuda_kernel_new failed for {name:?}")));
        }
        Ok(Kernel(k))
    }

    /// Applies the kernel on the default stream; `grid` counts threads (MLX's convention).
    fn apply(
        &self,
        inputs: &[&Array],
        outputs: &[(&[i32], Dtype)],
        grid: (i32, i32, i32),
        block: (i32, i32, i32),
        dtype: Dtype,
        head_dim: i32,
    ) -> Result<Vec<Array>> {
        let stream = mlx_rs::Stream::new();
        let (t_name, d_name) = (c"T", c"D");
        // SAFETY: every mlx-c object created here is freed before return; arrays handed out are owned copies.
        let res = unsafe {
            let cfg = mlx_sys::mlx_fast_cuda_kernel_config_new();
            for (s, dt) in outputs {
                mlx_sys::mlx_fast_cuda_kernel_config_add_output_arg(
                    cfg,
                    s.as_ptr(),
                    s.len(),
                    *dt as mlx_sys::mlx_dtype,
                );
            }
            mlx_sys::mlx_fast_cuda_kernel_config_set_grid(cfg, grid.0, grid.1, grid.2);
            mlx_sys::mlx_fast_cuda_kernel_config_set_thread_group(cfg, block.0, block.1, block.2);
            mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_dtype(
                cfg,
                t_name.as_ptr(),
                dtype as mlx_sys::mlx_dtype,
            );
            mlx_sys::mlx_fast_cuda_kernel_config_add_template_arg_int(cfg, d_name.as_ptr(), head_dim);
            let vin = mlx_sys::mlx_vector_array_new();
            for a in inputs {
                mlx_sys::mlx_vector_array_append_value(vin, a.as_ptr());
            }
            let mut vout = mlx_sys::mlx_vector_array_new();
            let rc = mlx_sys::mlx_fast_cuda_kernel_apply(&mut vout, self.0, vin, cfg, stream.as_ptr());
            let mut res = Vec::new();
            if rc == 0 {
                for i in 0..mlx_sys::mlx_vector_array_size(vout) {
                    let mut a = mlx_sys::mlx_array_new();
                    mlx_sys::mlx_vector_array_get(&mut a, vout, i);
                    res.push(Array::from_ptr(a));
                }
            }
            mlx_sys::mlx_vector_array_free(vin);
            mlx_sys::mlx_vector_array_free(vout);
            mlx_sys::mlx_fast_cuda_kernel_config_free(cfg);
            if rc != 0 || res.len() != outputs.len() {
                return Err(invalid("mlx_fast_cuda_kernel_apply failed (no CUDA back-end, or a bad launch)"));
            }
            res
        };
        Ok(res)
    }
}

thread_local! {
    static KERNELS: std::cell::OnceCell<std::result::Result<(Kernel, Kernel), String>> = const { std::cell::OnceCell::new() };
}

/// The exact read on the GPU (module docs): `q [B, H_q, L, D]`, `k`/`v` `[B, H_kv, N, D]` (any strides), `ranges`
/// from [`visible_ranges`]. Returns `[B, H_q, L, D]` in the dtype of `q` (bf16 or f32). Lazy, like any MLX op.
pub fn exact_attend(q: &Array, k: &Array, v: &Array, scale: f32, ranges: &[i32]) -> Result<Array> {
    let (qs, ks) = (q.shape(), k.shape());
    if qs.len() != 4 || ks.len() != 4 || v.shape() != ks || qs[0] != ks[0] || qs[3] != ks[3] || ks[1] == 0 {
        return Err(shape(format!("exact read of q {qs:?}, k {ks:?}, v {:?}", v.shape())));
    }
    let (b, hq, l, d) = (qs[0], qs[1], qs[2], qs[3]);
    let (hkv, n) = (ks[1], ks[2]);
    if hq % hkv != 0 || ranges.len() != 2 * (b as usize) * (l as usize) {
        return Err(shape(format!("exact read: H_q {hq} / H_kv {hkv}, {} range values for B {b} L {l}", ranges.len())));
    }
    if q.dtype() != k.dtype() || v.dtype() != k.dtype() || !matches!(k.dtype(), Dtype::Bfloat16 | Dtype::Float32) {
        return Err(shape(format!("exact read of dtypes {:?}/{:?}/{:?}", q.dtype(), k.dtype(), v.dtype())));
    }
    let dtype = k.dtype();
    let mut meta = Vec::with_capacity(1 + ranges.len());
    meta.push(scale.to_bits() as i32);
    meta.extend_from_slice(ranges);
    let meta = Array::from_slice(&meta, &[meta.len() as i32]);
    let nchunks = (n.max(1) as usize).div_ceil(CHUNK) as i32;
    let rows = b * hq * l;
    let tiles = ((hq / hkv) * l + QTILE as i32 - 1) / QTILE as i32;
    let threads = (32 * WARPS) as i32;
    KERNELS.with(|cell| {
        let ks = cell.get_or_init(|| {
            let p = Kernel::new("kvsim_exact_partial", &["q", "k", "v", "meta"], &["pacc", "pml"], PARTIAL_SRC);
            let c = Kernel::new("kvsim_exact_combine", &["pacc", "pml"], &["out"], COMBINE_SRC);
            match (p, c) {
                (Ok(p), Ok(c)) => Ok((p, c)),
                (Err(e), _) | (_, Err(e)) => Err(e.to_string()),
            }
        });
        let (partial, combine) = ks.as_ref().map_err(|e| invalid(e.clone()))?;
        let parts = partial.apply(
            &[q, k, v, &meta],
            &[(&[rows, nchunks, d], Dtype::Float32), (&[rows, nchunks, 2], Dtype::Float32)],
            (nchunks * threads, hkv * tiles, b),
            (threads, 1, 1),
            dtype,
            d,
        )?;
        let per_block = 4;
        let out = combine.apply(
            &[&parts[0], &parts[1]],
            &[(&[b, hq, l, d], dtype)],
            ((rows + per_block - 1) / per_block * 32 * per_block, 1, 1),
            (32 * per_block, 1, 1),
            dtype,
            d,
        )?;
        out.into_iter().next().ok_or_else(|| invalid("exact read: no output"))
    })
}

#[cfg(test)]
mod tests;
