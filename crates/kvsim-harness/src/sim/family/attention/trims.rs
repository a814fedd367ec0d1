//! The attention family's trims: of a request outside the batch and of the running batch (plain and bypass), and
//! the model's verdict on a batch trim.

use std::collections::BTreeMap;

use super::{emit, Attention, Res};
use crate::sim::check;
use crate::sim::family::Cx;
use crate::sim::observe::{Call, TrimInfo};
use crate::sim::roster::Roster;
use kvsim_reference::RowModel;

impl Attention {
    pub(super) fn solo_trim(&mut self, cx: &mut Cx<'_>, req: u32, n: usize, bypass: bool) -> Res<bool> {
        let roster = cx.roster;
        if !roster.is_solo(req) {
            return Ok(false);
        }
        let mut model = self.reqs[&req].model.clone();
        let recording = cx.observer.wants_calls();
        let before = if recording {
            self.reqs[&req].solo.first().map(|c| c.state().clone()).unwrap_or_default()
        } else {
            Default::default()
        };
        let expected = model.trim(n, bypass);
        let mut first: Option<Result<usize, String>> = None;
        for layer in 0..self.cfg.layers {
            let r = self.reqs.get_mut(&req).unwrap();
            let got = r.solo[layer].trim(n, bypass);
            let twin = r.twin[layer].trim(n, bypass);
            if recording && first.is_none() {
                first = Some(got.as_ref().map(|x| *x).map_err(|e| format!("{e:?}")));
            }
            check::error_matches("solo trim", &expected, &got.map(|_| ()))?;
            check::error_matches("twin trim", &expected, &twin.map(|_| ()))?;
        }
        if cx.observer.wants_calls() {
            let after_window = before.last_concat.is_some_and(|l| l >= n);
            let kvsim = first.unwrap_or(Ok(0));
            emit(
                cx,
                Call::SoloTrim {
                    req,
                    offset: before.offset,
                    trim: &TrimInfo { n: vec![n], bypass, kvsim, after_window, live: vec![before.len] },
                },
            )?;
        }
        if expected.is_ok() {
            let q = self.reqs.get_mut(&req).unwrap();
            q.model = model;
            if bypass && n > 0 {
                q.history.rolled_back = true;
            }
        }
        self.counters.expected_errors += expected.is_err() as u64;
        Ok(true)
    }

    /// The model's verdict on trimming row `r` by `n[r]`: every row's trimmed model, and the first row's error (the
    /// production batch checks rows in order and changes nothing when one refuses).
    pub(super) fn model_trims(
        &self,
        roster: &Roster,
        n: &[usize],
        bypass: bool,
    ) -> (BTreeMap<u32, RowModel>, Result<(), kvsim_reference::ModelError>) {
        let mut models = BTreeMap::new();
        let mut expected = Ok(());
        for (r, &id) in roster.rows().iter().enumerate() {
            let mut m = self.reqs[&id].model.clone();
            if let Err(e) = m.trim(n[r], bypass) {
                if expected.is_ok() {
                    expected = Err(e);
                }
            }
            models.insert(id, m);
        }
        (models, expected)
    }

    pub(super) fn batch_trim(&mut self, cx: &mut Cx<'_>, n: usize, bypass: bool) -> Res<bool> {
        let roster = cx.roster;
        if roster.rows().is_empty() {
            return Ok(false);
        }
        let (models, expected) = self.model_trims(roster, &vec![n; roster.rows().len()], bypass);
        let recording = cx.observer.wants_calls();
        let before: Vec<kvsim_cache::RingState> = if recording {
            self.batch.first().map(|b| b.row_states().iter().map(|s| s.ring.clone()).collect()).unwrap_or_default()
        } else {
            vec![]
        };
        let mut first: Option<Result<usize, String>> = None;
        for layer in 0..self.cfg.layers {
            let got = self.batch[layer].trim(n, bypass);
            if recording && first.is_none() {
                first = Some(got.as_ref().map(|x| *x).map_err(|e| format!("{e:?}")));
            }
            check::error_matches("batch trim", &expected, &got.map(|_| ()))?;
            if expected.is_ok() {
                for &id in roster.rows() {
                    let t = self.reqs.get_mut(&id).unwrap().twin[layer].trim(n, bypass);
                    check::error_matches("twin trim", &expected, &t.map(|_| ()))?;
                }
            }
        }
        if cx.observer.wants_calls() {
            let offsets: Vec<usize> = before.iter().map(|s| s.offset).collect();
            let after_window = before.iter().all(|s| s.last_concat.is_some_and(|l| l >= n));
            let live = before.iter().map(|s| s.len).collect();
            let trim = TrimInfo { n: vec![n], bypass, kvsim: first.unwrap_or(Ok(0)), after_window, live };
            emit(cx, Call::Trim { reqs: roster.rows(), offsets: &offsets, trim: &trim })?;
        }
        match expected {
            Ok(()) => {
                for (id, m) in models {
                    self.reqs.get_mut(&id).unwrap().model = m;
                }
            }
            Err(_) => self.counters.expected_errors += 1,
        }
        Ok(true)
    }
}
