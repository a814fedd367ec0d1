//! Storage kinds (R-C-1, R-BROT-10): the identity string every router and capability predicate reads.
//!
//! Four routable kinds exist: [`KV_PLAIN`], [`ROTATING_PLAIN`] and their row batches (the serial kind plus
//! [`ROW_BATCH_MARKER`]). Predicates compare whole strings: a string that is not one of the four is *unknown*, and
//! every predicate answers `false` for it, so a router that asks [`is_row_batch`] first, then the serial predicates,
//! and finally fails with [`CacheError::UnknownStorageKind`] (see [`StorageKind::route`]) can never send an unknown or
//! mislabelled cache down another kind's path. The training kinds ([`TRAINING`], [`PREFIX_SHARED`]) are known but
//! never routed: [`StorageKind::route`] answers [`CacheError::TrainingOnly`] for them (R-TRN-1: never admitted,
//! merged or persisted).

use super::error::CacheError;
use super::Result;

/// The serial linear cache (`KvCache`).
pub const KV_PLAIN: &str = "kv-plain";
/// The serial rotating ring (`RotatingKvCache`, keep = 0).
pub const ROTATING_PLAIN: &str = "rotating-plain";
/// Appended to a serial kind by a cache that holds rows of that kind (`BatchKvCache`, `BatchRotatingKvCache`).
pub const ROW_BATCH_MARKER: &str = "+row-batch";
/// The stateless training cache (`TrainingCache`, R-TRN-1): never admitted, merged or persisted.
pub const TRAINING: &str = "train:training";
/// The prefix-shared training cache for chosen/rejected pairs (`PrefixSharedCache`): never admitted, merged or
/// persisted.
pub const PREFIX_SHARED: &str = "train:prefix-shared";

/// A cache's stable identity string (R-C-1).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StorageKind(pub String);

/// Where a router sends a cache of some kind. Obtained only through [`StorageKind::route`], which checks the
/// row-batch marker first (R-BROT-10).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KindRoute {
    /// A batch of rows; `rotating` tells the rows' serial kind.
    RowBatch { rotating: bool },
    /// One serial cache.
    Serial { rotating: bool },
}

impl StorageKind {
    /// A kind from a string (no validation: unknown strings are representable so that routers can refuse them).
    pub fn new(s: impl Into<String>) -> Self {
        StorageKind(s.into())
    }

    /// The kind of a serial cache with this window (`None` = linear).
    pub fn serial(max_size: Option<usize>) -> Self {
        StorageKind(if max_size.is_some() { ROTATING_PLAIN } else { KV_PLAIN }.to_string())
    }

    /// The kind of a row batch whose rows have this window: the serial kind plus [`ROW_BATCH_MARKER`].
    pub fn row_batch(max_size: Option<usize>) -> Self {
        StorageKind(format!("{}{}", Self::serial(max_size).0, ROW_BATCH_MARKER))
    }

    /// The string.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The route of this kind: row batch first, then the serial kinds; a training kind (`train:*`) is
    /// [`CacheError::TrainingOnly`] (never admitted, merged or persisted, R-TRN-1); any other string is
    /// [`CacheError::UnknownStorageKind`] (fail closed, R-C-1).
    pub fn route(&self) -> Result<KindRoute> {
        if is_training(self) {
            Err(CacheError::TrainingOnly { kind: self.0.clone() })
        } else if is_row_batch(self) {
            Ok(KindRoute::RowBatch { rotating: is_rotating(self) })
        } else if is_rotating(self) {
            Ok(KindRoute::Serial { rotating: true })
        } else if is_plain_kv(self) {
            Ok(KindRoute::Serial { rotating: false })
        } else {
            Err(CacheError::UnknownStorageKind { kind: self.0.clone() })
        }
    }

    /// The serial kind of the rows (the kind itself for a serial kind). Unknown kinds are an error.
    pub fn inner(&self) -> Result<StorageKind> {
        match self.route()? {
            KindRoute::RowBatch { rotating } | KindRoute::Serial { rotating } => {
                Ok(StorageKind::new(if rotating { ROTATING_PLAIN } else { KV_PLAIN }))
            }
        }
    }
}

impl std::fmt::Display for StorageKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn is_known_serial(s: &str) -> bool {
    s == KV_PLAIN || s == ROTATING_PLAIN
}

/// True iff `k` is exactly a known serial kind plus the row-batch marker. Every router asks this first.
pub fn is_row_batch(k: &StorageKind) -> bool {
    k.0.strip_suffix(ROW_BATCH_MARKER).is_some_and(is_known_serial)
}

/// True iff `k` is the rotating ring or a batch of rotating rows.
pub fn is_rotating(k: &StorageKind) -> bool {
    k.0 == ROTATING_PLAIN || k.0.strip_suffix(ROW_BATCH_MARKER) == Some(ROTATING_PLAIN)
}

/// True iff `k` is the linear cache or a batch of linear rows.
pub fn is_plain_kv(k: &StorageKind) -> bool {
    k.0 == KV_PLAIN || k.0.strip_suffix(ROW_BATCH_MARKER) == Some(KV_PLAIN)
}

/// True iff `k` is a known training-only kind ([`TRAINING`], [`PREFIX_SHARED`]).
pub fn is_training(k: &StorageKind) -> bool {
    k.0 == TRAINING || k.0 == PREFIX_SHARED
}

/// True iff `k` is one of the four known routable kinds (training kinds are known but never routed).
pub fn is_known(k: &StorageKind) -> bool {
    k.route().is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn predicates_compare_whole_strings() {
        let rot_batch = StorageKind::row_batch(Some(8));
        assert_eq!(rot_batch.as_str(), "rotating-plain+row-batch");
        assert!(is_row_batch(&rot_batch) && is_rotating(&rot_batch) && !is_plain_kv(&rot_batch));
        let kv_batch = StorageKind::row_batch(None);
        assert_eq!(kv_batch.as_str(), "kv-plain+row-batch");
        assert!(is_row_batch(&kv_batch) && is_plain_kv(&kv_batch) && !is_rotating(&kv_batch));
        assert!(!is_row_batch(&StorageKind::serial(Some(4))));
        for bad in ["", "rotating", "rotating-plain+row-batch+x", "+row-batch", "quantized+row-batch", "KV-PLAIN"] {
            let k = StorageKind::new(bad);
            assert!(!is_row_batch(&k) && !is_rotating(&k) && !is_plain_kv(&k) && !is_known(&k), "{bad}");
            assert_eq!(k.route(), Err(CacheError::UnknownStorageKind { kind: bad.to_string() }));
        }
    }

    #[test]
    fn route_checks_row_batch_first() {
        // R-BROT-10: the batched ring shares the serial signature; the marker must win.
        assert_eq!(StorageKind::row_batch(Some(3)).route(), Ok(KindRoute::RowBatch { rotating: true }));
        assert_eq!(StorageKind::serial(Some(3)).route(), Ok(KindRoute::Serial { rotating: true }));
        assert_eq!(StorageKind::serial(None).route(), Ok(KindRoute::Serial { rotating: false }));
        assert_eq!(StorageKind::row_batch(Some(3)).inner().unwrap(), StorageKind::serial(Some(3)));
    }

    #[test]
    fn training_kinds_are_never_routed() {
        for kind in [TRAINING, PREFIX_SHARED] {
            let k = StorageKind::new(kind);
            assert!(is_training(&k) && !is_known(&k) && !is_row_batch(&k) && !is_rotating(&k) && !is_plain_kv(&k));
            assert_eq!(k.route(), Err(CacheError::TrainingOnly { kind: kind.to_string() }));
            assert!(k.inner().is_err());
        }
        // Only the exact strings: anything else under the prefix is unknown, not training.
        let odd = StorageKind::new("train:training+row-batch");
        assert!(!is_training(&odd));
        assert_eq!(odd.route(), Err(CacheError::UnknownStorageKind { kind: odd.0.clone() }));
    }
}
