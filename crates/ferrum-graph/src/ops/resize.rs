//! Resize (and Upsample): separable 1-D interpolation along each resized axis, with ONNX's
//! coordinate transformations, nearest rounding modes, linear/cubic taps and antialiasing.

use crate::ops::elementwise::cast;
use crate::ops::{axis, unsupported, Ctx};
use crate::tensor::{DType, Tensor};
use crate::{kbail, Result};

struct Opts {
    mode: String,
    coord: String,
    nearest: String,
    cubic_a: f64,
    exclude_outside: bool,
    extrapolation: f64,
    antialias: bool,
}

fn coeffs(o: &Opts, ratio: f64, scale: f64) -> Vec<f64> {
    match o.mode.as_str() {
        "nearest" => {
            if ratio.fract() == 0.0 {
                return vec![0.0, 1.0];
            }
            let b = |c: bool| c as u8 as f64;
            match o.nearest.as_str() {
                "round_prefer_ceil" => vec![b(ratio < 0.5), b(ratio >= 0.5)],
                "floor" => vec![1.0, 0.0],
                "ceil" => vec![0.0, 1.0],
                _ => vec![b(ratio <= 0.5), b(ratio > 0.5)],
            }
        }
        "linear" if o.antialias => {
            let s = scale.min(1.0);
            let start = (-1.0 / s).floor() as i64 + 1;
            let foot = 2 - 2 * start;
            let c: Vec<f64> = (start..start + foot)
                .map(|i| (1.0 - ((i as f64 - ratio) * s).abs()).clamp(0.0, 1.0))
                .collect();
            let sum: f64 = c.iter().sum();
            c.iter().map(|x| x / sum).collect()
        }
        "linear" => vec![1.0 - ratio, ratio],
        _ if o.antialias => {
            let a = o.cubic_a;
            let s = scale.min(1.0);
            let f = |x: f64| {
                let x = x.abs();
                if x <= 1.0 {
                    (a + 2.0) * x.powi(3) - (a + 3.0) * x * x + 1.0
                } else if x < 2.0 {
                    a * x.powi(3) - 5.0 * a * x * x + 8.0 * a * x - 4.0 * a
                } else {
                    0.0
                }
            };
            let start = (-2.0 / s).floor() as i64 + 1;
            let end = 2 - start;
            let c: Vec<f64> = (start..end).map(|i| f(s * (i as f64 - ratio))).collect();
            let sum: f64 = c.iter().sum();
            c.iter().map(|x| x / sum).collect()
        }
        _ => {
            let a = o.cubic_a;
            let r = ratio;
            vec![
                ((a * (r + 1.0) - 5.0 * a) * (r + 1.0) + 8.0 * a) * (r + 1.0) - 4.0 * a,
                ((a + 2.0) * r - (a + 3.0)) * r * r + 1.0,
                ((a + 2.0) * (1.0 - r) - (a + 3.0)) * (1.0 - r) * (1.0 - r) + 1.0,
                ((a * ((1.0 - r) + 1.0) - 5.0 * a) * ((1.0 - r) + 1.0) + 8.0 * a)
                    * ((1.0 - r) + 1.0)
                    - 4.0 * a,
            ]
        }
    }
}

/// Resizes `data` (shape `shape`) along axis `a` to `out_len` elements.
#[allow(clippy::too_many_arguments)]
fn resize_axis(
    data: &[f64],
    shape: &[usize],
    a: usize,
    scale: f64,
    out_len: usize,
    roi: Option<(f64, f64)>,
    o: &Opts,
) -> Result<(Vec<f64>, Vec<usize>)> {
    let inw = shape[a];
    let outw = scale * inw as f64;
    let mut taps: Vec<(Vec<usize>, Vec<f64>, bool)> = Vec::with_capacity(out_len);
    for y in 0..out_len {
        let yf = y as f64;
        let mut extrapolated = false;
        let x = match o.coord.as_str() {
            "align_corners" => {
                if outw == 1.0 {
                    0.0
                } else {
                    yf * (inw as f64 - 1.0) / (outw - 1.0)
                }
            }
            "asymmetric" => yf / scale,
            "tf_crop_and_resize" => {
                let (r0, r1) = roi.unwrap_or((0.0, 1.0));
                let x = if outw == 1.0 {
                    (r1 - r0) * (inw as f64 - 1.0) / 2.0
                } else {
                    yf * (r1 - r0) * (inw as f64 - 1.0) / (outw - 1.0)
                } + r0 * (inw as f64 - 1.0);
                extrapolated = x < 0.0 || x > inw as f64 - 1.0;
                x
            }
            "pytorch_half_pixel" => {
                if outw == 1.0 {
                    -0.5
                } else {
                    (yf + 0.5) / scale - 0.5
                }
            }
            "half_pixel" => (yf + 0.5) / scale - 0.5,
            "half_pixel_symmetric" => {
                let adj = out_len as f64 / outw;
                let offset = inw as f64 / 2.0 * (1.0 - adj);
                offset + (yf + 0.5) / scale - 0.5
            }
            m => return Err(unsupported(format!("coordinate_transformation_mode '{m}'"))),
        };
        let xi = x.floor();
        let ratio = if x == xi { 1.0 } else { x - xi };
        let mut c = coeffs(o, ratio, scale);
        let n = c.len() as i64;
        let pad = (n + 1) / 2;
        let xp = x + pad as f64;
        let pp = xp.floor();
        let frac = xp - pp;
        let off = if n % 2 == 0 {
            if frac == 0.0 {
                -(n / 2)
            } else {
                -(n / 2) + 1
            }
        } else {
            let base = -((n - 1) / 2);
            if frac <= 0.5 {
                base
            } else {
                base + 1
            }
        };
        let start = pp as i64 + off;
        let idx: Vec<i64> = (0..n).map(|k| start + k - pad).collect();
        if o.exclude_outside {
            for (k, &i) in idx.iter().enumerate() {
                if i < 0 || i >= inw as i64 {
                    c[k] = 0.0;
                }
            }
            let s: f64 = c.iter().sum();
            let s = if s == 0.0 { 1.0 } else { s };
            c.iter_mut().for_each(|v| *v /= s);
        }
        let idx = idx
            .iter()
            .map(|&i| i.clamp(0, inw as i64 - 1) as usize)
            .collect();
        taps.push((idx, c, extrapolated));
    }
    let mut out_shape = shape.to_vec();
    out_shape[a] = out_len;
    let outer: usize = shape[..a].iter().product();
    let inner: usize = shape[a + 1..].iter().product();
    let mut out = vec![0f64; outer * out_len * inner];
    for o_ in 0..outer {
        for (y, (idx, c, ext)) in taps.iter().enumerate() {
            for i in 0..inner {
                out[(o_ * out_len + y) * inner + i] = if *ext {
                    o.extrapolation
                } else {
                    idx.iter()
                        .zip(c)
                        .map(|(&j, w)| w * data[(o_ * inw + j) * inner + i])
                        .sum()
                };
            }
        }
    }
    Ok((out, out_shape))
}

pub fn resize(cx: &Ctx) -> Result<Tensor> {
    let x = cx.t(0)?;
    let r = x.rank();
    let upsample = cx.node.op == "Upsample";
    let legacy = upsample || cx.opset() < 11;
    let o = Opts {
        mode: cx.astr("mode", "nearest"),
        coord: if legacy {
            "asymmetric".into()
        } else {
            cx.astr("coordinate_transformation_mode", "half_pixel")
        },
        nearest: if legacy {
            "floor".into()
        } else {
            cx.astr("nearest_mode", "round_prefer_floor")
        },
        cubic_a: cx.af("cubic_coeff_a", -0.75) as f64,
        exclude_outside: cx.ai("exclude_outside", 0) != 0,
        extrapolation: cx.af("extrapolation_value", 0.0) as f64,
        antialias: cx.ai("antialias", 0) != 0,
    };
    let o = Opts {
        mode: match o.mode.as_str() {
            "bilinear" | "trilinear" => "linear".into(),
            "bicubic" => "cubic".into(),
            m => m.into(),
        },
        ..o
    };
    let (roi_t, scales_t, sizes_t) = if legacy {
        let sc = if upsample && cx.opset() < 9 {
            cx.afloats_vec("scales")
        } else {
            Some(cx.t(1)?.to_f64_vec()?)
        };
        (None, sc, None)
    } else {
        (
            cx.opt(1)
                .map(|t| t.to_f64_vec())
                .transpose()?
                .filter(|v| !v.is_empty()),
            cx.opt(2)
                .map(|t| t.to_f64_vec())
                .transpose()?
                .filter(|v| !v.is_empty()),
            cx.opt(3)
                .map(|t| t.to_i64_vec())
                .transpose()?
                .filter(|v| !v.is_empty()),
        )
    };
    let axes: Vec<usize> = match cx.aints("axes") {
        Some(a) => a.iter().map(|&v| axis(v, r)).collect::<Result<_>>()?,
        None => (0..r).collect(),
    };
    let na = axes.len();
    let mut scales = vec![1.0f64; r];
    let mut sizes: Vec<usize> = x.shape().to_vec();
    if let Some(sz) = sizes_t {
        if sz.len() != na {
            kbail!("sizes has {} entries for {na} axes", sz.len());
        }
        for (k, &a) in axes.iter().enumerate() {
            sizes[a] = sz[k].max(0) as usize;
            scales[a] = sizes[a] as f64 / x.shape()[a] as f64;
        }
        let policy = cx.astr("keep_aspect_ratio_policy", "stretch");
        if policy != "stretch" {
            let sel = axes.iter().map(|&a| scales[a]);
            let s = if policy == "not_larger" {
                sel.fold(f64::INFINITY, f64::min)
            } else {
                sel.fold(0.0, f64::max)
            };
            for &a in &axes {
                scales[a] = s;
                sizes[a] = (s * x.shape()[a] as f64 + 0.5) as usize;
            }
        }
    } else if let Some(sc) = scales_t {
        if sc.len() != na {
            kbail!("scales has {} entries for {na} axes", sc.len());
        }
        for (k, &a) in axes.iter().enumerate() {
            scales[a] = sc[k];
            sizes[a] = (sc[k] * x.shape()[a] as f64) as usize;
        }
    } else {
        kbail!("Resize needs scales or sizes");
    }
    let roi = roi_t.map(|v| {
        let mut full = vec![(0.0, 1.0); r];
        for (k, &a) in axes.iter().enumerate() {
            if v.len() >= 2 * na {
                full[a] = (v[k], v[na + k]);
            }
        }
        full
    });
    let mut data = x.to_f64_vec()?;
    let mut shape = x.shape().to_vec();
    for &a in &axes {
        let unchanged = (scales[a] - 1.0).abs() < 1e-9
            && sizes[a] == shape[a]
            && roi
                .as_ref()
                .is_none_or(|rv| rv[a].0.abs() < 1e-9 && (rv[a].1 - 1.0).abs() < 1e-9);
        if unchanged {
            continue;
        }
        let (d, s) = resize_axis(
            &data,
            &shape,
            a,
            scales[a],
            sizes[a],
            roi.as_ref().map(|v| v[a]),
            &o,
        )?;
        data = d;
        shape = s;
    }
    let dt = x.dtype();
    if dt.is_int() {
        let (lo, hi) = match dt {
            DType::U8 => (0.0, 255.0),
            DType::I8 => (-128.0, 127.0),
            _ => (f64::MIN, f64::MAX),
        };
        data.iter_mut()
            .for_each(|v| *v = v.round_ties_even().clamp(lo, hi));
    }
    cast(&Tensor::from_vec(shape, data)?, dt)
}
