//! Batch invariance: a sequence's logits are the same bits whether it runs alone or stacked with
//! other sequences in one forward pass (`Model::forward_batch`), for prompts of different lengths,
//! decode steps, and a decode step sharing its pass with another sequence's prompt (the shape of
//! continuous batching). Batched sequences keep their caches in one shared paged pool, through
//! interleaved block tables, and still match the contiguous cache of a sequence alone. Both real models: SmolLM2 (Q4_1/Q8_0 kernels) and Gemma 3 (Q4_K/Q6_K/Q5_0
//! kernels, whose llama.cpp order depends on a sequence's row count).

mod common;

use ferrum_llm::model::{KvCache, KvPool, Logits, SeqInput};
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

    // All prompts in one pass, then all decode steps in one pass, every cache paged in one shared
    // pool: sequence i holds blocks i, i + n, i + 2n, ... (interleaved, none contiguous).
    let bs = 16;
    let per_seq = ctx / bs;
    let tables_for = |n: usize| -> Vec<Vec<u32>> {
        (0..n)
            .map(|i| (0..per_seq).map(|j| (i + n * j) as u32).collect())
            .collect()
    };
    let n = ps.len();
    let mut pool = KvPool::new(cfg, n * per_seq, bs).unwrap();
    let tables = tables_for(n);
    let batch: Vec<SeqInput> = ps
        .iter()
        .zip(&tables)
        .map(|(p, table)| SeqInput {
            tokens: p,
            start: 0,
            table,
            want: Logits::From(0),
        })
        .collect();
    let out = llm.model.forward_batch(&mut pool, batch).unwrap();
    for (i, (got, want)) in out.iter().zip(&alone_prompt).enumerate() {
        assert!(
            same_bits(got, want),
            "{name}: prompt {i}'s logits changed when batched with the others"
        );
    }
    let steps: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
    let batch: Vec<SeqInput> = ps
        .iter()
        .zip(&tables)
        .zip(&steps)
        .map(|((p, table), tok)| SeqInput {
            tokens: tok,
            start: p.len(),
            table,
            want: Logits::Last,
        })
        .collect();
    let out = llm.model.forward_batch(&mut pool, batch).unwrap();
    for (i, (got, want)) in out.iter().zip(&alone_step).enumerate() {
        assert!(
            same_bits(got, want),
            "{name}: sequence {i}'s decode step changed when batched"
        );
    }

    // A decode step sharing its pass with another sequence's whole prompt.
    let mut pool = KvPool::new(cfg, 4 * per_seq, bs).unwrap();
    let t = tables_for(4);
    llm.model
        .forward_batch(
            &mut pool,
            vec![SeqInput {
                tokens: &ps[0],
                start: 0,
                table: &t[0],
                want: Logits::None,
            }],
        )
        .unwrap();
    let out = llm
        .model
        .forward_batch(
            &mut pool,
            vec![
                SeqInput {
                    tokens: &steps[0],
                    start: ps[0].len(),
                    table: &t[0],
                    want: Logits::Last,
                },
                SeqInput {
                    tokens: &ps[2],
                    start: 0,
                    table: &t[1],
                    want: Logits::From(0),
                },
            ],
        )
        .unwrap();
    assert!(
        same_bits(&out[0], &alone_step[0]),
        "{name}: mixed decode step"
    );
    assert!(same_bits(&out[1], &alone_prompt[2]), "{name}: mixed prompt");
    // A sequence that needs no logits gets none, and does not disturb the others.
    let out = llm
        .model
        .forward_batch(
            &mut pool,
            vec![
                SeqInput {
                    tokens: &ps[1],
                    start: 0,
                    table: &t[2],
                    want: Logits::None,
                },
                SeqInput {
                    tokens: &ps[3],
                    start: 0,
                    table: &t[3],
                    want: Logits::From(0),
                },
            ],
        )
        .unwrap();
    assert!(out[0].is_empty());
    assert!(
        same_bits(&out[1], &alone_prompt[3]),
        "{name}: next to a no-logits sequence"
    );
}

/// Greedy decoding of 8 sequences together (every step one forward pass over all 8, their caches
/// in one paged pool) gives each sequence the tokens and the logits, bit for bit, of its run
/// alone, at every step: what `ferrum bench --batch` and the server's decode steps compute.
#[allow(clippy::needless_range_loop)] // `step` indexes every sequence's record
fn check_batched_decode(llm: &Llm, name: &str) {
    let cfg = &llm.model.config;
    let mut ps = prompts(llm);
    for extra in ["The quick brown fox", "Water boils at", "In 1492, Columbus"] {
        ps.push(llm.tokenizer.encode(extra, true, false));
    }
    let steps = 16;
    let ctx = 96;
    let argmax = |l: &[f32]| -> u32 {
        l.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0 as u32
    };
    // Alone: per sequence, the logits of its last prompt position and of every decode step.
    let mut alone: Vec<Vec<Vec<f32>>> = Vec::new();
    for p in &ps {
        let mut cache = KvCache::new(cfg, ctx);
        let mut l = llm
            .model
            .forward(p, 0, &mut cache, Logits::Last)
            .unwrap()
            .to_vec();
        let mut seq = vec![l.clone()];
        for i in 0..steps {
            let tok = argmax(&l);
            l = llm
                .model
                .forward(&[tok], p.len() + i, &mut cache, Logits::Last)
                .unwrap()
                .to_vec();
            seq.push(l.clone());
        }
        alone.push(seq);
    }
    // Together: prompts one by one into a shared pool, then every step all 8 in one pass.
    let bs = 16;
    let per_seq = ctx / bs;
    let n = ps.len();
    let mut pool = KvPool::new(cfg, n * per_seq, bs).unwrap();
    let tables: Vec<Vec<u32>> = (0..n)
        .map(|i| (0..per_seq).map(|j| (i + n * j) as u32).collect())
        .collect();
    let mut last: Vec<Vec<f32>> = Vec::new();
    for (p, table) in ps.iter().zip(&tables) {
        let seq = SeqInput {
            tokens: p,
            start: 0,
            table,
            want: Logits::Last,
        };
        last.push(llm.model.forward_batch(&mut pool, vec![seq]).unwrap()[0].to_vec());
    }
    for step in 0..=steps {
        for (i, l) in last.iter().enumerate() {
            assert!(
                same_bits(l, &alone[i][step]),
                "{name}: sequence {i} at step {step}: batched logits differ from its run alone"
            );
        }
        if step == steps {
            break;
        }
        let toks: Vec<[u32; 1]> = last.iter().map(|l| [argmax(l)]).collect();
        let batch: Vec<SeqInput> = (0..n)
            .map(|i| SeqInput {
                tokens: &toks[i],
                start: ps[i].len() + step,
                table: &tables[i],
                want: Logits::Last,
            })
            .collect();
        last = llm
            .model
            .forward_batch(&mut pool, batch)
            .unwrap()
            .iter()
            .map(|b| b.to_vec())
            .collect();
    }
}

#[test]
fn smollm2_batched_decode_equals_each_sequence_alone() {
    check_batched_decode(common::smollm2(), "SmolLM2");
}

#[test]
fn gemma3_batched_decode_equals_each_sequence_alone() {
    check_batched_decode(common::gemma3(), "Gemma 3");
}

#[test]
fn smollm2_logits_do_not_depend_on_the_batch() {
    check(common::smollm2(), "SmolLM2");
}

#[test]
fn gemma3_logits_do_not_depend_on_the_batch() {
    check(common::gemma3(), "Gemma 3");
}
