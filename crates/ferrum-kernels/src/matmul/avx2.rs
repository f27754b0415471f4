//! AVX2 tile kernels for the "_0/_1" block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0): what a CPU
//! without AVX-512 runs for their products. They read the weights in place in the file's
//! row-major layout or in [`Layout::X4`] (what `PackedMatrix` stores on these tiers: groups of 4
//! rows, the 4 rows' block `ib` side by side, then block `ib + 1`), each row given as its first
//! block and a block stride (row-major: the block's bytes; X4: 4 blocks' bytes), so one kernel
//! serves both; other layouts are unpacked to rows first.
//!
//! Each output is the dot product `quant::vec_dot` computes on the AVX2 tier (the AVX2 kernels of
//! `quant/dot_avx2.rs`, llama.cpp's `ggml_vec_dot_*`), with the same float operations in the same
//! order, so the same bits: per 32-element block the exact integer lane sums
//! `madd(maddubs(w, x), 1)` (as `|w|`, `sign(x, w)` for the signed "_0" weights), converted to
//! f32, one `fma(set1(d_w·d_x), ·, acc)` per block into 8 lanes, a final `hsum8`; the "_1" types
//! add `Σ m_w·s_x`, kept as a separate f32 chain (`summs += m_w·s_x`, block by block).
//!
//! The single-output kernel is bound by its one FMA chain and per-block overhead. A tile runs
//! `4 × T` such chains interleaved (4 weight rows × `T` tokens, `T` in 1..=[`TILE_T`]): each
//! weight block is unpacked once for the `T` tokens and each activation block loaded once per
//! row. Per (row, token, block) what is left is the integer dot (`sign`, `maddubs`, `madd`), the
//! conversion and the FMA; the scale products `d_w·d_x` (the same IEEE products as the scalar
//! ones) are formed 8 blocks at a time, one vector multiply per (row, token), from scales
//! converted to f32 once (activations per call, weights per task), and broadcast from memory
//! (a load, no shuffle). The "_1" `summs` of 4 rows are one 4-lane vector per token (lane r:
//! row r's chain), one multiply and one add per token and block.
//!
//! Register plan: per block, one row's unpacked weights and `|w|`, one token's activation block,
//! the i16 ones, and the `4 × T` accumulators; with `T` = 4 a few accumulators spill, which costs
//! loads and stores (free ports here) rather than vector ALU slots, and the weight unpacking
//! (costly for Q5_0/Q5_1) is shared by 4 tokens. The kernels are bound by the 5 vector ALU ops
//! per (row, token, block): `sign`, `maddubs`, `madd`, `cvt`, `fma`, each 2 per cycle here.
//!
//! Prompts (4 tokens or more) take [`tile`]; decode (1 to 3 tokens) takes [`tile_direct`],
//! which converts the scales as it goes (a per-task conversion pass would cost as much as the
//! product). Decode is bound by memory: four row-major rows read side by side are four short
//! streams the hardware prefetcher does not follow, so row-major tiles prefetch two tiles ahead;
//! an X4 group is one stream, which it follows (1 thread: SmolLM2 Q4_1 decode ~110 -> ~130
//! tok/s, Gemma 3 270M ~37 -> ~65, Qwen2.5 0.5B ~26 -> ~35; an explicit prefetch on X4 measured
//! no faster).
//!
//! Threading as the other row kernels: tasks of 16 weight rows ([`Src::with_rows16`]), each
//! walking the tokens in blocks of [`TOKEN_BLOCK`] so their activations stay in L1/L2.

use super::{Layout, OutPtr, Src, ROWS16};
use crate::pool;
use core::arch::x86_64::*;
use ferrum_core::DType;
use std::cell::RefCell;

/// Rows of one tile.
const TILE_R: usize = 4;
/// Most tokens of one tile (4 × 4: the weight unpacking, costly for Q5_0/Q5_1, is shared by 4
/// tokens; 16 accumulators spill a little, which costs loads and stores, not vector ALU slots).
const TILE_T: usize = 4;
/// Tokens a task walks before moving to its next rows.
const TOKEN_BLOCK: usize = 64;
/// From this many tokens on, the scales are converted to f32 once (activations per call, weights
/// per task) and their products formed 8 blocks at a time; below it (decode) the tiles convert
/// them as they go ([`tile_direct`]), which costs less than a conversion pass per task.
const PRE_MIN_TOKENS: usize = 4;
/// Blocks whose scale products a tile forms at a time (one 8-lane multiply per row and token).
const CHUNK: usize = 8;

/// The weight types with a tile kernel here.
pub(super) fn supports(dtype: DType) -> bool {
    kind_of(dtype).is_some()
}

/// Bytes of a `rows` x `cols` `dtype` matrix in [`Layout::X4`] (`None`: not a type here, or
/// `cols` not whole blocks): groups of 4 rows (the last one padded by repeating the last row),
/// each group block by block, the 4 rows' block `ib` one after another.
pub(super) fn x4_len(dtype: DType, rows: usize, cols: usize) -> Option<usize> {
    kind_of(dtype)?;
    if rows == 0 || cols == 0 || !cols.is_multiple_of(32) {
        return None;
    }
    dtype
        .row_bytes(cols)?
        .checked_mul(rows.next_multiple_of(TILE_R))
}

/// Writes groups `g0 ..` of the row-major `src` (`rows` x `cols`) into `dst` (whole groups) in
/// [`Layout::X4`].
pub(super) fn pack_x4_groups(
    dtype: DType,
    src: &[u8],
    rows: usize,
    cols: usize,
    g0: usize,
    dst: &mut [u8],
) {
    let rb = dtype.row_bytes(cols).expect("whole blocks");
    let bw = rb / (cols / 32);
    for (gi, group) in dst.chunks_exact_mut(TILE_R * rb).enumerate() {
        let r0 = (g0 + gi) * TILE_R;
        for (ib, cell) in group.chunks_exact_mut(TILE_R * bw).enumerate() {
            for (j, blk) in cell.chunks_exact_mut(bw).enumerate() {
                let r = (r0 + j).min(rows - 1);
                blk.copy_from_slice(&src[r * rb + ib * bw..][..bw]);
            }
        }
    }
}

/// Row `r` of an [`Layout::X4`] matrix in the file's layout, into `out` (`row_bytes` long).
pub(super) fn unpack_row_x4(w: &Src, r: usize, out: &mut [u8]) {
    let rb = w.row_bytes();
    let bw = rb / (w.cols / 32);
    let (row, stride) = x4_row(w, r);
    for (ib, blk) in out.chunks_exact_mut(bw).enumerate() {
        blk.copy_from_slice(&row[ib * stride..][..bw]);
    }
}

/// Row `r` (`< rows`, or a padding row of the last group) of an [`Layout::X4`] matrix: its
/// bytes from its first block to its group's end, and the stride between its blocks.
fn x4_row<'a>(w: &Src<'a>, r: usize) -> (&'a [u8], usize) {
    let rb = w.row_bytes();
    let bw = rb / (w.cols / 32);
    let glen = TILE_R * rb;
    (
        &w.data[r / TILE_R * glen + r % TILE_R * bw..][..glen - r % TILE_R * bw],
        TILE_R * bw,
    )
}

/// Runs `f` on a task's 16 rows from `r0` (rows past the end repeat the last row) as (first
/// block, block stride): read in place for row-major and [`Layout::X4`] matrices, unpacked to
/// the file's rows for other layouts ([`Src::with_rows16`]).
fn with_task_rows<R>(w: &Src, r0: usize, f: impl FnOnce(&[&[u8]; ROWS16], usize) -> R) -> R {
    let bw = w.row_bytes() / (w.cols / 32);
    match w.layout {
        Layout::X4 => {
            let last = w.rows - 1;
            let rows: [&[u8]; ROWS16] = core::array::from_fn(|i| x4_row(w, (r0 + i).min(last)).0);
            f(&rows, TILE_R * bw)
        }
        _ => w.with_rows16(r0, |rws| f(rws, bw)),
    }
}

// Kind codes (const generic parameters of the kernels).
const K_Q4_0: u8 = 0;
const K_Q4_1: u8 = 1;
const K_Q5_0: u8 = 2;
const K_Q5_1: u8 = 3;
const K_Q8_0: u8 = 4;

fn kind_of(dtype: DType) -> Option<u8> {
    Some(match dtype {
        DType::Q4_0 => K_Q4_0,
        DType::Q4_1 => K_Q4_1,
        DType::Q5_0 => K_Q5_0,
        DType::Q5_1 => K_Q5_1,
        DType::Q8_0 => K_Q8_0,
        _ => return None,
    })
}

/// Weight block bytes of kind `k`.
const fn block_bytes(k: u8) -> usize {
    match k {
        K_Q4_0 => 18,
        K_Q4_1 => 20,
        K_Q5_0 => 22,
        K_Q5_1 => 24,
        _ => 34,
    }
}

/// "_1" kinds (unsigned quants plus a minimum `m` at byte 2; Q8_1 activations).
const fn is_one(k: u8) -> bool {
    k == K_Q4_1 || k == K_Q5_1
}

/// Activation block bytes (Q8_1 is 40 bytes here, Q8_0 34) and the offset of its quants.
const fn act_block(k: u8) -> (usize, usize) {
    if is_one(k) {
        (40, 4)
    } else {
        (34, 2)
    }
}

thread_local! {
    /// The activations' scales as f32 (per call, on the calling thread).
    static ACT_SCALES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// A task's weight scales as f32 (per worker thread).
    static ROW_SCALES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// A task's weight quants unpacked to bytes ([`unpack_rows`]), per worker thread.
    static ROW_QUANTS: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}

/// `y[tok, r]` (`y`: [T, rows]) for the `t` tokens of `act` (`ab` bytes each, quantized as
/// `quant::vec_dot_type(w.dtype)`), each output equal to `quant::vec_dot` on the AVX2 tier.
/// Only for CPUs with AVX2, FMA and F16C (checked).
pub(super) fn matmul(w: &Src, act: &[u8], ab: usize, t: usize, y: &mut [f32]) {
    assert!(
        crate::cpu::features().x86_simd(),
        "AVX2 tiles need AVX2+FMA+F16C"
    );
    match kind_of(w.dtype).expect("AVX2 tile type") {
        K_Q4_0 => run::<K_Q4_0, TILE_T>(w, act, ab, t, y),
        K_Q4_1 => run::<K_Q4_1, TILE_T>(w, act, ab, t, y),
        K_Q5_0 => run::<K_Q5_0, TILE_T>(w, act, ab, t, y),
        K_Q5_1 => run::<K_Q5_1, TILE_T>(w, act, ab, t, y),
        _ => run::<K_Q8_0, TILE_T>(w, act, ab, t, y),
    }
}

fn run<const K: u8, const TT: usize>(w: &Src, act: &[u8], ab: usize, t: usize, y: &mut [f32]) {
    let (rows, cols) = (w.rows, w.cols);
    let nb = cols / 32;
    let nbp = nb.next_multiple_of(CHUNK);
    assert_eq!(
        w.row_bytes(),
        nb * block_bytes(K),
        "AVX2 tiles: weight row bytes"
    );
    assert_eq!(ab, nb * act_block(K).0, "AVX2 tiles: activation row bytes");
    assert!(
        act.len() >= ab * t && y.len() == rows * t,
        "AVX2 tiles: shapes"
    );
    let out = OutPtr(y.as_mut_ptr());
    if w.layout == Layout::X8 {
        return if t <= super::avx2_x8::MAX_TOKENS {
            super::avx2_x8::matmul(w, act, ab, t, out)
        } else {
            super::avx2_x8::matmul_prompt(w, act, ab, t, out)
        };
    }
    if t < PRE_MIN_TOKENS {
        return run_direct::<K>(w, act, ab, t, out);
    }
    ACT_SCALES.with_borrow_mut(|asc| {
        // [t][nbp] d_x, then [t][nbp] s_x ("_1" kinds); the padding stays 0.
        asc.clear();
        asc.resize(2 * t * nbp, 0.0);
        let (dx, sx) = asc.split_at_mut(t * nbp);
        for (tok, (dxr, sxr)) in dx
            .chunks_exact_mut(nbp)
            .zip(sx.chunks_exact_mut(nbp))
            .enumerate()
        {
            let a = &act[tok * ab..][..ab];
            let ba = act_block(K).0;
            // SAFETY: AVX2+FMA+F16C were checked in `matmul`.
            unsafe {
                gather_f16(a, ba, 0, nb, dxr, 1);
                if is_one(K) {
                    gather_f16(a, ba, 2, nb, sxr, 1);
                }
            }
        }
        let (dx, sx) = (&*dx, &*sx);
        pool::parallel_for(rows.div_ceil(ROWS16), |task| {
            let r_begin = task * ROWS16;
            let r_end = (r_begin + ROWS16).min(rows);
            let store = |tok: usize, r0: usize, v: &[f32; TILE_R]| {
                for (i, &val) in v.iter().enumerate() {
                    if r0 + i < r_end {
                        // SAFETY: `tok < t` and `r0 + i < rows`, so the index is inside `y`
                        // ([t, rows]); only this task writes rows r_begin..r_end.
                        unsafe { *out.at(tok * rows + r0 + i) = val };
                    }
                }
            };
            with_task_rows(w, r_begin, |rws, stride| {
                ROW_SCALES.with_borrow_mut(|rsc| {
                    ROW_QUANTS.with_borrow_mut(|rq| {
                        // [16][nbp] d_w, then [nb][16] m_w ("_1" kinds).
                        let n_rows = (r_end - r_begin).next_multiple_of(TILE_R);
                        rsc.clear();
                        rsc.resize(ROWS16 * nbp + nb * ROWS16, 0.0);
                        let (dw, mw) = rsc.split_at_mut(ROWS16 * nbp);
                        let ub = unpacked_block(K);
                        rq.resize(ROWS16 * nb * ub, 0);
                        for (r, row) in rws[..n_rows].iter().enumerate() {
                            // SAFETY: AVX2+FMA+F16C were checked in `matmul`.
                            unsafe {
                                gather_f16(row, stride, 0, nb, &mut dw[r * nbp..], 1);
                                if is_one(K) {
                                    gather_f16(row, stride, 2, nb, &mut mw[r..], ROWS16);
                                }
                                unpack_row::<K>(row, stride, nb, &mut rq[r * nb * ub..][..nb * ub]);
                            }
                        }
                        let (dw, mw, rq) = (&*dw, &*mw, &*rq);
                        for tb in (0..t).step_by(TOKEN_BLOCK) {
                            let te = (tb + TOKEN_BLOCK).min(t);
                            for r0 in (r_begin..r_end).step_by(TILE_R) {
                                if tb == 0 {
                                    prefetch_ahead(w, r0);
                                }
                                let i = r0 - r_begin;
                                let wr = Rows {
                                    q: core::array::from_fn(|j| {
                                        &rq[(i + j) * nb * ub..][..nb * ub]
                                    }),
                                    d: core::array::from_fn(|j| &dw[(i + j) * nbp..][..nbp]),
                                    m: &mw[i..],
                                };
                                let acts = |tok: usize| Act {
                                    q: &act[tok * ab..][..ab],
                                    d: &dx[tok * nbp..][..nbp],
                                    s: &sx[tok * nbp..][..nbp],
                                };
                                let mut tok = tb;
                                while tok + TT <= te {
                                    let a = core::array::from_fn(|c| acts(tok + c));
                                    // SAFETY: AVX2+FMA+F16C were checked in `matmul`.
                                    let o = unsafe { tile::<K, TT>(&wr, &a, nb) };
                                    o.iter()
                                        .enumerate()
                                        .for_each(|(c, v)| store(tok + c, r0, v));
                                    tok += TT;
                                }
                                // The last 1..TT-1 tokens in one tile.
                                macro_rules! rest {
                                    ($n:literal) => {{
                                        let a: [Act; $n] = core::array::from_fn(|c| acts(tok + c));
                                        // SAFETY: as above.
                                        let o = unsafe { tile::<K, $n>(&wr, &a, nb) };
                                        o.iter()
                                            .enumerate()
                                            .for_each(|(c, v)| store(tok + c, r0, v));
                                    }};
                                }
                                match te - tok {
                                    0 => {}
                                    1 => rest!(1),
                                    2 => rest!(2),
                                    3 => rest!(3),
                                    n => unreachable!("{n} tokens left of a {TT}-token tile"),
                                }
                            }
                        }
                    })
                })
            });
        });
    });
}

/// Rows the prompt path prefetches ahead of a tile on its first token block (decode prefetches
/// inside [`tile_direct`]).
const PREFETCH_ROWS: usize = 16;

/// Prefetches the 4 rows [`PREFETCH_ROWS`] after `r0` (row-major, or their X4 group: the same
/// bytes, `r0` being a multiple of 4; nothing for other layouts or past the end).
fn prefetch_ahead(w: &Src, r0: usize) {
    let r = r0 + PREFETCH_ROWS;
    if matches!(w.layout, Layout::RowMajor | Layout::X4) && r + TILE_R <= w.rows {
        let rb = w.row_bytes();
        super::avx512::prefetch(&w.data[r * rb..(r + TILE_R) * rb]);
    }
}

/// [`run`] for 1..[`PRE_MIN_TOKENS`] tokens: one [`tile_direct`] of all the tokens per 4 rows.
fn run_direct<const K: u8>(w: &Src, act: &[u8], ab: usize, t: usize, out: OutPtr) {
    let (rows, nb) = (w.rows, w.cols / 32);
    // Runs of consecutive 16-row groups per thread (`pool::parallel_runs`).
    let groups = rows.div_ceil(ROWS16);
    pool::parallel_runs(groups, |task| {
        let r_begin = task * ROWS16;
        let r_end = (r_begin + ROWS16).min(rows);
        with_task_rows(w, r_begin, |rws, stride| {
            // Row-major rows lie `rb` bytes apart: each tile prefetches, block by block, the
            // same blocks two tiles further on. An X4 group is one stream, which the hardware
            // prefetcher follows (an explicit prefetch measured no faster: SmolLM2 Q4_1, Gemma
            // 3 270M, Qwen2.5 0.5B at 1 thread).
            let pf = match w.layout {
                Layout::RowMajor => 2 * TILE_R * w.row_bytes(),
                _ => 0,
            };
            for r0 in (r_begin..r_end).step_by(TILE_R) {
                let i = r0 - r_begin;
                let quad: [&[u8]; TILE_R] = core::array::from_fn(|j| rws[i + j]);
                let mut o = [[0f32; TILE_R]; PRE_MIN_TOKENS];
                macro_rules! direct {
                    ($n:literal) => {{
                        let a: [&[u8]; $n] = core::array::from_fn(|c| &act[c * ab..][..ab]);
                        // SAFETY: AVX2+FMA+F16C were checked in `matmul`.
                        let v = unsafe { tile_direct::<K, $n>(quad, stride, a, nb, pf) };
                        o[..$n].copy_from_slice(&v);
                    }};
                }
                match t {
                    1 => direct!(1),
                    2 => direct!(2),
                    3 => direct!(3),
                    _ => unreachable!("run_direct takes 1..{PRE_MIN_TOKENS} tokens"),
                }
                for (tok, v) in o[..t].iter().enumerate() {
                    for (j, &val) in v.iter().enumerate() {
                        if r0 + j < r_end {
                            // SAFETY: `tok < t` and `r0 + j < rows`, so the index is inside `y`
                            // ([t, rows]); only this task writes rows r_begin..r_end.
                            unsafe { *out.at(tok * rows + r0 + j) = val };
                        }
                    }
                }
            }
        });
    });
}

/// The 4 weight rows of a tile: quants unpacked by [`unpack_row`], `d_w` as f32 (`nbp` each,
/// 0-padded), and ("_1" kinds) `m_w` as f32 laid out [block][16 rows], starting at the tile's
/// first row.
struct Rows<'a> {
    q: [&'a [u8]; TILE_R],
    d: [&'a [f32]; TILE_R],
    m: &'a [f32],
}

/// One token of a tile: its quant blocks, `d_x` and ("_1" kinds) `s_x` as f32 (`nbp` each).
struct Act<'a> {
    q: &'a [u8],
    d: &'a [f32],
    s: &'a [f32],
}

// ---------------------------------------------------------------------------------------------
// Helpers (the operations of `quant/dot_avx2.rs`'s helpers of the same names).

/// `dst[i * dst_stride] = ` the binary16 at `src[i * stride + off]`, as f32, for `i < n` (exact,
/// F16C). Panics when a slice is too short.
#[target_feature(enable = "avx2,fma,f16c")]
fn gather_f16(src: &[u8], stride: usize, off: usize, n: usize, dst: &mut [f32], dst_stride: usize) {
    for i0 in (0..n).step_by(8) {
        let k = (n - i0).min(8);
        let mut h = [0u16; 8];
        for (j, hj) in h[..k].iter_mut().enumerate() {
            let o = (i0 + j) * stride + off;
            *hj = u16::from_le_bytes([src[o], src[o + 1]]);
        }
        let mut f = [0f32; 8];
        // SAFETY: `h` is 16 readable bytes, `f` 32 writable ones; no alignment needed.
        unsafe {
            _mm256_storeu_ps(
                f.as_mut_ptr(),
                _mm256_cvtph_ps(_mm_loadu_si128(h.as_ptr() as *const __m128i)),
            )
        };
        for (j, &v) in f[..k].iter().enumerate() {
            dst[(i0 + j) * dst_stride] = v;
        }
    }
}

/// 16 bytes of nibbles at `p` -> 32 bytes: low nibbles (elements 0..15), then high (16..31).
///
/// # Safety
/// `p` is readable for 16 bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles32(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees 16 readable bytes; loadu has no alignment requirement.
    let x = unsafe { _mm_loadu_si128(p as *const __m128i) };
    let m = _mm_set1_epi8(0x0f);
    let lo = _mm_and_si128(x, m);
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(x), m);
    _mm256_set_m128i(hi, lo)
}

/// The 32 bits of `qh` -> 32 bytes, 0xFF where bit i is set, else 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn bits_to_bytes(qh: u32) -> __m256i {
    let v = _mm256_set1_epi32(qh as i32);
    let pick = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, //
        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
    );
    let bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let v = _mm256_and_si256(_mm256_shuffle_epi8(v, pick), bit);
    _mm256_cmpeq_epi8(v, bit)
}

/// Horizontal sum of 8 f32 (llama.cpp's `hsum_float_8` order).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum8(x: __m256) -> f32 {
    let r = _mm_add_ps(_mm256_extractf128_ps::<1>(x), _mm256_castps256_ps128(x));
    let r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    let r = _mm_add_ss(r, _mm_movehdup_ps(r));
    _mm_cvtss_f32(r)
}

/// Little-endian u16 at `p`.
///
/// # Safety
/// `p` is readable for 2 bytes.
#[inline(always)]
unsafe fn rd16(p: *const u8) -> u16 {
    // SAFETY: the caller guarantees 2 readable bytes; read_unaligned has no alignment need.
    u16::from_le(unsafe { (p as *const u16).read_unaligned() })
}

/// Little-endian u32 at `p`.
///
/// # Safety
/// `p` is readable for 4 bytes.
#[inline(always)]
unsafe fn rd32(p: *const u8) -> u32 {
    // SAFETY: the caller guarantees 4 readable bytes; read_unaligned has no alignment need.
    u32::from_le(unsafe { (p as *const u32).read_unaligned() })
}

/// The 32 quants of the weight block at `b` as bytes: for the "_0" kinds the signed values
/// (`q - 8`, `q - 16`, `q`), for the "_1" kinds the unsigned ones.
///
/// # Safety
/// `b` is readable for a whole block of kind `K`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack<const K: u8>(b: *const u8) -> __m256i {
    // SAFETY (every arm): the offsets read lie inside the block (layouts of `quant::blocks`:
    // Q4_0 d|qs[16], Q4_1 d|m|qs[16], Q5_0 d|qh|qs[16], Q5_1 d|m|qh|qs[16], Q8_0 d|qs[32]).
    unsafe {
        match K {
            K_Q4_0 => _mm256_sub_epi8(nibbles32(b.add(2)), _mm256_set1_epi8(8)),
            K_Q4_1 => nibbles32(b.add(4)),
            K_Q5_0 => {
                let high = _mm256_andnot_si256(
                    bits_to_bytes(rd32(b.add(2))),
                    _mm256_set1_epi8(0xf0u8 as i8),
                );
                _mm256_or_si256(nibbles32(b.add(6)), high)
            }
            K_Q5_1 => {
                let high = _mm256_and_si256(bits_to_bytes(rd32(b.add(4))), _mm256_set1_epi8(0x10));
                _mm256_or_si256(nibbles32(b.add(8)), high)
            }
            _ => _mm256_loadu_si256(b.add(2) as *const __m256i),
        }
    }
}

/// Bytes per block of a row unpacked by [`unpack_row`].
const fn unpacked_block(k: u8) -> usize {
    if is_one(k) {
        32
    } else {
        64
    }
}

/// Writes the `nb` blocks of a row (first block at `row`, `stride` bytes apart) unpacked to
/// bytes, block after block: for the "_0" kinds `|w|` then `w` (the signed values; 64 bytes per
/// block), for the "_1" kinds the unsigned quants (32 bytes). A prompt's task unpacks its rows
/// once for all its tokens (for Q5_0 the unpacking costs twice the product per token).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn unpack_row<const K: u8>(row: &[u8], stride: usize, nb: usize, out: &mut [u8]) {
    let (bw, ub) = (block_bytes(K), unpacked_block(K));
    assert!(
        nb == 0 || (stride >= bw && row.len() >= (nb - 1) * stride + bw),
        "unpack_row: short row"
    );
    assert!(out.len() >= nb * ub, "unpack_row: short output");
    for ib in 0..nb {
        // SAFETY: block `ib` lies inside `row` and its `ub` output bytes inside `out` (asserted).
        unsafe {
            let q = unpack::<K>(row.as_ptr().add(ib * stride));
            let o = out.as_mut_ptr().add(ib * ub);
            if is_one(K) {
                _mm256_storeu_si256(o as *mut __m256i, q);
            } else {
                _mm256_storeu_si256(o as *mut __m256i, _mm256_sign_epi8(q, q));
                _mm256_storeu_si256(o.add(32) as *mut __m256i, q);
            }
        }
    }
}

/// One tile: the 4 rows `w` (`nb` blocks of kind `K` each, unpacked) times the `T` tokens `a` (`nb`
/// Q8_0 / Q8_1 blocks each); `out[t][r]` equals `quant::vec_dot(w.q[r], a[t].q)` on the AVX2
/// tier, bit for bit (given that `w.d`, `w.m`, `a.d`, `a.s` hold the blocks' scales as f32).
///
/// # Safety
/// The CPU has AVX2, FMA and F16C.
#[allow(clippy::needless_range_loop)] // index loops over per-token and per-row register arrays
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const K: u8, const T: usize>(
    w: &Rows,
    a: &[Act; T],
    nb: usize,
) -> [[f32; TILE_R]; T] {
    let ub = unpacked_block(K);
    let (ba, aqs) = act_block(K);
    let nbp = nb.next_multiple_of(CHUNK);
    for r in 0..TILE_R {
        assert!(
            w.q[r].len() >= nb * ub && w.d[r].len() >= nbp,
            "tile: short weight row"
        );
    }
    if is_one(K) && nb > 0 {
        assert!(w.m.len() >= (nb - 1) * ROWS16 + TILE_R, "tile: short m_w");
    }
    for at in a {
        assert!(
            at.q.len() >= nb * ba && at.d.len() >= nbp && (!is_one(K) || at.s.len() >= nb),
            "tile: short activation row"
        );
    }
    let wp: [*const u8; TILE_R] = w.q.map(|r| r.as_ptr());
    let dwp: [*const f32; TILE_R] = w.d.map(|r| r.as_ptr());
    let ap: [*const u8; T] = core::array::from_fn(|t| a[t].q.as_ptr());
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); TILE_R]; T];
    // "_1" kinds: per token, lane r holds row r's `summs`.
    let mut summs = [_mm_setzero_ps(); T];
    // Per token and row, the scale products d_w·d_x of the chunk's blocks.
    let mut dp = [[[0f32; CHUNK]; TILE_R]; T];
    for ib0 in (0..nb).step_by(CHUNK) {
        // SAFETY: `ib0 + CHUNK <= nbp`, inside every `d` slice (checked above); `dp` rows are
        // CHUNK writable f32.
        unsafe {
            for t in 0..T {
                let dx = _mm256_loadu_ps(a[t].d.as_ptr().add(ib0));
                for r in 0..TILE_R {
                    let p = _mm256_mul_ps(_mm256_loadu_ps(dwp[r].add(ib0)), dx);
                    _mm256_storeu_ps(dp[t][r].as_mut_ptr(), p);
                }
            }
        }
        for j in 0..(nb - ib0).min(CHUNK) {
            let ib = ib0 + j;
            let (wo, ao) = (ib * ub, ib * ba);
            // SAFETY: `ib < nb`, so block `ib` of every row (`wo .. wo + ub`), of every
            // activation row (`ao .. ao + ba`), `s_x[ib]` and `m_w[ib * 16 .. + 4]` lie inside
            // the slices checked above.
            unsafe {
                if is_one(K) {
                    // m_w of the 4 rows times s_x, lane by lane (the scalar products and sums).
                    let m = _mm_loadu_ps(w.m.as_ptr().add(ib * ROWS16));
                    for t in 0..T {
                        let sx = _mm_broadcast_ss(&*a[t].s.as_ptr().add(ib));
                        summs[t] = _mm_add_ps(summs[t], _mm_mul_ps(m, sx));
                    }
                }
                for r in 0..TILE_R {
                    // "_0": |w| and, per token, x with w's sign (`sum_i8_pairs`).
                    let aq = _mm256_loadu_si256(wp[r].add(wo) as *const __m256i);
                    let q = if is_one(K) {
                        aq
                    } else {
                        _mm256_loadu_si256(wp[r].add(wo + 32) as *const __m256i)
                    };
                    for t in 0..T {
                        let x = _mm256_loadu_si256(ap[t].add(ao + aqs) as *const __m256i);
                        let x = if is_one(K) { x } else { _mm256_sign_epi8(x, q) };
                        let s = _mm256_madd_epi16(_mm256_maddubs_epi16(aq, x), ones);
                        let d = _mm256_broadcast_ss(&dp[t][r][j]);
                        acc[t][r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), acc[t][r]);
                    }
                }
            }
        }
    }
    let mut out = [[0f32; TILE_R]; T];
    for t in 0..T {
        let mut sm = [0f32; 4];
        // SAFETY: `sm` is 4 writable f32.
        unsafe { _mm_storeu_ps(sm.as_mut_ptr(), summs[t]) };
        for r in 0..TILE_R {
            out[t][r] = hsum8(acc[t][r]);
            if is_one(K) {
                out[t][r] += sm[r];
            }
        }
    }
    out
}

/// [`tile`] with the scales converted as it goes (and, with `pf > 0`, a prefetch of each row's
/// block `pf` bytes further on, per block): `d_w` of each row and `d_x` of each token
/// broadcast and converted per block, their product (`set1(d_w·d_x)`) one multiply per row and
/// token; the "_1" `m_w` of the 4 rows gathered into one vector per block.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile_direct<const K: u8, const T: usize>(
    rows: [&[u8]; TILE_R],
    stride: usize,
    acts: [&[u8]; T],
    nb: usize,
    pf: usize,
) -> [[f32; TILE_R]; T] {
    let bw = block_bytes(K);
    let (ba, aqs) = act_block(K);
    assert!(stride >= bw, "tile: block stride");
    for r in &rows {
        assert!(
            r.len() >= (nb.max(1) - 1) * stride + bw,
            "tile: short weight row"
        );
    }
    for a in &acts {
        assert!(a.len() >= nb * ba, "tile: short activation row");
    }
    let wp: [*const u8; TILE_R] = rows.map(|r| r.as_ptr());
    let ap: [*const u8; T] = acts.map(|a| a.as_ptr());
    let ones = _mm256_set1_epi16(1);
    let mut acc = [[_mm256_setzero_ps(); TILE_R]; T];
    // "_1" kinds: per token, lane r holds row r's `summs`.
    let mut summs = [_mm_setzero_ps(); T];
    for ib in 0..nb {
        let (wo, ao) = (ib * stride, ib * ba);
        // SAFETY: `ib < nb`, so block `ib` of every row (`wo .. wo + bw`) and of every
        // activation row (`ao .. ao + ba`) lies inside the slices checked above.
        unsafe {
            if is_one(K) {
                // m_w of the 4 rows times s_x, lane by lane (the scalar products and sums).
                let m = _mm_cvtph_ps(_mm_setr_epi16(
                    rd16(wp[0].add(wo + 2)) as i16,
                    rd16(wp[1].add(wo + 2)) as i16,
                    rd16(wp[2].add(wo + 2)) as i16,
                    rd16(wp[3].add(wo + 2)) as i16,
                    0,
                    0,
                    0,
                    0,
                ));
                for t in 0..T {
                    let sx = _mm_cvtph_ps(_mm_set1_epi16(rd16(ap[t].add(ao + 2)) as i16));
                    summs[t] = _mm_add_ps(summs[t], _mm_mul_ps(m, sx));
                }
            }
            if pf > 0 {
                for p in wp {
                    // Never faults, whatever the address (`wrapping_add`: no pointer arithmetic
                    // past the allocation).
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(wo + pf) as *const i8);
                }
            }
            // d_x of each token, in every lane.
            let dx: [__m256; T] = core::array::from_fn(|t| {
                _mm256_cvtph_ps(_mm_set1_epi16(rd16(ap[t].add(ao)) as i16))
            });
            for r in 0..TILE_R {
                let dw = _mm256_cvtph_ps(_mm_set1_epi16(rd16(wp[r].add(wo)) as i16));
                let q = unpack::<K>(wp[r].add(wo));
                // "_0": |w| and, per token, x with w's sign (`sum_i8_pairs`).
                let aq = if is_one(K) { q } else { _mm256_sign_epi8(q, q) };
                for t in 0..T {
                    let x = _mm256_loadu_si256(ap[t].add(ao + aqs) as *const __m256i);
                    let x = if is_one(K) { x } else { _mm256_sign_epi8(x, q) };
                    let s = _mm256_madd_epi16(_mm256_maddubs_epi16(aq, x), ones);
                    // set1(d_w·d_x): the same rounded product in every lane.
                    let d = _mm256_mul_ps(dw, dx[t]);
                    acc[t][r] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(s), acc[t][r]);
                }
            }
        }
    }
    let mut out = [[0f32; TILE_R]; T];
    for t in 0..T {
        let mut sm = [0f32; 4];
        // SAFETY: `sm` is 4 writable f32.
        unsafe { _mm_storeu_ps(sm.as_mut_ptr(), summs[t]) };
        for r in 0..TILE_R {
            out[t][r] = hsum8(acc[t][r]);
            if is_one(K) {
                out[t][r] += sm[r];
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn random_row(dtype: DType, cols: usize, rng: &mut StdRng) -> Vec<u8> {
        let v: Vec<f32> = (0..cols)
            .map(|_| rng.gen_range(-1.0f32..1.0) * rng.gen_range(0.01f32..4.0))
            .collect();
        let mut row = vec![0u8; dtype.row_bytes(cols).unwrap()];
        quant::quantize_row(dtype, &v, &mut row);
        row
    }

    /// A weight row of random quant bytes (every bit pattern, e.g. -128 in Q8_0) with finite
    /// random scales (and minimums).
    fn random_bytes_row(dtype: DType, cols: usize, rng: &mut StdRng) -> Vec<u8> {
        let mut row: Vec<u8> = (0..dtype.row_bytes(cols).unwrap())
            .map(|_| rng.gen())
            .collect();
        let k = kind_of(dtype).unwrap();
        for b in row.chunks_exact_mut(block_bytes(k)) {
            let d = half::f16::from_f32(rng.gen_range(-0.1f32..0.1)).to_bits();
            b[..2].copy_from_slice(&d.to_le_bytes());
            if is_one(k) {
                let m = half::f16::from_f32(rng.gen_range(-0.5f32..0.5)).to_bits();
                b[2..4].copy_from_slice(&m.to_le_bytes());
            }
        }
        row
    }

    /// The tiles against `quant::vec_dot` on random rows, for every type, token counts on both
    /// sides of the tile and row counts that are not multiples of it.
    #[test]
    fn tiles_equal_vec_dot_bit_for_bit() {
        if !crate::cpu::features().x86_simd() {
            eprintln!("no AVX2+FMA+F16C: skipped");
            return;
        }
        let seed: u64 = match std::env::var("QUANT_SEED") {
            Ok(s) => s.parse().expect("QUANT_SEED must be a u64"),
            Err(_) => rand::random(),
        };
        let mut rng = StdRng::seed_from_u64(seed);
        let types = [
            DType::Q4_0,
            DType::Q4_1,
            DType::Q5_0,
            DType::Q5_1,
            DType::Q8_0,
        ];
        for dtype in types {
            let at = quant::vec_dot_type(dtype);
            for &rows in &[1usize, 5, 17, 40] {
                let cols = 32 * rng.gen_range(1..=12);
                let w: Vec<u8> = (0..rows)
                    .flat_map(|_| random_bytes_row(dtype, cols, &mut rng))
                    .collect();
                let src = Src {
                    dtype,
                    rows,
                    cols,
                    data: &w,
                    layout: Layout::RowMajor,
                };
                let rb = src.row_bytes();
                // The same rows in the 4-row packed layout (read in place by the tiles).
                let mut w4 = vec![0u8; x4_len(dtype, rows, cols).unwrap()];
                pack_x4_groups(dtype, &w, rows, cols, 0, &mut w4);
                let src4 = Src {
                    data: &w4,
                    layout: Layout::X4,
                    ..src
                };
                let mut back = vec![0u8; rb];
                for r in 0..rows {
                    unpack_row_x4(&src4, r, &mut back);
                    assert_eq!(
                        back,
                        w[r * rb..][..rb],
                        "{dtype:?} X4 row {r} (seed {seed})"
                    );
                }
                let ts = (1usize..=16).chain([33, 64, 70]);
                for (t, src) in ts.flat_map(|t| [(t, src), (t, src4)]) {
                    let act: Vec<u8> = (0..t)
                        .flat_map(|_| random_row(at, cols, &mut rng))
                        .collect();
                    let ab = at.row_bytes(cols).unwrap();
                    let mut y = vec![f32::NAN; t * rows];
                    matmul(&src, &act, ab, t, &mut y);
                    for tok in 0..t {
                        for r in 0..rows {
                            let want = quant::vec_dot(
                                dtype,
                                &w[r * rb..][..rb],
                                &act[tok * ab..][..ab],
                                cols,
                            );
                            let got = y[tok * rows + r];
                            assert!(
                                !got.is_nan() && got.to_bits() == want.to_bits(),
                                "{dtype:?} {} rows {rows} cols {cols} T {t}: y[{tok}, {r}] = {got:e}, \
                                 vec_dot {want:e} (seed {seed}; rerun with QUANT_SEED={seed})",
                                src.layout.name()
                            );
                        }
                    }
                }
            }
        }
    }
}
