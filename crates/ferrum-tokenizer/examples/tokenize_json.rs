//! Dev tool: tokenizes a batch of texts with a model's tokenizer and writes the ids as JSON,
//! for differential testing against llama.cpp (see scripts/dump_tokenizer_oracle.py).
//!
//! Usage: `cargo run -p ferrum-tokenizer --example tokenize_json -- MODEL.gguf IN.json OUT.json`
//! where IN.json is `[{"text": "...", "special": bool}]` (parse_special; add_special is false)
//! and OUT.json receives `[[ids...], ...]`.

use std::path::Path;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [model, input, output] = args.as_slice() else {
        return Err("usage: tokenize_json MODEL.gguf IN.json OUT.json".into());
    };
    let file = ferrum_gguf::GgufFile::open(Path::new(model))?;
    let tok = ferrum_tokenizer::Tokenizer::from_gguf(&file)?;
    let items: Vec<serde_json::Value> = serde_json::from_slice(&std::fs::read(input)?)?;
    let mut out = Vec::with_capacity(items.len());
    for it in &items {
        let text = it["text"].as_str().ok_or("item without text")?;
        let special = it["special"].as_bool().unwrap_or(false);
        out.push(tok.encode(text, false, special));
    }
    std::fs::write(output, serde_json::to_vec(&out)?)?;
    Ok(())
}
