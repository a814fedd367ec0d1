//! The paged family's checks: outputs against the twins and the placement store, the model's verdicts on writes
//! and trims, the pool of every store against the model, and every live request's stored planes.

use mlx_rs::Array;

use super::{cache_fail, pool_fail, Paged, Req, Res};
use crate::sim::check::{self, Failure, OutClass};
use crate::sim::family::attention::{mlx_fail, payload_block};
use crate::sim::family::Cx;
use kvsim_cache::bytes::ArrayBytes;
use kvsim_cache::{CacheError, Storage};
use kvsim_reference::paged::{PoolModel, PoolVerdict};
use kvsim_reference::Tensor;

impl Paged {
    /// Compares outputs: `(production, other, placement)`. Against the placement store (the same calls on the same
    /// device) always byte for byte; against the twin byte for byte where the run's device promises it (CPU, and the
    /// GPU in exact mode), else (the GPU's fused kernels) the distance in ULPs at output scale is measured and
    /// recorded in the guarantees table.
    pub(super) fn compare_outputs(
        &mut self,
        cx: &mut Cx<'_>,
        what: &str,
        pairs: &[(&Array, &Array, bool)],
        warm: bool,
    ) -> Res<()> {
        let arrays: Vec<&Array> = pairs.iter().flat_map(|(a, b, _)| [*a, *b]).collect();
        let bytes = ArrayBytes::read_many(&arrays).map_err(|e| mlx_fail("read outputs", e))?;
        let exact = self.counters.guarantees.exact_unpadded_decode;
        for (i, (pair, &(_, _, placement))) in bytes.chunks(2).zip(pairs).enumerate() {
            let worst = if placement || exact || pair[0].shape != pair[1].shape || pair[0].dtype != pair[1].dtype {
                check::bytes_equal(&format!("{what} (read {i})"), &pair[0], &pair[1])?;
                0
            } else {
                check::max_ulp_at_scale(&pair[0], &pair[1])
            };
            cx.hasher.update(&pair[0].digest());
            let tags: &[&'static str] = if warm { &["paged", "paged/warm"] } else { &["paged"] };
            self.counters.record_twin(OutClass::Window, tags, self.dtype(), worst);
            if warm {
                self.counters.paged.warm_vs_cold += 1;
            }
        }
        Ok(())
    }

    /// The model's verdict on a write against production's result.
    pub(super) fn write_matches(
        &mut self,
        what: &str,
        verdict: &Result<(), PoolVerdict>,
        got: &Result<(), CacheError>,
    ) -> Res<()> {
        match (verdict, got) {
            (Ok(()), Ok(())) => Ok(()),
            (
                Err(PoolVerdict::Exhausted { needed, available }),
                Err(CacheError::PoolExhausted { needed: n, available: a }),
            ) if needed == n && available == a => Ok(()),
            _ => check::fail(Failure::new("errors", format!("{what}: model says {verdict:?}, production {got:?}"))),
        }
    }

    pub(super) fn trim_matches(what: &str, verdict: &Result<(), PoolVerdict>, got: &Result<(), CacheError>) -> Res<()> {
        let same = matches!(
            (verdict, got),
            (Ok(()), Ok(()))
                | (Err(PoolVerdict::TrimTooLong), Err(CacheError::TrimTooLong { .. }))
                | (Err(PoolVerdict::BypassNotAfterWindow), Err(CacheError::BypassNotAfterWindow))
        );
        if same {
            Ok(())
        } else {
            check::fail(Failure::new("errors", format!("{what}: model says {verdict:?}, production {got:?}")))
        }
    }

    /// Counts what the model says a write of `writes` does: copy-on-write copies and evictions under pressure.
    pub(super) fn count_write(&mut self, before: &PoolModel, writes: &[(u64, usize)]) {
        let bs = self.choice.block_size;
        let refs = before.refs();
        for &(s, _) in writes {
            let seq = &before.seqs[&s];
            if !seq.offset().is_multiple_of(bs) && refs[*seq.table.last().expect("partial") as usize] > 1 {
                self.counters.paged.cow_copies += 1;
                if self.storage != Storage::Plain {
                    self.reach("paged/affine_cow_partial");
                }
            }
        }
        self.count_evictions(before);
    }

    pub(super) fn count_evictions(&mut self, before: &PoolModel) {
        let gone = before.index.keys().filter(|k| !self.model.index.contains_key(*k)).count();
        self.counters.paged.evictions += gone as u64;
    }

    /// The pool of every store against the model, and the placement store's own accounting.
    pub(super) fn check_pool(&mut self) -> Res<()> {
        let m = &self.model;
        let refs = m.refs();
        for (i, st) in self.stores.iter().enumerate() {
            st.audit().map_err(|e| pool_fail(format!("layer {i}: {e}")))?;
            let rows: Vec<u64> = st.rows().iter().map(|s| s.0).collect();
            if st.capacity() != m.capacity || st.refs() != refs.as_slice() || st.free_list() != m.free.as_slice() {
                return check::fail(pool_fail(format!(
                    "layer {i}: capacity {} refs {:?} free {:?}; the model {} {:?} {:?}",
                    st.capacity(),
                    st.refs(),
                    st.free_list(),
                    m.capacity,
                    refs,
                    m.free
                )));
            }
            if rows != m.rows {
                return check::fail(pool_fail(format!("layer {i}: rows {rows:?}, the model {:?}", m.rows)));
            }
            let seqs: Vec<(u64, &[u32], &[u32], Option<usize>)> =
                st.seqs().map(|(s, q)| (s.0, q.table.as_slice(), q.tokens.as_slice(), q.last_window)).collect();
            let want: Vec<(u64, &[u32], &[u32], Option<usize>)> =
                m.seqs.iter().map(|(s, q)| (*s, q.table.as_slice(), q.tokens.as_slice(), q.last_window)).collect();
            if seqs != want {
                return check::fail(pool_fail(format!("layer {i}: sequences {seqs:?}, the model {want:?}")));
            }
            let index: Vec<(Vec<u32>, u32, u64)> =
                st.index_entries().into_iter().map(|e| (e.prefix, e.block, e.last_used)).collect();
            let want: Vec<(Vec<u32>, u32, u64)> = m.index.iter().map(|(p, (b, u))| (p.clone(), *b, *u)).collect();
            if index != want {
                return check::fail(pool_fail(format!("layer {i}: index {index:?}, the model {want:?}")));
            }
            self.counters.paged.pool_checks += 1;
            self.counters.checks += 1;
        }
        self.placement.audit().map_err(|e| pool_fail(format!("placement store: {e}")))?;
        if self.placement.rows().iter().map(|s| s.0).collect::<Vec<_>>() != m.rows {
            return check::fail(pool_fail("placement store: rows differ from the model's".to_string()));
        }
        Ok(())
    }

    /// One request's logical contents in every layer: its stored planes against its twin's, the placement store's
    /// (layer 0) and the value space's values of the tokens it holds (plain planes: the values themselves; affine
    /// planes: the reference quantizer's triple of each), bytes.
    pub(super) fn check_request(&mut self, cx: &mut Cx<'_>, r: &Req, what: &str) -> Res<()> {
        let n = self.storage.planes();
        let plain = self.storage == Storage::Plain;
        let mut arrays: Vec<Array> = vec![];
        for layer in 0..self.cfg.layers {
            arrays.extend(self.stores[layer].fetch_planes(r.seq).map_err(|e| cache_fail("fetch", e))?);
            arrays.extend(r.twin[layer].temporal_view_planes().map_err(|e| cache_fail("twin view", e))?);
            if plain && !r.toks.is_empty() {
                let t = vec![r.toks.iter().copied().map(Some).collect::<Vec<_>>()];
                arrays.push(payload_block(&self.cfg, &self.vs, layer, Tensor::K, &t)?);
                arrays.push(payload_block(&self.cfg, &self.vs, layer, Tensor::V, &t)?);
            }
            if layer == 0 {
                arrays.extend(self.placement.fetch_planes(r.seq).map_err(|e| cache_fail("placement fetch", e))?);
            }
        }
        let refs: Vec<&Array> = arrays.iter().collect();
        let b = ArrayBytes::read_many(&refs).map_err(|e| mlx_fail("read contents", e))?;
        let mut i = 0;
        for layer in 0..self.cfg.layers {
            let (mine, twin) = (&b[i..i + n], &b[i + n..i + 2 * n]);
            i += 2 * n;
            for (j, (p, t)) in mine.iter().zip(twin).enumerate() {
                check::bytes_equal(&format!("{what} layer {layer}: plane {j} against the twin"), p, t)?;
                cx.hasher.update(&p.digest());
            }
            if !r.toks.is_empty() {
                if plain {
                    let (mk, mv) = (&b[i], &b[i + 1]);
                    i += 2;
                    for (found, want, t) in [(&mine[0], mk, "K"), (&mine[1], mv, "V")] {
                        if found.first_difference(want).is_some() {
                            return check::fail(Failure::new(
                                "layout",
                                format!("{what} layer {layer}: {t} does not hold the values of the tokens it should"),
                            ));
                        }
                    }
                } else if let Some(q) = self.storage.quant() {
                    let rq = kvsim_reference::quant::RefQuant { bits: q.bits, group: q.group };
                    let w = format!("{what} layer {layer}");
                    crate::sim::family::quant::planes_vs_model(&w, &self.vs, layer as u32, rq, mine, &r.toks)?;
                    self.counters.paged.affine_states += 1;
                }
                self.counters.model_checks += 1;
            }
            if layer == 0 {
                for (j, p) in mine.iter().enumerate() {
                    check::bytes_equal(&format!("{what}: plane {j} of the placement store"), p, &b[i + j])?;
                }
                i += n;
                self.counters.paged.placement_compared += 1;
            }
            self.counters.record_state(self.dtype(), 1);
            if r.warm {
                self.counters.paged.warm_vs_cold += 1;
            }
        }
        Ok(())
    }

    pub(super) fn check_all(&mut self, cx: &mut Cx<'_>) -> Res<()> {
        self.check_pool()?;
        let live: Vec<Req> = self.reqs.values().cloned().collect();
        for r in &live {
            if r.tokens.len() != self.model.seqs[&r.seq.0].offset() {
                return check::fail(pool_fail(format!("sequence {:?}: {} tokens held", r.seq, r.tokens.len())));
            }
            self.check_request(cx, r, &format!("sequence {}", r.seq.0))?;
        }
        Ok(())
    }
}
