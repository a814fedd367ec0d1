//! The exact read mode: an attention read whose bits do not depend on the batch.
//!
//! MLX's fused SDPA on CUDA picks different kernels for one row and for a batch, and for masked and unmasked reads,
//! so a row read inside a batch and the same row read alone by its solo twin differ in their last bits (in f32 up to
//! ~2e5 ULP at output scale, README "Guarantees"). [`ReadMode::Exact`] replaces that read, **on a GPU only**, by two
//! CUDA kernels of kvsim's own (JIT-compiled by MLX through mlx-c's `mlx_fast_cuda_kernel_*`, MLX 0.32.2
//! `mlx/backend/cuda/custom_kernel.cpp`) whose reduction order is a function of the row's own columns alone:
//!
//! - Every query `(row b, query head h, position i)` attends the physical key columns of its [`Visibility`]: sorted
//!   `[lo, hi)` intervals computed on the host from the read's mask ([`visible_ranges`]: no mask, MLX's bottom-right
//!   `Causal`, or any [`MaskSpec`], one per row or one broadcast over the rows). Masks never enter the arithmetic:
//!   a column the query does not see is skipped, never added as `exp(-inf)`.
//! - Columns are cut into fixed chunks of [`CHUNK`] = 256 **absolute** column indices (`[256 j, 256 (j + 1))`). One
//!   block of 128 threads serves one chunk of one K/V head for a tile of up to 4 queries (the GQA group's heads at
//!   one position, or several positions), so each K/V byte of the chunk is loaded once for the whole group. In the
//!   chunk, query `r` sees the columns `V_r` of its range, and the block computes, in this order:
//!   1. **scores**: a group of `GROUP` = 8 lanes serves one key column (16 columns per block at a time, four
//!      such steps in flight). Lane `s` of the group owns the 16-byte vectors `s, s + 8, s + 16, ...` of the key
//!      row (`E` = 8 bf16 or 4 f32 elements each) and sums `q_d k_d` over its `d` in increasing order, one f32 fused
//!      multiply-add at a time; the group then adds the 8 lane sums by the xor butterfly 4, 2, 1, and
//!      `s = sum * scale`. One warp load covers 4 whole key rows (coalesced); element loads where a row is not
//!      16-byte aligned give the same additions in the same order;
//!   2. **softmax of the chunk**: warp `r` takes query `r`; `m = max over V_r of s`; `p = exp(s - m)` on `V_r`, 0
//!      elsewhere; `l` = sum of the 256 `p` as lane `i` sums columns `i, i + 32, ..., i + 224` in that order, then
//!      a fixed xor butterfly 16, 8, 4, 2, 1;
//!   3. **values**: the columns of the chunk fall in `CG` classes `(c - c0) % CG` (`CG = 128 / ceil(D / E)`, `E`
//!      = 8 bf16 or 4 f32 elements per 16-byte load); per class, `acc_d = sum over its columns in increasing order
//!      of p v_d`, one fused multiply-add per column whose `p` is not 0 (a 0 adds nothing: skipping it keeps the
//!      bits); then the class sums are added in class order.
//!
//!   Then a second kernel combines the chunk partials `(m, l, acc)` of a query in chunk order `0, 1, 2, ...`. A
//!   chunk with no visible column is skipped by the combine, so a batch whose widest row has more chunks than this
//!   row gives this row exactly the bits it gets alone.
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
//! Quantized K/V (packed `u32` + scales + biases) reaches the kernel dense: on a GPU every read of affine storage is
//! MLX's elementwise `dequantize` first (`quant::attend_planes`; each value a function of its own code, scale and
//! bias only), then this read. The dequantized bytes are the same alone or in a batch, so the invariance carries
//! over; the kernels themselves read bf16 and f32 only.

use std::cell::Cell;
use std::ffi::CString;

use mlx_rs::{Array, Dtype};

use super::error::{invalid, shape};
use super::mask::MaskSpec;
use super::Result;

/// Columns per chunk: the fixed split over keys that makes the reduction order independent of the batch.
pub const CHUNK: usize = 256;
/// Threads of one block of the first kernel (4 warps): `CHUNK / THREADS` columns per thread in the score pass.
const THREADS: usize = 128;
/// Query rows (head x position pairs of one K/V head) one block of the first kernel serves (one per warp in the
/// softmax pass).
const QTILE: usize = 4;
/// Lanes of a warp (the softmax pass's sum runs over them).
const LANES: usize = 32;
/// Lanes that share one key row in the score pass (`KVSIM_GROUP` in the kernel).
const GROUP: usize = 8;

/// How attention reads are computed (a per-thread setting, like [`super::set_eval_after_write`]; default `Fused`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
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

/// The calling thread's read mode set to another until this guard drops (also on unwind), then restored: how a
/// layout attends with the kernel set it took when it was built, whatever the thread's mode is now.
pub(crate) struct ModeGuard(ReadMode);

impl ModeGuard {
    /// Sets `mode` on the calling thread until the guard drops.
    pub(crate) fn enter(mode: ReadMode) -> ModeGuard {
        let before = read_mode();
        set_read_mode(mode);
        ModeGuard(before)
    }
}

impl Drop for ModeGuard {
    fn drop(&mut self) {
        set_read_mode(self.0);
    }
}

pub use crate::util::default_device_is_gpu;

/// Whether reads on this thread go through the exact kernels now (exact mode on a GPU).
pub fn exact_kernels_active() -> bool {
    read_mode() == ReadMode::Exact && default_device_is_gpu()
}

/// The visible columns of every query of a read, as sorted, disjoint, non-empty half-open intervals: query
/// `q = b * queries + i` sees the intervals `starts[q] .. starts[q + 1]` of `spans` (each `[lo, hi)` as two values).
/// One interval for every decode and window read; two or more for the reads whose visible set has holes (a
/// prefix-shared pair's second response skips the first one's tokens; a bidirectional image span).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Visibility {
    /// Per query `q`, the index (in intervals) of its first interval in `spans`, then a final end: `B * L + 1`
    /// non-decreasing entries from 0.
    pub starts: Vec<i32>,
    /// Every query's intervals in query order, flattened: `[lo, hi)` as two physical column indices each.
    pub spans: Vec<i32>,
}

impl Visibility {
    /// The intervals of query `q` (`(lo, hi)` pairs).
    pub fn intervals(&self, q: usize) -> impl Iterator<Item = (usize, usize)> + '_ {
        let (a, b) = (self.starts[q] as usize, self.starts[q + 1] as usize);
        (a..b).map(move |k| (self.spans[2 * k] as usize, self.spans[2 * k + 1] as usize))
    }

    /// Whether query `q` sees column `c`.
    pub fn sees(&self, q: usize, c: usize) -> bool {
        self.intervals(q).any(|(lo, hi)| lo <= c && c < hi)
    }

    /// The number of queries described.
    pub fn queries(&self) -> usize {
        self.starts.len().saturating_sub(1)
    }
}

/// The [`Visibility`] of a read of `rows x queries` over `cols` columns.
///
/// `mask` (a host matrix over `cols` columns, one per row or one for every row) wins over `causal`; with neither,
/// every query sees `[0, cols)`; `causal` is MLX's bottom-right alignment: query `i` sees `[0, cols - queries + i + 1)`.
pub fn visible_ranges(
    rows: usize,
    queries: usize,
    cols: usize,
    mask: Option<&MaskSpec>,
    causal: bool,
) -> Result<Visibility> {
    let c32 = |n: usize| i32::try_from(n).map_err(|_| shape(format!("{n} columns exceed i32")));
    let mut vis = Visibility { starts: Vec::with_capacity(rows * queries + 1), spans: vec![] };
    vis.starts.push(0);
    if let Some(m) = mask {
        if (m.rows != rows && m.rows != 1) || m.queries != queries || m.cols != cols {
            return Err(shape(format!(
                "mask [{}, {}, {}] for a read of [{rows}, {queries}, {cols}]",
                m.rows, m.queries, m.cols
            )));
        }
    }
    for b in 0..rows {
        for i in 0..queries {
            match mask {
                Some(m) => {
                    let mb = if m.rows == 1 { 0 } else { b };
                    let row = &m.visible[(mb * queries + i) * cols..(mb * queries + i + 1) * cols];
                    let mut c = 0;
                    while c < cols {
                        if row[c] {
                            let lo = c;
                            while c < cols && row[c] {
                                c += 1;
                            }
                            vis.spans.extend([c32(lo)?, c32(c)?]);
                        } else {
                            c += 1;
                        }
                    }
                }
                None => {
                    let hi = if causal { (cols + i + 1).saturating_sub(queries).min(cols) } else { cols };
                    if hi > 0 {
                        vis.spans.extend([0, c32(hi)?]);
                    }
                }
            }
            vis.starts.push(c32(vis.spans.len() / 2)?);
        }
    }
    Ok(vis)
}

/// Dimensions of one read: `q [B, H_q, L, D]`, `k`/`v` `[B, H_kv, N, D]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReadDims {
    /// `B`: rows of the read.
    pub rows: usize,
    /// `H_q`: query heads (a multiple of `heads_kv`: query head `h` reads K/V head `h / (H_q / H_kv)`).
    pub heads_q: usize,
    /// `H_kv`: K/V heads.
    pub heads_kv: usize,
    /// `L`: query positions per row.
    pub queries: usize,
    /// `N`: physical K/V columns read per row.
    pub cols: usize,
    /// `D`: elements per head, of queries, keys and values alike.
    pub head_dim: usize,
    /// Bytes of one K/V element (2 for bf16, 4 for f32): the kernels' load width in elements is `16 / kv_bytes`,
    /// which sets how the value pass splits columns into classes.
    pub kv_bytes: usize,
}

/// The exact read on the host, in the kernels' order (module docs), on contiguous f32 data
/// (`q [B, H_q, L, D]`, `k`/`v` `[B, H_kv, N, D]`, `vis` from [`visible_ranges`]). Returns `[B, H_q, L, D]` in f32
/// (before the final rounding to the K/V dtype). Used by tests and the GPU check; not a production path.
pub fn emulate(q: &[f32], k: &[f32], v: &[f32], dims: ReadDims, vis: &Visibility, scale: f32) -> Vec<f32> {
    let ReadDims { rows, heads_q, heads_kv, queries, cols, head_dim: d, .. } = dims;
    let g = heads_q / heads_kv.max(1);
    let nchunks = cols.div_ceil(CHUNK).max(1);
    let vec = 16 / dims.kv_bytes.clamp(1, 16);
    let mut out = vec![0f32; rows * heads_q * queries * d];
    for b in 0..rows {
        for h in 0..heads_q {
            let kvh = h / g.max(1);
            for i in 0..queries {
                let qi = b * queries + i;
                let qrow = &q[((b * heads_q + h) * queries + i) * d..][..d];
                let mut total = Part::empty(d);
                for chunk in 0..nchunks {
                    let c0 = chunk * CHUNK;
                    let visible: Vec<usize> = (c0..(c0 + CHUNK).min(cols)).filter(|&c| vis.sees(qi, c)).collect();
                    if visible.is_empty() {
                        continue;
                    }
                    let at = |c: usize| ((b * heads_kv + kvh) * cols + c) * d;
                    // 1. scores: lane `(d / vec) % GROUP` sums its `q_d k_d` in increasing `d`, one fused
                    //    multiply-add each; then the group's xor butterfly.
                    let dot = |c: usize| {
                        let mut lanes = [0f32; GROUP];
                        for (x, (kd, qd)) in k[at(c)..at(c) + d].iter().zip(qrow).enumerate() {
                            let s = (x / vec) % GROUP;
                            lanes[s] = qd.mul_add(*kd, lanes[s]);
                        }
                        butterfly_sum(lanes)
                    };
                    let s: Vec<f32> = visible.iter().map(|&c| dot(c) * scale).collect();
                    // 2. softmax of the chunk: lane sums then the xor butterfly.
                    let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                    let mut p = [0f32; CHUNK];
                    for (&c, sc) in visible.iter().zip(&s) {
                        p[c - c0] = (sc - m).exp();
                    }
                    let mut lanes = [0f32; LANES];
                    for (lane, sum) in lanes.iter_mut().enumerate() {
                        for j in (lane..CHUNK).step_by(LANES) {
                            *sum += p[j];
                        }
                    }
                    let l = butterfly_sum(lanes);
                    // 3. values: per column class `(c - c0) % CG`, one fused multiply-add per visible column in
                    //    order (p = 0 skipped); then the classes added in class order.
                    let groups = d.div_ceil(16 / dims.kv_bytes.clamp(1, 16));
                    let classes_n = (THREADS / groups.max(1)).max(1);
                    let mut classes = vec![vec![0f32; d]; classes_n];
                    for &c in &visible {
                        let pc = p[c - c0];
                        if pc != 0.0 {
                            let class = &mut classes[(c - c0) % classes_n];
                            class.iter_mut().zip(&v[at(c)..at(c) + d]).for_each(|(a, x)| *a = pc.mul_add(*x, *a));
                        }
                    }
                    let acc: Vec<f32> = (0..d).map(|x| classes.iter().fold(0f32, |a, cl| a + cl[x])).collect();
                    total.combine(&Part { m, l, acc });
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

/// The xor butterfly `N/2, ..., 2, 1` over `N` lanes (every lane ends with the same sum, since `a + b == b + a`):
/// 16, 8, 4, 2, 1 over a warp, 4, 2, 1 over a score group.
fn butterfly_sum<const N: usize>(mut lanes: [f32; N]) -> f32 {
    let mut o = N / 2;
    while o >= 1 {
        let prev = lanes;
        for t in 0..N {
            lanes[t] = prev[t] + prev[t ^ o];
        }
        o /= 2;
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
#define KVSIM_THREADS 128
#define KVSIM_NEG_INF (-__int_as_float(0x7f800000))
#define KVSIM_QTILE 4
#define KVSIM_GROUP 8
template <typename T> __device__ __forceinline__ float kv_load(const T* p, long long i) {
  return static_cast<float>(p[i]);
}
__device__ __forceinline__ float kvsim_get(const float4& v, int j) {
  return j == 0 ? v.x : (j == 1 ? v.y : (j == 2 ? v.z : v.w));
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

/// Kernel 1: one block of 128 threads per (chunk, K/V head x query tile, row); writes each query's chunk partial
/// (module docs: scores, softmax of the chunk, values). Inputs `q`, `k`, `v` (strided), `meta` (int32: the scale's
/// f32 bits, then the [`Visibility`]: `starts`, then the intervals). Outputs `pacc [R, NC, D]`, `pml [R, NC, 2]` (f32),
/// `R = B * H_q * L`. Template: `T`, `D`.
const PARTIAL_SRC: &str = r#"
  constexpr int CH = KVSIM_CHUNK, NT = KVSIM_THREADS, QT = KVSIM_QTILE;
  constexpr int VEC = 16 / sizeof(T);
  constexpr int VE = VEC;
  constexpr int NV = (D + VEC - 1) / VEC;
  constexpr int DG = NV;
  constexpr int GL = KVSIM_GROUP;
  constexpr int VPL = (NV + GL - 1) / GL;
  constexpr int SQ = VPL * VEC * GL;
  constexpr int RPI = NT / GL;
  constexpr int UNR = 4;
  static_assert((CH / RPI) % UNR == 0, "chunk rows must split into whole unrolled steps");
  constexpr int CG = (NT / DG) > 0 ? (NT / DG) : 1;
  static_assert(DG <= NT, "head dim too large for the exact read");
  const int HQ = q_shape[1], L = q_shape[2];
  const int HKV = k_shape[1], N = k_shape[2];
  const int G = HQ / HKV;
  const int NC = gridDim.x;
  const int chunk = blockIdx.x;
  const int nrows = G * L;
  const int ntiles = (nrows + QT - 1) / QT;
  const int kvh = blockIdx.y / ntiles, tile = blockIdx.y % ntiles;
  const int b = blockIdx.z;
  const int t = threadIdx.x, warp = t / 32, lane = t % 32;
  const float scale = __int_as_float(meta[0]);
  const int c0 = chunk * CH;
  __shared__ float4 sq[SQ];
  __shared__ float4 sp[CH];
  __shared__ float sred[CG * QT * D];
  __shared__ int slo[QT], shi[QT], sk0[QT], sk1[QT];
  __shared__ float sm[QT], sl[QT];
  // meta: the scale's bits, then `starts` (B L + 1 values), then the `[lo, hi)` intervals (module docs).
  const int NQ = q_shape[0] * L;
  const int* spans = meta + 2 + NQ;

  if (t < QT) {
    const int r = tile * QT + t;
    int lo = 0, hi = 0, k0 = 0, k1 = 0;
    if (r < nrows) {
      const int i = r % L;
      k0 = meta[1 + b * L + i];
      k1 = meta[2 + b * L + i];
      if (k1 > k0) { lo = spans[2 * k0]; hi = spans[2 * k1 - 1]; }
    }
    lo = max(lo, c0);
    hi = min(min(hi, N), c0 + CH);
    if (hi < lo) hi = lo;
    slo[t] = lo; shi[t] = hi; sk0[t] = k0; sk1[t] = k1;
  }
  // The query slots in the score pass's lane order: slot (w VEC + x) GL + s holds d = VEC (s + GL w) + x.
  for (int slot = t; slot < SQ; slot += NT) {
    const int s8 = slot % GL, x = (slot / GL) % VEC, w = slot / (GL * VEC);
    const int d = (s8 + GL * w) * VEC + x;
    float qq[QT];
    #pragma unroll
    for (int j = 0; j < QT; ++j) {
      const int r = tile * QT + j;
      qq[j] = 0.0f;
      if (r < nrows && d < D) {
        const int g = r / L, i = r % L;
        const long long qb = b * q_strides[0] + (kvh * G + g) * q_strides[1] + i * q_strides[2];
        qq[j] = kv_load(q, qb + d * q_strides[3]);
      }
    }
    sq[slot] = make_float4(qq[0], qq[1], qq[2], qq[3]);
  }
  __syncthreads();
  int cs = c0 + CH, ce = c0;
  #pragma unroll
  for (int j = 0; j < QT; ++j) {
    if (slo[j] < shi[j]) { cs = min(cs, slo[j]); ce = max(ce, shi[j]); }
  }
  const long long kb = b * k_strides[0] + kvh * k_strides[1];
  const long long vb = b * v_strides[0] + kvh * v_strides[1];

  // 1. scores: an 8-lane group per key column (4 columns per warp, 16 per block at a time, UNR of those in flight);
  //    lane `s` of a group owns the 16-byte vectors `s, s + 8, s + 16, ...` of the key row, so it sums `q_d k_d`
  //    over `d = VEC (s + 8 w) + x` in increasing `d`, one fused multiply-add each; then the group adds its 8 lane
  //    sums by the xor butterfly 4, 2, 1. Loads are 16 bytes wide where the rows allow it, element loads
  //    elsewhere: the same additions in the same order.
  const int grp = lane / GL, sub = lane % GL;
  const bool kvec = (D % VEC == 0) && k_strides[3] == 1 && (k_strides[2] % VEC == 0) &&
                    ((reinterpret_cast<unsigned long long>(k + kb) & 15ull) == 0ull);
  for (int u0 = 0; u0 < CH / RPI; u0 += UNR) {
    float a[UNR][QT];
    #pragma unroll
    for (int u = 0; u < UNR; ++u) {
      #pragma unroll
      for (int j = 0; j < QT; ++j) a[u][j] = 0.0f;
    }
    if (kvec) {
      uint4 raw[UNR][VPL];
      #pragma unroll
      for (int u = 0; u < UNR; ++u) {
        const int c = c0 + RPI * (u0 + u) + (32 / GL) * warp + grp;
        const bool on = c >= cs && c < ce;
        #pragma unroll
        for (int w = 0; w < VPL; ++w) {
          const int vi = sub + GL * w;
          raw[u][w] = (on && vi < NV)
              ? *reinterpret_cast<const uint4*>(k + kb + (long long)c * k_strides[2] + vi * VEC)
              : make_uint4(0u, 0u, 0u, 0u);
        }
      }
      #pragma unroll
      for (int u = 0; u < UNR; ++u) {
        #pragma unroll
        for (int w = 0; w < VPL; ++w) {
          if (sub + GL * w < NV) {
            const T* e = reinterpret_cast<const T*>(&raw[u][w]);
            #pragma unroll
            for (int x = 0; x < VEC; ++x) {
              const float kd = static_cast<float>(e[x]);
              const float4 qd = sq[(w * VEC + x) * GL + sub];
              a[u][0] = fmaf(qd.x, kd, a[u][0]); a[u][1] = fmaf(qd.y, kd, a[u][1]);
              a[u][2] = fmaf(qd.z, kd, a[u][2]); a[u][3] = fmaf(qd.w, kd, a[u][3]);
            }
          }
        }
      }
    } else {
      #pragma unroll
      for (int u = 0; u < UNR; ++u) {
        const int c = c0 + RPI * (u0 + u) + (32 / GL) * warp + grp;
        if (c < cs || c >= ce) continue;
        const long long kr = kb + (long long)c * k_strides[2];
        for (int w = 0; w < VPL; ++w) {
          for (int x = 0; x < VEC; ++x) {
            const int d = (sub + GL * w) * VEC + x;
            if (d >= D) continue;
            const float kd = kv_load(k, kr + d * k_strides[3]);
            const float4 qd = sq[(w * VEC + x) * GL + sub];
            a[u][0] = fmaf(qd.x, kd, a[u][0]); a[u][1] = fmaf(qd.y, kd, a[u][1]);
            a[u][2] = fmaf(qd.z, kd, a[u][2]); a[u][3] = fmaf(qd.w, kd, a[u][3]);
          }
        }
      }
    }
    #pragma unroll
    for (int u = 0; u < UNR; ++u) {
      #pragma unroll
      for (int o = GL / 2; o >= 1; o >>= 1) {
        #pragma unroll
        for (int j = 0; j < QT; ++j) a[u][j] += __shfl_xor_sync(0xffffffffu, a[u][j], o);
      }
      const int c = c0 + RPI * (u0 + u) + (32 / GL) * warp + grp;
      if (sub == 0 && c >= cs && c < ce) {
        sp[c - c0] = make_float4(a[u][0] * scale, a[u][1] * scale, a[u][2] * scale, a[u][3] * scale);
      }
    }
  }
  __syncthreads();

  // 2. softmax of the chunk: warp j takes query j of the tile.
  {
    const int j = warp;
    const int lo = slo[j], hi = shi[j], k0 = sk0[j], k1 = sk1[j];
    float s[CH / 32];
    bool vis[CH / 32];
    float m = KVSIM_NEG_INF;
    #pragma unroll
    for (int x = 0; x < CH / 32; ++x) {
      const int c = c0 + lane + 32 * x;
      bool on = c >= lo && c < hi;
      if (on && k1 - k0 > 1) {
        on = false;
        for (int q = k0; q < k1; ++q) on = on || (c >= spans[2 * q] && c < spans[2 * q + 1]);
      }
      vis[x] = on;
      s[x] = on ? kvsim_get(sp[c - c0], j) : KVSIM_NEG_INF;
      m = fmaxf(m, s[x]);
    }
    #pragma unroll
    for (int o = 16; o >= 1; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    __syncwarp();
    float l = 0.0f;
    #pragma unroll
    for (int x = 0; x < CH / 32; ++x) {
      const int c = c0 + lane + 32 * x;
      const float p = vis[x] ? expf(s[x] - m) : 0.0f;
      l += p;
      if (c >= cs && c < ce) reinterpret_cast<float*>(&sp[c - c0])[j] = p;
    }
    #pragma unroll
    for (int o = 16; o >= 1; o >>= 1) l += __shfl_xor_sync(0xffffffffu, l, o);
    if (lane == 0) { sm[j] = m; sl[j] = l; }
  }
  __syncthreads();

  // 3. values: thread t owns the d-group dg = t % DG (VE consecutive d) for the columns c with
  //    (c - c0) % CG == t / DG, one fused multiply-add per column (p = 0 skipped) in increasing c; then the CG
  //    column classes are added in class order.
  float acc[QT][VE];
  #pragma unroll
  for (int j = 0; j < QT; ++j) {
    #pragma unroll
    for (int x = 0; x < VE; ++x) acc[j][x] = 0.0f;
  }
  const int dg = t % DG, cg = t / DG;
  const int d0 = dg * VE;
  if (cg < CG && d0 < D) {
    int c = c0 + cg;
    if (c < cs) c += ((cs - c + CG - 1) / CG) * CG;
    #pragma unroll 4
    for (; c < ce; c += CG) {
      const float4 p = sp[c - c0];
      float x[VE];
      const long long vr = vb + (long long)c * v_strides[2];
      const bool vec = (D % VE == 0) && v_strides[3] == 1 &&
                       ((reinterpret_cast<unsigned long long>(v + vr + d0) & 15ull) == 0ull);
      if (vec) {
        const uint4 raw = *reinterpret_cast<const uint4*>(v + vr + d0);
        const T* e = reinterpret_cast<const T*>(&raw);
        #pragma unroll
        for (int y = 0; y < VE; ++y) x[y] = static_cast<float>(e[y]);
      } else {
        #pragma unroll
        for (int y = 0; y < VE; ++y) x[y] = (d0 + y < D) ? kv_load(v, vr + (d0 + y) * v_strides[3]) : 0.0f;
      }
      #pragma unroll
      for (int y = 0; y < VE; ++y) {
        if (p.x != 0.0f) acc[0][y] = fmaf(p.x, x[y], acc[0][y]);
        if (p.y != 0.0f) acc[1][y] = fmaf(p.y, x[y], acc[1][y]);
        if (p.z != 0.0f) acc[2][y] = fmaf(p.z, x[y], acc[2][y]);
        if (p.w != 0.0f) acc[3][y] = fmaf(p.w, x[y], acc[3][y]);
      }
    }
    #pragma unroll
    for (int j = 0; j < QT; ++j) {
      #pragma unroll
      for (int y = 0; y < VE; ++y) {
        if (d0 + y < D) sred[(cg * QT + j) * D + d0 + y] = acc[j][y];
      }
    }
  }
  __syncthreads();
  #pragma unroll
  for (int j = 0; j < QT; ++j) {
    const int r = tile * QT + j;
    if (r >= nrows) continue;
    const int g = r / L, i = r % L;
    const long long row = ((long long)(b * HQ + kvh * G + g)) * L + i;
    const long long slot = row * NC + chunk;
    for (int d = t; d < D; d += NT) {
      float a = 0.0f;
      for (int q = 0; q < CG; ++q) a += sred[(q * QT + j) * D + d];
      pacc[slot * D + d] = a;
    }
    if (t == 0) { pml[2 * slot] = sm[j]; pml[2 * slot + 1] = sl[j]; }
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

thread_local! {
    /// Device copies of recent `meta` arrays, by content (see [`cached_meta`]).
    static METAS: std::cell::RefCell<std::collections::HashMap<Vec<i32>, Array>> =
        std::cell::RefCell::new(std::collections::HashMap::new());
}

/// Most reads repeat an earlier read's visibility (every decode step of a batch whose lengths do not change), so
/// the `meta` array is kept by content and made again only when new: a host-made array costs more than the whole
/// read on CUDA (docs/exact-read.md, "Host-made arrays", has the measurement). The bytes are the same either way.
/// At most [`META_CACHE`] entries; the map is emptied when full.
fn cached_meta(meta: Vec<i32>) -> Array {
    METAS.with(|m| {
        let mut m = m.borrow_mut();
        if let Some(a) = m.get(&meta) {
            return a.clone();
        }
        if m.len() >= META_CACHE {
            m.clear();
        }
        let a = Array::from_slice(&meta, &[meta.len() as i32]);
        m.insert(meta, a.clone());
        a
    })
}

/// Entries of the per-thread `meta` cache.
const META_CACHE: usize = 256;

/// The exact read on the GPU (module docs): `q [B, H_q, L, D]`, `k`/`v` `[B, H_kv, N, D]` (any strides), `vis`
/// from [`visible_ranges`]. Returns `[B, H_q, L, D]` in the dtype of `q` (bf16 or f32). Lazy, like any MLX op.
pub fn exact_attend(q: &Array, k: &Array, v: &Array, scale: f32, vis: &Visibility) -> Result<Array> {
    let (qs, ks) = (q.shape(), k.shape());
    if qs.len() != 4 || ks.len() != 4 || v.shape() != ks || qs[0] != ks[0] || qs[3] != ks[3] || ks[1] == 0 {
        return Err(shape(format!("exact read of q {qs:?}, k {ks:?}, v {:?}", v.shape())));
    }
    let (b, hq, l, d) = (qs[0], qs[1], qs[2], qs[3]);
    let (hkv, n) = (ks[1], ks[2]);
    if hq % hkv != 0 || vis.queries() != (b as usize) * (l as usize) {
        return Err(shape(format!(
            "exact read: H_q {hq} / H_kv {hkv}, visibility of {} queries for B {b} L {l}",
            vis.queries()
        )));
    }
    if q.dtype() != k.dtype() || v.dtype() != k.dtype() || !matches!(k.dtype(), Dtype::Bfloat16 | Dtype::Float32) {
        return Err(shape(format!("exact read of dtypes {:?}/{:?}/{:?}", q.dtype(), k.dtype(), v.dtype())));
    }
    let dtype = k.dtype();
    let mut meta = Vec::with_capacity(1 + vis.starts.len() + vis.spans.len());
    meta.push(scale.to_bits() as i32);
    meta.extend_from_slice(&vis.starts);
    meta.extend_from_slice(&vis.spans);
    let meta = cached_meta(meta);
    let nchunks = (n.max(1) as usize).div_ceil(CHUNK) as i32;
    let rows = b * hq * l;
    let tiles = ((hq / hkv) * l + QTILE as i32 - 1) / QTILE as i32;
    let threads = THREADS as i32;
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
