//! [`HostTensor`]: a typed tensor on the host (dtype, shape, little-endian bytes), the unit both file formats store.
//! Conversion to and from MLX arrays goes through [`kvsim_cache::bytes::ArrayBytes`], so a round trip is bit-exact.

use half::{bf16, f16};
use mlx_rs::{Array, Dtype};
use serde::{Deserialize, Serialize};

use super::error::{PersistError, Result};
use kvsim_cache::bytes::ArrayBytes;

/// The element types a cache file may hold (the names are safetensors' dtype strings).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[allow(clippy::upper_case_acronyms)]
pub enum TensorDtype {
    BOOL,
    U8,
    U32,
    I32,
    F16,
    BF16,
    F32,
}

impl TensorDtype {
    /// Bytes per element.
    pub fn itemsize(self) -> usize {
        match self {
            TensorDtype::BOOL | TensorDtype::U8 => 1,
            TensorDtype::F16 | TensorDtype::BF16 => 2,
            TensorDtype::U32 | TensorDtype::I32 | TensorDtype::F32 => 4,
        }
    }

    /// The safetensors name (`"BF16"`, ...).
    pub fn name(self) -> &'static str {
        match self {
            TensorDtype::BOOL => "BOOL",
            TensorDtype::U8 => "U8",
            TensorDtype::U32 => "U32",
            TensorDtype::I32 => "I32",
            TensorDtype::F16 => "F16",
            TensorDtype::BF16 => "BF16",
            TensorDtype::F32 => "F32",
        }
    }

    /// From MLX (`None` for a dtype no cache file holds).
    pub fn from_mlx(d: Dtype) -> Option<Self> {
        Some(match d {
            Dtype::Bool => TensorDtype::BOOL,
            Dtype::Uint8 => TensorDtype::U8,
            Dtype::Uint32 => TensorDtype::U32,
            Dtype::Int32 => TensorDtype::I32,
            Dtype::Float16 => TensorDtype::F16,
            Dtype::Bfloat16 => TensorDtype::BF16,
            Dtype::Float32 => TensorDtype::F32,
            _ => return None,
        })
    }

    pub fn to_mlx(self) -> Dtype {
        match self {
            TensorDtype::BOOL => Dtype::Bool,
            TensorDtype::U8 => Dtype::Uint8,
            TensorDtype::U32 => Dtype::Uint32,
            TensorDtype::I32 => Dtype::Int32,
            TensorDtype::F16 => Dtype::Float16,
            TensorDtype::BF16 => Dtype::Bfloat16,
            TensorDtype::F32 => Dtype::Float32,
        }
    }

    /// From safetensors (`None` for dtypes kvsim does not read: F64, I64, F8, ...).
    pub fn from_safetensors(d: safetensors::Dtype) -> Option<Self> {
        use safetensors::Dtype as S;
        Some(match d {
            S::BOOL => TensorDtype::BOOL,
            S::U8 => TensorDtype::U8,
            S::U32 => TensorDtype::U32,
            S::I32 => TensorDtype::I32,
            S::F16 => TensorDtype::F16,
            S::BF16 => TensorDtype::BF16,
            S::F32 => TensorDtype::F32,
            _ => return None,
        })
    }

    pub fn to_safetensors(self) -> safetensors::Dtype {
        use safetensors::Dtype as S;
        match self {
            TensorDtype::BOOL => S::BOOL,
            TensorDtype::U8 => S::U8,
            TensorDtype::U32 => S::U32,
            TensorDtype::I32 => S::I32,
            TensorDtype::F16 => S::F16,
            TensorDtype::BF16 => S::BF16,
            TensorDtype::F32 => S::F32,
        }
    }
}

impl std::fmt::Display for TensorDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A tensor on the host: `data` holds `product(shape) * itemsize` bytes, elements in row-major order, little endian.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostTensor {
    pub dtype: TensorDtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

/// `product(shape) * itemsize`, or `None` on overflow.
pub(crate) fn nbytes_of(dtype: TensorDtype, shape: &[usize]) -> Option<usize> {
    shape.iter().try_fold(dtype.itemsize(), |acc, &d| acc.checked_mul(d))
}

impl HostTensor {
    /// A tensor whose byte count matches its shape, else [`PersistError::Shape`].
    pub fn new(name: &str, dtype: TensorDtype, shape: Vec<usize>, data: Vec<u8>) -> Result<Self> {
        let want = nbytes_of(dtype, &shape).ok_or_else(|| PersistError::shape(name, "shape overflows"))?;
        if want != data.len() {
            return Err(PersistError::shape(
                name,
                format!("{} bytes for shape {shape:?} of {dtype}, expected {want}", data.len()),
            ));
        }
        if shape.iter().any(|&d| i32::try_from(d).is_err()) {
            return Err(PersistError::shape(name, format!("dimension of {shape:?} exceeds i32")));
        }
        Ok(HostTensor { dtype, shape, data })
    }

    /// A 0-d int32 scalar.
    pub fn scalar_i32(v: i32) -> Self {
        HostTensor { dtype: TensorDtype::I32, shape: vec![], data: v.to_le_bytes().to_vec() }
    }

    /// An int32 vector.
    pub fn vec_i32(v: &[i32]) -> Self {
        HostTensor {
            dtype: TensorDtype::I32,
            shape: vec![v.len()],
            data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The elements as i64 (integer and bool dtypes only).
    pub fn to_i64s(&self, name: &str) -> Result<Vec<i64>> {
        let c = &self.data;
        Ok(match self.dtype {
            TensorDtype::I32 => {
                c.chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64).collect()
            }
            TensorDtype::U32 => {
                c.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as i64).collect()
            }
            TensorDtype::U8 | TensorDtype::BOOL => c.iter().map(|&b| b as i64).collect(),
            d => {
                return Err(PersistError::Dtype {
                    name: name.into(),
                    expected: "an integer dtype".into(),
                    found: d.to_string(),
                })
            }
        })
    }

    /// The elements as f64 (float dtypes only).
    pub fn to_f64s(&self, name: &str) -> Result<Vec<f64>> {
        let c = &self.data;
        Ok(match self.dtype {
            TensorDtype::F32 => {
                c.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) as f64).collect()
            }
            TensorDtype::BF16 => c.chunks_exact(2).map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f64()).collect(),
            TensorDtype::F16 => c.chunks_exact(2).map(|b| f16::from_le_bytes([b[0], b[1]]).to_f64()).collect(),
            d => {
                return Err(PersistError::Dtype {
                    name: name.into(),
                    expected: "a float dtype".into(),
                    found: d.to_string(),
                })
            }
        })
    }

    /// Reads an MLX array (evaluating it) bit for bit.
    pub fn from_array(a: &Array) -> Result<Self> {
        let dtype = TensorDtype::from_mlx(a.dtype())
            .ok_or_else(|| PersistError::unsupported(format!("arrays of dtype {:?} are not persisted", a.dtype())))?;
        let b = ArrayBytes::of(a)?;
        let shape = b.shape.iter().map(|&d| d.max(0) as usize).collect();
        Ok(HostTensor { dtype, shape, data: b.words.le_bytes() })
    }

    /// The MLX array holding exactly these bits.
    pub fn to_array(&self) -> Result<Array> {
        let shape: Vec<i32> = self.shape.iter().map(|&d| d as i32).collect();
        let c = &self.data;
        let a = match self.dtype {
            TensorDtype::BOOL => Array::from_slice(&c.iter().map(|&b| b != 0).collect::<Vec<bool>>(), &shape),
            TensorDtype::U8 => Array::from_slice(c, &shape),
            TensorDtype::U32 => Array::from_slice(
                &c.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect::<Vec<_>>(),
                &shape,
            ),
            TensorDtype::I32 => Array::from_slice(
                &c.chunks_exact(4).map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect::<Vec<_>>(),
                &shape,
            ),
            TensorDtype::F32 => Array::from_slice(
                &c.chunks_exact(4)
                    .map(|b| f32::from_bits(u32::from_le_bytes([b[0], b[1], b[2], b[3]])))
                    .collect::<Vec<_>>(),
                &shape,
            ),
            TensorDtype::BF16 => Array::from_slice(
                &c.chunks_exact(2).map(|b| bf16::from_bits(u16::from_le_bytes([b[0], b[1]]))).collect::<Vec<_>>(),
                &shape,
            ),
            TensorDtype::F16 => Array::from_slice(
                &c.chunks_exact(2).map(|b| f16::from_bits(u16::from_le_bytes([b[0], b[1]]))).collect::<Vec<_>>(),
                &shape,
            ),
        };
        Ok(a)
    }

    /// Columns `[start, end)` along axis 2 of a 4-D tensor (a host copy).
    pub fn cols(&self, name: &str, start: usize, end: usize) -> Result<Self> {
        let [b, h, c, d] = self.dims4(name)?;
        if start > end || end > c {
            return Err(PersistError::shape(name, format!("columns [{start}, {end}) of a buffer of {c}")));
        }
        let item = self.dtype.itemsize();
        let row = d * item;
        let mut out = Vec::with_capacity(b * h * (end - start) * row);
        for bh in 0..b * h {
            let base = bh * c * row;
            out.extend_from_slice(&self.data[base + start * row..base + end * row]);
        }
        Ok(HostTensor { dtype: self.dtype, shape: vec![b, h, end - start, d], data: out })
    }

    /// The four dims of a `[B, H, C, D]` tensor, else [`PersistError::Shape`].
    pub fn dims4(&self, name: &str) -> Result<[usize; 4]> {
        match self.shape[..] {
            [b, h, c, d] => Ok([b, h, c, d]),
            _ => Err(PersistError::shape(name, format!("expected 4 dimensions [B, H, L, D], found {:?}", self.shape))),
        }
    }
}
