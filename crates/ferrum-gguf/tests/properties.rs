//! Property tests: random bytes, truncations and mutations never panic, report error offsets
//! inside the input, and never make the parser allocate more than a small multiple of the
//! input's size (a tracking global allocator measures the largest single allocation);
//! randomly generated files round-trip through the writer.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use ferrum_gguf::{Bytes, DType, Error, GgufFile, GgufWriter, Value, ValueType};
use proptest::collection::vec;
use proptest::prelude::*;
use proptest::sample::select;

// ---- allocation tracking ----

struct Tracking;

thread_local! {
    static LARGEST: Cell<usize> = const { Cell::new(0) };
}

fn note(size: usize) {
    let _ = LARGEST.try_with(|c| c.set(c.get().max(size)));
}

// SAFETY: forwards to the system allocator; only records sizes in a const thread-local.
unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        note(layout.size());
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        note(new_size);
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Tracking = Tracking;

/// Parses `bytes`, checking that no single allocation exceeds 64 bytes per input byte (plus
/// slack) and that any parse error's offset lies within the input.
fn parse_checked(bytes: &[u8]) -> Result<GgufFile, Error> {
    assert!(std::mem::size_of::<Value>() <= 48);
    let input = Bytes::from_vec(bytes.to_vec());
    LARGEST.with(|c| c.set(0));
    let r = GgufFile::from_bytes(input);
    let largest = LARGEST.with(|c| c.get());
    let bound = 64 * bytes.len() + 4096;
    assert!(
        largest <= bound,
        "largest allocation {largest} bytes for a {}-byte input",
        bytes.len()
    );
    match &r {
        Err(Error::Parse { format, offset, .. }) => {
            assert_eq!(*format, "GGUF");
            assert!(
                *offset <= bytes.len() as u64,
                "offset {offset} > {}",
                bytes.len()
            );
        }
        Err(e) => panic!("non-parse error from in-memory bytes: {e}"),
        Ok(_) => {}
    }
    r
}

// ---- generators ----

const SCALARS: [ValueType; 12] = [
    ValueType::U8,
    ValueType::I8,
    ValueType::U16,
    ValueType::I16,
    ValueType::U32,
    ValueType::I32,
    ValueType::F32,
    ValueType::Bool,
    ValueType::String,
    ValueType::U64,
    ValueType::I64,
    ValueType::F64,
];

/// A value of type `t` inside `depth` enclosing arrays (arrays nest at most 4 deep).
fn value_of(t: ValueType, depth: usize) -> BoxedStrategy<Value> {
    match t {
        ValueType::U8 => any::<u8>().prop_map(Value::U8).boxed(),
        ValueType::I8 => any::<i8>().prop_map(Value::I8).boxed(),
        ValueType::U16 => any::<u16>().prop_map(Value::U16).boxed(),
        ValueType::I16 => any::<i16>().prop_map(Value::I16).boxed(),
        ValueType::U32 => any::<u32>().prop_map(Value::U32).boxed(),
        ValueType::I32 => any::<i32>().prop_map(Value::I32).boxed(),
        ValueType::U64 => any::<u64>().prop_map(Value::U64).boxed(),
        ValueType::I64 => any::<i64>().prop_map(Value::I64).boxed(),
        ValueType::F32 => any::<f32>()
            .prop_filter("NaN != NaN", |x| !x.is_nan())
            .prop_map(Value::F32)
            .boxed(),
        ValueType::F64 => any::<f64>()
            .prop_filter("NaN != NaN", |x| !x.is_nan())
            .prop_map(Value::F64)
            .boxed(),
        ValueType::Bool => any::<bool>().prop_map(Value::Bool).boxed(),
        ValueType::String => vec(any::<char>(), 0..10)
            .prop_map(|c| Value::String(c.into_iter().collect()))
            .boxed(),
        ValueType::Array => {
            let elem_types: Vec<ValueType> = if depth + 1 < ferrum_gguf::MAX_ARRAY_DEPTH {
                ValueType::ALL.to_vec()
            } else {
                SCALARS.to_vec()
            };
            select(elem_types)
                .prop_flat_map(move |e| {
                    vec(value_of(e, depth + 1), 0..5).prop_map(move |items| Value::Array(e, items))
                })
                .boxed()
        }
    }
}

fn any_value() -> impl Strategy<Value = Value> {
    select(ValueType::ALL.to_vec()).prop_flat_map(|t| value_of(t, 0))
}

type TensorSpec = (Vec<u64>, DType, Vec<u8>);

fn any_tensor() -> impl Strategy<Value = TensorSpec> {
    let dtypes = vec![
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::Q4_0,
        DType::Q4_1,
        DType::Q8_0,
        DType::Q4_K,
        DType::Q6_K,
    ];
    (select(dtypes), 0u64..3, 1u64..3, 1usize..=3).prop_flat_map(|(dtype, blocks, rows, n_dims)| {
        let ne0 = blocks * dtype.block_size() as u64;
        let mut dims = vec![ne0, rows, 1, 1];
        dims.truncate(n_dims);
        let n_rows: u64 = dims[1..].iter().product();
        let n = (blocks * n_rows) as usize * dtype.block_bytes();
        vec(any::<u8>(), n).prop_map(move |data| (dims.clone(), dtype, data))
    })
}

#[derive(Debug, Clone)]
struct Spec {
    version: u32,
    alignment: Option<u64>,
    kvs: Vec<(String, Value)>,
    tensors: Vec<TensorSpec>,
}

impl Spec {
    fn bytes(&self) -> Vec<u8> {
        let mut w = GgufWriter::new().version(self.version);
        if let Some(a) = self.alignment {
            w = w.alignment(a);
        }
        for (k, v) in &self.kvs {
            w = w.kv(k.clone(), v.clone());
        }
        for (i, (dims, dtype, data)) in self.tensors.iter().enumerate() {
            w = w.tensor(format!("blk.{i}.weight"), dims, *dtype, data.clone());
        }
        w.to_bytes()
    }
}

fn any_spec() -> impl Strategy<Value = Spec> {
    (
        select(vec![2u32, 3]),
        select(vec![None, Some(8u64), Some(16), Some(64)]),
        vec(("[a-z_.]{0,8}", any_value()), 0..6),
        vec(any_tensor(), 0..4),
    )
        .prop_map(|(version, alignment, kvs, tensors)| Spec {
            version,
            alignment,
            kvs: kvs
                .into_iter()
                .enumerate()
                .map(|(i, (k, v))| (format!("k{i}.{k}"), v))
                .collect(),
            tensors,
        })
}

/// Length below which the file is necessarily incomplete: the end of the last tensor's data,
/// or of the padding before the data section.
fn required_len(f: &GgufFile) -> u64 {
    let data_end = f
        .tensors
        .iter()
        .map(|t| t.offset + t.n_bytes)
        .max()
        .unwrap_or(0);
    f.data_offset + data_end
}

/// A mutation: write `value`'s low `width` bytes at `pos % len`.
#[derive(Debug, Clone)]
struct Mutation {
    pos: usize,
    width: usize,
    value: u64,
}

fn any_mutation() -> impl Strategy<Value = Mutation> {
    let interesting = select(vec![
        0u64,
        1,
        2,
        4,
        5,
        9,
        13,
        31,
        255,
        0xffff,
        1 << 31,
        1 << 32,
        1 << 40,
        1 << 62,
        1 << 63,
        i64::MAX as u64,
        u64::MAX,
        u64::MAX - 1,
    ]);
    (
        any::<usize>(),
        select(vec![1usize, 4, 8]),
        prop_oneof![interesting, any::<u64>()],
    )
        .prop_map(|(pos, width, value)| Mutation { pos, width, value })
}

fn apply(bytes: &mut [u8], m: &Mutation) {
    if bytes.is_empty() {
        return;
    }
    let pos = m.pos % bytes.len();
    let v = m.value.to_le_bytes();
    let end = (pos + m.width).min(bytes.len());
    bytes[pos..end].copy_from_slice(&v[..end - pos]);
}

// ---- properties ----

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_are_rejected(bytes in vec(any::<u8>(), 0..600)) {
        prop_assert!(parse_checked(&bytes).is_err());
    }

    #[test]
    fn random_bytes_after_a_valid_header_never_panic(
        version in select(vec![2u32, 3]),
        n_tensors in 0u64..4,
        n_kv in 0u64..4,
        tail in vec(any::<u8>(), 0..600),
    ) {
        let mut bytes = b"GGUF".to_vec();
        bytes.extend_from_slice(&version.to_le_bytes());
        bytes.extend_from_slice(&n_tensors.to_le_bytes());
        bytes.extend_from_slice(&n_kv.to_le_bytes());
        bytes.extend_from_slice(&tail);
        let _ = parse_checked(&bytes);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn generated_files_round_trip(spec in any_spec()) {
        let bytes = spec.bytes();
        let f = parse_checked(&bytes).unwrap();
        prop_assert_eq!(f.version, spec.version);
        let alignment = spec.alignment.unwrap_or(32);
        prop_assert_eq!(f.alignment, alignment);
        let n_kv = spec.kvs.len() + usize::from(spec.alignment.is_some());
        prop_assert_eq!(f.metadata.len(), n_kv);
        prop_assert_eq!(&f.metadata[..spec.kvs.len()], &spec.kvs[..]);
        prop_assert_eq!(f.tensors.len(), spec.tensors.len());
        for ((dims, dtype, data), t) in spec.tensors.iter().zip(&f.tensors) {
            prop_assert_eq!(&t.dims, dims);
            prop_assert_eq!(t.dtype, *dtype);
            prop_assert_eq!(t.offset % alignment, 0);
            prop_assert_eq!(&f.tensor_data(t)[..], &data[..]);
        }
    }

    #[test]
    fn mutated_files_never_panic(
        spec in any_spec(),
        mutations in vec(any_mutation(), 1..4),
    ) {
        let mut bytes = spec.bytes();
        for m in &mutations {
            apply(&mut bytes, m);
        }
        if let Ok(f) = parse_checked(&bytes) {
            // Whatever parsed must be self-consistent.
            for t in &f.tensors {
                prop_assert_eq!(f.tensor_data(t).len() as u64, t.n_bytes);
                prop_assert!(f.data_offset + t.offset + t.n_bytes <= f.file_size());
            }
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 100, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn every_truncation_of_a_generated_file_is_rejected(spec in any_spec()) {
        let bytes = spec.bytes();
        let f = parse_checked(&bytes).unwrap();
        let required = required_len(&f) as usize;
        for len in 0..bytes.len() {
            let r = parse_checked(&bytes[..len]);
            if len < required {
                prop_assert!(r.is_err(), "prefix of {} bytes (of {}) parsed", len, bytes.len());
            } else {
                prop_assert!(r.is_ok());
            }
        }
    }
}

#[test]
fn allocation_tracker_sees_allocations() {
    LARGEST.with(|c| c.set(0));
    let v: Vec<u8> = Vec::with_capacity(1 << 20);
    assert!(LARGEST.with(|c| c.get()) >= 1 << 20);
    drop(v);
}

/// A fixed file with every value type and several dtypes, truncated at every length.
#[test]
fn every_truncation_of_a_rich_file_is_rejected() {
    let nested = Value::Array(
        ValueType::Array,
        vec![Value::Array(
            ValueType::I16,
            vec![Value::I16(-1), Value::I16(2)],
        )],
    );
    let bytes = GgufWriter::new()
        .alignment(16)
        .kv("general.architecture", Value::String("llama".into()))
        .kv("a.bool", Value::Bool(true))
        .kv("a.f64", Value::F64(0.5))
        .kv("a.nested", nested)
        .kv("a.tokens", ferrum_gguf::str_array(&["a", "bb", "ccc"]))
        .tensor("t.f32", &[4, 2], DType::F32, vec![1; 32])
        .tensor("t.q8", &[32], DType::Q8_0, vec![2; 34])
        .tensor("t.q4k", &[256], DType::Q4_K, vec![3; 144])
        .to_bytes();
    let f = parse_checked(&bytes).unwrap();
    let required = required_len(&f) as usize;
    assert_eq!(required, bytes.len()); // 144 is a multiple of 16: no trailing padding
    for len in 0..bytes.len() {
        assert!(parse_checked(&bytes[..len]).is_err(), "prefix {len}");
    }
}

/// Overwrites every 8-byte window of a small valid file with each hostile value.
#[test]
fn every_position_overwritten_with_hostile_values() {
    let bytes = GgufWriter::new()
        .kv("k.s", Value::String("abc".into()))
        .kv(
            "k.arr",
            Value::Array(ValueType::U32, vec![Value::U32(1), Value::U32(2)]),
        )
        .kv(
            "k.nested",
            Value::Array(
                ValueType::Array,
                vec![Value::Array(ValueType::U8, vec![Value::U8(1)])],
            ),
        )
        .tensor("w", &[32, 2], DType::Q4_0, vec![0; 36])
        .tensor("v", &[4], DType::F32, vec![0; 16])
        .to_bytes();
    let data_offset = parse_checked(&bytes).unwrap().data_offset as usize;
    for value in [u64::MAX, 1 << 40, 1 << 32, 1 << 63, u32::MAX as u64, 7] {
        for width in [4, 8] {
            for pos in 0..data_offset {
                let mut m = bytes.clone();
                apply(&mut m, &Mutation { pos, width, value });
                let _ = parse_checked(&m);
            }
        }
    }
}
