//! The prefix checker against a prefix cache written for the purpose (Python, standard library only): the correct
//! cache passes every seed, and each bug planted in it is caught by the check that names it and shrunk.

use std::time::Duration;

use super::*;
use crate::byoc::engine::Engine;
use crate::byoc::engine_check::check_engine;
use crate::byoc::CheckOptions;

const FAKE_PREFIX: &str = r#"
import base64, json, sys
mode = sys.argv[1]
def send(o):
    sys.stdout.write(json.dumps(o) + "\n"); sys.stdout.flush()
C = None
class Layer:
    """One layer's cache: every position's K and V bytes (per head), the offset, the window."""
    def __init__(s, w, h, e):
        s.w, s.h, s.e, s.k, s.v = w, h, e, [], []
    def fill(s, k, v, n):
        # k, v: [1, H, n, D] bytes -> per position the H head slices
        kb, vb = base64.b64decode(k["b64"]), base64.b64decode(v["b64"])
        per = len(kb) // (s.h * n) if n else 0
        for p in range(n):
            s.k.append([kb[(hd * n + p) * per:(hd * n + p + 1) * per] for hd in range(s.h)])
            s.v.append([vb[(hd * n + p) * per:(hd * n + p + 1) * per] for hd in range(s.h)])
    def view(s, upto, dtype, d, warm=False):
        n = upto if s.w is None else min(upto, s.w)
        rot = 1 if (warm and mode == "warm_ring_rotated" and s.w is not None and n > 1) else 0
        if mode == "window_keeps_one_less" and s.w is not None and upto > s.w:
            n -= 1
        def arr(pos):
            rows = pos[upto - n:upto]
            rows = rows[rot:] + rows[:rot]
            raw = b"".join(rows[p][hd] for hd in range(s.h) for p in range(n))
            return {"dtype": dtype, "shape": [1, s.h, n, d], "b64": base64.b64encode(raw).decode()}
        return {"offset": upto, "k": arr(s.k), "v": arr(s.v)}
def build(tokens, k, v):
    ls = [Layer(w["max_size"], C["heads_kv"], 0) for w in C["layers"]]
    for l, layer in enumerate(ls):
        layer.fill(k[l], v[l], len(tokens))
    return ls
def states(ls, upto, warm=False):
    out = [l.view(upto, C["dtype"], C["head_dim"], warm) for l in ls]
    if mode == "offset_desync" and len(out) > 1:
        out[1]["offset"] = upto + 1
    return out
store = []
for line in sys.stdin:
    r = json.loads(line); op = r["op"]
    if op == "hello":
        send({"ok": True, "protocol": 2, "engine": "fake-prefix", "version": mode, "supports": {"kv": False, "prefix": True}})
    elif op == "reset":
        store = []; send({"ok": True})
    elif op == "prefix_new":
        C = r; send({"ok": True})
    elif op == "prefix_insert":
        store.append((list(r["tokens"]), build(r["tokens"], r["k"], r["v"]))); send({"ok": True})
    elif op == "prefix_cold":
        send({"ok": True, "states": states(build(r["tokens"], r["k"], r["v"]), len(r["tokens"]))})
    elif op == "prefix_evict":
        n = 1 if store else 0
        store = store[1:]
        send({"ok": True, "evicted": n})
    elif op == "prefix_lookup":
        t = r["tokens"]; best, who = 0, None
        for toks, ls in store:
            m = 0
            bs = C["block_size"]
            if mode == "last_block_only":
                # matches whole blocks by their own tokens, whatever came before
                while m + bs <= min(len(t), len(toks)) and toks[m:m + bs] == t[m:m + bs]:
                    m += bs
                while m + bs <= min(len(t), len(toks)) and any(toks[i:i + bs] == t[m:m + bs] for i in range(0, len(toks) - bs + 1, bs)):
                    m += bs
            else:
                while m < min(len(t), len(toks)) and toks[m] == t[m]:
                    m += 1
            if m > best:
                best, who = m, ls
        if best == 0:
            send({"ok": True, "matched": 0, "states": None}); continue
        upto = best - 1 if mode == "short" else best
        send({"ok": True, "matched": best, "states": states(who, upto, True)})
    else:
        send({"ok": False, "error": "NotImplementedError: " + op})
"#;

fn command(mode: &str) -> (String, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("kvsim-fake-prefix-{}-{mode}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = dir.join("prefix.py");
    std::fs::write(&script, FAKE_PREFIX).unwrap();
    (format!("exec python3 {} {mode}", script.display()), dir)
}

#[test]
fn a_correct_prefix_cache_passes_every_seed() {
    let (cmd, dir) = command("correct");
    let opts = CheckOptions { seeds: 40, ops: 40, shrink_budget: 50, ..CheckOptions::default() };
    let r = check_engine(&cmd, Duration::from_secs(10), opts, 1).expect("the fake cache does not break");
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(r.failures, 0, "{:?}", r.classes.iter().map(|c| (&c.name, &c.message)).collect::<Vec<_>>());
    assert!(r.ops_by_kind.get("prefix_hit").copied().unwrap_or(0) > 100, "{:?}", r.ops_by_kind);
}

/// Every planted bug is caught by its check within 40 seeds and shrunk; the shrunk trace fails the same way again.
#[test]
fn every_planted_prefix_bug_is_caught_and_shrunk() {
    for (mode, check) in [
        ("short", "prefix_offset"),
        ("offset_desync", "prefix_offset"),
        ("last_block_only", "prefix_count"),
        ("warm_ring_rotated", "prefix_warm_cold"),
        ("window_keeps_one_less", "prefix_model"),
    ] {
        let (cmd, dir) = command(mode);
        let opts = CheckOptions { seeds: 40, ops: 40, shrink_budget: 200, ..CheckOptions::default() };
        let r = check_engine(&cmd, Duration::from_secs(10), opts, 2).expect("the fake cache does not break");
        let names: Vec<&String> = r.classes.iter().map(|c| &c.name).collect();
        let c =
            r.classes.iter().find(|c| c.name == check).unwrap_or_else(|| panic!("{mode}: no [{check}] in {names:?}"));
        let t = c.shortest.prefix().expect("a prefix class keeps a prefix trace");
        assert!(t.ops.len() <= 4, "{mode}: shortest trace has {} ops", t.ops.len());
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
fn values_are_a_function_of_the_prefix_and_exact_in_both_dtypes() {
    let mut cfg = PrefixConfig::from_seed(1, 10);
    for dtype in ["f32", "bf16"] {
        cfg.dtype = dtype.into();
        let a = value(&cfg, &[1, 2, 3], 0, 0);
        assert_eq!(a, value(&cfg, &[1, 2, 3], 0, 0));
        assert_ne!(a, value(&cfg, &[0, 2, 3], 0, 0), "the same last token after another prefix");
        assert_ne!(a, value(&cfg, &[1, 2, 3], 1, 0), "another layer");
        assert_ne!(a, value(&cfg, &[1, 2, 3], 0, 1), "V, not K");
        assert_eq!(a.len(), cfg.heads_kv * cfg.head_dim * cfg.elem());
    }
    let t = PrefixTrace {
        format: FORMAT.into(),
        version: 1,
        seed: 1,
        config: cfg.clone(),
        ops: generate(1, &cfg),
        outcome: Outcome::Pass,
    };
    assert_eq!(PrefixTrace::parse(&t.to_json()).unwrap(), t);
    for bad in ["", "{}", &t.to_json().replace(FORMAT, "kvsim-pool-trace"), &t.to_json().replace("\"bf16\"", "\"f64\"")]
    {
        assert!(PrefixTrace::parse(bad).is_err(), "{bad}");
    }
}

#[test]
fn prefix_replies_that_lie_are_typed() {
    let cfg = PrefixConfig {
        layers: vec![None],
        heads_kv: 1,
        head_dim: 2,
        dtype: "f32".into(),
        block_size: 2,
        vocab: 2,
        ops: 0,
    };
    let t = |shape: Value, b64: &str| json!({"dtype": "f32", "shape": shape, "b64": b64});
    for bad in [
        json!({"ok": true}),
        json!({"ok": true, "states": [{"offset": 1, "k": t(json!([1, 1, 1, 2]), "AAAAAAAAAAA="), "v": t(json!([1, 1, 1, 2]), "")}]}),
        json!({"ok": true, "states": [{"offset": 1, "k": t(json!([1, 2, 1, 2]), ""), "v": t(json!([1, 2, 1, 2]), "")}]}),
        json!({"ok": true, "states": [{"k": t(json!([1, 1, 0, 2]), ""), "v": t(json!([1, 1, 0, 2]), "")}]}),
        json!({"ok": true, "states": [{"offset": 0, "k": t(json!([1, 1, 9223372036854775807_i64, 2]), ""), "v": t(json!([1, 1, 0, 2]), "")}]}),
        json!({"ok": true, "states": []}),
    ] {
        assert!(parse_states("test", &bad, &cfg).is_err(), "{bad}");
    }
    let ok = json!({"ok": true, "states": [{"offset": 1, "k": t(json!([1, 1, 1, 2]), "AAAAAAAAAAA="), "v": t(json!([1, 1, 1, 2]), "AAAAAAAAAAA=")}]});
    assert_eq!(parse_states("test", &ok, &cfg).unwrap()[0].n, 1);
}
