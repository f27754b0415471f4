//! Parses the two real model files and cross-checks them against values read with the Python
//! `gguf` 0.19 reader, e.g.
//!
//! ```text
//! .venv/bin/python -c "from gguf import GGUFReader; r = GGUFReader('models/SmolLM2-135M-Instruct.Q4_1.gguf');
//!   t = [t for t in r.tensors if t.name == 'token_embd.weight'][0];
//!   print(t.tensor_type.name, list(t.shape), t.data_offset, t.n_bytes, bytes(t.data.reshape(-1).view('uint8')[:16]).hex())"
//! ```
//!
//! (`data_offset` there is absolute; `fields[k].contents()` gives metadata values.)

use std::path::PathBuf;

use ferrum_gguf::{DType, GgufFile, Value, ValueType};

fn model_path(file: &str) -> PathBuf {
    let dir = std::env::var_os("FERRUM_MODELS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../models"));
    let path = dir.join(file);
    assert!(
        path.is_file(),
        "model file {} is missing: run `python3 scripts/fetch_models.py` (or set FERRUM_MODELS_DIR)",
        path.display()
    );
    path
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|c| format!("{c:02x}")).collect()
}

fn check_tensor(
    f: &GgufFile,
    name: &str,
    dtype: DType,
    dims: &[u64],
    abs_offset: u64,
    n_bytes: u64,
    head: &str,
) {
    let t = f.tensor(name).unwrap_or_else(|| panic!("no tensor {name}"));
    assert_eq!(t.dtype, dtype, "{name}");
    assert_eq!(t.dims, dims, "{name}");
    assert_eq!(f.data_offset + t.offset, abs_offset, "{name}");
    assert_eq!(t.n_bytes, n_bytes, "{name}");
    let data = f.tensor_data(t);
    assert_eq!(data.len() as u64, n_bytes);
    assert_eq!(hex(&data[..16]), head, "{name}");
}

#[test]
fn smollm2_parses_and_matches_python_reader() {
    let f = GgufFile::open(&model_path("SmolLM2-135M-Instruct.Q4_1.gguf")).unwrap();
    assert_eq!(f.version, 3);
    assert_eq!(f.metadata.len(), 33);
    assert_eq!(f.tensors.len(), 272);
    assert_eq!(f.alignment, 32);
    assert_eq!(f.data_offset, 1_785_664);
    assert_eq!(f.file_size(), 98_362_432);
    assert_eq!(f.architecture(), Some("llama"));
    assert_eq!(f.get("llama.block_count"), Some(&Value::U32(30)));
    assert_eq!(f.get_u64("llama.embedding_length"), Some(576));
    assert_eq!(f.get_f32("llama.rope.freq_base"), Some(100000.0));
    assert_eq!(
        f.get_f32("llama.attention.layer_norm_rms_epsilon"),
        Some(1e-5) // stored f32 9.999999747378752e-06, the f32 nearest 1e-5
    );
    assert_eq!(
        f.get("tokenizer.ggml.add_bos_token"),
        Some(&Value::Bool(false))
    );
    assert_eq!(f.get_str("tokenizer.ggml.model"), Some("gpt2"));
    assert_eq!(f.get_str("tokenizer.ggml.pre"), Some("smollm"));
    assert_eq!(
        f.get_str("tokenizer.chat_template").map(str::len),
        Some(368)
    );

    let tokens = f.get("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.value_type(), ValueType::Array);
    let tokens = tokens.as_str_array().unwrap();
    assert_eq!(tokens.len(), 49152);
    assert_eq!(
        &tokens[..3],
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    );
    assert_eq!(tokens[1000], "()");
    assert_eq!(tokens[49151], "ectable");
    let merges = f
        .get("tokenizer.ggml.merges")
        .unwrap()
        .as_str_array()
        .unwrap();
    assert_eq!(merges.len(), 48900);
    assert_eq!(merges[0], "Ġ t");
    assert_eq!(merges[48899], "ect able");
    let types = f
        .get("tokenizer.ggml.token_type")
        .unwrap()
        .as_i32_array()
        .unwrap();
    assert_eq!(types.len(), 49152);
    assert_eq!(&types[15..18], [3, 3, 1]);
    assert_eq!(
        f.get("general.languages"),
        Some(&Value::Array(
            ValueType::String,
            vec![Value::String("en".into())]
        ))
    );
    // Display is short even for the 49152-token array.
    assert!(f
        .get("tokenizer.ggml.tokens")
        .unwrap()
        .to_string()
        .starts_with("[str; 49152: \"<|endoftext|>\""));

    check_tensor(
        &f,
        "token_embd.weight",
        DType::Q8_0,
        &[576, 49152],
        1_785_664,
        30_081_024,
        "3219d60d13f7e5ee08d02aa801de5681",
    );
    check_tensor(
        &f,
        "blk.0.ffn_down.weight",
        DType::Q4_1,
        &[1536, 576],
        31_868_992,
        552_960,
        "5530d0b8020765315462559637256352",
    );
    check_tensor(
        &f,
        "output_norm.weight",
        DType::F32,
        &[576],
        98_360_128,
        2304,
        "0000e13f0000e93f0000e43f0000cd3f",
    );
    assert!(f.tensor("output.weight").is_none());
    assert!(format!("{f:?}").len() < 300, "Debug should summarise");
    let n_q41 = f.tensors.iter().filter(|t| t.dtype == DType::Q4_1).count();
    let n_f32 = f.tensors.iter().filter(|t| t.dtype == DType::F32).count();
    assert_eq!((n_q41, n_f32), (210, 61));
}

#[test]
fn gemma3_parses_and_matches_python_reader() {
    let f = GgufFile::open(&model_path("gemma-3-270m-q4_k_m.gguf")).unwrap();
    assert_eq!(f.version, 3);
    assert_eq!(f.metadata.len(), 33);
    assert_eq!(f.tensors.len(), 236);
    assert_eq!(f.data_offset, 6_525_120);
    assert_eq!(f.file_size(), 253_113_024);
    assert_eq!(f.architecture(), Some("gemma3"));
    assert_eq!(f.get_u64("gemma3.block_count"), Some(18));
    assert_eq!(f.get_u64("gemma3.attention.sliding_window"), Some(512));
    assert_eq!(f.get_f32("gemma3.rope.freq_base"), Some(1_000_000.0));
    assert_eq!(f.get_u64("general.file_type"), Some(15));
    assert_eq!(
        f.get("tokenizer.ggml.add_bos_token"),
        Some(&Value::Bool(true))
    );
    assert!(f.get("tokenizer.chat_template").is_none());
    let tags = f.get("general.tags").unwrap().as_str_array().unwrap();
    assert_eq!(tags, ["gemma3", "gemma", "google", "text-generation"]);

    let tokens = f
        .get("tokenizer.ggml.tokens")
        .unwrap()
        .as_str_array()
        .unwrap();
    assert_eq!(tokens.len(), 262_144);
    assert_eq!(tokens[106], "<end_of_turn>");
    assert_eq!(tokens[238], "<0x00>");
    let scores = f
        .get("tokenizer.ggml.scores")
        .unwrap()
        .as_f32_array()
        .unwrap();
    assert_eq!(scores.len(), 262_144);
    assert_eq!((scores[0], scores[1000]), (-1000.0, -506.0));
    let types = f
        .get("tokenizer.ggml.token_type")
        .unwrap()
        .as_i32_array()
        .unwrap();
    assert_eq!((types[0], types[238]), (3, 6));

    check_tensor(
        &f,
        "blk.0.ffn_down.weight",
        DType::Q6_K,
        &[2048, 640],
        185_896_128,
        1_075_200,
        "da277d901132d47259b9570599d2679a",
    );
    check_tensor(
        &f,
        "token_embd.weight",
        DType::Q8_0,
        &[640, 262_144],
        6_527_680,
        178_257_920,
        "f210f447c7ddec3008cb3febf64d4610",
    );
    check_tensor(
        &f,
        "output_norm.weight",
        DType::F32,
        &[640],
        6_525_120,
        2560,
        "0000e4400000194100003c4200001143",
    );
}
