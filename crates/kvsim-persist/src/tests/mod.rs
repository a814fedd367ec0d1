//! Persistence: round trips by storage kind, continuation after load, corrupt files, atomic writes.

use std::collections::BTreeMap;

use super::codec::{AnyCache, Codec, Entry, Persisted, Registry};
use super::error::PersistError;
use super::{inspect, kvsim, mlxlm};

use kvsim_cache::testutil::testlock;
use kvsim_cache::testutil::{assert_same_bytes, kvq, row, spec};
use kvsim_cache::{
    BatchQuantizedKvCache, JoinSource, KvDtype, KvSpec, Masks, QuantSpec, QuantizedKvCache, RotatingQuantizedKvCache,
    RowBatch, SerialCache, Storage,
};

const SCALE: f32 = 0.35;

mod files;

fn decode_s(c: &mut SerialCache, seed: u64) -> mlx_rs::Array {
    let (k, v, q) = kvq(&c.spec(), seed, 1, 1);
    c.decode(&k, &v, &q, SCALE, &Masks::new()).unwrap().0
}

fn window_s(c: &mut SerialCache, seed: u64, l: usize) -> mlx_rs::Array {
    let (k, v, q) = kvq(&c.spec(), seed, 1, l);
    c.window(&k, &v, &q, SCALE, &Masks::new()).unwrap().0
}

fn decode_b(b: &mut RowBatch, seed: u64) -> mlx_rs::Array {
    let (k, v, q) = kvq(&b.spec(), seed, b.rows(), 1);
    b.decode(&k, &v, &q, SCALE, &Masks::new()).unwrap().0
}

fn window_b(b: &mut RowBatch, seed: u64, l: usize) -> mlx_rs::Array {
    let (k, v, q) = kvq(&b.spec(), seed, b.rows(), l);
    b.window(&k, &v, &q, SCALE, &Masks::new()).unwrap().0
}

fn serial(max: Option<usize>, dtype: KvDtype) -> SerialCache {
    let mut c = SerialCache::new(spec(dtype), max).unwrap();
    window_s(&mut c, 1, 3);
    for s in 0..4 {
        decode_s(&mut c, 10 + s);
    }
    window_s(&mut c, 20, 2);
    c
}

fn rows(max: Option<usize>, pending: bool) -> RowBatch {
    let sp = spec(KvDtype::Bf16);
    let mut a = SerialCache::new(sp, max).unwrap();
    window_s(&mut a, 3, 2);
    let mut b = SerialCache::new(sp, max).unwrap();
    window_s(&mut b, 4, 3);
    for s in 0..4 {
        decode_s(&mut b, 30 + s);
    }
    let mut batch =
        RowBatch::join(sp, max, &[kvsim_cache::JoinSource::Serial(&a), kvsim_cache::JoinSource::Serial(&b)]).unwrap();
    decode_b(&mut batch, 40);
    if pending {
        batch.prepare(&[3, 1]).unwrap();
        window_b(&mut batch, 41, 2);
    }
    batch
}

fn roundtrip(p: &Persisted) -> Persisted {
    let reg = Registry::default();
    let bytes = kvsim::encode(&reg, &BTreeMap::new(), std::slice::from_ref(p)).unwrap();
    let (_, mut back) = kvsim::decode(&reg, &bytes).unwrap();
    assert_eq!(back.len(), 1);
    back.pop().unwrap()
}

fn assert_serial_same(a: &SerialCache, b: &SerialCache, what: &str) {
    assert_eq!(a.state(), b.state(), "{what}: state");
    assert_eq!((a.spec(), a.max_size()), (b.spec(), b.max_size()), "{what}: spec");
    let (ak, av) = a.physical().unwrap();
    let (bk, bv) = b.physical().unwrap();
    assert_same_bytes(&ak, &bk, &format!("{what}: keys"));
    assert_same_bytes(&av, &bv, &format!("{what}: values"));
}

fn assert_rows_same(a: &RowBatch, b: &RowBatch, what: &str) {
    assert_eq!(a.row_states(), b.row_states(), "{what}: row states");
    for r in 0..a.rows() {
        let (ak, av) = a.row_physical(r).unwrap();
        let (bk, bv) = b.row_physical(r).unwrap();
        assert_same_bytes(&ak, &bk, &format!("{what}: row {r} keys"));
        assert_same_bytes(&av, &bv, &format!("{what}: row {r} values"));
    }
}

#[test]
fn serial_kinds_round_trip_and_continue_byte_identically() {
    let _g = testlock::shared();
    for (max, dtype) in [(None, KvDtype::Bf16), (Some(4), KvDtype::Bf16), (Some(5), KvDtype::F32), (None, KvDtype::F32)]
    {
        let mut orig = serial(max, dtype);
        let AnyCache::Serial(mut back) = roundtrip(&Persisted::new(AnyCache::Serial(orig.clone()))).cache else {
            panic!("kind changed")
        };
        assert_serial_same(&orig, &back, "after load");
        // The last op was a window write: a bypass trim must still be possible after load.
        assert_eq!(orig.trim(1, true).unwrap(), back.trim(1, true).unwrap());
        for s in 0..6 {
            let (o1, o2) = (decode_s(&mut orig, 100 + s), decode_s(&mut back, 100 + s));
            assert_same_bytes(&o1, &o2, &format!("{max:?} decode {s}"));
        }
        let (o1, o2) = (window_s(&mut orig, 200, 3), window_s(&mut back, 200, 3));
        assert_same_bytes(&o1, &o2, "window");
        assert_serial_same(&orig, &back, "after continuing");
        let (t1, t2) = (orig.temporal_view().unwrap(), back.temporal_view().unwrap());
        assert_same_bytes(&t1.0, &t2.0, "temporal view");
    }
}

#[test]
fn row_batches_round_trip_with_pending_prefill_and_continue() {
    let _g = testlock::shared();
    for max in [None, Some(4)] {
        let mut orig = rows(max, true);
        assert!(orig.is_pending());
        let AnyCache::Rows(mut back) = roundtrip(&Persisted::new(AnyCache::Rows(orig.clone()))).cache else {
            panic!("kind changed")
        };
        assert_rows_same(&orig, &back, "after load");
        // mlx-lm 0.32.2 loses the pending padding; kvsim keeps it: the rest of the prefill and finalize work.
        let (o1, o2) = (window_b(&mut orig, 50, 2), window_b(&mut back, 50, 2));
        assert_same_bytes(&row(&o1, 0), &row(&o2, 0), "pending window row 0");
        orig.finalize().unwrap();
        back.finalize().unwrap();
        for s in 0..5 {
            let (o1, o2) = (decode_b(&mut orig, 60 + s), decode_b(&mut back, 60 + s));
            assert_same_bytes(&o1, &o2, &format!("{max:?} decode {s}"));
        }
        assert_rows_same(&orig, &back, "after continuing");
        assert_serial_same(&orig.extract(1).unwrap(), &back.extract(1).unwrap(), "extract");
        orig.filter(&[1]).unwrap();
        back.filter(&[1]).unwrap();
        assert_rows_same(&orig, &back, "after filter");
    }
}

#[test]
fn empty_caches_round_trip() {
    let _g = testlock::shared();
    let sp = spec(KvDtype::F32);
    for max in [None, Some(3)] {
        let c = SerialCache::new(sp, max).unwrap();
        let AnyCache::Serial(mut b) = roundtrip(&Persisted::new(AnyCache::Serial(c.clone()))).cache else { panic!() };
        assert_serial_same(&c, &b, "empty serial");
        decode_s(&mut b, 1);
        let e = RowBatch::empty(sp, max).unwrap();
        let AnyCache::Rows(b) = roundtrip(&Persisted::new(AnyCache::Rows(e))).cache else { panic!() };
        assert_eq!(b.rows(), 0);
    }
}

/// Layers before any token (an empty linear, rotating and quantized cache, and a list holding an empty linear cache)
/// through mlx-lm's format: mlx-lm stores no array for them, so kvsim's writer carries their specs in the user
/// metadata (`EMPTY_SPECS_KEY`) and every such file loads back with the same kinds and specs; without that entry (a
/// file mlx-lm wrote) the reader refuses with a typed error, or takes the caller's spec (`Hints::spec`).
#[test]
fn empty_layers_round_trip_through_mlxlm_files() {
    let _g = testlock::shared();
    let sp = spec(KvDtype::Bf16);
    let q = QuantSpec { bits: 4, group: 64 };
    let layers = [
        AnyCache::Serial(SerialCache::new(sp, None).unwrap()),
        AnyCache::Serial(SerialCache::new(sp, Some(4)).unwrap()),
        AnyCache::Serial(QuantizedKvCache::new(qspec(KvDtype::F32), q).unwrap()),
        AnyCache::List(vec![
            AnyCache::Serial(serial(None, KvDtype::Bf16)),
            AnyCache::Serial(SerialCache::new(sp, None).unwrap()),
        ]),
    ];
    let caches: Vec<Persisted> = layers.iter().cloned().map(Persisted::new).collect();
    let bytes = inspect::save_as(inspect::Format::MlxLm, &BTreeMap::new(), &caches).unwrap();
    let (md, back) = inspect::load_any(&bytes).unwrap();
    assert!(md.contains_key(mlxlm::EMPTY_SPECS_KEY), "{md:?}");
    assert_eq!(back.len(), layers.len());
    for (i, (a, b)) in layers.iter().zip(&back).enumerate() {
        assert_eq!(a.storage_kind(), b.cache.storage_kind(), "layer {i}");
        assert_eq!(a.spec(), b.cache.spec(), "layer {i}");
    }
    let AnyCache::List(children) = &back[3].cache else { panic!("layer 3 is not a list") };
    let (AnyCache::Serial(full), AnyCache::Serial(empty)) = (&children[0], &children[1]) else { panic!() };
    let AnyCache::List(want) = &layers[3] else { unreachable!() };
    let AnyCache::Serial(want_full) = &want[0] else { unreachable!() };
    assert_eq!(full.offset(), want_full.offset(), "the list's full child");
    assert_eq!(empty.offset(), 0);
    // Saved again, the file is the same.
    assert_eq!(inspect::save_as(inspect::Format::MlxLm, &md, &back).unwrap(), bytes);

    // A file without the entry: the empty plain layers take the spec of the file's one attention layer that holds
    // tokens (said), the empty quantized layer takes none: typed refusal; with the caller's spec, the layer loads.
    let mut f = mlxlm::read(&bytes).unwrap();
    f.metadata.remove(mlxlm::EMPTY_SPECS_KEY);
    let (found, sources) = mlxlm::file_hints(&f, &mlxlm::Hints::default()).unwrap();
    assert_eq!(found.empty_specs.get("0").map(|s| s.dtype), Some(KvDtype::Bf16));
    assert_eq!(sources.get("0").map(String::as_str), Some(mlxlm::FROM_ATTENTION_SPEC));
    assert!(!found.empty_specs.contains_key("2"), "the empty quantized layer is given no spec");
    let e = mlxlm::file_to_kvsim(&f).unwrap_err();
    assert!(matches!(e, PersistError::Unsupported { .. }), "{e:?}");
    let hinted = mlxlm::Hints { spec: Some(sp), ..Default::default() };
    let c = mlxlm::to_kvsim_at(&f.layers[0], "0", &hinted).unwrap();
    assert_eq!(c.spec(), Some(sp));
    // A malformed entry is a typed error too.
    f.metadata.insert(mlxlm::EMPTY_SPECS_KEY.to_string(), "{\"0\": 3}".to_string());
    assert!(matches!(mlxlm::file_to_kvsim(&f), Err(PersistError::Malformed { .. })));
}

#[test]
fn floor_is_persisted_and_validated() {
    let _g = testlock::shared();
    let c = AnyCache::Serial(serial(None, KvDtype::Bf16));
    let off = c.offset();
    let p = roundtrip(&Persisted { cache: c.clone(), minimum_reusable_offset: 4 });
    assert_eq!(p.minimum_reusable_offset, 4);
    let reg = Registry::default();
    let too_high = Persisted { cache: c.clone(), minimum_reusable_offset: off + 1 };
    assert!(matches!(reg.encode(&too_high), Err(PersistError::InvalidFloor { .. })));
    let mut e = reg.encode(&Persisted::new(c)).unwrap();
    e.minimum_reusable_offset = off + 1;
    let bytes = kvsim::encode_entries(&BTreeMap::new(), &[e]).unwrap();
    assert!(matches!(kvsim::decode(&reg, &bytes), Err(PersistError::InvalidFloor { .. })));
}

#[test]
fn registry_routes_by_exact_kind_and_fails_closed() {
    let _g = testlock::shared();
    let reg = Registry::default();
    assert_eq!(
        reg.kinds(),
        [
            "kv-plain",
            "rotating-plain",
            "kv-plain+row-batch",
            "rotating-plain+row-batch",
            "kv:quant:<bits>:<group>",
            "kv:rotating-quant:<bits>:<group>",
            "kv:quant:<bits>:<group>+row-batch",
            "kv:rotating-quant:<bits>:<group>+row-batch",
            "ssm",
            "kv-chunked:<chunk_size>",
            "kv:bf16-first-quant:<bits>:<group>:<start>",
            "kv:bf16-first-rotating-quant:<W>:<bits>:<group>:<start>",
            "kv:paged-rows:<block_size>[:quant:<bits>:<group>]",
            "cache-list"
        ]
    );
    for (kind, pattern) in [
        ("kv:bf16-first-quant:4:64:16", "kv:bf16-first-quant:<bits>:<group>:<start>"),
        ("kv:bf16-first-rotating-quant:32:5:32:0", "kv:bf16-first-rotating-quant:<W>:<bits>:<group>:<start>"),
    ] {
        assert_eq!(reg.codec(kind).unwrap().storage_kind(), pattern, "{kind}");
    }
    // The rows' kinds have no codec (a row is saved as the lego its extract composes).
    for bad in ["kv:delayed-quant:4:64:16", "kv:bf16-first-quant:4:64", "kv:bf16-first-quant:7:64:16"] {
        assert!(matches!(reg.codec(bad), Err(PersistError::UnknownKind { .. })), "{bad}");
    }
    assert_eq!(reg.codec("kv-chunked:4").unwrap().storage_kind(), "kv-chunked:<chunk_size>");
    for bad in ["kv-chunked:", "kv-chunked:04", "kv-chunked:x", "kv-chunked:-1", "kv-chunked:<chunk_size>"] {
        assert!(matches!(reg.codec(bad), Err(PersistError::UnknownKind { .. })), "{bad}");
    }
    // Quantized kinds route by their parsed form; anything MLX's quantizer does not accept, or not written
    // canonically, is unknown.
    for (kind, pattern) in [
        ("kv:quant:4:64", "kv:quant:<bits>:<group>"),
        ("kv:rotating-quant:3:32", "kv:rotating-quant:<bits>:<group>"),
        ("kv:quant:8:128+row-batch", "kv:quant:<bits>:<group>+row-batch"),
        ("kv:rotating-quant:5:64+row-batch", "kv:rotating-quant:<bits>:<group>+row-batch"),
    ] {
        assert_eq!(reg.codec(kind).unwrap().storage_kind(), pattern, "{kind}");
    }
    for bad in ["kv:quant:7:64", "kv:quant:4:48", "kv:quant:04:64", "kv:quant:4", "kv:quant:<bits>:<group>"] {
        assert!(matches!(reg.codec(bad), Err(PersistError::UnknownKind { .. })), "{bad}");
    }
    for bad in ["", "kv-plain+row-batch+x", "KV-PLAIN", "quantized", "rotating-plain "] {
        assert!(matches!(reg.codec(bad), Err(PersistError::UnknownKind { .. })), "{bad}");
    }
    struct Dup;
    impl Codec for Dup {
        fn storage_kind(&self) -> &'static str {
            "kv-plain"
        }
        fn encode(&self, _: &AnyCache) -> super::Result<Entry> {
            unreachable!()
        }
        fn decode(&self, _: &Entry) -> super::Result<AnyCache> {
            unreachable!()
        }
    }
    let mut reg = Registry::default();
    reg.register(Box::new(Dup));
    assert!(matches!(reg.codec("kv-plain"), Err(PersistError::AmbiguousCodec { matches: 2, .. })));
    // An entry whose kind was edited to an unknown one.
    let reg = Registry::default();
    let mut e = reg.encode(&Persisted::new(AnyCache::Serial(serial(None, KvDtype::Bf16)))).unwrap();
    e.storage_kind = "kv-plain+row-batch".into();
    assert!(reg.decode(&e).is_err(), "a serial entry relabelled as a row batch must not load");
    e.storage_kind = "paged".into();
    assert!(matches!(reg.decode(&e), Err(PersistError::UnknownKind { .. })));
}

#[test]
fn mlxlm_form_round_trips_and_continues() {
    let _g = testlock::shared();
    let caches = [
        AnyCache::Serial(serial(None, KvDtype::Bf16)),
        AnyCache::Serial(serial(Some(4), KvDtype::Bf16)),
        AnyCache::Rows(rows(None, false)),
        AnyCache::Rows(rows(Some(4), false)),
    ];
    let layers: Vec<_> = caches.iter().map(|c| mlxlm::from_kvsim(c).unwrap()).collect();
    let names: Vec<_> = layers.iter().map(|l| l.class_name()).collect();
    assert_eq!(names, ["KVCache", "RotatingKVCache", "BatchKVCache", "BatchRotatingKVCache"]);
    let file = mlxlm::MlxFile { metadata: BTreeMap::from([("a".into(), "b".into())]), layers };
    let bytes = mlxlm::write(&file).unwrap();
    let back = mlxlm::read(&bytes).unwrap();
    assert_eq!(back, file, "file-level round trip");
    for (c, l) in caches.iter().zip(&back.layers) {
        match (c, mlxlm::to_kvsim(l, None).unwrap()) {
            (AnyCache::Serial(a), AnyCache::Serial(mut b)) => {
                let mut a = a.clone();
                assert_eq!(a.state().offset, b.state().offset);
                let (t1, t2) = (a.temporal_view().unwrap(), b.temporal_view().unwrap());
                assert_same_bytes(&t1.0, &t2.0, "temporal keys");
                for s in 0..6 {
                    let (o1, o2) = (decode_s(&mut a, 300 + s), decode_s(&mut b, 300 + s));
                    assert_same_bytes(&o1, &o2, &format!("serial decode {s} after the mlx-lm form"));
                }
            }
            (AnyCache::Rows(a), AnyCache::Rows(mut b)) => {
                let mut a = a.clone();
                for r in 0..a.rows() {
                    assert_eq!(a.row_states()[r].ring.offset, b.row_states()[r].ring.offset);
                    let (t1, t2) = (a.row_temporal_view(r).unwrap(), b.row_temporal_view(r).unwrap());
                    assert_same_bytes(&t1.0, &t2.0, "row temporal keys");
                }
                for s in 0..6 {
                    decode_b(&mut a, 400 + s);
                    decode_b(&mut b, 400 + s);
                }
                for r in 0..a.rows() {
                    let (t1, t2) = (a.row_temporal_view(r).unwrap(), b.row_temporal_view(r).unwrap());
                    assert_same_bytes(&t1.0, &t2.0, "row temporal keys after decodes");
                }
            }
            _ => panic!("kind changed"),
        }
    }
    // A pending prefill has no mlx-lm form.
    assert!(matches!(mlxlm::from_kvsim(&AnyCache::Rows(rows(None, true))), Err(PersistError::Unsupported { .. })));
}

#[test]
fn mlxlm_reader_refuses_malformed_files() {
    let _g = testlock::shared();
    let file = mlxlm::MlxFile {
        metadata: BTreeMap::new(),
        layers: vec![mlxlm::from_kvsim(&AnyCache::Serial(serial(Some(4), KvDtype::Bf16))).unwrap()],
    };
    let bytes = mlxlm::write(&file).unwrap();
    for n in 0..bytes.len() {
        assert!(mlxlm::read(&bytes[..n]).is_err(), "truncated to {n}");
    }
    for i in 0..bytes.len() {
        let mut b = bytes.clone();
        b[i] ^= 0x41;
        // A flip in tensor data is undetectable in safetensors (no checksums); everything else is caught or yields
        // a structurally valid file. Never a panic.
        if let Ok(f) = mlxlm::read(&b) {
            for l in &f.layers {
                let _ = mlxlm::to_kvsim(l, None);
            }
        }
    }
}

/// A two-row recurrent cache after a few positions (deterministic values), and its layer's params.
fn ssm_cache(dtype: KvDtype) -> (kvsim_cache::SsmCache, kvsim_cache::GdnParams) {
    use kvsim_cache::{GdnParams, SsmCache, SsmSpec};
    use mlx_rs::Array;
    let spec = SsmSpec { kernel: 4, heads_k: 1, heads_v: 2, dk: 4, dv: 2, dtype };
    let c = spec.conv_dim();
    let vals = |n: usize, seed: u32| -> Vec<f32> {
        (0..n).map(|i| (((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 20) as f32 / 4096.0) - 0.5).collect()
    };
    let arr = |v: Vec<f32>, shape: &[i32]| Array::from_slice(&v, shape).as_dtype(dtype.to_mlx()).unwrap();
    let params = GdnParams {
        conv_weight: arr(vals(c * 4, 1), &[c as i32, 4, 1]),
        a_log: Array::from_slice(&vals(2, 2), &[2]),
        dt_bias: arr(vals(2, 3), &[2]),
    };
    let mut cache = SsmCache::new(spec, 2).unwrap();
    let s = 5;
    cache
        .window(
            &arr(vals(2 * s * c, 4), &[2, s as i32, c as i32]),
            &arr(vals(2 * s * 2, 5), &[2, s as i32, 2]),
            &arr(vals(2 * s * 2, 6), &[2, s as i32, 2]),
            &params,
        )
        .unwrap();
    (cache, params)
}

#[test]
fn the_recurrent_cache_round_trips_continues_and_refuses_bad_entries() {
    let _g = testlock::shared();
    for dtype in [KvDtype::F32, KvDtype::Bf16] {
        let (orig, params) = ssm_cache(dtype);
        let p = Persisted { cache: AnyCache::Ssm(orig.clone()), minimum_reusable_offset: 3 };
        let back = roundtrip(&p);
        assert_eq!(back.minimum_reusable_offset, 3);
        let AnyCache::Ssm(mut b) = back.cache else { panic!("kind changed") };
        assert_eq!(b.offsets(), orig.offsets());
        assert_same_bytes(b.conv(), orig.conv(), "conv");
        assert_same_bytes(b.recurrent(), orig.recurrent(), "recurrent");
        // Continuation: the restored cache decodes exactly as the one never saved.
        let mut a = orig.clone();
        let c = a.spec().conv_dim();
        let one = |n: usize, x: f32| {
            mlx_rs::Array::from_slice(&vec![x; n], &[2, 1, (n / 2) as i32]).as_dtype(dtype.to_mlx()).unwrap()
        };
        let (q, ga, gb) = (one(2 * c, 0.25), one(4, -0.5), one(4, 0.125));
        let (y1, y2) = (a.decode(&q, &ga, &gb, &params).unwrap(), b.decode(&q, &ga, &gb, &params).unwrap());
        assert_same_bytes(&y1, &y2, "decode after restore");
        assert_same_bytes(a.recurrent(), b.recurrent(), "state after restore");
        // Not at rest: a pending prefill or an armed round is refused, the cache unchanged.
        let reg = Registry::default();
        let mut pending = orig.clone();
        pending.prepare(&[1, 1], &[]).unwrap();
        assert!(matches!(reg.encode(&Persisted::new(AnyCache::Ssm(pending))), Err(PersistError::Unsupported { .. })));
        let mut armed = orig.clone();
        armed.spec_round_begin().unwrap();
        assert!(matches!(reg.encode(&Persisted::new(AnyCache::Ssm(armed))), Err(PersistError::Unsupported { .. })));
        // Lying entries: a row count the tensors do not have, a wrong dtype, a floor past the offset.
        let good = reg.encode(&p).unwrap();
        let mut e = good.clone();
        e.state["offsets"] = serde_json::json!([5, 5, 5]);
        assert!(matches!(reg.decode(&e), Err(PersistError::Shape { .. })), "{:?}", reg.decode(&e).err());
        let mut e = good.clone();
        e.state["dk"] = serde_json::json!(usize::MAX);
        assert!(reg.decode(&e).is_err());
        let mut e = good.clone();
        e.tensors[1].1.dtype = crate::tensor::TensorDtype::BF16;
        assert!(matches!(reg.decode(&e), Err(PersistError::Dtype { .. })));
        let mut e = good.clone();
        e.minimum_reusable_offset = 99;
        assert!(matches!(reg.decode(&e), Err(PersistError::InvalidFloor { .. })));
        // The mlx-lm form: an ArraysCache [conv, recurrent] whose offsets travel in the user metadata.
        let file = mlxlm::file_from_kvsim(&BTreeMap::new(), &[AnyCache::Ssm(orig.clone())]).unwrap();
        assert_eq!(file.layers[0].class_name(), "ArraysCache");
        let read = mlxlm::read(&mlxlm::write(&file).unwrap()).unwrap();
        let AnyCache::Ssm(m) = mlxlm::file_to_kvsim(&read).unwrap().remove(0) else { panic!("kind changed") };
        assert_eq!(m.offsets(), orig.offsets());
        assert_same_bytes(m.conv(), orig.conv(), "conv via mlx-lm");
        assert_same_bytes(m.recurrent(), orig.recurrent(), "recurrent via mlx-lm");
        // Without the offsets the file is refused (the class stores none), and so is a pending or armed cache.
        let mut bare = read.clone();
        bare.metadata.clear();
        assert!(matches!(mlxlm::file_to_kvsim(&bare), Err(PersistError::Missing { .. })));
        bare.metadata.insert(mlxlm::SSM_OFFSETS_KEY.into(), "{\"0\": [1]}".into());
        assert!(matches!(mlxlm::file_to_kvsim(&bare), Err(PersistError::Shape { .. })), "one offset for two rows");
        bare.metadata.insert(mlxlm::SSM_OFFSETS_KEY.into(), "not json".into());
        assert!(matches!(mlxlm::file_to_kvsim(&bare), Err(PersistError::Malformed { .. })));
        let mut pending = orig.clone();
        pending.prepare(&[1, 1], &[]).unwrap();
        assert!(matches!(mlxlm::from_kvsim(&AnyCache::Ssm(pending)), Err(PersistError::Unsupported { .. })));
        // The fuzz seed corpus holds this file (valid) and a truncated copy (bad); refresh with KVSIM_WRITE_SEEDS=1.
        if dtype == KvDtype::Bf16 && std::env::var_os("KVSIM_WRITE_SEEDS").is_some() {
            let bytes = kvsim::encode(&reg, &BTreeMap::new(), std::slice::from_ref(&p)).unwrap();
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/cache_file");
            std::fs::write(dir.join("valid-kvsim-ssm_cache.kvsim"), &bytes).unwrap();
            std::fs::write(dir.join("bad-kvsim-ssm-truncated.kvsim"), &bytes[..bytes.len() - 7]).unwrap();
        }
    }
}
/// A spec whose head dim every group divides (the shared test spec's D = 8 is below MLX's smallest group).
fn qspec(dtype: KvDtype) -> KvSpec {
    KvSpec { heads_kv: 2, head_dim: 128, ..spec(dtype) }
}

fn quant_serial(max: Option<usize>, q: QuantSpec, dtype: KvDtype) -> SerialCache {
    let sp = qspec(dtype);
    let mut c = match max {
        None => QuantizedKvCache::new(sp, q).unwrap(),
        Some(w) => RotatingQuantizedKvCache::new(sp, w, q).unwrap(),
    };
    window_s(&mut c, 1, 3);
    for s in 0..5 {
        decode_s(&mut c, 10 + s);
    }
    c
}

fn assert_planes_same(a: &SerialCache, b: &SerialCache, what: &str) {
    assert_eq!((a.state(), a.storage(), a.spec(), a.max_size()), (b.state(), b.storage(), b.spec(), b.max_size()));
    for (i, (x, y)) in a.physical_planes().unwrap().iter().zip(b.physical_planes().unwrap().iter()).enumerate() {
        assert_same_bytes(x, y, &format!("{what}: plane {i}"));
    }
}

#[test]
fn quantized_kinds_round_trip_as_stored_and_continue_byte_identically() {
    let _g = testlock::shared();
    // 3-, 5- and 6-bit planes run across word boundaries; a window of 4 after 8 positions has wrapped.
    for (max, bits, group, dtype) in [
        (None, 4, 64, KvDtype::Bf16),
        (Some(4), 3, 32, KvDtype::F32),
        (Some(5), 5, 128, KvDtype::Bf16),
        (None, 6, 32, KvDtype::F32),
        (Some(16), 8, 64, KvDtype::Bf16),
        (None, 2, 128, KvDtype::F32),
    ] {
        let q = QuantSpec { bits, group };
        let what = format!("{max:?} {bits}/{group} {dtype:?}");
        let mut orig = quant_serial(max, q, dtype);
        let p = roundtrip(&Persisted::new(AnyCache::Serial(orig.clone())));
        assert_eq!(p.cache.storage_kind(), orig.storage_kind(), "{what}");
        let AnyCache::Serial(mut back) = p.cache else { panic!("kind changed") };
        assert_planes_same(&orig, &back, &what);
        for s in 0..6 {
            let (o1, o2) = (decode_s(&mut orig, 100 + s), decode_s(&mut back, 100 + s));
            assert_same_bytes(&o1, &o2, &format!("{what}: decode {s}"));
        }
        let (o1, o2) = (window_s(&mut orig, 200, 3), window_s(&mut back, 200, 3));
        assert_same_bytes(&o1, &o2, &format!("{what}: window"));
        assert_planes_same(&orig, &back, &format!("{what}: after continuing"));
    }
}

#[test]
fn quantized_row_batches_round_trip_and_continue() {
    let _g = testlock::shared();
    for max in [None, Some(4)] {
        let q = QuantSpec { bits: 4, group: 32 };
        let (a, b) = (quant_serial(max, q, KvDtype::Bf16), {
            let mut b = quant_serial(max, q, KvDtype::Bf16);
            decode_s(&mut b, 77);
            b
        });
        let sp = qspec(KvDtype::Bf16);
        let mut orig =
            RowBatch::join_storage(sp, max, Storage::Affine(q), &[JoinSource::Serial(&a), JoinSource::Serial(&b)])
                .unwrap();
        decode_b(&mut orig, 40);
        let AnyCache::Rows(mut back) = roundtrip(&Persisted::new(AnyCache::Rows(orig.clone()))).cache else {
            panic!("kind changed")
        };
        assert_eq!(orig.row_states(), back.row_states());
        assert_eq!(orig.storage_kind(), back.storage_kind());
        for s in 0..4 {
            let (o1, o2) = (decode_b(&mut orig, 60 + s), decode_b(&mut back, 60 + s));
            assert_same_bytes(&o1, &o2, &format!("{max:?} decode {s}"));
        }
        assert_planes_same(&orig.extract(1).unwrap(), &back.extract(1).unwrap(), "extract");
        // The batch constructor the seeds name gives the same kind.
        let empty = BatchQuantizedKvCache::with_rows(sp, max, q, 2).unwrap();
        assert_eq!(empty.storage_kind(), orig.storage_kind());
    }
}

#[test]
fn quantized_entries_that_lie_are_typed_errors() {
    let _g = testlock::shared();
    let reg = Registry::default();
    let q = QuantSpec { bits: 4, group: 64 };
    let good = reg.encode(&Persisted::new(AnyCache::Serial(quant_serial(Some(4), q, KvDtype::Bf16)))).unwrap();
    assert!(reg.decode(&good).is_ok());
    // The kind says 8 bits, the state and planes 4.
    let mut e = good.clone();
    e.storage_kind = "kv:rotating-quant:8:64".into();
    assert!(matches!(reg.decode(&e), Err(PersistError::Malformed { .. })), "{:?}", reg.decode(&e).err());
    // State and kind agree on 8 bits, the packed plane holds 4-bit words.
    e.state["quant"]["bits"] = 8.into();
    assert!(matches!(reg.decode(&e), Err(PersistError::Shape { .. })), "{:?}", reg.decode(&e).err());
    // Relabelled as a plain ring: no `keys` tensor, and the quant state is refused.
    let mut e = good.clone();
    e.storage_kind = "rotating-plain".into();
    assert!(reg.decode(&e).is_err());
    // A missing plane, a plane of the wrong dtype.
    let mut e = good.clone();
    e.tensors.retain(|(n, _)| n != "values.biases");
    assert!(matches!(reg.decode(&e), Err(PersistError::Missing { .. })));
    let mut e = good.clone();
    let scales = e.tensors.iter_mut().find(|(n, _)| n == "keys.scales").unwrap();
    scales.1.dtype = super::tensor::TensorDtype::F16;
    assert!(matches!(reg.decode(&e), Err(PersistError::Dtype { .. })));
    // A group the head dim does not divide cannot even be named; one that MLX rejects is unknown.
    let mut e = good;
    e.storage_kind = "kv:rotating-quant:4:48".into();
    assert!(matches!(reg.decode(&e), Err(PersistError::UnknownKind { .. })));
}

/// A quantized cache never takes a dense mlx-lm form (its dequantized values would restore a plain cache): the linear
/// one is a `QuantizedKVCache`, the ring and the rows have no mlx-lm form.
#[test]
fn quantized_caches_never_take_the_dense_mlxlm_forms() {
    let _g = testlock::shared();
    let spec = KvSpec { heads_kv: 1, head_dim: 32, dtype: KvDtype::F32 };
    let q = QuantSpec { bits: 4, group: 32 };
    let mut lin = QuantizedKvCache::new(spec, q).unwrap();
    window_s(&mut lin, 3, 3);
    let r = mlxlm::from_kvsim(&AnyCache::Serial(lin));
    assert!(matches!(r, Ok(mlxlm::MlxLayer::QuantizedKvCache { .. })), "{r:?}");
    let mut ring = RotatingQuantizedKvCache::new(spec, 4, q).unwrap();
    window_s(&mut ring, 4, 5);
    let rows = BatchQuantizedKvCache::with_rows(spec, Some(4), q, 2).unwrap();
    for c in [AnyCache::Serial(ring), AnyCache::Rows(rows)] {
        let r = mlxlm::from_kvsim(&c);
        assert!(matches!(r, Err(PersistError::Unsupported { .. })), "{}: {r:?}", c.storage_kind());
    }
}

/// A chunked cache (mlx-lm's `ChunkedKVCache` rule) and a list of caches (mlx-lm's `CacheList`: a DeltaNet state
/// beside an attention cache) round-trip through both formats and continue byte-identically.
#[test]
fn chunked_caches_and_lists_round_trip_in_both_formats_and_continue() {
    use kvsim_cache::ChunkedKvCache;
    let _g = testlock::shared();
    let mut ch = ChunkedKvCache::from_cache(serial(None, KvDtype::Bf16), 4).unwrap();
    assert_eq!(ch.maybe_trim_front().unwrap(), 5);
    assert_eq!((ch.offset(), ch.start_position()), (9, 5));
    let (ssm, params) = ssm_cache(KvDtype::Bf16);
    let list = AnyCache::List(vec![AnyCache::Ssm(ssm.extract(1).unwrap()), AnyCache::Chunked(ch.clone())]);
    for via_mlxlm in [false, true] {
        let back = if via_mlxlm {
            let f = mlxlm::file_from_kvsim(&BTreeMap::new(), std::slice::from_ref(&list)).unwrap();
            assert_eq!(f.layers[0].class_name(), "CacheList");
            mlxlm::file_to_kvsim(&mlxlm::read(&mlxlm::write(&f).unwrap()).unwrap()).unwrap().remove(0)
        } else {
            roundtrip(&Persisted { cache: list.clone(), minimum_reusable_offset: 2 }).cache
        };
        assert_eq!(back.storage_kind().0, "cache-list");
        let AnyCache::List(mut kids) = back else { panic!("kind changed") };
        let (AnyCache::Chunked(mut b), AnyCache::Ssm(mut s)) = (kids.pop().unwrap(), kids.pop().unwrap()) else {
            panic!("children changed kinds")
        };
        let mut a = ch.clone();
        assert_serial_same(a.cache(), b.cache(), "chunked after load");
        assert_eq!(b.chunk_size(), 4);
        for step in 0..6 {
            assert_eq!(a.maybe_trim_front().unwrap(), b.maybe_trim_front().unwrap());
            let (o1, o2) = if step % 2 == 0 {
                (decode_s(a.cache_mut(), 500 + step), decode_s(b.cache_mut(), 500 + step))
            } else {
                (window_s(a.cache_mut(), 500 + step, 2), window_s(b.cache_mut(), 500 + step, 2))
            };
            assert_same_bytes(&o1, &o2, &format!("chunked step {step} (via mlx-lm: {via_mlxlm})"));
        }
        assert_serial_same(a.cache(), b.cache(), "chunked after continuing");
        let mut o = ssm.extract(1).unwrap();
        let c = o.spec().conv_dim();
        let one = |n: usize, x: f32| {
            mlx_rs::Array::from_slice(&vec![x; n], &[1, 1, n as i32]).as_dtype(mlx_rs::Dtype::Bfloat16).unwrap()
        };
        let (q, ga, gb) = (one(c, 0.25), one(2, -0.5), one(2, 0.125));
        assert_same_bytes(
            &o.decode(&q, &ga, &gb, &params).unwrap(),
            &s.decode(&q, &ga, &gb, &params).unwrap(),
            "ssm child",
        );
        assert_same_bytes(o.recurrent(), s.recurrent(), "ssm child state");
    }
    // A list entry whose children name tensors it does not hold, or hold tensors no child names, is refused.
    let reg = Registry::default();
    let good = reg.encode(&Persisted::new(list)).unwrap();
    let mut e = good.clone();
    e.tensors.pop();
    assert!(matches!(reg.decode(&e), Err(PersistError::Missing { .. })));
    let mut e = good.clone();
    e.tensors.push(("9.extra".into(), e.tensors[0].1.clone()));
    assert!(matches!(reg.decode(&e), Err(PersistError::Malformed { .. })));
    // A chunk size that disagrees with the kind's.
    let mut e = reg.encode(&Persisted::new(AnyCache::Chunked(ch))).unwrap();
    e.state["chunk_size"] = serde_json::json!(5);
    assert!(matches!(reg.decode(&e), Err(PersistError::Malformed { .. })));
}

/// The mutation catalog's persistence mutants: each breaks a check here (and none of these checks fails unarmed).
/// `floor-not-persisted`, `mlxlm-load-drops-right-padding` and `codec-saves-whole-buffer` are also hunted by the
/// simulator's `persist` op; `mlxlm-rotated-flag-from-string` only here (no writer of 0.32.2 makes a string flag).
#[cfg(feature = "faults")]
#[test]
fn persistence_mutants_break_a_check() {
    use crate::tensor::HostTensor;
    use kvsim_cache::faults::Mutant;
    // A BatchRotatingKVCache file whose `rotated` leaf is the string "False" (the older layout).
    let string_flag = || -> Vec<u8> {
        let f = mlxlm::file_from_kvsim(&BTreeMap::new(), &[AnyCache::Rows(rows(Some(4), false))]).unwrap();
        let bytes = mlxlm::write(&f).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let (_, meta) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let mut md = meta.metadata().clone().unwrap();
        let j = md.iter().find(|(_, v)| v.as_str() == "0.7").map(|(k, _)| k.clone()).unwrap();
        md.insert(format!("{}.1", &j[..j.len() - 2]), "string".into());
        let cps: Vec<i32> = "False".chars().map(|c| c as i32).collect();
        let flag = HostTensor::vec_i32(&cps);
        let mut owned: Vec<(String, HostTensor)> = st
            .tensors()
            .into_iter()
            .filter(|(n, _)| n != "0.7")
            .map(|(n, v)| {
                let t = crate::TensorDtype::from_safetensors(v.dtype()).unwrap();
                (n.clone(), HostTensor::new(&n, t, v.shape().to_vec(), v.data().to_vec()).unwrap())
            })
            .collect();
        owned.push(("0.7".into(), flag));
        let views: Vec<_> = owned
            .iter()
            .map(|(n, t)| {
                (
                    n.clone(),
                    safetensors::tensor::TensorView::new(t.dtype.to_safetensors(), t.shape.clone(), &t.data).unwrap(),
                )
            })
            .collect();
        safetensors::serialize(views, Some(md)).unwrap()
    };
    let detect = |m: Mutant| -> Result<(), String> {
        match m {
            Mutant::FloorNotPersisted => {
                let p = roundtrip(&Persisted {
                    cache: AnyCache::Serial(serial(None, KvDtype::Bf16)),
                    minimum_reusable_offset: 4,
                });
                (p.minimum_reusable_offset == 4).then_some(()).ok_or_else(|| "floor lost".into())
            }
            Mutant::MlxlmLoadDropsRightPadding => {
                let orig = rows(None, true);
                let reg = Registry::default();
                let bytes =
                    kvsim::encode(&reg, &BTreeMap::new(), &[Persisted::new(AnyCache::Rows(orig.clone()))]).unwrap();
                let AnyCache::Rows(back) = kvsim::decode(&reg, &bytes).unwrap().1.remove(0).cache else { panic!() };
                (back.row_states() == orig.row_states()).then_some(()).ok_or_else(|| "pending prefill lost".into())
            }
            Mutant::MlxlmRotatedFlagFromString => match mlxlm::read(&string_flag()) {
                Err(PersistError::Malformed { .. }) => Ok(()),
                other => Err(format!("a string flag read as {:?}", other.map(|f| f.layers[0].clone()).ok())),
            },
            Mutant::CodecSavesWholeBuffer => {
                let orig = serial(None, KvDtype::Bf16);
                assert!(orig.cap() > orig.state().len, "the sample must hold spare capacity");
                let reg = Registry::default();
                let p = Persisted::new(AnyCache::Serial(orig.clone()));
                let bytes = kvsim::encode(&reg, &BTreeMap::new(), &[p]).map_err(|e| e.to_string())?;
                match kvsim::decode(&reg, &bytes).map_err(|e| e.to_string())?.1.remove(0).cache {
                    AnyCache::Serial(b) if b.state() == orig.state() => Ok(()),
                    other => Err(format!("restored {:?}", other.offset())),
                }
            }
            Mutant::FirstLayerBookkeeping => {
                let full = serial(None, KvDtype::Bf16);
                let mut cut = full.clone();
                cut.trim(2, false).unwrap();
                let set = [Persisted::new(AnyCache::Serial(full)), Persisted::new(AnyCache::Serial(cut.clone()))];
                let reg = Registry::default();
                let bytes = kvsim::encode(&reg, &BTreeMap::new(), &set).map_err(|e| e.to_string())?;
                match kvsim::decode(&reg, &bytes).map_err(|e| e.to_string())?.1.remove(1).cache {
                    AnyCache::Serial(b) if b.state() == cut.state() => Ok(()),
                    other => Err(format!("the trimmed layer restored at offset {}", other.offset())),
                }
            }
            _ => unreachable!(),
        }
    };
    let ms = [
        Mutant::FloorNotPersisted,
        Mutant::MlxlmLoadDropsRightPadding,
        Mutant::MlxlmRotatedFlagFromString,
        Mutant::CodecSavesWholeBuffer,
        Mutant::FirstLayerBookkeeping,
    ];
    {
        let _g = testlock::shared();
        for m in ms {
            detect(m).unwrap_or_else(|e| panic!("{m}: unarmed check failed: {e}"));
        }
    }
    for m in ms {
        assert_eq!(m.layout(), "persist");
        let _armed = testlock::arm(m);
        assert!(detect(m).is_err(), "{m} survived");
    }
}

fn lego_decode(c: &mut kvsim_cache::Bf16FirstCache, seed: u64) -> mlx_rs::Array {
    let (k, v, q) = kvq(&c.inner().spec(), seed, 1, 1);
    c.decode(&k, &v, &q, SCALE, &Masks::new()).unwrap().0
}

fn lego_window(c: &mut kvsim_cache::Bf16FirstCache, seed: u64, l: usize) -> mlx_rs::Array {
    let (k, v, q) = kvq(&c.inner().spec(), seed, 1, l);
    c.window(&k, &v, &q, SCALE, &Masks::new()).unwrap().0
}

fn assert_lego_same(a: &kvsim_cache::Bf16FirstCache, b: &kvsim_cache::Bf16FirstCache, what: &str) {
    assert_eq!(a.lego_kind(), b.lego_kind(), "{what}: kind");
    assert_eq!(
        (a.converted_at(), a.minimum_reusable_offset(), a.max_append_tokens()),
        (b.converted_at(), b.minimum_reusable_offset(), b.max_append_tokens()),
        "{what}: lifecycle"
    );
    assert_planes_same(a.inner(), b.inner(), what);
}

/// The bf16-first legos (and so the transitioning rows, through their extracted serial rows): saved before and
/// after their conversion, through a wrap and a trim below `start`; each loaded lego continues byte for byte (it
/// converts at the same append, with the same floor) and entries that lie about the lifecycle are typed errors.
#[test]
fn bf16_first_legos_round_trip_across_their_conversion_and_continue() {
    use kvsim_cache::{Bf16FirstCache, Transition};
    let _g = testlock::shared();
    let reg = Registry::default();
    for (max, bits, group, start) in
        [(None, 4, 64, Some(6)), (Some(4), 5, 32, Some(3)), (Some(8), 3, 128, Some(0)), (None, 8, 32, None)]
    {
        let t = Transition { start, quant: QuantSpec { bits, group } };
        let what = format!("{max:?} {bits}/{group} start {start:?}");
        let mut orig = Bf16FirstCache::new(qspec(KvDtype::Bf16), max, t).unwrap();
        // Saved empty, in bf16, then at every append until well past the conversion (and a wrap for the rings).
        for step in 0..10u64 {
            let mut back = match roundtrip(&Persisted::new(AnyCache::Bf16First(orig.clone()))).cache {
                AnyCache::Bf16First(c) => c,
                other => panic!("{what}: restored as {}", other.storage_kind()),
            };
            assert_lego_same(&orig, &back, &format!("{what} step {step}"));
            for s in 0..3 {
                let (o1, o2) = (lego_decode(&mut orig, 100 * step + s), lego_decode(&mut back, 100 * step + s));
                assert_same_bytes(&o1, &o2, &format!("{what} step {step}: decode {s}"));
            }
            assert_lego_same(&orig, &back, &format!("{what} step {step}: continued"));
            lego_window(&mut orig, 1000 + step, 2);
        }
        // Conversion is irreversible: a trim below start keeps the affine storage and the floor, and saves so.
        if max.is_none() && start.is_some() {
            let n = orig.offset() - 1;
            orig.trim(n, false).unwrap();
            let AnyCache::Bf16First(back) = roundtrip(&Persisted::new(AnyCache::Bf16First(orig.clone()))).cache else {
                panic!("{what}: kind changed")
            };
            assert_lego_same(&orig, &back, &format!("{what}: trimmed below start"));
        }
        // The fuzz seed corpus holds a converted linear and a converted ring lego; refresh with KVSIM_WRITE_SEEDS=1.
        if orig.converted_at().is_some() && std::env::var_os("KVSIM_WRITE_SEEDS").is_some() {
            let name = if max.is_some() { "bf16_first_rotating" } else { "bf16_first" };
            let p = Persisted::new(AnyCache::Bf16First(orig.clone()));
            let bytes = kvsim::encode(&reg, &BTreeMap::new(), std::slice::from_ref(&p)).unwrap();
            let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/cache_file");
            std::fs::write(dir.join(format!("valid-kvsim-{name}.kvsim")), &bytes).unwrap();
        }
        // mlx-lm has no class for it.
        assert!(matches!(mlxlm::from_kvsim(&AnyCache::Bf16First(orig.clone())), Err(PersistError::Unsupported { .. })));
    }

    // Entries that lie: each a typed error, never a lego.
    let t = Transition { start: Some(4), quant: QuantSpec { bits: 4, group: 64 } };
    let mut lego = Bf16FirstCache::new(qspec(KvDtype::Bf16), Some(8), t).unwrap();
    lego_window(&mut lego, 7, 5);
    assert_eq!(lego.converted_at(), Some(5));
    let good = reg.encode(&Persisted::new(AnyCache::Bf16First(lego.clone()))).unwrap();
    assert!(reg.decode(&good).is_ok());
    let lie = |f: &dyn Fn(&mut Entry)| {
        let mut e = good.clone();
        f(&mut e);
        reg.decode(&e).err().unwrap_or_else(|| panic!("accepted: {e:?}"))
    };
    // Converted before its start; a floor the conversion did not leave; said unconverted while holding affine planes.
    assert!(matches!(lie(&|e| e.state["converted_at"] = 3.into()), PersistError::Cache(_)));
    if std::env::var_os("KVSIM_WRITE_SEEDS").is_some() {
        // The fuzz seed corpus's lying lego: every checksum right, the lifecycle impossible (floor 0 after a
        // conversion at 5 with start 4).
        let mut e = good.clone();
        e.state["floor"] = 0.into();
        let bytes = kvsim::encode_entries(&BTreeMap::new(), &[e]).unwrap();
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/seeds/cache_file");
        std::fs::write(dir.join("bad-kvsim-bf16-first-floor.kvsim"), &bytes).unwrap();
    }
    assert!(matches!(lie(&|e| e.state["floor"] = 0.into()), PersistError::Cache(_)));
    assert!(matches!(lie(&|e| e.state["converted_at"] = serde_json::Value::Null), PersistError::Malformed { .. }));
    // The kind's window or format differs from the stored storage's.
    assert!(lie(&|e| e.storage_kind = "kv:bf16-first-rotating-quant:16:4:64:4".into()).to_string().contains("window"));
    assert!(matches!(
        lie(&|e| e.storage_kind = "kv:bf16-first-rotating-quant:8:8:64:4".into()),
        PersistError::Cache(_)
    ));
    // Unknown fields, a kind that does not parse back.
    assert!(matches!(lie(&|e| e.state["extra"] = 1.into()), PersistError::Malformed { .. }));
    assert!(matches!(
        lie(&|e| e.storage_kind = "kv:bf16-first-quant:4:64:04".into()),
        PersistError::UnknownKind { .. }
    ));
    // An armed round is not a resting state: refused on save.
    let mut armed = lego;
    armed.round_begin().unwrap();
    assert!(matches!(reg.encode(&Persisted::new(AnyCache::Bf16First(armed))), Err(PersistError::Unsupported { .. })));
}

/// A model's cache set whose layers differ (a sliding layer that wrapped and cannot trim beside a full layer that
/// trimmed, and a list whose children were trimmed apart) comes back layer by layer from both formats; each layer
/// keeps its own offset, ring phase and bytes, and the list's floor may lie between its children's offsets.
#[test]
fn layers_that_differ_come_back_layer_by_layer_in_both_formats() {
    let _g = testlock::shared();
    let mut sliding = serial(Some(4), KvDtype::Bf16);
    decode_s(&mut sliding, 40);
    assert!(!sliding.is_trimmable(), "the sliding layer has wrapped");
    let before = sliding.state().clone();
    assert!(sliding.trim(1, false).is_err(), "a wrapped ring refuses a plain trim");
    assert_eq!(sliding.state(), &before, "a refused trim changes nothing");
    let mut full = serial(None, KvDtype::Bf16);
    decode_s(&mut full, 41);
    let mut trimmed = full.clone();
    assert_eq!(trimmed.trim(3, false).unwrap(), 3);
    let mut child = trimmed.clone();
    assert_eq!(child.trim(2, false).unwrap(), 2);
    let list = AnyCache::List(vec![AnyCache::Serial(child.clone()), AnyCache::Serial(full.clone())]);
    let layers =
        [AnyCache::Serial(sliding.clone()), AnyCache::Serial(full.clone()), AnyCache::Serial(trimmed.clone()), list];
    let offsets: Vec<usize> = layers.iter().map(AnyCache::offset).collect();
    assert_eq!(offsets, [10, 10, 7, 10]);
    // The list's floor lies above one child's offset and below the other's.
    assert!(child.offset() < 6 && 6 <= full.offset());
    let floors = [0, 5, 7, 6];
    let set: Vec<Persisted> =
        layers.iter().zip(floors).map(|(c, f)| Persisted { cache: c.clone(), minimum_reusable_offset: f }).collect();
    let check = |back: &[Persisted], what: &str, with_floors: bool| {
        assert_eq!(back.len(), 4, "{what}");
        for (i, (a, b)) in layers.iter().zip(back).enumerate() {
            let at = format!("{what}: layer {i}");
            match (a, &b.cache) {
                (AnyCache::Serial(a), AnyCache::Serial(b)) => assert_serial_same(a, b, &at),
                (AnyCache::List(a), AnyCache::List(b)) => {
                    assert_eq!(a.len(), b.len(), "{at}");
                    for (x, y) in a.iter().zip(b) {
                        let (AnyCache::Serial(x), AnyCache::Serial(y)) = (x, y) else { panic!("{at}: child kind") };
                        assert_serial_same(x, y, &at);
                    }
                }
                _ => panic!("{at}: kind changed"),
            }
            if with_floors {
                assert_eq!(b.minimum_reusable_offset, floors[i], "{at}: floor");
            }
        }
    };
    let reg = Registry::default();
    let bytes = kvsim::encode(&reg, &BTreeMap::new(), &set).unwrap();
    check(&kvsim::decode(&reg, &bytes).unwrap().1, "kvsim", true);
    let plain: Vec<AnyCache> = layers.to_vec();
    let f = mlxlm::file_from_kvsim(&BTreeMap::new(), &plain).unwrap();
    let back: Vec<Persisted> = mlxlm::file_to_kvsim(&mlxlm::read(&mlxlm::write(&f).unwrap()).unwrap())
        .unwrap()
        .into_iter()
        .map(Persisted::new)
        .collect();
    check(&back, "mlx-lm", false);
}

/// Files whose layers disagree, each well formed and under valid checksums: a layer given another layer's
/// bookkeeping (kvsim's format: the trimmed layer's state replaced by its untrimmed sibling's; mlx-lm's: a
/// sliding layer's `_idx` and offset taken from the full layer beside it) is refused with a typed error.
#[test]
fn a_layer_holding_another_layers_bookkeeping_is_refused() {
    let _g = testlock::shared();
    let full = serial(None, KvDtype::Bf16);
    let mut trimmed = full.clone();
    trimmed.trim(3, false).unwrap();
    let reg = Registry::default();
    let mut entries = [full.clone(), trimmed]
        .into_iter()
        .map(|c| reg.encode(&Persisted::new(AnyCache::Serial(c))).unwrap())
        .collect::<Vec<_>>();
    entries[1].state = entries[0].state.clone();
    let bytes = kvsim::encode_entries(&BTreeMap::new(), &entries).unwrap();
    assert!(kvsim::decode_entries(&bytes).is_ok(), "the lie is under valid checksums");
    match kvsim::decode(&reg, &bytes) {
        Err(PersistError::Cache(_)) | Err(PersistError::Malformed { .. }) => {}
        other => panic!("a layer with its sibling's bookkeeping: {:?}", other.map(|(_, c)| c.len())),
    }
    let sliding = serial(Some(4), KvDtype::Bf16);
    let caches = [AnyCache::Serial(sliding), AnyCache::Serial(full.clone())];
    let mut f = mlxlm::file_from_kvsim(&BTreeMap::new(), &caches).unwrap();
    let n = full.offset() as i64;
    let mlxlm::MlxLayer::RotatingKvCache { offset, idx, .. } = &mut f.layers[0] else {
        panic!("not a RotatingKVCache")
    };
    (*offset, *idx) = (n, n);
    let bytes = mlxlm::write(&f).unwrap();
    assert!(mlxlm::read(&bytes).is_ok(), "the file parses");
    match mlxlm::file_to_kvsim(&mlxlm::read(&bytes).unwrap()) {
        Err(e) => assert!(!e.to_string().is_empty()),
        Ok(_) => panic!("a sliding layer with its full sibling's _idx loaded"),
    }
}

/// A paged store: two requests sharing a prefix through the index, one of them a row of the running batch. Affine
/// storage takes a head dim of 64 (the smallest group is 32).
fn paged_store(dtype: KvDtype, storage: Storage) -> kvsim_cache::PagedStore {
    let mut spec = spec(dtype);
    if storage != Storage::Plain {
        spec.head_dim = 64;
    }
    let pool = kvsim_cache::PoolSpec { block_size: 3, initial_blocks: 2, max_blocks: 32, grow_by: 2, index_budget: 16 };
    let mut st = kvsim_cache::PagedStore::with_storage(spec, pool, storage).unwrap();
    let prompt: Vec<u32> = (100..108).collect();
    let a = st.open();
    let (k, v, q) = kvq(&spec, 5, 1, 8);
    st.window(a, &prompt, &k, &v, &q, SCALE).unwrap();
    st.finish(a).unwrap();
    let (b, hit) = st.open_with_prefix(&prompt, 7);
    assert_eq!(hit.positions, 6);
    let (k, v, q) = kvq(&spec, 6, 1, 2);
    st.window(b, &[106, 7], &k, &v, &q, SCALE).unwrap();
    let c = st.open();
    let (k, v, q) = kvq(&spec, 7, 1, 4);
    st.window(c, &[1, 2, 3, 4], &k, &v, &q, SCALE).unwrap();
    st.join(&[b]).unwrap();
    st
}

#[test]
fn a_paged_store_round_trips_whole_and_continues_byte_identically() {
    let _g = testlock::shared();
    let affine = Storage::Affine(QuantSpec { bits: 4, group: 32 });
    for (dtype, storage) in [
        (KvDtype::F32, Storage::Plain),
        (KvDtype::Bf16, Storage::Plain),
        (KvDtype::F32, affine),
        (KvDtype::Bf16, affine),
    ] {
        let st = paged_store(dtype, storage);
        let AnyCache::Paged(mut back) = roundtrip(&Persisted::new(AnyCache::Paged(st.clone()))).cache else {
            panic!("a paged entry decoded as another cache");
        };
        assert_eq!(back.to_parts().unwrap().0, st.to_parts().unwrap().0, "{dtype:?}: parts");
        let (planes, again) = (st.to_parts().unwrap().1.unwrap(), back.to_parts().unwrap().1.unwrap());
        assert_eq!(planes.len(), storage.planes());
        assert_eq!(back.storage(), storage);
        for (i, (a, b)) in planes.iter().zip(&again).enumerate() {
            assert_same_bytes(a, b, &format!("{storage:?}: plane {i}"));
        }
        // Both continue alike: a decode of the row, a fork of it, a finish into the index.
        let mut orig = st.clone();
        for s in [&mut orig, &mut back] {
            let (k, v, q) = kvq(&s.spec(), 9, 1, 1);
            let out = s.rows_decode(&[9], &k, &v, &q, SCALE, &Masks::new()).unwrap().0;
            let row0 = s.rows()[0];
            let f = s.fork(row0).unwrap();
            s.finish(f).unwrap();
            s.audit().unwrap();
            let _ = out;
        }
        let (k, v, q) = kvq(&orig.spec(), 10, 1, 1);
        let a = orig.rows_decode(&[10], &k, &v, &q, SCALE, &Masks::new()).unwrap().0;
        let b = back.rows_decode(&[10], &k, &v, &q, SCALE, &Masks::new()).unwrap().0;
        assert_same_bytes(&a, &b, &format!("{dtype:?}: the restored store decodes as the original"));
        assert_eq!(orig.to_parts().unwrap().0, back.to_parts().unwrap().0, "{dtype:?}: parts after continuing");
        // Its kind routes to the paged codec only; mlx-lm has no class for it.
        let kind = st.rows_storage_kind();
        assert_eq!(
            Registry::default().codec(kind.as_str()).unwrap().storage_kind(),
            "kv:paged-rows:<block_size>[:quant:<bits>:<group>]"
        );
        assert!(matches!(mlxlm::from_kvsim(&AnyCache::Paged(st.clone())), Err(PersistError::Unsupported { .. })));
        // The file describes itself.
        let bytes =
            inspect::save_as(inspect::Format::Kvsim, &BTreeMap::new(), &[Persisted::new(AnyCache::Paged(st))]).unwrap();
        let info = inspect::inspect_bytes(&bytes).unwrap();
        assert_eq!(info.layers[0].kind, kind.to_string());
    }
}

#[test]
fn paged_entries_that_lie_or_stores_mid_round_are_refused() {
    let _g = testlock::shared();
    let reg = Registry::default();
    let st = paged_store(KvDtype::F32, Storage::Plain);
    let good = reg.encode(&Persisted::new(AnyCache::Paged(st.clone()))).unwrap();
    assert!(reg.decode(&good).is_ok());
    let lie = |f: &dyn Fn(&mut Entry)| {
        let mut e = good.clone();
        f(&mut e);
        reg.decode(&e).map(|_| ())
    };
    // A block table past the pool, a count off by one, a row that is no sequence: the store's own checks.
    for (i, r) in [
        lie(&|e| e.state["seqs"][0][1]["table"][0] = 99.into()),
        lie(&|e| e.state["refs"][0] = 7.into()),
        lie(&|e| e.state["rows"] = serde_json::json!([42])),
    ]
    .into_iter()
    .enumerate()
    {
        assert!(matches!(r, Err(PersistError::Cache(kvsim_cache::CacheError::InvalidState { .. }))), "case {i}: {r:?}");
    }
    // Planes of the wrong shape or dtype, a plane missing, an unknown field, another block size in the kind.
    assert!(matches!(
        lie(&|e| e.state["refs"].as_array_mut().unwrap().push(0.into())),
        Err(PersistError::Shape { .. })
    ));
    assert!(matches!(
        lie(&|e| e.tensors[0].1.dtype = super::tensor::TensorDtype::BF16),
        Err(PersistError::Dtype { .. })
    ));
    assert!(matches!(lie(&|e| e.tensors.truncate(1)), Err(PersistError::Missing { .. })));
    assert!(matches!(lie(&|e| e.state["extra"] = 1.into()), Err(PersistError::Malformed { .. })));
    assert!(matches!(lie(&|e| e.storage_kind = "kv:paged-rows:4".into()), Err(PersistError::Malformed { .. })));
    assert!(matches!(lie(&|e| e.storage_kind = "kv:paged:3".into()), Err(PersistError::UnknownKind { .. })));
    // Plain planes under an affine kind, and affine state with two plain planes: refused, typed.
    assert!(matches!(
        lie(&|e| e.storage_kind = "kv:paged-rows:3:quant:4:32".into()),
        Err(PersistError::Malformed { .. })
    ));
    assert!(lie(&|e| {
        e.state["storage"] = serde_json::json!({"Affine": {"bits": 4, "group": 32}});
        e.storage_kind = "kv:paged-rows:3:quant:4:32".into();
    })
    .is_err());
    // A save while a speculative round is armed is refused, and the store is unchanged.
    let mut armed = st.clone();
    armed.round_begin().unwrap();
    let before = format!("{armed:?}");
    assert!(matches!(
        reg.encode(&Persisted::new(AnyCache::Paged(armed.clone()))),
        Err(PersistError::Unsupported { .. })
    ));
    assert_eq!(format!("{armed:?}"), before);
}
