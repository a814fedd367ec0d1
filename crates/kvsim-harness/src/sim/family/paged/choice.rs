//! The paged family's parameters of one run (block size, pool, index budget, prompt groups, affine storage) and
//! its own op's draw.

use rand::Rng;
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use super::NAME;
use crate::sim::config::{Params, SimConfig};
use crate::sim::ops::{Op, PagedAction};
use crate::sim::rng::{stream, Stream};
use kvsim_cache::{PoolSpec, QuantSpec, Storage};

/// The paged family's parameters of one run (drawn per seed from [`Stream::Paged`]; recorded in the trace's config).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PagedChoice {
    /// Positions per block: 1, sizes that divide nothing in particular (3, 5), powers of two.
    pub block_size: usize,
    pub initial_blocks: usize,
    pub grow_by: usize,
    /// The pool's cap in positions (`None`: practically unbounded); the cap in blocks rounds it up.
    pub cap_positions: Option<usize>,
    /// The prefix index's budget in blocks.
    pub index_budget: usize,
    /// Prompt groups requests draw from (requests of one group share a prompt prefix).
    pub groups: u32,
    /// The longest shared prompt prefix a request draws.
    pub share_max: u32,
    /// Weight of the family's own ops in this run.
    pub weight: u32,
    /// Affine storage of the pool (`None`: plain planes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quant: Option<PagedQuant>,
}

/// An affine pool's parameters and the family's head dim for it (a multiple of the group).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PagedQuant {
    pub bits: usize,
    pub group: usize,
    pub head_dim: usize,
}

impl PagedChoice {
    pub fn draw(seed: u64) -> PagedChoice {
        let mut rng = stream(seed, Stream::Paged);
        // Small blocks most often (the simulator's prompts are short: a hit needs whole blocks), 1 and sizes that
        // divide nothing in particular among them.
        let sizes = [1usize, 1, 2, 2, 3, 4, 4, 5, 8, 16];
        let block_size = sizes[rng.random_range(0..sizes.len())];
        let initial_blocks = rng.random_range(1..=4);
        let grow_by = rng.random_range(1..=4);
        let cap_positions = rng.random_bool(0.35).then(|| rng.random_range(16..=96));
        let index_budget = if rng.random_bool(0.4) { rng.random_range(1..=8) } else { 4096 };
        let groups = rng.random_range(1..=2);
        let share_max = rng.random_range(4..=32);
        let weight = rng.random_range(3..=7);
        // Drawn last, so the draws above are those of runs before affine pools existed.
        let quant = rng.random_bool(0.5).then(|| {
            let bits = [4usize, 4, 8, 8, 2, 3, 5, 6][rng.random_range(0..8)];
            let group = kvsim_cache::QUANT_GROUPS[rng.random_range(0..kvsim_cache::QUANT_GROUPS.len())];
            let dims: Vec<usize> = [32usize, 64, 128].into_iter().filter(|d| d % group == 0).collect();
            PagedQuant { bits, group, head_dim: dims[rng.random_range(0..dims.len())] }
        });
        PagedChoice {
            block_size,
            initial_blocks,
            grow_by,
            cap_positions,
            index_budget,
            groups,
            share_max,
            weight,
            quant,
        }
    }

    /// How the pool stores K and V.
    pub fn storage(&self) -> Storage {
        self.quant.map_or(Storage::Plain, |q| Storage::Affine(QuantSpec { bits: q.bits, group: q.group }))
    }

    pub fn of(cfg: &SimConfig) -> Option<PagedChoice> {
        cfg.params_of(NAME).and_then(PagedChoice::from_params)
    }

    pub fn to_params(self) -> Params {
        Params::of(&self)
    }

    pub fn from_params(p: &Params) -> Option<PagedChoice> {
        p.to()
    }

    /// The pool of every layer's store.
    pub fn pool(&self) -> PoolSpec {
        let max_blocks = match self.cap_positions {
            Some(n) => n.div_ceil(self.block_size).max(self.initial_blocks),
            None => 1 << 16,
        };
        PoolSpec {
            block_size: self.block_size,
            initial_blocks: self.initial_blocks,
            max_blocks,
            grow_by: self.grow_by,
            index_budget: self.index_budget,
        }
    }
}

/// The generator's paged op: a same-end prefill of the running batch in 45% of the draws, else a fork
/// (parallel sampling, seven in ten of the rest) or an eviction.
pub fn draw_paged(cfg: &SimConfig, w: &mut ChaCha8Rng) -> Op {
    let action = if w.random_bool(0.45) {
        PagedAction::SameEnd {
            extra: w.random_range(1..=cfg.max_prompt.max(1) as u32),
            chunk: w.random_range(1..=cfg.max_chunk.max(1) as u32),
        }
    } else if w.random_bool(0.7) {
        PagedAction::Fork {
            req: 0,
            n: w.random_range(1..=3),
            len: w.random_range(1..=cfg.max_chunk.max(1) as u32),
            finish: w.random_bool(0.6),
        }
    } else {
        PagedAction::Evict { blocks: w.random_range(1..=8) }
    };
    Op::Paged { action }
}
