//! The attention family's probes of the public API the other ops do not reach: `adopt` /
//! `adopt_planes` of the running batch, `decode_phase` of every row and request, a prepared (right-padded) prefill
//! into rows that already hold positions (a length of 0, an early `finalize`), and ill-formed inputs (dtype,
//! shape, heads, storage-kind strings, row ids).
//!
//! Every ill-formed input must be the expected typed error with every byte and every state of the cache it was
//! offered to unchanged: the cache's buffers and row states are read before and after and compared byte for byte,
//! and `check_all` after the op compares the cache with its twins and the model as after any op.

use mlx_rs::{Array, Dtype};

use super::{unexpected, Attention, Res};
use crate::sim::check::Failure;
use crate::sim::family::Cx;
use crate::sim::ops::IllInput;
use crate::sim::roster::Roster;
use kvsim_cache::bytes::ArrayBytes;
use kvsim_cache::{CacheError, DecodePhase, Masks, RowBatch, StorageKind, ROW_BATCH_MARKER};
use kvsim_persist::{AnyCache, PersistError, Persisted, Registry};
use kvsim_reference::Tok;

/// Every byte and every state of one cache (or of the running batch, all layers): what an ill-formed input must
/// leave as it was.
#[derive(Debug, PartialEq)]
struct Snapshot {
    bytes: Vec<ArrayBytes>,
    states: String,
}

fn errors(what: impl Into<String>) -> Failure {
    Failure::new("errors", what.into())
}

impl Attention {
    fn snapshot(&self, on_batch: bool, req: u32) -> Res<Snapshot> {
        let mut planes: Vec<Array> = vec![];
        let mut states = String::new();
        if on_batch {
            for b in &self.batch {
                planes.extend(b.buffer_planes().unwrap_or_default());
                states.push_str(&format!("{:?} {:?};", b.row_states(), b.storage_kind()));
            }
        } else {
            for c in &self.reqs[&req].solo {
                planes.extend(c.buffer_planes().unwrap_or_default());
                states.push_str(&format!("{:?} {:?};", c.state(), c.storage_kind()));
            }
        }
        let refs: Vec<&Array> = planes.iter().collect();
        let bytes = ArrayBytes::read_many(&refs).map_err(|e| super::mlx_fail("snapshot", e))?;
        Ok(Snapshot { bytes, states })
    }

    /// The ill-formed input of class `class` was refused with the expected error (`ok`): the cache must be as
    /// `before`.
    fn rejected(&mut self, class: &str, on_batch: bool, req: u32, before: &Snapshot, what: &str) -> Res<()> {
        let after = self.snapshot(on_batch, req)?;
        if after.states != before.states {
            return Err(Failure::new(
                "ill_formed",
                format!("{what}: the refused call changed the state: {} -> {}", before.states, after.states),
            ));
        }
        if after.bytes.len() != before.bytes.len() {
            return crate::sim::check::fail(Failure::new(
                "ill_formed",
                format!("{what}: the refused call changed the buffers"),
            ));
        }
        for (a, b) in before.bytes.iter().zip(&after.bytes) {
            crate::sim::check::bytes_equal(&format!("{what}: buffer after the refused call"), a, b)
                .map_err(|f| Failure::new("ill_formed", f.message))?;
        }
        self.counters.record_rejected(class);
        Ok(())
    }

    /// `Op::Adopt`: every layer's running batch rebuilt from its own parts (`RowLayout::parts`: buffers and row
    /// states; `adopt` for plain storage, the contract's `RowLayout::adopt` otherwise); `check_all` then proves every byte and state kept. With `invalid`, row
    /// 0 claims one column more than the buffer holds: `InvalidState`, and the batch is not replaced.
    pub(super) fn adopt(&mut self, roster: &Roster, invalid: bool) -> Res<bool> {
        if roster.rows().is_empty() {
            return Ok(false);
        }
        // A batch without buffers (its rows hold no column) is its own adoption: applied, nothing built. Only the
        // running batch decides a skip, as in every family of the run (the bf16-first rows may hold columns of their
        // own ops that this family lets pass).
        if self.batch[0].buffer_planes().is_none() {
            return Ok(true);
        }
        let before = if invalid { Some(self.snapshot(true, 0)?) } else { None };
        let max = self.max_size();
        for layer in 0..self.cfg.layers {
            let b = &self.batch[layer];
            let storage = b.storage();
            // The row-layout contract's parts (`RowLayout::parts`): the owned planes and every row's state.
            let kvsim_cache::BatchParts { planes, rows: mut states } =
                kvsim_cache::RowLayout::parts(b).map_err(|e| unexpected("parts", e))?;
            if invalid {
                states[0].ring.len = b.cap() + 1;
            }
            // Plain storage through R-BROT-8's `adopt(k, v, rows)`, affine through the contract's `RowLayout::adopt`.
            let got = if storage == kvsim_cache::Storage::Plain {
                RowBatch::adopt(self.spec, max, planes[0].clone(), planes[1].clone(), states)
            } else {
                let g = kvsim_cache::RowLayout::geometry(b);
                <RowBatch as kvsim_cache::RowLayout>::adopt(&g, kvsim_cache::BatchParts { planes, rows: states })
            };
            match (invalid, got) {
                (false, Ok(adopted)) => self.batch[layer] = adopted,
                (false, Err(e)) => return Err(unexpected("adopt", e)),
                (true, Err(CacheError::InvalidState { .. })) => {}
                (true, other) => {
                    return Err(errors(format!(
                        "adopt of a row with len past the buffer: expected InvalidState, got {:?}",
                        other.map(|_| ())
                    )))
                }
            }
        }
        if let Some(before) = before {
            self.rejected("adopt_state", true, 0, &before, "adopt of an impossible row state")?;
        }
        Ok(true)
    }

    /// `Op::DecodePhase`: every batch row's `row_decode_phase` and every outside request's `decode_phase` against
    /// the model's answer (R-ROT-5); the row one past the end is `NoSuchRow`.
    pub(super) fn decode_phases(&mut self, roster: &Roster) -> Res<bool> {
        let solo: Vec<u32> = roster.solo().collect();
        if roster.rows().is_empty() && solo.is_empty() {
            return Ok(false);
        }
        let want = |ring: bool| if ring { DecodePhase::Ring } else { DecodePhase::Concat };
        for layer in 0..self.cfg.layers {
            for (r, id) in roster.rows().iter().enumerate() {
                let got = self.batch[layer].row_decode_phase(r).map_err(|e| unexpected("row_decode_phase", e))?;
                let expected = want(self.reqs[id].model.decode_phase_is_ring());
                if got != expected {
                    crate::sim::check::fail(Failure::new(
                        "decode_phase",
                        format!("layer {layer} row {r} (request {id}): {got:?}, the model says {expected:?}"),
                    ))?;
                }
                self.counters.checks += 1;
            }
            let n = roster.rows().len();
            match self.batch[layer].row_decode_phase(n) {
                Err(CacheError::NoSuchRow { row, rows }) if row == n && rows == n => {
                    self.counters.expected_errors += 1;
                }
                other => return Err(errors(format!("row_decode_phase({n}) of {n} rows: {other:?}"))),
            }
            for id in &solo {
                let got = self.reqs[id].solo[layer].decode_phase();
                let expected = want(self.reqs[id].model.decode_phase_is_ring());
                if got != expected {
                    crate::sim::check::fail(Failure::new(
                        "decode_phase",
                        format!("layer {layer} request {id}: {got:?}, the model says {expected:?}"),
                    ))?;
                }
                self.counters.checks += 1;
            }
        }
        Ok(true)
    }

    /// `Op::Prepare`: a right-padded prefill into the running batch (rows that hold positions). While it is
    /// pending, a decode and a second `prepare` are `PendingPrefill` with nothing changed; at most `chunks` chunks
    /// are delivered, then `finalize` (the undelivered positions are forgotten: the model and the twins never see
    /// them); a second `finalize` is `NoPendingPrefill`.
    pub(super) fn prepare_rows(&mut self, cx: &mut Cx<'_>, lengths: &[u32], chunk: usize, chunks: u32) -> Res<bool> {
        let roster = cx.roster;
        if roster.rows().is_empty()
            || lengths.len() != roster.rows().len()
            || chunk == 0
            || roster.rows().iter().all(|id| self.reqs[id].model.offset == 0)
        {
            return Ok(false);
        }
        let lens: Vec<usize> = lengths.iter().map(|&l| l as usize).collect();
        for b in self.batch.iter_mut() {
            b.prepare(&lens).map_err(|e| unexpected("prepare (rows holding positions)", e))?;
        }
        // Pending: a decode and a second prepare are refused, the batch unchanged.
        let before = self.snapshot(true, 0)?;
        let toks: Vec<Vec<Option<Tok>>> = roster.rows().iter().map(|&id| self.next_toks(id, 1)).collect();
        let scale = self.cfg.scale();
        for layer in 0..self.cfg.layers {
            let (k, v, q) = self.kvq(layer, &toks)?;
            let b = &mut self.batch[layer];
            match b.decode(&k, &v, &q, scale, &Masks::new()) {
                Err(CacheError::PendingPrefill) => {}
                other => return Err(errors(format!("decode while a prefill is pending: {:?}", other.map(|_| ())))),
            }
            match b.prepare(&lens) {
                Err(CacheError::PendingPrefill) => {}
                other => return Err(errors(format!("prepare while a prefill is pending: {other:?}"))),
            }
            self.counters.expected_errors += 2;
        }
        let after = self.snapshot(true, 0)?;
        if after != before {
            crate::sim::check::fail(Failure::new(
                "ill_formed",
                "a refused decode or prepare changed the pending batch",
            ))?;
        }
        let ids = roster.rows().to_vec();
        let mut batches = std::mem::take(&mut self.batch);
        let done = self.padded_chunks(cx, &mut batches, &ids, &lens, chunk, chunks as usize, false);
        self.batch = batches;
        done?;
        for b in self.batch.iter_mut() {
            b.finalize().map_err(|e| unexpected("finalize", e))?;
            match b.finalize() {
                Err(CacheError::NoPendingPrefill) => self.counters.expected_errors += 1,
                other => return Err(errors(format!("a second finalize: {other:?}"))),
            }
        }
        Ok(true)
    }

    /// `Op::IllFormed`: one ill-formed input offered to the running batch or to request `req` outside it.
    pub(super) fn ill_formed(
        &mut self,
        roster: &Roster,
        req: u32,
        batch: bool,
        input: IllInput,
        variant: u32,
    ) -> Res<bool> {
        let on_batch = batch && !roster.rows().is_empty();
        if !on_batch && !roster.is_solo(req) || input == IllInput::RowId && roster.rows().is_empty() {
            return Ok(false);
        }
        let on_batch = on_batch || input == IllInput::RowId;
        let before = self.snapshot(on_batch, req)?;
        let layer = variant as usize % self.cfg.layers;
        let what = match input {
            IllInput::Dtype | IllInput::Shape | IllInput::Heads => {
                self.bad_tensor(roster, on_batch, req, layer, input, variant)?
            }
            IllInput::StorageKind => self.bad_kind(on_batch, req, layer, variant)?,
            IllInput::RowId => self.bad_row(roster, layer, variant)?,
        };
        self.rejected(input.name(), on_batch, req, &before, &what)?;
        Ok(true)
    }

    /// A write (+ read) whose K, V or Q is ill-formed (`variant` picks the call, the tensor and the fault):
    /// `ShapeMismatch`.
    fn bad_tensor(
        &mut self,
        roster: &Roster,
        on_batch: bool,
        req: u32,
        layer: usize,
        input: IllInput,
        variant: u32,
    ) -> Res<String> {
        let rows: Vec<u32> = if on_batch { roster.rows().to_vec() } else { vec![req] };
        // The call: 0 decode, 1 window, 2 append (no queries); its well-formed inputs are the rows' next positions.
        let call = variant / 3 % 3;
        let l = if call == 0 { 1 } else { 1 + (variant / 9 % 3) as usize };
        let toks: Vec<Vec<Option<Tok>>> = rows.iter().map(|&id| self.next_toks(id, l)).collect();
        let (mut k, mut v, mut q) = self.kvq(layer, &toks)?;
        // The tensor: 0 keys, 1 values, 2 queries (keys for an append, which takes none).
        let which = if call == 2 { variant % 2 } else { variant % 3 };
        let (b, d) = (rows.len() as i32, self.cfg.head_dim as i32);
        let (hkv, hq) = (self.cfg.heads_kv as i32, self.cfg.heads_q as i32);
        let heads = if which == 2 { hq } else { hkv };
        let dtype = k.dtype();
        let zeros = |shape: &[i32], dt: Dtype| -> Res<Array> {
            mlx_rs::ops::zeros_dtype(shape, dt).map_err(|e| super::mlx_fail("ill-formed input", e))
        };
        let fault = variant / 27;
        let (bad, desc) = match input {
            IllInput::Dtype => {
                let other = match (dtype, fault % 2) {
                    (Dtype::Float32, 0) => Dtype::Bfloat16,
                    (Dtype::Bfloat16, 0) => Dtype::Float32,
                    _ => Dtype::Float16,
                };
                (zeros(&[b, heads, l as i32, d], other)?, format!("{other:?} instead of {dtype:?}"))
            }
            IllInput::Shape => match fault % 4 {
                0 => (zeros(&[b, heads, l as i32, d + 1], dtype)?, "head dim + 1".to_string()),
                1 => (zeros(&[b + 1, heads, l as i32, d], dtype)?, "one row too many".to_string()),
                2 => (zeros(&[b * heads, l as i32, d], dtype)?, "rank 3".to_string()),
                _ => (zeros(&[b, heads, l as i32 + 1, d], dtype)?, "one position more than the others".to_string()),
            },
            IllInput::Heads => {
                // Keys and values: H_kv + 1 heads. Queries: a count that is not a positive multiple of H_kv.
                let h = if which == 2 && hkv == 1 { 0 } else { hkv + 1 };
                (zeros(&[b, h, l as i32, d], dtype)?, format!("{h} heads"))
            }
            _ => unreachable!("bad_tensor is called for tensor inputs only"),
        };
        let name = ["keys", "values", "queries"][which as usize];
        match which {
            0 => k = bad,
            1 => v = bad,
            _ => q = bad,
        }
        let scale = self.cfg.scale();
        let call_name = ["decode", "window", "append"][call as usize];
        let got = if on_batch {
            let c = &mut self.batch[layer];
            match call {
                0 => c.decode(&k, &v, &q, scale, &Masks::new()).map(|_| ()),
                1 => c.window(&k, &v, &q, scale, &Masks::new()).map(|_| ()),
                _ => c.append(&k, &v),
            }
        } else {
            let c = &mut self.reqs.get_mut(&req).unwrap().solo[layer];
            match call {
                0 => c.decode(&k, &v, &q, scale, &Masks::new()).map(|_| ()),
                1 => c.window(&k, &v, &q, scale, &Masks::new()).map(|_| ()),
                _ => c.append(&k, &v),
            }
        };
        let what = format!(
            "{} {call_name} with {name} of {desc}",
            if on_batch { "batch".to_string() } else { format!("request {req}") }
        );
        match got {
            Err(CacheError::ShapeMismatch { .. }) => Ok(what),
            other => Err(errors(format!("{what}: expected ShapeMismatch, got {other:?}"))),
        }
    }

    /// The cache's own storage kind, malformed (`variant` picks how): the router refuses it
    /// (`UnknownStorageKind`, from `route` and `storage`), and a saved entry of the cache relabelled with it does
    /// not load (`UnknownKind`).
    fn bad_kind(&mut self, on_batch: bool, req: u32, layer: usize, variant: u32) -> Res<String> {
        let cache = if on_batch {
            AnyCache::Rows(self.batch[layer].clone())
        } else {
            AnyCache::Serial(self.reqs[&req].solo[layer].clone())
        };
        let kind = cache.storage_kind().0;
        let bad = match variant % 6 {
            0 => kind.to_uppercase(),
            1 => format!("{kind}{ROW_BATCH_MARKER}"),
            2 => format!(" {kind}"),
            3 => format!("{kind}:"),
            4 => kind[..kind.len() - 1].to_string(),
            _ => kind.replace(['-', ':'], "_"),
        };
        // Case 1 is a valid kind for a serial cache (its row-batch kind): double the marker there.
        let bad = if bad.strip_suffix(ROW_BATCH_MARKER).is_some_and(|s| s == kind) && !kind.ends_with(ROW_BATCH_MARKER)
        {
            format!("{bad}{ROW_BATCH_MARKER}")
        } else {
            bad
        };
        let what = format!("storage kind {bad:?} (the cache's is {kind:?})");
        let k = StorageKind::new(bad.clone());
        let unknown = Err(CacheError::UnknownStorageKind { kind: bad.clone() });
        if k.route().map(|_| ()) != unknown || k.storage().map(|_| ()) != unknown {
            return Err(errors(format!("{what}: route {:?}, storage {:?}", k.route(), k.storage())));
        }
        let registry = Registry::default();
        if registry.codec(&kind).is_ok() {
            let mut entry =
                registry.encode(&Persisted::new(cache)).map_err(|e| Failure::new("persist", format!("encode: {e}")))?;
            entry.storage_kind = bad.clone();
            match registry.decode(&entry) {
                Err(PersistError::UnknownKind { kind: k }) if k == bad => {}
                other => {
                    return Err(errors(format!(
                        "{what}: a saved entry relabelled with it: expected UnknownKind, got {:?}",
                        other.map(|p| p.cache.storage_kind())
                    )))
                }
            }
        }
        Ok(what)
    }

    /// A row id that does not exist or is listed twice, somewhere in a `filter` list of the other rows in reverse
    /// order (so that a filter that validated as it went would already have changed the batch), or an `extract`
    /// past the end: `NoSuchRow`, `DuplicateRow`.
    fn bad_row(&mut self, roster: &Roster, layer: usize, variant: u32) -> Res<String> {
        let n = roster.rows().len();
        let past = n + (variant as usize / 3 % 3);
        let at = variant as usize / 9 % (n + 1);
        let dup = n.saturating_sub(1);
        let b = &mut self.batch[layer];
        let (what, got) = match variant % 3 {
            0 => {
                let mut keep: Vec<usize> = (0..n).rev().collect();
                keep.insert(at, past);
                (format!("filter {keep:?} of {n} rows"), b.filter(&keep))
            }
            1 => {
                // The first listed row again, after its first place.
                let mut keep: Vec<usize> = (0..n).rev().collect();
                keep.insert(1 + at % n, dup);
                (format!("filter {keep:?} of {n} rows"), b.filter(&keep))
            }
            _ => (format!("extract row {past} of {n} rows"), b.extract(past).map(|_| ())),
        };
        let ok = match (variant % 3, &got) {
            (1, Err(CacheError::DuplicateRow { row })) => *row == dup,
            (0 | 2, Err(CacheError::NoSuchRow { row, rows })) => *row == past && *rows == n,
            _ => false,
        };
        if !ok {
            return Err(errors(format!("{what}: got {:?}", got.map(|_| ()))));
        }
        Ok(what)
    }
}
