//! mlx-lm prompt-cache files (the format of mlx-lm 0.32.2's `save_prompt_cache` / `load_prompt_cache`,
//! `mlx_lm/models/cache.py`; the full-state layout of mlx-lm PR #1778), read and written through the `safetensors`
//! crate.
//!
//! The layout, as mlx-lm writes it:
//! - tensors are named by dotted index paths into `[c.state for c in cache]` (`"<layer>.<field>[.<sub>...]"`); every
//!   non-array leaf of a state becomes an array and is listed in the `scalars` metadata: an `int` a 0-d I32, a
//!   `bool` a 0-d BOOL, a `float` a 0-d F32 (all `"scalar"`), a `str` an I32 vector of code points (`"string"`),
//!   `None` an empty F32 `[0]` (`"none"`);
//! - the safetensors `__metadata__` is `tree_flatten([user_metadata, class_names, scalars])`: `"0.<key>"` user
//!   metadata, `"1.<i>"` the class name of layer `i`, `"2.0" = ""` (a sentinel), `"2.<j>.0"` / `"2.<j>.1"` the
//!   key and type of the `j`-th converted leaf;
//! - each class's `state` tuple (the key suffix is the field's index):
//!
//! | class | state |
//! |---|---|
//! | `KVCache` | keys, values (the **full allocated buffer**, 256-column steps, zeros past `offset`), offset |
//! | `RotatingKVCache` | keys, values (the ring as laid out), offset, keep, max_size, _idx |
//! | `QuantizedKVCache` | keys = (packed U32, scales, biases), values = (same), offset, group_size, bits |
//! | `ArraysCache` | cache = [arrays or None], left_padding, lengths |
//! | `BatchKVCache` | keys, values, offset (I32 `[B]`), left_padding (I32 `[B]`), _idx |
//! | `BatchRotatingKVCache` | keys, values, offset `[B]`, left_padding `[B]`, max_size, _offset, _idx, rotated (BOOL) |
//! | `ChunkedKVCache` | keys, values, offset, chunk_size, start_position |
//! | `CacheList` | [(sub-state, class name string)] |
//!
//! [`MlxFile`] is the file-level structure of every class above: typed tensors and scalars, read and written
//! faithfully (a file read and written again holds the same tensors, scalars and metadata). Continuing a cache in
//! kvsim needs a kvsim layout: [`to_kvsim`] maps every class onto [`AnyCache`] (`KVCache`, `RotatingKVCache` with
//! keep = 0, `QuantizedKVCache`, `BatchKVCache`, `BatchRotatingKVCache` onto the attention layouts, `ArraysCache`
//! onto `ssm`, `ChunkedKVCache` onto `kv-chunked:<n>`, `CacheList` onto a list); [`from_kvsim`] maps back. What has
//! no kvsim layout (keep > 0, an `ArraysCache` that is not a DeltaNet state or is mid-prefill) is readable,
//! writable and inspectable, and [`to_kvsim`] refuses it with [`PersistError::Unsupported`]. An `ArraysCache`
//! stores no offsets: they travel in the user metadata ([`SSM_OFFSETS_KEY`]).
//!
//! mlx-lm 0.32.2's own load bugs (mlx-lm 0.32.2 `cache.py`) and what kvsim does instead:
//! - a loaded `BatchKVCache` has no `_right_padding` (so `finalize()` raises) and a loaded `BatchRotatingKVCache`
//!   has no `_lengths` (so every update raises): the file format does not carry a pending right-padded prefill.
//!   kvsim loads such files as finalized batches (which is what they are once written: `state` holds no pending
//!   padding) and refuses to *write* a batch with a pending prefill ([`PersistError::Unsupported`]), since mlx-lm
//!   could not restore it;
//! - `rotated` is a BOOL scalar in 0.32.2 (older files wrote strings, which Python reads back truthy); kvsim reads it
//!   only as a 0-d BOOL or integer and refuses anything else.

use std::collections::{BTreeMap, HashMap};

use safetensors::SafeTensors;

use super::codec::AnyCache;
use super::error::{PersistError, Result};
use super::tensor::{HostTensor, TensorDtype};
use kvsim_cache::{
    ChunkedKvCache, KvDtype, KvSpec, QuantSpec, QuantizedKvCache, RingState, RowBatch, RowState, SerialCache, SsmCache,
    SsmSpec, Storage,
};

/// The file-level leaf of a state tree.
#[derive(Debug, Clone, PartialEq)]
pub enum Leaf {
    Tensor(HostTensor),
    Int(i64),
    Bool(bool),
    Float(f64),
    Str(String),
    None,
}

/// A state tree (mlx's `tree_unflatten` of the dotted keys).
#[derive(Debug, Clone, PartialEq)]
pub enum Node {
    Leaf(Leaf),
    List(Vec<Node>),
}

/// One mlx-lm cache object, at the file level.
#[derive(Debug, Clone, PartialEq)]
pub enum MlxLayer {
    KvCache {
        keys: Option<HostTensor>,
        values: Option<HostTensor>,
        offset: i64,
    },
    RotatingKvCache {
        keys: Option<HostTensor>,
        values: Option<HostTensor>,
        offset: i64,
        keep: i64,
        max_size: i64,
        idx: i64,
    },
    QuantizedKvCache {
        keys: Option<[HostTensor; 3]>,
        values: Option<[HostTensor; 3]>,
        offset: i64,
        group_size: i64,
        bits: i64,
    },
    ArraysCache {
        cache: Vec<Option<HostTensor>>,
        left_padding: Option<HostTensor>,
        lengths: Option<HostTensor>,
    },
    BatchKvCache {
        keys: Option<HostTensor>,
        values: Option<HostTensor>,
        offset: HostTensor,
        left_padding: HostTensor,
        idx: i64,
    },
    BatchRotatingKvCache {
        keys: Option<HostTensor>,
        values: Option<HostTensor>,
        offset: HostTensor,
        left_padding: HostTensor,
        max_size: i64,
        offset_total: i64,
        idx: i64,
        rotated: bool,
    },
    ChunkedKvCache {
        keys: Option<HostTensor>,
        values: Option<HostTensor>,
        offset: i64,
        chunk_size: i64,
        start_position: i64,
    },
    CacheList(Vec<MlxLayer>),
}

/// An mlx-lm prompt-cache file: user metadata and one cache object per layer.
#[derive(Debug, Clone, PartialEq)]
pub struct MlxFile {
    pub metadata: BTreeMap<String, String>,
    pub layers: Vec<MlxLayer>,
}

impl MlxLayer {
    /// mlx-lm's class name.
    pub fn class_name(&self) -> &'static str {
        match self {
            MlxLayer::KvCache { .. } => "KVCache",
            MlxLayer::RotatingKvCache { .. } => "RotatingKVCache",
            MlxLayer::QuantizedKvCache { .. } => "QuantizedKVCache",
            MlxLayer::ArraysCache { .. } => "ArraysCache",
            MlxLayer::BatchKvCache { .. } => "BatchKVCache",
            MlxLayer::BatchRotatingKvCache { .. } => "BatchRotatingKVCache",
            MlxLayer::ChunkedKvCache { .. } => "ChunkedKVCache",
            MlxLayer::CacheList(_) => "CacheList",
        }
    }

    /// The state tree exactly as mlx-lm's `state` property returns it.
    fn to_node(&self) -> Node {
        let t = |x: &HostTensor| Node::Leaf(Leaf::Tensor(x.clone()));
        let ot = |x: &Option<HostTensor>| x.as_ref().map_or(Node::Leaf(Leaf::None), t);
        let i = |x: i64| Node::Leaf(Leaf::Int(x));
        let q = |x: &Option<[HostTensor; 3]>| match x {
            Some(a) => Node::List(a.iter().map(t).collect()),
            None => Node::Leaf(Leaf::None),
        };
        match self {
            MlxLayer::KvCache { keys, values, offset } => Node::List(vec![ot(keys), ot(values), i(*offset)]),
            MlxLayer::RotatingKvCache { keys, values, offset, keep, max_size, idx } => {
                Node::List(vec![ot(keys), ot(values), i(*offset), i(*keep), i(*max_size), i(*idx)])
            }
            MlxLayer::QuantizedKvCache { keys, values, offset, group_size, bits } => {
                Node::List(vec![q(keys), q(values), i(*offset), i(*group_size), i(*bits)])
            }
            MlxLayer::ArraysCache { cache, left_padding, lengths } => {
                Node::List(vec![Node::List(cache.iter().map(ot).collect()), ot(left_padding), ot(lengths)])
            }
            MlxLayer::BatchKvCache { keys, values, offset, left_padding, idx } => {
                Node::List(vec![ot(keys), ot(values), t(offset), t(left_padding), i(*idx)])
            }
            MlxLayer::BatchRotatingKvCache {
                keys,
                values,
                offset,
                left_padding,
                max_size,
                offset_total,
                idx,
                rotated,
            } => Node::List(vec![
                ot(keys),
                ot(values),
                t(offset),
                t(left_padding),
                i(*max_size),
                i(*offset_total),
                i(*idx),
                Node::Leaf(Leaf::Bool(*rotated)),
            ]),
            MlxLayer::ChunkedKvCache { keys, values, offset, chunk_size, start_position } => {
                Node::List(vec![ot(keys), ot(values), i(*offset), i(*chunk_size), i(*start_position)])
            }
            MlxLayer::CacheList(children) => Node::List(
                children
                    .iter()
                    .map(|c| Node::List(vec![c.to_node(), Node::Leaf(Leaf::Str(c.class_name().to_string()))]))
                    .collect(),
            ),
        }
    }

    /// The cache object of class `class` from its state tree (mlx-lm's `from_state`), every field typed.
    fn from_node(class: &str, node: &Node, at: &str) -> Result<Self> {
        let f = fields(node, at)?;
        let want = |n: usize| -> Result<()> {
            if f.len() == n {
                Ok(())
            } else {
                Err(PersistError::malformed(format!("{class} at {at}: {} state fields, expected {n}", f.len())))
            }
        };
        let p = |k: usize| format!("{at}.{k}");
        Ok(match class {
            "KVCache" => {
                want(3)?;
                MlxLayer::KvCache {
                    keys: opt_tensor(f[0], &p(0))?,
                    values: opt_tensor(f[1], &p(1))?,
                    offset: int(f[2], &p(2))?,
                }
            }
            "RotatingKVCache" => {
                want(6)?;
                MlxLayer::RotatingKvCache {
                    keys: opt_tensor(f[0], &p(0))?,
                    values: opt_tensor(f[1], &p(1))?,
                    offset: int(f[2], &p(2))?,
                    keep: int(f[3], &p(3))?,
                    max_size: int(f[4], &p(4))?,
                    idx: int(f[5], &p(5))?,
                }
            }
            "QuantizedKVCache" => {
                want(5)?;
                MlxLayer::QuantizedKvCache {
                    keys: triple(f[0], &p(0))?,
                    values: triple(f[1], &p(1))?,
                    offset: int(f[2], &p(2))?,
                    group_size: int(f[3], &p(3))?,
                    bits: int(f[4], &p(4))?,
                }
            }
            "ArraysCache" => {
                want(3)?;
                let cache = fields(f[0], &p(0))?
                    .iter()
                    .enumerate()
                    .map(|(j, n)| opt_tensor(n, &format!("{at}.0.{j}")))
                    .collect::<Result<_>>()?;
                MlxLayer::ArraysCache {
                    cache,
                    left_padding: opt_tensor(f[1], &p(1))?,
                    lengths: opt_tensor(f[2], &p(2))?,
                }
            }
            "BatchKVCache" => {
                want(5)?;
                MlxLayer::BatchKvCache {
                    keys: opt_tensor(f[0], &p(0))?,
                    values: opt_tensor(f[1], &p(1))?,
                    offset: tensor(f[2], &p(2))?,
                    left_padding: tensor(f[3], &p(3))?,
                    idx: int(f[4], &p(4))?,
                }
            }
            "BatchRotatingKVCache" => {
                want(8)?;
                MlxLayer::BatchRotatingKvCache {
                    keys: opt_tensor(f[0], &p(0))?,
                    values: opt_tensor(f[1], &p(1))?,
                    offset: tensor(f[2], &p(2))?,
                    left_padding: tensor(f[3], &p(3))?,
                    max_size: int(f[4], &p(4))?,
                    offset_total: int(f[5], &p(5))?,
                    idx: int(f[6], &p(6))?,
                    rotated: boolean(f[7], &p(7))?,
                }
            }
            "ChunkedKVCache" => {
                want(5)?;
                MlxLayer::ChunkedKvCache {
                    keys: opt_tensor(f[0], &p(0))?,
                    values: opt_tensor(f[1], &p(1))?,
                    offset: int(f[2], &p(2))?,
                    chunk_size: int(f[3], &p(3))?,
                    start_position: int(f[4], &p(4))?,
                }
            }
            "CacheList" => {
                let mut children = Vec::with_capacity(f.len());
                for (j, pair) in f.iter().enumerate() {
                    let at = format!("{at}.{j}");
                    let pf = fields(pair, &at)?;
                    if pf.len() != 2 {
                        return Err(PersistError::malformed(format!("CacheList entry {at}: expected (state, class)")));
                    }
                    let Node::Leaf(Leaf::Str(c)) = pf[1] else {
                        return Err(PersistError::malformed(format!(
                            "CacheList entry {at}.1: class name is not a string"
                        )));
                    };
                    children.push(MlxLayer::from_node(c, pf[0], &format!("{at}.0"))?);
                }
                MlxLayer::CacheList(children)
            }
            other => return Err(PersistError::UnknownKind { kind: other.to_string() }),
        })
    }
}

fn fields<'a>(n: &'a Node, at: &str) -> Result<Vec<&'a Node>> {
    match n {
        Node::List(v) => Ok(v.iter().collect()),
        Node::Leaf(_) => Err(PersistError::malformed(format!("{at}: expected a state tuple, found a leaf"))),
    }
}

fn int(n: &Node, at: &str) -> Result<i64> {
    match n {
        Node::Leaf(Leaf::Int(i)) => Ok(*i),
        _ => Err(PersistError::malformed(format!("{at}: expected an integer scalar"))),
    }
}

fn boolean(n: &Node, at: &str) -> Result<bool> {
    match n {
        Node::Leaf(Leaf::Bool(b)) => Ok(*b),
        Node::Leaf(Leaf::Int(i @ (0 | 1))) => Ok(*i == 1),
        // Mutation hook: Python's `bool(s)` of an older file's string flag (`bool("False")` is `True`).
        Node::Leaf(Leaf::Str(s)) if fault!(MlxlmRotatedFlagFromString) => Ok(!s.is_empty()),
        _ => Err(PersistError::malformed(format!("{at}: expected a boolean scalar"))),
    }
}

fn tensor(n: &Node, at: &str) -> Result<HostTensor> {
    match n {
        Node::Leaf(Leaf::Tensor(t)) => Ok(t.clone()),
        _ => Err(PersistError::Missing { name: format!("tensor {at}") }),
    }
}

fn opt_tensor(n: &Node, at: &str) -> Result<Option<HostTensor>> {
    match n {
        Node::Leaf(Leaf::None) => Ok(None),
        _ => tensor(n, at).map(Some),
    }
}

fn triple(n: &Node, at: &str) -> Result<Option<[HostTensor; 3]>> {
    match n {
        Node::Leaf(Leaf::None) => Ok(None),
        _ => {
            let f = fields(n, at)?;
            if f.len() != 3 {
                return Err(PersistError::malformed(format!(
                    "{at}: a quantized tensor needs (packed, scales, biases)"
                )));
            }
            Ok(Some([
                tensor(f[0], &format!("{at}.0"))?,
                tensor(f[1], &format!("{at}.1"))?,
                tensor(f[2], &format!("{at}.2"))?,
            ]))
        }
    }
}

/// A partially built tree (dotted keys inserted one by one).
enum Build {
    Leaf(Leaf),
    Map(BTreeMap<usize, Build>),
}

fn insert(tree: &mut BTreeMap<usize, Build>, path: &[usize], leaf: Leaf, key: &str) -> Result<()> {
    let (first, rest) = path.split_first().ok_or_else(|| PersistError::malformed(format!("empty key {key:?}")))?;
    if rest.is_empty() {
        if tree.insert(*first, Build::Leaf(leaf)).is_some() {
            return Err(PersistError::malformed(format!("key {key:?} collides with another key")));
        }
        return Ok(());
    }
    match tree.entry(*first).or_insert_with(|| Build::Map(BTreeMap::new())) {
        Build::Map(m) => insert(m, rest, leaf, key),
        Build::Leaf(_) => Err(PersistError::malformed(format!("key {key:?} nests under a leaf"))),
    }
}

/// mlx's `tree_unflatten` for all-digit keys: indices must be dense from 0.
fn to_list(m: BTreeMap<usize, Build>, at: &str) -> Result<Vec<Node>> {
    let mut out = Vec::with_capacity(m.len());
    for (i, (k, b)) in m.into_iter().enumerate() {
        if k != i {
            return Err(PersistError::malformed(format!("{at}: index {k} present but {i} missing")));
        }
        let here = if at.is_empty() { k.to_string() } else { format!("{at}.{k}") };
        out.push(match b {
            Build::Leaf(l) => Node::Leaf(l),
            Build::Map(m) => Node::List(to_list(m, &here)?),
        });
    }
    Ok(out)
}

fn parse_path(key: &str) -> Result<Vec<usize>> {
    key.split('.')
        .map(|c| {
            if c.is_empty() || !c.bytes().all(|b| b.is_ascii_digit()) || (c.len() > 1 && c.starts_with('0')) {
                Err(PersistError::malformed(format!("tensor key {key:?} is not a dotted index path")))
            } else {
                c.parse::<usize>().map_err(|_| PersistError::malformed(format!("tensor key {key:?} index too large")))
            }
        })
        .collect()
}

/// Whether `bytes` can be a safetensors file (8-byte little-endian header length, then `{`).
pub fn looks_like_safetensors(bytes: &[u8]) -> bool {
    bytes.len() >= 9 && bytes[8] == b'{'
}

/// Parses an mlx-lm prompt-cache file (0.32.2 layout). Every structural problem is a typed error.
pub fn read(bytes: &[u8]) -> Result<MlxFile> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| match e {
        safetensors::SafeTensorError::HeaderTooSmall => PersistError::Truncated { what: format!("safetensors: {e}") },
        safetensors::SafeTensorError::MetadataIncompleteBuffer => PersistError::Truncated {
            what: "safetensors: the tensor table does not cover the data exactly (truncated, or bytes no tensor owns)"
                .into(),
        },
        e => PersistError::malformed(format!("safetensors: {e}")),
    })?;
    let (_, meta) =
        SafeTensors::read_metadata(bytes).map_err(|e| PersistError::malformed(format!("safetensors: {e}")))?;
    let md: HashMap<String, String> = meta.metadata().clone().unwrap_or_default();

    // Metadata: "0.<key>" user, "1.<i>" classes, "2.0" = "", "2.<j>.0"/"2.<j>.1" scalars.
    match md.get("2.0") {
        Some(s) if s.is_empty() => {}
        _ => {
            return Err(PersistError::unsupported(
                "not an mlx-lm 0.32 prompt-cache file (no \"2.0\" = \"\" sentinel: the pre-PR-#1778 layout, or not a prompt cache)",
            ))
        }
    }
    let mut user = BTreeMap::new();
    let mut classes = BTreeMap::new();
    let mut scal: BTreeMap<usize, (Option<String>, Option<String>)> = BTreeMap::new();
    for (k, v) in &md {
        if let Some(u) = k.strip_prefix("0.") {
            user.insert(u.to_string(), v.clone());
        } else if let Some(i) = k.strip_prefix("1.") {
            let i: usize = i.parse().map_err(|_| PersistError::malformed(format!("metadata key {k:?}")))?;
            classes.insert(i, v.clone());
        } else if k == "2.0" {
        } else if let Some(r) = k.strip_prefix("2.") {
            let (j, which) = r.split_once('.').ok_or_else(|| PersistError::malformed(format!("metadata key {k:?}")))?;
            let j: usize = j.parse().map_err(|_| PersistError::malformed(format!("metadata key {k:?}")))?;
            let slot = scal.entry(j).or_default();
            match which {
                "0" => slot.0 = Some(v.clone()),
                "1" => slot.1 = Some(v.clone()),
                _ => return Err(PersistError::malformed(format!("metadata key {k:?}"))),
            }
        } else {
            return Err(PersistError::malformed(format!("unexpected metadata key {k:?}")));
        }
    }
    let classes: Vec<String> = classes
        .into_iter()
        .enumerate()
        .map(|(i, (k, c))| if i == k { Ok(c) } else { Err(PersistError::malformed(format!("class name {i} missing"))) })
        .collect::<Result<_>>()?;
    let mut kinds: HashMap<String, String> = HashMap::new();
    for (j, (key, ty)) in scal {
        match (key, ty) {
            (Some(key), Some(ty)) => {
                kinds.insert(key, ty);
            }
            _ => return Err(PersistError::malformed(format!("scalar entry {j} lacks its key or type"))),
        }
    }

    let mut tree = BTreeMap::new();
    for (name, view) in st.tensors() {
        let dtype = TensorDtype::from_safetensors(view.dtype()).ok_or_else(|| PersistError::Dtype {
            name: name.clone(),
            expected: "BOOL, U8, U32, I32, F16, BF16 or F32".into(),
            found: format!("{:?}", view.dtype()),
        })?;
        let t = HostTensor::new(&name, dtype, view.shape().to_vec(), view.data().to_vec())?;
        let leaf = match kinds.remove(&name).as_deref() {
            None => Leaf::Tensor(t),
            Some("scalar") => {
                if t.numel() != 1 {
                    return Err(PersistError::shape(&name, format!("a scalar of shape {:?}", t.shape)));
                }
                match t.dtype {
                    TensorDtype::BOOL => Leaf::Bool(t.data[0] != 0),
                    TensorDtype::F32 | TensorDtype::F16 | TensorDtype::BF16 => Leaf::Float(t.to_f64s(&name)?[0]),
                    _ => Leaf::Int(t.to_i64s(&name)?[0]),
                }
            }
            Some("string") => {
                let cps = t.to_i64s(&name)?;
                let s: Option<String> = cps.iter().map(|&c| u32::try_from(c).ok().and_then(char::from_u32)).collect();
                Leaf::Str(s.ok_or_else(|| PersistError::malformed(format!("{name}: not a string of code points")))?)
            }
            Some("none") => {
                if t.numel() != 0 {
                    return Err(PersistError::shape(&name, "a None placeholder must be empty"));
                }
                Leaf::None
            }
            Some(other) => return Err(PersistError::malformed(format!("{name}: unknown scalar type {other:?}"))),
        };
        insert(&mut tree, &parse_path(&name)?, leaf, &name)?;
    }
    if let Some(k) = kinds.keys().next() {
        return Err(PersistError::Missing { name: format!("tensor {k} (listed in scalars)") });
    }
    let states = to_list(tree, "")?;
    if states.len() != classes.len() {
        return Err(PersistError::malformed(format!(
            "{} class names for {} layer states",
            classes.len(),
            states.len()
        )));
    }
    let layers = classes
        .iter()
        .zip(&states)
        .enumerate()
        .map(|(i, (c, s))| MlxLayer::from_node(c, s, &i.to_string()))
        .collect::<Result<_>>()?;
    Ok(MlxFile { metadata: user, layers })
}

/// Flattens a tree in mlx's `tree_flatten` order (depth first, list order).
fn flatten(n: &Node, at: String, out: &mut Vec<(String, Leaf)>) {
    match n {
        Node::Leaf(l) => out.push((at, l.clone())),
        Node::List(v) => {
            for (i, c) in v.iter().enumerate() {
                flatten(c, if at.is_empty() { i.to_string() } else { format!("{at}.{i}") }, out);
            }
        }
    }
}

/// The safetensors bytes mlx-lm's `load_prompt_cache` reads back as these caches and metadata.
pub fn write(file: &MlxFile) -> Result<Vec<u8>> {
    let mut leaves = Vec::new();
    flatten(&Node::List(file.layers.iter().map(MlxLayer::to_node).collect()), String::new(), &mut leaves);
    let mut md: HashMap<String, String> = HashMap::new();
    for (k, v) in &file.metadata {
        md.insert(format!("0.{k}"), v.clone());
    }
    for (i, l) in file.layers.iter().enumerate() {
        md.insert(format!("1.{i}"), l.class_name().to_string());
    }
    md.insert("2.0".into(), String::new());
    let mut tensors: Vec<(String, HostTensor)> = Vec::with_capacity(leaves.len());
    let mut j = 0;
    for (key, leaf) in leaves {
        let (t, ty) = match leaf {
            Leaf::Tensor(t) => (t, None),
            Leaf::Int(i) => {
                let v = i32::try_from(i).map_err(|_| PersistError::unsupported(format!("{key}: {i} exceeds int32")))?;
                (HostTensor::scalar_i32(v), Some("scalar"))
            }
            Leaf::Bool(b) => {
                (HostTensor { dtype: TensorDtype::BOOL, shape: vec![], data: vec![b as u8] }, Some("scalar"))
            }
            Leaf::Float(f) => (
                HostTensor { dtype: TensorDtype::F32, shape: vec![], data: (f as f32).to_le_bytes().to_vec() },
                Some("scalar"),
            ),
            Leaf::Str(s) => {
                let cps: Vec<i32> = s.chars().map(|c| c as i32).collect();
                (HostTensor::vec_i32(&cps), Some("string"))
            }
            Leaf::None => (HostTensor { dtype: TensorDtype::F32, shape: vec![0], data: vec![] }, Some("none")),
        };
        if let Some(ty) = ty {
            j += 1;
            md.insert(format!("2.{j}.0"), key.clone());
            md.insert(format!("2.{j}.1"), ty.to_string());
        }
        tensors.push((key, t));
    }
    let views = tensors
        .iter()
        .map(|(k, t)| {
            safetensors::tensor::TensorView::new(t.dtype.to_safetensors(), t.shape.clone(), &t.data)
                .map(|v| (k.clone(), v))
                .map_err(|e| PersistError::malformed(format!("{k}: {e}")))
        })
        .collect::<Result<Vec<_>>>()?;
    let bytes =
        safetensors::serialize(views, Some(md)).map_err(|e| PersistError::malformed(format!("safetensors: {e}")))?;
    sorted_header(bytes)
}

/// The same file with its JSON header's keys in sorted order, so that one content always gives the same bytes (the
/// `safetensors` crate writes `__metadata__` in `HashMap` order). The data section and its offsets are unchanged;
/// the header stays padded with spaces to a multiple of 8 bytes, as the crate pads it.
fn sorted_header(bytes: Vec<u8>) -> Result<Vec<u8>> {
    let bad = || PersistError::malformed("safetensors output without a header");
    let n = u64::from_le_bytes(bytes.get(..8).ok_or_else(bad)?.try_into().map_err(|_| bad())?) as usize;
    let header = bytes.get(8..8 + n).ok_or_else(bad)?;
    let v: serde_json::Value = serde_json::from_slice(header).map_err(|e| PersistError::malformed(e.to_string()))?;
    let mut h = serde_json::to_vec(&v).map_err(|e| PersistError::malformed(e.to_string()))?;
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + h.len() + bytes.len() - 8 - n);
    out.extend_from_slice(&(h.len() as u64).to_le_bytes());
    out.extend_from_slice(&h);
    out.extend_from_slice(&bytes[8 + n..]);
    Ok(out)
}

// ---------------------------------------------------------------------------------------------------------------
// Conversion to and from kvsim layouts.

fn kv_dtype_of(t: &HostTensor, name: &str) -> Result<KvDtype> {
    match t.dtype {
        TensorDtype::F32 => Ok(KvDtype::F32),
        TensorDtype::BF16 => Ok(KvDtype::Bf16),
        d => Err(PersistError::unsupported(format!("{name}: kvsim layouts hold F32 or BF16, not {d}"))),
    }
}

fn usize_of(v: i64, name: &str) -> Result<usize> {
    usize::try_from(v).map_err(|_| PersistError::malformed(format!("{name} = {v} is negative")))
}

/// Keys and values of a KV-like class: same dtype and shape `[B, H, C, D]`; returns (spec, B, C).
fn kv_pair<'a>(
    keys: &'a Option<HostTensor>,
    values: &'a Option<HostTensor>,
    class: &str,
) -> Result<Option<(&'a HostTensor, &'a HostTensor, KvSpec, usize, usize)>> {
    match (keys, values) {
        (None, None) => Ok(None),
        (Some(k), Some(v)) => {
            let [b, h, c, d] = k.dims4("keys")?;
            if k.shape != v.shape || k.dtype != v.dtype {
                return Err(PersistError::shape(
                    format!("{class} values"),
                    format!("{} {:?} differs from keys {} {:?}", v.dtype, v.shape, k.dtype, k.shape),
                ));
            }
            let spec = KvSpec { heads_kv: h, head_dim: d, dtype: kv_dtype_of(k, "keys")? };
            Ok(Some((k, v, spec, b, c)))
        }
        _ => Err(PersistError::Missing { name: format!("{class}: keys and values must both be present or both None") }),
    }
}

fn rows_of(t: &HostTensor, rows: usize, name: &str) -> Result<Vec<i64>> {
    if t.shape != [rows] {
        return Err(PersistError::shape(name, format!("shape {:?}, expected [{rows}]", t.shape)));
    }
    t.to_i64s(name)
}

/// The kvsim cache that continues this mlx-lm cache exactly as mlx-lm continues it (same live bytes per row, same
/// physical order for serial rings, same offsets). `spec_hint` gives the spec of a cache that holds no array yet.
///
/// - `KVCache` (B = 1) -> `kv-plain`: columns `[0, offset)`.
/// - `QuantizedKVCache` (B = 1) -> `kv:quant:<bits>:<group>`: the six planes' columns `[0, offset)` as stored.
/// - `RotatingKVCache` (keep = 0, B = 1) -> `rotating-plain`: the ring as laid out, `len = min(offset, columns)`,
///   `idx = _idx` (mlx-lm's live columns: `keys_and_values`).
/// - `BatchKVCache` -> `kv-plain+row-batch`: row `r` = columns `[left_padding_r, _idx)` (mlx-lm's `extract`),
///   left-aligned.
/// - `BatchRotatingKVCache` -> `rotating-plain+row-batch`: row `r` = mlx-lm's `extract(r)` (temporal order, padding
///   dropped), left-aligned. A layout event for rotated rings (kvsim rows keep their own phase from then on).
///
/// A file without a pending right padding is the only kind mlx-lm 0.32.2 writes, so loaded batches are finalized.
pub fn to_kvsim(layer: &MlxLayer, spec_hint: Option<KvSpec>) -> Result<AnyCache> {
    to_kvsim_at(layer, "0", &Hints { spec: spec_hint, ..Hints::default() })
}

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

/// The geometry of an mlx-lm `ArraysCache` holding a gated-DeltaNet layer's `[conv, recurrent]` state (mlx-lm
/// 0.32.2 `qwen3_5.py` / `qwen3_next.py`: `cache[0]` the conv tail `[B, K-1, conv_dim]` in the input dtype,
/// `cache[1]` the recurrent state `[B, Hv, Dv, Dk]`, f32), and its row count. `Hk` follows from
/// `conv_dim = 2 Hk Dk + Hv Dv`. Any other content is [`PersistError::Unsupported`] (kvsim has no layout for it) or a
/// shape error.
pub fn ssm_spec_of(cache: &[Option<HostTensor>]) -> Result<(SsmSpec, usize)> {
    let (conv, rec) = match cache {
        [Some(c), Some(r)] => (c, r),
        [None, None] => return Err(PersistError::unsupported("an ArraysCache without state carries no spec")),
        _ => {
            return Err(PersistError::unsupported(format!(
                "an ArraysCache of {} arrays (kvsim's ssm layout holds exactly [conv, recurrent], both set)",
                cache.len()
            )))
        }
    };
    let dtype = kv_dtype_of(conv, "cache.0")?;
    if rec.dtype != TensorDtype::F32 {
        return Err(PersistError::Dtype {
            name: "cache.1".into(),
            expected: "F32".into(),
            found: rec.dtype.to_string(),
        });
    }
    let [b, km1, c] = match conv.shape.as_slice() {
        &[b, k, c] => [b, k, c],
        s => return Err(PersistError::shape("cache.0", format!("shape {s:?}, expected [B, K-1, conv_dim]"))),
    };
    let [rb, hv, dv, dk] = rec.dims4("cache.1")?;
    let v_width = hv.checked_mul(dv).ok_or_else(|| PersistError::shape("cache.1", "Hv * Dv overflows"))?;
    let bad = || {
        PersistError::shape(
            "cache.0",
            format!("conv_dim {c} is not 2 Hk Dk + Hv Dv for the recurrent state's Hv {hv}, Dv {dv}, Dk {dk}"),
        )
    };
    if rb != b {
        return Err(PersistError::shape("cache.1", format!("{rb} rows, the conv state has {b}")));
    }
    if dk == 0 || c <= v_width || (c - v_width) % (2 * dk) != 0 {
        return Err(bad());
    }
    let spec = SsmSpec { kernel: km1 + 1, heads_k: (c - v_width) / (2 * dk), heads_v: hv, dk, dv, dtype };
    Ok((spec, b))
}

/// [`to_kvsim`] of the layer at path `at` (`"<layer>"`, `"<layer>.<child>"`), with `hints`.
///
/// Beyond the five attention classes above:
/// - `ArraysCache` `[conv, recurrent]` -> `ssm` ([`ssm_spec_of`]); the offsets come from `hints.ssm_offsets[at]`
///   ([`PersistError::Missing`] without them: the class stores none). Only a cache at rest maps: `lengths` set, or a
///   positive `left_padding`, is a pending prefill ([`PersistError::Unsupported`]).
/// - `ChunkedKVCache` -> `kv-chunked:<chunk_size>`: columns `[0, offset - start_position)` of its buffer (mlx-lm's
///   `keys_and_values`), the start position as the linear cache's `offset - len`.
/// - `CacheList` -> a list of its children's kvsim caches.
pub fn to_kvsim_at(layer: &MlxLayer, at: &str, hints: &Hints) -> Result<AnyCache> {
    let class = layer.class_name();
    let spec_hint = hints.spec;
    match layer {
        MlxLayer::KvCache { keys, values, offset } => {
            let offset = usize_of(*offset, "offset")?;
            match kv_pair(keys, values, class)? {
                None => {
                    let spec =
                        spec_hint.ok_or_else(|| PersistError::unsupported("an empty KVCache carries no spec"))?;
                    if offset != 0 {
                        return Err(PersistError::malformed(format!("empty KVCache with offset {offset}")));
                    }
                    Ok(AnyCache::Serial(SerialCache::new(spec, None)?))
                }
                Some((k, v, spec, b, c)) => {
                    if b != 1 {
                        return Err(PersistError::unsupported(format!(
                            "KVCache with batch {b} (kvsim serial caches hold one row)"
                        )));
                    }
                    if offset > c {
                        return Err(PersistError::shape(
                            "keys",
                            format!("offset {offset} past the buffer's {c} columns"),
                        ));
                    }
                    let ring = RingState { offset, len: offset, idx: offset, last_concat: None };
                    Ok(AnyCache::Serial(SerialCache::adopt(spec, None, k.to_array()?, v.to_array()?, ring)?))
                }
            }
        }
        MlxLayer::RotatingKvCache { keys, values, offset, keep, max_size, idx } => {
            if *keep != 0 {
                return Err(PersistError::unsupported(format!(
                    "RotatingKVCache with keep = {keep} (kvsim rings keep 0)"
                )));
            }
            let w = usize_of(*max_size, "max_size")?;
            let offset = usize_of(*offset, "offset")?;
            let idx = usize_of(*idx, "_idx")?;
            match kv_pair(keys, values, class)? {
                None => {
                    let spec = spec_hint
                        .ok_or_else(|| PersistError::unsupported("an empty RotatingKVCache carries no spec"))?;
                    if offset != 0 || idx != 0 {
                        return Err(PersistError::malformed("empty RotatingKVCache with a non-zero offset or _idx"));
                    }
                    Ok(AnyCache::Serial(SerialCache::new(spec, Some(w))?))
                }
                Some((k, v, spec, b, c)) => {
                    if b != 1 {
                        return Err(PersistError::unsupported(format!("RotatingKVCache with batch {b}")));
                    }
                    let len = offset.min(c);
                    let ring = RingState { offset, len, idx, last_concat: None };
                    Ok(AnyCache::Serial(SerialCache::adopt(spec, Some(w), k.to_array()?, v.to_array()?, ring)?))
                }
            }
        }
        MlxLayer::BatchKvCache { keys, values, offset, left_padding, idx } => {
            let idx = usize_of(*idx, "_idx")?;
            batch_to_kvsim(keys, values, offset, left_padding, None, spec_hint, class, |_, lp, c| {
                let lp = usize_of(lp, "left_padding")?;
                if lp > idx || idx > c {
                    return Err(PersistError::shape(
                        "keys",
                        format!("row columns [{lp}, {idx}) outside the buffer's {c}"),
                    ));
                }
                Ok((lp..idx).collect())
            })
        }
        MlxLayer::BatchRotatingKvCache { keys, values, offset, left_padding, max_size, offset_total, idx, rotated } => {
            let w = usize_of(*max_size, "max_size")?;
            let idx = usize_of(*idx, "_idx")?;
            let _ = usize_of(*offset_total, "_offset")?;
            let rotated = *rotated;
            batch_to_kvsim(keys, values, offset, left_padding, Some(w), spec_hint, class, |_, lp, c| {
                // mlx-lm 0.32.2 `BatchRotatingKVCache.extract`: roll by -_idx when rotated (then _idx = max_size),
                // drop max(0, left_padding) columns, keep up to _idx.
                let padding = usize::try_from(lp.max(0)).unwrap_or(0);
                let (order, end): (Vec<usize>, usize) = if rotated {
                    if idx > c || c != w {
                        return Err(PersistError::shape(
                            "keys",
                            format!("a rotated ring of {c} columns, _idx {idx}, window {w}"),
                        ));
                    }
                    ((idx..c).chain(0..idx).collect(), w)
                } else {
                    if idx > c {
                        return Err(PersistError::shape("keys", format!("_idx {idx} past the buffer's {c} columns")));
                    }
                    ((0..c).collect(), idx)
                };
                if padding > end {
                    return Err(PersistError::shape(
                        "left_padding",
                        format!("padding {padding} past the row's {end} columns"),
                    ));
                }
                Ok(order[padding..end].to_vec())
            })
        }
        MlxLayer::QuantizedKvCache { keys, values, offset, group_size, bits } => {
            let offset = usize_of(*offset, "offset")?;
            let q = QuantSpec { bits: usize_of(*bits, "bits")?, group: usize_of(*group_size, "group_size")? };
            match (keys, values) {
                (None, None) => {
                    let spec = spec_hint
                        .ok_or_else(|| PersistError::unsupported("an empty QuantizedKVCache carries no spec"))?;
                    if offset != 0 {
                        return Err(PersistError::malformed(format!("empty QuantizedKVCache with offset {offset}")));
                    }
                    Ok(AnyCache::Serial(QuantizedKvCache::new(spec, q)?))
                }
                (Some(k), Some(v)) => {
                    let [b, h, c, w] = k[0].dims4("keys.0")?;
                    if b != 1 {
                        return Err(PersistError::unsupported(format!(
                            "QuantizedKVCache with batch {b} (kvsim serial caches hold one row)"
                        )));
                    }
                    // `quantize` packs D elements into D * bits / 32 words.
                    if q.bits == 0 || (w * 32) % q.bits != 0 {
                        return Err(PersistError::shape("keys.0", format!("{w} packed words at {} bits", q.bits)));
                    }
                    let spec = KvSpec { heads_kv: h, head_dim: w * 32 / q.bits, dtype: kv_dtype_of(&k[1], "keys.1")? };
                    let storage = Storage::Affine(q);
                    storage.validate(&spec)?;
                    if offset > c {
                        return Err(PersistError::shape(
                            "keys.0",
                            format!("offset {offset} past the buffer's {c} columns"),
                        ));
                    }
                    let planes = k.iter().chain(v.iter()).map(HostTensor::to_array).collect::<Result<Vec<_>>>()?;
                    let ring = RingState { offset, len: offset, idx: offset, last_concat: None };
                    Ok(AnyCache::Serial(SerialCache::adopt_planes(spec, None, storage, planes, ring)?))
                }
                _ => Err(PersistError::Missing {
                    name: format!("{class}: keys and values must both be present or both None"),
                }),
            }
        }
        MlxLayer::ArraysCache { cache, left_padding, lengths } => {
            let (spec, rows) = ssm_spec_of(cache)?;
            if lengths.is_some() {
                return Err(PersistError::unsupported(
                    "an ArraysCache with lengths set (a pending prefill: finalize it before saving)",
                ));
            }
            if let Some(lp) = left_padding {
                if rows_of(lp, rows, "left_padding")?.iter().any(|&x| x > 0) {
                    return Err(PersistError::unsupported(
                        "an ArraysCache with positive left padding (a pending prefill: finalize it before saving)",
                    ));
                }
            }
            let offsets = hints.ssm_offsets.get(at).ok_or_else(|| PersistError::Missing {
                name: format!("user metadata {SSM_OFFSETS_KEY}[{at:?}]: an mlx-lm ArraysCache carries no offsets"),
            })?;
            if offsets.len() != rows {
                return Err(PersistError::shape(
                    SSM_OFFSETS_KEY,
                    format!("{} offsets for layer {at}'s {rows} rows", offsets.len()),
                ));
            }
            let [conv, rec] = [&cache[0], &cache[1]].map(|t| t.as_ref().map(HostTensor::to_array));
            let (Some(conv), Some(rec)) = (conv, rec) else {
                return Err(PersistError::malformed("ArraysCache state vanished"));
            };
            Ok(AnyCache::Ssm(SsmCache::from_states(spec, conv?, rec?, offsets.clone())?))
        }
        MlxLayer::ChunkedKvCache { keys, values, offset, chunk_size, start_position } => {
            let offset = usize_of(*offset, "offset")?;
            let start = usize_of(*start_position, "start_position")?;
            let chunk = usize_of(*chunk_size, "chunk_size")?;
            if start > offset {
                return Err(PersistError::malformed(format!("start_position {start} past offset {offset}")));
            }
            let cache = match kv_pair(keys, values, class)? {
                None => {
                    let spec = spec_hint
                        .ok_or_else(|| PersistError::unsupported("an empty ChunkedKVCache carries no spec"))?;
                    if offset != 0 {
                        return Err(PersistError::malformed(format!("empty ChunkedKVCache with offset {offset}")));
                    }
                    SerialCache::new(spec, None)?
                }
                Some((k, v, spec, b, c)) => {
                    if b != 1 {
                        return Err(PersistError::unsupported(format!("ChunkedKVCache with batch {b}")));
                    }
                    let valid = offset - start;
                    if valid > c {
                        return Err(PersistError::shape(
                            "keys",
                            format!("{valid} live positions past the buffer's {c} columns"),
                        ));
                    }
                    let ring = RingState { offset, len: valid, idx: valid, last_concat: None };
                    SerialCache::adopt(spec, None, k.to_array()?, v.to_array()?, ring)?
                }
            };
            Ok(AnyCache::Chunked(ChunkedKvCache::from_cache(cache, chunk)?))
        }
        MlxLayer::CacheList(children) => Ok(AnyCache::List(
            children
                .iter()
                .enumerate()
                .map(|(j, c)| to_kvsim_at(c, &format!("{at}.{j}"), &Hints { spec: None, ..hints.clone() }))
                .collect::<Result<_>>()?,
        )),
    }
}

/// Rows of an mlx-lm batch cache: `columns(row, left_padding_r, buffer columns)` lists the buffer columns holding
/// row `r`'s positions, oldest first. Each row becomes a temporal serial cache, then the rows are joined.
#[allow(clippy::too_many_arguments)]
fn batch_to_kvsim(
    keys: &Option<HostTensor>,
    values: &Option<HostTensor>,
    offset: &HostTensor,
    left_padding: &HostTensor,
    max_size: Option<usize>,
    spec_hint: Option<KvSpec>,
    class: &str,
    columns: impl Fn(usize, i64, usize) -> Result<Vec<usize>>,
) -> Result<AnyCache> {
    let rows = offset.numel();
    let offsets = rows_of(offset, rows, "offset")?;
    let pads = rows_of(left_padding, rows, "left_padding")?;
    let Some((k, v, spec, b, c)) = kv_pair(keys, values, class)? else {
        // No array yet: every row is empty (an empty batch's offsets are -left_padding, mlx-lm's constructor).
        let spec = spec_hint.ok_or_else(|| PersistError::unsupported(format!("an empty {class} carries no spec")))?;
        let z = HostTensor {
            dtype: match spec.dtype {
                KvDtype::F32 => TensorDtype::F32,
                KvDtype::Bf16 => TensorDtype::BF16,
            },
            shape: vec![rows, spec.heads_kv, 0, spec.head_dim],
            data: vec![],
        }
        .to_array()?;
        return Ok(AnyCache::Rows(RowBatch::adopt(spec, max_size, z.clone(), z, vec![RowState::default(); rows])?));
    };
    if b != rows {
        return Err(PersistError::shape("keys", format!("{b} rows, offset lists {rows}")));
    }
    let (ka, va) = (k.to_array()?, v.to_array()?);
    let mut serials = Vec::with_capacity(rows);
    for r in 0..rows {
        let cols = columns(r, pads[r], c)?;
        let off = usize_of(offsets[r], "offset")?;
        if cols.len() > off {
            return Err(PersistError::shape(
                "offset",
                format!("row {r} holds {} positions but offset {off}", cols.len()),
            ));
        }
        let rk = take_row_cols(&ka, r, &cols)?;
        let rv = take_row_cols(&va, r, &cols)?;
        serials.push(SerialCache::from_temporal(spec, max_size, &rk, &rv, off)?);
    }
    let sources: Vec<kvsim_cache::JoinSource<'_>> = serials.iter().map(kvsim_cache::JoinSource::Serial).collect();
    Ok(AnyCache::Rows(RowBatch::join(spec, max_size, &sources)?))
}

fn take_row_cols(a: &mlx_rs::Array, row: usize, cols: &[usize]) -> Result<mlx_rs::Array> {
    use mlx_rs::ops::indexing::TryIndexOp;
    let r = row as i32;
    let one = a.try_index((r..r + 1, .., .., ..))?;
    let idx: Vec<i32> = cols.iter().map(|&c| c as i32).collect();
    let at = mlx_rs::Array::from_slice(&idx, &[idx.len() as i32]);
    Ok(one.take_axis(&at, 2)?.contiguous()?)
}

fn pad_cols(t: &HostTensor, name: &str, total: usize, left: usize) -> Result<HostTensor> {
    let [b, h, c, d] = t.dims4(name)?;
    if left + c > total {
        return Err(PersistError::shape(name, "padding past the target width"));
    }
    let item = t.dtype.itemsize();
    let row = d * item;
    let mut out = vec![0u8; b * h * total * row];
    for bh in 0..b * h {
        let src = &t.data[bh * c * row..(bh + 1) * c * row];
        let dst = bh * total * row + left * row;
        out[dst..dst + c * row].copy_from_slice(src);
    }
    Ok(HostTensor { dtype: t.dtype, shape: vec![b, h, total, d], data: out })
}

fn stack_rows(parts: &[HostTensor], name: &str) -> Result<HostTensor> {
    let first = parts.first().ok_or_else(|| PersistError::malformed("no rows"))?;
    let mut shape = first.shape.clone();
    shape[0] = parts.len();
    let mut data = Vec::with_capacity(first.data.len() * parts.len());
    for p in parts {
        if p.shape[1..] != first.shape[1..] {
            return Err(PersistError::shape(name, "rows of different shapes"));
        }
        data.extend_from_slice(&p.data);
    }
    Ok(HostTensor { dtype: first.dtype, shape, data })
}

fn cache_quant(cache: &AnyCache) -> Option<QuantSpec> {
    match cache {
        AnyCache::Serial(c) => c.storage().quant(),
        AnyCache::Rows(b) => b.storage().quant(),
        AnyCache::Ssm(_) | AnyCache::Chunked(_) | AnyCache::List(_) | AnyCache::Bf16First(_) => None,
    }
}

/// `kv:quant:<bits>:<group>` -> `QuantizedKVCache`: the six planes' columns `[0, offset)` as stored (never
/// requantized), zeros up to the next multiple of 256 as mlx-lm allocates them. mlx-lm 0.32.2 has no rotating or
/// batched quantized class, so those kinds have no mlx-lm form.
fn quantized_from_kvsim(cache: &AnyCache, q: QuantSpec) -> Result<MlxLayer> {
    let AnyCache::Serial(c) = cache else {
        return Err(PersistError::unsupported("mlx-lm 0.32.2 has no batched quantized cache class"));
    };
    if c.max_size().is_some() {
        return Err(PersistError::unsupported("mlx-lm 0.32.2 has no rotating quantized cache class"));
    }
    let s = c.state();
    if s.len != s.offset {
        return Err(PersistError::unsupported(format!(
            "a quantized cache holding {} positions at offset {} has no QuantizedKVCache form",
            s.len, s.offset
        )));
    }
    let (group_size, bits) = (i32_of(q.group, "group_size")? as i64, i32_of(q.bits, "bits")? as i64);
    if s.len == 0 {
        return Ok(MlxLayer::QuantizedKvCache { keys: None, values: None, offset: 0, group_size, bits });
    }
    let total = s.len.div_ceil(kvsim_cache::ring::GROW_STEP) * kvsim_cache::ring::GROW_STEP;
    let mut planes = vec![];
    for (i, p) in c.physical_planes()?.iter().enumerate() {
        planes.push(pad_cols(&HostTensor::from_array(p)?, &format!("plane {i}"), total, 0)?);
    }
    let v: [HostTensor; 3] = planes.split_off(3).try_into().map_err(|_| PersistError::malformed("six planes"))?;
    let k: [HostTensor; 3] = planes.try_into().map_err(|_| PersistError::malformed("six planes"))?;
    Ok(MlxLayer::QuantizedKvCache {
        keys: Some(k),
        values: Some(v),
        offset: i32_of(s.offset, "offset")? as i64,
        group_size,
        bits,
    })
}

fn i32_of(v: usize, name: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| PersistError::unsupported(format!("{name} = {v} exceeds int32")))
}

/// The mlx-lm cache object that mlx-lm continues exactly as kvsim continues `cache` (the inverse of [`to_kvsim`]).
///
/// - `kv-plain` -> `KVCache` with mlx-lm's full buffer (columns `[0, offset)`, zeros up to the next multiple of 256).
///   Requires `len == offset` (a merged row holding fewer positions than its offset has no `KVCache` form).
/// - `rotating-plain` -> `RotatingKVCache(keep = 0)`: the ring as laid out, `_idx = idx`. Requires that mlx-lm sees
///   the same live columns: `len == offset`, or `len >= W` (a full or oversized ring).
/// - row batches -> `BatchKVCache` / `BatchRotatingKVCache` as mlx-lm's `merge` lays rows out: each row's newest
///   positions (its temporal view) right-aligned at `width = max len_r`, `left_padding_r = width - len_r`,
///   `_idx = _offset = width`, `rotated = False`. A batch with a pending prefill is refused (mlx-lm's files cannot
///   carry it).
/// - Affine storage never takes the dense forms above (their dequantized values would restore a plain cache: the
///   simulator's quantized family caught that): `kv:quant:..` -> `QuantizedKVCache`, the rotating and batched
///   quantized kinds are [`PersistError::Unsupported`] (see `quantized_from_kvsim`).
/// - The bf16-first legos are [`PersistError::Unsupported`]: mlx-lm 0.32.2 has no class that converts at a boundary
///   (its `QuantizedKVCache` form would lose the transition and, before it, the bf16 storage).
pub fn from_kvsim(cache: &AnyCache) -> Result<MlxLayer> {
    if let Some(q) = cache_quant(cache) {
        return quantized_from_kvsim(cache, q);
    }
    match cache {
        // mlx-lm's `ArraysCache` carries no offsets: `file_from_kvsim` puts them in the user metadata.
        AnyCache::Ssm(c) => {
            if c.is_pending() || c.in_round() {
                return Err(PersistError::unsupported("an ssm cache with a pending prefill or an armed round"));
            }
            Ok(MlxLayer::ArraysCache {
                cache: vec![Some(HostTensor::from_array(c.conv())?), Some(HostTensor::from_array(c.recurrent())?)],
                left_padding: None,
                lengths: None,
            })
        }
        AnyCache::Chunked(c) => {
            let s = c.cache().state();
            let chunk_size = i32_of(c.chunk_size(), "chunk_size")? as i64;
            let offset = i32_of(s.offset, "offset")? as i64;
            let start_position = i32_of(c.start_position(), "start_position")? as i64;
            if s.len == 0 {
                if s.offset != 0 {
                    return Err(PersistError::unsupported(
                        "a chunked cache with no live position at a positive offset",
                    ));
                }
                return Ok(MlxLayer::ChunkedKvCache { keys: None, values: None, offset, chunk_size, start_position });
            }
            // The live columns exactly (what `maybe_trim_front` leaves; mlx-lm grows the buffer on the next write).
            let (k, v) = c.cache().physical()?;
            Ok(MlxLayer::ChunkedKvCache {
                keys: Some(HostTensor::from_array(&k)?),
                values: Some(HostTensor::from_array(&v)?),
                offset,
                chunk_size,
                start_position,
            })
        }
        AnyCache::List(children) => Ok(MlxLayer::CacheList(children.iter().map(from_kvsim).collect::<Result<_>>()?)),
        AnyCache::Bf16First(_) => Err(PersistError::unsupported("mlx-lm 0.32.2 has no bf16-first cache class")),
        AnyCache::Serial(c) => {
            let s = c.state();
            let (k, v) = c.physical()?;
            let (k, v) = (HostTensor::from_array(&k)?, HostTensor::from_array(&v)?);
            let empty = s.len == 0;
            match c.max_size() {
                None => {
                    if s.len != s.offset {
                        return Err(PersistError::unsupported(format!(
                            "a linear cache holding {} positions at offset {} has no KVCache form",
                            s.len, s.offset
                        )));
                    }
                    if empty {
                        return Ok(MlxLayer::KvCache { keys: None, values: None, offset: 0 });
                    }
                    let total = s.len.div_ceil(kvsim_cache::ring::GROW_STEP).max(1) * kvsim_cache::ring::GROW_STEP;
                    Ok(MlxLayer::KvCache {
                        keys: Some(pad_cols(&k, "keys", total, 0)?),
                        values: Some(pad_cols(&v, "values", total, 0)?),
                        offset: i32_of(s.offset, "offset")? as i64,
                    })
                }
                Some(w) => {
                    if !(s.len == s.offset || s.len >= w) {
                        return Err(PersistError::unsupported(format!(
                            "a ring holding {} positions at offset {} (window {w}) has no RotatingKVCache form",
                            s.len, s.offset
                        )));
                    }
                    if empty {
                        return Ok(MlxLayer::RotatingKvCache {
                            keys: None,
                            values: None,
                            offset: 0,
                            keep: 0,
                            max_size: i32_of(w, "max_size")? as i64,
                            idx: 0,
                        });
                    }
                    Ok(MlxLayer::RotatingKvCache {
                        keys: Some(k),
                        values: Some(v),
                        offset: i32_of(s.offset, "offset")? as i64,
                        keep: 0,
                        max_size: i32_of(w, "max_size")? as i64,
                        idx: i32_of(s.idx, "_idx")? as i64,
                    })
                }
            }
        }
        AnyCache::Rows(b) => {
            if b.is_pending() {
                return Err(PersistError::unsupported(
                    "a batch with a pending right-padded prefill: mlx-lm 0.32.2 files cannot carry it (finalize first)",
                ));
            }
            let n = b.rows();
            let mut views = Vec::with_capacity(n);
            for r in 0..n {
                // Every live column in temporal order (an oversized row after a window write keeps all of them,
                // as mlx-lm's concat path does).
                let (k, v) = b.extract(r)?.physical()?;
                views.push((HostTensor::from_array(&k)?, HostTensor::from_array(&v)?));
            }
            let width = views.iter().map(|(k, _)| k.shape[2]).max().unwrap_or(0);
            let mut lps = Vec::with_capacity(n);
            let mut offs = Vec::with_capacity(n);
            let (mut ks, mut vs) = (Vec::with_capacity(n), Vec::with_capacity(n));
            for (r, (k, v)) in views.iter().enumerate() {
                let len = k.shape[2];
                let st = &b.row_states()[r].ring;
                lps.push(i32_of(width - len, "left_padding")?);
                offs.push(i32_of(st.offset, "offset")?);
                ks.push(pad_cols(k, "keys", width, width - len)?);
                vs.push(pad_cols(v, "values", width, width - len)?);
            }
            let (keys, values) = if n == 0 || width == 0 {
                (None, None)
            } else {
                (Some(stack_rows(&ks, "keys")?), Some(stack_rows(&vs, "values")?))
            };
            let (offset, left_padding) = (HostTensor::vec_i32(&offs), HostTensor::vec_i32(&lps));
            let width_i = i32_of(width, "width")? as i64;
            Ok(match b.max_size() {
                None => MlxLayer::BatchKvCache { keys, values, offset, left_padding, idx: width_i },
                Some(w) => MlxLayer::BatchRotatingKvCache {
                    keys,
                    values,
                    offset,
                    left_padding,
                    max_size: i32_of(w, "max_size")? as i64,
                    offset_total: width_i,
                    idx: width_i,
                    rotated: false,
                },
            })
        }
    }
}
