//! Dense convolution on channels-last tensors with few input channels (a network's first
//! layer, over an image's 3 channels), computed directly.
//!
//! Input `[n, ih, iw, cin]`, filter `[kh * kw * cin, cout]` (rows in (ky, kx, ci) order), output
//! `[n, oh, ow, cout]`: `act(residual + bias + sum over the taps inside the input of
//! x[.., ci] * w[tap, ci, ..])`. Through a patch matrix, such a layer's GEMM has `kh * kw * cin`
//! (27) columns, so packing the patches costs as much as the products; here each input value is
//! broadcast once per pixel and tap against the output channels' weights (up to 64 output
//! channels, four pixels at a time in registers; on AVX2, up to 32 output channels in 8-lane
//! vectors). AVX-512 and AVX2 + FMA (the portable tier takes the patch matrix and the GEMM:
//! [`worthwhile`]); [`dense_nhwc_ref`] is the f64 reference. Every tier sums each output in the
//! same order, so they give the same bits.

use std::mem::MaybeUninit;
use std::ops::Range;

use crate::depthwise::{for_each_row, Finish, Geometry};
use crate::gemm::{self, Isa};
use crate::pool;

/// Input channels up to which [`dense_nhwc`] is used for a dense channels-last convolution.
pub const MAX_CIN: usize = 4;

/// True when [`dense_nhwc`] runs on this CPU for `cin` input channels.
pub fn worthwhile(cin: usize) -> bool {
    cin <= MAX_CIN
        && matches!(gemm::isa(), Isa::Avx512 | Isa::Avx2)
        && std::env::var_os("FERRUM_NO_DIRECT").is_none()
}

/// The convolution of `n` images (see the module's documentation; `g.channels` is `cin`) into
/// `out` (`n * oh * ow * cout`, every element written). Panics when a buffer is too short, the
/// activation is not a vector one, or the CPU has neither AVX-512 nor AVX2 and FMA.
pub fn dense_nhwc(
    x: &[f32],
    w: &[f32],
    cout: usize,
    n: usize,
    g: &Geometry,
    fin: &Finish,
    out: &mut [MaybeUninit<f32>],
) {
    dense_with(pool::threads(), Input::Nhwc, x, w, cout, n, g, fin, out)
}

/// How the input images lie in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Input {
    /// `[n, ih, iw, cin]`.
    Nhwc,
    /// `[n, cin, ih, iw]` (planes: an image as it enters a network), read where it lies: the
    /// same products in the same order as over its channels-last copy.
    Nchw,
}

/// [`dense_nhwc`] with at most `threads` tasks at a time, over input images laid out as
/// `input` says (the output channels-last).
#[allow(clippy::too_many_arguments)]
pub fn dense_with(
    threads: usize,
    input: Input,
    x: &[f32],
    w: &[f32],
    cout: usize,
    n: usize,
    g: &Geometry,
    fin: &Finish,
    out: &mut [MaybeUninit<f32>],
) {
    dense_with_isa(gemm::isa(), threads, input, x, w, cout, n, g, fin, out)
}

/// [`dense_with`] by a chosen kernel family: [`Isa::Avx512`] or [`Isa::Avx2`] (panics for
/// others, or when this CPU lacks it).
#[allow(clippy::too_many_arguments)]
pub fn dense_with_isa(
    isa: Isa,
    threads: usize,
    input: Input,
    x: &[f32],
    w: &[f32],
    cout: usize,
    n: usize,
    g: &Geometry,
    fin: &Finish,
    out: &mut [MaybeUninit<f32>],
) {
    assert_runs(isa);
    let wlen = g.kernel[0] * g.kernel[1] * g.channels * cout;
    let st = strides(input, g);
    for_each_row(
        "direct",
        threads,
        x,
        (w, wlen),
        cout,
        n,
        g,
        fin,
        out,
        |img, oy, z, o| {
            // SAFETY: the ISA is supported (asserted above); `img` is one image, `w` the
            // filter, `z` and `o` one output row, the bias `cout` values (lengths checked by
            // `for_each_row`).
            unsafe { conv_row(isa, img, st, w, cout, g, oy, fin, z, o) }
        },
    );
}

/// Output row `oy` of one image (every pixel and output channel, channels-last) by the kernel
/// family `isa`.
///
/// # Safety
/// `isa` is [`Isa::Avx512`] or [`Isa::Avx2`] and this CPU runs it; `img` holds one image laid
/// out as `st` says, `w` the whole filter, `fin`'s bias (when given) `cout` values, `z` (when
/// given) and `o` `ow * cout`.
#[allow(clippy::too_many_arguments)]
unsafe fn conv_row(
    isa: Isa,
    img: &[f32],
    st: Strides,
    w: &[f32],
    cout: usize,
    g: &Geometry,
    oy: usize,
    fin: &Finish,
    z: Option<&[f32]>,
    o: &mut [MaybeUninit<f32>],
) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: forwarded from the caller.
    unsafe {
        match isa {
            Isa::Avx512 => x86::row(img, st, w, cout, g, oy, fin.bias, z, fin.act, o),
            _ => x86::avx2::row(img, st, w, cout, g, oy, fin.bias, z, fin.act, o),
        }
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (isa, img, st, w, cout, g, oy, fin, z, o);
}

/// Panics unless `isa` is a family the direct kernels have ([`Isa::Avx512`] or [`Isa::Avx2`])
/// and this CPU runs it.
fn assert_runs(isa: Isa) {
    assert!(
        matches!(isa, Isa::Avx512 | Isa::Avx2) && gemm::isa_available(isa),
        "direct: needs AVX-512 or AVX2 and FMA ({isa:?} asked for)"
    );
}

/// Where the elements of an image laid out as `input` says lie.
fn strides(input: Input, g: &Geometry) -> Strides {
    let ([ih, iw], cin) = (g.input, g.channels);
    match input {
        Input::Nhwc => Strides {
            row: iw * cin,
            pixel: cin,
            channel: 1,
        },
        Input::Nchw => Strides {
            row: iw,
            pixel: 1,
            channel: ih * iw,
        },
    }
}

/// A 2-D max pool over a convolution's output (no dilation): window, stride, leading padding
/// and output size, each as (rows, columns). Windows may reach past the convolution's output
/// (padding, or a ceil-mode last window); what lies outside never wins.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MaxPool {
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub pad: [usize; 2],
    pub output: [usize; 2],
}

/// [`dense_with_isa`] (its bias and activation; no residual) followed by the max pool `p` of
/// its output, written as planes: `out` is `[n, cout, ph, pw]`, every element written. Each
/// thread makes the convolution's rows as its pooled rows need them (a ring of `p.kernel[0]`
/// rows, in cache) and pools them there, so the convolution's output never travels to memory
/// and back (a network's stem: ResNet's 7x7 convolution to 64 x 112 x 112 then its 3x3 stride-2
/// max pool). A pooled value is the first largest of its window in row-major order, or its
/// first NaN (ONNX MaxPool's result on the convolution's output, bit for bit; see
/// [`max_pool_ref`]); a window with nothing inside gives -inf.
#[allow(clippy::too_many_arguments)]
pub fn dense_max_pool_with_isa(
    isa: Isa,
    threads: usize,
    input: Input,
    x: &[f32],
    w: &[f32],
    cout: usize,
    n: usize,
    g: &Geometry,
    fin: &Finish,
    p: &MaxPool,
    out: &mut [MaybeUninit<f32>],
) {
    assert_runs(isa);
    let ([ih, iw], cin, [kh, kw]) = (g.input, g.channels, g.kernel);
    let [oh, ow] = g.output;
    let ([pkh, pkw], [psh, psw], [pph, ppw], [ph, pw]) = (p.kernel, p.stride, p.pad, p.output);
    assert!(
        g.stride.iter().chain(&g.dilation).all(|&v| v > 0)
            && kh > 0
            && kw > 0
            && pkh > 0
            && pkw > 0
            && psh > 0
            && psw > 0,
        "direct: zero stride, dilation or kernel in {g:?} or {p:?}"
    );
    assert!(
        x.len() >= n * ih * iw * cin
            && w.len() >= kh * kw * cin * cout
            && out.len() >= n * cout * ph * pw,
        "direct: buffers too short for {n} images of {g:?} -> {cout}, pooled by {p:?}"
    );
    assert!(
        fin.residual.is_none(),
        "direct: a pooled convolution takes no residual"
    );
    assert!(
        fin.bias.is_none_or(|b| b.len() >= cout) && fin.act.is_vector(),
        "direct: short bias or {:?} not a vector activation",
        fin.act
    );
    let (rows, len, plane) = (n * ph, ow * cout, ph * pw);
    if rows * pw * cout == 0 {
        return;
    }
    let st = strides(input, g);
    let isz = ih * iw * cin;
    let base = OutPtr(out.as_mut_ptr());
    // Pooled rows r0..r1 (of all images, image-major): the convolution's rows each needs,
    // made into a ring once each, then pooled and turned into planes.
    let hlen = pw * cout;
    // Pooled rows r0..r1 (of all images, image-major): each convolution row one of them needs
    // is made once, into `conv`, and pooled across its windows' columns into a ring of such
    // rows (`hring`, `p.kernel[0]` of them); a pooled row is then the maximum down its
    // window's rows of the ring, turned into planes as it is written. The maximum taken
    // across the columns first and then down the rows is the row-major one: the combination
    // (first largest, or first NaN, wins) is associative.
    let run = |r0: usize, r1: usize| {
        let slots = pkh.min(oh).max(1);
        let mut conv = vec![0f32; len];
        let mut hring = vec![0f32; slots * hlen];
        // Whether each ring row holds a NaN.
        let mut nans = vec![false; slots];
        let mut pooled = vec![0f32; hlen];
        // The next convolution row to make, per image.
        let mut next = (usize::MAX, 0usize);
        for r in r0..r1 {
            let (b, py) = (r / ph, r % ph);
            if next.0 != b {
                next = (b, 0);
            }
            let top = (py * psh) as isize - pph as isize;
            let lo = top.clamp(0, oh as isize) as usize;
            let hi = (top + pkh as isize).clamp(0, oh as isize) as usize;
            next.1 = next.1.max(lo);
            let img = &x[b * isz..][..isz];
            while next.1 < hi {
                // SAFETY: a float slice viewed as possibly-uninitialised floats (same layout;
                // the kernel writes only floats). The ISA was asserted, `img` is one image,
                // the bias checked, `conv` one output row.
                unsafe {
                    let row =
                        &mut *(conv.as_mut_slice() as *mut [f32] as *mut [MaybeUninit<f32>]);
                    conv_row(isa, img, st, w, cout, g, next.1, fin, None, row);
                }
                let slot = next.1 % slots;
                nans[slot] = pool_cols(
                    isa,
                    &conv,
                    cout,
                    ow,
                    (pkw, psw, ppw),
                    &mut hring[slot * hlen..][..hlen],
                );
                next.1 += 1;
            }
            let nan = (lo..hi).any(|cy| nans[cy % slots]);
            pool_down(isa, &hring, hlen, (lo..hi, slots), nan, &mut pooled);
            // SAFETY: pooled row (b, py) of each channel lies inside `out` (length checked
            // above) and belongs to this task alone (tasks take disjoint pooled rows); `isa`
            // was asserted.
            unsafe {
                to_planes(
                    isa,
                    &pooled,
                    cout,
                    pw,
                    base.get().add(b * cout * plane + py * pw).cast::<f32>(),
                    plane,
                )
            };
        }
    };
    if threads <= 1 {
        run(0, rows);
    } else {
        let per = rows.div_ceil(2 * threads).max(1);
        pool::parallel_for(rows.div_ceil(per), |t| {
            run(t * per, ((t + 1) * per).min(rows))
        });
    }
}

/// `dst[c * plane + px] = src[px * cout + c]` for `px < pw`, `c < cout`: a pooled row
/// (channels-last) written into its planes.
///
/// # Safety
/// `src` holds `pw * cout` values, `dst + c * plane` addresses `pw` writable floats for every
/// `c < cout`, and this CPU runs `isa`.
unsafe fn to_planes(isa: Isa, src: &[f32], cout: usize, pw: usize, dst: *mut f32, plane: usize) {
    let (mut p0, mut c0) = (0, 0);
    #[cfg(target_arch = "x86_64")]
    if isa == Isa::Avx512 {
        // SAFETY: forwarded; whole 16 x 16 blocks inside both.
        unsafe { x86::to_planes(src, cout, pw, dst, plane) };
        (p0, c0) = (pw / 16 * 16, cout / 16 * 16);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    // What the blocks left: the last pixels of every channel, the last channels of the rest.
    for c in 0..cout {
        let from = if c < c0 { p0 } else { 0 };
        for px in from..pw {
            // SAFETY: c < cout and px < pw (the caller's contract).
            unsafe { *dst.add(c * plane + px) = src[px * cout + c] };
        }
    }
}

/// The start of an output that tasks write disjoint parts of.
#[derive(Clone, Copy)]
struct OutPtr(*mut MaybeUninit<f32>);
// SAFETY: each task writes only its own elements, and the output stays borrowed until every
// task has finished.
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}

impl OutPtr {
    fn get(self) -> *mut MaybeUninit<f32> {
        self.0
    }
}

/// The max pool's combination: `v` replaces `best` when larger, or when NaN and `best` is not
/// (so the first NaN, else the first largest value, in visiting order wins).
#[inline(always)]
pub fn pool_max(best: f32, v: f32) -> f32 {
    if v > best || (v.is_nan() && !best.is_nan()) {
        v
    } else {
        best
    }
}

/// [`pool_max`] for values that are not NaN: one vector `maxps` (which keeps `best` on ties,
/// as `pool_max` does).
#[inline(always)]
pub fn max_no_nan(best: f32, v: f32) -> f32 {
    if v > best {
        v
    } else {
        best
    }
}

/// `out[i]` = the combination `comb` of `term(0)[i]`, `term(1)[i]`, ... in that order (`count`
/// terms of at least `out.len()` values; -inf when there are none), up to three terms per pass
/// so that `out` is written, not read back and written again, for windows of up to 3 (a
/// vectorised read-modify-write of `out` becomes a masked store, which the next pass's load
/// waits on).
#[inline(always)]
fn comb_terms<'a>(
    out: &mut [f32],
    count: usize,
    term: impl Fn(usize) -> &'a [f32],
    comb: impl Fn(f32, f32) -> f32 + Copy,
) {
    let n = out.len();
    match count {
        0 => out.fill(f32::NEG_INFINITY),
        1 => out.copy_from_slice(&term(0)[..n]),
        2 => {
            let (a, b) = (&term(0)[..n], &term(1)[..n]);
            for ((o, &a), &b) in out.iter_mut().zip(a).zip(b) {
                *o = comb(a, b);
            }
        }
        _ => {
            let (a, b, c) = (&term(0)[..n], &term(1)[..n], &term(2)[..n]);
            for (((o, &a), &b), &c) in out.iter_mut().zip(a).zip(b).zip(c) {
                *o = comb(comb(a, b), c);
            }
            for t in 3..count {
                for (o, &v) in out.iter_mut().zip(&term(t)[..n]) {
                    *o = comb(*o, v);
                }
            }
        }
    }
}

/// `out[px]` (`cout` channels each) = the combination `comb` over the columns of `row` (`ow`
/// pixels of `cout` channels) that window `px` covers: `kw` wide at stride `sw` from `px * sw
/// - pad`, left to right (-inf when none lies inside).
#[inline(always)]
fn cols_body(
    row: &[f32],
    cout: usize,
    ow: usize,
    (kw, sw, pad): (usize, usize, usize),
    out: &mut [f32],
    comb: impl Fn(f32, f32) -> f32 + Copy,
) {
    for (px, best) in out.chunks_exact_mut(cout).enumerate() {
        let left = (px * sw) as isize - pad as isize;
        let c0 = left.clamp(0, ow as isize) as usize;
        let c1 = (left + kw as isize).clamp(0, ow as isize) as usize;
        comb_terms(best, c1 - c0, |j| &row[(c0 + j) * cout..], comb);
    }
}

/// `out` = the combination `comb` of convolution rows `rows` (row `r` in slot `r % slots` of
/// `ring`, `len` floats each) element by element, in order (-inf when there are none).
#[inline(always)]
fn down_body(
    ring: &[f32],
    len: usize,
    (rows, slots): (Range<usize>, usize),
    out: &mut [f32],
    comb: impl Fn(f32, f32) -> f32 + Copy,
) {
    let at = |j: usize| &ring[(rows.start + j) % slots * len..][..len];
    comb_terms(out, rows.len(), at, comb);
}

/// Defines `$name(isa, args..)`: `$body` (an `#[inline(always)]` function of the args)
/// compiled for the kernel family `isa` (its vectors), which the caller checked this CPU runs.
macro_rules! on_isa {
    ($(#[$doc:meta])* fn $name:ident$(<$lt:lifetime>)?($($a:ident: $t:ty),*) -> $r:ty = $body:ident) => {
        $(#[$doc])*
        fn $name$(<$lt>)?(isa: Isa, $($a: $t),*) -> $r {
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
                fn wide$(<$lt>)?($($a: $t),*) -> $r {
                    $body($($a),*)
                }
                #[target_feature(enable = "avx2,fma")]
                fn narrow$(<$lt>)?($($a: $t),*) -> $r {
                    $body($($a),*)
                }
                // SAFETY: the caller checked that this CPU runs `isa`.
                unsafe {
                    match isa {
                        Isa::Avx512 => wide($($a),*),
                        _ => narrow($($a),*),
                    }
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                let _ = isa;
                $body($($a),*)
            }
        }
    };
}

/// [`cols_body`] with the max pool's combination; returns whether `row` holds a NaN (without
/// one, the combination is one `maxps`).
#[inline(always)]
fn cols_pooled(
    row: &[f32],
    cout: usize,
    ow: usize,
    win: (usize, usize, usize),
    out: &mut [f32],
) -> bool {
    let nan = row.iter().fold(false, |a, v| a | v.is_nan());
    if nan {
        cols_body(row, cout, ow, win, out, pool_max);
    } else {
        cols_body(row, cout, ow, win, out, max_no_nan);
    }
    nan
}

/// [`down_body`] with the max pool's combination (`nan`: some row holds a NaN).
#[inline(always)]
fn down_pooled(ring: &[f32], len: usize, rows: (Range<usize>, usize), nan: bool, out: &mut [f32]) {
    if nan {
        down_body(ring, len, rows, out, pool_max);
    } else {
        down_body(ring, len, rows, out, max_no_nan);
    }
}

on_isa! {
    /// [`cols_pooled`] for the kernel family `isa`.
    fn pool_cols(
        row: &[f32],
        cout: usize,
        ow: usize,
        win: (usize, usize, usize),
        out: &mut [f32]
    ) -> bool = cols_pooled
}

on_isa! {
    /// [`down_pooled`] for the kernel family `isa`.
    fn pool_down(
        ring: &[f32],
        len: usize,
        rows: (Range<usize>, usize),
        nan: bool,
        out: &mut [f32]
    ) -> () = down_pooled
}

/// The reference max pool of channels-last convolution outputs (`[n, oh, ow, cout]`, as
/// [`dense_with`] writes them) into planes (`[n, cout, ph, pw]`): each window's first NaN in
/// row-major order, else its first largest value (-inf when nothing of it lies inside).
pub fn max_pool_ref(
    y: &[f32],
    cout: usize,
    n: usize,
    [oh, ow]: [usize; 2],
    p: &MaxPool,
) -> Vec<f32> {
    let [ph, pw] = p.output;
    let mut out = vec![f32::NEG_INFINITY; n * cout * ph * pw];
    for b in 0..n {
        for c in 0..cout {
            for py in 0..ph {
                for px in 0..pw {
                    // The window's first NaN, else its first largest value.
                    let (mut best, mut nan) = (f32::NEG_INFINITY, false);
                    for ky in 0..p.kernel[0] {
                        for kx in 0..p.kernel[1] {
                            let cy = (py * p.stride[0] + ky) as isize - p.pad[0] as isize;
                            let cx = (px * p.stride[1] + kx) as isize - p.pad[1] as isize;
                            if cy < 0 || cx < 0 || cy as usize >= oh || cx as usize >= ow {
                                continue;
                            }
                            let v = y[((b * oh + cy as usize) * ow + cx as usize) * cout + c];
                            if !nan && (v.is_nan() || v > best) {
                                (best, nan) = (v, v.is_nan());
                            }
                        }
                    }
                    out[((b * cout + c) * ph + py) * pw + px] = best;
                }
            }
        }
    }
    out
}

/// Where an image's elements lie: element (iy, ix, ci) at `iy * row + ix * pixel + ci * channel`.
#[derive(Clone, Copy, Debug)]
struct Strides {
    row: usize,
    pixel: usize,
    channel: usize,
}

/// The f64 reference of [`dense_nhwc`] (zero padding, every tap), before the activation and
/// rounding.
pub fn dense_nhwc_ref(
    x: &[f32],
    w: &[f32],
    cout: usize,
    n: usize,
    g: &Geometry,
    fin: &Finish,
) -> Vec<f64> {
    let ([ih, iw], cin, [kh, kw]) = (g.input, g.channels, g.kernel);
    let [oh, ow] = g.output;
    let mut out = vec![0f64; n * oh * ow * cout];
    for b in 0..n {
        for oy in 0..oh {
            for ox in 0..ow {
                for m in 0..cout {
                    let i = ((b * oh + oy) * ow + ox) * cout + m;
                    let mut a = fin.residual.map_or(0.0, |z| z[i] as f64)
                        + fin.bias.map_or(0.0, |v| v[m] as f64);
                    for ky in 0..kh {
                        for kx in 0..kw {
                            let iy = (oy * g.stride[0] + ky * g.dilation[0]) as isize
                                - g.pad[0] as isize;
                            let ix = (ox * g.stride[1] + kx * g.dilation[1]) as isize
                                - g.pad[1] as isize;
                            if iy < 0 || ix < 0 || iy as usize >= ih || ix as usize >= iw {
                                continue;
                            }
                            for ci in 0..cin {
                                let xv = x[((b * ih + iy as usize) * iw + ix as usize) * cin + ci];
                                a += xv as f64 * w[((ky * kw + kx) * cin + ci) * cout + m] as f64;
                            }
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

    use super::Strides;
    use crate::depthwise::Geometry;
    use crate::gemm::x86::act_avx512;
    use crate::gemm::Act;

    /// Pixels computed together near the row's edges (taps checked one by one).
    const P: usize = 4;
    /// Pixels computed together inside the row (no tap outside the input): with one or two
    /// vectors of output channels, 12 pixels (24 accumulators); with three or four, two runs of
    /// [`HALF`].
    const WIDE: usize = 12;
    const HALF: usize = WIDE / 2;

    /// One output row (every pixel and output channel).
    ///
    /// # Safety
    /// AVX-512F must be supported; `x` one image (`ih * iw * cin` values laid out as `st`
    /// says), `w` `kh * kw * cin * cout`
    /// values, `bias` (when given) `cout`, `z` (when given) and `o` `ow * cout`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn row(
        x: &[f32],
        st: Strides,
        w: &[f32],
        cout: usize,
        g: &Geometry,
        oy: usize,
        bias: Option<&[f32]>,
        z: Option<&[f32]>,
        act: Act,
        o: &mut [MaybeUninit<f32>],
    ) {
        let ow = g.output[1];
        // Output columns whose taps all lie inside the input row: [lo, hi).
        let (iw, sx, dx, px) = (g.input[1], g.stride[1], g.dilation[1], g.pad[1]);
        let span = (g.kernel[1] - 1) * dx;
        let lo = px.div_ceil(sx).min(ow);
        let hi = if iw + px > span {
            ((iw + px - span - 1) / sx + 1).clamp(lo, ow)
        } else {
            lo
        };
        let mut ox = 0;
        while ox < ow {
            if ox >= lo && ox + WIDE <= hi {
                let mut mb = 0;
                while mb < cout {
                    // SAFETY: forwarded; pixels ox..ox + WIDE are inside [lo, hi), so every
                    // tap of theirs lies inside the input row.
                    unsafe {
                        let left = cout - mb;
                        macro_rules! run {
                            ($v:literal, $q:expr) => {
                                for h in (0..WIDE).step_by($q) {
                                    let ox = ox + h;
                                    if left >= 16 * $v {
                                        wide::<$v, $q, true>(
                                            x, st, w, cout, g, oy, ox, mb, bias, z, act, o,
                                        )
                                    } else {
                                        wide::<$v, $q, false>(
                                            x, st, w, cout, g, oy, ox, mb, bias, z, act, o,
                                        )
                                    }
                                }
                            };
                        }
                        match left.div_ceil(16) {
                            1 => run!(1, WIDE),
                            2 => run!(2, WIDE),
                            3 => run!(3, HALF),
                            _ => run!(4, HALF),
                        }
                    }
                    mb += 64;
                }
                ox += WIDE;
                continue;
            }
            let np = P.min(ow - ox);
            let mut mb = 0;
            while mb < cout {
                let left = (cout - mb).div_ceil(16);
                // SAFETY: forwarded; the block covers pixels ox..ox + np and channels mb.. of
                // this row.
                unsafe {
                    match left {
                        1 => block::<1>(x, st, w, cout, g, oy, ox, np, mb, bias, z, act, o),
                        2 => block::<2>(x, st, w, cout, g, oy, ox, np, mb, bias, z, act, o),
                        3 => block::<3>(x, st, w, cout, g, oy, ox, np, mb, bias, z, act, o),
                        _ => block::<4>(x, st, w, cout, g, oy, ox, np, mb, bias, z, act, o),
                    }
                }
                mb += 64;
            }
            ox += np;
        }
    }

    /// Pixels `ox..ox + Q` of output row `oy`, all of whose taps lie inside the input row,
    /// output channels `mb..` in `V` vectors of 16 (masked past `cout`): per tap and input
    /// channel, the `V` weight vectors are loaded once and each pixel's input value broadcast
    /// against them.
    ///
    /// # Safety
    /// As [`row`]; pixels `ox..ox + Q` lie in the row's interior (every tap column inside
    /// the input).
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn wide<const V: usize, const Q: usize, const FULL: bool>(
        x: &[f32],
        st: Strides,
        w: &[f32],
        cout: usize,
        g: &Geometry,
        oy: usize,
        ox: usize,
        mb: usize,
        bias: Option<&[f32]>,
        z: Option<&[f32]>,
        act: Act,
        o: &mut [MaybeUninit<f32>],
    ) {
        let ([ih, _], cin, [kh, kw]) = (g.input, g.channels, g.kernel);
        let (xp, wp, op) = (x.as_ptr(), w.as_ptr(), o.as_mut_ptr() as *mut f32);
        let m = masks::<V>(cout, mb);
        let step = g.stride[1] * st.pixel;
        let mut acc = [[_mm512_setzero_ps(); V]; Q];
        // SAFETY (all pointer reads and writes below): channel offsets stay below `cout` under
        // the masks, pixel offsets below `ow`, input offsets inside the image (rows outside
        // are skipped; columns are inside by the caller's contract).
        unsafe {
            start(&mut acc, Q, &m, bias, z, ox, cout, mb);
            for ky in 0..kh {
                let iy = (oy * g.stride[0] + ky * g.dilation[0]) as isize - g.pad[0] as isize;
                if iy < 0 || iy as usize >= ih {
                    continue;
                }
                for kx in 0..kw {
                    let ix0 = ox * g.stride[1] + kx * g.dilation[1] - g.pad[1];
                    let src = xp.add(iy as usize * st.row + ix0 * st.pixel);
                    let wt = wp.add((ky * kw + kx) * cin * cout + mb);
                    for ci in 0..cin {
                        let src = src.add(ci * st.channel);
                        let mut wv = [_mm512_setzero_ps(); V];
                        for (v, x) in wv.iter_mut().enumerate() {
                            // Whole vectors load plainly (a masked load also takes a vector
                            // port from the multiply-adds).
                            *x = if FULL {
                                _mm512_loadu_ps(wt.add(ci * cout + 16 * v))
                            } else {
                                _mm512_maskz_loadu_ps(m[v], wt.add(ci * cout + 16 * v))
                            };
                        }
                        for (p, a) in acc.iter_mut().enumerate() {
                            let xv = _mm512_set1_ps(*src.add(p * step));
                            for v in 0..V {
                                a[v] = _mm512_fmadd_ps(wv[v], xv, a[v]);
                            }
                        }
                    }
                }
            }
            store(&acc, Q, &m, act, op, ox, cout, mb);
        }
    }

    /// The first `np` pixels' accumulators set to the bias plus the residual (each when
    /// given) of pixels `ox..` and output channels `mb..` under the masks `m`.
    ///
    /// # Safety
    /// As [`row`]: pixels `ox..ox + np` and the masked channels lie in the output row.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn start<const V: usize, const Q: usize>(
        acc: &mut [[__m512; V]; Q],
        np: usize,
        m: &[u16; V],
        bias: Option<&[f32]>,
        z: Option<&[f32]>,
        ox: usize,
        cout: usize,
        mb: usize,
    ) {
        for v in 0..V {
            // SAFETY: channels under the mask, pixels below ox + np (caller's contract).
            unsafe {
                let b = match bias {
                    Some(b) => _mm512_maskz_loadu_ps(m[v], b.as_ptr().add(mb + 16 * v)),
                    None => _mm512_setzero_ps(),
                };
                for (p, a) in acc.iter_mut().enumerate().take(np) {
                    a[v] = match z {
                        Some(z) => _mm512_add_ps(
                            _mm512_maskz_loadu_ps(
                                m[v],
                                z.as_ptr().add((ox + p) * cout + mb + 16 * v),
                            ),
                            b,
                        ),
                        None => _mm512_add_ps(_mm512_setzero_ps(), b),
                    };
                }
            }
        }
    }

    /// Stores the first `np` pixels' accumulators, activated, at pixels `ox..` and output
    /// channels `mb..` of the row at `op` under the masks `m`.
    ///
    /// # Safety
    /// As [`start`], for the output row at `op`.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn store<const V: usize, const Q: usize>(
        acc: &[[__m512; V]; Q],
        np: usize,
        m: &[u16; V],
        act: Act,
        op: *mut f32,
        ox: usize,
        cout: usize,
        mb: usize,
    ) {
        for (p, a) in acc.iter().enumerate().take(np) {
            for v in 0..V {
                // SAFETY: channels under the mask, pixels below ox + np (caller's contract).
                unsafe {
                    _mm512_mask_storeu_ps(
                        op.add((ox + p) * cout + mb + 16 * v),
                        m[v],
                        act_avx512(act, a[v]),
                    )
                };
            }
        }
    }

    /// The lane masks of `V` vectors of output channels from `mb` (the last masked past
    /// `cout`).
    #[inline]
    fn masks<const V: usize>(cout: usize, mb: usize) -> [u16; V] {
        core::array::from_fn(|v| {
            let left = cout.saturating_sub(mb + 16 * v).min(16);
            if left == 16 {
                0xffff
            } else {
                (1u16 << left) - 1
            }
        })
    }

    /// Pixels `ox..ox + np` (at most [`P`]) of output row `oy`, output channels `mb..` in `V`
    /// vectors of 16 (masked past `cout`).
    ///
    /// # Safety
    /// As [`row`].
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn block<const V: usize>(
        x: &[f32],
        st: Strides,
        w: &[f32],
        cout: usize,
        g: &Geometry,
        oy: usize,
        ox: usize,
        np: usize,
        mb: usize,
        bias: Option<&[f32]>,
        z: Option<&[f32]>,
        act: Act,
        o: &mut [MaybeUninit<f32>],
    ) {
        let ([ih, iw], cin, [kh, kw]) = (g.input, g.channels, g.kernel);
        let (xp, wp, op) = (x.as_ptr(), w.as_ptr(), o.as_mut_ptr() as *mut f32);
        let m = masks::<V>(cout, mb);
        let mut acc = [[_mm512_setzero_ps(); V]; P];
        // SAFETY (all pointer reads and writes below): channel offsets stay below `cout`
        // under the masks, pixel offsets below `ow`, input offsets inside the image (taps
        // outside are skipped).
        unsafe {
            start(&mut acc, np, &m, bias, z, ox, cout, mb);
            for ky in 0..kh {
                let iy = (oy * g.stride[0] + ky * g.dilation[0]) as isize - g.pad[0] as isize;
                if iy < 0 || iy as usize >= ih {
                    continue;
                }
                for kx in 0..kw {
                    let tap = ky * kw + kx;
                    // Each weight vector loaded once for the block's pixels (each pixel still
                    // sums its taps and channels in the interior kernel's order).
                    for ci in 0..cin {
                        let wr = wp.add((tap * cin + ci) * cout + mb);
                        let wv: [__m512; V] =
                            core::array::from_fn(|v| _mm512_maskz_loadu_ps(m[v], wr.add(16 * v)));
                        for (p, a) in acc.iter_mut().enumerate().take(np) {
                            let ix = ((ox + p) * g.stride[1] + kx * g.dilation[1]) as isize
                                - g.pad[1] as isize;
                            if ix < 0 || ix as usize >= iw {
                                continue;
                            }
                            let at = iy as usize * st.row + ix as usize * st.pixel;
                            let xv = _mm512_set1_ps(*xp.add(at + ci * st.channel));
                            for v in 0..V {
                                a[v] = _mm512_fmadd_ps(wv[v], xv, a[v]);
                            }
                        }
                    }
                }
            }
            store(&acc, np, &m, act, op, ox, cout, mb);
        }
    }

    /// [`super::to_planes`]'s whole 16 x 16 blocks (pixels `..pw / 16 * 16`, channels `..cout
    /// / 16 * 16`): 16 pixels' vectors of 16 channels turned in registers into 16 channels'
    /// vectors of 16 pixels (pairs of lanes, then of pairs, then 128-bit quarters twice).
    ///
    /// # Safety
    /// As [`super::to_planes`], with AVX-512F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn to_planes(
        src: &[f32],
        cout: usize,
        pw: usize,
        dst: *mut f32,
        plane: usize,
    ) {
        assert!(src.len() >= pw * cout);
        for p0 in (0..pw / 16 * 16).step_by(16) {
            for c0 in (0..cout / 16 * 16).step_by(16) {
                // SAFETY: pixels p0..p0 + 16 and channels c0..c0 + 16 lie inside `src`
                // (asserted) and, for `dst`, inside what the caller vouched for.
                unsafe {
                    let r: [__m512; 16] = core::array::from_fn(|i| {
                        _mm512_loadu_ps(src.as_ptr().add((p0 + i) * cout + c0))
                    });
                    // Per 128-bit quarter: t[2k] = r[2k].0 r[2k+1].0 r[2k].1 r[2k+1].1,
                    // t[2k+1] the same of elements 2 and 3.
                    let t: [__m512; 16] = core::array::from_fn(|i| {
                        let (a, b) = (r[i & !1], r[i | 1]);
                        if i % 2 == 0 {
                            _mm512_unpacklo_ps(a, b)
                        } else {
                            _mm512_unpackhi_ps(a, b)
                        }
                    });
                    // u[4k + j], quarter q: element j of quarter q (channel 4q + j) of
                    // pixels 4k..4k + 4.
                    let u: [__m512; 16] = core::array::from_fn(|i| {
                        let (k, j) = (i / 4, i % 4);
                        let (a, b) = (
                            _mm512_castps_pd(t[4 * k + j / 2]),
                            _mm512_castps_pd(t[4 * k + j / 2 + 2]),
                        );
                        _mm512_castpd_ps(if j % 2 == 0 {
                            _mm512_unpacklo_pd(a, b)
                        } else {
                            _mm512_unpackhi_pd(a, b)
                        })
                    });
                    for j in 0..4 {
                        let (p, q, r2, s) = (u[j], u[4 + j], u[8 + j], u[12 + j]);
                        let x0 = _mm512_shuffle_f32x4::<0x88>(p, q);
                        let x1 = _mm512_shuffle_f32x4::<0xdd>(p, q);
                        let y0 = _mm512_shuffle_f32x4::<0x88>(r2, s);
                        let y1 = _mm512_shuffle_f32x4::<0xdd>(r2, s);
                        let at = |quarter: usize| dst.add((c0 + 4 * quarter + j) * plane + p0);
                        _mm512_storeu_ps(at(0), _mm512_shuffle_f32x4::<0x88>(x0, y0));
                        _mm512_storeu_ps(at(1), _mm512_shuffle_f32x4::<0x88>(x1, y1));
                        _mm512_storeu_ps(at(2), _mm512_shuffle_f32x4::<0xdd>(x0, y0));
                        _mm512_storeu_ps(at(3), _mm512_shuffle_f32x4::<0xdd>(x1, y1));
                    }
                }
            }
        }
    }

    /// The kernels of [`row`] on AVX2 and FMA: output channels in vectors of 8, up to four
    /// vectors (32 channels) a block; each output summed in the same order as on AVX-512, so
    /// the same bits. Blocks of whole vectors load and store plainly, a block ending past
    /// `cout` through lane masks.
    pub(super) mod avx2 {
        use std::arch::x86_64::*;
        use std::mem::MaybeUninit;

        use super::super::Strides;
        use crate::depthwise::Geometry;
        use crate::gemm::x86::{act_avx2, first_lanes, load8};
        use crate::gemm::Act;

        /// Pixels computed together near the row's edges (taps checked one by one).
        const P: usize = 4;
        /// Pixels of an interior run: with `V` vectors of output channels, `WIDE / Q` runs
        /// of `Q` pixels, `V * Q` accumulators beside the `V` weight vectors and a broadcast
        /// in the 16 registers (12, 6, 3 and 2 pixels for 1 to 4 vectors).
        const WIDE: usize = 12;

        /// Where a run lies and what it adds: pixels from `ox` of output row `oy`, output
        /// channels from `mb`.
        #[derive(Clone, Copy)]
        struct At<'a> {
            oy: usize,
            ox: usize,
            mb: usize,
            bias: Option<&'a [f32]>,
            z: Option<&'a [f32]>,
            act: Act,
        }

        /// One output row (every pixel and output channel), as [`super::row`].
        ///
        /// # Safety
        /// AVX2 and FMA must be supported; the buffers as for [`super::row`].
        #[target_feature(enable = "avx2,fma")]
        #[allow(clippy::too_many_arguments)]
        pub(in super::super) unsafe fn row(
            x: &[f32],
            st: Strides,
            w: &[f32],
            cout: usize,
            g: &Geometry,
            oy: usize,
            bias: Option<&[f32]>,
            z: Option<&[f32]>,
            act: Act,
            o: &mut [MaybeUninit<f32>],
        ) {
            let ow = g.output[1];
            // Output columns whose taps all lie inside the input row: [lo, hi).
            let (iw, sx, dx, px) = (g.input[1], g.stride[1], g.dilation[1], g.pad[1]);
            let span = (g.kernel[1] - 1) * dx;
            let lo = px.div_ceil(sx).min(ow);
            let hi = if iw + px > span {
                ((iw + px - span - 1) / sx + 1).clamp(lo, ow)
            } else {
                lo
            };
            let mut ox = 0;
            while ox < ow {
                let interior = ox >= lo && ox + WIDE <= hi;
                let np = if interior { WIDE } else { P.min(ow - ox) };
                let mut mb = 0;
                while mb < cout {
                    let v = (cout - mb).div_ceil(8).min(4);
                    let full = cout - mb >= 8 * v;
                    let at = At {
                        oy,
                        ox,
                        mb,
                        bias,
                        z,
                        act,
                    };
                    macro_rules! go {
                        ($v:literal, $q:literal) => {
                            // SAFETY: forwarded; an interior run's pixels lie inside [lo, hi),
                            // so every tap of theirs is inside the input row; an edge block
                            // covers pixels ox..ox + np of this row.
                            unsafe {
                                match (interior, full) {
                                    (true, true) => wide::<$v, $q, true>(x, st, w, cout, g, at, o),
                                    (true, false) => {
                                        wide::<$v, $q, false>(x, st, w, cout, g, at, o)
                                    }
                                    (false, true) => {
                                        block::<$v, true>(x, st, w, cout, g, at, np, o)
                                    }
                                    (false, false) => {
                                        block::<$v, false>(x, st, w, cout, g, at, np, o)
                                    }
                                }
                            }
                        };
                    }
                    match v {
                        1 => go!(1, 12),
                        2 => go!(2, 6),
                        3 => go!(3, 3),
                        _ => go!(4, 2),
                    }
                    mb += 32;
                }
                ox += np;
            }
        }

        /// The lane masks of `V` vectors of output channels from `mb` (the last masked past
        /// `cout`).
        #[inline]
        #[target_feature(enable = "avx2")]
        fn masks<const V: usize>(cout: usize, mb: usize) -> [__m256i; V] {
            core::array::from_fn(|v| first_lanes(cout.saturating_sub(mb + 8 * v)))
        }

        /// The first `np` pixels' accumulators set to the bias plus the residual (each when
        /// given) of pixels `at.ox..` and output channels `at.mb..`.
        ///
        /// # Safety
        /// As [`row`]: pixels `at.ox..at.ox + np` and the masked channels lie in the row.
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn start<const V: usize, const Q: usize, const FULL: bool>(
            acc: &mut [[__m256; V]; Q],
            np: usize,
            m: &[__m256i; V],
            at: At,
            cout: usize,
        ) {
            for v in 0..V {
                let ch = at.mb + 8 * v;
                // SAFETY: channels under the mask, pixels below ox + np (caller's contract).
                unsafe {
                    let b = match at.bias {
                        Some(b) => load8::<FULL>(b.as_ptr().add(ch), m[v]),
                        None => _mm256_setzero_ps(),
                    };
                    for (p, a) in acc.iter_mut().enumerate().take(np) {
                        a[v] = match at.z {
                            Some(z) => _mm256_add_ps(
                                load8::<FULL>(z.as_ptr().add((at.ox + p) * cout + ch), m[v]),
                                b,
                            ),
                            None => _mm256_add_ps(_mm256_setzero_ps(), b),
                        };
                    }
                }
            }
        }

        /// Stores the first `np` pixels' accumulators, activated, at pixels `at.ox..` and
        /// output channels `at.mb..` of the row at `op`.
        ///
        /// # Safety
        /// As [`start`], for the output row at `op`.
        #[inline]
        #[target_feature(enable = "avx2,fma")]
        unsafe fn store<const V: usize, const Q: usize, const FULL: bool>(
            acc: &[[__m256; V]; Q],
            np: usize,
            m: &[__m256i; V],
            at: At,
            op: *mut f32,
            cout: usize,
        ) {
            for (p, a) in acc.iter().enumerate().take(np) {
                for v in 0..V {
                    let y = act_avx2(at.act, a[v]);
                    // SAFETY: channels under the mask, pixels below ox + np (caller's
                    // contract).
                    unsafe {
                        let dst = op.add((at.ox + p) * cout + at.mb + 8 * v);
                        if FULL {
                            _mm256_storeu_ps(dst, y)
                        } else {
                            _mm256_maskstore_ps(dst, m[v], y)
                        }
                    };
                }
            }
        }

        /// [`WIDE`] pixels from `at.ox` of output row `at.oy`, all of whose taps lie inside
        /// the input row, in runs of `Q`; output channels `at.mb..` in `V` vectors of 8
        /// (`FULL`: all inside `cout`): per run, tap and input channel, the `V` weight
        /// vectors are loaded once and each pixel's input value broadcast against them.
        ///
        /// # Safety
        /// As [`row`]; pixels `at.ox..at.ox + WIDE` lie in the row's interior (every tap
        /// column inside the input).
        #[target_feature(enable = "avx2,fma")]
        unsafe fn wide<const V: usize, const Q: usize, const FULL: bool>(
            x: &[f32],
            st: Strides,
            w: &[f32],
            cout: usize,
            g: &Geometry,
            at: At,
            o: &mut [MaybeUninit<f32>],
        ) {
            let ([ih, _], cin, [kh, kw]) = (g.input, g.channels, g.kernel);
            let (xp, wp, op) = (x.as_ptr(), w.as_ptr(), o.as_mut_ptr() as *mut f32);
            let m = masks::<V>(cout, at.mb);
            let step = g.stride[1] * st.pixel;
            for run in 0..WIDE / Q {
                let at = At {
                    ox: at.ox + run * Q,
                    ..at
                };
                let mut acc = [[_mm256_setzero_ps(); V]; Q];
                // SAFETY (all pointer reads and writes below): channel offsets stay below
                // `cout` (whole vectors, or under the masks), pixel offsets below `ow`, input
                // offsets inside the image (rows outside are skipped; columns are inside by
                // the caller's contract).
                unsafe {
                    start::<V, Q, FULL>(&mut acc, Q, &m, at, cout);
                    for ky in 0..kh {
                        let iy =
                            (at.oy * g.stride[0] + ky * g.dilation[0]) as isize - g.pad[0] as isize;
                        if iy < 0 || iy as usize >= ih {
                            continue;
                        }
                        for kx in 0..kw {
                            let ix0 = at.ox * g.stride[1] + kx * g.dilation[1] - g.pad[1];
                            let src = xp.add(iy as usize * st.row + ix0 * st.pixel);
                            let wt = wp.add((ky * kw + kx) * cin * cout + at.mb);
                            for ci in 0..cin {
                                let src = src.add(ci * st.channel);
                                let wv: [__m256; V] = core::array::from_fn(|v| {
                                    load8::<FULL>(wt.add(ci * cout + 8 * v), m[v])
                                });
                                for (p, a) in acc.iter_mut().enumerate() {
                                    let xv = _mm256_set1_ps(*src.add(p * step));
                                    for v in 0..V {
                                        a[v] = _mm256_fmadd_ps(wv[v], xv, a[v]);
                                    }
                                }
                            }
                        }
                    }
                    store::<V, Q, FULL>(&acc, Q, &m, at, op, cout);
                }
            }
        }

        /// Pixels `at.ox..at.ox + np` (at most [`P`]) of output row `at.oy`, output
        /// channels `at.mb..` in `V` vectors of 8 (`FULL`: all inside `cout`).
        ///
        /// # Safety
        /// As [`row`].
        #[target_feature(enable = "avx2,fma")]
        #[allow(clippy::too_many_arguments)]
        unsafe fn block<const V: usize, const FULL: bool>(
            x: &[f32],
            st: Strides,
            w: &[f32],
            cout: usize,
            g: &Geometry,
            at: At,
            np: usize,
            o: &mut [MaybeUninit<f32>],
        ) {
            let ([ih, iw], cin, [kh, kw]) = (g.input, g.channels, g.kernel);
            let (xp, wp, op) = (x.as_ptr(), w.as_ptr(), o.as_mut_ptr() as *mut f32);
            let m = masks::<V>(cout, at.mb);
            let mut acc = [[_mm256_setzero_ps(); V]; P];
            // SAFETY (all pointer reads and writes below): channel offsets stay below `cout`
            // (whole vectors, or under the masks), pixel offsets below `ow`, input offsets
            // inside the image (taps outside are skipped).
            unsafe {
                start::<V, P, FULL>(&mut acc, np, &m, at, cout);
                for ky in 0..kh {
                    let iy =
                        (at.oy * g.stride[0] + ky * g.dilation[0]) as isize - g.pad[0] as isize;
                    if iy < 0 || iy as usize >= ih {
                        continue;
                    }
                    for kx in 0..kw {
                        let tap = ky * kw + kx;
                        for (p, a) in acc.iter_mut().enumerate().take(np) {
                            let ix = ((at.ox + p) * g.stride[1] + kx * g.dilation[1]) as isize
                                - g.pad[1] as isize;
                            if ix < 0 || ix as usize >= iw {
                                continue;
                            }
                            let src = xp.add(iy as usize * st.row + ix as usize * st.pixel);
                            for ci in 0..cin {
                                let xv = _mm256_set1_ps(*src.add(ci * st.channel));
                                let wr = wp.add((tap * cin + ci) * cout + at.mb);
                                for v in 0..V {
                                    let wv = load8::<FULL>(wr.add(8 * v), m[v]);
                                    a[v] = _mm256_fmadd_ps(wv, xv, a[v]);
                                }
                            }
                        }
                    }
                }
                store::<V, P, FULL>(&acc, np, &m, at, op, cout);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gemm::Act;
    use rand::{Rng, SeedableRng};

    /// The kernel families of this module that this CPU runs.
    fn families() -> Vec<Isa> {
        gemm::available_isas()
            .into_iter()
            .filter(|i| matches!(i, Isa::Avx512 | Isa::Avx2))
            .collect()
    }

    /// `n` channels-last images (`[n, ih, iw, cin]`) as planes (`[n, cin, ih, iw]`).
    fn as_planes(x: &[f32], n: usize, [ih, iw]: [usize; 2], cin: usize) -> Vec<f32> {
        let mut planes = vec![0f32; x.len()];
        for b in 0..n {
            for q in 0..ih * iw {
                for ci in 0..cin {
                    planes[(b * cin + ci) * ih * iw + q] = x[(b * ih * iw + q) * cin + ci];
                }
            }
        }
        planes
    }

    /// Against the f64 reference on fresh random shapes: 1-4 input channels, 1-90 output
    /// channels (below, at and past whole vectors and the 64-channel blocks), kernels 1-7,
    /// strides 1-3, dilations 1-2, paddings 0-3, batches 1-2, bias / residual / each vector
    /// activation, 1-3 threads, each kernel family (AVX-512, AVX2) this CPU has. Bound: 4e-6 x
    /// (the sum of the terms' magnitudes + 1e-3), 1.5x after an activation; the output starts
    /// as NaN, so an element left unwritten fails. Every family and thread count gives the
    /// same bits, and images read as planes the same bits as channels-last.
    #[test]
    fn matches_the_f64_reference() {
        let isas = families();
        if isas.is_empty() {
            return;
        }
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        for case in 0..40 {
            let cin = rng.gen_range(1..=MAX_CIN);
            let cout = rng.gen_range(1..91);
            let k = [rng.gen_range(1..8), rng.gen_range(1..8)];
            let s = [rng.gen_range(1..4), rng.gen_range(1..4)];
            let d = [rng.gen_range(1..3), rng.gen_range(1..3)];
            let pad = [rng.gen_range(0..4), rng.gen_range(0..4)];
            // Rows wide enough for the interior kernel's runs of 12 pixels at any stride.
            let input = [rng.gen_range(1..20), rng.gen_range(1..[30, 90][case % 2])];
            let Some(g) = Geometry::fitting(input, cin, k, s, d, pad, pad) else {
                continue;
            };
            let (output, n) = (g.output, rng.gen_range(1..3));
            let mut v = |len: usize| -> Vec<f32> {
                (0..len).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
            };
            let x = v(n * input[0] * input[1] * cin);
            let w = v(k[0] * k[1] * cin * cout);
            let bias = v(cout);
            let z = v(n * output[0] * output[1] * cout);
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
            let plain = Finish {
                bias: None,
                residual: None,
                act: Act::Identity,
            };
            let want = dense_nhwc_ref(
                &x,
                &w,
                cout,
                n,
                &g,
                &Finish {
                    act: Act::Identity,
                    ..fin
                },
            );
            let abs = |v: &[f32]| v.iter().map(|a| a.abs()).collect::<Vec<_>>();
            let mag = dense_nhwc_ref(&abs(&x), &abs(&w), cout, n, &g, &plain);
            let mut first: Option<Vec<u32>> = None;
            for (threads, &isa) in (1..4).flat_map(|t| isas.iter().map(move |i| (t, i))) {
                let mut out = vec![MaybeUninit::new(f32::NAN); want.len()];
                dense_with_isa(
                    isa,
                    threads,
                    Input::Nhwc,
                    &x,
                    &w,
                    cout,
                    n,
                    &g,
                    &fin,
                    &mut out,
                );
                for (i, o) in out.iter().enumerate() {
                    // SAFETY: initialised above (NaN), then overwritten by the kernel.
                    let got = unsafe { o.assume_init() } as f64;
                    let extra = fin.bias.map_or(0.0, |b| b[i % cout].abs() as f64)
                        + fin.residual.map_or(0.0, |z| z[i].abs() as f64);
                    let mut tol = 4e-6 * (mag[i] + extra + 1e-3);
                    if act != Act::Identity {
                        tol *= 1.5;
                    }
                    let exp = act.apply(want[i] as f32) as f64;
                    assert!(
                        (got - exp).abs() <= tol,
                        "seed {seed} case {case} {isa:?} {threads}t {g:?} -> {cout}, n {n}, at {i}: {got} vs {exp} (tol {tol})"
                    );
                }
                // Every tier and thread count sums in the same order: the same bits.
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
                // The same images as planes, read where they lie: the same bits.
                let planes = as_planes(&x, n, input, cin);
                let mut from_planes = vec![MaybeUninit::new(f32::NAN); want.len()];
                dense_with_isa(
                    isa,
                    threads,
                    Input::Nchw,
                    &planes,
                    &w,
                    cout,
                    n,
                    &g,
                    &fin,
                    &mut from_planes,
                );
                for (i, (a, b)) in out.iter().zip(&from_planes).enumerate() {
                    // SAFETY: both initialised above (NaN), then overwritten by the kernel.
                    let (a, b) = unsafe { (a.assume_init(), b.assume_init()) };
                    assert!(
                        a.to_bits() == b.to_bits() && !b.is_nan(),
                        "seed {seed} case {case} {isa:?} {threads}t {g:?} -> {cout}, n {n}, planes, at {i}: {b} vs {a}"
                    );
                }
            }
        }
    }

    /// The pooled convolution against the convolution's own output pooled by the reference,
    /// on fresh random shapes (1-4 input channels, 1-90 output channels, kernels, strides and
    /// paddings as above; pool windows 1-4 at strides 1-3, padded 0 to one less than the window,
    /// floor or ceil sizes), bias and activations, some inputs NaN, 1-3 threads, each kernel
    /// family: bit for bit (a pooled value is one of the convolution's values), every element
    /// written (the output starts as a NaN the kernel cannot make).
    #[test]
    fn pooled_matches_the_convolution_then_the_reference_pool() {
        let isas = families();
        if isas.is_empty() {
            return;
        }
        let seed: u64 = rand::random();
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let unwritten = f32::from_bits(0x7fc0_dead);
        let mut pooled_cases = 0;
        for case in 0..60 {
            let cin = rng.gen_range(1..=MAX_CIN);
            let cout = rng.gen_range(1..91);
            let k = [rng.gen_range(1..8), rng.gen_range(1..8)];
            let s = [rng.gen_range(1..4), rng.gen_range(1..4)];
            let pad = [rng.gen_range(0..4), rng.gen_range(0..4)];
            let input = [rng.gen_range(1..24), rng.gen_range(1..[30, 90][case % 2])];
            let Some(g) = Geometry::fitting(input, cin, k, s, [1, 1], pad, pad) else {
                continue;
            };
            let [oh, ow] = g.output;
            let pk = [rng.gen_range(1..5), rng.gen_range(1..5)];
            let ps = [rng.gen_range(1..4), rng.gen_range(1..4)];
            let pp = [rng.gen_range(0..pk[0]), rng.gen_range(0..pk[1])];
            let ceil = rng.gen_bool(0.5);
            let size = |i: usize, o: usize| -> Option<usize> {
                let span = (o + 2 * pp[i]).checked_sub(pk[i])?;
                let mut n = if ceil {
                    span.div_ceil(ps[i]) + 1
                } else {
                    span / ps[i] + 1
                };
                if ceil && (n - 1) * ps[i] >= o + pp[i] {
                    n -= 1;
                }
                Some(n)
            };
            let (Some(ph), Some(pw)) = (size(0, oh), size(1, ow)) else {
                continue;
            };
            let p = MaxPool {
                kernel: pk,
                stride: ps,
                pad: pp,
                output: [ph, pw],
            };
            pooled_cases += 1;
            let n = rng.gen_range(1..3);
            let mut v = |len: usize| -> Vec<f32> {
                (0..len).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
            };
            let mut x = v(n * input[0] * input[1] * cin);
            let w = v(k[0] * k[1] * cin * cout);
            let bias = v(cout);
            if case % 5 == 0 {
                for _ in 0..3 {
                    let i = rng.gen_range(0..x.len());
                    x[i] = f32::NAN;
                }
            }
            let act = match case % 4 {
                0 => Act::Identity,
                1 => Act::Relu,
                2 => Act::Clip { lo: -0.5, hi: 0.7 },
                _ => Act::LeakyRelu(0.1),
            };
            let fin = Finish {
                bias: (case % 3 != 0).then_some(&bias[..]),
                residual: None,
                act,
            };
            // The image as planes too.
            let planes = as_planes(&x, n, input, cin);
            for (threads, &isa) in (1..4).flat_map(|t| isas.iter().map(move |i| (t, i))) {
                let mut conv = vec![MaybeUninit::new(f32::NAN); n * oh * ow * cout];
                dense_with_isa(
                    isa,
                    threads,
                    Input::Nhwc,
                    &x,
                    &w,
                    cout,
                    n,
                    &g,
                    &fin,
                    &mut conv,
                );
                // SAFETY: every element written by the kernel (its own test checks that).
                let conv: Vec<f32> = conv.iter().map(|o| unsafe { o.assume_init() }).collect();
                let want = max_pool_ref(&conv, cout, n, [oh, ow], &p);
                for (input, xs) in [(Input::Nhwc, &x), (Input::Nchw, &planes)] {
                    let mut out = vec![MaybeUninit::new(unwritten); want.len()];
                    dense_max_pool_with_isa(
                        isa, threads, input, xs, &w, cout, n, &g, &fin, &p, &mut out,
                    );
                    for (i, (o, e)) in out.iter().zip(&want).enumerate() {
                        // SAFETY: initialised above, then overwritten by the kernel.
                        let got = unsafe { o.assume_init() };
                        assert!(
                            got.to_bits() == e.to_bits() && got.to_bits() != unwritten.to_bits(),
                            "seed {seed} case {case} {isa:?} {threads}t {input:?} {g:?} -> {cout}, {p:?}, n {n}, at {i}: {got} vs {e}"
                        );
                    }
                }
            }
        }
        assert!(
            pooled_cases >= 20,
            "seed {seed}: only {pooled_cases} cases ran"
        );
    }
}
