//! The diff of both sides' step results: kvsim's and the driver's records compared step by step
//! ([`diff`] ... [`diff_full`]), every divergence described ([`Divergence`]) and classified by the rules of
//! `rules`, the roots' scopes followed (the driver's rows included) until what they explain is gone, and the
//! differing reads measured in ULPs at output scale ([`Measure`], [`output_dtype`]).

use std::collections::{BTreeMap, BTreeSet};

use crate::recorder::{Outcome, Record, StepInfo, Values};
use crate::rules::{
    checkpoint_rule, failed_rows, is_batch_step, quant_rows_failed_rule, quant_rows_layouts, quant_rows_read_rule,
    quant_rows_trim_differs, quant_rows_trim_rule, read_rule, root_scope, rows_mapped, rows_outside, state_rule,
    trim_counts, Class, Rule, Scope, RESYNCED,
};
use kvsim_cache::bytes::Words;
use kvsim_harness::sim::config::{DtypeChoice, SimConfig};
use kvsim_harness::sim::observe::Read;

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

/// The dtype of a run's outputs.
pub fn output_dtype(cfg: &SimConfig) -> mlx_rs::Dtype {
    match cfg.dtype {
        DtypeChoice::F32 => mlx_rs::Dtype::Float32,
        DtypeChoice::Bf16 => mlx_rs::Dtype::Bfloat16,
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

pub(crate) fn show(o: Option<&Outcome>) -> String {
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

pub(crate) fn detail(k: Option<&Outcome>, o: Option<&Outcome>) -> String {
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
pub(crate) fn layout_of(info: Option<&StepInfo>, window: Option<usize>, ssm: bool) -> &'static str {
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
