//! Puts the folder of `libmlx.so` (exported by mlx-sys as DEP_MLX_LIB_DIR) into the run path of every
//! binary and test of this package, so they start without LD_LIBRARY_PATH. LD_LIBRARY_PATH still wins
//! (it is searched before RUNPATH), which is how the CUDA runtime of MLX is swapped in on a GPU machine.
//!
//! `KVSIM_RPATH`, when set, is the run path instead (`python/build-wheel.sh` sets it to folders relative to
//! `$ORIGIN`, where pip puts the `mlx` wheel's `mlx/lib` beside the installed binary; docs/python.md).
fn main() {
    println!("cargo:rerun-if-env-changed=KVSIM_RPATH");
    println!("cargo:rerun-if-env-changed=DEP_MLX_LIB_DIR");
    let rpath =
        std::env::var("KVSIM_RPATH").ok().filter(|r| !r.is_empty()).or_else(|| std::env::var("DEP_MLX_LIB_DIR").ok());
    if let Some(rpath) = &rpath {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{rpath}");
    }
    // `kvsim doctor` prints it ("build run path").
    println!("cargo:rustc-env=KVSIM_RUN_PATH={}", rpath.unwrap_or_default());
}
