use super::*;
use crate::testutil::{assert_same_bytes, kvq, row, spec};
use crate::{KvCache, KvDtype, Masks, SerialCache};

const SCALE: f32 = 0.35;

fn pool(block_size: usize, max_blocks: usize) -> PoolSpec {
    PoolSpec { block_size, initial_blocks: 2, max_blocks, grow_by: 3, index_budget: 64 }
}

/// Token ids of positions `[from, to)` of a prompt family (requests of one family share their tokens).
fn toks(family: u32, from: usize, to: usize) -> Vec<u32> {
    (from..to).map(|p| family * 1000 + p as u32).collect()
}

/// K, V, Q of positions `[from, to)` of a prompt family: the same tokens give the same K/V (a model's K/V of a
/// position is a function of its prefix).
fn kv_of(spec: &KvSpec, family: u32, from: usize, to: usize) -> (Array, Array, Array) {
    let parts: Vec<(Array, Array, Array)> =
        (from..to).map(|p| kvq(spec, u64::from(family) * 1_000_003 + p as u64, 1, 1)).collect();
    join_along(&parts, 2)
}

/// K, V and Q of several pieces joined along `axis` (2: one sequence's positions, 0: the rows of a batch).
fn join_along(parts: &[(Array, Array, Array)], axis: i32) -> (Array, Array, Array) {
    let cat = |i: usize| {
        let xs: Vec<&Array> = parts.iter().map(|t| [&t.0, &t.1, &t.2][i]).collect();
        mlx_rs::ops::concatenate(&xs, axis).unwrap()
    };
    (cat(0), cat(1), cat(2))
}

/// Both sides: a paged sequence and a plain linear cache fed the same positions.
fn window_both(
    st: &mut PagedStore,
    s: SeqId,
    plain: &mut SerialCache,
    family: u32,
    from: usize,
    to: usize,
) -> (Array, Array) {
    let (k, v, q) = kv_of(&st.spec(), family, from, to);
    let a = st.window(s, &toks(family, from, to), &k, &v, &q, SCALE).unwrap();
    let (b, _) = plain.window(&k, &v, &q, SCALE, &Masks::new()).unwrap();
    (a, b)
}

fn assert_same_contents(st: &PagedStore, s: SeqId, plain: &SerialCache, what: &str) {
    let (k, v) = st.fetch(s).unwrap();
    let (pk, pv) = plain.temporal_view().unwrap();
    assert_same_bytes(&k, &pk, &format!("{what}: K"));
    assert_same_bytes(&v, &pv, &format!("{what}: V"));
}

#[test]
fn a_paged_sequence_reads_like_a_plain_cache_at_every_block_size() {
    for dtype in [KvDtype::F32, KvDtype::Bf16] {
        let spec = spec(dtype);
        for bs in [1usize, 3, 4, 7, 16] {
            let mut st = PagedStore::new(spec, pool(bs, 64)).unwrap();
            let s = st.open();
            let mut plain = KvCache::new(spec).unwrap();
            let mut at = 0;
            for (step, len) in [5usize, 1, 3, 1, 1, 8, 2].into_iter().enumerate() {
                let (a, b) = if len == 1 && step % 2 == 1 {
                    let (k, v, q) = kv_of(&spec, 1, at, at + 1);
                    let a = st.decode(s, toks(1, at, at + 1)[0], &k, &v, &q, SCALE).unwrap();
                    let (b, _) = plain.decode(&k, &v, &q, SCALE, &Masks::new()).unwrap();
                    (a, b)
                } else {
                    window_both(&mut st, s, &mut plain, 1, at, at + len)
                };
                at += len;
                assert_same_bytes(&a, &b, &format!("{dtype:?} block {bs} step {step}: output"));
                assert_same_contents(&st, s, &plain, &format!("{dtype:?} block {bs} step {step}"));
                st.audit().unwrap();
            }
            // A rollback and a trim back into an earlier block free the blocks past the end.
            st.trim(s, 2, true).unwrap();
            plain.trim(2, true).unwrap();
            st.trim(s, 9, false).unwrap();
            plain.trim(9, false).unwrap();
            assert_same_contents(&st, s, &plain, "after trims");
            assert_eq!(st.seq(s).unwrap().table.len(), st.seq(s).unwrap().offset.div_ceil(bs));
            st.audit().unwrap();
            assert_eq!(st.bytes_for_tokens(5), 5usize.div_ceil(bs) * bs * spec.bytes_per_token());
        }
    }
}

#[test]
fn a_warm_request_reads_the_bytes_of_the_same_request_run_cold() {
    let spec = spec(KvDtype::F32);
    for bs in [1usize, 4, 5] {
        let mut st = PagedStore::new(spec, pool(bs, 64)).unwrap();
        // Request A: 13 prompt positions of family 7, then finished into the index.
        let a = st.open();
        let mut plain_a = KvCache::new(spec).unwrap();
        window_both(&mut st, a, &mut plain_a, 7, 0, 13);
        let inserted = st.finish(a).unwrap();
        assert_eq!(inserted, 13 / bs);
        st.audit().unwrap();
        // Request B has the same 13-token prompt: the full blocks of its first 12 positions come from the index.
        let prompt = toks(7, 0, 13);
        let (b, hit) = st.open_with_prefix(&prompt, prompt.len() - 1);
        assert_eq!(hit.positions, (12 / bs) * bs);
        assert!(hit.blocks > 0);
        let shared: Vec<u32> = st.seq(b).unwrap().table.clone();
        assert!(shared.iter().all(|&blk| st.refs()[blk as usize] == 2), "shared with the index");
        let mut cold = KvCache::new(spec).unwrap();
        let (k, v, q) = kv_of(&spec, 7, 0, hit.positions);
        if hit.positions > 0 {
            cold.window(&k, &v, &q, SCALE, &Masks::new()).unwrap();
        }
        let (warm_out, cold_out) = window_both(&mut st, b, &mut cold, 7, hit.positions, 16);
        let rows = 16 - hit.positions;
        assert_eq!(warm_out.shape()[2] as usize, rows);
        assert_same_bytes(&warm_out, &cold_out, &format!("block {bs}: warm and cold outputs"));
        assert_same_contents(&st, b, &cold, &format!("block {bs}: warm contents"));
        st.audit().unwrap();
        // A request whose prompt differs inside the first block shares nothing.
        let other = toks(8, 0, 13);
        assert_eq!(st.lookup(&other, 12).positions, 0);
    }
}

#[test]
fn appending_into_a_shared_partial_block_copies_it_first() {
    let spec = spec(KvDtype::F32);
    let mut st = PagedStore::new(spec, pool(4, 64)).unwrap();
    let parent = st.open();
    let mut plain = KvCache::new(spec).unwrap();
    window_both(&mut st, parent, &mut plain, 3, 0, 6);
    let child = st.fork(parent).unwrap();
    let last = *st.seq(parent).unwrap().table.last().unwrap();
    assert_eq!(st.refs()[last as usize], 2);
    // The child diverges: family 4's tokens from position 6 on.
    let mut child_plain = plain.clone();
    window_both(&mut st, child, &mut child_plain, 4, 6, 9);
    assert_ne!(*st.seq(child).unwrap().table.last().unwrap(), last, "copied on write");
    assert_eq!(st.seq(child).unwrap().table[0], st.seq(parent).unwrap().table[0], "the full block stays shared");
    assert_same_contents(&st, parent, &plain, "parent after the child's write");
    assert_same_contents(&st, child, &child_plain, "child");
    st.audit().unwrap();
    // The parent appends too: its block is its own again (count 1), no copy.
    window_both(&mut st, parent, &mut plain, 3, 6, 7);
    assert_eq!(*st.seq(parent).unwrap().table.last().unwrap(), last);
    assert_same_contents(&st, parent, &plain, "parent");
    st.release(child).unwrap();
    st.release(parent).unwrap();
    assert_eq!(st.free_list().len(), st.capacity(), "every block back in the pool");
    st.audit().unwrap();
}

#[test]
fn an_exhausted_pool_is_a_typed_error_with_nothing_changed() {
    let spec = spec(KvDtype::F32);
    let mut st = PagedStore::new(spec, pool(2, 3)).unwrap();
    let s = st.open();
    let mut plain = KvCache::new(spec).unwrap();
    window_both(&mut st, s, &mut plain, 1, 0, 5);
    let before = (st.refs().to_vec(), st.free_list().to_vec(), st.seq(s).unwrap().clone());
    let (k, v, q) = kv_of(&spec, 1, 5, 8);
    let err = st.window(s, &toks(1, 5, 8), &k, &v, &q, SCALE).unwrap_err();
    assert!(matches!(err, CacheError::PoolExhausted { needed: 1, available: 0 }), "{err:?}");
    assert_eq!((st.refs().to_vec(), st.free_list().to_vec(), st.seq(s).unwrap().clone()), before);
    assert_same_contents(&st, s, &plain, "after the refusal");
    // One more position fits the last block's free slot.
    window_both(&mut st, s, &mut plain, 1, 5, 6);
    assert_same_contents(&st, s, &plain, "after the fitting write");
    // Wrong token counts and unknown sequences are typed too.
    let (k, v, _) = kv_of(&spec, 1, 6, 7);
    assert!(matches!(st.append(s, &[], &k, &v), Err(CacheError::BadLengths { .. })));
    assert!(matches!(st.append(SeqId(99), &[1], &k, &v), Err(CacheError::NoSuchSeq { seq: 99 })));
    st.audit().unwrap();
    // A pool smaller than one row's need: refused before any pool memory exists.
    let mut small = PagedStore::new(spec, pool(2, 2)).unwrap();
    let s = small.open();
    let (k, v, q) = kv_of(&spec, 1, 0, 5);
    let err = small.window(s, &toks(1, 0, 5), &k, &v, &q, SCALE).unwrap_err();
    assert!(matches!(err, CacheError::PoolExhausted { needed: 3, available: 2 }), "{err:?}");
    assert_eq!(small.capacity(), 0);
    assert!(small.pool_planes().is_none());
    assert_eq!(small.seq(s).unwrap().offset, 0);
}

#[test]
fn eviction_takes_unreferenced_leaves_first_and_never_a_referenced_block() {
    let spec = spec(KvDtype::F32);
    let mut st = PagedStore::new(spec, PoolSpec { index_budget: 100, ..pool(2, 8) }).unwrap();
    for family in [1u32, 2] {
        let s = st.open();
        let mut plain = KvCache::new(spec).unwrap();
        window_both(&mut st, s, &mut plain, family, 0, 6);
        st.finish(s).unwrap();
    }
    assert_eq!(st.index_entries().len(), 6);
    // Family 1's prefix is in use again: its blocks are referenced by a table and cannot go.
    let (user, hit) = st.open_with_prefix(&toks(1, 0, 6), 5);
    assert_eq!(hit.positions, 4);
    assert_eq!(st.evict(10), 4, "family 2's three blocks and family 1's unreferenced leaf");
    let left: Vec<u32> = st.index_entries().iter().map(|e| e.block).collect();
    assert_eq!(left, st.seq(user).unwrap().table);
    st.audit().unwrap();
    // Under pressure a write evicts the index's unreferenced blocks before it refuses.
    st.release(user).unwrap();
    let s = st.open();
    let mut plain = KvCache::new(spec).unwrap();
    window_both(&mut st, s, &mut plain, 3, 0, 16);
    assert!(st.index_entries().is_empty());
    assert_same_contents(&st, s, &plain, "after evictions under pressure");
    st.audit().unwrap();
}

#[test]
fn placement_never_matters() {
    let spec = spec(KvDtype::Bf16);
    let run = |order: Option<u64>| {
        let mut st = PagedStore::new(spec, pool(3, 40)).unwrap();
        if let Some(seed) = order {
            st = st.with_free_order(seed);
        }
        let mut outs = vec![];
        let a = st.open();
        let mut pa = KvCache::new(spec).unwrap();
        outs.push(window_both(&mut st, a, &mut pa, 5, 0, 7).0);
        let b = st.fork(a).unwrap();
        let mut pb = pa.clone();
        outs.push(window_both(&mut st, b, &mut pb, 6, 7, 11).0);
        st.finish(a).unwrap();
        let (c, hit) = st.open_with_prefix(&toks(5, 0, 7), 6);
        outs.push(window_both(&mut st, c, &mut KvCache::new(spec).unwrap(), 5, hit.positions, 9).0);
        st.join(&[b, c]).unwrap();
        let (k, v, q) = kvq(&spec, 77, 2, 1);
        outs.push(st.rows_decode(&[1, 2], &k, &v, &q, SCALE, &Masks::new()).unwrap().0);
        let contents: Vec<(Array, Array)> = [b, c].iter().map(|&s| st.fetch(s).unwrap()).collect();
        (outs, contents, st.seq(b).unwrap().table.clone())
    };
    let (o1, c1, t1) = run(None);
    let (o2, c2, t2) = run(Some(12345));
    assert_ne!(t1, t2, "the permuted free list placed blocks elsewhere");
    for (i, (a, b)) in o1.iter().zip(&o2).enumerate() {
        assert_same_bytes(a, b, &format!("output {i}"));
    }
    for (i, ((k1, v1), (k2, v2))) in c1.iter().zip(&c2).enumerate() {
        assert_same_bytes(k1, k2, &format!("contents {i}: K"));
        assert_same_bytes(v1, v2, &format!("contents {i}: V"));
    }
}

#[test]
fn rows_read_like_their_solo_caches() {
    let spec = spec(KvDtype::F32);
    let mut st = PagedStore::new(spec, pool(4, 64)).unwrap();
    let mut solos = vec![];
    let mut seqs = vec![];
    for (family, len) in [(1u32, 3usize), (2, 9), (3, 9)] {
        let s = st.open();
        let mut plain = KvCache::new(spec).unwrap();
        window_both(&mut st, s, &mut plain, family, 0, len);
        seqs.push((s, family, len));
        solos.push(plain);
    }
    st.join(&seqs.iter().map(|x| x.0).collect::<Vec<_>>()).unwrap();
    let masks = Masks::new();
    for step in 0..3 {
        let parts: Vec<(Array, Array, Array)> =
            seqs.iter().map(|&(_, f, len)| kv_of(&spec, f, len + step, len + step + 1)).collect();
        let (ck, cv, cq) = join_along(&parts, 0);
        let tokens: Vec<u32> = seqs.iter().map(|&(_, f, len)| toks(f, len + step, len + step + 1)[0]).collect();
        let (out, _) = st.rows_decode(&tokens, &ck, &cv, &cq, SCALE, &masks).unwrap();
        for (r, solo) in solos.iter_mut().enumerate() {
            let (k, v, q) = &parts[r];
            let (want, _) = solo.decode(k, v, q, SCALE, &Masks::new()).unwrap();
            assert_same_bytes(&row(&out, r), &want, &format!("step {step} row {r}"));
            assert_same_contents(&st, seqs[r].0, solo, &format!("step {step} row {r}"));
        }
    }
    // A window of 2 for every row, then a rollback keeping 1, 0 and 2 positions.
    let parts: Vec<(Array, Array, Array)> = seqs.iter().map(|&(_, f, len)| kv_of(&spec, f, len + 3, len + 5)).collect();
    let (ck, cv, cq) = join_along(&parts, 0);
    let tokens: Vec<Vec<u32>> = seqs.iter().map(|&(_, f, len)| toks(f, len + 3, len + 5)).collect();
    let (out, _) = st.rows_window(&tokens, &ck, &cv, &cq, SCALE, &masks).unwrap();
    for (r, solo) in solos.iter_mut().enumerate() {
        let (k, v, q) = &parts[r];
        let (want, _) = solo.window(k, v, q, SCALE, &Masks::new()).unwrap();
        assert_same_bytes(&row(&out, r), &want, &format!("window row {r}"));
    }
    assert!(matches!(st.rows_trim(&[1, 2, 3], true), Err(CacheError::TrimTooLong { requested: 3, available: 2 })));
    st.rows_trim(&[1, 2, 0], true).unwrap();
    for (r, (solo, n)) in solos.iter_mut().zip([1, 2, 0]).enumerate() {
        solo.trim(n, true).unwrap();
        assert_same_contents(&st, seqs[r].0, solo, &format!("rollback row {r}"));
    }
    // Rows leave: extract, filter; the sequences live on outside the batch.
    let out = st.extract(1).unwrap();
    assert_eq!(out, seqs[1].0);
    assert!(matches!(st.filter(&[0, 0]), Err(CacheError::DuplicateRow { row: 0 })));
    assert!(matches!(st.filter(&[2]), Err(CacheError::NoSuchRow { row: 2, rows: 2 })));
    assert_eq!(st.filter(&[1]).unwrap(), vec![seqs[0].0]);
    assert!(st.release(seqs[2].0).is_err(), "a row is not released behind the batch's back");
    st.audit().unwrap();
}

#[test]
fn impossible_saved_states_are_refused() {
    let spec = spec(KvDtype::F32);
    let mut st = PagedStore::new(spec, pool(2, 16)).unwrap();
    let a = st.open();
    let mut plain = KvCache::new(spec).unwrap();
    window_both(&mut st, a, &mut plain, 1, 0, 5);
    st.finish(a).unwrap();
    let b = st.open_with_prefix(&toks(1, 0, 5), 4).0;
    window_both(&mut st, b, &mut KvCache::new(spec).unwrap(), 1, 4, 7);
    let (parts, planes) = st.to_parts().unwrap();
    // The round trip gives the same store.
    let back = PagedStore::from_parts(parts.clone(), planes.clone()).unwrap();
    assert_eq!(back.to_parts().unwrap().0, parts);
    let (k1, _) = st.fetch(b).unwrap();
    let (k2, _) = back.fetch(b).unwrap();
    assert_same_bytes(&k1, &k2, "restored contents");
    let bad = |f: &dyn Fn(&mut PagedParts)| {
        let mut p = parts.clone();
        f(&mut p);
        PagedStore::from_parts(p, planes.clone())
    };
    let refused = [
        bad(&|p| p.seqs[0].1.table[0] = 99),
        bad(&|p| p.seqs[0].1.table.pop().map(|_| ()).unwrap_or(())),
        bad(&|p| p.refs[0] += 1),
        bad(&|p| p.free.push(p.free[0])),
        bad(&|p| p.rows = vec![42]),
        bad(&|p| p.index[0].prefix.pop().map(|_| ()).unwrap_or(())),
        bad(&|p| p.seqs[0].0 = p.next_seq),
        bad(&|p| {
            let t = &mut p.seqs[0].1.table;
            let (a, b) = (t[0], t[1]);
            t[1] = a;
            p.refs[a as usize] += 1;
            p.refs[b as usize] -= 1;
            if p.refs[b as usize] == 0 {
                p.free.push(b);
            }
        }),
    ];
    for (i, r) in refused.iter().enumerate() {
        assert!(matches!(r, Err(CacheError::InvalidState { .. })), "case {i}: {r:?}");
    }
    assert!(matches!(PagedStore::from_parts(parts.clone(), None), Err(CacheError::InvalidState { .. })));
}

#[test]
fn a_speculative_round_rolls_back_per_row_and_refuses_a_save_while_armed() {
    use crate::contract::{Cache, Capabilities, SpecRounds};
    let spec = spec(KvDtype::F32);
    let mut st = PagedStore::new(spec, pool(3, 64)).unwrap();
    let mut solos = vec![];
    let mut seqs = vec![];
    for (family, len) in [(1u32, 4usize), (2, 6)] {
        let s = st.open();
        let mut plain = KvCache::new(spec).unwrap();
        window_both(&mut st, s, &mut plain, family, 0, len);
        seqs.push((s, family, len));
        solos.push(plain);
    }
    st.join(&[seqs[0].0, seqs[1].0]).unwrap();
    let caps = Capabilities::of(&Cache::storage_kind(&st));
    assert!(caps.known && caps.row_batch && !caps.rotating, "{caps:?}");
    assert!(Capabilities::of(&st.storage_kind()).known && !Capabilities::of(&st.storage_kind()).row_batch);
    assert!(!Capabilities::of(&StorageKind::new("kv:paged-rows:04")).known, "written only as the store writes it");
    assert!(matches!(st.round_commit(), Err(CacheError::NoSpecRound)));
    SpecRounds::round_begin(&mut st).unwrap();
    assert!(matches!(st.round_begin(), Err(CacheError::SpecRoundActive)));
    // The verify window: 4 positions per row.
    let parts: Vec<(Array, Array, Array)> = seqs.iter().map(|&(_, f, len)| kv_of(&spec, f, len, len + 4)).collect();
    let (ck, cv, cq) = join_along(&parts, 0);
    let tokens: Vec<Vec<u32>> = seqs.iter().map(|&(_, f, len)| toks(f, len, len + 4)).collect();
    st.rows_window(&tokens, &ck, &cv, &cq, SCALE, &Masks::new()).unwrap();
    // While armed: no save, no change of the batch's shape, nothing changed by the refusals.
    let before = format!("{st:?}");
    assert!(matches!(st.to_parts(), Err(CacheError::SpecRoundActive)));
    assert!(matches!(st.filter(&[0]), Err(CacheError::SpecRoundActive)));
    assert!(matches!(st.extract(0), Err(CacheError::SpecRoundActive)));
    assert!(matches!(st.rows_trim(&[1, 1], true), Err(CacheError::SpecRoundActive)));
    assert!(matches!(st.round_rollback(&[1]), Err(CacheError::BadLengths { .. })));
    assert!(matches!(st.round_rollback(&[5, 0]), Err(CacheError::KeepOutsideWindow { keep: 5, window: 4 })));
    assert_eq!(format!("{st:?}"), before, "refusals change nothing");
    assert!(st.in_round());
    st.round_rollback(&[1, 4]).unwrap();
    assert!(!st.in_round());
    for (r, (solo, keep)) in solos.iter_mut().zip([1usize, 4]).enumerate() {
        let (k, v, q) = &parts[r];
        solo.window(k, v, q, SCALE, &Masks::new()).unwrap();
        solo.trim(4 - keep, true).unwrap();
        assert_same_contents(&st, seqs[r].0, solo, &format!("row {r} after the rollback"));
    }
    assert_eq!(Cache::offsets(&st), vec![5, 10]);
    st.audit().unwrap();
    // A committed round keeps everything; the save works again.
    st.round_begin().unwrap();
    st.round_commit().unwrap();
    st.to_parts().unwrap();
}

/// Affine storage: the same prefix sharing and rows, checked against serial quantized caches (outputs and all six
/// planes, bytes).
#[test]
fn affine_sequences_and_rows_match_serial_quantized_caches() {
    let quant = crate::QuantSpec { bits: 4, group: 32 };
    for dtype in [KvDtype::F32, KvDtype::Bf16] {
        let spec = KvSpec { head_dim: 64, ..spec(dtype) };
        let storage = Storage::Affine(quant);
        let mut st = PagedStore::with_storage(spec, pool(3, 64), storage).unwrap();
        assert_eq!(st.rows_storage_kind().as_str(), "kv:paged-rows:3:quant:4:32");
        assert_eq!(st.bytes_per_token(), storage.bytes_per_token(&spec));
        assert_eq!(st.bytes_for_tokens(4), 6 * storage.bytes_per_token(&spec));
        let twin = || crate::QuantizedKvCache::new(spec, quant).unwrap();
        let same_planes = |st: &PagedStore, s: SeqId, t: &SerialCache, what: &str| {
            let (a, b) = (st.fetch_planes(s).unwrap(), t.temporal_view_planes().unwrap());
            assert_eq!(a.len(), 6);
            for (i, (x, y)) in a.iter().zip(&b).enumerate() {
                assert_same_bytes(x, y, &format!("{dtype:?} {what}: plane {i}"));
            }
        };
        // A cold request fills the index; a warm one shares its full blocks, and its twin computes them itself.
        let a = st.open();
        let mut ta = twin();
        let (k, v, q) = kv_of(&spec, 1, 0, 7);
        let got = st.window(a, &toks(1, 0, 7), &k, &v, &q, SCALE).unwrap();
        let (want, _) = ta.window(&k, &v, &q, SCALE, &Masks::new()).unwrap();
        assert_same_bytes(&got, &want, &format!("{dtype:?}: cold window"));
        st.finish(a).unwrap();
        let (b, hit) = st.open_with_prefix(&toks(1, 0, 9), 8);
        assert_eq!(hit.positions, 6);
        let mut tb = twin();
        let (k, v, q) = kv_of(&spec, 1, 0, 6);
        tb.window(&k, &v, &q, SCALE, &Masks::new()).unwrap();
        same_planes(&st, b, &tb, "warm prefix");
        let c = st.open();
        let mut tc = twin();
        let (k, v, q) = kv_of(&spec, 2, 0, 2);
        st.window(c, &toks(2, 0, 2), &k, &v, &q, SCALE).unwrap();
        tc.window(&k, &v, &q, SCALE, &Masks::new()).unwrap();
        st.join(&[b, c]).unwrap();
        // Rows of different lengths (6 and 2): decodes and a window, each row against its twin.
        let masks = Masks::new();
        let (mut nb, mut nc) = (6, 2);
        for step in 0..3 {
            let l = if step == 1 { 3 } else { 1 };
            let parts = [kv_of(&spec, 1, nb, nb + l), kv_of(&spec, 2, nc, nc + l)];
            let (ck, cv, cq) = join_along(&parts, 0);
            let out = if l == 1 {
                st.rows_decode(&[toks(1, nb, nb + 1)[0], toks(2, nc, nc + 1)[0]], &ck, &cv, &cq, SCALE, &masks)
            } else {
                st.rows_window(&[toks(1, nb, nb + l), toks(2, nc, nc + l)], &ck, &cv, &cq, SCALE, &masks)
            }
            .unwrap()
            .0;
            for (r, t) in [&mut tb, &mut tc].into_iter().enumerate() {
                let (k, v, q) = &parts[r];
                let want = if l == 1 { t.decode(k, v, q, SCALE, &masks) } else { t.window(k, v, q, SCALE, &masks) };
                assert_same_bytes(&row(&out, r), &want.unwrap().0, &format!("{dtype:?} step {step} row {r}"));
            }
            nb += l;
            nc += l;
            same_planes(&st, b, &tb, &format!("step {step} row 0"));
            same_planes(&st, c, &tc, &format!("step {step} row 1"));
            st.audit().unwrap();
        }
        // The dense view is MLX's dequantize of the planes.
        let (k, _) = st.fetch(b).unwrap();
        let (tk, _) = tb.temporal_view().unwrap();
        assert_same_bytes(&k, &tk, &format!("{dtype:?}: dequantized K"));
        // Saved and restored with its storage.
        let (parts, planes) = st.to_parts().unwrap();
        assert_eq!(parts.storage, storage);
        let back = PagedStore::from_parts(parts.clone(), planes.clone()).unwrap();
        assert_eq!(back.to_parts().unwrap().0, parts);
        let mut two = planes.clone().unwrap();
        two.truncate(2);
        assert!(matches!(PagedStore::from_parts(parts, Some(two)), Err(CacheError::ShapeMismatch { .. })));
    }
    // Parameters MLX refuses, and a head dim the group does not divide.
    let bad = Storage::Affine(crate::QuantSpec { bits: 7, group: 32 });
    assert!(matches!(
        PagedStore::with_storage(KvSpec { head_dim: 64, ..spec(KvDtype::F32) }, pool(3, 8), bad),
        Err(CacheError::InvalidQuant { .. })
    ));
    assert!(matches!(
        PagedStore::with_storage(spec(KvDtype::F32), pool(3, 8), Storage::Affine(quant)),
        Err(CacheError::InvalidQuant { .. })
    ));
}

/// A right-padded prefill into rows that already hold positions: each row takes its own real positions of every
/// chunk and nothing else (no block for padding); while it is pending, everything that would change the rows or
/// read past the prefill is refused with nothing changed.
#[test]
fn a_right_padded_prefill_takes_only_each_rows_real_positions() {
    let quant = crate::QuantSpec { bits: 8, group: 32 };
    for storage in [Storage::Plain, Storage::Affine(quant)] {
        let spec = KvSpec { head_dim: 32, ..spec(KvDtype::F32) };
        let mut st = PagedStore::with_storage(spec, pool(2, 64), storage).unwrap();
        let twin = || match storage {
            Storage::Plain => KvCache::new(spec).unwrap(),
            Storage::Affine(q) => crate::QuantizedKvCache::new(spec, q).unwrap(),
        };
        let mut seqs = vec![];
        let mut twins = vec![];
        for (family, len) in [(1u32, 3usize), (2, 1), (3, 2)] {
            let s = st.open();
            let mut t = twin();
            let (k, v, q) = kv_of(&spec, family, 0, len);
            st.window(s, &toks(family, 0, len), &k, &v, &q, SCALE).unwrap();
            t.window(&k, &v, &q, SCALE, &Masks::new()).unwrap();
            seqs.push((s, family, len));
            twins.push(t);
        }
        st.join(&seqs.iter().map(|x| x.0).collect::<Vec<_>>()).unwrap();
        assert!(matches!(st.rows_prepare(&[1, 2]), Err(CacheError::BadLengths { .. })));
        st.rows_prepare(&[5, 0, 2]).unwrap();
        assert!(st.is_pending());
        // Refused while pending, nothing changed.
        let before = format!("{st:?}");
        let (k1, v1, q1) = join_along(&[kvq(&spec, 9, 1, 1), kvq(&spec, 10, 1, 1), kvq(&spec, 11, 1, 1)], 0);
        let masks = Masks::new();
        assert!(matches!(st.rows_decode(&[1, 2, 3], &k1, &v1, &q1, SCALE, &masks), Err(CacheError::PendingPrefill)));
        assert!(matches!(st.rows_prepare(&[1, 1, 1]), Err(CacheError::PendingPrefill)));
        assert!(matches!(st.filter(&[0]), Err(CacheError::PendingPrefill)));
        assert!(matches!(st.extract(0), Err(CacheError::PendingPrefill)));
        assert!(matches!(st.rows_trim(&[1, 0, 0], false), Err(CacheError::PendingPrefill)));
        assert!(matches!(st.trim(seqs[0].0, 1, false), Err(CacheError::PendingPrefill)));
        assert!(matches!(st.round_begin(), Err(CacheError::PendingPrefill)));
        assert!(matches!(st.to_parts(), Err(CacheError::PendingPrefill)));
        assert_eq!(format!("{st:?}"), before);
        // Chunks of 2: rows take (2, 0, 2), then (2, 0, 0); then a finalize forgets the fifth position of row 0.
        let mut offsets: Vec<usize> = seqs.iter().map(|x| x.2).collect();
        let mut pending = [5usize, 0, 2];
        for chunk in 0..2 {
            let parts: Vec<(Array, Array, Array)> =
                seqs.iter().zip(&offsets).map(|(&(_, f, _), &o)| kv_of(&spec, f, o, o + 2)).collect();
            let (ck, cv, cq) = join_along(&parts, 0);
            let tokens: Vec<Vec<u32>> = seqs.iter().zip(&offsets).map(|(&(_, f, _), &o)| toks(f, o, o + 2)).collect();
            let (out, _) = st.rows_window(&tokens, &ck, &cv, &cq, SCALE, &masks).unwrap();
            for r in 0..3 {
                let n = pending[r].min(2);
                pending[r] -= n;
                if n == 0 {
                    continue;
                }
                let (k, v, q) = &parts[r];
                let cut = |a: &Array| crate::util::cols(a, 0, n).unwrap();
                let (want, _) = twins[r].window(&cut(k), &cut(v), &cut(q), SCALE, &masks).unwrap();
                let got = crate::util::cols(&row(&out, r), 0, n).unwrap();
                assert_same_bytes(&got, &want, &format!("{storage:?} chunk {chunk} row {r}"));
                offsets[r] += n;
            }
            for (r, t) in twins.iter().enumerate() {
                assert_eq!(st.seq(seqs[r].0).unwrap().offset, offsets[r]);
                let (a, b) = (st.fetch_planes(seqs[r].0).unwrap(), t.temporal_view_planes().unwrap());
                for (x, y) in a.iter().zip(&b) {
                    assert_same_bytes(x, y, &format!("{storage:?} chunk {chunk} row {r}: planes"));
                }
            }
            st.audit().unwrap();
        }
        assert_eq!(offsets, [7, 1, 4]);
        st.rows_finalize().unwrap();
        assert!(matches!(st.rows_finalize(), Err(CacheError::NoPendingPrefill)));
        // A block per two positions, none for padding or the forgotten position.
        let held: usize = seqs.iter().map(|x| st.seq(x.0).unwrap().table.len()).sum();
        assert_eq!(held, 4 + 1 + 2);
        // The rows decode again, each as its twin.
        let (out, _) = st.rows_decode(&[1, 2, 3], &k1, &v1, &q1, SCALE, &masks).unwrap();
        for (r, t) in twins.iter_mut().enumerate() {
            let (k, v, q) = kvq(&spec, 9 + r as u64, 1, 1);
            let (want, _) = t.decode(&k, &v, &q, SCALE, &masks).unwrap();
            assert_same_bytes(&row(&out, r), &want, &format!("{storage:?}: decode after finalize, row {r}"));
        }
    }
}

#[test]
fn paged_kinds_parse_exactly_as_they_are_written() {
    use crate::kind::{paged_kind, parse_paged};
    let q = crate::QuantSpec { bits: 4, group: 64 };
    for (bs, rows, quant) in [(1, false, None), (256, true, None), (3, false, Some(q)), (16, true, Some(q))] {
        let k = paged_kind(bs, rows, quant);
        assert_eq!(parse_paged(&k), Some(crate::kind::PagedKind { block_size: bs, rows, quant }), "{k}");
        let caps = crate::Capabilities::of(&k);
        assert!(caps.known && caps.row_batch == rows && caps.quantized == quant.is_some(), "{k}: {caps:?}");
    }
    for bad in [
        "kv:paged:0",
        "kv:paged:03",
        "kv:paged:+3",
        "kv:paged:3:",
        "kv:paged:3:quant:4",
        "kv:paged:3:quant:7:32",
        "kv:paged:3:quant:4:48",
        "kv:paged:3:quant:04:32",
        "kv:paged:3:affine:4:32",
        "kv:paged-rows:3:quant:4:32:1",
    ] {
        assert_eq!(parse_paged(&StorageKind::new(bad)), None, "{bad}");
    }
}
