//! String ops: StringNormalizer, StringSplit, StringConcat.

use crate::ops::elementwise::zip_with;
use crate::ops::{one, Kernel};
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
pub fn kernel(op: &str) -> Option<Kernel> {
    let k: Kernel = match op {
        "StringNormalizer" => |cx| one(normalizer(cx)?),
        "StringSplit" => split,
        "StringConcat" => |cx| one(concat(cx)?),
        "TfIdfVectorizer" => |cx| one(tfidf(cx)?),
        "RegexFullMatch" => |cx| {
            let x = cx.t(0)?;
            let pat = cx.astr("pattern", "");
            let re = regex::Regex::new(&format!("^(?:{pat})$"))
                .map_err(|e| unsupported(format!("pattern '{pat}': {e}")))?;
            let v: Vec<bool> = x
                .as_slice::<String>()?
                .iter()
                .map(|s| re.is_match(s))
                .collect();
            one(Tensor::from_vec(x.shape().to_vec(), v)?)
        },
        _ => return None,
    };
    Some(k)
}

/// TfIdfVectorizer: counts the pool's n-grams (with skips) in each row, then weighs them.
fn tfidf(cx: &Ctx) -> Result<Tensor> {
    use std::collections::HashMap;
    let x = cx.t(0)?;
    let key = |s: String| s;
    let xs: Vec<String> = match x.data() {
        crate::tensor::Data::Str(v) => v.clone(),
        _ => x.to_i64_vec()?.iter().map(|i| i.to_string()).collect(),
    };
    let pool: Vec<String> = match (cx.aints("pool_int64s"), cx.attr("pool_strings")) {
        (Some(p), _) => p.iter().map(|i| i.to_string()).collect(),
        (None, Some(crate::ir::Attr::Strings(s))) => s
            .iter()
            .map(|b| key(String::from_utf8_lossy(b).into_owned()))
            .collect(),
        _ => kbail!("TfIdfVectorizer needs pool_int64s or pool_strings"),
    };
    let (min_n, max_n) = (
        cx.ai("min_gram_length", 1) as usize,
        cx.ai("max_gram_length", 1) as usize,
    );
    let max_skip = cx.ai("max_skip_count", 0) as usize;
    let counts = cx.aints("ngram_counts").unwrap_or_default();
    let indexes = cx.aints("ngram_indexes").unwrap_or_default();
    let weights = cx.afloats_vec("weights").unwrap_or_default();
    let mode = cx.astr("mode", "TF");
    let out_size = indexes.iter().copied().max().map_or(0, |m| m + 1) as usize;
    // n-gram -> output index, for sizes within [min_n, max_n]
    let mut grams: HashMap<Vec<String>, usize> = HashMap::new();
    let mut id = 0usize;
    for (g, &start) in counts.iter().enumerate() {
        let size = g + 1;
        let end = counts.get(g + 1).map_or(pool.len(), |&e| e as usize);
        let start = start as usize;
        let n = end.saturating_sub(start) / size;
        for k in 0..n {
            if size >= min_n && size <= max_n {
                let out = *indexes
                    .get(id)
                    .ok_or_else(|| crate::kerr!("ngram_indexes too short"))?
                    as usize;
                grams.insert(pool[start + k * size..start + (k + 1) * size].to_vec(), out);
            }
            id += 1;
        }
    }
    let (rows, c, batched) = match x.rank() {
        0 => (1, 1, false),
        1 => (1, x.shape()[0], false),
        2 => (x.shape()[0], x.shape()[1], true),
        _ => kbail!("input must be [C] or [B, C]"),
    };
    let mut freq = vec![0f64; rows * out_size];
    for r in 0..rows {
        let row = &xs[r * c..(r + 1) * c];
        let mut start_n = min_n;
        for skip in 1..=max_skip + 1 {
            for s in 0..c {
                if s + skip * (start_n.max(1) - 1) >= c {
                    break;
                }
                let mut gram = Vec::new();
                let mut i = s;
                while gram.len() < max_n && i < c {
                    gram.push(row[i].clone());
                    if gram.len() >= start_n {
                        if let Some(&o) = grams.get(&gram) {
                            freq[r * out_size + o] += 1.0;
                        }
                    }
                    i += skip;
                }
            }
            if start_n == 1 {
                start_n = 2;
                if start_n > max_n {
                    break;
                }
            }
        }
    }
    let y: Vec<f64> = freq
        .iter()
        .enumerate()
        .map(|(p, &f)| {
            let w = weights.get(p % out_size.max(1)).copied();
            match mode.as_str() {
                "IDF" => {
                    if f > 0.0 {
                        w.unwrap_or(1.0)
                    } else {
                        0.0
                    }
                }
                "TFIDF" => w.map_or(f, |w| w * f),
                _ => f,
            }
        })
        .collect();
    let shape = if batched {
        vec![rows, out_size]
    } else {
        vec![out_size]
    };
    crate::ops::elementwise::cast(&Tensor::from_vec(shape, y)?, crate::tensor::DType::F32)
}
