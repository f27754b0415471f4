//! Depthwise convolution on channels-last tensors (one filter per channel: MobileNet's 3x3
//! layers).
//!
//! Input `[n, ih, iw, c]`, filter taps `[kh * kw, c]` (tap-major: each tap's weights for all
//! channels side by side), output `[n, oh, ow, c]`. Each output is `act(residual + bias +
//! sum over the taps inside the input of w * x)`, the taps in (ky, kx) order (taps over the
//! padding add nothing and are skipped). The vector kernels run across channels: per output
//! pixel and tap one fused multiply-add of a weight vector and an input vector, four pixels at
//! a time where every tap of the pixels is inside the input, masked for the channels past the
//! last whole vector. Threads split the output rows. [`depthwise_nhwc_ref`] is the f64
//! reference.

use std::mem::MaybeUninit;

use crate::gemm::{self, Act, Isa};
use crate::pool;

/// The shape of a channels-last depthwise convolution.
#[derive(Clone, Copy, Debug)]
pub struct Geometry {
    /// Input rows and columns.
    pub input: [usize; 2],
    pub channels: usize,
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub dilation: [usize; 2],
    /// Padding above and to the left (the output size decides the rest).
    pub pad: [usize; 2],
    pub output: [usize; 2],
}

impl Geometry {
    /// A `kernel` window over `input` with padding `pad` before and `pad_end` after, and the
    /// output size that follows; `None` when the window does not fit (tests' random shapes).
    #[cfg(test)]
    pub(crate) fn fitting(
        input: [usize; 2],
        channels: usize,
        kernel: [usize; 2],
        stride: [usize; 2],
        dilation: [usize; 2],
        pad: [usize; 2],
        pad_end: [usize; 2],
    ) -> Option<Geometry> {
        let out = |i: usize| {
            let span = input[i] + pad[i] + pad_end[i];
            let ext = (kernel[i] - 1) * dilation[i] + 1;
            (span >= ext).then(|| (span - ext) / stride[i] + 1)
        };
        Some(Geometry {
            input,
            channels,
            kernel,
            stride,
            dilation,
            pad,
            output: [out(0)?, out(1)?],
        })
    }
}

/// What follows the taps: starting values (`residual`, `[n, oh, ow, c]`, plus `bias`, one per
/// channel) and the activation (Identity, Relu, Clip or LeakyRelu: the vector ones).
#[derive(Clone, Copy, Debug)]
pub struct Finish<'a> {
    pub bias: Option<&'a [f32]>,
    pub residual: Option<&'a [f32]>,
    pub act: Act,
}

/// Pixels of a group whose taps are all inside the input.
const GROUP: usize = 4;

/// The depthwise convolution of `n` images (see the module's documentation) into `out`
/// (`n * oh * ow * c`, every element written). Panics when a buffer is too short or the
/// activation is not a vector one.
pub fn depthwise_nhwc(
    x: &[f32],
    w: &[f32],
    n: usize,
    g: &Geometry,
    fin: &Finish,
    out: &mut [MaybeUninit<f32>],
) {
    depthwise_nhwc_with(gemm::isa(), pool::threads(), x, w, n, g, fin, out)
}

/// [`depthwise_nhwc`] with a chosen kernel family and at most `threads` tasks at a time.
#[allow(clippy::too_many_arguments)]
pub fn depthwise_nhwc_with(
    isa: Isa,
    threads: usize,
    x: &[f32],
    w: &[f32],
    n: usize,
    g: &Geometry,
    fin: &Finish,
    out: &mut [MaybeUninit<f32>],
) {
    assert!(
        available(isa),
        "depthwise: {isa:?} is not supported by this CPU"
    );
    let (c, [kh, kw]) = (g.channels, g.kernel);
    let wlen = kh * kw * c;
    for_each_row(
        "depthwise",
        threads,
        x,
        (w, wlen),
        c,
        n,
        g,
        fin,
        out,
        |img, oy, z, o| {
            let (ky0, ky1, iy0) = tap_rows(g, oy);
            let row = g.input[1] * c;
            with_rows(
                ky1 - ky0,
                |r| &img[(iy0 + r * g.dilation[0]) * row..][..row],
                |rows| out_row(isa, Taps { ky0, rows }, w, g, fin.bias, z, fin.act, o),
            )
        },
    );
}

/// The input rows an output row reads: filter row `ky0 + r` over the input row `rows[r]`
/// (`iw * c` values: an image's row, or a row made just before).
#[derive(Clone, Copy)]
struct Taps<'a> {
    ky0: usize,
    rows: &'a [&'a [f32]],
}

/// Runs `f` on the `n` rows `at(0..n)` gathered into a slice (on the stack for up to 8 rows).
fn with_rows<'x, R>(
    n: usize,
    at: impl Fn(usize) -> &'x [f32],
    f: impl FnOnce(&[&'x [f32]]) -> R,
) -> R {
    if n <= 8 {
        let mut buf: [&[f32]; 8] = [&[]; 8];
        for (r, b) in buf.iter_mut().enumerate().take(n) {
            *b = at(r);
        }
        f(&buf[..n])
    } else {
        f(&(0..n).map(at).collect::<Vec<_>>())
    }
}

/// A 1x1 convolution in front of a depthwise one (MobileNet's expansion): per pixel
/// `act(x W + bias)`, `cin` channels in, the depthwise convolution's channels out.
#[derive(Clone, Copy)]
pub struct Expand<'a> {
    pub cin: usize,
    /// W `[cin, channels]`.
    pub w: gemm::Rhs<'a>,
    pub bias: Option<&'a [f32]>,
    pub act: Act,
}

/// The depthwise convolution ([`depthwise_nhwc`], geometry `g` over the expanded tensor) of the
/// expansion `e` of `x` (`[n, ih, iw, e.cin]`), without the expanded tensor: each task makes
/// the expanded rows its output rows read as they are first needed, one product a row, into
/// a ring of `(kh - 1) * dh + 1` rows that stays in cache (in an inverted residual block the
/// expanded tensor is the largest, six times the block's input). The same bits as
/// [`gemm::gemm_ex`] over every pixel followed by [`depthwise_nhwc`]. Threads take one run of
/// consecutive output rows each (an input row where two runs meet is expanded by both).
pub fn expand_depthwise_nhwc(
    x: &[f32],
    e: &Expand,
    w: &[f32],
    n: usize,
    g: &Geometry,
    fin: &Finish,
    out: &mut [MaybeUninit<f32>],
) {
    expand_depthwise_nhwc_with(gemm::isa(), pool::threads(), x, e, w, n, g, fin, out)
}

/// [`expand_depthwise_nhwc`] with a chosen kernel family and at most `threads` tasks.
#[allow(clippy::too_many_arguments)]
pub fn expand_depthwise_nhwc_with(
    isa: Isa,
    threads: usize,
    x: &[f32],
    e: &Expand,
    w: &[f32],
    n: usize,
    g: &Geometry,
    fin: &Finish,
    out: &mut [MaybeUninit<f32>],
) {
    assert!(
        available(isa),
        "expand_depthwise: {isa:?} is not supported by this CPU"
    );
    let ([ih, iw], c, [kh, kw]) = (g.input, g.channels, g.kernel);
    let [oh, ow] = g.output;
    assert!(
        g.stride.iter().chain(&g.dilation).all(|&v| v > 0) && kh > 0 && kw > 0 && e.cin > 0,
        "expand_depthwise: zero stride, dilation, kernel or input channels in {g:?}"
    );
    assert!(
        x.len() >= n * ih * iw * e.cin && w.len() >= kh * kw * c && out.len() >= n * oh * ow * c,
        "expand_depthwise: buffers too short for {n} images of {g:?} from {} channels",
        e.cin
    );
    assert!(
        e.bias.is_none_or(|b| b.len() >= c),
        "expand_depthwise: short expansion bias"
    );
    check_finish("expand_depthwise", fin, c, n * oh * ow);
    let len = ow * c;
    if len == 0 || n * oh == 0 {
        return;
    }
    let (d0, rl) = (g.dilation[0], iw * c);
    let span = (kh - 1) * d0 + 1;
    let epi = gemm::Epilogue {
        bias: e.bias.map_or(gemm::Bias::None, gemm::Bias::Col),
        act: e.act,
        residual: None,
    };
    // Output rows first.. of the images, into `o`.
    let run = |first: usize, o: &mut [MaybeUninit<f32>]| {
        let mut ring = RING.with(|r| std::mem::take(&mut *r.borrow_mut()));
        if ring.len() < span * rl {
            ring.resize(span * rl, 0.0);
        }
        // Which input row (image * ih + row) each slot holds.
        let mut held = vec![usize::MAX; span];
        for (i, o) in o.chunks_mut(len).enumerate() {
            let r = first + i;
            let (img, oy) = (r / oh, r % oh);
            let (ky0, ky1, iy0) = tap_rows(g, oy);
            for t in 0..ky1 - ky0 {
                let iy = iy0 + t * d0;
                let (key, slot) = (img * ih + iy, iy % span);
                if held[slot] != key {
                    let src = &x[key * iw * e.cin..][..iw * e.cin];
                    let dst = &mut ring[slot * rl..][..rl];
                    let lhs = gemm::Lhs::Mat(gemm::Mat::row_major(src, e.cin));
                    gemm::gemm_ex_with(isa, 1, iw, c, e.cin, 1.0, lhs, e.w, 0.0, dst, c, &epi);
                    held[slot] = key;
                }
            }
            let z = fin.residual.map(|z| &z[r * len..][..len]);
            let at = |t: usize| &ring[(iy0 + t * d0) % span * rl..][..rl];
            with_rows(ky1 - ky0, at, |rows| {
                out_row(isa, Taps { ky0, rows }, w, g, fin.bias, z, fin.act, o)
            });
        }
        RING.with(|r| *r.borrow_mut() = ring);
    };
    let rows = &mut out[..n * oh * len];
    if threads <= 1 {
        run(0, rows);
    } else {
        let per = (n * oh).div_ceil(threads);
        pool::parallel_chunks_mut(rows, per * len, |t, o| run(t * per, o));
    }
}

thread_local! {
    /// The expanded rows of an [`expand_depthwise_nhwc`] task, kept by each thread that runs
    /// one (the largest so far).
    static RING: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Checks the buffers of a channels-last convolution of `n` images (`g`, `cout` output
/// channels, a filter of at least `w.1` values) and runs `row(image, oy, residual row, output
/// row)` for every output row: in runs of consecutive rows, two per thread, so each thread
/// streams its own part of the input (rows claimed one at a time interleave the threads'
/// reads). Panics on a zero stride, dilation or kernel, a short buffer or an activation that
/// is not a vector one.
#[allow(clippy::too_many_arguments)]
pub(crate) fn for_each_row(
    what: &str,
    threads: usize,
    x: &[f32],
    w: (&[f32], usize),
    cout: usize,
    n: usize,
    g: &Geometry,
    fin: &Finish,
    out: &mut [MaybeUninit<f32>],
    row: impl Fn(&[f32], usize, Option<&[f32]>, &mut [MaybeUninit<f32>]) + Sync,
) {
    let ([ih, iw], cin, [kh, kw]) = (g.input, g.channels, g.kernel);
    let [oh, ow] = g.output;
    let isz = ih * iw * cin;
    assert!(
        g.stride.iter().chain(&g.dilation).all(|&v| v > 0) && kh > 0 && kw > 0,
        "{what}: zero stride, dilation or kernel in {g:?}"
    );
    assert!(
        x.len() >= n * isz && w.0.len() >= w.1 && out.len() >= n * oh * ow * cout,
        "{what}: buffers too short for {n} images of {g:?} -> {cout}"
    );
    check_finish(what, fin, cout, n * oh * ow);
    let len = ow * cout;
    if len == 0 || n * oh == 0 {
        return;
    }
    let rows = &mut out[..n * oh * len];
    let work = |r: usize, o: &mut [MaybeUninit<f32>]| {
        let img = &x[r / oh * isz..][..isz];
        let z = fin.residual.map(|z| &z[r * len..][..len]);
        row(img, r % oh, z, o);
    };
    if threads <= 1 {
        for (r, o) in rows.chunks_mut(len).enumerate() {
            work(r, o);
        }
    } else {
        let per = (n * oh).div_ceil(2 * threads).max(1);
        pool::parallel_chunks_mut(rows, per * len, |t, o| {
            for (i, o) in o.chunks_mut(len).enumerate() {
                work(t * per + i, o);
            }
        });
    }
}

/// Panics unless `fin` fits `pixels` output pixels of `cout` channels (its bias and residual
/// long enough) and its activation is a vector one.
fn check_finish(what: &str, fin: &Finish, cout: usize, pixels: usize) {
    assert!(
        fin.bias.is_none_or(|b| b.len() >= cout),
        "{what}: short bias"
    );
    assert!(
        fin.residual.is_none_or(|z| z.len() >= pixels * cout),
        "{what}: short residual"
    );
    assert!(
        fin.act.is_vector(),
        "{what}: {:?} is not a vector activation",
        fin.act
    );
}

fn available(isa: Isa) -> bool {
    gemm::isa_available(isa)
}

/// The filter rows of output row `oy` that fall inside the input: `ky0..ky1`, the first
/// reading input row `iy0`. A contiguous range: the input row grows with `ky`.
fn tap_rows(g: &Geometry, oy: usize) -> (usize, usize, usize) {
    let iy = |ky: usize| (oy * g.stride[0] + ky * g.dilation[0]) as isize - g.pad[0] as isize;
    let kh = g.kernel[0];
    let ky0 = (0..kh).find(|&ky| iy(ky) >= 0).unwrap_or(kh);
    let ky1 = (ky0..kh)
        .find(|&ky| iy(ky) >= g.input[0] as isize)
        .unwrap_or(kh);
    (ky0, ky1, if ky0 < ky1 { iy(ky0) as usize } else { 0 })
}

/// The output columns whose every tap is inside the input: `lo..hi`.
fn inner_cols(g: &Geometry) -> (usize, usize) {
    let (iw, ow, s, p) = (g.input[1], g.output[1], g.stride[1], g.pad[1]);
    let span = (g.kernel[1] - 1) * g.dilation[1];
    let lo = p.div_ceil(s).min(ow);
    let hi = if iw + p > span {
        ((iw + p - span - 1) / s + 1).min(ow)
    } else {
        0
    };
    (lo, hi.max(lo))
}

/// One output row, every channel, by `isa`'s kernel, from the input rows `taps`.
#[allow(clippy::too_many_arguments)]
fn out_row(
    isa: Isa,
    taps: Taps,
    w: &[f32],
    g: &Geometry,
    bias: Option<&[f32]>,
    z: Option<&[f32]>,
    act: Act,
    o: &mut [MaybeUninit<f32>],
) {
    match isa {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: the ISA is supported (checked by the caller); `taps` gives whole input
        // rows, `w` holds the taps, `z` and `o` one output row, `bias` the channels (lengths
        // checked by the caller), and the kernel reads and writes only inside them.
        Isa::Avx512 => unsafe { x86::row_avx512(taps, w, g, bias, z, act, o) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, for AVX2 and FMA.
        Isa::Avx2 => unsafe { x86::row_avx2(taps, w, g, bias, z, act, o) },
        _ => row_portable(taps, w, g, bias, z, act, o),
    }
}

/// [`out_row`] in plain Rust, one channel at a time.
#[allow(clippy::too_many_arguments)]
fn row_portable(
    taps: Taps,
    w: &[f32],
    g: &Geometry,
    bias: Option<&[f32]>,
    z: Option<&[f32]>,
    act: Act,
    o: &mut [MaybeUninit<f32>],
) {
    let (c, iw, [_, kw]) = (g.channels, g.input[1], g.kernel);
    let Taps { ky0, rows } = taps;
    let ky1 = ky0 + rows.len();
    for ox in 0..g.output[1] {
        for ch in 0..c {
            let mut a = z.map_or(0.0, |z| z[ox * c + ch]) + bias.map_or(0.0, |b| b[ch]);
            for (r, ky) in (ky0..ky1).enumerate() {
                let row = rows[r];
                for kx in 0..kw {
                    let ix = (ox * g.stride[1] + kx * g.dilation[1]) as isize - g.pad[1] as isize;
                    if ix < 0 || ix as usize >= iw {
                        continue;
                    }
                    a = w[(ky * kw + kx) * c + ch].mul_add(row[ix as usize * c + ch], a);
                }
            }
            o[ox * c + ch].write(act.apply(a));
        }
    }
}

/// The f64 reference: every output of [`depthwise_nhwc`] for `n` images, computed directly
/// from the definition (zero padding, no skipped taps), before rounding.
pub fn depthwise_nhwc_ref(x: &[f32], w: &[f32], n: usize, g: &Geometry, fin: &Finish) -> Vec<f64> {
    let ([ih, iw], c, [kh, kw]) = (g.input, g.channels, g.kernel);
    let [oh, ow] = g.output;
    let mut out = vec![0f64; n * oh * ow * c];
    for b in 0..n {
        for oy in 0..oh {
            for ox in 0..ow {
                for ch in 0..c {
                    let i = ((b * oh + oy) * ow + ox) * c + ch;
                    let mut a = fin.residual.map_or(0.0, |z| z[i] as f64)
                        + fin.bias.map_or(0.0, |v| v[ch] as f64);
                    for ky in 0..kh {
                        for kx in 0..kw {
                            let iy = (oy * g.stride[0] + ky * g.dilation[0]) as isize
                                - g.pad[0] as isize;
                            let ix = (ox * g.stride[1] + kx * g.dilation[1]) as isize
                                - g.pad[1] as isize;
                            let v = if iy < 0 || ix < 0 || iy as usize >= ih || ix as usize >= iw {
                                0.0
                            } else {
                                x[((b * ih + iy as usize) * iw + ix as usize) * c + ch] as f64
                            };
                            a += w[(ky * kw + kx) * c + ch] as f64 * v;
                        }
                    }
                    out[i] = a;
                }
            }
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    use super::{inner_cols, Geometry, Taps, GROUP};
    use crate::gemm::x86::{act_avx2, act_avx512, first_lanes, load8};
    use crate::gemm::Act;

    /// [`super::out_row`] on AVX-512: 16 channels a vector (masked past the last whole one).
    ///
    /// # Safety
    /// AVX-512F must be supported; `taps` gives whole input rows (`iw * c` values), `w` holds
    /// at least `kh * kw * c` taps, `bias` (when given) `c` values, `z` (when given) and `o`
    /// one output row (`ow * c`).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn row_avx512(
        taps: Taps,
        w: &[f32],
        g: &Geometry,
        bias: Option<&[f32]>,
        z: Option<&[f32]>,
        act: Act,
        o: &mut [MaybeUninit<f32>],
    ) {
        let (c, iw, [_, kw], [_, ow]) = (g.channels, g.input[1], g.kernel, g.output);
        let Taps { ky0, rows } = taps;
        let ky1 = ky0 + rows.len();
        let (lo, hi) = inner_cols(g);
        let (wp, op) = (w.as_ptr(), o.as_mut_ptr() as *mut f32);
        let (s1, d1, p1) = (g.stride[1], g.dilation[1], g.pad[1] as isize);
        // Output pixels ox..ox + np, the channels cb..cb + 16 under `m`; `inside` when every
        // tap of these pixels is inside the input.
        let block = |ox: usize, np: usize, cb: usize, m: __mmask16, inside: bool| {
            let mut acc = [_mm512_setzero_ps(); GROUP];
            let b = match bias {
                Some(b) => _mm512_maskz_loadu_ps(m, b.as_ptr().add(cb)),
                None => _mm512_setzero_ps(),
            };
            for (p, a) in acc.iter_mut().enumerate().take(np) {
                *a = match z {
                    Some(z) => _mm512_add_ps(
                        _mm512_maskz_loadu_ps(m, z.as_ptr().add((ox + p) * c + cb)),
                        b,
                    ),
                    None => _mm512_add_ps(_mm512_setzero_ps(), b),
                };
            }
            for (r, ky) in (ky0..ky1).enumerate() {
                let row = rows[r].as_ptr().add(cb);
                for kx in 0..kw {
                    let wv = _mm512_maskz_loadu_ps(m, wp.add((ky * kw + kx) * c + cb));
                    let ix0 = (ox * s1 + kx * d1) as isize - p1;
                    if inside {
                        let at = row.offset(ix0 * c as isize);
                        for (p, a) in acc.iter_mut().enumerate().take(np) {
                            let xv = _mm512_maskz_loadu_ps(m, at.add(p * s1 * c));
                            *a = _mm512_fmadd_ps(wv, xv, *a);
                        }
                    } else {
                        for (p, a) in acc.iter_mut().enumerate().take(np) {
                            let ix = ix0 + (p * s1) as isize;
                            if ix < 0 || ix as usize >= iw {
                                continue;
                            }
                            let xv = _mm512_maskz_loadu_ps(m, row.add(ix as usize * c));
                            *a = _mm512_fmadd_ps(wv, xv, *a);
                        }
                    }
                }
            }
            for (p, a) in acc.iter().enumerate().take(np) {
                _mm512_mask_storeu_ps(op.add((ox + p) * c + cb), m, act_avx512(act, *a));
            }
        };
        let mask = |cb: usize| -> __mmask16 {
            let left = c - cb;
            if left >= 16 {
                0xffff
            } else {
                (1u16 << left) - 1
            }
        };
        let mut ox = lo;
        // Three taps a row, stride 1 or 2, no dilation (MobileNet's layers): runs of WIDE
        // pixels with each input vector loaded once for all the taps that read it.
        if kw == 3 && d1 == 1 && (s1 == 1 || s1 == 2) {
            while ox + WIDE <= hi {
                for cb in (0..c).step_by(16) {
                    let run = Run {
                        ox,
                        cb,
                        m: mask(cb),
                    };
                    if s1 == 1 {
                        wide3::<1>(taps, w, g, bias, z, act, o, run);
                    } else {
                        wide3::<2>(taps, w, g, bias, z, act, o, run);
                    }
                }
                ox += WIDE;
            }
        }
        while ox + GROUP <= hi {
            for cb in (0..c).step_by(16) {
                block(ox, GROUP, cb, mask(cb), true);
            }
            ox += GROUP;
        }
        for ox in (0..lo).chain(ox..ow) {
            let inside = ox >= lo && ox < hi;
            for cb in (0..c).step_by(16) {
                block(ox, 1, cb, mask(cb), inside);
            }
        }
    }

    /// Pixels computed together by [`wide3`].
    const WIDE: usize = 8;

    /// Where a run of [`wide3`] lies: output pixels `ox..ox + WIDE`, channels `cb..` under `m`.
    #[derive(Clone, Copy)]
    struct Run {
        ox: usize,
        cb: usize,
        m: __mmask16,
    }

    /// [`WIDE`] pixels of output row `oy` inside the input (every tap in it), a filter three
    /// taps wide at stride `S` (1 or 2), no dilation: per filter row, the `(WIDE - 1) * S + 3`
    /// input vectors the run reads are loaded once and each feeds every tap that reads it; the
    /// sums in [`row_avx512`]'s order (so the same bits).
    ///
    /// # Safety
    /// As [`row_avx512`], with `g.kernel[1] == 3`, `g.dilation[1] == 1`, `g.stride[1] == S`
    /// and the run's pixels inside the row's interior ([`inner_cols`]).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn wide3<const S: usize>(
        taps: Taps,
        w: &[f32],
        g: &Geometry,
        bias: Option<&[f32]>,
        z: Option<&[f32]>,
        act: Act,
        o: &mut [MaybeUninit<f32>],
        Run { ox, cb, m }: Run,
    ) {
        let c = g.channels;
        let Taps { ky0, rows } = taps;
        let ky1 = ky0 + rows.len();
        let (wp, op) = (w.as_ptr(), o.as_mut_ptr() as *mut f32);
        let mut acc = [_mm512_setzero_ps(); WIDE];
        // SAFETY (all pointer reads and writes below): channels under the mask, pixels inside
        // the output row, input columns inside the row's interior (caller's contract), whole
        // input rows from `taps`.
        unsafe {
            let b = match bias {
                Some(b) => _mm512_maskz_loadu_ps(m, b.as_ptr().add(cb)),
                None => _mm512_setzero_ps(),
            };
            for (p, a) in acc.iter_mut().enumerate() {
                *a = match z {
                    Some(z) => _mm512_add_ps(
                        _mm512_maskz_loadu_ps(m, z.as_ptr().add((ox + p) * c + cb)),
                        b,
                    ),
                    None => _mm512_add_ps(_mm512_setzero_ps(), b),
                };
            }
            for (r, ky) in (ky0..ky1).enumerate() {
                let at = rows[r].as_ptr().add(cb + (ox * S - g.pad[1]) * c);
                let wt: [__m512; 3] = core::array::from_fn(|kx| {
                    _mm512_maskz_loadu_ps(m, wp.add((ky * 3 + kx) * c + cb))
                });
                let mut xs = [_mm512_setzero_ps(); (WIDE - 1) * 2 + 3];
                for (j, v) in xs.iter_mut().enumerate().take((WIDE - 1) * S + 3) {
                    *v = _mm512_maskz_loadu_ps(m, at.add(j * c));
                }
                for (p, a) in acc.iter_mut().enumerate() {
                    for (kx, &wv) in wt.iter().enumerate() {
                        *a = _mm512_fmadd_ps(wv, xs[p * S + kx], *a);
                    }
                }
            }
            for (p, a) in acc.iter().enumerate() {
                _mm512_mask_storeu_ps(op.add((ox + p) * c + cb), m, act_avx512(act, *a));
            }
        }
    }

    /// [`row_avx512`] on AVX2 and FMA: 8 channels a vector, whole vectors loaded and stored
    /// plainly, the channels past the last whole one through lane masks; [`WIDE`] pixels at a
    /// time where every tap of theirs is inside the input. Each output summed in
    /// [`row_avx512`]'s order (so the same bits).
    ///
    /// # Safety
    /// AVX2 and FMA must be supported; the buffers as for [`row_avx512`].
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn row_avx2(
        taps: Taps,
        w: &[f32],
        g: &Geometry,
        bias: Option<&[f32]>,
        z: Option<&[f32]>,
        act: Act,
        o: &mut [MaybeUninit<f32>],
    ) {
        let (c, ow) = (g.channels, g.output[1]);
        let (lo, hi) = inner_cols(g);
        let whole = c / 8 * 8;
        let tail = first_lanes(c - whole);
        let k = Kernel {
            taps,
            w,
            g,
            bias,
            z,
            act,
        };
        // SAFETY (every call below): forwarded; channels cb..cb + 8 lie below `whole` for the
        // whole-vector calls, the tail's under its mask; pixels ox..ox + NP lie in the row,
        // inside [lo, hi) where INSIDE is set.
        unsafe {
            let mut ox = lo;
            let (kw, s1, d1) = (g.kernel[1], g.stride[1], g.dilation[1]);
            let three = kw == 3 && d1 == 1 && (s1 == 1 || s1 == 2);
            while ox + WIDE <= hi {
                for cb in (0..whole).step_by(8) {
                    match (three, s1) {
                        (true, 1) => wide3_avx2::<1, true>(&k, o, ox, cb, tail),
                        (true, _) => wide3_avx2::<2, true>(&k, o, ox, cb, tail),
                        _ => pixels_avx2::<WIDE, true, true>(&k, o, ox, cb, tail),
                    }
                }
                if whole < c {
                    match (three, s1) {
                        (true, 1) => wide3_avx2::<1, false>(&k, o, ox, whole, tail),
                        (true, _) => wide3_avx2::<2, false>(&k, o, ox, whole, tail),
                        _ => pixels_avx2::<WIDE, false, true>(&k, o, ox, whole, tail),
                    }
                }
                ox += WIDE;
            }
            if ox + GROUP <= hi {
                for cb in (0..whole).step_by(8) {
                    pixels_avx2::<GROUP, true, true>(&k, o, ox, cb, tail);
                }
                if whole < c {
                    pixels_avx2::<GROUP, false, true>(&k, o, ox, whole, tail);
                }
                ox += GROUP;
            }
            for ox in (0..lo).chain(ox..ow) {
                let inside = ox >= lo && ox < hi;
                for cb in (0..whole).step_by(8) {
                    if inside {
                        pixels_avx2::<1, true, true>(&k, o, ox, cb, tail);
                    } else {
                        pixels_avx2::<1, true, false>(&k, o, ox, cb, tail);
                    }
                }
                if whole < c {
                    pixels_avx2::<1, false, false>(&k, o, ox, whole, tail);
                }
            }
        }
    }

    /// [`WIDE`] pixels from `ox` of the row's interior, channels `cb..cb + 8` (`FULL`) or those
    /// under `m`, for a filter three taps wide at stride `S` (1 or 2), no dilation: per filter
    /// row, the input vectors the run reads are loaded once each (one more at the end at
    /// stride 2) and feed every tap that reads them (a pixel's taps still in order, so
    /// [`pixels_avx2`]'s sums and bits).
    ///
    /// # Safety
    /// As [`pixels_avx2`] with `INSIDE`, and `g.kernel[1] == 3`, `g.dilation[1] == 1`,
    /// `g.stride[1] == S`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn wide3_avx2<const S: usize, const FULL: bool>(
        k: &Kernel,
        o: &mut [MaybeUninit<f32>],
        ox: usize,
        cb: usize,
        m: __m256i,
    ) {
        let g = k.g;
        let c = g.channels;
        let Taps { ky0, rows } = k.taps;
        let wp = k.w.as_ptr();
        // SAFETY (all pointer reads and writes below): channels cb..cb + 8 inside the row (or
        // under the mask); the run's pixels and every tap of theirs inside the row's interior
        // (the caller's contract).
        unsafe {
            let ld = |p: *const f32| load8::<FULL>(p, m);
            let mut acc = start8::<WIDE, FULL>(k, ox, cb, m);
            for (r, row) in rows.iter().enumerate() {
                let at = row.as_ptr().add(cb + (ox * S - g.pad[1]) * c);
                let wt: [__m256; 3] =
                    core::array::from_fn(|kx| ld(wp.add(((ky0 + r) * 3 + kx) * c + cb)));
                // Pixel p reads input columns p S .. p S + 3; the last of them is the next
                // pixel's first at stride 2, and the last two its first two at stride 1.
                let mut x0 = ld(at);
                let mut x1 = ld(at.add(c));
                for (p, a) in acc.iter_mut().enumerate() {
                    let x2 = ld(at.add((p * S + 2) * c));
                    *a = _mm256_fmadd_ps(wt[0], x0, *a);
                    *a = _mm256_fmadd_ps(wt[1], x1, *a);
                    *a = _mm256_fmadd_ps(wt[2], x2, *a);
                    if S == 1 {
                        (x0, x1) = (x1, x2);
                    } else {
                        x0 = x2;
                        x1 = ld(at.add((p * S + 3) * c));
                    }
                }
            }
            store8::<WIDE, FULL>(k, &acc, o, ox, cb, m);
        }
    }

    /// What [`pixels_avx2`] reads besides its place: [`row_avx2`]'s arguments.
    struct Kernel<'a> {
        taps: Taps<'a>,
        w: &'a [f32],
        g: &'a Geometry,
        bias: Option<&'a [f32]>,
        z: Option<&'a [f32]>,
        act: Act,
    }

    /// Output pixels `ox..ox + NP` of the row, channels `cb..cb + 8` (`FULL`) or those of them
    /// under `m`; `INSIDE`: every tap of these pixels is inside the input (else taps outside
    /// are skipped). Per filter row and tap, one weight vector for the NP pixels' inputs.
    ///
    /// # Safety
    /// As [`row_avx2`]; the channels and pixels inside the row, and inside its interior
    /// ([`inner_cols`]) when `INSIDE`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn pixels_avx2<const NP: usize, const FULL: bool, const INSIDE: bool>(
        k: &Kernel,
        o: &mut [MaybeUninit<f32>],
        ox: usize,
        cb: usize,
        m: __m256i,
    ) {
        let g = k.g;
        let (c, iw, [_, kw]) = (g.channels, g.input[1], g.kernel);
        let Taps { ky0, rows } = k.taps;
        let (s1, d1, p1) = (g.stride[1], g.dilation[1], g.pad[1] as isize);
        let wp = k.w.as_ptr();
        // SAFETY (all pointer reads and writes below): channels cb..cb + 8 inside the row (or
        // under the mask), pixels and taps as the caller's contract says (taps outside the
        // input skipped unless INSIDE).
        unsafe {
            let ld = |p: *const f32| load8::<FULL>(p, m);
            let mut acc = start8::<NP, FULL>(k, ox, cb, m);
            for (r, row) in rows.iter().enumerate() {
                let row = row.as_ptr().add(cb);
                for kx in 0..kw {
                    let wv = ld(wp.add(((ky0 + r) * kw + kx) * c + cb));
                    let ix0 = (ox * s1 + kx * d1) as isize - p1;
                    for (p, a) in acc.iter_mut().enumerate() {
                        let ix = ix0 + (p * s1) as isize;
                        if !INSIDE && (ix < 0 || ix as usize >= iw) {
                            continue;
                        }
                        *a = _mm256_fmadd_ps(wv, ld(row.offset(ix * c as isize)), *a);
                    }
                }
            }
            store8::<NP, FULL>(k, &acc, o, ox, cb, m);
        }
    }

    /// The starting sums of pixels `ox..ox + NP`, channels `cb..cb + 8` (`FULL`) or those under
    /// `m`: the residual (when given) plus the bias (when given), as [`row_avx512`] starts.
    ///
    /// # Safety
    /// As [`pixels_avx2`]: the channels and pixels inside the output row.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn start8<const NP: usize, const FULL: bool>(
        k: &Kernel,
        ox: usize,
        cb: usize,
        m: __m256i,
    ) -> [__m256; NP] {
        let c = k.g.channels;
        // SAFETY: the bias's channels and the residual's pixels and channels lie in them (the
        // caller's contract).
        unsafe {
            let b = match k.bias {
                Some(b) => load8::<FULL>(b.as_ptr().add(cb), m),
                None => _mm256_setzero_ps(),
            };
            core::array::from_fn(|p| match k.z {
                Some(z) => _mm256_add_ps(load8::<FULL>(z.as_ptr().add((ox + p) * c + cb), m), b),
                None => _mm256_add_ps(_mm256_setzero_ps(), b),
            })
        }
    }

    /// Stores the sums `acc` of pixels `ox..`, activated, at channels `cb..cb + 8` (`FULL`) or
    /// those under `m` of the output row `o`.
    ///
    /// # Safety
    /// As [`start8`], for the output row.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn store8<const NP: usize, const FULL: bool>(
        k: &Kernel,
        acc: &[__m256; NP],
        o: &mut [MaybeUninit<f32>],
        ox: usize,
        cb: usize,
        m: __m256i,
    ) {
        let (c, op) = (k.g.channels, o.as_mut_ptr() as *mut f32);
        for (p, a) in acc.iter().enumerate() {
            let y = act_avx2(k.act, *a);
            // SAFETY: pixel ox + p and the channels lie in the row (the caller's contract).
            unsafe {
                let dst = op.add((ox + p) * c + cb);
                if FULL {
                    _mm256_storeu_ps(dst, y)
                } else {
                    _mm256_maskstore_ps(dst, m, y)
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The expansion fused in front of the depthwise convolution gives the same bits as the
    /// product over every pixel followed by the depthwise convolution, for every kernel family
    /// and 1-3 threads, on fresh random shapes (kernels 1-4, strides 1-3, dilations 1-2,
    /// padding, 1-2 images, expansion biases and activations, a packed or plain W). The output
    /// starts as NaN, so an element left unwritten fails (NaN never equals).
    #[test]
    fn expanded_rows_made_on_the_way_give_the_same_bits() {
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for case in 0..40 {
            let (cin, c) = (rng.gen_range(1..20), rng.gen_range(1..40));
            let k = [rng.gen_range(1..5), [3, rng.gen_range(1..5)][case % 2]];
            let s = [rng.gen_range(1..4), rng.gen_range(1..3)];
            let d = [rng.gen_range(1..3), 1];
            let pad = [rng.gen_range(0..3), rng.gen_range(0..3)];
            let input = [rng.gen_range(1..14), rng.gen_range(1..40)];
            let Some(g) = Geometry::fitting(input, c, k, s, d, pad, pad) else {
                continue;
            };
            let (output, n) = (g.output, rng.gen_range(1..3));
            let mut rand_vec = |len: usize| -> Vec<f32> {
                (0..len).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
            };
            let x = rand_vec(n * input[0] * input[1] * cin);
            let we = rand_vec(cin * c);
            let (be, w, b) = (rand_vec(c), rand_vec(k[0] * k[1] * c), rand_vec(c));
            let z = rand_vec(n * output[0] * output[1] * c);
            let packed = gemm::PackedB::new(cin, c, gemm::Mat::row_major(&we, c));
            let e = Expand {
                cin,
                w: if case % 3 == 0 {
                    gemm::Rhs::Mat(gemm::Mat::row_major(&we, c))
                } else {
                    gemm::Rhs::Packed(&packed)
                },
                bias: (case % 4 != 0).then_some(&be[..]),
                act: [Act::Identity, Act::Relu, Act::Clip { lo: 0.0, hi: 6.0 }][case % 3],
            };
            let fin = Finish {
                bias: (case % 2 == 0).then_some(&b[..]),
                residual: (case % 5 == 0).then_some(&z[..]),
                act: [Act::Relu, Act::Identity][case % 2],
            };
            let pixels = n * input[0] * input[1];
            for isa in gemm::available_isas() {
                let mut mid = vec![0f32; pixels * c];
                let epi = gemm::Epilogue {
                    bias: e.bias.map_or(gemm::Bias::None, gemm::Bias::Col),
                    act: e.act,
                    residual: None,
                };
                let lhs = gemm::Lhs::Mat(gemm::Mat::row_major(&x, cin));
                gemm::gemm_ex_with(
                    isa, 1, pixels, c, cin, 1.0, lhs, e.w, 0.0, &mut mid, c, &epi,
                );
                let mut want = vec![MaybeUninit::new(f32::NAN); n * output[0] * output[1] * c];
                depthwise_nhwc_with(isa, 1, &mid, &w, n, &g, &fin, &mut want);
                for threads in 1..4 {
                    let mut out = vec![MaybeUninit::new(f32::NAN); want.len()];
                    expand_depthwise_nhwc_with(isa, threads, &x, &e, &w, n, &g, &fin, &mut out);
                    for (i, (o, w)) in out.iter().zip(&want).enumerate() {
                        // SAFETY: both initialised above (NaN), then overwritten by the kernels.
                        let (got, exp) = unsafe { (o.assume_init(), w.assume_init()) };
                        assert!(
                            got.to_bits() == exp.to_bits() && !got.is_nan(),
                            "seed {seed} case {case} {isa:?} {threads}t {g:?} n {n} cin {cin} at {i}: {got} vs {exp}"
                        );
                    }
                }
            }
        }
    }

    /// Every kernel family against the f64 reference on fresh random shapes: channels below,
    /// at and past whole vectors, kernels 1-5, strides 1-3, dilations 1-2, paddings 0-3 on
    /// either side, batches 1-2, bias / residual / each vector activation, 1-3 threads. Bound:
    /// 4e-6 x (the sum of the products' magnitudes + 1e-3), 1.5x after an activation (which
    /// moves no value further from the reference); the output starts as NaN, so an element
    /// left unwritten fails. Every family and thread count gives the same bits.
    #[test]
    fn matches_the_f64_reference() {
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for case in 0..60 {
            let c = rng.gen_range(1..40);
            let k = [rng.gen_range(1..6), rng.gen_range(1..6)];
            let s = [rng.gen_range(1..4), rng.gen_range(1..4)];
            let d = [rng.gen_range(1..3), rng.gen_range(1..3)];
            let pad = [rng.gen_range(0..4), rng.gen_range(0..4)];
            let pad_end = [rng.gen_range(0..4), rng.gen_range(0..4)];
            // Some rows wide enough for runs of 8 pixels at stride 2; a third of the filters
            // three taps wide with no dilation (the kernels' special case).
            let input = [rng.gen_range(1..20), rng.gen_range(1..[30, 60][case % 2])];
            let (k, d) = if case % 3 == 0 {
                ([k[0], 3], [d[0], 1])
            } else {
                (k, d)
            };
            let Some(g) = Geometry::fitting(input, c, k, s, d, pad, pad_end) else {
                continue;
            };
            let (output, n) = (g.output, rng.gen_range(1..3));
            let mut rand_vec = |len: usize| -> Vec<f32> {
                (0..len).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
            };
            let x = rand_vec(n * input[0] * input[1] * c);
            let w = rand_vec(k[0] * k[1] * c);
            let bias = rand_vec(c);
            let z = rand_vec(n * output[0] * output[1] * c);
            let act = match case % 4 {
                0 => Act::Identity,
                1 => Act::Relu,
                2 => Act::Clip { lo: -0.5, hi: 0.7 },
                _ => Act::LeakyRelu(0.1),
            };
            let fin = Finish {
                bias: (case % 3 != 0).then_some(&bias[..]),
                residual: (case % 2 == 0).then_some(&z[..]),
                act,
            };
            let want = depthwise_nhwc_ref(
                &x,
                &w,
                n,
                &g,
                &Finish {
                    act: Act::Identity,
                    ..fin
                },
            );
            // The sum of the magnitudes of each output's terms.
            let mag = depthwise_nhwc_ref(
                &x.iter().map(|v| v.abs()).collect::<Vec<_>>(),
                &w.iter().map(|v| v.abs()).collect::<Vec<_>>(),
                n,
                &g,
                &Finish {
                    bias: None,
                    residual: None,
                    act: Act::Identity,
                },
            );
            let mut first: Option<Vec<u32>> = None;
            for isa in gemm::available_isas() {
                for threads in 1..4 {
                    let mut out = vec![MaybeUninit::new(f32::NAN); want.len()];
                    depthwise_nhwc_with(isa, threads, &x, &w, n, &g, &fin, &mut out);
                    // Every family and thread count sums in the same order: the same bits.
                    // SAFETY: initialised above (NaN), then overwritten by the kernel.
                    let bits: Vec<u32> = out
                        .iter()
                        .map(|o| unsafe { o.assume_init() }.to_bits())
                        .collect();
                    match &first {
                        None => first = Some(bits),
                        Some(f) => assert!(
                            *f == bits,
                            "seed {seed} case {case} {isa:?} {threads}t {g:?}: bits differ from the first run"
                        ),
                    }
                    for (i, o) in out.iter().enumerate() {
                        // SAFETY: initialised above (NaN), then overwritten by the kernel.
                        let got = unsafe { o.assume_init() } as f64;
                        let ch = i % c;
                        let extra = fin.bias.map_or(0.0, |b| b[ch].abs() as f64)
                            + fin.residual.map_or(0.0, |z| z[i].abs() as f64);
                        let mut tol = 4e-6 * (mag[i] + extra + 1e-3);
                        if act != Act::Identity {
                            tol *= 1.5;
                        }
                        let exp = act.apply(want[i] as f32) as f64;
                        assert!(
                            (got - exp).abs() <= tol,
                            "seed {seed} case {case} {isa:?} {threads}t {g:?} n {n} at {i}: {got} vs {exp} (tol {tol})"
                        );
                    }
                }
            }
        }
    }
}
