//! The pure-Rust reference model of every layout (no accelerator library: plain integers and f64).
//!
//! The model answers three questions independently of the production layouts in `src/cache`:
//!
//! 1. **Which token sits in which physical column** of every row ([`RowModel`], [`BatchModel`]), following
//!    ARCHITECTURE.md's serial core, implemented by positions (the oldest position is the one a full ring
//!    overwrites; temporal order is the columns sorted by position), with the production's host-side fields
//!    (`offset`, `len`, `idx`, `last_concat`, `base`, `pending`) tracked for field-by-field comparison.
//! 2. **What every stored byte should be** ([`ValueSpace`]): every K/V/Q value is a pure function of
//!    `(seed, layer, tensor, request, position, head, dim)` rounded to the dtype, so the bytes found in a column
//!    identify the token that wrote them ([`ValueSpace::identify`]); padded slots hold conspicuous poison.
//! 3. **What every read should return** ([`attention_f64`]): f64 attention over the keys each query may see
//!    ([`RowModel::decode_visible`], [`RowModel::window_visible`]), measured against the found output in ULPs
//!    ([`max_ulp`]).
//!
//! 4. **What the training masks and special reads see** ([`training_visible`], [`prefix_shared_visible`],
//!    [`bidirectional_visible`], [`encoder_visible`], [`read_block_context`]), in its own formulation of each rule.
//! 4. **What a gated-DeltaNet layer's cache should hold and return** ([`SsmRowModel`], [`SsmValues`]): the exact
//!    conv tail and the f64 recurrence (ssm.rs).
//!
//! Divergences are reported in these terms ([`compare_columns`], [`compare_fields`], [`Divergence`]): op, row,
//! physical column, the token expected there and the token actually found.
//!
//! Guarantees: no panic on any input; impossible requests are [`ModelError`]s; no dependency on the caches, the
//! harness or any array library (this crate's manifest names none).
#![cfg_attr(test, allow(clippy::print_stdout, clippy::print_stderr))]

pub mod attention;
pub mod compare;
pub mod error;
mod memo;
pub mod model;
pub mod paged;
pub mod quant;
pub mod special;
pub mod ssm;
pub mod transition;
pub mod values;

pub use attention::{attention_bits, attention_f64};
pub use compare::{bits_summary, columns_of, compare_columns, compare_fields, describe_found, Divergence};
pub use error::ModelError;
pub use model::{BatchModel, JoinModelSource, RowFields, RowModel, Visibility};
pub use quant::{Quantized, RefQuant};
pub use special::{
    bidirectional_visible, encoder_visible, prefix_shared_positions, prefix_shared_visible, read_block_context,
    training_visible,
};
pub use ssm::{SsmDims, SsmRowModel, SsmToken, SsmValues, SsmWeights};
pub use values::{
    bits_to_f32, max_ulp, round_to, ulp_bf16, ulp_bits, ulp_distance, ulp_f32, BitsKind, FloatFormat, RefDtype, Tensor,
    Tok, ValueSpace,
};
