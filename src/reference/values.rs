//! Self-identifying K/V/Q values.
//!
//! Every value the simulator feeds a cache is a pure function of
//! `(seed, layer, tensor, request, position, head, dim)`: a splitmix64 hash of the mixed key, mapped to a uniform
//! value in `[-1, 1)` with 24 significant bits, then rounded to the storage dtype (round-to-nearest-even for bf16,
//! after which the range is `[-1, 1]`). A column (all heads and dims of one token) is therefore a fingerprint of
//! its token: [`ValueSpace::identify`] turns the bits found in a physical column back into the token that wrote
//! them, which is how a divergence report can say "expected position 12, found position 4".
//!
//! Padded slots get [`ValueSpace::pad_value`]: poison of magnitude in `[8, 16)`, far outside the range of real
//! values, so a padded slot that leaks into attention moves the output visibly and a padded column found where a
//! token was expected is recognisable at a glance.

use std::fmt;

use crate::reference::attention::round_to;
use crate::reference::model::ModelError;

/// One stored position: request `req` at sequence (RoPE) position `pos`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize, serde::Deserialize)]
pub struct Tok {
    pub req: u32,
    pub pos: u32,
}

impl Tok {
    /// `Tok { req, pos }`.
    pub const fn new(req: u32, pos: u32) -> Self {
        Tok { req, pos }
    }
}

impl fmt::Display for Tok {
    /// `req 2 pos 17`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "req {} pos {}", self.req, self.pos)
    }
}

/// Which of the three projections a value belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tensor {
    K,
    V,
    Q,
}

impl Tensor {
    /// Domain-separation tag mixed into every hash.
    fn tag(self) -> u64 {
        match self {
            Tensor::K => 0x4b,
            Tensor::V => 0x56,
            Tensor::Q => 0x51,
        }
    }

    /// `"K"`, `"V"` or `"Q"`.
    pub fn name(self) -> &'static str {
        match self {
            Tensor::K => "K",
            Tensor::V => "V",
            Tensor::Q => "Q",
        }
    }
}

impl fmt::Display for Tensor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Storage dtype of the reference values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum RefDtype {
    F32,
    Bf16,
}

impl RefDtype {
    /// Bytes per element: 4 or 2.
    pub fn itemsize(self) -> usize {
        match self {
            RefDtype::F32 => 4,
            RefDtype::Bf16 => 2,
        }
    }
}

/// The value space of one simulated model: shapes, dtype and the seed every value derives from.
#[derive(Debug, Clone, Copy)]
pub struct ValueSpace {
    pub seed: u64,
    pub heads_kv: usize,
    pub heads_q: usize,
    pub head_dim: usize,
    pub dtype: RefDtype,
}

/// splitmix64's finalizer: a bijection of `u64` with full avalanche.
pub(crate) fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Folds the words of a key into one hash, order-sensitively.
fn mix(words: &[u64]) -> u64 {
    words.iter().fold(0x6b76_7369_6d00_0001u64, |acc, &w| splitmix64(acc ^ splitmix64(w)))
}

/// Top 24 bits of a hash as a uniform in `[0, 1)`, exact in f32.
fn unit(h: u64) -> f32 {
    ((h >> 40) as f32) / ((1u32 << 24) as f32)
}

/// Storage bits of an f32 value already representable in `d` (a bf16 value is its upper 16 f32 bits).
fn storage_bits(d: RefDtype, x: f32) -> u32 {
    match d {
        RefDtype::F32 => x.to_bits(),
        RefDtype::Bf16 => x.to_bits() >> 16,
    }
}

/// The f32 value of storage bits in `d` (bf16 bits in the low 16 bits of `bits`).
pub fn bits_to_f32(d: RefDtype, bits: u32) -> f32 {
    match d {
        RefDtype::F32 => f32::from_bits(bits),
        RefDtype::Bf16 => f32::from_bits((bits & 0xffff) << 16),
    }
}

/// Rounds `x` to `d` and returns it as an f32 (exact for both dtypes).
fn rounded(d: RefDtype, x: f32) -> f32 {
    bits_to_f32(d, round_to(d, x as f64))
}

impl ValueSpace {
    /// Checks the shapes: `heads_kv >= 1`, `head_dim >= 1`, `heads_q` a positive multiple of `heads_kv`.
    pub fn validate(&self) -> Result<(), ModelError> {
        if self.heads_kv == 0 || self.head_dim == 0 || self.heads_q == 0 || self.heads_q % self.heads_kv != 0 {
            return Err(ModelError::InvalidState {
                what: format!(
                    "value space shapes: heads_q {} must be a positive multiple of heads_kv {}, head_dim {} >= 1",
                    self.heads_q, self.heads_kv, self.head_dim
                ),
            });
        }
        Ok(())
    }

    /// Heads of one column of `t`: `heads_kv` for K/V, `heads_q` for Q.
    pub fn heads(&self, t: Tensor) -> usize {
        match t {
            Tensor::Q => self.heads_q,
            Tensor::K | Tensor::V => self.heads_kv,
        }
    }

    /// Elements of one column of `t` (`heads(t) * head_dim`).
    pub fn column_len(&self, t: Tensor) -> usize {
        self.heads(t) * self.head_dim
    }

    /// The value of `t` for token `tok` at `(head, dim)` of `layer`, already rounded to the dtype.
    /// Guarantees: a pure function of its arguments and `self.seed`; in `[-1, 1]`; exactly representable in
    /// `self.dtype`.
    pub fn value(&self, layer: u32, t: Tensor, tok: Tok, head: usize, dim: usize) -> f32 {
        let h = mix(&[self.seed, layer as u64, t.tag(), tok.req as u64, tok.pos as u64, head as u64, dim as u64]);
        rounded(self.dtype, unit(h) * 2.0 - 1.0)
    }

    /// Poison for a padded slot (`row`, `slot` = physical column or window index) of `t`.
    /// Guarantees: magnitude in `[8, 16]` (never a real value, which lies in `[-1, 1]`), exactly representable in
    /// the dtype, distinct per `(layer, t, row, slot, head, dim)` up to hash collisions.
    pub fn pad_value(&self, layer: u32, t: Tensor, row: u32, slot: u32, head: usize, dim: usize) -> f32 {
        let h = mix(&[
            self.seed ^ 0x7061_6464_696e_6721, // "padding!"
            layer as u64,
            t.tag(),
            row as u64,
            slot as u64,
            head as u64,
            dim as u64,
        ]);
        let magnitude = 8.0 + 8.0 * unit(h);
        let x = if h & 1 == 1 { -magnitude } else { magnitude };
        rounded(self.dtype, x)
    }

    /// One column of `t` for `tok`: `[heads(t), head_dim]` row-major.
    pub fn column_f32(&self, layer: u32, t: Tensor, tok: Tok) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.column_len(t));
        for head in 0..self.heads(t) {
            for dim in 0..self.head_dim {
                out.push(self.value(layer, t, tok, head, dim));
            }
        }
        out
    }

    /// One column as storage bits: f32 bits, or bf16 bits in the low 16 bits of each `u32`.
    pub fn column_bits(&self, layer: u32, t: Tensor, tok: Tok) -> Vec<u32> {
        self.column_f32(layer, t, tok).into_iter().map(|x| storage_bits(self.dtype, x)).collect()
    }

    /// One padded column (`[heads(t), head_dim]` row-major) as f32 values.
    pub fn pad_column_f32(&self, layer: u32, t: Tensor, row: u32, slot: u32) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.column_len(t));
        for head in 0..self.heads(t) {
            for dim in 0..self.head_dim {
                out.push(self.pad_value(layer, t, row, slot, head, dim));
            }
        }
        out
    }

    /// One padded column as storage bits.
    pub fn pad_column_bits(&self, layer: u32, t: Tensor, row: u32, slot: u32) -> Vec<u32> {
        self.pad_column_f32(layer, t, row, slot).into_iter().map(|x| storage_bits(self.dtype, x)).collect()
    }

    /// The first token among `candidates` whose column of `t` has exactly `bits` (bit-for-bit, all heads and
    /// dims); `None` if none does (including when `bits` has the wrong length).
    pub fn identify(&self, layer: u32, t: Tensor, bits: &[u32], candidates: impl Iterator<Item = Tok>) -> Option<Tok> {
        if bits.len() != self.column_len(t) {
            return None;
        }
        candidates.into_iter().find(|&tok| {
            // Compare lazily: almost every wrong candidate fails on its first element.
            let mut i = 0;
            for head in 0..self.heads(t) {
                for dim in 0..self.head_dim {
                    if storage_bits(self.dtype, self.value(layer, t, tok, head, dim)) != bits[i] {
                        return false;
                    }
                    i += 1;
                }
            }
            true
        })
    }

    /// What a column's bits look like when they are no candidate: every element poison-sized (`|x| >= 8`, the
    /// range of [`ValueSpace::pad_value`]), every element zero, or neither.
    pub fn classify(&self, bits: &[u32]) -> BitsKind {
        if bits.is_empty() {
            return BitsKind::Other;
        }
        let vals = bits.iter().map(|&b| bits_to_f32(self.dtype, b));
        if bits.iter().all(|&b| bits_to_f32(self.dtype, b) == 0.0) {
            BitsKind::Zeros
        } else if vals.clone().all(|x| x.abs() >= 8.0 && x.is_finite()) {
            BitsKind::Padding
        } else if vals.clone().all(|x| x.is_finite() && x.abs() <= 1.0) {
            BitsKind::InRange
        } else {
            BitsKind::Other
        }
    }
}

/// Coarse description of a column's bits (see [`ValueSpace::classify`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BitsKind {
    /// Every element zero (a column never written).
    Zeros,
    /// Every element poison-sized: a padded slot.
    Padding,
    /// Every element in the range of real values, but no candidate token matched.
    InRange,
    /// Anything else (NaN, infinities, mixed).
    Other,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vs(dtype: RefDtype) -> ValueSpace {
        ValueSpace { seed: 7, heads_kv: 2, heads_q: 4, head_dim: 8, dtype }
    }

    #[test]
    fn values_are_pure_in_range_and_rounded() {
        for dtype in [RefDtype::F32, RefDtype::Bf16] {
            let v = vs(dtype);
            for pos in 0..50 {
                let tok = Tok::new(3, pos);
                let a = v.column_f32(1, Tensor::K, tok);
                assert_eq!(a, v.column_f32(1, Tensor::K, tok));
                for &x in &a {
                    assert!((-1.0..=1.0).contains(&x), "{x}");
                    if dtype == RefDtype::Bf16 {
                        assert_eq!(x.to_bits() & 0xffff, 0, "bf16 values have 16 zero low bits");
                    }
                }
            }
        }
    }

    #[test]
    fn values_depend_on_every_key_part() {
        let v = vs(RefDtype::F32);
        let t = Tok::new(1, 2);
        let base = v.value(0, Tensor::K, t, 0, 0);
        assert_ne!(base, v.value(1, Tensor::K, t, 0, 0));
        assert_ne!(base, v.value(0, Tensor::V, t, 0, 0));
        assert_ne!(base, v.value(0, Tensor::K, Tok::new(2, 2), 0, 0));
        assert_ne!(base, v.value(0, Tensor::K, Tok::new(1, 3), 0, 0));
        assert_ne!(base, v.value(0, Tensor::K, t, 1, 0));
        assert_ne!(base, v.value(0, Tensor::K, t, 0, 1));
        let other_seed = ValueSpace { seed: 8, ..v };
        assert_ne!(base, other_seed.value(0, Tensor::K, t, 0, 0));
    }

    #[test]
    fn column_bits_layout() {
        let v = vs(RefDtype::Bf16);
        let tok = Tok::new(0, 5);
        let f = v.column_f32(0, Tensor::Q, tok);
        let b = v.column_bits(0, Tensor::Q, tok);
        assert_eq!(f.len(), 4 * 8);
        assert_eq!(b.len(), 4 * 8);
        for (x, bits) in f.iter().zip(&b) {
            assert!(*bits <= 0xffff, "bf16 bits live in the low 16 bits");
            assert_eq!(x.to_bits() >> 16, *bits);
            assert_eq!(bits_to_f32(RefDtype::Bf16, *bits), *x);
        }
        let v32 = vs(RefDtype::F32);
        let f = v32.column_f32(0, Tensor::V, tok);
        let b = v32.column_bits(0, Tensor::V, tok);
        assert_eq!(f.len(), 2 * 8);
        assert!(f.iter().zip(&b).all(|(x, bits)| x.to_bits() == *bits));
    }

    #[test]
    fn identify_finds_the_writer() {
        for dtype in [RefDtype::F32, RefDtype::Bf16] {
            let v = vs(dtype);
            let cands: Vec<Tok> = (0..4).flat_map(|r| (0..40).map(move |p| Tok::new(r, p))).collect();
            for &tok in &cands {
                let bits = v.column_bits(2, Tensor::V, tok);
                assert_eq!(v.identify(2, Tensor::V, &bits, cands.iter().copied()), Some(tok));
                // Same token, other tensor: not identified as V.
                let kbits = v.column_bits(2, Tensor::K, tok);
                assert_eq!(v.identify(2, Tensor::V, &kbits, cands.iter().copied()), None);
            }
            assert_eq!(v.identify(2, Tensor::V, &[0u32; 3], cands.iter().copied()), None, "wrong length");
        }
    }

    #[test]
    fn pad_values_are_poison_and_distinct() {
        for dtype in [RefDtype::F32, RefDtype::Bf16] {
            let v = vs(dtype);
            let mut seen = std::collections::HashSet::new();
            for slot in 0..16 {
                let col = v.pad_column_bits(0, Tensor::K, 1, slot);
                assert!(seen.insert(col.clone()), "pad columns are distinct");
                for &x in &v.pad_column_f32(0, Tensor::K, 1, slot) {
                    assert!((8.0..=16.0).contains(&x.abs()), "{x}");
                }
                assert_eq!(v.classify(&col), BitsKind::Padding);
            }
            assert_ne!(v.pad_value(0, Tensor::K, 0, 0, 0, 0), v.pad_value(0, Tensor::K, 1, 0, 0, 0));
            assert_eq!(v.classify(&[0; 16]), BitsKind::Zeros);
            assert_eq!(v.classify(&v.column_bits(0, Tensor::K, Tok::new(0, 0))), BitsKind::InRange);
        }
    }

    #[test]
    fn validate_shapes() {
        assert!(vs(RefDtype::F32).validate().is_ok());
        assert!(ValueSpace { heads_q: 3, ..vs(RefDtype::F32) }.validate().is_err());
        assert!(ValueSpace { heads_kv: 0, ..vs(RefDtype::F32) }.validate().is_err());
        assert!(ValueSpace { head_dim: 0, ..vs(RefDtype::F32) }.validate().is_err());
    }
}
