//! Convolutions (Conv, ConvInteger, ConvTranspose) and pooling (Max, Average, Lp, global).
//! Reference loops over N-D spatial dims in f64.

use std::cell::RefCell;

use ferrum_kernels::aligned::Aligned;
use ferrum_kernels::pool;
use ferrum_kernels::qgemm::{self, Bytes, PackedI8};

use crate::ir::Node;
use crate::ops::fused::{Act, Epi};
use crate::ops::nn::{f64_tensor, minus_zp};
use crate::ops::shape::strides;
use crate::ops::{attr_ints, attr_str, numel, one, per_input, Inferred, Kernel, Known, Rules};
use crate::ops::{fast, linear};
use crate::ops::{unsupported, Ctx};
use crate::tensor::{DType, Tensor, Value};
use crate::{kbail, Result};

/// Spatial geometry shared by Conv, the pools and the channels-last `NhwcConv`.
pub(crate) struct Geom {
    pub ins: Vec<usize>,
    pub k: Vec<usize>,
    pub s: Vec<usize>,
    pub d: Vec<usize>,
    pub pad_begin: Vec<usize>,
    pub outs: Vec<usize>,
}

/// How a window op's pads are chosen (`auto_pad`).
#[derive(Clone, Copy, Debug, PartialEq)]
enum AutoPad {
    /// `pads` as given (`NOTSET`, or empty).
    Explicit,
    Valid,
    SameUpper,
    SameLower,
}

/// A window op's strides, dilations, pads and `auto_pad`, read once from its node (when its op
/// is resolved, [`crate::ops::Parsed`]); the dims they cover come with each run's shapes.
#[derive(Clone, Debug)]
pub struct Window {
    s: Option<Vec<usize>>,
    d: Option<Vec<usize>>,
    pads: Option<Vec<usize>>,
    auto: AutoPad,
}

/// The largest kernel, stride, dilation or pad the window ops take.
const LIMIT: usize = 1 << 24;

impl Window {
    /// The node's window attributes; an error for values beyond [`LIMIT`] or an `auto_pad` the
    /// kernels do not know.
    pub fn of(node: &Node) -> Result<Window> {
        Window::named(node, "")
    }

    /// [`Window::of`] from the attributes named with `prefix` (`pool_strides`, ...: the max
    /// pool of a `ConvMaxPool` node).
    pub fn named(node: &Node, prefix: &str) -> Result<Window> {
        let read = |name: &str, min: i64| -> Result<Option<Vec<usize>>> {
            let Some(v) = attr_ints(node, &format!("{prefix}{name}")) else {
                return Ok(None);
            };
            let v: Vec<usize> = v.iter().map(|&x| x.max(min) as usize).collect();
            if v.iter().any(|&x| x > LIMIT) {
                kbail!("kernel, stride, dilation or pad beyond {LIMIT}");
            }
            Ok(Some(v))
        };
        let auto = match attr_str(node, &format!("{prefix}auto_pad"), "NOTSET").as_str() {
            "NOTSET" | "" => AutoPad::Explicit,
            "VALID" => AutoPad::Valid,
            "SAME_UPPER" => AutoPad::SameUpper,
            "SAME_LOWER" => AutoPad::SameLower,
            a => return Err(unsupported(format!("auto_pad '{a}'"))),
        };
        Ok(Window {
            s: read("strides", 1)?,
            d: read("dilations", 1)?,
            pads: read("pads", 0)?,
            auto,
        })
    }

    /// The geometry over input dims `ins` and kernel `k` (`ceil`: a pool's `ceil_mode`).
    pub(crate) fn geom(&self, ins: &[usize], k: &[usize], ceil: bool) -> Result<Geom> {
        let nd = ins.len();
        let s = self.s.clone().unwrap_or(vec![1; nd]);
        let d = self.d.clone().unwrap_or(vec![1; nd]);
        let mut pads = self.pads.clone().unwrap_or(vec![0; 2 * nd]);
        if k.iter().any(|&x| x > LIMIT) {
            kbail!("kernel, stride, dilation or pad beyond {LIMIT}");
        }
        if s.len() != nd || d.len() != nd || pads.len() != 2 * nd || k.len() != nd || k.contains(&0)
        {
            kbail!("strides, dilations, pads or kernel_shape do not match {nd} spatial dims");
        }
        let mut outs = vec![0; nd];
        for i in 0..nd {
            let ek = (k[i] - 1) * d[i] + 1;
            match self.auto {
                AutoPad::SameUpper | AutoPad::SameLower => {
                    let o = ins[i].div_ceil(s[i]);
                    let total = ((o - 1) * s[i] + ek).saturating_sub(ins[i]);
                    let small = total / 2;
                    let (b, e) = if self.auto == AutoPad::SameUpper {
                        (small, total - small)
                    } else {
                        (total - small, small)
                    };
                    pads[i] = b;
                    pads[i + nd] = e;
                    outs[i] = o;
                }
                AutoPad::Valid | AutoPad::Explicit => {
                    if self.auto == AutoPad::Valid {
                        pads[i] = 0;
                        pads[i + nd] = 0;
                    }
                    let span = ins[i] + pads[i] + pads[i + nd];
                    if span < ek {
                        kbail!("kernel larger than the padded input");
                    }
                    let num = span - ek;
                    let mut o = if ceil {
                        num.div_ceil(s[i]) + 1
                    } else {
                        num / s[i] + 1
                    };
                    if ceil && (o - 1) * s[i] >= ins[i] + pads[i] {
                        o -= 1;
                    }
                    outs[i] = o;
                }
            }
        }
        Ok(Geom {
            ins: ins.to_vec(),
            k: k.to_vec(),
            s,
            d,
            pad_begin: pads[..nd].to_vec(),
            outs,
        })
    }
}

/// The node's strides, dilations, pads and `auto_pad` over input dims `ins` and kernel `k`
/// (as parsed when the node was resolved, else read now).
pub(crate) fn geom(cx: &Ctx, ins: &[usize], k: &[usize], ceil: bool) -> Result<Geom> {
    match cx.parsed.and_then(|p| p.window.as_ref()) {
        Some(w) => w.geom(ins, k, ceil),
        None => Window::of(cx.node)?.geom(ins, k, ceil),
    }
}

/// [`geom`] from the node alone: the one rule for the kernels and for shape inference.
pub(crate) fn geom_of(node: &Node, ins: &[usize], k: &[usize], ceil: bool) -> Result<Geom> {
    Window::of(node)?.geom(ins, k, ceil)
}

/// Every index of a shape, row-major.
fn indices(shape: &[usize]) -> Vec<Vec<usize>> {
    let n: usize = shape.iter().product();
    let st = strides(shape);
    (0..n)
        .map(|o| (0..shape.len()).map(|d| (o / st[d]) % shape[d]).collect())
        .collect()
}

/// Conv's three forms: float, ConvInteger (zero points, int32 out), QLinearConv (quantized in
/// and out).
#[derive(Clone, Copy, PartialEq)]
enum ConvKind {
    Float,
    Integer,
    QLinear,
}

/// `(w - zero_point) * scale` with per-output-channel (dim 0) or scalar parameters.
fn per_channel(w: &Tensor, zp: Option<&Tensor>, scale: Option<&Tensor>) -> Result<Vec<f64>> {
    let m = w.shape().first().copied().unwrap_or(1).max(1);
    let per = w.len() / m;
    let pick = |v: &[f64], i: usize| -> Result<f64> {
        match v.len() {
            1 => Ok(v[0]),
            l if l == m => Ok(v[i / per.max(1)]),
            l => kbail!("{l} per-channel parameters for {m} channels"),
        }
    };
    let z = zp.map(|t| t.to_f64_vec()).transpose()?;
    let s = scale.map(|t| t.to_f64_vec()).transpose()?;
    let mut wv = w.to_f64_vec()?;
    for (i, e) in wv.iter_mut().enumerate() {
        if let Some(z) = &z {
            *e -= pick(z, i)?;
        }
        if let Some(s) = &s {
            *e *= pick(s, i)?;
        }
    }
    Ok(wv)
}

fn conv(cx: &Ctx, kind: ConvKind) -> Result<Tensor> {
    if kind == ConvKind::QLinear {
        if let Some(t) = qlinear_conv_fast(cx)? {
            return Ok(t);
        }
    }
    conv_epi(cx, kind, Epi::default(), &mut None)
}

/// A one-value float32 input as f64 (`None` for another form).
fn scalar_f32(t: &Tensor) -> Option<f64> {
    (t.dtype() == DType::F32 && t.len() == 1)
        .then(|| t.as_slice::<f32>().ok().map(|v| v[0] as f64))
        .flatten()
        .filter(|v| v.is_finite())
}

/// QLinearConv in 2-D with one group, 8-bit X, W and Y, X and Y quantized per tensor, W per
/// tensor or per output channel: on the integer GEMM ([`qgemm`]) as `col(X)^T W^T`. The image
/// is turned channels-last (unsigned bytes), so each row of A (one per output position) is the
/// kernel taps' runs of C bytes, padding filled with X's zero point so it adds nothing; a 1x1
/// filter at stride 1 reads the channels-last image itself. B is the filter packed once at
/// session creation ([`crate::passes::Role::IntFilter`]). The GEMM's epilogue requantizes each
/// output as ONNX Runtime does, `clamp(round_half_even(acc * s + bias * s) + y_zero_point)`
/// with `s = x_scale w_scale / y_scale` in float32 (so an output may differ from the exact
/// reference by one step where the exact value lies within float32 rounding of a half), and
/// stores it channels-first. `None` for the other forms, left to the reference.
fn qlinear_conv_fast(cx: &Ctx) -> Result<Option<Tensor>> {
    qlinear_conv_layout(cx, false)
}

/// `com.ferrum.NhwcQLinearConv` (made by the layout pass): QLinearConv's inputs and attributes
/// with X and Y channels-last (`[N, H, W, C]`, `[N, OH, OW, M]`), the filter as QLinearConv's
/// (`[M, C, kh, kw]`). The same integer products and requantization as [`qlinear_conv_fast`]
/// (the same bytes), without turning X and Y around. Only the forms that function takes (the
/// pass checks them on the constant parameters).
pub(crate) fn nhwc_qlinear_conv(cx: &Ctx) -> Result<Tensor> {
    match qlinear_conv_layout(cx, true)? {
        Some(t) => Ok(t),
        None => Err(super::unsupported(format!(
            "NhwcQLinearConv {}: a form the channels-last kernel does not take",
            cx.node.name
        ))),
    }
}

/// [`qlinear_conv_fast`] (`nhwc` false) or [`nhwc_qlinear_conv`] (`nhwc` true).
fn qlinear_conv_layout(cx: &Ctx, nhwc_io: bool) -> Result<Option<Tensor>> {
    let (x, w) = (cx.t(0)?, cx.t(3)?);
    let eight = |t: &Tensor| matches!(t.dtype(), DType::U8 | DType::I8);
    if x.rank() != 4 || w.rank() != 4 || !eight(x) || !eight(w) || cx.ai("group", 1) != 1 {
        return Ok(None);
    }
    let (n, c, m) = (
        x.shape()[0],
        x.shape()[if nhwc_io { 3 } else { 1 }],
        w.shape()[0],
    );
    if w.shape()[1] != c || m == 0 || c == 0 || n == 0 {
        return Ok(None);
    }
    let (Some(xs), Some(ys)) = (scalar_f32(cx.t(1)?), scalar_f32(cx.t(6)?)) else {
        return Ok(None);
    };
    let one_int = |i: usize, dt: DType| -> Result<Option<i32>> {
        Ok(match cx.opt(i) {
            None => Some(0),
            Some(z) if z.len() == 1 && z.dtype() == dt => Some(z.to_i64_vec()?[0] as i32),
            Some(_) => None,
        })
    };
    let (Some(xz), Some(yz)) = (one_int(2, x.dtype())?, one_int(7, cx.t(7)?.dtype())?) else {
        return Ok(None);
    };
    let y_dtype = cx.t(7)?.dtype();
    if !matches!(y_dtype, DType::U8 | DType::I8) {
        return Ok(None);
    }
    let ws = cx.t(4)?;
    if ws.dtype() != DType::F32 || !(ws.len() == 1 || ws.len() == m) {
        return Ok(None);
    }
    let ws = ws.as_slice::<f32>()?;
    if !ws.iter().all(|v| v.is_finite()) {
        return Ok(None);
    }
    // The filter's zero points: one value when they are all equal (symmetric weights give
    // zeros), else one per output channel.
    let wz: Vec<i32> = match cx.opt(5) {
        None => vec![0],
        Some(z) if z.dtype() == w.dtype() && (z.len() == 1 || z.len() == m) => {
            super::quant::zero_points(z)?
        }
        Some(_) => return Ok(None),
    };
    let bias: Option<&[i32]> = match cx.opt(8) {
        None => None,
        Some(b) if b.dtype() == DType::I32 && b.len() == m => Some(b.as_slice::<i32>()?),
        Some(_) => return Ok(None),
    };
    let k = [w.shape()[2], w.shape()[3]];
    let spatial = if nhwc_io {
        &x.shape()[1..3]
    } else {
        &x.shape()[2..]
    };
    let g = geom(cx, spatial, &k, false)?;
    let (oh, ow) = (g.outs[0], g.outs[1]);
    let (ih, iw) = (g.ins[0], g.ins[1]);
    let osp = oh * ow;
    let kk = c * k[0] * k[1];
    let shape = if nhwc_io {
        vec![n, oh, ow, m]
    } else {
        vec![n, m, oh, ow]
    };
    if osp == 0 {
        return Ok(Some(Tensor::zeros(y_dtype, shape)?));
    }
    // Per output channel: the float32 multiplier and the bias in output steps (in buffers
    // this thread recycles: kilobytes a call).
    let mut scale = ferrum_core::Buf::overwritten(m);
    for (o, d) in scale.iter_mut().enumerate() {
        *d = (xs * ws[if ws.len() == 1 { 0 } else { o }] as f64 / ys) as f32;
    }
    let bias_f = bias.map(|b| {
        let mut f = ferrum_core::Buf::overwritten(m);
        for ((d, &v), &s) in f.iter_mut().zip(b).zip(scale.iter()) {
            *d = (v as f64 * s as f64) as f32;
        }
        f
    });
    // Signed bytes are read as unsigned ones shifted by 128 (and so is their zero point).
    let (flip, xz) = if x.dtype() == DType::I8 {
        (0x80u8, xz + 128)
    } else {
        (0, xz)
    };
    let own;
    let packed = match cx.packed_int_filter(3) {
        Some(p) if p.k() == kk && p.n() == m => p,
        _ => {
            own = pack_int_filter(w)?;
            &own
        }
    };
    let signed_bytes: Vec<u8>;
    let xb: &[u8] = match x.dtype() {
        DType::U8 => x.as_slice::<u8>()?,
        // The same bits as unsigned bytes (flipped below).
        _ => {
            signed_bytes = x.as_slice::<i8>()?.iter().map(|&v| v as u8).collect();
            &signed_bytes
        }
    };
    let isp = ih * iw;
    let geo = Patches {
        c,
        k,
        s: [g.s[0], g.s[1]],
        d: [g.d[0], g.d[1]],
        pad: [g.pad_begin[0], g.pad_begin[1]],
        ins: [ih, iw],
        ow,
        fill: xz as u8,
    };
    // A 1x1 filter at stride 1 without padding reads the channels-last image as it is.
    let direct = k == [1, 1] && geo.s == [1, 1] && geo.pad == [0, 0] && osp == isp;
    let tile_unit = packed.layout() == qgemm::Layout::Tiles && qgemm::use_amx();
    // Patch rows are written as far apart as the kernels read them, zeros past kk (an RGB
    // stem's 147 bytes in rows of 192), so the GEMM reads them in place.
    let ld = packed.kp().max(kk);
    // A tap's run of C bytes where the window leaves the image (for gathered patches), in a
    // buffer this thread keeps (taken out for the call, so a nested call finds it empty).
    let mut fill_run = FILL_RUN.take();
    fill_run.clear();
    fill_run.resize(c, geo.fill);
    let mut y = crate::arena::overwritten(n * m * osp, 0u8);
    // The channels-last image, A's rows and the channels-last output: scratch kept by the
    // thread between calls (every byte is written before it is read).
    SCRATCH.with(|cell| {
        let mut bufs = cell.borrow_mut();
        let [nhwc, col, rows_out] = &mut *bufs;
        for (b, yb) in y.chunks_exact_mut(m * osp).enumerate() {
            let xin = &xb[b * c * isp..(b + 1) * c * isp];
            // The image channels-last, unsigned: X itself where it already is (and, for the
            // tile unit, which reads A's rows in place, starts on a cache line; the vector
            // kernels read rows anywhere), else a copy.
            let image: &[u8] = if !nhwc_io {
                let t = scratch(nhwc, isp * c);
                transpose_bytes(xin, c, isp, flip, t);
                t
            } else if flip != 0
                || (direct && tile_unit && !(xin.as_ptr() as usize).is_multiple_of(64))
            {
                let t = scratch(nhwc, isp * c);
                copy_flipped(xin, flip, t);
                t
            } else {
                xin
            };
            // The patches gathered where they lie in the image by the kernel (a tap's C bytes
            // a run), or written out as A's rows.
            let gathered = (!direct && qgemm::reads_gathered(c, packed))
                .then(|| geo.offsets_kept(osp))
                .flatten();
            let col = scratch(
                col,
                if direct || gathered.is_some() {
                    0
                } else {
                    osp * ld
                },
            );
            if !direct && gathered.is_none() {
                let rows = osp.div_ceil(pool::threads() * 4).max(16);
                pool::parallel_chunks_mut(col, rows * ld, |ci, chunk| {
                    geo.rows(image, ci * rows, ld, chunk)
                });
            }
            // Output position p, channel o at p * m + o: Y itself when channels-last, else
            // turned channels-first as Y is stored.
            let a_rows: &[u8] = if direct { image } else { col };
            let product = |out: &mut [u8]| {
                let q8 = qgemm::QOut::Q8 {
                    out,
                    rs: m,
                    cs: 1,
                    scale: &scale,
                    bias: bias_f.as_deref().map(|b| &b[..]),
                    zero: yz,
                    signed: y_dtype == DType::I8,
                };
                match &gathered {
                    Some(offsets) => qgemm::qgemm_gathered(
                        qgemm::Gathered {
                            image,
                            offsets,
                            taps: k[0] * k[1],
                            run: c,
                            fill: &fill_run,
                        },
                        osp,
                        &[xz],
                        packed,
                        &wz,
                        q8,
                    ),
                    None => qgemm::qgemm(
                        qgemm::QuantA {
                            data: a_rows,
                            m: osp,
                            ld: if direct { kk } else { ld },
                            zero: &[xz],
                            zero_padded: !direct,
                        },
                        packed,
                        &wz,
                        q8,
                    ),
                }
            };
            if nhwc_io {
                product(yb);
            } else {
                let staged = scratch(rows_out, osp * m);
                product(staged);
                transpose_bytes(staged, osp, m, 0, yb);
            }
        }
    });
    FILL_RUN.set(fill_run);
    Ok(Some(if y_dtype == DType::I8 {
        Tensor::from_vec(shape, y.into_iter().map(|v| v as i8).collect())?
    } else {
        Tensor::from_vec(shape, y)?
    }))
}

thread_local! {
    /// [`qlinear_conv_layout`]'s run of fill bytes, kept between calls.
    static FILL_RUN: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// `src` into `dst`, each byte `^ flip`, split across the pool.
fn copy_flipped(src: &[u8], flip: u8, dst: &mut [u8]) {
    const PART: usize = 1 << 16;
    pool::parallel_chunks_mut(&mut dst[..src.len()], PART, |ci, part| {
        let from = &src[ci * PART..ci * PART + part.len()];
        if flip == 0 {
            part.copy_from_slice(from);
        } else {
            for (d, &v) in part.iter_mut().zip(from) {
                *d = v ^ flip;
            }
        }
    });
}

/// `FusedConv`: Conv (float) followed by the residual and activation of `epi`.
pub(crate) fn conv_fused(cx: &Ctx, epi: Epi) -> Result<Tensor> {
    conv_epi(cx, ConvKind::Float, epi, &mut None)
}

/// `FusedConv` with its residual handed over in `z` (the node its last reader): the output is
/// written in its memory (taken from `z`) where the kernel would start from a copy of it.
pub(crate) fn conv_fused_into(cx: &Ctx, z: &mut Option<Tensor>, act: Act) -> Result<Tensor> {
    conv_epi(cx, ConvKind::Float, Epi { z: None, act }, z)
}

/// A convolution of `kind` followed by `epi`; `spare`: the residual handed over (then `epi.z`
/// is `None`), taken where the output is written in its memory.
fn conv_epi(cx: &Ctx, kind: ConvKind, epi: Epi, spare: &mut Option<Tensor>) -> Result<Tensor> {
    let (x, w) = (
        cx.t(0)?,
        cx.t(if kind == ConvKind::QLinear { 3 } else { 1 })?,
    );
    if x.rank() < 3 || w.rank() != x.rank() {
        kbail!(
            "Conv expects X and W of equal rank >= 3, got {:?} and {:?}",
            x.shape(),
            w.shape()
        );
    }
    let nd = x.rank() - 2;
    let (n, c) = (x.shape()[0], x.shape()[1]);
    let m = w.shape()[0];
    let group = cx.ai("group", 1).max(1) as usize;
    let cg = w.shape()[1];
    if cg * group != c || m % group != 0 {
        kbail!(
            "channels {c}, weights {:?} and group {group} disagree",
            w.shape()
        );
    }
    let k: Vec<usize> = w.shape()[2..].to_vec();
    let g = geom(cx, &x.shape()[2..], &k, false)?;
    let bias_f32 = cx
        .opt(2)
        .is_none_or(|b| b.dtype() == DType::F32 && b.len() == m);
    if kind == ConvKind::Float && nd == 2 && fast::all_f32(&[x, w]) && bias_f32 {
        let geom2 = linear::Conv2d {
            group,
            k: [k[0], k[1]],
            s: [g.s[0], g.s[1]],
            d: [g.d[0], g.d[1]],
            pad: [g.pad_begin[0], g.pad_begin[1]],
            out: [g.outs[0], g.outs[1]],
        };
        return linear::conv2d(
            x,
            w,
            cx.opt(2),
            &geom2,
            epi,
            spare,
            cx.packed_a(1),
            cx.packed_winograd(1),
        );
    }
    // The reference path reads a handed-over residual as it would read the input.
    let epi = match spare.as_ref() {
        Some(t) => Epi { z: Some(t), ..epi },
        None => epi,
    };
    let (xv, wv, bias) = match kind {
        // Weight zero points (and scales) are per output channel (dim 0).
        ConvKind::Integer => (
            minus_zp(x, cx.opt(2), false)?,
            per_channel(w, cx.opt(3), None)?,
            None,
        ),
        ConvKind::Float => (
            x.to_f64_vec()?,
            w.to_f64_vec()?,
            cx.opt(2).map(|b| b.to_f64_vec()).transpose()?,
        ),
        ConvKind::QLinear => {
            let xs = cx.t(1)?.scalar_f64()?;
            let xv: Vec<f64> = minus_zp(x, cx.opt(2), false)?
                .iter()
                .map(|v| v * xs)
                .collect();
            let wv = per_channel(w, cx.opt(5), Some(cx.t(4)?))?;
            // int32 bias is in units of x_scale * w_scale
            let ws = per_channel(
                &Tensor::from_vec(vec![m], vec![1f64; m])?,
                None,
                Some(cx.t(4)?),
            )?;
            let bias = cx.opt(8).map(|b| -> Result<Vec<f64>> {
                Ok(b.to_f64_vec()?
                    .iter()
                    .enumerate()
                    .map(|(o, v)| v * xs * ws[o.min(m - 1)])
                    .collect())
            });
            (xv, wv, bias.transpose()?)
        }
    };
    if bias.as_ref().is_some_and(|b| b.len() != m) {
        kbail!(
            "bias has {} entries for {m} output channels",
            bias.as_ref().map_or(0, Vec::len)
        );
    }
    let osp: usize = g.outs.iter().product();
    let isp: usize = g.ins.iter().product();
    let ksp: usize = k.iter().product();
    let ist = strides(&g.ins);
    let kidx = indices(&k);
    let oidx = indices(&g.outs);
    // For each kernel tap, the (output position, input offset) pairs that fall inside the
    // input: the same for every batch and channel, so the inner loop is a plain gather-FMA.
    let mut pairs: Vec<Vec<(u32, u32)>> = Vec::with_capacity(ksp);
    for ki in &kidx {
        let mut v = Vec::new();
        for (op, oi) in oidx.iter().enumerate() {
            let mut off = 0usize;
            let mut inside = true;
            for dd in 0..nd {
                let pos = (oi[dd] * g.s[dd] + ki[dd] * g.d[dd]) as isize - g.pad_begin[dd] as isize;
                if pos < 0 || pos >= g.ins[dd] as isize {
                    inside = false;
                    break;
                }
                off += pos as usize * ist[dd];
            }
            if inside {
                v.push((op as u32, off as u32));
            }
        }
        pairs.push(v);
    }
    if isp > u32::MAX as usize || osp > u32::MAX as usize {
        kbail!("convolution too large");
    }
    let mut out = vec![0f64; n * m * osp];
    let mpg = m / group;
    for b in 0..n {
        for oc in 0..m {
            let grp = oc / mpg;
            let o = &mut out[(b * m + oc) * osp..][..osp];
            if let Some(bv) = &bias {
                o.iter_mut().for_each(|v| *v = bv[oc]);
            }
            for ci in 0..cg {
                let ic = grp * cg + ci;
                let plane = &xv[(b * c + ic) * isp..][..isp];
                let wrow = &wv[(oc * cg + ci) * ksp..][..ksp];
                for (kp, pk) in pairs.iter().enumerate() {
                    let wk = wrow[kp];
                    for &(op, off) in pk {
                        o[op as usize] += wk * plane[off as usize];
                    }
                }
            }
        }
    }
    let mut shape = vec![n, m];
    shape.extend_from_slice(&g.outs);
    match kind {
        ConvKind::Float => epi.finish(f64_tensor(shape, out, x.dtype())?),
        ConvKind::Integer => f64_tensor(shape, out, DType::I32),
        ConvKind::QLinear => {
            let ys = cx.t(6)?.scalar_f64()?;
            let yz = cx.t(7)?;
            let zv = yz.scalar_f64()?;
            let (lo, hi) = if yz.dtype() == DType::I8 {
                (-128.0, 127.0)
            } else {
                (0.0, 255.0)
            };
            let q = out
                .iter()
                .map(|&v| ((v / ys).round_ties_even() + zv).clamp(lo, hi))
                .collect();
            f64_tensor(shape, q, yz.dtype())
        }
    }
}

thread_local! {
    /// [`qlinear_conv_fast`]'s byte buffers, kept by each thread that runs one.
    static SCRATCH: RefCell<[Aligned; 3]> = RefCell::new(Default::default());
}

/// The first `len` bytes of `v`, grown (with zeros) when shorter; 64-byte aligned, so the
/// integer GEMM's tile unit reads A's rows in place (it copies a misaligned A).
fn scratch(v: &mut Aligned, len: usize) -> &mut [u8] {
    v.resize_for(len);
    v.bytes_mut()
}

/// `com.ferrum.NhwcMaxPool` (made by the 8-bit layout pass from a dequantize, max pool,
/// quantize chain): MaxPool's attributes (2-D, `ceil_mode` 0) on channels-last bytes
/// `[N, H, W, C]`, unsigned or signed: each output pixel the channel-wise maximum of the
/// input pixels its window covers (padding covers none).
pub(crate) fn nhwc_max_pool(cx: &Ctx) -> Result<Tensor> {
    let x = cx.t(0)?;
    if x.rank() != 4 {
        kbail!("NhwcMaxPool expects [N, H, W, C], got {:?}", x.shape());
    }
    let k: Vec<usize> = cx
        .aints("kernel_shape")
        .ok_or_else(|| crate::kerr!("kernel_shape is required"))?
        .iter()
        .map(|&v| v.max(0) as usize)
        .collect();
    if k.len() != 2 || k.contains(&0) {
        kbail!("NhwcMaxPool needs a 2-D kernel, got {k:?}");
    }
    let (n, c) = (x.shape()[0], x.shape()[3]);
    let g = geom(cx, &x.shape()[1..3], &k, false)?;
    let (ih, iw) = (g.ins[0], g.ins[1]);
    let (oh, ow) = (g.outs[0], g.outs[1]);
    let shape = vec![n, oh, ow, c];
    // A window over padding only gives the type's lowest value (the float chain's -inf,
    // quantized).
    fn run<T: Copy + Ord + Default + Send + Sync + crate::arena::Pooled>(
        x: &[T],
        lowest: T,
        (n, c): (usize, usize),
        (ih, iw, oh, ow): (usize, usize, usize, usize),
        g: &Geom,
    ) -> Vec<T> {
        // In the session's memory, not cleared (every element is written below).
        let mut out = crate::arena::overwritten(n * oh * ow * c, T::default());
        if out.is_empty() {
            return out;
        }
        // One output row (ow pixels of c channels) per task; each pixel the maximum of its
        // window's pixels, c channels at a time (element by element: it vectorizes), read where
        // they lie in the image.
        pool::parallel_chunks_mut(&mut out, ow * c, |r, o| {
            let (b, oy) = (r / oh, r % oh);
            let img = &x[b * ih * iw * c..][..ih * iw * c];
            let rows = || {
                (0..g.k[0]).filter_map(move |ky| {
                    let iy = (oy * g.s[0] + ky * g.d[0]).checked_sub(g.pad_begin[0])?;
                    (iy < ih).then_some(iy)
                })
            };
            for (ox, px) in o.chunks_exact_mut(c).enumerate() {
                let cols = || {
                    (0..g.k[1]).filter_map(move |kx| {
                        let ix = (ox * g.s[1] + kx * g.d[1]).checked_sub(g.pad_begin[1])?;
                        (ix < iw).then_some(ix)
                    })
                };
                let mut taps = rows().flat_map(|iy| cols().map(move |ix| (iy * iw + ix) * c));
                match taps.next() {
                    Some(at) => px.copy_from_slice(&img[at..at + c]),
                    None => px.fill(lowest),
                }
                for at in taps {
                    for (d, &s) in px.iter_mut().zip(&img[at..at + c]) {
                        *d = (*d).max(s);
                    }
                }
            }
        });
        out
    }
    let dims = (ih, iw, oh, ow);
    match x.dtype() {
        DType::U8 => Tensor::from_vec(shape, run(x.as_slice::<u8>()?, 0, (n, c), dims, &g)),
        DType::I8 => Tensor::from_vec(shape, run(x.as_slice::<i8>()?, -128, (n, c), dims, &g)),
        d => kbail!("NhwcMaxPool on {d} (8-bit only)"),
    }
}

/// Transpose of 8-bit `[N, C, H, W]` to `[N, H, W, C]` (perm `[0, 2, 3, 1]`) or back (`[0, 3, 1,
/// 2]`), the layout pass's boundary transposes on quantized tensors: per image one byte matrix
/// transposed by [`transpose_bytes`]. `None` for other types and permutations.
pub(crate) fn transpose_channels_u8(x: &Tensor, perm: &[usize]) -> Result<Option<Tensor>> {
    if x.rank() != 4 || !matches!(x.dtype(), DType::U8 | DType::I8) {
        return Ok(None);
    }
    let s = x.shape();
    // Per image: rows x cols bytes become cols x rows.
    let (rows, cols) = match perm {
        [0, 2, 3, 1] => (s[1], s[2] * s[3]),
        [0, 3, 1, 2] => (s[1] * s[2], s[3]),
        _ => return Ok(None),
    };
    let shape: Vec<usize> = perm.iter().map(|&p| s[p]).collect();
    let per = rows * cols;
    let go = |src: &[u8]| {
        let mut out = crate::arena::overwritten(src.len(), 0u8);
        if per > 0 {
            for (d, sv) in out.chunks_exact_mut(per).zip(src.chunks_exact(per)) {
                transpose_bytes(sv, rows, cols, 0, d);
            }
        }
        out
    };
    Ok(Some(match x.dtype() {
        DType::U8 => Tensor::from_vec(shape, go(x.as_slice::<u8>()?))?,
        _ => {
            let bytes: Vec<u8> = x.as_slice::<i8>()?.iter().map(|&v| v as u8).collect();
            Tensor::from_vec(shape, go(&bytes).into_iter().map(|v| v as i8).collect())?
        }
    }))
}

/// `src` (`rows x cols` bytes) transposed into `dst` (`cols x rows`), each byte `^ flip`.
/// Split across the pool by rows of `dst`; 8 x 8 blocks are transposed in eight u64 words
/// ([`transpose8x8`]), the edges byte by byte.
fn transpose_bytes(src: &[u8], rows: usize, cols: usize, flip: u8, dst: &mut [u8]) {
    let per = cols
        .div_ceil(pool::threads() * 2)
        .max(64)
        .next_multiple_of(8);
    let flip8 = u64::from_ne_bytes([flip; 8]);
    pool::parallel_chunks_mut(&mut dst[..rows * cols], per * rows, |ci, part| {
        let j0 = ci * per;
        let nj = part.len() / rows;
        let (full_i, full_j) = (rows / 8 * 8, nj / 8 * 8);
        for i0 in (0..full_i).step_by(8) {
            for jb in (0..full_j).step_by(8) {
                let mut r = [0u64; 8];
                for (q, w) in r.iter_mut().enumerate() {
                    let at = (i0 + q) * cols + j0 + jb;
                    *w = u64::from_le_bytes(src[at..at + 8].try_into().expect("8 bytes")) ^ flip8;
                }
                transpose8x8(&mut r);
                for (q, w) in r.iter().enumerate() {
                    let at = (jb + q) * rows + i0;
                    part[at..at + 8].copy_from_slice(&w.to_le_bytes());
                }
            }
        }
        // The columns of whole row blocks that do not fill a block.
        for i in 0..full_i {
            for j in full_j..nj {
                part[j * rows + i] = src[i * cols + j0 + j] ^ flip;
            }
        }
        // The last rows (all of them for fewer than 8: an image's planes made channels-last),
        // output row by output row.
        let planes = |i0: usize| (i0..rows).map(move |i| &src[i * cols + j0..][..nj]);
        match rows - full_i {
            0 => {}
            1 => interleave::<1>(planes(full_i), rows, full_i, flip, part),
            2 => interleave::<2>(planes(full_i), rows, full_i, flip, part),
            3 => interleave::<3>(planes(full_i), rows, full_i, flip, part),
            4 => interleave::<4>(planes(full_i), rows, full_i, flip, part),
            5 => interleave::<5>(planes(full_i), rows, full_i, flip, part),
            6 => interleave::<6>(planes(full_i), rows, full_i, flip, part),
            _ => interleave::<7>(planes(full_i), rows, full_i, flip, part),
        }
    });
}

/// Bytes `i0..i0 + R` of each output row (`rows` bytes apart in `part`) from the `R` source
/// rows `planes` (each as long as `part` has output rows), XORed with `flip`.
#[inline(always)]
fn interleave<'a, const R: usize>(
    planes: impl Iterator<Item = &'a [u8]>,
    rows: usize,
    i0: usize,
    flip: u8,
    part: &mut [u8],
) {
    let mut p = [&[][..]; R];
    for (d, s) in p.iter_mut().zip(planes) {
        *d = s;
    }
    let nj = part.len() / rows;
    let p = p.map(|s| &s[..nj]);
    for (j, out) in part.chunks_exact_mut(rows).enumerate() {
        let out = &mut out[i0..i0 + R];
        for i in 0..R {
            out[i] = p[i][j] ^ flip;
        }
    }
}

/// Transposes the 8 x 8 bytes held in `r` (byte `j` of word `i`, little-endian, is element
/// `(i, j)`): swaps of 1-byte, then 2-byte, then 4-byte blocks between word pairs.
#[inline(always)]
fn transpose8x8(r: &mut [u64; 8]) {
    const MASKS: [(u32, u64); 3] = [
        (8, 0x00FF_00FF_00FF_00FF),
        (16, 0x0000_FFFF_0000_FFFF),
        (32, 0x0000_0000_FFFF_FFFF),
    ];
    for (stage, &(shift, mask)) in MASKS.iter().enumerate() {
        let d = 1 << stage;
        for i in 0..8 {
            if i & d == 0 {
                let t = ((r[i] >> shift) ^ r[i + d]) & mask;
                r[i + d] ^= t;
                r[i] ^= t << shift;
            }
        }
    }
}

/// QLinearConv's filter (`M x C x kh x kw`, 8-bit) packed as the B (`kh kw C x M`, rows in
/// the patches' (tap, channel) order) of `col(X)^T W^T`.
pub(crate) fn pack_int_filter(w: &Tensor) -> Result<PackedI8> {
    let m = w.shape().first().copied().unwrap_or(0);
    if w.rank() != 4 || m == 0 || w.is_empty() {
        kbail!("QLinearConv filter of shape {:?}", w.shape());
    }
    let (c, taps) = (w.shape()[1], w.shape()[2] * w.shape()[3]);
    let kk = c * taps;
    // Row (tap t, channel ci) of column o is w[o, ci, t].
    let order = |v: &[u8]| -> Vec<u8> {
        let mut out = vec![0u8; v.len()];
        for o in 0..m {
            for ci in 0..c {
                for t in 0..taps {
                    out[o * kk + t * c + ci] = v[o * kk + ci * taps + t];
                }
            }
        }
        out
    };
    Ok(match w.dtype() {
        DType::I8 => {
            let bytes: Vec<u8> = w.as_slice::<i8>()?.iter().map(|&v| v as u8).collect();
            let signed: Vec<i8> = order(&bytes).into_iter().map(|v| v as i8).collect();
            PackedI8::new(kk, m, Bytes::I8(&signed), 1, kk)
        }
        DType::U8 => PackedI8::new(kk, m, Bytes::U8(&order(w.as_slice::<u8>()?)), 1, kk),
        d => kbail!("QLinearConv filter of type {d:?}"),
    })
}

/// How the rows of `col(X)^T` are made for one image stored channels last (`H x W x C`): row
/// `p` (output position `(p / ow, p % ow)`) holds, for each kernel tap in row-major order, the
/// `C` input bytes under it, or `fill` (X's zero point) where the tap falls in the padding.
struct Patches {
    c: usize,
    k: [usize; 2],
    s: [usize; 2],
    d: [usize; 2],
    pad: [usize; 2],
    ins: [usize; 2],
    ow: usize,
    fill: u8,
}

/// A geometry's key (channels, kernel, strides, dilations, padding, input size, output width
/// and positions) and its [`Patches::offsets`] table.
type KeptOffsets = ([usize; 13], std::rc::Rc<Vec<u32>>);

thread_local! {
    /// [`Patches::offsets`] tables by geometry, kept by each thread that runs a quantized
    /// convolution: the same table serves every run (and every image of a batch).
    static OFFSETS: RefCell<Vec<KeptOffsets>> =
        const { RefCell::new(Vec::new()) };
}

/// Geometries whose offset tables a thread keeps (a network has a handful).
const KEPT_OFFSETS: usize = 32;

impl Patches {
    /// [`Patches::offsets`], made once per geometry and kept (see [`OFFSETS`]).
    fn offsets_kept(&self, osp: usize) -> Option<std::rc::Rc<Vec<u32>>> {
        let key = [
            self.c,
            self.k[0],
            self.k[1],
            self.s[0],
            self.s[1],
            self.d[0],
            self.d[1],
            self.pad[0],
            self.pad[1],
            self.ins[0],
            self.ins[1],
            self.ow,
            osp,
        ];
        OFFSETS.with(|cell| {
            let mut kept = cell.borrow_mut();
            if let Some((_, t)) = kept.iter().find(|(k, _)| *k == key) {
                return Some(t.clone());
            }
            let t = std::rc::Rc::new(self.offsets(osp)?);
            if kept.len() == KEPT_OFFSETS {
                kept.remove(0);
            }
            kept.push((key, t.clone()));
            Some(t)
        })
    }

    /// Where each row's taps read the channels-last image, for [`qgemm::qgemm_gathered`]: per
    /// output position and tap (row-major), the tap's first byte, or [`qgemm::Gathered::PAD`]
    /// in the padding. `None` when the image's offsets do not fit in 32 bits.
    fn offsets(&self, osp: usize) -> Option<Vec<u32>> {
        let ([kh, kw], [ih, iw], c) = (self.k, self.ins, self.c);
        if ih * iw * c >= qgemm::Gathered::PAD as usize {
            return None;
        }
        let mut v = Vec::with_capacity(osp * kh * kw);
        for p in 0..osp {
            let (oy, ox) = (p / self.ow, p % self.ow);
            for ky in 0..kh {
                let iy = (oy * self.s[0] + ky * self.d[0]) as isize - self.pad[0] as isize;
                for kx in 0..kw {
                    let ix = (ox * self.s[1] + kx * self.d[1]) as isize - self.pad[1] as isize;
                    v.push(
                        if iy < 0 || ix < 0 || iy >= ih as isize || ix >= iw as isize {
                            qgemm::Gathered::PAD
                        } else {
                            ((iy as usize * iw + ix as usize) * c) as u32
                        },
                    );
                }
            }
        }
        Some(v)
    }

    /// Writes rows `first..` of `col(X)^T` into `out` (rows `ld` bytes apart: `kh kw C` bytes,
    /// then zeros) from the channels-last image `x`.
    fn rows(&self, x: &[u8], first: usize, ld: usize, out: &mut [u8]) {
        let [kh, kw] = self.k;
        let [ih, iw] = self.ins;
        let c = self.c;
        for (r, row) in out.chunks_exact_mut(ld).enumerate() {
            let (row, tail) = row.split_at_mut(kh * kw * c);
            tail.fill(0);
            let p = first + r;
            let (oy, ox) = (p / self.ow, p % self.ow);
            let y0 = (oy * self.s[0]) as isize - self.pad[0] as isize;
            let x0 = (ox * self.s[1]) as isize - self.pad[1] as isize;
            // Taps along a filter row read one run of kw * C bytes when they are adjacent
            // (dilation 1) and all inside: one copy instead of kw (an RGB stem's runs are 3
            // bytes).
            let whole_rows = self.d[1] == 1 && x0 >= 0 && x0 as usize + kw <= iw;
            for (ky, taps) in row.chunks_exact_mut(kw * c).enumerate() {
                let iy = y0 + (ky * self.d[0]) as isize;
                if iy < 0 || iy >= ih as isize {
                    taps.fill(self.fill);
                    continue;
                }
                let line = iy as usize * iw;
                if whole_rows {
                    let at = (line + x0 as usize) * c;
                    taps.copy_from_slice(&x[at..at + kw * c]);
                    continue;
                }
                for (kx, run) in taps.chunks_exact_mut(c).enumerate() {
                    let ix = x0 + (kx * self.d[1]) as isize;
                    if ix < 0 || ix >= iw as isize {
                        run.fill(self.fill);
                    } else {
                        let at = (line + ix as usize) * c;
                        run.copy_from_slice(&x[at..at + c]);
                    }
                }
            }
        }
    }
}

fn conv_transpose(cx: &Ctx) -> Result<Tensor> {
    let (x, w) = (cx.t(0)?, cx.t(1)?);
    let nd = x.rank() - 2;
    let (n, c) = (x.shape()[0], x.shape()[1]);
    let group = cx.ai("group", 1).max(1) as usize;
    let mpg = w.shape()[1];
    let m = mpg * group;
    let k: Vec<usize> = w.shape()[2..].to_vec();
    let ins = &x.shape()[2..];
    let s: Vec<usize> = cx
        .aints("strides")
        .map(|v| v.iter().map(|&x| x as usize).collect())
        .unwrap_or(vec![1; nd]);
    let d: Vec<usize> = cx
        .aints("dilations")
        .map(|v| v.iter().map(|&x| x as usize).collect())
        .unwrap_or(vec![1; nd]);
    let opad: Vec<usize> = cx
        .aints("output_padding")
        .map(|v| v.iter().map(|&x| x as usize).collect())
        .unwrap_or(vec![0; nd]);
    let mut pads: Vec<usize> = cx
        .aints("pads")
        .map(|v| v.iter().map(|&x| x as usize).collect())
        .unwrap_or(vec![0; 2 * nd]);
    let auto = cx.astr("auto_pad", "NOTSET");
    let full: Vec<usize> = (0..nd)
        .map(|i| s[i] * (ins[i] - 1) + opad[i] + (k[i] - 1) * d[i] + 1)
        .collect();
    // A given output shape, or SAME_*: the padding is whatever the full output exceeds it by,
    // split with the odd element at the end (SAME_UPPER) or the start.
    let given: Option<Vec<usize>> = if let Some(os) = cx.aints("output_shape") {
        Some(
            os.iter()
                .rev()
                .take(nd)
                .rev()
                .map(|&v| v as usize)
                .collect(),
        )
    } else if auto == "SAME_UPPER" || auto == "SAME_LOWER" {
        Some((0..nd).map(|i| ins[i] * s[i]).collect())
    } else {
        None
    };
    let outs: Vec<usize> = match given {
        Some(os) => {
            for i in 0..nd {
                let total = full[i].saturating_sub(os[i]);
                let (lo, hi) = if auto == "SAME_UPPER" {
                    (total / 2, total - total / 2)
                } else {
                    (total - total / 2, total / 2)
                };
                pads[i] = lo;
                pads[i + nd] = hi;
            }
            os
        }
        None => (0..nd).map(|i| full[i] - pads[i] - pads[i + nd]).collect(),
    };
    let (xv, wv) = (x.to_f64_vec()?, w.to_f64_vec()?);
    let osp: usize = outs.iter().product();
    let isp: usize = ins.iter().product();
    let ksp: usize = k.iter().product();
    let ost = strides(&outs);
    let kidx = indices(&k);
    let iidx = indices(ins);
    let cpg = c / group;
    let mut out = vec![0f64; n * m * osp];
    for b in 0..n {
        for ic in 0..c {
            let grp = ic / cpg;
            for (ip, ii) in iidx.iter().enumerate() {
                let xval = xv[(b * c + ic) * isp + ip];
                for (kp, ki) in kidx.iter().enumerate() {
                    let mut off = 0usize;
                    let mut inside = true;
                    for dd in 0..nd {
                        let pos = (ii[dd] * s[dd] + ki[dd] * d[dd]) as isize - pads[dd] as isize;
                        if pos < 0 || pos >= outs[dd] as isize {
                            inside = false;
                            break;
                        }
                        off += pos as usize * ost[dd];
                    }
                    if !inside {
                        continue;
                    }
                    for oj in 0..mpg {
                        let oc = grp * mpg + oj;
                        out[(b * m + oc) * osp + off] += xval * wv[(ic * mpg + oj) * ksp + kp];
                    }
                }
            }
        }
    }
    if let Some(bias) = cx.opt(2) {
        let bv = bias.to_f64_vec()?;
        for b in 0..n {
            for oc in 0..m {
                for v in &mut out[(b * m + oc) * osp..(b * m + oc + 1) * osp] {
                    *v += bv[oc];
                }
            }
        }
    }
    let mut shape = vec![n, m];
    shape.extend_from_slice(&outs);
    f64_tensor(shape, out, x.dtype())
}

#[derive(Clone, Copy, PartialEq)]
enum Pool {
    Max,
    Avg,
    Lp(f64),
}

/// AveragePool over the two spatial dims of `planes` float32 planes: per output the taps inside
/// the input summed in f64 in row-major tap order and divided by their count (or, with
/// `include_pad`, by the taps inside the padded extent), rounded once, as the general path
/// computes it; planes spread over the pool's threads.
fn avg_pool2d_f32(
    x: &[f32],
    planes: usize,
    g: &Geom,
    pads_end: &[usize],
    include_pad: bool,
) -> Vec<f32> {
    let (ih, iw) = (g.ins[0], g.ins[1]);
    let (oh, ow) = (g.outs[0], g.outs[1]);
    let (isp, osp) = (ih * iw, oh * ow);
    // Along one dim: the input positions output `o` reads, and how many taps lie in the
    // padded extent.
    let span = |o: usize, dd: usize| -> (Vec<usize>, usize) {
        let (mut inside, mut padded) = (Vec::new(), 0);
        for k in 0..g.k[dd] {
            let pos = (o * g.s[dd] + k * g.d[dd]) as isize - g.pad_begin[dd] as isize;
            if pos >= -(g.pad_begin[dd] as isize) && pos < (g.ins[dd] + pads_end[dd]) as isize {
                padded += 1;
            }
            if pos >= 0 && pos < g.ins[dd] as isize {
                inside.push(pos as usize);
            }
        }
        (inside, padded)
    };
    let rows: Vec<(Vec<usize>, usize)> = (0..oh).map(|o| span(o, 0)).collect();
    let cols: Vec<(Vec<usize>, usize)> = (0..ow).map(|o| span(o, 1)).collect();
    // Per kernel column kx: the outputs whose tap lies inside the input row (a run `lo..hi`, as
    // the position grows with the output), and the position of output 0's tap (may be
    // negative).
    let (sw, dw, pw) = (g.s[1] as isize, g.d[1] as isize, g.pad_begin[1] as isize);
    let runs: Vec<(usize, usize, isize)> = (0..g.k[1])
        .map(|kx| {
            let at = |ox: usize| ox as isize * sw + kx as isize * dw - pw;
            let lo = (0..ow).find(|&ox| at(ox) >= 0).unwrap_or(ow);
            let hi = (lo..ow).find(|&ox| at(ox) >= iw as isize).unwrap_or(ow);
            (lo, hi, at(0))
        })
        .collect();
    let div: Vec<f64> = (0..osp)
        .map(|i| {
            let ((ys, ypad), (xs, xpad)) = (&rows[i / ow], &cols[i % ow]);
            let count = if include_pad {
                ypad * xpad
            } else {
                ys.len() * xs.len()
            };
            count.max(1) as f64
        })
        .collect();
    // Counts that are all powers of two (a 2x2 window, say) divide exactly as multiplications
    // by their reciprocals: the same quotients, at a fraction of a division's cost.
    let pow2 = div.iter().all(|&d| (d as u64).is_power_of_two());
    let div: Vec<f64> = if pow2 {
        div.iter().map(|&d| 1.0 / d).collect()
    } else {
        div
    };
    let mut out = vec![0f32; planes * osp];
    if osp == 0 {
        return out;
    }
    let ys: Vec<Vec<usize>> = rows.into_iter().map(|(ys, _)| ys).collect();
    let walk = super::vecmath::AvgPoolWalk {
        rows: &ys,
        runs: &runs,
        stride: g.s[1],
        div: &div,
        recip: pow2,
    };
    fast::par_rows(&mut out, osp, 1 << 14, |first, o| {
        let mut acc = vec![0f64; ow];
        for (r, plane) in o.chunks_mut(osp).enumerate() {
            let xp = &x[(first + r) * isp..][..isp];
            super::vecmath::avg_pool_plane(xp, iw, plane, &walk, &mut acc);
        }
    });
    out
}

fn pool(cx: &Ctx, kind: Pool, global: bool) -> Result<Vec<Value>> {
    let x = cx.t(0)?;
    if x.rank() < 3 {
        kbail!("pooling expects N, C and spatial dims");
    }
    let (n, c) = (x.shape()[0], x.shape()[1]);
    let ins = &x.shape()[2..];
    let nd = ins.len();
    let k: Vec<usize> = if global {
        ins.to_vec()
    } else {
        cx.aints("kernel_shape")
            .ok_or_else(|| crate::kerr!("kernel_shape is required"))?
            .iter()
            .map(|&v| v.max(0) as usize)
            .collect()
    };
    let g = if global {
        Geom {
            ins: ins.to_vec(),
            k: k.clone(),
            s: vec![1; nd],
            d: vec![1; nd],
            pad_begin: vec![0; nd],
            outs: vec![1; nd],
        }
    } else {
        geom(cx, ins, &k, cx.ai("ceil_mode", 0) != 0)?
    };
    let pads_end: Vec<usize> = if global {
        vec![0; nd]
    } else {
        cx.aints("pads")
            .map(|v| v[nd..].iter().map(|&x| x as usize).collect())
            .unwrap_or(vec![0; nd])
    };
    let include_pad = cx.ai("count_include_pad", 0) != 0;
    if kind == Pool::Max && nd == 2 && x.dtype() == DType::F32 && cx.node.outputs.len() < 2 {
        let g2 = linear::Conv2d {
            group: 1,
            k: [g.k[0], g.k[1]],
            s: [g.s[0], g.s[1]],
            d: [g.d[0], g.d[1]],
            pad: [g.pad_begin[0], g.pad_begin[1]],
            out: [g.outs[0], g.outs[1]],
        };
        let v = fast::maxpool2d(x.as_slice::<f32>()?, n * c, (ins[0], ins[1]), &g2);
        let mut shape = vec![n, c];
        shape.extend_from_slice(&g.outs);
        return Ok(vec![Value::Tensor(Tensor::from_vec(shape, v)?)]);
    }
    if kind == Pool::Avg && global && x.dtype() == DType::F32 && !ins.contains(&0) {
        let v = fast::global_avg_pool_f32(x.as_slice::<f32>()?, ins.iter().product());
        let mut shape = vec![n, c];
        shape.extend_from_slice(&g.outs);
        return Ok(vec![Value::Tensor(Tensor::from_vec(shape, v)?)]);
    }
    if kind == Pool::Avg && nd == 2 && x.dtype() == DType::F32 && cx.node.outputs.len() < 2 {
        let v = avg_pool2d_f32(x.as_slice::<f32>()?, n * c, &g, &pads_end, include_pad);
        let mut shape = vec![n, c];
        shape.extend_from_slice(&g.outs);
        return Ok(vec![Value::Tensor(Tensor::from_vec(shape, v)?)]);
    }
    let xv = x.to_f64_vec()?;
    let osp: usize = g.outs.iter().product();
    let isp: usize = ins.iter().product();
    let ist = strides(ins);
    let kidx = indices(&g.k);
    let oidx = indices(&g.outs);
    let mut out = vec![0f64; n * c * osp];
    let mut arg = vec![0i64; n * c * osp];
    let col_major = cx.ai("storage_order", 0) != 0;
    for nc in 0..n * c {
        for (op, oi) in oidx.iter().enumerate() {
            let mut best = f64::NEG_INFINITY;
            let mut best_at = 0usize;
            let mut sum = 0.0;
            let mut count = 0usize;
            let mut pad_count = 0usize;
            for ki in &kidx {
                let mut off = 0usize;
                let mut inside = true;
                let mut in_pad = true;
                for dd in 0..nd {
                    let pos =
                        (oi[dd] * g.s[dd] + ki[dd] * g.d[dd]) as isize - g.pad_begin[dd] as isize;
                    if pos < -(g.pad_begin[dd] as isize)
                        || pos >= (g.ins[dd] + pads_end[dd]) as isize
                    {
                        in_pad = false;
                    }
                    if pos < 0 || pos >= g.ins[dd] as isize {
                        inside = false;
                    } else {
                        off += pos as usize * ist[dd];
                    }
                }
                if in_pad {
                    pad_count += 1;
                }
                if !inside {
                    continue;
                }
                let v = xv[nc * isp + off];
                count += 1;
                match kind {
                    Pool::Max => {
                        if v > best || (v.is_nan() && !best.is_nan()) {
                            best = v;
                            best_at = off;
                        }
                    }
                    Pool::Avg => sum += v,
                    Pool::Lp(p) => sum += v.abs().powf(p),
                }
            }
            out[nc * osp + op] = match kind {
                Pool::Max => best,
                Pool::Avg => sum / (if include_pad { pad_count } else { count }).max(1) as f64,
                Pool::Lp(p) => sum.powf(1.0 / p),
            };
            let idx = if col_major && nd == 2 {
                let (h, w) = (ins[0], ins[1]);
                let (r, cc) = (best_at / w, best_at % w);
                r + cc * h
            } else {
                best_at
            };
            arg[nc * osp + op] = (nc * isp + idx) as i64;
        }
    }
    let mut shape = vec![n, c];
    shape.extend_from_slice(&g.outs);
    let y = f64_tensor(shape.clone(), out, x.dtype())?;
    let mut res = vec![Value::Tensor(y)];
    if kind == Pool::Max && cx.node.outputs.len() > 1 {
        res.push(Value::Tensor(Tensor::from_vec(shape, arg)?));
    }
    Ok(res)
}

/// The static rules of Conv (also a fused convolution's), by the kernels' own geometry.
pub const CONV_RULES: Rules = Rules::with(|k| window(k, Some(1)), |k, out| filter_flops(k, 1, out));

/// The static rules of the convolutions and pools: the output's dims by the kernels' own
/// geometry ([`geom_of`]); a multiply-add per filter tap and output (pools: an operation).
pub fn rules(op: &str) -> Option<Rules> {
    Some(match op {
        "Conv" => CONV_RULES,
        "QLinearConv" => Rules::with(|k| window(k, Some(3)), |k, out| filter_flops(k, 3, out)),
        "MaxPool" | "AveragePool" => Rules::with(
            |k| window(k, None),
            |k, out| {
                let taps = k
                    .aints("kernel_shape")?
                    .iter()
                    .try_fold(1.0, |a, &v| (v > 0).then_some(a * v as f64))?;
                Some(numel(out) * taps)
            },
        ),
        "GlobalAveragePool" | "GlobalMaxPool" => Rules::with(
            |k| {
                let x = k.dims(0)?;
                let mut o = x.get(..2)?.to_vec();
                o.extend(std::iter::repeat_n(1, x.len() - 2));
                Some(Inferred::dims(o))
            },
            per_input,
        ),
        _ => return None,
    })
}

/// The shape rule of an `[N, C, spatial..]` window op: the filter's `[M, C/group, k..]` from
/// input `filter` (a convolution) or `kernel_shape` (a pool).
fn window(k: &Known, filter: Option<usize>) -> Option<Inferred> {
    let x = k.dims(0)?;
    let ins = x.get(2..)?;
    let (m, taps): (usize, Vec<usize>) = match filter {
        Some(f) => {
            let w = k.dims(f)?;
            (*w.first()?, w.get(2..)?.to_vec())
        }
        None => (
            x[1],
            k.aints("kernel_shape")?
                .iter()
                .map(|&v| usize::try_from(v).ok())
                .collect::<Option<_>>()?,
        ),
    };
    let ceil = filter.is_none() && k.ai("ceil_mode", 0) != 0;
    let g = geom_of(k.node, ins, &taps, ceil).ok()?;
    let mut out = vec![x[0], m];
    out.extend_from_slice(&g.outs);
    Some(Inferred::dims(out))
}

/// A convolution's FLOPs: a multiply-add per output and tap of one group's inputs (the filter
/// `[M, C/group, k..]` at input `filter`).
pub(crate) fn filter_flops(k: &Known, filter: usize, out: &[usize]) -> Option<f64> {
    let w = k.dims(filter)?;
    Some(2.0 * numel(out) * numel(w.get(1..)?))
}

/// Convolution and pooling ops; `None` when `cx`'s op is not one of them.
pub fn kernel(op: &str) -> Option<Kernel> {
    let k: Kernel = match op {
        "DeformConv" => |cx| one(deform_conv(cx)?),
        "Conv" => |cx| one(conv(cx, ConvKind::Float)?),
        "ConvInteger" => |cx| one(conv(cx, ConvKind::Integer)?),
        "QLinearConv" => |cx| one(conv(cx, ConvKind::QLinear)?),
        "ConvTranspose" => |cx| one(conv_transpose(cx)?),
        "MaxPool" => |cx| pool(cx, Pool::Max, false),
        "AveragePool" => |cx| pool(cx, Pool::Avg, false),
        "LpPool" => |cx| pool(cx, Pool::Lp(cx.ai("p", 2) as f64), false),
        "GlobalMaxPool" => |cx| pool(cx, Pool::Max, true),
        "GlobalAveragePool" => |cx| pool(cx, Pool::Avg, true),
        "GlobalLpPool" => |cx| pool(cx, Pool::Lp(cx.ai("p", 2) as f64), true),
        _ => return None,
    };
    Some(k)
}

/// DeformConv (2-D): each kernel tap samples X bilinearly at its offset position (zero outside),
/// scaled by the optional mask.
pub fn deform_conv(cx: &Ctx) -> Result<Tensor> {
    let (x, w, off) = (cx.t(0)?, cx.t(1)?, cx.t(2)?);
    if x.rank() != 4 || w.rank() != 4 || off.rank() != 4 {
        return Err(unsupported("DeformConv other than 2-D"));
    }
    let (n, ic, ih, iw) = (x.shape()[0], x.shape()[1], x.shape()[2], x.shape()[3]);
    let (oc, icg, kh, kw) = (w.shape()[0], w.shape()[1], w.shape()[2], w.shape()[3]);
    let group = cx.ai("group", 1).max(1) as usize;
    let og = cx.ai("offset_group", 1).max(1) as usize;
    let st = cx.aints("strides").unwrap_or(vec![1, 1]);
    let dl = cx.aints("dilations").unwrap_or(vec![1, 1]);
    let pads = cx.aints("pads").unwrap_or(vec![0; 4]);
    let (oh, ow) = (off.shape()[2], off.shape()[3]);
    if icg * group != ic
        || oc % group != 0
        || ic % og != 0
        || off.shape()[1] != og * kh * kw * 2
        || off.shape()[0] != n
    {
        kbail!(
            "DeformConv shapes disagree: X {:?}, W {:?}, offset {:?}",
            x.shape(),
            w.shape(),
            off.shape()
        );
    }
    let (xv, wv, ov) = (x.to_f64_vec()?, w.to_f64_vec()?, off.to_f64_vec()?);
    let bias = cx.opt(3).map(|t| t.to_f64_vec()).transpose()?;
    let mask = cx.opt(4).map(|t| t.to_f64_vec()).transpose()?;
    if mask
        .as_ref()
        .is_some_and(|m| m.len() != n * og * kh * kw * oh * ow)
    {
        kbail!("mask has the wrong size");
    }
    let ocg = oc / group;
    let icog = ic / og;
    let sample = |plane: &[f64], y: f64, xx: f64| -> f64 {
        let (y0, x0) = (y.floor(), xx.floor());
        let (fy, fx) = (y - y0, xx - x0);
        let at = |r: f64, c: f64| -> f64 {
            if r < 0.0 || c < 0.0 || r >= ih as f64 || c >= iw as f64 {
                0.0
            } else {
                plane[r as usize * iw + c as usize]
            }
        };
        at(y0, x0) * (1.0 - fy) * (1.0 - fx)
            + at(y0, x0 + 1.0) * (1.0 - fy) * fx
            + at(y0 + 1.0, x0) * fy * (1.0 - fx)
            + at(y0 + 1.0, x0 + 1.0) * fy * fx
    };
    let mut out = vec![0f64; n * oc * oh * ow];
    for b in 0..n {
        for o in 0..oc {
            for i in 0..oh {
                for j in 0..ow {
                    let mut s = bias.as_ref().map_or(0.0, |bv| bv[o]);
                    for c in 0..ic {
                        if c / icg != o / ocg {
                            continue;
                        }
                        let g = c / icog;
                        let plane = &xv[(b * ic + c) * ih * iw..][..ih * iw];
                        for p in 0..kh {
                            for q in 0..kw {
                                let k = (g * kh + p) * kw + q;
                                let oy = ov[((b * og * kh * kw + k) * 2 * oh + i) * ow + j];
                                let ox = ov[(((b * og * kh * kw + k) * 2 + 1) * oh + i) * ow + j];
                                let y =
                                    (-pads[0] + st[0] * i as i64 + p as i64 * dl[0]) as f64 + oy;
                                let xx =
                                    (-pads[1] + st[1] * j as i64 + q as i64 * dl[1]) as f64 + ox;
                                let m = mask
                                    .as_ref()
                                    .map_or(1.0, |m| m[((b * og * kh * kw + k) * oh + i) * ow + j]);
                                let v = sample(plane, y as f32 as f64, xx as f32 as f64);
                                s += v * wv[((o * icg + c % icg) * kh + p) * kw + q] * m;
                            }
                        }
                    }
                    out[((b * oc + o) * oh + i) * ow + j] = s;
                }
            }
        }
    }
    f64_tensor(vec![n, oc, oh, ow], out, x.dtype())
}

#[cfg(test)]
mod tests {
    use super::{transpose_bytes, transpose_channels_u8};
    use crate::tensor::Tensor;
    use rand::{Rng, SeedableRng};

    /// The 8-bit channels-last max pool of a node with these attributes.
    fn max_pool_node(x: &Tensor, k: [i64; 2], s: [i64; 2], d: [i64; 2], pads: [i64; 4]) -> Tensor {
        use crate::ir::{Attr, Node, ValueId};
        use crate::tensor::Value;
        let node = Node {
            name: "pool".into(),
            op: "NhwcMaxPool".into(),
            domain: crate::passes::DOMAIN.into(),
            opset: 1,
            inputs: vec![Some(ValueId(0))],
            outputs: vec![Some(ValueId(1))],
            attrs: [
                ("kernel_shape", k.to_vec()),
                ("strides", s.to_vec()),
                ("dilations", d.to_vec()),
                ("pads", pads.to_vec()),
            ]
            .into_iter()
            .map(|(n, v)| (n.to_string(), Attr::Ints(v)))
            .collect(),
            implicit_inputs: vec![],
        };
        let input = Value::Tensor(x.clone());
        match crate::exec::eval_node(&node, &[Some(&input)])
            .unwrap()
            .remove(0)
        {
            Value::Tensor(t) => t,
            v => panic!("not a tensor: {v:?}"),
        }
    }

    #[test]
    fn channels_last_byte_max_pool_matches_the_window_maximum() {
        // Fresh shapes, windows, strides, dilations and pads (some windows wholly in the
        // padding), signed and unsigned, 1-3 threads: each output byte against the maximum over
        // its window's pixels taken one by one (the type's lowest value for an empty window).
        let seed: u64 = rand::random();
        let mut r = rand::rngs::StdRng::seed_from_u64(seed);
        for case in 0..40 {
            let (n, h, w, c) = (
                r.gen_range(1..3),
                r.gen_range(1..12),
                r.gen_range(1..12),
                r.gen_range(1..70),
            );
            let k = [r.gen_range(1..4), r.gen_range(1..4)];
            let s = [r.gen_range(1..3), r.gen_range(1..3)];
            let d = [r.gen_range(1..3), r.gen_range(1..3)];
            let pads = [0, 0, 0, 0].map(|_| r.gen_range(0..4i64));
            // Skip windows larger than the padded image (no output).
            let out = |i: usize| {
                let span = (k[i] - 1) * d[i] + 1;
                let size = [h, w][i] as i64 + pads[i] + pads[i + 2];
                (size >= span).then(|| ((size - span) / s[i] + 1) as usize)
            };
            let (Some(oh), Some(ow)) = (out(0), out(1)) else {
                continue;
            };
            let bytes: Vec<u8> = (0..n * h * w * c).map(|_| r.gen()).collect();
            let signed = case % 2 == 1;
            let x = if signed {
                Tensor::from_vec(vec![n, h, w, c], bytes.iter().map(|&v| v as i8).collect())
            } else {
                Tensor::from_vec(vec![n, h, w, c], bytes.clone())
            }
            .unwrap();
            let value = |v: u8| if signed { v as i8 as i32 } else { v as i32 };
            for threads in 1..=3 {
                ferrum_kernels::pool::set_threads(Some(threads));
                let y = max_pool_node(&x, k, s, d, pads);
                assert_eq!(y.shape(), [n, oh, ow, c], "seed {seed} case {case}");
                let got: Vec<i32> = if signed {
                    y.as_slice::<i8>()
                        .unwrap()
                        .iter()
                        .map(|&v| v as i32)
                        .collect()
                } else {
                    y.as_slice::<u8>()
                        .unwrap()
                        .iter()
                        .map(|&v| v as i32)
                        .collect()
                };
                for (at, &g) in got.iter().enumerate() {
                    let (b, oy, ox, ch) =
                        (at / (oh * ow * c), at / (ow * c) % oh, at / c % ow, at % c);
                    let mut want = if signed { -128 } else { 0 };
                    for ky in 0..k[0] {
                        for kx in 0..k[1] {
                            let iy = (oy as i64 * s[0] + ky * d[0]) - pads[0];
                            let ix = (ox as i64 * s[1] + kx * d[1]) - pads[1];
                            if (0..h as i64).contains(&iy) && (0..w as i64).contains(&ix) {
                                let i = ((b * h + iy as usize) * w + ix as usize) * c + ch;
                                want = want.max(value(bytes[i]));
                            }
                        }
                    }
                    assert_eq!(
                        g, want,
                        "seed {seed} case {case}: {n}x{h}x{w}x{c}, k {k:?} s {s:?} d {d:?} \
                         pads {pads:?}, output ({b}, {oy}, {ox}, {ch}), {threads} threads"
                    );
                }
            }
        }
        ferrum_kernels::pool::set_threads(None);
    }

    #[test]
    fn channel_transposes_of_bytes_match_the_generic_transpose() {
        // Both directions, signed and unsigned, batch 1-2, against the strided gather.
        let seed: u64 = rand::random();
        let mut r = rand::rngs::StdRng::seed_from_u64(seed);
        for case in 0..20 {
            let s: Vec<usize> = vec![
                r.gen_range(1..3),
                r.gen_range(1..20),
                r.gen_range(1..13),
                r.gen_range(1..11),
            ];
            let n: usize = s.iter().product();
            let bytes: Vec<u8> = (0..n).map(|_| r.gen()).collect();
            let x = if case % 2 == 0 {
                Tensor::from_vec(s.clone(), bytes).unwrap()
            } else {
                Tensor::from_vec(s.clone(), bytes.iter().map(|&v| v as i8).collect()).unwrap()
            };
            for perm in [[0, 2, 3, 1], [0, 3, 1, 2]] {
                let got = transpose_channels_u8(&x, &perm).unwrap().unwrap();
                let want = crate::ops::shape::transpose_t(&x, &perm).unwrap();
                assert_eq!(got, want, "seed {seed} case {case} {s:?} {perm:?}");
            }
        }
    }

    #[test]
    fn byte_transpose_matches_the_plain_one() {
        // Fresh shapes with and without whole 8 x 8 blocks, the XOR of signed inputs, 1 to 3
        // threads: each output byte against `src[i][j] ^ flip` read one at a time.
        let seed: u64 = rand::random();
        let mut r = rand::rngs::StdRng::seed_from_u64(seed);
        for case in 0..60 {
            let (rows, cols) = (r.gen_range(1..70), r.gen_range(1..300));
            let flip = if case % 2 == 0 { 0 } else { 0x80 };
            let src: Vec<u8> = (0..rows * cols).map(|_| r.gen()).collect();
            for threads in 1..=3 {
                ferrum_kernels::pool::set_threads(Some(threads));
                let mut dst = vec![0u8; rows * cols];
                transpose_bytes(&src, rows, cols, flip, &mut dst);
                for i in 0..rows {
                    for j in 0..cols {
                        assert_eq!(
                            dst[j * rows + i],
                            src[i * cols + j] ^ flip,
                            "seed {seed} case {case}: {rows}x{cols}, ({i}, {j}), {threads} threads"
                        );
                    }
                }
            }
        }
        ferrum_kernels::pool::set_threads(None);
    }
}
