//! The attention family's save/restore mid-run: a request's serial caches (kvsim's format or an mlx-lm
//! prompt-cache file) and the running batch, through bytes and back.

use super::{Attention, Res};
use crate::sim::check::Failure;
use crate::sim::roster::Roster;
use kvsim_cache::SerialCache;
use kvsim_reference::{Tensor, Tok};

impl Attention {
    /// Save/restore of a request outside the batch: every layer saved in one file, dropped, restored
    /// from the bytes alone. `check_all` after the op compares the restored caches with the twins (state and bytes)
    /// and the model; every later op continues them.
    pub(super) fn persist(&mut self, roster: &Roster, req: u32, mlxlm: bool) -> Res<bool> {
        if !roster.is_solo(req) {
            return Ok(false);
        }
        let r = self.reqs.get_mut(&req).unwrap();
        let caches = std::mem::take(&mut r.solo);
        r.solo = persist_roundtrip(caches, mlxlm, &mut self.counters)?;
        self.counters.persist_roundtrips += 1;
        self.persist_layer_set(req)?;
        if !roster.rows().is_empty() {
            self.persist_batch()?;
        }
        Ok(true)
    }

    /// A model's cache set whose layers differ, built from copies of the request's layer 0 and its positions in
    /// the other layout (`sim::family::layer_set`), saved and restored through both formats and compared layer by
    /// layer. The run's caches are untouched. The trim and the list's floor are chosen by the request's id and
    /// offset.
    fn persist_layer_set(&mut self, req: u32) -> Res<()> {
        let n = self.reqs[&req].model.offset;
        if n == 0 {
            return Ok(());
        }
        // Beside a linear family a ring of ceil(n / 2) columns (wrapped: it holds n > W - 1 positions), beside a
        // rotating family a linear cache of every position.
        let (max, first) = match self.max_size() {
            None => (Some(n.div_ceil(2)), n - n.div_ceil(2)),
            Some(_) => (None, 0),
        };
        let toks: Vec<Option<Tok>> = (first..n).map(|p| Some(Tok { req, pos: p as u32 })).collect();
        let rows = std::slice::from_ref(&toks);
        let (k, v) = (self.block(0, Tensor::K, rows)?, self.block(0, Tensor::V, rows)?);
        let other = SerialCache::from_temporal(self.spec, max, &k, &v, n)
            .map_err(|e| super::unexpected("the layer set's other layout", e))?;
        let pick = u64::from(req).wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ (n as u64).rotate_left(32);
        let reach = super::super::layer_set::round_trip(&self.reqs[&req].solo[0], other, pick, &mut self.counters)?;
        if let Some(reach) = reach {
            self.reached.extend(["persist/layers_differ", "persist/list"]);
            if reach.mlxlm {
                self.reached.push("persist/layers_differ/mlx-lm");
            }
        }
        Ok(())
    }

    /// The running batch (every layer, one file) through kvsim's format and back, mid-run: rows keep their physical
    /// columns, ring phase, bypass-trim record and a pending prefill (mlx-lm's batch classes keep none of the
    /// last two, so kvsim's format only). A reuse floor of half the batch offset rides along and must come back. The
    /// state checks after the op compare every restored row with its twin; the outputs of every later op are the
    /// run's, so a restore that is not exact changes the result hash.
    fn persist_batch(&mut self) -> Res<()> {
        use kvsim_persist::{inspect::Format, AnyCache, Persisted};
        let persisted: Vec<Persisted> = std::mem::take(&mut self.batch)
            .into_iter()
            .map(|b| Persisted { minimum_reusable_offset: b.offset() / 2, cache: AnyCache::Rows(b) })
            .collect();
        self.batch = crate::sim::family::persist_through_bytes(persisted, Format::Kvsim, &mut self.counters)?
            .into_iter()
            .map(|c| match c {
                AnyCache::Rows(b) => Ok(b),
                other => Err(Failure::new("persist", format!("batch restored as {}", other.storage_kind()))),
            })
            .collect::<Res<_>>()?;
        self.counters.persist_batches += 1;
        Ok(())
    }
}

/// Saves serial caches to bytes (kvsim's format, or an mlx-lm prompt-cache file when `via_mlxlm` and every cache
/// has an mlx-lm form that keeps its state: positions held, and no bypass-trim record, which mlx-lm's classes do not
/// carry), drops them, and restores them from the bytes alone.
pub(super) fn persist_roundtrip(
    caches: Vec<SerialCache>,
    via_mlxlm: bool,
    counters: &mut crate::sim::summary::Counters,
) -> Res<Vec<SerialCache>> {
    use kvsim_persist::inspect::{load_any, save_as, Format};
    use kvsim_persist::{mlxlm, AnyCache, Persisted};
    let fail = |what: &str, e: kvsim_persist::PersistError| Failure::new("persist", format!("{what}: {e}"));
    let spec_hints: Vec<_> = caches.iter().map(|c| c.spec()).collect();
    let mlx_ok = via_mlxlm && caches.iter().all(|c| mlxlm_keeps_state(&AnyCache::Serial(c.clone())));
    let format = if mlx_ok { Format::MlxLm } else { Format::Kvsim };
    // kvsim's format carries a reuse floor: attach one (half the offset) and require it back; mlx-lm files carry none.
    let floors: Vec<usize> = caches.iter().map(|c| if format == Format::Kvsim { c.offset() / 2 } else { 0 }).collect();
    let persisted: Vec<Persisted> = caches
        .into_iter()
        .zip(&floors)
        .map(|(c, &f)| Persisted { cache: AnyCache::Serial(c), minimum_reusable_offset: f })
        .collect();
    let bytes = save_as(format, &Default::default(), &persisted).map_err(|e| fail("save", e))?;
    drop(persisted);
    let restored = match format {
        Format::Kvsim => {
            counters.damaged_files_refused += crate::sim::family::damaged_copies_refused(&bytes)?;
            load_any(&bytes).map_err(|e| fail("restore", e))?.1
        }
        Format::MlxLm => {
            let f = mlxlm::read(&bytes).map_err(|e| fail("restore", e))?;
            f.layers
                .iter()
                .zip(spec_hints)
                .map(|(l, hint)| mlxlm::to_kvsim(l, Some(hint)).map(Persisted::new))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| fail("restore", e))?
        }
    };
    let back: Vec<usize> = restored.iter().map(|p| p.minimum_reusable_offset).collect();
    if back != floors {
        crate::sim::check::fail(Failure::new("persist", format!("reuse floors {floors:?} saved, {back:?} restored")))?;
    }
    restored
        .into_iter()
        .map(|p| match p.cache {
            AnyCache::Serial(c) => Ok(c),
            other => Err(Failure::new("persist", format!("restored as {}", other.storage_kind()))),
        })
        .collect()
}

/// Whether a cache's mlx-lm form restores its whole state: it holds positions (an empty mlx-lm cache carries no
/// spec), has no bypass-trim record (`last_concat`: mlx-lm's classes carry none) and has an mlx-lm form at all.
pub(crate) fn mlxlm_keeps_state(c: &kvsim_persist::AnyCache) -> bool {
    use kvsim_persist::{mlxlm, AnyCache};
    let serial_ok = |s: &SerialCache| s.offset() > 0 && s.state().last_concat.is_none();
    let ok = match c {
        AnyCache::Serial(s) => serial_ok(s),
        AnyCache::Ssm(s) => !s.is_pending() && !s.in_round(),
        AnyCache::List(children) => !children.is_empty() && children.iter().all(mlxlm_keeps_state),
        _ => false,
    };
    ok && mlxlm::from_kvsim(c).is_ok()
}
