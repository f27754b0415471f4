//! Assorted ops: SwiGLU, CenterCropPad, TensorScatter, window functions, Det, Unique, MaxUnpool,
//! Col2Im, NonMaxSuppression.

use crate::ir::Attr;
use crate::ops::elementwise::cast;
use crate::ops::shape::{strides, take};
use crate::ops::{axis, unsupported, Ctx};
use crate::ops::{one, Kernel};
use crate::tensor::{DType, Tensor, Value};
use crate::{kbail, Result};

fn swiglu(cx: &Ctx) -> Result<Tensor> {
    let (a, b) = (cx.t(0)?, cx.t(1)?);
    if a.shape() != b.shape() {
        kbail!("SwiGLU inputs differ in shape");
    }
    let alpha = cx.af("alpha", 1.0) as f64;
    let sig = cast(
        &Tensor::from_vec(
            a.shape().to_vec(),
            a.to_f64_vec()?
                .iter()
                .map(|&x| 1.0 / (1.0 + (-alpha * x).exp()))
                .collect(),
        )?,
        a.dtype(),
    )?;
    let sw = cast(
        &Tensor::from_vec(
            a.shape().to_vec(),
            a.to_f64_vec()?
                .iter()
                .zip(sig.to_f64_vec()?)
                .map(|(x, s)| x * s)
                .collect(),
        )?,
        a.dtype(),
    )?;
    let out = sw
        .to_f64_vec()?
        .iter()
        .zip(b.to_f64_vec()?)
        .map(|(x, y)| x * y)
        .collect();
    cast(&Tensor::from_vec(a.shape().to_vec(), out)?, a.dtype())
}

fn center_crop_pad(cx: &Ctx) -> Result<Tensor> {
    let x = cx.t(0)?;
    let target = cx.t(1)?.to_i64_vec()?;
    let r = x.rank();
    let axes: Vec<usize> = match cx.aints("axes") {
        Some(a) => a.iter().map(|&v| axis(v, r)).collect::<Result<_>>()?,
        None => (0..r).collect(),
    };
    let mut shape = x.shape().to_vec();
    // per dim: output index o maps to input index o + shift (shift may be negative)
    let mut shift = vec![0i64; r];
    for (&a, &t) in axes.iter().zip(&target) {
        let d = x.shape()[a] as i64;
        shape[a] = t.max(0) as usize;
        shift[a] = if t < d { (d - t) / 2 } else { -((t - d) / 2) };
    }
    let n: usize = shape.iter().product();
    let os = strides(&shape);
    let xs = strides(x.shape());
    let idx: Vec<Option<usize>> = (0..n)
        .map(|o| {
            let mut off = 0usize;
            for d in 0..r {
                let i = ((o / os[d]) % shape[d]) as i64 + shift[d];
                if i < 0 || i >= x.shape()[d] as i64 {
                    return None;
                }
                off += i as usize * xs[d];
            }
            Some(off)
        })
        .collect();
    let zero = Tensor::zeros(x.dtype(), vec![1])?;
    let src = crate::ops::shape::concat_t(&[&x.clone().reshape(vec![x.len()])?, &zero], 0)?;
    let flat: Vec<usize> = idx.iter().map(|i| i.unwrap_or(x.len())).collect();
    take(&src, &flat, shape)
}

fn tensor_scatter(cx: &Ctx) -> Result<Tensor> {
    let (past, upd) = (cx.t(0)?, cx.t(1)?);
    let wi = cx.opt(2).map(|t| t.to_i64_vec()).transpose()?;
    let circular = cx.astr("mode", "linear") == "circular";
    let r = past.rank();
    let a = axis(cx.ai("axis", -2), r)?;
    let max = past.shape()[a];
    let ps = strides(past.shape());
    let us = strides(upd.shape());
    let mut idx: Vec<usize> = (0..past.len()).collect();
    // Source: 0..past.len() = past, past.len().. = update.
    for u in 0..upd.len() {
        let mut off = 0usize;
        let b = if r > 0 { u / us[0] % upd.shape()[0] } else { 0 };
        let start = wi.as_ref().map_or(0, |w| w[b]);
        for d in 0..r {
            let mut i = (u / us[d]) % upd.shape()[d];
            if d == a {
                let mut j = start + i as i64;
                if circular {
                    j = j.rem_euclid(max as i64);
                }
                if j < 0 || j >= max as i64 {
                    kbail!("write index {j} out of range");
                }
                i = j as usize;
            }
            off += i * ps[d];
        }
        idx[off] = past.len() + u;
    }
    let src = crate::ops::shape::concat_t(
        &[
            &past.clone().reshape(vec![past.len()])?,
            &upd.clone().reshape(vec![upd.len()])?,
        ],
        0,
    )?;
    take(&src, &idx, past.shape().to_vec())
}

fn window(cx: &Ctx) -> Result<Tensor> {
    let n = cx.t(0)?.scalar_i64()?.max(0) as usize;
    let periodic = cx.ai("periodic", 1) != 0;
    let nn = if periodic { n as f64 } else { n as f64 - 1.0 };
    let pi = std::f64::consts::PI;
    let v: Vec<f64> = (0..n)
        .map(|i| {
            let i = i as f64;
            match cx.node.op.as_str() {
                "HannWindow" => (pi * i / nn).sin().powi(2),
                "HammingWindow" => {
                    let a = 25.0 / 46.0;
                    a - (1.0 - a) * (2.0 * pi * i / nn).cos()
                }
                _ => 0.42 - 0.5 * (2.0 * pi * i / nn).cos() + 0.08 * (4.0 * pi * i / nn).cos(),
            }
        })
        .collect();
    let dt = DType::from_onnx(cx.ai("output_datatype", 1) as i32)
        .ok_or_else(|| unsupported("output_datatype"))?;
    cast(&Tensor::from_vec(vec![n], v)?, dt)
}

fn det(cx: &Ctx) -> Result<Tensor> {
    let x = cx.t(0)?;
    let r = x.rank();
    if r < 2 || x.shape()[r - 1] != x.shape()[r - 2] {
        kbail!("Det expects [*, M, M]");
    }
    let m = x.shape()[r - 1];
    let v = x.to_f64_vec()?;
    let out: Vec<f64> = v
        .chunks(m * m)
        .map(|a| {
            let mut a = a.to_vec();
            let mut det = 1.0;
            for c in 0..m {
                let p = (c..m)
                    .max_by(|&i, &j| a[i * m + c].abs().total_cmp(&a[j * m + c].abs()))
                    .unwrap_or(c);
                if a[p * m + c] == 0.0 {
                    return 0.0;
                }
                if p != c {
                    for k in 0..m {
                        a.swap(p * m + k, c * m + k);
                    }
                    det = -det;
                }
                det *= a[c * m + c];
                for i in c + 1..m {
                    let f = a[i * m + c] / a[c * m + c];
                    for k in c..m {
                        a[i * m + k] -= f * a[c * m + k];
                    }
                }
            }
            det
        })
        .collect();
    cast(
        &Tensor::from_vec(x.shape()[..r - 2].to_vec(), out)?,
        x.dtype(),
    )
}

fn unique(cx: &Ctx) -> Result<Vec<Value>> {
    let x = cx.t(0)?;
    let sorted = cx.ai("sorted", 1) != 0;
    let (t, a) = match cx.attr("axis") {
        Some(Attr::Int(a)) => (x.clone(), axis(*a, x.rank())?),
        _ => (x.clone().reshape(vec![x.len()])?, 0),
    };
    let d = t.shape()[a];
    let outer: usize = t.shape()[..a].iter().product();
    let inner: usize = t.shape()[a + 1..].iter().product();
    let v = t.to_f64_vec()?;
    let slice = |i: usize| -> Vec<f64> {
        let mut s = Vec::with_capacity(outer * inner);
        for o in 0..outer {
            s.extend_from_slice(&v[(o * d + i) * inner..][..inner]);
        }
        s
    };
    let slices: Vec<Vec<f64>> = (0..d).map(slice).collect();
    let mut uniq: Vec<usize> = Vec::new(); // first occurrence of each distinct slice
    let mut inverse = vec![0usize; d];
    for i in 0..d {
        match uniq.iter().position(|&u| slices[u] == slices[i]) {
            Some(p) => inverse[i] = p,
            None => {
                inverse[i] = uniq.len();
                uniq.push(i);
            }
        }
    }
    let mut order: Vec<usize> = (0..uniq.len()).collect();
    if sorted {
        order.sort_by(|&p, &q| {
            slices[uniq[p]]
                .iter()
                .zip(&slices[uniq[q]])
                .map(|(x, y)| x.total_cmp(y))
                .find(|o| o.is_ne())
                .unwrap_or(std::cmp::Ordering::Equal)
        });
    }
    let mut rank = vec![0usize; uniq.len()];
    for (k, &p) in order.iter().enumerate() {
        rank[p] = k;
    }
    let mut counts = vec![0i64; uniq.len()];
    for &p in &inverse {
        counts[rank[p]] += 1;
    }
    let firsts: Vec<usize> = order.iter().map(|&p| uniq[p]).collect();
    let mut offs = Vec::new();
    for o in 0..outer {
        for &i in &firsts {
            offs.extend((0..inner).map(|j| (o * d + i) * inner + j));
        }
    }
    let mut shape = t.shape().to_vec();
    shape[a] = firsts.len();
    let y = take(&t, &offs, shape)?;
    let n = firsts.len();
    Ok(vec![
        Value::Tensor(y),
        Value::Tensor(Tensor::from_vec(
            vec![n],
            firsts.iter().map(|&i| i as i64).collect(),
        )?),
        Value::Tensor(Tensor::from_vec(
            vec![d],
            inverse.iter().map(|&p| rank[p] as i64).collect(),
        )?),
        Value::Tensor(Tensor::from_vec(vec![n], counts)?),
    ])
}

fn max_unpool(cx: &Ctx) -> Result<Tensor> {
    let (x, ind) = (cx.t(0)?, cx.t(1)?);
    let nd = x
        .rank()
        .checked_sub(2)
        .ok_or_else(|| crate::kerr!("X must have rank >= 3"))?;
    let k = cx
        .aints("kernel_shape")
        .ok_or_else(|| crate::kerr!("kernel_shape is required"))?;
    let s = cx.aints("strides").unwrap_or(vec![1; nd]);
    let p = cx.aints("pads").unwrap_or(vec![0; 2 * nd]);
    if k.len() != nd || s.len() != nd || p.len() != 2 * nd {
        kbail!("kernel_shape, strides or pads do not match {nd} spatial dims");
    }
    // Scatter into the inferred shape, then place it at the origin of output_shape.
    let mut inferred = x.shape()[..2].to_vec();
    for i in 0..nd {
        inferred
            .push(((x.shape()[i + 2] as i64 - 1) * s[i] + k[i] - p[i] - p[i + nd]).max(0) as usize);
    }
    let n: usize = inferred.iter().product();
    let mut y = vec![0f64; n];
    for (v, &i) in x.to_f64_vec()?.iter().zip(&ind.to_i64_vec()?) {
        if i < 0 || i as usize >= n {
            kbail!("index {i} out of range");
        }
        y[i as usize] = *v;
    }
    let shape: Vec<usize> = match cx.opt(2) {
        Some(t) => t.to_i64_vec()?.iter().map(|&v| v.max(0) as usize).collect(),
        None => inferred.clone(),
    };
    if shape.len() != inferred.len() || shape.iter().zip(&inferred).any(|(a, b)| a < b) {
        kbail!("output_shape {shape:?} is smaller than {inferred:?}");
    }
    let mut out = vec![0f64; shape.iter().product()];
    let (is, os) = (strides(&inferred), strides(&shape));
    for (i, v) in y.into_iter().enumerate() {
        let o: usize = (0..shape.len())
            .map(|d| (i / is[d]) % inferred[d] * os[d])
            .sum();
        out[o] = v;
    }
    cast(&Tensor::from_vec(shape, out)?, x.dtype())
}

fn mel_weight_matrix(cx: &Ctx) -> Result<Tensor> {
    let bins = cx.t(0)?.scalar_i64()?.max(0) as usize;
    let dft = cx.t(1)?.scalar_i64()?.max(0);
    let rate = cx.t(2)?.scalar_f64()?;
    let (lo, hi) = (cx.t(3)?.scalar_f64()?, cx.t(4)?.scalar_f64()?);
    let spec = (dft / 2 + 1) as usize;
    if bins > 1 << 16 || spec > 1 << 24 {
        kbail!("MelWeightMatrix too large");
    }
    let mel = |f: f64| 2595.0 * (f / 700.0).ln_1p() / 10f64.ln();
    let (ml, mh) = (mel(lo), mel(hi));
    let step = (mh - ml) / (bins + 2) as f64;
    let fb: Vec<usize> = (0..bins + 2)
        .map(|i| {
            let hz = 700.0 * ((i as f64 * step + ml) / 2595.0 * 10f64.ln()).exp_m1();
            (((dft + 1) as f64 * hz) / rate).floor().max(0.0) as usize
        })
        .collect();
    let mut out = vec![0f64; spec * bins];
    let mut set = |j: usize, i: usize, v: f64| {
        if j < spec {
            out[j * bins + i] = v;
        }
    };
    for i in 0..bins {
        let (l, c, h) = (fb[i], fb[i + 1], fb[i + 2]);
        if c == l {
            set(c, i, 1.0);
        } else {
            for j in l..=c {
                set(j, i, (j - l) as f64 / (c - l) as f64);
            }
        }
        for j in c..h {
            set(j, i, (h - j) as f64 / (h - c) as f64);
        }
    }
    let dt = DType::from_onnx(cx.ai("output_datatype", 1) as i32)
        .ok_or_else(|| unsupported("output_datatype"))?;
    cast(&Tensor::from_vec(vec![spec, bins], out)?, dt)
}

fn col2im(cx: &Ctx) -> Result<Tensor> {
    let x = cx.t(0)?;
    let img: Vec<usize> = cx.t(1)?.to_i64_vec()?.iter().map(|&v| v as usize).collect();
    let blk: Vec<usize> = cx.t(2)?.to_i64_vec()?.iter().map(|&v| v as usize).collect();
    let nd = img.len();
    let dil = cx.aints("dilations").unwrap_or(vec![1; nd]);
    let pads = cx.aints("pads").unwrap_or(vec![0; 2 * nd]);
    let st = cx.aints("strides").unwrap_or(vec![1; nd]);
    let (n, ck, l) = (x.shape()[0], x.shape()[1], x.shape()[2]);
    let bsz: usize = blk.iter().product();
    let c = ck / bsz;
    let outs: Vec<usize> = (0..nd)
        .map(|i| {
            ((img[i] as i64 + pads[i] + pads[i + nd] - dil[i] * (blk[i] as i64 - 1) - 1) / st[i]
                + 1) as usize
        })
        .collect();
    if outs.iter().product::<usize>() != l {
        kbail!("L = {l} does not match the block grid {outs:?}");
    }
    let v = x.to_f64_vec()?;
    let isp: usize = img.iter().product();
    let ist = strides(&img);
    let bst = strides(&blk);
    let lst = strides(&outs);
    let mut out = vec![0f64; n * c * isp];
    for b in 0..n {
        for ch in 0..c {
            for kb in 0..bsz {
                for li in 0..l {
                    let mut off = 0usize;
                    let mut inside = true;
                    for d in 0..nd {
                        let kk = (kb / bst[d]) % blk[d];
                        let ll = (li / lst[d]) % outs[d];
                        let pos = ll as i64 * st[d] + kk as i64 * dil[d] - pads[d];
                        if pos < 0 || pos >= img[d] as i64 {
                            inside = false;
                            break;
                        }
                        off += pos as usize * ist[d];
                    }
                    if inside {
                        out[(b * c + ch) * isp + off] += v[((b * ck) + ch * bsz + kb) * l + li];
                    }
                }
            }
        }
    }
    let mut shape = vec![n, c];
    shape.extend(img);
    cast(&Tensor::from_vec(shape, out)?, x.dtype())
}

fn nms(cx: &Ctx) -> Result<Tensor> {
    let (boxes, scores) = (cx.t(0)?, cx.t(1)?);
    let max_out = cx
        .opt(2)
        .filter(|t| !t.is_empty())
        .map(|t| t.scalar_i64())
        .transpose()?
        .unwrap_or(0)
        .max(0) as usize;
    let iou_t = cx
        .opt(3)
        .filter(|t| !t.is_empty())
        .map(|t| t.scalar_f64())
        .transpose()?
        .unwrap_or(0.0);
    let score_t = cx
        .opt(4)
        .filter(|t| !t.is_empty())
        .map(|t| t.scalar_f64())
        .transpose()?;
    let center = cx.ai("center_point_box", 0) != 0;
    let (nb, ns) = (boxes.shape()[0], boxes.shape()[1]);
    let nc = scores.shape()[1];
    let bv = boxes.to_f64_vec()?;
    let sv = scores.to_f64_vec()?;
    let corners = |b: usize, i: usize| -> (f64, f64, f64, f64) {
        let q = &bv[(b * ns + i) * 4..][..4];
        if center {
            (
                q[1] - q[3] / 2.0,
                q[0] - q[2] / 2.0,
                q[1] + q[3] / 2.0,
                q[0] + q[2] / 2.0,
            )
        } else {
            (
                q[0].min(q[2]),
                q[1].min(q[3]),
                q[0].max(q[2]),
                q[1].max(q[3]),
            )
        }
    };
    let suppress = |b: usize, i: usize, j: usize| -> bool {
        let (ay0, ax0, ay1, ax1) = corners(b, i);
        let (by0, bx0, by1, bx1) = corners(b, j);
        let (ix0, ix1) = (ax0.max(bx0), ax1.min(bx1));
        let (iy0, iy1) = (ay0.max(by0), ay1.min(by1));
        if ix1 <= ix0 || iy1 <= iy0 {
            return false;
        }
        let inter = (ix1 - ix0) * (iy1 - iy0);
        let (a1, a2) = ((ax1 - ax0) * (ay1 - ay0), (bx1 - bx0) * (by1 - by0));
        let union = a1 + a2 - inter;
        if a1 <= 0.0 || a2 <= 0.0 || union <= 0.0 {
            return false;
        }
        inter / union > iou_t
    };
    let mut sel: Vec<i64> = Vec::new();
    for b in 0..nb {
        for c in 0..nc {
            let s = &sv[(b * nc + c) * ns..][..ns];
            let mut cand: Vec<usize> = (0..ns)
                .filter(|&i| score_t.is_none_or(|t| s[i] > t))
                .collect();
            cand.sort_by(|&p, &q| s[q].total_cmp(&s[p]).then(p.cmp(&q)));
            let mut kept: Vec<usize> = Vec::new();
            for i in cand {
                if kept.len() >= max_out {
                    break;
                }
                if kept.iter().all(|&k| !suppress(b, k, i)) {
                    kept.push(i);
                    sel.extend([b as i64, c as i64, i as i64]);
                }
            }
        }
    }
    let n = sel.len() / 3;
    Tensor::from_vec(vec![n, 3], sel)
}

pub fn kernel(op: &str) -> Option<Kernel> {
    let k: Kernel = match op {
        "SwiGLU" => |cx| one(swiglu(cx)?),
        "CenterCropPad" => |cx| one(center_crop_pad(cx)?),
        "TensorScatter" => |cx| one(tensor_scatter(cx)?),
        "HannWindow" | "HammingWindow" | "BlackmanWindow" => |cx| one(window(cx)?),
        "Det" => |cx| one(det(cx)?),
        "Unique" => unique,
        "MaxUnpool" => |cx| one(max_unpool(cx)?),
        "Col2Im" => |cx| one(col2im(cx)?),
        "NonMaxSuppression" => |cx| one(nms(cx)?),
        "RoiAlign" => |cx| one(roi_align(cx)?),
        "MelWeightMatrix" => |cx| one(mel_weight_matrix(cx)?),
        _ => return None,
    };
    Some(k)
}

/// RoiAlign: average or max of bilinear samples on a grid inside each region's output bins.
fn roi_align(cx: &Ctx) -> Result<Tensor> {
    let (x, rois, bidx) = (cx.t(0)?, cx.t(1)?, cx.t(2)?.to_i64_vec()?);
    if x.rank() != 4 || rois.rank() != 2 || rois.shape()[1] != 4 || rois.shape()[0] != bidx.len() {
        kbail!("RoiAlign expects X [N,C,H,W], rois [R,4] and R batch indices");
    }
    let (n, c, h, w) = (x.shape()[0], x.shape()[1], x.shape()[2], x.shape()[3]);
    let (oh, ow) = (
        cx.ai("output_height", 1).max(1) as usize,
        cx.ai("output_width", 1).max(1) as usize,
    );
    let ratio = cx.ai("sampling_ratio", 0);
    let scale = cx.af("spatial_scale", 1.0) as f64;
    let max_mode = cx.astr("mode", "avg").eq_ignore_ascii_case("max");
    let half = cx
        .astr("coordinate_transformation_mode", "half_pixel")
        .eq_ignore_ascii_case("half_pixel");
    let xv = x.to_f64_vec()?;
    let rv = rois.to_f64_vec()?;
    let nr = bidx.len();
    let mut out = vec![0f64; nr * c * oh * ow];
    for r in 0..nr {
        let b = bidx[r];
        if b < 0 || b as usize >= n {
            kbail!("batch index {b} out of range");
        }
        let off = if half { 0.5 } else { 0.0 };
        let q = &rv[r * 4..r * 4 + 4];
        let (sw, sh) = (q[0] * scale - off, q[1] * scale - off);
        let (mut rw, mut rh) = (q[2] * scale - off - sw, q[3] * scale - off - sh);
        if !half {
            rw = rw.max(1.0);
            rh = rh.max(1.0);
        }
        let (bh, bw) = (rh / oh as f64, rw / ow as f64);
        let gh = if ratio > 0 {
            ratio as usize
        } else {
            (rh / oh as f64).ceil().max(0.0) as usize
        };
        let gw = if ratio > 0 {
            ratio as usize
        } else {
            (rw / ow as f64).ceil().max(0.0) as usize
        };
        if gh * gw > 1 << 20 {
            kbail!("sampling grid too large");
        }
        let count = (gh * gw).max(1) as f64;
        // bilinear taps of each sample point: (4 positions, 4 weights)
        let mut taps: Vec<([usize; 4], [f64; 4])> = Vec::with_capacity(oh * ow * gh * gw);
        for ph in 0..oh {
            for pw in 0..ow {
                for iy in 0..gh {
                    let y = sh + ph as f64 * bh + (iy as f64 + 0.5) * bh / gh as f64;
                    for ix in 0..gw {
                        let mut xx = sw + pw as f64 * bw + (ix as f64 + 0.5) * bw / gw as f64;
                        if y < -1.0 || y > h as f64 || xx < -1.0 || xx > w as f64 {
                            taps.push(([0; 4], [0.0; 4]));
                            continue;
                        }
                        let yy = y.max(0.0);
                        xx = xx.max(0.0);
                        let (mut yl, mut xl) = (yy as usize, xx as usize);
                        let (yh, xh);
                        let mut yv = yy;
                        if yl >= h - 1 {
                            yl = h - 1;
                            yh = h - 1;
                            yv = yl as f64;
                        } else {
                            yh = yl + 1;
                        }
                        if xl >= w - 1 {
                            xl = w - 1;
                            xh = w - 1;
                            xx = xl as f64;
                        } else {
                            xh = xl + 1;
                        }
                        let (ly, lx) = (yv - yl as f64, xx - xl as f64);
                        let (hy, hx) = (1.0 - ly, 1.0 - lx);
                        taps.push((
                            [yl * w + xl, yl * w + xh, yh * w + xl, yh * w + xh],
                            [hy * hx, hy * lx, ly * hx, ly * lx],
                        ));
                    }
                }
            }
        }
        for ch in 0..c {
            let base = (b as usize * c + ch) * h * w;
            let mut k = 0;
            for p in 0..oh * ow {
                let mut acc: Option<f64> = None;
                let mut sum = 0.0;
                for _ in 0..gh * gw {
                    let (pos, wt) = taps[k];
                    k += 1;
                    if max_mode {
                        let v = (0..4)
                            .map(|t| wt[t] * xv[base + pos[t]])
                            .fold(f64::NEG_INFINITY, f64::max);
                        acc = Some(acc.map_or(v, |a| a.max(v)));
                    } else {
                        sum += (0..4).map(|t| wt[t] * xv[base + pos[t]]).sum::<f64>();
                    }
                }
                out[(r * c + ch) * oh * ow + p] = if max_mode {
                    acc.unwrap_or(0.0)
                } else {
                    sum / count
                };
            }
        }
    }
    cast(&Tensor::from_vec(vec![nr, c, oh, ow], out)?, x.dtype())
}
