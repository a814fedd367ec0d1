//! kvsim's one ULP distance: how many representable values lie between two floating-point bit patterns of one
//! format. The reference model measures its f64 expectations with it and the caches' byte views measure arrays
//! with it, so both report distances on the same line.

/// A binary floating-point storage format, by bit layout (sign, exponent, mantissa), for [`ulp_distance`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FloatFormat {
    /// IEEE 754 binary16.
    F16,
    /// bfloat16 (the upper half of an f32).
    Bf16,
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary64.
    F64,
}

impl FloatFormat {
    fn width(self) -> u32 {
        match self {
            FloatFormat::F16 | FloatFormat::Bf16 => 16,
            FloatFormat::F32 => 32,
            FloatFormat::F64 => 64,
        }
    }

    /// The bits of +infinity (all exponent bits set, mantissa 0).
    fn infinity_bits(self) -> u64 {
        match self {
            FloatFormat::F16 => 0x7c00,
            FloatFormat::Bf16 => 0x7f80,
            FloatFormat::F32 => 0x7f80_0000,
            FloatFormat::F64 => 0x7ff0_0000_0000_0000,
        }
    }
}

/// Distance between two values of one format (storage bits in the low bits of `a`, `b`), counted in representable
/// steps (ULPs).
///
/// Guarantees: bits are mapped to a monotone integer line (sign-magnitude to two's complement), so the distance is
/// `0` exactly when the bits are equal, symmetric, and additive along the line; `+0` and `-0` are 1 apart (they are
/// different bytes) and a distance across zero counts that step; any NaN gives `u64::MAX`; bits above the format's
/// width are ignored.
///
/// ```
/// use kvsim_ulp::{ulp_distance, FloatFormat};
/// assert_eq!(ulp_distance(FloatFormat::F32, 1.0f32.to_bits() as u64, 1.0f32.to_bits() as u64 + 3), 3);
/// assert_eq!(ulp_distance(FloatFormat::Bf16, 0x8000, 0x0000), 1); // -0 and +0
/// assert_eq!(ulp_distance(FloatFormat::F32, 0x7fc0_0000, 0), u64::MAX); // NaN
/// ```
pub fn ulp_distance(format: FloatFormat, a: u64, b: u64) -> u64 {
    let sign = 1u64 << (format.width() - 1);
    let magnitude = sign - 1;
    let nan = |x: u64| x & magnitude > format.infinity_bits();
    if nan(a) || nan(b) {
        return u64::MAX;
    }
    let line = |x: u64| -> i128 {
        let m = (x & magnitude) as i128;
        if x & sign != 0 {
            -m - 1
        } else {
            m
        }
    };
    line(a).abs_diff(line(b)).min(u64::MAX as u128) as u64
}
