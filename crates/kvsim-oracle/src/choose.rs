//! The choice of the recorded seeds: what a recording exercises ([`features`], [`quant_features`]), where mlx-lm is
//! expected to part from kvsim ([`predicted_root`]), the greedy covers that pick the seeds ([`choose_seeds`],
//! [`choose_family_seeds`]), and `kvsim oracle record --dry-run` ([`describe_choice`]).

use std::collections::{BTreeMap, BTreeSet};

use crate::record::{family_run, record};
use crate::recorder::StepInfo;
use crate::report::step_kinds;
use crate::rules::{mlx_refuses_quant, padding_in_window_rows};
use kvsim_harness::sim::config::{DtypeChoice, SimConfig};
use kvsim_harness::sim::observe::Read;
use kvsim_harness::sim::DeviceChoice;

/// What a recording exercises, for the choice of seeds: its step kinds, its dtype and layout, and the geometries
/// where kvsim and mlx-lm are expected to part (so that every rule and catalog bug gets a trace).
pub fn features(cfg: &SimConfig, infos: &[StepInfo]) -> BTreeSet<String> {
    // Only what comes before the first expected change of state is compared on its own (later divergences are
    // consequences), so only that part counts, plus the kind of that first change.
    let root = predicted_root(cfg, infos);
    let all = infos;
    let infos = &infos[..root.map_or(infos.len(), |(i, _)| i + 1)];
    let mut f = step_kinds(infos);
    if let Some((_, why)) = root {
        f.insert(format!("root/{why}"));
    }
    let wrapped_reads = infos.iter().any(|s| s.read.is_some() && s.wrapped);
    if root.is_none() && wrapped_reads {
        // Expected to agree byte for byte although its rings wrap.
        let dtype = match cfg.dtype {
            DtypeChoice::F32 => "f32",
            DtypeChoice::Bf16 => "bf16",
        };
        let one_position = infos.iter().any(|s| s.l == 1 && s.read == Some(Read::Window) && s.wrapped);
        if !one_position {
            f.insert(format!("clean-after-wrap/{dtype}"));
        }
    }
    let dtype = match cfg.dtype {
        DtypeChoice::F32 => "f32",
        DtypeChoice::Bf16 => "bf16",
    };
    let layout = if cfg.layout.max_size().is_some() { "rotating" } else { "linear" };
    f.insert(format!("config/{dtype}/{layout}"));
    let rotating = layout == "rotating";
    for s in infos {
        let one = s.l == 1 && s.read == Some(Read::Window);
        if rotating && one && s.wrapped {
            f.insert(format!("geometry/{}-one-position-window-after-wrap", s.t));
        }
        if s.t == "batch" && s.read == Some(Read::Decode) && s.wrapped {
            f.insert(format!("geometry/batch-decode-after-wrap/{dtype}"));
        }
        if s.t == "enter" && rotating && !s.emptied.is_empty() && s.nonempty > 0 {
            f.insert("geometry/merge-emptied-ring".into());
        }
        if s.t == "enter"
            && s.how == Some("join")
            && s.offsets.iter().any(|&o| cfg.layout.max_size().is_some_and(|w| o > w))
        {
            f.insert("geometry/join-wrapped-ring".into());
        }
        if s.t == "prefill_chunk" && rotating && s.l == 1 && s.padded {
            f.insert("geometry/padded-singleton-chunk".into());
        }
        if let Some(t) = &s.trim {
            let equal = t.n.iter().all(|&x| x == t.n[0]);
            if !equal {
                f.insert("geometry/per-row-trim".into());
            }
            if rotating && t.bypass && s.wrapped && t.kvsim.as_ref().is_ok_and(|&n| n > 0) && equal {
                f.insert(format!("geometry/{}-bypass-after-wrap", s.t));
            }
            if let Err(e) = &t.kvsim {
                f.insert(format!("geometry/{}-refused-{}", s.t, e.split([' ', '{', '(']).next().unwrap_or("")));
            }
        }
        if s.t == "prefill" && s.padded {
            f.insert(format!("geometry/right-padded-prefill/{layout}"));
        }
        let root_in_op = root.is_some_and(|(ri, _)| all[ri].op == s.op);
        if s.t == "prefill"
            && !root_in_op
            && cfg.layout.max_size().is_some_and(|w| !padding_in_window_rows(s, w).is_empty())
        {
            f.insert("geometry/prefill-padding-in-window".into());
        }
    }
    f
}

/// The first step where mlx-lm is expected to end up in another state than kvsim (a guess from kvsim's side
/// only, for the choice of seeds; the classification uses the oracle's results), and why.
pub fn predicted_root(cfg: &SimConfig, infos: &[StepInfo]) -> Option<(usize, &'static str)> {
    let w = cfg.layout.max_size();
    for (i, s) in infos.iter().enumerate() {
        if let Some(t) = &s.trim {
            let equal = t.n.iter().all(|&x| x == t.n[0]);
            let n = t.n.iter().copied().max().unwrap_or(0);
            match &t.kvsim {
                Ok(_) if !equal => return Some((i, "per-row-trim")),
                Ok(_) if n > 0 && w.is_some() && s.wrapped => return Some((i, "trim-after-wrap")),
                Err(_) if n > 0 && s.offsets.iter().all(|&o| o > 0) && !(w.is_some() && s.wrapped) => {
                    return Some((i, "trim-refused-by-kvsim"))
                }
                _ => {}
            }
        }
        if s.t == "prefill_chunk" && w.is_some() && s.l == 1 && s.padded {
            return Some((i, "padded-singleton-chunk"));
        }
        if s.t == "extract" && !s.batch_arrays {
            return Some((i, "extract-empty-batch"));
        }
    }
    None
}

/// Picks `count` seeds among `0..scan` (`include` first): a greedy cover of every [`features`] value (smaller traces first on ties),
/// then the smallest remaining traces round-robin over (dtype, layout), so that the set mixes f32/bf16 and
/// rotating/linear while staying small in bytes. Only passing seeds are chosen.
pub fn choose_seeds(count: usize, scan: u64, include: &[u64]) -> Result<Vec<u64>, String> {
    struct Cand {
        seed: u64,
        feats: BTreeSet<String>,
        size: usize,
        group: String,
    }
    let mut cands = vec![];
    for seed in 0..scan {
        let r = kvsim_harness::sim::run_seed(seed, DeviceChoice::Cpu, None);
        if r.failed() {
            continue;
        }
        let rec = match record(&r.trace, false) {
            Ok(x) => x,
            Err(_) => continue,
        };
        let cfg = &r.trace.config;
        let feats = features(cfg, &rec.infos);
        let size: usize = rec.results.iter().map(|r| r.to_json().to_string().len() + 1).sum();
        let group = feats.iter().find(|f| f.starts_with("config/")).cloned().unwrap_or_default();
        cands.push(Cand { seed, feats, size, group });
    }
    if cands.is_empty() {
        return Err(format!("no passing seed in 0..{scan}"));
    }
    let mut chosen: Vec<u64> = include.to_vec();
    let mut covered: BTreeSet<String> = BTreeSet::new();
    for c in cands.iter().filter(|c| include.contains(&c.seed)) {
        covered.extend(c.feats.iter().cloned());
    }
    loop {
        let best = cands
            .iter()
            .filter(|c| !chosen.contains(&c.seed))
            .map(|c| (c.feats.difference(&covered).count(), c))
            .filter(|(n, _)| *n > 0)
            .max_by(|(n1, c1), (n2, c2)| n1.cmp(n2).then(c2.size.cmp(&c1.size)));
        match best {
            Some((_, c)) if chosen.len() < count => {
                covered.extend(c.feats.iter().cloned());
                chosen.push(c.seed);
            }
            _ => break,
        }
    }
    let mut groups: BTreeMap<String, Vec<&Cand>> = BTreeMap::new();
    for c in cands.iter().filter(|c| !chosen.contains(&c.seed)) {
        groups.entry(c.group.clone()).or_default().push(c);
    }
    for g in groups.values_mut() {
        g.sort_by_key(|c| (c.size, c.seed));
        g.reverse();
    }
    while chosen.len() < count && groups.values().any(|g| !g.is_empty()) {
        for g in groups.values_mut() {
            if chosen.len() >= count {
                break;
            }
            if let Some(c) = g.pop() {
                chosen.push(c.seed);
            }
        }
    }
    chosen.sort();
    Ok(chosen)
}

/// What a quantized-family recording covers besides [`features`]: its parameters, native or converted, the
/// conversion and where each quantized rule's geometry occurs (from kvsim's side only). For a recurrent-family
/// recording (its layer calls carry row spans): right / left-padded prepares, padded calls, enter, extract, filter,
/// committed and rolled-back rounds.
pub fn quant_features(cfg: &SimConfig, infos: &[StepInfo]) -> BTreeSet<String> {
    let mut f = BTreeSet::new();
    if infos.iter().any(|s| !s.spans.is_empty()) {
        // A recurrent-family recording: what it covers (its caches are not quantized).
        for s in infos {
            let what = match s.t {
                "prepare" if s.left.iter().any(|&l| l > 0) => "ssm/prepare-left",
                "prepare" => "ssm/prepare-right",
                "enter" | "extract" | "filter" | "finalize" => s.t,
                "round" if s.keep.iter().all(|&k| k == s.l) => "ssm/round-commit",
                "round" => "ssm/round-rollback",
                "solo" | "batch" => {
                    if s.spans.iter().any(|&(a, b)| b - a != s.l) {
                        "ssm/padded-call"
                    } else {
                        "ssm/full-call"
                    }
                }
                _ => continue,
            };
            f.insert(if what.starts_with("ssm/") { what.to_string() } else { format!("ssm/{what}") });
        }
        return f;
    }
    let Some(q) = kvsim_harness::sim::family::quant::QuantChoice::of(cfg) else { return f };
    let layout = if cfg.layout.max_size().is_some() { "rotating" } else { "linear" };
    f.insert(format!("quant/bits-{}", q.bits));
    f.insert(format!("quant/group-{}", q.group));
    f.insert(format!("quant/{layout}/{}", if q.native { "native" } else { "converted" }));
    if layout == "linear" && matches!(q.bits, 5 | 6) && q.head_dim * q.bits / 32 != q.head_dim / (32 / q.bits) {
        // mlx-lm's packed-width crash: a QuantizedKVCache created quantized (native, or admitted after the conversion)
        f.insert("quant/packed-width".into());
    }
    for s in infos {
        match s.t {
            "quantize" => {
                let (b, g) = s.target.unwrap_or_default();
                let kind = if mlx_refuses_quant(b, g, s.head_dim) {
                    "invalid"
                } else if s.quant.is_some() {
                    "already"
                } else if s.batch_live {
                    "with-batch"
                } else {
                    "solo"
                };
                f.insert(format!("quant/convert-{kind}/{layout}"));
            }
            "solo" | "batch" | "prefill_chunk" if s.quant.is_some() => {
                f.insert(format!("quant/{}-read/{layout}", s.t));
            }
            "enter" | "prefill" if s.quant.is_some() => {
                f.insert(format!("quant/{}-quantized/{layout}", s.t));
            }
            _ => {}
        }
    }
    f
}

/// Seeds for a family's recorded set: among `0..scan`, the runs [`family_run`] gives, a greedy cover of
/// [`features`] and [`quant_features`] (fewer steps first on ties), then the smallest remaining ones.
pub fn choose_family_seeds(family: &str, count: usize, scan: u64) -> Result<Vec<u64>, String> {
    let mut cands: Vec<(u64, BTreeSet<String>, usize)> = vec![];
    for seed in 0..scan {
        let Some(r) = family_run(seed, family) else { continue };
        let Ok(rec) = record(&r.trace, false) else { continue };
        let mut feats = features(&r.trace.config, &rec.infos);
        feats.extend(quant_features(&r.trace.config, &rec.infos));
        cands.push((seed, feats, rec.infos.len()));
    }
    if cands.is_empty() {
        return Err(format!("no passing {family} seed in 0..{scan}"));
    }
    let mut chosen: Vec<u64> = vec![];
    let mut covered: BTreeSet<String> = BTreeSet::new();
    while chosen.len() < count {
        let best = cands
            .iter()
            .filter(|c| !chosen.contains(&c.0))
            .map(|c| (c.1.difference(&covered).count(), c))
            .filter(|(n, _)| *n > 0)
            .max_by(|(n1, c1), (n2, c2)| n1.cmp(n2).then(c2.2.cmp(&c1.2)));
        let Some((_, c)) = best else { break };
        covered.extend(c.1.iter().cloned());
        chosen.push(c.0);
    }
    let mut rest: Vec<&(u64, BTreeSet<String>, usize)> = cands.iter().filter(|c| !chosen.contains(&c.0)).collect();
    rest.sort_by_key(|c| (c.2, c.0));
    chosen.extend(rest.iter().take(count.saturating_sub(chosen.len())).map(|c| c.0));
    chosen.sort();
    Ok(chosen)
}

/// `kvsim oracle record --dry-run`: the chosen seeds, each with the geometry and config features it covers.
pub fn describe_choice(
    family: &str,
    count: usize,
    scan: u64,
    include: &[u64],
) -> Result<Vec<(u64, Vec<String>)>, String> {
    let seeds = if family == "attention" {
        choose_seeds(count, scan, include)?
    } else {
        choose_family_seeds(family, count, scan)?
    };
    Ok(seeds
        .into_iter()
        .map(|s| {
            let feats = family_run(s, family)
                .and_then(|r| {
                    record(&r.trace, false).ok().map(|rec| {
                        let mut f = features(&r.trace.config, &rec.infos);
                        f.extend(quant_features(&r.trace.config, &rec.infos));
                        f
                    })
                })
                .unwrap_or_default();
            let shown = |f: &String| {
                f.starts_with("geometry/")
                    || f.starts_with("config/")
                    || f.starts_with("quant/")
                    || f.starts_with("ssm/")
            };
            (s, feats.into_iter().filter(shown).collect())
        })
        .collect())
}
