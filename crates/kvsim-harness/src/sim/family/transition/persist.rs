//! The bf16-first family's save/restore of a request outside the batch: its legos through kvsim's format and back
//! (mlx-lm's form must be refused).

use super::{Res, TransitionFamily};
use crate::sim::check::Failure;
use crate::sim::roster::Roster;
use kvsim_cache::transition::Bf16FirstCache;

impl TransitionFamily {
    /// `Persist { req, mlxlm }`: a request outside the batch through a save and a restore (`persist_legos`).
    pub(super) fn persist(&mut self, roster: &Roster, req: u32, mlxlm: bool) -> Res<bool> {
        if !roster.is_solo(req) {
            return Ok(false);
        }
        let r = self.reqs.get_mut(&req).unwrap();
        let legos = std::mem::take(&mut r.solo);
        r.solo = persist_legos(legos, mlxlm, &mut self.counters)?;
        self.counters.persist_roundtrips += 1;
        Ok(true)
    }
}

/// Saves a request's legos (one per layer) in kvsim's format, each with a reuse floor attached (half its offset),
/// drops them, and restores them from the bytes alone (`family::persist_through_bytes`: floors and kinds must come
/// back). With `via_mlxlm`, mlx-lm's form of every lego must first be refused as unsupported (and nothing is written
/// in that format).
fn persist_legos(
    legos: Vec<Bf16FirstCache>,
    via_mlxlm: bool,
    counters: &mut crate::sim::summary::Counters,
) -> Res<Vec<Bf16FirstCache>> {
    use kvsim_persist::inspect::Format;
    use kvsim_persist::{mlxlm, AnyCache, PersistError, Persisted};
    let persisted: Vec<Persisted> = legos
        .into_iter()
        .map(|c| Persisted { minimum_reusable_offset: c.offset() / 2, cache: AnyCache::Bf16First(c) })
        .collect();
    if via_mlxlm {
        for p in &persisted {
            match mlxlm::from_kvsim(&p.cache) {
                Err(PersistError::Unsupported { .. }) => {}
                other => {
                    return Err(Failure::new(
                        "persist",
                        format!("mlx-lm form of {}: {:?}, expected Unsupported", p.cache.storage_kind(), other.err()),
                    ))
                }
            }
        }
    }
    crate::sim::family::persist_through_bytes(persisted, Format::Kvsim, counters)?
        .into_iter()
        .map(|c| match c {
            AnyCache::Bf16First(c) => Ok(c),
            other => Err(Failure::new("persist", format!("restored as {}", other.storage_kind()))),
        })
        .collect()
}
