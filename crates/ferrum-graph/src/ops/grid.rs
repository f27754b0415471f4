//! GridSample (2-D and 3-D; nearest, linear, cubic; zeros, border, reflection padding) and
//! AffineGrid.

use crate::ops::elementwise::cast;
use crate::ops::shape::strides;
use crate::ops::{unsupported, Ctx};
use crate::tensor::Tensor;
use crate::{kbail, Result};

fn reflect(x: f64, lo: f64, hi: f64) -> f64 {
    let rng = hi - lo;
    if rng <= 0.0 {
        return lo;
    }
    if x < lo {
        let dx = lo - x;
        let n = (dx / rng) as i64;
        let r = dx - n as f64 * rng;
        if n % 2 == 0 {
            lo + r
        } else {
            hi - r
        }
    } else if x > hi {
        let dx = x - hi;
        let n = (dx / rng) as i64;
        let r = dx - n as f64 * rng;
        if n % 2 == 0 {
            hi - r
        } else {
            lo + r
        }
    } else {
        x
    }
}

fn cubic(x: f64) -> [f64; 4] {
    let a = -0.75;
    let x = x.abs();
    [
        ((a * (x + 1.0) - 5.0 * a) * (x + 1.0) + 8.0 * a) * (x + 1.0) - 4.0 * a,
        ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0,
        ((a + 2.0) * (1.0 - x) - (a + 3.0)) * (1.0 - x) * (1.0 - x) + 1.0,
        ((a * (2.0 - x) - 5.0 * a) * (2.0 - x) + 8.0 * a) * (2.0 - x) - 4.0 * a,
    ]
}

pub fn grid_sample(cx: &Ctx) -> Result<Tensor> {
    let (x, grid) = (cx.t(0)?, cx.t(1)?);
    let mode = match cx
        .astr(
            "mode",
            if cx.opset() < 20 {
                "bilinear"
            } else {
                "linear"
            },
        )
        .as_str()
    {
        "bilinear" | "linear" => 1,
        "nearest" => 0,
        "bicubic" | "cubic" => 2,
        m => return Err(unsupported(format!("GridSample mode '{m}'"))),
    };
    let pad = cx.astr("padding_mode", "zeros");
    let align = cx.ai("align_corners", 0) != 0;
    let k = x
        .rank()
        .checked_sub(2)
        .ok_or_else(|| crate::kerr!("X must have rank >= 3"))?;
    let (n, c) = (x.shape()[0], x.shape()[1]);
    let dims = &x.shape()[2..];
    if grid.rank() != k + 2 || grid.shape()[k + 1] != k || grid.shape()[0] != n {
        kbail!(
            "grid shape {:?} does not match X {:?}",
            grid.shape(),
            x.shape()
        );
    }
    let out_sp: Vec<usize> = grid.shape()[1..=k].to_vec();
    let osp: usize = out_sp.iter().product();
    let isp: usize = dims.iter().product();
    let ist = strides(dims);
    let xv = x.to_f64_vec()?;
    let gv = grid.to_f64_vec()?;
    let (lo, hi): (Vec<f64>, Vec<f64>) = dims
        .iter()
        .map(|&d| {
            if align {
                (0.0, d as f64 - 1.0)
            } else {
                (-0.5, d as f64 - 0.5)
            }
        })
        .unzip();
    let mut out = vec![0f64; n * c * osp];
    // Per output point: for each dim, taps of (index or None for zero padding, weight).
    let mut taps: Vec<Vec<(Option<usize>, f64)>> = vec![Vec::new(); k];
    for b in 0..n {
        for p in 0..osp {
            let g = &gv[(b * osp + p) * k..][..k];
            for i in 0..k {
                let nv = g[k - 1 - i];
                let d = dims[i] as f64;
                let mut v = if align {
                    (nv + 1.0) / 2.0 * (d - 1.0)
                } else {
                    ((nv + 1.0) * d - 1.0) / 2.0
                };
                v = v as f32 as f64;
                if mode == 0 {
                    v = v.round_ties_even();
                }
                if v < lo[i] || v > hi[i] {
                    if pad == "border" {
                        v = v.clamp(0.0, d - 1.0);
                    } else if pad == "reflection" {
                        v = reflect(v, lo[i], hi[i]);
                    }
                }
                let fetch = |j: i64| -> Option<usize> {
                    let dm = dims[i] as i64;
                    match pad.as_str() {
                        "border" => Some(j.clamp(0, dm - 1) as usize),
                        "reflection" => {
                            Some((reflect(j as f64, lo[i], hi[i]) as i64).clamp(0, dm - 1) as usize)
                        }
                        _ => (j >= 0 && j < dm).then_some(j as usize),
                    }
                };
                taps[i].clear();
                match mode {
                    0 => taps[i].push((fetch(v as i64), 1.0)),
                    1 => {
                        let x0 = v.floor();
                        let f = v - x0;
                        taps[i].push((fetch(x0 as i64), 1.0 - f));
                        taps[i].push((fetch(x0 as i64 + 1), f));
                    }
                    _ => {
                        let x0 = v.floor();
                        let w = cubic(v - x0);
                        for (t, wt) in w.iter().enumerate() {
                            taps[i].push((fetch(x0 as i64 - 1 + t as i64), *wt));
                        }
                    }
                }
            }
            // Walk the product of the per-dim taps.
            let total: usize = taps.iter().map(Vec::len).product();
            for ch in 0..c {
                let base = (b * c + ch) * isp;
                let mut acc = 0.0;
                for t in 0..total {
                    let mut rem = t;
                    let mut w = 1.0;
                    let mut off = Some(0usize);
                    for i in (0..k).rev() {
                        let (idx, wt) = taps[i][rem % taps[i].len()];
                        rem /= taps[i].len();
                        w *= wt;
                        off = match (off, idx) {
                            (Some(o), Some(j)) => Some(o + j * ist[i]),
                            _ => None,
                        };
                    }
                    if let Some(o) = off {
                        acc += w * xv[base + o];
                    }
                }
                out[(b * c + ch) * osp + p] = acc;
            }
        }
    }
    let mut shape = vec![n, c];
    shape.extend(out_sp);
    cast(&Tensor::from_vec(shape, out)?, x.dtype())
}

pub fn affine_grid(cx: &Ctx) -> Result<Tensor> {
    let theta = cx.t(0)?;
    let size = cx.t(1)?.to_i64_vec()?;
    let align = cx.ai("align_corners", 0) != 0;
    let tv = theta.to_f64_vec()?;
    let n = size[0] as usize;
    let sp: Vec<usize> = size[2..].iter().map(|&d| d.max(0) as usize).collect();
    let k = sp.len();
    if k != 2 && k != 3 {
        kbail!("AffineGrid supports 2-D and 3-D sizes");
    }
    let lin = |i: usize, d: usize| -> f64 {
        if d <= 1 {
            return 0.0;
        }
        let step = 2.0 / (d as f64 - if align { 1.0 } else { 0.0 });
        let start = if align { -1.0 } else { -1.0 + step / 2.0 };
        start + i as f64 * step
    };
    let total: usize = sp.iter().product();
    let sst = strides(&sp);
    let mut out: Vec<f64> = Vec::with_capacity(n * total * k);
    for b in 0..n {
        let th = &tv[b * k * (k + 1)..][..k * (k + 1)];
        for p in 0..total {
            // base coordinates, innermost dim first: (x, y[, z], 1)
            let mut base: Vec<f64> = (0..k)
                .rev()
                .map(|i| lin((p / sst[i]) % sp[i], sp[i]))
                .collect();
            base.push(1.0);
            for r in 0..k {
                out.push((0..=k).map(|j| th[r * (k + 1) + j] * base[j]).sum());
            }
        }
    }
    let mut shape = vec![n];
    shape.extend(&sp);
    shape.push(k);
    cast(&Tensor::from_vec(shape, out)?, theta.dtype())
}
