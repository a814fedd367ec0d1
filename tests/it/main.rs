//! kvsim's one integration-test crate (matklad: one binary, many modules).
mod architecture;
mod cache_contracts;
mod common;
mod corpus;
mod determinism;
mod fuzz_corpus;
mod mutants;
mod oracle;
mod sim_smoke;
mod snapshots;
mod special_reads;
mod state_machine;
mod traces;
