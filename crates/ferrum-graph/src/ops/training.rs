//! The `ai.onnx.preview.training` optimizers: Adagrad, Adam, Momentum (standard and Nesterov).
//! Each updates one or more (X, G, state...) groups sharing the learning rate R and step T.

use crate::ops::elementwise::cast;
use crate::ops::{Ctx, Kernel};
use crate::tensor::{Tensor, Value};
use crate::{kbail, Result};

/// The kernel of a training op (Adagrad, Adam, Momentum).
pub fn kernel(op: &str) -> Option<Kernel> {
    let k: Kernel = match op {
        "Adagrad" => |cx| optimizer(cx, 3, 0),
        "Adam" => |cx| optimizer(cx, 4, 1),
        "Momentum" => |cx| optimizer(cx, 3, 2),
        _ => return None,
    };
    Some(k)
}

/// One optimizer step: `per` inputs per tensor (X, G and the optimizer's state), `kind` 0
/// Adagrad, 1 Adam, 2 Momentum.
fn optimizer(cx: &Ctx, per: usize, kind: u8) -> Result<Vec<Value>> {
    let r = cx.t(0)?.scalar_f64()?;
    let t = cx.t(1)?.scalar_f64()?;
    let n = (cx.n_in() - 2) / per;
    if n == 0 || 2 + n * per != cx.n_in() {
        kbail!("expected 2 + {per}·n inputs, got {}", cx.n_in());
    }
    let norm = cx.af("norm_coefficient", 0.0) as f64;
    let mut outs: Vec<Vec<Value>> = vec![Vec::new(); per - 1];
    for i in 0..n {
        let x = cx.t(2 + i)?;
        let g = cx.t(2 + n + i)?.to_f64_vec()?;
        let s1 = cx.t(2 + 2 * n + i)?;
        let xv = x.to_f64_vec()?;
        let s1v = s1.to_f64_vec()?;
        let shape = x.shape().to_vec();
        let mut nx = vec![0f64; xv.len()];
        let mut n1 = vec![0f64; xv.len()];
        let mut n2 = vec![0f64; xv.len()];
        match kind {
            0 => {
                let eps = cx.af("epsilon", 1e-6) as f64;
                let decay = cx.af("decay_factor", 0.0) as f64;
                let rr = r / (1.0 + t * decay);
                for k in 0..xv.len() {
                    let gr = norm * xv[k] + g[k];
                    n1[k] = s1v[k] + gr * gr;
                    nx[k] = xv[k] - rr * gr / (n1[k].sqrt() + eps);
                }
            }
            1 => {
                let h = cx.t(2 + 3 * n + i)?.to_f64_vec()?;
                let (alpha, beta) = (cx.af("alpha", 0.9) as f64, cx.af("beta", 0.999) as f64);
                let eps = cx.af("epsilon", 1e-6) as f64;
                let post = cx.af("norm_coefficient_post", 0.0) as f64;
                let ra = if t > 0.0 {
                    r * (1.0 - beta.powf(t)).sqrt() / (1.0 - alpha.powf(t))
                } else {
                    r
                };
                for k in 0..xv.len() {
                    let gr = norm * xv[k] + g[k];
                    n1[k] = alpha * s1v[k] + (1.0 - alpha) * gr;
                    n2[k] = beta * h[k] + (1.0 - beta) * gr * gr;
                    nx[k] = (1.0 - post) * (xv[k] - ra * (n1[k] / (n2[k].sqrt() + eps)));
                }
            }
            _ => {
                let (alpha, beta) = (cx.af("alpha", 0.0) as f64, cx.af("beta", 0.0) as f64);
                let nesterov = cx.astr("mode", "standard") == "nesterov";
                let ba = if t > 0.0 { beta } else { 1.0 };
                for k in 0..xv.len() {
                    let gr = norm * xv[k] + g[k];
                    n1[k] = alpha * s1v[k] + ba * gr;
                    nx[k] = if nesterov {
                        xv[k] - r * (gr + alpha * n1[k])
                    } else {
                        xv[k] - r * n1[k]
                    };
                }
            }
        }
        outs[0].push(Value::Tensor(cast(
            &Tensor::from_vec(shape.clone(), nx)?,
            x.dtype(),
        )?));
        outs[1].push(Value::Tensor(cast(
            &Tensor::from_vec(shape.clone(), n1)?,
            s1.dtype(),
        )?));
        if kind == 1 {
            outs[2].push(Value::Tensor(cast(
                &Tensor::from_vec(shape, n2)?,
                s1.dtype(),
            )?));
        }
    }
    Ok(outs.into_iter().flatten().collect())
}
