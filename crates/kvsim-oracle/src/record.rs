//! kvsim's side of the oracle: a trace replayed through `kvsim_harness::sim::run_observed` with a [`Recorder`]
//! watching ([`record`]), and the run each oracle family records for a seed ([`family_run`], [`family_prefix`]).

use crate::recorder::{Record, Recorder, StepInfo, Values};
use kvsim_harness::sim::config::SimConfig;
use kvsim_harness::sim::trace::Trace;
use kvsim_harness::sim::DeviceChoice;

/// kvsim's side of one trace.
pub struct Recording {
    /// STEPS lines (empty unless recorded with `emit_steps`).
    pub steps: Vec<String>,
    pub infos: Vec<StepInfo>,
    pub results: Vec<Record>,
    /// The bytes of every read output, by sha256.
    pub values: Values,
}

impl Recording {
    pub fn steps_jsonl(&self) -> String {
        self.steps.iter().map(|l| format!("{l}\n")).collect()
    }
}

/// Replays `trace` on CPU with the recorder observing the run (the same run loop as `kvsim sim`): kvsim's steps
/// (when `emit_steps`) and result records. Every kvsim check still runs; a failing one is an error (only passing
/// traces are compared).
pub fn record(trace: &Trace, emit_steps: bool) -> Result<Recording, String> {
    if trace.mutant.is_some() {
        return Err("a mutant trace is not compared with the oracle".into());
    }
    let mut rec = Recorder::new(&trace.config, emit_steps);
    let r = kvsim_harness::sim::run_observed(
        trace.seed,
        trace.config.clone(),
        Some(trace.ops.clone()),
        DeviceChoice::Cpu,
        None,
        &mut rec,
    );
    if let kvsim_harness::sim::trace::Outcome::Fail { op_index, check, message } = &r.trace.outcome {
        let op = r.trace.ops.get(*op_index);
        return Err(format!("kvsim check failed at op {op_index} {op:?}: [{check}] {message}"));
    }
    Ok(Recording { steps: rec.steps, infos: rec.infos, results: rec.results, values: rec.values })
}

/// The run of `seed` whose calls the oracle records for `family`: for `attention` the seed's swarm run (the
/// recorder watches its attention family); for another family of [`crate::recorder::ORACLE_FAMILIES`] the seed's
/// configuration with that family alone (`None` when the seed's swarm draw does not hold it: its parameters, e.g.
/// the quantized family's bits and group, come from that draw), without the kinds listed below. `None` too when the
/// run fails or holds an op whose writes the recorder does not describe (a prepared prefill into running rows, a
/// bidirectional prefill).
pub fn family_run(seed: u64, family: &str) -> Option<kvsim_harness::sim::RunResult> {
    let r = if family == "attention" {
        kvsim_harness::sim::run_seed(seed, DeviceChoice::Cpu, None)
    } else {
        let mut cfg = SimConfig::from_seed(seed);
        if !cfg.families.iter().any(|f| f == family) {
            return None;
        }
        // The recurrent family is recorded in its `ssm` set only (two DeltaNet layers; the hybrid sets' attention
        // layers are not described).
        if family == "ssm" && kvsim_harness::sim::family::ssm::SsmSet::of(&cfg).name != "ssm" {
            return None;
        }
        cfg.families = vec![family.to_string()];
        // The other families' own kinds (training forwards, the bf16-first family's reads) touch none of this
        // family's caches, and the recorder does not describe the writes of a prepared prefill into running rows
        // or of a bidirectional prefill: none is drawn.
        use kvsim_harness::sim::ops::OpKind;
        if cfg.weight(OpKind::Admit) == 0 {
            // A family of the full draw supported none of the inference kinds (the training family's runs draw
            // only its forwards): this family's run takes every kind at its base weight.
            for w in cfg.weights.iter_mut() {
                w.1 = w.0.base_weight();
            }
        }
        for w in cfg.weights.iter_mut() {
            if w.0.is_training() || w.0.is_transition() || matches!(w.0, OpKind::Prepare | OpKind::BidirPrefill) {
                w.1 = 0;
            }
        }
        // The conversion op is drawn when the family's parameters say so (a family of the full draw that does not
        // support it had switched it off).
        if let (Some(q), true) = (kvsim_harness::sim::family::quant::QuantChoice::of(&cfg), family == "quant") {
            match cfg.weights.iter_mut().find(|w| w.0 == OpKind::Quantize) {
                Some(w) => w.1 = w.1.max(q.convert_weight),
                None => cfg.weights.push((OpKind::Quantize, q.convert_weight)),
            }
        }
        kvsim_harness::sim::run(seed, cfg, None, DeviceChoice::Cpu, None)
    };
    let undescribed = |op: &kvsim_harness::sim::ops::Op| {
        matches!(op, kvsim_harness::sim::ops::Op::Prepare { .. } | kvsim_harness::sim::ops::Op::BidirPrefill { .. })
    };
    (!r.failed() && (family == "attention" || !r.trace.ops.iter().any(undescribed))).then_some(r)
}

/// The file-name prefix of a family's recorded traces (`seed-N` for the attention family, `quant-seed-N`, ...).
pub fn family_prefix(family: &str) -> String {
    if family == "attention" {
        "seed-".into()
    } else {
        format!("{family}-seed-")
    }
}
