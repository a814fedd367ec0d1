//! The attention family (`kv:plain`, `kv:rotating-plain`): executes ops on three things at once and checks them
//! after every op:
//! - the **production** caches: the running batch (`RowBatch`, one per layer) and, for requests outside it, their
//!   serial caches (`SerialCache`, one per layer);
//! - a **solo twin** per request and layer: a `SerialCache` that only ever holds that request, fed the same K/V and
//!   queries (its window writes get only the request's real positions), and re-linearized exactly when the
//!   production row goes through a layout event (`merge`, `extract`);
//! - the **reference model** (`reference::RowModel`, one per request: layers share the layout).
//!
//! After each op `check::*` compares production against the model (layout, positions, masks, bytes, errors), the
//! production rows against their twins (bytes), and read outputs against the twins (bytes) and the f64 model (ULPs).
//!
//! This file holds the family's state, its payloads and the op dispatch; the ops and checks live in child modules:
//! `lifecycle` (admit, merge/join, extract, filter), `reads` (solo and batch reads and writes, verify, commit_span),
//! `trims`, `special` (read_block, bidir_prefill, encoder_read, compiled_step), `persist`, `checks` (reads and state) and `probes`
//! (API probes and ill-formed inputs).

use std::collections::BTreeMap;

use mlx_rs::Array;

use crate::sim::check::Failure;
use crate::sim::config::{DtypeChoice, SimConfig};
use crate::sim::family::{Cx, Family, Registration};
use crate::sim::observe::Call;
use crate::sim::ops::{Op, OpKind};
use crate::sim::roster::Roster;
use crate::sim::summary::Counters;
use kvsim_cache::{CacheError, KvSpec, RowBatch, SerialCache, Storage};
use kvsim_reference::{RowModel, Tensor, Tok, ValueSpace};

mod checks;
mod lifecycle;
mod persist;
mod probes;
mod reads;
mod special;
mod trims;

pub(crate) use persist::mlxlm_keeps_state;

/// One request: its production serial caches (when outside the batch), its twins and its model.
pub struct Request {
    pub id: u32,
    /// Production serial caches, one per layer (meaningful while the request is outside the batch).
    pub solo: Vec<SerialCache>,
    /// Solo twins, one per layer.
    pub twin: Vec<SerialCache>,
    /// The expected layout (shared by every layer).
    pub model: RowModel,
    /// What the request's rows went through (for the guarantees table's classes).
    pub history: History,
}

/// Events in a request's life that the guarantees table reports separately.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct History {
    /// Went through merge, join or extract.
    pub layout_event: bool,
    /// Had a speculative rollback (a bypass trim of at least one position).
    pub rolled_back: bool,
}

/// The attention family's layers of one run.
pub struct Attention {
    pub cfg: SimConfig,
    pub vs: ValueSpace,
    pub spec: KvSpec,
    /// Every live request of the roster (`Cx::roster`), by id.
    pub reqs: BTreeMap<u32, Request>,
    /// The running batch, one per layer (row `i` is the roster's `rows()[i]`).
    pub batch: Vec<RowBatch>,
    pub counters: Counters,
    /// How every cache of this instance stores K and V: plain (the attention family), or affine triples (the
    /// quantized family, `sim::family::quant`, which may also start plain and convert mid-run).
    pub storage: Storage,
    /// Coverage classes the current op reached through this family's state ([`Family::take_reached`]).
    pub(crate) reached: Vec<&'static str>,
    /// `counters.damaged_files_refused` when the classes were last drained.
    pub(crate) damaged_seen: u64,
}

pub(crate) type Res<T> = Result<T, Failure>;

/// `[B, heads, L, D]` for `tensor` of `layer`: row `b`, slot `i` holds `toks[b][i]`, or the pad poison when None
/// (every family's payloads: values are a pure function of the config's value space and the token).
pub(crate) fn payload_block(
    cfg: &SimConfig,
    vs: &ValueSpace,
    layer: usize,
    tensor: Tensor,
    toks: &[Vec<Option<Tok>>],
) -> Res<Array> {
    let heads = if tensor == Tensor::Q { cfg.heads_q } else { cfg.heads_kv };
    let d = cfg.head_dim;
    let b = toks.len();
    let l = toks.iter().map(|r| r.len()).max().unwrap_or(0);
    let mut data = vec![0f32; b * heads * l * d];
    for (r, row) in toks.iter().enumerate() {
        for (i, t) in row.iter().enumerate() {
            let col: std::rc::Rc<[f32]> = match t {
                Some(t) => vs.column(layer as u32, tensor, *t),
                None => (0..heads * d)
                    .map(|x| vs.pad_value(layer as u32, tensor, r as u32, i as u32, x / d, x % d))
                    .collect(),
            };
            for h in 0..heads {
                for k in 0..d {
                    data[((r * heads + h) * l + i) * d + k] = col[h * d + k];
                }
            }
        }
    }
    let shape = [b as i32, heads as i32, l as i32, d as i32];
    Ok(match cfg.dtype {
        DtypeChoice::F32 => Array::from_slice(&data, &shape),
        // Values are already bf16-representable (reference::values rounds them): the conversion is exact, done
        // on the host so that no MLX op is spent on it.
        DtypeChoice::Bf16 => {
            let h: Vec<half::bf16> = data.iter().map(|&x| half::bf16::from_f32(x)).collect();
            Array::from_slice(&h, &shape)
        }
    })
}

pub(crate) fn mlx_fail(what: &str, e: impl std::fmt::Display) -> Failure {
    Failure::new("mlx", format!("{what}: {e}"))
}

impl Attention {
    pub fn new(cfg: SimConfig) -> Res<Attention> {
        Attention::with_storage(cfg, Storage::Plain)
    }

    /// The family's layers with caches of `storage` (the geometry is `cfg`'s: `kv_spec`, `value_space`, `scale`).
    pub fn with_storage(cfg: SimConfig, storage: Storage) -> Res<Attention> {
        let (spec, vs) = (cfg.kv_spec(), cfg.value_space());
        let batch = (0..cfg.layers)
            .map(|_| RowBatch::with_rows_storage(spec, cfg.layout.max_size(), storage, 0))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| Failure::new("setup", e.to_string()))?;
        Ok(Attention {
            cfg,
            vs,
            spec,
            reqs: BTreeMap::new(),
            batch,
            counters: Counters::default(),
            storage,
            reached: vec![],
            damaged_seen: 0,
        })
    }

    /// A live request's (offset, last window width), from its model.
    pub fn position(&self, req: u32) -> Option<(usize, Option<usize>)> {
        self.reqs.get(&req).map(|r| (r.model.offset, r.model.last_concat))
    }

    /// Each batch row's (offset, live columns), in row order, as the models have them (the observer's `rows`).
    fn row_extents(&self, roster: &Roster) -> Vec<(usize, usize)> {
        roster.rows().iter().map(|id| (self.reqs[id].model.offset, self.reqs[id].model.cols.len())).collect()
    }

    fn max_size(&self) -> Option<usize> {
        self.cfg.layout.max_size()
    }

    /// The classes reached since the last call (see [`Family::take_reached`]).
    pub(crate) fn drain_reached(&mut self) -> Vec<&'static str> {
        if self.counters.damaged_files_refused > self.damaged_seen {
            self.damaged_seen = self.counters.damaged_files_refused;
            self.reached.push("persist/damaged");
        }
        std::mem::take(&mut self.reached)
    }

    fn new_serial(&self) -> Res<SerialCache> {
        SerialCache::with_storage(self.spec, self.max_size(), self.storage)
            .map_err(|e| Failure::new("setup", e.to_string()))
    }

    // ----- payloads --------------------------------------------------------------------------------------------

    /// `[B, heads, L, D]` for `tensor` of `layer` ([`payload_block`]).
    fn block(&self, layer: usize, tensor: Tensor, toks: &[Vec<Option<Tok>>]) -> Res<Array> {
        payload_block(&self.cfg, &self.vs, layer, tensor, toks)
    }

    fn kvq(&self, layer: usize, toks: &[Vec<Option<Tok>>]) -> Res<(Array, Array, Array)> {
        Ok((
            self.block(layer, Tensor::K, toks)?,
            self.block(layer, Tensor::V, toks)?,
            self.block(layer, Tensor::Q, toks)?,
        ))
    }

    fn next_toks(&self, req: u32, n: usize) -> Vec<Option<Tok>> {
        let off = self.reqs[&req].model.offset as u32;
        (0..n as u32).map(|i| Some(Tok { req, pos: off + i })).collect()
    }

    // ----- the op interpreter ----------------------------------------------------------------------------------

    /// Applies one op. `Ok(false)`: skipped (its references do not exist). `Err`: a check failed.
    fn run_op(&mut self, cx: &mut Cx<'_>, op: &Op) -> Res<bool> {
        if let Some(change) = cx.change {
            return self.carry_out(cx, change, matches!(op, Op::Merge { .. }));
        }
        Ok(match op {
            // Lifecycle ops that change nothing were skipped by the roster, but for an extract of a missing row.
            Op::Admit { .. } | Op::Merge { .. } | Op::Join { .. } | Op::BatchPrefill { .. } | Op::Filter { .. } => {
                false
            }
            Op::Extract { row, .. } => self.extract_missing(*row as usize)?,
            Op::SoloWindow { req, len } => self.solo_window(cx, *req, *len as usize, true)?,
            Op::SoloDecode { req } => self.solo_decode(cx, *req)?,
            Op::SoloTrim { req, n, bypass } => self.solo_trim(cx, *req, *n as usize, *bypass)?,
            Op::Decode => self.batch_step(cx, false)?,
            Op::Window { len } => self.batch_window(cx, *len as usize, true)?,
            Op::Append { len } => self.batch_window(cx, *len as usize, false)?,
            Op::Verify { gamma, accept } => self.verify(cx, *gamma as usize, accept)?,
            Op::CommitSpan { len } => self.commit_span(cx, *len as usize)?,
            Op::CommitKnownSpans { lens } => self.commit_known_spans(cx, lens)?,
            Op::CompiledBatchStep => self.batch_step(cx, true)?,
            Op::Trim { n, bypass } => self.batch_trim(cx, *n as usize, *bypass)?,
            Op::ReadBlock { req, len } => self.solo_read_block(cx, *req, *len as usize)?,
            Op::BidirPrefill { req, len, image } => self.bidir_prefill(cx, *req, *len as usize, *image)?,
            Op::EncoderRead { req, len, window, batch } => {
                let window = (*window > 0).then_some(*window as usize);
                if *batch {
                    self.batch_encoder_read(cx, *len as usize, window)?
                } else {
                    self.solo_encoder_read(cx, *req, *len as usize, window)?
                }
            }
            Op::CompiledStep { req } => self.compiled_step(cx, *req)?,
            Op::Quantize { bits, group, mid_round } => {
                self.quantize(cx, *bits as usize, *group as usize, *mid_round)?
            }
            // The training family's forwards use their own stateless caches: every inference cache of this family
            // must come out of them unchanged, which `check_all` verifies after the op.
            Op::TrainingForward { .. } | Op::PrefixSharedForward { .. } | Op::TrainingRefusal { .. } => true,
            // The bf16-first family's own ops (prefix reuse from its stored entry, the refused plain read) touch
            // no cache here: `check_all` after the op proves it.
            Op::PrefixReuse { .. } | Op::PlainRead | Op::Fetch { .. } => true,
            // The paged family's own ops touch no cache here either.
            Op::Paged { .. } => true,
            Op::Adopt { invalid } => self.adopt(cx.roster, *invalid)?,
            Op::DecodePhase => self.decode_phases(cx.roster)?,
            Op::Prepare { lengths, chunk, chunks } => self.prepare_rows(cx, lengths, *chunk as usize, *chunks)?,
            Op::IllFormed { req, batch, input, variant } => {
                self.ill_formed(cx.roster, *req, *batch, *input, *variant)?
            }
            Op::Persist { req, mlxlm } => self.persist(cx.roster, *req, *mlxlm)?,
        })
    }
}

/// The read a solo twin performs for a batch op.
#[derive(Debug, Clone, Copy)]
enum TwinRead {
    Decode,
    Window,
    Span,
}

fn model_after_map(id: u32, m: &RowModel) -> BTreeMap<u32, RowModel> {
    let mut map = BTreeMap::new();
    map.insert(id, m.clone());
    map
}

/// Describes a production call to the observer.
fn emit(cx: &mut Cx<'_>, call: Call<'_>) -> Res<()> {
    cx.observer.on_call(call).map_err(|e| mlx_fail("observe", e))
}

pub(crate) fn unexpected(what: &str, e: CacheError) -> Failure {
    Failure::new("errors", format!("{what}: unexpected error {e:?}"))
}

/// The attention family's name in `SimConfig::families`.
pub const NAME: &str = "attention";

/// The attention family: every op of the alphabet.
pub const REGISTRATION: Registration =
    Registration::plain(NAME, |_kind: OpKind| true, 1.0, |cfg| Ok(Box::new(Attention::new(cfg.clone())?)));

impl Family for Attention {
    fn key(&self) -> &'static str {
        match self.cfg.layout.max_size() {
            None => "kv:plain",
            Some(_) => "kv:rotating-plain",
        }
    }

    fn apply(&mut self, op: &Op, cx: &mut Cx<'_>) -> Res<bool> {
        self.run_op(cx, op)
    }

    fn check_state(&mut self, cx: &mut Cx<'_>) -> Res<()> {
        self.check_all(cx)
    }

    fn observe_state(&mut self, cx: &mut Cx<'_>) -> Res<()> {
        self.record_checkpoint(cx)
    }

    fn position(&self, req: u32) -> Option<(usize, Option<usize>)> {
        Attention::position(self, req)
    }

    fn counters(&self) -> &Counters {
        &self.counters
    }

    fn counters_mut(&mut self) -> &mut Counters {
        &mut self.counters
    }

    fn take_reached(&mut self) -> Vec<&'static str> {
        self.drain_reached()
    }
}
