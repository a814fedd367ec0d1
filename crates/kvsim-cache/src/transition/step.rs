//! The rows' compiled decode step (R-C-9 / R-TKV-6): the host plan, the closure slots, the apply.

use mlx_rs::Array;

use super::*;

impl TransitioningKvRows {
    /// R-C-9: the host bookkeeping of the coming one-position step on every row (growth, oversize drop,
    /// rotation), without the write. Returns each row's target column. [`CacheError::PendingPrefill`] while a
    /// prepared prefill is pending; nothing changed on error.
    pub fn prepare_decode_step(&mut self) -> Result<Vec<usize>> {
        if self.pending.is_some() {
            return Err(CacheError::PendingPrefill);
        }
        let mut next = self.store.clone();
        let targets = match &mut next {
            Store::Rows(caches) => {
                caches.iter_mut().map(|c| Ok(c.prepare_decode_step()?.write_pos)).collect::<Result<Vec<_>>>()?
            }
            Store::Packed(b) => b.prepare_decode_step()?,
        };
        self.store = next;
        Ok(targets)
    }

    /// R-C-9 / R-TKV-6: the host side of the coming compiled step of every row, without the write (each unpacked
    /// row's own serial plan, or the packed batch's). [`CacheError::PendingPrefill`] while a prepared prefill is
    /// pending; nothing changed on error. Idempotent.
    pub fn prepare_step(&mut self) -> Result<RowsStep> {
        if self.pending.is_some() {
            return Err(CacheError::PendingPrefill);
        }
        let mut next = self.store.clone();
        let plan = match &mut next {
            Store::Rows(caches) => {
                RowsStep::Rows(caches.iter_mut().map(SerialCache::prepare_decode_step).collect::<Result<Vec<_>>>()?)
            }
            Store::Packed(b) => RowsStep::Packed(b.prepare_rows_step()?),
        };
        self.store = next;
        Ok(plan)
    }

    /// The closure slots of `plan` (see [`StepSlot`]); the packed slot's mask comes from the forward's `masks`.
    /// A plan of the other store (the rows packed since) is [`CacheError::StepMismatch`].
    pub fn step_slots(&self, plan: &RowsStep, masks: &Masks) -> Result<Vec<StepSlot>> {
        use crate::compiled::CompiledDecode;
        match (&self.store, plan) {
            (Store::Rows(caches), RowsStep::Rows(plans)) if plans.len() == caches.len() => caches
                .iter()
                .zip(plans)
                .map(|(c, p)| {
                    Ok(StepSlot {
                        storage: c.storage(),
                        fetch: Some(p.fetch),
                        mask: MaskUse::None,
                        inputs: c.step_inputs(p)?,
                        rope: c.rope_input()?,
                    })
                })
                .collect(),
            (Store::Packed(b), RowsStep::Packed(p)) => {
                let (inputs, mask) = b.rows_step_inputs(p, masks)?;
                Ok(vec![StepSlot { storage: b.storage(), fetch: None, mask, inputs, rope: b.rows_rope_input() }])
            }
            _ => Err(CacheError::StepMismatch { what: "a plan of the other store (the rows packed since)".into() }),
        }
    }

    /// Applies every slot's outputs (ownership taken, in slot order), then, outside a prefill and a round, the rows
    /// whose transition came due convert (and pack once all have), as after the ordinary decode. Returns the arrays to
    /// evaluate with the step and the rows converted. Outputs that do not fit, or a stale plan, are
    /// [`CacheError::StepMismatch`] with the rows unchanged.
    pub fn apply_step(&mut self, plan: &RowsStep, outputs: Vec<Vec<Array>>) -> Result<(Vec<Array>, Vec<usize>)> {
        use crate::compiled::CompiledDecode;
        let mut next = self.clone();
        let mut roots = Vec::new();
        match (&mut next.store, plan) {
            (Store::Rows(caches), RowsStep::Rows(plans))
                if plans.len() == caches.len() && outputs.len() == plans.len() =>
            {
                for ((c, p), o) in caches.iter_mut().zip(plans).zip(outputs) {
                    roots.extend(c.apply_decode_step(p, o)?);
                }
            }
            (Store::Packed(b), RowsStep::Packed(p)) if outputs.len() == 1 => {
                let o = outputs.into_iter().next().unwrap_or_default();
                roots.extend(b.apply_rows_step(p, o)?);
            }
            _ => return Err(CacheError::StepMismatch { what: "outputs or plan of another store or row count".into() }),
        }
        let converted = next.settle_all()?;
        *self = next;
        Ok((roots, converted))
    }
}
