//! The unit tests of the diff and the rules (step geometries built by hand) and of the RESULTS parsing.

use super::*;
use crate::diff::{detail, layout_of, show};
use crate::recorder::TrimInfo;
use crate::recorder::{Outcome, Record, StepInfo, Values};
use kvsim_harness::sim::observe::Read;
use std::collections::BTreeMap;

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
    let kvsim =
        vec![rec(4, rows("a")), rec(5, Outcome::Trimmed(1)), rec(6, rows("b")), rec(7, rows("c")), rec(11, rows("d"))];
    let mut oracle =
        vec![rec(4, rows("a")), rec(5, Outcome::Trimmed(0)), rec(6, rows("B")), rec(7, rows("c")), rec(11, rows("d"))];
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
    let (out, _, _) = rows_mapped_then_decode(trim, Outcome::TrimmedRows(vec![1, 1]), Outcome::TrimmedRows(vec![0, 1]));
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
    let (_, _, uncompared) = batch_root_then_new_batch(Some(Outcome::Error("DriverError: no running batch".into())));
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
