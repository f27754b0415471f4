//! Block formats defined by one [`BlockFormat`] implementation each: the i-quants (IQ1_S, IQ1_M,
//! IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S), the ternary TQ1_0/TQ2_0 and MXFP4. Supporting a
//! new GGUF type is a [`ferrum_core::DType`] row, an implementation here and its entry in
//! [`FORMATS`]; the quant module's `dequantize_row`, `vec_dot_type`, `vec_dot` and
//! `vec_dot_ref` find it through [`format`].
//!
//! Each format follows ggml's C reference (`dequantize_row_*` in `ggml-quants.c`,
//! `ggml_vec_dot_*_generic` in `ggml-cpu/quants.c`): dequantization performs the same f32
//! operations in the same order (so it is bit-identical to ggml and to the `gguf` Python
//! package), and the dot product computes the same exact integer sums and combines them with
//! the generic C's float operations as ggml's x86-64 build executes them (there the compiler fuses
//! IQ1_S's and IQ1_M's two multiply-adds into FMAs; ours are `mul_add`), so the result equals
//! that build's `ggml_vec_dot_*_generic` bit for bit ([`BlockFormat::dot`], behind
//! `vec_dot_ref`). [`BlockFormat::dot_x86`] computes the float order of llama.cpp's x86 AVX2
//! kernel for the type, in portable Rust, which `vec_dot` uses on every CPU, so ferrum gives the
//! bits llama.cpp's x86 build gives (tests/quant_ggml.rs checks both against ggml itself). These
//! types have no SIMD kernels of their own yet.

mod grids;
mod iq1;
mod iq2;
mod iq3;
mod mxfp4;
mod ternary;

use ferrum_core::DType;

/// Everything the quant module needs to know of a weight type.
pub(crate) trait BlockFormat: Sync {
    /// The type this format reads.
    fn dtype(&self) -> DType;
    /// The activation format llama.cpp pairs with it (`vec_dot_type`).
    fn dot_type(&self) -> DType;
    /// Dequantizes one block (`dtype().block_bytes()` bytes) into `dtype().block_size()` values.
    fn dequantize(&self, block: &[u8], y: &mut [f32]);
    /// Weight row `w` times activation row `a` (quantized as [`BlockFormat::dot_type`]), whole
    /// blocks of both, lengths already checked: ggml's generic C (`vec_dot_ref`).
    fn dot(&self, w: &[u8], a: &[u8]) -> f32;
    /// The same product in the float order of llama.cpp's x86 AVX2 kernel for the type, in
    /// portable Rust (its 8 f32 lanes as an array, its FMAs as `mul_add`, the exact integer lane
    /// sums its byte shuffles form): `vec_dot` and `vec_dot_lanes`, on every CPU.
    fn dot_x86(&self, w: &[u8], a: &[u8]) -> f32;
    /// The block as llama.cpp's tiled prompt matmul (`ggml-cpu/tiled`, calls of 8+ rows) holds
    /// it: its 256 integer codes, 16 scales (one per 16 codes) and the f32 scale its epilogue
    /// multiplies by (the factor of the generic C folded in); `None` for a type it does not take.
    fn tiled(&self, _block: &[u8], _q: &mut [i8; 256], _sc: &mut [i32; 16]) -> Option<f32> {
        None
    }
}

/// The float order of llama.cpp's tiled prompt matmul for a [`BlockFormat::tiled`] type: per
/// super-block the exact integer S = Σ sc·q·y, then `r = f32(S)·d_t` (rounded) and
/// `acc = fma(r, d_x, acc)`, as for Q6_K (`vec_dot_q6k_tiled_order`).
pub(crate) fn dot_tiled(f: &dyn BlockFormat, w: &[u8], a: &[u8]) -> f32 {
    use crate::quant::blocks::{rd_f32, Q8_K_QS};
    let (mut q, mut sc) = ([0i8; 256], [0i32; 16]);
    let mut acc = 0f32;
    for (bx, by) in w
        .chunks_exact(f.dtype().block_bytes())
        .zip(a.chunks_exact(292))
    {
        let d = f
            .tiled(bx, &mut q, &mut sc)
            .unwrap_or_else(|| panic!("{} has no tiled form", f.dtype()));
        let y = &by[Q8_K_QS..Q8_K_QS + 256];
        let s: i32 = (0..256)
            .map(|e| sc[e / 16] * q[e] as i32 * y[e] as i8 as i32)
            .sum();
        acc = (s as f32 * d).mul_add(rd_f32(by, 0), acc);
    }
    acc
}

/// The types of this module llama.cpp's tiled prompt matmul takes (those whose
/// [`BlockFormat::tiled`] is `Some`; `tests` checks the two agree).
pub(crate) const TILED: [DType; 7] = [
    DType::IQ2_XXS,
    DType::IQ2_XS,
    DType::IQ2_S,
    DType::IQ3_XXS,
    DType::IQ3_S,
    DType::IQ1_S,
    DType::IQ1_M,
];

/// The exact integer lanes of llama.cpp's AVX2 kernels over a 256-weight block whose 32-weight
/// steps run `madd(maddubs(q, y), scales)` into 8 i32 lanes: lane t = Σ over the elements e with
/// (e mod 32) / 4 = t of sc[e / 16]·q[e]·y[e].
#[inline(always)]
fn lanes256(q: &[i8; 256], y: &[u8], sc: &[i32; 16]) -> [i32; 8] {
    let mut out = [0i32; 8];
    for (e, (&q, &y)) in q.iter().zip(&y[..256]).enumerate() {
        out[(e % 32) / 4] += sc[e / 16] * q as i32 * y as i8 as i32;
    }
    out
}

/// The x86 order of the formats whose AVX2 kernel scales 32-weight steps by integer scales and
/// makes one FMA per block: `acc = fma(d_w·d_x, f32(lanes), acc)`, result `factor·hsum8(acc)`.
/// `unpack` gives a block's 256 signed weights and its 16 scales (one per 16 weights).
#[inline(always)]
fn dot_scaled_lanes(
    w: &[u8],
    a: &[u8],
    block_bytes: usize,
    factor: f32,
    unpack: impl Fn(&[u8], &mut [i8; 256], &mut [i32; 16]),
) -> f32 {
    use crate::quant::blocks::{rd_f16, rd_f32, Q8_K_QS};
    use crate::quant::dot_lanes::{fma_lanes, hsum8};
    let mut acc = [0f32; 8];
    let (mut q, mut sc) = ([0i8; 256], [0i32; 16]);
    for (bx, by) in w.chunks_exact(block_bytes).zip(a.chunks_exact(292)) {
        unpack(bx, &mut q, &mut sc);
        let d = rd_f16(bx, 0) * rd_f32(by, 0);
        fma_lanes(&mut acc, d, &lanes256(&q, &by[Q8_K_QS..], &sc));
    }
    factor * hsum8(&acc)
}

/// Every format of this module.
pub(crate) static FORMATS: [&dyn BlockFormat; 10] = [
    &iq2::Iq2Xxs,
    &iq2::Iq2Xs,
    &iq2::Iq2S,
    &iq3::Iq3Xxs,
    &iq3::Iq3S,
    &iq1::Iq1S,
    &iq1::Iq1M,
    &ternary::Tq1_0,
    &ternary::Tq2_0,
    &mxfp4::Mxfp4,
];

/// The format of `dtype`, when this module defines it.
pub(crate) fn format(dtype: DType) -> Option<&'static dyn BlockFormat> {
    FORMATS.iter().copied().find(|f| f.dtype() == dtype)
}

/// `kmask_iq2xs`: bit j of a sign byte flips element j.
const KMASK: [u8; 8] = [1, 2, 4, 8, 16, 32, 64, 128];

/// `ksigns_iq2xs[i]`: 7 stored sign bits plus an eighth that makes the count of minus signs even.
#[inline(always)]
fn ksigns(i: u32) -> u8 {
    let i = (i & 127) as u8;
    i | (((i.count_ones() & 1) as u8) << 7)
}

/// ±1 for element j under sign byte `s`.
#[inline(always)]
fn sign(s: u8, j: usize) -> i32 {
    if s & KMASK[j] != 0 {
        -1
    } else {
        1
    }
}

/// The 8 bytes of a grid entry.
#[inline(always)]
fn grid8(v: u64) -> [i8; 8] {
    v.to_le_bytes().map(|b| b as i8)
}

/// The 4 bytes of a grid entry.
#[inline(always)]
fn grid4(v: u32) -> [i8; 4] {
    v.to_le_bytes().map(|b| b as i8)
}

/// Stores 8 signed weights (group l of the 32 weights ib32) into a block's 256, as i8.
#[inline(always)]
fn store(q: &mut [i8; 256], ib32: usize, l: usize, v: &[i32; 8]) {
    for (o, &x) in q[32 * ib32 + 8 * l..32 * ib32 + 8 * l + 8]
        .iter_mut()
        .zip(v)
    {
        *o = x as i8;
    }
}

/// Σ v·q8 over 8 weights and their activations.
#[inline(always)]
fn dot8(v: &[i32; 8], q8: &[u8]) -> i32 {
    v.iter().zip(q8).map(|(&a, &b)| a * b as i8 as i32).sum()
}

#[inline(always)]
fn rd_u16(b: &[u8], off: usize) -> u16 {
    u16::from_le_bytes([b[off], b[off + 1]])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_format_is_one_type_and_its_sizes_hold() {
        for (i, f) in FORMATS.iter().enumerate() {
            assert!(
                std::ptr::eq(format(f.dtype()).unwrap(), *f),
                "{}",
                f.dtype()
            );
            for g in &FORMATS[i + 1..] {
                assert_ne!(f.dtype(), g.dtype());
            }
            let t = f.dtype();
            assert_eq!(t.block_size() % f.dot_type().block_size(), 0, "{t}");
        }
        // ggml's ksigns_iq2xs starts 0x00 0x81 0x82 0x03 and ends 0xff.
        assert_eq!(
            [ksigns(0), ksigns(1), ksigns(2), ksigns(3)],
            [0, 0x81, 0x82, 0x03]
        );
        assert_eq!(ksigns(127), 0xff);
        for f in FORMATS {
            let b = vec![0u8; f.dtype().block_bytes()];
            let has = f.tiled(&b, &mut [0; 256], &mut [0; 16]).is_some();
            assert_eq!(has, TILED.contains(&f.dtype()), "{}", f.dtype());
        }
    }
}
