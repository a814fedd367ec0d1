//! The bf16-first family's own ops on the rows: `prefix_reuse` (a `take` from the run's stored prefix-cache entry,
//! then more positions), `plain_read` (refused while any row is affine; the dense fetch against the twins') and
//! `fetch` (the softcapped read's: every row appends, then one aligned dense K/V against the twins' own fetches).

use super::{bytes_of, model_fail, row_of, same_error, unexpected, Res, Stored, TransitionFamily};
use crate::sim::check::{self, Failure};
use crate::sim::family::Cx;
use kvsim_cache::Masks;
use kvsim_reference::transition::take;
use kvsim_reference::Tok;

impl TransitionFamily {
    /// Prefix reuse from the stored entry (module docs).
    pub(super) fn prefix_reuse(&mut self, cx: &mut Cx<'_>, common: usize, prompt: usize, extra: usize) -> Res<bool> {
        let Some(st) = self.stored.take() else { return Ok(true) };
        let want = take(&st.model, common, prompt);
        let mut taken = Vec::with_capacity(self.cfg.layers);
        let mut twins = Vec::with_capacity(self.cfg.layers);
        for layer in 0..self.cfg.layers {
            let got = st.lego[layer].take(common, prompt);
            match (&want, got) {
                (Ok(_), Ok(l)) => {
                    taken.push(l);
                    twins.push(st.twin[layer].take(common, prompt).map_err(|e| unexpected("twin take", e))?);
                }
                (Err(w), Err(e)) if same_error(&e, w) => self.counters.expected_errors += 1,
                (w, g) => {
                    self.stored = Some(st);
                    return Err(Failure::new(
                        "errors",
                        format!(
                            "take({common}, {prompt}): model {:?}, production {:?}",
                            w.as_ref().map(|_| ()),
                            g.map(|_| ())
                        ),
                    ));
                }
            }
        }
        let Ok(model) = want else {
            // Refused: the entry is unchanged (take borrows it); it stays stored.
            self.stored = Some(st);
            return Ok(true);
        };
        self.counters.reuses += 1;
        let id = model.row.ring.temporal_view().first().map_or(u32::MAX - 1, |t| t.req);
        let mut model = model;
        if extra > 0 {
            let toks = Self::toks_from(id, model.row.offset(), extra);
            let (read, converted) = model.append(&toks, false).map_err(|e| model_fail("reuse append", e))?;
            let scale = self.cfg.scale();
            let masks = Masks::new();
            for layer in 0..self.cfg.layers {
                let (k, v, q) = self.kvq(layer, std::slice::from_ref(&toks));
                let before = taken[layer].converted_at();
                let (out, _) =
                    taken[layer].window(&k, &v, &q, scale, &masks).map_err(|e| unexpected("reuse read", e))?;
                let (tw, _) = twins[layer].window(&k, &v, &q, scale, &masks).map_err(|e| unexpected("twin read", e))?;
                check::flag(
                    "conversion after reuse",
                    before.is_none() && taken[layer].converted_at().is_some(),
                    converted,
                )?;
                let (ob, tb) = (bytes_of(&out)?, bytes_of(&tw)?);
                cx.hasher.update(&ob.digest());
                self.read_vs_model(layer, &ob, 0, &toks, &read)?;
                self.read_vs_twin(&ob, 0, &tb, extra, false, false, true)?;
                if converted {
                    self.counters.conversions += 1;
                }
            }
        }
        self.stored = Some(Stored { lego: taken, twin: twins, model });
        Ok(true)
    }

    /// The plain read of the batch (refused while mixed) and the dense fetch.
    pub(super) fn plain_read(&mut self, cx: &mut Cx<'_>) -> Res<bool> {
        let roster = cx.roster;
        if roster.rows().is_empty() {
            return Ok(true);
        }
        let want = self.rows_model.check_plain_read();
        for layer in 0..self.cfg.layers {
            let b = self.batch_rows(layer)?.clone();
            match (b.check_plain_read(), &want) {
                (Ok(()), Ok(())) => {}
                (Err(e), Err(w)) if same_error(&e, w) => self.counters.expected_errors += 1,
                (g, w) => return Err(Failure::new("errors", format!("plain read: model {w:?}, production {g:?}"))),
            }
            let dense = b.dense_fetch().map_err(|e| unexpected("dense fetch", e))?;
            let aligned = b.dense_fetch_aligned().map_err(|e| unexpected("aligned dense fetch", e))?;
            self.check_aligned_fetch(&self.rows_model.dense_fetch(), &aligned, &dense)?;
            for (r, (k, v)) in dense.iter().enumerate() {
                let (tk, tv) =
                    self.reqs[&roster.rows()[r]].twin[layer].dense().map_err(|e| unexpected("twin dense", e))?;
                let (kb, vb) = (bytes_of(k)?, bytes_of(v)?);
                check::bytes_equal("dense fetch keys vs the lego twin", &kb, &bytes_of(&tk)?)?;
                check::bytes_equal("dense fetch values vs the lego twin", &vb, &bytes_of(&tv)?)?;
                cx.hasher.update(&kb.digest());
                self.counters.record_state(mlx_rs::Dtype::Bfloat16, 2);
                self.counters.bit_exact_state += 2;
            }
        }
        Ok(true)
    }

    /// The softcapped read's fetch (R-TKV-4) on the running batch: every row appends `len` positions (the model's
    /// window write), the rows answer with one aligned dense K/V, checked against the model's aligned geometry
    /// with each row's part against its lego twin's own fetch of the same positions (bytes); the rows converted
    /// after the fetch against the model's, and each twin's conversion with its row's.
    pub(super) fn fetch(&mut self, cx: &mut Cx<'_>, len: usize) -> Res<bool> {
        let roster = cx.roster;
        let n = roster.rows().len();
        if n == 0 || len == 0 {
            return Ok(false);
        }
        let toks: Vec<Vec<Tok>> =
            (0..n).map(|r| Self::toks_from(roster.rows()[r], self.rows_model.rows[r].offset(), len)).collect();
        let (_, mconv) = self.rows_model.append(&toks, false).map_err(|e| model_fail("fetch append", e))?;
        if mconv.len() >= 2 {
            // Several rows come due in the one call: every one of them must convert in it.
            self.reached.push("fetch/rows_due_together");
        }
        let model = self.rows_model.dense_fetch();
        for layer in 0..self.cfg.layers {
            let (k, v, _) = self.kvq(layer, &toks);
            let (aligned, conv) = self.batch_mut(layer)?.fetch(&k, &v).map_err(|e| unexpected("rows fetch", e))?;
            if conv != mconv {
                return Err(Failure::new("conversion", format!("the fetch converted {conv:?}, the model {mconv:?}")));
            }
            self.counters.conversions += conv.len() as u64;
            let mut dense = Vec::with_capacity(n);
            for r in 0..n {
                let twin = &mut self.reqs.get_mut(&roster.rows()[r]).unwrap().twin[layer];
                let (kv, converted) =
                    twin.fetch(&row_of(&k, r), &row_of(&v, r)).map_err(|e| unexpected("twin fetch", e))?;
                check::flag("the twin's conversion at the fetch vs its row's", converted, conv.contains(&r))?;
                dense.push(kv);
            }
            self.check_aligned_fetch(&model, &aligned, &dense)?;
            cx.hasher.update(&bytes_of(&aligned.0)?.digest());
            self.counters.record_state(mlx_rs::Dtype::Bfloat16, 2);
            self.counters.bit_exact_state += 2;
        }
        Ok(true)
    }

    /// R-TKV-4's aligned form (one batch tensor) against the model's aligned geometry: its width, and per row and
    /// slot, zeros where the model has padding and the row's own dense fetch (compared with the lego twin by the
    /// caller) at the row's slots, in order.
    fn check_aligned_fetch(
        &mut self,
        model: &[kvsim_reference::transition::DenseRow],
        (ak, av): &(mlx_rs::Array, mlx_rs::Array),
        dense: &[(mlx_rs::Array, mlx_rs::Array)],
    ) -> Res<()> {
        let width = model.first().map_or(0, |r| r.slots.len());
        let (akb, avb) = (bytes_of(ak)?, bytes_of(av)?);
        if akb.shape.get(2).copied() != Some(width as i32) || akb.shape[0] as usize != model.len() {
            return Err(Failure::new(
                "dense_fetch",
                format!("aligned fetch of shape {:?}, the model's geometry {} rows x {width}", akb.shape, model.len()),
            ));
        }
        for (r, m) in model.iter().enumerate() {
            let pad = m.slots.iter().take_while(|s| s.is_none()).count();
            let (rk, rv) = (bytes_of(&dense[r].0)?, bytes_of(&dense[r].1)?);
            for (j, slot) in m.slots.iter().enumerate() {
                for (all, own, t) in [(&akb, &rk, "keys"), (&avb, &rv, "values")] {
                    let got =
                        all.select_columns(r, &[j]).map_err(|e| Failure::new("dense_fetch", format!("cut: {e}")))?;
                    let ok = match slot {
                        None => got.words.to_u32().iter().all(|&x| x == 0),
                        Some(_) => {
                            own.select_columns(0, &[j - pad])
                                .map_err(|e| Failure::new("dense_fetch", format!("cut: {e}")))?
                                .words
                                == got.words
                        }
                    };
                    if !ok {
                        return Err(Failure::new(
                            "dense_fetch",
                            format!("aligned {t} row {r} slot {j}: the model has {slot:?}, the bytes differ"),
                        ));
                    }
                }
            }
        }
        self.counters.checks += 1;
        Ok(())
    }
}
