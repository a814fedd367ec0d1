//! Every trace in corpus/ replays as its file records: regressions pass, recorded failures fail with the same check.
use kvsim::sim::trace::Trace;
use kvsim::sim::{replay, replay_matches, DeviceChoice};

#[test]
fn corpus_replays_as_recorded() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    let mut n = 0;
    let mut problems = vec![];
    let mut paths: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    paths.sort();
    for p in paths {
        let t = Trace::load(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        let r = replay(&t, DeviceChoice::Cpu);
        if let Err(e) = replay_matches(&t, &r) {
            problems.push(format!("{}: {e}", p.display()));
        }
        n += 1;
    }
    assert!(n > 0, "corpus/ holds no traces");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}
