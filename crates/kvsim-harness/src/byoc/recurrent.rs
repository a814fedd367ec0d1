//! Recurrent state in another process: the protocol-2 `rec_*` requests (oracles/PROTOCOL.md, "Recurrent state"),
//! driven by a seeded swarm of serial writes, batch writes, merges, extends, extracts, filters and speculative
//! blocks, and checked after every op against kvsim's model of where each request's state must be.
//!
//! A recurrent layer (Mamba's conv and SSM state, DeltaNet's state) keeps a few state arrays per request instead of
//! K/V positions; a batch holds one row of each array per request. The engines' bugs in these caches are in the
//! bookkeeping (a row that takes its neighbour's state after a merge, filter, extract or extend; a rollback that keeps
//! a step too many), not in the math, so kvsim supplies the values: the state a request holds after `p` positions is
//! a pure function of (request, `p`, array, element) ([`value`]), exact in f32 and bf16, which kvsim sends with every
//! write as a model layer assigns `cache[i] = new_state`. After every op:
//! - `rec_state`: every live request's state arrays, in the batch or outside it, are its values at the position it
//!   has reached (a cache that holds no array yet reads as zeros, the state at position 0);
//! - `rec_rows`: the batch holds as many rows as the schedule put in it;
//! - `rec_rollback`: after a speculative block is committed (each row keeping its accepted steps) or aborted, every
//!   row of the cache holds its values at its accepted position;
//! - `rec_missing_row`: an `extract` of a row the batch does not have is refused.
//!
//! A conv state (`[1, K-1, C]`) is a window of input columns: its values at position `p` are the columns of positions
//! `p-K+2 ..= p` (zeros before position 1), so an engine that rebuilds it from the previous window and the new
//! columns (mlx-vlm's `update_window`) sees the same values. This module holds no MLX: replies are compared as bytes.

use std::collections::BTreeMap;

use base64::Engine as _;
use rand::Rng;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::engine::{self, ask, EngineFailure};
use crate::sim::rng::{stream, Stream};
use crate::sim::trace::Outcome;

/// What an array of a recurrent layer holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ArrayKind {
    /// A causal convolution's window of input columns, `[1, K-1, C]`.
    Conv,
    /// A recurrent state of any shape (`[1, H, Dh, N]` for Mamba2, `[1, D, N]` for Mamba1).
    Ssm,
}

/// One state array of the layer: its kind and shape (a leading 1: one request).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecArray {
    pub kind: ArrayKind,
    pub shape: Vec<usize>,
}

impl RecArray {
    fn elements(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A run's layer and length, drawn from the seed ([`RecConfig::from_seed`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RecConfig {
    pub arrays: Vec<RecArray>,
    /// `f32` or `bf16`.
    pub dtype: String,
    /// Whether the run draws speculative blocks (the engine says `supports.rec_spec`).
    pub spec: bool,
    /// Whether the run draws right-padded prompt batches (the engine says `supports.rec_prefill`).
    #[serde(default)]
    pub prefill: bool,
    pub ops: usize,
}

impl RecConfig {
    /// A Mamba2-like layer (conv `[1, K-1, C]`, SSM `[1, H, Dh, N]`) or a Mamba1-like one (SSM `[1, D, N]`), small.
    pub fn from_seed(seed: u64, ops: usize, spec: bool, prefill: bool) -> RecConfig {
        let mut r = stream(seed, Stream::RecurrentState);
        let conv = RecArray { kind: ArrayKind::Conv, shape: vec![1, r.random_range(1..=3), r.random_range(1..=4)] };
        let ssm = if r.random_bool(0.5) {
            RecArray {
                kind: ArrayKind::Ssm,
                shape: vec![1, r.random_range(1..=2), r.random_range(1..=3), r.random_range(1..=3)],
            }
        } else {
            RecArray { kind: ArrayKind::Ssm, shape: vec![1, r.random_range(1..=4), r.random_range(1..=3)] }
        };
        RecConfig {
            arrays: vec![conv, ssm],
            dtype: if r.random_bool(0.5) { "f32".into() } else { "bf16".into() },
            spec,
            prefill,
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

/// One op of a recurrent run. Requests are kvsim's numbers, rows the running batch's indices at the time of the op;
/// an op that does not fit the state the ops before it left (a request not live, a row the batch does not have) is
/// skipped, so any subsequence of a run is a run.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum RecOp {
    /// A new request on an empty serial cache.
    Admit { req: u64 },
    /// A serial request advances `n` positions.
    Write { req: u64, n: usize },
    /// Every row of the running batch advances `n` positions.
    RowsWrite { n: usize },
    /// Serial requests are merged into a new batch, which then extends the running batch (or becomes it).
    Enter { reqs: Vec<u64> },
    /// Row `row` leaves the batch as a serial cache (`extract`, then `filter` of the others).
    Extract { row: usize },
    /// The batch keeps these rows, in this order; the others are finished.
    Filter { keep: Vec<usize> },
    /// An `extract` of a row the batch does not have: it must be refused.
    ExtractMissing { row: usize },
    /// A speculative block of `n` steps on the batch (`req` None) or a serial request: start, writes of `steps`
    /// positions (summing to `n`), then commit `accept` (one count per row) or abort (`accept` None).
    Spec { req: Option<u64>, n: usize, steps: Vec<usize>, accept: Option<Vec<usize>> },
    /// New requests' prompts of `lengths` positions, prefilled together as one right-padded batch in writes of
    /// `chunk` steps (every row gets the longest prompt's steps; row `r`'s steps past `lengths[r]` are padding), as
    /// mlx-lm's `BatchGenerator` prompts a batch: `merge` of their empty caches, `prepare(lengths)`, the writes,
    /// `finalize`; the batch then extends the running one (or becomes it).
    Prefill { reqs: Vec<u64>, lengths: Vec<usize>, chunk: usize },
}

impl RecOp {
    pub fn kind(&self) -> &'static str {
        match self {
            RecOp::Admit { .. } => "admit",
            RecOp::Write { .. } => "write",
            RecOp::RowsWrite { .. } => "rows_write",
            RecOp::Enter { .. } => "enter",
            RecOp::Extract { .. } => "extract",
            RecOp::Filter { .. } => "filter",
            RecOp::ExtractMissing { .. } => "extract_missing",
            RecOp::Spec { accept: Some(_), .. } => "spec_commit",
            RecOp::Spec { accept: None, .. } => "spec_abort",
            RecOp::Prefill { .. } => "prefill",
        }
    }
}

/// The file format name of a recurrent trace.
pub const FORMAT: &str = "kvsim-recurrent-trace";

/// A recurrent run as a file; it replays exactly ([`replay`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecTrace {
    pub format: String,
    pub version: u32,
    pub seed: u64,
    pub config: RecConfig,
    pub ops: Vec<RecOp>,
    pub outcome: Outcome,
}

impl RecTrace {
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }
    /// A recurrent trace from its JSON: a typed error for anything else.
    pub fn parse(text: &str) -> Result<RecTrace, String> {
        let t: RecTrace = serde_json::from_str(text).map_err(|e| format!("not a kvsim recurrent trace: {e}"))?;
        if t.format != FORMAT {
            return Err(format!("format is {:?}, expected {FORMAT:?}", t.format));
        }
        if t.config.dtype != "f32" && t.config.dtype != "bf16" {
            return Err(format!("dtype {:?}: f32 or bf16", t.config.dtype));
        }
        let fits = |a: &RecArray| {
            a.shape.len() >= 2
                && a.shape.len() <= 6
                && a.shape[0] == 1
                && a.shape.iter().all(|&d| (1..=64).contains(&d))
                && (a.kind != ArrayKind::Conv || a.shape.len() == 3)
        };
        if t.config.arrays.is_empty() || t.config.arrays.len() > 8 || !t.config.arrays.iter().all(fits) {
            return Err("a recurrent config needs 1 to 8 arrays of shape [1, ...] (2 to 6 axes of 1 to 64)".into());
        }
        Ok(t)
    }
}

/// One recurrent run's result.
#[derive(Debug, Clone)]
pub struct RecRun {
    pub trace: RecTrace,
    pub applied: u64,
    pub checks: u64,
    pub ops_by_kind: BTreeMap<String, u64>,
}

/// The schedule's picture: where every live request is and how far it has advanced. Generation and runs share it,
/// so a run skips exactly the ops that do not fit.
#[derive(Debug, Clone, Default)]
struct Sched {
    /// Live request -> position reached.
    pos: BTreeMap<u64, usize>,
    /// Serial requests -> their engine id.
    serial: BTreeMap<u64, u64>,
    /// The running batch: its engine id and its requests in row order.
    batch: Option<(u64, Vec<u64>)>,
    next_id: u64,
}

impl Sched {
    fn fresh(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }
    fn rows(&self) -> usize {
        self.batch.as_ref().map_or(0, |b| b.1.len())
    }
    fn applies(&self, op: &RecOp) -> bool {
        let rows = self.rows();
        let distinct = |v: &[usize]| v.iter().collect::<std::collections::BTreeSet<_>>().len() == v.len();
        match op {
            RecOp::Admit { req } => !self.pos.contains_key(req),
            RecOp::Write { req, n } => self.serial.contains_key(req) && *n > 0,
            RecOp::RowsWrite { n } => rows > 0 && *n > 0,
            RecOp::Enter { reqs } => {
                !reqs.is_empty()
                    && reqs.iter().all(|r| self.serial.contains_key(r))
                    && reqs.iter().collect::<std::collections::BTreeSet<_>>().len() == reqs.len()
            }
            RecOp::Extract { row } => *row < rows,
            RecOp::Filter { keep } => rows > 0 && keep.iter().all(|&k| k < rows) && distinct(keep),
            RecOp::ExtractMissing { row } => rows > 0 && *row >= rows,
            RecOp::Spec { req, n, steps, accept } => {
                let target_rows = match req {
                    Some(r) if self.serial.contains_key(r) => 1,
                    Some(_) => return false,
                    None => rows,
                };
                target_rows > 0
                    && *n > 0
                    && steps.iter().sum::<usize>() == *n
                    && steps.iter().all(|&s| s > 0)
                    && accept.as_ref().is_none_or(|a| a.len() == target_rows && a.iter().all(|&x| x <= *n))
            }
            RecOp::Prefill { reqs, lengths, chunk } => {
                !reqs.is_empty()
                    && reqs.len() == lengths.len()
                    && reqs.iter().all(|q| !self.pos.contains_key(q))
                    && reqs.iter().collect::<std::collections::BTreeSet<_>>().len() == reqs.len()
                    && lengths.iter().all(|&l| (1..=64).contains(&l))
                    && (1..=64).contains(chunk)
            }
        }
    }
}

/// The ops of a seed: kvsim's draws for `cfg`.
pub fn generate(seed: u64, cfg: &RecConfig) -> Vec<RecOp> {
    let mut r = stream(seed, Stream::Workload);
    let mut s = Sched::default();
    let mut next_req = 1u64;
    let mut ops = vec![];
    while ops.len() < cfg.ops {
        let pick = r.random_range(0..100);
        let serial: Vec<u64> = s.serial.keys().copied().collect();
        let rows = s.rows();
        let op = if serial.is_empty() && rows == 0 || pick < 14 {
            next_req += 1;
            RecOp::Admit { req: next_req - 1 }
        } else if pick < 32 && !serial.is_empty() {
            RecOp::Write { req: serial[r.random_range(0..serial.len())], n: r.random_range(1..=3) }
        } else if pick < 50 && rows > 0 {
            RecOp::RowsWrite { n: r.random_range(1..=2) }
        } else if pick < 64 && !serial.is_empty() {
            let k = r.random_range(1..=serial.len().min(3));
            let mut reqs = vec![];
            while reqs.len() < k {
                let q = serial[r.random_range(0..serial.len())];
                if !reqs.contains(&q) {
                    reqs.push(q);
                }
            }
            RecOp::Enter { reqs }
        } else if pick < 72 && rows > 0 {
            RecOp::Extract { row: r.random_range(0..rows) }
        } else if pick < 80 && rows > 0 {
            let keep: Vec<usize> = (0..rows).filter(|_| r.random_bool(0.7)).collect();
            RecOp::Filter { keep }
        } else if pick < 84 && rows > 0 {
            RecOp::ExtractMissing { row: rows + r.random_range(0..2) }
        } else if cfg.prefill && pick < 92 {
            let k = r.random_range(1..=3);
            let reqs: Vec<u64> = (next_req..next_req + k).collect();
            next_req += k;
            let lengths = (0..k).map(|_| r.random_range(1..=6)).collect();
            RecOp::Prefill { reqs, lengths, chunk: r.random_range(1..=4) }
        } else if cfg.spec && (rows > 0 || !serial.is_empty()) {
            let req = if rows > 0 && (serial.is_empty() || r.random_bool(0.6)) {
                None
            } else {
                Some(serial[r.random_range(0..serial.len())])
            };
            let target = if req.is_some() { 1 } else { rows };
            let n = r.random_range(1..=4);
            let mut steps = vec![];
            let mut left = n;
            while left > 0 {
                let t = r.random_range(1..=left);
                steps.push(t);
                left -= t;
            }
            let accept = r.random_bool(0.8).then(|| (0..target).map(|_| r.random_range(0..=n)).collect());
            RecOp::Spec { req, n, steps, accept }
        } else if !serial.is_empty() {
            RecOp::Write { req: serial[r.random_range(0..serial.len())], n: r.random_range(1..=3) }
        } else {
            RecOp::RowsWrite { n: 1 }
        };
        if s.applies(&op) {
            advance(&mut s, &op);
            ops.push(op);
        }
    }
    ops
}

/// The schedule after `op` (positions, where each request lives), without an engine: what the run's checks expect.
fn advance(s: &mut Sched, op: &RecOp) {
    match op {
        RecOp::Admit { req } => {
            let id = s.fresh();
            s.pos.insert(*req, 0);
            s.serial.insert(*req, id);
        }
        RecOp::Write { req, n } => *s.pos.entry(*req).or_insert(0) += n,
        RecOp::RowsWrite { n } => {
            for q in s.batch.as_ref().map(|b| b.1.clone()).unwrap_or_default() {
                *s.pos.entry(q).or_insert(0) += n;
            }
        }
        RecOp::Enter { reqs } => {
            let merged = s.fresh();
            for q in reqs {
                s.serial.remove(q);
            }
            match &mut s.batch {
                Some((_, rows)) => rows.extend(reqs),
                None => s.batch = Some((merged, reqs.clone())),
            }
        }
        RecOp::Extract { row } => {
            let id = s.fresh();
            if let Some((_, rows)) = &mut s.batch {
                let q = rows.remove(*row);
                s.serial.insert(q, id);
                if rows.is_empty() {
                    s.batch = None;
                }
            }
        }
        RecOp::Filter { keep } => {
            if let Some((_, rows)) = &mut s.batch {
                let kept: Vec<u64> = keep.iter().map(|&k| rows[k]).collect();
                for q in rows.iter() {
                    if !kept.contains(q) {
                        s.pos.remove(q);
                    }
                }
                *rows = kept;
                if rows.is_empty() {
                    s.batch = None;
                }
            }
        }
        RecOp::ExtractMissing { .. } => {
            s.fresh();
        }
        RecOp::Spec { req, accept, .. } => {
            let targets = match req {
                Some(q) => vec![*q],
                None => s.batch.as_ref().map(|b| b.1.clone()).unwrap_or_default(),
            };
            for (i, q) in targets.iter().enumerate() {
                let add = accept.as_ref().map_or(0, |a| a[i]);
                *s.pos.entry(*q).or_insert(0) += add;
            }
        }
        RecOp::Prefill { reqs, lengths, .. } => {
            for _ in reqs {
                s.fresh();
            }
            let merged = s.fresh();
            for (q, l) in reqs.iter().zip(lengths) {
                s.pos.insert(*q, *l);
            }
            match &mut s.batch {
                Some((_, rows)) => rows.extend(reqs),
                None => s.batch = Some((merged, reqs.clone())),
            }
        }
    }
}

fn column(req: u64, position: usize, array: usize, n: usize) -> Vec<f32> {
    let mut h = blake3::Hasher::new();
    h.update(b"kvsim recurrent value");
    h.update(&req.to_le_bytes());
    h.update(&(position as u64).to_le_bytes());
    h.update(&(array as u64).to_le_bytes());
    let mut raw = vec![0u8; n];
    h.finalize_xof().fill(&mut raw);
    raw.into_iter().map(|b| f32::from(b as i8) / 16.0).collect()
}

/// Request `req`'s array `array` after `pos` positions, as little-endian bytes of the run's dtype, row-major over
/// the array's shape. An SSM state is a fresh multiple of 1/16 in [-8, 8) per element at every position, zeros at
/// position 0; a conv window `[1, W, C]` holds the columns of positions `pos-W+1 ..= pos` (zeros before position 1),
/// each column a function of (request, its position, array). Exact in bf16 and f32.
pub fn value(cfg: &RecConfig, req: u64, pos: usize, array: usize) -> Vec<u8> {
    let a = &cfg.arrays[array];
    let xs: Vec<f32> = match a.kind {
        ArrayKind::Ssm if pos == 0 => vec![0.0; a.elements()],
        ArrayKind::Ssm => column(req, pos, array, a.elements()),
        ArrayKind::Conv => {
            let (w, c) = (a.shape[1], a.shape[2]);
            (0..w)
                .flat_map(|j| {
                    let q = pos as i64 - w as i64 + 1 + j as i64;
                    if q < 1 {
                        vec![0.0; c]
                    } else {
                        column(req, q as usize, array, c)
                    }
                })
                .collect()
        }
    };
    let mut out = Vec::with_capacity(xs.len() * cfg.elem());
    for x in xs {
        if cfg.dtype == "bf16" {
            out.extend_from_slice(&half::bf16::from_f32(x).to_bits().to_le_bytes());
        } else {
            out.extend_from_slice(&x.to_le_bytes());
        }
    }
    out
}

/// The request number whose values stand for the padding steps of request `req`'s prompt: no request of a run
/// (runs number theirs from 1 up), so a row that kept a padding step's state is told apart from every request's.
/// Its own inverse: `pad_of(pad_of(q)) == q`.
fn pad_of(req: u64) -> u64 {
    u64::MAX - req
}

/// The `states` of a write: per array `[B, n, ...]`, row `b`'s step `t` its request's value at `pos + t`, for
/// `t` in `1..=n`; where the row has `real` steps (a right-padded prefill), its steps past them are padding (the
/// values of [`pad_of`] its request at those positions).
fn write_states(cfg: &RecConfig, rows: &[(u64, usize)], n: usize, real: Option<&[usize]>) -> Value {
    let arrays = (0..cfg.arrays.len())
        .map(|a| {
            let mut bytes = vec![];
            for (b, &(req, pos)) in rows.iter().enumerate() {
                for t in 1..=n {
                    let padding = real.is_some_and(|real| t > real[b]);
                    bytes.extend(value(cfg, if padding { pad_of(req) } else { req }, pos + t, a));
                }
            }
            let mut shape = vec![rows.len(), n];
            shape.extend(&cfg.arrays[a].shape[1..]);
            json!({"dtype": cfg.dtype, "shape": shape, "b64": base64::engine::general_purpose::STANDARD.encode(bytes)})
        })
        .collect();
    Value::Array(arrays)
}

fn malformed(op: &str, reply: &Value, why: String) -> EngineFailure {
    EngineFailure::Malformed { op: op.into(), reply: engine::shorten(reply), why }
}

/// The `arrays` of a `rec_state` / `rec_rows_state` reply: per array its bytes, `None` where the cache holds none
/// (null). Any bytes give the arrays or a typed failure: another dtype or missing bytes `malformed`, another shape
/// than the array's `wrong_shape`.
pub fn parse_arrays(op: &str, reply: &Value, cfg: &RecConfig) -> Result<Vec<Option<Vec<u8>>>, EngineFailure> {
    let list = reply
        .get("arrays")
        .and_then(Value::as_array)
        .ok_or_else(|| malformed(op, reply, "no list \"arrays\"".into()))?;
    if list.len() != cfg.arrays.len() {
        return Err(malformed(op, reply, format!("{} arrays for a layer of {}", list.len(), cfg.arrays.len())));
    }
    let mut out = vec![];
    for (i, (t, a)) in list.iter().zip(&cfg.arrays).enumerate() {
        if t.is_null() {
            out.push(None);
            continue;
        }
        let shape: Vec<i64> = t
            .get("shape")
            .and_then(Value::as_array)
            .and_then(|s| s.iter().map(Value::as_i64).collect::<Option<Vec<_>>>())
            .ok_or_else(|| malformed(op, reply, format!("array {i}: no integer shape")))?;
        if t.get("dtype").and_then(Value::as_str) != Some(cfg.dtype.as_str()) {
            return Err(malformed(
                op,
                reply,
                format!("array {i}: dtype {:?}, the run's is {:?}", t.get("dtype"), cfg.dtype),
            ));
        }
        let raw =
            super::engine::frame::array_bytes(t).map_err(|why| malformed(op, reply, format!("array {i}: {why}")))?;
        let want: Vec<i64> = a.shape.iter().map(|&d| d as i64).collect();
        if shape != want {
            return Err(EngineFailure::WrongShape {
                op: op.into(),
                field: format!("arrays[{i}]"),
                got: shape,
                want: format!("{want:?}"),
            });
        }
        if raw.len() != a.elements() * cfg.elem() {
            return Err(malformed(op, reply, format!("array {i}: {} bytes for shape {want:?}", raw.len())));
        }
        out.push(Some(raw));
    }
    Ok(out)
}

fn broke(f: EngineFailure) -> EngineFailure {
    engine::break_engine(&f);
    f
}

/// Sends `reqs` (one `batch` round trip where the engine answers it) and answers each reply: `Ok` answered, `Err`
/// refused.
fn ask_all(reqs: Vec<Value>) -> Result<Vec<Result<Value, String>>, EngineFailure> {
    if reqs.len() > 1 && engine::with_engine(|e| e.hello().batch)? {
        let replies = engine::with_engine(|e| e.request_batch(reqs))??;
        return Ok(replies
            .into_iter()
            .map(|r| {
                if r["ok"] == Value::Bool(true) {
                    Ok(r)
                } else {
                    Err(engine::EngineRefused(r.get("error").map_or("no message".into(), |e| e.to_string()))
                        .to_string())
                }
            })
            .collect());
    }
    reqs.into_iter().map(ask).collect()
}

type Failed = Option<(&'static str, String)>;

/// Runs one recurrent seed (or `ops` again) against the engine installed on this thread. `Err`: the engine broke.
pub fn run(seed: u64, cfg: RecConfig, ops: Option<Vec<RecOp>>) -> Result<RecRun, EngineFailure> {
    let ops = ops.unwrap_or_else(|| generate(seed, &cfg));
    engine::open_run()?;
    let mut out = RecRun {
        trace: RecTrace {
            format: FORMAT.into(),
            version: 1,
            seed,
            config: cfg.clone(),
            ops: ops.clone(),
            outcome: Outcome::Pass,
        },
        applied: 0,
        checks: 0,
        ops_by_kind: BTreeMap::new(),
    };
    let mut s = Sched::default();
    for (i, op) in ops.iter().enumerate() {
        if !s.applies(op) {
            continue;
        }
        out.applied += 1;
        *out.ops_by_kind.entry(op.kind().to_string()).or_insert(0) += 1;
        let failed = step(&cfg, &mut s, op, &mut out.checks)?;
        if let Some((check, message)) = failed {
            out.trace.outcome = Outcome::Fail { op_index: i, check: check.into(), message };
            out.trace.ops.truncate(i + 1);
            return Ok(out);
        }
    }
    Ok(out)
}

fn refused(call: &str, why: String) -> Failed {
    Some(("adapter_error", format!("{call}: {why}")))
}

fn new_request(cfg: &RecConfig, id: u64) -> Value {
    let arrays: Vec<Value> = cfg.arrays.iter().map(|a| json!({"kind": a.kind, "shape": a.shape})).collect();
    json!({"op": "rec_new", "id": id, "arrays": arrays, "dtype": cfg.dtype})
}

/// Carries out `op` on the engine (the model moves with it), then checks every live request.
fn step(cfg: &RecConfig, s: &mut Sched, op: &RecOp, checks: &mut u64) -> Result<Failed, EngineFailure> {
    let rows_of = |s: &Sched, reqs: &[u64]| -> Vec<(u64, usize)> { reqs.iter().map(|q| (*q, s.pos[q])).collect() };
    match op {
        RecOp::Admit { .. } => {
            let id = s.next_id + 1;
            if let Err(why) = ask(new_request(cfg, id))? {
                return Ok(refused("rec_new", why));
            }
            advance(s, op);
        }
        RecOp::Write { req, n } => {
            let states = write_states(cfg, &rows_of(s, &[*req]), *n, None);
            if let Err(why) = ask(json!({"op": "rec_write", "id": s.serial[req], "n": n, "states": states}))? {
                return Ok(refused("rec_write", why));
            }
            advance(s, op);
        }
        RecOp::RowsWrite { n } => {
            let (id, reqs) = s.batch.clone().unwrap_or_default();
            let states = write_states(cfg, &rows_of(s, &reqs), *n, None);
            if let Err(why) = ask(json!({"op": "rec_write", "id": id, "n": n, "states": states}))? {
                return Ok(refused("rec_write", why));
            }
            advance(s, op);
        }
        RecOp::Enter { reqs } => {
            let merged = s.next_id + 1;
            let ids: Vec<u64> = reqs.iter().map(|q| s.serial[q]).collect();
            if let Err(why) = ask(json!({"op": "rec_merge", "id": merged, "rows": ids}))? {
                return Ok(refused("rec_merge", why));
            }
            if let Some((running, _)) = &s.batch {
                if let Err(why) = ask(json!({"op": "rec_extend", "id": running, "other": merged}))? {
                    return Ok(refused("rec_extend", why));
                }
            }
            advance(s, op);
        }
        RecOp::Extract { row } => {
            let (id, reqs) = s.batch.clone().unwrap_or_default();
            let new = s.next_id + 1;
            if let Err(why) = ask(json!({"op": "rec_extract", "id": id, "row": row, "new": new}))? {
                return Ok(refused("rec_extract", why));
            }
            if reqs.len() > 1 {
                let keep: Vec<usize> = (0..reqs.len()).filter(|r| r != row).collect();
                if let Err(why) = ask(json!({"op": "rec_filter", "id": id, "keep": keep}))? {
                    return Ok(refused("rec_filter", why));
                }
            }
            advance(s, op);
        }
        RecOp::Filter { keep } => {
            let (id, _) = s.batch.clone().unwrap_or_default();
            if !keep.is_empty() {
                if let Err(why) = ask(json!({"op": "rec_filter", "id": id, "keep": keep}))? {
                    return Ok(refused("rec_filter", why));
                }
            }
            advance(s, op);
        }
        RecOp::ExtractMissing { row } => {
            let (id, reqs) = s.batch.clone().unwrap_or_default();
            let new = s.next_id + 1;
            advance(s, op);
            *checks += 1;
            if ask(json!({"op": "rec_extract", "id": id, "row": row, "new": new}))?.is_ok() {
                let m = format!(
                    "an extract of row {row} from a batch of {} rows returned a cache instead of raising",
                    reqs.len()
                );
                return Ok(Some(("rec_missing_row", m)));
            }
        }
        RecOp::Spec { req, n, steps, accept } => return spec(cfg, s, (*req, *n, steps, accept.as_ref()), checks),
        RecOp::Prefill { reqs, lengths, chunk } => {
            if let Some(f) = prefill(cfg, s, reqs, lengths, *chunk)? {
                return Ok(Some(f));
            }
            advance(s, op);
        }
    }
    audit(cfg, s, None, checks)
}

/// A right-padded prompt batch of new requests (`RecOp::Prefill`), up to its `rec_finalize` and the extend of the
/// running batch; the model moves after it.
fn prefill(cfg: &RecConfig, s: &Sched, reqs: &[u64], lengths: &[usize], chunk: usize) -> Result<Failed, EngineFailure> {
    let ids: Vec<u64> = (1..=reqs.len() as u64).map(|i| s.next_id + i).collect();
    for &id in &ids {
        if let Err(why) = ask(new_request(cfg, id))? {
            return Ok(refused("rec_new", why));
        }
    }
    let merged = s.next_id + reqs.len() as u64 + 1;
    if let Err(why) = ask(json!({"op": "rec_merge", "id": merged, "rows": ids}))? {
        return Ok(refused("rec_merge", why));
    }
    let longest = lengths.iter().copied().max().unwrap_or(0);
    let padding: Vec<usize> = lengths.iter().map(|l| longest - l).collect();
    let prepare = json!({"op": "rec_prepare", "id": merged, "lengths": lengths, "right_padding": padding});
    if let Err(why) = ask(prepare)? {
        return Ok(refused("rec_prepare", why));
    }
    let mut done = 0;
    while done < longest {
        let n = chunk.min(longest - done);
        let rows: Vec<(u64, usize)> = reqs.iter().map(|&q| (q, done)).collect();
        let real: Vec<usize> = lengths.iter().map(|&l| l.saturating_sub(done).min(n)).collect();
        let states = write_states(cfg, &rows, n, Some(&real));
        if let Err(why) = ask(json!({"op": "rec_write", "id": merged, "n": n, "states": states}))? {
            return Ok(refused("rec_write", why));
        }
        done += n;
    }
    if let Err(why) = ask(json!({"op": "rec_finalize", "id": merged}))? {
        return Ok(refused("rec_finalize", why));
    }
    if let Some((running, _)) = &s.batch {
        if let Err(why) = ask(json!({"op": "rec_extend", "id": running, "other": merged}))? {
            return Ok(refused("rec_extend", why));
        }
    }
    Ok(None)
}

fn spec(
    cfg: &RecConfig,
    s: &mut Sched,
    (req, n, steps, accept): (Option<u64>, usize, &[usize], Option<&Vec<usize>>),
    checks: &mut u64,
) -> Result<Failed, EngineFailure> {
    let (id, targets) = match req {
        Some(q) => (s.serial[&q], vec![q]),
        None => s.batch.clone().unwrap_or_default(),
    };
    let start: Vec<usize> = targets.iter().map(|q| s.pos[q]).collect();
    if let Err(why) = ask(json!({"op": "rec_spec_start", "id": id, "n": n}))? {
        return Ok(refused("rec_spec_start", why));
    }
    for &t in steps {
        let rows: Vec<(u64, usize)> = targets.iter().map(|q| (*q, s.pos[q])).collect();
        let states = write_states(cfg, &rows, t, None);
        if let Err(why) = ask(json!({"op": "rec_write", "id": id, "n": t, "states": states}))? {
            return Ok(refused("rec_write", why));
        }
        for q in &targets {
            *s.pos.get_mut(q).expect("a live request") += t;
        }
        if let Some(f) = audit(cfg, s, None, checks)? {
            return Ok(Some(f));
        }
    }
    let reply = match accept {
        Some(a) => ask(json!({"op": "rec_spec_commit", "id": id, "accept": a}))?,
        None => ask(json!({"op": "rec_spec_abort", "id": id}))?,
    };
    if let Err(why) = reply {
        return Ok(refused(if accept.is_some() { "rec_spec_commit" } else { "rec_spec_abort" }, why));
    }
    for (i, q) in targets.iter().enumerate() {
        s.pos.insert(*q, start[i] + accept.map_or(0, |a| a[i]));
    }
    audit(cfg, s, Some(&targets), checks)
}

/// Where a request lives, for messages.
fn place(s: &Sched, q: u64) -> String {
    match s.batch.as_ref().and_then(|(_, rows)| rows.iter().position(|&x| x == q)) {
        Some(r) => format!("request {q} (row {r} of the batch)"),
        None => format!("request {q} (serial)"),
    }
}

/// Which live request's values (or the padding of its prompt: [`pad_of`]), at which position, `got` (array `a`)
/// equals: a row that took its neighbour's state, or kept a padding step's, says so.
fn whose(cfg: &RecConfig, s: &Sched, a: usize, got: &[u8]) -> Option<(u64, usize)> {
    let top = s.pos.values().copied().max().unwrap_or(0) + 64;
    let reqs = s.pos.keys().flat_map(|&q| [q, pad_of(q)]);
    reqs.flat_map(|q| (1..=top).map(move |p| (q, p))).find(|&(q, p)| value(cfg, q, p, a) == got)
}

/// Reads every live request's state (the batch's row count and rows, then each serial cache) and checks them
/// against the model. `rollback`: the requests whose speculative block was just committed or aborted.
fn audit(cfg: &RecConfig, s: &Sched, rollback: Option<&[u64]>, checks: &mut u64) -> Result<Failed, EngineFailure> {
    let mut reqs = vec![];
    let mut who: Vec<u64> = vec![];
    if let Some((id, rows)) = &s.batch {
        reqs.push(json!({"op": "rec_rows_info", "id": id}));
        for (r, q) in rows.iter().enumerate() {
            reqs.push(json!({"op": "rec_rows_state", "id": id, "row": r}));
            who.push(*q);
        }
    }
    for (q, id) in &s.serial {
        reqs.push(json!({"op": "rec_state", "id": id}));
        who.push(*q);
    }
    let replies = ask_all(reqs)?;
    let mut replies = replies.into_iter();
    if let Some((_, rows)) = &s.batch {
        let info = replies.next().unwrap_or_else(|| Err("no reply".into()));
        let r = match info {
            Ok(r) => r,
            Err(why) => return Ok(refused("rec_rows_info", why)),
        };
        let got = r
            .get("rows")
            .and_then(Value::as_u64)
            .ok_or_else(|| broke(malformed("rec_rows_info", &r, "no count \"rows\"".into())))?;
        *checks += 1;
        if got as usize != rows.len() {
            let m = format!("the batch holds {got} rows; the schedule put {} in it (requests {rows:?})", rows.len());
            return Ok(Some(("rec_rows", m)));
        }
    }
    for (q, reply) in who.into_iter().zip(replies) {
        let call = if s.serial.contains_key(&q) { "rec_state" } else { "rec_rows_state" };
        let r = match reply {
            Ok(r) => r,
            Err(why) => return Ok(refused(call, why)),
        };
        let arrays = parse_arrays(call, &r, cfg).map_err(broke)?;
        let p = s.pos[&q];
        for (a, got) in arrays.iter().enumerate() {
            *checks += 1;
            let want = value(cfg, q, p, a);
            let zeros = vec![0u8; want.len()];
            let got = got.as_ref().unwrap_or(&zeros);
            if *got == want {
                continue;
            }
            let e = cfg.elem();
            let at = got.chunks(e).zip(want.chunks(e)).position(|(x, y)| x != y).unwrap_or(0);
            let check = if rollback.is_some_and(|t| t.contains(&q)) { "rec_rollback" } else { "rec_state" };
            let held = match whose(cfg, s, a, got) {
                Some((o, op)) if o == q => format!("; it is this request's state at position {op}"),
                Some((o, op)) if o == pad_of(q) => {
                    format!("; it is the state of a padding step of its prompt (position {op})")
                }
                Some((o, op)) if s.pos.contains_key(&pad_of(o)) => {
                    format!("; it is the state of a padding step of {}'s prompt (position {op})", place(s, pad_of(o)))
                }
                Some((o, op)) => format!("; it is {}'s state at position {op}", place(s, o)),
                None if got.iter().all(|&b| b == 0) => "; it is all zeros".into(),
                None => String::new(),
            };
            let m = format!(
                "{} at position {p}: array {a} ({:?} {:?}) differs from kvsim's value from element {at}{held}",
                place(s, q),
                cfg.arrays[a].kind,
                cfg.arrays[a].shape,
            );
            return Ok(Some((check, m)));
        }
    }
    Ok(None)
}

/// A recurrent trace's ops again, against the engine installed on this thread.
pub fn replay(t: &RecTrace) -> Result<RecRun, EngineFailure> {
    run(t.seed, t.config.clone(), Some(t.ops.clone()))
}

/// A failing recurrent trace shrunk through the engine (the same check must fail) within `budget` replays.
pub fn shrink(t: &RecTrace, budget: usize) -> Result<RecTrace, EngineFailure> {
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

/// Whether `reply` decodes as a recurrent reply (`arrays` of a small Mamba2-like layer of `dtype`, or `rows`): typed
/// failures for anything else, never a panic (reached by the `engine_reply` fuzz target).
pub fn decode_reply(reply: &Value, dtype: &str) -> bool {
    let cfg = RecConfig {
        arrays: vec![
            RecArray { kind: ArrayKind::Conv, shape: vec![1, 2, 2] },
            RecArray { kind: ArrayKind::Ssm, shape: vec![1, 1, 2, 2] },
        ],
        dtype: dtype.into(),
        spec: false,
        prefill: false,
        ops: 0,
    };
    parse_arrays("fuzz", reply, &cfg).is_ok()
}

#[cfg(test)]
mod tests;
