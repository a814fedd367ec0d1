//! Genuine mlx-lm 0.32.2 prompt-cache files (`tests/fixtures/mlxlm/`, written by
//! `oracles/mlx_lm/prompt_cache_fixtures.py`): every class reads, round-trips at the file level, and the classes kvsim
//! continues continue here exactly as mlx-lm continued them (outputs and state, byte for byte).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use kvsim::bytes::ArrayBytes;
use kvsim::cache::{GdnParams, Masks, RowBatch, SerialCache, SsmCache};
use kvsim::persist::inspect::{self, Format};
use kvsim::persist::{mlxlm, AnyCache, HostTensor, PersistError, TensorDtype};
use mlx_rs::Array;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/mlxlm")
}

fn manifest() -> BTreeMap<String, serde_json::Value> {
    serde_json::from_str(&std::fs::read_to_string(dir().join("manifest.json")).unwrap()).unwrap()
}

fn read(name: &str) -> Vec<u8> {
    std::fs::read(dir().join(name)).unwrap_or_else(|e| panic!("{name}: {e}"))
}

/// The arrays of a plain safetensors file (the continuation's inputs and mlx-lm's outputs).
fn io_arrays(name: &str) -> BTreeMap<String, Array> {
    let bytes = read(name);
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| {
            let t = HostTensor::new(
                &n,
                TensorDtype::from_safetensors(v.dtype()).unwrap(),
                v.shape().to_vec(),
                v.data().to_vec(),
            )
            .unwrap();
            (n, t.to_array().unwrap())
        })
        .collect()
}

fn bytes_of(a: &Array) -> ArrayBytes {
    ArrayBytes::of(a).unwrap()
}

fn cpu() {
    mlx_rs::Device::set_default(&mlx_rs::Device::cpu());
}

#[test]
fn every_class_reads_inspects_and_round_trips_at_the_file_level() {
    cpu();
    let m = manifest();
    let classes: Vec<&str> = m.values().map(|e| e["class"].as_str().unwrap()).collect();
    for c in [
        "KVCache",
        "ConcatenateKVCache",
        "RotatingKVCache",
        "QuantizedKVCache",
        "ArraysCache",
        "BatchKVCache",
        "BatchRotatingKVCache",
        "ChunkedKVCache",
        "CacheList",
    ] {
        assert!(classes.contains(&c), "no fixture of {c}");
    }
    for (name, e) in &m {
        let bytes = read(&format!("{name}.safetensors"));
        let info = inspect::inspect_bytes(&bytes).unwrap_or_else(|err| panic!("{name}: {err}"));
        assert_eq!(info.format, Format::MlxLm);
        assert_eq!(info.layers[0].kind, e["class"].as_str().unwrap(), "{name}");
        assert_eq!(info.metadata.get("fixture").map(String::as_str), Some(name.as_str()), "{name}: user metadata");
        let json = serde_json::to_value(&info).unwrap();
        assert!(json["layers"][0]["kind"].is_string());
        let continuable = e.get("steps").is_some();
        // The files without a continuation that kvsim still loads (a hybrid model's, a list with an empty layer, a
        // ConcatenateKVCache: a plain cache holding exactly its positions).
        let loads =
            continuable || ["hybrid_model", "empty_layer_list", "concatenate_kv_cache"].contains(&name.as_str());
        assert_eq!(info.layers[0].kvsim_kind.is_some(), loads, "{name}: kvsim layout");
        // File level: read, write, read gives the same classes, tensors, scalars and metadata.
        let f = mlxlm::read(&bytes).unwrap();
        let again = mlxlm::read(&mlxlm::write(&f).unwrap()).unwrap();
        assert_eq!(f, again, "{name}");
        // Converting to mlx-lm at the file level works for every class (also those kvsim has no layout for).
        let tmp = std::env::temp_dir().join(format!("kvsim-it-{name}-{}.safetensors", std::process::id()));
        inspect::convert(&dir().join(format!("{name}.safetensors")), &tmp, Format::MlxLm).unwrap();
        assert_eq!(mlxlm::read(&std::fs::read(&tmp).unwrap()).unwrap(), f);
        let to_kvsim = inspect::convert(&dir().join(format!("{name}.safetensors")), &tmp, Format::Kvsim);
        assert_eq!(to_kvsim.is_ok(), loads, "{name}: convert --to kvsim");
        if !loads {
            assert!(matches!(to_kvsim, Err(PersistError::Unsupported { .. })));
        }
        let _ = std::fs::remove_file(&tmp);
    }
}

/// Files mlx-lm writes with less than kvsim needs and no kvsim metadata: a hybrid model's `ArraysCache` layers take
/// their offsets from its attention layers, an empty `KVCache` of a list its spec from the others, and a Mamba
/// layer's `ArraysCache` is described (its shapes, and why no kvsim layout maps it), never loaded.
#[test]
fn what_mlx_lm_files_leave_out_is_taken_from_the_file_and_said() {
    cpu();
    let info = inspect::inspect_bytes(&read("hybrid_model.safetensors")).unwrap();
    for at in [0, 2] {
        let l = &info.layers[at];
        assert_eq!((l.kind.as_str(), l.kvsim_kind.as_deref()), ("ArraysCache", Some("ssm")));
        assert_eq!(l.offset, serde_json::json!([5]));
        assert!(l.note.as_deref().is_some_and(|n| n.contains(mlxlm::FROM_ATTENTION)), "{:?}", l.note);
    }
    let f = mlxlm::read(&read("hybrid_model.safetensors")).unwrap();
    let caches = mlxlm::file_to_kvsim(&f).unwrap();
    let AnyCache::Ssm(s) = &caches[0] else { panic!("layer 0 is not recurrent") };
    assert_eq!(s.offsets(), &[5]);
    assert_eq!(caches[1].offset(), 5);
    // A caller's offsets come first, and are said to.
    let given = mlxlm::Hints { ssm_offsets: [("0".to_string(), vec![7])].into(), ..Default::default() };
    let (hints, sources) = mlxlm::file_hints(&f, &given).unwrap();
    assert_eq!((hints.ssm_offsets["0"].as_slice(), sources["0"].as_str()), (&[7][..], mlxlm::FROM_CALLER));
    assert_eq!(sources["2"], mlxlm::FROM_ATTENTION);

    let info = inspect::inspect_bytes(&read("empty_layer_list.safetensors")).unwrap();
    let l = &info.layers[1];
    assert_eq!((l.offset.clone(), l.kvsim_kind.as_deref()), (serde_json::json!(0), Some("kv-plain")));
    assert!(l.note.as_deref().is_some_and(|n| n.contains(mlxlm::FROM_ATTENTION_SPEC)), "{:?}", l.note);
    let caches = mlxlm::file_to_kvsim(&mlxlm::read(&read("empty_layer_list.safetensors")).unwrap()).unwrap();
    assert_eq!((caches[0].offset(), caches[1].offset()), (3, 0));
    assert_eq!(caches[1].spec(), caches[0].spec());

    let info = inspect::inspect_bytes(&read("mamba_arrays_cache.safetensors")).unwrap();
    let l = &info.layers[0];
    assert_eq!(l.kvsim_kind, None);
    assert_eq!(l.tensors.iter().map(|t| t.shape.clone()).collect::<Vec<_>>(), vec![vec![1, 3, 32], vec![1, 32, 16]]);
    assert!(
        l.note.as_deref().is_some_and(|n| n.contains("no kvsim layout") && n.contains("[1, 32, 16]")),
        "{:?}",
        l.note
    );
    let f = mlxlm::read(&read("mamba_arrays_cache.safetensors")).unwrap();
    assert!(matches!(mlxlm::file_to_kvsim(&f), Err(PersistError::Unsupported { .. })));
}

/// A Mamba2-shaped `ArraysCache` mlx-lm wrote (conv tail `[1, 3, 40]` beside an SSM state `[1, 4, 8, 16]`, whose
/// conv width no gated-DeltaNet geometry gives): `inspect` describes every array, what it most likely is and why no
/// kvsim layout maps it; `convert --to kvsim` is a typed `Unsupported`; `convert --to mlx-lm` keeps it whole.
#[test]
fn a_mamba2_shaped_arrays_cache_is_described_and_refused_with_a_typed_error() {
    cpu();
    let bytes = read("mamba2_arrays_cache.safetensors");
    let info = inspect::inspect_bytes(&bytes).unwrap();
    let l = &info.layers[0];
    assert_eq!((l.kind.as_str(), l.kvsim_kind.as_deref()), ("ArraysCache", None));
    let t: Vec<_> = l.tensors.iter().map(|t| (t.name.as_str(), t.dtype.as_str(), t.shape.clone())).collect();
    assert_eq!(t, vec![("cache.0", "BF16", vec![1, 3, 40]), ("cache.1", "F32", vec![1, 4, 8, 16])]);
    let roles: Vec<&str> = l.tensors.iter().map(|t| t.role.as_deref().unwrap()).collect();
    assert!(roles[0].contains("causal-conv tail") && roles[0].contains("K = 4"), "{roles:?}");
    assert!(roles[1].contains("Mamba2 SSM state"), "{roles:?}");
    let note = l.note.as_deref().unwrap();
    assert!(note.starts_with("no kvsim layout") && note.contains("conv_dim 40"), "{note}");
    let text = inspect::render(&info);
    assert!(text.contains("causal-conv tail") && text.contains("no kvsim layout"), "{text}");
    let f = mlxlm::read(&bytes).unwrap();
    assert!(matches!(mlxlm::file_to_kvsim(&f), Err(PersistError::Unsupported { .. })));
    let tmp = std::env::temp_dir().join(format!("kvsim-it-mamba2-{}.kvsim", std::process::id()));
    let err = inspect::convert(&dir().join("mamba2_arrays_cache.safetensors"), &tmp, Format::Kvsim).unwrap_err();
    assert!(matches!(err, PersistError::Unsupported { .. }), "{err}");
    assert!(!tmp.exists(), "a refused conversion writes nothing");
}

/// mlx-lm's `ConcatenateKVCache` (state: keys and values, exactly the positions written), as mlx-lm wrote it: described
/// with its offset (the column count) and loaded as a plain cache holding those positions.
#[test]
fn a_concatenate_kv_cache_is_a_plain_cache_of_its_positions() {
    cpu();
    let bytes = read("concatenate_kv_cache.safetensors");
    let info = inspect::inspect_bytes(&bytes).unwrap();
    let l = &info.layers[0];
    assert_eq!(
        (l.kind.as_str(), l.offset.clone(), l.kvsim_kind.as_deref()),
        ("ConcatenateKVCache", serde_json::json!(4), Some("kv-plain"))
    );
    let f = mlxlm::read(&bytes).unwrap();
    let mlxlm::MlxLayer::ConcatenateKvCache { keys: Some(k), .. } = &f.layers[0] else { panic!("{:?}", f.layers[0]) };
    let c = layer0(&bytes);
    assert_eq!(c.offset(), 4);
    let AnyCache::Serial(s) = &c else { panic!("not a serial cache") };
    assert_eq!(bytes_of(&s.temporal_view_planes().unwrap()[0]), bytes_of(&k.to_array().unwrap()));
}

/// Any `ArraysCache` state, of any number of arrays, ranks, shapes and dtypes, with or without row bookkeeping, is a
/// well-formed mlx-lm file: `inspect` describes it (every array with a likely role), and a layer kvsim has no layout
/// for is refused by the conversion with a typed `Unsupported`, never a panic.
#[test]
fn every_arrays_cache_state_is_described() {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestRunner};
    cpu();
    let dtypes = [TensorDtype::BF16, TensorDtype::F32, TensorDtype::F16, TensorDtype::I32, TensorDtype::U8];
    let array =
        (0usize..dtypes.len(), prop::collection::vec(0usize..5, 0..6)).prop_map(move |(d, shape)| (dtypes[d], shape));
    let state =
        // At least one slot: an empty list leaves no key in the file (mlx's `tree_flatten` drops it), and mlx-lm's
        // layers make `ArraysCache(size)` with size >= 1.
        (prop::collection::vec(prop::option::weighted(0.85, array), 1..5), prop::option::of(0i32..3), any::<bool>());
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(256);
    let mut runner = TestRunner::new(Config { cases, ..Config::default() });
    runner
        .run(&state, |(arrays, pad, lengths)| {
            let tensor = |(d, shape): &(TensorDtype, Vec<usize>)| {
                let n: usize = shape.iter().product();
                HostTensor::new("cache", *d, shape.clone(), vec![0u8; n * d.itemsize()]).unwrap()
            };
            let cache: Vec<Option<HostTensor>> = arrays.iter().map(|a| a.as_ref().map(tensor)).collect();
            let rows = cache.iter().flatten().find_map(|t| t.shape.first().copied()).unwrap_or(1);
            let layer = mlxlm::MlxLayer::ArraysCache {
                cache,
                left_padding: pad.map(|p| HostTensor::vec_i32(&vec![p; rows])),
                lengths: lengths.then(|| HostTensor::vec_i32(&vec![1; rows])),
            };
            let file = mlxlm::MlxFile { metadata: BTreeMap::new(), layers: vec![layer] };
            let bytes = mlxlm::write(&file).unwrap();
            let info = inspect::inspect_bytes(&bytes).map_err(|e| TestCaseError::fail(format!("{arrays:?}: {e}")))?;
            let l = &info.layers[0];
            let described: Vec<_> = l.tensors.iter().filter(|t| t.name.starts_with("cache.")).collect();
            prop_assert_eq!(described.len(), arrays.len());
            for (t, a) in described.iter().zip(&arrays) {
                prop_assert!(t.role.as_deref().is_some_and(|r| !r.is_empty()));
                if let Some((_, shape)) = a {
                    prop_assert_eq!(&t.shape, shape);
                }
            }
            prop_assert!(!inspect::render(&info).is_empty());
            let _ = serde_json::to_string(&info).unwrap();
            let loaded = mlxlm::file_to_kvsim(&mlxlm::read(&bytes).unwrap());
            if l.kvsim_kind.is_none() {
                prop_assert!(l.note.as_deref().is_some_and(|n| n.starts_with("no kvsim layout")), "{:?}", l.note);
                prop_assert!(matches!(loaded, Err(PersistError::Unsupported { .. })), "{:?}", loaded.err());
            }
            Ok(())
        })
        .unwrap();
}

fn layer0(bytes: &[u8]) -> AnyCache {
    let f = mlxlm::read(bytes).unwrap();
    mlxlm::file_to_kvsim(&f).unwrap().remove(0)
}

/// Each row's offset and its state as stored: for attention the temporal view (the newest `min(offset, W)`
/// positions, oldest first: K and V, or the six quantized planes, never dequantized; a chunked cache's live
/// positions), for the recurrent cache both states; a list's children in order.
fn rows_view(c: &AnyCache) -> Vec<(usize, Vec<ArrayBytes>)> {
    let all = |planes: Vec<Array>| planes.iter().map(bytes_of).collect::<Vec<_>>();
    match c {
        AnyCache::Serial(s) => vec![(s.offset(), all(s.temporal_view_planes().unwrap()))],
        AnyCache::Rows(b) => (0..b.rows())
            .map(|r| (b.row_states()[r].ring.offset, all(b.row_temporal_view_planes(r).unwrap())))
            .collect(),
        AnyCache::Ssm(s) => (0..s.rows())
            .map(|r| {
                let (conv, rec) = s.row_states(r).unwrap();
                (s.offsets()[r], vec![bytes_of(&conv), bytes_of(&rec)])
            })
            .collect(),
        AnyCache::Chunked(c) => vec![(c.offset(), all(c.cache().temporal_view_planes().unwrap()))],
        AnyCache::List(v) => v.iter().flat_map(rows_view).collect(),
        AnyCache::Bf16First(c) => vec![(c.offset(), all(c.inner().temporal_view_planes().unwrap()))],
        AnyCache::Paged(p) => p
            .seqs()
            .map(|(s, q)| {
                let (k, v) = p.fetch(s).unwrap();
                (q.offset, vec![bytes_of(&k), bytes_of(&v)])
            })
            .collect(),
    }
}

fn step_serial(c: &mut SerialCache, k: &Array, v: &Array, q: &Array, scale: f32) -> Array {
    let m = Masks::new();
    if k.shape()[2] == 1 {
        c.decode(k, v, q, scale, &m).unwrap().0
    } else {
        c.window(k, v, q, scale, &m).unwrap().0
    }
}

fn step_rows(b: &mut RowBatch, k: &Array, v: &Array, q: &Array, scale: f32) -> Array {
    let m = Masks::new();
    if k.shape()[2] == 1 {
        b.decode(k, v, q, scale, &m).unwrap().0
    } else {
        b.window(k, v, q, scale, &m).unwrap().0
    }
}

fn step_ssm(c: &mut SsmCache, io: &BTreeMap<String, Array>, p: &str, i: usize) -> Array {
    let params = GdnParams {
        conv_weight: io[&format!("{p}conv_weight")].clone(),
        a_log: io[&format!("{p}A_log")].clone(),
        dt_bias: io[&format!("{p}dt_bias")].clone(),
    };
    let (qkv, a, b) = (&io[&format!("{p}qkv.{i}")], &io[&format!("{p}a.{i}")], &io[&format!("{p}b.{i}")]);
    if qkv.shape()[1] == 1 {
        c.decode(qkv, a, b, &params).unwrap()
    } else {
        c.window(qkv, a, b, &params).unwrap()
    }
}

/// One recorded step of one cache object (as the fixture script drives it: a chunked cache trims its front first);
/// returns `(io key of mlx-lm's output, kvsim's output)` per cache.
fn step(cache: &mut AnyCache, io: &BTreeMap<String, Array>, p: &str, i: usize, scale: f32) -> Vec<(String, Array)> {
    let kvq = |n: &str| &io[&format!("{p}{n}.{i}")];
    match cache {
        AnyCache::Serial(c) => vec![(format!("{p}out.{i}"), step_serial(c, kvq("k"), kvq("v"), kvq("q"), scale))],
        AnyCache::Rows(b) => vec![(format!("{p}out.{i}"), step_rows(b, kvq("k"), kvq("v"), kvq("q"), scale))],
        AnyCache::Chunked(c) => {
            c.maybe_trim_front().unwrap();
            vec![(format!("{p}out.{i}"), step_serial(c.cache_mut(), kvq("k"), kvq("v"), kvq("q"), scale))]
        }
        AnyCache::Ssm(c) => vec![(format!("{p}y.{i}"), step_ssm(c, io, p, i))],
        AnyCache::List(v) => {
            v.iter_mut().enumerate().flat_map(|(j, c)| step(c, io, &format!("{p}c{j}."), i, scale)).collect()
        }
        AnyCache::Bf16First(c) => panic!("no mlx-lm fixture holds a bf16-first lego ({})", c.lego_kind()),
        AnyCache::Paged(p) => panic!("no mlx-lm fixture holds a paged store ({})", p.rows_storage_kind()),
    }
}

/// mlx-lm files continue here as mlx-lm continued them: every output and the final state, byte for byte. For the
/// recurrent state (`ArraysCache`) mlx-lm's side is its own layer arithmetic (`mx.conv1d`, `normalize_qk`,
/// `gated_delta_update`'s ops path) and kvsim's is `SsmCache`: bytes agree there too (measured, CPU, bf16).
#[test]
fn mlxlm_files_continue_here_as_mlxlm_continues_them() {
    cpu();
    let mut compared = 0;
    for (name, e) in manifest() {
        let Some(steps) = e.get("steps") else { continue };
        let steps: Vec<usize> = serde_json::from_value(steps.clone()).unwrap();
        let scale = e["scale"].as_f64().unwrap() as f32;
        let io = io_arrays(&format!("{name}.io.safetensors"));
        let mut cache = layer0(&read(&format!("{name}.safetensors")));
        for (i, l) in steps.iter().enumerate() {
            for (key, out) in step(&mut cache, &io, "", i, scale) {
                assert_eq!(bytes_of(&out), bytes_of(&io[&key]), "{name}: {key} (step {i}, L = {l})");
                compared += 1;
            }
        }
        let theirs = layer0(&read(&format!("{name}.continued.safetensors")));
        assert_eq!(rows_view(&cache), rows_view(&theirs), "{name}: state after the continuation");
        if let (AnyCache::Chunked(a), AnyCache::Chunked(b)) = (&cache, &theirs) {
            assert_eq!(a.start_position(), b.start_position(), "{name}: start_position");
        }
        // The known mlx-lm 0.32.2 load bugs the script met (classified, with the workaround it used).
        for bug in e["bugs"].as_array().unwrap() {
            assert!(bug["error"].as_str().unwrap().starts_with("AttributeError"), "{name}: {bug}");
        }
    }
    // KV 4, rotating 6, oversized 3, quantized 4, batch 4, batch rotating 4, ArraysCache 4, chunked 5, CacheList 3 x 2.
    assert_eq!(compared, 4 + 6 + 3 + 4 + 4 + 4 + 4 + 5 + 6, "every recorded output compared");
}

/// An `ArraysCache` carries no offsets: without `kvsim_ssm_offsets` in the user metadata (or a [`mlxlm::Hints`])
/// loading it is a typed error naming the key; with hints it loads.
#[test]
fn arrays_cache_offsets_come_from_metadata_or_hints() {
    cpu();
    let mut f = mlxlm::read(&read("arrays_cache.safetensors")).unwrap();
    f.metadata.remove(mlxlm::SSM_OFFSETS_KEY);
    let err = mlxlm::file_to_kvsim(&f).unwrap_err();
    assert!(matches!(err, PersistError::Missing { .. }) && err.to_string().contains(mlxlm::SSM_OFFSETS_KEY), "{err}");
    let hints = mlxlm::Hints { ssm_offsets: BTreeMap::from([("0".to_string(), vec![6])]), ..Default::default() };
    let c = mlxlm::to_kvsim_at(&f.layers[0], "0", &hints).unwrap();
    assert_eq!(c.storage_kind().0, "ssm");
    // Inspect still names the kvsim kind (offsets are checked on load, not to describe a file).
    let info = inspect::inspect_bytes(&mlxlm::write(&f).unwrap()).unwrap();
    assert_eq!(info.layers[0].kvsim_kind.as_deref(), Some("ssm"));
}

/// The other direction: the files in `kvsim-written/` are exactly what kvsim writes today for each fixture (so the
/// recorded mlx-lm check below is about these bytes), and mlx-lm 0.32.2 continued each of them with outputs
/// byte-identical to its continuation of its own file (`kvsim-written.json`, written by
/// `prompt_cache_fixtures.py --check-kvsim-written`).
#[test]
fn files_written_here_continue_in_mlxlm_as_mlxlm_files_do() {
    cpu();
    let report: BTreeMap<String, serde_json::Value> =
        serde_json::from_str(&std::fs::read_to_string(dir().join("kvsim-written.json")).unwrap()).unwrap();
    let mut checked = 0;
    for (name, e) in manifest() {
        if e.get("steps").is_none() {
            continue;
        }
        let orig = read(&format!("{name}.safetensors"));
        let (md, caches) = inspect::load_any(&orig).unwrap();
        let now = inspect::save_as(Format::MlxLm, &md, &caches).unwrap();
        if std::env::var_os("KVSIM_WRITE_FIXTURES").is_some() {
            // Refresh kvsim-written/ (then run `prompt_cache_fixtures.py --check-kvsim-written` to record mlx-lm's
            // continuation of these bytes).
            std::fs::write(dir().join(format!("kvsim-written/{name}.safetensors")), &now).unwrap();
            // And the fuzz seed corpus's valid files of this fixture, in both formats.
            let seeds = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/seeds/cache_file");
            std::fs::write(seeds.join(format!("valid-mlxlm-from-kvsim-{name}.safetensors")), &now).unwrap();
            let kv = inspect::save_as(Format::Kvsim, &md, &caches).unwrap();
            std::fs::write(seeds.join(format!("valid-kvsim-{name}.kvsim")), kv).unwrap();
            checked += 1;
            continue;
        }
        assert!(now == read(&format!("kvsim-written/{name}.safetensors")), "{name}: kvsim writes other bytes now");
        let r = &report[&name];
        assert_eq!(r["class"], e["class"], "{name}");
        let steps = r["steps"].as_array().unwrap();
        assert_eq!(steps.len(), e["steps"].as_array().unwrap().len(), "{name}");
        for s in steps {
            assert_eq!(s["bit_identical"], true, "{name}: {s}");
        }
        checked += 1;
    }
    assert_eq!(checked, 9);
}

/// kvsim's mlx-lm writer reproduces mlx-lm's layout for what it writes: a loaded file written back through kvsim's
/// own layouts keeps every live byte, offset and class.
#[test]
fn files_written_here_hold_what_mlxlm_wrote() {
    cpu();
    for (name, e) in manifest() {
        if e.get("steps").is_none() {
            continue;
        }
        let orig = layer0(&read(&format!("{name}.safetensors")));
        let f = mlxlm::file_from_kvsim(&BTreeMap::new(), std::slice::from_ref(&orig)).unwrap();
        assert_eq!(f.layers[0].class_name(), e["class"].as_str().unwrap(), "{name}");
        let back = layer0(&mlxlm::write(&f).unwrap());
        assert_eq!(rows_view(&orig), rows_view(&back), "{name}");
    }
}

/// Corrupt and truncated files: `inspect` says why, with a typed error, never a panic.
#[test]
fn corrupt_fixture_files_give_typed_errors() {
    cpu();
    let bytes = read("rotating_kv_cache.safetensors");
    for n in [0, 5, 8, 9, 40, bytes.len() / 2, bytes.len() - 1] {
        let err = inspect::inspect_bytes(&bytes[..n]).unwrap_err();
        assert!(!err.to_string().is_empty());
    }
    // An offset past the buffer: _idx / offset edited inside the file.
    let f = mlxlm::read(&bytes).unwrap();
    let mut bad = f.clone();
    if let mlxlm::MlxLayer::RotatingKvCache { idx, .. } = &mut bad.layers[0] {
        *idx = 99;
    }
    assert!(inspect::inspect_bytes(&mlxlm::write(&bad).unwrap()).is_err(), "_idx past the ring");
    let mut bad = f.clone();
    if let mlxlm::MlxLayer::RotatingKvCache { keep, .. } = &mut bad.layers[0] {
        *keep = 2;
    }
    assert!(matches!(mlxlm::to_kvsim(&bad.layers[0], None), Err(PersistError::Unsupported { .. })));
    let kv = mlxlm::read(&read("kv_cache.safetensors")).unwrap();
    let mut bad = kv.clone();
    if let mlxlm::MlxLayer::KvCache { offset, .. } = &mut bad.layers[0] {
        *offset = 100_000;
    }
    assert!(inspect::inspect_bytes(&mlxlm::write(&bad).unwrap()).is_err(), "offset past the buffer");
    let mut bad = kv;
    if let mlxlm::MlxLayer::KvCache { values, .. } = &mut bad.layers[0] {
        let v = values.as_mut().unwrap();
        v.dtype = TensorDtype::F16;
    }
    assert!(inspect::inspect_bytes(&mlxlm::write(&bad).unwrap()).is_err(), "keys and values of different dtypes");
}
