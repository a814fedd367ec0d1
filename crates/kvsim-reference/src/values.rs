//! Self-identifying K/V/Q values.
//!
//! Every value the simulator feeds a cache is a pure function of
//! `(seed, layer, tensor, request, position, head, dim)`: a splitmix64 hash of the mixed key, mapped to a uniform
//! value in `[-1, 1)` with 24 significant bits, then rounded to the storage dtype (round-to-nearest-even for bf16,
//! after which the range is `[-1, 1]`). A column (all heads and dims of one token) is therefore a fingerprint of
//! its token: [`ValueSpace::identify`] turns the bits found in a physical column back into the token that wrote
//! them, which is how a divergence report can say "expected position 12, found position 4".
//!
//! This module also owns dtype rounding ([`round_to`]) and the ULP distance ([`ulp_distance`]); it depends on no
//! other part of `reference` but its error type (the other modules depend on it, never the reverse).
//!
//! Padded slots get [`ValueSpace::pad_value`]: poison of magnitude in `[8, 16)`, far outside the range of real
//! values, so a padded slot that leaks into attention moves the output visibly and a padded column found where a
//! token was expected is recognisable at a glance.

use std::fmt;
use std::rc::Rc;

use crate::error::ModelError;
use crate::memo::Memo;

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

/// Columns one thread's memo holds before it starts over ([`ValueSpace::column`]).
pub const COLUMN_MEMO_LIMIT: usize = crate::memo::MEMO_LIMIT;

/// What a memoized column is a pure function of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct ColumnKey {
    space: (u64, u32, u32, u32, RefDtype),
    layer: u32,
    tensor: Tensor,
    tok: Tok,
}

thread_local! {
    static COLUMNS: Memo<ColumnKey, Rc<[f32]>> = Memo::default();
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
        if self.heads_kv == 0 || self.head_dim == 0 || self.heads_q == 0 || !self.heads_q.is_multiple_of(self.heads_kv)
        {
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

    /// One column of `t` for `tok`: `[heads(t), head_dim]` row-major (a copy of [`ValueSpace::column`]).
    pub fn column_f32(&self, layer: u32, t: Tensor, tok: Tok) -> Vec<f32> {
        self.column(layer, t, tok).to_vec()
    }

    /// One column of `t` for `tok`, `[heads(t), head_dim]` row-major, shared: memoized per thread, since a run asks
    /// for the same columns again and again (the batch's payload and the twin's, every model read over its visible
    /// keys, every state check). Guarantees: the same values as computing them afresh ([`ValueSpace::value`] per
    /// element); debug builds recompute every 16th answer from the memo and assert it. The memo holds at most
    /// [`COLUMN_MEMO_LIMIT`] columns per thread (then it starts over).
    pub fn column(&self, layer: u32, t: Tensor, tok: Tok) -> Rc<[f32]> {
        COLUMNS.with(|m| m.get_or(self.column_key(layer, t, tok), || self.fresh_column(layer, t, tok).into()))
    }

    /// Everything [`ValueSpace::column`] of `(layer, t, tok)` depends on.
    pub(crate) fn column_key(&self, layer: u32, t: Tensor, tok: Tok) -> ColumnKey {
        ColumnKey {
            space: (self.seed, self.heads_kv as u32, self.heads_q as u32, self.head_dim as u32, self.dtype),
            layer,
            tensor: t,
            tok,
        }
    }

    /// [`ValueSpace::column`] computed afresh, element by element.
    fn fresh_column(&self, layer: u32, t: Tensor, tok: Tok) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.column_len(t));
        for head in 0..self.heads(t) {
            for dim in 0..self.head_dim {
                out.push(self.value(layer, t, tok, head, dim));
            }
        }
        out
    }

    /// The storage bits of a value of this space (f32 bits, or bf16 bits in the low 16 bits).
    pub fn bits(&self, x: f32) -> u32 {
        storage_bits(self.dtype, x)
    }

    /// One column as storage bits: f32 bits, or bf16 bits in the low 16 bits of each `u32`.
    pub fn column_bits(&self, layer: u32, t: Tensor, tok: Tok) -> Vec<u32> {
        self.column(layer, t, tok).iter().map(|&x| storage_bits(self.dtype, x)).collect()
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

    /// kvsim's one payload builder: the `[B, heads, L, D]` block of `t` on `layer`, row-major, for `toks`
    /// (`toks[b][i]` is the token in row `b`, slot `i`; `None` is a padded slot, filled with
    /// [`ValueSpace::pad_column_f32`]'s poison). `L` is the longest row; slots past a shorter row's end stay `0.0`.
    /// Returns the values (exactly representable in `self.dtype`, so casting them to it is exact) and the shape.
    pub fn block_f32(&self, layer: u32, t: Tensor, toks: &[Vec<Option<Tok>>]) -> (Vec<f32>, [usize; 4]) {
        let (heads, d, b) = (self.heads(t), self.head_dim, toks.len());
        let l = toks.iter().map(Vec::len).max().unwrap_or(0);
        let mut data = vec![0f32; b * heads * l * d];
        for (r, row) in toks.iter().enumerate() {
            for (i, tok) in row.iter().enumerate() {
                let col: Rc<[f32]> = match tok {
                    Some(tok) => self.column(layer, t, *tok),
                    None => self.pad_column_f32(layer, t, r as u32, i as u32).into(),
                };
                for h in 0..heads {
                    data[((r * heads + h) * l + i) * d..][..d].copy_from_slice(&col[h * d..(h + 1) * d]);
                }
            }
        }
        (data, [b, heads, l, d])
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

// ---- rounding and ULP distances (the one owner of both in kvsim) ----------------------------------------------

/// `x` rounded to `d`, round-to-nearest-even, as storage bits (f32 bits, or bf16 bits in the low 16 bits).
///
/// Guarantees: a single correct rounding from f64 (bf16 goes through f32 with round-to-odd, which cannot
/// double-round); overflow gives infinity; NaN gives a quiet NaN of the same sign.
pub fn round_to(d: RefDtype, x: f64) -> u32 {
    match d {
        RefDtype::F32 => (x as f32).to_bits(),
        RefDtype::Bf16 => f32_bits_to_bf16_rne(f64_to_f32_round_odd(x).to_bits()) as u32,
    }
}

/// f64 -> f32 rounding to odd: truncate toward zero, then set the last bit when inexact.
fn f64_to_f32_round_odd(x: f64) -> f32 {
    if x.is_nan() || x.is_infinite() {
        return x as f32;
    }
    let f = x as f32; // nearest-even; may overflow to infinity
    if f.is_finite() && f as f64 == x {
        return f;
    }
    let mut b = if f.is_infinite() { f32::MAX.copysign(f).to_bits() } else { f.to_bits() };
    if (f32::from_bits(b) as f64).abs() > x.abs() {
        b -= 1; // one step toward zero (the magnitude bits are > 0 here)
    }
    f32::from_bits(b | 1)
}

/// f32 bits -> bf16 bits, round-to-nearest-even.
fn f32_bits_to_bf16_rne(b: u32) -> u16 {
    if f32::from_bits(b).is_nan() {
        return ((b >> 16) as u16) | 0x0040;
    }
    let bias = 0x7fff + ((b >> 16) & 1);
    ((b as u64 + bias as u64) >> 16) as u16
}

pub use kvsim_ulp::{ulp_distance, FloatFormat};

/// Distance in ULPs of f32 between `a` and `b` ([`ulp_distance`]).
pub fn ulp_f32(a: f32, b: f32) -> u64 {
    ulp_distance(FloatFormat::F32, a.to_bits() as u64, b.to_bits() as u64)
}

/// Distance in ULPs of bf16 between the bf16 bit patterns `a` and `b` ([`ulp_distance`]).
pub fn ulp_bf16(a: u16, b: u16) -> u64 {
    ulp_distance(FloatFormat::Bf16, a as u64, b as u64)
}

/// ULP distance between two storage bit patterns of dtype `d` (bf16 bits in the low 16 bits).
pub fn ulp_bits(d: RefDtype, a: u32, b: u32) -> u64 {
    match d {
        RefDtype::F32 => ulp_f32(f32::from_bits(a), f32::from_bits(b)),
        RefDtype::Bf16 => ulp_bf16(a as u16, b as u16),
    }
}

/// The largest ULP distance between `expected` (rounded to `d` first, see [`round_to`]) and the `found` storage
/// bits, element by element. `u64::MAX` when the lengths differ or any element is NaN; `0` for two empty slices.
pub fn max_ulp(d: RefDtype, expected: &[f64], found: &[u32]) -> u64 {
    if expected.len() != found.len() {
        return u64::MAX;
    }
    expected.iter().zip(found).map(|(&e, &f)| ulp_bits(d, round_to(d, e), f)).max().unwrap_or(0)
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

    #[test]
    fn round_to_bf16_is_single_rounding() {
        assert_eq!(round_to(RefDtype::Bf16, 1.0), 0x3f80);
        assert_eq!(round_to(RefDtype::Bf16, -2.0), 0xc000);
        // Exactly halfway between 1 and 1 + 2^-7: ties to even (1.0).
        assert_eq!(round_to(RefDtype::Bf16, 1.0 + 2f64.powi(-8)), 0x3f80);
        // Halfway between 1 + 2^-7 and 1 + 2^-6: ties to even (1 + 2^-6).
        assert_eq!(round_to(RefDtype::Bf16, 1.0 + 3.0 * 2f64.powi(-8)), 0x3f82);
        // Just above the midpoint by less than an f32 ulp: double rounding via f32 would give 1.0.
        let x = 1.0 + 2f64.powi(-8) + 2f64.powi(-30);
        assert_eq!(half::bf16::from_f32(x as f32).to_bits(), 0x3f80, "the double-rounding trap");
        assert_eq!(round_to(RefDtype::Bf16, x), 0x3f81);
        assert_eq!(round_to(RefDtype::Bf16, 1e300), 0x7f80);
        assert_eq!(round_to(RefDtype::Bf16, -1e300), 0xff80);
        assert_eq!(round_to(RefDtype::Bf16, f64::INFINITY), 0x7f80);
        assert!(bits_to_f32(RefDtype::Bf16, round_to(RefDtype::Bf16, f64::NAN)).is_nan());
        assert_eq!(round_to(RefDtype::Bf16, 0.0), 0);
        assert_eq!(round_to(RefDtype::Bf16, -0.0), 0x8000);
        assert_eq!(round_to(RefDtype::F32, 0.1), 0.1f32.to_bits());
    }

    #[test]
    fn ulp_distances() {
        assert_eq!(ulp_f32(1.0, 1.0), 0);
        assert_eq!(ulp_f32(1.0, f32::from_bits(1.0f32.to_bits() + 3)), 3);
        assert_eq!(ulp_f32(-1.0, f32::from_bits((-1.0f32).to_bits() + 2)), 2);
        assert_eq!(ulp_f32(0.0, -0.0), 1, "+0 and -0 are different bytes: 1 apart");
        assert_eq!(ulp_f32(f32::from_bits(1), -f32::from_bits(1)), 3);
        assert_eq!(ulp_f32(f32::NAN, f32::NAN), u64::MAX);
        assert_eq!(ulp_f32(1.0, f32::NAN), u64::MAX);
        assert_eq!(ulp_f32(f32::MAX, f32::INFINITY), 1);
        assert_eq!(ulp_bf16(0x3f80, 0x3f81), 1);
        assert_eq!(ulp_bf16(0x3f81, 0x3f80), 1);
        assert_eq!(ulp_bf16(0x0000, 0x8000), 1);
        assert_eq!(ulp_bf16(0xbf80, 0xbf82), 2);
        assert_eq!(ulp_bf16(0x7fc0, 0x3f80), u64::MAX);
        assert_eq!(ulp_bits(RefDtype::Bf16, 0x3f80, 0x3f84), 4);
        assert_eq!(max_ulp(RefDtype::Bf16, &[1.0, 2.0], &[0x3f80, 0x4001]), 1);
        assert_eq!(max_ulp(RefDtype::Bf16, &[1.0], &[0x3f80, 0x4001]), u64::MAX);
        assert_eq!(max_ulp(RefDtype::F32, &[], &[]), 0);
    }

    #[test]
    fn ulp_distance_by_format() {
        assert_eq!(ulp_distance(FloatFormat::F16, 0x3c00, 0x3c02), 2);
        assert_eq!(ulp_distance(FloatFormat::F16, 0x7e00, 0x3c00), u64::MAX, "f16 NaN");
        assert_eq!(ulp_distance(FloatFormat::F16, 0x7c00, 0x7bff), 1, "f16 infinity is one step past MAX");
        assert_eq!(ulp_distance(FloatFormat::F64, 1f64.to_bits(), (-1f64).to_bits()), 2 * 1f64.to_bits() + 1);
        assert_eq!(ulp_distance(FloatFormat::F64, f64::NAN.to_bits(), 0), u64::MAX);
        assert_eq!(ulp_distance(FloatFormat::F32, 0xdead_0000_3f80_0000, 0x3f80_0001), 1, "high bits ignored");
    }

    proptest::proptest! {
        #[test]
        fn ulp_f32_is_a_distance_on_the_float_line(a in proptest::prelude::any::<u32>(), b in proptest::prelude::any::<u32>(), c in proptest::prelude::any::<u32>()) {
            let mut xs = [f32::from_bits(a), f32::from_bits(b), f32::from_bits(c)];
            proptest::prop_assume!(xs.iter().all(|x| !x.is_nan()));
            xs.sort_by(|p, q| p.total_cmp(q));
            let [x, y, z] = xs;
            proptest::prop_assert_eq!(ulp_f32(x, y) == 0, x.to_bits() == y.to_bits());
            proptest::prop_assert_eq!(ulp_f32(x, y), ulp_f32(y, x));
            proptest::prop_assert_eq!(ulp_f32(x, z), ulp_f32(x, y) + ulp_f32(y, z), "additive along the line");
        }

        #[test]
        fn round_to_bf16_matches_half_on_f32_inputs(a in proptest::prelude::any::<u32>()) {
            let x = f32::from_bits(a);
            proptest::prop_assume!(!x.is_nan());
            proptest::prop_assert_eq!(round_to(RefDtype::Bf16, x as f64), half::bf16::from_f32(x).to_bits() as u32);
        }
    }

    #[test]
    fn block_places_columns_by_row_head_slot() {
        let v = vs(RefDtype::Bf16);
        let toks = vec![vec![Some(Tok::new(0, 4)), None], vec![Some(Tok::new(1, 0))]];
        let (data, shape) = v.block_f32(2, Tensor::Q, &toks);
        let (h, d) = (v.heads_q, v.head_dim);
        assert_eq!(shape, [2, h, 2, d]);
        assert_eq!(data.len(), 2 * h * 2 * d);
        let at = |r: usize, hh: usize, i: usize| data[((r * h + hh) * 2 + i) * d..][..d].to_vec();
        let col = v.column_f32(2, Tensor::Q, Tok::new(0, 4));
        let pad = v.pad_column_f32(2, Tensor::Q, 0, 1);
        let other = v.column_f32(2, Tensor::Q, Tok::new(1, 0));
        for hh in 0..h {
            assert_eq!(at(0, hh, 0), col[hh * d..(hh + 1) * d]);
            assert_eq!(at(0, hh, 1), pad[hh * d..(hh + 1) * d]);
            assert_eq!(at(1, hh, 0), other[hh * d..(hh + 1) * d]);
            assert!(at(1, hh, 1).iter().all(|&x| x.to_bits() == 0), "past a short row's end: +0.0");
        }
        assert_eq!(v.block_f32(0, Tensor::K, &[]), (vec![], [0, v.heads_kv, 0, d]));
    }
}
