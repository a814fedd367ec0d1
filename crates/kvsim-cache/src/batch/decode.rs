//! The decode step of a [`RowBatch`]: the host bookkeeping (R-C-9: oversize drop, compaction to the capacity bound,
//! head rotation, growth), the one-scatter write, the read, committed spans (all rows, or known spans of unequal
//! per-row lengths), and the hooks of the compiled step (`compiled.rs`).

use mlx_rs::Array;

use super::capacity::capacity_bound;
use super::RowBatch;
use crate::error::{invalid, shape, CacheError};
use crate::mask::{MaskKey, MaskKind, MaskUse, Masks};
use crate::quant::{attend_planes, Storage};
use crate::ring::{grown_capacity, Buf, RingState};
use crate::util::{cols, index_array, step_index_array};
use crate::Result;

impl RowBatch {
    /// Grows the buffer (in [`crate::ring::GROW_STEP`] steps, capped at the window for rings) to hold `needed`
    /// columns.
    pub(super) fn ensure_capacity(&mut self, needed: usize) -> Result<()> {
        let cap = self.cap();
        let new_cap = grown_capacity(cap, needed, self.max_size);
        if new_cap > cap {
            self.buf = Buf::grow(self.buf.take(), &self.spec, &self.storage, self.rows.len(), new_cap - cap)?;
        }
        Ok(())
    }

    /// The host bookkeeping of a decode step for every row (R-C-9): each row's oversize dropped and the buffer cut
    /// to its capacity bound ([`RowBatch::capacity_bound`]; one gather for both), heads rotated, buffer grown.
    /// Returns each row's target column. Idempotent; changes no live byte.
    /// [`CacheError::PendingPrefill`] during a prepared prefill.
    pub fn prepare_decode_step(&mut self) -> Result<Vec<usize>> {
        self.prepare_some(None)
    }

    /// [`RowBatch::prepare_decode_step`] of the rows `active` marks (all with `None`); the others keep their state.
    pub(super) fn prepare_some(&mut self, active: Option<&[bool]>) -> Result<Vec<usize>> {
        if self.is_pending() {
            return Err(CacheError::PendingPrefill);
        }
        let on = |r: usize| active.is_none_or(|a| a[r]);
        let plans: Vec<(usize, RingState)> = self
            .rows
            .iter()
            .enumerate()
            .map(|(i, r)| if on(i) { r.ring.prepared_for_decode(self.max_size) } else { (0, r.ring.clone()) })
            .collect();
        // The oversize drop and the compaction, in one gather: each row's kept columns move to `[0, W)` and the
        // buffer keeps the capacity bound of the rows as they will be (`max(W, longest len)` for rings), not the
        // width the dropped columns needed. Mutation hook `Mutant::BatchRingKeepsOversize`: the old width is kept.
        let cap = self.cap();
        let bound = capacity_bound(plans.iter().map(|(_, s)| s.len), self.max_size);
        let width = if fault!(BatchRingKeepsOversize) { cap } else { cap.min(bound) };
        let dropped = plans.iter().any(|(d, _)| *d > 0);
        if let Some(b) = self.buf.as_ref().filter(|_| width > 0 && (dropped || width < cap)) {
            let mut idx = Vec::with_capacity(self.rows.len() * width);
            for (r, (drop, _)) in plans.iter().enumerate() {
                let old_len = self.rows[r].ring.len;
                idx.extend((0..width).map(|c| match *drop {
                    0 => c,
                    d if c + d < old_len => c + d,
                    _ => cap,
                }));
            }
            let nb = self.gather_rows(b, None, &idx, width)?;
            self.buf = Some(nb);
        }
        for (r, (_, s)) in self.rows.iter_mut().zip(plans) {
            r.ring = s;
        }
        // Only the rows that write need a column (an idle row's head may sit past the bound, at an oversize).
        let needed = self.rows.iter().enumerate().filter(|&(i, _)| on(i)).map(|(_, r)| r.ring.idx + 1).max();
        self.ensure_capacity(needed.unwrap_or(0))?;
        Ok(self.rows.iter().map(|r| r.ring.idx).collect())
    }

    /// One decode step (R-BROT-2): one position per row (`k`, `v` `[B, H_kv, 1, D]`, `q` `[B, H_q, 1, D]`), written
    /// at each row's own ring head in one scatter, then attended over `[0, max len_r)`: no mask when rows' `len`
    /// are equal, else the mask `c < len_r`. Requires no pending prefill ([`CacheError::PendingPrefill`]).
    pub fn decode(&mut self, k: &Array, v: &Array, q: &Array, scale: f32, masks: &Masks) -> Result<(Array, MaskUse)> {
        if self.is_pending() {
            return Err(CacheError::PendingPrefill);
        }
        let l = self.check_step(k, v, Some(q))?;
        if l != 1 {
            return Err(shape(format!("decode writes one position per row, {l} given")));
        }
        if self.rows.is_empty() {
            return Ok((self.empty_output(q)?, MaskUse::None));
        }
        self.write_decode(k, v)?;
        let (out, mask) = self.read_decode(q, scale, masks)?;
        // The write and the read in one evaluation: one device round trip per step, not two. The same ops run; the
        // buffers end evaluated as after [`crate::ring::Buf::eval`], so the graph stays one write deep.
        if crate::ring::eval_after_write() {
            let b = self.buf.as_ref().ok_or_else(|| invalid("no buffer after a decode write"))?;
            mlx_rs::transforms::eval(std::iter::once(&out).chain(b.planes.iter()))?;
        }
        Ok((out, mask))
    }

    /// The decode write, left lazy ([`RowBatch::decode`] evaluates it with the read).
    fn write_decode(&mut self, k: &Array, v: &Array) -> Result<()> {
        let block = self.storage.encode(k, v)?;
        let mut targets = self.prepare_decode_step()?;
        if fault!(SharedWritePointer) {
            let shared = targets[0];
            targets.iter_mut().for_each(|t| *t = shared);
        }
        let at = step_index_array(&targets, &[self.rows.len(), 1, 1, 1], self.max_size)?;
        // Take the buffer out of `self` before evaluating: the scatter's input is then referenced by the graph only,
        // so MLX donates it and writes the B new columns in place instead of copying the whole cache.
        let b = self.buf.take().ok_or_else(|| invalid("no buffer after prepare_decode_step"))?;
        let nb = match b.zip_map(&block, |p, x| Ok(p.put_along_axis(&at, x, 2)?)) {
            Ok(nb) => nb,
            Err(e) => {
                self.buf = Some(b);
                return Err(e);
            }
        };
        drop(b);
        self.buf = Some(nb);
        for r in &mut self.rows {
            r.ring.after_decode_write();
        }
        self.sync();
        Ok(())
    }

    fn read_decode(&self, q: &Array, scale: f32, masks: &Masks) -> Result<(Array, MaskUse)> {
        let lens: Vec<usize> = self.rows.iter().map(|r| r.ring.len).collect();
        let width = lens.iter().copied().max().unwrap_or(0).max(1);
        let b = self.buf.as_ref().ok_or_else(|| invalid("decode read without a buffer"))?;
        let mut live = b.map(|p| cols(p, 0, width))?.planes;
        // Mutation hook `Mutant::QuantMaskFromArrayOffset` (mlx-vlm#1206): a quantized batch's mask built from
        // the per-row array offset plus left padding (`offset_r - base_r + left_padding_r`, which is the batch width
        // for every row) instead of the buffered-token count `len_r`.
        let lens: Vec<usize> = if self.storage != Storage::Plain && fault!(QuantMaskFromArrayOffset) {
            let lp = self.left_padding();
            self.rows.iter().zip(lp).map(|(r, p)| ((r.ring.offset - r.base) as i64 + p).max(0) as usize).collect()
        } else {
            lens
        };
        let uniform = lens.iter().all(|&l| l == lens[0]);
        let scale = if fault!(DecodeScaleUlp) { f32::from_bits(scale.to_bits() + 1) } else { scale };
        if uniform && fault!(DecodeKeyOrder) {
            // Every plane (K, V and, when quantized, their scales and biases) is permuted alike.
            let at = index_array(&(0..width).rev().collect::<Vec<_>>(), &[width])?;
            live = live.iter().map(|p| Ok(p.take_axis(&at, 2)?)).collect::<Result<_>>()?;
        }
        if uniform || fault!(MaskIgnoresPadding) {
            return Ok((attend_planes(&self.storage, q, &live, scale, None, false)?, MaskUse::None));
        }
        let key = decode_mask_key(lens, self.max_size, width);
        let (spec, arr) = masks.get(&key)?;
        Ok((attend_planes(&self.storage, q, &live, scale, Some((&spec, &arr)), false)?, MaskUse::Array(spec)))
    }

    /// A committed span (R-ROT-7) for every row: `L` decodes, one per position; outputs concatenated.
    pub fn commit_span(&mut self, k: &Array, v: &Array, q: &Array, scale: f32, masks: &Masks) -> Result<Array> {
        if self.is_pending() {
            return Err(CacheError::PendingPrefill);
        }
        let l = self.check_step(k, v, Some(q))?;
        let mut outs = Vec::with_capacity(l);
        for i in 0..l {
            let (o, _) = self.decode(&cols(k, i, i + 1)?, &cols(v, i, i + 1)?, &cols(q, i, i + 1)?, scale, masks)?;
            outs.push(o);
        }
        Ok(mlx_rs::ops::concatenate(&outs, 2)?)
    }
}

/// The mask of a batched decode read whose rows hold `lens` live columns after the write, over `width` columns.
pub(crate) fn decode_mask_key(lens: Vec<usize>, window: Option<usize>, width: usize) -> MaskKey {
    MaskKey { kind: MaskKind::Decode, real: vec![1; lens.len()], lens, queries: 1, window, cols: width }
}

impl RowBatch {
    /// The buffers (for the compiled step, `compiled.rs`).
    pub(crate) fn buf_ref(&self) -> Option<&Buf> {
        self.buf.as_ref()
    }

    /// Installs the buffers a compiled step wrote, then advances every row as the ordinary decode write does.
    pub(crate) fn commit_step(&mut self, b: Buf) {
        self.buf = Some(b);
        for r in &mut self.rows {
            r.ring.after_decode_write();
        }
        self.sync();
    }
}

impl RowBatch {
    /// R-TKV-7 on rows: a committed read under known spans of unequal per-row lengths. Row `r` commits its first
    /// `lens[r]` positions of the block (`k`, `v` `[B, H_kv, L, D]`, `q` `[B, H_q, L, D]`, `L >= max lens`), one
    /// decode per position (R-ROT-7): at position `i` exactly the rows with `lens[r] > i` are written (each at its
    /// own ring head) and read; the other rows' state and bytes do not change. Each row's output at its real
    /// positions is the one its solo cache's [`crate::SerialCache::commit_span`] of those positions gives (same keys, same
    /// physical order, the decode mask `c < len_r` when rows differ); outputs at padded positions (`i >= lens[r]`)
    /// are unspecified. A wrong count or a length past `L` is [`CacheError::BadLengths`], a pending prefill
    /// [`CacheError::PendingPrefill`], nothing changed.
    pub fn commit_known_spans(
        &mut self,
        k: &Array,
        v: &Array,
        q: &Array,
        scale: f32,
        masks: &Masks,
        lens: &[usize],
    ) -> Result<Array> {
        if self.is_pending() {
            return Err(CacheError::PendingPrefill);
        }
        let l = self.check_step(k, v, Some(q))?;
        if lens.len() != self.rows.len() || lens.iter().any(|&n| n > l) {
            return Err(CacheError::BadLengths {
                what: format!("span lengths {lens:?} for {} rows of a {l}-position block", self.rows.len()),
            });
        }
        let mut next = self.clone();
        let mut outs = Vec::with_capacity(l);
        for i in 0..l {
            let active: Vec<bool> = lens.iter().map(|&n| n > i).collect();
            let (ki, vi, qi) = (cols(k, i, i + 1)?, cols(v, i, i + 1)?, cols(q, i, i + 1)?);
            let out = if active.iter().all(|&a| a) {
                next.decode(&ki, &vi, &qi, scale, masks)?.0
            } else if active.iter().any(|&a| a) {
                next.decode_some(&ki, &vi, &qi, scale, masks, &active)?
            } else {
                next.empty_output(&qi)?
            };
            outs.push(out);
        }
        *self = next;
        Ok(mlx_rs::ops::concatenate(&outs, 2)?)
    }

    /// One decode of the rows `active` marks (some but not all): their columns written at their ring heads, the
    /// others rewritten with the bytes they hold (column 0), then the batched decode read. Rows outside `active` keep
    /// their state; their outputs are unspecified.
    pub(crate) fn decode_some(
        &mut self,
        k: &Array,
        v: &Array,
        q: &Array,
        scale: f32,
        masks: &Masks,
        active: &[bool],
    ) -> Result<Array> {
        let block = self.storage.encode(k, v)?;
        let mut targets = self.prepare_some(Some(active))?;
        self.ensure_capacity(1)?;
        for (t, &a) in targets.iter_mut().zip(active) {
            if !a {
                *t = 0;
            }
        }
        let b = self.buf.take().ok_or_else(|| invalid("no buffer after prepare"))?;
        let written = (|| -> Result<Buf> {
            let on: Vec<u8> = active.iter().map(|&a| u8::from(a)).collect();
            let on = Array::from_slice(&on, &[active.len() as i32, 1, 1, 1]).as_dtype(mlx_rs::Dtype::Bool)?;
            let at = index_array(&targets, &[self.rows.len(), 1, 1, 1])?;
            let kept = b.map(|p| Ok(p.take_along_axis(&at, 2)?))?;
            let column: Vec<Array> = block
                .iter()
                .zip(&kept.planes)
                .map(|(new, old)| Ok(mlx_rs::ops::select(&on, new, old)?))
                .collect::<Result<_>>()?;
            let nb = b.zip_map(&column, |p, x| Ok(p.put_along_axis(&at, x, 2)?))?;
            nb.eval()?;
            Ok(nb)
        })();
        let nb = match written {
            Ok(nb) => nb,
            Err(e) => {
                self.buf = Some(b);
                return Err(e);
            }
        };
        self.buf = Some(nb);
        for (r, &a) in self.rows.iter_mut().zip(active) {
            if a {
                r.ring.after_decode_write();
            }
        }
        self.sync();
        Ok(self.read_decode(q, scale, masks)?.0)
    }
}
