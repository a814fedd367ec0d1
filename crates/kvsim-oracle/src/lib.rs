//! The differential oracle against mlx-lm (`oracles/PROTOCOL.md`, `oracles/README.md`).
//!
//! - [`record()`]: replays a kvsim trace with a [`Recorder`](recorder::Recorder) in the runner, giving the protocol
//!   steps and kvsim's own result records.
//! - [`run_driver`]: runs the Python driver (`oracles/mlx_lm/driver.py`, in the venv `setup.sh` creates) on the
//!   steps and parses its results.
//! - [`diff()`]: compares kvsim's results with the oracle's, step by step, and classifies every divergence: a
//!   documented semantic choice, an mlx-lm bug of the catalog, an unsupported mapping, or **unclassified**. A
//!   divergence that changes state (a **root**) explains only what it touched (its requests, or the running batch
//!   and its rows until the batch is gone; a request until it finishes); everything else keeps being compared.
//!   Where the driver re-synced mlx-lm by replay (`PROTOCOL.md` decision 14), nothing is left to explain.
//! - [`check_dir`]: the recorded set (`oracles/recorded/NAME.trace.json` + `NAME.oracle.jsonl`, the driver's
//!   results), compared without Python.
//!
//! The modules, one job each (their items are re-exported here):
//!
//! - `record`: kvsim's side, a trace replayed with the recorder; the run each family records.
//! - `set`: `kvsim oracle record`, the chosen seeds recorded through both sides and stored.
//! - `driver`: the Python driver, its venv, running it, and the protocol's RESULTS read and written back.
//! - `choose`: the choice of the recorded seeds (what a recording covers, greedy covers).
//! - `rules`: the classification rules, their layouts and sizes, and the bounded scope of a root.
//! - `diff`: the step-by-step diff of both sides' results, classification applied, reads measured in ULPs.
//! - `report`: the recorded set compared without Python, and the lines `kvsim oracle diff` / `check` print.
//! - `redrive`: `kvsim oracle redrive`, the driver re-run over the stored traces.
//! - [`recorder`]: the protocol steps and kvsim's result records, written while the runner runs.
//! - [`teeth`]: `kvsim oracle teeth`, the mutants the oracle alone catches.
#![cfg_attr(test, allow(clippy::print_stdout, clippy::print_stderr))]

mod choose;
mod diff;
mod driver;
mod record;
pub mod recorder;
mod redrive;
mod report;
mod rules;
mod set;
pub mod teeth;
#[cfg(test)]
mod tests;

pub use choose::{choose_family_seeds, choose_seeds, describe_choice, features, predicted_root, quant_features};
pub use diff::{diff, diff_counted, diff_full, diff_measured, output_dtype, Divergence, Measure};
pub use driver::{driver_dir, parse_results, parse_solo, parse_values, run_driver, setup_driver, strip_known_values};
pub use record::{family_prefix, family_run, record, Recording};
pub use redrive::redrive_set;
pub use report::{check_dir, diff_recorded, recorded_traces, step_kinds, CheckReport, TraceReport, STEP_KINDS};
pub use rules::{
    mlx_refuses_quant, padding_in_window_rows, Class, Rule, Verdict, READ_RULE_ULP_BF16, READ_RULE_ULP_F32, RESYNCED,
};
pub use set::record_set;
