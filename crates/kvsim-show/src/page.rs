//! The page as plain data: everything the HTML page and the terminal text draw, built once from a replay
//! ([`crate::build`]). The HTML page embeds it as JSON for its script (the per-op pictures are drawn in the
//! browser from it); the static parts of the page and the terminal text are rendered from it in Rust.

use serde::Serialize;

/// One trace, replayed and described.
#[derive(Debug, Clone, Serialize)]
pub struct Page {
    pub header: Header,
    /// The command that reproduces the run (`kvsim replay ...`).
    pub replay_command: String,
    /// The command that draws this page again.
    pub show_command: String,
    /// One cell per op of the trace, in order.
    pub ops: Vec<OpCell>,
    /// One lane per request the run admitted.
    pub lanes: Vec<Lane>,
    /// Per family the observer could watch: what it saw after every op.
    pub families: Vec<FamilyView>,
    pub failure: Option<FailureView>,
    pub shrunk: Option<ShrunkView>,
    /// The op whose pictures the page opens with.
    pub selected: usize,
    /// What the page cannot show, and why (pieces the observer interface does not carry).
    pub unobservable: Vec<String>,
}

/// The trace's header.
#[derive(Debug, Clone, Serialize)]
pub struct Header {
    /// The trace file as given on the command line.
    pub path: String,
    pub seed: u64,
    /// The swarm config, as the trace stores it.
    pub config: serde_json::Value,
    pub families: Vec<String>,
    pub kvsim_version: String,
    /// The MLX version the trace was recorded with, and the one this replay ran on.
    pub trace_mlx_version: String,
    pub replay_mlx_version: String,
    pub device: String,
    pub mutant: Option<String>,
    /// What a corpus replay requires (`pass` or `fail`).
    pub expect: String,
    pub note: String,
    /// The outcome the trace recorded, and the replay's.
    pub recorded_outcome: String,
    pub replay_outcome: String,
    /// `None` when the replay does what the trace expects; else why not.
    pub mismatch: Option<String>,
}

/// How an op ended in the replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Applied, every check passed.
    Passed,
    /// Skipped (its references did not exist, or a family does not support its kind).
    Skipped,
    /// The first divergence: a check failed here and the run stopped.
    Failed,
    /// After the failure: the run never reached it.
    NotRun,
}

impl Status {
    pub fn name(self) -> &'static str {
        match self {
            Status::Passed => "passed",
            Status::Skipped => "skipped",
            Status::Failed => "failed",
            Status::NotRun => "not run",
        }
    }
}

/// One op of the trace.
#[derive(Debug, Clone, Serialize)]
pub struct OpCell {
    pub index: usize,
    pub kind: String,
    /// The op as `kvsim replay` prints it.
    pub text: String,
    pub status: Status,
}

/// Where a request is after an op.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Place {
    /// Admitted, outside the batch (its own serial cache).
    Solo,
    /// A row of the running batch.
    Batch,
}

/// A run of consecutive ops (`from..=to`) a request spends in one place.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Span {
    pub from: usize,
    pub to: usize,
    pub place: Place,
}

/// One request over the run.
#[derive(Debug, Clone, Serialize)]
pub struct Lane {
    pub req: u32,
    pub admitted: usize,
    pub spans: Vec<Span>,
    /// The op after which it was no longer live (finished, filtered out), if it happened.
    pub finished: Option<usize>,
}

/// What the observer saw of one family.
#[derive(Debug, Clone, Serialize)]
pub struct FamilyView {
    /// The family's name in the config (`attention`, `quant`, `ssm`).
    pub name: String,
    /// `kv` (temporal K/V views) or `ssm` (recurrent states).
    pub kind: String,
    pub layers: usize,
    /// The ring's window `W` (`None`: linear caches).
    pub window: Option<usize>,
    /// Geometry and storage, in words.
    pub geometry: String,
    /// One entry per op (`None`: skipped or not run: nothing changed or nothing was seen).
    pub ops: Vec<Option<OpSnap>>,
}

/// A family after one op: the states it handed over (most ops one, after the op; a verify also one before its
/// rollback), each with the calls made before it.
#[derive(Debug, Clone, Serialize)]
pub struct OpSnap {
    pub stages: Vec<Stage>,
    /// Why no (final) state is shown, when none is.
    pub missing: Option<String>,
}

/// One state a family handed over, and the production calls made since the previous one.
#[derive(Debug, Clone, Serialize)]
pub struct Stage {
    /// Where the state comes from (`after the op`, `mid-op checkpoint`, ...).
    pub source: String,
    /// The production calls, in order, in words.
    pub calls: Vec<String>,
    /// The running batch's requests in row order.
    pub batch: Vec<u32>,
    /// Every live request, batch rows first (empty for calls after the last state).
    pub rows: Vec<RowSnap>,
    /// The masks the reads among `calls` attended with (one per distinct mask and read; layers that read the
    /// same mask share one).
    pub masks: Vec<MaskPic>,
}

/// The mask one read attended with, as the production call reported it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct MaskPic {
    /// The read, `layers 0, 1: batch decode` style.
    pub what: String,
    /// `none` (every column visible), `causal` (MLX's bottom-right causal mask) or `matrix` (a boolean matrix).
    pub kind: String,
    /// Matrix rows (1: one matrix broadcast over every batch row), queries per row and key columns.
    pub rows: usize,
    pub queries: usize,
    pub cols: usize,
    /// One line per (row, query) of a matrix, `#` a visible key column and `.` a hidden one; at most
    /// [`MaskPic::LINES`] lines of [`MaskPic::COLS`] columns are kept (`clipped` then says so).
    pub grid: Vec<String>,
    pub clipped: bool,
}

impl MaskPic {
    /// Lines of a matrix kept.
    pub const LINES: usize = 32;
    /// Columns of a line kept.
    pub const COLS: usize = 96;
}

/// One live request after an op.
#[derive(Debug, Clone, Serialize)]
pub struct RowSnap {
    pub req: u32,
    /// `batch row R` or `solo` (a recurrent row: `batch row R at op K's batch call` when the op made no batch
    /// call, as that family describes no extract or filter).
    pub home: String,
    /// Positions ever written (the RoPE position of its next write).
    pub offset: usize,
    pub layers: Vec<LayerSnap>,
}

/// One layer of one request.
#[derive(Debug, Clone, Serialize)]
pub struct LayerSnap {
    /// The model's layer index (a hybrid run's recurrent layers are some of its layers).
    pub layer: usize,
    /// Live columns of the temporal view (0 for recurrent rows).
    pub len: usize,
    /// The live window in temporal order, as runs of tokens identified from the K bytes.
    pub tokens: Vec<TokRun>,
    /// `plain` or `affine B-bit, group G`.
    pub storage: String,
    /// Affine storage: the six planes of the temporal view, `name dtype [shape]`.
    pub planes: Vec<String>,
    /// Recurrent rows: the two states.
    pub ssm: Option<SsmSnap>,
    /// Families with rings: the ring as production stores it, beside the reference model's.
    pub ring: Option<RingSnap>,
}

/// One layer's ring of one request after an op: production's physical columns (tokens identified from its K bytes),
/// write head and padding, and the reference model's where they differ.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RingSnap {
    /// Physical columns `[0, len)`, physical order; a run's `expected` is false where the column does not hold the
    /// model's token for that physical column.
    pub columns: Vec<TokRun>,
    pub offset: usize,
    pub len: usize,
    /// The write head (physical column of the next write).
    pub idx: usize,
    pub last_concat: Option<usize>,
    /// Physical order is not temporal order (`idx < len`).
    pub rotated: bool,
    /// A batch row's mlx-lm left padding and pending prefill positions (`None`: a request alone).
    pub left_padding: Option<i64>,
    pub pending: Option<usize>,
    /// The model's ring, when any of its columns or numbers differ from production's (`None`: they agree).
    pub model: Option<ModelRing>,
}

/// The reference model's ring of one row (what production's must equal).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ModelRing {
    /// The token of each physical column, as `(request, position)`.
    pub columns: Vec<(u32, u32)>,
    pub offset: usize,
    pub idx: usize,
    pub last_concat: Option<usize>,
    pub left_padding: Option<i64>,
    pub pending: Option<usize>,
}

/// Consecutive columns of a window: `n` columns from `pos` of request `req` (`kind` `tok`), or `n` columns that hold
/// padding poison (`pad`), zeros (`zero`) or bytes no candidate token has (`unknown`). `expected` is false when the
/// columns are not the positions `offset - len ..` of the row's own request (the view's own consistency: the
/// model's window is not handed to observers); `named` marks the column a failing `layout` check names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TokRun {
    pub kind: String,
    pub req: u32,
    pub pos: u32,
    pub n: u32,
    pub expected: bool,
    pub named: bool,
}

/// A recurrent row's two states of one layer.
#[derive(Debug, Clone, Serialize)]
pub struct SsmSnap {
    /// `dtype [shape]`.
    pub conv: String,
    pub rec: String,
    /// The first 16 hex digits of blake3 of each state's bytes.
    pub conv_digest: String,
    pub rec_digest: String,
    /// Whether each changed since the previous op's snapshot of this request.
    pub conv_changed: bool,
    pub rec_changed: bool,
}

/// The first failing check.
#[derive(Debug, Clone, Serialize)]
pub struct FailureView {
    pub op_index: usize,
    pub op_text: String,
    pub check: String,
    pub message: String,
    /// The storage-kind family whose check failed (`None`: the runner's own).
    pub family: Option<String>,
    /// Every check that failed in this op when it ran to its end with kvsim's checks off (the first is the
    /// failure above).
    pub all_failures: Vec<String>,
    /// Pictures of what the message names.
    pub details: Vec<Detail>,
}

/// One picture of the failure.
#[derive(Debug, Clone, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Detail {
    /// Production's and the model's ring of one row, from the `(offset, len, idx, last_concat)` the check printed.
    Rings { what: String, window: Option<usize>, production: RingPic, model: RingPic },
    /// Production's mask of one query against the model's visible columns.
    Mask { what: String, width: usize, production: Vec<usize>, model: Vec<usize> },
    /// Expected and actual elements.
    Values(ValueTable),
    /// Labelled values side by side (`label`, production, model).
    Pairs { what: String, rows: Vec<(String, String, String)> },
    /// A piece of the failure that is not observable, and why.
    Unobservable { what: String },
}

/// A ring's physical columns.
#[derive(Debug, Clone, Serialize)]
pub struct RingPic {
    pub offset: usize,
    pub len: usize,
    pub idx: usize,
    pub last_concat: Option<usize>,
    pub rotated: bool,
    /// The position each physical column holds (`None`: holds nothing), over the window (or `len` for linear).
    pub columns: Vec<Option<usize>>,
}

/// Elements of an expected and an actual array, or of an actual one alone.
#[derive(Debug, Clone, Serialize)]
pub struct ValueTable {
    pub what: String,
    pub dtype: String,
    pub expected_label: String,
    pub actual_label: String,
    /// The first elements (differing ones first when there is an expectation).
    pub rows: Vec<ValueRow>,
    /// Elements compared, elements that differ, and the largest ULP distance (`None` without an expectation).
    pub total: usize,
    pub differing: Option<usize>,
    pub max_ulp: Option<u64>,
}

/// One element: where, expected and actual bits (hex) and values, ULP distance.
#[derive(Debug, Clone, Serialize)]
pub struct ValueRow {
    pub at: String,
    pub expected_hex: Option<String>,
    pub expected: Option<String>,
    pub actual_hex: String,
    pub actual: String,
    /// ULP distance (floating-point dtypes with an expectation only).
    pub ulp: Option<u64>,
    /// Whether expected and actual bits differ.
    pub differs: bool,
}

/// The shrunk trace beside the original.
#[derive(Debug, Clone, Serialize)]
pub struct ShrunkView {
    /// Where it came from (`shrunk now, N replays` or the file given).
    pub source: String,
    pub original: Vec<String>,
    pub shrunk: Vec<String>,
    pub outcome: String,
}
