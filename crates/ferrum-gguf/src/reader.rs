//! Parsing and validating a GGUF file: header, metadata, tensor infos, data-section bounds.
//!
//! Every check runs before the memory it guards is allocated: counts and lengths are compared
//! with the bytes left, so a hostile file can make the parser allocate at most a small multiple
//! of its own size (and [`MAX_METADATA_VALUES`] caps the decoded metadata outright).

use std::collections::HashMap;
use std::path::Path;

use ferrum_core::{Bytes, DType};

use crate::cursor::{parse_err, with_context, Cursor};
use crate::value::{Value, ValueType};
use crate::Result;

/// The four magic bytes every GGUF file starts with.
pub const MAGIC: [u8; 4] = *b"GGUF";
/// Alignment of the data section and tensor offsets when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// The metadata key that overrides [`DEFAULT_ALIGNMENT`].
pub const ALIGNMENT_KEY: &str = "general.alignment";
/// Most dimensions a tensor may have (GGML_MAX_DIMS).
pub const MAX_DIMS: usize = 4;
/// Longest accepted tensor name in bytes (llama.cpp's limit is 63; ferrum is more lenient).
pub const MAX_TENSOR_NAME_LEN: usize = 256;
/// Longest accepted metadata key in bytes (the spec's limit).
pub const MAX_KEY_LEN: usize = 65535;
/// Deepest accepted nesting of arrays (an array of scalars has depth 1).
pub const MAX_ARRAY_DEPTH: usize = 4;
/// Most metadata values (array elements included, at any depth) one file may hold. Real
/// vocabularies need a few million; this bounds the decoded size of a hostile file.
pub const MAX_METADATA_VALUES: u64 = 1 << 25;

/// Fewest bytes a key-value pair takes: key length, a 1-byte key, type id, a 1-byte value.
const MIN_KV_LEN: usize = 8 + 1 + 4 + 1;
/// Fewest bytes a tensor info takes: name length, a 1-byte name, n_dims, type id, offset.
const MIN_TENSOR_INFO_LEN: usize = 8 + 1 + 4 + 4 + 8;

/// One tensor's description from the file's tensor-info table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Tensor name, e.g. `blk.0.attn_q.weight`.
    pub name: String,
    /// Dimensions in GGML `ne` order: `dims[0]` is the fastest-varying (contiguous) axis, so a
    /// weight `[n_in, n_out]` is `n_out` rows of `n_in` elements.
    pub dims: Vec<u64>,
    /// Storage type.
    pub dtype: DType,
    /// Offset of the data from the start of the data section (a multiple of the alignment).
    pub offset: u64,
    /// Size of the data in bytes.
    pub n_bytes: u64,
}

impl TensorInfo {
    /// Number of elements (the product of `dims`; 1 for a 0-d tensor). Validated not to overflow.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A parsed GGUF file: header fields, metadata in file order, tensor infos, and the underlying
/// bytes (usually a memory map) from which [`GgufFile::tensor_data`] hands out zero-copy windows.
///
/// Tensor data ranges are checked to be aligned, inside the file and non-overlapping (llama.cpp
/// additionally requires them to be packed in file order; ferrum does not).
///
/// The public fields are for reading; the lookup indices are built once by the parser, so
/// changing `metadata` or `tensors` in place can make [`GgufFile::get`]/[`GgufFile::tensor`] miss.
#[derive(Clone)]
pub struct GgufFile {
    /// Format version (2 or 3; the layouts are identical for little-endian files).
    pub version: u32,
    /// Alignment of the data section and of every tensor offset.
    pub alignment: u64,
    /// Absolute file offset where the data section starts.
    pub data_offset: u64,
    /// Key-value metadata in file order; keys are unique.
    pub metadata: Vec<(String, Value)>,
    /// Tensor infos in file order; names are unique.
    pub tensors: Vec<TensorInfo>,
    bytes: Bytes,
    kv_index: HashMap<String, usize>,
    tensor_index: HashMap<String, usize>,
}

impl GgufFile {
    /// Memory-maps and parses the file at `path` ([`ferrum_core::Error::Io`] if it cannot be
    /// opened, [`ferrum_core::Error::Parse`] if it is not a valid GGUF file).
    pub fn open(path: &Path) -> Result<GgufFile> {
        Self::from_bytes(Bytes::map_file(path)?)
    }

    /// Parses and validates a GGUF file held in `bytes`.
    pub fn from_bytes(bytes: Bytes) -> Result<GgufFile> {
        parse(bytes)
    }

    /// The metadata value stored under `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        let &i = self.kv_index.get(key)?;
        // `get` rather than indexing: the fields are public and may have been changed.
        self.metadata
            .get(i)
            .filter(|(k, _)| k == key)
            .map(|(_, v)| v)
    }

    /// `get(key)` as a string.
    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }

    /// `get(key)` as a non-negative integer.
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(Value::as_u64)
    }

    /// `get(key)` as an `f32` (any numeric type).
    pub fn get_f32(&self, key: &str) -> Option<f32> {
        self.get(key).and_then(Value::as_f32)
    }

    /// `general.architecture`, e.g. `llama` or `gemma3`; model keys are prefixed with it.
    pub fn architecture(&self) -> Option<&str> {
        self.get_str("general.architecture")
    }

    /// The tensor info named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        let &i = self.tensor_index.get(name)?;
        self.tensors.get(i).filter(|t| t.name == name)
    }

    /// The tensor's data: a zero-copy window into the file's bytes. `t` should come from this
    /// file (its bounds were validated when parsing); for a `TensorInfo` whose range lies
    /// outside the file, an empty buffer is returned.
    pub fn tensor_data(&self, t: &TensorInfo) -> Bytes {
        let window = self
            .data_offset
            .checked_add(t.offset)
            .and_then(|start| usize::try_from(start).ok())
            .zip(usize::try_from(t.n_bytes).ok())
            .and_then(|(start, len)| self.bytes.slice(start, len).ok());
        window.unwrap_or_else(|| Bytes::from_vec(Vec::new()))
    }

    /// The data of the tensor named `name`.
    pub fn tensor_bytes(&self, name: &str) -> Option<Bytes> {
        self.tensor(name).map(|t| self.tensor_data(t))
    }

    /// Size of the whole file in bytes.
    pub fn file_size(&self) -> u64 {
        self.bytes.len() as u64
    }

    /// The whole file's bytes.
    pub fn bytes(&self) -> &Bytes {
        &self.bytes
    }
}

/// A summary (the full metadata can hold hundreds of thousands of strings).
impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("architecture", &self.architecture())
            .field("n_kv", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .field("alignment", &self.alignment)
            .field("data_offset", &self.data_offset)
            .field("file_size", &self.file_size())
            .finish()
    }
}

fn escape_bytes(b: &[u8]) -> String {
    b.iter()
        .flat_map(|&c| std::ascii::escape_default(c))
        .map(char::from)
        .collect()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|c| format!("{c:02x}")).collect()
}

/// Checks the magic and version; returns the version.
fn parse_magic_and_version(c: &mut Cursor) -> Result<u32> {
    let len = c.remaining();
    let head = c.take(len.min(4), "magic")?;
    if head.is_empty() {
        return Err(parse_err(0, "empty file (not a GGUF file)"));
    }
    if !MAGIC.starts_with(head) {
        return Err(parse_err(
            0,
            format!(
                "bad magic 0x{} \"{}\" (not a GGUF file)",
                hex(head),
                escape_bytes(head)
            ),
        ));
    }
    if head.len() < 4 {
        return Err(parse_err(
            len,
            format!("unexpected end of file in the magic: the file is only {len} bytes"),
        ));
    }
    let version = c.u32("version")?;
    if version != 0 && version & 0xFFFF == 0 {
        return Err(parse_err(
            4,
            format!(
                "version field 0x{version:08x} looks byte-swapped: big-endian GGUF files are not supported"
            ),
        ));
    }
    if version == 1 {
        return Err(parse_err(
            4,
            "unsupported GGUF version 1 (supported: 2, 3); v1 files are obsolete, re-convert the model",
        ));
    }
    if !(2..=3).contains(&version) {
        return Err(parse_err(
            4,
            format!("unsupported GGUF version {version} (supported: 2, 3)"),
        ));
    }
    Ok(version)
}

/// Parser state for the metadata section.
struct ValueReader<'c, 'a> {
    c: &'c mut Cursor<'a>,
    /// Values decoded so far (array elements included), checked against [`MAX_METADATA_VALUES`].
    n_values: u64,
}

impl ValueReader<'_, '_> {
    fn value(&mut self, ty: ValueType, depth: usize) -> Result<Value> {
        let c = &mut *self.c;
        Ok(match ty {
            ValueType::U8 => Value::U8(c.u8("u8 value")?),
            ValueType::I8 => Value::I8(c.u8("i8 value")? as i8),
            ValueType::U16 => Value::U16(c.u16("u16 value")?),
            ValueType::I16 => Value::I16(c.u16("i16 value")? as i16),
            ValueType::U32 => Value::U32(c.u32("u32 value")?),
            ValueType::I32 => Value::I32(c.u32("i32 value")? as i32),
            ValueType::F32 => Value::F32(f32::from_bits(c.u32("f32 value")?)),
            ValueType::U64 => Value::U64(c.u64("u64 value")?),
            ValueType::I64 => Value::I64(c.u64("i64 value")? as i64),
            ValueType::F64 => Value::F64(f64::from_bits(c.u64("f64 value")?)),
            ValueType::Bool => {
                let at = c.pos();
                match c.u8("bool value")? {
                    0 => Value::Bool(false),
                    1 => Value::Bool(true),
                    b => return Err(parse_err(at, format!("bool value {b} is not 0 or 1"))),
                }
            }
            ValueType::String => Value::String(c.string("string value")?),
            ValueType::Array => self.array(depth + 1)?,
        })
    }

    /// An array at nesting depth `depth` (1 for a top-level array).
    fn array(&mut self, depth: usize) -> Result<Value> {
        let at = self.c.pos();
        let type_id = self.c.u32("array element type")?;
        let elem = ValueType::from_id(type_id)
            .ok_or_else(|| parse_err(at, format!("unknown array element type id {type_id}")))?;
        if elem == ValueType::Array && depth >= MAX_ARRAY_DEPTH {
            return Err(parse_err(
                at,
                format!("arrays nested deeper than {MAX_ARRAY_DEPTH} levels"),
            ));
        }
        let count_at = self.c.pos();
        let count = self.c.u64("array length")?;
        let left = self.c.remaining();
        let max = (left / elem.min_encoded_size()) as u64;
        if count > max {
            return Err(parse_err(
                count_at,
                format!(
                    "array of {count} {elem} elements cannot fit in the {left} bytes left (at most {max})"
                ),
            ));
        }
        self.n_values = self.n_values.saturating_add(count);
        if self.n_values > MAX_METADATA_VALUES {
            return Err(parse_err(
                count_at,
                format!(
                    "metadata holds more than {MAX_METADATA_VALUES} values in total (array of {count})"
                ),
            ));
        }
        // `count` <= bytes left and <= MAX_METADATA_VALUES, so this allocation is bounded.
        let mut items = Vec::with_capacity(count as usize);
        for i in 0..count {
            let v = self
                .value(elem, depth)
                .map_err(|e| with_context(e, || format!("array element {i}")))?;
            items.push(v);
        }
        Ok(Value::Array(elem, items))
    }
}

/// The parsed metadata section.
struct Metadata {
    entries: Vec<(String, Value)>,
    index: HashMap<String, usize>,
    /// File offset of each entry's value, for error messages.
    value_offsets: Vec<usize>,
}

/// Reads the metadata section: `n_kv` key-value pairs.
fn parse_metadata(c: &mut Cursor, n_kv: u64) -> Result<Metadata> {
    // n_kv was checked against the bytes left, so these capacities are bounded by the file size.
    let n = n_kv as usize;
    let mut metadata = Vec::with_capacity(n);
    let mut index = HashMap::with_capacity(n);
    let mut value_offsets = Vec::with_capacity(n);
    let mut reader = ValueReader { c, n_values: 0 };
    for i in 0..n {
        let at = reader.c.pos();
        let key = reader
            .c
            .string("key")
            .map_err(|e| with_context(e, || format!("metadata entry {i}")))?;
        if key.is_empty() {
            return Err(parse_err(at, format!("metadata entry {i}: empty key")));
        }
        if key.len() > MAX_KEY_LEN {
            return Err(parse_err(
                at,
                format!(
                    "metadata entry {i}: key of {} bytes exceeds the limit of {MAX_KEY_LEN}",
                    key.len()
                ),
            ));
        }
        if index.contains_key(&key) {
            return Err(parse_err(at, format!("duplicate key '{key}'")));
        }
        let type_at = reader.c.pos();
        let ctx = |e| with_context(e, || format!("key '{key}'"));
        let type_id = reader.c.u32("value type").map_err(ctx)?;
        let ty = ValueType::from_id(type_id).ok_or_else(|| {
            parse_err(
                type_at,
                format!("key '{key}': unknown value type id {type_id}"),
            )
        })?;
        let value_at = reader.c.pos();
        reader.n_values = reader.n_values.saturating_add(1);
        let value = reader.value(ty, 0).map_err(ctx)?;
        index.insert(key.clone(), metadata.len());
        metadata.push((key, value));
        value_offsets.push(value_at);
    }
    Ok(Metadata {
        entries: metadata,
        index,
        value_offsets,
    })
}

/// The alignment from `general.alignment` (any integer type; a non-zero power of two).
fn alignment_of(value: Option<(&Value, usize)>) -> Result<u64> {
    let Some((v, at)) = value else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    let ty = v.value_type();
    if !ty.is_integer() {
        return Err(parse_err(
            at,
            format!("{ALIGNMENT_KEY} has type {ty}, expected an integer"),
        ));
    }
    match v.as_u64() {
        Some(a) if a.is_power_of_two() => Ok(a),
        _ => Err(parse_err(
            at,
            format!("{ALIGNMENT_KEY} = {v} is not a non-zero power of two"),
        )),
    }
}

/// A tensor info plus the file offsets needed for error messages.
struct RawTensor {
    info: TensorInfo,
    /// Where the info starts (its name).
    at: usize,
    /// Where its `offset` field is.
    offset_at: usize,
}

fn parse_tensor_info(c: &mut Cursor, names: &HashMap<String, usize>) -> Result<RawTensor> {
    let at = c.pos();
    let name = c.string("tensor name")?;
    if name.is_empty() || name.len() > MAX_TENSOR_NAME_LEN {
        return Err(parse_err(
            at,
            format!(
                "tensor name of {} bytes (must be 1..={MAX_TENSOR_NAME_LEN})",
                name.len()
            ),
        ));
    }
    if names.contains_key(&name) {
        return Err(parse_err(at, format!("duplicate tensor name '{name}'")));
    }
    let ctx = |e| with_context(e, || format!("tensor '{name}'"));
    let dims_at = c.pos();
    let n_dims = c.u32("n_dims").map_err(ctx)?;
    if n_dims as usize > MAX_DIMS {
        return Err(parse_err(
            dims_at,
            format!("tensor '{name}': n_dims {n_dims} exceeds the maximum of {MAX_DIMS}"),
        ));
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    let mut n_elements: i64 = 1;
    for d in 0..n_dims {
        let ne_at = c.pos();
        let ne = c.u64("dimension").map_err(ctx)?;
        let ne_i = i64::try_from(ne).map_err(|_| {
            parse_err(
                ne_at,
                format!("tensor '{name}': dimension {d} is {ne} (negative as i64)"),
            )
        })?;
        n_elements = n_elements.checked_mul(ne_i).ok_or_else(|| {
            parse_err(
                ne_at,
                format!("tensor '{name}': element count overflows at dimension {d} ({ne})"),
            )
        })?;
        dims.push(ne);
    }
    let type_at = c.pos();
    let type_id = c.u32("tensor type").map_err(ctx)?;
    let dtype = DType::from_ggml_id(type_id).ok_or_else(|| {
        parse_err(
            type_at,
            format!(
                "tensor '{name}': type id {type_id} ({}) is not supported",
                DType::ggml_name_of_id(type_id)
            ),
        )
    })?;
    let ne0 = dims.first().copied().unwrap_or(1);
    let bs = dtype.block_size() as u64;
    if ne0 % bs != 0 {
        return Err(parse_err(
            type_at,
            format!(
                "tensor '{name}': {dtype} needs the first dimension to be a multiple of {bs}, got {ne0}"
            ),
        ));
    }
    // n_elements >= 0 and ne0 % bs == 0, so n_elements is a whole number of blocks.
    let n_bytes = (n_elements as u64 / bs)
        .checked_mul(dtype.block_bytes() as u64)
        .filter(|&n| usize::try_from(n).is_ok())
        .ok_or_else(|| {
            parse_err(
                type_at,
                format!("tensor '{name}': byte size of {n_elements} {dtype} elements overflows"),
            )
        })?;
    let offset_at = c.pos();
    let offset = c.u64("tensor data offset").map_err(ctx)?;
    Ok(RawTensor {
        info: TensorInfo {
            name,
            dims,
            dtype,
            offset,
            n_bytes,
        },
        at,
        offset_at,
    })
}

/// Checks each tensor's data range: aligned, inside the data section, not overlapping another.
fn check_data_ranges(raw: &[RawTensor], alignment: u64, data_offset: u64, size: u64) -> Result<()> {
    let data_len = size - data_offset;
    for r in raw {
        let t = &r.info;
        if t.offset % alignment != 0 {
            return Err(parse_err(
                r.offset_at,
                format!(
                    "tensor '{}': data offset {} is not a multiple of the alignment {alignment}",
                    t.name, t.offset
                ),
            ));
        }
        match t.offset.checked_add(t.n_bytes) {
            Some(end) if end <= data_len => {}
            _ => {
                return Err(parse_err(
                    r.offset_at,
                    format!(
                        "tensor '{}': data [{}, {}+{}) lies past the end of the file (size {size}, data section {data_len} bytes from byte {data_offset})",
                        t.name, t.offset, t.offset, t.n_bytes
                    ),
                ))
            }
        }
    }
    let mut order: Vec<&RawTensor> = raw.iter().filter(|r| r.info.n_bytes > 0).collect();
    order.sort_by_key(|r| r.info.offset);
    for pair in order.windows(2) {
        let (a, b) = (&pair[0].info, &pair[1].info);
        // Both ends were checked not to overflow above.
        if a.offset + a.n_bytes > b.offset {
            let later = if pair[0].at > pair[1].at {
                pair[0]
            } else {
                pair[1]
            };
            return Err(parse_err(
                later.offset_at,
                format!(
                    "tensor '{}' data [{}, {}) overlaps tensor '{}' data [{}, {})",
                    a.name,
                    a.offset,
                    a.offset + a.n_bytes,
                    b.name,
                    b.offset,
                    b.offset + b.n_bytes
                ),
            ));
        }
    }
    Ok(())
}

fn parse(bytes: Bytes) -> Result<GgufFile> {
    let data: &[u8] = bytes.as_slice();
    let size = data.len() as u64;
    let mut c = Cursor::new(data);
    let version = parse_magic_and_version(&mut c)?;
    let n_tensors_at = c.pos();
    let n_tensors = c.u64("tensor count")?;
    let n_kv_at = c.pos();
    let n_kv = c.u64("metadata kv count")?;
    let left = c.remaining() as u64;
    if n_kv > left / MIN_KV_LEN as u64 {
        return Err(parse_err(
            n_kv_at,
            format!(
                "metadata kv count {n_kv} cannot fit in the {left} bytes left (at most {})",
                left / MIN_KV_LEN as u64
            ),
        ));
    }
    let min_tensors_len = n_tensors
        .checked_mul(MIN_TENSOR_INFO_LEN as u64)
        .and_then(|t| t.checked_add(n_kv * MIN_KV_LEN as u64));
    if min_tensors_len.is_none_or(|n| n > left) {
        return Err(parse_err(
            n_tensors_at,
            format!(
                "tensor count {n_tensors} cannot fit in the {left} bytes left (at most {})",
                (left - n_kv * MIN_KV_LEN as u64) / MIN_TENSOR_INFO_LEN as u64
            ),
        ));
    }

    let Metadata {
        entries: metadata,
        index: kv_index,
        value_offsets,
    } = parse_metadata(&mut c, n_kv)?;
    let alignment = alignment_of(
        kv_index
            .get(ALIGNMENT_KEY)
            .map(|&i| (&metadata[i].1, value_offsets[i])),
    )?;

    // Re-check the tensor count against what is actually left after the metadata.
    let left = c.remaining() as u64;
    if n_tensors > left / MIN_TENSOR_INFO_LEN as u64 {
        return Err(parse_err(
            n_tensors_at,
            format!(
                "tensor count {n_tensors} cannot fit in the {left} bytes left after the metadata (at most {})",
                left / MIN_TENSOR_INFO_LEN as u64
            ),
        ));
    }
    let n = n_tensors as usize;
    let mut raw = Vec::with_capacity(n);
    let mut tensor_index = HashMap::with_capacity(n);
    for i in 0..n {
        let r = parse_tensor_info(&mut c, &tensor_index)
            .map_err(|e| with_context(e, || format!("tensor info {i}")))?;
        tensor_index.insert(r.info.name.clone(), i);
        raw.push(r);
    }

    let end_of_infos = c.pos() as u64;
    let data_offset = end_of_infos
        .div_ceil(alignment)
        .checked_mul(alignment)
        .filter(|&d| d <= size)
        .ok_or_else(|| {
            parse_err(
                data.len(),
                format!(
                    "the data section (tensor infos end at byte {end_of_infos}, padded to a multiple of {alignment}) starts past the end of the file (size {size})"
                ),
            )
        })?;
    check_data_ranges(&raw, alignment, data_offset, size)?;

    Ok(GgufFile {
        version,
        alignment,
        data_offset,
        metadata,
        tensors: raw.into_iter().map(|r| r.info).collect(),
        bytes,
        kv_index,
        tensor_index,
    })
}
