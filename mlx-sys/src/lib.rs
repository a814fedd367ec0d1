//! Raw bindings to the MLX C API (mlx-c 0.7.0), built for Linux against a prebuilt MLX 0.32.2.
//!
//! This crate replaces the crates.io `mlx-sys` (which links Apple frameworks) for `mlx-rs = "=0.33.0"`.
//! `build.rs` finds or fetches everything it needs; see its module docs for the environment overrides.
//! The items below the generated bindings are the ones mlx-rs uses that x86-64 mlx-c leaves out; their
//! C definitions live in `native/x86_shims.cpp`.
#![allow(non_upper_case_globals, non_camel_case_types, non_snake_case, clippy::all)]

include!(concat!(env!("OUT_DIR"), "/bindings.rs"));

/// IEEE half as its bit pattern (mlx-c only defines `float16_t` on ARM).
#[repr(transparent)]
#[derive(Debug, Default, Copy, Clone, PartialEq, Eq, Hash)]
pub struct __BindgenFloat16(pub u16);
/// IEEE binary16, carried as bits.
pub type float16_t = __BindgenFloat16;
/// bfloat16, carried as bits.
pub type bfloat16_t = u16;

extern "C" {
    pub fn mlx_array_data_float16(arr: mlx_array) -> *const float16_t;
    pub fn mlx_array_data_bfloat16(arr: mlx_array) -> *const bfloat16_t;
    pub fn mlx_array_item_float16(res: *mut float16_t, arr: mlx_array) -> ::std::os::raw::c_int;
    pub fn mlx_array_item_bfloat16(res: *mut bfloat16_t, arr: mlx_array) -> ::std::os::raw::c_int;
}

/// Where the build found `libmlx.so` (also exported to dependents as `DEP_MLX_LIB_DIR`).
pub const MLX_LIB_DIR: &str = env!("KVSIM_MLX_LIB_DIR");
/// Whether `docs/bindings.rs` (what a documentation build uses, `DOCS_RS`) is byte for byte what this build generated.
pub const DOCS_BINDINGS_CURRENT: bool = matches!(env!("KVSIM_DOCS_BINDINGS_CURRENT").as_bytes(), b"true");
/// The MLX version the headers declare (checked at build time).
pub const MLX_BUILD_VERSION: &str = env!("KVSIM_MLX_VERSION");

extern "C" {
    /// Inline CPU scheduling (`native/inline_cpu.cpp`): `on != 0` runs MLX's CPU stream tasks on the enqueuing
    /// thread, in their order; returns 1 when the requested state holds, 0 when turning it on was refused.
    pub fn kvsim_mlx_inline_cpu(on: ::std::os::raw::c_int) -> ::std::os::raw::c_int;
    /// 1 while inline CPU scheduling is on.
    pub fn kvsim_mlx_inline_cpu_active() -> ::std::os::raw::c_int;
    /// Why the last request to turn it on was refused, NUL-terminated (empty when it was not).
    pub fn kvsim_mlx_inline_cpu_refusal() -> *const ::std::os::raw::c_char;
}
