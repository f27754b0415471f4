//! Weight x activation products: y[t, r] = sum_c W[r, c] * x[t, c].
//!
//! The weight keeps its storage type; each activation row is quantized once into the weight type's
//! partner format ([`quant::vec_dot_type`]) and every output is one [`quant::vec_dot`]. Work is split
//! by weight rows, so a weight row is read from memory once for all tokens, and each output depends
//! only on its own token: results do not change with the batch size.

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
    let act_type = quant::vec_dot_type(w.dtype);
    let ab = act_type
        .row_bytes(cols)
        .expect("activation rows are whole blocks");
    let mut act = vec![0u8; ab * t];
    for (xr, ar) in x.chunks_exact(cols).zip(act.chunks_exact_mut(ab)) {
        quant::quantize_row(act_type, xr, ar);
    }
    // llama.cpp runs Q4_K matrices with rows % 8 == 0 through its repacked kernel (its own float
    // order); mirror that choice so results match it bit for bit.
    let repacked = quant::uses_repacked_q4k(w.dtype, rows);
    let dot = |wr: &[u8], ar: &[u8]| {
        if repacked {
            quant::vec_dot_q4k_repacked(wr, ar, cols)
        } else {
            quant::vec_dot(w.dtype, wr, ar, cols)
        }
    };
    if t == 1 {
        y.par_chunks_mut(ROWS_PER_TASK)
            .enumerate()
            .for_each(|(ci, yc)| {
                let r0 = ci * ROWS_PER_TASK;
                for (i, yv) in yc.iter_mut().enumerate() {
                    let wr = &w.data[(r0 + i) * rb..(r0 + i + 1) * rb];
                    *yv = dot(wr, &act);
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
                    *yv = dot(wr, &act[tok * ab..(tok + 1) * ab]);
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
