//! Tensor and value codecs: `TensorProto` (raw, typed fields, external data, packed small
//! types) to [`Tensor`] and back, and the test-data containers (SequenceProto, OptionalProto).
//! Element counts are checked against the bytes that carry them before anything is allocated.

use std::path::{Component, Path};

use half::{bf16, f16};

use crate::ir::ValueType;
use crate::onnx::MAX_ELEMENTS;
use crate::proto::{self, TensorProto};
use crate::tensor::{numel, DType, Data, Tensor, Value};
use crate::{Error, Result};

fn bad(msg: impl Into<String>) -> Error {
    Error::Format(msg.into())
}

pub(crate) fn dims_of(dims: &[i64]) -> Result<Vec<usize>> {
    let mut shape = Vec::with_capacity(dims.len().min(64));
    for &d in dims {
        if d < 0 {
            return Err(bad(format!("negative dimension {d}")));
        }
        shape.push(d as usize);
    }
    Ok(shape)
}

/// Decodes a `TensorProto` (raw_data, typed fields or external data under `dir`).
pub fn tensor_from_proto(t: &TensorProto, dir: Option<&Path>) -> Result<Tensor> {
    let dt = DType::from_onnx(t.data_type)
        .ok_or_else(|| Error::UnsupportedType(DType::onnx_name(t.data_type)))?;
    let shape = dims_of(&t.dims)?;
    let n = numel(&shape)
        .filter(|&n| n <= MAX_ELEMENTS)
        .ok_or_else(|| bad(format!("tensor '{}' has absurd dims {:?}", t.name, t.dims)))?;
    let nbytes = if dt.is_small() {
        crate::small::packed_len(dt, n)
    } else {
        n.checked_mul(dt.size())
            .ok_or_else(|| bad("tensor too large"))?
    };
    let external;
    let raw: Option<&[u8]> = if t.data_location == 1 {
        external = read_external(t, dir, nbytes)?;
        Some(&external)
    } else if !t.raw_data.is_empty() || (n == 0 && dt != DType::Str) {
        Some(&t.raw_data)
    } else {
        None
    };
    let data = match raw {
        Some(raw) if dt.is_small() => {
            if raw.len() != nbytes {
                return Err(bad(format!(
                    "tensor '{}' of shape {:?} {dt} needs {nbytes} bytes, raw_data has {}",
                    t.name,
                    shape,
                    raw.len()
                )));
            }
            Data::Code(dt, crate::small::unpack(dt, raw, n))
        }
        None if dt.is_small() => {
            // int32_data: one entry per packed byte (4- and 2-bit), per element otherwise.
            let entries = if matches!(crate::small::bits(dt), 4 | 2) {
                nbytes
            } else {
                n
            };
            if t.int32_data.len() != entries {
                return Err(bad(format!(
                    "tensor '{}' of shape {:?} {dt} has {} values, expected {entries}",
                    t.name,
                    t.dims,
                    t.int32_data.len()
                )));
            }
            let bytes: Vec<u8> = t.int32_data.iter().map(|&x| x as u8).collect();
            if entries == n {
                Data::Code(dt, bytes)
            } else {
                Data::Code(dt, crate::small::unpack(dt, &bytes, n))
            }
        }
        Some(raw) if dt != DType::Str => {
            if raw.len() != n * dt.size() {
                return Err(bad(format!(
                    "tensor '{}' of shape {:?} {dt} needs {} bytes, raw_data has {}",
                    t.name,
                    shape,
                    n * dt.size(),
                    raw.len()
                )));
            }
            decode_raw(dt, raw)
        }
        _ => decode_typed(t, dt, n)?,
    };
    Tensor::new(shape, data)
}

fn decode_raw(dt: DType, raw: &[u8]) -> Data {
    macro_rules! le {
        ($t:ty, $n:expr) => {
            raw.chunks_exact($n)
                .map(|c| <$t>::from_le_bytes(c.try_into().expect("chunk size")))
                .collect()
        };
    }
    match dt {
        DType::F32 => Data::F32(le!(f32, 4)),
        DType::F64 => Data::F64(le!(f64, 8)),
        DType::F16 => Data::F16(
            raw.chunks_exact(2)
                .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
        ),
        DType::BF16 => Data::BF16(
            raw.chunks_exact(2)
                .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])))
                .collect(),
        ),
        DType::I8 => Data::I8(raw.iter().map(|&b| b as i8).collect()),
        DType::U8 => Data::U8(raw.to_vec().into()),
        DType::I16 => Data::I16(le!(i16, 2)),
        DType::U16 => Data::U16(le!(u16, 2)),
        DType::I32 => Data::I32(le!(i32, 4)),
        DType::U32 => Data::U32(le!(u32, 4)),
        DType::I64 => Data::I64(le!(i64, 8)),
        DType::U64 => Data::U64(le!(u64, 8)),
        DType::Bool => Data::Bool(raw.iter().map(|&b| b != 0).collect()),
        DType::Str => Data::Str(Vec::new()),
        _ => Data::Code(dt, raw.to_vec()),
    }
}

fn decode_typed(t: &TensorProto, dt: DType, n: usize) -> Result<Data> {
    let len = match dt {
        DType::F32 => t.float_data.len(),
        DType::F64 => t.double_data.len(),
        DType::I64 => t.int64_data.len(),
        DType::U32 | DType::U64 => t.uint64_data.len(),
        DType::Str => t.string_data.len(),
        _ => t.int32_data.len(),
    };
    if len != n {
        return Err(bad(format!(
            "tensor '{}' of shape {:?} {dt} has {len} values, expected {n}",
            t.name, t.dims
        )));
    }
    let i32s = &t.int32_data;
    Ok(match dt {
        DType::F32 => Data::F32(t.float_data.clone().into()),
        DType::F64 => Data::F64(t.double_data.clone().into()),
        DType::I64 => Data::I64(t.int64_data.clone().into()),
        DType::U64 => Data::U64(t.uint64_data.clone().into()),
        DType::U32 => Data::U32(t.uint64_data.iter().map(|&x| x as u32).collect()),
        DType::I32 => Data::I32(i32s.clone().into()),
        DType::I16 => Data::I16(i32s.iter().map(|&x| x as i16).collect()),
        DType::I8 => Data::I8(i32s.iter().map(|&x| x as i8).collect()),
        DType::U16 => Data::U16(i32s.iter().map(|&x| x as u16).collect()),
        DType::U8 => Data::U8(i32s.iter().map(|&x| x as u8).collect()),
        DType::Bool => Data::Bool(i32s.iter().map(|&x| x != 0).collect()),
        DType::F16 => Data::F16(i32s.iter().map(|&x| f16::from_bits(x as u16)).collect()),
        DType::BF16 => Data::BF16(i32s.iter().map(|&x| bf16::from_bits(x as u16)).collect()),
        DType::Str => Data::Str(
            t.string_data
                .iter()
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect(),
        ),
        _ => Data::Code(dt, i32s.iter().map(|&x| x as u8).collect()),
    })
}

/// Reads an external-data tensor's bytes, refusing locations outside `dir`.
fn read_external(t: &TensorProto, dir: Option<&Path>, expected: usize) -> Result<Vec<u8>> {
    let dir = dir.ok_or_else(|| {
        bad(format!(
            "tensor '{}' uses external data but the model has no folder",
            t.name
        ))
    })?;
    let mut location = None;
    let (mut offset, mut length) = (0u64, None);
    for kv in &t.external_data {
        match kv.key.as_str() {
            "location" => location = Some(kv.value.clone()),
            "offset" => {
                offset = kv
                    .value
                    .parse()
                    .map_err(|_| bad(format!("bad external offset '{}'", kv.value)))?
            }
            "length" => {
                length = Some(
                    kv.value
                        .parse::<u64>()
                        .map_err(|_| bad(format!("bad external length '{}'", kv.value)))?,
                )
            }
            _ => {}
        }
    }
    let loc = location.ok_or_else(|| {
        bad(format!(
            "tensor '{}': external data without a location",
            t.name
        ))
    })?;
    let rel = Path::new(&loc);
    if loc.is_empty()
        || rel.is_absolute()
        || rel
            .components()
            .any(|c| !matches!(c, Component::Normal(_) | Component::CurDir))
    {
        return Err(bad(format!(
            "tensor '{}': external data location '{loc}' escapes the model folder",
            t.name
        )));
    }
    let path = dir.join(rel);
    let io = |err| Error::Io {
        path: path.clone(),
        err,
    };
    let canon_dir = dir.canonicalize().map_err(|err| Error::Io {
        path: dir.to_path_buf(),
        err,
    })?;
    let meta = std::fs::symlink_metadata(&path).map_err(io)?;
    if !meta.is_file() {
        return Err(bad(format!(
            "tensor '{}': external data '{loc}' is not a regular file",
            t.name
        )));
    }
    let canon = path.canonicalize().map_err(io)?;
    if !canon.starts_with(&canon_dir) {
        return Err(bad(format!(
            "tensor '{}': external data '{loc}' escapes the model folder",
            t.name
        )));
    }
    let size = meta.len();
    let length = length.unwrap_or(size.saturating_sub(offset));
    if offset.checked_add(length).is_none_or(|end| end > size) {
        return Err(bad(format!(
            "tensor '{}': external data range {offset}+{length} is beyond '{loc}' ({size} bytes)",
            t.name
        )));
    }
    if length != expected as u64 {
        return Err(bad(format!(
            "tensor '{}': external data has {length} bytes, the shape needs {expected}",
            t.name
        )));
    }
    use std::io::{Read, Seek, SeekFrom};
    let mut f = std::fs::File::open(&path).map_err(io)?;
    f.seek(SeekFrom::Start(offset)).map_err(io)?;
    let mut buf = vec![0u8; expected];
    f.read_exact(&mut buf).map_err(io)?;
    Ok(buf)
}

/// Encodes a tensor as a `TensorProto` (raw_data; strings in string_data).
pub fn tensor_to_proto(t: &Tensor, name: &str) -> TensorProto {
    let mut p = TensorProto {
        dims: t.shape().iter().map(|&d| d as i64).collect(),
        data_type: t.dtype().onnx(),
        name: name.to_string(),
        ..Default::default()
    };
    let mut raw = Vec::with_capacity(t.len() * t.dtype().size());
    match t.data() {
        Data::F32(v) => v
            .iter()
            .for_each(|x| raw.extend_from_slice(&x.to_le_bytes())),
        Data::F64(v) => v
            .iter()
            .for_each(|x| raw.extend_from_slice(&x.to_le_bytes())),
        Data::F16(v) => v
            .iter()
            .for_each(|x| raw.extend_from_slice(&x.to_bits().to_le_bytes())),
        Data::BF16(v) => v
            .iter()
            .for_each(|x| raw.extend_from_slice(&x.to_bits().to_le_bytes())),
        Data::I8(v) => v.iter().for_each(|x| raw.push(*x as u8)),
        Data::U8(v) => raw.extend_from_slice(v),
        Data::I16(v) => v
            .iter()
            .for_each(|x| raw.extend_from_slice(&x.to_le_bytes())),
        Data::U16(v) => v
            .iter()
            .for_each(|x| raw.extend_from_slice(&x.to_le_bytes())),
        Data::I32(v) => v
            .iter()
            .for_each(|x| raw.extend_from_slice(&x.to_le_bytes())),
        Data::U32(v) => v
            .iter()
            .for_each(|x| raw.extend_from_slice(&x.to_le_bytes())),
        Data::I64(v) => v
            .iter()
            .for_each(|x| raw.extend_from_slice(&x.to_le_bytes())),
        Data::U64(v) => v
            .iter()
            .for_each(|x| raw.extend_from_slice(&x.to_le_bytes())),
        Data::Bool(v) => v.iter().for_each(|x| raw.push(*x as u8)),
        Data::Str(v) => p.string_data = v.iter().map(|s| s.as_bytes().to_vec()).collect(),
        Data::Code(dt, v) => raw = crate::small::pack(*dt, v),
    }
    p.raw_data = raw.into();
    p
}

/// Encodes a value as the message ONNX test data uses for its kind.
pub fn value_to_bytes(v: &Value, name: &str) -> Vec<u8> {
    use prost::Message;
    match v {
        Value::Tensor(t) => tensor_to_proto(t, name).encode_to_vec(),
        Value::Sequence(_) => sequence_proto(v, name).encode_to_vec(),
        Value::Optional(_) => optional_proto(v, name).encode_to_vec(),
    }
}

fn sequence_proto(v: &Value, name: &str) -> proto::SequenceProto {
    let Value::Sequence(ts) = v else {
        unreachable!("called on sequences")
    };
    proto::SequenceProto {
        name: name.to_string(),
        elem_type: 1,
        tensor_values: ts.iter().map(|t| tensor_to_proto(t, "")).collect(),
        ..Default::default()
    }
}

fn optional_proto(v: &Value, name: &str) -> proto::OptionalProto {
    let mut p = proto::OptionalProto {
        name: name.to_string(),
        ..Default::default()
    };
    if let Value::Optional(Some(inner)) = v {
        match inner.as_ref() {
            Value::Tensor(t) => {
                p.elem_type = 1;
                p.tensor_value = Some(tensor_to_proto(t, ""));
            }
            s @ Value::Sequence(_) => {
                p.elem_type = 3;
                p.sequence_value = Some(Box::new(sequence_proto(s, "")));
            }
            o @ Value::Optional(_) => {
                p.elem_type = 5;
                p.optional_value = Some(Box::new(optional_proto(o, "")));
            }
        }
    }
    p
}

/// Decodes test data for a value of type `ty` (TensorProto, SequenceProto or OptionalProto).
pub fn value_from_bytes(bytes: &[u8], ty: &ValueType) -> Result<Value> {
    match ty {
        ValueType::Sequence(_) => {
            let s: proto::SequenceProto = proto::decode(bytes, "sequence")?;
            seq_value(&s)
        }
        ValueType::Optional(_) => {
            let o: proto::OptionalProto = proto::decode(bytes, "optional")?;
            opt_value(&o)
        }
        _ => {
            let t: TensorProto = proto::decode(bytes, "tensor")?;
            Ok(Value::Tensor(tensor_from_proto(&t, None)?))
        }
    }
}

fn seq_value(s: &proto::SequenceProto) -> Result<Value> {
    if !s.sequence_values.is_empty() || !s.optional_values.is_empty() {
        return Err(Error::UnsupportedType(
            "sequence of sequences or optionals".into(),
        ));
    }
    Ok(Value::Sequence(
        s.tensor_values
            .iter()
            .map(|t| tensor_from_proto(t, None))
            .collect::<Result<_>>()?,
    ))
}

fn opt_value(o: &proto::OptionalProto) -> Result<Value> {
    Ok(Value::Optional(match o.elem_type {
        0 => None,
        1 => Some(Box::new(Value::Tensor(tensor_from_proto(
            o.tensor_value
                .as_ref()
                .ok_or_else(|| bad("optional tensor without a value"))?,
            None,
        )?))),
        3 => Some(Box::new(seq_value(
            o.sequence_value
                .as_deref()
                .ok_or_else(|| bad("optional sequence without a value"))?,
        )?)),
        5 => Some(Box::new(opt_value(
            o.optional_value
                .as_deref()
                .ok_or_else(|| bad("optional without a value"))?,
        )?)),
        e => {
            return Err(Error::UnsupportedType(format!(
                "optional of element kind {e}"
            )))
        }
    }))
}
