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
//! family never draw it: `SoloTrim`, `Trim`, `Append`, `ReadBlock`, `BidirPrefill`, `CompiledStep`, `Adopt`,
//! `DecodePhase`, `Prepare`, `IllFormed`, `Quantize`):
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
//! - `Persist { req, mlxlm }` (both modes): a request outside the batch (a transitioning row handed back
//!   to serial use, or a lego that never ran in the batch) saved in kvsim's format by its legos' own kind, dropped,
//!   and restored from the bytes alone; `check_all` then compares the restored legos with their twins (planes,
//!   lifecycle, floor, kind). With `mlxlm`, mlx-lm's form is first asked for and must be refused
//!   (`PersistError::Unsupported`: mlx-lm 0.32.2 has no class that converts at a boundary).

use std::collections::BTreeMap;

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;
use rand::Rng;
use serde::{Deserialize, Serialize};

use crate::sim::check::{self, Failure, OutClass};
use crate::sim::config::{DtypeChoice, SimConfig};
use crate::sim::family::{entering, join_permutation, Cx, Family, Registration, View};
use crate::sim::ops::{Op, OpKind};
use crate::sim::rng::{stream, Stream};
use crate::sim::summary::Counters;
use kvsim_cache::bytes::ArrayBytes;
use kvsim_cache::transition::{Bf16FirstCache, Transition, TransitioningKvRows};
use kvsim_cache::{self as cache, CacheError, KvSpec, Masks, QuantSpec};
use kvsim_reference::quant::{attention_f64_quantized, quantized_column, RefQuant};
use kvsim_reference::transition::{take, LegoModel, Precision, RowRead, RowsModel, TransitionError, TransitionSpec};
use kvsim_reference::{attention_f64, ModelError, Tensor, Tok, ValueSpace};

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
            | OpKind::PrefixReuse
            | OpKind::PlainRead
            | OpKind::Persist
    ) || k.is_training()
}

/// The lego family's name in `SimConfig::families`: the serial legos in their own right (`legos.rs`).
pub const LEGO_NAME: &str = "bf16-first";

/// What the serial legos can be asked: the rows' ops (the running batch is a set of serial legos, one call each)
/// and the serial trims.
pub fn supports_legos(k: OpKind) -> bool {
    supports(k) || matches!(k, OpKind::SoloTrim | OpKind::Trim)
}

/// The bf16-first family, in about a quarter of the runs.
pub const REGISTRATION: Registration = Registration {
    name: NAME,
    supports,
    swarm_probability: 0.25,
    owns: OpKind::is_transition,
    draw_params: None,
    weights_from_params: |_| Vec::new(),
    draws_op: None,
    build: |cfg| Ok(Box::new(TransitionFamily::new(cfg, false)?)),
};

/// The serial legos as a family of their own (`kv:bf16-first-quant`, `kv:bf16-first-rotating-quant`), in about a
/// fifth of the runs.
pub const LEGO_REGISTRATION: Registration = Registration {
    name: LEGO_NAME,
    supports: supports_legos,
    swarm_probability: 0.2,
    owns: OpKind::is_transition,
    draw_params: None,
    weights_from_params: |_| Vec::new(),
    draws_op: None,
    build: |cfg| Ok(Box::new(TransitionFamily::new(cfg, true)?)),
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
        let start = match rng.random_range(0..20) {
            0..=2 => Some(0),
            3 => None,
            _ => Some(rng.random_range(1..=3 * cfg.max_prompt.max(4))),
        };
        let padded_prefill = rng.random_bool(0.35);
        TransitionChoice { bits, group, head_dim, start, padded_prefill }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Home {
    Solo,
    Batch,
}

/// One request: its production lego per layer (outside the batch), its twins, its model (outside the batch).
struct Req {
    home: Home,
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
    reqs: BTreeMap<u32, Req>,
    rows: Vec<u32>,
    /// The running batch, one per layer (`None` while no row runs).
    batch: Vec<Option<TransitioningKvRows>>,
    rows_model: RowsModel,
    stored: Option<Stored>,
    next_id: u32,
    counters: Counters,
    /// The lego family (`legos.rs`): every request, in the batch or not, is a serial lego; no rows layout.
    legos: bool,
    /// `TransitionChoice::padded_prefill`.
    padded_prefill: bool,
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

/// Saves a request's legos (one per layer) in kvsim's format, each with a reuse floor attached (half its offset),
/// drops them, and restores them from the bytes alone (`family::persist_through_bytes`: floors and kinds must come
/// back). With `via_mlxlm`, mlx-lm's form of every lego must first be refused as unsupported (and nothing is written
/// in that format).
fn persist_legos(legos: Vec<Bf16FirstCache>, via_mlxlm: bool) -> Res<Vec<Bf16FirstCache>> {
    use kvsim_persist::inspect::Format;
    use kvsim_persist::{mlxlm, AnyCache, PersistError, Persisted};
    let persisted: Vec<Persisted> = legos
        .into_iter()
        .map(|c| Persisted { minimum_reusable_offset: c.offset() / 2, cache: AnyCache::Bf16First(c) })
        .collect();
    if via_mlxlm {
        for p in &persisted {
            match mlxlm::from_kvsim(&p.cache) {
                Err(PersistError::Unsupported { .. }) => {}
                other => {
                    return Err(Failure::new(
                        "persist",
                        format!("mlx-lm form of {}: {:?}, expected Unsupported", p.cache.storage_kind(), other.err()),
                    ))
                }
            }
        }
    }
    crate::sim::family::persist_through_bytes(persisted, Format::Kvsim)?
        .into_iter()
        .map(|c| match c {
            AnyCache::Bf16First(c) => Ok(c),
            other => Err(Failure::new("persist", format!("restored as {}", other.storage_kind()))),
        })
        .collect()
}

impl TransitionFamily {
    /// `Persist { req, mlxlm }`: a request outside the batch through a save and a restore (`persist_legos`).
    fn persist(&mut self, req: u32, mlxlm: bool) -> Res<bool> {
        if !self.solo_req(req) {
            return Ok(false);
        }
        let r = self.reqs.get_mut(&req).unwrap();
        let legos = std::mem::take(&mut r.solo);
        r.solo = persist_legos(legos, mlxlm)?;
        self.counters.persist_roundtrips += 1;
        Ok(true)
    }

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
            rows: Vec::new(),
            batch: Vec::new(),
            rows_model,
            stored: None,
            next_id: 0,
            counters: Counters::default(),
            legos,
            padded_prefill: choice.padded_prefill,
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

    fn solo_req(&self, req: u32) -> bool {
        self.reqs.get(&req).is_some_and(|r| r.home == Home::Solo)
    }

    fn toks_from(id: u32, offset: usize, n: usize) -> Vec<Tok> {
        (offset..offset + n).map(|p| Tok::new(id, p as u32)).collect()
    }

    /// One read's real queries against the f64 model over what the model says each query sees (bf16 values, or
    /// the dequantized affine ones).
    fn read_vs_model(&mut self, layer: usize, out: &ArrayBytes, row: usize, q0: &[Tok], read: &RowRead) -> Res<()> {
        let (hq, l, d) = (out.shape[1] as usize, out.shape[2] as usize, out.shape[3] as usize);
        let scale = self.cfg.scale() as f64;
        for (i, keys) in read.queries.iter().enumerate() {
            let q = q0[i];
            let (expected, mut bound) = match read.precision {
                Precision::Bf16 => (attention_f64(&self.vs, layer as u32, q, keys, scale), BF16_READ_BOUND),
                Precision::Affine => {
                    (attention_f64_quantized(&self.vs, layer as u32, q, keys, scale, self.rq()), AFFINE_READ_BOUND)
                }
            };
            if self.counters.guarantees.gpu {
                // A GPU's kernels round differently (`check::model_bound`): four times the CPU's measured bound.
                bound *= 4.0;
            }
            let mut worst = 0f64;
            for h in 0..hq {
                for k in 0..d {
                    let found = check::value_of(out.dtype, out.words.get(((row * hq + h) * l + i) * d + k));
                    let e = expected[h * d + k];
                    if !found.is_finite() || !e.is_finite() {
                        return Err(Failure::new("nan", format!("row {row} query {i}: output {found}, model {e}")));
                    }
                    worst = worst.max((found - e).abs() / check::ulp_at(out.dtype, e));
                }
            }
            self.counters.record_model_ulp(out.dtype, worst);
            let tag =
                if read.precision == Precision::Affine { "transition_affine_model" } else { "transition_bf16_model" };
            let e = self.counters.table.entry(format!("{tag}/bf16")).or_default();
            e.compared += 1;
            e.max_ulp = e.max_ulp.max(worst.ceil() as u64);
            self.counters.checks += 1;
            if worst > bound {
                return Err(Failure::new(
                    "output_vs_model",
                    format!(
                        "row {row} query {i} ({q:?}, {:?}): {worst:.1} ULPs from the f64 model over {} keys (bound {bound})",
                        read.precision,
                        keys.len()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// One row's read against its twin's: byte-identical while the row is a serial cache of its own (unpacked) and
    /// for unpadded packed decodes (CPU); measured otherwise.
    #[allow(clippy::too_many_arguments)]
    fn read_vs_twin(
        &mut self,
        out: &ArrayBytes,
        row: usize,
        twin: &ArrayBytes,
        n: usize,
        decode: bool,
        packed: bool,
        equal_lens: bool,
    ) -> Res<()> {
        let class = match (decode, !packed || equal_lens) {
            (true, true) => OutClass::DecodeUnpadded,
            (true, false) => OutClass::DecodePadded,
            (false, _) => OutClass::Window,
        };
        let tags: &[&'static str] = if packed { &["transition_packed"] } else { &["transition_rows"] };
        let before = self.counters.table.get(&format!("{}/bf16", tags[0])).map_or(0, |c| c.compared - c.bit_exact);
        check::output_vs_twin(class, tags, out, row, twin, n, &mut self.counters)?;
        let after = self.counters.table.get(&format!("{}/bf16", tags[0])).map_or(0, |c| c.compared - c.bit_exact);
        if !packed && after > before {
            return Err(Failure::new(
                "read_vs_lego",
                format!("row {row}: an unpacked row's read differs from its lego twin's (a row is a serial cache)"),
            ));
        }
        Ok(())
    }

    // ----- solo requests (legos) ----------------------------------------------------------------------------

    fn admit(&mut self, req: u32) -> Res<bool> {
        if self.reqs.contains_key(&req) || req < self.next_id {
            return Ok(false);
        }
        let layers = self.cfg.layers;
        let solo = (0..layers).map(|_| self.new_lego()).collect::<Res<Vec<_>>>()?;
        let twin = (0..layers).map(|_| self.new_lego()).collect::<Res<Vec<_>>>()?;
        let model = LegoModel::new(self.ts).map_err(|e| model_fail("lego", e))?;
        self.reqs.insert(req, Req { home: Home::Solo, solo, twin, model });
        self.next_id = req + 1;
        Ok(true)
    }

    /// A window (or decode) on a request outside the batch: lego, twin and model, reads checked.
    fn solo_append(&mut self, cx: &mut Cx<'_>, req: u32, len: usize, decode: bool) -> Res<bool> {
        if !self.solo_req(req) || len == 0 {
            return Ok(false);
        }
        self.lego_append(cx, req, len, decode)?;
        Ok(true)
    }

    /// A window (or decode) on request `req`'s lego (outside the batch, or a row of the lego family's batch), its
    /// twin and model: reads against the model (f64) and the twin (bytes), conversion against the model's.
    fn lego_append(&mut self, cx: &mut Cx<'_>, req: u32, len: usize, decode: bool) -> Res<()> {
        let mut model = self.reqs[&req].model.clone();
        let toks = Self::toks_from(req, model.row.offset(), len);
        let (read, converted) = model.append(&toks, decode).map_err(|e| model_fail("lego append", e))?;
        let scale = self.cfg.scale();
        let masks = Masks::new();
        for layer in 0..self.cfg.layers {
            let (k, v, q) = self.kvq(layer, std::slice::from_ref(&toks));
            let r = self.reqs.get_mut(&req).unwrap();
            let before = r.solo[layer].converted_at();
            let (out, _) = if decode {
                r.solo[layer].decode(&k, &v, &q, scale, &masks)
            } else {
                r.solo[layer].window(&k, &v, &q, scale, &masks)
            }
            .map_err(|e| unexpected("lego read", e))?;
            let (tw, _) = if decode {
                r.twin[layer].decode(&k, &v, &q, scale, &masks)
            } else {
                r.twin[layer].window(&k, &v, &q, scale, &masks)
            }
            .map_err(|e| unexpected("twin read", e))?;
            let did = before.is_none() && r.solo[layer].converted_at().is_some();
            check::flag("lego conversion vs the model", did, converted)?;
            let (ob, tb) = (bytes_of(&out)?, bytes_of(&tw)?);
            cx.hasher.update(&ob.digest());
            self.read_vs_model(layer, &ob, 0, &toks, &read)?;
            self.read_vs_twin(&ob, 0, &tb, len, decode, false, true)?;
            if did {
                self.counters.conversions += 1;
            }
        }
        self.reqs.get_mut(&req).unwrap().model = model;
        Ok(())
    }

    // ----- the running batch ----------------------------------------------------------------------------------

    /// A twin rewritten in temporal order as a merge of several rows rewrites each row (its newest
    /// `min(offset, W)` positions), through the same public merge: two copies of the twin merged, the first handed
    /// back.
    fn relayout_twin(&self, twin: &Bf16FirstCache) -> Res<Bf16FirstCache> {
        let pair = TransitioningKvRows::merge(self.spec, self.max_size(), self.t, vec![twin.clone(), twin.clone()])
            .map_err(|e| unexpected("twin relayout merge", e))?;
        pair.extract(0).map_err(|e| unexpected("twin relayout extract", e))
    }

    /// A converted twin de-rolled as a packed layout hands a row back (every live column, temporal order): the
    /// twin alone merged (it packs, keeping its columns and phase) and handed back.
    fn deroll_twin(&self, twin: &Bf16FirstCache) -> Res<Bf16FirstCache> {
        let one = TransitioningKvRows::merge(self.spec, self.max_size(), self.t, vec![twin.clone()])
            .map_err(|e| unexpected("twin de-roll merge", e))?;
        check::flag("a converted twin packs alone", one.is_packed(), true)?;
        one.extract(0).map_err(|e| unexpected("twin de-roll extract", e))
    }

    /// Rows `ids` (requests outside the batch) enter it: every running row is handed back to its lego and merged
    /// with theirs (`Merge` and `Join` alike: the rows layout has one merge), the running rows listed in `order`
    /// (empty: identity; anything but a permutation of the rows skips the op, as in the attention family).
    fn enter(&mut self, reqs: &[u32], order: &[u32]) -> Res<bool> {
        let Some(perm) = join_permutation(order, self.rows.len()) else {
            return Ok(false);
        };
        let ids = entering(reqs, |r| self.solo_req(r));
        if ids.is_empty() {
            return Ok(false);
        }
        if perm.iter().enumerate().any(|(i, &r)| i != r) {
            // The running rows reordered first (a filter keeping every row in that order).
            self.filter_rows(&perm)?;
        }
        self.enter_ids(&ids)?;
        Ok(true)
    }

    fn enter_ids(&mut self, ids: &[u32]) -> Res<()> {
        let n_old = self.rows.len();
        let total = n_old + ids.len();
        for layer in 0..self.cfg.layers {
            let mut legos = Vec::with_capacity(total);
            if let Some(b) = &self.batch.get(layer).and_then(|b| b.as_ref()) {
                for i in 0..n_old {
                    legos.push(b.extract(i).map_err(|e| unexpected("extract for merge", e))?);
                }
            }
            for id in ids {
                legos.push(self.reqs[id].solo[layer].clone());
            }
            let merged = TransitioningKvRows::merge(self.spec, self.max_size(), self.t, legos)
                .map_err(|e| unexpected("merge", e))?;
            if self.batch.len() <= layer {
                self.batch.push(Some(merged));
            } else {
                self.batch[layer] = Some(merged);
            }
        }
        let mut sources = Vec::with_capacity(total);
        for i in 0..n_old {
            sources.push(self.rows_model.extract(i).map_err(|e| model_fail("extract for merge", e))?.row);
        }
        for id in ids {
            sources.push(self.reqs[id].model.row.clone());
        }
        self.rows_model = RowsModel::merge(self.ts, sources).map_err(|e| model_fail("merge", e))?;
        for id in ids {
            let r = self.reqs.get_mut(id).unwrap();
            r.home = Home::Batch;
            r.solo.clear();
            self.rows.push(*id);
        }
        if total > 1 {
            for i in 0..self.rows.len() {
                let id = self.rows[i];
                for layer in 0..self.cfg.layers {
                    let t = self.relayout_twin(&self.reqs[&id].twin[layer])?;
                    self.reqs.get_mut(&id).unwrap().twin[layer] = t;
                }
            }
        }
        Ok(())
    }

    fn batch_rows(&self, layer: usize) -> Res<&TransitioningKvRows> {
        self.batch.get(layer).and_then(|b| b.as_ref()).ok_or_else(|| Failure::new("state", "no running batch"))
    }

    fn batch_mut(&mut self, layer: usize) -> Res<&mut TransitioningKvRows> {
        self.batch.get_mut(layer).and_then(|b| b.as_mut()).ok_or_else(|| Failure::new("state", "no running batch"))
    }

    /// One forward of `toks[r]` per row (equal lengths) on the running batch, twins fed the same blocks. Returns
    /// the rows that converted (checked against the model's).
    fn forward(&mut self, cx: &mut Cx<'_>, len: usize, decode: bool) -> Res<Vec<usize>> {
        let n = self.rows.len();
        let toks: Vec<Vec<Tok>> =
            (0..n).map(|r| Self::toks_from(self.rows[r], self.rows_model.rows[r].offset(), len)).collect();
        let (reads, mconv) = self.rows_model.append(&toks, decode).map_err(|e| model_fail("rows append", e))?;
        let scale = self.cfg.scale();
        let masks = Masks::new();
        let mut converted = Vec::new();
        for layer in 0..self.cfg.layers {
            let (k, v, q) = self.kvq(layer, &toks);
            let (out, conv) = {
                let b = self.batch_mut(layer)?;
                if decode { b.decode(&k, &v, &q, scale, &masks) } else { b.window(&k, &v, &q, scale, &masks) }
                    .map_err(|e| unexpected("rows read", e))?
            };
            if conv != mconv {
                return Err(Failure::new("conversion", format!("rows converted {conv:?}, the model says {mconv:?}")));
            }
            self.counters.conversions += conv.len() as u64;
            let packed_before_read = self.read_packed_before(layer, &conv);
            let lens_equal = {
                let lens: Vec<usize> = self.reqs_len_before(&toks, len);
                lens.iter().all(|&x| x == lens[0])
            };
            let ob = bytes_of(&out)?;
            cx.hasher.update(&ob.digest());
            for r in 0..n {
                let id = self.rows[r];
                let (kr, vr, qr) = (row_of(&k, r), row_of(&v, r), row_of(&q, r));
                let twin = &mut self.reqs.get_mut(&id).unwrap().twin[layer];
                let (tw, _) = if decode {
                    twin.decode(&kr, &vr, &qr, scale, &masks)
                } else {
                    twin.window(&kr, &vr, &qr, scale, &masks)
                }
                .map_err(|e| unexpected("twin read", e))?;
                let tb = bytes_of(&tw)?;
                self.read_vs_model(layer, &ob, r, &toks[r], &reads[r])?;
                self.read_vs_twin(&ob, r, &tb, len, decode, packed_before_read, lens_equal)?;
            }
            converted = conv;
        }
        Ok(converted)
    }

    /// Whether the batch was packed when it read (it packs only at a boundary after the read: when rows converted
    /// in this very call, the read ran on the unpacked rows).
    fn read_packed_before(&self, layer: usize, conv: &[usize]) -> bool {
        self.batch_rows(layer).is_ok_and(|b| b.is_packed()) && conv.is_empty()
    }

    /// Live column counts of the rows when they read (the model after the append).
    fn reqs_len_before(&self, _toks: &[Vec<Tok>], _len: usize) -> Vec<usize> {
        self.rows_model.rows.iter().map(|r| r.ring.len()).collect()
    }

    fn batch_read(&mut self, cx: &mut Cx<'_>, len: usize, decode: bool) -> Res<bool> {
        if self.rows.is_empty() || len == 0 {
            return Ok(false);
        }
        self.forward(cx, len, decode)?;
        Ok(true)
    }

    /// A committed span on the running batch: `TransitioningKvRows::commit_span`, one decode per
    /// position. Each position's read against the model (its own precision: a row converts between the span's
    /// positions when its transition comes due) and against the twin's ordinary decode of that position (bytes);
    /// the rows converted, in order, against the model's.
    fn commit_span(&mut self, cx: &mut Cx<'_>, len: usize) -> Res<bool> {
        if self.rows.is_empty() || len == 0 {
            return Ok(false);
        }
        let n = self.rows.len();
        let toks: Vec<Vec<Tok>> =
            (0..n).map(|r| Self::toks_from(self.rows[r], self.rows_model.rows[r].offset(), len)).collect();
        // The model: one decode per position; whether the batch was packed when each position read, and whether
        // the rows then held equal live lengths.
        let mut model = self.rows_model.clone();
        let mut steps = Vec::with_capacity(len);
        let mut mconv = Vec::new();
        for i in 0..len {
            let packed = model.packed;
            let col: Vec<Vec<Tok>> = toks.iter().map(|t| vec![t[i]]).collect();
            let (reads, c) = model.append(&col, true).map_err(|e| model_fail("rows span", e))?;
            let lens: Vec<usize> = model.rows.iter().map(|r| r.ring.len()).collect();
            steps.push((reads, packed, lens.iter().all(|&x| x == lens[0])));
            mconv.extend(c);
        }
        let scale = self.cfg.scale();
        let masks = Masks::new();
        for layer in 0..self.cfg.layers {
            let (k, v, q) = self.kvq(layer, &toks);
            let (out, conv) = self
                .batch_mut(layer)?
                .commit_span(&k, &v, &q, scale, &masks)
                .map_err(|e| unexpected("rows commit_span", e))?;
            if conv != mconv {
                return Err(Failure::new("conversion", format!("span converted {conv:?}, the model says {mconv:?}")));
            }
            self.counters.conversions += conv.len() as u64;
            for (i, (reads, packed, equal)) in steps.iter().enumerate() {
                let i32_ = i as i32;
                let ob = bytes_of(&out.index((.., .., i32_..i32_ + 1, ..)))?;
                cx.hasher.update(&ob.digest());
                for r in 0..n {
                    let id = self.rows[r];
                    let c = |a: &Array| row_of(a, r).index((.., .., i32_..i32_ + 1, ..));
                    let twin = &mut self.reqs.get_mut(&id).unwrap().twin[layer];
                    let (tw, _) =
                        twin.decode(&c(&k), &c(&v), &c(&q), scale, &masks).map_err(|e| unexpected("twin decode", e))?;
                    let tb = bytes_of(&tw)?;
                    self.read_vs_model(layer, &ob, r, &toks[r][i..i + 1], &reads[r])?;
                    self.read_vs_twin(&ob, r, &tb, 1, true, *packed, *equal)?;
                }
            }
        }
        self.rows_model = model;
        Ok(true)
    }

    /// A speculative round (module docs).
    fn verify(&mut self, cx: &mut Cx<'_>, gamma: usize, accept: &[u32]) -> Res<bool> {
        if self.rows.is_empty() || gamma == 0 {
            return Ok(false);
        }
        let n = self.rows.len();
        for layer in 0..self.cfg.layers {
            self.batch_mut(layer)?.round_begin().map_err(|e| unexpected("round_begin", e))?;
            for &id in &self.rows.clone() {
                self.reqs.get_mut(&id).unwrap().twin[layer].round_begin().map_err(|e| unexpected("twin round", e))?;
            }
        }
        self.rows_model.round_begin().map_err(|e| model_fail("round_begin", e))?;
        let conv = self.forward(cx, gamma, false)?;
        if !conv.is_empty() {
            return Err(Failure::new("conversion", format!("rows {conv:?} converted inside an armed round")));
        }
        let keep: Vec<usize> =
            (0..n).map(|r| (accept.get(r).copied().unwrap_or(gamma as u32) as usize).min(gamma)).collect();
        // Bad input first: row 0 keeps more than the round wrote; refused, nothing changed.
        let mut bad = keep.clone();
        bad[0] = gamma + 1;
        let want = self.rows_model.round_rollback(&bad).err();
        let Some(want) = want else {
            return Err(Failure::new("model", "the model accepted a rollback keeping more than the round wrote"));
        };
        for layer in 0..self.cfg.layers {
            let b = self.batch_mut(layer)?;
            let before = (b.offsets(), b.lifecycle().to_vec());
            match b.round_rollback(&bad) {
                Err(e) if same_error(&e, &want) => {}
                other => {
                    return Err(Failure::new(
                        "errors",
                        format!("rollback keeping {bad:?}: expected {want}, got {:?}", other.map(|_| ())),
                    ))
                }
            }
            check::flag(
                "state unchanged after a refused rollback",
                (b.offsets(), b.lifecycle().to_vec()) == before,
                true,
            )?;
            self.counters.expected_errors += 1;
        }
        let offsets_after: Vec<usize> = self.rows_model.rows.iter().map(|r| r.offset()).collect();
        let commit = keep.iter().all(|&k| k == gamma);
        let mconv = if commit {
            self.rows_model.round_commit().map_err(|e| model_fail("round_commit", e))?
        } else {
            self.rows_model.round_rollback(&keep).map_err(|e| model_fail("round_rollback", e))?.1
        };
        for layer in 0..self.cfg.layers {
            let got = if commit {
                self.batch_mut(layer)?.round_commit().map_err(|e| unexpected("round_commit", e))?
            } else {
                self.batch_mut(layer)?.round_rollback(&keep).map_err(|e| unexpected("round_rollback", e))?.1
            };
            if got != mconv {
                return Err(Failure::new("conversion", format!("round end converted {got:?}, model {mconv:?}")));
            }
            for (r, &id) in self.rows.clone().iter().enumerate() {
                let twin = &mut self.reqs.get_mut(&id).unwrap().twin[layer];
                let did = if commit { twin.round_commit() } else { twin.round_rollback(keep[r]) }
                    .map_err(|e| unexpected("twin round end", e))?;
                check::flag("twin conversion at the round's end", did, mconv.contains(&r))?;
            }
        }
        self.counters.conversions += (mconv.len() * self.cfg.layers) as u64;
        if !commit && keep.iter().any(|&k| k != keep[0]) {
            self.counters.rounds += 1;
        }
        if let Some(w) = self.max_size() {
            if !commit && (0..n).any(|r| keep[r] < gamma && offsets_after[r] > w) {
                self.counters.rollbacks_across_wrap += 1;
            }
        }
        Ok(true)
    }

    /// Fresh requests prefilled as a cohort (module docs).
    fn batch_prefill(&mut self, cx: &mut Cx<'_>, reqs: &[u32], lengths: &[u32], chunk: usize) -> Res<bool> {
        let mut ids: Vec<u32> = vec![];
        let mut lens: Vec<usize> = vec![];
        for (i, &r) in reqs.iter().enumerate() {
            let fresh = self.reqs.get(&r).is_some_and(|q| q.home == Home::Solo && q.model.row.offset() == 0);
            if fresh && !ids.contains(&r) {
                ids.push(r);
                lens.push(lengths.get(i).copied().unwrap_or(1).max(1) as usize);
            }
        }
        if ids.is_empty() || chunk == 0 {
            return Ok(false);
        }
        if self.padded_prefill {
            return self.batch_prefill_padded(cx, &ids, &lens, chunk);
        }
        let n = ids.len();
        let common = *lens.iter().min().unwrap();
        let scale = self.cfg.scale();
        let mut cohort = Vec::with_capacity(self.cfg.layers);
        for layer in 0..self.cfg.layers {
            let legos: Vec<Bf16FirstCache> = ids.iter().map(|id| self.reqs[id].solo[layer].clone()).collect();
            let mut c = TransitioningKvRows::merge(self.spec, self.max_size(), self.t, legos)
                .map_err(|e| unexpected("cohort merge", e))?;
            c.begin_prefill().map_err(|e| unexpected("begin_prefill", e))?;
            cohort.push(c);
        }
        let sources = ids.iter().map(|id| self.reqs[id].model.row.clone()).collect();
        let mut model = RowsModel::merge(self.ts, sources).map_err(|e| model_fail("cohort merge", e))?;
        model.begin_prefill().map_err(|e| model_fail("begin_prefill", e))?;
        let mut done = 0;
        while done < common {
            let planned = chunk.min(common - done);
            let parts = sibling_split(planned);
            for layer in 0..self.cfg.layers {
                for &id in &ids {
                    let twin = &mut self.reqs.get_mut(&id).unwrap().twin[layer];
                    twin.round_begin().map_err(|e| unexpected("twin chunk", e))?;
                }
            }
            for &l in &parts {
                let toks: Vec<Vec<Tok>> = (0..n).map(|r| Self::toks_from(ids[r], model.rows[r].offset(), l)).collect();
                let (reads, mconv) = model.append(&toks, false).map_err(|e| model_fail("cohort append", e))?;
                if !mconv.is_empty() {
                    return Err(Failure::new("model", "the model converted inside a prefill chunk"));
                }
                let masks = Masks::new();
                for layer in 0..self.cfg.layers {
                    let (k, v, q) = self.kvq(layer, &toks);
                    let packed = cohort[layer].is_packed();
                    let (out, conv) =
                        cohort[layer].window(&k, &v, &q, scale, &masks).map_err(|e| unexpected("cohort read", e))?;
                    if !conv.is_empty() {
                        return Err(Failure::new(
                            "conversion",
                            format!("rows {conv:?} converted inside a prefill chunk"),
                        ));
                    }
                    let ob = bytes_of(&out)?;
                    cx.hasher.update(&ob.digest());
                    for r in 0..n {
                        let twin = &mut self.reqs.get_mut(&ids[r]).unwrap().twin[layer];
                        let (tw, _) = twin
                            .window(&row_of(&k, r), &row_of(&v, r), &row_of(&q, r), scale, &masks)
                            .map_err(|e| unexpected("twin chunk read", e))?;
                        let tb = bytes_of(&tw)?;
                        self.read_vs_model(layer, &ob, r, &toks[r], &reads[r])?;
                        self.read_vs_twin(&ob, r, &tb, l, false, packed, false)?;
                    }
                }
            }
            // Each request commits its own chunk boundary.
            for r in 0..n {
                let mconv = model.commit_prefill(&[r]).map_err(|e| model_fail("commit_prefill", e))?;
                for layer in 0..self.cfg.layers {
                    let got = cohort[layer].commit_prefill(&[r]).map_err(|e| unexpected("commit_prefill", e))?;
                    if got != mconv {
                        return Err(Failure::new("conversion", format!("commit of row {r}: {got:?}, model {mconv:?}")));
                    }
                    let twin = &mut self.reqs.get_mut(&ids[r]).unwrap().twin[layer];
                    let did = twin.round_commit().map_err(|e| unexpected("twin chunk commit", e))?;
                    check::flag("twin conversion at the chunk's commit", did, !mconv.is_empty())?;
                }
                self.counters.conversions += (mconv.len() * self.cfg.layers) as u64;
                self.counters.prefill_conversions += (mconv.len() * self.cfg.layers) as u64;
            }
            done += planned;
        }
        model.end_prefill().map_err(|e| model_fail("end_prefill", e))?;
        for c in cohort.iter_mut() {
            c.end_prefill().map_err(|e| unexpected("end_prefill", e))?;
        }
        self.hand_back_cohort(&cohort, &model, &ids)?;
        self.check_all(cx)?;
        // The longer requests' tails: solo lego windows.
        for (r, id) in ids.iter().enumerate() {
            if lens[r] > common {
                self.solo_append(cx, *id, lens[r] - common, false)?;
            }
        }
        self.enter_ids(&ids)?;
        Ok(true)
    }

    /// `BatchPrefill` as a right-padded prefill: the fresh requests' legos merged into a cohort,
    /// `prepare(lengths)`, then windows of `chunk` positions each delivered as two forwards (a sibling's split) until
    /// the longest prompt is in; row `r` stores only its next `min(pending_r, L)` real positions of each window. A
    /// request commits (`commit_prefill`) at the end of the planned chunk where its prompt ends, except those ending
    /// in the last chunk, which `finalize` commits; nothing converts before its request commits. Twins: legos fed
    /// each row's real positions inside a lego round committed at the same point. Then the cohort enters the batch.
    fn batch_prefill_padded(&mut self, cx: &mut Cx<'_>, ids: &[u32], lens: &[usize], chunk: usize) -> Res<bool> {
        let n = ids.len();
        let longest = *lens.iter().max().unwrap();
        let scale = self.cfg.scale();
        let mut cohort = Vec::with_capacity(self.cfg.layers);
        for layer in 0..self.cfg.layers {
            let legos: Vec<Bf16FirstCache> = ids.iter().map(|id| self.reqs[id].solo[layer].clone()).collect();
            let mut c = TransitioningKvRows::merge(self.spec, self.max_size(), self.t, legos)
                .map_err(|e| unexpected("cohort merge", e))?;
            c.prepare(lens).map_err(|e| unexpected("prepare", e))?;
            cohort.push(c);
        }
        let sources = ids.iter().map(|id| self.reqs[id].model.row.clone()).collect();
        let mut model = RowsModel::merge(self.ts, sources).map_err(|e| model_fail("cohort merge", e))?;
        model.prepare(lens).map_err(|e| model_fail("prepare", e))?;
        for layer in 0..self.cfg.layers {
            for id in ids {
                let twin = &mut self.reqs.get_mut(id).unwrap().twin[layer];
                twin.round_begin().map_err(|e| unexpected("twin prefill", e))?;
            }
        }
        let mut done = 0;
        let mut committed = vec![false; n];
        while done < longest {
            let planned = chunk.min(longest - done);
            let parts = sibling_split(planned);
            for &l in &parts {
                let pending: Vec<usize> = model.pending.clone().unwrap_or_default();
                let toks: Vec<Vec<Tok>> = (0..n).map(|r| Self::toks_from(ids[r], model.rows[r].offset(), l)).collect();
                let (reads, mconv) = model.append(&toks, false).map_err(|e| model_fail("prepared window", e))?;
                if !mconv.is_empty() {
                    return Err(Failure::new("model", "the model converted at a prepared window"));
                }
                let masks = Masks::new();
                for layer in 0..self.cfg.layers {
                    let (k, v, q) = self.kvq(layer, &toks);
                    let packed = cohort[layer].is_packed();
                    let (out, conv) = cohort[layer]
                        .window(&k, &v, &q, scale, &masks)
                        .map_err(|e| unexpected("prepared window", e))?;
                    if !conv.is_empty() {
                        return Err(Failure::new(
                            "conversion",
                            format!("rows {conv:?} converted at a prepared window"),
                        ));
                    }
                    let ob = bytes_of(&out)?;
                    cx.hasher.update(&ob.digest());
                    for r in 0..n {
                        let real = pending[r].min(l);
                        if real == 0 {
                            continue;
                        }
                        let c = |a: &Array| a.index((r as i32..r as i32 + 1, .., 0..real as i32, ..));
                        let twin = &mut self.reqs.get_mut(&ids[r]).unwrap().twin[layer];
                        let (tw, _) = twin
                            .window(&c(&k), &c(&v), &c(&q), scale, &masks)
                            .map_err(|e| unexpected("twin prefill read", e))?;
                        let tb = bytes_of(&tw)?;
                        self.read_vs_model(layer, &ob, r, &toks[r], &reads[r])?;
                        self.read_vs_twin(&ob, r, &tb, real, false, packed, false)?;
                    }
                }
            }
            done += planned;
            // The requests whose prompt ended in this chunk commit (those of the last chunk: `finalize`).
            if done < longest {
                for r in 0..n {
                    if !committed[r] && lens[r] <= done {
                        committed[r] = true;
                        let mconv = model.commit_prefill(&[r]).map_err(|e| model_fail("commit_prefill", e))?;
                        self.commit_padded_row(&mut cohort, ids, r, &mconv, Some(r))?;
                    }
                }
            }
        }
        let mconv = model.finalize().map_err(|e| model_fail("finalize", e))?;
        let mut got = None;
        for c in cohort.iter_mut() {
            let conv = c.finalize().map_err(|e| unexpected("finalize", e))?;
            if *got.get_or_insert_with(|| conv.clone()) != conv || conv != mconv {
                return Err(Failure::new("conversion", format!("finalize converted {conv:?}, model {mconv:?}")));
            }
        }
        for r in (0..n).filter(|&r| !committed[r]) {
            self.commit_padded_row(&mut cohort, ids, r, &mconv, None)?;
        }
        self.hand_back_cohort(&cohort, &model, ids)?;
        self.counters.prepared_prefills += 1;
        self.check_all(cx)?;
        self.enter_ids(ids)?;
        Ok(true)
    }

    /// A prefill cohort's rows go back to serial use: each request's lego of every layer and its model row, and, when
    /// a cohort of several rows packed (it hands its rows back de-rolled to temporal order), its twins de-rolled too.
    fn hand_back_cohort(&mut self, cohort: &[TransitioningKvRows], model: &RowsModel, ids: &[u32]) -> Res<()> {
        for (layer, c) in cohort.iter().enumerate() {
            for (r, id) in ids.iter().enumerate() {
                let lego = c.extract(r).map_err(|e| unexpected("cohort extract", e))?;
                self.reqs.get_mut(id).unwrap().solo[layer] = lego;
            }
        }
        let packed = ids.len() > 1 && cohort.first().is_some_and(|c| c.is_packed());
        for (r, id) in ids.iter().enumerate() {
            let m = model.extract(r).map_err(|e| model_fail("cohort extract", e))?;
            self.reqs.get_mut(id).unwrap().model = m;
            if packed {
                for layer in 0..self.cfg.layers {
                    let t = self.deroll_twin(&self.reqs[id].twin[layer])?;
                    self.reqs.get_mut(id).unwrap().twin[layer] = t;
                }
            }
        }
        Ok(())
    }

    /// One request of a right-padded prefill commits: `commit` `Some(r)` calls `commit_prefill(&[r])` on every
    /// layer's cohort (which must convert what the model's `mconv` says), `None` means `finalize` already did; the
    /// row's twins end their lego round, converting exactly when the model converted the row.
    fn commit_padded_row(
        &mut self,
        cohort: &mut [TransitioningKvRows],
        ids: &[u32],
        r: usize,
        mconv: &[usize],
        commit: Option<usize>,
    ) -> Res<()> {
        let converts = mconv.contains(&r);
        for (layer, c) in cohort.iter_mut().enumerate() {
            if let Some(row) = commit {
                let got = c.commit_prefill(&[row]).map_err(|e| unexpected("commit_prefill", e))?;
                if got != mconv {
                    return Err(Failure::new("conversion", format!("commit of row {r}: {got:?}, model {mconv:?}")));
                }
            }
            let twin = &mut self.reqs.get_mut(&ids[r]).unwrap().twin[layer];
            let did = twin.round_commit().map_err(|e| unexpected("twin prefill commit", e))?;
            check::flag("twin conversion at the request's commit", did, converts)?;
        }
        if converts {
            self.counters.conversions += self.cfg.layers as u64;
            self.counters.prefill_conversions += self.cfg.layers as u64;
        }
        Ok(())
    }

    fn extract(&mut self, row: usize, finish: bool) -> Res<bool> {
        if self.rows.is_empty() {
            return Ok(false);
        }
        if row >= self.rows.len() {
            let want = self.rows_model.extract(row).err().ok_or_else(|| Failure::new("model", "extract of no row"))?;
            for layer in 0..self.cfg.layers {
                match self.batch_rows(layer)?.extract(row) {
                    Err(e) if same_error(&e, &want) => self.counters.expected_errors += 1,
                    other => {
                        return Err(Failure::new(
                            "errors",
                            format!("extract of row {row}: expected {want}, got {:?}", other.map(|_| ())),
                        ))
                    }
                }
            }
            return Ok(true);
        }
        let id = self.rows[row];
        let model = self.rows_model.extract(row).map_err(|e| model_fail("extract", e))?;
        let mut legos = Vec::with_capacity(self.cfg.layers);
        let packed = self.batch_rows(0)?.is_packed();
        for layer in 0..self.cfg.layers {
            legos.push(self.batch_rows(layer)?.extract(row).map_err(|e| unexpected("extract", e))?);
        }
        let keep: Vec<usize> = (0..self.rows.len()).filter(|&r| r != row).collect();
        self.filter_rows(&keep)?;
        let mut r = self.reqs.remove(&id).unwrap();
        if packed {
            for layer in 0..self.cfg.layers {
                r.twin[layer] = self.deroll_twin(&r.twin[layer])?;
            }
        }
        if finish {
            self.stored = Some(Stored { lego: legos, twin: r.twin, model });
        } else {
            r.home = Home::Solo;
            r.solo = legos;
            r.model = model;
            self.reqs.insert(id, r);
        }
        Ok(true)
    }

    fn filter_rows(&mut self, kept: &[usize]) -> Res<()> {
        for layer in 0..self.cfg.layers {
            self.batch_mut(layer)?.filter(kept).map_err(|e| unexpected("filter", e))?;
        }
        self.rows_model.filter(kept).map_err(|e| model_fail("filter", e))?;
        self.rows = kept.iter().map(|&r| self.rows[r]).collect();
        if self.rows.is_empty() {
            self.batch.clear();
            self.rows_model = RowsModel::new(self.ts).map_err(|e| model_fail("reset", e))?;
        }
        Ok(())
    }

    fn filter(&mut self, keep: &[u32]) -> Res<bool> {
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
        let dropped: Vec<u32> = (0..self.rows.len()).filter(|r| !kept.contains(r)).map(|r| self.rows[r]).collect();
        self.filter_rows(&kept)?;
        for id in dropped {
            self.reqs.remove(&id);
        }
        Ok(true)
    }

    /// Prefix reuse from the stored entry (module docs).
    fn prefix_reuse(&mut self, cx: &mut Cx<'_>, common: usize, prompt: usize, extra: usize) -> Res<bool> {
        let Some(st) = self.stored.take() else { return Ok(true) };
        let want = take(&st.model, common, prompt);
        let mut taken = Vec::with_capacity(self.cfg.layers);
        let mut twins = Vec::with_capacity(self.cfg.layers);
        for layer in 0..self.cfg.layers {
            let got = st.lego[layer].take(common, prompt);
            match (&want, got) {
                (Ok(_), Ok(l)) => {
                    taken.push(l);
                    twins.push(st.twin[layer].take(common, prompt).map_err(|e| unexpected("twin take", e))?);
                }
                (Err(w), Err(e)) if same_error(&e, w) => self.counters.expected_errors += 1,
                (w, g) => {
                    self.stored = Some(st);
                    return Err(Failure::new(
                        "errors",
                        format!(
                            "take({common}, {prompt}): model {:?}, production {:?}",
                            w.as_ref().map(|_| ()),
                            g.map(|_| ())
                        ),
                    ));
                }
            }
        }
        let Ok(model) = want else {
            // Refused: the entry is unchanged (take borrows it); it stays stored.
            self.stored = Some(st);
            return Ok(true);
        };
        self.counters.reuses += 1;
        let id = model.row.ring.temporal_view().first().map_or(u32::MAX - 1, |t| t.req);
        let mut model = model;
        if extra > 0 {
            let toks = Self::toks_from(id, model.row.offset(), extra);
            let (read, converted) = model.append(&toks, false).map_err(|e| model_fail("reuse append", e))?;
            let scale = self.cfg.scale();
            let masks = Masks::new();
            for layer in 0..self.cfg.layers {
                let (k, v, q) = self.kvq(layer, std::slice::from_ref(&toks));
                let before = taken[layer].converted_at();
                let (out, _) =
                    taken[layer].window(&k, &v, &q, scale, &masks).map_err(|e| unexpected("reuse read", e))?;
                let (tw, _) = twins[layer].window(&k, &v, &q, scale, &masks).map_err(|e| unexpected("twin read", e))?;
                check::flag(
                    "conversion after reuse",
                    before.is_none() && taken[layer].converted_at().is_some(),
                    converted,
                )?;
                let (ob, tb) = (bytes_of(&out)?, bytes_of(&tw)?);
                cx.hasher.update(&ob.digest());
                self.read_vs_model(layer, &ob, 0, &toks, &read)?;
                self.read_vs_twin(&ob, 0, &tb, extra, false, false, true)?;
                if converted {
                    self.counters.conversions += 1;
                }
            }
        }
        self.stored = Some(Stored { lego: taken, twin: twins, model });
        Ok(true)
    }

    /// The plain read of the batch (refused while mixed) and the dense fetch.
    fn plain_read(&mut self, cx: &mut Cx<'_>) -> Res<bool> {
        if self.rows.is_empty() {
            return Ok(true);
        }
        let want = self.rows_model.check_plain_read();
        for layer in 0..self.cfg.layers {
            let b = self.batch_rows(layer)?.clone();
            match (b.check_plain_read(), &want) {
                (Ok(()), Ok(())) => {}
                (Err(e), Err(w)) if same_error(&e, w) => self.counters.expected_errors += 1,
                (g, w) => return Err(Failure::new("errors", format!("plain read: model {w:?}, production {g:?}"))),
            }
            let dense = b.dense_fetch().map_err(|e| unexpected("dense fetch", e))?;
            for (r, (k, v)) in dense.iter().enumerate() {
                let (tk, tv) = self.reqs[&self.rows[r]].twin[layer].dense().map_err(|e| unexpected("twin dense", e))?;
                let (kb, vb) = (bytes_of(k)?, bytes_of(v)?);
                check::bytes_equal("dense fetch keys vs the lego twin", &kb, &bytes_of(&tk)?)?;
                check::bytes_equal("dense fetch values vs the lego twin", &vb, &bytes_of(&tv)?)?;
                cx.hasher.update(&kb.digest());
                self.counters.record_state(mlx_rs::Dtype::Bfloat16, 2);
                self.counters.bit_exact_state += 2;
            }
        }
        Ok(true)
    }

    // ----- state checks ---------------------------------------------------------------------------------------

    /// A lego's (or an extracted row's) stored planes against its twin's (physical order, bytes) and its temporal
    /// view against the model's tokens (bf16 bits, or the quantized triple).
    fn check_lego(
        &mut self,
        cx: &mut Cx<'_>,
        layer: usize,
        what: &str,
        prod: &Bf16FirstCache,
        twin: &Bf16FirstCache,
        m: &LegoModel,
    ) -> Res<()> {
        let phys = planes_bytes(&prod.inner().physical_planes().map_err(|e| unexpected("planes", e))?)?;
        let tphys = planes_bytes(&twin.inner().physical_planes().map_err(|e| unexpected("twin planes", e))?)?;
        if phys.len() != tphys.len() {
            return Err(Failure::new(
                "state_vs_twin",
                format!("{what}: {} planes, the twin {}", phys.len(), tphys.len()),
            ));
        }
        for (i, (a, b)) in phys.iter().zip(&tphys).enumerate() {
            check::bytes_equal(&format!("{what}: plane {i} vs the lego twin"), a, b)?;
            cx.hasher.update(&a.digest());
        }
        let lc = (prod.converted_at(), prod.minimum_reusable_offset(), prod.offset());
        let tc = (twin.converted_at(), twin.minimum_reusable_offset(), twin.offset());
        let mc = (m.row.converted_at, m.row.floor, m.row.offset());
        if lc != mc || tc != mc {
            return Err(Failure::new(
                "lifecycle",
                format!("{what}: (converted_at, floor, offset) production {lc:?}, twin {tc:?}, model {mc:?}"),
            ));
        }
        if prod.max_append_tokens() != m.max_append_tokens() {
            return Err(Failure::new(
                "lifecycle",
                format!(
                    "{what}: max_append_tokens {:?} vs model {:?}",
                    prod.max_append_tokens(),
                    m.max_append_tokens()
                ),
            ));
        }
        check::flag(
            &format!("{what}: affine storage kind"),
            cache::kind::is_quantized(&prod.storage_kind()),
            m.row.converted_at.is_some(),
        )?;
        let want = cache::DelayedKind { max_size: self.max_size(), quant: self.t.quant, start: self.t.start };
        check::flag(
            &format!("{what}: the lego's kind, parsed back"),
            cache::parse_bf16_first(&prod.lego_kind()) == Some(want),
            true,
        )?;
        let toks = m.row.ring.temporal_view();
        let planes = planes_bytes(&prod.inner().temporal_view_planes().map_err(|e| unexpected("temporal", e))?)?;
        self.planes_vs_model(layer, what, &planes, &toks, m.row.converted_at.is_some())?;
        self.counters.record_state(mlx_rs::Dtype::Bfloat16, phys.len() as u64 + 1);
        self.counters.bit_exact_state += phys.len() as u64 + 1;
        self.counters.checks += 1;
        Ok(())
    }

    /// Temporal-view planes `[1, H, n, X]` against the model's tokens: bf16 K, V bits, or the affine triples.
    fn planes_vs_model(&self, layer: usize, what: &str, planes: &[ArrayBytes], toks: &[Tok], affine: bool) -> Res<()> {
        let (vs, q, l) = (self.vs, self.rq(), layer as u32);
        // Plane order: [k, v] (bf16), or [kq, ks, kb, vq, vs, vb] (affine).
        let expect = |p: usize, tok: Tok| -> Vec<u32> {
            if affine {
                let t = if p < 3 { Tensor::K } else { Tensor::V };
                let x = quantized_column(&vs, l, t, tok, q);
                [x.packed, x.scales, x.biases].into_iter().nth(p % 3).unwrap_or_default()
            } else {
                vs.column_bits(l, if p == 0 { Tensor::K } else { Tensor::V }, tok)
            }
        };
        let n_planes = if affine { 6 } else { 2 };
        if planes.len() != n_planes {
            return Err(Failure::new(
                "state_vs_model",
                format!("{what}: {} planes, expected {n_planes}", planes.len()),
            ));
        }
        for (p, plane) in planes.iter().enumerate() {
            let (h, n, x) = (plane.shape[1] as usize, plane.shape[2] as usize, plane.shape[3] as usize);
            if n != toks.len() {
                return Err(Failure::new(
                    "state_vs_model",
                    format!("{what}: temporal view holds {n} positions, the model {}", toks.len()),
                ));
            }
            for (c, &tok) in toks.iter().enumerate() {
                let e = expect(p, tok);
                for hh in 0..h {
                    for k in 0..x {
                        if plane.words.get((hh * n + c) * x + k) != e[hh * x + k] as u64 {
                            return Err(Failure::new(
                                "state_vs_model",
                                format!("{what}: plane {p} temporal column {c} (token {tok:?}) head {hh} word {k} differs from the model"),
                            ));
                        }
                    }
                }
            }
        }
        Ok(())
    }

    pub fn check_all(&mut self, cx: &mut Cx<'_>) -> Res<()> {
        // Every request outside the batch; in the lego family every request (its rows are legos too).
        let solo: Vec<u32> =
            self.reqs.iter().filter(|(_, r)| r.home == Home::Solo || self.legos).map(|(&id, _)| id).collect();
        for id in solo {
            let r = self.reqs.remove(&id).unwrap();
            let res = (0..self.cfg.layers).try_for_each(|layer| {
                self.check_lego(
                    cx,
                    layer,
                    &format!("request {id} layer {layer}"),
                    &r.solo[layer],
                    &r.twin[layer],
                    &r.model,
                )
            });
            self.reqs.insert(id, r);
            res?;
        }
        if let Some(st) = self.stored.take() {
            let res = (0..self.cfg.layers).try_for_each(|layer| {
                self.check_lego(
                    cx,
                    layer,
                    &format!("stored entry layer {layer}"),
                    &st.lego[layer],
                    &st.twin[layer],
                    &st.model,
                )
            });
            self.stored = Some(st);
            res?;
        }
        if self.rows.is_empty() || self.legos {
            return Ok(());
        }
        let m = self.rows_model.clone();
        for layer in 0..self.cfg.layers {
            let b = self.batch_rows(layer)?.clone();
            if b.rows() != m.rows.len() || b.is_packed() != m.packed {
                return Err(Failure::new(
                    "rows",
                    format!(
                        "layer {layer}: {} rows (packed {}), the model {} (packed {})",
                        b.rows(),
                        b.is_packed(),
                        m.rows.len(),
                        m.packed
                    ),
                ));
            }
            let kind = b.storage_kind();
            let parsed = cache::parse_delayed(&kind);
            let want = cache::DelayedKind { max_size: self.max_size(), quant: self.t.quant, start: self.t.start };
            check::flag(
                "storage kind (the model's signature, parsed back)",
                kind.0 == self.ts.signature() && parsed == Some(want),
                true,
            )?;
            if b.minimum_reusable_offset() != m.minimum_reusable_offset()
                || b.max_append_tokens() != m.max_append_tokens()
            {
                return Err(Failure::new(
                    "lifecycle",
                    format!(
                        "layer {layer}: floor {} / max_append_tokens {:?}, the model {} / {:?}",
                        b.minimum_reusable_offset(),
                        b.max_append_tokens(),
                        m.minimum_reusable_offset(),
                        m.max_append_tokens()
                    ),
                ));
            }
            let offsets = b.offsets();
            for (i, mr) in m.rows.iter().enumerate() {
                let p = b.lifecycle()[i];
                if (p.converted_at, p.floor, p.left_pad, offsets[i])
                    != (mr.converted_at, mr.floor, mr.left_pad, mr.offset())
                {
                    return Err(Failure::new(
                        "lifecycle",
                        format!(
                            "layer {layer} row {i}: (converted_at, floor, left_pad, offset) {:?}, the model {:?}",
                            (p.converted_at, p.floor, p.left_pad, offsets[i]),
                            (mr.converted_at, mr.floor, mr.left_pad, mr.offset())
                        ),
                    ));
                }
                let id = self.rows[i];
                let twin = self.reqs[&id].twin[layer].clone();
                // The row's planes in physical order against its twin's.
                let planes = planes_bytes(&b.row_physical_planes(i).map_err(|e| unexpected("row planes", e))?)?;
                let tplanes = planes_bytes(&twin.inner().physical_planes().map_err(|e| unexpected("twin planes", e))?)?;
                if planes.len() != tplanes.len() {
                    return Err(Failure::new(
                        "state_vs_twin",
                        format!("row {i}: {} planes vs {}", planes.len(), tplanes.len()),
                    ));
                }
                for (j, (a, t)) in planes.iter().zip(&tplanes).enumerate() {
                    check::bytes_equal(&format!("layer {layer} row {i} plane {j} vs its lego twin"), a, t)?;
                    cx.hasher.update(&a.digest());
                }
                let tc = (twin.converted_at(), twin.minimum_reusable_offset(), twin.offset());
                if tc != (mr.converted_at, mr.floor, mr.offset()) {
                    return Err(Failure::new("lifecycle", format!("layer {layer} row {i}: twin {tc:?} vs the model")));
                }
                // The row handed back to serial use: its temporal view against the model's tokens.
                let back = b.extract(i).map_err(|e| unexpected("extract (check)", e))?;
                let tv = planes_bytes(&back.inner().temporal_view_planes().map_err(|e| unexpected("temporal", e))?)?;
                self.planes_vs_model(
                    layer,
                    &format!("layer {layer} row {i}"),
                    &tv,
                    &mr.ring.temporal_view(),
                    mr.converted_at.is_some(),
                )?;
                self.counters.record_state(mlx_rs::Dtype::Bfloat16, planes.len() as u64 + 1);
                self.counters.bit_exact_state += planes.len() as u64 + 1;
            }
            self.counters.checks += 1;
        }
        Ok(())
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
        if self.legos {
            return self.apply_legos(op, cx);
        }
        match op {
            Op::Admit { req } => self.admit(*req),
            Op::SoloWindow { req, len } => self.solo_append(cx, *req, *len as usize, false),
            Op::SoloDecode { req } => self.solo_append(cx, *req, 1, true),
            Op::Merge { reqs } => self.enter(reqs, &[]),
            Op::Join { reqs, order } => self.enter(reqs, order),
            Op::BatchPrefill { reqs, lengths, chunk } => self.batch_prefill(cx, reqs, lengths, *chunk as usize),
            Op::Decode => self.batch_read(cx, 1, true),
            Op::Window { len } => self.batch_read(cx, *len as usize, false),
            Op::Verify { gamma, accept } => self.verify(cx, *gamma as usize, accept),
            Op::CommitSpan { len } => self.commit_span(cx, *len as usize),
            Op::Extract { row, finish } => self.extract(*row as usize, *finish),
            Op::Filter { keep } => self.filter(keep),
            Op::PrefixReuse { common, prompt, extra } => {
                self.prefix_reuse(cx, *common as usize, *prompt as usize, *extra as usize)
            }
            Op::PlainRead => self.plain_read(cx),
            Op::Persist { req, mlxlm } => self.persist(*req, *mlxlm),
            // The training kinds use their own stateless caches: every cache here must come out unchanged.
            Op::TrainingForward { .. } | Op::PrefixSharedForward { .. } | Op::TrainingRefusal { .. } => Ok(true),
            _ => Ok(false),
        }
    }

    fn check_state(&mut self, cx: &mut Cx<'_>) -> Res<()> {
        self.check_all(cx)
    }

    fn observe_state(&mut self, _cx: &mut Cx<'_>) -> Res<()> {
        Ok(())
    }

    fn view(&self) -> View {
        View {
            solo: self
                .reqs
                .iter()
                .filter(|(_, r)| r.home == Home::Solo)
                .map(|(&id, r)| (id, r.model.row.offset(), r.model.row.ring.last_concat))
                .collect(),
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

mod legos;
#[cfg(test)]
mod tests;
