//! Bad input gets a clear, typed error: malformed traces never panic.
use kvsim::sim::trace::{Trace, TraceError};
use kvsim::sim::{run_seed, DeviceChoice};

#[test]
fn malformed_traces_are_typed_errors() {
    assert!(matches!(Trace::parse("not json"), Err(TraceError::Json(_))));
    assert!(matches!(Trace::parse("{}"), Err(TraceError::Json(_))));
    let good = run_seed(3, DeviceChoice::Cpu, None).trace;
    let text = good.to_json();
    assert!(Trace::parse(&text).is_ok());
    let v2 = text.replacen("\"version\": 1", "\"version\": 99", 1);
    assert!(matches!(Trace::parse(&v2), Err(TraceError::Version(99))));
    let fmt = text.replacen("\"format\": \"kvsim-trace\"", "\"format\": \"other\"", 1);
    assert!(matches!(Trace::parse(&fmt), Err(TraceError::Format(_))));
    let heads = text.replacen("\"head_dim\": ", "\"head_dim\": 100000", 1);
    assert!(Trace::parse(&heads).is_err());
    // Truncations at every length are errors, never panics.
    for cut in (0..text.len()).step_by(97) {
        assert!(Trace::parse(&text[..cut]).is_err());
    }
    let missing = Trace::load(std::path::Path::new("/nonexistent/trace.json"));
    assert!(matches!(missing, Err(TraceError::Io { .. })));
}
