//! The recurrent family (`ssm`, `hybrid:qwen35`, `hybrid:sliding`): gated-DeltaNet layers ([`SsmCache`]), alone or
//! as a hybrid cache set with attention layers, driven by the main op stream.
//!
//! **The sets** (one per run, drawn from the run's `Stream::Recurrent`; the key of the summary's `layouts`):
//! - `ssm`: two DeltaNet layers;
//! - `hybrid:qwen35` (a run whose attention layout is linear): DeltaNet x3 then full attention, Qwen3.5's pattern
//!   (mlx-lm 0.32.2 `mlx_lm/models/qwen3_5.py`: `full_attention_interval = 4`);
//! - `hybrid:sliding` (a run whose attention layout is rotating with window `W`): DeltaNet, sliding attention `W`,
//!   DeltaNet, full attention.
//!
//! The attention layers of a set are this family's own (`RowBatch` rows and `SerialCache`s, joined, never merged
//! from temporal views); the run's attention family checks its own caches beside it on the same ops.
//!
//! **Ops.** `admit` (empty caches), `solo_window` / `solo_decode` (a request outside the batch), `merge` and `join`
//! (both: `SsmCache::merge` of the batch and the requests' one-row caches; attention layers join), `batch_prefill`
//! (the fresh requests' caches merged into the running batch, one prepared prefill over the *whole* batch with the
//! running rows all padding, in chunks, then `finalize`; left padding in the `ssm` set unless the first request's id plus the chunk width is a multiple of 3, right
//! padding otherwise), `decode`, `window` / `append` (S positions per row), `commit_span` (production's span APIs, the twins' S single decodes), `verify`
//! (a speculative round: DeltaNet layers `spec_round_begin`, the armed window of `gamma` draft positions, then
//! `spec_round_commit` when every row accepts all, else `spec_round_rollback_rows(keep)` with replay; attention
//! layers `trim_rows(gamma - keep, bypass)`), `extract` (with `finish`: the request ends; else it continues outside
//! the batch, its layers saved to a kvsim file and restored from the bytes alone first), `filter`, and the training kinds
//! (`training_forward`: the training DeltaNet cache [`TrainingSsmCache`]; `training_refusal`). Trims, the
//! attention-only special reads and the prefix-shared forward are not supported (`supports` answers false, so a
//! run holding this family never draws them).
//!
//! **Checks.** After every op, per live request and layer: offsets of production, twin, model and the positions fed
//! equal; both DeltaNet states byte-identical to the solo twin (a one-row cache fed the request's real positions
//! only, on CPU); the conv tail byte-identical to the model's (a copy of the last `K-1` real inputs); the recurrent
//! state within [`ssm_model_bound`] ULPs of the f64 model; attention layers' state and live columns byte-identical
//! to their serial twins. Every read: outputs at real positions byte-identical to the twin's, and within the bound
//! of the model. Every rollback: each row's replayed state byte-identical to a fresh run of its accepted prefix from
//! the pre-round state. Misuse (a second `begin`, a keep past the window, a trim, a duplicate filter row, a missing
//! row) must be the typed error.
//!
//! This file holds the sets, the family's state, its payloads and the op dispatch; the rest lives in child modules:
//! `forward` (the forward passes and their output checks), `lifecycle` (admit, merge/join, extract, filter), `batch`
//! (prefill, decode, window, commit_span, verify), `training`, `checks` (state after every op) and `persist`.
//!
//! [`TrainingSsmCache`]: kvsim_cache::TrainingSsmCache

use std::collections::BTreeMap;

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{Array, Dtype};
use rand::Rng;

use crate::sim::check::{ulp_at, Failure};
use crate::sim::config::{DtypeChoice, LayoutChoice, SimConfig};
use crate::sim::family::{Cx, Family, Registration};
use crate::sim::observe::{Call, StateView};
use crate::sim::ops::{Op, OpKind};
use crate::sim::rng::{stream, Stream};
use crate::sim::summary::Counters;
use kvsim_cache::bytes::ArrayBytes;
use kvsim_cache::{CacheError, GdnParams, KvSpec, RowBatch, SerialCache, SsmCache, SsmSpec};
use kvsim_reference::{RefDtype, SsmDims, SsmRowModel, SsmToken, SsmValues, SsmWeights};

mod batch;
mod checks;
mod forward;
mod lifecycle;
mod persist;
mod training;

use persist::persist_roundtrip;

#[cfg(test)]
mod tests;

type Res<T = ()> = Result<T, Failure>;

pub const NAME: &str = "ssm";

/// The recurrent family: everything but trims, the attention-only special reads and the prefix-shared forward, and
/// the attention API probes (`adopt`, `decode_phase`, `prepare` into holding rows, ill-formed inputs). The bf16-first
/// family's own ops (`prefix_reuse`, `plain_read`, `fetch`) touch no cache here (as in the attention family): the
/// state checks after the op prove it.
pub const REGISTRATION: Registration = Registration::plain(
    NAME,
    |k: OpKind| {
        !matches!(
            k,
            OpKind::Trim
                | OpKind::SoloTrim
                | OpKind::ReadBlock
                | OpKind::BidirPrefill
                | OpKind::EncoderRead
                | OpKind::CompiledStep
                | OpKind::CompiledBatchStep
                | OpKind::CommitKnownSpans
                | OpKind::PrefixSharedForward
                | OpKind::Adopt
                | OpKind::DecodePhase
                | OpKind::Prepare
                | OpKind::IllFormed
                | OpKind::Quantize
        )
    },
    0.4,
    |cfg| Ok(Box::new(Recurrent::new(cfg)?)),
);

/// The attention scale of the set's attention layers.
const SCALE: f32 = 0.35;
/// Request ids of the training forwards' rows (never a request of the run).
const TRAIN_REQ: u64 = 1 << 40;

fn mlx(what: &str, e: CacheError) -> Failure {
    Failure::new("errors", format!("{what}: production refused a legal op: {e}"))
}

/// Bounds of the model distance (ULPs of the input dtype at output scale) beyond which a run fails: set from
/// measurement (README "Guarantees"), far below what a folded padding step or a wrong conv tail does.
pub fn ssm_model_bound(dtype: RefDtype) -> f64 {
    match dtype {
        RefDtype::Bf16 => 64.0,
        RefDtype::F32 => 256.0,
    }
}

/// One layer of a set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerKind {
    DeltaNet,
    Attention { window: Option<usize> },
}

/// A run's set: its name (the `layouts` key), layers and DeltaNet geometry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SsmSet {
    pub name: &'static str,
    pub layers: Vec<LayerKind>,
    pub dims: SsmDims,
}

impl SsmSet {
    /// The set of a run of `cfg` (its own stream, so nothing else in the run moves).
    pub fn of(cfg: &SimConfig) -> SsmSet {
        let mut rng = stream(cfg.payload_seed, Stream::Recurrent);
        let heads_k = rng.random_range(1..=2);
        let dims = SsmDims {
            kernel: [2, 3, 4, 4][rng.random_range(0..4)],
            heads_k,
            heads_v: heads_k * rng.random_range(1..=2),
            dk: [4, 8, 16][rng.random_range(0..3)],
            dv: [2, 4, 8][rng.random_range(0..3)],
            dtype: match cfg.dtype {
                DtypeChoice::F32 => RefDtype::F32,
                DtypeChoice::Bf16 => RefDtype::Bf16,
            },
        };
        let (name, layers) = if rng.random_bool(0.5) {
            ("ssm", vec![LayerKind::DeltaNet, LayerKind::DeltaNet])
        } else {
            match cfg.layout {
                LayoutChoice::Linear => (
                    "hybrid:qwen35",
                    vec![
                        LayerKind::DeltaNet,
                        LayerKind::DeltaNet,
                        LayerKind::DeltaNet,
                        LayerKind::Attention { window: None },
                    ],
                ),
                LayoutChoice::Rotating { window } => (
                    "hybrid:sliding",
                    vec![
                        LayerKind::DeltaNet,
                        LayerKind::Attention { window: Some(window) },
                        LayerKind::DeltaNet,
                        LayerKind::Attention { window: None },
                    ],
                ),
            }
        };
        SsmSet { name, layers, dims }
    }

    pub fn spec(&self) -> SsmSpec {
        let d = &self.dims;
        let dtype = if d.dtype == RefDtype::Bf16 { kvsim_cache::KvDtype::Bf16 } else { kvsim_cache::KvDtype::F32 };
        SsmSpec { kernel: d.kernel, heads_k: d.heads_k, heads_v: d.heads_v, dk: d.dk, dv: d.dv, dtype }
    }

    fn hybrid(&self) -> bool {
        self.layers.iter().any(|l| matches!(l, LayerKind::Attention { .. }))
    }
}

/// A layer's weights: DeltaNet params and their f64 model, or an attention layer's window.
enum LayerDef {
    DeltaNet { params: GdnParams, weights: SsmWeights },
    Attention { window: Option<usize> },
}

/// One layer's cache of one request (outside the batch) or one twin.
#[derive(Clone)]
enum Cache {
    Ssm(SsmCache),
    Attn(SerialCache),
}

/// One layer of the running batch.
enum Rows {
    Ssm(SsmCache),
    Attn(RowBatch),
}

/// One request: its caches outside the batch, its twins, its models (DeltaNet layers) and positions fed.
struct Req {
    solo: Vec<Cache>,
    twin: Vec<Cache>,
    models: Vec<Option<SsmRowModel>>,
    pos: usize,
}

/// The recurrent family's layers of one run.
pub struct Recurrent {
    set: SsmSet,
    spec: SsmSpec,
    attn: KvSpec,
    values: SsmValues,
    layers: Vec<LayerDef>,
    /// Every live request of the roster (`Cx::roster`), by id.
    reqs: BTreeMap<u32, Req>,
    /// The running batch, one per layer (row `i` is the roster's `rows()[i]`).
    batch: Vec<Rows>,
    round_no: u64,
    counters: Counters,
    /// The observer has been told the geometry and weights ([`Call::SsmLayers`]).
    described: bool,
    /// Coverage classes the current op reached through this family's state ([`Family::take_reached`]).
    reached: Vec<&'static str>,
}

/// Describes a production call to the observer (only called when it wants calls).
fn emit(cx: &mut Cx<'_>, call: Call<'_>) -> Res<()> {
    cx.observer.on_call(call).map_err(|e| Failure::new("mlx", format!("observe: {e}")))
}

fn arr(bits: &[u32], shape: &[usize], d: RefDtype) -> Array {
    let s: Vec<i32> = shape.iter().map(|&x| x as i32).collect();
    match d {
        RefDtype::F32 => Array::from_slice(&bits.iter().map(|&b| f32::from_bits(b)).collect::<Vec<_>>(), &s),
        RefDtype::Bf16 => {
            let h: Vec<half::bf16> = bits.iter().map(|&b| half::bf16::from_bits(b as u16)).collect();
            Array::from_slice(&h, &s)
        }
    }
}

fn words(a: &Array) -> Res<ArrayBytes> {
    ArrayBytes::of(a).map_err(|e| Failure::new("bytes", e.to_string()))
}

fn to_f64(b: &ArrayBytes, i: usize) -> f64 {
    match b.dtype {
        Dtype::Bfloat16 => f32::from_bits((b.words.get(i) as u32) << 16) as f64,
        _ => f32::from_bits(b.words.get(i) as u32) as f64,
    }
}

/// Worst distance of found values to expected f64 values, in ULPs of `unit` at output scale.
fn worst_ulp(found: &ArrayBytes, start: usize, expected: &[f64], unit: Dtype) -> f64 {
    expected.iter().enumerate().fold(0.0f64, |w, (i, &e)| {
        let f = to_f64(found, start + i);
        if !f.is_finite() {
            return f64::INFINITY;
        }
        w.max((f - e).abs() / ulp_at(unit, e))
    })
}

/// Words `[start, start + n)` of `a` equal words `[0, n)` of `b` (and `b` holds exactly `n`).
fn same_slice(a: &ArrayBytes, start: usize, b: &ArrayBytes) -> bool {
    let n = b.words.len();
    start + n <= a.words.len() && (0..n).all(|i| a.words.get(start + i) == b.words.get(i))
}

/// Rows `[r, r + 1)`, positions `[st, en)` of a `[B, S, ...]` input (`seq_axis` 1) or `[B, H, S, D]` (axis 2).
fn pick(x: &Array, r: usize, st: usize, en: usize, seq_axis: usize) -> Res<Array> {
    let (r, st, en) = (r as i32, st as i32, en as i32);
    let got = if seq_axis == 1 { x.try_index((r..r + 1, st..en, ..)) } else { x.try_index((r..r + 1, .., st..en, ..)) };
    got.map_err(|e| Failure::new("mlx", format!("slice: {e}")))
}

/// A row of a layer call: (request, first position, real range `[st, en)` of the window).
type RowIn = (u64, usize, usize, usize);

impl Recurrent {
    pub fn new(cfg: &SimConfig) -> Res<Recurrent> {
        let set = SsmSet::of(cfg);
        let spec = set.spec();
        let values = SsmValues { seed: cfg.payload_seed ^ 0x5353_4d5f_6661_6d31, dims: set.dims };
        let attn = cfg.kv_spec();
        let mut layers = vec![];
        let mut batch = vec![];
        for (i, k) in set.layers.iter().enumerate() {
            match *k {
                LayerKind::DeltaNet => {
                    let (w, a, t) = values.weight_bits(i as u32);
                    let c = set.dims.conv_dim();
                    let params = GdnParams {
                        conv_weight: arr(&w, &[c, set.dims.kernel, 1], set.dims.dtype),
                        a_log: arr(&a, &[set.dims.heads_v], RefDtype::F32),
                        dt_bias: arr(&t, &[set.dims.heads_v], set.dims.dtype),
                    };
                    layers.push(LayerDef::DeltaNet { params, weights: values.weights(i as u32) });
                    batch.push(Rows::Ssm(SsmCache::new(spec, 0).map_err(|e| mlx("new", e))?));
                }
                LayerKind::Attention { window } => {
                    layers.push(LayerDef::Attention { window });
                    batch.push(Rows::Attn(RowBatch::with_rows(attn, window, 0).map_err(|e| mlx("new", e))?));
                }
            }
        }
        Ok(Recurrent {
            set,
            spec,
            attn,
            values,
            layers,
            reqs: BTreeMap::new(),
            batch,
            round_no: 0,
            counters: Counters::default(),
            described: false,
            reached: Vec::new(),
        })
    }

    /// The set this run holds.
    pub fn set(&self) -> &SsmSet {
        &self.set
    }

    fn dtype(&self) -> Dtype {
        self.spec.dtype.to_mlx()
    }

    fn bound(&self) -> f64 {
        ssm_model_bound(self.set.dims.dtype)
    }

    fn fresh_caches(&self) -> Res<Vec<Cache>> {
        self.layers
            .iter()
            .map(|l| match l {
                LayerDef::DeltaNet { .. } => SsmCache::new(self.spec, 1).map(Cache::Ssm),
                LayerDef::Attention { window } => SerialCache::new(self.attn, *window).map(Cache::Attn),
            })
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| mlx("new", e))
    }

    // ----- payloads --------------------------------------------------------------------------------------------

    /// DeltaNet inputs `[n, s, ...]` of `layer` for `rows`; padded slots hold poison, rejected drafts (positions at
    /// or past `draft[r]`) values that are never the request's real token there.
    fn ssm_inputs(&self, layer: u32, rows: &[RowIn], s: usize, draft: Option<&[usize]>) -> [Array; 3] {
        let d = &self.set.dims;
        let (mut q, mut a, mut b) = (vec![], vec![], vec![]);
        for (r, &(req, p0, st, en)) in rows.iter().enumerate() {
            for t in 0..s {
                let (x, y, z) = if t < st || t >= en {
                    self.values.pad_bits(layer, r as u64, t as u64)
                } else if draft.is_some_and(|k| t - st >= k[r]) {
                    self.values.pad_bits(layer, 1_000_000 + self.round_no, (req << 16) ^ (p0 + t - st) as u64)
                } else {
                    self.values.token_bits(layer, req, (p0 + t - st) as u64)
                };
                q.extend(x);
                a.extend(y);
                b.extend(z);
            }
        }
        let n = rows.len();
        [
            arr(&q, &[n, s, d.conv_dim()], d.dtype),
            arr(&a, &[n, s, d.heads_v], d.dtype),
            arr(&b, &[n, s, d.heads_v], d.dtype),
        ]
    }

    /// Attention K, V, Q `[n, H, s, D]` for the same rows (real tokens keyed by request and position).
    fn attn_inputs(&self, layer: u32, rows: &[RowIn], s: usize, draft: Option<&[usize]>) -> [Array; 3] {
        let sp = &self.attn;
        let d = self.set.dims.dtype;
        let hq = sp.heads_kv * 2;
        let mut out = vec![];
        for (tensor, heads) in [(10u64, sp.heads_kv), (11, sp.heads_kv), (12, hq)] {
            let mut v = vec![];
            for (r, &(req, p0, st, en)) in rows.iter().enumerate() {
                for h in 0..heads {
                    for t in 0..s {
                        let key = if t < st || t >= en {
                            [tensor, layer as u64, 1 << 40 | r as u64, t as u64]
                        } else if draft.is_some_and(|k| t - st >= k[r]) {
                            [tensor, layer as u64, 2 << 40 | self.round_no, (req << 16) ^ (p0 + t) as u64]
                        } else {
                            [tensor, layer as u64, req, (p0 + t - st) as u64]
                        };
                        let base = SsmValues { seed: self.values.seed ^ key[0], dims: self.set.dims };
                        // One draw gives conv_dim values; more draws (further slots) until the head is full.
                        let mut bits = vec![];
                        for j in 0u64.. {
                            if bits.len() >= sp.head_dim {
                                break;
                            }
                            bits.extend(base.pad_bits(key[1] as u32, key[2], (key[3] * 64 + h as u64) * 64 + j).0);
                        }
                        v.extend(bits.into_iter().take(sp.head_dim).map(|b| {
                            let x = kvsim_reference::bits_to_f32(d, b) / 8.0;
                            kvsim_reference::round_to(d, x as f64)
                        }));
                    }
                }
            }
            out.push(arr(&v, &[rows.len(), heads, s, sp.head_dim], d));
        }
        [out[0].clone(), out[1].clone(), out[2].clone()]
    }

    fn tokens(&self, layer: u32, req: u64, p0: usize, n: usize) -> Vec<SsmToken> {
        (0..n).map(|t| self.values.token(layer, req, (p0 + t) as u64)).collect()
    }
}

impl Family for Recurrent {
    fn key(&self) -> &'static str {
        self.set.name
    }

    fn apply(&mut self, op: &Op, cx: &mut Cx<'_>) -> Res<bool> {
        let roster = cx.roster;
        if cx.observer.wants_calls() && !self.described {
            self.described = true;
            let params: Vec<GdnParams> = self
                .layers
                .iter()
                .filter_map(|l| match l {
                    LayerDef::DeltaNet { params, .. } => Some(params.clone()),
                    LayerDef::Attention { .. } => None,
                })
                .collect();
            emit(cx, Call::SsmLayers { spec: self.spec, params: &params })?;
        }
        if let Some(change) = cx.change {
            self.carry_out(cx, change)?;
            return Ok(true);
        }
        match op {
            // Lifecycle ops that change nothing were skipped by the roster, but for an extract of a missing row.
            Op::Admit { .. } | Op::Merge { .. } | Op::Join { .. } | Op::BatchPrefill { .. } | Op::Filter { .. } => {
                Ok(false)
            }
            Op::Extract { row, .. } => self.extract_missing(*row as usize),
            Op::SoloWindow { req, len } => {
                if !roster.is_solo(*req) || *len == 0 {
                    return Ok(false);
                }
                self.solo_forward(cx, *req, *len as usize, false)?;
                Ok(true)
            }
            Op::SoloDecode { req } => {
                if !roster.is_solo(*req) {
                    return Ok(false);
                }
                self.solo_forward(cx, *req, 1, true)?;
                Ok(true)
            }
            Op::Decode => self.decode(cx),
            Op::Window { len } | Op::Append { len } => self.window(cx, *len as usize),
            Op::Verify { gamma, accept } => self.verify(cx, *gamma as usize, accept),
            Op::CommitSpan { len } => self.commit_span(cx, *len as usize),
            Op::TrainingForward { lengths, len, .. } => self.training_forward(cx, lengths, *len as usize),
            Op::TrainingRefusal { .. } => self.training_refusal(),
            // The bf16-first family's own ops touch no cache here: `check_all` after the op proves it.
            Op::PrefixReuse { .. } | Op::PlainRead | Op::Fetch { .. } => Ok(true),
            Op::Persist { req, mlxlm } => {
                if !roster.is_solo(*req) {
                    return Ok(false);
                }
                let r = self.reqs.get_mut(req).unwrap();
                let caches = std::mem::take(&mut r.solo);
                r.solo = persist_roundtrip(caches, *mlxlm, &mut self.counters)?;
                self.counters.persist_roundtrips += 1;
                self.persist_recurrent_set(*req)?;
                if !roster.rows().is_empty() {
                    self.persist_batch()?;
                }
                Ok(true)
            }
            // Not supported (never dispatched here): trims, the attention-only special reads, prefix-shared forwards.
            Op::Trim { .. }
            | Op::SoloTrim { .. }
            | Op::ReadBlock { .. }
            | Op::BidirPrefill { .. }
            | Op::EncoderRead { .. }
            | Op::CompiledStep { .. }
            | Op::CompiledBatchStep
            | Op::CommitKnownSpans { .. }
            | Op::PrefixSharedForward { .. }
            | Op::Adopt { .. }
            | Op::DecodePhase
            | Op::Prepare { .. }
            | Op::IllFormed { .. }
            | Op::Quantize { .. }
            | Op::Paged { .. } => Ok(false),
        }
    }

    fn check_state(&mut self, cx: &mut Cx<'_>) -> Res<()> {
        self.check_all(cx)
    }

    /// Every live request's two states per DeltaNet layer (`[1, K-1, conv_dim]`, `[1, Hv, Dv, Dk]`) and positions.
    fn observe_state(&mut self, cx: &mut Cx<'_>) -> Res<()> {
        let roster = cx.roster;
        if !cx.observer.wants_calls() {
            return Ok(());
        }
        let mut views = BTreeMap::new();
        for (r, id) in roster.rows().iter().enumerate() {
            let mut layers = vec![];
            for b in &self.batch {
                if let Rows::Ssm(b) = b {
                    layers.push(b.row_states(r).map_err(|e| mlx("row states", e))?);
                }
            }
            views.insert(
                *id,
                StateView { row: Some(r), offset: self.reqs[id].pos, layers, planes: None, rings: vec![], quant: None },
            );
        }
        for (id, req) in roster.solo().map(|id| (id, &self.reqs[&id])) {
            let mut layers = vec![];
            for c in &req.solo {
                if let Cache::Ssm(c) = c {
                    layers.push(c.row_states(0).map_err(|e| mlx("row states", e))?);
                }
            }
            views
                .insert(id, StateView { row: None, offset: req.pos, layers, planes: None, rings: vec![], quant: None });
        }
        cx.observer.on_state(views).map_err(|e| Failure::new("mlx", format!("observe: {e}")))
    }

    fn position(&self, req: u32) -> Option<(usize, Option<usize>)> {
        self.reqs.get(&req).map(|r| (r.pos, None))
    }

    fn counters(&self) -> &Counters {
        &self.counters
    }

    fn counters_mut(&mut self) -> &mut Counters {
        &mut self.counters
    }

    fn take_reached(&mut self) -> Vec<&'static str> {
        std::mem::take(&mut self.reached)
    }
}
