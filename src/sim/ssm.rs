//! The recurrent layout families in the simulator: `ssm` (one gated-DeltaNet layer) and hybrid cache sets (a
//! model's layers as a mix of DeltaNet and attention layers, driven together).
//!
//! Per row, after every op: offsets equal across the batch, the solo twin and the model (and across every layer of a
//! hybrid set); both SSM states byte-identical to the solo twin (CPU), the conv tail byte-identical to the model
//! (exact: it is a copy of inputs), the recurrent state and outputs measured against the f64 model in ULPs at output
//! scale; attention layers' live columns byte-identical to their serial twins. Verify rounds trim attention layers
//! (bypass) and replay DeltaNet layers; every replayed state is also compared with a fresh run of the accepted prefix
//! from the pre-round state.

use arbitrary::Arbitrary;
use mlx_rs::{Array, Dtype};
use rand::Rng;

use crate::bytes::ArrayBytes;
use crate::cache::{
    CacheError, GdnParams, JoinSource, KvDtype, KvSpec, Masks, RowBatch, SerialCache, SsmCache, SsmSpec,
};
use crate::reference::{RefDtype, SsmDims, SsmRowModel, SsmToken, SsmValues, SsmWeights};
use crate::sim::check::{ulp_at, Failure};
use crate::sim::rng::{stream, Stream};

type Res<T = ()> = Result<T, Failure>;

fn mlx(what: &str, e: CacheError) -> Failure {
    Failure::new("errors", format!("{what}: production refused a legal op: {e}"))
}

/// One layer of a set: a DeltaNet layer, or an attention layer with an optional sliding window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum LayerKind {
    DeltaNet,
    Attention { window: Option<usize> },
}

/// A family's configuration: the layer mix and shapes.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct SsmFamilyConfig {
    /// `"ssm"` or a hybrid set's name.
    pub name: String,
    pub layers: Vec<LayerKind>,
    pub dims: SsmDims,
    pub attn: KvSpec,
    pub payload_seed: u64,
    pub ops: usize,
    pub max_rows: usize,
}

impl SsmFamilyConfig {
    /// The configuration of `family` (`ssm`, `hybrid-qwen35` = (DeltaNet x3, full attention), or `hybrid-sliding` =
    /// DeltaNet, sliding, DeltaNet, full) for `seed`.
    pub fn from_seed(family: &str, seed: u64) -> Option<Self> {
        let mut rng = stream(seed, Stream::Config);
        let dtype = if rng.random_bool(0.5) { RefDtype::Bf16 } else { RefDtype::F32 };
        let heads_k = rng.random_range(1..=2);
        let dims = SsmDims {
            kernel: [2, 3, 4, 4][rng.random_range(0..4)],
            heads_k,
            heads_v: heads_k * rng.random_range(1..=2),
            dk: [4, 8, 16][rng.random_range(0..3)],
            dv: [2, 4, 8][rng.random_range(0..3)],
            dtype,
        };
        let kv_dtype = if dtype == RefDtype::Bf16 { KvDtype::Bf16 } else { KvDtype::F32 };
        let attn = KvSpec { heads_kv: 2, head_dim: 8, dtype: kv_dtype };
        let window = rng.random_range(3..=8);
        let layers = match family {
            "ssm" => vec![LayerKind::DeltaNet],
            "hybrid-qwen35" => vec![
                LayerKind::DeltaNet,
                LayerKind::DeltaNet,
                LayerKind::DeltaNet,
                LayerKind::Attention { window: None },
            ],
            "hybrid-sliding" => vec![
                LayerKind::DeltaNet,
                LayerKind::Attention { window: Some(window) },
                LayerKind::DeltaNet,
                LayerKind::Attention { window: None },
            ],
            _ => return None,
        };
        Some(SsmFamilyConfig {
            name: family.to_string(),
            layers,
            dims,
            attn,
            payload_seed: stream(seed, Stream::Payload).random(),
            ops: rng.random_range(12..=28),
            max_rows: rng.random_range(2..=5),
        })
    }

    fn spec(&self) -> SsmSpec {
        let d = &self.dims;
        let dtype = if d.dtype == RefDtype::Bf16 { KvDtype::Bf16 } else { KvDtype::F32 };
        SsmSpec { kernel: d.kernel, heads_k: d.heads_k, heads_v: d.heads_v, dk: d.dk, dv: d.dv, dtype }
    }
}

/// The ops of these families (any subsequence is a valid op list: ops that name missing rows are skipped).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, Arbitrary)]
pub enum SsmOp {
    /// A request prefilled alone (in chunks of `chunk`), then merged (SSM) / joined (attention) into the batch.
    Admit { prompt: u8, chunk: u8 },
    /// A cohort of fresh rows merged empty, then one prepared padded prefill over the whole batch (running rows are
    /// all padding), in chunks, then finalize. `drop_longest`: on an empty batch, filter out the cohort's longest row
    /// right after `prepare` (a filter of an empty batch with left padding still pending).
    AdmitPadded { prompts: Vec<u8>, left: bool, chunk: u8, drop_longest: bool },
    /// One position per row.
    Decode,
    /// A speculative verify round of `len` draft positions; row `r` accepts `keeps[r % len(keeps)] % (len + 1)`.
    Verify { len: u8, keeps: Vec<u8> },
    /// Keep the rows whose flag is set.
    Filter { keep: Vec<bool> },
    /// Extract a row, compare it with its twin, decode it alone one step.
    Extract { row: u8 },
}

impl SsmOp {
    pub fn name(&self) -> &'static str {
        match self {
            SsmOp::Admit { .. } => "admit",
            SsmOp::AdmitPadded { .. } => "admit_padded",
            SsmOp::Decode => "decode",
            SsmOp::Verify { .. } => "verify",
            SsmOp::Filter { .. } => "filter",
            SsmOp::Extract { .. } => "extract",
        }
    }
}

/// Counters of these families (reported per family in the summary).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SsmCounters {
    pub ops: u64,
    pub checks: u64,
    pub rounds: u64,
    pub commits: u64,
    pub rollbacks: u64,
    /// Rollbacks whose rows accepted different counts.
    pub rollbacks_unequal: u64,
    /// Rollbacks that replayed at least one position of some row (production's own count).
    pub replays: u64,
    pub replayed_steps: u64,
    /// Replayed rows compared byte for byte with a fresh run of the accepted prefix.
    pub replay_vs_fresh: u64,
    /// State comparisons (batch vs twin) and how many were byte-identical.
    pub state_compared: u64,
    pub state_exact: u64,
    /// Output comparisons (batch vs twin at real positions) and how many were byte-identical.
    pub outputs_compared: u64,
    pub outputs_exact: u64,
    /// Largest distance of outputs / recurrent states to the f64 model (ULPs of the input dtype at output scale).
    pub model_max_ulp_output: f64,
    pub model_max_ulp_state: f64,
    pub padded_prefills: u64,
    pub left_padded_prefills: u64,
    pub expected_errors: u64,
}

/// Bounds of the model distance (ULPs of the input dtype at output scale) beyond which a run fails: set from
/// measurement (README "Guarantees"), far below what a folded padding step or a wrong conv tail does.
pub fn ssm_model_bound(dtype: RefDtype) -> f64 {
    match dtype {
        RefDtype::Bf16 => 64.0,
        RefDtype::F32 => 256.0,
    }
}

struct SsmLayer {
    index: u32,
    params: GdnParams,
    weights: SsmWeights,
    batch: SsmCache,
    twins: Vec<SsmCache>,
    models: Vec<SsmRowModel>,
}

struct AttnLayer {
    index: u32,
    window: Option<usize>,
    batch: RowBatch,
    twins: Vec<SerialCache>,
}

enum Layer {
    Ssm(SsmLayer),
    Attn(AttnLayer),
}

/// One run of a recurrent family: production batch, solo twins, models.
pub struct SsmWorld {
    pub cfg: SsmFamilyConfig,
    spec: SsmSpec,
    values: SsmValues,
    layers: Vec<Layer>,
    /// Request id and positions consumed, per row.
    reqs: Vec<u64>,
    pos: Vec<usize>,
    next_req: u64,
    round_no: u64,
    pub counters: SsmCounters,
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

impl SsmWorld {
    pub fn new(cfg: SsmFamilyConfig) -> Res<Self> {
        let spec = cfg.spec();
        let values = SsmValues { seed: cfg.payload_seed, dims: cfg.dims };
        let mut layers = vec![];
        for (i, k) in cfg.layers.iter().enumerate() {
            let index = i as u32;
            layers.push(match *k {
                LayerKind::DeltaNet => {
                    let (w, a, t) = values.weight_bits(index);
                    let c = cfg.dims.conv_dim();
                    let params = GdnParams {
                        conv_weight: arr(&w, &[c, cfg.dims.kernel, 1], cfg.dims.dtype),
                        a_log: arr(&a, &[cfg.dims.heads_v], RefDtype::F32),
                        dt_bias: arr(&t, &[cfg.dims.heads_v], cfg.dims.dtype),
                    };
                    Layer::Ssm(SsmLayer {
                        index,
                        params,
                        weights: values.weights(index),
                        batch: SsmCache::new(spec, 0).map_err(|e| mlx("new", e))?,
                        twins: vec![],
                        models: vec![],
                    })
                }
                LayerKind::Attention { window } => Layer::Attn(AttnLayer {
                    index,
                    window,
                    batch: RowBatch::with_rows(cfg.attn, window, 0).map_err(|e| mlx("new", e))?,
                    twins: vec![],
                }),
            });
        }
        Ok(SsmWorld {
            cfg,
            spec,
            values,
            layers,
            reqs: vec![],
            pos: vec![],
            next_req: 0,
            round_no: 0,
            counters: SsmCounters::default(),
        })
    }

    pub fn rows(&self) -> usize {
        self.reqs.len()
    }

    fn hybrid(&self) -> bool {
        self.layers.iter().any(|l| matches!(l, Layer::Attn(_)))
    }

    /// SSM inputs `[n, s, ...]` for rows (request, first position, real range) of one layer; padded slots poison.
    fn ssm_inputs(
        &self,
        layer: u32,
        rows: &[(u64, usize, usize, usize)],
        s: usize,
        draft: Option<&[usize]>,
    ) -> [Array; 3] {
        let d = &self.cfg.dims;
        let (mut q, mut a, mut b) = (vec![], vec![], vec![]);
        for (r, &(req, p0, st, en)) in rows.iter().enumerate() {
            for t in 0..s {
                let (x, y, z) = if t < st || t >= en {
                    self.values.pad_bits(layer, r as u64, t as u64)
                } else if draft.is_some_and(|k| t - st >= k[r]) {
                    // A rejected draft: never the request's real token at that position.
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
    fn attn_inputs(
        &self,
        layer: u32,
        rows: &[(u64, usize, usize, usize)],
        s: usize,
        draft: Option<&[usize]>,
    ) -> [Array; 3] {
        let sp = &self.cfg.attn;
        let d = self.cfg.dims.dtype;
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
                        let base = SsmValues { seed: self.values.seed ^ key[0], dims: self.cfg.dims };
                        let bits = base.pad_bits(key[1] as u32, key[2], key[3] * 64 + h as u64);
                        v.extend(bits.0.into_iter().take(sp.head_dim).map(|b| {
                            // scale poison-range draws into [-1, 1) for real tokens
                            let x = crate::reference::bits_to_f32(d, b) / 8.0;
                            crate::reference::round_to(d, x as f64)
                        }));
                    }
                }
            }
            out.push(arr(&v, &[rows.len(), heads, s, sp.head_dim], d));
        }
        [out[0].clone(), out[1].clone(), out[2].clone()]
    }

    fn model_token(&self, layer: u32, req: u64, pos: usize) -> SsmToken {
        self.values.token(layer, req, pos as u64)
    }

    /// Runs a window on every layer for rows with real ranges; the twins run the real parts; the models step.
    /// `draft`: per-row accepted counts of a verify round (the model steps only those).
    fn window_all(&mut self, s: usize, real: &[(usize, usize)], draft: Option<&[usize]>) -> Res {
        let rows: Vec<(u64, usize, usize, usize)> =
            (0..self.rows()).map(|r| (self.reqs[r], self.pos[r], real[r].0, real[r].1)).collect();
        let scale = 0.35f32;
        let masks = Masks::new();
        let n_layers = self.layers.len();
        for li in 0..n_layers {
            let idx = match &self.layers[li] {
                Layer::Ssm(l) => l.index,
                Layer::Attn(l) => l.index,
            };
            if let Layer::Ssm(_) = &self.layers[li] {
                let [q, a, b] = self.ssm_inputs(idx, &rows, s, draft);
                let tokens: Vec<Vec<SsmToken>> = (0..rows.len())
                    .map(|r| {
                        let n = draft.map_or(real[r].1 - real[r].0, |k| k[r]);
                        (0..n).map(|t| self.model_token(idx, rows[r].0, rows[r].1 + t)).collect()
                    })
                    .collect();
                let Layer::Ssm(l) = &mut self.layers[li] else { unreachable!() };
                let y = if s == 1 && draft.is_none() && l.batch.padding().is_none() {
                    l.batch.decode(&q, &a, &b, &l.params)
                } else {
                    l.batch.window(&q, &a, &b, &l.params)
                }
                .map_err(|e| mlx("ssm window", e))?;
                let yb = words(&y)?;
                let (hv, dv) = (self.cfg.dims.heads_v, self.cfg.dims.dv);
                for (r, &(st, en)) in real.iter().enumerate() {
                    if en == st {
                        continue;
                    }
                    let pick = |x: &Array| -> Array {
                        use mlx_rs::ops::indexing::TryIndexOp;
                        x.try_index((r as i32..r as i32 + 1, st as i32..en as i32, ..)).unwrap()
                    };
                    let twin = &mut l.twins[r];
                    let ty = if draft.is_some() {
                        twin.spec_round_begin().map_err(|e| mlx("twin begin", e))?;
                        twin.window(&pick(&q), &pick(&a), &pick(&b), &l.params)
                    } else {
                        twin.window(&pick(&q), &pick(&a), &pick(&b), &l.params)
                    }
                    .map_err(|e| mlx("twin window", e))?;
                    let tb = words(&ty)?;
                    // Outputs at real positions: batch vs twin (bytes), and vs the model (accepted positions only).
                    let per = hv * dv;
                    let base = (r * s + st) * per;
                    let same = (0..(en - st) * per).all(|i| yb.words.get(base + i) == tb.words.get(i));
                    self.counters.outputs_compared += 1;
                    self.counters.outputs_exact += u64::from(same);
                    self.counters.checks += 1;
                    if !same {
                        return Err(Failure::new(
                            "ssm_output_vs_twin",
                            format!("layer {idx} row {r}: outputs at real positions differ from the solo run"),
                        ));
                    }
                    let unit = self.spec.dtype.to_mlx();
                    for (t, tok) in tokens[r].iter().enumerate() {
                        let e = l.models[r].step(&l.weights, tok);
                        let w = worst_ulp(&yb, base + t * per, &e, unit);
                        self.counters.model_max_ulp_output = self.counters.model_max_ulp_output.max(w);
                        if w > ssm_model_bound(self.cfg.dims.dtype) {
                            return Err(Failure::new(
                                "ssm_output_vs_model",
                                format!("layer {idx} row {r} position {t}: {w:.1} ULPs from the f64 model"),
                            ));
                        }
                    }
                }
            } else {
                let [k, v, q] = self.attn_inputs(idx, &rows, s, draft);
                let Layer::Attn(l) = &mut self.layers[li] else { unreachable!() };
                let used_decode = s == 1 && draft.is_none() && !l.batch.is_pending();
                let (out, _) = if used_decode {
                    l.batch.decode(&k, &v, &q, scale, &masks)
                } else {
                    l.batch.window(&k, &v, &q, scale, &masks)
                }
                .map_err(|e| mlx("attention read", e))?;
                for (r, &(st, en)) in real.iter().enumerate() {
                    if en == st {
                        continue;
                    }
                    let pick = |x: &Array| -> Array {
                        use mlx_rs::ops::indexing::TryIndexOp;
                        x.try_index((r as i32..r as i32 + 1, .., st as i32..en as i32, ..)).unwrap()
                    };
                    let twin = &mut l.twins[r];
                    let (to, _) = if used_decode {
                        twin.decode(&pick(&k), &pick(&v), &pick(&q), scale, &masks)
                    } else {
                        twin.window(&pick(&k), &pick(&v), &pick(&q), scale, &masks)
                    }
                    .map_err(|e| mlx("twin attention read", e))?;
                    let tb = words(&to)?;
                    let sel = words(&pick(&out))?;
                    let same = sel == tb;
                    self.counters.outputs_compared += 1;
                    self.counters.outputs_exact += u64::from(same);
                }
            }
        }
        Ok(())
    }

    /// Compares every row of every layer with its twin and model.
    pub fn check(&mut self) -> Res {
        let unit = self.spec.dtype.to_mlx();
        for li in 0..self.layers.len() {
            match &self.layers[li] {
                Layer::Ssm(l) => {
                    if l.batch.rows() != self.rows() || l.twins.len() != self.rows() {
                        return Err(Failure::new("rows", format!("layer {}: {} rows", l.index, l.batch.rows())));
                    }
                    let conv = words(l.batch.conv())?;
                    let rec = words(l.batch.recurrent())?;
                    let (cw, rw) = (conv.words.len() / self.rows().max(1), rec.words.len() / self.rows().max(1));
                    for r in 0..self.rows() {
                        let (o_b, o_t, o_m) = (l.batch.offsets()[r], l.twins[r].offsets()[0], l.models[r].offset);
                        self.counters.checks += 1;
                        if o_b != o_t || o_b != o_m || o_b != self.pos[r] {
                            return Err(Failure::new(
                                "ssm_offsets",
                                format!(
                                    "layer {} row {r}: batch {o_b}, twin {o_t}, model {o_m}, fed {}",
                                    l.index, self.pos[r]
                                ),
                            ));
                        }
                        let tc = words(l.twins[r].conv())?;
                        let tr = words(l.twins[r].recurrent())?;
                        let conv_same = (0..cw).all(|i| conv.words.get(r * cw + i) == tc.words.get(i));
                        let rec_same = (0..rw).all(|i| rec.words.get(r * rw + i) == tr.words.get(i));
                        self.counters.state_compared += 2;
                        self.counters.state_exact += u64::from(conv_same) + u64::from(rec_same);
                        self.counters.checks += 2;
                        if !conv_same || !rec_same {
                            let which = if conv_same { "recurrent" } else { "conv" };
                            return Err(Failure::new(
                                "ssm_state_vs_twin",
                                format!("layer {} row {r}: {which} state differs from the solo run", l.index),
                            ));
                        }
                        let want = l.models[r].conv_bits();
                        let model_same = (0..cw).all(|i| conv.words.get(r * cw + i) as u32 == want[i]);
                        self.counters.checks += 1;
                        if !model_same {
                            return Err(Failure::new(
                                "ssm_conv_vs_model",
                                format!("layer {} row {r}: conv tail is not the last K-1 real inputs", l.index),
                            ));
                        }
                        let w = worst_ulp(&rec, r * rw, &l.models[r].state, unit);
                        self.counters.model_max_ulp_state = self.counters.model_max_ulp_state.max(w);
                        self.counters.checks += 1;
                        if w > ssm_model_bound(self.cfg.dims.dtype) {
                            return Err(Failure::new(
                                "ssm_state_vs_model",
                                format!("layer {} row {r}: recurrent state {w:.1} ULPs from the f64 model", l.index),
                            ));
                        }
                    }
                }
                Layer::Attn(l) => {
                    for r in 0..self.rows() {
                        let st = &l.batch.row_states()[r].ring;
                        self.counters.checks += 1;
                        if st != l.twins[r].state() || st.offset != self.pos[r] {
                            return Err(Failure::new(
                                "hybrid_consistency",
                                format!(
                                    "layer {} row {r}: attention state {st:?}, twin {:?}, set offset {}",
                                    l.index,
                                    l.twins[r].state(),
                                    self.pos[r]
                                ),
                            ));
                        }
                        let (bk, bv) = l.batch.row_physical(r).map_err(|e| mlx("row", e))?;
                        let (tk, tv) = l.twins[r].physical().map_err(|e| mlx("twin", e))?;
                        let same = words(&bk)? == words(&tk)? && words(&bv)? == words(&tv)?;
                        self.counters.state_compared += 1;
                        self.counters.state_exact += u64::from(same);
                        if !same {
                            return Err(Failure::new(
                                "hybrid_state_vs_twin",
                                format!("layer {} row {r}: attention columns differ from the twin", l.index),
                            ));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    /// Applies one op; `Ok(false)` when it was skipped (it names rows that do not exist, or is out of range).
    pub fn apply(&mut self, op: &SsmOp) -> Res<bool> {
        let done = match op {
            SsmOp::Admit { prompt, chunk } => self.admit(*prompt as usize % 9 + 1, (*chunk as usize % 4) + 1)?,
            SsmOp::AdmitPadded { prompts, left, chunk, drop_longest } => {
                self.admit_padded(prompts, *left && !self.hybrid(), (*chunk as usize % 5) + 1, *drop_longest)?
            }
            SsmOp::Decode => {
                if self.rows() == 0 {
                    false
                } else {
                    let real = vec![(0, 1); self.rows()];
                    self.window_all(1, &real, None)?;
                    self.pos.iter_mut().for_each(|p| *p += 1);
                    true
                }
            }
            SsmOp::Verify { len, keeps } => self.verify((*len as usize % 5) + 1, keeps)?,
            SsmOp::Filter { keep } => self.filter(keep)?,
            SsmOp::Extract { row } => self.extract(*row as usize)?,
        };
        if done {
            self.counters.ops += 1;
            self.check()?;
        }
        Ok(done)
    }

    fn admit(&mut self, prompt: usize, chunk: usize) -> Res<bool> {
        if self.rows() >= self.cfg.max_rows {
            return Ok(false);
        }
        let req = self.next_req;
        self.next_req += 1;
        let spec = self.spec;
        let masks = Masks::new();
        let row_of = |p0: usize, n: usize| vec![(req, p0, 0usize, n)];
        let mut pos = 0;
        // The prefill cache (production) runs in chunks; the twin runs the whole prompt at once.
        let mut pre_ssm: Vec<SsmCache> = vec![];
        let mut pre_attn: Vec<SerialCache> = vec![];
        for l in &self.layers {
            match l {
                Layer::Ssm(_) => pre_ssm.push(SsmCache::new(spec, 1).map_err(|e| mlx("new", e))?),
                Layer::Attn(a) => pre_attn.push(SerialCache::new(self.cfg.attn, a.window).map_err(|e| mlx("new", e))?),
            }
        }
        while pos < prompt {
            let n = chunk.min(prompt - pos);
            let (mut si, mut ai) = (0, 0);
            for li in 0..self.layers.len() {
                match &self.layers[li] {
                    Layer::Ssm(l) => {
                        let [q, a, b] = self.ssm_inputs(l.index, &row_of(pos, n), n, None);
                        pre_ssm[si].window(&q, &a, &b, &l.params).map_err(|e| mlx("prefill", e))?;
                        si += 1;
                    }
                    Layer::Attn(l) => {
                        let [k, v, q] = self.attn_inputs(l.index, &row_of(pos, n), n, None);
                        pre_attn[ai].window(&k, &v, &q, 0.35, &masks).map_err(|e| mlx("prefill", e))?;
                        ai += 1;
                    }
                }
            }
            pos += n;
        }
        let (mut si, mut ai) = (0, 0);
        for li in 0..self.layers.len() {
            let idx = match &self.layers[li] {
                Layer::Ssm(l) => l.index,
                Layer::Attn(l) => l.index,
            };
            match &self.layers[li] {
                Layer::Ssm(l) => {
                    let [q, a, b] = self.ssm_inputs(idx, &row_of(0, prompt), prompt, None);
                    let mut twin = SsmCache::new(spec, 1).map_err(|e| mlx("new", e))?;
                    twin.window(&q, &a, &b, &l.params).map_err(|e| mlx("twin prefill", e))?;
                    let mut model = SsmRowModel::new(self.cfg.dims);
                    for p in 0..prompt {
                        model.step(&l.weights, &self.model_token(idx, req, p));
                    }
                    let merged = SsmCache::merge(spec, &[&l.batch, &pre_ssm[si]]).map_err(|e| mlx("merge", e))?;
                    si += 1;
                    let Layer::Ssm(l) = &mut self.layers[li] else { unreachable!() };
                    l.batch = merged;
                    l.twins.push(twin);
                    l.models.push(model);
                }
                Layer::Attn(l) => {
                    let [k, v, q] = self.attn_inputs(idx, &row_of(0, prompt), prompt, None);
                    let mut twin = SerialCache::new(self.cfg.attn, l.window).map_err(|e| mlx("new", e))?;
                    twin.window(&k, &v, &q, 0.35, &masks).map_err(|e| mlx("twin prefill", e))?;
                    let all: Vec<usize> = (0..l.batch.rows()).collect();
                    let joined = RowBatch::join(
                        self.cfg.attn,
                        l.window,
                        &[JoinSource::Rows(&l.batch, all), JoinSource::Serial(&pre_attn[ai])],
                    )
                    .map_err(|e| mlx("join", e))?;
                    ai += 1;
                    let Layer::Attn(l) = &mut self.layers[li] else { unreachable!() };
                    l.batch = joined;
                    // The twin ran one window; the production row ran chunks. Their states differ when the ring
                    // wrapped between chunks, so the twin follows the production's chunking instead.
                    l.twins.push(pre_attn[ai - 1].clone());
                    let _ = twin;
                }
            }
        }
        self.reqs.push(req);
        self.pos.push(prompt);
        Ok(true)
    }

    fn admit_padded(&mut self, prompts: &[u8], left: bool, chunk: usize, drop_longest: bool) -> Res<bool> {
        let room = self.cfg.max_rows.saturating_sub(self.rows());
        let prompts: Vec<usize> = prompts.iter().take(room).map(|&p| p as usize % 9 + 1).collect();
        if prompts.is_empty() {
            return Ok(false);
        }
        let spec = self.spec;
        let old = self.rows();
        // Merge the fresh cohort (zero states) in.
        for li in 0..self.layers.len() {
            match &mut self.layers[li] {
                Layer::Ssm(l) => {
                    let fresh = SsmCache::new(spec, prompts.len()).map_err(|e| mlx("new", e))?;
                    l.batch = SsmCache::merge(spec, &[&l.batch, &fresh]).map_err(|e| mlx("merge", e))?;
                    for _ in &prompts {
                        l.twins.push(SsmCache::new(spec, 1).map_err(|e| mlx("new", e))?);
                        l.models.push(SsmRowModel::new(self.cfg.dims));
                    }
                }
                Layer::Attn(l) => {
                    let mut sources: Vec<SerialCache> = vec![];
                    for _ in &prompts {
                        sources.push(SerialCache::new(self.cfg.attn, l.window).map_err(|e| mlx("new", e))?);
                    }
                    let all: Vec<usize> = (0..l.batch.rows()).collect();
                    let mut js = vec![JoinSource::Rows(&l.batch, all)];
                    js.extend(sources.iter().map(JoinSource::Serial));
                    let joined = RowBatch::join(self.cfg.attn, l.window, &js).map_err(|e| mlx("join", e))?;
                    l.batch = joined;
                    l.twins.extend(sources);
                }
            }
        }
        for _ in &prompts {
            self.reqs.push(self.next_req);
            self.next_req += 1;
            self.pos.push(0);
        }
        // Padding: running rows are all padding; the cohort's rows have `prompt` real positions.
        let width = *prompts.iter().max().unwrap_or(&1);
        let mut lengths = vec![0usize; old];
        let mut lefts = vec![0usize; old];
        for &p in &prompts {
            lengths.push(if left { width } else { p });
            lefts.push(if left { width - p } else { 0 });
        }
        for l in &mut self.layers {
            match l {
                Layer::Ssm(l) => l.batch.prepare(&lengths, if left { &lefts } else { &[] }),
                Layer::Attn(l) => l.batch.prepare(&lengths),
            }
            .map_err(|e| mlx("prepare", e))?;
        }
        self.counters.padded_prefills += 1;
        self.counters.left_padded_prefills += u64::from(left);
        let mut model_pad: Vec<(i64, i64)> = lefts.iter().zip(&lengths).map(|(&a, &b)| (a as i64, b as i64)).collect();
        if drop_longest && old == 0 && self.rows() > 1 {
            let longest = (0..prompts.len()).max_by_key(|&i| (prompts[i], usize::MAX - i)).unwrap_or(0);
            let keep: Vec<usize> = (0..self.rows()).filter(|&r| r != longest).collect();
            self.filter_rows(&keep)?;
            model_pad.remove(longest);
        }
        let mut done = 0;
        while done < width {
            let s = chunk.min(width - done);
            let real: Vec<(usize, usize)> = model_pad
                .iter()
                .map(|&(l, n)| {
                    let st = l.clamp(0, s as i64);
                    (st as usize, n.clamp(0, s as i64).max(st) as usize)
                })
                .collect();
            self.window_all(s, &real, None)?;
            for (r, &(st, en)) in real.iter().enumerate() {
                self.pos[r] += en - st;
            }
            model_pad.iter_mut().for_each(|(l, n)| {
                *l -= s as i64;
                *n -= s as i64;
            });
            done += s;
        }
        for l in &mut self.layers {
            match l {
                Layer::Ssm(l) => l.batch.finalize(),
                Layer::Attn(l) => l.batch.finalize(),
            }
            .map_err(|e| mlx("finalize", e))?;
        }
        Ok(true)
    }

    fn verify(&mut self, len: usize, keeps: &[u8]) -> Res<bool> {
        if self.rows() == 0 {
            return Ok(false);
        }
        let keep: Vec<usize> = (0..self.rows())
            .map(|r| keeps.get(r % keeps.len().max(1)).map_or(len, |&k| k as usize % (len + 1)))
            .collect();
        self.round_no += 1;
        self.counters.rounds += 1;
        // Pre-round snapshots of the twins: the fresh-prefix runs start from them.
        let snapshots: Vec<Vec<SsmCache>> = self
            .layers
            .iter()
            .filter_map(|l| if let Layer::Ssm(l) = l { Some(l.twins.clone()) } else { None })
            .collect();
        for l in &mut self.layers {
            if let Layer::Ssm(l) = l {
                l.batch.spec_round_begin().map_err(|e| mlx("begin", e))?;
                // A second begin is a typed error that changes nothing.
                if l.batch.spec_round_begin() != Err(CacheError::SpecRoundActive) {
                    return Err(Failure::new("ssm_round_errors", "a second begin was not refused"));
                }
                self.counters.expected_errors += 1;
            }
        }
        let real = vec![(0, len); self.rows()];
        self.window_all(len, &real, Some(&keep))?;
        let all = keep.iter().all(|&k| k == len);
        let unequal = keep.iter().any(|&k| k != keep[0]);
        let mut si = 0;
        for li in 0..self.layers.len() {
            // Inputs of the fresh-prefix runs (built before the layer is borrowed mutably).
            let fresh_inputs: Vec<Option<[Array; 3]>> = match &self.layers[li] {
                Layer::Ssm(l) => keep
                    .iter()
                    .enumerate()
                    .map(|(r, &k)| {
                        (k > 0).then(|| self.ssm_inputs(l.index, &[(self.reqs[r], self.pos[r], 0, k)], k, None))
                    })
                    .collect(),
                Layer::Attn(_) => vec![],
            };
            match &mut self.layers[li] {
                Layer::Ssm(l) => {
                    let before = l.batch.stats();
                    if all {
                        l.batch.spec_round_commit().map_err(|e| mlx("commit", e))?;
                        for t in &mut l.twins {
                            t.spec_round_commit().map_err(|e| mlx("twin commit", e))?;
                        }
                    } else {
                        let too_far = vec![len + 1; keep.len()];
                        if l.batch.spec_round_rollback_rows(&too_far)
                            != Err(CacheError::KeepOutsideWindow { keep: len + 1, window: len })
                        {
                            return Err(Failure::new("ssm_round_errors", "keep beyond the window was not refused"));
                        }
                        self.counters.expected_errors += 1;
                        l.batch.spec_round_rollback_rows(&keep).map_err(|e| mlx("rollback", e))?;
                        for (t, &k) in l.twins.iter_mut().zip(&keep) {
                            t.spec_round_rollback(k).map_err(|e| mlx("twin rollback", e))?;
                        }
                        // Replay vs a fresh run of the accepted prefix from the pre-round state.
                        let (hr, cr) = (words(l.batch.recurrent())?, words(l.batch.conv())?);
                        let (rw, cw) = (hr.words.len() / keep.len(), cr.words.len() / keep.len());
                        for (r, &k) in keep.iter().enumerate() {
                            let mut fresh = snapshots[si][r].clone();
                            if let Some([q, a, b]) = &fresh_inputs[r] {
                                fresh.window(q, a, b, &l.params).map_err(|e| mlx("fresh prefix", e))?;
                            }
                            let (fr, fc) = (words(fresh.recurrent())?, words(fresh.conv())?);
                            let same = (0..rw).all(|i| hr.words.get(r * rw + i) == fr.words.get(i))
                                && (0..cw).all(|i| cr.words.get(r * cw + i) == fc.words.get(i))
                                && fresh.offsets()[0] == l.batch.offsets()[r];
                            self.counters.replay_vs_fresh += 1;
                            self.counters.checks += 1;
                            if !same {
                                return Err(Failure::new(
                                    "ssm_replay_vs_fresh",
                                    format!("layer {} row {r}: keep {k} of {len}: replayed state is not the fresh prefix run", l.index),
                                ));
                            }
                        }
                    }
                    let after = l.batch.stats();
                    self.counters.replays += after.replays - before.replays;
                    self.counters.replayed_steps += after.replayed_steps - before.replayed_steps;
                    si += 1;
                }
                Layer::Attn(l) => {
                    let n: Vec<usize> = keep.iter().map(|&k| len - k).collect();
                    if n.iter().any(|&x| x > 0) {
                        l.batch.trim_rows(&n, true).map_err(|e| mlx("trim_rows", e))?;
                        for (t, &x) in l.twins.iter_mut().zip(&n) {
                            t.trim(x, true).map_err(|e| mlx("twin trim", e))?;
                        }
                    }
                }
            }
        }
        if all {
            self.counters.commits += 1;
        } else {
            self.counters.rollbacks += 1;
            self.counters.rollbacks_unequal += u64::from(unequal);
        }
        for (p, &k) in self.pos.iter_mut().zip(&keep) {
            *p += k;
        }
        Ok(true)
    }

    fn filter_rows(&mut self, keep: &[usize]) -> Res {
        for l in &mut self.layers {
            match l {
                Layer::Ssm(l) => {
                    l.batch.filter(keep).map_err(|e| mlx("filter", e))?;
                    l.twins = keep.iter().map(|&r| l.twins[r].clone()).collect();
                    l.models = keep.iter().map(|&r| l.models[r].clone()).collect();
                }
                Layer::Attn(l) => {
                    l.batch.filter(keep).map_err(|e| mlx("filter", e))?;
                    l.twins = keep.iter().map(|&r| l.twins[r].clone()).collect();
                }
            }
        }
        self.reqs = keep.iter().map(|&r| self.reqs[r]).collect();
        self.pos = keep.iter().map(|&r| self.pos[r]).collect();
        Ok(())
    }

    fn filter(&mut self, flags: &[bool]) -> Res<bool> {
        if self.rows() == 0 || flags.is_empty() {
            return Ok(false);
        }
        let keep: Vec<usize> = (0..self.rows()).filter(|&r| flags[r % flags.len()]).collect();
        // A repeated row is a typed error and changes nothing.
        if self.rows() > 0 {
            for l in &mut self.layers {
                if let Layer::Ssm(l) = l {
                    if l.batch.filter(&[0, 0]) != Err(CacheError::DuplicateRow { row: 0 }) {
                        return Err(Failure::new("ssm_filter_errors", "a repeated row was not refused"));
                    }
                    self.counters.expected_errors += 1;
                }
            }
        }
        self.filter_rows(&keep)?;
        Ok(true)
    }

    fn extract(&mut self, row: usize) -> Res<bool> {
        if row >= self.rows() {
            return Ok(false);
        }
        for li in 0..self.layers.len() {
            if let Layer::Ssm(l) = &self.layers[li] {
                let mut e = l.batch.extract(row).map_err(|e| mlx("extract", e))?;
                let mut twin = l.twins[row].clone();
                self.counters.checks += 1;
                let same = words(e.conv())? == words(twin.conv())?
                    && words(e.recurrent())? == words(twin.recurrent())?
                    && e.offsets() == twin.offsets();
                if !same {
                    return Err(Failure::new(
                        "ssm_extract",
                        format!("layer {} row {row}: extract differs from the twin", l.index),
                    ));
                }
                let rows = vec![(self.reqs[row], self.pos[row], 0, 1)];
                let [q, a, b] = self.ssm_inputs(l.index, &rows, 1, None);
                let y1 = e.decode(&q, &a, &b, &l.params).map_err(|err| mlx("extracted decode", err))?;
                let y2 = twin.decode(&q, &a, &b, &l.params).map_err(|err| mlx("twin decode", err))?;
                let same = words(&y1)? == words(&y2)? && words(e.recurrent())? == words(twin.recurrent())?;
                self.counters.outputs_compared += 1;
                self.counters.outputs_exact += u64::from(same);
                if !same {
                    return Err(Failure::new(
                        "ssm_extract",
                        format!("layer {} row {row}: extracted row decodes differently", l.index),
                    ));
                }
            }
        }
        Ok(true)
    }
}

/// Draws one op for the current world (the workload stream).
pub fn gen_op(rng: &mut impl Rng, world: &SsmWorld) -> SsmOp {
    let rows = world.rows();
    let k = rng.random_range(0..100);
    if rows == 0 || k < 12 {
        if rng.random_bool(0.5) {
            SsmOp::Admit { prompt: rng.random(), chunk: rng.random() }
        } else {
            let n = rng.random_range(1..=3);
            SsmOp::AdmitPadded {
                prompts: (0..n).map(|_| rng.random()).collect(),
                left: rng.random_bool(0.5),
                chunk: rng.random(),
                drop_longest: rng.random_bool(0.4),
            }
        }
    } else if k < 40 {
        SsmOp::Decode
    } else if k < 75 {
        SsmOp::Verify { len: rng.random(), keeps: (0..rows).map(|_| rng.random()).collect() }
    } else if k < 88 {
        SsmOp::Filter { keep: (0..rows).map(|_| rng.random_bool(0.8)).collect() }
    } else {
        SsmOp::Extract { row: rng.random_range(0..rows) as u8 }
    }
}

/// One seed of a recurrent family: ops, the failing op (if any) and the counters.
pub struct SsmRun {
    pub ops: Vec<SsmOp>,
    pub failure: Option<(usize, Failure)>,
    pub counters: SsmCounters,
}

/// Runs `family` for `seed` (generated ops) or replays `ops`.
pub fn run_family(family: &str, seed: u64, ops: Option<Vec<SsmOp>>) -> Option<SsmRun> {
    let cfg = SsmFamilyConfig::from_seed(family, seed)?;
    let mut rng = stream(seed, Stream::Workload);
    let mut run = SsmRun { ops: vec![], failure: None, counters: SsmCounters::default() };
    let mut world = match SsmWorld::new(cfg.clone()) {
        Ok(w) => w,
        Err(f) => {
            run.failure = Some((0, f));
            return Some(run);
        }
    };
    let replay = ops.is_some();
    let list = ops.unwrap_or_default();
    let n = if replay { list.len() } else { cfg.ops };
    for i in 0..n {
        let op = if replay { list[i].clone() } else { gen_op(&mut rng, &world) };
        run.ops.push(op.clone());
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| world.apply(&op)));
        match r {
            Ok(Ok(_)) => {}
            Ok(Err(f)) => {
                run.failure = Some((i, f));
                break;
            }
            Err(_) => {
                run.failure = Some((i, Failure::new("panic", "the op panicked")));
                break;
            }
        }
    }
    run.counters = world.counters;
    Some(run)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cache::mutation::{self, Mutant};

    fn cpu() {
        mlx_rs::Device::set_default(&mlx_rs::Device::cpu());
    }

    #[test]
    fn families_pass_and_count_rounds_rollbacks_and_replays() {
        cpu();
        for family in ["ssm", "hybrid-qwen35", "hybrid-sliding"] {
            let mut total = SsmCounters::default();
            for seed in 0..6 {
                let run = run_family(family, seed, None).unwrap();
                if let Some((i, f)) = &run.failure {
                    panic!("{family} seed {seed} op {i} ({:?}): {f}", run.ops[*i]);
                }
                let c = &run.counters;
                total.rounds += c.rounds;
                total.rollbacks += c.rollbacks;
                total.rollbacks_unequal += c.rollbacks_unequal;
                total.replays += c.replays;
                total.replay_vs_fresh += c.replay_vs_fresh;
                total.state_compared += c.state_compared;
                total.state_exact += c.state_exact;
            }
            assert!(total.rounds > 0 && total.rollbacks_unequal > 0 && total.replays > 0, "{family}: {total:?}");
            assert!(total.replay_vs_fresh > 0 && total.state_compared > 0, "{family}: {total:?}");
            assert_eq!(total.state_exact, total.state_compared, "{family}");
        }
        assert!(run_family("no-such-family", 0, None).is_none());
    }

    #[test]
    fn the_same_seed_gives_the_same_ops_and_counters() {
        cpu();
        let a = run_family("ssm", 11, None).unwrap();
        let b = run_family("ssm", 11, None).unwrap();
        assert_eq!(a.ops, b.ops);
        assert_eq!(a.counters, b.counters);
        let replayed = run_family("ssm", 11, Some(a.ops.clone())).unwrap();
        assert_eq!(replayed.counters, a.counters);
    }

    #[test]
    fn every_ssm_mutant_is_caught_by_the_family() {
        cpu();
        let mut survivors = vec![];
        for &m in Mutant::ALL.iter().filter(|m| m.layout() == "ssm") {
            mutation::arm(Some(m));
            let caught = (0..60).find(|&seed| run_family("ssm", seed, None).unwrap().failure.is_some());
            mutation::arm(None);
            if caught.is_none() {
                survivors.push(m.name());
            }
        }
        assert!(!mutation::ENABLED || survivors.is_empty(), "survivors: {survivors:?}");
    }
}

/// Sums counters of many runs (for measurements and the summary).
pub fn add_counters(total: &mut SsmCounters, c: &SsmCounters) {
    total.ops += c.ops;
    total.checks += c.checks;
    total.rounds += c.rounds;
    total.commits += c.commits;
    total.rollbacks += c.rollbacks;
    total.rollbacks_unequal += c.rollbacks_unequal;
    total.replays += c.replays;
    total.replayed_steps += c.replayed_steps;
    total.replay_vs_fresh += c.replay_vs_fresh;
    total.state_compared += c.state_compared;
    total.state_exact += c.state_exact;
    total.outputs_compared += c.outputs_compared;
    total.outputs_exact += c.outputs_exact;
    total.model_max_ulp_output = total.model_max_ulp_output.max(c.model_max_ulp_output);
    total.model_max_ulp_state = total.model_max_ulp_state.max(c.model_max_ulp_state);
    total.padded_prefills += c.padded_prefills;
    total.left_padded_prefills += c.left_padded_prefills;
    total.expected_errors += c.expected_errors;
}
