//! An engine in another process, as a cache under test: kvsim's engine protocol (oracles/PROTOCOL.md, "The engine
//! protocol"), JSON lines over the process's standard input and output, one request per cache call.
//!
//! [`Engine::start`] runs the driver command and asks `hello` (protocol version, what the engine supports);
//! [`install`] makes it the engine of this thread's runs of [`EngineCache`], the [`Adapter`] whose serial caches
//! and rows are handles (ids) of caches living in the engine. Every request of a run is kept ([`calls`]): a shrunk
//! failing run's calls are what the engine's reproducer replays.
//!
//! Bad input from the engine is an [`EngineFailure`] naming the request and the reply: it exited, it sent no reply
//! within the timeout, a reply that is not a JSON object (or not `ok` as a boolean), a line cut off at the end of its
//! output, a reply whose fields (a count, a tensor's dtype, bytes or shape) are not what the request implies, another
//! protocol version. From then on
//! the engine is **broken**: every later call answers the same failure at once, and [`Engine::stop`] kills the
//! process. A reply `{"ok": false, "error": ...}` is not a protocol failure: the engine's cache refused the call,
//! which the simulator judges like any cache's refusal.

use std::cell::RefCell;
use std::io::{BufReader, Read as _, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use mlx_rs::{Array, Dtype};
use serde_json::{json, Value};

use super::{
    read_each, read_group_each, Adapter, AdapterError, AdapterResult, Geometry, GroupRead, QuantGeometry, Read,
    ReadOut, RowsUnderTest, SerialUnderTest, Supports, Target,
};

/// The newest protocol version this module speaks.
pub const PROTOCOL: u64 = 2;

/// Every protocol version this module speaks: 2 is 1 plus the requests an engine opts into through `supports`
/// (oracles/PROTOCOL.md, "Protocol 2"), so a protocol-1 engine runs unchanged.
pub const PROTOCOLS: &[u64] = &[1, 2];

/// What went wrong with the engine process (not with its caches).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineFailure {
    #[error("cannot start the engine {command:?}: {why}")]
    Spawn { command: String, why: String },
    #[error("{op}: the engine exited ({status}) before replying; its last output on stderr: {stderr:?}")]
    Exited { op: String, status: String, stderr: String },
    #[error("{op}: the engine sent no reply within {secs} s")]
    Timeout { op: String, secs: u64 },
    #[error("{op}: malformed reply {reply:?}: {why}")]
    Malformed { op: String, reply: String, why: String },
    #[error("{op}: the reply was cut off (no end of line before the engine's output ended): {reply:?}")]
    Truncated { op: String, reply: String },
    #[error("{op}: reply field {field:?} has shape {got:?}, the request implies {want}")]
    WrongShape { op: String, field: String, got: Vec<i64>, want: String },
    #[error("the engine speaks protocol {got}, kvsim speaks {want}")]
    Version { got: String, want: u64 },
    #[error("no engine is installed on this thread")]
    NotInstalled,
}

impl EngineFailure {
    /// The failure's kind, as a class name (`engine/timeout`, ...).
    pub fn kind(&self) -> &'static str {
        match self {
            EngineFailure::Spawn { .. } => "spawn",
            EngineFailure::Exited { .. } => "exited",
            EngineFailure::Timeout { .. } => "timeout",
            EngineFailure::Malformed { .. } => "malformed",
            EngineFailure::Truncated { .. } => "truncated",
            EngineFailure::WrongShape { .. } => "wrong_shape",
            EngineFailure::Version { .. } => "version",
            EngineFailure::NotInstalled => "not_installed",
        }
    }
}

/// The engine's cache refused a call (`{"ok": false, "error": ...}`).
#[derive(Debug, Clone, thiserror::Error)]
#[error("the engine's cache raised: {0}")]
pub struct EngineRefused(pub String);

pub mod frame;

use frame::Line;

/// What `hello` said.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    pub protocol: u64,
    pub engine: String,
    pub version: String,
    /// The K/V calls it has (protocol 1's requests).
    pub supports: Supports,
    /// Whether it serves protocol 1's K/V requests at all (`supports.kv`; absent: true).
    pub kv: bool,
    /// Whether it serves the block-pool requests (`supports.pool`).
    pub pool: bool,
    /// Whether it serves the prefix-cache requests (`supports.prefix`).
    pub prefix: bool,
    /// Whether it serves the recurrent-state requests (`supports.recurrent`), and their speculative blocks
    /// (`supports.rec_spec`).
    pub recurrent: bool,
    pub rec_spec: bool,
    /// Whether its recurrent caches take right-padded prompt batches (`supports.rec_prefill`: `rec_prepare`,
    /// `rec_finalize`).
    pub rec_prefill: bool,
    /// Whether it answers `batch` (several requests in one round trip; `supports.batch`).
    pub batch: bool,
    /// Whether its replies may be binary frames (`supports.binary`, answered to the offer in kvsim's `hello`).
    pub binary: bool,
}

/// Decodes a `hello` reply: what the engine speaks and supports, or a typed failure.
pub fn parse_hello(command: &str, reply: &Value) -> Result<Hello, EngineFailure> {
    if reply["ok"] != Value::Bool(true) {
        let why = format!("hello answered {}", shorten(reply));
        return Err(EngineFailure::Spawn { command: command.to_string(), why });
    }
    let protocol = reply.get("protocol").and_then(Value::as_u64);
    let Some(protocol) = protocol.filter(|p| PROTOCOLS.contains(p)) else {
        let got = reply.get("protocol").map_or("none".to_string(), |v| v.to_string());
        return Err(EngineFailure::Version { got, want: PROTOCOL });
    };
    let s = reply.get("supports").cloned().unwrap_or(Value::Null);
    let flag = |k: &str, absent: bool| s.get(k).and_then(Value::as_bool).unwrap_or(absent);
    Ok(Hello {
        protocol,
        engine: reply.get("engine").and_then(Value::as_str).unwrap_or("?").to_string(),
        version: reply.get("version").and_then(Value::as_str).unwrap_or("?").to_string(),
        supports: Supports {
            serial_trim: flag("serial_trim", false),
            rows_window: flag("rows_window", false),
            rows_trim: flag("rows_trim", false),
            join: flag("join", false),
            rotating: flag("rotating", false),
            quant: protocol >= 2 && (flag("quant", false) || flag("quant_only", false)),
            quant_only: protocol >= 2 && flag("quant_only", false),
            quant_rows: protocol >= 2 && flag("quant_rows", false),
            prefill: protocol >= 2 && flag("prefill", false),
            convert: protocol >= 2 && flag("convert", false),
            rows_trim_rows: protocol >= 2 && flag("rows_trim_rows", false),
        },
        kv: flag("kv", true) || protocol == 1,
        pool: protocol >= 2 && flag("pool", false),
        prefix: protocol >= 2 && flag("prefix", false),
        recurrent: protocol >= 2 && flag("recurrent", false),
        rec_spec: protocol >= 2 && flag("recurrent", false) && flag("rec_spec", false),
        rec_prefill: protocol >= 2 && flag("recurrent", false) && flag("rec_prefill", false),
        batch: protocol >= 2 && flag("batch", false),
        binary: protocol >= 2 && flag("binary", false),
    })
}

/// A running engine process.
pub struct Engine {
    command: String,
    child: Child,
    stdin: Option<ChildStdin>,
    /// Its standard output, read on the calling thread (each read waits at most until the reply's deadline).
    out: BufReader<frame::Timed>,
    /// Set once `hello` agreed on binary frames: a frame's bytes are then read after its line.
    binary: bool,
    stderr: Arc<Mutex<String>>,
    timeout: Duration,
    next_id: u64,
    frees: Vec<u64>,
    calls: Vec<Value>,
    /// Requests to send after the next batch's, in its round trip ([`Adapter::prefetch`]).
    tail: Vec<Value>,
    /// The tail sent with the last batch: its requests, their replies and the frame's bytes, until the next request.
    prefetched: Option<(Vec<Value>, Vec<Value>, Vec<u8>)>,
    broken: Option<EngineFailure>,
    hello: Hello,
}

impl Engine {
    /// Runs `command` (through `sh -c`) and asks `hello`; `timeout` bounds every reply.
    pub fn start(command: &str, timeout: Duration) -> Result<Engine, EngineFailure> {
        let spawn = |why: String| EngineFailure::Spawn { command: command.to_string(), why };
        let mut child = Command::new("sh")
            .arg("-c")
            .arg(command)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| spawn(e.to_string()))?;
        let stdout = child.stdout.take().ok_or_else(|| spawn("no stdout".into()))?;
        let mut err = child.stderr.take().ok_or_else(|| spawn("no stderr".into()))?;
        let out = BufReader::with_capacity(1 << 16, frame::Timed::new(stdout));
        let stderr = Arc::new(Mutex::new(String::new()));
        let sink = Arc::clone(&stderr);
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = err.read(&mut buf) {
                if n == 0 {
                    return;
                }
                let mut s = sink.lock().unwrap_or_else(|p| p.into_inner());
                s.push_str(&String::from_utf8_lossy(&buf[..n]));
                if s.len() > 8192 {
                    let cut = s.len() - 4096;
                    let cut = (cut..s.len()).find(|&i| s.is_char_boundary(i)).unwrap_or(s.len());
                    s.drain(..cut);
                }
            }
        });
        let stdin = child.stdin.take();
        let mut e = Engine {
            command: command.to_string(),
            child,
            stdin,
            out,
            binary: false,
            stderr,
            timeout,
            next_id: 0,
            frees: vec![],
            calls: vec![],
            tail: vec![],
            prefetched: None,
            broken: None,
            hello: Hello {
                protocol: 0,
                engine: String::new(),
                version: String::new(),
                supports: Supports::default(),
                kv: false,
                pool: false,
                prefix: false,
                recurrent: false,
                rec_spec: false,
                rec_prefill: false,
                batch: false,
                binary: false,
            },
        };
        // The offer of binary frames: an engine that takes it answers `supports.binary` and may frame what it
        // sends after this reply.
        let reply = e.request(json!({"op": "hello", "binary": true}));
        let reply = match reply {
            Ok(r) => r,
            Err(f) => {
                e.stop();
                return Err(f);
            }
        };
        match parse_hello(command, &reply) {
            Ok(h) => {
                e.binary = h.binary;
                e.hello = h;
            }
            Err(f) => {
                e.stop();
                return Err(f);
            }
        }
        e.calls.clear();
        Ok(e)
    }

    /// Opens a run: the engine forgets every cache (`reset`), the run's log starts empty.
    pub fn begin(&mut self) -> AdapterResult<()> {
        self.frees.clear();
        self.next_id = 0;
        let r = self.call(json!({"op": "reset"}));
        self.calls.clear();
        r.map(|_| ())
    }

    /// What `hello` said.
    pub fn hello(&self) -> &Hello {
        &self.hello
    }

    /// The command it runs.
    pub fn command(&self) -> &str {
        &self.command
    }

    /// The failure that broke it, if one did.
    pub fn broken(&self) -> Option<&EngineFailure> {
        self.broken.as_ref()
    }

    /// Stops the process (killed if it is still running) and waits for it.
    pub fn stop(&mut self) {
        self.stdin = None;
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Whether the process has ended.
    pub fn exited(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(Some(_)))
    }

    fn fresh_id(&mut self) -> u64 {
        self.next_id += 1;
        self.next_id
    }

    /// Sends one request and reads its reply. `Err(EngineFailure)`: the engine is broken from now on.
    pub fn request(&mut self, req: Value) -> Result<Value, EngineFailure> {
        self.send(req, 0)
    }

    /// [`Engine::request`] of `req`, a batch whose last `tail` requests are left out of the run's log.
    fn send(&mut self, mut req: Value, tail: usize) -> Result<Value, EngineFailure> {
        self.prefetched = None;
        if tail == 0 {
            self.tail.clear(); // a prefetch no batch carried is dropped
        }
        if let Some(f) = &self.broken {
            return Err(f.clone());
        }
        let op = req.get("op").and_then(Value::as_str).unwrap_or("?").to_string();
        if !self.frees.is_empty() {
            req["free"] = json!(std::mem::take(&mut self.frees));
        }
        let mut line = req.to_string();
        let mut logged = req;
        if let Some(r) = logged.get_mut("requests").and_then(Value::as_array_mut).filter(|_| tail > 0) {
            r.truncate(r.len().saturating_sub(tail));
        }
        self.calls.push(logged);
        line.push('\n');
        let sent = match self.stdin.as_mut() {
            Some(w) => w.write_all(line.as_bytes()).and_then(|_| w.flush()).is_ok(),
            None => false,
        };
        let result = if !sent {
            Err(self.exited_failure(&op))
        } else {
            self.out.get_mut().deadline = Instant::now() + self.timeout;
            match frame::next_frame(&mut self.out, self.binary) {
                Line::Full(s, blob) => {
                    frame::set_blob(blob);
                    parse_reply(&op, &s)
                }
                Line::Bad(s, why) => Err(EngineFailure::Malformed { op: op.clone(), reply: s, why }),
                Line::Cut(s) => Err(EngineFailure::Truncated { op: op.clone(), reply: s }),
                Line::End => Err(self.exited_failure(&op)),
                Line::TimedOut => Err(EngineFailure::Timeout { op: op.clone(), secs: self.timeout.as_secs() }),
            }
        };
        if let Err(f) = &result {
            self.broken = Some(f.clone());
            self.stop();
        }
        result
    }

    /// Sends `requests` as one `batch` request (the engine must say `supports.batch`) and answers each one's reply,
    /// in order: `{"ok": true, ...}` or a refusal. A batch refused as a whole, or replies that are not one object with
    /// a boolean `ok` per request, break the engine.
    pub fn request_batch(&mut self, mut requests: Vec<Value>) -> Result<Vec<Value>, EngineFailure> {
        let tail = std::mem::take(&mut self.tail);
        let (asked, extra) = (requests.len(), tail.len());
        requests.extend(tail.iter().cloned());
        let n = requests.len();
        let reply = self.send(json!({"op": "batch", "requests": requests}), extra)?;
        let malformed = |why: String| EngineFailure::Malformed { op: "batch".into(), reply: shorten(&reply), why };
        let fault = if reply["ok"] != Value::Bool(true) {
            Some(malformed("an engine that says supports.batch must answer batch".into()))
        } else {
            match reply.get("replies").and_then(Value::as_array) {
                Some(r) if r.len() == n && r.iter().all(|x| x.get("ok").is_some_and(Value::is_boolean)) => None,
                Some(r) => {
                    Some(malformed(format!("{} replies for {n} requests, or one without a boolean ok", r.len())))
                }
                None => Some(malformed("no list \"replies\"".into())),
            }
        };
        if let Some(f) = fault {
            self.broken = Some(f.clone());
            self.stop();
            return Err(f);
        }
        let mut replies = match reply {
            Value::Object(mut m) => match m.remove("replies") {
                Some(Value::Array(r)) => r,
                _ => vec![],
            },
            _ => vec![],
        };
        if extra > 0 {
            let rest = replies.split_off(asked);
            self.prefetched = Some((tail, rest, frame::blob()));
        }
        Ok(replies)
    }

    /// The replies to `requests` when they are the tail the last batch carried (nothing sent since): they enter the
    /// run's log now, as if sent now, and the frame's bytes are the current reply's again.
    fn take_prefetched(&mut self, requests: &[Value]) -> Option<Vec<Value>> {
        match self.prefetched.take() {
            Some((asked, replies, blob)) if asked == requests => {
                self.calls.push(json!({"op": "batch", "requests": asked}));
                frame::set_blob(blob);
                Some(replies)
            }
            _ => None,
        }
    }

    fn exited_failure(&mut self, op: &str) -> EngineFailure {
        let status = match self.child.wait() {
            Ok(s) => s.to_string(),
            Err(e) => e.to_string(),
        };
        std::thread::sleep(Duration::from_millis(20));
        let stderr = self.stderr.lock().map(|s| s.chars().rev().take(600).collect::<String>()).unwrap_or_default();
        EngineFailure::Exited { op: op.to_string(), status, stderr: stderr.chars().rev().collect() }
    }

    /// A call whose refusal is the cache's: `Err(EngineRefused)` for `ok: false`, `Err(EngineFailure)` for a
    /// protocol failure.
    fn call(&mut self, req: Value) -> AdapterResult<Value> {
        let reply = self.request(req)?;
        if reply["ok"] == Value::Bool(true) {
            Ok(reply)
        } else {
            Err(Box::new(EngineRefused(reply.get("error").map_or("no message".to_string(), |e| e.to_string()))))
        }
    }

    /// Asks the engine for a standalone reproducer of `calls` whose divergence is `divergence` (a check name).
    pub fn reproducer(&mut self, calls: &[Value], divergence: &str, title: &str) -> Result<String, String> {
        let reply = self
            .request(json!({"op": "reproducer", "calls": calls, "divergence": divergence, "title": title}))
            .map_err(|e| e.to_string())?;
        match (reply["ok"].as_bool(), reply["script"].as_str()) {
            (Some(true), Some(s)) => Ok(s.to_string()),
            _ => Err(format!("the engine wrote no reproducer: {}", reply.get("error").unwrap_or(&Value::Null))),
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.stop();
    }
}

pub(crate) fn parse_reply(op: &str, s: &str) -> Result<Value, EngineFailure> {
    let malformed =
        |why: &str| EngineFailure::Malformed { op: op.to_string(), reply: s.trim_end().to_string(), why: why.into() };
    let v: Value = serde_json::from_str(s).map_err(|e| malformed(&format!("not JSON: {e}")))?;
    if !v.is_object() {
        return Err(malformed("not a JSON object"));
    }
    if !v.get("ok").is_some_and(Value::is_boolean) {
        return Err(malformed("no boolean \"ok\""));
    }
    Ok(v)
}

thread_local! {
    static ENGINE: RefCell<Option<Engine>> = const { RefCell::new(None) };
}

/// Makes `engine` the engine of this thread's [`EngineCache`] runs; returns the one it replaces.
pub fn install(engine: Engine) -> Option<Engine> {
    ENGINE.with(|e| e.borrow_mut().replace(engine))
}

/// Takes this thread's engine back.
pub fn uninstall() -> Option<Engine> {
    ENGINE.with(|e| e.borrow_mut().take())
}

/// The requests of the current run (since its `reset`), in order.
pub fn calls() -> Vec<Value> {
    ENGINE.with(|e| e.borrow().as_ref().map(|e| e.calls.clone()).unwrap_or_default())
}

/// Runs `f` on this thread's engine.
pub fn with_engine<T>(f: impl FnOnce(&mut Engine) -> T) -> Result<T, EngineFailure> {
    ENGINE.with(|e| e.borrow_mut().as_mut().map(f).ok_or(EngineFailure::NotInstalled))
}

fn engine_call(req: Value) -> AdapterResult<Value> {
    with_engine(|e| e.call(req))?
}

/// A reply that parsed but holds what the request cannot have produced: the engine is broken from now on (stopped).
fn fault(f: EngineFailure) -> AdapterError {
    break_engine(&f);
    Box::new(f)
}

/// One request to this thread's engine: `Ok(Ok(reply))` answered, `Ok(Err(message))` refused (the cache raised),
/// `Err` the engine broke.
pub(crate) fn ask(req: Value) -> Result<Result<Value, String>, EngineFailure> {
    match with_engine(|e| e.request(req)) {
        Err(f) | Ok(Err(f)) => Err(f),
        Ok(Ok(reply)) if reply["ok"] == Value::Bool(true) => Ok(Ok(reply)),
        Ok(Ok(reply)) => {
            Ok(Err(EngineRefused(reply.get("error").map_or("no message".into(), |e| e.to_string())).to_string()))
        }
    }
}

/// Opens a run on this thread's engine (`reset`, the run's log emptied); an engine that refuses `reset` is broken.
pub(crate) fn open_run() -> Result<(), EngineFailure> {
    with_engine(|e| e.begin())?.map_err(|err| match err.downcast::<EngineFailure>() {
        Ok(f) => *f,
        Err(refused) => {
            let f = EngineFailure::Malformed {
                op: "reset".into(),
                reply: refused.to_string(),
                why: "an engine must accept reset".into(),
            };
            break_engine(&f);
            f
        }
    })
}

/// Marks this thread's engine broken by `f` and stops it (nothing when none is installed).
pub(crate) fn break_engine(f: &EngineFailure) {
    let _ = with_engine(|e| {
        e.broken = Some(f.clone());
        e.stop();
    });
}

pub(crate) fn dtype_name(d: Dtype) -> &'static str {
    match d {
        Dtype::Bfloat16 => "bf16",
        Dtype::Uint32 => "u32",
        _ => "f32",
    }
}

fn tensor(a: &Array) -> AdapterResult<Value> {
    let b = kvsim_cache::bytes::ArrayBytes::of(a)?;
    Ok(json!({
        "dtype": dtype_name(b.dtype),
        "shape": b.shape,
        "b64": base64::engine::general_purpose::STANDARD.encode(b.words.le_bytes()),
    }))
}

/// The reply's tensor `field`, of `dtype`, whose shape must pass `fits` (`want` says what it should be).
pub(crate) fn tensor_from(
    op: &str,
    reply: &Value,
    field: &str,
    dtype: Dtype,
    want: &str,
    fits: impl Fn(&[i64]) -> bool,
) -> AdapterResult<Array> {
    let malformed =
        |why: String| -> AdapterError { fault(EngineFailure::Malformed { op: op.into(), reply: shorten(reply), why }) };
    let t = reply.get(field).ok_or_else(|| malformed(format!("no field {field:?}")))?;
    let shape: Vec<i64> = t
        .get("shape")
        .and_then(Value::as_array)
        .and_then(|s| s.iter().map(Value::as_i64).collect::<Option<Vec<_>>>())
        .ok_or_else(|| malformed(format!("{field}: no integer shape")))?;
    if t.get("dtype").and_then(Value::as_str) != Some(dtype_name(dtype)) {
        return Err(malformed(format!("{field}: dtype {:?}, expected {:?}", t.get("dtype"), dtype_name(dtype))));
    }
    let raw = frame::array_bytes(t).map_err(|why| malformed(format!("{field}: {why}")))?;
    let size = if dtype == Dtype::Bfloat16 { 2 } else { 4 }; // f32 and u32: 4
    let bytes =
        shape.iter().try_fold(
            size,
            |acc: i64, &d| if (0..=i64::from(i32::MAX)).contains(&d) { acc.checked_mul(d) } else { None },
        );
    if bytes != Some(raw.len() as i64) {
        return Err(malformed(format!("{field}: {} bytes for shape {shape:?}", raw.len())));
    }
    if !fits(&shape) {
        return Err(fault(EngineFailure::WrongShape {
            op: op.into(),
            field: field.into(),
            got: shape,
            want: want.into(),
        }));
    }
    let dims: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
    Ok(if dtype == Dtype::Bfloat16 {
        let v: Vec<half::bf16> =
            raw.chunks_exact(2).map(|c| half::bf16::from_bits(u16::from_le_bytes([c[0], c[1]]))).collect();
        Array::from_slice(&v, &dims)
    } else if dtype == Dtype::Uint32 {
        let v: Vec<u32> = raw.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        Array::from_slice(&v, &dims)
    } else {
        let v: Vec<f32> = raw.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        Array::from_slice(&v, &dims)
    })
}

pub(crate) fn shorten(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 400 {
        format!("{}...", &s[..s.char_indices().take_while(|(i, _)| *i < 400).last().map_or(0, |(i, _)| i)])
    } else {
        s
    }
}

pub(crate) fn usize_of(op: &str, reply: &Value, field: &str) -> AdapterResult<usize> {
    reply.get(field).and_then(Value::as_u64).map(|n| n as usize).ok_or_else(|| {
        fault(EngineFailure::Malformed { op: op.into(), reply: shorten(reply), why: format!("no count {field:?}") })
    })
}

fn read(op: &str, id: u64, k: &Array, v: &Array, q: &Array, scale: f32, g: &Geometry) -> AdapterResult<Array> {
    read_real(op, id, k, v, q, scale, g, None)
}

/// A read request; `real` (a right-padded prefill's window: each row's real positions in it, the rest padding) is
/// sent as the request's `real`, for reproducers (an engine may ignore it).
#[allow(clippy::too_many_arguments)]
fn read_real(
    op: &str,
    id: u64,
    k: &Array,
    v: &Array,
    q: &Array,
    scale: f32,
    g: &Geometry,
    real: Option<Vec<usize>>,
) -> AdapterResult<Array> {
    let reply = engine_call(read_request(op, id, k, v, q, scale, real)?)?;
    decode_out(op, &reply, q, g)
}

/// A read request (`window`, `decode`, `rows_window`, `rows_decode`).
fn read_request(
    op: &str,
    id: u64,
    k: &Array,
    v: &Array,
    q: &Array,
    scale: f32,
    real: Option<Vec<usize>>,
) -> AdapterResult<Value> {
    let mut req = json!({
        "op": op, "id": id, "k": tensor(k)?, "v": tensor(v)?, "q": tensor(q)?, "scale": scale,
    });
    if let Some(real) = real {
        req["real"] = json!(real);
    }
    Ok(req)
}

/// A read reply's `out`: the shape of `q`, of the run's dtype.
fn decode_out(op: &str, reply: &Value, q: &Array, g: &Geometry) -> AdapterResult<Array> {
    let want: Vec<i64> = q.shape().iter().map(|&d| i64::from(d)).collect();
    tensor_from(op, reply, "out", g.dtype, &format!("{want:?} (the query's)"), |s| s == want.as_slice())
}

fn state(op: &str, req: Value, g: &Geometry) -> AdapterResult<[Array; 2]> {
    decode_state(op, &engine_call(req)?, g)
}

/// A reply's `k` and `v` of geometry `g`: `[1, H_kv, n, D]` each.
fn decode_state(op: &str, reply: &Value, g: &Geometry) -> AdapterResult<[Array; 2]> {
    let (h, d) = (g.heads_kv as i64, g.head_dim as i64);
    let want = format!("[1, {h}, n, {d}]");
    let fits = |s: &[i64]| s.len() == 4 && s[0] == 1 && s[1] == h && s[3] == d;
    Ok([tensor_from(op, reply, "k", g.dtype, &want, fits)?, tensor_from(op, reply, "v", g.dtype, &want, fits)?])
}

/// A quantization as the protocol writes it (`new`'s `geometry.quant`, `convert`'s `quant`).
fn quant_json(q: QuantGeometry) -> Value {
    json!({"bits": q.bits, "group_size": q.group_size, "mode": "affine"})
}

fn planes(op: &str, req: Value, g: &Geometry) -> AdapterResult<[Array; 6]> {
    decode_planes(op, &engine_call(req)?, g)
}

/// A quantized cache's `state` reply of geometry `g`: `k` and `v` each an object of three arrays, `packed`
/// (`u32 [1, H_kv, n, D * bits / 32]`), `scales` and `biases` (`[1, H_kv, n, D / group_size]`, the run's dtype), one
/// `n` for all six.
pub(crate) fn decode_planes(op: &str, reply: &Value, g: &Geometry) -> AdapterResult<[Array; 6]> {
    let Some(q) = g.quant else { return Err("planes of a plain run".into()) };
    let (h, d) = (g.heads_kv as i64, g.head_dim as i64);
    let packed = d * q.bits as i64 / 32;
    let groups = d / q.group_size as i64;
    let mut n: Option<i64> = None;
    let mut out = vec![];
    for side in ["k", "v"] {
        let Some(obj) = reply.get(side) else {
            return Err(fault(EngineFailure::Malformed {
                op: op.into(),
                reply: shorten(reply),
                why: format!("no planes {side:?}"),
            }));
        };
        for (name, dtype, width) in
            [("packed", Dtype::Uint32, packed), ("scales", g.dtype, groups), ("biases", g.dtype, groups)]
        {
            let want = format!("[1, {h}, n, {width}] (one n for all six planes)");
            let field = format!("{side}.{name}");
            let fits =
                |s: &[i64]| s.len() == 4 && s[0] == 1 && s[1] == h && s[3] == width && n.is_none_or(|n| n == s[2]);
            let wrapped = json!({ field.as_str(): obj.get(name).cloned().unwrap_or(Value::Null) });
            let a = tensor_from(op, &wrapped, &field, dtype, &want, fits)?;
            n = Some(i64::from(a.shape()[2]));
            out.push(a);
        }
    }
    out.try_into().map_err(|_| "six planes".into())
}

/// The request of a state check's read.
fn check_request(r: &Read<'_, EngineSerial, EngineRows>) -> Value {
    match r {
        Read::Offset(s) => json!({"op": "offset", "id": s.id}),
        Read::State(s) | Read::Planes(s) => json!({"op": "state", "id": s.id}),
        Read::Info(b) => json!({"op": "rows_info", "id": b.id}),
        Read::RowState(b, row) | Read::RowPlanes(b, row) => json!({"op": "rows_state", "id": b.id, "row": row}),
    }
}

/// The refusal a reply `{"ok": false, "error": ...}` carries.
fn refused(reply: &Value) -> AdapterError {
    Box::new(EngineRefused(reply.get("error").map_or("no message".to_string(), |e| e.to_string())))
}

fn release(id: u64) {
    let _ = ENGINE.try_with(|e| {
        if let Ok(mut e) = e.try_borrow_mut() {
            if let Some(e) = e.as_mut() {
                e.frees.push(id);
            }
        }
    });
}

/// A serial cache living in the engine.
pub struct EngineSerial {
    id: u64,
    geometry: Geometry,
}

impl Drop for EngineSerial {
    fn drop(&mut self) {
        release(self.id);
    }
}

impl SerialUnderTest for EngineSerial {
    fn offset(&self) -> usize {
        engine_call(json!({"op": "offset", "id": self.id}))
            .and_then(|r| usize_of("offset", &r, "offset"))
            .unwrap_or(usize::MAX)
    }
    fn window(&mut self, k: &Array, v: &Array, q: &Array, scale: f32) -> AdapterResult<Array> {
        read("window", self.id, k, v, q, scale, &self.geometry)
    }
    fn decode(&mut self, k: &Array, v: &Array, q: &Array, scale: f32) -> AdapterResult<Array> {
        read("decode", self.id, k, v, q, scale, &self.geometry)
    }
    fn trim(&mut self, n: usize) -> AdapterResult<usize> {
        let r = engine_call(json!({"op": "trim", "id": self.id, "n": n}))?;
        usize_of("trim", &r, "trimmed")
    }
    fn state(&self) -> AdapterResult<[Array; 2]> {
        state("state", json!({"op": "state", "id": self.id}), &self.geometry)
    }
    fn planes(&self) -> AdapterResult<[Array; 6]> {
        planes("state", json!({"op": "state", "id": self.id}), &self.geometry)
    }
    fn convert(&mut self, quant: QuantGeometry) -> AdapterResult<()> {
        engine_call(json!({"op": "convert", "id": self.id, "quant": quant_json(quant)}))?;
        self.geometry.quant = Some(quant);
        Ok(())
    }
}

/// A batch living in the engine.
pub struct EngineRows {
    id: u64,
    geometry: Geometry,
    /// During a right-padded prefill: the rows' prompt lengths and the positions fed so far.
    prefill: Option<(Vec<usize>, usize)>,
}

impl Drop for EngineRows {
    fn drop(&mut self) {
        release(self.id);
    }
}

impl EngineRows {
    /// During a right-padded prefill, a window of `q`'s length: each row's real queries in it (the positions fed move
    /// on by that length).
    fn real(&mut self, q: &Array) -> Option<Vec<usize>> {
        self.prefill.as_mut().map(|(lens, from)| {
            let l = q.shape().get(2).map_or(0, |&l| l as usize);
            let real = lens.iter().map(|&n| n.saturating_sub(*from).min(l)).collect();
            *from += l;
            real
        })
    }
    fn info(&self) -> AdapterResult<(usize, Vec<usize>)> {
        decode_info(&engine_call(json!({"op": "rows_info", "id": self.id}))?)
    }
}

/// A `rows_trim_rows` reply's counts, one per row of a batch of `rows`; anything else is `malformed`.
pub(crate) fn decode_trimmed(r: &Value, rows: usize) -> AdapterResult<Vec<usize>> {
    let got: Option<Vec<usize>> = r
        .get("trimmed")
        .and_then(Value::as_array)
        .and_then(|a| a.iter().map(|x| x.as_u64().map(|x| x as usize)).collect());
    match got {
        Some(got) if got.len() == rows => Ok(got),
        _ => Err(fault(EngineFailure::Malformed {
            op: "rows_trim_rows".into(),
            reply: shorten(r),
            why: format!("no list of {rows} counts \"trimmed\""),
        })),
    }
}

/// A `rows_info` reply's row count and offsets. An offset below zero is a cache's answer, not a broken reply: an
/// error of the read (the state checks class it `offsets`), while a missing or non-integer list is `malformed`.
pub(crate) fn decode_info(r: &Value) -> AdapterResult<(usize, Vec<usize>)> {
    let rows = usize_of("rows_info", r, "rows")?;
    let offsets = r
        .get("offsets")
        .and_then(Value::as_array)
        .and_then(|o| o.iter().map(Value::as_i64).collect::<Option<Vec<_>>>())
        .ok_or_else(|| {
            fault(EngineFailure::Malformed { op: "rows_info".into(), reply: shorten(r), why: "no offsets".into() })
        })?;
    if offsets.iter().any(|&o| o < 0) {
        return Err(format!("the batch answered offsets {offsets:?}: a row below zero").into());
    }
    Ok((rows, offsets.into_iter().map(|o| o as usize).collect()))
}

impl RowsUnderTest for EngineRows {
    type Serial = EngineSerial;
    fn merge(rows: Vec<EngineSerial>) -> AdapterResult<Self> {
        let geometry = rows.first().ok_or("merge of no rows")?.geometry;
        let id = with_engine(|e| e.fresh_id())?;
        let ids: Vec<u64> = rows.iter().map(|r| r.id).collect();
        // The engine consumes the rows' caches: their handles must not free them again.
        std::mem::forget(rows);
        engine_call(json!({"op": "merge", "id": id, "rows": ids}))?;
        Ok(EngineRows { id, geometry, prefill: None })
    }
    fn extend(&mut self, other: Self) -> AdapterResult<()> {
        let oid = other.id;
        std::mem::forget(other);
        engine_call(json!({"op": "extend", "id": self.id, "other": oid}))?;
        Ok(())
    }
    fn rows(&self) -> usize {
        self.info().map(|i| i.0).unwrap_or(usize::MAX)
    }
    fn offsets(&self) -> Vec<usize> {
        self.info().map(|i| i.1).unwrap_or_default()
    }
    fn decode(&mut self, k: &Array, v: &Array, q: &Array, scale: f32) -> AdapterResult<Array> {
        read("rows_decode", self.id, k, v, q, scale, &self.geometry)
    }
    fn window(&mut self, k: &Array, v: &Array, q: &Array, scale: f32) -> AdapterResult<Array> {
        let real = self.real(q);
        read_real("rows_window", self.id, k, v, q, scale, &self.geometry, real)
    }
    fn convert(&mut self, quant: QuantGeometry) -> AdapterResult<()> {
        engine_call(json!({"op": "rows_convert", "id": self.id, "quant": quant_json(quant)}))?;
        self.geometry.quant = Some(quant);
        Ok(())
    }
    fn prepare(&mut self, lengths: &[usize]) -> AdapterResult<()> {
        let width = lengths.iter().copied().max().unwrap_or(0);
        let right: Vec<usize> = lengths.iter().map(|&n| width - n).collect();
        engine_call(json!({"op": "rows_prepare", "id": self.id, "lengths": lengths, "right_padding": right}))?;
        self.prefill = Some((lengths.to_vec(), 0));
        Ok(())
    }
    fn finalize(&mut self) -> AdapterResult<()> {
        self.prefill = None;
        engine_call(json!({"op": "rows_finalize", "id": self.id}))?;
        Ok(())
    }
    fn extract(&self, row: usize) -> AdapterResult<EngineSerial> {
        let new = with_engine(|e| e.fresh_id())?;
        engine_call(json!({"op": "extract", "id": self.id, "row": row, "new": new}))?;
        Ok(EngineSerial { id: new, geometry: self.geometry })
    }
    fn filter(&mut self, keep: &[usize]) -> AdapterResult<()> {
        engine_call(json!({"op": "filter", "id": self.id, "keep": keep}))?;
        Ok(())
    }
    fn trim(&mut self, n: usize) -> AdapterResult<usize> {
        let r = engine_call(json!({"op": "rows_trim", "id": self.id, "n": n}))?;
        usize_of("rows_trim", &r, "trimmed")
    }
    fn trim_rows(&mut self, n: &[usize]) -> AdapterResult<Vec<usize>> {
        decode_trimmed(&engine_call(json!({"op": "rows_trim_rows", "id": self.id, "n": n}))?, n.len())
    }
    fn row_state(&self, row: usize) -> AdapterResult<[Array; 2]> {
        state("rows_state", json!({"op": "rows_state", "id": self.id, "row": row}), &self.geometry)
    }
    fn row_planes(&self, row: usize) -> AdapterResult<[Array; 6]> {
        planes("rows_state", json!({"op": "rows_state", "id": self.id, "row": row}), &self.geometry)
    }
}

/// The engine installed on this thread, as a cache under test.
pub struct EngineCache;

impl Adapter for EngineCache {
    const NAME: &'static str = "engine";
    fn supports() -> Supports {
        with_engine(|e| e.hello.supports).unwrap_or_default()
    }
    fn begin_run() -> AdapterResult<()> {
        with_engine(|e| e.begin())?
    }
    type Serial = EngineSerial;
    type Rows = EngineRows;
    /// With `supports.batch`, every read in one `batch` request; else one request each.
    fn read_all(reads: &[Read<'_, EngineSerial, EngineRows>]) -> Vec<AdapterResult<ReadOut>> {
        if !with_engine(|e| e.hello.batch).unwrap_or(false) || reads.is_empty() {
            return read_each(reads);
        }
        let requests: Vec<Value> = reads.iter().map(check_request).collect();
        let replies = match with_engine(|e| match e.take_prefetched(&requests) {
            Some(r) => Ok(r),
            None => {
                e.tail.clear(); // a prefetch is carried by a read group's batch only
                e.request_batch(requests)
            }
        }) {
            Ok(Ok(r)) => r,
            Ok(Err(f)) | Err(f) => return reads.iter().map(|_| Err(Box::new(f.clone()) as AdapterError)).collect(),
        };
        reads
            .iter()
            .zip(&replies)
            .map(|(r, reply)| {
                let ok = reply["ok"] == Value::Bool(true);
                match r {
                    // The traits give offsets no error path: a refusal reads as an impossible count, as one by one.
                    Read::Offset(_) => Ok(ReadOut::Offset(if ok {
                        usize_of("offset", reply, "offset").unwrap_or(usize::MAX)
                    } else {
                        usize::MAX
                    })),
                    Read::Info(_) if ok => decode_info(reply).map(|(n, o)| ReadOut::Info(n, o)),
                    Read::Info(_) => Ok(ReadOut::Info(usize::MAX, vec![])),
                    Read::State(s) if ok => decode_state("state", reply, &s.geometry).map(ReadOut::State),
                    Read::RowState(b, _) if ok => decode_state("rows_state", reply, &b.geometry).map(ReadOut::State),
                    Read::Planes(s) if ok => decode_planes("state", reply, &s.geometry).map(ReadOut::Planes),
                    Read::RowPlanes(b, _) if ok => decode_planes("rows_state", reply, &b.geometry).map(ReadOut::Planes),
                    Read::State(_) | Read::RowState(..) | Read::Planes(_) | Read::RowPlanes(..) => Err(refused(reply)),
                }
            })
            .collect()
    }
    /// With `supports.batch`, the reads go with the next [`Adapter::read_group`]'s batch.
    fn prefetch(reads: &[Read<'_, EngineSerial, EngineRows>]) {
        let _ = with_engine(|e| {
            if e.hello.batch && !reads.is_empty() {
                e.tail = reads.iter().map(check_request).collect();
            }
        });
    }
    /// With `supports.batch`, the group's reads in one `batch` request (the twins' replies are ignored by the caller
    /// after a refused batch read); else one request each.
    fn read_group(reads: Vec<GroupRead<'_, EngineSerial, EngineRows>>, scale: f32) -> Vec<AdapterResult<Array>> {
        if !with_engine(|e| e.hello.batch).unwrap_or(false) || reads.len() < 2 {
            return read_group_each(reads, scale);
        }
        let n = reads.len();
        let mut requests = vec![];
        let mut decoding = vec![];
        for r in reads {
            let (op, id, geometry, real) = match r.target {
                Target::Serial(s) => (if r.decode { "decode" } else { "window" }, s.id, s.geometry, None),
                Target::Rows(b) if r.decode => ("rows_decode", b.id, b.geometry, None),
                Target::Rows(b) => ("rows_window", b.id, b.geometry, b.real(r.q)),
            };
            match read_request(op, id, r.k, r.v, r.q, scale, real) {
                Ok(req) => requests.push(req),
                // An input kvsim cannot encode: nothing is sent.
                Err(e) => return std::iter::once(Err(e)).chain((1..n).map(|_| Err("not sent".into()))).collect(),
            }
            decoding.push((op, r.q, geometry));
        }
        let replies = match with_engine(|e| e.request_batch(requests)) {
            Ok(Ok(r)) => r,
            Ok(Err(f)) | Err(f) => return decoding.iter().map(|_| Err(Box::new(f.clone()) as AdapterError)).collect(),
        };
        decoding
            .iter()
            .zip(&replies)
            .map(
                |((op, q, g), reply)| {
                    if reply["ok"] == Value::Bool(true) {
                        decode_out(op, reply, q, g)
                    } else {
                        Err(refused(reply))
                    }
                },
            )
            .collect()
    }
    fn serial(g: &Geometry) -> AdapterResult<EngineSerial> {
        let id = with_engine(|e| e.fresh_id())?;
        let mut geometry = json!({
            "heads_kv": g.heads_kv, "heads_q": g.heads_q, "head_dim": g.head_dim, "dtype": dtype_name(g.dtype),
            "max_size": g.max_size,
        });
        if let Some(q) = g.quant {
            geometry["quant"] = quant_json(q);
        }
        engine_call(json!({"op": "new", "id": id, "geometry": geometry}))?;
        Ok(EngineSerial { id, geometry: *g })
    }
}

#[cfg(test)]
mod tests;
