//! `kvsim soak`: one long simulation that watches memory. Seeds run back to back in one process; after every seed
//! (when its world, caches and twins are dropped) a [`MemorySample`] records MLX's active, cached and peak memory
//! and the process's resident set. The verdict ([`Verdict`]) fails when memory grows after warm-up: the level of the
//! last window of samples must stay within `tolerance` (1.1x) of the level just after warm-up, for MLX active memory
//! and for the RSS outside MLX's allocator cache. A leak of one buffer per op, a cache that never lets go of a request, or a lazy graph that grows
//! across steps (bug catalog #11) all show as growth over a million ops.
//!
//! What is measured, precisely:
//! - MLX memory: `mlx::core::get_active_memory`, `get_cache_memory`, `get_peak_memory` (MLX 0.32.2, through mlx-rs'
//!   `memory` module); the peak is reset when warm-up ends, so the reported peak is the peak after warm-up.
//! - RSS: the second field of `/proc/self/statm` (resident pages) times the page size; `None` off Linux.
//! - What is judged: MLX active memory, and `rss - mlx_cache` (the resident set outside MLX's allocator cache). MLX
//!   keeps freed buffers in a cache for reuse (bounded by its cache limit) and keeps one for each new buffer size a
//!   seed asks for, so the raw RSS climbs with the cache for a while as new shapes appear: measured on a 20,000-op
//!   CPU soak (16-core Xeon), raw RSS grew 1.71x after warm-up while `rss - mlx_cache` grew 1.02x and MLX active
//!   memory stayed 0 between seeds. A leak holds memory outside that cache (host vectors, live MLX arrays, which
//!   count as active), so those are the judged metrics; raw RSS and the cache level are reported beside them.
//!
//! Levels: a window's level is the maximum over its samples (a leak raises every sample; a transient spike inside one
//! seed is not sampled at all, since samples are taken between seeds). Levels below [`FLOOR_BYTES`] count as that
//! floor: between seeds MLX's active memory is near zero, and a ratio of a few kilobytes says nothing.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use serde::{Deserialize, Serialize};

/// Levels below this count as this (1 MiB) in the growth ratio.
pub const FLOOR_BYTES: u64 = 1 << 20;

/// One observation of memory, taken between seeds.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MemorySample {
    /// Ops completed when the sample was taken.
    pub ops: u64,
    /// Seeds completed.
    pub seeds: u64,
    /// Seconds since the soak started.
    pub seconds: f64,
    /// MLX bytes in active use.
    pub mlx_active: u64,
    /// MLX bytes held in its allocator cache.
    pub mlx_cache: u64,
    /// MLX peak bytes (since the last reset).
    pub mlx_peak: u64,
    /// Resident set size of the process in bytes (0 when unknown).
    pub rss: u64,
    /// Bytes in live heap allocations (glibc `mallinfo2`: `uordblks + hblkhd`; 0 where the heap is not counted,
    /// [`SoakReport::heap_counted`]). MLX's CPU buffers, its allocator cache included, are heap allocations, so
    /// `heap_in_use - mlx_cache` is what the process holds live outside that cache: a leak raises it, fragmentation
    /// does not.
    #[serde(default)]
    pub heap_in_use: u64,
    /// Bytes that glibc's malloc holds free inside its arenas (`mallinfo2().fordblks`; 0 where the heap is not
    /// counted): freed memory not yet returned to the system, which RSS counts and a leak does not explain.
    #[serde(default)]
    pub heap_free: u64,
}

/// The process's resident set size in bytes, from `/proc/self/statm`.
pub fn rss_bytes() -> Option<u64> {
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * page_size())
}

/// The `malloc` whose heap a soak counts and trims: glibc's unless the program says otherwise with
/// [`use_allocator`] (the `kvsim` binary puts mimalloc in `malloc`'s place). Counters of an allocator that does not
/// serve `malloc` would read as a flat, empty heap, so none are reported then.
#[derive(Debug, Clone, Copy)]
pub struct HeapAllocator {
    /// Named in the soak's report.
    pub name: &'static str,
    /// `(bytes in live allocations, free bytes the allocator keeps)`, or `None` where they are not counted.
    pub counters: fn() -> Option<(u64, u64)>,
    /// Returns the allocator's free memory to the system (`kvsim soak --trim`).
    pub trim: fn(),
}

/// glibc's malloc: `mallinfo2` counts the heap, `malloc_trim(0)` trims it. Its counters are `None` off glibc and
/// where another allocator serves `malloc` in this process (probed once: a 4 MiB `malloc` that glibc's counters do
/// not see).
pub const GLIBC_MALLOC: HeapAllocator =
    HeapAllocator { name: "glibc malloc", counters: glibc_counters, trim: glibc_trim };

static ALLOCATOR: std::sync::OnceLock<HeapAllocator> = std::sync::OnceLock::new();

/// Names the allocator that serves `malloc` in this process, once, before the first soak; `false` (and nothing
/// changed) when one was already named or a soak already asked.
pub fn use_allocator(allocator: HeapAllocator) -> bool {
    ALLOCATOR.set(allocator).is_ok()
}

/// The allocator a soak counts and trims.
pub fn allocator() -> HeapAllocator {
    *ALLOCATOR.get_or_init(|| GLIBC_MALLOC)
}

/// The heap's counters `(in use, free)` from [`allocator`]; `None` where it does not count them.
pub fn heap_bytes() -> Option<(u64, u64)> {
    (allocator().counters)()
}

/// Returns the heap's free memory to the system ([`allocator`]'s `trim`).
pub fn trim_heap() {
    (allocator().trim)()
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn glibc_counters() -> Option<(u64, u64)> {
    static SERVES_MALLOC: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let counts = || {
        // SAFETY: mallinfo2 only reads the allocator's statistics (glibc >= 2.33).
        let m = unsafe { libc::mallinfo2() };
        ((m.uordblks + m.hblkhd) as u64, m.fordblks as u64)
    };
    let serves = *SERVES_MALLOC.get_or_init(|| {
        const PROBE: usize = 4 << 20;
        let (before, _) = counts();
        // `black_box`: an allocation nothing uses is one the compiler may take out, with its `free`.
        // SAFETY: a plain allocation, freed below and never read or written.
        let p = std::hint::black_box(unsafe { libc::malloc(PROBE) });
        if p.is_null() {
            return false;
        }
        let (during, _) = counts();
        // SAFETY: `p` came from `malloc` above and is freed once.
        unsafe { libc::free(p) };
        // Other threads allocate and free beside the probe: half of it is far above what they move meanwhile.
        during >= before + (PROBE as u64) / 2
    });
    serves.then(counts)
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn glibc_counters() -> Option<(u64, u64)> {
    None
}

fn glibc_trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim releases free pages of the arenas; it touches no live allocation.
    unsafe {
        libc::malloc_trim(0);
    }
}

fn page_size() -> u64 {
    // Linux on x86-64 and aarch64 as kvsim runs them; `getconf PAGESIZE` would say the same.
    4096
}

/// A sample of memory now.
pub fn sample(ops: u64, seeds: u64, seconds: f64) -> MemorySample {
    let get = |r: mlx_rs::error::Result<usize>| r.map(|x| x as u64).unwrap_or(0);
    let (heap_in_use, heap_free) = heap_bytes().unwrap_or((0, 0));
    MemorySample {
        ops,
        seeds,
        seconds,
        mlx_active: get(mlx_rs::memory::active_memory()),
        mlx_cache: get(mlx_rs::memory::cache_memory()),
        mlx_peak: get(mlx_rs::memory::peak_memory()),
        rss: rss_bytes().unwrap_or(0),
        heap_in_use,
        heap_free,
    }
}

/// When a soak stops.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum Budget {
    /// After at least this many ops.
    Ops(u64),
    /// After this many seconds (no new seed starts later).
    Seconds(f64),
}

/// Soak settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct SoakConfig {
    pub budget: Budget,
    /// First seed; seeds run `first, first + 1, ...`.
    pub first: u64,
    /// Fraction of the budget that is warm-up (default 0.1): samples before it are reported, never judged.
    pub warmup: f64,
    /// Fraction of the budget each judged window spans (default 0.1): the post-warm-up window starts where warm-up
    /// ends, the final window ends at the last sample.
    pub window: f64,
    /// Allowed growth: final level at most `tolerance` x the post-warm-up level (default 1.1).
    pub tolerance: f64,
    /// Return the heap's free memory to the system ([`trim_heap`]) before every sample (`kvsim soak --trim`), so
    /// that RSS counts what the process holds rather than what glibc keeps free for reuse.
    #[serde(default)]
    pub trim: bool,
}

impl SoakConfig {
    pub fn new(budget: Budget, first: u64) -> SoakConfig {
        SoakConfig { budget, first, warmup: 0.1, window: 0.1, tolerance: 1.1, trim: false }
    }

    /// Where a sample lies in the budget, in [0, 1].
    fn progress(&self, s: &MemorySample) -> f64 {
        match self.budget {
            Budget::Ops(n) => s.ops as f64 / n.max(1) as f64,
            Budget::Seconds(t) => s.seconds / t.max(1e-9),
        }
    }

    fn done(&self, ops: u64, seconds: f64) -> bool {
        match self.budget {
            Budget::Ops(n) => ops >= n,
            Budget::Seconds(t) => seconds >= t,
        }
    }
}

/// What one seed did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeedRun {
    /// Ops applied (skipped ones excluded).
    pub ops: u64,
    /// A check failed.
    pub failed: bool,
}

/// One metric's growth verdict.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct Growth {
    /// Level (max) over the post-warm-up window, bytes.
    pub post_warmup: u64,
    /// Level (max) over the final window, bytes.
    pub final_level: u64,
    /// `max(final, FLOOR) / max(post_warmup, FLOOR)`.
    pub ratio: f64,
    pub ok: bool,
}

/// The soak's verdict.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    pub mlx_active: Growth,
    /// The judged resident set: `rss - mlx_cache`.
    pub rss_outside_cache: Growth,
    /// Raw RSS and MLX's allocator cache: reported, not judged (their `ok` says whether they stayed within tolerance).
    pub rss: Growth,
    pub mlx_cache: Growth,
    /// Live heap bytes outside MLX's cache (`heap_in_use - mlx_cache`, [`MemorySample::heap_in_use`]) and the
    /// heap's free bytes: reported, not judged; they tell a leak (live bytes grow) from fragmentation (free bytes
    /// grow while live bytes stay).
    #[serde(default)]
    pub heap_outside_cache: Growth,
    #[serde(default)]
    pub heap_free: Growth,
    /// Samples judged in each window.
    pub post_warmup_samples: usize,
    pub final_samples: usize,
    /// Memory held steady (both metrics within tolerance) and enough samples existed to judge.
    pub pass: bool,
    /// Why it did not pass, when it did not.
    pub reason: Option<String>,
}

fn growth(post: &[&MemorySample], fin: &[&MemorySample], f: impl Fn(&MemorySample) -> u64, tol: f64) -> Growth {
    let post_warmup = post.iter().map(|s| f(s)).max().unwrap_or(0);
    let final_level = fin.iter().map(|s| f(s)).max().unwrap_or(0);
    let ratio = final_level.max(FLOOR_BYTES) as f64 / post_warmup.max(FLOOR_BYTES) as f64;
    Growth { post_warmup, final_level, ratio, ok: ratio <= tol }
}

/// Every metric [`judge`] takes a level of, in the order of its `Growth` fields: MLX active, RSS outside MLX's cache,
/// raw RSS, MLX's cache, live heap outside MLX's cache, free heap.
const METRICS: [fn(&MemorySample) -> u64; 6] = [
    |s| s.mlx_active,
    |s| s.rss.saturating_sub(s.mlx_cache),
    |s| s.rss,
    |s| s.mlx_cache,
    |s| s.heap_in_use.saturating_sub(s.mlx_cache),
    |s| s.heap_free,
];

/// Buckets of the budget a [`SampleLog`] keeps maxima for (each 1/1000 of the budget).
pub const BUCKETS: u64 = 1000;

/// The samples a soak keeps, bounded whatever the run's length: for every bucket of 1/[`BUCKETS`] of the budget,
/// only the samples holding a `METRICS` maximum in that bucket (at most six, fewer when one sample holds several).
/// A window's level is a maximum, so [`judge`] over the kept samples gives the levels it gives over all of them
/// wherever the windows' edges fall on bucket edges (the warm-up window's do with the default fractions; the final
/// window's start, `reached - window`, may cut a bucket, and then that one bucket's maxima are placed by where they
/// were sampled). At most [`MAX_KEPT`] samples, about 430 KB (a soak used to keep every seed's sample: 1.2 MB
/// at a million ops, growing). The whole bound is reserved when the log is made, so the log's own growth never shows
/// in the heap it samples (a doubling of its vector late in a run once read as a 0.3 MiB rise of the live heap).
#[derive(Debug, Clone)]
pub struct SampleLog {
    bucket: Option<u64>,
    best: [Option<MemorySample>; 6],
    kept: Vec<MemorySample>,
}

/// Most samples a [`SampleLog`] keeps: six per bucket, one bucket more for the budget's last edge.
pub const MAX_KEPT: usize = 6 * (BUCKETS as usize + 1);

impl Default for SampleLog {
    fn default() -> Self {
        SampleLog { bucket: None, best: [None; 6], kept: Vec::with_capacity(MAX_KEPT) }
    }
}

impl SampleLog {
    /// Adds `s`, taken under `cfg`.
    pub fn push(&mut self, cfg: &SoakConfig, s: MemorySample) {
        let b = (cfg.progress(&s) * BUCKETS as f64).floor().max(0.0) as u64;
        if self.bucket != Some(b) {
            self.flush();
            self.bucket = Some(b);
        }
        for (best, f) in self.best.iter_mut().zip(METRICS) {
            if best.is_none_or(|x| f(&s) > f(&x)) {
                *best = Some(s);
            }
        }
    }

    fn flush(&mut self) {
        let mut held: Vec<MemorySample> = self.best.iter_mut().filter_map(Option::take).collect();
        held.sort_by(|a, b| a.ops.cmp(&b.ops).then(a.seconds.total_cmp(&b.seconds)));
        held.dedup();
        self.kept.extend(held);
    }

    /// The kept samples in the order they were taken.
    pub fn into_samples(mut self) -> Vec<MemorySample> {
        self.flush();
        self.kept
    }

    /// Samples held now (kept plus the open bucket's).
    pub fn len(&self) -> usize {
        self.kept.len() + self.best.iter().flatten().count()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Judges samples taken under `cfg`: the post-warm-up window is `[warmup, warmup + window)` of the budget, the final
/// window the last `window` of the progress actually reached. Fewer than one sample in either window, or windows
/// that overlap (a run stopped early), is "not enough to judge": `pass = false` with the reason.
pub fn judge(cfg: &SoakConfig, samples: &[MemorySample]) -> Verdict {
    let reached = samples.last().map_or(0.0, |s| cfg.progress(s));
    let post: Vec<&MemorySample> = samples
        .iter()
        .filter(|s| {
            let p = cfg.progress(s);
            p >= cfg.warmup && p < cfg.warmup + cfg.window
        })
        .collect();
    let fin_start = (reached - cfg.window).max(cfg.warmup + cfg.window);
    let fin: Vec<&MemorySample> = samples.iter().filter(|s| cfg.progress(s) >= fin_start).collect();
    let [mlx_active, rss_outside_cache, rss, mlx_cache, heap_outside_cache, heap_free] =
        METRICS.map(|f| growth(&post, &fin, f, cfg.tolerance));
    let reason = if post.is_empty() || fin.is_empty() {
        Some(format!(
            "not enough samples to judge ({} after warm-up, {} in the final window; the run reached {:.0}% of its budget)",
            post.len(),
            fin.len(),
            100.0 * reached
        ))
    } else if !mlx_active.ok || !rss_outside_cache.ok {
        Some(format!(
            "memory grew after warm-up: MLX active {:.3}x, RSS outside MLX's cache {:.3}x (allowed {}x)",
            mlx_active.ratio, rss_outside_cache.ratio, cfg.tolerance
        ))
    } else {
        None
    };
    Verdict {
        mlx_active,
        rss_outside_cache,
        rss,
        mlx_cache,
        heap_outside_cache,
        heap_free,
        post_warmup_samples: post.len(),
        final_samples: fin.len(),
        pass: reason.is_none(),
        reason,
    }
}

/// Everything a soak measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SoakReport {
    pub config: SoakConfig,
    pub seeds: u64,
    pub ops: u64,
    pub failures: u64,
    /// Seeds whose run failed a check (the soak keeps going; `kvsim sim --seed S` reproduces one), and those that
    /// killed the soak's process (`crashed`).
    pub failed_seeds: Vec<u64>,
    /// Seeds whose run killed the process running the soak (`kvsim soak` runs it in a worker process: a signal, an
    /// abort, an out-of-memory kill). Each is also a failure; a fresh worker ran the soak again without it.
    #[serde(default)]
    pub crashed: u64,
    pub seconds: f64,
    pub ops_per_s: f64,
    /// Stopped by the caller's flag (Ctrl-C) before the budget.
    pub interrupted: bool,
    /// The first sample (before any seed), the one where warm-up ended, and the last.
    pub at_start: MemorySample,
    pub at_warmup: Option<MemorySample>,
    pub at_end: MemorySample,
    pub verdict: Verdict,
    /// At most 400 of the judged samples ([`SampleLog`]), evenly thinned.
    pub samples: Vec<MemorySample>,
    /// The allocator serving `malloc` ([`allocator`]).
    #[serde(default = "allocator_before_it_was_said")]
    pub allocator: String,
    /// Whether the heap fields count anything: `false` where the allocator does not count its heap (the heap
    /// fields and their growths are then 0 and say nothing; RSS and MLX memory are judged all the same).
    #[serde(default = "heap_counted_before_it_was_said")]
    pub heap_counted: bool,
}

fn allocator_before_it_was_said() -> String {
    GLIBC_MALLOC.name.to_string()
}

fn heap_counted_before_it_was_said() -> bool {
    true
}

/// Runs seeds `cfg.first, cfg.first + 1, ...` through `run_seed` until the budget is spent or `stop` is set, sampling
/// memory after every seed; `on_seed` sees every sample (progress display). The MLX peak counter is reset when
/// warm-up ends.
pub fn soak(
    cfg: SoakConfig,
    stop: &AtomicBool,
    run_seed: impl FnMut(u64) -> SeedRun,
    on_seed: impl FnMut(&MemorySample, u64),
) -> SoakReport {
    soak_seeds(cfg, (0u64..).map(|i| cfg.first.wrapping_add(i)), stop, run_seed, on_seed)
}

/// [`soak`] over the seeds `seeds` hands out (`kvsim soak`'s worker: those its parent feeds it), ending early (not
/// interrupted) when they run out.
pub fn soak_seeds(
    cfg: SoakConfig,
    seeds: impl IntoIterator<Item = u64>,
    stop: &AtomicBool,
    mut run_seed: impl FnMut(u64) -> SeedRun,
    mut on_seed: impl FnMut(&MemorySample, u64),
) -> SoakReport {
    let mut feed = seeds.into_iter();
    let start = Instant::now();
    let at_start = sample(0, 0, 0.0);
    let mut samples = SampleLog::default();
    samples.push(&cfg, at_start);
    let (mut ops, mut seeds, mut failures) = (0u64, 0u64, 0u64);
    let mut failed_seeds = vec![];
    let mut at_warmup = None;
    let mut interrupted = false;
    while !cfg.done(ops, start.elapsed().as_secs_f64()) {
        if stop.load(Ordering::SeqCst) {
            interrupted = true;
            break;
        }
        let Some(seed) = feed.next() else { break };
        let r = run_seed(seed);
        ops += r.ops;
        seeds += 1;
        if r.failed {
            failures += 1;
            failed_seeds.push(seed);
        }
        if cfg.trim {
            trim_heap();
        }
        let s = sample(ops, seeds, start.elapsed().as_secs_f64());
        if at_warmup.is_none() && cfg.progress(&s) >= cfg.warmup {
            at_warmup = Some(s);
            let _ = mlx_rs::memory::reset_peak_memory();
        }
        samples.push(&cfg, s);
        on_seed(&s, failures);
    }
    let seconds = start.elapsed().as_secs_f64();
    let at_end = sample(ops, seeds, seconds);
    samples.push(&cfg, at_end);
    let samples = samples.into_samples();
    let verdict = judge(&cfg, &samples);
    SoakReport {
        config: cfg,
        seeds,
        ops,
        failures,
        failed_seeds,
        crashed: 0,
        seconds,
        ops_per_s: ops as f64 / seconds.max(1e-9),
        interrupted,
        at_start,
        at_warmup,
        at_end,
        verdict,
        samples: thin(&samples, 400),
        allocator: allocator().name.to_string(),
        heap_counted: heap_bytes().is_some(),
    }
}

/// At most `max` samples, evenly spaced, first and last kept.
pub fn thin(samples: &[MemorySample], max: usize) -> Vec<MemorySample> {
    if samples.len() <= max || max < 2 {
        return samples.to_vec();
    }
    let n = samples.len() - 1;
    (0..max).map(|i| samples[i * n / (max - 1)]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(ops: u64, active: u64, rss: u64) -> MemorySample {
        MemorySample {
            ops,
            seeds: ops / 10,
            seconds: ops as f64,
            mlx_active: active,
            mlx_cache: 0,
            mlx_peak: 0,
            rss,
            heap_in_use: 0,
            heap_free: 0,
        }
    }

    const MIB: u64 = 1 << 20;

    fn steady(n: u64, f: impl Fn(u64) -> (u64, u64)) -> Vec<MemorySample> {
        (0..=n)
            .map(|i| {
                let (a, r) = f(i);
                s(i * 10, a, r)
            })
            .collect()
    }

    /// The bounded log keeps at most six samples a bucket, and judging what it kept gives the levels and verdict of
    /// judging every sample (windows on bucket edges), for a steady run and for late leaks of each judged metric.
    #[test]
    fn bounded_log_judges_like_every_sample() {
        let n = 50_000u64;
        let cfg = SoakConfig::new(Budget::Ops(n * 10), 0);
        let noise = |i: u64| (i.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 54) * 1024;
        let runs: [Box<dyn Fn(u64) -> MemorySample>; 3] = [
            Box::new(|i| MemorySample {
                mlx_cache: 8 * MIB + noise(i),
                heap_free: noise(i + 1),
                ..s(i * 10, MIB, 40 * MIB + noise(i))
            }),
            Box::new(|i| s(i * 10, MIB + if i > n * 95 / 100 { (i - n * 95 / 100) * 512 } else { 0 }, 40 * MIB)),
            Box::new(|i| MemorySample { heap_in_use: 30 * MIB + i * 1024, ..s(i * 10, 0, 40 * MIB + i * 1024) }),
        ];
        for (k, run) in runs.iter().enumerate() {
            let all: Vec<MemorySample> = (0..=n).map(run).collect();
            let mut log = SampleLog::default();
            all.iter().for_each(|x| log.push(&cfg, *x));
            assert!(log.len() <= MAX_KEPT, "run {k}: {} kept", log.len());
            let kept = log.into_samples();
            assert!(kept.windows(2).all(|w| w[0].ops < w[1].ops), "run {k}: kept in order, no duplicates");
            let (a, b) = (judge(&cfg, &all), judge(&cfg, &kept));
            let levels = |v: &Verdict| {
                [v.mlx_active, v.rss_outside_cache, v.rss, v.mlx_cache, v.heap_outside_cache, v.heap_free]
                    .map(|g| (g.post_warmup, g.final_level, g.ok))
            };
            assert_eq!(levels(&a), levels(&b), "run {k}");
            assert_eq!((a.pass, k == 0), (b.pass, a.pass), "run {k}: steady passes, leaks fail");
        }
    }

    #[test]
    fn steady_memory_passes_and_warmup_growth_is_ignored() {
        let cfg = SoakConfig::new(Budget::Ops(1000), 0);
        // Grows during warm-up (first 100 ops), flat afterwards with noise under 5%.
        let samples =
            steady(100, |i| if i < 10 { (i * MIB, (50 + 5 * i) * MIB) } else { (8 * MIB, 100 * MIB + (i % 3) * MIB) });
        let v = judge(&cfg, &samples);
        assert!(v.pass, "{v:?}");
        assert_eq!(v.rss.post_warmup, 102 * MIB);
        assert!(v.post_warmup_samples >= 9 && v.final_samples >= 9, "{v:?}");
    }

    #[test]
    fn growth_after_warmup_fails_on_either_metric() {
        let cfg = SoakConfig::new(Budget::Ops(1000), 0);
        // RSS leaks 1 MiB per 10 ops: 100 MiB at 100 ops, 190 MiB at the end.
        let leak = steady(100, |i| (4 * MIB, (90 + i) * MIB));
        let v = judge(&cfg, &leak);
        assert!(!v.pass && !v.rss_outside_cache.ok && v.mlx_active.ok, "{v:?}");
        assert!(v.reason.unwrap().contains("grew"));
        // MLX active grows by 20%: fails even though RSS is flat.
        let mlx = steady(100, |i| (if i < 50 { 10 * MIB } else { 12 * MIB }, 100 * MIB));
        let v = judge(&cfg, &mlx);
        assert!(!v.pass && !v.mlx_active.ok && v.rss_outside_cache.ok, "{v:?}");
        assert!((v.mlx_active.ratio - 1.2).abs() < 1e-9);
    }

    #[test]
    fn mlx_cache_growth_alone_is_reported_not_judged() {
        let cfg = SoakConfig::new(Budget::Ops(1000), 0);
        // The allocator cache grows by 60 MiB and RSS with it: the resident set outside the cache is flat (40 MiB).
        let cached = steady(100, |i| (2 * MIB, (40 + 60 * i / 100) * MIB));
        let with_cache: Vec<MemorySample> =
            cached.iter().map(|s| MemorySample { mlx_cache: s.rss - 40 * MIB, ..*s }).collect();
        let v = judge(&cfg, &with_cache);
        assert!(v.pass, "{v:?}");
        assert!(!v.rss.ok && !v.mlx_cache.ok && v.rss_outside_cache.ok, "{v:?}");
        // The same RSS growth with nothing in the cache is a leak.
        let v = judge(&cfg, &cached);
        assert!(!v.pass && !v.rss_outside_cache.ok, "{v:?}");
    }

    #[test]
    fn tiny_levels_count_as_the_floor() {
        let cfg = SoakConfig::new(Budget::Ops(1000), 0);
        // MLX active between seeds: 0 bytes after warm-up, 64 KiB at the end: noise, not a leak.
        let samples = steady(100, |i| (if i > 90 { 64 << 10 } else { 0 }, 100 * MIB));
        let v = judge(&cfg, &samples);
        assert!(v.pass, "{v:?}");
        assert_eq!(v.mlx_active.ratio, 1.0);
    }

    #[test]
    fn a_run_stopped_before_the_windows_separate_is_not_judged_a_pass() {
        let cfg = SoakConfig::new(Budget::Ops(1000), 0);
        let samples = steady(15, |_| (MIB, 100 * MIB));
        let v = judge(&cfg, &samples);
        assert!(!v.pass);
        assert!(v.reason.unwrap().contains("not enough samples"));
    }

    #[test]
    fn time_budgets_judge_by_seconds() {
        let cfg = SoakConfig::new(Budget::Seconds(100.0), 0);
        let samples: Vec<MemorySample> =
            (0..=100).map(|i| MemorySample { seconds: i as f64, ..s(i * 1000, MIB, (100 + i) * MIB) }).collect();
        let v = judge(&cfg, &samples);
        assert!(!v.rss.ok, "{v:?}");
    }

    #[test]
    fn thinning_keeps_ends_and_bounds_the_count() {
        let samples = steady(1000, |i| (i, i));
        let t = thin(&samples, 50);
        assert_eq!(t.len(), 50);
        assert_eq!(t[0], samples[0]);
        assert_eq!(t[49], samples[1000]);
        assert_eq!(thin(&samples[..10], 50).len(), 10);
    }

    #[test]
    fn soak_runs_until_the_budget_and_stops_on_the_flag() {
        let stop = AtomicBool::new(false);
        let mut seen = vec![];
        let r = soak(
            SoakConfig::new(Budget::Ops(100), 7),
            &stop,
            |seed| {
                seen.push(seed);
                SeedRun { ops: 10, failed: seed == 9 }
            },
            |_, _| {},
        );
        assert_eq!(r.ops, 100);
        assert_eq!(r.seeds, 10);
        assert_eq!(seen, (7..17).collect::<Vec<_>>());
        assert_eq!(r.failed_seeds, vec![9]);
        assert!(!r.interrupted);
        assert!(r.at_warmup.is_some_and(|s| s.ops == 10));
        assert!(r.at_end.rss > 0);
        // The flag stops it between seeds, and the report still says what ran.
        let stop = AtomicBool::new(false);
        let r = soak(
            SoakConfig::new(Budget::Ops(1000), 0),
            &stop,
            |seed| {
                if seed == 4 {
                    stop.store(true, Ordering::SeqCst);
                }
                SeedRun { ops: 10, failed: false }
            },
            |_, _| {},
        );
        assert!(r.interrupted);
        assert_eq!(r.seeds, 5);
        assert!(!r.verdict.pass);
    }

    #[test]
    fn heap_counters_see_a_live_allocation_and_trim_keeps_it() {
        // This test binary leaves `malloc` to the C library and names no other allocator.
        assert_eq!(allocator().name, GLIBC_MALLOC.name);
        if !cfg!(all(target_os = "linux", target_env = "gnu")) {
            assert_eq!(heap_bytes(), None);
            return;
        }
        // The counters are the whole process's, and other tests allocate and free beside this one: hold 128 MiB
        // and ask for half of it, far above what the other tests' churn moves.
        let (before, _) = heap_bytes().expect("glibc serves malloc here");
        let held: Vec<Vec<u8>> = (0..2048).map(|i| vec![i as u8; 64 << 10]).collect();
        let (during, _) = heap_bytes().unwrap();
        assert!(during >= before + (64 << 20), "{before} -> {during}");
        trim_heap();
        assert!(heap_bytes().unwrap().0 >= before + (64 << 20), "trim must not release live allocations");
        assert_eq!(held.iter().map(|v| v[1] as usize).sum::<usize>(), (0..2048).map(|i| i % 256).sum::<usize>());
        drop(held);
        // A trimmed soak samples after every seed and reports the heap beside RSS, and which heap it counted.
        let stop = AtomicBool::new(false);
        let r = soak(
            SoakConfig { trim: true, ..SoakConfig::new(Budget::Ops(20), 0) },
            &stop,
            |_| SeedRun { ops: 10, failed: false },
            |_, _| {},
        );
        assert!(r.at_end.heap_in_use > 0 && r.config.trim);
        assert!(r.heap_counted);
        assert_eq!(r.allocator, "glibc malloc");
        // A report written before the allocator was named reads as glibc's, counted.
        let mut v = serde_json::to_value(&r).unwrap();
        let o = v.as_object_mut().unwrap();
        o.remove("allocator");
        o.remove("heap_counted");
        let old: SoakReport = serde_json::from_value(v).unwrap();
        assert_eq!((old.allocator.as_str(), old.heap_counted), ("glibc malloc", true));
    }
}
