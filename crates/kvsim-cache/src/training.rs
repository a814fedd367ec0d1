//! Training caches (R-TRN-1..3): stateless adapters for the training and scoring forward, never admitted, merged or
//! persisted.
//!
//! - [`TrainingCache`] (`train:training`): a single offset-0 full-sequence pass. Every append returns exactly the
//!   K/V it is handed and stores nothing, so calling it twice changes nothing (gradient checkpointing re-runs a
//!   layer during the backward recompute; a layer that shares another layer's K/V reads them through that layer's
//!   cache again). Its reads take no mask for a one-position decode, MLX's fused `Causal` for a window, and the
//!   offset-0 sliding-window mask once a window is longer than the layer's window; with row lengths (a right-padded
//!   batch) both reads take the padded training mask ([`FamilyKey::Training`], mlx-lm's causal mask with right
//!   padding), so no real query sees a padded key.
//! - [`PrefixSharedCache`] (`train:prefix-shared`): chosen/rejected pairs that share a prompt in one forward of
//!   `N = P + Rc + Rr` positions; its mask hides the chosen answer from the rejected one ([`FamilyKey::PrefixShared`])
//!   and a length other than `P + Rc + Rr` is [`CacheError::PrefixSharedSize`].
//!
//! Both hold no K/V and take `&self` for every read: statelessness is a property of the types, not a promise. Their
//! kinds route nowhere ([`super::StorageKind::route`] answers [`CacheError::TrainingOnly`]), so no merge, join or
//! persistence path can take them. Rules: the upstream engine's `TrainingCache` / `PrefixSharedCache` (mlx-bun
//! `packages/inference/src/state/training-cache.ts`) and mlx-lm 0.32.2 `create_causal_mask` (`mlx_lm/models/base.py`).

use mlx_rs::Array;

use super::error::{invalid, CacheError};
use super::kind::{StorageKind, PREFIX_SHARED, TRAINING, TRAINING_SSM};
use super::mask::{FamilyKey, MaskUse, Masks};
use super::read::attend;
use super::ssm::{GdnParams, SsmCache, SsmSpec};
use super::util::{check_kv, check_q, ncols};
use super::{KvSpec, Result};

fn validate_window(window: Option<usize>) -> Result<()> {
    match window {
        Some(0) => Err(invalid("a sliding window of 0 positions")),
        _ => Ok(()),
    }
}

/// Rows of a `[B, H, L, D]` array.
fn batch_rows(a: &Array) -> usize {
    a.shape().first().map_or(0, |&b| b.max(0) as usize)
}

/// The stateless training cache (R-TRN-1..3): see the module documentation.
///
/// Guarantees: [`TrainingCache::update_and_fetch`] returns arrays holding exactly the bytes it was given (the same
/// MLX arrays), and no method changes the cache; `offset()` is always 0. A read's output is MLX's fused SDPA over
/// exactly those K/V under the mask [`TrainingCache::mask`] names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrainingCache {
    spec: KvSpec,
    window: Option<usize>,
    row_lengths: Option<Vec<usize>>,
}

impl TrainingCache {
    /// An unpadded training cache for a layer with this sliding window (`None` = full attention).
    pub fn new(spec: KvSpec, window: Option<usize>) -> Result<Self> {
        spec.validate()?;
        validate_window(window)?;
        Ok(TrainingCache { spec, window, row_lengths: None })
    }

    /// A training cache for a right-padded batch whose row `b` holds `row_lengths[b]` real positions (R-TRN-3).
    /// An empty list is [`CacheError::BadLengths`].
    pub fn padded(spec: KvSpec, window: Option<usize>, row_lengths: Vec<usize>) -> Result<Self> {
        if row_lengths.is_empty() {
            return Err(CacheError::BadLengths { what: "a padded training batch needs at least one row".into() });
        }
        let mut c = Self::new(spec, window)?;
        c.row_lengths = Some(row_lengths);
        Ok(c)
    }

    /// The K/V geometry (`H_kv`, `D`, dtype) every `k`, `v` and `q` is checked against.
    pub fn spec(&self) -> KvSpec {
        self.spec
    }

    /// The layer's sliding window (`None` = full attention).
    pub fn window_size(&self) -> Option<usize> {
        self.window
    }

    /// Real positions per row of a right-padded batch; `None` for unpadded rows.
    pub fn row_lengths(&self) -> Option<&[usize]> {
        self.row_lengths.as_deref()
    }

    /// Always 0: training is a single offset-0 pass (R-TRN-1).
    pub fn offset(&self) -> usize {
        0
    }

    /// `train:training` (R-C-1): a kind every router refuses ([`CacheError::TrainingOnly`]).
    pub fn storage_kind(&self) -> StorageKind {
        StorageKind::new(TRAINING)
    }

    /// Checks `k`, `v` (`[B, H_kv, N, D]`, `N >= 1`, `B` the row count when padded, every row length `<= N`) and
    /// returns `N`.
    fn check(&self, k: &Array, v: &Array) -> Result<usize> {
        let rows = batch_rows(k).max(1);
        let n = check_kv(&self.spec, k, v, rows, 1)?;
        if let Some(l) = &self.row_lengths {
            if l.len() != rows {
                return Err(CacheError::BadLengths { what: format!("{} row lengths for {rows} rows", l.len()) });
            }
            if let Some(&bad) = l.iter().find(|&&x| x > n) {
                return Err(CacheError::BadLengths { what: format!("row length {bad} > {n} positions") });
            }
        }
        Ok(n)
    }

    /// R-TRN-1: the K/V of this forward, exactly as given (the same arrays: nothing is copied, stored or moved).
    pub fn update_and_fetch(&self, k: &Array, v: &Array) -> Result<(Array, Array)> {
        self.check(k, v)?;
        Ok((k.clone(), v.clone()))
    }

    /// The mask of an `n`-position read (R-TRN-3). Without row lengths: none for `n == 1`, MLX's `Causal` while
    /// `n <= window`, else the offset-0 sliding-window mask ([`FamilyKey::Training`] with `lengths: None`). With row
    /// lengths: the padded training mask, for decode and window alike. Built once per forward through `masks`.
    pub fn mask(&self, n: usize, masks: &Masks) -> Result<(MaskUse, Option<Array>)> {
        let key = match &self.row_lengths {
            None if n == 1 => return Ok((MaskUse::None, None)),
            None if self.window.is_none_or(|w| n <= w) => return Ok((MaskUse::Causal, None)),
            None => FamilyKey::Training { lengths: None, queries: n, window: self.window },
            Some(l) => FamilyKey::Training { lengths: Some(l.clone()), queries: n, window: self.window },
        };
        let (spec, arr) = masks.get_family(&key)?;
        Ok((MaskUse::Array(spec), Some(arr)))
    }

    fn read(&self, k: &Array, v: &Array, q: &Array, scale: f32, masks: &Masks) -> Result<(Array, MaskUse)> {
        let n = self.check(k, v)?;
        check_q(&self.spec, q, batch_rows(k), n)?;
        let (kf, vf) = self.update_and_fetch(k, v)?;
        let (used, arr) = self.mask(n, masks)?;
        let spec = match &used {
            MaskUse::Array(s) => Some(s.clone()),
            _ => None,
        };
        let mask = spec.as_deref().zip(arr.as_ref());
        let out = attend(q, &kf, &vf, scale, mask, used == MaskUse::Causal)?;
        Ok((out, used))
    }

    /// A one-position read (`N == 1`; else [`CacheError::ShapeMismatch`]).
    pub fn decode(&self, k: &Array, v: &Array, q: &Array, scale: f32, masks: &Masks) -> Result<(Array, MaskUse)> {
        if ncols(k) != 1 {
            return Err(super::error::shape(format!("decode reads one position, {} given", ncols(k))));
        }
        self.read(k, v, q, scale, masks)
    }

    /// The full-sequence read of `N >= 1` positions, causal within the layer's window (R-TRN-3).
    pub fn window(&self, k: &Array, v: &Array, q: &Array, scale: f32, masks: &Masks) -> Result<(Array, MaskUse)> {
        self.read(k, v, q, scale, masks)
    }
}

/// Chosen/rejected pairs that share a prompt, in one training forward (ORPO/DPO-style preference pairs): the
/// sequence is `prompt ++ chosen ++ rejected` (`N = P + Rc + Rr` positions); the rejected answer attends the prompt
/// and itself, never the chosen answer, and continues the prompt's positions ([`PrefixSharedCache::rope_positions`]).
///
/// Guarantees: stateless like [`TrainingCache`] (reads take `&self`, K/V pass through unchanged); any `N` other
/// than `P + Rc + Rr` is [`CacheError::PrefixSharedSize`] before anything is read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixSharedCache {
    spec: KvSpec,
    window: Option<usize>,
    prompt: usize,
    chosen: usize,
    rejected: usize,
}

impl PrefixSharedCache {
    /// `prompt` (`P`), `chosen` (`Rc`) and `rejected` (`Rr`) positions; a layer window (`None` = full attention).
    pub fn new(spec: KvSpec, window: Option<usize>, prompt: usize, chosen: usize, rejected: usize) -> Result<Self> {
        spec.validate()?;
        validate_window(window)?;
        if prompt.checked_add(chosen).and_then(|x| x.checked_add(rejected)).is_none_or(|n| n == 0) {
            return Err(invalid(format!("prefix-shared sizes P {prompt} Rc {chosen} Rr {rejected}")));
        }
        Ok(PrefixSharedCache { spec, window, prompt, chosen, rejected })
    }

    /// `P + Rc + Rr`.
    pub fn total(&self) -> usize {
        self.prompt + self.chosen + self.rejected
    }

    /// Always 0.
    pub fn offset(&self) -> usize {
        0
    }

    /// `train:prefix-shared` (routes nowhere).
    pub fn storage_kind(&self) -> StorageKind {
        StorageKind::new(PREFIX_SHARED)
    }

    /// The logical (RoPE) position of each of the `N` columns: `i` for the prompt and the chosen answer, `i - Rc` for
    /// the rejected answer.
    pub fn rope_positions(&self) -> Vec<usize> {
        let split = self.prompt + self.chosen;
        (0..self.total()).map(|i| if i < split { i } else { i - self.chosen }).collect()
    }

    fn family_key(&self) -> FamilyKey {
        FamilyKey::PrefixShared {
            prompt: self.prompt,
            chosen: self.chosen,
            rejected: self.rejected,
            window: self.window,
        }
    }

    fn check_n(&self, n: usize) -> Result<()> {
        if n != self.total() {
            return Err(CacheError::PrefixSharedSize { n, expected: self.total() });
        }
        Ok(())
    }

    /// The K/V exactly as given, after checking `N == P + Rc + Rr` (an empty forward is a size mismatch too).
    pub fn update_and_fetch(&self, k: &Array, v: &Array) -> Result<(Array, Array)> {
        let n = check_kv(&self.spec, k, v, batch_rows(k).max(1), 0)?;
        self.check_n(n)?;
        Ok((k.clone(), v.clone()))
    }

    /// The mask of an `n`-position forward ([`FamilyKey::PrefixShared`]), built once per forward through `masks`.
    pub fn mask(&self, n: usize, masks: &Masks) -> Result<(MaskUse, Array)> {
        self.check_n(n)?;
        let (spec, arr) = masks.get_family(&self.family_key())?;
        Ok((MaskUse::Array(spec), arr))
    }

    /// The forward's read: fused SDPA under [`PrefixSharedCache::mask`].
    pub fn window(&self, k: &Array, v: &Array, q: &Array, scale: f32, masks: &Masks) -> Result<(Array, MaskUse)> {
        let (kf, vf) = self.update_and_fetch(k, v)?;
        let n = ncols(k);
        check_q(&self.spec, q, batch_rows(k), n)?;
        let (used, arr) = self.mask(n, masks)?;
        let spec = match &used {
            MaskUse::Array(s) => s.clone(),
            _ => return Err(CacheError::InvalidState { what: "prefix-shared mask is always an array".into() }),
        };
        Ok((attend(q, &kf, &vf, scale, Some((&spec, &arr)), false)?, used))
    }
}

/// The training DeltaNet cache (`train:training-ssm`, R-TRN-1 for the gated-DeltaNet layers of a hybrid model): every call
/// starts from the zero state (a fresh [`SsmCache`] of the batch's rows) and discards the state it ends with, so
/// calling it twice gives the same bytes and nothing is carried between forwards. With row lengths (a right-padded
/// batch), row `b`'s positions past `lengths[b]` are padding: they are zeroed and their recurrence steps are masked,
/// as in a prepared prefill ([`SsmCache::prepare`]), so every real position's output equals the row run alone
/// (byte for byte on CPU, the simulator checks it). Its kind routes nowhere: no merge, join or persistence path can
/// take it. Rule: mlx-lm 0.32.2 `mlx_lm/models/qwen3_5.py` `GatedDeltaNet.__call__` with `cache=None` (zero conv
/// and recurrent state, nothing stored).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TrainingSsmCache {
    spec: SsmSpec,
    lengths: Option<Vec<usize>>,
}

impl TrainingSsmCache {
    /// Unpadded rows.
    pub fn new(spec: SsmSpec) -> Result<Self> {
        SsmCache::new(spec, 0)?;
        Ok(TrainingSsmCache { spec, lengths: None })
    }

    /// A right-padded batch whose row `b` holds `lengths[b]` real positions; no rows is [`CacheError::BadLengths`].
    pub fn padded(spec: SsmSpec, lengths: Vec<usize>) -> Result<Self> {
        SsmCache::new(spec, 0)?;
        if lengths.is_empty() {
            return Err(CacheError::BadLengths { what: "a padded training batch of no rows".into() });
        }
        Ok(TrainingSsmCache { spec, lengths: Some(lengths) })
    }

    /// Real positions per row of a right-padded batch; `None` for unpadded rows.
    pub fn row_lengths(&self) -> Option<&[usize]> {
        self.lengths.as_deref()
    }

    /// `train:training-ssm`.
    pub fn storage_kind(&self) -> StorageKind {
        StorageKind::new(TRAINING_SSM)
    }

    /// R-SSM-1's ordinary call for a window: [`TrainingSsmCache::forward`] (the recurrence behind the same call a
    /// serving layer makes on [`SsmCache::window`]; differentiable: only MLX ops with gradients).
    pub fn window(&self, qkv: &Array, a: &Array, b: &Array, params: &GdnParams) -> Result<Array> {
        self.forward(qkv, a, b, params)
    }

    /// R-SSM-1's ordinary call for one position (`N = 1`): [`TrainingSsmCache::forward`] from the zero state.
    pub fn decode(&self, qkv: &Array, a: &Array, b: &Array, params: &GdnParams) -> Result<Array> {
        if qkv.shape().get(1) != Some(&1) {
            return Err(CacheError::ShapeMismatch {
                what: format!("decode takes one position, qkv {:?}", qkv.shape()),
            });
        }
        self.forward(qkv, a, b, params)
    }

    /// The layer's cache-side forward of `qkv [B, N, conv_dim]`, `a`, `b` `[B, N, Hv]` from the zero state; returns
    /// `y [B, N, Hv, Dv]` (unspecified at padded positions). Lengths that do not match the batch (count, or a row
    /// longer than `N`) are [`CacheError::BadLengths`]; bad shapes [`CacheError::ShapeMismatch`].
    pub fn forward(&self, qkv: &Array, a: &Array, b: &Array, params: &GdnParams) -> Result<Array> {
        let shape = qkv.shape();
        let rows = shape.first().map_or(0, |&x| x.max(0) as usize);
        let n = shape.get(1).map_or(0, |&x| x.max(0) as usize);
        let mut cache = SsmCache::new(self.spec, rows)?;
        if let Some(lengths) = &self.lengths {
            if lengths.len() != rows || lengths.iter().any(|&l| l > n) {
                return Err(CacheError::BadLengths {
                    what: format!("lengths {lengths:?} for {rows} rows of {n} positions"),
                });
            }
            cache.prepare(lengths, &[])?;
        }
        cache.window(qkv, a, b, params)
    }
}

#[cfg(test)]
mod tests;
