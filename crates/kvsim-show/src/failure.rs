//! The failure's pictures: what the failing check's message names (its row, layer, column, token, ring state,
//! mask), matched with the bytes the observer saw in the failing op (its read outputs, and the state the op left
//! when it ran to its end with kvsim's checks off).
//!
//! A check hands the run loop a name and a message only; everything here is read from those and from the observer's
//! data. A piece neither carries is listed as [`Detail::Unobservable`].

use kvsim_cache::bytes::ArrayBytes;
use kvsim_cache::RingState;
use kvsim_reference::{RefDtype, Tensor, Tok};
use kvsim_ulp::{ulp_distance, FloatFormat};
use mlx_rs::Dtype;

use crate::page::{Detail, RingPic, ValueRow, ValueTable};
use crate::watch::{column, Watcher};

/// Rows shown of a value table.
const SHOWN: usize = 8;

/// The number right after the first `key` in `s`.
pub fn num_after(s: &str, key: &str) -> Option<usize> {
    let i = s.find(key)? + key.len();
    let digits: String = s[i..].chars().take_while(|c| c.is_ascii_digit()).collect();
    digits.parse().ok()
}

/// The list `[a, b, ...]` right after the first `key` in `s` (`[]` is an empty list).
pub fn list_after(s: &str, key: &str) -> Option<Vec<usize>> {
    let i = s.find(key)? + key.len();
    let rest = s[i..].strip_prefix('[')?;
    let body = &rest[..rest.find(']')?];
    if body.trim().is_empty() {
        return Some(vec![]);
    }
    body.split(',').map(|x| x.trim().parse().ok()).collect()
}

/// `(offset, len, idx, last_concat)` right after `key`: four comma-separated fields, the last `None` or `Some(n)`.
fn ring_after(s: &str, key: &str) -> Option<RingState> {
    let i = s.find(key)? + key.len();
    let body = &s[i..];
    let body = &body[..body.find(')')? + 1];
    let body = body.strip_suffix(')')?;
    // `Some(n)` closes with its own parenthesis: take it back.
    let fields: Vec<&str> = body.split(',').map(str::trim).collect();
    let (offset, len, idx) =
        (fields.first()?.parse().ok()?, fields.get(1)?.parse().ok()?, fields.get(2)?.parse().ok()?);
    let last = *fields.get(3)?;
    let last_concat = if last == "None" { None } else { last.strip_prefix("Some(")?.parse().ok() };
    Some(RingState { offset, len, idx, last_concat })
}

fn ring_pic(s: &RingState, window: Option<usize>) -> RingPic {
    let width = window.unwrap_or(s.len).max(s.len);
    let pos = if s.len <= s.offset && s.idx <= s.len { s.positions() } else { vec![] };
    RingPic {
        offset: s.offset,
        len: s.len,
        idx: s.idx,
        last_concat: s.last_concat,
        rotated: s.is_rotated(),
        columns: (0..width).map(|c| pos.get(c).copied()).collect(),
    }
}

/// `(request a, position b)` right after `key`.
fn tok_after(s: &str, key: &str) -> Option<Tok> {
    let i = s.find(key)? + key.len();
    let rest = &s[i..];
    let req = num_after(rest, "(request ")? as u32;
    let pos = num_after(rest, "position ")? as u32;
    Some(Tok::new(req, pos))
}

fn format_of(d: Dtype) -> Option<FloatFormat> {
    match d {
        Dtype::Bfloat16 => Some(FloatFormat::Bf16),
        Dtype::Float32 => Some(FloatFormat::F32),
        Dtype::Float16 => Some(FloatFormat::F16),
        _ => None,
    }
}

fn value_of(format: Option<FloatFormat>, w: u64) -> String {
    match format {
        Some(FloatFormat::Bf16) => format!("{}", f32::from_bits((w as u32) << 16)),
        Some(FloatFormat::F32) => format!("{}", f32::from_bits(w as u32)),
        _ => format!("{w}"),
    }
}

fn hex_of(format: Option<FloatFormat>, w: u64) -> String {
    match format {
        Some(FloatFormat::Bf16) | Some(FloatFormat::F16) => format!("0x{w:04x}"),
        _ => format!("0x{w:08x}"),
    }
}

fn dtype_name(d: Dtype) -> String {
    match d {
        Dtype::Bfloat16 => "bf16".into(),
        Dtype::Float32 => "f32".into(),
        Dtype::Uint32 => "u32".into(),
        other => format!("{other:?}").to_lowercase(),
    }
}

/// Expected against actual words of one dtype: the differing elements first, then the others, `SHOWN` in all.
/// Elements are labelled `head h <noun> i` for rows of `heads_dim.1` elements per head.
fn compare(
    what: String,
    dtype: Dtype,
    labels: (&str, &str),
    (heads_dim, noun): ((usize, usize), &str),
    exp: &[u32],
    act: &[u32],
) -> ValueTable {
    let format = format_of(dtype);
    let at = |i: usize| format!("head {} {noun} {}", i / heads_dim.1.max(1), i % heads_dim.1.max(1));
    let n = exp.len().min(act.len());
    let ulp = |i: usize| format.map(|f| ulp_distance(f, exp[i] as u64, act[i] as u64));
    let differing: Vec<usize> = (0..n).filter(|&i| exp[i] != act[i]).collect();
    let same = (0..n).filter(|&i| exp[i] == act[i]);
    let rows = differing
        .iter()
        .copied()
        .chain(same)
        .take(SHOWN)
        .map(|i| ValueRow {
            at: at(i),
            expected_hex: Some(hex_of(format, exp[i] as u64)),
            expected: Some(value_of(format, exp[i] as u64)),
            actual_hex: hex_of(format, act[i] as u64),
            actual: value_of(format, act[i] as u64),
            ulp: ulp(i),
            differs: exp[i] != act[i],
        })
        .collect();
    let max_ulp = (0..n).filter_map(ulp).max();
    ValueTable {
        what,
        dtype: dtype_name(dtype),
        expected_label: labels.0.into(),
        actual_label: labels.1.into(),
        rows,
        total: n,
        differing: Some(differing.len() + exp.len().abs_diff(act.len())),
        max_ulp: if format.is_some() { max_ulp } else { None },
    }
}

/// The first elements of an array the check compared against something the observer does not see.
fn actual_only(what: String, ab: &ArrayBytes, start: usize, count: usize, dims: &[usize]) -> ValueTable {
    let format = format_of(ab.dtype);
    let total = ab.words.len();
    let at = |i: usize| {
        let mut rest = i;
        let mut idx = vec![0; dims.len()];
        for k in (0..dims.len()).rev() {
            idx[k] = rest % dims[k].max(1);
            rest /= dims[k].max(1);
        }
        format!("{idx:?}")
    };
    let rows = (start..(start + count).min(total))
        .take(SHOWN)
        .map(|i| {
            let w = ab.words.get(i);
            ValueRow {
                at: at(i),
                expected_hex: None,
                expected: None,
                actual_hex: hex_of(format, w),
                actual: value_of(format, w),
                ulp: None,
                differs: false,
            }
        })
        .collect();
    ValueTable {
        what,
        dtype: dtype_name(ab.dtype),
        expected_label: String::new(),
        actual_label: "production".into(),
        rows,
        total: count.min(total.saturating_sub(start)),
        differing: None,
        max_ulp: None,
    }
}

/// Everything the failure's message and the failing op's observed bytes let the page draw.
pub fn details(check: &str, message: &str, window: Option<usize>, watcher: Option<&Watcher>) -> Vec<Detail> {
    let mut out = vec![];
    let who = message.split(':').next().unwrap_or("").to_string();
    match check {
        "ring_state" => {
            if let (Some(p), Some(m)) = (ring_after(message, "= ("), ring_after(message, "model (")) {
                out.push(Detail::Rings {
                    what: format!("{who}: the ring's physical columns (position each holds; > marks the write head)"),
                    window,
                    production: ring_pic(&p, window),
                    model: ring_pic(&m, window),
                });
            }
        }
        "mask" => {
            if let (Some(p), Some(m)) =
                (list_after(message, "mask shows columns "), list_after(message, "model expects "))
            {
                let width = p.iter().chain(&m).copied().max().map_or(0, |x| x + 1);
                let kind = message.rsplit('(').next().and_then(|k| k.strip_suffix(')')).unwrap_or("");
                out.push(Detail::Mask {
                    what: format!("{who} ({kind}): visible key columns"),
                    width,
                    production: p,
                    model: m,
                });
            }
        }
        "layout" => {
            // The checks name a physical column of the buffer or a column of the temporal view; both are handed
            // to observers (the ring's live columns and the temporal view).
            layout(message, &who, watcher, &mut out);
        }
        "left_padding" => {
            if let (Some(p), Some(m)) = (list_after(message, "left_padding "), list_after(message, "model ")) {
                let rows =
                    (0..p.len().max(m.len())).map(|r| (format!("row {r}"), opt(p.get(r)), opt(m.get(r)))).collect();
                out.push(Detail::Pairs { what: "left padding per batch row".into(), rows });
            }
        }
        "ssm_offsets" => {
            let fields = ["production ", "twin ", "model ", "fed "];
            let rows: Vec<(String, String, String)> = fields
                .iter()
                .filter_map(|f| num_after(message, f).map(|n| (f.trim().to_string(), n.to_string())))
                .map(|(f, n)| (f, n, String::new()))
                .collect();
            if !rows.is_empty() {
                let model = num_after(message, "model ").map(|n| n.to_string()).unwrap_or_default();
                let rows = rows.into_iter().map(|(f, n, _)| (f, n, model.clone())).collect();
                out.push(Detail::Pairs { what: format!("{who}: positions fed to the recurrent state"), rows });
            }
        }
        _ => {}
    }
    if out.is_empty() {
        generic_pair(message, &who, &mut out);
    }
    if check.contains("vs_solo") || check.contains("output") || check.contains("vs_twin") || check.contains("vs_fresh")
    {
        observed_output(check, message, watcher, &mut out);
    }
    out
}

fn opt(x: Option<&usize>) -> String {
    x.map_or("-".into(), |x| x.to_string())
}

/// `A, model B` / `A, the model says B` / `A, the model B`: production's value and the model's, side by side.
fn generic_pair(message: &str, who: &str, out: &mut Vec<Detail>) {
    for sep in [", the model says ", ", the model ", ", model "] {
        if let Some(i) = message.find(sep) {
            let before = &message[..i];
            let prod = before.rsplit(": ").next().unwrap_or(before).trim();
            let model = message[i + sep.len()..].trim();
            let label = if before.contains(": ") { who.to_string() } else { "value".to_string() };
            out.push(Detail::Pairs {
                what: "production against the model".into(),
                rows: vec![(label, prod.into(), model.into())],
            });
            return;
        }
    }
}

/// `layout`: the column the check names, the expected token's bytes (from the self-identifying value space)
/// against the bytes production's state holds there after the op.
fn layout(message: &str, who: &str, watcher: Option<&Watcher>, out: &mut Vec<Detail>) {
    let Some(w) = watcher else { return };
    let req = num_after(message, "request ").map(|r| r as u32);
    let layer = num_after(message, "layer ");
    let col = num_after(message, "column ");
    let tensor = if message.contains(" V ") || message.contains(" V column") { Tensor::V } else { Tensor::K };
    let packed = message.contains("packed column");
    let expected = tok_after(message, "expected token").or_else(|| tok_after(message, "triple of token"));
    let (Some(req), Some(layer), Some(col), Some(tok)) = (req, layer, col, expected) else { return };
    let Some(raw) = w.raw.get(&req) else {
        out.push(Detail::Unobservable {
            what: format!("Request {req}'s state after the failing op was not handed over (the op stopped early)."),
        });
        return;
    };
    let heads_dim = (w.vs.heads_kv, w.vs.head_dim);
    let t = tensor.name();
    if packed {
        let (Some(q), Some(planes)) = (w.quant, raw.planes.get(layer)) else { return };
        let plane = if tensor == Tensor::K { 0 } else { 3 };
        let physical =
            if tensor == Tensor::K { raw.rings.get(layer).map(|r| &r.0) } else { raw.rings.get(layer).map(|r| &r.1) };
        let view = if message.contains("temporal_view") { planes.get(plane) } else { physical };
        let Some(ab) = view else { return };
        let exp = kvsim_reference::quant::quantized_column(&w.vs, layer as u32, tensor, tok, q).packed.clone();
        let act = column(ab, col);
        let words = exp.len() / heads_dim.0.max(1);
        out.push(Detail::Values(compare(
            format!(
                "{who}: the {t} packed words of token (request {}, position {}) against production's",
                tok.req, tok.pos
            ),
            ab.dtype,
            ("expected", "production"),
            ((heads_dim.0, words), "word"),
            &exp,
            &act,
        )));
        return;
    }
    // `... temporal_view K column c`: the view; otherwise column `c` of the buffer's live physical columns.
    let source = if message.contains("temporal_view") { raw.layers.get(layer) } else { raw.rings.get(layer) };
    let Some((k, v)) = source else { return };
    let ab = if tensor == Tensor::K { k } else { v };
    let exp = w.vs.column_bits(layer as u32, tensor, tok);
    let act = column(ab, col);
    let dtype = if w.vs.dtype == RefDtype::Bf16 { Dtype::Bfloat16 } else { Dtype::Float32 };
    out.push(Detail::Values(compare(
        format!(
            "{who}, every head and dim: the bytes of token (request {}, position {}) against those production holds \
             there after the op",
            tok.req, tok.pos
        ),
        dtype,
        ("expected", "production"),
        (heads_dim, "dim"),
        &exp,
        &act,
    )));
}

/// Output and state checks against a twin or a fresh run: production's side is observed (the read's output in the
/// failing op, the state it left); the other side is not.
fn observed_output(check: &str, message: &str, watcher: Option<&Watcher>, out: &mut Vec<Detail>) {
    let Some(w) = watcher else { return };
    let row = num_after(message, "row ");
    let layer = num_after(message, "layer ");
    let state = message.contains("state");
    let other = if check.contains("model") {
        "the f64 model's output"
    } else if check.contains("fresh") {
        "the fresh prefix run's state"
    } else if state {
        "the solo twin's state"
    } else {
        "the solo twin's output"
    };
    if state && w.ssm {
        let (Some(row), Some(layer)) = (row, layer) else { return };
        let Some(&req) = w.ssm_rows.get(row) else { return };
        let k = w.ssm_layers.iter().position(|&l| l == layer).unwrap_or(layer);
        if let Some((conv, rec)) = w.raw.get(&req).and_then(|r| r.layers.get(k)) {
            let (ab, name) = if message.contains("conv") { (conv, "conv") } else { (rec, "recurrent") };
            let dims: Vec<usize> = ab.shape.iter().map(|&x| x.max(0) as usize).collect();
            out.push(Detail::Values(actual_only(
                format!(
                    "layer {layer} row {row} (request {req}): production's {name} state after the op, {}",
                    crate::watch::describe(ab)
                ),
                ab,
                0,
                ab.words.len(),
                &dims,
            )));
        }
        out.push(Detail::Unobservable {
            what: format!("{other} is not handed to observers: only production's side is shown."),
        });
        return;
    }
    // `solo request R ...` names a request alone (its one-row read); `row R ...` a row of the batch.
    let solo = message.starts_with("solo request ").then(|| num_after(message, "solo request ")).flatten();
    let row = if solo.is_some() { Some(0) } else { row };
    let Some(row) = row else { return };
    let rec = w.outs.iter().rev().find(|o| {
        layer.is_none_or(|l| o.layer == l)
            && row < o.reqs.len()
            && o.bytes.shape.len() == 4
            && match solo {
                Some(r) => !o.batch && o.reqs[0] == r as u32,
                None => o.batch,
            }
    });
    // A read checked against its twin, or against the f64 model (then the twin's same read is shown beside it).
    let twin_read = !check.contains("fresh") && !state;
    if let Some(o) = rec {
        let dims: Vec<usize> = o.bytes.shape.iter().map(|&x| x.max(0) as usize).collect();
        let per_row: usize = dims[1..].iter().product();
        if let Some(t) = o.twins.get(row).filter(|t| twin_read && t.words.len() == per_row && t.dtype == o.bytes.dtype)
        {
            let act: Vec<u32> = (0..per_row).map(|i| o.bytes.words.get(row * per_row + i) as u32).collect();
            let exp: Vec<u32> = (0..per_row).map(|i| t.words.get(i) as u32).collect();
            let per_head = dims[2] * dims[3];
            out.push(Detail::Values(compare(
                format!(
                    "row {row} (request {}): the op's last read on layer {}, {}: production's output against its solo \
                     twin's (element j of a head: query j / D, dim j % D)",
                    o.reqs[row],
                    o.layer,
                    crate::watch::describe(&o.bytes)
                ),
                o.bytes.dtype,
                ("solo twin", "production"),
                ((dims[1], per_head), "element"),
                &exp,
                &act,
            )));
            if check.contains("model") {
                out.push(Detail::Unobservable {
                    what: format!("{other} is not handed to observers: the solo twin's same read is shown instead."),
                });
            }
            return;
        }
        out.push(Detail::Values(actual_only(
            format!(
                "row {row} (request {}): production's output of the op's last read on layer {}, {} (first elements of the row)",
                o.reqs[row],
                o.layer,
                crate::watch::describe(&o.bytes)
            ),
            &o.bytes,
            row * per_row,
            per_row,
            &dims,
        )));
    }
    out.push(Detail::Unobservable {
        what: format!("{other} is not handed to observers (the check compares it inside the family): only production's side is shown."),
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_what_the_checks_print() {
        let m =
            "row 0 (request 1) layer 0: (offset, len, idx, last_concat) = (3, 2, 2, None), model (3, 2, 1, Some(2))";
        let p = ring_after(m, "= (").unwrap();
        assert_eq!((p.offset, p.len, p.idx, p.last_concat), (3, 2, 2, None));
        let q = ring_after(m, "model (").unwrap();
        assert_eq!((q.offset, q.len, q.idx, q.last_concat), (3, 2, 1, Some(2)));
        let m = "Window read, row 0, query 0: mask shows columns [1, 2, 3], model expects [] (array mask)";
        assert_eq!(list_after(m, "mask shows columns "), Some(vec![1, 2, 3]));
        assert_eq!(list_after(m, "model expects "), Some(vec![]));
        let m = "row 0 (request 0) layer 0 temporal_view K column 3: expected token (request 0, position 1), found";
        assert_eq!(tok_after(m, "expected token"), Some(Tok::new(0, 1)));
        assert_eq!(num_after(m, "column "), Some(3));
        let m = "solo request 0 layer 0: (offset, len, idx, last_concat) = (7, 5, 2, None), model (7, 5, 5, None)";
        let d = details("ring_state", m, Some(5), None);
        let Detail::Rings { production, model, .. } = &d[0] else { panic!("{d:?}") };
        assert!(production.rotated && !model.rotated);
        // Rotated at 2: columns 2.. hold the oldest positions (2, 3, 4), columns 0, 1 the newest (5, 6).
        assert_eq!(production.columns, vec![Some(5), Some(6), Some(2), Some(3), Some(4)]);
        assert_eq!(model.columns, vec![Some(2), Some(3), Some(4), Some(5), Some(6)]);
    }

    #[test]
    fn compares_bits_with_ulp_distances() {
        let (e, a) = ([0x3f80, 0x3f80, 0, 1], [0x3f80, 0x3f82, 0, 1]);
        let t = compare("x".into(), Dtype::Bfloat16, ("e", "a"), ((1, 4), "dim"), &e, &a);
        assert_eq!((t.total, t.differing, t.max_ulp), (4, Some(1), Some(2)));
        assert_eq!(t.rows[0].at, "head 0 dim 1");
        assert_eq!((t.rows[0].expected.as_deref(), t.rows[0].actual_hex.as_str()), (Some("1"), "0x3f82"));
        assert!(t.rows[0].differs && !t.rows[1].differs);
        // Packed words are no floating-point values: no ULPs.
        let t = compare("x".into(), Dtype::Uint32, ("e", "a"), ((1, 4), "word"), &e, &a);
        assert_eq!((t.differing, t.max_ulp, t.rows[0].ulp), (Some(1), None, None));
    }
}
