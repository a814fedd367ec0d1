//! The scheduler's picture of one run, held once: which requests live, which of them run in the batch and in
//! which row order, and the next id a request may take. The run loop ([`crate::sim::runner::World`]) owns the one
//! [`Roster`]; every layout family reads it (through [`crate::sim::family::Cx`]) and keeps only what it proves: its
//! layouts, twins and models of those requests.
//!
//! The roster alone decides what a lifecycle op (`Admit`, `Merge`, `Join`, `BatchPrefill`, `Extract`, `Filter`)
//! does to the membership, before any family sees the op: [`Roster::resolve`] either skips it (its references do
//! not exist) or names the [`Change`], which the run loop commits and then hands every family to carry out on its
//! layouts. Every other op leaves the roster as it is.

use std::collections::BTreeMap;

use crate::sim::ops::Op;

/// Where a request's storage lives.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Home {
    /// Outside the batch: its own serial caches (prefill, or continued after extract).
    Solo,
    /// A row of the running batch.
    Batch,
}

/// What the op generator may look at: the roster, with the position of every request outside the batch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct View {
    /// Requests outside the batch: (id, offset, width of the last window write if it was the last mutation).
    pub solo: Vec<(u32, usize, Option<usize>)>,
    /// Requests of the batch rows, in row order.
    pub rows: Vec<u32>,
    pub next_id: u32,
    pub live: usize,
}

/// What a lifecycle op does to the roster (indices are the running rows' before the op).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Change {
    /// `Admit`: a new request outside the batch.
    Admit { req: u32 },
    /// `Merge` (`perm` the identity) or `Join`: the running rows reordered (new row `i` is old row `perm[i]`),
    /// then the requests `ids`, outside the batch until now, appended in that order.
    Enter { ids: Vec<u32>, perm: Vec<usize> },
    /// `BatchPrefill`: the fresh requests `ids` (outside the batch, offset 0), with their prompt lengths `lens`
    /// (at least 1), prefilled in chunks of `chunk` and appended after the `running` rows; those listed in
    /// `uncommitted` commit no chunk of their own (the prefill's end commits them, where a layout has the call).
    Prefill { ids: Vec<u32>, lens: Vec<usize>, chunk: usize, running: usize, uncommitted: Vec<u32> },
    /// `Extract` of a row the batch has: request `req` leaves row `row`, finished or back outside the batch;
    /// `keep` lists the other rows, in order.
    Extract { row: usize, req: u32, finish: bool, keep: Vec<usize> },
    /// `Filter`: the rows `kept` stay, in that order (each once); the requests of the others, `dropped`, finish.
    Filter { kept: Vec<usize>, dropped: Vec<u32> },
}

/// The roster's verdict on an op.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resolved {
    /// A lifecycle op whose references do not exist: every family skips it.
    Skip,
    /// An op that leaves the roster as it is (the families decide whether its references exist for them).
    Unchanged,
    /// A lifecycle op's change of the roster.
    Change(Change),
}

/// The scheduler's picture (module docs).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Roster {
    homes: BTreeMap<u32, Home>,
    rows: Vec<u32>,
    next_id: u32,
}

impl Roster {
    /// The requests of the batch rows, in row order.
    pub fn rows(&self) -> &[u32] {
        &self.rows
    }

    /// Where request `req` lives (`None`: it never was admitted, or it finished).
    pub fn home(&self, req: u32) -> Option<Home> {
        self.homes.get(&req).copied()
    }

    /// Whether `req` lives outside the batch.
    pub fn is_solo(&self, req: u32) -> bool {
        self.home(req) == Some(Home::Solo)
    }

    /// The live requests outside the batch, in id order.
    pub fn solo(&self) -> impl Iterator<Item = u32> + '_ {
        self.homes.iter().filter(|(_, h)| **h == Home::Solo).map(|(id, _)| *id)
    }

    /// Every live request, in id order.
    pub fn live(&self) -> impl Iterator<Item = u32> + '_ {
        self.homes.keys().copied()
    }

    /// The id the next admitted request must have at least (ids are never reused).
    pub fn next_id(&self) -> u32 {
        self.next_id
    }

    /// The generator's view, with `position` giving each request's (offset, last window width).
    pub fn view(&self, position: impl Fn(u32) -> (usize, Option<usize>)) -> View {
        View {
            solo: self
                .solo()
                .map(|id| {
                    let (offset, last) = position(id);
                    (id, offset, last)
                })
                .collect(),
            rows: self.rows.clone(),
            next_id: self.next_id,
            live: self.homes.len(),
        }
    }

    /// What `op` does to the roster; `offset` gives a live request's position (a prefill takes only fresh ones).
    pub fn resolve(&self, op: &Op, offset: impl Fn(u32) -> usize) -> Resolved {
        let change = match op {
            Op::Admit { req } => {
                if self.homes.contains_key(req) || *req < self.next_id {
                    return Resolved::Skip;
                }
                Change::Admit { req: *req }
            }
            Op::Merge { reqs } => Change::Enter { ids: self.entering(reqs), perm: (0..self.rows.len()).collect() },
            Op::Join { reqs, order } => match self.join_permutation(order) {
                Some(perm) => Change::Enter { ids: self.entering(reqs), perm },
                None => return Resolved::Skip,
            },
            Op::BatchPrefill { reqs, lengths, chunk, uncommitted } => {
                let (mut ids, mut lens) = (vec![], vec![]);
                for (i, &r) in reqs.iter().enumerate() {
                    if self.is_solo(r) && offset(r) == 0 && !ids.contains(&r) {
                        ids.push(r);
                        lens.push(lengths.get(i).copied().unwrap_or(1).max(1) as usize);
                    }
                }
                if *chunk == 0 {
                    return Resolved::Skip;
                }
                let uncommitted = uncommitted.clone();
                Change::Prefill { ids, lens, chunk: *chunk as usize, running: self.rows.len(), uncommitted }
            }
            Op::Extract { row, finish } => {
                let row = *row as usize;
                if self.rows.is_empty() {
                    return Resolved::Skip;
                }
                if row >= self.rows.len() {
                    // An impossible request: every family executes it (a typed error) and nothing changes.
                    return Resolved::Unchanged;
                }
                let keep = (0..self.rows.len()).filter(|&r| r != row).collect();
                Change::Extract { row, req: self.rows[row], finish: *finish, keep }
            }
            Op::Filter { keep } => {
                if self.rows.is_empty() {
                    return Resolved::Skip;
                }
                let mut kept: Vec<usize> = vec![];
                for &k in keep {
                    let k = k as usize;
                    if k < self.rows.len() && !kept.contains(&k) {
                        kept.push(k);
                    }
                }
                let dropped = (0..self.rows.len()).filter(|r| !kept.contains(r)).map(|r| self.rows[r]).collect();
                Change::Filter { kept, dropped }
            }
            _ => return Resolved::Unchanged,
        };
        match &change {
            Change::Enter { ids, .. } | Change::Prefill { ids, .. } if ids.is_empty() => Resolved::Skip,
            _ => Resolved::Change(change),
        }
    }

    /// Commits a change [`Roster::resolve`] named.
    pub fn commit(&mut self, change: &Change) {
        match change {
            Change::Admit { req } => {
                self.homes.insert(*req, Home::Solo);
                self.next_id = req + 1;
            }
            Change::Enter { ids, perm } => {
                self.rows = perm.iter().map(|&r| self.rows[r]).collect();
                self.append(ids);
            }
            Change::Prefill { ids, .. } => self.append(ids),
            Change::Extract { row, req, finish, .. } => {
                self.rows.remove(*row);
                if *finish {
                    self.homes.remove(req);
                } else {
                    self.homes.insert(*req, Home::Solo);
                }
            }
            Change::Filter { kept, dropped } => {
                self.rows = kept.iter().map(|&r| self.rows[r]).collect();
                for id in dropped {
                    self.homes.remove(id);
                }
            }
        }
    }

    fn append(&mut self, ids: &[u32]) {
        for id in ids {
            self.homes.insert(*id, Home::Batch);
            self.rows.push(*id);
        }
    }

    /// The requests of `reqs` that may enter the batch (outside it), each once, in the order listed.
    fn entering(&self, reqs: &[u32]) -> Vec<u32> {
        let mut ids: Vec<u32> = vec![];
        for &r in reqs {
            if self.is_solo(r) && !ids.contains(&r) {
                ids.push(r);
            }
        }
        ids
    }

    /// The running rows' order a `Join` lists (`order`; empty = identity) as a permutation of the rows, or `None`
    /// when it is not one.
    fn join_permutation(&self, order: &[u32]) -> Option<Vec<usize>> {
        let n = self.rows.len();
        let perm: Vec<usize> =
            if order.is_empty() { (0..n).collect() } else { order.iter().map(|&r| r as usize).collect() };
        let mut sorted = perm.clone();
        sorted.sort_unstable();
        (sorted == (0..n).collect::<Vec<_>>()).then_some(perm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admitted(n: u32) -> Roster {
        let mut r = Roster::default();
        for req in 0..n {
            let Resolved::Change(c) = r.resolve(&Op::Admit { req }, |_| 0) else { panic!("admit {req}") };
            r.commit(&c);
        }
        r
    }

    fn apply(r: &mut Roster, op: Op, offset: impl Fn(u32) -> usize) -> Resolved {
        let v = r.resolve(&op, offset);
        if let Resolved::Change(c) = &v {
            r.commit(c);
        }
        v
    }

    #[test]
    fn ids_are_never_reused() {
        let mut r = admitted(3);
        assert_eq!(r.resolve(&Op::Admit { req: 1 }, |_| 0), Resolved::Skip, "a live id");
        apply(&mut r, Op::Merge { reqs: vec![1] }, |_| 0);
        apply(&mut r, Op::Extract { row: 0, finish: true }, |_| 0);
        assert_eq!(r.home(1), None);
        assert_eq!(r.resolve(&Op::Admit { req: 1 }, |_| 0), Resolved::Skip, "a finished id");
        assert_eq!(r.resolve(&Op::Admit { req: 5 }, |_| 0), Resolved::Change(Change::Admit { req: 5 }));
    }

    #[test]
    fn join_reorders_then_appends_and_refuses_what_is_not_a_permutation() {
        let mut r = admitted(4);
        apply(&mut r, Op::Merge { reqs: vec![0, 1, 0, 9] }, |_| 0);
        assert_eq!(r.rows(), [0, 1], "each solo request once, unknown ones ignored");
        assert_eq!(r.resolve(&Op::Join { reqs: vec![2], order: vec![0, 0] }, |_| 0), Resolved::Skip);
        assert_eq!(r.resolve(&Op::Join { reqs: vec![0], order: vec![] }, |_| 0), Resolved::Skip, "no one enters");
        apply(&mut r, Op::Join { reqs: vec![3, 2], order: vec![1, 0] }, |_| 0);
        assert_eq!(r.rows(), [1, 0, 3, 2]);
        assert_eq!(r.solo().count(), 0);
    }

    #[test]
    fn prefill_takes_fresh_requests_only() {
        let mut r = admitted(3);
        let op = Op::BatchPrefill { reqs: vec![2, 0, 1, 2], lengths: vec![4, 0, 5], chunk: 2, uncommitted: vec![] };
        let v = apply(&mut r, op, |id| if id == 0 { 3 } else { 0 });
        assert_eq!(
            v,
            Resolved::Change(Change::Prefill {
                ids: vec![2, 1],
                lens: vec![4, 5],
                chunk: 2,
                running: 0,
                uncommitted: vec![]
            })
        );
        assert_eq!(r.rows(), [2, 1]);
        let none = Op::BatchPrefill { reqs: vec![0], lengths: vec![], chunk: 0, uncommitted: vec![] };
        assert_eq!(r.resolve(&none, |_| 0), Resolved::Skip);
    }

    #[test]
    fn extract_and_filter() {
        let mut r = admitted(4);
        apply(&mut r, Op::Merge { reqs: vec![0, 1, 2, 3] }, |_| 0);
        assert_eq!(r.resolve(&Op::Extract { row: 9, finish: false }, |_| 0), Resolved::Unchanged);
        apply(&mut r, Op::Extract { row: 1, finish: false }, |_| 0);
        assert_eq!((r.rows(), r.is_solo(1)), (&[0, 2, 3][..], true));
        let v = apply(&mut r, Op::Filter { keep: vec![2, 7, 2, 0] }, |_| 0);
        assert_eq!(v, Resolved::Change(Change::Filter { kept: vec![2, 0], dropped: vec![2] }));
        assert_eq!(r.rows(), [3, 0]);
        assert_eq!(r.live().collect::<Vec<_>>(), [0, 1, 3]);
        let mut empty = admitted(1);
        assert_eq!(apply(&mut empty, Op::Filter { keep: vec![] }, |_| 0), Resolved::Skip);
        assert_eq!(apply(&mut empty, Op::Extract { row: 0, finish: true }, |_| 0), Resolved::Skip);
    }
}
