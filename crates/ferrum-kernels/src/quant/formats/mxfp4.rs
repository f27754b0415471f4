//! MXFP4 (OCP microscaling FP4, as gpt-oss ships its experts): 32 weights as FP4 E2M1 codes
//! with one shared E8M0 (power of two) scale.
//!
//! Layout: `e: u8` (the exponent), `qs: [u8; 16]`: weight j in the low nibble of byte j,
//! weight j + 16 in its high nibble. ggml keeps the E2M1 values doubled (`kvalues_mxfp4`, integers)
//! and halves the scale instead.

use super::BlockFormat;
use crate::quant::blocks::{rd_f16, Q8_0_QS};
use ferrum_core::DType;

pub(crate) struct Mxfp4;

/// E2M1 values times two (`kvalues_mxfp4`).
const KVALUES: [i8; 16] = [0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12];

/// Half of 2^(e - 127) as an f32 (`GGML_E8M0_TO_FP32_HALF`): exact for every e (e < 2 gives
/// subnormals).
#[inline(always)]
fn e8m0_half(e: u8) -> f32 {
    let bits = if e < 2 {
        0x0020_0000u32 << e
    } else {
        (e as u32 - 1) << 23
    };
    f32::from_bits(bits)
}

impl BlockFormat for Mxfp4 {
    fn dtype(&self) -> DType {
        DType::MXFP4
    }
    fn dot_type(&self) -> DType {
        DType::Q8_0
    }
    fn dequantize(&self, b: &[u8], y: &mut [f32]) {
        let d = e8m0_half(b[0]);
        for j in 0..16 {
            y[j] = KVALUES[(b[1 + j] & 0xf) as usize] as f32 * d;
            y[j + 16] = KVALUES[(b[1 + j] >> 4) as usize] as f32 * d;
        }
    }
    fn dot(&self, w: &[u8], a: &[u8]) -> f32 {
        let mut sumf = 0f32;
        for (bx, by) in w.chunks_exact(17).zip(a.chunks_exact(34)) {
            let d = rd_f16(by, 0) * e8m0_half(bx[0]);
            let q8 = &by[Q8_0_QS..];
            let (mut s1, mut s2) = (0i32, 0i32);
            for j in 0..16 {
                s1 += q8[j] as i8 as i32 * KVALUES[(bx[1 + j] & 0xf) as usize] as i32;
                s2 += q8[j + 16] as i8 as i32 * KVALUES[(bx[1 + j] >> 4) as usize] as i32;
            }
            sumf += d * (s1 + s2) as f32;
        }
        sumf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e8m0_half_is_half_a_power_of_two() {
        for e in 0..=255u8 {
            let want = 2f64.powi(e as i32 - 127) / 2.0;
            assert_eq!(e8m0_half(e) as f64, want, "e = {e}");
        }
    }
}
