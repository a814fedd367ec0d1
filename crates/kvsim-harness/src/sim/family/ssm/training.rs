//! The recurrent family's training kinds: `training_forward` on the training DeltaNet cache and the refusals of
//! `training_refusal`.

use super::{mlx, pick, words, LayerDef, Recurrent, Res, RowIn, TRAIN_REQ};
use crate::sim::check::Failure;
use crate::sim::family::Cx;
use kvsim_cache::{CacheError, SsmCache, TrainingSsmCache};
use kvsim_reference::SsmRowModel;

impl Recurrent {
    /// A training forward of the DeltaNet layers (the training DeltaNet cache: zero state every call, state
    /// discarded) on `lengths.len()` right-padded rows of `n` positions. Checks: two calls give the same bytes;
    /// every row's real outputs equal the row run alone (a fresh one-row cache, bytes) and the f64 model.
    pub(super) fn training_forward(&mut self, cx: &mut Cx<'_>, lengths: &[u32], n: usize) -> Res<bool> {
        let lengths: Vec<usize> = lengths.iter().map(|&l| l as usize).collect();
        let refused = lengths.is_empty() || n == 0 || lengths.iter().any(|&l| l > n);
        let cache = TrainingSsmCache::padded(self.spec, lengths.clone());
        let per = self.set.dims.heads_v * self.set.dims.dv;
        for li in 0..self.layers.len() {
            let LayerDef::DeltaNet { params, weights } = &self.layers[li] else { continue };
            let (params, weights) = (params.clone(), weights.clone());
            let rows: Vec<RowIn> = lengths.iter().enumerate().map(|(r, &l)| (TRAIN_REQ + r as u64, 0, 0, l)).collect();
            let [q, a, b] = self.ssm_inputs(li as u32, &rows, n, None);
            let got = cache.as_ref().map_err(|e| e.clone()).and_then(|c| c.forward(&q, &a, &b, &params));
            if refused {
                return match got {
                    Err(CacheError::BadLengths { .. } | CacheError::ShapeMismatch { .. }) => {
                        self.counters.expected_errors += 1;
                        self.counters.checks += 1;
                        Ok(true)
                    }
                    other => Err(Failure::new(
                        "errors",
                        format!("training forward of {n} with lengths {lengths:?}: got {:?}", other.map(|_| ())),
                    )),
                };
            }
            let y = got.map_err(|e| mlx("training forward", e))?;
            let yb = words(&y)?;
            let again = cache.as_ref().unwrap().forward(&q, &a, &b, &params).map_err(|e| mlx("again", e))?;
            self.counters.checks += 1;
            if words(&again)? != yb {
                crate::sim::check::fail(Failure::new(
                    "ssm_training_stateless",
                    format!("layer {li}: a second call differs"),
                ))?;
            }
            cx.hasher.update(&yb.digest());
            for (r, &l) in lengths.iter().enumerate() {
                if l == 0 {
                    continue;
                }
                let (pq, pa, pb) = (pick(&q, r, 0, l, 1)?, pick(&a, r, 0, l, 1)?, pick(&b, r, 0, l, 1)?);
                let mut twin = SsmCache::new(self.spec, 1).map_err(|e| mlx("twin", e))?;
                let ty = twin.window(&pq, &pa, &pb, &params).map_err(|e| mlx("twin", e))?;
                let tb = words(&ty)?;
                let tokens = self.tokens(li as u32, TRAIN_REQ + r as u64, 0, l);
                let mut model = SsmRowModel::new(self.set.dims);
                self.check_row_output(
                    li as u32,
                    &format!("training row {r}"),
                    &yb,
                    r * n * per,
                    &tb,
                    &mut model,
                    &weights,
                    &tokens,
                )?;
            }
        }
        Ok(true)
    }

    pub(super) fn training_refusal(&mut self) -> Res<bool> {
        let c = TrainingSsmCache::new(self.spec).map_err(|e| mlx("training cache", e))?;
        match c.storage_kind().route() {
            Err(CacheError::TrainingOnly { kind }) if kind == kvsim_cache::kind::TRAINING_SSM => {
                self.counters.expected_errors += 1;
                self.counters.checks += 1;
                Ok(true)
            }
            other => Err(Failure::new("errors", format!("a training DeltaNet cache routed: {other:?}"))),
        }
    }
}
