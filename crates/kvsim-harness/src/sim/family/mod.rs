//! Layout families: the plug-ins of the harness.
//!
//! A **family** is one kind of cache a model's layers may hold (attention K/V caches, quantized ones, a recurrent
//! state, ...). It owns, for one run, everything about its layers: the production layouts (serial caches and rows
//! of the running batch), one solo twin per request, its reference model, the ops it supports, its checks, and the
//! counters of what it proved. It keeps no scheduler state: which requests live, which run in the batch and in
//! which order is the run's one [`Roster`], handed to every call in [`Cx`]. The runner
//! ([`crate::sim::runner::World`]) holds the roster and one instance per family of the run's swarm config and
//! dispatches every op to each of them; it knows nothing else about any family.
//!
//! Families are registered at run time: a [`Registry`] is the value the run loop takes ([`Registry::builtin`] holds
//! kvsim's own, and a crate outside kvsim adds its own [`Registration`] with [`Registry::with`]). The swarm config
//! and the op generator name no family: each registration brings its own draws (the op kinds it owns, parameters
//! drawn per seed, op kinds weighted from them, and how to draw the ops of a kind it draws itself).

pub mod attention;
mod layer_set;
pub mod paged;
pub mod quant;
pub mod ssm;
pub mod training;
pub mod transition;

use std::sync::LazyLock;

use rand_chacha::ChaCha8Rng;

use crate::sim::check::Failure;
use crate::sim::config::{Params, SimConfig};
use crate::sim::observe::RunObserver;
use crate::sim::ops::{Op, OpKind};
use crate::sim::roster::{Change, Roster};
use crate::sim::summary::Counters;

/// What a family hands its checks besides itself: the run's roster, the change the op made to it, the run's digest
/// (every byte a check reads is chained into it, in order) and the observer.
pub struct Cx<'a> {
    pub hasher: &'a mut blake3::Hasher,
    pub observer: &'a mut dyn RunObserver,
    /// The scheduler's picture, the op's change already committed (which requests live, the batch rows in order).
    pub roster: &'a Roster,
    /// What the op being applied did to the roster (`None` for ops that leave it alone, and in the state checks).
    pub change: Option<&'a Change>,
    /// The positions every batch row holds as the run's first family counts them (the counts the roster's own
    /// decisions use), for a family whose skipping rule depends on them; empty in the state checks.
    pub held: &'a [usize],
}

/// One layout family of one run.
///
/// Contract (what the runner relies on):
/// - [`Family::apply`] executes `op` on production, twins and model, checks every read it makes, and returns
///   `Ok(false)` (changing nothing) when the op's references do not exist; an impossible request is executed and
///   must yield the model's typed error. A lifecycle op reaches it only when the roster changed (`cx.change`, which
///   it carries out on its layouts: skipping it then is a failure). Ops of kinds the family does not
///   [`support`](Registration::supports) never reach it.
/// - [`Family::check_state`] runs after every applied op: every live request's state against twin and model.
/// - Everything the checks read goes into `cx.hasher` in a deterministic order (the run's result hash).
/// - Production calls are described to `cx.observer` only when `cx.observer.wants_calls()`.
pub trait Family {
    /// The storage-kind family this instance checks (the key of the summary's `layouts` object), e.g. `"kv:plain"`.
    fn key(&self) -> &'static str;
    /// Applies one op. `Ok(false)`: skipped (its references do not exist here). `Err`: a check failed.
    fn apply(&mut self, op: &Op, cx: &mut Cx<'_>) -> Result<bool, Failure>;
    /// After every applied op: every live request's state, bytes and kinds, in production, twin and model.
    fn check_state(&mut self, cx: &mut Cx<'_>) -> Result<(), Failure>;
    /// Hands every live request's production state to the observer (only called when it wants calls).
    fn observe_state(&mut self, cx: &mut Cx<'_>) -> Result<(), Failure>;
    /// A live request's position as this family's model has it: (offset, width of the last window write when that
    /// was its last mutation). The generator's view takes the run's first family's (`None`: the family holds no
    /// request state).
    fn position(&self, req: u32) -> Option<(usize, Option<usize>)>;
    /// What this family counted so far.
    fn counters(&self) -> &Counters;
    fn counters_mut(&mut self) -> &mut Counters;
    /// The parameters this run's instance was drawn with, when the family draws some per seed (the quantized
    /// family's `"<bits>:<group>"`): the summary's `layouts.<key>.variants` counts coverage per variant.
    fn variant(&self) -> Option<String> {
        None
    }
    /// The coverage classes ([`crate::sim::ops::API_CLASSES`]) the last op reached through this family's state
    /// rather than its parameters (a conversion while a request holds no position, a saved set whose layers
    /// differ, ...), each once; the runner drains them after every op.
    fn take_reached(&mut self) -> Vec<&'static str> {
        Vec::new()
    }
}

/// How the runner finds a family: its name (as in `SimConfig::families`), which op kinds it supports, and how to
/// build its instance for a run.
#[derive(Clone, Copy)]
pub struct Registration {
    /// The name in [`SimConfig::families`].
    pub name: &'static str,
    /// Whether the family executes ops of this kind. A run's generator draws only kinds every family of the run
    /// supports (`SimConfig::from_seed` switches the others off), and a replayed op of another kind is skipped.
    pub supports: fn(OpKind) -> bool,
    /// Swarm: the probability that a seed's run includes this family (drawn from `Stream::Families`, in registry
    /// order). A run always holds at least one family: the first registered one when the draw picks none.
    pub swarm_probability: f64,
    /// Op kinds that belong to this family (its own ops): the swarm draws a kind that some registered family owns
    /// only in runs that hold at least one of its owners.
    pub owns: fn(OpKind) -> bool,
    /// Parameters the family draws per seed, from a stream of its own, when the run holds it (`None`: it draws
    /// none). They are stored in the run's config under the family's name ([`SimConfig::params_of`]).
    pub draw_params: Option<fn(u64) -> Params>,
    /// Op kinds (with their weights) this family adds to a run that holds it, from its parameters, after the swarm's
    /// own kinds (each only where every family of the run supports it).
    pub weights_from_params: fn(&Params) -> Vec<(OpKind, u32)>,
    /// The kind whose ops this family draws itself, and how ([`crate::sim::gen::Generator`] calls it).
    pub draws_op: Option<(OpKind, fn(&SimConfig, &mut ChaCha8Rng) -> Op)>,
    /// One instance for a run of `cfg`.
    pub build: fn(&SimConfig) -> Result<Box<dyn Family>, Failure>,
}

impl Registration {
    /// A family with no draws of its own (`owns` nothing, no parameters, no extra kinds, no op it draws itself).
    pub const fn plain(
        name: &'static str,
        supports: fn(OpKind) -> bool,
        swarm_probability: f64,
        build: fn(&SimConfig) -> Result<Box<dyn Family>, Failure>,
    ) -> Registration {
        Registration {
            name,
            supports,
            swarm_probability,
            owns: |_| false,
            draw_params: None,
            weights_from_params: |_| Vec::new(),
            draws_op: None,
            build,
        }
    }
}

/// The layout families a run can hold, in the order the runner dispatches them and the swarm draws them.
#[derive(Clone)]
pub struct Registry {
    families: Vec<Registration>,
}

impl std::fmt::Debug for Registry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(self.families.iter().map(|r| r.name)).finish()
    }
}

static BUILTIN: LazyLock<Registry> = LazyLock::new(|| Registry {
    families: vec![
        attention::REGISTRATION,
        training::REGISTRATION,
        ssm::REGISTRATION,
        quant::REGISTRATION,
        transition::REGISTRATION,
        transition::LEGO_REGISTRATION,
        paged::REGISTRATION,
    ],
});

impl Registry {
    /// kvsim's own families (attention, training, recurrent, quantized, bf16-first rows and legos, paged), in that
    /// order.
    pub fn builtin() -> &'static Registry {
        &BUILTIN
    }

    /// An empty registry (a run needs at least one family: [`Registry::with`]).
    pub fn empty() -> Registry {
        Registry { families: vec![] }
    }

    /// This registry and `r` after it; a name registered twice is refused.
    pub fn with(mut self, r: Registration) -> Result<Registry, String> {
        if self.get(r.name).is_some() {
            return Err(format!("layout family {:?} is registered twice", r.name));
        }
        self.families.push(r);
        Ok(self)
    }

    /// Every registration, in order.
    pub fn iter(&self) -> impl Iterator<Item = &Registration> {
        self.families.iter()
    }

    /// The registration of `name`.
    pub fn get(&self, name: &str) -> Option<&Registration> {
        self.families.iter().find(|r| r.name == name)
    }

    /// Whether every family of `names` supports `kind` (an unknown name supports nothing), or lets it pass: a kind
    /// that touches only its owners' caches and never the roster ([`OpKind::passes_others`]) passes the families
    /// that do not execute it (they answer it as skipped; its owners decide).
    pub fn all_support(&self, names: &[String], kind: OpKind) -> bool {
        names.iter().all(|n| self.get(n).is_some_and(|r| (r.supports)(kind) || kind.passes_others()))
    }

    /// Whether a run of `names` may draw `kind`: no registered family owns it, or one of the run's families does.
    pub fn owners_present(&self, names: &[String], kind: OpKind) -> bool {
        let mut owners = self.families.iter().filter(|r| (r.owns)(kind)).peekable();
        owners.peek().is_none() || owners.any(|r| names.iter().any(|n| n == r.name))
    }

    /// The families drawing their own ops: `(kind, draw)` pairs, in registry order.
    pub fn op_drawers(&self) -> Vec<(OpKind, fn(&SimConfig, &mut ChaCha8Rng) -> Op)> {
        self.families.iter().filter_map(|r| r.draws_op).collect()
    }
}

/// The families a run holds by default (a config that names none): [`crate::sim::config::default_families`].
pub fn default_families() -> Vec<String> {
    crate::sim::config::default_families()
}

/// A kvsim-format file damaged three ways, each at a place its own bytes choose (so the run's seed decides it): one
/// bit flipped in the header, one in the tensor data, and the file cut short. Each copy must be refused with a typed
/// error, for every byte of kvsim's format is under a checksum or a length check (`kvsim_persist::kvsim`); the
/// undamaged bytes are then restored as usual. Returns the copies refused. (mlx-lm's files carry no checksums: a
/// flipped tensor bit would load as other values, so they are not damaged.)
pub(crate) fn damaged_copies_refused(bytes: &[u8]) -> Result<u64, Failure> {
    let [_, header, data] = kvsim_persist::kvsim::regions(bytes)
        .ok_or_else(|| Failure::new("persist", "the saved bytes are not a kvsim file"))?;
    let pick = blake3::hash(bytes);
    let word = |i: usize| u64::from_le_bytes(pick.as_bytes()[8 * i..8 * i + 8].try_into().expect("8 bytes"));
    let flip = |lo: usize, hi: usize, w: u64| -> Option<(usize, Vec<u8>)> {
        (hi > lo).then(|| {
            let bit = lo * 8 + (w % ((hi - lo) as u64 * 8)) as usize;
            let mut copy = bytes.to_vec();
            copy[bit / 8] ^= 1 << (bit % 8);
            (bit / 8, copy)
        })
    };
    let mut damaged: Vec<(String, Vec<u8>)> = vec![];
    if let Some((at, c)) = flip(header.start, header.end, word(0)) {
        damaged.push((format!("a header bit flipped at byte {at}"), c));
    }
    if let Some((at, c)) = flip(data.start, data.end, word(1)) {
        damaged.push((format!("a tensor bit flipped at byte {at}"), c));
    }
    if !bytes.is_empty() {
        let keep = (word(2) % bytes.len() as u64) as usize;
        damaged.push((format!("cut to {keep} of {} bytes", bytes.len()), bytes[..keep].to_vec()));
    }
    let mut refused = 0;
    for (what, copy) in damaged {
        match kvsim_persist::inspect::load_any(&copy) {
            Err(_) => refused += 1,
            Ok(_) => crate::sim::check::fail(Failure::new("persist", format!("a kvsim file with {what} loaded")))?,
        }
    }
    Ok(refused)
}

/// Saves caches to one file of `format` (every cache one layer), drops them, and restores them from the bytes alone:
/// the persist op's round trip, shared by every family. Each cache's reuse floor and storage kind must come back
/// (a `persist` failure otherwise); the restored caches are returned in order for the family to unwrap.
pub(crate) fn persist_through_bytes(
    persisted: Vec<kvsim_persist::Persisted>,
    format: kvsim_persist::inspect::Format,
    counters: &mut Counters,
) -> Result<Vec<kvsim_persist::AnyCache>, Failure> {
    use kvsim_persist::inspect::{load_any, save_as};
    let fail = |what: &str, e: kvsim_persist::PersistError| Failure::new("persist", format!("{what}: {e}"));
    let floors: Vec<usize> = persisted.iter().map(|p| p.minimum_reusable_offset).collect();
    let kinds: Vec<String> = persisted.iter().map(|p| p.cache.storage_kind().to_string()).collect();
    let bytes = save_as(format, &Default::default(), &persisted).map_err(|e| fail("save", e))?;
    drop(persisted);
    if format == kvsim_persist::inspect::Format::Kvsim {
        counters.damaged_files_refused += damaged_copies_refused(&bytes)?;
    }
    let restored = load_any(&bytes).map_err(|e| fail("restore", e))?.1;
    let back: Vec<usize> = restored.iter().map(|p| p.minimum_reusable_offset).collect();
    if back != floors {
        crate::sim::check::fail(Failure::new("persist", format!("reuse floors {floors:?} saved, {back:?} restored")))?;
    }
    let got: Vec<String> = restored.iter().map(|p| p.cache.storage_kind().to_string()).collect();
    if got != kinds {
        crate::sim::check::fail(Failure::new("persist", format!("kinds {kinds:?} saved, {got:?} restored")))?;
    }
    Ok(restored.into_iter().map(|p| p.cache).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_names_are_unique_and_the_default_is_registered() {
        let reg = Registry::builtin();
        let names: Vec<&str> = reg.iter().map(|r| r.name).collect();
        for (i, n) in names.iter().enumerate() {
            assert!(!names[..i].contains(n), "{n} registered twice");
        }
        assert_eq!(default_families(), [attention::NAME], "the default family is the attention family");
        for n in default_families() {
            assert!(reg.get(&n).is_some());
        }
        assert!(!reg.all_support(&["no-such-family".to_string()], OpKind::Decode));
        assert!(reg.clone().with(attention::REGISTRATION).is_err(), "a second registration of a name is refused");
        // The training kinds belong to the training family: drawn only in runs that hold it.
        assert!(!reg.owners_present(&["attention".to_string()], OpKind::TrainingForward));
        assert!(reg.owners_present(&["attention".to_string(), "training".to_string()], OpKind::TrainingForward));
        assert!(reg.owners_present(&["attention".to_string()], OpKind::Decode), "a kind nobody owns");
    }
}
