//! Byte-level views of MLX arrays: the only way kvsim decides that two arrays are "the same".
//!
//! Guarantees:
//! - [`ArrayBytes::of`] returns the array's elements **in row-major logical order**, as unsigned integers of the
//!   element's own width (`u16` for bf16/f16, `u32` for f32, ...), whatever the array's strides: a strided or
//!   transposed view is first materialized with MLX's `contiguous` op, and the result's strides are checked
//!   before reading (mlx-rs 0.33's `Array::as_slice` reads the buffer without checking contiguity).
//! - Equality of two `ArrayBytes` is equality of dtype, shape and every bit: `-0.0 != +0.0`, NaN payloads are told
//!   apart, and no tolerance is ever applied. Distances (where exactness is not claimed) are measured in ULPs by
//!   [`max_ulp`], never hidden behind `allclose`.

use mlx_rs::{Array, Dtype};

use kvsim_ulp::FloatFormat;

/// Why an array's bytes could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BytesError {
    /// MLX raised an error evaluating or materializing the array, or its data could not be borrowed (null data
    /// pointer, slice refused); the message says which.
    #[error("MLX failed while materializing the array: {0}")]
    Mlx(String),
    /// A dtype whose element is not 1, 2, 4 or 8 bytes wide; never returned today (every mlx-rs 0.33 dtype is).
    #[error("dtype {0:?} has no byte view in kvsim")]
    Unsupported(Dtype),
    /// The buffer to read is not row-major contiguous (after `contiguous`), or its strides do not match its rank.
    #[error("array is not row-major contiguous after `contiguous` (shape {shape:?}, strides {strides:?})")]
    NotContiguous {
        /// The array's shape.
        shape: Vec<i32>,
        /// Its strides as MLX reports them, in elements.
        strides: Vec<usize>,
    },
    /// A host-side request that does not fit the view's shape ([`ArrayBytes::select_columns`]: not 4-D, or a row or
    /// column out of range).
    #[error("{0}")]
    Shape(String),
}

impl From<mlx_rs::error::Exception> for BytesError {
    fn from(e: mlx_rs::error::Exception) -> Self {
        BytesError::Mlx(e.to_string())
    }
}

/// The elements of an array as same-width unsigned integers.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Words {
    /// 1-byte elements (bool, u8, i8).
    U8(Vec<u8>),
    /// 2-byte elements (u16, i16, f16, bf16).
    U16(Vec<u16>),
    /// 4-byte elements (u32, i32, f32).
    U32(Vec<u32>),
    /// 8-byte elements (u64, i64, f64, complex64).
    U64(Vec<u64>),
}

impl Words {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Words::U8(w) => w.len(),
            Words::U16(w) => w.len(),
            Words::U32(w) => w.len(),
            Words::U64(w) => w.len(),
        }
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Element `i` widened to u64 (bit pattern preserved).
    pub fn get(&self, i: usize) -> u64 {
        match self {
            Words::U8(w) => w[i] as u64,
            Words::U16(w) => w[i] as u64,
            Words::U32(w) => w[i] as u64,
            Words::U64(w) => w[i],
        }
    }

    /// Elements `range` widened to u32 (for 8/16/32-bit words; 64-bit words are truncated).
    pub fn to_u32(&self) -> Vec<u32> {
        (0..self.len()).map(|i| self.get(i) as u32).collect()
    }

    /// Little-endian bytes of every element, for hashing.
    pub fn le_bytes(&self) -> Vec<u8> {
        match self {
            Words::U8(w) => w.clone(),
            Words::U16(w) => w.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Words::U32(w) => w.iter().flat_map(|x| x.to_le_bytes()).collect(),
            Words::U64(w) => w.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    /// The inverse of [`Words::le_bytes`]: `bytes` read as little-endian words of `width` bytes (1, 2, 4 or 8);
    /// `None` for another width or a length that is not a whole number of words.
    pub fn from_le(bytes: &[u8], width: usize) -> Option<Words> {
        if width == 0 || !bytes.len().is_multiple_of(width) {
            return None;
        }
        let chunks = bytes.chunks_exact(width);
        Some(match width {
            1 => Words::U8(bytes.to_vec()),
            2 => Words::U16(chunks.map(|c| u16::from_le_bytes([c[0], c[1]])).collect()),
            4 => Words::U32(chunks.map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()),
            8 => Words::U64(chunks.map(|c| u64::from_le_bytes(c.try_into().unwrap_or([0; 8]))).collect()),
            _ => return None,
        })
    }
}

/// An array's dtype, shape and element bits in row-major order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArrayBytes {
    /// The array's MLX dtype (the words' width is its element size).
    pub dtype: Dtype,
    /// The array's logical shape.
    pub shape: Vec<i32>,
    /// Every element's bits, in row-major logical order, whatever the array's strides.
    pub words: Words,
}

impl ArrayBytes {
    /// Reads `a` (evaluating it) as same-width unsigned integers in row-major order.
    pub fn of(a: &Array) -> Result<Self, BytesError> {
        let dtype = a.dtype();
        let shape = a.shape().to_vec();
        let dense = a.contiguous()?;
        let words = match dtype.item_size_bytes() {
            1 => Words::U8(read::<u8>(&dense)?),
            2 => Words::U16(read::<u16>(&dense)?),
            4 => Words::U32(read::<u32>(&dense)?),
            8 => Words::U64(read::<u64>(&dense)?),
            _ => return Err(BytesError::Unsupported(dtype)),
        };
        Ok(ArrayBytes { dtype, shape, words })
    }

    /// Reads many arrays with one MLX evaluation and no extra MLX ops: each evaluated array (a view too) is read
    /// by walking its own strides from its data pointer, in row-major logical order.
    pub fn read_many(arrays: &[&Array]) -> Result<Vec<ArrayBytes>, BytesError> {
        mlx_rs::transforms::eval(arrays.iter().copied())?;
        arrays.iter().map(|a| read_strided(a)).collect()
    }

    /// Row `row`, columns `cols` (axis 2) of a `[B, H, C, D]` view, as the `[1, H, cols.len(), D]` view MLX's
    /// `take` along axis 2 of that row would give: bits copied on the host, never converted. Lets a checker read a
    /// whole buffer once and cut every row's physical or temporal columns from it without more MLX ops.
    pub fn select_columns(&self, row: usize, cols: &[usize]) -> Result<ArrayBytes, BytesError> {
        let dims: Vec<usize> = self.shape.iter().map(|&d| d.max(0) as usize).collect();
        let [b, h, c, d] = dims[..] else {
            return Err(BytesError::Shape(format!("select_columns needs a 4-D view, got shape {:?}", self.shape)));
        };
        if row >= b || cols.iter().any(|&x| x >= c) {
            return Err(BytesError::Shape(format!(
                "row {row}, columns {cols:?} out of range for shape {:?}",
                self.shape
            )));
        }
        macro_rules! pick {
            ($w:expr, $v:ident) => {{
                let mut out = Vec::with_capacity(h * cols.len() * d);
                for hh in 0..h {
                    for &cc in cols {
                        let at = ((row * h + hh) * c + cc) * d;
                        out.extend_from_slice(&$w[at..at + d]);
                    }
                }
                Words::$v(out)
            }};
        }
        let words = match &self.words {
            Words::U8(w) => pick!(w, U8),
            Words::U16(w) => pick!(w, U16),
            Words::U32(w) => pick!(w, U32),
            Words::U64(w) => pick!(w, U64),
        };
        Ok(ArrayBytes { dtype: self.dtype, shape: vec![1, h as i32, cols.len() as i32, d as i32], words })
    }

    /// blake3 of dtype, shape and bits: a stable digest for traces.
    pub fn digest(&self) -> [u8; 32] {
        let mut h = blake3::Hasher::new();
        h.update(format!("{:?}", self.dtype).as_bytes());
        for d in &self.shape {
            h.update(&d.to_le_bytes());
        }
        // The bytes of [`Words::le_bytes`], fed through a stack buffer instead of one allocation.
        let mut buf = [0u8; 4096];
        macro_rules! feed {
            ($w:expr, $n:expr) => {{
                for chunk in $w.chunks(4096 / $n) {
                    for (i, x) in chunk.iter().enumerate() {
                        buf[i * $n..(i + 1) * $n].copy_from_slice(&x.to_le_bytes());
                    }
                    h.update(&buf[..chunk.len() * $n]);
                }
            }};
        }
        match &self.words {
            Words::U8(w) => {
                h.update(w);
            }
            Words::U16(w) => feed!(w, 2),
            Words::U32(w) => feed!(w, 4),
            Words::U64(w) => feed!(w, 8),
        }
        *h.finalize().as_bytes()
    }

    /// Index of the first element whose bits differ (None when identical in dtype, shape and bits).
    pub fn first_difference(&self, other: &ArrayBytes) -> Option<usize> {
        if self.dtype != other.dtype || self.shape != other.shape || self.words.len() != other.words.len() {
            return Some(0);
        }
        if self.words == other.words {
            return None;
        }
        (0..self.words.len()).find(|&i| self.words.get(i) != other.words.get(i))
    }
}

/// Element size in bytes per dtype (kept here so the byte view never trusts a stride-less slice).
trait ItemSize {
    fn item_size_bytes(&self) -> usize;
}

impl ItemSize for Dtype {
    fn item_size_bytes(&self) -> usize {
        match self {
            Dtype::Bool | Dtype::Uint8 | Dtype::Int8 => 1,
            Dtype::Uint16 | Dtype::Int16 | Dtype::Float16 | Dtype::Bfloat16 => 2,
            Dtype::Uint32 | Dtype::Int32 | Dtype::Float32 => 4,
            Dtype::Uint64 | Dtype::Int64 | Dtype::Float64 | Dtype::Complex64 => 8,
        }
    }
}

/// Reads an evaluated array through its strides (element strides, as MLX reports them for views).
fn read_strided(a: &Array) -> Result<ArrayBytes, BytesError> {
    let dtype = a.dtype();
    let shape = a.shape().to_vec();
    let n = a.size();
    let dims: Vec<usize> = shape.iter().map(|&d| d.max(0) as usize).collect();
    let strides = a.strides().to_vec();
    if strides.len() != dims.len() {
        return Err(BytesError::NotContiguous { shape, strides });
    }
    // Row-major walk of the logical index space, one run of the innermost axis at a time (a plain copy when that
    // axis is dense, as it is for every K/V/Q/output view kvsim reads).
    let inner = dims.last().copied().unwrap_or(1);
    let inner_stride = strides.last().copied().unwrap_or(1);
    let outer_dims = &dims[..dims.len().saturating_sub(1)];
    let outer_strides = &strides[..strides.len().saturating_sub(1)];
    macro_rules! walk {
        ($f:ident, $t:ty, $v:ident) => {{
            if n == 0 {
                Words::$v(vec![])
            } else {
                // SAFETY: the array is evaluated; its data pointer is the start of this view inside a buffer MLX
                // keeps alive while `a` lives, and every offset is a valid element of the view (shape x strides).
                let p = unsafe { mlx_sys::$f(a.as_ptr()) };
                if p.is_null() {
                    return Err(BytesError::Mlx("null data pointer (array not evaluated?)".into()));
                }
                let mut out: Vec<$t> = Vec::with_capacity(n);
                let mut idx = vec![0usize; outer_dims.len()];
                for _ in 0..n / inner {
                    let base: usize = idx.iter().zip(outer_strides).map(|(i, s)| i * s).sum();
                    if inner_stride == 1 {
                        out.extend_from_slice(unsafe { std::slice::from_raw_parts(p.add(base), inner) });
                    } else {
                        out.extend((0..inner).map(|j| unsafe { *p.add(base + j * inner_stride) }));
                    }
                    for ax in (0..idx.len()).rev() {
                        idx[ax] += 1;
                        if idx[ax] < outer_dims[ax] {
                            break;
                        }
                        idx[ax] = 0;
                    }
                }
                Words::$v(out)
            }
        }};
    }
    let words = match dtype.item_size_bytes() {
        1 => walk!(mlx_array_data_uint8, u8, U8),
        2 => walk!(mlx_array_data_uint16, u16, U16),
        4 => walk!(mlx_array_data_uint32, u32, U32),
        8 => walk!(mlx_array_data_uint64, u64, U64),
        _ => return Err(BytesError::Unsupported(dtype)),
    };
    Ok(ArrayBytes { dtype, shape, words })
}

/// The same-width unsigned view of a contiguous array (lazy).
fn as_bits<T: mlx_rs::ArrayElement>(dense: &Array) -> Result<Array, BytesError> {
    Ok(if dense.dtype() == T::DTYPE { dense.clone() } else { dense.view::<T>()?.contiguous()? })
}

fn read<T: mlx_rs::ArrayElement + Copy>(dense: &Array) -> Result<Vec<T>, BytesError> {
    // Reinterpret the bits (no value conversion), then check the layout before borrowing the buffer.
    let bits = as_bits::<T>(dense)?;
    bits.eval()?;
    read_evaluated(&bits)
}

fn read_evaluated<T: mlx_rs::ArrayElement + Copy>(bits: &Array) -> Result<Vec<T>, BytesError> {
    if bits.size() == 0 {
        // Nothing to read (and `as_slice` refuses a null buffer).
        return Ok(vec![]);
    }
    let shape = bits.shape().to_vec();
    let strides = bits.strides().to_vec();
    let mut expect = 1usize;
    for (dim, stride) in shape.iter().zip(&strides).rev() {
        if *dim > 1 && *stride != expect {
            return Err(BytesError::NotContiguous { shape, strides });
        }
        expect *= (*dim).max(1) as usize;
    }
    let slice = bits.try_as_slice::<T>().map_err(|e| BytesError::Mlx(format!("{e:?}")))?;
    Ok(slice.to_vec())
}

/// True when `a` and `b` have the same dtype, shape and bits.
pub fn bit_equal(a: &Array, b: &Array) -> Result<bool, BytesError> {
    Ok(ArrayBytes::of(a)? == ArrayBytes::of(b)?)
}

/// Distance between two floating values of one dtype, counted in representable steps (ULPs): the MLX-dtype face
/// of kvsim's one ULP distance, [`kvsim_ulp::ulp_distance`] (same line, same rules: `+0.0` and `-0.0` are 1
/// apart, equal bits 0 apart, any NaN `u64::MAX`). A non-float dtype gives 0 for equal bits, else `u64::MAX`.
pub fn ulp_distance(dtype: Dtype, a: u64, b: u64) -> u64 {
    let format = match dtype {
        Dtype::Float32 => FloatFormat::F32,
        Dtype::Bfloat16 => FloatFormat::Bf16,
        Dtype::Float16 => FloatFormat::F16,
        Dtype::Float64 => FloatFormat::F64,
        _ => return if a == b { 0 } else { u64::MAX },
    };
    kvsim_ulp::ulp_distance(format, a, b)
}

/// Largest ULP distance between two arrays' elements (shape and dtype must match).
pub fn max_ulp(a: &ArrayBytes, b: &ArrayBytes) -> Option<u64> {
    if a.dtype != b.dtype || a.shape != b.shape {
        return None;
    }
    Some((0..a.words.len()).map(|i| ulp_distance(a.dtype, a.words.get(i), b.words.get(i))).max().unwrap_or(0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::ops::indexing::IndexOp;

    #[test]
    fn negative_zero_is_not_positive_zero() {
        let a = Array::from_slice(&[0.0f32, 1.0], &[2]);
        let b = Array::from_slice(&[-0.0f32, 1.0], &[2]);
        // Value equality (what `PartialEq`/allclose sees) says equal; bytes say different.
        assert!(!bit_equal(&a, &b).unwrap());
        let (x, y) = (ArrayBytes::of(&a).unwrap(), ArrayBytes::of(&b).unwrap());
        assert_eq!(x.first_difference(&y), Some(0));
        assert_eq!(max_ulp(&x, &y), Some(1));
    }

    #[test]
    fn nan_payloads_are_told_apart() {
        let q1 = f32::from_bits(0x7fc0_0001);
        let q2 = f32::from_bits(0x7fc0_0002);
        let a = Array::from_slice(&[q1], &[1]);
        let b = Array::from_slice(&[q2], &[1]);
        let c = Array::from_slice(&[q1], &[1]);
        assert!(!bit_equal(&a, &b).unwrap());
        assert!(bit_equal(&a, &c).unwrap());
        assert_eq!(max_ulp(&ArrayBytes::of(&a).unwrap(), &ArrayBytes::of(&c).unwrap()), Some(u64::MAX));
    }

    #[test]
    fn bf16_bits_are_read_as_u16() {
        let a = Array::from_slice(&[1.0f32, -2.5, 3.0e-3], &[3]).as_dtype(Dtype::Bfloat16).unwrap();
        let w = ArrayBytes::of(&a).unwrap();
        assert_eq!(w.words, Words::U16(vec![0x3f80, 0xc020, 0x3b45]));
        assert_eq!(Words::from_le(&w.words.le_bytes(), 2), Some(w.words.clone()));
        assert_eq!(Words::from_le(&[1, 2, 3], 2), None);
        assert_eq!(Words::from_le(&[1, 2, 3, 4], 4), Some(Words::U32(vec![0x0403_0201])));
    }

    #[test]
    fn strided_views_read_in_logical_order() {
        let data: Vec<f32> = (0..12).map(|x| x as f32).collect();
        let a = Array::from_slice(&data, &[3, 4]);
        let t = a.transpose().unwrap(); // [4, 3], strided
        assert_eq!(
            ArrayBytes::of(&t).unwrap().words,
            Words::U32([0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11].iter().map(|&x: &i32| (x as f32).to_bits()).collect())
        );
        let s = a.index((.., 1..3)); // [3, 2], a sliced view
        assert_eq!(
            ArrayBytes::of(&s).unwrap().words,
            Words::U32([1, 2, 5, 6, 9, 10].iter().map(|&x: &i32| (x as f32).to_bits()).collect())
        );
        // The strided host walk of `read_many` (no MLX copy) reads the same logical order: a transposed view (a
        // strided innermost axis), a column slice (dense runs at an offset), a scalar.
        let scalar = a.index((2, 3));
        let many = ArrayBytes::read_many(&[&t, &s, &scalar, &a]).unwrap();
        for (got, view) in many.iter().zip([&t, &s, &scalar, &a]) {
            assert_eq!(got, &ArrayBytes::of(view).unwrap());
        }
    }

    #[test]
    fn host_column_selection_equals_mlx_take() {
        use mlx_rs::ops::indexing::TryIndexOp;
        let data: Vec<f32> = (0..2 * 3 * 5 * 4).map(|x| x as f32 * 0.5 - 7.0).collect();
        let a = Array::from_slice(&data, &[2, 3, 5, 4]);
        let all = ArrayBytes::of(&a).unwrap();
        for (row, cols) in [(0usize, vec![4usize, 0, 2]), (1, vec![1, 2, 3]), (1, vec![]), (0, vec![3, 3])] {
            let at = Array::from_slice(&cols.iter().map(|&c| c as i32).collect::<Vec<_>>(), &[cols.len() as i32]);
            let mlx = a.try_index((row as i32..row as i32 + 1, .., .., ..)).unwrap().take_axis(&at, 2).unwrap();
            assert_eq!(all.select_columns(row, &cols).unwrap(), ArrayBytes::of(&mlx).unwrap(), "{row} {cols:?}");
        }
        assert!(matches!(all.select_columns(2, &[0]), Err(BytesError::Shape(_))));
        assert!(matches!(all.select_columns(0, &[5]), Err(BytesError::Shape(_))));
        let flat = ArrayBytes::of(&Array::from_slice(&[1.0f32], &[1])).unwrap();
        assert!(matches!(flat.select_columns(0, &[0]), Err(BytesError::Shape(_))));
    }

    /// Canaries: two arrays that differ only in their last element, their last row or their last byte must be told
    /// apart by every face of the byte view (`of`, `read_many`, `bit_equal`, `first_difference`, `digest`,
    /// `max_ulp`). A byte view weakened to read or compare a prefix fails here.
    #[test]
    fn the_last_element_row_and_byte_count() {
        let data: Vec<f32> = (0..12).map(|x| x as f32 * 0.5).collect();
        let mut last = data.clone();
        *last.last_mut().unwrap() = f32::from_bits(last[11].to_bits() + 1);
        let mut last_row = data.clone();
        last_row[8..].iter_mut().for_each(|x| *x = -*x - 1.0);
        let a = Array::from_slice(&data, &[3, 4]);
        for (other, first) in [(last, 11), (last_row, 8)] {
            let b = Array::from_slice(&other, &[3, 4]);
            assert!(!bit_equal(&a, &b).unwrap());
            let (x, y) = (ArrayBytes::of(&a).unwrap(), ArrayBytes::of(&b).unwrap());
            assert_ne!(x, y);
            assert_ne!(x.digest(), y.digest());
            assert_eq!(x.first_difference(&y), Some(first));
            assert!(max_ulp(&x, &y).unwrap() >= 1);
            let many = ArrayBytes::read_many(&[&a, &b]).unwrap();
            assert_eq!(many[0], x);
            assert_eq!(many[1], y);
            // Through strided views (transposed): the last logical element differs only where the data does.
            let (ta, tb) = (a.transpose().unwrap(), b.transpose().unwrap());
            let tv = ArrayBytes::read_many(&[&ta, &tb]).unwrap();
            assert_ne!(tv[0], tv[1]);
            assert_eq!(tv[0], ArrayBytes::of(&ta).unwrap());
            assert_eq!(tv[1], ArrayBytes::of(&tb).unwrap());
        }
        // The last byte of a u8 array, and the last bit of a bf16 array.
        let u = Array::from_slice(&[1u8, 2, 3, 4, 5, 6, 7], &[7]);
        let v = Array::from_slice(&[1u8, 2, 3, 4, 5, 6, 6], &[7]);
        assert!(!bit_equal(&u, &v).unwrap());
        assert_eq!(ArrayBytes::of(&u).unwrap().first_difference(&ArrayBytes::of(&v).unwrap()), Some(6));
        // bf16 values exactly representable: 1 + i/128, and the last one moved by one bf16 ULP (2^-7 at 1.0).
        let fa: Vec<f32> = (0..9).map(|i| 1.0 + i as f32 / 128.0).collect();
        let mut fb = fa.clone();
        fb[8] += 1.0 / 128.0;
        let ba = Array::from_slice(&fa, &[9]).as_dtype(Dtype::Bfloat16).unwrap();
        let bb = Array::from_slice(&fb, &[9]).as_dtype(Dtype::Bfloat16).unwrap();
        let (x, y) = (ArrayBytes::of(&ba).unwrap(), ArrayBytes::of(&bb).unwrap());
        assert_eq!(x.first_difference(&y), Some(8));
        assert_eq!(max_ulp(&x, &y), Some(1));
        // Same bits, another shape or dtype: different.
        let r = Array::from_slice(&data, &[4, 3]);
        assert!(!bit_equal(&a, &r).unwrap());
        let i = Array::from_slice(&data.iter().map(|x| x.to_bits() as i32).collect::<Vec<_>>(), &[3, 4]);
        assert!(!bit_equal(&a, &i).unwrap());
    }

    #[test]
    fn ulp_line_is_monotone() {
        let d = Dtype::Float32;
        let b = |x: f32| x.to_bits() as u64;
        assert_eq!(ulp_distance(d, b(1.0), b(1.0)), 0);
        assert_eq!(ulp_distance(d, b(1.0), b(f32::from_bits(1.0f32.to_bits() + 3))), 3);
        assert_eq!(ulp_distance(d, b(-f32::MIN_POSITIVE), b(f32::MIN_POSITIVE)), 2 * (1 << 23) + 1);
        let bf = Dtype::Bfloat16;
        assert_eq!(ulp_distance(bf, 0x3f80, 0x3f82), 2);
        assert_eq!(ulp_distance(bf, 0x8000, 0x0000), 1);
    }
}
