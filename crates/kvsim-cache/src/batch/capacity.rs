//! The capacity guarantee of a [`RowBatch`] (its type docs, "Capacity"): the bound its buffers keep to, the bytes
//! its arrays hold, and the cut that releases columns no live row needs.

use super::RowBatch;
use crate::ring::{Buf, GROW_STEP};
use crate::util::index_array;
use crate::Result;

/// The columns a batch whose live rows hold `lens` columns may keep (0 without rows): `max(W, longest len)` for
/// rings (a ring row holds more than `W` columns only while a multi-token write's window is in flight, at most
/// `W - 1 + L` after a window of `L` positions, until its next decode step drops the oversize), the longest len plus
/// `GROW_STEP - 1` for linear rows (a decode grows the buffer by whole steps of [`GROW_STEP`] columns).
pub(crate) fn capacity_bound(lens: impl IntoIterator<Item = usize>, max_size: Option<usize>) -> usize {
    let longest = lens.into_iter().fold(None, |m: Option<usize>, l| Some(m.map_or(l, |m| m.max(l))));
    match (longest, max_size) {
        (None, _) => 0,
        (Some(l), Some(w)) => w.max(l),
        (Some(l), None) => l + GROW_STEP - 1,
    }
}

impl RowBatch {
    /// The most columns the buffers may hold now ([`RowBatch`], "Capacity"): computed from the live rows alone,
    /// `max(W, max_r len_r)` for rings, `max_r len_r + GROW_STEP - 1` for linear rows, 0 without rows. After every
    /// operation [`RowBatch::cap`] `<=` this.
    pub fn capacity_bound(&self) -> usize {
        capacity_bound(self.rows.iter().map(|r| r.ring.len), self.max_size)
    }

    /// The bytes the batch's arrays hold: the sum of every plane's `nbytes` (0 without a buffer). Equal to
    /// `rows() * cap() * bytes_per_token()`, so at most `rows() * capacity_bound() * bytes_per_token()`.
    pub fn held_bytes(&self) -> usize {
        self.buf.as_ref().map_or(0, |b| b.planes.iter().map(|p| p.nbytes()).sum())
    }

    /// The buffer cut to the capacity bound of rows whose live columns will be `lens` (every row keeps its columns
    /// `[0, len_r)`, which lie below the bound), or `None` when it is within the bound already. One gather into
    /// fresh arrays, so the cut columns are released rather than kept alive under a view.
    pub(super) fn compacted(&self, lens: impl IntoIterator<Item = usize>) -> Result<Option<Buf>> {
        let bound = capacity_bound(lens, self.max_size);
        match &self.buf {
            Some(b) if bound > 0 && b.cap() > bound => {
                let at = index_array(&(0..bound).collect::<Vec<_>>(), &[bound])?;
                let nb = b.map(|p| Ok(p.take_axis(&at, 2)?))?;
                nb.eval()?;
                Ok(Some(nb))
            }
            _ => Ok(None),
        }
    }
}
