//! Dequantization against fixtures from an independent implementation (`gguf.quants.dequantize`,
//! NumPy; see scripts/gen_quant_fixtures.py). Dequantization is exact in f32 with ggml's operation
//! order, so every comparison is bit-exact (f32 bit patterns, so -0.0 != +0.0).

use ferrum_core::DType;
use ferrum_kernels::quant::{dequantize_row, quantize_row, vec_dot, vec_dot_ref, vec_dot_type};
use std::fs;
use std::io::{Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/quant")
}

fn u32_at(b: &[u8], off: usize) -> u32 {
    u32::from_le_bytes(b[off..off + 4].try_into().unwrap())
}

struct Fixture {
    name: String,
    dtype: DType,
    raw: Vec<u8>,
    expected: Vec<f32>,
}

fn load_fixtures() -> Vec<Fixture> {
    let mut out = Vec::new();
    for entry in fs::read_dir(fixture_dir()).expect("fixture dir") {
        let path = entry.unwrap().path();
        if path.extension().and_then(|e| e.to_str()) != Some("qfix") {
            continue;
        }
        let b = fs::read(&path).unwrap();
        assert_eq!(&b[0..4], b"QFIX", "{path:?}");
        let dtype = DType::from_ggml_id(u32_at(&b, 4)).expect("known type");
        let n = u32_at(&b, 8) as usize;
        let nbytes = u32_at(&b, 12) as usize;
        let raw = b[16..16 + nbytes].to_vec();
        let exp_bytes = &b[16 + nbytes..];
        assert_eq!(exp_bytes.len(), 4 * n, "{path:?}");
        let expected = exp_bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let name = path.file_stem().unwrap().to_string_lossy().into_owned();
        out.push(Fixture {
            name,
            dtype,
            raw,
            expected,
        });
    }
    out.sort_by(|a, b| a.name.cmp(&b.name));
    out
}

fn assert_bits_eq(name: &str, got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            g.to_bits() == w.to_bits(),
            "{name}: element {i}: got {g:e} ({:#010x}), gguf says {w:e} ({:#010x})",
            g.to_bits(),
            w.to_bits()
        );
    }
}

#[test]
fn dequantize_matches_gguf_python_bit_exactly() {
    let fixtures = load_fixtures();
    let mut seen = std::collections::BTreeSet::new();
    for f in &fixtures {
        let mut got = vec![f32::NAN; f.expected.len()];
        dequantize_row(f.dtype, &f.raw, &mut got);
        assert_bits_eq(&f.name, &got, &f.expected);
        assert!(got.iter().all(|v| v.is_finite()), "{}: non-finite", f.name);
        seen.insert(f.dtype.name());
    }
    // Every type gguf-py can dequantize, and real blocks of the types the models use.
    for t in [
        "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
        "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S",
        "IQ1_S", "IQ1_M", "TQ1_0", "TQ2_0", "MXFP4",
    ] {
        assert!(seen.contains(t), "no fixture for {t}");
    }
    for real in [
        "Q4_1_real_smollm2",
        "Q8_0_real_smollm2",
        "Q5_0_real_gemma3",
        "Q8_0_real_gemma3",
        "Q4_K_real_gemma3",
        "Q6_K_real_gemma3",
    ] {
        assert!(
            fixtures.iter().any(|f| f.name == real),
            "missing fixture {real}"
        );
    }
}

#[test]
fn dequantize_block_by_block_equals_whole_row() {
    for f in load_fixtures() {
        let (bs, bb) = (f.dtype.block_size(), f.dtype.block_bytes());
        for (k, raw) in f.raw.chunks_exact(bb).enumerate() {
            let mut got = vec![0f32; bs];
            dequantize_row(f.dtype, raw, &mut got);
            assert_bits_eq(&f.name, &got, &f.expected[k * bs..(k + 1) * bs]);
        }
    }
}

#[test]
#[should_panic(expected = "dequantize_row")]
fn dequantize_rejects_wrong_length() {
    let mut out = vec![0f32; 32];
    dequantize_row(DType::Q4_0, &[0u8; 17], &mut out);
}

/// Q8_K is not in gguf-py: a hand-built block, d = -0.5, qs[i] = i - 128, bsums consistent.
#[test]
fn q8k_dequantize_hand_computed() {
    let mut b = vec![0u8; 292];
    b[0..4].copy_from_slice(&(-0.5f32).to_le_bytes());
    for i in 0..256 {
        b[4 + i] = (i as i32 - 128) as i8 as u8;
    }
    let mut out = vec![0f32; 256];
    dequantize_row(DType::Q8_K, &b, &mut out);
    for (i, v) in out.iter().enumerate() {
        assert_eq!(*v, -0.5 * (i as f32 - 128.0));
    }
    // Q8_1 dequantizes as Q8_0 (s is only used by dot products).
    let mut q81 = vec![0u8; 40];
    q81[0..2].copy_from_slice(&ferrum_core::f16::from_f32(0.25).to_bits().to_le_bytes());
    q81[2..4].copy_from_slice(&ferrum_core::f16::from_f32(99.0).to_bits().to_le_bytes());
    for i in 0..32 {
        q81[4 + i] = (3 * i as i32 - 50) as i8 as u8;
    }
    let mut out = vec![0f32; 32];
    dequantize_row(DType::Q8_1, &q81, &mut out);
    for (i, v) in out.iter().enumerate() {
        assert_eq!(*v, 0.25 * (3.0 * i as f32 - 50.0));
    }
}

// ---------------------------------------------------------------------------------------------
// Whole real tensors of both models (skipped when models/ is absent).

fn tensor_hash(values: &[f32]) -> u64 {
    let mut h = 0u64;
    for (i, v) in values.iter().enumerate() {
        h = h.wrapping_add((v.to_bits() as u64).wrapping_mul(2 * i as u64 + 1));
    }
    h
}

struct RealTensor {
    model: PathBuf,
    name: String,
    dtype: DType,
    offset: u64,
    ne0: usize,
    rows: usize,
    hash: u64,
    sum: f64,
}

fn real_tensors() -> Vec<RealTensor> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let text = fs::read_to_string(fixture_dir().join("real_tensors.txt")).unwrap();
    let mut out = Vec::new();
    for line in text
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
    {
        let f: Vec<&str> = line.split_whitespace().collect();
        let dtype = DType::ALL.into_iter().find(|d| d.name() == f[2]).unwrap();
        out.push(RealTensor {
            model: root.join(f[0]),
            name: f[1].to_string(),
            dtype,
            offset: f[3].parse().unwrap(),
            ne0: f[4].parse().unwrap(),
            rows: f[5].parse().unwrap(),
            hash: u64::from_str_radix(f[6], 16).unwrap(),
            sum: f[7].parse().unwrap(),
        });
    }
    out
}

fn read_tensor(t: &RealTensor) -> Option<Vec<u8>> {
    let mut file = match fs::File::open(&t.model) {
        Ok(f) => f,
        Err(_) => {
            eprintln!("skipping {}: {:?} not found", t.name, t.model);
            return None;
        }
    };
    let len = t.dtype.row_bytes(t.ne0).unwrap() * t.rows;
    let mut buf = vec![0u8; len];
    file.seek(SeekFrom::Start(t.offset)).unwrap();
    file.read_exact(&mut buf).unwrap();
    Some(buf)
}

/// Every real tensor listed dequantizes to exactly gguf-py's values (hash of all f32 bit
/// patterns), and its quantized rows dot products agree (SIMD vs scalar vs f64 of dequantized).
#[test]
fn real_model_tensors() {
    let tensors = real_tensors();
    assert!(tensors.len() >= 8);
    let mut checked = 0;
    for t in &tensors {
        let Some(bytes) = read_tensor(t) else {
            continue;
        };
        let mut deq = vec![0f32; t.ne0 * t.rows];
        dequantize_row(t.dtype, &bytes, &mut deq);
        assert_eq!(
            tensor_hash(&deq),
            t.hash,
            "{} ({}): dequantized tensor differs from gguf-py",
            t.name,
            t.dtype
        );
        let sum: f64 = deq.iter().map(|&v| v as f64).sum();
        assert!((sum - t.sum).abs() <= 1e-9 * t.sum.abs().max(1.0));
        checked += 1;

        // Dot products over a sample of rows with a smooth activation vector.
        let at = vec_dot_type(t.dtype);
        let x: Vec<f32> = (0..t.ne0)
            .map(|i| ((i as f32) * 0.37).sin() * 2.0 + 0.01 * i as f32)
            .collect();
        let mut act = vec![0u8; at.row_bytes(t.ne0).unwrap()];
        quantize_row(at, &x, &mut act);
        let mut xq = vec![0f32; t.ne0];
        dequantize_row(at, &act, &mut xq);
        let rb = t.dtype.row_bytes(t.ne0).unwrap();
        let step = (t.rows / 16).max(1);
        for r in (0..t.rows).step_by(step) {
            let w = &bytes[r * rb..(r + 1) * rb];
            let simd = vec_dot(t.dtype, w, &act, t.ne0);
            let reference = vec_dot_ref(t.dtype, w, &act, t.ne0);
            let wd = &deq[r * t.ne0..(r + 1) * t.ne0];
            let exact: f64 = wd.iter().zip(&xq).map(|(&a, &b)| a as f64 * b as f64).sum();
            let mag: f64 = wd
                .iter()
                .zip(&xq)
                .map(|(&a, &b)| (a as f64 * b as f64).abs())
                .sum();
            assert!(simd.is_finite() && reference.is_finite());
            // Real weights have small mins, so |w|·|x| bounds the float error well; Q4_1 adds
            // the f16 rounding of the activation block sum s (2^-10 relative, see quant_random).
            let tol = 1e-5 * mag + 1e-6;
            assert!(
                (simd as f64 - reference as f64).abs() <= tol,
                "{} row {r}: simd {simd} vs ref {reference}",
                t.name
            );
            assert!(
                (reference as f64 - exact).abs() <= 2e-3 * mag + 1e-6,
                "{} row {r}: ref {reference} vs f64 {exact}",
                t.name
            );
        }
    }
    eprintln!("checked {checked} real tensors");
}

/// The Q4_0 quantizer (a Q4_0 KV cache is written by it) against ggml's `quantize_row_q4_0_ref`
/// itself (tests/fixtures/quant/q4_0_quantize.bin, from scripts/gen_quant_fixtures.py
/// --q4-0-quantizer): byte for byte, with an all-zero block, a constant block and a negative max.
#[test]
fn q4_0_quantizer_matches_ggml() {
    let b = fs::read(fixture_dir().join("q4_0_quantize.bin")).unwrap();
    let n = u32_at(&b, 0) as usize;
    let x: Vec<f32> = b[4..4 + 4 * n]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let want = &b[4 + 4 * n..];
    let mut got = vec![0u8; DType::Q4_0.row_bytes(n).unwrap()];
    quantize_row(DType::Q4_0, &x, &mut got);
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.chunks(18).zip(want.chunks(18)).enumerate() {
        assert_eq!(g, w, "block {i}");
    }
}
