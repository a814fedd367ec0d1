//! The oracle step recorder (`oracles/PROTOCOL.md`): while the runner executes a trace, it appends one protocol step
//! per production call (with the exact input arrays) and computes **kvsim's own result record** for the same step,
//! in the format the mlx-lm driver writes. It is a [`RunObserver`] of the run: the families describe their calls
//! ([`Call`]) and it turns them into protocol steps; without it nothing here runs.
//!
//! Beside the steps and results it keeps a [`StepInfo`] per step: what kvsim knew when it made the call (the op,
//! the requests, their offsets, whether the ring may have wrapped, the trim it asked for and what kvsim did). The
//! step JSON itself is not needed to compare (`oracle check` runs without it), so building it (base64 of every
//! array) is optional ([`Recorder::new`]`(.., emit_steps)`).

use std::collections::{BTreeMap, BTreeSet};

use base64::Engine;
use serde_json::{json, Map, Value};
use sha2::{Digest, Sha256};

use kvsim_cache::bytes::{ArrayBytes, Words};
use kvsim_harness::sim::observe::{Call, RunObserver, StateView};
pub use kvsim_harness::sim::observe::{Read, TrimInfo};
use kvsim_harness::sim::ops::Op;

/// sha256 of the empty byte string (a view of no positions, a row with no real query).
pub const EMPTY_SHA: &str = "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855";

/// One request's view in a checkpoint: its offset and, per layer, the sha256 of its temporal K and V views.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReqView {
    pub offset: i64,
    pub k: Vec<String>,
    pub v: Vec<String>,
}

/// What a result record says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// A read: sha256 per row of the row's output at its real queries.
    Rows(Vec<String>),
    /// A trim: the count trimmed (0 = refused).
    Trimmed(i64),
    /// kvsim only: a per-row trim with unequal counts (what each row dropped; all 0 when kvsim refused).
    TrimmedRows(Vec<usize>),
    /// A conversion: whether the caches changed storage.
    Converted(bool),
    /// The driver only: mlx-lm's trim entry point trimmed nothing on a wrapped ring (bug-catalog #18), and the
    /// driver re-synced by replay (PROTOCOL.md decision 14): the caches rebuilt from the request's writes less the
    /// newest `replayed` positions.
    Resynced {
        trimmed: i64,
        replayed: i64,
    },
    /// The state of every live request at the end of a kvsim op.
    Checkpoint {
        op: i64,
        reqs: BTreeMap<u32, ReqView>,
    },
    Unsupported(String),
    Error(String),
}

/// Read outputs by the sha256 of their bytes (`[H, n, D]` row-major little-endian, as the result records hash them).
pub type Values = BTreeMap<String, Vec<u8>>;

/// One result record (one JSON line of RESULTS).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub step: usize,
    pub outcome: Outcome,
}

impl Record {
    /// The driver's JSON form (`{"step": i, ...}`).
    pub fn to_json(&self) -> Value {
        let mut m = Map::new();
        m.insert("step".into(), json!(self.step));
        match &self.outcome {
            Outcome::Rows(r) => {
                m.insert("rows".into(), json!(r));
            }
            Outcome::Trimmed(n) => {
                m.insert("trimmed".into(), json!(n));
            }
            Outcome::TrimmedRows(n) => {
                m.insert("trimmed_rows".into(), json!(n));
            }
            Outcome::Converted(c) => {
                m.insert("converted".into(), json!(c));
            }
            Outcome::Resynced { trimmed, replayed } => {
                m.insert("trimmed".into(), json!(trimmed));
                m.insert("resynced".into(), json!(replayed));
            }
            Outcome::Checkpoint { op, reqs } => {
                m.insert("op".into(), json!(op));
                let mut rm = Map::new();
                for (id, v) in reqs {
                    rm.insert(id.to_string(), json!({"offset": v.offset, "k": v.k, "v": v.v}));
                }
                m.insert("reqs".into(), Value::Object(rm));
            }
            Outcome::Unsupported(s) => {
                m.insert("unsupported".into(), json!(s));
            }
            Outcome::Error(s) => {
                m.insert("error".into(), json!(s));
            }
        }
        Value::Object(m)
    }

    /// Parses one line of the driver's RESULTS. Never panics.
    pub fn parse(line: &str) -> Result<Record, String> {
        let v: Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
        let o = v.as_object().ok_or("a result must be a JSON object")?;
        let step = o.get("step").and_then(Value::as_u64).ok_or("no step index")? as usize;
        let strings = |x: &Value| -> Result<Vec<String>, String> {
            x.as_array()
                .ok_or("expected a list")?
                .iter()
                .map(|s| s.as_str().map(str::to_string).ok_or_else(|| "expected a string".to_string()))
                .collect()
        };
        let outcome = if let Some(r) = o.get("rows") {
            Outcome::Rows(strings(r)?)
        } else if let Some(n) = o.get("trimmed") {
            let n = n.as_i64().ok_or("trimmed must be an integer")?;
            match o.get("resynced") {
                Some(r) => Outcome::Resynced { trimmed: n, replayed: r.as_i64().ok_or("resynced must be an integer")? },
                None => Outcome::Trimmed(n),
            }
        } else if let Some(n) = o.get("trimmed_rows") {
            let n = n.as_array().ok_or("trimmed_rows must be a list")?;
            Outcome::TrimmedRows(
                n.iter()
                    .map(|x| x.as_u64().map(|x| x as usize).ok_or_else(|| "trimmed_rows: expected counts".to_string()))
                    .collect::<Result<_, _>>()?,
            )
        } else if let Some(c) = o.get("converted") {
            Outcome::Converted(c.as_bool().ok_or("converted must be a boolean")?)
        } else if let Some(r) = o.get("reqs") {
            let op = o.get("op").and_then(Value::as_i64).unwrap_or(-1);
            let mut reqs = BTreeMap::new();
            for (id, view) in r.as_object().ok_or("reqs must be an object")? {
                let id: u32 = id.parse().map_err(|_| format!("request id {id:?}"))?;
                let offset = view.get("offset").and_then(Value::as_i64).ok_or("view without offset")?;
                // The recurrent family's views name their two states `conv` and `rec` (kept as `k` and `v`).
                let k = strings(view.get("k").or(view.get("conv")).ok_or("view without k")?)?;
                let v = strings(view.get("v").or(view.get("rec")).ok_or("view without v")?)?;
                reqs.insert(id, ReqView { offset, k, v });
            }
            Outcome::Checkpoint { op, reqs }
        } else if let Some(s) = o.get("unsupported") {
            Outcome::Unsupported(s.as_str().unwrap_or_default().to_string())
        } else if let Some(s) = o.get("error") {
            Outcome::Error(s.as_str().unwrap_or_default().to_string())
        } else {
            return Err(format!("record of step {step} has no known field"));
        };
        Ok(Record { step, outcome })
    }
}

/// What kvsim knew when it made the call of one step (not part of the protocol; the classifier's context).
#[derive(Debug, Clone, Default)]
pub struct StepInfo {
    /// The protocol step type (`config`, `admit`, `solo`, ...).
    pub t: &'static str,
    /// Index of the kvsim op (in the trace) this step belongs to (`usize::MAX` for `config`).
    pub op: usize,
    /// The kvsim op kind's name.
    pub op_kind: &'static str,
    pub read: Option<Read>,
    pub layer: usize,
    /// Positions written per row (query count of a read).
    pub l: usize,
    /// The requests involved, in row order (one for solo steps).
    pub reqs: Vec<u32>,
    /// Their offsets before the step.
    pub offsets: Vec<usize>,
    /// Batch steps: each row's live positions before the step.
    pub lens: Vec<usize>,
    /// Batch steps: the upper bound of mlx-lm's shared column counter (`_offset` / `_idx`) before the step.
    pub bound: usize,
    /// Real queries per row (prefill chunks).
    pub real: Vec<usize>,
    /// The cache read may have wrapped: some position was evicted or overwritten before or by this write
    /// (solo: `offset + L > W`; batch: an upper bound of mlx-lm's shared `_offset`, plus `L`, exceeds `W`).
    pub wrapped: bool,
    /// Prefill: the prepared lengths differ (mlx-lm then keeps `_lengths` set until `finalize()`).
    pub padded: bool,
    pub trim: Option<TrimInfo>,
    /// `enter`: requests whose ring holds no position although it was written before (fully trimmed).
    pub emptied: Vec<u32>,
    /// `enter`: how many of the entering requests hold at least one position.
    pub nonempty: usize,
    /// `enter`: `merge` or `join`.
    pub how: Option<&'static str>,
    /// `extract`: whether the running batch has held any position since it was built (mlx-lm's batch cache then
    /// has arrays; before, `keys is None`).
    pub batch_arrays: bool,
    /// The caches' storage before the step: `Some((bits, group))` when affine-quantized (the `quant` family).
    pub quant: Option<(usize, usize)>,
    /// `quantize`: the parameters asked for.
    pub target: Option<(usize, usize)>,
    /// `quantize`: whether a running batch or a pending prefill holds rows.
    pub batch_live: bool,
    /// The head dim of the recorded family's caches (the quantized family has its own).
    pub head_dim: usize,
    /// The recurrent family: each row's real `[start, end)` in a layer call; `prepare`'s left padding per row.
    pub spans: Vec<(usize, usize)>,
    pub left: Vec<usize>,
    /// The recurrent family's round: the keep per row (`gamma` in `l`).
    pub keep: Vec<usize>,
    /// `extract` / `filter`: the running batch's rows after the step (0: the batch is gone); `filter` also lists
    /// the rows before it in `reqs` and the kept row indices in `keep`.
    pub rows_left: usize,
    /// `extract`: the request finishes (its cache is dropped).
    pub finish: bool,
    /// `extract`: the row index asked for.
    pub row: Option<usize>,
}

/// The families the mlx-lm oracle maps (`oracles/PROTOCOL.md`): the attention family's plain caches, the
/// quantized family's affine ones and the recurrent family's gated-DeltaNet states (its `ssm` set).
pub const ORACLE_FAMILIES: &[&str] = &["attention", "quant", "ssm"];

/// The family a recording of `cfg` describes: the first of the run's families the oracle maps.
pub fn oracle_family(cfg: &kvsim_harness::sim::config::SimConfig) -> Option<&'static str> {
    let names =
        if cfg.families.is_empty() { kvsim_harness::sim::family::default_families() } else { cfg.families.clone() };
    names.iter().find_map(|n| ORACLE_FAMILIES.iter().copied().find(|f| f == n))
}

/// Collects steps, kvsim's results and step infos.
pub struct Recorder {
    pub emit_steps: bool,
    /// JSON Lines of STEPS (empty unless `emit_steps`).
    pub steps: Vec<String>,
    pub infos: Vec<StepInfo>,
    pub results: Vec<Record>,
    /// Every read output's bytes, by sha256 (the hash a result record carries): a divergence is measured from them.
    pub values: Values,
    /// The kvsim op being executed (set by whoever drives the world).
    pub op: usize,
    pub op_kind: &'static str,
    window: Option<usize>,
    /// Upper bound of mlx-lm's shared `_offset` of the running batch (0 when there is none).
    bound: usize,
    /// Requests that had at least one write.
    written: BTreeSet<u32>,
    /// The running batch has held a position since it was built (mlx-lm's batch cache has arrays).
    batch_arrays: bool,
    /// The family whose calls are recorded (one of [`ORACLE_FAMILIES`]).
    pub family: &'static str,
    /// The family's storage now: `Some((bits, group))` once affine.
    quant: Option<(usize, usize)>,
    /// Requests of the running batch's rows, in row order, and of a pending prefill (for `quantize`).
    rows: Vec<u32>,
    prefill_rows: Vec<u32>,
    head_dim: usize,
}

fn dtype_name(ab: &ArrayBytes) -> &'static str {
    match ab.words {
        Words::U16(_) => "bf16",
        _ => "f32",
    }
}

fn itemsize(ab: &ArrayBytes) -> usize {
    match ab.words {
        Words::U8(_) => 1,
        Words::U16(_) => 2,
        Words::U32(_) => 4,
        Words::U64(_) => 8,
    }
}

/// Little-endian bytes of `ab[b0..b1, :, c0..c1, :]` for a 4-d array `[B, H, L, D]`, row-major.
fn block(ab: &ArrayBytes, le: &[u8], rows: std::ops::Range<usize>, cols: std::ops::Range<usize>) -> Vec<u8> {
    let s: Vec<usize> = ab.shape.iter().map(|&x| x as usize).collect();
    let (h, l, d) = (s[1], s[2], s[3]);
    let w = itemsize(ab);
    let mut out = Vec::with_capacity(rows.len() * h * cols.len() * d * w);
    for b in rows {
        for hh in 0..h {
            let start = ((b * h + hh) * l + cols.start) * d * w;
            let end = ((b * h + hh) * l + cols.end) * d * w;
            out.extend_from_slice(&le[start..end]);
        }
    }
    out
}

pub(crate) fn sha_hex(bytes: &[u8]) -> String {
    let d = Sha256::digest(bytes);
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// sha256 of an array's row-major little-endian element bytes.
pub fn sha_of(ab: &ArrayBytes) -> String {
    sha_hex(&ab.words.le_bytes())
}

fn encode(ab: &ArrayBytes, le: &[u8], rows: std::ops::Range<usize>, cols: std::ops::Range<usize>) -> Value {
    let shape = [rows.len(), ab.shape[1] as usize, cols.len(), ab.shape[3] as usize];
    let bytes = block(ab, le, rows, cols);
    json!({"dtype": dtype_name(ab), "shape": shape, "b64": base64::engine::general_purpose::STANDARD.encode(bytes)})
}

/// An input array of a step, read once.
pub struct Input {
    ab: ArrayBytes,
    le: Vec<u8>,
}

impl Input {
    pub fn of(a: &mlx_rs::Array) -> Result<Input, String> {
        let ab = ArrayBytes::of(a).map_err(|e| e.to_string())?;
        let le = ab.words.le_bytes();
        Ok(Input { ab, le })
    }
    fn rows(&self) -> usize {
        self.ab.shape[0] as usize
    }
    fn len(&self) -> usize {
        self.ab.shape[2] as usize
    }
    /// The whole array in the protocol's encoding (any rank).
    fn whole_json(&self) -> Value {
        let shape: Vec<usize> = self.ab.shape.iter().map(|&x| x as usize).collect();
        json!({"dtype": dtype_name(&self.ab), "shape": shape, "b64": base64::engine::general_purpose::STANDARD.encode(&self.le)})
    }
    fn json(&self, cols: std::ops::Range<usize>) -> Value {
        encode(&self.ab, &self.le, 0..self.rows(), cols)
    }
    /// The bytes of row `r`'s first `n` queries (`[H, n, D]`), from column `c0`.
    fn row_bytes(&self, r: usize, c0: usize, n: usize) -> Vec<u8> {
        block(&self.ab, &self.le, r..r + 1, c0..c0 + n)
    }
}

impl Recorder {
    /// A recorder for a run of `cfg`; the first step (`config`) is appended here.
    pub fn new(cfg: &kvsim_harness::sim::config::SimConfig, emit_steps: bool) -> Recorder {
        let family = oracle_family(cfg).unwrap_or("attention");
        let q = kvsim_harness::sim::family::quant::QuantChoice::of(cfg).filter(|_| family == "quant");
        let quant = q.filter(|q| q.native).map(|q| (q.bits, q.group));
        let head_dim = q.map_or(cfg.head_dim, |q| q.head_dim);
        let mut r = Recorder {
            family,
            quant,
            rows: vec![],
            prefill_rows: vec![],
            head_dim,
            emit_steps,
            steps: vec![],
            infos: vec![],
            results: vec![],
            values: Values::new(),
            op: usize::MAX,
            op_kind: "",
            window: cfg.layout.max_size(),
            bound: 0,
            written: BTreeSet::new(),
            batch_arrays: false,
        };
        let dtype = match cfg.dtype {
            kvsim_harness::sim::config::DtypeChoice::F32 => "f32",
            kvsim_harness::sim::config::DtypeChoice::Bf16 => "bf16",
        };
        r.push(
            || {
                json!({"t": "config", "max_size": cfg.layout.max_size(), "dtype": dtype, "heads_kv": cfg.heads_kv,
                       "heads_q": cfg.heads_q, "head_dim": head_dim, "layers": cfg.layers,
                       "scale": (1.0 / (head_dim as f32).sqrt()) as f64,
                       "family": family, "quant": quant.map(|(bits, group)| json!({"bits": bits, "group": group}))})
            },
            StepInfo { t: "config", quant, head_dim, ..Default::default() },
        );
        r
    }

    /// Index the next step will get.
    pub fn next_step(&self) -> usize {
        self.infos.len()
    }

    fn push(&mut self, step: impl FnOnce() -> Value, mut info: StepInfo) -> usize {
        let i = self.infos.len();
        if self.emit_steps {
            self.steps.push(serde_json::to_string(&step()).expect("a step serializes"));
        }
        if info.t != "config" {
            info.op = self.op;
            info.op_kind = self.op_kind;
            info.quant = self.quant;
            info.head_dim = self.head_dim;
        } else {
            info.op = usize::MAX;
        }
        self.infos.push(info);
        i
    }

    /// Keeps a read's output bytes (for measuring a divergence) and returns their sha256.
    fn keep(&mut self, bytes: Vec<u8>) -> String {
        let sha = sha_hex(&bytes);
        self.values.entry(sha.clone()).or_insert(bytes);
        sha
    }

    fn result(&mut self, step: usize, outcome: Outcome) {
        self.results.push(Record { step, outcome });
    }

    fn wraps(&self, before: usize, l: usize) -> bool {
        self.window.is_some_and(|w| before + l > w)
    }

    pub fn admit(&mut self, req: u32) {
        self.push(|| json!({"t": "admit", "req": req}), StepInfo { t: "admit", reqs: vec![req], ..Default::default() });
    }

    /// A solo write (+ read): `out` is the read's output `[1, H_q, L, D]` (None for `append`).
    #[allow(clippy::too_many_arguments)]
    pub fn solo(
        &mut self,
        req: u32,
        layer: usize,
        read: Read,
        k: &mlx_rs::Array,
        v: &mlx_rs::Array,
        q: Option<&mlx_rs::Array>,
        out: Option<&mlx_rs::Array>,
        offset_before: usize,
    ) -> Result<(), String> {
        let (k, v) = (Input::of(k)?, Input::of(v)?);
        let q = q.map(Input::of).transpose()?;
        let l = k.len();
        let info = StepInfo {
            t: "solo",
            read: Some(read),
            layer,
            l,
            reqs: vec![req],
            offsets: vec![offset_before],
            wrapped: self.wraps(offset_before, l),
            ..Default::default()
        };
        let step = self.push(
            || {
                json!({"t": "solo", "req": req, "layer": layer, "read": read.name(), "k": k.json(0..l), "v": v.json(0..l),
                       "q": if read == Read::Append { Value::Null } else { q.as_ref().map_or(Value::Null, |q| q.json(0..l)) }})
            },
            info,
        );
        self.written.insert(req);
        if let (Some(out), false) = (out, read == Read::Append) {
            let o = Input::of(out)?;
            let sha = self.keep(o.row_bytes(0, 0, o.len()));
            self.result(step, Outcome::Rows(vec![sha]));
        }
        Ok(())
    }

    pub fn solo_trim(&mut self, req: u32, offset_before: usize, trim: TrimInfo) {
        let (n, bypass) = (trim.n[0], trim.bypass);
        let trimmed = *trim.kvsim.as_ref().unwrap_or(&0) as i64;
        let wrapped = self.window.is_some_and(|w| offset_before >= w);
        let info = StepInfo {
            t: "solo_trim",
            reqs: vec![req],
            offsets: vec![offset_before],
            wrapped,
            trim: Some(trim),
            ..Default::default()
        };
        let step = self.push(|| json!({"t": "solo_trim", "req": req, "n": n, "bypass": bypass}), info);
        self.result(step, Outcome::Trimmed(trimmed));
    }

    /// Solo requests enter the running batch. `sizes`: live positions of each (before the merge).
    pub fn enter(&mut self, reqs: &[u32], merge: bool, offsets: &[usize], sizes: &[usize]) {
        let emptied: Vec<u32> =
            reqs.iter().zip(sizes).filter(|(r, &s)| s == 0 && self.written.contains(r)).map(|(r, _)| *r).collect();
        let nonempty = sizes.iter().filter(|&&s| s > 0).count();
        let how = if merge { "merge" } else { "join" };
        let info = StepInfo {
            t: "enter",
            reqs: reqs.to_vec(),
            offsets: offsets.to_vec(),
            emptied,
            nonempty,
            how: Some(how),
            ..Default::default()
        };
        self.push(|| json!({"t": "enter", "reqs": reqs, "how": how}), info);
        self.rows.extend_from_slice(reqs);
        self.bound = self.bound.max(offsets.iter().copied().max().unwrap_or(0));
        self.batch_arrays |= nonempty > 0;
    }

    /// A right-padded prefill of `lengths` positions per row, fed in chunks of `chunk`.
    pub fn prefill(&mut self, reqs: &[u32], lengths: &[usize], chunk: usize) {
        let padded = lengths.iter().any(|&x| x != lengths[0]);
        let info = StepInfo {
            t: "prefill",
            reqs: reqs.to_vec(),
            real: lengths.to_vec(),
            l: chunk,
            padded,
            ..Default::default()
        };
        self.push(|| json!({"t": "prefill", "reqs": reqs, "lengths": lengths}), info);
        self.prefill_rows = reqs.to_vec();
        for r in reqs {
            self.written.insert(*r);
        }
    }

    /// A chunk of the prefill batch: `real[r]` real queries of row `r` (the first ones), `done` positions of
    /// the longest row delivered before it.
    #[allow(clippy::too_many_arguments)]
    pub fn prefill_chunk(
        &mut self,
        layer: usize,
        reqs: &[u32],
        k: &mlx_rs::Array,
        v: &mlx_rs::Array,
        q: &mlx_rs::Array,
        real: &[usize],
        out: &mlx_rs::Array,
        done: usize,
        padded: bool,
    ) -> Result<(), String> {
        let (k, v, q) = (Input::of(k)?, Input::of(v)?, Input::of(q)?);
        let l = k.len();
        let info = StepInfo {
            t: "prefill_chunk",
            read: Some(Read::Window),
            layer,
            l,
            reqs: reqs.to_vec(),
            offsets: vec![done; reqs.len()],
            real: real.to_vec(),
            wrapped: self.wraps(done, l),
            padded,
            ..Default::default()
        };
        let step = self.push(
            || json!({"t": "prefill_chunk", "layer": layer, "k": k.json(0..l), "v": v.json(0..l), "q": q.json(0..l), "real": real}),
            info,
        );
        let o = Input::of(out)?;
        let rows = (0..o.rows()).map(|r| self.keep(o.row_bytes(r, 0, real[r]))).collect();
        self.result(step, Outcome::Rows(rows));
        Ok(())
    }

    /// `finalize()` and join: the prefill batch (whose longest row holds `longest` positions) joins the running one.
    pub fn prefill_end(&mut self, longest: usize) {
        let info = StepInfo { t: "prefill_end", reqs: self.prefill_rows.clone(), ..Default::default() };
        self.push(|| json!({"t": "prefill_end"}), info);
        let p = std::mem::take(&mut self.prefill_rows);
        self.rows.extend(p);
        self.bound = self.bound.max(longest);
        self.batch_arrays |= longest > 0;
    }

    /// A write (+ read) on the running batch; `out` `[B, H_q, L, D]` (None for `append`).
    #[allow(clippy::too_many_arguments)]
    pub fn batch(
        &mut self,
        layer: usize,
        read: Read,
        reqs: &[u32],
        rows: &[(usize, usize)],
        k: &mlx_rs::Array,
        v: &mlx_rs::Array,
        q: Option<&mlx_rs::Array>,
        out: Option<&mlx_rs::Array>,
    ) -> Result<(), String> {
        let (k, v) = (Input::of(k)?, Input::of(v)?);
        let q = q.map(Input::of).transpose()?;
        let l = k.len();
        let info = StepInfo {
            t: "batch",
            read: Some(read),
            layer,
            l,
            reqs: reqs.to_vec(),
            offsets: rows.iter().map(|r| r.0).collect(),
            lens: rows.iter().map(|r| r.1).collect(),
            bound: self.bound,
            wrapped: self.wraps(self.bound, l),
            ..Default::default()
        };
        let step = self.push(
            || {
                json!({"t": "batch", "layer": layer, "read": read.name(), "k": k.json(0..l), "v": v.json(0..l),
                       "q": if read == Read::Append { Value::Null } else { q.as_ref().map_or(Value::Null, |q| q.json(0..l)) }})
            },
            info,
        );
        if let (Some(out), false) = (out, read == Read::Append) {
            let o = Input::of(out)?;
            let rows = (0..o.rows()).map(|r| self.keep(o.row_bytes(r, 0, o.len()))).collect();
            self.result(step, Outcome::Rows(rows));
        }
        Ok(())
    }

    /// A committed span on the running batch: one `batch` decode step per position; `out` `[B, H_q, L, D]` is
    /// kvsim's span output, split per position.
    #[allow(clippy::too_many_arguments)]
    pub fn batch_span(
        &mut self,
        layer: usize,
        reqs: &[u32],
        rows: &[(usize, usize)],
        k: &mlx_rs::Array,
        v: &mlx_rs::Array,
        q: &mlx_rs::Array,
        out: &mlx_rs::Array,
    ) -> Result<(), String> {
        let (k, v, q, o) = (Input::of(k)?, Input::of(v)?, Input::of(q)?, Input::of(out)?);
        let w = self.window.unwrap_or(usize::MAX);
        for i in 0..k.len() {
            let info = StepInfo {
                t: "batch",
                read: Some(Read::Decode),
                layer,
                l: 1,
                reqs: reqs.to_vec(),
                offsets: rows.iter().map(|r| r.0 + i).collect(),
                lens: rows.iter().map(|r| (r.1 + i).min(w)).collect(),
                bound: self.bound + i,
                wrapped: self.wraps(self.bound + i, 1),
                ..Default::default()
            };
            let step = self.push(
                || json!({"t": "batch", "layer": layer, "read": "decode", "k": k.json(i..i + 1), "v": v.json(i..i + 1), "q": q.json(i..i + 1)}),
                info,
            );
            let rows = (0..o.rows()).map(|r| self.keep(o.row_bytes(r, i, 1))).collect();
            self.result(step, Outcome::Rows(rows));
        }
        Ok(())
    }

    /// The running batch got `l` more positions per row (after every layer's write).
    pub fn batch_written(&mut self, l: usize) {
        self.bound += l;
        self.batch_arrays |= l > 0;
    }

    pub fn trim_rows(&mut self, reqs: &[u32], offsets: &[usize], trim: TrimInfo) {
        let n = trim.n.clone();
        let bypass = trim.bypass;
        let equal = n.iter().all(|&x| x == n[0]);
        let outcome = match (&trim.kvsim, equal) {
            (Ok(_), true) => Outcome::Trimmed(n.first().copied().unwrap_or(0) as i64),
            (Err(_), true) => Outcome::Trimmed(0),
            (Ok(_), false) => Outcome::TrimmedRows(n.clone()),
            (Err(_), false) => Outcome::TrimmedRows(vec![0; n.len()]),
        };
        let wrapped = self.window.is_some_and(|w| self.bound >= w);
        if trim.kvsim.is_ok() {
            self.bound = self.bound.saturating_sub(n.iter().copied().min().unwrap_or(0));
        }
        let info = StepInfo {
            t: "trim_rows",
            reqs: reqs.to_vec(),
            offsets: offsets.to_vec(),
            wrapped,
            trim: Some(trim),
            ..Default::default()
        };
        let step = self.push(|| json!({"t": "trim_rows", "n": n, "bypass": bypass}), info);
        self.result(step, outcome);
    }

    pub fn trim(&mut self, reqs: &[u32], offsets: &[usize], trim: TrimInfo) {
        let n = trim.n[0];
        let trimmed = *trim.kvsim.as_ref().unwrap_or(&0);
        let wrapped = self.window.is_some_and(|w| self.bound >= w);
        self.bound = self.bound.saturating_sub(trimmed);
        let info = StepInfo {
            t: "trim",
            reqs: reqs.to_vec(),
            offsets: offsets.to_vec(),
            wrapped,
            trim: Some(trim),
            ..Default::default()
        };
        let step = self.push(|| json!({"t": "trim", "n": n}), info);
        self.result(step, Outcome::Trimmed(trimmed as i64));
    }

    /// Row `row` leaves the batch; `rows_left` rows remain.
    pub fn extract(&mut self, row: usize, req: u32, finish: bool, rows_left: usize) {
        let info = StepInfo {
            t: "extract",
            reqs: vec![req],
            batch_arrays: self.batch_arrays,
            rows_left,
            finish,
            row: Some(row),
            ..Default::default()
        };
        self.push(|| json!({"t": "extract", "row": row, "finish": finish}), info);
        if row < self.rows.len() {
            self.rows.remove(row);
        }
        if rows_left == 0 {
            self.bound = 0;
            self.batch_arrays = false;
        }
    }

    pub fn filter(&mut self, keep: &[usize]) {
        let info = StepInfo {
            t: "filter",
            reqs: self.rows.clone(),
            keep: keep.to_vec(),
            rows_left: keep.len(),
            ..Default::default()
        };
        self.push(|| json!({"t": "filter", "keep": keep}), info);
        self.rows = keep.iter().filter_map(|&r| self.rows.get(r).copied()).collect();
        if keep.is_empty() {
            self.bound = 0;
            self.batch_arrays = false;
        }
    }

    /// The conversion op: `to_quantized(bits, group)` of every cache of the family; `converted` when kvsim's caches
    /// changed storage.
    pub fn quantize(&mut self, bits: usize, group: usize, converted: bool) {
        let info = StepInfo {
            t: "quantize",
            target: Some((bits, group)),
            batch_live: !(self.rows.is_empty() && self.prefill_rows.is_empty()),
            reqs: self.rows.iter().chain(&self.prefill_rows).copied().collect(),
            ..Default::default()
        };
        let step = self.push(|| json!({"t": "quantize", "bits": bits, "group": group}), info);
        self.result(step, Outcome::Converted(converted));
        if converted {
            self.quant = Some((bits, group));
        }
    }

    /// The recurrent family's geometry and weights: the config step (the first, emitted before any other) is rewritten
    /// with them (`family: "ssm"`).
    pub fn ssm_layers(
        &mut self,
        spec: kvsim_cache::ssm::SsmSpec,
        params: &[kvsim_cache::ssm::GdnParams],
    ) -> Result<(), String> {
        if !self.emit_steps || self.steps.len() != 1 {
            return Ok(());
        }
        let mut cfg: Value = serde_json::from_str(&self.steps[0]).map_err(|e| e.to_string())?;
        let mut weights = vec![];
        for p in params {
            let w = |a: &mlx_rs::Array| Input::of(a).map(|i| i.whole_json());
            weights.push(json!({"conv_weight": w(&p.conv_weight)?, "a_log": w(&p.a_log)?, "dt_bias": w(&p.dt_bias)?}));
        }
        cfg["family"] = json!("ssm");
        cfg["layers"] = json!(params.len());
        cfg["ssm"] = json!({"kernel": spec.kernel, "heads_k": spec.heads_k, "heads_v": spec.heads_v, "dk": spec.dk, "dv": spec.dv});
        cfg["weights"] = Value::Array(weights);
        self.steps[0] = serde_json::to_string(&cfg).map_err(|e| e.to_string())?;
        Ok(())
    }

    /// A gated-DeltaNet layer call (solo when `req` is set); kvsim's result: per row the sha256 of its outputs at
    /// its real positions (`[n, Hv, Dv]`).
    #[allow(clippy::too_many_arguments)]
    pub fn ssm_call(
        &mut self,
        req: Option<u32>,
        layer: usize,
        read: Read,
        reqs: &[u32],
        qkv: &mlx_rs::Array,
        a: &mlx_rs::Array,
        b: &mlx_rs::Array,
        out: &mlx_rs::Array,
        spans: &[(usize, usize)],
    ) -> Result<(), String> {
        let (qkv, a, b, o) = (Input::of(qkv)?, Input::of(a)?, Input::of(b)?, Input::of(out)?);
        let s = qkv.ab.shape.get(1).copied().unwrap_or(0) as usize;
        let info = StepInfo {
            t: if req.is_some() { "solo" } else { "batch" },
            read: Some(read),
            layer,
            l: s,
            reqs: reqs.to_vec(),
            spans: spans.to_vec(),
            ..Default::default()
        };
        let step = self.push(
            || {
                let mut j = json!({"t": if req.is_some() { "solo" } else { "batch" }, "layer": layer, "read": read.name(),
                                   "qkv": qkv.whole_json(), "a": a.whole_json(), "b": b.whole_json()});
                if let Some(r) = req {
                    j["req"] = json!(r);
                }
                j
            },
            info,
        );
        for (r, &(s0, s1)) in reqs.iter().zip(spans) {
            if s1 > s0 {
                self.written.insert(*r);
            }
        }
        // out [B, S, Hv, Dv]: row r's positions [s0, s1) are contiguous
        let per = o.le.len() / o.rows().max(1) / s.max(1);
        let rows = spans
            .iter()
            .enumerate()
            .map(|(r, &(s0, s1))| self.keep(o.le[(r * s + s0) * per..(r * s + s1) * per].to_vec()))
            .collect();
        self.result(step, Outcome::Rows(rows));
        Ok(())
    }

    pub fn ssm_prepare(&mut self, lengths: &[usize], left: &[usize]) {
        let info = StepInfo {
            t: "prepare",
            reqs: self.rows.clone(),
            // 1 for a row whose request has consumed positions (history), else 0
            lens: self.rows.iter().map(|r| usize::from(self.written.contains(r))).collect(),
            real: lengths.to_vec(),
            left: left.to_vec(),
            padded: left.iter().any(|&x| x > 0) || lengths.iter().any(|&x| x != lengths[0]),
            ..Default::default()
        };
        let left_json = if left.is_empty() { Value::Null } else { json!(left) };
        self.push(|| json!({"t": "prepare", "lengths": lengths, "left": left_json}), info);
    }

    pub fn ssm_finalize(&mut self) {
        self.push(
            || json!({"t": "finalize"}),
            StepInfo { t: "finalize", reqs: self.rows.clone(), ..Default::default() },
        );
    }

    /// A resolved speculative round: kvsim commits (every row keeps `gamma`; no record, as mlx-lm's window was the
    /// whole call) or rolls back (`keep` per row; kvsim's result is what each row dropped).
    pub fn ssm_round(&mut self, reqs: &[u32], gamma: usize, keep: &[usize]) {
        let info = StepInfo { t: "round", reqs: reqs.to_vec(), l: gamma, keep: keep.to_vec(), ..Default::default() };
        let step = self.push(|| json!({"t": "round", "gamma": gamma, "keep": keep}), info);
        if keep.iter().any(|&k| k != gamma) {
            self.result(step, Outcome::TrimmedRows(keep.iter().map(|&k| gamma - k).collect()));
        }
    }

    /// The state of every live request (`views`: request -> (offset, per-layer K shas, per-layer V shas)).
    pub fn checkpoint(&mut self, reqs: BTreeMap<u32, ReqView>) {
        let op = self.op;
        let step = self.push(
            || json!({"t": "checkpoint", "op": op}),
            StepInfo { t: "checkpoint", reqs: reqs.keys().copied().collect(), ..Default::default() },
        );
        self.result(step, Outcome::Checkpoint { op: op as i64, reqs });
    }

    /// STEPS as one string (JSON Lines).
    pub fn steps_jsonl(&self) -> String {
        let mut s = String::new();
        for l in &self.steps {
            s.push_str(l);
            s.push('\n');
        }
        s
    }
}

impl RunObserver for Recorder {
    fn on_op_start(&mut self, index: usize, op: &Op) {
        self.op = index;
        self.op_kind = op.kind().name();
    }

    fn wants_calls(&self) -> bool {
        true
    }

    fn watches(&self, family: &str) -> bool {
        family == self.family
    }

    fn on_call(&mut self, call: Call<'_>) -> Result<(), String> {
        match call {
            Call::Admit { req } => self.admit(req),
            Call::Solo { req, layer, read, k, v, q, out, offset, .. } => {
                self.solo(req, layer, read, k, v, q, out, offset)?
            }
            Call::SoloTrim { req, offset, trim } => self.solo_trim(req, offset, trim.clone()),
            Call::Enter { reqs, merge, offsets, sizes } => self.enter(reqs, merge, offsets, sizes),
            Call::Prefill { reqs, lengths, chunk } => self.prefill(reqs, lengths, chunk),
            Call::PrefillChunk { layer, reqs, k, v, q, real, out, done, padded } => {
                self.prefill_chunk(layer, reqs, k, v, q, real, out, done, padded)?
            }
            Call::PrefillEnd { longest } => self.prefill_end(longest),
            Call::Batch { layer, read, reqs, rows, k, v, q, out, .. } => {
                self.batch(layer, read, reqs, rows, k, v, q, out)?
            }
            Call::BatchSpan { layer, reqs, rows, k, v, q, out, .. } => {
                self.batch_span(layer, reqs, rows, k, v, q, out)?
            }
            Call::BatchWritten { l } => self.batch_written(l),
            Call::TrimRows { reqs, offsets, trim } => self.trim_rows(reqs, offsets, trim.clone()),
            Call::Trim { reqs, offsets, trim } => self.trim(reqs, offsets, trim.clone()),
            Call::Extract { row, req, finish, rows_left } => self.extract(row, req, finish, rows_left),
            Call::Filter { keep } => self.filter(keep),
            Call::Quantize { bits, group, converted } => self.quantize(bits, group, converted),
            Call::SsmLayers { spec, params } => self.ssm_layers(spec, params)?,
            Call::SsmCall { req, layer, read, reqs, qkv, a, b, out, spans } => {
                self.ssm_call(req, layer, read, reqs, qkv, a, b, out, spans)?
            }
            Call::SsmPrepare { lengths, left } => self.ssm_prepare(lengths, left),
            Call::SsmFinalize => self.ssm_finalize(),
            Call::SsmRound { reqs, gamma, keep } => self.ssm_round(reqs, gamma, keep),
        }
        Ok(())
    }

    fn on_state(&mut self, views: BTreeMap<u32, StateView>) -> Result<(), String> {
        let mut reqs = BTreeMap::new();
        for (id, view) in views {
            let (mut k, mut v) = (vec![], vec![]);
            if let Some(planes) = &view.planes {
                // Affine storage: each side's (packed, scales, biases) bytes, concatenated in that order.
                for p in planes {
                    let refs: Vec<&mlx_rs::Array> = p.iter().collect();
                    let b = ArrayBytes::read_many(&refs).map_err(|e| e.to_string())?;
                    let side =
                        |x: &[ArrayBytes]| sha_hex(&x.iter().flat_map(|a| a.words.le_bytes()).collect::<Vec<u8>>());
                    k.push(side(&b[..3]));
                    v.push(side(&b[3..6]));
                }
            } else {
                for (tk, tv) in &view.layers {
                    k.push(sha_of(&ArrayBytes::of(tk).map_err(|e| e.to_string())?));
                    v.push(sha_of(&ArrayBytes::of(tv).map_err(|e| e.to_string())?));
                }
            }
            reqs.insert(id, ReqView { offset: view.offset as i64, k, v });
        }
        self.checkpoint(reqs);
        Ok(())
    }
}
