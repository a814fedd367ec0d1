//! insta snapshots of what a person reads when a layout changes: masks as pictures, ring pictures after a scripted
//! schedule, and a compact summary of one simulator seed. A changed picture fails the test (review with
//! `cargo insta review`, or regenerate with `INSTA_UPDATE=always` after checking the diff by eye).

use std::fmt::Write as _;

use kvsim::cache::{JoinSource, KvDtype, KvSpec, MaskSpec, MaskUse, Masks, RowBatch, SerialCache};
use kvsim::reference::Tok;
use kvsim::sim::trace::Outcome;
use kvsim::sim::{run_seed, DeviceChoice};

use crate::common::Payload;

const SPEC: KvSpec = KvSpec { heads_kv: 1, head_dim: 4, dtype: KvDtype::F32 };

fn payload() -> Payload {
    Payload::new(SPEC, 2, 11)
}

/// One line per (row, query): `r{row} q{query} ` then a character per physical column, `#` visible, `.` hidden.
fn mask_picture(m: &MaskSpec) -> String {
    let mut s = format!("rows={} queries={} cols={}\n", m.rows, m.queries, m.cols);
    for b in 0..m.rows {
        for i in 0..m.queries {
            let cells: String = (0..m.cols).map(|c| if m.is_visible(b, i, c) { '#' } else { '.' }).collect();
            let _ = writeln!(s, "r{b} q{i} {cells}");
        }
    }
    s
}

fn used_picture(u: &MaskUse) -> String {
    match u {
        MaskUse::None => "mask: none\n".to_string(),
        MaskUse::Causal => "mask: causal\n".to_string(),
        MaskUse::Array(m) => format!("mask: array\n{}", mask_picture(m)),
    }
}

/// Tokens `from .. from + n` of request `req`.
fn toks(req: u32, from: usize, n: usize) -> Vec<Tok> {
    (from..from + n).map(|p| Tok { req, pos: p as u32 }).collect()
}

/// A serial cache of request `req` after a window of `prefill` positions and `decodes` decode steps.
fn serial(p: &Payload, w: Option<usize>, req: u32, prefill: usize, decodes: usize) -> SerialCache {
    let mut c = SerialCache::new(SPEC, w).unwrap();
    if prefill > 0 {
        let (k, v, q) = p.kvq1(&toks(req, 0, prefill));
        c.window(&k, &v, &q, p.scale(), &Masks::new()).unwrap();
    }
    for i in 0..decodes {
        let (k, v, q) = p.kvq1(&toks(req, prefill + i, 1));
        c.decode(&k, &v, &q, p.scale(), &Masks::new()).unwrap();
    }
    c
}

/// `L` next positions per row of `b` (rows are requests 0, 1, ...; positions from each row's offset).
fn next_block(p: &Payload, b: &RowBatch, l: usize) -> (mlx_rs::Array, mlx_rs::Array, mlx_rs::Array) {
    let rows: Vec<Vec<Option<Tok>>> = b
        .row_states()
        .iter()
        .enumerate()
        .map(|(r, s)| toks(r as u32, s.ring.offset, l).into_iter().map(Some).collect())
        .collect();
    p.kvq(&rows)
}

fn decode(p: &Payload, b: &mut RowBatch) -> MaskUse {
    let (k, v, q) = next_block(p, b, 1);
    b.decode(&k, &v, &q, p.scale(), &Masks::new()).unwrap().1
}

fn window(p: &Payload, b: &mut RowBatch, l: usize) -> MaskUse {
    let (k, v, q) = next_block(p, b, l);
    b.window(&k, &v, &q, p.scale(), &Masks::new()).unwrap().1
}

/// Decode over rows of unequal length: each row sees its own `len` columns (`c < len_r`).
#[test]
fn mask_decode_unequal_rows() {
    let p = payload();
    let rows = [(5usize, 0usize), (1, 1), (0, 0)];
    let solo: Vec<SerialCache> =
        rows.iter().enumerate().map(|(r, &(w, d))| serial(&p, Some(4), r as u32, w, d)).collect();
    let sources: Vec<JoinSource> = solo.iter().map(JoinSource::Serial).collect();
    let mut b = RowBatch::join(SPEC, Some(4), &sources).unwrap();
    let used = decode(&p, &mut b);
    insta::assert_snapshot!("mask_decode_unequal_rows", format!("{}{}", b.picture(), used_picture(&used)));
}

/// A window read once the sliding window binds (len > W after the write): causal, and each query sees only
/// its newest W positions.
#[test]
fn mask_window_sliding_window_binds() {
    let p = payload();
    let solo = [serial(&p, Some(3), 0, 2, 3), serial(&p, Some(3), 1, 1, 0)];
    let sources: Vec<JoinSource> = solo.iter().map(JoinSource::Serial).collect();
    let mut b = RowBatch::join(SPEC, Some(3), &sources).unwrap();
    let used = window(&p, &mut b, 3);
    let mut s = format!("{}{}", b.picture(), used_picture(&used));
    // The serial twin of row 0 reads with the same sliding-window mask.
    let mut twin = solo[0].clone();
    let (k, v, q) = p.kvq1(&toks(0, 5, 3));
    let (_, u) = twin.window(&k, &v, &q, p.scale(), &Masks::new()).unwrap();
    s.push_str("serial twin of row 0:\n");
    s.push_str(&used_picture(&u));
    insta::assert_snapshot!("mask_window_sliding_window_binds", s);
}

/// A right-padded prefill: rows of 5, 2 and 0 real positions in chunks of 3. Padded queries see column 0 only
/// (their outputs are unspecified); a row's padded positions are never stored.
#[test]
fn mask_right_padded_prefill_chunks() {
    let p = payload();
    let mut b = RowBatch::with_rows(SPEC, None, 3).unwrap();
    let lengths = [5usize, 2, 0];
    b.prepare(&lengths).unwrap();
    let mut s = String::new();
    let mut done = 0;
    for chunk in 0..2 {
        let rows: Vec<Vec<Option<Tok>>> = lengths
            .iter()
            .enumerate()
            .map(|(r, &n)| {
                let real = n.saturating_sub(done).min(3);
                let mut row: Vec<Option<Tok>> = toks(r as u32, done.min(n), real).into_iter().map(Some).collect();
                row.resize(3, None);
                row
            })
            .collect();
        let (k, v, q) = p.kvq(&rows);
        let (_, used) = b.window(&k, &v, &q, p.scale(), &Masks::new()).unwrap();
        let _ = writeln!(s, "chunk {chunk}:");
        s.push_str(&b.picture());
        s.push_str(&used_picture(&used));
        done += 3;
    }
    b.finalize().unwrap();
    insta::assert_snapshot!("mask_right_padded_prefill_chunks", s);
}

/// Ring pictures through a scripted schedule: rows joined with different phases, wraps, a window plateau, a
/// speculative rollback, an extract.
#[test]
fn ring_pictures_through_a_schedule() {
    let p = payload();
    let w = Some(4);
    let solo = [serial(&p, w, 0, 3, 0), serial(&p, w, 1, 4, 3), serial(&p, w, 2, 1, 0)];
    let sources: Vec<JoinSource> = solo.iter().map(JoinSource::Serial).collect();
    let mut b = RowBatch::join(SPEC, w, &sources).unwrap();
    insta::assert_snapshot!("ring_joined", b.picture());
    for _ in 0..3 {
        decode(&p, &mut b);
    }
    insta::assert_snapshot!("ring_wrapped", b.picture());
    window(&p, &mut b, 3);
    insta::assert_snapshot!("ring_window_plateau", b.picture());
    // Verify: a window of 2, then rows accept 2, 1 and 0 of them.
    window(&p, &mut b, 2);
    b.trim_rows(&[0, 1, 2], true).unwrap();
    insta::assert_snapshot!("ring_rollback", b.picture());
    decode(&p, &mut b);
    let e = b.extract(1).unwrap();
    b.filter(&[0, 2]).unwrap();
    insta::assert_snapshot!(
        "ring_extract",
        format!("extracted row 1: {}\nbatch after filter:\n{}", e.picture(), b.picture())
    );
}

/// Seed 3 of the simulator, summarized: its config, the ops it ran by kind, the outcome and the result hash.
#[test]
fn trace_summary_seed_3() {
    let r = run_seed(3, DeviceChoice::Cpu, None);
    let c = &r.trace.config;
    let mut s = format!(
        "seed {} layout {:?} dtype {:?} heads_kv {} heads_q {} head_dim {} layers {} ops {} max_batch {}\n",
        r.trace.seed, c.layout, c.dtype, c.heads_kv, c.heads_q, c.head_dim, c.layers, c.ops, c.max_batch
    );
    for (kind, n) in &r.ops_by_kind {
        let _ = writeln!(s, "  {kind:<13} {n}");
    }
    let _ = writeln!(s, "  {:<13} {}", "(skipped)", r.skipped);
    match &r.trace.outcome {
        Outcome::Pass => s.push_str("outcome: pass\n"),
        Outcome::Fail { op_index, check, message } => {
            let _ = writeln!(s, "outcome: fail at op {op_index} [{check}] {message}");
        }
    }
    let _ = writeln!(s, "expected errors: {}", r.counters.expected_errors);
    let _ = writeln!(s, "result hash: {}", r.trace.result_hash);
    insta::assert_snapshot!("trace_summary_seed_3", s);
}
