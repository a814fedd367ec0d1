//! The prefix index of a [`PagedStore`](super::PagedStore): a radix tree over full blocks of token ids, each node
//! a block under its parent's prefix.

use std::collections::BTreeMap;

/// One node of the prefix index: a full block of token ids under its parent's prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Node {
    pub(super) parent: Option<usize>,
    pub(super) key: Vec<u32>,
    pub(super) block: u32,
    pub(super) children: BTreeMap<Vec<u32>, usize>,
    pub(super) last_used: u64,
}

/// One entry of the prefix index as [`PagedStore::index_entries`](super::PagedStore::index_entries) lists it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(deny_unknown_fields))]
pub struct IndexEntry {
    /// The token ids from the first position to the end of this block.
    pub prefix: Vec<u32>,
    /// The physical block holding the block's K/V.
    pub block: u32,
    /// The index clock when the entry was last matched or inserted (least recently used goes first).
    pub last_used: u64,
}

/// The radix tree over full blocks of token ids.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(super) struct PrefixIndex {
    pub(super) nodes: Vec<Option<Node>>,
    pub(super) roots: BTreeMap<Vec<u32>, usize>,
    pub(super) clock: u64,
}

impl PrefixIndex {
    pub(super) fn live(&self) -> impl Iterator<Item = (usize, &Node)> {
        self.nodes.iter().enumerate().filter_map(|(i, n)| n.as_ref().map(|n| (i, n)))
    }

    pub(super) fn len(&self) -> usize {
        self.live().count()
    }

    pub(super) fn node(&self, i: usize) -> &Node {
        self.nodes[i].as_ref().expect("index node ids are live")
    }

    pub(super) fn children_of(&self, parent: Option<usize>) -> &BTreeMap<Vec<u32>, usize> {
        match parent {
            None => &self.roots,
            Some(p) => &self.node(p).children,
        }
    }

    /// The nodes along the longest cached chain of full blocks of `tokens`.
    pub(super) fn matching(&self, tokens: &[u32], bs: usize) -> Vec<usize> {
        let mut at = None;
        let mut out = vec![];
        for chunk in tokens.chunks_exact(bs) {
            let found = self.children_of(at).get(chunk).copied();
            // Mutation hook `Mutant::PagedMatchIgnoresParent`: a block the parent lacks is looked up by its own
            // tokens anywhere in the index.
            let found = found.or_else(|| {
                if crate::fault!(PagedMatchIgnoresParent) {
                    self.live().find(|(_, n)| n.key == chunk).map(|(i, _)| i)
                } else {
                    None
                }
            });
            match found {
                Some(n) => {
                    out.push(n);
                    at = Some(n);
                }
                None => break,
            }
        }
        if crate::fault!(PagedPartialMatch) {
            // Mutation hook `Mutant::PagedPartialMatch`: a block that agrees with the prompt's next tokens on a part
            // of itself only (a partial last block, or a block the prompt leaves midway) matches as a whole.
            let rest = &tokens[out.len() * bs..];
            let agree = |key: &Vec<u32>| key.iter().zip(rest).take_while(|(a, b)| a == b).count();
            if let Some((_, &n)) = self.children_of(at).iter().find(|(key, _)| (1..bs).contains(&agree(key))) {
                out.push(n);
            }
        }
        out
    }

    pub(super) fn touch(&mut self, ids: &[usize]) {
        self.clock += 1;
        for &i in ids {
            if let Some(n) = self.nodes[i].as_mut() {
                n.last_used = self.clock;
            }
        }
    }

    /// The least recently used leaf whose block only the index references (ties: the lower block).
    pub(super) fn lru_leaf(&self, refs: &[u32]) -> Option<usize> {
        self.live()
            .filter(|(_, n)| {
                n.children.is_empty() && (refs[n.block as usize] == 1 || crate::fault!(PagedEvictReferenced))
            })
            .min_by_key(|(_, n)| (n.last_used, n.block))
            .map(|(i, _)| i)
    }

    pub(super) fn remove(&mut self, i: usize) -> u32 {
        let n = self.nodes[i].take().expect("removing a live node");
        match n.parent {
            None => self.roots.remove(&n.key),
            Some(p) => self.nodes[p].as_mut().expect("parent is live").children.remove(&n.key),
        };
        n.block
    }

    /// How many blocks evictions could free: nodes whose block and whole subtree only the index references.
    pub(super) fn evictable(&self, refs: &[u32]) -> usize {
        fn walk(ix: &PrefixIndex, i: usize, refs: &[u32]) -> (bool, usize) {
            let n = ix.node(i);
            let mut all = refs[n.block as usize] == 1;
            let mut count = 0;
            for &c in n.children.values() {
                let (ok, k) = walk(ix, c, refs);
                all &= ok;
                count += k;
            }
            (all, count + usize::from(all))
        }
        self.roots.values().map(|&r| walk(self, r, refs).1).sum()
    }

    pub(super) fn prefix_of(&self, i: usize) -> Vec<u32> {
        let mut chain = vec![];
        let mut at = Some(i);
        while let Some(n) = at {
            chain.push(n);
            at = self.node(n).parent;
        }
        chain.iter().rev().flat_map(|&n| self.node(n).key.iter().copied()).collect()
    }
}
