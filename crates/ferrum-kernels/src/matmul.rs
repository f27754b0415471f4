//! Weight x activation products: y[t, r] = sum_c W[r, c] * x[t, c].
//!
//! The weight keeps its storage type; each activation row is quantized once into the weight type's
//! partner format ([`quant::vec_dot_type`]) and every output is one dot product. Work is split by
//! weight rows, so a weight row is read from memory once for all tokens.
//!
//! Each output depends only on its own token's activations, its weight row, and which of
//! llama.cpp's kernels would have computed it ([`Order`]): llama.cpp picks Q4_K and Q6_K kernels
//! by the number of rows in a call, and each kernel sums in its own order. We reproduce that choice
//! so a single sequence's logits match llama.cpp's bit for bit; the price is that a token's bits
//! depend on the row count of the call it is in (callers that need batch invariance across
//! sequences must give each sequence's rows their own call).

use crate::quant;
use ferrum_core::DType;
use rayon::prelude::*;

/// A row-major weight matrix: `rows` rows of `cols` elements stored as `dtype` (GGUF `ne = [cols, rows]`).
#[derive(Clone, Copy, Debug)]
pub struct WeightRef<'a> {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
}

impl WeightRef<'_> {
    pub fn row_bytes(&self) -> usize {
        self.dtype
            .row_bytes(self.cols)
            .expect("weight rows are whole blocks")
    }
}

/// The float summation order of one output, named after the llama.cpp kernel that uses it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Order {
    /// `ggml_vec_dot_*` (every type, and every row of a 1-row call).
    Vec,
    /// Q4_K repacked 8x8 GEMV: Q4_K matrices with rows % 8 == 0 (llama.cpp repacks them).
    Q4kGemv,
    /// Q4_K repacked 8x8 GEMM: rows 0 .. 4*floor(T/4) of a T-row call.
    Q4kGemm,
    /// Q6_K tiled matmul: every row of a call with at least [`TILED_MIN_ROWS`] rows.
    Q6kTiled,
}

/// llama.cpp sends non-repacked K-quant matmuls of this many rows or more to its tiled kernel.
pub const TILED_MIN_ROWS: usize = 8;

impl Order {
    /// The order llama.cpp uses for token `tok` of a `t`-row product with a `dtype` weight of `rows` rows.
    pub fn of(dtype: DType, rows: usize, t: usize, tok: usize) -> Order {
        if quant::uses_repacked_q4k(dtype, rows) {
            if tok < t / 4 * 4 {
                Order::Q4kGemm
            } else {
                Order::Q4kGemv
            }
        } else if dtype == DType::Q6_K && t >= TILED_MIN_ROWS {
            Order::Q6kTiled
        } else {
            Order::Vec
        }
    }
}

/// Rows per parallel task: large enough to amortise scheduling, small enough to balance two cores.
const ROWS_PER_TASK: usize = 16;

/// `x`: [T, cols] f32; `y`: [T, rows].
pub fn matmul(w: &WeightRef, x: &[f32], y: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    assert!(
        cols > 0 && x.len().is_multiple_of(cols),
        "matmul: x has {} values, not a multiple of cols {cols}",
        x.len()
    );
    let t = x.len() / cols;
    assert_eq!(y.len(), t * rows, "matmul: y shape");
    let rb = w.row_bytes();
    assert_eq!(w.data.len(), rb * rows, "matmul: weight bytes");
    if t == 0 {
        // No rows (e.g. a last layer whose outputs no logits need).
        return;
    }
    let act_type = quant::vec_dot_type(w.dtype);
    let ab = act_type
        .row_bytes(cols)
        .expect("activation rows are whole blocks");
    let mut act = vec![0u8; ab * t];
    for (xr, ar) in x.chunks_exact(cols).zip(act.chunks_exact_mut(ab)) {
        quant::quantize_row(act_type, xr, ar);
    }
    let orders: Vec<Order> = (0..t).map(|tok| Order::of(w.dtype, rows, t, tok)).collect();
    let dot = |wr: &[u8], ar: &[u8], tok: usize| match orders[tok] {
        Order::Vec => quant::vec_dot(w.dtype, wr, ar, cols),
        Order::Q4kGemv => quant::vec_dot_q4k_repacked(wr, ar, cols),
        Order::Q4kGemm => quant::vec_dot_q4k_gemm_order(wr, ar, cols),
        Order::Q6kTiled => quant::vec_dot_q6k_tiled_order(wr, ar, cols),
    };
    if t == 1 {
        y.par_chunks_mut(ROWS_PER_TASK)
            .enumerate()
            .for_each(|(ci, yc)| {
                let r0 = ci * ROWS_PER_TASK;
                for (i, yv) in yc.iter_mut().enumerate() {
                    let wr = &w.data[(r0 + i) * rb..(r0 + i + 1) * rb];
                    *yv = dot(wr, &act, 0);
                }
            });
        return;
    }
    // [rows, T] by weight row, then transposed to [T, rows].
    let mut yt = vec![0f32; rows * t];
    yt.par_chunks_mut(ROWS_PER_TASK * t)
        .enumerate()
        .for_each(|(ci, yc)| {
            let r0 = ci * ROWS_PER_TASK;
            for (i, yrow) in yc.chunks_exact_mut(t).enumerate() {
                let wr = &w.data[(r0 + i) * rb..(r0 + i + 1) * rb];
                for (tok, yv) in yrow.iter_mut().enumerate() {
                    *yv = dot(wr, &act[tok * ab..(tok + 1) * ab], tok);
                }
            }
        });
    for r in 0..rows {
        for tok in 0..t {
            y[tok * rows + r] = yt[r * t + tok];
        }
    }
}

/// Plain reference: dequantized weights, f64 sums, activations not quantized.
pub fn matmul_ref(w: &WeightRef, x: &[f32], y: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    let t = x.len() / cols;
    let rb = w.row_bytes();
    let mut wr = vec![0f32; cols];
    for r in 0..rows {
        quant::dequantize_row(w.dtype, &w.data[r * rb..(r + 1) * rb], &mut wr);
        for tok in 0..t {
            let xr = &x[tok * cols..(tok + 1) * cols];
            y[tok * rows + r] = wr
                .iter()
                .zip(xr)
                .map(|(&a, &b)| a as f64 * b as f64)
                .sum::<f64>() as f32;
        }
    }
}

/// Dequantizes row `r` of `w` (an embedding lookup: exact, no activation quantization).
pub fn get_row(w: &WeightRef, r: usize, out: &mut [f32]) {
    let rb = w.row_bytes();
    quant::dequantize_row(w.dtype, &w.data[r * rb..(r + 1) * rb], out);
}
