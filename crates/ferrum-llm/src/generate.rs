//! Autoregressive generation: prefill the prompt, then sample (or teacher-force) one token per step,
//! streaming text as it is produced.

use std::time::Instant;

use ferrum_core::{Buf, Error, Result};

use crate::model::{KvCache, Logits};
use crate::output::SeqOutput;
use crate::sampling::{top_logprobs, Sampler, SamplingParams};
use crate::Llm;

/// Prompt tokens processed per forward pass during prefill (bounds activation memory).
pub const PREFILL_CHUNK: usize = 512;

/// How prefill cuts an `n`-token prompt into forward calls.
///
/// For models with sliding-window layers llama-server evaluates the prompt's last 4 tokens, and
/// for prompts over 516 tokens also the 512 before them, in calls of their own (it takes context
/// checkpoints there). llama.cpp's Q4_K kernels choose their summation order by the number of rows
/// in a call, so following the same cuts reproduces its numerics exactly; models without a window
/// get one piece. Every piece is then cut into [`PREFILL_CHUNK`]-token calls from its own start.
pub fn prefill_calls(n: usize, sliding_window: bool) -> Vec<std::ops::Range<usize>> {
    let pieces: Vec<std::ops::Range<usize>> = if !sliding_window || n <= 4 {
        std::iter::once(0..n).collect()
    } else if n <= 4 + PREFILL_CHUNK {
        vec![0..n - 4, n - 4..n]
    } else {
        let a = n - 4 - PREFILL_CHUNK;
        vec![0..a, a..n - 4, n - 4..n]
    };
    pieces
        .into_iter()
        .flat_map(|p| {
            (p.start..p.end)
                .step_by(PREFILL_CHUNK)
                .map(move |s| s..(s + PREFILL_CHUNK).min(p.end))
        })
        .collect()
}

/// Runs `prompt` from position 0 into `cache` and returns the logits of its last token.
pub fn prefill(llm: &Llm, prompt: &[u32], cache: &mut KvCache) -> Result<Buf> {
    let calls = prefill_calls(prompt.len(), llm.model.config.sliding_window.is_some());
    let mut logits = Buf::default();
    for r in &calls {
        let want = if r.end == prompt.len() {
            Logits::Last
        } else {
            Logits::None
        };
        logits = llm
            .model
            .forward(&prompt[r.clone()], r.start, cache, want)?;
    }
    Ok(logits)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefill_calls_follow_llama_servers_cuts() {
        assert_eq!(
            prefill_calls(6, false),
            std::iter::once(0..6).collect::<Vec<_>>()
        );
        assert_eq!(prefill_calls(6, true), vec![0..2, 2..6]);
        assert_eq!(
            prefill_calls(3, true),
            std::iter::once(0..3).collect::<Vec<_>>()
        );
        assert_eq!(
            prefill_calls(1100, false),
            vec![0..512, 512..1024, 1024..1100]
        );
        assert_eq!(
            prefill_calls(1100, true),
            vec![0..512, 512..584, 584..1096, 1096..1100]
        );
        for n in [1, 5, 516, 517, 2000] {
            let calls = prefill_calls(n, true);
            assert_eq!(calls.first().unwrap().start, 0);
            assert_eq!(calls.last().unwrap().end, n);
            assert!(calls
                .windows(2)
                .all(|w| w[0].end == w[1].start && w[0].len() <= PREFILL_CHUNK));
        }
    }
}

#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// Keep going past end-of-generation tokens.
    pub ignore_eos: bool,
    /// Teacher forcing: feed these ids instead of sampling (top-K is still reported per position).
    pub force_tokens: Option<Vec<u32>>,
    /// Report this many most likely tokens (full-vocabulary log-softmax) per generated position.
    pub top_logprobs: usize,
    /// KV-cache capacity in tokens (prompt + generated).
    pub ctx_size: usize,
    /// The grammar the output must follow (compiled by [`crate::grammar::Grammars`]): each token
    /// is drawn from the tokens it allows, and generation stops when it is complete. Not applied
    /// to forced tokens.
    pub constraint: Option<crate::grammar::Constraint>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// max_tokens reached (or the forced tokens ran out).
    Length,
    /// An end-of-generation token or a stop string.
    Stop,
}

#[derive(Clone, Debug)]
pub struct Generation {
    pub prompt_tokens: usize,
    pub tokens: Vec<u32>,
    pub text: String,
    /// Per generated position, its most likely `(token, logprob)`.
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    pub finish: FinishReason,
    pub prompt_seconds: f64,
    pub generate_seconds: f64,
}

impl Generation {
    pub fn prompt_tokens_per_second(&self) -> f64 {
        self.prompt_tokens as f64 / self.prompt_seconds.max(1e-9)
    }
    pub fn tokens_per_second(&self) -> f64 {
        // The first token comes out of the prefill pass; later ones each cost one decode step.
        self.tokens.len().saturating_sub(1) as f64 / self.generate_seconds.max(1e-9)
    }
}

/// Runs `req`, calling `on_text` with each piece of text as soon as it is final.
pub fn generate(
    llm: &Llm,
    req: &GenerateRequest,
    on_text: &mut dyn FnMut(&str),
) -> Result<Generation> {
    let cfg = &llm.model.config;
    if req.prompt.is_empty() {
        return Err(Error::msg("the prompt is empty (no tokens)"));
    }
    req.sampling.validate().map_err(Error::msg)?;
    let n_forced = req.force_tokens.as_ref().map(|f| f.len());
    let budget = n_forced.unwrap_or(req.max_tokens);
    if req.prompt.len() > req.ctx_size {
        return Err(Error::msg(format!(
            "the prompt has {} tokens, more than the context of {}: shorten it or raise --ctx-size (the model was trained with {})",
            req.prompt.len(),
            req.ctx_size,
            cfg.n_ctx_train
        )));
    }
    if let Some(&bad) = req
        .force_tokens
        .iter()
        .flatten()
        .find(|&&t| t as usize >= cfg.n_vocab)
    {
        return Err(Error::msg(format!(
            "forced token id {bad} is outside the vocabulary of {}",
            cfg.n_vocab
        )));
    }
    let capacity = req.ctx_size.min(req.prompt.len() + budget);
    let mut cache = KvCache::new(cfg, capacity.max(1));
    // The context the run may reach is --ctx-size (LongRoPE picks its factors by it, as
    // llama.cpp does), however little of it this generation needs.
    cache.pool.set_seq_context(req.ctx_size);
    let mut sampler = Sampler::new(req.sampling.clone());
    for &t in &req.prompt {
        sampler.accept(t);
    }

    let t0 = Instant::now();
    let mut logits = prefill(llm, &req.prompt, &mut cache)?;
    let prompt_seconds = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    let mut out = Generation {
        prompt_tokens: req.prompt.len(),
        tokens: Vec::new(),
        text: String::new(),
        top_logprobs: Vec::new(),
        finish: FinishReason::Length,
        prompt_seconds,
        generate_seconds: 0.0,
    };
    // Forced tokens are taken whatever they are: no end-of-generation stop while forcing.
    let ignore_eos = req.ignore_eos || req.force_tokens.is_some();
    let mut seq = SeqOutput::new(&req.stop, budget, ignore_eos, 0);
    let mut constraint = req
        .constraint
        .clone()
        .filter(|_| req.force_tokens.is_none());
    let mut pos = req.prompt.len();
    while out.tokens.len() < budget {
        if req.top_logprobs > 0 {
            out.top_logprobs
                .push(top_logprobs(&logits, req.top_logprobs));
        }
        let id = match (&req.force_tokens, constraint.as_mut()) {
            (Some(f), _) => f[out.tokens.len()],
            (None, Some(c)) => {
                let mut masked = logits.to_vec();
                c.mask(&mut masked)?;
                sampler.sample(&masked)
            }
            (None, None) => sampler.sample(&logits),
        };
        sampler.accept(id);
        out.tokens.push(id);
        let mut complete = false;
        if let Some(c) = constraint.as_mut() {
            c.accept(id)?;
            complete = c.is_complete();
        }
        let step = seq.push(&llm.tokenizer, id, complete);
        for t in [&step.text, &step.tail] {
            if !t.is_empty() {
                on_text(t);
            }
        }
        if step.finish.is_some() {
            break;
        }
        if pos >= capacity {
            // The context is full: stop as max_tokens would.
            let tail = seq.cut();
            if !tail.is_empty() {
                on_text(&tail);
            }
            break;
        }
        logits = llm.model.forward(&[id], pos, &mut cache, Logits::Last)?;
        pos += 1;
    }
    out.finish = seq.finish().unwrap_or(FinishReason::Length);
    out.text = seq.text().to_string();
    out.generate_seconds = t1.elapsed().as_secs_f64();
    Ok(out)
}
