//! Masks (R-C-2, R-C-3): host-side visibility matrices, built once per forward and shared by every layer.
//!
//! A [`Masks`] value lives for one forward. Every read asks it for the mask of its geometry ([`MaskKey`]); each
//! distinct geometry is built once (host matrix + MLX array) and handed out again to every later layer, which
//! [`Masks::builds`] proves. The MLX array is `[B, 1, L, cols]` bool (broadcast over heads); `true` = visible.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

use mlx_rs::Array;

use super::util::dim;
use super::Result;

/// What a read's mask depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MaskKind {
    /// One query per row over physical ring columns: column `c` of row `b` is visible iff `c < lens[b]`.
    Decode,
    /// `queries` new positions per row (the last `real[b]` stored columns of row `b` are this window's real
    /// positions): real query `i < real[b]` at position `q` sees column `c` (position `p_c`) iff `c < lens[b]`,
    /// `p_c <= q` and `q - p_c < window`; padded queries (`i >= real[b]`) see column 0 only (finite, unspecified).
    Window,
}

/// The geometry of one read: everything its visibility depends on (the memo key of [`Masks`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct MaskKey {
    /// Which rule builds the matrix: a decode read (`c < len_r`) or a window read (causal, sliding).
    pub kind: MaskKind,
    /// Per row: live columns after the write (`len_r`).
    pub lens: Vec<usize>,
    /// Per row: real positions of this write (`1` for decode).
    pub real: Vec<usize>,
    /// Queries per row (`L`).
    pub queries: usize,
    /// The sliding window (`None` = unbounded).
    pub window: Option<usize>,
    /// Columns attended (`max_r len_r`, at least 1).
    pub cols: usize,
}

/// One visibility matrix, host side: `visible[(b * queries + i) * cols + c]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MaskSpec {
    /// Rows `B` of the matrix (1 for a matrix broadcast over every row of the read).
    pub rows: usize,
    /// Queries per row (`L`).
    pub queries: usize,
    /// Key columns per query: the physical columns of a cache geometry, or the `N` positions of a family mask.
    pub cols: usize,
    /// `rows * queries * cols` flags, row-major; `true` = query `i` of row `b` sees column `c`.
    pub visible: Vec<bool>,
}

impl MaskSpec {
    /// The matrix of a geometry (pure; see [`MaskKind`] for the rule).
    pub fn build(key: &MaskKey) -> MaskSpec {
        let rows = key.lens.len();
        let (l, cols) = (key.queries, key.cols);
        let mut visible = vec![false; rows * l * cols];
        for b in 0..rows {
            let len = key.lens[b];
            let real = key.real.get(b).copied().unwrap_or(0);
            for i in 0..l {
                let row = &mut visible[(b * l + i) * cols..(b * l + i + 1) * cols];
                match key.kind {
                    MaskKind::Decode => {
                        for (c, v) in row.iter_mut().enumerate() {
                            *v = c < len;
                        }
                    }
                    MaskKind::Window if i < real && real <= len => {
                        // Relative to the row's newest stored position (offset - 1):
                        // query i sits at len - real + i, column c at c.
                        let q = len - real + i;
                        for (c, v) in row.iter_mut().enumerate() {
                            *v = c < len && c <= q && key.window.is_none_or(|w| q - c < w);
                        }
                    }
                    MaskKind::Window => {
                        if let Some(v) = row.first_mut() {
                            *v = true;
                        }
                    }
                }
            }
        }
        MaskSpec { rows, queries: l, cols, visible }
    }

    /// Whether query `i` of row `b` sees column `c`.
    pub fn is_visible(&self, b: usize, i: usize, c: usize) -> bool {
        b < self.rows && i < self.queries && c < self.cols && self.visible[(b * self.queries + i) * self.cols + c]
    }

    /// The visible columns of query `i` of row `b`.
    pub fn visible_columns(&self, b: usize, i: usize) -> Vec<usize> {
        (0..self.cols).filter(|&c| self.is_visible(b, i, c)).collect()
    }

    /// The MLX array `[rows, 1, queries, cols]` bool.
    pub fn to_array(&self) -> Result<Array> {
        Ok(Array::from_slice(&self.visible, &[dim(self.rows)?, 1, dim(self.queries)?, dim(self.cols)?]))
    }

    /// Row `b`'s block of this matrix: its first `queries` queries over its first `cols` columns, as a one-row
    /// matrix. Out of range is [`crate::CacheError::InvalidState`].
    pub fn block(&self, b: usize, queries: usize, cols: usize) -> Result<MaskSpec> {
        if b >= self.rows || queries > self.queries || cols > self.cols {
            return Err(super::error::invalid(format!(
                "block of row {b}, {queries} x {cols}, of a {} x {} x {} mask",
                self.rows, self.queries, self.cols
            )));
        }
        let visible = (0..queries).flat_map(|i| (0..cols).map(move |c| self.is_visible(b, i, c))).collect();
        Ok(MaskSpec { rows: 1, queries, cols, visible })
    }
}

/// Row `b`'s block of a built mask ([`MaskSpec::block`]) with a view of the same MLX array (`[1, 1, queries, cols]`):
/// how a row layout hands each of its rows its part of the one mask it built for the forward.
pub(crate) fn row_block(
    mask: &(Rc<MaskSpec>, Array),
    b: usize,
    queries: usize,
    cols: usize,
) -> Result<(Rc<MaskSpec>, Array)> {
    use mlx_rs::ops::indexing::TryIndexOp;
    let spec = mask.0.block(b, queries, cols)?;
    let arr = mask.1.try_index((dim(b)?..dim(b + 1)?, .., 0..dim(queries)?, 0..dim(cols)?))?;
    Ok((Rc::new(spec), arr))
}

/// How a read was attended: no mask, MLX's bottom-right `Causal`, or an explicit boolean mask.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MaskUse {
    /// No mask: every query saw every column it was given (also the answer of a read of no rows).
    None,
    /// MLX's bottom-right causal mask: query `i` of `L` over `N` columns saw columns `[0, N - L + i + 1)`.
    Causal,
    /// This boolean matrix (the memoized one of [`Masks`], shared, not a copy).
    Array(Rc<MaskSpec>),
}

/// The mask families that are not a cache geometry (R-TRN-3, R-ROT-9): each is keyed by everything its visibility
/// depends on and memoized by [`Masks`] beside the [`MaskKey`] geometries. Every matrix is `[1, 1, N, N]` except
/// [`FamilyKey::Training`] with row lengths (`[B, 1, N, N]`) and [`FamilyKey::EncoderWindow`] (`[B, 1, L, cols]`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum FamilyKey {
    /// The offset-0 training mask of `queries` positions (R-TRN-3). `lengths: None` is the unpadded batch (one row,
    /// broadcast over the batch); `Some(l)` a right-padded batch whose row `b` holds `l[b]` real positions. Key `j`
    /// is visible to query `i` of row `b` iff `j <= i`, `j < l[b]` and (with a window) `i - j < window`: exactly
    /// mlx-lm 0.32.2's `create_causal_mask(N, 0, window, right_padding = N - l)` (`mlx_lm/models/base.py`), padded
    /// query rows included (their outputs are unspecified; a padded row may see no key at all).
    Training {
        /// Real positions per row of a right-padded batch (`None`: unpadded, one broadcast row).
        lengths: Option<Vec<usize>>,
        /// `N`: positions of the forward (queries = keys).
        queries: usize,
        /// The layer's sliding window (`None`: full attention).
        window: Option<usize>,
    },
    /// Chosen/rejected pairs sharing a prompt (`P` prompt, `Rc` chosen, `Rr` rejected positions, `N = P + Rc + Rr`):
    /// causal, and no rejected query (`i >= P + Rc`) sees a chosen key (`P <= j < P + Rc`); with a window also
    /// `logpos(i) - logpos(j) < window`, where `logpos(x) = x` for `x < P + Rc` and `x - Rc` after (the rejected
    /// answer continues the prompt's positions). Rule of the upstream engine's `PrefixSharedCache` (mlx-bun
    /// `packages/inference/src/state/training-cache.ts`).
    PrefixShared {
        /// `P`: prompt positions, seen by both answers.
        prompt: usize,
        /// `Rc`: chosen-answer positions, hidden from the rejected answer.
        chosen: usize,
        /// `Rr`: rejected-answer positions, after the chosen ones.
        rejected: usize,
        /// The layer's sliding window over logical positions (`None`: full attention).
        window: Option<usize>,
    },
    /// Gemma 4's vision prefill at offset 0 (R-ROT-9a): `causal(window) OR (image[i] AND image[j])`: image tokens
    /// see each other regardless of order and window (mlx-bun `bidirMask`, `src/model/gemma4-base.ts`).
    Bidirectional {
        /// Per position of the block: whether it is an image token (`N = image.len()`).
        image: Vec<bool>,
        /// The layer's sliding window for the causal part (`None`: full attention).
        window: Option<usize>,
    },
    /// DiffusionGemma's vision-encoder read (R-ROT-9b), `[B, 1, L, cols]` with `L = queries` and `cols = max_b
    /// keys[b]`. Row `b` attends `keys[b]` columns: its `keys[b] - L` stored history columns, oldest first and
    /// contiguous in position (the newest one just before the block), then the block's `L` positions. Block query
    /// `i` sits at column `a = keys[b] - L + i` and sees column `c` iff `c <= a` and (with a window) `a - c <
    /// window`: causal over history and block, limited only by the encoder's own window. The cache's `max_size`
    /// limits which history is stored (the newest `W - 1` positions), never this mask: with `window > W` a query
    /// sees every kept history column and every earlier block column, even past `W`. Columns `[keys[b], cols)`
    /// are another row's width and never visible. The upstream engine's rotating cache (mlx-bun) calls this mask
    /// `encoderWindowMask`; the rule is its documented one (causal under the encoder's window, which the cache's
    /// window does not limit), docs/training-and-special-reads.md.
    EncoderWindow {
        /// Per row: the columns the block sees, stored history plus the block (`>= queries`).
        keys: Vec<usize>,
        /// `L`: the block's positions (its queries).
        queries: usize,
        /// The encoder's own window (`None`: unbounded); never the cache's `max_size`.
        window: Option<usize>,
    },
}

impl FamilyKey {
    /// The memo family (one build per family and geometry per forward): `training:<w>`, `prefix-shared:<w>`,
    /// `bidirectional:<w>`, `encoder-window:<w>` (`w` = the window or `inf`).
    pub fn family(&self) -> String {
        let (name, w) = match self {
            FamilyKey::Training { window, .. } => ("training", window),
            FamilyKey::PrefixShared { window, .. } => ("prefix-shared", window),
            FamilyKey::Bidirectional { window, .. } => ("bidirectional", window),
            FamilyKey::EncoderWindow { window, .. } => ("encoder-window", window),
        };
        format!("{name}:{}", w.map_or("inf".to_string(), |w| w.to_string()))
    }

    /// Key columns of the matrix: `N` (= queries) for the square families, the widest row's keys for
    /// [`FamilyKey::EncoderWindow`].
    pub fn size(&self) -> usize {
        match self {
            FamilyKey::Training { queries, .. } => *queries,
            FamilyKey::PrefixShared { prompt, chosen, rejected, .. } => prompt + chosen + rejected,
            FamilyKey::Bidirectional { image, .. } => image.len(),
            FamilyKey::EncoderWindow { keys, .. } => keys.iter().copied().max().unwrap_or(0),
        }
    }

    /// The matrix (pure; see the variants for the rules).
    pub fn build(&self) -> MaskSpec {
        let n = self.size();
        let causal = |i: usize, j: usize, w: &Option<usize>| j <= i && w.is_none_or(|w| i - j < w);
        if let FamilyKey::EncoderWindow { keys, queries, window } = self {
            let (rows, l, cols) = (keys.len(), *queries, n);
            let mut visible = vec![false; rows * l * cols];
            for (b, &kb) in keys.iter().enumerate() {
                for i in 0..l {
                    // The block's query i at key column kb - l + i (a row with fewer keys than queries sees nothing).
                    let Some(a) = (kb + i).checked_sub(l) else { continue };
                    for c in 0..kb.min(cols) {
                        visible[(b * l + i) * cols + c] = causal(a, c, window);
                    }
                }
            }
            return MaskSpec { rows, queries: l, cols, visible };
        }
        let rows = match self {
            FamilyKey::Training { lengths: Some(l), .. } => l.len(),
            _ => 1,
        };
        let mut visible = vec![false; rows * n * n];
        for b in 0..rows {
            for i in 0..n {
                for j in 0..n {
                    visible[(b * n + i) * n + j] = match self {
                        FamilyKey::Training { lengths, window, .. } => {
                            causal(i, j, window) && lengths.as_ref().is_none_or(|l| j < l[b])
                        }
                        FamilyKey::PrefixShared { prompt, chosen, window, .. } => {
                            let split = prompt + chosen;
                            let logpos = |x: usize| if x < split { x } else { x - chosen };
                            let hidden = i >= split && (*prompt..split).contains(&j);
                            j <= i && !hidden && window.is_none_or(|w| logpos(i) - logpos(j) < w)
                        }
                        FamilyKey::Bidirectional { image, window } => causal(i, j, window) || (image[i] && image[j]),
                        // Not square: built above.
                        FamilyKey::EncoderWindow { .. } => false,
                    };
                }
            }
        }
        MaskSpec { rows, queries: n, cols: n, visible }
    }
}

/// A memo key of [`Masks`]: a cache geometry or a family mask.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum AnyKey {
    Geometry(MaskKey),
    Family(FamilyKey),
}

impl AnyKey {
    fn family(&self) -> String {
        match self {
            AnyKey::Geometry(k) => {
                let w = k.window.map_or("inf".to_string(), |w| w.to_string());
                match k.kind {
                    MaskKind::Decode => format!("decode:{w}"),
                    MaskKind::Window => format!("window:{w}"),
                }
            }
            AnyKey::Family(k) => k.family(),
        }
    }

    fn build(&self) -> MaskSpec {
        match self {
            AnyKey::Geometry(k) => MaskSpec::build(k),
            AnyKey::Family(k) => k.build(),
        }
    }
}

/// The masks of one forward (R-C-3): a memo from [`MaskKey`] (cache geometries) and [`FamilyKey`] (training,
/// prefix-shared, bidirectional and encoder-window masks) to the matrix and its MLX array. Each distinct key is built once;
/// [`Masks::builds`] and [`Masks::builds_of`] count the builds, so tests prove the sharing.
#[derive(Default)]
pub struct Masks {
    memo: RefCell<HashMap<AnyKey, (Rc<MaskSpec>, Array)>>,
    builds: Cell<usize>,
    by_family: RefCell<HashMap<String, usize>>,
}

impl std::fmt::Debug for Masks {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Masks")
            .field("distinct", &self.memo.borrow().len())
            .field("builds", &self.builds.get())
            .finish()
    }
}

impl Masks {
    /// Empty: nothing built yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// How many masks were built (each distinct geometry once).
    pub fn builds(&self) -> usize {
        self.builds.get()
    }

    /// How many masks of one family were built (`decode:<w>`, `window:<w>`, or a [`FamilyKey::family`]).
    pub fn builds_of(&self, family: &str) -> usize {
        self.by_family.borrow().get(family).copied().unwrap_or(0)
    }

    /// Builds per family, sorted by family name.
    pub fn families(&self) -> Vec<(String, usize)> {
        let mut v: Vec<(String, usize)> = self.by_family.borrow().iter().map(|(k, &n)| (k.clone(), n)).collect();
        v.sort();
        v
    }

    /// The mask of this geometry, building it on first request.
    pub fn get(&self, key: &MaskKey) -> Result<(Rc<MaskSpec>, Array)> {
        self.get_any(AnyKey::Geometry(key.clone()))
    }

    /// The mask of this family key, building it on first request.
    pub fn get_family(&self, key: &FamilyKey) -> Result<(Rc<MaskSpec>, Array)> {
        self.get_any(AnyKey::Family(key.clone()))
    }

    fn get_any(&self, key: AnyKey) -> Result<(Rc<MaskSpec>, Array)> {
        if let Some((spec, arr)) = self.memo.borrow().get(&key) {
            return Ok((spec.clone(), arr.clone()));
        }
        let spec = Rc::new(key.build());
        let arr = spec.to_array()?;
        self.builds.set(self.builds.get() + 1);
        *self.by_family.borrow_mut().entry(key.family()).or_insert(0) += 1;
        self.memo.borrow_mut().insert(key, (spec.clone(), arr.clone()));
        Ok((spec, arr))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(kind: MaskKind, lens: &[usize], real: &[usize], queries: usize, window: Option<usize>) -> MaskKey {
        let cols = lens.iter().copied().max().unwrap_or(0).max(1);
        MaskKey { kind, lens: lens.to_vec(), real: real.to_vec(), queries, window, cols }
    }

    #[test]
    fn window_visibility_is_causal_and_sliding() {
        // One row, W = 4, after a 3-position window on top of 3 kept columns: len 6.
        let m = MaskSpec::build(&key(MaskKind::Window, &[6], &[3], 3, Some(4)));
        assert_eq!(m.visible_columns(0, 0), vec![0, 1, 2, 3]);
        assert_eq!(m.visible_columns(0, 1), vec![1, 2, 3, 4]);
        assert_eq!(m.visible_columns(0, 2), vec![2, 3, 4, 5]);
        // Linear: everything up to the query.
        let m = MaskSpec::build(&key(MaskKind::Window, &[5], &[2], 2, None));
        assert_eq!(m.visible_columns(0, 0), vec![0, 1, 2, 3]);
        assert_eq!(m.visible_columns(0, 1), vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn padded_queries_see_column_zero_only_and_decode_masks_by_len() {
        let m = MaskSpec::build(&key(MaskKind::Window, &[2, 5], &[1, 3], 3, Some(8)));
        assert_eq!(m.visible_columns(0, 0), vec![0, 1]);
        assert_eq!(m.visible_columns(0, 1), vec![0]);
        assert_eq!(m.visible_columns(0, 2), vec![0]);
        assert_eq!(m.visible_columns(1, 2), vec![0, 1, 2, 3, 4]);
        let d = MaskSpec::build(&key(MaskKind::Decode, &[2, 4], &[1, 1], 1, Some(4)));
        assert_eq!(d.visible_columns(0, 0), vec![0, 1]);
        assert_eq!(d.visible_columns(1, 0), vec![0, 1, 2, 3]);
    }

    #[test]
    fn training_mask_is_mlx_lm_causal_with_right_padding() {
        // N = 4, lengths [4, 2], window 3: row 1 keys 2, 3 are padding; the window drops key 0 for query 3.
        let k = FamilyKey::Training { lengths: Some(vec![4, 2]), queries: 4, window: Some(3) };
        let m = k.build();
        assert_eq!((m.rows, m.queries, m.cols), (2, 4, 4));
        assert_eq!(m.visible_columns(0, 3), vec![1, 2, 3]);
        assert_eq!(m.visible_columns(1, 1), vec![0, 1]);
        assert_eq!(m.visible_columns(1, 3), vec![1], "a padded query follows the same formula");
        let unpadded = FamilyKey::Training { lengths: None, queries: 3, window: None }.build();
        assert_eq!(unpadded.rows, 1);
        assert_eq!(unpadded.visible_columns(0, 2), vec![0, 1, 2]);
        assert_eq!(k.family(), "training:3");
    }

    #[test]
    fn prefix_shared_and_bidirectional_rules() {
        // P 2, Rc 2, Rr 2: rejected queries 4, 5 skip the chosen keys 2, 3.
        let m = FamilyKey::PrefixShared { prompt: 2, chosen: 2, rejected: 2, window: None }.build();
        assert_eq!(m.visible_columns(0, 3), vec![0, 1, 2, 3]);
        assert_eq!(m.visible_columns(0, 5), vec![0, 1, 4, 5]);
        // Window 2 on logical positions: query 4 (logpos 2) sees key 1 (logpos 1) and itself.
        let w = FamilyKey::PrefixShared { prompt: 2, chosen: 2, rejected: 2, window: Some(2) }.build();
        assert_eq!(w.visible_columns(0, 4), vec![1, 4]);
        assert_eq!(w.visible_columns(0, 3), vec![2, 3]);
        // Image tokens 1 and 3 see each other both ways, past the window of 1.
        let b = FamilyKey::Bidirectional { image: vec![false, true, false, true], window: Some(1) }.build();
        assert_eq!(b.visible_columns(0, 1), vec![1, 3]);
        assert_eq!(b.visible_columns(0, 2), vec![2]);
        assert_eq!(b.visible_columns(0, 3), vec![1, 3]);
    }

    #[test]
    fn encoder_window_is_causal_under_its_own_window_per_row() {
        // Row 0: 3 history columns + a 4-position block; row 1: no history; window 3.
        let k = FamilyKey::EncoderWindow { keys: vec![7, 4], queries: 4, window: Some(3) };
        let m = k.build();
        assert_eq!((m.rows, m.queries, m.cols), (2, 4, 7));
        assert_eq!(m.visible_columns(0, 0), vec![1, 2, 3], "the first block query reaches back into the history");
        assert_eq!(m.visible_columns(0, 3), vec![4, 5, 6]);
        assert_eq!(m.visible_columns(1, 0), vec![0]);
        assert_eq!(m.visible_columns(1, 3), vec![1, 2, 3], "columns past the row's keys are never visible");
        // Unbounded: every history column and every earlier block column.
        let u = FamilyKey::EncoderWindow { keys: vec![5], queries: 2, window: None }.build();
        assert_eq!(u.visible_columns(0, 0), vec![0, 1, 2, 3]);
        assert_eq!(u.visible_columns(0, 1), vec![0, 1, 2, 3, 4]);
        assert_eq!(k.family(), "encoder-window:3");
        assert_eq!(FamilyKey::EncoderWindow { keys: vec![1], queries: 1, window: None }.family(), "encoder-window:inf");
    }

    #[test]
    fn masks_build_each_geometry_once() {
        let _g = crate::testutil::testlock::shared();
        let masks = Masks::new();
        let k1 = key(MaskKind::Decode, &[2, 4], &[1, 1], 1, Some(4));
        let k2 = key(MaskKind::Window, &[4, 4], &[1, 2], 2, Some(4));
        for _layer in 0..5 {
            let (a, _) = masks.get(&k1).unwrap();
            let (b, _) = masks.get(&k2).unwrap();
            assert!(Rc::ptr_eq(&a, &masks.get(&k1).unwrap().0), "the same build is handed out");
            assert_ne!(a, b);
        }
        assert_eq!(masks.builds(), 2);
        assert_eq!(masks.builds_of("decode:4"), 1);
        assert_eq!(masks.builds_of("window:4"), 1);
        let (_, arr) = masks.get(&k1).unwrap();
        assert_eq!(arr.shape(), &[2, 1, 1, 4]);
        assert_eq!(arr.dtype(), mlx_rs::Dtype::Bool);
    }
}
