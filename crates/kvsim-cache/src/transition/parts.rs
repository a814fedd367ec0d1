//! The rows' parts (R-TKV-5): each row's bare storage, and rows that adopt storage already laid out.

use super::*;

impl TransitioningKvRows {
    /// R-TKV-5: row `i`'s bare storage, owned by the caller (a copy of its live columns and ring state, plain or
    /// affine as the row holds now): what another row layout merges. The lifecycle (conversion, floor) stays here;
    /// [`TransitioningKvRows::extract`] is the same storage composed again by its lego.
    pub fn row_storage(&self, i: usize) -> Result<SerialCache> {
        self.check_row(i)?;
        match &self.store {
            Store::Rows(caches) => Ok(caches[i].clone()),
            Store::Packed(b) => b.extract(i),
        }
    }

    /// Row `i`'s storage as laid out: an unpacked row's serial cache, or a packed row's live columns in physical
    /// order with its ring state (phase kept). Not [`RowBatch::extract`], which de-rolls a wrapped ring into temporal
    /// order: a packed row adopted from that would come back with its columns moved.
    fn row_as_laid_out(&self, i: usize) -> Result<SerialCache> {
        self.check_row(i)?;
        match &self.store {
            Store::Rows(caches) => Ok(caches[i].clone()),
            Store::Packed(b) => SerialCache::adopt_planes(
                self.spec,
                self.max_size,
                b.storage(),
                b.row_physical_planes(i)?,
                b.row_states()[i].ring.clone(),
            ),
        }
    }

    /// The rows' parts, owned by the caller (R-TKV-5, upstream `adopt`'s input): each row's bare storage as laid out
    /// ([`TransitioningKvRows::row_storage`]: physical columns and phase), its lifecycle, and the kernel set;
    /// [`TransitioningKvRows::adopt`] of them is these rows again. Refused inside a round, a prefill cohort or a
    /// pending prefill ([`CacheError::Lifecycle`] / [`CacheError::PendingPrefill`]): their bookkeeping is not a part.
    pub fn parts(&self) -> Result<RowsParts> {
        if self.pending.is_some() {
            return Err(CacheError::PendingPrefill);
        }
        if self.round.is_some() || self.prefilling {
            return Err(out_of_order("parts inside a round or a prefill"));
        }
        let rows = (0..self.rows()).map(|i| self.row_as_laid_out(i)).collect::<Result<Vec<_>>>()?;
        Ok(RowsParts { rows, lifecycle: self.meta.clone(), kernels: self.kernels })
    }

    /// Rows that take storage already laid out (upstream `adopt`): row `r` is `parts.rows[r]` as it is (no column
    /// moves, no temporal rewrite), with `parts.lifecycle[r]`, attending with `parts.kernels`; the rows pack if every
    /// row has converted. Each row must be a state its lego's lifecycle reaches (as [`Bf16FirstCache::restore`]
    /// requires: converted at `c` only if due at `c`, in the transition's affine format, with the floor that
    /// conversion leaves; unconverted only in plain storage, not past a due transition, floor 0), else
    /// [`CacheError::InvalidState`]; rows of another window, spec or format, or a kernel set of another format, are
    /// [`CacheError::WindowMismatch`] / [`CacheError::StorageMismatch`]; counts that differ are
    /// [`CacheError::BadLengths`]. Nothing is built on an error.
    pub fn adopt(spec: KvSpec, max_size: Option<usize>, transition: Transition, parts: RowsParts) -> Result<Self> {
        Storage::Affine(transition.quant).validate(&spec)?;
        let RowsParts { rows, lifecycle, kernels } = parts;
        if rows.len() != lifecycle.len() {
            return Err(CacheError::BadLengths {
                what: format!("{} rows with {} lifecycles", rows.len(), lifecycle.len()),
            });
        }
        let mismatch = || CacheError::StorageMismatch {
            expected: transition.rows_kind(max_size).0,
            found: format!("a part of another spec or format ({})", kernels.name()),
        };
        if kernels.quant != transition.quant {
            return Err(mismatch());
        }
        for (i, (c, m)) in rows.iter().zip(&lifecycle).enumerate() {
            if c.max_size() != max_size {
                return Err(CacheError::WindowMismatch { expected: max_size, found: c.max_size() });
            }
            if c.spec() != spec {
                return Err(mismatch());
            }
            Bf16FirstCache::restore(c.clone(), transition, m.converted_at, m.floor)
                .map_err(|e| CacheError::InvalidState { what: format!("row {i}: {e}") })?;
        }
        let mut lifecycle = lifecycle;
        if fault!(TkvAdoptDropsBoundary) {
            // Mutation hook `Mutant::TkvAdoptDropsBoundary`: each conversion recorded at the row's current offset.
            for (m, c) in lifecycle.iter_mut().zip(&rows) {
                if m.converted_at.is_some() {
                    m.converted_at = Some(c.offset());
                }
            }
        }
        let mut out = TransitioningKvRows {
            spec,
            max_size,
            transition,
            kernels,
            store: Store::Rows(rows),
            meta: lifecycle,
            prefilling: false,
            round: None,
            pending: None,
        };
        out.maybe_pack()?;
        Ok(out)
    }
}
