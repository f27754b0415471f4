//! GGUF files: the reader (header, metadata, tensor infos and their bounds), then what loading
//! reads from a parsed file: the model's hyperparameters, the tokenizer from the metadata, and the
//! first row of every tensor dequantized. Malformed input must be an error, never a panic, a hang
//! or an allocation the file's size does not justify.
#![no_main]

use ferrum_gguf::{Bytes, GgufFile};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(f) = GgufFile::from_bytes(Bytes::from_vec(data.to_vec())) else {
        return;
    };
    let _ = format!("{f:?}");
    let _ = f.architecture();
    let _ = ferrum_llm::Config::from_gguf(&f);
    let _ = ferrum_tokenizer::Tokenizer::from_gguf(&f);
    for t in &f.tensors {
        let bytes = f.tensor_data(t);
        let row = t.dims.first().copied().unwrap_or(1) as usize;
        let Some(need) = t.dtype.row_bytes(row) else {
            continue; // not a whole number of blocks: loading refuses such a tensor
        };
        if row == 0 || row > 1 << 16 || need > bytes.len() {
            continue;
        }
        let mut out = vec![0f32; row];
        ferrum_kernels::quant::dequantize_row(t.dtype, &bytes[..need], &mut out);
    }
});
