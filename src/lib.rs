//! kvsim: KV-cache layouts on MLX, and a deterministic simulator that proves them bit-exact against solo runs.
//!
//! See ARCHITECTURE.md for the codemap and the invariants. Modules:
//! - [`cache`]: the production layouts (the system under test).
//! - [`reference`]: the pure-Rust model of every layout (no MLX).
//! - [`sim`]: seeds, op alphabet, traces, runner, checks, shrinking.
//! - [`bytes`]: byte-level views of MLX arrays; every bit-exact claim goes through it.
//! - [`shard`]: seed campaigns split over processes and machines (shards, per-seed hashes, merging).
//! - [`soak`]: long runs that sample MLX and process memory and fail on growth after warm-up.
pub mod bench;
pub mod bytes;
pub mod cache;
pub mod campaign;
pub mod doctor;
pub mod exact_check;
pub mod fuzzing;
pub mod oracle;
pub mod persist;
pub mod reference;
pub mod shard;
pub mod sim;
pub mod soak;
