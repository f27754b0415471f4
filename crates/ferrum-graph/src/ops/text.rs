//! String ops: StringNormalizer, StringSplit, StringConcat.

use crate::ops::elementwise::zip_with;
use crate::ops::{unsupported, Ctx};
use crate::tensor::{Tensor, Value};
use crate::{kbail, Result};

fn normalizer(cx: &Ctx) -> Result<Tensor> {
    let x = cx.t(0)?;
    let v = x.as_slice::<String>()?;
    let action = cx.astr("case_change_action", "NONE");
    let sensitive = cx.ai("is_case_sensitive", 0) != 0;
    let raw_stops: Vec<String> = match cx.attr("stopwords") {
        Some(crate::ir::Attr::Strings(s)) => s
            .iter()
            .map(|b| String::from_utf8_lossy(b).into_owned())
            .collect(),
        _ => vec![],
    };
    let case = |s: &str| match action.as_str() {
        "LOWER" => s.to_lowercase(),
        "UPPER" => s.to_uppercase(),
        _ => s.to_string(),
    };
    let stops: Vec<String> = raw_stops.iter().map(|s| case(s)).collect();
    let drop = |s: &str, stops: &[String]| -> String {
        s.split(' ')
            .filter(|w| !stops.iter().any(|x| x == w))
            .collect::<Vec<_>>()
            .join(" ")
    };
    if !matches!(action.as_str(), "LOWER" | "UPPER" | "NONE") {
        return Err(unsupported(format!("case_change_action '{action}'")));
    }
    let out: Vec<String> = v
        .iter()
        .map(|s| {
            let mut s = s.clone();
            if sensitive && !raw_stops.is_empty() {
                s = drop(&s, &raw_stops);
            }
            s = case(&s);
            if !sensitive && !stops.is_empty() {
                s = drop(&s, &stops);
            }
            s
        })
        .collect();
    let squeeze = x.rank() == 1 || (x.rank() == 2 && x.shape()[0] == 1);
    if !squeeze {
        if x.rank() != 2 {
            kbail!("StringNormalizer expects a 1-D or 2-D input");
        }
        return Tensor::from_vec(x.shape().to_vec(), out);
    }
    let mut kept: Vec<String> = out.into_iter().filter(|s| !s.is_empty()).collect();
    if kept.is_empty() {
        kept.push(String::new());
    }
    let n = kept.len();
    Tensor::from_vec(if x.rank() == 1 { vec![n] } else { vec![1, n] }, kept)
}

/// Python's `str.split(sep, maxsplit)`.
fn py_split(s: &str, sep: Option<&str>, maxsplit: Option<usize>) -> Vec<String> {
    let max = maxsplit.unwrap_or(usize::MAX);
    match sep {
        Some(sep) => {
            let mut parts = Vec::new();
            let mut rest = s;
            while parts.len() < max {
                match rest.find(sep) {
                    Some(i) => {
                        parts.push(rest[..i].to_string());
                        rest = &rest[i + sep.len()..];
                    }
                    None => break,
                }
            }
            parts.push(rest.to_string());
            parts
        }
        None => {
            let mut parts = Vec::new();
            let mut rest = s.trim_start();
            while !rest.is_empty() {
                if parts.len() == max {
                    parts.push(rest.trim_end().to_string());
                    break;
                }
                let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
                parts.push(rest[..end].to_string());
                rest = rest[end..].trim_start();
            }
            parts
        }
    }
}

fn split(cx: &Ctx) -> Result<Vec<Value>> {
    let x = cx.t(0)?;
    let delim = cx.astr("delimiter", "");
    let sep = if delim.is_empty() {
        None
    } else {
        Some(delim.as_str())
    };
    let maxsplit = cx
        .attr("maxsplit")
        .map(|_| cx.ai("maxsplit", 0).max(0) as usize);
    let parts: Vec<Vec<String>> = x
        .as_slice::<String>()?
        .iter()
        .map(|s| py_split(s, sep, maxsplit))
        .collect();
    let width = parts.iter().map(Vec::len).max().unwrap_or(0);
    let counts: Vec<i64> = parts.iter().map(|p| p.len() as i64).collect();
    let mut flat = Vec::with_capacity(parts.len() * width);
    for mut p in parts {
        p.resize(width, String::new());
        flat.extend(p);
    }
    let mut shape = x.shape().to_vec();
    shape.push(width);
    Ok(vec![
        Value::Tensor(Tensor::from_vec(shape, flat)?),
        Value::Tensor(Tensor::from_vec(x.shape().to_vec(), counts)?),
    ])
}

fn concat(cx: &Ctx) -> Result<Tensor> {
    let (a, b) = (cx.t(0)?, cx.t(1)?);
    let (shape, v) = zip_with(
        a.as_slice::<String>()?,
        a.shape(),
        b.as_slice::<String>()?,
        b.shape(),
        |p, q| Ok(p + &q),
    )?;
    Tensor::from_vec(shape, v)
}

/// String ops; `None` when `cx`'s op is not one of them.
pub fn run(cx: &Ctx) -> Result<Option<Vec<Value>>> {
    let one = |t: Tensor| Ok(Some(vec![Value::Tensor(t)]));
    match cx.node.op.as_str() {
        "StringNormalizer" => one(normalizer(cx)?),
        "StringSplit" => split(cx).map(Some),
        "StringConcat" => one(concat(cx)?),
        _ => Ok(None),
    }
}
