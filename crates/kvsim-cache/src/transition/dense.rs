//! The rows' dense reads: the plain read's guard, the dense fetch, the softcapped read's fetch (R-TKV-4) and its aligned form.

use mlx_rs::Array;

use super::*;

impl TransitioningKvRows {
    /// The plain read's guard (`update_and_fetch`, one dense K/V for the batch): refused while any row is affine
    /// or the rows are packed, with nothing changed.
    pub fn check_plain_read(&self) -> Result<()> {
        match self.meta.iter().position(|m| m.converted_at.is_some()) {
            Some(row) => Err(CacheError::MixedPrecision { row }),
            None => Ok(()),
        }
    }

    /// The dense fetch: each row's live columns in physical order as its storage fetches them dense (a converted
    /// row dequantized), one `(k, v)` per row (the caller owns them).
    pub fn dense_fetch(&self) -> Result<Vec<(Array, Array)>> {
        match &self.store {
            Store::Rows(caches) => caches.iter().map(|c| c.storage().dense(&c.physical_planes()?)).collect(),
            Store::Packed(b) => (0..b.rows()).map(|i| b.storage().dense(&b.row_physical_planes(i)?)).collect(),
        }
    }

    /// The softcapped read's fetch (R-TKV-4): the transition first (nothing is left due outside a prefill or a
    /// round: rows settle after every call), then every row appends its `L >= 1` positions (each unpacked row's ring
    /// by its window write, or the packed batch's), then the rows answer as
    /// [`TransitioningKvRows::dense_fetch_aligned`] (each row as its storage fetches it dense, converted rows
    /// dequantized, joined along the batch behind their left padding; the caller owns both); then, outside a
    /// prefill and a round, the rows whose transition is due convert, as after a read. Row `r`'s part is exactly
    /// its lego's [`Bf16FirstCache::fetch`]. Returns `(k, v)` and the rows converted. While a right-padded prefill
    /// is pending: [`CacheError::PendingPrefill`]; bad shapes: typed errors; errors change nothing.
    pub fn fetch(&mut self, k: &Array, v: &Array) -> Result<((Array, Array), Vec<usize>)> {
        if self.pending.is_some() {
            return Err(CacheError::PendingPrefill);
        }
        let n = self.rows();
        check_kv(&self.spec, k, v, n, 1)?;
        let mut next = self.clone();
        match &mut next.store {
            Store::Packed(b) => b.append(k, v)?,
            Store::Rows(caches) => {
                for (i, c) in caches.iter_mut().enumerate() {
                    c.append(&row_slice(k, i, i + 1)?, &row_slice(v, i, i + 1)?)?;
                }
            }
        }
        let kv = next.dense_fetch_aligned()?;
        // Mutation hook `Mutant::TkvFetchConvertsFirstDue`: only the first row come due converts.
        let converted = if fault!(TkvFetchConvertsFirstDue) && !next.prefilling && next.round.is_none() {
            let offsets = next.offsets();
            let first: Vec<usize> = (0..n)
                .filter(|&i| next.meta[i].converted_at.is_none() && next.transition.due(offsets[i]))
                .take(1)
                .collect();
            next.settle(&first)?
        } else {
            next.settle_all()?
        };
        *self = next;
        Ok((kv, converted))
    }

    /// The plain read (`update_and_fetch`): [`TransitioningKvRows::check_plain_read`] (refused while any row is
    /// affine, nothing changed), then [`TransitioningKvRows::fetch`].
    pub fn update_and_fetch(&mut self, k: &Array, v: &Array) -> Result<((Array, Array), Vec<usize>)> {
        self.check_plain_read()?;
        self.fetch(k, v)
    }

    /// R-TKV-4's aligned form: the rows joined along the batch in one geometry, `[B, H_kv, width, D]` each for K
    /// and V, the caller owning both. Row `r` holds `left_pad_r` zero columns, then its live columns in physical order
    /// as its storage fetches them dense (a converted row dequantized: exactly [`TransitioningKvRows::dense_fetch`]'s
    /// row), then zero columns up to `width = max_r (left_pad_r + len_r)`. A lone row has no padding: its physical
    /// columns and phase as they are. No rows is `[0, H_kv, 0, D]`.
    pub fn dense_fetch_aligned(&self) -> Result<(Array, Array)> {
        let rows = self.dense_fetch()?;
        let lens: Vec<usize> = rows.iter().map(|(k, _)| k.shape()[2].max(0) as usize).collect();
        let width = self.meta.iter().zip(&lens).map(|(m, &l)| m.left_pad + l).max().unwrap_or(0);
        let (h, d, dt) = (self.spec.heads_kv, self.spec.head_dim, self.spec.dtype.to_mlx());
        if rows.is_empty() {
            let z = zeros(&[0, h, 0, d], dt)?;
            return Ok((z.clone(), z));
        }
        let pad = |n: usize| zeros(&[1, h, n, d], dt);
        let mut ks = Vec::with_capacity(rows.len());
        let mut vs = Vec::with_capacity(rows.len());
        for ((k, v), (m, &l)) in rows.iter().zip(self.meta.iter().zip(&lens)) {
            let (front, back) = (pad(m.left_pad)?, pad(width - m.left_pad - l)?);
            ks.push(mlx_rs::ops::concatenate(&[&front, k, &back], 2)?);
            vs.push(mlx_rs::ops::concatenate(&[&front, v, &back], 2)?);
        }
        Ok((mlx_rs::ops::concatenate(&ks, 0)?, mlx_rs::ops::concatenate(&vs, 0)?))
    }
}
