//! Reading an engine's replies: JSON lines, and binary frames where both sides agreed on them in `hello`
//! (oracles/PROTOCOL.md, "Binary frames"). A binary frame is a JSON line that starts with `{"blob":N,` followed by
//! exactly `N` raw bytes; its arrays name a span of those bytes (`"off"`, `"len"`) instead of carrying `"b64"`.
//! Any bytes give a frame, a cut-off line, a typed complaint or the end, never a panic (the `engine_reply` fuzz
//! target reads its input through [`next_frame`] too).

use std::cell::RefCell;
use std::io::{self, BufRead, Read};
use std::os::fd::AsRawFd;
use std::process::ChildStdout;
use std::time::Instant;

use base64::Engine as _;
use serde_json::Value;

/// How a binary frame's line starts; the byte count follows.
pub const BLOB_PREFIX: &str = "{\"blob\":";

/// The most bytes one frame may carry (1 GiB).
pub const MAX_BLOB: usize = 1 << 30;

/// What the engine's output gave next.
#[derive(Debug, PartialEq, Eq)]
pub enum Line {
    /// A line ending in `\n`, and the bytes of its frame (empty for a JSON line).
    Full(String, Vec<u8>),
    /// The output ended inside a line, or inside a frame's bytes.
    Cut(String),
    /// A frame whose byte count is not one: the line and why.
    Bad(String, String),
    /// The output ended (or was not UTF-8).
    End,
    /// Nothing (or not all of it) came before the deadline ([`Timed`]).
    TimedOut,
}

/// An engine's standard output whose reads wait at most until `deadline` (then `ErrorKind::TimedOut`): kvsim reads
/// replies on its own thread, with no reader thread between it and the pipe.
pub struct Timed {
    out: ChildStdout,
    pub deadline: Instant,
}

impl Timed {
    pub fn new(out: ChildStdout) -> Timed {
        Timed { out, deadline: Instant::now() }
    }
}

impl Read for Timed {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let left = self.deadline.saturating_duration_since(Instant::now());
            let ms = i32::try_from(left.as_millis()).unwrap_or(i32::MAX);
            let mut p = libc::pollfd { fd: self.out.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd, owned by this frame, for the duration of the call.
            let r = unsafe { libc::poll(&mut p, 1, ms) };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            if r == 0 {
                return Err(io::ErrorKind::TimedOut.into());
            }
            return self.out.read(buf);
        }
    }
}

fn timed_out(e: &io::Error) -> bool {
    e.kind() == io::ErrorKind::TimedOut
}

/// The next line (and, with `binary`, the bytes of a binary frame) of `r`.
pub fn next_frame(r: &mut impl BufRead, binary: bool) -> Line {
    let mut s = String::new();
    match r.read_line(&mut s) {
        Err(e) if timed_out(&e) => return Line::TimedOut,
        Ok(0) | Err(_) => return Line::End,
        Ok(_) if !s.ends_with('\n') => return Line::Cut(s),
        Ok(_) => {}
    }
    let Some(rest) = s.strip_prefix(BLOB_PREFIX).filter(|_| binary) else { return Line::Full(s, vec![]) };
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    let count = rest[..digits].parse::<usize>().ok().filter(|&n| n <= MAX_BLOB);
    let (Some(n), Some(b',' | b'}')) = (count, rest.as_bytes().get(digits)) else {
        return Line::Bad(s, format!("a binary frame's \"blob\" must be a byte count of at most {MAX_BLOB}"));
    };
    let mut blob = Vec::with_capacity(n.min(1 << 20));
    match r.take(n as u64).read_to_end(&mut blob) {
        Ok(got) if got == n => Line::Full(s, blob),
        Err(e) if timed_out(&e) => Line::TimedOut,
        _ => Line::Cut(format!("{}... ({} of the frame's {n} bytes)", s.trim_end(), blob.len())),
    }
}

thread_local! {
    /// The bytes of the last reply read on this thread (empty for a JSON line).
    static BLOB: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// Makes `blob` the bytes the arrays of the reply just read refer to.
pub fn set_blob(blob: Vec<u8>) {
    BLOB.with(|b| *b.borrow_mut() = blob);
}

/// The bytes of the last reply read on this thread.
pub fn blob() -> Vec<u8> {
    BLOB.with(|b| b.borrow().clone())
}

/// An array's element bytes: its base64 `b64`, or its span `off`, `len` of the current reply's frame bytes. `Err`
/// says what is wrong.
pub fn array_bytes(t: &Value) -> Result<Vec<u8>, String> {
    if let Some(s) = t.get("b64") {
        return s
            .as_str()
            .and_then(|s| base64::engine::general_purpose::STANDARD.decode(s).ok())
            .ok_or_else(|| "no base64 \"b64\"".to_string());
    }
    let (Some(off), Some(len)) = (t.get("off").and_then(Value::as_u64), t.get("len").and_then(Value::as_u64)) else {
        return Err("no base64 \"b64\" nor a span \"off\", \"len\" of the frame's bytes".into());
    };
    BLOB.with(|b| {
        let b = b.borrow();
        off.checked_add(len)
            .filter(|&end| end <= b.len() as u64)
            .map(|end| b[off as usize..end as usize].to_vec())
            .ok_or_else(|| format!("span [{off}, {off} + {len}) outside the frame's {} bytes", b.len()))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(bytes: &[u8]) -> Vec<Line> {
        let mut r = std::io::Cursor::new(bytes);
        let mut out = vec![];
        loop {
            let l = next_frame(&mut r, true);
            let end = !matches!(l, Line::Full(..));
            out.push(l);
            if end {
                return out;
            }
        }
    }

    #[test]
    fn a_frame_is_its_line_and_exactly_its_bytes() {
        let got = frames(b"{\"blob\":3,\"ok\":true}\nabc{\"ok\":true}\n");
        assert_eq!(got[0], Line::Full("{\"blob\":3,\"ok\":true}\n".into(), b"abc".to_vec()));
        assert_eq!(got[1], Line::Full("{\"ok\":true}\n".into(), vec![]));
        assert_eq!(got[2], Line::End);
    }

    #[test]
    fn bad_counts_and_short_bytes_are_typed() {
        assert!(matches!(&frames(b"{\"blob\":x}\n")[0], Line::Bad(_, why) if why.contains("byte count")));
        assert!(matches!(&frames(b"{\"blob\":99999999999}\n")[0], Line::Bad(..)));
        assert!(matches!(&frames(b"{\"blob\":3 ,\"ok\":true}\n")[0], Line::Bad(..)));
        assert!(
            matches!(&frames(b"{\"blob\":5,\"ok\":true}\nab")[0], Line::Cut(s) if s.contains("2 of the frame's 5"))
        );
        // Without binary frames agreed, the same line is a JSON line.
        let mut r = std::io::Cursor::new(&b"{\"blob\":x}\n"[..]);
        assert_eq!(next_frame(&mut r, false), Line::Full("{\"blob\":x}\n".into(), vec![]));
    }

    #[test]
    fn spans_outside_the_frame_are_refused() {
        set_blob(b"abcd".to_vec());
        assert_eq!(array_bytes(&serde_json::json!({"off": 1, "len": 2})), Ok(b"bc".to_vec()));
        assert!(array_bytes(&serde_json::json!({"off": 3, "len": 2})).unwrap_err().contains("outside"));
        assert!(array_bytes(&serde_json::json!({"off": u64::MAX, "len": 2})).is_err());
        assert!(array_bytes(&serde_json::json!({"off": -1, "len": 2})).is_err());
        assert_eq!(array_bytes(&serde_json::json!({"b64": "AAE="})), Ok(vec![0, 1]));
        set_blob(vec![]);
    }
}
