//! Batch invariance: a sequence's logits are the same bits whether it runs alone or stacked with
//! other sequences in one forward pass (`Model::forward_batch`), for prompts of different lengths,
//! decode steps, and a decode step sharing its pass with another sequence's prompt (the shape of
//! continuous batching). Both real models: SmolLM2 (Q4_1/Q8_0 kernels) and Gemma 3 (Q4_K/Q6_K/Q5_0
//! kernels, whose llama.cpp order depends on a sequence's row count).

mod common;

use ferrum_llm::model::{KvCache, Logits, SeqInput};
use ferrum_llm::Llm;

fn prompts(llm: &Llm) -> Vec<Vec<u32>> {
    [
        "The capital of France is",
        "def fibonacci(n):\n    if n < 2:\n        return n",
        "Once upon a time, in a village far away, there lived a",
        "1, 2, 3,",
        "Translate to French: good morning, my friend, how are you today?",
    ]
    .iter()
    .map(|p| llm.tokenizer.encode(p, true, false))
    .collect()
}

fn same_bits(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits())
}

fn check(llm: &Llm, name: &str) {
    let cfg = &llm.model.config;
    let ps = prompts(llm);
    let ctx = 128;
    // Alone: every prompt position's logits, then one decode step.
    let mut alone_prompt = Vec::new();
    let mut alone_step = Vec::new();
    let mut next = Vec::new();
    for p in &ps {
        let mut cache = KvCache::new(cfg, ctx);
        let l = llm
            .model
            .forward(p, 0, &mut cache, Logits::From(0))
            .unwrap();
        let v = cfg.n_vocab;
        let last = &l[l.len() - v..];
        let tok = last
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0 as u32;
        let s = llm
            .model
            .forward(&[tok], p.len(), &mut cache, Logits::Last)
            .unwrap();
        alone_prompt.push(l);
        alone_step.push(s);
        next.push(tok);
    }

    // All prompts in one pass, then all decode steps in one pass.
    let mut caches: Vec<KvCache> = ps.iter().map(|_| KvCache::new(cfg, ctx)).collect();
    let batch: Vec<SeqInput> = ps
        .iter()
        .zip(caches.iter_mut())
        .map(|(p, cache)| SeqInput {
            tokens: p,
            start: 0,
            cache,
            want: Logits::From(0),
        })
        .collect();
    let out = llm.model.forward_batch(batch).unwrap();
    for (i, (got, want)) in out.iter().zip(&alone_prompt).enumerate() {
        assert!(
            same_bits(got, want),
            "{name}: prompt {i}'s logits changed when batched with the others"
        );
    }
    let steps: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
    let batch: Vec<SeqInput> = ps
        .iter()
        .zip(caches.iter_mut())
        .zip(&steps)
        .map(|((p, cache), tok)| SeqInput {
            tokens: tok,
            start: p.len(),
            cache,
            want: Logits::Last,
        })
        .collect();
    let out = llm.model.forward_batch(batch).unwrap();
    for (i, (got, want)) in out.iter().zip(&alone_step).enumerate() {
        assert!(
            same_bits(got, want),
            "{name}: sequence {i}'s decode step changed when batched"
        );
    }

    // A decode step sharing its pass with another sequence's whole prompt.
    let mut c0 = KvCache::new(cfg, ctx);
    llm.model.forward(&ps[0], 0, &mut c0, Logits::None).unwrap();
    let mut c1 = KvCache::new(cfg, ctx);
    let out = llm
        .model
        .forward_batch(vec![
            SeqInput {
                tokens: &steps[0],
                start: ps[0].len(),
                cache: &mut c0,
                want: Logits::Last,
            },
            SeqInput {
                tokens: &ps[2],
                start: 0,
                cache: &mut c1,
                want: Logits::From(0),
            },
        ])
        .unwrap();
    assert!(
        same_bits(&out[0], &alone_step[0]),
        "{name}: mixed decode step"
    );
    assert!(same_bits(&out[1], &alone_prompt[2]), "{name}: mixed prompt");
    // A sequence that needs no logits gets none, and does not disturb the others.
    let mut c2 = KvCache::new(cfg, ctx);
    let mut c3 = KvCache::new(cfg, ctx);
    let out = llm
        .model
        .forward_batch(vec![
            SeqInput {
                tokens: &ps[1],
                start: 0,
                cache: &mut c2,
                want: Logits::None,
            },
            SeqInput {
                tokens: &ps[3],
                start: 0,
                cache: &mut c3,
                want: Logits::From(0),
            },
        ])
        .unwrap();
    assert!(out[0].is_empty());
    assert!(
        same_bits(&out[1], &alone_prompt[3]),
        "{name}: next to a no-logits sequence"
    );
}

#[test]
fn smollm2_logits_do_not_depend_on_the_batch() {
    check(common::smollm2(), "SmolLM2");
}

#[test]
fn gemma3_logits_do_not_depend_on_the_batch() {
    check(common::gemma3(), "Gemma 3");
}
