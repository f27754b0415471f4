//! Locating the real models and the shared reference data, loading each model once per test binary.

#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::OnceLock;

use ferrum_llm::{Llm, LoadOptions};

pub const SMOLLM2: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
pub const GEMMA3: &str = "gemma-3-270m-q4_k_m.gguf";
pub const QWEN2: &str = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf";

pub fn models_dir() -> PathBuf {
    std::env::var_os("FERRUM_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models"))
}

pub fn shared_dir() -> PathBuf {
    std::env::var_os("FERRUM_SHARED_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared"))
}

pub fn model_path(file: &str) -> PathBuf {
    let p = models_dir().join(file);
    assert!(
        p.exists(),
        "{} is missing: run `python3 scripts/fetch_models.py`",
        p.display()
    );
    p
}

pub fn reference(name: &str) -> serde_json::Value {
    let p = shared_dir().join("reference").join(name);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).expect("reference JSON parses")
}

/// A reference file of this repository's own (`tests/reference`, made by
/// `scripts/llamacpp/make_reference.py`).
pub fn own_reference(name: &str) -> serde_json::Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/reference")
        .join(name);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    serde_json::from_str(&text).expect("reference JSON parses")
}

pub fn load(file: &str) -> Llm {
    Llm::load(&model_path(file), &LoadOptions::default(), &mut |_, _| {}).expect("model loads")
}

pub fn smollm2() -> &'static Llm {
    static M: OnceLock<Llm> = OnceLock::new();
    M.get_or_init(|| load(SMOLLM2))
}

pub fn gemma3() -> &'static Llm {
    static M: OnceLock<Llm> = OnceLock::new();
    M.get_or_init(|| load(GEMMA3))
}

pub fn qwen2() -> &'static Llm {
    static M: OnceLock<Llm> = OnceLock::new();
    M.get_or_init(|| load(QWEN2))
}
