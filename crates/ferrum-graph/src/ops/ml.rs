//! A few `ai.onnx.ml` ops: LabelEncoder, Binarizer, ArrayFeatureExtractor, TreeEnsemble.

use crate::ir::Attr;
use crate::ops::elementwise::cast;
use crate::ops::shape::take;
use crate::ops::{one, unsupported, Ctx, Kernel};
use crate::tensor::{DType, Data, Tensor};
use crate::{kbail, Result};

/// A key or value of LabelEncoder, compared across types by its text form.
#[derive(Clone, PartialEq)]
enum Key {
    F(f64),
    I(i64),
    S(String),
}

fn attr_list(cx: &Ctx, prefix: &str) -> Result<Option<(Vec<Key>, DType)>> {
    let s = |n: &str| format!("{prefix}_{n}");
    if let Some(Attr::Floats(v)) = cx.attr(&s("floats")) {
        return Ok(Some((
            v.iter().map(|&x| Key::F(x as f64)).collect(),
            DType::F32,
        )));
    }
    if let Some(Attr::Ints(v)) = cx.attr(&s("int64s")) {
        return Ok(Some((v.iter().map(|&x| Key::I(x)).collect(), DType::I64)));
    }
    if let Some(Attr::Strings(v)) = cx.attr(&s("strings")) {
        return Ok(Some((
            v.iter()
                .map(|b| Key::S(String::from_utf8_lossy(b).into_owned()))
                .collect(),
            DType::Str,
        )));
    }
    if let Some(Attr::Tensor(t)) = cx.attr(&s("tensor")) {
        return Ok(Some((keys_of(t)?, t.dtype())));
    }
    Ok(None)
}

fn keys_of(t: &Tensor) -> Result<Vec<Key>> {
    Ok(match t.data() {
        Data::Str(v) => v.iter().cloned().map(Key::S).collect(),
        _ if t.dtype().is_float() => t.to_f64_vec()?.into_iter().map(Key::F).collect(),
        _ => t.to_i64_vec()?.into_iter().map(Key::I).collect(),
    })
}

fn tensor_of(keys: Vec<Key>, shape: Vec<usize>, dt: DType) -> Result<Tensor> {
    match dt {
        DType::Str => Tensor::from_vec(
            shape,
            keys.into_iter()
                .map(|k| if let Key::S(s) = k { s } else { String::new() })
                .collect(),
        ),
        dt if dt.is_float() => cast(
            &Tensor::from_vec(
                shape,
                keys.into_iter()
                    .map(|k| if let Key::F(f) = k { f } else { 0.0 })
                    .collect(),
            )?,
            dt,
        ),
        dt => cast(
            &Tensor::from_vec(
                shape,
                keys.into_iter()
                    .map(|k| if let Key::I(i) = k { i } else { 0 })
                    .collect(),
            )?,
            dt,
        ),
    }
}

fn label_encoder(cx: &Ctx) -> Result<Tensor> {
    let x = cx.t(0)?;
    let (keys, _) =
        attr_list(cx, "keys")?.ok_or_else(|| crate::kerr!("LabelEncoder without keys"))?;
    let (vals, vt) =
        attr_list(cx, "values")?.ok_or_else(|| crate::kerr!("LabelEncoder without values"))?;
    if keys.len() != vals.len() {
        kbail!("{} keys for {} values", keys.len(), vals.len());
    }
    let default = match cx.attr("default_tensor") {
        Some(Attr::Tensor(t)) => keys_of(t)?.into_iter().next().unwrap_or(Key::I(-1)),
        _ => match vt {
            DType::Str => Key::S(cx.astr("default_string", "_Unused")),
            dt if dt.is_float() => Key::F(cx.af("default_float", -0.0) as f64),
            _ => Key::I(cx.ai("default_int64", -1)),
        },
    };
    let out: Vec<Key> = keys_of(x)?
        .into_iter()
        .map(|k| {
            keys.iter()
                .position(|c| *c == k)
                .map_or(default.clone(), |p| vals[p].clone())
        })
        .collect();
    tensor_of(out, x.shape().to_vec(), vt)
}

/// The kernel of an `ai.onnx.ml` op.
pub fn kernel(op: &str) -> Option<Kernel> {
    let k: Kernel = match op {
        "LabelEncoder" => |cx| one(label_encoder(cx)?),
        "TreeEnsemble" => |cx| one(tree_ensemble(cx)?),
        "Binarizer" => |cx| {
            let x = cx.t(0)?;
            let th = cx.af("threshold", 0.0) as f64;
            let v: Vec<f64> = x
                .to_f64_vec()?
                .iter()
                .map(|&e| (e > th) as u8 as f64)
                .collect();
            one(cast(&Tensor::from_vec(x.shape().to_vec(), v)?, x.dtype())?)
        },
        "ArrayFeatureExtractor" => |cx| {
            let x = cx.t(0)?;
            let idx = cx.t(1)?.to_i64_vec()?;
            let n = *x.shape().last().unwrap_or(&1);
            let outer = x.len() / n.max(1);
            let mut offs = Vec::with_capacity(outer * idx.len());
            for o in 0..outer {
                for &i in &idx {
                    if i < 0 || i as usize >= n {
                        kbail!("index {i} out of range for {n}");
                    }
                    offs.push(o * n + i as usize);
                }
            }
            let mut shape = if x.rank() <= 1 {
                vec![1]
            } else {
                x.shape()[..x.rank() - 1].to_vec()
            };
            shape.push(idx.len());
            one(take(x, &offs, shape)?)
        },
        _ => return None,
    };
    Some(k)
}

/// TreeEnsemble (ai.onnx.ml 5): every tree maps a row to a (target, weight) leaf; leaves are
/// aggregated per target.
fn tree_ensemble(cx: &Ctx) -> Result<Tensor> {
    let x = cx.t(0)?;
    if x.rank() != 2 {
        kbail!("X must be [N, F]");
    }
    let (rows, feats) = (x.shape()[0], x.shape()[1]);
    let xv = x.to_f64_vec()?;
    let tensor = |n: &str| -> Result<Vec<f64>> {
        match cx.attr(n) {
            Some(Attr::Tensor(t)) => t.to_f64_vec(),
            _ => kbail!("attribute {n} is required"),
        }
    };
    let ints = |n: &str| cx.aints(n).unwrap_or_default();
    let splits = tensor("nodes_splits")?;
    let modes = tensor("nodes_modes")?;
    let feat = ints("nodes_featureids");
    let (tid, fid) = (ints("nodes_truenodeids"), ints("nodes_falsenodeids"));
    let (tleaf, fleaf) = (ints("nodes_trueleafs"), ints("nodes_falseleafs"));
    let missing = ints("nodes_missing_value_tracks_true");
    let leaf_t = ints("leaf_targetids");
    let leaf_w = tensor("leaf_weights")?;
    let roots = ints("tree_roots");
    let members = match cx.attr("membership_values") {
        Some(Attr::Tensor(t)) => t.to_f64_vec()?,
        _ => vec![],
    };
    let n_targets = cx.ai("n_targets", 1).max(1) as usize;
    let agg = cx.ai("aggregate_function", 1);
    let nn = splits.len();
    if [
        modes.len(),
        feat.len(),
        tid.len(),
        fid.len(),
        tleaf.len(),
        fleaf.len(),
    ]
    .iter()
    .any(|&l| l != nn)
        || leaf_t.len() != leaf_w.len()
    {
        kbail!("node or leaf attributes differ in length");
    }
    // Sets of MEMBER nodes, taken from membership_values in the order nodes are first reached
    // (depth-first, true branch first), as the reference builds them.
    let mut sets: Vec<Vec<f64>> = vec![Vec::new(); nn];
    let mut it = members.iter();
    let mut stack: Vec<usize> = roots.iter().rev().map(|&r| r as usize).collect();
    let mut seen = vec![false; nn];
    while let Some(i) = stack.pop() {
        if i >= nn || seen[i] {
            continue;
        }
        seen[i] = true;
        if modes[i] as i64 == 6 {
            for &v in it.by_ref() {
                if v.is_nan() {
                    break;
                }
                sets[i].push(v);
            }
        }
        if fleaf[i] == 0 {
            stack.push(fid[i] as usize);
        }
        if tleaf[i] == 0 {
            stack.push(tid[i] as usize);
        }
    }
    let init = match agg {
        2 => f64::MAX,
        3 => f64::MIN,
        _ => 0.0,
    };
    let mut out = vec![init; rows * n_targets];
    for r in 0..rows {
        let row = &xv[r * feats..(r + 1) * feats];
        for &root in &roots {
            let mut i = root as usize;
            let leaf = loop {
                if i >= nn {
                    kbail!("node index {i} out of range");
                }
                if tleaf[i] != 0 && fleaf[i] != 0 && tid[i] == fid[i] {
                    break tid[i] as usize;
                }
                let f = feat[i] as usize;
                let v = *row
                    .get(f)
                    .ok_or_else(|| crate::kerr!("feature {f} out of range"))?;
                let s = splits[i];
                let go_true = (missing.get(i).copied().unwrap_or(0) != 0 && v.is_nan())
                    || match modes[i] as i64 {
                        0 => v <= s,
                        1 => v < s,
                        2 => v >= s,
                        3 => v > s,
                        4 => v == s,
                        5 => v != s,
                        6 => sets[i].contains(&v),
                        m => return Err(unsupported(format!("node mode {m}"))),
                    };
                let (next, is_leaf) = if go_true {
                    (tid[i], tleaf[i])
                } else {
                    (fid[i], fleaf[i])
                };
                if is_leaf != 0 {
                    break next as usize;
                }
                i = next as usize;
            };
            let t = *leaf_t
                .get(leaf)
                .ok_or_else(|| crate::kerr!("leaf {leaf} out of range"))?
                as usize;
            if t >= n_targets {
                kbail!("target {t} out of range");
            }
            let o = &mut out[r * n_targets + t];
            let w = leaf_w[leaf];
            match agg {
                0 => *o += w / roots.len() as f64,
                2 => *o = o.min(w),
                3 => *o = o.max(w),
                _ => *o += w,
            }
        }
    }
    cast(&Tensor::from_vec(vec![rows, n_targets], out)?, x.dtype())
}
