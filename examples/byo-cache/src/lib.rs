//! A small K/V cache for continuous batching, written from scratch on `mlx-rs` (no kvsim code): a serial cache
//! per request ([`SoloCache`]) and a batch of right-padded rows ([`BatchCache`]) whose row `r` holds its positions in
//! columns `0..offsets[r]` of one `[B, H_kv, W, D]` buffer per plane.
//!
//! Every read attends with MLX's fused scaled-dot-product attention over exactly the positions a request holds:
//! a batch read slices each row's live columns and attends them as its serial cache would, so a row's output is
//! the bytes of the same request run alone.
//!
//! [`Planted::SharedDecodeColumn`] plants a realistic bug: the batch writes every row's new positions at one shared
//! column (the longest row's offset), as a layout that keeps one write index for the whole batch does when its rows
//! are right-padded instead of left-padded. A shorter row then attends a column of zeros it never wrote.

use mlx_rs::error::Exception;
use mlx_rs::fast::{scaled_dot_product_attention, ScaledDotProductAttentionMask};
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::ops::{concatenate, zeros_dtype};
use mlx_rs::{Array, Dtype};

/// The cache's result.
pub type Result<T> = std::result::Result<T, Exception>;

/// A bug to plant, for the tutorial's failing run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Planted {
    /// The correct cache.
    None,
    /// Batch writes land at one shared column (module docs).
    SharedDecodeColumn,
}

/// The shapes every cache of a model shares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub heads_kv: usize,
    pub head_dim: usize,
    pub dtype: Dtype,
}

impl Shape {
    fn empty(&self, rows: usize) -> Result<Array> {
        zeros_dtype(&[rows as i32, self.heads_kv as i32, 0, self.head_dim as i32], self.dtype)
    }
}

/// `q` (`[1, H_q, L, D]`) attending `k`, `v` (`[1, H_kv, N, D]`), causal within the last `L` positions.
fn attend(q: &Array, k: &Array, v: &Array, scale: f32) -> Result<Array> {
    let mask = (q.shape()[2] > 1).then_some(ScaledDotProductAttentionMask::Causal);
    scaled_dot_product_attention(q, k, v, scale, mask, None)
}

/// Columns `from..to` of row `row` of a `[B, H, W, D]` plane.
fn cols(p: &Array, row: usize, from: usize, to: usize) -> Result<Array> {
    p.try_index((row as i32..row as i32 + 1, .., from as i32..to as i32, ..))
}

/// One request's cache: K and V `[1, H_kv, offset, D]`.
#[derive(Debug, Clone)]
pub struct SoloCache {
    shape: Shape,
    planted: Planted,
    k: Array,
    v: Array,
}

impl SoloCache {
    /// An empty cache.
    pub fn new(shape: Shape, planted: Planted) -> Result<SoloCache> {
        Ok(SoloCache { shape, planted, k: shape.empty(1)?, v: shape.empty(1)? })
    }

    /// Positions held.
    pub fn offset(&self) -> usize {
        self.k.shape()[2] as usize
    }

    /// Appends `L` positions and attends `q` over everything held (causal within the block).
    pub fn window(&mut self, k: &Array, v: &Array, q: &Array, scale: f32) -> Result<Array> {
        self.k = concatenate(&[&self.k, k], 2)?;
        self.v = concatenate(&[&self.v, v], 2)?;
        attend(q, &self.k, &self.v, scale)
    }

    /// Drops the last `n` positions (at most all of them); returns how many it dropped.
    pub fn trim(&mut self, n: usize) -> Result<usize> {
        let n = n.min(self.offset());
        let keep = self.offset() - n;
        self.k = cols(&self.k, 0, 0, keep)?;
        self.v = cols(&self.v, 0, 0, keep)?;
        Ok(n)
    }

    /// K and V.
    pub fn state(&self) -> [Array; 2] {
        [self.k.clone(), self.v.clone()]
    }
}

/// Right-padded rows: row `r` holds columns `0..offsets[r]` of `k` and `v` (`[B, H_kv, W, D]`).
#[derive(Debug, Clone)]
pub struct BatchCache {
    shape: Shape,
    planted: Planted,
    k: Array,
    v: Array,
    offsets: Vec<usize>,
}

impl BatchCache {
    /// The rows of these caches, in order: each padded with zeros to the longest.
    pub fn merge(rows: Vec<SoloCache>) -> Result<BatchCache> {
        let first = rows.first().ok_or_else(|| Exception::custom("merge of no rows"))?;
        let (shape, planted) = (first.shape, first.planted);
        let width = rows.iter().map(SoloCache::offset).max().unwrap_or(0);
        let pad = |p: &Array| -> Result<Array> {
            let missing = width - p.shape()[2] as usize;
            let z = zeros_dtype(&[1, shape.heads_kv as i32, missing as i32, shape.head_dim as i32], shape.dtype)?;
            concatenate(&[p, &z], 2)
        };
        let ks = rows.iter().map(|r| pad(&r.k)).collect::<Result<Vec<_>>>()?;
        let vs = rows.iter().map(|r| pad(&r.v)).collect::<Result<Vec<_>>>()?;
        Ok(BatchCache {
            shape,
            planted,
            k: concatenate(&ks, 0)?,
            v: concatenate(&vs, 0)?,
            offsets: rows.iter().map(SoloCache::offset).collect(),
        })
    }

    /// Rows held.
    pub fn rows(&self) -> usize {
        self.offsets.len()
    }

    /// Positions held, per row.
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }

    /// `L` new positions for every row (`k`, `v`: `[B, H_kv, L, D]`), each row attending its own positions
    /// (`q`: `[B, H_q, L, D]`); returns `[B, H_q, L, D]`. A decode step is `L = 1`.
    pub fn window(&mut self, k: &Array, v: &Array, q: &Array, scale: f32) -> Result<Array> {
        let l = k.shape()[2] as usize;
        let shared = self.offsets.iter().copied().max().unwrap_or(0);
        let at: Vec<usize> = match self.planted {
            Planted::None => self.offsets.clone(),
            Planted::SharedDecodeColumn => vec![shared; self.rows()],
        };
        let width = at.iter().map(|c| c + l).max().unwrap_or(0).max(self.k.shape()[2] as usize);
        let (mut ks, mut vs, mut outs) = (vec![], vec![], vec![]);
        for (r, &c) in at.iter().enumerate() {
            let write = |p: &Array, new: &Array| -> Result<Array> {
                let old = p.shape()[2] as usize;
                let before = cols(p, r, 0, c.min(old))?;
                let gap = zeros_dtype(
                    &[1, self.shape.heads_kv as i32, c.saturating_sub(old) as i32, self.shape.head_dim as i32],
                    self.shape.dtype,
                )?;
                let after = cols(p, r, (c + l).min(old), old)?;
                let row = concatenate(&[&before, &gap, &cols(new, r, 0, l)?, &after], 2)?;
                let tail = zeros_dtype(
                    &[
                        1,
                        self.shape.heads_kv as i32,
                        (width - row.shape()[2] as usize) as i32,
                        self.shape.head_dim as i32,
                    ],
                    self.shape.dtype,
                )?;
                concatenate(&[&row, &tail], 2)
            };
            let (kr, vr) = (write(&self.k, k)?, write(&self.v, v)?);
            let n = c + l;
            outs.push(attend(&cols(q, r, 0, l)?, &cols(&kr, 0, 0, n)?, &cols(&vr, 0, 0, n)?, scale)?);
            ks.push(kr);
            vs.push(vr);
        }
        self.k = concatenate(&ks, 0)?;
        self.v = concatenate(&vs, 0)?;
        self.offsets = at.iter().map(|c| c + l).collect();
        concatenate(&outs, 0)
    }

    /// Row `row` as a serial cache (the batch unchanged).
    pub fn extract(&self, row: usize) -> Result<SoloCache> {
        let n = *self.offsets.get(row).ok_or_else(|| Exception::custom(format!("no row {row}")))?;
        Ok(SoloCache {
            shape: self.shape,
            planted: self.planted,
            k: cols(&self.k, row, 0, n)?,
            v: cols(&self.v, row, 0, n)?,
        })
    }

    /// Keeps these rows, in this order (each once, at least one).
    pub fn filter(&mut self, keep: &[usize]) -> Result<()> {
        let mut seen = vec![false; self.rows()];
        for &r in keep {
            if r >= self.rows() || std::mem::replace(&mut seen[r], true) {
                return Err(Exception::custom(format!("filter {keep:?} of {} rows", self.rows())));
            }
        }
        if keep.is_empty() {
            return Err(Exception::custom("filter keeping no row"));
        }
        let at = Array::from_slice(&keep.iter().map(|&r| r as i32).collect::<Vec<_>>(), &[keep.len() as i32]);
        self.k = self.k.take_axis(&at, 0)?;
        self.v = self.v.take_axis(&at, 0)?;
        self.offsets = keep.iter().map(|&r| self.offsets[r]).collect();
        Ok(())
    }

    /// Drops the last `n` positions of every row (`n` at most the shortest row's offset); returns `n`.
    pub fn trim(&mut self, n: usize) -> Result<usize> {
        if self.offsets.iter().any(|&o| o < n) {
            return Err(Exception::custom(format!("trim({n}) of rows holding {:?}", self.offsets)));
        }
        self.offsets.iter_mut().for_each(|o| *o -= n);
        Ok(n)
    }

    /// Row `row`'s K and V, `[1, H_kv, offset, D]`.
    pub fn row_state(&self, row: usize) -> Result<[Array; 2]> {
        let s = self.extract(row)?;
        Ok([s.k, s.v])
    }
}
