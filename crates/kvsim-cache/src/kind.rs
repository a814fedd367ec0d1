//! Storage kinds (R-C-1, R-BROT-10): the identity string every router and capability predicate reads.
//!
//! The serial kinds are [`KV_PLAIN`], [`ROTATING_PLAIN`] and the quantized `kv:quant:<bits>:<group>` and
//! `kv:rotating-quant:<bits>:<group>` (bits and group among MLX's affine ones, written exactly as
//! [`StorageKind::serial_of`] writes them); each has a row batch (the serial kind plus [`ROW_BATCH_MARKER`]).
//! Predicates compare whole strings: a string that is not one of these is *unknown*, and
//! every predicate answers `false` for it, so a router that asks [`is_row_batch`] first, then the serial predicates,
//! and finally fails with [`CacheError::UnknownStorageKind`] (see [`StorageKind::route`]) can never send an unknown or
//! mislabelled cache down another kind's path. The training kinds ([`TRAINING`], [`PREFIX_SHARED`]) are known but
//! never routed: [`StorageKind::route`] answers [`CacheError::TrainingOnly`] for them (R-TRN-1: never admitted,
//! merged or persisted).

use super::error::CacheError;
use super::quant::{QuantSpec, Storage, QUANT_BITS, QUANT_GROUPS};
use super::Result;

/// The serial linear cache (`KvCache`).
pub const KV_PLAIN: &str = "kv-plain";
/// The serial rotating ring (`RotatingKvCache`, keep = 0).
pub const ROTATING_PLAIN: &str = "rotating-plain";
/// Prefix of the linear quantized kind `kv:quant:<bits>:<group>`.
pub const QUANT_PREFIX: &str = "kv:quant:";
/// Prefix of the quantized ring kind `kv:rotating-quant:<bits>:<group>`.
pub const ROTATING_QUANT_PREFIX: &str = "kv:rotating-quant:";
/// The gated-DeltaNet recurrent cache (`SsmCache`, any number of rows). Not an attention kind: the attention
/// router [`StorageKind::route`] refuses it (fail closed); hybrid sets ask [`is_ssm`] first.
pub const SSM: &str = "ssm";
/// Prefix of the chunked attention cache's kind `kv-chunked:<chunk_size>` ([`super::ChunkedKvCache`], mlx-lm's
/// `ChunkedKVCache`). Not routed by [`StorageKind::route`] (fail closed): it is persisted and continued serially.
pub const CHUNKED_PREFIX: &str = "kv-chunked:";
/// The kind of one layer's list of caches (mlx-lm's `CacheList`: e.g. a DeltaNet state beside an attention cache);
/// each child keeps its own kind. Persisted only (`persist::AnyCache::List`); never routed.
pub const CACHE_LIST: &str = "cache-list";
/// A paged sequence's kind: `kv:paged:<block_size>` (`crate::paged::PagedStore::storage_kind`).
pub const PAGED_PREFIX: &str = "kv:paged:";
/// A paged store's running batch: `kv:paged-rows:<block_size>` (`crate::paged::PagedStore::rows_storage_kind`).
pub const PAGED_ROWS_PREFIX: &str = "kv:paged-rows:";
/// Appended to a serial kind by a cache that holds rows of that kind (`BatchKvCache`, `BatchRotatingKvCache`).
pub const ROW_BATCH_MARKER: &str = "+row-batch";
/// The stateless training cache (`TrainingCache`, R-TRN-1): never admitted, merged or persisted.
pub const TRAINING: &str = "train:training";
/// The prefix-shared training cache for chosen/rejected pairs (`PrefixSharedCache`): never admitted, merged or
/// persisted.
pub const PREFIX_SHARED: &str = "train:prefix-shared";
/// The training DeltaNet cache (`TrainingSsmCache`): zero state every call, state discarded; never admitted, merged
/// or persisted.
pub const TRAINING_SSM: &str = "train:training-ssm";

/// A cache's stable identity string (R-C-1).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StorageKind(pub String);

/// Where a router sends a cache of some kind. Obtained only through [`StorageKind::route`], which checks the
/// row-batch marker first (R-BROT-10).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KindRoute {
    /// A batch of rows; `rotating` tells the rows' serial kind.
    RowBatch {
        /// Whether the rows are rotating rings (`rotating-plain`, `kv:rotating-quant:..`) rather than linear.
        rotating: bool,
    },
    /// One serial cache.
    Serial {
        /// Whether the cache is a rotating ring (`rotating-plain`, `kv:rotating-quant:..`) rather than linear.
        rotating: bool,
    },
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

    /// The kind of a serial cache with this window and storage.
    pub fn serial_of(max_size: Option<usize>, storage: Storage) -> Self {
        StorageKind(storage.serial_kind(max_size))
    }

    /// The kind of a row batch whose rows have this window and storage.
    pub fn row_batch_of(max_size: Option<usize>, storage: Storage) -> Self {
        StorageKind(format!("{}{}", storage.serial_kind(max_size), ROW_BATCH_MARKER))
    }

    /// The storage this kind names; unknown kinds are [`CacheError::UnknownStorageKind`].
    pub fn storage(&self) -> Result<Storage> {
        self.route()?;
        let serial = self.0.strip_suffix(ROW_BATCH_MARKER).unwrap_or(&self.0);
        Ok(parse_quant(serial).map_or(Storage::Plain, |(_, q)| Storage::Affine(q)))
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
        } else if is_linear(self) {
            Ok(KindRoute::Serial { rotating: false })
        } else {
            Err(CacheError::UnknownStorageKind { kind: self.0.clone() })
        }
    }

    /// The serial kind of the rows (the kind itself for a serial kind). Unknown kinds are an error.
    pub fn inner(&self) -> Result<StorageKind> {
        self.route()?;
        Ok(StorageKind::new(self.0.strip_suffix(ROW_BATCH_MARKER).unwrap_or(&self.0)))
    }
}

impl std::fmt::Display for StorageKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// `(rotating, params)` of a quantized serial kind string, only if written exactly as [`StorageKind::serial_of`]
/// writes it with valid bits and group.
fn parse_quant(s: &str) -> Option<(bool, QuantSpec)> {
    let (rotating, rest) = if let Some(r) = s.strip_prefix(ROTATING_QUANT_PREFIX) {
        (true, r)
    } else {
        (false, s.strip_prefix(QUANT_PREFIX)?)
    };
    let (b, g) = rest.split_once(':')?;
    let q = QuantSpec { bits: b.parse().ok()?, group: g.parse().ok()? };
    let canonical = format!("{}:{}", q.bits, q.group) == rest;
    (canonical && QUANT_BITS.contains(&q.bits) && QUANT_GROUPS.contains(&q.group)).then_some((rotating, q))
}

/// Prefix of the transitioning rows' kind `kv:delayed-quant:<bits>:<group>:<start>`.
pub const DELAYED_QUANT_PREFIX: &str = "kv:delayed-quant:";
/// Prefix of the rotating transitioning rows' kind `kv:delayed-rotating-quant:<W>:<bits>:<group>:<start>`.
pub const DELAYED_ROTATING_QUANT_PREFIX: &str = "kv:delayed-rotating-quant:";

/// Prefix of the serial bf16-first lego's kind `kv:bf16-first-quant:<bits>:<group>:<start>`
/// (`Bf16FirstQuantizedKvCache`).
pub const BF16_FIRST_QUANT_PREFIX: &str = "kv:bf16-first-quant:";
/// Prefix of the rotating lego's kind `kv:bf16-first-rotating-quant:<W>:<bits>:<group>:<start>`
/// (`Bf16FirstRotatingQuantizedKvCache`).
pub const BF16_FIRST_ROTATING_QUANT_PREFIX: &str = "kv:bf16-first-rotating-quant:";

/// The parameters of a bf16-first kind (transitioning rows, or their serial lego): window (`None`: full attention), the affine format, and the
/// precision boundary (`None`: `inf`, never converts).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DelayedKind {
    /// The window `W` (`None`: full attention); a parsed kind always has `W >= 1`.
    pub max_size: Option<usize>,
    /// The affine format the storage converts to (bits and group among MLX's).
    pub quant: QuantSpec,
    /// The precision boundary: storage converts once `offset >= start` (and `offset != 0`); `None` (`inf`): never.
    pub start: Option<usize>,
}

impl DelayedKind {
    /// The canonical string (upstream's parameter order; an infinite start is `inf`).
    pub fn kind(&self) -> StorageKind {
        self.write(DELAYED_QUANT_PREFIX, DELAYED_ROTATING_QUANT_PREFIX)
    }

    /// The serial lego's kind with the same parameters: `kv:bf16-first-quant:<bits>:<group>:<start>`,
    /// `kv:bf16-first-rotating-quant:<W>:<bits>:<group>:<start>` (the layout as a whole, whichever storage it
    /// holds now).
    pub fn lego_kind(&self) -> StorageKind {
        self.write(BF16_FIRST_QUANT_PREFIX, BF16_FIRST_ROTATING_QUANT_PREFIX)
    }

    fn write(&self, linear: &str, rotating: &str) -> StorageKind {
        let start = self.start.map_or("inf".to_string(), |s| s.to_string());
        let (b, g) = (self.quant.bits, self.quant.group);
        StorageKind(match self.max_size {
            None => format!("{linear}{b}:{g}:{start}"),
            Some(w) => format!("{rotating}{w}:{b}:{g}:{start}"),
        })
    }
}

/// The parameters of a transitioning rows' kind, only if written exactly as [`DelayedKind::kind`] writes it with
/// valid bits and group and a window of at least 1 (strict like the quantized kinds: no leading zeros, no extra
/// fields, no marker). These kinds are rows of bf16-first legos; no router sends a cache to them
/// ([`StorageKind::route`] answers `UnknownStorageKind`): `TransitioningKvRows` is built from its legos only.
pub fn parse_delayed(k: &StorageKind) -> Option<DelayedKind> {
    parse_params(k, DELAYED_QUANT_PREFIX, DELAYED_ROTATING_QUANT_PREFIX).filter(|d| d.kind() == *k)
}

/// The parameters of a serial bf16-first lego's kind (`kv:bf16-first-quant:..`, `kv:bf16-first-rotating-quant:..`),
/// only if written exactly as [`DelayedKind::lego_kind`] writes it (as strict as [`parse_delayed`]). A lego's
/// storage routes as what it holds now (`kv-plain`, then `kv:quant:..`); this kind names the layout and routes
/// nowhere.
pub fn parse_bf16_first(k: &StorageKind) -> Option<DelayedKind> {
    parse_params(k, BF16_FIRST_QUANT_PREFIX, BF16_FIRST_ROTATING_QUANT_PREFIX).filter(|d| d.lego_kind() == *k)
}

/// True iff `k` is a serial bf16-first lego's kind.
pub fn is_bf16_first(k: &StorageKind) -> bool {
    parse_bf16_first(k).is_some()
}

fn parse_params(k: &StorageKind, linear: &str, rotating: &str) -> Option<DelayedKind> {
    let s = k.as_str();
    let (max_size, rest) = if let Some(r) = s.strip_prefix(rotating) {
        let (w, rest) = r.split_once(':')?;
        (Some(w.parse::<usize>().ok().filter(|&w| w >= 1)?), rest)
    } else {
        (None, s.strip_prefix(linear)?)
    };
    let mut it = rest.split(':');
    let (b, g, st) = (it.next()?, it.next()?, it.next()?);
    if it.next().is_some() {
        return None;
    }
    let quant = QuantSpec { bits: b.parse().ok()?, group: g.parse().ok()? };
    let start = if st == "inf" { None } else { Some(st.parse::<usize>().ok()?) };
    let d = DelayedKind { max_size, quant, start };
    (QUANT_BITS.contains(&quant.bits) && QUANT_GROUPS.contains(&quant.group)).then_some(d)
}

/// True iff `k` is a transitioning rows' kind (`kv:delayed-quant:..`, `kv:delayed-rotating-quant:..`).
pub fn is_delayed(k: &StorageKind) -> bool {
    parse_delayed(k).is_some()
}

fn is_known_serial(s: &str) -> bool {
    s == KV_PLAIN || s == ROTATING_PLAIN || parse_quant(s).is_some()
}

fn is_rotating_serial(s: &str) -> bool {
    s == ROTATING_PLAIN || parse_quant(s).is_some_and(|(r, _)| r)
}

fn is_linear_serial(s: &str) -> bool {
    s == KV_PLAIN || parse_quant(s).is_some_and(|(r, _)| !r)
}

/// True iff `k` is a linear kind (plain or quantized) or a batch of linear rows.
pub fn is_linear(k: &StorageKind) -> bool {
    is_linear_serial(&k.0) || k.0.strip_suffix(ROW_BATCH_MARKER).is_some_and(is_linear_serial)
}

/// True iff `k` is a quantized kind (serial or row batch).
pub fn is_quantized(k: &StorageKind) -> bool {
    parse_quant(k.0.strip_suffix(ROW_BATCH_MARKER).unwrap_or(&k.0)).is_some()
}

/// A paged kind's parameters (`crate::paged::PagedStore::storage_kind`, `rows_storage_kind`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedKind {
    /// Positions per block.
    pub block_size: usize,
    /// The running batch's kind (`kv:paged-rows:`) rather than one sequence's (`kv:paged:`).
    pub rows: bool,
    /// Affine storage's parameters (the `:quant:<bits>:<group>` suffix), `None` for plain planes.
    pub quant: Option<QuantSpec>,
}

/// The paged kind of these parameters: `kv:paged:<block_size>` or `kv:paged-rows:<block_size>`, with
/// `:quant:<bits>:<group>` for affine storage.
pub fn paged_kind(block_size: usize, rows: bool, quant: Option<QuantSpec>) -> StorageKind {
    let prefix = if rows { PAGED_ROWS_PREFIX } else { PAGED_PREFIX };
    StorageKind::new(match quant {
        None => format!("{prefix}{block_size}"),
        Some(q) => format!("{prefix}{block_size}:quant:{}:{}", q.bits, q.group),
    })
}

/// A paged kind written exactly as [`paged_kind`] writes it; `None` for anything else (a block size of 0, a sign,
/// a leading zero, bits or a group MLX's `quantize` does not accept).
pub fn parse_paged(k: &StorageKind) -> Option<PagedKind> {
    let (rest, rows) = match k.0.strip_prefix(PAGED_ROWS_PREFIX) {
        Some(n) => (n, true),
        None => (k.0.strip_prefix(PAGED_PREFIX)?, false),
    };
    let (n, quant) = match rest.split_once(':') {
        None => (rest, None),
        Some((n, q)) => {
            let (b, g) = q.strip_prefix("quant:")?.split_once(':')?;
            (n, Some(QuantSpec { bits: b.parse().ok()?, group: g.parse().ok()? }))
        }
    };
    let block_size: usize = n.parse().ok()?;
    let parsed = PagedKind { block_size, rows, quant };
    let valid = quant.is_none_or(|q| QUANT_BITS.contains(&q.bits) && QUANT_GROUPS.contains(&q.group));
    (block_size > 0 && valid && paged_kind(block_size, rows, quant) == *k).then_some(parsed)
}

/// True iff `k` is exactly a known serial kind plus the row-batch marker. Every router asks this first.
pub fn is_row_batch(k: &StorageKind) -> bool {
    k.0.strip_suffix(ROW_BATCH_MARKER).is_some_and(is_known_serial)
}

/// True iff `k` is a rotating ring (plain or quantized) or a batch of rotating rows.
pub fn is_rotating(k: &StorageKind) -> bool {
    is_rotating_serial(&k.0) || k.0.strip_suffix(ROW_BATCH_MARKER).is_some_and(is_rotating_serial)
}

/// True iff `k` is the linear cache or a batch of linear rows.
pub fn is_plain_kv(k: &StorageKind) -> bool {
    k.0 == KV_PLAIN || k.0.strip_suffix(ROW_BATCH_MARKER) == Some(KV_PLAIN)
}

/// True iff `k` is a known training-only kind ([`TRAINING`], [`PREFIX_SHARED`], [`TRAINING_SSM`]).
pub fn is_training(k: &StorageKind) -> bool {
    k.0 == TRAINING || k.0 == PREFIX_SHARED || k.0 == TRAINING_SSM
}

/// True iff `k` is exactly the recurrent kind [`SSM`].
pub fn is_ssm(k: &StorageKind) -> bool {
    k.0 == SSM
}

/// True iff `k` is one of the known routable attention kinds (training and recurrent kinds are known but never
/// routed here).
pub fn is_known(k: &StorageKind) -> bool {
    k.route().is_ok()
}

impl Storage {
    /// The serial kind string of this storage (`kv:quant:<bits>:<group>`, `kv:rotating-quant:<bits>:<group>`, or
    /// the plain kinds).
    pub(crate) fn serial_kind(&self, max_size: Option<usize>) -> String {
        match (self, max_size) {
            (Storage::Plain, None) => KV_PLAIN.to_string(),
            (Storage::Plain, Some(_)) => ROTATING_PLAIN.to_string(),
            (Storage::Affine(q), None) => format!("{}{}:{}", QUANT_PREFIX, q.bits, q.group),
            (Storage::Affine(q), Some(_)) => format!("{}{}:{}", ROTATING_QUANT_PREFIX, q.bits, q.group),
        }
    }
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
    fn delayed_kinds_parse_strictly_and_route_nowhere() {
        for (s, w, b, g, st) in [
            ("kv:delayed-quant:4:32:8", None, 4, 32, Some(8)),
            ("kv:delayed-quant:8:128:0", None, 8, 128, Some(0)),
            ("kv:delayed-rotating-quant:6:3:64:inf", Some(6), 3, 64, None),
            ("kv:delayed-rotating-quant:1:2:32:17", Some(1), 2, 32, Some(17)),
        ] {
            let k = StorageKind::new(s);
            let d = parse_delayed(&k).unwrap_or_else(|| panic!("{s}"));
            assert_eq!(d, DelayedKind { max_size: w, quant: QuantSpec { bits: b, group: g }, start: st });
            assert_eq!(d.kind(), k);
            assert!(is_delayed(&k) && !is_known(&k) && !is_quantized(&k) && !is_row_batch(&k), "{s}");
            assert!(matches!(k.route(), Err(CacheError::UnknownStorageKind { .. })));
        }
        for bad in [
            "kv:delayed-quant:4:32",
            "kv:delayed-quant:4:32:8:1",
            "kv:delayed-quant:7:32:8",
            "kv:delayed-quant:4:48:8",
            "kv:delayed-quant:04:32:8",
            "kv:delayed-quant:4:32:08",
            "kv:delayed-quant:4:32:-1",
            "kv:delayed-quant:4:32:Inf",
            "kv:delayed-quant:4:32:8+row-batch",
            "kv:delayed-rotating-quant:0:4:32:8",
            "kv:delayed-rotating-quant:4:32:8",
            "kv:delayed-rotating-quant:06:4:32:8",
            "kv:delayed-quant::32:8",
        ] {
            assert!(!is_delayed(&StorageKind::new(bad)), "{bad}");
        }
    }

    #[test]
    fn lego_kinds_parse_strictly_and_are_not_rows_kinds() {
        for (s, w, st) in [
            ("kv:bf16-first-quant:4:32:8", None, Some(8)),
            ("kv:bf16-first-quant:4:32:inf", None, None),
            ("kv:bf16-first-rotating-quant:6:4:32:0", Some(6), Some(0)),
        ] {
            let k = StorageKind::new(s);
            let d = parse_bf16_first(&k).unwrap_or_else(|| panic!("{s}"));
            assert_eq!(d, DelayedKind { max_size: w, quant: QuantSpec { bits: 4, group: 32 }, start: st });
            assert_eq!(d.lego_kind(), k);
            assert!(is_bf16_first(&k) && !is_delayed(&k) && !is_known(&k) && !is_quantized(&k), "{s}");
            assert!(!is_bf16_first(&d.kind()), "{s}: the rows' kind is not the lego's");
        }
        for bad in [
            "kv:bf16-first-quant:4:32",
            "kv:bf16-first-quant:4:32:8:1",
            "kv:bf16-first-quant:7:32:8",
            "kv:bf16-first-quant:4:32:08",
            "kv:bf16-first-quant:4:32:8+row-batch",
            "kv:bf16-first-rotating-quant:0:4:32:8",
            "kv:bf16-first-rotating-quant:4:32:8",
            "kv:bf16-first-rotating-quant:06:4:32:8",
            "kv:bf16-first-quant-rotating:6:4:32:8",
        ] {
            assert!(!is_bf16_first(&StorageKind::new(bad)), "{bad}");
        }
    }

    #[test]
    fn quantized_kinds_route_and_parse_strictly() {
        let q = QuantSpec { bits: 5, group: 32 };
        let rot = StorageKind::serial_of(Some(8), Storage::Affine(q));
        assert_eq!(rot.as_str(), "kv:rotating-quant:5:32");
        assert_eq!(rot.route(), Ok(KindRoute::Serial { rotating: true }));
        assert_eq!(rot.storage(), Ok(Storage::Affine(q)));
        let lin = StorageKind::row_batch_of(None, Storage::Affine(q));
        assert_eq!(lin.as_str(), "kv:quant:5:32+row-batch");
        assert_eq!(lin.route(), Ok(KindRoute::RowBatch { rotating: false }));
        assert!(is_quantized(&lin) && is_linear(&lin) && !is_plain_kv(&lin) && !is_rotating(&lin));
        assert_eq!(lin.inner().unwrap().as_str(), "kv:quant:5:32");
        assert_eq!(StorageKind::serial(None).storage(), Ok(Storage::Plain));
        for bad in
            ["kv:quant:7:32", "kv:quant:4:16", "kv:quant:04:32", "kv:quant:4", "kv:quant:4:32:1", "kv:quant:4:32+x"]
        {
            let k = StorageKind::new(bad);
            assert!(!is_known(&k) && !is_quantized(&k), "{bad}");
            assert_eq!(k.storage(), Err(CacheError::UnknownStorageKind { kind: bad.to_string() }));
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
        for kind in [TRAINING, PREFIX_SHARED, TRAINING_SSM] {
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

    /// `is_ssm` is exactly the recurrent kind: not the training SSM kind, not an attention kind, not a near miss
    /// (hybrid sets ask it first; cargo-mutants' `is_ssm -> true` survivor).
    #[test]
    fn is_ssm_is_exactly_the_recurrent_kind() {
        assert!(is_ssm(&StorageKind::new(SSM)));
        let others = [TRAINING_SSM, TRAINING, PREFIX_SHARED, "ssm+row-batch", "SSM", "", "kv-plain"];
        for other in others.into_iter().map(StorageKind::new).chain([
            StorageKind::serial(None),
            StorageKind::serial(Some(4)),
            StorageKind::row_batch(Some(4)),
        ]) {
            assert!(!is_ssm(&other), "{other:?}");
        }
    }
}
