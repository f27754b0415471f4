//! Control flow (If, Loop, Scan) and the sequence and optional ops.

use std::sync::Arc;

use crate::exec::run_graph;
use crate::ir::{Attr, Graph};
use crate::ops::shape::{concat_t, narrow, transpose_t};
use crate::ops::Kernel;
use crate::ops::{axis, unsupported, Ctx};
use crate::tensor::{DType, Tensor, Value};
use crate::{kbail, Result};

fn graph_attr<'a>(cx: &Ctx<'a>, name: &str) -> Result<&'a Arc<Graph>> {
    match cx.attr(name) {
        Some(Attr::Graph(g)) => Ok(g),
        _ => kbail!("missing graph attribute '{name}'"),
    }
}

fn if_op(cx: &Ctx) -> Result<Vec<Value>> {
    let c = cx.t(0)?;
    let cond = c.to_f64_vec()?.first().copied().unwrap_or(0.0) != 0.0;
    let g = graph_attr(cx, if cond { "then_branch" } else { "else_branch" })?;
    run_graph(g, vec![], Some(cx.env))
}

/// Stacks per-iteration tensors on a new axis `a` (0 iterations: an empty f32 tensor).
fn stack(parts: &[Tensor], a: usize) -> Result<Tensor> {
    if parts.is_empty() {
        return Tensor::zeros(DType::F32, vec![0]);
    }
    let exp: Vec<Tensor> = parts
        .iter()
        .map(|t| {
            let mut s = t.shape().to_vec();
            s.insert(a.min(s.len()), 1);
            t.clone().reshape(s)
        })
        .collect::<Result<_>>()?;
    let refs: Vec<&Tensor> = exp.iter().collect();
    concat_t(&refs, a as i64)
}

fn loop_op(cx: &Ctx) -> Result<Vec<Value>> {
    let body = graph_attr(cx, "body")?;
    let max = cx.opt(0).map(|t| t.scalar_i64()).transpose()?;
    let mut cond = cx
        .opt(1)
        .map(|t| t.scalar_f64())
        .transpose()?
        .map(|c| c != 0.0);
    let n_carried = cx.n_in().saturating_sub(2);
    let mut carried: Vec<Value> = (0..n_carried)
        .map(|i| {
            cx.value(i + 2)
                .cloned()
                .ok_or_else(|| crate::kerr!("loop-carried input {i} missing"))
        })
        .collect::<Result<_>>()?;
    let n_scan = body.outputs.len().saturating_sub(1 + n_carried);
    let mut scans: Vec<Vec<Tensor>> = vec![Vec::new(); n_scan];
    let mut i: i64 = 0;
    loop {
        if max.is_some_and(|m| i >= m) || cond == Some(false) {
            break;
        }
        if max.is_none() && cond.is_none() {
            kbail!("Loop without trip count or condition would never end");
        }
        if i > 1 << 24 {
            kbail!("Loop ran more than 2^24 iterations");
        }
        let mut ins = vec![
            Some(Value::Tensor(Tensor::scalar(i))),
            Some(Value::Tensor(Tensor::scalar(cond.unwrap_or(true)))),
        ];
        ins.extend(carried.iter().cloned().map(Some));
        let mut outs = run_graph(body, ins, Some(cx.env))?.into_iter();
        let c = outs
            .next()
            .ok_or_else(|| crate::kerr!("loop body has no outputs"))?;
        cond = Some(c.tensor()?.scalar_f64()? != 0.0);
        carried = outs.by_ref().take(n_carried).collect();
        for (k, v) in outs.enumerate() {
            scans[k].push(v.into_tensor()?);
        }
        i += 1;
    }
    let mut res = carried;
    for s in scans {
        res.push(Value::Tensor(stack(&s, 0)?));
    }
    Ok(res)
}

/// Axes and directions of a Scan's scan inputs and outputs.
struct ScanDirs {
    in_axes: Vec<i64>,
    in_dirs: Vec<i64>,
    out_axes: Vec<i64>,
    out_dirs: Vec<i64>,
}

/// One Scan-9 run: iterate `body` over slices of `scans`, threading `state`. Returns the final
/// state followed by the stacked scan outputs.
fn scan_loop(
    cx: &Ctx,
    body: &Graph,
    mut state: Vec<Value>,
    scans: &[&Tensor],
    d: &ScanDirs,
) -> Result<Vec<Value>> {
    let n_state = state.len();
    let k = body.outputs.len().saturating_sub(n_state);
    let axes: Vec<usize> = scans
        .iter()
        .enumerate()
        .map(|(j, t)| axis(d.in_axes.get(j).copied().unwrap_or(0), t.rank()))
        .collect::<Result<_>>()?;
    let len = scans.first().map_or(0, |t| t.shape()[axes[0]]);
    if scans.iter().zip(&axes).any(|(t, &a)| t.shape()[a] != len) {
        kbail!("scan inputs differ in length");
    }
    let mut outs: Vec<Vec<Tensor>> = vec![Vec::new(); k];
    for it in 0..len {
        let mut ins: Vec<Option<Value>> = state.iter().cloned().map(Some).collect();
        for (j, t) in scans.iter().enumerate() {
            let pos = if d.in_dirs.get(j).copied().unwrap_or(0) == 1 {
                len - 1 - it
            } else {
                it
            };
            let s = narrow(t, axes[j], pos, 1)?;
            let mut shape = s.shape().to_vec();
            shape.remove(axes[j]);
            ins.push(Some(Value::Tensor(s.reshape(shape)?)));
        }
        let mut res = run_graph(body, ins, Some(cx.env))?.into_iter();
        state = res.by_ref().take(n_state).collect();
        for (j, v) in res.enumerate() {
            outs[j].push(v.into_tensor()?);
        }
    }
    let mut result = state;
    for (j, mut parts) in outs.into_iter().enumerate() {
        if d.out_dirs.get(j).copied().unwrap_or(0) == 1 {
            parts.reverse();
        }
        let st = stack(&parts, 0)?;
        let r = st.rank();
        let a = axis(d.out_axes.get(j).copied().unwrap_or(0), r)?;
        let t = if a == 0 {
            st
        } else {
            let mut perm: Vec<usize> = (1..r).collect();
            perm.insert(a, 0);
            transpose_t(&st, &perm)?
        };
        result.push(Value::Tensor(t));
    }
    Ok(result)
}

fn scan_op(cx: &Ctx) -> Result<Vec<Value>> {
    let body = graph_attr(cx, "body")?;
    let m = cx.ai("num_scan_inputs", 0) as usize;
    // Scan-8 has a leading (optional) sequence_lens input and a batch dim on everything.
    let first = if cx.opset() < 9 { 1 } else { 0 };
    let n_state = cx
        .n_in()
        .checked_sub(m + first)
        .ok_or_else(|| crate::kerr!("num_scan_inputs too large"))?;
    let k = body.outputs.len().saturating_sub(n_state);
    let state: Vec<Value> = (0..n_state)
        .map(|i| {
            Ok(cx
                .value(first + i)
                .ok_or_else(|| crate::kerr!("state {i} missing"))?
                .clone())
        })
        .collect::<Result<_>>()?;
    let scans: Vec<&Tensor> = (0..m)
        .map(|j| cx.t(first + n_state + j))
        .collect::<Result<_>>()?;
    if cx.opset() >= 9 {
        let d = ScanDirs {
            in_axes: cx.aints("scan_input_axes").unwrap_or(vec![0; m]),
            in_dirs: cx.aints("scan_input_directions").unwrap_or(vec![0; m]),
            out_axes: cx.aints("scan_output_axes").unwrap_or(vec![0; k]),
            out_dirs: cx.aints("scan_output_directions").unwrap_or(vec![0; k]),
        };
        return scan_loop(cx, body, state, &scans, &d);
    }
    if cx.opt(0).is_some() {
        return Err(unsupported("Scan-8 with sequence_lens"));
    }
    let d = ScanDirs {
        in_axes: vec![0; m],
        in_dirs: cx.aints("directions").unwrap_or(vec![0; m]),
        out_axes: vec![0; k],
        out_dirs: vec![0; k],
    };
    let batch = scans
        .first()
        .map_or(1, |t| t.shape().first().copied().unwrap_or(1));
    let row = |t: &Tensor, b: usize| -> Result<Tensor> {
        let s = narrow(t, 0, b, 1)?;
        let shape = s.shape()[1..].to_vec();
        s.reshape(shape)
    };
    let mut per_batch: Vec<Vec<Tensor>> = vec![Vec::new(); n_state + k];
    for b in 0..batch {
        let st: Vec<Value> = state
            .iter()
            .map(|v| Ok(Value::Tensor(row(v.tensor()?, b)?)))
            .collect::<Result<_>>()?;
        let sc: Vec<Tensor> = scans.iter().map(|t| row(t, b)).collect::<Result<_>>()?;
        let refs: Vec<&Tensor> = sc.iter().collect();
        for (j, v) in scan_loop(cx, body, st, &refs, &d)?.into_iter().enumerate() {
            per_batch[j].push(v.into_tensor()?);
        }
    }
    per_batch
        .iter()
        .map(|parts| Ok(Value::Tensor(stack(parts, 0)?)))
        .collect()
}

fn seq<'a>(cx: &Ctx<'a>, i: usize) -> Result<&'a Vec<Tensor>> {
    match cx.value(i) {
        Some(Value::Sequence(s)) => Ok(s),
        Some(Value::Optional(Some(v))) => match v.as_ref() {
            Value::Sequence(s) => Ok(s),
            _ => kbail!("input {i} is not a sequence"),
        },
        _ => kbail!("input {i} is not a sequence"),
    }
}

fn seq_pos(cx: &Ctx, i: usize, len: usize, insert: bool) -> Result<usize> {
    let Some(p) = cx.opt(i) else {
        return Ok(if insert { len } else { len.saturating_sub(1) });
    };
    let p = p.scalar_i64()?;
    let lim = if insert { len as i64 + 1 } else { len as i64 };
    let q = if p < 0 { p + len as i64 } else { p };
    if q < 0 || q >= lim {
        kbail!("position {p} out of range for a sequence of {len}");
    }
    Ok(q as usize)
}

/// Control-flow, sequence and optional ops; `None` when `cx`'s op is not one of them.
pub fn kernel(op: &str) -> Option<Kernel> {
    let k: Kernel = match op {
        "If" => if_op,
        "Loop" => loop_op,
        "Scan" => scan_op,
        "SequenceMap" => |cx| {
            let body = graph_attr(cx, "body")?;
            let n = seq(cx, 0)?.len();
            let mut outs: Vec<Vec<Tensor>> = vec![Vec::new(); body.outputs.len()];
            for i in 0..n {
                let mut ins = Vec::with_capacity(cx.n_in());
                for j in 0..cx.n_in() {
                    ins.push(Some(Value::Tensor(match cx.value(j) {
                        Some(Value::Sequence(s)) => s
                            .get(i)
                            .cloned()
                            .ok_or_else(|| crate::kerr!("sequence {j} is shorter than {n}"))?,
                        Some(v) => v.tensor()?.clone(),
                        None => kbail!("input {j} missing"),
                    })));
                }
                for (k, v) in run_graph(body, ins, Some(cx.env))?.into_iter().enumerate() {
                    outs[k].push(v.into_tensor()?);
                }
            }
            Ok(outs.into_iter().map(Value::Sequence).collect())
        },
        "SequenceEmpty" => |_| value(Value::Sequence(vec![])),
        "SequenceConstruct" => |cx| {
            value(Value::Sequence(
                (0..cx.n_in())
                    .map(|i| cx.t(i).cloned())
                    .collect::<Result<_>>()?,
            ))
        },
        "SequenceLength" => |cx| value(Value::Tensor(Tensor::scalar(seq(cx, 0)?.len() as i64))),
        "SequenceAt" => |cx| {
            let s = seq(cx, 0)?;
            let p = seq_pos(cx, 1, s.len(), false)?;
            value(Value::Tensor(
                s.get(p)
                    .cloned()
                    .ok_or_else(|| crate::kerr!("empty sequence"))?,
            ))
        },
        "SequenceInsert" => |cx| {
            let mut s = seq(cx, 0)?.clone();
            let p = seq_pos(cx, 2, s.len(), true)?;
            s.insert(p, cx.t(1)?.clone());
            value(Value::Sequence(s))
        },
        "SequenceErase" => |cx| {
            let mut s = seq(cx, 0)?.clone();
            let p = seq_pos(cx, 1, s.len(), false)?;
            if p < s.len() {
                s.remove(p);
            }
            value(Value::Sequence(s))
        },
        "ConcatFromSequence" => |cx| {
            let s = seq(cx, 0)?;
            let new_axis = cx.ai("axis", 0);
            if cx.ai("new_axis", 0) != 0 {
                let r = s.first().map_or(0, |t| t.rank()) + 1;
                value(Value::Tensor(stack(s, axis(new_axis, r)?)?))
            } else {
                let refs: Vec<&Tensor> = s.iter().collect();
                value(Value::Tensor(concat_t(&refs, new_axis)?))
            }
        },
        "SplitToSequence" => |cx| {
            let x = cx.t(0)?;
            let a = axis(cx.ai("axis", 0), x.rank())?;
            let d = x.shape()[a];
            let keep = cx.ai("keepdims", 1) != 0;
            let sizes: Vec<usize> = match cx.opt(1) {
                Some(s) if s.rank() == 0 => {
                    let c = s.scalar_i64()?.max(1) as usize;
                    (0..d.div_ceil(c)).map(|i| c.min(d - i * c)).collect()
                }
                Some(s) => s.to_i64_vec()?.iter().map(|&v| v as usize).collect(),
                None => vec![1; d],
            };
            let mut out = Vec::new();
            let mut start = 0;
            let squeeze = cx.opt(1).is_none() && !keep;
            for sz in sizes {
                let t = narrow(x, a, start, sz)?;
                start += sz;
                out.push(if squeeze {
                    let mut s = t.shape().to_vec();
                    s.remove(a);
                    t.reshape(s)?
                } else {
                    t
                });
            }
            value(Value::Sequence(out))
        },
        "Optional" => |cx| value(Value::Optional(cx.value(0).map(|v| Box::new(v.clone())))),
        "OptionalHasElement" => |cx| {
            let has = match cx.value(0) {
                None | Some(Value::Optional(None)) => false,
                Some(_) => true,
            };
            value(Value::Tensor(Tensor::scalar(has)))
        },
        "OptionalGetElement" => |cx| match cx.value(0) {
            Some(Value::Optional(Some(v))) => value((**v).clone()),
            Some(Value::Optional(None)) | None => kbail!("the optional is empty"),
            Some(v) => value(v.clone()),
        },
        _ => return None,
    };
    Some(k)
}

/// A kernel's one output.
fn value(v: Value) -> Result<Vec<Value>> {
    Ok(vec![v])
}
