//! What a conversion needs beyond an mlx-lm file's own fields ([`Hints`]), the user metadata that carries it
//! ([`SSM_OFFSETS_KEY`]), and whole files to and from kvsim caches ([`file_to_kvsim`], [`file_from_kvsim`]).

use std::collections::BTreeMap;

use crate::codec::AnyCache;
use crate::error::{PersistError, Result};
use kvsim_cache::KvSpec;

use super::convert::{from_kvsim, to_kvsim_at};
use super::MlxFile;

/// The user-metadata key that carries the row offsets of every `ArraysCache` of a file (mlx-lm's `ArraysCache`
/// stores none): a JSON object from the layer's path (`"<layer>"`, or `"<layer>.<child>"` inside a `CacheList`) to
/// its per-row offsets, e.g. `{"0": [6]}`. [`file_from_kvsim`] writes it; [`file_to_kvsim`] requires it for every
/// `ArraysCache` (else [`PersistError::Missing`]); a caller that knows the offsets otherwise passes [`Hints`].
pub const SSM_OFFSETS_KEY: &str = "kvsim_ssm_offsets";

/// What [`to_kvsim_at`] needs beyond an mlx-lm file's own fields.
#[derive(Debug, Clone, Default)]
pub struct Hints {
    /// The K/V spec of an attention cache that holds no array yet.
    pub spec: Option<KvSpec>,
    /// Per-row offsets of each `ArraysCache`, by layer path (see [`SSM_OFFSETS_KEY`]).
    pub ssm_offsets: BTreeMap<String, Vec<usize>>,
}

impl Hints {
    /// The hints a file's user metadata carries ([`SSM_OFFSETS_KEY`]; absent = none, malformed = an error).
    pub fn from_metadata(metadata: &BTreeMap<String, String>) -> Result<Self> {
        let ssm_offsets = match metadata.get(SSM_OFFSETS_KEY) {
            None => BTreeMap::new(),
            Some(s) => serde_json::from_str(s).map_err(|e| {
                PersistError::malformed(format!(
                    "user metadata {SSM_OFFSETS_KEY}: {e} (expected {{\"<layer>\": [offsets]}})"
                ))
            })?,
        };
        Ok(Hints { spec: None, ssm_offsets })
    }
}

/// Every layer of an mlx-lm file as a kvsim cache, with the hints of its user metadata ([`Hints::from_metadata`]).
pub fn file_to_kvsim(f: &MlxFile) -> Result<Vec<AnyCache>> {
    let hints = Hints::from_metadata(&f.metadata)?;
    f.layers.iter().enumerate().map(|(i, l)| to_kvsim_at(l, &i.to_string(), &hints)).collect()
}

/// The mlx-lm file of these kvsim caches: [`from_kvsim`] per layer, and `metadata` plus [`SSM_OFFSETS_KEY`] when a
/// layer holds a recurrent cache (so that [`file_to_kvsim`] restores its offsets).
pub fn file_from_kvsim(metadata: &BTreeMap<String, String>, caches: &[AnyCache]) -> Result<MlxFile> {
    let mut offsets = BTreeMap::new();
    for (i, c) in caches.iter().enumerate() {
        collect_ssm_offsets(c, i.to_string(), &mut offsets);
    }
    let mut metadata = metadata.clone();
    metadata.remove(SSM_OFFSETS_KEY);
    if !offsets.is_empty() {
        let json = serde_json::to_string(&offsets).map_err(|e| PersistError::malformed(e.to_string()))?;
        metadata.insert(SSM_OFFSETS_KEY.to_string(), json);
    }
    let layers = caches.iter().map(from_kvsim).collect::<Result<_>>()?;
    Ok(MlxFile { metadata, layers })
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
