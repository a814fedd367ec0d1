//! Whole mlx-lm files to and from kvsim caches ([`file_to_kvsim`], [`file_from_kvsim`]): every layer converted, and
//! the recurrent layers' offsets carried in the file's user metadata ([`SSM_OFFSETS_KEY`]).

use std::collections::BTreeMap;

use crate::codec::AnyCache;
use crate::error::Result;

use super::convert::{from_kvsim, to_kvsim_at};
use super::hints::{put_by_path, Hints, EMPTY_SPECS_KEY, SSM_OFFSETS_KEY};
use super::{MlxFile, MlxLayer};

/// Every layer of an mlx-lm file as a kvsim cache, with the hints [`file_hints`] finds.
pub fn file_to_kvsim(f: &MlxFile) -> Result<Vec<AnyCache>> {
    file_to_kvsim_with(f, &Hints::default())
}

/// [`file_to_kvsim`], `given` first (a caller's explicit offsets and specs).
pub fn file_to_kvsim_with(f: &MlxFile, given: &Hints) -> Result<Vec<AnyCache>> {
    let (hints, _) = file_hints(f, given)?;
    f.layers.iter().enumerate().map(|(i, l)| to_kvsim_at(l, &i.to_string(), &hints)).collect()
}

/// Where a hint of [`file_hints`] came from.
pub const FROM_CALLER: &str = "given by the caller";
/// See [`FROM_CALLER`].
pub const FROM_METADATA: &str = "the file's user metadata";
/// See [`FROM_CALLER`].
pub const FROM_ATTENTION: &str = "the file's attention layers (they saw the same tokens)";
/// See [`FROM_CALLER`].
pub const FROM_ATTENTION_SPEC: &str = "the file's other attention layers (they share one K/V spec)";

/// What converting `f` needs beyond its own fields, and where each piece came from (by layer path): `given` first
/// (a caller's `ssm_offsets` and specs), then the file's user metadata ([`Hints::from_metadata`]), then the file
/// itself. An `ArraysCache` mlx-lm wrote for a hybrid model carries no offsets, but the model's attention layers
/// saw the same tokens: when every attention layer of the file holds the same per-row offsets (and as many rows),
/// those are its offsets. A plain `KVCache` or `RotatingKVCache` that holds no token yet (mlx-lm writes only its
/// class name) takes the K/V spec every attention layer of the file that holds tokens shares (an empty quantized or
/// chunked layer does not: its group or chunk must fit the spec). Where the file does not decide (no attention layer,
/// layers that disagree), nothing is added and the conversion refuses as before.
pub fn file_hints(f: &MlxFile, given: &Hints) -> Result<(Hints, BTreeMap<String, String>)> {
    let meta = Hints::from_metadata(&f.metadata)?;
    let mut hints =
        Hints { spec: given.spec, empty_specs: given.empty_specs.clone(), ssm_offsets: given.ssm_offsets.clone() };
    let mut sources: BTreeMap<String, String> = BTreeMap::new();
    for k in given.ssm_offsets.keys().chain(given.empty_specs.keys()) {
        sources.insert(k.clone(), FROM_CALLER.into());
    }
    for (k, v) in meta.ssm_offsets {
        if let std::collections::btree_map::Entry::Vacant(e) = hints.ssm_offsets.entry(k.clone()) {
            sources.insert(k, FROM_METADATA.into());
            e.insert(v);
        }
    }
    for (k, v) in meta.empty_specs {
        if let std::collections::btree_map::Entry::Vacant(e) = hints.empty_specs.entry(k.clone()) {
            sources.entry(k).or_insert_with(|| FROM_METADATA.into());
            e.insert(v);
        }
    }
    let mut attention = Vec::new();
    let mut arrays = Vec::new();
    let mut empty = Vec::new();
    for (i, l) in f.layers.iter().enumerate() {
        walk(l, i.to_string(), &mut attention, &mut arrays, &mut empty)?;
    }
    let offsets: Vec<&Vec<usize>> = attention.iter().map(|(o, _)| o).collect();
    if let Some(first) = offsets.first().filter(|f| offsets.iter().all(|o| o == *f)) {
        for (at, rows) in arrays {
            if !hints.ssm_offsets.contains_key(&at) && rows == first.len() {
                sources.insert(at.clone(), FROM_ATTENTION.into());
                hints.ssm_offsets.insert(at, (*first).clone());
            }
        }
    }
    let specs: Vec<kvsim_cache::KvSpec> = attention.iter().filter_map(|(_, s)| *s).collect();
    if let Some(first) = specs.first().filter(|f| specs.iter().all(|s| s == *f)) {
        for at in empty {
            if hints.spec.is_none() && !hints.empty_specs.contains_key(&at) {
                sources.insert(at.clone(), FROM_ATTENTION_SPEC.into());
                hints.empty_specs.insert(at, *first);
            }
        }
    }
    Ok((hints, sources))
}

/// The file's layers by path: each attention layer holding tokens (its per-row offsets and its spec), each
/// `ArraysCache` (its rows), each attention layer holding none.
fn walk(
    l: &MlxLayer,
    at: String,
    attention: &mut Vec<(Vec<usize>, Option<kvsim_cache::KvSpec>)>,
    arrays: &mut Vec<(String, usize)>,
    empty: &mut Vec<String>,
) -> Result<()> {
    let spec_of = |k: &Option<crate::tensor::HostTensor>| -> Option<kvsim_cache::KvSpec> {
        let k = k.as_ref()?;
        let dtype = match k.dtype {
            crate::tensor::TensorDtype::BF16 => kvsim_cache::KvDtype::Bf16,
            crate::tensor::TensorDtype::F32 => kvsim_cache::KvDtype::F32,
            _ => return None,
        };
        (k.shape.len() == 4).then(|| kvsim_cache::KvSpec { heads_kv: k.shape[1], head_dim: k.shape[3], dtype })
    };
    let pos = |v: i64| usize::try_from(v).unwrap_or(0);
    match l {
        MlxLayer::ConcatenateKvCache { keys, .. } => {
            // Its offset is its column count; one without keys is not a cache mlx-lm can load.
            if let Some(k) = keys.as_ref().filter(|k| k.shape.len() == 4) {
                attention.push((vec![k.shape[2]], spec_of(keys)));
            }
        }
        MlxLayer::KvCache { keys, offset, .. } | MlxLayer::RotatingKvCache { keys, offset, .. } => {
            if keys.is_none() {
                empty.push(at);
            } else {
                attention.push((vec![pos(*offset)], spec_of(keys)));
            }
        }
        // An empty chunked or quantized layer takes no spec from the others (its chunk or group size must fit it).
        MlxLayer::ChunkedKvCache { keys, offset, .. } => {
            if keys.is_some() {
                attention.push((vec![pos(*offset)], spec_of(keys)));
            }
        }
        MlxLayer::QuantizedKvCache { keys, offset, .. } => {
            if keys.is_some() {
                attention.push((vec![pos(*offset)], None));
            }
        }
        MlxLayer::BatchKvCache { keys, offset, .. } | MlxLayer::BatchRotatingKvCache { keys, offset, .. } => {
            if keys.is_some() {
                let o = offset.to_i64s("offset")?.into_iter().map(pos).collect();
                attention.push((o, spec_of(keys)));
            }
        }
        MlxLayer::ArraysCache { cache, .. } => {
            let rows = cache.iter().flatten().next().and_then(|t| t.shape.first().copied()).unwrap_or(1);
            arrays.push((at, rows));
        }
        MlxLayer::CacheList(children) => {
            for (j, c) in children.iter().enumerate() {
                walk(c, format!("{at}.{j}"), attention, arrays, empty)?;
            }
        }
    }
    Ok(())
}

/// The mlx-lm file of these kvsim caches: [`from_kvsim`] per layer, and `metadata` plus [`SSM_OFFSETS_KEY`] when a
/// layer holds a recurrent cache and [`EMPTY_SPECS_KEY`] when an attention layer holds no token (so that
/// [`file_to_kvsim`] restores their offsets and specs: every file this writes loads back).
pub fn file_from_kvsim(metadata: &BTreeMap<String, String>, caches: &[AnyCache]) -> Result<MlxFile> {
    let mut offsets = BTreeMap::new();
    for (i, c) in caches.iter().enumerate() {
        collect_ssm_offsets(c, i.to_string(), &mut offsets);
    }
    if kvsim_cache::fault!(MlxlmSsmOffsetsFromFirst) {
        // Mutation hook `Mutant::MlxlmSsmOffsetsFromFirst`: the first recurrent layer's offsets for every one.
        if let Some(first) = caches.iter().find_map(first_ssm_offsets) {
            offsets.values_mut().for_each(|o| *o = first.clone());
        }
    }
    let mut metadata = metadata.clone();
    put_by_path(&mut metadata, SSM_OFFSETS_KEY, &offsets)?;
    let layers: Vec<MlxLayer> = caches.iter().map(from_kvsim).collect::<Result<_>>()?;
    let mut specs = BTreeMap::new();
    for (i, (c, l)) in caches.iter().zip(&layers).enumerate() {
        collect_empty_specs(c, l, i.to_string(), &mut specs);
    }
    put_by_path(&mut metadata, EMPTY_SPECS_KEY, &specs)?;
    Ok(MlxFile { metadata, layers })
}

/// The spec of every attention layer written without arrays, by path.
fn collect_empty_specs(c: &AnyCache, l: &MlxLayer, at: String, out: &mut BTreeMap<String, kvsim_cache::KvSpec>) {
    let empty = match l {
        MlxLayer::KvCache { keys, .. }
        | MlxLayer::ConcatenateKvCache { keys, .. }
        | MlxLayer::RotatingKvCache { keys, .. }
        | MlxLayer::BatchKvCache { keys, .. }
        | MlxLayer::BatchRotatingKvCache { keys, .. }
        | MlxLayer::ChunkedKvCache { keys, .. } => keys.is_none(),
        MlxLayer::QuantizedKvCache { keys, .. } => keys.is_none(),
        MlxLayer::CacheList(children) => {
            if let AnyCache::List(v) = c {
                for (j, (cc, cl)) in v.iter().zip(children).enumerate() {
                    collect_empty_specs(cc, cl, format!("{at}.{j}"), out);
                }
            }
            false
        }
        MlxLayer::ArraysCache { .. } => false,
    };
    if let (true, Some(spec)) = (empty, c.spec()) {
        out.insert(at, spec);
    }
}

fn collect_ssm_offsets(c: &AnyCache, at: String, out: &mut BTreeMap<String, Vec<usize>>) {
    match c {
        AnyCache::Ssm(s) => {
            out.insert(at, s.offsets().to_vec());
        }
        AnyCache::List(v) => {
            for (j, child) in v.iter().enumerate() {
                collect_ssm_offsets(child, format!("{at}.{j}"), out);
            }
        }
        _ => {}
    }
}

/// The offsets of the first recurrent cache of `c` in file order (the hook of `Mutant::MlxlmSsmOffsetsFromFirst`).
fn first_ssm_offsets(c: &AnyCache) -> Option<Vec<usize>> {
    match c {
        AnyCache::Ssm(s) => Some(s.offsets().to_vec()),
        AnyCache::List(v) => v.iter().find_map(first_ssm_offsets),
        _ => None,
    }
}
