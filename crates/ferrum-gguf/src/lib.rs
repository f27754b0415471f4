//! ferrum-gguf: the GGUF model container.
//!
//! A GGUF file is a header (magic `GGUF`, version, counts), typed key-value metadata, a table
//! of tensor infos (name, dims, GGML type, offset), padding, and an aligned data section.
//! [`GgufFile::open`] memory-maps a file and validates all of it up front; afterwards
//! [`GgufFile::get`] looks up metadata and [`GgufFile::tensor_data`] hands out zero-copy
//! windows of tensor bytes. [`GgufWriter`] builds files (for tests and tools).
//!
//! Hostile input: every malformed file yields [`Error::Parse`] with `format: "GGUF"`, the byte
//! offset of the problem and a message naming it; lengths and counts are checked against the
//! bytes left before anything is allocated, so parsing never panics or allocates more than a
//! small multiple of the file's size.
//!
//! ```no_run
//! # fn main() -> ferrum_gguf::Result<()> {
//! let f = ferrum_gguf::GgufFile::open(std::path::Path::new("model.gguf"))?;
//! println!("{:?} with {} tensors", f.architecture(), f.tensors.len());
//! let emb = f.tensor("token_embd.weight").expect("no embedding");
//! let bytes = f.tensor_data(emb);
//! # Ok(()) }
//! ```

mod cursor;
mod reader;
mod value;
mod writer;

pub use ferrum_core::{Bytes, DType, Error, Result};
pub use reader::{
    GgufFile, TensorInfo, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC, MAX_ARRAY_DEPTH, MAX_DIMS,
    MAX_KEY_LEN, MAX_METADATA_VALUES, MAX_TENSOR_NAME_LEN,
};
pub use value::{Value, ValueType};
pub use writer::{str_array, GgufWriter};
