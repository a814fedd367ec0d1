//! The running batch of a [`PagedStore`]: rows joining, reordered, extracted and filtered, their decodes, windows
//! and appends, the right-padded prefill, per-row trims and the speculative round.

use mlx_rs::Array;

use super::{check_rows, check_tokens, check_trim, flat_rows, PagedStore, SeqId};
use crate::error::{invalid, shape};
use crate::mask::{MaskKey, MaskKind, MaskUse, Masks};
use crate::quant::{attend_planes, Storage};
use crate::util::{check_kv, check_q, cols, index_array, zeros};
use crate::{CacheError, Result};

impl PagedStore {
    /// Sequences outside the batch join it at its end, in this order (nothing moves: rows are block tables).
    pub fn join(&mut self, seqs: &[SeqId]) -> Result<()> {
        self.no_round()?;
        self.no_pending()?;
        for (i, s) in seqs.iter().enumerate() {
            self.seq(*s)?;
            self.not_a_row(*s)?;
            if seqs[..i].contains(s) {
                return Err(CacheError::DuplicateRow { row: self.rows.len() + i });
            }
        }
        self.rows.extend_from_slice(seqs);
        Ok(())
    }

    /// Reorders the running batch's rows: `order` lists every row index once.
    pub fn reorder(&mut self, order: &[usize]) -> Result<()> {
        self.no_round()?;
        self.no_pending()?;
        check_rows(order, self.rows.len())?;
        if order.len() != self.rows.len() {
            return Err(CacheError::BadLengths { what: format!("{} rows, order of {}", self.rows.len(), order.len()) });
        }
        self.rows = order.iter().map(|&r| self.rows[r]).collect();
        Ok(())
    }

    /// Row `row` leaves the batch and goes on as a sequence outside it.
    pub fn extract(&mut self, row: usize) -> Result<SeqId> {
        self.no_round()?;
        self.no_pending()?;
        if row >= self.rows.len() {
            return Err(CacheError::NoSuchRow { row, rows: self.rows.len() });
        }
        Ok(self.rows.remove(row))
    }

    /// Keeps only these rows, in this order; returns the sequences of the others (still live, outside the batch).
    pub fn filter(&mut self, keep: &[usize]) -> Result<Vec<SeqId>> {
        self.no_round()?;
        self.no_pending()?;
        check_rows(keep, self.rows.len())?;
        let out: Vec<SeqId> = (0..self.rows.len()).filter(|r| !keep.contains(r)).map(|r| self.rows[r]).collect();
        self.rows = keep.iter().map(|&r| self.rows[r]).collect();
        Ok(out)
    }

    /// One decode step for every row (`k`, `v` `[B, H_kv, 1, D]`, `q` `[B, H_q, 1, D]`, one token per row), then
    /// the rows are attended: plain rows over `[0, max len_r)`, no mask when every row has the same length, else
    /// `c < len_r`; affine rows one by one over their own positions. [`CacheError::PendingPrefill`] during a
    /// prepared prefill.
    pub fn rows_decode(
        &mut self,
        tokens: &[u32],
        k: &Array,
        v: &Array,
        q: &Array,
        scale: f32,
        masks: &Masks,
    ) -> Result<(Array, MaskUse)> {
        self.no_pending()?;
        let b = self.rows.len();
        let l = check_kv(&self.spec, k, v, b, 1)?;
        if l != 1 {
            return Err(shape(format!("decode writes one position per row, {l} given")));
        }
        check_q(&self.spec, q, b, 1)?;
        check_tokens(tokens.len(), b)?;
        if b == 0 {
            return Err(invalid("decode on a batch with no rows"));
        }
        let writes: Vec<(SeqId, usize)> = self.rows.iter().map(|&s| (s, 1)).collect();
        let plan = self.plan(&writes)?;
        let per: Vec<&[u32]> = tokens.chunks(1).collect();
        let (fk, fv) = (flat_rows(k)?, flat_rows(v)?);
        self.write(&plan, &per, &fk, &fv)?;
        for s in self.rows.clone() {
            self.seqs.get_mut(&s).expect("row").last_window = None;
        }
        if self.storage != Storage::Plain {
            return Ok((self.rows_one_by_one(q, &vec![1; b], false, scale)?, MaskUse::None));
        }
        let rows = self.rows.clone();
        let (planes, lens) = self.gather(&rows)?;
        if lens.iter().all(|&n| n == lens[0]) {
            return Ok((attend_planes(&self.storage, q, &planes, scale, None, false)?, MaskUse::None));
        }
        let width = lens.iter().copied().max().unwrap_or(1);
        let key = crate::batch::decode_mask_key(lens, None, width);
        let (spec, arr) = masks.get(&key)?;
        Ok((attend_planes(&self.storage, q, &planes, scale, Some((&spec, &arr)), false)?, MaskUse::Array(spec)))
    }

    /// A window read of `L` positions for every row (`tokens[r]` the row's `L` ids), then every row attended
    /// causally. Plain rows: `Causal` when every row has the same length and took all `L`, else the per-row causal
    /// mask of a [`crate::RowBatch`]. Affine rows: one by one, each row's real queries over its own positions. During
    /// a prepared prefill row `r` takes only its first `min(pending_r, L)` positions; outputs at the other query
    /// positions are unspecified (zeros for affine rows).
    pub fn rows_window(
        &mut self,
        tokens: &[Vec<u32>],
        k: &Array,
        v: &Array,
        q: &Array,
        scale: f32,
        masks: &Masks,
    ) -> Result<(Array, MaskUse)> {
        let b = self.rows.len();
        let l = check_kv(&self.spec, k, v, b, 1)?;
        check_q(&self.spec, q, b, l)?;
        let real = self.rows_append(tokens, k, v)?;
        if self.storage != Storage::Plain {
            return Ok((self.rows_one_by_one(q, &real, true, scale)?, MaskUse::Causal));
        }
        let rows = self.rows.clone();
        let (planes, lens) = self.gather(&rows)?;
        // Mutation hook `Mutant::PagedPrefillCausalByLength`: rows of one length read under `Causal` whatever each
        // took of the chunk.
        let took_all = real.iter().all(|&n| n == l) || crate::fault!(PagedPrefillCausalByLength);
        if took_all && lens.iter().all(|&n| n == lens[0]) {
            return Ok((attend_planes(&self.storage, q, &planes, scale, None, true)?, MaskUse::Causal));
        }
        let width = lens.iter().copied().max().unwrap_or(1);
        let key = MaskKey { kind: MaskKind::Window, lens, real, queries: l, window: None, cols: width };
        let (spec, arr) = masks.get(&key)?;
        Ok((attend_planes(&self.storage, q, &planes, scale, Some((&spec, &arr)), false)?, MaskUse::Array(spec)))
    }

    /// Row by row: row `r`'s first `real[r]` queries (`q` `[B, H_q, L, D]`) over exactly its own positions (causal
    /// for a window, no mask for a decode), the serial cache's own read; queries past `real[r]` give zeros.
    pub(super) fn rows_one_by_one(&self, q: &Array, real: &[usize], causal: bool, scale: f32) -> Result<Array> {
        let qs: Vec<usize> = q.shape().iter().map(|&x| x.max(0) as usize).collect();
        let (hq, l, d) = (qs[1], qs[2], qs[3]);
        let mut outs = vec![];
        for (r, (&s, &n)) in self.rows.iter().zip(real).enumerate() {
            let qr = q.take_axis(&index_array(&[r], &[1])?, 0)?;
            let mut out = if n == 0 {
                zeros(&[1, hq, l, d], q.dtype())?
            } else {
                let qr = if n < l { cols(&qr, 0, n)? } else { qr };
                attend_planes(&self.storage, &qr, &self.fetch_planes(s)?, scale, None, causal)?
            };
            if n > 0 && n < l {
                out = mlx_rs::ops::concatenate(&[&out, &zeros(&[1, hq, l - n, d], q.dtype())?], 2)?;
            }
            outs.push(out);
        }
        if outs.len() == 1 {
            return Ok(outs.pop().expect("one"));
        }
        Ok(mlx_rs::ops::concatenate(&outs.iter().collect::<Vec<_>>(), 0)?)
    }

    /// Appends `L` positions to every row without attending (during a prepared prefill, row `r` takes its first
    /// `min(pending_r, L)`; a row that takes none is untouched). Returns the positions each row took.
    pub fn rows_append(&mut self, tokens: &[Vec<u32>], k: &Array, v: &Array) -> Result<Vec<usize>> {
        let b = self.rows.len();
        let l = check_kv(&self.spec, k, v, b, 1)?;
        check_tokens(tokens.len(), b)?;
        for t in tokens {
            check_tokens(t.len(), l)?;
        }
        if b == 0 {
            return Err(invalid("a write on a batch with no rows"));
        }
        let real: Vec<usize> = match &self.pending {
            Some(p) => p.iter().map(|&n| n.min(l)).collect(),
            None => vec![l; b],
        };
        let writes: Vec<(SeqId, usize)> = self.rows.iter().zip(&real).map(|(&s, &n)| (s, n)).collect();
        let plan = self.plan(&writes)?;
        let per: Vec<&[u32]> = tokens.iter().zip(&real).map(|(t, &n)| &t[..n]).collect();
        let (fk, fv) = if real.iter().all(|&n| n == l) {
            (flat_rows(k)?, flat_rows(v)?)
        } else {
            // Each row's real positions only, in plan order.
            let at: Vec<usize> = real.iter().enumerate().flat_map(|(r, &n)| (0..n).map(move |i| r * l + i)).collect();
            let at = index_array(&at, &[at.len()])?;
            (flat_rows(k)?.take_axis(&at, 2)?, flat_rows(v)?.take_axis(&at, 2)?)
        };
        self.write(&plan, &per, &fk, &fv)?;
        for (s, &n) in self.rows.clone().iter().zip(&real) {
            if n > 0 {
                self.seqs.get_mut(s).expect("row").last_window = Some(n);
            }
        }
        if let Some(p) = self.pending.as_mut() {
            for (left, &n) in p.iter_mut().zip(&real) {
                *left -= n;
            }
        }
        Ok(real)
    }

    /// A right-padded prefill of the running batch: row `r` takes `lengths[r]` more real positions, delivered by
    /// the next window chunks ([`PagedStore::rows_window`], [`PagedStore::rows_append`]). Errors, nothing changed:
    /// [`CacheError::PendingPrefill`] (one is pending), [`CacheError::SpecRoundActive`], [`CacheError::BadLengths`]
    /// (one length per row).
    pub fn rows_prepare(&mut self, lengths: &[usize]) -> Result<()> {
        self.no_pending()?;
        self.no_round()?;
        if lengths.len() != self.rows.len() {
            return Err(CacheError::BadLengths {
                what: format!("{} lengths for {} rows", lengths.len(), self.rows.len()),
            });
        }
        self.pending = Some(lengths.to_vec());
        Ok(())
    }

    /// Ends a prepared prefill; positions not yet delivered are forgotten (no pool block was taken for them).
    /// [`CacheError::NoPendingPrefill`] if none is pending.
    pub fn rows_finalize(&mut self) -> Result<()> {
        self.pending.take().map(|_| ()).ok_or(CacheError::NoPendingPrefill)
    }

    /// Whether a prepared prefill is pending.
    pub fn is_pending(&self) -> bool {
        self.pending.is_some()
    }

    pub(super) fn no_pending(&self) -> Result<()> {
        match self.pending {
            Some(_) => Err(CacheError::PendingPrefill),
            None => Ok(()),
        }
    }

    /// Per-row trims (`n[r]` positions from row `r`; speculative rollback with per-row accepts when `bypass`):
    /// every row is checked first, nothing changes on an error.
    pub fn rows_trim(&mut self, n: &[usize], bypass: bool) -> Result<()> {
        self.no_round()?;
        self.no_pending()?;
        if n.len() != self.rows.len() {
            return Err(CacheError::BadLengths { what: format!("{} trims for {} rows", n.len(), self.rows.len()) });
        }
        for (s, &k) in self.rows.iter().zip(n) {
            check_trim(&self.seqs[s], k, bypass)?;
        }
        for (s, &k) in self.rows.clone().iter().zip(n) {
            self.trim_unchecked(*s, k, bypass);
        }
        Ok(())
    }

    // ----- speculative rounds (R-C-6) ---------------------------------------------------------------------------

    /// Whether a speculative round is armed.
    pub fn in_round(&self) -> bool {
        self.round.is_some()
    }

    /// Arms a speculative round over the running batch before its verify window: each row's offset is recorded.
    /// While it is armed, the rows' writes and reads go on as usual, and `join`, `reorder`, `extract`, `filter`,
    /// `rows_trim` and `to_parts` are refused ([`CacheError::SpecRoundActive`], nothing changed); so is a second
    /// `round_begin`.
    pub fn round_begin(&mut self) -> Result<()> {
        self.no_round()?;
        self.no_pending()?;
        self.round = Some(self.rows.iter().map(|s| self.seqs[s].offset).collect());
        Ok(())
    }

    /// Ends the round keeping every position it wrote. [`CacheError::NoSpecRound`] without one.
    pub fn round_commit(&mut self) -> Result<()> {
        self.round.take().map(|_| ()).ok_or(CacheError::NoSpecRound)
    }

    /// Ends the round keeping the first `keep[r]` of the positions it wrote into row `r`: the rest go as a
    /// rollback trim does (`trim(n, bypass = true)`), their tail blocks back to the pool. Errors, nothing changed:
    /// [`CacheError::NoSpecRound`], [`CacheError::BadLengths`] (one count per row),
    /// [`CacheError::KeepOutsideWindow`] (more than the round wrote).
    pub fn round_rollback(&mut self, keep: &[usize]) -> Result<()> {
        let at = self.round.as_ref().ok_or(CacheError::NoSpecRound)?;
        if keep.len() != self.rows.len() {
            return Err(CacheError::BadLengths { what: format!("{} keeps for {} rows", keep.len(), self.rows.len()) });
        }
        let wrote: Vec<usize> = self.rows.iter().zip(at).map(|(s, &o)| self.seqs[s].offset - o).collect();
        if let Some((&k, &w)) = keep.iter().zip(&wrote).find(|(&k, &w)| k > w) {
            return Err(CacheError::KeepOutsideWindow { keep: k, window: w });
        }
        for (s, (&w, &k)) in self.rows.clone().iter().zip(wrote.iter().zip(keep)) {
            self.trim_unchecked(*s, w - k, true);
        }
        self.round = None;
        Ok(())
    }

    pub(super) fn no_round(&self) -> Result<()> {
        match self.round {
            Some(_) => Err(CacheError::SpecRoundActive),
            None => Ok(()),
        }
    }
}
