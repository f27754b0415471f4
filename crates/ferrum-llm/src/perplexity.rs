//! Perplexity as llama.cpp's `llama-perplexity` computes it: the text is tokenized once (with BOS
//! if the model adds one), cut into non-overlapping chunks of `ctx` tokens (the tail is dropped),
//! each chunk is evaluated from an empty cache with its first token replaced by BOS when the model
//! adds BOS, and the second half of each chunk is scored: token j+1 given logits at j, for
//! j = ctx/2 .. ctx-2. PPL = exp(mean NLL).

use ferrum_core::{Error, Result};

use crate::model::{KvCache, Logits};
use crate::Llm;

#[derive(Clone, Debug)]
pub struct PerplexityReport {
    pub ppl: f64,
    /// Standard error of the PPL estimate (llama.cpp's `+/-` figure).
    pub ppl_stderr: f64,
    pub n_chunks: usize,
    pub n_scored: usize,
    pub n_tokens: usize,
}

/// `on_chunk(i, n, running_ppl)` is called after each chunk.
pub fn perplexity(
    llm: &Llm,
    text: &str,
    ctx: usize,
    on_chunk: &mut dyn FnMut(usize, usize, f64),
) -> Result<PerplexityReport> {
    if ctx < 4 {
        return Err(Error::msg(format!("--ctx {ctx} is too small (at least 4)")));
    }
    let tokens = llm.tokenizer.encode(text, true, false);
    if tokens.len() < 2 * ctx {
        return Err(Error::msg(format!(
            "the text has {} tokens; perplexity with --ctx {ctx} needs at least {}",
            tokens.len(),
            2 * ctx
        )));
    }
    let n_chunks = tokens.len() / ctx;
    let first = ctx / 2;
    let bos = llm
        .tokenizer
        .add_bos()
        .then(|| llm.tokenizer.bos())
        .flatten();
    let (mut sum, mut sum2, mut n) = (0f64, 0f64, 0usize);
    for c in 0..n_chunks {
        let mut chunk = tokens[c * ctx..(c + 1) * ctx].to_vec();
        if let Some(b) = bos {
            chunk[0] = b;
        }
        let mut cache = KvCache::new(&llm.model.config, ctx);
        let logits = llm
            .model
            .forward(&chunk, 0, &mut cache, Logits::From(first))?;
        let nv = llm.model.config.n_vocab;
        for j in first..ctx - 1 {
            let row = &logits[(j - first) * nv..(j - first + 1) * nv];
            let target = tokens[c * ctx + j + 1] as usize;
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let s: f64 = row.iter().map(|&l| ((l - max) as f64).exp()).sum();
            let nll = max as f64 + s.ln() - row[target] as f64;
            sum += nll;
            sum2 += nll * nll;
            n += 1;
        }
        on_chunk(c + 1, n_chunks, (sum / n as f64).exp());
    }
    let mean = sum / n as f64;
    let var = (sum2 / n as f64 - mean * mean).max(0.0) / (n as f64 - 1.0).max(1.0);
    let ppl = mean.exp();
    Ok(PerplexityReport {
        ppl,
        ppl_stderr: var.sqrt() * ppl,
        n_chunks,
        n_scored: n,
        n_tokens: tokens.len(),
    })
}
