//! The pure-Rust affine quantizer (`reference::quant`) against MLX's own bytes, for every bits x group x dtype and
//! for special groups (zeros, constants, ties, one-signed, integer ramps, wide ranges); and the quantized caches
//! against it (state checks of the family are byte compares of all three planes).

use kvsim::bytes::ArrayBytes;
use kvsim::cache::{KvDtype, KvSpec, Masks, QuantSpec, RotatingQuantizedKvCache, QUANT_BITS, QUANT_GROUPS};
use kvsim::reference::quant::{dequantize, quantize, Quantized, RefQuant};
use kvsim::reference::RefDtype;
use mlx_rs::Array;

fn pin_cpu() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| mlx_rs::Device::set_default(&mlx_rs::Device::cpu()));
}

fn words(a: &Array) -> Vec<u32> {
    ArrayBytes::of(a).unwrap().words.to_u32()
}

fn hash(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51afd7ed558ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ceb9fe1a85ec53);
    x ^ (x >> 33)
}

/// `rows` rows of `d` values in several regimes, each row rounded to the dtype.
fn regimes(seed: u64, d: usize, rows: usize, dtype: RefDtype) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows * d);
    for r in 0..rows {
        for i in 0..d {
            let h = hash(seed ^ hash((r * d + i) as u64));
            let u = (h >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
            let x = match r % 8 {
                0 => u * 4.0 - 2.0,                                                  // symmetric
                1 => u * 3.0 + 0.5,                                                  // one-signed positive
                2 => -(u * 3.0) - 0.25,                                              // one-signed negative
                3 => 0.0,                                                            // zeros
                4 => 1.75,                                                           // constant
                5 => ((i % 16) as f32) - 7.0,                                        // integer ramp (ties)
                6 => (u - 0.5) * 2.0f32.powi((h % 40) as i32 - 20),                  // wide magnitudes
                _ => (if i % 2 == 0 { 0.5 } else { -0.5 }) * (1.0 + (i % 3) as f32), // few levels
            };
            out.push(x);
        }
    }
    match dtype {
        RefDtype::F32 => out,
        RefDtype::Bf16 => out.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect(),
    }
}

#[test]
fn reference_quantize_and_dequantize_are_mlx_bytes_for_every_bits_group_dtype() {
    pin_cpu();
    let d = 128;
    let rows = 24;
    let mut cells = 0;
    for dtype in [RefDtype::F32, RefDtype::Bf16] {
        let mdt = if dtype == RefDtype::F32 { mlx_rs::Dtype::Float32 } else { mlx_rs::Dtype::Bfloat16 };
        for &bits in &QUANT_BITS {
            for &group in &QUANT_GROUPS {
                let vals = regimes(bits as u64 * 1000 + group as u64, d, rows, dtype);
                let w = Array::from_slice(&vals, &[rows as i32, d as i32]).as_dtype(mdt).unwrap();
                let (wq, s, b) = mlx_rs::ops::quantize(&w, group as i32, bits as i32).unwrap();
                let q = RefQuant { bits, group };
                let r = quantize(&vals, d, dtype, q).unwrap();
                let what = format!("{dtype:?} bits {bits} group {group}");
                assert_eq!(wq.shape(), &[rows as i32, (d * bits / 32) as i32], "{what}: packed width D*bits/32");
                assert_eq!(words(&wq), r.packed, "{what}: packed words");
                assert_eq!(words(&s), r.scales, "{what}: scales");
                assert_eq!(words(&b), r.biases, "{what}: biases");
                let deq = mlx_rs::ops::dequantize(&wq, &s, &b, group as i32, bits as i32).unwrap();
                let rd = dequantize(
                    &Quantized { packed: r.packed, scales: r.scales, biases: r.biases },
                    vals.len(),
                    dtype,
                    q,
                )
                .unwrap();
                let rd_bits: Vec<u32> =
                    rd.iter().map(|x| if dtype == RefDtype::F32 { x.to_bits() } else { x.to_bits() >> 16 }).collect();
                assert_eq!(words(&deq), rd_bits, "{what}: dequantized values");
                cells += 1;
            }
        }
    }
    assert_eq!(cells, 2 * 6 * 3);
}

/// The packed width of a quantized cache is `D * bits / 32`, also for 3, 5 and 6 bits at D = 128 where mlx-lm's
/// `D // (32 // bits)` is one word too wide (mlx-lm 0.32.2 `QuantizedKVCache`, its 5/6-bit broadcast error).
#[test]
fn quantized_ring_stores_reference_bytes_at_5_and_6_bits() {
    pin_cpu();
    let spec = KvSpec { heads_kv: 2, head_dim: 128, dtype: KvDtype::Bf16 };
    for bits in [3usize, 5, 6] {
        let q = QuantSpec { bits, group: 64 };
        let mut c = RotatingQuantizedKvCache::new(spec, 4, q).unwrap();
        let masks = Masks::new();
        let mut all = Vec::new();
        for step in 0..6u64 {
            let n = 2 * 128;
            let vals = regimes(step + 77, 128, 2, RefDtype::Bf16);
            assert_eq!(vals.len(), n);
            let k = Array::from_slice(&vals, &[1, 2, 1, 128]).as_dtype(mlx_rs::Dtype::Bfloat16).unwrap();
            let qv = Array::from_slice(&vals, &[1, 2, 1, 128]).as_dtype(mlx_rs::Dtype::Bfloat16).unwrap();
            c.decode(&k, &k, &qv, 0.1, &masks).unwrap();
            all.push(vals);
        }
        // Ring of 4 after 6 decodes: columns hold positions 4, 5, 2, 3.
        let planes = c.physical_planes().unwrap();
        assert_eq!(planes[0].shape(), &[1, 2, 4, (128 * bits / 32) as i32]);
        let rq = RefQuant { bits, group: 64 };
        let packed = words(&planes[0]);
        let scales = words(&planes[1]);
        let per_col = 128 * bits / 32;
        for (col, pos) in [4usize, 5, 2, 3].into_iter().enumerate() {
            for h in 0..2 {
                let r = quantize(&all[pos][h * 128..(h + 1) * 128], 128, RefDtype::Bf16, rq).unwrap();
                let at = (h * 4 + col) * per_col;
                assert_eq!(&packed[at..at + per_col], &r.packed[..], "bits {bits} col {col} head {h}");
                let at = (h * 4 + col) * 2;
                assert_eq!(&scales[at..at + 2], &r.scales[..], "bits {bits} col {col} head {h} scales");
            }
        }
    }
}

// ----- the quantized family in the simulator (`sim::family::quant`) ----------------------------------------------

use kvsim::cache::faults::Mutant;
use kvsim::sim::config::{LayoutChoice, SimConfig};
use kvsim::sim::family::quant::QuantChoice;
use kvsim::sim::ops::Op;
use kvsim::sim::{run, DeviceChoice};

/// A run of the attention and quantized families (no training family), window 4, one layer.
fn quant_config(native: bool) -> SimConfig {
    // The swarm weights of the first seed without the training family (whose runs draw training kinds only).
    let mut c = (0..).map(SimConfig::from_seed).find(|c| !c.families.iter().any(|f| f == "training")).unwrap();
    c.weights.retain(|w| w.0 != kvsim::sim::ops::OpKind::Quantize);
    c.weights.push((kvsim::sim::ops::OpKind::Quantize, 2));
    c.layout = LayoutChoice::Rotating { window: 4 };
    c.layers = 1;
    c.heads_kv = 2;
    c.heads_q = 4;
    c.families = vec!["attention".into(), "quant".into()];
    let q = QuantChoice { bits: 5, group: 32, head_dim: 64, native, convert_weight: 1 };
    c.params.insert("quant".into(), q.to_params());
    c
}

/// Two wrapped rings (one solo, one a batch row), then the conversion op in every verdict the model knows.
fn conversion_ops() -> Vec<Op> {
    let mut ops = vec![Op::Admit { req: 0 }, Op::SoloWindow { req: 0, len: 3 }];
    ops.extend((0..3).map(|_| Op::SoloDecode { req: 0 }));
    // A compiled step of the still-plain caches (its probe converts a copy between step and apply: refused).
    ops.push(Op::CompiledStep { req: 0 });
    ops.extend([Op::Admit { req: 1 }, Op::SoloWindow { req: 1, len: 2 }, Op::Join { reqs: vec![1], order: vec![] }]);
    ops.extend((0..3).map(|_| Op::Decode));
    ops.extend([
        // Invalid bits: InvalidQuant in both families; mid-round: PendingPrefill on a prepared copy of the batch.
        Op::Quantize { bits: 7, group: 32, mid_round: true },
        // Head dim 64 is not a multiple of 128: InvalidQuant.
        Op::Quantize { bits: 5, group: 128, mid_round: false },
        // Converts the quantized family (the attention family's head dim is below every group: InvalidQuant).
        Op::Quantize { bits: 5, group: 32, mid_round: true },
        // The same parameters again: nothing changes; others: StorageMismatch.
        Op::Quantize { bits: 5, group: 32, mid_round: false },
        Op::Quantize { bits: 8, group: 32, mid_round: false },
        Op::Decode,
        Op::SoloDecode { req: 0 },
        // Compiled steps of the converted ring (wrapped: the ring fetch), each probed with a plain step's outputs.
        Op::CompiledStep { req: 0 },
        Op::CompiledStep { req: 0 },
        Op::Verify { gamma: 2, accept: vec![1] },
        Op::Extract { row: 0, finish: false },
        Op::SoloWindow { req: 1, len: 2 },
        Op::Merge { reqs: vec![0, 1] },
        Op::Decode,
    ]);
    ops
}

#[test]
fn conversion_op_converts_wrapped_rings_mid_run_and_refuses_the_impossible() {
    pin_cpu();
    let r = run(3, quant_config(false), Some(conversion_ops()), DeviceChoice::Cpu, None);
    assert!(r.failure.is_none(), "{:?}", r.failure);
    assert_eq!(r.skipped, 0);
    let q = &r.layouts["kv:rotating-quant"];
    assert_eq!(q.ops, conversion_ops().len() as u64);
    assert_eq!(q.guarantees.get("to_quantized/f32").or(q.guarantees.get("to_quantized/bf16")).unwrap().compared, 1);
    assert_eq!(q.variants["5:32"].seeds, 1);
    // Attention: 5 refused conversions + 2 mid-round refusals; quant: 2 invalid + 1 mismatch + 2 mid-round + the
    // three compiled steps' refused applies of a step of the other storage.
    assert_eq!(r.counters.expected_errors, 7 + 5 + 3, "{:?}", r.counters);
    assert_eq!(r.counters.ill_formed_rejected.get("compiled_step_storage"), Some(&3));
    // The compiled steps: one of plain storage, two of the six affine planes, each byte-identical to the twin.
    let steps: u64 = ["f32", "bf16"]
        .iter()
        .filter_map(|d| q.guarantees.get(&format!("compiled_step/{d}")))
        .map(|c| c.bit_exact)
        .sum();
    assert_eq!(steps, 3, "{:?}", q.guarantees);
    // The conversion converts in physical order, phase kept: converting in temporal order is caught.
    let m =
        run(3, quant_config(false), Some(conversion_ops()), DeviceChoice::Cpu, Some(Mutant::QuantConvertTemporalOrder));
    assert_eq!(m.failure.map(|f| (f.family, f.failure.check)), Some((Some("kv:rotating-quant"), "layout".to_string())));
}

#[test]
fn native_quantized_runs_pass_and_count_their_variant() {
    pin_cpu();
    let mut cfg = quant_config(true);
    cfg.layout = LayoutChoice::Linear;
    let r = run(3, cfg.clone(), None, DeviceChoice::Cpu, None);
    assert!(r.failure.is_none(), "{:?}", r.failure);
    let q = &r.layouts["kv:quant"];
    assert!(q.ops > 0 && q.checks > 0 && q.bit_exact > 0, "{q:?} {:?}", r.ops_by_kind);
    assert_eq!(q.variants["5:32"].ops, q.ops);
    // A replay of the recorded trace gives the same result hash (the quant parameters travel in the config).
    let again = kvsim::sim::replay(&r.trace, DeviceChoice::Cpu);
    assert_eq!(again.trace.result_hash, r.trace.result_hash);
}
