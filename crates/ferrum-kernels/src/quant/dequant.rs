//! Scalar dequantization of every block type, with the f32 operations in the order of ggml's
//! `dequantize_row_*` (so results are bit-identical to ggml and to `gguf.quants.dequantize`).

use super::blocks::*;
use ferrum_core::DType;

/// Dequantizes whole rows; lengths were checked by the caller.
pub(crate) fn dequantize(dtype: DType, src: &[u8], dst: &mut [f32]) {
    match dtype {
        DType::F32 => {
            for (o, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *o = rd_f32(c, 0);
            }
        }
        DType::F16 => {
            for (o, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *o = rd_f16(c, 0);
            }
        }
        DType::BF16 => {
            for (o, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *o = bf16_bits_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        DType::Q4_0 => small(dtype, src, dst, |b, q| {
            unpack_q4(&b[Q4_0_QS..], 8, q);
            (rd_f16(b, 0), None)
        }),
        DType::Q4_1 => small(dtype, src, dst, |b, q| {
            unpack_q4(&b[Q4_1_QS..], 0, q);
            (rd_f16(b, 0), Some(rd_f16(b, 2)))
        }),
        DType::Q5_0 => small(dtype, src, dst, |b, q| {
            unpack_q5(rd_u32(b, Q5_0_QH), &b[Q5_0_QS..], 16, q);
            (rd_f16(b, 0), None)
        }),
        DType::Q5_1 => small(dtype, src, dst, |b, q| {
            unpack_q5(rd_u32(b, Q5_1_QH), &b[Q5_1_QS..], 0, q);
            (rd_f16(b, 0), Some(rd_f16(b, 2)))
        }),
        DType::IQ4_NL => {
            let mut q = [0i8; QK];
            for (b, y) in blocks(dtype, src, dst) {
                unpack_iq4(&b[IQ4_NL_QS..], &mut q);
                let d = rd_f16(b, 0);
                for (o, &v) in y.iter_mut().zip(&q) {
                    *o = d * v as f32;
                }
            }
        }
        DType::IQ4_XS => {
            let mut q = [0i8; QK];
            for (b, y) in blocks(dtype, src, dst) {
                let d = rd_f16(b, 0);
                let sc = iq4xs_scales(b);
                for ib in 0..8 {
                    unpack_iq4(&b[IQ4_XS_QS + 16 * ib..], &mut q);
                    let dl = d * sc[ib] as f32;
                    for (o, &v) in y[32 * ib..32 * ib + 32].iter_mut().zip(&q) {
                        *o = dl * v as f32;
                    }
                }
            }
        }
        DType::Q8_0 | DType::Q8_1 => {
            let qs_off = if dtype == DType::Q8_0 {
                Q8_0_QS
            } else {
                Q8_1_QS
            };
            small(dtype, src, dst, |b, q| {
                for (o, &v) in q.iter_mut().zip(&b[qs_off..qs_off + QK]) {
                    *o = v as i8;
                }
                (rd_f16(b, 0), None)
            })
        }
        DType::Q2_K => {
            let mut q = [0i8; QK_K];
            for (b, y) in blocks(dtype, src, dst) {
                unpack_q2k(b, &mut q);
                let d = rd_f16(b, Q2_K_D);
                let dmin = rd_f16(b, Q2_K_D + 2);
                for g in 0..16 {
                    let sc = b[g];
                    let dl = d * (sc & 15) as f32;
                    let ml = dmin * (sc >> 4) as f32;
                    for e in 16 * g..16 * g + 16 {
                        y[e] = dl * q[e] as f32 - ml;
                    }
                }
            }
        }
        DType::Q3_K => {
            let mut q = [0i8; QK_K];
            for (b, y) in blocks(dtype, src, dst) {
                unpack_q3k(b, &mut q);
                let d = rd_f16(b, Q3_K_D);
                let sc = q3k_scales(&b[Q3_K_SCALES..Q3_K_SCALES + 12]);
                for g in 0..16 {
                    let dl = d * sc[g] as f32;
                    for e in 16 * g..16 * g + 16 {
                        y[e] = dl * q[e] as f32;
                    }
                }
            }
        }
        DType::Q4_K | DType::Q5_K => {
            let mut q = [0i8; QK_K];
            for (b, y) in blocks(dtype, src, dst) {
                if dtype == DType::Q4_K {
                    unpack_q4k(b, &mut q);
                } else {
                    unpack_q5k(b, &mut q);
                }
                let d = rd_f16(b, 0);
                let dmin = rd_f16(b, 2);
                let (sc, m) = scale_min_k4(&b[Q4_K_SCALES..Q4_K_SCALES + 12]);
                for j in 0..8 {
                    let d1 = d * sc[j] as f32;
                    let m1 = dmin * m[j] as f32;
                    for e in 32 * j..32 * j + 32 {
                        y[e] = d1 * q[e] as f32 - m1;
                    }
                }
            }
        }
        DType::Q6_K => {
            let mut q = [0i8; QK_K];
            for (b, y) in blocks(dtype, src, dst) {
                unpack_q6k(b, &mut q);
                let d = rd_f16(b, Q6_K_D);
                let sc = q6k_scales(b);
                for g in 0..16 {
                    let dl = d * sc[g] as f32;
                    for e in 16 * g..16 * g + 16 {
                        y[e] = dl * q[e] as f32;
                    }
                }
            }
        }
        DType::Q8_K => {
            for (b, y) in blocks(dtype, src, dst) {
                let d = rd_f32(b, 0);
                for (o, &v) in y.iter_mut().zip(&b[Q8_K_QS..Q8_K_QS + QK_K]) {
                    *o = d * (v as i8) as f32;
                }
            }
        }
        other => {
            let format = super::formats::format(other)
                .unwrap_or_else(|| panic!("dequantize_row: no block format for {other}"));
            for (b, y) in blocks(dtype, src, dst) {
                format.dequantize(b, y);
            }
        }
    }
}

/// Pairs each block of `src` with its `block_size` outputs.
fn blocks<'a>(
    dtype: DType,
    src: &'a [u8],
    dst: &'a mut [f32],
) -> impl Iterator<Item = (&'a [u8], &'a mut [f32])> {
    src.chunks_exact(dtype.block_bytes())
        .zip(dst.chunks_exact_mut(dtype.block_size()))
}

/// 32-element block types: `unpack` yields the integer values plus (d, optional m);
/// output is q*d, or q*d + m.
#[inline(always)]
fn small(
    dtype: DType,
    src: &[u8],
    dst: &mut [f32],
    unpack: impl Fn(&[u8], &mut [i8; QK]) -> (f32, Option<f32>),
) {
    let mut q = [0i8; QK];
    for (b, y) in blocks(dtype, src, dst) {
        let (d, m) = unpack(b, &mut q);
        match m {
            None => {
                for (o, &v) in y.iter_mut().zip(&q) {
                    *o = v as f32 * d;
                }
            }
            Some(m) => {
                for (o, &v) in y.iter_mut().zip(&q) {
                    *o = v as f32 * d + m;
                }
            }
        }
    }
}
