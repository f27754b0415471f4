//! [`PackedMatrix`]: one home for a weight matrix, in the layout its kernels want, and the
//! planner that picks a kernel for each product.
//!
//! A model holds each weight once. On a tier with a packed layout for the weight's type (AVX-512
//! VNNI: Q4_1, Q5_0, Q8_0, Q4_K, Q6_K, IQ4_XS in groups of 16 rows, [`Layout::X16`]) the matrix is stored
//! only in that layout, and every product reads it:
//! - Q4_1, Q5_0 and Q8_0: every token, prompt or decode, goes through the packed kernel
//!   ([`avx512::gemv_x16`], several tokens per pass over a group), in llama.cpp's order, or
//!   with [`super::block_order`] on in the block order ([`Order::Blocks`]: each block's
//!   products summed as one exact integer before one float FMA, about half the vector work of
//!   llama.cpp's 8 lanes per block);
//! - the K-quants: tokens whose llama.cpp float order is the one-token kernel's (every token of
//!   a decode step, whatever the batch) go through the packed GEMV, which reads each 16-row group
//!   once for all of them; prompt tokens go through the row kernels (K-quant tiles), which get
//!   each task's 16 rows unpacked from the group, exactly, into per-thread scratch;
//! - an embedding lookup unpacks one row.
//!
//! On the AVX2 tiers the "_0/_1" types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) are stored in groups of 4
//! rows, block by block ([`Layout::X4`]), which the AVX2 tiles read in place for prompts and
//! decode alike (a decode step reads one contiguous stream); other kernels get rows unpacked.
//!
//! Types and tiers without a packed layout keep the file's row-major bytes (a window of the memory
//! map: nothing is copied). Every path computes each output in the order
//! [`PackedMatrix::orders`] names for its sequence alone (llama.cpp's, or the block order of the
//! packed "_0/_1" kernels), so results never depend on the batch or on what shares a call.

use ferrum_core::{Buf, Bytes, DType, Error, Result};

#[cfg(target_arch = "x86_64")]
use super::{avx2, avx2_x8, avx512};
use super::{check_shapes, matmul_rows, orders_of, Order, Src, WeightRef};
use crate::quant;

/// How a matrix's bytes are laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// The file's layout: rows of blocks, one after another.
    RowMajor,
    /// Groups of 16 rows, block by block, fields interleaved for AVX-512 ([`avx512::pack_x16`]).
    #[cfg(target_arch = "x86_64")]
    X16,
    /// Groups of 4 rows, block by block (the 4 rows' block `ib`, then their block `ib + 1`, ...;
    /// the last group padded by repeating the last row), for the AVX2 tiles of the "_0/_1"
    /// types: a decode step reads one stream ([`avx2::x4_len`]).
    #[cfg(target_arch = "x86_64")]
    X4,
    /// Groups of 8 rows, block by block, 4-element runs of the 8 rows interleaved, for Q5_0, Q4_1
    /// and Q8_0 on the AVX2 tiers: the kernels work on 8 rows per vector (`avx2_x8`).
    #[cfg(target_arch = "x86_64")]
    X8,
}

impl Layout {
    pub fn name(self) -> &'static str {
        match self {
            Layout::RowMajor => "row-major",
            #[cfg(target_arch = "x86_64")]
            Layout::X16 => "x16",
            #[cfg(target_arch = "x86_64")]
            Layout::X4 => "x4",
            #[cfg(target_arch = "x86_64")]
            Layout::X8 => "x8",
        }
    }
}

/// A weight matrix `rows` x `cols` (GGUF `ne = [cols, rows]`) of `dtype`, stored once in
/// [`PackedMatrix::layout`]. Cloning shares the bytes.
#[derive(Clone, Debug)]
pub struct PackedMatrix {
    dtype: DType,
    rows: usize,
    cols: usize,
    layout: Layout,
    data: Bytes,
}

/// Up to this many tokens whose order is the one-token kernel's go through the packed GEMV (one
/// read of each group from memory, then L1) rather than the prompt tiles, where the prompt
/// kernels take that order at all (`cargo bench -p ferrum-kernels --bench matmul` prints both).
pub const GEMV_MAX_TOKENS: usize = 16;

thread_local! {
    /// One row unpacked from a packed group (embedding lookups).
    static ROW: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

impl PackedMatrix {
    /// The layout this process's kernels want for a `dtype` matrix of this shape.
    pub fn plan_layout(dtype: DType, rows: usize, cols: usize) -> Layout {
        #[cfg(target_arch = "x86_64")]
        if avx512::available() && avx512::packed_len(dtype, rows, cols).is_some() {
            return Layout::X16;
        }
        #[cfg(target_arch = "x86_64")]
        if !avx512::available() && crate::cpu::features().x86_simd() {
            if avx2_x8::x8_len(dtype, rows, cols).is_some() {
                return Layout::X8;
            }
            if avx2::x4_len(dtype, rows, cols).is_some() {
                return Layout::X4;
            }
        }
        let _ = (dtype, rows, cols);
        Layout::RowMajor
    }

    /// Bytes of the matrix stored in `layout` (`None`: the shape or type does not fit it).
    pub fn stored_len(dtype: DType, rows: usize, cols: usize, layout: Layout) -> Option<usize> {
        match layout {
            Layout::RowMajor => dtype.row_bytes(cols)?.checked_mul(rows),
            #[cfg(target_arch = "x86_64")]
            Layout::X16 => avx512::packed_len(dtype, rows, cols),
            #[cfg(target_arch = "x86_64")]
            Layout::X4 => avx2::x4_len(dtype, rows, cols),
            #[cfg(target_arch = "x86_64")]
            Layout::X8 => avx2_x8::x8_len(dtype, rows, cols),
        }
    }

    /// Writes the row-major matrix `src` into `dst` (exactly [`PackedMatrix::stored_len`] bytes)
    /// in `layout`, splitting the work over the pool's threads.
    pub fn pack_into(
        dtype: DType,
        rows: usize,
        cols: usize,
        layout: Layout,
        src: &[u8],
        dst: &mut [u8],
    ) -> Result<()> {
        let want = Self::stored_len(dtype, rows, cols, layout);
        let row_major = Self::stored_len(dtype, rows, cols, Layout::RowMajor);
        if want != Some(dst.len()) || row_major != Some(src.len()) {
            return Err(Error::Shape(format!(
                "packing a {rows}x{cols} {dtype} matrix ({} bytes) as {}: sizes do not fit",
                src.len(),
                layout.name()
            )));
        }
        match layout {
            Layout::RowMajor => {
                crate::pool::parallel_chunks_mut(dst, 1 << 20, |ci, chunk| {
                    chunk.copy_from_slice(&src[ci << 20..][..chunk.len()])
                });
            }
            #[cfg(target_arch = "x86_64")]
            Layout::X16 => {
                let group_len = dst.len() / (rows / avx512::GROUP);
                // About 1 MiB per task, whole groups.
                let per_task = ((1 << 20) / group_len).max(1);
                crate::pool::parallel_chunks_mut(dst, per_task * group_len, |ci, chunk| {
                    let ok = avx512::pack_x16_groups(dtype, src, rows, cols, ci * per_task, chunk);
                    assert!(ok, "pack_x16_groups: sizes were checked");
                });
            }
            #[cfg(target_arch = "x86_64")]
            Layout::X4 => {
                let group_len = 4 * dtype.row_bytes(cols).expect("whole blocks");
                let per_task = ((1 << 20) / group_len).max(1);
                crate::pool::parallel_chunks_mut(dst, per_task * group_len, |ci, chunk| {
                    avx2::pack_x4_groups(dtype, src, rows, cols, ci * per_task, chunk)
                });
            }
            #[cfg(target_arch = "x86_64")]
            Layout::X8 => {
                let group_len = avx2_x8::GROUP * dtype.row_bytes(cols).expect("whole blocks");
                let per_task = ((1 << 20) / group_len).max(1);
                crate::pool::parallel_chunks_mut(dst, per_task * group_len, |ci, chunk| {
                    avx2_x8::pack_x8_groups(dtype, src, rows, cols, ci * per_task, chunk)
                });
            }
        }
        Ok(())
    }

    /// A matrix stored in `layout` already (`data` is [`PackedMatrix::stored_len`] bytes).
    pub fn from_parts(
        dtype: DType,
        rows: usize,
        cols: usize,
        layout: Layout,
        data: Bytes,
    ) -> Result<Self> {
        match Self::stored_len(dtype, rows, cols, layout) {
            Some(n) if n == data.len() => Ok(Self {
                dtype,
                rows,
                cols,
                layout,
                data,
            }),
            _ => Err(Error::Shape(format!(
                "a {rows}x{cols} {dtype} matrix in the {} layout cannot be {} bytes",
                layout.name(),
                data.len()
            ))),
        }
    }

    /// The file's row-major bytes, kept as they are (a window of the memory map stays one).
    pub fn row_major(dtype: DType, rows: usize, cols: usize, data: Bytes) -> Result<Self> {
        Self::from_parts(dtype, rows, cols, Layout::RowMajor, data)
    }

    /// Row-major bytes stored in [`PackedMatrix::plan_layout`], in a buffer of its own (a
    /// loader with many matrices packs them into one buffer instead: `pack_into`, `from_parts`).
    pub fn new(dtype: DType, rows: usize, cols: usize, data: Bytes) -> Result<Self> {
        let layout = Self::plan_layout(dtype, rows, cols);
        if layout == Layout::RowMajor {
            return Self::row_major(dtype, rows, cols, data);
        }
        let n = Self::stored_len(dtype, rows, cols, layout).expect("planned layout fits");
        let mut out = vec![0u8; n];
        Self::pack_into(dtype, rows, cols, layout, &data, &mut out)?;
        Self::from_parts(dtype, rows, cols, layout, Bytes::from_vec(out))
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn rows(&self) -> usize {
        self.rows
    }
    pub fn cols(&self) -> usize {
        self.cols
    }
    pub fn layout(&self) -> Layout {
        self.layout
    }
    /// The stored bytes (in [`PackedMatrix::layout`]).
    pub fn data(&self) -> &Bytes {
        &self.data
    }
    /// Bytes held.
    pub fn n_bytes(&self) -> usize {
        self.data.len()
    }

    fn src(&self) -> Src<'_> {
        Src {
            dtype: self.dtype,
            rows: self.rows,
            cols: self.cols,
            data: &self.data,
            layout: self.layout,
        }
    }

    /// The row-major view, where that is the layout.
    pub fn as_row_major(&self) -> Option<WeightRef<'_>> {
        (self.layout == Layout::RowMajor).then(|| WeightRef {
            dtype: self.dtype,
            rows: self.rows,
            cols: self.cols,
            data: &self.data,
        })
    }

    /// Row `r` in the file's block layout, into `out` (`dtype.row_bytes(cols)` bytes).
    pub fn copy_row(&self, r: usize, out: &mut [u8]) {
        assert!(r < self.rows, "row {r} of a {}-row matrix", self.rows);
        self.src().copy_row(r, out)
    }

    /// All rows in the file's layout (for reference paths and re-export).
    pub fn to_row_major(&self) -> Vec<u8> {
        let rb = self.dtype.row_bytes(self.cols).expect("whole blocks");
        let mut out = vec![0u8; rb * self.rows];
        for (r, row) in out.chunks_exact_mut(rb).enumerate() {
            self.copy_row(r, row);
        }
        out
    }

    /// Row `r` dequantized exactly (an embedding lookup).
    pub fn get_row(&self, r: usize, out: &mut [f32]) {
        assert!(r < self.rows, "row {r} of a {}-row matrix", self.rows);
        let rb = self.dtype.row_bytes(self.cols).expect("whole blocks");
        match self.layout {
            Layout::RowMajor => {
                quant::dequantize_row(self.dtype, &self.data[r * rb..(r + 1) * rb], out)
            }
            #[cfg(target_arch = "x86_64")]
            _ => ROW.with_borrow_mut(|buf| {
                buf.resize(rb, 0);
                self.src().copy_row(r, buf);
                quant::dequantize_row(self.dtype, buf, out)
            }),
        }
    }

    /// `y = x Wᵀ`: `x` is [T, cols], `y` [T, rows], the T rows stacked from sequences of
    /// `segs[i]` rows each; every sequence's outputs are the bits it gets alone (see
    /// [`super::matmul_segments`]). The plan: the packed GEMV for tokens in the one-token
    /// kernel's order, the row kernels for the rest.
    pub fn matmul(&self, x: &[f32], y: &mut [f32], segs: &[usize]) {
        let src = self.src();
        let t = check_shapes(&src, x, y, segs);
        if t == 0 {
            return;
        }
        let orders = self.orders(segs);
        match self.layout {
            #[cfg(target_arch = "x86_64")]
            Layout::X16 if avx512::available() => self.matmul_x16(x, y, &orders),
            // Row-major, or packed while the process runs a lower tier than it was packed for
            // (`cpu::set_tier_cap`): the row kernels, on rows unpacked from the groups.
            _ => matmul_rows(&src, x, y, &orders),
        }
    }

    /// The float order of each token's outputs in a product over rows stacked from sequences of
    /// `segs[i]` rows: [`Order::Blocks`] for every token where [`super::block_order`] is on
    /// and the matrix is in the 16-row layout and of a type whose packed kernel has it (Q4_1,
    /// Q5_0, Q8_0) on a CPU that runs that kernel, else the order llama.cpp gives the token in
    /// its sequence ([`Order::of`]).
    /// It depends on the sequence alone, never on what shares the call.
    pub fn orders(&self, segs: &[usize]) -> smallvec::SmallVec<[Order; 16]> {
        #[cfg(target_arch = "x86_64")]
        if self.layout == Layout::X16
            && avx512::available()
            && quant::has_blocks_order(self.dtype)
            && super::block_order()
        {
            return smallvec::smallvec![Order::Blocks; segs.iter().sum()];
        }
        orders_of(self.dtype, self.rows, segs)
    }

    /// Products of several matrices with the same input: `ys[i] = x mats[i]ᵀ`, each the bits
    /// [`PackedMatrix::matmul`] gives it (`x` is [T, cols] in sequences of `segs[i]` rows). Where
    /// every matrix is in the 16-row layout, all of one type and width, and every token takes
    /// the packed GEMV, one parallel call runs them all: the activations quantized once, and the
    /// threads splitting all the matrices' groups as one matrix's (a layer's Q, K and V
    /// projections, or its gate and up). Otherwise one call each.
    pub fn matmul_many(mats: &[&PackedMatrix], x: &[f32], ys: &mut [&mut [f32]], segs: &[usize]) {
        assert_eq!(mats.len(), ys.len(), "matmul_many: one output per matrix");
        #[cfg(target_arch = "x86_64")]
        if let Some(m0) = mats.first() {
            let fused = mats.len() > 1
                && avx512::available()
                && mats.iter().zip(ys.iter_mut()).all(|(m, y)| {
                    let t = check_shapes(&m.src(), x, y, segs);
                    m.layout == Layout::X16
                        && m.dtype == m0.dtype
                        && m.cols == m0.cols
                        && gemv_only(m.dtype, &m.orders(segs), t)
                });
            if fused {
                let mut parts: smallvec::SmallVec<[avx512::X16Part; 4]> = mats
                    .iter()
                    .zip(ys.iter_mut())
                    .map(|(m, y)| avx512::X16Part {
                        packed: &m.data,
                        rows: m.rows,
                        y,
                    })
                    .collect();
                avx512::gemv_x16_parts(m0.dtype, &mut parts, m0.cols, x, false);
                return;
            }
        }
        for (m, y) in mats.iter().zip(ys.iter_mut()) {
            m.matmul(x, y, segs);
        }
    }

    /// [`PackedMatrix::matmul`] over the 16-row packed layout.
    #[cfg(target_arch = "x86_64")]
    fn matmul_x16(&self, x: &[f32], y: &mut [f32], orders: &[Order]) {
        let (dtype, rows, cols) = (self.dtype, self.rows, self.cols);
        let t = orders.len();
        if orders.contains(&Order::Tiled) {
            // IQ4_XS: the packed kernel has both epilogues; each sequence's tokens are all in
            // one order, so run the tiled ones and the rest apart.
            let run = |tiled: bool| {
                move |x: &[f32], y: &mut [f32], _: &[Order]| {
                    avx512::gemv_x16_order(dtype, &self.data, rows, cols, x, y, tiled)
                }
            };
            if orders.iter().all(|&o| o == Order::Tiled) {
                run(true)(x, y, orders);
            } else {
                split_tokens(
                    orders,
                    cols,
                    rows,
                    x,
                    y,
                    |o| o == Order::Tiled,
                    run(true),
                    run(false),
                );
            }
            return;
        }
        if gemv_only(dtype, orders, t) {
            avx512::gemv_x16(dtype, &self.data, rows, cols, x, y);
            return;
        }
        let g = gemv_order(dtype);
        let n_gemv = orders.iter().filter(|&&o| o == g).count();
        let rows_take_g = row_kernels_take(dtype, g);
        if n_gemv == 0 || rows_take_g {
            matmul_rows(&self.src(), x, y, orders);
            return;
        }
        // Both kinds, and the row kernels lack the GEMV's order (Q6_K: a prompt's tiled order
        // beside decode tokens): each part through its own kernel.
        split_tokens(
            orders,
            cols,
            rows,
            x,
            y,
            |o| o == g,
            |x, y, _| avx512::gemv_x16(dtype, &self.data, rows, cols, x, y),
            |x, y, os| matmul_rows(&self.src(), x, y, os),
        );
    }
}

/// Runs the tokens whose order `in_a` picks through `a` and the others through `b`, each over
/// its tokens' rows stacked (with their orders), and writes both back in token order.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn split_tokens(
    orders: &[Order],
    cols: usize,
    rows: usize,
    x: &[f32],
    y: &mut [f32],
    in_a: impl Fn(Order) -> bool,
    a: impl FnOnce(&[f32], &mut [f32], &[Order]),
    b: impl FnOnce(&[f32], &mut [f32], &[Order]),
) {
    let t = orders.len();
    let mut xs = [Buf::with_capacity(t * cols), Buf::with_capacity(t * cols)];
    let mut os: [smallvec::SmallVec<[Order; 16]>; 2] = Default::default();
    for (tok, &o) in orders.iter().enumerate() {
        let i = !in_a(o) as usize;
        xs[i].extend_from_slice(&x[tok * cols..(tok + 1) * cols]);
        os[i].push(o);
    }
    let mut ys = [
        Buf::zeros(os[0].len() * rows),
        Buf::zeros(os[1].len() * rows),
    ];
    let [ya, yb] = &mut ys;
    a(&xs[0], ya, &os[0]);
    b(&xs[1], yb, &os[1]);
    let mut at = [0, 0];
    for (tok, &o) in orders.iter().enumerate() {
        let i = !in_a(o) as usize;
        y[tok * rows..(tok + 1) * rows].copy_from_slice(&ys[i][at[i] * rows..(at[i] + 1) * rows]);
        at[i] += 1;
    }
}

/// Whether the packed GEMV takes all `t` tokens of a call with these orders (every token in the
/// one-token kernel's order, and few enough of them, or no faster kernel for the rest).
#[cfg(target_arch = "x86_64")]
fn gemv_only(dtype: DType, orders: &[Order], t: usize) -> bool {
    let g = gemv_order(dtype);
    orders.len() == t
        && orders.iter().all(|&o| o == g)
        && (t <= GEMV_MAX_TOKENS || !row_kernels_take(dtype, g) || gemv_takes_prompts(dtype))
}

/// The float order of the packed one-token kernel for `dtype` (Q4_1, Q5_0, Q8_0 with
/// [`super::block_order`] on: the block order, which the packed kernel then gives every token,
/// prompts included).
#[cfg(target_arch = "x86_64")]
fn gemv_order(dtype: DType) -> Order {
    if dtype == DType::Q4_K {
        Order::Q4kGemv
    } else if quant::has_blocks_order(dtype) && super::block_order() {
        Order::Blocks
    } else {
        Order::Vec
    }
}

/// Whether the packed GEMV, several tokens per pass over a group (weights unpacked once for
/// all), outruns the prompt tiles at any token count: Q4_1, Q5_0 and Q8_0, whose prompt order is
/// `vec_dot`'s too (`cargo bench -p ferrum-kernels --bench matmul`: 1536x576 x 512 tokens, 1
/// thread, Q4_1 ~190 vs ~100 GFLOP/s).
#[cfg(target_arch = "x86_64")]
fn gemv_takes_prompts(dtype: DType) -> bool {
    matches!(dtype, DType::Q4_1 | DType::Q5_0 | DType::Q8_0)
}

/// Whether the row kernels have a fast path for `order` over `dtype` (else only one dot product
/// per output).
#[cfg(target_arch = "x86_64")]
fn row_kernels_take(dtype: DType, order: Order) -> bool {
    match dtype {
        DType::Q4_1 | DType::Q5_0 | DType::Q8_0 => order == Order::Vec,
        DType::Q4_K => matches!(order, Order::Q4kGemm | Order::Q4kGemv),
        DType::Q6_K => order == Order::Q6kTiled,
        _ => false,
    }
}
