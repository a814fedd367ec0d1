//! Bring your own cache: the simulator drives a K/V cache kvsim did not write.
//!
//! A cache under test is two types, written against `mlx-rs` alone:
//! - its **serial cache** ([`SerialUnderTest`]): one request's K and V of one layer, with window and decode reads;
//! - its **rows** ([`RowsUnderTest`]): the running batch of continuous batching, made by `merge` (and `join`, where
//!   it has one) of serial caches, read a step at a time for every row, shrunk by `extract` and `filter`.
//!
//! An [`Adapter`] names the two, says how to make an empty serial cache of a [`Geometry`], and says through
//! [`Adapter::supports`] which optional calls it has (the simulator never draws an op that needs one it lacks). kvsim
//! supplies the rest: the seeded swarm of schedules (admit, prefill chunks, decode, merge, join, extract, filter,
//! trims), one **solo twin** per request and layer built from the adapter's own serial cache and fed only that
//! request, and the checks after every op:
//! - every batch read's row against its twin's read of the same request (bytes on the CPU and in the GPU's exact
//!   mode; ULPs at output scale are measured otherwise), check `rows_vs_solo`;
//! - every read against softmax attention in f64 over the positions the request holds (kvsim's self-identifying
//!   values: each K/V/Q column is a pure function of the request, layer and position), check `output_vs_model`;
//! - every live request's stored K and V, in the batch or outside it, against the exact bytes of the positions it
//!   holds (`state_vs_model`), its offsets (`offsets`) and the batch's row count (`rows`);
//! - an error from a call the model says must succeed (`adapter_error`), an `extract` of a row the batch does not
//!   have that returns a cache (`missing_row_accepted`), a trim that drops another count than asked
//!   (`trim_count`), a panic (`panic`).
//!
//! A failing seed is shrunk through the adapter ([`shrink`]) to a trace of a few ops that [`replay`] runs again;
//! traces are kvsim's ordinary trace files (their config names the adapter's family).
//!
//! Scope: plain K/V storage (no quantized planes), full attention or a sliding window ([`Supports::rotating`]),
//! judged by kvsim's reference model of each request as if it ran alone (`kvsim_reference::RowModel`: which
//! positions each query sees, which a state holds). A trim drops positions from the end (`trim(n)` returns what it
//! dropped: `min(n, offset)`, 0 for a filled window) and is asked of the rows only with `n` at most every row's
//! offset. A right-padded batch prefill where the cache has one ([`Supports::prefill`]); no per-row speculative
//! rollback.

mod ddmin;
pub mod engine;
pub mod engine_check;
mod family;
pub mod pool;
pub mod prefix;
pub mod recurrent;
#[cfg(test)]
mod tests;

use mlx_rs::{Array, Dtype};

use crate::sim::config::{LayoutChoice, SimConfig};
use crate::sim::family::quant::QuantChoice;
use crate::sim::family::{Registration, Registry};
use crate::sim::observe::NoObserver;
use crate::sim::ops::OpKind;
use crate::sim::shrink::{shrink_in, Shrunk};
use crate::sim::trace::{Outcome, Trace};
use crate::sim::{run_in, DeviceChoice, RunResult};

/// What a cache under test returns when a call fails: any error (its message is reported with the op).
pub type AdapterError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A cache under test's result.
pub type AdapterResult<T> = Result<T, AdapterError>;

/// The shapes and dtype of one run: K and V are `[B, heads_kv, L, head_dim]`, queries and outputs
/// `[B, heads_q, L, head_dim]` (`heads_q` a multiple of `heads_kv`), all of `dtype` (`float32` or `bfloat16`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    pub heads_kv: usize,
    pub heads_q: usize,
    pub head_dim: usize,
    pub dtype: Dtype,
    /// The sliding window `W` (`None`: full attention). Only adapters that say [`Supports::rotating`] get runs
    /// with a window.
    pub max_size: Option<usize>,
    /// Affine-quantized K/V (`None`: plain). Only adapters that say [`Supports::quant`] get quantized runs; their
    /// `head_dim` is then a multiple of the group (32 to 128).
    pub quant: Option<QuantGeometry>,
}

/// The affine quantization of a run's K/V, as `mx.quantize` takes it: every position's `head_dim` values of one
/// head in groups of `group_size`, each group stored as `bits`-bit codes packed into `u32` words with its scale and
/// bias (of the run's dtype).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuantGeometry {
    /// 2, 3, 4, 5, 6 or 8.
    pub bits: usize,
    /// 32, 64 or 128.
    pub group_size: usize,
}

/// The optional calls a cache under test has. Every field `false` is a cache with windows and decodes outside the
/// batch, merge, batch decodes, extract and filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Supports {
    /// [`SerialUnderTest::trim`].
    pub serial_trim: bool,
    /// [`RowsUnderTest::window`]: `L` new positions for every row in one read.
    pub rows_window: bool,
    /// [`RowsUnderTest::trim`].
    pub rows_trim: bool,
    /// [`RowsUnderTest::join`] (without it, a join of the schedule is carried out by `merge`).
    pub join: bool,
    /// Sliding-window caches ([`Geometry::max_size`]): a query at position `q` sees the positions `p` with
    /// `q - W < p <= q`. Without it every run is full attention.
    pub rotating: bool,
    /// Affine-quantized K/V ([`Geometry::quant`]): about half the runs are quantized from their first write, their
    /// states read as planes ([`SerialUnderTest::planes`], [`RowsUnderTest::row_planes`]).
    pub quant: bool,
    /// Every run quantized (an adapter whose caches are quantized only). Implies [`Supports::quant`].
    pub quant_only: bool,
    /// Quantized caches also form batches (`merge`, `join`, a batch prefill); without it a quantized run draws no
    /// batch op and its requests stay serial.
    pub quant_rows: bool,
    /// Converting a plain cache to a quantized one ([`SerialUnderTest::convert`], [`RowsUnderTest::convert`]; with
    /// [`Supports::quant`]): the other half of the runs start plain, and the conversion op converts every cache of the
    /// run at once.
    pub convert: bool,
    /// A right-padded batch prefill ([`RowsUnderTest::prepare`], [`RowsUnderTest::window`] over the padded chunks,
    /// [`RowsUnderTest::finalize`]): fresh requests' prompts of different lengths enter the batch together.
    pub prefill: bool,
    /// Per-row trims ([`RowsUnderTest::trim_rows`]): a speculative rollback of the rows (a `bypass` trim of `n`)
    /// drops `n - (r mod (n + 1))` positions of row `r`, each row keeping its own share of the rejected block.
    /// Without it, and for a trim that is no rollback, every row drops `n` ([`RowsUnderTest::trim`]).
    pub rows_trim_rows: bool,
}

/// One request's cache of one layer, outside any batch.
pub trait SerialUnderTest: Sized {
    /// Positions held.
    fn offset(&self) -> usize;
    /// Appends `L` positions (`k`, `v`: `[1, heads_kv, L, D]`) and attends `q` (`[1, heads_q, L, D]`), causal
    /// within the block: query `i` (position `offset + i`) sees the positions before the block and the block's
    /// first `i + 1`, the last `W` of them under a sliding window. Returns `[1, heads_q, L, D]`.
    fn window(&mut self, k: &Array, v: &Array, q: &Array, scale: f32) -> AdapterResult<Array>;
    /// One position (`L = 1`): the decode step. The default is [`SerialUnderTest::window`].
    fn decode(&mut self, k: &Array, v: &Array, q: &Array, scale: f32) -> AdapterResult<Array> {
        self.window(k, v, q, scale)
    }
    /// Drops the last `n` positions; returns how many it dropped: `min(n, offset)`, or 0 for a sliding-window
    /// cache that has filled its window (it cannot restore what it overwrote). Asked only where
    /// [`Supports::serial_trim`] says the cache has it.
    fn trim(&mut self, n: usize) -> AdapterResult<usize> {
        let _ = n;
        Err("trim is not supported".into())
    }
    /// The K and V the next read attends, `[1, heads_kv, n, D]` each, oldest position first: every position held
    /// (`n = offset`), or under a sliding window the newest `n = min(offset, W)` (any array with no element when
    /// it holds none).
    fn state(&self) -> AdapterResult<[Array; 2]>;
    /// Converts this plain cache to an affine-quantized one of `quant` in place (mlx-lm's `to_quantized`): the same
    /// positions, offset and (for a ring) phase, stored as `mx.quantize` stores them. Parameters MLX does not accept
    /// (bits outside 2-6 and 8, a group outside 32, 64, 128 or not dividing the head dim) must be refused, the cache
    /// unchanged. Asked only where [`Supports::convert`] says so.
    fn convert(&mut self, quant: QuantGeometry) -> AdapterResult<()> {
        let _ = quant;
        Err("conversion is not supported".into())
    }
    /// A quantized cache's state: the six planes of the positions [`SerialUnderTest::state`] would give, in the
    /// same temporal order, K's packed words (`uint32 [1, heads_kv, n, head_dim * bits / 32]`), scales and biases
    /// (`[1, heads_kv, n, head_dim / group_size]`, the run's dtype), then V's, exactly as `mx.quantize` of those
    /// positions gives them. Asked only in quantized runs.
    fn planes(&self) -> AdapterResult<[Array; 6]> {
        Err("quantized planes are not supported".into())
    }
}

/// The running batch of one layer: row `r` is one request.
pub trait RowsUnderTest: Sized {
    /// What one row is outside the batch.
    type Serial: SerialUnderTest;
    /// A batch of these caches, in order (at least one; some may hold no position).
    fn merge(rows: Vec<Self::Serial>) -> AdapterResult<Self>;
    /// A batch of borrowed caches, in order. Asked only where [`Supports::join`] says the cache has it.
    fn join(rows: &[&Self::Serial]) -> AdapterResult<Self> {
        let _ = rows;
        Err("join is not supported".into())
    }
    /// This batch's rows, then `other`'s. The default extracts every row of both and merges them.
    fn extend(&mut self, other: Self) -> AdapterResult<()> {
        let mut all = (0..self.rows()).map(|r| self.extract(r)).collect::<AdapterResult<Vec<_>>>()?;
        for r in 0..other.rows() {
            all.push(other.extract(r)?);
        }
        *self = Self::merge(all)?;
        Ok(())
    }
    /// Rows held.
    fn rows(&self) -> usize;
    /// Positions held, per row.
    fn offsets(&self) -> Vec<usize>;
    /// One position for every row (`k`, `v`: `[B, heads_kv, 1, D]`, `q`: `[B, heads_q, 1, D]`), each row
    /// attending its own positions. Returns `[B, heads_q, 1, D]`.
    fn decode(&mut self, k: &Array, v: &Array, q: &Array, scale: f32) -> AdapterResult<Array>;
    /// `L` positions for every row, causal within the block. Asked only where [`Supports::rows_window`] says so.
    fn window(&mut self, k: &Array, v: &Array, q: &Array, scale: f32) -> AdapterResult<Array> {
        let _ = (k, v, q, scale);
        Err("a window of the rows is not supported".into())
    }
    /// Row `row` as a serial cache (the batch unchanged). A row the batch does not have is an error.
    fn extract(&self, row: usize) -> AdapterResult<Self::Serial>;
    /// Keeps these rows, in this order (each once, at least one).
    fn filter(&mut self, keep: &[usize]) -> AdapterResult<()>;
    /// Drops the last `n` positions of every row (`n` at most every row's offset); returns `n`, or 0 when some
    /// row is a sliding window that filled. Asked only where [`Supports::rows_trim`] says so.
    fn trim(&mut self, n: usize) -> AdapterResult<usize> {
        let _ = n;
        Err("trim is not supported".into())
    }
    /// Drops the last `n[r]` positions of row `r` (one count per row, each at most the row's offset); returns what
    /// each row dropped (0 for every row when some row is a sliding window that filled). Asked only where
    /// [`Supports::rows_trim_rows`] says so.
    fn trim_rows(&mut self, n: &[usize]) -> AdapterResult<Vec<usize>> {
        let _ = n;
        Err("per-row trims are not supported".into())
    }
    /// Row `row`'s K and V as [`SerialUnderTest::state`] gives a serial cache's.
    fn row_state(&self, row: usize) -> AdapterResult<[Array; 2]>;
    /// [`SerialUnderTest::convert`] of every row at once.
    fn convert(&mut self, quant: QuantGeometry) -> AdapterResult<()> {
        let _ = quant;
        Err("conversion is not supported".into())
    }
    /// Readies a batch merged from empty caches for a right-padded prefill of prompts of `lengths` positions (one per
    /// row): the windows that follow carry `max(lengths)` positions per row in chunks, row `r`'s last
    /// `max(lengths) - lengths[r]` of them padding (values that are no position of its request; a query sees no
    /// padding of its own row, which comes after every real position). Asked only where [`Supports::prefill`] says
    /// so, and followed by [`RowsUnderTest::finalize`].
    fn prepare(&mut self, lengths: &[usize]) -> AdapterResult<()> {
        let _ = lengths;
        Err("a right-padded prefill is not supported".into())
    }
    /// Ends a right-padded prefill: row `r` holds exactly its `lengths[r]` positions, as if it had taken them alone.
    fn finalize(&mut self) -> AdapterResult<()> {
        Err("a right-padded prefill is not supported".into())
    }
    /// Row `row`'s planes as [`SerialUnderTest::planes`] gives a serial cache's. Asked only in quantized runs.
    fn row_planes(&self, row: usize) -> AdapterResult<[Array; 6]> {
        let _ = row;
        Err("quantized planes are not supported".into())
    }
}

/// The cache a [`GroupRead`] reads: a serial cache or a batch.
pub enum Target<'a, S, R> {
    Serial(&'a mut S),
    Rows(&'a mut R),
}

/// One read of a group ([`Adapter::read_group`]): a `decode` (one position) or a `window` of `target`, with its
/// inputs as the traits' read methods take them.
pub struct GroupRead<'a, S, R> {
    pub target: Target<'a, S, R>,
    pub decode: bool,
    pub k: &'a Array,
    pub v: &'a Array,
    pub q: &'a Array,
}

/// Every read of `reads`, in order, one call at a time: [`Adapter::read_group`]'s default. When the first read is a
/// batch's and it is refused, the others are not made (each answers that it was not made).
pub fn read_group_each<S: SerialUnderTest, R: RowsUnderTest>(
    reads: Vec<GroupRead<'_, S, R>>,
    scale: f32,
) -> Vec<AdapterResult<Array>> {
    let rows_first = matches!(reads.first(), Some(GroupRead { target: Target::Rows(_), .. }));
    let mut out: Vec<AdapterResult<Array>> = Vec::with_capacity(reads.len());
    for r in reads {
        if rows_first && matches!(out.first(), Some(Err(_))) {
            out.push(Err("not made: the batch's read before it was refused".into()));
            continue;
        }
        let got = match r.target {
            Target::Serial(s) if r.decode => s.decode(r.k, r.v, r.q, scale),
            Target::Serial(s) => s.window(r.k, r.v, r.q, scale),
            Target::Rows(b) if r.decode => b.decode(r.k, r.v, r.q, scale),
            Target::Rows(b) => b.window(r.k, r.v, r.q, scale),
        };
        out.push(got);
    }
    out
}

/// One read the checks make after every op (of a serial cache, a batch or one of its rows), for
/// [`Adapter::read_all`].
pub enum Read<'a, S, R> {
    /// [`SerialUnderTest::offset`].
    Offset(&'a S),
    /// [`SerialUnderTest::state`].
    State(&'a S),
    /// [`RowsUnderTest::rows`] and [`RowsUnderTest::offsets`].
    Info(&'a R),
    /// [`RowsUnderTest::row_state`] of a row.
    RowState(&'a R, usize),
    /// [`SerialUnderTest::planes`].
    Planes(&'a S),
    /// [`RowsUnderTest::row_planes`] of a row.
    RowPlanes(&'a R, usize),
}

/// What a [`Read`] gave.
pub enum ReadOut {
    Offset(usize),
    State([Array; 2]),
    Info(usize, Vec<usize>),
    Planes([Array; 6]),
}

/// Every read of `reads`, in order, one call at a time: [`Adapter::read_all`]'s default.
pub fn read_each<S: SerialUnderTest, R: RowsUnderTest>(reads: &[Read<'_, S, R>]) -> Vec<AdapterResult<ReadOut>> {
    reads
        .iter()
        .map(|r| match r {
            Read::Offset(s) => Ok(ReadOut::Offset(s.offset())),
            Read::State(s) => s.state().map(ReadOut::State),
            Read::Info(b) => Ok(ReadOut::Info(b.rows(), b.offsets())),
            Read::RowState(b, row) => b.row_state(*row).map(ReadOut::State),
            Read::Planes(s) => s.planes().map(ReadOut::Planes),
            Read::RowPlanes(b, row) => b.row_planes(*row).map(ReadOut::Planes),
        })
        .collect()
}

/// A cache under test: its two types, its name, what it supports, how to make an empty serial cache.
pub trait Adapter: 'static {
    /// The family name of its runs (in their traces and summaries).
    const NAME: &'static str;
    /// The optional calls it has (default: none).
    fn supports() -> Supports {
        Supports::default()
    }
    /// Called as every run starts, before its first cache is made (an engine in another process forgets the last
    /// run's caches here). Default: nothing.
    fn begin_run() -> AdapterResult<()> {
        Ok(())
    }
    type Serial: SerialUnderTest + 'static;
    type Rows: RowsUnderTest<Serial = Self::Serial> + 'static;
    /// An empty serial cache of `geometry`.
    fn serial(geometry: &Geometry) -> AdapterResult<Self::Serial>;
    /// The reads the checks make after an op, all at once, answered in order (the checks judge them in that order,
    /// so the results must be those of making them one after the other). Default: [`read_each`]; an engine in
    /// another process answers them in one round trip.
    #[allow(clippy::type_complexity)]
    fn read_all(reads: &[Read<'_, Self::Serial, Self::Rows>]) -> Vec<AdapterResult<ReadOut>> {
        read_each(reads)
    }
    /// The reads the state checks will make right after the next [`Adapter::read_group`] (the last layer's of a
    /// read op, which leaves every cache's handle where it was), told before it: an engine in another process sends
    /// them in the group's round trip and answers the [`Adapter::read_all`] that follows from their replies, when it
    /// asks exactly these. Default: nothing.
    #[allow(clippy::type_complexity)]
    fn prefetch(reads: &[Read<'_, Self::Serial, Self::Rows>]) {
        let _ = reads;
    }
    /// The reads of one op's layer, all at once, answered in order: a serial read and its twin's, or a batch's read
    /// and its rows' twin reads. Default: [`read_group_each`] (a refused batch read ends the group there); an engine
    /// in another process sends them in one round trip (and ignores the twins' replies after a refused batch read).
    #[allow(clippy::type_complexity)]
    fn read_group(reads: Vec<GroupRead<'_, Self::Serial, Self::Rows>>, scale: f32) -> Vec<AdapterResult<Array>> {
        read_group_each(reads, scale)
    }
}

/// The op kinds an adapter's runs draw: the lifecycle and the reads every cache has, and the ones it supports.
pub fn supports<A: Adapter>(kind: OpKind) -> bool {
    let s = A::supports();
    match kind {
        OpKind::Admit
        | OpKind::SoloWindow
        | OpKind::SoloDecode
        | OpKind::Merge
        | OpKind::Join
        | OpKind::Decode
        | OpKind::Extract
        | OpKind::Filter => true,
        OpKind::SoloTrim => s.serial_trim,
        OpKind::BatchPrefill => s.prefill,
        OpKind::Quantize => s.convert && s.quant,
        OpKind::Window => s.rows_window,
        OpKind::Trim => s.rows_trim,
        _ => false,
    }
}

/// The adapter's family, for a [`Registry`] (every run of that registry holds it).
pub fn registration<A: Adapter>() -> Registration {
    let plain = Registration::plain(A::NAME, supports::<A>, 1.0, |cfg| Ok(Box::new(family::Adapted::<A>::new(cfg)?)));
    let s = A::supports();
    if s.convert && s.quant {
        Registration { draws_op: Some((OpKind::Quantize, draw_convert)), ..plain }
    } else {
        plain
    }
}

/// The conversion op of a run that starts plain: the quantized family's draw (mostly the run's own parameters,
/// sometimes bits or a group MLX refuses).
fn draw_convert(cfg: &SimConfig, w: &mut rand_chacha::ChaCha8Rng) -> crate::sim::ops::Op {
    crate::sim::family::quant::draw_quantize_for(quant_of(cfg), w)
}

/// A registry holding the adapter's family alone.
pub fn registry<A: Adapter>() -> Registry {
    Registry::empty().with(registration::<A>()).expect("an empty registry takes any family")
}

/// The swarm configuration of `seed` for the adapter: kvsim's draws (shapes, dtype, window, op mix, limits; the
/// linear layout for an adapter without [`Supports::rotating`]), `ops` ops.
pub fn config<A: Adapter>(seed: u64, ops: usize) -> SimConfig {
    let mut cfg = SimConfig::from_seed_in(seed, &registry::<A>());
    let s = A::supports();
    if !s.rotating {
        cfg.layout = LayoutChoice::Linear;
    }
    if s.quant || s.quant_only {
        // The quantized family's draw (its own stream: no other draw moves): bits, group, a head dim that is a
        // multiple of the group; its `native` half of the seeds are the quantized runs.
        let choice = QuantChoice::draw(seed);
        let converts = s.convert && !s.quant_only && !choice.native;
        if s.quant_only || choice.native || converts {
            cfg.params.insert(QUANT_PARAMS.to_string(), choice.to_params());
            if converts {
                // Plain until the conversion op: its weight is the quantized family's draw.
                match cfg.weights.iter_mut().find(|(k, _)| *k == OpKind::Quantize) {
                    Some(w) => w.1 = choice.convert_weight,
                    None => cfg.weights.push((OpKind::Quantize, choice.convert_weight)),
                }
            }
            if !s.quant_rows {
                for (kind, w) in cfg.weights.iter_mut() {
                    if matches!(kind, OpKind::Merge | OpKind::Join | OpKind::BatchPrefill) {
                        *w = 0;
                    }
                }
            }
        }
    }
    cfg.ops = ops;
    cfg
}

/// The key of a quantized run's parameters in its config ([`QuantChoice`]: bits, group, head dim).
pub const QUANT_PARAMS: &str = "byoc_quant";

/// A run's quantization, from its config (`None`: plain K/V).
pub fn quant_of(cfg: &SimConfig) -> Option<QuantChoice> {
    cfg.params_of(QUANT_PARAMS).and_then(QuantChoice::from_params)
}

/// One seed's run against the adapter.
pub fn run_seed<A: Adapter>(seed: u64, ops: usize, device: DeviceChoice) -> RunResult {
    run_seed_observed::<A>(seed, ops, device, &mut NoObserver)
}

/// [`run_seed`] with `observer` watching every op (`kvsim check-engine`'s op journal).
pub fn run_seed_observed<A: Adapter>(
    seed: u64,
    ops: usize,
    device: DeviceChoice,
    observer: &mut dyn crate::sim::observe::RunObserver,
) -> RunResult {
    run_in(&registry::<A>(), seed, config::<A>(seed, ops), None, device, None, observer)
}

/// A trace's ops again, against the adapter (its config and seed).
pub fn replay<A: Adapter>(trace: &Trace, device: DeviceChoice) -> RunResult {
    run_in(&registry::<A>(), trace.seed, trace.config.clone(), Some(trace.ops.clone()), device, None, &mut NoObserver)
}

/// A failing trace shrunk through the adapter within `budget` replays (the same check must fail).
pub fn shrink<A: Adapter>(trace: &Trace, device: DeviceChoice, budget: usize) -> Result<Shrunk, String> {
    shrink_in(&registry::<A>(), trace, device, budget)
}

/// How [`check`] runs.
#[derive(Debug, Clone, Copy)]
pub struct CheckOptions {
    /// Seeds `0..seeds`.
    pub seeds: u64,
    /// Ops per seed.
    pub ops: usize,
    pub device: DeviceChoice,
    /// Replays a failing seed's shrink may take.
    pub shrink_budget: usize,
}

impl Default for CheckOptions {
    fn default() -> Self {
        CheckOptions { seeds: 200, ops: 120, device: DeviceChoice::Cpu, shrink_budget: 400 }
    }
}

/// One failing seed: the check that failed first, its message, and its trace before and after shrinking.
#[derive(Debug, Clone)]
pub struct Found {
    pub seed: u64,
    pub check: String,
    pub message: String,
    /// The ops the seed ran up to and including the failing one.
    pub ops_before: usize,
    /// The shrunk trace (fails with the same check; its `ops` are the reproducer).
    pub shrunk: Trace,
}

/// What [`check`] found.
#[derive(Debug, Clone)]
pub struct CheckReport {
    pub seeds: u64,
    /// Ops applied over every seed (skipped ones not counted).
    pub applied: u64,
    /// Applied ops by kind (`decode`, `merge`, ...), over every seed.
    pub ops_by_kind: std::collections::BTreeMap<String, u64>,
    /// Comparisons made.
    pub checks: u64,
    pub failures: Vec<Found>,
}

/// Runs seeds `0..seeds` against the adapter and shrinks every failing one.
pub fn check<A: Adapter>(opts: CheckOptions) -> CheckReport {
    let mut report =
        CheckReport { seeds: opts.seeds, applied: 0, ops_by_kind: Default::default(), checks: 0, failures: vec![] };
    for seed in 0..opts.seeds {
        let r = run_seed::<A>(seed, opts.ops, opts.device);
        report.applied += r.ops_by_kind.values().sum::<u64>();
        for (k, n) in &r.ops_by_kind {
            *report.ops_by_kind.entry(k.clone()).or_insert(0) += n;
        }
        report.checks += r.counters.checks;
        if let Outcome::Fail { op_index, check, message } = &r.trace.outcome {
            let shrunk = match shrink::<A>(&r.trace, opts.device, opts.shrink_budget) {
                Ok(s) => s.trace,
                Err(_) => r.trace.clone(),
            };
            report.failures.push(Found {
                seed,
                check: check.clone(),
                message: message.clone(),
                ops_before: op_index + 1,
                shrunk,
            });
        }
    }
    report
}
