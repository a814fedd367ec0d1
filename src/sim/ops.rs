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
    Join { reqs: Vec<u32> },
    /// Fresh (empty) requests are prefilled together: right-padded to the longest with `prepare(lengths)`, fed in
    /// chunks of `chunk` (each a window read), `finalize`d, then joined into the running batch (R-BROT-2).
    BatchPrefill { reqs: Vec<u32>, lengths: Vec<u32>, chunk: u32 },
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
    /// Trim every row of the batch by `n` (R-C-5, no bypass).
    Trim { n: u32 },
    /// DiffusionGemma's canvas read (R-ROT-9c) of `len` block positions on a request outside the batch: the block
    /// attends the stored context and itself; nothing is stored, offsets never move.
    ReadBlock { req: u32, len: u32 },
    /// Gemma 4's bidirectional vision prefill (R-ROT-9a) of `len` positions on a request outside the batch; bit `i`
    /// of `image` marks position `i` an image token. Defined only at offset 0: elsewhere the typed error is expected.
    BidirPrefill { req: u32, len: u32, image: u64 },
    /// One decode step of a request outside the batch through the compiled-decode protocol (R-C-9): plan, pure step,
    /// apply; it must equal the ordinary append byte for byte.
    CompiledStep { req: u32 },
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
    TrainingForward,
    PrefixSharedForward,
    TrainingRefusal,
    PrefixReuse,
    PlainRead,
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
        OpKind::TrainingForward,
        OpKind::PrefixSharedForward,
        OpKind::TrainingRefusal,
        OpKind::PrefixReuse,
        OpKind::PlainRead,
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
            OpKind::TrainingForward => "training_forward",
            OpKind::PrefixSharedForward => "prefix_shared_forward",
            OpKind::TrainingRefusal => "training_refusal",
            OpKind::PrefixReuse => "prefix_reuse",
            OpKind::PlainRead => "plain_read",
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
            OpKind::TrainingForward => 6,
            OpKind::PrefixSharedForward => 3,
            OpKind::TrainingRefusal => 1,
            OpKind::PrefixReuse => 3,
            OpKind::PlainRead => 1,
        }
    }

    /// The training kinds: executed by the training family only (never drawn in a run without it).
    pub fn is_training(self) -> bool {
        matches!(self, OpKind::TrainingForward | OpKind::PrefixSharedForward | OpKind::TrainingRefusal)
    }

    /// The bf16-first family's own kinds: drawn only in runs that hold it.
    pub fn is_transition(self) -> bool {
        matches!(self, OpKind::PrefixReuse | OpKind::PlainRead)
    }

    /// Kinds every run keeps, so that requests can reach the batch and make progress.
    pub fn essential(self) -> bool {
        matches!(self, OpKind::Admit | OpKind::SoloWindow | OpKind::Decode | OpKind::Join)
    }
}

impl Op {
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
            Op::CompiledStep { .. } => OpKind::CompiledStep,
            Op::TrainingForward { .. } => OpKind::TrainingForward,
            Op::PrefixSharedForward { .. } => OpKind::PrefixSharedForward,
            Op::TrainingRefusal { .. } => OpKind::TrainingRefusal,
            Op::PrefixReuse { .. } => OpKind::PrefixReuse,
            Op::PlainRead => OpKind::PlainRead,
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
            Op::Trim { n } => out.extend(halve(*n).into_iter().map(|n| Op::Trim { n })),
            Op::Verify { gamma, accept } => {
                for g in halve(*gamma) {
                    out.push(Op::Verify { gamma: g, accept: accept.iter().map(|&a| a.min(g)).collect() });
                }
            }
            Op::Merge { reqs } | Op::Join { reqs } if reqs.len() > 1 => {
                for i in 0..reqs.len() {
                    let mut r = reqs.clone();
                    r.remove(i);
                    out.push(if matches!(self, Op::Merge { .. }) {
                        Op::Merge { reqs: r }
                    } else {
                        Op::Join { reqs: r }
                    });
                }
            }
            Op::BatchPrefill { reqs, lengths, chunk } => {
                for c in halve(*chunk) {
                    out.push(Op::BatchPrefill { reqs: reqs.clone(), lengths: lengths.clone(), chunk: c });
                }
                for (i, &l) in lengths.iter().enumerate() {
                    for s in halve(l) {
                        let mut ls = lengths.clone();
                        ls[i] = s;
                        out.push(Op::BatchPrefill { reqs: reqs.clone(), lengths: ls, chunk: *chunk });
                    }
                }
                if reqs.len() > 1 {
                    for i in 0..reqs.len() {
                        let (mut r, mut l) = (reqs.clone(), lengths.clone());
                        r.remove(i);
                        if i < l.len() {
                            l.remove(i);
                        }
                        out.push(Op::BatchPrefill { reqs: r, lengths: l, chunk: *chunk });
                    }
                }
            }
            _ => {}
        }
        out
    }
}
