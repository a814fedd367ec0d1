//! The training family (`train:training`): stateless training caches ([`TrainingCache`], [`PrefixSharedCache`]) in
//! forwards on random right-padded batches, checked against the reference model (`reference::special`) and against
//! each row run alone (the twin), plus the refusals (merge, persist, a prefix-shared size mismatch).
//!
//! Nothing is stored between ops: the family holds one long-lived `TrainingCache` per layer and checks after every
//! op that it is still exactly the cache it was built as (an append must leave the cache as it found it, R-TRN-2).

use mlx_rs::Array;

use crate::sim::check::{self, Failure, OutClass};
use crate::sim::config::{DtypeChoice, SimConfig};
use crate::sim::family::{Cx, Family, Registration};
use crate::sim::ops::{Op, OpKind};
use crate::sim::summary::Counters;
use kvsim_cache::bytes::ArrayBytes;
use kvsim_cache::{CacheError, JoinSource, KvSpec, MaskUse, Masks, PrefixSharedCache, RowBatch, TrainingCache};
use kvsim_reference::{prefix_shared_visible, training_visible, Tensor, Tok, ValueSpace};

type Res<T> = Result<T, Failure>;

pub const NAME: &str = "training";

/// The training family: only the training kinds (a training cache is never admitted, merged, decoded or trimmed).
pub const REGISTRATION: Registration = Registration {
    owns: OpKind::is_training,
    ..Registration::plain(
        NAME,
        |k: OpKind| matches!(k, OpKind::TrainingForward | OpKind::PrefixSharedForward | OpKind::TrainingRefusal),
        0.25,
        |cfg| Ok(Box::new(Training::new(cfg.clone())?)),
    )
};

pub struct Training {
    cfg: SimConfig,
    vs: ValueSpace,
    spec: KvSpec,
    /// One per layer, built once: every forward goes through it, and it must never change.
    held: Vec<TrainingCache>,
    built: Vec<TrainingCache>,
    counters: Counters,
}

fn mlx_fail(what: &str, e: impl std::fmt::Display) -> Failure {
    Failure::new("mlx", format!("{what}: {e}"))
}

fn unexpected(what: &str, e: CacheError) -> Failure {
    Failure::new("unexpected_error", format!("{what}: {e}"))
}

fn bytes_of(a: &Array) -> Res<ArrayBytes> {
    ArrayBytes::of(a).map_err(|e| mlx_fail("read bytes", e))
}

impl Training {
    pub fn new(cfg: SimConfig) -> Res<Training> {
        let (spec, vs) = (cfg.kv_spec(), cfg.value_space());
        let held = (0..cfg.layers)
            .map(|_| TrainingCache::new(spec, cfg.layout.max_size()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| Failure::new("setup", e.to_string()))?;
        Ok(Training { cfg, vs, spec, built: held.clone(), held, counters: Counters::default() })
    }

    fn block(&self, layer: usize, tensor: Tensor, toks: &[Vec<Option<Tok>>]) -> Array {
        let (data, s) = self.vs.block_f32(layer as u32, tensor, toks);
        let shape = [s[0] as i32, s[1] as i32, s[2] as i32, s[3] as i32];
        match self.cfg.dtype {
            DtypeChoice::F32 => Array::from_slice(&data, &shape),
            DtypeChoice::Bf16 => {
                let h: Vec<half::bf16> = data.iter().map(|&x| half::bf16::from_f32(x)).collect();
                Array::from_slice(&h, &shape)
            }
        }
    }

    fn kvq(&self, layer: usize, toks: &[Vec<Option<Tok>>]) -> (Array, Array, Array) {
        (self.block(layer, Tensor::K, toks), self.block(layer, Tensor::V, toks), self.block(layer, Tensor::Q, toks))
    }

    fn window(&self, w: u32) -> Option<usize> {
        (w > 0).then_some(w as usize)
    }

    /// A forward of `n` positions on rows holding `lengths[r]` real positions (right padding), every layer sharing
    /// one `Masks`. Checks: K/V pass through unchanged (twice), every real query vs the f64 model, every row vs the
    /// same row run alone (bytes, measured), one mask build per forward.
    fn forward(&mut self, cx: &mut Cx<'_>, lengths: &[u32], n: usize, window: Option<usize>) -> Res<bool> {
        let lengths: Vec<usize> = lengths.iter().map(|&l| l as usize).collect();
        let padded = lengths.iter().any(|&l| l != n);
        let cache = if padded {
            TrainingCache::padded(self.spec, window, lengths.clone()).map_err(|e| unexpected("padded", e))?
        } else {
            TrainingCache::new(self.spec, window).map_err(|e| unexpected("training cache", e))?
        };
        let toks: Vec<Vec<Option<Tok>>> = lengths
            .iter()
            .enumerate()
            .map(|(r, &len)| (0..n).map(|j| (j < len).then_some(Tok::new(r as u32, j as u32))).collect())
            .collect();
        // The model's verdict: a forward reads at least one position, and no row holds more than the forward has.
        let refused = n == 0 || lengths.iter().any(|&l| l > n);
        let masks = Masks::new();
        let scale = self.cfg.scale();
        for layer in 0..self.cfg.layers {
            let (k, v, q) = self.kvq(layer, &toks);
            let got = cache.window(&k, &v, &q, scale, &masks);
            if refused {
                let what = format!("lengths {lengths:?} on a forward of {n}");
                return self.expect_error(&what, got.err(), |e| {
                    matches!(e, CacheError::BadLengths { .. } | CacheError::ShapeMismatch { .. })
                });
            }
            let (out, used) = got.map_err(|e| unexpected("training forward", e))?;
            // Stateless: the held cache returns exactly what it is given, twice.
            let held = &self.held[layer];
            for _ in 0..2 {
                let (kf, vf) = held.update_and_fetch(&k, &v).map_err(|e| unexpected("update_and_fetch", e))?;
                check::bytes_equal("pass-through keys", &bytes_of(&kf)?, &bytes_of(&k)?)?;
                check::bytes_equal("pass-through values", &bytes_of(&vf)?, &bytes_of(&v)?)?;
                self.counters.record_state(k.dtype(), 2);
            }
            let ob = bytes_of(&out)?;
            cx.hasher.update(&ob.digest());
            for (r, &len) in lengths.iter().enumerate() {
                for i in 0..len {
                    let keys: Vec<Tok> = training_visible(n, padded.then_some(len), window, i)
                        .into_iter()
                        .map(|j| Tok::new(r as u32, j as u32))
                        .collect();
                    check::output_vs_model(
                        &self.vs,
                        layer as u32,
                        Tok::new(r as u32, i as u32),
                        &keys,
                        scale,
                        &ob,
                        r,
                        i,
                        &mut self.counters,
                    )?;
                }
                if len > 0 {
                    // The twin: this row alone, unpadded.
                    let solo = TrainingCache::new(self.spec, window).map_err(|e| unexpected("twin", e))?;
                    let (sk, sv, sq) = self.kvq(layer, &[toks[r][..len].to_vec()]);
                    let (so, _) =
                        solo.window(&sk, &sv, &sq, scale, &Masks::new()).map_err(|e| unexpected("twin", e))?;
                    check::output_vs_twin(
                        OutClass::Window,
                        &["training"],
                        &ob,
                        r,
                        &bytes_of(&so)?,
                        len,
                        &mut self.counters,
                    )?;
                }
            }
            let expect_builds = usize::from(matches!(used, MaskUse::Array(_)));
            let fam = format!("training:{}", window.map_or("inf".to_string(), |w| w.to_string()));
            if masks.builds_of(&fam) != expect_builds {
                return Err(Failure::new(
                    "mask_memo",
                    format!("{fam}: {} builds after layer {layer}", masks.builds_of(&fam)),
                ));
            }
            self.counters.checks += 1;
        }
        Ok(true)
    }

    fn prefix_shared(
        &mut self,
        cx: &mut Cx<'_>,
        p: usize,
        rc: usize,
        rr: usize,
        n: usize,
        window: Option<usize>,
    ) -> Res<bool> {
        let cache = match PrefixSharedCache::new(self.spec, window, p, rc, rr) {
            Ok(c) => c,
            Err(e) => {
                // The model: a pair of empty sequences is no forward.
                let empty = p + rc + rr == 0;
                return self.expect_error("an empty prefix-shared forward", Some(e), |e| {
                    empty && matches!(e, CacheError::InvalidState { .. })
                });
            }
        };
        let seg = |j: usize| {
            if j < p {
                0
            } else if j < p + rc {
                1
            } else {
                2
            }
        };
        let tok = |j: usize| Tok::new(seg(j), j as u32);
        let row: Vec<Option<Tok>> = (0..n).map(|j| Some(tok(j))).collect();
        let masks = Masks::new();
        let scale = self.cfg.scale();
        for layer in 0..self.cfg.layers {
            let (k, v, q) = self.kvq(layer, &[row.clone()]);
            let got = cache.window(&k, &v, &q, scale, &masks);
            if n != p + rc + rr {
                return match got {
                    Err(CacheError::PrefixSharedSize { n: a, expected: b }) if a == n && b == p + rc + rr => {
                        self.counters.expected_errors += 1;
                        Ok(true)
                    }
                    other => Err(Failure::new(
                        "error",
                        format!("prefix-shared N {n} != {}: got {:?}", p + rc + rr, other.err()),
                    )),
                };
            }
            let (out, _) = got.map_err(|e| unexpected("prefix-shared forward", e))?;
            let ob = bytes_of(&out)?;
            cx.hasher.update(&ob.digest());
            for i in 0..n {
                let keys: Vec<Tok> = prefix_shared_visible(p, rc, rr, window, i).into_iter().map(tok).collect();
                check::output_vs_model(&self.vs, layer as u32, tok(i), &keys, scale, &ob, 0, i, &mut self.counters)?;
            }
            if masks.builds_of(&format!("prefix-shared:{}", window.map_or("inf".to_string(), |w| w.to_string()))) != 1 {
                return Err(Failure::new("mask_memo", "prefix-shared mask not built exactly once per forward"));
            }
        }
        Ok(true)
    }

    /// An impossible request: production must refuse it with the model's typed error.
    fn expect_error(&mut self, what: &str, got: Option<CacheError>, ok: impl Fn(&CacheError) -> bool) -> Res<bool> {
        match got {
            Some(e) if ok(&e) => {
                self.counters.expected_errors += 1;
                self.counters.checks += 1;
                Ok(true)
            }
            other => Err(Failure::new("errors", format!("{what}: expected a typed refusal, got {other:?}"))),
        }
    }

    fn refusal(&mut self, persist: bool) -> Res<bool> {
        let held = &self.held[0];
        let got = if persist {
            // Persistence picks its codec by storage kind: no codec of the registry handles a training kind (kvsim's
            // own format and mlx-lm's alike: `UnknownKind`, fail closed), and the kind routes nowhere.
            for kind in [held.storage_kind().0, kvsim_cache::PREFIX_SHARED.to_string()] {
                match kvsim_persist::codec::Registry::default().codec(&kind) {
                    Err(kvsim_persist::PersistError::UnknownKind { kind: k }) if k == kind => {}
                    other => {
                        return Err(Failure::new(
                            "error",
                            format!("the persistence registry for {kind}: expected UnknownKind, got {:?}", other.err()),
                        ))
                    }
                }
                self.counters.checks += 1;
            }
            held.storage_kind().route().map(|_| ())
        } else {
            RowBatch::join(self.spec, self.cfg.layout.max_size(), &[JoinSource::Training(held)]).map(|_| ())
        };
        match got {
            Err(CacheError::TrainingOnly { kind }) if kind == "train:training" => {
                self.counters.expected_errors += 1;
                self.counters.checks += 1;
                Ok(true)
            }
            other => Err(Failure::new(
                "error",
                format!("a training cache asked to {}: got {other:?}", if persist { "persist" } else { "merge" }),
            )),
        }
    }
}

impl Family for Training {
    fn key(&self) -> &'static str {
        "train:training"
    }

    fn apply(&mut self, op: &Op, cx: &mut Cx<'_>) -> Res<bool> {
        match op {
            Op::TrainingForward { lengths, len, window } => {
                let w = self.window(*window);
                if lengths.is_empty() {
                    // The model: a padded batch needs rows.
                    let got = TrainingCache::padded(self.spec, w, vec![]);
                    return self.expect_error("an empty padded batch", got.err(), |e| {
                        matches!(e, CacheError::BadLengths { .. })
                    });
                }
                self.forward(cx, lengths, *len as usize, w)
            }
            Op::PrefixSharedForward { prompt, chosen, rejected, len, window } => {
                let w = self.window(*window);
                self.prefix_shared(cx, *prompt as usize, *chosen as usize, *rejected as usize, *len as usize, w)
            }
            Op::TrainingRefusal { persist } => self.refusal(*persist),
            _ => Ok(false),
        }
    }

    fn check_state(&mut self, _cx: &mut Cx<'_>) -> Res<()> {
        if self.held != self.built {
            return Err(Failure::new("stateless", "a training cache changed across forwards"));
        }
        self.counters.checks += 1;
        Ok(())
    }

    fn observe_state(&mut self, _cx: &mut Cx<'_>) -> Res<()> {
        Ok(())
    }

    /// Training caches hold no request of the roster.
    fn position(&self, _req: u32) -> Option<(usize, Option<usize>)> {
        None
    }

    fn counters(&self) -> &Counters {
        &self.counters
    }

    fn counters_mut(&mut self) -> &mut Counters {
        &mut self.counters
    }
}
