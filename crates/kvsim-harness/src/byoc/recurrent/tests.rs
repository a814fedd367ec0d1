//! The recurrent checker against a recurrent cache written for the purpose (Python, standard library only, no MLX:
//! it keeps each row's state arrays as the bytes kvsim sent): the correct cache passes every seed, and each bug
//! planted in it is caught by the check that names it and shrunk.

use std::time::Duration;

use super::*;
use crate::byoc::engine::Engine;
use crate::byoc::engine_check::check_engine;
use crate::byoc::CheckOptions;

const FAKE_RECURRENT: &str = r#"
import base64, json, sys
mode = sys.argv[1]
def send(o):
    sys.stdout.write(json.dumps(o) + "\n"); sys.stdout.flush()
C, L = {}, {}
def enc(raw, shape):
    return None if raw is None else {"dtype": L["dtype"], "shape": shape, "b64": base64.b64encode(raw).decode()}
def state(row):
    return {"arrays": [enc(x, a["shape"]) for x, a in zip(row, L["arrays"])]}
def handle(r):
    op = r["op"]
    if op == "hello":
        return {"protocol": 2, "engine": "fake-recurrent", "version": mode,
                "supports": {"kv": False, "recurrent": True, "rec_spec": True, "rec_prefill": True}}
    if op == "reset":
        C.clear(); return {}
    if op == "rec_new":
        L.update(arrays=r["arrays"], dtype=r["dtype"])
        C[r["id"]] = {"rows": [[None] * len(r["arrays"])], "spec": None}; return {}
    if op == "rec_write":
        c = C[r["id"]]; rows = c["rows"]; dec = []
        for s in r["states"]:
            b_, n = s["shape"][0], s["shape"][1]
            if b_ != len(rows):
                raise ValueError(f"{b_} rows written to a cache of {len(rows)}")
            raw = base64.b64decode(s["b64"]); per = len(raw) // (b_ * n)
            dec.append([[raw[(b * n + t) * per:(b * n + t + 1) * per] for t in range(n)] for b in range(b_)])
        left = c.get("left")
        for b in range(len(rows)):
            for t in range(n):
                step = [d[b][t] for d in dec]
                if c["spec"] is not None:
                    c["spec"]["steps"][b].append(step)
                if left is None or mode == "prefill_unmasked" or t < left[b]:
                    rows[b] = list(step)
        if left is not None:
            c["left"] = [x - n for x in left]
        return {}
    if op == "rec_prepare":
        C[r["id"]]["left"] = list(r["lengths"]); return {}
    if op == "rec_finalize":
        C[r["id"]].pop("left", None); return {}
    if op == "rec_merge":
        rows = [C.pop(i)["rows"][0] for i in r["rows"]]
        if mode == "merge_drops_empty":
            rows = [x for x in rows if x[0] is not None]
        C[r["id"]] = {"rows": rows, "spec": None}; return {}
    if op == "rec_extend":
        C[r["id"]]["rows"] += C.pop(r["other"])["rows"]; return {}
    if op == "rec_filter":
        c, keep = C[r["id"]], list(r["keep"])
        if mode == "filter_neighbour" and keep and keep[0] + 1 < len(c["rows"]) and keep[0] + 1 not in keep:
            keep[0] += 1
        c["rows"] = [c["rows"][k] for k in keep]; return {}
    if op == "rec_extract":
        c, row = C[r["id"]], r["row"]
        if not 0 <= row < len(c["rows"]):
            if mode != "missing_row_empty":
                raise IndexError(f"row {row} of {len(c['rows'])}")
            C[r["new"]] = {"rows": [], "spec": None}; return {}
        if mode == "extract_wrong_row" and len(c["rows"]) > 1:
            row = (row + 1) % len(c["rows"])
        C[r["new"]] = {"rows": [list(c["rows"][row])], "spec": None}; return {}
    if op == "rec_state":
        return state(C[r["id"]]["rows"][0])
    if op == "rec_rows_state":
        return state(C[r["id"]]["rows"][r["row"]])
    if op == "rec_rows_info":
        return {"rows": len(C[r["id"]]["rows"])}
    if op == "rec_spec_start":
        c = C[r["id"]]
        c["spec"] = {"n": r["n"], "init": [list(x) for x in c["rows"]], "steps": [[] for _ in c["rows"]]}
        return {}
    if op == "rec_spec_commit":
        c = C[r["id"]]; sp = c["spec"]
        for b, a in enumerate(r["accept"]):
            keep = min(a + 1, sp["n"]) if mode == "commit_one_more" else a
            c["rows"][b] = list(sp["init"][b]) if keep == 0 else list(sp["steps"][b][keep - 1])
        c["spec"] = None; return {}
    if op == "rec_spec_abort":
        c = C[r["id"]]; c["rows"] = c["spec"]["init"]; c["spec"] = None; return {}
    raise NotImplementedError(op)
for line in sys.stdin:
    r = json.loads(line)
    try:
        out = handle(r); out["ok"] = True
    except Exception as e:
        out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    send(out)
"#;

fn command(mode: &str) -> (String, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("kvsim-fake-recurrent-{}-{mode}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = dir.join("recurrent.py");
    std::fs::write(&script, FAKE_RECURRENT).unwrap();
    (format!("exec python3 {} {mode}", script.display()), dir)
}

#[test]
fn a_correct_recurrent_cache_passes_every_seed() {
    let (cmd, dir) = command("correct");
    let opts = CheckOptions { seeds: 60, ops: 60, shrink_budget: 50, ..CheckOptions::default() };
    let r = check_engine(&cmd, Duration::from_secs(10), opts, 1).expect("the fake cache does not break");
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(r.failures, 0, "{:?}", r.classes.iter().map(|c| (&c.name, &c.message)).collect::<Vec<_>>());
    for kind in
        ["admit", "write", "rows_write", "enter", "extract", "filter", "extract_missing", "spec_commit", "spec_abort"]
            .into_iter()
            .chain(["prefill"])
    {
        assert!(r.ops_by_kind.get(&format!("rec_{kind}")).copied().unwrap_or(0) > 20, "{kind}: {:?}", r.ops_by_kind);
    }
}

/// Every planted bug is caught by its check within 60 seeds and shrunk to a few ops that fail the same way again.
#[test]
fn every_planted_recurrent_bug_is_caught_and_shrunk() {
    for (mode, check, most) in [
        ("filter_neighbour", "rec_state", 5),
        ("extract_wrong_row", "rec_state", 5),
        ("commit_one_more", "rec_rollback", 3),
        ("merge_drops_empty", "rec_rows", 4),
        ("missing_row_empty", "rec_missing_row", 3),
        ("prefill_unmasked", "rec_state", 2),
    ] {
        let (cmd, dir) = command(mode);
        let opts = CheckOptions { seeds: 60, ops: 60, shrink_budget: 200, ..CheckOptions::default() };
        let r = check_engine(&cmd, Duration::from_secs(10), opts, 2).expect("the fake cache does not break");
        let names: Vec<&String> = r.classes.iter().map(|c| &c.name).collect();
        let c =
            r.classes.iter().find(|c| c.name == check).unwrap_or_else(|| panic!("{mode}: no [{check}] in {names:?}"));
        let t = c.shortest.recurrent().expect("a recurrent class keeps a recurrent trace");
        assert!(t.ops.len() <= most, "{mode}: shortest trace has {} ops: {:?}", t.ops.len(), t.ops);
        let engine = Engine::start(&cmd, Duration::from_secs(10)).unwrap();
        engine::install(engine);
        let again = replay(t).expect("no break");
        engine::uninstall();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            matches!(&again.trace.outcome, Outcome::Fail { check: c, .. } if c == check),
            "{mode}: {:?}",
            again.trace.outcome
        );
    }
}

#[test]
fn values_are_exact_in_both_dtypes_and_conv_windows_slide() {
    let mut cfg = RecConfig::from_seed(5, 10, true, true);
    cfg.arrays = vec![
        RecArray { kind: ArrayKind::Conv, shape: vec![1, 3, 2] },
        RecArray { kind: ArrayKind::Ssm, shape: vec![1, 2, 2, 3] },
    ];
    cfg.dtype = "f32".into();
    let f32s = |b: &[u8]| b.chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect::<Vec<_>>();
    let mut bf = cfg.clone();
    bf.dtype = "bf16".into();
    for (req, pos, a) in [(1, 0, 0), (1, 1, 0), (2, 5, 0), (1, 3, 1), (3, 9, 1)] {
        let x = f32s(&value(&cfg, req, pos, a));
        let y: Vec<f32> = value(&bf, req, pos, a)
            .chunks(2)
            .map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
            .collect();
        assert_eq!(x, y, "bf16 holds the f32 value exactly");
        assert_eq!(x.len(), cfg.arrays[a].elements());
    }
    assert!(value(&cfg, 1, 0, 1).iter().all(|&b| b == 0), "position 0 is the zero state");
    assert_ne!(value(&cfg, 1, 4, 1), value(&cfg, 2, 4, 1), "another request");
    assert_ne!(value(&cfg, 1, 4, 1), value(&cfg, 1, 5, 1), "another position");
    // A conv window at p + 1 is the window at p shifted by one column, the new column last.
    let (w0, w1) = (value(&cfg, 1, 4, 0), value(&cfg, 1, 5, 0));
    let col = 2 * 4;
    assert_eq!(w0[col..], w1[..2 * col]);
    let t = RecTrace {
        format: FORMAT.into(),
        version: 1,
        seed: 5,
        config: cfg.clone(),
        ops: generate(5, &cfg),
        outcome: Outcome::Pass,
    };
    assert_eq!(t.ops.len(), 10);
    assert_eq!(RecTrace::parse(&t.to_json()).unwrap(), t);
    assert_eq!(generate(5, &cfg), generate(5, &cfg), "one seed, one op stream");
    let mut two_rows: Value = serde_json::from_str(&t.to_json()).unwrap();
    two_rows["config"]["arrays"][0]["shape"][0] = json!(2);
    let mut conv_4d = two_rows.clone();
    conv_4d["config"]["arrays"][0]["shape"] = json!([1, 2, 2, 2]);
    for bad in [
        "",
        "{}",
        &t.to_json().replace(FORMAT, "kvsim-pool-trace"),
        &t.to_json().replace("\"f32\"", "\"f64\""),
        &two_rows.to_string(),
        &conv_4d.to_string(),
    ] {
        assert!(RecTrace::parse(bad).is_err(), "{bad}");
    }
}

#[test]
fn recurrent_replies_that_lie_are_typed() {
    let cfg = RecConfig {
        arrays: vec![RecArray { kind: ArrayKind::Ssm, shape: vec![1, 2] }],
        dtype: "f32".into(),
        spec: false,
        prefill: false,
        ops: 0,
    };
    let t = |shape: Value, dtype: &str, b64: &str| json!({"dtype": dtype, "shape": shape, "b64": b64});
    for bad in [
        json!({"ok": true}),
        json!({"ok": true, "arrays": []}),
        json!({"ok": true, "arrays": [t(json!([1, 2]), "bf16", "AAAAAAAAAAA=")]}),
        json!({"ok": true, "arrays": [t(json!([1, 2]), "f32", "AAAA")]}),
        json!({"ok": true, "arrays": [t(json!([1, 3]), "f32", "AAAAAAAAAAA=")]}),
        json!({"ok": true, "arrays": [t(json!([1, 9223372036854775807_i64]), "f32", "")]}),
        json!({"ok": true, "arrays": [{"dtype": "f32", "shape": [1, 2]}]}),
        json!({"ok": true, "arrays": [5]}),
    ] {
        assert!(parse_arrays("test", &bad, &cfg).is_err(), "{bad}");
    }
    let ok = json!({"ok": true, "arrays": [t(json!([1, 2]), "f32", "AAAAAAAAAAA=")]});
    assert_eq!(parse_arrays("test", &ok, &cfg).unwrap(), vec![Some(vec![0; 8])]);
    assert_eq!(parse_arrays("test", &json!({"ok": true, "arrays": [null]}), &cfg).unwrap(), vec![None]);
}
