//! The swarm configuration of one run, as plain data (what a trace stores; `sim::swarm` draws it from a seed).
//! some op kinds off, so rare interleavings get runs of their own; harness-practices.md §1).

use serde::{Deserialize, Serialize};

use std::collections::BTreeMap;

use crate::sim::ops::OpKind;

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
    /// The layout families of this run (names in the run's `Registry`), dispatched in this order. Absent from a
    /// trace = the default (`["attention"]`), so traces written before families existed replay unchanged.
    #[serde(default = "default_families", skip_serializing_if = "is_default_families")]
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

/// The families of a config that names none (traces written before families existed): the attention family alone.
pub fn default_families() -> Vec<String> {
    vec!["attention".to_string()]
}

fn is_default_families(f: &[String]) -> bool {
    f == default_families().as_slice()
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

    /// Weight of `kind` in this run.
    pub fn weight(&self, kind: OpKind) -> u32 {
        self.weights.iter().find(|w| w.0 == kind).map_or(0, |w| w.1)
    }

    /// 1/sqrt(D), the SDPA scale every read uses.
    pub fn scale(&self) -> f32 {
        1.0 / (self.head_dim as f32).sqrt()
    }
}
