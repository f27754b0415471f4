//! Signal ops: DFT (forward, inverse, one-sided) and STFT, as direct O(N²) sums in f64.

use crate::ops::elementwise::cast;
use crate::ops::{axis, Ctx};
use crate::ops::{one, Kernel};
use crate::tensor::Tensor;
use crate::{kbail, Result};

/// DFT of `n_in` complex samples zero-padded or cut to `n`; returns `n` bins (or `n/2+1`).
fn dft_line(
    re: &[f64],
    im: &[f64],
    n: usize,
    inverse: bool,
    onesided: bool,
) -> (Vec<f64>, Vec<f64>) {
    let bins = if onesided && !inverse { n / 2 + 1 } else { n };
    let sign = if inverse { 1.0 } else { -1.0 };
    let m = re.len().min(n);
    let mut or = vec![0f64; bins];
    let mut oi = vec![0f64; bins];
    for k in 0..bins {
        let (mut sr, mut si) = (0.0, 0.0);
        for t in 0..m {
            let ang = sign * 2.0 * std::f64::consts::PI * ((k * t) % n) as f64 / n as f64;
            let (s, c) = ang.sin_cos();
            sr += re[t] * c - im[t] * s;
            si += re[t] * s + im[t] * c;
        }
        if inverse {
            sr /= n as f64;
            si /= n as f64;
        }
        or[k] = sr;
        oi[k] = si;
    }
    (or, oi)
}

fn dft(cx: &Ctx) -> Result<Tensor> {
    let x = cx.t(0)?;
    let r = x.rank();
    if r < 2 {
        kbail!("DFT input needs a trailing complex dim");
    }
    let cdim = x.shape()[r - 1];
    let a = if cx.opset() >= 20 {
        let ax = cx.opt(2).map(|t| t.scalar_i64()).transpose()?.unwrap_or(-2);
        axis(ax, r)?
    } else {
        axis(cx.ai("axis", 1), r)?
    };
    if a == r - 1 {
        kbail!("DFT axis cannot be the complex dim");
    }
    let inverse = cx.ai("inverse", 0) != 0;
    let onesided = cx.ai("onesided", 0) != 0;
    let len = x.shape()[a];
    let n = match cx.opt(1).filter(|t| !t.is_empty()) {
        Some(t) => t.scalar_i64()?.max(1) as usize,
        None if inverse && onesided => 2 * (len - 1),
        None => len,
    };
    let v = x.to_f64_vec()?;
    let outer: usize = x.shape()[..a].iter().product();
    let inner: usize = x.shape()[a + 1..r - 1].iter().product();
    let bins = if inverse && onesided {
        n
    } else if onesided {
        n / 2 + 1
    } else {
        n
    };
    let out_c = if inverse && onesided { 1 } else { 2 };
    let mut out = vec![0f64; outer * bins * inner * out_c];
    for o in 0..outer {
        for i in 0..inner {
            let at = |t: usize, c: usize| v[((o * len + t) * inner + i) * cdim + c];
            let mut re: Vec<f64> = (0..len).map(|t| at(t, 0)).collect();
            let mut im: Vec<f64> = (0..len)
                .map(|t| if cdim == 2 { at(t, 1) } else { 0.0 })
                .collect();
            if inverse && onesided {
                // Rebuild the Hermitian spectrum, then keep the real part.
                re.resize(n, 0.0);
                im.resize(n, 0.0);
                for k in len..n {
                    re[k] = re[n - k];
                    im[k] = -im[n - k];
                }
            }
            let (or, oi) = dft_line(&re, &im, n, inverse, onesided && !inverse);
            for k in 0..bins {
                let base = ((o * bins + k) * inner + i) * out_c;
                out[base] = or[k];
                if out_c == 2 {
                    out[base + 1] = oi[k];
                }
            }
        }
    }
    let mut shape = x.shape().to_vec();
    shape[a] = bins;
    shape[r - 1] = out_c;
    cast(&Tensor::from_vec(shape, out)?, x.dtype())
}

fn stft(cx: &Ctx) -> Result<Tensor> {
    let x = cx.t(0)?;
    if x.rank() != 3 {
        kbail!("STFT signal must be [batch, length, 1 or 2]");
    }
    let (b, l, cdim) = (x.shape()[0], x.shape()[1], x.shape()[2]);
    let hop = cx.t(1)?.scalar_i64()?.max(1) as usize;
    let window = cx.opt(2).map(|t| t.to_f64_vec()).transpose()?;
    let flen = match cx.opt(3) {
        Some(t) => t.scalar_i64()? as usize,
        None => window.as_ref().map_or(0, Vec::len),
    };
    if flen == 0 || flen > l {
        kbail!("bad frame length {flen}");
    }
    let win = window.unwrap_or(vec![1.0; flen]);
    let onesided = cx.ai("onesided", 1) != 0;
    let frames = 1 + (l - flen) / hop;
    let bins = if onesided { flen / 2 + 1 } else { flen };
    let v = x.to_f64_vec()?;
    let mut out = Vec::with_capacity(b * frames * bins * 2);
    for bi in 0..b {
        for f in 0..frames {
            let start = f * hop;
            let re: Vec<f64> = (0..win.len())
                .map(|t| v.get((bi * l + start + t) * cdim).copied().unwrap_or(0.0) * win[t])
                .collect();
            let im: Vec<f64> = (0..win.len())
                .map(|t| {
                    if cdim == 2 {
                        v.get((bi * l + start + t) * cdim + 1)
                            .copied()
                            .unwrap_or(0.0)
                            * win[t]
                    } else {
                        0.0
                    }
                })
                .collect();
            let (or, oi) = dft_line(&re, &im, flen, false, onesided);
            for k in 0..bins {
                out.push(or[k]);
                out.push(oi[k]);
            }
        }
    }
    cast(&Tensor::from_vec(vec![b, frames, bins, 2], out)?, x.dtype())
}

pub fn kernel(op: &str) -> Option<Kernel> {
    let k: Kernel = match op {
        "DFT" => |cx| one(dft(cx)?),
        "STFT" => |cx| one(stft(cx)?),
        _ => return None,
    };
    Some(k)
}
