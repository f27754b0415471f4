//! Named regression cases for hostile or malformed GGUF files: each must give a precise
//! `Error::Parse { format: "GGUF", offset, msg }`.

use ferrum_gguf::{Bytes, DType, Error, GgufFile, GgufWriter, Value};

/// Parses `bytes`, expecting a parse error; returns (offset, message).
fn parse_err(bytes: Vec<u8>) -> (u64, String) {
    let len = bytes.len() as u64;
    match GgufFile::from_bytes(Bytes::from_vec(bytes)) {
        Err(Error::Parse {
            format,
            offset,
            msg,
        }) => {
            assert_eq!(format, "GGUF");
            assert!(offset <= len, "offset {offset} past the end ({len}): {msg}");
            (offset, msg)
        }
        Err(e) => panic!("expected a parse error, got {e}"),
        Ok(_) => panic!("expected a parse error, file parsed"),
    }
}

fn expect_err(bytes: Vec<u8>, offset: u64, needle: &str) {
    let (o, msg) = parse_err(bytes);
    assert!(msg.contains(needle), "message {msg:?} lacks {needle:?}");
    assert_eq!(o, offset, "offset of {msg:?}");
}

fn header(version: u32, n_tensors: u64, n_kv: u64) -> Vec<u8> {
    let mut v = b"GGUF".to_vec();
    v.extend_from_slice(&version.to_le_bytes());
    v.extend_from_slice(&n_tensors.to_le_bytes());
    v.extend_from_slice(&n_kv.to_le_bytes());
    v
}

fn push_str(v: &mut Vec<u8>, s: &[u8]) {
    v.extend_from_slice(&(s.len() as u64).to_le_bytes());
    v.extend_from_slice(s);
}

/// Header with one kv whose key is "k" and type id `ty`, followed by `payload` and padding.
fn one_kv(ty: u32, payload: &[u8]) -> Vec<u8> {
    let mut v = header(3, 0, 1);
    push_str(&mut v, b"k");
    v.extend_from_slice(&ty.to_le_bytes());
    v.extend_from_slice(payload);
    v.resize(v.len() + 64, 0);
    v
}

/// Offset of the first occurrence of `needle`.
fn find(hay: &[u8], needle: &[u8]) -> usize {
    hay.windows(needle.len())
        .position(|w| w == needle)
        .expect("needle not found")
}

fn put_u64(v: &mut [u8], at: usize, x: u64) {
    v[at..at + 8].copy_from_slice(&x.to_le_bytes());
}

/// Offset of the `offset` field of a 1-D or 2-D tensor named `name` (name must be unique in
/// the file's bytes).
fn offset_field(bytes: &[u8], name: &str, n_dims: usize) -> usize {
    find(bytes, name.as_bytes()) + name.len() + 4 + 8 * n_dims + 4
}

#[test]
fn not_a_gguf_file() {
    expect_err(
        b"hello, this is a text file\n".to_vec(),
        0,
        "not a GGUF file",
    );
    expect_err(b"{\"json\": true}".to_vec(), 0, "bad magic 0x7b226a73");
    expect_err(b"x".to_vec(), 0, "not a GGUF file");
    expect_err(vec![], 0, "empty file");
    expect_err(b"GGU".to_vec(), 3, "unexpected end of file");
    expect_err(
        b"GGUF\x03\x00".to_vec(),
        4,
        "unexpected end of file reading version",
    );
}

#[test]
fn versions() {
    expect_err(
        header(1, 0, 0),
        4,
        "unsupported GGUF version 1 (supported: 2, 3)",
    );
    expect_err(header(0, 0, 0), 4, "unsupported GGUF version 0");
    expect_err(header(4, 0, 0), 4, "unsupported GGUF version 4");
    expect_err(header(u32::MAX, 0, 0), 4, "unsupported GGUF version");
    // A big-endian v3 file's version reads as 0x03000000 on a little-endian machine.
    expect_err(
        header(3u32.swap_bytes(), 0, 0),
        4,
        "big-endian GGUF files are not supported",
    );
}

#[test]
fn huge_counts() {
    let mut v = header(3, u64::MAX, 0);
    v.resize(256, 0);
    expect_err(v, 8, "tensor count 18446744073709551615 cannot fit");
    let mut v = header(3, 0, 1 << 40);
    v.resize(256, 0);
    expect_err(v, 16, "metadata kv count 1099511627776 cannot fit");
    // Each count alone fits, both together do not.
    let mut v = header(3, 10, 10);
    v.resize(24 + 10 * 14 + 5 * 25, 0);
    expect_err(v, 8, "tensor count 10 cannot fit");
}

#[test]
fn huge_string_lengths() {
    let mut v = header(3, 0, 1);
    v.extend_from_slice(&u64::MAX.to_le_bytes());
    v.extend_from_slice(&[b'a'; 30]);
    let left = 30;
    expect_err(
        v,
        24,
        &format!("string length 18446744073709551615 exceeds the {left} bytes left"),
    );
    let mut payload = (1u64 << 40).to_le_bytes().to_vec();
    payload.extend_from_slice(b"abc");
    expect_err(
        one_kv(8, &payload),
        24 + 9 + 4,
        "string length 1099511627776 exceeds",
    );
}

#[test]
fn array_bombs() {
    // Huge element count of u8.
    let mut p = 0u32.to_le_bytes().to_vec();
    p.extend_from_slice(&u64::MAX.to_le_bytes());
    expect_err(
        one_kv(9, &p),
        24 + 9 + 4 + 4,
        "array of 18446744073709551615 u8 elements cannot fit",
    );
    // 2^40 nested arrays: each takes at least 12 bytes.
    let mut p = 9u32.to_le_bytes().to_vec();
    p.extend_from_slice(&(1u64 << 40).to_le_bytes());
    expect_err(
        one_kv(9, &p),
        24 + 9 + 4 + 4,
        "array of 1099511627776 array elements",
    );
    // Nesting deeper than MAX_ARRAY_DEPTH: array<array<array<array<array<u8>>>>>.
    let mut p = Vec::new();
    for _ in 0..4 {
        p.extend_from_slice(&9u32.to_le_bytes());
        p.extend_from_slice(&1u64.to_le_bytes());
    }
    let depth5_at = 24 + 9 + 4 + 4 * 12;
    p.extend_from_slice(&9u32.to_le_bytes());
    p.extend_from_slice(&1u64.to_le_bytes());
    p.extend_from_slice(&0u32.to_le_bytes());
    p.extend_from_slice(&0u64.to_le_bytes());
    expect_err(
        one_kv(9, &p),
        (depth5_at - 12) as u64,
        "nested deeper than 4",
    );
    // Unknown element type.
    let mut p = 13u32.to_le_bytes().to_vec();
    p.extend_from_slice(&0u64.to_le_bytes());
    expect_err(one_kv(9, &p), 37, "unknown array element type id 13");
}

#[test]
fn metadata_value_budget() {
    let n = ferrum_gguf::MAX_METADATA_VALUES;
    let mut p = 0u32.to_le_bytes().to_vec();
    p.extend_from_slice(&n.to_le_bytes()); // plus the kv itself: one value too many
    p.resize(p.len() + n as usize, 7);
    expect_err(one_kv(9, &p), 24 + 9 + 4 + 4, "more than 33554432 values");
}

#[test]
fn bad_scalar_values() {
    expect_err(one_kv(7, &[2]), 37, "bool value 2 is not 0 or 1");
    expect_err(one_kv(13, &[0; 8]), 33, "key 'k': unknown value type id 13");
    let mut p = 3u64.to_le_bytes().to_vec();
    p.extend_from_slice(&[b'a', 0xc3, 0x28]);
    expect_err(one_kv(8, &p), 46, "invalid UTF-8");
    let mut arr = 7u32.to_le_bytes().to_vec();
    arr.extend_from_slice(&2u64.to_le_bytes());
    arr.extend_from_slice(&[1, 9]);
    let (o, msg) = parse_err(one_kv(9, &arr));
    assert!(msg.contains("array element 1: bool value 9"), "{msg}");
    assert_eq!(o, 37 + 12 + 1);
}

#[test]
fn keys() {
    let w = GgufWriter::new()
        .kv("general.name", Value::String("a".into()))
        .kv("general.name", Value::String("b".into()));
    let bytes = w.to_bytes();
    let second = 24 + 8 + 12 + 4 + 8 + 1;
    expect_err(bytes, second as u64, "duplicate key 'general.name'");
    let bytes = GgufWriter::new().kv("", Value::U8(0)).to_bytes();
    expect_err(bytes, 24, "empty key");
    let mut v = header(3, 0, 1);
    push_str(&mut v, &[0xff, 0xfe]);
    v.resize(128, 0);
    expect_err(v, 32, "invalid UTF-8");
}

#[test]
fn alignment_values() {
    for (v, needle) in [
        (Value::U32(0), "is not a non-zero power of two"),
        (
            Value::U32(48),
            "general.alignment = 48 is not a non-zero power of two",
        ),
        (Value::I32(-32), "is not a non-zero power of two"),
        (
            Value::String("32".into()),
            "general.alignment has type str, expected an integer",
        ),
        (Value::F32(32.0), "has type f32"),
    ] {
        let bytes = GgufWriter::new().kv("general.alignment", v).to_bytes();
        expect_err(bytes, 24 + 8 + 17 + 4, needle);
    }
    // A huge power of two puts the data section past the end of the file.
    let bytes = GgufWriter::new()
        .kv("general.alignment", Value::U64(1 << 40))
        .to_bytes();
    let len = bytes.len() as u64;
    expect_err(bytes, len, "starts past the end of the file");
}

fn one_tensor(dims: &[u64], dtype: DType, n_bytes: usize) -> Vec<u8> {
    GgufWriter::new()
        .tensor("w", dims, dtype, vec![0; n_bytes])
        .to_bytes()
}

#[test]
fn tensor_shapes_and_types() {
    // Tensor info starts at 24: name len 8, "w" 1, n_dims 4, dims, type 4, offset 8.
    let mut v = one_tensor(&[4], DType::F32, 16);
    v[24 + 9..24 + 13].copy_from_slice(&5u32.to_le_bytes());
    expect_err(v, 33, "n_dims 5 exceeds the maximum of 4");

    let v = one_tensor(&[1 << 32, 1 << 32], DType::F32, 0);
    expect_err(v, 24 + 13 + 8, "element count overflows at dimension 1");
    let v = one_tensor(&[u64::MAX], DType::F32, 0);
    expect_err(
        v,
        37,
        "dimension 0 is 18446744073709551615 (negative as i64)",
    );
    // Fits i64 as elements but not as bytes.
    let v = one_tensor(&[1 << 61, 2], DType::F32, 0);
    expect_err(v, 24 + 13 + 16, "byte size");

    let v = one_tensor(&[33, 2], DType::Q4_0, 0);
    expect_err(
        v,
        53,
        "Q4_0 needs the first dimension to be a multiple of 32, got 33",
    );
    let v = one_tensor(&[], DType::Q8_0, 34);
    expect_err(v, 37, "multiple of 32, got 1");

    let v = GgufWriter::new()
        .tensor_with_type_id("blk.0.attn_q.weight", &[256], 40, vec![0; 144])
        .to_bytes();
    expect_err(
        v,
        24 + 8 + 19 + 4 + 8,
        "tensor 'blk.0.attn_q.weight': type id 40 (NVFP4) is not supported",
    );
    let v = GgufWriter::new()
        .tensor_with_type_id("x", &[1], 4, vec![0; 4])
        .to_bytes();
    expect_err(v, 45, "type id 4 (unknown) is not supported");
}

#[test]
fn tensor_names() {
    let v = GgufWriter::new()
        .tensor("a", &[1], DType::F32, vec![0; 4])
        .tensor("a", &[1], DType::F32, vec![0; 4])
        .to_bytes();
    let second = 24 + 8 + 1 + 4 + 8 + 4 + 8;
    expect_err(v, second, "duplicate tensor name 'a'");
    let v = GgufWriter::new()
        .tensor("", &[1], DType::F32, vec![0; 4])
        .to_bytes();
    expect_err(v, 24, "tensor name of 0 bytes");
    let long = "n".repeat(300);
    let v = GgufWriter::new()
        .tensor(long, &[1], DType::F32, vec![0; 4])
        .to_bytes();
    expect_err(v, 24, "tensor name of 300 bytes (must be 1..=256)");
    let ok = "n".repeat(256);
    let v = GgufWriter::new()
        .tensor(ok, &[1], DType::F32, vec![0; 4])
        .to_bytes();
    assert!(GgufFile::from_bytes(Bytes::from_vec(v)).is_ok());
}

#[test]
fn tensor_data_ranges() {
    let good = GgufWriter::new()
        .tensor("first", &[8], DType::F32, vec![1; 32])
        .tensor("second", &[8], DType::F32, vec![2; 32])
        .to_bytes();
    assert!(GgufFile::from_bytes(Bytes::from_vec(good.clone())).is_ok());
    let at = offset_field(&good, "second", 1);

    let mut v = good.clone();
    put_u64(&mut v, at, 33);
    expect_err(
        v,
        at as u64,
        "tensor 'second': data offset 33 is not a multiple of the alignment 32",
    );

    let mut v = good.clone();
    put_u64(&mut v, at, 0);
    expect_err(
        v,
        at as u64,
        "tensor 'first' data [0, 32) overlaps tensor 'second' data [0, 32)",
    );

    let mut v = good.clone();
    put_u64(&mut v, at, 64);
    expect_err(
        v,
        at as u64,
        "tensor 'second': data [64, 64+32) lies past the end of the file",
    );

    let mut v = good.clone();
    put_u64(&mut v, at, u64::MAX - 31);
    expect_err(v, at as u64, "lies past the end of the file");

    // Truncated data of the last tensor.
    let mut v = good.clone();
    v.truncate(v.len() - 1);
    expect_err(
        v,
        at as u64,
        "tensor 'second': data [32, 32+32) lies past the end of the file",
    );

    // Zero-sized tensors may share offsets.
    let v = GgufWriter::new()
        .tensor("e1", &[0], DType::F32, vec![])
        .tensor("e2", &[0, 3], DType::F32, vec![])
        .to_bytes();
    let f = GgufFile::from_bytes(Bytes::from_vec(v)).unwrap();
    assert!(f.tensor_bytes("e2").unwrap().is_empty());
}

#[test]
fn error_display_names_format_and_offset() {
    let e = GgufFile::from_bytes(Bytes::from_vec(b"not gguf".to_vec())).unwrap_err();
    let s = e.to_string();
    assert!(
        s.starts_with("GGUF parse error at byte 0: bad magic 0x6e6f7420"),
        "{s}"
    );
}
