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

use std::collections::BTreeMap;

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{Array, Dtype};
use rand::Rng;

use crate::sim::check::{self, ulp_at, Failure};
use crate::sim::config::{DtypeChoice, LayoutChoice, SimConfig};
use crate::sim::family::attention::mlx_fail;
use crate::sim::family::{entering, join_permutation, Cx, Family, Registration, View};
use crate::sim::observe::{Call, Read, StateView};
use crate::sim::ops::{Op, OpKind};
use crate::sim::rng::{stream, Stream};
use crate::sim::summary::Counters;
use kvsim_cache::bytes::ArrayBytes;
use kvsim_cache::{
    CacheError, GdnParams, JoinSource, KvSpec, Masks, RowBatch, SerialCache, SsmCache, SsmSpec, TrainingSsmCache,
};
use kvsim_reference::{RefDtype, SsmDims, SsmRowModel, SsmToken, SsmValues, SsmWeights};

#[cfg(test)]
mod tests;

type Res<T = ()> = Result<T, Failure>;

pub const NAME: &str = "ssm";

/// The recurrent family: everything but trims, the attention-only special reads and the prefix-shared forward, and
/// the attention API probes (`adopt`, `decode_phase`, `prepare` into holding rows, ill-formed inputs)
/// and the bf16-first family's own ops (`prefix_reuse`, `plain_read`).
pub const REGISTRATION: Registration = Registration {
    name: NAME,
    supports: |k: OpKind| {
        !matches!(
            k,
            OpKind::Trim
                | OpKind::SoloTrim
                | OpKind::ReadBlock
                | OpKind::BidirPrefill
                | OpKind::CompiledStep
                | OpKind::PrefixSharedForward
                | OpKind::Adopt
                | OpKind::DecodePhase
                | OpKind::Prepare
                | OpKind::IllFormed
                | OpKind::Quantize
                | OpKind::PrefixReuse
                | OpKind::PlainRead
        )
    },
    swarm_probability: 0.4,
    owns: |_| false,
    draw_params: None,
    weights_from_params: |_| Vec::new(),
    draws_op: None,
    build: |cfg| Ok(Box::new(Recurrent::new(cfg)?)),
};

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

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Home {
    Solo,
    Batch,
}

/// One request: its caches outside the batch, its twins, its models (DeltaNet layers) and positions fed.
struct Req {
    home: Home,
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
    reqs: BTreeMap<u32, Req>,
    batch: Vec<Rows>,
    rows: Vec<u32>,
    next_id: u32,
    round_no: u64,
    counters: Counters,
    /// The observer has been told the geometry and weights ([`Call::SsmLayers`]).
    described: bool,
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
            rows: vec![],
            next_id: 0,
            round_no: 0,
            counters: Counters::default(),
            described: false,
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

    // ----- reads -----------------------------------------------------------------------------------------------

    /// Outputs of one row vs the twin's (bytes) and the model (ULPs): `yb` holds `[.., s, Hv*Dv]` row-major, the row's
    /// real positions start at word `base`; `tb` is the twin's output over exactly those positions.
    #[allow(clippy::too_many_arguments)]
    fn check_row_output(
        &mut self,
        layer: u32,
        what: &str,
        yb: &ArrayBytes,
        base: usize,
        tb: &ArrayBytes,
        model: &mut SsmRowModel,
        weights: &SsmWeights,
        tokens: &[SsmToken],
    ) -> Res {
        let dtype = self.dtype();
        self.counters.checks += 1;
        if !same_slice(yb, base, tb) {
            return crate::sim::check::fail(Failure::new(
                "ssm_output_vs_twin",
                format!("layer {layer} {what}: outputs at real positions differ from the solo run"),
            ));
        }
        self.record("ssm_output_vs_twin", 1);
        let per = self.set.dims.heads_v * self.set.dims.dv;
        for (t, tok) in tokens.iter().enumerate() {
            let e = model.step(weights, tok);
            let w = worst_ulp(yb, base + t * per, &e, dtype);
            let r = &mut self.counters.recurrent;
            r.model_max_ulp_output = r.model_max_ulp_output.max(w);
            self.counters.checks += 1;
            if w > self.bound() {
                return crate::sim::check::fail(Failure::new(
                    "ssm_output_vs_model",
                    format!("layer {layer} {what} position {t}: {w:.1} ULPs from the f64 model"),
                ));
            }
        }
        Ok(())
    }

    /// `n` byte-identical comparisons of class `class` (the family's guarantees table and `bit_exact`).
    /// A comparison that is measured, not promised (a batch's attention output on a GPU outside exact mode): counted
    /// in the class whether or not the bytes agree, with the distance in ULPs at output scale when they do not.
    fn record_measured(&mut self, class: &str, out: &ArrayBytes, twin: &ArrayBytes) {
        let dt = if self.dtype() == Dtype::Bfloat16 { "bf16" } else { "f32" };
        let worst = check::max_ulp_at_scale(out, twin);
        let e = self.counters.table.entry(format!("{class}/{dt}")).or_default();
        e.compared += 1;
        if worst == 0 {
            e.bit_exact += 1;
            self.counters.bit_exact_state += 1;
        } else {
            e.max_ulp = e.max_ulp.max(worst);
        }
    }

    fn record(&mut self, class: &str, n: u64) {
        let dt = if self.dtype() == Dtype::Bfloat16 { "bf16" } else { "f32" };
        let e = self.counters.table.entry(format!("{class}/{dt}")).or_default();
        e.compared += n;
        e.bit_exact += n;
        self.counters.bit_exact_state += n;
    }

    /// A window of `s` positions on every batch row, every layer: row `r` has real positions `real[r]`; with
    /// `draft`, a verify window whose row `r` accepts `draft[r]` (the models step only those). Twins run each
    /// row's real part (inside a round of their own when `draft`).
    fn batch_forward(&mut self, cx: &mut Cx<'_>, s: usize, real: &[(usize, usize)], draft: Option<&[usize]>) -> Res {
        let rows: Vec<RowIn> =
            self.rows.iter().enumerate().map(|(r, id)| (*id as u64, self.reqs[id].pos, real[r].0, real[r].1)).collect();
        let masks = Masks::new();
        let per = self.set.dims.heads_v * self.set.dims.dv;
        for li in 0..self.layers.len() {
            let idx = li as u32;
            match &self.layers[li] {
                LayerDef::DeltaNet { params, weights } => {
                    let (params, weights) = (params.clone(), weights.clone());
                    let [q, a, b] = self.ssm_inputs(idx, &rows, s, draft);
                    let Rows::Ssm(batch) = &mut self.batch[li] else { unreachable!() };
                    let decode = s == 1 && draft.is_none() && batch.padding().is_none();
                    let y = if decode { batch.decode(&q, &a, &b, &params) } else { batch.window(&q, &a, &b, &params) }
                        .map_err(|e| mlx("ssm window", e))?;
                    if cx.observer.wants_calls() {
                        let read = if decode { Read::Decode } else { Read::Window };
                        let reqs = self.rows.clone();
                        emit(
                            cx,
                            Call::SsmCall {
                                req: None,
                                layer: li,
                                read,
                                reqs: &reqs,
                                qkv: &q,
                                a: &a,
                                b: &b,
                                out: &y,
                                spans: real,
                            },
                        )?;
                    }
                    let yb = words(&y)?;
                    cx.hasher.update(&yb.digest());
                    for (r, &(st, en)) in real.iter().enumerate() {
                        if en == st {
                            continue;
                        }
                        let id = self.rows[r];
                        let n_model = draft.map_or(en - st, |k| k[r]);
                        let tokens = self.tokens(idx, id as u64, rows[r].1, n_model);
                        let req = self.reqs.get_mut(&id).unwrap();
                        let Cache::Ssm(twin) = &mut req.twin[li] else { unreachable!() };
                        if draft.is_some() {
                            twin.spec_round_begin().map_err(|e| mlx("twin begin", e))?;
                        }
                        let (pq, pa, pb) = (pick(&q, r, st, en, 1)?, pick(&a, r, st, en, 1)?, pick(&b, r, st, en, 1)?);
                        let ty = twin.window(&pq, &pa, &pb, &params).map_err(|e| mlx("twin window", e))?;
                        let tb = words(&ty)?;
                        let mut model = req.models[li].take().unwrap();
                        let got = self.check_row_output(
                            idx,
                            &format!("row {r}"),
                            &yb,
                            (r * s + st) * per,
                            &tb,
                            &mut model,
                            &weights,
                            &tokens,
                        );
                        self.reqs.get_mut(&id).unwrap().models[li] = Some(model);
                        got?;
                    }
                }
                LayerDef::Attention { .. } => {
                    let [k, v, q] = self.attn_inputs(idx, &rows, s, draft);
                    let Rows::Attn(batch) = &mut self.batch[li] else { unreachable!() };
                    let decode = s == 1 && draft.is_none() && !batch.is_pending();
                    let (out, _) = if decode {
                        batch.decode(&k, &v, &q, SCALE, &masks)
                    } else {
                        batch.window(&k, &v, &q, SCALE, &masks)
                    }
                    .map_err(|e| mlx("attention read", e))?;
                    cx.hasher.update(&words(&out)?.digest());
                    for (r, &(st, en)) in real.iter().enumerate() {
                        if en == st {
                            continue;
                        }
                        let id = self.rows[r];
                        let Cache::Attn(twin) = &mut self.reqs.get_mut(&id).unwrap().twin[li] else { unreachable!() };
                        let (pk, pv, pq) = (pick(&k, r, st, en, 2)?, pick(&v, r, st, en, 2)?, pick(&q, r, st, en, 2)?);
                        let (to, _) = if decode {
                            twin.decode(&pk, &pv, &pq, SCALE, &Masks::new())
                        } else {
                            twin.window(&pk, &pv, &pq, SCALE, &Masks::new())
                        }
                        .map_err(|e| mlx("twin attention read", e))?;
                        // Attention outputs of padded reads are measured by the attention family; here the set's
                        // attention layers are checked by their state bytes (check_state).
                        self.record_measured(
                            "hybrid_attention_output_vs_twin",
                            &words(&pick(&out, r, st, en, 2)?)?,
                            &words(&to)?,
                        );
                    }
                }
            }
        }
        // The forward's attention layers shared one mask memo: each family built once.
        check::mask_memo("hybrid batch forward", &masks.families())?;
        self.counters.checks += 1;
        Ok(())
    }

    /// `s` positions of request `id` outside the batch, every layer (`decode`: the decode path).
    fn solo_forward(&mut self, cx: &mut Cx<'_>, id: u32, s: usize, decode: bool) -> Res {
        let p0 = self.reqs[&id].pos;
        let rows = [(id as u64, p0, 0, s)];
        for li in 0..self.layers.len() {
            let idx = li as u32;
            match &self.layers[li] {
                LayerDef::DeltaNet { params, weights } => {
                    let (params, weights) = (params.clone(), weights.clone());
                    let [q, a, b] = self.ssm_inputs(idx, &rows, s, None);
                    let tokens = self.tokens(idx, id as u64, p0, s);
                    let req = self.reqs.get_mut(&id).unwrap();
                    let (Cache::Ssm(prod), Cache::Ssm(twin)) = (&mut req.solo[li], &mut req.twin[li]) else {
                        unreachable!()
                    };
                    let call = |c: &mut SsmCache| {
                        if decode {
                            c.decode(&q, &a, &b, &params)
                        } else {
                            c.window(&q, &a, &b, &params)
                        }
                    };
                    let y = call(prod).map_err(|e| mlx("solo call", e))?;
                    let ty = call(twin).map_err(|e| mlx("twin call", e))?;
                    if cx.observer.wants_calls() {
                        let read = if decode { Read::Decode } else { Read::Window };
                        emit(
                            cx,
                            Call::SsmCall {
                                req: Some(id),
                                layer: li,
                                read,
                                reqs: &[id],
                                qkv: &q,
                                a: &a,
                                b: &b,
                                out: &y,
                                spans: &[(0, s)],
                            },
                        )?;
                    }
                    let (yb, tb) = (words(&y)?, words(&ty)?);
                    cx.hasher.update(&yb.digest());
                    let mut model = req.models[li].take().unwrap();
                    let got = self.check_row_output(idx, "solo", &yb, 0, &tb, &mut model, &weights, &tokens);
                    self.reqs.get_mut(&id).unwrap().models[li] = Some(model);
                    got?;
                }
                LayerDef::Attention { .. } => {
                    let [k, v, q] = self.attn_inputs(idx, &rows, s, None);
                    let req = self.reqs.get_mut(&id).unwrap();
                    let (Cache::Attn(prod), Cache::Attn(twin)) = (&mut req.solo[li], &mut req.twin[li]) else {
                        unreachable!()
                    };
                    let call = |c: &mut SerialCache| {
                        if decode {
                            c.decode(&k, &v, &q, SCALE, &Masks::new())
                        } else {
                            c.window(&k, &v, &q, SCALE, &Masks::new())
                        }
                    };
                    let (o, _) = call(prod).map_err(|e| mlx("solo attention", e))?;
                    let (to, _) = call(twin).map_err(|e| mlx("twin attention", e))?;
                    let ob = words(&o)?;
                    cx.hasher.update(&ob.digest());
                    self.counters.checks += 1;
                    if ob != words(&to)? {
                        return crate::sim::check::fail(Failure::new(
                            "hybrid_output_vs_twin",
                            format!("layer {li}: solo read differs"),
                        ));
                    }
                    self.record("hybrid_attention_output_vs_twin", 1);
                }
            }
        }
        self.reqs.get_mut(&id).unwrap().pos += s;
        Ok(())
    }

    // ----- ops -------------------------------------------------------------------------------------------------

    fn solo_req(&self, id: u32) -> bool {
        self.reqs.get(&id).is_some_and(|r| r.home == Home::Solo)
    }

    fn admit(&mut self, id: u32) -> Res<bool> {
        if self.reqs.contains_key(&id) || id < self.next_id {
            return Ok(false);
        }
        let models = self
            .layers
            .iter()
            .map(|l| matches!(l, LayerDef::DeltaNet { .. }).then(|| SsmRowModel::new(self.set.dims)))
            .collect();
        let req = Req { home: Home::Solo, solo: self.fresh_caches()?, twin: self.fresh_caches()?, models, pos: 0 };
        self.reqs.insert(id, req);
        self.next_id = id + 1;
        Ok(true)
    }

    /// Requests outside the batch enter it after the running rows, listed in `perm` order (a permutation of the
    /// batch's rows): DeltaNet layers merge the (filtered) batch and the requests' one-row caches (`SsmCache::merge`,
    /// sources borrowed); attention layers join the batch's rows in that order and the requests' serial caches.
    fn enter(&mut self, cx: &mut Cx<'_>, ids: &[u32], perm: &[usize]) -> Res {
        let identity = perm.iter().enumerate().all(|(i, &r)| i == r);
        if cx.observer.wants_calls() {
            // A join's new row order is a filter keeping every row in that order (mlx-lm's filter reorders alike),
            // then the merge of the entering requests.
            if !identity {
                emit(cx, Call::Filter { keep: perm })?;
            }
            let offsets: Vec<usize> = ids.iter().map(|id| self.reqs[id].pos).collect();
            emit(cx, Call::Enter { reqs: ids, merge: true, offsets: &offsets, sizes: &offsets })?;
        }
        for li in 0..self.layers.len() {
            let joined = match &self.batch[li] {
                Rows::Ssm(b) => {
                    let permuted = if identity {
                        None
                    } else {
                        let mut p = b.clone();
                        p.filter(perm).map_err(|e| mlx("filter (join order)", e))?;
                        Some(p)
                    };
                    let mut src: Vec<&SsmCache> = vec![permuted.as_ref().unwrap_or(b)];
                    for id in ids {
                        let Cache::Ssm(c) = &self.reqs[id].solo[li] else { unreachable!() };
                        src.push(c);
                    }
                    Rows::Ssm(SsmCache::merge(self.spec, &src).map_err(|e| mlx("merge", e))?)
                }
                Rows::Attn(b) => {
                    let LayerDef::Attention { window } = self.layers[li] else { unreachable!() };
                    let mut src = vec![JoinSource::Rows(b, perm.to_vec())];
                    for id in ids {
                        let Cache::Attn(c) = &self.reqs[id].solo[li] else { unreachable!() };
                        src.push(JoinSource::Serial(c));
                    }
                    Rows::Attn(RowBatch::join(self.attn, window, &src).map_err(|e| mlx("join", e))?)
                }
            };
            self.batch[li] = joined;
        }
        self.rows = perm.iter().map(|&r| self.rows[r]).collect();
        for id in ids {
            let r = self.reqs.get_mut(id).unwrap();
            r.home = Home::Batch;
            r.solo.clear();
            self.rows.push(*id);
        }
        Ok(())
    }

    /// `merge` (identity order) or `join` (the running rows in `order`; empty = identity; anything but a
    /// permutation of the rows makes the op skipped, as in the attention family).
    fn merge_or_join(&mut self, cx: &mut Cx<'_>, reqs: &[u32], order: &[u32]) -> Res<bool> {
        let Some(perm) = join_permutation(order, self.rows.len()) else {
            return Ok(false);
        };
        let ids = entering(reqs, |r| self.solo_req(r));
        if ids.is_empty() {
            return Ok(false);
        }
        self.enter(cx, &ids, &perm)?;
        Ok(true)
    }

    /// The fresh requests' caches merged into the running batch, then one prepared prefill over the whole batch
    /// (running rows: all padding), in chunks of `chunk`, then finalize.
    fn batch_prefill(&mut self, cx: &mut Cx<'_>, reqs: &[u32], lengths: &[u32], chunk: usize) -> Res<bool> {
        let mut ids: Vec<u32> = vec![];
        let mut lens: Vec<usize> = vec![];
        for (i, &r) in reqs.iter().enumerate() {
            let fresh = self.reqs.get(&r).is_some_and(|q| q.home == Home::Solo && q.pos == 0);
            if fresh && !ids.contains(&r) {
                ids.push(r);
                lens.push(lengths.get(i).copied().unwrap_or(1).max(1) as usize);
            }
        }
        if ids.is_empty() || chunk == 0 {
            return Ok(false);
        }
        let left = !self.set.hybrid() && (ids[0] as usize + chunk) % 3 != 0;
        let old = self.rows.len();
        self.enter(cx, &ids, &(0..old).collect::<Vec<_>>())?;
        let width = *lens.iter().max().unwrap();
        // Running rows are all padding: right padding (`lengths = 0`), or with left padding `left = lengths =
        // width`, so a mask that ignored left padding would step their states (bug catalog #1).
        let mut lengths = vec![if left { width } else { 0 }; old];
        let mut lefts = vec![if left { width } else { 0 }; old];
        for &p in &lens {
            lengths.push(if left { width } else { p });
            lefts.push(if left { width - p } else { 0 });
        }
        for b in &mut self.batch {
            match b {
                Rows::Ssm(b) => b.prepare(&lengths, if left { &lefts } else { &[] }),
                Rows::Attn(b) => b.prepare(&lengths),
            }
            .map_err(|e| mlx("prepare", e))?;
        }
        if cx.observer.wants_calls() {
            emit(cx, Call::SsmPrepare { lengths: &lengths, left: if left { &lefts } else { &[] } })?;
        }
        self.counters.recurrent.padded_prefills += 1;
        self.counters.recurrent.left_padded_prefills += u64::from(left);
        // A side run: the cohort alone in a fresh batch, prepared with the same padding, its longest row filtered
        // out right after `prepare` (a filter of an empty batch whose left padding is pending), then the same
        // chunks; its rows must end byte-identical to theirs in the main run.
        let side_keep: Option<Vec<usize>> = (left && ids.len() > 1).then(|| {
            let longest = (0..lens.len()).max_by_key(|&i| (lens[i], usize::MAX - i)).unwrap_or(0);
            (0..lens.len()).filter(|&r| r != longest).collect()
        });
        let mut side: Vec<Option<SsmCache>> = vec![];
        if let Some(keep) = &side_keep {
            for b in &self.batch {
                side.push(match b {
                    Rows::Ssm(_) => {
                        let mut c = SsmCache::new(self.spec, ids.len()).map_err(|e| mlx("new", e))?;
                        c.prepare(&lengths[old..], &lefts[old..]).map_err(|e| mlx("prepare (side)", e))?;
                        c.filter(keep).map_err(|e| mlx("filter (pending prefill)", e))?;
                        Some(c)
                    }
                    Rows::Attn(_) => None,
                });
            }
        }
        let mut pad: Vec<(i64, i64)> = lefts.iter().zip(&lengths).map(|(&a, &b)| (a as i64, b as i64)).collect();
        let mut done = 0;
        while done < width {
            let s = chunk.min(width - done);
            let real: Vec<(usize, usize)> = pad
                .iter()
                .map(|&(l, n)| {
                    let st = l.clamp(0, s as i64);
                    (st as usize, n.clamp(0, s as i64).max(st) as usize)
                })
                .collect();
            if let Some(keep) = &side_keep {
                let rows: Vec<RowIn> = keep
                    .iter()
                    .map(|&r| {
                        let id = self.rows[old + r];
                        (id as u64, self.reqs[&id].pos, real[old + r].0, real[old + r].1)
                    })
                    .collect();
                for li in 0..self.layers.len() {
                    if let (Some(c), LayerDef::DeltaNet { params, .. }) = (&mut side[li], &self.layers[li]) {
                        let [q, a, b] = self.ssm_inputs(li as u32, &rows, s, None);
                        c.window(&q, &a, &b, params).map_err(|e| mlx("side prefill", e))?;
                    }
                }
            }
            self.batch_forward(cx, s, &real, None)?;
            for (r, &(st, en)) in real.iter().enumerate() {
                let id = self.rows[r];
                self.reqs.get_mut(&id).unwrap().pos += en - st;
            }
            pad.iter_mut().for_each(|(l, n)| {
                *l -= s as i64;
                *n -= s as i64;
            });
            done += s;
        }
        for b in &mut self.batch {
            match b {
                Rows::Ssm(b) => b.finalize(),
                Rows::Attn(b) => b.finalize(),
            }
            .map_err(|e| mlx("finalize", e))?;
        }
        if cx.observer.wants_calls() {
            emit(cx, Call::SsmFinalize)?;
        }
        if let Some(keep) = &side_keep {
            let mut matched = 0;
            for (li, c) in side.iter_mut().enumerate() {
                let (Some(c), Rows::Ssm(b)) = (c, &self.batch[li]) else { continue };
                c.finalize().map_err(|e| mlx("side finalize", e))?;
                for (i, &r) in keep.iter().enumerate() {
                    let (sc, sr) = c.row_states(i).map_err(|e| mlx("side row", e))?;
                    let (bc, br) = b.row_states(old + r).map_err(|e| mlx("row", e))?;
                    if words(&sc)? != words(&bc)?
                        || words(&sr)? != words(&br)?
                        || c.offsets()[i] != b.offsets()[old + r]
                    {
                        crate::sim::check::fail(Failure::new(
                            "ssm_filter_pending",
                            format!("layer {li} row {r}: filtered during a pending left-padded prefill, it differs"),
                        ))?;
                    }
                    matched += 1;
                }
            }
            self.counters.checks += matched;
            self.record("ssm_filter_pending", matched);
        }
        Ok(true)
    }

    fn decode(&mut self, cx: &mut Cx<'_>) -> Res<bool> {
        if self.rows.is_empty() {
            return Ok(false);
        }
        self.batch_forward(cx, 1, &vec![(0, 1); self.rows.len()], None)?;
        self.advance(&vec![1; self.rows.len()]);
        Ok(true)
    }

    fn advance(&mut self, n: &[usize]) {
        for (id, &k) in self.rows.iter().zip(n) {
            self.reqs.get_mut(id).unwrap().pos += k;
        }
    }

    fn window(&mut self, cx: &mut Cx<'_>, len: usize) -> Res<bool> {
        if self.rows.is_empty() || len == 0 {
            return Ok(false);
        }
        self.batch_forward(cx, len, &vec![(0, len); self.rows.len()], None)?;
        self.advance(&vec![len; self.rows.len()]);
        Ok(true)
    }

    /// A committed span of `len` positions on every batch row, every layer: DeltaNet layers through
    /// `SsmCache::commit_span` (the positions one recurrence step at a time), attention layers through
    /// `RowBatch::commit_span`; each row's twin runs `len` single decodes. Promised: every DeltaNet output of the span
    /// byte-identical to the twin's single steps (and within the bound of the f64 model); states are compared after
    /// the op by `check_state`, as after any op. Attention outputs are recorded when byte-identical (a batch decode
    /// of rows of different lengths is a padded read, measured by the attention family).
    fn commit_span(&mut self, cx: &mut Cx<'_>, len: usize) -> Res<bool> {
        if self.rows.is_empty() || len == 0 {
            return Ok(false);
        }
        let rows: Vec<RowIn> = self.rows.iter().map(|id| (*id as u64, self.reqs[id].pos, 0, len)).collect();
        let masks = Masks::new();
        let per = self.set.dims.heads_v * self.set.dims.dv;
        for li in 0..self.layers.len() {
            let idx = li as u32;
            match &self.layers[li] {
                LayerDef::DeltaNet { params, weights } => {
                    let (params, weights) = (params.clone(), weights.clone());
                    let [q, a, b] = self.ssm_inputs(idx, &rows, len, None);
                    let Rows::Ssm(batch) = &mut self.batch[li] else { unreachable!() };
                    let padded = batch.padding().is_some();
                    let y = batch.commit_span(&q, &a, &b, &params).map_err(|e| mlx("ssm commit_span", e))?;
                    if cx.observer.wants_calls() {
                        // The oracle sees the span as what it promises to equal: one decode per position.
                        let reqs = self.rows.clone();
                        let spans = vec![(0usize, 1usize); reqs.len()];
                        let read = if padded { Read::Window } else { Read::Decode };
                        for t in 0..len as i32 {
                            let at = |x: &Array| {
                                x.try_index((.., t..t + 1, ..)).map_err(|e| Failure::new("mlx", format!("slice: {e}")))
                            };
                            let (qt, at_, bt, yt) = (at(&q)?, at(&a)?, at(&b)?, at(&y)?);
                            let call = Call::SsmCall {
                                req: None,
                                layer: li,
                                read,
                                reqs: &reqs,
                                qkv: &qt,
                                a: &at_,
                                b: &bt,
                                out: &yt,
                                spans: &spans,
                            };
                            emit(cx, call)?;
                        }
                    }
                    let yb = words(&y)?;
                    cx.hasher.update(&yb.digest());
                    for r in 0..self.rows.len() {
                        let id = self.rows[r];
                        let tokens = self.tokens(idx, id as u64, rows[r].1, len);
                        let req = self.reqs.get_mut(&id).unwrap();
                        let Cache::Ssm(twin) = &mut req.twin[li] else { unreachable!() };
                        let mut steps = Vec::with_capacity(len);
                        for t in 0..len {
                            let (pq, pa, pb) =
                                (pick(&q, r, t, t + 1, 1)?, pick(&a, r, t, t + 1, 1)?, pick(&b, r, t, t + 1, 1)?);
                            steps.push(twin.decode(&pq, &pa, &pb, &params).map_err(|e| mlx("twin decode", e))?);
                        }
                        let ty = mlx_rs::ops::concatenate(&steps, 1).map_err(|e| mlx_fail("concatenate", e))?;
                        let tb = words(&ty)?;
                        let mut model = req.models[li].take().unwrap();
                        let got = self.check_row_output(
                            idx,
                            &format!("row {r} span of {len} vs single steps"),
                            &yb,
                            r * len * per,
                            &tb,
                            &mut model,
                            &weights,
                            &tokens,
                        );
                        self.reqs.get_mut(&id).unwrap().models[li] = Some(model);
                        got?;
                        self.record("ssm_span_vs_single_steps", 1);
                    }
                }
                LayerDef::Attention { .. } => {
                    let [k, v, q] = self.attn_inputs(idx, &rows, len, None);
                    let Rows::Attn(batch) = &mut self.batch[li] else { unreachable!() };
                    let out =
                        batch.commit_span(&k, &v, &q, SCALE, &masks).map_err(|e| mlx("attention commit_span", e))?;
                    cx.hasher.update(&words(&out)?.digest());
                    for r in 0..self.rows.len() {
                        let id = self.rows[r];
                        let Cache::Attn(twin) = &mut self.reqs.get_mut(&id).unwrap().twin[li] else { unreachable!() };
                        let mut steps = Vec::with_capacity(len);
                        for t in 0..len {
                            let (pk, pv, pq) =
                                (pick(&k, r, t, t + 1, 2)?, pick(&v, r, t, t + 1, 2)?, pick(&q, r, t, t + 1, 2)?);
                            let (o, _) = twin
                                .decode(&pk, &pv, &pq, SCALE, &Masks::new())
                                .map_err(|e| mlx("twin attention decode", e))?;
                            steps.push(o);
                        }
                        let to = mlx_rs::ops::concatenate(&steps, 2).map_err(|e| mlx_fail("concatenate", e))?;
                        self.record_measured(
                            "hybrid_attention_output_vs_twin",
                            &words(&pick(&out, r, 0, len, 2)?)?,
                            &words(&to)?,
                        );
                    }
                }
            }
        }
        self.advance(&vec![len; self.rows.len()]);
        Ok(true)
    }

    /// A speculative round of `gamma` draft positions; row `r` accepts `min(accept[r], gamma)` (all when absent).
    fn verify(&mut self, cx: &mut Cx<'_>, gamma: usize, accept: &[u32]) -> Res<bool> {
        if self.rows.is_empty() || gamma == 0 {
            return Ok(false);
        }
        let n = self.rows.len();
        let keep: Vec<usize> =
            (0..n).map(|r| (accept.get(r).copied().unwrap_or(gamma as u32) as usize).min(gamma)).collect();
        self.round_no += 1;
        self.counters.recurrent.rounds += 1;
        // Pre-round twins: the fresh-prefix runs start from them.
        let snapshots: Vec<Vec<Cache>> = self.rows.iter().map(|id| self.reqs[id].twin.clone()).collect();
        for b in &mut self.batch {
            if let Rows::Ssm(b) = b {
                if b.trim(1) != Err(CacheError::RecurrentNotTrimmable) {
                    crate::sim::check::fail(Failure::new(
                        "ssm_round_errors",
                        "a trim of a recurrent state was not refused",
                    ))?;
                }
                b.spec_round_begin().map_err(|e| mlx("begin", e))?;
                if b.spec_round_begin() != Err(CacheError::SpecRoundActive) {
                    crate::sim::check::fail(Failure::new("ssm_round_errors", "a second begin was not refused"))?;
                }
                self.counters.expected_errors += 2;
            }
        }
        self.batch_forward(cx, gamma, &vec![(0, gamma); n], Some(&keep))?;
        let all = keep.iter().all(|&k| k == gamma);
        let unequal = keep.iter().any(|&k| k != keep[0]);
        for li in 0..self.layers.len() {
            match &self.layers[li] {
                LayerDef::DeltaNet { params, .. } => {
                    let params = params.clone();
                    // Inputs of the fresh-prefix runs, built before the batch is borrowed.
                    let fresh_inputs: Vec<Option<[Array; 3]>> = keep
                        .iter()
                        .enumerate()
                        .map(|(r, &k)| {
                            let id = self.rows[r];
                            (k > 0)
                                .then(|| self.ssm_inputs(li as u32, &[(id as u64, self.reqs[&id].pos, 0, k)], k, None))
                        })
                        .collect();
                    let Rows::Ssm(b) = &mut self.batch[li] else { unreachable!() };
                    let before = b.stats();
                    if all {
                        b.spec_round_commit().map_err(|e| mlx("commit", e))?;
                    } else {
                        let too_far = vec![gamma + 1; n];
                        if b.spec_round_rollback_rows(&too_far)
                            != Err(CacheError::KeepOutsideWindow { keep: gamma + 1, window: gamma })
                        {
                            return Err(Failure::new("ssm_round_errors", "keep beyond the window was not refused"));
                        }
                        self.counters.expected_errors += 1;
                        b.spec_round_rollback_rows(&keep).map_err(|e| mlx("rollback", e))?;
                    }
                    let after = b.stats();
                    let (hr, cr) = (words(b.recurrent())?, words(b.conv())?);
                    let offsets = b.offsets().to_vec();
                    self.counters.recurrent.replays += after.replays - before.replays;
                    self.counters.recurrent.replayed_steps += after.replayed_steps - before.replayed_steps;
                    for (r, &k) in keep.iter().enumerate() {
                        let id = self.rows[r];
                        let Cache::Ssm(t) = &mut self.reqs.get_mut(&id).unwrap().twin[li] else { unreachable!() };
                        if all {
                            t.spec_round_commit().map_err(|e| mlx("twin commit", e))?;
                        } else {
                            t.spec_round_rollback(k).map_err(|e| mlx("twin rollback", e))?;
                        }
                        if all {
                            continue;
                        }
                        // Replay vs a fresh run of the accepted prefix from the pre-round state.
                        let Cache::Ssm(mut fresh) = snapshots[r][li].clone() else { unreachable!() };
                        if let Some([q, a, b]) = &fresh_inputs[r] {
                            fresh.window(q, a, b, &params).map_err(|e| mlx("fresh prefix", e))?;
                        }
                        let (fr, fc) = (words(fresh.recurrent())?, words(fresh.conv())?);
                        let same = same_slice(&hr, r * fr.words.len(), &fr)
                            && same_slice(&cr, r * fc.words.len(), &fc)
                            && fresh.offsets()[0] == offsets[r];
                        self.counters.recurrent.replay_vs_fresh += 1;
                        self.counters.checks += 1;
                        if !same {
                            crate::sim::check::fail(Failure::new(
                                "ssm_replay_vs_fresh",
                                format!("layer {li} row {r}: keep {k} of {gamma}: replayed state is not the fresh prefix run"),
                            ))?;
                        }
                        self.record("ssm_replay_vs_fresh", 1);
                    }
                }
                LayerDef::Attention { .. } => {
                    let cut: Vec<usize> = keep.iter().map(|&k| gamma - k).collect();
                    if cut.iter().any(|&x| x > 0) {
                        let Rows::Attn(b) = &mut self.batch[li] else { unreachable!() };
                        b.trim_rows(&cut, true).map_err(|e| mlx("trim_rows", e))?;
                        for (r, &x) in cut.iter().enumerate() {
                            let id = self.rows[r];
                            let Cache::Attn(t) = &mut self.reqs.get_mut(&id).unwrap().twin[li] else { unreachable!() };
                            t.trim(x, true).map_err(|e| mlx("twin trim", e))?;
                        }
                    }
                }
            }
        }
        if all {
            self.counters.recurrent.commits += 1;
        } else {
            self.counters.recurrent.rollbacks += 1;
            self.counters.recurrent.rollbacks_unequal += u64::from(unequal);
        }
        if cx.observer.wants_calls() {
            let reqs = self.rows.clone();
            emit(cx, Call::SsmRound { reqs: &reqs, gamma, keep: &keep })?;
        }
        self.advance(&keep);
        Ok(true)
    }

    fn extract(&mut self, cx: &mut Cx<'_>, row: usize, finish: bool) -> Res<bool> {
        if self.rows.is_empty() {
            return Ok(false);
        }
        if row >= self.rows.len() {
            for b in &self.batch {
                let got = match b {
                    Rows::Ssm(b) => b.extract(row).map(|_| ()),
                    Rows::Attn(b) => b.extract(row).map(|_| ()),
                };
                if !matches!(got, Err(CacheError::NoSuchRow { .. })) {
                    return Err(Failure::new("errors", format!("extract of missing row {row}: got {got:?}")));
                }
            }
            self.counters.expected_errors += 1;
            return Ok(true);
        }
        let id = self.rows[row];
        let keep: Vec<usize> = (0..self.rows.len()).filter(|&r| r != row).collect();
        if cx.observer.wants_calls() {
            emit(cx, Call::Extract { row, req: id, finish, rows_left: keep.len() })?;
        }
        let mut out = vec![];
        for b in &mut self.batch {
            match b {
                Rows::Ssm(b) => {
                    out.push(Cache::Ssm(b.extract(row).map_err(|e| mlx("extract", e))?));
                    b.filter(&keep).map_err(|e| mlx("filter after extract", e))?;
                }
                Rows::Attn(b) => {
                    out.push(Cache::Attn(b.extract(row).map_err(|e| mlx("extract", e))?));
                    b.filter(&keep).map_err(|e| mlx("filter after extract", e))?;
                }
            }
        }
        self.rows.remove(row);
        if finish {
            self.reqs.remove(&id);
            return Ok(true);
        }
        let out = persist_roundtrip(out, false)?;
        self.counters.persist_roundtrips += 1;
        let attn = self.attn;
        let r = self.reqs.get_mut(&id).unwrap();
        r.home = Home::Solo;
        r.solo = out;
        // Layout event for the attention layers: extract de-rolls the row into a fresh serial cache (R-BROT-5).
        for (li, twin) in r.twin.iter_mut().enumerate() {
            if let (Cache::Attn(t), LayerDef::Attention { window }) = (twin, &self.layers[li]) {
                t.relinearize().map_err(|e| mlx("twin relinearize", e))?;
                let (k, v) = t.physical().map_err(|e| mlx("twin physical", e))?;
                let off = t.state().offset;
                *t =
                    SerialCache::from_temporal(attn, *window, &k, &v, off).map_err(|e| mlx("twin from_temporal", e))?;
            }
        }
        Ok(true)
    }

    fn filter(&mut self, cx: &mut Cx<'_>, keep: &[u32]) -> Res<bool> {
        if self.rows.is_empty() {
            return Ok(false);
        }
        let mut kept: Vec<usize> = vec![];
        for &k in keep {
            let k = k as usize;
            if k < self.rows.len() && !kept.contains(&k) {
                kept.push(k);
            }
        }
        for b in &mut self.batch {
            match b {
                Rows::Ssm(b) => {
                    // A repeated row is a typed error (and changes nothing: the state checks after this op see it).
                    if b.filter(&[0, 0]) != Err(CacheError::DuplicateRow { row: 0 }) {
                        crate::sim::check::fail(Failure::new("ssm_filter_errors", "a repeated row was not refused"))?;
                    }
                    self.counters.expected_errors += 1;
                    b.filter(&kept)
                }
                Rows::Attn(b) => b.filter(&kept),
            }
            .map_err(|e| mlx("filter", e))?;
        }
        if cx.observer.wants_calls() {
            emit(cx, Call::Filter { keep: &kept })?;
        }
        let dropped: Vec<u32> = (0..self.rows.len()).filter(|r| !kept.contains(r)).map(|r| self.rows[r]).collect();
        self.rows = kept.iter().map(|&r| self.rows[r]).collect();
        for id in dropped {
            self.reqs.remove(&id);
        }
        Ok(true)
    }

    /// A training forward of the DeltaNet layers (the training DeltaNet cache: zero state every call, state
    /// discarded) on `lengths.len()` right-padded rows of `n` positions. Checks: two calls give the same bytes;
    /// every row's real outputs equal the row run alone (a fresh one-row cache, bytes) and the f64 model.
    fn training_forward(&mut self, cx: &mut Cx<'_>, lengths: &[u32], n: usize) -> Res<bool> {
        let lengths: Vec<usize> = lengths.iter().map(|&l| l as usize).collect();
        let refused = lengths.is_empty() || n == 0 || lengths.iter().any(|&l| l > n);
        let cache = TrainingSsmCache::padded(self.spec, lengths.clone());
        let per = self.set.dims.heads_v * self.set.dims.dv;
        for li in 0..self.layers.len() {
            let LayerDef::DeltaNet { params, weights } = &self.layers[li] else { continue };
            let (params, weights) = (params.clone(), weights.clone());
            let rows: Vec<RowIn> = lengths.iter().enumerate().map(|(r, &l)| (TRAIN_REQ + r as u64, 0, 0, l)).collect();
            let [q, a, b] = self.ssm_inputs(li as u32, &rows, n, None);
            let got = cache.as_ref().map_err(|e| e.clone()).and_then(|c| c.forward(&q, &a, &b, &params));
            if refused {
                return match got {
                    Err(CacheError::BadLengths { .. } | CacheError::ShapeMismatch { .. }) => {
                        self.counters.expected_errors += 1;
                        self.counters.checks += 1;
                        Ok(true)
                    }
                    other => Err(Failure::new(
                        "errors",
                        format!("training forward of {n} with lengths {lengths:?}: got {:?}", other.map(|_| ())),
                    )),
                };
            }
            let y = got.map_err(|e| mlx("training forward", e))?;
            let yb = words(&y)?;
            let again = cache.as_ref().unwrap().forward(&q, &a, &b, &params).map_err(|e| mlx("again", e))?;
            self.counters.checks += 1;
            if words(&again)? != yb {
                crate::sim::check::fail(Failure::new(
                    "ssm_training_stateless",
                    format!("layer {li}: a second call differs"),
                ))?;
            }
            cx.hasher.update(&yb.digest());
            for (r, &l) in lengths.iter().enumerate() {
                if l == 0 {
                    continue;
                }
                let (pq, pa, pb) = (pick(&q, r, 0, l, 1)?, pick(&a, r, 0, l, 1)?, pick(&b, r, 0, l, 1)?);
                let mut twin = SsmCache::new(self.spec, 1).map_err(|e| mlx("twin", e))?;
                let ty = twin.window(&pq, &pa, &pb, &params).map_err(|e| mlx("twin", e))?;
                let tb = words(&ty)?;
                let tokens = self.tokens(li as u32, TRAIN_REQ + r as u64, 0, l);
                let mut model = SsmRowModel::new(self.set.dims);
                self.check_row_output(
                    li as u32,
                    &format!("training row {r}"),
                    &yb,
                    r * n * per,
                    &tb,
                    &mut model,
                    &weights,
                    &tokens,
                )?;
            }
        }
        Ok(true)
    }

    fn training_refusal(&mut self) -> Res<bool> {
        let c = TrainingSsmCache::new(self.spec).map_err(|e| mlx("training cache", e))?;
        match c.storage_kind().route() {
            Err(CacheError::TrainingOnly { kind }) if kind == kvsim_cache::kind::TRAINING_SSM => {
                self.counters.expected_errors += 1;
                self.counters.checks += 1;
                Ok(true)
            }
            other => Err(Failure::new("errors", format!("a training DeltaNet cache routed: {other:?}"))),
        }
    }

    // ----- state checks ----------------------------------------------------------------------------------------

    /// One row's DeltaNet states (`conv`, `rec` words of this row, offset) against twin and model.
    #[allow(clippy::too_many_arguments)]
    fn check_ssm_row(
        &mut self,
        cx: &mut Cx<'_>,
        li: usize,
        what: &str,
        conv: (&ArrayBytes, usize),
        rec: (&ArrayBytes, usize),
        offset: usize,
        id: u32,
    ) -> Res {
        let req = &self.reqs[&id];
        let (Cache::Ssm(twin), Some(model)) = (&req.twin[li], &req.models[li]) else { unreachable!() };
        self.counters.checks += 1;
        if offset != twin.offsets()[0] || offset != model.offset || offset != req.pos {
            return crate::sim::check::fail(Failure::new(
                "ssm_offsets",
                format!(
                    "layer {li} {what}: production {offset}, twin {}, model {}, fed {}",
                    twin.offsets()[0],
                    model.offset,
                    req.pos
                ),
            ));
        }
        let (tc, tr) = (words(twin.conv())?, words(twin.recurrent())?);
        cx.hasher.update(&tc.digest());
        cx.hasher.update(&tr.digest());
        self.counters.checks += 2;
        if !same_slice(conv.0, conv.1, &tc) {
            return crate::sim::check::fail(Failure::new(
                "ssm_state_vs_twin",
                format!("layer {li} {what}: conv state differs from the solo run"),
            ));
        }
        if !same_slice(rec.0, rec.1, &tr) {
            return crate::sim::check::fail(Failure::new(
                "ssm_state_vs_twin",
                format!("layer {li} {what}: recurrent state differs from the solo run"),
            ));
        }
        let want = model.conv_bits();
        self.counters.checks += 1;
        if !(0..want.len()).all(|i| conv.0.words.get(conv.1 + i) as u32 == want[i]) {
            return crate::sim::check::fail(Failure::new(
                "ssm_conv_vs_model",
                format!("layer {li} {what}: conv tail is not the last K-1 real inputs"),
            ));
        }
        let w = worst_ulp(rec.0, rec.1, &model.state, self.dtype());
        self.counters.recurrent.model_max_ulp_state = self.counters.recurrent.model_max_ulp_state.max(w);
        self.counters.checks += 1;
        if w > self.bound() {
            return crate::sim::check::fail(Failure::new(
                "ssm_state_vs_model",
                format!("layer {li} {what}: recurrent state {w:.1} ULPs from the f64 model"),
            ));
        }
        self.record("ssm_state_vs_twin", 2);
        Ok(())
    }

    fn check_attn(
        &mut self,
        cx: &mut Cx<'_>,
        li: usize,
        what: &str,
        id: u32,
        prod: (kvsim_cache::RingState, Array, Array),
    ) -> Res {
        let Cache::Attn(twin) = &self.reqs[&id].twin[li] else { unreachable!() };
        let pos = self.reqs[&id].pos;
        let (tk, tv) = twin.physical().map_err(|e| mlx("twin", e))?;
        self.counters.checks += 1;
        if &prod.0 != twin.state() || prod.0.offset != pos {
            return crate::sim::check::fail(Failure::new(
                "hybrid_consistency",
                format!("layer {li} {what}: attention state {:?}, twin {:?}, set offset {pos}", prod.0, twin.state()),
            ));
        }
        let (pk, pv) = (words(&prod.1)?, words(&prod.2)?);
        cx.hasher.update(&pk.digest());
        cx.hasher.update(&pv.digest());
        if pk != words(&tk)? || pv != words(&tv)? {
            return crate::sim::check::fail(Failure::new(
                "hybrid_state_vs_twin",
                format!("layer {li} {what}: attention columns differ from the twin"),
            ));
        }
        self.record("hybrid_attention_state_vs_twin", 1);
        Ok(())
    }

    fn check_all(&mut self, cx: &mut Cx<'_>) -> Res {
        let n = self.rows.len();
        for li in 0..self.layers.len() {
            match &self.batch[li] {
                Rows::Ssm(b) => {
                    if b.rows() != n {
                        return crate::sim::check::fail(Failure::new(
                            "rows",
                            format!("layer {li}: {} rows for {n} requests", b.rows()),
                        ));
                    }
                    let (conv, rec) = (words(b.conv())?, words(b.recurrent())?);
                    let offsets = b.offsets().to_vec();
                    let (cw, rw) = (conv.words.len() / n.max(1), rec.words.len() / n.max(1));
                    for r in 0..n {
                        let id = self.rows[r];
                        self.check_ssm_row(
                            cx,
                            li,
                            &format!("row {r}"),
                            (&conv, r * cw),
                            (&rec, r * rw),
                            offsets[r],
                            id,
                        )?;
                    }
                }
                Rows::Attn(b) => {
                    let mut prods = vec![];
                    for r in 0..n {
                        let (k, v) = b.row_physical(r).map_err(|e| mlx("row", e))?;
                        prods.push((b.row_states()[r].ring.clone(), k, v));
                    }
                    for (r, p) in prods.into_iter().enumerate() {
                        self.check_attn(cx, li, &format!("row {r}"), self.rows[r], p)?;
                    }
                }
            }
        }
        let solo: Vec<u32> = self.reqs.iter().filter(|(_, r)| r.home == Home::Solo).map(|(id, _)| *id).collect();
        for id in solo {
            for li in 0..self.layers.len() {
                match self.reqs[&id].solo[li].clone() {
                    Cache::Ssm(c) => {
                        let (conv, rec) = (words(c.conv())?, words(c.recurrent())?);
                        self.check_ssm_row(
                            cx,
                            li,
                            &format!("request {id}"),
                            (&conv, 0),
                            (&rec, 0),
                            c.offsets()[0],
                            id,
                        )?;
                    }
                    Cache::Attn(c) => {
                        let (k, v) = c.physical().map_err(|e| mlx("solo", e))?;
                        self.check_attn(cx, li, &format!("request {id}"), id, (c.state().clone(), k, v))?;
                    }
                }
            }
        }
        Ok(())
    }
}

impl Recurrent {
    /// The running batch (every layer, one file: DeltaNet layers as `ssm`, attention layers as row batches) through
    /// kvsim's format and back, mid-run, when every layer is at rest (a recurrent cache with a pending prefill or an
    /// armed round is not persistable; between ops neither is open). The state checks after the op compare every
    /// restored row with its twin, and every later output is the run's, so an inexact restore changes the hash.
    fn persist_batch(&mut self) -> Res<()> {
        use kvsim_persist::{inspect::Format, AnyCache, Persisted};
        if self.batch.iter().any(|b| matches!(b, Rows::Ssm(c) if c.is_pending() || c.in_round())) {
            return Ok(());
        }
        let persisted: Vec<Persisted> = std::mem::take(&mut self.batch)
            .into_iter()
            .map(|b| {
                let cache = match b {
                    Rows::Ssm(c) => AnyCache::Ssm(c),
                    Rows::Attn(b) => AnyCache::Rows(b),
                };
                Persisted { minimum_reusable_offset: cache.offset() / 2, cache }
            })
            .collect();
        self.batch = super::persist_through_bytes(persisted, Format::Kvsim)?
            .into_iter()
            .map(|c| match c {
                AnyCache::Ssm(c) => Ok(Rows::Ssm(c)),
                AnyCache::Rows(b) => Ok(Rows::Attn(b)),
                other => Err(Failure::new("persist", format!("batch restored as {}", other.storage_kind()))),
            })
            .collect::<Res<_>>()?;
        self.counters.persist_batches += 1;
        Ok(())
    }
}

/// Saves a request's caches (every layer, one file) and restores them from the bytes alone: kvsim's format with a
/// reuse floor of half each offset (the floors must come back), or with `via_mlxlm` an mlx-lm prompt-cache file
/// (DeltaNet layers as `ArraysCache`, offsets in its user metadata) when every layer's mlx-lm form keeps its state.
/// The layers keep their kinds. The state checks after the op and every later read compare the restored caches
/// with the twins and the model.
fn persist_roundtrip(caches: Vec<Cache>, via_mlxlm: bool) -> Res<Vec<Cache>> {
    use kvsim_persist::inspect::Format;
    use kvsim_persist::{AnyCache, Persisted};
    let persisted: Vec<Persisted> = caches
        .into_iter()
        .map(|c| {
            let cache = match c {
                Cache::Ssm(c) => AnyCache::Ssm(c),
                Cache::Attn(c) => AnyCache::Serial(c),
            };
            Persisted { minimum_reusable_offset: cache.offset() / 2, cache }
        })
        .collect();
    let mlx = via_mlxlm && persisted.iter().all(|p| super::attention::mlxlm_keeps_state(&p.cache));
    let (format, persisted) = if mlx {
        let zero = persisted.into_iter().map(|p| Persisted::new(p.cache)).collect::<Vec<_>>();
        (Format::MlxLm, zero)
    } else {
        (Format::Kvsim, persisted)
    };
    super::persist_through_bytes(persisted, format)?
        .into_iter()
        .map(|c| match c {
            AnyCache::Ssm(c) => Ok(Cache::Ssm(c)),
            AnyCache::Serial(c) => Ok(Cache::Attn(c)),
            other => Err(Failure::new("persist", format!("a request's layer restored as {}", other.storage_kind()))),
        })
        .collect()
}

impl Family for Recurrent {
    fn key(&self) -> &'static str {
        self.set.name
    }

    fn apply(&mut self, op: &Op, cx: &mut Cx<'_>) -> Res<bool> {
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
        match op {
            Op::Admit { req } => {
                let admitted = self.admit(*req)?;
                if admitted && cx.observer.wants_calls() {
                    emit(cx, Call::Admit { req: *req })?;
                }
                Ok(admitted)
            }
            Op::SoloWindow { req, len } => {
                if !self.solo_req(*req) || *len == 0 {
                    return Ok(false);
                }
                self.solo_forward(cx, *req, *len as usize, false)?;
                Ok(true)
            }
            Op::SoloDecode { req } => {
                if !self.solo_req(*req) {
                    return Ok(false);
                }
                self.solo_forward(cx, *req, 1, true)?;
                Ok(true)
            }
            Op::Merge { reqs } => self.merge_or_join(cx, reqs, &[]),
            Op::Join { reqs, order } => self.merge_or_join(cx, reqs, order),
            Op::BatchPrefill { reqs, lengths, chunk } => self.batch_prefill(cx, reqs, lengths, *chunk as usize),
            Op::Decode => self.decode(cx),
            Op::Window { len } | Op::Append { len } => self.window(cx, *len as usize),
            Op::Verify { gamma, accept } => self.verify(cx, *gamma as usize, accept),
            Op::CommitSpan { len } => self.commit_span(cx, *len as usize),
            Op::Extract { row, finish } => self.extract(cx, *row as usize, *finish),
            Op::Filter { keep } => self.filter(cx, keep),
            Op::TrainingForward { lengths, len, .. } => self.training_forward(cx, lengths, *len as usize),
            Op::TrainingRefusal { .. } => self.training_refusal(),
            Op::Persist { req, mlxlm } => {
                if !self.solo_req(*req) {
                    return Ok(false);
                }
                let r = self.reqs.get_mut(req).unwrap();
                let caches = std::mem::take(&mut r.solo);
                r.solo = persist_roundtrip(caches, *mlxlm)?;
                self.counters.persist_roundtrips += 1;
                if !self.rows.is_empty() {
                    self.persist_batch()?;
                }
                Ok(true)
            }
            // Not supported (never dispatched here): trims, the attention-only special reads, prefix-shared forwards.
            Op::Trim { .. }
            | Op::SoloTrim { .. }
            | Op::ReadBlock { .. }
            | Op::BidirPrefill { .. }
            | Op::CompiledStep { .. }
            | Op::PrefixSharedForward { .. }
            | Op::Adopt { .. }
            | Op::DecodePhase
            | Op::Prepare { .. }
            | Op::IllFormed { .. }
            | Op::Quantize { .. }
            | Op::PrefixReuse { .. }
            | Op::PlainRead => Ok(false),
        }
    }

    fn check_state(&mut self, cx: &mut Cx<'_>) -> Res<()> {
        self.check_all(cx)
    }

    /// Every live request's two states per DeltaNet layer (`[1, K-1, conv_dim]`, `[1, Hv, Dv, Dk]`) and positions.
    fn observe_state(&mut self, cx: &mut Cx<'_>) -> Res<()> {
        if !cx.observer.wants_calls() {
            return Ok(());
        }
        let mut views = BTreeMap::new();
        for (r, id) in self.rows.iter().enumerate() {
            let mut layers = vec![];
            for b in &self.batch {
                if let Rows::Ssm(b) = b {
                    layers.push(b.row_states(r).map_err(|e| mlx("row states", e))?);
                }
            }
            views.insert(*id, StateView { offset: self.reqs[id].pos, layers, planes: None });
        }
        for (id, req) in self.reqs.iter().filter(|(_, r)| r.home == Home::Solo) {
            let mut layers = vec![];
            for c in &req.solo {
                if let Cache::Ssm(c) = c {
                    layers.push(c.row_states(0).map_err(|e| mlx("row states", e))?);
                }
            }
            views.insert(*id, StateView { offset: req.pos, layers, planes: None });
        }
        cx.observer.on_state(views).map_err(|e| Failure::new("mlx", format!("observe: {e}")))
    }

    fn view(&self) -> View {
        View {
            solo: self.reqs.iter().filter(|(_, r)| r.home == Home::Solo).map(|(id, r)| (*id, r.pos, None)).collect(),
            rows: self.rows.clone(),
            next_id: self.next_id,
            live: self.reqs.len(),
        }
    }

    fn counters(&self) -> &Counters {
        &self.counters
    }

    fn counters_mut(&mut self) -> &mut Counters {
        &mut self.counters
    }
}
