//! float32 products on `ferrum_kernels::gemm` (blocked, packed, threaded): MatMul, Gemm and
//! 2-D Conv (im2col or direct GEMMs, a direct depthwise loop). They compute in f32 with f32
//! accumulation (the reference kernels sum in f64), so results differ from the reference by f32
//! rounding; other dtypes and forms stay on the reference loops.

use ferrum_kernels::gemm::{
    gemm_batch, gemm_ex, gemm_ex_uninit,
    patches::{every_other, valid_range},
    Act as GemmAct, Bias, Epilogue, Lhs, Mat, PackedA, PackedB, Patches, Precision, Rhs,
};
use ferrum_kernels::pool;
use ferrum_kernels::winograd::{self, WinogradFilter};

use crate::ops::elementwise::{broadcast_offsets, broadcast_to};
use crate::ops::fused::{Act, Epi};
use crate::ops::{fast, vecmath};
use crate::tensor::{DType, Tensor};
use crate::Result;

/// numpy matmul of two f32 tensors (1-D operands promoted, batch dims broadcast). `pb`: B
/// packed ahead (a 2-D constant), used where the product is one GEMM.
pub fn matmul(a: &Tensor, b: &Tensor, pb: Option<&PackedB>) -> Result<Tensor> {
    let super::nn::MatmulDims {
        m,
        k,
        n,
        abatch,
        bbatch,
        batch,
        out_shape,
    } = super::nn::MatmulDims::of(a.shape(), b.shape())?;
    let nb: usize = batch.iter().product();
    let (av, bv) = (a.as_slice::<f32>()?, b.as_slice::<f32>()?);
    if bbatch.iter().all(|&d| d == 1) && nb * m > 1 && n > 0 {
        // One shared B: A's batch rows stack into one tall GEMM, written into fresh memory.
        let rows = nb * m;
        let out = fast::filled(rows * n, |o| {
            gemm_rows(av, bv, (rows, n, k), pb, o, &Epilogue::NONE)
        });
        return Tensor::from_vec(out_shape, out);
    }
    let mut out = vec![0f32; nb * m * n];
    if bbatch.iter().all(|&d| d == 1) && out.len() == n && n > 0 {
        // One row against one B: a matrix-vector product.
        gemv(av, bv, false, k, n, &mut out);
    } else if m > 0 && n > 0 && !bbatch.iter().all(|&d| d == 1) {
        // A batch of products (attention heads): the threads split across them.
        let offs = broadcast_offsets(&[&abatch, &bbatch], &batch);
        let a_of = |bi: usize| Mat::row_major(&av[offs[0][bi] * m * k..], k);
        let b_of = |bi: usize| Mat::row_major(&bv[offs[1][bi] * k * n..], n);
        gemm_batch(nb, m, n, k, 1.0, &a_of, &b_of, &mut out);
    }
    Tensor::from_vec(out_shape, out)
}

/// `FusedMatMul`: `act((A B + bias) + z)` with the bias along the last axis and `z` the
/// residual of `epi` (numpy broadcasting for either when it is not a plain row of the output's
/// width, or the output's own shape).
pub fn matmul_bias_act(
    a: &Tensor,
    b: &Tensor,
    bias: Option<&Tensor>,
    epi: Epi,
    pb: Option<&PackedB>,
) -> Result<Tensor> {
    let act = epi.act;
    let n = *b.shape().last().unwrap_or(&1);
    let row = bias.filter(|t| {
        t.dtype() == DType::F32
            && t.len() == n
            && t.rank() <= a.rank().max(2)
            && t.shape().iter().rev().skip(1).all(|&d| d == 1)
    });
    // A (rows x k, any leading dims) times a 2-D B, bias along the columns: one GEMM whose tiles
    // get the bias (and a simple activation) as they are written.
    if let (Some(bt), 2, true) = (row, b.rank(), a.rank() >= 2 && n > 0) {
        let k = b.shape()[0];
        if a.shape().last() == Some(&k) {
            let rows = a.len() / k.max(1);
            let mut shape = a.shape().to_vec();
            *shape.last_mut().expect("rank >= 2") = n;
            // A residual of the output's own shape is added as each tile is written (with the
            // product, before the bias: `Epilogue::residual`); any other, or one beside a bf16
            // product (whose kernels take no residual), goes through `Epi::finish`.
            let bf16 = pb.is_some_and(|p| p.precision() == Precision::Bf16);
            let residual = epi.z_exact(&shape).filter(|_| !bf16);
            if epi.z.is_none() || residual.is_some() {
                let (av, bv) = (a.as_slice::<f32>()?, b.as_slice::<f32>()?);
                let (in_gemm, after) = split_act(act);
                // (k = 0 gives act(bias), as the unfused nodes would.)
                let gepi = Epilogue {
                    bias: Bias::Col(bt.as_slice::<f32>()?),
                    act: in_gemm,
                    residual,
                };
                // Fresh memory that the product fills (no zero-filling pass first).
                let mut out =
                    fast::filled(rows * n, |o| gemm_rows(av, bv, (rows, n, k), pb, o, &gepi));
                after.apply(&mut out);
                return Tensor::from_vec(shape, out);
            }
        }
    }
    let y = matmul(a, b, pb)?;
    let y = Epi {
        z: bias,
        act: Act::Identity,
    }
    .finish(y)?;
    epi.finish(y)
}

/// `out = epi(A B)` for A `rows x k` (row-major `av`) and B `k x n` (row-major `bv`, or its
/// packed copy `pb` when that has this shape).
fn gemm_rows(
    av: &[f32],
    bv: &[f32],
    (rows, n, k): (usize, usize, usize),
    pb: Option<&PackedB>,
    out: &mut [std::mem::MaybeUninit<f32>],
    epi: &Epilogue,
) {
    gemm_ex_uninit(
        rows,
        n,
        k,
        1.0,
        Lhs::Mat(Mat::row_major(av, k)),
        packed_or(pb, k, n, Mat::row_major(bv, n)),
        out,
        n,
        epi,
    );
}

/// B for the GEMM: the packed copy when there is one of B's shape (`k x n`), else `b`.
fn packed_or<'a>(pb: Option<&'a PackedB>, k: usize, n: usize, b: Mat<'a>) -> Rhs<'a> {
    match pb {
        Some(p) if p.k() == k && p.n() == n => Rhs::Packed(p),
        _ => Rhs::Mat(b),
    }
}

/// Gemm on f32: `act(alpha * op(A) * op(B) + beta * C)` (C broadcast to `m x n`; `act` is
/// FusedGemm's activation, [`Act::Identity`] for Gemm). A C that is a row of `n` (a Linear
/// layer's bias) or a column of `m` is added by the GEMM's epilogue as each tile is written,
/// with the simple activations; other shapes start the output.
#[allow(clippy::too_many_arguments)]
pub fn gemm_op(
    a: &Tensor,
    b: &Tensor,
    c: Option<&Tensor>,
    (ta, tb): (bool, bool),
    alpha: f32,
    beta: f32,
    (m, n, k): (usize, usize, usize),
    pb: Option<&PackedB>,
    act: Act,
) -> Result<Tensor> {
    let (av, bv) = (a.as_slice::<f32>()?, b.as_slice::<f32>()?);
    let am = if ta {
        Mat::transposed(av, m)
    } else {
        Mat::row_major(av, k)
    };
    let bm = if tb {
        Mat::transposed(bv, k)
    } else {
        Mat::row_major(bv, n)
    };
    let mut out = crate::arena::full(m * n, 0.0);
    // `beta * C` (computed even when beta is 0, as the reference does: 0 * inf is NaN): the
    // epilogue's bias when C is a row or a column of the output (read in place when beta is
    // 1), else the output's start.
    let cv = c.map(|c| c.as_slice::<f32>()).transpose()?;
    let cs = c.map(|c| c.shape()).unwrap_or(&[]);
    let is_row = cs.last() == Some(&n) && cs.iter().rev().skip(1).all(|&d| d == 1);
    let is_col = cs == [m, 1];
    let scaled: Option<std::borrow::Cow<[f32]>> =
        cv.filter(|_| m > 1 && (is_row || is_col)).map(|cv| {
            if beta == 1.0 {
                cv.into()
            } else {
                cv.iter().map(|&v| beta * v).collect::<Vec<f32>>().into()
            }
        });
    let bias = match &scaled {
        Some(v) if is_row => Bias::Col(v),
        Some(v) => Bias::Row(v),
        None => Bias::None,
    };
    let (in_gemm, after) = if m > 1 {
        split_act(act)
    } else {
        (GemmAct::Identity, act)
    };
    if m == 1 {
        // One row (a classifier head): a matrix-vector product, B read once, no packing, then
        // `beta * C` added (C broadcasts to `[1, n]`: one value or `n`).
        gemv(av, bv, tb, k, n, &mut out);
        match cv {
            Some(cv) => {
                let one = cv.len() == 1;
                for (j, o) in out.iter_mut().enumerate() {
                    *o = beta * cv[if one { 0 } else { j }] + alpha * *o;
                }
            }
            None => out.iter_mut().for_each(|o| *o *= alpha),
        }
    } else {
        let mut beta_eff = 0.0;
        if let (Some(c), Some(cv), None) = (c, cv, &scaled) {
            let offs = broadcast_to(c.shape(), &[m, n])?;
            for (o, &ci) in out.iter_mut().zip(&offs) {
                *o = beta * cv[ci];
            }
            beta_eff = 1.0;
        }
        gemm_ex(
            m,
            n,
            k,
            alpha,
            Lhs::Mat(am),
            packed_or(pb, k, n, bm),
            beta_eff,
            &mut out,
            n,
            &Epilogue {
                bias,
                act: in_gemm,
                residual: None,
            },
        );
    }
    after.apply(&mut out);
    Tensor::from_vec(vec![m, n], out)
}

/// `y[j] = sum_p x[p] * B(p, j)` for one row `x` of `k` values, where `B(p, j)` is
/// `b[j * k + p]` (`bt`: B given as its transpose, `n x k`) or `b[p * n + j]` (`k x n`). Columns
/// are split over the pool's threads; each sum runs in f32 over 16 lanes.
pub fn gemv(x: &[f32], b: &[f32], bt: bool, k: usize, n: usize, y: &mut [f32]) {
    let per = n.div_ceil(pool::threads()).max(64);
    pool::parallel_chunks_mut(&mut y[..n], per, |ci, ys| {
        let j0 = ci * per;
        if bt {
            vecmath::dot16_rows(x, &b[j0 * k..], k, ys);
        } else {
            vecmath::axpy_rows(x, &b[j0..], n, ys);
        }
    });
}

/// 2-D convolution geometry (NCHW).
#[derive(Debug)]
pub struct Conv2d {
    pub group: usize,
    pub k: [usize; 2],
    pub s: [usize; 2],
    pub d: [usize; 2],
    pub pad: [usize; 2],
    pub out: [usize; 2],
}

/// 2-D float32 Conv: grouped convolutions as one GEMM per image and group (`W_g` times the
/// im2col matrix of the group's input channels, or the input itself for 1x1 / stride 1 / no
/// padding), depthwise convolutions as a direct loop per channel. `spare`: the residual handed
/// over with its memory (then `epi.z` is `None`), taken where the output is written there.
#[allow(clippy::too_many_arguments)]
pub fn conv2d(
    x: &Tensor,
    w: &Tensor,
    bias: Option<&Tensor>,
    g: &Conv2d,
    epi: Epi,
    spare: &mut Option<Tensor>,
    pw: Option<&PackedA>,
    wino: Option<&WinogradFilter>,
) -> Result<Tensor> {
    let (n, c, ih, iw) = (x.shape()[0], x.shape()[1], x.shape()[2], x.shape()[3]);
    let m = w.shape()[0];
    let cg = w.shape()[1];
    let [kh, kw] = g.k;
    let [oh, ow] = g.out;
    let (xv, wv) = (x.as_slice::<f32>()?, w.as_slice::<f32>()?);
    let bv = bias.map(|b| b.as_slice::<f32>()).transpose()?;
    let osp = oh * ow;
    let isp = ih * iw;
    let shape = vec![n, m, oh, ow];
    let depthwise_form = osp == 0 || (g.group == c && cg == 1 && m == c);
    let wino = wino.filter(|f| {
        g.k == [3, 3]
            && g.s == [1, 1]
            && g.d == [1, 1]
            && g.group == 1
            && f.cin() == c
            && f.cout() == m
            && winograd::worthwhile(c, m, oh, ow)
    });
    // A residual handed over with its memory (`spare`, this node its last reader): the
    // products accumulate into it where they would start from a copy of it, which gives the
    // bits of adding it in their epilogue (`Epilogue::residual`); elsewhere it is read as usual.
    let gemm_into = |t: &Tensor| {
        !depthwise_form && wino.is_none() && t.dtype() == DType::F32 && t.shape() == shape
    };
    let own = match spare.take_if(|t| gemm_into(t)) {
        Some(t) => Some(super::fused::into_f32(t)?),
        None => None,
    };
    let epi = match spare.as_ref() {
        Some(t) => Epi { z: Some(t), ..epi },
        None => epi,
    };
    // The output starts as the residual when that has the output's shape (the products
    // accumulate into it); a residual of another shape is added by broadcasting at the end.
    let z = epi.z_exact(&shape);
    let rest_z = if z.is_some() { None } else { epi.z };
    if depthwise_form {
        // Depthwise: each output starts as `0 + b` or `z + b` (bias, residual), then the taps,
        // then the activation (unless a broadcast residual must come first).
        let nhwc =
            osp > 0 && osp <= DW_NHWC_MAX_OUT && (ow <= vecmath::DW_LANES / 2 || g.s != [1, 1]);
        let mut after = epi.act;
        let out = if nhwc || osp == 0 {
            let start = |o: &mut [std::mem::MaybeUninit<f32>]| {
                for (i, o) in o.chunks_mut(osp.max(1)).enumerate() {
                    let b = bv.map_or(0.0, |bv| bv[i % m]);
                    match z {
                        Some(z) => {
                            for (v, &zv) in o.iter_mut().zip(&z[i * osp..]) {
                                v.write(zv + b);
                            }
                        }
                        None => o.iter_mut().for_each(|v| {
                            v.write(0.0 + b);
                        }),
                    }
                }
            };
            let mut out = fast::filled(n * m * osp, start);
            if osp > 0 {
                depthwise_nhwc(xv, wv, &mut out, (n, c), (ih, iw), g);
            }
            out
        } else {
            // The plane kernel starts each plane itself and applies a cheap activation as it
            // stores, while the plane is in registers; one with an exponential (Sigmoid, SiLU,
            // GELU) runs after, vectorized over the whole output (inside the kernel's blocks it
            // would be computed one lane at a time).
            let act = match (rest_z, after.lane_op().filter(|op| !op.is_costly())) {
                (None, Some(op)) => {
                    after = Act::Identity;
                    Some(op)
                }
                _ => None,
            };
            fast::filled(n * m * osp, |o| {
                depthwise(xv, wv, o, (ih, iw), g, (bv, z), act)
            })
        };
        let rest = Epi {
            z: rest_z,
            act: after,
        };
        return rest.finish(Tensor::from_vec(shape, out)?);
    }
    // The GEMM adds the bias and applies the simple activations as it writes each tile; the
    // others (and any activation that must follow a broadcast residual) come after.
    let (in_gemm, after) = match rest_z {
        None => split_act(epi.act),
        Some(_) => (GemmAct::Identity, epi.act),
    };
    if let Some(f) = wino {
        let fin = winograd::Finish {
            bias: bv,
            residual: z,
            act: in_gemm,
        };
        let geo = winograd::Geometry {
            input: [ih, iw],
            output: [oh, ow],
            pad: g.pad,
        };
        let out = fast::filled(n * m * osp, |o| winograd::conv3x3(f, xv, n, geo, &fin, o));
        let rest = Epi {
            z: rest_z,
            act: after,
        };
        return rest.finish(Tensor::from_vec(shape, out)?);
    }
    let mpg = m / g.group;
    let kk = cg * kh * kw;
    let direct = kh == 1 && kw == 1 && g.s == [1, 1] && g.pad == [0, 0] && g.out == [ih, iw];
    // A patch matrix larger than L2 makes a round trip through memory between im2col and the
    // GEMM's packing: such f32 products pack their panels straight from the image instead
    // (implicit im2col). Smaller ones are written out, as are a bf16 weight's (its product
    // rounds the patch matrix).
    let implicit = !direct
        && kk * osp * 4 > implicit_min_bytes(g)
        && pw.is_none_or(|p| p.precision() == Precision::F32);
    // The patch matrix goes in this thread's buffer, kept between calls: im2col writes every
    // element, so a fresh zero-filled one (and its pages, faulted in anew) is wasted work.
    let mut col = if direct || implicit {
        Vec::new()
    } else {
        let mut v = COL.with(|c| std::mem::take(&mut *c.borrow_mut()));
        if v.len() < kk * osp {
            v = vec![0f32; kk * osp];
        }
        v
    };
    // A residual of the output's shape joins an f32 product's epilogue (with the product, before
    // the bias and the activation); a bf16 product accumulates into a copy of it, which gives
    // the same order.
    let z_in_epi = z.filter(|_| pw.is_none_or(|p| p.precision() == Precision::F32));
    // One product per image and group, each writing its own `mpg x osp` block of the output:
    // accumulated into the residual when the output starts as one, else written into fresh
    // memory (no zero-filling pass first: the blocks cover the whole output).
    let mut products = |out: OutBuf| {
        let mut out = out;
        for b in 0..n {
            for grp in 0..g.group {
                let xg = &xv[(b * c + grp * cg) * isp..][..cg * isp];
                let patches;
                let rhs = if direct {
                    Rhs::Mat(Mat::row_major(xg, isp))
                } else if implicit {
                    patches = Patches::new(xg, cg, [ih, iw], g.k, g.s, g.d, g.pad, g.out);
                    Rhs::Patches(&patches)
                } else {
                    im2col(xg, cg, (ih, iw), g, &mut col);
                    Rhs::Mat(Mat::row_major(&col, osp))
                };
                let at = (b * m + grp * mpg) * osp;
                let epi_g = Epilogue {
                    bias: bv.map_or(Bias::None, |bv| Bias::Row(&bv[grp * mpg..][..mpg])),
                    act: in_gemm,
                    residual: z_in_epi.map(|z| &z[at..][..mpg * osp]),
                };
                let lhs = match pw {
                    Some(p) if g.group == 1 && p.m() == mpg && p.k() == kk => Lhs::Packed(p),
                    _ => Lhs::Mat(Mat::row_major(&wv[grp * mpg * kk..], kk)),
                };
                match &mut out {
                    OutBuf::Acc(o) => gemm_ex(
                        mpg,
                        osp,
                        kk,
                        1.0,
                        lhs,
                        rhs,
                        1.0,
                        &mut o[at..][..mpg * osp],
                        osp,
                        &epi_g,
                    ),
                    OutBuf::Fresh(o) => gemm_ex_uninit(
                        mpg,
                        osp,
                        kk,
                        1.0,
                        lhs,
                        rhs,
                        &mut o[at..][..mpg * osp],
                        osp,
                        &epi_g,
                    ),
                }
            }
        }
    };
    let out = match (own, z) {
        (Some(mut out), _) => {
            products(OutBuf::Acc(&mut out));
            out
        }
        (None, Some(z)) if z_in_epi.is_none() => {
            let mut out = z.to_vec();
            products(OutBuf::Acc(&mut out));
            out
        }
        _ => fast::filled(n * m * osp, |o| products(OutBuf::Fresh(o))),
    };
    if !direct && !implicit {
        COL.with(|c| *c.borrow_mut() = col);
    }
    let rest = Epi {
        z: rest_z,
        act: after,
    };
    rest.finish(Tensor::from_vec(shape, out)?)
}

/// The patch-matrix size above which [`conv2d`] packs from the image (implicit im2col). Below
/// it, the explicit matrix stays in L2 and the packer's vector copies of whole rows beat the
/// implicit packer's per-row runs on small planes (14 x 14, 7 x 7). Measured on ResNet-50 at one
/// thread: 7 x 7 conv1 (147 x 12544, 7.4 MB) 4.5 -> 3.4 ms, 3x3 over 64 x 56 x 56 (7.2 MB)
/// ~2.6 -> ~2.2 ms, while 3x3 over 256 x 14 x 14 (1.8 MB) got ~0.2 ms slower.
const IMPLICIT_MIN_BYTES: usize = 2 << 20;

/// [`IMPLICIT_MIN_BYTES`], halved for strided windows wider than one pixel: their explicit
/// matrix is gathered column by column, while the implicit packer copies each phase row once
/// and reads runs of it. ResNet-50's 3x3 stride-2 layer over 256 x 28 x 28 (1.8 MB), one thread,
/// four alternated processes: 0.94 of the explicit time (medians), 0.97 (minima); its 3x3 over
/// 512 x 14 x 14 (0.9 MB) ran the same either way, and a 1x1 stride-2 layer over 256 x 56 x 56
/// 1.15x slower implicit (the phased copy holds every input pixel, the explicit matrix a
/// quarter of them).
fn implicit_min_bytes(g: &Conv2d) -> usize {
    if g.s != [1, 1] && g.k != [1, 1] {
        IMPLICIT_MIN_BYTES / 2
    } else {
        IMPLICIT_MIN_BYTES
    }
}

/// Where [`conv2d`]'s products go: into an output that starts as the residual, or into fresh
/// memory that they fill.
pub(crate) enum OutBuf<'a> {
    Acc(&'a mut [f32]),
    Fresh(&'a mut [std::mem::MaybeUninit<f32>]),
}

thread_local! {
    /// [`conv2d`]'s im2col matrix, kept by each thread that runs one (the largest so far).
    static COL: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// `act` split into the part the GEMM's epilogue applies in registers, bit for bit as
/// [`Act::apply1`] (Relu, Clip, LeakyRelu, Gelu, Sigmoid, SiLU, HardSigmoid, HardSwish: the
/// same float32 functions), and the part left to apply afterwards (Tanh, GeluTanh).
pub(crate) fn split_act(a: Act) -> (GemmAct, Act) {
    let g = match a {
        Act::Identity => GemmAct::Identity,
        Act::Relu => GemmAct::Relu,
        Act::Clip(lo, hi) => GemmAct::Clip { lo, hi },
        Act::LeakyRelu(s) => GemmAct::LeakyRelu(s),
        Act::Gelu => GemmAct::Gelu,
        Act::Sigmoid => GemmAct::Sigmoid,
        Act::Silu => GemmAct::Silu,
        Act::HardSigmoid(alpha, beta) => GemmAct::HardSigmoid { alpha, beta },
        Act::HardSwish => GemmAct::HardSwish,
        _ => return (GemmAct::Identity, a),
    };
    (g, Act::Identity)
}

/// Fills `col` (`cg * kh * kw` rows of `oh * ow`) with the patches of `x` (`cg` planes).
fn im2col(x: &[f32], cg: usize, (ih, iw): (usize, usize), g: &Conv2d, col: &mut [f32]) {
    let [kh, kw] = g.k;
    let [oh, ow] = g.out;
    let osp = oh * ow;
    let rows = cg * kh * kw;
    let per = rows.div_ceil(pool::threads() * 4).max(1);
    pool::parallel_chunks_mut(&mut col[..rows * osp], per * osp, |ci, chunk| {
        for (r, row) in chunk.chunks_mut(osp).enumerate() {
            let idx = ci * per + r;
            let (ch, ky, kx) = (idx / (kh * kw), (idx / kw) % kh, idx % kw);
            let plane = &x[ch * ih * iw..][..ih * iw];
            let (tx, ty) = (kx * g.d[1], ky * g.d[0]);
            let (xlo, xhi) = valid_range(iw, ow, g.s[1], tx, g.pad[1]);
            for oy in 0..oh {
                let dst = &mut row[oy * ow..][..ow];
                let iy = (oy * g.s[0] + ty) as isize - g.pad[0] as isize;
                if iy < 0 || iy >= ih as isize {
                    dst.fill(0.0);
                    continue;
                }
                let src = &plane[iy as usize * iw..][..iw];
                dst[..xlo].fill(0.0);
                dst[xhi..].fill(0.0);
                if xlo == xhi {
                    continue;
                }
                if g.s[1] == 1 {
                    let start = xlo + tx - g.pad[1];
                    dst[xlo..xhi].copy_from_slice(&src[start..start + (xhi - xlo)]);
                } else if g.s[1] == 2 {
                    // Output column ox reads input column 2 ox + tx - pad (inside the row for
                    // xlo <= ox < xhi): ResNet's stride-2 layers, in vector permutes.
                    every_other(&src[2 * xlo + tx - g.pad[1]..], &mut dst[xlo..xhi]);
                } else {
                    for (ox, v) in dst.iter_mut().enumerate().take(xhi).skip(xlo) {
                        *v = src[ox * g.s[1] + tx - g.pad[1]];
                    }
                }
            }
        }
    });
}

/// Depthwise convolution (one input and one output channel per group), accumulated into `out`
/// (batch x channels planes, holding the bias or residual): each plane is copied once into a
/// zero-padded buffer whose columns are split by phase modulo the stride (phase `r` holds padded
/// columns `r, r + s, r + 2s, ..`), so every tap reads consecutive values; each run of 16 outputs
/// sums its taps in registers, in (ky, kx) order.
/// Small output planes that are narrow (at most half of the plane kernel's 16-output blocks
/// filled: 7 x 7) or strided (the plane kernel splits the input by column phase first) take
/// the channels-last depthwise kernel, whose vectors run across channels and are always full;
/// its transposes cost more than they save on larger planes. Measured on MobileNetV2 at one
/// thread: 960 x 7 x 7 0.27 -> 0.14 ms a node, 576 x 14 x 14 stride 2 0.27 -> 0.13 ms; at
/// 384 x 14 x 14 stride 1 the plane kernel stays ahead (0.18 vs 0.19 ms).
const DW_NHWC_MAX_OUT: usize = 16 * 16;

/// Depthwise convolution (one filter per channel) through a channels-last copy: per image, the
/// zero-padded input and the starting output (bias, residual) are transposed to
/// `[row][column][channel]`, each output row is computed 16 channels at a time
/// ([`vecmath::depthwise_nhwc_row`]), and the result is transposed back; the threads split the
/// channels, each doing all of this for its own. The same operations in the same order as
/// [`depthwise`].
fn depthwise_nhwc(
    x: &[f32],
    w: &[f32],
    out: &mut [f32],
    (n, c): (usize, usize),
    (ih, iw): (usize, usize),
    g: &Conv2d,
) {
    let [kh, kw] = g.k;
    let [oh, ow] = g.out;
    let (osp, isp) = (oh * ow, ih * iw);
    // The padded extent the taps read.
    let hp = (oh - 1) * g.s[0] + (kh - 1) * g.d[0] + 1;
    let wp = (ow - 1) * g.s[1] + (kw - 1) * g.d[1] + 1;
    // Channels split across the threads in whole 16-channel blocks; each task transposes,
    // computes and transposes back its own channels.
    let per = c.div_ceil(pool::threads()).next_multiple_of(16).max(16);
    for b in 0..n {
        let xb = &x[b * c * isp..][..c * isp];
        let ob = &mut out[b * c * osp..][..c * osp];
        pool::parallel_chunks_mut(ob, per * osp, |ci, oc| {
            let c0 = ci * per;
            let cn = oc.len() / osp;
            // Weights as [tap][channel]; each tap's input offset for output pixel (0, 0).
            let mut wt = vec![0f32; kh * kw * cn];
            for ch in 0..cn {
                for t in 0..kh * kw {
                    wt[t * cn + ch] = w[(c0 + ch) * kh * kw + t];
                }
            }
            let taps: Vec<usize> = (0..kh * kw)
                .map(|t| ((t / kw) * g.d[0] * wp + (t % kw) * g.d[1]) * cn)
                .collect();
            let mut xt = vec![0f32; hp * wp * cn];
            let mut ot = vec![0f32; osp * cn];
            let cols = iw.min(wp.saturating_sub(g.pad[1]));
            for y in 0..ih {
                let py = y + g.pad[0];
                if py >= hp {
                    break;
                }
                // Row y of every channel -> padded row py, channels last.
                transpose(
                    &xb[c0 * isp + y * iw..],
                    isp,
                    &mut xt[(py * wp + g.pad[1]) * cn..],
                    cn,
                    (cn, cols),
                );
            }
            transpose(oc, osp, &mut ot, cn, (cn, osp));
            for (oy, row) in ot.chunks_mut(ow * cn).enumerate() {
                let off: Vec<usize> = taps.iter().map(|&t| t + oy * g.s[0] * wp * cn).collect();
                vecmath::depthwise_nhwc_row(&xt, &off, &wt, row, cn, ow, g.s[1] * cn);
            }
            transpose(&ot, cn, oc, osp, (osp, cn));
        });
    }
}

/// `dst[j * ds + i] = src[i * ss + j]` for `i < rows`, `j < cols`, in 16 x 16 tiles: a tile's
/// rows are read whole into a local block, then written out as whole rows of the transpose.
fn transpose(src: &[f32], ss: usize, dst: &mut [f32], ds: usize, (rows, cols): (usize, usize)) {
    const T: usize = 16;
    let mut tile = [[0f32; T]; T];
    for i0 in (0..rows).step_by(T) {
        let ni = T.min(rows - i0);
        for j0 in (0..cols).step_by(T) {
            let nj = T.min(cols - j0);
            for (ii, t) in tile.iter_mut().enumerate().take(ni) {
                t[..nj].copy_from_slice(&src[(i0 + ii) * ss + j0..][..nj]);
            }
            for jj in 0..nj {
                let d = &mut dst[(j0 + jj) * ds + i0..][..ni];
                for (ii, v) in d.iter_mut().enumerate() {
                    *v = tile[ii][jj];
                }
            }
        }
    }
}

fn depthwise(
    x: &[f32],
    w: &[f32],
    out: &mut [std::mem::MaybeUninit<f32>],
    (ih, iw): (usize, usize),
    g: &Conv2d,
    (bias, z): (Option<&[f32]>, Option<&[f32]>),
    act: Option<vecmath::Unary>,
) {
    let [kh, kw] = g.k;
    let [oh, ow] = g.out;
    let (osp, isp) = (oh * ow, ih * iw);
    let c = w.len() / (kh * kw);
    let s1 = g.s[1];
    // The padded extent every tap reads, and the width of one phase.
    let hp = (oh - 1) * g.s[0] + (kh - 1) * g.d[0] + 1;
    let wp = (ow - 1) * s1 + (kw - 1) * g.d[1] + 1;
    let wph = wp.div_ceil(s1);
    let ends = |p: usize| vecmath::DwEnds {
        bias: bias.map_or(0.0, |b| b[p % c]),
        z: z.map(|z| &z[p * osp..][..osp]),
        act,
    };
    if s1 == 2 {
        // Stride 2 along columns: an unsplit padded plane (rows copied whole) read two apart.
        pool::parallel_chunks_mut(out, osp, |p, o| {
            let plane = &x[p * isp..][..isp];
            let wk = &w[(p % c) * kh * kw..][..kh * kw];
            let len = hp * wp + 2 * vecmath::DW_LANES;
            let key = [len, ih, iw, hp, wp, wp, g.pad[0], g.pad[1], 2];
            with_padded(len, key, |xp| {
                let cols = iw.min(wp.saturating_sub(g.pad[1]));
                for y in 0..ih {
                    let py = y + g.pad[0];
                    if py >= hp {
                        break;
                    }
                    xp[py * wp + g.pad[1]..][..cols].copy_from_slice(&plane[y * iw..][..cols]);
                }
                let taps: Vec<(usize, usize, f32)> = (0..kh * kw)
                    .map(|t| ((t / kw) * g.d[0], (t % kw) * g.d[1], wk[t]))
                    .collect();
                let out = vecmath::DwOut { oh, ow, s0: g.s[0] };
                vecmath::depthwise_rows_s2(xp, wp, &taps, ends(p), o, out);
            });
        });
        return;
    }
    pool::parallel_chunks_mut(out, osp, |p, o| {
        let plane = &x[p * isp..][..isp];
        let wk = &w[(p % c) * kh * kw..][..kh * kw];
        // L values of slack: a row's last block of outputs may read past the row's end (into
        // the next row, or here), for lanes that are not stored.
        let len = s1 * hp * wph + vecmath::DW_LANES;
        let key = [len, ih, iw, hp, wph, wp, g.pad[0], g.pad[1], s1];
        with_padded(len, key, |xp| {
            depthwise_plane(xp, plane, wk, ends(p), o, (ih, iw), (hp, wph), g)
        });
    });
}

/// One plane of [`depthwise`] (stride 1, or 3 and more along columns): the input copied into
/// `xp` (whose padding is zero), then the taps summed into `o`.
#[allow(clippy::too_many_arguments)]
fn depthwise_plane(
    xp: &mut [f32],
    plane: &[f32],
    wk: &[f32],
    ends: vecmath::DwEnds,
    o: &mut [std::mem::MaybeUninit<f32>],
    (ih, iw): (usize, usize),
    (hp, wph): (usize, usize),
    g: &Conv2d,
) {
    let ([kh, kw], [oh, ow], s1) = (g.k, g.out, g.s[1]);
    let wp = (ow - 1) * s1 + (kw - 1) * g.d[1] + 1;
    for y in 0..ih {
        let py = y + g.pad[0];
        if py >= hp {
            break;
        }
        let row = &plane[y * iw..][..iw];
        let cols = iw.min(wp.saturating_sub(g.pad[1]));
        if s1 == 1 {
            xp[py * wph + g.pad[1]..][..cols].copy_from_slice(&row[..cols]);
        } else {
            // Phase r holds padded columns r, r + s1, ..: input columns r - pad, r - pad + s1, ..
            for r in 0..s1 {
                let dst = &mut xp[(r * hp + py) * wph..][..wph];
                let first = (g.pad[1].saturating_sub(r)).div_ceil(s1);
                for (j, d) in dst.iter_mut().enumerate().skip(first) {
                    let x = j * s1 + r - g.pad[1];
                    if x >= cols {
                        break;
                    }
                    *d = row[x];
                }
            }
        }
    }
    // (phase row offset, column offset, weight) of each tap, relative to an output row.
    let taps: Vec<(usize, usize, f32)> = (0..kh * kw)
        .map(|t| {
            let (ky, kx) = (t / kw, t % kw);
            let off = kx * g.d[1];
            ((off % s1) * hp + ky * g.d[0], off / s1, wk[t])
        })
        .collect();
    let out = vecmath::DwOut { oh, ow, s0: g.s[0] };
    vecmath::depthwise_rows(xp, wph, &taps, ends, o, out);
}

thread_local! {
    /// [`depthwise`]'s padded plane, kept by each thread with the geometry it was zeroed for:
    /// a plane's copy writes the same positions every time, so the padding stays zero from one
    /// plane (and one call of the same geometry) to the next.
    static DW_PAD: std::cell::RefCell<(Vec<f32>, [usize; 9])> =
        const { std::cell::RefCell::new((Vec::new(), [0; 9])) };
}

/// Runs `f` on this thread's padded-plane buffer of `len` floats, zeroed when `key` (the
/// length and the geometry that decides which positions a copy writes) differs from last time.
fn with_padded<R>(len: usize, key: [usize; 9], f: impl FnOnce(&mut [f32]) -> R) -> R {
    DW_PAD.with(|c| {
        let mut g = c.borrow_mut();
        let (buf, last) = &mut *g;
        if *last != key || buf.len() != len {
            buf.clear();
            buf.resize(len, 0.0);
            *last = key;
        }
        f(buf)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    /// The channels-last depthwise kernel and the plane-at-a-time one do the same operations in
    /// the same order: equal bits on fresh random inputs (channel counts below, at and above
    /// the 16-lane blocks; strides, dilations, paddings, batches).
    #[test]
    fn both_depthwise_kernels_agree_bit_for_bit() {
        let seed: u64 = rand::random();
        eprintln!("seed {seed}");
        let mut r = rand::rngs::StdRng::seed_from_u64(seed);
        for case in 0..60 {
            let (n, c) = (r.gen_range(1..3), r.gen_range(1..40));
            let k = [r.gen_range(1..6), r.gen_range(1..6)];
            let s = [r.gen_range(1..3), r.gen_range(1..3)];
            let d = [r.gen_range(1..3), r.gen_range(1..3)];
            let pad = [r.gen_range(0..3), r.gen_range(0..3)];
            let ek = [(k[0] - 1) * d[0] + 1, (k[1] - 1) * d[1] + 1];
            let (ih, iw) = (
                r.gen_range(ek[0]..ek[0] + 20),
                r.gen_range(ek[1]..ek[1] + 20),
            );
            let outd = |i: usize, p: usize, e: usize, s: usize| (i + 2 * p - e) / s + 1;
            let out = [outd(ih, pad[0], ek[0], s[0]), outd(iw, pad[1], ek[1], s[1])];
            let g = Conv2d {
                group: c,
                k,
                s,
                d,
                pad,
                out,
            };
            let x: Vec<f32> = (0..n * c * ih * iw)
                .map(|_| r.gen_range(-1.0..1.0))
                .collect();
            let w: Vec<f32> = (0..c * k[0] * k[1])
                .map(|_| r.gen_range(-1.0..1.0))
                .collect();
            let osp = out[0] * out[1];
            let z: Vec<f32> = (0..n * c * osp).map(|_| r.gen_range(-1.0..1.0)).collect();
            let bias: Vec<f32> = (0..c).map(|_| r.gen_range(-1.0..1.0)).collect();
            let with_z = r.gen_bool(0.5);
            let a = fast::filled(n * c * osp, |o| {
                let z = with_z.then_some(&z[..]);
                depthwise(&x, &w, o, (ih, iw), &g, (Some(&bias), z), None)
            });
            // The channels-last kernel accumulates into outputs that start as `z + b`.
            let mut b: Vec<f32> = (0..n * c * osp)
                .map(|i| if with_z { z[i] } else { 0.0 } + bias[(i / osp) % c])
                .collect();
            depthwise_nhwc(&x, &w, &mut b, (n, c), (ih, iw), &g);
            assert!(a.iter().all(|v| v.is_finite()));
            let same = a.iter().zip(&b).all(|(u, v)| u.to_bits() == v.to_bits());
            assert!(same, "case {case}: n {n} c {c} {ih}x{iw} {g:?}");
        }
    }
}
