//! kvsim's deterministic simulation harness: one `u64` seed decides a swarm configuration and an op stream of
//! admit / merge / join / extract / filter / trim / speculative-rollback / persist; one run loop applies it to
//! every registered layout family and checks every row, after every op, against its solo twin and the reference
//! model.
//!
//! - [`sim`]: seeds, swarm config, op alphabet, generator, the run loop, families, checks, traces, shrinking.
//! - [`byoc`]: a cache written outside kvsim, driven by the same run loop through a small adapter.
//! - [`campaign`]: many seeds folded into one typed summary and one result hash; mutant hunts.
//! - [`shard`]: campaigns split over processes and machines, merged by seed.
//! - [`soak`]: long runs that sample memory and fail on growth after warm-up.
//! - [`fuzzing`]: the entry points of the cargo-fuzz targets.
//!
//! The harness never prints: every result is a value its caller reports.
//!
//! # Files
//! - `sim/`: `rng.rs` (ChaCha8 streams per subsystem), `config.rs` (swarm config from a seed), `ops.rs` (the op alphabet,
//!   serde + `Arbitrary`; `API_CLASSES`), `gen.rs` (op stream), `mod.rs` (`run` / `run_observed`: **the** run loop;
//!   `replay`), `roster.rs` (the scheduler's picture, held once: live requests, batch rows, next id; it resolves and
//!   commits what each lifecycle op changes), `runner.rs` (`World`: the roster, one instance per family, dispatch, run
//!   digest, per-family op counts),
//!   `check.rs` (one check function per feature; a difference goes through `check::fail`, which `checks_off` turns into
//!   "record and go on" for `oracle teeth`), `observe.rs` (`RunObserver`, the plain-data `Call`s families describe;
//!   `watches` names the families an observer watches, the others get a `NoObserver`), `summary.rs` (`Counters`,
//!   `LayoutStats`), `trace.rs` (versioned JSON traces), `shrink.rs` (delta debugging).
//!   `sim::run` switches `set_eval_after_write` off: every check reads every buffer after the op, so the runner
//!   evaluates each op's lazily built graphs once (one device round trip).
//! - `sim/family/`: the layout families behind the `Family` trait, registered at run time in a `Registry` (`mod.rs`:
//!   `Registry::builtin()` holds kvsim's own; each `Registration` brings its own draws, so `config.rs` and `gen.rs` name
//!   no family; a family keeps only layouts, twins, models and checks, and reads the roster from `Cx`; with
//!   `persist_through_bytes`, the `persist` op's one save/drop/restore round trip): `attention.rs` (plain rings and rows,
//!   the special reads and `compiled_step`; `attention/probes.rs`: generated `adopt`, `decode_phase`, `prepare` and
//!   ill-formed inputs), `quant.rs`, `transition.rs` (+ `transition/legos.rs`: the `bf16-first` family), `ssm.rs`,
//!   `training.rs`, `paged.rs` (one store per layer against cold twins, a permuted-placement store and the pool model). How to add one: docs/layouts.md.
//! - `byoc.rs` (+ `byoc/family.rs`, `byoc/engine.rs`): a cache written outside kvsim, under test. `SerialUnderTest`,
//!   `RowsUnderTest` and `Adapter` (what it supports, how to make an empty serial cache) are the interface; one generic
//!   family drives it with solo twins made from the adapter's own serial cache and a `RowModel` per request, through
//!   the same run loop, shrink and replay (`check`, `shrink`, `replay`). `engine.rs` is the adapter whose caches live
//!   in another process (the engine protocol, oracles/PROTOCOL.md): a child process, typed `EngineFailure`s, the calls
//!   of the run kept for the engine's reproducer. `pool.rs` (+
//!   `pool/model.rs`): protocol 2's block pools, seeded pool ops checked after every request against a pool model
//!   (references, tables, copy-on-write, lookups by whole prefix), `kvsim-pool-trace` files; `prefix.rs`: protocol 2's
//!   prefix caches, K/V derived from the token prefix so every hit is checked warm = cold (`kvsim-prefix-trace` files);
//!   `ddmin.rs`: the delta debugging both shrink with; `engine_check.rs`: `check_engine` (every layer an engine serves,
//!   classes, shrinking, reproducers) on top of `engine.rs`, `pool.rs` and `prefix.rs`, which know nothing of it.
//!   `Adapter::read_all` hands the checks' reads to an engine in one `batch` round trip. How to write one: docs/bring-your-own-cache.md.
//! - `campaign.rs`: `run_seeds`, the typed `Summary` (`result_hash` = blake3 of the ordered per-seed hashes), `Part`
//!   and `merge`, `hunt_mutant`, `MutantHunt`, `mutant_budget` (the one budget table).
//! - `shard.rs`: shard specs `I/N` (round-robin seed ownership), the campaign hash over `{seed, hash}` pairs in seed
//!   order, worker processes (`run_workers`: the binary re-run with `--seed-feed`, handed the next seed on its stdin as it
//!   finishes one; with `--gpus`, worker i sees GPU i mod N through its `CUDA_VISIBLE_DEVICES`: `worker_gpu`; a worker
//!   that dies fails the seed it was running, its `OpJournal` giving the ops it had started, and a new worker runs the
//!   rest; `kvsim mutants`, `soak` and `check-engine` run their seeds through it too, a `Pool` of one worker). `merge` refuses a seed run twice and parts of another device, MLX version, read mode or seed range.
//! - `pin.rs`: binding a worker (and the engine it starts) to one CPU, claimed with a lock file that the machine's other
//!   kvsim workers see (`claim_cpu`), so that runs side by side spread over the CPUs.
//! - `soak.rs`: long runs sampling MLX memory, RSS and the heap of the allocator that serves `malloc` (`HeapAllocator`:
//!   glibc's `mallinfo2` and `malloc_trim(0)` by default; the `kvsim` binary names mimalloc, whose heap is not counted)
//!   after every seed; fail when the last 10%'s level exceeds 1.1x the warm-up's (MLX active memory, or RSS outside
//!   MLX's cache). `SampleLog` keeps per 1/1000 of the budget only the samples holding a maximum (at most 6,006).
//! - `fuzzing.rs`: the `sim_trace`, `trace_json` and `cache_file` entry points.

#![cfg_attr(test, allow(clippy::print_stdout, clippy::print_stderr))]

pub mod byoc;
pub mod campaign;
pub mod fuzzing;
pub mod pin;
pub mod shard;
pub mod sim;
pub mod soak;
