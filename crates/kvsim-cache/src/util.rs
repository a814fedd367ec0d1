//! Small MLX helpers shared by the layouts: shape checks, column slices, index arrays, zero blocks.

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::Array;

use super::error::shape;
use super::{KvSpec, Result};

/// `n` as an MLX dimension.
pub(crate) fn dim(n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| shape(format!("dimension {n} exceeds i32")))
}

/// Columns `[start, end)` along axis 2 of a `[B, H, C, D]` array (a view). All columns: the array itself (no MLX op;
/// the same bytes, shape and strides a full slice would have).
pub(crate) fn cols(a: &Array, start: usize, end: usize) -> Result<Array> {
    if start == 0 && end == ncols(a) {
        return Ok(a.clone());
    }
    Ok(a.try_index((.., .., dim(start)?..dim(end)?, ..))?)
}

/// Rows `[start, end)` along axis 0.
pub(crate) fn rows(a: &Array, start: usize, end: usize) -> Result<Array> {
    Ok(a.try_index((dim(start)?..dim(end)?, .., .., ..))?)
}

/// A zero array of this shape and dtype.
pub(crate) fn zeros(shape: &[usize], dtype: mlx_rs::Dtype) -> Result<Array> {
    let s: Vec<i32> = shape.iter().map(|&n| dim(n)).collect::<Result<_>>()?;
    Ok(mlx_rs::ops::zeros_dtype(&s, dtype)?)
}

/// An int32 index array of this shape from host integers.
pub(crate) fn index_array(values: &[usize], shape_: &[usize]) -> Result<Array> {
    let v: Vec<i32> = values.iter().map(|&n| dim(n)).collect::<Result<_>>()?;
    let s: Vec<i32> = shape_.iter().map(|&n| dim(n)).collect::<Result<_>>()?;
    Ok(Array::from_slice(&v, &s))
}

thread_local! {
    /// The arrays [`step_index_array`] last returned on this thread (most recent last, at most
    /// [`STEP_INDEX_SLOTS`]), each with the host values it holds and its shape.
    static LAST_STEP_INDEX: std::cell::RefCell<Vec<StepIndex>> = const { std::cell::RefCell::new(Vec::new()) };
    /// Device-resident int32 scalars (1 and the ring moduli) made once per thread and only ever read after.
    static STEP_SCALARS: std::cell::RefCell<std::collections::HashMap<usize, Array>> =
        std::cell::RefCell::new(std::collections::HashMap::new());
}

/// One remembered index array: the host values it holds, its shape, the array.
type StepIndex = (Vec<usize>, Vec<usize>, Array);

/// How many index arrays a thread remembers: one per layer's batch of a model decoding in lockstep reuses the array
/// of the layer before it, and a few batches side by side (a scheduler's cohorts) each keep theirs.
const STEP_INDEX_SLOTS: usize = 8;

fn step_scalar(n: usize) -> Result<Array> {
    let v = dim(n)?;
    STEP_SCALARS.with(|m| Ok(m.borrow_mut().entry(n).or_insert_with(|| Array::from_int(v)).clone()))
}

/// [`index_array`] for a list of write positions that usually advances by one per step (rows' ring heads, which
/// wrap to 0 at `modulus`). The values are always exactly `values`; only where they come from differs:
///
/// - On a GPU, when an array this function returned recently on this thread (same shape) holds exactly `values`,
///   it is returned again (the other layers of a step); when one holds `last` with every
///   `values[r] == (last[r] + 1) % modulus`, the new array is that one plus one (and the remainder by `modulus` if
///   some row wraps), computed on the device with exact int32 arithmetic: a host-made array is the decode step's
///   largest fixed cost on CUDA (docs/exact-read.md, "Host-made arrays", has the measurement).
/// - Otherwise (and always on the CPU, where a host array costs a copy only) it is [`index_array`].
pub(crate) fn step_index_array(values: &[usize], shape_: &[usize], modulus: Option<usize>) -> Result<Array> {
    if !default_device_is_gpu() {
        return index_array(values, shape_);
    }
    Ok(derived_index_array(values, shape_, modulus)?.0)
}

/// How [`derived_index_array`] made its array.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StepSource {
    /// A remembered array holding exactly these values.
    Reused,
    /// A remembered array holding the last step's values, plus one (and the remainder) on the device.
    Derived,
    /// Made from the host values.
    Uploaded,
}

/// The device-derivation path of [`step_index_array`], without its GPU gate (so the CPU tests run it), with how the
/// array was made.
fn derived_index_array(values: &[usize], shape_: &[usize], modulus: Option<usize>) -> Result<(Array, StepSource)> {
    let next = |p: usize| modulus.map_or(p + 1, |m| (p + 1) % m.max(1));
    let found = LAST_STEP_INDEX.with(|slots| -> Result<Option<(usize, Array, StepSource)>> {
        let slots = slots.borrow();
        let same_shape =
            |(_, (prev, pshape, _)): &(usize, &StepIndex)| pshape.as_slice() == shape_ && prev.len() == values.len();
        // Newest first: a model's layers in lockstep find the array the layer before made this step.
        if let Some((i, (_, _, arr))) =
            slots.iter().enumerate().rev().filter(same_shape).find(|(_, (prev, _, _))| prev.as_slice() == values)
        {
            return Ok(Some((i, arr.clone(), StepSource::Reused)));
        }
        let Some((i, (prev, _, arr))) = slots
            .iter()
            .enumerate()
            .rev()
            .filter(same_shape)
            .find(|(_, (prev, _, _))| prev.iter().zip(values).all(|(&p, &v)| next(p) == v))
        else {
            return Ok(None);
        };
        let plus = arr.add(step_scalar(1)?)?;
        let wraps = modulus.is_some_and(|m| prev.iter().any(|&p| p + 1 >= m));
        let arr = match modulus {
            Some(m) if wraps => plus.remainder(step_scalar(m.max(1))?)?,
            _ => plus,
        };
        Ok(Some((i, arr, StepSource::Derived)))
    })?;
    let (slot, arr, source) = match found {
        Some((i, arr, source)) => (Some(i), arr, source),
        None => (None, index_array(values, shape_)?, StepSource::Uploaded),
    };
    // The array made now becomes the newest slot: it replaces the one it came from, or the oldest when full.
    LAST_STEP_INDEX.with(|slots| {
        let mut slots = slots.borrow_mut();
        match slot {
            Some(i) => {
                slots.remove(i);
            }
            None if slots.len() >= STEP_INDEX_SLOTS => {
                slots.remove(0);
            }
            None => {}
        }
        slots.push((values.to_vec(), shape_.to_vec(), arr.clone()));
    });
    Ok((arr, source))
}

/// Evaluate buffers so that no lazy graph grows across steps.
pub(crate) fn eval(arrays: &[&Array]) -> Result<()> {
    mlx_rs::transforms::eval(arrays.iter().copied())?;
    Ok(())
}

fn dims(a: &Array) -> Vec<usize> {
    a.shape().iter().map(|&d| d.max(0) as usize).collect()
}

/// Check K and V: `[rows, H_kv, L, D]` of the spec's dtype, same shape; returns `L`. `min_len` is the least `L`.
pub(crate) fn check_kv(spec: &KvSpec, k: &Array, v: &Array, rows: usize, min_len: usize) -> Result<usize> {
    for (name, a) in [("keys", k), ("values", v)] {
        let d = dims(a);
        if d.len() != 4 || d[0] != rows || d[1] != spec.heads_kv || d[3] != spec.head_dim {
            return Err(shape(format!(
                "{name} have shape {:?}, expected [{rows}, {}, L, {}]",
                a.shape(),
                spec.heads_kv,
                spec.head_dim
            )));
        }
        if a.dtype() != spec.dtype.to_mlx() {
            return Err(shape(format!("{name} have dtype {:?}, expected {:?}", a.dtype(), spec.dtype)));
        }
    }
    if k.shape() != v.shape() {
        return Err(shape(format!("keys {:?} and values {:?} differ in shape", k.shape(), v.shape())));
    }
    let l = dims(k)[2];
    if l < min_len {
        return Err(shape(format!("{l} positions given, at least {min_len} required")));
    }
    Ok(l)
}

/// Check queries: `[rows, H_q, len, D]` with `H_q` a positive multiple of `H_kv`, of the spec's dtype.
pub(crate) fn check_q(spec: &KvSpec, q: &Array, rows: usize, len: usize) -> Result<usize> {
    let d = dims(q);
    if d.len() != 4 || d[0] != rows || d[2] != len || d[3] != spec.head_dim {
        return Err(shape(format!(
            "queries have shape {:?}, expected [{rows}, H_q, {len}, {}]",
            q.shape(),
            spec.head_dim
        )));
    }
    if d[1] == 0 || !d[1].is_multiple_of(spec.heads_kv) {
        return Err(shape(format!("H_q = {} is not a positive multiple of H_kv = {}", d[1], spec.heads_kv)));
    }
    if q.dtype() != spec.dtype.to_mlx() {
        return Err(shape(format!("queries have dtype {:?}, expected {:?}", q.dtype(), spec.dtype)));
    }
    Ok(d[1])
}

/// Number of columns (axis 2) of a 4-D array.
pub(crate) fn ncols(a: &Array) -> usize {
    a.shape().get(2).map_or(0, |&d| d.max(0) as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(a: &Array) -> Vec<i32> {
        a.eval().unwrap();
        a.as_slice::<i32>().to_vec()
    }

    /// Ring heads advancing one a step (with wraps at different steps per row) are derived on the device, and every
    /// array holds exactly the host's values; a jump, a new shape or a new row count falls back to an upload.
    #[test]
    fn derived_step_indices_are_exactly_the_host_values() {
        let w = 5usize;
        let shape = [3usize, 1, 1, 1];
        let mut heads = vec![0usize, 3, 4];
        LAST_STEP_INDEX.with(|l| l.borrow_mut().clear());
        for step in 0..12 {
            let (a, derived) = derived_index_array(&heads, &shape, Some(w)).unwrap();
            assert_eq!(host(&a), heads.iter().map(|&h| h as i32).collect::<Vec<_>>(), "step {step}");
            assert_eq!(a.shape(), &[3, 1, 1, 1]);
            let want = if step > 0 { StepSource::Derived } else { StepSource::Uploaded };
            assert_eq!(derived, want, "step {step}: every step after the first advances by one");
            heads.iter_mut().for_each(|h| *h = (*h + 1) % w);
        }
        // A jump (one row moved by two), then a linear cache (no modulus), then another shape: still the host's values.
        for (vals, m, shape, want_derived) in [
            (vec![2usize, 1, 2], Some(w), vec![3usize, 1, 1, 1], StepSource::Uploaded),
            (vec![3, 2, 3], None, vec![3, 1, 1, 1], StepSource::Derived),
            (vec![4, 3, 4], None, vec![3, 1, 1, 1], StepSource::Derived),
            (vec![5, 4], None, vec![2, 1, 1, 1], StepSource::Uploaded),
        ] {
            let (a, derived) = derived_index_array(&vals, &shape, m).unwrap();
            assert_eq!(host(&a), vals.iter().map(|&h| h as i32).collect::<Vec<_>>());
            assert_eq!(derived, want_derived, "{vals:?}");
        }
    }

    /// A model's layers decode in lockstep (every layer's batch asks for the same heads in a step): the first layer
    /// derives, the others reuse its array; two batches side by side (other row counts or other heads) each keep
    /// their own; more batches than slots fall back to uploads, never to other values.
    #[test]
    fn lockstep_layers_reuse_and_side_by_side_batches_keep_their_own() {
        let w = 4usize;
        LAST_STEP_INDEX.with(|l| l.borrow_mut().clear());
        let (mut a, mut b) = (vec![0usize, 2], vec![1usize, 3, 0]);
        let (sa, sb) = ([2usize, 1, 1, 1], [3usize, 1, 1, 1]);
        for step in 0..9 {
            for (heads, shape) in [(&a, &sa), (&b, &sb)] {
                for layer in 0..3 {
                    let (arr, source) = derived_index_array(heads, shape, Some(w)).unwrap();
                    assert_eq!(host(&arr), heads.iter().map(|&h| h as i32).collect::<Vec<_>>(), "step {step}");
                    let want = match (step, layer) {
                        (0, 0) => StepSource::Uploaded,
                        (_, 0) => StepSource::Derived,
                        _ => StepSource::Reused,
                    };
                    assert_eq!(source, want, "step {step} layer {layer} heads {heads:?}");
                }
            }
            a.iter_mut().for_each(|h| *h = (*h + 1) % w);
            b.iter_mut().for_each(|h| *h = (*h + 1) % w);
        }
        // Same shape, other values (a third batch of two rows): its own slot, then derived from it.
        let (arr, source) = derived_index_array(&[3, 3], &sa, Some(w)).unwrap();
        assert_eq!((host(&arr), source), (vec![3, 3], StepSource::Uploaded));
        let (arr, source) = derived_index_array(&[0, 0], &sa, Some(w)).unwrap();
        assert_eq!((host(&arr), source), (vec![0, 0], StepSource::Derived));
        // More batches than slots: the oldest slots go; whatever is found, the values are the host's.
        for i in 0..(2 * STEP_INDEX_SLOTS) {
            let heads = vec![i % w, (i / w) % w, 1];
            let (arr, _) = derived_index_array(&heads, &sb, Some(w)).unwrap();
            assert_eq!(host(&arr), heads.iter().map(|&h| h as i32).collect::<Vec<_>>());
        }
        assert!(LAST_STEP_INDEX.with(|l| l.borrow().len()) <= STEP_INDEX_SLOTS);
    }

    /// On the CPU the public function is a plain upload (the simulator's CPU runs keep their exact op sequence).
    #[test]
    fn step_index_array_on_the_cpu_is_index_array() {
        let a = step_index_array(&[7, 8], &[2, 1, 1, 1], Some(9)).unwrap();
        assert_eq!(host(&a), vec![7, 8]);
    }
}

/// Whether MLX's default device (this thread's) is a GPU.
pub fn default_device_is_gpu() -> bool {
    mlx_rs::Device::try_default().and_then(|d| d.get_type()).is_ok_and(|t| matches!(t, mlx_rs::DeviceType::Gpu))
}
