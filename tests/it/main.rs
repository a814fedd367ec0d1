//! kvsim's one integration-test crate (matklad: one binary, many modules).
mod architecture;
mod cache_contracts;
mod common;
mod corpus;
mod determinism;
mod fuzz_corpus;
mod mutants;
mod oracle;
mod quant;
mod sim_smoke;
mod snapshots;
mod state_machine;
mod traces;
mod transition;
