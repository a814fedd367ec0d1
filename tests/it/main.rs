//! kvsim's one integration-test crate (matklad: one binary, many modules).
mod architecture;
mod corpus;
mod determinism;
mod fuzz_corpus;
mod mutants;
mod oracle;
mod sim_smoke;
mod traces;

/// Mutants are armed process-wide (`kvsim::cache::mutation::arm`), and the tests of this crate run in parallel
/// threads: a test that replays mutant traces holds this lock exclusively ([`arming`]), a test that runs the
/// production caches and needs them unmutated holds it shared ([`unmutated`]).
static MUTANTS: std::sync::RwLock<()> = std::sync::RwLock::new(());

pub(crate) fn unmutated() -> std::sync::RwLockReadGuard<'static, ()> {
    MUTANTS.read().unwrap_or_else(|e| e.into_inner())
}

pub(crate) fn arming() -> std::sync::RwLockWriteGuard<'static, ()> {
    MUTANTS.write().unwrap_or_else(|e| e.into_inner())
}
