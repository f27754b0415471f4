//! Quantized block formats (GGML types): dequantization, activation quantizers and dot products.
//!
//! * [`dequantize_row`]: any [`DType`] to f32, bit-identical to ggml's `dequantize_row_*`.
//! * [`vec_dot_type`] / [`quantize_row`]: the activation format llama.cpp pairs with a weight type,
//!   and its quantizer, bit-exact with llama.cpp's x86 build.
//! * [`vec_dot`]: weight row x quantized activation row in the float order of llama.cpp's x86
//!   AVX2 build, on every CPU: the AVX2 kernels where the CPU has AVX2+FMA+F16C, otherwise
//!   ([`Isa::Scalar`]: other architectures, older x86, `FERRUM_FORCE_SCALAR=1`) the portable
//!   kernels of `dot_lanes` ([`vec_dot_lanes`]), which emulate the 8 f32 lanes, FMAs and
//!   horizontal reductions of the AVX2 kernels in plain Rust and give the same bits.
//! * [`vec_dot_ref`]: the plain scalar reference in ggml's *generic C* float order (a different
//!   order: it agrees with [`vec_dot`] within rounding, not bit for bit).
//!
//! [`quantize_row`] and [`vec_dot`] so reproduce an x86 AVX2 build of ggml
//! (`libggml-cpu-haswell`) bit for bit for every weight type with kernels of its own (all but the
//! block formats of `formats`, which give ggml's generic C result bit for bit), whichever kernels run (checked by
//! `tests/quant_ggml.rs` on random and real rows, and `tests/quant_lanes.rs` portable vs AVX2).
//! The llama.cpp prefill and repacked orders ([`vec_dot_q4k_repacked`],
//! [`vec_dot_q4k_gemm_order`], [`vec_dot_q6k_tiled_order`]) likewise have exact scalar twins, and
//! [`uses_repacked_q4k`] makes llama.cpp's x86 choice on every CPU. Note llama.cpp may route a
//! matmul elsewhere (llamafile sgemm, repacked Q4_0 rows, AVX-512 builds), which changes the
//! float order.
//!
//! Q8_1 blocks are 40 bytes here (`DType::Q8_1.block_bytes()`): d, s, `qs[32]` and 4 zero bytes of
//! padding (ggml's own `block_q8_1` is 36 bytes; Q8_1 never appears in files).
//!
//! Layout of the module: `blocks` (field offsets, unpacking), `formats` (the types defined by one
//! `BlockFormat` implementation each: i-quants, ternary, MXFP4), `dequant`, `quantize`, `dot`
//! (scalar references, generic order), `dot_lanes` (portable x86 order), `dot_avx2` /
//! `dot_avx2_k` / `quantize_avx2` (x86_64 AVX2+FMA+F16C kernels, chosen at run time; other ISAs,
//! e.g. AVX-512 or NEON, slot into [`Isa`] and the dispatch below, and must keep the same bits).

// Index loops mirror the block layouts of ggml-common.h; iterator chains would hide them.
#![allow(clippy::needless_range_loop)]

pub(crate) mod blocks;
mod dequant;
mod dot;
#[cfg(target_arch = "x86_64")]
mod dot_avx2;
#[cfg(target_arch = "x86_64")]
mod dot_avx2_k;
mod dot_lanes;
mod formats;
mod quantize;
#[cfg(target_arch = "x86_64")]
mod quantize_avx2;

use ferrum_core::DType;

pub use blocks::{QK, QK_K};

/// Instruction-set level the dispatcher picked for this process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// Plain Rust, no explicit SIMD (the portable kernels; same bits as [`Isa::Avx2`]).
    Scalar,
    /// x86_64 with AVX2, FMA and F16C.
    Avx2,
}

/// The kernel set [`vec_dot`] and [`quantize_row`] use (from [`crate::cpu::features`], so
/// `FERRUM_FORCE_SCALAR` forces [`Isa::Scalar`]).
pub fn isa() -> Isa {
    detect()
}

fn detect() -> Isa {
    if cfg!(target_arch = "x86_64") && crate::cpu::features().x86_simd() {
        return Isa::Avx2;
    }
    Isa::Scalar
}

fn row_bytes_or_panic(dtype: DType, n: usize, what: &str) -> usize {
    dtype.row_bytes(n).unwrap_or_else(|| {
        panic!(
            "{what}: {n} elements is not a whole number of {dtype} blocks ({})",
            dtype.block_size()
        )
    })
}

/// Dequantizes `dst.len()` elements (a multiple of `dtype.block_size()`) from `src`, which must be
/// exactly `dtype.row_bytes(dst.len())` bytes. Works for every type in [`DType::ALL`].
/// Results are bit-identical to ggml's `dequantize_row_*` (f32 operations in the same order).
///
/// # Panics
/// On a length mismatch (a caller bug).
pub fn dequantize_row(dtype: DType, src: &[u8], dst: &mut [f32]) {
    let bytes = row_bytes_or_panic(dtype, dst.len(), "dequantize_row");
    assert_eq!(
        src.len(),
        bytes,
        "dequantize_row: {} elements of {dtype} need {bytes} bytes, got {}",
        dst.len(),
        src.len()
    );
    dequant::dequantize(dtype, src, dst);
}

/// The activation format llama.cpp pairs with a weight type (`type_traits_cpu[..].vec_dot_type`):
/// F32->F32, F16->F16, BF16->BF16, Q4_0|Q5_0|Q8_0|IQ4_NL->Q8_0, Q4_1|Q5_1->Q8_1,
/// Q2_K..Q6_K|IQ4_XS->Q8_K, and for the types of [`formats`] their own choice (the i-quants,
/// TQ1_0, TQ2_0 -> Q8_K; MXFP4 -> Q8_0). Activation-only types map to themselves.
pub fn vec_dot_type(weight: DType) -> DType {
    match weight {
        DType::F32 => DType::F32,
        DType::F16 => DType::F16,
        DType::BF16 => DType::BF16,
        DType::Q4_0 | DType::Q5_0 | DType::Q8_0 | DType::IQ4_NL => DType::Q8_0,
        DType::Q4_1 | DType::Q5_1 | DType::Q8_1 => DType::Q8_1,
        DType::Q2_K
        | DType::Q3_K
        | DType::Q4_K
        | DType::Q5_K
        | DType::Q6_K
        | DType::Q8_K
        | DType::IQ4_XS => DType::Q8_K,
        other => formats::format(other)
            .unwrap_or_else(|| panic!("vec_dot_type: no block format for {other}"))
            .dot_type(),
    }
}

/// Quantizes an activation or KV-cache row into `dtype` (one of F32, F16, BF16, Q8_0, Q8_1, Q8_K,
/// Q4_0), bit-exactly as llama.cpp's x86 build does:
/// * Q8_0/Q8_1: d = amax/127 stored as f16, multiplier 127/amax in f32, round half to even;
///   Q8_1 also s = f16(d·Σq) with the unrounded d.
/// * Q8_K: `quantize_row_q8_K_ref` (signed max, iscale = -127/max, ties to even, min 127, bsums).
/// * F16/BF16: round to nearest even.
/// * Q4_0: `quantize_row_q4_0_ref` (d = max/-8, codes truncated after +8.5, at most 15).
///
/// # Panics
/// If `dtype` is not an activation format, or `dst.len() != dtype.row_bytes(src.len())`.
pub fn quantize_row(dtype: DType, src: &[f32], dst: &mut [u8]) {
    let bytes = row_bytes_or_panic(dtype, src.len(), "quantize_row");
    assert_eq!(
        dst.len(),
        bytes,
        "quantize_row: {} elements as {dtype} need {bytes} bytes, got {}",
        src.len(),
        dst.len()
    );
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx2 && dot_avx2::quantize(dtype, src, dst) {
        return;
    }
    quantize::quantize(dtype, src, dst);
}

/// Scalar version of [`quantize_row`] (same bytes; for tests and benchmarks).
pub fn quantize_row_ref(dtype: DType, src: &[f32], dst: &mut [u8]) {
    let bytes = row_bytes_or_panic(dtype, src.len(), "quantize_row_ref");
    assert_eq!(
        dst.len(),
        bytes,
        "quantize_row_ref: wrong destination length"
    );
    quantize::quantize(dtype, src, dst);
}

fn check_dot(weight: DType, w_row: &[u8], act: &[u8], n: usize) {
    let wb = row_bytes_or_panic(weight, n, "vec_dot");
    let at = vec_dot_type(weight);
    let ab = row_bytes_or_panic(at, n, "vec_dot");
    assert_eq!(
        w_row.len(),
        wb,
        "vec_dot: {n} elements of {weight} need {wb} bytes, got {}",
        w_row.len()
    );
    assert_eq!(
        act.len(),
        ab,
        "vec_dot: {n} activations as {at} need {ab} bytes, got {}",
        act.len()
    );
}

/// Dot product of one weight row (type `weight`, `n` elements) with one activation row already
/// quantized as [`vec_dot_type`]`(weight)`, in the float order of llama.cpp's x86 AVX2 build
/// (`ggml_vec_dot_*` of `arch/x86/quants.c`, `vec.c`): the AVX2 kernels when [`isa`] is
/// [`Isa::Avx2`], else the portable kernels of [`vec_dot_lanes`], which give the same bits. The
/// i-quants below IQ4 (IQ1_S..IQ3_S), TQ1_0, TQ2_0 and MXFP4 have no SIMD kernels yet: for them
/// it is ggml's generic C order on every CPU (llama.cpp's AVX2 kernels agree within rounding).
/// Integer partial sums are exact; the float accumulation order differs from [`vec_dot_ref`]'s
/// (ggml's generic C). Activation quants must lie in [-127, 127], as [`quantize_row`] produces
/// them.
///
/// # Panics
/// If `weight` is activation-only (Q8_1, Q8_K) or a length does not match `n`.
pub fn vec_dot(weight: DType, w_row: &[u8], act: &[u8], n: usize) -> f32 {
    check_dot(weight, w_row, act, n);
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx2 {
        if let Some(v) = dot_avx2::vec_dot(weight, w_row, act, n) {
            return v;
        }
    }
    if let Some(v) = dot_lanes::vec_dot(weight, w_row, act, n) {
        return v;
    }
    dot::vec_dot_ref(weight, w_row, act)
}

/// The portable kernels behind [`vec_dot`] on [`Isa::Scalar`], callable on any CPU (for tests and
/// benchmarks): plain Rust that performs the float operations of the x86 AVX2 kernels in their
/// order (8 f32 lanes as arrays, [`f32::mul_add`] where they use FMA, their horizontal
/// reductions) on the same exact integer partial sums, so the result equals the AVX2 [`vec_dot`]
/// bit for bit, and llama.cpp's x86 AVX2 build. Covers every weight type.
///
/// # Panics
/// As [`vec_dot`].
pub fn vec_dot_lanes(weight: DType, w_row: &[u8], act: &[u8], n: usize) -> f32 {
    check_dot(weight, w_row, act, n);
    match dot_lanes::vec_dot(weight, w_row, act, n) {
        Some(v) => v,
        None => dot::vec_dot_ref(weight, w_row, act),
    }
}

/// Whether `weight` has ferrum's block order ([`vec_dot_blocks`]): Q4_1, Q5_0 and Q8_0.
pub fn has_blocks_order(weight: DType) -> bool {
    matches!(weight, DType::Q4_1 | DType::Q5_0 | DType::Q8_0)
}

/// One weight row x one activation row in the block order of ferrum's packed AVX-512 kernels
/// (`matmul::Order::Blocks`), which sum each 32-element block's products as one exact integer
/// before any float operation: per block `acc = fma(d_w·d_x, f32(Σ q·x), acc)`, and for Q4_1
/// `sm = fma(m_w, s_x, sm)` beside it, the result `acc + sm`. llama.cpp's order ([`vec_dot`])
/// converts and adds 8 partial sums per block instead; the two differ by float rounding only
/// (the integer sums are the same). Plain scalar code, the reference of those kernels.
///
/// # Panics
/// If `weight` is not one of [`has_blocks_order`]'s types, or a length does not match `n`.
pub fn vec_dot_blocks(weight: DType, w_row: &[u8], act: &[u8], n: usize) -> f32 {
    check_dot(weight, w_row, act, n);
    assert!(
        has_blocks_order(weight),
        "vec_dot_blocks: {weight} has no block order"
    );
    dot::dot_blocks(weight, w_row, act)
}

/// Whether llama.cpp's x86 build would repack this weight matrix (`ggml_repack_get_optimal_repack_type`:
/// Q4_K with a row count divisible by 8, as on an AVX2 CPU) and so run it through
/// `ggml_gemv_q4_K_8x8_q8_K` / `ggml_gemm_q4_K_8x8_q8_K`, whose float orders
/// [`vec_dot_q4k_repacked`] and [`vec_dot_q4k_gemm_order`] reproduce. The same decision on every
/// CPU (whatever [`isa`] says): those orders have exact scalar twins, so results are the x86
/// bits everywhere.
pub fn uses_repacked_q4k(weight: DType, rows: usize) -> bool {
    weight == DType::Q4_K && rows.is_multiple_of(8)
}

/// Q4_K weight row x Q8_K activation row in the float order of llama.cpp's repacked Q4_K kernel
/// (`ggml_gemv_q4_K_8x8_q8_K`): per super-block the exact integer sums Σ scale·q·y and
/// Σ min·bsums go to two f32 accumulators by FMA with d_w·d_x and dmin_w·d_x; the result is their
/// difference. Same value as [`vec_dot_q4k_repacked_ref`], with AVX2 when available.
///
/// # Panics
/// If a length does not match `n`.
pub fn vec_dot_q4k_repacked(w_row: &[u8], act: &[u8], n: usize) -> f32 {
    check_dot(DType::Q4_K, w_row, act, n);
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx2 {
        // SAFETY: `isa()` detected AVX2, FMA and F16C at run time.
        return unsafe { dot_avx2_k::dot_q4k_x8(w_row, act) };
    }
    dot::dot_q4k_x8(w_row, act)
}

/// Plain scalar reference for [`vec_dot_q4k_repacked`] (same bits).
pub fn vec_dot_q4k_repacked_ref(w_row: &[u8], act: &[u8], n: usize) -> f32 {
    check_dot(DType::Q4_K, w_row, act, n);
    dot::dot_q4k_x8(w_row, act)
}

/// Q4_K weight row x Q8_K activation row in the float order of llama.cpp's repacked 8x8 Q4_K GEMM
/// (`ggml_gemm_q4_K_8x8_q8_K`, x86). llama.cpp's prefill matmul sends rows `0..4·⌊m/4⌋` of an
/// m-row activation batch through that GEMM (the remainder through the GEMV order of
/// [`vec_dot_q4k_repacked`]), so reproducing its logits needs this order. Per super-block
/// `dd = d_w·d_x`, `dm = dmin_w·d_x` (rounded f32); for each 64-element chunk p (sub-blocks 2p,
/// 2p+1) the exact integer sums I_p = Σ scale·Σ q·y and M_p = Σ min·bsums go to
/// `acc = fma(I_p, dd, acc)` and `acc_m = fma(M_p, dm, acc_m)`; the result is `acc − acc_m`.
/// Integer sums equal [`vec_dot_q4k_repacked`]'s; only the float rounding differs. Same value as
/// [`vec_dot_q4k_gemm_order_ref`], with AVX2 when available.
///
/// # Panics
/// If a length does not match `n`.
pub fn vec_dot_q4k_gemm_order(w_row: &[u8], act: &[u8], n: usize) -> f32 {
    check_dot(DType::Q4_K, w_row, act, n);
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx2 {
        // SAFETY: `isa()` detected AVX2, FMA and F16C at run time.
        return unsafe { dot_avx2_k::dot_q4k_gemm(w_row, act) };
    }
    dot::dot_q4k_gemm(w_row, act)
}

/// Plain scalar reference for [`vec_dot_q4k_gemm_order`] (same bits).
pub fn vec_dot_q4k_gemm_order_ref(w_row: &[u8], act: &[u8], n: usize) -> f32 {
    check_dot(DType::Q4_K, w_row, act, n);
    dot::dot_q4k_gemm(w_row, act)
}

/// Q6_K weight row x Q8_K activation row in the float order of llama.cpp's tiled VNNI matmul
/// (`tiled_run_micro_vnni_8x16`, the AMX/VNNI Q6_K kernel), which llama.cpp's prefill uses for
/// Q6_K weights once a batch has 8 or more rows, so reproducing its logits needs this order. Per
/// super-block the exact integer sum S = Σ_sub scale·Σ (q − 32)·y is scaled `r = f32(S)·d_w`
/// (rounded f32), then `acc = fma(r, d_x, acc)`. Integer sums equal [`vec_dot`]'s for Q6_K; only
/// the float rounding differs. Same value as [`vec_dot_q6k_tiled_order_ref`], with AVX2 when
/// available.
///
/// # Panics
/// If a length does not match `n`.
pub fn vec_dot_q6k_tiled_order(w_row: &[u8], act: &[u8], n: usize) -> f32 {
    check_dot(DType::Q6_K, w_row, act, n);
    #[cfg(target_arch = "x86_64")]
    if isa() == Isa::Avx2 {
        // SAFETY: `isa()` detected AVX2, FMA and F16C at run time.
        return unsafe { dot_avx2_k::dot_q6k_tiled(w_row, act) };
    }
    dot::dot_q6k_tiled(w_row, act)
}

/// Plain scalar reference for [`vec_dot_q6k_tiled_order`] (same bits).
pub fn vec_dot_q6k_tiled_order_ref(w_row: &[u8], act: &[u8], n: usize) -> f32 {
    check_dot(DType::Q6_K, w_row, act, n);
    dot::dot_q6k_tiled(w_row, act)
}

/// Whether llama.cpp's tiled prompt matmul (`ggml-cpu/tiled`, calls of 8+ rows) computes `dtype`
/// in an order of its own that [`vec_dot_tiled_order`] reproduces: Q3_K, IQ4_XS and the
/// i-quants IQ1_S..IQ3_S (Q6_K has [`vec_dot_q6k_tiled_order`]; llama.cpp repacks Q2_K and Q5_K
/// on x86, in orders ferrum does not reproduce).
pub fn uses_tiled_order(dtype: DType) -> bool {
    matches!(dtype, DType::IQ4_XS | DType::Q3_K) || formats::TILED.contains(&dtype)
}

/// One weight row x one Q8_K activation row in the float order of llama.cpp's tiled prompt
/// matmul for `weight` (one of [`uses_tiled_order`]'s types): per super-block the exact integer
/// S = Σ scale·code·y, `r = f32(S)·d_t`, `acc = fma(r, d_x, acc)`, where the codes and `d_t`
/// are the tiled kernel's (IQ1: 8·g ± 1 and d/8; IQ2: d/8; IQ3_XXS: d/4; IQ4_XS, IQ3_S: d).
///
/// # Panics
/// If `weight` has no tiled order, or a length does not match `n`.
pub fn vec_dot_tiled_order(weight: DType, w_row: &[u8], act: &[u8], n: usize) -> f32 {
    check_dot(weight, w_row, act, n);
    match weight {
        DType::IQ4_XS => return dot::dot_iq4xs_tiled(w_row, act),
        DType::Q3_K => return dot::dot_q3k_tiled(w_row, act),
        _ => {}
    }
    let f = formats::format(weight)
        .filter(|_| uses_tiled_order(weight))
        .unwrap_or_else(|| panic!("vec_dot_tiled_order: {weight} has no tiled order"));
    formats::dot_tiled(f, w_row, act)
}

/// Plain scalar reference for [`vec_dot`]: the formulas of ggml's generic C
/// (`ggml_vec_dot_*_generic`), exact integer sums, generic C's float order (not the x86 order of
/// [`vec_dot`], which it matches within rounding). F32/F16/BF16 accumulate the (exact for
/// F16/BF16) f32 products in f64, as ggml's non-SIMD `ggml_vec_dot_f16` does.
///
/// # Panics
/// As [`vec_dot`].
pub fn vec_dot_ref(weight: DType, w_row: &[u8], act: &[u8], n: usize) -> f32 {
    check_dot(weight, w_row, act, n);
    dot::vec_dot_ref(weight, w_row, act)
}
