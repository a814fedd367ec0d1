//! An engine that misbehaves in each way a process can (a fake written for the purpose, in Python with no MLX):
//! every failure is typed, names the request, and leaves the process stopped; a refusal by the engine's cache is
//! not a protocol failure.

use std::time::Duration;

use super::*;
use crate::byoc::engine_check::*;
use crate::byoc::CheckOptions;

const FAKE: &str = r#"
import base64, json, os, sys, time
mode, pidfile = sys.argv[1], sys.argv[2]
open(pidfile, "w").write(str(os.getpid()))
def send(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()
for line in sys.stdin:
    req = json.loads(line)
    op = req["op"]
    if op == "hello":
        send({"ok": True, "protocol": 99 if mode == "version" else 1, "engine": "fake", "version": "0", "supports": {}})
    elif op == "new" and mode == "exited":
        sys.exit(7)
    elif op == "new":
        g = req["geometry"]
        send({"ok": True})
    elif op == "reset":
        send({"ok": True})
    elif op == "offset":
        send({"ok": True, "offset": 0})
    elif op == "state":
        # every run's first state check: an empty cache's K and V, or the mode's misbehaviour
        heads = g["heads_kv"] + (1 if mode == "wrong_shape" else 0)
        empty = {"dtype": g["dtype"], "shape": [1, heads, 0, g["head_dim"]], "b64": ""}
        if mode == "malformed":
            sys.stdout.write("this is not JSON\n"); sys.stdout.flush()
        elif mode == "truncated":
            sys.stdout.write('{"ok": true, "k": '); sys.stdout.flush(); sys.exit(0)
        elif mode == "timeout":
            time.sleep(60)
        elif mode == "refused":
            send({"ok": False, "error": "ValueError: this cache refuses to show its state"})
        else:
            send({"ok": True, "k": empty, "v": empty})
    else:
        send({"ok": False, "error": "NotImplementedError: " + op})
"#;

/// Runs a short check against the fake in `mode`; returns its result and the fake's pid.
fn against(mode: &str) -> (Result<EngineReport, Broken>, u32) {
    let dir = std::env::temp_dir().join(format!("kvsim-fake-engine-{}-{mode}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let script = dir.join("fake.py");
    std::fs::write(&script, FAKE).unwrap();
    let pidfile = dir.join("pid");
    let cmd = format!("exec python3 {} {mode} {}", script.display(), pidfile.display());
    let opts = CheckOptions { seeds: 3, ops: 40, shrink_budget: 20, ..CheckOptions::default() };
    let r = check_engine(&cmd, Duration::from_secs(2), opts, 1);
    let pid = std::fs::read_to_string(&pidfile).unwrap_or_default().trim().parse().unwrap_or(0);
    let _ = std::fs::remove_dir_all(&dir);
    (r, pid)
}

fn stopped(pid: u32) -> bool {
    pid != 0 && !std::path::Path::new(&format!("/proc/{pid}")).exists()
}

fn broken(mode: &str) -> Broken {
    let (r, pid) = against(mode);
    let b = r.expect_err("the engine must break");
    assert_eq!(b.failure.kind(), mode, "{}", b.failure);
    assert!(stopped(pid), "{mode}: the engine process {pid} still runs");
    b
}

#[test]
fn an_engine_that_exits_is_a_typed_failure_naming_the_request() {
    let b = broken("exited");
    assert!(matches!(&b.failure, EngineFailure::Exited { op, .. } if op == "new"), "{}", b.failure);
    assert!(b.trace.is_some());
}

#[test]
fn a_reply_that_is_not_json_is_malformed() {
    let b = broken("malformed");
    assert!(b.failure.to_string().contains("this is not JSON"), "{}", b.failure);
    assert!(b.trace.is_some());
}

#[test]
fn a_reply_cut_off_at_the_end_of_the_output_is_truncated() {
    let b = broken("truncated");
    assert!(matches!(&b.failure, EngineFailure::Truncated { op, reply } if op == "state" && reply.contains("\"k\"")));
}

#[test]
fn an_engine_that_hangs_is_stopped_after_the_timeout() {
    let b = broken("timeout");
    assert!(matches!(&b.failure, EngineFailure::Timeout { secs: 2, .. }), "{}", b.failure);
}

#[test]
fn an_output_of_another_shape_is_a_wrong_shape() {
    let b = broken("wrong_shape");
    assert!(matches!(&b.failure, EngineFailure::WrongShape { op, .. } if op == "state"), "{}", b.failure);
}

#[test]
fn another_protocol_version_is_refused_at_hello() {
    let b = broken("version");
    assert!(b.trace.is_none());
}

#[test]
fn a_refusal_by_the_engines_cache_is_a_failing_seed_not_a_broken_engine() {
    let (r, pid) = against("refused");
    let report = r.expect("a refusal is judged, the engine keeps running");
    assert!(report.failures > 0);
    assert!(report.classes.iter().all(|c| c.name == "adapter_error/state"), "{:?}", report.classes);
    assert!(stopped(pid), "the engine process {pid} is stopped when the check ends");
}

#[test]
fn a_command_that_cannot_start_is_a_typed_failure() {
    let r = check_engine("exec /nonexistent/engine", Duration::from_secs(2), CheckOptions::default(), 0);
    let b = r.expect_err("no engine");
    assert!(matches!(b.failure.kind(), "exited" | "spawn"), "{}", b.failure);
}
