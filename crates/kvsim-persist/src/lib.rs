//! Persistence by storage kind (R-P-1): caches saved and restored byte-exactly, in kvsim's own file format and in
//! mlx-lm's prompt-cache files.
//!
//! - [`codec`]: the codec registry keyed by storage kind ([`Registry`], [`Codec`], [`AnyCache`], [`Persisted`]).
//! - [`kvsim`]: kvsim's own format (versioned, checksummed header, per-tensor sha256, atomic write).
//! - [`mlxlm`]: mlx-lm 0.32.2 prompt-cache files (safetensors + metadata), both ways, and the mapping of mlx-lm's
//!   cache classes onto kvsim layouts.
//! - [`inspect`]: what `kvsim cache inspect` and `kvsim cache convert` do.
//! - [`PersistError`]: every failure, typed; a bad file never panics and never yields a cache.
//!
//! Depends on `src/cache` only (never on `src/sim` or `src/reference`).
#![cfg_attr(test, allow(clippy::print_stdout, clippy::print_stderr))]

/// Whether the fault hook of the named catalog mutant fires here (the caches' `faults` module; with the feature
/// `faults` only).
#[cfg(feature = "faults")]
macro_rules! fault {
    ($m:ident) => {
        kvsim_cache::faults::is(kvsim_cache::faults::Mutant::$m)
    };
}

/// Without the feature `faults` every fault hook is the constant `false`, so none is compiled.
#[cfg(not(feature = "faults"))]
macro_rules! fault {
    ($m:ident) => {
        false
    };
}

pub mod codec;
pub mod error;
pub mod inspect;
pub mod kvsim;
pub mod mlxlm;
pub mod tensor;
#[cfg(test)]
mod tests;

pub use codec::{AnyCache, Codec, Entry, Persisted, Registry};
pub use error::{PersistError, Result};
pub use tensor::{HostTensor, TensorDtype};
