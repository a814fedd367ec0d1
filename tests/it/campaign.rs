//! Sharded campaigns through the real binary: shards run as separate processes, `kvsim merge` folds their outputs,
//! and the result equals the unsharded run field for field (all but `seconds`), result hash included; `--jobs` does
//! the same on one machine; `kvsim soak` runs and judges memory.

use std::path::PathBuf;
use std::process::{Command, Output};

use serde_json::Value;

fn kvsim(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_kvsim")).args(args).output().expect("kvsim runs")
}

fn last_json(o: &Output) -> Value {
    let text = String::from_utf8_lossy(&o.stdout);
    kvsim::shard::last_json_line(&text).unwrap_or_else(|| panic!("no JSON line in {text}"))
}

/// The summary without its wall time.
fn timeless(mut v: Value) -> Value {
    v.as_object_mut().unwrap().remove("seconds");
    v
}

#[test]
fn two_shards_merge_into_the_unsharded_summary_and_jobs_agree() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("campaign-shards");
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let whole = kvsim(&["sim", "--first", "3", "--seeds", "7", "--json"]);
    assert!(whole.status.success(), "{}", String::from_utf8_lossy(&whole.stderr));
    let whole = last_json(&whole);
    let mut parts = vec![];
    for i in 0..2 {
        let o = kvsim(&["sim", "--first", "3", "--seeds", "7", "--shard", &format!("{i}/2"), "--json"]);
        assert!(o.status.success());
        let part = last_json(&o);
        assert_eq!(part["shard"]["index"], i);
        assert_eq!(part["seed_hashes"].as_array().unwrap().len(), if i == 0 { 4 } else { 3 });
        let p = dir.join(format!("part-{i}.json"));
        std::fs::write(&p, &o.stdout).unwrap();
        parts.push(p.display().to_string());
    }
    let merged = kvsim(&["merge", &parts[1], &parts[0], "--json"]);
    assert!(merged.status.success(), "{}", String::from_utf8_lossy(&merged.stderr));
    let merged = last_json(&merged);
    assert_eq!(merged["result_hash"], whole["result_hash"]);
    assert!(merged.get("read_mode").is_none(), "the default mode is not named: {merged}");
    assert_eq!(timeless(merged), timeless(whole.clone()));
    // The same campaign over two worker processes.
    let jobs = kvsim(&["sim", "--first", "3", "--seeds", "7", "--jobs", "2", "--json"]);
    assert!(jobs.status.success(), "{}", String::from_utf8_lossy(&jobs.stderr));
    assert_eq!(timeless(last_json(&jobs)), timeless(whole));
    // A part merged twice is refused (exit 2), not double counted.
    let twice = kvsim(&["merge", &parts[0], &parts[0], "--json"]);
    assert_eq!(twice.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&twice.stderr).contains("more than one part"));
    // A part of the other read mode is refused: its outputs went through another read, so their hashes are not
    // of the same campaign (on the CPU the bits agree, the refusal does not depend on that).
    let exact = kvsim(&["sim", "--first", "3", "--seeds", "7", "--shard", "1/2", "--exact-read", "--json"]);
    assert!(exact.status.success(), "{}", String::from_utf8_lossy(&exact.stderr));
    assert_eq!(last_json(&exact)["read_mode"], "Exact");
    let exact_part = dir.join("part-1-exact.json");
    std::fs::write(&exact_part, &exact.stdout).unwrap();
    let mixed = kvsim(&["merge", &parts[0], &exact_part.display().to_string(), "--json"]);
    assert_eq!(mixed.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&mixed.stderr).contains("read_mode"), "{}", String::from_utf8_lossy(&mixed.stderr));
    // A file that is no part is refused.
    let bogus = dir.join("bogus.json");
    std::fs::write(&bogus, "{\"seeds\": 1}\n").unwrap();
    assert_eq!(kvsim(&["merge", &bogus.display().to_string()]).status.code(), Some(2));
}

#[test]
fn a_short_soak_reports_memory_and_a_verdict() {
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("soak-smoke.json");
    let o = kvsim(&["soak", "--ops", "1500", "--json", "--out", &out.display().to_string()]);
    let report = last_json(&o);
    assert!(report["ops"].as_u64().unwrap() >= 400);
    assert!(report["at_end"]["rss"].as_u64().unwrap() > 0);
    assert!(report["verdict"]["post_warmup_samples"].as_u64().unwrap() > 0, "{report}");
    assert_eq!(o.status.success(), report["verdict"]["pass"].as_bool().unwrap() && report["failures"] == 0);
    let saved: Value = serde_json::from_str(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(saved["ops"], report["ops"]);
    // mimalloc serves malloc in the binary: the report names it and counts no heap it cannot see (glibc's counters
    // would read as an empty, flat heap).
    assert_eq!(report["allocator"], "mimalloc", "{report}");
    assert_eq!(report["heap_counted"], false);
    assert_eq!(report["at_end"]["heap_in_use"], 0);
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(text.contains("heap not counted (mimalloc serves malloc)"), "{text}");
}

/// Ctrl-C on a `--jobs` campaign: the parent stops handing out seeds, the workers end after the seeds they hold,
/// and the merged summary of what ran is printed and marked `interrupted`. The signal arrives twice at once, as
/// `timeout -s INT` delivers it (to the command, then to its process group): that is still one clean stop.
#[test]
fn ctrl_c_on_a_jobs_campaign_prints_the_summary_of_what_ran() {
    use std::process::Stdio;
    let child = Command::new(env!("CARGO_BIN_EXE_kvsim"))
        .args(["sim", "--seeds", "100000", "--jobs", "2", "--json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kvsim runs");
    std::thread::sleep(std::time::Duration::from_secs(3));
    let pid = child.id().to_string();
    for _ in 0..2 {
        assert!(Command::new("kill").args(["-INT", &pid]).status().unwrap().success());
    }
    let o = child.wait_with_output().unwrap();
    let s = last_json(&o);
    assert_eq!(s["interrupted"], true, "{s}");
    assert!(s["seeds"].as_u64().unwrap() < 100_000);
    assert_eq!(o.status.success(), s["failures"] == 0);
}

/// `--gpus` places `--jobs` workers on GPUs; on the CPU it is refused with a typed error (exit 2), and a bad spec
/// is refused by the parser. Which worker gets which GPU is tested in `kvsim::shard` (`worker_i_runs_on_gpu_i_mod_n`,
/// `each_worker_sees_its_own_gpu_and_every_seed_runs_once`).
#[test]
fn gpus_is_refused_on_the_cpu_and_bad_specs_are_typed_errors() {
    let cpu = kvsim(&["sim", "--seeds", "2", "--jobs", "2", "--gpus", "2", "--device", "cpu"]);
    assert_eq!(cpu.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&cpu.stderr).contains("--gpus places --jobs workers on GPUs"));
    for bad in ["0", "two"] {
        let o = kvsim(&["sim", "--seeds", "2", "--jobs", "2", "--gpus", bad, "--device", "gpu"]);
        assert_eq!(o.status.code(), Some(2), "--gpus {bad}");
        assert!(String::from_utf8_lossy(&o.stderr).contains("--gpus"), "{}", String::from_utf8_lossy(&o.stderr));
    }
}

/// `KVSIM_MUTANT` plants a failure in every run of `kvsim sim` (and its `--jobs` workers): the campaign fails
/// (exit 1), the failing trace records the mutant and `kvsim replay` reproduces the failure at the same op; an
/// unknown name is a typed error (exit 2).
#[test]
fn a_mutant_armed_through_the_environment_plants_failures_that_replay() {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("planted-mutant");
    let _ = std::fs::remove_dir_all(&dir);
    let out = dir.display().to_string();
    let planted = |args: &[&str], mutant: &str| {
        Command::new(env!("CARGO_BIN_EXE_kvsim")).args(args).env("KVSIM_MUTANT", mutant).output().unwrap()
    };
    let o = planted(&["sim", "--seeds", "4", "--jobs", "2", "--json", "--out", &out], PLANTED);
    assert_eq!(o.status.code(), Some(1), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stderr).contains(&format!("mutant {PLANTED} armed")));
    let s = last_json(&o);
    assert!(s["failures"].as_u64().unwrap() > 0, "{s}");
    let trace = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "json"));
    let trace = trace.expect("a failing trace");
    let saved: Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    assert_eq!(saved["mutant"], serde_json::to_value(kvsim::cache::faults::Mutant::from_name(PLANTED)).unwrap());
    // Replay re-arms the recorded mutant and fails where the run failed (exit 1: the trace expects a pass).
    let replay = kvsim(&["replay", &trace.display().to_string()]);
    let text = String::from_utf8_lossy(&replay.stdout);
    assert_eq!(replay.status.code(), Some(1), "{text}");
    let op = &saved["outcome"]["op_index"];
    assert!(text.starts_with(&format!("replay: first divergence at op {op} ")), "{text}");
    let bad = planted(&["sim", "--seeds", "1"], "no-such-mutant");
    assert_eq!(bad.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&bad.stderr).contains("KVSIM_MUTANT"));
}

/// The mutant `deploy/test-slurm.sh` and the test above plant: caught by most seeds.
const PLANTED: &str = "temporal-head";

/// `deploy/slurm-array.sh` end to end on a one-node Slurm cluster the script starts (root on Debian; it installs
/// slurm-wlm and munge when missing), and the Kubernetes manifests validated offline: `deploy/test-slurm.sh` with
/// the release binary (`cargo build --release` first). Run: `cargo test --test it slurm -- --ignored`.
#[test]
#[ignore = "needs root, Debian's slurm-wlm and munge (installed when missing), PyPI, and target/release/kvsim"]
fn slurm_array_campaign_on_a_real_cluster() {
    let root = env!("CARGO_MANIFEST_DIR");
    let o = Command::new(format!("{root}/deploy/test-slurm.sh"))
        .arg(format!("{}/slurm-test", env!("CARGO_TARGET_TMPDIR")))
        .status()
        .expect("deploy/test-slurm.sh runs");
    assert!(o.success(), "deploy/test-slurm.sh failed; its log is under target/tmp/slurm-test/");
}

/// A seed that kills its worker process (the abort drill, `KVSIM_FAULT_ABORT=SEED:OP`: SIGABRT as op OP of seed SEED
/// starts, as a segfault inside MLX would end it) inside `--jobs 2`: that seed is a failing seed, named, with the
/// ops up to the crash saved as a trace that replays in another process (and dies there too while the drill is
/// armed); a new worker runs every other seed; the JSON summary line is printed with its `crashed` count; exit 1.
#[test]
fn a_seed_that_kills_its_worker_fails_alone_and_every_other_seed_runs() {
    use std::os::unix::process::ExitStatusExt;
    let out = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("campaign-crash");
    let _ = std::fs::remove_dir_all(&out);
    let run = |args: &[&str], drill: Option<&str>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_kvsim"));
        c.args(args).env_remove(kvsim::sim::ABORT_ENV);
        if let Some(d) = drill {
            c.env(kvsim::sim::ABORT_ENV, d);
        }
        c.output().expect("kvsim runs")
    };
    let dir = out.display().to_string();
    let args = ["sim", "--first", "3", "--seeds", "7", "--jobs", "2", "--json", "--out", &dir];
    let o = run(&args, Some("6:1"));
    let stderr = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{stderr}");
    let s = last_json(&o);
    assert_eq!(
        (s["crashed"].as_u64(), s["failures"].as_u64(), s["seeds"].as_u64()),
        (Some(1), Some(1), Some(6)),
        "{s}"
    );
    let failed = &s["failed_seeds"][0];
    assert_eq!((failed["seed"].as_u64(), failed["check"].as_str()), (Some(6), Some("crash")), "{s}");
    assert_eq!(failed["op_index"], 1);
    assert!(failed["message"].as_str().unwrap().contains("SIGABRT"), "{s}");
    assert!(stderr.contains("FAIL seed 6 op 1 [crash]"), "{stderr}");
    // Every other seed ran once, with the results of a campaign without the crash: the same per-seed hashes.
    let parts: Vec<Value> = [("3", "3"), ("7", "3")]
        .iter()
        .map(|(first, n)| {
            last_json(&run(&["sim", "--first", first, "--seeds", n, "--shard", "0/1", "--json", "--out", &dir], None))
        })
        .collect();
    let hashes: Vec<String> = parts
        .iter()
        .flat_map(|p| p["seed_hashes"].as_array().unwrap().iter().map(|h| h["hash"].as_str().unwrap().to_string()))
        .collect();
    assert_eq!(hashes.len(), 6);
    assert_eq!(s["result_hash"].as_str().unwrap(), kvsim::shard::ordered_hash(hashes.iter().map(String::as_str)));
    let ops: u64 = parts.iter().map(|v| v["ops"].as_u64().unwrap()).sum();
    assert_eq!(s["ops"].as_u64(), Some(ops), "the seeds that ran did the ops of an undisturbed run");
    // The trace: the two ops seed 6 had started, replayable in another process.
    let trace = PathBuf::from(failed["trace"].as_str().unwrap());
    let t: Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    assert_eq!((t["seed"].as_u64(), t["ops"].as_array().unwrap().len()), (Some(6), 2), "{t}");
    assert_eq!(t["expect"], "fail");
    let again = run(&["replay", &trace.display().to_string()], Some("6:1"));
    assert_eq!(again.status.signal(), Some(6), "the replay dies in the same op: {again:?}");
    // Without the drill the ops run through: the crash does not reproduce, and replay says so (exit 1).
    let calm = run(&["replay", &trace.display().to_string()], None);
    assert_eq!(calm.status.code(), Some(1), "{}", String::from_utf8_lossy(&calm.stdout));
}
