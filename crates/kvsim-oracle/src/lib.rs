//! The differential oracle against mlx-lm (`oracles/PROTOCOL.md`, `oracles/README.md`).
//!
//! - [`record`]: replays a kvsim trace with a [`Recorder`] in the runner, giving the protocol steps and kvsim's own
//!   result records.
//! - [`run_driver`]: runs the Python driver (`oracles/mlx_lm/driver.py`, in the venv `setup.sh` creates) on the
//!   steps and parses its results.
//! - [`diff`]: compares kvsim's results with the oracle's, step by step, and classifies every divergence: a
//!   documented semantic choice, an mlx-lm bug of the catalog, an unsupported mapping, or **unclassified**. A
//!   divergence that changes state (a **root**) explains only what it touched (its requests, or the running batch
//!   and its rows until the batch is gone; a request until it finishes); everything else keeps being compared.
//!   Where the driver re-synced mlx-lm by replay (`PROTOCOL.md` decision 14), nothing is left to explain.
//! - [`check_dir`]: the recorded set (`oracles/recorded/NAME.trace.json` + `NAME.oracle.jsonl`, the driver's
//!   results), compared without Python.
#![cfg_attr(test, allow(clippy::print_stdout, clippy::print_stderr))]

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

pub mod recorder;
pub mod teeth;

use crate::recorder::{Outcome, Record, Recorder, StepInfo, Values};
use kvsim_cache::bytes::Words;
use kvsim_harness::sim::config::{DtypeChoice, SimConfig};
use kvsim_harness::sim::observe::Read;
use kvsim_harness::sim::trace::Trace;
use kvsim_harness::sim::DeviceChoice;

/// kvsim's side of one trace.
pub struct Recording {
    /// STEPS lines (empty unless recorded with `emit_steps`).
    pub steps: Vec<String>,
    pub infos: Vec<StepInfo>,
    pub results: Vec<Record>,
    /// The bytes of every read output, by sha256.
    pub values: Values,
}

impl Recording {
    pub fn steps_jsonl(&self) -> String {
        self.steps.iter().map(|l| format!("{l}\n")).collect()
    }
}

/// Replays `trace` on CPU with the recorder observing the run (the same run loop as `kvsim sim`): kvsim's steps
/// (when `emit_steps`) and result records. Every kvsim check still runs; a failing one is an error (only passing
/// traces are compared).
pub fn record(trace: &Trace, emit_steps: bool) -> Result<Recording, String> {
    if trace.mutant.is_some() {
        return Err("a mutant trace is not compared with the oracle".into());
    }
    let mut rec = Recorder::new(&trace.config, emit_steps);
    let r = kvsim_harness::sim::run_observed(
        trace.seed,
        trace.config.clone(),
        Some(trace.ops.clone()),
        DeviceChoice::Cpu,
        None,
        &mut rec,
    );
    if let kvsim_harness::sim::trace::Outcome::Fail { op_index, check, message } = &r.trace.outcome {
        let op = r.trace.ops.get(*op_index);
        return Err(format!("kvsim check failed at op {op_index} {op:?}: [{check}] {message}"));
    }
    Ok(Recording { steps: rec.steps, infos: rec.infos, results: rec.results, values: rec.values })
}

// ------------------------------------------------------------------------------------------------------------
// the driver
// ------------------------------------------------------------------------------------------------------------

/// `oracles/mlx_lm` (the current directory's when it has one, else this crate's).
pub fn driver_dir() -> PathBuf {
    let local = Path::new("oracles/mlx_lm");
    if local.join("driver.py").is_file() {
        return local.to_path_buf();
    }
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../oracles/mlx_lm")
}

/// Creates the driver's venv if needed (`setup.sh`, idempotent; offline once set up). Returns its python.
pub fn setup_driver() -> Result<PathBuf, String> {
    let dir = driver_dir();
    let out = std::process::Command::new("bash")
        .arg(dir.join("setup.sh"))
        .output()
        .map_err(|e| format!("cannot run {}/setup.sh: {e}", dir.display()))?;
    if !out.status.success() {
        return Err(format!(
            "setup.sh failed: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(dir.join(".venv/bin/python"))
}

/// Runs the driver on `steps` (JSON Lines) and parses its results. `work` is a scratch directory.
pub fn run_driver(python: &Path, steps: &str, work: &Path, name: &str) -> Result<(Vec<Record>, String), String> {
    std::fs::create_dir_all(work).map_err(|e| format!("{}: {e}", work.display()))?;
    let sp = work.join(format!("{name}.steps.jsonl"));
    let rp = work.join(format!("{name}.oracle.jsonl"));
    std::fs::write(&sp, steps).map_err(|e| format!("{}: {e}", sp.display()))?;
    let out = std::process::Command::new(python)
        .arg(driver_dir().join("driver.py"))
        .arg(&sp)
        .arg(&rp)
        .output()
        .map_err(|e| format!("cannot run the driver: {e}"))?;
    if !out.status.success() {
        return Err(format!("driver exited {:?}: {}", out.status.code(), String::from_utf8_lossy(&out.stderr)));
    }
    let text = std::fs::read_to_string(&rp).map_err(|e| format!("{}: {e}", rp.display()))?;
    let _ = std::fs::remove_file(&sp);
    let _ = std::fs::remove_file(&rp);
    Ok((parse_results(&text)?, text))
}

/// Parses a RESULTS file.
pub fn parse_results(text: &str) -> Result<Vec<Record>, String> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .enumerate()
        .map(|(i, l)| Record::parse(l).map_err(|e| format!("line {}: {e}", i + 1)))
        .collect()
}

/// The output bytes a RESULTS file carries (`vals` beside `rows`, PROTOCOL.md "Results"), by their sha256. Each is
/// checked against the hash of its row: a file whose bytes do not match its hashes is refused, never measured.
pub fn parse_values(text: &str) -> Result<Values, String> {
    let mut out = Values::new();
    for (i, l) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(l).map_err(|e| format!("line {}: not JSON: {e}", i + 1))?;
        let (Some(rows), Some(vals)) = (v.get("rows"), v.get("vals")) else { continue };
        let (Some(rows), Some(vals)) = (rows.as_array(), vals.as_array()) else {
            return Err(format!("line {}: rows and vals must be lists", i + 1));
        };
        if rows.len() != vals.len() {
            return Err(format!("line {}: {} rows, {} vals", i + 1, rows.len(), vals.len()));
        }
        for (h, b) in rows.iter().zip(vals) {
            let Some(b) = b.as_str() else { continue };
            let bytes = base64::Engine::decode(&base64::engine::general_purpose::STANDARD, b)
                .map_err(|e| format!("line {}: vals: {e}", i + 1))?;
            let sha = recorder::sha_hex(&bytes);
            if h.as_str() != Some(sha.as_str()) {
                return Err(format!("line {}: vals do not hash to their row's sha256", i + 1));
            }
            out.insert(sha, bytes);
        }
    }
    Ok(out)
}

/// The driver's RESULTS with the `vals` kvsim's own recording already holds removed (a row whose hash equals one of
/// kvsim's outputs has exactly those bytes): what is stored keeps mlx-lm's bytes only where they are news.
pub fn strip_known_values(text: &str, kvsim: &Values) -> String {
    let mut out = String::with_capacity(text.len());
    for l in text.lines() {
        let mut v: serde_json::Value = match serde_json::from_str(l) {
            Ok(v) => v,
            Err(_) => {
                out.push_str(l);
                out.push('\n');
                continue;
            }
        };
        let rows: Vec<Option<String>> = v
            .get("rows")
            .and_then(|r| r.as_array())
            .map(|r| r.iter().map(|h| h.as_str().map(str::to_string)).collect())
            .unwrap_or_default();
        if let Some(vals) = v.get_mut("vals").and_then(|x| x.as_array_mut()) {
            for (val, h) in vals.iter_mut().zip(&rows) {
                if h.as_ref().is_some_and(|h| kvsim.contains_key(h) || h == recorder::EMPTY_SHA) {
                    *val = serde_json::Value::Null;
                }
            }
            if vals.iter().all(|x| x.is_null()) {
                v.as_object_mut().map(|o| o.remove("vals"));
            }
        }
        out.push_str(&v.to_string());
        out.push('\n');
    }
    out
}

/// The bytes of both sides' read outputs, for measuring a divergence (ULPs at output scale, `check::ulp_at_scale`).
/// mlx-lm's bytes for a hash are its own `vals`, or kvsim's bytes of the same hash.
pub struct Measure<'a> {
    pub dtype: mlx_rs::Dtype,
    pub kvsim: &'a Values,
    pub oracle: &'a Values,
    /// Per step of a batch read, the sha256 of mlx-lm's own solo computation of each row (`solo`, PROTOCOL.md
    /// decision 17; `None` where the driver had no history to replay).
    pub solo: &'a BTreeMap<usize, Vec<Option<String>>>,
}

impl Measure<'_> {
    /// The largest distance between two outputs given by hash, `None` when either's bytes are unknown or their sizes
    /// differ.
    pub fn ulp(&self, kvsim: &str, oracle: &str) -> Option<u64> {
        let a = self.kvsim.get(kvsim)?;
        let b = self.oracle.get(oracle).or_else(|| self.kvsim.get(oracle))?;
        let w = if self.dtype == mlx_rs::Dtype::Bfloat16 { 2 } else { 4 };
        let (a, b) = (Words::from_le(a, w)?, Words::from_le(b, w)?);
        if a.len() != b.len() {
            return None;
        }
        Some(kvsim_harness::sim::check::max_ulp_of_words(self.dtype, &a, &b))
    }

    /// Whether every row of the read at `step` whose output differs from mlx-lm's batch output equals mlx-lm's own
    /// solo computation of that row byte for byte (false when the driver gave none).
    fn rows_equal_solo(&self, step: usize, k: Option<&Outcome>, o: Option<&Outcome>) -> bool {
        let (Some(Outcome::Rows(a)), Some(Outcome::Rows(b)), Some(solo)) = (k, o, self.solo.get(&step)) else {
            return false;
        };
        a.len() == b.len()
            && a.len() == solo.len()
            && a.iter().zip(b).zip(solo).all(|((x, y), s)| x == y || s.as_deref() == Some(x.as_str()))
    }

    /// The largest distance over the rows of a read that differ (`None`: some row unmeasurable).
    fn rows(&self, k: Option<&Outcome>, o: Option<&Outcome>) -> Option<u64> {
        let (Some(Outcome::Rows(a)), Some(Outcome::Rows(b))) = (k, o) else { return None };
        if a.len() != b.len() {
            return None;
        }
        a.iter().zip(b).filter(|(x, y)| x != y).map(|(x, y)| self.ulp(x, y)).try_fold(0u64, |m, u| Some(m.max(u?)))
    }
}

/// The `solo` hashes a RESULTS file carries beside a batch read's `rows` (PROTOCOL.md decision 17), by step.
pub fn parse_solo(text: &str) -> Result<BTreeMap<usize, Vec<Option<String>>>, String> {
    let mut out = BTreeMap::new();
    for (i, l) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: serde_json::Value = serde_json::from_str(l).map_err(|e| format!("line {}: not JSON: {e}", i + 1))?;
        let Some(solo) = v.get("solo") else { continue };
        let step = v.get("step").and_then(|s| s.as_u64()).ok_or_else(|| format!("line {}: no step", i + 1))?;
        let rows = solo.as_array().ok_or_else(|| format!("line {}: solo must be a list", i + 1))?;
        out.insert(step as usize, rows.iter().map(|h| h.as_str().map(str::to_string)).collect());
    }
    Ok(out)
}

/// The dtype of a run's outputs.
pub fn output_dtype(cfg: &SimConfig) -> mlx_rs::Dtype {
    match cfg.dtype {
        DtypeChoice::F32 => mlx_rs::Dtype::Float32,
        DtypeChoice::Bf16 => mlx_rs::Dtype::Bfloat16,
    }
}

// ------------------------------------------------------------------------------------------------------------
// classification
// ------------------------------------------------------------------------------------------------------------

/// The size of the read rules (`row-layout`, `one-position-window`): the same keys summed in another order round
/// differently, by at most this many ULPs at output scale; a key too many or too few (a mask that lets padding in, a
/// lost position) is far above it. Set from measurement (oracles/README.md, "Sizes").
pub const READ_RULE_ULP_F32: u64 = 64;
/// See [`READ_RULE_ULP_F32`].
pub const READ_RULE_ULP_BF16: u64 = 64;

/// What a classified divergence is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Verdict {
    Documented,
    MlxLmBug,
    Unsupported,
}

impl Verdict {
    pub fn name(self) -> &'static str {
        match self {
            Verdict::Documented => "documented semantic choice",
            Verdict::MlxLmBug => "mlx-lm bug",
            Verdict::Unsupported => "unsupported mapping",
        }
    }
}

/// The classification rules. Each names its reason and where it is written down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Rule {
    /// A batch read differs for rows whose physical columns differ between the layouts (padding, wrap) while the
    /// stored bytes agree.
    RowLayout,
    /// A one-position window (or a later read of the layout it left) after a wrap.
    OnePositionWindow,
    /// mlx-lm refuses (trims 0) a trim kvsim performs, once the ring has wrapped.
    TrimNoopAfterWrap,
    /// Per-row trims with unequal counts.
    PerRowTrim,
    /// A right-padded prefill chunk of one position: mlx-lm's ring raises until `finalize()`.
    PaddedSingletonChunk,
    /// A bypass trim that is not right after a window write: kvsim refuses, mlx-lm trims.
    BypassOutsideWindow,
    /// A trim of more positions than a row holds: kvsim refuses (typed error), mlx-lm clamps.
    TrimPastStart,
    /// mlx-lm's batch `extract` crashes on a batch cache that holds no arrays yet (`keys is None`).
    ExtractEmptyBatch,
    /// After a right-padded prefill on rings, mlx-lm's window of a row as long as the window holds a padding key.
    PrefillPaddingInWindow,
    /// mlx-lm's `QuantizedKVCache` allocates `D // (32 // bits)` packed words: one too many for 5 and 6 bits at
    /// D = 128, and the first write raises.
    QuantPackedWidth,
    /// A conversion with parameters MLX refuses for the head dim: kvsim refuses with a typed error, mlx-lm raises
    /// from `mx.quantize` (or, with no data to quantize, converts and fails at the next write).
    InvalidQuantParams,
    /// A speculative round of the recurrent family that rolled back: mlx-lm's `ArraysCache` has no rollback.
    SsmRound,
    /// A left-padded prepared prefill over running rows that have history: mlx-lm's convolution puts the zeroed
    /// padding between a row's history and its new inputs; kvsim reads each row's own stream.
    SsmLeftPadHistory,
    /// A batch read whose rows differ from mlx-lm's beyond rounding, where mlx-lm's own solo read of the same
    /// request (decision 17) equals kvsim's row byte for byte: mlx-lm's batch is not its solo.
    BatchNotSolo,
}

impl Rule {
    pub const ALL: &'static [Rule] = &[
        Rule::RowLayout,
        Rule::OnePositionWindow,
        Rule::TrimNoopAfterWrap,
        Rule::PerRowTrim,
        Rule::PaddedSingletonChunk,
        Rule::BypassOutsideWindow,
        Rule::TrimPastStart,
        Rule::ExtractEmptyBatch,
        Rule::PrefillPaddingInWindow,
        Rule::QuantPackedWidth,
        Rule::InvalidQuantParams,
        Rule::SsmRound,
        Rule::SsmLeftPadHistory,
        Rule::BatchNotSolo,
    ];

    pub fn id(self) -> &'static str {
        match self {
            Rule::RowLayout => "row-layout",
            Rule::OnePositionWindow => "one-position-window",
            Rule::TrimNoopAfterWrap => "bug-18-trim-noop-after-wrap",
            Rule::PerRowTrim => "per-row-trim",
            Rule::PaddedSingletonChunk => "padded-singleton-chunk",
            Rule::BypassOutsideWindow => "bypass-outside-window",
            Rule::TrimPastStart => "trim-past-start",
            Rule::ExtractEmptyBatch => "extract-empty-batch",
            Rule::PrefillPaddingInWindow => "prefill-padding-in-window",
            Rule::QuantPackedWidth => "quant-packed-width",
            Rule::InvalidQuantParams => "invalid-quant-params",
            Rule::SsmRound => "ssm-round",
            Rule::SsmLeftPadHistory => "ssm-left-pad-history",
            Rule::BatchNotSolo => "batch-not-solo",
        }
    }

    pub fn verdict(self) -> Verdict {
        match self {
            Rule::TrimNoopAfterWrap
            | Rule::ExtractEmptyBatch
            | Rule::PrefillPaddingInWindow
            | Rule::QuantPackedWidth
            | Rule::BatchNotSolo => Verdict::MlxLmBug,
            Rule::PerRowTrim | Rule::SsmRound => Verdict::Unsupported,
            _ => Verdict::Documented,
        }
    }

    /// The layouts a rule applies to: `linear`, `ring` (the attention family's plain caches), `quant-linear`,
    /// `quant-ring` (the quantized family once its caches are affine), `ssm` (the recurrent family). A divergence on
    /// another layout is never classified by it.
    pub fn layouts(self) -> &'static [&'static str] {
        const KV: &[&str] = &["linear", "ring", "quant-linear", "quant-ring"];
        const RINGS: &[&str] = &["ring", "quant-ring"];
        match self {
            // Left padding (any plain batch) or a wrapped shared write pointer (rings); quantized batches are
            // compared row by row (decision 16), where no row has another layout.
            Rule::RowLayout | Rule::BatchNotSolo => &["linear", "ring"],
            Rule::OnePositionWindow | Rule::TrimNoopAfterWrap => RINGS,
            Rule::PaddedSingletonChunk | Rule::PrefillPaddingInWindow => &["ring"],
            Rule::PerRowTrim | Rule::BypassOutsideWindow | Rule::TrimPastStart => KV,
            Rule::ExtractEmptyBatch => &["linear", "ring", "ssm"],
            Rule::QuantPackedWidth | Rule::InvalidQuantParams => &["quant-linear", "quant-ring"],
            Rule::SsmRound | Rule::SsmLeftPadHistory => &["ssm"],
        }
    }

    /// The size a read rule allows: the largest distance of a differing row's output from mlx-lm's, in ULPs at
    /// output scale (`check::ulp_at_scale`). `None` for the rules of state-changing steps (they explain what follows
    /// them, not a read's size).
    pub fn max_ulp(self, dtype: mlx_rs::Dtype) -> Option<u64> {
        let bf16 = dtype == mlx_rs::Dtype::Bfloat16;
        match self {
            Rule::RowLayout | Rule::OnePositionWindow => {
                Some(if bf16 { READ_RULE_ULP_BF16 } else { READ_RULE_ULP_F32 })
            }
            _ => None,
        }
    }

    /// Why, with the citation.
    pub fn reason(self) -> &'static str {
        match self {
            Rule::BatchNotSolo => {
                "a batch read whose differing rows differ from mlx-lm's batch output beyond the read rules' size (more \
                 than rounding), while mlx-lm's own solo computation of each such row (the driver replays the request's \
                 writes on a fresh cache of its class and reads it alone, PROTOCOL.md decision 17) equals kvsim's row \
                 byte for byte: mlx-lm's batch read is not its solo read. Seen on window reads of left-padded rows of \
                 BatchRotatingKVCache (seed-21 step 23: L = 5 on W = 4; seed-27 steps 87-88). Not in the catalog; kvsim \
                 promises each row its solo result (seeds 001_492dbf43c5432563.txt:55, R-TKV-4)"
            }
            Rule::RowLayout => {
                "a batch read of a row whose physical columns differ between the layouts, stored bytes equal (the next \
                 checkpoint agrees): kvsim keeps every row left-aligned with its own phase, exactly as its solo ring \
                 (ARCHITECTURE.md \"Rows\"; its output equals its solo twin's), mlx-lm left-pads rows shorter than the \
                 batch and, after a wrap, shares one write pointer; the same keys at other columns (other masked columns, \
                 another order) give other last bits in MLX's SDPA. Seeds: 001_492dbf43c5432563.txt:55 (\"one row keeps its \
                 physical columns and phase\", R-TKV-4), 002_432a426e18550fdd.txt:39 (\"without changing their physical \
                 ring columns\", R-BROT-8); measured-baselines.md (mlx-lm batch vs solo)"
            }
            Rule::OnePositionWindow => {
                "a one-position window on a ring after a wrap (or a later read of the layout it left): kvsim's read picks the \
                 write path and concatenates in temporal order, mlx-lm's update_and_fetch writes L = 1 in place; same stored \
                 bytes, another key order. Seeds: 000_7eb8175f52e88e8d.txt:50 (R-ROT-3, \"a one-row window concatenates: the \
                 same bits until the ring wraps, a different key order after\"), 002_432a426e18550fdd.txt:46 (batched rows)"
            }
            Rule::TrimNoopAfterWrap => {
                "mlx-lm's trim_prompt_cache trims nothing and returns 0 once the rotating cache has wrapped \
                 (is_trimmable: offset < max_size), so the rejected speculative positions stay; kvsim's bypass rollback \
                 trims them. bug-catalog.md #18"
            }
            Rule::PerRowTrim => {
                "per-row rollback with unequal counts: mlx-lm's batch caches trim every row by one n \
                 (mlx-lm-cache-semantics.md §8-9); the driver reports it unsupported (oracles/mlx_lm/README.md)"
            }
            Rule::PaddedSingletonChunk => {
                "a right-padded prefill chunk of one position: mlx-lm's BatchRotatingKVCache sends L = 1 to the in-place \
                 write, which raises until finalize(); kvsim uses the concat write with the block mask. Seed \
                 002_432a426e18550fdd.txt:44 (R-BROT-1, \"padded singleton chunks use its concat operation with the \
                 matching block mask until finalization\")"
            }
            Rule::BypassOutsideWindow => {
                "a bypass trim that does not follow a window write of at least n positions: kvsim refuses it \
                 (BypassNotAfterWindow / TrimTooLong), mlx-lm's trim_prompt_cache ignores bypass and trims while the ring is \
                 trimmable. Seed 000_7eb8175f52e88e8d.txt:44-47 (R-C-5: bypass is for \"the last n <= gamma tips right after \
                 a 1 concat write\")"
            }
            Rule::TrimPastStart => {
                "a trim of more positions than a row holds: kvsim refuses it with a typed error (TrimTooLong), mlx-lm clamps \
                 n (KVCache.trim: min(offset, n); batch caches: min(_idx or _offset, n), past a short row's start). Seed \
                 000_7eb8175f52e88e8d.txt:44 (R-C-5 \"drop the last n tokens\"), ARCHITECTURE.md (impossible requests are \
                 typed errors)"
            }
            Rule::ExtractEmptyBatch => {
                "mlx-lm's BatchRotatingKVCache.extract / BatchKVCache.extract index `self.keys[idx : idx + 1]` without \
                 checking for a batch that holds no arrays yet (keys is None: rows that joined empty, or merge's all-empty \
                 result), so extracting such a row raises TypeError; kvsim extracts an empty row. Not in the catalog: the \
                 class of bug-catalog.md #5 (a batch method reads .keys of a cache that has none; #5 is merge's, fixed by \
                 PR #755) in extract"
            }
            Rule::PrefillPaddingInWindow => {
                "after a right-padded prefill on BatchRotatingKVCache, a row at least the window long whose last real \
                 position comes in an earlier chunk than the longest row's keeps a padding key as the oldest position of \
                 its window: every later chunk trims the buffer to max_size - 1 columns before appending (the roll that \
                 protects real positions only moves the row's padding in front of them), and finalize() moves the row's \
                 last padding in front of its max_size - 1 newest positions, so extract()/size() show max_size columns, \
                 one of them padding. Benign for outputs (that position is outside every later query's window) and gone \
                 after the row's next write; the taint is tracked and the comparison continues. kvsim never stores \
                 padded positions (ARCHITECTURE.md; seed 000_7eb8175f52e88e8d.txt:21-22: prepared prefill padding is \
                 never visible). Not in the catalog (the family of bug-catalog.md #8 / #1, right-padded prefill chunks); \
                 the condition was checked against mlx-lm 0.32.2 on 4,122 random geometries"
            }
            Rule::QuantPackedWidth => {
                "a first write to a QuantizedKVCache at 5 or 6 bits with head_dim 128: mlx-lm 0.32.2's update_and_fetch \
                 allocates D // (32 // bits) packed words (21 / 25) where mx.quantize returns D * bits / 32 (20 / 24), \
                 and the assignment raises ValueError [broadcast_shapes] after offset was already advanced \
                 (mlx_lm/models/cache.py QuantizedKVCache.update_and_fetch, init_quant); kvsim uses D * bits / 32 \
                 (docs/quantized-kv.md; mutant quant-packed-width-divides)"
            }
            Rule::InvalidQuantParams => {
                "a conversion with bits or group MLX refuses for the head dim (bits not in {2,3,4,5,6,8}, group not in \
                 {32,64,128} or not dividing head_dim; mlx 0.32.2 mlx/ops.cpp quantize): kvsim refuses with \
                 CacheError::InvalidQuant and changes nothing (ARCHITECTURE.md: impossible requests are typed errors); \
                 mlx-lm's KVCache.to_quantized calls mx.quantize, which raises ValueError on cached data and checks \
                 nothing when there is none (the conversion then succeeds and the next write raises)"
            }
            Rule::SsmLeftPadHistory => {
                "a left-padded prepared prefill over running rows that already have history (kvsim's batch_prefill pads \
                 the running rows on the left too): mlx-lm 0.32.2's GatedDeltaNet (mlx_lm/models/qwen3_5.py) convolves \
                 concat(conv_state, where(mask, qkv, 0)), so the zeroed padding sits between the row's history and its \
                 new inputs, and a row that is all padding in a chunk takes its new conv state at `lengths` = the chunk \
                 width, i.e. K-1 zeroed padding rows: its conv state is wiped. kvsim reads each row's own stream (its \
                 conv state followed directly by its real inputs) and keeps it (docs/ssm.md \"Padding\"; R-SSM-3). mlx-lm \
                 uses left padding only for fresh rows (BatchGenerator), where the two agree (checked: the fresh rows \
                 of the same prefill agree byte for byte). The differing rows are explained from here on; the others \
                 keep being compared"
            }
            Rule::SsmRound => {
                "a speculative round of the recurrent family that rolled rows back (kvsim's spec_round_rollback_rows: \
                 restore the pre-round snapshot, replay the accepted prefix; docs/ssm.md, R-SSM-4, R-C-6): mlx-lm 0.32.2 \
                 has no counterpart (mlx_lm/models/cache.py ArraysCache.is_trimmable() is False, and \
                 generate.speculative_generate_step refuses caches that cannot be trimmed), so its rows keep every \
                 draft position. The rows that rolled back are explained from here on; the other rows (which kept \
                 all gamma positions, as mlx-lm did) keep being compared, in checkpoints and in batch outputs"
            }
        }
    }
}

/// How a divergence is classified.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Class {
    Rule(Rule),
    /// A consequence of the earlier state-changing divergence at `root` (step index), classified with it.
    Consequence {
        root: usize,
        rule: Option<Rule>,
    },
    Unclassified,
}

impl Class {
    pub fn is_classified(&self) -> bool {
        match self {
            Class::Rule(_) => true,
            Class::Consequence { rule, .. } => rule.is_some(),
            Class::Unclassified => false,
        }
    }
    pub fn rule(&self) -> Option<Rule> {
        match self {
            Class::Rule(r) => Some(*r),
            Class::Consequence { rule, .. } => *rule,
            Class::Unclassified => None,
        }
    }
    pub fn describe(&self) -> String {
        match self {
            Class::Rule(r) => format!("{} [{}]", r.id(), r.verdict().name()),
            Class::Consequence { root, rule: Some(r) } => format!("consequence of step {root} ({})", r.id()),
            Class::Consequence { root, rule: None } => format!("consequence of step {root} (UNCLASSIFIED)"),
            Class::Unclassified => "UNCLASSIFIED".into(),
        }
    }
}

/// One step where kvsim and the oracle disagree.
#[derive(Debug, Clone)]
pub struct Divergence {
    pub step: usize,
    /// kvsim op index of the step.
    pub op: usize,
    pub op_kind: &'static str,
    /// Step type (with the read kind).
    pub what: String,
    /// What differs.
    pub detail: String,
    /// For a read: the largest distance of a differing row's output, in ULPs at output scale (`None`: not measured,
    /// mlx-lm's bytes unknown).
    pub ulp: Option<u64>,
    pub class: Class,
}

fn step_name(info: &StepInfo) -> String {
    match info.read {
        Some(r) if info.t != "prefill_chunk" => format!("{} {} L={} layer {}", info.t, r.name(), info.l, info.layer),
        _ if info.t == "prefill_chunk" => format!("prefill_chunk L={} layer {}", info.l, info.layer),
        _ => info.t.to_string(),
    }
}

/// The first `n` characters of a hash (all of it when shorter: the driver's results are input, never trusted).
fn head(s: &str, n: usize) -> &str {
    s.char_indices().nth(n).map_or(s, |(i, _)| &s[..i])
}

fn show(o: Option<&Outcome>) -> String {
    match o {
        None => "no record".into(),
        Some(Outcome::Rows(r)) => {
            format!("rows [{}]", r.iter().map(|s| head(s, 8)).collect::<Vec<_>>().join(", "))
        }
        Some(Outcome::Trimmed(n)) => format!("trimmed {n}"),
        Some(Outcome::TrimmedRows(n)) => format!("trimmed rows {n:?}"),
        Some(Outcome::Converted(c)) => format!("converted {c}"),
        Some(Outcome::Resynced { trimmed, replayed }) => {
            format!("trimmed {trimmed}, re-synced by replay less {replayed}")
        }
        Some(Outcome::Checkpoint { reqs, .. }) => format!("checkpoint of {} requests", reqs.len()),
        Some(Outcome::Unsupported(s)) => format!("unsupported: {s}"),
        Some(Outcome::Error(s)) => format!("error: {s}"),
    }
}

fn detail(k: Option<&Outcome>, o: Option<&Outcome>) -> String {
    match (k, o) {
        (Some(Outcome::Rows(a)), Some(Outcome::Rows(b))) if a.len() == b.len() => {
            let rows: Vec<String> = (0..a.len())
                .filter(|&i| a[i] != b[i])
                .map(|i| format!("row {i}: kvsim {} / mlx-lm {}", head(&a[i], 12), head(&b[i], 12)))
                .collect();
            format!("output differs ({} of {} rows): {}", rows.len(), a.len(), rows.join("; "))
        }
        (Some(Outcome::Checkpoint { reqs: a, .. }), Some(Outcome::Checkpoint { reqs: b, .. })) => {
            let mut out = vec![];
            for id in a.keys().chain(b.keys()).collect::<BTreeSet<_>>() {
                match (a.get(id), b.get(id)) {
                    (Some(x), Some(y)) if x == y => {}
                    (Some(x), Some(y)) => {
                        let mut parts = vec![];
                        if x.offset != y.offset {
                            parts.push(format!("offset {} vs {}", x.offset, y.offset));
                        }
                        for l in 0..x.k.len().max(y.k.len()) {
                            if x.k.get(l) != y.k.get(l) {
                                parts.push(format!("K layer {l}"));
                            }
                            if x.v.get(l) != y.v.get(l) {
                                parts.push(format!("V layer {l}"));
                            }
                        }
                        out.push(format!("request {id}: {}", parts.join(", ")));
                    }
                    (Some(_), None) => out.push(format!("request {id} missing in mlx-lm")),
                    (None, Some(_)) => out.push(format!("request {id} only in mlx-lm")),
                    (None, None) => {}
                }
            }
            format!("state differs: {}", out.join("; "))
        }
        _ => format!("kvsim {} / mlx-lm {}", show(k), show(o)),
    }
}

/// The rule for a read whose outputs differ in rows `rows` (to be confirmed by the next checkpoint agreeing).
fn read_rule(info: &StepInfo, layout_r3: &BTreeMap<u32, usize>, rows: &[usize]) -> Option<Rule> {
    let one = info.l == 1 && info.read == Some(Read::Window);
    match info.t {
        "solo" if one && info.wrapped => Some(Rule::OnePositionWindow),
        "solo" if info.read == Some(Read::Decode) && layout_r3.contains_key(&info.reqs[0]) => {
            Some(Rule::OnePositionWindow)
        }
        "batch" if one && info.wrapped => Some(Rule::OnePositionWindow),
        "batch" if rows.iter().all(|&r| info.wrapped || info.lens.get(r).is_some_and(|&len| len < info.bound)) => {
            Some(Rule::RowLayout)
        }
        "prefill_chunk" if info.l == 1 && info.wrapped => Some(Rule::OnePositionWindow),
        _ => None,
    }
}

/// The rows whose outputs differ.
fn differing_rows(k: Option<&Outcome>, o: Option<&Outcome>) -> Vec<usize> {
    match (k, o) {
        (Some(Outcome::Rows(a)), Some(Outcome::Rows(b))) if a.len() == b.len() => {
            (0..a.len()).filter(|&i| a[i] != b[i]).collect()
        }
        _ => vec![],
    }
}

/// The requests whose checkpoint views differ (None unless both are checkpoints of the same requests with the
/// same offsets).
fn differing_requests(k: Option<&Outcome>, o: Option<&Outcome>) -> Option<BTreeSet<u32>> {
    let (Some(Outcome::Checkpoint { reqs: a, .. }), Some(Outcome::Checkpoint { reqs: b, .. })) = (k, o) else {
        return None;
    };
    if a.keys().ne(b.keys()) || a.iter().any(|(id, v)| v.offset != b[id].offset) {
        return None;
    }
    Some(a.keys().filter(|id| a[id] != b[id]).copied().collect())
}

/// The rule for a checkpoint that differs with no state-changing step identified before it.
fn checkpoint_rule(
    infos: &[StepInfo],
    step: usize,
    k: Option<&Outcome>,
    o: Option<&Outcome>,
    window: Option<usize>,
) -> Option<Rule> {
    let (Some(Outcome::Checkpoint { reqs: a, .. }), Some(Outcome::Checkpoint { reqs: b, .. })) = (k, o) else {
        return None;
    };
    let info = &infos[step];
    if info.op_kind != "batch_prefill" {
        return None;
    }
    // The recurrent family: the rows a left-padded prepare padded on the left over their history.
    if let Some(p) = infos[..step].iter().rev().take_while(|s| s.op == info.op).find(|s| s.t == "prepare") {
        let history: BTreeSet<u32> = p
            .reqs
            .iter()
            .zip(p.left.iter().zip(&p.lens))
            .filter(|(_, (&left, &had))| left > 0 && had > 0)
            .map(|(r, _)| *r)
            .collect();
        let differing: BTreeSet<u32> = a.keys().filter(|id| b.get(id) != Some(&a[id])).copied().collect();
        let offsets_agree = differing.iter().all(|id| b.get(id).is_some_and(|v| v.offset == a[id].offset));
        return (offsets_agree && !differing.is_empty() && differing.is_subset(&history))
            .then_some(Rule::SsmLeftPadHistory);
    }
    let w = window?;
    // The prefill step of this op.
    let p = infos[..step].iter().rev().take_while(|s| s.op == info.op).find(|s| s.t == "prefill")?;
    if !p.padded || a.keys().ne(b.keys()) {
        return None;
    }
    let differing: BTreeSet<u32> = a.keys().filter(|id| a[id] != b[id]).copied().collect();
    let offsets_agree = differing.iter().all(|id| a[id].offset == b[id].offset);
    (offsets_agree && !differing.is_empty() && differing == padding_in_window_rows(p, w))
        .then_some(Rule::PrefillPaddingInWindow)
}

/// The rows of a right-padded prefill on rings of window `w` that mlx-lm leaves with a padding key in their window:
/// a row at least `w` long whose last real position comes in an earlier chunk than the longest row's last. (Each
/// later chunk trims the buffer to `w - 1` columns before appending, and the row's real positions are then the
/// newest `w - 1`; `finalize()` moves its padding in front of them, and its window of `w` shows one.) Checked
/// against mlx-lm 0.32.2 on 4,122 random (W, lengths, chunk) geometries without a mismatch.
pub fn padding_in_window_rows(prefill: &StepInfo, w: usize) -> BTreeSet<u32> {
    let chunk = prefill.l.max(1);
    let longest = prefill.real.iter().copied().max().unwrap_or(0);
    if !prefill.padded || longest == 0 {
        return BTreeSet::new();
    }
    prefill
        .reqs
        .iter()
        .zip(&prefill.real)
        .filter(|(_, &len)| len >= w && (len - 1) / chunk < (longest - 1) / chunk)
        .map(|(r, _)| *r)
        .collect()
}

/// The rule for a divergence that changes state (trims, refused or failed steps).
fn state_rule(info: &StepInfo, k: Option<&Outcome>, o: Option<&Outcome>, rotating: bool) -> Option<Rule> {
    if let Some(Outcome::Resynced { trimmed, replayed }) = o {
        // mlx-lm's entry point refused; the driver replayed the request's writes less `replayed` positions
        // (decision 14). Judged as mlx-lm's refusal (bug #18 when kvsim trimmed that many), else as a trim of
        // `replayed` that kvsim refused.
        return match k {
            Some(Outcome::Trimmed(kn)) if kn == replayed => {
                state_rule(info, k, Some(&Outcome::Trimmed(*trimmed)), rotating)
            }
            _ => state_rule(info, k, Some(&Outcome::Trimmed(*replayed)), rotating),
        };
    }
    match (info.t, k, o) {
        ("solo_trim" | "trim" | "trim_rows", Some(Outcome::Trimmed(kn)), Some(Outcome::Trimmed(on))) => {
            let t = info.trim.as_ref()?;
            if *on == 0 && *kn > 0 && t.bypass && info.wrapped && rotating {
                return Some(Rule::TrimNoopAfterWrap);
            }
            if *kn == 0 && *on > 0 {
                return refused_trim_rule(info);
            }
            None
        }
        ("trim_rows", Some(Outcome::TrimmedRows(_)), Some(Outcome::Unsupported(_))) => Some(Rule::PerRowTrim),
        // A per-row trim kvsim refused (all 0) that the driver performed (its re-sync, decision 14): the rules of
        // refused trims.
        ("trim_rows", Some(Outcome::TrimmedRows(kn)), Some(Outcome::TrimmedRows(on)))
            if kn.iter().all(|&x| x == 0) && on.iter().any(|&x| x > 0) =>
        {
            refused_trim_rule(info)
        }
        ("round", Some(Outcome::TrimmedRows(_)), Some(Outcome::Unsupported(s))) if s.contains("ArraysCache") => {
            Some(Rule::SsmRound)
        }
        ("prefill_chunk", _, Some(Outcome::Error(e)))
            if info.l == 1 && info.padded && rotating && e.contains("finalize()") =>
        {
            Some(Rule::PaddedSingletonChunk)
        }
        ("extract", None, Some(Outcome::Error(e)))
            if !info.batch_arrays && e.contains("'NoneType' object is not subscriptable") =>
        {
            Some(Rule::ExtractEmptyBatch)
        }
        _ => quant_rule(info, k, o),
    }
}

/// Whether the driver maps this step's batch row by row (`oracles/PROTOCOL.md` decision 16): a step of the
/// quantized family whose caches are quantized before it (mlx-lm 0.32.2 has no batched quantized cache; each row is
/// its request's own solo `QuantizedKVCache` / the driver's `RotatingQuantizedKVCache`).
fn rows_mapped(info: &StepInfo) -> bool {
    info.quant.is_some() && is_batch_step(info.t)
}

/// Row `r`'s positions before a row-mapped step: its offset (a prefill chunk's `offsets` are the positions the
/// longest row had: a row with real queries in the chunk had as many).
fn row_wrapped(info: &StepInfo, r: usize, window: Option<usize>, l: usize) -> bool {
    window.is_some_and(|w| info.offsets.get(r).is_some_and(|&o| o + l > w))
}

/// The one-position windows of a row-mapped step (decision 16) after its row's ring wrapped: a `batch` window of
/// L = 1, or a prefill chunk where the row has one real query. Each such row is then a solo ring whose layout a
/// one-position window changed (kvsim concatenates in temporal order, mlx-lm writes L = 1 in place: R-ROT-3), as
/// for a solo request; a later window of more positions concatenates in temporal order in both and ends it.
fn quant_rows_layouts(info: &StepInfo, window: Option<usize>, step: usize, layout_r3: &mut BTreeMap<u32, usize>) {
    for (r, req) in info.reqs.iter().enumerate() {
        let n = match info.t {
            "batch" if info.read == Some(Read::Window) => info.l,
            "prefill_chunk" => info.real.get(r).copied().unwrap_or(0),
            _ => continue,
        };
        if n == 1 && row_wrapped(info, r, window, 1) {
            layout_r3.insert(*req, step);
        } else if n > 1 {
            layout_r3.remove(req);
        }
    }
}

/// The read rule of a row-mapped step (decision 16): every differing row read a one-position window after its
/// ring wrapped, or decoded over the layout one left (`layout_r3`). `row-layout` never applies: each row is its
/// own solo cache in the driver, at the physical columns kvsim keeps.
fn quant_rows_read_rule(
    info: &StepInfo,
    layout_r3: &BTreeMap<u32, usize>,
    rows: &[usize],
    window: Option<usize>,
) -> Option<Rule> {
    let one_position = |r: usize| match info.t {
        "batch" => match info.read {
            Some(Read::Window) => info.l == 1 && row_wrapped(info, r, window, 1),
            Some(Read::Decode) => info.reqs.get(r).is_some_and(|q| layout_r3.contains_key(q)),
            _ => false,
        },
        "prefill_chunk" => info.real.get(r) == Some(&1) && row_wrapped(info, r, window, 1),
        _ => false,
    };
    (!rows.is_empty() && rows.iter().all(|&r| one_position(r))).then_some(Rule::OnePositionWindow)
}

/// A row-mapped step's geometry restricted to the rows of requests no root explains (decision 16: its rows are
/// independent solo caches in the driver).
fn rows_outside(info: &StepInfo, explained: &BTreeMap<u32, (usize, Option<Rule>)>) -> StepInfo {
    let keep: Vec<usize> = (0..info.reqs.len()).filter(|&r| !explained.contains_key(&info.reqs[r])).collect();
    let pick =
        |v: &Vec<usize>| if v.len() == info.reqs.len() { keep.iter().map(|&r| v[r]).collect() } else { v.clone() };
    let mut out = info.clone();
    out.reqs = keep.iter().map(|&r| info.reqs[r]).collect();
    out.offsets = pick(&info.offsets);
    out.lens = pick(&info.lens);
    out.real = pick(&info.real);
    out
}

/// The rows of a row-mapped read whose own cache raised (the driver's `"error: ..."` in place of the row's hash).
fn failed_rows(o: Option<&Outcome>) -> Vec<usize> {
    match o {
        Some(Outcome::Rows(rows)) => (0..rows.len()).filter(|&r| rows[r].starts_with("error:")).collect(),
        _ => vec![],
    }
}

/// The rule of a row-mapped read whose rows `failed` raised in mlx-lm while the other rows agree:
/// `quant-packed-width` when every failure is that crash (5 or 6 bits where `D * bits / 32 != D // (32 // bits)`,
/// `[broadcast_shapes]`: a row whose `QuantizedKVCache` was created quantized, as for a solo write).
fn quant_rows_failed_rule(info: &StepInfo, k: Option<&Outcome>, o: Option<&Outcome>, failed: &[usize]) -> Option<Rule> {
    let (Some(Outcome::Rows(a)), Some(Outcome::Rows(b))) = (k, o) else { return None };
    let others_agree = a.len() == b.len() && (0..a.len()).all(|r| failed.contains(&r) || a[r] == b[r]);
    let (bits, _) = info.quant?;
    let d = info.head_dim;
    let wrong_width = matches!(bits, 5 | 6) && d * bits / 32 != d / (32 / bits);
    let crash = failed.iter().all(|&r| b[r].contains("broadcast_shapes"));
    (others_agree && wrong_width && crash).then_some(Rule::QuantPackedWidth)
}

/// Each row's trim count in a trim record (`None` for other records).
fn trim_counts(o: Option<&Outcome>, rows: usize) -> Option<Vec<i64>> {
    match o {
        Some(Outcome::Trimmed(n)) => Some(vec![*n; rows]),
        Some(Outcome::Resynced { replayed, .. }) => Some(vec![*replayed; rows]),
        Some(Outcome::TrimmedRows(ns)) if ns.len() == rows => Some(ns.iter().map(|&x| x as i64).collect()),
        _ => None,
    }
}

/// The rows where a row-mapped trim (decision 16) differs: each row is its own solo cache, so a trim that differs
/// in some rows explains their requests only.
fn quant_rows_trim_differs(info: &StepInfo, k: Option<&Outcome>, o: Option<&Outcome>) -> Option<Vec<usize>> {
    let n = info.reqs.len();
    let (kn, on) = (trim_counts(k, n)?, trim_counts(o, n)?);
    Some((0..n).filter(|&r| kn[r] != on[r]).collect())
}

/// The state rule of a row-mapped trim (decision 16) whose rows' counts differ: bug #18 when every differing row
/// is a bypass rollback that kvsim performed and mlx-lm's `trim_prompt_cache` refused on that row's ring, which
/// has reached the window (`offset >= W`, where `is_trimmable()` is False); the refused-trim rules when kvsim
/// refused in every row (its typed error) and mlx-lm trimmed.
fn quant_rows_trim_rule(
    info: &StepInfo,
    k: Option<&Outcome>,
    o: Option<&Outcome>,
    window: Option<usize>,
) -> Option<Rule> {
    let rows = quant_rows_trim_differs(info, k, o)?;
    let n = info.reqs.len();
    let (kn, on) = (trim_counts(k, n)?, trim_counts(o, n)?);
    let t = info.trim.as_ref()?;
    if rows.is_empty() {
        return None;
    }
    let reached_window = |r: usize| window.is_some_and(|w| info.offsets.get(r).is_some_and(|&x| x >= w));
    let refused_18 = |r: usize| on[r] == 0 && kn[r] > 0 && t.bypass && reached_window(r);
    if rows.iter().all(|&r| refused_18(r)) {
        return Some(Rule::TrimNoopAfterWrap);
    }
    if kn.iter().all(|&x| x == 0) && rows.iter().all(|&r| on[r] > 0) {
        return refused_trim_rule(info);
    }
    None
}

/// A trim kvsim refused (its typed error, from the trim's own record) that mlx-lm performed.
fn refused_trim_rule(info: &StepInfo) -> Option<Rule> {
    let t = info.trim.as_ref()?;
    match &t.kvsim {
        Err(e)
            if t.bypass
                && (e.starts_with("BypassNotAfterWindow") || (e.starts_with("TrimTooLong") && !t.after_window)) =>
        {
            Some(Rule::BypassOutsideWindow)
        }
        Err(e) if e.starts_with("TrimTooLong") => Some(Rule::TrimPastStart),
        _ => None,
    }
}

/// Whether MLX 0.32.2 refuses `(bits, group)` for a head dim (`mlx/ops.cpp` `quantize`: bits 2, 3, 4, 5, 6, 8; group
/// 32, 64, 128, dividing the last axis). Written here from MLX's messages, independently of kvsim's caches.
pub fn mlx_refuses_quant(bits: usize, group: usize, head_dim: usize) -> bool {
    ![2, 3, 4, 5, 6, 8].contains(&bits) || ![32, 64, 128].contains(&group) || head_dim % group != 0
}

/// The rules of the quantized family's divergences (`kv:quant`, `kv:rotating-quant`), from the step's geometry and
/// the two results only.
fn quant_rule(info: &StepInfo, k: Option<&Outcome>, o: Option<&Outcome>) -> Option<Rule> {
    let error = |o: Option<&Outcome>, what: &str| matches!(o, Some(Outcome::Error(s)) if s.contains(what));
    match info.t {
        // Rings are converted by the driver's RotatingQuantizedKVCache (decision 15) and batches mapped row by row
        // (decision 16): no unsupported mapping is left in this family.
        "quantize" => {
            let (bits, group) = info.target?;
            if mlx_refuses_quant(bits, group, info.head_dim) {
                let kvsim_refused = matches!(k, Some(Outcome::Converted(false)));
                let mlx_lm = matches!(o, Some(Outcome::Converted(true))) || error(o, "[quantize]");
                return (kvsim_refused && mlx_lm).then_some(Rule::InvalidQuantParams);
            }
            None
        }
        "solo" | "batch" | "prefill_chunk" => {
            let (bits, _) = info.quant?;
            let d = info.head_dim;
            let wrong_width = matches!(bits, 5 | 6) && d * bits / 32 != d / (32 / bits);
            (wrong_width && error(o, "broadcast_shapes")).then_some(Rule::QuantPackedWidth)
        }
        _ => None,
    }
}

/// Which requests a state-changing divergence explains: `All` (every later divergence is its consequence, the rule
/// of the attention family's roots), or only some requests and possibly the running batch (the quantized family's
/// unsupported mappings: requests outside the batch keep being compared).
#[derive(Debug, Clone, PartialEq, Eq)]
enum Scope {
    All,
    Some { reqs: Vec<u32>, batch: bool },
}

/// What the driver appends to an error it re-synced after (`oracles/PROTOCOL.md` decision 14): mlx-lm's state was
/// rebuilt by mlx-lm from its own state and the step's inputs, so the comparison goes on.
pub const RESYNCED: &str = "[driver re-synced:";

fn root_scope(info: &StepInfo, rule: Option<Rule>, k: Option<&Outcome>, o: Option<&Outcome>) -> Scope {
    let resynced = matches!(o, Some(Outcome::Error(e)) if e.contains(RESYNCED));
    // Both dropped the same positions (kvsim's record and the driver's replay).
    let replayed =
        matches!((k, o), (Some(Outcome::Trimmed(kn)), Some(Outcome::Resynced { replayed, .. })) if kn == replayed);
    match (rule, info.t) {
        // mlx-lm crashed on a row that holds nothing; the driver gave the request a new (empty) cache and removed
        // the row, as kvsim did: nothing is left to explain.
        (Some(Rule::ExtractEmptyBatch), "extract") if resynced => Scope::Some { reqs: vec![], batch: false },
        // mlx-lm refused a wrapped ring's trim (bug catalog #18) and the driver rebuilt the caches by replay of the same
        // positions kvsim kept: nothing is left to explain.
        (Some(Rule::TrimNoopAfterWrap), _) if replayed => Scope::Some { reqs: vec![], batch: false },
        (Some(Rule::QuantPackedWidth), "solo") => Scope::Some { reqs: info.reqs.clone(), batch: false },
        // A recurrent round explains the rows that rolled back (the others did what mlx-lm did).
        (Some(Rule::SsmRound), _) => Scope::Some {
            reqs: info.reqs.iter().zip(&info.keep).filter(|(_, &k)| k < info.l).map(|(r, _)| *r).collect(),
            batch: false,
        },
        // A solo request's trim explains that request (and the batch once it enters it).
        (Some(_), "solo_trim") => Scope::Some { reqs: info.reqs.clone(), batch: false },
        // mlx-lm's batch then has other rows than kvsim's: everything after is explained.
        (Some(Rule::ExtractEmptyBatch), _) => Scope::All,
        // A classified root on the running batch (or the pending prefill batch) explains the batch and the
        // requests in it (the step's requests are its rows); requests outside it keep being compared, and the
        // batch's scope ends when the batch is gone (`diff_measured`).
        (Some(_), t) if is_batch_step(t) => Scope::Some { reqs: info.reqs.clone(), batch: true },
        _ => Scope::All,
    }
}

/// Step types that act on the running batch (or the pending prefill batch).
fn is_batch_step(t: &str) -> bool {
    matches!(
        t,
        "enter" | "prefill" | "prefill_chunk" | "prefill_end" | "batch" | "trim" | "trim_rows" | "extract" | "filter"
    )
}

/// Compares kvsim's results with the oracle's, step by step, and classifies every divergence.
pub fn diff(infos: &[StepInfo], kvsim: &[Record], oracle: &[Record], window: Option<usize>) -> Vec<Divergence> {
    diff_counted(infos, kvsim, oracle, window).0
}

/// A checkpoint's views restricted to the requests outside `drop`.
fn without(o: Option<&Outcome>, drop: &BTreeMap<u32, (usize, Option<Rule>)>) -> Option<Outcome> {
    match o {
        Some(Outcome::Checkpoint { op, reqs }) => Some(Outcome::Checkpoint {
            op: *op,
            reqs: reqs.iter().filter(|(id, _)| !drop.contains_key(id)).map(|(id, v)| (*id, v.clone())).collect(),
        }),
        other => other.cloned(),
    }
}

/// Where the driver holds each request (PROTOCOL.md decisions 6 and 9), followed from the steps and the driver's
/// own answers: a step it answers with a `DriverError` (raised before it changes anything) or `unsupported` changes
/// nothing; another error inside mlx-lm during a membership step leaves its rows `unknown`.
#[derive(Default)]
struct DriverRows {
    rows: Vec<u32>,
    solo: BTreeSet<u32>,
    prefill: Vec<u32>,
    unknown: bool,
}

impl DriverRows {
    fn holds(&self, r: u32) -> bool {
        self.unknown || self.rows.contains(&r) || self.solo.contains(&r) || self.prefill.contains(&r)
    }

    fn apply(&mut self, info: &StepInfo, o: Option<&Outcome>) {
        if !matches!(info.t, "admit" | "enter" | "prefill" | "prefill_end" | "extract" | "filter") {
            return;
        }
        match o {
            Some(Outcome::Unsupported(_)) => return,
            Some(Outcome::Error(e)) if e.contains(RESYNCED) => {}
            Some(Outcome::Error(e)) if e.starts_with("DriverError:") && !e.contains("DriverStateLost") => return,
            Some(Outcome::Error(_)) => {
                self.unknown = true;
                return;
            }
            _ => {}
        }
        match info.t {
            "admit" => {
                self.solo.extend(&info.reqs);
            }
            "enter" => {
                for r in &info.reqs {
                    self.solo.remove(r);
                }
                self.rows.extend(&info.reqs);
            }
            "prefill" => {
                for r in &info.reqs {
                    self.solo.remove(r);
                }
                self.prefill = info.reqs.clone();
            }
            "prefill_end" => self.rows.append(&mut self.prefill),
            "extract" => {
                // The driver extracts its own row of that index (kvsim's request there may be another one).
                let Some(row) = info.row else { return };
                if row < self.rows.len() {
                    let r = self.rows.remove(row);
                    if !info.finish {
                        self.solo.insert(r);
                    }
                }
            }
            "filter" if info.keep.iter().all(|&i| i < self.rows.len()) => {
                self.rows = info.keep.iter().map(|&i| self.rows[i]).collect();
            }
            _ => {}
        }
    }
}

/// [`diff`], plus the number of steps compared on their own: every step but the config and those a state-changing
/// divergence before them explains (its consequences, and the agreeing steps in its scope).
pub fn diff_counted(
    infos: &[StepInfo],
    kvsim: &[Record],
    oracle: &[Record],
    window: Option<usize>,
) -> (Vec<Divergence>, usize) {
    let (out, compared, _) = diff_measured(infos, kvsim, oracle, window);
    (out, compared)
}

/// [`diff_counted`], plus the steps left uncompared per rule of the root that explains them (`None`: a root no
/// rule classifies).
pub fn diff_measured(
    infos: &[StepInfo],
    kvsim: &[Record],
    oracle: &[Record],
    window: Option<usize>,
) -> (Vec<Divergence>, usize, BTreeMap<Option<Rule>, usize>) {
    diff_full(infos, kvsim, oracle, window, None)
}

/// [`diff_measured`] with the outputs' bytes: every differing read is measured, and the read rules hold only within
/// their size ([`Rule::max_ulp`]). Without `measure` no read rule holds.
pub fn diff_full(
    infos: &[StepInfo],
    kvsim: &[Record],
    oracle: &[Record],
    window: Option<usize>,
    measure: Option<&Measure>,
) -> (Vec<Divergence>, usize, BTreeMap<Option<Rule>, usize>) {
    let rotating = window.is_some();
    // The recurrent family's traces (their calls carry spans).
    let ssm = infos.iter().any(|i| !i.spans.is_empty());
    let by_step =
        |rs: &[Record]| -> BTreeMap<usize, Outcome> { rs.iter().map(|r| (r.step, r.outcome.clone())).collect() };
    let (ks, os) = (by_step(kvsim), by_step(oracle));
    let mut out: Vec<Divergence> = vec![];
    // A root that explains everything after it.
    let mut root: Option<(usize, Option<Rule>)> = None;
    // Roots of a narrower scope: the requests they explain, and whether they explain the running batch.
    let mut explained: BTreeMap<u32, (usize, Option<Rule>)> = BTreeMap::new();
    let mut batch_root: Option<(usize, Option<Rule>)> = None;
    // Where the driver holds each request, followed from the steps and the driver's own answers, and how many
    // rows kvsim's running batch has.
    let mut drv = DriverRows::default();
    // kvsim's running batch (its requests in row order) and pending prefill batch.
    let (mut kv_rows, mut kv_prefill): (Vec<u32>, Vec<u32>) = (vec![], vec![]);
    // The requests that made the batch explained (a batch root's rows, explained requests that entered it), and
    // the requests explained only because they sat in it: once every request of the first kind has left both
    // batches (and the driver's rows are kvsim's), the batch's scope ends and the second kind is compared again.
    let (mut batch_taint, mut spread): (BTreeSet<u32>, BTreeSet<u32>) = (BTreeSet::new(), BTreeSet::new());
    let mut compared = 0usize;
    let mut uncompared: BTreeMap<Option<Rule>, usize> = BTreeMap::new();
    // Read divergences waiting for the next checkpoint (index into out, tentative rule).
    let mut pending: Vec<(usize, Option<Rule>)> = vec![];
    // Solo requests whose physical layout a one-position window after a wrap changed (step of that window).
    let mut layout_r3: BTreeMap<u32, usize> = BTreeMap::new();
    // Requests whose stored window differs only by a known benign taint (a padding key in place of a position no
    // later query sees), and the divergence that classified it.
    let mut tainted: BTreeMap<u32, (usize, Rule)> = BTreeMap::new();
    let last = infos.len().max(os.keys().next_back().map_or(0, |s| s + 1));
    for step in 0..last {
        // Every taint is bounded: a request that finishes (an extract with `finish`, a row a filter drops) is no
        // longer explained, and an explained batch's scope ends once the batch is gone (every row extracted or
        // filtered out: mlx-lm's running batch is then dropped too, PROTOCOL.md decision 6).
        // The driver's rows are followed (`DriverRows`): a finished request leaves the scope once the driver holds
        // it no more either, and the batch's scope ends once both batches are empty. When a membership step failed
        // inside mlx-lm, the driver's rows are unknown and the scopes stay.
        if let Some(prev) = step.checked_sub(1).and_then(|s| infos.get(s)) {
            drv.apply(prev, os.get(&(step - 1)));
            match prev.t {
                "enter" => kv_rows.extend(&prev.reqs),
                "prefill" => kv_prefill = prev.reqs.clone(),
                "prefill_end" => kv_rows.append(&mut kv_prefill),
                "extract" => {
                    if let Some(i) = prev.row.filter(|&i| i < kv_rows.len()) {
                        kv_rows.remove(i);
                    }
                }
                "filter" => kv_rows = prev.keep.iter().filter_map(|&i| prev.reqs.get(i).copied()).collect(),
                _ => {}
            }
            if !drv.unknown {
                let finished: Vec<u32> = match prev.t {
                    "extract" if prev.finish => prev.reqs.clone(),
                    "filter" => {
                        prev.reqs.iter().enumerate().filter(|(i, _)| !prev.keep.contains(i)).map(|(_, r)| *r).collect()
                    }
                    _ => vec![],
                };
                for r in finished.iter().filter(|r| !drv.holds(**r)) {
                    explained.remove(r);
                }
                let held = |r: &u32| {
                    kv_rows.contains(r) || kv_prefill.contains(r) || drv.rows.contains(r) || drv.prefill.contains(r)
                };
                if is_batch_step(prev.t)
                    && batch_root.is_some()
                    && kv_rows == drv.rows
                    && kv_prefill == drv.prefill
                    && !batch_taint.iter().any(held)
                {
                    batch_root = None;
                    batch_taint.clear();
                    for r in kv_rows.iter().chain(&kv_prefill) {
                        if spread.remove(r) {
                            explained.remove(r);
                        }
                    }
                }
            }
        }
        let info = infos.get(step).cloned().unwrap_or_default();
        let (k, o) = (ks.get(&step), os.get(&step));
        let by_rows = rows_mapped(&info);
        if info.t == "enter" && !by_rows {
            for r in &info.reqs {
                layout_r3.remove(r);
            }
        }
        if info.t == "solo" && info.read == Some(Read::Window) && info.l == 1 && info.wrapped {
            layout_r3.insert(info.reqs[0], step);
        }
        if by_rows {
            quant_rows_layouts(&info, window, step, &mut layout_r3);
        }
        // Narrow roots spread: an explained request entering the batch explains the batch, and every request of
        // an explained batch is explained.
        let batch_step = is_batch_step(info.t);
        if matches!(info.t, "enter" | "prefill" | "prefill_end") && !by_rows {
            for r in info.reqs.iter().filter(|r| explained.contains_key(r) && !spread.contains(r)) {
                batch_taint.insert(*r);
                batch_root = batch_root.or(explained.get(r).copied());
            }
        }
        if let (true, Some(r)) = (batch_step, batch_root) {
            for id in &info.reqs {
                if !explained.contains_key(id) {
                    explained.insert(*id, r);
                    spread.insert(*id);
                }
            }
        }
        // A recurrent batch call, or a quantized batch step mapped row by row (PROTOCOL.md decision 16): its rows
        // are independent (each row's output is its own state's), so rows of explained requests are dropped and the
        // others compared.
        let row_filtered = ((!info.spans.is_empty() && info.t == "batch")
            || (by_rows && matches!(info.t, "batch" | "prefill_chunk" | "trim" | "trim_rows")))
            && root.is_none()
            && batch_root.is_none()
            && info.reqs.iter().any(|r| explained.contains_key(r))
            && info.reqs.iter().any(|r| !explained.contains_key(r));
        let keep_rows = |x: Option<&Outcome>| match x {
            Some(Outcome::Rows(rows)) if rows.len() == info.reqs.len() => Some(Outcome::Rows(
                rows.iter()
                    .zip(&info.reqs)
                    .filter(|(_, r)| !explained.contains_key(r))
                    .map(|(h, _)| h.clone())
                    .collect(),
            )),
            // A row-mapped trim: each row's count (decision 16).
            x if by_rows && trim_counts(x, info.reqs.len()).is_some() => {
                let ns = trim_counts(x, info.reqs.len()).unwrap_or_default();
                Some(Outcome::TrimmedRows(
                    ns.iter()
                        .zip(&info.reqs)
                        .filter(|(_, r)| !explained.contains_key(r))
                        .map(|(n, _)| (*n).max(0) as usize)
                        .collect(),
                ))
            }
            other => other.cloned(),
        };
        let (k_rows, o_rows) = if row_filtered { (keep_rows(k), keep_rows(o)) } else { (None, None) };
        let (k, o) = if row_filtered { (k_rows.as_ref(), o_rows.as_ref()) } else { (k, o) };
        // A row-mapped step restricted to its rows outside every explained request: its geometry too.
        let info = if row_filtered && by_rows { rows_outside(&info, &explained) } else { info };
        // The narrow root that explains this step, if any (checkpoints: decided below, per request).
        // A recurrent round is a root of its own for the rows it rolls back (rows explained earlier stay so).
        let narrow = if info.t == "checkpoint" || row_filtered || (info.t == "round" && root.is_none()) {
            None
        } else if batch_step && batch_root.is_some() {
            batch_root
        } else if info.t == "quantize" {
            // A conversion acts on every cache, also those no root explains: it is classified on its own (a
            // divergence there is a root of its own).
            None
        } else {
            info.reqs.iter().find_map(|r| explained.get(r)).copied()
        };
        let (k_cmp, o_cmp) = if info.t == "checkpoint" && root.is_none() && !explained.is_empty() {
            (without(k, &explained), without(o, &explained))
        } else {
            (k.cloned(), o.cloned())
        };
        let (k, o) = (k_cmp.as_ref(), o_cmp.as_ref());
        if info.t != "config" {
            match root.or(narrow) {
                None => compared += 1,
                Some((_, rule)) => *uncompared.entry(rule).or_insert(0) += 1,
            }
        }
        if k == o {
            if info.t == "checkpoint" {
                for (i, tentative) in pending.drain(..) {
                    out[i].class = tentative.map_or(Class::Unclassified, Class::Rule);
                }
                tainted.clear();
            }
            continue;
        }
        let mut d = Divergence {
            step,
            op: info.op,
            op_kind: info.op_kind,
            what: step_name(&info),
            detail: detail(k, o),
            ulp: measure.and_then(|m| m.rows(k, o)),
            class: Class::Unclassified,
        };
        if let Some((r, rule)) = root.or(narrow) {
            d.class = Class::Consequence { root: r, rule };
            // A step of the explained batch that differs other than by its outputs (a trim, a failed or refused
            // step) may change every row's state: every row now taints the batch.
            let read_output = matches!((k, o), (Some(Outcome::Rows(_)), Some(Outcome::Rows(_))));
            if batch_step && !read_output {
                for r in kv_rows.iter().chain(&kv_prefill).chain(&info.reqs) {
                    spread.remove(r);
                    batch_taint.insert(*r);
                }
            }
            out.push(d);
            continue;
        }
        let is_read = matches!(info.t, "solo" | "batch" | "prefill_chunk");
        let oracle_failed = matches!(o, Some(Outcome::Error(_)) | Some(Outcome::Unsupported(_)) | None);
        // A row-mapped read (decision 16) where some rows' own caches raised: a state-changing divergence of those
        // rows (mlx-lm's cache may have advanced before raising), classified row by row; their requests only.
        let failed = if by_rows && is_read { failed_rows(o) } else { vec![] };
        if !failed.is_empty() {
            let rule = quant_rows_failed_rule(&info, k, o, &failed);
            for (i, tentative) in pending.drain(..) {
                out[i].class = tentative.map_or(Class::Unclassified, Class::Rule);
            }
            d.class = rule.map_or(Class::Unclassified, Class::Rule);
            match rule {
                Some(_) => {
                    for r in failed.iter().filter_map(|&r| info.reqs.get(r)) {
                        explained.entry(*r).or_insert((step, rule));
                        spread.remove(r);
                    }
                }
                None => root = Some((step, rule)),
            }
            out.push(d);
            continue;
        }
        if is_read && !oracle_failed {
            let rows = differing_rows(k, o);
            let tentative = if by_rows && info.t != "solo" {
                quant_rows_read_rule(&info, &layout_r3, &rows, window)
            } else {
                read_rule(&info, &layout_r3, &rows)
            };
            let within = |r: &Rule| d.ulp.zip(measure).is_some_and(|(u, m)| r.max_ulp(m.dtype).is_some_and(|b| u <= b));
            let rule = tentative.filter(within).or_else(|| {
                // Beyond rounding: mlx-lm's batch read of these rows differs from its own solo read of the same
                // requests, which kvsim's rows equal byte for byte.
                (info.t == "batch" && !by_rows && measure.is_some_and(|m| m.rows_equal_solo(step, k, o)))
                    .then_some(Rule::BatchNotSolo)
            });
            pending.push((out.len(), rule));
            out.push(d);
            continue;
        }
        if info.t == "checkpoint" {
            let differing = differing_requests(k, o);
            if let Some(diff_reqs) =
                differing.as_ref().filter(|d| !d.is_empty() && d.iter().all(|r| tainted.contains_key(r)))
            {
                // Only the known benign taint: the state otherwise agrees.
                let (r0, rule) = tainted[diff_reqs.iter().next().unwrap()];
                d.class = Class::Consequence { root: r0, rule: Some(rule) };
                for (i, tentative) in pending.drain(..) {
                    out[i].class = tentative.map_or(Class::Unclassified, Class::Rule);
                }
                tainted.retain(|r, _| diff_reqs.contains(r));
                out.push(d);
                continue;
            }
            let rule = checkpoint_rule(infos, step, k, o, window);
            if rule == Some(Rule::PrefillPaddingInWindow) && tainted.is_empty() {
                // Benign: the stored windows differ only in a position no later query sees. Keep comparing.
                for r in differing.unwrap_or_default() {
                    tainted.insert(r, (step, Rule::PrefillPaddingInWindow));
                }
                for (i, tentative) in pending.drain(..) {
                    out[i].class = tentative.map_or(Class::Unclassified, Class::Rule);
                }
                d.class = Class::Rule(Rule::PrefillPaddingInWindow);
                out.push(d);
                continue;
            }
            if rule == Some(Rule::SsmLeftPadHistory) {
                // Explains the differing rows only.
                for r in differing.unwrap_or_default() {
                    explained.entry(r).or_insert((step, rule));
                    spread.remove(&r);
                }
                for (i, tentative) in pending.drain(..) {
                    out[i].class = tentative.map_or(Class::Unclassified, Class::Rule);
                }
                d.class = Class::Rule(Rule::SsmLeftPadHistory);
                out.push(d);
                continue;
            }
            // The state diverged with no state-changing step identified before it.
            root = Some((step, rule));
            for (i, _) in pending.drain(..) {
                out[i].class = Class::Consequence { root: step, rule };
            }
            d.class = rule.map_or(Class::Unclassified, Class::Rule);
            out.push(d);
            continue;
        }
        // A state-changing divergence: trims, refused or failed steps. A row-mapped trim (decision 16) whose rows
        // answered one by one is judged row by row, and explains the differing rows' requests only.
        let row_trim =
            by_rows && matches!(info.t, "trim" | "trim_rows") && quant_rows_trim_differs(&info, k, o).is_some();
        let per_row =
            row_trim && matches!((k, o), (_, Some(Outcome::TrimmedRows(_))) | (Some(Outcome::TrimmedRows(_)), _));
        let rule = if per_row { quant_rows_trim_rule(&info, k, o, window) } else { state_rule(&info, k, o, rotating) };
        for (i, tentative) in pending.drain(..) {
            out[i].class = tentative.map_or(Class::Unclassified, Class::Rule);
        }
        d.class = rule.map_or(Class::Unclassified, Class::Rule);
        let changes_state = match (k, o) {
            (Some(Outcome::TrimmedRows(n)), Some(Outcome::Unsupported(_))) => n.iter().any(|&x| x > 0),
            // A conversion both refuse (kvsim's typed error, mlx-lm's exception) changes nothing.
            (Some(Outcome::Converted(false)), Some(Outcome::Error(_))) => false,
            _ => true,
        };
        if changes_state {
            let scope = match quant_rows_trim_differs(&info, k, o).filter(|_| row_trim && rule.is_some()) {
                Some(rows) => Scope::Some { reqs: rows.iter().map(|&r| info.reqs[r]).collect(), batch: false },
                None => root_scope(&info, rule, k, o),
            };
            match scope {
                Scope::All => root = Some((step, rule)),
                Scope::Some { reqs, batch } => {
                    for r in &reqs {
                        explained.entry(*r).or_insert((step, rule));
                        spread.remove(r);
                    }
                    if batch {
                        batch_taint.extend(&reqs);
                        if batch_root.is_none() {
                            batch_root = Some((step, rule));
                        }
                    }
                }
            }
        }
        out.push(d);
    }
    for (i, tentative) in pending.drain(..) {
        out[i].class = tentative.map_or(Class::Unclassified, Class::Rule);
    }
    // A rule classifies only on the layouts it names ([`Rule::layouts`]); elsewhere its divergences (and the
    // consequences of its roots) are unclassified.
    for d in &mut out {
        let at = |step: usize| layout_of(infos.get(step), window, ssm);
        let allowed = |r: Rule, step: usize| r.layouts().contains(&at(step));
        d.class = match d.class.clone() {
            Class::Rule(r) if !allowed(r, d.step) => Class::Unclassified,
            Class::Consequence { root, rule: Some(r) } if !allowed(r, root) => Class::Consequence { root, rule: None },
            c => c,
        };
    }
    (out, compared, uncompared)
}

/// The layout a step acts on, as [`Rule::layouts`] names them.
fn layout_of(info: Option<&StepInfo>, window: Option<usize>, ssm: bool) -> &'static str {
    // A conversion acts on the layout it converts to.
    let quant = info.is_some_and(|i| i.quant.is_some() || i.t == "quantize");
    match (ssm, quant, window.is_some()) {
        (true, _, _) => "ssm",
        (false, true, true) => "quant-ring",
        (false, true, false) => "quant-linear",
        (false, false, true) => "ring",
        (false, false, false) => "linear",
    }
}

// ------------------------------------------------------------------------------------------------------------
// the recorded set
// ------------------------------------------------------------------------------------------------------------

/// The comparison of one recorded trace.
pub struct TraceReport {
    pub name: String,
    pub config: SimConfig,
    pub steps: usize,
    /// Steps compared on their own (not explained by an earlier state-changing divergence; see [`diff_counted`]).
    pub steps_compared: usize,
    /// The other steps, per rule of the root that explains them (`None`: an unclassified root).
    pub uncompared: BTreeMap<Option<Rule>, usize>,
    /// Steps where the driver re-synced mlx-lm by replay (PROTOCOL.md decision 14): its `trimmed_rows` records
    /// (a rolled-back recurrent round, a per-row trim) and the errors it re-synced after.
    pub resyncs: usize,
    /// Reads of quantized caches whose outputs agree byte for byte with mlx-lm's (`QuantizedKVCache` and
    /// `quantized_scaled_dot_product_attention`).
    pub quant_reads_agree: usize,
    /// Of those, the reads of quantized batch rows mapped row by row (`batch`, `prefill_chunk`; PROTOCOL.md decision
    /// 16), and the reads of quantized rings (the driver's `RotatingQuantizedKVCache`, decision 15).
    pub quant_batch_reads_agree: usize,
    pub quant_ring_reads_agree: usize,
    pub divergences: Vec<Divergence>,
    /// Protocol step kinds this trace exercised (`batch/decode`, `enter/join`, ...).
    pub kinds: BTreeSet<String>,
    /// Set when kvsim's side could not be recorded or the oracle results not read.
    pub error: Option<String>,
}

impl TraceReport {
    pub fn status(&self) -> &'static str {
        if self.error.is_some() || self.divergences.iter().any(|d| !d.class.is_classified()) {
            "unclassified"
        } else if self.divergences.is_empty() {
            "agree"
        } else {
            "classified"
        }
    }

    /// Rules that classified a divergence directly (not as a consequence).
    pub fn rules(&self) -> BTreeMap<Rule, usize> {
        let mut m = BTreeMap::new();
        for d in &self.divergences {
            if let Class::Rule(r) = d.class {
                *m.entry(r).or_insert(0) += 1;
            }
        }
        m
    }

    pub fn summary_line(&self) -> String {
        let cfg = &self.config;
        let shape = format!(
            "{:<4} {:<6} H {}/{} D {:<2} layers {}",
            match cfg.dtype {
                DtypeChoice::F32 => "f32",
                DtypeChoice::Bf16 => "bf16",
            },
            cfg.layout.max_size().map_or("linear".to_string(), |w| format!("W={w}")),
            cfg.heads_q,
            cfg.heads_kv,
            cfg.head_dim,
            cfg.layers
        );
        let rules: Vec<String> = self.rules().iter().map(|(r, n)| format!("{}x{n}", r.id())).collect();
        let consequences = self.divergences.iter().filter(|d| matches!(d.class, Class::Consequence { .. })).count();
        let shape = match (recorder::oracle_family(cfg), kvsim_harness::sim::family::quant::QuantChoice::of(cfg)) {
            (Some("ssm"), _) => {
                let d = kvsim_harness::sim::family::ssm::SsmSet::of(cfg).dims;
                format!(
                    "{:<4} ssm K {} H {}/{} D {}/{}",
                    format!("{:?}", cfg.dtype).to_lowercase(),
                    d.kernel,
                    d.heads_k,
                    d.heads_v,
                    d.dk,
                    d.dv
                )
            }
            (Some("quant"), Some(q)) => format!(
                "{shape} quant {}:{} D {} {}",
                q.bits,
                q.group,
                q.head_dim,
                if q.native { "native" } else { "converted" }
            ),
            _ => shape,
        };
        let mut s = format!(
            "{:<16} {shape}  {:>5} steps ({} compared)  {}",
            self.name,
            self.steps,
            self.steps_compared,
            self.status()
        );
        if self.resyncs > 0 {
            s.push_str(&format!("  {} re-synced", self.resyncs));
        }
        if self.quant_reads_agree > 0 {
            s.push_str(&format!(
                "  {} quantized reads equal ({} batch, {} ring)",
                self.quant_reads_agree, self.quant_batch_reads_agree, self.quant_ring_reads_agree
            ));
        }
        if !rules.is_empty() {
            s.push_str(&format!("  {}", rules.join(" ")));
        }
        if consequences > 0 {
            s.push_str(&format!(" (+{consequences} consequences)"));
        }
        if let Some(e) = &self.error {
            s.push_str(&format!("  error: {e}"));
        }
        s
    }
}

/// The step kinds of a recording (`t`, with the read kind or the enter mode).
pub fn step_kinds(infos: &[StepInfo]) -> BTreeSet<String> {
    infos
        .iter()
        .map(|s| match (s.t, s.read) {
            ("solo" | "batch", Some(r)) => format!("{}/{}", s.t, r.name()),
            ("enter", _) => format!("enter/{}", s.how.unwrap_or("?")),
            (t, _) => t.to_string(),
        })
        .collect()
}

/// Compares one recorded trace (`NAME.trace.json` + `NAME.oracle.jsonl`).
pub fn diff_recorded(trace_path: &Path) -> TraceReport {
    let name =
        trace_path.file_name().and_then(|n| n.to_str()).unwrap_or("?").trim_end_matches(".trace.json").to_string();
    let fail = |config: SimConfig, e: String| TraceReport {
        name: name.clone(),
        config,
        steps: 0,
        steps_compared: 0,
        uncompared: BTreeMap::new(),
        resyncs: 0,
        quant_reads_agree: 0,
        quant_batch_reads_agree: 0,
        quant_ring_reads_agree: 0,
        divergences: vec![],
        kinds: BTreeSet::new(),
        error: Some(e),
    };
    let trace = match Trace::load(trace_path) {
        Ok(t) => t,
        Err(e) => return fail(SimConfig::from_seed(0), e.to_string()),
    };
    let oracle_path = trace_path.with_file_name(format!("{name}.oracle.jsonl"));
    let (oracle, oracle_values, solo) = match std::fs::read_to_string(&oracle_path)
        .map_err(|e| format!("{}: {e}", oracle_path.display()))
        .and_then(|t| Ok((parse_results(&t)?, parse_values(&t)?, parse_solo(&t)?)))
    {
        Ok(o) => o,
        Err(e) => return fail(trace.config.clone(), e),
    };
    let rec = match record(&trace, false) {
        Ok(r) => r,
        Err(e) => return fail(trace.config.clone(), e),
    };
    let measure =
        Measure { dtype: output_dtype(&trace.config), kvsim: &rec.values, oracle: &oracle_values, solo: &solo };
    let (divergences, steps_compared, uncompared) =
        diff_full(&rec.infos, &rec.results, &oracle, trace.config.layout.max_size(), Some(&measure));
    let kinds = step_kinds(&rec.infos);
    let oracle_rows: BTreeMap<usize, &Outcome> = oracle.iter().map(|r| (r.step, &r.outcome)).collect();
    let quant_equal: Vec<&StepInfo> = rec
        .results
        .iter()
        .filter(|r| matches!(r.outcome, Outcome::Rows(_)))
        .filter(|r| rec.infos.get(r.step).is_some_and(|i| i.quant.is_some()))
        .filter(|r| oracle_rows.get(&r.step) == Some(&&r.outcome))
        .filter_map(|r| rec.infos.get(r.step))
        .collect();
    let quant_reads_agree = quant_equal.len();
    let quant_batch_reads_agree = quant_equal.iter().filter(|i| matches!(i.t, "batch" | "prefill_chunk")).count();
    let quant_ring_reads_agree = if trace.config.layout.max_size().is_some() { quant_reads_agree } else { 0 };
    let resyncs = oracle
        .iter()
        .filter(|r| match &r.outcome {
            Outcome::TrimmedRows(_) | Outcome::Resynced { .. } => true,
            Outcome::Error(e) => e.contains(RESYNCED),
            _ => false,
        })
        .count();
    TraceReport {
        name,
        config: trace.config.clone(),
        steps: rec.infos.len(),
        steps_compared,
        uncompared,
        resyncs,
        quant_reads_agree,
        quant_batch_reads_agree,
        quant_ring_reads_agree,
        divergences,
        kinds,
        error: None,
    }
}

/// The recorded traces of `dir` (sorted by name).
pub fn recorded_traces(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n.ends_with(".trace.json")))
        .collect();
    v.sort_by_key(|p| {
        let n = p.file_name().and_then(|n| n.to_str()).unwrap_or("").to_string();
        // numeric order of seed-N names
        let num: u64 = n.trim_start_matches("seed-").trim_end_matches(".trace.json").parse().unwrap_or(u64::MAX);
        (num, n)
    });
    Ok(v)
}

/// The whole recorded set.
pub struct CheckReport {
    pub traces: Vec<TraceReport>,
}

impl CheckReport {
    pub fn count(&self, status: &str) -> usize {
        self.traces.iter().filter(|t| t.status() == status).count()
    }

    /// `{"traces", "agree", "classified", "unclassified", "steps", "steps_compared"}` (steps summed over the traces).
    pub fn json_line(&self) -> String {
        format!(
            "{{\"traces\":{},\"agree\":{},\"classified\":{},\"unclassified\":{},\"steps\":{},\"steps_compared\":{}}}",
            self.traces.len(),
            self.count("agree"),
            self.count("classified"),
            self.count("unclassified"),
            self.traces.iter().map(|t| t.steps).sum::<usize>(),
            self.traces.iter().map(|t| t.steps_compared).sum::<usize>()
        )
    }

    /// Per rule: (divergences it classified directly, consequences classified with it, traces).
    pub fn rule_counts(&self) -> BTreeMap<Rule, (usize, usize, BTreeSet<String>)> {
        let mut m: BTreeMap<Rule, (usize, usize, BTreeSet<String>)> = BTreeMap::new();
        for t in &self.traces {
            for d in &t.divergences {
                match d.class {
                    Class::Rule(r) => {
                        let e = m.entry(r).or_default();
                        e.0 += 1;
                        e.2.insert(t.name.clone());
                    }
                    Class::Consequence { rule: Some(r), .. } => m.entry(r).or_default().1 += 1,
                    _ => {}
                }
            }
        }
        m
    }

    /// Steps left uncompared, per rule of the root that explains them, over all traces (`None`: unclassified).
    pub fn uncompared(&self) -> BTreeMap<Option<Rule>, usize> {
        let mut m = BTreeMap::new();
        for t in &self.traces {
            for (r, n) in &t.uncompared {
                *m.entry(*r).or_insert(0) += n;
            }
        }
        m
    }

    /// Step kinds over all traces.
    pub fn kinds(&self) -> BTreeSet<String> {
        self.traces.iter().flat_map(|t| t.kinds.iter().cloned()).collect()
    }
}

/// Every protocol step kind kvsim's runner can emit (the subset of the protocol the oracle supports that kvsim
/// uses; `solo/append` is never emitted: a solo window always reads).
pub const STEP_KINDS: &[&str] = &[
    "config",
    "admit",
    "solo/decode",
    "solo/window",
    "solo_trim",
    "enter/merge",
    "enter/join",
    "prefill",
    "prefill_chunk",
    "prefill_end",
    "batch/decode",
    "batch/window",
    "batch/append",
    "trim_rows",
    "trim",
    "extract",
    "filter",
    "quantize",
    "prepare",
    "finalize",
    "round",
    "checkpoint",
];

/// Compares every recorded trace of `dir`.
pub fn check_dir(dir: &Path) -> Result<CheckReport, String> {
    let traces = recorded_traces(dir)?.iter().map(|p| diff_recorded(p)).collect();
    Ok(CheckReport { traces })
}

// ------------------------------------------------------------------------------------------------------------
// choosing the recorded seeds
// ------------------------------------------------------------------------------------------------------------

/// What a recording exercises, for the choice of seeds: its step kinds, its dtype and layout, and the geometries
/// where kvsim and mlx-lm are expected to part (so that every rule and catalog bug gets a trace).
pub fn features(cfg: &SimConfig, infos: &[StepInfo]) -> BTreeSet<String> {
    // Only what comes before the first expected change of state is compared on its own (later divergences are
    // consequences), so only that part counts, plus the kind of that first change.
    let root = predicted_root(cfg, infos);
    let all = infos;
    let infos = &infos[..root.map_or(infos.len(), |(i, _)| i + 1)];
    let mut f = step_kinds(infos);
    if let Some((_, why)) = root {
        f.insert(format!("root/{why}"));
    }
    let wrapped_reads = infos.iter().any(|s| s.read.is_some() && s.wrapped);
    if root.is_none() && wrapped_reads {
        // Expected to agree byte for byte although its rings wrap.
        let dtype = match cfg.dtype {
            DtypeChoice::F32 => "f32",
            DtypeChoice::Bf16 => "bf16",
        };
        let one_position = infos.iter().any(|s| s.l == 1 && s.read == Some(Read::Window) && s.wrapped);
        if !one_position {
            f.insert(format!("clean-after-wrap/{dtype}"));
        }
    }
    let dtype = match cfg.dtype {
        DtypeChoice::F32 => "f32",
        DtypeChoice::Bf16 => "bf16",
    };
    let layout = if cfg.layout.max_size().is_some() { "rotating" } else { "linear" };
    f.insert(format!("config/{dtype}/{layout}"));
    let rotating = layout == "rotating";
    for s in infos {
        let one = s.l == 1 && s.read == Some(Read::Window);
        if rotating && one && s.wrapped {
            f.insert(format!("geometry/{}-one-position-window-after-wrap", s.t));
        }
        if s.t == "batch" && s.read == Some(Read::Decode) && s.wrapped {
            f.insert(format!("geometry/batch-decode-after-wrap/{dtype}"));
        }
        if s.t == "enter" && rotating && !s.emptied.is_empty() && s.nonempty > 0 {
            f.insert("geometry/merge-emptied-ring".into());
        }
        if s.t == "enter"
            && s.how == Some("join")
            && s.offsets.iter().any(|&o| cfg.layout.max_size().is_some_and(|w| o > w))
        {
            f.insert("geometry/join-wrapped-ring".into());
        }
        if s.t == "prefill_chunk" && rotating && s.l == 1 && s.padded {
            f.insert("geometry/padded-singleton-chunk".into());
        }
        if let Some(t) = &s.trim {
            let equal = t.n.iter().all(|&x| x == t.n[0]);
            if !equal {
                f.insert("geometry/per-row-trim".into());
            }
            if rotating && t.bypass && s.wrapped && t.kvsim.as_ref().is_ok_and(|&n| n > 0) && equal {
                f.insert(format!("geometry/{}-bypass-after-wrap", s.t));
            }
            if let Err(e) = &t.kvsim {
                f.insert(format!("geometry/{}-refused-{}", s.t, e.split([' ', '{', '(']).next().unwrap_or("")));
            }
        }
        if s.t == "prefill" && s.padded {
            f.insert(format!("geometry/right-padded-prefill/{layout}"));
        }
        let root_in_op = root.is_some_and(|(ri, _)| all[ri].op == s.op);
        if s.t == "prefill"
            && !root_in_op
            && cfg.layout.max_size().is_some_and(|w| !padding_in_window_rows(s, w).is_empty())
        {
            f.insert("geometry/prefill-padding-in-window".into());
        }
    }
    f
}

/// The first step where mlx-lm is expected to end up in another state than kvsim (a guess from kvsim's side
/// only, for the choice of seeds; the classification uses the oracle's results), and why.
pub fn predicted_root(cfg: &SimConfig, infos: &[StepInfo]) -> Option<(usize, &'static str)> {
    let w = cfg.layout.max_size();
    for (i, s) in infos.iter().enumerate() {
        if let Some(t) = &s.trim {
            let equal = t.n.iter().all(|&x| x == t.n[0]);
            let n = t.n.iter().copied().max().unwrap_or(0);
            match &t.kvsim {
                Ok(_) if !equal => return Some((i, "per-row-trim")),
                Ok(_) if n > 0 && w.is_some() && s.wrapped => return Some((i, "trim-after-wrap")),
                Err(_) if n > 0 && s.offsets.iter().all(|&o| o > 0) && !(w.is_some() && s.wrapped) => {
                    return Some((i, "trim-refused-by-kvsim"))
                }
                _ => {}
            }
        }
        if s.t == "prefill_chunk" && w.is_some() && s.l == 1 && s.padded {
            return Some((i, "padded-singleton-chunk"));
        }
        if s.t == "extract" && !s.batch_arrays {
            return Some((i, "extract-empty-batch"));
        }
    }
    None
}

/// Picks `count` seeds among `0..scan` (`include` first): a greedy cover of every [`features`] value (smaller traces first on ties),
/// then the smallest remaining traces round-robin over (dtype, layout), so that the set mixes f32/bf16 and
/// rotating/linear while staying small in bytes. Only passing seeds are chosen.
pub fn choose_seeds(count: usize, scan: u64, include: &[u64]) -> Result<Vec<u64>, String> {
    struct Cand {
        seed: u64,
        feats: BTreeSet<String>,
        size: usize,
        group: String,
    }
    let mut cands = vec![];
    for seed in 0..scan {
        let r = kvsim_harness::sim::run_seed(seed, DeviceChoice::Cpu, None);
        if r.failed() {
            continue;
        }
        let rec = match record(&r.trace, false) {
            Ok(x) => x,
            Err(_) => continue,
        };
        let cfg = &r.trace.config;
        let feats = features(cfg, &rec.infos);
        let size: usize = rec.results.iter().map(|r| r.to_json().to_string().len() + 1).sum();
        let group = feats.iter().find(|f| f.starts_with("config/")).cloned().unwrap_or_default();
        cands.push(Cand { seed, feats, size, group });
    }
    if cands.is_empty() {
        return Err(format!("no passing seed in 0..{scan}"));
    }
    let mut chosen: Vec<u64> = include.to_vec();
    let mut covered: BTreeSet<String> = BTreeSet::new();
    for c in cands.iter().filter(|c| include.contains(&c.seed)) {
        covered.extend(c.feats.iter().cloned());
    }
    loop {
        let best = cands
            .iter()
            .filter(|c| !chosen.contains(&c.seed))
            .map(|c| (c.feats.difference(&covered).count(), c))
            .filter(|(n, _)| *n > 0)
            .max_by(|(n1, c1), (n2, c2)| n1.cmp(n2).then(c2.size.cmp(&c1.size)));
        match best {
            Some((_, c)) if chosen.len() < count => {
                covered.extend(c.feats.iter().cloned());
                chosen.push(c.seed);
            }
            _ => break,
        }
    }
    let mut groups: BTreeMap<String, Vec<&Cand>> = BTreeMap::new();
    for c in cands.iter().filter(|c| !chosen.contains(&c.seed)) {
        groups.entry(c.group.clone()).or_default().push(c);
    }
    for g in groups.values_mut() {
        g.sort_by_key(|c| (c.size, c.seed));
        g.reverse();
    }
    while chosen.len() < count && groups.values().any(|g| !g.is_empty()) {
        for g in groups.values_mut() {
            if chosen.len() >= count {
                break;
            }
            if let Some(c) = g.pop() {
                chosen.push(c.seed);
            }
        }
    }
    chosen.sort();
    Ok(chosen)
}

// ------------------------------------------------------------------------------------------------------------
// recording a set
// ------------------------------------------------------------------------------------------------------------

/// The run of `seed` whose calls the oracle records for `family`: for `attention` the seed's swarm run (the
/// recorder watches its attention family); for another family of [`recorder::ORACLE_FAMILIES`] the seed's
/// configuration with that family alone (`None` when the seed's swarm draw does not hold it: its parameters, e.g.
/// the quantized family's bits and group, come from that draw), without the kinds listed below. `None` too when the
/// run fails or holds an op whose writes the recorder does not describe (a prepared prefill into running rows, a
/// bidirectional prefill).
pub fn family_run(seed: u64, family: &str) -> Option<kvsim_harness::sim::RunResult> {
    let r = if family == "attention" {
        kvsim_harness::sim::run_seed(seed, DeviceChoice::Cpu, None)
    } else {
        let mut cfg = SimConfig::from_seed(seed);
        if !cfg.families.iter().any(|f| f == family) {
            return None;
        }
        // The recurrent family is recorded in its `ssm` set only (two DeltaNet layers; the hybrid sets' attention
        // layers are not described).
        if family == "ssm" && kvsim_harness::sim::family::ssm::SsmSet::of(&cfg).name != "ssm" {
            return None;
        }
        cfg.families = vec![family.to_string()];
        // The other families' own kinds (training forwards, the bf16-first family's reads) touch none of this
        // family's caches, and the recorder does not describe the writes of a prepared prefill into running rows
        // or of a bidirectional prefill: none is drawn.
        use kvsim_harness::sim::ops::OpKind;
        if cfg.weight(OpKind::Admit) == 0 {
            // A family of the full draw supported none of the inference kinds (the training family's runs draw
            // only its forwards): this family's run takes every kind at its base weight.
            for w in cfg.weights.iter_mut() {
                w.1 = w.0.base_weight();
            }
        }
        for w in cfg.weights.iter_mut() {
            if w.0.is_training() || w.0.is_transition() || matches!(w.0, OpKind::Prepare | OpKind::BidirPrefill) {
                w.1 = 0;
            }
        }
        // The conversion op is drawn when the family's parameters say so (a family of the full draw that does not
        // support it had switched it off).
        if let (Some(q), true) = (kvsim_harness::sim::family::quant::QuantChoice::of(&cfg), family == "quant") {
            match cfg.weights.iter_mut().find(|w| w.0 == OpKind::Quantize) {
                Some(w) => w.1 = w.1.max(q.convert_weight),
                None => cfg.weights.push((OpKind::Quantize, q.convert_weight)),
            }
        }
        kvsim_harness::sim::run(seed, cfg, None, DeviceChoice::Cpu, None)
    };
    let undescribed = |op: &kvsim_harness::sim::ops::Op| {
        matches!(op, kvsim_harness::sim::ops::Op::Prepare { .. } | kvsim_harness::sim::ops::Op::BidirPrefill { .. })
    };
    (!r.failed() && (family == "attention" || !r.trace.ops.iter().any(undescribed))).then_some(r)
}

/// The file-name prefix of a family's recorded traces (`seed-N` for the attention family, `quant-seed-N`, ...).
pub fn family_prefix(family: &str) -> String {
    if family == "attention" {
        "seed-".into()
    } else {
        format!("{family}-seed-")
    }
}

/// What a quantized-family recording covers besides [`features`]: its parameters, native or converted, the
/// conversion and where each quantized rule's geometry occurs (from kvsim's side only). For a recurrent-family
/// recording (its layer calls carry row spans): right / left-padded prepares, padded calls, enter, extract, filter,
/// committed and rolled-back rounds.
pub fn quant_features(cfg: &SimConfig, infos: &[StepInfo]) -> BTreeSet<String> {
    let mut f = BTreeSet::new();
    if infos.iter().any(|s| !s.spans.is_empty()) {
        // A recurrent-family recording: what it covers (its caches are not quantized).
        for s in infos {
            let what = match s.t {
                "prepare" if s.left.iter().any(|&l| l > 0) => "ssm/prepare-left",
                "prepare" => "ssm/prepare-right",
                "enter" | "extract" | "filter" | "finalize" => s.t,
                "round" if s.keep.iter().all(|&k| k == s.l) => "ssm/round-commit",
                "round" => "ssm/round-rollback",
                "solo" | "batch" => {
                    if s.spans.iter().any(|&(a, b)| b - a != s.l) {
                        "ssm/padded-call"
                    } else {
                        "ssm/full-call"
                    }
                }
                _ => continue,
            };
            f.insert(if what.starts_with("ssm/") { what.to_string() } else { format!("ssm/{what}") });
        }
        return f;
    }
    let Some(q) = kvsim_harness::sim::family::quant::QuantChoice::of(cfg) else { return f };
    let layout = if cfg.layout.max_size().is_some() { "rotating" } else { "linear" };
    f.insert(format!("quant/bits-{}", q.bits));
    f.insert(format!("quant/group-{}", q.group));
    f.insert(format!("quant/{layout}/{}", if q.native { "native" } else { "converted" }));
    if layout == "linear" && matches!(q.bits, 5 | 6) && q.head_dim * q.bits / 32 != q.head_dim / (32 / q.bits) {
        // mlx-lm's packed-width crash: a QuantizedKVCache created quantized (native, or admitted after the conversion)
        f.insert("quant/packed-width".into());
    }
    for s in infos {
        match s.t {
            "quantize" => {
                let (b, g) = s.target.unwrap_or_default();
                let kind = if mlx_refuses_quant(b, g, s.head_dim) {
                    "invalid"
                } else if s.quant.is_some() {
                    "already"
                } else if s.batch_live {
                    "with-batch"
                } else {
                    "solo"
                };
                f.insert(format!("quant/convert-{kind}/{layout}"));
            }
            "solo" | "batch" | "prefill_chunk" if s.quant.is_some() => {
                f.insert(format!("quant/{}-read/{layout}", s.t));
            }
            "enter" | "prefill" if s.quant.is_some() => {
                f.insert(format!("quant/{}-quantized/{layout}", s.t));
            }
            _ => {}
        }
    }
    f
}

/// Seeds for a family's recorded set: among `0..scan`, the runs [`family_run`] gives, a greedy cover of
/// [`features`] and [`quant_features`] (fewer steps first on ties), then the smallest remaining ones.
pub fn choose_family_seeds(family: &str, count: usize, scan: u64) -> Result<Vec<u64>, String> {
    let mut cands: Vec<(u64, BTreeSet<String>, usize)> = vec![];
    for seed in 0..scan {
        let Some(r) = family_run(seed, family) else { continue };
        let Ok(rec) = record(&r.trace, false) else { continue };
        let mut feats = features(&r.trace.config, &rec.infos);
        feats.extend(quant_features(&r.trace.config, &rec.infos));
        cands.push((seed, feats, rec.infos.len()));
    }
    if cands.is_empty() {
        return Err(format!("no passing {family} seed in 0..{scan}"));
    }
    let mut chosen: Vec<u64> = vec![];
    let mut covered: BTreeSet<String> = BTreeSet::new();
    while chosen.len() < count {
        let best = cands
            .iter()
            .filter(|c| !chosen.contains(&c.0))
            .map(|c| (c.1.difference(&covered).count(), c))
            .filter(|(n, _)| *n > 0)
            .max_by(|(n1, c1), (n2, c2)| n1.cmp(n2).then(c2.2.cmp(&c1.2)));
        let Some((_, c)) = best else { break };
        covered.extend(c.1.iter().cloned());
        chosen.push(c.0);
    }
    let mut rest: Vec<&(u64, BTreeSet<String>, usize)> = cands.iter().filter(|c| !chosen.contains(&c.0)).collect();
    rest.sort_by_key(|c| (c.2, c.0));
    chosen.extend(rest.iter().take(count.saturating_sub(chosen.len())).map(|c| c.0));
    chosen.sort();
    Ok(chosen)
}

/// `kvsim oracle record`: records `seeds` (or, when empty, a fresh choice of `count` seeds among `0..scan` that
/// replaces the recorded set in `out`): kvsim's side, the mlx-lm driver's results, and the diff of each. Every
/// line to show goes to `log` (`true` = an error line). Returns whether every seed was recorded.
#[allow(clippy::too_many_arguments)]
pub fn record_set(
    family: &str,
    count: usize,
    scan: u64,
    seeds: &[u64],
    include: &[u64],
    out: &Path,
    keep_steps: bool,
    log: &mut dyn FnMut(bool, String),
) -> Result<bool, String> {
    if !recorder::ORACLE_FAMILIES.contains(&family) {
        return Err(format!("the oracle maps the families {:?}, not {family:?}", recorder::ORACLE_FAMILIES));
    }
    let python = setup_driver()?;
    let explicit = !seeds.is_empty();
    let seeds: Vec<u64> = match (explicit, family) {
        (true, _) => seeds.to_vec(),
        (false, "attention") => choose_seeds(count, scan, include)?,
        (false, _) => choose_family_seeds(family, count, scan)?,
    };
    let prefix = family_prefix(family);
    std::fs::create_dir_all(out).map_err(|e| format!("{}: {e}", out.display()))?;
    if !explicit {
        // A fresh choice replaces the family's recorded traces.
        for p in recorded_traces(out).unwrap_or_default() {
            let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("").trim_end_matches(".trace.json").to_string();
            if name.strip_prefix(&prefix).is_none_or(|n| n.parse::<u64>().is_err()) {
                continue;
            }
            let _ = std::fs::remove_file(&p);
            let _ = std::fs::remove_file(out.join(format!("{name}.oracle.jsonl")));
        }
    }
    let work = std::env::temp_dir().join(format!("kvsim-oracle-{}", std::process::id()));
    let mut all = true;
    for seed in seeds {
        let name = format!("{prefix}{seed}");
        match record_one(family, seed, &name, &python, &work, out, keep_steps) {
            Ok(line) => log(false, line),
            Err(e) => {
                log(true, format!("{name}: {e}"));
                all = false;
            }
        }
    }
    let _ = std::fs::remove_dir_all(&work);
    if let Ok(report) = check_dir(out) {
        log(
            false,
            format!(
                "recorded set {}: {} traces, {} agree, {} classified, {} unclassified",
                out.display(),
                report.traces.len(),
                report.count("agree"),
                report.count("classified"),
                report.count("unclassified")
            ),
        );
    }
    Ok(all)
}

/// `kvsim oracle redrive`: re-runs the driver over the traces recorded in `dir` whose name starts with `prefix`
/// (the traces are kept; each `NAME.oracle.jsonl` is rewritten). Whether every trace went through.
pub fn redrive_set(
    dir: &Path,
    prefix: &str,
    keep_steps: Option<&Path>,
    log: &mut dyn FnMut(bool, String),
) -> Result<bool, String> {
    let python = setup_driver()?;
    let work = std::env::temp_dir().join(format!("kvsim-oracle-{}", std::process::id()));
    let mut all = true;
    for tp in recorded_traces(dir)? {
        let name = tp.file_name().and_then(|n| n.to_str()).unwrap_or("").trim_end_matches(".trace.json").to_string();
        if !name.starts_with(prefix) {
            continue;
        }
        let one = || -> Result<String, String> {
            let trace = Trace::load(&tp).map_err(|e| e.to_string())?;
            let rec = record(&trace, true)?;
            let (_, text) = run_driver(&python, &rec.steps_jsonl(), &work, &name)?;
            if let Some(k) = keep_steps {
                let _ = std::fs::create_dir_all(k);
                let _ = std::fs::write(k.join(format!("{name}.steps.jsonl")), rec.steps_jsonl());
            }
            std::fs::write(dir.join(format!("{name}.oracle.jsonl")), strip_known_values(&text, &rec.values))
                .map_err(|e| e.to_string())?;
            Ok(diff_recorded(&tp).summary_line())
        };
        match one() {
            Ok(line) => log(false, line),
            Err(e) => {
                log(true, format!("{name}: {e}"));
                all = false;
            }
        }
    }
    let _ = std::fs::remove_dir_all(&work);
    let report = check_dir(dir)?;
    log(false, report.json_line());
    Ok(all)
}

/// Records one seed into `out`; the diff's summary line.
fn record_one(
    family: &str,
    seed: u64,
    name: &str,
    python: &Path,
    work: &Path,
    out: &Path,
    keep_steps: bool,
) -> Result<String, String> {
    let r = family_run(seed, family).ok_or_else(|| {
        format!("no {family} run of seed {seed} to record (not in its swarm draw, failing, or undescribed ops)")
    })?;
    let mut trace = r.trace;
    trace.note = "oracle: recorded against mlx-lm 0.32.2 (kvsim oracle record)".into();
    let rec = record(&trace, true)?;
    let (_, text) = run_driver(python, &rec.steps_jsonl(), work, name)?;
    if keep_steps {
        let _ = std::fs::write(out.join(format!("{name}.steps.jsonl")), rec.steps_jsonl());
    }
    let tp = out.join(format!("{name}.trace.json"));
    let op = out.join(format!("{name}.oracle.jsonl"));
    std::fs::write(&tp, serde_json::to_string(&trace).unwrap() + "\n")
        .and_then(|_| std::fs::write(&op, strip_known_values(&text, &rec.values)))
        .map_err(|e| e.to_string())?;
    Ok(diff_recorded(&tp).summary_line())
}

/// `kvsim oracle record --dry-run`: the chosen seeds, each with the geometry and config features it covers.
pub fn describe_choice(
    family: &str,
    count: usize,
    scan: u64,
    include: &[u64],
) -> Result<Vec<(u64, Vec<String>)>, String> {
    let seeds = if family == "attention" {
        choose_seeds(count, scan, include)?
    } else {
        choose_family_seeds(family, count, scan)?
    };
    Ok(seeds
        .into_iter()
        .map(|s| {
            let feats = family_run(s, family)
                .and_then(|r| {
                    record(&r.trace, false).ok().map(|rec| {
                        let mut f = features(&r.trace.config, &rec.infos);
                        f.extend(quant_features(&r.trace.config, &rec.infos));
                        f
                    })
                })
                .unwrap_or_default();
            let shown = |f: &String| {
                f.starts_with("geometry/")
                    || f.starts_with("config/")
                    || f.starts_with("quant/")
                    || f.starts_with("ssm/")
            };
            (s, feats.into_iter().filter(shown).collect())
        })
        .collect())
}

// ------------------------------------------------------------------------------------------------------------
// report lines (`kvsim oracle diff` / `check` print them)
// ------------------------------------------------------------------------------------------------------------

impl TraceReport {
    /// One line pair per divergence: step, op, what, class, detail.
    pub fn divergence_lines(&self) -> Vec<String> {
        self.divergences
            .iter()
            .map(|d| {
                format!(
                    "  step {:>5}  op {:>3} {:<13} {:<34} {}\n             {}",
                    d.step,
                    d.op,
                    d.op_kind,
                    d.what,
                    d.class.describe(),
                    match d.ulp {
                        Some(u) => format!("{} (max {u} ULP at output scale)", d.detail),
                        None => d.detail.clone(),
                    }
                )
            })
            .collect()
    }

    /// `kvsim oracle diff`'s report.
    pub fn diff_lines(&self) -> Vec<String> {
        let mut lines = vec![format!("{}: {} steps, {} divergences", self.name, self.steps, self.divergences.len())];
        lines.extend(self.divergence_lines());
        for (r, n) in self.rules() {
            lines.push(format!("  {} x{n} [{}]: {}", r.id(), r.verdict().name(), r.reason()));
        }
        lines.push(self.summary_line());
        lines
    }
}

impl CheckReport {
    /// `kvsim oracle check`'s report: each trace (with its divergences when unclassified), the rules, the step kinds
    /// covered and the totals.
    pub fn lines(&self) -> Vec<String> {
        let mut lines = vec![];
        for t in &self.traces {
            lines.push(t.summary_line());
            if t.status() == "unclassified" {
                lines.extend(t.divergence_lines());
            }
        }
        lines.push("rules:".into());
        for (r, (n, c, traces)) in self.rule_counts() {
            let names: Vec<&str> = traces.iter().take(6).map(|s| s.as_str()).collect();
            lines.push(format!(
                "  {:<32} {:<26} {:>4} divergences, {:>4} consequences, {:>3} traces (e.g. {})",
                r.id(),
                r.verdict().name(),
                n,
                c,
                traces.len(),
                names.join(", ")
            ));
        }
        let steps: usize = self.traces.iter().map(|t| t.steps).sum();
        let compared: usize = self.traces.iter().map(|t| t.steps_compared).sum();
        lines.push(format!(
            "steps compared on their own: {compared} of {steps}; the others, by the rule of their root:"
        ));
        let mut by_rule: Vec<(Option<Rule>, usize)> = self.uncompared().into_iter().collect();
        by_rule.sort_by_key(|&(r, n)| (std::cmp::Reverse(n), r));
        for (r, n) in by_rule {
            lines.push(format!("  {:<32} {n:>5} steps", r.map_or("(unclassified root)", |r| r.id())));
        }
        let kinds = self.kinds();
        let missing: Vec<&str> = STEP_KINDS.iter().copied().filter(|k| !kinds.contains(*k)).collect();
        lines.push(format!(
            "step kinds covered: {}/{}{}",
            STEP_KINDS.len() - missing.len(),
            STEP_KINDS.len(),
            if missing.is_empty() { String::new() } else { format!(" (missing: {})", missing.join(", ")) }
        ));
        lines.push(format!(
            "kvsim oracle check: {} traces, {} agree, {} classified, {} unclassified",
            self.traces.len(),
            self.count("agree"),
            self.count("classified"),
            self.count("unclassified")
        ));
        lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recorder::TrimInfo;

    fn info(t: &'static str, reqs: &[u32]) -> StepInfo {
        StepInfo { t, reqs: reqs.to_vec(), ..Default::default() }
    }

    fn rec(step: usize, outcome: Outcome) -> Record {
        Record { step, outcome }
    }

    fn rows(h: &str) -> Outcome {
        Outcome::Rows(vec![h.to_string()])
    }

    /// Every rule names its layouts; a rule never classifies on a layout it does not name.
    #[test]
    fn rules_name_their_layouts() {
        for r in Rule::ALL {
            assert!(!r.layouts().is_empty(), "{} names no layout", r.id());
        }
        assert!(!Rule::OnePositionWindow.layouts().contains(&"linear"), "linear caches never wrap");
        assert!(!Rule::RowLayout.layouts().contains(&"ssm"));
        let quantize = StepInfo { t: "quantize", ..Default::default() };
        assert_eq!(layout_of(Some(&quantize), Some(4), false), "quant-ring");
        assert_eq!(layout_of(None, None, false), "linear");
        assert_eq!(layout_of(None, Some(4), true), "ssm");
    }

    /// `vals` must hash to their row's sha256: a file whose bytes were changed is refused, never measured; `solo`
    /// is read per step; the stored file keeps mlx-lm's bytes only where kvsim has none of the same hash.
    #[test]
    fn values_are_checked_against_their_hashes() {
        use base64::Engine;
        let bytes = vec![0u8, 0, 128, 63];
        let h = recorder::sha_hex(&bytes);
        let b64 = base64::engine::general_purpose::STANDARD.encode(&bytes);
        let good = format!("{{\"step\":3,\"rows\":[\"{h}\"],\"vals\":[\"{b64}\"],\"solo\":[\"{h}\"]}}\n");
        assert_eq!(parse_values(&good).unwrap().get(&h), Some(&bytes));
        assert_eq!(parse_solo(&good).unwrap()[&3], vec![Some(h.clone())]);
        let bad = good.replace(&b64, &base64::engine::general_purpose::STANDARD.encode([0u8, 0, 128, 191]));
        assert!(parse_values(&bad).unwrap_err().contains("do not hash"));
        assert!(parse_values("{\"step\":1,\"rows\":[\"a\"],\"vals\":[\"a\",\"b\"]}").is_err());
        let mut known = Values::new();
        assert!(strip_known_values(&good, &known).contains("vals"));
        known.insert(h.clone(), bytes.clone());
        assert!(!strip_known_values(&good, &known).contains("vals"));
        // Measured: one f32 element 1.0 vs 1.0 + 2 ULP.
        let other = vec![2u8, 0, 128, 63];
        let h2 = recorder::sha_hex(&other);
        let oracle: Values = [(h2.clone(), other)].into_iter().collect();
        let solo = BTreeMap::new();
        let m = Measure { dtype: mlx_rs::Dtype::Float32, kvsim: &known, oracle: &oracle, solo: &solo };
        assert_eq!(m.ulp(&h, &h2), Some(2));
        assert_eq!(m.ulp(&h, "unknown"), None);
    }

    /// A bug-18 rollback of the running batch (step 5), the batch filtered away (step 8) with `filter_outcome` as
    /// the driver's answer, then a new batch (steps 9-11). Returns the diff's divergences, compared count and
    /// uncompared steps per rule.
    fn batch_root_then_new_batch(
        filter_outcome: Option<Outcome>,
    ) -> (Vec<Divergence>, usize, BTreeMap<Option<Rule>, usize>) {
        let trim = TrimInfo { n: vec![1], bypass: true, kvsim: Ok(1), after_window: true, live: vec![5] };
        let mut trim_step = info("trim_rows", &[1]);
        trim_step.trim = Some(trim);
        trim_step.wrapped = true;
        let mut decode = info("batch", &[1]);
        decode.read = Some(Read::Decode);
        decode.l = 1;
        let mut filter = info("filter", &[1]);
        filter.keep = vec![];
        filter.rows_left = 0;
        let mut decode3 = decode.clone();
        decode3.reqs = vec![3];
        let infos = vec![
            info("config", &[]),
            info("admit", &[1]),
            info("admit", &[2]),
            info("enter", &[1]),
            decode.clone(),
            trim_step,
            decode,
            {
                let mut s = info("solo", &[2]);
                s.read = Some(Read::Decode);
                s.l = 1;
                s
            },
            filter,
            info("admit", &[3]),
            info("enter", &[3]),
            decode3,
        ];
        let kvsim = vec![
            rec(4, rows("a")),
            rec(5, Outcome::Trimmed(1)),
            rec(6, rows("b")),
            rec(7, rows("c")),
            rec(11, rows("d")),
        ];
        let mut oracle = vec![
            rec(4, rows("a")),
            rec(5, Outcome::Trimmed(0)),
            rec(6, rows("B")),
            rec(7, rows("c")),
            rec(11, rows("d")),
        ];
        if let Some(o) = filter_outcome {
            oracle.push(rec(8, o));
        }
        diff_measured(&infos, &kvsim, &oracle, Some(4))
    }

    /// A quantized batch of requests 1 and 2 mapped row by row (PROTOCOL.md decision 16): `step` at index 4, then a
    /// batch decode where request 1's row differs and request 2's agrees.
    fn rows_mapped_then_decode(
        step: StepInfo,
        k: Outcome,
        o: Outcome,
    ) -> (Vec<Divergence>, usize, BTreeMap<Option<Rule>, usize>) {
        let q = |mut s: StepInfo| {
            s.quant = Some((6, 64));
            s.head_dim = 128;
            s
        };
        let mut decode = q(info("batch", &[1, 2]));
        decode.read = Some(Read::Decode);
        decode.l = 1;
        decode.offsets = vec![6, 3];
        let infos = vec![
            q(info("config", &[])),
            q(info("admit", &[1])),
            q(info("admit", &[2])),
            q(info("enter", &[1, 2])),
            q(step),
            decode,
        ];
        let two = |a: &str, b: &str| Outcome::Rows(vec![a.to_string(), b.to_string()]);
        let kvsim = vec![rec(4, k), rec(5, two("a", "b"))];
        let oracle = vec![rec(4, o), rec(5, two("A", "b"))];
        diff_measured(&infos, &kvsim, &oracle, Some(4))
    }

    #[test]
    fn a_row_mapped_trim_explains_only_its_differing_rows() {
        let mut trim = info("trim_rows", &[1, 2]);
        trim.trim = Some(TrimInfo { n: vec![1, 1], bypass: true, kvsim: Ok(1), after_window: true, live: vec![4, 3] });
        trim.offsets = vec![5, 3];
        let (out, compared, uncompared) =
            rows_mapped_then_decode(trim, Outcome::TrimmedRows(vec![1, 1]), Outcome::TrimmedRows(vec![0, 1]));
        assert_eq!(out.len(), 1, "{out:?}");
        assert_eq!(out[0].class, Class::Rule(Rule::TrimNoopAfterWrap));
        // The decode is compared on request 2's row alone (request 1's row is explained).
        assert_eq!(compared, 5);
        assert!(uncompared.is_empty(), "{uncompared:?}");
        // A row that mlx-lm trimmed as kvsim did, while another was refused before the window: not bug catalog #18.
        let mut trim = info("trim_rows", &[1, 2]);
        trim.trim = Some(TrimInfo { n: vec![1, 1], bypass: true, kvsim: Ok(1), after_window: true, live: vec![3, 3] });
        trim.offsets = vec![3, 3];
        let (out, _, _) =
            rows_mapped_then_decode(trim, Outcome::TrimmedRows(vec![1, 1]), Outcome::TrimmedRows(vec![0, 1]));
        assert_eq!(out[0].class, Class::Unclassified);
    }

    #[test]
    fn a_row_mapped_crash_explains_only_its_row() {
        let mut read = info("batch", &[1, 2]);
        read.read = Some(Read::Window);
        read.l = 2;
        read.offsets = vec![0, 0];
        let crash = "error: ValueError: [broadcast_shapes] Shapes (1,2,2,24) and (1,2,2,25) cannot be broadcast.";
        let k = Outcome::Rows(vec!["a".into(), "b".into()]);
        let (out, compared, _) =
            rows_mapped_then_decode(read.clone(), k.clone(), Outcome::Rows(vec![crash.into(), "b".into()]));
        assert_eq!(out.len(), 1, "{out:?}");
        assert_eq!(out[0].class, Class::Rule(Rule::QuantPackedWidth));
        assert_eq!(compared, 5);
        // The other row differing too: not the packed-width crash alone.
        let (out, _, _) = rows_mapped_then_decode(read, k, Outcome::Rows(vec![crash.into(), "B".into()]));
        assert_eq!(out[0].class, Class::Unclassified);
    }

    #[test]
    fn a_batch_root_ends_when_the_batch_is_gone() {
        let (out, compared, uncompared) = batch_root_then_new_batch(None);
        assert_eq!(out[0].class, Class::Rule(Rule::TrimNoopAfterWrap));
        assert!(matches!(out[1].class, Class::Consequence { root: 5, .. }));
        // Steps 6 (the batch's read) and 8 (its filter) are explained; the solo request and the new batch are not.
        assert_eq!(uncompared, BTreeMap::from([(Some(Rule::TrimNoopAfterWrap), 2)]));
        assert_eq!(compared, 11 - 2);
    }

    #[test]
    fn a_batch_root_stays_when_the_driver_may_hold_other_rows() {
        // The filter failed inside mlx-lm: the driver's rows are unknown, the new batch stays explained.
        let (_, compared, uncompared) = batch_root_then_new_batch(Some(Outcome::Error("ValueError: boom".into())));
        assert_eq!(uncompared, BTreeMap::from([(Some(Rule::TrimNoopAfterWrap), 4)]));
        assert_eq!(compared, 11 - 4);
        // A DriverError is raised before the driver changes anything: the driver still holds the request (its
        // batch was not filtered), so the batch's scope stays too.
        let (_, _, uncompared) =
            batch_root_then_new_batch(Some(Outcome::Error("DriverError: no running batch".into())));
        assert_eq!(uncompared, BTreeMap::from([(Some(Rule::TrimNoopAfterWrap), 4)]));
    }

    #[test]
    fn a_request_that_joined_an_explained_batch_is_compared_again_once_the_taint_has_left() {
        let trim = TrimInfo { n: vec![1], bypass: true, kvsim: Ok(1), after_window: true, live: vec![5] };
        let mut trim_step = info("trim_rows", &[1]);
        trim_step.trim = Some(trim);
        trim_step.wrapped = true;
        let decode = |reqs: &[u32]| {
            let mut d = info("batch", reqs);
            d.read = Some(Read::Decode);
            d.l = 1;
            d
        };
        let mut extract = info("extract", &[1]);
        (extract.row, extract.finish, extract.rows_left) = (Some(0), true, 1);
        let infos = vec![
            info("config", &[]),
            info("admit", &[1]),
            info("enter", &[1]),
            trim_step,
            info("admit", &[3]),
            info("enter", &[3]),
            decode(&[1, 3]),
            extract,
            decode(&[3]),
        ];
        let kvsim = vec![rec(3, Outcome::Trimmed(1)), rec(6, rows("a")), rec(8, rows("b"))];
        let oracle = vec![rec(3, Outcome::Trimmed(0)), rec(6, rows("A")), rec(8, rows("b"))];
        let (out, compared, uncompared) = diff_measured(&infos, &kvsim, &oracle, Some(4));
        assert_eq!(out.len(), 2, "{out:?}");
        // Explained: the join of request 3 into the explained batch, the batch read and the extract of request 1;
        // the read of request 3 alone after that is compared.
        assert_eq!(uncompared, BTreeMap::from([(Some(Rule::TrimNoopAfterWrap), 3)]));
        assert_eq!(compared, 8 - 3);
    }

    #[test]
    fn a_replayed_rollback_explains_nothing() {
        let trim = TrimInfo { n: vec![2], bypass: true, kvsim: Ok(2), after_window: true, live: vec![5] };
        let mut t = info("solo_trim", &[1]);
        t.trim = Some(trim);
        t.wrapped = true;
        let mut read = info("solo", &[1]);
        read.read = Some(Read::Decode);
        read.l = 1;
        let infos = vec![info("config", &[]), info("admit", &[1]), t, read];
        let kvsim = vec![rec(2, Outcome::Trimmed(2)), rec(3, rows("a"))];
        for (replayed, explained) in [(2, 0), (1, 1)] {
            let oracle = vec![rec(2, Outcome::Resynced { trimmed: 0, replayed }), rec(3, rows("b"))];
            let (out, _, uncompared) = diff_measured(&infos, &kvsim, &oracle, Some(4));
            assert_eq!(uncompared.values().sum::<usize>(), explained, "replayed {replayed}: {out:?}");
            if replayed == 2 {
                // Bug catalog #18 stays visible; the read after it is compared (and here unclassified: it differs).
                assert_eq!(out[0].class, Class::Rule(Rule::TrimNoopAfterWrap));
                assert_eq!(out[1].class, Class::Unclassified);
            }
        }
    }

    #[test]
    fn short_or_odd_hashes_in_results_do_not_panic() {
        let (a, b) = (rows("é"), Outcome::Rows(vec!["ü".repeat(20)]));
        assert!(detail(Some(&a), Some(&b)).contains("row 0"));
        assert!(show(Some(&b)).starts_with("rows [üüüüüüüü]"));
    }

    #[test]
    fn resync_records_parse_without_panics() {
        let r = Record::parse(r#"{"step":3,"trimmed":0,"resynced":2}"#).unwrap();
        assert_eq!(r.outcome, Outcome::Resynced { trimmed: 0, replayed: 2 });
        assert_eq!(Record::parse(&r.to_json().to_string()).unwrap(), r);
        let r = Record::parse(r#"{"step":4,"trimmed_rows":[0,2,1]}"#).unwrap();
        assert_eq!(r.outcome, Outcome::TrimmedRows(vec![0, 2, 1]));
        for bad in [
            r#"{"step":4,"trimmed_rows":[0,-2]}"#,
            r#"{"step":4,"trimmed_rows":"x"}"#,
            r#"{"step":4,"trimmed":0,"resynced":"x"}"#,
        ] {
            assert!(Record::parse(bad).is_err(), "{bad}");
        }
    }
}
