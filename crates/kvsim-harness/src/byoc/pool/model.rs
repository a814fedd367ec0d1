//! kvsim's model of a block pool: which tokens each live sequence holds, the table the engine gave it, and under
//! which whole prefix each block was cached. Placement is the engine's (any free block will do); what the model
//! decides is what must hold whatever the placement: counts, exclusivity, and what a lookup may return.

use std::collections::{BTreeMap, BTreeSet};

use super::{PoolInfo, PoolOp};

/// A model's judgement of one reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Ok,
    /// The check that failed and what it saw.
    Fail(&'static str, String),
}

#[derive(Debug, Clone)]
struct Seq {
    tokens: Vec<u32>,
    table: Vec<u64>,
}

/// The pool as kvsim knows it.
#[derive(Debug, Clone)]
pub struct Model {
    bs: usize,
    usable: u64,
    seqs: BTreeMap<u64, Seq>,
    /// Block -> the tokens from the sequence's start through the end of that block, when it was cached; dropped
    /// when the engine hands the block out fresh (its contents are then another's).
    cached: BTreeMap<u64, Vec<u32>>,
}

impl Model {
    pub fn new(block_size: usize, usable: u64) -> Model {
        Model { bs: block_size, usable, seqs: BTreeMap::new(), cached: BTreeMap::new() }
    }

    /// Whether the op's sequences exist (or, for a new one, do not): an op that does not apply is skipped.
    pub fn applies(&self, op: &PoolOp) -> bool {
        let live = |s: &u64| self.seqs.contains_key(s);
        match op {
            PoolOp::Alloc { seq, tokens } => !live(seq) && !tokens.is_empty(),
            PoolOp::Hit { seq, .. } => !live(seq),
            PoolOp::Free { seq } | PoolOp::Cow { seq } | PoolOp::Cache { seq } => live(seq),
            PoolOp::Fork { seq, new } => live(seq) && !live(new),
            PoolOp::Lookup { .. } | PoolOp::Evict { .. } => true,
        }
    }

    /// The tokens `seq` holds (empty for a sequence that is not live).
    pub fn tokens(&self, seq: u64) -> Vec<u32> {
        self.seqs.get(&seq).map(|s| s.tokens.clone()).unwrap_or_default()
    }

    /// How many times each block is listed by a live sequence's table.
    fn refs(&self) -> BTreeMap<u64, u64> {
        let mut refs = BTreeMap::new();
        for s in self.seqs.values() {
            for &b in &s.table {
                *refs.entry(b).or_insert(0) += 1;
            }
        }
        refs
    }

    fn free(&self) -> u64 {
        self.usable.saturating_sub(self.refs().len() as u64)
    }

    fn blocks_for(&self, n: usize) -> usize {
        n.div_ceil(self.bs)
    }

    /// The blocks a copy-on-write of `seq` must copy: those another table lists too.
    fn shared(&self, seq: u64) -> Vec<u64> {
        let refs = self.refs();
        self.seqs.get(&seq).map_or(vec![], |s| s.table.iter().copied().filter(|b| refs[b] > 1).collect())
    }

    /// The engine refused `op` (`why`): right only where the pool cannot meet it.
    pub fn refused(&self, op: &PoolOp, why: &str) -> Verdict {
        let free = self.free();
        let need = match op {
            PoolOp::Alloc { tokens, .. } => self.blocks_for(tokens.len()) as u64,
            PoolOp::Cow { seq } => self.shared(*seq).len() as u64,
            _ => 0,
        };
        if need > free {
            return Verdict::Ok;
        }
        Verdict::Fail(
            "pool_refusal",
            format!("{} was refused ({why}), but it needs {need} free blocks and the pool has {free}", op.kind()),
        )
    }

    /// Fresh blocks in `table` (of an alloc or a copy) must be held by no one and listed once.
    fn check_fresh(&self, op: &PoolOp, fresh: &[u64]) -> Verdict {
        let refs = self.refs();
        let mut seen = BTreeSet::new();
        for &b in fresh {
            if let Some(holder) = self.seqs.iter().find(|(_, s)| s.table.contains(&b)).map(|(k, _)| *k) {
                return Verdict::Fail(
                    "pool_tables",
                    format!(
                        "{} handed out block {b} as a fresh block while sequence {holder} holds it ({} refs)",
                        op.kind(),
                        refs[&b]
                    ),
                );
            }
            if !seen.insert(b) {
                return Verdict::Fail("pool_tables", format!("{} handed out block {b} twice", op.kind()));
            }
        }
        Verdict::Ok
    }

    /// The table a reply gave `op`'s sequence (`copied`: the count a `pool_cow` reported).
    pub fn tabled(&mut self, op: &PoolOp, table: Vec<u64>, copied: Option<u64>) -> Verdict {
        match op {
            PoolOp::Alloc { seq, tokens } => {
                let need = self.blocks_for(tokens.len());
                if table.len() != need {
                    return Verdict::Fail(
                        "pool_tables",
                        format!(
                            "alloc of {} tokens gave {} blocks {table:?}, {need} needed",
                            tokens.len(),
                            table.len()
                        ),
                    );
                }
                if let v @ Verdict::Fail(..) = self.check_fresh(op, &table) {
                    return v;
                }
                for b in &table {
                    self.cached.remove(b);
                }
                self.seqs.insert(*seq, Seq { tokens: tokens.clone(), table });
                Verdict::Ok
            }
            PoolOp::Fork { seq, new } => {
                let src = self.seqs[seq].clone();
                if table != src.table {
                    return Verdict::Fail(
                        "pool_tables",
                        format!("fork of sequence {seq} (blocks {:?}) gave {new} the blocks {table:?}", src.table),
                    );
                }
                self.seqs.insert(*new, src);
                Verdict::Ok
            }
            PoolOp::Cow { seq } => {
                let old = self.seqs[seq].table.clone();
                let shared = self.shared(*seq);
                if table.len() != old.len() {
                    return Verdict::Fail(
                        "pool_tables",
                        format!("cow of sequence {seq} (blocks {old:?}) gave {} blocks {table:?}", table.len()),
                    );
                }
                let fresh: Vec<u64> = table.iter().zip(&old).filter(|(n, o)| n != o).map(|(n, _)| *n).collect();
                if let v @ Verdict::Fail(..) = self.check_fresh(op, &fresh) {
                    return v;
                }
                let changed = fresh.len() as u64;
                if let Some(o) = table.iter().zip(&old).find(|(n, o)| n != o && !shared.contains(o)).map(|(_, o)| *o) {
                    return Verdict::Fail(
                        "pool_cow",
                        format!("cow of sequence {seq} replaced block {o}, which it held alone ({old:?} -> {table:?})"),
                    );
                }
                let free = self.free();
                for b in &fresh {
                    self.cached.remove(b);
                }
                if let Some(s) = self.seqs.get_mut(seq) {
                    s.table = table.clone();
                }
                if copied != Some(changed) {
                    return Verdict::Fail(
                        "pool_count",
                        format!(
                            "cow of sequence {seq} said it copied {copied:?} blocks, its table changed in {changed}"
                        ),
                    );
                }
                let refs = self.refs();
                if let Some(b) = table.iter().find(|b| refs[b] > 1) {
                    return Verdict::Fail(
                        "pool_cow",
                        format!(
                            "after cow, sequence {seq} still shares block {b} ({} holders; it shared {shared:?}, the \
                             pool had {free} free blocks) and the engine did not refuse",
                            refs[b]
                        ),
                    );
                }
                Verdict::Ok
            }
            _ => Verdict::Ok,
        }
    }

    /// The longest run of whole blocks of `tokens` that a sequence still holding them cached: a lookup must find
    /// at least these (nothing may have evicted them).
    fn held_prefix_blocks(&self, tokens: &[u32]) -> usize {
        let refs = self.refs();
        let mut k = 0;
        while (k + 1) * self.bs <= tokens.len() {
            let want = &tokens[..(k + 1) * self.bs];
            if !self.cached.iter().any(|(b, t)| refs.contains_key(b) && t.as_slice() == want) {
                break;
            }
            k += 1;
        }
        k
    }

    /// A lookup of `tokens` answered `blocks` and `matched`.
    pub fn lookup(&self, tokens: &[u32], blocks: &[u64], matched: u64) -> Verdict {
        let bs = self.bs;
        if matched as usize != blocks.len() * bs || matched as usize > tokens.len() {
            return Verdict::Fail(
                "pool_count",
                format!("a lookup of {} tokens matched {matched} with {} blocks of {bs}", tokens.len(), blocks.len()),
            );
        }
        for (i, b) in blocks.iter().enumerate() {
            let want = &tokens[..(i + 1) * bs];
            match self.cached.get(b) {
                Some(t) if t.as_slice() == want => {}
                Some(t) => {
                    return Verdict::Fail(
                        "pool_lookup",
                        format!(
                            "a lookup of {tokens:?} returned block {b} for positions {}..{}: that block holds {:?} \
                             after {:?}, the query has {:?} after {:?}",
                            i * bs,
                            (i + 1) * bs,
                            &t[t.len() - bs..],
                            &t[..t.len() - bs],
                            &want[i * bs..],
                            &want[..i * bs]
                        ),
                    )
                }
                None => {
                    return Verdict::Fail(
                        "pool_lookup",
                        format!(
                        "a lookup of {tokens:?} returned block {b} for positions {}..{}, which holds nothing cached",
                        i * bs,
                        (i + 1) * bs
                    ),
                    )
                }
            }
        }
        let k = self.held_prefix_blocks(tokens);
        if blocks.len() < k {
            return Verdict::Fail(
                "pool_lookup",
                format!(
                    "a lookup of {tokens:?} found {} blocks; {k} are cached by sequences that still hold them",
                    blocks.len()
                ),
            );
        }
        Verdict::Ok
    }

    /// A hit made a new sequence of `table` holding `matched` tokens of `tokens`.
    pub fn hit(&mut self, op: &PoolOp, table: Vec<u64>, matched: u64) -> Verdict {
        let PoolOp::Hit { seq, tokens } = op else { return Verdict::Ok };
        if let v @ Verdict::Fail(..) = self.lookup(tokens, &table, matched) {
            return v;
        }
        self.seqs.insert(*seq, Seq { tokens: tokens[..matched as usize].to_vec(), table });
        Verdict::Ok
    }

    pub fn evicted(&self, n: usize, evicted: u64) -> Verdict {
        let free = self.free();
        if evicted > n as u64 || evicted > free {
            return Verdict::Fail("pool_count", format!("evict of {n} dropped {evicted} blocks ({free} unheld)"));
        }
        Verdict::Ok
    }

    /// An op whose reply has no fields: its change to the model.
    pub fn done(&mut self, op: &PoolOp) -> Verdict {
        match op {
            PoolOp::Free { seq } => {
                self.seqs.remove(seq);
            }
            PoolOp::Cache { seq } => {
                let s = self.seqs[seq].clone();
                for (i, b) in s.table.iter().enumerate().take(s.tokens.len() / self.bs) {
                    self.cached.insert(*b, s.tokens[..(i + 1) * self.bs].to_vec());
                }
            }
            _ => {}
        }
        Verdict::Ok
    }

    /// The engine's whole picture after `op` against the model's.
    pub fn audit(&self, info: &PoolInfo, op: &PoolOp) -> Verdict {
        let refs = self.refs();
        if info.refs != refs {
            let b = refs.keys().chain(info.refs.keys()).find(|b| refs.get(b) != info.refs.get(b));
            let b = b.copied().unwrap_or_default();
            return Verdict::Fail(
                "pool_refs",
                format!(
                    "after {}, block {b} has {:?} refs in the engine; the tables list it {} times",
                    op.kind(),
                    info.refs.get(&b),
                    refs.get(&b).copied().unwrap_or(0)
                ),
            );
        }
        let free = self.free();
        if info.free != free {
            return Verdict::Fail(
                "pool_refs",
                format!(
                    "after {}, the engine has {} free blocks; {} usable less {} held is {free}",
                    op.kind(),
                    info.free,
                    self.usable,
                    refs.len()
                ),
            );
        }
        let tables: BTreeMap<u64, Vec<u64>> = self.seqs.iter().map(|(k, s)| (*k, s.table.clone())).collect();
        if info.tables != tables {
            let s = tables.keys().chain(info.tables.keys()).find(|s| tables.get(s) != info.tables.get(s));
            let s = s.copied().unwrap_or_default();
            return Verdict::Fail(
                "pool_tables",
                format!(
                    "after {}, sequence {s}'s table is {:?} in the engine, {:?} by its replies",
                    op.kind(),
                    info.tables.get(&s),
                    tables.get(&s)
                ),
            );
        }
        let mut owner: BTreeMap<u64, u64> = BTreeMap::new();
        for (b, id) in &info.storage {
            if !refs.contains_key(b) {
                continue;
            }
            if let Some(other) = owner.insert(*id, *b) {
                return Verdict::Fail(
                    "pool_storage",
                    format!("after {}, blocks {other} and {b} share one storage object ({id})", op.kind()),
                );
            }
        }
        Verdict::Ok
    }
}
