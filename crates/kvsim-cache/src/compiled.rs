//! The compiled-decode protocol (R-C-9, R-ROT-5): a one-position decode step split into host bookkeeping, a pure
//! function of arrays, and an apply.
//!
//! 1. [`CompiledDecode::prepare_decode_step`] does the host-side bookkeeping of the decode write (growth, oversize
//!    trim, rotation: steps 1-2 of ARCHITECTURE.md's decode write) without the write and returns a [`DecodePlan`]:
//!    how the step fetches (`Concat`: the live columns plus the new one; `Ring`: the buffer with the new column
//!    written in at `write_pos`), where it writes, and how many buffer columns it reads. `decode_phase()` is its
//!    non-mutating twin and always equals `plan.fetch`.
//! 2. [`CompiledDecode::step_inputs`] hands out the slot's closure inputs, in order; [`decode_step`] is the step
//!    itself, a pure function of its inputs (no host integer of the cache inside): the RoPE offset and, on a ring,
//!    the write position travel as int32 arrays, so one traced or compiled closure serves every step of a
//!    geometry. [`plain_decode_step`] and [`quantized_decode_step`] are its two storages: the plain planes `[k, v]`
//!    and the affine planes `[kq, ks, kb, vq, vs, vb]` (the new column quantized inside the step through MLX's
//!    `quantize`, as the ordinary append quantizes it).
//! 3. [`CompiledDecode::apply_decode_step`] takes ownership of the step's outputs, advances the host state, and
//!    returns the arrays to evaluate with the step.
//!
//! Guarantee (tested through growth at [`super::ring::GROW_STEP`], oversize trim after a window write, the first
//! wrap and later rotations, for linear and rotating caches, plain and affine storage (every bit width, groups 32
//! to 128), f32 and bf16, eager and under `mlx_rs` `compile`): a prepared, stepped and applied cache holds exactly
//! the bytes (all planes: K and V, or packed words, scales and biases of both) and host state the ordinary
//! [`SerialCache::decode`] leaves, and the step's output is byte-identical to the ordinary read of the same
//! RoPE-rotated inputs (RoPE with the static int offset). What stays impossible is a typed error with the cache
//! unchanged: outputs of a step of the other storage (a cache converted by `to_quantized` between the step and its
//! apply), of another shape or dtype, or a plan that no longer matches the cache ([`CacheError::StepMismatch`]).

use mlx_rs::Array;

use super::batch::{decode_mask_key, RowBatch};
use super::error::CacheError;
use super::mask::{MaskKey, MaskSpec, MaskUse, Masks};
use super::quant::{attend_planes, QuantSpec, Storage};
use super::ring::{Buf, DecodePhase, SerialCache};
use super::util::{cols, dim, index_array, ncols};
use super::Result;

pub use crate::ring::DecodePlan;

/// RoPE of the step (MLX `fast::rope` parameters). The offset is not here: it is an input array.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepRope {
    /// Leading feature dimensions of each head that are rotated (MLX `dims`); the rest pass unchanged.
    pub dims: usize,
    /// The base of RoPE's angular frequencies (MLX `base`); the position scale is always 1.
    pub base: f32,
    /// MLX `traditional`: rotate consecutive pairs of dimensions instead of the two halves.
    pub traditional: bool,
}

impl StepRope {
    /// The static-int path: RoPE of `x` (`[B, H, L, D]`) at `offset` (what an uncompiled model does).
    pub fn apply(&self, x: &Array, offset: usize) -> Result<Array> {
        Ok(mlx_rs::fast::rope(x, dim(self.dims)?, self.traditional, self.base, 1.0, dim(offset)?, None)?)
    }

    /// The array path: RoPE of `x` at the int32 array `offset` (`[1]`), as a compiled step computes it.
    pub fn apply_dynamic(&self, x: &Array, offset: &Array) -> Result<Array> {
        Ok(mlx_rs::fast::rope_dynamic(x, dim(self.dims)?, self.traditional, self.base, 1.0, offset, None)?)
    }
}

/// A position as the int32 `[1]` array a compiled step takes (R-C-9).
pub fn int32_input(n: usize) -> Result<Array> {
    Ok(Array::from_slice(&[dim(n)?], &[1]))
}

/// Caches that implement the compiled-decode protocol (see the module documentation).
pub trait CompiledDecode {
    /// R-C-9: the host bookkeeping of the next one-position step, without the write. Idempotent.
    fn prepare_decode_step(&mut self) -> Result<DecodePlan>;
    /// R-ROT-5: the fetch the next step's plan will have (non-mutating).
    fn decode_phase(&self) -> DecodePhase;
    /// The RoPE position of the step, as the int32 `[1]` input array.
    fn rope_input(&self) -> Result<Array>;
    /// The slot's closure inputs, in order, for a plan just returned by `prepare_decode_step`.
    fn step_inputs(&self, plan: &DecodePlan) -> Result<Vec<Array>>;
    /// Apply the step's outputs (ownership taken), advance the host state; returns the arrays to evaluate with the
    /// step. A plan that no longer matches the cache, or outputs that do not fit it, are
    /// [`CacheError::StepMismatch`] with the cache unchanged.
    fn apply_decode_step(&mut self, plan: &DecodePlan, outputs: Vec<Array>) -> Result<Vec<Array>>;
}

/// The step of the plain caches: [`decode_step`] with [`Storage::Plain`] (slot planes `[k, v]`).
pub fn plain_decode_step(
    fetch: DecodePhase,
    rope: Option<StepRope>,
    scale: f32,
    inputs: &[Array],
) -> Result<Vec<Array>> {
    decode_step(Storage::Plain, fetch, rope, scale, inputs)
}

/// The step of the affine-quantized caches (`kv:quant`, `kv:rotating-quant`): [`decode_step`] with
/// [`Storage::Affine`] (slot planes `[kq, ks, kb, vq, vs, vb]`).
pub fn quantized_decode_step(
    quant: QuantSpec,
    fetch: DecodePhase,
    rope: Option<StepRope>,
    scale: f32,
    inputs: &[Array],
) -> Result<Vec<Array>> {
    decode_step(Storage::Affine(quant), fetch, rope, scale, inputs)
}

/// The step of a cache of `storage`, a pure function of `inputs` = the slot inputs ++ `[q, k, v, rope_offset]`,
/// where the slot holds the storage's `n` planes ([`Storage::planes`]: `[k, v]`, or `[kq, ks, kb, vq, vs, vb]`):
///
/// - `Concat` slot: the `n` planes' `active_len` live columns (`[1, H_kv, active_len, ·]`); returns
///   `[out, new_0, .., new_{n-1}]`, the new column as planes (`[1, H_kv, 1, ·]`);
/// - `Ring` slot: the `n` planes' `active_len` buffer columns, then `write_pos` (int32 `[1]`); returns
///   `[out, buf_0', .., buf_{n-1}']`, the planes with the new column written in.
///
/// `q`, `k` are pre-RoPE (`[1, H, 1, D]`) and rotated inside the step at `rope_offset` (int32 `[1]`); with
/// `rope: None` (a caller that rotates before the step, or a layer without RoPE) they are used as given and the
/// offset input only travels. The new column is encoded as the ordinary write encodes it (`Storage::encode`:
/// as given for plain storage; MLX's `quantize` of the one-position block for affine storage, which per (head,
/// group) gives the triple bytes the ordinary append stores). `out` is the ordinary decode's unmasked read of the
/// same storage (MLX's fused SDPA over plain planes, mlx-lm's quantized attention over affine ones) over the
/// columns the ordinary decode attends, in the same physical order. Inputs of another count are
/// [`CacheError::StepMismatch`].
pub fn decode_step(
    storage: Storage,
    fetch: DecodePhase,
    rope: Option<StepRope>,
    scale: f32,
    inputs: &[Array],
) -> Result<Vec<Array>> {
    let bad = |what: &str| CacheError::StepMismatch { what: what.to_string() };
    let n = storage.planes();
    let slot = match fetch {
        DecodePhase::Concat => n,
        DecodePhase::Ring => n + 1,
    };
    if inputs.len() != slot + 4 {
        return Err(bad(&format!(
            "{} inputs for a {fetch:?} step of {storage:?} storage, {} expected",
            inputs.len(),
            slot + 4
        )));
    }
    let (q, k, v, offset) = (&inputs[slot], &inputs[slot + 1], &inputs[slot + 2], &inputs[slot + 3]);
    let (qr, kr) = match rope {
        Some(r) => (r.apply_dynamic(q, offset)?, r.apply_dynamic(k, offset)?),
        None => (q.clone(), k.clone()),
    };
    let column = storage.encode(&kr, v)?;
    let planes = match fetch {
        DecodePhase::Concat => inputs[..n]
            .iter()
            .zip(&column)
            .map(|(p, x)| Ok(mlx_rs::ops::concatenate(&[p, x], 2)?))
            .collect::<Result<Vec<_>>>()?,
        DecodePhase::Ring => {
            let at = inputs[n].reshape(&[1, 1, 1, 1])?;
            inputs[..n].iter().zip(&column).map(|(p, x)| Ok(p.put_along_axis(&at, x, 2)?)).collect::<Result<_>>()?
        }
    };
    let out = attend_planes(&storage, &qr, &planes, scale, None, false)?;
    let written = match fetch {
        DecodePhase::Concat => column,
        DecodePhase::Ring => planes,
    };
    Ok(std::iter::once(out).chain(written).collect())
}

impl CompiledDecode for SerialCache {
    fn prepare_decode_step(&mut self) -> Result<DecodePlan> {
        SerialCache::prepare_decode_step(self)
    }

    fn decode_phase(&self) -> DecodePhase {
        SerialCache::decode_phase(self)
    }

    fn rope_input(&self) -> Result<Array> {
        int32_input(self.rope_offset())
    }

    fn step_inputs(&self, plan: &DecodePlan) -> Result<Vec<Array>> {
        self.check_plan(plan)?;
        let b = self.buf_ref().ok_or_else(|| CacheError::StepMismatch { what: "no buffer: prepare first".into() })?;
        let mut inputs = b.planes.iter().map(|p| cols(p, 0, plan.active_len)).collect::<Result<Vec<_>>>()?;
        if plan.fetch == DecodePhase::Ring {
            inputs.push(int32_input(plan.write_pos)?);
        }
        Ok(inputs)
    }

    fn apply_decode_step(&mut self, plan: &DecodePlan, outputs: Vec<Array>) -> Result<Vec<Array>> {
        self.check_plan(plan)?;
        let (spec, storage) = (self.spec(), self.storage());
        let bad = |what: String| CacheError::StepMismatch { what };
        let layout = storage.plane_layout(&spec);
        if outputs.len() != 1 + layout.len() {
            return Err(bad(format!(
                "{} outputs, {} expected for {storage:?} storage (a step of another storage?)",
                outputs.len(),
                1 + layout.len()
            )));
        }
        let want = match plan.fetch {
            DecodePhase::Concat => 1,
            DecodePhase::Ring => plan.active_len,
        };
        for (a, &(w, dt)) in outputs[1..].iter().zip(&layout) {
            let s = a.shape();
            let fits = s.len() == 4
                && s[0] == 1
                && s[1] as usize == spec.heads_kv
                && ncols(a) == want
                && s[3] as usize == w
                && a.dtype() == dt;
            if !fits {
                return Err(bad(format!(
                    "output {:?} {:?} does not fit a {:?} step of {storage:?} storage",
                    s,
                    a.dtype(),
                    plan.fetch
                )));
            }
        }
        let b = self.buf_ref().ok_or_else(|| bad("no buffer: prepare first".into()))?;
        let written = &outputs[1..];
        let nb = match plan.fetch {
            DecodePhase::Concat => {
                let at = super::util::index_array(&[plan.write_pos], &[1, 1, 1, 1])?;
                b.zip_map(written, |p, x| Ok(p.put_along_axis(&at, x, 2)?))?
            }
            DecodePhase::Ring if b.cap() == plan.active_len => Buf { planes: written.to_vec() },
            DecodePhase::Ring => {
                // The buffer is wider than the live ring (a linear buffer never is; a ring is capped at W, but a
                // buffer grown before a trim may be): write the step's columns back over [0, active_len).
                let at =
                    super::util::index_array(&(0..plan.active_len).collect::<Vec<_>>(), &[1, 1, plan.active_len, 1])?;
                b.zip_map(written, |p, x| Ok(p.put_along_axis(&at, x, 2)?))?
            }
        };
        let roots = match plan.fetch {
            DecodePhase::Concat => nb.planes.clone(),
            DecodePhase::Ring => Vec::new(),
        };
        self.set_buf(nb);
        self.state_mut().after_decode_write();
        Ok(roots)
    }
}

/// The host plan of one batched compiled decode step (R-C-9 on rows): each row's target column (its own ring head,
/// as the ordinary batched decode writes it), the buffer columns the read attends, and the read's mask (`None`: every
/// row holds `width` columns after the write, so the read takes no mask, as the ordinary read).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowsStepPlan {
    /// Each row's target column.
    pub targets: Vec<usize>,
    /// Buffer columns the step takes and attends: the longest row's live columns after the write.
    pub width: usize,
    /// The decode mask of rows of unequal length (`c < len_r`), else `None`.
    pub mask: Option<MaskKey>,
}

impl RowBatch {
    /// R-C-9 for rows: the host bookkeeping of the coming one-position step of every row (the ordinary decode's
    /// [`RowBatch::prepare_decode_step`]: oversize dropped, heads rotated, buffer grown), and its plan. Idempotent.
    /// [`CacheError::PendingPrefill`] during a prepared prefill; no rows is [`CacheError::StepMismatch`].
    pub fn prepare_rows_step(&mut self) -> Result<RowsStepPlan> {
        if self.rows() == 0 {
            return Err(CacheError::StepMismatch { what: "a step of no rows".into() });
        }
        let targets = self.prepare_decode_step()?;
        Ok(self.rows_plan(targets))
    }

    fn rows_plan(&self, targets: Vec<usize>) -> RowsStepPlan {
        let lens: Vec<usize> = self.row_states().iter().map(|r| r.ring.len.max(r.ring.idx + 1)).collect();
        let width = lens.iter().copied().max().unwrap_or(0).max(1);
        let mask = (!lens.iter().all(|&l| l == lens[0])).then(|| decode_mask_key(lens, self.max_size(), width));
        RowsStepPlan { targets, width, mask }
    }

    fn check_rows_plan(&self, plan: &RowsStepPlan) -> Result<()> {
        let prepared =
            self.row_states().iter().all(|r| r.ring.prepared_for_decode(self.max_size()) == (0, r.ring.clone()));
        let targets: Vec<usize> = self.row_states().iter().map(|r| r.ring.idx).collect();
        if !prepared || self.is_pending() || targets != plan.targets || self.rows_plan(targets) != *plan {
            return Err(CacheError::StepMismatch { what: format!("plan {plan:?} does not match the prepared rows") });
        }
        if self.cap() < plan.width {
            return Err(CacheError::StepMismatch {
                what: format!("a buffer of {} columns, {} planned", self.cap(), plan.width),
            });
        }
        Ok(())
    }

    /// The step's closure inputs, in order: the storage's planes cut to the plan's `width` columns, each row's
    /// target column as int32 `[B, 1, 1, 1]`, then the decode mask (boolean `[B, 1, 1, width]`, from the forward's
    /// `masks`, built once per forward) when the plan has one; and the mask use the read reports. The caller adds
    /// `[q, k, v, rope_offsets]` ([`rows_decode_step`]).
    pub fn rows_step_inputs(&self, plan: &RowsStepPlan, masks: &Masks) -> Result<(Vec<Array>, MaskUse)> {
        self.check_rows_plan(plan)?;
        let b = self.buf_ref().ok_or_else(|| CacheError::StepMismatch { what: "no buffer: prepare first".into() })?;
        let mut inputs = b.planes.iter().map(|p| cols(p, 0, plan.width)).collect::<Result<Vec<_>>>()?;
        inputs.push(index_array(&plan.targets, &[plan.targets.len(), 1, 1, 1])?);
        let used = match &plan.mask {
            None => MaskUse::None,
            Some(key) => {
                let (spec, arr) = masks.get(key)?;
                inputs.push(arr);
                MaskUse::Array(spec)
            }
        };
        Ok((inputs, used))
    }

    /// The RoPE positions of the step's rows (each row's offset), as the int32 `[B]` input array.
    pub fn rows_rope_input(&self) -> Array {
        self.rope_offsets().to_array()
    }

    /// Applies the step's outputs `[out, planes']` (ownership taken): the written planes replace the buffer's first
    /// `width` columns and every row advances as after the ordinary decode write. Returns the arrays to evaluate with
    /// the step. A plan that no longer matches the rows, or outputs that do not fit, are
    /// [`CacheError::StepMismatch`] with the rows unchanged.
    pub fn apply_rows_step(&mut self, plan: &RowsStepPlan, outputs: Vec<Array>) -> Result<Vec<Array>> {
        self.check_rows_plan(plan)?;
        let (spec, storage) = (self.spec(), self.storage());
        let layout = storage.plane_layout(&spec);
        let bad = |what: String| CacheError::StepMismatch { what };
        if outputs.len() != 1 + layout.len() {
            return Err(bad(format!(
                "{} outputs, {} expected for {storage:?} storage",
                outputs.len(),
                1 + layout.len()
            )));
        }
        for (a, &(w, dt)) in outputs[1..].iter().zip(&layout) {
            let s = a.shape();
            let fits = s.len() == 4
                && s[0] as usize == self.rows()
                && s[1] as usize == spec.heads_kv
                && ncols(a) == plan.width
                && s[3] as usize == w
                && a.dtype() == dt;
            if !fits {
                return Err(bad(format!(
                    "output {s:?} {:?} does not fit the planned rows of {storage:?} storage",
                    a.dtype()
                )));
            }
        }
        let b = self.buf_ref().ok_or_else(|| bad("no buffer: prepare first".into()))?;
        let written = &outputs[1..];
        let nb = if b.cap() == plan.width {
            Buf { planes: written.to_vec() }
        } else {
            let at = index_array(&(0..plan.width).collect::<Vec<_>>(), &[1, 1, plan.width, 1])?;
            b.zip_map(written, |p, x| Ok(p.put_along_axis(&at, x, 2)?))?
        };
        nb.eval()?;
        let roots = nb.planes.clone();
        self.commit_step(nb);
        Ok(roots)
    }
}

/// The batched step, a pure function of `inputs` = the slot ([`RowBatch::rows_step_inputs`]: `n` planes of
/// `width` columns, the targets, the mask array when the plan has one) ++ `[q, k, v, rope_offsets]`: every row's new column
/// (encoded as the ordinary write encodes it) written at its target, then the read of the `width` columns under the
/// mask (MLX's fused SDPA over plain planes, the quantized attention over affine ones), as the ordinary batched
/// decode reads them. `q`, `k` are pre-RoPE (`[B, H, 1, D]`) and rotated at each row's int32 offset (`[B]`); with
/// `rope: None` they are used as given. `mask` is the host description of the mask input (the [`MaskUse`] the
/// slot reported): only the exact read (`ReadMode::Exact` on CUDA) consults it, for its visible ranges; every other
/// read takes the array alone. Returns `[out, planes']`. Inputs of another count are [`CacheError::StepMismatch`].
pub fn rows_decode_step(
    storage: Storage,
    mask: Option<&MaskSpec>,
    rope: Option<StepRope>,
    scale: f32,
    inputs: &[Array],
) -> Result<Vec<Array>> {
    let n = storage.planes();
    let slot = n + 1 + usize::from(mask.is_some());
    if inputs.len() != slot + 4 {
        return Err(CacheError::StepMismatch {
            what: format!("{} inputs for a rows step of {storage:?} storage, {} expected", inputs.len(), slot + 4),
        });
    }
    let (q, k, v, offset) = (&inputs[slot], &inputs[slot + 1], &inputs[slot + 2], &inputs[slot + 3]);
    let (qr, kr) = match rope {
        Some(r) => (r.apply_dynamic(q, offset)?, r.apply_dynamic(k, offset)?),
        None => (q.clone(), k.clone()),
    };
    let column = storage.encode(&kr, v)?;
    let at = &inputs[n];
    let planes =
        inputs[..n].iter().zip(&column).map(|(p, x)| Ok(p.put_along_axis(at, x, 2)?)).collect::<Result<Vec<_>>>()?;
    let out = attend_planes(&storage, &qr, &planes, scale, mask.map(|m| (m, &inputs[n + 1])), false)?;
    Ok(std::iter::once(out).chain(planes).collect())
}

#[cfg(test)]
mod tests;
