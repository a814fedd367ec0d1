//! The file level of mlx-lm's prompt-cache layout: each class's state tree ([`MlxLayer`] to and from [`Node`]),
//! and the safetensors file ([`read`], [`write`]): tensors named by dotted index paths, the `scalars` and class-name
//! metadata, a sorted header.

use std::collections::{BTreeMap, HashMap};

use safetensors::SafeTensors;

use crate::error::{PersistError, Result};
use crate::tensor::{HostTensor, TensorDtype};

use super::{Leaf, MlxFile, MlxLayer, Node};

impl MlxLayer {
    /// mlx-lm's class name.
    pub fn class_name(&self) -> &'static str {
        match self {
            MlxLayer::KvCache { .. } => "KVCache",
            MlxLayer::ConcatenateKvCache { .. } => "ConcatenateKVCache",
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
            MlxLayer::ConcatenateKvCache { keys, values } => Node::List(vec![ot(keys), ot(values)]),
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
            "ConcatenateKVCache" => {
                want(2)?;
                MlxLayer::ConcatenateKvCache { keys: opt_tensor(f[0], &p(0))?, values: opt_tensor(f[1], &p(1))? }
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
        Node::Leaf(Leaf::Str(s)) if kvsim_cache::fault!(MlxlmRotatedFlagFromString) => Ok(!s.is_empty()),
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
