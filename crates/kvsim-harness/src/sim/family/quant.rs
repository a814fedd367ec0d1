//! The affine-quantized family (`kv:quant`, `kv:rotating-quant`, docs/quantized-kv.md): the attention
//! family's op interpreter ([`Attention`]) over caches of [`Storage::Affine`] — serial caches, the running batch's
//! rows and the solo twins alike hold six planes (packed words, scales and biases of K and V).
//!
//! What this module adds to the attention family:
//! - the per-seed draw ([`QuantChoice`], from its own stream [`Stream::Quant`]): bits in {2, 3, 4, 5, 6, 8}, group in
//!   {32, 64, 128}, and the family's own head dim, a multiple of the group in {32, 64, 128} (the run's `head_dim` of
//!   4..16 is below every group MLX accepts); `native` runs are quantized from the first write, the others start
//!   plain and convert when the generator draws the conversion op;
//! - the conversion op ([`Op::Quantize`]): `to_quantized` of every cache of the family at once (solo requests, the
//!   running batch, the twins at the same point), the model's verdict on invalid parameters and on other parameters
//!   than a cache holds, and the refusal mid-round (a prepared, unfinalized prefill) with the state unchanged;
//! - the state check of affine storage: all six planes of production against the twin (bytes, physical and temporal
//!   order) and every live column's triple against `reference::quant::quantized_column` of the model's token;
//! - the compiled-decode step of affine storage (`cache::quantized_decode_step`, run by the attention interpreter's
//!   `compiled_step` for this family's storage): output and all six planes byte-identical to the twin's ordinary
//!   append, the plan equal to `decode_phase` and the model's phase; and, on copies, the typed refusal of a step of
//!   the other storage (a plain step's outputs applied after a mid-run conversion, or to affine planes:
//!   `CacheError::StepMismatch`, state and planes unchanged; `ill_formed_rejected.compiled_step_storage`).
//!
//! Reads are the attention family's: outputs against the twin (bytes) and against the f64 attention over the
//! dequantized values (`reference::quant`, within [`check::quant_model_bound`]).
//!
//! Every family of a run gets the same ops: this one supports every kind (the conversion op is drawn only in runs
//! that hold it, the attention family answers it with `InvalidQuant`: its head dim is below every group).

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::sim::check::{self, Failure};
use crate::sim::config::{Params, SimConfig};
use crate::sim::family::attention::{mlx_fail, unexpected, Attention, Res};
use crate::sim::family::{Cx, Family, Registration};
use crate::sim::observe::NoObserver;
use crate::sim::ops::{Op, OpKind};
use crate::sim::rng::{stream, Stream};
use crate::sim::roster::Roster;
use crate::sim::summary::Counters;
use kvsim_cache::bytes::ArrayBytes;
use kvsim_cache::{self as cache, CacheError, CompiledDecode, DecodePhase, QuantSpec, Storage};
use kvsim_reference::quant::{quantized_column, RefQuant};
use kvsim_reference::{Tensor, Tok};

/// The family's name in `SimConfig::families`.
pub const NAME: &str = "quant";

/// The quantized family: every op kind of the alphabet, in about 30% of the runs.
pub const REGISTRATION: Registration = Registration {
    name: NAME,
    supports: |_kind: OpKind| true,
    swarm_probability: 0.3,
    owns: OpKind::is_quant,
    draw_params: Some(|seed| QuantChoice::draw(seed).to_params()),
    weights_from_params: |p| {
        QuantChoice::from_params(p).map(|q| vec![(OpKind::Quantize, q.convert_weight)]).unwrap_or_default()
    },
    draws_op: Some((OpKind::Quantize, draw_quantize)),
    build: |cfg| Ok(Box::new(Quant::new(cfg)?)),
};

/// The quantized family's parameters of one run (drawn per seed; recorded in the trace's config).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct QuantChoice {
    pub bits: usize,
    pub group: usize,
    /// The family's head dim (a multiple of the group, at most 128); the run's other geometry is shared.
    pub head_dim: usize,
    /// Quantized from the first write (`true`), or plain until the first successful conversion op.
    pub native: bool,
    /// Weight of the conversion op in this run.
    pub convert_weight: u32,
}

impl QuantChoice {
    /// The parameters of `seed`'s run (drawn only when it holds the quantized family), from [`Stream::Quant`] (no
    /// other subsystem's draws move).
    pub fn draw(seed: u64) -> QuantChoice {
        let mut rng = stream(seed, Stream::Quant);
        let bits = cache::QUANT_BITS[rng.random_range(0..cache::QUANT_BITS.len())];
        let group = cache::QUANT_GROUPS[rng.random_range(0..cache::QUANT_GROUPS.len())];
        let dims: Vec<usize> = [32usize, 64, 128].into_iter().filter(|d| d % group == 0).collect();
        let head_dim = dims[rng.random_range(0..dims.len())];
        let native = rng.random_bool(0.5);
        let convert_weight = rng.random_range(1..=3);
        QuantChoice { bits, group, head_dim, native, convert_weight }
    }

    /// This run's parameters, if its config holds the quantized family's.
    pub fn of(cfg: &SimConfig) -> Option<QuantChoice> {
        cfg.params_of(NAME).and_then(QuantChoice::from_params)
    }

    /// The parameters as the config stores them (in field order, as traces have always written them).
    pub fn to_params(self) -> Params {
        Params::of(&self)
    }

    /// The parameters from the config's record (`None` when they do not parse).
    pub fn from_params(p: &Params) -> Option<QuantChoice> {
        p.to()
    }

    pub fn spec(&self) -> QuantSpec {
        QuantSpec { bits: self.bits, group: self.group }
    }
}

/// The generator's conversion op: mostly the run's own parameters; sometimes invalid bits, an invalid group, or
/// (three times as often) another valid pair, each with `mid_round` now and then. Another pair is a typed error
/// once the family holds its own, for every cache at once: an empty request's too (a request admitted into the
/// quantized batch's world, the conversion drawn right after its admission: [`crate::sim::gen::FollowUp`]).
pub fn draw_quantize(cfg: &SimConfig, w: &mut ChaCha8Rng) -> Op {
    draw_quantize_for(QuantChoice::of(cfg), w)
}

/// [`draw_quantize`] for a run whose parameters are `choice` (wherever its config keeps them).
pub fn draw_quantize_for(choice: Option<QuantChoice>, w: &mut ChaCha8Rng) -> Op {
    let (bits, group) = choice.map_or((4, 64), |q| (q.bits, q.group));
    let (bits, group) = match w.random_range(0..20) {
        0 => ([1usize, 7, 16][w.random_range(0..3)], group),
        1 => (bits, [16usize, 48, 256][w.random_range(0..3)]),
        2..=4 => (cache::QUANT_BITS[w.random_range(0..cache::QUANT_BITS.len())], group),
        _ => (bits, group),
    };
    Op::Quantize { bits: bits as u32, group: group as u32, mid_round: w.random_bool(0.3) }
}

/// One run's quantized layers: an [`Attention`] over affine storage with the family's head dim.
pub struct Quant {
    inner: Attention,
    choice: QuantChoice,
}

impl Quant {
    pub fn new(cfg: &SimConfig) -> Res<Quant> {
        let choice = QuantChoice::of(cfg)
            .ok_or_else(|| Failure::new("setup", "the quant family needs the config's quant parameters"))?;
        let mut own = cfg.clone();
        own.head_dim = choice.head_dim;
        let storage = if choice.native { Storage::Affine(choice.spec()) } else { Storage::Plain };
        storage.validate(&own.kv_spec()).map_err(|e| Failure::new("setup", e.to_string()))?;
        Ok(Quant { inner: Attention::with_storage(own, storage)?, choice })
    }
}

impl Family for Quant {
    fn key(&self) -> &'static str {
        match self.inner.cfg.layout.max_size() {
            None => "kv:quant",
            Some(_) => "kv:rotating-quant",
        }
    }

    fn apply(&mut self, op: &Op, cx: &mut Cx<'_>) -> Res<bool> {
        if let Op::CompiledStep { req } = op {
            // On copies, before the real step: the typed refusal of a step of the other storage.
            self.inner.compiled_step_other_storage(cx.roster, *req, self.choice.spec())?;
        }
        // Calls are described as the attention family's (the mlx-lm oracle maps them on `QuantizedKVCache`), plus
        // the conversion op (`Call::Quantize`).
        Family::apply(&mut self.inner, op, cx)
    }

    fn check_state(&mut self, cx: &mut Cx<'_>) -> Res<()> {
        let mut quiet = NoObserver;
        let mut own =
            Cx { hasher: &mut *cx.hasher, observer: &mut quiet, roster: cx.roster, change: None, held: cx.held };
        self.inner.check_all(&mut own)
    }

    fn observe_state(&mut self, cx: &mut Cx<'_>) -> Res<()> {
        self.inner.record_checkpoint(cx)
    }

    fn position(&self, req: u32) -> Option<(usize, Option<usize>)> {
        self.inner.position(req)
    }

    fn counters(&self) -> &Counters {
        &self.inner.counters
    }

    fn counters_mut(&mut self) -> &mut Counters {
        &mut self.inner.counters
    }

    fn variant(&self) -> Option<String> {
        Some(format!("{}:{}", self.choice.bits, self.choice.group))
    }

    fn take_reached(&mut self) -> Vec<&'static str> {
        self.inner.drain_reached()
    }
}

/// The model's verdict on `to_quantized(target)` of a cache of `storage` and head dim `head_dim` (the rules of
/// docs/quantized-kv.md, written here from the reference's parameter rules, not from the production code):
/// the same storage is a no-op; another affine storage is `StorageMismatch`; parameters MLX refuses for this head
/// dim are `InvalidQuant`; else the cache converts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Converts,
    Unchanged,
    StorageMismatch,
    InvalidQuant,
}

fn verdict(storage: Storage, head_dim: usize, target: QuantSpec) -> Verdict {
    match storage {
        Storage::Affine(q) if q == target => Verdict::Unchanged,
        Storage::Affine(_) => Verdict::StorageMismatch,
        Storage::Plain => {
            if (RefQuant { bits: target.bits, group: target.group }).validate(head_dim).is_ok() {
                Verdict::Converts
            } else {
                Verdict::InvalidQuant
            }
        }
    }
}

fn conversion_matches(what: &str, v: Verdict, got: &Result<(), CacheError>) -> Res<()> {
    let ok = matches!(
        (v, got),
        (Verdict::Converts | Verdict::Unchanged, Ok(()))
            | (Verdict::StorageMismatch, Err(CacheError::StorageMismatch { .. }))
            | (Verdict::InvalidQuant, Err(CacheError::InvalidQuant { .. }))
    );
    if ok {
        Ok(())
    } else {
        Err(Failure::new("errors", format!("{what}: model says {v:?}, production returned {got:?}")))
    }
}

impl Attention {
    /// The conversion op (see [`Op::Quantize`]). Production, twins and the family's storage convert together;
    /// the model's positions, columns and ring phases do not move (the state check after the op proves it, and,
    /// when the verdict is an error, that nothing changed).
    pub(crate) fn quantize(&mut self, cx: &mut Cx<'_>, bits: usize, group: usize, mid_round: bool) -> Res<bool> {
        let roster = cx.roster;
        let target = QuantSpec { bits, group };
        let v = verdict(self.storage, self.spec.head_dim, target);
        if mid_round && !roster.rows().is_empty() {
            self.refuse_mid_round(target)?;
        }
        for layer in 0..self.cfg.layers {
            let got = self.batch[layer].to_quantized(target);
            conversion_matches("batch to_quantized", v, &got)?;
        }
        let ids: Vec<u32> = self.reqs.keys().copied().collect();
        for id in ids {
            let solo = roster.is_solo(id);
            let r = self.reqs.get_mut(&id).unwrap();
            for layer in 0..r.twin.len() {
                if solo {
                    conversion_matches("solo to_quantized", v, &r.solo[layer].to_quantized(target))?;
                }
                conversion_matches("twin to_quantized", v, &r.twin[layer].to_quantized(target))?;
            }
        }
        // Every cache of a request that holds no position went through the call too (converted empty, left as it
        // is, or refused with the same typed error as the others), checked like the rest.
        if self.reqs.values().any(|r| r.model.offset == 0) {
            self.reached.push("to_quantized/empty_request");
            if matches!(self.storage, Storage::Affine(_)) && !roster.rows().is_empty() {
                self.reached.push("to_quantized/empty_beside_quantized");
            }
        }
        if cx.observer.wants_calls() {
            let call = crate::sim::observe::Call::Quantize { bits, group, converted: v == Verdict::Converts };
            cx.observer.on_call(call).map_err(|e| mlx_fail("observe", e))?;
        }
        match v {
            Verdict::Converts => {
                self.storage = Storage::Affine(target);
                // Counted in the family's table; the state check right after the op compares every converted plane
                // with the twin's and the reference's (a difference fails the run).
                let dtype = if self.cfg.dtype == crate::sim::config::DtypeChoice::Bf16 { "bf16" } else { "f32" };
                let e = self.counters.table.entry(format!("to_quantized/{dtype}")).or_default();
                e.compared += 1;
                e.bit_exact += 1;
            }
            Verdict::Unchanged => {}
            Verdict::StorageMismatch | Verdict::InvalidQuant => self.counters.expected_errors += 1,
        }
        Ok(true)
    }

    /// A copy of the running batch with a right-padded prefill prepared (one more position per row) refuses the
    /// conversion with `PendingPrefill` (mid-round: whatever the parameters), and its planes, storage and row
    /// states are exactly what they were.
    fn refuse_mid_round(&mut self, target: QuantSpec) -> Res<()> {
        for layer in 0..self.cfg.layers {
            let mut copy = self.batch[layer].clone();
            copy.prepare(&vec![1; copy.rows()]).map_err(|e| unexpected("prepare", e))?;
            let (states, storage) = (copy.row_states().to_vec(), copy.storage());
            let before = copy.buffer_planes().unwrap_or_default();
            match copy.to_quantized(target) {
                Err(CacheError::PendingPrefill) => {}
                other => {
                    return Err(Failure::new(
                        "errors",
                        format!("to_quantized with a prefill pending: expected PendingPrefill, got {other:?}"),
                    ))
                }
            }
            let after = copy.buffer_planes().unwrap_or_default();
            if copy.row_states() != states.as_slice() || copy.storage() != storage || after.len() != before.len() {
                return Err(Failure::new("errors", "a refused mid-round conversion changed the batch's state"));
            }
            let arrays: Vec<&mlx_rs::Array> = before.iter().chain(&after).collect();
            let bytes = ArrayBytes::read_many(&arrays).map_err(|e| mlx_fail("read planes", e))?;
            let n = before.len();
            for p in 0..n {
                check::bytes_equal(
                    &format!("layer {layer} plane {p} after a refused conversion"),
                    &bytes[p],
                    &bytes[n + p],
                )?;
            }
            self.counters.expected_errors += 1;
        }
        Ok(())
    }

    /// The compiled step's one remaining impossibility, a step of the other storage, on a copy of each layer's
    /// serial cache of request `req` (prepared for its next step): a plain cache runs the plain step, then converts
    /// (`to_quantized` with the run's parameters) before the apply, a mid-round conversion; an affine cache is
    /// handed what a plain step returns for its plan (dense K and V of the slot's columns, its own outputs' shapes
    /// otherwise). Both applies must be `StepMismatch` with the copy's state and every plane's bytes as they were
    /// before the apply. The run's own caches are not touched (the op then runs the real step).
    pub(crate) fn compiled_step_other_storage(&mut self, roster: &Roster, req: u32, quant: QuantSpec) -> Res<()> {
        if !roster.is_solo(req) {
            return Ok(());
        }
        let fail = |what: String| Failure::new("errors", what);
        let step_err = |e: CacheError| unexpected("compiled step (probe)", e);
        for layer in 0..self.cfg.layers {
            let mut c = self.reqs[&req].solo[layer].clone();
            let plan = CompiledDecode::prepare_decode_step(&mut c).map_err(step_err)?;
            let slot = c.step_inputs(&plan).map_err(step_err)?;
            let n = c.storage().planes();
            let outputs = match c.storage() {
                Storage::Plain => {
                    let (hq, d) = (self.cfg.heads_q as i32, self.spec.head_dim as i32);
                    let dt = self.spec.dtype.to_mlx();
                    let zeros = |h: i32| mlx_rs::ops::zeros_dtype(&[1, h, 1, d], dt).map_err(|e| mlx_fail("zeros", e));
                    let hkv = self.spec.heads_kv as i32;
                    let mut inputs = slot;
                    inputs.extend([zeros(hq)?, zeros(hkv)?, zeros(hkv)?, c.rope_input().map_err(step_err)?]);
                    let outs = cache::plain_decode_step(plan.fetch, None, 1.0, &inputs).map_err(step_err)?;
                    c.to_quantized(quant).map_err(|e| unexpected("to_quantized (probe)", e))?;
                    outs
                }
                Storage::Affine(_) => {
                    let (dk, dv) = match plan.fetch {
                        DecodePhase::Ring => c.storage().dense(&slot[..n]).map_err(step_err)?,
                        // A plain concat step returns the new column only: one dense column (the slot may be empty).
                        DecodePhase::Concat => {
                            let (h, d) = (self.spec.heads_kv as i32, self.spec.head_dim as i32);
                            let one = mlx_rs::ops::zeros_dtype(&[1, h, 1, d], self.spec.dtype.to_mlx())
                                .map_err(|e| mlx_fail("zeros", e))?;
                            (one.clone(), one)
                        }
                    };
                    vec![dk.clone(), dk, dv]
                }
            };
            let (state, before) = (c.state().clone(), c.buffer_planes().unwrap_or_default());
            match c.apply_decode_step(&plan, outputs) {
                Err(CacheError::StepMismatch { .. }) => {}
                other => {
                    return Err(fail(format!(
                        "layer {layer}: a step of the other storage applied to {}: expected StepMismatch, got {:?}",
                        c.storage_kind().0,
                        other.map(|r| r.len())
                    )))
                }
            }
            let after = c.buffer_planes().unwrap_or_default();
            if c.state() != &state || after.len() != before.len() {
                return Err(fail(format!("layer {layer}: a refused step apply changed the cache's state")));
            }
            let arrays: Vec<&mlx_rs::Array> = before.iter().chain(&after).collect();
            let bytes = ArrayBytes::read_many(&arrays).map_err(|e| mlx_fail("read planes", e))?;
            let m = before.len();
            for p in 0..m {
                check::bytes_equal(
                    &format!("layer {layer} plane {p} after a refused step apply"),
                    &bytes[p],
                    &bytes[m + p],
                )?;
            }
            self.counters.record_rejected("compiled_step_storage");
        }
        Ok(())
    }

    /// [`Attention::check_all`] for affine storage: host-side state and kinds, then every live request's six
    /// planes (physical and temporal view) against its twin's (bytes) and the model's tokens quantized by the
    /// reference (bytes), with one device round trip; then every batch's capacity (`check::capacity`).
    pub(crate) fn check_all_planes(&mut self, cx: &mut Cx<'_>) -> Res<()> {
        let roster = cx.roster;
        let quant = self.storage.quant().ok_or_else(|| Failure::new("setup", "plane check of plain storage"))?;
        let max = self.cfg.layout.max_size();
        for layer in 0..self.cfg.layers {
            check::row_count(&self.batch[layer], roster.rows().len())?;
            let b = &self.batch[layer];
            kinds(&b.storage_kind(), true, max, quant)?;
            bytes_per_token("batch", b.bytes_per_token(), |n| b.bytes_for_tokens(n), max, &self.spec, quant)?;
            let width = roster.rows().iter().map(|id| self.reqs[id].model.cols.len()).max().unwrap_or(0);
            let expected_lp: Vec<i64> =
                roster.rows().iter().map(|id| self.reqs[id].model.left_padding(width)).collect();
            check::left_padding(&b.left_padding(), &expected_lp)?;
            let trimmable = roster.rows().iter().all(|id| self.reqs[id].model.is_trimmable());
            check::flag("batch is_trimmable", b.is_trimmable(), trimmable)?;
            self.check_contract(cx, layer)?;
        }
        // Per item: production's physical planes and temporal-view planes (12 arrays), then the twin's (12).
        let mut items: Vec<(String, u32, usize)> = vec![];
        let mut arrays: Vec<mlx_rs::Array> = vec![];
        for (row, id) in roster.rows().iter().enumerate() {
            for layer in 0..self.cfg.layers {
                let what = format!("row {row} (request {id}) layer {layer}");
                let b = &self.batch[layer];
                check::ring_state(&what, &b.row_states()[row].ring, &self.reqs[id].model)?;
                arrays.extend(b.row_physical_planes(row).map_err(|e| unexpected("row_physical_planes", e))?);
                arrays.extend(b.row_temporal_view_planes(row).map_err(|e| unexpected("row_temporal_view", e))?);
                items.push((what, *id, layer));
            }
        }
        let solo: Vec<u32> = roster.solo().collect();
        for id in solo {
            for layer in 0..self.cfg.layers {
                let what = format!("solo request {id} layer {layer}");
                let r = &self.reqs[&id];
                let c = &r.solo[layer];
                check::ring_state(&what, c.state(), &r.model)?;
                kinds(&c.storage_kind(), false, max, quant)?;
                bytes_per_token("serial", c.bytes_per_token(), |n| c.bytes_for_tokens(n), max, &self.spec, quant)?;
                check::flag("solo is_trimmable", c.is_trimmable(), r.model.is_trimmable())?;
                arrays.extend(c.physical_planes().map_err(|e| unexpected("physical_planes", e))?);
                arrays.extend(c.temporal_view_planes().map_err(|e| unexpected("temporal_view", e))?);
                items.push((what, id, layer));
            }
        }
        let twins_at = arrays.len();
        for (what, id, layer) in &items {
            let r = &self.reqs[id];
            let twin = &r.twin[*layer];
            check::ring_state(&format!("twin of {what}"), twin.state(), &r.model)?;
            arrays.extend(twin.physical_planes().map_err(|e| unexpected("twin physical_planes", e))?);
            arrays.extend(twin.temporal_view_planes().map_err(|e| unexpected("twin temporal_view", e))?);
        }
        let refs: Vec<&mlx_rs::Array> = arrays.iter().collect();
        let bytes = ArrayBytes::read_many(&refs).map_err(|e| mlx_fail("read state", e))?;
        let rq = RefQuant { bits: quant.bits, group: quant.group };
        for (n, (what, id, layer)) in items.iter().enumerate() {
            let ours = &bytes[12 * n..12 * n + 12];
            let theirs = &bytes[twins_at + 12 * n..twins_at + 12 * n + 12];
            let model = &self.reqs[id].model;
            for p in 0..6 {
                cx.hasher.update(&ours[p].digest());
                check::bytes_equal(&format!("{what} plane {p} physical vs twin"), &ours[p], &theirs[p])?;
                check::bytes_equal(&format!("{what} plane {p} temporal_view vs twin"), &ours[6 + p], &theirs[6 + p])?;
            }
            let l = *layer as u32;
            planes_vs_model(what, &self.vs, l, rq, &ours[..6], &model.cols)?;
            planes_vs_model(&format!("{what} temporal_view"), &self.vs, l, rq, &ours[6..], &model.temporal_view())?;
            self.counters.bit_exact_state += 6;
            self.counters.record_state(ours[1].dtype, 6);
            self.counters.checks += 8;
        }
        self.counters.checks += items.len() as u64;
        self.check_capacity(cx)
    }
}

/// The storage kind a quantized cache must report: `kv:quant:<bits>:<group>` or `kv:rotating-quant:<bits>:<group>`,
/// plus the row-batch marker for rows (R-C-1, R-BROT-10).
fn kinds(kind: &cache::StorageKind, rows: bool, max: Option<usize>, q: QuantSpec) -> Res<()> {
    let prefix = if max.is_some() { cache::ROTATING_QUANT_PREFIX } else { cache::QUANT_PREFIX };
    let marker = if rows { cache::ROW_BATCH_MARKER } else { "" };
    let want = format!("{prefix}{}:{}{marker}", q.bits, q.group);
    if kind.0 != want || cache::is_row_batch(kind) != rows || cache::is_rotating(kind) != max.is_some() {
        return crate::sim::check::fail(Failure::new(
            "storage_kind",
            format!("{} reports {:?}, expected {want}", kind_of(rows), kind.0),
        ));
    }
    Ok(())
}

fn kind_of(rows: bool) -> &'static str {
    if rows {
        "batch"
    } else {
        "serial cache"
    }
}

/// R-C-4 for affine storage: `2 * H_kv * (4 * D * bits / 32 + 2 * (D / group) * itemsize)` per token (packed
/// words, scales and biases of both sides), `bytes_for_tokens(n)` capped at the window.
fn bytes_per_token(
    what: &str,
    per: usize,
    for_n: impl Fn(usize) -> usize,
    max: Option<usize>,
    spec: &cache::KvSpec,
    q: QuantSpec,
) -> Res<()> {
    let item = spec.dtype.itemsize();
    let d = spec.head_dim;
    let expect = 2 * spec.heads_kv * (4 * d * q.bits / 32 + 2 * (d / q.group) * item);
    if per != expect {
        return crate::sim::check::fail(Failure::new(
            "bytes_per_token",
            format!("{what}: {per}, expected 2*H*(4*D*bits/32 + 2*(D/group)*itemsize) = {expect}"),
        ));
    }
    for n in [0usize, 1, 7, 100] {
        let capped = max.map_or(n, |w| n.min(w));
        if for_n(n) != capped * expect {
            return crate::sim::check::fail(Failure::new(
                "bytes_per_token",
                format!("{what}: bytes_for_tokens({n}) = {}, expected {}", for_n(n), capped * expect),
            ));
        }
    }
    Ok(())
}

/// Six planes `[1, H, n, ·]` (K's packed, scales, biases, then V's) against the reference's triple of each
/// model token, column by column (bytes). A plane of another width or column count is a `layout` failure too.
pub(crate) fn planes_vs_model(
    what: &str,
    vs: &kvsim_reference::ValueSpace,
    layer: u32,
    q: RefQuant,
    planes: &[ArrayBytes],
    toks: &[Tok],
) -> Res<()> {
    let h = vs.heads_kv;
    let widths = [q.packed_words(vs.head_dim), vs.head_dim / q.group, vs.head_dim / q.group];
    for (side, tensor) in [Tensor::K, Tensor::V].into_iter().enumerate() {
        for (j, name) in ["packed", "scales", "biases"].into_iter().enumerate() {
            let p = &planes[3 * side + j];
            let w = widths[j];
            let shape: Vec<usize> = p.shape.iter().map(|&x| x.max(0) as usize).collect();
            if shape != [1, h, toks.len(), w] {
                return crate::sim::check::fail(Failure::new(
                    "layout",
                    format!(
                        "{what} {tensor:?} {name}: shape {shape:?}, the model expects [1, {h}, {}, {w}]",
                        toks.len()
                    ),
                ));
            }
        }
        for (c, tok) in toks.iter().enumerate() {
            let want = quantized_column(vs, layer, tensor, *tok, q);
            let n = toks.len();
            for (j, (name, expect)) in
                [("packed", &want.packed), ("scales", &want.scales), ("biases", &want.biases)].into_iter().enumerate()
            {
                let (p, w) = (&planes[3 * side + j], widths[j]);
                let found: Vec<u32> = (0..h * w).map(|x| p.words.get(((x / w) * n + c) * w + x % w) as u32).collect();
                if &found != expect {
                    return crate::sim::check::fail(Failure::new(
                        "layout",
                        format!(
                            "{what} {tensor:?} {name} column {c}: not the reference's triple of token (request {}, \
                             position {})",
                            tok.req, tok.pos
                        ),
                    ));
                }
            }
        }
    }
    Ok(())
}
