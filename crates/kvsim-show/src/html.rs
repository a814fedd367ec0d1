//! The page as one self-contained HTML file: inline CSS, an inline SVG timeline, the header, the failure's pictures
//! and the op list rendered here; the per-op pictures drawn by a small inline script from the page's data (embedded
//! as JSON), so a long trace stays a small file. Nothing is loaded from anywhere: no network, no fonts, no external
//! script.
//!
//! Element ids the page guarantees (the browser check and the tests read them): `header`, `repro`, `config`,
//! `failure`, `timeline`, `cell-N` (op N's check cell; class `passed`, `skipped`, `failed` or `not_run`),
//! `lane-R` (request R's lane), `detail` (the selected op's pictures; the script sets `data-rendered-op`),
//! `shrunk`, `ops`, `op-N`, `unobservable`, `kvsim-data`. The script marks the failing cell with
//! `data-marked="first-failure"`; an error in it sets the title to `kvsim show: SCRIPT ERROR ...` and fills
//! `script-error`.

use std::collections::HashMap;
use std::fmt::Write;

use html_escape::{encode_double_quoted_attribute as attr, encode_text as text};
use serde::Serialize;
use serde_json::{json, Value};

use crate::page::{Detail, FamilyView, LayerSnap, MaskPic, Page, Place, RingPic, Status, TokRun, ValueTable};

const CSS: &str = include_str!("page.css");
const SCRIPT: &str = include_str!("page.js");

/// What the script needs: the op cells, the families' snapshots (compacted: [`compact_family`]) and the
/// preselected op.
#[derive(Serialize)]
struct ScriptData<'a> {
    selected: usize,
    fail_at: Option<usize>,
    ops: Vec<(&'a str, &'a str, &'a str)>,
    families: Vec<Value>,
}

/// A family's snapshots as the script reads them, small enough for long traces: every distinct layer picture once
/// in `layers` (a request's layers rarely change from one op to the next), referenced by index from the rows;
/// stages as `[source, calls, batch, rows]` with `source` an index into `sources`, rows as `[req, offset, [layer
/// indices]]` plus the row's home when its place in `batch` does not say it; the k-th index is the model's layer
/// `layer_ids[k]` (identical windows of different layers share one entry). A plain layer is `[len, storage, runs,
/// planes, ring]` with `storage` an index into `storages` and `planes` one into `plane_sets` (a list of plane
/// descriptions); a run is `[kind, req, pos, n, flags]` (kind `t` token, `p` padding, `z` zeros, `u` unknown; flags
/// 1: out of the row's own order, or not the model's token there; 2: named by the failing check); `ring` is `null`
/// or `[physical runs, head, last window write, left padding, pending, model, offset]` (`offset` `null` when it is
/// the row's; its length is the runs' total, rotated when the head is below it), the physical runs `0` when they are the live window's own,
/// with `model` `null` (it agrees) or `[[[req, pos] per physical column], offset, head, last window write, left
/// padding, pending]`; a recurrent layer is `["ssm", conv, rec, conv
/// digest, rec digest]`. A stage's fifth entry lists its masks as indices into `masks`, each `[what, kind, rows,
/// queries, cols, grid lines, clipped]`.
pub fn compact_family(f: &FamilyView) -> Value {
    let mut layers: Vec<Value> = vec![];
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut sources: Vec<String> = vec![];
    let mut strings = Strings::default();
    let mut intern = |v: Value, table: &mut Vec<Value>| -> usize {
        let key = v.to_string();
        *index.entry(key).or_insert_with(|| {
            table.push(v);
            table.len() - 1
        })
    };
    let ops: Vec<Value> = f
        .ops
        .iter()
        .map(|snap| {
            let Some(snap) = snap else { return Value::Null };
            let stages: Vec<Value> = snap
                .stages
                .iter()
                .map(|st| {
                    let src = match sources.iter().position(|s| *s == st.source) {
                        Some(i) => i,
                        None => {
                            sources.push(st.source.clone());
                            sources.len() - 1
                        }
                    };
                    let rows: Vec<Value> = st
                        .rows
                        .iter()
                        .map(|r| {
                            let ls: Vec<usize> = r
                                .layers
                                .iter()
                                .map(|l| intern(compact_layer(l, &mut strings, r.offset), &mut layers))
                                .collect();
                            // The home only when the row's place in `batch` does not say it.
                            let plain = match st.batch.iter().position(|&b| b == r.req) {
                                Some(i) => r.home == format!("batch row {i}"),
                                None => r.home == "solo",
                            };
                            if plain {
                                json!([r.req, r.offset, ls])
                            } else {
                                json!([r.req, r.offset, ls, r.home])
                            }
                        })
                        .collect();
                    let masks: Vec<usize> = st.masks.iter().map(|m| strings.mask(m)).collect();
                    json!([src, st.calls, st.batch, rows, masks])
                })
                .collect();
            json!({"s": stages, "m": snap.missing})
        })
        .collect();
    // A row's k-th layer picture is the model's layer `layer_ids[k]` (the same in every row of a family).
    let layer_ids: Vec<usize> = f
        .ops
        .iter()
        .flatten()
        .flat_map(|s| &s.stages)
        .flat_map(|st| &st.rows)
        .next()
        .map(|r| r.layers.iter().map(|l| l.layer).collect())
        .unwrap_or_default();
    json!({"name": f.name, "kind": f.kind, "window": f.window, "geometry": f.geometry, "sources": sources,
           "layer_ids": layer_ids, "layers": layers, "storages": strings.storages, "plane_sets": strings.plane_sets,
           "masks": strings.masks, "ops": ops})
}

/// The storage names and plane descriptions of a family's layers, and its reads' masks, each once.
#[derive(Default)]
struct Strings {
    storages: Vec<String>,
    plane_sets: Vec<Vec<String>>,
    masks: Vec<Value>,
    mask_index: HashMap<String, usize>,
}

impl Strings {
    fn mask(&mut self, m: &MaskPic) -> usize {
        let v = json!([m.what, m.kind, m.rows, m.queries, m.cols, m.grid, m.clipped]);
        let masks = &mut self.masks;
        *self.mask_index.entry(v.to_string()).or_insert_with(|| {
            masks.push(v);
            masks.len() - 1
        })
    }

    fn storage(&mut self, s: &str) -> usize {
        match self.storages.iter().position(|x| x == s) {
            Some(i) => i,
            None => {
                self.storages.push(s.to_string());
                self.storages.len() - 1
            }
        }
    }

    fn planes(&mut self, p: &[String]) -> usize {
        match self.plane_sets.iter().position(|x| x == p) {
            Some(i) => i,
            None => {
                self.plane_sets.push(p.to_vec());
                self.plane_sets.len() - 1
            }
        }
    }
}

fn compact_layer(l: &LayerSnap, strings: &mut Strings, row_offset: usize) -> Value {
    if let Some(s) = &l.ssm {
        return json!(["ssm", s.conv, s.rec, s.conv_digest, s.rec_digest]);
    }
    let ring = l.ring.as_ref().map(|g| {
        let model = g.model.as_ref().map(|m| {
            let cols: Vec<[u32; 2]> = m.columns.iter().map(|&(r, p)| [r, p]).collect();
            json!([cols, m.offset, m.idx, m.last_concat, m.left_padding, m.pending])
        });
        let physical = if g.columns == l.tokens { json!(0) } else { json!(runs(&g.columns)) };
        let offset = (g.offset != row_offset).then_some(g.offset);
        json!([physical, g.idx, g.last_concat, g.left_padding, g.pending, model, offset])
    });
    json!([l.len, strings.storage(&l.storage), runs(&l.tokens), strings.planes(&l.planes), ring])
}

fn runs(runs: &[TokRun]) -> Vec<Value> {
    runs.iter()
        .map(|r| {
            let kind = match r.kind.as_str() {
                "tok" => "t",
                "pad" => "p",
                "zero" => "z",
                _ => "u",
            };
            let flags = u8::from(!r.expected) | (u8::from(r.named) << 1);
            json!([kind, r.req, r.pos, r.n, flags])
        })
        .collect()
}

/// JSON that is safe inside a `<script>` element: `<`, `>` and `&` escaped as JSON `\u` escapes (they only occur
/// inside strings).
fn script_json<T: Serialize>(v: &T) -> String {
    let s = serde_json::to_string(v).expect("the page's data serializes");
    s.replace('<', "\\u003c").replace('>', "\\u003e").replace('&', "\\u0026")
}

fn status_class(s: Status) -> &'static str {
    match s {
        Status::Passed => "passed",
        Status::Skipped => "skipped",
        Status::Failed => "failed",
        Status::NotRun => "not_run",
    }
}

/// The page's title.
pub fn title(p: &Page) -> String {
    match &p.failure {
        Some(f) => format!("kvsim show: seed {}, first failure at op {} [{}]", p.header.seed, f.op_index, f.check),
        None => format!("kvsim show: seed {}, {} ops, {}", p.header.seed, p.ops.len(), p.header.replay_outcome),
    }
}

/// The whole page.
pub fn render(p: &Page) -> String {
    let mut h = String::with_capacity(64 * 1024);
    let t = title(p);
    let _ = writeln!(
        h,
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>{}</title>\n\
         <script>window.onerror=function(m,s,l){{document.title='kvsim show: SCRIPT ERROR '+m;\
         var e=document.getElementById('script-error');if(e){{e.hidden=false;e.textContent='script error: '+m+' (line '+l+')';}}}};</script>\n\
         <style>\n{CSS}</style>\n</head>\n<body data-selected=\"{}\">\n<pre id=\"script-error\" hidden></pre>",
        text(&t),
        p.selected
    );
    header(&mut h, p);
    failure(&mut h, p);
    timeline(&mut h, p);
    let _ = writeln!(
        h,
        "<section id=\"detail\"><h2 id=\"detail-title\">Op {}</h2>\
         <p class=\"hint\">Click a cell of the timeline or an op of the list (or press ← →) to see its pictures.</p>\
         <div id=\"detail-body\"></div><noscript>The per-op pictures are drawn by the page's script.</noscript></section>",
        p.selected
    );
    shrunk(&mut h, p);
    op_list(&mut h, p);
    h.push_str("<section id=\"unobservable\"><h2>Not observable</h2><ul>");
    for u in &p.unobservable {
        let _ = write!(h, "<li>{}</li>", text(u));
    }
    h.push_str("</ul></section>\n");
    let data = ScriptData {
        selected: p.selected,
        fail_at: p.failure.as_ref().map(|f| f.op_index),
        ops: p.ops.iter().map(|o| (o.kind.as_str(), o.text.as_str(), status_class(o.status))).collect(),
        families: p.families.iter().map(compact_family).collect(),
    };
    let _ = writeln!(h, "<script type=\"application/json\" id=\"kvsim-data\">{}</script>", script_json(&data));
    let _ = writeln!(h, "<script>\n{SCRIPT}</script>\n</body>\n</html>");
    h
}

fn header(h: &mut String, p: &Page) {
    let hd = &p.header;
    let _ = write!(h, "<header id=\"header\"><h1>{}</h1><dl>", text(&format!("kvsim show {}", hd.path)));
    let mut row = |k: &str, v: &str| {
        let _ = write!(h, "<dt>{}</dt><dd>{}</dd>", text(k), text(v));
    };
    row("seed", &hd.seed.to_string());
    row("families", &hd.families.join(", "));
    row("mutant", hd.mutant.as_deref().unwrap_or("none"));
    row("device", &hd.device);
    row("kvsim", &hd.kvsim_version);
    row("MLX", &format!("{} (recorded), {} (this replay)", hd.trace_mlx_version, hd.replay_mlx_version));
    row("expect", &hd.expect);
    row("recorded", &hd.recorded_outcome);
    row("replay", &hd.replay_outcome);
    if let Some(m) = &hd.mismatch {
        row("mismatch", m);
    }
    if !hd.note.is_empty() {
        row("note", &hd.note);
    }
    let cfg = serde_json::to_string_pretty(&hd.config).unwrap_or_default();
    let _ = writeln!(
        h,
        "</dl><p id=\"repro\">Reproduce: <code>{}</code><br>This page: <code>{}</code></p>\
         <details><summary>config</summary><pre id=\"config\">{}</pre></details></header>",
        text(&p.replay_command),
        text(&p.show_command),
        text(&cfg)
    );
}

fn ring_table(h: &mut String, label: &str, r: &RingPic) {
    let _ = write!(h, "<tr><th>{}</th>", text(label));
    for (c, pos) in r.columns.iter().enumerate() {
        let head = if c == r.idx { " head" } else { "" };
        match pos {
            Some(p) => {
                let _ = write!(h, "<td class=\"col{head}\" title=\"column {c}: position {p}\">{p}</td>");
            }
            None => {
                let _ = write!(h, "<td class=\"col empty{head}\" title=\"column {c}: empty\">·</td>");
            }
        }
    }
    let _ = write!(
        h,
        "<td class=\"note\">offset {}, len {}, write head {}, {}, last window write {}</td></tr>",
        r.offset,
        r.len,
        r.idx,
        if r.rotated { "rotated" } else { "in temporal order" },
        r.last_concat.map_or("none".to_string(), |l| l.to_string())
    );
}

fn value_table(h: &mut String, t: &ValueTable) {
    let _ = write!(h, "<p>{}</p><table class=\"values\"><tr><th>element</th>", text(&t.what));
    let expect = t.rows.iter().any(|r| r.expected_hex.is_some());
    let ulps = t.max_ulp.is_some();
    if expect {
        let _ = write!(h, "<th>{} (hex)</th><th>{}</th>", text(&t.expected_label), text(&t.expected_label));
    }
    let _ = write!(h, "<th>{} (hex)</th><th>{}</th>", text(&t.actual_label), text(&t.actual_label));
    if expect {
        h.push_str(if ulps { "<th>ULPs</th>" } else { "<th>differs</th>" });
    }
    h.push_str("</tr>");
    for r in &t.rows {
        let bad = r.differs;
        let _ = write!(h, "<tr{}><td>{}</td>", if bad { " class=\"bad\"" } else { "" }, text(&r.at));
        if expect {
            let _ = write!(
                h,
                "<td><code>{}</code></td><td>{}</td>",
                text(r.expected_hex.as_deref().unwrap_or("")),
                text(r.expected.as_deref().unwrap_or(""))
            );
        }
        let _ = write!(h, "<td><code>{}</code></td><td>{}</td>", text(&r.actual_hex), text(&r.actual));
        if expect {
            let cell = r.ulp.map_or(if r.differs { "yes" } else { "no" }.to_string(), |u| u.to_string());
            let _ = write!(h, "<td>{cell}</td>");
        }
        h.push_str("</tr>");
    }
    h.push_str("</table>");
    let _ = write!(h, "<p class=\"note\">{}</p>", text(&value_summary(t)));
}

/// `16 elements (bf16), 3 differ, largest distance 2 ULPs`.
pub fn value_summary(t: &ValueTable) -> String {
    let mut s = format!("{} elements ({})", t.total, t.dtype);
    if let Some(d) = t.differing {
        let _ = write!(s, ", {d} differ");
    }
    if let Some(u) = t.max_ulp {
        let _ = write!(s, ", largest distance {u} ULPs (kvsim-ulp)");
    }
    if t.rows.len() < t.total {
        let _ = write!(s, "; the first {} shown", t.rows.len());
    }
    s
}

fn detail(h: &mut String, d: &Detail, i: usize) {
    let _ = write!(h, "<div class=\"detail\" id=\"failure-detail-{i}\">");
    match d {
        Detail::Rings { what, window, production, model } => {
            let _ = write!(h, "<p>{}</p><table class=\"ring\"><tr><th></th>", text(what));
            let w = production.columns.len().max(model.columns.len());
            for c in 0..w {
                let _ = write!(h, "<th>{c}</th>");
            }
            let _ =
                write!(h, "<th class=\"note\">window {}</th></tr>", window.map_or("linear".into(), |w| w.to_string()));
            ring_table(h, "production", production);
            ring_table(h, "model", model);
            h.push_str("</table>");
        }
        Detail::Mask { what, width, production, model } => {
            let _ = write!(h, "<p>{}</p><table class=\"mask\"><tr><th>key column</th>", text(what));
            for c in 0..*width {
                let _ = write!(h, "<th>{c}</th>");
            }
            h.push_str("</tr>");
            for (label, cols, other) in [("production", production, model), ("model", model, production)] {
                let _ = write!(h, "<tr><th>{label}</th>");
                for c in 0..*width {
                    let on = cols.contains(&c);
                    let differs = on != other.contains(&c);
                    let class = match (on, differs) {
                        (true, false) => "on",
                        (true, true) => "on bad",
                        (false, true) => "off bad",
                        (false, false) => "off",
                    };
                    let _ = write!(h, "<td class=\"{class}\">{}</td>", if on { "■" } else { "·" });
                }
                h.push_str("</tr>");
            }
            h.push_str("</table>");
        }
        Detail::Values(t) => value_table(h, t),
        Detail::Pairs { what, rows } => {
            let _ = write!(
                h,
                "<p>{}</p><table class=\"pairs\"><tr><th></th><th>production</th><th>model</th></tr>",
                text(what)
            );
            for (l, a, b) in rows {
                let bad = a != b && !b.is_empty();
                let _ = write!(
                    h,
                    "<tr{}><th>{}</th><td>{}</td><td>{}</td></tr>",
                    if bad { " class=\"bad\"" } else { "" },
                    text(l),
                    text(a),
                    text(b)
                );
            }
            h.push_str("</table>");
        }
        Detail::Unobservable { what } => {
            let _ = write!(h, "<p class=\"unobservable\">Not observable: {}</p>", text(what));
        }
    }
    h.push_str("</div>");
}

fn failure(h: &mut String, p: &Page) {
    let Some(f) = &p.failure else {
        let _ = writeln!(
            h,
            "<section id=\"failure\" class=\"pass\"><h2>No failing check</h2><p>All {} ops replayed; every check passed.</p></section>",
            p.ops.len()
        );
        return;
    };
    let _ = write!(
        h,
        "<section id=\"failure\"><h2>First failing check: <span id=\"failure-check\">{}</span> at op {}</h2>\
         <p><code>{}</code>{}</p><p class=\"message\" id=\"failure-message\">{}</p>",
        text(&f.check),
        f.op_index,
        text(&f.op_text),
        f.family.as_ref().map_or(String::new(), |k| format!(" — family <code>{}</code>", text(k))),
        text(&f.message)
    );
    if f.all_failures.len() > 1 {
        h.push_str("<p>Every check this op failed when it ran to its end with kvsim's checks off:</p><ol class=\"all-failures\">");
        for a in &f.all_failures {
            let _ = write!(h, "<li>{}</li>", text(a));
        }
        h.push_str("</ol>");
    }
    for (i, d) in f.details.iter().enumerate() {
        detail(h, d, i);
    }
    h.push_str("</section>\n");
}

/// Width of one op's column of the timeline, in pixels.
fn cell_width(n: usize) -> usize {
    match n {
        0..=60 => 16,
        61..=200 => 8,
        201..=600 => 5,
        _ => 3,
    }
}

fn timeline(h: &mut String, p: &Page) {
    let n = p.ops.len();
    let cw = cell_width(n);
    let (label_w, lane_h, top) = (90usize, 14usize, 18usize);
    let rows = 1 + p.lanes.len();
    let width = label_w + n * cw + 10;
    let height = top + rows * lane_h + 6;
    let _ = write!(
        h,
        "<section id=\"timeline\"><h2>Timeline</h2><p class=\"legend\"><span class=\"sw passed\"></span>checks passed \
         <span class=\"sw skipped\"></span>skipped <span class=\"sw failed\"></span>first divergence \
         <span class=\"sw not_run\"></span>not run · lanes: <span class=\"sw solo\"></span>admitted, alone \
         <span class=\"sw batch\"></span>in the batch · a lane ends when its request finishes</p>\
         <div class=\"scroll\"><svg id=\"timeline-svg\" xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" \
         data-cell-width=\"{cw}\">"
    );
    // Op numbers every 10 ops (every op for short traces).
    let every = if n <= 30 {
        1
    } else if n <= 300 {
        10
    } else {
        100
    };
    for i in (0..n).step_by(every) {
        let _ = write!(h, "<text class=\"opno\" x=\"{}\" y=\"12\">{i}</text>", label_w + i * cw);
    }
    let y0 = top;
    let _ = write!(h, "<text class=\"lbl\" x=\"0\" y=\"{}\">checks</text>", y0 + 11);
    for op in &p.ops {
        let _ = write!(
            h,
            "<rect id=\"cell-{i}\" class=\"cell {c}\" data-op=\"{i}\" x=\"{x}\" y=\"{y0}\" width=\"{w}\" height=\"{hh}\"><title>{t}</title></rect>",
            i = op.index,
            c = status_class(op.status),
            x = label_w + op.index * cw,
            w = cw.saturating_sub(1).max(1),
            hh = lane_h - 2,
            t = attr(&format!("op {}: {} — {}", op.index, op.kind, op.status.name()))
        );
    }
    for (k, lane) in p.lanes.iter().enumerate() {
        let y = top + (k + 1) * lane_h;
        let _ = write!(
            h,
            "<g id=\"lane-{r}\" class=\"lane\"><text class=\"lbl\" x=\"0\" y=\"{ty}\">request {r}</text>",
            r = lane.req,
            ty = y + 11
        );
        for s in &lane.spans {
            let (class, what) = match s.place {
                Place::Solo => ("solo", "alone"),
                Place::Batch => ("batch", "in the batch"),
            };
            let _ = write!(
                h,
                "<rect class=\"span {class}\" data-op=\"{from}\" x=\"{x}\" y=\"{y}\" width=\"{w}\" height=\"{hh}\"><title>{t}</title></rect>",
                from = s.from,
                x = label_w + s.from * cw,
                w = (s.to - s.from + 1) * cw - 1,
                hh = lane_h - 4,
                t = attr(&format!("request {}: {what}, ops {}..={}", lane.req, s.from, s.to))
            );
        }
        if let Some(f) = lane.finished {
            let _ = write!(
                h,
                "<text class=\"end\" x=\"{}\" y=\"{}\">✕<title>request {} is no longer live after op {f}</title></text>",
                label_w + f * cw,
                y + 10,
                lane.req
            );
        }
        h.push_str("</g>");
    }
    h.push_str("</svg></div></section>\n");
}

fn shrunk(h: &mut String, p: &Page) {
    let Some(s) = &p.shrunk else { return };
    let _ = write!(
        h,
        "<section id=\"shrunk\"><h2>Shrunk trace beside the original</h2><p>{} — {} ops to {}; the shrunk trace: {}</p><div class=\"side\">",
        text(&s.source),
        s.original.len(),
        s.shrunk.len(),
        text(&s.outcome)
    );
    for (label, ops) in [("original", &s.original), ("shrunk", &s.shrunk)] {
        let _ = write!(h, "<div><h3>{label} ({} ops)</h3><ol start=\"0\">", ops.len());
        for o in ops.iter() {
            let _ = write!(h, "<li><code>{}</code></li>", text(o));
        }
        h.push_str("</ol></div>");
    }
    h.push_str("</div></section>\n");
}

fn op_list(h: &mut String, p: &Page) {
    h.push_str("<section id=\"ops\"><h2>Ops</h2><ol start=\"0\">");
    for op in &p.ops {
        let _ = write!(
            h,
            "<li id=\"op-{i}\" class=\"{c}\" data-op=\"{i}\"><code>{t}</code> <span class=\"st\">{s}</span></li>",
            i = op.index,
            c = status_class(op.status),
            t = text(&op.text),
            s = op.status.name()
        );
    }
    h.push_str("</ol></section>\n");
}
