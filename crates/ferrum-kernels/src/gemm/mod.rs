//! Blocked, packed f32 GEMM: `C = alpha * A * B + beta * C`, for the graph runtime's float32
//! MatMul, Gemm and Conv.
//!
//! The loop nest is the usual one (Goto / BLIS): the columns of B in blocks of [`NC`], the inner
//! dimension in blocks of [`KC`] (B's block packed once into panels of `NR` columns), the rows of
//! A in blocks of [`MC`] (packed into panels of `MR` rows, `alpha` folded in), and a register-tiled
//! microkernel that keeps an `MR x NR` tile of C in registers over the whole `KC` block. A and B
//! are read through strides ([`Mat`]), so transposed operands and im2col views cost nothing extra:
//! packing reads them in whatever order they lie.
//!
//! Microkernels ([`Isa`], picked once at run time with `is_x86_feature_detected!`): AVX-512F
//! (`12 x 32`, or `8 x 32` when 8 divides the row count better), AVX2 + FMA (`6 x 16`), and a portable scalar one (`4 x 8`); `FERRUM_NO_AVX512=1`
//! and `FERRUM_FORCE_SCALAR=1` step down as in the other kernels. [`gemm_ref`] is the plain
//! reference (f64 accumulation) the randomized tests compare every path with.
//!
//! Threads: [`gemm`] splits C into one column range (or row range, when C is taller than wide)
//! per pool thread; each task packs its own operands and writes only its own part of C. The
//! float order of an output element depends on the block sizes only, not on the split or the
//! thread count; the AVX-512 and AVX2 kernels sum alike (one FMA chain per output, `KC` steps at
//! a time, added to C), so they give the same bits too.

#[cfg(target_arch = "x86_64")]
mod x86;

use crate::pool;

/// Inner-dimension block: one packed B panel (`KC x NR`) stays in L1.
pub const KC: usize = 256;
/// Row block of A packed at once (`MC x KC` floats stay in L2); a multiple of every `MR`.
pub const MC: usize = 120;
/// Column block of B packed at once; a multiple of every `NR`.
pub const NC: usize = 1024;

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
    let mut v = vec![Isa::Scalar];
    let f = crate::cpu::detected();
    if cfg!(target_arch = "x86_64") && f.avx2 && f.fma {
        v.push(Isa::Avx2);
        if f.avx512f {
            v.push(Isa::Avx512);
        }
    }
    v
}

/// A register-tiled kernel: `MR x NR` outputs from an A panel (`kc x MR`, row index fastest)
/// and a B panel (`kc x NR`, column index fastest).
trait Micro {
    const MR: usize;
    const NR: usize;
    /// Writes (or, with `accumulate`, adds) the `MR x NR` tile to `c` (row stride `ldc`).
    ///
    /// # Safety
    /// `a` holds `kc * MR` floats, `b` holds `kc * NR`, `c` addresses an `MR x NR` tile with row
    /// stride `ldc`, and the CPU has the kernel's features.
    unsafe fn tile(kc: usize, a: *const f32, b: *const f32, c: *mut f32, ldc: usize, acc: bool);
}

/// The portable kernel (4 x 8), plain Rust: a separate multiply and add (`mul_add` would be a
/// library call without hardware FMA), so its bits differ from the FMA kernels'.
struct Scalar;

impl Micro for Scalar {
    const MR: usize = 4;
    const NR: usize = 8;
    unsafe fn tile(kc: usize, a: *const f32, b: *const f32, c: *mut f32, ldc: usize, acc: bool) {
        // SAFETY: the caller guarantees the panel sizes (kc * MR, kc * NR).
        let (a, b) = unsafe {
            (
                std::slice::from_raw_parts(a, kc * 4),
                std::slice::from_raw_parts(b, kc * 8),
            )
        };
        let mut t = [[0f32; 8]; 4];
        for (ap, bp) in a.chunks_exact(4).zip(b.chunks_exact(8)) {
            for r in 0..4 {
                for j in 0..8 {
                    t[r][j] += ap[r] * bp[j];
                }
            }
        }
        for (r, row) in t.iter().enumerate() {
            for (j, v) in row.iter().enumerate() {
                // SAFETY: the caller guarantees `c` addresses a 4 x 8 tile with row stride `ldc`.
                unsafe {
                    let p = c.add(r * ldc + j);
                    *p = if acc { *p + v } else { *v };
                }
            }
        }
    }
}

/// Packs rows `0..mc` x columns `0..kc` of `a` into panels of `MR` rows (zero-padded), scaled by
/// `alpha`: panel `q`, step `p`, row `r` at `q * kc * MR + p * MR + r`.
fn pack_a(a: Mat, mc: usize, kc: usize, mr: usize, alpha: f32, out: &mut Vec<f32>) {
    let panels = mc.div_ceil(mr);
    out.clear();
    out.resize(panels * kc * mr, 0.0);
    for q in 0..panels {
        let rows = mr.min(mc - q * mr);
        let dst = &mut out[q * kc * mr..][..kc * mr];
        for r in 0..rows {
            let i = q * mr + r;
            if a.cs == 1 {
                let src = &a.data[i * a.rs..][..kc];
                for (p, &v) in src.iter().enumerate() {
                    dst[p * mr + r] = v * alpha;
                }
            } else {
                for p in 0..kc {
                    dst[p * mr + r] = a.at(i, p) * alpha;
                }
            }
        }
    }
}

/// Packs rows `0..kc` x columns `0..nc` of `b` into panels of `NR` columns (zero-padded): panel
/// `q`, step `p`, column `j` at `q * kc * NR + p * NR + j`.
fn pack_b(b: Mat, kc: usize, nc: usize, nr: usize, out: &mut Vec<f32>) {
    let panels = nc.div_ceil(nr);
    out.clear();
    out.resize(panels * kc * nr, 0.0);
    for q in 0..panels {
        let cols = nr.min(nc - q * nr);
        let dst = &mut out[q * kc * nr..][..kc * nr];
        if b.cs == 1 {
            for p in 0..kc {
                let src = &b.data[p * b.rs + q * nr..][..cols];
                dst[p * nr..][..cols].copy_from_slice(src);
            }
        } else {
            for j in 0..cols {
                let col = q * nr + j;
                if b.rs == 1 {
                    let src = &b.data[col * b.cs..][..kc];
                    for (p, &v) in src.iter().enumerate() {
                        dst[p * nr + j] = v;
                    }
                } else {
                    for p in 0..kc {
                        dst[p * nr + j] = b.at(p, col);
                    }
                }
            }
        }
    }
}

/// A raw pointer to C that tasks may share: each task writes a disjoint part.
#[derive(Clone, Copy)]
struct CPtr(*mut f32);
// SAFETY: tasks write disjoint regions of C (different rows or columns), and `gemm` keeps C
// borrowed mutably until every task has finished.
unsafe impl Send for CPtr {}
// SAFETY: as above.
unsafe impl Sync for CPtr {}

impl CPtr {
    /// The pointer `off` elements further.
    ///
    /// # Safety
    /// The result must stay inside C.
    unsafe fn add(self, off: usize) -> CPtr {
        // SAFETY: forwarded from the caller.
        CPtr(unsafe { self.0.add(off) })
    }
}

/// One thread's GEMM over an `m x n` part of C at `c` (row stride `ldc`), `beta` already applied
/// (`accumulate`: add to C, else overwrite it).
///
/// # Safety
/// `c` addresses `m` rows of `n` writable floats with row stride `ldc`, not written by anyone
/// else during the call; `a` and `b` are checked for `m x k` and `k x n`.
#[allow(clippy::too_many_arguments)]
unsafe fn blocked<K: Micro>(
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: Mat,
    b: Mat,
    c: CPtr,
    ldc: usize,
    accumulate: bool,
) {
    let (mr, nr) = (K::MR, K::NR);
    let mut ap = Vec::new();
    let mut bp = Vec::new();
    let mut edge = vec![0f32; mr * nr];
    for jc in (0..n).step_by(NC) {
        let nc = NC.min(n - jc);
        for pc in (0..k).step_by(KC) {
            let kc = KC.min(k - pc);
            let acc = accumulate || pc > 0;
            pack_b(b.offset(pc, jc), kc, nc, nr, &mut bp);
            // Row blocks of equal size (whole MR panels), at most MC + MR - 1 rows.
            let mcb = m.div_ceil(m.div_ceil(MC)).next_multiple_of(mr);
            for ic in (0..m).step_by(mcb) {
                let mc = mcb.min(m - ic);
                pack_a(a.offset(ic, pc), mc, kc, mr, alpha, &mut ap);
                for (qj, jr) in (0..nc).step_by(nr).enumerate() {
                    let cols = nr.min(nc - jr);
                    let bpanel = bp[qj * kc * nr..].as_ptr();
                    for (qi, ir) in (0..mc).step_by(mr).enumerate() {
                        let rows = mr.min(mc - ir);
                        let apanel = ap[qi * kc * mr..].as_ptr();
                        // SAFETY: the caller guarantees C's extent; (ic + ir, jc + jr) is inside
                        // the m x n part.
                        let ct = unsafe { c.0.add((ic + ir) * ldc + jc + jr) };
                        if rows == mr && cols == nr {
                            // SAFETY: the panels hold kc * MR and kc * NR floats; the tile lies
                            // inside C; the ISA was checked when this kernel was chosen.
                            unsafe { K::tile(kc, apanel, bpanel, ct, ldc, acc) };
                        } else {
                            // SAFETY: as above, with `edge` (MR x NR, row stride NR) as the tile.
                            unsafe { K::tile(kc, apanel, bpanel, edge.as_mut_ptr(), nr, false) };
                            for r in 0..rows {
                                for j in 0..cols {
                                    // SAFETY: r < rows and j < cols keep the element in C.
                                    unsafe {
                                        let p = ct.add(r * ldc + j);
                                        let v = edge[r * nr + j];
                                        *p = if acc { *p + v } else { v };
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Rows of the AVX-512 kernel for an `m`-row product: 8 when that pads fewer rows than 12 (and
/// always for small `m`), else 12 (more accumulators per B load).
fn avx512_rows(m: usize) -> usize {
    if m.next_multiple_of(8) < m.next_multiple_of(12) || m <= 96 {
        8
    } else {
        12
    }
}

/// Dispatches [`blocked`] to the microkernel for `isa`.
///
/// # Safety
/// As [`blocked`]; `isa` must be supported by this CPU.
#[allow(clippy::too_many_arguments)]
unsafe fn blocked_isa(
    isa: Isa,
    m: usize,
    n: usize,
    k: usize,
    alpha: f32,
    a: Mat,
    b: Mat,
    c: CPtr,
    ldc: usize,
    accumulate: bool,
) {
    // SAFETY: forwarded from the caller.
    unsafe {
        match isa {
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 if avx512_rows(m) == 8 => {
                blocked::<x86::Avx512<8>>(m, n, k, alpha, a, b, c, ldc, accumulate)
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => blocked::<x86::Avx512<12>>(m, n, k, alpha, a, b, c, ldc, accumulate),
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => blocked::<x86::Avx2>(m, n, k, alpha, a, b, c, ldc, accumulate),
            _ => blocked::<Scalar>(m, n, k, alpha, a, b, c, ldc, accumulate),
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
    assert!(available_isas().contains(&isa), "gemm: {isa:?} unsupported");
    if m == 0 || n == 0 {
        return;
    }
    assert!(ldc >= n, "gemm: ldc {ldc} < n {n}");
    assert!(
        (m - 1) * ldc + n <= c.len(),
        "gemm: C ({m} x {n}, ldc {ldc}) exceeds its {} elements",
        c.len()
    );
    a.check(m, k, "A");
    b.check(k, n, "B");
    // beta: 0 overwrites C (first K block), 1 accumulates, anything else scales C first.
    let accumulate = beta != 0.0;
    if beta != 0.0 && beta != 1.0 {
        for i in 0..m {
            c[i * ldc..][..n].iter_mut().for_each(|v| *v *= beta);
        }
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                c[i * ldc..][..n].fill(0.0);
            }
        }
        return;
    }
    // A short, wide-K product with many rows (late CNN layers: 7x7 outputs): the NR-wide
    // panels would be mostly padding, so compute C^T = B^T A^T (the views swap for free) and
    // transpose it into C.
    let nr_of = |isa: Isa| match isa {
        Isa::Avx512 => 32,
        Isa::Avx2 => 16,
        Isa::Scalar => 8,
    };
    let util = |x: usize| x as f64 / x.next_multiple_of(nr_of(isa)) as f64;
    if n < 128 && m >= 2 * n && util(m) > util(n) + 0.1 {
        let mut t = vec![0f32; n * m];
        let at = Mat {
            data: a.data,
            rs: a.cs,
            cs: a.rs,
        };
        let bt = Mat {
            data: b.data,
            rs: b.cs,
            cs: b.rs,
        };
        gemm_with(isa, threads, n, m, k, alpha, bt, at, 0.0, &mut t, m);
        for i in 0..m {
            let row = &mut c[i * ldc..][..n];
            for (j, v) in row.iter_mut().enumerate() {
                let x = t[j * m + i];
                *v = if accumulate { *v + x } else { x };
            }
        }
        return;
    }
    let (mr, nr) = match isa {
        Isa::Avx512 => (avx512_rows(m), 32),
        Isa::Avx2 => (6, 16),
        Isa::Scalar => (4, 8),
    };
    // Splits worth a thread: at least ~1M multiply-adds each.
    let work = m * n * k;
    let tasks = threads.min(work / (1 << 20)).max(1);
    let cp = CPtr(c.as_mut_ptr());
    if tasks == 1 {
        // SAFETY: C's extent was checked above and C is borrowed mutably; the ISA is supported.
        unsafe { blocked_isa(isa, m, n, k, alpha, a, b, cp, ldc, accumulate) };
        return;
    }
    if n >= m {
        // Column ranges, whole NR panels each.
        let per = n.div_ceil(nr).div_ceil(tasks) * nr;
        let count = n.div_ceil(per);
        pool::parallel_for(count, |t| {
            let j0 = t * per;
            let w = per.min(n - j0);
            // SAFETY: tasks write disjoint column ranges j0..j0 + w of C (checked above), which
            // stays borrowed until parallel_for returns; the ISA is supported.
            unsafe {
                blocked_isa(
                    isa,
                    m,
                    w,
                    k,
                    alpha,
                    a,
                    b.offset(0, j0),
                    cp.add(j0),
                    ldc,
                    accumulate,
                )
            };
        });
    } else {
        // Row ranges, whole MR panels each.
        let per = m.div_ceil(mr).div_ceil(tasks) * mr;
        let count = m.div_ceil(per);
        pool::parallel_for(count, |t| {
            let i0 = t * per;
            let h = per.min(m - i0);
            // SAFETY: tasks write disjoint row ranges i0..i0 + h of C (checked above), which
            // stays borrowed until parallel_for returns; the ISA is supported.
            unsafe {
                blocked_isa(
                    isa,
                    h,
                    n,
                    k,
                    alpha,
                    a.offset(i0, 0),
                    b,
                    cp.add(i0 * ldc),
                    ldc,
                    accumulate,
                )
            };
        });
    }
}
