//! The fuzz corpora replayed on stable through the fuzz targets' own entry points.
use kvsim::sim::trace::Outcome;

fn files(dir: &str) -> Vec<std::path::PathBuf> {
    let d = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let mut v: Vec<_> = std::fs::read_dir(&d).map(|rd| rd.map(|e| e.unwrap().path()).collect()).unwrap_or_default();
    v.sort();
    v
}

#[test]
fn trace_json_corpus_never_panics() {
    let fs = files("fuzz/seeds/trace_json");
    assert!(!fs.is_empty());
    for p in fs {
        let _ = kvsim::fuzzing::trace_json(&std::fs::read(&p).unwrap());
    }
}

#[test]
fn sim_trace_corpus_passes_every_check() {
    let fs = files("fuzz/seeds/sim_trace");
    assert!(!fs.is_empty());
    for p in fs {
        if let Some(Outcome::Fail { op_index, check, message }) = kvsim::fuzzing::sim_trace(&std::fs::read(&p).unwrap())
        {
            panic!("{}: op {op_index} [{check}] {message}", p.display());
        }
    }
}

/// The `cache_file` seed corpus: `valid-*` files (kvsim files of every storage kind, genuine mlx-lm 0.32.2 files of
/// every class) must load; `bad-*` files (truncated, flipped, lying) must give a typed error; none may panic.
#[test]
fn cache_file_corpus_loads_valid_files_and_refuses_bad_ones() {
    let fs = files("fuzz/seeds/cache_file");
    assert!(fs.len() >= 12, "seed corpus too small: {}", fs.len());
    for p in fs {
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        let r = kvsim::fuzzing::cache_file(&std::fs::read(&p).unwrap());
        if name.starts_with("valid-") {
            assert!(r.is_ok(), "{name}: {r:?}");
        } else if name.starts_with("bad-") {
            assert!(r.is_err(), "{name} loaded");
        }
    }
}

/// The `engine_reply` seed corpus: `valid-*` replies decode, `bad-*` ones (shapes that overflow, lines that are not
/// objects, fields of the wrong type) give typed failures; none may panic.
#[test]
fn engine_reply_corpus_never_panics() {
    let fs = files("fuzz/seeds/engine_reply");
    assert!(fs.len() >= 5, "seed corpus too small: {}", fs.len());
    for p in fs {
        let decoded = kvsim::fuzzing::engine_reply(&std::fs::read(&p).unwrap());
        let name = p.file_name().unwrap().to_string_lossy().to_string();
        if name.starts_with("valid-") {
            assert!(decoded >= 2, "{name}: {decoded} decodes");
        }
    }
}
