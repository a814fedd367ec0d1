//! kvsim: KV-cache layouts on MLX, and a deterministic simulator that proves them bit-exact against solo runs.
//!
//! This package is the `kvsim` command line. Its library re-exports the workspace's crates under short names for
//! the command's own modules and its integration tests; an engine that wants the caches depends on `kvsim-cache`
//! alone (ARCHITECTURE.md has the codemap):
//! - [`cache`] (`kvsim-cache`): the production layouts, and [`bytes`], the byte views every bit-exact claim uses.
//! - [`reference`](mod@reference) (`kvsim-reference`): the pure-Rust model of every layout (no MLX).
//! - [`persist`] (`kvsim-persist`): cache files by storage kind, kvsim's format and mlx-lm's.
//! - [`sim`], [`byoc`], [`campaign`], [`shard`], [`soak`], [`fuzzing`] (`kvsim-harness`): the simulator and its campaigns.
//! - [`oracle`] (`kvsim-oracle`): the mlx-lm differential oracle.
//! - [`show`] (`kvsim-show`): a trace replayed and drawn as an HTML page or terminal text (`kvsim show`).
//! - [`bench`](mod@bench), [`doctor`], [`exact_check`]: the command line's own measurements.
#![allow(clippy::print_stdout, clippy::print_stderr)]

pub use kvsim_cache as cache;
pub use kvsim_cache::bytes;
pub use kvsim_harness::{byoc, campaign, fuzzing, pin, shard, sim, soak};
pub use kvsim_oracle as oracle;
pub use kvsim_persist as persist;
pub use kvsim_reference as reference;
pub use kvsim_show as show;

pub mod bench;
pub mod doctor;
pub mod exact_check;
