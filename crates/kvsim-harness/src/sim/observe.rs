//! Observers of a run: the runner and the families call these hooks; whoever watches (the mlx-lm oracle's recorder
//! in `src/oracle`, a future tracer) implements [`RunObserver`]. The simulator core knows nothing of what an
//! observer does with a call: it only describes, in plain data, which production call it made with which inputs
//! and outputs.
//!
//! A family builds the (possibly costly) call data only when [`RunObserver::wants_calls`] says so; the default
//! observer ([`NoObserver`]) wants nothing and costs nothing.

use std::collections::BTreeMap;

use mlx_rs::Array;

use crate::sim::ops::Op;
use kvsim_cache::mask::MaskUse;
use kvsim_cache::ssm::{GdnParams, SsmSpec};
use kvsim_cache::{CacheError, RingState, SerialCache, Storage};
use kvsim_reference::RowModel;

/// The read kind of a solo or batch call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Read {
    Decode,
    Window,
    /// A write without a read (no output).
    Append,
}

impl Read {
    pub fn name(self) -> &'static str {
        match self {
            Read::Decode => "decode",
            Read::Window => "window",
            Read::Append => "append",
        }
    }
}

/// What the production cache did for a trim call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrimInfo {
    /// Count per row (one entry for a solo or uniform trim).
    pub n: Vec<usize>,
    pub bypass: bool,
    /// The production answer: `Ok(count)` or the typed error's debug text.
    pub kvsim: Result<usize, String>,
    /// Whether the last mutation of every row was a window write of at least `n` positions (what a bypass trim
    /// undoes).
    pub after_window: bool,
    /// Live positions of each row before the trim.
    pub live: Vec<usize>,
}

/// One production call of a family the oracle maps (the attention and quantized families' `kv:*` caches; the
/// recurrent family's `Ssm*` calls), with its exact inputs and outputs. Offsets are the
/// requests' positions before the call; `rows` pairs are `(offset, live columns)` per batch row.
#[derive(Debug, Clone, Copy)]
pub enum Call<'a> {
    Admit {
        req: u32,
    },
    /// A write (+ read) on a request outside the batch; `q`/`out` are `None` for an append, `mask` the mask the
    /// read attended with (`None` for an append or a read that reports none), `twin` the same read of the
    /// request's solo twin (what the family compares `out` against; `None` where there is none).
    Solo {
        req: u32,
        layer: usize,
        read: Read,
        k: &'a Array,
        v: &'a Array,
        q: Option<&'a Array>,
        out: Option<&'a Array>,
        offset: usize,
        mask: Option<&'a MaskUse>,
        twin: Option<&'a Array>,
    },
    SoloTrim {
        req: u32,
        offset: usize,
        trim: &'a TrimInfo,
    },
    /// Requests outside the batch enter it (`merge` of temporal views, or `join` keeping their phase).
    Enter {
        reqs: &'a [u32],
        merge: bool,
        offsets: &'a [usize],
        sizes: &'a [usize],
    },
    Prefill {
        reqs: &'a [u32],
        lengths: &'a [usize],
        chunk: usize,
    },
    PrefillChunk {
        layer: usize,
        reqs: &'a [u32],
        k: &'a Array,
        v: &'a Array,
        q: &'a Array,
        real: &'a [usize],
        out: &'a Array,
        done: usize,
        padded: bool,
    },
    PrefillEnd {
        longest: usize,
    },
    /// A write (+ read) on the running batch; `q`/`out` are `None` for an append. `mask` is the mask the read
    /// attended with; `twins` the same read of every row's solo twin, in row order (empty for an append), the
    /// outputs the family compares the batch's against.
    Batch {
        layer: usize,
        read: Read,
        reqs: &'a [u32],
        rows: &'a [(usize, usize)],
        k: &'a Array,
        v: &'a Array,
        q: Option<&'a Array>,
        out: Option<&'a Array>,
        mask: Option<&'a MaskUse>,
        twins: &'a [Array],
    },
    /// A committed span on the running batch; `twins` as for [`Call::Batch`] (each twin's ordinary decodes of the
    /// span, in row order).
    BatchSpan {
        layer: usize,
        reqs: &'a [u32],
        rows: &'a [(usize, usize)],
        k: &'a Array,
        v: &'a Array,
        q: &'a Array,
        out: &'a Array,
        twins: &'a [Array],
    },
    /// Every batch row received `l` positions (after all layers' calls of one op).
    BatchWritten {
        l: usize,
    },
    TrimRows {
        reqs: &'a [u32],
        offsets: &'a [usize],
        trim: &'a TrimInfo,
    },
    Trim {
        reqs: &'a [u32],
        offsets: &'a [usize],
        trim: &'a TrimInfo,
    },
    Extract {
        row: usize,
        req: u32,
        finish: bool,
        rows_left: usize,
    },
    Filter {
        keep: &'a [usize],
    },
    /// The conversion op (`to_quantized` of every cache of the family): `converted` when the caches changed storage
    /// (false: the same parameters, a typed refusal, or nothing to convert).
    Quantize {
        bits: usize,
        group: usize,
        converted: bool,
    },
    /// The recurrent family: its DeltaNet geometry and every layer's weights (described once, before its first call).
    SsmLayers {
        spec: SsmSpec,
        params: &'a [GdnParams],
    },
    /// A gated-DeltaNet layer call (`SsmCache::decode` / `window`): on request `req`'s own cache (`Some`, one row) or
    /// on the running batch (`reqs` in row order); `spans[r]` is row `r`'s real `[start, end)`; `out` `[B, S, Hv, Dv]`.
    SsmCall {
        req: Option<u32>,
        layer: usize,
        read: Read,
        reqs: &'a [u32],
        qkv: &'a Array,
        a: &'a Array,
        b: &'a Array,
        out: &'a Array,
        spans: &'a [(usize, usize)],
    },
    /// `SsmCache::prepare(lengths, left)` on the running batch (`left` empty: no left padding).
    SsmPrepare {
        lengths: &'a [usize],
        left: &'a [usize],
    },
    /// `SsmCache::finalize()` on the running batch.
    SsmFinalize,
    /// A speculative round of `gamma` positions resolved with per-row `keep` (commit when every row keeps `gamma`).
    SsmRound {
        reqs: &'a [u32],
        gamma: usize,
        keep: &'a [usize],
    },
}

/// One live request at a checkpoint: its offset and, per layer, its temporal K and V views (production); for the
/// recurrent family each layer's pair is the row's conv state `[K-1, conv_dim]` and recurrent state `[Hv, Dv, Dk]`.
pub struct StateView {
    /// The request's row in the running batch (`None`: it runs alone).
    pub row: Option<usize>,
    pub offset: usize,
    pub layers: Vec<(Array, Array)>,
    /// Affine storage only: per layer, the six planes of the temporal view (K's packed words, scales, biases, then
    /// V's); `layers` is then empty.
    pub planes: Option<Vec<Vec<Array>>>,
    /// Families with rings (the attention and bf16-first families): per layer, the ring as production stores it
    /// beside the reference model's; empty for the others.
    pub rings: Vec<RingView>,
    /// `Some((bits, group))` when this request's `planes` are affine and its family says their parameters per
    /// request (the bf16-first rows, each converting on its own, and every request alone); `None` otherwise.
    pub quant: Option<(usize, usize)>,
}

impl StateView {
    /// A request held by one serial cache per layer, as an observer is handed it: each layer's temporal view (dense
    /// K/V, or the six planes once any layer is affine) and its ring beside `model`, the request's reference ring.
    pub fn of_serial(
        caches: &[SerialCache],
        model: &RowModel,
        row: Option<usize>,
        offset: usize,
    ) -> Result<StateView, CacheError> {
        let affine = caches.iter().any(|c| c.storage() != Storage::Plain);
        let (mut layers, mut planes, mut rings) = (vec![], vec![], vec![]);
        let mut quant = None;
        for c in caches {
            let (k, v) = if affine {
                planes.push(c.temporal_view_planes()?);
                let p = c.physical_planes()?;
                (p[0].clone(), p[3].clone())
            } else {
                layers.push(c.temporal_view()?);
                c.physical()?
            };
            if let Storage::Affine(q) = c.storage() {
                quant = Some((q.bits, q.group));
            }
            let (state, window, model) = (c.state().clone(), c.max_size(), model.clone());
            rings.push(RingView { k, v, state, window, left_padding: None, pending: None, model });
        }
        Ok(StateView { row, offset, layers, planes: affine.then_some(planes), rings, quant })
    }
}

/// One layer's ring of one request, as production stores it and as the reference model says it must be: what a
/// viewer draws as physical columns, write head, rotation and padding.
pub struct RingView {
    /// The live physical columns `[0, len)` in physical order, `[1, H_kv, len, D]`: K and V dense, or their packed
    /// words under affine storage.
    pub k: Array,
    pub v: Array,
    /// Production's host state (offset, len, write head, last window write).
    pub state: RingState,
    /// The window `W` (`None`: linear).
    pub window: Option<usize>,
    /// A batch row's mlx-lm left padding (`width - (offset - base)`) and its pending prefill positions; `None`
    /// for a request alone.
    pub left_padding: Option<i64>,
    pub pending: Option<usize>,
    /// The reference model of the same row (its physical columns, head, base and padding).
    pub model: RowModel,
}

/// Hooks a run calls. Every method has a do-nothing default.
pub trait RunObserver {
    /// Op `index` of the run starts.
    fn on_op_start(&mut self, _index: usize, _op: &Op) {}
    /// Whether the families should describe their production calls ([`RunObserver::on_call`]) and states
    /// ([`RunObserver::on_state`]). When false, they build nothing for the observer.
    fn wants_calls(&self) -> bool {
        false
    }
    /// Whether the family registered as `family` (its name in `sim::family::REGISTRY`) should describe its calls and
    /// states to this observer; the runner hands the others a [`NoObserver`]. Default: every family.
    fn watches(&self, _family: &str) -> bool {
        true
    }
    /// A production call, just made. An error (the observer could not read an array) fails the run.
    fn on_call(&mut self, _call: Call<'_>) -> Result<(), String> {
        Ok(())
    }
    /// The state of every live request after an op's checks passed (and, for a verify, before its rollback).
    fn on_state(&mut self, _views: BTreeMap<u32, StateView>) -> Result<(), String> {
        Ok(())
    }
    /// Op `index` ended: `Ok(true)` applied, `Ok(false)` skipped, `Err(check)` failed.
    fn on_op_end(&mut self, _index: usize, _op: &Op, _result: Result<bool, &str>) {}
}

/// The observer of a plain `sim` run: watches nothing.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoObserver;

impl RunObserver for NoObserver {}
