//! kvsim's own cache file format (version 1). kvsim's design; not another engine's format.
//!
//! ```text
//! offset  size  content
//! 0       8     magic  b"KVSIMPC\n"
//! 8       4     format version, u32 little endian (1)
//! 12      8     header length H, u64 little endian (at most 64 MiB)
//! 20      32    sha256 of the header bytes
//! 52      H     header: UTF-8 JSON (FileHeader)
//! 52 + H  ...   data: the tensors' bytes, back to back in header order, nothing before, between or after
//! ```
//!
//! The header lists the caches in order; each has its storage kind, its codec state, its reuse floor and its tensors
//! (name, dtype, shape, byte offset within the data, byte count, sha256). Reading checks, in this order: magic,
//! version, header length against the file, header checksum, JSON, every tensor's extent (contiguous, in order,
//! covering the data exactly, byte count = shape x itemsize), every tensor's sha256, and finally each codec's
//! validation of the state. Any failure is a typed [`PersistError`]; nothing is half-loaded.
//!
//! Writing is atomic ([`write_atomic`]): a temporary file in the same folder, locked by its write, `fsync`, `rename`
//! over the target, `fsync` of the folder. A failed or killed write leaves the previous file at the path intact (the
//! tests stop a write after every byte of a file of each format, and kill writing processes); a killed write's
//! temporary file is removed by the next successful write to the path.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::codec::{Entry, Persisted, Registry};
use super::error::{PersistError, Result};
use super::tensor::{nbytes_of, HostTensor, TensorDtype};

/// The first 8 bytes of every kvsim cache file.
pub const MAGIC: &[u8; 8] = b"KVSIMPC\n";
/// The format version this build writes and reads.
pub const FORMAT_VERSION: u32 = 1;
/// The largest header accepted (a corrupt length must not allocate gigabytes).
pub const MAX_HEADER: u64 = 64 << 20;
const PREFIX: usize = 8 + 4 + 8 + 32;

/// One tensor's slot in the data section.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorSlot {
    pub name: String,
    pub dtype: TensorDtype,
    pub shape: Vec<usize>,
    pub offset: usize,
    pub nbytes: usize,
    pub sha256: String,
}

/// One cache of the file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LayerHeader {
    pub storage_kind: String,
    pub state: serde_json::Value,
    pub minimum_reusable_offset: usize,
    pub tensors: Vec<TensorSlot>,
}

/// The JSON header.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileHeader {
    pub format: String,
    pub metadata: BTreeMap<String, String>,
    pub layers: Vec<LayerHeader>,
}

/// A decoded kvsim file at the entry level (before the codecs build caches).
#[derive(Debug, Clone, PartialEq)]
pub struct KvsimFile {
    pub metadata: BTreeMap<String, String>,
    pub entries: Vec<Entry>,
}

fn hex(d: &[u8]) -> String {
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// The file bytes of these entries.
pub fn encode_entries(metadata: &BTreeMap<String, String>, entries: &[Entry]) -> Result<Vec<u8>> {
    let mut data = Vec::new();
    let mut layers = Vec::with_capacity(entries.len());
    for e in entries {
        let mut tensors = Vec::with_capacity(e.tensors.len());
        for (name, t) in &e.tensors {
            tensors.push(TensorSlot {
                name: name.clone(),
                dtype: t.dtype,
                shape: t.shape.clone(),
                offset: data.len(),
                nbytes: t.data.len(),
                sha256: hex(&Sha256::digest(&t.data)),
            });
            data.extend_from_slice(&t.data);
        }
        layers.push(LayerHeader {
            storage_kind: e.storage_kind.clone(),
            state: e.state.clone(),
            minimum_reusable_offset: e.minimum_reusable_offset,
            tensors,
        });
    }
    let header = FileHeader { format: "kvsim-cache".into(), metadata: metadata.clone(), layers };
    let hbytes = serde_json::to_vec(&header).map_err(|e| PersistError::malformed(e.to_string()))?;
    let mut out = Vec::with_capacity(PREFIX + hbytes.len() + data.len());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&FORMAT_VERSION.to_le_bytes());
    out.extend_from_slice(&(hbytes.len() as u64).to_le_bytes());
    out.extend_from_slice(&Sha256::digest(&hbytes));
    out.extend_from_slice(&hbytes);
    out.extend_from_slice(&data);
    Ok(out)
}

/// Where a kvsim file's parts lie in `bytes`, from its fixed prefix alone (nothing is verified): the prefix
/// (magic, version, header length, header sha256), the header, and the tensor data. `None` when `bytes` is not a
/// kvsim file or is shorter than its prefix; a header length past the end is cut to it.
pub fn regions(bytes: &[u8]) -> Option<[std::ops::Range<usize>; 3]> {
    if !is_kvsim(bytes) || bytes.len() < PREFIX {
        return None;
    }
    let hlen = u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes"));
    let data = usize::try_from(hlen).map_or(bytes.len(), |h| PREFIX.saturating_add(h).min(bytes.len()));
    Some([0..PREFIX, PREFIX..data, data..bytes.len()])
}

/// Whether `bytes` start like a kvsim cache file.
pub fn is_kvsim(bytes: &[u8]) -> bool {
    bytes.starts_with(MAGIC)
}

/// Parses and verifies the file structure and every checksum (no MLX; the codecs' validation comes later).
pub fn decode_entries(bytes: &[u8]) -> Result<KvsimFile> {
    if bytes.len() < MAGIC.len() || !is_kvsim(bytes) {
        return Err(PersistError::BadMagic { what: "no kvsim cache magic".into() });
    }
    if bytes.len() < PREFIX {
        return Err(PersistError::Truncated {
            what: format!("{} bytes, the fixed prefix needs {PREFIX}", bytes.len()),
        });
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
    if version != FORMAT_VERSION {
        return Err(PersistError::UnsupportedVersion { found: version, supported: FORMAT_VERSION });
    }
    let hlen = u64::from_le_bytes(bytes[12..20].try_into().expect("8 bytes"));
    if hlen > MAX_HEADER {
        return Err(PersistError::malformed(format!("header length {hlen} exceeds {MAX_HEADER}")));
    }
    let hlen = hlen as usize;
    let rest = &bytes[PREFIX..];
    if rest.len() < hlen {
        return Err(PersistError::Truncated { what: format!("header of {hlen} bytes, {} present", rest.len()) });
    }
    let (hbytes, data) = rest.split_at(hlen);
    if Sha256::digest(hbytes).as_slice() != &bytes[20..52] {
        return Err(PersistError::HeaderChecksum);
    }
    let header: FileHeader =
        serde_json::from_slice(hbytes).map_err(|e| PersistError::malformed(format!("header JSON: {e}")))?;
    if header.format != "kvsim-cache" {
        return Err(PersistError::malformed(format!("header format {:?}", header.format)));
    }
    let mut cursor = 0usize;
    let mut entries = Vec::with_capacity(header.layers.len());
    for (li, layer) in header.layers.into_iter().enumerate() {
        let mut tensors = Vec::with_capacity(layer.tensors.len());
        for slot in layer.tensors {
            let name = format!("layer {li} tensor {}", slot.name);
            let want =
                nbytes_of(slot.dtype, &slot.shape).ok_or_else(|| PersistError::shape(&name, "shape overflows"))?;
            if want != slot.nbytes {
                return Err(PersistError::shape(&name, format!("{} bytes for shape {:?}", slot.nbytes, slot.shape)));
            }
            if slot.offset != cursor {
                return Err(PersistError::malformed(format!(
                    "{name} at data offset {}, expected {cursor}",
                    slot.offset
                )));
            }
            let end = cursor.checked_add(slot.nbytes).ok_or_else(|| PersistError::malformed("offset overflow"))?;
            if end > data.len() {
                return Err(PersistError::Truncated {
                    what: format!("{name} ends at {end}, data has {} bytes", data.len()),
                });
            }
            let raw = &data[cursor..end];
            // Mutation hook `Mutant::KvsimSkipsTensorChecksum`: the check skipped.
            if !kvsim_cache::fault!(KvsimSkipsTensorChecksum) && hex(&Sha256::digest(raw)) != slot.sha256 {
                return Err(PersistError::TensorChecksum { name });
            }
            tensors.push((slot.name.clone(), HostTensor::new(&name, slot.dtype, slot.shape, raw.to_vec())?));
            cursor = end;
        }
        entries.push(Entry {
            storage_kind: layer.storage_kind,
            state: layer.state,
            tensors,
            minimum_reusable_offset: layer.minimum_reusable_offset,
        });
    }
    if cursor != data.len() {
        return Err(PersistError::malformed(format!("{} trailing bytes after the last tensor", data.len() - cursor)));
    }
    Ok(KvsimFile { metadata: header.metadata, entries })
}

/// The file bytes of these caches (each routed to its kind's codec). Guarantee: every layer's entry is made from
/// that layer's cache alone (its own state, floor and tensors), so layers of one file that hold different offsets,
/// windows or trim histories come back each as it was (checked by the simulator's set of differing layers).
pub fn encode(registry: &Registry, metadata: &BTreeMap<String, String>, caches: &[Persisted]) -> Result<Vec<u8>> {
    let mut entries = caches.iter().map(|p| registry.encode(p)).collect::<Result<Vec<_>>>()?;
    if kvsim_cache::fault!(FirstLayerBookkeeping) {
        // Mutation hook `Mutant::FirstLayerBookkeeping`: each layer's state taken from the first of its kind.
        for i in 1..entries.len() {
            if let Some(j) = (0..i).find(|&j| entries[j].storage_kind == entries[i].storage_kind) {
                entries[i].state = entries[j].state.clone();
            }
        }
    }
    encode_entries(metadata, &entries)
}

/// The caches of a file: structure, checksums, then each codec's validation.
pub fn decode(registry: &Registry, bytes: &[u8]) -> Result<(BTreeMap<String, String>, Vec<Persisted>)> {
    let f = decode_entries(bytes)?;
    let caches = f.entries.iter().map(|e| registry.decode(e)).collect::<Result<Vec<_>>>()?;
    Ok((f.metadata, caches))
}

/// Writes `bytes` to `path` atomically: a temporary file beside it (locked by this write until its rename), `fsync`,
/// `rename` over `path`, `fsync` of the folder. On any error the temporary file is removed and whatever was at `path`
/// before is untouched. A write interrupted harder (the process killed) leaves its temporary file behind, unlocked:
/// the next successful write to `path` removes it. (A write that starts while another removes such files may have
/// its temporary file removed under it: its rename then fails with a typed error, and `path` is untouched.)
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    write_atomic_with(path, bytes, |f, b| f.write_all(b))
}

/// [`write_atomic`], with `write` putting the bytes into the (locked, empty) temporary file: the tests hand it
/// writers that fail or stop after `n` bytes.
pub(crate) fn write_atomic_with(
    path: &Path,
    bytes: &[u8],
    write: impl FnOnce(&mut std::fs::File, &[u8]) -> std::io::Result<()>,
) -> Result<()> {
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => std::path::PathBuf::from("."),
    };
    let fname = path.file_name().ok_or_else(|| PersistError::Io {
        path: path.display().to_string(),
        kind: std::io::ErrorKind::InvalidInput,
        message: "not a file path".into(),
    })?;
    let prefix = temporary_prefix(&fname.to_string_lossy());
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!("{prefix}{}.{n}", std::process::id()));
    let res = (|| -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        // Held until the rename: a write in progress is never taken for an interrupted one.
        f.lock()?;
        write(&mut f, bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)?;
        drop(f);
        if let Ok(d) = std::fs::File::open(&dir) {
            let _ = d.sync_all();
        }
        Ok(())
    })();
    if let Err(e) = res {
        let _ = std::fs::remove_file(&tmp);
        return Err(PersistError::io(path, e));
    }
    remove_interrupted(&dir, &prefix);
    Ok(())
}

/// The name prefix of the temporary files of writes to a file named `fname`.
pub(crate) fn temporary_prefix(fname: &str) -> String {
    format!(".{fname}.tmp.")
}

/// Removes the temporary files of `prefix` in `dir` that no write holds: each write locks its own until the rename,
/// so one whose lock can be taken belongs to a write that was interrupted.
fn remove_interrupted(dir: &Path, prefix: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        if !e.file_name().to_string_lossy().starts_with(prefix) {
            continue;
        }
        let p = e.path();
        if let Ok(f) = std::fs::File::open(&p) {
            if f.try_lock().is_ok() {
                let _ = std::fs::remove_file(&p);
            }
        }
    }
}

/// Saves caches to a kvsim file at `path` (atomically).
pub fn save(path: &Path, registry: &Registry, metadata: &BTreeMap<String, String>, caches: &[Persisted]) -> Result<()> {
    let bytes = encode(registry, metadata, caches)?;
    write_atomic(path, &bytes)
}

/// Loads the caches of a kvsim file.
pub fn load(path: &Path, registry: &Registry) -> Result<(BTreeMap<String, String>, Vec<Persisted>)> {
    let bytes = std::fs::read(path).map_err(|e| PersistError::io(path, e))?;
    decode(registry, &bytes)
}
