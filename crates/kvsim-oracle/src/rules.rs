//! The classification rules: what a divergence is ([`Verdict`], [`Rule`] with its layouts, size and citation,
//! [`Class`]), the predicates that classify a read, a checkpoint or a state-changing step (the quantized family's
//! row-mapped steps, PROTOCOL.md decision 16, among them), and the bounded scope of a root: which requests and
//! whether the running batch a state-changing divergence explains.

use std::collections::{BTreeMap, BTreeSet};

use crate::recorder::{Outcome, StepInfo};
use kvsim_harness::sim::observe::Read;

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

/// The rule for a read whose outputs differ in rows `rows` (to be confirmed by the next checkpoint agreeing).
pub(crate) fn read_rule(info: &StepInfo, layout_r3: &BTreeMap<u32, usize>, rows: &[usize]) -> Option<Rule> {
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

/// The rule for a checkpoint that differs with no state-changing step identified before it.
pub(crate) fn checkpoint_rule(
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
pub(crate) fn state_rule(info: &StepInfo, k: Option<&Outcome>, o: Option<&Outcome>, rotating: bool) -> Option<Rule> {
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
pub(crate) fn rows_mapped(info: &StepInfo) -> bool {
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
pub(crate) fn quant_rows_layouts(
    info: &StepInfo,
    window: Option<usize>,
    step: usize,
    layout_r3: &mut BTreeMap<u32, usize>,
) {
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
pub(crate) fn quant_rows_read_rule(
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
pub(crate) fn rows_outside(info: &StepInfo, explained: &BTreeMap<u32, (usize, Option<Rule>)>) -> StepInfo {
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
pub(crate) fn failed_rows(o: Option<&Outcome>) -> Vec<usize> {
    match o {
        Some(Outcome::Rows(rows)) => (0..rows.len()).filter(|&r| rows[r].starts_with("error:")).collect(),
        _ => vec![],
    }
}

/// The rule of a row-mapped read whose rows `failed` raised in mlx-lm while the other rows agree:
/// `quant-packed-width` when every failure is that crash (5 or 6 bits where `D * bits / 32 != D // (32 // bits)`,
/// `[broadcast_shapes]`: a row whose `QuantizedKVCache` was created quantized, as for a solo write).
pub(crate) fn quant_rows_failed_rule(
    info: &StepInfo,
    k: Option<&Outcome>,
    o: Option<&Outcome>,
    failed: &[usize],
) -> Option<Rule> {
    let (Some(Outcome::Rows(a)), Some(Outcome::Rows(b))) = (k, o) else { return None };
    let others_agree = a.len() == b.len() && (0..a.len()).all(|r| failed.contains(&r) || a[r] == b[r]);
    let (bits, _) = info.quant?;
    let d = info.head_dim;
    let wrong_width = matches!(bits, 5 | 6) && d * bits / 32 != d / (32 / bits);
    let crash = failed.iter().all(|&r| b[r].contains("broadcast_shapes"));
    (others_agree && wrong_width && crash).then_some(Rule::QuantPackedWidth)
}

/// Each row's trim count in a trim record (`None` for other records).
pub(crate) fn trim_counts(o: Option<&Outcome>, rows: usize) -> Option<Vec<i64>> {
    match o {
        Some(Outcome::Trimmed(n)) => Some(vec![*n; rows]),
        Some(Outcome::Resynced { replayed, .. }) => Some(vec![*replayed; rows]),
        Some(Outcome::TrimmedRows(ns)) if ns.len() == rows => Some(ns.iter().map(|&x| x as i64).collect()),
        _ => None,
    }
}

/// The rows where a row-mapped trim (decision 16) differs: each row is its own solo cache, so a trim that differs
/// in some rows explains their requests only.
pub(crate) fn quant_rows_trim_differs(info: &StepInfo, k: Option<&Outcome>, o: Option<&Outcome>) -> Option<Vec<usize>> {
    let n = info.reqs.len();
    let (kn, on) = (trim_counts(k, n)?, trim_counts(o, n)?);
    Some((0..n).filter(|&r| kn[r] != on[r]).collect())
}

/// The state rule of a row-mapped trim (decision 16) whose rows' counts differ: bug #18 when every differing row
/// is a bypass rollback that kvsim performed and mlx-lm's `trim_prompt_cache` refused on that row's ring, which
/// has reached the window (`offset >= W`, where `is_trimmable()` is False); the refused-trim rules when kvsim
/// refused in every row (its typed error) and mlx-lm trimmed.
pub(crate) fn quant_rows_trim_rule(
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
    ![2, 3, 4, 5, 6, 8].contains(&bits) || ![32, 64, 128].contains(&group) || !head_dim.is_multiple_of(group)
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
pub(crate) enum Scope {
    All,
    Some { reqs: Vec<u32>, batch: bool },
}

/// What the driver appends to an error it re-synced after (`oracles/PROTOCOL.md` decision 14): mlx-lm's state was
/// rebuilt by mlx-lm from its own state and the step's inputs, so the comparison goes on.
pub const RESYNCED: &str = "[driver re-synced:";

pub(crate) fn root_scope(info: &StepInfo, rule: Option<Rule>, k: Option<&Outcome>, o: Option<&Outcome>) -> Scope {
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
pub(crate) fn is_batch_step(t: &str) -> bool {
    matches!(
        t,
        "enter" | "prefill" | "prefill_chunk" | "prefill_end" | "batch" | "trim" | "trim_rows" | "extract" | "filter"
    )
}
