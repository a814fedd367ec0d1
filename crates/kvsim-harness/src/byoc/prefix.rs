//! Prefix caches in another process: the protocol-2 `prefix_*` requests (oracles/PROTOCOL.md, "Prefix caches"),
//! driven by a seeded stream of inserts, lookups and evictions, every hit checked **warm = cold**.
//!
//! A prefix cache keeps the caches of requests under their tokens and hands a new request the caches of the
//! longest prefix it holds. kvsim derives every K/V value from the token prefix ([`value`]: position `p`'s K and V
//! are a pure function of `tokens[..=p]`, the layer and the element), so the same prefix gives the same bytes, and
//! after every hit of `matched` positions:
//! - `prefix_count`: `matched` is at most the query's length, and `tokens[..matched]` begins some inserted sequence
//!   (a cache cannot restore what was never stored);
//! - `prefix_offset`: every restored layer's offset is `matched` (layers that disagree restore a torn request);
//! - `prefix_warm_cold`: every restored layer's offset and K/V bytes equal the engine's own cold run of
//!   `tokens[..matched]` (its caches filled from the same positions without the prefix cache);
//! - `prefix_model`: every restored layer's K/V bytes are kvsim's values of `tokens[..matched]`: all of them under
//!   full attention, the newest `min(matched, W)` under a window of `W` (checked after `prefix_warm_cold`, so a
//!   failure here is one the engine's cold run shares).
//!
//! The draws aim at what prefix caches get wrong: shared prefixes, the same block of tokens after different
//! prefixes, lengths on and off block boundaries, sequences longer than a window layer, lookups of prefixes shorter
//! than what was stored (a trim of a ring past its window), inserts after evictions. This module holds no MLX:
//! values and replies are compared as bytes.

use std::collections::BTreeMap;

use base64::Engine as _;
use rand::Rng;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::engine::{self, ask, EngineFailure};
use crate::sim::rng::{stream, Stream};
use crate::sim::trace::Outcome;

/// The layers, shapes and dtype of a run, drawn from the seed ([`PrefixConfig::from_seed`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PrefixConfig {
    /// Per layer: `None` full attention, `Some(W)` a sliding window of `W`.
    pub layers: Vec<Option<usize>>,
    pub heads_kv: usize,
    pub head_dim: usize,
    /// `f32` or `bf16`.
    pub dtype: String,
    /// The block size engines that store by blocks are asked for (`prefix_new`'s hint); the draws put lengths on
    /// and off its multiples.
    pub block_size: usize,
    /// Token ids are drawn from `0..vocab`.
    pub vocab: u32,
    pub ops: usize,
}

impl PrefixConfig {
    pub fn from_seed(seed: u64, ops: usize) -> PrefixConfig {
        let mut r = stream(seed, Stream::Prefix);
        let n = r.random_range(1..=3);
        let layers = (0..n).map(|_| if r.random_bool(0.6) { None } else { Some(r.random_range(3..=8)) }).collect();
        PrefixConfig {
            layers,
            heads_kv: r.random_range(1..=2),
            head_dim: [2, 4, 8][r.random_range(0..3)],
            dtype: if r.random_bool(0.5) { "f32".into() } else { "bf16".into() },
            block_size: r.random_range(2..=4),
            vocab: r.random_range(2..=4),
            ops,
        }
    }

    fn elem(&self) -> usize {
        if self.dtype == "bf16" {
            2
        } else {
            4
        }
    }
}

/// One op of a prefix run. Any subsequence of a run is a run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum PrefixOp {
    /// A request of these tokens finished: its caches are stored under them.
    Insert { tokens: Vec<u32> },
    /// A new request of these tokens asks for the caches of its longest stored prefix.
    Lookup { tokens: Vec<u32> },
    /// The engine's own eviction step.
    Evict,
}

impl PrefixOp {
    pub fn kind(&self) -> &'static str {
        match self {
            PrefixOp::Insert { .. } => "insert",
            PrefixOp::Lookup { .. } => "lookup",
            PrefixOp::Evict => "evict",
        }
    }
}

/// The file format name of a prefix trace.
pub const FORMAT: &str = "kvsim-prefix-trace";

/// A prefix run as a file; it replays exactly ([`replay`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PrefixTrace {
    pub format: String,
    pub version: u32,
    pub seed: u64,
    pub config: PrefixConfig,
    pub ops: Vec<PrefixOp>,
    pub outcome: Outcome,
}

impl PrefixTrace {
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }
    /// A prefix trace from its JSON: a typed error for anything else.
    pub fn parse(text: &str) -> Result<PrefixTrace, String> {
        let t: PrefixTrace = serde_json::from_str(text).map_err(|e| format!("not a kvsim prefix trace: {e}"))?;
        if t.format != FORMAT {
            return Err(format!("format is {:?}, expected {FORMAT:?}", t.format));
        }
        if t.config.dtype != "f32" && t.config.dtype != "bf16" {
            return Err(format!("dtype {:?}: f32 or bf16", t.config.dtype));
        }
        if t.config.layers.is_empty() || t.config.layers.len() > 64 || t.config.heads_kv == 0 || t.config.head_dim == 0
        {
            return Err("a prefix config needs 1 to 64 layers and non-zero heads and head dim".into());
        }
        Ok(t)
    }
}

/// One prefix run's result.
#[derive(Debug, Clone)]
pub struct PrefixRun {
    pub trace: PrefixTrace,
    pub applied: u64,
    pub checks: u64,
    /// Lookups that restored something.
    pub hits: u64,
    pub ops_by_kind: BTreeMap<String, u64>,
}

/// The ops of a seed: kvsim's draws for `cfg`.
pub fn generate(seed: u64, cfg: &PrefixConfig) -> Vec<PrefixOp> {
    let mut r = stream(seed, Stream::Workload);
    let bs = cfg.block_size;
    let longest = 4 * bs + cfg.layers.iter().flatten().max().copied().unwrap_or(0) + 4;
    let mut docs: Vec<Vec<u32>> = vec![];
    let mut ops = vec![];
    for _ in 0..cfg.ops {
        let fresh = |r: &mut rand_chacha::ChaCha8Rng, n: usize| -> Vec<u32> {
            (0..n).map(|_| r.random_range(0..cfg.vocab)).collect()
        };
        let tokens = if docs.is_empty() || r.random_bool(0.25) {
            let n = r.random_range(1..=longest);
            fresh(&mut r, n)
        } else {
            let d = docs[r.random_range(0..docs.len())].clone();
            match r.random_range(0..4) {
                // A prefix of a stored sequence, on or off a block boundary.
                0 => {
                    let n = r.random_range(1..=d.len());
                    if r.random_bool(0.5) && n >= bs {
                        d[..n / bs * bs].to_vec()
                    } else {
                        d[..n].to_vec()
                    }
                }
                // A stored sequence and more.
                1 => {
                    let tail = r.random_range(1..=2 * bs);
                    let mut t = d.clone();
                    t.extend(fresh(&mut r, tail));
                    t
                }
                // A shared prefix, then another tail.
                2 => {
                    let keep = r.random_range(0..=d.len());
                    let tail = r.random_range(1..=2 * bs);
                    let mut t = d[..keep].to_vec();
                    t.extend(fresh(&mut r, tail));
                    t
                }
                // The same blocks after another prefix.
                _ => {
                    let pre = r.random_range(1..=2) * bs;
                    let from = (r.random_range(0..=d.len()) / bs) * bs;
                    let mut t = fresh(&mut r, pre);
                    t.extend_from_slice(&d[from.min(d.len())..]);
                    t
                }
            }
        };
        let pick = r.random_range(0..100);
        let op = if pick < 45 {
            docs.push(tokens.clone());
            PrefixOp::Insert { tokens }
        } else if pick < 93 {
            PrefixOp::Lookup { tokens }
        } else {
            PrefixOp::Evict
        };
        ops.push(op);
    }
    ops
}

/// K or V of one position: the bits of `dtype` of the `head_dim * heads_kv` elements of `tokens[..=p]`, layer
/// `layer` (`which`: 0 K, 1 V), little-endian, head-major. Each element is a multiple of 1/16 in [-8, 8): exact in
/// bf16 and f32.
pub fn value(cfg: &PrefixConfig, prefix: &[u32], layer: usize, which: u8) -> Vec<u8> {
    let mut h = blake3::Hasher::new();
    h.update(b"kvsim prefix value");
    h.update(&(layer as u64).to_le_bytes());
    h.update(&[which]);
    for t in prefix {
        h.update(&t.to_le_bytes());
    }
    let n = cfg.heads_kv * cfg.head_dim;
    let mut raw = vec![0u8; n];
    h.finalize_xof().fill(&mut raw);
    let mut out = Vec::with_capacity(n * cfg.elem());
    for b in raw {
        let x = f32::from(b as i8) / 16.0;
        if cfg.dtype == "bf16" {
            out.extend_from_slice(&half::bf16::from_f32(x).to_bits().to_le_bytes());
        } else {
            out.extend_from_slice(&x.to_le_bytes());
        }
    }
    out
}

/// Layer `layer`'s K (`which` 0) or V of positions `from..to` of `tokens`, as a `[1, H, to - from, D]` array's
/// little-endian bytes.
fn block(cfg: &PrefixConfig, tokens: &[u32], layer: usize, which: u8, from: usize, to: usize) -> Vec<u8> {
    let e = cfg.elem();
    let (h, d) = (cfg.heads_kv, cfg.head_dim);
    let per_pos: Vec<Vec<u8>> = (from..to).map(|p| value(cfg, &tokens[..=p], layer, which)).collect();
    let mut out = Vec::with_capacity(h * (to - from) * d * e);
    for head in 0..h {
        for pos in &per_pos {
            out.extend_from_slice(&pos[head * d * e..(head + 1) * d * e]);
        }
    }
    out
}

fn array(cfg: &PrefixConfig, n: usize, bytes: &[u8]) -> Value {
    json!({
        "dtype": cfg.dtype,
        "shape": [1, cfg.heads_kv, n, cfg.head_dim],
        "b64": base64::engine::general_purpose::STANDARD.encode(bytes),
    })
}

/// Every layer's K and V of every position of `tokens`, as the request's `k` and `v` lists.
fn kv_lists(cfg: &PrefixConfig, tokens: &[u32]) -> (Value, Value) {
    let n = tokens.len();
    let ks = (0..cfg.layers.len()).map(|l| array(cfg, n, &block(cfg, tokens, l, 0, 0, n))).collect();
    let vs = (0..cfg.layers.len()).map(|l| array(cfg, n, &block(cfg, tokens, l, 1, 0, n))).collect();
    (Value::Array(ks), Value::Array(vs))
}

/// A reply tensor's shape and bytes, of `dtype`, whose shape must be `[1, heads_kv, n, head_dim]`: any bytes give
/// the tensor or a typed failure.
pub fn raw_tensor(op: &str, t: &Value, cfg: &PrefixConfig) -> Result<(usize, Vec<u8>), EngineFailure> {
    let malformed = |why: String| EngineFailure::Malformed { op: op.into(), reply: engine::shorten(t), why };
    let shape: Vec<i64> = t
        .get("shape")
        .and_then(Value::as_array)
        .and_then(|s| s.iter().map(Value::as_i64).collect::<Option<Vec<_>>>())
        .ok_or_else(|| malformed("no integer shape".into()))?;
    if t.get("dtype").and_then(Value::as_str) != Some(cfg.dtype.as_str()) {
        return Err(malformed(format!("dtype {:?}, the run's is {:?}", t.get("dtype"), cfg.dtype)));
    }
    let raw = super::engine::frame::array_bytes(t).map_err(malformed)?;
    let (h, d) = (cfg.heads_kv as i64, cfg.head_dim as i64);
    if shape.len() != 4 || shape[0] != 1 || shape[1] != h || shape[3] != d || !(0..=1 << 24).contains(&shape[2]) {
        return Err(EngineFailure::WrongShape {
            op: op.into(),
            field: "k/v".into(),
            got: shape,
            want: format!("[1, {h}, n, {d}]"),
        });
    }
    let n = shape[2] as usize;
    if raw.len() != n * cfg.heads_kv * cfg.head_dim * cfg.elem() {
        return Err(malformed(format!("{} bytes for shape {shape:?}", raw.len())));
    }
    Ok((n, raw))
}

/// One restored layer: its offset and the K/V the next read attends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LayerState {
    pub offset: u64,
    pub n: usize,
    pub k: Vec<u8>,
    pub v: Vec<u8>,
}

/// The `states` of a reply: one per layer, or the engine broke.
pub fn parse_states(op: &str, reply: &Value, cfg: &PrefixConfig) -> Result<Vec<LayerState>, EngineFailure> {
    let malformed = |why: String| EngineFailure::Malformed { op: op.into(), reply: engine::shorten(reply), why };
    let list = reply.get("states").and_then(Value::as_array).ok_or_else(|| malformed("no list \"states\"".into()))?;
    if list.len() != cfg.layers.len() {
        return Err(malformed(format!("{} states for {} layers", list.len(), cfg.layers.len())));
    }
    let mut out = vec![];
    for s in list {
        let offset =
            s.get("offset").and_then(Value::as_u64).ok_or_else(|| malformed("a state without offset".into()))?;
        let (nk, k) = raw_tensor(op, s.get("k").unwrap_or(&Value::Null), cfg)?;
        let (nv, v) = raw_tensor(op, s.get("v").unwrap_or(&Value::Null), cfg)?;
        if nk != nv {
            return Err(malformed(format!("k holds {nk} positions, v {nv}")));
        }
        out.push(LayerState { offset, n: nk, k, v });
    }
    Ok(out)
}

fn broke(f: EngineFailure) -> EngineFailure {
    engine::break_engine(&f);
    f
}

/// The first position where two byte strings of `elem`-byte elements differ, as an element index.
fn first_diff(a: &[u8], b: &[u8], elem: usize) -> Option<usize> {
    if a.len() != b.len() {
        return Some(a.len().min(b.len()) / elem);
    }
    a.chunks(elem).zip(b.chunks(elem)).position(|(x, y)| x != y)
}

/// Runs one prefix seed (or `ops` again) against the engine installed on this thread. `Err`: the engine broke.
pub fn run(seed: u64, cfg: PrefixConfig, ops: Option<Vec<PrefixOp>>) -> Result<PrefixRun, EngineFailure> {
    let ops = ops.unwrap_or_else(|| generate(seed, &cfg));
    engine::open_run()?;
    let mut out = PrefixRun {
        trace: PrefixTrace {
            format: FORMAT.into(),
            version: 1,
            seed,
            config: cfg.clone(),
            ops: ops.clone(),
            outcome: Outcome::Pass,
        },
        applied: 0,
        checks: 0,
        hits: 0,
        ops_by_kind: BTreeMap::new(),
    };
    let layers: Vec<Value> = cfg.layers.iter().map(|w| json!({"max_size": w})).collect();
    let new = json!({"op": "prefix_new", "id": 1, "layers": layers, "heads_kv": cfg.heads_kv,
        "head_dim": cfg.head_dim, "dtype": cfg.dtype, "block_size": cfg.block_size});
    if let Err(why) = ask(new)? {
        out.trace.ops.clear();
        out.trace.outcome =
            Outcome::Fail { op_index: 0, check: "adapter_error".into(), message: format!("prefix_new: {why}") };
        return Ok(out);
    }
    let mut inserted: Vec<Vec<u32>> = vec![];
    for (i, op) in ops.iter().enumerate() {
        if matches!(op, PrefixOp::Insert { tokens } | PrefixOp::Lookup { tokens } if tokens.is_empty()) {
            continue;
        }
        out.applied += 1;
        *out.ops_by_kind.entry(op.kind().to_string()).or_insert(0) += 1;
        let failed = match op {
            PrefixOp::Insert { tokens } => {
                let (k, v) = kv_lists(&cfg, tokens);
                let r = ask(json!({"op": "prefix_insert", "id": 1, "tokens": tokens, "k": k, "v": v}))?;
                inserted.push(tokens.clone());
                r.err().map(|why| ("adapter_error", format!("prefix_insert: {why}")))
            }
            PrefixOp::Evict => match ask(json!({"op": "prefix_evict", "id": 1}))? {
                Ok(r) => {
                    r.get("evicted").and_then(Value::as_u64).ok_or_else(|| {
                        broke(EngineFailure::Malformed {
                            op: "prefix_evict".into(),
                            reply: engine::shorten(&r),
                            why: "no count \"evicted\"".into(),
                        })
                    })?;
                    None
                }
                Err(why) => Some(("adapter_error", format!("prefix_evict: {why}"))),
            },
            PrefixOp::Lookup { tokens } => {
                let (failed, checks, hit) = lookup(&cfg, tokens, &inserted)?;
                out.checks += checks;
                out.hits += u64::from(hit);
                failed
            }
        };
        out.checks += 1;
        if let Some((check, message)) = failed {
            out.trace.outcome = Outcome::Fail { op_index: i, check: check.into(), message };
            out.trace.ops.truncate(i + 1);
            return Ok(out);
        }
    }
    Ok(out)
}

type Failed = Option<(&'static str, String)>;

fn lookup(cfg: &PrefixConfig, tokens: &[u32], inserted: &[Vec<u32>]) -> Result<(Failed, u64, bool), EngineFailure> {
    let reply = match ask(json!({"op": "prefix_lookup", "id": 1, "tokens": tokens}))? {
        Ok(r) => r,
        Err(why) => return Ok((Some(("adapter_error", format!("prefix_lookup: {why}"))), 0, false)),
    };
    let matched = reply.get("matched").and_then(Value::as_u64).ok_or_else(|| {
        broke(EngineFailure::Malformed {
            op: "prefix_lookup".into(),
            reply: engine::shorten(&reply),
            why: "no count \"matched\"".into(),
        })
    })? as usize;
    if matched == 0 {
        return Ok((None, 1, false));
    }
    if matched > tokens.len() || !inserted.iter().any(|s| s.len() >= matched && s[..matched] == tokens[..matched]) {
        let m = format!(
            "a lookup of {tokens:?} restored {matched} positions, but no stored sequence begins with {:?}",
            &tokens[..matched.min(tokens.len())]
        );
        return Ok((Some(("prefix_count", m)), 1, true));
    }
    let warm = parse_states("prefix_lookup", &reply, cfg).map_err(broke)?;
    let prefix = &tokens[..matched];
    for (l, s) in warm.iter().enumerate() {
        if s.offset as usize != matched {
            let offsets: Vec<u64> = warm.iter().map(|s| s.offset).collect();
            let m = format!(
                "a lookup of {tokens:?} matched {matched} positions; layer {l} ({}) was restored at offset {} \
                 (every layer's offset: {offsets:?})",
                kind(cfg.layers[l]),
                s.offset
            );
            return Ok((Some(("prefix_offset", m)), 2, true));
        }
    }
    let (k, v) = kv_lists(cfg, prefix);
    let cold = match ask(json!({"op": "prefix_cold", "id": 1, "tokens": prefix, "k": k, "v": v}))? {
        Ok(r) => parse_states("prefix_cold", &r, cfg).map_err(broke)?,
        Err(why) => return Ok((Some(("adapter_error", format!("prefix_cold: {why}"))), 3, true)),
    };
    for (l, (w, c)) in warm.iter().zip(&cold).enumerate() {
        if w != c {
            let m = format!(
                "a lookup of {tokens:?} restored {matched} positions; layer {l} ({}) warm holds {} positions at \
                 offset {}, the cold run of {prefix:?} {} at offset {}; K {}, V {}",
                kind(cfg.layers[l]),
                w.n,
                w.offset,
                c.n,
                c.offset,
                if w.k == c.k { "equal" } else { "differs" },
                if w.v == c.v { "equal" } else { "differs" }
            );
            return Ok((Some(("prefix_warm_cold", m)), 4, true));
        }
    }
    let e = cfg.elem();
    for (l, s) in warm.iter().enumerate() {
        let n = cfg.layers[l].map_or(matched, |w| matched.min(w));
        for (which, got) in [(0u8, &s.k), (1, &s.v)] {
            let want = block(cfg, prefix, l, which, matched - n, matched);
            if s.n != n || *got != want {
                let at = first_diff(got, &want, e).unwrap_or(0);
                let (h, pos, d) = (at / (n.max(1) * cfg.head_dim), at / cfg.head_dim % n.max(1), at % cfg.head_dim);
                let m = format!(
                    "a lookup of {tokens:?} restored {matched} positions; layer {l} ({}) {} holds {} positions, \
                     kvsim's values of {prefix:?} give {n}{}",
                    kind(cfg.layers[l]),
                    ["K", "V"][which as usize],
                    s.n,
                    if s.n == n {
                        format!(": first difference at head {h}, position {}, element {d}", matched - n + pos)
                    } else {
                        String::new()
                    }
                );
                return Ok((Some(("prefix_model", m)), 4, true));
            }
        }
    }
    Ok((None, 4, true))
}

fn kind(w: Option<usize>) -> String {
    w.map_or("full attention".into(), |w| format!("window {w}"))
}

/// A prefix trace's ops again, against the engine installed on this thread.
pub fn replay(t: &PrefixTrace) -> Result<PrefixRun, EngineFailure> {
    run(t.seed, t.config.clone(), Some(t.ops.clone()))
}

/// A failing prefix trace shrunk through the engine (the same check must fail) within `budget` replays.
pub fn shrink(t: &PrefixTrace, budget: usize) -> Result<PrefixTrace, EngineFailure> {
    let Outcome::Fail { check, .. } = &t.outcome else { return Ok(t.clone()) };
    let mut last = t.clone();
    super::ddmin::shrink(&t.ops, budget, |ops| {
        let r = run(t.seed, t.config.clone(), Some(ops))?;
        Ok(match &r.trace.outcome {
            Outcome::Fail { check: c, .. } if c == check => {
                last = r.trace;
                Some(last.ops.clone())
            }
            _ => None,
        })
    })?;
    Ok(last)
}

/// Whether `reply` decodes as a prefix reply (`matched`, `states`, `evicted`) for the geometry of `cfg`: typed
/// failures for anything else, never a panic (reached by the `engine_reply` fuzz target).
pub fn decode_reply(reply: &Value, cfg: &PrefixConfig) -> bool {
    parse_states("fuzz", reply, cfg).is_ok() || reply.get("matched").and_then(Value::as_u64).is_some()
}

#[cfg(test)]
mod tests;
