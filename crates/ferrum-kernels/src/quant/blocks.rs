//! Block layouts of the GGML types: field offsets, scalar float conversions, and unpacking of the
//! packed quant values and scales into plain integers (element order, as `dequantize_row_*` emits
//! them). Everything here works on byte slices; no struct is transmuted.

use half::f16;

/// Elements of a "_0/_1"-family block.
pub const QK: usize = 32;
/// Elements of a K-quant super-block.
pub const QK_K: usize = 256;

/// Reads a little-endian binary16 at `off` and widens it (exact).
#[inline(always)]
pub fn rd_f16(b: &[u8], off: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[off], b[off + 1]])).to_f32()
}

/// Reads a little-endian f32 at `off`.
#[inline(always)]
pub fn rd_f32(b: &[u8], off: usize) -> f32 {
    f32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// Reads a little-endian u32 at `off`.
#[inline(always)]
pub fn rd_u32(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

/// Reads a little-endian i16 at `off`.
#[inline(always)]
pub fn rd_i16(b: &[u8], off: usize) -> i16 {
    i16::from_le_bytes([b[off], b[off + 1]])
}

/// f32 -> binary16 bits, round to nearest even (what F16C `vcvtps2ph` with imm 0 does).
#[inline(always)]
pub fn f32_to_f16_bits(x: f32) -> u16 {
    f16::from_f32(x).to_bits()
}

/// bf16 bits -> f32 (exact).
#[inline(always)]
pub fn bf16_bits_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// f32 -> bf16 bits as ggml's `ggml_compute_fp32_to_bf16`: NaN keeps its top bits and is forced
/// quiet, everything else rounds to nearest even (overflowing to infinity).
#[inline(always)]
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let u = x.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

// ---------------------------------------------------------------------------------------------
// Field offsets (bytes from the start of a block).

/// The 16 values an IQ4_NL / IQ4_XS index selects (ggml's `kvalues_iq4nl`).
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];
/// IQ4_NL: f16 d, then 16 bytes of index pairs (low nibbles: elements 0..16, high: 16..32).
pub const IQ4_NL_QS: usize = 2;
/// IQ4_XS: f16 d, u16 scales_h (2 high bits per 32), u8 scales_l[4] (4 low bits per 32),
/// then 128 bytes of index pairs, 16 per 32 elements as in IQ4_NL.
pub const IQ4_XS_SCALES_H: usize = 2;
pub const IQ4_XS_SCALES_L: usize = 4;
pub const IQ4_XS_QS: usize = 8;

/// The 32 table values of one IQ4_NL-style group of 16 index bytes, in element order.
#[inline(always)]
pub fn unpack_iq4(qs: &[u8], q: &mut [i8]) {
    for j in 0..16 {
        q[j] = KVALUES_IQ4NL[(qs[j] & 0xf) as usize];
        q[j + 16] = KVALUES_IQ4NL[(qs[j] >> 4) as usize];
    }
}

/// The 8 signed 6-bit scales (ls - 32) of an IQ4_XS super-block, one per 32 elements.
#[inline(always)]
pub fn iq4xs_scales(b: &[u8]) -> [i32; 8] {
    let h = u16::from_le_bytes([b[IQ4_XS_SCALES_H], b[IQ4_XS_SCALES_H + 1]]) as i32;
    let mut out = [0i32; 8];
    for (ib, o) in out.iter_mut().enumerate() {
        let lo = (b[IQ4_XS_SCALES_L + ib / 2] as i32 >> (4 * (ib % 2))) & 0xf;
        let hi = (h >> (2 * ib)) & 3;
        *o = (lo | (hi << 4)) - 32;
    }
    out
}

/// Q4_0: d @0, qs[16] @2.
pub const Q4_0_QS: usize = 2;
/// Q4_1: d @0, m @2, qs[16] @4.
pub const Q4_1_QS: usize = 4;
/// Q5_0: d @0, qh[4] @2, qs[16] @6.
pub const Q5_0_QH: usize = 2;
/// Q5_0 qs offset.
pub const Q5_0_QS: usize = 6;
/// Q5_1: d @0, m @2, qh[4] @4, qs[16] @8.
pub const Q5_1_QH: usize = 4;
/// Q5_1 qs offset.
pub const Q5_1_QS: usize = 8;
/// Q8_0: d @0, qs[32] @2.
pub const Q8_0_QS: usize = 2;
/// Q8_1: d @0, s @2, qs[32] @4.
pub const Q8_1_QS: usize = 4;
/// Q2_K: scales[16] @0, qs[64] @16, d @80, dmin @82.
pub const Q2_K_QS: usize = 16;
/// Q2_K d offset.
pub const Q2_K_D: usize = 80;
/// Q3_K: hmask[32] @0, qs[64] @32, scales[12] @96, d @108.
pub const Q3_K_QS: usize = 32;
/// Q3_K scales offset.
pub const Q3_K_SCALES: usize = 96;
/// Q3_K d offset.
pub const Q3_K_D: usize = 108;
/// Q4_K: d @0, dmin @2, scales[12] @4, qs[128] @16.
pub const Q4_K_SCALES: usize = 4;
/// Q4_K qs offset.
pub const Q4_K_QS: usize = 16;
/// Q5_K: d @0, dmin @2, scales[12] @4, qh[32] @16, qs[128] @48.
pub const Q5_K_QH: usize = 16;
/// Q5_K qs offset.
pub const Q5_K_QS: usize = 48;
/// Q6_K: ql[128] @0, qh[64] @128, scales[16] (i8) @192, d @208.
pub const Q6_K_QH: usize = 128;
/// Q6_K scales offset.
pub const Q6_K_SCALES: usize = 192;
/// Q6_K d offset.
pub const Q6_K_D: usize = 208;
/// Q8_K: d (f32) @0, qs[256] @4, bsums[16] (i16) @260.
pub const Q8_K_QS: usize = 4;
/// Q8_K bsums offset.
pub const Q8_K_BSUMS: usize = 260;

// ---------------------------------------------------------------------------------------------
// "_0/_1" families: 32 values, byte j holds element j (low nibble) and j+16 (high nibble).

/// Unpacks the 16 nibble bytes of a Q4_0/Q4_1 block; `offset` is subtracted (8 for Q4_0, 0 for Q4_1).
#[inline(always)]
pub fn unpack_q4(qs: &[u8], offset: i8, out: &mut [i8; QK]) {
    for j in 0..QK / 2 {
        out[j] = (qs[j] & 0x0f) as i8 - offset;
        out[j + QK / 2] = (qs[j] >> 4) as i8 - offset;
    }
}

/// Unpacks a Q5_0/Q5_1 block: nibble | (bit i of qh) << 4, minus `offset` (16 for Q5_0, 0 for Q5_1).
#[inline(always)]
pub fn unpack_q5(qh: u32, qs: &[u8], offset: i8, out: &mut [i8; QK]) {
    for j in 0..QK / 2 {
        let h0 = (((qh >> j) & 1) << 4) as u8;
        let h1 = (((qh >> (j + 16)) & 1) << 4) as u8;
        out[j] = ((qs[j] & 0x0f) | h0) as i8 - offset;
        out[j + QK / 2] = ((qs[j] >> 4) | h1) as i8 - offset;
    }
}

// ---------------------------------------------------------------------------------------------
// K-quants.

/// Q4_K/Q5_K: the eight 6-bit scales and eight 6-bit mins packed in 12 bytes (`get_scale_min_k4`):
/// j<4: sc=b[j]&63, m=b[j+4]&63; j≥4: sc=(b[j+4]&15)|((b[j-4]>>6)<<4), m=(b[j+4]>>4)|((b[j]>>6)<<4).
/// Computed four bytes at a time.
#[inline(always)]
pub fn scale_min_k4(s: &[u8]) -> ([u8; 8], [u8; 8]) {
    let s0 = rd_u32(s, 0);
    let s1 = rd_u32(s, 4);
    let s2 = rd_u32(s, 8);
    let sc_lo = s0 & 0x3f3f_3f3f;
    let m_lo = s1 & 0x3f3f_3f3f;
    let sc_hi = (s2 & 0x0f0f_0f0f) | (((s0 >> 6) & 0x0303_0303) << 4);
    let m_hi = ((s2 >> 4) & 0x0f0f_0f0f) | (((s1 >> 6) & 0x0303_0303) << 4);
    let sc = ((sc_lo as u64) | ((sc_hi as u64) << 32)).to_le_bytes();
    let m = ((m_lo as u64) | ((m_hi as u64) << 32)).to_le_bytes();
    (sc, m)
}

/// Q3_K: the sixteen 6-bit scales packed in 12 bytes, already minus 32.
#[inline(always)]
pub fn q3k_scales(s: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        let low = if i < 8 { s[i] & 15 } else { s[i - 8] >> 4 };
        let high = (s[8 + i % 4] >> (2 * (i / 4))) & 3;
        *o = (low | (high << 4)) as i8 - 32;
    }
    out
}

/// Q2_K values 0..=3 in element order (e = 128h + 32j + 16p + l -> qs[32h+16p+l] >> 2j).
#[inline(always)]
pub fn unpack_q2k(b: &[u8], out: &mut [i8; QK_K]) {
    let qs = &b[Q2_K_QS..Q2_K_QS + 64];
    for h in 0..2 {
        for j in 0..4 {
            for l in 0..32 {
                out[128 * h + 32 * j + l] = ((qs[32 * h + l] >> (2 * j)) & 3) as i8;
            }
        }
    }
}

/// Q3_K values -4..=3 in element order (2 low bits as Q2_K; a clear hmask bit subtracts 4).
#[inline(always)]
pub fn unpack_q3k(b: &[u8], out: &mut [i8; QK_K]) {
    let hm = &b[0..32];
    let qs = &b[Q3_K_QS..Q3_K_QS + 64];
    for h in 0..2 {
        for j in 0..4 {
            let shift = 4 * h + j;
            for l in 0..32 {
                let low = ((qs[32 * h + l] >> (2 * j)) & 3) as i8;
                let sub = if (hm[l] >> shift) & 1 != 0 { 0 } else { 4 };
                out[128 * h + 32 * j + l] = low - sub;
            }
        }
    }
}

/// Q4_K values 0..=15 in element order (chunk c of 64: qs[32c+l] low nibble, then high nibble).
#[inline(always)]
pub fn unpack_q4k(b: &[u8], out: &mut [i8; QK_K]) {
    let qs = &b[Q4_K_QS..Q4_K_QS + 128];
    for c in 0..4 {
        for l in 0..32 {
            let v = qs[32 * c + l];
            out[64 * c + l] = (v & 15) as i8;
            out[64 * c + 32 + l] = (v >> 4) as i8;
        }
    }
}

/// Q5_K values 0..=31 in element order (Q4_K nibbles plus bit (2c + half) of qh[l] as 16).
#[inline(always)]
pub fn unpack_q5k(b: &[u8], out: &mut [i8; QK_K]) {
    let qh = &b[Q5_K_QH..Q5_K_QH + 32];
    let qs = &b[Q5_K_QS..Q5_K_QS + 128];
    for c in 0..4 {
        for l in 0..32 {
            let v = qs[32 * c + l];
            let h0 = ((qh[l] >> (2 * c)) & 1) << 4;
            let h1 = ((qh[l] >> (2 * c + 1)) & 1) << 4;
            out[64 * c + l] = ((v & 15) | h0) as i8;
            out[64 * c + 32 + l] = ((v >> 4) | h1) as i8;
        }
    }
}

/// Q6_K values -32..=31 in element order (e = 128h + 32k + l).
#[inline(always)]
pub fn unpack_q6k(b: &[u8], out: &mut [i8; QK_K]) {
    let ql = &b[0..128];
    let qh = &b[Q6_K_QH..Q6_K_QH + 64];
    for h in 0..2 {
        for k in 0..4 {
            for l in 0..32 {
                let lo = ql[64 * h + l + 32 * (k & 1)];
                let lo = if k < 2 { lo & 15 } else { lo >> 4 };
                let hi = (qh[32 * h + l] >> (2 * k)) & 3;
                out[128 * h + 32 * k + l] = (lo | (hi << 4)) as i8 - 32;
            }
        }
    }
}

/// Q6_K: the sixteen int8 scales (one per 16 elements).
#[inline(always)]
pub fn q6k_scales(b: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        *o = b[Q6_K_SCALES + i] as i8;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_matches_ggml_rules() {
        assert_eq!(f32_to_bf16_bits(1.0), 0x3f80);
        // 1 + 2^-8 is exactly half way between two bf16 values: ties to even (down).
        assert_eq!(f32_to_bf16_bits(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert_eq!(f32_to_bf16_bits(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(f32_to_bf16_bits(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert_eq!(f32_to_bf16_bits(f32::from_bits(0x7f80_0001)), 0x7fc0);
        assert_eq!(bf16_bits_to_f32(0xc000), -2.0);
    }

    #[test]
    fn scale_unpacking() {
        // sc_j = j + 1 for j < 4, m_j = 40 + j; high halves use the 2-bit spill.
        let mut s = [0u8; 12];
        let sc: [u8; 8] = [1, 2, 3, 4, 63, 17, 32, 48];
        let m: [u8; 8] = [40, 41, 42, 43, 5, 60, 33, 16];
        for j in 0..4 {
            s[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
            s[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
            s[j + 8] = (sc[j + 4] & 15) | ((m[j + 4] & 15) << 4);
        }
        assert_eq!(scale_min_k4(&s), (sc, m));

        let want: [u8; 16] = [0, 1, 2, 3, 4, 5, 31, 32, 33, 40, 50, 60, 61, 62, 63, 7];
        let mut s3 = [0u8; 12];
        for (i, &v) in want.iter().enumerate() {
            let low = v & 15;
            if i < 8 {
                s3[i] |= low;
            } else {
                s3[i - 8] |= low << 4;
            }
            s3[8 + i % 4] |= (v >> 4) << (2 * (i / 4));
        }
        let got = q3k_scales(&s3);
        for i in 0..16 {
            assert_eq!(got[i] as i32, want[i] as i32 - 32);
        }
    }
}
