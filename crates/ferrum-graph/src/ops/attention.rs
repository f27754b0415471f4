//! Attention (opsets 23-25): scaled dot-product attention with masks, causal and sliding-window
//! bias, grouped KV heads, past key/value caches and softcap. A reference loop in f64.

use ferrum_kernels::gemm::{gemm_ex_with, isa, Epilogue, Lhs, Mat, PackedB, Rhs};
use ferrum_kernels::pool;

use crate::ops::elementwise::{broadcast_offsets, broadcast_shape, bstrides, cast};
use crate::ops::nn::{matmul_f64, MatmulDims};
use crate::ops::shape::{concat_t, strides as row_major, transpose_t};
use crate::ops::vecmath;
use crate::ops::{numel, Ctx, Inferred, Known, Rules};
use crate::tensor::{DType, Tensor, Value};
use crate::{kbail, Result};

/// `[B, S, H*D]` to `[B, H, S, D]`.
fn to_heads(t: &Tensor, heads: usize) -> Result<Tensor> {
    let (b, s, hd) = (t.shape()[0], t.shape()[1], t.shape()[2]);
    if heads == 0 || hd % heads != 0 {
        kbail!("hidden size {hd} is not a multiple of {heads} heads");
    }
    transpose_t(
        &t.clone().reshape(vec![b, s, heads, hd / heads])?,
        &[0, 2, 1, 3],
    )
}

pub fn attention(cx: &Ctx) -> Result<Vec<Value>> {
    let (q0, k0, v0) = (cx.t(0)?, cx.t(1)?, cx.t(2)?);
    let dt = q0.dtype();
    let three_d = q0.rank() == 3;
    let (q, mut k, mut v) = if three_d {
        let qh = cx.ai("q_num_heads", 0) as usize;
        let kh = cx.ai("kv_num_heads", 0) as usize;
        (to_heads(q0, qh)?, to_heads(k0, kh)?, to_heads(v0, kh)?)
    } else if q0.rank() == 4 {
        (q0.clone(), k0.clone(), v0.clone())
    } else {
        kbail!("Q must be 3-D or 4-D");
    };
    let past_len = match (cx.opt(4), cx.opt(5)) {
        (Some(pk), Some(pv)) => {
            k = concat_t(&[pk, &k], 2)?;
            v = concat_t(&[pv, &v], 2)?;
            pk.shape()[2]
        }
        _ => 0,
    };
    let nonpad = cx.opt(6).map(|t| t.to_i64_vec()).transpose()?;
    let (b, hq, sq, d) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]);
    let (hk, skv, dv) = (k.shape()[1], k.shape()[2], v.shape()[3]);
    if hk == 0 || hq % hk != 0 || v.shape()[1] != hk {
        kbail!("{hq} query heads cannot share {hk} key/value heads");
    }
    let scale = match cx.attr("scale") {
        Some(_) => cx.af("scale", 1.0) as f64,
        None => 1.0 / (d as f64).sqrt(),
    };
    let sqrt_scale = scale.sqrt();
    let softcap = cx.af("softcap", 0.0) as f64;
    let causal = cx.ai("is_causal", 0) != 0;
    let mode = cx.ai("qk_matmul_output_mode", 0);
    let (left, right) = (
        cx.ai("left_window_size", -1),
        cx.ai("right_window_size", -1),
    );
    let (qv, kv, vv) = (q.to_f64_vec()?, k.to_f64_vec()?, v.to_f64_vec()?);
    let mask = cx.opt(3);
    let (mask_v, mask_st, mask_last, mask_bool) = match mask {
        Some(m) => {
            let mut shape = m.shape().to_vec();
            if shape.is_empty() {
                kbail!("attn_mask must have rank >= 1");
            }
            let last = *shape.last().unwrap_or(&0);
            let full = [b, hq, sq, skv];
            let off = 4usize.saturating_sub(shape.len());
            if shape.len() > 4
                || last > skv
                || shape[..shape.len() - 1]
                    .iter()
                    .enumerate()
                    .any(|(i, &d)| d != 1 && d != full[off + i])
            {
                kbail!("attn_mask {:?} does not broadcast to {full:?}", m.shape());
            }
            *shape.last_mut().expect("rank >= 1") = skv;
            let mut st = bstrides(m.shape(), &[b, hq, sq, skv]);
            // the real last-dim stride (the padded tail is handled separately)
            if last > 1 {
                st[3] = 1;
            }
            (m.to_f64_vec()?, st, last, m.dtype() == DType::Bool)
        }
        None => (vec![], vec![], 0, false),
    };
    let offset_of = |bi: usize| -> i64 {
        match (&nonpad, past_len) {
            (Some(np), 0) => np.get(bi).copied().unwrap_or(skv as i64) - sq as i64,
            _ => past_len as i64,
        }
    };
    let rep = hq / hk;
    let mut out = vec![0f64; b * hq * sq * dv];
    let mut qk_out = vec![0f64; b * hq * sq * skv];
    let mut scores = vec![0f64; skv];
    let mut bias = vec![0f64; skv];
    for bi in 0..b {
        let off = offset_of(bi);
        for h in 0..hq {
            let kh = h / rep;
            for i in 0..sq {
                for j in 0..skv {
                    let mut bv = 0.0;
                    if mask.is_some() {
                        let m = if j >= mask_last && mask_last != 1 {
                            if mask_bool {
                                0.0
                            } else {
                                f64::NEG_INFINITY
                            }
                        } else {
                            let jj = if mask_last == 1 { 0 } else { j };
                            mask_v[bi * mask_st[0]
                                + h * mask_st[1]
                                + i * mask_st[2]
                                + jj * mask_st[3]]
                        };
                        bv += if mask_bool {
                            if m != 0.0 {
                                0.0
                            } else {
                                f64::NEG_INFINITY
                            }
                        } else {
                            m
                        };
                    }
                    if causal && j as i64 > i as i64 + off {
                        bv = f64::NEG_INFINITY;
                    }
                    if left >= 0 || right >= 0 {
                        let diff = i as i64 + off - j as i64;
                        if (left >= 0 && diff > left) || (right >= 0 && -diff > right) {
                            bv = f64::NEG_INFINITY;
                        }
                    }
                    if let Some(np) = &nonpad {
                        if j as i64 >= np.get(bi).copied().unwrap_or(skv as i64) {
                            bv = f64::NEG_INFINITY;
                        }
                    }
                    bias[j] = bv;
                    let qrow = &qv[((bi * hq + h) * sq + i) * d..][..d];
                    let krow = &kv[((bi * hk + kh) * skv + j) * d..][..d];
                    let mut s: f64 = qrow
                        .iter()
                        .zip(krow)
                        .map(|(a, c)| (a * sqrt_scale) * (c * sqrt_scale))
                        .sum();
                    if softcap > 0.0 {
                        s = softcap * (s / softcap).tanh();
                    }
                    scores[j] = s;
                }
                let row = ((bi * hq + h) * sq + i) * skv;
                if mode == 0 || mode == 1 {
                    qk_out[row..row + skv].copy_from_slice(&scores);
                }
                for j in 0..skv {
                    scores[j] += bias[j];
                }
                if mode == 2 {
                    qk_out[row..row + skv].copy_from_slice(&scores);
                }
                let all_masked = bias.iter().all(|x| *x == f64::NEG_INFINITY);
                let m = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let m = if m == f64::NEG_INFINITY { 0.0 } else { m };
                let mut sum = 0.0;
                for s in scores.iter_mut() {
                    *s = (*s - m).exp();
                    sum += *s;
                }
                if sum == 0.0 {
                    sum = 1.0;
                }
                for s in scores.iter_mut() {
                    *s = if all_masked { 0.0 } else { *s / sum };
                }
                if mode == 3 {
                    qk_out[row..row + skv].copy_from_slice(&scores);
                }
                let o = &mut out[((bi * hq + h) * sq + i) * dv..][..dv];
                for (j, &p) in scores.iter().enumerate() {
                    if p == 0.0 {
                        continue;
                    }
                    let vrow = &vv[((bi * hk + kh) * skv + j) * dv..][..dv];
                    for (x, y) in o.iter_mut().zip(vrow) {
                        *x += p * y;
                    }
                }
            }
        }
    }
    let y = cast(&Tensor::from_vec(vec![b, hq, sq, dv], out)?, dt)?;
    let y = if three_d {
        transpose_t(&y, &[0, 2, 1, 3])?.reshape(vec![b, sq, hq * dv])?
    } else {
        y
    };
    let mut res = vec![Value::Tensor(y), Value::Tensor(k), Value::Tensor(v)];
    if cx.node.outputs.len() > 3 {
        res.push(Value::Tensor(cast(
            &Tensor::from_vec(vec![b, hq, sq, skv], qk_out)?,
            dt,
        )?));
    }
    Ok(res)
}

/// FlexAttention (ai.onnx.preview): attention whose scores and probabilities may be rewritten
/// by `score_mod` / `prob_mod` subgraphs, run on the whole [B, H, L, S] tensor.
pub fn flex_attention(cx: &Ctx) -> Result<Vec<Value>> {
    let (q, k, v) = (cx.t(0)?, cx.t(1)?, cx.t(2)?);
    if q.rank() != 4 || k.rank() != 4 || v.rank() != 4 {
        kbail!("FlexAttention needs rank-4 Q, K, V");
    }
    let (b, hq, l, e) = (q.shape()[0], q.shape()[1], q.shape()[2], q.shape()[3]);
    let (hk, s, ev) = (k.shape()[1], k.shape()[2], v.shape()[3]);
    if hk == 0 || hq % hk != 0 {
        kbail!("{hq} query heads cannot share {hk} key/value heads");
    }
    let scale = match cx.attr("scale") {
        Some(_) => cx.af("scale", 1.0) as f64,
        None => 1.0 / (e as f64).sqrt(),
    };
    let sq = (scale as f32).sqrt() as f64;
    let compute = match cx.attr("softmax_precision") {
        Some(_) => DType::from_onnx(cx.ai("softmax_precision", 1) as i32).unwrap_or(DType::F32),
        None if q.dtype() == DType::F64 => DType::F64,
        None => DType::F32,
    };
    let (qv, kv, vv) = (q.to_f64_vec()?, k.to_f64_vec()?, v.to_f64_vec()?);
    let rep = hq / hk;
    let mut scores = vec![0f64; b * hq * l * s];
    for bi in 0..b {
        for h in 0..hq {
            for i in 0..l {
                for j in 0..s {
                    let qr = &qv[((bi * hq + h) * l + i) * e..][..e];
                    let kr = &kv[((bi * hk + h / rep) * s + j) * e..][..e];
                    scores[((bi * hq + h) * l + i) * s + j] =
                        qr.iter().zip(kr).map(|(a, c)| (a * sq) * (c * sq)).sum();
                }
            }
        }
    }
    let shape = vec![b, hq, l, s];
    let mut st = cast(
        &cast(&Tensor::from_vec(shape.clone(), scores)?, q.dtype())?,
        compute,
    )?;
    let run_mod = |name: &str, t: Tensor| -> Result<Tensor> {
        match cx.attr(name) {
            Some(crate::ir::Attr::Graph(g)) => {
                let out = crate::exec::run_graph(g, vec![Some(Value::Tensor(t))], Some(cx.env))?;
                cast(
                    &out.into_iter()
                        .next()
                        .ok_or_else(|| crate::kerr!("{name} has no output"))?
                        .into_tensor()?,
                    compute,
                )
            }
            _ => Ok(t),
        }
    };
    st = run_mod("score_mod", st)?;
    let mut p = st.to_f64_vec()?;
    for row in p.chunks_mut(s) {
        let m = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = row.iter().map(|x| (x - m).exp()).sum();
        row.iter_mut().for_each(|x| *x = (*x - m).exp() / sum);
    }
    let pt = run_mod("prob_mod", cast(&Tensor::from_vec(shape, p)?, compute)?)?;
    let p = pt.to_f64_vec()?;
    let mut out = vec![0f64; b * hq * l * ev];
    for bi in 0..b {
        for h in 0..hq {
            for i in 0..l {
                let prow = &p[((bi * hq + h) * l + i) * s..][..s];
                let o = &mut out[((bi * hq + h) * l + i) * ev..][..ev];
                for (j, &w) in prow.iter().enumerate() {
                    let vr = &vv[((bi * hk + h / rep) * s + j) * ev..][..ev];
                    for (x, y) in o.iter_mut().zip(vr) {
                        *x += w * y;
                    }
                }
            }
        }
    }
    Ok(vec![Value::Tensor(cast(
        &Tensor::from_vec(vec![b, hq, l, ev], out)?,
        v.dtype(),
    )?)])
}

/// The static rules of `com.ferrum` FusedAttention: `out_shape` when the pass recorded it, else
/// `(Q K^T) V` with the batch dims broadcast, each operand read as its view (`{q,k,v}_shape`)
/// where it has one; per output row, `sk (d + dv)` multiply-adds and the softmax.
pub const FUSED_RULES: Rules = Rules::with(
    |k| {
        if let Some(o) = k.aints("out_shape") {
            return Some(Inferred::dims(
                o.iter()
                    .map(|&d| usize::try_from(d).ok())
                    .collect::<Option<_>>()?,
            ));
        }
        let (q, kk, v) = (
            operand(k, "q", 0)?,
            operand(k, "k", 1)?,
            operand(k, "v", 2)?,
        );
        if q.len() < 2 || kk.len() < 2 || v.len() < 2 {
            return None;
        }
        let mut dims = broadcast_shape(&q[..q.len() - 2], &kk[..kk.len() - 2]).ok()?;
        dims = broadcast_shape(&dims, &v[..v.len() - 2]).ok()?;
        dims.push(q[q.len() - 2]);
        dims.push(v[v.len() - 1]);
        Some(Inferred::dims(dims))
    },
    |k, out| {
        let (q, v) = (operand(k, "q", 0)?, operand(k, "v", 2)?);
        let (d, sk, dv) = (
            *q.last()? as f64,
            v[v.len().checked_sub(2)?] as f64,
            *out.last()? as f64,
        );
        Some(numel(out) / dv.max(1.0) * sk * (2.0 * (d + dv) + 5.0))
    },
);

/// A FusedAttention operand's dims: its view's (`{name}_shape`), else input `i`'s.
fn operand(k: &Known, name: &str, i: usize) -> Option<Vec<usize>> {
    match k.aints(&format!("{name}_shape")) {
        Some(v) => v.iter().map(|&d| usize::try_from(d).ok()).collect(),
        None => k.dims(i).map(<[usize]>::to_vec),
    }
}

/// `com.ferrum.FusedAttention` (made by the attention pass from PyTorch's exported chain):
/// inputs Q `[.., sq, d]`, K `[.., d, sk]` (the first MatMul's B), V `[.., sk, dv]`, then
/// optional: an additive mask broadcasting to the scores `[.., sq, sk]`, and scalar multipliers
/// of Q and of K. Computes `softmax((Q q_scale) (K k_scale) post + mask) V` along the last
/// axis, where `post` is a multiplication by `post_scale` (or a division, `post_div = 1`), and
/// with `nan_to_zero = 1` a NaN probability is 0 (`Where(IsNaN(p), 0, p)`). Batch dims broadcast
/// as MatMul's do.
///
/// Q, K and V may be strided views of the tensors given (the head splits PyTorch writes as
/// Reshape, Transpose and Gather): `{q,k,v}_shape`, `_strides` and `_offset` describe the
/// operand read from the input, whose shape must be `{q,k,v}_src_shape`; `b_transposed = 1`
/// reads K `[.., sk, d]` transposed. The output may be written straight into the layout of the
/// transposes and reshapes that followed the product: `out_shape` is the tensor produced and
/// `out_strides` the product's dims' strides in it (its last dim contiguous).
///
/// float32 with scalar scales runs [`attention_f32`]; anything else the f64 reference
/// [`attention_reference`], rounded once to the output type.
pub fn fused_attention(cx: &Ctx) -> Result<Tensor> {
    let spec = FusedSpec {
        post: match cx.af("post_scale", 1.0) {
            c if cx.ai("post_div", 0) != 0 => Some((c, true)),
            c if c != 1.0 => Some((c, false)),
            _ => None,
        },
        nan_to_zero: cx.ai("nan_to_zero", 0) != 0,
    };
    let view = |i: usize, name: &str| -> Result<View> {
        let t = cx.t(i)?;
        let dims = |a: &str| {
            cx.aints(&format!("{name}_{a}"))
                .map(|v| v.iter().map(|&x| x.max(0) as usize).collect::<Vec<usize>>())
        };
        match (dims("shape"), dims("strides"), dims("src_shape")) {
            (Some(shape), Some(strides), Some(src)) => {
                if src != t.shape() {
                    kbail!(
                        "FusedAttention: {name} was planned for a {src:?} input, got {:?}",
                        t.shape()
                    );
                }
                View::strided(
                    t,
                    cx.ai(&format!("{name}_offset"), 0) as usize,
                    shape,
                    strides,
                )
            }
            _ => Ok(View::of(t)),
        }
    };
    let (q, mut k, v) = (view(0, "q")?, view(1, "k")?, view(2, "v")?);
    if cx.ai("b_transposed", 0) != 0 {
        let r = k.shape.len();
        if r < 2 {
            kbail!(
                "FusedAttention: K must have rank 2 or more, got {:?}",
                k.shape
            );
        }
        k.shape.swap(r - 2, r - 1);
        k.strides.swap(r - 2, r - 1);
    }
    let out = match (cx.aints("out_shape"), cx.aints("out_strides")) {
        (Some(sh), Some(st)) => Some((
            sh.iter()
                .map(|&x| x.max(0) as usize)
                .collect::<Vec<usize>>(),
            st.iter()
                .map(|&x| x.max(0) as usize)
                .collect::<Vec<usize>>(),
        )),
        _ => None,
    };
    let (mask, qs, ks) = (cx.opt(3), cx.opt(4), cx.opt(5));
    // A scale of one element that does not raise the rank of what it multiplies.
    let f32_scalar = |s: Option<&Tensor>, of: &View| {
        s.is_none_or(|s| s.dtype() == DType::F32 && s.len() == 1 && s.rank() <= of.shape.len())
    };
    let all_f32 = [Some(q.t), Some(k.t), Some(v.t), mask]
        .iter()
        .flatten()
        .all(|t| t.dtype() == DType::F32);
    let ranks = q.shape.len() >= 2 && k.shape.len() >= 2 && v.shape.len() >= 2;
    if all_f32 && ranks && f32_scalar(qs, &q) && f32_scalar(ks, &k) {
        let scalar = |s: Option<&Tensor>| -> Result<Option<f32>> {
            s.map(|s| Ok(s.as_slice::<f32>()?[0])).transpose()
        };
        let scales = (scalar(qs)?, scalar(ks)?);
        if let Some(t) = attention_f32(&q, &k, &v, mask, scales, spec, out.as_ref())? {
            return Ok(t);
        }
    }
    let o = attention_reference(
        &q.materialize()?,
        &k.materialize()?,
        &v.materialize()?,
        mask,
        (qs, ks),
        spec,
    )?;
    match out {
        Some((shape, strides)) => scatter(&o, shape, &strides),
        None => Ok(o),
    }
}

/// The chain's scalar parts: the scores' multiplier or divisor, and NaN handling.
#[derive(Clone, Copy, Debug)]
pub struct FusedSpec {
    /// `(c, true)`: scores divided by `c`; `(c, false)`: multiplied by `c`.
    pub post: Option<(f32, bool)>,
    pub nan_to_zero: bool,
}

/// An operand of [`fused_attention`]: `shape`'s elements read from `t`'s data at `offset + Σ
/// index · stride` (strides in elements; any stride for a dim of size 1).
struct View<'a> {
    t: &'a Tensor,
    offset: usize,
    shape: Vec<usize>,
    strides: Vec<usize>,
}

impl<'a> View<'a> {
    /// The whole tensor, row-major.
    fn of(t: &'a Tensor) -> View<'a> {
        View {
            t,
            offset: 0,
            shape: t.shape().to_vec(),
            strides: row_major(t.shape()),
        }
    }

    /// A view of `t`, checked to lie within it.
    fn strided(
        t: &'a Tensor,
        offset: usize,
        shape: Vec<usize>,
        strides: Vec<usize>,
    ) -> Result<View<'a>> {
        let last = shape
            .iter()
            .zip(&strides)
            .try_fold(offset, |acc, (&n, &s)| {
                acc.checked_add(n.saturating_sub(1).checked_mul(s)?)
            });
        let empty = shape.contains(&0);
        if shape.len() != strides.len() || !empty && last.is_none_or(|l| l >= t.len()) {
            kbail!(
                "FusedAttention: view {shape:?} (strides {strides:?}, offset {offset}) does not fit a {:?} input",
                t.shape()
            );
        }
        Ok(View {
            t,
            offset,
            shape,
            strides,
        })
    }

    /// The viewed elements as a row-major tensor of the input's type.
    fn materialize(&self) -> Result<Tensor> {
        if self.offset == 0
            && self.shape == self.t.shape()
            && self.strides == row_major(&self.shape)
        {
            return Ok(self.t.clone());
        }
        let src = self.t.to_f64_vec()?;
        let n: usize = self.shape.iter().product();
        let mut v = Vec::with_capacity(n);
        let mut idx = vec![0usize; self.shape.len()];
        for _ in 0..n {
            let off: usize = idx.iter().zip(&self.strides).map(|(i, s)| i * s).sum();
            v.push(src[self.offset + off]);
            for d in (0..idx.len()).rev() {
                idx[d] += 1;
                if idx[d] < self.shape[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
        crate::ops::nn::f64_tensor(self.shape.clone(), v, self.t.dtype())
    }
}

/// `o` (row-major) written into a fresh `shape` tensor at `strides` (one per dim of `o`).
fn scatter(o: &Tensor, shape: Vec<usize>, strides: &[usize]) -> Result<Tensor> {
    let n: usize = shape.iter().product();
    if n != o.len() || strides.len() != o.rank() {
        kbail!(
            "FusedAttention: a {:?} product does not fill the planned {shape:?} output",
            o.shape()
        );
    }
    let src = o.to_f64_vec()?;
    let mut v = vec![0f64; n];
    let mut idx = vec![0usize; o.rank()];
    for x in src {
        let off: usize = idx.iter().zip(strides).map(|(i, s)| i * s).sum();
        match v.get_mut(off) {
            Some(slot) => *slot = x,
            None => kbail!("FusedAttention: output strides {strides:?} leave the {shape:?} output"),
        }
        for d in (0..idx.len()).rev() {
            idx[d] += 1;
            if idx[d] < o.shape()[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    crate::ops::nn::f64_tensor(shape, v, o.dtype())
}

/// For every entry of `batch` (row-major), the element offset of `v`'s matrix (its batch dims
/// right-aligned to `batch`, broadcast where they are 1).
fn batch_offsets(v: &View, batch: &[usize]) -> Vec<usize> {
    let r = v.shape.len() - 2;
    let lead = batch.len() - r;
    let nb: usize = batch.iter().product();
    let mut out = Vec::with_capacity(nb);
    let mut idx = vec![0usize; batch.len()];
    for _ in 0..nb {
        let off: usize = (0..r)
            .filter(|&j| v.shape[j] > 1)
            .map(|j| idx[lead + j] * v.strides[j])
            .sum();
        out.push(v.offset + off);
        for d in (0..batch.len()).rev() {
            idx[d] += 1;
            if idx[d] < batch[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}

/// One matrix of a view: `Mat` over the input's data from `off`.
fn mat<'a>(v: &View<'a>, off: usize) -> Result<Mat<'a>> {
    let r = v.shape.len();
    Ok(Mat {
        data: &v.t.as_slice::<f32>()?[off..],
        rs: v.strides[r - 2],
        cs: v.strides[r - 1],
    })
}

/// Query rows per task of [`attention_f32`]: the scores of one task (`ROWS x sk` floats) stay
/// in L2 between the two products.
const ROWS: usize = 64;

thread_local! {
    /// [`attention_f32`]'s per-thread score buffer.
    static SCRATCH: std::cell::RefCell<Vec<f32>> = Default::default();
}

/// [`fused_attention`] on float32 with scalar scales. Per block of at most [`ROWS`] query rows
/// and batch entry: one GEMM for the scores, the row pass of [`vecmath::attention_rows`] in
/// place, one GEMM into the output. The output's layout is `[outer.., sq, inner.., dv]` for
/// some split of the batch dims (all outer without `out`), so a task owns a contiguous run of
/// it: one outer entry's rows `r0..r1` for every inner entry. Tasks are outer entries, or row
/// blocks when there are too few of those to keep every thread busy. The score matrix never
/// exists whole. `None` when the mask would broadcast the scores to a larger shape, or the
/// planned output layout is not of that form (both left to the reference).
fn attention_f32(
    q: &View,
    k: &View,
    v: &View,
    mask: Option<&Tensor>,
    (q_scale, k_scale): (Option<f32>, Option<f32>),
    spec: FusedSpec,
    out: Option<&(Vec<usize>, Vec<usize>)>,
) -> Result<Option<Tensor>> {
    let d1 = MatmulDims::of(&q.shape, &k.shape)?;
    let (sq, d, sk) = (d1.m, d1.k, d1.n);
    let mut sshape = d1.batch.clone();
    sshape.extend([sq, sk]);
    let d2 = MatmulDims::of(&sshape, &v.shape)?;
    let dv = d2.n;
    let batch = d2.batch.clone();
    let nb: usize = batch.iter().product();
    let mut oshape = batch.clone();
    oshape.extend([sq, dv]);
    if d == 0 {
        return Ok(None);
    }
    // The output: its shape, and where each product dim lands (strides).
    let (out_shape, ostrides) = match out {
        Some((shape, strides)) => {
            let n: usize = shape.iter().product();
            if strides.len() != oshape.len() || n != oshape.iter().product::<usize>() {
                kbail!(
                    "FusedAttention: a {oshape:?} product does not fill the planned {shape:?} output"
                );
            }
            (shape.clone(), strides.clone())
        }
        None => (oshape.clone(), row_major(&oshape)),
    };
    let Some(split) = Split::of(&oshape, &ostrides) else {
        return Ok(None);
    };
    let qb = batch_offsets(q, &batch);
    let kb = batch_offsets(k, &batch);
    let vb = batch_offsets(v, &batch);
    // The mask: its batch offsets, and row / column strides (0 where it broadcasts).
    let mask = match mask {
        Some(m) => {
            let mut full = batch.clone();
            full.extend([sq, sk]);
            if m.rank() > full.len() || broadcast_shape(m.shape(), &full)? != full {
                return Ok(None);
            }
            let st = bstrides(m.shape(), &full);
            let r = full.len();
            let mv = View {
                t: m,
                offset: 0,
                shape: [vec![1; r - m.rank()], m.shape().to_vec()].concat(),
                strides: st.clone(),
            };
            Some((
                m.as_slice::<f32>()?,
                batch_offsets(&mv, &batch),
                st[r - 2],
                st[r - 1],
            ))
        }
        None => None,
    };
    let n_out: usize = out_shape.iter().product();
    if nb == 0 || sq == 0 || dv == 0 || sk == 0 {
        return Tensor::from_vec(out_shape, vec![0f32; n_out]).map(Some);
    }
    let (vv, ldc) = (v.t.as_slice::<f32>()?, split.inner * dv);
    // Q's and K's scales join the scores' product as one factor: `(q a)(k b)` rounded as
    // `(q k)(a b)`, within the product's own rounding of the chain's bits.
    let alpha = (f64::from(q_scale.unwrap_or(1.0)) * f64::from(k_scale.unwrap_or(1.0))) as f32;
    let threads = pool::threads();
    // Row blocks per outer entry: one per task when the outer entries alone cannot keep every
    // thread busy, each at most ROWS rows.
    let few = split.entries.len() < 2 * threads;
    let rows = if few {
        let tasks = threads * sq.div_ceil(threads * ROWS);
        sq.div_ceil(tasks)
    } else {
        sq.min(ROWS)
    };
    let vmat = |bi: usize| Mat {
        data: &vv[vb[bi]..],
        rs: v.strides[v.shape.len() - 2],
        cs: v.strides[v.shape.len() - 1],
    };
    // K^T and V packed once per batch entry when several row blocks read them (and they fit
    // in 64 MiB), instead of once per block.
    // The packed operands live in this thread's list, kept between calls (repacked in place).
    let packed_bytes = nb * sk * (d + dv) * 4;
    let mut packed = PACKED.with(|p| std::mem::take(&mut *p.borrow_mut()));
    let use_packed = sq > rows && packed_bytes <= 64 << 20;
    if use_packed {
        let kmats: Vec<Mat> = (0..nb).map(|bi| mat(k, kb[bi])).collect::<Result<_>>()?;
        packed.truncate(nb);
        packed.resize_with(nb, || None);
        pool::parallel_chunks_mut(&mut packed, 1, |bi, slot| match &mut slot[0] {
            Some((pk, pv)) => {
                pk.repack(d, sk, kmats[bi]);
                pv.repack(sk, dv, vmat(bi));
            }
            empty => {
                *empty = Some((
                    PackedB::new(d, sk, kmats[bi]),
                    PackedB::new(sk, dv, vmat(bi)),
                ))
            }
        });
    }
    let packed_now: &[Option<(PackedB, PackedB)>] = if use_packed { &packed } else { &[] };
    // Rows `r0..` of outer entry `o` into `chunk` (those rows' run of the output).
    let run_block = |o: usize, r0: usize, chunk: &mut [f32]| -> Result<()> {
        let cnt = chunk.len() / ldc;
        SCRATCH.with(|sc| -> Result<()> {
            let mut sbuf = sc.borrow_mut();
            for (i, &bi) in split.entries[o].iter().enumerate() {
                let qm = Lhs::Mat(mat(q, qb[bi] + r0 * q.strides[q.shape.len() - 2])?);
                let (km, vm) = match packed_now.get(bi) {
                    Some(Some((pk, pv))) => (Rhs::Packed(pk), Rhs::Packed(pv)),
                    _ => (Rhs::Mat(mat(k, kb[bi])?), Rhs::Mat(vmat(bi))),
                };
                sbuf.resize(cnt * sk, 0.0);
                let s = &mut sbuf[..cnt * sk];
                let none = &Epilogue::NONE;
                gemm_ex_with(isa(), 1, cnt, sk, d, alpha, qm, km, 0.0, s, sk, none);
                let m = mask
                    .as_ref()
                    .map(|(mv, offs, mrs, mcs)| (&mv[offs[bi] + r0 * mrs..], *mrs, *mcs));
                vecmath::attention_rows(s, sk, spec.post, m, spec.nan_to_zero);
                let p = Lhs::Mat(Mat::row_major(s, sk));
                let c = &mut chunk[i * dv..];
                gemm_ex_with(isa(), 1, cnt, dv, sk, 1.0, p, vm, 0.0, c, ldc, none);
            }
            Ok(())
        })
    };
    let mut y = crate::arena::full(n_out, 0.0);
    let per_outer = sq * ldc;
    let failed = std::sync::Mutex::new(None);
    let keep = |r: Result<()>| {
        if let Err(e) = r {
            *failed.lock().unwrap() = Some(e);
        }
    };
    if few {
        // The threads split each outer entry's query rows.
        for (o, yo) in y.chunks_mut(per_outer).enumerate() {
            pool::parallel_chunks_mut(yo, rows * ldc, |blk, c| keep(run_block(o, blk * rows, c)));
        }
    } else {
        // Enough outer entries for every thread: one task each, row blocks in turn.
        pool::parallel_chunks_mut(&mut y, per_outer, |o, yo| {
            for (blk, c) in yo.chunks_mut(rows * ldc).enumerate() {
                keep(run_block(o, blk * rows, c));
            }
        });
    }
    PACKED.with(|p| *p.borrow_mut() = packed);
    if let Some(e) = failed.into_inner().unwrap() {
        return Err(e);
    }
    Tensor::from_vec(out_shape, y).map(Some)
}

thread_local! {
    /// [`attention_f32`]'s packed keys and values per batch entry, kept per thread between
    /// calls and repacked in place.
    static PACKED: std::cell::RefCell<Vec<Option<(PackedB, PackedB)>>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// How a product `[batch.., sq, dv]` lies in its output: the batch dims in front of the rows
/// (outer) and between the rows and `dv` (inner, in the output's order), as batch entries.
struct Split {
    /// Inner entries per outer entry.
    inner: usize,
    /// For each outer entry (in output order), its batch entries (row-major indices of the
    /// product's batch) in output order.
    entries: Vec<Vec<usize>>,
}

impl Split {
    /// `None` unless the output is the product's dims in some order with `dv` last: the
    /// strides, sorted, are the row-major strides of that order.
    fn of(shape: &[usize], strides: &[usize]) -> Option<Split> {
        let r = shape.len();
        // Dims of size 1 go anywhere; the others by decreasing stride.
        let mut order: Vec<usize> = (0..r).filter(|&i| shape[i] > 1).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(strides[i]));
        let mut acc = 1;
        for &i in order.iter().rev() {
            if strides[i] != acc {
                return None;
            }
            acc *= shape[i];
        }
        let (sq_dim, dv_dim) = (r - 2, r - 1);
        if shape[dv_dim] > 1 && order.last() != Some(&dv_dim) {
            return None;
        }
        let batch = &shape[..r - 2];
        // Outer: batch dims laid out beyond the rows; inner: the others (size-1 dims count as
        // inner and change nothing).
        let is_outer =
            |j: usize| shape[j] > 1 && (shape[sq_dim] == 1 || strides[j] > strides[sq_dim]);
        let inner: usize = (0..r - 2)
            .filter(|&j| !is_outer(j))
            .map(|j| shape[j])
            .product();
        let nb: usize = batch.iter().product();
        // Batch entries keyed by (outer position, inner position) in the output's order.
        let mut keyed: Vec<(usize, usize, usize)> = Vec::with_capacity(nb);
        let mut idx = vec![0usize; r - 2];
        for bi in 0..nb {
            let (mut o, mut i) = (0usize, 0usize);
            for j in 0..r - 2 {
                if is_outer(j) {
                    o += idx[j] * strides[j];
                } else {
                    i += idx[j] * strides[j];
                }
            }
            keyed.push((o, i, bi));
            for d in (0..r - 2).rev() {
                idx[d] += 1;
                if idx[d] < batch[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
        keyed.sort_unstable();
        let entries: Vec<Vec<usize>> = keyed
            .chunks(inner.max(1))
            .map(|c| c.iter().map(|&(_, _, bi)| bi).collect())
            .collect();
        Some(Split { inner, entries })
    }
}

/// [`fused_attention`] in f64 for any float type and any broadcasting scales: the plain
/// definition, each product summed in order, rounded once to Q's type at the end.
fn attention_reference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    (qs, ks): (Option<&Tensor>, Option<&Tensor>),
    spec: FusedSpec,
) -> Result<Tensor> {
    let scaled = |t: &Tensor, s: Option<&Tensor>| -> Result<(Vec<usize>, Vec<f64>)> {
        let tv = t.to_f64_vec()?;
        let Some(s) = s else {
            return Ok((t.shape().to_vec(), tv));
        };
        let sv = s.to_f64_vec()?;
        let shape = broadcast_shape(t.shape(), s.shape())?;
        let offs = broadcast_offsets(&[t.shape(), s.shape()], &shape);
        let v = offs[0]
            .iter()
            .zip(&offs[1])
            .map(|(&a, &b)| tv[a] * sv[b])
            .collect();
        Ok((shape, v))
    };
    let (qsh, qv) = scaled(q, qs)?;
    let (ksh, kv) = scaled(k, ks)?;
    let (ssh, mut s) = matmul_f64(&qv, &qsh, &kv, &ksh)?;
    let sk = *ssh.last().unwrap_or(&1);
    if let Some((c, div)) = spec.post {
        let c = c as f64;
        s.iter_mut()
            .for_each(|x| *x = if div { *x / c } else { *x * c });
    }
    let (ssh, mut s) = match mask {
        Some(m) => {
            let mv = m.to_f64_vec()?;
            let shape = broadcast_shape(&ssh, m.shape())?;
            let offs = broadcast_offsets(&[&ssh, m.shape()], &shape);
            let v = offs[0]
                .iter()
                .zip(&offs[1])
                .map(|(&a, &b)| s[a] + mv[b])
                .collect();
            (shape, v)
        }
        None => (ssh, s),
    };
    for row in s.chunks_mut(sk.max(1)) {
        let m = row
            .iter()
            .fold(f64::NEG_INFINITY, |m, &x| if x > m { x } else { m });
        let e: Vec<f64> = row.iter().map(|&x| (x - m).exp()).collect();
        let sum: f64 = e.iter().sum();
        for (x, e) in row.iter_mut().zip(e) {
            let p = e / sum;
            *x = if spec.nan_to_zero && p.is_nan() {
                0.0
            } else {
                p
            };
        }
    }
    let (osh, o) = matmul_f64(&s, &ssh, &v.to_f64_vec()?, v.shape())?;
    crate::ops::nn::f64_tensor(osh, o, q.dtype())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn rand_t(r: &mut rand::rngs::StdRng, shape: &[usize]) -> Tensor {
        let n = shape.iter().product();
        Tensor::from_vec(
            shape.to_vec(),
            (0..n).map(|_| r.gen_range(-1.0f32..1.0)).collect(),
        )
        .unwrap()
    }

    /// A random operand of logical shape `shape` stored with its dims in `order` (source dim
    /// `j` holds logical dim `order[j]`), and the view of it; also the source.
    fn stored(
        r: &mut rand::rngs::StdRng,
        shape: &[usize],
        order: &[usize],
    ) -> (Tensor, Vec<usize>, Vec<usize>) {
        let src_shape: Vec<usize> = order.iter().map(|&l| shape[l]).collect();
        let cs = row_major(&src_shape);
        let mut strides = vec![0; shape.len()];
        for (j, &l) in order.iter().enumerate() {
            strides[l] = cs[j];
        }
        (rand_t(r, &src_shape), shape.to_vec(), strides)
    }

    /// Logical dims in storage order: row-major, or (half the time) the rows dim first, so the
    /// batch dims (heads) sit between the rows and the last dim, as `[s, h, d]` tensors hold
    /// them.
    fn order(r: &mut rand::rngs::StdRng, rank: usize) -> Vec<usize> {
        if rank >= 3 && r.gen_bool(0.5) {
            [vec![rank - 2], (0..rank - 2).collect(), vec![rank - 1]].concat()
        } else {
            (0..rank).collect()
        }
    }

    /// The float32 kernel against the f64 reference on fresh random shapes: batch dims that
    /// broadcast, operands read through strided views (K transposed, heads between rows and
    /// columns), outputs written in such layouts too, query counts across several row blocks,
    /// masks of every broadcast form (fully masked rows with `nan_to_zero`), scales and a
    /// divided score, 1-3 threads. Tolerance: |fast - reference| <= 1e-5 * (1 + d) for inputs
    /// in [-1, 1] (scores summed over d terms in f32; the probabilities sum to 1, so the
    /// output is no larger than V). NaN fails unless both are NaN where the chain gives NaN.
    #[test]
    fn the_float32_kernel_matches_the_f64_reference() {
        let seed: u64 = rand::random();
        eprintln!("seed {seed}");
        let mut r = rand::rngs::StdRng::seed_from_u64(seed);
        for case in 0..80 {
            ferrum_kernels::pool::set_threads(Some(1 + case % 3));
            let (h, sq, sk) = (r.gen_range(1..5), r.gen_range(1..150), r.gen_range(1..90));
            let (d, dv) = (r.gen_range(1..40), r.gen_range(1..40));
            let two = r.gen_bool(0.5);
            let qb = if two { vec![2, h] } else { vec![h] };
            let kb = if r.gen_bool(0.3) {
                vec![1, h]
            } else {
                qb.clone()
            };
            let vb = if r.gen_bool(0.3) { vec![h] } else { qb.clone() };
            let shape = |b: &[usize], m: usize, n: usize| [b, &[m, n][..]].concat();
            let qshape = shape(&qb, sq, d);
            let qorder = order(&mut r, qshape.len());
            let (qt, _, qst) = stored(&mut r, &qshape, &qorder);
            let q = View::strided(&qt, 0, qshape.clone(), qst).unwrap();
            // K as [.., d, sk], or stored [.., sk, d] and read transposed.
            let swapped = r.gen_bool(0.5);
            let kshape = shape(&kb, d, sk);
            let kr = kshape.len();
            let mut korder = order(&mut r, kr);
            if swapped {
                let (a, b) = (
                    korder.iter().position(|&x| x == kr - 2),
                    korder.iter().position(|&x| x == kr - 1),
                );
                korder.swap(a.unwrap(), b.unwrap());
            }
            let (kt, _, kst) = stored(&mut r, &kshape, &korder);
            let k = View::strided(&kt, 0, kshape.clone(), kst).unwrap();
            let vshape = shape(&vb, sk, dv);
            let vorder = order(&mut r, vshape.len());
            let (vt, _, vst) = stored(&mut r, &vshape, &vorder);
            let v = View::strided(&vt, 0, vshape.clone(), vst).unwrap();
            let nan_to_zero = r.gen_bool(0.5);
            let lead = if two { vec![2, 1] } else { vec![1] };
            let mshape = match r.gen_range(0..5) {
                0 => None,
                1 => Some(vec![sq, sk]),
                2 => Some([&lead[..], &[1, sk]].concat()),
                3 => Some(vec![1]),
                _ => Some([&qb[..], &[sq, 1]].concat()),
            };
            let mask = mshape.map(|ms| {
                let n: usize = ms.iter().product();
                let vals = (0..n)
                    .map(|i| match r.gen_range(0..6) {
                        // Whole rows masked only where NaN becomes 0.
                        0 if nan_to_zero || i % 2 == 1 => f32::NEG_INFINITY,
                        1 => -30.0,
                        _ => r.gen_range(-2.0f32..2.0),
                    })
                    .collect();
                Tensor::from_vec(ms, vals).unwrap()
            });
            let scale =
                |r: &mut rand::rngs::StdRng| r.gen_bool(0.5).then(|| r.gen_range(0.1f32..2.0));
            let (qs, ks) = (scale(&mut r), scale(&mut r));
            let post = match r.gen_range(0..3) {
                0 => None,
                1 => Some(((d as f32).sqrt(), true)),
                _ => Some((0.3, false)),
            };
            let spec = FusedSpec { post, nan_to_zero };
            // The output row-major, or with its batch dims between the rows and dv.
            let mut oshape = broadcast_shape(&broadcast_shape(&qb, &kb).unwrap(), &vb).unwrap();
            oshape.extend([sq, dv]);
            let oorder = order(&mut r, oshape.len());
            let ystride = row_major(&oorder.iter().map(|&l| oshape[l]).collect::<Vec<_>>());
            let mut ost = vec![0; oshape.len()];
            for (j, &l) in oorder.iter().enumerate() {
                ost[l] = ystride[j];
            }
            let out = (oorder.iter().map(|&l| oshape[l]).collect::<Vec<_>>(), ost);
            let fast = attention_f32(&q, &k, &v, mask.as_ref(), (qs, ks), spec, Some(&out))
                .unwrap()
                .expect("the mask and the layout fit");
            let scalar = |s: Option<f32>| s.map(|c| Tensor::from_vec(vec![1], vec![c]).unwrap());
            let (qst, kst) = (scalar(qs), scalar(ks));
            let want = attention_reference(
                &q.materialize().unwrap(),
                &k.materialize().unwrap(),
                &v.materialize().unwrap(),
                mask.as_ref(),
                (qst.as_ref(), kst.as_ref()),
                spec,
            )
            .unwrap();
            let want = scatter(&want, out.0.clone(), &out.1).unwrap();
            assert_eq!(fast.shape(), want.shape(), "case {case}");
            let (a, b) = (
                fast.as_slice::<f32>().unwrap(),
                want.as_slice::<f32>().unwrap(),
            );
            let tol = 1e-5 * (1.0 + d as f32);
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                assert!(
                    (x - y).abs() <= tol || (x.is_nan() && y.is_nan() && !nan_to_zero),
                    "case {case} (q {qshape:?} k {kshape:?} v {vshape:?} swapped {swapped} out {out:?} spec {spec:?}) element {i}: {x} vs {y}"
                );
            }
        }
        ferrum_kernels::pool::set_threads(None);
    }
}
