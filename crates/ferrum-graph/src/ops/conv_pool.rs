//! `com.ferrum.ConvMaxPool`: a dense convolution over an image's few channels followed by a
//! 2-D max pool, made by the level-3 pass for a network's stem (ResNet's 7x7 convolution, its
//! activation and 3x3 stride-2 max pool).
//!
//! Inputs: X `[N, C, H, W]` (planes, as the image enters the network), W `[kh, kw, C, M]` (the
//! direct kernel's layout), an optional bias `[M]`. Attributes: the convolution's `strides`,
//! `pads`, `dilations` and fused `activation` (`activation_params`), and the pool's
//! `pool_kernel_shape`, `pool_strides`, `pool_pads` and `pool_ceil_mode`. Output `[N, M, PH,
//! PW]`, planes: `MaxPool(act(conv(X, W) + bias))`. The convolution's rows are made as the
//! pool needs them and pooled while in cache ([`ferrum_kernels::direct::dense_max_pool_with_isa`]),
//! so the 64 x 112 x 112 output of ResNet's stem (3.2 MB) is never written out and read back.
//! The convolution's values are the direct kernel's, and a pooled value is one of them: the
//! output is that of the direct convolution then ONNX's MaxPool, bit for bit.

use ferrum_kernels::direct::{self, Input, MaxPool};
use ferrum_kernels::{depthwise, gemm, pool};

use crate::ops::conv::{geom, Window};
use crate::ops::fused::Act;
use crate::ops::{fast, numel, unsupported, Ctx, Inferred, Known};
use crate::tensor::{DType, Tensor};
use crate::{kbail, Result};

/// The pool's window (`pool_kernel_shape`, 2-D) as read from `node`.
fn pool_kernel(node: &crate::ir::Node) -> Result<[usize; 2]> {
    match crate::ops::attr_ints(node, "pool_kernel_shape").as_deref() {
        Some(&[a, b]) if a > 0 && b > 0 && a <= 1 << 24 && b <= 1 << 24 => {
            Ok([a as usize, b as usize])
        }
        k => kbail!("ConvMaxPool needs a 2-D pool_kernel_shape, got {k:?}"),
    }
}

/// Runs `ConvMaxPool` with the fused activation `act`.
pub fn conv_max_pool(cx: &Ctx, act: Act) -> Result<Tensor> {
    let (x, w) = (cx.t(0)?, cx.t(1)?);
    if x.dtype() != DType::F32 || w.dtype() != DType::F32 || x.rank() != 4 || w.rank() != 4 {
        return Err(unsupported(format!(
            "ConvMaxPool takes float32 X and W of rank 4, got {} {:?} and {} {:?}",
            x.dtype(),
            x.shape(),
            w.dtype(),
            w.shape()
        )));
    }
    let [n, c, ih, iw] = [x.shape()[0], x.shape()[1], x.shape()[2], x.shape()[3]];
    let [kh, kw, wc, m] = [w.shape()[0], w.shape()[1], w.shape()[2], w.shape()[3]];
    if wc != c || kh == 0 || kw == 0 {
        kbail!(
            "ConvMaxPool: input {:?} and filter {:?} disagree",
            x.shape(),
            w.shape()
        );
    }
    if !direct::worthwhile(c) {
        return Err(unsupported(format!(
            "ConvMaxPool over {c} channels: it runs on the direct kernel (AVX-512 or AVX2, at \
             most {} input channels)",
            direct::MAX_CIN
        )));
    }
    let conv = geom(cx, &[ih, iw], &[kh, kw], false)?;
    let [oh, ow] = [conv.outs[0], conv.outs[1]];
    let pk = pool_kernel(cx.node)?;
    let ceil = cx.ai("pool_ceil_mode", 0) != 0;
    let pg = Window::named(cx.node, "pool_")?.geom(&[oh, ow], &pk, ceil)?;
    if pg.d.iter().any(|&d| d != 1) {
        kbail!("ConvMaxPool: pool dilations {:?} (1 only)", pg.d);
    }
    let bias = match cx.opt(2) {
        Some(b) if b.dtype() == DType::F32 && b.len() == m => Some(b.as_slice::<f32>()?),
        Some(b) => kbail!(
            "ConvMaxPool: bias must be float32 with {m} values, got {} {:?}",
            b.dtype(),
            b.shape()
        ),
        None => None,
    };
    let (in_kernel, after) = crate::ops::linear::split_act(act);
    if after != Act::Identity {
        return Err(unsupported(format!(
            "ConvMaxPool with activation {act:?} (the kernel applies Relu, Clip, LeakyRelu, \
             Gelu, Sigmoid, SiLU, HardSigmoid and HardSwish)"
        )));
    }
    let g = depthwise::Geometry {
        input: [ih, iw],
        channels: c,
        kernel: [kh, kw],
        stride: [conv.s[0], conv.s[1]],
        dilation: [conv.d[0], conv.d[1]],
        pad: [conv.pad_begin[0], conv.pad_begin[1]],
        output: [oh, ow],
    };
    let p = MaxPool {
        kernel: pk,
        stride: [pg.s[0], pg.s[1]],
        pad: [pg.pad_begin[0], pg.pad_begin[1]],
        output: [pg.outs[0], pg.outs[1]],
    };
    let fin = depthwise::Finish {
        bias,
        residual: None,
        act: in_kernel,
    };
    let shape = vec![n, m, p.output[0], p.output[1]];
    let (xv, wv) = (x.as_slice::<f32>()?, w.as_slice::<f32>()?);
    let out = fast::filled(numel(&shape) as usize, |o| {
        direct::dense_max_pool_with_isa(
            gemm::isa(),
            pool::threads(),
            Input::Nchw,
            xv,
            wv,
            m,
            n,
            &g,
            &fin,
            &p,
            o,
        )
    });
    Tensor::from_vec(shape, out)
}

/// The output shape: the convolution's over X `[N, C, H, W]` and W `[kh, kw, C, M]`, then the
/// pool's.
pub fn shape_rule(k: &Known) -> Option<Inferred> {
    let (x, w) = (k.dims(0)?, k.dims(1)?);
    let (&[n, _, ih, iw], &[kh, kw, _, m]) = (x, w) else {
        return None;
    };
    let conv = crate::ops::conv::geom_of(k.node, &[ih, iw], &[kh, kw], false).ok()?;
    let pk = pool_kernel(k.node).ok()?;
    let ceil = k.ai("pool_ceil_mode", 0) != 0;
    let pg = Window::named(k.node, "pool_")
        .ok()?
        .geom(&conv.outs, &pk, ceil)
        .ok()?;
    Some(Inferred::dims(vec![n, m, pg.outs[0], pg.outs[1]]))
}

/// The cost: a multiply-add per convolution output and filter tap, and a comparison per pooled
/// output and window element.
pub fn flops(k: &Known, out: &[usize]) -> Option<f64> {
    let (x, w) = (k.dims(0)?, k.dims(1)?);
    let (&[n, _, ih, iw], &[kh, kw, c, m]) = (x, w) else {
        return None;
    };
    let conv = crate::ops::conv::geom_of(k.node, &[ih, iw], &[kh, kw], false).ok()?;
    let pk = pool_kernel(k.node).ok()?;
    let taps = (kh * kw * c) as f64;
    Some(2.0 * (n * m) as f64 * numel(&conv.outs) * taps + numel(out) * (pk[0] * pk[1]) as f64)
}
