//! The recurrent families (`sim::ssm`): a measurement over many seeds (ignored by default; it prints one JSON line per
//! family) and a short smoke that the public entry point runs.
use kvsim::reference::RefDtype;
use kvsim::sim::ssm::{add_counters, run_family, SsmCounters, SsmFamilyConfig};

#[test]
fn the_recurrent_families_pass_a_few_seeds() {
    mlx_rs::Device::set_default(&mlx_rs::Device::cpu());
    for family in ["ssm", "hybrid-qwen35", "hybrid-sliding"] {
        for seed in 100..102 {
            let run = run_family(family, seed, None).unwrap();
            assert!(run.failure.is_none(), "{family} seed {seed}: {:?}", run.failure);
        }
    }
}

/// `SSM_SEEDS=400 cargo test --test it ssm::measure -- --ignored --nocapture`: one JSON line per family.
#[test]
#[ignore]
fn measure() {
    mlx_rs::Device::set_default(&mlx_rs::Device::cpu());
    let seeds: u64 = std::env::var("SSM_SEEDS").ok().and_then(|s| s.parse().ok()).unwrap_or(100);
    for family in ["ssm", "hybrid-qwen35", "hybrid-sliding"] {
        let mut total = SsmCounters::default();
        let mut failures = vec![];
        let (mut bf16, mut f32_) = ((0f64, 0f64), (0f64, 0f64));
        for seed in 0..seeds {
            let run = run_family(family, seed, None).unwrap();
            if let Some((i, f)) = &run.failure {
                failures.push(format!("seed {seed} op {i}: {f}"));
            }
            let c = &run.counters;
            let slot = if SsmFamilyConfig::from_seed(family, seed).unwrap().dims.dtype == RefDtype::Bf16 {
                &mut bf16
            } else {
                &mut f32_
            };
            slot.0 = slot.0.max(c.model_max_ulp_output);
            slot.1 = slot.1.max(c.model_max_ulp_state);
            add_counters(&mut total, c);
        }
        println!(
            "{}",
            serde_json::json!({"family": family, "seeds": seeds, "failures": failures.len(),
                "first_failures": failures.iter().take(3).collect::<Vec<_>>(), "counters": total,
                "max_ulp_bf16": {"output": bf16.0, "state": bf16.1}, "max_ulp_f32": {"output": f32_.0, "state": f32_.1}})
        );
    }
}
