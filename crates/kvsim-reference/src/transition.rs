//! The precision lifecycle of the bf16-first layouts: when each row converts from bf16 to affine
//! storage, what every read sees, the reuse floor, packing, prefill cohorts and speculative rounds.
//!
//! Two models, both plain integers over [`RowModel`] token maps (which `(request, position)` sits in which
//! physical column), written from the rules in `docs/transitioning-rows.md`:
//!
//! - [`LegoModel`]: the serial bf16-first lego (`Bf16FirstQuantizedKvCache` with no window,
//!   `Bf16FirstRotatingQuantizedKvCache` with window `W`). The append that reaches `start` is read in bf16, then the
//!   storage converts before the call returns; later appends read affine; `start` 0 converts after the first append
//!   (never while empty); conversion is irreversible (a trim below `start` keeps quantized storage). The floor
//!   (`minimum_reusable_offset`) becomes the offset at conversion when `start > 0`, and stays 0 for `start` 0.
//!   While a speculative round is armed the lego does not convert: the round's commit or rollback settles it on the
//!   committed offset (a conversion never looks at an uncommitted suffix).
//! - [`RowsModel`]: the transitioning rows (`kv:delayed-quant:<bits>:<group>:<start>`,
//!   `kv:delayed-rotating-quant:<W>:<bits>:<group>:<start>`): rows of such legos under continuous batching. A row
//!   converts only at a boundary: the end of an append outside a prefill and outside a round, a round's commit or
//!   rollback, or the commit of that request's prefill chunk ([`RowsModel::commit_prefill`]); a sibling's split
//!   forward (several appends inside one planned chunk) therefore never moves a row's boundary. Rows pack into one
//!   layout once every row has converted, one way.
//!
//! Rows keep their own physical columns and phase (ARCHITECTURE.md "Rows"); a row additionally carries
//! `left_pad`, the padding slots in front of it in the aligned geometry: 0 for a lone row (it keeps its physical
//! columns and phase), `width - min(offset_i, W)` for each of several rows merged together (each laid out in
//! temporal order behind its padding). A speculative rollback rolls each row right by its rejected count into its
//! padding (`left_pad += shift`, the kept columns untouched: no requantization), except a lone unwrapped row, which
//! trims ([`RollbackPlan`]).
//!
//! Guarantees: no panic on any input; every impossible request is a [`TransitionError`] and leaves the model
//! unchanged (each operation runs on a copy that replaces the state only on success); no dependency on
//! `src/cache`, `src/sim` or any array library.

use crate::error::ModelError;
use crate::model::RowModel;
use crate::values::Tok;

/// The storage a read or a row is in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum Precision {
    /// Dense bf16 (the bf16-first phase).
    Bf16,
    /// Affine quantized (`bits`, `group`), after the row's transition.
    Affine,
}

/// An impossible request to the lifecycle model. The layout is unchanged after every one of them.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransitionError {
    /// The token-map model refused (trim legality, positions, windows).
    #[error(transparent)]
    Model(#[from] ModelError),
    /// A plain (dense `update_and_fetch`) read while some row is converted or the rows are packed: mixed precision
    /// rows use their attention read (upstream: "mixed precision rows use their attention state").
    #[error("mixed precision rows use their attention read (row {row} is affine)")]
    MixedPrecision { row: usize },
    /// A prefix reuse that would trim below the entry's floor (`minimum_reusable_offset`).
    #[error("reuse below the floor: usable prefix {prefix} < minimum_reusable_offset {floor}")]
    BelowFloor { prefix: usize, floor: usize },
    /// A rollback that keeps more positions than the round wrote into that row.
    #[error("row {row}: rollback keeps {keep} positions but the round wrote {written}")]
    KeepTooLong { row: usize, keep: usize, written: usize },
    /// A round operation without an armed round, or a second `round_begin`.
    #[error("round: {what}")]
    Round { what: &'static str },
    /// A prefill operation out of order (commit without a prefill, begin inside one, a round inside one).
    #[error("prefill: {what}")]
    Prefill { what: &'static str },
    /// Per-row arguments of the wrong count.
    #[error("expected {expected} per-row values, found {found}")]
    RowCount { expected: usize, found: usize },
    /// Sources of a merge whose transition specs differ.
    #[error("merge of rows with different transition specs")]
    SpecMismatch,
}

type Result<T> = std::result::Result<T, TransitionError>;

/// The parameters of a bf16-first layout: window (`None`: full attention), precision boundary `start` (`None`:
/// infinity, never converts: the prefill cohort's layout for plain rings, R-TKV-2), and the affine format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct TransitionSpec {
    pub max_size: Option<usize>,
    pub start: Option<usize>,
    pub bits: usize,
    pub group: usize,
}

impl TransitionSpec {
    /// Upstream `transitionDue(offset, start) = offset >= start && offset != 0`: never while empty, so `start` 0
    /// converts after the first append.
    pub fn transition_due(&self, offset: usize) -> bool {
        matches!(self.start, Some(s) if offset >= s && offset != 0)
    }

    /// The floor a conversion at `offset` leaves: the offset itself when `start > 0`, 0 for `start` 0 (every
    /// prefix was affine from the first append on, so none is invalidated).
    pub fn floor_at(&self, offset: usize) -> usize {
        if self.start == Some(0) {
            0
        } else {
            offset
        }
    }

    /// The rows layout's storage-kind signature (upstream order: `delayed-quant:<bits>:<group>:<start>`,
    /// `delayed-rotating-quant:<W>:<bits>:<group>:<start>`; an infinite start is written `inf`).
    pub fn signature(&self) -> String {
        let start = self.start.map_or("inf".to_string(), |s| s.to_string());
        match self.max_size {
            None => format!("kv:delayed-quant:{}:{}:{start}", self.bits, self.group),
            Some(w) => format!("kv:delayed-rotating-quant:{w}:{}:{}:{start}", self.bits, self.group),
        }
    }
}

/// One row's lifecycle state: its token map, when it converted, its floor, and its padding in the aligned geometry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LifecycleRow {
    /// Which token sits in which physical column (the serial rule, ARCHITECTURE.md "The serial core").
    pub ring: RowModel,
    /// The offset at which the row converted (`None`: still bf16).
    pub converted_at: Option<usize>,
    /// `minimum_reusable_offset`: prefix reuse never trims below it. Survives trim, extract, filter and merge.
    pub floor: usize,
    /// Padding slots in front of the row in the aligned geometry (0 for a lone row and for a serial lego).
    pub left_pad: usize,
}

impl LifecycleRow {
    /// An empty bf16 row.
    pub fn new(max_size: Option<usize>) -> Self {
        LifecycleRow { ring: RowModel::new(max_size), converted_at: None, floor: 0, left_pad: 0 }
    }

    /// The row's storage precision now.
    pub fn precision(&self) -> Precision {
        if self.converted_at.is_some() {
            Precision::Affine
        } else {
            Precision::Bf16
        }
    }

    /// Positions ever written.
    pub fn offset(&self) -> usize {
        self.ring.offset
    }

    /// Converts the row if its transition is due at its current (committed) offset. Returns whether it converted.
    fn settle(&mut self, spec: &TransitionSpec) -> bool {
        if self.converted_at.is_none() && spec.transition_due(self.ring.offset) {
            self.converted_at = Some(self.ring.offset);
            self.floor = self.floor.max(spec.floor_at(self.ring.offset));
            return true;
        }
        false
    }

    /// Appends `toks` (a decode write when `decode`, else a window write), returning the read it answers.
    fn write(&mut self, toks: &[Tok], decode: bool) -> Result<RowRead> {
        let precision = self.precision();
        if decode {
            let [tok] = toks else {
                return Err(
                    ModelError::BadLengths { what: format!("a decode writes 1 position, not {}", toks.len()) }.into()
                );
            };
            self.ring.try_decode_write(*tok)?;
            let visible = self.ring.decode_visible().into_iter().map(|c| self.ring.cols[c]).collect();
            return Ok(RowRead { precision, queries: vec![visible] });
        }
        let l = self.ring.try_window_write(toks)?;
        let queries =
            (0..l).map(|i| self.ring.window_visible(l, i).into_iter().map(|c| self.ring.cols[c]).collect()).collect();
        Ok(RowRead { precision, queries })
    }
}

/// What one row's read sees: the precision the keys are read in, and for each real query the tokens it attends
/// (in physical order).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowRead {
    pub precision: Precision,
    pub queries: Vec<Vec<Tok>>,
}

/// The serial bf16-first lego.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LegoModel {
    pub spec: TransitionSpec,
    pub row: LifecycleRow,
    /// The offset at `round_begin` while a round is armed.
    pub round: Option<usize>,
}

impl LegoModel {
    /// An empty lego (bf16). A window of 0 is refused.
    pub fn new(spec: TransitionSpec) -> Result<Self> {
        RowModel::try_new(spec.max_size)?;
        Ok(LegoModel { spec, row: LifecycleRow::new(spec.max_size), round: None })
    }

    /// A lego composed again over a row handed back to serial use (its storage, precision and floor kept;
    /// rewritten in temporal order as `extract` leaves it; no padding).
    pub fn compose(spec: TransitionSpec, row: &LifecycleRow) -> Self {
        let row =
            LifecycleRow { ring: row.ring.extract(), converted_at: row.converted_at, floor: row.floor, left_pad: 0 };
        LegoModel { spec, row, round: None }
    }

    /// Appends `toks` and returns the read: in the precision the storage had before the append. Then, outside a
    /// round, the storage converts if the transition is due. Returns the read and whether it converted.
    pub fn append(&mut self, toks: &[Tok], decode: bool) -> Result<(RowRead, bool)> {
        let mut next = self.clone();
        let read = next.row.write(toks, decode)?;
        let converted = next.round.is_none() && next.row.settle(&next.spec);
        *self = next;
        Ok((read, converted))
    }

    /// Drops the newest `n` positions (R-C-5). Precision and floor are kept: conversion is irreversible.
    pub fn trim(&mut self, n: usize, bypass: bool) -> Result<()> {
        self.row.ring.trim(n, bypass)?;
        Ok(())
    }

    /// Arms a speculative round: conversion waits for its commit or rollback.
    pub fn round_begin(&mut self) -> Result<()> {
        if self.round.is_some() {
            return Err(TransitionError::Round { what: "a round is already armed" });
        }
        self.round = Some(self.row.offset());
        Ok(())
    }

    /// Ends the round keeping every written position; converts if due. Returns whether it converted.
    pub fn round_commit(&mut self) -> Result<bool> {
        if self.round.take().is_none() {
            return Err(TransitionError::Round { what: "commit without an armed round" });
        }
        Ok(self.row.settle(&self.spec))
    }

    /// Ends the round keeping `keep` of the positions it wrote (a bypass trim of the rest); converts if due on the
    /// committed offset. Returns whether it converted.
    pub fn round_rollback(&mut self, keep: usize) -> Result<bool> {
        let before = self.round.ok_or(TransitionError::Round { what: "rollback without an armed round" })?;
        let written = self.row.offset() - before;
        if keep > written {
            return Err(TransitionError::KeepTooLong { row: 0, keep, written });
        }
        let mut next = self.clone();
        if written > keep {
            next.row.ring.trim(written - keep, true)?;
        }
        next.round = None;
        let converted = next.row.settle(&next.spec);
        *self = next;
        Ok(converted)
    }

    /// `minimum_reusable_offset`.
    pub fn minimum_reusable_offset(&self) -> usize {
        self.row.floor
    }

    /// `max_append_tokens`: positions that can be appended before the precision changes (`None`: unbounded).
    pub fn max_append_tokens(&self) -> Option<usize> {
        max_append_of(&self.spec, std::slice::from_ref(&self.row))
    }
}

fn max_append_of(spec: &TransitionSpec, rows: &[LifecycleRow]) -> Option<usize> {
    let start = spec.start?;
    rows.iter().filter(|r| r.converted_at.is_none() && r.offset() < start).map(|r| start - r.offset()).min()
}

/// How a rollback moves each row (upstream `rotatingRollbackPlan`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RollbackPlan {
    /// Trim the newest `n` positions of every row in place (a lone unwrapped ring row; every full-attention row).
    Trim(Vec<usize>),
    /// Roll each row right by its rejected count into its padding (`left_pad += shift`): the kept columns keep
    /// their bytes, nothing is requantized.
    RollRight(Vec<usize>),
}

/// An armed round of the rows: each row's offset at `round_begin`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoundModel {
    pub before: Vec<usize>,
}

/// The dense fetch of one row: its precision and its slots in the aligned geometry (`None`: padding).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DenseRow {
    pub precision: Precision,
    pub slots: Vec<Option<Tok>>,
}

/// The transitioning rows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowsModel {
    pub spec: TransitionSpec,
    pub rows: Vec<LifecycleRow>,
    /// Every row has converted and the rows were packed into one affine layout (one way).
    pub packed: bool,
    /// A prefill cohort is running: conversion waits for each request's `commit_prefill`.
    pub prefilling: bool,
    pub round: Option<RoundModel>,
    /// A right-padded prefill ([`RowsModel::prepare`]): each row's positions still to arrive.
    pub pending: Option<Vec<usize>>,
}

impl RowsModel {
    /// An empty layout (no rows).
    pub fn new(spec: TransitionSpec) -> Result<Self> {
        RowModel::try_new(spec.max_size)?;
        Ok(RowsModel { spec, rows: Vec::new(), packed: false, prefilling: false, round: None, pending: None })
    }

    /// Runs `op` on a copy and keeps it only on success: every error leaves the layout unchanged.
    fn transact<T>(&mut self, op: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        let mut next = self.clone();
        let out = op(&mut next)?;
        *self = next;
        Ok(out)
    }

    /// The rows merged from these sources (rows extracted from other layouts, or legos' rows), aligned: one row
    /// keeps its physical columns, phase and padding; several rows are each laid out in temporal order behind left
    /// padding to `width = max_i min(offset_i, W)`. Every row keeps its precision and floor; then packs if every
    /// row has converted.
    pub fn merge(spec: TransitionSpec, sources: Vec<LifecycleRow>) -> Result<Self> {
        let mut layout = RowsModel::new(spec)?;
        if sources.iter().any(|r| r.ring.max_size != spec.max_size) {
            return Err(TransitionError::SpecMismatch);
        }
        layout.rows = sources;
        layout.align();
        layout.maybe_pack();
        Ok(layout)
    }

    fn align(&mut self) {
        if self.rows.len() < 2 {
            return;
        }
        let w = self.spec.max_size.unwrap_or(usize::MAX);
        let width = self.rows.iter().map(|r| r.offset().min(w)).max().unwrap_or(0);
        for r in &mut self.rows {
            r.ring = RowModel::from_temporal(r.ring.max_size, r.ring.temporal_view(), r.ring.offset);
            r.left_pad = width - r.offset().min(w);
        }
    }

    fn maybe_pack(&mut self) -> bool {
        if !self.packed && !self.rows.is_empty() && self.rows.iter().all(|r| r.converted_at.is_some()) {
            // Packing keeps every row's columns, phase and padding (the rows are joined as they are).
            self.packed = true;
            return true;
        }
        false
    }

    /// Settles these rows (conversion if due), then packs if every row has converted. Returns the rows converted.
    fn settle_rows(&mut self, which: &[usize]) -> Vec<usize> {
        let spec = self.spec;
        let converted = which.iter().copied().filter(|&i| self.rows[i].settle(&spec)).collect();
        self.maybe_pack();
        converted
    }

    fn settle_all(&mut self) -> Vec<usize> {
        let all: Vec<usize> = (0..self.rows.len()).collect();
        self.settle_rows(&all)
    }

    fn per_row<T>(&self, v: &[T]) -> Result<()> {
        if v.len() != self.rows.len() {
            return Err(TransitionError::RowCount { expected: self.rows.len(), found: v.len() });
        }
        Ok(())
    }

    /// The attention read of one forward: row `r` appends `toks[r]` (a decode when `decode`, one position per row;
    /// an empty window leaves a row untouched) and reads in the precision its storage had before the append. Then,
    /// outside a prefill and a round, every row whose transition is due converts. Returns the reads and the rows
    /// that converted.
    pub fn append(&mut self, toks: &[Vec<Tok>], decode: bool) -> Result<(Vec<RowRead>, Vec<usize>)> {
        self.per_row(toks)?;
        if let Some(pending) = self.pending.clone() {
            if decode {
                return Err(ModelError::PendingPrefill.into());
            }
            // A prepared prefill: row `r` takes its next `min(pending_r, L)` positions; nothing settles.
            return self.transact(|s| {
                let mut reads = Vec::with_capacity(toks.len());
                let mut left = Vec::with_capacity(toks.len());
                for ((row, t), &p) in s.rows.iter_mut().zip(toks).zip(&pending) {
                    let n = p.min(t.len());
                    reads.push(if n == 0 {
                        RowRead { precision: row.precision(), queries: Vec::new() }
                    } else {
                        row.write(&t[..n], false)?
                    });
                    left.push(p - n);
                }
                s.pending = Some(left);
                Ok((reads, Vec::new()))
            });
        }
        self.transact(|s| {
            let mut reads = Vec::with_capacity(toks.len());
            for (row, t) in s.rows.iter_mut().zip(toks) {
                if !decode && t.is_empty() {
                    reads.push(RowRead { precision: row.precision(), queries: Vec::new() });
                    continue;
                }
                reads.push(row.write(t, decode)?);
            }
            let converted = if s.prefilling || s.round.is_some() { Vec::new() } else { s.settle_all() };
            Ok((reads, converted))
        })
    }

    /// One position of a committed read under known spans (R-TKV-7): row `r` decodes `toks[r]` when it is `Some`
    /// (reading in the precision its storage had before the write) and is left as it is when `None` (an empty
    /// read). Then, outside a prefill and a round, every row whose transition is due converts. A pending prepared
    /// prefill is refused. Returns the reads and the rows that converted.
    pub fn decode_some(&mut self, toks: &[Option<Tok>]) -> Result<(Vec<RowRead>, Vec<usize>)> {
        self.per_row(toks)?;
        if self.pending.is_some() {
            return Err(ModelError::PendingPrefill.into());
        }
        self.transact(|s| {
            let mut reads = Vec::with_capacity(toks.len());
            for (row, t) in s.rows.iter_mut().zip(toks) {
                reads.push(match t {
                    Some(t) => row.write(&[*t], true)?,
                    None => RowRead { precision: row.precision(), queries: Vec::new() },
                });
            }
            let converted = if s.prefilling || s.round.is_some() { Vec::new() } else { s.settle_all() };
            Ok((reads, converted))
        })
    }

    /// The plain read (`update_and_fetch`, one dense K/V for the whole batch): refused while any row is affine or
    /// the rows are packed (`MixedPrecision`), with nothing changed.
    pub fn check_plain_read(&self) -> Result<()> {
        if let Some(row) = self.rows.iter().position(|r| r.converted_at.is_some()) {
            return Err(TransitionError::MixedPrecision { row });
        }
        Ok(())
    }

    /// The dense fetch: each row answers as its storage fetches it dense, in the aligned geometry (a lone row: its
    /// physical columns; several: padding, then the row's columns, then trailing slots up to the widest row).
    pub fn dense_fetch(&self) -> Vec<DenseRow> {
        let width = self.rows.iter().map(|r| r.left_pad + r.ring.len()).max().unwrap_or(0);
        self.rows
            .iter()
            .map(|r| {
                let mut slots = vec![None; r.left_pad];
                slots.extend(r.ring.cols.iter().copied().map(Some));
                slots.resize(width, None);
                DenseRow { precision: r.precision(), slots }
            })
            .collect()
    }

    /// Starts a prefill cohort: conversion waits for each request's `commit_prefill`.
    pub fn begin_prefill(&mut self) -> Result<()> {
        if self.prefilling || self.round.is_some() {
            return Err(TransitionError::Prefill { what: "begin inside a prefill or a round" });
        }
        self.prefilling = true;
        Ok(())
    }

    /// Commits the planned chunk boundary of these rows' requests: exactly these rows settle (no-op once packed).
    /// Returns the rows that converted.
    pub fn commit_prefill(&mut self, which: &[usize]) -> Result<Vec<usize>> {
        if !self.prefilling {
            return Err(TransitionError::Prefill { what: "commit without a prefill" });
        }
        if let Some(&row) = which.iter().find(|&&i| i >= self.rows.len()) {
            return Err(ModelError::NoSuchRow { row, rows: self.rows.len() }.into());
        }
        self.transact(|s| Ok(s.settle_rows(which)))
    }

    /// A right-padded prefill: row `r` has `lengths[r]` more positions, delivered by the next windows (each of width
    /// `L` takes `min(remaining_r, L)` of them); a prefill cohort starts (conversion waits for each request's
    /// `commit_prefill`, or `finalize`). A second prepare is `PendingPrefill`; inside a round or a cohort a
    /// `Prefill` error.
    pub fn prepare(&mut self, lengths: &[usize]) -> Result<()> {
        if self.pending.is_some() {
            return Err(ModelError::PendingPrefill.into());
        }
        if self.prefilling || self.round.is_some() {
            return Err(TransitionError::Prefill { what: "prepare inside a prefill or a round" });
        }
        self.per_row(lengths)?;
        self.pending = Some(lengths.to_vec());
        self.prefilling = true;
        Ok(())
    }

    /// Ends the right-padded prefill (positions not delivered are forgotten): every row's request commits, the rows
    /// due convert (then pack). Returns the rows converted. Without one: `NoPendingPrefill`.
    pub fn finalize(&mut self) -> Result<Vec<usize>> {
        if self.pending.is_none() {
            return Err(ModelError::NoPendingPrefill.into());
        }
        self.transact(|s| {
            s.pending = None;
            s.prefilling = false;
            Ok(s.settle_all())
        })
    }

    /// Ends the prefill cohort: the requests that did not commit their chunk commit now, so every row whose
    /// transition is due converts (then the rows pack if all have), as at `finalize`. Returns the rows converted. A
    /// prepared prefill ends with `finalize` instead.
    pub fn end_prefill(&mut self) -> Result<Vec<usize>> {
        if !self.prefilling || self.pending.is_some() {
            return Err(TransitionError::Prefill { what: "end without a prefill" });
        }
        self.transact(|s| {
            s.prefilling = false;
            Ok(s.settle_all())
        })
    }

    /// Arms a speculative round (records each row's committed offset).
    pub fn round_begin(&mut self) -> Result<()> {
        if self.round.is_some() {
            return Err(TransitionError::Round { what: "a round is already armed" });
        }
        if self.prefilling {
            return Err(TransitionError::Prefill { what: "a round inside a prefill" });
        }
        self.round = Some(RoundModel { before: self.rows.iter().map(LifecycleRow::offset).collect() });
        Ok(())
    }

    /// Ends the round keeping every written position; settles every row. Returns the rows that converted.
    pub fn round_commit(&mut self) -> Result<Vec<usize>> {
        if self.round.is_none() {
            return Err(TransitionError::Round { what: "commit without an armed round" });
        }
        self.transact(|s| {
            s.round = None;
            Ok(s.settle_all())
        })
    }

    /// The rollback plan for keeping `keep[r]` of the positions the round wrote into row `r` (refused, with
    /// nothing changed, when a row keeps more than it was written).
    pub fn rollback_plan(&self, keep: &[usize]) -> Result<RollbackPlan> {
        let round = self.round.as_ref().ok_or(TransitionError::Round { what: "rollback without an armed round" })?;
        self.per_row(keep)?;
        let mut shifts = Vec::with_capacity(keep.len());
        for (row, (r, (&before, &k))) in self.rows.iter().zip(round.before.iter().zip(keep)).enumerate() {
            let written = r.offset() - before;
            if k > written {
                return Err(TransitionError::KeepTooLong { row, keep: k, written });
            }
            shifts.push(written - k);
        }
        let lone_unwrapped = self.rows.len() == 1 && self.rows[0].ring.is_trimmable();
        Ok(match self.spec.max_size {
            Some(_) if !lone_unwrapped => RollbackPlan::RollRight(shifts),
            _ => RollbackPlan::Trim(shifts),
        })
    }

    /// Ends the round keeping `keep[r]` positions of row `r` (the plan of [`RowsModel::rollback_plan`]), then
    /// settles every row on its committed offset. Returns the plan and the rows that converted.
    pub fn round_rollback(&mut self, keep: &[usize]) -> Result<(RollbackPlan, Vec<usize>)> {
        let plan = self.rollback_plan(keep)?;
        self.transact(|s| {
            let (shifts, roll) = match &plan {
                RollbackPlan::Trim(n) => (n, false),
                RollbackPlan::RollRight(n) => (n, true),
            };
            for (r, &n) in s.rows.iter_mut().zip(shifts) {
                if n > 0 {
                    // The rejected positions are the newest columns of the round's window write (bypass rule).
                    r.ring.trim(n, true)?;
                    if roll {
                        r.left_pad += n;
                    }
                }
            }
            s.round = None;
            let converted = s.settle_all();
            Ok((plan.clone(), converted))
        })
    }

    /// `max_append_tokens`: the smallest distance from an unconverted row to its boundary (`None`: unbounded,
    /// including once packed).
    pub fn max_append_tokens(&self) -> Option<usize> {
        if self.packed {
            return None;
        }
        max_append_of(&self.spec, &self.rows)
    }

    /// `minimum_reusable_offset`: the largest floor of any row (0 for no rows).
    pub fn minimum_reusable_offset(&self) -> usize {
        self.rows.iter().map(|r| r.floor).max().unwrap_or(0)
    }

    /// Row `i` handed back to serial use: composed again by the lego it came from (precision and floor kept).
    pub fn extract(&self, i: usize) -> Result<LegoModel> {
        let row = self.rows.get(i).ok_or(ModelError::NoSuchRow { row: i, rows: self.rows.len() })?;
        Ok(LegoModel::compose(self.spec, row))
    }

    /// Keeps these rows in this order (floors kept); the padding all kept rows share is shifted off. Refused inside
    /// a round (the round's per-row record would no longer match).
    pub fn filter(&mut self, keep: &[usize]) -> Result<()> {
        if self.round.is_some() {
            return Err(TransitionError::Round { what: "filter inside an armed round" });
        }
        if self.pending.is_some() {
            return Err(TransitionError::Prefill { what: "filter inside a pending prefill" });
        }
        let mut seen = vec![false; self.rows.len()];
        for &k in keep {
            match seen.get_mut(k) {
                None => return Err(ModelError::NoSuchRow { row: k, rows: self.rows.len() }.into()),
                Some(true) => return Err(ModelError::DuplicateRow { row: k }.into()),
                Some(s) => *s = true,
            }
        }
        self.rows = keep.iter().map(|&k| self.rows[k].clone()).collect();
        let shared = self.rows.iter().map(|r| r.left_pad).min().unwrap_or(0);
        for r in &mut self.rows {
            r.left_pad -= shared;
        }
        // A boundary: the kept rows pack if every one of them has converted.
        self.maybe_pack();
        Ok(())
    }

    /// Trims `n` positions from every row (pads kept; precision and floors kept). Refused inside a round.
    pub fn trim(&mut self, n: usize) -> Result<()> {
        if self.round.is_some() {
            return Err(TransitionError::Round { what: "trim inside an armed round (use rollback)" });
        }
        self.transact(|s| {
            for r in &mut s.rows {
                r.ring.trim(n, false)?;
            }
            Ok(())
        })
    }
}

/// Prefix reuse (`take`) from a stored row: the usable prefix `p = min(common, prompt_len - 1)`; the entry is
/// skipped (`BelowFloor`) when `p < floor`, and (`NotTrimmable`) when a trim is needed and the entry cannot trim.
/// On success the entry is trimmed to `p` and returned ready to continue the prompt from position `p`.
pub fn take(entry: &LegoModel, common: usize, prompt_len: usize) -> Result<LegoModel> {
    let p = common.min(prompt_len.saturating_sub(1)).min(entry.row.offset());
    let floor = entry.minimum_reusable_offset();
    if p < floor {
        return Err(TransitionError::BelowFloor { prefix: p, floor });
    }
    let mut out = entry.clone();
    out.round = None;
    let n = out.row.offset() - p;
    if n > 0 {
        out.row.ring.trim(n, false)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests;
