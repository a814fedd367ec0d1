//! The transitioning rows' appends and reads: a request outside the batch (its legos), and the running batch's
//! forwards (`decode`, `window`), `commit_span` and `verify`.

use mlx_rs::ops::indexing::IndexOp;
use mlx_rs::Array;

use super::{bytes_of, model_fail, row_of, same_error, unexpected, Res, TransitionFamily};
use crate::sim::check::{self, Failure};
use crate::sim::family::Cx;
use kvsim_cache::transition::TransitioningKvRows;
use kvsim_cache::Masks;
use kvsim_reference::Tok;

/// One position of a committed span as the model read it: each row's read, whether the rows were packed, and
/// whether every row decoded with equal live lengths (then the unpadded decode's byte claim holds).
type SpanStep = (Vec<kvsim_reference::transition::RowRead>, bool, bool);

impl TransitionFamily {
    // ----- solo requests (legos) ----------------------------------------------------------------------------

    /// A window (or decode) on a request outside the batch: lego, twin and model, reads checked.
    pub(super) fn solo_append(&mut self, cx: &mut Cx<'_>, req: u32, len: usize, decode: bool) -> Res<bool> {
        let roster = cx.roster;
        if !roster.is_solo(req) || len == 0 {
            return Ok(false);
        }
        self.lego_append(cx, req, len, decode)?;
        Ok(true)
    }

    /// A window (or decode) on request `req`'s lego (outside the batch, or a row of the lego family's batch), its
    /// twin and model: reads against the model (f64) and the twin (bytes), conversion against the model's.
    pub(super) fn lego_append(&mut self, cx: &mut Cx<'_>, req: u32, len: usize, decode: bool) -> Res<()> {
        let mut model = self.reqs[&req].model.clone();
        let toks = Self::toks_from(req, model.row.offset(), len);
        let (read, converted) = model.append(&toks, decode).map_err(|e| model_fail("lego append", e))?;
        let scale = self.cfg.scale();
        let masks = Masks::new();
        for layer in 0..self.cfg.layers {
            let (k, v, q) = self.kvq(layer, std::slice::from_ref(&toks));
            let r = self.reqs.get_mut(&req).unwrap();
            let before = r.solo[layer].converted_at();
            let (out, _) = if decode {
                r.solo[layer].decode(&k, &v, &q, scale, &masks)
            } else {
                r.solo[layer].window(&k, &v, &q, scale, &masks)
            }
            .map_err(|e| unexpected("lego read", e))?;
            let (tw, _) = if decode {
                r.twin[layer].decode(&k, &v, &q, scale, &masks)
            } else {
                r.twin[layer].window(&k, &v, &q, scale, &masks)
            }
            .map_err(|e| unexpected("twin read", e))?;
            let did = before.is_none() && r.solo[layer].converted_at().is_some();
            check::flag("lego conversion vs the model", did, converted)?;
            let (ob, tb) = (bytes_of(&out)?, bytes_of(&tw)?);
            cx.hasher.update(&ob.digest());
            self.read_vs_model(layer, &ob, 0, &toks, &read)?;
            self.read_vs_twin(&ob, 0, &tb, len, decode, false, true)?;
            if did {
                self.counters.conversions += 1;
            }
        }
        self.reqs.get_mut(&req).unwrap().model = model;
        Ok(())
    }

    // ----- the running batch ----------------------------------------------------------------------------------

    pub(super) fn batch_rows(&self, layer: usize) -> Res<&TransitioningKvRows> {
        self.batch.get(layer).and_then(|b| b.as_ref()).ok_or_else(|| Failure::new("state", "no running batch"))
    }

    pub(super) fn batch_mut(&mut self, layer: usize) -> Res<&mut TransitioningKvRows> {
        self.batch.get_mut(layer).and_then(|b| b.as_mut()).ok_or_else(|| Failure::new("state", "no running batch"))
    }

    /// One forward of `toks[r]` per row (equal lengths) on the running batch, twins fed the same blocks. Returns
    /// the rows that converted (checked against the model's).
    fn forward(&mut self, cx: &mut Cx<'_>, len: usize, decode: bool, compiled: bool) -> Res<Vec<usize>> {
        let roster = cx.roster;
        let n = roster.rows().len();
        let toks: Vec<Vec<Tok>> =
            (0..n).map(|r| Self::toks_from(roster.rows()[r], self.rows_model.rows[r].offset(), len)).collect();
        let (reads, mconv) = self.rows_model.append(&toks, decode).map_err(|e| model_fail("rows append", e))?;
        let scale = self.cfg.scale();
        // The forward's memo (R-C-3): every layer's rows share it; the twins keep their own.
        let masks = Masks::new();
        let twin_masks = Masks::new();
        let mut first_layer_builds = 0;
        let mut converted = Vec::new();
        for layer in 0..self.cfg.layers {
            let (k, v, q) = self.kvq(layer, &toks);
            let (out, conv) = {
                let b = self.batch_mut(layer)?;
                if compiled {
                    compiled_step(b, &k, &v, &q, scale, &masks)?
                } else if decode {
                    b.decode(&k, &v, &q, scale, &masks).map_err(|e| unexpected("rows read", e))?
                } else {
                    b.window(&k, &v, &q, scale, &masks).map_err(|e| unexpected("rows read", e))?
                }
            };
            if conv != mconv {
                return Err(Failure::new("conversion", format!("rows converted {conv:?}, the model says {mconv:?}")));
            }
            self.counters.conversions += conv.len() as u64;
            let packed_before_read = self.read_packed_before(layer, &conv);
            if layer == 0 {
                first_layer_builds = masks.builds();
            }
            let lens_equal = {
                let lens: Vec<usize> = self.reqs_len_before(&toks, len);
                lens.iter().all(|&x| x == lens[0])
            };
            let ob = bytes_of(&out)?;
            cx.hasher.update(&ob.digest());
            for r in 0..n {
                let id = roster.rows()[r];
                let (kr, vr, qr) = (row_of(&k, r), row_of(&v, r), row_of(&q, r));
                let twin = &mut self.reqs.get_mut(&id).unwrap().twin[layer];
                let (tw, _) = if decode {
                    twin.decode(&kr, &vr, &qr, scale, &twin_masks)
                } else {
                    twin.window(&kr, &vr, &qr, scale, &twin_masks)
                }
                .map_err(|e| unexpected("twin read", e))?;
                let tb = bytes_of(&tw)?;
                self.read_vs_model(layer, &ob, r, &toks[r], &reads[r])?;
                self.read_vs_twin(&ob, r, &tb, len, decode, packed_before_read, lens_equal)?;
            }
            converted = conv;
        }
        self.check_one_mask_per_forward("rows forward", first_layer_builds, &masks)?;
        Ok(converted)
    }

    /// R-C-3 and R-TKV-3 for one forward of the rows (`masks` theirs alone, not the twins'): every later layer
    /// found the first layer's masks, and one layout read all rows, packed or not (the unpacked rows build one
    /// mask for all of them before they append), so each mask family was built once.
    pub(super) fn check_one_mask_per_forward(
        &mut self,
        what: &str,
        first_layer_builds: usize,
        masks: &Masks,
    ) -> Res<()> {
        check::masks_shared_by_layers(what, first_layer_builds, masks.builds())?;
        check::mask_memo(what, &masks.families())?;
        self.counters.mask_memo += 1;
        self.counters.checks += 1;
        Ok(())
    }

    /// Whether the batch was packed when it read (it packs only at a boundary after the read: when rows converted
    /// in this very call, the read ran on the unpacked rows).
    fn read_packed_before(&self, layer: usize, conv: &[usize]) -> bool {
        self.batch_rows(layer).is_ok_and(|b| b.is_packed()) && conv.is_empty()
    }

    /// Live column counts of the rows when they read (the model after the append).
    fn reqs_len_before(&self, _toks: &[Vec<Tok>], _len: usize) -> Vec<usize> {
        self.rows_model.rows.iter().map(|r| r.ring.len()).collect()
    }

    /// The running batch's decode through the rows' compiled step (`prepare_step`, `step_slots`, the pure steps,
    /// `apply_step`), checked as the ordinary decode is: each row against the model and its lego twin's ordinary
    /// decode, conversions against the model's.
    pub(super) fn batch_step_compiled(&mut self, cx: &mut Cx<'_>) -> Res<bool> {
        if cx.roster.rows().is_empty() {
            return Ok(false);
        }
        self.forward(cx, 1, true, true)?;
        Ok(true)
    }

    pub(super) fn batch_read(&mut self, cx: &mut Cx<'_>, len: usize, decode: bool) -> Res<bool> {
        let roster = cx.roster;
        if roster.rows().is_empty() || len == 0 {
            return Ok(false);
        }
        self.forward(cx, len, decode, false)?;
        Ok(true)
    }

    /// A committed span on the running batch: `TransitioningKvRows::commit_span`, one decode per
    /// position. Each position's read against the model (its own precision: a row converts between the span's
    /// positions when its transition comes due) and against the twin's ordinary decode of that position (bytes);
    /// the rows converted, in order, against the model's.
    pub(super) fn commit_span(&mut self, cx: &mut Cx<'_>, len: usize) -> Res<bool> {
        let roster = cx.roster;
        if roster.rows().is_empty() || len == 0 {
            return Ok(false);
        }
        let n = roster.rows().len();
        let toks: Vec<Vec<Tok>> =
            (0..n).map(|r| Self::toks_from(roster.rows()[r], self.rows_model.rows[r].offset(), len)).collect();
        // The model: one decode per position; whether the batch was packed when each position read, and whether
        // the rows then held equal live lengths.
        let mut model = self.rows_model.clone();
        let mut steps = Vec::with_capacity(len);
        let mut mconv = Vec::new();
        for i in 0..len {
            let packed = model.packed;
            let col: Vec<Vec<Tok>> = toks.iter().map(|t| vec![t[i]]).collect();
            let (reads, c) = model.append(&col, true).map_err(|e| model_fail("rows span", e))?;
            let lens: Vec<usize> = model.rows.iter().map(|r| r.ring.len()).collect();
            steps.push((reads, packed, lens.iter().all(|&x| x == lens[0])));
            mconv.extend(c);
        }
        let scale = self.cfg.scale();
        let masks = Masks::new();
        for layer in 0..self.cfg.layers {
            let (k, v, q) = self.kvq(layer, &toks);
            let (out, conv) = self
                .batch_mut(layer)?
                .commit_span(&k, &v, &q, scale, &masks)
                .map_err(|e| unexpected("rows commit_span", e))?;
            if conv != mconv {
                return Err(Failure::new("conversion", format!("span converted {conv:?}, the model says {mconv:?}")));
            }
            self.counters.conversions += conv.len() as u64;
            self.check_span_positions(cx, layer, &out, [&k, &v, &q], &toks, &steps, None)?;
        }
        self.rows_model = model;
        Ok(true)
    }

    /// A committed read under known spans of unequal per-row lengths (R-TKV-7): row `r` commits `lens[r]` positions
    /// (the op's list cut or padded with 0 to the batch), one decode per position, through
    /// `TransitioningKvRows::commit_known_spans`. At each position every row still inside its span is checked
    /// against the model's decode read (f64) and its lego twin's decode (bytes); conversions against the model's
    /// (each row converts inside its own span as its lego does); rows past their span are left as they are (the
    /// state checks after the op).
    pub(super) fn commit_known_spans(&mut self, cx: &mut Cx<'_>, lens: &[u32]) -> Res<bool> {
        let roster = cx.roster;
        let n = roster.rows().len();
        let lens: Vec<usize> = (0..n).map(|r| lens.get(r).copied().unwrap_or(0) as usize).collect();
        let len = lens.iter().copied().max().unwrap_or(0);
        if n == 0 || len == 0 {
            return Ok(false);
        }
        // Every row is fed `len` positions from its offset; those past its span are never stored.
        let toks: Vec<Vec<Tok>> =
            (0..n).map(|r| Self::toks_from(roster.rows()[r], self.rows_model.rows[r].offset(), len)).collect();
        let mut model = self.rows_model.clone();
        let mut steps = Vec::with_capacity(len);
        let mut mconv = Vec::new();
        for i in 0..len {
            let packed = model.packed;
            let col: Vec<Option<Tok>> = (0..n).map(|r| (i < lens[r]).then_some(toks[r][i])).collect();
            let (reads, c) = model.decode_some(&col).map_err(|e| model_fail("rows known spans", e))?;
            // Byte identity with the twin is claimed as for an unpadded decode only when every row decodes and the
            // rows hold equal live lengths.
            let live: Vec<usize> = model.rows.iter().map(|r| r.ring.len()).collect();
            let all = col.iter().all(Option::is_some);
            steps.push((reads, packed, all && live.iter().all(|&x| x == live[0])));
            mconv.extend(c);
        }
        let scale = self.cfg.scale();
        let masks = Masks::new();
        for layer in 0..self.cfg.layers {
            let (k, v, q) = self.kvq(layer, &toks);
            let (out, conv) = self
                .batch_mut(layer)?
                .commit_known_spans(&k, &v, &q, scale, &masks, &lens)
                .map_err(|e| unexpected("rows commit_known_spans", e))?;
            if conv != mconv {
                return Err(Failure::new(
                    "conversion",
                    format!("known spans {lens:?} converted {conv:?}, the model says {mconv:?}"),
                ));
            }
            self.counters.conversions += conv.len() as u64;
            self.check_span_positions(cx, layer, &out, [&k, &v, &q], &toks, &steps, Some(&lens))?;
        }
        self.rows_model = model;
        Ok(true)
    }

    /// The outputs of a committed span, one position at a time: every row inside its span (all rows when `lens` is
    /// `None`) against the model's decode read of that position (f64) and its lego twin's decode of it (bytes). The
    /// run's hash takes the whole column of a whole span, and each decoding row's column under known spans (the
    /// other rows' outputs are unspecified).
    #[allow(clippy::too_many_arguments)]
    fn check_span_positions(
        &mut self,
        cx: &mut Cx<'_>,
        layer: usize,
        out: &Array,
        [k, v, q]: [&Array; 3],
        toks: &[Vec<Tok>],
        steps: &[SpanStep],
        lens: Option<&[usize]>,
    ) -> Res<()> {
        let roster = cx.roster;
        let (scale, masks) = (self.cfg.scale(), Masks::new());
        for (i, (reads, packed, equal)) in steps.iter().enumerate() {
            let i32_ = i as i32;
            let col = |a: &Array| a.index((.., .., i32_..i32_ + 1, ..));
            let ob = bytes_of(&col(out))?;
            if lens.is_none() {
                cx.hasher.update(&ob.digest());
            }
            for r in (0..toks.len()).filter(|&r| lens.is_none_or(|l| i < l[r])) {
                if lens.is_some() {
                    cx.hasher.update(&bytes_of(&col(&row_of(out, r)))?.digest());
                }
                let c = |a: &Array| col(&row_of(a, r));
                let twin = &mut self.reqs.get_mut(&roster.rows()[r]).unwrap().twin[layer];
                let (tw, _) =
                    twin.decode(&c(k), &c(v), &c(q), scale, &masks).map_err(|e| unexpected("twin decode", e))?;
                let tb = bytes_of(&tw)?;
                self.read_vs_model(layer, &ob, r, &toks[r][i..i + 1], &reads[r])?;
                self.read_vs_twin(&ob, r, &tb, 1, true, *packed, *equal)?;
            }
        }
        Ok(())
    }

    /// A speculative round (module docs).
    pub(super) fn verify(&mut self, cx: &mut Cx<'_>, gamma: usize, accept: &[u32]) -> Res<bool> {
        let roster = cx.roster;
        if roster.rows().is_empty() || gamma == 0 {
            return Ok(false);
        }
        let n = roster.rows().len();
        for layer in 0..self.cfg.layers {
            self.batch_mut(layer)?.round_begin().map_err(|e| unexpected("round_begin", e))?;
            for &id in roster.rows() {
                self.reqs.get_mut(&id).unwrap().twin[layer].round_begin().map_err(|e| unexpected("twin round", e))?;
            }
        }
        self.rows_model.round_begin().map_err(|e| model_fail("round_begin", e))?;
        let conv = self.forward(cx, gamma, false, false)?;
        if !conv.is_empty() {
            return Err(Failure::new("conversion", format!("rows {conv:?} converted inside an armed round")));
        }
        let keep: Vec<usize> =
            (0..n).map(|r| (accept.get(r).copied().unwrap_or(gamma as u32) as usize).min(gamma)).collect();
        // Bad input first: row 0 keeps more than the round wrote; refused, nothing changed.
        let mut bad = keep.clone();
        bad[0] = gamma + 1;
        let want = self.rows_model.round_rollback(&bad).err();
        let Some(want) = want else {
            return Err(Failure::new("model", "the model accepted a rollback keeping more than the round wrote"));
        };
        for layer in 0..self.cfg.layers {
            let b = self.batch_mut(layer)?;
            let before = (b.offsets(), b.lifecycle().to_vec());
            match b.round_rollback(&bad) {
                Err(e) if same_error(&e, &want) => {}
                other => {
                    return Err(Failure::new(
                        "errors",
                        format!("rollback keeping {bad:?}: expected {want}, got {:?}", other.map(|_| ())),
                    ))
                }
            }
            check::flag(
                "state unchanged after a refused rollback",
                (b.offsets(), b.lifecycle().to_vec()) == before,
                true,
            )?;
            self.counters.expected_errors += 1;
        }
        let offsets_after: Vec<usize> = self.rows_model.rows.iter().map(|r| r.offset()).collect();
        let commit = keep.iter().all(|&k| k == gamma);
        let mconv = if commit {
            self.rows_model.round_commit().map_err(|e| model_fail("round_commit", e))?
        } else {
            self.rows_model.round_rollback(&keep).map_err(|e| model_fail("round_rollback", e))?.1
        };
        for layer in 0..self.cfg.layers {
            let got = if commit {
                self.batch_mut(layer)?.round_commit().map_err(|e| unexpected("round_commit", e))?
            } else {
                self.batch_mut(layer)?.round_rollback(&keep).map_err(|e| unexpected("round_rollback", e))?.1
            };
            if got != mconv {
                return Err(Failure::new("conversion", format!("round end converted {got:?}, model {mconv:?}")));
            }
            for (r, &id) in roster.rows().to_vec().iter().enumerate() {
                let twin = &mut self.reqs.get_mut(&id).unwrap().twin[layer];
                let did = if commit { twin.round_commit() } else { twin.round_rollback(keep[r]) }
                    .map_err(|e| unexpected("twin round end", e))?;
                check::flag("twin conversion at the round's end", did, mconv.contains(&r))?;
            }
        }
        self.counters.conversions += (mconv.len() * self.cfg.layers) as u64;
        if !commit && keep.iter().any(|&k| k != keep[0]) {
            self.counters.rounds += 1;
        }
        if let Some(w) = self.max_size() {
            if !commit && (0..n).any(|r| keep[r] < gamma && offsets_after[r] > w) {
                self.counters.rollbacks_across_wrap += 1;
            }
        }
        Ok(true)
    }
}

/// One compiled decode step of the bf16-first rows: every slot's pure step (a serial row's `decode_step` in its own
/// storage, or the packed batch's `rows_decode_step` under the forward's mask), then the apply. Returns the batch's
/// output (the slots' outputs joined along the batch) and the rows converted.
fn compiled_step(
    b: &mut kvsim_cache::TransitioningKvRows,
    k: &mlx_rs::Array,
    v: &mlx_rs::Array,
    q: &mlx_rs::Array,
    scale: f32,
    masks: &Masks,
) -> Res<(mlx_rs::Array, Vec<usize>)> {
    let plan = b.prepare_step().map_err(|e| unexpected("prepare_step", e))?;
    let slots = b.step_slots(&plan, masks).map_err(|e| unexpected("step_slots", e))?;
    let (mut outs, mut parts) = (Vec::with_capacity(slots.len()), Vec::with_capacity(slots.len()));
    for (r, slot) in slots.into_iter().enumerate() {
        let o = match slot.fetch {
            Some(fetch) => {
                let one = |x: &mlx_rs::Array| row_of(x, r);
                let inputs: Vec<mlx_rs::Array> =
                    slot.inputs.into_iter().chain([one(q), one(k), one(v), slot.rope]).collect();
                kvsim_cache::decode_step(slot.storage, fetch, None, scale, &inputs)
            }
            None => {
                let mask = match &slot.mask {
                    kvsim_cache::MaskUse::Array(m) => Some(&**m),
                    _ => None,
                };
                let inputs: Vec<mlx_rs::Array> =
                    slot.inputs.into_iter().chain([q.clone(), k.clone(), v.clone(), slot.rope]).collect();
                kvsim_cache::rows_decode_step(slot.storage, mask, None, scale, &inputs)
            }
        }
        .map_err(|e| unexpected("step", e))?;
        parts.push(o[0].clone());
        outs.push(o);
    }
    let out = mlx_rs::ops::concatenate(&parts, 0).map_err(|e| unexpected("join outputs", e.into()))?;
    let (_, conv) = b.apply_step(&plan, outs).map_err(|e| unexpected("apply_step", e))?;
    Ok((out, conv))
}
