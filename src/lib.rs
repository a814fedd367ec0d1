//! kvsim: KV-cache layouts on MLX, and a deterministic simulator that proves them bit-exact against solo runs.
//!
//! See ARCHITECTURE.md for the codemap and the invariants. Modules:
//! - [`cache`]: the production layouts (the system under test).
//! - [`reference`]: the pure-Rust model of every layout (no MLX).
//! - [`sim`]: seeds, op alphabet, traces, runner, checks, shrinking.
//! - [`bytes`]: byte-level views of MLX arrays; every bit-exact claim goes through it.
pub mod bench;
pub mod bytes;
pub mod cache;
pub mod campaign;
pub mod doctor;
pub mod fuzzing;
pub mod oracle;
pub mod reference;
pub mod sim;
