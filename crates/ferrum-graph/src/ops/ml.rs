//! A few `ai.onnx.ml` ops: LabelEncoder, Binarizer, ArrayFeatureExtractor.

use crate::ir::Attr;
use crate::ops::elementwise::cast;
use crate::ops::shape::take;
use crate::ops::{unsupported, Ctx};
use crate::tensor::{DType, Data, Tensor, Value};
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

pub fn run(cx: &Ctx) -> Result<Vec<Value>> {
    let x = cx.t(0)?;
    let out = match cx.node.op.as_str() {
        "LabelEncoder" => label_encoder(cx)?,
        "Binarizer" => {
            let th = cx.af("threshold", 0.0) as f64;
            let v: Vec<f64> = x
                .to_f64_vec()?
                .iter()
                .map(|&e| (e > th) as u8 as f64)
                .collect();
            cast(&Tensor::from_vec(x.shape().to_vec(), v)?, x.dtype())?
        }
        "ArrayFeatureExtractor" => {
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
            take(x, &offs, shape)?
        }
        op => return Err(unsupported(format!("ai.onnx.ml.{op} is not implemented"))),
    };
    Ok(vec![Value::Tensor(out)])
}
