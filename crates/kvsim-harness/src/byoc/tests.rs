//! The adapter family over kvsim's own linear caches, reached through the contract traits alone (`Cache`,
//! `AttentionCache`, `RowLayout`): the correct ones pass, and a filter that forgets the order it was asked for is
//! caught, shrunk and replayed.

use mlx_rs::Array;

use super::*;
use crate::sim::trace::Outcome;
use kvsim_cache::contract::{AttentionCache, Cache, KvGeometry, RowLayout};
use kvsim_cache::{KvDtype, KvSpec, Masks, RowBatch, SerialCache, Storage};

struct Serial(SerialCache);
struct Rows(RowBatch);

fn spec_of(g: &Geometry) -> KvSpec {
    let dtype = if g.dtype == mlx_rs::Dtype::Bfloat16 { KvDtype::Bf16 } else { KvDtype::F32 };
    KvSpec { heads_kv: g.heads_kv, head_dim: g.head_dim, dtype }
}

impl SerialUnderTest for Serial {
    fn offset(&self) -> usize {
        Cache::offset(&self.0)
    }
    fn window(&mut self, k: &Array, v: &Array, q: &Array, scale: f32) -> AdapterResult<Array> {
        Ok(AttentionCache::window(&mut self.0, k, v, q, scale, &Masks::new())?)
    }
    fn decode(&mut self, k: &Array, v: &Array, q: &Array, scale: f32) -> AdapterResult<Array> {
        Ok(AttentionCache::decode(&mut self.0, k, v, q, scale, &Masks::new())?)
    }
    fn trim(&mut self, n: usize) -> AdapterResult<usize> {
        if !Cache::is_trimmable(&self.0) {
            return Ok(0);
        }
        let n = n.min(Cache::offset(&self.0));
        Ok(Cache::trim(&mut self.0, n, false)?)
    }
    fn state(&self) -> AdapterResult<[Array; 2]> {
        Ok(self.0.temporal_view()?.into())
    }
}

fn geometry_of(s: &SerialCache) -> KvGeometry {
    KvGeometry { spec: AttentionCache::spec(s), max_size: AttentionCache::max_size(s), storage: Storage::Plain }
}

impl RowsUnderTest for Rows {
    type Serial = Serial;
    fn merge(rows: Vec<Serial>) -> AdapterResult<Rows> {
        let g = geometry_of(&rows.first().ok_or("no rows")?.0);
        Ok(Rows(RowLayout::merge(&g, rows.into_iter().map(|s| s.0).collect())?))
    }
    fn join(rows: &[&Serial]) -> AdapterResult<Rows> {
        let g = geometry_of(&rows.first().ok_or("no rows")?.0);
        let refs: Vec<&SerialCache> = rows.iter().map(|s| &s.0).collect();
        Ok(Rows(RowLayout::join(&g, &refs)?))
    }
    fn rows(&self) -> usize {
        Cache::rows(&self.0)
    }
    fn offsets(&self) -> Vec<usize> {
        Cache::offsets(&self.0)
    }
    fn decode(&mut self, k: &Array, v: &Array, q: &Array, scale: f32) -> AdapterResult<Array> {
        Ok(AttentionCache::decode(&mut self.0, k, v, q, scale, &Masks::new())?)
    }
    fn window(&mut self, k: &Array, v: &Array, q: &Array, scale: f32) -> AdapterResult<Array> {
        Ok(AttentionCache::window(&mut self.0, k, v, q, scale, &Masks::new())?)
    }
    fn extract(&self, row: usize) -> AdapterResult<Serial> {
        Ok(Serial(RowLayout::extract(&self.0, row)?))
    }
    fn filter(&mut self, keep: &[usize]) -> AdapterResult<()> {
        Ok(RowLayout::filter(&mut self.0, keep)?)
    }
    fn trim(&mut self, n: usize) -> AdapterResult<usize> {
        if !Cache::is_trimmable(&self.0) {
            return Ok(0);
        }
        Ok(Cache::trim(&mut self.0, n, false)?)
    }
    fn trim_rows(&mut self, n: &[usize]) -> AdapterResult<Vec<usize>> {
        if !Cache::is_trimmable(&self.0) {
            return Ok(vec![0; n.len()]);
        }
        self.0.trim_rows(n, false)?;
        Ok(n.to_vec())
    }
    fn row_state(&self, row: usize) -> AdapterResult<[Array; 2]> {
        Ok(self.0.row_temporal_view(row)?.into())
    }
}

struct Kvsim;

impl Adapter for Kvsim {
    const NAME: &'static str = "kvsim-linear";
    fn supports() -> Supports {
        // Linear only: kvsim's rings re-linearize at merge and extract (docs/layouts.md), so after a wrap their
        // reads are byte-identical to a solo run that went through the same layout events, which the attention
        // family's twins do, not to one that never did, which is what these twins are.
        Supports {
            serial_trim: true,
            rows_window: true,
            rows_trim: true,
            join: true,
            rows_trim_rows: true,
            ..Supports::default()
        }
    }
    type Serial = Serial;
    type Rows = Rows;
    fn serial(g: &Geometry) -> AdapterResult<Serial> {
        Ok(Serial(SerialCache::with_storage(spec_of(g), g.max_size, Storage::Plain)?))
    }
}

/// kvsim's rows with a filter that keeps the rows asked for in ascending order, whatever order it was asked for.
struct Unordered(Rows);

impl RowsUnderTest for Unordered {
    type Serial = Serial;
    fn merge(rows: Vec<Serial>) -> AdapterResult<Self> {
        Ok(Unordered(Rows::merge(rows)?))
    }
    fn rows(&self) -> usize {
        self.0.rows()
    }
    fn offsets(&self) -> Vec<usize> {
        self.0.offsets()
    }
    fn decode(&mut self, k: &Array, v: &Array, q: &Array, scale: f32) -> AdapterResult<Array> {
        self.0.decode(k, v, q, scale)
    }
    fn extract(&self, row: usize) -> AdapterResult<Serial> {
        self.0.extract(row)
    }
    fn filter(&mut self, keep: &[usize]) -> AdapterResult<()> {
        let mut sorted = keep.to_vec();
        sorted.sort_unstable();
        self.0.filter(&sorted)
    }
    fn row_state(&self, row: usize) -> AdapterResult<[Array; 2]> {
        self.0.row_state(row)
    }
}

struct Bugged;

impl Adapter for Bugged {
    const NAME: &'static str = "kvsim-unordered-filter";
    fn supports() -> Supports {
        Supports { serial_trim: true, ..Supports::default() }
    }
    type Serial = Serial;
    type Rows = Unordered;
    fn serial(g: &Geometry) -> AdapterResult<Serial> {
        Kvsim::serial(g)
    }
}

/// kvsim's rows with a per-row rollback that drops the largest count from every row and answers the counts asked
/// (a batch whose rows' offsets are not rewound one by one).
struct UniformRollback(Rows);

impl RowsUnderTest for UniformRollback {
    type Serial = Serial;
    fn merge(rows: Vec<Serial>) -> AdapterResult<Self> {
        Ok(UniformRollback(Rows::merge(rows)?))
    }
    fn join(rows: &[&Serial]) -> AdapterResult<Self> {
        Ok(UniformRollback(Rows::join(rows)?))
    }
    fn rows(&self) -> usize {
        self.0.rows()
    }
    fn offsets(&self) -> Vec<usize> {
        self.0.offsets()
    }
    fn decode(&mut self, k: &Array, v: &Array, q: &Array, scale: f32) -> AdapterResult<Array> {
        self.0.decode(k, v, q, scale)
    }
    fn window(&mut self, k: &Array, v: &Array, q: &Array, scale: f32) -> AdapterResult<Array> {
        self.0.window(k, v, q, scale)
    }
    fn extract(&self, row: usize) -> AdapterResult<Serial> {
        self.0.extract(row)
    }
    fn filter(&mut self, keep: &[usize]) -> AdapterResult<()> {
        self.0.filter(keep)
    }
    fn trim(&mut self, n: usize) -> AdapterResult<usize> {
        self.0.trim(n)
    }
    fn trim_rows(&mut self, n: &[usize]) -> AdapterResult<Vec<usize>> {
        let most = n.iter().copied().max().unwrap_or(0);
        self.0.trim(most)?;
        Ok(n.to_vec())
    }
    fn row_state(&self, row: usize) -> AdapterResult<[Array; 2]> {
        self.0.row_state(row)
    }
}

struct BuggedRollback;

impl Adapter for BuggedRollback {
    const NAME: &'static str = "kvsim-uniform-rollback";
    fn supports() -> Supports {
        Kvsim::supports()
    }
    type Serial = Serial;
    type Rows = UniformRollback;
    fn serial(g: &Geometry) -> AdapterResult<Serial> {
        Kvsim::serial(g)
    }
}

#[test]
fn kvsims_own_linear_caches_pass_through_the_adapter() {
    let report = check::<Kvsim>(CheckOptions { seeds: 24, ops: 80, ..CheckOptions::default() });
    let failures: Vec<String> =
        report.failures.iter().map(|f| format!("seed {}: [{}] {}", f.seed, f.check, f.message)).collect();
    assert!(failures.is_empty(), "{failures:#?}");
    assert!(report.applied > 24 * 40, "{} ops applied", report.applied);
    assert!(report.checks > 1000, "{} checks", report.checks);
    for kind in ["admit", "solo_window", "solo_decode", "solo_trim", "merge", "join", "decode", "window", "trim"] {
        assert!(
            report.ops_by_kind.get(kind).copied().unwrap_or(0) > 0,
            "{kind} never applied: {:?}",
            report.ops_by_kind
        );
    }
    for kind in ["extract", "filter"] {
        assert!(
            report.ops_by_kind.get(kind).copied().unwrap_or(0) > 0,
            "{kind} never applied: {:?}",
            report.ops_by_kind
        );
    }
}

#[test]
fn a_filter_that_loses_the_order_is_caught_shrunk_and_replayed() {
    let report = check::<Bugged>(CheckOptions { seeds: 24, ops: 80, ..CheckOptions::default() });
    let found = report.failures.first().expect("the unordered filter is caught");
    eprintln!(
        "seed {} [{}] {}: {} ops shrunk to {}: {:?}",
        found.seed,
        found.check,
        found.message,
        found.ops_before,
        found.shrunk.ops.len(),
        found.shrunk.ops
    );
    assert!(found.shrunk.ops.len() < found.ops_before, "{} -> {}", found.ops_before, found.shrunk.ops.len());
    assert!(found.shrunk.ops.len() <= 12, "{:?}", found.shrunk.ops);
    let again = replay::<Bugged>(&found.shrunk, DeviceChoice::Cpu);
    match &again.trace.outcome {
        Outcome::Fail { check, .. } => assert_eq!(check, &found.check),
        Outcome::Pass => panic!("the shrunk trace passes on replay"),
    }
    // The same ops pass against the correct rows.
    let fixed = crate::sim::run_in(
        &registry::<Kvsim>(),
        found.shrunk.seed,
        SimConfig { families: vec![Kvsim::NAME.to_string()], ..found.shrunk.config.clone() },
        Some(found.shrunk.ops.clone()),
        DeviceChoice::Cpu,
        None,
        &mut NoObserver,
    );
    assert!(!fixed.failed(), "{:?}", fixed.trace.outcome);
}

#[test]
fn a_rollback_that_drops_the_most_from_every_row_is_caught_and_shrunk() {
    let report = check::<BuggedRollback>(CheckOptions { seeds: 24, ops: 80, ..CheckOptions::default() });
    let found = report.failures.first().expect("the uniform rollback is caught");
    eprintln!("seed {} [{}] {}: {:?}", found.seed, found.check, found.message, found.shrunk.ops);
    assert!(found.shrunk.ops.len() < found.ops_before, "{} -> {}", found.ops_before, found.shrunk.ops.len());
    assert!(
        found.shrunk.ops.iter().any(|op| matches!(op, crate::sim::ops::Op::Trim { bypass: true, .. })),
        "{:?}",
        found.shrunk.ops
    );
    let again = replay::<BuggedRollback>(&found.shrunk, DeviceChoice::Cpu);
    assert!(matches!(&again.trace.outcome, Outcome::Fail { check, .. } if check == &found.check));
    let fixed = crate::sim::run_in(
        &registry::<Kvsim>(),
        found.shrunk.seed,
        SimConfig { families: vec![Kvsim::NAME.to_string()], ..found.shrunk.config.clone() },
        Some(found.shrunk.ops.clone()),
        DeviceChoice::Cpu,
        None,
        &mut NoObserver,
    );
    assert!(!fixed.failed(), "{:?}", fixed.trace.outcome);
}
