//! An engine that misbehaves in each way a process can (a fake written for the purpose, in Python with no MLX):
//! every failure is typed, names the request, and leaves the process stopped; a refusal by the engine's cache is
//! not a protocol failure.

use std::time::Duration;

use super::*;
use crate::byoc::engine_check::*;
use crate::byoc::CheckOptions;

const FAKE: &str = include_str!("fake_engine.py");

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
fn binary_frames_agreed_in_hello_are_read_as_replies() {
    let (r, pid) = against("binary");
    let report = r.expect("a good frame is a reply: the engine keeps running");
    assert!(report.classes.iter().all(|c| c.name.starts_with("adapter_error")), "{:?}", report.classes);
    assert!(stopped(pid));
}

#[test]
fn a_frame_whose_array_lies_outside_its_bytes_is_malformed() {
    let (r, pid) = against("binary_span");
    let b = r.expect_err("the engine must break");
    assert_eq!(b.failure.kind(), "malformed", "{}", b.failure);
    assert!(b.failure.to_string().contains("outside the frame"), "{}", b.failure);
    assert!(matches!(&b.failure, EngineFailure::Malformed { op, .. } if op == "state"), "{}", b.failure);
    assert!(stopped(pid));
}

#[test]
fn a_frame_without_a_byte_count_is_malformed() {
    let (r, _) = against("binary_count");
    let b = r.expect_err("the engine must break");
    assert_eq!(b.failure.kind(), "malformed", "{}", b.failure);
    assert!(b.failure.to_string().contains("byte count"), "{}", b.failure);
}

#[test]
fn a_frame_cut_off_before_its_bytes_is_truncated() {
    let (r, _) = against("binary_cut");
    let b = r.expect_err("the engine must break");
    assert_eq!(b.failure.kind(), "truncated", "{}", b.failure);
    assert!(b.failure.to_string().contains("3 of the frame's 9 bytes"), "{}", b.failure);
}

#[test]
fn binary_frames_are_a_protocol_2_key() {
    let h = parse_hello("x", &json!({"ok": true, "protocol": 2, "supports": {"binary": true}})).unwrap();
    assert!(h.binary);
    let h = parse_hello("x", &json!({"ok": true, "protocol": 1, "supports": {"binary": true}})).unwrap();
    assert!(!h.binary, "binary frames are a protocol-2 key");
}

#[test]
fn a_command_that_cannot_start_is_a_typed_failure() {
    let r = check_engine("exec /nonexistent/engine", Duration::from_secs(2), CheckOptions::default(), 0);
    let b = r.expect_err("no engine");
    assert!(matches!(b.failure.kind(), "exited" | "spawn"), "{}", b.failure);
}

/// A quantized `state` reply of `n` positions for geometry `g` (planes of zeros), as JSON.
fn planes_reply(g: &Geometry, n: i64, packed_width: i64, dtype: &str) -> Value {
    let q = g.quant.expect("quantized");
    let (h, d) = (g.heads_kv as i64, g.head_dim as i64);
    let t = |dt: &str, w: i64| {
        let size = if dt == "bf16" { 2 } else { 4 };
        json!({"dtype": dt, "shape": [1, h, n, w],
               "b64": base64::engine::general_purpose::STANDARD.encode(vec![0u8; (h * n * w * size) as usize])})
    };
    let g_w = d / q.group_size as i64;
    let side = json!({"packed": t("u32", packed_width), "scales": t(dtype, g_w), "biases": t(dtype, g_w)});
    json!({"ok": true, "k": side.clone(), "v": side})
}

#[test]
fn quantized_state_replies_that_lie_are_typed() {
    let g = Geometry {
        heads_kv: 2,
        heads_q: 4,
        head_dim: 64,
        dtype: Dtype::Bfloat16,
        max_size: None,
        quant: Some(crate::byoc::QuantGeometry { bits: 5, group_size: 32 }),
    };
    // 5-bit codes are packed densely, across words: 64 * 5 / 32 = 10 words per position
    let ok = planes_reply(&g, 3, 10, "bf16");
    let planes = decode_planes("state", &ok, &g).expect("well-formed planes");
    assert_eq!(planes[0].shape(), &[1, 2, 3, 10]);
    assert_eq!(planes[0].dtype(), Dtype::Uint32);
    assert_eq!(planes[5].shape(), &[1, 2, 3, 2]);
    let kind = |reply: &Value| {
        let e = decode_planes("state", reply, &g).expect_err("a lie");
        e.downcast_ref::<EngineFailure>().map(|f| f.kind()).unwrap_or("untyped").to_string()
    };
    assert_eq!(kind(&planes_reply(&g, 3, 11, "bf16")), "wrong_shape", "a packed width of another bit count");
    assert_eq!(kind(&planes_reply(&g, 3, 10, "f32")), "malformed", "scales of another dtype");
    let mut other_n = ok.clone();
    other_n["v"] = planes_reply(&g, 4, 10, "bf16")["v"].clone();
    assert_eq!(kind(&other_n), "wrong_shape", "V of another position count than K");
    let mut no_v = ok.clone();
    no_v.as_object_mut().expect("object").remove("v");
    assert_eq!(kind(&no_v), "malformed");
    let mut plain = ok.clone();
    plain["k"] = json!({"dtype": "bf16", "shape": [1, 2, 3, 64], "b64": ""});
    assert_eq!(kind(&plain), "malformed", "a plain array where planes are due");
    let mut short = ok;
    short["k"]["scales"]["b64"] = json!("AAAA");
    assert_eq!(kind(&short), "malformed", "fewer bytes than the shape");
}
