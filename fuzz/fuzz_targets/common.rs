//! Shared by the targets: the grammar compiler on SmolLM2's vocabulary (loaded once), and a
//! short constrained walk.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use ferrum_llm::grammar::{Grammar, Grammars};
use ferrum_llm::{Llm, LoadOptions};

pub fn llm() -> &'static Llm {
    static L: OnceLock<Llm> = OnceLock::new();
    L.get_or_init(|| {
        let dir = std::env::var_os("FERRUM_MODELS_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models"));
        let p = dir.join("SmolLM2-135M-Instruct.Q4_1.gguf");
        Llm::load(&p, &LoadOptions::default(), &mut |_, _| {})
            .expect("SmolLM2 loads (run scripts/fetch_models.py)")
    })
}

pub fn grammars() -> &'static Grammars {
    static G: OnceLock<Grammars> = OnceLock::new();
    G.get_or_init(|| Grammars::new(Arc::clone(&llm().tokenizer)).expect("grammar compiler"))
}

/// Compiles `g` and takes up to `steps` tokens through its masks, choosing among the allowed
/// tokens by `pick`: whatever the grammar, a mask allows at least one token or is an error,
/// and an allowed token is accepted (but for the one limitation noted below).
pub fn walk(g: &Grammar, steps: usize, pick: &[u8]) {
    let Ok(mut c) = grammars().compile(g) else {
        return;
    };
    let vocab = grammars().vocab_size();
    let mut logits = vec![0f32; vocab];
    for i in 0..steps {
        if c.is_complete() {
            return;
        }
        logits.iter_mut().for_each(|l| *l = 0.0);
        if c.mask(&mut logits).is_err() {
            return; // over the parser's bounds: an error, as the engine reports it
        }
        let allowed: Vec<u32> = (0..vocab as u32)
            .filter(|&t| logits[t as usize] == 0.0)
            .collect();
        assert!(
            !allowed.is_empty(),
            "a mask that allows nothing was not an error"
        );
        let k = pick.get(i).copied().unwrap_or(0) as usize;
        let id = allowed[k % allowed.len()];
        if llm().tokenizer.is_eog(id) {
            return;
        }
        if let Err(e) = c.accept(id) {
            // Known grammar-engine limitation (found by this target): when the grammar forces
            // a byte that no token of the vocabulary starts with (SmolLM2 has no token for
            // 0x04, 0x06, 0x13, 0x14, 0x16, 0x1d), the mask lets a token for the byte after it
            // through, and the advance then refuses it. The engine ends such a request with an
            // error; any other refusal of an allowed token is a bug.
            let msg = e.to_string();
            assert!(
                msg.contains("forced bytes"),
                "an allowed token was refused: {msg}"
            );
            return;
        }
    }
}
