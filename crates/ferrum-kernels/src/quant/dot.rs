//! Scalar reference dot products: one weight row times one activation row quantized as
//! `vec_dot_type(weight)`. Integer sums are exact; the float operations follow ggml's generic C
//! (`ggml-cpu/quants.c ggml_vec_dot_*_generic`, `vec.c ggml_vec_dot_f16/_bf16/_f32` without SIMD).

use super::blocks::*;
use ferrum_core::DType;

/// Scalar dot product; lengths were checked by the caller.
pub(crate) fn vec_dot_ref(weight: DType, w: &[u8], a: &[u8]) -> f32 {
    match weight {
        DType::F32 => {
            // ggml scalar path: f32 products accumulated in double.
            let mut s = 0f64;
            for (x, y) in w.chunks_exact(4).zip(a.chunks_exact(4)) {
                s += (rd_f32(x, 0) * rd_f32(y, 0)) as f64;
            }
            s as f32
        }
        DType::F16 => {
            let mut s = 0f64;
            for (x, y) in w.chunks_exact(2).zip(a.chunks_exact(2)) {
                s += (rd_f16(x, 0) * rd_f16(y, 0)) as f64;
            }
            s as f32
        }
        DType::BF16 => {
            let mut s = 0f64;
            for (x, y) in w.chunks_exact(2).zip(a.chunks_exact(2)) {
                let x = bf16_bits_to_f32(u16::from_le_bytes([x[0], x[1]]));
                let y = bf16_bits_to_f32(u16::from_le_bytes([y[0], y[1]]));
                s += (x * y) as f64;
            }
            s as f32
        }
        DType::Q4_0 | DType::Q5_0 | DType::Q8_0 => dot_x_q8_0(weight, w, a),
        DType::Q4_1 | DType::Q5_1 => dot_x_q8_1(weight, w, a),
        DType::Q2_K => dot_q2k(w, a),
        DType::Q3_K | DType::Q6_K => dot_q3k_q6k(weight, w, a),
        DType::Q4_K | DType::Q5_K => dot_q4k_q5k(weight, w, a),
        DType::IQ4_NL => dot_iq4nl(w, a),
        DType::IQ4_XS => dot_iq4xs(w, a),
        DType::Q8_1 | DType::Q8_K => {
            panic!("vec_dot: {weight} is an activation-only type, not a weight type")
        }
        other => super::formats::format(other)
            .unwrap_or_else(|| panic!("vec_dot: no block format for {other}"))
            .dot(w, a),
    }
}

/// IQ4_NL x Q8_0: Σ (d_x d_w)·Σqq per block (`ggml_vec_dot_iq4_nl_q8_0_generic`).
fn dot_iq4nl(w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0f32;
    let mut q = [0i8; QK];
    for (bx, by) in w.chunks_exact(18).zip(a.chunks_exact(34)) {
        let d = rd_f16(by, 0) * rd_f16(bx, 0);
        unpack_iq4(&bx[IQ4_NL_QS..], &mut q);
        sumf += d * isum(&q, &by[Q8_0_QS..]) as f32;
    }
    sumf
}

/// IQ4_XS x Q8_K: per 32 elements (d_w d_x)(ls - 32)·Σqq (`ggml_vec_dot_iq4_xs_q8_K_generic`).
fn dot_iq4xs(w: &[u8], a: &[u8]) -> f32 {
    let mut sumf = 0f32;
    let mut q = [0i8; QK];
    for (bx, by) in w.chunks_exact(136).zip(a.chunks_exact(292)) {
        let d4d8 = rd_f16(bx, 0) * rd_f32(by, 0);
        let sc = iq4xs_scales(bx);
        for ib in 0..8 {
            unpack_iq4(&bx[IQ4_XS_QS + 16 * ib..], &mut q);
            let dl = d4d8 * sc[ib] as f32;
            sumf += dl * isum(&q, &by[Q8_K_QS + 32 * ib..]) as f32;
        }
    }
    sumf
}

/// Q3_K x Q8_K in the order of llama.cpp's tiled prompt matmul (its VNNI kernel): per
/// super-block the exact S = Σ_s (scale_s − 32)·Σ q·y over its 16-element sub-blocks,
/// `r = f32(S)·d`, `acc = fma(r, d_x, acc)`. (llama.cpp repacks Q2_K, Q4_K and Q5_K matrices on
/// x86 instead, whose orders are not the tiled kernel's.)
pub(crate) fn dot_q3k_tiled(w: &[u8], a: &[u8]) -> f32 {
    let mut q = [0i8; QK_K];
    let mut acc = 0f32;
    for (bx, by) in w.chunks_exact(110).zip(a.chunks_exact(292)) {
        unpack_q3k(bx, &mut q);
        let sc = q3k_scales(&bx[Q3_K_SCALES..Q3_K_SCALES + 12]);
        let y = &by[Q8_K_QS..Q8_K_QS + QK_K];
        let s: i32 = (0..QK_K)
            .map(|e| sc[e / 16] as i32 * (q[e] as i32 * y[e] as i8 as i32))
            .sum();
        acc = (s as f32 * rd_f16(bx, Q3_K_D)).mul_add(rd_f32(by, 0), acc);
    }
    acc
}

/// IQ4_XS x Q8_K in the order of llama.cpp's tiled prompt matmul: per super-block the exact
/// S = Σ_ib (ls − 32)·Σ q·y, `r = f32(S)·d_w`, `acc = fma(r, d_x, acc)`.
pub(crate) fn dot_iq4xs_tiled(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = 0f32;
    let mut q = [0i8; QK];
    for (bx, by) in w.chunks_exact(136).zip(a.chunks_exact(292)) {
        let sc = iq4xs_scales(bx);
        let mut s = 0i32;
        for ib in 0..8 {
            unpack_iq4(&bx[IQ4_XS_QS + 16 * ib..], &mut q);
            s += sc[ib] * isum(&q, &by[Q8_K_QS + 32 * ib..]);
        }
        acc = (s as f32 * rd_f16(bx, 0)).mul_add(rd_f32(by, 0), acc);
    }
    acc
}

/// Unpacks the 32 centred (Q4_0/Q5_0/Q8_0) or unsigned (Q4_1/Q5_1) weight values of one block.
#[inline(always)]
fn unpack_small(weight: DType, b: &[u8], q: &mut [i8; QK]) {
    match weight {
        DType::Q4_0 => unpack_q4(&b[Q4_0_QS..], 8, q),
        DType::Q4_1 => unpack_q4(&b[Q4_1_QS..], 0, q),
        DType::Q5_0 => unpack_q5(rd_u32(b, Q5_0_QH), &b[Q5_0_QS..], 16, q),
        DType::Q5_1 => unpack_q5(rd_u32(b, Q5_1_QH), &b[Q5_1_QS..], 0, q),
        DType::Q8_0 => {
            for (o, &v) in q.iter_mut().zip(&b[Q8_0_QS..Q8_0_QS + QK]) {
                *o = v as i8;
            }
        }
        _ => unreachable!(),
    }
}

#[inline(always)]
fn isum(q: &[i8; QK], y: &[u8]) -> i32 {
    q.iter()
        .zip(y)
        .map(|(&a, &b)| a as i32 * b as i8 as i32)
        .sum()
}

/// Q4_0/Q5_0/Q8_0 x Q8_0.
fn dot_x_q8_0(weight: DType, w: &[u8], a: &[u8]) -> f32 {
    let mut q = [0i8; QK];
    let mut sumf = 0f32;
    for (bx, by) in w.chunks_exact(weight.block_bytes()).zip(a.chunks_exact(34)) {
        unpack_small(weight, bx, &mut q);
        let sumi = isum(&q, &by[Q8_0_QS..]) as f32;
        let dx = rd_f16(bx, 0);
        let dy = rd_f16(by, 0);
        sumf += match weight {
            DType::Q4_0 => sumi * dx * dy,
            DType::Q5_0 => (dx * dy) * sumi,
            _ => sumi * (dx * dy),
        };
    }
    sumf
}

/// Q4_1 x Q8_1, Q5_0 / Q8_0 x Q8_0 in the block order of ferrum's packed AVX-512 kernels (see
/// [`super::vec_dot_blocks`]): per block the exact integer Σ q·y, then
/// `acc = fma(d_w·d_y, f32(Σ), acc)`; Q4_1 also `sm = fma(m_w, s_y, sm)` and the result
/// `acc + sm`.
pub(crate) fn dot_blocks(weight: DType, w: &[u8], a: &[u8]) -> f32 {
    let mut q = [0i8; QK];
    let (mut acc, mut sm) = (0f32, 0f32);
    let ab = if weight == DType::Q4_1 { 40 } else { 34 };
    for (bx, by) in w.chunks_exact(weight.block_bytes()).zip(a.chunks_exact(ab)) {
        unpack_small(weight, bx, &mut q);
        let qs = if weight == DType::Q4_1 {
            Q8_1_QS
        } else {
            Q8_0_QS
        };
        let s = isum(&q, &by[qs..]) as f32;
        acc = (rd_f16(bx, 0) * rd_f16(by, 0)).mul_add(s, acc);
        if weight == DType::Q4_1 {
            sm = rd_f16(bx, 2).mul_add(rd_f16(by, 2), sm);
        }
    }
    if weight == DType::Q4_1 {
        acc + sm
    } else {
        acc
    }
}

/// Q4_1/Q5_1 x Q8_1: Σ (d_w d_x) Σqq + m_w s_x.
fn dot_x_q8_1(weight: DType, w: &[u8], a: &[u8]) -> f32 {
    let mut q = [0i8; QK];
    let mut sumf = 0f32;
    for (bx, by) in w.chunks_exact(weight.block_bytes()).zip(a.chunks_exact(40)) {
        unpack_small(weight, bx, &mut q);
        let sumi = isum(&q, &by[Q8_1_QS..]) as f32;
        sumf += (rd_f16(bx, 0) * rd_f16(by, 0)) * sumi + rd_f16(bx, 2) * rd_f16(by, 2);
    }
    sumf
}

#[inline(always)]
fn q8k_qs(by: &[u8]) -> &[u8] {
    &by[Q8_K_QS..Q8_K_QS + QK_K]
}

#[inline(always)]
fn q8k_bsum(by: &[u8], g: usize) -> i32 {
    rd_i16(by, Q8_K_BSUMS + 2 * g) as i32
}

/// Q2_K x Q8_K.
fn dot_q2k(w: &[u8], a: &[u8]) -> f32 {
    let mut q = [0i8; QK_K];
    let mut sumf = 0f32;
    for (bx, by) in w.chunks_exact(84).zip(a.chunks_exact(292)) {
        unpack_q2k(bx, &mut q);
        let y = q8k_qs(by);
        let summs: i32 = (0..16).map(|g| q8k_bsum(by, g) * (bx[g] >> 4) as i32).sum();
        let dy = rd_f32(by, 0);
        let dall = dy * rd_f16(bx, Q2_K_D);
        let dmin = dy * rd_f16(bx, Q2_K_D + 2);
        let mut isum = 0i32;
        for g in 0..16 {
            let s: i32 = (16 * g..16 * g + 16)
                .map(|e| q[e] as i32 * y[e] as i8 as i32)
                .sum();
            isum += (bx[g] & 15) as i32 * s;
        }
        sumf += dall * isum as f32 - dmin * summs as f32;
    }
    sumf
}

/// Q3_K/Q6_K x Q8_K: scale per 16 elements, eight integer lanes (element index mod 8) per
/// super-block, lane sums scaled and accumulated in eight f32 lanes, summed at the end.
fn dot_q3k_q6k(weight: DType, w: &[u8], a: &[u8]) -> f32 {
    let mut q = [0i8; QK_K];
    let mut sums = [0f32; 8];
    for (bx, by) in w
        .chunks_exact(weight.block_bytes())
        .zip(a.chunks_exact(292))
    {
        let (sc, dx) = if weight == DType::Q3_K {
            unpack_q3k(bx, &mut q);
            (
                q3k_scales(&bx[Q3_K_SCALES..Q3_K_SCALES + 12]),
                rd_f16(bx, Q3_K_D),
            )
        } else {
            unpack_q6k(bx, &mut q);
            (q6k_scales(bx), rd_f16(bx, Q6_K_D))
        };
        let y = q8k_qs(by);
        let mut aux = [0i32; 8];
        for e in 0..QK_K {
            aux[e % 8] += sc[e / 16] as i32 * (q[e] as i32 * y[e] as i8 as i32);
        }
        let d = dx * rd_f32(by, 0);
        for l in 0..8 {
            sums[l] += d * aux[l] as f32;
        }
    }
    sums.iter().fold(0f32, |s, &v| s + v)
}

/// Q4_K/Q5_K x Q8_K: as Q3_K/Q6_K with a scale per 32, minus dmin-terms accumulated first.
fn dot_q4k_q5k(weight: DType, w: &[u8], a: &[u8]) -> f32 {
    let mut q = [0i8; QK_K];
    let mut sums = [0f32; 8];
    let mut sumf = 0f32;
    for (bx, by) in w
        .chunks_exact(weight.block_bytes())
        .zip(a.chunks_exact(292))
    {
        if weight == DType::Q4_K {
            unpack_q4k(bx, &mut q);
        } else {
            unpack_q5k(bx, &mut q);
        }
        let (sc, m) = scale_min_k4(&bx[Q4_K_SCALES..Q4_K_SCALES + 12]);
        let y = q8k_qs(by);
        let sumi: i32 = (0..16).map(|g| q8k_bsum(by, g) * m[g / 2] as i32).sum();
        let mut aux = [0i32; 8];
        for e in 0..QK_K {
            aux[e % 8] += sc[e / 32] as i32 * (q[e] as i32 * y[e] as i8 as i32);
        }
        let dy = rd_f32(by, 0);
        let d = rd_f16(bx, 0) * dy;
        for l in 0..8 {
            sums[l] += d * aux[l] as f32;
        }
        let dmin = rd_f16(bx, 2) * dy;
        sumf -= dmin * sumi as f32;
    }
    sums.iter().fold(sumf, |s, &v| s + v)
}

/// Q4_K x Q8_K in the float order of llama.cpp's repacked kernel (`ggml_gemv_q4_K_8x8_q8_K`,
/// x86), which ggml uses for Q4_K matrices whose row count is a multiple of 8: per super-block
/// the exact integer sums Σ_sub scale·Σ q·y and Σ_sub min·bsums are converted to f32 and
/// accumulated separately, `acc = fma(isum, d_w·d_x, acc)`, `acc_m = fma(imin, dmin_w·d_x,
/// acc_m)`, and the result is `acc − acc_m`.
pub(crate) fn dot_q4k_x8(w: &[u8], a: &[u8]) -> f32 {
    let mut q = [0i8; QK_K];
    let (mut acc, mut acc_m) = (0f32, 0f32);
    for (bx, by) in w.chunks_exact(144).zip(a.chunks_exact(292)) {
        unpack_q4k(bx, &mut q);
        let (sc, m) = scale_min_k4(&bx[Q4_K_SCALES..Q4_K_SCALES + 12]);
        let y = q8k_qs(by);
        let isum: i32 = (0..QK_K)
            .map(|e| sc[e / 32] as i32 * (q[e] as i32 * y[e] as i8 as i32))
            .sum();
        let imin: i32 = (0..16).map(|g| q8k_bsum(by, g) * m[g / 2] as i32).sum();
        let dy = rd_f32(by, 0);
        acc = (isum as f32).mul_add(rd_f16(bx, 0) * dy, acc);
        acc_m = (imin as f32).mul_add(rd_f16(bx, 2) * dy, acc_m);
    }
    acc - acc_m
}

/// Q4_K x Q8_K in the float order of llama.cpp's repacked 8x8 GEMM (`ggml_gemm_q4_K_8x8_q8_K`,
/// x86), its prefill path: per super-block `dd = d_w·d_x`, `dm = dmin_w·d_x` (rounded f32), then
/// for each 64-element chunk p (sub-blocks 2p, 2p+1) the exact integer sums
/// I_p = Σ_sub scale·Σ q·y and M_p = Σ_sub min·(bsums pair) go to `acc = fma(I_p, dd, acc)` and
/// `acc_m = fma(M_p, dm, acc_m)`; the result is `acc − acc_m`.
pub(crate) fn dot_q4k_gemm(w: &[u8], a: &[u8]) -> f32 {
    let mut q = [0i8; QK_K];
    let (mut acc, mut acc_m) = (0f32, 0f32);
    for (bx, by) in w.chunks_exact(144).zip(a.chunks_exact(292)) {
        unpack_q4k(bx, &mut q);
        let (sc, m) = scale_min_k4(&bx[Q4_K_SCALES..Q4_K_SCALES + 12]);
        let y = q8k_qs(by);
        let dy = rd_f32(by, 0);
        let dd = rd_f16(bx, 0) * dy;
        let dm = rd_f16(bx, 2) * dy;
        for p in 0..4 {
            let ip: i32 = (64 * p..64 * p + 64)
                .map(|e| sc[e / 32] as i32 * (q[e] as i32 * y[e] as i8 as i32))
                .sum();
            let mp = m[2 * p] as i32 * (q8k_bsum(by, 4 * p) + q8k_bsum(by, 4 * p + 1))
                + m[2 * p + 1] as i32 * (q8k_bsum(by, 4 * p + 2) + q8k_bsum(by, 4 * p + 3));
            acc = (ip as f32).mul_add(dd, acc);
            acc_m = (mp as f32).mul_add(dm, acc_m);
        }
    }
    acc - acc_m
}

/// Q6_K x Q8_K in the float order of llama.cpp's tiled VNNI matmul (`tiled_run_micro_vnni_8x16`,
/// its Q6_K prefill path): per super-block the exact integer sum S = Σ_sub scale·Σ (q−32)·y is
/// scaled `r = f32(S)·d_w` (rounded), then `acc = fma(r, d_x, acc)`.
pub(crate) fn dot_q6k_tiled(w: &[u8], a: &[u8]) -> f32 {
    let mut q = [0i8; QK_K];
    let mut acc = 0f32;
    for (bx, by) in w.chunks_exact(210).zip(a.chunks_exact(292)) {
        unpack_q6k(bx, &mut q);
        let sc = q6k_scales(bx);
        let y = q8k_qs(by);
        let s: i32 = (0..QK_K)
            .map(|e| sc[e / 16] as i32 * (q[e] as i32 * y[e] as i8 as i32))
            .sum();
        let r = s as f32 * rd_f16(bx, Q6_K_D);
        acc = r.mul_add(rd_f32(by, 0), acc);
    }
    acc
}
