//! The family that drives an [`Adapter`]'s caches: production (the adapter's serial caches and rows), one solo twin
//! per request and layer (the adapter's own serial cache, fed only that request), and the model (a `RowModel` per
//! request: the positions it holds and which each query sees, as if it ran alone; the values are the value
//! space's, the reads softmax attention in f64).

use std::collections::BTreeMap;

use mlx_rs::Array;

use super::{
    quant_of, Adapter, AdapterError, Geometry, GroupRead, QuantGeometry, RowsUnderTest, SerialUnderTest, Target,
};
use crate::sim::check::{self, Failure, OutClass};
use crate::sim::config::SimConfig;
use crate::sim::family::attention::payload_block;
use crate::sim::family::{Cx, Family};
use crate::sim::ops::Op;
use crate::sim::roster::{Change, Home, Roster};
use crate::sim::summary::Counters;
use kvsim_cache::bytes::ArrayBytes;
use kvsim_reference::quant::RefQuant;
use kvsim_reference::{RowModel, Tensor, Tok, ValueSpace};

type Res<T> = Result<T, Failure>;

/// One live request.
struct Req<S> {
    /// Its serial caches, one per layer, while it is outside the batch (empty while it is a row).
    solo: Vec<S>,
    /// Its solo twins, one per layer.
    twin: Vec<S>,
    /// What it holds, as if it ran alone (layers share it).
    model: RowModel,
}

/// One run's layers of the adapter's cache.
pub(super) struct Adapted<A: Adapter> {
    cfg: SimConfig,
    vs: ValueSpace,
    geometry: Geometry,
    reqs: BTreeMap<u32, Req<A::Serial>>,
    /// The running batch, one per layer (`None`: no rows).
    batch: Option<Vec<A::Rows>>,
    counters: Counters,
}

/// The twins of layer `l` of the requests `ids`, by id.
fn twins_of<'a, S>(reqs: &'a mut BTreeMap<u32, Req<S>>, ids: &[u32], l: usize) -> BTreeMap<u32, &'a mut S> {
    reqs.iter_mut().filter(|(id, _)| ids.contains(id)).map(|(&id, r)| (id, &mut r.twin[l])).collect()
}

/// A group of reads that answered fewer reads than it was asked (an adapter's bug).
fn short(what: &str) -> Failure {
    Failure::new("adapter_error", format!("read_group: {what}"))
}

fn refused(what: &str, e: AdapterError) -> Failure {
    if let Some(f) = e.downcast_ref::<super::engine::EngineFailure>() {
        return Failure::new("engine", format!("{what}: {f}"));
    }
    Failure::new("adapter_error", format!("{what}: the cache under test refused a call the model allows: {e}"))
}

fn read_fail(what: &str, e: impl std::fmt::Display) -> Failure {
    Failure::new("mlx", format!("{what}: {e}"))
}

impl<A: Adapter> Adapted<A> {
    pub(super) fn new(cfg: &SimConfig) -> Res<Adapted<A>> {
        if cfg.layout.max_size().is_some() && !A::supports().rotating {
            return Err(Failure::new("setup", "a sliding window, for a cache that does not support one"));
        }
        let quant = quant_of(cfg);
        if quant.is_some() && !A::supports().quant {
            return Err(Failure::new("setup", "a quantized run, for a cache that does not support one"));
        }
        A::begin_run().map_err(|e| refused("begin_run", e))?;
        // A quantized run's head dim is its own (a multiple of the group); the rest of the geometry is shared.
        let mut cfg = cfg.clone();
        if let Some(q) = quant {
            cfg.head_dim = q.head_dim;
        }
        let cfg = &cfg;
        let geometry = Geometry {
            heads_kv: cfg.heads_kv,
            heads_q: cfg.heads_q,
            head_dim: cfg.head_dim,
            dtype: cfg.kv_spec().dtype.to_mlx(),
            max_size: cfg.layout.max_size(),
            // Quantized from the first write (`native`, or an adapter that quantizes only); else plain until the
            // conversion op.
            quant: quant
                .filter(|q| q.native || A::supports().quant_only)
                .map(|q| QuantGeometry { bits: q.bits, group_size: q.group }),
        };
        Ok(Adapted {
            cfg: cfg.clone(),
            vs: cfg.value_space(),
            geometry,
            reqs: BTreeMap::new(),
            batch: None,
            counters: Counters::default(),
        })
    }

    fn serial(&self) -> Res<A::Serial> {
        A::serial(&self.geometry).map_err(|e| refused("a new serial cache", e))
    }

    /// The run's quantization as kvsim's reference takes it.
    fn ref_quant(&self) -> Option<RefQuant> {
        self.geometry.quant.map(|q| RefQuant { bits: q.bits, group: q.group_size })
    }

    fn toks(&self, req: u32, from: usize, n: usize) -> Vec<Option<Tok>> {
        (from..from + n).map(|p| Some(Tok::new(req, p as u32))).collect()
    }

    fn block(&self, layer: usize, t: Tensor, toks: &[Vec<Option<Tok>>]) -> Res<Array> {
        payload_block(&self.cfg, &self.vs, layer, t, toks)
    }

    fn kvq(&self, layer: usize, toks: &[Vec<Option<Tok>>]) -> Res<[Array; 3]> {
        Ok([
            self.block(layer, Tensor::K, toks)?,
            self.block(layer, Tensor::V, toks)?,
            self.block(layer, Tensor::Q, toks)?,
        ])
    }

    // ----- lifecycle ---------------------------------------------------------------------------------------------

    fn carry_out(&mut self, change: &Change, join: bool) -> Res<bool> {
        match change {
            Change::Admit { req } => {
                let layers = self.cfg.layers;
                let solo = (0..layers).map(|_| self.serial()).collect::<Res<Vec<_>>>()?;
                let twin = (0..layers).map(|_| self.serial()).collect::<Res<Vec<_>>>()?;
                let model = RowModel::new(self.cfg.layout.max_size());
                self.reqs.insert(*req, Req { solo, twin, model });
            }
            Change::Enter { ids, perm } => {
                let mut per_layer: Vec<Vec<A::Serial>> = (0..self.cfg.layers).map(|_| vec![]).collect();
                for id in ids {
                    let r = self.reqs.get_mut(id).expect("a live request");
                    for (l, s) in std::mem::take(&mut r.solo).into_iter().enumerate() {
                        per_layer[l].push(s);
                    }
                }
                let mut entering = vec![];
                for serials in per_layer {
                    let rows = if join && A::supports().join {
                        let refs: Vec<&A::Serial> = serials.iter().collect();
                        A::Rows::join(&refs).map_err(|e| refused("join", e))?
                    } else {
                        A::Rows::merge(serials).map_err(|e| refused("merge", e))?
                    };
                    entering.push(rows);
                }
                match &mut self.batch {
                    None => self.batch = Some(entering),
                    Some(batch) => {
                        for (b, new) in batch.iter_mut().zip(entering) {
                            b.filter(perm).map_err(|e| refused("filter (the running rows reordered)", e))?;
                            b.extend(new).map_err(|e| refused("extend", e))?;
                        }
                    }
                }
            }
            Change::Extract { row, req, finish, keep } => {
                let batch = self.batch.as_mut().expect("a row implies a batch");
                let mut out = vec![];
                for b in batch.iter_mut() {
                    out.push(b.extract(*row).map_err(|e| refused("extract", e))?);
                    if !keep.is_empty() {
                        b.filter(keep).map_err(|e| refused("filter (after extract)", e))?;
                    }
                }
                if keep.is_empty() {
                    self.batch = None;
                }
                if *finish {
                    self.reqs.remove(req);
                } else {
                    self.reqs.get_mut(req).expect("a live request").solo = out;
                }
            }
            Change::Filter { kept, dropped } => {
                if kept.is_empty() {
                    self.batch = None;
                } else if let Some(batch) = &mut self.batch {
                    for b in batch.iter_mut() {
                        b.filter(kept).map_err(|e| refused("filter", e))?;
                    }
                }
                for id in dropped {
                    self.reqs.remove(id);
                }
            }
            Change::Prefill { .. } => {
                return Err(Failure::new("setup", "a batch prefill reached a family that does not support it"))
            }
        }
        Ok(true)
    }

    /// An `extract` of a row the batch does not have must be an error, the batch unchanged (the state checks after
    /// the op compare every byte).
    fn extract_missing(&mut self, row: usize) -> Res<bool> {
        let Some(batch) = &self.batch else { return Ok(false) };
        for (l, b) in batch.iter().enumerate() {
            if b.extract(row).is_ok() {
                return check::fail(Failure::new(
                    "missing_row_accepted",
                    format!("layer {l}: extract of row {row} of a batch of {} rows returned a cache", b.rows()),
                ))
                .map(|_| true);
            }
            self.counters.expected_errors += 1;
        }
        Ok(true)
    }

    // ----- reads -------------------------------------------------------------------------------------------------

    /// A window of `len` positions (`decode`: the one-position step) on request `id` outside the batch.
    fn solo_read(&mut self, cx: &mut Cx<'_>, id: u32, len: usize, decode: bool) -> Res<bool> {
        if !cx.roster.is_solo(id) || len == 0 {
            return Ok(false);
        }
        let scale = self.cfg.scale();
        let from = self.reqs[&id].model.offset;
        let toks = vec![self.toks(id, from, len)];
        let seen = self.advance(id, &toks[0], decode);
        for l in 0..self.cfg.layers {
            let [k, v, q] = self.kvq(l, &toks)?;
            if l + 1 == self.cfg.layers {
                self.prefetch_checks(cx.roster);
            }
            let r = self.reqs.get_mut(&id).expect("live");
            let (solo, twin) = (&mut r.solo[l], &mut r.twin[l]);
            let reads = vec![
                GroupRead { target: Target::Serial(solo), decode, k: &k, v: &v, q: &q },
                GroupRead { target: Target::Serial(twin), decode, k: &k, v: &v, q: &q },
            ];
            let mut out = A::read_group(reads, scale).into_iter();
            let (got, twin) =
                (out.next().ok_or_else(|| short("no read"))?, out.next().ok_or_else(|| short("no twin read"))?);
            let got = got.map_err(|e| refused("solo read", e))?;
            let twin = twin.map_err(|e| refused("twin read", e))?;
            self.compare(cx, l, &got, &[(0, id, twin)], &[seen.clone()], (1, len), "solo read")?;
        }
        Ok(true)
    }

    /// A decode (`len = 1`, `window = false`) or window of `len` positions on every row of the batch.
    fn rows_read(&mut self, cx: &mut Cx<'_>, len: usize, window: bool) -> Res<bool> {
        let ids: Vec<u32> = cx.roster.rows().to_vec();
        if ids.is_empty() || self.batch.is_none() || len == 0 {
            return Ok(false);
        }
        let scale = self.cfg.scale();
        let froms: Vec<usize> = ids.iter().map(|id| self.reqs[id].model.offset).collect();
        let toks: Vec<Vec<Option<Tok>>> = ids.iter().zip(&froms).map(|(&id, &f)| self.toks(id, f, len)).collect();
        let seen: Vec<Vec<Vec<Tok>>> = ids.iter().zip(&toks).map(|(&id, t)| self.advance(id, t, !window)).collect();
        for l in 0..self.cfg.layers {
            let [k, v, q] = self.kvq(l, &toks)?;
            let inputs: Vec<[Array; 3]> =
                (0..ids.len()).map(|r| self.kvq(l, std::slice::from_ref(&toks[r]))).collect::<Res<_>>()?;
            if l + 1 == self.cfg.layers {
                self.prefetch_checks(cx.roster);
            }
            let b = &mut self.batch.as_mut().expect("rows")[l];
            let mut reads = vec![GroupRead { target: Target::Rows(b), decode: !window, k: &k, v: &v, q: &q }];
            let mut twins_of = twins_of(&mut self.reqs, &ids, l);
            for (&id, [k, v, q]) in ids.iter().zip(&inputs) {
                let t = twins_of.remove(&id).ok_or_else(|| short("a row without its twin"))?;
                reads.push(GroupRead { target: Target::Serial(t), decode: !window, k, v, q });
            }
            let mut out = A::read_group(reads, scale).into_iter();
            let got = out.next().ok_or_else(|| short("no read"))?;
            let got = got.map_err(|e| refused(if window { "rows window" } else { "rows decode" }, e))?;
            let mut twins = vec![];
            for (r, &id) in ids.iter().enumerate() {
                let t = out.next().ok_or_else(|| short("no twin read"))?;
                twins.push((r, id, t.map_err(|e| refused("twin read", e))?));
            }
            let what = if window { "rows window" } else { "rows decode" };
            self.compare(cx, l, &got, &twins, &seen, (ids.len(), len), what)?;
        }
        Ok(true)
    }

    /// A right-padded batch prefill: the fresh requests `ids` (empty, outside the batch) merged into new rows, readied
    /// for prompts of `lens` positions ([`RowsUnderTest::prepare`]), fed `max(lens)` positions per row in windows of
    /// `chunk` (row `r` padded after its `lens[r]`), finalized, and appended after the running rows. Each window's
    /// real queries are compared with the request's twin, which reads the same positions in the same chunks alone.
    fn prefill(&mut self, cx: &mut Cx<'_>, ids: &[u32], lens: &[usize], chunk: usize) -> Res<bool> {
        if !A::supports().prefill {
            return Err(Failure::new("setup", "a batch prefill reached a cache that does not support one"));
        }
        let width = lens.iter().copied().max().unwrap_or(0);
        let scale = self.cfg.scale();
        let mut per_layer: Vec<Vec<A::Serial>> = (0..self.cfg.layers).map(|_| vec![]).collect();
        for id in ids {
            let r = self.reqs.get_mut(id).expect("a live request");
            for (l, s) in std::mem::take(&mut r.solo).into_iter().enumerate() {
                per_layer[l].push(s);
            }
        }
        let mut rows = vec![];
        for serials in per_layer {
            let mut b = A::Rows::merge(serials).map_err(|e| refused("merge (a prefill's rows)", e))?;
            b.prepare(lens).map_err(|e| refused("rows_prepare", e))?;
            rows.push(b);
        }
        let mut from = 0;
        while from < width {
            let len = chunk.max(1).min(width - from);
            let toks: Vec<Vec<Option<Tok>>> = ids
                .iter()
                .zip(lens)
                .map(|(&id, &n)| (from..from + len).map(|p| (p < n).then(|| Tok::new(id, p as u32))).collect())
                .collect();
            let real: Vec<Vec<Option<Tok>>> =
                toks.iter().map(|t| t.iter().flatten().map(|t| Some(*t)).collect()).collect();
            let mut seen = vec![];
            for (&id, t) in ids.iter().zip(&real) {
                if !t.is_empty() {
                    seen.push(self.advance(id, t, false));
                }
            }
            for (l, b) in rows.iter_mut().enumerate() {
                let [k, v, q] = self.kvq(l, &toks)?;
                let with_real: Vec<usize> = (0..ids.len()).filter(|&r| !real[r].is_empty()).collect();
                let inputs: Vec<[Array; 3]> =
                    with_real.iter().map(|&r| self.kvq(l, std::slice::from_ref(&real[r]))).collect::<Res<_>>()?;
                let mut reads = vec![GroupRead { target: Target::Rows(b), decode: false, k: &k, v: &v, q: &q }];
                let real_ids: Vec<u32> = with_real.iter().map(|&r| ids[r]).collect();
                let mut twins_of = twins_of(&mut self.reqs, &real_ids, l);
                for (&id, [k, v, q]) in real_ids.iter().zip(&inputs) {
                    let t = twins_of.remove(&id).ok_or_else(|| short("a row without its twin"))?;
                    reads.push(GroupRead { target: Target::Serial(t), decode: false, k, v, q });
                }
                let mut out = A::read_group(reads, scale).into_iter();
                let got =
                    out.next().ok_or_else(|| short("no read"))?.map_err(|e| refused("rows window (prefill)", e))?;
                let mut twins = vec![];
                for (&r, &id) in with_real.iter().zip(&real_ids) {
                    let t = out.next().ok_or_else(|| short("no twin read"))?;
                    twins.push((r, id, t.map_err(|e| refused("twin read", e))?));
                }
                self.compare(cx, l, &got, &twins, &seen, (ids.len(), len), "prefill window")?;
            }
            from += len;
        }
        for b in rows.iter_mut() {
            b.finalize().map_err(|e| refused("rows_finalize", e))?;
        }
        match &mut self.batch {
            None => self.batch = Some(rows),
            Some(batch) => {
                for (b, new) in batch.iter_mut().zip(rows) {
                    b.extend(new).map_err(|e| refused("extend (after a prefill)", e))?;
                }
            }
        }
        Ok(true)
    }

    /// The model of request `id` takes `toks` (a decode when `decode`); returns the positions each of them sees.
    fn advance(&mut self, id: u32, toks: &[Option<Tok>], decode: bool) -> Vec<Vec<Tok>> {
        let m = &mut self.reqs.get_mut(&id).expect("live").model;
        let toks: Vec<Tok> = toks.iter().flatten().copied().collect();
        if decode {
            m.decode_write(toks[0]);
            vec![m.decode_visible().into_iter().map(|c| m.cols[c]).collect()]
        } else {
            m.window_write(&toks);
            (0..toks.len()).map(|i| m.window_visible(toks.len(), i).into_iter().map(|c| m.cols[c]).collect()).collect()
        }
    }

    /// Compares a read's output (`[B, heads_q, L, D]`, `(B, L) = (rows, len)`) with the twin outputs `twins` (`(row, request,
    /// output)`: the request of batch row `row`, whose twin read its real queries, the row's first ones) and with
    /// the f64 model over the positions each real query sees (`seen[j][i]` for `twins[j]`). Every row of the batch
    /// is in `twins` except, in a right-padded prefill, the rows with no real position in the window.
    #[allow(clippy::too_many_arguments)]
    fn compare(
        &mut self,
        cx: &mut Cx<'_>,
        layer: usize,
        got: &Array,
        twins: &[(usize, u32, Array)],
        seen: &[Vec<Vec<Tok>>],
        (rows, len): (usize, usize),
        what: &str,
    ) -> Res<()> {
        let mut arrays = vec![got];
        arrays.extend(twins.iter().map(|t| &t.2));
        let bytes = ArrayBytes::read_many(&arrays).map_err(|e| read_fail(what, e))?;
        let want = [rows as i32, self.geometry.heads_q as i32, len as i32, self.geometry.head_dim as i32];
        if bytes[0].shape != want || bytes[0].dtype != self.geometry.dtype {
            return check::fail(Failure::new(
                "output_shape",
                format!(
                    "{what}, layer {layer}: output {:?} {:?}, expected {want:?} {:?}",
                    bytes[0].shape, bytes[0].dtype, self.geometry.dtype
                ),
            ));
        }
        cx.hasher.update(&bytes[0].digest());
        let exact = self.counters.guarantees.exact_unpadded_decode;
        for (j, (r, id, _)) in twins.iter().enumerate() {
            let r = *r;
            let cols: Vec<usize> = (0..seen[j].len()).collect();
            let row = bytes[0].select_columns(r, &cols).map_err(|e| read_fail(what, e))?;
            let twin = &bytes[j + 1];
            let worst = if exact || row.shape != twin.shape {
                check::bytes_equal(&format!("{what}, layer {layer}, row {r}"), &row, twin)
                    .map_err(|f| Failure::new("rows_vs_solo", format!("{} (request {id})", f.message)))?;
                0
            } else {
                check::max_ulp_at_scale(&row, twin)
            };
            self.counters.checks += 1;
            let class = if len == 1 { OutClass::DecodeUnpadded } else { OutClass::Window };
            self.counters.record_twin(class, &[A::NAME], self.geometry.dtype, worst);
            for (i, keys) in seen[j].iter().enumerate() {
                let q = keys.iter().copied().max_by_key(|t| t.pos).unwrap_or(Tok::new(*id, 0));
                let (vs, l, scale, out) = (&self.vs, layer as u32, self.cfg.scale(), &bytes[0]);
                match self.ref_quant() {
                    // Every key the read attends is stored (quantized) before the read.
                    Some(rq) => check::output_vs_model_quantized(
                        vs,
                        rq,
                        l,
                        q,
                        keys,
                        keys.len(),
                        scale,
                        out,
                        r,
                        i,
                        &mut self.counters,
                    )?,
                    None => check::output_vs_model(vs, l, q, keys, scale, out, r, i, &mut self.counters)?,
                }
            }
        }
        Ok(())
    }

    // ----- conversion --------------------------------------------------------------------------------------------

    /// The conversion op: every cache of a plain run (each live request's serial caches and twins, the batch) converted
    /// to `bits` in groups of `group` at once. Parameters MLX takes must be taken by every cache (then the run is
    /// quantized: its states are checked as planes from here on); others must be refused by every cache
    /// (`convert_refusal`). A run already quantized skips the op.
    fn convert(&mut self, cx: &mut Cx<'_>, bits: usize, group: usize) -> Res<bool> {
        if self.geometry.quant.is_some() || !A::supports().convert {
            return Ok(false);
        }
        let valid =
            matches!(bits, 2..=6 | 8) && matches!(group, 32 | 64 | 128) && self.geometry.head_dim.is_multiple_of(group);
        let q = QuantGeometry { bits, group_size: group };
        let mut results: Vec<(String, super::AdapterResult<()>)> = vec![];
        for id in cx.roster.live().collect::<Vec<_>>() {
            let r = self.reqs.get_mut(&id).expect("live");
            for (l, s) in r.solo.iter_mut().enumerate() {
                results.push((format!("request {id} layer {l}"), s.convert(q)));
            }
            for (l, t) in r.twin.iter_mut().enumerate() {
                results.push((format!("the twin of request {id} layer {l}"), t.convert(q)));
            }
        }
        if let Some(batch) = &mut self.batch {
            for (l, b) in batch.iter_mut().enumerate() {
                results.push((format!("the batch's layer {l}"), b.convert(q)));
            }
        }
        for (what, r) in results {
            match (valid, r) {
                (true, Err(e)) => {
                    let f = refused("convert", e);
                    return Err(Failure::new(&f.check, format!("{} ({what}; {bits} bits, group {group})", f.message)));
                }
                (false, Ok(())) => {
                    return check::fail(Failure::new(
                        "convert_refusal",
                        format!("{what}: converted to {bits} bits in groups of {group}, which MLX does not quantize"),
                    ))
                    .map(|_| true)
                }
                (false, Err(_)) => self.counters.expected_errors += 1,
                (true, Ok(())) => {}
            }
        }
        self.counters.checks += 1;
        if valid {
            self.geometry.quant = Some(q);
        }
        Ok(true)
    }

    // ----- trims -------------------------------------------------------------------------------------------------

    /// What a trim of `n` must drop from `m`: `min(n, offset)` while the model is trimmable, else 0.
    fn trim_want(m: &RowModel, n: usize) -> usize {
        if m.is_trimmable() {
            n.min(m.offset)
        } else {
            0
        }
    }

    fn solo_trim(&mut self, cx: &mut Cx<'_>, id: u32, n: usize) -> Res<bool> {
        if !cx.roster.is_solo(id) {
            return Ok(false);
        }
        let r = self.reqs.get_mut(&id).expect("live");
        let want = Self::trim_want(&r.model, n);
        for (l, (s, t)) in r.solo.iter_mut().zip(r.twin.iter_mut()).enumerate() {
            let got = s.trim(n).map_err(|e| refused("trim", e))?;
            let twin = t.trim(n).map_err(|e| refused("twin trim", e))?;
            if got != want || twin != want {
                return check::fail(Failure::new(
                    "trim_count",
                    format!(
                        "layer {l}: trim({n}) of {} positions dropped {got} (twin {twin}), expected {want}{}",
                        r.model.offset,
                        if r.model.is_trimmable() { "" } else { " (the window has filled: nothing may go)" }
                    ),
                ))
                .map(|_| true);
            }
        }
        if want > 0 {
            r.model.trim(want, false).map_err(|e| Failure::new("model", format!("trim {want}: {e:?}")))?;
        }
        self.counters.checks += 1;
        Ok(true)
    }

    /// A trim of every row, where every row alone answers alike (all drop `n`, or all refuse; otherwise skipped):
    /// each row's twin first (against the model), then the batch, which must drop what the twins dropped
    /// (`rows_trim_vs_solo`).
    fn rows_trim(&mut self, cx: &mut Cx<'_>, n: usize) -> Res<bool> {
        let ids: Vec<u32> = cx.roster.rows().to_vec();
        if self.batch.is_none() || n == 0 || ids.iter().any(|id| self.reqs[id].model.offset < n) {
            return Ok(false);
        }
        // A uniform trim has one answer only where every row alone gives the same (all drop `n`, or all refuse).
        let wants: Vec<usize> = ids.iter().map(|id| Self::trim_want(&self.reqs[id].model, n)).collect();
        if wants.iter().any(|&w| w != wants[0]) {
            return Ok(false);
        }
        if !self.trim_twins(&ids, &vec![n; ids.len()], &wants)? {
            return Ok(true);
        }
        let solo = wants;
        let batch = self.batch.as_mut().expect("rows");
        for (l, b) in batch.iter_mut().enumerate() {
            let got = b.trim(n).map_err(|e| refused("rows trim", e))?;
            if solo.iter().any(|&w| w != got) {
                return check::fail(Failure::new(
                    "rows_trim_vs_solo",
                    format!("layer {l}: the rows' trim({n}) dropped {got}; each row alone drops {solo:?}"),
                ))
                .map(|_| true);
            }
        }
        self.trim_models(&ids, &solo)?;
        self.counters.checks += 1;
        Ok(true)
    }

    /// Each row's twins trimmed by `asks[i]` (row by row, each layer in order), each of which must drop `wants[i]`
    /// (`trim_count`). `false` when one did not and the failure was recorded (a suppressing check run goes on):
    /// the op ends there.
    fn trim_twins(&mut self, ids: &[u32], asks: &[usize], wants: &[usize]) -> Res<bool> {
        for ((id, &ask), &want) in ids.iter().zip(asks).zip(wants) {
            let r = self.reqs.get_mut(id).expect("live");
            for (l, t) in r.twin.iter_mut().enumerate() {
                let got = t.trim(ask).map_err(|e| refused("twin trim", e))?;
                if got != want {
                    return check::fail(Failure::new(
                        "trim_count",
                        format!("request {id} layer {l}: its twin's trim({ask}) dropped {got}, expected {want}"),
                    ))
                    .map(|_| false);
                }
            }
        }
        Ok(true)
    }

    /// Each row's model trimmed by what its row dropped.
    fn trim_models(&mut self, ids: &[u32], dropped: &[usize]) -> Res<()> {
        for (id, &k) in ids.iter().zip(dropped) {
            if k > 0 {
                let m = &mut self.reqs.get_mut(id).expect("live").model;
                m.trim(k, false).map_err(|e| Failure::new("model", format!("trim {k}: {e:?}")))?;
            }
        }
        Ok(())
    }

    /// A speculative rollback with per-row accepts ([`super::Supports::rows_trim_rows`]): row `r` (in batch order)
    /// drops `n - (r mod (n + 1))` positions, where each row alone drops exactly that (otherwise skipped): each
    /// row's twin first (against the model), then the batch's per-row trim, which must drop per row what the twins
    /// dropped (`rows_trim_vs_solo`); the reads and state checks that follow judge what each row kept.
    fn rows_trim_rows(&mut self, cx: &mut Cx<'_>, n: usize) -> Res<bool> {
        let ids: Vec<u32> = cx.roster.rows().to_vec();
        let counts: Vec<usize> = (0..ids.len()).map(|r| n - r % (n + 1)).collect();
        if self.batch.is_none() || n == 0 {
            return Ok(false);
        }
        let fits = ids.iter().zip(&counts).all(|(id, &k)| {
            let m = &self.reqs[id].model;
            m.offset >= k && Self::trim_want(m, k) == k
        });
        if !fits {
            return Ok(false);
        }
        if !self.trim_twins(&ids, &counts, &counts)? {
            return Ok(true);
        }
        let batch = self.batch.as_mut().expect("rows");
        for (l, b) in batch.iter_mut().enumerate() {
            let got = b.trim_rows(&counts).map_err(|e| refused("rows per-row trim", e))?;
            if got != counts {
                return check::fail(Failure::new(
                    "rows_trim_vs_solo",
                    format!("layer {l}: the rows' per-row trim({counts:?}) dropped {got:?}; each row alone drops {counts:?}"),
                ))
                .map(|_| true);
            }
        }
        self.trim_models(&ids, &counts)?;
        self.counters.checks += 1;
        Ok(true)
    }

    // ----- state -------------------------------------------------------------------------------------------------

    /// Tells the adapter which reads the state checks will make after a read op ([`Adapter::prefetch`]): a read
    /// leaves the roster, the batch and the requests as they are, so they are the reads [`Self::check_all`] makes.
    fn prefetch_checks(&self, roster: &Roster) {
        if self.batch.is_some() || roster.rows().is_empty() {
            A::prefetch(&self.check_reads(roster));
        }
    }

    /// The reads of [`Self::check_all`], in the order it judges them.
    fn check_reads(&self, roster: &Roster) -> Vec<super::Read<'_, A::Serial, A::Rows>> {
        use super::Read;
        let rows = roster.rows();
        let quant = self.geometry.quant.is_some();
        let mut reads: Vec<Read<'_, A::Serial, A::Rows>> = vec![];
        if let Some(batch) = &self.batch {
            reads.extend(batch.iter().map(Read::Info));
        }
        for id in roster.live() {
            let r = &self.reqs[&id];
            for l in 0..self.cfg.layers {
                match roster.home(id) {
                    Some(Home::Batch) => {
                        let row = rows.iter().position(|x| *x == id).expect("a row");
                        let b = &self.batch.as_ref().expect("rows")[l];
                        reads.push(if quant { Read::RowPlanes(b, row) } else { Read::RowState(b, row) });
                    }
                    _ => reads.extend([
                        Read::Offset(&r.solo[l]),
                        if quant { Read::Planes(&r.solo[l]) } else { Read::State(&r.solo[l]) },
                    ]),
                }
                reads.push(if quant { Read::Planes(&r.twin[l]) } else { Read::State(&r.twin[l]) });
            }
        }
        reads
    }

    /// Every live request's K and V (production and twin) against the exact bytes of the positions it holds. The
    /// reads are made at once ([`Adapter::read_all`]: the batch's rows and offsets per layer; per live request and
    /// layer its offset outside the batch, its state and its twin's) and judged in that order.
    fn check_all(&mut self, cx: &mut Cx<'_>) -> Res<()> {
        use super::ReadOut;
        let rows = cx.roster.rows();
        if self.batch.is_none() && !rows.is_empty() {
            return check::fail(Failure::new("rows", "the schedule has rows and the family no batch"));
        }
        let live: Vec<u32> = cx.roster.live().collect();
        let quant = self.geometry.quant.is_some();
        let reads = self.check_reads(cx.roster);
        let mut out = A::read_all(&reads).into_iter();
        drop(reads);
        let mut next = || out.next().unwrap_or_else(|| Err("the adapter answered fewer reads than asked".into()));
        // A state read's arrays: K and V, or a quantized run's six planes.
        let state = |r: super::AdapterResult<ReadOut>, what: &str| -> Res<Vec<Array>> {
            match r.map_err(|e| refused(what, e))? {
                ReadOut::State(kv) if !quant => Ok(kv.into()),
                ReadOut::Planes(p) if quant => Ok(p.into()),
                _ => Err(Failure::new("adapter_error", format!("{what}: the adapter answered another read"))),
            }
        };
        if let Some(batch) = &self.batch {
            for l in 0..batch.len() {
                let (n, offsets) = match next() {
                    Ok(ReadOut::Info(n, o)) => (n, o),
                    Err(e) => return check::fail(Failure::new("offsets", format!("layer {l}: {e}"))),
                    _ => (usize::MAX, vec![]),
                };
                if n != rows.len() {
                    return check::fail(Failure::new(
                        "rows",
                        format!("layer {l}: the batch holds {n} rows, the schedule {}", rows.len()),
                    ));
                }
                let want: Vec<usize> = rows.iter().map(|id| self.reqs[id].model.offset).collect();
                if offsets != want {
                    return check::fail(Failure::new(
                        "offsets",
                        format!("layer {l}: the batch's offsets {offsets:?}, the model's {want:?}"),
                    ));
                }
            }
        }
        for id in live {
            let r = &self.reqs[&id];
            let view: Vec<Option<Tok>> = r.model.temporal_view().into_iter().map(Some).collect();
            let offset = r.model.offset;
            let toks = vec![view];
            for l in 0..self.cfg.layers {
                let (prod, where_) = match cx.roster.home(id) {
                    Some(Home::Batch) => {
                        let row = rows.iter().position(|x| *x == id).expect("a row");
                        (state(next(), "row_state")?, format!("row {row}"))
                    }
                    _ => {
                        let got = match next() {
                            Ok(ReadOut::Offset(o)) => o,
                            _ => usize::MAX,
                        };
                        if got != offset {
                            return check::fail(Failure::new(
                                "offsets",
                                format!("request {id} layer {l}: offset {got}, the model's {offset}"),
                            ));
                        }
                        (state(next(), "state")?, "outside the batch".to_string())
                    }
                };
                let twin = state(next(), "twin state")?;
                if let Some(rq) = self.ref_quant() {
                    let who = format!("request {id} ({where_}) layer {l}");
                    let view = r.model.temporal_view();
                    planes_vs_model(cx, &self.vs, &mut self.counters, l, &who, [&prod, &twin], rq, &view)?;
                    continue;
                }
                let want = [self.block(l, Tensor::K, &toks)?, self.block(l, Tensor::V, &toks)?];
                let all: Vec<&Array> = prod.iter().chain(&twin).chain(&want).collect();
                let b = ArrayBytes::read_many(&all).map_err(|e| read_fail("state", e))?;
                for (i, name) in ["K", "V"].iter().enumerate() {
                    for (got, who) in [(&b[i], where_.as_str()), (&b[2 + i], "its twin")] {
                        let empty = toks[0].is_empty() && got.words.is_empty();
                        if !empty && got.first_difference(&b[4 + i]).is_some() {
                            return check::fail(Failure::new(
                                "state_vs_model",
                                format!(
                                    "request {id} ({who}) layer {l}: {name} is {:?} {:?}, not the {} positions the next \
                                     read attends (first difference at element {})",
                                    got.shape,
                                    got.dtype,
                                    toks[0].len(),
                                    got.first_difference(&b[4 + i]).unwrap_or(0)
                                ),
                            ));
                        }
                    }
                    cx.hasher.update(&b[i].digest());
                }
                self.counters.checks += 1;
                self.counters.bit_exact_state += 1;
            }
        }
        Ok(())
    }
}

/// A quantized state (production's six planes, then the twin's) against `mx.quantize` of the positions the next read
/// attends (kvsim's reference triple of each token, bytes; `state_vs_model`).
#[allow(clippy::too_many_arguments)]
fn planes_vs_model(
    cx: &mut Cx<'_>,
    vs: &ValueSpace,
    counters: &mut Counters,
    layer: usize,
    what: &str,
    [prod, twin]: [&[Array]; 2],
    rq: RefQuant,
    view: &[Tok],
) -> Res<()> {
    let all: Vec<&Array> = prod.iter().chain(twin).collect();
    let b = ArrayBytes::read_many(&all).map_err(|e| read_fail("state", e))?;
    for (planes, who) in [(&b[..6], what.to_string()), (&b[6..], format!("{what}, its twin"))] {
        crate::sim::family::quant::planes_vs_model(&who, vs, layer as u32, rq, planes, view)
            .map_err(|f| Failure::new("state_vs_model", f.message))?;
    }
    for p in &b[..6] {
        cx.hasher.update(&p.digest());
    }
    counters.checks += 1;
    counters.bit_exact_state += 6;
    Ok(())
}

impl<A: Adapter> Family for Adapted<A> {
    fn key(&self) -> &'static str {
        A::NAME
    }

    fn apply(&mut self, op: &Op, cx: &mut Cx<'_>) -> Res<bool> {
        if let Some(Change::Prefill { ids, lens, chunk, .. }) = cx.change {
            let (ids, lens, chunk) = (ids.clone(), lens.clone(), *chunk);
            return self.prefill(cx, &ids, &lens, chunk);
        }
        if let Some(change) = cx.change {
            return self.carry_out(change, matches!(op, Op::Join { .. }));
        }
        match op {
            Op::Extract { row, .. } => self.extract_missing(*row as usize),
            Op::SoloWindow { req, len } => self.solo_read(cx, *req, *len as usize, false),
            Op::SoloDecode { req } => self.solo_read(cx, *req, 1, true),
            Op::SoloTrim { req, n, .. } => self.solo_trim(cx, *req, *n as usize),
            Op::Decode => self.rows_read(cx, 1, false),
            Op::Window { len } => self.rows_read(cx, *len as usize, true),
            Op::Trim { n, bypass } if *bypass && A::supports().rows_trim_rows => self.rows_trim_rows(cx, *n as usize),
            Op::Trim { n, .. } => self.rows_trim(cx, *n as usize),
            Op::Quantize { bits, group, .. } => self.convert(cx, *bits as usize, *group as usize),
            _ => Ok(false),
        }
    }

    fn check_state(&mut self, cx: &mut Cx<'_>) -> Res<()> {
        self.check_all(cx)
    }

    fn observe_state(&mut self, _cx: &mut Cx<'_>) -> Res<()> {
        Ok(())
    }

    fn position(&self, req: u32) -> Option<(usize, Option<usize>)> {
        self.reqs.get(&req).map(|r| (r.model.offset, r.model.last_concat))
    }

    fn counters(&self) -> &Counters {
        &self.counters
    }

    fn counters_mut(&mut self) -> &mut Counters {
        &mut self.counters
    }
}
