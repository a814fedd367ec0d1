//! The bf16-first family (docs/transitioning-rows.md): transitioning rows
//! (`kv:delayed-quant:<bits>:<group>:<start>`, `kv:delayed-rotating-quant:<W>:<bits>:<group>:<start>`) under the
//! simulator's schedules, with the serial legos (`Bf16FirstQuantizedKvCache`, `Bf16FirstRotatingQuantizedKvCache`)
//! as the requests outside the batch and as the solo twins. The same struct in lego mode is the family `bf16-first`
//! (`legos.rs`): the legos in their own right, keys `kv:bf16-first-quant` / `kv:bf16-first-rotating-quant`.
//!
//! For one run it holds, per layer:
//! - **production**: the running batch as one [`TransitioningKvRows`], and a serial lego ([`Bf16FirstCache`]) for
//!   every request outside it;
//! - **twins**: one serial lego per request, fed the same blocks in the same appends, with a lego round armed where
//!   the rows hold their conversion (a speculative round, a prefill chunk until its commit);
//! - **the model**: `reference::transition` ([`RowsModel`] for the batch, [`LegoModel`] per request outside it,
//!   [`take`] for prefix reuse), pure Rust.
//!
//! Checks after every op: every row's lifecycle (conversion offset, floor, left padding, offset, packing,
//! `max_append_tokens`, `minimum_reusable_offset`) equals the model's; every row's stored planes (bf16, or the six
//! affine planes) are byte-identical to its twin's in physical order, and its temporal view holds exactly the
//! model's tokens (each column's bytes equal `reference::values` bits, or `reference::quant::quantized_column`
//! once converted). Every read: byte-identical to the twin's while rows are unpacked (each row is a serial cache),
//! measured once packed (unpadded packed decodes are promised byte-identical on CPU); and within measured ULP
//! bounds of the f64 attention over the values the model says the read sees (bf16, or dequantized affine).
//!
//! How the op stream maps here (what the rows layout has no call for is not supported, so runs holding this
//! family never draw it: `SoloTrim`, `Trim`, `Append`, `ReadBlock`, `BidirPrefill`, `EncoderRead`, `CompiledStep`,
//! `DecodePhase`, `Prepare`, `IllFormed`; the lego family has no rows to adopt; the quantized family's conversion
//! passes this family, `OpKind::passes_others`):
//! - `Merge`/`Join`: every running row is handed back to its lego (`extract`) and merged with the incoming legos
//!   (`TransitioningKvRows::merge`; several rows are rewritten in temporal order behind left padding, and so are
//!   their twins, through the same public merge).
//! - `BatchPrefill`: the fresh requests form a prefill cohort (`begin_prefill`); each planned chunk of the common
//!   length is delivered as two forwards (a sibling's split) and committed per request (`commit_prefill`), so
//!   `start` is crossed inside a prefill; the longer requests' tails are solo lego windows; then the cohort enters
//!   the batch. In about a third of the runs (`TransitionChoice::padded_prefill`) it is a right-padded prefill
//!   instead (`batch_prefill_padded`): `prepare(lengths)`, prepared windows of `chunk` positions (each as two
//!   forwards) until the longest prompt is in, each request committing at the end of the chunk where its prompt
//!   ends, the last ones by `finalize`; twins are legos fed each row's real positions inside a lego round.
//! - `Verify { gamma, accept }`: a speculative round (`round_begin`, a verify window, then `round_commit` when every
//!   row accepts all, else `round_rollback` with per-row keeps); a rollback keeping more than the round wrote is
//!   tried first and must be refused (`KeepTooLong`) with nothing changed.
//! - `CommitSpan { len }`: `TransitioningKvRows::commit_span`, one decode per position (a row whose
//!   transition comes due converts between the span's positions, and the rows pack as soon as all have): each
//!   position's read against the model in its own precision and against the twin's ordinary `decode` of that
//!   position (bytes, with the packed-read classes of `Decode`); the rows converted, in order, against the model's.
//! - `Extract { finish }`: the row handed back to serial use (its lego composed again); a finished request's lego
//!   is kept as the run's prefix-cache entry.
//! - `PrefixReuse { common, prompt, extra }` (new): `take` from the stored entry (below the floor: `BelowFloor`; a
//!   needed trim of a wrapped ring: `NotTrimmable`; nothing changed), then `extra` more positions continue it.
//! - `PlainRead` (new): the plain read of the batch, refused with `MixedPrecision` while any row is affine; the
//!   dense fetch (each row as its storage fetches it dense) against the twin's.
//! - `Fetch { len }`: the softcapped read's fetch (R-TKV-4): every row appends `len` positions and the rows answer
//!   with one aligned dense K/V; each row's part against its lego twin's own fetch (bytes), the padding and width
//!   against the model's aligned geometry, the rows converted after it against the model's. A fetch whose positions
//!   bring several rows to their boundary at once must convert them all in the one call (`fetch/rows_due_together`).
//! - `Adopt { invalid }` (rows only, `adopt.rs`): every layer's rows rebuilt from their own parts through
//!   `TransitioningKvRows::adopt`, the run going on from the adopted rows (`adopt/bf16_first`); with `invalid` row 0's
//!   lifecycle is made unreachable first and `InvalidState` is expected, the rows untouched.
//! - `Persist { req, mlxlm }` (both modes): a request outside the batch (a transitioning row handed back
//!   to serial use, or a lego that never ran in the batch) saved in kvsim's format by its legos' own kind, dropped,
//!   and restored from the bytes alone; `check_all` then compares the restored legos with their twins (planes,
//!   lifecycle, floor, kind). With `mlxlm`, mlx-lm's form is first asked for and must be refused
//!   (`PersistError::Unsupported`: mlx-lm 0.32.2 has no class that converts at a boundary).
//!
//! This file holds the family's parameters, state, helpers and the op dispatch; the rest lives in child modules:
//! `lifecycle` (admit, merge/join, extract, filter), `reads` (appends, batch forwards, commit_span, verify),
//! `prefill` (batch_prefill, chunked or padded), `prefix` (prefix_reuse, plain_read, fetch), `checks` (reads and state),
//! `persist`, `adopt`, and `legos` (lego mode).
//!
//! [`take`]: kvsim_reference::transition::take

use std::collections::BTreeMap;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;
use rand::Rng;
use serde::{Deserialize, Serialize};

use crate::sim::check::{self, Failure};
use crate::sim::config::{DtypeChoice, SimConfig};
use crate::sim::family::{Cx, Family, Registration};
use crate::sim::ops::{Op, OpKind};
use crate::sim::rng::{stream, Stream};
use crate::sim::roster::Change;
use crate::sim::summary::Counters;
use kvsim_cache::bytes::ArrayBytes;
use kvsim_cache::transition::{Bf16FirstCache, Transition, TransitioningKvRows};
use kvsim_cache::{self as cache, CacheError, KvSpec, Masks, QuantSpec};
use kvsim_reference::quant::RefQuant;
use kvsim_reference::transition::{LegoModel, RowsModel, TransitionError, TransitionSpec};
use kvsim_reference::{ModelError, Tensor, Tok, ValueSpace};

type Res<T> = Result<T, Failure>;

/// The family's name in `SimConfig::families`.
pub const NAME: &str = "transition";

/// What the rows layout can be asked (module docs); the training kinds leave every cache untouched.
pub fn supports(k: OpKind) -> bool {
    matches!(
        k,
        OpKind::Admit
            | OpKind::SoloWindow
            | OpKind::SoloDecode
            | OpKind::Merge
            | OpKind::Join
            | OpKind::BatchPrefill
            | OpKind::Decode
            | OpKind::Window
            | OpKind::Verify
            | OpKind::Extract
            | OpKind::Filter
            | OpKind::CommitSpan
            | OpKind::CompiledBatchStep
            | OpKind::CommitKnownSpans
            | OpKind::PrefixReuse
            | OpKind::PlainRead
            | OpKind::Fetch
            | OpKind::Persist
            | OpKind::Paged
            | OpKind::Adopt
    ) || k.is_training()
}

/// The lego family's name in `SimConfig::families`: the serial legos in their own right (`legos.rs`).
pub const LEGO_NAME: &str = "bf16-first";

/// What the serial legos can be asked: the rows' ops (the running batch is a set of serial legos, one call each)
/// and the serial trims.
pub fn supports_legos(k: OpKind) -> bool {
    (supports(k) && !matches!(k, OpKind::CompiledBatchStep | OpKind::CommitKnownSpans | OpKind::Adopt))
        || matches!(k, OpKind::SoloTrim | OpKind::Trim)
}

/// The bf16-first family, in about a quarter of the runs.
pub const REGISTRATION: Registration = Registration {
    owns: OpKind::is_transition,
    ..Registration::plain(NAME, supports, 0.25, |cfg| Ok(Box::new(TransitionFamily::new(cfg, false)?)))
};

/// The serial legos as a family of their own (`kv:bf16-first-quant`, `kv:bf16-first-rotating-quant`), in about a
/// fifth of the runs.
pub const LEGO_REGISTRATION: Registration = Registration {
    owns: OpKind::is_transition,
    ..Registration::plain(LEGO_NAME, supports_legos, 0.2, |cfg| Ok(Box::new(TransitionFamily::new(cfg, true)?)))
};

/// Largest scaled-ULP distance of a bf16 read to the f64 model (head dims 32..128; measured, README "Guarantees").
pub const BF16_READ_BOUND: f64 = 64.0;
/// Largest scaled-ULP distance of an affine read to the f64 attention over the dequantized values (measured).
pub const AFFINE_READ_BOUND: f64 = 256.0;

/// The family's parameters of one run, drawn from [`Stream::Transition`] of the run's payload seed (so a trace's
/// config decides them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TransitionChoice {
    pub bits: usize,
    pub group: usize,
    /// The family's head dim: a multiple of the group (the run's 4..16 is below every group MLX accepts).
    pub head_dim: usize,
    /// The precision boundary (`None`: never converts). 0 in some runs, small values the schedules cross in
    /// windows, rounds and prefills in most.
    pub start: Option<usize>,
    /// The rows family's `BatchPrefill` in this run: a right-padded prefill (`prepare` / prepared windows /
    /// per-request `commit_prefill` / `finalize`, about a third of the runs) instead of a prefill cohort of equal
    /// chunks (drawn last from the stream, so the other choices are those of a stream without it).
    pub padded_prefill: bool,
}

/// A planned prefill chunk as a sibling delivers it: two forwards (halves, the second one larger when odd) when it
/// has at least 2 positions, else one. The chunk's boundary stays the planned one.
fn sibling_split(planned: usize) -> Vec<usize> {
    if planned >= 2 {
        vec![planned / 2, planned - planned / 2]
    } else {
        vec![planned]
    }
}

impl TransitionChoice {
    pub fn draw(cfg: &SimConfig) -> TransitionChoice {
        let mut rng = stream(cfg.payload_seed, Stream::Transition);
        let bits = cache::QUANT_BITS[rng.random_range(0..cache::QUANT_BITS.len())];
        let group = cache::QUANT_GROUPS[rng.random_range(0..cache::QUANT_GROUPS.len())];
        let dims: Vec<usize> = [32usize, 64, 128].into_iter().filter(|d| d % group == 0).collect();
        let head_dim = dims[rng.random_range(0..dims.len())];
        // A third of the runs put the boundary inside the first prompt (a prefill cohort crosses it), the rest
        // anywhere a schedule reaches.
        let start = match rng.random_range(0..20) {
            0..=2 => Some(0),
            3 => None,
            4..=10 => Some(rng.random_range(1..=cfg.max_prompt.max(2))),
            _ => Some(rng.random_range(1..=3 * cfg.max_prompt.max(4))),
        };
        let padded_prefill = rng.random_bool(0.35);
        TransitionChoice { bits, group, head_dim, start, padded_prefill }
    }
}

/// One request: its production lego per layer (outside the batch), its twins, its model (outside the batch).
struct Req {
    solo: Vec<Bf16FirstCache>,
    twin: Vec<Bf16FirstCache>,
    model: LegoModel,
}

/// The run's prefix-cache entry: the lego of a finished request (per layer), its twin and model.
struct Stored {
    lego: Vec<Bf16FirstCache>,
    twin: Vec<Bf16FirstCache>,
    model: LegoModel,
}

pub struct TransitionFamily {
    cfg: SimConfig,
    vs: ValueSpace,
    spec: KvSpec,
    t: Transition,
    ts: TransitionSpec,
    /// Every live request of the roster (`Cx::roster`), by id.
    reqs: BTreeMap<u32, Req>,
    /// The running batch, one per layer (`None` while no row runs).
    batch: Vec<Option<TransitioningKvRows>>,
    rows_model: RowsModel,
    stored: Option<Stored>,
    counters: Counters,
    /// The lego family (`legos.rs`): every request, in the batch or not, is a serial lego; no rows layout.
    legos: bool,
    /// `TransitionChoice::padded_prefill`.
    padded_prefill: bool,
    /// Coverage classes the current op reached through this family's state ([`Family::take_reached`]).
    reached: Vec<&'static str>,
    /// Some row of the running batch has held a column since the batch was last empty (checked after every op):
    /// `adopt` applies.
    rows_stored: bool,
}

fn mlx_fail(what: &str, e: impl std::fmt::Display) -> Failure {
    Failure::new("mlx", format!("{what}: {e}"))
}

fn unexpected(what: &str, e: CacheError) -> Failure {
    Failure::new("unexpected_error", format!("{what}: {e}"))
}

fn model_fail(what: &str, e: TransitionError) -> Failure {
    Failure::new("model", format!("{what}: {e}"))
}

fn bytes_of(a: &Array) -> Res<ArrayBytes> {
    ArrayBytes::of(a).map_err(|e| mlx_fail("read bytes", e))
}

fn planes_bytes(p: &[Array]) -> Res<Vec<ArrayBytes>> {
    p.iter().map(bytes_of).collect()
}

fn row_of(a: &Array, r: usize) -> Array {
    a.index((r as i32..r as i32 + 1, .., .., ..))
}

/// Whether a production error is the one the model predicts (same variant and fields where they exist in both).
fn same_error(got: &CacheError, want: &TransitionError) -> bool {
    match (got, want) {
        (CacheError::BelowFloor { prefix: a, floor: b }, TransitionError::BelowFloor { prefix: c, floor: d }) => {
            a == c && b == d
        }
        (
            CacheError::KeepTooLong { row: a, keep: b, written: c },
            TransitionError::KeepTooLong { row: d, keep: e, written: f },
        ) => (a, b, c) == (d, e, f),
        (CacheError::MixedPrecision { row: a }, TransitionError::MixedPrecision { row: b }) => a == b,
        (CacheError::NotTrimmable { .. }, TransitionError::Model(ModelError::NotTrimmable)) => true,
        (CacheError::NoSuchRow { row: a, .. }, TransitionError::Model(ModelError::NoSuchRow { row: b, .. })) => a == b,
        _ => false,
    }
}

impl TransitionFamily {
    pub fn new(cfg: &SimConfig, legos: bool) -> Res<TransitionFamily> {
        let choice = TransitionChoice::draw(cfg);
        let mut own = cfg.clone();
        own.head_dim = choice.head_dim;
        // bf16-first: the plain phase is bf16 (upstream's layouts are bf16 caches that convert).
        own.dtype = DtypeChoice::Bf16;
        let quant = QuantSpec { bits: choice.bits, group: choice.group };
        let t = Transition { start: choice.start, quant };
        let max_size = own.layout.max_size();
        let ts = TransitionSpec { max_size, start: choice.start, bits: choice.bits, group: choice.group };
        let rows_model = RowsModel::new(ts).map_err(|e| model_fail("setup", e))?;
        Ok(TransitionFamily {
            vs: own.value_space(),
            spec: own.kv_spec(),
            cfg: own,
            t,
            ts,
            reqs: BTreeMap::new(),
            batch: Vec::new(),
            rows_model,
            stored: None,
            counters: Counters::default(),
            legos,
            padded_prefill: choice.padded_prefill,
            reached: Vec::new(),
            rows_stored: false,
        })
    }

    fn max_size(&self) -> Option<usize> {
        self.cfg.layout.max_size()
    }

    fn rq(&self) -> RefQuant {
        RefQuant { bits: self.t.quant.bits, group: self.t.quant.group }
    }

    fn new_lego(&self) -> Res<Bf16FirstCache> {
        Bf16FirstCache::new(self.spec, self.max_size(), self.t).map_err(|e| Failure::new("setup", e.to_string()))
    }

    fn block(&self, layer: usize, tensor: Tensor, toks: &[Vec<Tok>]) -> Array {
        let opt: Vec<Vec<Option<Tok>>> = toks.iter().map(|r| r.iter().copied().map(Some).collect()).collect();
        let (data, s) = self.vs.block_f32(layer as u32, tensor, &opt);
        let h: Vec<half::bf16> = data.iter().map(|&x| half::bf16::from_f32(x)).collect();
        Array::from_slice(&h, &[s[0] as i32, s[1] as i32, s[2] as i32, s[3] as i32])
    }

    fn kvq(&self, layer: usize, toks: &[Vec<Tok>]) -> (Array, Array, Array) {
        (self.block(layer, Tensor::K, toks), self.block(layer, Tensor::V, toks), self.block(layer, Tensor::Q, toks))
    }

    fn toks_from(id: u32, offset: usize, n: usize) -> Vec<Tok> {
        (offset..offset + n).map(|p| Tok::new(id, p as u32)).collect()
    }
}

impl Family for TransitionFamily {
    fn key(&self) -> &'static str {
        match (self.legos, self.max_size()) {
            (false, None) => "kv:delayed-quant",
            (false, Some(_)) => "kv:delayed-rotating-quant",
            (true, None) => "kv:bf16-first-quant",
            (true, Some(_)) => "kv:bf16-first-rotating-quant",
        }
    }

    fn apply(&mut self, op: &Op, cx: &mut Cx<'_>) -> Res<bool> {
        if let Some(change) = cx.change {
            if self.legos {
                self.lego_carry_out(cx, change)?;
            } else {
                self.carry_out(cx, change)?;
            }
            return Ok(true);
        }
        if self.legos {
            return self.apply_legos(op, cx);
        }
        match op {
            // Lifecycle ops that change nothing were skipped by the roster, but for an extract of a missing row.
            Op::Admit { .. } | Op::Merge { .. } | Op::Join { .. } | Op::BatchPrefill { .. } | Op::Filter { .. } => {
                Ok(false)
            }
            Op::Extract { row, .. } => self.extract_missing(*row as usize),
            Op::SoloWindow { req, len } => self.solo_append(cx, *req, *len as usize, false),
            Op::SoloDecode { req } => self.solo_append(cx, *req, 1, true),
            Op::Decode => self.batch_read(cx, 1, true),
            Op::CompiledBatchStep => self.batch_step_compiled(cx),
            Op::CommitKnownSpans { lens } => self.commit_known_spans(cx, lens),
            Op::Window { len } => self.batch_read(cx, *len as usize, false),
            Op::Verify { gamma, accept } => self.verify(cx, *gamma as usize, accept),
            Op::CommitSpan { len } => self.commit_span(cx, *len as usize),
            Op::PrefixReuse { common, prompt, extra } => {
                self.prefix_reuse(cx, *common as usize, *prompt as usize, *extra as usize)
            }
            Op::PlainRead => self.plain_read(cx),
            Op::Fetch { len } => self.fetch(cx, *len as usize),
            Op::Persist { req, mlxlm } => self.persist(cx.roster, *req, *mlxlm),
            Op::Adopt { invalid } => self.adopt_rows(cx, *invalid),
            // The training kinds use their own stateless caches: every cache here must come out unchanged.
            Op::TrainingForward { .. } | Op::PrefixSharedForward { .. } | Op::TrainingRefusal { .. } => Ok(true),
            _ => Ok(false),
        }
    }

    fn check_state(&mut self, cx: &mut Cx<'_>) -> Res<()> {
        self.check_all(cx)
    }

    fn observe_state(&mut self, cx: &mut Cx<'_>) -> Res<()> {
        self.observe(cx)
    }

    fn position(&self, req: u32) -> Option<(usize, Option<usize>)> {
        self.reqs.get(&req).map(|r| (r.model.row.offset(), r.model.row.ring.last_concat))
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

mod adopt;
mod checks;
mod legos;
mod lifecycle;
mod observe;
mod persist;
mod prefill;
mod prefix;
mod reads;

#[cfg(test)]
mod tests;
