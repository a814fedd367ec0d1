//! Traces: versioned JSON files that replay a run exactly.
//!
//! ```json
//! {"format": "kvsim-trace", "version": 1, "seed": 7, "config": {...}, "mlx_version": "0.32.2", "device": "cpu",
//!  "mutant": null, "ops": [{"op": "admit", "req": 0}, ...], "digests": ["<hex>", ...], "result_hash": "<hex>",
//!  "outcome": {"status": "pass"} | {"status": "fail", "op_index": 12, "check": "layout", "message": "..."},
//!  "expect": "pass" | "fail"}
//! ```
//! `expect` is what a corpus replay requires (a regression must pass; a recorded known-bad semantics must fail with
//! the recorded `check`). Parsing never panics: every malformed input is a [`TraceError`].

use serde::{Deserialize, Serialize};

use crate::sim::config::SimConfig;
use crate::sim::ops::Op;
use kvsim_cache::faults::Mutant;

pub const FORMAT: &str = "kvsim-trace";
pub const VERSION: u32 = 1;

/// How a run ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum Outcome {
    Pass,
    Fail { op_index: usize, check: String, message: String },
}

/// What a corpus replay must observe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Expect {
    #[default]
    Pass,
    /// Fail exactly as `outcome` records (same check, same op index).
    Fail,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Trace {
    pub format: String,
    pub version: u32,
    pub seed: u64,
    pub config: SimConfig,
    pub mlx_version: String,
    pub device: String,
    #[serde(default)]
    pub mutant: Option<Mutant>,
    pub ops: Vec<Op>,
    #[serde(default)]
    pub digests: Vec<String>,
    #[serde(default)]
    pub result_hash: String,
    pub outcome: Outcome,
    #[serde(default)]
    pub expect: Expect,
    /// Free text: why this trace is in the corpus.
    #[serde(default)]
    pub note: String,
}

/// Why a trace could not be used.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error("cannot read {path}: {source}")]
    Io { path: String, source: std::io::Error },
    #[error("not a kvsim trace: {0}")]
    Json(#[from] serde_json::Error),
    #[error("format is {0:?}, expected {FORMAT:?}")]
    Format(String),
    #[error("trace version {0} is not supported (this kvsim reads version {VERSION})")]
    Version(u32),
    #[error("config is invalid: {0}")]
    Config(String),
}

impl Trace {
    /// Parses and validates a trace. Never panics.
    pub fn parse(text: &str) -> Result<Trace, TraceError> {
        let t: Trace = serde_json::from_str(text)?;
        if t.format != FORMAT {
            return Err(TraceError::Format(t.format));
        }
        if t.version != VERSION {
            return Err(TraceError::Version(t.version));
        }
        t.config.validate().map_err(TraceError::Config)?;
        Ok(t)
    }

    pub fn load(path: &std::path::Path) -> Result<Trace, TraceError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| TraceError::Io { path: path.display().to_string(), source })?;
        Trace::parse(&text)
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a trace always serializes")
    }
}

impl SimConfig {
    /// Bounds a replayed (possibly hand-edited or fuzzed) config must respect, so a trace cannot ask for absurd sizes.
    pub fn validate(&self) -> Result<(), String> {
        let bad = |what: &str| Err(what.to_string());
        if self.heads_kv == 0 || self.heads_kv > 16 {
            return bad("heads_kv must be 1..=16");
        }
        if self.heads_q == 0 || !self.heads_q.is_multiple_of(self.heads_kv) || self.heads_q > 64 {
            return bad("heads_q must be a positive multiple of heads_kv, at most 64");
        }
        if self.head_dim == 0 || self.head_dim > 256 {
            return bad("head_dim must be 1..=256");
        }
        if self.layers == 0 || self.layers > 8 {
            return bad("layers must be 1..=8");
        }
        if let Some(w) = self.layout.max_size() {
            if w == 0 || w > 4096 {
                return bad("window must be 1..=4096");
            }
        }
        if self.max_batch == 0 || self.max_batch > 64 {
            return bad("max_batch must be 1..=64");
        }
        Ok(())
    }
}
