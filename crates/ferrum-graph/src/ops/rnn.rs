//! Recurrent layers: RNN, GRU, LSTM (forward, reverse, bidirectional; layouts 0 and 1;
//! sequence lengths; peepholes; clip).

use crate::ops::elementwise::cast;
use crate::ops::Kernel;
use crate::ops::{unsupported, Ctx};
use crate::tensor::{Tensor, Value};
use crate::{kbail, Result};

#[derive(Clone, Copy, PartialEq)]
enum Cell {
    Rnn,
    Gru,
    Lstm,
}

type Act = Box<dyn Fn(f64) -> f64>;

fn activation(name: &str, alpha: Option<f64>, beta: Option<f64>) -> Result<Act> {
    Ok(match name.to_ascii_lowercase().as_str() {
        "sigmoid" => Box::new(|x: f64| 1.0 / (1.0 + (-x).exp())),
        "tanh" => Box::new(f64::tanh),
        "relu" => Box::new(|x: f64| x.max(0.0)),
        "leakyrelu" => {
            let a = alpha.unwrap_or(0.01);
            Box::new(move |x: f64| if x >= 0.0 { x } else { a * x })
        }
        "hardsigmoid" => {
            let (a, b) = (alpha.unwrap_or(0.2), beta.unwrap_or(0.5));
            Box::new(move |x: f64| (a * x + b).clamp(0.0, 1.0))
        }
        "affine" => {
            let (a, b) = (alpha.unwrap_or(1.0), beta.unwrap_or(0.0));
            Box::new(move |x: f64| a * x + b)
        }
        "scaledtanh" => {
            let (a, b) = (alpha.unwrap_or(1.0), beta.unwrap_or(1.0));
            Box::new(move |x: f64| a * (b * x).tanh())
        }
        "thresholdedrelu" => {
            let a = alpha.unwrap_or(1.0);
            Box::new(move |x: f64| if x > a { x } else { 0.0 })
        }
        "elu" => {
            let a = alpha.unwrap_or(1.0);
            Box::new(move |x: f64| if x >= 0.0 { x } else { a * (x.exp() - 1.0) })
        }
        "softsign" => Box::new(|x: f64| x / (1.0 + x.abs())),
        "softplus" => Box::new(|x: f64| x.exp().ln_1p()),
        a => return Err(unsupported(format!("activation '{a}'"))),
    })
}

/// `out[j] = Σ_k m[row0 + j][k] · v[k]` for `n` rows of a row-major matrix with `cols` columns.
fn matvec(m: &[f64], row0: usize, n: usize, cols: usize, v: &[f64], out: &mut [f64]) {
    for j in 0..n {
        let r = &m[(row0 + j) * cols..][..cols];
        out[j] = r.iter().zip(v).map(|(a, b)| a * b).sum();
    }
}

fn recurrent(cx: &Ctx, cell: Cell) -> Result<Vec<Value>> {
    let x = cx.t(0)?;
    let (w, r) = (cx.t(1)?, cx.t(2)?);
    let layout = cx.ai("layout", 0);
    let hidden = cx.ai("hidden_size", 0) as usize;
    let dir = cx.astr("direction", "forward");
    let nd = if dir == "bidirectional" { 2 } else { 1 };
    let gates = match cell {
        Cell::Rnn => 1,
        Cell::Gru => 3,
        Cell::Lstm => 4,
    };
    if x.rank() != 3 {
        kbail!("X must be 3-D");
    }
    let (seq, batch, input) = if layout == 0 {
        (x.shape()[0], x.shape()[1], x.shape()[2])
    } else {
        (x.shape()[1], x.shape()[0], x.shape()[2])
    };
    let hidden = if hidden == 0 {
        w.shape()[1] / gates
    } else {
        hidden
    };
    if w.shape() != [nd, gates * hidden, input] || r.shape() != [nd, gates * hidden, hidden] {
        kbail!(
            "W {:?} or R {:?} do not match {nd} directions, {gates} gates, hidden {hidden}",
            w.shape(),
            r.shape()
        );
    }
    let xv = x.to_f64_vec()?;
    let at_x = |t: usize, b: usize| -> &[f64] {
        let o = if layout == 0 {
            (t * batch + b) * input
        } else {
            (b * seq + t) * input
        };
        &xv[o..o + input]
    };
    let wv = w.to_f64_vec()?;
    let rv = r.to_f64_vec()?;
    let bv = cx.opt(3).map(|t| t.to_f64_vec()).transpose()?;
    let lens: Vec<usize> = match cx.opt(4) {
        Some(t) => t
            .to_i64_vec()?
            .iter()
            .map(|&l| (l.max(0) as usize).min(seq))
            .collect(),
        None => vec![seq; batch],
    };
    let h_init = |i: usize| cx.opt(i).map(|t| t.to_f64_vec()).transpose();
    let h0 = h_init(5)?;
    let c0 = if cell == Cell::Lstm { h_init(6)? } else { None };
    let peep = if cell == Cell::Lstm {
        cx.opt(7).map(|t| t.to_f64_vec()).transpose()?
    } else {
        None
    };
    let clip = cx.attr("clip").map(|_| cx.af("clip", 0.0) as f64);
    let lbr = cx.ai("linear_before_reset", 0) != 0;
    let names: Vec<String> = match cx.attr("activations") {
        Some(crate::ir::Attr::Strings(s)) => s
            .iter()
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .collect(),
        _ => vec![],
    };
    let alphas = cx.afloats_vec("activation_alpha").unwrap_or_default();
    let betas = cx.afloats_vec("activation_beta").unwrap_or_default();
    let per_dir = match cell {
        Cell::Rnn => 1,
        Cell::Gru => 2,
        Cell::Lstm => 3,
    };
    let defaults: &[&str] = match cell {
        Cell::Rnn => &["Tanh"],
        Cell::Gru => &["Sigmoid", "Tanh"],
        Cell::Lstm => &["Sigmoid", "Tanh", "Tanh"],
    };
    let mut acts: Vec<Act> = Vec::new();
    for d in 0..nd {
        for (k, default) in defaults.iter().enumerate() {
            let i = d * per_dir + k;
            let name = names.get(i).map(String::as_str).unwrap_or(default);
            acts.push(activation(
                name,
                alphas.get(i).copied(),
                betas.get(i).copied(),
            )?);
        }
    }
    let gh = gates * hidden;
    let mut y = vec![0f64; seq * nd * batch * hidden];
    let mut yh = vec![0f64; nd * batch * hidden];
    let mut yc = vec![0f64; nd * batch * hidden];
    let cl = |v: f64| clip.map_or(v, |c| v.clamp(-c, c));
    let mut xw = vec![0f64; gh];
    let mut hr = vec![0f64; gh];
    for d in 0..nd {
        let reverse = dir == "reverse" || d == 1;
        let wd = &wv[d * gh * input..][..gh * input];
        let rd = &rv[d * gh * hidden..][..gh * hidden];
        let (wb, rb): (Vec<f64>, Vec<f64>) = match &bv {
            Some(b) => (
                b[d * 2 * gh..][..gh].to_vec(),
                b[d * 2 * gh + gh..][..gh].to_vec(),
            ),
            None => (vec![0.0; gh], vec![0.0; gh]),
        };
        let f = &acts[d * per_dir];
        for b in 0..batch {
            let mut h: Vec<f64> = h0.as_ref().map_or(vec![0.0; hidden], |v| {
                v[(d * batch + b) * hidden..][..hidden].to_vec()
            });
            let mut c: Vec<f64> = c0.as_ref().map_or(vec![0.0; hidden], |v| {
                v[(d * batch + b) * hidden..][..hidden].to_vec()
            });
            let len = lens[b];
            for step in 0..len {
                let t = if reverse { len - 1 - step } else { step };
                matvec(wd, 0, gh, input, at_x(t, b), &mut xw);
                matvec(rd, 0, gh, hidden, &h, &mut hr);
                match cell {
                    Cell::Rnn => {
                        for j in 0..hidden {
                            h[j] = f(cl(xw[j] + hr[j] + wb[j] + rb[j]));
                        }
                    }
                    Cell::Gru => {
                        let g = &acts[d * per_dir + 1];
                        let mut hn = vec![0f64; hidden];
                        let z: Vec<f64> = (0..hidden)
                            .map(|j| f(cl(xw[j] + hr[j] + wb[j] + rb[j])))
                            .collect();
                        let rg: Vec<f64> = (0..hidden)
                            .map(|j| {
                                f(cl(xw[hidden + j]
                                    + hr[hidden + j]
                                    + wb[hidden + j]
                                    + rb[hidden + j]))
                            })
                            .collect();
                        if lbr {
                            for j in 0..hidden {
                                let k = 2 * hidden + j;
                                hn[j] = g(cl(xw[k] + rg[j] * (hr[k] + rb[k]) + wb[k]));
                            }
                        } else {
                            let rh: Vec<f64> = (0..hidden).map(|j| rg[j] * h[j]).collect();
                            let mut tmp = vec![0f64; hidden];
                            matvec(rd, 2 * hidden, hidden, hidden, &rh, &mut tmp);
                            for j in 0..hidden {
                                let k = 2 * hidden + j;
                                hn[j] = g(cl(xw[k] + tmp[j] + rb[k] + wb[k]));
                            }
                        }
                        for j in 0..hidden {
                            h[j] = (1.0 - z[j]) * hn[j] + z[j] * h[j];
                        }
                    }
                    Cell::Lstm => {
                        let (g, hact) = (&acts[d * per_dir + 1], &acts[d * per_dir + 2]);
                        let p = |k: usize, j: usize| {
                            peep.as_ref()
                                .map_or(0.0, |p| p[d * 3 * hidden + k * hidden + j])
                        };
                        for j in 0..hidden {
                            let pre = |k: usize| {
                                xw[k * hidden + j]
                                    + hr[k * hidden + j]
                                    + wb[k * hidden + j]
                                    + rb[k * hidden + j]
                            };
                            let i_g = f(cl(pre(0) + p(0, j) * c[j]));
                            let f_g = f(cl(pre(2) + p(2, j) * c[j]));
                            let c_g = g(cl(pre(3)));
                            c[j] = f_g * c[j] + i_g * c_g;
                            let o_g = f(cl(pre(1) + p(1, j) * c[j]));
                            h[j] = o_g * hact(c[j]);
                        }
                    }
                }
                let o = if layout == 0 {
                    ((t * nd + d) * batch + b) * hidden
                } else {
                    ((b * seq + t) * nd + d) * hidden
                };
                y[o..o + hidden].copy_from_slice(&h);
            }
            let o = if layout == 0 {
                (d * batch + b) * hidden
            } else {
                (b * nd + d) * hidden
            };
            yh[o..o + hidden].copy_from_slice(&h);
            yc[o..o + hidden].copy_from_slice(&c);
        }
    }
    let dt = x.dtype();
    let (ys, hs) = if layout == 0 {
        (vec![seq, nd, batch, hidden], vec![nd, batch, hidden])
    } else {
        (vec![batch, seq, nd, hidden], vec![batch, nd, hidden])
    };
    let mut out = vec![
        Value::Tensor(cast(&Tensor::from_vec(ys, y)?, dt)?),
        Value::Tensor(cast(&Tensor::from_vec(hs.clone(), yh)?, dt)?),
    ];
    if cell == Cell::Lstm {
        out.push(Value::Tensor(cast(&Tensor::from_vec(hs, yc)?, dt)?));
    }
    Ok(out)
}

pub fn kernel(op: &str) -> Option<Kernel> {
    let k: Kernel = match op {
        "RNN" => |cx| recurrent(cx, Cell::Rnn),
        "GRU" => |cx| recurrent(cx, Cell::Gru),
        "LSTM" => |cx| recurrent(cx, Cell::Lstm),
        _ => return None,
    };
    Some(k)
}
