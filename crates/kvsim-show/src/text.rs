//! The page as terminal text: the header and the command that reproduces the run, the timeline as character
//! lanes, the selected op's pictures, the failure's pictures, the shrunk trace and what is not observable.

use std::fmt::Write;

use crate::html::value_summary;
use crate::page::{Detail, FamilyView, LayerSnap, MaskPic, Page, Place, RingPic, RingSnap, Status, TokRun};

/// Ops per line of the timeline.
const WIDTH: usize = 100;

fn status_char(s: Status) -> char {
    match s {
        Status::Passed => '+',
        Status::Skipped => '-',
        Status::Failed => 'X',
        Status::NotRun => ' ',
    }
}

/// The whole text.
pub fn render(p: &Page) -> String {
    let mut t = String::new();
    let hd = &p.header;
    let _ = writeln!(t, "kvsim show {}", hd.path);
    let _ = writeln!(
        t,
        "seed {} · families {} · mutant {} · device {} · kvsim {} · MLX {} (recorded), {} (this replay)",
        hd.seed,
        hd.families.join(", "),
        hd.mutant.as_deref().unwrap_or("none"),
        hd.device,
        hd.kvsim_version,
        hd.trace_mlx_version,
        hd.replay_mlx_version
    );
    let _ = writeln!(t, "expect {} · recorded: {} · replay: {}", hd.expect, hd.recorded_outcome, hd.replay_outcome);
    if let Some(m) = &hd.mismatch {
        let _ = writeln!(t, "MISMATCH: {m}");
    }
    if !hd.note.is_empty() {
        let _ = writeln!(t, "note: {}", hd.note);
    }
    let _ = writeln!(t, "config: {}", serde_json::to_string(&hd.config).unwrap_or_default());
    let _ = writeln!(t, "reproduce: {}", p.replay_command);
    t.push('\n');
    timeline(&mut t, p);
    t.push('\n');
    let op = &p.ops[p.selected.min(p.ops.len().saturating_sub(1))];
    let _ = writeln!(t, "op {}: {} — {}", op.index, op.text, op.status.name());
    for f in &p.families {
        family(&mut t, f, op.index);
    }
    if let Some(f) = &p.failure {
        let _ = writeln!(t, "\nFIRST FAILING CHECK at op {} {}: [{}]", f.op_index, f.op_text, f.check);
        if let Some(k) = &f.family {
            let _ = writeln!(t, "  family {k}");
        }
        let _ = writeln!(t, "  {}", f.message);
        if f.all_failures.len() > 1 {
            let _ = writeln!(t, "  every check this op failed with kvsim's checks off:");
            for a in &f.all_failures {
                let _ = writeln!(t, "    {a}");
            }
        }
        for d in &f.details {
            detail(&mut t, d);
        }
    }
    if let Some(s) = &p.shrunk {
        let _ =
            writeln!(t, "\nshrunk trace ({}): {} ops -> {}; {}", s.source, s.original.len(), s.shrunk.len(), s.outcome);
        for (i, o) in s.shrunk.iter().enumerate() {
            let _ = writeln!(t, "  {i:>3} {o}");
        }
    }
    let _ = writeln!(t, "\nnot observable:");
    for u in &p.unobservable {
        let _ = writeln!(t, "  - {u}");
    }
    t
}

fn timeline(t: &mut String, p: &Page) {
    let n = p.ops.len();
    let _ =
        writeln!(t, "timeline: checks + passed, - skipped, X first divergence; lanes s alone, B in the batch, x ended");
    for start in (0..n.max(1)).step_by(WIDTH) {
        let end = (start + WIDTH).min(n);
        let mut ruler = String::new();
        for i in start..end {
            ruler.push(if i % 10 == 0 { '|' } else { ' ' });
        }
        let _ = writeln!(t, "{:<12}{ruler}  ops {start}..{}", "", end.saturating_sub(1));
        let checks: String = p.ops[start..end].iter().map(|o| status_char(o.status)).collect();
        let _ = writeln!(t, "{:<12}{checks}", "checks");
        for lane in &p.lanes {
            let mut line: Vec<char> = vec![' '; end - start];
            let mut any = false;
            for s in &lane.spans {
                for i in s.from.max(start)..=s.to.min(end.saturating_sub(1)) {
                    if i >= start && i < end {
                        line[i - start] = if s.place == Place::Batch { 'B' } else { 's' };
                        any = true;
                    }
                }
            }
            if let Some(f) = lane.finished.filter(|f| (start..end).contains(f)) {
                line[f - start] = 'x';
                any = true;
            }
            if any {
                let _ = writeln!(t, "{:<12}{}", format!("request {}", lane.req), line.into_iter().collect::<String>());
            }
        }
    }
}

fn layer_line(l: &LayerSnap, req: u32) -> String {
    if let Some(s) = &l.ssm {
        return format!(
            "conv {} #{}{} · recurrent {} #{}{}",
            s.conv,
            s.conv_digest,
            if s.conv_changed { " (changed)" } else { "" },
            s.rec,
            s.rec_digest,
            if s.rec_changed { " (changed)" } else { "" }
        );
    }
    format!("|{}| live {} · {}", cells(&l.tokens, req, None), l.len, l.storage)
}

/// Runs of columns as cells (`!` a column out of order, `*` the column the failing check names, `>` before the
/// column `head`), the middle of a very long window elided.
fn cells(runs: &[TokRun], req: u32, head: Option<usize>) -> String {
    let mut cells = vec![];
    for r in runs {
        for k in 0..r.n {
            let mark = if r.named {
                "*"
            } else if r.expected {
                ""
            } else {
                "!"
            };
            let head = if head == Some(cells.len()) { ">" } else { "" };
            cells.push(match r.kind.as_str() {
                "tok" if r.req == req => format!("{head}{mark}{}", r.pos + k),
                "tok" => format!("{head}{mark}r{}:{}", r.req, r.pos + k),
                "pad" => format!("{head}{mark}pad"),
                "zero" => format!("{head}{mark}0"),
                _ => format!("{head}{mark}?"),
            });
        }
    }
    if head == Some(cells.len()) {
        cells.push(">".into());
    }
    if cells.len() > 48 {
        let n = cells.len();
        let tail = cells.split_off(n - 24);
        cells.truncate(24);
        cells.push(format!("… {} more …", n - 48));
        cells.extend(tail);
    }
    cells.join(" ")
}

/// A ring's physical columns and numbers, then the model's where they differ.
fn ring_lines(r: &RingSnap, req: u32) -> Vec<String> {
    let order = if r.rotated { "rotated" } else { "in temporal order" };
    let last = r.last_concat.map_or(String::new(), |l| format!(", last window write {l}"));
    let pad = match (r.left_padding, r.pending) {
        (Some(p), Some(n)) => format!(" · left padding {p}, {n} prefill positions pending"),
        (Some(p), None) => format!(" · left padding {p}"),
        _ => String::new(),
    };
    let mut out = vec![format!(
        "physical |{}| offset {} len {} head {} {order}{last}{pad}",
        cells(&r.columns, req, Some(r.idx)),
        r.offset,
        r.len,
        r.idx
    )];
    match &r.model {
        None => out.push("model agrees (columns, head, offset, padding)".into()),
        Some(m) => {
            let cols: Vec<String> = m
                .columns
                .iter()
                .enumerate()
                .map(|(c, &(q, p))| {
                    let head = if c == m.idx { ">" } else { "" };
                    if q == req {
                        format!("{head}{p}")
                    } else {
                        format!("{head}r{q}:{p}")
                    }
                })
                .collect();
            let last = m.last_concat.map_or(String::new(), |l| format!(", last window write {l}"));
            let pad = m.left_padding.map_or(String::new(), |p| format!(" · left padding {p}"));
            out.push(format!(
                "model    |{}| offset {} len {} head {}{last}{pad}",
                cols.join(" "),
                m.offset,
                m.columns.len(),
                m.idx
            ));
        }
    }
    out
}

/// A mask picture: its kind, and a matrix's grid.
fn mask_lines(m: &MaskPic) -> Vec<String> {
    match m.kind.as_str() {
        "none" => vec![format!("mask of {}: none (every column visible)", m.what)],
        "causal" => vec![format!("mask of {}: MLX's bottom-right causal mask", m.what)],
        _ => {
            let mut out = vec![format!(
                "mask of {}: {} x {} queries x {} columns (# visible){}",
                m.what,
                m.rows,
                m.queries,
                m.cols,
                if m.clipped { ", clipped" } else { "" }
            )];
            for (i, g) in m.grid.iter().enumerate() {
                out.push(format!("  row {} query {}: {g}", i / m.queries.max(1), i % m.queries.max(1)));
            }
            out
        }
    }
}

fn family(t: &mut String, f: &FamilyView, i: usize) {
    let _ = writeln!(t, "family {} ({})", f.name, f.geometry);
    let Some(Some(s)) = f.ops.get(i) else {
        let _ = writeln!(t, "  nothing observed at this op");
        return;
    };
    for st in &s.stages {
        let _ = writeln!(t, "  {}; batch rows {:?}", st.source, st.batch);
        for c in &st.calls {
            let _ = writeln!(t, "    call: {c}");
        }
        for line in st.masks.iter().flat_map(mask_lines) {
            let _ = writeln!(t, "    {line}");
        }
        for r in &st.rows {
            let _ = writeln!(t, "    request {} ({}), offset {}", r.req, r.home, r.offset);
            for layer in &r.layers {
                let _ = writeln!(t, "      layer {}: {}", layer.layer, layer_line(layer, r.req));
                if !layer.planes.is_empty() {
                    let _ = writeln!(t, "        planes: {}", layer.planes.join(" · "));
                }
                for line in layer.ring.iter().flat_map(|g| ring_lines(g, r.req)) {
                    let _ = writeln!(t, "        {line}");
                }
            }
        }
    }
    if let Some(m) = &s.missing {
        let _ = writeln!(t, "  {m}");
    }
    if f.kind == "kv" {
        let _ = writeln!(
            t,
            "  (live window: temporal order, oldest first; physical: buffer order, > the write head; ! a column out of \
             the row's own order or not the model's, * the column the failing check names)"
        );
    }
}

fn ring_line(label: &str, r: &RingPic) -> String {
    let mut s = format!("  {label:<11}|");
    for (c, p) in r.columns.iter().enumerate() {
        s.push(if c == r.idx { '>' } else { ' ' });
        s.push_str(&p.map_or("·".to_string(), |p| p.to_string()));
    }
    s.push(if r.idx >= r.columns.len() { '>' } else { ' ' });
    let _ = write!(
        s,
        "|  offset {} len {} head {} {}{}",
        r.offset,
        r.len,
        r.idx,
        if r.rotated { "rotated" } else { "in temporal order" },
        r.last_concat.map_or(String::new(), |l| format!(", last window write {l}"))
    );
    s
}

fn detail(t: &mut String, d: &Detail) {
    match d {
        Detail::Rings { what, production, model, .. } => {
            let _ = writeln!(t, "  {what}");
            let _ = writeln!(t, "{}", ring_line("production", production));
            let _ = writeln!(t, "{}", ring_line("model", model));
        }
        Detail::Mask { what, width, production, model } => {
            let _ = writeln!(t, "  {what}");
            for (label, cols) in [("production", production), ("model", model)] {
                let grid: String = (0..*width).map(|c| if cols.contains(&c) { '#' } else { '.' }).collect();
                let _ = writeln!(t, "  {label:<11}{grid}");
            }
        }
        Detail::Values(v) => {
            let _ = writeln!(t, "  {}", v.what);
            for r in &v.rows {
                match (&r.expected_hex, &r.expected) {
                    (Some(eh), Some(e)) => {
                        let ulp = r
                            .ulp
                            .map_or(if r.differs { "differs" } else { "same" }.to_string(), |u| format!("{u} ULPs"));
                        let _ = writeln!(
                            t,
                            "    {:<16} {} {eh} ({e})  {} {} ({})  {ulp}",
                            r.at, v.expected_label, v.actual_label, r.actual_hex, r.actual
                        );
                    }
                    _ => {
                        let _ = writeln!(t, "    {:<16} {} {} ({})", r.at, v.actual_label, r.actual_hex, r.actual);
                    }
                }
            }
            let _ = writeln!(t, "    {}", value_summary(v));
        }
        Detail::Pairs { what, rows } => {
            let _ = writeln!(t, "  {what}");
            for (l, a, b) in rows {
                let _ = writeln!(t, "    {l}: production {a}, model {b}");
            }
        }
        Detail::Unobservable { what } => {
            let _ = writeln!(t, "  not observable: {what}");
        }
    }
}
