//! Divergence reports: the first place where what a layout holds differs from what the model expects, named in
//! the model's terms (op, row, physical column, expected token, the token actually found).

use std::fmt;

use crate::model::RowFields;
use crate::values::{bits_to_f32, BitsKind, RefDtype, Tensor, Tok, ValueSpace};

/// One divergence between the model and a layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Divergence {
    /// Index of the op in the run (0-based).
    pub op_index: usize,
    /// The op's name (`decode`, `window`, `merge`, ...).
    pub op: String,
    /// Row of the batch (0 for a serial cache).
    pub row: usize,
    /// Physical column, for a column divergence.
    pub column: Option<usize>,
    /// What differs: `K layer 0`, `offset`, `len`, ...
    pub what: String,
    /// The model's expectation, in words.
    pub expected: String,
    /// What the layout holds, in words.
    pub found: String,
    /// The token the model expected in that column, if any.
    pub expected_tok: Option<Tok>,
    /// The token whose values were found there, if identified.
    pub found_tok: Option<Tok>,
    /// A summary of the found bytes, for a column divergence.
    pub bytes: Option<String>,
}

impl Divergence {
    /// A divergence of one scalar field (`offset`, `idx`, ...), not of a column.
    pub fn field(
        op_index: usize,
        op: &str,
        row: usize,
        what: &str,
        expected: impl fmt::Display,
        found: impl fmt::Display,
    ) -> Self {
        Divergence {
            op_index,
            op: op.to_string(),
            row,
            column: None,
            what: what.to_string(),
            expected: expected.to_string(),
            found: found.to_string(),
            expected_tok: None,
            found_tok: None,
            bytes: None,
        }
    }
}

impl fmt::Display for Divergence {
    /// `op #7 (decode) row 1 column 3, K layer 0: expected req 0 pos 12, found req 0 pos 4 [bits 3e80 bf12 …]`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "op #{} ({}) row {}", self.op_index, self.op, self.row)?;
        if let Some(c) = self.column {
            write!(f, " column {c}")?;
        }
        write!(f, ", {}: expected {}, found {}", self.what, self.expected, self.found)?;
        if let Some(b) = &self.bytes {
            write!(f, " [bits {b}]")?;
        }
        Ok(())
    }
}

/// The first elements of a column as hex storage words (`3f80 bf12 …` for bf16, 8 digits for f32), with the
/// element count when cut.
pub fn bits_summary(d: RefDtype, bits: &[u32]) -> String {
    const SHOWN: usize = 4;
    let mut parts: Vec<String> = bits
        .iter()
        .take(SHOWN)
        .map(|&b| match d {
            RefDtype::F32 => format!("{b:08x}"),
            RefDtype::Bf16 => format!("{:04x}", b & 0xffff),
        })
        .collect();
    if bits.len() > SHOWN {
        parts.push(format!("… ({} values)", bits.len()));
    }
    if bits.is_empty() {
        parts.push("(empty)".into());
    }
    parts.join(" ")
}

/// Describes found column bits: the token they belong to (among `candidates`), else what they look like.
pub fn describe_found(
    vs: &ValueSpace,
    layer: u32,
    t: Tensor,
    bits: &[u32],
    candidates: impl Iterator<Item = Tok>,
) -> (String, Option<Tok>) {
    if let Some(tok) = vs.identify(layer, t, bits, candidates) {
        return (tok.to_string(), Some(tok));
    }
    let first = bits.first().map(|&b| bits_to_f32(vs.dtype, b));
    let what = match vs.classify(bits) {
        BitsKind::Zeros => "zeros (a column never written)".to_string(),
        BitsKind::Padding => "padding poison".to_string(),
        BitsKind::InRange => "an unidentified column".to_string(),
        BitsKind::Other => match first {
            Some(x) => format!("unrecognised bytes (first value {x})"),
            None => "an empty column".to_string(),
        },
    };
    (what, None)
}

/// The columns of one row's K or V plane, `[heads, n, d]` row-major storage words (`[1, heads, n, d]` read as bits),
/// as the per-column vectors [`compare_columns`] takes: `out[c]` is column `c`, `[heads, d]` row-major. `None` when
/// `flat` does not hold exactly `heads * n * d` words.
pub fn columns_of(flat: &[u32], heads: usize, n: usize, d: usize) -> Option<Vec<Vec<u32>>> {
    if flat.len() != heads * n * d {
        return None;
    }
    Some((0..n).map(|c| (0..heads * d).map(|x| flat[((x / d) * n + c) * d + x % d]).collect()).collect())
}

/// Compares the expected column map of one row (`expected[c]` = the token in physical column `c`) with the
/// storage bits found in those columns (`found[c]`, `[heads_kv, head_dim]` row-major) for tensor `t` of `layer`.
///
/// Returns the first divergence in column order, or `None` when every column holds exactly its expected token's
/// bits and the column counts agree. The found token is identified among `expected` and `extra_candidates` (pass
/// e.g. every token the run has written, to name an evicted or foreign position).
#[allow(clippy::too_many_arguments)]
pub fn compare_columns(
    vs: &ValueSpace,
    layer: u32,
    t: Tensor,
    expected: &[Tok],
    found: &[Vec<u32>],
    extra_candidates: &[Tok],
    op_index: usize,
    op: &str,
    row: usize,
) -> Option<Divergence> {
    let what = format!("{t} layer {layer}");
    let candidates = || expected.iter().chain(extra_candidates).copied();
    for c in 0..expected.len().max(found.len()) {
        let (exp_text, exp_tok, found_text, found_tok, bytes) = match (expected.get(c), found.get(c)) {
            (Some(&e), Some(f)) => {
                if vs.column_bits(layer, t, e) == *f {
                    continue;
                }
                let (text, tok) = describe_found(vs, layer, t, f, candidates());
                (e.to_string(), Some(e), text, tok, Some(bits_summary(vs.dtype, f)))
            }
            (Some(&e), None) => {
                (e.to_string(), Some(e), format!("no column (the layout has {} columns)", found.len()), None, None)
            }
            (None, Some(f)) => {
                let (text, tok) = describe_found(vs, layer, t, f, candidates());
                (
                    format!("no column (the model has {} columns)", expected.len()),
                    None,
                    text,
                    tok,
                    Some(bits_summary(vs.dtype, f)),
                )
            }
            (None, None) => continue,
        };
        return Some(Divergence {
            op_index,
            op: op.to_string(),
            row,
            column: Some(c),
            what,
            expected: exp_text,
            found: found_text,
            expected_tok: exp_tok,
            found_tok,
            bytes,
        });
    }
    None
}

/// Compares the host-side fields of one row, in the order `offset`, `len`, `idx`, `last_concat`, `base`,
/// `pending`; the first that differs is the divergence.
pub fn compare_fields(
    op_index: usize,
    op: &str,
    row: usize,
    expected: &RowFields,
    found: &RowFields,
) -> Option<Divergence> {
    let opt = |x: Option<usize>| x.map_or_else(|| "none".to_string(), |v| v.to_string());
    let pairs = [
        ("offset", expected.offset.to_string(), found.offset.to_string()),
        ("len", expected.len.to_string(), found.len.to_string()),
        ("idx", expected.idx.to_string(), found.idx.to_string()),
        ("last_concat", opt(expected.last_concat), opt(found.last_concat)),
        ("base", expected.base.to_string(), found.base.to_string()),
        ("pending", opt(expected.pending), opt(found.pending)),
    ];
    pairs.into_iter().find(|(_, e, f)| e != f).map(|(what, e, f)| Divergence::field(op_index, op, row, what, e, f))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::RowModel;

    fn vs() -> ValueSpace {
        ValueSpace { seed: 3, heads_kv: 1, heads_q: 2, head_dim: 4, dtype: RefDtype::Bf16 }
    }

    /// A hand-made wrong layout: the ring of W = 3 after 5 decodes holds [p3 p4 p2]; the "layout" below kept the
    /// head of the temporal order instead and overwrote the wrong column, so column 2 holds position 0.
    #[test]
    fn divergence_report_names_expected_and_found_tokens() {
        let v = vs();
        let mut m = RowModel::new(Some(3));
        for p in 0..5 {
            m.try_decode_write(Tok::new(7, p)).unwrap();
        }
        let found: Vec<Vec<u32>> = [3, 4, 0].iter().map(|&p| v.column_bits(0, Tensor::K, Tok::new(7, p))).collect();
        let all: Vec<Tok> = (0..5).map(|p| Tok::new(7, p)).collect();
        let d = compare_columns(&v, 0, Tensor::K, &m.cols, &found, &all, 12, "decode", 1).unwrap();
        assert_eq!(d.column, Some(2));
        assert_eq!(d.expected_tok, Some(Tok::new(7, 2)));
        assert_eq!(d.found_tok, Some(Tok::new(7, 0)));
        let text = d.to_string();
        let bits = bits_summary(RefDtype::Bf16, &found[2]);
        assert_eq!(
            text,
            format!("op #12 (decode) row 1 column 2, K layer 0: expected req 7 pos 2, found req 7 pos 0 [bits {bits}]")
        );
        assert!(bits.len() == 4 * 4 + 3, "four bf16 words: {bits}");

        // Without the extra candidates the evicted position cannot be named.
        let d = compare_columns(&v, 0, Tensor::K, &m.cols, &found, &[], 12, "decode", 1).unwrap();
        assert_eq!(d.found, "an unidentified column");

        // The right layout: no divergence.
        let right: Vec<Vec<u32>> = m.cols.iter().map(|&t| v.column_bits(0, Tensor::K, t)).collect();
        assert_eq!(compare_columns(&v, 0, Tensor::K, &m.cols, &right, &[], 12, "decode", 1), None);
    }

    #[test]
    fn padding_missing_and_extra_columns_are_named() {
        let v = vs();
        let exp = vec![Tok::new(0, 0), Tok::new(0, 1)];
        let padded = vec![v.column_bits(0, Tensor::V, exp[0]), v.pad_column_bits(0, Tensor::V, 0, 1)];
        let d = compare_columns(&v, 0, Tensor::V, &exp, &padded, &[], 3, "window", 0).unwrap();
        assert_eq!(d.found, "padding poison");
        assert!(d.to_string().starts_with(
            "op #3 (window) row 0 column 1, V layer 0: expected req 0 pos 1, found padding poison [bits "
        ));

        let short = vec![v.column_bits(0, Tensor::V, exp[0])];
        let d = compare_columns(&v, 0, Tensor::V, &exp, &short, &[], 3, "window", 0).unwrap();
        assert_eq!(d.to_string(), "op #3 (window) row 0 column 1, V layer 0: expected req 0 pos 1, found no column (the layout has 1 columns)");

        let mut long = padded.clone();
        long[1] = v.column_bits(0, Tensor::V, exp[1]);
        long.push(vec![0; 4]);
        let d = compare_columns(&v, 0, Tensor::V, &exp, &long, &[], 3, "window", 0).unwrap();
        assert_eq!(
            d.to_string(),
            "op #3 (window) row 0 column 2, V layer 0: expected no column (the model has 2 columns), found zeros (a column never written) [bits 0000 0000 0000 0000]"
        );
    }

    #[test]
    fn field_divergences() {
        let e = RowFields { offset: 9, len: 4, idx: 2, last_concat: None, base: 0, pending: None };
        assert_eq!(compare_fields(0, "trim", 0, &e, &e), None);
        let f = RowFields { idx: 4, last_concat: Some(3), ..e };
        let d = compare_fields(5, "trim", 2, &e, &f).unwrap();
        assert_eq!(d.to_string(), "op #5 (trim) row 2, idx: expected 2, found 4");
        let f = RowFields { last_concat: Some(3), ..e };
        assert_eq!(
            compare_fields(5, "trim", 2, &e, &f).unwrap().to_string(),
            "op #5 (trim) row 2, last_concat: expected none, found 3"
        );
        assert_eq!(bits_summary(RefDtype::F32, &[1, 2, 3, 4, 5]), "00000001 00000002 00000003 00000004 … (5 values)");
    }

    #[test]
    fn columns_of_reads_a_head_major_plane_by_column() {
        let v = vs();
        let (h, n, d) = (2, 3, 4);
        let v2 = ValueSpace { heads_kv: h, heads_q: 2 * h, ..v };
        let toks: Vec<Tok> = (0..n as u32).map(|p| Tok::new(5, p)).collect();
        let (plane, shape) = v2.block_f32(0, Tensor::K, &[toks.iter().copied().map(Some).collect()]);
        assert_eq!(shape, [1, h, n, d]);
        let words: Vec<u32> = plane.iter().map(|x| x.to_bits() >> 16).collect();
        let cols = columns_of(&words, h, n, d).unwrap();
        assert_eq!(cols.len(), n);
        for (c, t) in toks.iter().enumerate() {
            assert_eq!(cols[c], v2.column_bits(0, Tensor::K, *t), "column {c}");
        }
        assert_eq!(compare_columns(&v2, 0, Tensor::K, &toks, &cols, &[], 0, "window", 0), None);
        assert_eq!(columns_of(&words[1..], h, n, d), None);
    }
}
