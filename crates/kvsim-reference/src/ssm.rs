//! The reference model of the gated-DeltaNet recurrent cache, in f64, with no array library.
//!
//! What it answers, independently of `src/cache`:
//! - **The state layout**: which input rows the convolution tail holds (the last `K-1` *real* `qkv` rows of the
//!   row's history, zeros before its first `K-1` positions). The tail is a copy of inputs, so its expected bytes
//!   are exact: [`SsmRowModel::conv_bits`].
//! - **The arithmetic**: the depthwise convolution, `silu`, `normalize_qk`, the gates and the gated-delta
//!   recurrence of the upstream Python engine's Qwen3.5 layer (docs/ssm.md names the files and the version), in f64
//!   on the dtype-rounded inputs. The production's f32 (and bf16) roundings and the array library's `exp` polynomial
//!   are not emulated, so outputs and the recurrent state are *measured* against it in ULPs at
//!   output scale, never claimed equal. The state layout is `[Hv, Dv, Dk]` per row, as the production's.
//! - **Inputs** ([`SsmValues`]): every `qkv`, `a`, `b` of a token is a pure function of
//!   `(seed, layer, request, position)` rounded to the dtype, and the layer weights of `(seed, layer)`, so a batch row
//!   and its solo twin are fed the same bytes by construction.
//!
//! Replays need nothing special here: a row that accepted `keep` positions of a verify window is simply the model
//! run over those positions (a fresh run of the accepted prefix).

use super::values::{bits_to_f32, round_to, splitmix64, RefDtype};

/// The geometry of one gated-DeltaNet layer (mirrors the production's spec, as plain integers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct SsmDims {
    pub kernel: usize,
    pub heads_k: usize,
    pub heads_v: usize,
    pub dk: usize,
    pub dv: usize,
    pub dtype: RefDtype,
}

impl SsmDims {
    /// `2 Hk Dk + Hv Dv`.
    pub fn conv_dim(&self) -> usize {
        2 * self.heads_k * self.dk + self.heads_v * self.dv
    }

    /// Elements of one row's recurrent state.
    pub fn state_len(&self) -> usize {
        self.heads_v * self.dv * self.dk
    }
}

/// A layer's weights as f64 of their stored (dtype-rounded) values.
#[derive(Debug, Clone, PartialEq)]
pub struct SsmWeights {
    /// `[conv_dim, K]` row-major (channel, tap), the production's `[conv_dim, K, 1]`.
    pub conv: Vec<f64>,
    /// `[Hv]`, stored in f32.
    pub a_log: Vec<f64>,
    /// `[Hv]`, stored in the dtype.
    pub dt_bias: Vec<f64>,
}

/// One token's inputs, as f64 of their stored values.
#[derive(Debug, Clone, PartialEq)]
pub struct SsmToken {
    pub qkv: Vec<f64>,
    pub a: Vec<f64>,
    pub b: Vec<f64>,
}

/// Deterministic inputs and weights of a simulated model.
#[derive(Debug, Clone, Copy)]
pub struct SsmValues {
    pub seed: u64,
    pub dims: SsmDims,
}

fn mix(words: &[u64]) -> u64 {
    words.iter().fold(0x7373_6d00_0000_0001u64, |acc, &w| splitmix64(acc ^ splitmix64(w)))
}

fn uniform(h: u64, lo: f64, hi: f64) -> f32 {
    (lo + ((h >> 40) as f64 / (1u64 << 24) as f64) * (hi - lo)) as f32
}

impl SsmValues {
    fn draw(&self, key: &[u64], n: usize, lo: f64, hi: f64, d: RefDtype) -> Vec<u32> {
        (0..n).map(|i| round_to(d, uniform(mix(&[&[self.seed], key, &[i as u64]].concat()), lo, hi) as f64)).collect()
    }

    /// The layer's weights as storage bits: conv `[conv_dim * K]` and `dt_bias` `[Hv]` in the dtype, `A_log` in
    /// f32 (the upstream engine keeps it f32).
    pub fn weight_bits(&self, layer: u32) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
        let d = &self.dims;
        let l = layer as u64;
        (
            self.draw(&[1, l], d.conv_dim() * d.kernel, -0.6, 0.6, d.dtype),
            self.draw(&[2, l], d.heads_v, -1.0, 1.0, RefDtype::F32),
            self.draw(&[3, l], d.heads_v, -0.5, 0.5, d.dtype),
        )
    }

    /// The layer's weights as f64.
    pub fn weights(&self, layer: u32) -> SsmWeights {
        let (c, a, t) = self.weight_bits(layer);
        let f = |v: Vec<u32>, d: RefDtype| v.into_iter().map(|b| bits_to_f32(d, b) as f64).collect();
        SsmWeights { conv: f(c, self.dims.dtype), a_log: f(a, RefDtype::F32), dt_bias: f(t, self.dims.dtype) }
    }

    /// The storage bits of request `req`'s inputs at `pos`: `(qkv [conv_dim], a [Hv], b [Hv])`.
    pub fn token_bits(&self, layer: u32, req: u64, pos: u64) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
        let d = &self.dims;
        let l = layer as u64;
        (
            self.draw(&[4, l, req, pos], d.conv_dim(), -1.0, 1.0, d.dtype),
            self.draw(&[5, l, req, pos], d.heads_v, -2.0, 2.0, d.dtype),
            self.draw(&[6, l, req, pos], d.heads_v, -2.0, 2.0, d.dtype),
        )
    }

    /// Conspicuous inputs for a padded slot (row, slot): large, so a padded position folded into a state shows.
    pub fn pad_bits(&self, layer: u32, row: u64, slot: u64) -> (Vec<u32>, Vec<u32>, Vec<u32>) {
        let d = &self.dims;
        let l = layer as u64;
        (
            self.draw(&[7, l, row, slot], d.conv_dim(), -8.0, 8.0, d.dtype),
            self.draw(&[8, l, row, slot], d.heads_v, -6.0, 6.0, d.dtype),
            self.draw(&[9, l, row, slot], d.heads_v, -6.0, 6.0, d.dtype),
        )
    }

    /// Request `req`'s inputs at `pos`, as f64.
    pub fn token(&self, layer: u32, req: u64, pos: u64) -> SsmToken {
        let (q, a, b) = self.token_bits(layer, req, pos);
        let f = |v: Vec<u32>| v.into_iter().map(|x| bits_to_f32(self.dims.dtype, x) as f64).collect();
        SsmToken { qkv: f(q), a: f(a), b: f(b) }
    }
}

/// One row's expected state: the conv tail (exact input values), the recurrent state (f64) and the offset.
#[derive(Debug, Clone, PartialEq)]
pub struct SsmRowModel {
    pub dims: SsmDims,
    /// `[K-1, conv_dim]`, oldest first.
    pub conv: Vec<f64>,
    /// `[Hv, Dv, Dk]`.
    pub state: Vec<f64>,
    pub offset: usize,
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

fn softplus(x: f64) -> f64 {
    // logaddexp(x, 0), stable.
    x.max(0.0) + (-x.abs()).exp().ln_1p()
}

/// Python's weak scalar `s` as the dtype rounds it (the upstream engine multiplies arrays by Python floats).
fn weak(d: RefDtype, s: f64) -> f64 {
    bits_to_f32(d, round_to(d, s)) as f64
}

impl SsmRowModel {
    /// A fresh row: zero conv tail, zero state, offset 0.
    pub fn new(dims: SsmDims) -> Self {
        SsmRowModel {
            dims,
            conv: vec![0.0; (dims.kernel - 1) * dims.conv_dim()],
            state: vec![0.0; dims.state_len()],
            offset: 0,
        }
    }

    /// The expected conv tail as storage bits of the dtype (exact: the tail is a copy of inputs).
    pub fn conv_bits(&self) -> Vec<u32> {
        self.conv.iter().map(|&x| round_to(self.dims.dtype, x)).collect()
    }

    /// One real position: the convolution over the tail and this token, the gates and one recurrence step.
    /// Returns `y [Hv * Dv]` in f64.
    pub fn step(&mut self, w: &SsmWeights, tok: &SsmToken) -> Vec<f64> {
        let d = self.dims;
        let (c, k) = (d.conv_dim(), d.kernel);
        // Depthwise conv over [tail ++ token] and silu.
        let x = |j: usize, ch: usize| if j < k - 1 { self.conv[j * c + ch] } else { tok.qkv[ch] };
        let conv: Vec<f64> = (0..c)
            .map(|ch| {
                let s: f64 = (0..k).map(|j| x(j, ch) * w.conv[ch * k + j]).sum();
                s * sigmoid(s)
            })
            .collect();
        let kd = d.heads_k * d.dk;
        let inv = (d.dk as f64).powf(-0.5);
        let eps = 1e-6 * inv * inv;
        let norm = |v: &[f64], scale: f64| -> Vec<f64> {
            let ms = v.iter().map(|x| x * x).sum::<f64>() / v.len() as f64;
            let r = 1.0 / (ms + eps).sqrt();
            v.iter().map(|x| x * r * scale).collect()
        };
        let (qs, ks) = (weak(d.dtype, inv * inv), weak(d.dtype, inv));
        let rep = d.heads_v / d.heads_k;
        let mut y = vec![0.0; d.heads_v * d.dv];
        for h in 0..d.heads_v {
            let hk = h / rep;
            let q = norm(&conv[hk * d.dk..(hk + 1) * d.dk], qs);
            let kk = norm(&conv[kd + hk * d.dk..kd + (hk + 1) * d.dk], ks);
            let v = &conv[2 * kd + h * d.dv..2 * kd + (h + 1) * d.dv];
            let beta = sigmoid(tok.b[h]);
            let g = (-(w.a_log[h].exp()) * softplus(tok.a[h] + w.dt_bias[h])).exp();
            let s = &mut self.state[h * d.dv * d.dk..(h + 1) * d.dv * d.dk];
            for dv in 0..d.dv {
                let row = &mut s[dv * d.dk..(dv + 1) * d.dk];
                row.iter_mut().for_each(|x| *x *= g);
                let kv: f64 = row.iter().zip(&kk).map(|(a, b)| a * b).sum();
                let delta = (v[dv] - kv) * beta;
                row.iter_mut().zip(&kk).for_each(|(x, kx)| *x += kx * delta);
                y[h * d.dv + dv] = row.iter().zip(&q).map(|(a, b)| a * b).sum();
            }
        }
        // The tail slides by one real row.
        if k > 1 {
            self.conv.drain(0..c);
            self.conv.extend_from_slice(&tok.qkv);
        }
        self.offset += 1;
        y
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims() -> SsmDims {
        SsmDims { kernel: 4, heads_k: 1, heads_v: 2, dk: 4, dv: 2, dtype: RefDtype::Bf16 }
    }

    #[test]
    fn the_tail_holds_the_last_real_inputs() {
        let vals = SsmValues { seed: 9, dims: dims() };
        let w = vals.weights(0);
        let mut m = SsmRowModel::new(dims());
        assert!(m.conv_bits().iter().all(|&b| b == 0));
        for p in 0..5 {
            m.step(&w, &vals.token(0, 1, p));
        }
        let c = dims().conv_dim();
        let want: Vec<u32> = (2..5).flat_map(|p| vals.token_bits(0, 1, p).0).collect();
        assert_eq!(m.conv_bits(), want);
        assert_eq!(m.offset, 5);
        assert_eq!(m.conv.len(), 3 * c);
    }

    #[test]
    fn the_recurrence_is_the_delta_rule() {
        // One head, Dk = Dv = 1 by hand: S = g S + k (v - g S k) beta, y = S q.
        let d = SsmDims { kernel: 1, heads_k: 1, heads_v: 1, dk: 1, dv: 1, dtype: RefDtype::F32 };
        let w = SsmWeights { conv: vec![1.0, 1.0, 1.0], a_log: vec![0.0], dt_bias: vec![0.0] };
        let mut m = SsmRowModel::new(d);
        let tok = SsmToken { qkv: vec![0.5, -0.25, 2.0], a: vec![0.0], b: vec![0.0] };
        let y = m.step(&w, &tok);
        let silu = |x: f64| x * sigmoid(x);
        let norm = |x: f64| x / (x * x + 1e-6).sqrt();
        let (q, k, v) = (norm(silu(0.5)), norm(silu(-0.25)), silu(2.0));
        let g = (-(2f64.ln())).exp(); // softplus(0) = ln 2, exp(A_log) = 1
        let s = g * 0.0 + k * (v - 0.0) * 0.5;
        assert!((m.state[0] - s).abs() < 1e-12, "{} vs {s}", m.state[0]);
        assert!((y[0] - s * q).abs() < 1e-12);
        assert!((g - 0.5).abs() < 1e-15);
    }

    #[test]
    fn inputs_are_pure_functions_of_their_key() {
        let vals = SsmValues { seed: 3, dims: dims() };
        assert_eq!(vals.token_bits(1, 2, 3), vals.token_bits(1, 2, 3));
        assert_ne!(vals.token_bits(1, 2, 3), vals.token_bits(1, 2, 4));
        assert_ne!(vals.token_bits(1, 2, 3), vals.pad_bits(1, 2, 3));
        assert_eq!(vals.weights(0), vals.weights(0));
    }
}
