//! GgufWriter -> GgufFile round trips.

use ferrum_gguf::{str_array, Bytes, DType, Error, GgufFile, GgufWriter, Value, ValueType};

fn every_value_type() -> Vec<(String, Value)> {
    let nested = Value::Array(
        ValueType::Array,
        vec![
            Value::Array(ValueType::U8, vec![Value::U8(1), Value::U8(2)]),
            Value::Array(ValueType::U8, vec![]),
            Value::Array(ValueType::U8, vec![Value::U8(255)]),
        ],
    );
    let deep = Value::Array(
        ValueType::Array,
        vec![Value::Array(
            ValueType::Array,
            vec![Value::Array(
                ValueType::Array,
                vec![Value::Array(
                    ValueType::String,
                    vec![Value::String("deep".into())],
                )],
            )],
        )],
    );
    vec![
        ("a.u8".into(), Value::U8(200)),
        ("a.i8".into(), Value::I8(-100)),
        ("a.u16".into(), Value::U16(65000)),
        ("a.i16".into(), Value::I16(-32000)),
        ("a.u32".into(), Value::U32(4_000_000_000)),
        ("a.i32".into(), Value::I32(-2_000_000_000)),
        ("a.f32".into(), Value::F32(-1.5e-7)),
        ("a.bool_t".into(), Value::Bool(true)),
        ("a.bool_f".into(), Value::Bool(false)),
        ("a.str".into(), Value::String("héllo ✓ \u{0} end".into())),
        ("a.empty_str".into(), Value::String(String::new())),
        ("a.u64".into(), Value::U64(u64::MAX)),
        ("a.i64".into(), Value::I64(i64::MIN)),
        ("a.f64".into(), Value::F64(std::f64::consts::PI)),
        ("a.f32_inf".into(), Value::F32(f32::INFINITY)),
        ("arr.str".into(), str_array(&["<unk>", "Ġ t", ""])),
        (
            "arr.f32".into(),
            Value::Array(ValueType::F32, vec![Value::F32(0.5), Value::F32(-2.0)]),
        ),
        (
            "arr.i32".into(),
            Value::Array(ValueType::I32, vec![Value::I32(1), Value::I32(-6)]),
        ),
        (
            "arr.bool".into(),
            Value::Array(ValueType::Bool, vec![Value::Bool(true), Value::Bool(false)]),
        ),
        (
            "arr.u64".into(),
            Value::Array(ValueType::U64, vec![Value::U64(1 << 40)]),
        ),
        ("arr.empty".into(), Value::Array(ValueType::F64, vec![])),
        ("arr.nested".into(), nested),
        ("arr.deep".into(), deep),
    ]
}

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// (name, dims, dtype, bytes)
fn some_tensors() -> Vec<(String, Vec<u64>, DType, Vec<u8>)> {
    vec![
        ("f32".into(), vec![4, 3], DType::F32, pattern(48, 1)),
        ("f16".into(), vec![8], DType::F16, pattern(16, 2)),
        ("bf16.3d".into(), vec![2, 2, 2], DType::BF16, pattern(16, 3)),
        (
            "q4_0".into(),
            vec![64, 2],
            DType::Q4_0,
            pattern(2 * 2 * 18, 4),
        ),
        (
            "q8_0".into(),
            vec![32, 1, 1, 3],
            DType::Q8_0,
            pattern(3 * 34, 5),
        ),
        ("q4_k".into(), vec![256, 1], DType::Q4_K, pattern(144, 6)),
        ("q6_k".into(), vec![512], DType::Q6_K, pattern(2 * 210, 7)),
        ("scalar".into(), vec![], DType::F32, pattern(4, 8)),
        ("empty".into(), vec![0, 5], DType::F32, vec![]),
        ("q5_0".into(), vec![32, 2], DType::Q5_0, pattern(44, 9)),
    ]
}

fn build(version: u32, alignment: Option<u64>) -> Vec<u8> {
    let mut w = GgufWriter::new().version(version);
    if let Some(a) = alignment {
        w = w.alignment(a);
    }
    for (k, v) in every_value_type() {
        w = w.kv(k, v);
    }
    for (name, dims, dtype, data) in some_tensors() {
        w = w.tensor(name, &dims, dtype, data);
    }
    w.to_bytes()
}

fn check(f: &GgufFile, alignment: u64) {
    let mut expected = every_value_type();
    if alignment != 32 {
        expected.push(("general.alignment".into(), Value::U32(alignment as u32)));
    }
    assert_eq!(f.metadata, expected);
    for (k, v) in &expected {
        assert_eq!(f.get(k), Some(v), "{k}");
    }
    assert_eq!(f.alignment, alignment);
    assert_eq!(f.data_offset % alignment, 0);
    let tensors = some_tensors();
    assert_eq!(f.tensors.len(), tensors.len());
    for ((name, dims, dtype, data), t) in tensors.iter().zip(&f.tensors) {
        assert_eq!(&t.name, name);
        assert_eq!(&t.dims, dims);
        assert_eq!(t.dtype, *dtype);
        assert_eq!(t.n_bytes, data.len() as u64, "{name}");
        assert_eq!(t.offset % alignment, 0);
        assert_eq!(t.n_elements(), dims.iter().product::<u64>());
        assert_eq!(&f.tensor_data(t)[..], &data[..], "{name}");
        assert_eq!(f.tensor(name).map(|t| &t.name), Some(name));
    }
    assert_eq!(f.tensor("scalar").unwrap().n_elements(), 1);
    assert!(f.get("missing").is_none());
    assert!(f.tensor("missing").is_none());
}

#[test]
fn every_value_type_dtypes_and_alignment_round_trip() {
    for alignment in [None, Some(8), Some(64), Some(4096)] {
        let bytes = build(3, alignment);
        let f = GgufFile::from_bytes(Bytes::from_vec(bytes.clone())).unwrap();
        assert_eq!(f.version, 3);
        assert_eq!(f.file_size(), bytes.len() as u64);
        check(&f, alignment.unwrap_or(32));
    }
}

#[test]
fn version_2_header_parses() {
    let f = GgufFile::from_bytes(Bytes::from_vec(build(2, Some(16)))).unwrap();
    assert_eq!(f.version, 2);
    check(&f, 16);
}

#[test]
fn empty_file_with_no_metadata_or_tensors() {
    let bytes = GgufWriter::new().to_bytes();
    assert_eq!(bytes.len(), 32); // 24-byte header padded to 32
    let f = GgufFile::from_bytes(Bytes::from_vec(bytes)).unwrap();
    assert!(f.metadata.is_empty() && f.tensors.is_empty());
    assert_eq!(f.data_offset, 32);
    assert_eq!(f.architecture(), None);
}

#[test]
fn alignment_key_may_be_any_integer_type() {
    for v in [
        Value::U8(64),
        Value::I32(64),
        Value::U64(64),
        Value::I16(64),
    ] {
        let bytes = GgufWriter::new()
            .alignment(64)
            .kv("general.alignment", v.clone())
            .tensor("t", &[3], DType::F32, vec![1; 12])
            .tensor("u", &[3], DType::F32, vec![2; 12])
            .to_bytes();
        let f = GgufFile::from_bytes(Bytes::from_vec(bytes)).unwrap();
        assert_eq!(f.alignment, 64, "{v:?}");
        assert_eq!(f.tensor("u").unwrap().offset, 64);
        assert_eq!(f.metadata.len(), 1);
    }
}

#[test]
fn open_reads_a_written_file_and_reports_missing_files() {
    let dir = std::env::temp_dir().join(format!("ferrum-gguf-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("t.gguf");
    let w = GgufWriter::new()
        .kv("general.architecture", Value::String("llama".into()))
        .tensor("w", &[2, 2], DType::F32, pattern(16, 0));
    w.write(&path).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.architecture(), Some("llama"));
    assert_eq!(&f.tensor_bytes("w").unwrap()[..], &pattern(16, 0)[..]);
    let e = GgufFile::open(&dir.join("nope.gguf")).unwrap_err();
    assert!(matches!(e, Error::Io { .. }), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn tensor_data_of_a_foreign_info_is_empty_not_a_panic() {
    let f = GgufFile::from_bytes(Bytes::from_vec(build(3, None))).unwrap();
    let mut t = f.tensors[0].clone();
    t.offset = u64::MAX - 3;
    assert!(f.tensor_data(&t).is_empty());
    t.offset = 0;
    t.n_bytes = f.file_size();
    assert!(f.tensor_data(&t).is_empty());
}
