//! Portable dot products in the float order of the x86 AVX2 kernels (`dot_avx2`, `dot_avx2_k`),
//! and so of llama.cpp's x86 AVX2 build, bit for bit on any CPU.
//!
//! Plain Rust: the 8 f32 lanes of a `__m256` are a `[f32; 8]`, every `_mm256_fmadd_ps` is an
//! [`f32::mul_add`] per lane (correctly rounded, like FMA), every plain vector add or multiply a
//! plain one, and each horizontal reduction is spelled out in the AVX2 kernel's order. Integer
//! partial sums are exact, so only their lane assignment matters, not the order they are formed
//! in: lane t of a 32-byte product (`maddubs` then `madd` against ones or a scale) holds the
//! elements whose index within the 32 is 4t..4t+3. The loops use fixed-size arrays so the
//! compiler can vectorise them; this is the path of every CPU without AVX2 (and of
//! `FERRUM_FORCE_SCALAR=1`). Where the target has no FMA instruction (baseline x86_64 builds),
//! `mul_add` is a correctly rounded libm call: the same bits, more slowly.

use super::blocks::*;
use ferrum_core::DType;
use half::f16;
use half::slice::HalfFloatSliceExt;

/// Dot product in the AVX2 kernels' float order (for the block formats of `formats`, their own
/// portable version of it), or `None` for a type with none (activation-only types). Lengths were checked by the caller.
pub(crate) fn vec_dot(weight: DType, w: &[u8], a: &[u8], n: usize) -> Option<f32> {
    // `f32::mul_add` is one instruction where the hardware has FMA; a build for plain x86_64
    // would otherwise call libm's `fmaf` (the same, exactly rounded, result, several times
    // slower). The code and its results are the same either way, so the hardware's feature is
    // asked for, not the process's kernel tier (`FERRUM_FORCE_SCALAR` runs this same code).
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::hardware().fma {
        // SAFETY: the CPU reports FMA, the only feature the function is compiled for.
        return unsafe { vec_dot_fma(weight, w, a, n) };
    }
    vec_dot_any(weight, w, a, n)
}

/// [`vec_dot_any`] compiled with FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn vec_dot_fma(weight: DType, w: &[u8], a: &[u8], n: usize) -> Option<f32> {
    vec_dot_any(weight, w, a, n)
}

#[inline(always)]
fn vec_dot_any(weight: DType, w: &[u8], a: &[u8], n: usize) -> Option<f32> {
    Some(match weight {
        DType::Q4_0 => dot_x_q8_0(w, a, 18, |b, q| unpack_q4(&b[Q4_0_QS..], 8, q)),
        DType::Q5_0 => dot_x_q8_0(w, a, 22, |b, q| {
            unpack_q5(rd_u32(b, Q5_0_QH), &b[Q5_0_QS..], 16, q)
        }),
        DType::Q8_0 => dot_x_q8_0(w, a, 34, |b, q| {
            for (o, &v) in q.iter_mut().zip(&b[Q8_0_QS..Q8_0_QS + QK]) {
                *o = v as i8;
            }
        }),
        DType::Q4_1 => dot_x_q8_1(w, a, 20, |b, q| unpack_q4(&b[Q4_1_QS..], 0, q)),
        DType::Q5_1 => dot_x_q8_1(w, a, 24, |b, q| {
            unpack_q5(rd_u32(b, Q5_1_QH), &b[Q5_1_QS..], 0, q)
        }),
        DType::Q2_K => dot_q2k(w, a),
        DType::Q3_K => dot_q3k(w, a),
        DType::Q4_K => dot_q45k(w, a, false),
        DType::Q5_K => dot_q45k(w, a, true),
        DType::Q6_K => dot_q6k(w, a),
        DType::IQ4_NL => dot_iq4nl(w, a),
        DType::IQ4_XS => dot_iq4xs(w, a),
        DType::F16 => dot_f16(w, a, n),
        DType::F32 => dot_f32(w, a, n),
        DType::BF16 => dot_bf16(w, a, n),
        // The block formats carry their own x86-order dot (`BlockFormat::dot_x86`).
        other => return super::formats::format(other).map(|f| f.dot_x86(w, a)),
    })
}

// ---------------------------------------------------------------------------------------------
// Lanes.

/// Eight f32 lanes (one `__m256`).
pub(crate) type F32x8 = [f32; 8];

/// `acc = fma(d, f32(s), acc)` lane by lane (`_mm256_fmadd_ps(set1(d), cvtepi32_ps(s), acc)`).
#[inline(always)]
pub(crate) fn fma_lanes(acc: &mut F32x8, d: f32, s: &[i32; 8]) {
    for (a, &v) in acc.iter_mut().zip(s) {
        *a = d.mul_add(v as f32, *a);
    }
}

/// llama.cpp's `hsum_float_8`: the high half added to the low half, then `(r0+r2) + (r1+r3)`.
#[inline(always)]
pub(crate) fn hsum8(x: &F32x8) -> f32 {
    let r = [x[4] + x[0], x[5] + x[1], x[6] + x[2], x[7] + x[3]];
    (r[0] + r[2]) + (r[1] + r[3])
}

/// The 32-byte dot of the AVX2 kernels: lane t = Σ_{j<4} q[4t+j]·y[4t+j] (exact).
#[inline(always)]
fn dot32_lanes(q: &[i8; QK], y: &[u8; QK]) -> [i32; 8] {
    let mut p = [0i32; QK];
    for e in 0..QK {
        p[e] = q[e] as i32 * y[e] as i8 as i32;
    }
    let mut s = [0i32; 8];
    for t in 0..8 {
        s[t] = p[4 * t] + p[4 * t + 1] + p[4 * t + 2] + p[4 * t + 3];
    }
    s
}

/// The 256-element K-quant dot of the AVX2 kernels, `sc` one scale per 16 elements: lane t =
/// Σ over the elements e with (e mod 32) / 4 = t of sc[e/16]·q[e]·y[e] (exact). (Each 32-element
/// step is `madd(maddubs(q, y), scales)`, the low 128 bits taking group 2k's scale and the high
/// bits group 2k+1's, summed into the same 8 i32 lanes.)
#[inline(always)]
fn dot256_lanes(q: &[i8; QK_K], y: &[u8; QK_K], sc: &[i32; 16]) -> [i32; 8] {
    // p[l]: Σ over the 32-element steps of sc·q·y at position l of the step.
    let mut p = [0i32; 32];
    for (g, (qg, yg)) in q.chunks_exact(16).zip(y.chunks_exact(16)).enumerate() {
        let mut s = [0i32; 16];
        for l in 0..16 {
            s[l] = qg[l] as i32 * yg[l] as i8 as i32;
        }
        let half = &mut p[16 * (g & 1)..16 * (g & 1) + 16];
        for l in 0..16 {
            half[l] += sc[g] * s[l];
        }
    }
    let mut out = [0i32; 8];
    for t in 0..8 {
        out[t] = p[4 * t] + p[4 * t + 1] + p[4 * t + 2] + p[4 * t + 3];
    }
    out
}

/// The Q8_K bsums as i32.
#[inline(always)]
fn bsums(by: &[u8]) -> [i32; 16] {
    let mut out = [0i32; 16];
    for (g, o) in out.iter_mut().enumerate() {
        *o = rd_i16(by, Q8_K_BSUMS + 2 * g) as i32;
    }
    out
}

/// The 256 activation quants of a Q8_K block.
#[inline(always)]
fn q8k_qs(by: &[u8]) -> &[u8; QK_K] {
    by[Q8_K_QS..Q8_K_QS + QK_K].try_into().unwrap()
}

// ---------------------------------------------------------------------------------------------
// "_0" weights x Q8_0 and "_1" weights x Q8_1 (`dot_avx2::dot_x_q8_0` / `dot_x_q8_1`).

/// Per block: `acc = fma(d_w·d_x, f32(lanes), acc)`; result `hsum8(acc)`.
#[inline(always)]
fn dot_x_q8_0(w: &[u8], a: &[u8], bw: usize, unpack: impl Fn(&[u8], &mut [i8; QK])) -> f32 {
    let mut acc = [0f32; 8];
    let mut q = [0i8; QK];
    for (bx, by) in w.chunks_exact(bw).zip(a.chunks_exact(34)) {
        let d = rd_f16(bx, 0) * rd_f16(by, 0);
        unpack(bx, &mut q);
        let y: &[u8; QK] = by[Q8_0_QS..Q8_0_QS + QK].try_into().unwrap();
        fma_lanes(&mut acc, d, &dot32_lanes(&q, y));
    }
    hsum8(&acc)
}

/// As [`dot_x_q8_0`], plus Σ m_w·s_x in a scalar (mul then add) added to `hsum8(acc)` last.
#[inline(always)]
fn dot_x_q8_1(w: &[u8], a: &[u8], bw: usize, unpack: impl Fn(&[u8], &mut [i8; QK])) -> f32 {
    let mut acc = [0f32; 8];
    let mut summs = 0f32;
    let mut q = [0i8; QK];
    for (bx, by) in w.chunks_exact(bw).zip(a.chunks_exact(40)) {
        summs += rd_f16(bx, 2) * rd_f16(by, 2);
        let d = rd_f16(bx, 0) * rd_f16(by, 0);
        unpack(bx, &mut q);
        let y: &[u8; QK] = by[Q8_1_QS..Q8_1_QS + QK].try_into().unwrap();
        fma_lanes(&mut acc, d, &dot32_lanes(&q, y));
    }
    hsum8(&acc) + summs
}

// ---------------------------------------------------------------------------------------------
// IQ4_NL x Q8_0 and IQ4_XS x Q8_K (llama.cpp's `ggml_vec_dot_iq4_nl_q8_0` /
// `ggml_vec_dot_iq4_xs_q8_K`, AVX2 branch).

/// IQ4_NL: blocks in pairs, the even block into `acc1` and the odd into `acc2`, each
/// `fma(d_x·d_w, f32(lanes), acc)`; `hsum8(acc1 + acc2)`; a last unpaired block is added as a
/// scalar, `sum + d·f32(Σqq)` (multiply, then add: ggml's build does not contract it).
#[inline(always)]
fn dot_iq4nl(w: &[u8], a: &[u8]) -> f32 {
    let (mut acc1, mut acc2) = ([0f32; 8], [0f32; 8]);
    let mut q = [0i8; QK];
    let nb = w.len() / 18;
    let block = |ib: usize, q: &mut [i8; QK]| {
        let (bx, by) = (&w[18 * ib..18 * ib + 18], &a[34 * ib..34 * ib + 34]);
        unpack_iq4(&bx[IQ4_NL_QS..], q);
        let y: &[u8; QK] = by[Q8_0_QS..Q8_0_QS + QK].try_into().unwrap();
        (rd_f16(by, 0) * rd_f16(bx, 0), dot32_lanes(q, y))
    };
    let mut ib = 0;
    while ib + 1 < nb {
        let (d, s) = block(ib, &mut q);
        fma_lanes(&mut acc1, d, &s);
        let (d, s) = block(ib + 1, &mut q);
        fma_lanes(&mut acc2, d, &s);
        ib += 2;
    }
    let mut sum = [0f32; 8];
    for l in 0..8 {
        sum[l] = acc1[l] + acc2[l];
    }
    let mut sumf = hsum8(&sum);
    if ib < nb {
        let (d, s) = block(ib, &mut q);
        sumf += d * s.iter().sum::<i32>() as f32;
    }
    sumf
}

/// IQ4_XS: per super-block the lanes of all eight 32-element groups, each scaled by its
/// `ls - 32`, summed exactly; `acc = fma(d_w·d_x, f32(lanes), acc)`; result `hsum8(acc)`.
#[inline(always)]
fn dot_iq4xs(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = [0f32; 8];
    let mut q = [0i8; QK];
    for (bx, by) in w.chunks_exact(136).zip(a.chunks_exact(292)) {
        let sc = iq4xs_scales(bx);
        let mut lanes = [0i32; 8];
        for ib in 0..8 {
            unpack_iq4(&bx[IQ4_XS_QS + 16 * ib..], &mut q);
            let y: &[u8; QK] = by[Q8_K_QS + 32 * ib..Q8_K_QS + 32 * ib + QK]
                .try_into()
                .unwrap();
            let s = dot32_lanes(&q, y);
            for t in 0..8 {
                lanes[t] += sc[ib] * s[t];
            }
        }
        fma_lanes(&mut acc, rd_f16(bx, 0) * rd_f32(by, 0), &lanes);
    }
    hsum8(&acc)
}

// ---------------------------------------------------------------------------------------------
// K-quants x Q8_K (`dot_avx2_k`).

/// Q4_K / Q5_K: per super-block the min terms go to 4 f32 lanes, `acc_m = fma(−d_x·dmin_w,
/// f32(lane), acc_m)`, lane j = Σ over sub-blocks 2j, 2j+1 of min·(bsum pair); the scaled sums
/// to 8 lanes, `acc = fma(d_w·d_x, f32(lanes), acc)`. Result `hsum8(acc) + ((m0+m2) + (m1+m3))`.
#[inline(always)]
fn dot_q45k(w: &[u8], a: &[u8], five: bool) -> f32 {
    let bw = if five { 176 } else { 144 };
    let mut acc = [0f32; 8];
    let mut acc_m = [0f32; 4];
    let mut q = [0i8; QK_K];
    for (bx, by) in w.chunks_exact(bw).zip(a.chunks_exact(292)) {
        let dy = rd_f32(by, 0);
        let d = rd_f16(bx, 0) * dy;
        let dmin = -dy * rd_f16(bx, 2);
        let (sc, m) = scale_min_k4(&bx[Q4_K_SCALES..Q4_K_SCALES + 12]);
        let bs = bsums(by);
        for (j, am) in acc_m.iter_mut().enumerate() {
            let mins = (bs[4 * j] + bs[4 * j + 1]) * m[2 * j] as i32
                + (bs[4 * j + 2] + bs[4 * j + 3]) * m[2 * j + 1] as i32;
            *am = dmin.mul_add(mins as f32, *am);
        }
        if five {
            unpack_q5k(bx, &mut q);
        } else {
            unpack_q4k(bx, &mut q);
        }
        let mut sc16 = [0i32; 16];
        for g in 0..16 {
            sc16[g] = sc[g / 2] as i32;
        }
        fma_lanes(&mut acc, d, &dot256_lanes(&q, q8k_qs(by), &sc16));
    }
    hsum8(&acc) + ((acc_m[0] + acc_m[2]) + (acc_m[1] + acc_m[3]))
}

/// Q6_K: the scaled sums are formed with the unsigned codes q ∈ 0..63, and lane t then loses
/// 32·(bsums[2t]·sc[2t] + bsums[2t+1]·sc[2t+1]) (llama.cpp's AVX2 layout: the correction of
/// lane t comes from groups 2t and 2t+1, not from the elements of lane t; the total is
/// Σ sc·(q − 32)·y either way, but the lanes are rounded separately).
/// Per super-block `acc = fma(d_w·d_x, f32(lanes), acc)`; result `hsum8(acc)`.
#[inline(always)]
fn dot_q6k(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = [0f32; 8];
    let mut q = [0i8; QK_K];
    for (bx, by) in w.chunks_exact(210).zip(a.chunks_exact(292)) {
        let d = rd_f16(bx, Q6_K_D) * rd_f32(by, 0);
        unpack_q6k(bx, &mut q);
        for v in q.iter_mut() {
            *v += 32;
        }
        let sc8 = q6k_scales(bx);
        let mut sc = [0i32; 16];
        for g in 0..16 {
            sc[g] = sc8[g] as i32;
        }
        let mut s = dot256_lanes(&q, q8k_qs(by), &sc);
        let bs = bsums(by);
        for t in 0..8 {
            s[t] -= 32 * (bs[2 * t] * sc[2 * t] + bs[2 * t + 1] * sc[2 * t + 1]);
        }
        fma_lanes(&mut acc, d, &s);
    }
    hsum8(&acc)
}

/// Q2_K: per super-block first `acc = fma(−d_x·dmin_w, f32(lanes), acc)` with lane l =
/// min[2l]·bsums[2l] + min[2l+1]·bsums[2l+1], then `acc = fma(d_x·d_w, f32(lanes), acc)` with
/// the scaled sums, in the same 8 lanes; result `hsum8(acc)`.
#[inline(always)]
fn dot_q2k(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = [0f32; 8];
    let mut q = [0i8; QK_K];
    for (bx, by) in w.chunks_exact(84).zip(a.chunks_exact(292)) {
        let dy = rd_f32(by, 0);
        let d = dy * rd_f16(bx, Q2_K_D);
        let dmin = -dy * rd_f16(bx, Q2_K_D + 2);
        let bs = bsums(by);
        let mut prod = [0i32; 8];
        for l in 0..8 {
            prod[l] =
                (bx[2 * l] >> 4) as i32 * bs[2 * l] + (bx[2 * l + 1] >> 4) as i32 * bs[2 * l + 1];
        }
        fma_lanes(&mut acc, dmin, &prod);
        unpack_q2k(bx, &mut q);
        let mut sc = [0i32; 16];
        for g in 0..16 {
            sc[g] = (bx[g] & 15) as i32;
        }
        fma_lanes(&mut acc, d, &dot256_lanes(&q, q8k_qs(by), &sc));
    }
    hsum8(&acc)
}

/// Q3_K: q = low 2 bits − 4·(clear high bit), scale − 32 per 16 elements; per super-block
/// `acc = fma(d_x·d_w, f32(lanes), acc)`; result `hsum8(acc)`.
#[inline(always)]
fn dot_q3k(w: &[u8], a: &[u8]) -> f32 {
    let mut acc = [0f32; 8];
    let mut q = [0i8; QK_K];
    for (bx, by) in w.chunks_exact(110).zip(a.chunks_exact(292)) {
        let d = rd_f32(by, 0) * rd_f16(bx, Q3_K_D);
        unpack_q3k(bx, &mut q);
        let sc8 = q3k_scales(&bx[Q3_K_SCALES..Q3_K_SCALES + 12]);
        let mut sc = [0i32; 16];
        for g in 0..16 {
            sc[g] = sc8[g] as i32;
        }
        fma_lanes(&mut acc, d, &dot256_lanes(&q, q8k_qs(by), &sc));
    }
    hsum8(&acc)
}

// ---------------------------------------------------------------------------------------------
// Float weights (`dot_avx2::dot_f16` / `dot_f32` / `dot_bf16`): 4 accumulators of 8 lanes over
// steps of 32 elements (accumulator j takes elements 8j..8j+7 of each step); the n % 32
// leftovers are added afterwards, in f64 for F16/BF16 as ggml does.

/// ggml's `GGML_F32x8_REDUCE` of 4 accumulators: `(s0+s2) + (s1+s3)` lane by lane, the high half
/// added to the low half, then `(t0+t1) + (t2+t3)` (two `hadd`s).
#[inline(always)]
fn reduce4(s: &[F32x8; 4]) -> f32 {
    let mut s0 = [0f32; 8];
    for k in 0..8 {
        s0[k] = (s[0][k] + s[2][k]) + (s[1][k] + s[3][k]);
    }
    let t = [s0[0] + s0[4], s0[1] + s0[5], s0[2] + s0[6], s0[3] + s0[7]];
    (t[0] + t[1]) + (t[2] + t[3])
}

/// 32 binary16 values (64 bytes) to f32 (exact).
#[inline(always)]
fn f16x32(b: &[u8]) -> [f32; 32] {
    let mut h = [f16::ZERO; 32];
    for (o, c) in h.iter_mut().zip(b.chunks_exact(2)) {
        *o = f16::from_bits(u16::from_le_bytes([c[0], c[1]]));
    }
    let mut out = [0f32; 32];
    h.convert_to_f32_slice(&mut out);
    out
}

/// 32 bf16 values (64 bytes) to f32 (exact).
#[inline(always)]
fn bf16x32(b: &[u8]) -> [f32; 32] {
    let mut out = [0f32; 32];
    for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
        *o = bf16_bits_to_f32(u16::from_le_bytes([c[0], c[1]]));
    }
    out
}

/// 32 f32 values (128 bytes).
#[inline(always)]
fn f32x32(b: &[u8]) -> [f32; 32] {
    let mut out = [0f32; 32];
    for (o, c) in out.iter_mut().zip(b.chunks_exact(4)) {
        *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
    out
}

/// `s[j] = fma(x[8j..], y[8j..], s[j])` lane by lane.
#[inline(always)]
fn fma_step(s: &mut [F32x8; 4], x: &[f32; 32], y: &[f32; 32]) {
    for (j, sj) in s.iter_mut().enumerate() {
        for k in 0..8 {
            sj[k] = x[8 * j + k].mul_add(y[8 * j + k], sj[k]);
        }
    }
}

/// F16: `s[j] = fma(x, y, s[j])`, [`reduce4`], leftovers added in f64.
#[inline(always)]
fn dot_f16(w: &[u8], a: &[u8], n: usize) -> f32 {
    let np = n & !31;
    let mut s = [[0f32; 8]; 4];
    for (wc, ac) in w[..2 * np]
        .chunks_exact(64)
        .zip(a[..2 * np].chunks_exact(64))
    {
        fma_step(&mut s, &f16x32(wc), &f16x32(ac));
    }
    let mut sumf = reduce4(&s) as f64;
    for i in np..n {
        sumf += (rd_f16(w, 2 * i) * rd_f16(a, 2 * i)) as f64;
    }
    sumf as f32
}

/// F32: `s[j] = fma(x, y, s[j])`, [`reduce4`], leftovers added in f32 (mul then add).
#[inline(always)]
fn dot_f32(w: &[u8], a: &[u8], n: usize) -> f32 {
    let np = n & !31;
    let mut s = [[0f32; 8]; 4];
    for (wc, ac) in w[..4 * np]
        .chunks_exact(128)
        .zip(a[..4 * np].chunks_exact(128))
    {
        fma_step(&mut s, &f32x32(wc), &f32x32(ac));
    }
    let mut sumf = reduce4(&s);
    for i in np..n {
        sumf += rd_f32(w, 4 * i) * rd_f32(a, 4 * i);
    }
    sumf
}

/// BF16: products (exact in f32) added without FMA, `c[j] = x·y + c[j]`; then
/// `(c0+c2) + (c1+c3)` lane by lane and [`hsum8`].
#[inline(always)]
fn dot_bf16(w: &[u8], a: &[u8], n: usize) -> f32 {
    let np = n & !31;
    let mut c = [[0f32; 8]; 4];
    for (wc, ac) in w[..2 * np]
        .chunks_exact(64)
        .zip(a[..2 * np].chunks_exact(64))
    {
        let (x, y) = (bf16x32(wc), bf16x32(ac));
        for (j, cj) in c.iter_mut().enumerate() {
            for k in 0..8 {
                cj[k] += x[8 * j + k] * y[8 * j + k];
            }
        }
    }
    let mut c0 = [0f32; 8];
    for k in 0..8 {
        c0[k] = (c[0][k] + c[2][k]) + (c[1][k] + c[3][k]);
    }
    let mut sumf = hsum8(&c0) as f64;
    for i in np..n {
        let x = bf16_bits_to_f32(u16::from_le_bytes([w[2 * i], w[2 * i + 1]]));
        let y = bf16_bits_to_f32(u16::from_le_bytes([a[2 * i], a[2 * i + 1]]));
        sumf += (x * y) as f64;
    }
    sumf as f32
}
