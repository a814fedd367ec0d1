//! Helpers shared by the integration tests: the mutant lock, self-identifying payload blocks, byte views.

use kvsim::bytes::ArrayBytes;
use kvsim::cache::{KvDtype, KvSpec};
use kvsim::reference::{RefDtype, Tensor, Tok, ValueSpace};
use mlx_rs::Array;

/// Disarms the calling thread's mutant on drop (also when the test panics). A mutant is armed per thread
/// (`cache::faults::arm`), so tests running beside each other never see each other's mutant and need no lock.
pub struct Exclusive;

impl Drop for Exclusive {
    fn drop(&mut self) {
        kvsim::cache::faults::arm(None);
    }
}

/// The guard for tests that arm mutants.
pub fn exclusive() -> Exclusive {
    Exclusive
}

/// K/V/Q blocks whose values identify their token (`reference::ValueSpace`), in a cache's dtype.
#[derive(Debug, Clone, Copy)]
pub struct Payload {
    pub spec: KvSpec,
    pub vs: ValueSpace,
}

impl Payload {
    pub fn new(spec: KvSpec, heads_q: usize, seed: u64) -> Self {
        let dtype = match spec.dtype {
            KvDtype::F32 => RefDtype::F32,
            KvDtype::Bf16 => RefDtype::Bf16,
        };
        Payload { spec, vs: ValueSpace { seed, heads_kv: spec.heads_kv, heads_q, head_dim: spec.head_dim, dtype } }
    }

    /// 1 / sqrt(D).
    pub fn scale(&self) -> f32 {
        1.0 / (self.spec.head_dim as f32).sqrt()
    }

    /// `[B, heads, L, D]` of `tensor`: row `b`, slot `i` holds `toks[b][i]`, or pad poison for `None`. Every row
    /// must have the same length `L`.
    pub fn block(&self, tensor: Tensor, toks: &[Vec<Option<Tok>>]) -> Array {
        assert!(toks.iter().all(|r| r.len() == toks.first().map_or(0, Vec::len)), "ragged block");
        let (data, [b, h, l, d]) = self.vs.block_f32(0, tensor, toks);
        let a = Array::from_slice(&data, &[b as i32, h as i32, l as i32, d as i32]);
        // Values are already representable in the dtype (ValueSpace rounds them): the cast is exact.
        a.as_dtype(self.spec.dtype.to_mlx()).expect("cast")
    }

    /// (K, V, Q) for these tokens.
    pub fn kvq(&self, toks: &[Vec<Option<Tok>>]) -> (Array, Array, Array) {
        (self.block(Tensor::K, toks), self.block(Tensor::V, toks), self.block(Tensor::Q, toks))
    }

    /// (K, V, Q) for one row of real tokens.
    pub fn kvq1(&self, toks: &[Tok]) -> (Array, Array, Array) {
        self.kvq(&[toks.iter().copied().map(Some).collect()])
    }

    /// Checks that `a` (`[1, H_kv, n, D]`, K or V) holds exactly the columns of `want`, in order.
    pub fn assert_columns(&self, what: &str, tensor: Tensor, a: &Array, want: &[Tok]) {
        let b = bytes(a);
        let (h, d) = (self.spec.heads_kv, self.spec.head_dim);
        assert_eq!(b.shape, vec![1, h as i32, want.len() as i32, d as i32], "{what}: shape");
        let w = b.words.to_u32();
        let n = want.len();
        for (c, tok) in want.iter().enumerate() {
            let expect = self.vs.column_bits(0, tensor, *tok);
            let found: Vec<u32> =
                (0..h).flat_map(|hh| (0..d).map(move |x| (hh, x))).map(|(hh, x)| w[(hh * n + c) * d + x]).collect();
            if found != expect {
                let who = self.vs.identify(0, tensor, &found, (0..=tok.pos + 8).map(|p| Tok { req: tok.req, pos: p }));
                panic!("{what}: {tensor:?} column {c} should hold {tok}, found {who:?}");
            }
        }
    }
}

/// The bytes of an array (panics on an MLX failure: a test helper).
pub fn bytes(a: &Array) -> ArrayBytes {
    ArrayBytes::of(a).expect("read array bytes")
}

/// Asserts two arrays have the same dtype, shape and bits.
#[track_caller]
pub fn assert_same_bytes(what: &str, a: &Array, b: &Array) {
    let (x, y) = (bytes(a), bytes(b));
    if let Some(i) = x.first_difference(&y) {
        panic!(
            "{what}: arrays differ at element {i} (shapes {:?} vs {:?}, dtypes {:?} vs {:?})",
            x.shape, y.shape, x.dtype, y.dtype
        );
    }
}

/// Asserts that row `row` of a batched output `[B, H_q, L, D]`, queries `[0, real)`, equals a solo output
/// `[1, H_q, real, D]` bit for bit.
#[track_caller]
pub fn assert_row_output(what: &str, batched: &ArrayBytes, row: usize, solo: &Array, real: usize) {
    let s = bytes(solo);
    let (hq, l, d) = (batched.shape[1] as usize, batched.shape[2] as usize, batched.shape[3] as usize);
    assert_eq!(s.shape, vec![1, hq as i32, real as i32, d as i32], "{what}: solo output shape");
    assert_eq!(batched.dtype, s.dtype, "{what}: dtype");
    for h in 0..hq {
        for i in 0..real {
            for x in 0..d {
                let got = batched.words.get(((row * hq + h) * l + i) * d + x);
                let want = s.words.get((h * real + i) * d + x);
                assert!(got == want, "{what}: row {row} head {h} query {i} dim {x}: {got:#x} vs the twin's {want:#x}");
            }
        }
    }
}
