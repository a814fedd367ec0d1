//! kvsim's simulator over this crate's cache: the adapter (the tutorial's code, README.md), the correct cache's
//! run, and the planted bug caught, shrunk and replayed.
#![allow(clippy::print_stderr)]

use byo_cache::{BatchCache, Planted, Shape, SoloCache};
use kvsim_harness::byoc::{
    self, Adapter, AdapterResult, CheckOptions, Geometry, RowsUnderTest, SerialUnderTest, Supports,
};
use kvsim_harness::sim::trace::Outcome;
use kvsim_harness::sim::DeviceChoice;
use mlx_rs::Array;

// ----- the adapter ------------------------------------------------------------------------------------------------

struct Solo(SoloCache);
struct Rows(BatchCache);

impl SerialUnderTest for Solo {
    fn offset(&self) -> usize {
        self.0.offset()
    }
    fn window(&mut self, k: &Array, v: &Array, q: &Array, scale: f32) -> AdapterResult<Array> {
        Ok(self.0.window(k, v, q, scale)?)
    }
    fn trim(&mut self, n: usize) -> AdapterResult<usize> {
        Ok(self.0.trim(n)?)
    }
    fn state(&self) -> AdapterResult<[Array; 2]> {
        Ok(self.0.state())
    }
}

impl RowsUnderTest for Rows {
    type Serial = Solo;
    fn merge(rows: Vec<Solo>) -> AdapterResult<Rows> {
        Ok(Rows(BatchCache::merge(rows.into_iter().map(|s| s.0).collect())?))
    }
    fn rows(&self) -> usize {
        self.0.rows()
    }
    fn offsets(&self) -> Vec<usize> {
        self.0.offsets().to_vec()
    }
    fn decode(&mut self, k: &Array, v: &Array, q: &Array, scale: f32) -> AdapterResult<Array> {
        Ok(self.0.window(k, v, q, scale)?)
    }
    fn window(&mut self, k: &Array, v: &Array, q: &Array, scale: f32) -> AdapterResult<Array> {
        Ok(self.0.window(k, v, q, scale)?)
    }
    fn extract(&self, row: usize) -> AdapterResult<Solo> {
        Ok(Solo(self.0.extract(row)?))
    }
    fn filter(&mut self, keep: &[usize]) -> AdapterResult<()> {
        Ok(self.0.filter(keep)?)
    }
    fn trim(&mut self, n: usize) -> AdapterResult<usize> {
        Ok(self.0.trim(n)?)
    }
    fn row_state(&self, row: usize) -> AdapterResult<[Array; 2]> {
        Ok(self.0.row_state(row)?)
    }
}

fn shape(g: &Geometry) -> Shape {
    Shape { heads_kv: g.heads_kv, head_dim: g.head_dim, dtype: g.dtype }
}

struct Correct;

impl Adapter for Correct {
    const NAME: &'static str = "byo-cache";
    fn supports() -> Supports {
        Supports { serial_trim: true, rows_window: true, rows_trim: true, ..Supports::default() }
    }
    type Serial = Solo;
    type Rows = Rows;
    fn serial(g: &Geometry) -> AdapterResult<Solo> {
        Ok(Solo(SoloCache::new(shape(g), Planted::None)?))
    }
}

struct SharedColumn;

impl Adapter for SharedColumn {
    const NAME: &'static str = "byo-cache-shared-column";
    fn supports() -> Supports {
        Correct::supports()
    }
    type Serial = Solo;
    type Rows = Rows;
    fn serial(g: &Geometry) -> AdapterResult<Solo> {
        Ok(Solo(SoloCache::new(shape(g), Planted::SharedDecodeColumn)?))
    }
}

// ----- the runs ---------------------------------------------------------------------------------------------------

#[test]
fn the_correct_cache_passes_every_seed() {
    let report = byoc::check::<Correct>(CheckOptions { seeds: 200, ops: 100, ..CheckOptions::default() });
    eprintln!(
        "{} seeds, {} ops applied, {} checks: {:?}",
        report.seeds, report.applied, report.checks, report.ops_by_kind
    );
    let failed: Vec<String> =
        report.failures.iter().map(|f| format!("seed {}: [{}] {}", f.seed, f.check, f.message)).collect();
    assert!(failed.is_empty(), "{failed:#?}");
    for kind in ["merge", "join", "decode", "window", "extract", "filter", "trim", "solo_trim"] {
        assert!(report.ops_by_kind.get(kind).is_some_and(|&n| n > 0), "{kind} never ran");
    }
}

#[test]
fn the_shared_column_bug_is_caught_shrunk_and_replayed() {
    let report = byoc::check::<SharedColumn>(CheckOptions { seeds: 20, ops: 100, ..CheckOptions::default() });
    let found = report.failures.first().expect("the planted bug is caught");
    eprintln!("seed {} fails [{}]: {}", found.seed, found.check, found.message);
    eprintln!("ops before shrinking: {}; after: {}", found.ops_before, found.shrunk.ops.len());
    for op in &found.shrunk.ops {
        eprintln!("  {op:?}");
    }
    assert!(found.shrunk.ops.len() <= 8, "{:?}", found.shrunk.ops);
    let again = byoc::replay::<SharedColumn>(&found.shrunk, DeviceChoice::Cpu);
    assert!(matches!(&again.trace.outcome, Outcome::Fail { check, .. } if *check == found.check));
    // The same ops against the correct cache pass.
    let mut fixed = found.shrunk.clone();
    fixed.config.families = vec![Correct::NAME.to_string()];
    assert!(!byoc::replay::<Correct>(&fixed, DeviceChoice::Cpu).failed());
}
