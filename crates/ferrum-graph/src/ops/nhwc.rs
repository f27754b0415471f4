//! `com.ferrum.NhwcConv`: a convolution on channels-last tensors, made by the layout pass
//! ([`crate::passes`], level 3) for chains of depthwise and dense convolutions.
//!
//! Inputs: X `[N, H, W, C]`, W `[kh, kw, C/group, M]`, an optional bias `[M]`, an optional
//! residual Z `[N, OH, OW, M]`; attributes `group`, `strides`, `pads` (`[top, left, bottom,
//! right]`), `dilations`, the fused `activation` (`activation_params`), and `nchw_input` (1: X
//! comes as `[N, C, H, W]`, an image entering the region, read as planes by the direct
//! kernel). Output
//! `[N, OH, OW, M]`: `act(conv(X, W) + bias + Z)`. Two kinds run: depthwise (`group = C = M`,
//! any kernel, stride, dilation and padding), as a vector multiply-add across channels per
//! output pixel and tap ([`ferrum_kernels::depthwise`]), and dense (one group), as a GEMM of
//! each image's patches `[OH*OW, kh*kw*C]` with W `[kh*kw*C, M]` (for a 1x1 with stride 1 and
//! no padding the input itself, all images at once), with the bias, residual and simple
//! activations in its epilogue; with at most [`direct::MAX_CIN`] input channels (an image) on
//! AVX-512 or AVX2, directly ([`ferrum_kernels::direct`]). Grouped convolutions that are not depthwise are refused (the
//! pass makes none).

use ferrum_kernels::gemm::{gemm_ex, gemm_ex_uninit, Bias, Epilogue, Lhs, Mat, Rhs};

use crate::ops::linear::OutBuf;
use ferrum_kernels::pool;
use ferrum_kernels::{depthwise, direct};

use crate::ops::fused::{Act, Epi};
use crate::ops::{fast, numel, unsupported, Ctx, Inferred, Known};
use crate::tensor::{DType, Tensor};
use crate::{kbail, Result};

/// Runs `NhwcConv` with the fused activation `act`. With `nchw_input` = 1, X comes as `[N, C,
/// H, W]` (the graph's image, not turned channels-last first): read where it lies by the
/// direct kernel, else turned channels-last here.
pub fn conv(cx: &Ctx, act: Act) -> Result<Tensor> {
    conv_into(cx, act, &mut None)
}

/// [`conv`] with the residual (input 3) handed over in `spare` (this node its last reader):
/// the products of the GEMM forms accumulate into its memory, the bits of adding it in their
/// epilogue; the direct and depthwise kernels read it as usual.
pub fn conv_into(cx: &Ctx, act: Act, spare: &mut Option<Tensor>) -> Result<Tensor> {
    let (x, w) = (cx.t(0)?, cx.t(1)?);
    let planes = cx.ai("nchw_input", 0) != 0;
    if x.dtype() != DType::F32 || w.dtype() != DType::F32 || x.rank() != 4 || w.rank() != 4 {
        return Err(unsupported(format!(
            "NhwcConv takes float32 X and W of rank 4, got {} {:?} and {} {:?}",
            x.dtype(),
            x.shape(),
            w.dtype(),
            w.shape()
        )));
    }
    // Planes stay planes only for the direct kernel (one group, a window wider than 1x1).
    let direct_planes = direct::worthwhile(x.shape()[1])
        && w.shape()[2] == x.shape()[1]
        && w.shape()[0] * w.shape()[1] > 1;
    let turned = if planes && !direct_planes {
        Some(fast::transpose_f32(x, &[0, 2, 3, 1])?)
    } else {
        None
    };
    let planes = planes && turned.is_none();
    let x = turned.as_ref().unwrap_or(x);
    let [n, ih, iw, c] = if planes {
        [x.shape()[0], x.shape()[2], x.shape()[3], x.shape()[1]]
    } else {
        [x.shape()[0], x.shape()[1], x.shape()[2], x.shape()[3]]
    };
    let [kh, kw, cg, m] = [w.shape()[0], w.shape()[1], w.shape()[2], w.shape()[3]];
    let group = cx.ai("group", 1).max(1) as usize;
    if cg * group != c || kh == 0 || kw == 0 {
        kbail!(
            "NhwcConv: input {:?}, filter {:?} and group {group} disagree",
            x.shape(),
            w.shape()
        );
    }
    let geo = crate::ops::conv::geom(cx, &[ih, iw], &[kh, kw], false)?;
    let (s, d) = ([geo.s[0], geo.s[1]], [geo.d[0], geo.d[1]]);
    let pad = [geo.pad_begin[0], geo.pad_begin[1]];
    let (oh, ow) = (geo.outs[0], geo.outs[1]);
    let shape = vec![n, oh, ow, m];
    let bias = match cx.opt(2) {
        Some(b) if b.dtype() == DType::F32 && b.len() == m => Some(b.as_slice::<f32>()?),
        Some(b) => kbail!(
            "NhwcConv: bias must be float32 with {m} values, got {} {:?}",
            b.dtype(),
            b.shape()
        ),
        None => None,
    };
    let (xv, wv) = (x.as_slice::<f32>()?, w.as_slice::<f32>()?);
    let depthwise = group == c && cg == 1 && m == c;
    let pointwise = group == 1 && kh == 1 && kw == 1 && s == [1, 1] && [oh, ow] == [ih, iw];
    // The GEMM forms take a residual of the output's shape handed over as their output.
    let by_gemm = !depthwise && group == 1 && (pointwise || !direct::worthwhile(c));
    let own = match spare.take_if(|t| by_gemm && t.dtype() == DType::F32 && t.shape() == shape) {
        Some(t) => Some(crate::ops::fused::into_f32(t)?),
        None => None,
    };
    let epi = Epi {
        z: spare.as_ref().or_else(|| cx.opt(3)),
        act,
    };
    let z = epi.z_exact(&shape);
    if epi.z.is_some() && z.is_none() {
        kbail!("NhwcConv: the residual must be float32 of shape {shape:?}");
    }
    let rows = n * oh * ow;
    if rows == 0 || m == 0 {
        return Tensor::from_vec(shape, vec![0f32; rows * m]);
    }
    let g = depthwise::Geometry {
        input: [ih, iw],
        channels: c,
        kernel: [kh, kw],
        stride: s,
        dilation: d,
        pad,
        output: [oh, ow],
    };
    // The kernels apply the vector activations as they store; the others follow.
    let (in_kernel, after) = crate::ops::linear::split_act(act);
    let fin = depthwise::Finish {
        bias,
        residual: z,
        act: in_kernel,
    };
    let rest = Epi {
        z: None,
        act: after,
    };
    if depthwise {
        let out = fast::filled(rows * c, |o| {
            depthwise::depthwise_nhwc(xv, wv, n, &g, &fin, o)
        });
        return rest.finish(Tensor::from_vec(shape, out)?);
    }
    if group != 1 {
        return Err(unsupported(format!(
            "NhwcConv with {group} groups of {cg} channels (depthwise or one group only)"
        )));
    }
    if !pointwise && direct::worthwhile(c) {
        let input = if planes {
            direct::Input::Nchw
        } else {
            direct::Input::Nhwc
        };
        let threads = pool::threads();
        let out = fast::filled(rows * m, |o| {
            direct::dense_with(threads, input, xv, wv, m, n, &g, &fin, o)
        });
        return rest.finish(Tensor::from_vec(shape, out)?);
    }
    let rhs = match cx.packed_b(1, crate::passes::Role::B) {
        Some(p) if p.k() == kh * kw * c && p.n() == m => Rhs::Packed(p),
        _ => Rhs::Mat(Mat::row_major(wv, m)),
    };
    let e = Epilogue {
        bias: bias.map_or(Bias::None, Bias::Col),
        act: in_kernel,
        residual: z,
    };
    let kk = kh * kw * c;
    // One product into `o` (fresh, or the residual's memory, accumulated into).
    let product = |rows: usize, lhs: Lhs, o: OutBuf, e: &Epilogue| match o {
        OutBuf::Acc(o) => gemm_ex(rows, m, kk, 1.0, lhs, rhs, 1.0, o, m, e),
        OutBuf::Fresh(o) => gemm_ex_uninit(rows, m, kk, 1.0, lhs, rhs, o, m, e),
    };
    let products = |out: OutBuf| {
        if pointwise {
            product(rows, Lhs::Mat(Mat::row_major(xv, c)), out, &e);
            return;
        }
        // Per image: its patches as rows (`[oh * ow, kh * kw * c]`, in the filter's (ky, kx,
        // c) order), times the filter.
        let (osp, isz) = (oh * ow, ih * iw * c);
        let mut col = COL.with(|v| std::mem::take(&mut *v.borrow_mut()));
        if col.len() < osp * kk {
            col = vec![0f32; osp * kk];
        }
        let geo = Patches {
            input: [ih, iw],
            c,
            k: [kh, kw],
            s,
            d,
            pad,
            ow,
        };
        let mut image = |b: usize, ob: OutBuf| {
            patches(&xv[b * isz..][..isz], &geo, &mut col[..osp * kk]);
            let e = Epilogue {
                residual: z.map(|z| &z[b * osp * m..][..osp * m]),
                ..e
            };
            product(osp, Lhs::Mat(Mat::row_major(&col, kk)), ob, &e);
        };
        match out {
            OutBuf::Acc(o) => {
                for (b, ob) in o.chunks_mut(osp * m).enumerate() {
                    image(b, OutBuf::Acc(ob));
                }
            }
            OutBuf::Fresh(o) => {
                for (b, ob) in o.chunks_mut(osp * m).enumerate() {
                    image(b, OutBuf::Fresh(ob));
                }
            }
        }
        COL.with(|v| *v.borrow_mut() = col);
    };
    let out = match own {
        Some(mut out) => {
            products(OutBuf::Acc(&mut out));
            out
        }
        None => fast::filled(rows * m, |o| products(OutBuf::Fresh(o))),
    };
    rest.finish(Tensor::from_vec(shape, out)?)
}

/// Runs `NhwcExpandDepthwise` (made by the layout pass for an inverted residual block): a 1x1
/// `NhwcConv` and the depthwise `NhwcConv` that alone reads its output, as one node. Inputs X
/// `[N, H, W, C]`, the expansion's W `[1, 1, C, M]` and optional bias `[M]`, the depthwise
/// filter `[kh, kw, 1, M]` and optional bias `[M]`, an optional residual `[N, OH, OW, M]`; the
/// depthwise convolution's attributes (`group` = M, `strides`, `pads`, `dilations`,
/// `activation`: `act`) and the expansion's activation (`expand_activation`, a vector one).
/// The expanded tensor is made a few rows at a time as the depthwise convolution reads it
/// ([`depthwise::expand_depthwise_nhwc`]): the same values as the two nodes.
pub fn expand_depthwise(cx: &Ctx, act: Act) -> Result<Tensor> {
    let (x, we, wd) = (cx.t(0)?, cx.t(1)?, cx.t(3)?);
    if [x, we, wd]
        .iter()
        .any(|t| t.dtype() != DType::F32 || t.rank() != 4)
    {
        return Err(unsupported(format!(
            "NhwcExpandDepthwise takes float32 X and filters of rank 4, got {} {:?}, {} {:?} and {} {:?}",
            x.dtype(),
            x.shape(),
            we.dtype(),
            we.shape(),
            wd.dtype(),
            wd.shape()
        )));
    }
    let [n, ih, iw, cin] = [x.shape()[0], x.shape()[1], x.shape()[2], x.shape()[3]];
    let [kh, kw, one, m] = [wd.shape()[0], wd.shape()[1], wd.shape()[2], wd.shape()[3]];
    let group = cx.ai("group", 1).max(1) as usize;
    if we.shape() != [1, 1, cin, m] || one != 1 || group != m || kh == 0 || kw == 0 {
        kbail!(
            "NhwcExpandDepthwise: input {:?}, filters {:?} and {:?} and group {group} disagree",
            x.shape(),
            we.shape(),
            wd.shape()
        );
    }
    let (e_act, e_after) = crate::ops::linear::split_act(Act::from_attrs(cx, "expand_activation")?);
    if e_after != Act::Identity {
        return Err(unsupported(format!(
            "NhwcExpandDepthwise with the expansion's activation {e_after:?} (a vector one only)"
        )));
    }
    let geo = crate::ops::conv::geom(cx, &[ih, iw], &[kh, kw], false)?;
    let (oh, ow) = (geo.outs[0], geo.outs[1]);
    let shape = vec![n, oh, ow, m];
    let bias = |i: usize| -> Result<Option<&[f32]>> {
        match cx.opt(i) {
            Some(b) if b.dtype() == DType::F32 && b.len() == m => Ok(Some(b.as_slice::<f32>()?)),
            Some(b) => kbail!(
                "NhwcExpandDepthwise: bias #{i} must be float32 with {m} values, got {} {:?}",
                b.dtype(),
                b.shape()
            ),
            None => Ok(None),
        }
    };
    let epi = Epi { z: cx.opt(5), act };
    let z = epi.z_exact(&shape);
    if epi.z.is_some() && z.is_none() {
        kbail!("NhwcExpandDepthwise: the residual must be float32 of shape {shape:?}");
    }
    let g = depthwise::Geometry {
        input: [ih, iw],
        channels: m,
        kernel: [kh, kw],
        stride: [geo.s[0], geo.s[1]],
        dilation: [geo.d[0], geo.d[1]],
        pad: [geo.pad_begin[0], geo.pad_begin[1]],
        output: [oh, ow],
    };
    let wev = we.as_slice::<f32>()?;
    let e = depthwise::Expand {
        cin,
        w: match cx.packed_b(1, crate::passes::Role::B) {
            Some(p) if p.k() == cin && p.n() == m => Rhs::Packed(p),
            _ => Rhs::Mat(Mat::row_major(wev, m)),
        },
        bias: bias(2)?,
        act: e_act,
    };
    let (in_kernel, after) = crate::ops::linear::split_act(act);
    let fin = depthwise::Finish {
        bias: bias(4)?,
        residual: z,
        act: in_kernel,
    };
    let rows = n * oh * ow;
    if rows == 0 || m == 0 {
        return Tensor::from_vec(shape, Vec::<f32>::new());
    }
    if cin == 0 {
        return Err(unsupported(
            "NhwcExpandDepthwise of an input with no channels",
        ));
    }
    let (xv, wdv) = (x.as_slice::<f32>()?, wd.as_slice::<f32>()?);
    let out = fast::filled(rows * m, |o| {
        depthwise::expand_depthwise_nhwc(xv, &e, wdv, n, &g, &fin, o)
    });
    Epi {
        z: None,
        act: after,
    }
    .finish(Tensor::from_vec(shape, out)?)
}

thread_local! {
    /// A dense [`conv`]'s patch matrix, kept by each thread that runs one (the largest so far).
    static COL: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// The geometry of one image's patches.
struct Patches {
    input: [usize; 2],
    c: usize,
    k: [usize; 2],
    s: [usize; 2],
    d: [usize; 2],
    /// Top and left.
    pad: [usize; 2],
    ow: usize,
}

/// Fills `col` (one row of `kh * kw * c` per output pixel, (ky, kx, c) order, zeros for taps
/// over the padding) from the channels-last image `x`; rows split across the threads.
fn patches(x: &[f32], g: &Patches, col: &mut [f32]) {
    let ([ih, iw], c, [kh, kw]) = (g.input, g.c, g.k);
    let kk = kh * kw * c;
    let per = (col.len() / kk).div_ceil(pool::threads() * 4).max(1);
    pool::parallel_chunks_mut(col, per * kk, |ci, chunk| {
        for (r, row) in chunk.chunks_mut(kk).enumerate() {
            let p = ci * per + r;
            let (oy, ox) = (p / g.ow, p % g.ow);
            for ky in 0..kh {
                let iy = (oy * g.s[0] + ky * g.d[0]) as isize - g.pad[0] as isize;
                for kx in 0..kw {
                    let ix = (ox * g.s[1] + kx * g.d[1]) as isize - g.pad[1] as isize;
                    let dst = &mut row[(ky * kw + kx) * c..][..c];
                    if iy < 0 || ix < 0 || iy as usize >= ih || ix as usize >= iw {
                        dst.fill(0.0);
                    } else {
                        let src = &x[(iy as usize * iw + ix as usize) * c..][..c];
                        // A few channels (an image's 3) as fixed-size moves, not a call to
                        // `memcpy` per tap.
                        match c {
                            1 => dst[0] = src[0],
                            3 => dst[..3].copy_from_slice(&src[..3]),
                            4 => dst[..4].copy_from_slice(&src[..4]),
                            _ => dst.copy_from_slice(src),
                        }
                    }
                }
            }
        }
    });
}

/// The shape rule of the channels-last window ops (`com.ferrum` NhwcConv, NhwcExpandDepthwise,
/// NhwcQLinearConv, NhwcMaxPool): X `[N, H, W, C]` (an NhwcConv's `[N, C, H, W]` with
/// `nchw_input`) to `[N, OH, OW, M]`, by the kernels' own geometry; the window and M from the
/// filter (`[kh, kw, C/group, M]`, QLinearConv's `[M, C, kh, kw]`) or, for the pool,
/// `kernel_shape` and C.
pub fn window_rule(k: &Known) -> Option<Inferred> {
    let x = k.dims(0)?;
    if x.len() != 4 {
        return None;
    }
    let op = k.node.op.as_str();
    let hw = if op == "NhwcConv" && k.ai("nchw_input", 0) != 0 {
        2
    } else {
        1
    };
    let (kh, kw, m) = match op {
        "NhwcConv" => {
            let w = k.dims(1)?;
            (*w.first()?, *w.get(1)?, *w.get(3)?)
        }
        // The window is the depthwise filter's (input 3; the expansion's is 1x1).
        "NhwcExpandDepthwise" => {
            let w = k.dims(3)?;
            (*w.first()?, *w.get(1)?, *w.get(3)?)
        }
        "NhwcQLinearConv" => {
            let w = k.dims(3)?;
            (*w.get(2)?, *w.get(3)?, *w.first()?)
        }
        _ => {
            let ks = k.aints("kernel_shape")?;
            let dim = |i: usize| usize::try_from(*ks.get(i)?).ok();
            (dim(0)?, dim(1)?, x[3])
        }
    };
    let g = crate::ops::conv::geom_of(k.node, &x[hw..hw + 2], &[kh, kw], false).ok()?;
    Some(Inferred::dims(vec![x[0], g.outs[0], g.outs[1], m]))
}

/// The cost rule of the channels-last convolutions: a multiply-add per output and filter tap
/// (NhwcConv's filter `[kh, kw, C/group, M]`; NhwcExpandDepthwise's 1x1 expansion `[1, 1, C,
/// M]` over every input pixel, then its depthwise `[kh, kw, 1, M]`; NhwcQLinearConv's `[M, C,
/// kh, kw]`, 8-bit multiply-adds counted as FLOPs).
pub fn conv_flops(k: &Known, out: &[usize]) -> Option<f64> {
    let taps = |d: &[usize]| numel(d);
    match k.node.op.as_str() {
        "NhwcConv" => Some(2.0 * numel(out) * taps(k.dims(1)?.get(..3)?)),
        "NhwcQLinearConv" => Some(2.0 * numel(out) * taps(k.dims(3)?.get(1..)?)),
        "NhwcExpandDepthwise" => {
            let (x, w) = (k.dims(0)?, k.dims(3)?);
            let pixels = numel(x.get(..3)?);
            let window = (*w.first()? * *w.get(1)?) as f64;
            Some(
                2.0 * pixels * *k.dims(1)?.get(2)? as f64 * *w.get(3)? as f64
                    + 2.0 * numel(out) * window,
            )
        }
        _ => None,
    }
}
