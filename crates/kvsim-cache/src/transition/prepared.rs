//! The rows' right-padded prefill: `prepare`, the prepared windows, `finalize`.

use mlx_rs::Array;

use super::*;

impl TransitioningKvRows {
    /// A window while a right-padded prefill is pending: row `r` stores only its next `min(pending_r, L)` real
    /// positions (each unpacked row a window of exactly those on its serial cache, so its state is its lego's fed
    /// the real positions); outputs at padded query positions are unspecified (zeros for unpacked rows). Nothing
    /// converts until the row's request commits ([`TransitioningKvRows::commit_prefill`] or `finalize`).
    pub(super) fn prepared_window(
        &mut self,
        k: &Array,
        v: &Array,
        q: &Array,
        scale: f32,
        masks: &Masks,
    ) -> Result<(Array, Vec<usize>)> {
        let n = self.rows();
        let l = check_kv(&self.spec, k, v, n, 1)?;
        let hq = check_q(&self.spec, q, n, l)?;
        let pending = self.pending.clone().unwrap_or_default();
        let real: Vec<usize> = pending.iter().map(|&p| p.min(l)).collect();
        let mut next = self.clone();
        let out = match &mut next.store {
            Store::Packed(b) => b.window(k, v, q, scale, masks)?.0,
            Store::Rows(caches) => {
                let row_masks = layout_window_masks(caches, l, &real, masks)?;
                let mut outs = Vec::with_capacity(n);
                for ((i, c), mask) in caches.iter_mut().enumerate().zip(row_masks) {
                    let r = real[i];
                    let mut parts = Vec::with_capacity(2);
                    if r > 0 {
                        let (ki, vi, qi) = (row_slice(k, i, i + 1)?, row_slice(v, i, i + 1)?, row_slice(q, i, i + 1)?);
                        let (kr, vr, qr) = (cols(&ki, 0, r)?, cols(&vi, 0, r)?, cols(&qi, 0, r)?);
                        parts.push(c.window_with_mask(&kr, &vr, &qr, scale, mask)?.0);
                    }
                    if r < l {
                        parts.push(zeros(&[1, hq, l - r, self.spec.head_dim], self.spec.dtype.to_mlx())?);
                    }
                    outs.push(mlx_rs::ops::concatenate(&parts, 2)?);
                }
                mlx_rs::ops::concatenate(&outs, 0)?
            }
        };
        next.pending = Some(pending.iter().zip(&real).map(|(&p, &r)| p - r).collect());
        *self = next;
        Ok((out, Vec::new()))
    }

    /// A right-padded prefill (as the quantized rows' `prepare`, R-BROT-2): row `r` has `lengths[r]` more real
    /// positions (0: none), delivered by the next windows, each of width `L` consuming `min(remaining_r, L)`. A
    /// prefill cohort starts: no row converts until its request's chunk commits
    /// ([`TransitioningKvRows::commit_prefill`]) or [`TransitioningKvRows::finalize`] (a sibling's longer prompt
    /// never moves a row's boundary). While pending a decode is [`CacheError::PendingPrefill`]; a second prepare
    /// too; a prepare inside a round or a cohort is [`CacheError::Lifecycle`]; lengths of another count are
    /// [`CacheError::BadLengths`]. Errors change nothing.
    pub fn prepare(&mut self, lengths: &[usize]) -> Result<()> {
        if self.pending.is_some() {
            return Err(CacheError::PendingPrefill);
        }
        if self.round.is_some() || self.prefilling {
            return Err(out_of_order("prepare inside a round or a prefill"));
        }
        if lengths.len() != self.rows() {
            return Err(CacheError::BadLengths { what: format!("{} lengths for {} rows", lengths.len(), self.rows()) });
        }
        let mut next = self.clone();
        if let Store::Packed(b) = &mut next.store {
            b.prepare(lengths)?;
        }
        next.pending = Some(lengths.to_vec());
        next.prefilling = true;
        *self = next;
        Ok(())
    }

    /// Ends the right-padded prefill: positions not yet delivered are forgotten, every row's request commits its
    /// boundary (the rows whose transition is due convert, then pack if all have). Returns the rows converted.
    /// Without a pending prefill: [`CacheError::NoPendingPrefill`], nothing changed.
    pub fn finalize(&mut self) -> Result<Vec<usize>> {
        if self.pending.is_none() {
            return Err(CacheError::NoPendingPrefill);
        }
        let mut next = self.clone();
        if let Store::Packed(b) = &mut next.store {
            b.finalize()?;
        }
        next.pending = None;
        next.prefilling = false;
        let converted = next.settle_all()?;
        *self = next;
        Ok(converted)
    }

    /// Each row's positions still to arrive in a pending right-padded prefill (`None`: none pending).
    pub fn pending(&self) -> Option<&[usize]> {
        self.pending.as_deref()
    }
}
