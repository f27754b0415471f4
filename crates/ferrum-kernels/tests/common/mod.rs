//! Block-layout facts the randomized kernel tests share: where each type keeps its scales, so
//! random bytes can be made into valid blocks of sane magnitude.

// Each test binary uses its own subset.
#![allow(dead_code)]

use ferrum_core::{f16, DType};

/// Offsets of the plain f16 scale fields (d, then m/dmin where present) of each block type.
pub fn scale_fields(t: DType) -> &'static [usize] {
    match t {
        DType::Q4_0 | DType::Q5_0 | DType::Q8_0 | DType::IQ4_NL | DType::IQ4_XS => &[0],
        DType::IQ2_XXS | DType::IQ2_XS | DType::IQ2_S | DType::IQ3_XXS | DType::IQ3_S => &[0],
        DType::IQ1_S => &[0],
        DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => &[0, 2],
        DType::Q2_K => &[80, 82],
        DType::Q3_K => &[108],
        DType::Q6_K => &[208],
        DType::TQ1_0 => &[52],
        DType::TQ2_0 => &[64],
        _ => &[],
    }
}

/// Offset of the f16 "min" field (m or dmin), whose part of the value is subtracted/added.
pub fn min_field(t: DType) -> Option<usize> {
    match t {
        DType::Q4_1 | DType::Q5_1 | DType::Q4_K | DType::Q5_K => Some(2),
        DType::Q2_K => Some(82),
        _ => None,
    }
}

/// Writes scale `d` into every scale field of one block: the plain f16 fields, IQ1_M's f16 spread
/// over the top nibbles of its four u16 scale words, MXFP4's power-of-two exponent near |d|.
pub fn set_scale(t: DType, blk: &mut [u8], d: f16) {
    for &off in scale_fields(t) {
        blk[off..off + 2].copy_from_slice(&d.to_bits().to_le_bytes());
    }
    match t {
        DType::IQ1_M => {
            let bits = d.to_bits();
            for i in 0..4 {
                let o = 48 + 2 * i;
                let w = u16::from_le_bytes([blk[o], blk[o + 1]]);
                let w = (w & 0x0fff) | (((bits >> (4 * i)) & 0xf) << 12);
                blk[o..o + 2].copy_from_slice(&w.to_le_bytes());
            }
        }
        DType::MXFP4 => {
            let mag = d.to_f32().abs().max(1e-30);
            blk[0] = (mag.log2().floor() as i32 + 128).clamp(0, 250) as u8;
        }
        _ => {}
    }
}

/// How much larger Σ|parts| of a dequantized weight can be than |weight| itself, for error
/// bounds: IQ1's weights are dl·(g + δ) with g in {-1, 0, 1} and δ = ±1/8, so the dot's partial
/// sums (of dl·g and dl·δ apart) reach 9 times Σ|w·x|.
pub fn cancellation(t: DType) -> f64 {
    match t {
        DType::IQ1_S | DType::IQ1_M => 9.0,
        _ => 1.0,
    }
}

/// Σ over the weights of the magnitude their offset adds to a dot's partial sums: ternary
/// weights are d·(u − 1), and llama.cpp's kernels sum d·u·x and d·x apart, which cancel
/// (an all-zero row still has partial sums of 2·Σ|d·x|). 0 for other types.
pub fn offset_magnitude(t: DType, w: &[u8], xd: &[f32]) -> f64 {
    let d_at = match t {
        DType::TQ1_0 => 52,
        DType::TQ2_0 => 64,
        _ => return 0.0,
    };
    w.chunks_exact(t.block_bytes())
        .zip(xd.chunks_exact(t.block_size()))
        .map(|(b, x)| {
            let d = f16::from_bits(u16::from_le_bytes([b[d_at], b[d_at + 1]])).to_f64();
            2.0 * d.abs() * x.iter().map(|v| v.abs() as f64).sum::<f64>()
        })
        .sum()
}

/// The weight types of `quant::formats` (one `BlockFormat` each, ggml's generic C order).
pub const BLOCK_FORMATS: [DType; 10] = [
    DType::IQ2_XXS,
    DType::IQ2_XS,
    DType::IQ2_S,
    DType::IQ3_XXS,
    DType::IQ3_S,
    DType::IQ1_S,
    DType::IQ1_M,
    DType::TQ1_0,
    DType::TQ2_0,
    DType::MXFP4,
];
