//! Bad input gives errors, never panics; small hand-built vocabularies behave as specified.

use ferrum_gguf::{str_array, Bytes, GgufFile, GgufWriter, Value, ValueType};
use ferrum_tokenizer::{Tokenizer, TokenizerSpec};
use proptest::prelude::*;

fn bpe_spec() -> TokenizerSpec {
    let mut tokens: Vec<String> = (0..=255u8)
        .map(|b| ferrum_tokenizer::byte_to_char(b).to_string())
        .collect();
    tokens.extend(["ab", "<|end|>", "ĠHello"].map(String::from));
    TokenizerSpec {
        model: "gpt2".into(),
        pre: Some("gpt2".into()),
        token_types: Some(
            (0..tokens.len())
                .map(|i| if i == 257 { 3 } else { 1 })
                .collect(),
        ),
        tokens,
        merges: Some(
            ["a b", "Ġ H", "ĠH e", "ĠHe l", "ĠHel l", "ĠHell o"]
                .map(String::from)
                .to_vec(),
        ),
        eos: Some(257),
        ..Default::default()
    }
}

fn err_of(spec: TokenizerSpec) -> String {
    Tokenizer::from_spec(spec).unwrap_err().to_string()
}

#[test]
fn garbage_specs_are_errors() {
    assert!(Tokenizer::from_spec(bpe_spec()).is_ok());
    assert!(err_of(TokenizerSpec::default()).contains("empty"));
    assert!(err_of(TokenizerSpec {
        model: "wordpiece".into(),
        ..bpe_spec()
    })
    .contains("wordpiece"));
    assert!(err_of(TokenizerSpec {
        pre: Some("klingon".into()),
        ..bpe_spec()
    })
    .contains("klingon"));
    assert!(err_of(TokenizerSpec {
        merges: None,
        ..bpe_spec()
    })
    .contains("merges"));
    assert!(err_of(TokenizerSpec {
        merges: Some(vec!["nospace".into()]),
        ..bpe_spec()
    })
    .contains("nospace"));
    assert!(err_of(TokenizerSpec {
        bos: Some(100_000),
        ..bpe_spec()
    })
    .contains("100000"));
    assert!(err_of(TokenizerSpec {
        eos: Some(259),
        ..bpe_spec()
    })
    .contains("out of range"));
    assert!(err_of(TokenizerSpec {
        token_types: Some(vec![1, 1]),
        ..bpe_spec()
    })
    .contains("types"));
    assert!(err_of(TokenizerSpec {
        add_bos: Some(true),
        ..bpe_spec()
    })
    .contains("bos"));
    let mut dup = bpe_spec();
    dup.tokens[258] = "a".into();
    assert!(err_of(dup).contains("duplicate"));
    let spm = TokenizerSpec {
        model: "llama".into(),
        tokens: vec!["<unk>".into(), "a".into()],
        scores: Some(vec![0.0]),
        ..Default::default()
    };
    assert!(err_of(spm.clone()).contains("scores"));
    // SPM defaults to add_bos=true, which needs a BOS id
    assert!(err_of(TokenizerSpec {
        scores: None,
        ..spm
    })
    .contains("bos"));
}

#[test]
fn small_bpe_vocab() {
    let t = Tokenizer::from_spec(bpe_spec()).unwrap();
    assert_eq!(t.encode("ab", false, false), [256]);
    assert_eq!(t.encode(" Hello", false, false), [258]);
    assert_eq!(t.encode("x<|end|>", false, true), [u32::from(b'x'), 257]);
    assert_eq!(
        t.decode(&t.encode("héllo wörld", false, false), false),
        "héllo wörld"
    );
    assert!(t.is_eog(257));
    assert!(!t.add_bos());
}

#[test]
fn gguf_without_or_with_broken_tokenizer_is_an_error() {
    let open = |w: GgufWriter| GgufFile::from_bytes(Bytes::from_vec(w.to_bytes())).unwrap();
    let f = open(GgufWriter::new().kv("general.architecture", Value::String("llama".into())));
    assert!(Tokenizer::from_gguf(&f)
        .unwrap_err()
        .to_string()
        .contains("tokenizer"));
    let f = open(
        GgufWriter::new()
            .kv("tokenizer.ggml.model", Value::String("gpt2".into()))
            .kv("tokenizer.ggml.tokens", Value::U32(7)),
    );
    assert!(Tokenizer::from_gguf(&f)
        .unwrap_err()
        .to_string()
        .contains("tokenizer.ggml.tokens"));
    let f = open(
        GgufWriter::new()
            .kv("tokenizer.ggml.model", Value::String("gpt2".into()))
            .kv("tokenizer.ggml.tokens", str_array(&["a", "b"]))
            .kv(
                "tokenizer.ggml.merges",
                Value::Array(ValueType::U32, vec![Value::U32(1)]),
            ),
    );
    assert!(Tokenizer::from_gguf(&f)
        .unwrap_err()
        .to_string()
        .contains("merges"));
    let f = open(
        GgufWriter::new()
            .kv("tokenizer.ggml.model", Value::String("gpt2".into()))
            .kv("tokenizer.ggml.tokens", str_array(&["a", "b", "ab"]))
            .kv("tokenizer.ggml.merges", str_array(&["a b"]))
            .kv("tokenizer.ggml.eos_token_id", Value::I32(-1)),
    );
    assert!(Tokenizer::from_gguf(&f)
        .unwrap_err()
        .to_string()
        .contains("eos_token_id"));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    /// Arbitrary specs never panic; whatever loads encodes and decodes arbitrary input
    /// without panicking and only yields ids inside the vocabulary.
    #[test]
    fn arbitrary_specs_never_panic(
        spm in any::<bool>(),
        pre in prop::sample::select(vec!["smollm", "gpt2", "default", "llama3", "qwen2"]),
        tokens in prop::collection::vec("[ab<>|/ \\nĠ▁é東😀]{0,4}|<0x[0-9A-F]{2}>", 1..40),
        types in prop::collection::vec(0i32..8, 40),
        merges in prop::collection::vec("[abĠ▁é]{1,2} [abĠ▁é]{1,2}", 0..30),
        scores in prop::collection::vec(-10.0f32..10.0, 40),
        bos in prop::option::of(0u32..45),
        text in "[ab<>|/ \\nĠ▁é東😀x0-9']{0,40}|\\PC{0,20}",
        ids in prop::collection::vec(0u32..60, 0..20),
        parse_special in any::<bool>(),
    ) {
        let mut seen = std::collections::HashSet::new();
        let tokens: Vec<String> = tokens.into_iter().filter(|t| seen.insert(t.clone())).collect();
        let spec = TokenizerSpec {
            model: if spm { "llama" } else { "gpt2" }.into(),
            pre: Some(pre.into()),
            tokens,
            token_types: Some(types),
            merges: Some(merges),
            scores: Some(scores),
            bos,
            ..Default::default()
        };
        if let Ok(t) = Tokenizer::from_spec(spec) {
            let enc = t.encode(&text, true, parse_special);
            prop_assert!(enc.iter().all(|&i| (i as usize) < t.vocab_size()));
            let _ = t.decode(&enc, true);
            let _ = t.decode(&ids, false);
            for &i in &ids {
                let _ = (t.token_bytes(i, true), t.token_text(i), t.is_eog(i), t.token_type(i));
            }
        }
    }
}
