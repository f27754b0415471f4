//! Shared test helpers: locating models and reference data, loading tokenizers once.
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use ferrum_tokenizer::{Tokenizer, TokenizerSpec};

pub const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const GEMMA3: &str = "gemma-3-270m-q4_k_m.gguf";

/// `$FERRUM_MODELS_DIR/<name>` or `<repo>/models/<name>`; panics (fails the test) when absent.
pub fn model_path(name: &str) -> PathBuf {
    let dir = std::env::var_os("FERRUM_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models"));
    let p = dir.join(name);
    assert!(
        p.is_file(),
        "model {} not found: run python3 scripts/fetch_models.py",
        p.display()
    );
    p
}

/// `$FERRUM_SHARED_DIR/reference/<name>` or `<repo>/../shared/reference/<name>`.
pub fn reference_path(name: &str) -> PathBuf {
    let dir = std::env::var_os("FERRUM_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared"));
    let p = dir.join("reference").join(name);
    assert!(
        p.is_file(),
        "reference file {} not found (set FERRUM_SHARED_DIR)",
        p.display()
    );
    p
}

pub fn reference(name: &str) -> serde_json::Value {
    let bytes = std::fs::read(reference_path(name)).unwrap();
    serde_json::from_slice(&bytes).unwrap()
}

pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("id array")
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn load_spec(name: &str) -> TokenizerSpec {
    let f = ferrum_gguf::GgufFile::open(&model_path(name)).expect("open gguf");
    TokenizerSpec::from_gguf(&f).expect("tokenizer spec")
}

pub fn smollm2_spec() -> &'static TokenizerSpec {
    static S: OnceLock<TokenizerSpec> = OnceLock::new();
    S.get_or_init(|| load_spec(SMOLLM2))
}

pub fn gemma3_spec() -> &'static TokenizerSpec {
    static S: OnceLock<TokenizerSpec> = OnceLock::new();
    S.get_or_init(|| load_spec(GEMMA3))
}

pub fn smollm2() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::from_spec(smollm2_spec().clone()).expect("smollm2 tokenizer"))
}

pub fn gemma3() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::from_spec(gemma3_spec().clone()).expect("gemma3 tokenizer"))
}
