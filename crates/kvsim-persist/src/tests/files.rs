//! Files on disk: every truncation and bit flip of a saved file is a typed error, lying headers are refused, and a
//! write that stops (at any byte, killed, beside another write, into a folder it cannot write) keeps the previous file.

use super::*;

fn sample_file() -> Vec<u8> {
    let reg = Registry::default();
    let mut md = BTreeMap::new();
    md.insert("model".to_string(), "toy".to_string());
    let caches = [
        Persisted::new(AnyCache::Serial(serial(Some(4), KvDtype::Bf16))),
        Persisted { cache: AnyCache::Rows(rows(None, false)), minimum_reusable_offset: 2 },
    ];
    kvsim::encode(&reg, &md, &caches).unwrap()
}

#[test]
fn every_truncation_and_bit_flip_is_a_typed_error() {
    let _g = testlock::shared();
    let bytes = sample_file();
    let reg = Registry::default();
    assert!(kvsim::decode(&reg, &bytes).is_ok());
    for n in 0..bytes.len() {
        assert!(kvsim::decode(&reg, &bytes[..n]).is_err(), "truncated to {n} bytes loaded");
        assert!(inspect::inspect_bytes(&bytes[..n]).is_err());
    }
    let mut extra = bytes.clone();
    extra.push(0);
    assert!(matches!(kvsim::decode(&reg, &extra), Err(PersistError::Malformed { .. })));
    // Flip one bit of every byte (the header is covered by its checksum, the data by per-tensor checksums; the
    // prefix by magic, version and length checks).
    for i in 0..bytes.len() {
        let mut b = bytes.clone();
        b[i] ^= 0x10;
        match kvsim::decode(&reg, &b) {
            Err(_) => {}
            Ok(_) => panic!("a flipped bit at byte {i} loaded"),
        }
    }
    let data_start = bytes.len() - 8;
    let mut b = bytes.clone();
    b[data_start] ^= 1;
    assert!(matches!(kvsim::decode(&reg, &b), Err(PersistError::TensorChecksum { .. })));
    let mut b = bytes.clone();
    b[60] ^= 1;
    assert!(matches!(kvsim::decode(&reg, &b), Err(PersistError::HeaderChecksum)));
    let mut b = bytes.clone();
    b[8] = 9;
    assert!(matches!(kvsim::decode(&reg, &b), Err(PersistError::UnsupportedVersion { found: 9, .. })));
}

/// A header that is well-formed JSON with a valid checksum but lies: the codecs' validation refuses it.
#[test]
fn lying_headers_are_refused_with_typed_errors() {
    let _g = testlock::shared();
    let reg = Registry::default();
    let base = reg.encode(&Persisted::new(AnyCache::Serial(serial(Some(4), KvDtype::Bf16)))).unwrap();
    let edits: Vec<(&str, Box<dyn Fn(&mut Entry)>)> = vec![
        ("offset below len", Box::new(|e: &mut Entry| e.state["offset"] = 1.into())),
        ("idx past len", Box::new(|e: &mut Entry| e.state["idx"] = 99.into())),
        ("last_concat past len", Box::new(|e: &mut Entry| e.state["last_concat"] = 99.into())),
        ("wrong dtype", Box::new(|e: &mut Entry| e.state["dtype"] = "F32".into())),
        ("wrong heads", Box::new(|e: &mut Entry| e.state["heads_kv"] = 3.into())),
        ("no window", Box::new(|e: &mut Entry| e.state["max_size"] = serde_json::Value::Null)),
        ("zero window", Box::new(|e: &mut Entry| e.state["max_size"] = 0.into())),
        ("unknown field", Box::new(|e: &mut Entry| e.state["keep"] = 4.into())),
        ("missing field", Box::new(|e: &mut Entry| drop(e.state.as_object_mut().unwrap().remove("offset")))),
        ("missing values", Box::new(|e: &mut Entry| drop(e.tensors.pop()))),
        ("values shorter", Box::new(|e: &mut Entry| e.tensors[1].1 = e.tensors[1].1.cols("v", 0, 1).unwrap())),
    ];
    for (what, edit) in edits {
        let mut e = base.clone();
        edit(&mut e);
        let bytes = kvsim::encode_entries(&BTreeMap::new(), &[e]).unwrap();
        match kvsim::decode(&reg, &bytes) {
            Err(err) => assert!(!err.to_string().is_empty(), "{what}"),
            Ok(_) => panic!("{what}: loaded"),
        }
    }
}

/// Two different sample files of `format` (the file already at the path, and the one written over it).
fn format_samples(format: inspect::Format) -> (Vec<u8>, Vec<u8>) {
    let md = BTreeMap::new();
    let one = |c: SerialCache| inspect::save_as(format, &md, &[Persisted::new(AnyCache::Serial(c))]).unwrap();
    (one(serial(Some(4), KvDtype::Bf16)), one(serial(None, KvDtype::F32)))
}

/// A fresh, empty folder for one test.
fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("kvsim-persist-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The names in `dir`, sorted.
fn names(dir: &std::path::Path) -> Vec<String> {
    let mut v: Vec<String> =
        std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

/// The file at `path` is exactly `want`, and loads, and its caches save again to the same bytes.
fn assert_intact(path: &std::path::Path, want: &[u8], format: inspect::Format, what: &str) {
    let got = std::fs::read(path).unwrap();
    assert!(got == want, "{what}: the previous file changed");
    let (md, caches) =
        inspect::load_any(&got).unwrap_or_else(|e| panic!("{what}: the previous file does not load: {e}"));
    assert!(inspect::save_as(format, &md, &caches).unwrap() == want, "{what}: the loaded caches save differently");
}

/// A write interrupted after `n` bytes (every `n` of a sample file, both formats) by a disk that fills up (`ENOSPC`):
/// a typed error, the previous file intact and loading, no temporary file left; the next write succeeds.
#[test]
fn a_write_stopped_at_every_byte_keeps_the_previous_file() {
    let _g = testlock::shared();
    for format in [inspect::Format::Kvsim, inspect::Format::MlxLm] {
        let dir = scratch(&format!("every-byte-{format}"));
        let path = dir.join("cache.file");
        let (old, new) = format_samples(format);
        kvsim::write_atomic(&path, &old).unwrap();
        for n in 0..new.len() {
            let r = kvsim::write_atomic_with(&path, &new, |f, b| {
                use std::io::Write;
                f.write_all(&b[..n])?;
                Err(std::io::Error::from(std::io::ErrorKind::StorageFull))
            });
            assert!(
                matches!(r, Err(PersistError::Io { kind: std::io::ErrorKind::StorageFull, .. })),
                "{format}, stopped after {n} bytes: {r:?}"
            );
            assert_intact(&path, &old, format, &format!("{format}, stopped after {n} bytes"));
            assert_eq!(names(&dir), ["cache.file"], "{format}, stopped after {n} bytes: a temporary file stayed");
        }
        kvsim::write_atomic(&path, &new).unwrap();
        assert_intact(&path, &new, format, &format!("{format}, written"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// Run only as the child of `a_killed_write_keeps_the_previous_file`: writes the file named by
/// `KVSIM_PERSIST_CHILD_WRITE` (`<path>:<format>:<n>`), stops after `n` bytes, says so, and waits to be killed.
#[test]
#[ignore = "the child process of a_killed_write_keeps_the_previous_file"]
fn child_write_waits_to_be_killed() {
    let spec = std::env::var("KVSIM_PERSIST_CHILD_WRITE").expect("run by a_killed_write_keeps_the_previous_file");
    let mut parts = spec.rsplitn(3, ':');
    let n: usize = parts.next().unwrap().parse().unwrap();
    let format = if parts.next().unwrap() == "kvsim" { inspect::Format::Kvsim } else { inspect::Format::MlxLm };
    let path = std::path::PathBuf::from(parts.next().unwrap());
    let (_, new) = format_samples(format);
    let _ = kvsim::write_atomic_with(&path, &new, |f, b| {
        use std::io::Write;
        f.write_all(&b[..n])?;
        f.sync_all()?;
        println!("KVSIM-STOPPED");
        std::io::stdout().flush()?;
        loop {
            std::thread::sleep(std::time::Duration::from_secs(1));
        }
    });
}

/// A writing process killed (`SIGKILL`) after `n` bytes: the previous file is intact and loads; the killed write's
/// temporary file stays until the next successful write, which removes it and leaves nothing behind.
#[test]
fn a_killed_write_keeps_the_previous_file() {
    use std::io::BufRead;
    let _g = testlock::shared();
    for format in [inspect::Format::Kvsim, inspect::Format::MlxLm] {
        let dir = scratch(&format!("killed-{format}"));
        let path = dir.join("cache.file");
        let (old, new) = format_samples(format);
        for n in [0, 1, new.len() / 3, new.len() - 1] {
            kvsim::write_atomic(&path, &old).unwrap();
            let tag = if format == inspect::Format::Kvsim { "kvsim" } else { "mlxlm" };
            let mut child = std::process::Command::new(std::env::current_exe().unwrap())
                .args(["--ignored", "--exact", "tests::files::child_write_waits_to_be_killed", "--nocapture"])
                .env("KVSIM_PERSIST_CHILD_WRITE", format!("{}:{tag}:{n}", path.display()))
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::null())
                .spawn()
                .unwrap();
            let out = child.stdout.take().unwrap();
            let stopped =
                std::io::BufReader::new(out).lines().map_while(|l| l.ok()).any(|l| l.contains("KVSIM-STOPPED"));
            assert!(stopped, "{format}: the child never reached its write");
            child.kill().unwrap();
            child.wait().unwrap();
            let what = format!("{format}, killed after {n} bytes");
            assert_intact(&path, &old, format, &what);
            assert_eq!(names(&dir).len(), 2, "{what}: the killed write's temporary file");
            kvsim::write_atomic(&path, &new).unwrap();
            assert_intact(&path, &new, format, &format!("{what}, then written"));
            assert_eq!(names(&dir), ["cache.file"], "{what}: the next write left a temporary file");
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

/// A write in progress keeps its temporary file (locked until its rename) while another write to the same path
/// starts and ends: both succeed, the later rename wins, and nothing is left behind.
#[test]
fn another_write_leaves_a_write_in_progress_alone() {
    let dir = scratch("in-progress");
    let path = dir.join("cache.kvsim");
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
    let p = path.clone();
    let slow = std::thread::spawn(move || {
        kvsim::write_atomic_with(&p, b"slow", |f, b| {
            use std::io::Write;
            f.write_all(b)?;
            started_tx.send(()).unwrap();
            done_rx.recv().unwrap();
            Ok(())
        })
    });
    started_rx.recv().unwrap();
    kvsim::write_atomic(&path, b"fast").unwrap();
    assert_eq!(names(&dir).len(), 2, "the write in progress lost its temporary file");
    done_tx.send(()).unwrap();
    slow.join().unwrap().unwrap();
    assert_eq!(std::fs::read(&path).unwrap(), b"slow");
    assert_eq!(names(&dir), ["cache.kvsim"]);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A folder that cannot be written is a typed error and changes nothing. Run as root (for whom permissions do not
/// stop a write), the file system's refusal is the same `Io` error handed back by the writer.
#[test]
fn a_folder_that_cannot_be_written_is_a_typed_error() {
    use std::os::unix::fs::PermissionsExt;
    let _g = testlock::shared();
    let dir = scratch("read-only");
    let path = dir.join("cache.kvsim");
    let (old, new) = format_samples(inspect::Format::Kvsim);
    kvsim::write_atomic(&path, &old).unwrap();
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o555)).unwrap();
    let privileged = std::fs::write(dir.join("probe"), b"").is_ok();
    let _ = std::fs::remove_file(dir.join("probe"));
    let r = if privileged {
        kvsim::write_atomic_with(&path, &new, |_, _| Err(std::io::Error::from(std::io::ErrorKind::ReadOnlyFilesystem)))
    } else {
        kvsim::write_atomic(&path, &new)
    };
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let want = if privileged { std::io::ErrorKind::ReadOnlyFilesystem } else { std::io::ErrorKind::PermissionDenied };
    assert!(matches!(&r, Err(PersistError::Io { kind, .. }) if *kind == want), "{r:?}");
    assert_intact(&path, &old, inspect::Format::Kvsim, "read-only folder");
    assert_eq!(names(&dir), ["cache.kvsim"]);
    std::fs::remove_dir_all(&dir).unwrap();
}
