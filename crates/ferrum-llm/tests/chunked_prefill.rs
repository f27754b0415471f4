//! Prompts longer than one prefill chunk: the cache carries the first chunk into the second, and
//! a chunk whose outputs no logits need (its last layer keeps no rows) must run cleanly.

mod common;

use ferrum_llm::generate::PREFILL_CHUNK;
use ferrum_llm::model::{KvCache, Logits};
use ferrum_llm::{generate, GenerateRequest, SamplingParams};

#[test]
fn chunked_prefill_gives_the_logits_of_one_pass() {
    let llm = common::smollm2();
    let text =
        std::fs::read_to_string(common::shared_dir().join("reference/ppl-text.txt")).unwrap();
    let mut ids = llm.tokenizer.encode(&text, true, false);
    ids.truncate(PREFILL_CHUNK + 88);
    assert_eq!(ids.len(), PREFILL_CHUNK + 88, "the text is long enough");
    let cfg = &llm.model.config;

    let mut one = KvCache::new(cfg, ids.len());
    let whole = llm.model.forward(&ids, 0, &mut one, Logits::Last).unwrap();

    let mut two = KvCache::new(cfg, ids.len());
    let none = llm
        .model
        .forward(&ids[..PREFILL_CHUNK], 0, &mut two, Logits::None)
        .unwrap();
    assert!(none.is_empty());
    let split = llm
        .model
        .forward(&ids[PREFILL_CHUNK..], PREFILL_CHUNK, &mut two, Logits::Last)
        .unwrap();
    // SmolLM2's kernels (Q4_1, Q8_0) do not change order with the row count: bit-identical.
    assert_eq!(whole.len(), cfg.n_vocab);
    assert!(whole.iter().all(|v| v.is_finite()));
    assert_eq!(whole, split);

    // And through `generate`, which prefills in PREFILL_CHUNK pieces.
    let req = GenerateRequest {
        prompt: ids,
        max_tokens: 4,
        sampling: SamplingParams::greedy(),
        stop: vec![],
        ignore_eos: true,
        force_tokens: None,
        top_logprobs: 1,
        ctx_size: 4096,
        constraint: None,
    };
    let g = generate(llm, &req, &mut |_| {}).unwrap();
    assert_eq!(g.tokens.len(), 4);
    let argmax = whole
        .iter()
        .enumerate()
        .fold(0, |b, (i, &v)| if v > whole[b] { i } else { b });
    assert_eq!(g.tokens[0] as usize, argmax);
}
