//! Cost of a constrained-decoding step on the real vocabularies: the mask (computed by the
//! grammar engine, applied to the logits) and the advance by the drawn token, per token, along
//! walks that follow the grammar (the most likely allowed token under random logits).
//!
//! `cargo bench -p ferrum-llm --bench grammar` (needs the models from scripts/fetch_models.py).
//! Prints, per model and grammar, the median and 90th-percentile microseconds per token. Compare
//! with a decode step (`ferrum bench`): SmolLM2 tg at 2 threads is ~3.5-4 ms a token.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use ferrum_llm::grammar::{Grammar, Grammars};
use ferrum_llm::{Llm, LoadOptions};
use rand::{Rng, SeedableRng};
use serde_json::json;

fn model(file: &str) -> Option<Llm> {
    let dir = std::env::var_os("FERRUM_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models"));
    let p = dir.join(file);
    if !p.exists() {
        eprintln!("{} is missing: run scripts/fetch_models.py", p.display());
        return None;
    }
    Some(Llm::load(&p, &LoadOptions::default(), &mut |_, _| {}).expect("model loads"))
}

fn pct(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * q).round() as usize]
}

fn main() {
    let grammars: Vec<(&str, Grammar)> = vec![
        (
            "json: 30 objects (pattern, bounds, enum, bool)",
            Grammar::JsonSchema(json!({"type": "array", "minItems": 30, "items": {
                "type": "object", "properties": {
                    "id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    "kind": {"enum": ["book", "pen", "lamp"]},
                    "note": {"type": "string", "maxLength": 40},
                    "ok": {"type": "boolean"}},
                "required": ["id", "qty", "kind", "note", "ok"], "additionalProperties": false}})),
        ),
        (
            "json: free strings",
            Grammar::JsonSchema(
                json!({"type": "array", "items": {"type": "string"}, "minItems": 64}),
            ),
        ),
        ("json_object", Grammar::JsonObject),
        (
            "regex: sentences",
            Grammar::Regex(r"([A-Z][a-z]{1,12}( [a-z]{1,12}){2,8}\. ){1,40}".into()),
        ),
    ];
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for file in [
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    ] {
        let Some(llm) = model(file) else { continue };
        let t = Instant::now();
        let g = Grammars::new(Arc::clone(&llm.tokenizer)).unwrap();
        println!(
            "{} (vocabulary {}): grammar compiler built in {:.1} ms",
            llm.name,
            g.vocab_size(),
            t.elapsed().as_secs_f64() * 1e3
        );
        let vocab = llm.tokenizer.vocab_size();
        for (name, grammar) in &grammars {
            let t = Instant::now();
            let mut c = g.compile(grammar).unwrap();
            let compile_ms = t.elapsed().as_secs_f64() * 1e3;
            let mut per_token = Vec::new();
            let mut logits = vec![0f32; vocab];
            for _ in 0..256 {
                for l in logits.iter_mut() {
                    *l = rng.gen();
                }
                let t = Instant::now();
                c.mask(&mut logits).unwrap();
                let id = logits
                    .iter()
                    .enumerate()
                    .max_by(|a, b| a.1.total_cmp(b.1))
                    .map(|(i, _)| i as u32)
                    .unwrap();
                if llm.tokenizer.is_eog(id) {
                    break;
                }
                c.accept(id).unwrap();
                per_token.push(t.elapsed().as_secs_f64() * 1e6);
                if c.is_complete() {
                    break;
                }
            }
            let n = per_token.len();
            println!(
                "  {name:<46} compile {compile_ms:7.2} ms | {n:3} tokens: mask+advance median {:6.1} us, p90 {:6.1} us",
                pct(&mut per_token, 0.5),
                pct(&mut per_token, 0.9)
            );
        }
    }
}
