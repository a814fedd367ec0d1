//! kvsim's one integration-test crate (matklad: one binary, many modules).
mod architecture;
mod corpus;
mod determinism;
mod fuzz_corpus;
mod oracle;
mod sim_smoke;
mod traces;
