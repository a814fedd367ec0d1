//! Counters of one run, per family and in total (the campaign's summary of many runs is `crate::campaign`).

use std::collections::BTreeMap;

use mlx_rs::Dtype;
use serde::{Deserialize, Serialize};

/// Comparisons of one output class against the solo twin.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ClassCount {
    /// Rows compared.
    pub compared: u64,
    /// Rows whose every output value was byte-identical to the twin's.
    pub bit_exact: u64,
    /// Largest ULP distance to the twin among the others.
    pub max_ulp: u64,
}

impl ClassCount {
    fn add(&mut self, o: &ClassCount) {
        self.compared += o.compared;
        self.bit_exact += o.bit_exact;
        self.max_ulp = self.max_ulp.max(o.max_ulp);
    }
}

/// What the recurrent family (`sim::family::ssm`) counted: speculative rounds and their replays, padded prefills,
/// and the largest distances to the f64 model (ULPs of the input dtype at output scale).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Recurrent {
    /// Verify rounds (`spec_round_begin` ... commit or rollback).
    pub rounds: u64,
    /// Rounds every row accepted in full (`spec_round_commit`).
    pub commits: u64,
    /// Rounds rolled back (`spec_round_rollback_rows`).
    pub rollbacks: u64,
    /// Rollbacks whose rows accepted different counts.
    pub rollbacks_unequal: u64,
    /// Rollbacks that replayed at least one position (production's own count).
    pub replays: u64,
    /// Recurrence steps replayed, summed over rows.
    pub replayed_steps: u64,
    /// Rolled-back rows whose state was compared byte for byte with a fresh run of the accepted prefix.
    pub replay_vs_fresh: u64,
    /// Prepared (padded) prefills, and those with left padding.
    pub padded_prefills: u64,
    pub left_padded_prefills: u64,
    pub model_max_ulp_output: f64,
    pub model_max_ulp_state: f64,
}

impl Recurrent {
    pub fn is_zero(&self) -> bool {
        *self == Recurrent::default()
    }

    pub fn add(&mut self, o: &Recurrent) {
        self.rounds += o.rounds;
        self.commits += o.commits;
        self.rollbacks += o.rollbacks;
        self.rollbacks_unequal += o.rollbacks_unequal;
        self.replays += o.replays;
        self.replayed_steps += o.replayed_steps;
        self.replay_vs_fresh += o.replay_vs_fresh;
        self.padded_prefills += o.padded_prefills;
        self.left_padded_prefills += o.left_padded_prefills;
        self.model_max_ulp_output = self.model_max_ulp_output.max(o.model_max_ulp_output);
        self.model_max_ulp_state = self.model_max_ulp_state.max(o.model_max_ulp_state);
    }
}

/// What the paged family (`sim::family::paged`) counted: sharing, copies, pressure, and the comparisons only it
/// makes (a warm request against the same request run cold, a store with a permuted free list against the default
/// one, the pool's accounting against the model).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PagedCounts {
    /// Prefills that took a cached prefix from the index.
    pub prefix_hits: u64,
    /// Blocks those hits shared.
    pub shared_blocks: u64,
    /// Shared, partly filled blocks copied before a write into them.
    pub cow_copies: u64,
    /// Blocks the index gave up (its budget, pressure, or the evict op).
    pub evictions: u64,
    /// Writes refused with the typed `PoolExhausted`, nothing changed.
    pub pool_exhausted: u64,
    /// Sequences forked for parallel sampling.
    pub forks: u64,
    /// Reads and states of warm (prefix-hit) requests compared byte for byte with their cold twin.
    pub warm_vs_cold: u64,
    /// Reads and states compared byte for byte with the store whose free list is permuted.
    pub placement_compared: u64,
    /// Pool accountings (tables, counts, free list, index) compared with the model.
    pub pool_checks: u64,
    /// Chunks of right-padded prefills delivered to the running batch (each row's real positions only).
    #[serde(default)]
    pub prefill_chunks: u64,
    /// Live requests' stored planes checked in affine (quantized) pools, against the twin and the reference
    /// quantizer's triples.
    #[serde(default)]
    pub affine_states: u64,
}

impl PagedCounts {
    pub fn is_zero(&self) -> bool {
        *self == PagedCounts::default()
    }

    pub fn add(&mut self, o: &PagedCounts) {
        self.prefix_hits += o.prefix_hits;
        self.shared_blocks += o.shared_blocks;
        self.cow_copies += o.cow_copies;
        self.evictions += o.evictions;
        self.pool_exhausted += o.pool_exhausted;
        self.forks += o.forks;
        self.warm_vs_cold += o.warm_vs_cold;
        self.placement_compared += o.placement_compared;
        self.pool_checks += o.pool_checks;
        self.prefill_chunks += o.prefill_chunks;
        self.affine_states += o.affine_states;
    }
}

/// Output classes of the guarantees table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutClass {
    /// A decode read of a row whose columns span the whole read (no masked column).
    DecodeUnpadded,
    /// A decode read of a row read under a mask (other rows are longer).
    DecodePadded,
    /// A window read (causal within the window).
    Window,
}

/// Policy for outputs that are not promised bit-exact. Set per device by the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Guarantees {
    /// Unpadded decode outputs must be byte-identical to the twin's (CPU: yes; CUDA: measured only).
    pub exact_unpadded_decode: bool,
    /// Reads run on a GPU, whose kernels (MLX's, and kvsim's exact ones) round differently from the CPU's: the
    /// distances to the f64 model get the loose bounds (`check::model_bound`), also in exact mode.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub gpu: bool,
}

/// Everything counted during a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Counters {
    pub checks: u64,
    pub expected_errors: u64,
    /// Rows persisted mid-run and restored before they continued (kvsim's format or an mlx-lm prompt-cache file;
    /// `src/persist`), then checked against their solo twins like every other state.
    pub persist_roundtrips: u64,
    /// Running batches persisted mid-run (every layer, kvsim's format) and restored before they continued, each row
    /// then checked against its twin (one per `persist` op that found rows running: attention, quant, ssm families).
    #[serde(default)]
    pub persist_batches: u64,
    /// bf16-first rows: right-padded prefills (`prepare` .. `finalize`) of a cohort (one per op, all layers).
    #[serde(default)]
    pub prepared_prefills: u64,
    /// bf16-first rows: prefills (chunked or prepared) that some request ended without committing a chunk of its
    /// own, so that the prefill's end (`end_prefill`, `finalize`) committed it (one per op, all layers).
    #[serde(default)]
    pub prefills_ended_uncommitted: u64,
    /// Damaged copies of saved kvsim files (a header bit, a tensor bit, a truncation) refused with a typed error.
    #[serde(default)]
    pub damaged_files_refused: u64,
    /// Model cache sets of differing layers (`sim::family::layer_set`: a wrapped sliding layer, a full or trimmed
    /// one, a list of children trimmed apart) saved and restored layer by layer, one per persist op that built one.
    #[serde(default)]
    pub layer_sets: u64,
    /// Saved kvsim files made to lie under valid checksums (a layer holding another layer's bookkeeping) and
    /// refused with a typed error.
    #[serde(default)]
    pub lying_files_refused: u64,
    /// bf16-first families: caches that converted to affine storage, one per row or lego **and per layer** (every
    /// one checked against the model's boundary; production caches only, twins not counted); those converted at a
    /// prefill chunk's commit; speculative rounds with unequal per-row accepts (one per round); rollbacks of rows
    /// (or legos) whose ring had wrapped (one per round); prefix reuses that took a stored entry; trims that took a
    /// converted lego below `start` (one per lego and layer; its storage stays affine).
    #[serde(default)]
    pub conversions: u64,
    #[serde(default)]
    pub prefill_conversions: u64,
    #[serde(default)]
    pub rounds: u64,
    #[serde(default)]
    pub rollbacks_across_wrap: u64,
    #[serde(default)]
    pub reuses: u64,
    #[serde(default)]
    pub trims_below_start: u64,
    /// Forwards whose mask memo was checked (`check::mask_memo`, `check::masks_shared_by_layers`: R-C-3).
    #[serde(default)]
    pub mask_memo: u64,
    /// State comparisons (physical and temporal bytes vs twin and model) that were byte-identical.
    pub bit_exact_state: u64,
    pub decode_unpadded: ClassCount,
    pub decode_padded: ClassCount,
    pub window: ClassCount,
    /// Largest scaled-ULP error against the f64 model, per dtype.
    pub model_max_ulp_f32: f64,
    pub model_max_ulp_bf16: f64,
    pub model_checks: u64,
    pub guarantees: Guarantees,
    /// The guarantees table: `class/dtype` -> comparisons with the solo twin (see README "Guarantees").
    pub table: BTreeMap<String, ClassCount>,
    /// The recurrent family's rounds, replays and model distances (zero in runs without it).
    #[serde(default, skip_serializing_if = "Recurrent::is_zero")]
    pub recurrent: Recurrent,
    /// The paged family's sharing, pressure and comparisons (zero in runs without it).
    #[serde(default, skip_serializing_if = "PagedCounts::is_zero")]
    pub paged: PagedCounts,
    /// Generated ill-formed inputs (`Op::IllFormed`, impossible adopted states) that production refused with the
    /// expected typed error and every byte and state unchanged, per input class (`dtype`, `shape`, `heads`,
    /// `storage_kind`, `row_id`, `adopt_state`).
    #[serde(default)]
    pub ill_formed_rejected: BTreeMap<String, u64>,
}

impl Default for Counters {
    fn default() -> Self {
        Counters {
            checks: 0,
            expected_errors: 0,
            persist_roundtrips: 0,
            persist_batches: 0,
            prepared_prefills: 0,
            prefills_ended_uncommitted: 0,
            damaged_files_refused: 0,
            layer_sets: 0,
            lying_files_refused: 0,
            conversions: 0,
            prefill_conversions: 0,
            rounds: 0,
            rollbacks_across_wrap: 0,
            reuses: 0,
            trims_below_start: 0,
            mask_memo: 0,
            bit_exact_state: 0,
            decode_unpadded: ClassCount::default(),
            decode_padded: ClassCount::default(),
            window: ClassCount::default(),
            model_max_ulp_f32: 0.0,
            model_max_ulp_bf16: 0.0,
            model_checks: 0,
            guarantees: Guarantees { exact_unpadded_decode: true, gpu: false },
            table: BTreeMap::new(),
            recurrent: Recurrent::default(),
            paged: PagedCounts::default(),
            ill_formed_rejected: BTreeMap::new(),
        }
    }
}

impl Counters {
    pub fn record_model_ulp(&mut self, dtype: Dtype, ulp: f64) {
        self.model_checks += 1;
        if dtype == Dtype::Bfloat16 {
            self.model_max_ulp_bf16 = self.model_max_ulp_bf16.max(ulp);
        } else {
            self.model_max_ulp_f32 = self.model_max_ulp_f32.max(ulp);
        }
    }

    /// `n` state comparisons (bytes vs twin and model), all byte-identical (a difference is a failure).
    pub fn record_state(&mut self, dtype: Dtype, n: u64) {
        let e = self.table.entry(format!("state_bytes/{}", dtype_name(dtype))).or_default();
        e.compared += n;
        e.bit_exact += n;
    }

    /// One read of an affine-quantized cache against the f64 attention over the dequantized keys and values
    /// (`reference::quant`): its scaled-ULP distance, kept apart from the plain reads' `model_max_ulp_*` (the
    /// quantized matmuls round every product and sum to the dtype, so the distance is of another order), in the
    /// table under `vs_f64_dequantized/<dtype>` (`max_ulp` rounded up).
    pub fn record_quant_model_ulp(&mut self, dtype: Dtype, ulp: f64) {
        self.model_checks += 1;
        let e = self.table.entry(format!("vs_f64_dequantized/{}", dtype_name(dtype))).or_default();
        e.compared += 1;
        if ulp == 0.0 {
            e.bit_exact += 1;
        }
        e.max_ulp = e.max_ulp.max(ulp.ceil() as u64);
    }

    pub fn record_twin(&mut self, class: OutClass, tags: &[&'static str], dtype: Dtype, worst: u64) {
        let base = match class {
            OutClass::DecodeUnpadded => "decode_unpadded",
            OutClass::DecodePadded => "decode_padded",
            OutClass::Window => "window",
        };
        for t in std::iter::once(&base).chain(tags) {
            let e = self.table.entry(format!("{t}/{}", dtype_name(dtype))).or_default();
            e.compared += 1;
            if worst == 0 {
                e.bit_exact += 1;
            } else {
                e.max_ulp = e.max_ulp.max(worst);
            }
        }
        let c = match class {
            OutClass::DecodeUnpadded => &mut self.decode_unpadded,
            OutClass::DecodePadded => &mut self.decode_padded,
            OutClass::Window => &mut self.window,
        };
        c.compared += 1;
        if worst == 0 {
            c.bit_exact += 1;
        } else {
            c.max_ulp = c.max_ulp.max(worst);
        }
        self.checks += 1;
    }

    pub fn add(&mut self, o: &Counters) {
        self.checks += o.checks;
        self.expected_errors += o.expected_errors;
        self.persist_roundtrips += o.persist_roundtrips;
        self.persist_batches += o.persist_batches;
        self.prepared_prefills += o.prepared_prefills;
        self.prefills_ended_uncommitted += o.prefills_ended_uncommitted;
        self.damaged_files_refused += o.damaged_files_refused;
        self.layer_sets += o.layer_sets;
        self.lying_files_refused += o.lying_files_refused;
        self.conversions += o.conversions;
        self.prefill_conversions += o.prefill_conversions;
        self.rounds += o.rounds;
        self.rollbacks_across_wrap += o.rollbacks_across_wrap;
        self.trims_below_start += o.trims_below_start;
        self.mask_memo += o.mask_memo;
        self.reuses += o.reuses;
        self.bit_exact_state += o.bit_exact_state;
        self.decode_unpadded.add(&o.decode_unpadded);
        self.decode_padded.add(&o.decode_padded);
        self.window.add(&o.window);
        self.model_max_ulp_f32 = self.model_max_ulp_f32.max(o.model_max_ulp_f32);
        self.model_max_ulp_bf16 = self.model_max_ulp_bf16.max(o.model_max_ulp_bf16);
        self.model_checks += o.model_checks;
        for (k, v) in &o.table {
            self.table.entry(k.clone()).or_default().add(v);
        }
        self.recurrent.add(&o.recurrent);
        self.paged.add(&o.paged);
        for (k, v) in &o.ill_formed_rejected {
            *self.ill_formed_rejected.entry(k.clone()).or_insert(0) += v;
        }
    }

    /// One ill-formed input of class `class` refused as expected (typed error, nothing changed).
    pub fn record_rejected(&mut self, class: &str) {
        *self.ill_formed_rejected.entry(class.to_string()).or_insert(0) += 1;
        self.expected_errors += 1;
        self.checks += 1;
    }
}

fn dtype_name(d: Dtype) -> &'static str {
    if d == Dtype::Bfloat16 {
        "bf16"
    } else {
        "f32"
    }
}

/// One storage-kind family's line of the summary's `layouts` object.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LayoutStats {
    /// Ops the family applied (not skipped).
    pub ops: u64,
    /// The same ops per op kind (which kinds reached this family: e.g. `commit_span` in the quantized and recurrent
    /// families, `compiled_step` in the quantized one).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub ops_by_kind: BTreeMap<String, u64>,
    /// Checks the family ran.
    pub checks: u64,
    /// Forwards whose mask memo the family checked (R-C-3).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub mask_memo: u64,
    /// Runs that failed on one of this family's checks.
    pub failures: u64,
    /// Comparisons (states and read outputs, against twin and model) that were byte-identical.
    pub bit_exact: u64,
    /// `class/dtype` -> comparisons with the solo twin (the family's guarantees table).
    pub guarantees: BTreeMap<String, ClassCount>,
    /// The recurrent family's rounds, rollbacks (with unequal per-row keeps), replays and model distances.
    #[serde(default, skip_serializing_if = "Recurrent::is_zero")]
    pub recurrent: Recurrent,
    /// The paged family's sharing, pressure and comparisons.
    #[serde(default, skip_serializing_if = "PagedCounts::is_zero")]
    pub paged: PagedCounts,
    /// Coverage per variant of a family that draws parameters per seed (`Family::variant`, e.g. the quantized
    /// family's `"<bits>:<group>"`): the runs, ops and checks of each. Empty (and not serialized) for the others.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub variants: BTreeMap<String, VariantStats>,
}

/// One variant's share of a family's line (see [`LayoutStats::variants`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct VariantStats {
    /// Runs (seeds) of this variant.
    pub seeds: u64,
    pub ops: u64,
    pub checks: u64,
    pub failures: u64,
}

impl LayoutStats {
    /// The line of one run of one family.
    pub fn of(ops: u64, c: &Counters, failed: bool) -> LayoutStats {
        LayoutStats {
            ops,
            ops_by_kind: BTreeMap::new(),
            checks: c.checks,
            mask_memo: c.mask_memo,
            failures: failed as u64,
            bit_exact: c.bit_exact_state + c.decode_unpadded.bit_exact + c.decode_padded.bit_exact + c.window.bit_exact,
            guarantees: c.table.clone(),
            recurrent: c.recurrent,
            paged: c.paged,
            variants: BTreeMap::new(),
        }
    }

    /// The same line, counted under `variant` too (one run).
    pub fn with_variant(mut self, variant: Option<String>) -> LayoutStats {
        if let Some(v) = variant {
            let e = VariantStats { seeds: 1, ops: self.ops, checks: self.checks, failures: self.failures };
            self.variants.insert(v, e);
        }
        self
    }

    /// The same line with its ops counted per kind.
    pub fn with_ops_by_kind<'a>(mut self, kinds: impl IntoIterator<Item = (&'a str, u64)>) -> LayoutStats {
        for (k, n) in kinds {
            *self.ops_by_kind.entry(k.to_string()).or_insert(0) += n;
        }
        self
    }

    pub fn add(&mut self, o: &LayoutStats) {
        self.ops += o.ops;
        for (k, n) in &o.ops_by_kind {
            *self.ops_by_kind.entry(k.clone()).or_insert(0) += n;
        }
        self.checks += o.checks;
        self.mask_memo += o.mask_memo;
        self.failures += o.failures;
        self.bit_exact += o.bit_exact;
        for (k, v) in &o.guarantees {
            self.guarantees.entry(k.clone()).or_default().add(v);
        }
        self.recurrent.add(&o.recurrent);
        self.paged.add(&o.paged);
        for (k, v) in &o.variants {
            let e = self.variants.entry(k.clone()).or_default();
            e.seeds += v.seeds;
            e.ops += v.ops;
            e.checks += v.checks;
            e.failures += v.failures;
        }
    }
}

fn is_zero(x: &u64) -> bool {
    *x == 0
}
