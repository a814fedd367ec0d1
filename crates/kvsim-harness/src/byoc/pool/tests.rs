//! The pool checker against a block pool written for the purpose (Python, standard library only): the correct pool
//! passes every seed, and each bug planted in it is caught by the check that names it and shrunk.

use std::time::Duration;

use super::*;
use crate::byoc::engine::Engine;
use crate::byoc::engine_check::check_engine;
use crate::byoc::CheckOptions;

const FAKE_POOL: &str = r#"
import json, sys
mode = sys.argv[1]
def send(o):
    sys.stdout.write(json.dumps(o) + "\n"); sys.stdout.flush()
class Pool:
    def __init__(s, bs, n):
        s.bs, s.n = bs, n
        s.refs = {}              # held block -> count
        s.free = list(range(n))  # LRU first
        s.index = {}             # key -> block
        s.key_of = {}            # block -> key
        s.tables = {}
        s.storage = {}
    def key(s, tokens, i):
        blk = tuple(tokens[i * s.bs:(i + 1) * s.bs])
        return blk if mode == "lookup_ignores_prefix" else tuple(tokens[:(i + 1) * s.bs])
    def take(s):
        b = s.free.pop(0)
        k = s.key_of.pop(b, None)
        if k is not None and s.index.get(k) == b:
            del s.index[k]
        s.refs[b] = 1
        s.storage[b] = [None]
        return b
    def drop(s, b):
        s.refs[b] -= 1
        if s.refs[b] == 0:
            del s.refs[b]
            s.free.append(b)
    def lookup(s, tokens):
        out = []
        for i in range(len(tokens) // s.bs):
            b = s.index.get(s.key(tokens, i))
            if b is None:
                break
            out.append(b)
        return out
P = None
for line in sys.stdin:
    r = json.loads(line); op = r["op"]
    if op == "hello":
        send({"ok": True, "protocol": 2, "engine": "fake-pool", "version": mode, "supports": {"kv": False, "pool": True}})
    elif op == "reset":
        send({"ok": True})
    elif op == "pool_new":
        P = Pool(r["block_size"], r["blocks"]); send({"ok": True, "usable": r["blocks"]})
    elif op == "pool_alloc":
        need = -(-len(r["tokens"]) // P.bs)
        if need > len(P.free):
            send({"ok": False, "error": "ValueError: pool full"}); continue
        P.tables[r["seq"]] = [P.take() for _ in range(need)]
        send({"ok": True, "table": P.tables[r["seq"]]})
    elif op == "pool_free":
        for b in P.tables.pop(r["seq"]):
            if mode != "free_keeps_refs":
                P.drop(b)
        send({"ok": True})
    elif op == "pool_fork":
        t = list(P.tables[r["seq"]])
        for b in t:
            P.refs[b] += 1
        P.tables[r["new"]] = t
        send({"ok": True, "table": t})
    elif op == "pool_cow":
        t = P.tables[r["seq"]]; copied = 0
        shared = [b for b in t if P.refs[b] > 1]
        if mode != "cow_keeps_shared":
            if len(shared) > len(P.free):
                send({"ok": False, "error": "ValueError: no block to copy into"}); continue
            for i, b in enumerate(t):
                if P.refs[b] > 1:
                    n = P.take(); P.refs[b] -= 1; t[i] = n; copied += 1
                    if mode == "cow_shares_storage":
                        P.storage[n] = P.storage[b]
        send({"ok": True, "table": t, "copied": copied})
    elif op == "pool_cache":
        t = P.tables[r["seq"]]
        for i in range(len(r["tokens"]) // P.bs):
            k = P.key(r["tokens"], i)
            P.index[k] = t[i]; P.key_of[t[i]] = k
        send({"ok": True})
    elif op == "pool_lookup":
        bl = P.lookup(r["tokens"])
        send({"ok": True, "blocks": bl, "matched": len(bl) * P.bs})
    elif op == "pool_hit":
        bl = P.lookup(r["tokens"])
        for b in bl:
            if b in P.refs:
                P.refs[b] += 1
            else:
                P.free.remove(b); P.refs[b] = 1
        P.tables[r["seq"]] = bl
        send({"ok": True, "table": bl, "matched": len(bl) * P.bs})
    elif op == "pool_evict":
        n = 0
        for b in list(P.free):
            if n == r["n"]:
                break
            k = P.key_of.pop(b, None)
            if k is not None:
                if P.index.get(k) == b:
                    del P.index[k]
                n += 1
        send({"ok": True, "evicted": n})
    elif op == "pool_info":
        send({"ok": True, "free": len(P.free), "refs": {str(b): c for b, c in P.refs.items()},
              "tables": {str(s): t for s, t in P.tables.items()},
              "storage": {str(b): id(v) for b, v in P.storage.items() if b in P.refs}})
    else:
        send({"ok": False, "error": "NotImplementedError: " + op})
"#;

fn command(mode: &str) -> (String, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("kvsim-fake-pool-{}-{mode}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = dir.join("pool.py");
    std::fs::write(&script, FAKE_POOL).unwrap();
    (format!("exec python3 {} {mode}", script.display()), dir)
}

#[test]
fn a_correct_pool_passes_every_seed() {
    let (cmd, dir) = command("correct");
    let opts = CheckOptions { seeds: 60, ops: 80, shrink_budget: 50, ..CheckOptions::default() };
    let r = check_engine(&cmd, Duration::from_secs(10), opts, 1).expect("the fake pool does not break");
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(r.failures, 0, "{:?}", r.classes.iter().map(|c| (&c.name, &c.message)).collect::<Vec<_>>());
    for kind in ["alloc", "free", "fork", "cow", "cache", "lookup", "hit", "evict"] {
        assert!(r.ops_by_kind.get(&format!("pool_{kind}")).copied().unwrap_or(0) > 20, "{kind}: {:?}", r.ops_by_kind);
    }
}

/// Every planted bug is caught by its check within 60 seeds and shrunk to a trace of a few ops that fails the same
/// way on replay.
#[test]
fn every_planted_pool_bug_is_caught_and_shrunk() {
    for (mode, check) in [
        ("lookup_ignores_prefix", "pool_lookup"),
        ("cow_keeps_shared", "pool_cow"),
        ("cow_shares_storage", "pool_storage"),
        ("free_keeps_refs", "pool_refs"),
    ] {
        let (cmd, dir) = command(mode);
        let opts = CheckOptions { seeds: 60, ops: 80, shrink_budget: 200, ..CheckOptions::default() };
        let r = check_engine(&cmd, Duration::from_secs(10), opts, 2).expect("the fake pool does not break");
        let c = r.classes.iter().find(|c| c.name == check).unwrap_or_else(|| {
            panic!("{mode}: no [{check}] in {:?}", r.classes.iter().map(|c| &c.name).collect::<Vec<_>>())
        });
        let t = c.shortest.pool().expect("a pool class keeps a pool trace");
        assert!(t.ops.len() <= 8, "{mode}: shortest trace has {} ops", t.ops.len());
        // The shrunk trace fails the same way on replay, in a fresh engine.
        let engine = Engine::start(&cmd, Duration::from_secs(10)).unwrap();
        engine::install(engine);
        let again = replay(t).expect("no break");
        engine::uninstall();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            matches!(&again.trace.outcome, crate::sim::trace::Outcome::Fail { check: c, .. } if c == check),
            "{mode}: {:?}",
            again.trace.outcome
        );
    }
}

#[test]
fn a_pool_trace_round_trips_and_bad_ones_are_typed_errors() {
    let cfg = PoolConfig::from_seed(3, 20);
    let t = PoolTrace {
        format: FORMAT.into(),
        version: 1,
        seed: 3,
        config: cfg,
        ops: generate(3, &cfg),
        outcome: crate::sim::trace::Outcome::Pass,
    };
    assert_eq!(PoolTrace::parse(&t.to_json()).unwrap(), t);
    for bad in ["", "{}", "[1]", "{\"format\": \"kvsim-trace\"}", &t.to_json().replace(FORMAT, "other")] {
        assert!(PoolTrace::parse(bad).is_err(), "{bad}");
    }
    assert_eq!(generate(3, &cfg), generate(3, &cfg), "one seed, one op stream");
}

#[test]
fn pool_info_replies_that_lie_about_their_shape_are_typed() {
    for bad in [
        json!({"ok": true}),
        json!({"ok": true, "free": -1, "refs": {}, "tables": {}, "storage": {}}),
        json!({"ok": true, "free": 1, "refs": {"x": 1}, "tables": {}, "storage": {}}),
        json!({"ok": true, "free": 1, "refs": {}, "tables": {"1": [1, "a"]}, "storage": {}}),
        json!({"ok": true, "free": 1, "refs": {}, "tables": {}, "storage": []}),
    ] {
        assert!(parse_info(&bad).is_err(), "{bad}");
    }
    let ok = json!({"ok": true, "free": 1, "refs": {"2": 1}, "tables": {"5": [2]}, "storage": {"2": 77}});
    assert_eq!(parse_info(&ok).unwrap().tables[&5], vec![2]);
}
