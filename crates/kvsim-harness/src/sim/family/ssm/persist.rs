//! The recurrent family's save/restore mid-run: a request's caches (kvsim's format or an mlx-lm prompt-cache file)
//! and the running batch, through bytes and back.

use super::{Cache, Recurrent, Res, Rows};
use crate::sim::check::Failure;

impl Recurrent {
    /// The running batch (every layer, one file: DeltaNet layers as `ssm`, attention layers as row batches) through
    /// kvsim's format and back, mid-run, when every layer is at rest (a recurrent cache with a pending prefill or an
    /// armed round is not persistable; between ops neither is open). The state checks after the op compare every
    /// restored row with its twin, and every later output is the run's, so an inexact restore changes the hash.
    pub(super) fn persist_batch(&mut self) -> Res<()> {
        use kvsim_persist::{inspect::Format, AnyCache, Persisted};
        if self.batch.iter().any(|b| matches!(b, Rows::Ssm(c) if c.is_pending() || c.in_round())) {
            return Ok(());
        }
        let persisted: Vec<Persisted> = std::mem::take(&mut self.batch)
            .into_iter()
            .map(|b| {
                let cache = match b {
                    Rows::Ssm(c) => AnyCache::Ssm(c),
                    Rows::Attn(b) => AnyCache::Rows(b),
                };
                Persisted { minimum_reusable_offset: cache.offset() / 2, cache }
            })
            .collect();
        self.batch = crate::sim::family::persist_through_bytes(persisted, Format::Kvsim, &mut self.counters)?
            .into_iter()
            .map(|c| match c {
                AnyCache::Ssm(c) => Ok(Rows::Ssm(c)),
                AnyCache::Rows(b) => Ok(Rows::Attn(b)),
                other => Err(Failure::new("persist", format!("batch restored as {}", other.storage_kind()))),
            })
            .collect::<Res<_>>()?;
        self.counters.persist_batches += 1;
        Ok(())
    }
}

/// Saves a request's caches (every layer, one file) and restores them from the bytes alone: kvsim's format with a
/// reuse floor of half each offset (the floors must come back), or with `via_mlxlm` an mlx-lm prompt-cache file
/// (DeltaNet layers as `ArraysCache`, offsets in its user metadata) when every layer's mlx-lm form keeps its state.
/// The layers keep their kinds. The state checks after the op and every later read compare the restored caches
/// with the twins and the model.
pub(super) fn persist_roundtrip(
    caches: Vec<Cache>,
    via_mlxlm: bool,
    counters: &mut crate::sim::summary::Counters,
) -> Res<Vec<Cache>> {
    use kvsim_persist::inspect::Format;
    use kvsim_persist::{AnyCache, Persisted};
    let persisted: Vec<Persisted> = caches
        .into_iter()
        .map(|c| {
            let cache = match c {
                Cache::Ssm(c) => AnyCache::Ssm(c),
                Cache::Attn(c) => AnyCache::Serial(c),
            };
            Persisted { minimum_reusable_offset: cache.offset() / 2, cache }
        })
        .collect();
    let mlx = via_mlxlm && persisted.iter().all(|p| crate::sim::family::attention::mlxlm_keeps_state(&p.cache));
    let (format, persisted) = if mlx {
        let zero = persisted.into_iter().map(|p| Persisted::new(p.cache)).collect::<Vec<_>>();
        (Format::MlxLm, zero)
    } else {
        (Format::Kvsim, persisted)
    };
    crate::sim::family::persist_through_bytes(persisted, format, counters)?
        .into_iter()
        .map(|c| match c {
            AnyCache::Ssm(c) => Ok(Cache::Ssm(c)),
            AnyCache::Serial(c) => Ok(Cache::Attn(c)),
            other => Err(Failure::new("persist", format!("a request's layer restored as {}", other.storage_kind()))),
        })
        .collect()
}
