//! `kvsim cache inspect` and `kvsim cache convert`: a cache file of either format, described or converted.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

use super::codec::{Persisted, Registry};
use super::error::{PersistError, Result};
use super::kvsim;
use super::mlxlm::{self, MlxLayer};
use super::tensor::HostTensor;

/// The two file formats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Format {
    /// kvsim's own format ([`super::kvsim`]).
    Kvsim,
    /// mlx-lm 0.32.2 prompt-cache safetensors ([`super::mlxlm`]).
    MlxLm,
}

impl std::fmt::Display for Format {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Format::Kvsim => "kvsim",
            Format::MlxLm => "mlx-lm",
        })
    }
}

impl std::str::FromStr for Format {
    type Err = String;

    /// `kvsim` or `mlx-lm` (the command line's `--format`).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "kvsim" => Ok(Format::Kvsim),
            "mlx-lm" => Ok(Format::MlxLm),
            _ => Err(format!("unknown format {s:?} (expected kvsim or mlx-lm)")),
        }
    }
}

/// One tensor of a layer.
#[derive(Debug, Clone, Serialize)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: String,
    pub shape: Vec<usize>,
    /// What the array most likely is, where its name does not say (an `ArraysCache` stores bare arrays):
    /// [`arrays_roles`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<String>,
}

/// One layer (cache object) of a file.
#[derive(Debug, Clone, Serialize)]
pub struct LayerInfo {
    /// The storage kind (kvsim files) or the class name (mlx-lm files).
    pub kind: String,
    /// Positions ever written: a number, or one per row for batches.
    pub offset: serde_json::Value,
    /// `minimum_reusable_offset` (kvsim files; mlx-lm files have none).
    pub floor: Option<usize>,
    pub tensors: Vec<TensorInfo>,
    /// The scalar fields (mlx-lm) or the codec state (kvsim).
    pub fields: serde_json::Value,
    /// The kvsim storage kind this layer continues in, when kvsim has a layout for it (mlx-lm files).
    pub kvsim_kind: Option<String>,
    /// Sub-caches of a `CacheList`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub children: Vec<LayerInfo>,
    /// mlx-lm files: where what the file does not store came from (an `ArraysCache`'s offsets, an empty layer's
    /// K/V spec), or why kvsim has no layout for the layer.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// A whole file.
#[derive(Debug, Clone, Serialize)]
pub struct Inspection {
    pub format: Format,
    pub version: Option<u32>,
    pub bytes: usize,
    pub metadata: BTreeMap<String, String>,
    pub layers: Vec<LayerInfo>,
}

/// Which format `bytes` are in, else [`PersistError::BadMagic`].
pub fn detect(bytes: &[u8]) -> Result<Format> {
    if kvsim::is_kvsim(bytes) {
        Ok(Format::Kvsim)
    } else if mlxlm::looks_like_safetensors(bytes) {
        Ok(Format::MlxLm)
    } else if bytes.len() < 9 {
        Err(PersistError::Truncated { what: format!("{} bytes: not even a format prefix", bytes.len()) })
    } else {
        Err(PersistError::BadMagic { what: "neither a kvsim cache file nor a safetensors file".into() })
    }
}

fn tinfo(name: &str, t: &HostTensor) -> TensorInfo {
    TensorInfo { name: name.to_string(), dtype: t.dtype.to_string(), shape: t.shape.clone(), role: None }
}

/// What each array of an mlx-lm `ArraysCache` most likely is, from its rank and shape alone: the class stores bare
/// arrays (`cache.0`, `cache.1`, ...) and no layer name, so this is a reading of the shapes, worded as one. The
/// layouts mlx-lm 0.32.2's layers keep there: a causal-conv tail `[B, K-1, C]` (Mamba, Mamba2, gated DeltaNet,
/// LFM2's short conv, ...), a Mamba layer's selective-scan state `[B, D, N]`, a per-head matrix state `[B, H, a, b]`
/// (a gated-DeltaNet state `[B, Hv, Dv, Dk]`, a Mamba2 SSM state `[B, H, Dh, N]`, a linear-attention state), a
/// per-row vector `[B, D]` (an RG-LRU state). `deltanet`: the pair maps onto kvsim's `ssm` layout
/// ([`mlxlm::ssm_spec_of`]). One entry per array, `None` where unset.
pub fn arrays_roles(cache: &[Option<HostTensor>], deltanet: bool) -> Vec<String> {
    cache
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let Some(t) = t else { return "unset (None: the layer has not written it yet)".to_string() };
            let s = &t.shape;
            match s.len() {
                _ if deltanet && i == 0 => {
                    format!("the gated-DeltaNet conv tail [B, K-1, conv_dim]: kernel K = {}", s[1].saturating_add(1))
                }
                _ if deltanet && i == 1 => {
                    "the gated-DeltaNet recurrent state [B, Hv, Dv, Dk] (read from the shapes: a \
                                             Mamba2 layer whose conv width is H Dh + 2 G N has the same ones)"
                        .to_string()
                }
                0 => "a scalar (no row axis: not a per-row state)".to_string(),
                1 => format!("a vector of {} (no row axis: a per-layer value, or per-row lengths)", s[0]),
                2 => format!(
                    "a per-row vector [B, D] (B = {}, D = {}): a recurrence's hidden state, e.g. RG-LRU",
                    s[0], s[1]
                ),
                3 if s[1] <= 8 && s[1] < s[2] => format!(
                    "a causal-conv tail [B, K-1, C] (kernel K = {}, C = {} channels)",
                    s[1].saturating_add(1),
                    s[2]
                ),
                3 => format!(
                    "a per-row matrix state [B, D, N] (D = {}, N = {}): a Mamba layer's selective-scan state",
                    s[1], s[2]
                ),
                4 => format!(
                    "a per-head matrix state [B, H, {}, {}] (H = {}): a Mamba2 SSM state [B, H, Dh, N] or a \
                     linear-attention / DeltaNet state [B, Hv, Dv, Dk]",
                    s[2], s[3], s[1]
                ),
                r => format!("an array of rank {r} (no mlx-lm 0.32.2 layer keeps one of this rank)"),
            }
        })
        .collect()
}

/// What an mlx-lm layer at path `at` needs beyond its own fields ([`mlxlm::file_hints`]) and where it came from.
struct FileHints {
    hints: mlxlm::Hints,
    sources: BTreeMap<String, String>,
}

fn mlx_info(l: &MlxLayer, at: &str, h: &FileHints) -> Result<LayerInfo> {
    use serde_json::json;
    // An ArraysCache's arrays, first (each with its likely role), then the tensors every class names.
    let mut arrays = Vec::new();
    let mut tensors = Vec::new();
    let mut push = |n: &str, t: &Option<HostTensor>| {
        if let Some(t) = t {
            tensors.push(tinfo(n, t));
        }
    };
    let (offset, fields) = match l {
        MlxLayer::KvCache { keys, values, offset } => {
            push("keys", keys);
            push("values", values);
            (json!(offset), json!({}))
        }
        MlxLayer::ConcatenateKvCache { keys, values } => {
            push("keys", keys);
            push("values", values);
            (json!(keys.as_ref().and_then(|k| k.shape.get(2))), json!({}))
        }
        MlxLayer::RotatingKvCache { keys, values, offset, keep, max_size, idx } => {
            push("keys", keys);
            push("values", values);
            (json!(offset), json!({"keep": keep, "max_size": max_size, "_idx": idx}))
        }
        MlxLayer::QuantizedKvCache { keys, values, offset, group_size, bits } => {
            for (p, q) in [("keys", keys), ("values", values)] {
                if let Some(q) = q {
                    for (n, t) in ["packed", "scales", "biases"].iter().zip(q.iter()) {
                        push(&format!("{p}.{n}"), &Some(t.clone()));
                    }
                }
            }
            (json!(offset), json!({"group_size": group_size, "bits": bits}))
        }
        MlxLayer::ArraysCache { cache, left_padding, lengths } => {
            let roles = arrays_roles(cache, mlxlm::ssm_spec_of(cache).is_ok());
            for (i, (t, role)) in cache.iter().zip(roles).enumerate() {
                match t {
                    Some(t) => arrays.push(TensorInfo { role: Some(role), ..tinfo(&format!("cache.{i}"), t) }),
                    None => arrays.push(TensorInfo {
                        name: format!("cache.{i}"),
                        dtype: "None".into(),
                        shape: vec![],
                        role: Some(role),
                    }),
                }
            }
            push("left_padding", left_padding);
            push("lengths", lengths);
            let lp = left_padding.as_ref().map(|t| t.to_i64s("left_padding")).transpose()?;
            let ln = lengths.as_ref().map(|t| t.to_i64s("lengths")).transpose()?;
            let offset = h.hints.ssm_offsets.get(at).map_or(serde_json::Value::Null, |o| json!(o));
            (offset, json!({"left_padding": lp, "lengths": ln}))
        }
        MlxLayer::BatchKvCache { keys, values, offset, left_padding, idx } => {
            push("keys", keys);
            push("values", values);
            (
                json!(offset.to_i64s("offset")?),
                json!({"left_padding": left_padding.to_i64s("left_padding")?, "_idx": idx}),
            )
        }
        MlxLayer::BatchRotatingKvCache { keys, values, offset, left_padding, max_size, offset_total, idx, rotated } => {
            push("keys", keys);
            push("values", values);
            (
                json!(offset.to_i64s("offset")?),
                json!({"left_padding": left_padding.to_i64s("left_padding")?, "max_size": max_size,
                       "_offset": offset_total, "_idx": idx, "rotated": rotated}),
            )
        }
        MlxLayer::ChunkedKvCache { keys, values, offset, chunk_size, start_position } => {
            push("keys", keys);
            push("values", values);
            (json!(offset), json!({"chunk_size": chunk_size, "start_position": start_position}))
        }
        MlxLayer::CacheList(children) => {
            let kids = children
                .iter()
                .enumerate()
                .map(|(j, c)| mlx_info(c, &format!("{at}.{j}"), h))
                .collect::<Result<Vec<_>>>()?;
            return Ok(LayerInfo {
                kind: l.class_name().into(),
                offset: serde_json::Value::Null,
                floor: None,
                tensors: vec![],
                fields: json!({}),
                kvsim_kind: kvsim_kind_of(l, at, h)?.0,
                children: kids,
                note: None,
            });
        }
    };
    let (kvsim_kind, note) = kvsim_kind_of(l, at, h)?;
    arrays.extend(tensors);
    Ok(LayerInfo {
        kind: l.class_name().into(),
        offset,
        floor: None,
        tensors: arrays,
        fields,
        kvsim_kind,
        children: vec![],
        note,
    })
}

/// The kvsim kind an mlx-lm layer at `at` continues in (`None`: no kvsim layout), and a note: where what the file
/// does not store came from, or why there is no layout. An `ArraysCache` maps to `ssm` by its shapes alone (its
/// offsets are checked when it is loaded).
fn kvsim_kind_of(l: &MlxLayer, at: &str, h: &FileHints) -> Result<(Option<String>, Option<String>)> {
    let from = |what: &str| h.sources.get(at).map(|s| format!("{what} from {s}"));
    let mapped = match l {
        MlxLayer::ArraysCache { cache, lengths, left_padding } => {
            let pending = lengths.is_some()
                || left_padding
                    .as_ref()
                    .map(|t| t.to_i64s("left_padding"))
                    .transpose()?
                    .is_some_and(|v| v.iter().any(|&x| x > 0));
            return Ok(match mlxlm::ssm_spec_of(cache) {
                Ok(_) if pending => (None, Some("no kvsim layout: a right-padded prefill is pending".into())),
                Ok(_) if h.hints.ssm_offsets.contains_key(at) => (Some(kvsim_cache::SSM.to_string()), from("offsets")),
                Ok(_) => (
                    Some(kvsim_cache::SSM.to_string()),
                    Some(
                        "no offsets: an ArraysCache stores none, the file's user metadata has none and no attention \
                         layer decides them (`kvsim cache convert --ssm-offsets N,...`)"
                            .into(),
                    ),
                ),
                // Whatever else the arrays are, the file is well-formed: described, never refused.
                Err(PersistError::Unsupported { what }) => (None, Some(format!("no kvsim layout: {what}"))),
                Err(e) => (None, Some(format!("no kvsim layout: {e}"))),
            });
        }
        MlxLayer::CacheList(children) => {
            for (j, c) in children.iter().enumerate() {
                if kvsim_kind_of(c, &format!("{at}.{j}"), h)?.0.is_none() {
                    return Ok((None, None));
                }
            }
            Ok(kvsim_cache::CACHE_LIST.to_string())
        }
        _ => mlxlm::to_kvsim(l, h.hints.spec_at(at)).map(|c| c.storage_kind().to_string()),
    };
    let empty = h.hints.empty_specs.contains_key(at);
    match mapped {
        Ok(k) => Ok((Some(k), if empty { from("an empty layer's K/V spec") } else { None })),
        Err(PersistError::Unsupported { what }) => Ok((None, Some(format!("no kvsim layout: {what}")))),
        Err(e) => Err(e),
    }
}

/// Reads and fully validates a file (for kvsim files: every checksum and every codec's state validation; for
/// mlx-lm files: the structure of every class, and the kvsim mapping where kvsim has a layout).
pub fn inspect_bytes(bytes: &[u8]) -> Result<Inspection> {
    match detect(bytes)? {
        Format::Kvsim => {
            let f = kvsim::decode_entries(bytes)?;
            let reg = Registry::default();
            let mut layers = Vec::new();
            for e in &f.entries {
                let p = reg.decode(e)?;
                let offset = match &p.cache {
                    super::AnyCache::Serial(c) => serde_json::json!(c.offset()),
                    super::AnyCache::Rows(b) => {
                        serde_json::json!(b.row_states().iter().map(|r| r.ring.offset).collect::<Vec<_>>())
                    }
                    super::AnyCache::Ssm(c) => serde_json::json!(c.offsets()),
                    super::AnyCache::Chunked(c) => serde_json::json!(c.offset()),
                    super::AnyCache::Bf16First(c) => serde_json::json!(c.offset()),
                    super::AnyCache::Paged(p) => {
                        serde_json::json!(p.seqs().map(|(_, s)| s.offset).collect::<Vec<_>>())
                    }
                    super::AnyCache::List(v) => serde_json::json!(v.iter().map(|c| c.offset()).collect::<Vec<_>>()),
                };
                layers.push(LayerInfo {
                    kind: e.storage_kind.clone(),
                    offset,
                    floor: Some(e.minimum_reusable_offset),
                    tensors: e.tensors.iter().map(|(n, t)| tinfo(n, t)).collect(),
                    fields: e.state.clone(),
                    kvsim_kind: Some(e.storage_kind.clone()),
                    children: vec![],
                    note: None,
                });
            }
            Ok(Inspection {
                format: Format::Kvsim,
                version: Some(kvsim::FORMAT_VERSION),
                bytes: bytes.len(),
                metadata: f.metadata,
                layers,
            })
        }
        Format::MlxLm => {
            let f = mlxlm::read(bytes)?;
            let (hints, sources) = mlxlm::file_hints(&f, &mlxlm::Hints::default())?;
            let h = FileHints { hints, sources };
            let layers = f
                .layers
                .iter()
                .enumerate()
                .map(|(i, l)| mlx_info(l, &i.to_string(), &h))
                .collect::<Result<Vec<_>>>()?;
            Ok(Inspection { format: Format::MlxLm, version: None, bytes: bytes.len(), metadata: f.metadata, layers })
        }
    }
}

/// [`inspect_bytes`] of a file.
pub fn inspect_file(path: &Path) -> Result<Inspection> {
    let bytes = std::fs::read(path).map_err(|e| PersistError::io(path, e))?;
    inspect_bytes(&bytes)
}

/// A human-readable description.
pub fn render(i: &Inspection) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let fmt = match i.format {
        Format::Kvsim => format!("kvsim cache file, format version {}", i.version.unwrap_or(0)),
        Format::MlxLm => "mlx-lm prompt-cache file (0.32.2 layout)".to_string(),
    };
    let _ = writeln!(s, "{fmt}, {} bytes, {} layers", i.bytes, i.layers.len());
    for (k, v) in &i.metadata {
        let _ = writeln!(s, "metadata {k} = {v:?}");
    }
    fn layer(s: &mut String, l: &LayerInfo, at: &str) {
        let _ = write!(s, "layer {at}: {} offset {}", l.kind, l.offset);
        if let Some(f) = l.floor {
            let _ = write!(s, " floor {f}");
        }
        if let Some(k) = &l.kvsim_kind {
            let _ = write!(s, " (kvsim {k})");
        }
        let _ = writeln!(s, " {}", l.fields);
        if let Some(n) = &l.note {
            let _ = writeln!(s, "    ({n})");
        }
        for t in &l.tensors {
            let shape = format!("{:?}", t.shape);
            match &t.role {
                Some(r) => {
                    let _ = writeln!(s, "    {:<14} {:<5} {shape:<16} {r}", t.name, t.dtype);
                }
                None => {
                    let _ = writeln!(s, "    {:<14} {:<5} {shape}", t.name, t.dtype);
                }
            }
        }
        for (j, c) in l.children.iter().enumerate() {
            layer(s, c, &format!("{at}.{j}"));
        }
    }
    for (n, l) in i.layers.iter().enumerate() {
        layer(&mut s, l, &n.to_string());
    }
    s
}

/// Reads caches of either format as kvsim layouts (mlx-lm classes without a kvsim layout are
/// [`PersistError::Unsupported`]).
pub fn load_any(bytes: &[u8]) -> Result<(BTreeMap<String, String>, Vec<Persisted>)> {
    load_any_with(bytes, &mlxlm::Hints::default())
}

/// [`load_any`], with a caller's hints for an mlx-lm file first ([`mlxlm::file_hints`]).
pub fn load_any_with(bytes: &[u8], given: &mlxlm::Hints) -> Result<(BTreeMap<String, String>, Vec<Persisted>)> {
    match detect(bytes)? {
        Format::Kvsim => kvsim::decode(&Registry::default(), bytes),
        Format::MlxLm => {
            let f = mlxlm::read(bytes)?;
            let caches = mlxlm::file_to_kvsim_with(&f, given)?.into_iter().map(Persisted::new).collect();
            let mut md = f.metadata;
            // The offsets key belongs to the mlx-lm form (a kvsim file stores the offsets in the codec state).
            md.remove(mlxlm::SSM_OFFSETS_KEY);
            Ok((md, caches))
        }
    }
}

/// The bytes of `caches` in format `to`. mlx-lm files carry no reuse floor: a floor above 0 is refused rather
/// than dropped.
pub fn save_as(to: Format, metadata: &BTreeMap<String, String>, caches: &[Persisted]) -> Result<Vec<u8>> {
    match to {
        Format::Kvsim => kvsim::encode(&Registry::default(), metadata, caches),
        Format::MlxLm => {
            for (i, p) in caches.iter().enumerate() {
                if p.minimum_reusable_offset > 0 {
                    return Err(PersistError::unsupported(format!(
                        "layer {i} has minimum_reusable_offset {}: mlx-lm files cannot carry it",
                        p.minimum_reusable_offset
                    )));
                }
            }
            let caches: Vec<_> = caches.iter().map(|p| p.cache.clone()).collect();
            mlxlm::write(&mlxlm::file_from_kvsim(metadata, &caches)?)
        }
    }
}

/// `kvsim cache convert IN OUT --to FORMAT`: an mlx-lm file to an mlx-lm file is rewritten at the file level (every
/// class, kvsim layout or not); every other conversion goes through kvsim layouts. The output is written
/// atomically.
pub fn convert(input: &Path, output: &Path, to: Format) -> Result<()> {
    convert_with(input, output, to, None)
}

/// [`convert`]; `ssm_offsets`: the per-row offsets of every `ArraysCache` of an mlx-lm file whose offsets neither
/// its metadata nor its attention layers give (a file of recurrent layers only).
pub fn convert_with(input: &Path, output: &Path, to: Format, ssm_offsets: Option<&[usize]>) -> Result<()> {
    let bytes = std::fs::read(input).map_err(|e| PersistError::io(input, e))?;
    let mut given = mlxlm::Hints::default();
    if let (Some(o), Format::MlxLm) = (ssm_offsets, detect(&bytes)?) {
        let f = mlxlm::read(&bytes)?;
        let (found, _) = mlxlm::file_hints(&f, &given)?;
        let mut paths = vec![];
        for (i, l) in f.layers.iter().enumerate() {
            arrays_paths(l, i.to_string(), &mut paths);
        }
        for at in paths.into_iter().filter(|p| !found.ssm_offsets.contains_key(p)) {
            given.ssm_offsets.insert(at, o.to_vec());
        }
    }
    let out = match (detect(&bytes)?, to) {
        (Format::MlxLm, Format::MlxLm) => mlxlm::write(&mlxlm::read(&bytes)?)?,
        _ => {
            let (md, caches) = load_any_with(&bytes, &given)?;
            save_as(to, &md, &caches)?
        }
    };
    kvsim::write_atomic(output, &out)
}

fn arrays_paths(l: &MlxLayer, at: String, out: &mut Vec<String>) {
    match l {
        MlxLayer::ArraysCache { .. } => out.push(at),
        MlxLayer::CacheList(children) => {
            for (j, c) in children.iter().enumerate() {
                arrays_paths(c, format!("{at}.{j}"), out);
            }
        }
        _ => {}
    }
}
