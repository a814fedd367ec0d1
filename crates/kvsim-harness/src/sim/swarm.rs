//! Seed -> swarm configuration (swarm testing: each run draws its own shapes, window, dtype and op mix, and switches
//! some op kinds off, so rare interleavings get runs of their own): [`SimConfig::from_seed_in`] over the families of
//! a [`Registry`], each of which brings its own draws.

use std::collections::BTreeMap;

use rand::Rng;

use crate::sim::config::{DtypeChoice, LayoutChoice, SimConfig};
use crate::sim::family::Registry;
use crate::sim::ops::OpKind;
use crate::sim::rng::{stream, Stream};

/// The families of `seed`'s run: each registered family is included with its swarm probability (one draw per
/// family, in registry order, from its own stream); none drawn = the first registered family.
pub fn draw_families(seed: u64, registry: &Registry) -> Vec<String> {
    let mut rng = stream(seed, Stream::Families);
    let mut out: Vec<String> = registry
        .iter()
        .filter(|r| r.swarm_probability >= 1.0 || rng.random_bool(r.swarm_probability.max(0.0)))
        .map(|r| r.name.to_string())
        .collect();
    if let (true, Some(first)) = (out.is_empty(), registry.iter().next()) {
        out.push(first.name.to_string());
    }
    out
}

impl SimConfig {
    /// The swarm configuration of `seed` over kvsim's own families ([`Registry::builtin`]).
    pub fn from_seed(seed: u64) -> SimConfig {
        SimConfig::from_seed_in(seed, Registry::builtin())
    }

    /// The swarm configuration of `seed` over the families of `registry`.
    pub fn from_seed_in(seed: u64, registry: &Registry) -> SimConfig {
        let mut rng = stream(seed, Stream::Config);
        let layout = if rng.random_bool(0.8) {
            LayoutChoice::Rotating { window: [2usize, 3, 4, 5, 6, 8, 16][rng.random_range(0..7)] }
        } else {
            LayoutChoice::Linear
        };
        let dtype = if rng.random_bool(0.5) { DtypeChoice::F32 } else { DtypeChoice::Bf16 };
        let heads_kv = rng.random_range(1..=2);
        let heads_q = heads_kv * rng.random_range(1..=2);
        let head_dim = [4usize, 8, 16][rng.random_range(0..3)];
        let layers = rng.random_range(1..=2);
        let window = layout.max_size().unwrap_or(8);
        // The conversion op is not in the swarm's list (its length is part of every seed's draws): the quantized
        // family appends it below, from its own stream.
        let mut weights: Vec<(OpKind, u32)> =
            OpKind::ALL.iter().filter(|k| k.in_base_swarm()).map(|&k| (k, k.base_weight())).collect();
        // Swarm: switch off up to three kinds (never the ones every run needs to make progress).
        for _ in 0..rng.random_range(0..=3) {
            let i = rng.random_range(0..weights.len());
            if !weights[i].0.essential() {
                weights[i].1 = 0;
            }
        }
        for w in weights.iter_mut().filter(|w| w.1 > 0) {
            w.1 = (w.1 * rng.random_range(1..=4)).max(1);
        }
        // Kinds some family of the run does not support are never drawn, nor a family's own kinds (the training
        // forwards, say) in a run without that family.
        let families = draw_families(seed, registry);
        for w in weights.iter_mut() {
            if !registry.all_support(&families, w.0) || !registry.owners_present(&families, w.0) {
                w.1 = 0;
            }
        }
        // Each family of the run draws its own parameters (from its own stream) and weights its own kinds from them.
        let mut params = BTreeMap::new();
        for r in registry.iter().filter(|r| families.iter().any(|f| f == r.name)) {
            if let Some(draw) = r.draw_params {
                let p = draw(seed);
                for (kind, weight) in (r.weights_from_params)(&p) {
                    if registry.all_support(&families, kind) {
                        weights.push((kind, weight));
                    }
                }
                params.insert(r.name.to_string(), p);
            }
        }
        // Save/restore, from its own stream: about half the runs whose families all support it.
        let mut prng = stream(seed, Stream::Persist);
        if prng.random_bool(0.5) && registry.all_support(&families, OpKind::Persist) {
            weights.push((OpKind::Persist, prng.random_range(2..=6)));
        }
        // The encoder read, from its own stream: about four runs in five whose families all support it, a modest
        // weight (an encoder window that decides what a query sees, not the cache's, needs a ring and a block past
        // either window: about one run in ten reaches it at one half).
        let mut erng = stream(seed, Stream::Encoder);
        if erng.random_bool(0.8) && registry.all_support(&families, OpKind::EncoderRead) {
            weights.push((OpKind::EncoderRead, erng.random_range(2..=6)));
        }
        SimConfig {
            layout,
            dtype,
            heads_kv,
            heads_q,
            head_dim,
            layers,
            max_batch: rng.random_range(2..=6),
            max_requests: rng.random_range(3..=10),
            max_prompt: rng.random_range(1..=3 * window + 2),
            max_chunk: rng.random_range(1..=window + 3),
            max_gamma: rng.random_range(1..=4),
            ops: rng.random_range(30..=90),
            weights,
            payload_seed: rng.random(),
            families,
            params,
        }
    }
}
