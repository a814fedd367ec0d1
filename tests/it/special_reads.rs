//! Training masks and special reads (R-TRN-3, R-ROT-9) against the pure-Rust model: the MLX mask arrays equal the
//! model's visibility bit for bit, and every real query's output is within the f64 model's bound.

use kvsim::bytes::ArrayBytes;
use kvsim::cache::{CacheError, FamilyKey, KvDtype, KvSpec, Masks, PrefixSharedCache, SerialCache, TrainingCache};
use kvsim::reference::{
    attention_f64, bidirectional_visible, encoder_visible, prefix_shared_visible, read_block_context, training_visible,
    RowModel, Tok,
};
use kvsim::sim::check::{model_bound, ulp_at};
use mlx_rs::Array;

use crate::common::{bytes, Payload};

/// The rows of a mask array `[rows, 1, N, N]` as visible-column lists.
fn mlx_visible(arr: &Array) -> Vec<Vec<Vec<usize>>> {
    let b = ArrayBytes::of(arr).expect("mask bytes");
    assert_eq!(b.dtype, mlx_rs::Dtype::Bool);
    let (rows, n, cols) = (b.shape[0] as usize, b.shape[2] as usize, b.shape[3] as usize);
    (0..rows)
        .map(|r| (0..n).map(|i| (0..cols).filter(|&j| b.words.get((r * n + i) * cols + j) != 0).collect()).collect())
        .collect()
}

#[test]
fn family_masks_equal_the_reference_bit_for_bit() {
    let masks = Masks::new();
    let mut compared = 0;
    for n in 1..=7usize {
        for window in [None, Some(1), Some(2), Some(3), Some(5)] {
            // Training, unpadded and right-padded (every length 0..=n appears in some row).
            let lengths: Vec<usize> = (0..=n).collect();
            for l in [None, Some(lengths.clone())] {
                let (_, arr) =
                    masks.get_family(&FamilyKey::Training { lengths: l.clone(), queries: n, window }).unwrap();
                for (r, rows) in mlx_visible(&arr).iter().enumerate() {
                    for (i, vis) in rows.iter().enumerate() {
                        let want = training_visible(n, l.as_ref().map(|l| l[r]), window, i);
                        assert_eq!(vis, &want, "training n {n} W {window:?} row {r} query {i}");
                        compared += 1;
                    }
                }
            }
            // Bidirectional: every image pattern of n flags.
            for pattern in 0u32..(1 << n) {
                let image: Vec<bool> = (0..n).map(|i| pattern >> i & 1 == 1).collect();
                let (_, arr) = masks.get_family(&FamilyKey::Bidirectional { image: image.clone(), window }).unwrap();
                for (i, vis) in mlx_visible(&arr)[0].iter().enumerate() {
                    assert_eq!(vis, &bidirectional_visible(&image, window, i), "bidir {image:?} W {window:?} q {i}");
                    compared += 1;
                }
            }
            // Prefix-shared: every split of n positions.
            for p in 0..=n {
                for rc in 0..=n - p {
                    let rr = n - p - rc;
                    let key = FamilyKey::PrefixShared { prompt: p, chosen: rc, rejected: rr, window };
                    let (_, arr) = masks.get_family(&key).unwrap();
                    for (i, vis) in mlx_visible(&arr)[0].iter().enumerate() {
                        assert_eq!(vis, &prefix_shared_visible(p, rc, rr, window, i), "{key:?} q {i}");
                        compared += 1;
                    }
                }
            }
        }
    }
    // Encoder window: rows of a ring (W = 4) and of a linear cache holding 0..=6 positions before an n-position block,
    // side by side in one per-row matrix; the model reads each row after its append.
    for n in 1..=5usize {
        for window in [None, Some(1), Some(2), Some(4), Some(9)] {
            for max_size in [None, Some(4)] {
                let mut after = vec![];
                for held in 0..=6u32 {
                    let mut m =
                        RowModel::from_temporal(max_size, (0..held).map(|j| Tok::new(0, j)).collect(), held as usize);
                    m.window_write(&(held..held + n as u32).map(|j| Tok::new(0, j)).collect::<Vec<_>>());
                    after.push(m);
                }
                let keys: Vec<usize> = after.iter().map(|m| m.cols.len()).collect();
                let (_, arr) = masks.get_family(&FamilyKey::EncoderWindow { keys, queries: n, window }).unwrap();
                for (r, rows) in mlx_visible(&arr).iter().enumerate() {
                    for (i, vis) in rows.iter().enumerate() {
                        let want = encoder_visible(&after[r], n, window, i);
                        assert_eq!(vis, &want, "encoder n {n} window {window:?} W {max_size:?} row {r} q {i}");
                        compared += 1;
                    }
                }
            }
        }
    }
    assert!(compared > 5000, "{compared} query rows compared");
}

/// Max ULP distance (at output scale) of query `i` of row `row` of `out` from f64 attention over `keys`.
fn ulps(p: &Payload, out: &Array, row: usize, i: usize, q: Tok, keys: &[Tok]) -> f64 {
    let b = bytes(out);
    let (hq, l, d) = (b.shape[1] as usize, b.shape[2] as usize, b.shape[3] as usize);
    let want = attention_f64(&p.vs, 0, q, keys, p.scale() as f64);
    let mut worst = 0f64;
    for h in 0..hq {
        for x in 0..d {
            let w = b.words.get(((row * hq + h) * l + i) * d + x) as u32;
            let got = match b.dtype {
                mlx_rs::Dtype::Bfloat16 => f32::from_bits(w << 16) as f64,
                _ => f32::from_bits(w) as f64,
            };
            let e = want[h * d + x];
            assert!(got.is_finite(), "row {row} query {i}: {got}");
            worst = worst.max((got - e).abs() / ulp_at(b.dtype, e));
        }
    }
    worst
}

fn specs() -> Vec<KvSpec> {
    [KvDtype::F32, KvDtype::Bf16].into_iter().map(|dtype| KvSpec { heads_kv: 2, head_dim: 16, dtype }).collect()
}

fn bound(spec: &KvSpec) -> f64 {
    model_bound(spec.dtype.to_mlx(), false)
}

#[test]
fn training_reads_match_the_model() {
    for spec in specs() {
        let p = Payload::new(spec, 4, 17);
        for window in [None, Some(3)] {
            let lengths = vec![7, 3, 5];
            let n = 7;
            let toks: Vec<Vec<Option<Tok>>> = lengths
                .iter()
                .enumerate()
                .map(|(r, &len)| (0..n).map(|j| (j < len).then_some(Tok::new(r as u32, j as u32))).collect())
                .collect();
            let (k, v, q) = p.kvq(&toks);
            let c = TrainingCache::padded(spec, window, lengths.clone()).unwrap();
            let (out, _) = c.window(&k, &v, &q, p.scale(), &Masks::new()).unwrap();
            for (r, &len) in lengths.iter().enumerate() {
                for i in 0..len {
                    let keys: Vec<Tok> = training_visible(n, Some(len), window, i)
                        .into_iter()
                        .map(|j| Tok::new(r as u32, j as u32))
                        .collect();
                    let u = ulps(&p, &out, r, i, Tok::new(r as u32, i as u32), &keys);
                    assert!(u <= bound(&spec), "{spec:?} W {window:?} row {r} q {i}: {u} ULPs");
                }
            }
        }
        // Prefix-shared: the prompt is request 0, the chosen answer request 1, the rejected one request 2.
        let (pr, rc, rr) = (3, 2, 3);
        let seg = |j: usize| {
            if j < pr {
                0
            } else if j < pr + rc {
                1
            } else {
                2
            }
        };
        let tok = |j: usize| Tok::new(seg(j), j as u32);
        let row: Vec<Option<Tok>> = (0..pr + rc + rr).map(|j| Some(tok(j))).collect();
        let (k, v, q) = p.kvq(&[row]);
        for window in [None, Some(2)] {
            let c = PrefixSharedCache::new(spec, window, pr, rc, rr).unwrap();
            let (out, _) = c.window(&k, &v, &q, p.scale(), &Masks::new()).unwrap();
            for i in 0..pr + rc + rr {
                let keys: Vec<Tok> = prefix_shared_visible(pr, rc, rr, window, i).into_iter().map(tok).collect();
                let u = ulps(&p, &out, 0, i, tok(i), &keys);
                assert!(u <= bound(&spec), "prefix-shared {spec:?} W {window:?} q {i}: {u} ULPs");
            }
        }
    }
}

#[test]
fn bidirectional_prefill_matches_the_model_and_refuses_offset_past_zero() {
    for spec in specs() {
        let p = Payload::new(spec, 4, 23);
        for max_size in [None, Some(3), Some(8)] {
            let image = [false, true, true, false, true, false];
            let toks: Vec<Tok> = (0..image.len() as u32).map(|j| Tok::new(0, j)).collect();
            let (k, v, q) = p.kvq1(&toks);
            let mut c = SerialCache::new(spec, max_size).unwrap();
            let masks = Masks::new();
            let (out, _) = c.bidir_prefill(&k, &v, &q, &image, p.scale(), &masks).unwrap();
            for i in 0..image.len() {
                let keys: Vec<Tok> = bidirectional_visible(&image, max_size, i).into_iter().map(|j| toks[j]).collect();
                let u = ulps(&p, &out, 0, i, toks[i], &keys);
                assert!(u <= bound(&spec), "{spec:?} W {max_size:?} q {i}: {u} ULPs");
            }
            // The ordinary append: the whole block is stored, even past W.
            let mut plain = SerialCache::new(spec, max_size).unwrap();
            plain.append(&k, &v).unwrap();
            assert_eq!(c.state(), plain.state());
            p.assert_columns("bidir keys", kvsim::reference::Tensor::K, &c.physical().unwrap().0, &toks);
            // Defined only at offset 0: a typed error, nothing changed, nothing built.
            let before = c.state().clone();
            let builds = masks.builds();
            let err = c.bidir_prefill(&k, &v, &q, &image, p.scale(), &masks).unwrap_err();
            assert_eq!(err, CacheError::NotAtOffsetZero { read: "bidir_prefill", offset: 6 });
            assert_eq!(c.state(), &before);
            assert_eq!(masks.builds(), builds);
            let mut fresh = SerialCache::new(spec, max_size).unwrap();
            let bad = fresh.bidir_prefill(&k, &v, &q, &image[..2], p.scale(), &masks);
            assert!(matches!(bad, Err(CacheError::BadLengths { .. })));
            assert_eq!(fresh.offset(), 0);
        }
    }
}

/// DiffusionGemma's canvas read: context from the model's `read_block_context`, the block after it; nothing moves.
#[test]
fn read_block_matches_the_model_and_moves_nothing() {
    for spec in specs() {
        let p = Payload::new(spec, 4, 29);
        for max_size in [None, Some(1), Some(4), Some(32)] {
            // Prompts of 7, 31, 32, 50 positions (as the upstream test), each then a few decodes, then blocks.
            for prompt in [7u32, 31, 32, 50] {
                let mut c = SerialCache::new(spec, max_size).unwrap();
                let mut m = RowModel::new(max_size);
                let toks: Vec<Tok> = (0..prompt).map(|j| Tok::new(0, j)).collect();
                let (k, v, _) = p.kvq1(&toks);
                c.append(&k, &v).unwrap();
                m.window_write(&toks);
                for j in prompt..prompt + 3 {
                    let (k, v, q) = p.kvq1(&[Tok::new(0, j)]);
                    c.decode(&k, &v, &q, p.scale(), &Masks::new()).unwrap();
                    m.decode_write(Tok::new(0, j));
                }
                let offset = c.offset() as u32;
                for l in [1u32, 3, 8] {
                    let block: Vec<Tok> = (0..l).map(|i| Tok::new(1, offset + i)).collect();
                    let (k, v, q) = p.kvq1(&block);
                    let before = c.state().clone();
                    let (out, _) = c.read_block(&k, &v, &q, p.scale()).unwrap();
                    assert_eq!(c.state(), &before, "offsets never move");
                    let mut keys = read_block_context(&m);
                    keys.extend(&block);
                    for i in 0..l as usize {
                        let u = ulps(&p, &out, 0, i, block[i], &keys);
                        assert!(u <= bound(&spec), "{spec:?} W {max_size:?} prompt {prompt} L {l} q {i}: {u} ULPs");
                    }
                }
            }
        }
    }
}

/// DiffusionGemma's vision-encoder read: every block position stored after the kept history (even past W), every
/// query within the f64 model's bound over the model's `encoder_visible` keys, the state that of a window write.
#[test]
fn encoder_read_matches_the_model_past_max_size() {
    for spec in specs() {
        let p = Payload::new(spec, 4, 31);
        for max_size in [None, Some(1), Some(4), Some(8)] {
            for window in [None, Some(2), Some(6), Some(20)] {
                let mut c = SerialCache::new(spec, max_size).unwrap();
                let mut m = RowModel::new(max_size);
                let toks: Vec<Tok> = (0..5).map(|j| Tok::new(0, j)).collect();
                let (k, v, _) = p.kvq1(&toks);
                c.append(&k, &v).unwrap();
                m.window_write(&toks);
                for j in 5..11 {
                    let (k, v, q) = p.kvq1(&[Tok::new(0, j)]);
                    c.decode(&k, &v, &q, p.scale(), &Masks::new()).unwrap();
                    m.decode_write(Tok::new(0, j));
                }
                let block: Vec<Tok> = (11..23).map(|j| Tok::new(0, j)).collect();
                let (k, v, q) = p.kvq1(&block);
                let masks = Masks::new();
                let (out, _) = c.encoder_read(&k, &v, &q, p.scale(), window, &masks).unwrap();
                m.window_write(&block);
                assert_eq!(c.state().len, m.cols.len(), "{max_size:?}: the kept history and the whole block");
                assert_eq!((c.state().offset, c.state().last_concat), (23, Some(block.len())));
                p.assert_columns("encoder keys", kvsim::reference::Tensor::K, &c.physical().unwrap().0, &m.cols);
                for i in 0..block.len() {
                    let keys: Vec<Tok> =
                        encoder_visible(&m, block.len(), window, i).into_iter().map(|c| m.cols[c]).collect();
                    let u = ulps(&p, &out, 0, i, block[i], &keys);
                    assert!(u <= bound(&spec), "{spec:?} W {max_size:?} window {window:?} q {i}: {u} ULPs");
                }
                assert_eq!(masks.builds(), 1);
            }
        }
    }
}
