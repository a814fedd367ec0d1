//! The recurrent family (`sim::family::ssm`) through the public entry points: the first seeds that hold it pass, and
//! the speculative rounds are counted in the campaign summary.
use kvsim::campaign::run_seeds;
use kvsim::sim::DeviceChoice;

#[test]
fn a_campaign_counts_the_recurrent_rounds() {
    let seeds: Vec<u64> = (0..24).collect();
    let s = run_seeds(&seeds, DeviceChoice::Cpu, None, |_| None);
    assert_eq!(s.failures, 0, "{:?}", s.failed_seeds);
    let keys: Vec<&String> = s.layouts.keys().filter(|k| *k == "ssm" || k.starts_with("hybrid:")).collect();
    assert!(!keys.is_empty(), "{:?}", s.layouts.keys());
    assert!(s.counters.recurrent.rounds > 0 && s.counters.recurrent.replays > 0, "{:?}", s.counters.recurrent);
}

/// R-SSM-1, the training variant: MLX's `value_and_grad` through the DeltaNet recurrence behind the layer's ordinary
/// call (`TrainingSsmCache::window`) against central finite differences of the reference model's f64 recurrence,
/// for every input element (qkv, a, b) of a tiny shape; and zero state every call (the same inputs give the same
/// bytes after a call on other inputs). A gradient is not a bit-exact claim: the bound is relative, measured below.
#[test]
fn training_deltanet_gradient_matches_central_differences() {
    use kvsim::cache::{GdnParams, KvDtype, SsmSpec, TrainingSsmCache};
    use kvsim::reference::ssm::{SsmDims, SsmRowModel, SsmToken, SsmWeights};
    use kvsim::reference::RefDtype;
    use mlx_rs::Array;

    kvsim::cache::testutil::pin_cpu();
    let spec = SsmSpec { kernel: 2, heads_k: 1, heads_v: 1, dk: 2, dv: 2, dtype: KvDtype::F32 };
    let dims = SsmDims { kernel: 2, heads_k: 1, heads_v: 1, dk: 2, dv: 2, dtype: RefDtype::F32 };
    let (c, n, hv) = (spec.conv_dim(), 3usize, spec.heads_v);
    let val = |i: usize, lo: f32, hi: f32| lo + (((i as u64 * 2654435761) % 1000) as f32 / 1000.0) * (hi - lo);
    let conv_w: Vec<f32> = (0..c * spec.kernel).map(|i| val(i + 7, -0.8, 0.8)).collect();
    let a_log = vec![val(3, -0.5, 0.5)];
    let dt_bias = vec![val(5, -0.5, 0.5)];
    let params = GdnParams {
        conv_weight: Array::from_slice(&conv_w, &[c as i32, spec.kernel as i32, 1]),
        a_log: Array::from_slice(&a_log, &[hv as i32]),
        dt_bias: Array::from_slice(&dt_bias, &[hv as i32]),
    };
    let qkv: Vec<f32> = (0..n * c).map(|i| val(i + 101, -1.0, 1.0)).collect();
    let a: Vec<f32> = (0..n * hv).map(|i| val(i + 301, -1.0, 1.0)).collect();
    let b: Vec<f32> = (0..n * hv).map(|i| val(i + 401, -1.0, 1.0)).collect();
    let weights: Vec<f32> = (0..n * hv * spec.dv).map(|i| val(i + 501, -1.0, 1.0)).collect();
    let cache = TrainingSsmCache::new(spec).unwrap();

    // The loss through production: sum(y * weights).
    let w_arr = Array::from_slice(&weights, &[1, n as i32, hv as i32, spec.dv as i32]);
    let (p2, c2, w2) = (params.clone(), cache.clone(), w_arr.clone());
    let loss = move |x: &[Array]| -> Result<Vec<Array>, mlx_rs::error::Exception> {
        let y = c2.window(&x[0], &x[1], &x[2], &p2).map_err(|e| mlx_rs::error::Exception::custom(e.to_string()))?;
        Ok(vec![y.multiply(&w2)?.sum(None)?])
    };
    let inputs = [
        Array::from_slice(&qkv, &[1, n as i32, c as i32]),
        Array::from_slice(&a, &[1, n as i32, hv as i32]),
        Array::from_slice(&b, &[1, n as i32, hv as i32]),
    ];
    let (_, grads) = mlx_rs::transforms::value_and_grad_with_argnums(loss, &[0, 1, 2][..])(&inputs).unwrap();
    let grads: Vec<Vec<f32>> = grads.iter().map(|g| g.as_slice::<f32>().to_vec()).collect();

    // The same loss in f64 through the reference model's recurrence.
    let w64 = SsmWeights {
        conv: conv_w.iter().map(|&x| x as f64).collect(),
        a_log: a_log.iter().map(|&x| x as f64).collect(),
        dt_bias: dt_bias.iter().map(|&x| x as f64).collect(),
    };
    let loss64 = |x: &[Vec<f64>; 3]| -> f64 {
        let mut row = SsmRowModel::new(dims);
        (0..n)
            .map(|t| {
                let tok = SsmToken {
                    qkv: x[0][t * c..(t + 1) * c].to_vec(),
                    a: x[1][t * hv..(t + 1) * hv].to_vec(),
                    b: x[2][t * hv..(t + 1) * hv].to_vec(),
                };
                let y = row.step(&w64, &tok);
                y.iter().enumerate().map(|(j, yj)| yj * weights[t * hv * spec.dv + j] as f64).sum::<f64>()
            })
            .sum()
    };
    let base: [Vec<f64>; 3] = [
        qkv.iter().map(|&x| x as f64).collect(),
        a.iter().map(|&x| x as f64).collect(),
        b.iter().map(|&x| x as f64).collect(),
    ];
    let h = 1e-6;
    let mut worst = 0f64;
    for (which, g) in grads.iter().enumerate() {
        for i in 0..base[which].len() {
            let (mut up, mut down) = (base.clone(), base.clone());
            up[which][i] += h;
            down[which][i] -= h;
            let fd = (loss64(&up) - loss64(&down)) / (2.0 * h);
            let err = (g[i] as f64 - fd).abs() / fd.abs().max(1e-2);
            worst = worst.max(err);
            assert!(err < 1e-3, "input {which} element {i}: MLX gradient {} vs central difference {fd}", g[i]);
        }
    }
    assert!(worst < 1e-3, "worst relative error {worst}");

    // Zero state every call: a call on other inputs in between changes nothing.
    let y1 = cache.window(&inputs[0], &inputs[1], &inputs[2], &params).unwrap();
    let other = Array::from_slice(&vec![0.5f32; n * c], &[1, n as i32, c as i32]);
    cache.window(&other, &inputs[1], &inputs[2], &params).unwrap();
    let y2 = cache.window(&inputs[0], &inputs[1], &inputs[2], &params).unwrap();
    let (b1, b2) =
        (kvsim::cache::bytes::ArrayBytes::of(&y1).unwrap(), kvsim::cache::bytes::ArrayBytes::of(&y2).unwrap());
    assert_eq!(b1, b2, "the training cache carries no state between calls");
}
