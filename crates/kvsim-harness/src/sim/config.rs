//! Seed -> swarm configuration (swarm testing: each run draws its own shapes, window, dtype and op mix, and switches
//! some op kinds off, so rare interleavings get runs of their own; harness-practices.md §1).

use rand::Rng;
use serde::{Deserialize, Serialize};

use std::collections::BTreeMap;

use crate::sim::family::{self, Registry};
use crate::sim::ops::OpKind;
use crate::sim::rng::{stream, Stream};

/// Linear (`KvCache` rows) or rotating (`RotatingKvCache` rows, window `W`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LayoutChoice {
    Linear,
    Rotating { window: usize },
}

impl LayoutChoice {
    /// The window, `None` for full attention.
    pub fn max_size(self) -> Option<usize> {
        match self {
            LayoutChoice::Linear => None,
            LayoutChoice::Rotating { window } => Some(window),
        }
    }
}

/// Storage dtype of K/V (queries and outputs share it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DtypeChoice {
    F32,
    Bf16,
}

/// Everything a seed decides before the first op. Printed before the run and stored in every trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimConfig {
    pub layout: LayoutChoice,
    pub dtype: DtypeChoice,
    pub heads_kv: usize,
    pub heads_q: usize,
    pub head_dim: usize,
    /// Layers share one forward's masks (R-C-3); each has its own caches and values.
    pub layers: usize,
    pub max_batch: usize,
    pub max_requests: usize,
    pub max_prompt: usize,
    pub max_chunk: usize,
    pub max_gamma: usize,
    pub ops: usize,
    /// Relative weights of op kinds; 0 = switched off for this run.
    pub weights: Vec<(OpKind, u32)>,
    /// Seed of the payload values (reference::values).
    pub payload_seed: u64,
    /// The layout families of this run (names in the run's [`Registry`]), dispatched in this order. Absent from a
    /// trace = the default (`["attention"]`), so traces written before families existed replay unchanged.
    #[serde(default = "family::default_families", skip_serializing_if = "is_default_families")]
    pub families: Vec<String>,
    /// Parameters the run's families drew for themselves, by family name (a trace stores each under that name, as
    /// a field of the config).
    #[serde(flatten)]
    pub params: BTreeMap<String, Params>,
}

/// A family's parameters of one run: a flat JSON object whose fields keep the order the family wrote them in, so
/// that a config's JSON (part of every run's result hash) does not depend on how it was built.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Params(pub Vec<(String, serde_json::Value)>);

impl Params {
    /// `value`'s fields, in the order it serializes them (`value` must serialize as a JSON object).
    pub fn of<T: Serialize>(value: &T) -> Params {
        serde_json::to_string(value).ok().and_then(|t| serde_json::from_str(&t).ok()).unwrap_or_default()
    }

    /// The parameters as a `T` (`None` when they do not parse as one).
    pub fn to<T: serde::de::DeserializeOwned>(&self) -> Option<T> {
        serde_json::from_value(serde_json::Value::Object(self.0.iter().cloned().collect())).ok()
    }
}

impl Serialize for Params {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

impl<'de> Deserialize<'de> for Params {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Params, D::Error> {
        struct Fields;
        impl<'de> serde::de::Visitor<'de> for Fields {
            type Value = Params;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a family's parameters (a JSON object)")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, mut m: A) -> Result<Params, A::Error> {
                let mut out = vec![];
                while let Some((k, v)) = m.next_entry::<String, serde_json::Value>()? {
                    out.push((k, v));
                }
                Ok(Params(out))
            }
        }
        d.deserialize_map(Fields)
    }
}

fn is_default_families(f: &[String]) -> bool {
    f == family::default_families().as_slice()
}

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
    /// The K/V geometry and dtype every family of this run builds its caches with.
    pub fn kv_spec(&self) -> kvsim_cache::KvSpec {
        let dtype = match self.dtype {
            DtypeChoice::F32 => kvsim_cache::KvDtype::F32,
            DtypeChoice::Bf16 => kvsim_cache::KvDtype::Bf16,
        };
        kvsim_cache::KvSpec { heads_kv: self.heads_kv, head_dim: self.head_dim, dtype }
    }

    /// The self-identifying payload space of this run (the same values in production, twins and the model).
    pub fn value_space(&self) -> kvsim_reference::ValueSpace {
        kvsim_reference::ValueSpace {
            seed: self.payload_seed,
            heads_kv: self.heads_kv,
            heads_q: self.heads_q,
            head_dim: self.head_dim,
            dtype: match self.dtype {
                DtypeChoice::F32 => kvsim_reference::RefDtype::F32,
                DtypeChoice::Bf16 => kvsim_reference::RefDtype::Bf16,
            },
        }
    }

    /// The parameters the family `name` drew for this run, if it did.
    pub fn params_of(&self, name: &str) -> Option<&Params> {
        self.params.get(name)
    }

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

    /// Weight of `kind` in this run.
    pub fn weight(&self, kind: OpKind) -> u32 {
        self.weights.iter().find(|w| w.0 == kind).map_or(0, |w| w.1)
    }

    /// 1/sqrt(D), the SDPA scale every read uses.
    pub fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
}
