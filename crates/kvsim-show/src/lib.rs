//! `kvsim show`: a trace replayed under observers of its own and drawn as one self-contained HTML page
//! ([`html::render`]) or as terminal text ([`text::render`]).
//!
//! [`build`] replays the trace once per family the observer interface describes (the attention, quantized and
//! recurrent families) with a [`watch::Watcher`] that watches that family alone: its production calls and the state
//! of every live request after every op (the first of these replays also gives every op's verdict; with no such
//! family, [`watch::Verdicts`] does). After a failure the watchers replay up to the failing op, which runs to its
//! end with kvsim's checks off ([`kvsim_harness::sim::check::checks_off`]), so the page shows
//! the state production left there and every check that op failed. [`failure::details`] turns the failing check's
//! message into pictures (rings, mask, expected against actual bytes) where the observed data holds both sides.
//!
//! The page shows only what observers are handed: every read's inputs, output, mask and (for the attention
//! families) its solo twin's output; every request's temporal view and, for rings, the live physical columns, write
//! head and padding beside the reference model's ring. [`page::Page::unobservable`] lists what they are not
//! handed (the f64 model outputs, the families that describe nothing). This crate never prints: the command line
//! writes its result.
#![cfg_attr(test, allow(clippy::print_stdout, clippy::print_stderr))]

pub mod failure;
pub mod html;
pub mod page;
pub mod text;
pub mod watch;

use std::collections::BTreeMap;

use kvsim_harness::sim::check::checks_off;
use kvsim_harness::sim::shrink;
use kvsim_harness::sim::trace::{Outcome, Trace};
use kvsim_harness::sim::{self, DeviceChoice};

use page::{FailureView, FamilyView, Header, Lane, OpCell, Page, Place, ShrunkView, Span, Status};
use watch::{Verdicts, Watcher};

/// The families whose calls and states the observer interface describes.
pub const WATCHED: &[&str] = &["attention", "quant", "ssm", "transition", "bf16-first"];

/// What to draw, besides the trace.
#[derive(Debug, Clone)]
pub struct Options {
    /// The trace's path as the user gave it (it goes into the commands the page prints).
    pub path: String,
    pub device: DeviceChoice,
    /// The op the page opens with (default: the failing op, else the last).
    pub op: Option<usize>,
    /// Shrink a failing trace with this many replays and show the result beside it.
    pub shrink: Option<usize>,
    /// A shrunk trace to show beside it (and its path).
    pub shrunk: Option<(String, Trace)>,
    /// The version of the kvsim that draws the page.
    pub kvsim_version: String,
    /// Where the HTML goes (for the `show_command`), if anywhere.
    pub html: Option<String>,
}

fn outcome_text(o: &Outcome) -> String {
    match o {
        Outcome::Pass => "pass".into(),
        Outcome::Fail { op_index, check, message } => format!("fail at op {op_index} [{check}] {message}"),
    }
}

fn device_flag(device: &str) -> &'static str {
    if device == "gpu" {
        " --device gpu"
    } else {
        ""
    }
}

/// Quotes a path for a POSIX shell when it needs it.
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty() && s.chars().all(|c| c.is_ascii_alphanumeric() || "/._-+=:,@".contains(c)) {
        s.to_string()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// The command that draws a trace's page (what `kvsim sim` and `kvsim replay` print for a failing trace).
pub fn show_command(trace: &str, html: &str) -> String {
    format!("kvsim show {} --html {}", shell_quote(trace), shell_quote(html))
}

/// The families of a run (the config's, or the default).
fn families_of(trace: &Trace) -> Vec<String> {
    if trace.config.families.is_empty() {
        kvsim_harness::sim::family::default_families()
    } else {
        trace.config.families.clone()
    }
}

/// Which watcher describes the family whose storage-kind key is `key`.
fn watcher_for<'a>(watchers: &'a [Watcher], key: Option<&str>) -> Option<&'a Watcher> {
    let key = key?;
    let name = match key {
        "kv:plain" | "kv:rotating-plain" => "attention",
        "kv:quant" | "kv:rotating-quant" => "quant",
        "kv:delayed-quant" | "kv:delayed-rotating-quant" => "transition",
        "kv:bf16-first-quant" | "kv:bf16-first-rotating-quant" => "bf16-first",
        k if !k.starts_with("kv:") && !k.starts_with("train:") => "ssm",
        _ => return None,
    };
    watchers.iter().find(|w| w.family == name)
}

/// Replays `trace` under the page's observers and builds the page.
pub fn build(trace: &Trace, opts: &Options) -> Result<Page, String> {
    let device = opts.device;
    let families = families_of(trace);
    let watched: Vec<&String> = families.iter().filter(|n| WATCHED.contains(&n.as_str())).collect();
    // The verdicts come from a plain replay; when some family is watched, that replay is the first watcher's.
    let mut first = watched.first().map(|n| Watcher::new(n, &trace.config));
    let mut verdicts = Verdicts::default();
    let observer: &mut dyn kvsim_harness::sim::observe::RunObserver = match first.as_mut() {
        Some(w) => w,
        None => &mut verdicts,
    };
    let run =
        sim::run_observed(trace.seed, trace.config.clone(), Some(trace.ops.clone()), device, trace.mutant, observer);
    let results = first.as_ref().map_or(verdicts.results, |w| w.results.clone());
    if let Some(e) = first.as_ref().and_then(|w| w.error.clone()) {
        return Err(format!("observing the {} family: {e}", watched[0]));
    }
    let fail_at = match &run.trace.outcome {
        Outcome::Fail { op_index, .. } => Some(*op_index),
        Outcome::Pass => None,
    };
    let reached = fail_at.map_or(trace.ops.len(), |i| i + 1);
    let ops: Vec<OpCell> = trace
        .ops
        .iter()
        .enumerate()
        .map(|(i, op)| OpCell {
            index: i,
            kind: op.kind().name().to_string(),
            text: format!("{op:?}"),
            status: match results.get(i) {
                _ if Some(i) == fail_at => Status::Failed,
                _ if i >= reached => Status::NotRun,
                Some(Ok(true)) => Status::Passed,
                Some(Ok(false)) => Status::Skipped,
                Some(Err(_)) => Status::Failed,
                None => Status::NotRun,
            },
        })
        .collect();

    // Every other watched family (and, when the run failed, the first one again): one replay each, up to and
    // including the failing op, with the checks off. The ops before the failure pass either way, and the failing op
    // runs to its end and hands over its state.
    let mut watchers = vec![];
    let mut suppressed = vec![];
    for (k, name) in watched.iter().enumerate() {
        if k == 0 && fail_at.is_none() {
            watchers.extend(first.take());
            continue;
        }
        let mut w = Watcher::new(name, &trace.config);
        let ops_run = trace.ops[..reached].to_vec();
        let (r, found) = checks_off(|| {
            sim::run_observed(trace.seed, trace.config.clone(), Some(ops_run), device, trace.mutant, &mut w)
        });
        if let Some(e) = &w.error {
            return Err(format!("observing the {name} family: {e}"));
        }
        if suppressed.is_empty() {
            suppressed = found.iter().map(|f| f.to_string()).collect();
        }
        if let (Some(i), Outcome::Fail { op_index, check, message }) = (fail_at, &r.trace.outcome) {
            if *op_index == i {
                if let Some(Some(s)) = w.snaps.get_mut(i) {
                    s.missing = Some(format!("with kvsim's checks off the op still stopped: [{check}] {message}"));
                }
            }
        }
        if let Some(Some(s)) = fail_at.and_then(|i| w.snaps.get_mut(i)) {
            if let Some(last) = s.stages.iter_mut().rev().find(|st| st.source == "after the op") {
                last.source = "after the failing op, run to its end with kvsim's checks off".into();
            }
        }
        watchers.push(w);
    }
    // The recurrent family's states list its layers in order; which model layers they are is known once its calls
    // named them.
    for w in watchers.iter_mut().filter(|w| w.ssm) {
        let ids: Vec<usize> = (0..trace.config.layers.max(w.ssm_layers.len())).map(|k| w.ssm_layer(k)).collect();
        for st in w.snaps.iter_mut().flatten().flat_map(|s| s.stages.iter_mut()) {
            for r in &mut st.rows {
                for (k, l) in r.layers.iter_mut().enumerate() {
                    l.layer = ids.get(k).copied().unwrap_or(k);
                }
            }
        }
    }

    let lanes = lanes_of(&watchers, reached);
    let window = trace.config.layout.max_size();
    let failure = match (&run.trace.outcome, &run.failure) {
        (Outcome::Fail { op_index, check, message }, f) => {
            let family = f.as_ref().and_then(|f| f.family).map(str::to_string);
            let w = watcher_for(&watchers, family.as_deref());
            let mut all = suppressed.clone();
            if all.is_empty() {
                all.push(format!("[{check}] {message}"));
            }
            Some(FailureView {
                op_index: *op_index,
                op_text: format!("{:?}", trace.ops[*op_index]),
                check: check.clone(),
                message: message.clone(),
                family,
                all_failures: all.clone(),
                details: failure::details(check, message, window, w),
            })
        }
        (Outcome::Pass, _) => None,
    };

    if let Some(f) = &failure {
        mark_named_column(&mut watchers, f, run.failure.as_ref().and_then(|x| x.family));
    }

    let shrunk = match (&opts.shrunk, opts.shrink, fail_at) {
        (Some((path, t)), _, _) => Some(shrunk_view(trace, t, format!("the shrunk trace {path}"))),
        (None, Some(budget), Some(_)) => {
            let s = shrink::shrink(trace, device, budget)?;
            Some(shrunk_view(trace, &s.trace, format!("shrunk now, in {} replays", s.runs)))
        }
        _ => None,
    };

    let family_views = watchers
        .iter()
        .map(|w| FamilyView {
            name: w.family.clone(),
            kind: if w.ssm { "ssm".into() } else { "kv".into() },
            layers: trace.config.layers,
            window: if w.ssm { None } else { window },
            geometry: geometry(trace, w),
            ops: {
                let mut v = w.snaps.clone();
                v.resize(trace.ops.len(), None);
                v
            },
        })
        .collect();

    let mismatch = sim::replay_matches(trace, &run).err();
    let header = Header {
        path: opts.path.clone(),
        seed: trace.seed,
        config: serde_json::to_value(&trace.config).map_err(|e| e.to_string())?,
        families,
        kvsim_version: opts.kvsim_version.clone(),
        trace_mlx_version: trace.mlx_version.clone(),
        replay_mlx_version: run.trace.mlx_version.clone(),
        device: device.name().to_string(),
        mutant: trace.mutant.map(|m| m.name().to_string()),
        expect: format!("{:?}", trace.expect).to_lowercase(),
        note: trace.note.clone(),
        recorded_outcome: outcome_text(&trace.outcome),
        replay_outcome: outcome_text(&run.trace.outcome),
        mismatch,
    };
    let last = trace.ops.len().saturating_sub(1);
    let selected = opts.op.unwrap_or(fail_at.unwrap_or(last)).min(last);
    let replay_command = format!("kvsim replay {}{}", shell_quote(&opts.path), device_flag(device.name()));
    let show_command = match &opts.html {
        Some(h) => show_command(&opts.path, h),
        None => format!("kvsim show {}", shell_quote(&opts.path)),
    };
    let mut unobservable = vec![
        "The reference model's f64 attention outputs: computed inside the output checks from the model's visible \
         columns and never handed over (a failing output check's message gives its distance); the model's rings \
         (columns, write head, offset, padding) are handed over and drawn beside production's."
            .to_string(),
    ];
    let unwatched: Vec<&String> = header.families.iter().filter(|f| !WATCHED.contains(&f.as_str())).collect();
    if !unwatched.is_empty() {
        unobservable.push(format!(
            "The families {unwatched:?} describe no calls or states to observers: their checks count in the verdicts \
             only."
        ));
    }
    Ok(Page {
        header,
        replay_command,
        show_command,
        ops,
        lanes,
        families: family_views,
        failure,
        shrunk,
        selected,
        unobservable,
    })
}

/// A `layout` failure names a request, a layer and a column: that column of the failing op's final state is marked.
fn mark_named_column(watchers: &mut [Watcher], f: &FailureView, key: Option<&str>) {
    use failure::num_after;
    if f.check != "layout" {
        return;
    }
    let Some(msg) = std::iter::once(&f.message).chain(&f.all_failures).find(|m| m.contains("temporal_view")) else {
        return;
    };
    let Some(name) = watcher_for(watchers, key).map(|w| w.family.clone()) else { return };
    let (Some(req), Some(layer), Some(col)) =
        (num_after(msg, "request "), num_after(msg, "layer "), num_after(msg, "column "))
    else {
        return;
    };
    let Some(w) = watchers.iter_mut().find(|w| w.family == name) else { return };
    let Some(Some(snap)) = w.snaps.get_mut(f.op_index) else { return };
    let Some(stage) = snap.stages.iter_mut().rev().find(|s| !s.rows.is_empty()) else { return };
    let Some(row) = stage.rows.iter_mut().find(|r| r.req == req as u32) else { return };
    let Some(l) = row.layers.get_mut(layer) else { return };
    l.tokens = split_at_column(std::mem::take(&mut l.tokens), col);
}

/// `runs` with column `col` as a run of its own, marked `named`.
fn split_at_column(runs: Vec<page::TokRun>, col: usize) -> Vec<page::TokRun> {
    let mut out = vec![];
    let mut at = 0usize;
    for r in runs {
        let n = r.n as usize;
        if col < at || col >= at + n {
            at += n;
            out.push(r);
            continue;
        }
        let k = (col - at) as u32;
        let step = |d: u32| if r.kind == "tok" { r.pos + d } else { r.pos };
        if k > 0 {
            out.push(page::TokRun { n: k, ..r.clone() });
        }
        out.push(page::TokRun { pos: step(k), n: 1, named: true, ..r.clone() });
        if k + 1 < r.n {
            out.push(page::TokRun { pos: step(k + 1), n: r.n - k - 1, ..r.clone() });
        }
        at += n;
    }
    out
}

fn geometry(trace: &Trace, w: &Watcher) -> String {
    let c = &trace.config;
    if w.ssm {
        let n = w.ssm_layer_count.unwrap_or(w.ssm_layers.len());
        return format!("recurrent (gated DeltaNet) rows, {n} layer{}, {:?}", if n == 1 { "" } else { "s" }, c.dtype);
    }
    let window = c.layout.max_size().map_or("linear".to_string(), |w| format!("rotating, window {w}"));
    let storage = match kvsim_harness::sim::family::quant::QuantChoice::of(c).filter(|_| w.family == "quant") {
        Some(q) if q.native => format!(", affine {}-bit group {} from the first write", q.bits, q.group),
        Some(q) => format!(", plain until converted to affine {}-bit group {}", q.bits, q.group),
        None if w.family == kvsim_harness::sim::family::transition::NAME
            || w.family == kvsim_harness::sim::family::transition::LEGO_NAME =>
        {
            let t = kvsim_harness::sim::family::transition::TransitionChoice::draw(c);
            let at = t.start.map_or("never converts".to_string(), |s| format!("each request converts at offset {s}"));
            format!(", bf16 first, then affine {}-bit group {} ({at})", t.bits, t.group)
        }
        None => String::new(),
    };
    let dtype = if w.vs.dtype == kvsim_reference::RefDtype::Bf16 { "Bf16" } else { "F32" };
    format!(
        "{window}, {} layer{}, {} KV heads x head dim {}, {dtype}{storage}",
        c.layers,
        if c.layers == 1 { "" } else { "s" },
        w.vs.heads_kv,
        w.vs.head_dim,
    )
}

fn shrunk_view(original: &Trace, shrunk: &Trace, source: String) -> ShrunkView {
    ShrunkView {
        source,
        original: original.ops.iter().map(|o| format!("{o:?}")).collect(),
        shrunk: shrunk.ops.iter().map(|o| format!("{o:?}")).collect(),
        outcome: outcome_text(&shrunk.outcome),
    }
}

/// Requests' lanes from the first watched family that tracks requests (the attention families place rows; the
/// recurrent family's places come from its batch calls).
fn lanes_of(watchers: &[Watcher], reached: usize) -> Vec<Lane> {
    let Some(w) = watchers.iter().find(|w| !w.ssm).or(watchers.first()) else { return vec![] };
    let mut lanes: BTreeMap<u32, Lane> = BTreeMap::new();
    let mut prev: BTreeMap<u32, Place> = BTreeMap::new();
    for i in 0..reached.min(w.places.len()) {
        let now = &w.places[i];
        for (&req, &place) in now {
            let lane = lanes.entry(req).or_insert(Lane { req, admitted: i, spans: vec![], finished: None });
            match lane.spans.last_mut() {
                Some(s) if s.place == place && s.to + 1 == i => s.to = i,
                _ => lane.spans.push(Span { from: i, to: i, place }),
            }
        }
        for req in prev.keys() {
            if !now.contains_key(req) {
                if let Some(l) = lanes.get_mut(req) {
                    l.finished.get_or_insert(i);
                }
            }
        }
        prev = now.clone();
    }
    lanes.into_values().collect()
}
