//! Implicit im2col: a 2-D convolution's patch matrix as a GEMM operand that is never written
//! out. Row `r = (channel, ky, kx)` and column `j = (oy, ox)` of the `channels * kh * kw` by
//! `oh * ow` matrix hold input pixel `(channel, oy * sy + ky * dy - top, ox * sx + kx * dx - left)`,
//! or 0 where that lies in the padding. The GEMM packs its panels straight from the input image
//! (see [`pack`]), so the patch matrix (7 MB for a 3x3 convolution over 64 x 56 x 56) does not
//! make a round trip through memory between im2col and packing.
//!
//! The image is first copied once, zero-padded to every window's reach and with each row split
//! into its column phases modulo the stride (a stride-2 row becomes its even columns, then its
//! odd ones): every run of a panel's lanes along an output row is then a contiguous copy, with
//! no bounds to check (the padding is in the copy) and no gather (a stride-2 tap reads one
//! phase).

use crate::pool;
use ferrum_core::Buf;

/// A convolution's input seen as its patch matrix (`k x n`: `channels * kh * kw` rows, `oh * ow`
/// columns), the right-hand operand `B` of `W * patches` (see [`super::Rhs::Patches`]).
#[derive(Clone, Debug)]
pub struct Patches<'a> {
    data: &'a [f32],
    /// The image zero-padded and split by column phase: plane `c`, padded row `y`, phase `f`,
    /// value `i` (padded column `i * sx + f`) at `((c * rows + y) * sx + f) * width + i`.
    phased: Buf,
    /// Padded rows that the windows reach.
    rows: usize,
    /// Values in each phase of a padded row.
    width: usize,
    channels: usize,
    input: [usize; 2],
    kernel: [usize; 2],
    stride: [usize; 2],
    dilation: [usize; 2],
    /// Padding before the first row and column.
    pad: [usize; 2],
    output: [usize; 2],
}

impl<'a> Patches<'a> {
    /// The patches of `channels` planes of `input = [ih, iw]` (row-major, one after another in
    /// `data`) under a `kernel = [kh, kw]` window, with the given stride, dilation, leading
    /// padding (`[top, left]`) and output size. Panics when `data` is too short, a size is 0
    /// where it must not be, or an output position's window starts past the padded input.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        data: &'a [f32],
        channels: usize,
        input: [usize; 2],
        kernel: [usize; 2],
        stride: [usize; 2],
        dilation: [usize; 2],
        pad: [usize; 2],
        output: [usize; 2],
    ) -> Patches<'a> {
        assert!(
            data.len() >= channels * input[0] * input[1],
            "patches: {} floats for {channels} planes of {input:?}",
            data.len()
        );
        assert!(
            stride
                .iter()
                .chain(&dilation)
                .chain(&kernel)
                .all(|&v| v > 0),
            "patches: zero stride, dilation or kernel size"
        );
        // The padded rows and columns the windows reach (at least the input's extent).
        let reach = |i: usize| {
            if output[i] == 0 {
                0
            } else {
                (output[i] - 1) * stride[i] + (kernel[i] - 1) * dilation[i] + 1
            }
        };
        let (rows, cols) = (reach(0), reach(1));
        let width = cols.div_ceil(stride[1]);
        let mut p = Patches {
            data,
            phased: Buf::default(),
            rows,
            width,
            channels,
            input,
            kernel,
            stride,
            dilation,
            pad,
            output,
        };
        p.phased = p.split_phases();
        p
    }

    /// The phased copy of the image (see the field): every value written.
    fn split_phases(&self) -> Buf {
        let [ih, iw] = self.input;
        let [top, left] = self.pad;
        let sx = self.stride[1];
        let (rows, width) = (self.rows, self.width);
        let plane = rows * sx * width;
        // Zeros (the padding rows stay so), in a recycled buffer of this thread (a convolution
        // makes one per image and group, each the same size from run to run).
        let mut out = Buf::zeros(self.channels * plane);
        if plane == 0 {
            return out;
        }
        let data = self.data;
        pool::parallel_chunks_mut(&mut out, plane, |c, dst| {
            for y in 0..rows {
                let Some(iy) = y.checked_sub(top).filter(|&iy| iy < ih) else {
                    continue; // a padding row: zeros
                };
                let src = &data[(c * ih + iy) * iw..][..iw];
                for f in 0..sx {
                    let d = &mut dst[(y * sx + f) * width..][..width];
                    // Values i with input column i * sx + f - left in 0..iw.
                    let lo = left.saturating_sub(f).div_ceil(sx);
                    let hi = (iw + left).saturating_sub(f).div_ceil(sx).min(width);
                    if lo >= hi {
                        continue;
                    }
                    let first = lo * sx + f - left;
                    let d = &mut d[lo..hi];
                    match sx {
                        1 => d.copy_from_slice(&src[first..first + d.len()]),
                        2 => every_other(&src[first..], d),
                        _ => {
                            for (i, v) in d.iter_mut().enumerate() {
                                *v = src[first + i * sx];
                            }
                        }
                    }
                }
            }
        });
        out
    }

    /// Rows of the patch matrix (the product's inner dimension): `channels * kh * kw`.
    pub fn rows(&self) -> usize {
        self.channels * self.kernel[0] * self.kernel[1]
    }

    /// Columns of the patch matrix (output positions): `oh * ow`.
    pub fn cols(&self) -> usize {
        self.output[0] * self.output[1]
    }

    /// Element `(r, j)` of the patch matrix (the plain definition the packer is tested against).
    pub fn at(&self, r: usize, j: usize) -> f32 {
        let [kh, kw] = self.kernel;
        let (ch, ky, kx) = (r / (kh * kw), (r / kw) % kh, r % kw);
        let (oy, ox) = (j / self.output[1], j % self.output[1]);
        let iy = (oy * self.stride[0] + ky * self.dilation[0]) as isize - self.pad[0] as isize;
        let ix = (ox * self.stride[1] + kx * self.dilation[1]) as isize - self.pad[1] as isize;
        let [ih, iw] = self.input;
        if iy < 0 || ix < 0 || iy >= ih as isize || ix >= iw as isize {
            return 0.0;
        }
        self.data[(ch * ih + iy as usize) * iw + ix as usize]
    }
}

/// The output columns `lo..hi` whose input column `o * s + t - pad` lies in `0..len` (of `out`
/// output columns), for a tap at offset `t` in the padded input.
pub fn valid_range(len: usize, out: usize, s: usize, t: usize, pad: usize) -> (usize, usize) {
    // o * s + t >= pad  and  o * s + t < len + pad
    let lo = if t >= pad { 0 } else { (pad - t).div_ceil(s) };
    let hi = if len + pad > t {
        ((len + pad - t).div_ceil(s)).min(out)
    } else {
        0
    };
    (lo.min(hi), hi)
}

/// A run of a panel's lanes that lie in one output row: lanes `lane..lane + len`, read from
/// `at` in a step's phase row (output row `oy`, columns `ox..`: `oy * sy * sx * width + ox`).
#[derive(Clone, Copy)]
struct Run {
    lane: usize,
    len: usize,
    at: usize,
}

/// Packs `cols x kc` of the transposed patch matrix (`X = B^T`: output positions `j0..j0 + cols`
/// as the panels' lanes, patch rows `r0..r0 + kc` as their steps) into panels of `w` lanes, the
/// layout of the GEMM's other packers: panel `q`, step `p`, lane `l` at `q * kc * w + p * w + l`,
/// lanes past `cols` zero. Writes every float of those panels.
pub(super) fn pack(
    x: &Patches,
    j0: usize,
    r0: usize,
    cols: usize,
    kc: usize,
    w: usize,
    dst: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    {
        let f = crate::cpu::features();
        if f.avx512() {
            // SAFETY: the CPU has AVX-512F/BW/VL (and AVX2, FMA) and the process allows them.
            return unsafe { pack_avx512(x, j0, r0, cols, kc, w, dst) };
        }
        if f.x86_simd() && f.avx2 {
            // SAFETY: the CPU has AVX2 and the process allows it.
            return unsafe { pack_avx2(x, j0, r0, cols, kc, w, dst) };
        }
    }
    pack_any(x, j0, r0, cols, kc, w, dst)
}

/// [`pack_any`] compiled for AVX2 (its copies in 32-byte registers; same values).
///
/// # Safety
/// The CPU supports AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn pack_avx2(
    x: &Patches,
    j0: usize,
    r0: usize,
    cols: usize,
    kc: usize,
    w: usize,
    dst: &mut [f32],
) {
    pack_any(x, j0, r0, cols, kc, w, dst)
}

/// [`pack_any`] compiled for AVX-512 (its copies in vector registers; same values).
///
/// # Safety
/// The CPU supports AVX-512F/BW/VL, AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn pack_avx512(
    x: &Patches,
    j0: usize,
    r0: usize,
    cols: usize,
    kc: usize,
    w: usize,
    dst: &mut [f32],
) {
    pack_any(x, j0, r0, cols, kc, w, dst)
}

/// [`pack`] for any CPU: per panel, its lanes split into runs along output rows; per step, each
/// run one contiguous copy from the step's phase row.
#[inline(always)]
fn pack_any(x: &Patches, j0: usize, r0: usize, cols: usize, kc: usize, w: usize, dst: &mut [f32]) {
    let [kh, kw] = x.kernel;
    let [oh, ow] = x.output;
    let [sy, sx] = x.stride;
    let [dy, dx] = x.dilation;
    let (rows, width) = (x.rows, x.width);
    debug_assert!(j0 + cols <= oh * ow && r0 + kc <= x.rows());
    let src = &x.phased[..];
    let mut runs: Vec<Run> = Vec::with_capacity(w);
    for (q, panel) in dst[..cols.div_ceil(w) * kc * w]
        .chunks_exact_mut(kc * w)
        .enumerate()
    {
        // The panel's lanes split where output rows end.
        runs.clear();
        let lanes = w.min(cols - q * w);
        let start = j0 + q * w;
        let (mut oy, mut ox) = (start / ow, start % ow);
        let mut lane = 0;
        while lane < lanes {
            let len = (lanes - lane).min(ow - ox);
            runs.push(Run {
                lane,
                len,
                at: oy * sy * sx * width + ox,
            });
            lane += len;
            ox += len;
            if ox == ow {
                ox = 0;
                oy += 1;
            }
        }
        let (mut ch, mut ky, mut kx) = (r0 / (kh * kw), (r0 / kw) % kh, r0 % kw);
        for step in panel.chunks_exact_mut(w) {
            step[lanes..].fill(0.0);
            let t = kx * dx;
            let base = ((ch * rows + ky * dy) * sx + t % sx) * width + t / sx;
            for run in &runs {
                let s = &src[base + run.at..][..run.len];
                copy_run(&mut step[run.lane..][..run.len], s);
            }
            kx += 1;
            if kx == kw {
                kx = 0;
                ky += 1;
                if ky == kh {
                    ky = 0;
                    ch += 1;
                }
            }
        }
    }
}

/// `dst = src` for a run of a panel's lanes (at most 32 floats, often a few: rows of 7 to 28
/// outputs split the panels), as at most two fixed-size copies that may overlap, so a run costs
/// a few vector moves rather than a call to `memmove` (10% of a 3x3 stride-2 layer over
/// 128 x 56 x 56 at one thread went to that call).
#[inline(always)]
fn copy_run(dst: &mut [f32], src: &[f32]) {
    #[inline(always)]
    fn two<const W: usize>(dst: &mut [f32], src: &[f32]) {
        // W <= len <= 2 W: the first W and the last W values cover the run.
        let n = dst.len();
        for at in [0, n - W] {
            let d: &mut [f32; W] = (&mut dst[at..at + W]).try_into().unwrap();
            let s: &[f32; W] = src[at..at + W].try_into().unwrap();
            *d = *s;
        }
    }
    match dst.len() {
        16..=32 => two::<16>(dst, src),
        8..=15 => two::<8>(dst, src),
        4..=7 => two::<4>(dst, src),
        _ => dst.copy_from_slice(src),
    }
}

/// `d[i] = src[2 * i]` for every `i < d.len()` (`src` holds at least `2 * d.len() - 1` values),
/// with [`every_other_avx512`] where the CPU has it: a stride-2 row of a convolution's patches.
pub fn every_other(src: &[f32], d: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        let f = crate::cpu::features();
        if f.avx512() {
            // SAFETY: the CPU has AVX-512F and the process allows it.
            return unsafe { every_other_avx512(src, d) };
        }
        if f.x86_simd() && f.avx2 {
            // SAFETY: the CPU has AVX2 and the process allows it.
            return unsafe { every_other_avx2(src, d) };
        }
    }
    every_other_from(src, d, 0);
}

/// `d[i] = src[2 * i]` for `i` from `start`.
#[inline(always)]
fn every_other_from(src: &[f32], d: &mut [f32], start: usize) {
    for (i, v) in d.iter_mut().enumerate().skip(start) {
        *v = src[2 * i];
    }
}

/// [`every_other`] in 8 lanes: whole groups of 8 from two loads, a shuffle of their even
/// lanes and a lane permute while 16 values remain in `src`, the rest one by one.
///
/// # Safety
/// The CPU supports AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn every_other_avx2(src: &[f32], d: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = d.len();
    let mut i = 0;
    while i + 8 <= n && 2 * i + 16 <= src.len() {
        // SAFETY: values 2i .. 2i + 16 lie in `src` (the loop's condition), outputs
        // i .. i + 8 in `d`.
        unsafe {
            let p = src.as_ptr().add(2 * i);
            // a0 a2 b0 b2 | a4 a6 b4 b6, then the 64-bit pairs in order 0 2 1 3.
            let e = _mm256_shuffle_ps::<0x88>(_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)));
            let v = _mm256_castpd_ps(_mm256_permute4x64_pd::<0xd8>(_mm256_castps_pd(e)));
            _mm256_storeu_ps(d.as_mut_ptr().add(i), v);
        }
        i += 8;
    }
    every_other_from(src, d, i);
}

/// [`every_other`] in 16 lanes: whole groups of 16 from two loads and one two-source permute
/// while 32 values remain in `src`, the rest with masked loads (nothing read past the last value
/// used) and a masked store (masked accesses are slow on some CPUs: only at the end).
///
/// # Safety
/// The CPU supports AVX-512F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn every_other_avx512(src: &[f32], d: &mut [f32]) {
    use std::arch::x86_64::*;
    let n = d.len();
    if n == 0 {
        return;
    }
    assert!(src.len() > 2 * (n - 1));
    let even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let mut i = 0;
    // Whole groups while two whole vectors of `src` remain.
    while i + 16 <= n && 2 * i + 32 <= src.len() {
        // SAFETY: values 2i .. 2i + 32 lie in `src` (the loop's condition), outputs
        // i .. i + 16 in `d`.
        unsafe {
            let p = src.as_ptr().add(2 * i);
            let v = _mm512_permutex2var_ps(_mm512_loadu_ps(p), even, _mm512_loadu_ps(p.add(16)));
            _mm512_storeu_ps(d.as_mut_ptr().add(i), v);
        }
        i += 16;
    }
    while i < n {
        let count = (n - i).min(16);
        // Values 2i .. 2i + 2 count - 1 (the last one used is 2 (i + count - 1)).
        let used = 2 * count - 1;
        let lo: __mmask16 = if used >= 16 { 0xffff } else { (1 << used) - 1 };
        let hi: __mmask16 = if used > 16 {
            ((1u32 << (used - 16)) - 1) as u16
        } else {
            0
        };
        let keep: __mmask16 = if count == 16 {
            0xffff
        } else {
            (1 << count) - 1
        };
        // SAFETY: the masks enable only values 2i .. 2i + used of `src` (inside it: the
        // assert) and outputs i .. i + count of `d`.
        unsafe {
            let p = src.as_ptr().add(2 * i);
            let a = _mm512_maskz_loadu_ps(lo, p);
            let b = _mm512_maskz_loadu_ps(hi, p.add(16));
            let v = _mm512_permutex2var_ps(a, even, b);
            _mm512_mask_storeu_ps(d.as_mut_ptr().add(i), keep, v);
        }
        i += count;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// Every vector version of [`every_other`] this CPU runs gives `src[2 i]` exactly, for
    /// lengths around the vector widths and sources that end at the last value used or run
    /// past it (fresh random values; the destination starts as NaN, so a value left
    /// unwritten fails).
    #[test]
    fn every_other_picks_the_even_values() {
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let f = crate::cpu::hardware();
        for n in 0..70usize {
            for extra in [0, 1, 17] {
                let len = (2 * n).saturating_sub(1) + extra;
                let src: Vec<f32> = (0..len).map(|_| rng.gen_range(-1.0f32..1.0)).collect();
                let want: Vec<u32> = (0..n).map(|i| src[2 * i].to_bits()).collect();
                let mut got = vec![f32::NAN; n];
                every_other_from(&src, &mut got, 0);
                let mut kinds: Vec<(&str, Vec<f32>)> = vec![("portable", got)];
                #[cfg(target_arch = "x86_64")]
                {
                    if f.x86_simd() && f.avx2 {
                        let mut d = vec![f32::NAN; n];
                        // SAFETY: the CPU has AVX2.
                        unsafe { every_other_avx2(&src, &mut d) };
                        kinds.push(("avx2", d));
                    }
                    if f.avx512() && n > 0 {
                        let mut d = vec![f32::NAN; n];
                        // SAFETY: the CPU has AVX-512F.
                        unsafe { every_other_avx512(&src, &mut d) };
                        kinds.push(("avx512", d));
                    }
                }
                for (kind, d) in kinds {
                    let bits: Vec<u32> = d.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(bits, want, "seed {seed} {kind} n {n} src {len}");
                }
            }
        }
    }
}
