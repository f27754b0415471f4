//! x86 kernels of [`super`]: the AMX `tdpbusd` block, the AVX-512 VNNI `vpdpbusd` tile, the AVX2
//! `vpmaddwd` tile and the f32 -> u8 quantizers.

use std::arch::asm;
use std::arch::x86_64::*;
use std::ops::Range;

use super::{Finish, Gathered, OutPtr};

/// [`super::Layout::Quads`]: columns per panel, rows per tile.
const PANEL: usize = 16;
const MR: usize = 6;
/// [`super::Layout::Pairs`]: columns per panel, rows per tile.
const PANEL8: usize = 8;
const MR8: usize = 6;

/// Runs `$tile::<R, P>(args)` over `rows` in tiles of up to `$mr` rows (at most 6; the last
/// tile shorter) and `P = $np` panels (one of the listed counts), `$i` bound to each tile's
/// first row. Expands to `unsafe` calls: the caller's contract must cover every tile.
macro_rules! row_tiles {
    ($rows:expr, $np:expr, |$i:ident| $tile:ident $args:tt, $mr:expr, [$($p:literal)*]) => {{
        let rows = $rows;
        let mut $i = rows.start;
        while $i < rows.end {
            let r = $mr.min(rows.end - $i);
            macro_rules! by_panels {
                ($r:literal) => {
                    match $np {
                        $($p => unsafe { $tile::<$r, $p> $args },)*
                        np => unreachable!("tile {} x {np}", $r),
                    }
                };
            }
            match r {
                1 => by_panels!(1),
                2 => by_panels!(2),
                3 => by_panels!(3),
                4 => by_panels!(4),
                5 => by_panels!(5),
                6 => by_panels!(6),
                _ => unreachable!("a tile of {r} rows"),
            }
            $i += r;
        }
    }};
}

/// VNNI: rows `rows` of the column block starting at panel `p0` (`np` panels, at most 4), in
/// tiles of up to `MR` rows.
///
/// # Safety
/// AVX-512 F/BW/VL and VNNI must be present; every row in `rows` of `a` must hold `fin.b.kp`
/// readable bytes from `i * lda`; `p0 + np` panels must exist.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn block_vnni(
    a: &[u8],
    lda: usize,
    rows: Range<usize>,
    p0: usize,
    np: usize,
    fin: &Finish,
) {
    let cols = BlockCols::new(fin, p0, np);
    // SAFETY: as this function's contract, for each tile's rows.
    match &cols.q8 {
        Some(q8) => row_tiles!(rows, np, |i| tile(a, lda, i, p0, fin, q8), MR, [4]),
        None => row_tiles!(rows, np, |i| tile(a, lda, i, p0, fin, &cols), MR, [1 2 3 4]),
    }
}

/// Rows of an AMX block: two A tiles of 16 rows.
const AMX_ROWS: usize = 32;

/// AMX: rows `rows` of the column block starting at panel `p0` (`np` panels, 1 or 2) of a
/// [`super::Layout::Tiles`] B, in blocks of 32 rows on the tile unit; the rows left over (fewer
/// than 32, only at the end of the product) on the VNNI tile, which gives the same integers.
///
/// # Safety
/// AVX-512 F/BW/VL, VNNI and AMX-INT8 must be present and the tile state granted to the process;
/// `fin.b.kp` must be a multiple of 64; every row in `rows` of `a` must hold `fin.b.kp` readable
/// bytes from `i * lda`; `p0 + np` panels must exist.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn block_amx(
    a: &[u8],
    lda: usize,
    rows: Range<usize>,
    p0: usize,
    np: usize,
    fin: &Finish,
) {
    debug_assert!(fin.b.kp.is_multiple_of(64) && (1..=2).contains(&np));
    let whole = rows.start + (rows.end - rows.start) / AMX_ROWS * AMX_ROWS;
    if whole > rows.start {
        // SAFETY: the CPU has AMX and the tile state (contract).
        unsafe { crate::amx::configure() };
        for i in (rows.start..whole).step_by(AMX_ROWS) {
            // SAFETY: rows i..i + 32 are in `rows`, panels in range (contract).
            unsafe {
                if np == 2 {
                    amx_block::<2>(a, lda, i, p0, fin)
                } else {
                    amx_block::<1>(a, lda, i, p0, fin)
                }
            }
        }
        // SAFETY: as above.
        unsafe { crate::amx::release() };
    }
    if whole < rows.end {
        // SAFETY: the VNNI tile reads the `Tiles` layout as `Quads` (same arrangement, kp
        // groups); the contract covers these rows.
        unsafe { block_vnni(a, lda, whole..rows.end, p0, np, fin) };
    }
}

/// One 32-row block over `P` panels: C tiles 0-1 (rows 0-15, 16-31 of panel `p0`) and 2-3
/// (panel `p0 + 1`), A tiles 4-5, B tiles 6-7, over the whole inner dimension in steps of 64,
/// then each C tile stored to memory and finished row by row.
///
/// # Safety
/// As [`block_amx`], with the tile configuration loaded; rows `i0..i0 + 32` in range.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn amx_block<const P: usize>(a: &[u8], lda: usize, i0: usize, p0: usize, fin: &Finish) {
    let b = fin.b;
    let stride = b.kp * PANEL;
    assert!(p0 + P <= b.n.div_ceil(PANEL) && (i0 + AMX_ROWS - 1) * lda + b.kp <= a.len());
    assert!(b.data.len() >= (p0 + P) * stride);
    let a0 = a.as_ptr().add(i0 * lda);
    let a1 = a0.add(16 * lda);
    let b0 = b.data.i8s().as_ptr().add(p0 * stride) as *const u8;
    // SAFETY (every asm block below): the tile configuration is loaded (contract); A tiles read
    // 16 rows of 64 bytes at `lda` apart from row i0 or i0 + 16, step kt's bytes 64kt..64kt + 64,
    // inside `a` (asserted: each row holds kp bytes); B tiles read 1 KiB (16 groups of 64 bytes)
    // of panel p0 or p0 + 1 at offset 1024kt, inside `b.data` (asserted).
    crate::amx::zero_c();
    for kt in 0..b.kp / 64 {
        asm!(
            "tileloadd tmm4, [{a0} + {lda}*1]",
            "tileloadd tmm5, [{a1} + {lda}*1]",
            "tileloadd tmm6, [{b0} + {s64}*1]",
            "tdpbusd tmm0, tmm4, tmm6",
            "tdpbusd tmm1, tmm5, tmm6",
            a0 = in(reg) a0.add(64 * kt),
            a1 = in(reg) a1.add(64 * kt),
            b0 = in(reg) b0.add(1024 * kt),
            lda = in(reg) lda,
            s64 = in(reg) 64usize,
            options(nostack, readonly)
        );
        if P == 2 {
            asm!(
                "tileloadd tmm7, [{b1} + {s64}*1]",
                "tdpbusd tmm2, tmm4, tmm7",
                "tdpbusd tmm3, tmm5, tmm7",
                b1 = in(reg) b0.add(stride + 1024 * kt),
                s64 = in(reg) 64usize,
                options(nostack, readonly)
            );
        }
    }
    let mut c = Aligned([[0i32; PANEL]; 16]);
    for t in 0..2 * P {
        // SAFETY: `c` holds 16 rows of 64 bytes; tiles 0..2P hold this block's sums.
        crate::amx::store_c(t, c.0.as_mut_ptr().cast());
        let (r0, j0) = (i0 + 16 * (t % 2), (p0 + t / 2) * PANEL);
        if j0 + PANEL <= b.n {
            let cols = Cols16::new(fin, j0);
            for (r, raw) in c.0.iter().enumerate() {
                store16(
                    fin,
                    r0 + r,
                    &cols,
                    _mm512_load_si512(raw.as_ptr() as *const _),
                );
            }
        } else {
            for (r, raw) in c.0.iter().enumerate() {
                fin.store(r0 + r, j0, &raw[..b.n - j0]);
            }
        }
    }
}

/// A C tile's 16 rows as stored from the tile register.
#[repr(C, align(64))]
struct Aligned([[i32; PANEL]; 16]);

/// AVX2: rows `rows` of the column block starting at panel `p0` (`np` panels of 8, at most 2),
/// in tiles of up to `MR8` rows; `a` is A widened to 16 bits, row `i` at `a[i * lda..]`.
///
/// # Safety
/// AVX2 must be present; `fin.b` must be in the `Pairs` layout with `p0 + np` panels; every row
/// in `rows` of `a` must hold `fin.b.kp` values from `i * lda`.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn block_avx2(
    a: &[u16],
    lda: usize,
    rows: Range<usize>,
    p0: usize,
    np: usize,
    fin: &Finish,
) {
    // SAFETY: as this function's contract, for each tile's rows.
    row_tiles!(rows, np, |i| tile8(a, lda, i, p0, fin), MR8, [1 2]);
}

/// One `R x (P * 8)` AVX2 tile: per pair of k, each row's two 16-bit values broadcast as one
/// i32, `vpmaddwd` against the panel's 8 columns x 2 values, added to the row's accumulators.
///
/// # Safety
/// As [`block_avx2`].
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn tile8<const R: usize, const P: usize>(
    a: &[u16],
    lda: usize,
    i0: usize,
    p0: usize,
    fin: &Finish,
) {
    let b = fin.b;
    let kp = b.kp;
    let pairs = kp / 2;
    let stride = kp * PANEL8;
    assert!(p0 + P <= b.n.div_ceil(PANEL8) && (i0 + R - 1) * lda + kp <= a.len());
    assert!(b.wide.len() >= (p0 + P) * stride);
    let bp = b.wide.as_ptr().add(p0 * stride);
    let ap = a.as_ptr().add(i0 * lda);
    let mut acc = [[_mm256_setzero_si256(); P]; R];
    for g in 0..pairs {
        let mut bv = [_mm256_setzero_si256(); P];
        for (q, v) in bv.iter_mut().enumerate() {
            // SAFETY: panel p0 + q's pair g: 16 values inside `b.wide` (asserted above).
            *v = _mm256_loadu_si256(bp.add(q * stride + g * 16) as *const _);
        }
        for (r, row) in acc.iter_mut().enumerate() {
            // SAFETY: row i0 + r's values 2g, 2g + 1, inside `a` (asserted above).
            let av = _mm256_set1_epi32((ap.add(r * lda + 2 * g) as *const i32).read_unaligned());
            for q in 0..P {
                row[q] = _mm256_add_epi32(row[q], _mm256_madd_epi16(av, bv[q]));
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (q, &v) in row.iter().enumerate() {
            let j0 = (p0 + q) * PANEL8;
            if j0 + PANEL8 <= b.n {
                store8(fin, i0 + r, j0, v);
            } else {
                let mut raw = [0i32; PANEL8];
                _mm256_storeu_si256(raw.as_mut_ptr() as *mut _, v);
                fin.store(i0 + r, j0, &raw[..b.n - j0]);
            }
        }
    }
}

/// [`store16`] for 8 columns.
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn store8(fin: &Finish, i: usize, j0: usize, raw: __m256i) {
    let (rs, za) = fin.row_terms[i];
    let cs = _mm256_loadu_si256(fin.b.col_sums[j0..j0 + PANEL8].as_ptr() as *const _);
    let bt = if fin.b_terms.len() == 1 {
        _mm256_set1_epi32(fin.b_terms[0])
    } else {
        _mm256_loadu_si256(fin.b_terms[j0..j0 + PANEL8].as_ptr() as *const _)
    };
    let v = _mm256_add_epi32(
        _mm256_sub_epi32(raw, _mm256_mullo_epi32(_mm256_set1_epi32(za), cs)),
        _mm256_mullo_epi32(bt, _mm256_set1_epi32(rs)),
    );
    match fin.out {
        OutPtr::I32(p, ld) => {
            // SAFETY: (i, j0..j0 + 8) is in this task's tile (see OutPtr).
            _mm256_storeu_si256(p.add(i * ld + j0) as *mut _, v)
        }
        OutPtr::F32(p, ld) => {
            // SAFETY: as above.
            _mm256_storeu_ps(p.add(i * ld + j0), float8(fin, j0, v))
        }
        OutPtr::Q8 {
            p,
            rs,
            cs,
            zero,
            signed,
        } => {
            let mut y = float8(fin, j0, v);
            // `min(y, hold)` gives `hold` for a NaN y (the second operand), as f32::min.
            let hold = _mm256_set1_ps(super::Q8_HOLD);
            y = _mm256_max_ps(
                _mm256_min_ps(y, hold),
                _mm256_sub_ps(_mm256_setzero_ps(), hold),
            );
            // Round half to even (the default rounding mode), add the zero point, then narrow
            // with saturation to 16 and 8 bits: the clamp.
            let q = _mm256_add_epi32(_mm256_cvtps_epi32(y), _mm256_set1_epi32(zero));
            let (lo, hi) = (_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q));
            let w = _mm_packs_epi32(lo, hi);
            let bytes = if signed {
                _mm_packs_epi16(w, w)
            } else {
                _mm_packus_epi16(w, w)
            };
            if cs == 1 {
                // SAFETY: (i, j0..j0 + 8) is in this task's tile, bytes i * rs + j0.. (see
                // OutPtr).
                _mm_storel_epi64(p.add(i * rs + j0) as *mut _, bytes);
            } else {
                let mut b = [0u8; 16];
                _mm_storeu_si128(b.as_mut_ptr() as *mut _, bytes);
                for (c, &v) in b[..PANEL8].iter().enumerate() {
                    // SAFETY: as above, element (i, j0 + c).
                    *p.add(i * rs + (j0 + c) * cs) = v;
                }
            }
        }
    }
}

/// [`Finish::value_f32`] of 8 columns `j0..j0 + 8` from their finished integers `v`:
/// `v * scale + bias`, multiply then add (the unfused chain's two roundings, no FMA).
#[target_feature(enable = "avx2")]
#[inline]
unsafe fn float8(fin: &Finish, j0: usize, v: __m256i) -> __m256 {
    let s = if fin.scale.len() == 1 {
        _mm256_set1_ps(fin.scale[0])
    } else {
        _mm256_loadu_ps(fin.scale[j0..j0 + PANEL8].as_ptr())
    };
    let y = _mm256_mul_ps(_mm256_cvtepi32_ps(v), s);
    match fin.bias {
        Some(bias) => _mm256_add_ps(y, _mm256_loadu_ps(bias[j0..j0 + PANEL8].as_ptr())),
        None => y,
    }
}

/// One `R x (P * 16)` tile: rows `i0..i0 + R`, panels `p0..p0 + P`, over the whole inner
/// dimension, then finished and stored.
///
/// # Safety
/// As [`block_vnni`].
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn tile<const R: usize, const P: usize>(
    a: &[u8],
    lda: usize,
    i0: usize,
    p0: usize,
    fin: &Finish,
    epilogue: &impl Epilogue,
) {
    let b = fin.b;
    let groups = b.kp / 4;
    let stride = b.kp * PANEL;
    assert!(p0 + P <= b.n.div_ceil(PANEL) && (i0 + R - 1) * lda + b.kp <= a.len());
    let bp = b.data.i8s().as_ptr().add(p0 * stride);
    let ap = a.as_ptr().add(i0 * lda);
    let mut acc = [[_mm512_setzero_si512(); P]; R];
    // The next tile's rows of A (R rows below these), a cache line of each every 16 groups:
    // they come from L2 or beyond (a fresh activation), in R streams too many for the
    // hardware prefetcher to run ahead of.
    let next = ap.wrapping_add(R * lda) as *const i8;
    for g0 in (0..groups).step_by(16) {
        for r in 0..R {
            // SAFETY: a prefetch never faults, and the address is only computed (wrapping).
            _mm_prefetch::<_MM_HINT_T0>(next.wrapping_add(r * lda + 4 * g0));
        }
        let rows: [*const u8; R] = core::array::from_fn(|r| ap.add(r * lda + 4 * g0));
        // SAFETY: rows i0 + r hold kp bytes (asserted above), so bytes 4 * g0.. of each hold the
        // groups g0..g0 + n; B's groups likewise.
        unsafe { dot_groups(&mut acc, rows, bp, stride, g0, 16.min(groups - g0)) };
    }
    // SAFETY: rows i0..i0 + R and panels p0..p0 + P are the caller's (contract).
    unsafe { epilogue.finish(acc, i0, p0, fin) };
}

/// Groups `g0..g0 + n` of B's `P` panels (`stride` bytes apart from `bp`) against 4 bytes a
/// group of each of A's `R` rows (`rows[r]`, group g0 first), added to `acc`.
///
/// # Safety
/// AVX-512 F/BW/VL and VNNI present; `rows[r]` holds `4 n` readable bytes and each panel the
/// groups; always inlined into the VNNI kernels (compiled for those features).
#[inline(always)]
unsafe fn dot_groups<const R: usize, const P: usize>(
    acc: &mut [[__m512i; P]; R],
    rows: [*const u8; R],
    bp: *const i8,
    stride: usize,
    g0: usize,
    n: usize,
) {
    for gg in 0..n {
        let mut bv = [_mm512_setzero_si512(); P];
        for (q, v) in bv.iter_mut().enumerate() {
            // SAFETY: panel q's group g0 + gg: 64 bytes inside B (contract).
            *v = _mm512_loadu_si512(bp.add(q * stride + (g0 + gg) * 64) as *const _);
        }
        for (row, &a) in acc.iter_mut().zip(&rows) {
            // SAFETY: bytes 4gg..4gg + 4 of the row (contract).
            let av = _mm512_set1_epi32((a.add(4 * gg) as *const i32).read_unaligned());
            for q in 0..P {
                row[q] = _mm512_dpbusd_epi32(row[q], av, bv[q]);
            }
        }
    }
}

/// How a VNNI tile's raw sums are finished and stored: chosen per column block, before its
/// tiles, so that each kernel is compiled with one epilogue and keeps its sums in registers.
trait Epilogue {
    /// Finishes and stores the raw sums of an `R x (P * 16)` tile at rows `i0..`, panels
    /// `p0..` (the block's first panels).
    ///
    /// # Safety
    /// AVX-512 F/BW/VL and VNNI present (implementations are always inlined into kernels
    /// compiled for them); the rows and panels are in range and this task's.
    unsafe fn finish<const R: usize, const P: usize>(
        &self,
        acc: [[__m512i; P]; R],
        i0: usize,
        p0: usize,
        fin: &Finish,
    );
}

impl Epilogue for BlockCols {
    #[inline(always)]
    unsafe fn finish<const R: usize, const P: usize>(
        &self,
        acc: [[__m512i; P]; R],
        i0: usize,
        p0: usize,
        fin: &Finish,
    ) {
        let b = fin.b;
        for q in 0..P {
            let j0 = (p0 + q) * PANEL;
            if j0 + PANEL <= b.n {
                for (r, row) in acc.iter().enumerate() {
                    store16(fin, i0 + r, &self.panels[q], row[q]);
                }
            } else {
                for (r, row) in acc.iter().enumerate() {
                    let mut raw = [0i32; PANEL];
                    _mm512_storeu_si512(raw.as_mut_ptr() as *mut _, row[q]);
                    fin.store(i0 + r, j0, &raw[..b.n - j0]);
                }
            }
        }
    }
}

/// A column block's epilogue terms, made once for all the rows a task takes of it.
struct BlockCols {
    /// Each whole panel's terms (a partial panel's are unused: its columns go through
    /// [`Finish::store`]).
    panels: [Cols16; 4],
    /// The fast path of the commonest int8 layer, where it applies.
    q8: Option<Q8x64>,
}

impl BlockCols {
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn new(fin: &Finish, p0: usize, np: usize) -> BlockCols {
        let panels = core::array::from_fn(|q| {
            let j0 = (p0 + q) * PANEL;
            if q < np && j0 + PANEL <= fin.b.n {
                // SAFETY: the features are this function's.
                unsafe { Cols16::new(fin, j0) }
            } else {
                Cols16::unused(j0)
            }
        });
        BlockCols {
            // SAFETY: as above.
            q8: unsafe { Q8x64::new(fin, &panels, p0, np) },
            panels,
        }
    }
}

/// The requantizing epilogue of 64 whole columns stored as contiguous bytes, A with one zero
/// point and no row-sum term (`off - zb` zero: a signed weight quantized symmetrically, as
/// static int8 convolutions are): per element `clamp(round(hold((raw - za colsum) as f32 *
/// scale + bias)) + zero)`, the operations of [`Finish::store`] with every choice made once.
/// Without a bias, 0 is added: `x + 0.0` differs from `x` only for `x = -0.0`, which rounds
/// to the same integer.
struct Q8x64 {
    za_col_sums: [__m512i; 4],
    scale: [__m512; 4],
    bias: [__m512; 4],
    p: *mut u8,
    rs: usize,
    j0: usize,
    zero: i32,
    signed: bool,
}

impl Q8x64 {
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn new(fin: &Finish, panels: &[Cols16; 4], p0: usize, np: usize) -> Option<Q8x64> {
        let OutPtr::Q8 {
            p,
            rs,
            cs: 1,
            zero,
            signed,
        } = fin.out
        else {
            return None;
        };
        let whole = np == 4 && (p0 + 4) * PANEL <= fin.b.n;
        if !whole || !fin.b_terms_zero {
            return None;
        }
        let mut za_col_sums = [_mm512_setzero_si512(); 4];
        for (z, c) in za_col_sums.iter_mut().zip(panels) {
            *z = c.za_col_sums?;
        }
        Some(Q8x64 {
            za_col_sums,
            scale: panels.each_ref().map(|c| c.scale),
            bias: panels
                .each_ref()
                .map(|c| c.bias.unwrap_or(_mm512_setzero_ps())),
            p,
            rs,
            j0: p0 * PANEL,
            zero,
            signed,
        })
    }
}

impl Epilogue for Q8x64 {
    /// Only for blocks of four panels (`P = 4`: the block's columns `j0..j0 + 64`).
    #[inline(always)]
    unsafe fn finish<const R: usize, const P: usize>(
        &self,
        acc: [[__m512i; P]; R],
        i0: usize,
        _p0: usize,
        _fin: &Finish,
    ) {
        debug_assert_eq!(P, 4);
        let zero = _mm512_set1_epi32(self.zero);
        for (r, row) in acc.iter().enumerate() {
            // A plain loop, not a closure: a closure would not inherit the target features.
            let mut q = [_mm512_setzero_si512(); 4];
            for (c, out) in q.iter_mut().enumerate() {
                let v = _mm512_sub_epi32(row[c % P], self.za_col_sums[c]);
                let y = _mm512_add_ps(
                    _mm512_mul_ps(_mm512_cvtepi32_ps(v), self.scale[c]),
                    self.bias[c],
                );
                // SAFETY: inlined into the VNNI kernels (AVX-512F).
                *out = unsafe { held_rounded(y, zero) };
            }
            // SAFETY: (i0 + r, j0..j0 + 64) is in this task's tile, 64 bytes from
            // (i0 + r) * rs + j0 (see OutPtr).
            unsafe { store_q8x64(self.p.add((i0 + r) * self.rs + self.j0), q, self.signed) };
        }
    }
}

/// [`block_vnni`] with A's rows gathered ([`Gathered`], `run` a multiple of 4): per tap, each
/// row's run read where it lies in the image (the fill run in the padding), its groups of 4
/// against B's groups `t * run / 4..`. The same sums in the same order as over the rows written
/// out.
///
/// # Safety
/// AVX-512 F/BW/VL and VNNI must be present; every offset of the rows in `rows` is `PAD` or
/// starts `run` bytes inside `a.image`; `a.taps * a.run == fin.b.k`, `a.run % 4 == 0`; `p0 + np`
/// panels must exist.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn block_vnni_gathered(
    a: &Gathered,
    rows: Range<usize>,
    p0: usize,
    np: usize,
    fin: &Finish,
) {
    assert!(a.run.is_multiple_of(4) && a.taps * a.run == fin.b.k && a.fill.len() == a.run);
    assert!(rows.end * a.taps <= a.offsets.len());
    let cols = BlockCols::new(fin, p0, np);
    // SAFETY: as this function's contract, for each tile's rows.
    match &cols.q8 {
        Some(q8) => row_tiles!(rows, np, |i| tile_gathered(a, i, p0, fin, q8), MR, [4]),
        None => row_tiles!(rows, np, |i| tile_gathered(a, i, p0, fin, &cols), MR, [1 2 3 4]),
    }
}

/// [`tile`] over gathered rows.
///
/// # Safety
/// As [`block_vnni_gathered`], for rows `i0..i0 + R`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn tile_gathered<const R: usize, const P: usize>(
    a: &Gathered,
    i0: usize,
    p0: usize,
    fin: &Finish,
    epilogue: &impl Epilogue,
) {
    let b = fin.b;
    let stride = b.kp * PANEL;
    let per_run = a.run / 4;
    assert!(p0 + P <= b.n.div_ceil(PANEL) && a.taps * per_run <= b.kp / 4);
    let bp = b.data.i8s().as_ptr().add(p0 * stride);
    let mut acc = [[_mm512_setzero_si512(); P]; R];
    for t in 0..a.taps {
        // Each row's run under tap t: in the image (checked by the caller), or the fill run.
        let runs: [*const u8; R] =
            core::array::from_fn(|r| match a.offsets[(i0 + r) * a.taps + t] {
                Gathered::PAD => a.fill.as_ptr(),
                o => a.image[o as usize..o as usize + a.run].as_ptr(),
            });
        // SAFETY: each run holds `run` = 4 per_run bytes; B's groups t * per_run.. lie below
        // kp / 4 (asserted above).
        unsafe { dot_groups(&mut acc, runs, bp, stride, t * per_run, per_run) };
    }
    // SAFETY: rows i0..i0 + R and panels p0..p0 + P are the caller's (contract).
    unsafe { epilogue.finish(acc, i0, p0, fin) };
}

/// The terms of 16 whole columns `j0..j0 + 16` that every row's epilogue uses: B's column sums,
/// `off - zb`, the scales and the bias, loaded once for the rows of a tile.
struct Cols16 {
    j0: usize,
    col_sums: __m512i,
    /// `za * col_sums` when A has one zero point (so no row multiplies it again).
    za_col_sums: Option<__m512i>,
    b_terms: __m512i,
    scale: __m512,
    bias: Option<__m512>,
}

impl Cols16 {
    /// Placeholder terms of a partial panel, never read.
    #[target_feature(enable = "avx512f")]
    fn unused(j0: usize) -> Cols16 {
        Cols16 {
            j0,
            col_sums: _mm512_setzero_si512(),
            za_col_sums: None,
            b_terms: _mm512_setzero_si512(),
            scale: _mm512_setzero_ps(),
            bias: None,
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    #[inline]
    unsafe fn new(fin: &Finish, j0: usize) -> Cols16 {
        let cols = j0..j0 + PANEL;
        let ints = |v: &[i32]| {
            if v.len() == 1 {
                _mm512_set1_epi32(v[0])
            } else {
                _mm512_loadu_si512(v[cols.clone()].as_ptr() as *const _)
            }
        };
        let scale = match fin.scale.len() {
            0 => _mm512_setzero_ps(),
            1 => _mm512_set1_ps(fin.scale[0]),
            _ => _mm512_loadu_ps(fin.scale[cols.clone()].as_ptr()),
        };
        let col_sums = ints(&fin.b.col_sums);
        Cols16 {
            j0,
            col_sums,
            za_col_sums: fin
                .za
                .map(|za| _mm512_mullo_epi32(_mm512_set1_epi32(za), col_sums)),
            b_terms: ints(fin.b_terms),
            scale,
            bias: fin.bias.map(|b| _mm512_loadu_ps(b[cols.clone()].as_ptr())),
        }
    }
}

/// The finished integer values (before scale and bias) of 16 whole columns (`cols`) of row `i`
/// from their raw sums: [`Finish::value_i32`] lane by lane.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
fn lanes_i32(fin: &Finish, i: usize, cols: &Cols16, raw: __m512i) -> __m512i {
    let (rs, za) = fin.row_terms[i];
    let za_cs = match cols.za_col_sums {
        Some(t) => t,
        None => _mm512_mullo_epi32(_mm512_set1_epi32(za), cols.col_sums),
    };
    let v = _mm512_sub_epi32(raw, za_cs);
    if fin.b_terms_zero {
        v
    } else {
        _mm512_add_epi32(v, _mm512_mullo_epi32(cols.b_terms, _mm512_set1_epi32(rs)))
    }
}

/// The float value `v * scale + bias` of 16 finished lanes, multiply then add (the unfused
/// chain's two roundings, no FMA).
#[target_feature(enable = "avx512f")]
#[inline]
fn lanes_f32(cols: &Cols16, v: __m512i) -> __m512 {
    let y = _mm512_mul_ps(_mm512_cvtepi32_ps(v), cols.scale);
    match cols.bias {
        Some(b) => _mm512_add_ps(y, b),
        None => y,
    }
}

/// [`QOut::Q8`](super::QOut::Q8)'s rounded values plus the zero point, before the clamp to the
/// output type: the float value held within `+-Q8_HOLD` (NaN as +hold), rounded half to even
/// (the default rounding mode), plus `zero`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
fn q8_lanes(fin: &Finish, i: usize, cols: &Cols16, raw: __m512i, zero: i32) -> __m512i {
    let y = lanes_f32(cols, lanes_i32(fin, i, cols, raw));
    // SAFETY: this function's features include AVX-512F.
    unsafe { held_rounded(y, _mm512_set1_epi32(zero)) }
}

/// The float values `y` held within `+-Q8_HOLD` (NaN as +hold), rounded half to even (the
/// default rounding mode), plus `zero`: [`QOut::Q8`](super::QOut::Q8) before the clamp.
///
/// # Safety
/// AVX-512F present (always inlined into kernels compiled for it).
#[inline(always)]
unsafe fn held_rounded(y: __m512, zero: __m512i) -> __m512i {
    // `min(y, hold)` gives `hold` for a NaN y (the second operand), as f32::min.
    let hold = _mm512_set1_ps(super::Q8_HOLD);
    let y = _mm512_max_ps(_mm512_min_ps(y, hold), _mm512_set1_ps(-super::Q8_HOLD));
    _mm512_add_epi32(_mm512_cvtps_epi32(y), zero)
}

/// Stores [`q8_lanes`]' values of 64 columns (`q[v]` columns 16v..16v + 16) as bytes: two
/// saturating packs to 16 then 8 bits clamp them to the output type (signed or unsigned),
/// and a dword permute puts the 128-bit lanes' interleaving back in order.
///
/// # Safety
/// AVX-512 F/BW present; `p` addresses 64 writable bytes.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn store_q8x64(p: *mut u8, q: [__m512i; 4], signed: bool) {
    let (w01, w23) = (
        _mm512_packs_epi32(q[0], q[1]),
        _mm512_packs_epi32(q[2], q[3]),
    );
    let bytes = if signed {
        _mm512_packs_epi16(w01, w23)
    } else {
        _mm512_packus_epi16(w01, w23)
    };
    // Lane L holds q[0][4L..4L + 4], q[1][4L..], q[2][4L..], q[3][4L..]: dword L * 4 + v
    // goes to v * 4 + L.
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    // SAFETY: 64 bytes at p (contract).
    unsafe { _mm512_storeu_si512(p as *mut _, _mm512_permutexvar_epi32(order, bytes)) };
}

/// Finishes and stores 16 whole columns (`cols`) of row `i` (the vector form of
/// [`Finish::store`], the same operations lane by lane).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
#[inline]
unsafe fn store16(fin: &Finish, i: usize, cols: &Cols16, raw: __m512i) {
    let j0 = cols.j0;
    let float = || lanes_f32(cols, lanes_i32(fin, i, cols, raw));
    let v = || lanes_i32(fin, i, cols, raw);
    match fin.out {
        OutPtr::I32(p, ld) => {
            // SAFETY: (i, j0..j0 + 16) is in this task's tile (see OutPtr).
            _mm512_storeu_si512(p.add(i * ld + j0) as *mut _, v())
        }
        OutPtr::F32(p, ld) => {
            // SAFETY: as above.
            _mm512_storeu_ps(p.add(i * ld + j0), float())
        }
        OutPtr::Q8 {
            p,
            rs,
            cs,
            zero,
            signed,
        } => {
            // Clamp to the output type's range, then keep each lane's low byte.
            let (lo, hi) = if signed { (-128, 127) } else { (0, 255) };
            let q = q8_lanes(fin, i, cols, raw, zero);
            let q = _mm512_min_epi32(
                _mm512_max_epi32(q, _mm512_set1_epi32(lo)),
                _mm512_set1_epi32(hi),
            );
            let bytes = _mm512_cvtepi32_epi8(q);
            if cs == 1 {
                // SAFETY: (i, j0..j0 + 16) is in this task's tile, bytes i * rs + j0.. (see
                // OutPtr).
                _mm_storeu_si128(p.add(i * rs + j0) as *mut _, bytes);
            } else {
                let mut b = [0u8; PANEL];
                _mm_storeu_si128(b.as_mut_ptr() as *mut _, bytes);
                for (c, &v) in b.iter().enumerate() {
                    // SAFETY: as above, element (i, j0 + c).
                    *p.add(i * rs + (j0 + c) * cs) = v;
                }
            }
        }
    }
}

/// Stores 64 bytes: the i32 lanes of `q` (each in 0..=255) in order, narrowed by two saturating
/// packs and a dword permute (the packs interleave by 128-bit lane). A narrowing store straight
/// to memory (`vpmovusdb m128, zmm`) is slow on some CPUs (Zen 4: 42% of QLinearAdd's samples
/// sat on it).
///
/// # Safety
/// AVX-512 F/BW present; `p` addresses 64 writable bytes.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn store_bytes64(p: *mut u8, q: [__m512i; 4]) {
    // Lane L of the packed bytes holds q[0][4L..4L + 4], q[1][4L..], q[2][4L..], q[3][4L..]:
    // dword L * 4 + v goes to v * 4 + L.
    let words = _mm512_packus_epi16(
        _mm512_packus_epi32(q[0], q[1]),
        _mm512_packus_epi32(q[2], q[3]),
    );
    let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    // SAFETY: 64 bytes at p (contract).
    unsafe { _mm512_storeu_si512(p as *mut _, _mm512_permutexvar_epi32(order, words)) };
}

/// `round_half_even(v / s) + z` clamped to 0..=255 (0 for NaN), as i32 lanes: the scalar
/// quantizer's operations in 16 lanes.
#[target_feature(enable = "avx512f")]
#[inline]
fn quantize_lanes(v: __m512, s: __m512, z: __m512) -> __m512i {
    let q = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_div_ps(v, s),
    );
    // max(., 0) first: it returns 0 for NaN, as the scalar clamp-then-cast does.
    let (lo, hi) = (_mm512_setzero_ps(), _mm512_set1_ps(255.0));
    _mm512_cvttps_epi32(_mm512_min_ps(_mm512_max_ps(_mm512_add_ps(q, z), lo), hi))
}

/// Writes `out[..n16]` (`n16` a multiple of 16) from `lanes(i)`, the 16 values from `i` as i32
/// lanes in 0..=255: 64 at a time by [`store_bytes64`], the rest 16 at a time.
///
/// # Safety
/// AVX-512 F/BW/VL present (always inlined into kernels compiled for them); `n16 <= out.len()`
/// and `lanes` is sound for every `i + 16 <= n16`.
#[inline(always)]
unsafe fn store_u8_lanes(out: &mut [u8], n16: usize, lanes: impl Fn(usize) -> __m512i) {
    assert!(n16 <= out.len() && n16.is_multiple_of(16));
    let n64 = n16 / 64 * 64;
    for i in (0..n64).step_by(64) {
        let q = [lanes(i), lanes(i + 16), lanes(i + 32), lanes(i + 48)];
        // SAFETY: i + 64 <= n16 <= len (asserted).
        unsafe { store_bytes64(out.as_mut_ptr().add(i), q) };
    }
    for i in (n64..n16).step_by(16) {
        let r = _mm512_cvtusepi32_epi8(lanes(i));
        // SAFETY: i + 16 <= n16 <= len (asserted).
        unsafe { _mm_storeu_si128(out.as_mut_ptr().add(i) as *mut _, r) };
    }
}

/// [`super::quantize_u8`] in 16 lanes: the same f32 division, round-half-even, add and clamp.
///
/// # Safety
/// AVX-512 F/BW/VL must be present.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn quantize_u8_avx512(x: &[f32], scale: f32, zp: f32, out: &mut [u8]) {
    assert_eq!(x.len(), out.len());
    let (s, z) = (_mm512_set1_ps(scale), _mm512_set1_ps(zp));
    let n16 = x.len() / 16 * 16;
    // SAFETY: lanes i..i + 16 < n16 <= len of both slices (the store's contract).
    unsafe {
        store_u8_lanes(out, n16, |i| {
            quantize_lanes(_mm512_loadu_ps(x.as_ptr().add(i)), s, z)
        })
    };
    super::quantize_u8_portable(&x[n16..], scale, zp, &mut out[n16..]);
}

/// [`super::qadd_u8`] in 16 lanes: the portable form's operations, lane by lane (no fused
/// multiply-add), then [`quantize_u8_avx512`]'s.
///
/// # Safety
/// AVX-512 F/BW/VL must be present; the three slices have one length.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
pub(super) unsafe fn qadd_u8_avx512(
    a: &[u8],
    (za, sa): (f32, f32),
    b: &[u8],
    (zb, sb): (f32, f32),
    (zc, sc): (f32, f32),
    out: &mut [u8],
) {
    let n16 = out.len() / 16 * 16;
    let (za_v, sa_v, zb_v, sb_v) = (
        _mm512_set1_ps(za),
        _mm512_set1_ps(sa),
        _mm512_set1_ps(zb),
        _mm512_set1_ps(sb),
    );
    let (s, z) = (_mm512_set1_ps(sc), _mm512_set1_ps(zc));
    let bytes = |p: &[u8], i: usize| {
        // SAFETY: i + 16 <= n16 <= the slices' one length (checked by the caller).
        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(unsafe {
            _mm_loadu_si128(p.as_ptr().add(i) as *const _)
        }))
    };
    // SAFETY: lanes i..i + 16 < n16 <= len of the three slices (the store's contract).
    unsafe {
        store_u8_lanes(out, n16, |i| {
            let v = _mm512_add_ps(
                _mm512_mul_ps(_mm512_sub_ps(bytes(a, i), za_v), sa_v),
                _mm512_mul_ps(_mm512_sub_ps(bytes(b, i), zb_v), sb_v),
            );
            quantize_lanes(v, s, z)
        })
    };
    super::qadd_u8_portable(
        &a[n16..],
        (za, sa),
        &b[n16..],
        (zb, sb),
        (zc, sc),
        &mut out[n16..],
    );
}

/// [`super::qadd_u8`] in 8 lanes (AVX2): the same operations as the AVX-512 form.
///
/// # Safety
/// AVX2 must be present; the three slices have one length.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn qadd_u8_avx2(
    a: &[u8],
    (za, sa): (f32, f32),
    b: &[u8],
    (zb, sb): (f32, f32),
    (zc, sc): (f32, f32),
    out: &mut [u8],
) {
    let n8 = out.len() / 8 * 8;
    let (za_v, sa_v, zb_v, sb_v) = (
        _mm256_set1_ps(za),
        _mm256_set1_ps(sa),
        _mm256_set1_ps(zb),
        _mm256_set1_ps(sb),
    );
    let (s, z) = (_mm256_set1_ps(sc), _mm256_set1_ps(zc));
    let (lo, hi) = (_mm256_setzero_ps(), _mm256_set1_ps(255.0));
    for i in (0..n8).step_by(8) {
        // SAFETY: i + 8 <= len for the three slices (one length, checked by the caller).
        unsafe {
            let x = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                a.as_ptr().add(i) as *const _
            )));
            let y = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(
                b.as_ptr().add(i) as *const _
            )));
            let v = _mm256_add_ps(
                _mm256_mul_ps(_mm256_sub_ps(x, za_v), sa_v),
                _mm256_mul_ps(_mm256_sub_ps(y, zb_v), sb_v),
            );
            let q = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm256_div_ps(v, s),
            );
            let q = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(q, z), lo), hi);
            let w = _mm256_cvttps_epi32(q);
            let p16 = _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256::<1>(w));
            let p8 = _mm_packus_epi16(p16, p16);
            _mm_storel_epi64(out.as_mut_ptr().add(i) as *mut _, p8);
        }
    }
    super::qadd_u8_portable(
        &a[n8..],
        (za, sa),
        &b[n8..],
        (zb, sb),
        (zc, sc),
        &mut out[n8..],
    );
}

/// [`super::quantize_u8`] in 8 lanes (AVX2): the same operations as the AVX-512 form.
///
/// # Safety
/// AVX2 must be present.
#[target_feature(enable = "avx2")]
pub(super) unsafe fn quantize_u8_avx2(x: &[f32], scale: f32, zp: f32, out: &mut [u8]) {
    assert_eq!(x.len(), out.len());
    let (s, z) = (_mm256_set1_ps(scale), _mm256_set1_ps(zp));
    let (lo, hi) = (_mm256_setzero_ps(), _mm256_set1_ps(255.0));
    let n8 = x.len() / 8 * 8;
    for i in (0..n8).step_by(8) {
        // SAFETY: i + 8 <= len for both slices.
        let v = _mm256_loadu_ps(x.as_ptr().add(i));
        let q = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_div_ps(v, s),
        );
        // max(., 0) first: it returns 0 for NaN (the second operand), as the scalar
        // clamp-then-cast does.
        let q = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(q, z), lo), hi);
        let w = _mm256_cvttps_epi32(q);
        // 8 i32 in 0..=255 -> 8 bytes.
        let p16 = _mm_packus_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256::<1>(w));
        let p8 = _mm_packus_epi16(p16, p16);
        _mm_storel_epi64(out.as_mut_ptr().add(i) as *mut _, p8);
    }
    super::quantize_u8_portable(&x[n8..], scale, zp, &mut out[n8..]);
}

/// [`super::byte_sum`] with AVX-512BW: 64 bytes a step summed by `vpsadbw` into eight 64-bit
/// lanes, the tail masked.
///
/// # Safety
/// AVX-512F and BW present.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn byte_sum_avx512(v: &[u8]) -> u32 {
    let zero = _mm512_setzero_si512();
    let mut acc = zero;
    let mut p = 0;
    while p < v.len() {
        let n = (v.len() - p).min(64);
        let mask: __mmask64 = if n == 64 { !0 } else { (1u64 << n) - 1 };
        // SAFETY: the masked bytes p..p + n lie in `v`; masked-off ones are not read.
        let x = unsafe { _mm512_maskz_loadu_epi8(mask, v.as_ptr().add(p) as *const i8) };
        acc = _mm512_add_epi64(acc, _mm512_sad_epu8(x, zero));
        p += 64;
    }
    _mm512_reduce_add_epi64(acc) as u32
}
