//! MXFP4 (OCP microscaling FP4, as gpt-oss ships its experts): 32 weights as FP4 E2M1 codes
//! with one shared E8M0 (power of two) scale.
//!
//! Layout: `e: u8` (the exponent), `qs: [u8; 16]`: weight j in the low nibble of byte j,
//! weight j + 16 in its high nibble. ggml keeps the E2M1 values doubled (`kvalues_mxfp4`, integers)
//! and halves the scale instead.

use super::BlockFormat;
use crate::quant::blocks::{rd_f16, Q8_0_QS};
use crate::quant::dot_lanes::{fma_lanes, hsum8};
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
    /// `ggml_vec_dot_mxfp4_q8_0`, AVX2 (IQ4_NL's shape): blocks in pairs, the even one into
    /// `acc1` and the odd into `acc2`, `acc = fma(d_x·scale, f32(lanes), acc)` with lane t the
    /// elements 4t..4t+3; `hsum8(acc1 + acc2)`; a last unpaired block is added as a scalar,
    /// multiply then add.
    fn dot_x86(&self, w: &[u8], a: &[u8]) -> f32 {
        let nb = w.len() / 17;
        let block = |ib: usize| {
            let (bx, by) = (&w[17 * ib..17 * ib + 17], &a[34 * ib..34 * ib + 34]);
            let mut lanes = [0i32; 8];
            for j in 0..16 {
                let (lo, hi) = (bx[1 + j] & 0xf, bx[1 + j] >> 4);
                lanes[j / 4] += KVALUES[lo as usize] as i32 * by[Q8_0_QS + j] as i8 as i32;
                lanes[4 + j / 4] += KVALUES[hi as usize] as i32 * by[Q8_0_QS + 16 + j] as i8 as i32;
            }
            (rd_f16(by, 0) * e8m0_half(bx[0]), lanes)
        };
        let (mut acc1, mut acc2) = ([0f32; 8], [0f32; 8]);
        let mut ib = 0;
        while ib + 1 < nb {
            let (d, s) = block(ib);
            fma_lanes(&mut acc1, d, &s);
            let (d, s) = block(ib + 1);
            fma_lanes(&mut acc2, d, &s);
            ib += 2;
        }
        let sum: [f32; 8] = std::array::from_fn(|l| acc1[l] + acc2[l]);
        let mut sumf = hsum8(&sum);
        if ib < nb {
            let (d, s) = block(ib);
            sumf += d * s.iter().sum::<i32>() as f32;
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
