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
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_q6k;
#[cfg(target_arch = "x86_64")]
mod avx2_x8;
#[cfg(target_arch = "x86_64")]
pub mod avx512;
#[cfg(target_arch = "x86_64")]
mod kquant;
#[cfg(target_arch = "x86_64")]
mod kquant_avx2;
mod matrix;

pub use matrix::{Layout, PackedMatrix};

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

    fn src(&self) -> Src<'_> {
        Src {
            dtype: self.dtype,
            rows: self.rows,
            cols: self.cols,
            data: self.data,
            layout: Layout::RowMajor,
        }
    }
}

/// A weight matrix as the kernels read it: row-major, or in a packed layout whose rows the
/// row-oriented kernels get unpacked, 16 at a time ([`Src::with_rows16`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Src<'a> {
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
    pub data: &'a [u8],
    pub layout: Layout,
}

/// Rows handed to the row kernels at a time: one packed group.
const ROWS16: usize = 16;

impl Src<'_> {
    fn row_bytes(&self) -> usize {
        self.dtype
            .row_bytes(self.cols)
            .expect("weight rows are whole blocks")
    }

    /// Runs `f` on rows `r0 .. r0 + 16` in the file's block layout (`r0` a multiple of 16; rows
    /// past the end repeat the last row). Row-major weights are read in place; a packed group is
    /// unpacked into this thread's scratch first, exactly (same bytes as the file's rows).
    fn with_rows16<R>(&self, r0: usize, f: impl FnOnce(&[&[u8]; ROWS16]) -> R) -> R {
        debug_assert!(r0.is_multiple_of(ROWS16) && r0 < self.rows);
        let rb = self.row_bytes();
        let last = self.rows - 1;
        match self.layout {
            Layout::RowMajor => {
                let rows: [&[u8]; ROWS16] =
                    core::array::from_fn(|i| &self.data[(r0 + i).min(last) * rb..][..rb]);
                f(&rows)
            }
            #[cfg(target_arch = "x86_64")]
            Layout::X16 => {
                let (block, cell) = avx512::packed_cell(self.dtype).expect("packed type");
                let nb = self.cols / block;
                let group = &self.data[r0 / ROWS16 * nb * cell..][..nb * cell];
                GROUP_ROWS.with_borrow_mut(|buf| {
                    buf.resize(ROWS16 * rb, 0);
                    for (i, row) in buf.chunks_exact_mut(rb).enumerate() {
                        avx512::unpack_row_x16(self.dtype, group, nb, i, row);
                    }
                    let rows: [&[u8]; ROWS16] = core::array::from_fn(|i| &buf[i * rb..][..rb]);
                    f(&rows)
                })
            }
            #[cfg(target_arch = "x86_64")]
            Layout::X4 => GROUP_ROWS.with_borrow_mut(|buf| {
                buf.resize(ROWS16 * rb, 0);
                for (i, row) in buf.chunks_exact_mut(rb).enumerate() {
                    avx2::unpack_row_x4(self, (r0 + i).min(last), row);
                }
                let rows: [&[u8]; ROWS16] = core::array::from_fn(|i| &buf[i * rb..][..rb]);
                f(&rows)
            }),
            #[cfg(target_arch = "x86_64")]
            Layout::X8 => GROUP_ROWS.with_borrow_mut(|buf| {
                buf.resize(ROWS16 * rb, 0);
                for (i, row) in buf.chunks_exact_mut(rb).enumerate() {
                    avx2_x8::unpack_row_x8(self, (r0 + i).min(last), row);
                }
                let rows: [&[u8]; ROWS16] = core::array::from_fn(|i| &buf[i * rb..][..rb]);
                f(&rows)
            }),
        }
    }

    /// Row `r` in the file's block layout, written to `out` (`row_bytes` long).
    fn copy_row(&self, r: usize, out: &mut [u8]) {
        let rb = self.row_bytes();
        match self.layout {
            Layout::RowMajor => out.copy_from_slice(&self.data[r * rb..(r + 1) * rb]),
            #[cfg(target_arch = "x86_64")]
            Layout::X16 => {
                let (block, cell) = avx512::packed_cell(self.dtype).expect("packed type");
                let nb = self.cols / block;
                let group = &self.data[r / ROWS16 * nb * cell..][..nb * cell];
                avx512::unpack_row_x16(self.dtype, group, nb, r % ROWS16, out);
            }
            #[cfg(target_arch = "x86_64")]
            Layout::X4 => avx2::unpack_row_x4(self, r, out),
            #[cfg(target_arch = "x86_64")]
            Layout::X8 => avx2_x8::unpack_row_x8(self, r, out),
        }
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
    /// The tiled matmul of the other types it takes ([`quant::uses_tiled_order`]: Q3_K, IQ4_XS,
    /// IQ1_S..IQ3_S), every row of a call with at least [`TILED_MIN_ROWS`] rows.
    Tiled,
    /// Not llama.cpp's: ferrum's packed AVX-512 kernels for Q4_1, Q5_0 and Q8_0 with
    /// [`block_order`] on, every token of every call ([`quant::vec_dot_blocks`]: one exact
    /// integer sum per block, then one conversion and one FMA). [`Order::of`] never names it; a
    /// matrix stored for those kernels does then ([`PackedMatrix::orders`]).
    Blocks,
}

/// [`block_order`]: 0 not yet decided, 1 off, 2 on.
static BLOCK_ORDER: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Whether the packed AVX-512 kernels of Q4_1, Q5_0 and Q8_0 give every token the block order
/// ([`Order::Blocks`]) instead of llama.cpp's. Off unless the environment sets
/// `FERRUM_DOT_ORDER=blocks` or [`set_block_order`] turned it on. The block order does about half
/// the vector work per block, but its results differ from llama.cpp's by float rounding, and
/// through the next layer's activation quantization (a value crossing a rounding boundary) those
/// differences grow: llama.cpp's outputs are then matched within sampling noise, not bit for bit.
pub fn block_order() -> bool {
    use std::sync::atomic::Ordering;
    match BLOCK_ORDER.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var("FERRUM_DOT_ORDER").is_ok_and(|v| v == "blocks");
            BLOCK_ORDER.store(1 + on as u8, Ordering::Relaxed);
            on
        }
        v => v == 2,
    }
}

/// Turns the block order on or off for the whole process (see [`block_order`]). Set it before
/// running a model: a sequence's results are the same alone or batched only while it stays put.
pub fn set_block_order(on: bool) {
    BLOCK_ORDER.store(1 + on as u8, std::sync::atomic::Ordering::Relaxed);
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
        } else if t >= TILED_MIN_ROWS && quant::uses_tiled_order(dtype) {
            Order::Tiled
        } else {
            Order::Vec
        }
    }
}

/// `x`: [T, cols] f32; `y`: [T, rows]. The T rows form one sequence (see [`matmul_segments`]).
pub fn matmul(w: &WeightRef, x: &[f32], y: &mut [f32]) {
    let t = x.len().checked_div(w.cols).unwrap_or(0);
    matmul_segments(w, x, y, &[t])
}

/// [`matmul`] over rows stacked from several sequences, `segs[i]` rows each (summing to T): each
/// sequence's rows get the kernel order llama.cpp would use for that sequence alone, so a
/// sequence's results do not depend on what shares its call (batch invariance).
pub fn matmul_segments(w: &WeightRef, x: &[f32], y: &mut [f32], segs: &[usize]) {
    let t = check_shapes(&w.src(), x, y, segs);
    if t == 0 {
        return;
    }
    let orders = orders_of(w.dtype, w.rows, segs);
    matmul_rows(&w.src(), x, y, &orders)
}

/// Checks a product's shapes; returns its token count.
fn check_shapes(w: &Src, x: &[f32], y: &mut [f32], segs: &[usize]) -> usize {
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
    t
}

/// Per token, the order llama.cpp uses for it (inline for up to 16 tokens: a decode step
/// allocates nothing here).
fn orders_of(dtype: DType, rows: usize, segs: &[usize]) -> smallvec::SmallVec<[Order; 16]> {
    segs.iter()
        .flat_map(|&n| (0..n).map(move |tok| Order::of(dtype, rows, n, tok)))
        .collect()
}

/// The row-oriented kernels (prompt tiles, K-quant tiles, one dot per output) over any layout:
/// token `i` of `x` in order `orders[i]`.
fn matmul_rows(w: &Src, x: &[f32], y: &mut [f32], orders: &[Order]) {
    let (rows, cols) = (w.rows, w.cols);
    let t = orders.len();
    if t == 0 {
        return;
    }
    let rb = w.row_bytes();
    let stored = match w.layout {
        Layout::RowMajor => rb * rows,
        #[cfg(target_arch = "x86_64")]
        Layout::X16 => avx512::packed_len(w.dtype, rows, cols).expect("packed shape"),
        #[cfg(target_arch = "x86_64")]
        Layout::X4 => avx2::x4_len(w.dtype, rows, cols).expect("packed shape"),
        #[cfg(target_arch = "x86_64")]
        Layout::X8 => avx2_x8::x8_len(w.dtype, rows, cols).expect("packed shape"),
    };
    assert_eq!(w.data.len(), stored, "matmul: weight bytes");
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
        if avx512::available()
            && avx512::supports(w.dtype)
            && (t > 1 || w.dtype == DType::Q4_1)
            && orders.iter().all(|&o| o == Order::Vec)
        {
            // (One token of Q8_0 or Q5_0 streams faster through the row-at-a-time kernel below,
            // with the same bits: see benches/matmul.rs.)
            sc.prepared.fill(w.dtype, &sc.act, ab, t, true);
            matmul_tiles(w, &sc.prepared, t, y);
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if crate::cpu::features().x86_simd()
            && avx2::supports(w.dtype)
            && orders.iter().all(|&o| o == Order::Vec)
        {
            // AVX2 tiers: several rows x tokens per kernel call, `vec_dot`'s bits.
            avx2::matmul(w, &sc.act, ab, t, y);
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if w.layout == Layout::X8
            && w.dtype == DType::Q6_K
            && crate::cpu::features().x86_simd()
            && orders.iter().all(|&o| o == Order::Vec)
        {
            // AVX2 tiers: 8 rows per vector, `vec_dot`'s bits.
            avx2_q6k::matmul(w, &sc.act, ab, t, OutPtr(y.as_mut_ptr()));
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if t >= KQUANT_MIN_TOKENS && kquant::supports(w.dtype, orders) {
            kquant::matmul_k(w, &sc.act, ab, t, orders, y);
            return;
        }
        #[cfg(target_arch = "x86_64")]
        if t >= KQUANT_MIN_TOKENS && kquant_avx2::supports(w.dtype, orders) {
            kquant_avx2::matmul_k(w, &sc.act, ab, t, orders, y);
            return;
        }
        matmul_dots(w, &sc.act, ab, orders, y);
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
    /// Rows of a packed group unpacked to the file's layout ([`Src::with_rows16`]), per thread.
    static GROUP_ROWS: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
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
fn matmul_tiles(w: &Src, p: &avx512::Prepared, t: usize, y: &mut [f32]) {
    let rows = w.rows;
    let rb = w.row_bytes();
    let out = OutPtr(y.as_mut_ptr());
    let n_tasks = rows.div_ceil(TILE_ROWS_PER_TASK);
    let tr = avx512::tile_rows(w.dtype);
    let prefetch = w.layout == Layout::RowMajor;
    pool::parallel_for(n_tasks, |task| {
        let r_begin = task * TILE_ROWS_PER_TASK;
        let r_end = (r_begin + TILE_ROWS_PER_TASK).min(rows);
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
        w.with_rows16(r_begin, |task_rows| {
            if tr == 8 {
                // Unpack the task's rows once (padded to whole 8-row tiles by repeating the
                // last row), then run every token over them.
                let n = (r_end - r_begin).div_ceil(8) * 8;
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
                    if prefetch && r0 + PREFETCH_ROWS + tr <= rows {
                        avx512::prefetch(
                            &w.data[(r0 + PREFETCH_ROWS) * rb..(r0 + PREFETCH_ROWS + tr) * rb],
                        );
                    }
                    let i = r0 - r_begin;
                    let quad = [
                        task_rows[i],
                        task_rows[i + 1],
                        task_rows[i + 2],
                        task_rows[i + 3],
                    ];
                    sweep!(tile(w.dtype, quad), tb, te, r0);
                }
            }
        });
    });
}

/// One dot product per (row, token), in the order [`Order::of`] picks.
fn matmul_dots(w: &Src, act: &[u8], ab: usize, orders: &[Order], y: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    let t = orders.len();
    let dot = |wr: &[u8], ar: &[u8], tok: usize| match orders[tok] {
        Order::Vec => quant::vec_dot(w.dtype, wr, ar, cols),
        Order::Q4kGemv => quant::vec_dot_q4k_repacked(wr, ar, cols),
        Order::Q4kGemm => quant::vec_dot_q4k_gemm_order(wr, ar, cols),
        Order::Q6kTiled => quant::vec_dot_q6k_tiled_order(wr, ar, cols),
        Order::Tiled => quant::vec_dot_tiled_order(w.dtype, wr, ar, cols),
        Order::Blocks => quant::vec_dot_blocks(w.dtype, wr, ar, cols),
    };
    #[cfg(target_arch = "x86_64")]
    if t == 1 && w.dtype == DType::Q6_K && orders[0] == Order::Vec && avx512::available() {
        // Two rows per AVX-512 kernel call, in `vec_dot`'s order (an odd last row is paired
        // with itself).
        let nsb = cols / quant::QK_K;
        pool::parallel_chunks_mut(y, ROWS16, |ci, yc| {
            w.with_rows16(ci * ROWS16, |rws| {
                for i in (0..yc.len()).step_by(2) {
                    let j = (i + 1).min(yc.len() - 1);
                    let v = kquant::q6k_vec_pair(rws[i], rws[j], act, nsb);
                    yc[i] = v[0];
                    yc[j] = if j == i { v[0] } else { v[1] };
                }
            })
        });
        return;
    }
    if t == 1 {
        pool::parallel_chunks_mut(y, ROWS16, |ci, yc| {
            w.with_rows16(ci * ROWS16, |rws| {
                for (i, yv) in yc.iter_mut().enumerate() {
                    *yv = dot(rws[i], act, 0);
                }
            })
        });
        return;
    }
    // [rows, T] by weight row, then transposed to [T, rows].
    let mut yt = vec![0f32; rows * t];
    pool::parallel_chunks_mut(&mut yt, ROWS16 * t, |ci, yc| {
        w.with_rows16(ci * ROWS16, |rws| {
            for (i, yrow) in yc.chunks_exact_mut(t).enumerate() {
                for (tok, yv) in yrow.iter_mut().enumerate() {
                    *yv = dot(rws[i], &act[tok * ab..(tok + 1) * ab], tok);
                }
            }
        })
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
