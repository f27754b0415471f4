//! Every architecture against PyTorch, on tiny random-weight models (tests/models/tiny, made by
//! `scripts/tiny_models/make.py` with Hugging Face `transformers`): each model is loaded twice,
//! from its Hugging Face folder and from the F32 GGUF llama.cpp's converter made of it, and must
//! - tokenize every prompt into PyTorch's ids (the chat prompt as rendered, special tokens parsed);
//! - teacher-forced on PyTorch's greedy continuation (computed in float64), give PyTorch's top-5
//!   tokens probabilities within the default-cache rule: top-1 the same wherever PyTorch's
//!   top-2 gap is >= 0.05, mean |dp| <= 0.01 and worst <= 0.05 (ferrum's KV cache is f16 as
//!   llama.cpp's; the float64 reference has no rounding at all);
//! - give the HF folder and the GGUF file the same logits (within 1e-4: both hold the same F32
//!   values, the converter only renames and permutes them);
//! - with an f32 KV cache (`LoadOptions::kv_type`), give PyTorch's top-5 probabilities within
//!   2e-3 at every position, both formats.
//!
//! Measured (worst |dp| over all prompts, both formats): printed by each test.

mod common;

use std::path::PathBuf;

use ferrum_llm::model::{KvCache, Logits};
use ferrum_llm::{Llm, LoadOptions};
use serde_json::Value;

fn tiny_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/models/tiny")
}

fn load(path: &std::path::Path) -> Llm {
    Llm::load(path, &LoadOptions::default(), &mut |_, _| {})
        .unwrap_or_else(|e| panic!("{} loads: {e}", path.display()))
}

/// With an f32 KV cache nothing is rounded to f16 on the way (the weights are F32 too): every
/// probability of PyTorch's top-5 within 2e-3 of the float64 reference, at every position.
const F32_KV_WORST: f64 = 2e-3;

fn load_f32_kv(path: &std::path::Path) -> Llm {
    let opts = LoadOptions {
        kv_type: ferrum_core::DType::F32,
        ..Default::default()
    };
    Llm::load(path, &opts, &mut |_, _| {})
        .unwrap_or_else(|e| panic!("{} loads: {e}", path.display()))
}

/// [`check`] with an f32 cache and the tight bound.
fn check_f32_kv(path: &std::path::Path, what: &str, reference: &Value) {
    let llm = load_f32_kv(path);
    let (_, worst, _) = check(&llm, &format!("{what}, f32 KV"), reference);
    assert!(
        worst <= F32_KV_WORST,
        "{what}, f32 KV: worst |dp| {worst} > {F32_KV_WORST}"
    );
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn softmax(row: &[f32]) -> Vec<f64> {
    let m = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = row.iter().map(|&l| (l as f64 - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|v| v / s).collect()
}

/// Logits of every position of `tokens` in one prompt pass.
fn all_logits(llm: &Llm, tokens: &[u32]) -> Vec<f32> {
    let mut cache = KvCache::new(&llm.model.config, tokens.len());
    let l = llm
        .model
        .forward(tokens, 0, &mut cache, Logits::From(0))
        .expect("forward");
    l.to_vec()
}

/// Checks one model in one format against the reference; returns (mean, worst) |dp| and the
/// logits of each prompt.
fn check(llm: &Llm, what: &str, reference: &Value) -> (f64, f64, Vec<Vec<f32>>) {
    let nv = llm.model.config.n_vocab;
    let (mut sum, mut n, mut worst) = (0f64, 0usize, 0f64);
    let mut out = Vec::new();
    let mut bad = Vec::new();
    for p in reference["prompts"].as_array().expect("prompts") {
        let text = p["text"].as_str().expect("text");
        let chat = p["chat"].as_bool().unwrap_or(false);
        let want = ids(&p["prompt_ids"]);
        let got = llm.tokenizer.encode(text, !chat, chat);
        assert_eq!(got, want, "{what}: prompt ids of {text:?}");
        let mut tokens = want.clone();
        tokens.extend(ids(&p["greedy_ids"]));
        let logits = all_logits(llm, &tokens);
        let top = p["top"].as_array().expect("top");
        assert_eq!(top.len(), tokens.len(), "{what}: one top-5 per position");
        let mut mismatches = Vec::new();
        for (i, t) in top.iter().enumerate() {
            let probs = softmax(&logits[i * nv..(i + 1) * nv]);
            assert!(probs.iter().all(|v| v.is_finite()), "{what}: non-finite");
            let theirs: Vec<(usize, f64)> = ids(&t["ids"])
                .into_iter()
                .map(|id| id as usize)
                .zip(
                    t["probs"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(|x| x.as_f64().unwrap()),
                )
                .collect();
            let ours = (0..nv).fold(0, |b, j| if probs[j] > probs[b] { j } else { b });
            if theirs[0].1 - theirs[1].1 >= 0.05 && ours != theirs[0].0 {
                mismatches.push((i, ours, theirs[0].0));
            }
            for &(id, pr) in &theirs {
                let d = (probs[id] - pr).abs();
                sum += d;
                n += 1;
                worst = worst.max(d);
            }
        }
        if !mismatches.is_empty() {
            bad.push(format!("{text:?}: {mismatches:?}"));
        }
        out.push(logits);
    }
    let mean = sum / n as f64;
    eprintln!("{what}: mean |dp| {mean:.6}, worst {worst:.6} over {n} probabilities");
    assert!(
        bad.is_empty(),
        "{what}: top-1 differs at clear positions (pos, ours, PyTorch): {bad:?}"
    );
    assert!(mean <= 0.01, "{what}: mean |dp| {mean}");
    assert!(worst <= 0.05, "{what}: worst |dp| {worst}");
    (mean, worst, out)
}

fn reference(name: &str) -> Value {
    let text = std::fs::read_to_string(tiny_dir().join(format!("{name}.json")))
        .unwrap_or_else(|e| panic!("reference of {name}: {e}"));
    serde_json::from_str(&text).expect("reference parses")
}

fn run(name: &str) {
    let dir = tiny_dir();
    let reference = reference(name);
    let hf = load(&dir.join(name));
    let gguf = load(&dir.join(format!("{name}.f32.gguf")));
    assert_eq!(hf.model.config.arch, gguf.model.config.arch);
    assert_eq!(
        hf.model.config.rope_scaling, gguf.model.config.rope_scaling,
        "{name}: RoPE scaling read from config.json and from GGUF"
    );
    assert_eq!(hf.model.config.moe, gguf.model.config.moe);
    let (_, _, a) = check(&hf, &format!("{name} (HF folder)"), &reference);
    let (_, _, b) = check(&gguf, &format!("{name} (GGUF F32)"), &reference);
    let mut worst = 0f32;
    for (x, y) in a.iter().zip(&b) {
        for (u, v) in x.iter().zip(y) {
            worst = worst.max((u - v).abs());
        }
    }
    assert!(
        worst <= 1e-4,
        "{name}: HF and GGUF logits differ by {worst}"
    );
    check_f32_kv(&dir.join(name), &format!("{name} (HF folder)"), &reference);
    check_f32_kv(
        &dir.join(format!("{name}.f32.gguf")),
        &format!("{name} (GGUF F32)"),
        &reference,
    );
}

#[test]
fn llama() {
    run("llama");
}

#[test]
fn llama3_rope_scaling() {
    run("llama3");
}

#[test]
fn llama_linear_rope_scaling() {
    run("llama_linear");
}

#[test]
fn qwen2() {
    run("qwen2");
}

#[test]
fn qwen3() {
    run("qwen3");
}

#[test]
fn qwen3moe() {
    run("qwen3moe");
}

#[test]
fn mixtral() {
    run("mixtral");
}

#[test]
fn gemma3() {
    run("gemma3");
}

#[test]
fn gemma2() {
    run("gemma2");
}

#[test]
fn phi3() {
    run("phi3");
}

/// Mistral's sliding window (8 here, every layer) is honoured from config.json, as transformers
/// does. llama.cpp's converter drops it (the GGUF has no window key and llama.cpp attends to
/// the whole context), and ferrum runs the GGUF as llama.cpp does, so only the folder is
/// compared with PyTorch past the window.
#[test]
fn mistral_sliding_window() {
    let dir = tiny_dir();
    let hf = load(&dir.join("mistral_swa"));
    assert_eq!(hf.model.config.sliding_window, Some(8));
    assert!((0..hf.model.config.n_layer).all(|il| hf.model.config.is_swa_layer(il)));
    check(&hf, "mistral_swa (HF folder)", &reference("mistral_swa"));
    check_f32_kv(
        &dir.join("mistral_swa"),
        "mistral_swa (HF folder)",
        &reference("mistral_swa"),
    );
    let gguf = load(&dir.join("mistral_swa.f32.gguf"));
    assert_eq!(gguf.model.config.sliding_window, None);
}

/// Logits of every position of `tokens`, with a cache sized for `ctx` positions (the context a
/// sequence may reach picks LongRoPE's factor set).
fn logits_ctx(llm: &Llm, tokens: &[u32], ctx: usize) -> Vec<f32> {
    let mut cache = KvCache::new(&llm.model.config, ctx);
    let l = llm
        .model
        .forward(tokens, 0, &mut cache, Logits::From(0))
        .expect("forward");
    l.to_vec()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The tiny Phi-3 model given LongRoPE factors, both ways a user meets them: a Hugging Face
/// folder whose config.json has `rope_type: longrope` with `short_factor`/`long_factor`, and a
/// GGUF file with llama.cpp's `rope_factors_short/long.weight` and `rope.scaling.attn_factor`
/// (as its converter writes them). Returns (HF folder, GGUF path).
fn phi3_longrope(
    name: &str,
    short: &[f32],
    long: &[f32],
    max_pos: usize,
    orig: usize,
) -> (PathBuf, PathBuf) {
    use ferrum_gguf::{GgufFile, GgufWriter, Value as Gv};
    let tmp = std::env::temp_dir().join(format!("ferrum-{name}-{}", std::process::id()));
    let hf = tmp.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    let src = tiny_dir().join("phi3");
    for f in std::fs::read_dir(&src).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, hf.join(f.file_name().unwrap())).unwrap();
    }
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    cfg["max_position_embeddings"] = max_pos.into();
    cfg["original_max_position_embeddings"] = orig.into();
    cfg["rope_parameters"] = serde_json::json!({
        "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 1.0,
        "short_factor": short, "long_factor": long,
    });
    std::fs::write(hf.join("config.json"), cfg.to_string()).unwrap();

    // The converter's attention factor: sqrt(1 + ln(s) / ln(orig)), s = max_pos / orig.
    let s = max_pos as f64 / orig as f64;
    let attn = if s > 1.0 {
        (1.0 + s.ln() / (orig as f64).ln()).sqrt()
    } else {
        1.0
    };
    let f = GgufFile::open(&tiny_dir().join("phi3.f32.gguf")).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in &f.metadata {
        let ours = [
            "phi3.context_length",
            "phi3.rope.scaling.original_context_length",
            "phi3.rope.scaling.attn_factor",
        ];
        if !ours.contains(&k.as_str()) {
            w = w.kv(k.clone(), v.clone());
        }
    }
    w = w
        .kv("phi3.context_length", Gv::U32(max_pos as u32))
        .kv(
            "phi3.rope.scaling.original_context_length",
            Gv::U32(orig as u32),
        )
        .kv("phi3.rope.scaling.attn_factor", Gv::F32(attn as f32));
    for t in &f.tensors {
        w = w.tensor(&t.name, &t.dims, t.dtype, f.tensor_data(t).to_vec());
    }
    let bytes = |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| x.to_le_bytes()).collect() };
    let n = short.len() as u64;
    w = w
        .tensor(
            "rope_factors_short.weight",
            &[n],
            ferrum_core::DType::F32,
            bytes(short),
        )
        .tensor(
            "rope_factors_long.weight",
            &[n],
            ferrum_core::DType::F32,
            bytes(long),
        );
    let gguf = tmp.join("phi3-longrope.gguf");
    w.write(&gguf).unwrap();
    (hf, gguf)
}

/// LongRoPE (Phi-3 128k, Phi-3.5, Phi-4-mini) from both formats: against a float64 reference of
/// Hugging Face's Phi-3 with LongRoPE (`scripts/tiny_models/longrope_reference.py`, itself checked
/// against PyTorch on the plain model), teacher-forced, every top-5 probability within 2e-3 with
/// an f32 cache, with the short set (a context within the original length) and the long set
/// (past it, llama.cpp's rule); the HF folder and the GGUF file give the same logits; uniform
/// factors of 4 with no attention factor are exactly linear scaling by 4.
#[test]
fn phi3_longrope_both_formats() {
    let f32_kv = |p: &std::path::Path| load_f32_kv(p);
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(tiny_dir().join("phi3-longrope.json")).unwrap(),
    )
    .unwrap();
    let floats = |k: &str| -> Vec<f32> {
        reference[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap() as f32)
            .collect()
    };
    let (short, long) = (floats("short_factor"), floats("long_factor"));
    let n = |k: &str| reference[k].as_u64().unwrap() as usize;
    let (max_pos, orig) = (
        n("max_position_embeddings"),
        n("original_max_position_embeddings"),
    );
    let (hf_dir, gguf_path) = phi3_longrope("longrope", &short, &long, max_pos, orig);
    for path in [&hf_dir, &gguf_path] {
        let llm = f32_kv(path);
        for (set, ctx) in [("short", orig), ("long", 4 * orig)] {
            let mut worst = 0f64;
            for p in reference["prompts"].as_array().unwrap() {
                let tokens = ids(&p["ids"]);
                let logits = logits_ctx(&llm, &tokens, ctx);
                let v = llm.model.config.n_vocab;
                for (pos, top) in p[set].as_array().unwrap().iter().enumerate() {
                    let probs = softmax(&logits[pos * v..(pos + 1) * v]);
                    for (id, want) in ids(&top["ids"])
                        .iter()
                        .zip(top["probs"].as_array().unwrap())
                    {
                        let d = (probs[*id as usize] - want.as_f64().unwrap()).abs();
                        worst = worst.max(d);
                    }
                }
            }
            println!(
                "LongRoPE {set} set, {}: worst |dp| {worst:.2e}",
                path.display()
            );
            assert!(worst <= F32_KV_WORST, "{set}: worst |dp| {worst}");
        }
    }
    let (hf, gguf) = (f32_kv(&hf_dir), f32_kv(&gguf_path));
    let plain = f32_kv(&tiny_dir().join("phi3"));
    let lr = hf
        .model
        .config
        .long_rope
        .as_ref()
        .expect("LongRoPE from config.json");
    assert_eq!(Some(lr), gguf.model.config.long_rope.as_ref());
    let a = lr.short.yarn.expect("attention factor").attn_factor;
    let want = reference["attention_factor"].as_f64().unwrap() as f32;
    assert!((a - want).abs() < 1e-6, "attention factor {a}, want {want}");

    let tokens: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 2000).collect();
    let (hs, gs) = (
        logits_ctx(&hf, &tokens, orig),
        logits_ctx(&gguf, &tokens, orig),
    );
    let (hl, gl) = (
        logits_ctx(&hf, &tokens, 4 * orig),
        logits_ctx(&gguf, &tokens, 4 * orig),
    );
    let p = logits_ctx(&plain, &tokens, orig);
    let (d_short, d_long) = (max_diff(&hs, &gs), max_diff(&hl, &gl));
    let (d_sets, d_plain) = (max_diff(&hs, &hl), max_diff(&hs, &p));
    println!(
        "LongRoPE: HF vs GGUF {d_short:e} (short) {d_long:e} (long); short vs long {d_sets}, \
         short vs plain {d_plain}"
    );
    assert!(d_short <= 1e-4 && d_long <= 1e-4, "{d_short} {d_long}");
    assert!(d_sets > 1e-2 && d_plain > 1e-2, "{d_sets} {d_plain}");

    // Uniform factors 4 and max positions = the original (attention factor 1): linear scaling.
    let (uniform, _) = phi3_longrope("longrope4", &[4.0; 8], &[4.0; 8], 64, 64);
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(uniform.join("config.json")).unwrap())
            .unwrap();
    cfg["rope_parameters"] = serde_json::json!({
        "rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0,
    });
    let linear = uniform.parent().unwrap().join("linear");
    std::fs::create_dir_all(&linear).unwrap();
    for f in std::fs::read_dir(&uniform).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, linear.join(f.file_name().unwrap())).unwrap();
    }
    std::fs::write(linear.join("config.json"), cfg.to_string()).unwrap();
    let (u, l) = (f32_kv(&uniform), f32_kv(&linear));
    assert!(u.model.config.rope_scaling.yarn.is_none());
    assert_eq!(
        logits_ctx(&u, &tokens, 64),
        logits_ctx(&l, &tokens, 64),
        "uniform LongRoPE factors of 4 must equal linear scaling by 4"
    );
    for d in [&hf_dir, &uniform] {
        let _ = std::fs::remove_dir_all(d.parent().unwrap());
    }
}
