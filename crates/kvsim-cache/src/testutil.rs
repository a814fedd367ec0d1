//! Test helpers: deterministic data, byte views, and a batch-vs-solo twin driver (the crate's own tests, and
//! with the feature `testutil` the tests of crates built on it).
#![allow(dead_code)]

use mlx_rs::{Array, Dtype};

use super::batch::RowBatch;
use super::mask::Masks;
use super::ring::SerialCache;
use super::{KvDtype, KvSpec};

pub const HQ: usize = 4;

/// These tests state CPU facts (byte-identity of batched and solo reads on MLX's CPU backend); with the CUDA
/// runtime loaded MLX's default device is the GPU, so pin the CPU.
pub fn pin_cpu() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| mlx_rs::Device::set_default(&mlx_rs::Device::cpu()));
}

pub fn spec(dtype: KvDtype) -> KvSpec {
    pin_cpu();
    KvSpec { heads_kv: 2, head_dim: 8, dtype }
}

fn hash(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51afd7ed558ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ceb9fe1a85ec53);
    x ^ (x >> 33)
}

/// Deterministic values in [-2, 2) of shape `[b, h, l, d]`, in `dtype`.
pub fn data(seed: u64, b: usize, h: usize, l: usize, d: usize, dtype: KvDtype) -> Array {
    pin_cpu();
    let n = b * h * l * d;
    let vals: Vec<f32> = (0..n as u64)
        .map(|i| (hash(seed.wrapping_mul(0x9e3779b97f4a7c15) ^ hash(i)) >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0)
        .collect();
    let a = Array::from_slice(&vals, &[b as i32, h as i32, l as i32, d as i32]);
    a.as_dtype(dtype.to_mlx()).unwrap()
}

/// K, V for `l` positions of `b` rows, and queries.
pub fn kvq(spec: &KvSpec, seed: u64, b: usize, l: usize) -> (Array, Array, Array) {
    (
        data(seed * 3 + 1, b, spec.heads_kv, l, spec.head_dim, spec.dtype),
        data(seed * 3 + 2, b, spec.heads_kv, l, spec.head_dim, spec.dtype),
        data(seed * 3 + 3, b, HQ, l, spec.head_dim, spec.dtype),
    )
}

/// The storage bits of every element (row-major), widened to u32.
pub fn bits(a: &Array) -> Vec<u32> {
    if a.size() == 0 {
        return Vec::new(); // as_slice of an empty array is Err(Null)
    }
    let a = a.contiguous().unwrap();
    match a.dtype() {
        Dtype::Float32 => {
            let v = a.view::<u32>().unwrap().contiguous().unwrap();
            v.eval().unwrap();
            v.as_slice::<u32>().to_vec()
        }
        Dtype::Bfloat16 => {
            let v = a.view::<u16>().unwrap().contiguous().unwrap();
            v.eval().unwrap();
            v.as_slice::<u16>().iter().map(|&x| x as u32).collect()
        }
        Dtype::Uint32 => {
            a.eval().unwrap();
            a.as_slice::<u32>().to_vec()
        }
        d => panic!("bits of {d:?}"),
    }
}

pub fn same_bytes(a: &Array, b: &Array) -> bool {
    a.shape() == b.shape() && a.dtype() == b.dtype() && bits(a) == bits(b)
}

#[track_caller]
pub fn assert_same_bytes(a: &Array, b: &Array, what: &str) {
    assert_eq!(a.shape(), b.shape(), "{what}: shapes");
    assert_eq!(a.dtype(), b.dtype(), "{what}: dtypes");
    assert!(bits(a) == bits(b), "{what}: bytes differ");
}

pub fn row(a: &Array, r: usize) -> Array {
    super::util::rows(a, r, r + 1).unwrap()
}

/// Output byte-identity counters.
#[derive(Debug, Default, Clone)]
pub struct Stats {
    pub decode_rows: usize,
    pub decode_same: usize,
    pub decode_masked_rows: usize,
    pub decode_masked_same: usize,
    pub window_rows: usize,
    pub window_same: usize,
}

/// A batch and one solo serial cache per row, fed the same data; checks after every op.
pub struct Twin {
    pub lenient: bool,
    pub spec: KvSpec,
    pub batch: RowBatch,
    pub solo: Vec<SerialCache>,
    pub stats: Stats,
    pub scale: f32,
}

impl Twin {
    pub(crate) fn new(batch: RowBatch, solo: Vec<SerialCache>) -> Self {
        let t = Twin { lenient: false, spec: batch.spec(), batch, solo, stats: Stats::default(), scale: 0.35 };
        t.check_state("new");
        t
    }

    /// The first difference between the batch rows and their solo twins (state, physical bytes, temporal view).
    pub(crate) fn mismatch(&self) -> Option<String> {
        if self.batch.rows() != self.solo.len() {
            return Some(format!("rows {} vs {}", self.batch.rows(), self.solo.len()));
        }
        for (r, s) in self.solo.iter().enumerate() {
            if &self.batch.row_states()[r].ring != s.state() {
                return Some(format!("row {r} state {:?} vs {:?}", self.batch.row_states()[r].ring, s.state()));
            }
            // Every stored plane (K and V, or the six affine planes), byte for byte.
            let (bp, sp) = (self.batch.row_physical_planes(r).unwrap(), s.physical_planes().unwrap());
            if bp.len() != sp.len() || bp.iter().zip(&sp).any(|(a, b)| !same_bytes(a, b)) {
                return Some(format!("row {r} physical bytes"));
            }
            let (bt, st) = (self.batch.row_temporal_view_planes(r).unwrap(), s.temporal_view_planes().unwrap());
            if bt.len() != st.len() || bt.iter().zip(&st).any(|(a, b)| !same_bytes(a, b)) {
                return Some(format!("row {r} temporal view"));
            }
        }
        None
    }

    #[track_caller]
    pub(crate) fn check_state(&self, what: &str) {
        if let Some(m) = self.mismatch() {
            panic!("{what}: {m}\n{}", self.batch.picture());
        }
    }

    /// Checks after each op (panicking on divergence) unless `lenient`.
    pub(crate) fn decode(&mut self, seed: u64) {
        let b = self.solo.len();
        let (k, v, q) = kvq(&self.spec, seed, b, 1);
        let masks = Masks::new();
        let (out, _) = self.batch.decode(&k, &v, &q, self.scale, &masks).unwrap();
        let lens: Vec<usize> = self.batch.row_states().iter().map(|r| r.ring.len).collect();
        let masked = lens.iter().any(|&l| l != lens[0]);
        for r in 0..b {
            let (so, _) = self.solo[r].decode(&row(&k, r), &row(&v, r), &row(&q, r), self.scale, &masks).unwrap();
            let same = same_bytes(&row(&out, r), &so);
            self.stats.decode_rows += 1;
            self.stats.decode_same += usize::from(same);
            if masked {
                self.stats.decode_masked_rows += 1;
                self.stats.decode_masked_same += usize::from(same);
            }
        }
        if !self.lenient {
            self.check_state(&format!("decode {seed}"));
        }
    }

    /// A window of `l` positions per row; with a prepared prefill, `real[r]` are the rows' real counts.
    pub(crate) fn window(&mut self, seed: u64, l: usize) {
        let b = self.solo.len();
        let (k, v, q) = kvq(&self.spec, seed, b, l);
        let real: Vec<usize> = self.batch.row_states().iter().map(|r| r.pending.map_or(l, |p| p.min(l))).collect();
        let masks = Masks::new();
        let (out, _) = self.batch.window(&k, &v, &q, self.scale, &masks).unwrap();
        for (r, &n) in real.iter().enumerate() {
            if n == 0 {
                continue;
            }
            let sl = |a: &Array| super::util::cols(&row(a, r), 0, n).unwrap();
            let (so, _) = self.solo[r].window(&sl(&k), &sl(&v), &sl(&q), self.scale, &masks).unwrap();
            let same = same_bytes(&sl(&out), &so);
            self.stats.window_rows += 1;
            self.stats.window_same += usize::from(same);
        }
        if !self.lenient {
            self.check_state(&format!("window {seed} x{l}"));
        }
    }

    pub(crate) fn trim_rows(&mut self, n: &[usize], bypass: bool) {
        self.batch.trim_rows(n, bypass).unwrap();
        for (s, &k) in self.solo.iter_mut().zip(n) {
            s.trim(k, bypass).unwrap();
        }
        self.check_state("trim_rows");
    }
}

/// Tests arm a global mutant; they serialize through this lock. Every cache test holds [`testlock::shared`]; a
/// test that arms holds [`testlock::arm`] (exclusive), which disarms on drop.
pub mod testlock {
    #[cfg(feature = "faults")]
    use crate::faults::{arm as set, Mutant};
    use std::sync::{RwLock, RwLockReadGuard};

    static LOCK: RwLock<()> = RwLock::new(());

    pub fn shared() -> RwLockReadGuard<'static, ()> {
        LOCK.read().unwrap_or_else(|e| e.into_inner())
    }

    #[cfg(feature = "faults")]
    pub struct Armed(#[allow(dead_code)] std::sync::RwLockWriteGuard<'static, ()>);

    #[cfg(feature = "faults")]
    impl Drop for Armed {
        fn drop(&mut self) {
            set(None);
        }
    }

    #[cfg(feature = "faults")]
    pub fn arm(m: Mutant) -> Armed {
        let g = LOCK.write().unwrap_or_else(|e| e.into_inner());
        set(Some(m));
        Armed(g)
    }
}
