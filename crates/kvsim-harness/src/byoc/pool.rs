//! Block pools in another process: the protocol-2 `pool_*` requests (oracles/PROTOCOL.md, "Block pools") driven by
//! a seeded stream of pool ops and checked after every request against kvsim's model of what each sequence holds.
//!
//! A block pool is the metadata of a paged KV cache (vLLM's block manager and its MLX ports): fixed-size blocks
//! shared by sequences through reference counts, copied before a sequence writes into one it shares, and indexed by
//! the tokens they hold so that a new sequence starts from the cached blocks of its prefix. kvsim names the
//! sequences, the engine names the blocks; the model (`pool/model.rs`) keeps which tokens each sequence holds, which
//! table the engine gave it, and under which whole prefix each block was cached, and [`run`] checks every reply and
//! the pool's whole picture (`pool_info`) after every op:
//! - `pool_refs`: each held block's count is the number of tables that list it, the free count is the usable blocks
//!   less the held ones, no block the engine calls free is in a table;
//! - `pool_tables`: every live sequence's table is the one its replies gave it, of the size its tokens need, and no
//!   fresh block (of an alloc or a copy) was held by someone else;
//! - `pool_cow`: after a copy-on-write the sequence holds each of its blocks alone (or the engine refused);
//! - `pool_storage`: no two held blocks share a storage object (a copy that shares its source's storage is no copy);
//! - `pool_lookup`: every block a lookup or a hit returns was cached holding exactly that block of the query after
//!   exactly the query's tokens before it (soundness), and blocks cached by a sequence that still holds them are
//!   found (completeness);
//! - `pool_refusal`: a request is refused exactly where the pool cannot meet it (too few free blocks);
//! - `pool_count`: the counts a reply gives (`copied`, `evicted`, `matched`) are ones the model allows.
//!
//! The draws aim at what prefix caches get wrong: token prefixes shared between sequences, the same block of tokens
//! after different prefixes, lengths on and off block boundaries, forks then copies, lookups after frees and
//! evictions.

mod model;

use std::collections::BTreeMap;

use rand::Rng;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::engine::{self, ask, EngineFailure};
use crate::sim::rng::{stream, Stream};
use model::{Model, Verdict};

/// A pool's geometry and the length of a run: drawn from the seed ([`PoolConfig::from_seed`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolConfig {
    /// Positions per block.
    pub block_size: usize,
    /// Blocks of the pool as created (`pool_new`'s `blocks`).
    pub blocks: usize,
    /// Token ids are drawn from `0..vocab`: a small vocabulary makes equal blocks after different prefixes common.
    pub vocab: u32,
    pub ops: usize,
}

impl PoolConfig {
    pub fn from_seed(seed: u64, ops: usize) -> PoolConfig {
        let mut r = stream(seed, Stream::Pool);
        PoolConfig {
            block_size: r.random_range(2..=4),
            blocks: r.random_range(5..=16),
            vocab: r.random_range(2..=5),
            ops,
        }
    }
}

/// One op of a pool run. Sequences are kvsim's numbers; an op whose sequence is not live (or, for a new one, is
/// already live) is skipped, so any subsequence of a run is a run (shrinking removes ops freely).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum PoolOp {
    /// A new sequence holding `tokens` in fresh blocks.
    Alloc { seq: u64, tokens: Vec<u32> },
    /// The sequence is done: its blocks are held once less.
    Free { seq: u64 },
    /// A new sequence sharing `seq`'s blocks.
    Fork { seq: u64, new: u64 },
    /// `seq` gets its own copy of every block it shares (before it writes).
    Cow { seq: u64 },
    /// `seq`'s full blocks become findable under its tokens.
    Cache { seq: u64 },
    /// Which cached blocks hold a prefix of `tokens`.
    Lookup { tokens: Vec<u32> },
    /// A new sequence made of the cached blocks of `tokens`' prefix.
    Hit { seq: u64, tokens: Vec<u32> },
    /// Drop up to `n` unheld cached blocks from the index.
    Evict { n: usize },
}

impl PoolOp {
    pub fn kind(&self) -> &'static str {
        match self {
            PoolOp::Alloc { .. } => "alloc",
            PoolOp::Free { .. } => "free",
            PoolOp::Fork { .. } => "fork",
            PoolOp::Cow { .. } => "cow",
            PoolOp::Cache { .. } => "cache",
            PoolOp::Lookup { .. } => "lookup",
            PoolOp::Hit { .. } => "hit",
            PoolOp::Evict { .. } => "evict",
        }
    }
}

/// The file format name of a pool trace.
pub const FORMAT: &str = "kvsim-pool-trace";

/// A pool run as a file: its seed, config, ops and outcome. It replays exactly ([`replay`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolTrace {
    pub format: String,
    pub version: u32,
    pub seed: u64,
    pub config: PoolConfig,
    pub ops: Vec<PoolOp>,
    pub outcome: crate::sim::trace::Outcome,
}

impl PoolTrace {
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }
    /// A pool trace from its JSON: a typed error for anything else.
    pub fn parse(text: &str) -> Result<PoolTrace, String> {
        let t: PoolTrace = serde_json::from_str(text).map_err(|e| format!("not a kvsim pool trace: {e}"))?;
        if t.format != FORMAT {
            return Err(format!("format is {:?}, expected {FORMAT:?}", t.format));
        }
        Ok(t)
    }
}

/// One pool run's result.
#[derive(Debug, Clone)]
pub struct PoolRun {
    pub trace: PoolTrace,
    /// Ops applied (skipped ones not counted).
    pub applied: u64,
    pub checks: u64,
    pub ops_by_kind: BTreeMap<String, u64>,
}

/// The ops of a seed: kvsim's draws for `cfg`.
pub fn generate(seed: u64, cfg: &PoolConfig) -> Vec<PoolOp> {
    let mut r = stream(seed, Stream::Workload);
    let bs = cfg.block_size;
    let mut docs: Vec<Vec<u32>> = vec![];
    let mut live: Vec<u64> = vec![];
    let mut next = 1u64;
    let mut ops = vec![];
    let fresh = |r: &mut rand_chacha::ChaCha8Rng, n: usize| -> Vec<u32> {
        (0..n).map(|_| r.random_range(0..cfg.vocab)).collect()
    };
    // Tokens for a new sequence or a query: a prefix of an earlier one (on or off a block boundary) and a new tail;
    // the same block after another prefix; or fresh.
    let draw = |r: &mut rand_chacha::ChaCha8Rng, docs: &[Vec<u32>]| -> Vec<u32> {
        let len = r.random_range(1..=4 * bs);
        if docs.is_empty() || r.random_bool(0.3) {
            return fresh(r, len);
        }
        let d = &docs[r.random_range(0..docs.len())];
        if r.random_bool(0.5) {
            let keep =
                if r.random_bool(0.5) { (r.random_range(0..=d.len()) / bs) * bs } else { r.random_range(0..=d.len()) };
            let mut t = d[..keep].to_vec();
            let tail = r.random_range(0..=2 * bs);
            t.extend(fresh(r, tail));
            if t.is_empty() {
                t = fresh(r, len);
            }
            t
        } else {
            // Another prefix of whole blocks, then one of `d`'s whole blocks and what follows it.
            let blocks = d.len() / bs;
            if blocks == 0 {
                return fresh(r, len);
            }
            let b = r.random_range(0..blocks);
            let pre = r.random_range(1..=2) * bs;
            let mut t = fresh(r, pre);
            t.extend_from_slice(&d[b * bs..]);
            t
        }
    };
    for _ in 0..cfg.ops {
        let pick = r.random_range(0..100);
        let any_live = |r: &mut rand_chacha::ChaCha8Rng, live: &[u64]| live[r.random_range(0..live.len())];
        let op = if live.is_empty() || pick < 24 {
            let tokens = draw(&mut r, &docs);
            docs.push(tokens.clone());
            live.push(next);
            next += 1;
            PoolOp::Alloc { seq: next - 1, tokens }
        } else if pick < 36 {
            let s = any_live(&mut r, &live);
            live.retain(|&x| x != s);
            PoolOp::Free { seq: s }
        } else if pick < 46 {
            let s = any_live(&mut r, &live);
            live.push(next);
            next += 1;
            PoolOp::Fork { seq: s, new: next - 1 }
        } else if pick < 57 {
            PoolOp::Cow { seq: any_live(&mut r, &live) }
        } else if pick < 73 {
            PoolOp::Cache { seq: any_live(&mut r, &live) }
        } else if pick < 84 {
            PoolOp::Lookup { tokens: draw(&mut r, &docs) }
        } else if pick < 94 {
            let tokens = draw(&mut r, &docs);
            live.push(next);
            next += 1;
            PoolOp::Hit { seq: next - 1, tokens }
        } else {
            PoolOp::Evict { n: r.random_range(1..=4) }
        };
        ops.push(op);
    }
    ops
}

struct Failed {
    check: &'static str,
    message: String,
}

fn fail(check: &'static str, message: String) -> Failed {
    Failed { check, message }
}

fn broken(op: &str, reply: &Value, why: String) -> EngineFailure {
    let f = EngineFailure::Malformed { op: op.into(), reply: engine::shorten(reply), why };
    engine::break_engine(&f);
    f
}

/// A list of non-negative integers in `field`, or the engine broke.
fn ints(op: &str, reply: &Value, field: &str) -> Result<Vec<u64>, EngineFailure> {
    reply
        .get(field)
        .and_then(Value::as_array)
        .and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<_>>>())
        .ok_or_else(|| broken(op, reply, format!("no list of block numbers {field:?}")))
}

fn count(op: &str, reply: &Value, field: &str) -> Result<u64, EngineFailure> {
    reply.get(field).and_then(Value::as_u64).ok_or_else(|| broken(op, reply, format!("no count {field:?}")))
}

/// `{"<n>": value}` with integer keys, or the engine broke.
fn int_map<T>(
    op: &str,
    reply: &Value,
    field: &str,
    f: impl Fn(&Value) -> Option<T>,
) -> Result<BTreeMap<u64, T>, EngineFailure> {
    let obj =
        reply.get(field).and_then(Value::as_object).ok_or_else(|| broken(op, reply, format!("no object {field:?}")))?;
    let mut out = BTreeMap::new();
    for (k, v) in obj {
        let key = k.parse::<u64>().ok();
        match (key, f(v)) {
            (Some(key), Some(v)) => {
                out.insert(key, v);
            }
            _ => return Err(broken(op, reply, format!("{field}: entry {k:?}: {v} is not what the protocol says"))),
        }
    }
    Ok(out)
}

/// What `pool_info` says of the pool.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolInfo {
    pub free: u64,
    pub refs: BTreeMap<u64, u64>,
    pub tables: BTreeMap<u64, Vec<u64>>,
    pub storage: BTreeMap<u64, u64>,
}

/// Decodes a `pool_info` reply: any bytes give a [`PoolInfo`] or a typed [`EngineFailure`].
pub fn parse_info(reply: &Value) -> Result<PoolInfo, EngineFailure> {
    let op = "pool_info";
    let list = |v: &Value| v.as_array().and_then(|a| a.iter().map(Value::as_u64).collect::<Option<Vec<u64>>>());
    Ok(PoolInfo {
        free: count(op, reply, "free")?,
        refs: int_map(op, reply, "refs", Value::as_u64)?,
        tables: int_map(op, reply, "tables", list)?,
        storage: int_map(op, reply, "storage", Value::as_u64)?,
    })
}

/// Whether `reply` decodes as every block-pool reply (tables, counts, `pool_info`): typed failures for anything
/// else, never a panic (the `engine_reply` fuzz target reaches it through `engine_check::decode_any`).
pub fn decode_reply(reply: &Value) -> bool {
    let op = "fuzz";
    let lists = ["table", "blocks"].map(|f| ints(op, reply, f).is_ok());
    let counts = ["usable", "copied", "matched", "evicted"].map(|f| count(op, reply, f).is_ok());
    parse_info(reply).is_ok() || lists.iter().chain(&counts).any(|&b| b)
}

/// Runs one pool seed (or `ops` again) against the engine installed on this thread. `Err`: the engine broke.
pub fn run(seed: u64, cfg: PoolConfig, ops: Option<Vec<PoolOp>>) -> Result<PoolRun, EngineFailure> {
    use crate::sim::trace::Outcome;
    let ops = ops.unwrap_or_else(|| generate(seed, &cfg));
    engine::open_run()?;
    let mut out = PoolRun {
        trace: PoolTrace {
            format: FORMAT.into(),
            version: 1,
            seed,
            config: cfg,
            ops: ops.clone(),
            outcome: Outcome::Pass,
        },
        applied: 0,
        checks: 0,
        ops_by_kind: BTreeMap::new(),
    };
    let created = ask(json!({"op": "pool_new", "id": 1, "block_size": cfg.block_size, "blocks": cfg.blocks}))?;
    let usable = match created {
        Ok(reply) => count("pool_new", &reply, "usable")?,
        Err(why) => {
            out.trace.outcome =
                Outcome::Fail { op_index: 0, check: "adapter_error".into(), message: format!("pool_new: {why}") };
            out.trace.ops.truncate(0);
            return Ok(out);
        }
    };
    let mut m = Model::new(cfg.block_size, usable);
    for (i, op) in ops.iter().enumerate() {
        match step(&mut m, op)? {
            Step::Skipped => continue,
            Step::Done(checks) => {
                out.applied += 1;
                out.checks += checks;
                *out.ops_by_kind.entry(op.kind().to_string()).or_insert(0) += 1;
            }
            Step::Failed(f) => {
                out.applied += 1;
                *out.ops_by_kind.entry(op.kind().to_string()).or_insert(0) += 1;
                out.trace.outcome = Outcome::Fail { op_index: i, check: f.check.into(), message: f.message };
                out.trace.ops.truncate(i + 1);
                return Ok(out);
            }
        }
    }
    Ok(out)
}

enum Step {
    Skipped,
    Done(u64),
    Failed(Failed),
}

fn step(m: &mut Model, op: &PoolOp) -> Result<Step, EngineFailure> {
    if !m.applies(op) {
        return Ok(Step::Skipped);
    }
    let name = |s: &str| format!("pool_{s}");
    let req = match op {
        PoolOp::Alloc { seq, tokens } => json!({"op": "pool_alloc", "id": 1, "seq": seq, "tokens": tokens}),
        PoolOp::Free { seq } => json!({"op": "pool_free", "id": 1, "seq": seq}),
        PoolOp::Fork { seq, new } => json!({"op": "pool_fork", "id": 1, "seq": seq, "new": new}),
        PoolOp::Cow { seq } => json!({"op": "pool_cow", "id": 1, "seq": seq}),
        PoolOp::Cache { seq } => json!({"op": "pool_cache", "id": 1, "seq": seq, "tokens": m.tokens(*seq)}),
        PoolOp::Lookup { tokens } => json!({"op": "pool_lookup", "id": 1, "tokens": tokens}),
        PoolOp::Hit { seq, tokens } => json!({"op": "pool_hit", "id": 1, "seq": seq, "tokens": tokens}),
        PoolOp::Evict { n } => json!({"op": "pool_evict", "id": 1, "n": n}),
    };
    let opname = name(op.kind());
    let reply = ask(req)?;
    // What the reply says, decoded (a malformed one breaks the engine), then judged by the model.
    let verdict = match (op, &reply) {
        (_, Err(why)) => m.refused(op, why),
        (PoolOp::Alloc { .. } | PoolOp::Fork { .. }, Ok(r)) => m.tabled(op, ints(&opname, r, "table")?, None),
        (PoolOp::Cow { .. }, Ok(r)) => m.tabled(op, ints(&opname, r, "table")?, Some(count(&opname, r, "copied")?)),
        (PoolOp::Hit { .. }, Ok(r)) => m.hit(op, ints(&opname, r, "table")?, count(&opname, r, "matched")?),
        (PoolOp::Lookup { tokens }, Ok(r)) => {
            m.lookup(tokens, &ints(&opname, r, "blocks")?, count(&opname, r, "matched")?)
        }
        (PoolOp::Evict { n }, Ok(r)) => m.evicted(*n, count(&opname, r, "evicted")?),
        (PoolOp::Free { .. } | PoolOp::Cache { .. }, Ok(_)) => m.done(op),
    };
    let mut checks = 1;
    if let Verdict::Fail(check, message) = verdict {
        return Ok(Step::Failed(fail(check, message)));
    }
    let info = match ask(json!({"op": "pool_info", "id": 1}))? {
        Ok(r) => parse_info(&r)?,
        Err(why) => return Ok(Step::Failed(fail("adapter_error", format!("pool_info: {why}")))),
    };
    checks += 3;
    if let Verdict::Fail(check, message) = m.audit(&info, op) {
        return Ok(Step::Failed(fail(check, message)));
    }
    Ok(Step::Done(checks))
}

/// A pool trace's ops again, against the engine installed on this thread.
pub fn replay(t: &PoolTrace) -> Result<PoolRun, EngineFailure> {
    run(t.seed, t.config, Some(t.ops.clone()))
}

/// A failing pool trace shrunk through the engine (the same check must fail) within `budget` replays.
pub fn shrink(t: &PoolTrace, budget: usize) -> Result<PoolTrace, EngineFailure> {
    use crate::sim::trace::Outcome;
    let Outcome::Fail { check, .. } = &t.outcome else { return Ok(t.clone()) };
    let mut last = t.clone();
    super::ddmin::shrink(&t.ops, budget, |ops| {
        let r = run(t.seed, t.config, Some(ops))?;
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

#[cfg(test)]
mod tests;
