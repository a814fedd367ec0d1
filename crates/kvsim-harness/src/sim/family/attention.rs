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

use std::collections::BTreeMap;

use mlx_rs::Array;

use crate::sim::check::{self, Failure, ReadKind};
use crate::sim::config::{DtypeChoice, SimConfig};
use crate::sim::family::{entering, join_permutation, Cx, Family, Registration, View};
use crate::sim::observe::{Call, Read, StateView, TrimInfo};
use crate::sim::ops::{Op, OpKind};
use crate::sim::summary::Counters;
use kvsim_cache::bytes::ArrayBytes;
use kvsim_cache::{
    decode_step, CacheError, CompiledDecode, DecodePhase, JoinSource, KvSpec, MaskUse, Masks, RowBatch, SerialCache,
    Storage,
};
use kvsim_reference::{bidirectional_visible, read_block_context, RowModel, Tensor, Tok, ValueSpace};

mod probes;

/// Where a request's storage lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Home {
    /// Its own serial cache (prefill, or continued after extract).
    Solo,
    /// A row of the running batch.
    Batch,
}

/// One request: its production serial caches (when outside the batch), its twins and its model.
pub struct Request {
    pub id: u32,
    pub home: Home,
    /// Production serial caches, one per layer (meaningful when `home == Solo`).
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
    pub reqs: BTreeMap<u32, Request>,
    /// The running batch, one per layer.
    pub batch: Vec<RowBatch>,
    /// Request id of each batch row.
    pub rows: Vec<u32>,
    pub next_id: u32,
    pub counters: Counters,
    /// How every cache of this instance stores K and V: plain (the attention family), or affine triples (the
    /// quantized family, `sim::family::quant`, which may also start plain and convert mid-run).
    pub storage: Storage,
}

pub(crate) type Res<T> = Result<T, Failure>;

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
            rows: vec![],
            next_id: 0,
            counters: Counters::default(),
            storage,
        })
    }

    pub fn view(&self) -> View {
        View {
            solo: self
                .reqs
                .values()
                .filter(|r| r.home == Home::Solo)
                .map(|r| (r.id, r.model.offset, r.model.last_concat))
                .collect(),
            rows: self.rows.clone(),
            next_id: self.next_id,
            live: self.reqs.len(),
        }
    }

    fn max_size(&self) -> Option<usize> {
        self.cfg.layout.max_size()
    }

    fn new_serial(&self) -> Res<SerialCache> {
        SerialCache::with_storage(self.spec, self.max_size(), self.storage)
            .map_err(|e| Failure::new("setup", e.to_string()))
    }

    // ----- payloads --------------------------------------------------------------------------------------------

    /// `[B, heads, L, D]` for `tensor` of `layer`: row `b`, slot `i` holds `toks[b][i]`, or the pad poison when None.
    fn block(&self, layer: usize, tensor: Tensor, toks: &[Vec<Option<Tok>>]) -> Res<Array> {
        let heads = if tensor == Tensor::Q { self.cfg.heads_q } else { self.cfg.heads_kv };
        let d = self.cfg.head_dim;
        let b = toks.len();
        let l = toks.iter().map(|r| r.len()).max().unwrap_or(0);
        let mut data = vec![0f32; b * heads * l * d];
        for (r, row) in toks.iter().enumerate() {
            for (i, t) in row.iter().enumerate() {
                let col: Vec<f32> = match t {
                    Some(t) => self.vs.column_f32(layer as u32, tensor, *t),
                    None => (0..heads * d)
                        .map(|x| self.vs.pad_value(layer as u32, tensor, r as u32, i as u32, x / d, x % d))
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
        Ok(match self.cfg.dtype {
            DtypeChoice::F32 => Array::from_slice(&data, &shape),
            // Values are already bf16-representable (reference::values rounds them): the conversion is exact, done
            // on the host so that no MLX op is spent on it.
            DtypeChoice::Bf16 => {
                let h: Vec<half::bf16> = data.iter().map(|&x| half::bf16::from_f32(x)).collect();
                Array::from_slice(&h, &shape)
            }
        })
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
        Ok(match op {
            Op::Admit { req } => self.admit(cx, *req)?,
            Op::SoloWindow { req, len } => self.solo_window(cx, *req, *len as usize, true)?,
            Op::SoloDecode { req } => self.solo_decode(cx, *req)?,
            Op::SoloTrim { req, n, bypass } => self.solo_trim(cx, *req, *n as usize, *bypass)?,
            Op::Merge { reqs } => self.enter(cx, reqs, true)?,
            Op::Join { reqs, order } => self.join(cx, reqs, order)?,
            Op::BatchPrefill { reqs, lengths, chunk } => self.batch_prefill(cx, reqs, lengths, *chunk as usize)?,
            Op::Decode => self.batch_decode(cx)?,
            Op::Window { len } => self.batch_window(cx, *len as usize, true)?,
            Op::Append { len } => self.batch_window(cx, *len as usize, false)?,
            Op::Verify { gamma, accept } => self.verify(cx, *gamma as usize, accept)?,
            Op::CommitSpan { len } => self.commit_span(cx, *len as usize)?,
            Op::Extract { row, finish } => self.extract(cx, *row as usize, *finish)?,
            Op::Filter { keep } => self.filter(cx, keep)?,
            Op::Trim { n, bypass } => self.batch_trim(cx, *n as usize, *bypass)?,
            Op::ReadBlock { req, len } => self.solo_read_block(cx, *req, *len as usize)?,
            Op::BidirPrefill { req, len, image } => self.bidir_prefill(cx, *req, *len as usize, *image)?,
            Op::CompiledStep { req } => self.compiled_step(cx, *req)?,
            Op::Quantize { bits, group, mid_round } => {
                self.quantize(cx, *bits as usize, *group as usize, *mid_round)?
            }
            // The training family's forwards use their own stateless caches: every inference cache of this family
            // must come out of them unchanged, which `check_all` verifies after the op.
            Op::TrainingForward { .. } | Op::PrefixSharedForward { .. } | Op::TrainingRefusal { .. } => true,
            // The bf16-first family's own ops (prefix reuse from its stored entry, the refused plain read) touch
            // no cache here: `check_all` after the op proves it.
            Op::PrefixReuse { .. } | Op::PlainRead => true,
            Op::Adopt { invalid } => self.adopt(*invalid)?,
            Op::DecodePhase => self.decode_phases()?,
            Op::Prepare { lengths, chunk, chunks } => self.prepare_rows(cx, lengths, *chunk as usize, *chunks)?,
            Op::IllFormed { req, batch, input, variant } => self.ill_formed(*req, *batch, *input, *variant)?,
            Op::Persist { req, mlxlm } => self.persist(*req, *mlxlm)?,
        })
    }

    /// Save/restore of a request outside the batch: every layer saved in one file, dropped, restored
    /// from the bytes alone. `check_all` after the op compares the restored caches with the twins (state and bytes)
    /// and the model; every later op continues them.
    fn persist(&mut self, req: u32, mlxlm: bool) -> Res<bool> {
        if !self.solo_req(req) {
            return Ok(false);
        }
        let r = self.reqs.get_mut(&req).unwrap();
        let caches = std::mem::take(&mut r.solo);
        r.solo = persist_roundtrip(caches, mlxlm)?;
        self.counters.persist_roundtrips += 1;
        if !self.rows.is_empty() {
            self.persist_batch()?;
        }
        Ok(true)
    }

    /// The running batch (every layer, one file) through kvsim's format and back, mid-run: rows keep their physical
    /// columns, ring phase, bypass-trim record and a pending prefill (mlx-lm's batch classes keep none of the
    /// last two, so kvsim's format only). A reuse floor of half the batch offset rides along and must come back. The
    /// state checks after the op compare every restored row with its twin; the outputs of every later op are the
    /// run's, so a restore that is not exact changes the result hash.
    fn persist_batch(&mut self) -> Res<()> {
        use kvsim_persist::{inspect::Format, AnyCache, Persisted};
        let persisted: Vec<Persisted> = std::mem::take(&mut self.batch)
            .into_iter()
            .map(|b| Persisted { minimum_reusable_offset: b.offset() / 2, cache: AnyCache::Rows(b) })
            .collect();
        self.batch = super::persist_through_bytes(persisted, Format::Kvsim)?
            .into_iter()
            .map(|c| match c {
                AnyCache::Rows(b) => Ok(b),
                other => Err(Failure::new("persist", format!("batch restored as {}", other.storage_kind()))),
            })
            .collect::<Res<_>>()?;
        self.counters.persist_batches += 1;
        Ok(())
    }

    // ----- special reads and the compiled step (R-ROT-9, R-C-9) -------------------------------------------------

    /// DiffusionGemma's canvas read on a request outside the batch: `len` block positions (tokens of request
    /// `u32::MAX - req`, so they never alias a stored position) attend the stored context and the whole block.
    /// Nothing is stored: `check_all` after the op proves every state unchanged.
    fn solo_read_block(&mut self, cx: &mut Cx<'_>, req: u32, len: usize) -> Res<bool> {
        if !self.solo_req(req) || len == 0 {
            return Ok(false);
        }
        let model = self.reqs[&req].model.clone();
        let off = model.offset as u32;
        let block: Vec<Tok> = (0..len as u32).map(|i| Tok { req: u32::MAX - req, pos: off + i }).collect();
        let mut keys = read_block_context(&model);
        // The context is stored (quantized, for affine storage); the block is attended as given.
        let stored = keys.len();
        keys.extend(&block);
        let scale = self.cfg.scale();
        for layer in 0..self.cfg.layers {
            let (k, v, q) = self.kvq(layer, &[block.iter().copied().map(Some).collect()])?;
            let r = &self.reqs[&req];
            let (out, _) = r.solo[layer].read_block(&k, &v, &q, scale).map_err(|e| unexpected("read_block", e))?;
            let (tw, _) = r.twin[layer].read_block(&k, &v, &q, scale).map_err(|e| unexpected("twin read_block", e))?;
            let read = ArrayBytes::read_many(&[&out, &tw]).map_err(|e| mlx_fail("read output", e))?;
            cx.hasher.update(&read[0].digest());
            for (i, t) in block.iter().enumerate() {
                self.out_vs_model(layer as u32, *t, &keys, stored, scale, &read[0], 0, i)?;
            }
            check::output_vs_twin(
                check::OutClass::Window,
                &["read_block"],
                &read[0],
                0,
                &read[1],
                len,
                &mut self.counters,
            )?;
        }
        Ok(true)
    }

    /// Gemma 4's vision prefill on a request outside the batch: only at offset 0; at any other offset production
    /// must refuse with `NotAtOffsetZero` and change nothing (the model predicts the refusal).
    fn bidir_prefill(&mut self, cx: &mut Cx<'_>, req: u32, len: usize, image_bits: u64) -> Res<bool> {
        if !self.solo_req(req) || len == 0 {
            return Ok(false);
        }
        let image: Vec<bool> = (0..len).map(|i| i < 64 && image_bits >> i & 1 == 1).collect();
        let model = self.reqs[&req].model.clone();
        let toks = self.next_toks(req, len);
        let scale = self.cfg.scale();
        let max_size = self.max_size();
        if model.offset > 0 {
            for layer in 0..self.cfg.layers {
                let (k, v, q) = self.kvq(layer, &[toks.clone()])?;
                let r = self.reqs.get_mut(&req).unwrap();
                match r.solo[layer].bidir_prefill(&k, &v, &q, &image, scale, &Masks::new()) {
                    Err(CacheError::NotAtOffsetZero { offset, .. }) if offset == model.offset => {}
                    other => {
                        return Err(Failure::new(
                            "errors",
                            format!(
                                "bidir_prefill at offset {}: expected NotAtOffsetZero, got {:?}",
                                model.offset,
                                other.err()
                            ),
                        ))
                    }
                }
                self.counters.expected_errors += 1;
            }
            return Ok(true);
        }
        let real: Vec<Tok> = toks.iter().map(|t| t.unwrap()).collect();
        let mut model_after = model.clone();
        model_after.window_write(&real);
        let masks = Masks::new();
        for layer in 0..self.cfg.layers {
            let (k, v, q) = self.kvq(layer, &[toks.clone()])?;
            let r = self.reqs.get_mut(&req).unwrap();
            let (out, _) = r.solo[layer]
                .bidir_prefill(&k, &v, &q, &image, scale, &masks)
                .map_err(|e| unexpected("bidir_prefill", e))?;
            let (tw, _) = r.twin[layer]
                .bidir_prefill(&k, &v, &q, &image, scale, &Masks::new())
                .map_err(|e| unexpected("twin bidir_prefill", e))?;
            let read = ArrayBytes::read_many(&[&out, &tw]).map_err(|e| mlx_fail("read output", e))?;
            cx.hasher.update(&read[0].digest());
            for (i, t) in real.iter().enumerate() {
                let keys: Vec<Tok> = bidirectional_visible(&image, max_size, i).into_iter().map(|j| real[j]).collect();
                self.out_vs_model(layer as u32, *t, &keys, keys.len(), scale, &read[0], 0, i)?;
            }
            check::output_vs_twin(
                check::OutClass::Window,
                &["bidir_prefill"],
                &read[0],
                0,
                &read[1],
                len,
                &mut self.counters,
            )?;
        }
        if masks.builds() != 1 {
            crate::sim::check::fail(Failure::new(
                "mask_memo",
                format!("bidirectional mask built {} times in one forward", masks.builds()),
            ))?;
        }
        self.reqs.get_mut(&req).unwrap().model = model_after;
        Ok(true)
    }

    /// One decode step of a request outside the batch through the compiled-decode protocol (plan, pure step of
    /// the family's storage: plain planes or the six affine planes, apply); the twin runs the ordinary decode.
    /// Promised: the plan's fetch equals `decode_phase` and the model's phase, and output and state (every plane)
    /// are byte-identical to the ordinary append (the state check after the op compares the planes with the
    /// twin's and, for affine storage, with the reference's triples).
    fn compiled_step(&mut self, cx: &mut Cx<'_>, req: u32) -> Res<bool> {
        if !self.solo_req(req) {
            return Ok(false);
        }
        let toks = self.next_toks(req, 1);
        let scale = self.cfg.scale();
        let mut model_after = self.reqs[&req].model.clone();
        let ring = model_after.decode_phase_is_ring();
        model_after.decode_write(toks[0].unwrap());
        for layer in 0..self.cfg.layers {
            let (k, v, q) = self.kvq(layer, &[toks.clone()])?;
            let r = self.reqs.get_mut(&req).unwrap();
            let c = &mut r.solo[layer];
            let phase = CompiledDecode::decode_phase(c);
            let plan = CompiledDecode::prepare_decode_step(c).map_err(|e| unexpected("prepare_decode_step", e))?;
            if plan.fetch != phase || (plan.fetch == DecodePhase::Ring) != ring {
                crate::sim::check::fail(Failure::new(
                    "compiled_step",
                    format!("plan {plan:?}, decode_phase {phase:?}, model ring {ring}"),
                ))?;
            }
            let mut inputs = c.step_inputs(&plan).map_err(|e| unexpected("step_inputs", e))?;
            inputs.extend([q.clone(), k.clone(), v.clone(), c.rope_input().map_err(|e| unexpected("rope_input", e))?]);
            let outputs =
                decode_step(self.storage, plan.fetch, None, scale, &inputs).map_err(|e| unexpected("step", e))?;
            let out = outputs[0].clone();
            c.apply_decode_step(&plan, outputs).map_err(|e| unexpected("apply_decode_step", e))?;
            if cx.observer.wants_calls() {
                // The compiled step is a decode (checked byte-identical to the ordinary append below): observers see
                // the ordinary decode call.
                let offset = model_after.offset - 1;
                let call =
                    Call::Solo { req, layer, read: Read::Decode, k: &k, v: &v, q: Some(&q), out: Some(&out), offset };
                emit(cx, call)?;
            }
            let (tw, _) =
                r.twin[layer].decode(&k, &v, &q, scale, &Masks::new()).map_err(|e| unexpected("twin decode", e))?;
            let read = ArrayBytes::read_many(&[&out, &tw]).map_err(|e| mlx_fail("read output", e))?;
            cx.hasher.update(&read[0].digest());
            check::bytes_equal("compiled step output vs the ordinary append", &read[0], &read[1])?;
            self.counters.record_twin(check::OutClass::DecodeUnpadded, &["compiled_step"], read[0].dtype, 0);
            let keys: Vec<Tok> = model_after.decode_visible().iter().map(|&c| model_after.cols[c]).collect();
            self.out_vs_model(layer as u32, toks[0].unwrap(), &keys, keys.len(), scale, &read[0], 0, 0)?;
        }
        self.reqs.get_mut(&req).unwrap().model = model_after;
        Ok(true)
    }

    fn admit(&mut self, cx: &mut Cx<'_>, req: u32) -> Res<bool> {
        if self.reqs.contains_key(&req) || req < self.next_id && self.reqs.contains_key(&req) {
            return Ok(false);
        }
        if req < self.next_id {
            // Ids are never reused: a finished request stays finished.
            return Ok(false);
        }
        let layers = self.cfg.layers;
        let solo = (0..layers).map(|_| self.new_serial()).collect::<Res<Vec<_>>>()?;
        let twin = (0..layers).map(|_| self.new_serial()).collect::<Res<Vec<_>>>()?;
        let model = RowModel::new(self.max_size());
        self.reqs.insert(req, Request { id: req, home: Home::Solo, solo, twin, model, history: History::default() });
        self.next_id = req + 1;
        if cx.observer.wants_calls() {
            emit(cx, Call::Admit { req })?;
        }
        Ok(true)
    }

    fn solo_req(&self, req: u32) -> bool {
        self.reqs.get(&req).is_some_and(|r| r.home == Home::Solo)
    }

    fn solo_window(&mut self, cx: &mut Cx<'_>, req: u32, len: usize, read: bool) -> Res<bool> {
        if !self.solo_req(req) || len == 0 {
            return Ok(false);
        }
        let toks = self.next_toks(req, len);
        let scale = self.cfg.scale();
        let offset_before = self.reqs[&req].model.offset;
        for layer in 0..self.cfg.layers {
            let masks = Masks::new();
            let (k, v, q) = self.kvq(layer, &[toks.clone()])?;
            let r = self.reqs.get_mut(&req).unwrap();
            let got = r.solo[layer].window(&k, &v, &q, scale, &masks).map_err(|e| unexpected("solo window", e))?;
            if cx.observer.wants_calls() {
                let kind = if read { Read::Window } else { Read::Append };
                emit(
                    cx,
                    Call::Solo {
                        req,
                        layer,
                        read: kind,
                        k: &k,
                        v: &v,
                        q: Some(&q),
                        out: Some(&got.0),
                        offset: offset_before,
                    },
                )?;
            }
            let r = self.reqs.get_mut(&req).unwrap();
            let twin =
                r.twin[layer].window(&k, &v, &q, scale, &Masks::new()).map_err(|e| unexpected("twin window", e))?;
            if read {
                let real: Vec<Tok> = toks.iter().flatten().copied().collect();
                let model_after = {
                    let mut m = self.reqs[&req].model.clone();
                    m.window_write(&real);
                    m
                };
                self.check_read(
                    cx,
                    layer,
                    ReadKind::Window,
                    &got.0,
                    &[(0, req, real.clone(), Some(&twin.0))],
                    &model_after_map(req, &model_after),
                    &got.1,
                )?;
            }
        }
        let real: Vec<Tok> = toks.iter().flatten().copied().collect();
        self.reqs.get_mut(&req).unwrap().model.window_write(&real);
        Ok(true)
    }

    fn solo_decode(&mut self, cx: &mut Cx<'_>, req: u32) -> Res<bool> {
        if !self.solo_req(req) {
            return Ok(false);
        }
        let toks = self.next_toks(req, 1);
        let scale = self.cfg.scale();
        let mut model_after = self.reqs[&req].model.clone();
        model_after.decode_write(toks[0].unwrap());
        for layer in 0..self.cfg.layers {
            let (k, v, q) = self.kvq(layer, &[toks.clone()])?;
            let r = self.reqs.get_mut(&req).unwrap();
            let got =
                r.solo[layer].decode(&k, &v, &q, scale, &Masks::new()).map_err(|e| unexpected("solo decode", e))?;
            if cx.observer.wants_calls() {
                let off = model_after.offset - 1;
                emit(
                    cx,
                    Call::Solo {
                        req,
                        layer,
                        read: Read::Decode,
                        k: &k,
                        v: &v,
                        q: Some(&q),
                        out: Some(&got.0),
                        offset: off,
                    },
                )?;
            }
            let r = self.reqs.get_mut(&req).unwrap();
            let twin =
                r.twin[layer].decode(&k, &v, &q, scale, &Masks::new()).map_err(|e| unexpected("twin decode", e))?;
            let real = vec![toks[0].unwrap()];
            self.check_read(
                cx,
                layer,
                ReadKind::Decode,
                &got.0,
                &[(0, req, real, Some(&twin.0))],
                &model_after_map(req, &model_after),
                &got.1,
            )?;
        }
        self.reqs.get_mut(&req).unwrap().model = model_after;
        Ok(true)
    }

    fn solo_trim(&mut self, cx: &mut Cx<'_>, req: u32, n: usize, bypass: bool) -> Res<bool> {
        if !self.solo_req(req) {
            return Ok(false);
        }
        let mut model = self.reqs[&req].model.clone();
        let recording = cx.observer.wants_calls();
        let before = if recording {
            self.reqs[&req].solo.first().map(|c| c.state().clone()).unwrap_or_default()
        } else {
            Default::default()
        };
        let expected = model.trim(n, bypass);
        let mut first: Option<Result<usize, String>> = None;
        for layer in 0..self.cfg.layers {
            let r = self.reqs.get_mut(&req).unwrap();
            let got = r.solo[layer].trim(n, bypass);
            let twin = r.twin[layer].trim(n, bypass);
            if recording && first.is_none() {
                first = Some(got.as_ref().map(|x| *x).map_err(|e| format!("{e:?}")));
            }
            check::error_matches("solo trim", &expected, &got.map(|_| ()))?;
            check::error_matches("twin trim", &expected, &twin.map(|_| ()))?;
        }
        if cx.observer.wants_calls() {
            let after_window = before.last_concat.is_some_and(|l| l >= n);
            let kvsim = first.unwrap_or(Ok(0));
            emit(
                cx,
                Call::SoloTrim {
                    req,
                    offset: before.offset,
                    trim: &TrimInfo { n: vec![n], bypass, kvsim, after_window, live: vec![before.len] },
                },
            )?;
        }
        if expected.is_ok() {
            let q = self.reqs.get_mut(&req).unwrap();
            q.model = model;
            if bypass && n > 0 {
                q.history.rolled_back = true;
            }
        }
        self.counters.expected_errors += expected.is_err() as u64;
        Ok(true)
    }

    /// Solo requests enter the running batch: by temporal merge (`merge = true`) or keeping their phase (join).
    /// `join` with the running batch's rows listed in `order` (empty: identity). A permutation is first described to
    /// observers as a `filter` keeping every row in that order (mlx-lm's `filter` reorders rows alike).
    fn join(&mut self, cx: &mut Cx<'_>, reqs: &[u32], order: &[u32]) -> Res<bool> {
        match join_permutation(order, self.rows.len()) {
            Some(perm) if reqs.iter().any(|&r| self.solo_req(r)) => self.enter_ordered(cx, reqs, false, &perm),
            _ => Ok(false),
        }
    }

    fn enter(&mut self, cx: &mut Cx<'_>, reqs: &[u32], merge: bool) -> Res<bool> {
        let perm: Vec<usize> = (0..self.rows.len()).collect();
        self.enter_ordered(cx, reqs, merge, &perm)
    }

    fn enter_ordered(&mut self, cx: &mut Cx<'_>, reqs: &[u32], merge: bool, perm: &[usize]) -> Res<bool> {
        let ids = entering(reqs, |r| self.solo_req(r));
        if ids.is_empty() {
            return Ok(false);
        }
        let max = self.max_size();
        let identity = perm.iter().enumerate().all(|(i, &r)| i == r);
        if cx.observer.wants_calls() {
            if !identity {
                emit(cx, Call::Filter { keep: perm })?;
            }
            let offsets: Vec<usize> = ids.iter().map(|id| self.reqs[id].model.offset).collect();
            let sizes: Vec<usize> = ids.iter().map(|id| self.reqs[id].model.cols.len()).collect();
            emit(cx, Call::Enter { reqs: &ids, merge, offsets: &offsets, sizes: &sizes })?;
        }
        for layer in 0..self.cfg.layers {
            let incoming = if merge {
                let mut slices = vec![];
                for id in &ids {
                    let planes =
                        self.reqs[id].solo[layer].temporal_view_planes().map_err(|e| unexpected("temporal_view", e))?;
                    slices.push((planes, self.reqs[id].model.offset));
                }
                RowBatch::merge_planes(self.spec, max, self.storage, &slices).map_err(|e| unexpected("merge", e))?
            } else {
                let sources: Vec<JoinSource> =
                    ids.iter().map(|id| JoinSource::Serial(&self.reqs[id].solo[layer])).collect();
                RowBatch::join_storage(self.spec, max, self.storage, &sources)
                    .map_err(|e| unexpected("join (serial rows)", e))?
            };
            let joined = RowBatch::join_storage(
                self.spec,
                max,
                self.storage,
                &[
                    JoinSource::Rows(&self.batch[layer], perm.to_vec()),
                    JoinSource::Rows(&incoming, (0..ids.len()).collect()),
                ],
            )
            .map_err(|e| unexpected("join", e))?;
            self.batch[layer] = joined;
        }
        self.rows = perm.iter().map(|&r| self.rows[r]).collect();
        for id in &ids {
            let r = self.reqs.get_mut(id).unwrap();
            r.home = Home::Batch;
            r.history.layout_event = true;
            if merge {
                // Layout event: the row is rebuilt from its temporal view; the twin mirrors it.
                let view = r.model.temporal_view();
                let offset = r.model.offset;
                r.model = RowModel::from_temporal(r.model.max_size, view.clone(), offset);
                r.model.base = offset - view.len();
                for twin in r.twin.iter_mut() {
                    let planes = twin.temporal_view_planes().map_err(|e| unexpected("twin temporal_view", e))?;
                    *twin = SerialCache::from_temporal_planes(self.spec, max, self.storage, &planes, offset)
                        .map_err(|e| unexpected("twin from_temporal", e))?;
                }
            } else {
                // join keeps the row's state whole (columns, phase, last window width).
                r.model.base = r.model.offset - r.model.cols.len();
            }
            r.solo.clear();
            self.rows.push(*id);
        }
        Ok(true)
    }

    fn batch_prefill(&mut self, cx: &mut Cx<'_>, reqs: &[u32], lengths: &[u32], chunk: usize) -> Res<bool> {
        let mut ids: Vec<u32> = vec![];
        let mut lens: Vec<usize> = vec![];
        for (i, &r) in reqs.iter().enumerate() {
            let fresh = self.reqs.get(&r).is_some_and(|q| q.home == Home::Solo && q.model.offset == 0);
            if fresh && !ids.contains(&r) {
                ids.push(r);
                lens.push(lengths.get(i).copied().unwrap_or(1).max(1) as usize);
            }
        }
        if ids.is_empty() || chunk == 0 {
            return Ok(false);
        }
        let max = self.max_size();
        let b = ids.len();
        // Fresh rows, from the requests' own (empty) serial caches.
        let mut pre: Vec<RowBatch> = vec![];
        for layer in 0..self.cfg.layers {
            let sources: Vec<JoinSource> =
                ids.iter().map(|id| JoinSource::Serial(&self.reqs[id].solo[layer])).collect();
            let mut p = RowBatch::join_storage(self.spec, max, self.storage, &sources)
                .map_err(|e| unexpected("join (fresh rows)", e))?;
            p.prepare(&lens).map_err(|e| unexpected("prepare", e))?;
            pre.push(p);
        }
        for id in &ids {
            self.reqs.get_mut(id).unwrap().model.base = 0;
        }
        if cx.observer.wants_calls() {
            emit(cx, Call::Prefill { reqs: &ids, lengths: &lens, chunk })?;
        }
        let total = *lens.iter().max().unwrap();
        self.padded_chunks(cx, &mut pre, &ids, &lens, chunk, usize::MAX, true)?;
        for (layer, p) in pre.iter_mut().enumerate() {
            p.finalize().map_err(|e| unexpected("finalize", e))?;
            let all: Vec<usize> = (0..self.batch[layer].rows()).collect();
            self.batch[layer] = RowBatch::join_storage(
                self.spec,
                max,
                self.storage,
                &[JoinSource::Rows(&self.batch[layer], all), JoinSource::Rows(p, (0..b).collect())],
            )
            .map_err(|e| unexpected("join (prefilled rows)", e))?;
        }
        for id in &ids {
            let r = self.reqs.get_mut(id).unwrap();
            r.home = Home::Batch;
            r.history.layout_event = true;
            r.solo.clear();
            self.rows.push(*id);
        }
        if cx.observer.wants_calls() {
            emit(cx, Call::PrefillEnd { longest: total })?;
        }
        let _ = b;
        Ok(true)
    }

    /// The chunks of a prepared (right-padded) prefill on `batches` (one per layer, rows `ids`, `lens[r]` real
    /// positions still to come for row `r`): at most `max_chunks` window reads of `chunk` positions, each checked
    /// row by row against the twins (fed only the row's real positions) and the model. Returns the positions
    /// delivered to the longest row. Calls are described to the observer only with `observe`.
    #[allow(clippy::too_many_arguments)]
    fn padded_chunks(
        &mut self,
        cx: &mut Cx<'_>,
        batches: &mut [RowBatch],
        ids: &[u32],
        lens: &[usize],
        chunk: usize,
        max_chunks: usize,
        observe: bool,
    ) -> Res<usize> {
        let scale = self.cfg.scale();
        let padded = lens.iter().any(|&x| x != lens[0]);
        let total = lens.iter().copied().max().unwrap_or(0);
        let mut done = 0;
        let mut chunks = 0;
        while done < total && chunks < max_chunks {
            chunks += 1;
            let l = chunk.min(total - done);
            // Per row: the real positions of this chunk, then padding.
            let mut toks: Vec<Vec<Option<Tok>>> = vec![];
            let mut reals: Vec<Vec<Tok>> = vec![];
            for (r, id) in ids.iter().enumerate() {
                let remaining = lens[r].saturating_sub(done);
                let n = remaining.min(l);
                let off = self.reqs[id].model.offset as u32;
                let real: Vec<Tok> = (0..n as u32).map(|i| Tok { req: *id, pos: off + i }).collect();
                let mut row: Vec<Option<Tok>> = real.iter().map(|t| Some(*t)).collect();
                row.resize(l, None);
                toks.push(row);
                reals.push(real);
            }
            let mut models: BTreeMap<u32, RowModel> = BTreeMap::new();
            for (r, id) in ids.iter().enumerate() {
                let mut m = self.reqs[id].model.clone();
                if !reals[r].is_empty() {
                    m.window_write(&reals[r]);
                }
                models.insert(*id, m);
            }
            for layer in 0..self.cfg.layers {
                let masks = Masks::new();
                let (k, v, q) = self.kvq(layer, &toks)?;
                let got =
                    batches[layer].window(&k, &v, &q, scale, &masks).map_err(|e| unexpected("prefill window", e))?;
                if observe && cx.observer.wants_calls() {
                    let real: Vec<usize> = reals.iter().map(Vec::len).collect();
                    emit(
                        cx,
                        Call::PrefillChunk {
                            layer,
                            reqs: ids,
                            k: &k,
                            v: &v,
                            q: &q,
                            real: &real,
                            out: &got.0,
                            done,
                            padded,
                        },
                    )?;
                }
                let mut twin_outs = vec![];
                for (r, id) in ids.iter().enumerate() {
                    if reals[r].is_empty() {
                        twin_outs.push(None);
                        continue;
                    }
                    let one: Vec<Vec<Option<Tok>>> = vec![reals[r].iter().map(|t| Some(*t)).collect()];
                    let (tk, tv, tq) = self.kvq(layer, &one)?;
                    let t = self.reqs.get_mut(id).unwrap().twin[layer]
                        .window(&tk, &tv, &tq, scale, &Masks::new())
                        .map_err(|e| unexpected("twin window", e))?;
                    twin_outs.push(Some(t.0));
                }
                let rows: Vec<(usize, u32, Vec<Tok>, Option<&Array>)> =
                    ids.iter().enumerate().map(|(r, id)| (r, *id, reals[r].clone(), twin_outs[r].as_ref())).collect();
                self.check_read(cx, layer, ReadKind::PaddedWindow, &got.0, &rows, &models, &got.1)?;
            }
            for (id, m) in models {
                self.reqs.get_mut(&id).unwrap().model = m;
            }
            done += l;
        }
        Ok(done)
    }

    /// Every batch row's twin reads its request's next `len` positions (the same K/V/Q the row got); outputs in row
    /// order.
    fn twin_reads(&mut self, layer: usize, len: usize, how: TwinRead) -> Res<Vec<Array>> {
        let scale = self.cfg.scale();
        let mut outs = vec![];
        for id in self.rows.clone() {
            let one = vec![self.next_toks(id, len)];
            let (k, v, q) = self.kvq(layer, &one)?;
            let twin = &mut self.reqs.get_mut(&id).unwrap().twin[layer];
            let out = match how {
                TwinRead::Decode => twin.decode(&k, &v, &q, scale, &Masks::new()).map(|o| o.0),
                TwinRead::Window => twin.window(&k, &v, &q, scale, &Masks::new()).map(|o| o.0),
                TwinRead::Span => twin.commit_span(&k, &v, &q, scale, &Masks::new()),
            };
            outs.push(out.map_err(|e| unexpected(&format!("twin {how:?}"), e))?);
        }
        Ok(outs)
    }

    /// The model's verdict on trimming row `r` by `n[r]`: every row's trimmed model, and the first row's error (the
    /// production batch checks rows in order and changes nothing when one refuses).
    fn model_trims(
        &self,
        n: &[usize],
        bypass: bool,
    ) -> (BTreeMap<u32, RowModel>, Result<(), kvsim_reference::ModelError>) {
        let mut models = BTreeMap::new();
        let mut expected = Ok(());
        for (r, &id) in self.rows.iter().enumerate() {
            let mut m = self.reqs[&id].model.clone();
            if let Err(e) = m.trim(n[r], bypass) {
                if expected.is_ok() {
                    expected = Err(e);
                }
            }
            models.insert(id, m);
        }
        (models, expected)
    }

    fn batch_decode(&mut self, cx: &mut Cx<'_>) -> Res<bool> {
        if self.rows.is_empty() {
            return Ok(false);
        }
        let scale = self.cfg.scale();
        let toks: Vec<Vec<Option<Tok>>> = self.rows.iter().map(|&id| self.next_toks(id, 1)).collect();
        let mut models = BTreeMap::new();
        for &id in &self.rows {
            let mut m = self.reqs[&id].model.clone();
            m.decode_write(Tok { req: id, pos: m.offset as u32 });
            models.insert(id, m);
        }
        let rope_before = self.batch[0].rope_offsets();
        let rope_values = rope_before.values();
        // One memo for the forward: every layer reads the same geometry, built once (checked after the layers).
        let masks = Masks::new();
        for layer in 0..self.cfg.layers {
            let (k, v, q) = self.kvq(layer, &toks)?;
            let got = self.batch[layer].decode(&k, &v, &q, scale, &masks).map_err(|e| unexpected("decode", e))?;
            if cx.observer.wants_calls() {
                let offsets: Vec<(usize, usize)> =
                    self.rows.iter().map(|id| (self.reqs[id].model.offset, self.reqs[id].model.cols.len())).collect();
                emit(
                    cx,
                    Call::Batch {
                        layer,
                        read: Read::Decode,
                        reqs: &self.rows,
                        rows: &offsets,
                        k: &k,
                        v: &v,
                        q: Some(&q),
                        out: Some(&got.0),
                    },
                )?;
            }
            let twin_outs = self.twin_reads(layer, 1, TwinRead::Decode)?;
            let rows: Vec<(usize, u32, Vec<Tok>, Option<&Array>)> = self
                .rows
                .iter()
                .enumerate()
                .map(|(r, &id)| (r, id, vec![toks[r][0].unwrap()], Some(&twin_outs[r])))
                .collect();
            self.check_read(cx, layer, ReadKind::Decode, &got.0, &rows, &models, &got.1)?;
        }
        check::rope_snapshot(
            &rope_values,
            &rope_before.values(),
            &self.rows.iter().map(|id| self.reqs[id].model.offset).collect::<Vec<_>>(),
        )?;
        check::mask_memo("batch decode", &masks.families())?;
        self.counters.checks += 1;
        if cx.observer.wants_calls() {
            emit(cx, Call::BatchWritten { l: 1 })?;
        }
        self.counters.checks += 1;
        for (id, m) in models {
            self.reqs.get_mut(&id).unwrap().model = m;
        }
        Ok(true)
    }

    fn batch_window(&mut self, cx: &mut Cx<'_>, len: usize, read: bool) -> Res<bool> {
        if self.rows.is_empty() || len == 0 {
            return Ok(false);
        }
        let scale = self.cfg.scale();
        let toks: Vec<Vec<Option<Tok>>> = self.rows.iter().map(|&id| self.next_toks(id, len)).collect();
        let mut models = BTreeMap::new();
        for (r, &id) in self.rows.iter().enumerate() {
            let mut m = self.reqs[&id].model.clone();
            m.window_write(&toks[r].iter().flatten().copied().collect::<Vec<_>>());
            models.insert(id, m);
        }
        // One memo for the forward (checked after the layers).
        let masks = Masks::new();
        for layer in 0..self.cfg.layers {
            let (k, v, q) = self.kvq(layer, &toks)?;
            if read {
                let got = self.batch[layer].window(&k, &v, &q, scale, &masks).map_err(|e| unexpected("window", e))?;
                if cx.observer.wants_calls() {
                    let offsets: Vec<(usize, usize)> = self
                        .rows
                        .iter()
                        .map(|id| (self.reqs[id].model.offset, self.reqs[id].model.cols.len()))
                        .collect();
                    emit(
                        cx,
                        Call::Batch {
                            layer,
                            read: Read::Window,
                            reqs: &self.rows,
                            rows: &offsets,
                            k: &k,
                            v: &v,
                            q: Some(&q),
                            out: Some(&got.0),
                        },
                    )?;
                }
                let twin_outs = self.twin_reads(layer, len, TwinRead::Window)?;
                let rows: Vec<(usize, u32, Vec<Tok>, Option<&Array>)> = self
                    .rows
                    .iter()
                    .enumerate()
                    .map(|(r, &id)| (r, id, toks[r].iter().flatten().copied().collect(), Some(&twin_outs[r])))
                    .collect();
                self.check_read(cx, layer, ReadKind::Window, &got.0, &rows, &models, &got.1)?;
            } else {
                self.batch[layer].append(&k, &v).map_err(|e| unexpected("append", e))?;
                if cx.observer.wants_calls() {
                    let offsets: Vec<(usize, usize)> = self
                        .rows
                        .iter()
                        .map(|id| (self.reqs[id].model.offset, self.reqs[id].model.cols.len()))
                        .collect();
                    emit(
                        cx,
                        Call::Batch {
                            layer,
                            read: Read::Append,
                            reqs: &self.rows,
                            rows: &offsets,
                            k: &k,
                            v: &v,
                            q: None,
                            out: None,
                        },
                    )?;
                }
                for &id in &self.rows.clone() {
                    let one = vec![self.next_toks(id, len)];
                    let (tk, tv, _) = self.kvq(layer, &one)?;
                    self.reqs.get_mut(&id).unwrap().twin[layer]
                        .append(&tk, &tv)
                        .map_err(|e| unexpected("twin append", e))?;
                }
            }
        }
        check::mask_memo("batch window", &masks.families())?;
        self.counters.checks += 1;
        for (id, m) in models {
            self.reqs.get_mut(&id).unwrap().model = m;
        }
        if cx.observer.wants_calls() {
            emit(cx, Call::BatchWritten { l: len })?;
        }
        Ok(true)
    }

    fn verify(&mut self, cx: &mut Cx<'_>, gamma: usize, accept: &[u32]) -> Res<bool> {
        if self.rows.is_empty() || gamma == 0 {
            return Ok(false);
        }
        self.batch_window(cx, gamma, true)?;
        self.check_all(cx)?;
        // The oracle compares the verify window's state before the rollback (a checkpoint of its own).
        self.record_checkpoint(cx)?;
        let rollback: Vec<usize> = (0..self.rows.len())
            .map(|r| gamma - (accept.get(r).copied().unwrap_or(gamma as u32) as usize).min(gamma))
            .collect();
        let (models, expected) = self.model_trims(&rollback, true);
        let recording = cx.observer.wants_calls();
        let before: Vec<kvsim_cache::RingState> = if recording {
            self.batch.first().map(|b| b.row_states().iter().map(|s| s.ring.clone()).collect()).unwrap_or_default()
        } else {
            vec![]
        };
        let mut first: Option<Result<usize, String>> = None;
        for layer in 0..self.cfg.layers {
            let got = self.batch[layer].trim_rows(&rollback, true);
            if recording && first.is_none() {
                first = Some(
                    got.as_ref().map(|_| rollback.iter().copied().max().unwrap_or(0)).map_err(|e| format!("{e:?}")),
                );
            }
            check::error_matches("verify rollback (trim_rows bypass)", &expected, &got)?;
            for (r, &id) in self.rows.clone().iter().enumerate() {
                let t = self.reqs.get_mut(&id).unwrap().twin[layer].trim(rollback[r], true);
                check::error_matches("twin rollback", &expected, &t.map(|_| ()))?;
            }
        }
        if cx.observer.wants_calls() {
            let offsets: Vec<usize> = before.iter().map(|s| s.offset).collect();
            let after_window = before.iter().zip(&rollback).all(|(s, &n)| s.last_concat.is_some_and(|l| l >= n));
            let live = before.iter().map(|s| s.len).collect();
            let trim =
                TrimInfo { n: rollback.clone(), bypass: true, kvsim: first.unwrap_or(Ok(0)), after_window, live };
            emit(cx, Call::TrimRows { reqs: &self.rows, offsets: &offsets, trim: &trim })?;
        }
        if expected.is_ok() {
            for (r, (id, m)) in models.into_iter().enumerate() {
                let q = self.reqs.get_mut(&id).unwrap();
                q.model = m;
                let _ = r;
            }
            for (r, id) in self.rows.clone().iter().enumerate() {
                if rollback[r] > 0 {
                    self.reqs.get_mut(id).unwrap().history.rolled_back = true;
                }
            }
        }
        Ok(true)
    }

    fn commit_span(&mut self, cx: &mut Cx<'_>, len: usize) -> Res<bool> {
        if self.rows.is_empty() || len == 0 {
            return Ok(false);
        }
        let scale = self.cfg.scale();
        let toks: Vec<Vec<Option<Tok>>> = self.rows.iter().map(|&id| self.next_toks(id, len)).collect();
        let mut models = BTreeMap::new();
        for (r, &id) in self.rows.iter().enumerate() {
            let mut m = self.reqs[&id].model.clone();
            for t in toks[r].iter().flatten() {
                m.decode_write(*t);
            }
            models.insert(id, m);
        }
        for layer in 0..self.cfg.layers {
            let masks = Masks::new();
            let (k, v, q) = self.kvq(layer, &toks)?;
            let got =
                self.batch[layer].commit_span(&k, &v, &q, scale, &masks).map_err(|e| unexpected("commit_span", e))?;
            if cx.observer.wants_calls() {
                let offsets: Vec<(usize, usize)> =
                    self.rows.iter().map(|id| (self.reqs[id].model.offset, self.reqs[id].model.cols.len())).collect();
                emit(cx, Call::BatchSpan { layer, reqs: &self.rows, rows: &offsets, k: &k, v: &v, q: &q, out: &got })?;
            }
            let twin_outs = self.twin_reads(layer, len, TwinRead::Span)?;
            // Outputs: compared with the twin (bytes) and the f64 model of each position's decode read.
            let rows: Vec<(usize, u32, Vec<Tok>, Option<&Array>)> = self
                .rows
                .iter()
                .enumerate()
                .map(|(r, &id)| (r, id, toks[r].iter().flatten().copied().collect(), Some(&twin_outs[r])))
                .collect();
            self.check_span(cx, layer, &got, &rows)?;
        }
        for (id, m) in models {
            self.reqs.get_mut(&id).unwrap().model = m;
        }
        if cx.observer.wants_calls() {
            emit(cx, Call::BatchWritten { l: len })?;
        }
        Ok(true)
    }

    fn extract(&mut self, cx: &mut Cx<'_>, row: usize, finish: bool) -> Res<bool> {
        if self.rows.is_empty() {
            return Ok(false);
        }
        if row >= self.rows.len() {
            // An impossible request: every layer must refuse it with NoSuchRow, and change nothing.
            for layer in 0..self.cfg.layers {
                match self.batch[layer].extract(row) {
                    Err(CacheError::NoSuchRow { .. }) => {}
                    other => {
                        return Err(Failure::new(
                            "errors",
                            format!(
                                "extract of missing row {row} (rows {}): expected NoSuchRow, got {:?}",
                                self.rows.len(),
                                other.map(|_| ())
                            ),
                        ))
                    }
                }
            }
            self.counters.expected_errors += 1;
            return Ok(true);
        }
        let id = self.rows[row];
        let mut extracted = vec![];
        for layer in 0..self.cfg.layers {
            extracted.push(self.batch[layer].extract(row).map_err(|e| unexpected("extract", e))?);
            let keep: Vec<usize> = (0..self.rows.len()).filter(|&r| r != row).collect();
            self.batch[layer].filter(&keep).map_err(|e| unexpected("filter after extract", e))?;
        }
        self.rows.remove(row);
        if cx.observer.wants_calls() {
            emit(cx, Call::Extract { row, req: id, finish, rows_left: self.rows.len() })?;
        }
        if finish {
            self.reqs.remove(&id);
            return Ok(true);
        }
        let max = self.max_size();
        // Save/restore: the extracted row is persisted (every layer, one file), dropped and restored before it
        // continues solo; the state checks after this op and every later read compare the restored caches with
        // the twin and the model. Even requests go through kvsim's format, odd ones through an mlx-lm prompt-cache
        // file when every layer has an mlx-lm form (else kvsim's format).
        // Affine storage goes through kvsim's format (its codecs store the six planes as they are).
        let extracted = persist_roundtrip(extracted, id % 2 == 1)?;
        self.counters.persist_roundtrips += 1;
        let r = self.reqs.get_mut(&id).unwrap();
        r.home = Home::Solo;
        r.history.layout_event = true;
        r.solo = extracted;
        // Layout event: extract de-rolls the row into a fresh serial cache (R-BROT-5); the twin and the model follow.
        r.model = r.model.extract();
        for twin in r.twin.iter_mut() {
            twin.relinearize().map_err(|e| unexpected("twin relinearize", e))?;
            let planes = twin.physical_planes().map_err(|e| unexpected("twin physical", e))?;
            *twin = SerialCache::from_temporal_planes(self.spec, max, self.storage, &planes, r.model.offset)
                .map_err(|e| unexpected("twin from_temporal", e))?;
        }
        let _ = max;
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
        for layer in 0..self.cfg.layers {
            self.batch[layer].filter(&kept).map_err(|e| unexpected("filter", e))?;
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

    fn batch_trim(&mut self, cx: &mut Cx<'_>, n: usize, bypass: bool) -> Res<bool> {
        if self.rows.is_empty() {
            return Ok(false);
        }
        let (models, expected) = self.model_trims(&vec![n; self.rows.len()], bypass);
        let recording = cx.observer.wants_calls();
        let before: Vec<kvsim_cache::RingState> = if recording {
            self.batch.first().map(|b| b.row_states().iter().map(|s| s.ring.clone()).collect()).unwrap_or_default()
        } else {
            vec![]
        };
        let mut first: Option<Result<usize, String>> = None;
        for layer in 0..self.cfg.layers {
            let got = self.batch[layer].trim(n, bypass);
            if recording && first.is_none() {
                first = Some(got.as_ref().map(|x| *x).map_err(|e| format!("{e:?}")));
            }
            check::error_matches("batch trim", &expected, &got.map(|_| ()))?;
            if expected.is_ok() {
                for &id in &self.rows.clone() {
                    let t = self.reqs.get_mut(&id).unwrap().twin[layer].trim(n, bypass);
                    check::error_matches("twin trim", &expected, &t.map(|_| ()))?;
                }
            }
        }
        if cx.observer.wants_calls() {
            let offsets: Vec<usize> = before.iter().map(|s| s.offset).collect();
            let after_window = before.iter().all(|s| s.last_concat.is_some_and(|l| l >= n));
            let live = before.iter().map(|s| s.len).collect();
            let trim = TrimInfo { n: vec![n], bypass, kvsim: first.unwrap_or(Ok(0)), after_window, live };
            emit(cx, Call::Trim { reqs: &self.rows, offsets: &offsets, trim: &trim })?;
        }
        match expected {
            Ok(()) => {
                for (id, m) in models {
                    self.reqs.get_mut(&id).unwrap().model = m;
                }
            }
            Err(_) => self.counters.expected_errors += 1,
        }
        Ok(true)
    }

    // ----- checks ----------------------------------------------------------------------------------------------

    /// Checks one read: for each `(row, request, real query tokens, twin output)`, the row's output at its real
    /// query positions against the twin's (bytes) and the model (f64, ULPs), and the mask it used against the model.
    #[allow(clippy::too_many_arguments)]
    fn check_read(
        &mut self,
        cx: &mut Cx<'_>,
        layer: usize,
        kind: ReadKind,
        out: &Array,
        rows: &[(usize, u32, Vec<Tok>, Option<&Array>)],
        models: &BTreeMap<u32, RowModel>,
        mask: &MaskUse,
    ) -> Res<()> {
        let mut to_read: Vec<&Array> = vec![out];
        to_read.extend(rows.iter().filter_map(|r| r.3));
        let mut read = ArrayBytes::read_many(&to_read).map_err(|e| mlx_fail("read output", e))?.into_iter();
        let out_bytes = read.next().unwrap();
        cx.hasher.update(&out_bytes.digest());
        let l = out.shape()[2] as usize;
        let width = rows.iter().map(|(_, id, _, _)| models[id].cols.len()).max().unwrap_or(0);
        for (row, id, real, twin) in rows {
            let model = &models[id];
            let padded = model.cols.len() < width || real.len() < l;
            let class = kind.class(padded);
            // The mask each real query used must be exactly the model's visibility.
            for (i, q) in real.iter().enumerate() {
                let visible = match kind {
                    ReadKind::Decode => model.decode_visible(),
                    ReadKind::Window | ReadKind::PaddedWindow => model.window_visible(real.len(), i),
                };
                check::mask_row(mask, *row, i, &visible, l, width, kind)?;
                self.counters.checks += 1;
                let keys: Vec<Tok> = visible.iter().map(|&c| model.cols[c]).collect();
                self.out_vs_model(layer as u32, *q, &keys, keys.len(), self.cfg.scale(), &out_bytes, *row, i)?;
            }
            if twin.is_some() {
                let twin_bytes = read.next().unwrap();
                let tags = self.tags(*id, model);
                check::output_vs_twin(class, &tags, &out_bytes, *row, &twin_bytes, real.len(), &mut self.counters)?;
            }
        }
        Ok(())
    }

    /// One query's output against the model: the f64 attention over `keys` (plain storage), or over their
    /// dequantized values (affine storage, where only the first `stored` keys are stored; the others are attended
    /// as given).
    #[allow(clippy::too_many_arguments)]
    fn out_vs_model(
        &mut self,
        layer: u32,
        q: Tok,
        keys: &[Tok],
        stored: usize,
        scale: f32,
        out: &ArrayBytes,
        row: usize,
        i: usize,
    ) -> Res<()> {
        match self.storage.quant() {
            None => check::output_vs_model(&self.vs, layer, q, keys, scale, out, row, i, &mut self.counters),
            Some(qs) => {
                let rq = kvsim_reference::RefQuant { bits: qs.bits, group: qs.group };
                check::output_vs_model_quantized(
                    &self.vs,
                    rq,
                    layer,
                    q,
                    keys,
                    stored,
                    scale,
                    out,
                    row,
                    i,
                    &mut self.counters,
                )
            }
        }
    }

    /// The guarantees-table classes a read of request `id` (state `model` after the write) also belongs to.
    fn tags(&self, id: u32, model: &RowModel) -> Vec<&'static str> {
        let mut t = vec![];
        if model.max_size.is_some_and(|w| model.offset > w) {
            t.push("after_rotation");
        }
        let h = self.reqs.get(&id).map(|r| r.history).unwrap_or_default();
        if h.layout_event {
            t.push("after_merge_join_extract");
        }
        if h.rolled_back {
            t.push("after_speculative_rollback");
        }
        t
    }

    fn check_span(
        &mut self,
        cx: &mut Cx<'_>,
        layer: usize,
        out: &Array,
        rows: &[(usize, u32, Vec<Tok>, Option<&Array>)],
    ) -> Res<()> {
        let out_bytes = ArrayBytes::of(out).map_err(|e| mlx_fail("read output", e))?;
        cx.hasher.update(&out_bytes.digest());
        for (row, id, real, twin) in rows {
            // Rebuild the model position by position: position i is a decode read over the state after i+1 writes.
            let mut m = self.reqs[id].model.clone();
            for (i, q) in real.iter().enumerate() {
                m.decode_write(*q);
                let keys: Vec<Tok> = m.decode_visible().iter().map(|&c| m.cols[c]).collect();
                self.out_vs_model(layer as u32, *q, &keys, keys.len(), self.cfg.scale(), &out_bytes, *row, i)?;
            }
            if let Some(twin) = twin {
                let twin_bytes = ArrayBytes::of(twin).map_err(|e| mlx_fail("read twin output", e))?;
                let tags = self.tags(*id, &m);
                check::output_vs_twin(
                    check::OutClass::DecodeUnpadded,
                    &tags,
                    &out_bytes,
                    *row,
                    &twin_bytes,
                    real.len(),
                    &mut self.counters,
                )?;
            }
        }
        Ok(())
    }

    /// Hands the observer every live request's offset and per-layer temporal K/V views, from the production
    /// caches (batch rows first, in row order, then requests outside the batch). Nothing when it does not watch.
    pub fn record_checkpoint(&mut self, cx: &mut Cx<'_>) -> Res<()> {
        if !cx.observer.wants_calls() {
            return Ok(());
        }
        let affine = self.storage != Storage::Plain;
        let mut views = BTreeMap::new();
        for (row, id) in self.rows.iter().enumerate() {
            let (mut layers, mut planes) = (vec![], vec![]);
            for layer in 0..self.cfg.layers {
                let b = &self.batch[layer];
                if affine {
                    planes.push(b.row_temporal_view_planes(row).map_err(|e| unexpected("row_temporal_view", e))?);
                } else {
                    layers.push(b.row_temporal_view(row).map_err(|e| unexpected("row_temporal_view", e))?);
                }
            }
            let offset = self.batch[0].row_states()[row].ring.offset;
            views.insert(*id, StateView { offset, layers, planes: affine.then_some(planes) });
        }
        for r in self.reqs.values().filter(|r| r.home == Home::Solo) {
            let (mut layers, mut planes) = (vec![], vec![]);
            for layer in 0..self.cfg.layers {
                if affine {
                    planes.push(r.solo[layer].temporal_view_planes().map_err(|e| unexpected("temporal_view", e))?);
                } else {
                    layers.push(r.solo[layer].temporal_view().map_err(|e| unexpected("temporal_view", e))?);
                }
            }
            views.insert(r.id, StateView { offset: r.solo[0].offset(), layers, planes: affine.then_some(planes) });
        }
        cx.observer.on_state(views).map_err(|e| mlx_fail("observe", e))
    }

    /// After every op: every live request's state, bytes and kinds, in production, twin and model.
    pub fn check_all(&mut self, cx: &mut Cx<'_>) -> Res<()> {
        if self.storage != Storage::Plain {
            return self.check_all_planes(cx);
        }
        let rows_model = self.rows.len();
        for layer in 0..self.cfg.layers {
            check::row_count(&self.batch[layer], rows_model)?;
            check::kinds_batch(&self.batch[layer], self.max_size(), self.spec)?;
            let width = self.rows.iter().map(|id| self.reqs[id].model.cols.len()).max().unwrap_or(0);
            let expected_lp: Vec<i64> = self.rows.iter().map(|id| self.reqs[id].model.left_padding(width)).collect();
            check::left_padding(&self.batch[layer].left_padding(), &expected_lp)?;
            let trimmable = self.rows.iter().all(|id| self.reqs[id].model.is_trimmable());
            check::flag("batch is_trimmable", self.batch[layer].is_trimmable(), trimmable)?;
        }
        // Host-side state first (cheap), then every byte with one device round trip and few MLX ops: each layer's
        // batch buffers and all rows' temporal views (one gather per tensor), each solo cache's buffers and temporal
        // view, each twin's buffers. Physical columns (and the twins' temporal views) are cut on the host from the
        // buffers' bytes, by the same column rules the caches' `physical` / `temporal_view` use: the same bytes,
        // shapes and digests as reading those views through MLX, in a fraction of the MLX ops.
        let mut items: Vec<(String, u32, usize)> = vec![];
        // Where each item's production bytes come from: (batch layer, row) or a solo cache.
        enum Src {
            /// Row `row` of the batch buffers read at `layer_at[layer]`.
            Row { layer: usize, row: usize, len: usize },
            /// A serial cache's buffers at `at` (physical = columns `[0, len)`), its temporal view at `at + 2`.
            Solo { at: usize, len: usize },
        }
        let mut srcs: Vec<Src> = vec![];
        let mut arrays: Vec<Array> = vec![];
        let mut layer_at: Vec<Option<(usize, Vec<usize>)>> = vec![None; self.cfg.layers];
        if !self.rows.is_empty() {
            for (layer, slot) in layer_at.iter_mut().enumerate() {
                let b = &self.batch[layer];
                let (bk, bv) = match b.buffers() {
                    Some(x) => x,
                    None => continue,
                };
                let (tk, tv, counts) = b.temporal_views().map_err(|e| unexpected("temporal_views", e))?;
                *slot = Some((arrays.len(), counts));
                arrays.extend([bk, bv, tk, tv]);
            }
        }
        for (row, id) in self.rows.iter().enumerate() {
            for layer in 0..self.cfg.layers {
                let what = format!("row {row} (request {id}) layer {layer}");
                let model = &self.reqs[id].model;
                let ring = &self.batch[layer].row_states()[row].ring;
                check::ring_state(&what, ring, model)?;
                if layer_at[layer].is_some() {
                    srcs.push(Src::Row { layer, row, len: ring.len });
                } else {
                    // No buffer yet (rows that never stored a position): the views themselves, as `Solo` reads them.
                    let b = &self.batch[layer];
                    let p = b.row_physical(row).map_err(|e| unexpected("row_physical", e))?;
                    let t = b.row_temporal_view(row).map_err(|e| unexpected("row_temporal_view", e))?;
                    srcs.push(Src::Solo { at: arrays.len(), len: 0 });
                    arrays.extend([p.0, p.1, t.0, t.1]);
                }
                items.push((what, *id, layer));
            }
        }
        let solo: Vec<u32> = self.reqs.values().filter(|r| r.home == Home::Solo).map(|r| r.id).collect();
        for id in solo {
            for layer in 0..self.cfg.layers {
                let what = format!("solo request {id} layer {layer}");
                let r = &self.reqs[&id];
                let c = &r.solo[layer];
                check::ring_state(&what, c.state(), &r.model)?;
                check::kinds_serial(c, self.max_size(), self.spec)?;
                check::flag("solo is_trimmable", c.is_trimmable(), r.model.is_trimmable())?;
                let t = c.temporal_view().map_err(|e| unexpected("temporal_view", e))?;
                let at = arrays.len();
                match c.buffers() {
                    Some((k, v)) => arrays.extend([k, v, t.0, t.1]),
                    None => {
                        let (pk, pv) = c.physical().map_err(|e| unexpected("physical", e))?;
                        arrays.extend([pk, pv, t.0, t.1]);
                    }
                }
                srcs.push(Src::Solo { at, len: c.state().len });
                items.push((what, id, layer));
            }
        }
        let mut twin_at = vec![];
        for (what, id, layer) in &items {
            let r = &self.reqs[id];
            let twin = &r.twin[*layer];
            check::ring_state(&format!("twin of {what}"), twin.state(), &r.model)?;
            twin_at.push(arrays.len());
            match twin.buffers() {
                Some((k, v)) => arrays.extend([k, v]),
                None => {
                    let (pk, pv) = twin.physical().map_err(|e| unexpected("twin physical", e))?;
                    arrays.extend([pk, pv]);
                }
            }
        }
        let refs: Vec<&Array> = arrays.iter().collect();
        let bytes = ArrayBytes::read_many(&refs).map_err(|e| mlx_fail("read state", e))?;
        let cut = |b: &ArrayBytes, row: usize, cols: &[usize]| -> Res<ArrayBytes> {
            b.select_columns(row, cols).map_err(|e| mlx_fail("cut state", e))
        };
        for (n, (what, id, layer)) in items.iter().enumerate() {
            let ours: Vec<ArrayBytes> = match srcs[n] {
                Src::Row { layer: l, row, len } => {
                    let (at, counts) =
                        layer_at[l].as_ref().ok_or_else(|| mlx_fail("read state", "a batch row without buffers"))?;
                    let phys: Vec<usize> = (0..len).collect();
                    let tv: Vec<usize> = (0..counts[row]).collect();
                    vec![
                        cut(&bytes[*at], row, &phys)?,
                        cut(&bytes[at + 1], row, &phys)?,
                        cut(&bytes[at + 2], row, &tv)?,
                        cut(&bytes[at + 3], row, &tv)?,
                    ]
                }
                Src::Solo { at, len } => {
                    let phys: Vec<usize> = (0..len).collect();
                    vec![
                        cut(&bytes[at], 0, &phys)?,
                        cut(&bytes[at + 1], 0, &phys)?,
                        bytes[at + 2].clone(),
                        bytes[at + 3].clone(),
                    ]
                }
            };
            let twin = &self.reqs[id].twin[*layer];
            let at = twin_at[n];
            let phys: Vec<usize> = (0..twin.state().len).collect();
            let tv = twin.temporal_view_columns();
            let theirs = vec![
                cut(&bytes[at], 0, &phys)?,
                cut(&bytes[at + 1], 0, &phys)?,
                cut(&bytes[at], 0, &tv)?,
                cut(&bytes[at + 1], 0, &tv)?,
            ];
            self.check_storage(cx, what, *id, *layer, &ours, &theirs)?;
        }
        self.counters.checks += items.len() as u64;
        Ok(())
    }

    /// Production physical columns == model tokens (bytes); == twin's physical columns (bytes, same order);
    /// temporal views equal (bytes) and equal to the model's tail. `ours`/`theirs`: physical K, V, temporal K, V.
    fn check_storage(
        &mut self,
        cx: &mut Cx<'_>,
        what: &str,
        id: u32,
        layer: usize,
        ours: &[ArrayBytes],
        theirs: &[ArrayBytes],
    ) -> Res<()> {
        let model = &self.reqs[&id].model;
        for (i, tensor) in [Tensor::K, Tensor::V].into_iter().enumerate() {
            cx.hasher.update(&ours[i].digest());
            check::columns_vs_model(what, &self.vs, layer as u32, tensor, &ours[i], &model.cols)?;
            check::bytes_equal(&format!("{what} {tensor:?} physical vs twin"), &ours[i], &theirs[i])?;
            check::bytes_equal(&format!("{what} {tensor:?} temporal_view vs twin"), &ours[2 + i], &theirs[2 + i])?;
            check::columns_vs_model(
                &format!("{what} temporal_view"),
                &self.vs,
                layer as u32,
                tensor,
                &ours[2 + i],
                &model.temporal_view(),
            )?;
            self.counters.bit_exact_state += 3;
            self.counters.record_state(ours[i].dtype, 3);
            self.counters.checks += 4;
        }
        Ok(())
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

    fn view(&self) -> View {
        Attention::view(self)
    }

    fn counters(&self) -> &Counters {
        &self.counters
    }

    fn counters_mut(&mut self) -> &mut Counters {
        &mut self.counters
    }
}

/// Saves serial caches to bytes (kvsim's format, or an mlx-lm prompt-cache file when `via_mlxlm` and every cache
/// has an mlx-lm form that keeps its state: positions held, and no bypass-trim record, which mlx-lm's classes do not
/// carry), drops them, and restores them from the bytes alone.
fn persist_roundtrip(caches: Vec<SerialCache>, via_mlxlm: bool) -> Res<Vec<SerialCache>> {
    use kvsim_persist::inspect::{load_any, save_as, Format};
    use kvsim_persist::{mlxlm, AnyCache, Persisted};
    let fail = |what: &str, e: kvsim_persist::PersistError| Failure::new("persist", format!("{what}: {e}"));
    let spec_hints: Vec<_> = caches.iter().map(|c| c.spec()).collect();
    let mlx_ok = via_mlxlm && caches.iter().all(|c| mlxlm_keeps_state(&AnyCache::Serial(c.clone())));
    let format = if mlx_ok { Format::MlxLm } else { Format::Kvsim };
    // kvsim's format carries a reuse floor: attach one (half the offset) and require it back; mlx-lm files carry none.
    let floors: Vec<usize> = caches.iter().map(|c| if format == Format::Kvsim { c.offset() / 2 } else { 0 }).collect();
    let persisted: Vec<Persisted> = caches
        .into_iter()
        .zip(&floors)
        .map(|(c, &f)| Persisted { cache: AnyCache::Serial(c), minimum_reusable_offset: f })
        .collect();
    let bytes = save_as(format, &Default::default(), &persisted).map_err(|e| fail("save", e))?;
    drop(persisted);
    let restored = match format {
        Format::Kvsim => load_any(&bytes).map_err(|e| fail("restore", e))?.1,
        Format::MlxLm => {
            let f = mlxlm::read(&bytes).map_err(|e| fail("restore", e))?;
            f.layers
                .iter()
                .zip(spec_hints)
                .map(|(l, hint)| mlxlm::to_kvsim(l, Some(hint)).map(Persisted::new))
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| fail("restore", e))?
        }
    };
    let back: Vec<usize> = restored.iter().map(|p| p.minimum_reusable_offset).collect();
    if back != floors {
        crate::sim::check::fail(Failure::new("persist", format!("reuse floors {floors:?} saved, {back:?} restored")))?;
    }
    restored
        .into_iter()
        .map(|p| match p.cache {
            AnyCache::Serial(c) => Ok(c),
            other => Err(Failure::new("persist", format!("restored as {}", other.storage_kind()))),
        })
        .collect()
}

/// Whether a cache's mlx-lm form restores its whole state: it holds positions (an empty mlx-lm cache carries no
/// spec), has no bypass-trim record (`last_concat`: mlx-lm's classes carry none) and has an mlx-lm form at all.
pub(crate) fn mlxlm_keeps_state(c: &kvsim_persist::AnyCache) -> bool {
    use kvsim_persist::{mlxlm, AnyCache};
    let serial_ok = |s: &SerialCache| s.offset() > 0 && s.state().last_concat.is_none();
    let ok = match c {
        AnyCache::Serial(s) => serial_ok(s),
        AnyCache::Ssm(s) => !s.is_pending() && !s.in_round(),
        _ => false,
    };
    ok && mlxlm::from_kvsim(c).is_ok()
}
