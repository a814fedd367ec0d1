//! Whole mlx-lm files to and from kvsim caches ([`file_to_kvsim`], [`file_from_kvsim`]): every layer converted, and
//! the recurrent layers' offsets carried in the file's user metadata ([`SSM_OFFSETS_KEY`]).

use std::collections::BTreeMap;

use crate::codec::AnyCache;
use crate::error::Result;

use super::convert::{from_kvsim, to_kvsim_at};
use super::hints::{put_by_path, Hints, EMPTY_SPECS_KEY, SSM_OFFSETS_KEY};
use super::{MlxFile, MlxLayer};

/// Every layer of an mlx-lm file as a kvsim cache, with the hints of its user metadata ([`Hints::from_metadata`]).
pub fn file_to_kvsim(f: &MlxFile) -> Result<Vec<AnyCache>> {
    let hints = Hints::from_metadata(&f.metadata)?;
    f.layers.iter().enumerate().map(|(i, l)| to_kvsim_at(l, &i.to_string(), &hints)).collect()
}

/// The mlx-lm file of these kvsim caches: [`from_kvsim`] per layer, and `metadata` plus [`SSM_OFFSETS_KEY`] when a
/// layer holds a recurrent cache and [`EMPTY_SPECS_KEY`] when an attention layer holds no token (so that
/// [`file_to_kvsim`] restores their offsets and specs: every file this writes loads back).
pub fn file_from_kvsim(metadata: &BTreeMap<String, String>, caches: &[AnyCache]) -> Result<MlxFile> {
    let mut offsets = BTreeMap::new();
    for (i, c) in caches.iter().enumerate() {
        collect_ssm_offsets(c, i.to_string(), &mut offsets);
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
