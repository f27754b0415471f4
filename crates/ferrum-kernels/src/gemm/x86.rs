//! x86-64 microkernels for [`super`]: AVX-512F (`MR x 32`, with kernels for every row count up to
//! `MR` and for 16-column edges, so edge tiles cost what their size does) and AVX2 + FMA
//! (`6 x 16`). Each keeps its tile of C in registers over a packed K block: per step, the B
//! panel's row is loaded once and every A value is broadcast against it.
//!
//! The AVX-512 kernel writes its tile straight into C (masked at the right edge, or transposed in
//! registers for a C stored transposed), applying `alpha`, the old C, the bias and the vectorised
//! activations in registers; the AVX2 kernel goes through [`super::write_tile`]. The AVX-512
//! transpose also packs operands whose rows are contiguous along K ([`pack_transposed`]).

use std::arch::x86_64::*;

use super::epilogue::{EXP_HI, EXP_LO, EXP_P, GELU_CUT, GELU_Q, LN2_HI, LN2_LO, ROUND_MAGIC};
use super::{write_tile, APanel, Act, Micro, Out, TileEpi};

/// The AVX-512 kernel: panels of `MR` rows and 32 columns.
pub struct Avx512<const MR: usize>;

impl<const MR: usize> Micro for Avx512<MR> {
    const MR: usize = MR;
    const NR: usize = 32;
    #[inline]
    unsafe fn tile(
        kc: usize,
        a: APanel,
        b: *const f32,
        ldb: usize,
        rows: usize,
        cols: usize,
        out: &Out,
    ) {
        macro_rules! by_rows {
            ($nv:literal, $ip:literal, $half:literal, $($r:literal)*) => {
                match rows {
                    // SAFETY: forwarded from the caller (panel sizes, tile extent, AVX-512F);
                    // `rows <= MR` is checked by the match arm's bound.
                    $($r if $r <= MR => unsafe {
                        tile_avx512::<MR, $r, $nv, $ip, $half>(kc, a, b, ldb, cols, out)
                    },)*
                    _ => unreachable!("gemm: {rows} rows in an AVX-512 tile of {MR}"),
                }
            };
        }
        macro_rules! by_width {
            ($ip:literal) => {
                match cols {
                    0..=8 => by_rows!(1, $ip, true, 1 2 3 4 5 6 7 8 9 10 11 12 13 14),
                    9..=16 => by_rows!(1, $ip, false, 1 2 3 4 5 6 7 8 9 10 11 12 13 14),
                    17..=24 => by_rows!(2, $ip, true, 1 2 3 4 5 6 7 8 9 10 11 12 13 14),
                    _ => by_rows!(2, $ip, false, 1 2 3 4 5 6 7 8 9 10 11 12 13 14),
                }
            };
        }
        if a.lda == 0 {
            by_width!(false)
        } else {
            by_width!(true)
        }
    }
}

/// The prefetches a tile makes for [`Out::fetch`]: its lines asked for one at a time, spread
/// evenly over the tile's steps of K (a burst before the tile would hold the line fill buffers
/// as misses do), at most one a step.
struct Fetch {
    ptr: *const f32,
    lines: usize,
    every: usize,
    due: usize,
    line: usize,
}

impl Fetch {
    #[inline(always)]
    fn new(out: &Out, kc: usize) -> Fetch {
        Fetch {
            ptr: out.fetch,
            lines: out.fetch_lines,
            every: kc.checked_div(out.fetch_lines).unwrap_or(0).max(1),
            due: 0,
            line: 0,
        }
    }

    /// At step `p`: the next line, when one is due.
    #[inline(always)]
    fn at(&mut self, p: usize) {
        if p >= self.due && self.line < self.lines {
            // SAFETY: a prefetch of a line inside the slice `Out::fetch` describes; prefetches
            // never fault and change no memory.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(self.ptr.add(self.line * 16).cast()) };
            self.line += 1;
            self.due += self.every;
        }
    }
}

/// The `R x 16*NV` tile of `a` (a panel of row stride `MR`, or with `IN_PLACE` A's rows
/// `a.lda` apart: [`APanel`]) times `b`'s panel (row stride `ldb`), written per `out` for its first
/// `cols` columns. With `HALF`, the tile's last vector holds at most 8 columns, and its
/// products are 8-lane (256-bit) FMAs: on CPUs that split a 512-bit FMA into two 256-bit
/// halves (AMD Zen 4) the dead half costs as much as a live one, so a 24-column edge (a
/// MobileNetV2 projection to 24 channels, every tile of it) runs 18 FMA slots a step instead of
/// 24. The upper lanes of such a vector are zero and never stored.
///
/// # Safety
/// `a` addresses `kc` steps of `R` rows (`kc * MR` floats packed), `b` `kc` steps of 32 floats `ldb` apart,
/// `R <= MR`, `cols <= 16 * NV` (`cols <= 16 * NV - 8` with `HALF`), `out` addresses an
/// `R x cols` tile (and its bias pointers `R` and `cols` values), and the CPU supports AVX-512F.
#[target_feature(enable = "avx512f")]
unsafe fn tile_avx512<
    const MR: usize,
    const R: usize,
    const NV: usize,
    const IN_PLACE: bool,
    const HALF: bool,
>(
    kc: usize,
    a: APanel,
    b: *const f32,
    ldb: usize,
    cols: usize,
    out: &Out,
) {
    let mut acc = [[_mm512_setzero_ps(); NV]; R];
    let rp = a.rows::<R>(R);
    let mut fetch = Fetch::new(out, kc);
    for p in 0..kc {
        fetch.at(p);
        // SAFETY: p < kc and R <= MR, so the loads stay inside the panels the caller vouched for
        // (A read in place: inside its R rows of kc steps).
        unsafe {
            let bp = b.add(p * ldb);
            let mut bv = [_mm512_setzero_ps(); NV];
            for (v, x) in bv.iter_mut().enumerate() {
                *x = _mm512_loadu_ps(bp.add(16 * v));
            }
            for (r, row) in acc.iter_mut().enumerate() {
                let av = _mm512_set1_ps(if IN_PLACE {
                    *rp[r].add(p)
                } else {
                    *a.ptr.add(p * MR + r)
                });
                for (v, (acc, &x)) in row.iter_mut().zip(&bv).enumerate() {
                    *acc = if HALF && v == NV - 1 {
                        // The low 8 lanes only; the 256-bit operation zeroes the upper ones.
                        _mm512_zextps256_ps512(_mm256_fmadd_ps(
                            _mm512_castps512_ps256(av),
                            _mm512_castps512_ps256(x),
                            _mm512_castps512_ps256(*acc),
                        ))
                    } else {
                        _mm512_fmadd_ps(av, x, *acc)
                    };
                }
            }
        }
    }
    // The out-of-line writers get a copy of the sums ([`spill`]); the inline paths read them in
    // registers.
    if out.csc != 1 {
        if out.rsc == 1 {
            // SAFETY: forwarded from the caller.
            return unsafe { write_transposed_avx512::<R, NV>(spill(&acc), cols, out) };
        }
        // Any other strides: through a row-major buffer.
        let mut buf = [0f32; 14 * 32];
        for (r, row) in acc.iter().enumerate() {
            for (v, &x) in row.iter().enumerate() {
                // SAFETY: r < R <= 14 and v < NV <= 2 keep the store inside `buf`.
                unsafe { _mm512_storeu_ps(buf.as_mut_ptr().add(r * 32 + 16 * v), x) };
            }
        }
        // SAFETY: forwarded from the caller (`out` addresses R x cols).
        unsafe { write_tile(&buf, 32, R, cols, out) };
        return;
    }
    if out.alpha == 1.0 && out.epi.is_none() && cols == 16 * NV {
        // The common tile: whole, overwritten or added to.
        for (r, row) in acc.iter().enumerate() {
            for (v, &x) in row.iter().enumerate() {
                // SAFETY: r < R rows and 16 * NV == cols columns lie in the tile the caller
                // vouched for.
                unsafe {
                    let p = out.c.add(r * out.rsc + 16 * v);
                    let x = if out.acc {
                        _mm512_add_ps(x, _mm512_loadu_ps(p))
                    } else {
                        x
                    };
                    _mm512_storeu_ps(p, x);
                }
            }
        }
        return;
    }
    if out.alpha == 1.0 {
        if let Some(e) = &out.epi {
            // A tile with a bias, residual or simple activation (a convolution's or a linear
            // layer's epilogue): written from the registers, the activation chosen once for
            // the tile. SAFETY (each call): forwarded from the caller.
            match e.act {
                Act::Identity => {
                    return unsafe { write_epi_avx512::<R, NV, 0>(&acc, cols, e, out) }
                }
                Act::Relu => return unsafe { write_epi_avx512::<R, NV, 1>(&acc, cols, e, out) },
                Act::Clip { .. } => {
                    return unsafe { write_epi_avx512::<R, NV, 2>(&acc, cols, e, out) }
                }
                Act::Gelu => return unsafe { write_epi_avx512::<R, NV, 3>(&acc, cols, e, out) },
                Act::Sigmoid | Act::Silu | Act::HardSigmoid { .. } | Act::HardSwish => {
                    return unsafe { write_epi_avx512::<R, NV, 4>(&acc, cols, e, out) }
                }
                _ => {}
            }
        }
    }
    // SAFETY: forwarded from the caller.
    unsafe { write_avx512::<R, NV>(spill(&acc), cols, out) };
}

/// A copy of a tile's sums for the out-of-line writers, made in memory that nothing zeroes first.
/// Handing them the kernel's own array kept that array in memory for the whole tile, zeroed by a
/// call to memset before every tile (1.5 KiB, about 4% of a 12 x 32 tile of depth 64) and read
/// back from the stack by the inline writers too.
#[inline(always)]
fn spill<const R: usize, const NV: usize>(acc: &[[__m512; NV]; R]) -> [[__m512; NV]; R] {
    let mut t = std::mem::MaybeUninit::<[[__m512; NV]; R]>::uninit();
    let at = t.as_mut_ptr().cast::<__m512>();
    for (r, row) in acc.iter().enumerate() {
        for (v, &x) in row.iter().enumerate() {
            // SAFETY: r < R and v < NV index one of the array's R * NV vectors.
            unsafe { at.add(r * NV + v).write(x) };
        }
    }
    // SAFETY: every one of the R * NV vectors was written above.
    unsafe { t.assume_init() }
}

/// Writes a tile (`csc == 1`, `alpha == 1`, its first `cols` columns, a masked right edge as
/// [`write_avx512`]'s) with its epilogue: [`write_avx512`]'s operations in its order (C's old
/// value where it accumulates, residual, row bias, column bias, activation), so the same bits,
/// with the activation fixed at compile time (`ACT`: 0 identity, 1 [`Act::Relu`], 2
/// [`Act::Clip`], 3 [`Act::Gelu`], 4 the logistic family through [`act_avx512`]) and the column bias loaded once for the tile. MobileNetV2's 1x1 layers spent
/// 9% of the network's time in the out-of-line general writer (the tile's 24 vectors stored and
/// reloaded, a branch per vector); through this one the expansion-and-depthwise layers run 3-5%
/// faster (`cargo bench --bench conv`).
///
/// Always inlined into [`tile_avx512`] (so the tile stays in registers), whose AVX-512 feature
/// its intrinsics then run under: it has no target feature of its own, which an always-inlined
/// function cannot have.
///
/// # Safety
/// As [`tile_avx512`]: `16 * (NV - 1) < cols <= 16 * NV`, `out` addresses an `R x cols` tile
/// with `csc == 1`, and `e`'s bias and residual pointers (where not null) its rows and
/// columns; the CPU supports AVX-512F.
#[inline(always)]
unsafe fn write_epi_avx512<const R: usize, const NV: usize, const ACT: u8>(
    t: &[[__m512; NV]; R],
    cols: usize,
    e: &TileEpi,
    out: &Out,
) {
    let tail = edge_mask::<NV>(cols);
    let (lo, hi) = match e.act {
        Act::Clip { lo, hi } => (_mm512_set1_ps(lo), _mm512_set1_ps(hi)),
        _ => (_mm512_setzero_ps(), _mm512_setzero_ps()),
    };
    // A plain loop, not a closure: a closure here would not run under the caller's feature.
    let mut col = [_mm512_setzero_ps(); NV];
    if !e.col.is_null() {
        for (v, c) in col.iter_mut().enumerate() {
            let mask = if v == NV - 1 { tail } else { 0xffff };
            // SAFETY: the tile's masked columns of the column bias (the caller's extent).
            *c = unsafe { _mm512_maskz_loadu_ps(mask, e.col.add(16 * v)) };
        }
    }
    // The rows one by one at constant indices (R <= 14), so that the tile stays in registers:
    // a loop over them indexed the array, which kept it in memory.
    macro_rules! each_row {
        ($($r:literal)*) => {$(
            if $r < R {
                // SAFETY: forwarded from the caller (row $r < R of the tile).
                unsafe { epi_row::<NV, ACT>(t[$r], $r, tail, &col, (lo, hi), e, out) };
            }
        )*};
    }
    each_row!(0 1 2 3 4 5 6 7 8 9 10 11 12 13);
}

/// Row `r` of [`write_epi_avx512`]'s tile: its terms added, the activation (`ACT`), stored.
/// Always inlined, so it runs under its caller's AVX-512 feature.
///
/// # Safety
/// As [`write_epi_avx512`], for row `r` of its tile.
#[inline(always)]
unsafe fn epi_row<const NV: usize, const ACT: u8>(
    row: [__m512; NV],
    r: usize,
    tail: __mmask16,
    col: &[__m512; NV],
    (lo, hi): (__m512, __m512),
    e: &TileEpi,
    out: &Out,
) {
    for (v, &x) in row.iter().enumerate() {
        let mask = if v == NV - 1 { tail } else { 0xffff };
        // SAFETY: row r and the masked columns (< cols) lie in the tile the caller vouched for,
        // as do the row bias and the residual (C's extent); masked-off lanes are neither read
        // nor written.
        unsafe {
            let p = out.c.add(r * out.rsc + 16 * v);
            let mut x = add_terms(x, mask, out, Some(e), col[v], r, v);
            // `act_avx512`'s operations for the kinds named by ACT.
            x = match ACT {
                1 => _mm512_max_ps(x, _mm512_setzero_ps()),
                2 => _mm512_min_ps(hi, _mm512_max_ps(lo, x)),
                3 => gelu_avx512(x),
                4 => act_avx512(e.act, x),
                _ => x,
            };
            if mask == 0xffff {
                _mm512_storeu_ps(p, x);
            } else {
                _mm512_mask_storeu_ps(p, mask, x);
            }
        }
    }
}

/// Vector `v` of row `r` of a tile (lanes `mask`) plus its epilogue's terms, in the order both
/// tile writers use and so with their bits: C's old value (where `out.acc`), then, where `e` has
/// them, the residual, the row bias and the column bias (`col`: the tile's columns of it, loaded
/// by the caller). Always inlined, so it runs under its caller's AVX-512 feature.
///
/// # Safety
/// `r` and the masked lanes of vector `v` lie in the tile `out` addresses, as do `e`'s row bias
/// and residual (C's extent); the CPU supports AVX-512F.
#[inline(always)]
unsafe fn add_terms(
    mut x: __m512,
    mask: __mmask16,
    out: &Out,
    e: Option<&TileEpi>,
    col: __m512,
    r: usize,
    v: usize,
) -> __m512 {
    let at = r * out.rsc + 16 * v;
    // SAFETY: the caller's extent; masked-off lanes are not read.
    unsafe {
        if out.acc {
            x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(mask, out.c.add(at)));
        }
        if let Some(e) = e {
            if !e.z.is_null() {
                x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(mask, e.z.add(at)));
            }
            if !e.row.is_null() {
                x = _mm512_add_ps(x, _mm512_set1_ps(*e.row.add(r)));
            }
            if !e.col.is_null() {
                x = _mm512_add_ps(x, col);
            }
        }
    }
    x
}

/// The lanes of a tile's last vector that lie inside its `cols` columns (`16 * (NV - 1) < cols
/// <= 16 * NV`).
fn edge_mask<const NV: usize>(cols: usize) -> __mmask16 {
    let left = cols - 16 * (NV - 1);
    if left >= 16 {
        0xffff
    } else {
        (1u16 << left) - 1
    }
}

/// Writes a tile per `out` on the general path: `alpha`, a masked right edge, the epilogue.
/// Kept out of line so that the common path keeps the tile in registers.
///
/// # Safety
/// As [`tile_avx512`]: `out` addresses an `R x cols` tile (`csc == 1`) and its bias values.
#[inline(never)]
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn write_avx512<const R: usize, const NV: usize>(
    t: [[__m512; NV]; R],
    cols: usize,
    out: &Out,
) {
    let alpha = _mm512_set1_ps(out.alpha);
    let tail = edge_mask::<NV>(cols);
    for (r, row) in t.iter().enumerate() {
        for (v, &x) in row.iter().enumerate() {
            let mask = if v == NV - 1 { tail } else { 0xffff };
            // SAFETY: r < R rows and the masked columns (< cols) lie in the tile the caller
            // vouched for (and in the residual, which has C's extent); masked-off lanes are
            // neither read nor written.
            unsafe {
                let p = out.c.add(r * out.rsc + 16 * v);
                let mut x = x;
                if out.alpha != 1.0 {
                    x = _mm512_mul_ps(x, alpha);
                }
                let e = out.epi.as_ref();
                let col = match e {
                    Some(e) if !e.col.is_null() => _mm512_maskz_loadu_ps(mask, e.col.add(16 * v)),
                    _ => _mm512_setzero_ps(),
                };
                x = add_terms(x, mask, out, e, col, r, v);
                if let Some(e) = e {
                    x = act_avx512(e.act, x);
                }
                if mask == 0xffff {
                    _mm512_storeu_ps(p, x);
                } else {
                    _mm512_mask_storeu_ps(p, mask, x);
                }
            }
        }
    }
    if let Some(e) = &out.epi {
        if !e.act.is_vector() {
            for r in 0..R {
                for j in 0..cols {
                    // SAFETY: r < R and j < cols stay inside the tile the caller vouched for.
                    unsafe {
                        let p = out.c.add(r * out.rsc + j);
                        *p = e.act.apply(*p);
                    }
                }
            }
        }
    }
}

/// Writes a tile into a C stored transposed (`rsc == 1`: each of the tile's columns is `R`
/// contiguous floats, `csc` apart), transposing it in registers: as [`write_avx512`] otherwise.
///
/// # Safety
/// As [`tile_avx512`]: `out` addresses an `R x cols` tile with `rsc == 1`, and its bias values.
#[inline(never)]
#[target_feature(enable = "avx512f")]
unsafe fn write_transposed_avx512<const R: usize, const NV: usize>(
    t: [[__m512; NV]; R],
    cols: usize,
    out: &Out,
) {
    let alpha = _mm512_set1_ps(out.alpha);
    let mask: __mmask16 = (1u16 << R) - 1;
    for v in 0..NV {
        let mut rows = [_mm512_setzero_ps(); 16];
        for (x, row) in rows.iter_mut().zip(&t) {
            *x = row[v];
        }
        let tr = transpose16(&rows);
        for (c, &x) in tr.iter().enumerate().take(cols.saturating_sub(16 * v)) {
            let j = 16 * v + c;
            // SAFETY: column j < cols of the tile, its R rows contiguous (rsc == 1), lie in the
            // tile the caller vouched for, as do the bias values and the residual (C's extent);
            // masked-off lanes are neither read nor written.
            unsafe {
                let p = out.c.add(j * out.csc);
                let mut x = x;
                if out.alpha != 1.0 {
                    x = _mm512_mul_ps(x, alpha);
                }
                if out.acc {
                    x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(mask, p));
                }
                if let Some(e) = &out.epi {
                    if !e.z.is_null() {
                        x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(mask, e.z.add(j * out.csc)));
                    }
                    if !e.row.is_null() {
                        x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(mask, e.row));
                    }
                    if !e.col.is_null() {
                        x = _mm512_add_ps(x, _mm512_set1_ps(*e.col.add(j)));
                    }
                    x = act_avx512(e.act, x);
                }
                _mm512_mask_storeu_ps(p, mask, x);
                if let Some(e) = &out.epi {
                    if !e.act.is_vector() {
                        for r in 0..R {
                            *p.add(r) = e.act.apply(*p.add(r));
                        }
                    }
                }
            }
        }
    }
}

/// The vectorised activations, bit for bit as [`Act::apply`]; the others pass `x` through (the
/// caller applies them per element).
#[inline]
#[target_feature(enable = "avx512f")]
pub(crate) fn act_avx512(act: Act, x: __m512) -> __m512 {
    match act {
        // `max(a, b)` is `a > b ? a : b`: NaN gives 0, as `Act::apply`.
        Act::Relu => _mm512_max_ps(x, _mm512_setzero_ps()),
        // `x < lo ? lo : x`, then `y > hi ? hi : y`: NaN stays.
        Act::Clip { lo, hi } => {
            _mm512_min_ps(_mm512_set1_ps(hi), _mm512_max_ps(_mm512_set1_ps(lo), x))
        }
        Act::LeakyRelu(s) => {
            let ge = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, _mm512_setzero_ps());
            _mm512_mask_blend_ps(ge, _mm512_mul_ps(x, _mm512_set1_ps(s)), x)
        }
        // SAFETY (each): AVX-512F is enabled for this function.
        Act::Gelu => unsafe { gelu_avx512(x) },
        Act::Sigmoid => unsafe { sigmoid_avx512(x) },
        Act::Silu => _mm512_mul_ps(x, unsafe { sigmoid_avx512(x) }),
        Act::HardSigmoid { alpha, beta } => {
            let t = _mm512_add_ps(
                _mm512_mul_ps(_mm512_set1_ps(alpha), x),
                _mm512_set1_ps(beta),
            );
            unsafe { clamp01_avx512(t) }
        }
        Act::HardSwish => {
            let t = _mm512_add_ps(
                _mm512_mul_ps(x, _mm512_set1_ps(1.0 / 6.0)),
                _mm512_set1_ps(0.5),
            );
            _mm512_mul_ps(x, unsafe { clamp01_avx512(t) })
        }
        _ => x,
    }
}

/// [`super::clamp01`] on 16 lanes: `max(0, t)` is `t < 0 ? 0 : t` and `min(1, y)` is `y > 1 ? 1
/// : y` (each returns its second operand for NaN), so NaN stays.
///
/// # Safety
/// The CPU supports AVX-512F.
#[inline(always)]
unsafe fn clamp01_avx512(t: __m512) -> __m512 {
    // SAFETY: register-only AVX-512F operations; the caller vouches for the feature.
    unsafe { _mm512_min_ps(_mm512_set1_ps(1.0), _mm512_max_ps(_mm512_setzero_ps(), t)) }
}

/// [`super::exp_f32`] on 16 lanes, operation for operation (no multiply-add fused; `2^n` from
/// its exponent bits as the scalar's), so the same bits.
///
/// # Safety
/// The CPU supports AVX-512F.
#[inline(always)]
unsafe fn exp_avx512(d: __m512, err: __m512) -> __m512 {
    // SAFETY: register-only AVX-512F operations; the caller vouches for the feature.
    unsafe {
        let s = _mm512_set1_ps;
        // `max(LO, d)` is `d < LO ? LO : d` and `min(HI, c)` is `c > HI ? HI : c` (NaN passes).
        let c = _mm512_min_ps(s(EXP_HI), _mm512_max_ps(s(EXP_LO), d));
        let z = _mm512_add_ps(
            _mm512_mul_ps(c, s(std::f32::consts::LOG2_E)),
            s(ROUND_MAGIC),
        );
        let n = _mm512_sub_ps(z, s(ROUND_MAGIC));
        let r = _mm512_add_ps(_mm512_sub_ps(c, _mm512_mul_ps(n, s(LN2_HI))), err);
        let r = _mm512_sub_ps(r, _mm512_mul_ps(n, s(LN2_LO)));
        let r2 = _mm512_mul_ps(r, r);
        let mut p = s(EXP_P[0]);
        for &k in &EXP_P[1..] {
            p = _mm512_add_ps(_mm512_mul_ps(p, r), s(k));
        }
        let y = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(p, r2), r), s(1.0));
        let nb = _mm512_sub_epi32(
            _mm512_castps_si512(z),
            _mm512_set1_epi32(ROUND_MAGIC.to_bits() as i32),
        );
        let bits = _mm512_slli_epi32::<23>(_mm512_add_epi32(nb, _mm512_set1_epi32(127)));
        let e = _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
        let under = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(d, s(EXP_LO));
        let e = _mm512_mask_blend_ps(under, e, _mm512_setzero_ps());
        let over = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(d, s(EXP_HI));
        _mm512_mask_blend_ps(over, e, s(f32::INFINITY))
    }
}

/// [`super::sigmoid_f32`] on 16 lanes, operation for operation, so the same bits: `e^-|x|`,
/// `1 / (1 + e)`, times `e` where `x` is not `>= 0` (NaN included).
///
/// # Safety
/// The CPU supports AVX-512F.
#[inline(always)]
unsafe fn sigmoid_avx512(x: __m512) -> __m512 {
    let neg_abs = _mm512_castsi512_ps(_mm512_or_si512(
        _mm512_castps_si512(x),
        _mm512_set1_epi32(i32::MIN),
    ));
    // SAFETY: the caller vouches for AVX-512F.
    let e = unsafe { exp_avx512(neg_abs, _mm512_setzero_ps()) };
    let one = _mm512_set1_ps(1.0);
    let q = _mm512_div_ps(one, _mm512_add_ps(one, e));
    let ge = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, _mm512_setzero_ps());
    _mm512_mask_blend_ps(ge, _mm512_mul_ps(e, q), q)
}

/// [`super::gelu_erf`] on 16 lanes, operation for operation (each multiply-add fused, `2^n` by
/// `vscalefps`, exact as the scalar's exponent bits are for these n), so the same bits. A FFN's
/// GELU applied as its product's tiles are written, while they are in registers: ViT-B/16's and
/// BERT's up-projections no longer make a second pass over their outputs.
///
/// Always inlined into AVX-512 functions (it has no target feature of its own).
///
/// # Safety
/// The CPU supports AVX-512F.
#[inline(always)]
unsafe fn gelu_avx512(x: __m512) -> __m512 {
    let s = _mm512_set1_ps;
    // SAFETY: register-only AVX-512F operations; the caller vouches for the feature.
    unsafe {
        let a = _mm512_abs_ps(x);
        let cut = s(GELU_CUT);
        // `a < cut ? a : cut`, as the scalar (NaN gives cut).
        let ac = _mm512_min_ps(a, cut);
        let t = _mm512_fmadd_ps(ac, s(2.0 / GELU_CUT), s(-1.0));
        let mut q = s(GELU_Q[11]);
        for &c in GELU_Q[..11].iter().rev() {
            q = _mm512_fmadd_ps(q, t, s(c));
        }
        let z = _mm512_fmadd_ps(q, s(std::f32::consts::LOG2_E), s(ROUND_MAGIC));
        let n = _mm512_sub_ps(z, s(ROUND_MAGIC));
        let r = _mm512_fnmadd_ps(n, s(LN2_HI), q);
        let r = _mm512_fnmadd_ps(n, s(LN2_LO), r);
        let mut p = s(EXP_P[0]);
        for &c in &EXP_P[1..] {
            p = _mm512_fmadd_ps(p, r, s(c));
        }
        let y = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), s(1.0));
        let e = _mm512_scalef_ps(y, n);
        let g = _mm512_mul_ps(_mm512_mul_ps(s(0.5), x), e);
        let zero = _mm512_setzero_ps();
        let neg = _mm512_cmp_ps_mask::<_CMP_LT_OQ>(x, zero);
        let v = _mm512_mask_blend_ps(neg, _mm512_sub_ps(x, g), g);
        let far = _mm512_cmp_ps_mask::<_CMP_GT_OQ>(a, cut);
        let tail = _mm512_mask_blend_ps(neg, x, _mm512_mul_ps(x, zero));
        _mm512_mask_blend_ps(far, v, tail)
    }
}

/// The AVX2 kernel (6 x 16).
pub struct Avx2;

impl Micro for Avx2 {
    const MR: usize = 6;
    const NR: usize = 16;
    #[inline]
    unsafe fn tile(
        kc: usize,
        a: APanel,
        b: *const f32,
        ldb: usize,
        rows: usize,
        cols: usize,
        out: &Out,
    ) {
        // SAFETY: forwarded from the caller (panel sizes, tile extent, AVX2 and FMA present).
        unsafe {
            if a.lda == 0 {
                tile_avx2::<false>(kc, a, b, ldb, rows, cols, out)
            } else {
                tile_avx2::<true>(kc, a, b, ldb, rows, cols, out)
            }
        };
    }
}

/// The full 6 x 16 product of the panels (with `IN_PLACE`, of A's rows read in place, rows past
/// `rows` repeating the last: [`APanel`]), written per `out` for its first `rows x cols`: whole
/// tiles without an epilogue straight from registers, others through [`write_tile`].
///
/// # Safety
/// `a` addresses `kc` steps of `rows` rows (`kc * 6` floats packed), `b` `kc` steps of 16 floats `ldb` apart, `out`
/// addresses a `rows x cols` tile (and its bias values), and the CPU supports AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
unsafe fn tile_avx2<const IN_PLACE: bool>(
    kc: usize,
    a: APanel,
    b: *const f32,
    ldb: usize,
    rows: usize,
    cols: usize,
    out: &Out,
) {
    prefetch_c(rows, cols, out);
    let rp = a.rows::<6>(rows);
    let mut t = [[_mm256_setzero_ps(); 2]; 6];
    // One step of K: B's 16 values against each of A's 6, broadcast.
    let step = |t: &mut [[__m256; 2]; 6], p: usize| {
        // SAFETY: p < kc, so the loads stay inside the panels the caller vouched for.
        unsafe {
            let b0 = _mm256_loadu_ps(b.add(p * ldb));
            let b1 = _mm256_loadu_ps(b.add(p * ldb + 8));
            for (r, row) in t.iter_mut().enumerate() {
                let av = _mm256_set1_ps(if IN_PLACE {
                    *rp[r].add(p)
                } else {
                    *a.ptr.add(p * 6 + r)
                });
                row[0] = _mm256_fmadd_ps(av, b0, row[0]);
                row[1] = _mm256_fmadd_ps(av, b1, row[1]);
            }
        }
    };
    // Four steps per iteration: the loop's own counter and pointer updates otherwise take
    // dispatch slots from the 20 vector instructions of each step (measured ~20% of the rate).
    let whole = kc / 4 * 4;
    let mut p = 0;
    let mut fetch = Fetch::new(out, kc);
    while p < whole {
        fetch.at(p);
        step(&mut t, p);
        step(&mut t, p + 1);
        step(&mut t, p + 2);
        step(&mut t, p + 3);
        p += 4;
    }
    for p in whole..kc {
        step(&mut t, p);
    }
    if cols == 16 && out.csc == 1 {
        // Whole rows (every tile but those at the right edge or of a C stored transposed, the
        // bottom edge's shorter ones included): alpha, the old C, the biases and a vector
        // activation in registers, in `write_tile`'s order (so the same bits); other activations
        // per element after.
        let alpha = _mm256_set1_ps(out.alpha);
        let (col0, col1) = match &out.epi {
            // SAFETY: the column bias covers the tile's 16 columns (caller's contract).
            Some(e) if !e.col.is_null() => unsafe {
                (
                    Some(_mm256_loadu_ps(e.col)),
                    Some(_mm256_loadu_ps(e.col.add(8))),
                )
            },
            _ => (None, None),
        };
        for (r, row) in t.iter().enumerate().take(rows) {
            // SAFETY: r < rows and 16 columns lie in the tile the caller vouched for, as do
            // the bias values and the residual (C's extent).
            unsafe {
                let p = out.c.add(r * out.rsc);
                let (mut v0, mut v1) = (row[0], row[1]);
                if out.alpha != 1.0 {
                    v0 = _mm256_mul_ps(v0, alpha);
                    v1 = _mm256_mul_ps(v1, alpha);
                }
                if out.acc {
                    v0 = _mm256_add_ps(v0, _mm256_loadu_ps(p));
                    v1 = _mm256_add_ps(v1, _mm256_loadu_ps(p.add(8)));
                }
                if let Some(e) = &out.epi {
                    if !e.z.is_null() {
                        let z = e.z.add(r * out.rsc);
                        v0 = _mm256_add_ps(v0, _mm256_loadu_ps(z));
                        v1 = _mm256_add_ps(v1, _mm256_loadu_ps(z.add(8)));
                    }
                    if !e.row.is_null() {
                        let rb = _mm256_set1_ps(*e.row.add(r));
                        v0 = _mm256_add_ps(v0, rb);
                        v1 = _mm256_add_ps(v1, rb);
                    }
                    if let (Some(c0), Some(c1)) = (col0, col1) {
                        v0 = _mm256_add_ps(v0, c0);
                        v1 = _mm256_add_ps(v1, c1);
                    }
                    v0 = act_avx2(e.act, v0);
                    v1 = act_avx2(e.act, v1);
                }
                _mm256_storeu_ps(p, v0);
                _mm256_storeu_ps(p.add(8), v1);
                if let Some(e) = &out.epi {
                    if !e.act.is_vector() {
                        for j in 0..16 {
                            *p.add(j) = e.act.apply(*p.add(j));
                        }
                    }
                }
            }
        }
        return;
    }
    let mut buf = [0f32; 6 * 16];
    for (r, row) in t.iter().enumerate() {
        // SAFETY: r < 6, so both 8-float stores stay inside the 96 floats of `buf`.
        unsafe {
            _mm256_storeu_ps(buf.as_mut_ptr().add(r * 16), row[0]);
            _mm256_storeu_ps(buf.as_mut_ptr().add(r * 16 + 8), row[1]);
        }
    }
    // SAFETY: forwarded from the caller (`out` addresses rows x cols).
    unsafe { write_tile(&buf, 16, rows, cols, out) };
}

/// Asks for the cache lines of the tile's C (its first and last column of each row, or of each
/// column when C is stored transposed) ahead of the K loop: the loop is far longer than the
/// reorder window, so without this the epilogue's loads of C (and the stores' reads for
/// ownership) miss the cache after it, one stall per tile.
#[inline]
fn prefetch_c(rows: usize, cols: usize, out: &Out) {
    if rows == 0 || cols == 0 {
        return;
    }
    let (outer, inner, so, si) = if out.csc == 1 {
        (rows, cols, out.rsc, 1)
    } else {
        (cols, rows, out.csc, out.rsc)
    };
    for o in 0..outer {
        // `wrapping_add`: only addresses are formed, nothing is read through them here (a
        // prefetch of any address is harmless), and both lie inside the tile the caller vouched
        // for.
        let first = out.c.wrapping_add(o * so);
        let last = first.wrapping_add((inner - 1) * si);
        // SAFETY: a prefetch reads nothing observable and cannot fault.
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(first as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(last as *const i8);
        }
    }
}

/// [`act_avx512`] in 8 lanes: the vectorised activations, bit for bit as [`Act::apply`]; the
/// others pass `x` through (the caller applies them per element).
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn act_avx2(act: Act, x: __m256) -> __m256 {
    match act {
        // `max(a, b)` returns b when either is NaN (and for two zeros): NaN and -0 give +0, as
        // `Act::apply`'s `x > 0 ? x : 0`.
        Act::Relu => _mm256_max_ps(x, _mm256_setzero_ps()),
        // `x < lo ? lo : x`, then `y > hi ? hi : y`: NaN stays.
        Act::Clip { lo, hi } => {
            _mm256_min_ps(_mm256_set1_ps(hi), _mm256_max_ps(_mm256_set1_ps(lo), x))
        }
        Act::LeakyRelu(s) => {
            let ge = _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_setzero_ps());
            _mm256_blendv_ps(_mm256_mul_ps(x, _mm256_set1_ps(s)), x, ge)
        }
        // SAFETY (each): AVX2 and FMA are enabled for this function.
        Act::Gelu => unsafe { gelu_avx2(x) },
        Act::Sigmoid => unsafe { sigmoid_avx2(x) },
        Act::Silu => _mm256_mul_ps(x, unsafe { sigmoid_avx2(x) }),
        Act::HardSigmoid { alpha, beta } => {
            let t = _mm256_add_ps(
                _mm256_mul_ps(_mm256_set1_ps(alpha), x),
                _mm256_set1_ps(beta),
            );
            unsafe { clamp01_avx2(t) }
        }
        Act::HardSwish => {
            let t = _mm256_add_ps(
                _mm256_mul_ps(x, _mm256_set1_ps(1.0 / 6.0)),
                _mm256_set1_ps(0.5),
            );
            _mm256_mul_ps(x, unsafe { clamp01_avx2(t) })
        }
        _ => x,
    }
}

/// [`clamp01_avx512`] in 8 lanes.
///
/// # Safety
/// The CPU supports AVX.
#[inline(always)]
unsafe fn clamp01_avx2(t: __m256) -> __m256 {
    // SAFETY: register-only AVX operations; the caller vouches for the feature.
    unsafe { _mm256_min_ps(_mm256_set1_ps(1.0), _mm256_max_ps(_mm256_setzero_ps(), t)) }
}

/// [`exp_avx512`] in 8 lanes: the same operations, so the same bits as [`super::exp_f32`].
///
/// # Safety
/// The CPU supports AVX2.
#[inline(always)]
unsafe fn exp_avx2(d: __m256, err: __m256) -> __m256 {
    // SAFETY: register-only AVX2 operations; the caller vouches for the feature.
    unsafe {
        let s = _mm256_set1_ps;
        let c = _mm256_min_ps(s(EXP_HI), _mm256_max_ps(s(EXP_LO), d));
        let z = _mm256_add_ps(
            _mm256_mul_ps(c, s(std::f32::consts::LOG2_E)),
            s(ROUND_MAGIC),
        );
        let n = _mm256_sub_ps(z, s(ROUND_MAGIC));
        let r = _mm256_add_ps(_mm256_sub_ps(c, _mm256_mul_ps(n, s(LN2_HI))), err);
        let r = _mm256_sub_ps(r, _mm256_mul_ps(n, s(LN2_LO)));
        let r2 = _mm256_mul_ps(r, r);
        let mut p = s(EXP_P[0]);
        for &k in &EXP_P[1..] {
            p = _mm256_add_ps(_mm256_mul_ps(p, r), s(k));
        }
        let y = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(p, r2), r), s(1.0));
        let nb = _mm256_sub_epi32(
            _mm256_castps_si256(z),
            _mm256_set1_epi32(ROUND_MAGIC.to_bits() as i32),
        );
        let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(nb, _mm256_set1_epi32(127)));
        let e = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
        let under = _mm256_cmp_ps::<_CMP_LT_OQ>(d, s(EXP_LO));
        let e = _mm256_blendv_ps(e, _mm256_setzero_ps(), under);
        let over = _mm256_cmp_ps::<_CMP_GT_OQ>(d, s(EXP_HI));
        _mm256_blendv_ps(e, s(f32::INFINITY), over)
    }
}

/// [`sigmoid_avx512`] in 8 lanes, so the same bits as [`super::sigmoid_f32`].
///
/// # Safety
/// The CPU supports AVX2.
#[inline(always)]
unsafe fn sigmoid_avx2(x: __m256) -> __m256 {
    let neg_abs = _mm256_or_ps(x, _mm256_set1_ps(-0.0));
    // SAFETY: the caller vouches for AVX2.
    let e = unsafe { exp_avx2(neg_abs, _mm256_setzero_ps()) };
    let one = _mm256_set1_ps(1.0);
    let q = _mm256_div_ps(one, _mm256_add_ps(one, e));
    let ge = _mm256_cmp_ps::<_CMP_GE_OQ>(x, _mm256_setzero_ps());
    _mm256_blendv_ps(_mm256_mul_ps(e, q), q, ge)
}

/// [`gelu_avx512`] in 8 lanes (AVX2 + FMA): the same operations, `2^n` from its exponent bits
/// as the scalar's, so the same bits as [`super::gelu_erf`].
///
/// # Safety
/// The CPU supports AVX2 and FMA.
#[inline(always)]
unsafe fn gelu_avx2(x: __m256) -> __m256 {
    let s = _mm256_set1_ps;
    // SAFETY: register-only AVX2/FMA operations; the caller vouches for the features.
    unsafe {
        let a = _mm256_andnot_ps(s(-0.0), x);
        let cut = s(GELU_CUT);
        // `min(a, cut)` returns cut when a is NaN, as the scalar's `a < cut ? a : cut`.
        let ac = _mm256_min_ps(a, cut);
        let t = _mm256_fmadd_ps(ac, s(2.0 / GELU_CUT), s(-1.0));
        let mut q = s(GELU_Q[11]);
        for &c in GELU_Q[..11].iter().rev() {
            q = _mm256_fmadd_ps(q, t, s(c));
        }
        let z = _mm256_fmadd_ps(q, s(std::f32::consts::LOG2_E), s(ROUND_MAGIC));
        let n = _mm256_sub_ps(z, s(ROUND_MAGIC));
        let r = _mm256_fnmadd_ps(n, s(LN2_HI), q);
        let r = _mm256_fnmadd_ps(n, s(LN2_LO), r);
        let mut p = s(EXP_P[0]);
        for &c in &EXP_P[1..] {
            p = _mm256_fmadd_ps(p, r, s(c));
        }
        let y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), s(1.0));
        let nb = _mm256_sub_epi32(
            _mm256_castps_si256(z),
            _mm256_set1_epi32(ROUND_MAGIC.to_bits() as i32),
        );
        let bits = _mm256_slli_epi32::<23>(_mm256_add_epi32(nb, _mm256_set1_epi32(127)));
        let e = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
        let g = _mm256_mul_ps(_mm256_mul_ps(s(0.5), x), e);
        let zero = _mm256_setzero_ps();
        let neg = _mm256_cmp_ps::<_CMP_LT_OQ>(x, zero);
        let v = _mm256_blendv_ps(_mm256_sub_ps(x, g), g, neg);
        let far = _mm256_cmp_ps::<_CMP_GT_OQ>(a, cut);
        let tail = _mm256_blendv_ps(x, _mm256_mul_ps(x, zero), neg);
        _mm256_blendv_ps(v, tail, far)
    }
}

/// The 16 x 16 transpose of `r` (row `i` in `r[i]`): column `c` in the result's `c`.
#[inline]
#[target_feature(enable = "avx512f")]
fn transpose16(r: &[__m512; 16]) -> [__m512; 16] {
    // Pairs of rows interleaved by element, then by element pair: u[4q + s] holds rows
    // 4q..4q+4 of columns s, s + 4, s + 8, s + 12 (one per 128-bit lane).
    let mut u = [_mm512_setzero_ps(); 16];
    for q in 0..4 {
        let lo01 = _mm512_unpacklo_ps(r[4 * q], r[4 * q + 1]);
        let hi01 = _mm512_unpackhi_ps(r[4 * q], r[4 * q + 1]);
        let lo23 = _mm512_unpacklo_ps(r[4 * q + 2], r[4 * q + 3]);
        let hi23 = _mm512_unpackhi_ps(r[4 * q + 2], r[4 * q + 3]);
        let pd = _mm512_castps_pd;
        let ps = _mm512_castpd_ps;
        u[4 * q] = ps(_mm512_unpacklo_pd(pd(lo01), pd(lo23)));
        u[4 * q + 1] = ps(_mm512_unpackhi_pd(pd(lo01), pd(lo23)));
        u[4 * q + 2] = ps(_mm512_unpacklo_pd(pd(hi01), pd(hi23)));
        u[4 * q + 3] = ps(_mm512_unpackhi_pd(pd(hi01), pd(hi23)));
    }
    // Gather the 128-bit lanes: column s + 4l takes lane l of u[s], u[4 + s], u[8 + s],
    // u[12 + s].
    let mut out = [_mm512_setzero_ps(); 16];
    for s in 0..4 {
        let v0 = _mm512_shuffle_f32x4::<0x88>(u[s], u[4 + s]);
        let v1 = _mm512_shuffle_f32x4::<0xdd>(u[s], u[4 + s]);
        let v2 = _mm512_shuffle_f32x4::<0x88>(u[8 + s], u[12 + s]);
        let v3 = _mm512_shuffle_f32x4::<0xdd>(u[8 + s], u[12 + s]);
        out[s] = _mm512_shuffle_f32x4::<0x88>(v0, v2);
        out[s + 8] = _mm512_shuffle_f32x4::<0xdd>(v0, v2);
        out[s + 4] = _mm512_shuffle_f32x4::<0x88>(v1, v3);
        out[s + 12] = _mm512_shuffle_f32x4::<0xdd>(v1, v3);
    }
    out
}

/// Packs the `full` whole panels of `w` (16 or 32) lanes of an operand whose lanes are
/// contiguous (step `p`'s lanes at `src[p * cs..]`): `dst[q * kc * w + p * w..][..w]` =
/// `src[p * cs + q * w..][..w]`, in registers (per-step copies this small were library calls).
/// Returns false (and writes nothing) when the CPU lacks AVX-512F or `w` is another width.
pub fn pack_steps(
    src: &[f32],
    cs: usize,
    full: usize,
    kc: usize,
    w: usize,
    dst: &mut [f32],
) -> bool {
    if !(w == 16 || w == 32) || !is_x86_feature_detected!("avx512f") {
        return false;
    }
    if full == 0 || kc == 0 {
        return true;
    }
    assert!((kc - 1) * cs + full * w <= src.len() && full * kc * w <= dst.len());
    // SAFETY: AVX-512F is present; the assert bounds every read and write made.
    unsafe { pack_steps_avx512(src.as_ptr(), cs, full, kc, w, dst.as_mut_ptr()) };
    true
}

/// # Safety
/// As [`pack_steps`]'s assert, and the CPU supports AVX-512F.
#[target_feature(enable = "avx512f")]
unsafe fn pack_steps_avx512(
    src: *const f32,
    cs: usize,
    full: usize,
    kc: usize,
    w: usize,
    dst: *mut f32,
) {
    for p in 0..kc {
        for q in 0..full {
            for v in (0..w).step_by(16) {
                // SAFETY: step p < kc, lanes q * w + v + 16 <= full * w: inside both (contract).
                unsafe {
                    let x = _mm512_loadu_ps(src.add(p * cs + q * w + v));
                    _mm512_storeu_ps(dst.add(q * kc * w + p * w + v), x);
                }
            }
        }
    }
}

/// Packs one panel from `lanes` rows that are contiguous along K (row `r` at
/// `src[r * rs..][..kc]`): `out[p * w + r]`, zero for `r >= lanes`, by 16 x 16 transposes in
/// AVX-512 registers or 8 x 8 ones in AVX2 registers. Returns false (and writes nothing) when
/// the CPU has neither (as [`crate::cpu::features`] reports it, so `FERRUM_NO_AVX512` takes
/// the AVX2 one).
pub fn pack_transposed(
    src: &[f32],
    rs: usize,
    lanes: usize,
    kc: usize,
    w: usize,
    out: &mut [f32],
) -> bool {
    let f = crate::cpu::features();
    assert!(lanes >= 1 && lanes <= w && out.len() >= kc * w);
    assert!((lanes - 1) * rs + kc <= src.len());
    if f.avx512() {
        // SAFETY: AVX-512F is present; the asserts bound every read and write made.
        unsafe { pack_transposed_avx512(src.as_ptr(), rs, lanes, kc, w, out.as_mut_ptr()) };
        true
    } else if f.x86_simd() && f.avx2 {
        // SAFETY: AVX2 is present; the asserts bound every read and write made.
        unsafe { pack_transposed_avx2(src.as_ptr(), rs, lanes, kc, w, out.as_mut_ptr()) };
        true
    } else {
        false
    }
}

/// [`pack_transposed`] by 8 x 8 transposes in AVX2 registers: per group of 8 lanes and 8 steps,
/// the lanes' 8 values loaded as rows, transposed, and each step's lanes stored (a group
/// narrower than 8 that is the whole panel as whole vectors running into the next step's lanes,
/// its last step exactly; other narrower groups exactly).
///
/// # Safety
/// `src` holds `(lanes - 1) * rs + kc` floats, `out` holds `kc * w`, `lanes <= w`, and the CPU
/// supports AVX2.
#[target_feature(enable = "avx2")]
unsafe fn pack_transposed_avx2(
    src: *const f32,
    rs: usize,
    lanes: usize,
    kc: usize,
    w: usize,
    out: *mut f32,
) {
    let full = kc - kc % 8;
    for g in (0..w).step_by(8) {
        let gl = 8.min(w - g);
        let live = lanes.saturating_sub(g).min(gl);
        for p0 in (0..full).step_by(8) {
            let mut r = [_mm256_setzero_ps(); 8];
            for (i, v) in r.iter_mut().enumerate().take(live) {
                // SAFETY: row g + i < lanes, columns p0..p0 + 8 <= kc: inside `src`.
                *v = unsafe { _mm256_loadu_ps(src.add((g + i) * rs + p0)) };
            }
            let t = transpose8(&r);
            for (c, &v) in t.iter().enumerate() {
                let dst = (p0 + c) * w + g;
                // SAFETY: step p0 + c < kc, lanes g..g + gl <= w: inside `out`. A whole vector
                // for a narrower panel (one group: w = gl) runs into the next step's first
                // lanes, which that step (written after this one, by this loop or the one
                // below) overwrites; the panel's last step is stored exactly.
                unsafe {
                    if gl == 8 || (w == gl && p0 + c + 1 < kc) {
                        _mm256_storeu_ps(out.add(dst), v);
                    } else {
                        store_first(out.add(dst), v, gl);
                    }
                }
            }
        }
        // SAFETY: steps full..kc of lanes g..g + gl, inside both (the caller's contract).
        unsafe { transpose_tail(src, rs, g, gl, live, full..kc, w, out) };
    }
}

/// Eight floats at `p`: all of them (`FULL`) or the lanes under `m` (the AVX2 kernels' loads of
/// a vector that may end past a row's last channel).
///
/// # Safety
/// The lanes read lie in one buffer; the CPU supports AVX2.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) unsafe fn load8<const FULL: bool>(p: *const f32, m: __m256i) -> __m256 {
    // SAFETY: the caller's contract.
    unsafe {
        if FULL {
            _mm256_loadu_ps(p)
        } else {
            _mm256_maskload_ps(p, m)
        }
    }
}

/// The mask of the first `n` (at most 8) of 8 lanes.
#[inline]
#[target_feature(enable = "avx2")]
pub(crate) fn first_lanes(n: usize) -> __m256i {
    _mm256_cmpgt_epi32(
        _mm256_set1_epi32(n.min(8) as i32),
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
    )
}

/// The steps `steps` (past the transposers' whole blocks) of lanes `g..g + gl` of a panel, one
/// element at a time: lane `g + i` from `src` row `g + i` for `i < live`, zero past it.
///
/// # Safety
/// As [`pack_transposed_avx512`], for these steps and lanes.
#[allow(clippy::too_many_arguments)]
#[inline]
unsafe fn transpose_tail(
    src: *const f32,
    rs: usize,
    g: usize,
    gl: usize,
    live: usize,
    steps: std::ops::Range<usize>,
    w: usize,
    out: *mut f32,
) {
    for p in steps {
        for i in 0..gl {
            // SAFETY: step p < kc, lane g + i < w; row g + i < lanes when read (the contract).
            unsafe {
                *out.add(p * w + g + i) = if i < live {
                    *src.add((g + i) * rs + p)
                } else {
                    0.0
                };
            }
        }
    }
}

/// Stores the first `n` (1 to 8) lanes of `v` at `p`, nothing past them (a call to `memcpy` per
/// step was 14% of a panel transpose's time).
///
/// # Safety
/// `n` floats at `p` are writable; the CPU supports AVX2.
#[inline]
#[target_feature(enable = "avx2")]
unsafe fn store_first(p: *mut f32, v: __m256, n: usize) {
    let (lo, hi) = (_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    // The first `k` (0 to 4) lanes of `x` at `q`.
    let four = |q: *mut f32, x: __m128, k: usize| {
        // SAFETY: `k` floats at `q` are writable (the caller's contract).
        unsafe {
            match k {
                4 => _mm_storeu_ps(q, x),
                3 => {
                    _mm_store_sd(q as *mut f64, _mm_castps_pd(x));
                    _mm_store_ss(q.add(2), _mm_movehl_ps(x, x));
                }
                2 => _mm_store_sd(q as *mut f64, _mm_castps_pd(x)),
                1 => _mm_store_ss(q, x),
                _ => {}
            }
        }
    };
    if n >= 4 {
        four(p, lo, 4);
        // SAFETY: n > 4 floats at p are writable, so n - 4 at p + 4.
        four(unsafe { p.add(4) }, hi, n.min(8) - 4);
    } else {
        four(p, lo, n);
    }
}

/// The 8 x 8 transpose of `r` (row `i` in `r[i]`): column `c` in the result's `c`.
#[inline]
#[target_feature(enable = "avx2")]
fn transpose8(r: &[__m256; 8]) -> [__m256; 8] {
    // Pairs of rows interleaved, then pairs of pairs, then the 128-bit halves.
    let u0 = _mm256_unpacklo_ps(r[0], r[1]);
    let u1 = _mm256_unpackhi_ps(r[0], r[1]);
    let u2 = _mm256_unpacklo_ps(r[2], r[3]);
    let u3 = _mm256_unpackhi_ps(r[2], r[3]);
    let u4 = _mm256_unpacklo_ps(r[4], r[5]);
    let u5 = _mm256_unpackhi_ps(r[4], r[5]);
    let u6 = _mm256_unpacklo_ps(r[6], r[7]);
    let u7 = _mm256_unpackhi_ps(r[6], r[7]);
    let s0 = _mm256_shuffle_ps::<0x44>(u0, u2);
    let s1 = _mm256_shuffle_ps::<0xee>(u0, u2);
    let s2 = _mm256_shuffle_ps::<0x44>(u1, u3);
    let s3 = _mm256_shuffle_ps::<0xee>(u1, u3);
    let s4 = _mm256_shuffle_ps::<0x44>(u4, u6);
    let s5 = _mm256_shuffle_ps::<0xee>(u4, u6);
    let s6 = _mm256_shuffle_ps::<0x44>(u5, u7);
    let s7 = _mm256_shuffle_ps::<0xee>(u5, u7);
    [
        _mm256_permute2f128_ps::<0x20>(s0, s4),
        _mm256_permute2f128_ps::<0x20>(s1, s5),
        _mm256_permute2f128_ps::<0x20>(s2, s6),
        _mm256_permute2f128_ps::<0x20>(s3, s7),
        _mm256_permute2f128_ps::<0x31>(s0, s4),
        _mm256_permute2f128_ps::<0x31>(s1, s5),
        _mm256_permute2f128_ps::<0x31>(s2, s6),
        _mm256_permute2f128_ps::<0x31>(s3, s7),
    ]
}

/// # Safety
/// `src` holds `(lanes - 1) * rs + kc` floats, `out` holds `kc * w`, `lanes <= w`, and the CPU
/// supports AVX-512F.
#[target_feature(enable = "avx512f")]
unsafe fn pack_transposed_avx512(
    src: *const f32,
    rs: usize,
    lanes: usize,
    kc: usize,
    w: usize,
    out: *mut f32,
) {
    let full = kc - kc % 16;
    for g in (0..w).step_by(16) {
        let gl = 16.min(w - g);
        let live = lanes.saturating_sub(g).min(gl);
        let mask: __mmask16 = if gl == 16 { 0xffff } else { (1 << gl) - 1 };
        for p0 in (0..full).step_by(16) {
            let mut r = [_mm512_setzero_ps(); 16];
            for (i, v) in r.iter_mut().enumerate().take(live) {
                // SAFETY: row g + i < lanes, columns p0..p0 + 16 <= kc: inside `src`.
                *v = unsafe { _mm512_loadu_ps(src.add((g + i) * rs + p0)) };
            }
            let t = transpose16(&r);
            for (c, &v) in t.iter().enumerate() {
                // SAFETY: step p0 + c < kc, lanes g..g + gl <= w: inside `out`.
                unsafe { _mm512_mask_storeu_ps(out.add((p0 + c) * w + g), mask, v) };
            }
        }
        // SAFETY: steps full..kc of lanes g..g + gl, inside both (the caller's contract).
        unsafe { transpose_tail(src, rs, g, gl, live, full..kc, w, out) };
    }
}
