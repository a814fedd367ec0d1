//! One check function per feature. Each returns `Err(Failure)` naming the check and what diverged; counters record
//! how many comparisons were made and how many were byte-identical.

use crate::sim::summary::Counters;
pub use crate::sim::summary::{Guarantees, OutClass};
use kvsim_cache::bytes::{ArrayBytes, Words};
use kvsim_cache::{self as cache, CacheError, KvSpec, MaskUse, RingState, RowBatch, SerialCache};
use kvsim_reference::quant::attention_f64_partly_quantized;
use kvsim_reference::{attention_f64, ModelError, RefQuant, RowModel, Tensor, Tok, ValueSpace};
use mlx_rs::Dtype;

/// A failed check: which check, and a message naming op-independent facts (row, column, expected, found).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Failure {
    pub check: String,
    pub message: String,
}

impl Failure {
    pub fn new(check: &str, message: impl Into<String>) -> Failure {
        Failure { check: check.to_string(), message: message.into() }
    }

    /// Whether this check compares production with the reference model (the summary's `reference.failures`):
    /// [`output_vs_model`], [`columns_vs_model`] (`layout`), [`mask_row`] (`mask`) and [`ring_state`].
    pub fn against_model(&self) -> bool {
        MODEL_CHECKS.contains(&self.check.as_str())
    }
}

/// The check ids of the comparisons with the reference model.
pub const MODEL_CHECKS: &[&str] = &["output_vs_model", "layout", "mask", "ring_state"];

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "[{}] {}", self.check, self.message)
    }
}

type Res = Result<(), Failure>;

thread_local! {
    /// `Some` while this thread runs with kvsim's checks off ([`checks_off`]): the failures they found, in order.
    static SUPPRESSED: std::cell::RefCell<Option<Vec<Failure>>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` with kvsim's own comparisons off on this thread, as `kvsim oracle teeth` needs them (the oracle alone
/// judges the run): every check that [`fail`]s instead lets the op go on as if it had passed, so the op still makes
/// all its calls and reports its state. Returns `f`'s result and the failures the checks found. Checks that stop an
/// op because it cannot go on (production refused a legal op, a panic) still stop it.
pub fn checks_off<T>(f: impl FnOnce() -> T) -> (T, Vec<Failure>) {
    let before = SUPPRESSED.with(|s| s.borrow_mut().replace(vec![]));
    let out = f();
    let found = SUPPRESSED.with(|s| std::mem::replace(&mut *s.borrow_mut(), before)).unwrap_or_default();
    (out, found)
}

/// What a comparison does when it finds a difference: `Err(failure)`, or, with the checks off ([`checks_off`]),
/// records it and returns `Ok`.
pub fn fail(failure: Failure) -> Res {
    SUPPRESSED.with(|s| match s.borrow_mut().as_mut() {
        Some(found) => {
            found.push(failure);
            Ok(())
        }
        None => Err(failure),
    })
}

/// The read being checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReadKind {
    Decode,
    Window,
    PaddedWindow,
}

impl ReadKind {
    pub fn class(self, padded: bool) -> OutClass {
        match (self, padded) {
            (ReadKind::Decode, false) => OutClass::DecodeUnpadded,
            (ReadKind::Decode, true) => OutClass::DecodePadded,
            _ => OutClass::Window,
        }
    }
}

/// The production result of an op must be exactly the model's verdict: Ok, or the same error kind.
pub fn error_matches(what: &str, expected: &Result<(), ModelError>, got: &Result<(), CacheError>) -> Res {
    let same = matches!(
        (expected, got),
        (Ok(()), Ok(()))
            | (Err(ModelError::NotTrimmable), Err(CacheError::NotTrimmable { .. }))
            | (Err(ModelError::TrimTooLong), Err(CacheError::TrimTooLong { .. }))
            | (Err(ModelError::BypassNotAfterWindow), Err(CacheError::BypassNotAfterWindow))
    );
    if same {
        Ok(())
    } else {
        fail(Failure::new("errors", format!("{what}: model says {expected:?}, production returned {got:?}")))
    }
}

/// RoPE offsets read before an op are a snapshot: equal to the model's positions then, and unchanged after the op
/// (bug catalog #3: offset aliasing).
pub fn rope_snapshot(at_read: &[i32], after_op: &[i32], model_before: &[usize]) -> Res {
    let expect: Vec<i32> = model_before.iter().map(|&o| o as i32).collect();
    if at_read != expect.as_slice() {
        return fail(Failure::new("rope", format!("rope_offsets {at_read:?}, model positions {expect:?}")));
    }
    if at_read != after_op {
        return fail(Failure::new(
            "rope",
            format!("rope_offsets read before the write changed after it: {at_read:?} -> {after_op:?} (aliasing)"),
        ));
    }
    Ok(())
}

/// The columns query `i` of `row` could see under `mask`, versus the model's visible columns (indices into the row's
/// `[0, len)`). `width` is the number of key columns the read attended, `l` its query count.
pub fn mask_row(
    mask: &MaskUse,
    row: usize,
    i: usize,
    visible: &[usize],
    l: usize,
    width: usize,
    kind: ReadKind,
) -> Res {
    let seen: Vec<usize> = match mask {
        MaskUse::None => (0..width).collect(),
        MaskUse::Causal => (0..width).filter(|&c| c + l <= width + i).collect(),
        MaskUse::Array(spec) => {
            if row >= spec.rows || i >= spec.queries {
                return fail(Failure::new(
                    "mask",
                    format!("mask {}x{}x{} has no row {row} query {i}", spec.rows, spec.queries, spec.cols),
                ));
            }
            (0..spec.cols).filter(|&c| spec.visible[(row * spec.queries + i) * spec.cols + c]).collect()
        }
    };
    if seen != visible {
        return fail(Failure::new(
            "mask",
            format!("{kind:?} read, row {row}, query {i}: mask shows columns {seen:?}, model expects {visible:?} ({mask_kind})", mask_kind = match mask {
                MaskUse::None => "no mask",
                MaskUse::Causal => "causal",
                MaskUse::Array(_) => "array mask",
            }),
        ));
    }
    Ok(())
}

/// The value of one stored word of `dtype` (bf16 bits in the low 16 bits).
pub fn value_of(dtype: Dtype, w: u64) -> f64 {
    match dtype {
        Dtype::Bfloat16 => f32::from_bits((w as u32) << 16) as f64,
        _ => f32::from_bits(w as u32) as f64,
    }
}

/// Size of one ULP of `dtype` at magnitude `x`, with magnitudes below 2^-6 measured at 2^-6 ("ULPs at the output's
/// scale": outputs are convex combinations of values in [-1, 1), so a near-zero output's relative error says nothing).
pub fn ulp_at(dtype: Dtype, x: f64) -> f64 {
    let m = x.abs().max(1.0 / 64.0);
    let e = m.log2().floor();
    let mant = if dtype == Dtype::Bfloat16 { 7.0 } else { 23.0 };
    (e - mant).exp2()
}

/// Largest scaled ULP error a read may show against the f64 model before it counts as a failure.
/// CPU: set from measurement (README "Guarantees"; 200 seeds measured 24.6 bf16 / 38.4 f32): above MLX's rounding,
/// below what a misplaced key does. GPU (`loose`): MLX's CUDA kernels round differently (and may use reduced-precision
/// matrix units), so the bound only catches gross errors there; the measured maximum is reported either way.
pub fn model_bound(dtype: Dtype, loose: bool) -> f64 {
    match (dtype == Dtype::Bfloat16, loose) {
        (true, false) => 32.0,
        (false, false) => 512.0,
        (true, true) => 256.0,
        // MLX's CUDA SDPA on f32 inputs measured up to ~2e5 ULPs at output scale (about 4e-4 absolute near zero,
        // consistent with TF32 tensor-core arithmetic), 1000 seeds on an H200.
        (false, true) => 1048576.0,
    }
}

/// [`model_bound`] for reads of head dim `head_dim`. The attention family's head dims (4, 8, 16) use it as is; the
/// quantized family's plain phase (before its conversion op) reads head dims of 32 to 128, where bf16 SDPA sums
/// longer dot products: 1000 CPU seeds measured 32.7 scaled ULPs there (seed 816, head dim 128), so bf16 reads of
/// head dims above 16 get twice the plain bound.
pub fn model_bound_at(dtype: Dtype, loose: bool, head_dim: usize) -> f64 {
    let b = model_bound(dtype, loose);
    if head_dim > 16 && dtype == Dtype::Bfloat16 && !loose {
        2.0 * b
    } else {
        b
    }
}

/// One query's output (row, query i; `[B, H_q, L, D]`) against softmax attention in f64 over `keys`.
#[allow(clippy::too_many_arguments)]
pub fn output_vs_model(
    vs: &ValueSpace,
    layer: u32,
    q: Tok,
    keys: &[Tok],
    scale: f32,
    out: &ArrayBytes,
    row: usize,
    i: usize,
    counters: &mut Counters,
) -> Res {
    let expected = attention_f64(vs, layer, q, keys, scale as f64);
    let worst = match distance_to(&expected, q, out, row, i) {
        Ok(w) => w,
        Err(f) => return fail(f),
    };
    counters.record_model_ulp(out.dtype, worst);
    counters.checks += 1;
    let bound = model_bound_at(out.dtype, counters.guarantees.gpu, vs.head_dim);
    if worst > bound {
        return fail(Failure::new(
            "output_vs_model",
            format!(
                "row {row} query {i} (token {q:?}): {worst:.1} ULPs from the f64 model over {} keys (bound {bound})",
                keys.len()
            ),
        ));
    }
    Ok(())
}

/// Largest scaled-ULP distance of one query's output (row, query i) to `expected` (`[H_q * D]`); a NaN or
/// infinite output is the failure `nan`.
fn distance_to(expected: &[f64], q: Tok, out: &ArrayBytes, row: usize, i: usize) -> Result<f64, Failure> {
    let (hq, l, d) = (out.shape[1] as usize, out.shape[2] as usize, out.shape[3] as usize);
    let mut worst = 0f64;
    for h in 0..hq {
        for k in 0..d {
            let w = out.words.get(((row * hq + h) * l + i) * d + k);
            let found = value_of(out.dtype, w);
            let e = expected.get(h * d + k).copied().unwrap_or(f64::NAN);
            if found.is_nan() || found.is_infinite() {
                return Err(Failure::new(
                    "nan",
                    format!("row {row} query {i} (token {q:?}) head {h} dim {k}: output {found}"),
                ));
            }
            worst = worst.max((found - e).abs() / ulp_at(out.dtype, e));
        }
    }
    Ok(worst)
}

/// Largest scaled-ULP distance a read of an affine-quantized cache may show against the f64 attention over the
/// dequantized keys and values before it counts as a failure. The quantized matmuls of MLX's CPU backend round
/// every product and partial sum to the dtype (docs/quantized-kv.md), so this is far above [`model_bound`]; set
/// from measurement (README, "The quantized family"), with the GPU as loose as the plain reads' there.
pub fn quant_model_bound(dtype: Dtype, loose: bool) -> f64 {
    match (dtype == Dtype::Bfloat16, loose) {
        (true, false) => QUANT_BOUND_BF16,
        (false, false) => QUANT_BOUND_F32,
        (true, true) => 4.0 * QUANT_BOUND_BF16,
        (false, true) => 1048576.0,
    }
}

/// See [`quant_model_bound`]. 400 CPU seeds measured at most 104 (bf16) and 92 (f32) scaled ULPs (README); a
/// misplaced or lost key is millions (the `quant-single-plain-path` mutant: 3e8).
pub const QUANT_BOUND_BF16: f64 = 256.0;
/// See [`quant_model_bound`].
pub const QUANT_BOUND_F32: f64 = 512.0;

/// [`output_vs_model`] for a read of an affine-quantized cache: against the f64 attention over `keys`, of which the
/// first `stored` are read back dequantized (`reference::quant`) and the rest as given (a canvas block, which
/// is attended without being stored). Bound: [`quant_model_bound`].
#[allow(clippy::too_many_arguments)]
pub fn output_vs_model_quantized(
    vs: &ValueSpace,
    quant: RefQuant,
    layer: u32,
    q: Tok,
    keys: &[Tok],
    stored: usize,
    scale: f32,
    out: &ArrayBytes,
    row: usize,
    i: usize,
    counters: &mut Counters,
) -> Res {
    let expected = attention_f64_partly_quantized(vs, layer, q, keys, stored, scale as f64, quant);
    let worst = match distance_to(&expected, q, out, row, i) {
        Ok(w) => w,
        Err(f) => return fail(f),
    };
    counters.record_quant_model_ulp(out.dtype, worst);
    counters.checks += 1;
    let bound = quant_model_bound(out.dtype, counters.guarantees.gpu);
    if worst > bound {
        return fail(Failure::new(
            "output_vs_model",
            format!(
                "row {row} query {i} (token {q:?}): {worst:.1} ULPs from the f64 model over {} dequantized keys \
                 ({} {}-bit, group {}; bound {bound})",
                keys.len(),
                stored,
                quant.bits,
                quant.group
            ),
        ));
    }
    Ok(())
}

/// The distance between two values' bits (one dtype) in ULPs at the output's scale ([`ulp_at`]), rounded up: 0 for
/// equal bits, at least 1 for any difference (raw ULP counts near zero are meaningless), `u64::MAX` for a NaN.
pub fn ulp_at_scale(dtype: Dtype, a: u64, b: u64) -> u64 {
    if a == b {
        return 0;
    }
    let (x, y) = (value_of(dtype, a), value_of(dtype, b));
    if x.is_nan() || y.is_nan() {
        return u64::MAX;
    }
    (((x - y).abs() / ulp_at(dtype, x.abs().max(y.abs()))).ceil() as u64).max(1)
}

/// The largest [`ulp_at_scale`] over two arrays of one shape and dtype (`u64::MAX` when they do not match).
pub fn max_ulp_at_scale(a: &ArrayBytes, b: &ArrayBytes) -> u64 {
    if a.dtype != b.dtype || a.shape != b.shape {
        return u64::MAX;
    }
    max_ulp_of_words(a.dtype, &a.words, &b.words)
}

/// The largest [`ulp_at_scale`] over two element lists of `dtype` (`u64::MAX` when their lengths differ).
pub fn max_ulp_of_words(dtype: Dtype, a: &Words, b: &Words) -> u64 {
    if a.len() != b.len() {
        return u64::MAX;
    }
    (0..a.len()).map(|i| ulp_at_scale(dtype, a.get(i), b.get(i))).max().unwrap_or(0)
}

/// One row's real query outputs against the twin's, bytes first; distance measured when they differ.
pub fn output_vs_twin(
    class: OutClass,
    tags: &[&'static str],
    out: &ArrayBytes,
    row: usize,
    twin: &ArrayBytes,
    n: usize,
    counters: &mut Counters,
) -> Res {
    let (hq, l, d) = (out.shape[1] as usize, out.shape[2] as usize, out.shape[3] as usize);
    let lt = twin.shape[2] as usize;
    let mut worst = 0u64;
    for i in 0..n {
        for h in 0..hq {
            for k in 0..d {
                let a = out.words.get(((row * hq + h) * l + i) * d + k);
                let b = twin.words.get((h * lt + i) * d + k);
                worst = worst.max(ulp_at_scale(out.dtype, a, b));
            }
        }
    }
    counters.record_twin(class, tags, out.dtype, worst);
    if worst > 0 && class == OutClass::DecodeUnpadded && counters.guarantees.exact_unpadded_decode {
        return fail(Failure::new(
            "decode_vs_solo",
            format!("row {row}: unpadded decode output differs from the solo twin by {worst} ULPs (promised byte-identical)"),
        ));
    }
    Ok(())
}

pub fn row_count(batch: &RowBatch, expected: usize) -> Res {
    if batch.rows() != expected {
        return fail(Failure::new("rows", format!("batch holds {} rows, the scheduler has {expected}", batch.rows())));
    }
    Ok(())
}

pub fn kinds_batch(batch: &RowBatch, max: Option<usize>, spec: KvSpec) -> Res {
    let kind = batch.storage_kind();
    let serial = if max.is_some() { cache::ROTATING_PLAIN } else { cache::KV_PLAIN };
    if !cache::is_row_batch(&kind) || kind.0 != format!("{serial}{}", cache::ROW_BATCH_MARKER) {
        return fail(Failure::new(
            "storage_kind",
            format!("batch reports {:?}, expected {serial}{}", kind.0, cache::ROW_BATCH_MARKER),
        ));
    }
    if max.is_some() != cache::is_rotating(&kind) {
        return fail(Failure::new("storage_kind", format!("{:?}: is_rotating disagrees with the layout", kind.0)));
    }
    bytes_per_token("batch", batch.bytes_per_token(), |n| batch.bytes_for_tokens(n), max, spec)
}

pub fn kinds_serial(c: &SerialCache, max: Option<usize>, spec: KvSpec) -> Res {
    let kind = c.storage_kind();
    let serial = if max.is_some() { cache::ROTATING_PLAIN } else { cache::KV_PLAIN };
    if cache::is_row_batch(&kind) || kind.0 != serial {
        return fail(Failure::new("storage_kind", format!("serial cache reports {:?}, expected {serial}", kind.0)));
    }
    bytes_per_token("serial", c.bytes_per_token(), |n| c.bytes_for_tokens(n), max, spec)
}

fn bytes_per_token(what: &str, per: usize, for_n: impl Fn(usize) -> usize, max: Option<usize>, spec: KvSpec) -> Res {
    let item = match spec.dtype {
        cache::KvDtype::F32 => 4,
        cache::KvDtype::Bf16 => 2,
    };
    let expect = 2 * spec.heads_kv * spec.head_dim * item;
    if per != expect {
        return fail(Failure::new("bytes_per_token", format!("{what}: {per}, expected 2*H*D*itemsize = {expect}")));
    }
    for n in [0usize, 1, 7, 100] {
        let capped = max.map_or(n, |w| n.min(w));
        if for_n(n) != capped * expect {
            return fail(Failure::new(
                "bytes_per_token",
                format!("{what}: bytes_for_tokens({n}) = {}, expected {}", for_n(n), capped * expect),
            ));
        }
    }
    Ok(())
}

/// The capacity guarantee of a batch (`RowBatch`, "Capacity"), after every op: (a) its buffers hold at most the
/// columns its live rows need, computed here from the models' live columns `lens` (one per row): `max(W, longest)`
/// for rings, the longest plus `GROW_STEP - 1` for linear rows, 0 without rows; the batch's own
/// `capacity_bound` must say the same; and (b) kvsim's accounting of the buffers, `rows * cap * bytes_per_token`,
/// is the bytes its arrays hold (`held_bytes`: every plane's `nbytes`). Integers only: nothing is added to the run's
/// digest. Counted once per call.
pub fn capacity(what: &str, batch: &RowBatch, lens: &[usize], max: Option<usize>, counters: &mut Counters) -> Res {
    counters.checks += 1;
    let longest = lens.iter().copied().max();
    let bound = match (longest, max) {
        (None, _) => 0,
        (Some(l), Some(w)) => w.max(l),
        (Some(l), None) => l + cache::ring::GROW_STEP - 1,
    };
    let cap = batch.cap();
    if cap > bound || batch.capacity_bound() != bound {
        return fail(Failure::new(
            "capacity",
            format!(
                "{what}: {cap} columns held (capacity_bound {}), its live rows need at most {bound} (longest row {}, \
                 W {max:?})",
                batch.capacity_bound(),
                longest.unwrap_or(0)
            ),
        ));
    }
    let accounted = batch.rows() * cap * batch.bytes_per_token();
    if batch.held_bytes() != accounted {
        return fail(Failure::new(
            "capacity",
            format!(
                "{what}: the arrays hold {} bytes, the accounting {} rows x {cap} columns x {} bytes per token = \
                 {accounted}",
                batch.held_bytes(),
                batch.rows(),
                batch.bytes_per_token()
            ),
        ));
    }
    Ok(())
}

pub fn left_padding(got: &[i64], expected: &[i64]) -> Res {
    if got != expected {
        return fail(Failure::new("left_padding", format!("left_padding {got:?}, model {expected:?}")));
    }
    Ok(())
}

pub fn flag(what: &str, got: bool, expected: bool) -> Res {
    if got != expected {
        return fail(Failure::new("flags", format!("{what} = {got}, model says {expected}")));
    }
    Ok(())
}

/// offset, len, write head and last window width, field by field.
pub fn ring_state(what: &str, s: &RingState, m: &RowModel) -> Res {
    let got = (s.offset, s.len, s.idx, s.last_concat);
    let want = (m.offset, m.cols.len(), m.idx, m.last_concat);
    if got != want {
        return fail(Failure::new(
            "ring_state",
            format!("{what}: (offset, len, idx, last_concat) = {got:?}, model {want:?}"),
        ));
    }
    Ok(())
}

/// Bytes `[1, H, n, D]` against the model's token per column; names the token found where they differ.
pub fn columns_vs_model(
    what: &str,
    vs: &ValueSpace,
    layer: u32,
    tensor: Tensor,
    got: &ArrayBytes,
    toks: &[Tok],
) -> Res {
    let (h, n, d) = (got.shape[1] as usize, got.shape[2] as usize, got.shape[3] as usize);
    if n != toks.len() {
        return fail(Failure::new(
            "layout",
            format!("{what} {tensor:?}: {n} columns, the model expects {} ({toks:?})", toks.len()),
        ));
    }
    for (c, tok) in toks.iter().enumerate() {
        // Compared in place against the memoized column; the vectors are built only to name a difference.
        let col = vs.column(layer, tensor, *tok);
        if col.len() == h * d
            && (0..h * d).all(|x| got.words.get(((x / d) * n + c) * d + x % d) as u32 == vs.bits(col[x]))
        {
            continue;
        }
        let want = vs.column_bits(layer, tensor, *tok);
        let found: Vec<u32> = (0..h * d).map(|x| got.words.get(((x / d) * n + c) * d + x % d) as u32).collect();
        if found != want {
            let candidates = toks.iter().copied().chain((0..=tok.pos + 64).map(|p| Tok { req: tok.req, pos: p }));
            let who = vs.identify(layer, tensor, &found, candidates);
            return fail(Failure::new(
                "layout",
                format!(
                    "{what} {tensor:?} column {c}: expected token (request {}, position {}), found {}",
                    tok.req,
                    tok.pos,
                    match who {
                        Some(t) => format!("token (request {}, position {})", t.req, t.pos),
                        None => "bytes of no known token (padding or garbage)".to_string(),
                    }
                ),
            ));
        }
    }
    Ok(())
}

/// The per-forward mask memo: every mask family a forward used (`cache::Masks::families`, one `Masks`
/// shared by all the forward's layers) was built exactly once, however many layers read it.
pub fn mask_memo(what: &str, families: &[(String, usize)]) -> Res {
    match families.iter().find(|(_, n)| *n != 1) {
        Some((f, n)) => {
            fail(Failure::new("mask_memo", format!("{what}: mask family {f} built {n} times in one forward")))
        }
        None => Ok(()),
    }
}

/// R-C-3 for a forward over several layers: the masks the first layer built are all the forward builds (every
/// later layer, and every row layout made from the layers' caches, finds its masks in the memo).
pub fn masks_shared_by_layers(what: &str, after_first_layer: usize, after_all: usize) -> Res {
    if after_all != after_first_layer {
        return fail(Failure::new(
            "mask_memo",
            format!("{what}: the first layer built {after_first_layer} masks, the forward {after_all}"),
        ));
    }
    Ok(())
}

pub fn bytes_equal(what: &str, a: &ArrayBytes, b: &ArrayBytes) -> Res {
    if let Some(i) = a.first_difference(b) {
        return fail(Failure::new(
            "bytes_vs_twin",
            format!("{what}: first difference at element {i} (shapes {:?} vs {:?})", a.shape, b.shape),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests;

/// What the harness knows of one layout independently of the layout's own answers (from the models and the
/// roster), for [`contract`].
pub struct ContractView<'a> {
    /// The models of its rows, in row order (one for a serial cache).
    pub rows: Vec<&'a RowModel>,
    /// Whether a plain trim may drop positions now (the models' answer, and the layout's own lifecycle).
    pub trimmable: bool,
    /// The storage kind each row holds now, for a wrapper (`None`: the layout is its storage).
    pub composed: Option<Vec<cache::StorageKind>>,
}

/// The common contract (R-C-1, R-C-4, R-C-5, R-ROT-5, R-C-10) through `&dyn Cache`, against the models: the rows
/// and their offsets, trimmability, each row's decode phase, the capabilities the kind string gives (a known kind),
/// what a wrapper composes, and `bytes_per_token` times each row's live columns against the bytes of the state the
/// layout hands out. Integers only: nothing is added to the run's digest.
pub fn contract(what: &str, c: &dyn cache::Cache, want: &ContractView<'_>, counters: &mut Counters) -> Res {
    let bad = |m: String| fail(Failure::new("contract", format!("{what}: {m}")));
    counters.checks += 1;
    let kind = c.storage_kind();
    if c.capabilities() != cache::Capabilities::of(&kind) || !c.capabilities().known {
        return bad(format!("{kind}: capabilities {:?} not those of its kind string", c.capabilities()));
    }
    let offsets: Vec<usize> = want.rows.iter().map(|m| m.offset).collect();
    if c.rows() != want.rows.len() || c.offsets() != offsets {
        return bad(format!("{} rows at offsets {:?}, the models have {offsets:?}", c.rows(), c.offsets()));
    }
    if c.is_trimmable() != want.trimmable {
        return bad(format!("is_trimmable = {}, the models say {}", c.is_trimmable(), want.trimmable));
    }
    let phases: Vec<cache::DecodePhase> = want
        .rows
        .iter()
        .map(|m| if m.decode_phase_is_ring() { cache::DecodePhase::Ring } else { cache::DecodePhase::Concat })
        .collect();
    if c.decode_phase() != Some(phases.clone()) {
        return bad(format!("decode_phase {:?}, the models say {phases:?}", c.decode_phase()));
    }
    let composed = c.composed().map(|x| x.storage);
    if composed != want.composed {
        return bad(format!("composes {composed:?}, expected {:?}", want.composed));
    }
    // Rows of one precision cost one rate; rows of mixed precision (some bf16-first rows converted) each their own,
    // which the per-row answers of those rows cover.
    let uniform = want.composed.as_ref().is_none_or(|k| k.windows(2).all(|w| w[0] == w[1]));
    let per = c.bytes_per_token().ok_or_else(|| Failure::new("contract", format!("{what}: no bytes_per_token")))?;
    let live: usize = want.rows.iter().map(|m| m.cols.len()).sum();
    // `nbytes` of the lazily sliced state: shapes only, nothing evaluated.
    let state = c.state().map_err(|e| Failure::new("contract", format!("{what}: state(): {e}")))?;
    let stored: usize = state.iter().map(|a| a.nbytes()).sum();
    if uniform && per * live != stored {
        return bad(format!("bytes_per_token {per} x {live} live columns, {stored} bytes stored"));
    }
    Ok(())
}
