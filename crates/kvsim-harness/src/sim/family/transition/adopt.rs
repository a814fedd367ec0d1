//! `Op::Adopt` on the bf16-first rows: every layer's running rows rebuilt from their own parts
//! (`TransitioningKvRows::parts`: each row's bare storage as laid out, its lifecycle and the kernel set) through
//! `TransitioningKvRows::adopt`, upstream's `adopt` of rows laid out elsewhere.
//!
//! The adopted rows replace the running ones, and the run goes on from them: `check_all` after the op compares each
//! row's lifecycle (conversion offset, floor, left padding, offset), packing, storage kind, floor and planes with
//! the model and the lego twins, and every later read, conversion and rollback of the adopted rows is checked as
//! before. With `invalid`, row 0's lifecycle is made one its lego's lifecycle cannot reach (a conversion with
//! another floor, or a conversion of plain storage) first: the typed error `InvalidState`, and the running rows
//! stay as they were (nothing is built).

use super::*;

impl TransitionFamily {
    /// See the module docs. Skipped without a running batch (the lego family has none: it never draws `adopt`).
    /// A batch whose rows laid out no storage since it was last empty is its own adoption: applied, nothing built.
    pub(super) fn adopt_rows(&mut self, cx: &mut Cx<'_>, invalid: bool) -> Res<bool> {
        if cx.roster.rows().is_empty() || self.legos {
            return Ok(false);
        }
        // The families of a run agree on what they skip, and only the running batch decides it: the rows' own ops
        // (fetch, prefix reuse, plain read) lay out columns that the attention families, which let them pass, never
        // hold, so "has storage" differs between them.
        if !self.rows_stored {
            return Ok(true);
        }
        let (spec, max, t) = (self.spec, self.max_size(), self.t);
        for layer in 0..self.cfg.layers {
            let b = self.batch_rows(layer)?;
            let kernels = b.kernel_set();
            let mut parts = b.parts().map_err(|e| unexpected("parts", e))?;
            if invalid {
                let m = &mut parts.lifecycle[0];
                match m.converted_at {
                    // Every conversion leaves exactly `floor_at(c)`: one more is a floor no lifecycle reaches.
                    Some(_) => m.floor += 1,
                    // A conversion of storage that is still plain (or before the transition was due).
                    None => m.converted_at = Some(parts.rows[0].offset().max(1)),
                }
            }
            match (invalid, TransitioningKvRows::adopt(spec, max, t, parts)) {
                (false, Ok(adopted)) => {
                    check::flag("the adopted rows' kernel set is their parts'", adopted.kernel_set() == kernels, true)?;
                    *self.batch_mut(layer)? = adopted;
                }
                (false, Err(e)) => return Err(unexpected("adopt of the rows' own parts", e)),
                (true, Err(CacheError::InvalidState { .. })) => self.counters.record_rejected("adopt_state"),
                (true, other) => {
                    return Err(Failure::new(
                        "errors",
                        format!(
                        "layer {layer}: adopt of a row with an impossible lifecycle: expected InvalidState, got {:?}",
                        other.map(|_| ())
                    ),
                    ))
                }
            }
        }
        if !invalid {
            self.reached.push("adopt/bf16_first");
        }
        Ok(true)
    }
}
