//! Weight x activation products: y[t, r] = sum_c W[r, c] * x[t, c].
//!
//! The weight keeps its storage type; each activation row is quantized once into the weight type's
//! partner format ([`quant::vec_dot_type`]) and every output is one dot product. Work is split by
//! weight rows, so a weight row is read from memory once for all tokens.
//!
//! Each output depends only on its own token's activations, its weight row, and which of
//! llama.cpp's kernels would have computed it ([`Order`]): llama.cpp picks Q4_K and Q6_K kernels
//! by the number of rows in a call, and each kernel sums in its own order. We reproduce that choice
//! so a single sequence's logits match llama.cpp's bit for bit. A call may stack the rows of
//! several sequences ([`matmul_segments`]): each sequence's rows then get the orders they would
//! get alone, so a sequence's results never depend on what shares its batch.
//!
//! Kernels: on CPUs with AVX-512 VNNI, Q4_1, Q5_0 and Q8_0 weights go through the tile kernels of
//! [`avx512`] (4 rows x 4 tokens per call, same float order as `vec_dot`, so the same bits), and
//! prompts over Q4_K and Q6_K weights through `kquant` (integer sums by VNNI, llama.cpp's float
//! epilogues); everything else runs one [`quant::vec_dot`]-family product per output.

#[cfg(target_arch = "x86_64")]
pub mod avx512;
#[cfg(target_arch = "x86_64")]
mod kquant;

/// Below this many tokens the K-quant prompt kernels (which unpack each weight row per call) do
/// not pay for their unpacking.
#[cfg(target_arch = "x86_64")]
const KQUANT_MIN_TOKENS: usize = 4;

use crate::pool;
use crate::quant;
use ferrum_core::DType;
use std::cell::RefCell;

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

/// `x`: [T, cols] f32; `y`: [T, rows]. The T rows form one sequence (see [`matmul_segments`]).
pub fn matmul(w: &WeightRef, x: &[f32], y: &mut [f32]) {
    let t = x.len().checked_div(w.cols).unwrap_or(0);
    matmul_segments(w, x, y, &[t])
}

/// [`matmul`] over rows stacked from several sequences, `segs[i]` rows each (summing to T): each
/// sequence's rows get the kernel order llama.cpp would use for that sequence alone, so a
/// sequence's results do not depend on what shares its call (batch invariance).
pub fn matmul_segments(w: &WeightRef, x: &[f32], y: &mut [f32], segs: &[usize]) {
    let (rows, cols) = (w.rows, w.cols);
    assert!(
        cols > 0 && x.len().is_multiple_of(cols),
        "matmul: x has {} values, not a multiple of cols {cols}",
        x.len()
    );
    let t = x.len() / cols;
    assert_eq!(y.len(), t * rows, "matmul: y shape");
    assert_eq!(
        segs.iter().sum::<usize>(),
        t,
        "matmul: segments do not cover the rows"
    );
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
    SCRATCH.with_borrow_mut(|sc| {
        sc.act.resize(ab * t, 0);
        for (xr, ar) in x.chunks_exact(cols).zip(sc.act.chunks_exact_mut(ab)) {
            quant::quantize_row(act_type, xr, ar);
        }
        #[cfg(target_arch = "x86_64")]
        if avx512::available() && avx512::supports(w.dtype) && (t > 1 || w.dtype == DType::Q4_1) {
            // (One token of Q8_0 or Q5_0 streams faster through the row-at-a-time kernel below,
            // with the same bits: see benches/matmul.rs.)
            sc.prepared.fill(w.dtype, &sc.act, ab, t);
            matmul_tiles(w, &sc.prepared, t, y);
            return;
        }
        // Inline for up to 16 tokens: a decode step allocates nothing here.
        let orders: smallvec::SmallVec<[Order; 16]> = segs
            .iter()
            .flat_map(|&n| (0..n).map(move |tok| Order::of(w.dtype, rows, n, tok)))
            .collect();
        #[cfg(target_arch = "x86_64")]
        if t >= KQUANT_MIN_TOKENS && kquant::supports(w.dtype, &orders) {
            kquant::matmul_k(w, &sc.act, ab, t, &orders, y);
            return;
        }
        matmul_dots(w, &sc.act, ab, &orders, y);
    });
}

/// Runs `f` with this thread's reusable activation buffers (quantized rows, tile layout).
#[cfg(target_arch = "x86_64")]
fn with_scratch<R>(f: impl FnOnce(&mut Vec<u8>, &mut avx512::Prepared) -> R) -> R {
    SCRATCH.with_borrow_mut(|sc| f(&mut sc.act, &mut sc.prepared))
}

/// Per-thread buffers reused across calls (no allocation per token once warm).
struct Scratch {
    act: Vec<u8>,
    #[cfg(target_arch = "x86_64")]
    prepared: avx512::Prepared,
}

thread_local! {
    /// The tile kernels' unpacked weight rows, per worker thread.
    #[cfg(target_arch = "x86_64")]
    static UNPACKED: RefCell<avx512::Unpacked> = const { RefCell::new(avx512::Unpacked::new()) };
    static SCRATCH: RefCell<Scratch> = const {
        RefCell::new(Scratch {
            act: Vec::new(),
            #[cfg(target_arch = "x86_64")]
            prepared: avx512::Prepared::new(),
        })
    };
}

/// A raw output pointer shared by tasks that write disjoint elements.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint elements of one `&mut [f32]` that outlives the parallel call.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}
impl OutPtr {
    /// Element `i` (the caller keeps `i` inside the slice and writes no element another task writes).
    fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// Rows per task of the tiled kernels (a multiple of 4).
#[cfg(target_arch = "x86_64")]
const TILE_ROWS_PER_TASK: usize = 16;
/// Tokens whose activations a task walks before moving to its next rows (keeps them in L1/L2).
#[cfg(target_arch = "x86_64")]
const TILE_TOKEN_BLOCK: usize = 64;

/// How far ahead (in rows) the tiled kernels prefetch weights.
#[cfg(target_arch = "x86_64")]
const PREFETCH_ROWS: usize = 32;

#[cfg(target_arch = "x86_64")]
fn matmul_tiles(w: &WeightRef, p: &avx512::Prepared, t: usize, y: &mut [f32]) {
    let rows = w.rows;
    let rb = w.row_bytes();
    let out = OutPtr(y.as_mut_ptr());
    let n_tasks = rows.div_ceil(TILE_ROWS_PER_TASK);
    let tr = avx512::tile_rows(w.dtype);
    pool::parallel_for(n_tasks, |task| {
        let r_begin = task * TILE_ROWS_PER_TASK;
        let r_end = (r_begin + TILE_ROWS_PER_TASK).min(rows);
        let row = |r: usize| &w.data[r.min(rows - 1) * rb..][..rb];
        let store = |tok: usize, r0: usize, v: &[f32]| {
            for (i, &val) in v.iter().enumerate() {
                if r0 + i < r_end {
                    // SAFETY: `tok < t` and `r0 + i < rows`, so the index is inside `y`
                    // ([t, rows]); only this task writes rows r_begin..r_end.
                    unsafe { *out.at(tok * rows + r0 + i) = val };
                }
            }
        };
        // Runs the tile kernel over tokens tok..te for the rows starting at r0, 4 tokens per
        // call and then the remainder.
        macro_rules! sweep {
            ($tile:ident($($arg:expr),*), $tok:expr, $te:expr, $r0:expr) => {{
                let (mut tok, te, r0) = ($tok, $te, $r0);
                while tok + 4 <= te {
                    let o = avx512::$tile::<4>($($arg,)* p, tok);
                    o.iter().enumerate().for_each(|(c, v)| store(tok + c, r0, v));
                    tok += 4;
                }
                match te - tok {
                    3 => {
                        let o = avx512::$tile::<3>($($arg,)* p, tok);
                        o.iter().enumerate().for_each(|(c, v)| store(tok + c, r0, v));
                    }
                    2 => {
                        let o = avx512::$tile::<2>($($arg,)* p, tok);
                        o.iter().enumerate().for_each(|(c, v)| store(tok + c, r0, v));
                    }
                    1 => {
                        let o = avx512::$tile::<1>($($arg,)* p, tok);
                        store(tok, r0, &o[0]);
                    }
                    _ => {}
                }
            }};
        }
        if tr == 8 {
            // Unpack the task's rows once (padded to whole 8-row tiles by repeating the last
            // row), then run every token over them.
            let n = (r_end - r_begin).div_ceil(8) * 8;
            let task_rows: [&[u8]; TILE_ROWS_PER_TASK] = std::array::from_fn(|i| row(r_begin + i));
            UNPACKED.with_borrow_mut(|u| {
                u.fill(w.dtype, &task_rows[..n], p.nb);
                for tb in (0..t).step_by(TILE_TOKEN_BLOCK) {
                    let te = (tb + TILE_TOKEN_BLOCK).min(t);
                    for r0 in (r_begin..r_end).step_by(8) {
                        let pair0 = (r0 - r_begin) / 2;
                        sweep!(tile8_unpacked(&*u, pair0), tb, te, r0);
                    }
                }
            });
            return;
        }
        for tb in (0..t).step_by(TILE_TOKEN_BLOCK) {
            let te = (tb + TILE_TOKEN_BLOCK).min(t);
            for r0 in (r_begin..r_end).step_by(tr) {
                if r0 + PREFETCH_ROWS + tr <= rows {
                    avx512::prefetch(
                        &w.data[(r0 + PREFETCH_ROWS) * rb..(r0 + PREFETCH_ROWS + tr) * rb],
                    );
                }
                let quad = [row(r0), row(r0 + 1), row(r0 + 2), row(r0 + 3)];
                sweep!(tile(w.dtype, quad), tb, te, r0);
            }
        }
    });
}

/// One dot product per (row, token), in the order [`Order::of`] picks.
fn matmul_dots(w: &WeightRef, act: &[u8], ab: usize, orders: &[Order], y: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    let rb = w.row_bytes();
    let t = orders.len();
    let dot = |wr: &[u8], ar: &[u8], tok: usize| match orders[tok] {
        Order::Vec => quant::vec_dot(w.dtype, wr, ar, cols),
        Order::Q4kGemv => quant::vec_dot_q4k_repacked(wr, ar, cols),
        Order::Q4kGemm => quant::vec_dot_q4k_gemm_order(wr, ar, cols),
        Order::Q6kTiled => quant::vec_dot_q6k_tiled_order(wr, ar, cols),
    };
    #[cfg(target_arch = "x86_64")]
    if t == 1 && w.dtype == DType::Q6_K && orders[0] == Order::Vec && avx512::available() {
        // Two rows per AVX-512 kernel call, in `vec_dot`'s order (an odd last row is paired
        // with itself).
        let nsb = cols / quant::QK_K;
        pool::parallel_chunks_mut(y, ROWS_PER_TASK, |ci, yc| {
            let r0 = ci * ROWS_PER_TASK;
            let row = |i: usize| &w.data[(r0 + i) * rb..(r0 + i + 1) * rb];
            for i in (0..yc.len()).step_by(2) {
                let j = (i + 1).min(yc.len() - 1);
                let v = kquant::q6k_vec_pair(row(i), row(j), act, nsb);
                yc[i] = v[0];
                yc[j] = if j == i { v[0] } else { v[1] };
            }
        });
        return;
    }
    if t == 1 {
        pool::parallel_chunks_mut(y, ROWS_PER_TASK, |ci, yc| {
            let r0 = ci * ROWS_PER_TASK;
            for (i, yv) in yc.iter_mut().enumerate() {
                let wr = &w.data[(r0 + i) * rb..(r0 + i + 1) * rb];
                *yv = dot(wr, act, 0);
            }
        });
        return;
    }
    // [rows, T] by weight row, then transposed to [T, rows].
    let mut yt = vec![0f32; rows * t];
    pool::parallel_chunks_mut(&mut yt, ROWS_PER_TASK * t, |ci, yc| {
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
