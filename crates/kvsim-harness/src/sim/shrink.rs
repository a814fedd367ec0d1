//! Minimizes a failing trace: delta debugging over ops (drop chunks, then single ops), then over op parameters
//! (`Op::shrink_candidates`), keeping only candidates that fail with the **same check**. Every candidate is a valid
//! trace because ops whose references vanish are skipped deterministically (see `ops`).

use crate::sim::family::Registry;
use crate::sim::observe::NoObserver;
use crate::sim::ops::Op;
use crate::sim::trace::{Outcome, Trace};
use crate::sim::{run_in, DeviceChoice, RunResult};

/// The result of shrinking.
pub struct Shrunk {
    pub trace: Trace,
    pub runs: usize,
}

/// Shrinks `trace` (which must fail) within `budget` replays, over kvsim's own families.
pub fn shrink(trace: &Trace, device: DeviceChoice, budget: usize) -> Result<Shrunk, String> {
    shrink_in(Registry::builtin(), trace, device, budget)
}

/// [`shrink`] over the families of `registry` (a cache brought from outside kvsim: `crate::byoc`).
pub fn shrink_in(registry: &Registry, trace: &Trace, device: DeviceChoice, budget: usize) -> Result<Shrunk, String> {
    let target = match &trace.outcome {
        Outcome::Fail { check, .. } => check.clone(),
        Outcome::Pass => return Err("the trace passes: nothing to shrink".into()),
    };
    let mut runs = 0usize;
    let mut attempt = |ops: &[Op]| -> Option<RunResult> {
        if runs >= budget {
            return None;
        }
        runs += 1;
        let r = run_in(
            registry,
            trace.seed,
            trace.config.clone(),
            Some(ops.to_vec()),
            device,
            trace.mutant,
            &mut NoObserver,
        );
        match &r.trace.outcome {
            Outcome::Fail { check, .. } if *check == target => Some(r),
            _ => None,
        }
    };
    let cut = |r: &RunResult| -> Vec<Op> {
        match &r.trace.outcome {
            // A run that failed before its first op (its setup) has no op to keep.
            Outcome::Fail { op_index, .. } => r.trace.ops[..(*op_index + 1).min(r.trace.ops.len())].to_vec(),
            Outcome::Pass => r.trace.ops.clone(),
        }
    };
    let first = attempt(&trace.ops).ok_or_else(|| format!("the trace does not fail with [{target}] on replay"))?;
    let mut best = first;
    let mut ops = cut(&best);

    // 1. Chunks, then single ops (ddmin-style, complement removal).
    let mut n = 2usize;
    while ops.len() >= 2 {
        let chunk = ops.len().div_ceil(n);
        let mut reduced = false;
        let mut start = 0;
        while start < ops.len() {
            let mut cand = ops.clone();
            cand.drain(start..(start + chunk).min(ops.len()));
            if let Some(r) = attempt(&cand) {
                best = r;
                ops = cut(&best);
                n = (n - 1).max(2);
                reduced = true;
                break;
            }
            start += chunk;
        }
        if !reduced {
            if n >= ops.len() {
                break;
            }
            n = (2 * n).min(ops.len());
        }
    }
    // 2. Parameters, to a fixpoint.
    let mut changed = true;
    while changed {
        changed = false;
        for i in 0..ops.len() {
            for cand_op in ops[i].shrink_candidates() {
                let mut cand = ops.clone();
                cand[i] = cand_op;
                if let Some(r) = attempt(&cand) {
                    best = r;
                    ops = cut(&best);
                    changed = true;
                    break;
                }
            }
            if i + 1 >= ops.len() {
                break;
            }
        }
    }
    let mut t = best.trace;
    t.ops = ops;
    Ok(Shrunk { trace: t, runs })
}
