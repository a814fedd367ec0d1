//! What a conversion needs beyond an mlx-lm file's own fields ([`Hints`]), the user metadata that carries it
//! ([`SSM_OFFSETS_KEY`], [`EMPTY_SPECS_KEY`]).

use std::collections::BTreeMap;

use crate::error::{PersistError, Result};
use kvsim_cache::KvSpec;

/// The user-metadata key that carries the row offsets of every `ArraysCache` of a file (mlx-lm's `ArraysCache`
/// stores none): a JSON object from the layer's path (`"<layer>"`, or `"<layer>.<child>"` inside a `CacheList`) to
/// its per-row offsets, e.g. `{"0": [6]}`. `file_from_kvsim` writes it; `file_to_kvsim` requires it for every
/// `ArraysCache` (else [`PersistError::Missing`]); a caller that knows the offsets otherwise passes [`Hints`].
pub const SSM_OFFSETS_KEY: &str = "kvsim_ssm_offsets";

/// The user-metadata key that carries the K/V spec of every attention layer that holds no token yet (mlx-lm stores
/// an empty cache as a class name and no array, so its heads, head dim and dtype are not in the file): a JSON object
/// from the layer's path (as [`SSM_OFFSETS_KEY`]) to its spec, e.g. `{"0.1": {"heads_kv": 2, "head_dim": 16,
/// "dtype": "Bf16"}}`. `file_from_kvsim` writes it, so that every file kvsim writes loads back; a file without it
/// (one mlx-lm wrote) needs [`Hints::spec`] for its empty layers, else [`PersistError::Unsupported`].
pub const EMPTY_SPECS_KEY: &str = "kvsim_empty_specs";

/// What [`to_kvsim_at`](super::to_kvsim_at) needs beyond an mlx-lm file's own fields.
#[derive(Debug, Clone, Default)]
pub struct Hints {
    /// The K/V spec of an attention cache that holds no array yet (every such layer).
    pub spec: Option<KvSpec>,
    /// The K/V spec of each empty attention layer, by layer path (see [`EMPTY_SPECS_KEY`]); [`Hints::spec`] first.
    pub empty_specs: BTreeMap<String, KvSpec>,
    /// Per-row offsets of each `ArraysCache`, by layer path (see [`SSM_OFFSETS_KEY`]).
    pub ssm_offsets: BTreeMap<String, Vec<usize>>,
}

impl Hints {
    /// The hints a file's user metadata carries ([`SSM_OFFSETS_KEY`], [`EMPTY_SPECS_KEY`]; absent = none, malformed
    /// = an error).
    pub fn from_metadata(metadata: &BTreeMap<String, String>) -> Result<Self> {
        let ssm_offsets = by_path(metadata, SSM_OFFSETS_KEY, "[offsets]")?;
        let empty_specs = by_path(metadata, EMPTY_SPECS_KEY, "{\"heads_kv\", \"head_dim\", \"dtype\"}")?;
        Ok(Hints { spec: None, ssm_offsets, empty_specs })
    }

    /// The spec of the empty attention layer at `at`: [`Hints::spec`], else the file's [`EMPTY_SPECS_KEY`] entry.
    pub fn spec_at(&self, at: &str) -> Option<KvSpec> {
        // Mutation hook `Mutant::MlxlmEmptySpecFromFirst`: the first empty layer's spec for every one.
        if kvsim_cache::fault!(MlxlmEmptySpecFromFirst) && self.empty_specs.contains_key(at) {
            return self.spec.or_else(|| self.empty_specs.values().next().copied());
        }
        self.spec.or_else(|| self.empty_specs.get(at).copied())
    }
}

/// A user-metadata entry that maps layer paths to values (absent = empty; malformed JSON = `Malformed`, naming the
/// key and the `expected` value shape).
fn by_path<T: serde::de::DeserializeOwned>(
    metadata: &BTreeMap<String, String>,
    key: &str,
    expected: &str,
) -> Result<BTreeMap<String, T>> {
    match metadata.get(key) {
        None => Ok(BTreeMap::new()),
        Some(s) => serde_json::from_str(s).map_err(|e| {
            PersistError::malformed(format!("user metadata {key}: {e} (expected {{\"<layer>\": {expected}}})"))
        }),
    }
}

/// Writes `map` under `key` as JSON (an empty map: no entry), replacing what `metadata` held there.
pub(super) fn put_by_path<T: serde::Serialize>(
    metadata: &mut BTreeMap<String, String>,
    key: &str,
    map: &BTreeMap<String, T>,
) -> Result<()> {
    metadata.remove(key);
    if !map.is_empty() {
        let json = serde_json::to_string(map).map_err(|e| PersistError::malformed(e.to_string()))?;
        metadata.insert(key.to_string(), json);
    }
    Ok(())
}
