//! Serialising GGUF files (little-endian), for tests, fixtures and tools.

use std::path::Path;

use ferrum_core::{DType, Error};

use crate::reader::{ALIGNMENT_KEY, DEFAULT_ALIGNMENT, MAGIC};
use crate::value::{Value, ValueType};
use crate::Result;

struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    type_id: u32,
    data: Vec<u8>,
}

/// Builds a GGUF file (version 3 unless [`GgufWriter::version`] says otherwise) from metadata
/// and raw tensor bytes:
///
/// ```
/// use ferrum_gguf::{DType, GgufFile, GgufWriter, Value, Bytes};
/// let bytes = GgufWriter::new()
///     .alignment(64)
///     .kv("general.architecture", Value::String("llama".into()))
///     .tensor("w", &[2, 3], DType::F32, vec![0u8; 24])
///     .to_bytes();
/// let f = GgufFile::from_bytes(Bytes::from_vec(bytes)).unwrap();
/// assert_eq!(f.architecture(), Some("llama"));
/// assert_eq!(f.tensor("w").unwrap().dims, vec![2, 3]);
/// ```
///
/// The writer writes what it is given without validating it, so tests can also build
/// malformed files: the tensor info records `data.len()`-based offsets whatever the dims say,
/// array elements are written as they are even if their type differs from the array's, and a
/// `general.alignment` key added with [`GgufWriter::kv`] is written verbatim (the layout then
/// still uses the [`GgufWriter::alignment`] value, 32 by default).
pub struct GgufWriter {
    version: u32,
    alignment: Option<u64>,
    kvs: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    /// An empty version-3 file with the default alignment (32).
    pub fn new() -> Self {
        Self {
            version: 3,
            alignment: None,
            kvs: Vec::new(),
            tensors: Vec::new(),
        }
    }

    /// Sets the header's version field (2 and 3 share the layout).
    pub fn version(mut self, version: u32) -> Self {
        self.version = version;
        self
    }

    /// Lays the data out with this alignment (must be a non-zero power of two for the result to
    /// be valid) and, unless a `general.alignment` key was added explicitly, records it as a
    /// `general.alignment` u32 key after the other metadata.
    pub fn alignment(mut self, alignment: u64) -> Self {
        self.alignment = Some(alignment);
        self
    }

    /// Appends a metadata key-value pair (in order; duplicates are written as given).
    pub fn kv(mut self, key: impl Into<String>, value: Value) -> Self {
        self.kvs.push((key.into(), value));
        self
    }

    /// Appends a tensor with `dims` in GGML `ne` order and its raw bytes.
    pub fn tensor(
        self,
        name: impl Into<String>,
        dims: &[u64],
        dtype: DType,
        data: Vec<u8>,
    ) -> Self {
        self.tensor_with_type_id(name, dims, dtype.ggml_id(), data)
    }

    /// Like [`GgufWriter::tensor`] with a raw GGML type id (to write types ferrum rejects).
    pub fn tensor_with_type_id(
        mut self,
        name: impl Into<String>,
        dims: &[u64],
        type_id: u32,
        data: Vec<u8>,
    ) -> Self {
        self.tensors.push(PendingTensor {
            name: name.into(),
            dims: dims.to_vec(),
            type_id,
            data,
        });
        self
    }

    fn layout_alignment(&self) -> u64 {
        self.alignment
            .filter(|&a| a > 0)
            .unwrap_or(DEFAULT_ALIGNMENT)
    }

    /// The file's bytes. Padding goes after the tensor infos and after every tensor's data
    /// (including the last, as llama.cpp's writers do).
    pub fn to_bytes(&self) -> Vec<u8> {
        let align = self.layout_alignment() as usize;
        let pad = |out: &mut Vec<u8>| {
            let rem = out.len() % align;
            if rem != 0 {
                out.resize(out.len() + align - rem, 0);
            }
        };
        let implicit_alignment_kv = match self.alignment {
            Some(a) if !self.kvs.iter().any(|(k, _)| k == ALIGNMENT_KEY) => {
                Some(u32::try_from(a).map(Value::U32).unwrap_or(Value::U64(a)))
            }
            _ => None,
        };

        let mut out = Vec::new();
        out.extend_from_slice(&MAGIC);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        let n_kv = self.kvs.len() + usize::from(implicit_alignment_kv.is_some());
        out.extend_from_slice(&(n_kv as u64).to_le_bytes());
        let implicit = implicit_alignment_kv.as_ref().map(|v| (ALIGNMENT_KEY, v));
        for (key, value) in self
            .kvs
            .iter()
            .map(|(k, v)| (k.as_str(), v))
            .chain(implicit)
        {
            write_str(&mut out, key);
            out.extend_from_slice(&value.value_type().id().to_le_bytes());
            write_value(&mut out, value);
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            write_str(&mut out, &t.name);
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.type_id.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            offset += (t.data.len() as u64).div_ceil(align as u64) * align as u64;
        }
        pad(&mut out);
        for t in &self.tensors {
            out.extend_from_slice(&t.data);
            pad(&mut out);
        }
        out
    }

    /// Writes [`GgufWriter::to_bytes`] to `path`.
    pub fn write(&self, path: &Path) -> Result<()> {
        std::fs::write(path, self.to_bytes()).map_err(|e| Error::io(path, e))
    }
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// A value's payload (without its type id).
fn write_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => write_str(out, s),
        Value::Array(elem, items) => {
            out.extend_from_slice(&elem.id().to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for item in items {
                write_value(out, item);
            }
        }
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
    }
}

/// Convenience: an array of strings.
pub fn str_array<S: AsRef<str>>(items: &[S]) -> Value {
    Value::Array(
        ValueType::String,
        items
            .iter()
            .map(|s| Value::String(s.as_ref().to_owned()))
            .collect(),
    )
}
