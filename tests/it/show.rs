//! `kvsim show`: the pages of corpus traces, snapshotted structurally (the page's text and element ids, and the data
//! its script draws the per-op pictures from; not pixels), and what the page must hold: the failing cell marked,
//! the failure's pictures, nothing loaded from outside. `.ci/browser-check` opens the same pages in Chromium.

use std::process::Command;

use kvsim::show::{self, page::Detail, page::Status, Options};
use kvsim::sim::trace::Trace;
use kvsim::sim::DeviceChoice;

fn options(path: &str, shrink: Option<usize>) -> Options {
    Options {
        path: path.to_string(),
        device: DeviceChoice::Cpu,
        op: None,
        shrink,
        shrunk: None,
        kvsim_version: env!("CARGO_PKG_VERSION").to_string(),
        html: Some("target/show/page.html".to_string()),
    }
}

fn page(path: &str, shrink: Option<usize>) -> show::page::Page {
    let trace = Trace::load(std::path::Path::new(path)).expect("a corpus trace loads");
    show::build(&trace, &options(path, shrink)).expect("the page builds")
}

fn unescape(s: &str) -> String {
    s.replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", "\"").replace("&#x27;", "'").replace("&amp;", "&")
}

/// The page's structure: one line per element id (`#id`, in document order) and per text node (collapsed
/// whitespace), outside scripts and styles; then the script's data, pretty-printed.
fn outline(html: &str) -> String {
    let mut out = String::new();
    let mut data = None;
    let mut rest = html;
    while let Some(lt) = rest.find('<') {
        let text = rest[..lt].split_whitespace().collect::<Vec<_>>().join(" ");
        if !text.is_empty() {
            out.push_str(&unescape(&text));
            out.push('\n');
        }
        let gt = rest[lt..].find('>').expect("every tag closes") + lt;
        let tag = &rest[lt + 1..gt];
        if let Some(i) = tag.find(" id=\"") {
            let id = &tag[i + 5..];
            out.push_str(&format!("#{}\n", &id[..id.find('"').expect("the id's quote closes")]));
        }
        rest = &rest[gt + 1..];
        for raw in ["script", "style"] {
            if tag.starts_with(raw) {
                let end = rest.find(&format!("</{raw}>")).expect("a raw-text element closes");
                if tag.contains("id=\"kvsim-data\"") {
                    data = Some(rest[..end].to_string());
                }
                rest = &rest[end..];
            }
        }
    }
    let data = data.expect("the page embeds its data");
    let v: serde_json::Value = serde_json::from_str(&data).expect("the embedded data is JSON");
    out.push_str("--- data ---\n");
    out.push_str(&serde_json::to_string_pretty(&v).unwrap());
    out
}

#[test]
fn the_page_of_a_passing_trace() {
    let path = "corpus/seed-234-end-prefill-commits-uncommitted.json";
    let t = Trace::load(std::path::Path::new(path)).unwrap();
    assert_eq!(t.expect, kvsim::sim::trace::Expect::Pass, "the passing example must expect to pass");
    let p = page(path, None);
    assert!(p.failure.is_none());
    assert!(p.ops.iter().all(|o| o.status == Status::Passed || o.status == Status::Skipped));
    let html = show::html::render(&p);
    assert!(html.contains("No failing check"));
    insta::assert_snapshot!("show_pass_seed_234", outline(&html));
}

#[test]
fn the_page_of_a_caught_mutant_marks_its_first_failure() {
    let path = "corpus/mutant-temporal-head.json";
    let p = page(path, Some(200));
    let f = p.failure.as_ref().expect("the mutant's trace fails");
    assert_eq!((f.op_index, f.check.as_str()), (6, "layout"));
    assert_eq!(p.selected, 6, "the page opens at the failing op");
    let failed: Vec<usize> = p.ops.iter().filter(|o| o.status == Status::Failed).map(|o| o.index).collect();
    assert_eq!(failed, vec![6], "exactly the first divergence is red");
    // Expected against actual bytes of the column the check names, with ULP distances.
    let values = f.details.iter().find_map(|d| match d {
        Detail::Values(v) => Some(v),
        _ => None,
    });
    let v = values.expect("a layout failure shows the column's bytes");
    assert!(v.max_ulp.is_some_and(|u| u > 0) && v.differing.is_some_and(|d| d > 0), "{v:?}");
    assert!(v.rows.iter().all(|r| r.expected_hex.as_deref().is_some_and(|h| h.starts_with("0x"))));
    // The failing op's state, run to its end with the checks off, marks the named column.
    let fam = &p.families[0];
    let snap = fam.ops[6].as_ref().expect("the failing op was observed");
    let last = snap.stages.iter().rev().find(|s| !s.rows.is_empty()).unwrap();
    assert!(last.source.contains("checks off"), "{}", last.source);
    assert!(last.rows[0].layers[0].tokens.iter().any(|r| r.named));
    assert!(p.shrunk.as_ref().is_some_and(|s| s.shrunk.len() <= s.original.len()));
    let html = show::html::render(&p);
    assert!(html.contains("<rect id=\"cell-6\" class=\"cell failed\""));
    insta::assert_snapshot!("show_mutant_temporal_head", outline(&html));
}

#[test]
fn the_page_of_a_recurrent_mutant() {
    let path = "corpus/mutant-ssm-conv-tail-at-padded-end.json";
    let p = page(path, None);
    let f = p.failure.as_ref().expect("the mutant's trace fails");
    assert_eq!(f.check, "ssm_state_vs_twin");
    let ssm = p.families.iter().find(|f| f.kind == "ssm").expect("the recurrent family is watched");
    let snap = ssm.ops[f.op_index].as_ref().expect("the failing op was observed");
    let calls: Vec<&String> = snap.stages.iter().flat_map(|s| &s.calls).collect();
    assert!(calls.iter().any(|c| c.starts_with("prepare lengths")), "{calls:?}");
    let rows = &snap.stages.last().unwrap().rows;
    assert!(rows.iter().all(|r| r.layers.iter().all(|l| l.ssm.is_some())));
    // A hybrid run's recurrent layers are named by the model's layer index.
    assert!(rows[0].layers.iter().map(|l| l.layer).eq([0, 2]), "{:?}", rows[0].layers);
    assert!(f.details.iter().any(|d| matches!(d, Detail::Unobservable { .. })), "the twin's side is said unobservable");
    insta::assert_snapshot!("show_mutant_ssm_conv_tail", outline(&show::html::render(&p)));
}

#[test]
fn the_page_loads_nothing_from_outside() {
    let html = show::html::render(&page("corpus/mutant-adopt-drops-phase.json", None));
    for banned in ["<link", " src=", "url(", "@import", "<iframe", "fetch(", "XMLHttpRequest"] {
        assert!(!html.contains(banned), "the page holds {banned:?}");
    }
    // The one address in the page is the SVG namespace (a name, never fetched).
    let urls: Vec<&str> = html.match_indices("http").map(|(i, _)| &html[i..(i + 26).min(html.len())]).collect();
    assert!(urls.iter().all(|u| u.starts_with("http://www.w3.org/2000/svg")), "{urls:?}");
}

#[test]
fn a_ring_state_failure_draws_both_rings() {
    let p = page("corpus/mutant-adopt-drops-phase.json", None);
    let f = p.failure.as_ref().unwrap();
    let Some(Detail::Rings { production, model, .. }) = f.details.first() else { panic!("{:?}", f.details) };
    // Production kept the ring in temporal order; the model's is rotated at column 1.
    assert_eq!((production.rotated, model.rotated), (false, true));
    assert_eq!(production.columns, vec![Some(1), Some(2)]);
    assert_eq!(model.columns, vec![Some(2), Some(1)]);
}

fn kvsim(args: &[&str]) -> (String, bool) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvsim")).args(args).output().expect("kvsim runs");
    (String::from_utf8_lossy(&out.stdout).into_owned(), out.status.success())
}

#[test]
fn the_command_line_draws_text_and_pages_and_replay_points_at_it() {
    let (text, ok) = kvsim(&["show", "corpus/mutant-adopt-drops-phase.json"]);
    assert!(ok, "{text}");
    assert!(text.contains("production | 1 2>|") && text.contains("model      | 2>1 |"), "{text}");
    assert!(text.contains("reproduce: kvsim replay corpus/mutant-adopt-drops-phase.json"), "{text}");
    let dir = std::env::temp_dir().join(format!("kvsim-show-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("page.html");
    let (said, ok) = kvsim(&["show", "corpus/mutant-temporal-head.json", "--html", out.to_str().unwrap(), "--op", "3"]);
    assert!(ok, "{said}");
    let html = std::fs::read_to_string(&out).unwrap();
    assert!(html.contains("<body data-selected=\"3\">"), "--op preselects the op");
    let _ = std::fs::remove_dir_all(&dir);
    // A failing replay says how to see it; a passing one does not.
    let (said, _) = kvsim(&["replay", "corpus/mutant-temporal-head.json"]);
    let want = "see it: kvsim show corpus/mutant-temporal-head.json --html corpus/mutant-temporal-head.html";
    assert!(said.contains(want), "{said}");
    let (said, ok) = kvsim(&["replay", "corpus/seed-234-end-prefill-commits-uncommitted.json"]);
    assert!(ok && !said.contains("see it:"), "{said}");
}

/// The rings of one family's last stage of op `i` (`(request, layer) -> ring`).
fn rings_at(p: &show::page::Page, family: &str, i: usize) -> Vec<(u32, show::page::RingSnap)> {
    let fam = p.families.iter().find(|f| f.name == family).expect("the family is watched");
    let snap = fam.ops[i].as_ref().expect("the op was observed");
    let st = snap.stages.iter().rev().find(|s| !s.rows.is_empty()).expect("a state was handed over");
    st.rows
        .iter()
        .flat_map(|r| r.layers.iter().map(move |l| (r.req, l.ring.clone().expect("a ring per layer"))))
        .collect()
}

#[test]
fn rings_are_drawn_physically_beside_the_model_and_differences_are_marked() {
    let p = page("corpus/mutant-merge-slices-by-offset.json", None);
    // Before the failing merge every ring agrees with its model.
    for i in 0..6 {
        if p.families[0].ops[i].is_some() {
            assert!(rings_at(&p, "attention", i).iter().all(|(_, g)| g.model.is_none()), "op {i}");
        }
    }
    // The merge recorded request 4's slice of 5 as 6 columns: production's ring holds a column the model's does not.
    let rings = rings_at(&p, "attention", 6);
    let (_, g) = rings.iter().find(|(r, _)| *r == 4).expect("request 4 is in the batch");
    let m = g.model.as_ref().expect("the model's ring differs and is drawn");
    assert_eq!((g.len, m.columns.len()), (6, 5));
    assert_eq!((g.left_padding, m.left_padding), (Some(0), Some(1)));
    assert!(g.columns.iter().any(|r| !r.expected), "the stray column is marked: {:?}", g.columns);
    assert!(m.columns.iter().all(|&(req, _)| req == 4));
}

#[test]
fn every_read_hands_over_its_mask() {
    // The mutant reads a batch of unequal rows with no mask: the page shows it.
    let p = page("corpus/mutant-mask-ignores-padding.json", None);
    let f = p.failure.as_ref().unwrap();
    let snap = p.families[0].ops[f.op_index].as_ref().unwrap();
    let kinds: Vec<&str> = snap.stages.iter().flat_map(|s| &s.masks).map(|m| m.kind.as_str()).collect();
    assert!(!kinds.is_empty() && kinds.iter().all(|k| *k == "none"), "{kinds:?}");
    // A window read's matrix: the grid of query 0 is the columns the failing check says production's mask shows.
    let p = page("corpus/mutant-concat-keeps-window.json", None);
    let f = p.failure.as_ref().unwrap();
    assert!(f.message.contains("mask shows columns [1, 2, 3, 4, 5]"), "{}", f.message);
    let snap = p.families[0].ops[f.op_index].as_ref().unwrap();
    let m = snap.stages.iter().flat_map(|s| &s.masks).find(|m| m.kind == "matrix").expect("a matrix mask");
    assert_eq!(m.grid[0], ".#####", "{m:?}");
    assert!(m.what.contains("batch window"), "{}", m.what);
}

#[test]
fn an_output_failure_shows_production_against_the_twin_in_bytes() {
    let p = page("corpus/mutant-decode-key-order.json", None);
    let f = p.failure.as_ref().unwrap();
    assert_eq!(f.check, "decode_vs_solo");
    let v = f
        .details
        .iter()
        .find_map(|d| match d {
            Detail::Values(v) if v.expected_label == "solo twin" => Some(v),
            _ => None,
        })
        .expect("the twin's output is compared");
    // The message says 1 ULP: the table finds the same distance over every element of the row.
    assert_eq!(v.max_ulp, Some(1), "{v:?}");
    assert!(v.differing.is_some_and(|d| d > 0) && v.rows[0].differs);
    assert!(!f.details.iter().any(|d| matches!(d, Detail::Unobservable { .. })), "{:?}", f.details);
}

#[test]
fn the_bf16_first_rows_describe_their_storage_per_request() {
    // Op 2: request 0 converted at offset 0 (affine), request 1 still holds nothing (bf16).
    let p = page("corpus/mutant-tkv-pack-before-all-converted.json", None);
    let fam = p.families.iter().find(|f| f.name == "transition").expect("the rows family is watched");
    let st = fam.ops[2].as_ref().unwrap().stages.last().unwrap();
    let r0 = st.rows.iter().find(|r| r.req == 0).unwrap();
    let l = &r0.layers[0];
    assert!(l.storage.starts_with("affine 5-bit"), "{}", l.storage);
    assert_eq!(l.planes.len(), 6);
    assert!(l.tokens.iter().all(|t| t.kind == "tok" && t.expected), "packed columns identified: {:?}", l.tokens);
    assert!(l.ring.as_ref().is_some_and(|g| g.model.is_none() && g.columns.iter().all(|c| c.expected)));
    let r1 = st.rows.iter().find(|r| r.req == 1).unwrap();
    assert_eq!(r1.layers[0].storage, "plain");
}
