//! Puts the folder of `libmlx.so` (exported by mlx-sys as DEP_MLX_LIB_DIR) into the run path of every
//! binary and test of this package, so they start without LD_LIBRARY_PATH. LD_LIBRARY_PATH still wins
//! (it is searched before RUNPATH), which is how the CUDA runtime of MLX is swapped in on a GPU machine.
fn main() {
    if let Ok(dir) = std::env::var("DEP_MLX_LIB_DIR") {
        println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
    }
    println!("cargo:rerun-if-env-changed=DEP_MLX_LIB_DIR");
}
