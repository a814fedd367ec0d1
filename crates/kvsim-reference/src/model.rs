//! Per-row token maps: which `(request, position)` sits in which physical column.
//!
//! [`RowModel`] is the serial core of ARCHITECTURE.md ("The serial core": a ring of window `W` when `max_size` is
//! `Some(W)`, a linear cache when it is `None`), written independently of the production code and as plainly as
//! possible: it keeps the physical columns `[0, len)` as a `Vec<Tok>` and decides everything from the positions
//! the columns hold, never from write-pointer arithmetic:
//!
//! - a decode write overwrites **the column holding the oldest position** once the ring is full (R-ROT-2);
//! - temporal order is the columns **sorted by position** (R-ROT-4);
//! - visibility is **by position**: key `p` is visible to query `q` iff `p <= q` and `q - p < W` (R-C-2).
//!
//! It still tracks `offset`, `idx`, `last_concat`, `base` and `pending` with the production meaning (`RingState`,
//! `RowState`), so a simulator can compare them field by field: after a decode write `idx` = the written column + 1,
//! after a window write `idx = len`, after a trim or a relinearize `idx = len`.
//!
//! [`BatchModel`] is a batch of such rows: in kvsim's semantics every row of a row batch is an independent serial
//! ring (R-TKV-4, R-BROT-8), so the batch adds only membership (merge, join, filter, extract, adopt), the
//! right-padded prefill bookkeeping (`prepare`/`finalize`) and the legality checks.
//!
//! What the model guarantees: no panic on any input (impossible requests are [`ModelError`]s); every operation is
//! the serial rule applied to each row; a state reached from [`RowModel::new`] through the checked operations
//! (`try_*`, [`BatchModel`]) satisfies [`RowModel::check`].

use std::collections::HashSet;
use std::fmt::Write as _;

pub use crate::error::ModelError;
use crate::values::Tok;

/// The host-side fields a production row exposes (`RingState` plus `RowState`'s `base` and `pending`), for
/// field-by-field comparison.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RowFields {
    pub offset: usize,
    pub len: usize,
    pub idx: usize,
    pub last_concat: Option<usize>,
    pub base: usize,
    pub pending: Option<usize>,
}

/// The model of one serial ring (`max_size = Some(W)`) or linear cache (`None`), or of one row of a row batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RowModel {
    /// The window `W`; `None` for a linear cache (`W = ∞`).
    pub max_size: Option<usize>,
    /// Physical columns `[0, len)`: the token each holds.
    pub cols: Vec<Tok>,
    /// Positions ever written = the next RoPE position.
    pub offset: usize,
    /// Physical write head, as the production ring keeps it.
    pub idx: usize,
    /// `Some(L)` when the last mutation was a window write of `L` positions (or a trim right after one).
    pub last_concat: Option<usize>,
    /// Position at which the row's batch history starts (for [`RowModel::left_padding`]).
    pub base: usize,
    /// Real positions still to come in a right-padded prefill (`prepare` .. `finalize`).
    pub pending: Option<usize>,
}

fn zero_window(max_size: Option<usize>) -> Result<(), ModelError> {
    if max_size == Some(0) {
        return Err(ModelError::InvalidState { what: "a window of 0 positions".into() });
    }
    Ok(())
}

impl RowModel {
    /// An empty row. `Some(0)` is accepted here without panicking but is not a valid window (use
    /// [`RowModel::try_new`] to reject it).
    pub fn new(max_size: Option<usize>) -> Self {
        RowModel { max_size, cols: Vec::new(), offset: 0, idx: 0, last_concat: None, base: 0, pending: None }
    }

    /// An empty row; a window of 0 is `ModelError::InvalidState`.
    pub fn try_new(max_size: Option<usize>) -> Result<Self, ModelError> {
        zero_window(max_size)?;
        Ok(Self::new(max_size))
    }

    /// A row holding a temporal slice (`from_temporal`, used by merge and extract): `cols = toks`,
    /// `len = idx = toks.len()`, `last_concat = None`, `base = offset - len`, no pending prefill.
    /// Unchecked; see [`RowModel::try_from_temporal`].
    pub fn from_temporal(max_size: Option<usize>, toks: Vec<Tok>, offset: usize) -> Self {
        let len = toks.len();
        RowModel {
            max_size,
            cols: toks,
            offset,
            idx: len,
            last_concat: None,
            base: offset.saturating_sub(len),
            pending: None,
        }
    }

    /// [`RowModel::from_temporal`], checked: window not 0, and `toks` are the positions `offset - len .. offset`
    /// in order (`PositionMismatch` otherwise; `BadLengths` when `len > offset`).
    pub fn try_from_temporal(max_size: Option<usize>, toks: Vec<Tok>, offset: usize) -> Result<Self, ModelError> {
        zero_window(max_size)?;
        if toks.len() > offset {
            return Err(ModelError::BadLengths {
                what: format!("{} positions cannot end at offset {offset}", toks.len()),
            });
        }
        let first = offset - toks.len();
        for (j, t) in toks.iter().enumerate() {
            if t.pos as usize != first + j {
                return Err(ModelError::PositionMismatch { expected: first + j, found: t.pos });
            }
        }
        Ok(Self::from_temporal(max_size, toks, offset))
    }

    /// Live physical columns.
    pub fn len(&self) -> usize {
        self.cols.len()
    }

    /// `len() == 0`.
    pub fn is_empty(&self) -> bool {
        self.cols.is_empty()
    }

    /// The window as a number (`usize::MAX` for a linear cache).
    pub fn window(&self) -> usize {
        self.max_size.unwrap_or(usize::MAX)
    }

    /// The fields a production row exposes.
    pub fn fields(&self) -> RowFields {
        RowFields {
            offset: self.offset,
            len: self.len(),
            idx: self.idx,
            last_concat: self.last_concat,
            base: self.base,
            pending: self.pending,
        }
    }

    /// Physical columns sorted by the position they hold (ties, impossible in a valid state, by column).
    pub fn temporal_columns(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.cols.len()).collect();
        order.sort_by_key(|&c| (self.cols[c].pos, c));
        order
    }

    /// Every live token in temporal order (oldest first).
    pub fn temporal(&self) -> Vec<Tok> {
        self.temporal_columns().into_iter().map(|c| self.cols[c]).collect()
    }

    /// R-ROT-4: the newest `min(offset, W)` positions in temporal order: the **tail** of the temporal order, never
    /// the head (bug catalog #26). Bounded by `len` too, in a state that holds fewer positions.
    pub fn temporal_view(&self) -> Vec<Tok> {
        let t = self.temporal();
        let n = t.len().min(self.window()).min(self.offset);
        t[t.len() - n..].to_vec()
    }

    /// R-ROT-5: does the next decode write overwrite (ring) rather than append? True iff the ring is full
    /// (`len >= W`; an oversized buffer is first cut back to `W`, then overwritten).
    pub fn decode_phase_is_ring(&self) -> bool {
        matches!(self.max_size, Some(w) if w > 0 && self.len() >= w)
    }

    /// The column holding the oldest position (`None` when empty).
    pub fn oldest_column(&self) -> Option<usize> {
        (0..self.cols.len()).min_by_key(|&c| (self.cols[c].pos, c))
    }

    /// R-ROT-2 decode write of `tok`, unchecked (it ignores `pending` and `tok.pos`; see
    /// [`RowModel::try_decode_write`]). Returns the physical column written.
    ///
    /// 1. An oversized buffer (`len > W`, after a window write) loses its `len - W` oldest positions; the other
    ///    columns keep their order.
    /// 2. A full ring (`len == W`) overwrites the column holding the oldest position; otherwise the token is
    ///    appended at column `len`.
    /// 3. `idx` = written column + 1, `offset += 1`, `last_concat = None`.
    pub fn decode_write(&mut self, tok: Tok) -> usize {
        let mut col = self.cols.len();
        if let Some(w) = self.max_size {
            if self.cols.len() > w {
                let excess = self.cols.len() - w;
                let doomed: HashSet<usize> = self.temporal_columns().into_iter().take(excess).collect();
                self.cols =
                    self.cols.iter().enumerate().filter(|(c, _)| !doomed.contains(c)).map(|(_, &t)| t).collect();
                self.idx = w;
            }
            if w > 0 && self.cols.len() >= w {
                if let Some(oldest) = self.oldest_column() {
                    col = oldest;
                }
            }
        }
        if col == self.cols.len() {
            self.cols.push(tok);
        } else {
            self.cols[col] = tok;
        }
        self.idx = col + 1;
        self.offset += 1;
        self.last_concat = None;
        col
    }

    /// [`RowModel::decode_write`], checked: no pending prefill (`PendingPrefill`, R-BROT-2) and
    /// `tok.pos == offset` (`PositionMismatch`). On error the row is unchanged.
    pub fn try_decode_write(&mut self, tok: Tok) -> Result<usize, ModelError> {
        self.check_decode(tok)?;
        Ok(self.decode_write(tok))
    }

    fn check_decode(&self, tok: Tok) -> Result<(), ModelError> {
        if self.pending.is_some() {
            return Err(ModelError::PendingPrefill);
        }
        if tok.pos as usize != self.offset {
            return Err(ModelError::PositionMismatch { expected: self.offset, found: tok.pos });
        }
        Ok(())
    }

    /// The serial window rule (R-ROT-3) with exactly these positions: keep the newest `min(len, W - 1)`
    /// positions (all of them for a linear cache) in temporal order, append `toks`; `idx = len`,
    /// `offset += L`, `last_concat = Some(L)`. An empty `toks` applies the rule with `L = 0`.
    fn window_apply(&mut self, toks: &[Tok]) {
        let mut t = self.temporal();
        let keep = match self.max_size {
            Some(w) => t.len().min(w.saturating_sub(1)),
            None => t.len(),
        };
        t.drain(..t.len() - keep);
        t.extend_from_slice(toks);
        self.cols = t;
        self.idx = self.cols.len();
        self.offset += toks.len();
        self.last_concat = Some(toks.len());
    }

    /// R-ROT-3 window write of `toks` (one chunk of `L = toks.len()` positions), unchecked (see
    /// [`RowModel::try_window_write`]). With a pending prefill only the first `min(remaining, L)` tokens are real
    /// and stored (right padding); a chunk with no real position of this row leaves the row untouched.
    pub fn window_write(&mut self, toks: &[Tok]) {
        self.window_write_stored(toks);
    }

    /// [`RowModel::window_write`], returning how many positions this row stored.
    pub fn window_write_stored(&mut self, toks: &[Tok]) -> usize {
        match self.pending {
            None => {
                self.window_apply(toks);
                toks.len()
            }
            Some(remaining) => {
                let m = remaining.min(toks.len());
                if m > 0 {
                    self.window_apply(&toks[..m]);
                }
                self.pending = Some(remaining - m);
                m
            }
        }
    }

    /// How many of a chunk of `l` positions this row would store (all, or `min(remaining, l)` when pending).
    pub fn real_in_chunk(&self, l: usize) -> usize {
        match self.pending {
            None => l,
            Some(remaining) => remaining.min(l),
        }
    }

    /// [`RowModel::window_write_stored`], checked: the stored tokens have positions `offset, offset + 1, ...`
    /// (`PositionMismatch`). On error the row is unchanged.
    pub fn try_window_write(&mut self, toks: &[Tok]) -> Result<usize, ModelError> {
        self.check_window(toks)?;
        Ok(self.window_write_stored(toks))
    }

    fn check_window(&self, toks: &[Tok]) -> Result<(), ModelError> {
        zero_window(self.max_size)?;
        let m = self.real_in_chunk(toks.len());
        for (j, t) in toks[..m].iter().enumerate() {
            if t.pos as usize != self.offset + j {
                return Err(ModelError::PositionMismatch { expected: self.offset + j, found: t.pos });
            }
        }
        Ok(())
    }

    /// R-ROT-6: a ring is trimmable while it has never filled (`offset < W`); a linear cache always is.
    pub fn is_trimmable(&self) -> bool {
        match self.max_size {
            Some(w) => self.offset < w,
            None => true,
        }
    }

    /// R-C-5 trim of the newest `n` positions.
    ///
    /// - `bypass = false`: `NotTrimmable` unless [`RowModel::is_trimmable`]; `TrimTooLong` unless
    ///   `n <= offset` (and `n <= len`, which only a row built from a short temporal slice can violate).
    /// - `bypass = true` (speculative rollback): `BypassNotAfterWindow` unless `last_concat == Some(L)`;
    ///   `TrimTooLong` unless `n <= L`.
    ///
    /// Effect: the columns holding the `n` newest positions go, `offset -= n`, `idx = len`. `last_concat`
    /// becomes `Some(L - n)` when it was `Some(L)` with `n <= L` (the state is then exactly the state a window of
    /// `L - n` positions would have left), else `None`. On error the row is unchanged.
    pub fn trim(&mut self, n: usize, bypass: bool) -> Result<(), ModelError> {
        self.check_trim(n, bypass)?;
        let order = self.temporal_columns();
        let doomed: HashSet<usize> = order[order.len() - n..].iter().copied().collect();
        self.cols = self.cols.iter().enumerate().filter(|(c, _)| !doomed.contains(c)).map(|(_, &t)| t).collect();
        self.offset -= n;
        self.idx = self.cols.len();
        // Only a speculative rollback (bypass) keeps the window history: the state is then exactly the state a
        // window of `L - n` would have left. A plain trim ends it (as the production ring does).
        self.last_concat = match self.last_concat {
            Some(l) if bypass && n <= l => Some(l - n),
            _ => None,
        };
        Ok(())
    }

    /// The legality half of [`RowModel::trim`].
    pub fn check_trim(&self, n: usize, bypass: bool) -> Result<(), ModelError> {
        if bypass {
            let l = self.last_concat.ok_or(ModelError::BypassNotAfterWindow)?;
            if n > l {
                return Err(ModelError::TrimTooLong);
            }
        } else if !self.is_trimmable() {
            return Err(ModelError::NotTrimmable);
        }
        if n > self.offset || n > self.len() {
            return Err(ModelError::TrimTooLong);
        }
        Ok(())
    }

    /// Rewrites the buffer in temporal order, keeping every live column; `idx = len`. Positions, `offset`,
    /// `last_concat` (the buffer is already temporal when it is `Some`) and `base` are unchanged.
    pub fn relinearize(&mut self) {
        self.cols = self.temporal();
        self.idx = self.cols.len();
    }

    /// R-BROT-5 `extract`: this row as a fresh serial cache: every live column in temporal order,
    /// `offset` kept, `idx = len`, no window history, no pending prefill.
    pub fn extract(&self) -> RowModel {
        RowModel::from_temporal(self.max_size, self.temporal(), self.offset)
    }

    /// Columns whose position `p` a query at position `q` sees: `p <= q` and `q - p < W` (R-C-2), in physical
    /// order.
    pub fn visible_at(&self, q: usize) -> Vec<usize> {
        let w = self.window();
        (0..self.cols.len())
            .filter(|&c| {
                let p = self.cols[c].pos as usize;
                p <= q && q - p < w
            })
            .collect()
    }

    /// Columns the query of the newest position (`offset - 1`) sees; empty when nothing was ever written.
    /// Right after a decode write this is every live column (R-ROT-2: no mask, eviction enforces the window).
    pub fn decode_visible(&self) -> Vec<usize> {
        match self.offset.checked_sub(1) {
            Some(q) => self.visible_at(q),
            None => Vec::new(),
        }
    }

    /// Right after a window write that stored `l` positions in this row: the columns query `i` (position
    /// `offset - l + i`) sees (R-ROT-3). Empty for `i >= l` (a padded query of this row, whose output is
    /// unspecified) or `l > offset`.
    pub fn window_visible(&self, l: usize, i: usize) -> Vec<usize> {
        if i >= l || l > self.offset {
            return Vec::new();
        }
        self.visible_at(self.offset - l + i)
    }

    /// The compatibility quantity `width - (offset - base)` (negative after wraps, as the row-batch reference
    /// implementation's left padding).
    pub fn left_padding(&self, width: usize) -> i64 {
        width as i64 - (self.offset as i64 - self.base as i64)
    }

    /// Checks the invariants every reachable state satisfies: window not 0; `idx <= len <= offset`; the live
    /// positions are exactly `offset - len .. offset`, each once; an oversized buffer (`len > W`) is in temporal
    /// order with `idx = len`; a buffer whose write head is behind its length (`idx < len`) is a full ring
    /// (`len == W`) whose column `idx` holds the oldest position.
    pub fn check(&self) -> Result<(), ModelError> {
        let bad = |what: String| Err(ModelError::InvalidState { what });
        zero_window(self.max_size)?;
        let len = self.len();
        if self.idx > len {
            return bad(format!("idx {} > len {len}", self.idx));
        }
        if len > self.offset {
            return bad(format!("len {len} > offset {}", self.offset));
        }
        let mut pos: Vec<usize> = self.cols.iter().map(|t| t.pos as usize).collect();
        pos.sort_unstable();
        if pos.iter().enumerate().any(|(j, &p)| p != self.offset - len + j) {
            return bad(format!("positions {pos:?} are not {}..{}", self.offset - len, self.offset));
        }
        let sorted = self.temporal_columns().into_iter().enumerate().all(|(j, c)| j == c);
        if len > self.window() && (!sorted || self.idx != len) {
            return bad(format!("oversized buffer (len {len}) not in temporal order with idx = len"));
        }
        if self.idx < len && (Some(len) != self.max_size || self.oldest_column() != Some(self.idx)) {
            return bad(format!("idx {} < len {len}, but not a full ring whose oldest column is idx", self.idx));
        }
        Ok(())
    }

    /// A one-line picture: `W=4 off=9 idx=2 [p8 p5 p6 p7]` (`*` marks the write head column).
    pub fn picture(&self) -> String {
        let mut s = match self.max_size {
            Some(w) => format!("W={w}"),
            None => "W=inf".to_string(),
        };
        let _ = write!(s, " off={} idx={} [", self.offset, self.idx);
        for (c, t) in self.cols.iter().enumerate() {
            if c > 0 {
                s.push(' ');
            }
            if c == self.idx {
                s.push('*');
            }
            let _ = write!(s, "r{}p{}", t.req, t.pos);
        }
        s.push(']');
        if let Some(l) = self.last_concat {
            let _ = write!(s, " concat={l}");
        }
        if let Some(p) = self.pending {
            let _ = write!(s, " pending={p}");
        }
        s
    }
}

/// A visibility matrix in the production `MaskSpec` layout: `visible[(r * queries + i) * cols + c]` says whether
/// query `i` of row `r` sees physical column `c`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Visibility {
    pub rows: usize,
    pub queries: usize,
    pub cols: usize,
    pub visible: Vec<bool>,
}

impl Visibility {
    /// All false.
    pub fn new(rows: usize, queries: usize, cols: usize) -> Self {
        Visibility { rows, queries, cols, visible: vec![false; rows * queries * cols] }
    }

    fn set(&mut self, r: usize, i: usize, c: usize) {
        if r < self.rows && i < self.queries && c < self.cols {
            self.visible[(r * self.queries + i) * self.cols + c] = true;
        }
    }

    /// Whether query `i` of row `r` sees column `c` (false out of range).
    pub fn get(&self, r: usize, i: usize, c: usize) -> bool {
        r < self.rows && i < self.queries && c < self.cols && self.visible[(r * self.queries + i) * self.cols + c]
    }

    /// The columns query `i` of row `r` sees.
    pub fn columns(&self, r: usize, i: usize) -> Vec<usize> {
        (0..self.cols).filter(|&c| self.get(r, i, c)).collect()
    }
}

/// A source of rows for [`BatchModel::join`].
#[derive(Debug, Clone)]
pub enum JoinModelSource<'a> {
    /// These rows of a running batch, in this order.
    Rows(&'a BatchModel, Vec<usize>),
    /// A serial cache (one row).
    Serial(&'a RowModel),
}

/// A row batch: independent serial rows that share a window (R-BROT-*, R-TKV-4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchModel {
    pub max_size: Option<usize>,
    pub rows: Vec<RowModel>,
}

impl BatchModel {
    /// An empty batch; a window of 0 is `InvalidState`.
    pub fn empty(max_size: Option<usize>) -> Result<Self, ModelError> {
        zero_window(max_size)?;
        Ok(BatchModel { max_size, rows: Vec::new() })
    }

    /// R-BROT-4 `merge`: one row per `(temporal slice, offset)`, each in temporal order (`idx = len`,
    /// `base = offset - len`). A slice longer than the window, or not the positions `offset - L .. offset`, is an
    /// error (`BadLengths`, `PositionMismatch`).
    pub fn merge(max_size: Option<usize>, rows: &[(Vec<Tok>, usize)]) -> Result<Self, ModelError> {
        zero_window(max_size)?;
        let mut out = Vec::with_capacity(rows.len());
        for (r, (toks, offset)) in rows.iter().enumerate() {
            if let Some(w) = max_size {
                if toks.len() > w {
                    return Err(ModelError::BadLengths {
                        what: format!("row {r}: a temporal slice of {} positions exceeds the window {w}", toks.len()),
                    });
                }
            }
            out.push(RowModel::try_from_temporal(max_size, toks.clone(), *offset)?);
        }
        Ok(BatchModel { max_size, rows: out })
    }

    /// R-BROT-7 `join`: rows of running batches and serial caches, in order, each keeping its physical columns,
    /// `idx`, `offset` and `last_concat`; its batch history restarts here (`base = offset - len`). Errors:
    /// `WindowMismatch`, `NoSuchRow`, and `PendingPrefill` for a source batch (or serial row) with a pending
    /// prefill. Repeated rows of a source are copied twice.
    pub fn join(max_size: Option<usize>, sources: &[JoinModelSource<'_>]) -> Result<Self, ModelError> {
        zero_window(max_size)?;
        let mut out = Vec::new();
        let mut take = |row: &RowModel| -> Result<(), ModelError> {
            if row.max_size != max_size {
                return Err(ModelError::WindowMismatch { expected: max_size, found: row.max_size });
            }
            if row.pending.is_some() {
                return Err(ModelError::PendingPrefill);
            }
            let mut row = row.clone();
            row.base = row.offset.saturating_sub(row.len());
            out.push(row);
            Ok(())
        };
        for s in sources {
            match s {
                JoinModelSource::Rows(b, which) => {
                    if b.max_size != max_size {
                        return Err(ModelError::WindowMismatch { expected: max_size, found: b.max_size });
                    }
                    for &i in which {
                        take(b.row(i)?)?;
                    }
                }
                JoinModelSource::Serial(r) => take(r)?,
            }
        }
        Ok(BatchModel { max_size, rows: out })
    }

    /// R-BROT-8 `adopt`: rows as given, columns untouched. Every row must share the window and pass
    /// [`RowModel::check`] (`WindowMismatch`, `InvalidState`).
    pub fn adopt(max_size: Option<usize>, rows: Vec<RowModel>) -> Result<Self, ModelError> {
        zero_window(max_size)?;
        for r in &rows {
            if r.max_size != max_size {
                return Err(ModelError::WindowMismatch { expected: max_size, found: r.max_size });
            }
            r.check()?;
        }
        Ok(BatchModel { max_size, rows })
    }

    /// Number of rows.
    pub fn num_rows(&self) -> usize {
        self.rows.len()
    }

    /// Row `i`, or `NoSuchRow`.
    pub fn row(&self, i: usize) -> Result<&RowModel, ModelError> {
        self.rows.get(i).ok_or(ModelError::NoSuchRow { row: i, rows: self.rows.len() })
    }

    /// R-BROT-5 `extract(i)`: row `i` as a fresh serial cache ([`RowModel::extract`]).
    pub fn extract(&self, i: usize) -> Result<RowModel, ModelError> {
        Ok(self.row(i)?.extract())
    }

    /// R-BROT-6 `filter(keep)`: keep these rows, in this order (`NoSuchRow`, `DuplicateRow`; unchanged on error).
    pub fn filter(&mut self, keep: &[usize]) -> Result<(), ModelError> {
        let mut seen = HashSet::new();
        for &i in keep {
            self.row(i)?;
            if !seen.insert(i) {
                return Err(ModelError::DuplicateRow { row: i });
            }
        }
        self.rows = keep.iter().map(|&i| self.rows[i].clone()).collect();
        Ok(())
    }

    /// Whether any row has a pending right-padded prefill.
    pub fn is_pending(&self) -> bool {
        self.rows.iter().any(|r| r.pending.is_some())
    }

    /// Right-padded prefill: row `r` has `lengths[r]` more real positions, delivered by the next window writes.
    /// Errors: `PendingPrefill` (already prepared), `BadLengths` (one length per row).
    pub fn prepare(&mut self, lengths: &[usize]) -> Result<(), ModelError> {
        if self.is_pending() {
            return Err(ModelError::PendingPrefill);
        }
        self.check_count(lengths.len(), "prepare lengths")?;
        for (row, &l) in self.rows.iter_mut().zip(lengths) {
            row.pending = Some(l);
        }
        Ok(())
    }

    /// Ends a right-padded prefill (`NoPendingPrefill` when none is pending). Real positions not yet delivered
    /// are simply never stored.
    pub fn finalize(&mut self) -> Result<(), ModelError> {
        if !self.is_pending() {
            return Err(ModelError::NoPendingPrefill);
        }
        for row in &mut self.rows {
            row.pending = None;
        }
        Ok(())
    }

    fn check_count(&self, n: usize, what: &str) -> Result<(), ModelError> {
        if n != self.rows.len() {
            return Err(ModelError::BadLengths { what: format!("{what}: {n} entries for {} rows", self.rows.len()) });
        }
        Ok(())
    }

    /// R-BROT-2 decode: one token per row (`toks[r]` at row `r`'s next position). Returns the physical column
    /// each row wrote. Errors (batch unchanged): `PendingPrefill`, `BadLengths`, `PositionMismatch`.
    pub fn decode(&mut self, toks: &[Tok]) -> Result<Vec<usize>, ModelError> {
        if self.is_pending() {
            return Err(ModelError::PendingPrefill);
        }
        self.check_count(toks.len(), "decode tokens")?;
        for (row, &t) in self.rows.iter().zip(toks) {
            row.check_decode(t)?;
        }
        Ok(self.rows.iter_mut().zip(toks).map(|(row, &t)| row.decode_write(t)).collect())
    }

    /// Window write of one chunk of `L` positions per row (`toks[r].len() == L` for every row; with a pending
    /// prefill only each row's first `min(remaining, L)` are real, the rest are placeholders never stored).
    /// Returns the number each row stored. Errors (batch unchanged): `BadLengths`, `PositionMismatch`.
    pub fn window(&mut self, toks: &[Vec<Tok>]) -> Result<Vec<usize>, ModelError> {
        self.check_count(toks.len(), "window chunks")?;
        if let Some(first) = toks.first() {
            if let Some(bad) = toks.iter().find(|t| t.len() != first.len()) {
                return Err(ModelError::BadLengths {
                    what: format!("chunks of {} and {} positions in one window", first.len(), bad.len()),
                });
            }
        }
        for (row, t) in self.rows.iter().zip(toks) {
            row.check_window(t)?;
        }
        Ok(self.rows.iter_mut().zip(toks).map(|(row, t)| row.window_write_stored(t)).collect())
    }

    /// Trim `n` from every row ([`RowModel::trim`]); all rows or none. Returns `n`.
    pub fn trim(&mut self, n: usize, bypass: bool) -> Result<usize, ModelError> {
        for row in &self.rows {
            row.check_trim(n, bypass)?;
        }
        for row in &mut self.rows {
            row.trim(n, bypass)?;
        }
        Ok(n)
    }

    /// Trim `n[r]` from row `r` (speculative rollback with per-row accepts); all rows or none.
    pub fn trim_rows(&mut self, n: &[usize], bypass: bool) -> Result<(), ModelError> {
        self.check_count(n.len(), "trim counts")?;
        for (row, &k) in self.rows.iter().zip(n) {
            row.check_trim(k, bypass)?;
        }
        for (row, &k) in self.rows.iter_mut().zip(n) {
            row.trim(k, bypass)?;
        }
        Ok(())
    }

    /// Every row trimmable (true for an empty batch).
    pub fn is_trimmable(&self) -> bool {
        self.rows.iter().all(RowModel::is_trimmable)
    }

    /// The batch's temporal width: `max_r len_r` (0 when empty).
    pub fn width(&self) -> usize {
        self.rows.iter().map(RowModel::len).max().unwrap_or(0)
    }

    /// Per-row [`RowModel::left_padding`] against [`BatchModel::width`].
    pub fn left_padding(&self) -> Vec<i64> {
        let w = self.width();
        self.rows.iter().map(|r| r.left_padding(w)).collect()
    }

    /// R-BROT-3: per-row positions (the next RoPE position of each row).
    pub fn rope_offsets(&self) -> Vec<usize> {
        self.rows.iter().map(|r| r.offset).collect()
    }

    /// The scalar offset: the maximum over rows (0 when empty).
    pub fn offset(&self) -> usize {
        self.rows.iter().map(|r| r.offset).max().unwrap_or(0)
    }

    /// The decode read's visibility, in the production mask layout (see [`Visibility`]): row `r`'s query sees
    /// [`RowModel::decode_visible`] (every live column right after a decode write: `c < len_r`).
    pub fn decode_visibility(&self) -> Visibility {
        let mut v = Visibility::new(self.rows.len(), 1, self.width());
        for (r, row) in self.rows.iter().enumerate() {
            for c in row.decode_visible() {
                v.set(r, 0, c);
            }
        }
        v
    }

    /// The visibility of the read right after a window write of `l` positions per row in which row `r` stored
    /// `stored[r]` (the values [`BatchModel::window`] returned): real query `i < stored[r]` sees
    /// [`RowModel::window_visible`]; a padded query (`i >= stored[r]`) sees column 0 only, as ARCHITECTURE.md
    /// specifies (its output is unspecified: compare only real queries). `BadLengths` for a wrong count or a
    /// `stored[r] > l`.
    pub fn window_visibility(&self, l: usize, stored: &[usize]) -> Result<Visibility, ModelError> {
        self.check_count(stored.len(), "stored counts")?;
        if let Some(&bad) = stored.iter().find(|&&m| m > l) {
            return Err(ModelError::BadLengths { what: format!("{bad} stored positions in a chunk of {l}") });
        }
        let mut v = Visibility::new(self.rows.len(), l, self.width());
        for (r, (row, &m)) in self.rows.iter().zip(stored).enumerate() {
            for i in 0..l {
                if i < m {
                    for c in row.window_visible(m, i) {
                        v.set(r, i, c);
                    }
                } else if v.cols > 0 {
                    v.set(r, i, 0);
                }
            }
        }
        Ok(v)
    }

    /// [`RowModel::check`] for every row, plus the shared window.
    pub fn check(&self) -> Result<(), ModelError> {
        zero_window(self.max_size)?;
        for r in &self.rows {
            if r.max_size != self.max_size {
                return Err(ModelError::WindowMismatch { expected: self.max_size, found: r.max_size });
            }
            r.check()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests;
