//! One thread's memo of a pure function: the owner of how the reference model keeps what it computed
//! ([`ValueSpace::column`](crate::values::ValueSpace::column), the quantized columns of [`crate::quant`]).
//!
//! Guarantees: an answer from the memo equals the fresh computation; debug builds recompute every 16th hit and
//! assert it. The memo holds at most [`MEMO_LIMIT`] entries (then it starts over), so a long run's memory stays
//! bounded.

use std::cell::{Cell, RefCell};
use std::fmt::Debug;
use std::hash::Hash;

/// Entries one memo holds before it starts over.
pub const MEMO_LIMIT: usize = 1 << 16;

/// A per-thread memo (it lives in a `thread_local!`), keyed by everything its function's answer depends on.
pub(crate) struct Memo<K, V> {
    map: RefCell<rustc_hash::FxHashMap<K, V>>,
    hits: Cell<u64>,
}

impl<K, V> Default for Memo<K, V> {
    fn default() -> Self {
        Memo { map: RefCell::default(), hits: Cell::new(0) }
    }
}

impl<K: Hash + Eq + Copy + Debug, V: Clone + PartialEq + Debug> Memo<K, V> {
    /// The answer for `key`: from the memo, or `fresh()` (then kept). `fresh` may use other memos, never this one.
    pub(crate) fn get_or(&self, key: K, fresh: impl Fn() -> V) -> V {
        let hit = self.map.borrow().get(&key).cloned();
        if let Some(v) = hit {
            if cfg!(debug_assertions) && self.hits.replace(self.hits.get().wrapping_add(1)).is_multiple_of(16) {
                assert_eq!(v, fresh(), "memoized answer for {key:?}");
            }
            return v;
        }
        let v = fresh();
        let mut m = self.map.borrow_mut();
        if m.len() >= MEMO_LIMIT {
            m.clear();
        }
        m.insert(key, v.clone());
        v
    }
}
