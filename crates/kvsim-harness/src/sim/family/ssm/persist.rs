//! The recurrent family's save/restore mid-run: a request's caches (kvsim's format or an mlx-lm prompt-cache file)
//! and the running batch, through bytes and back.

use super::{mlx, Cache, LayerDef, Recurrent, Res, Rows};
use crate::sim::check::Failure;
use crate::sim::family::layer_set;
use kvsim_cache::SsmCache;
use kvsim_persist::AnyCache;

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

impl Recurrent {
    /// A model's cache set whose recurrent layers hold different offsets, built from copies of request `req`'s caches
    /// (the run's caches are untouched), saved and restored through kvsim's format and an mlx-lm file
    /// ([`layer_set::round_trip_both`]) and compared layer by layer (kind, spec, offsets, both states' bytes):
    ///
    /// | layer | holds |
    /// |---|---|
    /// | 0 | the request's first DeltaNet layer, as it is (offset `p`) |
    /// | 1 | a copy of it advanced by `n = 1..=4` of the request's next positions (offset `p + n`) |
    /// | 2, 3 | empty attention layers of different specs, windows and classes ([`layer_set::empty_layers_differing`]) |
    /// | 4 | a list: the request's second DeltaNet layer (offset `p`), layer 1, and a third empty attention layer |
    ///
    /// Every recurrent layer of a request's own save shares one offset (they saw the same tokens), so a codec that
    /// writes one recurrent layer's offsets for all (mlx-lm's `ArraysCache` stores none: kvsim carries them in the
    /// file's user metadata) passes those saves and fails this one; likewise a reader that gives every empty layer
    /// one spec.
    pub(super) fn persist_recurrent_set(&mut self, req: u32) -> Res<()> {
        let solo = &self.reqs[&req].solo;
        let recurrent: Vec<(usize, SsmCache)> = solo
            .iter()
            .enumerate()
            .filter_map(|(i, c)| match c {
                Cache::Ssm(c) => Some((i, c.clone())),
                Cache::Attn(_) => None,
            })
            .collect();
        let Some((l0, base)) = recurrent.first().cloned() else {
            return Ok(());
        };
        let second = recurrent.get(1).map_or_else(|| base.clone(), |x| x.1.clone());
        let p = base.offset();
        let n = 1 + ((u64::from(req) ^ p as u64) % 4) as usize;
        let LayerDef::DeltaNet { params, .. } = &self.layers[l0] else {
            return Err(Failure::new("persist_layers", format!("layer {l0} is not a DeltaNet layer")));
        };
        let [q, a, b] = self.ssm_inputs(l0 as u32, &[(u64::from(req), p, 0, n)], n, None);
        let mut advanced = base.clone();
        advanced.window(&q, &a, &b, params).map_err(|e| mlx("a copy's window", e))?;
        if advanced.offset() != p + n {
            return Err(Failure::new(
                "persist_layers",
                format!("a window of {n} took offset {p} to {}", advanced.offset()),
            ));
        }
        let w = self
            .layers
            .iter()
            .find_map(|l| match l {
                LayerDef::Attention { window: Some(w) } => Some(*w),
                _ => None,
            })
            .unwrap_or(4);
        let [linear, ring, wide] = layer_set::empty_layers_differing(self.attn, w)?;
        let set = vec![
            AnyCache::Ssm(base),
            AnyCache::Ssm(advanced.clone()),
            AnyCache::Serial(linear),
            AnyCache::Serial(ring),
            AnyCache::List(vec![AnyCache::Ssm(second), AnyCache::Ssm(advanced), AnyCache::Serial(wide)]),
        ];
        let floors = [p / 2, (p + n) / 2, 0, 0, 0];
        layer_set::round_trip_both(&set, &floors, &mut self.counters)?;
        self.reached.extend(["persist/recurrent_offsets_differ", "persist/empty_layers_differ/mlx-lm"]);
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
