//! The opt-in bf16 product ([`super::Precision::Bf16`]): both operands rounded to bf16 (to
//! nearest even, the GGUF rounding of `f32_to_bf16_bits`), products exact, sums in f32, on the
//! AMX tile unit where the CPU has one (`tdpbf16ps`: per step a 16 x 16 f32 C tile += a 16 x 32
//! A tile times a 32 x 16 B tile, the 32 in pairs), else on AVX512-BF16's dot product
//! (`vdpbf16ps`: per instruction 16 f32 lanes += the products of 16 bf16 pairs; AMD Zen 4,
//! Intel Cooper Lake).
//!
//! A weight is rounded and laid out once ([`Bf16Operand`], inside a [`super::PackedA`] or
//! [`super::PackedB`]); the other operand is rounded and laid out at each product, into the
//! calling thread's buffer. Two arrangements, both with the inner dimension padded with zeros
//! to `kp`, a multiple of 32, and the rows padded with zeros to a multiple of 16:
//! - **rows** (the A side): row `i`, element `p` at `i * kp + p`; an A tile is 16 rows of 64
//!   bytes read `2 kp` bytes apart;
//! - **panels** (the B side, held as `X = B^T`): panels of 16 columns of B, k in pairs: panel
//!   `q`, pair `g`, column `c`, element `r` at `q * kp * 16 + g * 32 + c * 2 + r`; a B tile is
//!   16 consecutive pairs of a panel (1 KiB, contiguous).
//!
//! Blocks of 32 x 32 (two A tiles, two B tiles, four C tiles; 16-wide at the edges) run over the
//! whole inner dimension; each C tile is then stored to memory and written into C with `alpha`,
//! the old C, the bias and the activation ([`super::write_tile`] or the AVX-512 writer). The
//! threads split C into column blocks and row ranges. [`super::gemm_ref`] on the rounded
//! operands is the reference the randomized tests hold it to.

use super::{write_tile, Act, CPtr, Mat, Out, TileEpi};
use crate::aligned::Aligned;
use crate::pool;
use crate::quant::blocks::f32_to_bf16_bits;

use std::cell::RefCell;

/// Inner-dimension step of one tile product (16 pairs).
const KSTEP: usize = 32;
/// Rows (and columns) of a tile.
const T: usize = 16;
/// Multiply-adds below which a product stays on one thread.
const MIN_PARALLEL_MACS: usize = 1 << 18;

/// True when this process runs the bf16 product: AVX-512 with AMX-BF16 (granted by the OS) or
/// with AVX512-BF16.
pub fn supported() -> bool {
    let f = crate::cpu::features();
    cfg!(target_arch = "x86_64") && f.avx512() && (f.amx_bf16 || f.avx512bf16)
}

/// Which unit runs the bf16 products in this process (`None` where [`supported`] is false).
pub fn unit() -> Option<&'static str> {
    if !supported() {
        None
    } else if crate::cpu::features().amx_bf16 {
        Some("AMX")
    } else {
        Some("AVX512-BF16")
    }
}

/// An operand rounded to bf16 and laid out for the tile unit (see the module notes).
pub(super) struct Bf16Operand {
    /// Rows of `X` (A's `m`, or B's `n`) and the inner dimension.
    pub(super) rows: usize,
    pub(super) k: usize,
    /// 64-byte aligned (every tile row within one cache line).
    data: Aligned,
}

impl Bf16Operand {
    /// `x` (`rows x k`) in the rows arrangement (the A side).
    pub(super) fn rows(x: Mat, rows: usize, k: usize) -> Bf16Operand {
        x.check(rows, k, "bf16 operand");
        let mut data = Aligned::zeroed(2 * len(rows, k));
        fill_rows(x, rows, k, data.u16s_mut());
        Bf16Operand { rows, k, data }
    }

    /// `x` (`rows x k`, B transposed) in the panels arrangement (the B side).
    pub(super) fn panels(x: Mat, rows: usize, k: usize) -> Bf16Operand {
        x.check(rows, k, "bf16 operand");
        let mut data = Aligned::zeroed(2 * len(rows, k));
        fill_panels(x, rows, k, data.u16s_mut());
        Bf16Operand { rows, k, data }
    }

    /// Bytes held.
    pub(super) fn size_bytes(&self) -> usize {
        self.data.len()
    }
}

/// One pair of B's rows (`even`, `odd`: columns `0..cols`) rounded into every panel's slot for
/// that pair: panel `q`'s 32 elements at `out[q * stride..]`, column `c` at `2c` (even) and
/// `2c + 1` (odd), zeros past `cols` in the last panel.
fn round_pair(even: &[f32], odd: &[f32], cols: usize, out: &mut [u16], stride: usize) {
    #[cfg(target_arch = "x86_64")]
    if crate::cpu::features().avx512() {
        // SAFETY: AVX-512 checked; `even` and `odd` hold `cols` floats, `out` holds the slot of
        // each of the `cols.div_ceil(16)` panels (checked inside).
        return unsafe { x86::round_pair(even, odd, cols, out, stride) };
    }
    for q in 0..cols.div_ceil(T) {
        for c in 0..T {
            let j = q * T + c;
            let (e, o) = if j < cols {
                (even[j], odd[j])
            } else {
                (0.0, 0.0)
            };
            out[q * stride + 2 * c] = f32_to_bf16_bits(e);
            out[q * stride + 2 * c + 1] = f32_to_bf16_bits(o);
        }
    }
}

/// `k` padded to whole tile steps.
fn kp(k: usize) -> usize {
    k.next_multiple_of(KSTEP)
}

/// Elements of an operand of `rows x k` in either arrangement.
fn len(rows: usize, k: usize) -> usize {
    rows.next_multiple_of(T) * kp(k)
}

/// Rows per parallel chunk of a conversion (about 64 K elements).
fn chunk_rows(k: usize) -> usize {
    ((1usize << 16) / kp(k).max(1)).next_multiple_of(T).max(T)
}

/// Writes `x` (`rows x k`) rounded to bf16 in the rows arrangement into `out` (`len(rows, k)`),
/// padding included; split across the pool for large operands.
fn fill_rows(x: Mat, rows: usize, k: usize, out: &mut [u16]) {
    let kp = kp(k);
    let fill = |c: usize, part: &mut [u16]| {
        let r0 = c * chunk_rows(k);
        for (r, row) in part.chunks_exact_mut(kp).enumerate() {
            let i = r0 + r;
            if i >= rows {
                row.fill(0);
                continue;
            }
            #[cfg(target_arch = "x86_64")]
            if x.cs == 1 && crate::cpu::features().avx512() {
                // SAFETY: AVX-512 checked; the row's k elements lie in `x` (checked by the
                // caller), `row` holds kp >= k.
                unsafe { x86::round_row(&x.data[i * x.rs..][..k], row) };
                continue;
            }
            for (p, d) in row.iter_mut().enumerate() {
                *d = if p < k {
                    f32_to_bf16_bits(x.at(i, p))
                } else {
                    0
                };
            }
        }
    };
    split(out, chunk_rows(k) * kp, fill);
}

/// Writes `x` (`rows x k`, B transposed) rounded to bf16 in the panels arrangement into `out`
/// (`len(rows, k)`), padding included; split across the pool for large operands.
fn fill_panels(x: Mat, rows: usize, k: usize, out: &mut [u16]) {
    let kp = kp(k);
    let fill = |c: usize, part: &mut [u16]| {
        let q0 = c * chunk_rows(k) / T;
        let j0 = q0 * T;
        let cols = (part.len() / kp).min(rows.saturating_sub(j0));
        if x.rs == 1 && cols > 0 {
            // B's rows are contiguous: a pair of rows at a time across every panel (B read row
            // by row, each panel's 64 bytes of the pair written).
            let zeros = vec![0f32; cols];
            let b_row = |p: usize| {
                if p < k {
                    &x.data[j0 + p * x.cs..][..cols]
                } else {
                    &zeros[..]
                }
            };
            for g in 0..kp / 2 {
                round_pair(
                    b_row(2 * g),
                    b_row(2 * g + 1),
                    cols,
                    &mut part[g * 32..],
                    kp * T,
                );
            }
            return;
        }
        for (q, panel) in part.chunks_exact_mut(kp * T).enumerate() {
            let j0 = (q0 + q) * T;
            let cols = T.min(rows.saturating_sub(j0));
            for g in 0..kp / 2 {
                for c in 0..T {
                    for r in 0..2 {
                        let p = 2 * g + r;
                        panel[g * 32 + c * 2 + r] = if c < cols && p < k {
                            f32_to_bf16_bits(x.at(j0 + c, p))
                        } else {
                            0
                        };
                    }
                }
            }
        }
    };
    split(out, chunk_rows(k) * kp, fill);
}

/// Runs `f(chunk index, chunk)` over `out` in chunks of `size`, on the pool when there are
/// several.
fn split(out: &mut [u16], size: usize, f: impl Fn(usize, &mut [u16]) + Sync) {
    if out.is_empty() {
        return;
    }
    if out.len() > size && pool::threads() > 1 {
        pool::parallel_chunks_mut(out, size, f);
    } else {
        for (c, part) in out.chunks_mut(size).enumerate() {
            f(c, part);
        }
    }
}

/// One operand of a product: laid out ahead, or a view rounded at the call.
#[derive(Clone, Copy)]
pub(super) enum Src<'a> {
    Ready(&'a Bf16Operand),
    Raw(Mat<'a>),
}

/// Where a product goes: C (row-major, `ldc`), `alpha`, whether the old C is added, and the
/// epilogue (bias per row or column, activation) when `epi` is set.
pub(super) struct Dest<'a> {
    pub c: CPtr,
    pub ldc: usize,
    pub alpha: f32,
    pub acc: bool,
    pub row_bias: Option<&'a [f32]>,
    pub col_bias: Option<&'a [f32]>,
    pub act: Act,
    pub epi: bool,
}

thread_local! {
    /// The calling thread's buffers for the operands rounded at the call (A, B).
    static BUF: RefCell<(Aligned, Aligned)> = RefCell::new(Default::default());
}

/// `C = act(alpha A B (+ C) + bias)` for A `m x k` and B given as `X = B^T` (`n x k`), at most
/// `threads` tasks.
///
/// Panics unless [`supported`]; the caller has checked the shapes, C's extent and the biases.
pub(super) fn gemm(m: usize, n: usize, k: usize, a: Src, b: Src, d: &Dest, threads: usize) {
    assert!(
        supported(),
        "gemm: a bf16 product on a CPU without AMX-BF16 or AVX512-BF16"
    );
    let shape = |s: &Src, rows: usize| match s {
        Src::Ready(o) => assert!(o.rows == rows && o.k == k, "gemm: bf16 operand shape"),
        Src::Raw(x) => x.check(rows, k, "bf16 operand"),
    };
    shape(&a, m);
    shape(&b, n);
    BUF.with(|cell| {
        let mut bufs = cell.borrow_mut();
        let (abuf, bbuf) = &mut *bufs;
        let ad: &[u16] = match a {
            Src::Ready(o) => o.data.u16s(),
            Src::Raw(x) => {
                abuf.resize_for(2 * len(m, k));
                let v = abuf.u16s_mut();
                fill_rows(x, m, k, v);
                v
            }
        };
        let bd: &[u16] = match b {
            Src::Ready(o) => o.data.u16s(),
            Src::Raw(x) => {
                bbuf.resize_for(2 * len(n, k));
                let v = bbuf.u16s_mut();
                fill_panels(x, n, k, v);
                v
            }
        };
        run(m, n, k, ad, bd, d, threads);
    });
}

/// The blocked product over laid-out operands (see the module notes).
fn run(m: usize, n: usize, k: usize, a: &[u16], b: &[u16], d: &Dest, threads: usize) {
    let (mt, panels) = (m.div_ceil(T), n.div_ceil(T));
    let (row_blocks, col_blocks) = (mt.div_ceil(2), panels.div_ceil(2));
    let threads = if m * n * k < MIN_PARALLEL_MACS {
        1
    } else {
        threads.max(1)
    };
    // Row chunks per column block: enough tasks for two per thread.
    let chunks = (2 * threads).div_ceil(col_blocks).clamp(1, row_blocks);
    let per = row_blocks.div_ceil(chunks);
    let chunks = row_blocks.div_ceil(per);
    let amx = crate::cpu::features().amx_bf16;
    let task = |t: usize| {
        let (blk, ch) = (t / chunks, t % chunks);
        let rb = ch * per..((ch + 1) * per).min(row_blocks);
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `gemm` checked `supported()` (AVX-512, and AMX-BF16 granted where `amx`, else
        // AVX512-BF16); both operands hold `len` elements for their shapes, so every tile read
        // lies inside them; C's extent was checked by the caller and tasks write disjoint
        // blocks of it.
        unsafe {
            x86::blocks(a, b, (m, n, k), rb, blk, d, amx)
        };
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (rb, blk, a, b, k, amx);
    };
    if threads == 1 || col_blocks * chunks == 1 {
        (0..col_blocks * chunks).for_each(task);
    } else {
        pool::parallel_for(col_blocks * chunks, task);
    }
}

/// Writes one finished C tile (`rows x cols` of `buf`, row stride 16) at `(i0, j0)` per `d`.
///
/// # Safety
/// `(i0, j0)` and the tile lie inside C as the caller checked it; no other task writes there.
unsafe fn write(buf: &[f32], rows: usize, cols: usize, i0: usize, j0: usize, d: &Dest) {
    let out = Out {
        // SAFETY: inside C (contract).
        c: unsafe { d.c.0.add(i0 * d.ldc + j0) },
        rsc: d.ldc,
        csc: 1,
        alpha: d.alpha,
        acc: d.acc,
        epi: d.epi.then(|| TileEpi {
            row: d.row_bias.map_or(std::ptr::null(), |v| v[i0..].as_ptr()),
            col: d.col_bias.map_or(std::ptr::null(), |v| v[j0..].as_ptr()),
            z: std::ptr::null(),
            act: d.act,
        }),
        fetch: std::ptr::null(),
        fetch_lines: 0,
    };
    #[cfg(target_arch = "x86_64")]
    if rows == T {
        // SAFETY: AVX-512 is present (checked by `gemm`); the tile is in C (contract).
        return unsafe { x86::write16(buf, cols, &out) };
    }
    // SAFETY: the tile is in C (contract), the bias slices cover its rows and columns.
    unsafe { write_tile(buf, T, rows, cols, &out) };
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::asm;
    use std::arch::x86_64::*;
    use std::ops::Range;

    use super::{kp, write, Dest, KSTEP, T};

    /// One C tile as stored from a tile register.
    #[repr(C, align(64))]
    struct Tile([f32; T * T]);

    /// Row blocks `rb` (32 rows each) of column block `blk` (32 columns) of the product: on the
    /// tile unit with `amx`, else on AVX512-BF16's dot product, each block as slices of
    /// [`SLICE`] rows by its one or two panels ([`slice`]) into the same C tiles. Each element's
    /// sum runs over the pairs in order either way (`vdpbf16ps` adds a pair's two exact
    /// products to its lane), whatever the slicing.
    ///
    /// # Safety
    /// AVX-512 present, and AMX-BF16 granted (`amx`) or AVX512-BF16 present (otherwise); `a` and
    /// `b` hold the operands laid out for `m x k` and `n x k`; C as [`write`] needs it.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn blocks(
        a: &[u16],
        b: &[u16],
        (m, n, k): (usize, usize, usize),
        rb: Range<usize>,
        blk: usize,
        d: &Dest,
        amx: bool,
    ) {
        let kp = kp(k);
        let (mt, panels) = (m.div_ceil(T), n.div_ceil(T));
        let (q0, np) = (2 * blk, 2.min(panels - 2 * blk));
        assert!(a.len() >= mt * T * kp && b.len() >= panels * T * kp);
        let mut c = [
            Tile([0.0; T * T]),
            Tile([0.0; T * T]),
            Tile([0.0; T * T]),
            Tile([0.0; T * T]),
        ];
        if amx {
            // SAFETY: AMX present and granted (contract).
            unsafe { crate::amx::configure() };
        }
        for r in rb {
            let t0 = 2 * r;
            let nr = 2.min(mt - t0);
            let ap = a[t0 * T * kp..].as_ptr();
            let bp = b[q0 * T * kp..].as_ptr();
            if amx {
                // SAFETY: tiles t0..t0 + nr of A and panels q0..q0 + np of B lie in the slices
                // (asserted above); the configuration is loaded.
                unsafe {
                    match (nr, np) {
                        (2, 2) => block::<2, 2>(ap, bp, kp, &mut c),
                        (2, _) => block::<2, 1>(ap, bp, kp, &mut c),
                        (_, 2) => block::<1, 2>(ap, bp, kp, &mut c),
                        _ => block::<1, 1>(ap, bp, kp, &mut c),
                    }
                }
            } else {
                // Slices of SLICE rows: rows past m inside the last tile are A's zero padding.
                for s in 0..nr * T / SLICE {
                    let ap = a[(t0 * T + s * SLICE) * kp..].as_ptr();
                    let (tile, row) = (s * SLICE / T, s * SLICE % T);
                    // SAFETY: SLICE rows of kp elements from `ap` lie in A's tiles t0..t0 + nr,
                    // and panels q0..q0 + np of B in `b` (asserted above); AVX512-BF16
                    // (contract).
                    unsafe {
                        if np == 2 {
                            slice::<2>(ap, bp, kp, &mut c, tile, row)
                        } else {
                            slice::<1>(ap, bp, kp, &mut c, tile, row)
                        }
                    }
                }
            }
            for (t, tile) in c.iter().enumerate() {
                let (ri, pj) = (t % 2, t / 2);
                if ri >= nr || pj >= np {
                    continue;
                }
                let (i0, j0) = ((t0 + ri) * T, (q0 + pj) * T);
                let (rows, cols) = (T.min(m - i0), T.min(n - j0));
                // SAFETY: the tile is inside C's m x n (rows and columns clipped), in this
                // task's block (contract).
                unsafe { write(&tile.0, rows, cols, i0, j0, d) };
            }
        }
        if amx {
            // SAFETY: as above.
            unsafe { crate::amx::release() };
        }
    }

    /// `R` A tiles by `P` B tiles over the whole inner dimension (`kp / 32` steps): C tile
    /// `r + 2p` in tmm(r + 2p), A tiles in tmm4-5, B tiles in tmm6-7; then the C tiles stored to
    /// `c[r + 2p]`.
    ///
    /// # Safety
    /// The tile configuration is loaded; `a` addresses `R` tiles of 16 rows of `kp` elements,
    /// `b` `P` panels of `kp * 16`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn block<const R: usize, const P: usize>(
        a: *const u16,
        b: *const u16,
        kp: usize,
        c: &mut [Tile; 4],
    ) {
        let lda = 2 * kp;
        let (a0, b0) = (a, b);
        // SAFETY (every asm block): the configuration is loaded (contract); A tiles read 16 rows
        // of 64 bytes `lda` bytes apart from tile row 0 or 16, columns 32s..32s + 32; B tiles read
        // 1 KiB of panel 0 or 1 at pair 16s; all inside the operands (contract).
        unsafe {
            let a1 = a0.add(T * kp);
            let b1 = b0.add(T * kp);
            crate::amx::zero_c();
            for s in 0..kp / KSTEP {
                asm!(
                    "tileloadd tmm4, [{a} + {lda}*1]",
                    "tileloadd tmm6, [{b} + {s64}*1]",
                    "tdpbf16ps tmm0, tmm4, tmm6",
                    a = in(reg) a0.add(KSTEP * s),
                    b = in(reg) b0.add(512 * s),
                    lda = in(reg) lda,
                    s64 = in(reg) 64usize,
                    options(nostack, readonly)
                );
                if R == 2 {
                    asm!(
                        "tileloadd tmm5, [{a} + {lda}*1]",
                        "tdpbf16ps tmm1, tmm5, tmm6",
                        a = in(reg) a1.add(KSTEP * s),
                        lda = in(reg) lda,
                        options(nostack, readonly)
                    );
                }
                if P == 2 {
                    asm!(
                        "tileloadd tmm7, [{b} + {s64}*1]",
                        "tdpbf16ps tmm2, tmm4, tmm7",
                        b = in(reg) b1.add(512 * s),
                        s64 = in(reg) 64usize,
                        options(nostack, readonly)
                    );
                    if R == 2 {
                        asm!("tdpbf16ps tmm3, tmm5, tmm7", options(nostack, nomem));
                    }
                }
            }
            for (t, tile) in c.iter_mut().enumerate() {
                if t % 2 < R && t / 2 < P {
                    crate::amx::store_c(t, tile.0.as_mut_ptr().cast());
                }
            }
        }
    }

    /// 32 bf16 values as the dot product's operand type.
    #[inline(always)]
    fn bh(x: __m512i) -> __m512bh {
        // SAFETY: both are 512-bit vectors of plain bits; any bit pattern is a valid value.
        unsafe { core::mem::transmute::<__m512i, __m512bh>(x) }
    }

    /// Rows of A one [`slice`] computes (16 accumulators with two panels).
    const SLICE: usize = 8;

    /// [`SLICE`] rows of A (from `a`, `kp` elements apart) times `P` panels of B (from `b`,
    /// `kp * 16` elements apart) over the whole inner dimension: per pair of k, each row's pair
    /// broadcast against each panel's 16 columns of that pair. The sums go to rows
    /// `row..row + SLICE` of C tiles `tile + 2p`.
    ///
    /// # Safety
    /// AVX-512F and AVX512-BF16 present; `a` addresses SLICE rows of `kp` elements and `b` P
    /// panels of `kp * 16`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn slice<const P: usize>(
        a: *const u16,
        b: *const u16,
        kp: usize,
        c: &mut [Tile; 4],
        tile: usize,
        row: usize,
    ) {
        let mut acc = [[_mm512_setzero_ps(); P]; SLICE];
        for g in 0..kp / 2 {
            // SAFETY (loads): pair g of panel p lies at p * kp * 16 + g * 32 (32 elements), and
            // row i's pair at i * kp + 2g, inside the operands (contract).
            let bv: [__m512bh; P] = core::array::from_fn(|p| unsafe {
                bh(_mm512_loadu_si512(b.add(p * kp * T + g * 32).cast()))
            });
            for (i, acc) in acc.iter_mut().enumerate() {
                let pair = unsafe { (a.add(i * kp + 2 * g) as *const i32).read_unaligned() };
                let av = bh(_mm512_set1_epi32(pair));
                for p in 0..P {
                    acc[p] = _mm512_dpbf16_ps(acc[p], av, bv[p]);
                }
            }
        }
        for (i, acc) in acc.iter().enumerate() {
            for (p, &v) in acc.iter().enumerate() {
                let dst = &mut c[tile + 2 * p].0[(row + i) * T..(row + i + 1) * T];
                // SAFETY: `dst` holds 16 floats.
                unsafe { _mm512_storeu_ps(dst.as_mut_ptr(), v) };
            }
        }
    }

    /// A full-height tile (16 rows, `cols` columns) of `buf` written through the AVX-512 writer.
    ///
    /// # Safety
    /// AVX-512 present; `out` addresses a `16 x cols` tile of C and its bias values.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn write16(buf: &[f32], cols: usize, out: &super::Out) {
        let mut t = [[_mm512_setzero_ps(); 1]; T];
        for (r, row) in t.iter_mut().enumerate() {
            row[0] = _mm512_loadu_ps(buf[r * T..][..T].as_ptr());
        }
        // SAFETY: forwarded (16 rows, cols <= 16, csc == 1).
        unsafe { crate::gemm::x86::write_avx512::<T, 1>(t, cols, out) };
    }

    /// 16 floats to bf16 bits as `f32_to_bf16_bits` (the GGUF bf16 rounding): round to nearest even,
    /// a NaN keeps its top bits and is made quiet.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn bf16x16(x: __m512) -> __m256i {
        let u = _mm512_castps_si512(x);
        let hi = _mm512_srli_epi32::<16>(u);
        let lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(
            u,
            _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)),
        ));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
        let quiet = _mm512_or_si512(hi, _mm512_set1_epi32(64));
        _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet))
    }

    /// A contiguous row of `k` floats rounded into `out` (`kp` elements, zeros past k).
    ///
    /// # Safety
    /// AVX-512 present; `out.len() >= x.len()`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn round_row(x: &[f32], out: &mut [u16]) {
        let k = x.len();
        assert!(out.len() >= k);
        let mut p = 0;
        while p < k {
            let n = 16.min(k - p);
            let mask: __mmask16 = if n == 16 { 0xffff } else { (1u16 << n) - 1 };
            // SAFETY: the masked lanes are p..p + n < k of `x` and of `out`.
            unsafe {
                let v = _mm512_maskz_loadu_ps(mask, x.as_ptr().add(p));
                _mm256_mask_storeu_epi16(out.as_mut_ptr().add(p) as *mut _, mask, bf16x16(v));
            }
            p += 16;
        }
        out[k..].fill(0);
    }

    /// [`super::round_pair`]: the pair's 16-column pieces rounded, interleaved and stored.
    ///
    /// # Safety
    /// AVX-512 F and BW present.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn round_pair(
        even: &[f32],
        odd: &[f32],
        cols: usize,
        out: &mut [u16],
        stride: usize,
    ) {
        let np = cols.div_ceil(T);
        assert!(even.len() >= cols && odd.len() >= cols);
        assert!(np == 0 || (np - 1) * stride + 32 <= out.len());
        // Lane 2c takes column c of the even row (the low half), 2c + 1 column c of the odd one.
        let idx = _mm512_set_epi16(
            31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20,
            4, 19, 3, 18, 2, 17, 1, 16, 0,
        );
        for q in 0..np {
            let c0 = q * T;
            let n = T.min(cols - c0);
            let mask: __mmask16 = if n == 16 { 0xffff } else { (1u16 << n) - 1 };
            // SAFETY: columns c0..c0 + n < cols of both rows (asserted); masked lanes only.
            let (e, o) = unsafe {
                (
                    _mm512_maskz_loadu_ps(mask, even.as_ptr().add(c0)),
                    _mm512_maskz_loadu_ps(mask, odd.as_ptr().add(c0)),
                )
            };
            let both = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(bf16x16(e)), bf16x16(o));
            // SAFETY: panel q's 32 elements lie within `out` (asserted).
            unsafe {
                _mm512_storeu_si512(
                    out.as_mut_ptr().add(q * stride) as *mut _,
                    _mm512_permutexvar_epi16(idx, both),
                )
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::blocks::bf16_bits_to_f32;
    use rand::{Rng, SeedableRng};

    /// Floats with every kind of bit pattern: random bits (NaNs with any payload, infinities,
    /// subnormals), exact ties between two bf16 values, and ordinary values.
    fn specials(rng: &mut impl Rng, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| match i % 4 {
                0 => f32::from_bits(rng.gen()),
                1 => f32::from_bits((rng.gen::<u32>() & 0xffff_0000) | 0x8000),
                2 => [
                    f32::NAN,
                    f32::INFINITY,
                    -0.0,
                    f32::MAX,
                    f32::MIN_POSITIVE / 3.0,
                ][i / 4 % 5],
                _ => rng.gen_range(-4.0..4.0),
            })
            .collect()
    }

    #[test]
    fn layouts_hold_each_element_rounded_where_the_module_notes_put_it() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(rand::random());
        for _ in 0..20 {
            let (rows, k) = (rng.gen_range(1..40), rng.gen_range(1..70));
            let ld = k + rng.gen_range(0..3);
            let v = specials(&mut rng, rows * ld);
            let want = |i: usize, p: usize| f32_to_bf16_bits(v[i * ld + p]);
            let kp = kp(k);
            // Rows: from a row-major X (the vector path where the CPU has AVX-512) and from its
            // transposed view (the scalar path).
            let r = Bf16Operand::rows(Mat::row_major(&v, ld), rows, k);
            for i in 0..rows.next_multiple_of(T) {
                for p in 0..kp {
                    let w = if i < rows && p < k { want(i, p) } else { 0 };
                    assert_eq!(
                        r.data.u16s()[i * kp + p],
                        w,
                        "rows ({i}, {p}) of {rows} x {k}"
                    );
                }
            }
            // Panels of X = B^T: B row-major (`x.rs == 1`, the vector path where the CPU has
            // AVX-512) and B transposed (X row-major: the scalar path).
            let ldb = rows + rng.gen_range(0..3);
            let bv = specials(&mut rng, k * ldb);
            for x in [Mat::transposed(&bv, ldb), Mat::row_major(&v, ld)] {
                let p = Bf16Operand::panels(x, rows, k);
                for i in 0..rows.next_multiple_of(T) {
                    for q in 0..kp {
                        let w = if i < rows && q < k {
                            f32_to_bf16_bits(x.at(i, q))
                        } else {
                            0
                        };
                        let at = (i / T) * kp * T + (q / 2) * 32 + (i % T) * 2 + q % 2;
                        assert_eq!(p.data.u16s()[at], w, "panels ({i}, {q}) of {rows} x {k}");
                    }
                }
            }
        }
        // The rounding itself: ties to even, NaN kept quiet.
        assert_eq!(f32_to_bf16_bits(f32::from_bits(0x3f80_8000)), 0x3f80);
        assert!(bf16_bits_to_f32(f32_to_bf16_bits(f32::NAN)).is_nan());
    }
}
