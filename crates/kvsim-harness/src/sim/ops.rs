//! The op alphabet: what a continuous-batching scheduler does to its caches.
//!
//! Ops name requests by id and batch rows by index. An op whose references do not exist in the current state (a
//! request never admitted, a request that is not where the op needs it) is **skipped deterministically** and counted
//! as skipped, so any subsequence of a trace (shrinking, fuzzing) is still a valid trace. An op that exists but asks
//! the impossible of a cache (trim a wrapped ring, extract a missing row) is **executed**: the reference model
//! predicts the typed error and the check requires exactly that error.

use arbitrary::Arbitrary;
use serde::{Deserialize, Serialize};

/// One scheduler step. Serialized with a `"op"` tag, snake_case (the trace format).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Arbitrary)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Op {
    /// A new request with an empty serial cache (outside the batch).
    Admit { req: u32 },
    /// A prefill chunk (window read, R-C-2) of `len` positions on a request outside the batch.
    SoloWindow { req: u32, len: u32 },
    /// A decode step (R-ROT-2) on a request outside the batch.
    SoloDecode { req: u32 },
    /// Trim a request outside the batch (R-C-5); `bypass` is the speculative-rollback path.
    SoloTrim { req: u32, n: u32, bypass: bool },
    /// Requests outside the batch enter it through `merge` of their temporal views (R-BROT-4), then `join` with the
    /// running batch. A layout event: rows come out in temporal order (the twins are re-linearized with them).
    Merge { reqs: Vec<u32> },
    /// Requests outside the batch are joined into the running batch keeping their physical columns and phase (R-BROT-7).
    /// `order`: the running batch's rows as the join lists them (a permutation of its row indices; empty = identity
    /// order). Any other list (a shrunk or fuzzed one) makes the op skipped.
    Join {
        reqs: Vec<u32>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        order: Vec<u32>,
    },
    /// Fresh (empty) requests are prefilled together: right-padded to the longest with `prepare(lengths)`, fed in
    /// chunks of `chunk` (each a window read), `finalize`d, then joined into the running batch (R-BROT-2).
    /// `uncommitted`: the requests that never commit a chunk of their own; the prefill's end (`end_prefill` of a
    /// chunked cohort, `finalize` of a prepared one) commits them (R-TKV-3; the bf16-first family gives it meaning).
    BatchPrefill {
        reqs: Vec<u32>,
        lengths: Vec<u32>,
        chunk: u32,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        uncommitted: Vec<u32>,
    },
    /// One decode step for every row of the running batch (R-C-2, R-BROT-2).
    Decode,
    /// A window read of `len` new positions for every row (prefill tail, committed context, R-C-2).
    Window { len: u32 },
    /// Append `len` positions to every row without attending (R-C-2).
    Append { len: u32 },
    /// A speculative verify window of `gamma` positions, then each row accepts `accept[r]` and the rest is rolled back
    /// with `trim(bypass = true)` (R-C-5).
    Verify { gamma: u32, accept: Vec<u32> },
    /// A committed span: one decode per position (R-ROT-7).
    CommitSpan { len: u32 },
    /// Row `row` leaves the batch through `extract` (R-BROT-5), then `filter` (R-BROT-6). With `finish` the request
    /// ends; otherwise it continues outside the batch (and may be joined again).
    Extract { row: u32, finish: bool },
    /// Keep only these rows (R-BROT-6): the others' requests are dropped.
    Filter { keep: Vec<u32> },
    /// Trim every row of the batch by `n` (R-C-5); `bypass` is the speculative-rollback path (every row must have
    /// just taken a window of at least `n` positions, else the typed error with every row unchanged).
    Trim {
        n: u32,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        bypass: bool,
    },
    /// DiffusionGemma's canvas read (R-ROT-9c) of `len` block positions on a request outside the batch: the block
    /// attends the stored context and itself; nothing is stored, offsets never move.
    ReadBlock { req: u32, len: u32 },
    /// Gemma 4's bidirectional vision prefill (R-ROT-9a) of `len` positions on a request outside the batch; bit `i`
    /// of `image` marks position `i` an image token. Defined only at offset 0: elsewhere the typed error is expected.
    BidirPrefill { req: u32, len: u32, image: u64 },
    /// DiffusionGemma's vision-encoder read (R-ROT-9b) of `len` block positions: on request `req` outside the batch,
    /// or with `batch` on every row of the running batch (then `req` is not read; no rows: skipped). The block is
    /// appended by the window rule (every block position kept, even past the window), then attended under the
    /// encoder's own sliding `window` (0 = unbounded), which the cache's window does not limit.
    EncoderRead {
        req: u32,
        len: u32,
        window: u32,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        batch: bool,
    },
    /// One decode step of a request outside the batch through the compiled-decode protocol (R-C-9): plan, pure step,
    /// apply; it must equal the ordinary append byte for byte.
    CompiledStep { req: u32 },
    /// The running batch's decode through the batched compiled step (prepare, closure inputs, pure step, apply).
    CompiledBatchStep,
    /// A committed read under known spans: row `r` commits `lens[r]` positions (unequal lengths, 0 allowed).
    CommitKnownSpans { lens: Vec<u32> },
    /// A stateless training forward (R-TRN-3) of `len` positions on a right-padded batch whose row `r` holds
    /// `lengths[r]` real positions, under a sliding window `window` (0 = none). A length above `len` is the typed
    /// error `BadLengths`.
    TrainingForward { lengths: Vec<u32>, len: u32, window: u32 },
    /// A prefix-shared training forward of `len` positions for `prompt ++ chosen ++ rejected`; `len` other than
    /// `prompt + chosen + rejected` is the typed error `PrefixSharedSize`.
    PrefixSharedForward { prompt: u32, chosen: u32, rejected: u32, len: u32, window: u32 },
    /// A training cache asked to be merged into a batch (`persist = false`) or persisted (`true`): `TrainingOnly`.
    TrainingRefusal { persist: bool },
    /// Prefix reuse from the bf16-first family's stored entry (the lego of the last finished request): `take` the
    /// usable prefix `p = min(common, prompt - 1)` (refused below the entry's floor, `BelowFloor`, and when a
    /// wrapped ring would need a trim, `NotTrimmable`; nothing changed), then continue it with `extra` positions.
    PrefixReuse { common: u32, prompt: u32, extra: u32 },
    /// The plain (dense `update_and_fetch`) read of the bf16-first rows: refused with `MixedPrecision` while any row
    /// is affine, nothing changed; the dense fetch is checked beside it.
    PlainRead,
    /// The softcapped read's fetch on the bf16-first rows (R-TKV-4): every row appends `len` positions, then the
    /// rows answer with one aligned dense K/V (each row's part against its lego twin's own fetch, the geometry and
    /// the conversions against the model's).
    Fetch { len: u32 },
    /// The running batch is rebuilt, every layer, from its own owned buffers and per-row states through
    /// `RowBatch::adopt` (plain storage) / `adopt_planes` (R-BROT-8), or the bf16-first rows from their parts through
    /// `TransitioningKvRows::adopt` (R-TKV-5): the adopted batch must hold every byte, every row state and (bf16-first)
    /// every row's lifecycle as before. With `invalid`, row `0`'s state is made impossible first (`len` past the
    /// buffer's columns; a bf16-first row's lifecycle one its lego cannot reach): the typed error `InvalidState`, the
    /// running batch untouched.
    Adopt { invalid: bool },
    /// Asks every batch row (`row_decode_phase`) and every request outside the batch (`decode_phase`) whether its
    /// next decode write appends or overwrites (R-ROT-5), against the model; row `rows` (one past the end) must be
    /// the typed error `NoSuchRow`. Changes nothing.
    DecodePhase,
    /// A right-padded prefill into the running batch, whose rows already hold positions: `prepare(lengths)` (one
    /// length per row; 0 = the row takes no position), at most `chunks` window chunks of `chunk` positions, then
    /// `finalize`; when that is before every position arrived, the positions not yet delivered are forgotten
    /// (R-BROT-2). While pending, a decode and a second `prepare` must be the typed error
    /// `PendingPrefill`; after it, a second `finalize` must be `NoPendingPrefill`. A `lengths` list of another size
    /// than the batch makes the op skipped.
    Prepare { lengths: Vec<u32>, chunk: u32, chunks: u32 },
    /// An ill-formed input offered to a live cache: the running batch (`batch` and it has rows) or request `req`
    /// outside it. `variant` picks the call and the tensor. Every one must be the typed error with the cache's
    /// bytes and state unchanged (checked before/after, then against twin and model).
    IllFormed { req: u32, batch: bool, input: IllInput, variant: u32 },
    /// Convert every cache of the run to affine storage of `bits` and `group` (`to_quantized`, R-ROT-8): every
    /// request outside the batch, the running batch, and the twins at the same point, ring phase and offset kept.
    /// With `mid_round`, the conversion is first asked of a copy of the running batch with a right-padded prefill
    /// prepared and not finalized, which must refuse with `PendingPrefill` and change nothing. Invalid parameters
    /// (for the cache's head dim), or other parameters than a cache already holds, are typed errors.
    Quantize { bits: u32, group: u32, mid_round: bool },
    /// Save/restore: request `req` outside the batch has its caches (every layer, one file) saved,
    /// dropped and restored from the bytes alone, then continues; the state checks after the op and every later
    /// read compare the restored caches with the solo twins and the model. kvsim's format with a reuse floor of half
    /// the offset (which must come back), or, with `mlxlm`, an mlx-lm prompt-cache file when every layer has an
    /// mlx-lm form that keeps its state (else kvsim's format).
    Persist { req: u32, mlxlm: bool },
    /// The paged family's own ops (`sim::family::paged`, docs/paged.md): parallel sampling from a request, eviction
    /// from the prefix index. Drawn only in runs that hold that family; the others leave every cache unchanged.
    Paged { action: PagedAction },
}

/// What an [`Op::Paged`] does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Arbitrary)]
#[serde(tag = "action", rename_all = "snake_case")]
pub enum PagedAction {
    /// Parallel sampling: `n` sequences forked from live request `req` (sharing every block of it), each appending
    /// `len` positions of its own through a window read, each checked against a copy of the request's twin; then
    /// each finishes into the prefix index (`finish`) or is dropped. The request itself must come out unchanged.
    Fork { req: u32, n: u32, len: u32, finish: bool },
    /// Up to `blocks` blocks evicted from the prefix index (least recently used unreferenced leaves first).
    Evict { blocks: u32 },
    /// A right-padded prefill that brings every row of the running batch (at least two) to one length, `extra`
    /// positions past the longest row: each row takes what it lacks of it, in chunks of `chunk` positions widened
    /// so that every row's last chunk is the same one (the row that held fewest takes all of it, the others part).
    /// Then each such row's rollback limit is probed.
    SameEnd { extra: u32, chunk: u32 },
}

/// What is wrong with an [`Op::IllFormed`] input.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Arbitrary)]
#[serde(rename_all = "snake_case")]
pub enum IllInput {
    /// K, V or Q in another float dtype than the cache's: `ShapeMismatch`.
    Dtype,
    /// K, V or Q of another head dim, row count or rank, or K and V of different lengths: `ShapeMismatch`.
    Shape,
    /// K or V with `H_kv + 1` heads, or Q with a head count that is not a positive multiple of `H_kv`:
    /// `ShapeMismatch`.
    Heads,
    /// A malformed storage-kind string (the cache's own kind, altered): routing refuses it with
    /// `UnknownStorageKind`, and a saved entry carrying it does not load (`UnknownKind`).
    StorageKind,
    /// A row id that does not exist or is listed twice (`filter`, `extract`, `row_decode_phase`): `NoSuchRow`,
    /// `DuplicateRow`.
    RowId,
}

impl IllInput {
    pub const ALL: &'static [IllInput] =
        &[IllInput::Dtype, IllInput::Shape, IllInput::Heads, IllInput::StorageKind, IllInput::RowId];

    /// Snake-case name (the key of `ill_formed_rejected` and of the `ill_formed/*` API classes).
    pub fn name(self) -> &'static str {
        match self {
            IllInput::Dtype => "dtype",
            IllInput::Shape => "shape",
            IllInput::Heads => "heads",
            IllInput::StorageKind => "storage_kind",
            IllInput::RowId => "row_id",
        }
    }
}

/// The kinds of op, for weights, counters and coverage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OpKind {
    Admit,
    SoloWindow,
    SoloDecode,
    SoloTrim,
    Merge,
    Join,
    BatchPrefill,
    Decode,
    Window,
    Append,
    Verify,
    CommitSpan,
    Extract,
    Filter,
    Trim,
    ReadBlock,
    BidirPrefill,
    CompiledStep,
    CompiledBatchStep,
    CommitKnownSpans,
    TrainingForward,
    PrefixSharedForward,
    TrainingRefusal,
    PrefixReuse,
    PlainRead,
    Adopt,
    DecodePhase,
    Prepare,
    IllFormed,
    Quantize,
    Persist,
    EncoderRead,
    Fetch,
    Paged,
}

impl OpKind {
    pub const ALL: &'static [OpKind] = &[
        OpKind::Admit,
        OpKind::SoloWindow,
        OpKind::SoloDecode,
        OpKind::SoloTrim,
        OpKind::Merge,
        OpKind::Join,
        OpKind::BatchPrefill,
        OpKind::Decode,
        OpKind::Window,
        OpKind::Append,
        OpKind::Verify,
        OpKind::CommitSpan,
        OpKind::Extract,
        OpKind::Filter,
        OpKind::Trim,
        OpKind::ReadBlock,
        OpKind::BidirPrefill,
        OpKind::CompiledStep,
        OpKind::CompiledBatchStep,
        OpKind::CommitKnownSpans,
        OpKind::TrainingForward,
        OpKind::PrefixSharedForward,
        OpKind::TrainingRefusal,
        OpKind::PrefixReuse,
        OpKind::PlainRead,
        OpKind::Adopt,
        OpKind::DecodePhase,
        OpKind::Prepare,
        OpKind::IllFormed,
        OpKind::Quantize,
        OpKind::Persist,
        OpKind::EncoderRead,
        OpKind::Fetch,
        OpKind::Paged,
    ];

    /// Snake-case name (as in traces and summaries).
    pub fn name(self) -> &'static str {
        match self {
            OpKind::Admit => "admit",
            OpKind::SoloWindow => "solo_window",
            OpKind::SoloDecode => "solo_decode",
            OpKind::SoloTrim => "solo_trim",
            OpKind::Merge => "merge",
            OpKind::Join => "join",
            OpKind::BatchPrefill => "batch_prefill",
            OpKind::Decode => "decode",
            OpKind::Window => "window",
            OpKind::Append => "append",
            OpKind::Verify => "verify",
            OpKind::CommitSpan => "commit_span",
            OpKind::Extract => "extract",
            OpKind::Filter => "filter",
            OpKind::Trim => "trim",
            OpKind::ReadBlock => "read_block",
            OpKind::BidirPrefill => "bidir_prefill",
            OpKind::CompiledStep => "compiled_step",
            OpKind::CompiledBatchStep => "compiled_batch_step",
            OpKind::CommitKnownSpans => "commit_known_spans",
            OpKind::TrainingForward => "training_forward",
            OpKind::PrefixSharedForward => "prefix_shared_forward",
            OpKind::TrainingRefusal => "training_refusal",
            OpKind::PrefixReuse => "prefix_reuse",
            OpKind::PlainRead => "plain_read",
            OpKind::Adopt => "adopt",
            OpKind::DecodePhase => "decode_phase",
            OpKind::Prepare => "prepare",
            OpKind::IllFormed => "ill_formed",
            OpKind::Quantize => "quantize",
            OpKind::Persist => "persist",
            OpKind::EncoderRead => "encoder_read",
            OpKind::Fetch => "fetch",
            OpKind::Paged => "paged",
        }
    }

    /// Default relative weight before the swarm scales it.
    pub fn base_weight(self) -> u32 {
        match self {
            OpKind::Admit => 4,
            OpKind::SoloWindow => 5,
            OpKind::SoloDecode => 3,
            OpKind::SoloTrim => 3,
            OpKind::Merge => 3,
            OpKind::Join => 2,
            OpKind::BatchPrefill => 2,
            OpKind::Decode => 10,
            OpKind::Window => 2,
            OpKind::Append => 1,
            OpKind::Verify => 3,
            OpKind::CommitSpan => 1,
            OpKind::Extract => 2,
            OpKind::Filter => 1,
            OpKind::Trim => 1,
            OpKind::ReadBlock => 2,
            OpKind::BidirPrefill => 2,
            OpKind::CompiledStep => 3,
            // Drawn from their own stream (`gen::CONTRACT_OPS`), never by weight.
            OpKind::CompiledBatchStep | OpKind::CommitKnownSpans => 0,
            // Drawn from its own stream (`Stream::Fetch`), never by weight.
            OpKind::Fetch => 0,
            // Weighted by the paged family from its own parameters, never by the swarm.
            OpKind::Paged => 0,
            OpKind::TrainingForward => 6,
            OpKind::PrefixSharedForward => 3,
            OpKind::TrainingRefusal => 1,
            OpKind::PrefixReuse => 3,
            OpKind::PlainRead => 1,
            OpKind::Adopt => 1,
            OpKind::DecodePhase => 1,
            OpKind::Prepare => 1,
            OpKind::IllFormed => 2,
            OpKind::Quantize => 1,
            OpKind::Persist => 2,
            OpKind::EncoderRead => 2,
        }
    }

    /// The training kinds: executed by the training family only (never drawn in a run without it).
    pub fn is_training(self) -> bool {
        matches!(self, OpKind::TrainingForward | OpKind::PrefixSharedForward | OpKind::TrainingRefusal)
    }

    /// The bf16-first family's own kinds: drawn only in runs that hold it.
    pub fn is_transition(self) -> bool {
        matches!(self, OpKind::PrefixReuse | OpKind::PlainRead | OpKind::Fetch)
    }

    /// The conversion op: drawn only in runs that hold the quantized family (`sim::family::quant`), with a weight
    /// from its own stream, so that the swarm draws of every other run are unchanged.
    pub fn is_quant(self) -> bool {
        matches!(self, OpKind::Quantize)
    }

    /// Kinds that change only their owning family's caches, never the roster: the conversion op (it converts the
    /// quantized family's caches) and the bf16-first rows' softcapped fetch (their rows append and read). Every other
    /// family of the run lets them pass (`Registry::all_support`), so they reach every run that holds their owner,
    /// whatever families stand beside it.
    pub fn passes_others(self) -> bool {
        self.is_quant() || matches!(self, OpKind::Fetch)
    }

    /// Kinds the swarm weights itself (every seed draws their weights): all but the conversion op (weighted by the
    /// family that draws it), save/restore and the encoder read (each weighted from its own stream), the contract
    /// ops and the softcapped fetch (drawn from theirs).
    pub fn in_base_swarm(self) -> bool {
        !self.is_quant()
            && !self.is_persist()
            && !self.is_encoder()
            && !self.is_contract()
            && self != OpKind::Fetch
            && !self.is_paged()
    }

    /// The paged family's own ops: drawn only in runs that hold it, weighted from its own stream.
    pub fn is_paged(self) -> bool {
        matches!(self, OpKind::Paged)
    }

    /// The ops of the contract's batched calls (the batched compiled step, known spans of unequal lengths): drawn
    /// by [`crate::sim::gen::Generator`] from [`crate::sim::rng::Stream::Contract`], never by weight, so a seed
    /// that draws none of them runs every other op exactly as it would without them.
    pub fn is_contract(self) -> bool {
        matches!(self, OpKind::CompiledBatchStep | OpKind::CommitKnownSpans)
    }

    /// The encoder read: not in the swarm's list (its length is part of every seed's draws); about half the runs
    /// whose families all support it get a weight from [`crate::sim::rng::Stream::Encoder`].
    pub fn is_encoder(self) -> bool {
        matches!(self, OpKind::EncoderRead)
    }

    /// The save/restore op: not in the swarm's list either (its length is part of every seed's draws); about half
    /// the runs whose families all support it get a weight from [`crate::sim::rng::Stream::Persist`].
    pub fn is_persist(self) -> bool {
        matches!(self, OpKind::Persist)
    }

    /// Kinds every run keeps, so that requests can reach the batch and make progress.
    pub fn essential(self) -> bool {
        matches!(self, OpKind::Admit | OpKind::SoloWindow | OpKind::Decode | OpKind::Join)
    }
}

/// Every public operation and parameter class the generator is meant to reach: the keys of `api_coverage` in
/// `kvsim sim --json` (applied ops per class; a class at 0 is an input the simulator never produces). Most follow
/// from the op alone ([`Op::api_classes`]); the rest from what a family found when it applied it
/// (`Family::take_reached`): `to_quantized/empty_request` (the conversion op while some request holds no
/// position: its empty caches converted, left as they are, or refused like the others),
/// `to_quantized/empty_beside_quantized` (the same while the family's storage is already quantized and the batch
/// runs: its empty caches must keep or refuse like the batch, never take other parameters),
/// `encoder_read/window_decides` (an encoder read some query of which sees other columns under the encoder's window
/// than it would under the cache's),
/// `persist/layers_differ` (a saved set whose layers hold different offsets, windows and trim histories, and
/// `/mlx-lm` when it also went through an mlx-lm file), `persist/list` (a saved cache list whose children differ)
/// and `persist/damaged` (damaged copies of a saved file refused), `persist/recurrent_offsets_differ` (a saved set
/// and list whose recurrent layers hold different offsets, through both formats), `persist/empty_layers_differ/mlx-lm`
/// (an mlx-lm file whose empty attention layers differ in spec, window and class), `adopt/bf16_first` (the
/// bf16-first rows rebuilt from their own parts) and `fetch/rows_due_together` (a softcapped fetch that brings
/// several rows to their conversion at once); and the paged family's
/// `paged/same_block_other_prefix` (a prefix lookup whose next block's tokens the index holds under another
/// prefix), `paged/prefill_partial_same_end` (a right-padded prefill chunk in which rows end at the same length
/// while one took only part of the chunk) and `paged/affine_cow_partial` (copy-on-write of a shared, partly
/// filled block of an affine pool).
pub const API_CLASSES: &[&str] = &[
    "admit",
    "solo_window",
    "solo_decode",
    "solo_trim/plain",
    "solo_trim/bypass",
    "solo_trim/zero",
    "merge",
    "join/identity_order",
    "join/permuted",
    "batch_prefill",
    "batch_prefill/uneven_lengths",
    "batch_prefill/uncommitted",
    "decode",
    "window",
    "append",
    "verify",
    "commit_span",
    "extract/continue",
    "extract/finish",
    "filter/subset",
    "filter/reordered",
    "trim/plain",
    "trim/bypass",
    "read_block",
    "bidir_prefill",
    "encoder_read/solo",
    "encoder_read/batch",
    "encoder_read/window_decides",
    "compiled_step",
    "compiled_batch_step",
    "commit_known_spans",
    "training_forward",
    "prefix_shared_forward",
    "training_refusal/merge",
    "training_refusal/persist",
    "adopt",
    "adopt/invalid_state",
    "adopt/bf16_first",
    "decode_phase",
    "prepare/non_empty_rows",
    "prepare/zero_length",
    "finalize/early",
    "ill_formed/dtype",
    "ill_formed/shape",
    "ill_formed/heads",
    "ill_formed/storage_kind",
    "ill_formed/row_id",
    "prefix_reuse",
    "plain_read",
    "fetch",
    "fetch/rows_due_together",
    "to_quantized",
    "to_quantized/mid_round",
    "to_quantized/empty_request",
    "to_quantized/empty_beside_quantized",
    "persist/kvsim",
    "persist/mlx-lm",
    "persist/layers_differ",
    "persist/layers_differ/mlx-lm",
    "persist/list",
    "persist/damaged",
    "persist/recurrent_offsets_differ",
    "persist/empty_layers_differ/mlx-lm",
    "paged/fork",
    "paged/evict",
    "paged/same_block_other_prefix",
    "paged/prefill_partial_same_end",
    "paged/affine_cow_partial",
];

impl Op {
    /// The [`API_CLASSES`] this op exercises (from the op alone).
    pub fn api_classes(&self) -> Vec<&'static str> {
        match self {
            Op::Admit { .. } => vec!["admit"],
            Op::SoloWindow { .. } => vec!["solo_window"],
            Op::SoloDecode { .. } => vec!["solo_decode"],
            Op::SoloTrim { n, bypass, .. } => {
                let mut v = vec![if *bypass { "solo_trim/bypass" } else { "solo_trim/plain" }];
                if *n == 0 {
                    v.push("solo_trim/zero");
                }
                v
            }
            Op::Merge { .. } => vec!["merge"],
            Op::Join { order, .. } => {
                let permuted = order.iter().enumerate().any(|(i, &r)| r as usize != i);
                vec![if permuted { "join/permuted" } else { "join/identity_order" }]
            }
            Op::BatchPrefill { lengths, uncommitted, .. } => {
                let mut v = vec!["batch_prefill"];
                if lengths.iter().any(|&l| l != lengths[0]) {
                    v.push("batch_prefill/uneven_lengths");
                }
                if !uncommitted.is_empty() {
                    v.push("batch_prefill/uncommitted");
                }
                v
            }
            Op::Decode => vec!["decode"],
            Op::Window { .. } => vec!["window"],
            Op::Append { .. } => vec!["append"],
            Op::Verify { .. } => vec!["verify"],
            Op::CommitSpan { .. } => vec!["commit_span"],
            Op::Extract { finish, .. } => vec![if *finish { "extract/finish" } else { "extract/continue" }],
            Op::Filter { keep } => {
                let reordered = keep.windows(2).any(|w| w[0] > w[1]);
                vec![if reordered { "filter/reordered" } else { "filter/subset" }]
            }
            Op::Trim { bypass, .. } => vec![if *bypass { "trim/bypass" } else { "trim/plain" }],
            Op::ReadBlock { .. } => vec!["read_block"],
            Op::BidirPrefill { .. } => vec!["bidir_prefill"],
            Op::EncoderRead { batch, .. } => vec![if *batch { "encoder_read/batch" } else { "encoder_read/solo" }],
            Op::CompiledStep { .. } => vec!["compiled_step"],
            Op::CompiledBatchStep => vec!["compiled_batch_step"],
            Op::CommitKnownSpans { .. } => vec!["commit_known_spans"],
            Op::TrainingForward { .. } => vec!["training_forward"],
            Op::PrefixSharedForward { .. } => vec!["prefix_shared_forward"],
            Op::TrainingRefusal { persist } => {
                vec![if *persist { "training_refusal/persist" } else { "training_refusal/merge" }]
            }
            Op::Adopt { invalid } => vec![if *invalid { "adopt/invalid_state" } else { "adopt" }],
            Op::Quantize { mid_round, .. } => {
                let mut v = vec!["to_quantized"];
                if *mid_round {
                    v.push("to_quantized/mid_round");
                }
                v
            }
            Op::DecodePhase => vec!["decode_phase"],
            // Applied only on a running batch, whose rows hold positions (the family skips it otherwise).
            Op::Prepare { lengths, chunk, chunks } => {
                let mut v = vec!["prepare/non_empty_rows"];
                if lengths.contains(&0) {
                    v.push("prepare/zero_length");
                }
                let longest = lengths.iter().copied().max().unwrap_or(0);
                if (*chunks as u64) * (*chunk as u64) < longest as u64 {
                    v.push("finalize/early");
                }
                v
            }
            Op::IllFormed { input, .. } => vec![match input {
                IllInput::Dtype => "ill_formed/dtype",
                IllInput::Shape => "ill_formed/shape",
                IllInput::Heads => "ill_formed/heads",
                IllInput::StorageKind => "ill_formed/storage_kind",
                IllInput::RowId => "ill_formed/row_id",
            }],
            Op::PrefixReuse { .. } => vec!["prefix_reuse"],
            Op::PlainRead => vec!["plain_read"],
            Op::Fetch { .. } => vec!["fetch"],
            Op::Persist { mlxlm, .. } => vec![if *mlxlm { "persist/mlx-lm" } else { "persist/kvsim" }],
            Op::Paged { action: PagedAction::Fork { .. } } => vec!["paged/fork"],
            Op::Paged { action: PagedAction::Evict { .. } } => vec!["paged/evict"],
            Op::Paged { action: PagedAction::SameEnd { .. } } => vec![],
        }
    }

    /// This op's kind.
    pub fn kind(&self) -> OpKind {
        match self {
            Op::Admit { .. } => OpKind::Admit,
            Op::SoloWindow { .. } => OpKind::SoloWindow,
            Op::SoloDecode { .. } => OpKind::SoloDecode,
            Op::SoloTrim { .. } => OpKind::SoloTrim,
            Op::Merge { .. } => OpKind::Merge,
            Op::Join { .. } => OpKind::Join,
            Op::BatchPrefill { .. } => OpKind::BatchPrefill,
            Op::Decode => OpKind::Decode,
            Op::Window { .. } => OpKind::Window,
            Op::Append { .. } => OpKind::Append,
            Op::Verify { .. } => OpKind::Verify,
            Op::CommitSpan { .. } => OpKind::CommitSpan,
            Op::Extract { .. } => OpKind::Extract,
            Op::Filter { .. } => OpKind::Filter,
            Op::Trim { .. } => OpKind::Trim,
            Op::ReadBlock { .. } => OpKind::ReadBlock,
            Op::BidirPrefill { .. } => OpKind::BidirPrefill,
            Op::EncoderRead { .. } => OpKind::EncoderRead,
            Op::CompiledStep { .. } => OpKind::CompiledStep,
            Op::CompiledBatchStep => OpKind::CompiledBatchStep,
            Op::CommitKnownSpans { .. } => OpKind::CommitKnownSpans,
            Op::TrainingForward { .. } => OpKind::TrainingForward,
            Op::PrefixSharedForward { .. } => OpKind::PrefixSharedForward,
            Op::TrainingRefusal { .. } => OpKind::TrainingRefusal,
            Op::PrefixReuse { .. } => OpKind::PrefixReuse,
            Op::PlainRead => OpKind::PlainRead,
            Op::Fetch { .. } => OpKind::Fetch,
            Op::Adopt { .. } => OpKind::Adopt,
            Op::DecodePhase => OpKind::DecodePhase,
            Op::Prepare { .. } => OpKind::Prepare,
            Op::IllFormed { .. } => OpKind::IllFormed,
            Op::Quantize { .. } => OpKind::Quantize,
            Op::Persist { .. } => OpKind::Persist,
            Op::Paged { .. } => OpKind::Paged,
        }
    }

    /// Smaller variants of this op, for parameter shrinking (each strictly "smaller" than `self`).
    pub fn shrink_candidates(&self) -> Vec<Op> {
        let halve = |x: u32| -> Vec<u32> {
            let mut v = vec![];
            if x > 1 {
                v.push(1);
                v.push(x / 2);
                v.push(x - 1);
            }
            v.dedup();
            v
        };
        let mut out = vec![];
        match self {
            Op::SoloWindow { req, len } => {
                out.extend(halve(*len).into_iter().map(|len| Op::SoloWindow { req: *req, len }))
            }
            Op::SoloTrim { req, n, bypass } => {
                out.extend(halve(*n).into_iter().map(|n| Op::SoloTrim { req: *req, n, bypass: *bypass }))
            }
            Op::Window { len } => out.extend(halve(*len).into_iter().map(|len| Op::Window { len })),
            Op::Append { len } => out.extend(halve(*len).into_iter().map(|len| Op::Append { len })),
            Op::CommitSpan { len } => out.extend(halve(*len).into_iter().map(|len| Op::CommitSpan { len })),
            Op::Fetch { len } => out.extend(halve(*len).into_iter().map(|len| Op::Fetch { len })),
            Op::Paged { action: PagedAction::Fork { req, n, len, finish } } => {
                for n in halve(*n) {
                    out.push(Op::Paged { action: PagedAction::Fork { req: *req, n, len: *len, finish: *finish } });
                }
                for len in halve(*len) {
                    out.push(Op::Paged { action: PagedAction::Fork { req: *req, n: *n, len, finish: *finish } });
                }
            }
            Op::Paged { action: PagedAction::Evict { blocks } } => {
                out.extend(halve(*blocks).into_iter().map(|blocks| Op::Paged { action: PagedAction::Evict { blocks } }))
            }
            Op::Paged { action: PagedAction::SameEnd { extra, chunk } } => {
                for extra in halve(*extra).into_iter().filter(|&e| e > 0) {
                    out.push(Op::Paged { action: PagedAction::SameEnd { extra, chunk: *chunk } });
                }
                for chunk in halve(*chunk).into_iter().filter(|&c| c > 0) {
                    out.push(Op::Paged { action: PagedAction::SameEnd { extra: *extra, chunk } });
                }
            }
            Op::EncoderRead { req, len, window, batch } => {
                out.extend(halve(*len).into_iter().map(|len| Op::EncoderRead {
                    req: *req,
                    len,
                    window: *window,
                    batch: *batch,
                }))
            }
            Op::Trim { n, bypass } => out.extend(halve(*n).into_iter().map(|n| Op::Trim { n, bypass: *bypass })),
            Op::Verify { gamma, accept } => {
                for g in halve(*gamma) {
                    out.push(Op::Verify { gamma: g, accept: accept.iter().map(|&a| a.min(g)).collect() });
                }
            }
            Op::Join { reqs, order } if !order.is_empty() => {
                out.push(Op::Join { reqs: reqs.clone(), order: vec![] });
            }
            Op::Merge { reqs } | Op::Join { reqs, .. } if reqs.len() > 1 => {
                for i in 0..reqs.len() {
                    let mut r = reqs.clone();
                    r.remove(i);
                    out.push(if matches!(self, Op::Merge { .. }) {
                        Op::Merge { reqs: r }
                    } else {
                        Op::Join { reqs: r, order: vec![] }
                    });
                }
            }
            Op::Prepare { lengths, chunk, chunks } => {
                for c in halve(*chunk) {
                    out.push(Op::Prepare { lengths: lengths.clone(), chunk: c, chunks: *chunks });
                }
                for (i, &l) in lengths.iter().enumerate() {
                    for s in halve(l) {
                        let mut ls = lengths.clone();
                        ls[i] = s;
                        out.push(Op::Prepare { lengths: ls, chunk: *chunk, chunks: *chunks });
                    }
                }
            }
            Op::BatchPrefill { reqs, lengths, chunk, uncommitted } => {
                let un = uncommitted.clone();
                if !un.is_empty() {
                    out.push(Op::BatchPrefill {
                        reqs: reqs.clone(),
                        lengths: lengths.clone(),
                        chunk: *chunk,
                        uncommitted: vec![],
                    });
                }
                for c in halve(*chunk) {
                    out.push(Op::BatchPrefill {
                        reqs: reqs.clone(),
                        lengths: lengths.clone(),
                        chunk: c,
                        uncommitted: un.clone(),
                    });
                }
                for (i, &l) in lengths.iter().enumerate() {
                    for s in halve(l) {
                        let mut ls = lengths.clone();
                        ls[i] = s;
                        out.push(Op::BatchPrefill {
                            reqs: reqs.clone(),
                            lengths: ls,
                            chunk: *chunk,
                            uncommitted: un.clone(),
                        });
                    }
                }
                if reqs.len() > 1 {
                    for i in 0..reqs.len() {
                        let (mut r, mut l) = (reqs.clone(), lengths.clone());
                        let gone = r.remove(i);
                        if i < l.len() {
                            l.remove(i);
                        }
                        let u = un.iter().copied().filter(|&x| x != gone).collect();
                        out.push(Op::BatchPrefill { reqs: r, lengths: l, chunk: *chunk, uncommitted: u });
                    }
                }
            }
            _ => {}
        }
        out
    }
}
