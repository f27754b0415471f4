//! The safetensors container: reading (memory-mapped, zero-copy windows) and writing.
//!
//! Layout: `u64` little-endian header length `N`, `N` bytes of UTF-8 JSON, then the data section.
//! The JSON maps each tensor name to `{"dtype", "shape", "data_offsets": [begin, end]}` (offsets
//! relative to the data section, row-major with the last axis contiguous); the optional
//! `"__metadata__"` entry maps strings to strings. Every header field is checked against the file
//! before any tensor is handed out, so a truncated or corrupt file is an error, never a panic.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use ferrum_core::{Bytes, DType, Error, Result};
use serde_json::{json, Map, Value};

/// Headers larger than this are rejected as corrupt (real ones are a few hundred KiB).
const MAX_HEADER: u64 = 100 << 20;

/// One tensor's header entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorEntry {
    /// safetensors dtype name as written (`F32`, `BF16`, `I64`, ...).
    pub dtype: String,
    /// Shape, outermost axis first (PyTorch order).
    pub shape: Vec<usize>,
    /// Byte range within the data section.
    pub begin: usize,
    pub end: usize,
}

impl TensorEntry {
    /// The ferrum storage type, for the float types ferrum computes with.
    pub fn ferrum_dtype(&self) -> Option<DType> {
        dtype_from_name(&self.dtype)
    }
}

/// `F32`/`F16`/`BF16` to ferrum's type; other safetensors dtypes are not loadable weights.
pub fn dtype_from_name(name: &str) -> Option<DType> {
    match name {
        "F32" => Some(DType::F32),
        "F16" => Some(DType::F16),
        "BF16" => Some(DType::BF16),
        _ => None,
    }
}

/// The safetensors name of a ferrum float type.
pub fn dtype_name(d: DType) -> Option<&'static str> {
    match d {
        DType::F32 => Some("F32"),
        DType::F16 => Some("F16"),
        DType::BF16 => Some("BF16"),
        _ => None,
    }
}

/// Bytes per element of the dtypes the format defines (None: unknown to this reader).
fn element_size(name: &str) -> Option<usize> {
    Some(match name {
        "F64" | "I64" | "U64" => 8,
        "F32" | "I32" | "U32" => 4,
        "F16" | "BF16" | "I16" | "U16" => 2,
        "I8" | "U8" | "BOOL" | "F8_E4M3" | "F8_E5M2" | "F8_E8M0" => 1,
        _ => return None,
    })
}

/// An opened `.safetensors` file.
pub struct SafetensorsFile {
    path: PathBuf,
    /// The data section (everything after the header).
    data: Bytes,
    tensors: BTreeMap<String, TensorEntry>,
    metadata: BTreeMap<String, String>,
}

impl std::fmt::Debug for SafetensorsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SafetensorsFile")
            .field("path", &self.path)
            .field("tensors", &self.tensors.len())
            .finish_non_exhaustive()
    }
}

impl SafetensorsFile {
    /// Memory-maps and validates a file.
    pub fn open(path: &Path) -> Result<Self> {
        Self::from_bytes(Bytes::map_file(path)?, path)
    }

    /// Validates an in-memory file; `path` only names it in errors.
    pub fn from_bytes(bytes: Bytes, path: &Path) -> Result<Self> {
        let err = |offset: u64, msg: String| Error::Parse {
            format: "safetensors",
            offset,
            msg: format!("{}: {msg}", path.display()),
        };
        let total = bytes.len() as u64;
        if total < 8 {
            return Err(err(
                0,
                format!("file of {total} bytes is too short for the 8-byte header length"),
            ));
        }
        let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
        if n > MAX_HEADER || n > total - 8 {
            return Err(err(
                0,
                format!("header length {n} exceeds the file ({total} bytes): truncated or not safetensors"),
            ));
        }
        let header_end = 8 + n as usize;
        let text = std::str::from_utf8(&bytes[8..header_end])
            .map_err(|e| err(8, format!("header is not UTF-8: {e}")))?;
        let header: Value =
            serde_json::from_str(text).map_err(|e| err(8, format!("header is not JSON: {e}")))?;
        let header = header
            .as_object()
            .ok_or_else(|| err(8, "header is not a JSON object".into()))?;
        let data = bytes.slice(header_end, bytes.len() - header_end)?;
        let mut tensors = BTreeMap::new();
        let mut metadata = BTreeMap::new();
        for (name, entry) in header {
            if name == "__metadata__" {
                let m = entry
                    .as_object()
                    .ok_or_else(|| err(8, "__metadata__ is not an object".into()))?;
                for (k, v) in m {
                    let v = v.as_str().ok_or_else(|| {
                        err(8, format!("__metadata__ value of '{k}' is not a string"))
                    })?;
                    metadata.insert(k.clone(), v.to_string());
                }
                continue;
            }
            let e = parse_entry(entry, data.len())
                .map_err(|m| err(8, format!("tensor '{name}': {m}")))?;
            tensors.insert(name.clone(), e);
        }
        Ok(Self {
            path: path.to_path_buf(),
            data,
            tensors,
            metadata,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tensor names, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.tensors.keys().map(String::as_str)
    }

    pub fn get(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.get(name)
    }

    /// The `__metadata__` strings.
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// The bytes of a tensor of this file (a window into the map, no copy).
    pub fn data(&self, e: &TensorEntry) -> Result<Bytes> {
        self.data.slice(e.begin, e.end - e.begin)
    }
}

/// Checks one header entry against the data section length.
fn parse_entry(v: &Value, data_len: usize) -> std::result::Result<TensorEntry, String> {
    let o = v.as_object().ok_or("entry is not an object")?;
    let dtype = o
        .get("dtype")
        .and_then(Value::as_str)
        .ok_or("no dtype string")?
        .to_string();
    let shape = o
        .get("shape")
        .and_then(Value::as_array)
        .ok_or("no shape list")?
        .iter()
        .map(|d| {
            d.as_u64()
                .and_then(|d| usize::try_from(d).ok())
                .ok_or("shape entries must be non-negative integers")
        })
        .collect::<std::result::Result<Vec<usize>, _>>()?;
    let offs = o
        .get("data_offsets")
        .and_then(Value::as_array)
        .ok_or("no data_offsets list")?;
    let off = |i: usize| {
        offs.get(i)
            .and_then(Value::as_u64)
            .and_then(|x| usize::try_from(x).ok())
    };
    let (Some(begin), Some(end), 2) = (off(0), off(1), offs.len()) else {
        return Err("data_offsets must be two non-negative integers".into());
    };
    if begin > end || end > data_len {
        return Err(format!(
            "data_offsets [{begin}, {end}] fall outside the data section of {data_len} bytes (truncated file?)"
        ));
    }
    if let Some(size) = element_size(&dtype) {
        let n = shape
            .iter()
            .try_fold(size, |acc, &d| acc.checked_mul(d))
            .ok_or("shape overflows")?;
        if n != end - begin {
            return Err(format!(
                "shape {shape:?} of {dtype} needs {n} bytes but data_offsets span {}",
                end - begin
            ));
        }
    }
    Ok(TensorEntry {
        dtype,
        shape,
        begin,
        end,
    })
}

/// A tensor to write: PyTorch-order shape, raw little-endian bytes.
#[derive(Clone, Copy, Debug)]
pub struct TensorData<'a> {
    pub name: &'a str,
    pub dtype: DType,
    pub shape: &'a [usize],
    pub data: &'a [u8],
}

/// Writes a `.safetensors` file (tensors in the given order; the header padded to 8 bytes).
pub fn write(
    path: &Path,
    tensors: &[TensorData],
    metadata: &BTreeMap<String, String>,
) -> Result<()> {
    let mut header = Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".into(), json!(metadata));
    }
    let mut offset = 0usize;
    for t in tensors {
        let name = dtype_name(t.dtype).ok_or_else(|| {
            Error::Unsupported(format!("writing {} tensors to safetensors", t.dtype))
        })?;
        let want = t.shape.iter().product::<usize>() * t.dtype.row_bytes(1).unwrap_or(0);
        if want != t.data.len() {
            return Err(Error::Shape(format!(
                "tensor '{}': shape {:?} needs {want} bytes, got {}",
                t.name,
                t.shape,
                t.data.len()
            )));
        }
        if header.contains_key(t.name) {
            return Err(Error::msg(format!("tensor '{}' written twice", t.name)));
        }
        let end = offset + t.data.len();
        header.insert(
            t.name.to_string(),
            json!({"dtype": name, "shape": t.shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut text =
        serde_json::to_string(&Value::Object(header)).map_err(|e| Error::msg(e.to_string()))?;
    while text.len() % 8 != 0 {
        text.push(' ');
    }
    let file = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
    let mut w = std::io::BufWriter::with_capacity(1 << 20, file);
    let io = |e| Error::io(path, e);
    w.write_all(&(text.len() as u64).to_le_bytes())
        .map_err(io)?;
    w.write_all(text.as_bytes()).map_err(io)?;
    for t in tensors {
        w.write_all(t.data).map_err(io)?;
    }
    w.flush().map_err(io)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_bytes(header: &str, data: &[u8]) -> Vec<u8> {
        let mut v = (header.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(header.as_bytes());
        v.extend_from_slice(data);
        v
    }

    fn open(bytes: Vec<u8>) -> Result<SafetensorsFile> {
        SafetensorsFile::from_bytes(Bytes::from_vec(bytes), Path::new("t.safetensors"))
    }

    #[test]
    fn write_then_read() {
        let dir = std::env::temp_dir().join(format!("ferrum-st-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.safetensors");
        let a: Vec<u8> = [1f32, 2.0, 3.0, 4.0, 5.0, 6.0]
            .iter()
            .flat_map(|x| x.to_le_bytes())
            .collect();
        let b = vec![0u8, 0x3c, 0, 0x40]; // f16 1.0, 2.0
        let meta = BTreeMap::from([("format".to_string(), "pt".to_string())]);
        let ts = [
            TensorData {
                name: "a",
                dtype: DType::F32,
                shape: &[2, 3],
                data: &a,
            },
            TensorData {
                name: "b",
                dtype: DType::F16,
                shape: &[2],
                data: &b,
            },
        ];
        write(&p, &ts, &meta).unwrap();
        let f = SafetensorsFile::open(&p).unwrap();
        assert_eq!(f.names().collect::<Vec<_>>(), ["a", "b"]);
        assert_eq!(f.metadata(), &meta);
        let e = f.get("a").unwrap();
        assert_eq!(
            (e.shape.as_slice(), e.ferrum_dtype()),
            (&[2usize, 3][..], Some(DType::F32))
        );
        assert_eq!(&*f.data(e).unwrap(), &a[..]);
        assert_eq!(&*f.data(f.get("b").unwrap()).unwrap(), &b[..]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_files_are_errors() {
        let ok = r#"{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#;
        assert!(open(file_bytes(ok, &[0; 8])).is_ok());
        let msg = |b: Vec<u8>| open(b).unwrap_err().to_string();
        assert!(msg(vec![1, 2, 3]).contains("too short"));
        assert!(msg(file_bytes(ok, &[0; 8])[..20].to_vec()).contains("exceeds the file"));
        assert!(msg(file_bytes(ok, &[0; 4])).contains("outside the data section"));
        assert!(msg(file_bytes("not json", &[])).contains("not JSON"));
        assert!(msg(file_bytes("[]", &[])).contains("not a JSON object"));
        let wrong = r#"{"w":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#;
        assert!(msg(file_bytes(wrong, &[0; 8])).contains("needs 12 bytes"));
        let neg = r#"{"w":{"dtype":"F32","shape":[-1],"data_offsets":[0,8]}}"#;
        assert!(msg(file_bytes(neg, &[0; 8])).contains("non-negative"));
        let huge = r#"{"w":{"dtype":"F32","shape":[4611686018427387904, 8],"data_offsets":[0,8]}}"#;
        assert!(msg(file_bytes(huge, &[0; 8])).contains("overflows"));
        let mut big = vec![0xff; 8];
        big.extend_from_slice(b"{}");
        assert!(msg(big).contains("exceeds the file"));
    }
}
