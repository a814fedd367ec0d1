//! What a conversion needs beyond an mlx-lm file's own fields ([`Hints`]), the user metadata that carries it
//! ([`SSM_OFFSETS_KEY`]).

use std::collections::BTreeMap;

use crate::error::{PersistError, Result};
use kvsim_cache::KvSpec;

/// The user-metadata key that carries the row offsets of every `ArraysCache` of a file (mlx-lm's `ArraysCache`
/// stores none): a JSON object from the layer's path (`"<layer>"`, or `"<layer>.<child>"` inside a `CacheList`) to
/// its per-row offsets, e.g. `{"0": [6]}`. `file_from_kvsim` writes it; `file_to_kvsim` requires it for every
/// `ArraysCache` (else [`PersistError::Missing`]); a caller that knows the offsets otherwise passes [`Hints`].
pub const SSM_OFFSETS_KEY: &str = "kvsim_ssm_offsets";

/// What [`to_kvsim_at`](super::to_kvsim_at) needs beyond an mlx-lm file's own fields.
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
