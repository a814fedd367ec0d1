//! Per-layer variety at save time: a model's cache set whose layers differ, built from one request's caches,
//! saved and restored through both formats and compared layer by layer.
//!
//! A model's layers see the same tokens but need not hold the same state. A sliding layer that has wrapped cannot
//! trim while a full layer beside it can (vllm-mlx#680: a set's layers desync once a trim reaches the window); a
//! list (mlx-lm's `CacheList`) may hold children trimmed apart. A codec that writes one layer's bookkeeping for
//! every layer (the class of mlx-lm#1494 / #1502, whose `trim_prompt_cache` reports layer 0's count) passes every
//! save whose layers are alike, which is every save of a family's own layers. So the persist op also saves this
//! set, built from the request it saves:
//!
//! | layer | holds |
//! |---|---|
//! | 0 | the request's own layer-0 cache, as it is |
//! | 1 | the request's positions in the other layout: beside a linear family a ring of `ceil(offset / 2)` columns, wrapped (its plain trim is refused and changes nothing); beside a rotating family a linear cache of every position |
//! | 2 | a copy of the first trimmable of the two, trimmed by `1..=len` positions (the trim returns what was asked) |
//! | 3 | a list: layer 2 trimmed once more, and layer 1 |
//!
//! In kvsim's format every layer carries its own reuse floor (the list's lies between its children's offsets when
//! they differ) and the file is damaged three ways like every saved file ([`super::damaged_copies_refused`]). Every
//! layer must come back with its kind, spec, window, ring state, floor and live bytes. Then a lie under valid
//! checksums: layer 2 given its untrimmed source's bookkeeping, whose write head lies past the columns layer 2
//! holds, must be refused with a typed error. mlx-lm's files carry no floor and no bypass-trim record: the set goes
//! through them too when every layer's mlx-lm form keeps its state.
//!
//! Nothing here touches the run's caches (the set is made of copies): the run's result hash does not see it.

use crate::sim::check::Failure;
use crate::sim::summary::Counters;
use kvsim_cache::bytes::ArrayBytes;
use kvsim_cache::{CacheError, KvDtype, KvSpec, SerialCache};
use kvsim_persist::inspect::{load_any, save_as, Format};
use kvsim_persist::{AnyCache, Persisted};

type Res<T> = Result<T, Failure>;

fn fail(what: impl Into<String>) -> Failure {
    Failure::new("persist_layers", what.into())
}

/// What one set's round trip reached (for the run's coverage classes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SetReach {
    /// The set went through an mlx-lm file as well.
    pub mlxlm: bool,
}

/// Builds the set from `own` (a request's layer-0 cache) and `other` (its positions in the other layout), saves and
/// restores it, and checks it layer by layer (see the module docs). `pick` chooses the trim and the list's floor.
/// `None`: neither layer holds a position it could trim, so no set was built.
pub(crate) fn round_trip(
    own: &SerialCache,
    other: SerialCache,
    pick: u64,
    counters: &mut Counters,
) -> Res<Option<SetReach>> {
    let pair = [own.clone(), other];
    for c in pair.iter().filter(|c| !c.is_trimmable()) {
        let mut copy = c.clone();
        match copy.trim(1, false) {
            Err(CacheError::NotTrimmable { .. }) if copy.state() == c.state() => counters.expected_errors += 1,
            Err(CacheError::NotTrimmable { .. }) => return Err(fail("a refused trim changed the ring state")),
            other => return Err(fail(format!("a wrapped ring's plain trim: {other:?}, expected NotTrimmable"))),
        }
    }
    let Some(src) = (0..2).find(|&i| pair[i].is_trimmable() && pair[i].state().len > 0) else {
        return Ok(None);
    };
    let trim = |c: &SerialCache, n: usize| -> Res<SerialCache> {
        let mut t = c.clone();
        let got = t.trim(n, false).map_err(|e| fail(format!("trim({n}) of a trimmable layer: {e}")))?;
        if got != n || t.offset() + n != c.offset() || t.state().len + n != c.state().len {
            return Err(fail(format!("trim({n}) reported {got}: {:?} -> {:?}", c.state(), t.state())));
        }
        Ok(t)
    };
    let len = pair[src].state().len;
    let trimmed = trim(&pair[src], 1 + (pick % len as u64) as usize)?;
    let child = if trimmed.state().len > 0 { trim(&trimmed, 1)? } else { trimmed.clone() };
    let (lo, hi) = (child.offset().min(pair[1].offset()), child.offset().max(pair[1].offset()));
    let list_floor = if hi > lo { lo + 1 + ((pick >> 32) % (hi - lo) as u64) as usize } else { hi / 2 };
    let [a, b] = pair;
    let set = vec![
        AnyCache::Serial(a),
        AnyCache::Serial(b.clone()),
        AnyCache::Serial(trimmed),
        AnyCache::List(vec![AnyCache::Serial(child), AnyCache::Serial(b)]),
    ];
    let floors = [set[0].offset() / 2, set[1].offset(), 0, list_floor];
    let persisted: Vec<Persisted> =
        set.iter().zip(floors).map(|(c, f)| Persisted { cache: c.clone(), minimum_reusable_offset: f }).collect();
    let bytes = save_as(Format::Kvsim, &Default::default(), &persisted).map_err(|e| fail(format!("save: {e}")))?;
    counters.damaged_files_refused += super::damaged_copies_refused(&bytes)?;
    let back = load_any(&bytes).map_err(|e| fail(format!("restore: {e}")))?.1;
    same_set("kvsim", &set, &back, Some(&floors))?;
    // The lie: layer 2 holds its untrimmed source's bookkeeping (a write head past its columns), checksums valid.
    let mut file = kvsim_persist::kvsim::decode_entries(&bytes).map_err(|e| fail(format!("entries: {e}")))?;
    file.entries[2].state = file.entries[src].state.clone();
    let lie = kvsim_persist::kvsim::encode_entries(&file.metadata, &file.entries).map_err(|e| fail(e.to_string()))?;
    match load_any(&lie) {
        Err(_) => counters.lying_files_refused += 1,
        Ok(_) => return Err(fail(format!("layer 2 loaded with layer {src}'s bookkeeping"))),
    }
    let mlxlm = set.iter().all(super::attention::mlxlm_keeps_state);
    if mlxlm {
        let plain: Vec<Persisted> = set.iter().cloned().map(Persisted::new).collect();
        let bytes =
            save_as(Format::MlxLm, &Default::default(), &plain).map_err(|e| fail(format!("mlx-lm save: {e}")))?;
        let back = load_any(&bytes).map_err(|e| fail(format!("mlx-lm restore: {e}")))?.1;
        same_set("mlx-lm", &set, &back, None)?;
    }
    counters.layer_sets += 1;
    counters.checks += 1;
    Ok(Some(SetReach { mlxlm }))
}

/// Three empty attention layers (no position yet: mlx-lm writes an empty cache as its class name alone, so their specs
/// travel only in the file's `kvsim_empty_specs`) whose specs, windows and classes differ pairwise, made from `spec`:
/// a linear cache of `spec` (`KVCache`); a ring of window `w` with one more K/V head, the other head dim (16 or 32)
/// and the other dtype (`RotatingKVCache`); a linear cache with two more K/V heads (the caller puts it inside a list).
/// A reader that gives every empty layer one spec (the first's, a neighbour's) brings at least two of them back wrong.
pub(crate) fn empty_layers_differing(spec: KvSpec, w: usize) -> Res<[SerialCache; 3]> {
    let other_dtype = match spec.dtype {
        KvDtype::Bf16 => KvDtype::F32,
        _ => KvDtype::Bf16,
    };
    let ring =
        KvSpec { heads_kv: spec.heads_kv + 1, head_dim: if spec.head_dim == 16 { 32 } else { 16 }, dtype: other_dtype };
    let wide = KvSpec { heads_kv: spec.heads_kv + 2, ..spec };
    let new = |s: KvSpec, w: Option<usize>| SerialCache::new(s, w).map_err(|e| fail(format!("an empty layer: {e}")));
    Ok([new(spec, None)?, new(ring, Some(w.max(1)))?, new(wide, None)?])
}

/// Saves `set` in kvsim's format (every layer with its floor) and in an mlx-lm file (no floors), restores both from
/// the bytes alone, and requires every layer back with its own kind, spec, window, offsets and state bytes
/// (recurrent layers' offsets travel in the mlx-lm file's `kvsim_ssm_offsets`, empty layers' specs in its
/// `kvsim_empty_specs`). Every layer of `set` must have an mlx-lm form.
pub(crate) fn round_trip_both(set: &[AnyCache], floors: &[usize], counters: &mut Counters) -> Res<()> {
    let persisted: Vec<Persisted> =
        set.iter().zip(floors).map(|(c, &f)| Persisted { cache: c.clone(), minimum_reusable_offset: f }).collect();
    let bytes = save_as(Format::Kvsim, &Default::default(), &persisted).map_err(|e| fail(format!("save: {e}")))?;
    let back = load_any(&bytes).map_err(|e| fail(format!("restore: {e}")))?.1;
    same_set("kvsim", set, &back, Some(floors))?;
    let plain: Vec<Persisted> = set.iter().cloned().map(Persisted::new).collect();
    let bytes = save_as(Format::MlxLm, &Default::default(), &plain).map_err(|e| fail(format!("mlx-lm save: {e}")))?;
    let back = load_any(&bytes).map_err(|e| fail(format!("mlx-lm restore: {e}")))?.1;
    same_set("mlx-lm", set, &back, None)?;
    counters.layer_sets += 1;
    counters.checks += 2;
    Ok(())
}

/// Every layer of `back` is its layer of `set` (and carries its floor, where the format stores one).
fn same_set(format: &str, set: &[AnyCache], back: &[Persisted], floors: Option<&[usize]>) -> Res<()> {
    if back.len() != set.len() {
        return Err(fail(format!("{format}: {} layers saved, {} restored", set.len(), back.len())));
    }
    for (i, (a, b)) in set.iter().zip(back).enumerate() {
        same_layer(&format!("{format} layer {i}"), a, &b.cache)?;
        if let Some(f) = floors.filter(|f| f[i] != b.minimum_reusable_offset) {
            return Err(fail(format!(
                "{format} layer {i}: floor {} saved, {} restored",
                f[i], b.minimum_reusable_offset
            )));
        }
    }
    Ok(())
}

fn same_layer(at: &str, a: &AnyCache, b: &AnyCache) -> Res<()> {
    match (a, b) {
        (AnyCache::Serial(a), AnyCache::Serial(b)) => {
            let (ka, kb) = (a.storage_kind(), b.storage_kind());
            if ka != kb || a.spec() != b.spec() || a.max_size() != b.max_size() || a.state() != b.state() {
                return Err(fail(format!(
                    "{at}: {ka} {:?} W={:?} saved, {kb} {:?} W={:?} restored",
                    a.state(),
                    a.max_size(),
                    b.state(),
                    b.max_size()
                )));
            }
            let planes = |c: &SerialCache| -> Res<Vec<ArrayBytes>> {
                let p = c.physical_planes().map_err(|e| fail(format!("{at}: planes: {e}")))?;
                ArrayBytes::read_many(&p.iter().collect::<Vec<_>>()).map_err(|e| fail(format!("{at}: bytes: {e}")))
            };
            if planes(a)? != planes(b)? {
                return Err(fail(format!("{at}: the live columns' bytes differ")));
            }
            Ok(())
        }
        (AnyCache::Ssm(a), AnyCache::Ssm(b)) => {
            if a.spec() != b.spec() || a.offsets() != b.offsets() {
                return Err(fail(format!(
                    "{at}: ssm {:?} at offsets {:?} saved, {:?} at {:?} restored",
                    a.spec(),
                    a.offsets(),
                    b.spec(),
                    b.offsets()
                )));
            }
            let states = |c: &kvsim_cache::SsmCache| -> Res<Vec<ArrayBytes>> {
                [c.conv(), c.recurrent()]
                    .into_iter()
                    .map(|x| ArrayBytes::of(x).map_err(|e| fail(format!("{at}: bytes: {e}"))))
                    .collect()
            };
            if states(a)? != states(b)? {
                return Err(fail(format!("{at}: the recurrent states' bytes differ")));
            }
            Ok(())
        }
        (AnyCache::List(a), AnyCache::List(b)) if a.len() == b.len() => {
            a.iter().zip(b).enumerate().try_for_each(|(i, (x, y))| same_layer(&format!("{at} child {i}"), x, y))
        }
        _ => Err(fail(format!("{at}: {} saved, {} restored", a.storage_kind(), b.storage_kind()))),
    }
}
