//! Writes small GGUF seed files for the `gguf_reader` target into `seeds/gguf_reader/`: a tiny
//! model-shaped file (llama metadata, a byte-level tokenizer, one tensor of every type ferrum
//! reads) and a few variants (version 2, another alignment, metadata of every value type).
//! `cargo run --example make_gguf_seeds` from `fuzz/`.

use ferrum_core::DType;
use ferrum_gguf::{str_array, GgufWriter, Value, ValueType};

fn tensor_bytes(dtype: DType, n: usize, seed: u8) -> Vec<u8> {
    let len = dtype.row_bytes(n).expect("whole blocks");
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) & 0x3f)
        .collect()
}

fn main() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("seeds/gguf_reader");
    std::fs::create_dir_all(&dir).unwrap();
    let tokens: Vec<String> = (0..=255u8)
        .map(|b| ferrum_tokenizer::byte_to_char(b).to_string())
        .chain(["<s>".to_string(), "</s>".to_string()])
        .collect();
    let types: Vec<i32> = (0..tokens.len())
        .map(|i| if i >= 256 { 3 } else { 1 })
        .collect();
    let base = || {
        GgufWriter::new()
            .kv("general.architecture", Value::String("llama".into()))
            .kv("llama.block_count", Value::U32(1))
            .kv("llama.context_length", Value::U32(64))
            .kv("llama.embedding_length", Value::U32(256))
            .kv("llama.feed_forward_length", Value::U32(512))
            .kv("llama.attention.head_count", Value::U32(4))
            .kv("llama.attention.head_count_kv", Value::U32(2))
            .kv("llama.rope.freq_base", Value::F32(10000.0))
            .kv("llama.attention.layer_norm_rms_epsilon", Value::F32(1e-5))
            .kv("tokenizer.ggml.model", Value::String("gpt2".into()))
            .kv("tokenizer.ggml.pre", Value::String("gpt2".into()))
            .kv("tokenizer.ggml.tokens", str_array(&tokens))
            .kv(
                "tokenizer.ggml.token_type",
                Value::Array(
                    ValueType::I32,
                    types.iter().map(|&t| Value::I32(t)).collect(),
                ),
            )
            .kv("tokenizer.ggml.merges", str_array(&["a b", "Ġ t"]))
            .kv("tokenizer.ggml.bos_token_id", Value::U32(256))
            .kv("tokenizer.ggml.eos_token_id", Value::U32(257))
    };
    let mut all = base();
    for (i, &d) in DType::ALL.iter().enumerate() {
        all = all.tensor(
            format!("t.{i}.{d}"),
            &[256, 1],
            d,
            tensor_bytes(d, 256, i as u8),
        );
    }
    std::fs::write(dir.join("every_type.gguf"), all.to_bytes()).unwrap();
    let small = base().tensor(
        "token_embd.weight",
        &[256, 2],
        DType::Q8_0,
        tensor_bytes(DType::Q8_0, 512, 1),
    );
    std::fs::write(dir.join("small_v3.gguf"), small.to_bytes()).unwrap();
    let v2 = GgufWriter::new()
        .version(2)
        .alignment(64)
        .kv("general.alignment", Value::U32(64))
        .kv("general.architecture", Value::String("qwen3".into()))
        .tensor("x", &[32], DType::F16, tensor_bytes(DType::F16, 32, 3));
    std::fs::write(dir.join("v2_align64.gguf"), v2.to_bytes()).unwrap();
    let kinds = GgufWriter::new()
        .kv("u8", Value::U8(1))
        .kv("i8", Value::I8(-1))
        .kv("u16", Value::U16(2))
        .kv("i16", Value::I16(-2))
        .kv("u32", Value::U32(3))
        .kv("i32", Value::I32(-3))
        .kv("f32", Value::F32(0.5))
        .kv("bool", Value::Bool(true))
        .kv("str", Value::String("s".into()))
        .kv("u64", Value::U64(4))
        .kv("i64", Value::I64(-4))
        .kv("f64", Value::F64(0.25))
        .kv(
            "nested",
            Value::Array(
                ValueType::Array,
                vec![Value::Array(ValueType::U8, vec![Value::U8(7)])],
            ),
        );
    std::fs::write(dir.join("value_kinds.gguf"), kinds.to_bytes()).unwrap();
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        println!(
            "{} {} bytes",
            p.display(),
            std::fs::metadata(&p).unwrap().len()
        );
    }
}
