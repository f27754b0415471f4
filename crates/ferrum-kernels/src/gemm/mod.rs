//! Blocked, packed f32 GEMM: `C = act(alpha * A * B + beta * C + bias)`, for the graph runtime's
//! float32 MatMul, Gemm and Conv.
//!
//! The loop nest is the usual one (Goto / BLIS): the columns of B in blocks of [`nc()`], the inner
//! dimension in blocks of [`kc()`] (B's block packed into panels of `NR` columns), the rows of A in
//! blocks of about [`MC`] (packed into panels of `MR` rows), and a register-tiled microkernel
//! that keeps an `MR x NR` tile of C in registers over the whole `kc()` block and then writes it:
//! `alpha` applied, the old C added (after the first K block, or when `beta != 0`), and on the
//! last K block the [`Epilogue`]'s bias and activation, while the tile is in cache. A and B are
//! read through strides ([`Mat`]), so transposed operands and im2col views cost nothing extra:
//! packing reads them in whatever order they lie.
//!
//! Both operands are packed the same way: an operand `X` (A, or B transposed) of `rows x k`
//! becomes, for each K block `pc` of height `kc`, panels of `w` rows (zero-padded), panel `q`
//! step `p` lane `r` at `pc * pad + q * kc * w + p * w + r` (`pad`: rows rounded up to `w`).
//! [`PackedA`] and [`PackedB`] hold an operand in exactly that layout, so products with them skip
//! its packing.
//!
//! Microkernels ([`Isa`], picked once at run time): AVX-512F (`12 x 32`, with kernels for every
//! edge row count and for 16-column edges), AVX2 + FMA (`6 x 16`), and a portable scalar one
//! (`4 x 8`); `FERRUM_NO_AVX512=1` and `FERRUM_FORCE_SCALAR=1` step down as in the other
//! kernels. [`gemm_ref`] is the plain reference (f64 accumulation) the randomized tests compare
//! every path with.
//!
//! A short product with wide K and many rows (`n` small, late CNN layers: 7x7 outputs) is
//! computed as `C^T = B^T A^T` (the operands swap roles, C is written through a column stride),
//! so that the small dimension falls on the kernel's rows, where edges cost nothing.
//!
//! [`PackedA`] and [`PackedB`] are packed for the kernel of [`isa`]; when a product needs another
//! width (another ISA, or the transposed product, where A is the right-hand side), the operand is
//! repacked from its own data on first use and kept.
//!
//! Threads: C is split into a grid of ranges, one per task, chosen by a cost model (usually row
//! ranges for a tall C, column ranges for a wide one). An operand that several tasks read in full
//! (B for a row split, A for a column split) is packed first, once, by all threads together; each
//! task then packs only its own part of the other. [`gemm_batch`] spreads independent products over
//! the threads. The float order of an output element depends on the block sizes only, not on the
//! split or the thread count; the AVX-512 and AVX2 kernels sum alike (one FMA chain per output,
//! `kc()` steps at a time, added to C), so they give the same bits too.

mod bf16;
mod epilogue;
pub mod patches;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;
#[cfg(target_arch = "x86_64")]
pub(crate) use x86::{act_avx2, act_avx512};

use std::cell::RefCell;
use std::mem::MaybeUninit;
use std::sync::{Mutex, OnceLock};

pub use bf16::supported as bf16_supported;
pub use bf16::unit as bf16_unit;
pub use epilogue::{
    clamp01, exp_f32, gelu_erf, sigmoid_f32, Act, Bias, Epilogue, EXP_P, LN2_HI, LN2_LO,
    ROUND_MAGIC,
};
pub use patches::Patches;

use crate::aligned::Aligned;
use crate::pool;

/// Inner-dimension block: the steps of K a tile of C sums in registers before it is written (or
/// added to C). Fixed for the process by the hardware (not by a tier cap set later, so operands
/// packed once keep their layout): 384 on CPUs without AVX-512, whose 6 x 16 AVX2 tile leaves
/// room in a 32 KiB L1 for a 24 KiB B panel (one pass over C per 384 steps of K instead of 256;
/// measured on an AVX2-only EPYC, one thread, six alternating runs: 1024^3 62-65 -> 66-72
/// GFLOP/s, 197 x 768 x 768 and 512 x 196 x 1024 0-25% faster), else 768. There the 32-wide
/// B panel (96 KiB) is read from L2, not L1, which keeps up with the tile (128 bytes per 24
/// FMAs), while each pass over C (read and written back, often from L3: BERT's and ViT's
/// 3072-wide outputs are 1.5-2.4 MB) and each fresh pass over B's block is paid a third as
/// often as at 256, and products of depth up to 768 (BERT's and ViT's) write C once. On the
/// Zen 4 host (one thread, B packed ahead, fastest of 15, KC 256 -> 768): 192 x 3072 x 768
/// 101 -> 110 GFLOP/s, 128 x 3072 x 768 98 -> 107, 197 x 768 x 3072 104 -> 108, 49 x 512 x
/// 4608 90 -> 103, 64 x 3136 x 576 108 -> 113, 196 x 256 x 2304 111 -> 115, the rest within
/// 2% (512 and 1024 were no better); two threads 197 x 3072 x 768 210 -> 224.
pub fn kc() -> usize {
    static KC: OnceLock<usize> = OnceLock::new();
    *KC.get_or_init(|| {
        if crate::cpu::hardware().avx512f {
            768
        } else {
            384
        }
    })
}
/// Rows of A packed at once (about `MC x kc()` floats stay in L2); a multiple of every `MR`.
pub const MC: usize = 120;
/// Column block of B packed at once (when B is not packed ahead): 768 KiB of panels, a
/// multiple of every `NR` (256 columns at `kc()` 768, 512 at 384), so that the block stays in
/// L2 while every strip of A's rows runs along it. At 1024 columns (3 MB at depth 768) each
/// strip read it again from L3; on a Xeon (2 MB L2), one thread, A packed ahead, fastest of
/// 21, 197 x 3072 x 768 121 -> 150 GFLOP/s, 128 x 784 x 1152 (a 3x3 convolution's patches)
/// 130 -> 140, shapes whose B fits either way unchanged.
pub fn nc() -> usize {
    ((768 << 10) / (kc() * 4)) / 32 * 32
}

/// Rows of the AVX-512 kernel's panels.
const AVX512_MR: usize = 12;

/// Columns of C up to which a row-major A is read in place rather than packed ([`Side::InPlace`])
/// whatever its depth.
const IN_PLACE_MAX_N: usize = 64;

/// True when the kernels read a row-major A in place for a product of `n` columns and depth `k`
/// (`FERRUM_GEMM_PACK_A=1`: never): when B is at most two panels wide (each packed value would
/// serve one or two tiles, so packing costs about what the products do), when K fits one block
/// (its rows then stay in L1 and L2 across the tiles), or, for the AVX-512 kernel, when A's
/// rows are not a multiple of 4 KiB apart. Rows that far apart fall into the same few L1 sets,
/// and a tile reading 12 of them in place runs slower than from a packed panel (BERT's
/// 3072-deep products: 92-101 -> 70-78 GFLOP/s); at other strides its 12 rows read as well in
/// place as packed, and the packing pass is saved (one thread, B packed ahead, in cache:
/// MobileNetV2's 49 x 320 x 960 91-93 -> 104-105 GFLOP/s, 196 x 96 x 576 87-92 -> 108, ViT's
/// 197 x 768 x 768 99-106 -> 110; in MobileNetV2 its 7 x 7 and 14 x 14 layers with 320-960
/// inputs 2.52 -> 2.28 ms in all). The AVX2 kernel's 6-row tiles did not gain (49 x 320 x 960
/// 93 -> 82 GFLOP/s).
fn reads_a_in_place(isa: Isa, n: usize, k: usize) -> bool {
    static OFF: OnceLock<bool> = OnceLock::new();
    let deep = isa == Isa::Avx512 && !(4 * k).is_multiple_of(4096);
    (n <= IN_PLACE_MAX_N || k <= kc() || deep)
        && !*OFF.get_or_init(|| std::env::var_os("FERRUM_GEMM_PACK_A").is_some())
}

/// True when the AVX-512 kernel reads B's rows in place as its panels ([`Side::Lanes`]; `x` is
/// `B^T`) rather than packing them (`FERRUM_GEMM_PACK_B=1`: never): when each step's lanes are
/// contiguous (a row-major B: a 1x1 convolution's channels-first input) and rows are not a
/// multiple of 2 KiB apart (a panel's rows would then share a few sets of L1 and L2). On an AMD
/// Zen 5 (`cargo bench --bench gemm -- 1 2 --shape ... --bf16`, filter packed, with bias,
/// residual and Relu, from memory, fastest of 15, packed against in place): 64 x 3136 x 256
/// 0.680 -> 0.603 ms at one thread, 256 x 196 x 1024 0.491 -> 0.450, at two threads 0.293 -> 0.261 (nothing
/// left to pack for both threads before they start), 1024 x 196 x 256 0.271 -> 0.241; ResNet-50's
/// nodes at one thread ~1 ms in all. Running a block's panels one by one down its row strips
/// instead (as for a B packed ahead) was no faster.
fn reads_b_in_place(isa: Isa, x: Mat) -> bool {
    static OFF: OnceLock<bool> = OnceLock::new();
    isa == Isa::Avx512
        && x.rs == 1
        && !(4 * x.cs).is_multiple_of(2048)
        && !*OFF.get_or_init(|| std::env::var_os("FERRUM_GEMM_PACK_B").is_some())
}

/// Multiply-adds below which a product is not worth another thread.
const MIN_TASK_MACS: usize = 1 << 19;

/// A read-only matrix view: element `(i, j)` is `data[i * rs + j * cs]`.
#[derive(Clone, Copy, Debug)]
pub struct Mat<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

impl<'a> Mat<'a> {
    /// A row-major matrix with leading dimension `ld` (`(i, j)` at `i * ld + j`).
    pub fn row_major(data: &'a [f32], ld: usize) -> Mat<'a> {
        Mat {
            data,
            rs: ld,
            cs: 1,
        }
    }

    /// The transpose of a row-major matrix with leading dimension `ld` (`(i, j)` at `j * ld + i`).
    pub fn transposed(data: &'a [f32], ld: usize) -> Mat<'a> {
        Mat {
            data,
            rs: 1,
            cs: ld,
        }
    }

    /// The transposed view (free: the strides swap).
    fn t(self) -> Mat<'a> {
        Mat {
            data: self.data,
            rs: self.cs,
            cs: self.rs,
        }
    }

    #[inline]
    fn at(&self, i: usize, j: usize) -> f32 {
        self.data[i * self.rs + j * self.cs]
    }

    /// The view starting at `(i, j)`.
    fn offset(&self, i: usize, j: usize) -> Mat<'a> {
        let o = i * self.rs + j * self.cs;
        Mat {
            data: &self.data[o.min(self.data.len())..],
            rs: self.rs,
            cs: self.cs,
        }
    }

    /// Panics unless every element of an `rows x cols` matrix lies inside `data`.
    fn check(&self, rows: usize, cols: usize, what: &str) {
        if rows == 0 || cols == 0 {
            return;
        }
        let last = (rows - 1) * self.rs + (cols - 1) * self.cs;
        assert!(
            last < self.data.len(),
            "gemm: {what} ({rows} x {cols}, strides {} {}) exceeds its {} elements",
            self.rs,
            self.cs,
            self.data.len()
        );
    }
}

/// The plain reference: every output an f64 sum over `k` in order, rounded once. `beta == 0`
/// ignores C's old contents (NaN included), as BLAS does.
#[allow(clippy::too_many_arguments)]
pub fn gemm_ref(
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: Mat,
    b: Mat,
    beta: f32,
    c: &mut [f32],
    ldc: usize,
) {
    a.check(m, k, "A");
    b.check(k, n, "B");
    for i in 0..m {
        for j in 0..n {
            let s: f64 = (0..k).map(|p| a.at(i, p) as f64 * b.at(p, j) as f64).sum();
            let old = if beta == 0.0 {
                0.0
            } else {
                beta as f64 * c[i * ldc + j] as f64
            };
            c[i * ldc + j] = (alpha as f64 * s + old) as f32;
        }
    }
}

/// The microkernel family in use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    Avx512,
    Avx2,
    Scalar,
}

impl Isa {
    /// Rows and columns of the kernel's tile (the packed panels' widths of A and B).
    fn tile(self) -> (usize, usize) {
        match self {
            Isa::Avx512 => (AVX512_MR, 32),
            Isa::Avx2 => (6, 16),
            Isa::Scalar => (4, 8),
        }
    }

    /// Columns that an edge tile of `n` columns costs: the AVX-512 kernel has a 16-column one.
    fn padded_cols(self, n: usize) -> usize {
        let nr = self.tile().1;
        let rem = n % nr;
        n - rem
            + match (self, rem) {
                (_, 0) => 0,
                (Isa::Avx512, 1..=16) => 16,
                _ => nr,
            }
    }
}

/// True when an `m x n` product whose A is not read in place runs as `C^T = B^T A^T`: a short,
/// wide-K product with many rows (late CNN layers: 7x7 outputs), whose NR-wide panels would be
/// mostly padding (the operands swap roles, C is written through a column stride).
fn swaps(isa: Isa, m: usize, n: usize) -> bool {
    let util = |x: usize| x as f64 / isa.padded_cols(x) as f64;
    n < 128 && m >= 2 * n && util(m) > util(n) + 0.1
}

/// The best microkernel this CPU runs (detected once), unless the environment steps down.
pub fn isa() -> Isa {
    let f = crate::cpu::features();
    if cfg!(target_arch = "x86_64") && f.avx512f && f.avx2 && f.fma {
        return Isa::Avx512;
    }
    if cfg!(target_arch = "x86_64") && f.avx2 && f.fma {
        return Isa::Avx2;
    }
    Isa::Scalar
}

/// Every microkernel family this CPU can run (for tests that compare them).
pub fn available_isas() -> Vec<Isa> {
    [Isa::Scalar, Isa::Avx2, Isa::Avx512]
        .into_iter()
        .filter(|&isa| isa_available(isa))
        .collect()
}

/// Whether this CPU can run the microkernel family `isa`.
pub fn isa_available(isa: Isa) -> bool {
    let f = crate::cpu::hardware();
    let avx2 = cfg!(target_arch = "x86_64") && f.avx2 && f.fma;
    match isa {
        Isa::Scalar => true,
        Isa::Avx2 => avx2,
        Isa::Avx512 => avx2 && f.avx512f,
    }
}

/// Where and how a kernel writes its tile of C.
pub(crate) struct Out {
    /// The tile's first element.
    pub c: *mut f32,
    /// Row and column strides of C.
    pub rsc: usize,
    pub csc: usize,
    /// Multiplies the product.
    pub alpha: f32,
    /// Add C's old contents (else overwrite them).
    pub acc: bool,
    /// On the last K block, unless the epilogue is empty.
    pub epi: Option<TileEpi>,
    /// Cache lines (64 bytes each) from `fetch` that the kernel asks to be brought into L2,
    /// spread over its steps (the next B panel, when B comes from memory; `fetch_lines` 0:
    /// none). A hint only: it changes no result.
    pub fetch: *const f32,
    pub fetch_lines: usize,
}

/// The epilogue for one tile: bias pointers at the tile's first row / column, the residual at
/// the tile's first element with C's strides (each null when absent).
#[derive(Clone, Copy)]
pub(crate) struct TileEpi {
    pub row: *const f32,
    pub col: *const f32,
    pub z: *const f32,
    pub act: Act,
}

/// Writes the `rows x cols` tile in `buf` (row stride `ldb`) per `out`, element by element:
/// `act(alpha * x + old + bias)`.
///
/// # Safety
/// `out` addresses a `rows x cols` tile of writable floats, and its bias pointers `rows` and
/// `cols` values; `buf` holds the tile.
unsafe fn write_tile(buf: &[f32], ldb: usize, rows: usize, cols: usize, out: &Out) {
    // One loop per activation kind, the activation inlined (the common ones are a compare or
    // two; `Act::apply` per element was a call and a match).
    let act = out.epi.as_ref().map_or(Act::Identity, |e| e.act);
    // SAFETY: forwarded from the caller.
    unsafe {
        match act {
            Act::Identity => write_tile_with(buf, ldb, rows, cols, out, |v| v),
            // As `Act::apply` defines them.
            Act::Relu => {
                write_tile_with(buf, ldb, rows, cols, out, |v| if v > 0.0 { v } else { 0.0 })
            }
            Act::Clip { lo, hi } => write_tile_with(buf, ldb, rows, cols, out, |v| {
                let y = if v < lo { lo } else { v };
                if y > hi {
                    hi
                } else {
                    y
                }
            }),
            Act::LeakyRelu(s) => {
                write_tile_with(
                    buf,
                    ldb,
                    rows,
                    cols,
                    out,
                    |v| if v >= 0.0 { v } else { s * v },
                )
            }
            a => write_tile_with(buf, ldb, rows, cols, out, |v| a.apply(v)),
        }
    }
}

/// [`write_tile`] with the activation `act`.
///
/// # Safety
/// As [`write_tile`].
#[inline(always)]
unsafe fn write_tile_with(
    buf: &[f32],
    ldb: usize,
    rows: usize,
    cols: usize,
    out: &Out,
    act: impl Fn(f32) -> f32,
) {
    let one = |r: usize, j: usize| {
        let mut v = buf[r * ldb + j];
        if out.alpha != 1.0 {
            v *= out.alpha;
        }
        // SAFETY: r < rows, j < cols: inside the tile (and bias extents) the caller vouched for.
        unsafe {
            let p = out.c.add(r * out.rsc + j * out.csc);
            if out.acc {
                v += *p;
            }
            if let Some(e) = &out.epi {
                if !e.z.is_null() {
                    v += *e.z.add(r * out.rsc + j * out.csc);
                }
                if !e.row.is_null() {
                    v += *e.row.add(r);
                }
                if !e.col.is_null() {
                    v += *e.col.add(j);
                }
                v = act(v);
            }
            *p = v;
        }
    };
    if out.csc == 1 {
        (0..rows).for_each(|r| (0..cols).for_each(|j| one(r, j)));
    } else {
        // Column-strided C: walk each column of the tile (contiguous in C when rsc is 1).
        (0..cols).for_each(|j| (0..rows).for_each(|r| one(r, j)));
    }
}

/// Where a tile's A values lie: a packed panel (`lda == 0`: step `p` of row `r` at `p * MR + r`,
/// `kc * MR` floats), or the operand itself, read in place (`lda > 0`: row `r`, step `p` at
/// `r * lda + p`, only the tile's `rows` rows).
#[derive(Clone, Copy)]
pub(crate) struct APanel {
    pub ptr: *const f32,
    pub lda: usize,
}

impl APanel {
    /// The tile's row pointers when read in place (rows past `rows` repeat the last one, so a
    /// kernel that always computes `R` rows reads nothing outside the operand).
    #[inline(always)]
    fn rows<const R: usize>(self, rows: usize) -> [*const f32; R] {
        core::array::from_fn(|r| self.ptr.wrapping_add(r.min(rows.max(1) - 1) * self.lda))
    }
}

/// A register-tiled kernel: a `rows x cols` tile (at most `MR x NR`) from an A panel (`kc x MR`,
/// row index fastest, or A's rows in place: [`APanel`]) and a B panel (`kc` steps of `NR`
/// columns, `ldb` apart: `NR` when packed, B's row stride when B's rows are read in place).
trait Micro {
    const MR: usize;
    const NR: usize;
    /// Computes the tile and writes it per `out`.
    ///
    /// # Safety
    /// `a` addresses `kc` steps of the tile's rows ([`APanel`]), `b` addresses `kc` steps of
    /// `NR` floats each, `ldb` apart, `rows <= MR`, `cols <= NR`, `out` addresses a `rows x
    /// cols` tile (bias pointers: `rows` and `cols` values), and the CPU has the kernel's
    /// features.
    unsafe fn tile(
        kc: usize,
        a: APanel,
        b: *const f32,
        ldb: usize,
        rows: usize,
        cols: usize,
        out: &Out,
    );
}

/// The portable kernel (4 x 8), plain Rust: a separate multiply and add (`mul_add` would be a
/// library call without hardware FMA), so its bits differ from the FMA kernels'.
struct Scalar;

impl Micro for Scalar {
    const MR: usize = 4;
    const NR: usize = 8;
    unsafe fn tile(
        kc: usize,
        a: APanel,
        b: *const f32,
        ldb: usize,
        rows: usize,
        cols: usize,
        out: &Out,
    ) {
        let rp = a.rows::<4>(rows);
        let mut t = [0f32; 32];
        for p in 0..kc {
            // SAFETY: the caller guarantees kc steps of NR floats, ldb apart.
            let bp = unsafe { std::slice::from_raw_parts(b.add(p * ldb), 8) };
            for r in 0..4 {
                // SAFETY: p < kc; a packed panel holds kc * MR floats, a row read in place kc
                // (rows past `rows` repeat the last).
                let x = unsafe {
                    if a.lda == 0 {
                        *a.ptr.add(p * 4 + r)
                    } else {
                        *rp[r].add(p)
                    }
                };
                for j in 0..8 {
                    t[r * 8 + j] += x * bp[j];
                }
            }
        }
        // SAFETY: forwarded from the caller.
        unsafe { write_tile(&t, 8, rows, cols, out) };
    }
}

/// Packs `rows x kc` of `x` into panels of `w` rows (zero-padded to whole panels): panel `q`,
/// step `p`, lane `r` at `q * kc * w + p * w + r`. Writes every float of those panels. Compiled
/// for AVX2 where that is the best the CPU offers (its copies then move 32 bytes at a time; the
/// AVX-512 path has its own packers, [`steps_in_registers`] and [`transposed_panel`]).
fn pack(x: Mat, rows: usize, kc: usize, w: usize, dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        let f = crate::cpu::features();
        if !f.avx512() && f.x86_simd() && f.avx2 {
            // SAFETY: the CPU has AVX2 and the process allows it.
            return unsafe { pack_avx2(x, rows, kc, w, dst) };
        }
    }
    pack_any(x, rows, kc, w, dst)
}

/// [`pack_any`] compiled for AVX2 (same values).
///
/// # Safety
/// The CPU supports AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn pack_avx2(x: Mat, rows: usize, kc: usize, w: usize, dst: &mut [f32]) {
    pack_any(x, rows, kc, w, dst)
}

/// [`pack`] for any CPU.
#[inline(always)]
fn pack_any(x: Mat, rows: usize, kc: usize, w: usize, dst: &mut [f32]) {
    let panels = rows.div_ceil(w);
    if x.rs == 1 {
        // Each step's lanes are contiguous: read the operand step by step (one row of B at a
        // time), copying each panel's share.
        let full = rows / w;
        let lanes = rows - full * w;
        let vector = steps_in_registers(x, full, kc, w, dst);
        for p in 0..kc {
            let src = &x.data[p * x.cs..];
            if !vector {
                for q in 0..full {
                    copy_lanes(&mut dst[q * kc * w + p * w..][..w], &src[q * w..][..w]);
                }
            }
            if lanes > 0 {
                let o = &mut dst[full * kc * w + p * w..][..w];
                o[..lanes].copy_from_slice(&src[full * w..][..lanes]);
                o[lanes..].fill(0.0);
            }
        }
        return;
    }
    for q in 0..panels {
        let r0 = q * w;
        let lanes = w.min(rows - r0);
        let out = &mut dst[q * kc * w..][..kc * w];
        if lanes < w {
            out.fill(0.0);
        }
        if x.cs == 1 && kc >= 16 && transposed_panel(x, r0, lanes, kc, w, out) {
            // Transposed in registers.
        } else if x.cs == 1 {
            // Each lane is contiguous along K: transpose it in.
            for r in 0..lanes {
                let src = &x.data[(r0 + r) * x.rs..][..kc];
                for (o, &v) in out.chunks_exact_mut(w).zip(src) {
                    o[r] = v;
                }
            }
        } else {
            for (p, o) in out.chunks_exact_mut(w).enumerate() {
                for (r, v) in o[..lanes].iter_mut().enumerate() {
                    *v = x.at(r0 + r, p);
                }
            }
        }
    }
}

/// The whole panels of an operand with contiguous lanes (`rs == 1`) packed with AVX-512 loads
/// and stores, if the CPU has it (else false, nothing written).
fn steps_in_registers(x: Mat, full: usize, kc: usize, w: usize, dst: &mut [f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        crate::cpu::features().avx512() && x86::pack_steps(x.data, x.cs, full, kc, w, dst)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (x, full, kc, w, dst);
        false
    }
}

/// Packs one panel of `lanes` rows from `r0` of `x` (`cs == 1`) with the AVX-512 or AVX2
/// transposes, if the CPU has one of them.
fn transposed_panel(x: Mat, r0: usize, lanes: usize, kc: usize, w: usize, out: &mut [f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        x86::pack_transposed(&x.data[r0 * x.rs..], x.rs, lanes, kc, w, out)
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (x, r0, lanes, kc, w, out);
        false
    }
}

/// `dst = src` for one step of a panel (`w` floats): a fixed-size copy for the kernels' widths.
#[inline]
fn copy_lanes(dst: &mut [f32], src: &[f32]) {
    fn fixed<const W: usize>(dst: &mut [f32], src: &[f32]) {
        let (d, s): (&mut [f32; W], &[f32; W]) = (dst.try_into().unwrap(), src.try_into().unwrap());
        *d = *s;
    }
    match dst.len() {
        32 => fixed::<32>(dst, src),
        16 => fixed::<16>(dst, src),
        12 => fixed::<12>(dst, src),
        _ => dst.copy_from_slice(src),
    }
}

/// Floats of an operand of `rows x k` packed whole in panels of `w`.
fn packed_len(rows: usize, k: usize, w: usize) -> usize {
    rows.next_multiple_of(w) * k
}

/// Packs all of `x` (`rows x k`) into `dst` in the blocked layout (see the module docs), on up to
/// `threads` tasks that each write their own panels.
fn pack_whole(x: Src, rows: usize, k: usize, w: usize, threads: usize, dst: &mut [f32]) {
    let pad = rows.next_multiple_of(w);
    let panels = pad / w;
    if pad * k == 0 {
        return;
    }
    let groups = if threads > 1 {
        panels.min(2 * threads)
    } else {
        1
    };
    let per = panels.div_ceil(groups);
    let groups = panels.div_ceil(per);
    // One region per (K block, panel group), each a disjoint run of `dst`: K block `b` starts
    // at `b * kc() * pad` (the blocks before it are whole), its group `g` `g * per` panels of
    // `kc * w` further on.
    let kc0 = kc();
    let dst = &mut dst[..pad * k];
    let base = Shared(dst.as_mut_ptr());
    let run = |t: usize| {
        let (pc, g) = ((t / groups) * kc0, (t % groups) * per);
        let kc = kc0.min(k - pc);
        let n = per.min(panels - g);
        let (at, len) = (pc * pad + g * kc * w, n * kc * w);
        // SAFETY: `at + len <= pad * k` (the last group of the last block ends there), `dst`
        // is borrowed mutably for this whole function, and the runs of two different tasks do
        // not overlap (they tile `dst` in order), so each task writes its own elements only.
        let out = unsafe { std::slice::from_raw_parts_mut(base.get().add(at), len) };
        x.offset(g * w, pc)
            .pack((n * w).min(rows - g * w), kc, w, out);
    };
    let regions = k.div_ceil(kc0) * groups;
    if groups > 1 {
        pool::parallel_for(regions, run);
    } else {
        (0..regions).for_each(run);
    }
}

/// A pointer the tasks of [`pack_whole`] share, each writing its own part of the memory.
#[derive(Clone, Copy)]
struct Shared(*mut f32);

impl Shared {
    /// The pointer (a method, so that closures capture the whole `Sync` wrapper).
    fn get(self) -> *mut f32 {
        self.0
    }
}

// SAFETY: only `pack_whole` makes one, and its tasks write disjoint parts through it.
unsafe impl Send for Shared {}
// SAFETY: as above.
unsafe impl Sync for Shared {}

/// An operand `X` (`rows x k`) packed whole, in panels of any of the kernels' widths: the
/// width it was packed for up front, others (for another ISA, or the other side of a transposed
/// product) converted on first use and kept.
struct Packed {
    rows: usize,
    k: usize,
    /// 64-byte aligned (no vector load of a panel straddles two cache lines).
    by_width: [OnceLock<Aligned>; WIDTHS.len()],
}

/// Every panel width a kernel uses (`MR`s and `NR`s).
const WIDTHS: [usize; 6] = [4, 6, 8, 12, 16, 32];

fn width_index(w: usize) -> usize {
    WIDTHS
        .iter()
        .position(|&x| x == w)
        .expect("gemm: panel width")
}

impl Packed {
    fn new(x: Mat, rows: usize, k: usize, w: usize) -> Packed {
        x.check(rows, k, "packed operand");
        let mut data = Aligned::zeroed(4 * packed_len(rows, k, w));
        pack_whole(Src::Mat(x), rows, k, w, pool::threads(), data.f32s_mut());
        let p = Packed {
            rows,
            k,
            by_width: Default::default(),
        };
        let _ = p.by_width[width_index(w)].set(data);
        p
    }

    /// `x` packed as [`Packed::new`] packs it, in this operand's memory (grown when too small;
    /// the panels of other widths are dropped).
    fn repack(&mut self, x: Mat, rows: usize, k: usize, w: usize) {
        x.check(rows, k, "packed operand");
        let i = width_index(w);
        let mut data = self.by_width[i].take().unwrap_or_default();
        self.by_width.iter_mut().for_each(|d| drop(d.take()));
        data.resize_for(4 * packed_len(rows, k, w));
        pack_whole(Src::Mat(x), rows, k, w, pool::threads(), data.f32s_mut());
        (self.rows, self.k) = (rows, k);
        let _ = self.by_width[i].set(data);
    }

    /// The operand in panels of `w`.
    fn get(&self, w: usize) -> &[f32] {
        self.by_width[width_index(w)]
            .get_or_init(|| {
                let (sw, src) = WIDTHS
                    .iter()
                    .zip(&self.by_width)
                    .find_map(|(&sw, s)| Some((sw, s.get()?)))
                    .expect("gemm: a packed operand has one layout");
                let (spad, pad) = (
                    self.rows.next_multiple_of(sw),
                    self.rows.next_multiple_of(w),
                );
                let src = src.f32s();
                let mut out = Aligned::zeroed(4 * pad * self.k);
                for pc in (0..self.k).step_by(kc()) {
                    let kc = kc().min(self.k - pc);
                    let (s, d) = (&src[pc * spad..], &mut out.f32s_mut()[pc * pad..]);
                    for i in 0..self.rows {
                        let (so, doff) = ((i / sw) * kc * sw + i % sw, (i / w) * kc * w + i % w);
                        for p in 0..kc {
                            d[doff + p * w] = s[so + p * sw];
                        }
                    }
                }
                out
            })
            .f32s()
    }
}

/// The arithmetic of products with a packed operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Precision {
    /// f32 operands and sums.
    #[default]
    F32,
    /// Both operands rounded to bf16 (nearest even), products exact, sums in f32, on the AMX
    /// tile unit: opt-in, where [`bf16_supported`].
    Bf16,
}

/// A packed operand's data: f32 panels for the FMA kernels, or bf16 for the tile unit.
enum Repr {
    F32(Box<Packed>),
    Bf16(bf16::Bf16Operand),
}

impl Repr {
    fn rows_k(&self) -> (usize, usize) {
        match self {
            Repr::F32(p) => (p.rows, p.k),
            Repr::Bf16(b) => (b.rows, b.k),
        }
    }

    fn precision(&self) -> Precision {
        match self {
            Repr::F32(_) => Precision::F32,
            Repr::Bf16(_) => Precision::Bf16,
        }
    }

    fn size_bytes(&self) -> usize {
        match self {
            Repr::F32(p) => p
                .by_width
                .iter()
                .filter_map(|w| w.get())
                .map(|v| v.len())
                .sum(),
            Repr::Bf16(b) => b.size_bytes(),
        }
    }
}

/// The left operand `A` (`m x k`) packed once for the kernel in use ([`isa`]), or rounded to
/// bf16 for the tile unit ([`Precision::Bf16`]), so products with it skip packing it (conv
/// weights). `alpha` is not folded in.
pub struct PackedA(Repr);

impl PackedA {
    pub fn new(m: usize, k: usize, a: Mat) -> PackedA {
        PackedA(Repr::F32(Box::new(Packed::new(a, m, k, isa().tile().0))))
    }

    /// Packed in `precision` (products with a [`Precision::Bf16`] operand need
    /// [`bf16_supported`]).
    pub fn with_precision(m: usize, k: usize, a: Mat, precision: Precision) -> PackedA {
        match precision {
            Precision::F32 => PackedA::new(m, k, a),
            Precision::Bf16 => PackedA(Repr::Bf16(bf16::Bf16Operand::rows(a, m, k))),
        }
    }

    /// As [`PackedA::with_precision`], for products of `n` columns: an f32 A that such a product
    /// reads as the B of `C^T = B^T A^T` (a convolution's filter over a 7x7 output) is packed in
    /// B's panels from the start, so the product does not convert it on first use and the
    /// operand is held in one layout, not two. Any other product still reads it (converting).
    pub fn for_columns(m: usize, k: usize, a: Mat, precision: Precision, n: usize) -> PackedA {
        let isa = isa();
        match precision {
            Precision::F32 if swaps(isa, m, n) => {
                PackedA(Repr::F32(Box::new(Packed::new(a, m, k, isa.tile().1))))
            }
            _ => PackedA::with_precision(m, k, a, precision),
        }
    }

    /// Rows (`m`).
    pub fn m(&self) -> usize {
        self.0.rows_k().0
    }

    /// Columns (`k`).
    pub fn k(&self) -> usize {
        self.0.rows_k().1
    }

    /// The arithmetic of products with it.
    pub fn precision(&self) -> Precision {
        self.0.precision()
    }

    /// Bytes held.
    pub fn size_bytes(&self) -> usize {
        self.0.size_bytes()
    }
}

/// The right operand `B` (`k x n`) packed once for the kernel in use ([`isa`]), or rounded to
/// bf16 for the tile unit ([`Precision::Bf16`]), so products with it skip packing it (MatMul /
/// Gemm weights).
pub struct PackedB(Repr);

impl PackedB {
    pub fn new(k: usize, n: usize, b: Mat) -> PackedB {
        PackedB(Repr::F32(Box::new(Packed::new(
            b.t(),
            n,
            k,
            isa().tile().1,
        ))))
    }

    /// `b` packed as [`PackedB::new`] packs it, in this operand's memory (no allocation once it
    /// is large enough): for operands packed anew at every call, such as attention's keys and
    /// values.
    pub fn repack(&mut self, k: usize, n: usize, b: Mat) {
        match &mut self.0 {
            Repr::F32(p) => p.repack(b.t(), n, k, isa().tile().1),
            _ => *self = PackedB::new(k, n, b),
        }
    }

    /// Packed in `precision` (products with a [`Precision::Bf16`] operand need
    /// [`bf16_supported`]).
    pub fn with_precision(k: usize, n: usize, b: Mat, precision: Precision) -> PackedB {
        match precision {
            Precision::F32 => PackedB::new(k, n, b),
            Precision::Bf16 => PackedB(Repr::Bf16(bf16::Bf16Operand::panels(b.t(), n, k))),
        }
    }

    /// Rows (`k`).
    pub fn k(&self) -> usize {
        self.0.rows_k().1
    }

    /// Columns (`n`).
    pub fn n(&self) -> usize {
        self.0.rows_k().0
    }

    /// The arithmetic of products with it.
    pub fn precision(&self) -> Precision {
        self.0.precision()
    }

    /// Bytes held.
    pub fn size_bytes(&self) -> usize {
        self.0.size_bytes()
    }
}

/// The left operand of [`gemm_ex`].
#[derive(Clone, Copy)]
pub enum Lhs<'a> {
    Mat(Mat<'a>),
    Packed(&'a PackedA),
}

/// The right operand of [`gemm_ex`].
#[derive(Clone, Copy)]
pub enum Rhs<'a> {
    Mat(Mat<'a>),
    Packed(&'a PackedB),
    /// A convolution's patch matrix, packed straight from the input image (implicit im2col;
    /// f32 products only).
    Patches(&'a Patches<'a>),
}

/// An operand packed block by block as the loop goes: a strided matrix, or the transposed patch
/// matrix of a convolution (output positions as rows) seen from row `j0`, step `r0`.
#[derive(Clone, Copy)]
enum Src<'a> {
    Mat(Mat<'a>),
    Patches {
        x: &'a Patches<'a>,
        j0: usize,
        r0: usize,
    },
}

impl<'a> Src<'a> {
    /// The operand starting at row `i`, step `p`.
    fn offset(self, i: usize, p: usize) -> Src<'a> {
        match self {
            Src::Mat(m) => Src::Mat(m.offset(i, p)),
            Src::Patches { x, j0, r0 } => Src::Patches {
                x,
                j0: j0 + i,
                r0: r0 + p,
            },
        }
    }

    /// Packs `rows x kc` from the start into panels of `w` rows (see [`pack`]).
    fn pack(self, rows: usize, kc: usize, w: usize, dst: &mut [f32]) {
        match self {
            Src::Mat(m) => pack(m, rows, kc, w, dst),
            Src::Patches { x, j0, r0 } => patches::pack(x, j0, r0, rows, kc, w, dst),
        }
    }
}

/// One operand as the blocked loop reads it: `X` (`rows x k`; A, or B transposed).
#[derive(Clone, Copy)]
enum Side<'a> {
    /// Packed block by block as the loop goes.
    Raw(Src<'a>),
    /// Packed whole in the kernel's width (`pad` = rows rounded up to it).
    Whole(&'a [f32], usize),
    /// A packed operand, in whatever width the side needs.
    Pre(&'a Packed),
    /// A's rows read in place by the kernels (`cs == 1`): a product whose B is one or two
    /// panels wide would use each packed A value once or twice, so packing it costs as much as
    /// the product ([`IN_PLACE_MAX_N`]).
    InPlace(Mat<'a>),
    /// B's rows read in place as the kernels' panels (`X = B^T` with `rs == 1`: each step's
    /// lanes contiguous, steps `cs` apart; [`reads_b_in_place`]); only the right edge's panel,
    /// narrower than the kernel, is packed.
    Lanes(Mat<'a>),
}

impl<'a> Side<'a> {
    /// The whole-packed data in width `w`, if it is.
    fn whole(self, rows: usize, w: usize) -> Option<(&'a [f32], usize)> {
        match self {
            Side::Raw(_) | Side::InPlace(_) | Side::Lanes(_) => None,
            Side::Whole(d, pad) => Some((d, pad)),
            Side::Pre(p) => Some((p.get(w), rows.next_multiple_of(w))),
        }
    }
}

/// A raw pointer to C that tasks may share: each task writes a disjoint part.
#[derive(Clone, Copy)]
struct CPtr(*mut f32);
// SAFETY: tasks write disjoint regions of C (different rows or columns), and the entry points
// keep C borrowed mutably until every task has finished.
unsafe impl Send for CPtr {}
// SAFETY: as above.
unsafe impl Sync for CPtr {}

/// A product as the blocked loop runs it (possibly the transposed one): C through strides,
/// `beta` already applied (`acc`: add to C), the bias in this product's rows and columns.
#[derive(Clone, Copy)]
struct Prob<'a> {
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: Side<'a>,
    b: Side<'a>,
    c: CPtr,
    rsc: usize,
    csc: usize,
    acc: bool,
    row_bias: Option<&'a [f32]>,
    col_bias: Option<&'a [f32]>,
    act: Act,
    /// The residual, addressed as C is (its extent checked against C's).
    z: Option<ZPtr>,
    has_epi: bool,
}

/// The residual's start, shared by tasks that only read it.
#[derive(Clone, Copy)]
struct ZPtr(*const f32);
// SAFETY: the residual is only read, and stays borrowed until every task has finished.
unsafe impl Send for ZPtr {}
// SAFETY: as above.
unsafe impl Sync for ZPtr {}

thread_local! {
    /// Each thread's packing buffers for A and B blocks, kept between calls.
    static SCRATCH: RefCell<(Aligned, Aligned)> = const { RefCell::new((Aligned::new(), Aligned::new())) };
    /// The calling thread's buffers for operands (A, B) packed whole for all tasks.
    static SHARED: RefCell<(Aligned, Aligned)> = const { RefCell::new((Aligned::new(), Aligned::new())) };
}

/// Grows `v` to at least `n` floats (contents unspecified: the packers write every float).
fn at_least(v: &mut Aligned, n: usize) -> &mut [f32] {
    v.resize_for(4 * n);
    v.f32s_mut()
}

/// One task's share of the product: rows `i0..i1` and columns `j0..j1` of C. Where a side is
/// packed whole, the range on it starts on a panel boundary.
///
/// # Safety
/// `p.c` addresses the product's C (rows `m`, columns `n`, strides `rsc`, `csc`) and nobody
/// else writes this range during the call; the CPU supports `K`.
unsafe fn run_block<K: Micro>(p: &Prob, i0: usize, i1: usize, j0: usize, j1: usize) {
    let (mr, nr) = (K::MR, K::NR);
    let (mut sa, mut sb) = SCRATCH.with(|s| std::mem::take(&mut *s.borrow_mut()));
    let a_whole = p.a.whole(p.m, mr);
    let b_whole = p.b.whole(p.n, nr);
    let rows = i1 - i0;
    // Row blocks of equal size (whole MR panels), at most MC + MR - 1 rows.
    let mcb = rows.div_ceil(rows.div_ceil(MC)).next_multiple_of(mr);
    let ncb = nc();
    for jc in (j0..j1).step_by(ncb) {
        let nc = ncb.min(j1 - jc);
        let kcb = kc();
        for pc in (0..p.k).step_by(kcb) {
            let kc = kcb.min(p.k - pc);
            let last = pc + kc == p.k;
            let acc = p.acc || pc > 0;
            // B's panels: packed (`ldb` = nr), or B's rows in place (`lanes`: the block's
            // whole panels; its narrower last panel is packed as panel 0 of the buffer).
            let whole_panels = nc / nr * nr;
            let (bp, lanes): (&[f32], Option<Mat>) = match (b_whole, p.b) {
                (Some((d, pad)), _) => (&d[pc * pad + jc * kc..], None),
                (None, Side::Raw(x)) => {
                    let buf = at_least(&mut sb, nc.next_multiple_of(nr) * kc);
                    x.offset(jc, pc).pack(nc, kc, nr, buf);
                    (buf, None)
                }
                (None, Side::Lanes(x)) => {
                    let x = x.offset(jc, pc);
                    let buf = at_least(&mut sb, nr * kc);
                    if whole_panels < nc {
                        pack(x.offset(whole_panels, 0), nc - whole_panels, kc, nr, buf);
                    }
                    (buf, Some(x))
                }
                (None, _) => unreachable!(),
            };
            for ic in (i0..i1).step_by(mcb) {
                let mc = mcb.min(i1 - ic);
                let ap: Result<&[f32], Mat> = match (a_whole, p.a) {
                    (Some((d, pad)), _) => Ok(&d[pc * pad + ic * kc..]),
                    (None, Side::Raw(x)) => {
                        let buf = at_least(&mut sa, mc.next_multiple_of(mr) * kc);
                        x.offset(ic, pc).pack(mc, kc, mr, buf);
                        Ok(buf)
                    }
                    (None, Side::InPlace(x)) => Err(x.offset(ic, pc)),
                    (None, _) => unreachable!(),
                };
                let tiles = mc.div_ceil(mr);
                let lines = (kc * nr).div_ceil(16);
                let tile = |jr: usize, ir: usize, fetch: &[f32]| {
                    let cols = nr.min(nc - jr);
                    let j = jc + jr;
                    let (bpanel, ldb) = match lanes {
                        // B's rows in place: kc steps of nr lanes, x.cs apart (inside B:
                        // the slice's bounds).
                        Some(x) if jr < whole_panels => {
                            (x.data[jr..][..(kc - 1) * x.cs + nr].as_ptr(), x.cs)
                        }
                        Some(_) => (bp[..kc * nr].as_ptr(), nr),
                        None => (bp[jr * kc..][..kc * nr].as_ptr(), nr),
                    };
                    let rws = mr.min(mc - ir);
                    let i = ic + ir;
                    let apanel = match ap {
                        Ok(ap) => APanel {
                            ptr: ap[ir * kc..][..kc * mr].as_ptr(),
                            lda: 0,
                        },
                        // Rows ir.. of the block, `kc` steps each (inside A: `check`).
                        Err(x) => APanel {
                            ptr: x.data[ir * x.rs..][..kc].as_ptr(),
                            lda: x.rs,
                        },
                    };
                    // The residual joins with the first block of K (where C's old value would),
                    // the biases and the activation with the last.
                    let z = p.z.filter(|_| pc == 0);
                    let epi = ((last && p.has_epi) || z.is_some()).then(|| TileEpi {
                        row: match p.row_bias {
                            Some(v) if last => v[i..].as_ptr(),
                            _ => std::ptr::null(),
                        },
                        col: match p.col_bias {
                            Some(v) if last => v[j..].as_ptr(),
                            _ => std::ptr::null(),
                        },
                        // SAFETY: (i, j) lies inside the residual, which has C's extent.
                        z: z.map_or(std::ptr::null(), |z| unsafe {
                            z.0.add(i * p.rsc + j * p.csc)
                        }),
                        act: if last { p.act } else { Act::Identity },
                    });
                    let out = Out {
                        // SAFETY: (i, j) lies inside the product's C (the caller's extent).
                        c: unsafe { p.c.0.add(i * p.rsc + j * p.csc) },
                        rsc: p.rsc,
                        csc: p.csc,
                        alpha: p.alpha,
                        acc,
                        epi,
                        fetch: fetch.as_ptr(),
                        fetch_lines: fetch.len().div_ceil(16),
                    };
                    // SAFETY: the panels were sliced to kc * MR and kc steps of NR floats (A read
                    // in place: its rws rows of kc steps lie inside A, checked at entry); the rws x
                    // cols tile lies inside this task's range of C, and the bias slices were
                    // checked to cover every row and column; the ISA was checked by the caller.
                    unsafe { K::tile(kc, apanel, bpanel, ldb, rws, cols, &out) };
                };
                if b_whole.is_some() {
                    // B packed ahead (a weight) comes from memory on its first use, panel after
                    // panel, each then reused from cache by every row tile: while one panel's
                    // row tiles run, the next panel is fetched into L2, a share within each
                    // tile (the hardware prefetcher sees no misses to follow within a panel).
                    let ahead = prefetches_panels(nr);
                    for jr in (0..nc).step_by(nr) {
                        let next = (ahead && jr + nr < nc)
                            .then(|| &bp[(jr + nr) * kc..][..kc * nr.min(nc - jr - nr)]);
                        for ir in (0..mc).step_by(mr) {
                            // This tile's share of the next panel, asked for within its steps
                            // (a burst of prefetches before the tile stalls on the line fill
                            // buffers as a miss would).
                            let share =
                                next.map_or(&[][..], |next| share_of(next, lines, ir / mr, tiles));
                            tile(jr, ir, share);
                        }
                    }
                } else {
                    // B packed just now (in L2): a strip of MR rows of C at a time, along all
                    // of the block's columns, so C is written as MR sequential streams (the
                    // other order writes one tile into each of mc rows in turn: more streams
                    // than the hardware prefetcher follows, each store a miss when C is cold,
                    // as a fresh output is).
                    // An A packed ahead (a convolution's filter) comes from memory: each strip's
                    // tiles ask for a share of the next strip's panel.
                    let next_a = |ir: usize| match ap {
                        Ok(ap) if a_whole.is_some() && ir + mr < mc && prefetches_panels(nr) => {
                            &ap[(ir + mr) * kc..][..kc * mr.min(mc - ir - mr)]
                        }
                        _ => &[],
                    };
                    let strip = nc.div_ceil(nr);
                    for ir in (0..mc).step_by(mr) {
                        let next = next_a(ir);
                        let lines = next.len().div_ceil(16);
                        for (t, jr) in (0..nc).step_by(nr).enumerate() {
                            tile(jr, ir, share_of(next, lines, t, strip));
                        }
                    }
                }
            }
        }
    }
    SCRATCH.with(|s| *s.borrow_mut() = (sa, sb));
}

/// Part `t` of `parts` of the first `lines` cache lines (16 floats each) of `next`: what one
/// tile asks for of the next panel (clipped to `next`).
fn share_of(next: &[f32], lines: usize, t: usize, parts: usize) -> &[f32] {
    let l0 = (t * lines / parts * 16).min(next.len());
    let l1 = ((t + 1) * lines / parts * 16).min(next.len());
    &next[l0..l1]
}

/// True when a product streaming an operand packed ahead (B in panels `nr` wide, or a
/// convolution's filter as A) asks for its next panel while the current one's tiles run
/// (`Out::fetch`), one line at a time within the tile's steps. Measured to pay on a Xeon with
/// AMX (one thread, B from memory: 128 x 3072 x 768 114-120 -> 125-146 GFLOP/s), on a Xeon
/// without AMX (2 MB L2; one thread, fastest of 21, operand from memory: B packed ahead 197 x
/// 3072 x 768 131 -> 166 GFLOP/s, 197 x 768 x 3072 132 -> 163, a filter as A 2048 x 49 x 512 95
/// -> 127, 256 x 196 x 1024 138 -> 149) and on an AMD Zen 5 (1 MB L2; one thread, fastest of 9:
/// a filter as A 256 x 196 x 1024 212 -> 232, 2048 x 49 x 512 193 -> 217, 197 x 768 x 3072 218
/// -> 236; whole networks, one thread, alternated runs: ResNet-50 35.3-38.0 -> 31.5-32.7 ms,
/// BERT-base 100.6-103.4 -> 93.7-95.3, ViT-B/16 159-163 -> 153-156; two threads 3-7% too).
/// On a Zen 4 an earlier form (a burst of prefetches before each tile, which holds the line
/// fill buffers as misses do) cost the AVX-512 kernel's 32-wide panels 5-13% (BERT-base 7%);
/// the form above was not measured there, so AMD's family 25 (Zen 3 and 4) keeps it off for
/// those panels (its AVX2 kernel's 16-wide ones gained). `FERRUM_GEMM_PREFETCH=0` or `1`
/// overrides.
fn prefetches_panels(nr: usize) -> bool {
    static ON: OnceLock<Option<bool>> = OnceLock::new();
    let forced = *ON.get_or_init(|| match std::env::var("FERRUM_GEMM_PREFETCH").as_deref() {
        Ok("0") => Some(false),
        Ok("1") => Some(true),
        _ => None,
    });
    let zen4 = crate::cpu::vendor() == crate::cpu::Vendor::Amd && crate::cpu::family() <= 25;
    forced.unwrap_or(!zen4 || nr < 32)
}

/// How a product is split among tasks: a grid of `tm x tn` ranges of `per_m` rows and `per_n`
/// columns (the last of each shorter).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Split {
    tm: usize,
    tn: usize,
    per_m: usize,
    per_n: usize,
}

/// The split of an `m x n` product into at most `tasks` ranges that costs least: the largest
/// range's multiply-adds (rows counted in kernel rows, columns in the kernel's padded columns)
/// plus about 4 multiply-adds per float packed up front for sharing (a row split shares B,
/// `n x k`, a column split A, `m x k`). `a_pre` / `b_pre`: the side is already packed whole (its
/// ranges start on panel boundaries).
fn plan_split<K: Micro>(
    m: usize,
    n: usize,
    k: usize,
    tasks: usize,
    a_pre: bool,
    b_pre: bool,
) -> Split {
    let (mr, nr) = (K::MR, K::NR);
    // An edge tile of r < MR rows costs r rows, but at least 4 (shorter ones wait on latency).
    let row_cost = |r: usize| {
        r - r % mr
            + if r.is_multiple_of(mr) {
                0
            } else {
                (r % mr).max(4)
            }
    };
    let col_cost = |c: usize| {
        let rem = c % nr;
        c - rem
            + match rem {
                0 => 0,
                // The AVX-512 kernel has a 16-column edge.
                r if nr == 32 && r <= 16 => 16,
                _ => nr,
            }
    };
    let mut best: Option<(usize, Split)> = None;
    for tm in (1..=tasks).filter(|tm| tasks.is_multiple_of(*tm)) {
        let tn = tasks / tm;
        // Ranges on a side that is packed whole (ahead, or for sharing) start on its panels.
        let step_m = if a_pre || tn > 1 { mr } else { 4 };
        let step_n = if b_pre || tm > 1 { nr } else { nr / 2 };
        let per_m = m.div_ceil(tm).next_multiple_of(step_m).min(m);
        let per_n = n.div_ceil(tn).next_multiple_of(step_n).min(n);
        let shared =
            if tm > 1 && !b_pre { n * k } else { 0 } + if tn > 1 && !a_pre { m * k } else { 0 };
        let cost = row_cost(per_m) * col_cost(per_n) * k + 4 * shared;
        let split = Split {
            tm,
            tn,
            per_m,
            per_n,
        };
        if best.is_none_or(|(c, _)| cost < c) {
            best = Some((cost, split));
        }
    }
    best.expect("gemm: a split").1
}

/// Runs the product on up to `threads` tasks with kernel `K`.
///
/// # Safety
/// As [`run_block`] for the whole product.
unsafe fn run_product<K: Micro>(p: &Prob, threads: usize) {
    let (mr, nr) = (K::MR, K::NR);
    let work = p.m * p.n * p.k;
    let tasks = threads.min(work / MIN_TASK_MACS).max(1);
    if tasks == 1 {
        // SAFETY: forwarded from the caller.
        return unsafe { run_block::<K>(p, 0, p.m, 0, p.n) };
    }
    let a_pre = !matches!(p.a, Side::Raw(_));
    let b_pre = !matches!(p.b, Side::Raw(_));
    let sp = plan_split::<K>(p.m, p.n, p.k, tasks, a_pre, b_pre);
    let (mut sa, mut sb) = SHARED.with(|s| std::mem::take(&mut *s.borrow_mut()));
    let mut q = *p;
    // Every task in a column of the grid reads all of its B range, every task in a row all of
    // its A range: pack what is shared once, together.
    if let (Side::Raw(x), true) = (p.b, sp.tm > 1) {
        let buf = at_least(&mut sb, packed_len(p.n, p.k, nr));
        pack_whole(x, p.n, p.k, nr, tasks, buf);
        q.b = Side::Whole(buf, p.n.next_multiple_of(nr));
    }
    if let (Side::Raw(x), true) = (p.a, sp.tn > 1) {
        let buf = at_least(&mut sa, packed_len(p.m, p.k, mr));
        pack_whole(x, p.m, p.k, mr, tasks, buf);
        q.a = Side::Whole(buf, p.m.next_multiple_of(mr));
    }
    let (gm, gn) = (p.m.div_ceil(sp.per_m), p.n.div_ceil(sp.per_n));
    let q = &q;
    pool::parallel_for(gm * gn, |t| {
        let (i0, j0) = (t / gn * sp.per_m, t % gn * sp.per_n);
        let (i1, j1) = ((i0 + sp.per_m).min(q.m), (j0 + sp.per_n).min(q.n));
        // SAFETY: tasks write disjoint ranges of C; ranges on a side packed whole start on its
        // panels (`plan_split`); forwarded from the caller.
        unsafe { run_block::<K>(q, i0, i1, j0, j1) };
    });
    // Keep the buffers for the next call unless they are large.
    let keep = |v: Aligned| {
        if v.len() <= 4 << 22 {
            v
        } else {
            Aligned::new()
        }
    };
    SHARED.with(|s| *s.borrow_mut() = (keep(sa), keep(sb)));
}

/// Dispatches [`run_product`] to the microkernel for `isa`.
///
/// # Safety
/// As [`run_product`]; `isa` must be supported by this CPU.
unsafe fn run_isa(isa: Isa, p: &Prob, threads: usize) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => run_product::<x86::Avx512<AVX512_MR>>(p, threads),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => run_product::<x86::Avx2>(p, threads),
            _ => run_product::<Scalar>(p, threads),
        }
    }
}

/// `C = alpha * A * B + beta * C` for an `m x k` A, a `k x n` B and a row-major `m x n` C with
/// row stride `ldc`, on the pool's threads with the best microkernel. `beta == 0` ignores C's old
/// contents. Panics when a view is too short for its shape.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: Mat,
    b: Mat,
    beta: f32,
    c: &mut [f32],
    ldc: usize,
) {
    gemm_with(isa(), pool::threads(), m, n, k, alpha, a, b, beta, c, ldc)
}

/// [`gemm`] with a chosen microkernel family and at most `threads` tasks (for tests and
/// benchmarks). Panics when `isa` is not supported by this CPU.
#[allow(clippy::too_many_arguments)]
pub fn gemm_with(
    isa: Isa,
    threads: usize,
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: Mat,
    b: Mat,
    beta: f32,
    c: &mut [f32],
    ldc: usize,
) {
    gemm_ex_with(
        isa,
        threads,
        m,
        n,
        k,
        alpha,
        Lhs::Mat(a),
        Rhs::Mat(b),
        beta,
        c,
        ldc,
        &Epilogue::NONE,
    )
}

/// `C = act(alpha * A * B + beta * C + bias)` (see [`Epilogue`]) for an `m x k` A and a `k x n`
/// B, either of them packed ahead, into a row-major `m x n` C with row stride `ldc`, on the
/// pool's threads with the best microkernel. `beta == 0` ignores C's old contents. Panics when a
/// view, a packed operand or a bias does not fit the shape.
#[allow(clippy::too_many_arguments)]
pub fn gemm_ex(
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: Lhs<'_>,
    b: Rhs<'_>,
    beta: f32,
    c: &mut [f32],
    ldc: usize,
    epi: &Epilogue<'_>,
) {
    gemm_ex_with(
        isa(),
        pool::threads(),
        m,
        n,
        k,
        alpha,
        a,
        b,
        beta,
        c,
        ldc,
        epi,
    )
}

/// [`gemm_ex`] with a chosen microkernel family and at most `threads` tasks. Panics when `isa`
/// is not supported by this CPU.
#[allow(clippy::too_many_arguments)]
pub fn gemm_ex_with(
    isa: Isa,
    threads: usize,
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: Lhs<'_>,
    b: Rhs<'_>,
    beta: f32,
    c: &mut [f32],
    ldc: usize,
    epi: &Epilogue<'_>,
) {
    gemm_dst(
        isa,
        threads,
        m,
        n,
        k,
        alpha,
        a,
        b,
        beta,
        Dst::Init(c),
        ldc,
        epi,
    )
}

/// `C = alpha * A * B` (with the epilogue) written into memory not yet initialised (a fresh
/// output's capacity), on the pool's threads with the best microkernel: the first `n` elements
/// of each of C's `m` rows (row stride `ldc`) are written, nothing is read; a caller that
/// allocated exactly `m x n` with `ldc == n` owns an initialised C afterwards. Saves the
/// zero-filling pass an initialised C would cost (its own memory pass on products with small K).
#[allow(clippy::too_many_arguments)]
pub fn gemm_ex_uninit(
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: Lhs<'_>,
    b: Rhs<'_>,
    c: &mut [MaybeUninit<f32>],
    ldc: usize,
    epi: &Epilogue<'_>,
) {
    gemm_dst(
        isa(),
        pool::threads(),
        m,
        n,
        k,
        alpha,
        a,
        b,
        0.0,
        Dst::Uninit(c),
        ldc,
        epi,
    )
}

/// The C of a product: initialised (read when `beta != 0`), or not (never read, `beta == 0`).
enum Dst<'c> {
    Init(&'c mut [f32]),
    Uninit(&'c mut [MaybeUninit<f32>]),
}

#[allow(clippy::too_many_arguments)]
fn gemm_dst(
    isa: Isa,
    threads: usize,
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: Lhs<'_>,
    b: Rhs<'_>,
    beta: f32,
    mut c: Dst<'_>,
    ldc: usize,
    epi: &Epilogue<'_>,
) {
    assert!(isa_available(isa), "gemm: {isa:?} unsupported");
    if m == 0 || n == 0 {
        return;
    }
    let c_len = match &c {
        Dst::Init(c) => c.len(),
        Dst::Uninit(c) => {
            assert!(beta == 0.0, "gemm: an uninitialised C with beta {beta}");
            c.len()
        }
    };
    assert!(ldc >= n, "gemm: ldc {ldc} < n {n}");
    assert!(
        (m - 1) * ldc + n <= c_len,
        "gemm: C ({m} x {n}, ldc {ldc}) exceeds its {c_len} elements"
    );
    // Both operands as X (rows x k): A, and B transposed.
    match a {
        Lhs::Mat(v) => v.check(m, k, "A"),
        Lhs::Packed(p) => assert!(p.0.rows_k() == (m, k), "gemm: PackedA shape"),
    }
    match b {
        Rhs::Mat(v) => v.check(k, n, "B"),
        Rhs::Packed(p) => assert!(p.0.rows_k() == (n, k), "gemm: PackedB shape"),
        Rhs::Patches(x) => assert!(
            (x.rows(), x.cols()) == (k, n),
            "gemm: patches of {} x {} for B of {k} x {n}",
            x.rows(),
            x.cols()
        ),
    }
    let (row_bias, col_bias) = match epi.bias {
        Bias::None => (None, None),
        Bias::Row(v) => {
            assert!(v.len() >= m, "gemm: row bias of {} for {m} rows", v.len());
            (Some(&v[..m]), None)
        }
        Bias::Col(v) => {
            assert!(
                v.len() >= n,
                "gemm: column bias of {} for {n} columns",
                v.len()
            );
            (None, Some(&v[..n]))
        }
    };
    if let Some(z) = epi.residual {
        assert!(
            (m - 1) * ldc + n <= z.len(),
            "gemm: residual of {} for C ({m} x {n}, ldc {ldc})",
            z.len()
        );
    }
    // beta: 0 overwrites C (first K block), 1 accumulates, anything else scales C first.
    let acc = beta != 0.0;
    if let (Dst::Init(c), true) = (&mut c, beta != 0.0 && beta != 1.0) {
        for i in 0..m {
            c[i * ldc..][..n].iter_mut().for_each(|v| *v *= beta);
        }
    }
    if k == 0 {
        let value = |i: usize, j: usize, x: f32| {
            if epi.is_none() {
                return x;
            }
            let mut v = x;
            if let Some(z) = epi.residual {
                v += z[i * ldc + j];
            }
            if let Some(b) = row_bias {
                v += b[i];
            }
            if let Some(b) = col_bias {
                v += b[j];
            }
            epi.act.apply(v)
        };
        for i in 0..m {
            match &mut c {
                Dst::Init(c) => {
                    for (j, v) in c[i * ldc..][..n].iter_mut().enumerate() {
                        *v = value(i, j, if acc { *v } else { 0.0 });
                    }
                }
                Dst::Uninit(c) => {
                    for (j, v) in c[i * ldc..][..n].iter_mut().enumerate() {
                        v.write(value(i, j, 0.0));
                    }
                }
            }
        }
        return;
    }
    let c_ptr = match c {
        Dst::Init(c) => c.as_mut_ptr(),
        // The kernels only write through it (`acc` is false: beta is 0, checked above).
        Dst::Uninit(c) => c.as_mut_ptr().cast::<f32>(),
    };
    // A bf16 operand makes the product bf16 (the other operand is rounded at the call).
    if let Some((sa, sb)) = bf16_sources(a, b) {
        assert!(
            epi.residual.is_none(),
            "gemm: a residual epilogue on a bf16 product"
        );
        let d = bf16::Dest {
            c: CPtr(c_ptr),
            ldc,
            alpha,
            acc,
            row_bias,
            col_bias,
            act: epi.act,
            epi: !epi.is_none(),
        };
        return bf16::gemm(m, n, k, sa, sb, &d, threads);
    }
    // Both operands as X (rows x k): A, and B transposed.
    let in_place = matches!(a, Lhs::Mat(v) if v.cs == 1) && reads_a_in_place(isa, n, k);
    let xa = match a {
        Lhs::Mat(v) if in_place => Side::InPlace(v),
        Lhs::Mat(v) => Side::Raw(Src::Mat(v)),
        Lhs::Packed(PackedA(Repr::F32(p))) => Side::Pre(p),
        Lhs::Packed(_) => unreachable!("bf16 handled above"),
    };
    let xb = match b {
        Rhs::Mat(v) => Side::Raw(Src::Mat(v.t())),
        Rhs::Patches(x) => Side::Raw(Src::Patches { x, j0: 0, r0: 0 }),
        Rhs::Packed(PackedB(Repr::F32(p))) => Side::Pre(p),
        Rhs::Packed(_) => unreachable!("bf16 handled above"),
    };
    let mut p = Prob {
        m,
        n,
        k,
        alpha,
        a: xa,
        b: xb,
        c: CPtr(c_ptr),
        rsc: ldc,
        csc: 1,
        acc,
        row_bias,
        col_bias,
        act: epi.act,
        z: epi.residual.map(|z| ZPtr(z.as_ptr())),
        has_epi: !epi.is_none(),
    };
    if !in_place && swaps(isa, m, n) {
        p = Prob {
            m: n,
            n: m,
            a: xb,
            b: xa,
            rsc: 1,
            csc: ldc,
            row_bias: col_bias,
            col_bias: row_bias,
            ..p
        };
    }
    if let Side::Raw(Src::Mat(x)) = p.b {
        if reads_b_in_place(isa, x) {
            p.b = Side::Lanes(x);
        }
    }
    // SAFETY: C's extent was checked above and C is borrowed mutably until the call returns
    // (an uninitialised C is only written: `acc` is false); the bias slices cover the rows and
    // columns; the ISA is supported.
    unsafe { run_isa(isa, &p, threads) };
}

/// The operands of a bf16 product (`B` as `X = B^T`), when either is packed in bf16. Panics
/// when the other is packed in f32: a product has one precision.
fn bf16_sources<'a>(a: Lhs<'a>, b: Rhs<'a>) -> Option<(bf16::Src<'a>, bf16::Src<'a>)> {
    let a16 = matches!(a, Lhs::Packed(PackedA(Repr::Bf16(_))));
    let b16 = matches!(b, Rhs::Packed(PackedB(Repr::Bf16(_))));
    if !a16 && !b16 {
        return None;
    }
    let sa = match a {
        Lhs::Mat(v) => bf16::Src::Raw(v),
        Lhs::Packed(PackedA(Repr::Bf16(o))) => bf16::Src::Ready(o),
        Lhs::Packed(_) => panic!("gemm: an f32-packed A with a bf16-packed B"),
    };
    let sb = match b {
        Rhs::Mat(v) => bf16::Src::Raw(v.t()),
        Rhs::Patches(_) => panic!("gemm: implicit patches with a bf16-packed A"),
        Rhs::Packed(PackedB(Repr::Bf16(o))) => bf16::Src::Ready(o),
        Rhs::Packed(_) => panic!("gemm: a bf16-packed A with an f32-packed B"),
    };
    Some((sa, sb))
}

/// `count` independent products `C_i = alpha * A_i B_i` (`A_i = a(i)`, `m x k`; `B_i = b(i)`,
/// `k x n`), product `i` written row-major into `c[i * m * n..][..m * n]`, spread over the pool's
/// threads (across the batch, and within products when there are fewer than threads). Attention
/// heads: many products each too small to split.
#[allow(clippy::too_many_arguments)]
pub fn gemm_batch<'a>(
    count: usize,
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: &(dyn Fn(usize) -> Mat<'a> + Sync),
    b: &(dyn Fn(usize) -> Mat<'a> + Sync),
    c: &mut [f32],
) {
    gemm_batch_with(isa(), pool::threads(), count, m, n, k, alpha, a, b, c)
}

/// [`gemm_batch`] with a chosen microkernel family and at most `threads` tasks at a time.
#[allow(clippy::too_many_arguments)]
pub fn gemm_batch_with<'a>(
    isa: Isa,
    threads: usize,
    count: usize,
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: &(dyn Fn(usize) -> Mat<'a> + Sync),
    b: &(dyn Fn(usize) -> Mat<'a> + Sync),
    c: &mut [f32],
) {
    let size = m * n;
    assert!(
        c.len() >= count * size,
        "gemm_batch: C holds {} floats, {count} products of {m} x {n} need {}",
        c.len(),
        count * size
    );
    if count == 0 || size == 0 {
        return;
    }
    let threads = threads.max(1);
    let tasks_max = threads.min((count * size * k) / MIN_TASK_MACS).max(1);
    // Row chunks per product: whole products when they divide evenly among the threads (or are
    // many), else each product split so that every thread gets a share of each.
    let split = if tasks_max == 1 || count.is_multiple_of(tasks_max) || count >= 4 * tasks_max {
        1
    } else {
        tasks_max.min(m.div_ceil(8)).max(1)
    };
    let rows = m.div_ceil(split);
    let mut parts: Vec<Mutex<(usize, usize, &mut [f32])>> = Vec::new();
    for (i, ci) in c[..count * size].chunks_mut(size).enumerate() {
        for (r, cr) in ci.chunks_mut(rows * n).enumerate() {
            parts.push(Mutex::new((i, r * rows, cr)));
        }
    }
    let run = |t: usize| {
        let mut g = parts[t].lock().unwrap();
        let (i, r0, ref mut ct) = *g;
        let h = ct.len() / n;
        gemm_ex_with(
            isa,
            1,
            h,
            n,
            k,
            alpha,
            Lhs::Mat(a(i).offset(r0, 0)),
            Rhs::Mat(b(i)),
            0.0,
            ct,
            n,
            &Epilogue::NONE,
        );
    };
    if tasks_max > 1 {
        pool::parallel_for(parts.len(), run);
    } else {
        (0..parts.len()).for_each(run);
    }
}
