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
