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
mod tests {
    use super::*;
    use proptest::prelude::*;

    const R: u32 = 0;

    fn t(pos: u32) -> Tok {
        Tok::new(R, pos)
    }

    fn positions(toks: &[Tok]) -> Vec<u32> {
        toks.iter().map(|t| t.pos).collect()
    }

    fn decode(m: &mut RowModel) -> usize {
        let p = m.offset as u32;
        m.try_decode_write(t(p)).unwrap()
    }

    fn window(m: &mut RowModel, l: u32) -> usize {
        let p = m.offset as u32;
        let toks: Vec<Tok> = (p..p + l).map(t).collect();
        m.try_window_write(&toks).unwrap()
    }

    // ---- R-ROT-2: the ring rotates; idx = written column + 1 ----
    #[test]
    fn decode_fills_then_rotates() {
        let mut m = RowModel::new(Some(3));
        let cols: Vec<usize> = (0..8).map(|_| decode(&mut m)).collect();
        assert_eq!(cols, vec![0, 1, 2, 0, 1, 2, 0, 1]);
        assert_eq!(positions(&m.cols), vec![6, 7, 5]);
        assert_eq!(m.idx, 2);
        assert_eq!(m.offset, 8);
        assert_eq!(positions(&m.temporal()), vec![5, 6, 7]);
        assert!(m.decode_phase_is_ring());
        m.check().unwrap();
    }

    #[test]
    fn linear_cache_appends_forever() {
        let mut m = RowModel::new(None);
        for i in 0..20 {
            assert_eq!(decode(&mut m), i);
            assert!(!m.decode_phase_is_ring());
        }
        window(&mut m, 5);
        assert_eq!(m.len(), 25);
        assert_eq!(m.decode_visible().len(), 25);
        assert_eq!(m.window_visible(5, 0).len(), 21);
        m.check().unwrap();
    }

    // ---- R-ROT-3 / bug catalog F: the plateau W - 1 + L ----
    #[test]
    fn window_writes_plateau_at_w_minus_1_plus_l() {
        let mut m = RowModel::new(Some(4));
        for _ in 0..6 {
            window(&mut m, 3);
            assert!(m.len() <= 4 - 1 + 3);
            m.check().unwrap();
        }
        assert_eq!(m.len(), 6, "plateau W - 1 + L");
        assert_eq!(m.idx, 6);
        assert_eq!(m.last_concat, Some(3));
        assert_eq!(positions(&m.cols), (12..18).collect::<Vec<_>>(), "temporal order after a window write");
        // A one-position window also concatenates (the read picks the path).
        window(&mut m, 1);
        assert_eq!(positions(&m.cols), vec![15, 16, 17, 18]);
        assert_eq!(m.last_concat, Some(1));
    }

    // ---- R-ROT-2 step 1: decode after a window cuts back to W and writes column 0 ----
    #[test]
    fn decode_after_window_trims_to_w_and_writes_column_0() {
        let mut m = RowModel::new(Some(4));
        window(&mut m, 7);
        assert_eq!(m.len(), 7);
        assert!(m.decode_phase_is_ring());
        assert_eq!(decode(&mut m), 0);
        assert_eq!(positions(&m.cols), vec![7, 4, 5, 6]);
        assert_eq!(m.idx, 1);
        assert_eq!(m.last_concat, None);
        assert_eq!(decode(&mut m), 1);
        assert_eq!(positions(&m.cols), vec![7, 8, 5, 6]);
        m.check().unwrap();
        // Window write of a rotated ring: temporal order [idx, len) ++ [0, idx), keep newest W - 1.
        window(&mut m, 2);
        assert_eq!(positions(&m.cols), vec![6, 7, 8, 9, 10]);
        // A window write that lands exactly at W: the next decode overwrites column 0.
        let mut m = RowModel::new(Some(4));
        window(&mut m, 4);
        assert_eq!(decode(&mut m), 0);
        assert_eq!(positions(&m.cols), vec![4, 1, 2, 3]);
    }

    // ---- R-ROT-4: temporal_view is the tail ----
    #[test]
    fn temporal_view_is_the_tail_never_the_head() {
        let mut m = RowModel::new(Some(4));
        window(&mut m, 3);
        window(&mut m, 3);
        assert_eq!(positions(&m.cols), vec![0, 1, 2, 3, 4, 5]);
        assert_eq!(positions(&m.temporal_view()), vec![2, 3, 4, 5], "the newest W positions");
        let mut short = RowModel::new(Some(8));
        window(&mut short, 3);
        assert_eq!(positions(&short.temporal_view()), vec![0, 1, 2]);
    }

    // ---- R-C-2: visibility by position ----
    #[test]
    fn window_visibility_is_causal_and_windowed() {
        let mut m = RowModel::new(Some(4));
        for _ in 0..5 {
            decode(&mut m);
        }
        window(&mut m, 3); // keeps 3 of [1..5), appends 5, 6, 7
        assert_eq!(positions(&m.cols), vec![2, 3, 4, 5, 6, 7]);
        let vis = |i| m.window_visible(3, i).iter().map(|&c| m.cols[c].pos).collect::<Vec<_>>();
        assert_eq!(vis(0), vec![2, 3, 4, 5]);
        assert_eq!(vis(1), vec![3, 4, 5, 6]);
        assert_eq!(vis(2), vec![4, 5, 6, 7]);
        assert!(m.window_visible(3, 3).is_empty(), "no such query");
        assert_eq!(m.decode_visible(), vec![2, 3, 4, 5], "columns of positions 4..=7");
    }

    // ---- R-C-5 / R-ROT-6: trim legality ----
    #[test]
    fn trim_rules() {
        let mut m = RowModel::new(Some(4));
        window(&mut m, 3);
        assert!(m.is_trimmable());
        assert_eq!(m.trim(4, false), Err(ModelError::TrimTooLong));
        m.trim(2, false).unwrap();
        assert_eq!((m.offset, m.len(), m.idx), (1, 1, 1));
        assert_eq!(m.last_concat, None, "a plain trim ends the window history (only a bypass rollback keeps it)");
        decode(&mut m);
        assert_eq!(m.trim(1, true), Err(ModelError::BypassNotAfterWindow), "bypass needs a window last");
        for _ in 0..3 {
            decode(&mut m);
        }
        assert_eq!(m.offset, 5);
        assert!(!m.is_trimmable());
        assert_eq!(m.trim(1, false), Err(ModelError::NotTrimmable), "wrapped: R-ROT-6");
        assert_eq!(m.trim(0, false), Err(ModelError::NotTrimmable));
        // Speculative rollback after a window, even on a wrapped ring.
        window(&mut m, 3);
        let before = m.clone();
        assert_eq!(m.trim(4, true), Err(ModelError::TrimTooLong));
        assert_eq!(m, before, "unchanged on error");
        m.trim(2, true).unwrap();
        assert_eq!(positions(&m.cols), vec![2, 3, 4, 5]);
        assert_eq!((m.offset, m.idx, m.last_concat), (6, 4, Some(1)));
        m.check().unwrap();
        // Linear caches are always trimmable.
        let mut lin = RowModel::new(None);
        window(&mut lin, 10);
        decode(&mut lin);
        lin.trim(6, false).unwrap();
        assert_eq!(lin.offset, 5);
        assert_eq!(lin.last_concat, None);
        assert_eq!(lin.trim(6, false), Err(ModelError::TrimTooLong));
        // A short temporal slice: n is bounded by len as well as offset.
        let mut short = RowModel::try_from_temporal(Some(8), vec![t(5), t(6)], 7).unwrap();
        assert_eq!(short.trim(3, false), Err(ModelError::TrimTooLong));
        short.trim(2, false).unwrap();
        assert_eq!(short.offset, 5);
    }

    /// Found by `temporal_view_is_the_newest_positions`: a bypass trim of all L positions of a window that had
    /// cut the history to W - 1 (R-ROT-3) leaves W - 1 positions, one short of min(offset, W). Reads stay right
    /// (the next write needs only the newest W - 1 as history), but `temporal_view` then holds W - 1 positions:
    /// a view sliced as "the last min(offset, W) columns" would underflow.
    #[test]
    fn full_rollback_leaves_w_minus_1_positions() {
        let mut m = RowModel::new(Some(3));
        for _ in 0..4 {
            decode(&mut m);
        }
        window(&mut m, 2);
        assert_eq!(positions(&m.cols), vec![2, 3, 4, 5]);
        m.trim(2, true).unwrap();
        assert_eq!(positions(&m.cols), vec![2, 3]);
        assert_eq!((m.offset, m.idx, m.last_concat), (4, 2, Some(0)));
        assert_eq!(positions(&m.temporal_view()), vec![2, 3], "W - 1 positions, not min(offset, W) = 3");
        let x = m.extract();
        assert_eq!(x.len(), 2);
        // The next decode appends and sees exactly the window again.
        let c = decode(&mut m);
        assert_eq!(c, 2);
        assert_eq!(m.decode_visible().len(), 3);
        assert_eq!(positions(&m.temporal_view()), vec![2, 3, 4]);
    }

    #[test]
    fn relinearize_keeps_positions_and_restores_temporal_order() {
        let mut m = RowModel::new(Some(3));
        for _ in 0..5 {
            decode(&mut m);
        }
        assert_eq!(positions(&m.cols), vec![3, 4, 2]);
        m.relinearize();
        assert_eq!(positions(&m.cols), vec![2, 3, 4]);
        assert_eq!(m.idx, 3);
        assert_eq!(decode(&mut m), 0);
        m.check().unwrap();
    }

    #[test]
    fn checked_writes_reject_bad_positions_and_pending() {
        let mut m = RowModel::new(Some(4));
        assert_eq!(m.try_decode_write(t(1)), Err(ModelError::PositionMismatch { expected: 0, found: 1 }));
        assert_eq!(m.try_window_write(&[t(0), t(2)]), Err(ModelError::PositionMismatch { expected: 1, found: 2 }));
        assert_eq!(m, RowModel::new(Some(4)));
        m.pending = Some(1);
        assert_eq!(m.try_decode_write(t(0)), Err(ModelError::PendingPrefill));
        assert!(RowModel::try_new(Some(0)).is_err());
        assert!(RowModel::try_from_temporal(Some(4), vec![t(1), t(2)], 2).is_err());
        assert!(RowModel::try_from_temporal(Some(4), vec![t(0), t(2)], 3).is_err());
        // W = 0 through the unchecked path never panics.
        let mut z = RowModel::new(Some(0));
        z.decode_write(t(0));
        z.window_write(&[t(1)]);
        let _ = z.trim(1, true);
        let _ = z.temporal_view();
        assert!(z.check().is_err());
    }

    // ---- batch: prepare / finalize (right-padded prefill) ----
    #[test]
    fn right_padded_prefill_stores_only_real_positions() {
        let mut b = BatchModel::merge(Some(4), &[(vec![], 0), (vec![Tok::new(1, 0), Tok::new(1, 1)], 2)]).unwrap();
        assert_eq!(b.left_padding(), vec![2, 0]);
        b.prepare(&[5, 1]).unwrap();
        assert_eq!(b.prepare(&[1, 1]), Err(ModelError::PendingPrefill));
        assert_eq!(b.decode(&[Tok::new(0, 0), Tok::new(1, 2)]), Err(ModelError::PendingPrefill));
        let chunk = |o0: u32, o1: u32| {
            vec![
                (o0..o0 + 3).map(|p| Tok::new(0, p)).collect::<Vec<_>>(),
                (o1..o1 + 3).map(|p| Tok::new(1, p)).collect(),
            ]
        };
        assert_eq!(b.window(&chunk(0, 2)).unwrap(), vec![3, 1]);
        assert_eq!(b.rows[1].pending, Some(0));
        let row1 = b.rows[1].clone();
        assert_eq!(b.window(&chunk(3, 3)).unwrap(), vec![2, 0]);
        assert_eq!(b.rows[1], row1, "a chunk with no real position leaves the row untouched");
        assert_eq!(positions(&b.rows[0].cols), vec![0, 1, 2, 3, 4], "3 kept (W - 1) + 2 real");
        assert_eq!(b.rows[0].last_concat, Some(2));
        b.finalize().unwrap();
        assert_eq!(b.finalize(), Err(ModelError::NoPendingPrefill));
        assert_eq!(b.decode(&[Tok::new(0, 5), Tok::new(1, 3)]).unwrap(), vec![0, 3]);
        b.check().unwrap();
        assert_eq!(b.rope_offsets(), vec![6, 4]);
        assert_eq!(b.offset(), 6);
        assert!(b.window(&[vec![Tok::new(0, 6)], vec![]]).is_err(), "ragged chunk");
        assert!(b.decode(&[Tok::new(0, 6)]).is_err(), "one token per row");
    }

    #[test]
    fn batch_visibility_in_mask_layout() {
        let mut b = BatchModel::merge(Some(3), &[(vec![], 0), (vec![Tok::new(1, 0), Tok::new(1, 1)], 2)]).unwrap();
        b.prepare(&[2, 1]).unwrap();
        let stored = b.window(&[vec![Tok::new(0, 0), Tok::new(0, 1)], vec![Tok::new(1, 2), Tok::new(1, 99)]]).unwrap();
        assert_eq!(stored, vec![2, 1]);
        b.finalize().unwrap();
        let v = b.window_visibility(2, &stored).unwrap();
        assert_eq!((v.rows, v.queries, v.cols), (2, 2, 3));
        assert_eq!(v.columns(0, 0), vec![0]);
        assert_eq!(v.columns(0, 1), vec![0, 1]);
        assert_eq!(v.columns(1, 0), vec![0, 1, 2], "positions 0, 1, 2 within W = 3 of query 2");
        assert_eq!(v.columns(1, 1), vec![0], "a padded query sees column 0 only");
        assert!(b.window_visibility(1, &stored).is_err());
        b.decode(&[Tok::new(0, 2), Tok::new(1, 3)]).unwrap();
        let d = b.decode_visibility();
        assert_eq!(d.columns(0, 0), vec![0, 1, 2]);
        assert_eq!(d.columns(1, 0), vec![0, 1, 2]);
        assert_eq!(b.rows[1].cols[0], Tok::new(1, 3), "row 1 rotated onto its oldest column");
    }

    #[test]
    fn batch_membership_rules() {
        let mut b = BatchModel::merge(None, &[(vec![t(0)], 1), (vec![t(0), t(1)], 2), (vec![], 0)]).unwrap();
        assert_eq!(b.filter(&[0, 3]), Err(ModelError::NoSuchRow { row: 3, rows: 3 }));
        assert_eq!(b.filter(&[1, 1]), Err(ModelError::DuplicateRow { row: 1 }));
        b.filter(&[2, 0]).unwrap();
        assert_eq!(b.rope_offsets(), vec![0, 1]);
        assert_eq!(
            BatchModel::merge(Some(1), &[(vec![t(0), t(1)], 2)]).map(|_| ()),
            Err(ModelError::BadLengths { what: "row 0: a temporal slice of 2 positions exceeds the window 1".into() })
        );
        let ring = BatchModel::empty(Some(4)).unwrap();
        let serial = RowModel::new(None);
        assert_eq!(
            BatchModel::join(Some(4), &[JoinModelSource::Rows(&ring, vec![]), JoinModelSource::Serial(&serial)]),
            Err(ModelError::WindowMismatch { expected: Some(4), found: None })
        );
        assert!(matches!(
            BatchModel::join(None, &[JoinModelSource::Rows(&b, vec![5])]),
            Err(ModelError::NoSuchRow { .. })
        ));
        assert_eq!(b.extract(9), Err(ModelError::NoSuchRow { row: 9, rows: 2 }));
        let mut bad = RowModel::new(None);
        bad.idx = 3;
        assert!(matches!(BatchModel::adopt(None, vec![bad]), Err(ModelError::InvalidState { .. })));
    }

    // ---- R-BROT-7: join keeps every row's physical columns and phase ----
    #[test]
    fn join_keeps_physical_columns_and_phase() {
        let mut solo = RowModel::new(Some(3));
        for _ in 0..5 {
            decode(&mut solo);
        }
        let b = BatchModel::merge(Some(3), &[(vec![Tok::new(1, 0)], 1)]).unwrap();
        let j =
            BatchModel::join(Some(3), &[JoinModelSource::Rows(&b, vec![0]), JoinModelSource::Serial(&solo)]).unwrap();
        assert_eq!(j.rows[1].cols, solo.cols);
        assert_eq!(j.rows[1].idx, solo.idx);
        assert_eq!(j.left_padding(), vec![2, 0]);
        let mut j2 = j.clone();
        let mut s2 = solo.clone();
        j2.decode(&[Tok::new(1, 1), t(5)]).unwrap();
        decode(&mut s2);
        assert_eq!(j2.rows[1].cols, s2.cols, "the row stays bit-for-bit its serial twin");
        assert_eq!(j2.left_padding(), vec![1, -1], "negative after a wrap");
    }

    #[test]
    fn batch_trim_is_all_or_nothing() {
        let mut b = BatchModel::merge(Some(4), &[(vec![t(0)], 1), (vec![t(0), t(1), t(2)], 3)]).unwrap();
        let before = b.clone();
        assert_eq!(b.trim(2, false), Err(ModelError::TrimTooLong));
        assert_eq!(b, before);
        assert_eq!(b.trim_rows(&[1, 3], false), Ok(()));
        assert_eq!(b.rope_offsets(), vec![0, 0]);
        assert!(b.trim_rows(&[1], false).is_err());
        assert!(b.is_trimmable());
    }

    #[test]
    fn picture_is_readable() {
        let mut m = RowModel::new(Some(3));
        for _ in 0..4 {
            decode(&mut m);
        }
        assert_eq!(m.picture(), "W=3 off=4 idx=1 [r0p3 *r0p1 r0p2]");
    }

    // ---- Differential check against a literal transcription of ARCHITECTURE.md (idx arithmetic) ----

    /// The serial core exactly as ARCHITECTURE.md words it, with columns as positions.
    #[derive(Debug, Clone)]
    struct SpecRing {
        w: Option<usize>,
        cols: Vec<u32>,
        offset: usize,
        idx: usize,
        last_concat: Option<usize>,
    }

    impl SpecRing {
        fn decode(&mut self, pos: u32) -> usize {
            if let Some(w) = self.w {
                if self.cols.len() > w {
                    self.cols.drain(..self.cols.len() - w);
                    self.idx = w;
                }
                if self.idx == w {
                    self.idx = 0;
                }
            }
            let c = self.idx;
            if c == self.cols.len() {
                self.cols.push(pos);
            } else {
                self.cols[c] = pos;
            }
            self.idx += 1;
            self.offset += 1;
            self.last_concat = None;
            c
        }
        fn window(&mut self, pos: &[u32]) {
            let len = self.cols.len();
            let mut t: Vec<u32> = if self.idx < len {
                self.cols[self.idx..].iter().chain(&self.cols[..self.idx]).copied().collect()
            } else {
                self.cols.clone()
            };
            let keep = self.w.map_or(len, |w| len.min(w - 1));
            t.drain(..len - keep);
            t.extend_from_slice(pos);
            self.cols = t;
            self.idx = self.cols.len();
            self.offset += pos.len();
            self.last_concat = Some(pos.len());
        }
        /// Temporal order `[idx, len) ++ [0, idx)` when rotated, else `[0, len)`; then `idx = len`.
        fn relinearize(&mut self) {
            if self.idx < self.cols.len() {
                self.cols.rotate_left(self.idx);
            }
            self.idx = self.cols.len();
        }
        fn trim(&mut self, n: usize) {
            let len = self.cols.len() - n;
            self.cols.truncate(len);
            self.offset -= n;
            self.idx = len;
        }
    }

    #[derive(Debug, Clone)]
    enum Op {
        Decode,
        Window(u32),
        Trim(usize, bool),
        Relinearize,
        Extract,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => Just(Op::Decode),
            3 => (1u32..7).prop_map(Op::Window),
            2 => (0usize..5, any::<bool>()).prop_map(|(n, b)| Op::Trim(n, b)),
            1 => Just(Op::Relinearize),
            1 => Just(Op::Extract),
        ]
    }

    fn window_size() -> impl Strategy<Value = Option<usize>> {
        prop_oneof![4 => (1usize..9).prop_map(Some), 1 => Just(None)]
    }

    /// Applies `op` to the model (checked API), returning the stored window length when it was a window write.
    fn apply(m: &mut RowModel, op: &Op) -> Option<usize> {
        match *op {
            Op::Decode => {
                decode(m);
                None
            }
            Op::Window(l) => Some(window(m, l)),
            Op::Trim(n, b) => {
                let _ = m.trim(n, b);
                None
            }
            Op::Relinearize => {
                m.relinearize();
                None
            }
            Op::Extract => {
                *m = m.extract();
                None
            }
        }
    }

    fn w_or_inf(m: &RowModel) -> usize {
        m.max_size.unwrap_or(usize::MAX)
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

        /// The model agrees with the literal idx-arithmetic reading of the serial core on every field and column.
        #[test]
        fn model_matches_the_architecture_transcription(w in window_size(), ops in prop::collection::vec(op(), 0..60)) {
            let mut m = RowModel::new(w);
            let mut s = SpecRing { w, cols: vec![], offset: 0, idx: 0, last_concat: None };
            for o in &ops {
                match *o {
                    Op::Decode => {
                        let p = m.offset as u32;
                        prop_assert_eq!(m.decode_write(t(p)), s.decode(p));
                    }
                    Op::Window(l) => {
                        let p = m.offset as u32;
                        window(&mut m, l);
                        s.window(&(p..p + l).collect::<Vec<_>>());
                    }
                    Op::Trim(n, b) => {
                        let ok = m.trim(n, b).is_ok();
                        let legal = if b { matches!(s.last_concat, Some(l) if n <= l) }
                                    else { s.w.is_none_or(|w| s.offset < w) && n <= s.offset };
                        prop_assert_eq!(ok, legal);
                        if legal { s.trim(n); s.last_concat = if b { s.last_concat.filter(|&l| n <= l).map(|l| l - n) } else { None }; }
                    }
                    Op::Relinearize => {
                        apply(&mut m, o);
                        s.relinearize();
                    }
                    Op::Extract => {
                        apply(&mut m, o);
                        s.relinearize();
                        s.last_concat = None;
                    }
                }
                prop_assert_eq!(positions(&m.cols), s.cols.clone(), "{}", m.picture());
                prop_assert_eq!((m.offset, m.idx, m.last_concat), (s.offset, s.idx, s.last_concat));
                prop_assert!(m.check().is_ok(), "{:?} {}", m.check(), m.picture());
            }
        }

        /// R-ROT-4: temporal_view is always the newest min(offset, W) positions, in order: the tail. The one
        /// exception is a full speculative rollback (bypass trim of all L of a window that had cut the history
        /// to W - 1): until the next write the row holds W - 1 positions and the view is their tail (see
        /// `full_rollback_leaves_w_minus_1_positions`).
        #[test]
        fn temporal_view_is_the_newest_positions(w in window_size(), ops in prop::collection::vec(op(), 0..60)) {
            let mut m = RowModel::new(w);
            let mut full_rollback = false;
            for o in &ops {
                let before = m.clone();
                apply(&mut m, o);
                match o {
                    Op::Decode | Op::Window(_) => full_rollback = false,
                    Op::Trim(_, true) if m != before && m.last_concat == Some(0) => full_rollback = true,
                    _ => {}
                }
                let full = m.offset.min(w_or_inf(&m));
                let view = m.temporal_view();
                if full_rollback {
                    prop_assert!(view.len() + 1 >= full, "{}", m.picture());
                } else {
                    prop_assert_eq!(view.len(), full, "{}", m.picture());
                }
                let want: Vec<u32> = ((m.offset - view.len()) as u32..m.offset as u32).collect();
                prop_assert_eq!(positions(&view), want);
            }
        }

        /// R-ROT-2 / R-C-2: every decode query sees exactly min(offset, W) keys, which are all live columns.
        #[test]
        fn decode_sees_min_offset_w(w in window_size(), ops in prop::collection::vec(op(), 0..60)) {
            let mut m = RowModel::new(w);
            for o in &ops {
                apply(&mut m, o);
                if matches!(o, Op::Decode) {
                    let vis = m.decode_visible();
                    prop_assert_eq!(vis.len(), m.offset.min(w_or_inf(&m)));
                    prop_assert_eq!(vis, (0..m.len()).collect::<Vec<_>>(), "no mask: eviction enforces the window");
                }
            }
        }

        /// R-ROT-3 / R-C-2: window query i (position q) sees min(q + 1, W) keys: exactly positions q-W+1 ..= q.
        #[test]
        fn window_query_sees_its_window(w in window_size(), ops in prop::collection::vec(op(), 0..40), l in 1u32..8) {
            let mut m = RowModel::new(w);
            for o in &ops { apply(&mut m, o); }
            let l = window(&mut m, l);
            for i in 0..l {
                let q = m.offset - l + i;
                let vis = m.window_visible(l, i);
                let n = (q + 1).min(w_or_inf(&m));
                prop_assert_eq!(vis.len(), n);
                let mut got: Vec<u32> = vis.iter().map(|&c| m.cols[c].pos).collect();
                got.sort_unstable();
                prop_assert_eq!(got, ((q + 1 - n) as u32..=q as u32).collect::<Vec<_>>());
            }
        }

        /// R-BROT-4/5: from_temporal keeps the temporal order; extract after merge is the identity per row.
        #[test]
        fn extract_after_merge_is_identity(rows in prop::collection::vec(prop::collection::vec(op(), 0..40), 1..4), w in 1usize..9) {
            let mut solos = Vec::new();
            for ops in &rows {
                let mut m = RowModel::new(Some(w));
                for o in ops { apply(&mut m, o); }
                let again = RowModel::from_temporal(m.max_size, m.temporal(), m.offset);
                prop_assert_eq!(again.temporal(), m.temporal());
                prop_assert_eq!(again.temporal_view(), m.temporal_view());
                solos.push(m);
            }
            let slices: Vec<(Vec<Tok>, usize)> = solos.iter().map(|m| (m.temporal_view(), m.offset)).collect();
            let b = BatchModel::merge(Some(w), &slices).unwrap();
            b.check().unwrap();
            for (i, m) in solos.iter().enumerate() {
                let x = b.extract(i).unwrap();
                prop_assert_eq!(x.temporal(), m.temporal_view());
                prop_assert_eq!(x.temporal_view(), m.temporal_view());
                prop_assert_eq!(x.offset, m.offset);
                prop_assert_eq!(x.idx, x.len());
            }
        }

        /// R-C-5: a bypass trim of n after a window of L leaves exactly the state of a window of L - n.
        #[test]
        fn bypass_trim_equals_shorter_window(w in window_size(), ops in prop::collection::vec(op(), 0..40), l in 1u32..8, n in 0u32..8) {
            let n = n.min(l);
            let mut m = RowModel::new(w);
            for o in &ops { apply(&mut m, o); }
            let mut short = m.clone();
            window(&mut m, l);
            m.trim(n as usize, true).unwrap();
            let p = short.offset as u32;
            short.try_window_write(&(p..p + l - n).map(t).collect::<Vec<_>>()).unwrap();
            prop_assert_eq!(m, short);
        }

        /// Rows of a batch are independent serial rings: a batch decode/window equals each row's serial op.
        #[test]
        fn batch_rows_equal_serial_twins(w in window_size(), steps in prop::collection::vec((any::<bool>(), 1u32..5), 0..40)) {
            let mut b = BatchModel::merge(w, &[(vec![], 0), (vec![Tok::new(1, 0)], 1)]).unwrap();
            let mut twins = [RowModel::new(w), RowModel::from_temporal(w, vec![Tok::new(1, 0)], 1)];
            for (dec, l) in steps {
                if dec {
                    let toks: Vec<Tok> = b.rows.iter().enumerate().map(|(r, m)| Tok::new(r as u32, m.offset as u32)).collect();
                    let cols = b.decode(&toks).unwrap();
                    for (r, tw) in twins.iter_mut().enumerate() { prop_assert_eq!(tw.try_decode_write(toks[r]).unwrap(), cols[r]); }
                } else {
                    let toks: Vec<Vec<Tok>> = b.rows.iter().enumerate().map(|(r, m)| (m.offset as u32..m.offset as u32 + l).map(|p| Tok::new(r as u32, p)).collect()).collect();
                    b.window(&toks).unwrap();
                    for (r, tw) in twins.iter_mut().enumerate() { tw.try_window_write(&toks[r]).unwrap(); }
                }
                for (r, tw) in twins.iter().enumerate() {
                    prop_assert_eq!(&b.rows[r].cols, &tw.cols);
                    prop_assert_eq!(b.rows[r].idx, tw.idx);
                }
            }
        }
    }
}
