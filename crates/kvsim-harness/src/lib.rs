//! kvsim's deterministic simulation harness: one `u64` seed decides a swarm configuration and an op stream of
//! admit / merge / join / extract / filter / trim / speculative-rollback / persist; one run loop applies it to
//! every registered layout family and checks every row, after every op, against its solo twin and the reference
//! model.
//!
//! - [`sim`]: seeds, swarm config, op alphabet, generator, the run loop, families, checks, traces, shrinking.
//! - [`byoc`]: a cache written outside kvsim, driven by the same run loop through a small adapter.
//! - [`campaign`]: many seeds folded into one typed summary and one result hash; mutant hunts.
//! - [`shard`]: campaigns split over processes and machines, merged by seed.
//! - [`soak`]: long runs that sample memory and fail on growth after warm-up.
//! - [`fuzzing`]: the entry points of the cargo-fuzz targets.
//!
//! The harness never prints: every result is a value its caller reports.
#![cfg_attr(test, allow(clippy::print_stdout, clippy::print_stderr))]

pub mod byoc;
pub mod campaign;
pub mod fuzzing;
pub mod shard;
pub mod sim;
pub mod soak;
