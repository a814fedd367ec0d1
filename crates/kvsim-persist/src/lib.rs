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
