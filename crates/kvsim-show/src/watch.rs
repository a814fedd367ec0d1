//! The observers of a shown replay: [`Verdicts`] records how every op ended; [`Watcher`] watches one family (its
//! production calls and its state after every op) and keeps what the page draws.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use kvsim_cache::bytes::ArrayBytes;
use kvsim_cache::mask::MaskUse;
use kvsim_harness::sim::config::{DtypeChoice, SimConfig};
use kvsim_harness::sim::family::transition;
use kvsim_harness::sim::observe::{Call, RingView, RunObserver, StateView, TrimInfo};
use kvsim_harness::sim::ops::Op;
use kvsim_reference::{BitsKind, RefDtype, RefQuant, Tensor, Tok, ValueSpace};
use mlx_rs::Dtype;

use crate::page::{LayerSnap, MaskPic, ModelRing, OpSnap, Place, RingSnap, RowSnap, SsmSnap, Stage, TokRun};

/// How each op ended (`Ok(true)` applied, `Ok(false)` skipped, `Err(check)` failed).
#[derive(Debug, Default)]
pub struct Verdicts {
    pub results: Vec<Result<bool, String>>,
}

impl RunObserver for Verdicts {
    fn on_op_end(&mut self, index: usize, _op: &Op, result: Result<bool, &str>) {
        self.results.resize(index, Ok(false));
        self.results.push(result.map_err(str::to_string));
    }
}

/// A read output of the current op (kept for the failure's actual bytes).
pub struct OutRec {
    pub layer: usize,
    /// The requests of the output's rows, in row order.
    pub reqs: Vec<u32>,
    /// A read of the running batch (or of a prefill batch), not of one request alone.
    pub batch: bool,
    pub bytes: ArrayBytes,
    /// The same read of each row's solo twin, in row order (empty when the family handed none over).
    pub twins: Vec<ArrayBytes>,
}

/// The raw bytes of one request's state after the last op: per layer the K and V views (recurrent rows: conv and
/// recurrent state); affine storage: per layer the six planes.
pub struct RawState {
    pub offset: usize,
    pub layers: Vec<(ArrayBytes, ArrayBytes)>,
    pub planes: Vec<Vec<ArrayBytes>>,
    /// Families with rings: per layer, the live physical K and V columns (packed words under affine storage).
    pub rings: Vec<(ArrayBytes, ArrayBytes)>,
}

/// Watches one family of a run (the runner hands the others a do-nothing observer).
pub struct Watcher {
    pub family: String,
    pub ssm: bool,
    pub vs: ValueSpace,
    /// The family's storage now: `Some` once affine (the quantized family).
    pub quant: Option<RefQuant>,
    /// One snapshot per op index seen (`None`: skipped, nothing was handed over).
    pub snaps: Vec<Option<OpSnap>>,
    /// Where every live request is after each op (carried over skipped ops).
    pub places: Vec<BTreeMap<u32, Place>>,
    /// The current op's outputs and the last state's raw bytes (for the failure).
    pub outs: Vec<OutRec>,
    pub raw: BTreeMap<u32, RawState>,
    /// The recurrent family's batch rows as its last batch call listed them, and the layers its calls named (its
    /// states list these layers, in order).
    pub ssm_rows: Vec<u32>,
    pub ssm_layers: BTreeSet<usize>,
    /// The op of that batch call (the family describes no extract or filter: rows may have left since).
    ssm_rows_at: Option<usize>,
    /// The recurrent family's DeltaNet layers, as its geometry call describes them.
    pub ssm_layer_count: Option<usize>,
    op: usize,
    /// An observer error (an array that could not be read): it also fails the run.
    pub error: Option<String>,
    /// How each op ended, as [`Verdicts`] records it.
    pub results: Vec<Result<bool, String>>,
    calls: Vec<String>,
    /// The masks of the reads since the last state: `(layer, read, picture)`.
    masks: Vec<(usize, String, MaskPic)>,
    stages: Vec<Stage>,
    got_state: bool,
    rows: Vec<u32>,
    prefill_rows: Vec<u32>,
    live: BTreeMap<u32, Place>,
    admitted: BTreeSet<u32>,
    max_offset: usize,
    /// Column fingerprints already identified, per layer.
    known: HashMap<(u32, u64), Tok>,
    /// The expected K fingerprint of a token per layer and storage (`None` plain, else affine `(bits, group)`).
    expected_fp: HashMap<(u32, Tok, Option<(usize, usize)>), u64>,
    /// The bf16-first families: each request's storage is its own (bf16 until it converts), as its state says.
    per_request_quant: bool,
    last_digests: BTreeMap<(u32, usize), (String, String)>,
}

fn ref_dtype(cfg: &SimConfig) -> RefDtype {
    match cfg.dtype {
        DtypeChoice::F32 => RefDtype::F32,
        DtypeChoice::Bf16 => RefDtype::Bf16,
    }
}

/// `dtype [shape]`.
pub fn describe(ab: &ArrayBytes) -> String {
    let dt = match ab.dtype {
        Dtype::Bfloat16 => "bf16".to_string(),
        Dtype::Float32 => "f32".to_string(),
        Dtype::Uint32 => "u32".to_string(),
        other => format!("{other:?}").to_lowercase(),
    };
    format!("{dt} {:?}", ab.shape)
}

fn fingerprint(words: &[u32]) -> u64 {
    let mut h = blake3::Hasher::new();
    for w in words {
        h.update(&w.to_le_bytes());
    }
    u64::from_le_bytes(h.finalize().as_bytes()[..8].try_into().expect("8 bytes"))
}

fn digest(ab: &ArrayBytes) -> String {
    blake3::hash(&ab.words.le_bytes()).to_hex()[..16].to_string()
}

/// Elements `[0, h, c, :]` for every head `h` of a `[1, H, L, D]` array, as u32 words.
pub fn column(ab: &ArrayBytes, c: usize) -> Vec<u32> {
    let s: Vec<usize> = ab.shape.iter().map(|&x| x.max(0) as usize).collect();
    if s.len() != 4 || c >= s[2] {
        return vec![];
    }
    let (h, l, d) = (s[1], s[2], s[3]);
    let mut out = Vec::with_capacity(h * d);
    for hh in 0..h {
        let start = (hh * l + c) * d;
        out.extend((start..start + d).map(|i| ab.words.get(i) as u32));
    }
    out
}

fn len_of(ab: &ArrayBytes) -> usize {
    ab.shape.get(2).map_or(0, |&x| x.max(0) as usize)
}

fn trim_text(t: &TrimInfo) -> String {
    let n = if t.n.len() == 1 { t.n[0].to_string() } else { format!("{:?}", t.n) };
    let res = match &t.kvsim {
        Ok(k) => format!("trimmed {k}"),
        Err(e) => format!("refused: {e}"),
    };
    format!("trim {n}{} (live {:?}): {res}", if t.bypass { " (bypass)" } else { "" }, t.live)
}

/// Consecutive calls that differ only in their layer (`layer N: ...`) as one line (`layers 0, 1: ...`).
pub fn merge_layers(calls: Vec<String>) -> Vec<String> {
    let split = |c: &str| -> Option<(usize, String)> {
        let rest = c.strip_prefix("layer ")?;
        let (n, tail) = rest.split_once(": ")?;
        Some((n.parse().ok()?, tail.to_string()))
    };
    let mut out: Vec<(Vec<usize>, String)> = vec![];
    let mut plain: Vec<Option<String>> = vec![];
    for c in calls {
        match split(&c) {
            Some((n, tail)) => {
                if let (Some(last), Some(None)) = (out.last_mut(), plain.last()) {
                    if last.1 == tail && !last.0.contains(&n) {
                        last.0.push(n);
                        continue;
                    }
                }
                out.push((vec![n], tail));
                plain.push(None);
            }
            None => {
                out.push((vec![], String::new()));
                plain.push(Some(c));
            }
        }
    }
    out.into_iter()
        .zip(plain)
        .map(|((layers, tail), p)| match (p, layers.len()) {
            (Some(c), _) => c,
            (None, 1) => format!("layer {}: {tail}", layers[0]),
            (None, _) => {
                let l: Vec<String> = layers.iter().map(|l| l.to_string()).collect();
                format!("layers {}: {tail}", l.join(", "))
            }
        })
        .collect()
}

fn bytes(a: &mlx_rs::Array) -> Result<ArrayBytes, String> {
    ArrayBytes::of(a).map_err(|e| e.to_string())
}

fn rows_text(reqs: &[u32], rows: &[(usize, usize)]) -> String {
    let each: Vec<String> = reqs.iter().zip(rows).map(|(r, (o, l))| format!("{r} (offset {o}, {l} live)")).collect();
    each.join(", ")
}

impl Watcher {
    /// A watcher of the family `family` of a run of `cfg` (`ssm`: the recurrent family).
    pub fn new(family: &str, cfg: &SimConfig) -> Watcher {
        let mut vs = cfg.value_space();
        let mut quant = None;
        if family == "quant" {
            if let Some(q) = kvsim_harness::sim::family::quant::QuantChoice::of(cfg) {
                vs.head_dim = q.head_dim;
                quant = q.native.then_some(RefQuant { bits: q.bits, group: q.group });
            }
        }
        vs.dtype = ref_dtype(cfg);
        let per_request_quant = family == transition::NAME || family == transition::LEGO_NAME;
        if per_request_quant {
            // The bf16-first families run their own head dim, in bf16 until each request converts.
            vs.head_dim = transition::TransitionChoice::draw(cfg).head_dim;
            vs.dtype = RefDtype::Bf16;
        }
        Watcher {
            family: family.to_string(),
            ssm: family == "ssm",
            vs,
            quant,
            snaps: vec![],
            places: vec![],
            outs: vec![],
            raw: BTreeMap::new(),
            ssm_rows: vec![],
            ssm_layers: BTreeSet::new(),
            ssm_rows_at: None,
            ssm_layer_count: None,
            op: 0,
            error: None,
            results: vec![],
            calls: vec![],
            masks: vec![],
            stages: vec![],
            got_state: false,
            rows: vec![],
            prefill_rows: vec![],
            live: BTreeMap::new(),
            admitted: BTreeSet::new(),
            max_offset: 0,
            known: HashMap::new(),
            expected_fp: HashMap::new(),
            per_request_quant,
            last_digests: BTreeMap::new(),
        }
    }

    fn expected_fingerprint(&mut self, layer: u32, tok: Tok) -> u64 {
        let vs = self.vs;
        let q = self.quant;
        *self.expected_fp.entry((layer, tok, q.map(|q| (q.bits, q.group)))).or_insert_with(|| match q {
            None => fingerprint(&vs.column_bits(layer, Tensor::K, tok)),
            Some(q) => fingerprint(&kvsim_reference::quant::quantized_column(&vs, layer, Tensor::K, tok, q).packed),
        })
    }

    /// The token whose K column has these words (plain bits, or packed words under affine storage): the expected
    /// one first, then any earlier identification, then every admitted request's positions.
    fn identify(&mut self, layer: u32, words: &[u32], expected: Tok) -> (String, Option<Tok>) {
        let fp = fingerprint(words);
        if self.expected_fingerprint(layer, expected) == fp {
            return ("tok".into(), Some(expected));
        }
        if let Some(t) = self.known.get(&(layer, fp)) {
            return ("tok".into(), Some(*t));
        }
        if self.quant.is_none() {
            match self.vs.classify(words) {
                BitsKind::Padding => return ("pad".into(), None),
                BitsKind::Zeros => return ("zero".into(), None),
                _ => {}
            }
        }
        let reqs: Vec<u32> = self.admitted.iter().copied().collect();
        let top = self.max_offset as u32 + 1;
        for r in reqs {
            for p in 0..top {
                let t = Tok::new(r, p);
                if self.expected_fingerprint(layer, t) == fp {
                    self.known.insert((layer, fp), t);
                    return ("tok".into(), Some(t));
                }
            }
        }
        ("unknown".into(), None)
    }

    /// The window of a `[1, H, L, ·]` view (plain K, or affine K words) as runs of identified tokens.
    fn runs(&mut self, layer: u32, req: u32, offset: usize, k: &ArrayBytes) -> Vec<TokRun> {
        let len = len_of(k);
        self.runs_by(layer, k, |c| Some(Tok::new(req, (offset + c).saturating_sub(len) as u32)), req)
    }

    /// The columns of a `[1, H, L, ·]` array as runs of identified tokens; column `c` is `expected` when it holds
    /// `expected(c)` (`None`: no token belongs there). Runs of one request's consecutive positions merge.
    fn runs_by(
        &mut self,
        layer: u32,
        k: &ArrayBytes,
        expected: impl Fn(usize) -> Option<Tok>,
        req: u32,
    ) -> Vec<TokRun> {
        let mut out: Vec<TokRun> = vec![];
        for c in 0..len_of(k) {
            let words = column(k, c);
            let want = expected(c);
            let (kind, tok) = self.identify(layer, &words, want.unwrap_or(Tok::new(req, 0)));
            let tok_ok = want.is_some() && tok == want;
            let fallback = want.map_or(0, |t| t.pos);
            let (r, p) = tok.map_or((req, fallback), |t| (t.req, t.pos));
            if let Some(last) = out.last_mut() {
                let follows = last.kind == kind
                    && last.expected == tok_ok
                    && (kind != "tok" || last.req == r && last.pos + last.n == p);
                if follows {
                    last.n += 1;
                    continue;
                }
            }
            out.push(TokRun { kind, req: r, pos: p, n: 1, expected: tok_ok, named: false });
        }
        out
    }

    /// A ring as the page draws it: production's physical columns identified against the model's, its numbers,
    /// and the model's ring where anything differs. `width`: the widest batch row of the model (for its padding).
    fn ring_snap(&mut self, layer: u32, req: u32, ring: &RingView, k: &ArrayBytes, width: usize) -> RingSnap {
        let m = &ring.model;
        let cols = m.cols.clone();
        let columns = self.runs_by(layer, k, |c| cols.get(c).copied(), req);
        let st = &ring.state;
        let model_pad = ring.left_padding.map(|_| m.left_padding(width));
        let agrees = columns.iter().all(|r| r.expected)
            && len_of(k) == m.cols.len()
            && (st.offset, st.idx, st.last_concat) == (m.offset, m.idx, m.last_concat)
            && (ring.left_padding, ring.pending) == (model_pad, m.pending.filter(|_| ring.left_padding.is_some()));
        let model = (!agrees).then(|| ModelRing {
            columns: m.cols.iter().map(|t| (t.req, t.pos)).collect(),
            offset: m.offset,
            idx: m.idx,
            last_concat: m.last_concat,
            left_padding: model_pad,
            pending: m.pending,
        });
        RingSnap {
            columns,
            offset: st.offset,
            len: st.len,
            idx: st.idx,
            last_concat: st.last_concat,
            rotated: st.is_rotated(),
            left_padding: ring.left_padding,
            pending: ring.pending,
            model,
        }
    }

    /// Keeps the mask a read of `layer` attended with (described as `read`), for the stage's pictures.
    fn keep_mask(&mut self, layer: usize, read: String, mask: &MaskUse) {
        let pic = match mask {
            MaskUse::None => MaskPic {
                what: String::new(),
                kind: "none".into(),
                rows: 0,
                queries: 0,
                cols: 0,
                grid: vec![],
                clipped: false,
            },
            MaskUse::Causal => MaskPic {
                what: String::new(),
                kind: "causal".into(),
                rows: 0,
                queries: 0,
                cols: 0,
                grid: vec![],
                clipped: false,
            },
            MaskUse::Array(spec) => {
                let (b, l, n) = (spec.rows, spec.queries, spec.cols);
                let mut grid = vec![];
                for line in 0..(b * l).min(MaskPic::LINES) {
                    let at = line * n;
                    let row: String = (0..n.min(MaskPic::COLS))
                        .map(|c| if spec.visible.get(at + c).copied().unwrap_or(false) { '#' } else { '.' })
                        .collect();
                    grid.push(row);
                }
                let clipped = b * l > MaskPic::LINES || n > MaskPic::COLS;
                MaskPic { what: String::new(), kind: "matrix".into(), rows: b, queries: l, cols: n, grid, clipped }
            }
        };
        self.masks.push((layer, read, pic));
    }

    /// The masks kept since the last state, one per distinct read and mask (their layers listed together).
    fn take_masks(&mut self) -> Vec<MaskPic> {
        let mut out: Vec<(Vec<usize>, String, MaskPic)> = vec![];
        for (layer, read, pic) in std::mem::take(&mut self.masks) {
            match out.iter_mut().find(|(ls, r, p)| *r == read && *p == pic && !ls.contains(&layer)) {
                Some(e) => e.0.push(layer),
                None => out.push((vec![layer], read, pic)),
            }
        }
        out.into_iter()
            .map(|(ls, read, mut pic)| {
                let ls: Vec<String> = ls.iter().map(|l| l.to_string()).collect();
                let which = if ls.len() == 1 { "layer" } else { "layers" };
                pic.what = format!("{which} {}: {read}", ls.join(", "));
                pic
            })
            .collect()
    }

    /// The model layer of the recurrent family's `k`-th state (`k` itself before any call named its layers).
    pub fn ssm_layer(&self, k: usize) -> usize {
        self.ssm_layers.iter().nth(k).copied().unwrap_or(k)
    }

    fn line(&mut self, s: String) {
        self.calls.push(s);
    }

    fn keep_out(
        &mut self,
        layer: usize,
        reqs: Vec<u32>,
        batch: bool,
        out: &mlx_rs::Array,
        twins: &[&mlx_rs::Array],
    ) -> Result<(), String> {
        let bytes = bytes(out)?;
        let twins = twins.iter().map(|t| self::bytes(t)).collect::<Result<_, _>>()?;
        self.outs.push(OutRec { layer, reqs, batch, bytes, twins });
        Ok(())
    }

    fn describe_call(&mut self, call: &Call<'_>) -> Result<(), String> {
        match *call {
            Call::Admit { req } => {
                self.admitted.insert(req);
                self.line(format!("admit request {req}"));
            }
            Call::Solo { req, layer, read, k, out, offset, mask, twin, .. } => {
                let l = len_of(&bytes(k)?);
                self.line(format!("layer {layer}: request {req} alone: {} of {l} at offset {offset}", read.name()));
                if let Some(m) = mask {
                    self.keep_mask(layer, format!("request {req} alone, {} of {l}", read.name()), m);
                }
                if let Some(o) = out {
                    let twins: Vec<&mlx_rs::Array> = twin.into_iter().collect();
                    self.keep_out(layer, vec![req], false, o, &twins)?;
                }
            }
            Call::SoloTrim { req, offset, trim } => {
                self.line(format!("request {req} alone at offset {offset}: {}", trim_text(trim)));
            }
            Call::Enter { reqs, merge, offsets, sizes } => {
                self.rows.extend_from_slice(reqs);
                let how = if merge { "merge" } else { "join" };
                let each: Vec<String> = reqs
                    .iter()
                    .zip(offsets)
                    .zip(sizes)
                    .map(|((r, o), s)| format!("{r} (offset {o}, {s} live)"))
                    .collect();
                self.line(format!("requests {} enter the batch by {how}", each.join(", ")));
            }
            Call::Prefill { reqs, lengths, chunk } => {
                self.prefill_rows = reqs.to_vec();
                self.admitted.extend(reqs.iter().copied());
                self.line(format!("prefill of requests {reqs:?}: lengths {lengths:?}, chunks of {chunk}"));
            }
            Call::PrefillChunk { layer, k, real, done, padded, out, reqs, .. } => {
                let l = len_of(&bytes(k)?);
                let pad = if padded { " (right-padded)" } else { "" };
                self.line(format!("layer {layer}: prefill chunk of {l} after {done}{pad}: real queries {real:?}"));
                self.keep_out(layer, reqs.to_vec(), true, out, &[])?;
            }
            Call::PrefillEnd { longest } => {
                let p = std::mem::take(&mut self.prefill_rows);
                self.line(format!("prefill ends (longest {longest}): requests {p:?} join the batch"));
                self.rows.extend(p);
            }
            Call::Batch { layer, read, reqs, rows, k, out, mask, twins, .. } => {
                let l = len_of(&bytes(k)?);
                self.line(format!("layer {layer}: batch {} of {l}: rows {}", read.name(), rows_text(reqs, rows)));
                if let Some(m) = mask {
                    self.keep_mask(layer, format!("batch {} of {l}, rows {reqs:?}", read.name()), m);
                }
                if let Some(o) = out {
                    let twins: Vec<&mlx_rs::Array> = twins.iter().collect();
                    self.keep_out(layer, reqs.to_vec(), true, o, &twins)?;
                }
            }
            Call::BatchSpan { layer, reqs, rows, k, out, twins, .. } => {
                let l = len_of(&bytes(k)?);
                self.line(format!("layer {layer}: batch span of {l}: rows {}", rows_text(reqs, rows)));
                let twins: Vec<&mlx_rs::Array> = twins.iter().collect();
                self.keep_out(layer, reqs.to_vec(), true, out, &twins)?;
            }
            Call::BatchWritten { l } => self.line(format!("every batch row received {l}")),
            Call::TrimRows { reqs, trim, .. } => self.line(format!("batch rows {reqs:?}: per-row {}", trim_text(trim))),
            Call::Trim { reqs, trim, .. } => self.line(format!("batch rows {reqs:?}: {}", trim_text(trim))),
            Call::Extract { row, req, finish, rows_left } => {
                if row < self.rows.len() {
                    self.rows.remove(row);
                }
                let then = if finish { "finishes" } else { "continues alone" };
                self.line(format!("row {row} (request {req}) extracted, {then}; {rows_left} rows left"));
            }
            Call::Filter { keep } => {
                let before = self.rows.clone();
                self.rows = keep.iter().filter_map(|&k| before.get(k).copied()).collect();
                self.line(format!("filter keeps rows {keep:?} of {before:?}"));
            }
            Call::Quantize { bits, group, converted } => {
                if converted {
                    self.quant = Some(RefQuant { bits, group });
                    self.expected_fp.clear();
                    self.known.clear();
                }
                let what = if converted { "converted" } else { "unchanged" };
                self.line(format!("quantize to {bits} bits, group {group}: {what}"));
            }
            Call::SsmLayers { spec, params } => {
                self.ssm_layer_count = Some(params.len());
                self.line(format!(
                    "gated DeltaNet, {} layers: kernel {}, key heads {} x {}, value heads {} x {}, conv width {}",
                    params.len(),
                    spec.kernel,
                    spec.heads_k,
                    spec.dk,
                    spec.heads_v,
                    spec.dv,
                    spec.conv_dim()
                ));
            }
            Call::SsmCall { req, layer, read, reqs, spans, out, .. } => {
                self.ssm_layers.insert(layer);
                let who = match req {
                    Some(r) => format!("request {r} alone"),
                    None => {
                        self.ssm_rows = reqs.to_vec();
                        self.ssm_rows_at = Some(self.op);
                        format!("batch rows {reqs:?}")
                    }
                };
                self.line(format!("layer {layer}: {who}: {} over real spans {spans:?}", read.name()));
                let rows = if req.is_some() { req.into_iter().collect() } else { reqs.to_vec() };
                self.keep_out(layer, rows, req.is_none(), out, &[])?;
            }
            Call::SsmPrepare { lengths, left } => {
                self.line(format!("prepare lengths {lengths:?}, left padding {left:?}"));
            }
            Call::SsmFinalize => self.line("finalize".to_string()),
            Call::SsmRound { reqs, gamma, keep } => {
                let verdict = if keep.iter().all(|&k| k == gamma) { "commit" } else { "rollback" };
                self.line(format!("round of {gamma} on rows {reqs:?}: keep {keep:?} ({verdict})"));
            }
        }
        Ok(())
    }

    fn snapshot(&mut self, views: BTreeMap<u32, StateView>) -> Result<(), String> {
        let mut rows = vec![];
        let mut raw = BTreeMap::new();
        // The batch as the states place it (every family's states name their rows).
        let mut placed: Vec<(usize, u32)> = views.iter().filter_map(|(&r, v)| v.row.map(|i| (i, r))).collect();
        placed.sort_unstable();
        let placed: Vec<u32> = placed.into_iter().map(|p| p.1).collect();
        if self.ssm {
            self.ssm_rows = placed;
            self.ssm_rows_at = Some(self.op);
        } else {
            self.rows = placed;
        }
        let batch: Vec<u32> = if self.ssm { self.ssm_rows.clone() } else { self.rows.clone() };
        // Batch rows first, in row order, then the requests alone.
        let mut order: Vec<u32> = batch.iter().copied().filter(|r| views.contains_key(r)).collect();
        order.extend(views.keys().copied().filter(|r| !batch.contains(r)));
        let mut views = views;
        // The model's widest batch row, per layer (its left padding is measured against it).
        let widths: Vec<usize> = {
            let mut w = vec![];
            for v in batch.iter().filter_map(|r| views.get(r)) {
                w.resize(w.len().max(v.rings.len()), 0);
                for (l, ring) in v.rings.iter().enumerate() {
                    w[l] = w[l].max(ring.model.cols.len());
                }
            }
            w
        };
        for req in order {
            let Some(view) = views.remove(&req) else { continue };
            if self.per_request_quant {
                self.quant = view.quant.map(|(bits, group)| RefQuant { bits, group });
            }
            self.admitted.insert(req);
            self.max_offset = self.max_offset.max(view.offset);
            let home = match (batch.iter().position(|&r| r == req), self.ssm_rows_at) {
                (Some(i), Some(at)) if self.ssm && at != self.op => format!("batch row {i} at op {at}'s batch call"),
                (Some(i), _) => format!("batch row {i}"),
                (None, _) => "solo".to_string(),
            };
            let mut layers = vec![];
            let mut raw_layers = vec![];
            let mut raw_planes = vec![];
            for (l, (a, b)) in view.layers.iter().enumerate() {
                let (a, b) = (bytes(a)?, bytes(b)?);
                if self.ssm {
                    let (cd, rd) = (digest(&a), digest(&b));
                    let prev = self.last_digests.insert((req, l), (cd.clone(), rd.clone()));
                    let (cc, rc) = prev.map_or((true, true), |(pc, pr)| (pc != cd, pr != rd));
                    let ssm = SsmSnap {
                        conv: describe(&a),
                        rec: describe(&b),
                        conv_digest: cd,
                        rec_digest: rd,
                        conv_changed: cc,
                        rec_changed: rc,
                    };
                    let storage = "recurrent".to_string();
                    let layer = self.ssm_layer(l);
                    let (len, tokens, planes) = (0, vec![], vec![]);
                    layers.push(LayerSnap { layer, len, tokens, storage, planes, ssm: Some(ssm), ring: None });
                } else {
                    let tokens = self.runs(l as u32, req, view.offset, &a);
                    let storage = "plain".to_string();
                    let len = len_of(&a);
                    layers.push(LayerSnap { layer: l, len, tokens, storage, planes: vec![], ssm: None, ring: None });
                }
                raw_layers.push((a, b));
            }
            if let Some(planes) = &view.planes {
                for (l, six) in planes.iter().enumerate() {
                    let six: Vec<ArrayBytes> = six.iter().map(bytes).collect::<Result<_, _>>()?;
                    let names = ["K words", "K scales", "K biases", "V words", "V scales", "V biases"];
                    let planes: Vec<String> =
                        six.iter().zip(names).map(|(p, n)| format!("{n} {}", describe(p))).collect();
                    let storage = match self.quant {
                        Some(q) => format!("affine {}-bit, group {}", q.bits, q.group),
                        None => "affine".to_string(),
                    };
                    let (len, tokens) = match six.first() {
                        Some(kq) => (len_of(kq), self.runs(l as u32, req, view.offset, kq)),
                        None => (0, vec![]),
                    };
                    layers.push(LayerSnap { layer: l, len, tokens, storage, planes, ssm: None, ring: None });
                    raw_planes.push(six);
                }
            }
            let mut raw_rings = vec![];
            for (l, ring) in view.rings.iter().enumerate() {
                let (k, v) = (bytes(&ring.k)?, bytes(&ring.v)?);
                let snap = self.ring_snap(l as u32, req, ring, &k, widths.get(l).copied().unwrap_or(0));
                if let Some(layer) = layers.get_mut(l) {
                    layer.ring = Some(snap);
                }
                raw_rings.push((k, v));
            }
            let place = if home == "solo" { Place::Solo } else { Place::Batch };
            self.live.insert(req, place);
            rows.push(RowSnap { req, home, offset: view.offset, layers });
            let state = RawState { offset: view.offset, layers: raw_layers, planes: raw_planes, rings: raw_rings };
            raw.insert(req, state);
        }
        self.live.retain(|r, _| raw.contains_key(r));
        self.raw = raw;
        self.got_state = true;
        let calls = merge_layers(std::mem::take(&mut self.calls));
        let stage = Stage { source: String::new(), calls, batch, rows, masks: self.take_masks() };
        self.stages.push(stage);
        Ok(())
    }
}

impl RunObserver for Watcher {
    fn on_op_start(&mut self, index: usize, _op: &Op) {
        self.op = index;
        self.calls.clear();
        self.masks.clear();
        self.outs.clear();
        self.got_state = false;
        self.stages.clear();
    }

    fn wants_calls(&self) -> bool {
        true
    }

    fn watches(&self, family: &str) -> bool {
        family == self.family
    }

    fn on_call(&mut self, call: Call<'_>) -> Result<(), String> {
        self.describe_call(&call).inspect_err(|e| self.error = Some(e.clone()))
    }

    fn on_state(&mut self, views: BTreeMap<u32, StateView>) -> Result<(), String> {
        self.snapshot(views).inspect_err(|e| self.error = Some(e.clone()))
    }

    fn on_op_end(&mut self, index: usize, _op: &Op, result: Result<bool, &str>) {
        self.snaps.resize(index, None);
        self.places.resize(index, self.live.clone());
        self.results.resize(index, Ok(false));
        self.results.push(result.map_err(str::to_string));
        let mut stages = std::mem::take(&mut self.stages);
        let n = stages.len();
        for (i, s) in stages.iter_mut().enumerate() {
            s.source = if i + 1 == n {
                "after the op".to_string()
            } else {
                format!("handed over mid-op (checkpoint {} of {n}: a verify's window, before its rollback)", i + 1)
            };
        }
        let calls = merge_layers(std::mem::take(&mut self.calls));
        let batch = if self.ssm { self.ssm_rows.clone() } else { self.rows.clone() };
        let missing = match result {
            Err(check) if !self.got_state || !calls.is_empty() => {
                Some(format!("the op stopped at check [{check}] before the family handed over its final state"))
            }
            Ok(true) if !self.got_state => Some("the family handed over no state after this op".to_string()),
            _ => None,
        };
        if !calls.is_empty() {
            let (source, masks) = ("calls after the last state handed over".into(), self.take_masks());
            stages.push(Stage { source, calls, batch, rows: vec![], masks });
        }
        let snap = match (stages.is_empty(), result) {
            (true, Ok(false)) => None,
            _ => Some(OpSnap { stages, missing }),
        };
        self.snaps.push(snap);
        self.places.push(self.live.clone());
    }
}

#[cfg(test)]
mod tests {
    use super::merge_layers;

    #[test]
    fn calls_of_every_layer_read_as_one_line() {
        let calls =
            ["layer 0: batch decode of 1: rows 3", "layer 1: batch decode of 1: rows 3", "every batch row received 1"];
        let got = merge_layers(calls.iter().map(|c| c.to_string()).collect());
        assert_eq!(got, vec!["layers 0, 1: batch decode of 1: rows 3", "every batch row received 1"]);
        // Different calls stay apart, and so does a layer seen twice (a second chunk).
        let calls = ["layer 0: chunk a", "layer 0: chunk a", "layer 1: chunk b", "admit request 2"];
        let got = merge_layers(calls.iter().map(|c| c.to_string()).collect());
        assert_eq!(got, vec!["layer 0: chunk a", "layer 0: chunk a", "layer 1: chunk b", "admit request 2"]);
    }
}
