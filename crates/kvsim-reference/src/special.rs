//! The model of the training masks and the special reads (R-TRN-3, R-ROT-9), in plain integers.
//!
//! Each function answers "which keys does query `i` see" by its own formulation (ranges and sets built from the
//! rule's words), independently of the production mask builders, so that a test comparing the two compares two
//! readings of the rule:
//!
//! - [`training_visible`]: the offset-0 training read, optionally right-padded (the upstream LM package 0.32.2,
//!   `create_causal_mask(N, 0, window, right_padding)` in `models/base.py`).
//! - [`prefix_shared_visible`], [`prefix_shared_positions`]: chosen/rejected pairs sharing a prompt.
//! - [`bidirectional_visible`]: Gemma 4's vision prefill (image tokens see each other regardless of order and window).
//! - [`encoder_visible`]: the stored positions a DiffusionGemma vision-encoder query sees after its block's append
//!   (R-ROT-9b).
//! - [`read_block_context`]: the stored positions a DiffusionGemma canvas block attends (R-ROT-9c).

use crate::model::RowModel;
use crate::values::Tok;

/// Keys `[lo, i]` of a causal query `i` under an optional window (`i - j < w`).
fn causal_range(i: usize, window: Option<usize>) -> std::ops::RangeInclusive<usize> {
    let lo = window.map_or(0, |w| (i + 1).saturating_sub(w));
    lo..=i
}

/// The keys query `i` of an `n`-position training forward sees: causal, within the window, and (for a right-padded
/// row of `length` real positions) only real keys. Padded queries (`i >= length`) follow the same rule (their
/// outputs are unspecified). Empty when `i >= n`.
pub fn training_visible(n: usize, length: Option<usize>, window: Option<usize>, i: usize) -> Vec<usize> {
    if i >= n {
        return Vec::new();
    }
    let real = length.unwrap_or(n).min(n);
    causal_range(i, window).filter(|&j| j < real).collect()
}

/// The logical (RoPE) position of every column of `prompt ++ chosen ++ rejected`: the rejected answer continues the
/// prompt's positions, as if the chosen answer were not there.
pub fn prefix_shared_positions(prompt: usize, chosen: usize, rejected: usize) -> Vec<usize> {
    let mut out: Vec<usize> = (0..prompt + chosen).collect();
    out.extend(prompt..prompt + rejected);
    out
}

/// The keys query `i` of a prefix-shared forward sees: the sequence it belongs to (prompt ++ chosen, or prompt ++
/// rejected), causally, within the window measured in logical positions. Empty when `i` is out of range.
pub fn prefix_shared_visible(
    prompt: usize,
    chosen: usize,
    rejected: usize,
    window: Option<usize>,
    i: usize,
) -> Vec<usize> {
    let n = prompt + chosen + rejected;
    if i >= n {
        return Vec::new();
    }
    let logical = prefix_shared_positions(prompt, chosen, rejected);
    // The columns of the query's own sequence, in order.
    let own: Vec<usize> = if i < prompt + chosen {
        (0..prompt + chosen).collect()
    } else {
        (0..prompt).chain(prompt + chosen..n).collect()
    };
    own.into_iter().filter(|&j| j <= i && window.is_none_or(|w| logical[i] - logical[j] < w)).collect()
}

/// The keys query `i` of a bidirectional prefill at offset 0 sees: its causal window, and every image token if it
/// is one. Empty when `i` is out of range.
pub fn bidirectional_visible(image: &[bool], window: Option<usize>, i: usize) -> Vec<usize> {
    if i >= image.len() {
        return Vec::new();
    }
    let mut out: Vec<usize> = causal_range(i, window).collect();
    if image[i] {
        out.extend((0..image.len()).filter(|&j| image[j] && j > i));
        out.extend((0..i).filter(|&j| image[j] && !causal_range(i, window).contains(&j)));
    }
    out.sort_unstable();
    out
}

/// The columns of `after` (the row right after an encoder read's append of an `l`-position block: its kept history
/// and the whole block, [`RowModel::window_write`]) that block query `i` sees (R-ROT-9b): the query stands at the
/// block's position `offset - l + i` and sees every stored token no later than itself whose distance back is below
/// the encoder's own `window` (`None`: unbounded). The row's `max_size` plays no part here: it decided only which
/// history the append kept. In physical order; empty when `i >= l` or `l > offset`.
pub fn encoder_visible(after: &RowModel, l: usize, window: Option<usize>, i: usize) -> Vec<usize> {
    if i >= l || l > after.offset {
        return Vec::new();
    }
    let me = after.offset - l + i;
    let earliest = window.map_or(0, |w| (me + 1).saturating_sub(w));
    after.cols.iter().enumerate().filter(|(_, t)| (earliest..=me).contains(&(t.pos as usize))).map(|(c, _)| c).collect()
}

/// The stored tokens a canvas block attends before itself (R-ROT-9c), oldest first: the live window in temporal
/// order ([`RowModel::temporal_view`]), cut to the newest `W - 1` positions on a ring (the block's own positions
/// complete the window); every stored position for a linear cache. Every block query sees all of these and the
/// whole block; nothing is stored and the offset does not move.
pub fn read_block_context(row: &RowModel) -> Vec<Tok> {
    let view = row.temporal_view();
    let keep = row.max_size.map_or(view.len(), |w| view.len().min(w.saturating_sub(1)));
    view[view.len() - keep..].to_vec()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn training_rules() {
        assert_eq!(training_visible(5, None, None, 3), vec![0, 1, 2, 3]);
        assert_eq!(training_visible(5, None, Some(2), 3), vec![2, 3]);
        assert_eq!(training_visible(5, Some(2), None, 4), vec![0, 1]);
        assert_eq!(training_visible(5, Some(2), Some(2), 4), Vec::<usize>::new(), "a padded query may see nothing");
        assert!(training_visible(5, None, None, 5).is_empty());
    }

    #[test]
    fn prefix_shared_rules() {
        assert_eq!(prefix_shared_positions(2, 3, 2), vec![0, 1, 2, 3, 4, 2, 3]);
        assert_eq!(prefix_shared_visible(2, 3, 2, None, 6), vec![0, 1, 5, 6]);
        assert_eq!(prefix_shared_visible(2, 3, 2, None, 4), vec![0, 1, 2, 3, 4]);
        assert_eq!(prefix_shared_visible(2, 3, 2, Some(2), 5), vec![1, 5]);
    }

    #[test]
    fn bidirectional_rules() {
        let img = [true, false, true, true, false];
        assert_eq!(bidirectional_visible(&img, None, 0), vec![0, 2, 3]);
        assert_eq!(bidirectional_visible(&img, None, 1), vec![0, 1]);
        assert_eq!(bidirectional_visible(&img, Some(1), 3), vec![0, 2, 3]);
        assert_eq!(bidirectional_visible(&img, Some(2), 4), vec![3, 4]);
    }

    #[test]
    fn encoder_visible_is_the_encoder_window_over_the_kept_history_and_the_block() {
        let toks = |a: u32, b: u32| (a..b).map(|p| Tok::new(1, p)).collect::<Vec<_>>();
        // A ring of W = 4 holding positions 5..=8, then a 6-position block: the append keeps 6, 7, 8 and the block.
        let mut ring = RowModel::from_temporal(Some(4), toks(5, 9), 9);
        ring.window_write(&toks(9, 15));
        assert_eq!(ring.cols, toks(6, 15));
        let pos = |cs: Vec<usize>| cs.into_iter().map(|c| ring.cols[c].pos).collect::<Vec<_>>();
        assert_eq!(pos(encoder_visible(&ring, 6, Some(2), 0)), vec![8, 9]);
        assert_eq!(pos(encoder_visible(&ring, 6, None, 0)), vec![6, 7, 8, 9]);
        // The last block query sees 9 positions, more than W: the cache's window does not limit the mask.
        assert_eq!(pos(encoder_visible(&ring, 6, None, 5)), (6..15).collect::<Vec<_>>());
        assert_eq!(pos(encoder_visible(&ring, 6, Some(5), 5)), (10..15).collect::<Vec<_>>());
        assert!(encoder_visible(&ring, 6, None, 6).is_empty());
        // A linear cache keeps every stored position.
        let mut lin = RowModel::from_temporal(None, toks(0, 3), 3);
        lin.window_write(&toks(3, 5));
        assert_eq!(encoder_visible(&lin, 2, None, 1), vec![0, 1, 2, 3, 4]);
        assert_eq!(encoder_visible(&lin, 2, Some(1), 1), vec![4]);
    }

    #[test]
    fn read_block_context_is_the_newest_w_minus_one() {
        let toks = |a: u32, b: u32| (a..b).map(|p| Tok::new(1, p)).collect::<Vec<_>>();
        let ring = RowModel::from_temporal(Some(4), toks(3, 9), 9);
        assert_eq!(read_block_context(&ring), toks(6, 9));
        let short = RowModel::from_temporal(Some(4), toks(0, 2), 2);
        assert_eq!(read_block_context(&short), toks(0, 2));
        let lin = RowModel::from_temporal(None, toks(0, 7), 7);
        assert_eq!(read_block_context(&lin), toks(0, 7));
        let one = RowModel::from_temporal(Some(1), toks(0, 3), 3);
        assert!(read_block_context(&one).is_empty(), "W = 1: the block sees only itself");
    }
}
