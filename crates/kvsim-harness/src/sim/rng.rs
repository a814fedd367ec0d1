//! One `u64` seed decides a whole run: every subsystem draws from its own ChaCha8 stream of that seed.
//!
//! `ChaCha8Rng` is named after its algorithm (not `StdRng`, whose algorithm may change between rand releases), and
//! `rand_chacha` is pinned in Cargo.lock. `seed_from_u64` expands the seed through PCG32, so neighbouring seeds give
//! unrelated streams; `set_stream` gives each subsystem an independent stream of the same seed, so adding draws in one
//! subsystem never shifts another's (harness-practices.md §9).

use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// The named streams. Their numbers are part of the trace format: changing one changes every seed's run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub enum Stream {
    /// The swarm configuration (shapes, windows, dtype, weights, disabled op kinds).
    Config = 1,
    /// The op stream (which op, which rows, lengths).
    Workload = 2,
    /// Speculative accepts and trim amounts.
    Speculation = 3,
    /// The K/V/Q payload seed (values themselves are a pure function of it; see reference::values).
    Payload = 4,
    /// Which layout families a run holds (`sim::family::REGISTRY`).
    Families = 5,
    /// The bf16-first family's parameters (bits, group, head dim, `start`), a stream of the run's payload seed.
    Transition = 9,
    /// The recurrent family's set and DeltaNet geometry (`sim::family::ssm`), seeded by the run's payload seed.
    Recurrent = 6,
    /// The quantized family's parameters (bits, group, head dim, native or converted) and the weight of its
    /// conversion op (`sim::family::quant`); drawn only for runs that hold that family.
    Quant = 7,
    /// Whether a run draws the save/restore op, and its weight (`sim::config`).
    Persist = 10,
    /// Which requests of a batch prefill leave their chunks uncommitted, for the prefill's end to commit
    /// (`Op::BatchPrefill::uncommitted`).
    Prefill = 11,
    /// Whether the next op is one of the contract's batched calls, and its parameters (`OpKind::is_contract`).
    Contract = 12,
    /// Whether a run draws the encoder read, and its weight (`sim::config`).
    Encoder = 13,
    /// Whether the next op is the bf16-first rows' softcapped fetch (`Op::Fetch`), and its length.
    Fetch = 14,
    /// Whether the op after a lifecycle step is the step that consumes the state it left (`sim::gen::FollowUp`),
    /// and that op's parameters.
    FollowUp = 15,
    /// The paged family's parameters (block size, pool limits, prompt sharing) and the weight of its own ops.
    Paged = 16,
    /// A block-pool run's geometry (`byoc::pool`: block size, blocks, vocabulary).
    Pool = 17,
    /// A prefix-cache run's layers and shapes (`byoc::prefix`).
    Prefix = 18,
    /// A recurrent-state run's arrays and dtype (`byoc::recurrent`).
    RecurrentState = 19,
    /// Whether the next op is an adopt of the bf16-first rows drawn beside the weights (`sim::gen`), and whether
    /// it is the invalid one.
    RowsAdopt = 27,
}

/// A generator for one subsystem of one seed.
pub fn stream(seed: u64, which: Stream) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(which as u64);
    rng
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    #[test]
    fn streams_are_reproducible_and_distinct() {
        let a: Vec<u64> = (0..4).map(|_| stream(7, Stream::Workload).random()).collect();
        assert!(a.windows(2).all(|w| w[0] == w[1]));
        let x: u64 = stream(7, Stream::Workload).random();
        let y: u64 = stream(7, Stream::Config).random();
        let z: u64 = stream(8, Stream::Workload).random();
        assert_ne!(x, y);
        assert_ne!(x, z);
    }
}
