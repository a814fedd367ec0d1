//! Build script: the MLX C API (mlx-c 0.7.0) against a prebuilt MLX 0.32.2, on x86-64 Linux.
//!
//! What it needs, and where each piece comes from (first match wins):
//!
//! | piece | override | otherwise |
//! |---|---|---|
//! | MLX headers + `libmlx.so` | `MLX_DIR` (a folder with `include/mlx/` and `lib/libmlx.so`) | the PyPI wheel `mlx-cpu==0.32.2`, downloaded once with `python3 -m pip download` and unzipped into the cache |
//! | mlx-c sources | `MLX_C_DIR` (a folder with `mlx/c/*.cpp`) | `src/mlx-c` of the crates.io package `mlx-sys` 0.7.0, fetched once by a nested `cargo fetch` with its own `CARGO_HOME` |
//! | libclang for bindgen | `LIBCLANG_PATH` | a system `libclang.so`, else the PyPI wheel `libclang==18.1.1` in the cache |
//!
//! The cache is `KVSIM_CACHE_DIR`, else `$XDG_CACHE_HOME/kvsim`, else `$HOME/.cache/kvsim`. Each piece
//! is unpacked into a staging folder and renamed into place only when complete, so an interrupted
//! build never leaves a half piece behind; once all three are cached no network is used.
//!
//! Facts this relies on (measured on this project's machines; see DEVELOPERS notes / README):
//! mlx-c 0.7.0 compiles against the 0.32.2 headers but not the 0.32.4 ones (a changed `gather_qmm`);
//! GCC 12 lacks `std::format`, which `mlx/c/private/io.h` uses (`native/compat.h` supplies it);
//! x86 mlx-c omits the f16/bf16 accessors mlx-rs calls (`native/x86_shims.cpp`).
//!
//! A documentation build (`DOCS_RS` set, as docs.rs sets it) downloads and compiles nothing: it takes the
//! bindings committed in `docs/bindings.rs` (the ones this script generates; every ordinary build checks that they
//! still are, `mlx_sys::DOCS_BINDINGS_CURRENT`) and links nothing.
//!
//! Dependents get `DEP_MLX_LIB_DIR` (the folder of `libmlx.so`) to put into their run path, so
//! binaries start without `LD_LIBRARY_PATH`; pointing `LD_LIBRARY_PATH` at another MLX 0.32.2 build
//! (the CUDA wheel's `mlx/lib`) swaps the runtime without a rebuild.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

const MLX_VERSION: (u32, u32, u32) = (0, 32, 2);
const MLX_WHEEL: &str = "mlx-cpu==0.32.2";
const MLX_C_CRATE: &str = "0.7.0";
const LIBCLANG_WHEEL: &str = "libclang==18.1.1";

fn main() {
    for var in ["MLX_DIR", "MLX_C_DIR", "LIBCLANG_PATH", "KVSIM_CACHE_DIR", "XDG_CACHE_HOME", "HOME"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-changed=native");
    println!("cargo:rerun-if-changed=docs/bindings.rs");
    println!("cargo:rerun-if-env-changed=DOCS_RS");

    let (a, b, c) = MLX_VERSION;
    if env::var_os("DOCS_RS").is_some() {
        // Documentation only: no network, no C++ build, nothing to link.
        let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("bindings.rs");
        fs::copy(Path::new(&env::var("CARGO_MANIFEST_DIR").unwrap()).join("docs/bindings.rs"), out)
            .unwrap_or_else(|e| fail(&format!("docs/bindings.rs: {e}"), "restore mlx-sys/docs/bindings.rs"));
        println!("cargo:rustc-env=KVSIM_MLX_LIB_DIR=");
        println!("cargo:rustc-env=KVSIM_MLX_VERSION={a}.{b}.{c}");
        println!("cargo:rustc-env=KVSIM_DOCS_BINDINGS_CURRENT=true");
        return;
    }

    if env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux") {
        fail(
            "this mlx-sys is the Linux build",
            "on macOS use the crates.io mlx-sys (remove the [patch.crates-io] entry)",
        );
    }

    let cache = cache_root();
    let mlx = mlx_dir(&cache);
    check_mlx_version(&mlx);
    let mlx_c = mlx_c_dir(&cache);
    let libclang = libclang_dir(&cache);

    compile_mlx_c(&mlx, &mlx_c);
    let generated = generate_bindings(&mlx_c, &libclang);
    let committed = fs::read(Path::new(&env::var("CARGO_MANIFEST_DIR").unwrap()).join("docs/bindings.rs")).ok();
    println!("cargo:rustc-env=KVSIM_DOCS_BINDINGS_CURRENT={}", committed.as_deref() == Some(generated.as_slice()));

    let lib = mlx.join("lib");
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=mlx");
    println!("cargo:rustc-link-lib=dylib=stdc++");
    // For dependents (DEP_MLX_LIB_DIR) and for this crate's own tests.
    println!("cargo:lib_dir={}", lib.display());
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    println!("cargo:rustc-env=KVSIM_MLX_LIB_DIR={}", lib.display());
    println!("cargo:rustc-env=KVSIM_MLX_VERSION={a}.{b}.{c}");
}

/// Stops the build with a message that names the missing piece and the fix.
fn fail(what: &str, fix: &str) -> ! {
    panic!("\n\nmlx-sys (kvsim): {what}.\n  fix: {fix}\n\n");
}

fn cache_root() -> PathBuf {
    if let Some(dir) = env::var_os("KVSIM_CACHE_DIR") {
        return PathBuf::from(dir);
    }
    if let Some(dir) = env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return PathBuf::from(dir).join("kvsim");
    }
    match env::var_os("HOME") {
        Some(home) => PathBuf::from(home).join(".cache").join("kvsim"),
        None => fail("no cache folder", "set KVSIM_CACHE_DIR (or HOME)"),
    }
}

/// Runs `fill(staging)` unless `dest` is already complete, then moves staging into place.
fn cached(dest: &Path, what: &str, fill: impl FnOnce(&Path)) {
    let marker = dest.join(".kvsim-complete");
    if marker.exists() {
        return;
    }
    let parent = dest.parent().expect("cache path has a parent");
    fs::create_dir_all(parent).unwrap_or_else(|e| {
        fail(&format!("cannot create {}: {e}", parent.display()), "set KVSIM_CACHE_DIR to a writable folder")
    });
    let staging =
        parent.join(format!(".{}.staging-{}", dest.file_name().unwrap().to_string_lossy(), std::process::id()));
    let _ = fs::remove_dir_all(&staging);
    fs::create_dir_all(&staging).unwrap();
    // Cargo replays this warning on later builds (path dependency), so it is worded to stay true then.
    println!("cargo:warning=kvsim: {what} is cached in {} (downloaded on the first build only)", dest.display());
    fill(&staging);
    fs::write(staging.join(".kvsim-complete"), what).unwrap();
    let _ = fs::remove_dir_all(dest);
    if let Err(e) = fs::rename(&staging, dest) {
        // Another build may have won the race; accept its copy if it is complete.
        if !marker.exists() {
            fail(
                &format!("cannot move {} into place: {e}", staging.display()),
                "remove the cache folder and build again",
            );
        }
        let _ = fs::remove_dir_all(&staging);
    }
}

fn run(cmd: &mut Command, what: &str, fix: &str) {
    let out =
        cmd.output().unwrap_or_else(|e| fail(&format!("{what}: could not start {:?}: {e}", cmd.get_program()), fix));
    if !out.status.success() {
        fail(
            &format!(
                "{what} failed ({})\n--- stdout\n{}\n--- stderr\n{}",
                out.status,
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
            fix,
        );
    }
}

fn python() -> String {
    env::var("PYTHON").unwrap_or_else(|_| "python3".to_string())
}

/// Downloads one wheel (no dependencies) with pip and unzips it into `into`.
fn fetch_wheel(requirement: &str, into: &Path) {
    let dl = into.join(".download");
    fs::create_dir_all(&dl).unwrap();
    let fix = "install python3 with pip, or set MLX_DIR / LIBCLANG_PATH to a local copy";
    run(
        Command::new(python())
            .args([
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--disable-pip-version-check",
                "-q",
                "-d",
            ])
            .arg(&dl)
            .arg(requirement),
        &format!("pip download {requirement}"),
        fix,
    );
    let wheel = fs::read_dir(&dl)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|x| x == "whl"))
        .unwrap_or_else(|| fail(&format!("pip left no wheel for {requirement}"), fix));
    run(
        Command::new(python()).args(["-m", "zipfile", "-e"]).arg(&wheel).arg(into),
        &format!("unzip {}", wheel.display()),
        fix,
    );
    let _ = fs::remove_dir_all(&dl);
}

fn mlx_dir(cache: &Path) -> PathBuf {
    let dir = match env::var_os("MLX_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => {
            let root = cache.join("mlx-cpu-0.32.2");
            cached(&root, MLX_WHEEL, |staging| fetch_wheel(MLX_WHEEL, staging));
            root.join("mlx")
        }
    };
    for needed in ["include/mlx/mlx.h", "include/mlx/version.h", "lib/libmlx.so"] {
        if !dir.join(needed).exists() {
            fail(
                &format!("MLX at {} has no {needed}", dir.display()),
                "point MLX_DIR at a folder with include/mlx and lib/libmlx.so (e.g. the `mlx` folder of the mlx-cpu==0.32.2 wheel), or unset it",
            );
        }
    }
    dir
}

fn check_mlx_version(mlx: &Path) {
    let text = fs::read_to_string(mlx.join("include/mlx/version.h")).unwrap();
    let field = |name: &str| -> Option<u32> {
        text.lines()
            .find_map(|l| l.trim().strip_prefix(&format!("#define {name} ")))
            .and_then(|v| v.trim().parse().ok())
    };
    let found = (field("MLX_VERSION_MAJOR"), field("MLX_VERSION_MINOR"), field("MLX_VERSION_PATCH"));
    let (a, b, c) = MLX_VERSION;
    if found != (Some(a), Some(b), Some(c)) {
        fail(
            &format!("MLX at {} is {:?}, mlx-c {MLX_C_CRATE} needs exactly {a}.{b}.{c}", mlx.display(), found),
            "use the headers of mlx-cpu==0.32.2 (0.32.4 changed gather_qmm and mlx-c 0.7.0 no longer compiles)",
        );
    }
}

fn mlx_c_dir(cache: &Path) -> PathBuf {
    if let Some(dir) = env::var_os("MLX_C_DIR") {
        let dir = PathBuf::from(dir);
        if !dir.join("mlx/c/array.cpp").exists() {
            fail(
                &format!("MLX_C_DIR={} has no mlx/c/array.cpp", dir.display()),
                "point it at an mlx-c 0.7.0 source tree",
            );
        }
        return dir;
    }
    let root = cache.join(format!("mlx-c-{MLX_C_CRATE}"));
    cached(&root, &format!("mlx-c from the mlx-sys {MLX_C_CRATE} crate"), |staging| {
        // A throwaway manifest whose only dependency is the published crate; `cargo fetch` with a
        // private CARGO_HOME unpacks it without touching the outer build's locks.
        let proj = staging.join(".fetch");
        fs::create_dir_all(proj.join("src")).unwrap();
        fs::write(
            proj.join("Cargo.toml"),
            format!("[package]\nname = \"kvsim-fetch-mlx-c\"\nversion = \"0.0.0\"\nedition = \"2021\"\n[dependencies]\nmlx-sys = \"={MLX_C_CRATE}\"\n[workspace]\n"),
        )
        .unwrap();
        fs::write(proj.join("src/lib.rs"), "").unwrap();
        let cargo_home = proj.join("cargo-home");
        let cargo = env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        run(
            Command::new(cargo)
                .arg("fetch")
                .current_dir(&proj)
                .env("CARGO_HOME", &cargo_home)
                .env_remove("CARGO_TARGET_DIR")
                .env_remove("RUSTFLAGS"),
            &format!("cargo fetch of mlx-sys {MLX_C_CRATE}"),
            "check that crates.io is reachable, or set MLX_C_DIR to an mlx-c 0.7.0 source tree",
        );
        let src_root = cargo_home.join("registry/src");
        let pkg = fs::read_dir(&src_root)
            .unwrap()
            .filter_map(|e| e.ok())
            .map(|e| e.path().join(format!("mlx-sys-{MLX_C_CRATE}/src/mlx-c")))
            .find(|p| p.join("mlx/c").exists())
            .unwrap_or_else(|| fail("the fetched mlx-sys crate has no src/mlx-c", "set MLX_C_DIR"));
        copy_tree(&pkg, staging);
        let _ = fs::remove_dir_all(&proj);
    });
    root
}

fn copy_tree(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for entry in fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let target = to.join(entry.file_name());
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            fs::copy(entry.path(), &target).unwrap();
        }
    }
}

fn libclang_dir(cache: &Path) -> PathBuf {
    if let Some(dir) = env::var_os("LIBCLANG_PATH") {
        return PathBuf::from(dir);
    }
    let mut system: Vec<PathBuf> = vec!["/usr/lib/x86_64-linux-gnu".into(), "/usr/lib".into(), "/usr/local/lib".into()];
    if let Ok(rd) = fs::read_dir("/usr/lib") {
        let mut llvm: Vec<PathBuf> = rd
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("llvm-")))
            .map(|p| p.join("lib"))
            .collect();
        llvm.sort();
        llvm.reverse();
        system.splice(0..0, llvm);
    }
    // `libclang-cpp.so` is not what bindgen loads; only a real libclang.so counts.
    if let Some(d) = system.into_iter().find(|d| {
        fs::read_dir(d).is_ok_and(|rd| {
            rd.filter_map(|e| e.ok()).any(|e| e.file_name().to_string_lossy().starts_with("libclang.so"))
        })
    }) {
        return d;
    }
    let root = cache.join("libclang-18.1.1");
    cached(&root, LIBCLANG_WHEEL, |staging| fetch_wheel(LIBCLANG_WHEEL, staging));
    let dir = root.join("libclang-18.1.1.data/platlib/clang/native");
    if !dir.join("libclang.so").exists() {
        fail(&format!("{} has no libclang.so", dir.display()), "set LIBCLANG_PATH to a folder with libclang.so");
    }
    dir
}

fn compile_mlx_c(mlx: &Path, mlx_c: &Path) {
    let native = Path::new(env!("CARGO_MANIFEST_DIR")).join("native");
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++20")
        .flag("-include")
        .flag(native.join("compat.h").to_str().unwrap())
        .include(mlx_c)
        .include(mlx.join("include"))
        .flag("-w")
        .opt_level(2)
        .debug(false);
    let mut sources: Vec<PathBuf> = fs::read_dir(mlx_c.join("mlx/c"))
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "cpp"))
        .collect();
    sources.sort();
    if sources.is_empty() {
        fail(&format!("no mlx/c/*.cpp under {}", mlx_c.display()), "set MLX_C_DIR to an mlx-c 0.7.0 source tree");
    }
    build.files(&sources).file(native.join("x86_shims.cpp")).file(native.join("inline_cpu.cpp"));
    build.compile("mlxc");
}

/// GCC's own include folder (for `float.h` / `stddef.h`, which the pip libclang lacks).
fn gcc_include_dir() -> Option<PathBuf> {
    let out =
        Command::new(env::var("CC").unwrap_or_else(|_| "cc".into())).arg("-print-file-name=include").output().ok()?;
    let p = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    p.join("stddef.h").exists().then_some(p)
}

fn generate_bindings(mlx_c: &Path, libclang: &Path) -> Vec<u8> {
    env::set_var("LIBCLANG_PATH", libclang);
    let mut headers: Vec<PathBuf> = fs::read_dir(mlx_c.join("mlx/c"))
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "h"))
        .collect();
    headers.sort();
    let mut builder = bindgen::Builder::default()
        .clang_arg(format!("-I{}", mlx_c.display()))
        // bindgen's c_ulong sizes for these trip rustc's suspicious_runtime_symbol_definitions lint.
        .blocklist_function("malloc")
        .blocklist_function("realloc")
        .layout_tests(false);
    if let Some(inc) = gcc_include_dir() {
        builder = builder.clang_arg(format!("-I{}", inc.display()));
    }
    for h in &headers {
        builder = builder.header(h.to_string_lossy());
    }
    let bindings = builder.generate().unwrap_or_else(|e| {
        fail(
            &format!("bindgen failed on the mlx-c headers: {e}"),
            "check LIBCLANG_PATH (a folder holding libclang.so) and that a C compiler (cc) is installed",
        )
    });
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("bindings.rs");
    bindings.write_to_file(&out).unwrap();
    fs::read(&out).unwrap()
}
