//! The fast matmul and attention paths against the plain ones. Fresh random inputs every run; the
//! seed is in every failure message (rerun with `QUANT_SEED=<seed>`).
//!
//! * `matmul` (AVX-512 tiles where the CPU has them) == one `vec_dot` per output, bit for bit:
//!   the tiles keep vec_dot's float order. Shapes cover odd row counts, every token remainder
//!   of the 4-token tiles, and more tokens than one token block.
//! * `matmul` vs `matmul_ref` (f64, unquantized activations): relative error of the quantized
//!   activations, |Δ| ≤ 2^-6 · Σ|w·x| + 1e-6 (Q8 activations carry about 2^-8 relative error per
//!   element; the bound leaves room for the f32 sums).
//! * attention: the SIMD kernels == `attention_portable` (same float order) bit for bit, within
//!   5e-3 of `attention_ref` (f64; Q and the V accumulator are f16), and one query at a time ==
//!   the whole batch bit for bit (batch invariance).
//! * Q4_K/Q6_K prompts: `matmul` == the dot product of the order llama.cpp uses for each token
//!   (`Order::of`), bit for bit.
//! * SwiGLU and GeGLU: the AVX-512 kernels == the portable ones (ggml's operations) bit for bit.
//! * Every check demands finite values, so a NaN never passes.

use ferrum_core::{f16, DType};
use ferrum_kernels::attention::{
    attention, attention_paged, attention_paged_portable, attention_portable, attention_ref,
    AttnParams, KvRows, PagedKv,
};
use ferrum_kernels::matmul::{matmul, matmul_ref, WeightRef};
use ferrum_kernels::quant::{quantize_row, vec_dot, vec_dot_type};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn seed() -> u64 {
    match std::env::var("QUANT_SEED") {
        Ok(s) => s.parse().expect("QUANT_SEED must be a u64"),
        Err(_) => rand::random(),
    }
}

fn put_f16(b: &mut [u8], off: usize, v: f32) {
    b[off..off + 2].copy_from_slice(&f16::from_f32(v).to_bits().to_le_bytes());
}

/// Random weight rows with sane scale fields (random bytes elsewhere).
fn random_weights(t: DType, rows: usize, cols: usize, rng: &mut StdRng) -> Vec<u8> {
    let mut b = vec![0u8; t.row_bytes(cols).unwrap() * rows];
    rng.fill(&mut b[..]);
    for blk in b.chunks_exact_mut(t.block_bytes()) {
        match t {
            DType::Q4_1 | DType::Q5_1 => {
                put_f16(blk, 0, rng.gen_range(0.001..0.1));
                put_f16(blk, 2, rng.gen_range(-0.5..0.5));
            }
            DType::Q8_0 | DType::Q5_0 | DType::Q4_0 => put_f16(blk, 0, rng.gen_range(0.0001..0.01)),
            DType::Q4_K => {
                put_f16(blk, 0, rng.gen_range(0.0001..0.01));
                put_f16(blk, 2, rng.gen_range(0.0001..0.01));
            }
            DType::Q6_K => put_f16(blk, 208, rng.gen_range(0.0001..0.01)),
            DType::IQ4_XS => put_f16(blk, 0, rng.gen_range(0.0001..0.01)),
            _ => unreachable!(),
        }
    }
    b
}

#[test]
fn matmul_equals_vec_dot_bit_for_bit() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for &dtype in &[DType::Q4_1, DType::Q5_0, DType::Q8_0] {
        for &(rows, cols, t) in &[
            (1, 32, 1),
            (3, 64, 2),
            (5, 96, 3),
            (17, 576, 5),
            (64, 128, 7),
            (33, 64, 70),
            (8, 32, 131),
        ] {
            let data = random_weights(dtype, rows, cols, &mut rng);
            let w = WeightRef {
                dtype,
                rows,
                cols,
                data: &data,
            };
            let x: Vec<f32> = (0..t * cols).map(|_| rng.gen_range(-3.0..3.0)).collect();
            let mut y = vec![f32::NAN; t * rows];
            matmul(&w, &x, &mut y);
            let at = vec_dot_type(dtype);
            let ab = at.row_bytes(cols).unwrap();
            let rb = dtype.row_bytes(cols).unwrap();
            let mut yr = vec![0f32; t * rows];
            matmul_ref(&w, &x, &mut yr);
            for tok in 0..t {
                let mut act = vec![0u8; ab];
                quantize_row(at, &x[tok * cols..(tok + 1) * cols], &mut act);
                for r in 0..rows {
                    let want = vec_dot(dtype, &data[r * rb..(r + 1) * rb], &act, cols);
                    let got = y[tok * rows + r];
                    assert!(
                        got.is_finite() && got.to_bits() == want.to_bits(),
                        "seed {seed}: {dtype} {rows}x{cols} t={t} token {tok} row {r}: {got} vs vec_dot {want}"
                    );
                    let mut deq = vec![0f32; cols];
                    ferrum_kernels::quant::dequantize_row(
                        dtype,
                        &data[r * rb..(r + 1) * rb],
                        &mut deq,
                    );
                    let mag: f32 = deq
                        .iter()
                        .zip(&x[tok * cols..])
                        .map(|(a, b)| (a * b).abs())
                        .sum();
                    let bound = mag / 64.0 + 1e-6;
                    assert!(
                        (got - yr[tok * rows + r]).abs() <= bound,
                        "seed {seed}: {dtype} token {tok} row {r}: {got} vs f64 reference {} (bound {bound})",
                        yr[tok * rows + r]
                    );
                }
            }
        }
    }
}

fn random_cache(n: usize, rng: &mut StdRng) -> Vec<f16> {
    (0..n)
        .map(|_| f16::from_f32(rng.gen_range(-2.0..2.0)))
        .collect()
}

/// Several sequences in one call (`attention_paged_batch`: one parallel pass over every
/// sequence's rows) give each sequence the bits of its own call, for decode steps (one query
/// each, different lengths) and a prompt beside them.
#[test]
fn batched_attention_equals_each_sequence_alone() {
    use ferrum_kernels::attention::{attention_paged_batch, SeqAttn};
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for &(nh, nkv, hd) in &[(9, 3, 64), (14, 2, 64), (4, 1, 256), (6, 2, 128)] {
        let bs = 16;
        let n_seq = 5;
        let per_seq = 4; // 64 positions each
        let rows = n_seq * per_seq * bs;
        let k = random_cache(rows * nkv * hd, &mut rng);
        let v = random_cache(rows * nkv * hd, &mut rng);
        // Sequence i holds blocks i, i + n, ... (interleaved).
        let tables: Vec<Vec<u32>> = (0..n_seq)
            .map(|i| (0..per_seq).map(|j| (i + n_seq * j) as u32).collect())
            .collect();
        let positions: Vec<Vec<usize>> =
            vec![vec![17], vec![63], (30..41).collect(), vec![0], vec![44]];
        let p = AttnParams {
            n_head: nh,
            n_head_kv: nkv,
            head_dim: hd,
            scale: 0.125,
            window: None,
            softcap: None,
            sinks: None,
        };
        let qs: Vec<Vec<f32>> = positions
            .iter()
            .map(|ps| {
                (0..ps.len() * nh * hd)
                    .map(|_| rng.gen_range(-1.0..1.0))
                    .collect()
            })
            .collect();
        let kv = |i: usize| PagedKv {
            k: KvRows::F16(&k),
            v: KvRows::F16(&v),
            table: &tables[i],
            block_size: bs,
        };
        let seqs: Vec<SeqAttn> = (0..n_seq)
            .map(|i| SeqAttn {
                kv: kv(i),
                positions: &positions[i],
            })
            .collect();
        let q_all: Vec<f32> = qs.concat();
        let mut out = vec![f32::NAN; q_all.len()];
        attention_paged_batch(&p, &q_all, &seqs, &mut out);
        let mut r0 = 0;
        for i in 0..n_seq {
            let mut alone = vec![f32::NAN; qs[i].len()];
            attention_paged(&p, &qs[i], kv(i), &positions[i], &mut alone);
            let got = &out[r0..r0 + alone.len()];
            assert!(
                got.iter()
                    .zip(&alone)
                    .all(|(a, b)| a.is_finite() && a.to_bits() == b.to_bits()),
                "seed {seed}: {nh}x{hd} sequence {i}: batched attention differs from alone"
            );
            r0 += alone.len();
        }
    }
}

#[test]
fn attention_is_batch_invariant_and_close_to_f64() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for &(nh, nkv, hd, window) in &[
        (9, 3, 64, None),
        (7, 1, 64, Some(12)),
        (4, 1, 256, Some(7)),
        (2, 2, 80, None),
        (2, 1, 16, None),
        (6, 2, 128, Some(9)),
    ] {
        let ctx = 40;
        let k = random_cache(ctx * nkv * hd, &mut rng);
        let v = random_cache(ctx * nkv * hd, &mut rng);
        let positions: Vec<usize> = (25..40).collect();
        let q: Vec<f32> = (0..positions.len() * nh * hd)
            .map(|_| rng.gen_range(-1.0..1.0))
            .collect();
        let p = AttnParams {
            n_head: nh,
            n_head_kv: nkv,
            head_dim: hd,
            scale: 1.0 / (hd as f32).sqrt(),
            window,
            softcap: None,
            sinks: None,
        };
        let mut all = vec![f32::NAN; q.len()];
        attention(&p, &q, &k, &v, &positions, &mut all);
        let mut plain = vec![f32::NAN; q.len()];
        attention_portable(&p, &q, &k, &v, &positions, &mut plain);
        for (i, (a, b)) in all.iter().zip(&plain).enumerate() {
            assert!(
                a.is_finite() && a.to_bits() == b.to_bits(),
                "seed {seed}: hd {hd} element {i}: SIMD {a} vs portable {b}"
            );
        }
        let mut refv = vec![0f32; q.len()];
        attention_ref(&p, &q, &k, &v, &positions, &mut refv);
        for (i, (a, b)) in all.iter().zip(&refv).enumerate() {
            assert!(
                a.is_finite() && (a - b).abs() < 5e-3,
                "seed {seed}: hd {hd} element {i}: {a} vs f64 {b}"
            );
        }
        // One query at a time gives the same bits as the whole batch.
        let row = nh * hd;
        for (t, &pos) in positions.iter().enumerate() {
            let mut one = vec![f32::NAN; row];
            attention(&p, &q[t * row..(t + 1) * row], &k, &v, &[pos], &mut one);
            for (a, b) in one.iter().zip(&all[t * row..(t + 1) * row]) {
                assert_eq!(a.to_bits(), b.to_bits(), "seed {seed}: hd {hd} query {t}");
            }
        }
        // The same rows scattered over shuffled blocks of a larger pool, read through a block
        // table: the same bits (SIMD and portable).
        for bs in [1usize, 4, 16] {
            let kv_row = nkv * hd;
            let n_logical = ctx.div_ceil(bs);
            let n_blocks = n_logical + 5;
            let mut ids: Vec<u32> = (0..n_blocks as u32).collect();
            for i in (1..ids.len()).rev() {
                ids.swap(i, rng.gen_range(0..=i));
            }
            let table = &ids[..n_logical];
            let mut kp = random_cache(n_blocks * bs * kv_row, &mut rng);
            let mut vp = random_cache(n_blocks * bs * kv_row, &mut rng);
            for j in 0..ctx {
                let r = table[j / bs] as usize * bs + j % bs;
                kp[r * kv_row..(r + 1) * kv_row].copy_from_slice(&k[j * kv_row..(j + 1) * kv_row]);
                vp[r * kv_row..(r + 1) * kv_row].copy_from_slice(&v[j * kv_row..(j + 1) * kv_row]);
            }
            let kv = PagedKv {
                k: KvRows::F16(&kp),
                v: KvRows::F16(&vp),
                table,
                block_size: bs,
            };
            let mut paged = vec![f32::NAN; q.len()];
            attention_paged(&p, &q, kv, &positions, &mut paged);
            let mut paged_plain = vec![f32::NAN; q.len()];
            attention_paged_portable(&p, &q, kv, &positions, &mut paged_plain);
            for (i, ((a, b), c)) in paged.iter().zip(&paged_plain).zip(&all).enumerate() {
                assert!(
                    a.to_bits() == c.to_bits() && b.to_bits() == c.to_bits(),
                    "seed {seed}: hd {hd} block {bs} element {i}: paged {a} / {b} vs {c}"
                );
            }
        }
    }
}

#[test]
fn swiglu_simd_equals_portable_bit_for_bit() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for len in [1usize, 15, 16, 17, 100, 1536, 100_003] {
        let mut g: Vec<f32> = (0..len)
            .map(|i| match i % 7 {
                0 => rng.gen_range(-200.0..200.0),
                1 => rng.gen_range(-1e-3..1e-3),
                _ => rng.gen_range(-12.0..12.0),
            })
            .collect();
        let u: Vec<f32> = (0..len).map(|_| rng.gen_range(-3.0..3.0)).collect();
        let mut plain = g.clone();
        ferrum_kernels::ops::swiglu_portable(&mut plain, &u);
        ferrum_kernels::ops::swiglu(&mut g, &u);
        for (i, (a, b)) in g.iter().zip(&plain).enumerate() {
            assert!(
                !a.is_nan() && a.to_bits() == b.to_bits(),
                "seed {seed}: len {len} element {i}: SIMD {a} vs portable {b}"
            );
        }
    }
}

#[test]
#[cfg(target_arch = "x86_64")]
fn packed_gemv_equals_its_order_reference_bit_for_bit() {
    use ferrum_kernels::matmul::avx512;
    if !avx512::available() {
        eprintln!("skipped: this CPU has no AVX-512 VNNI");
        return;
    }
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for &dtype in &[
        DType::Q8_0,
        DType::Q5_0,
        DType::Q4_1,
        DType::Q4_K,
        DType::Q6_K,
    ] {
        let shapes: &[(usize, usize)] = if dtype.block_size() == 256 {
            &[(16, 256), (48, 768), (160, 1024)]
        } else {
            &[(16, 32), (48, 576), (160, 640)]
        };
        for &(rows, cols) in shapes {
            let data = random_weights(dtype, rows, cols, &mut rng);
            assert!(avx512::pack_x16(dtype, &data, rows + 1, cols).is_none());
            let packed = avx512::pack_x16(dtype, &data, rows, cols).unwrap();
            let x: Vec<f32> = (0..cols).map(|_| rng.gen_range(-3.0..3.0)).collect();
            let mut y = vec![f32::NAN; rows];
            avx512::gemv_x16(dtype, &packed, rows, cols, &x, &mut y);
            let at = vec_dot_type(dtype);
            let mut act = vec![0u8; at.row_bytes(cols).unwrap()];
            quantize_row(at, &x, &mut act);
            let rb = dtype.row_bytes(cols).unwrap();
            for (r, a) in y.iter().enumerate() {
                let wr = &data[r * rb..(r + 1) * rb];
                // Q4_K: the order of llama.cpp's repacked GEMV, which one token gets; Q4_1,
                // Q5_0, Q8_0 with `FERRUM_DOT_ORDER=blocks`: the block order.
                let b = if dtype == DType::Q4_K {
                    ferrum_kernels::quant::vec_dot_q4k_repacked(wr, &act, cols)
                } else if ferrum_kernels::quant::has_blocks_order(dtype)
                    && ferrum_kernels::matmul::block_order()
                {
                    ferrum_kernels::quant::vec_dot_blocks(dtype, wr, &act, cols)
                } else {
                    vec_dot(dtype, wr, &act, cols)
                };
                assert!(
                    a.is_finite() && a.to_bits() == b.to_bits(),
                    "seed {seed}: {dtype} {rows}x{cols} row {r}: packed {a} vs reference {b}"
                );
            }
        }
    }
}

#[test]
#[cfg(target_arch = "x86_64")]
fn packed_layout_round_trips_exactly() {
    use ferrum_kernels::matmul::{avx512, Layout, PackedMatrix};
    if !avx512::available() {
        eprintln!("skipped: this CPU has no AVX-512 VNNI");
        return;
    }
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for &dtype in &PACKED_TYPES {
        let cols = if dtype.block_size() == 256 { 768 } else { 96 };
        let rows = 48;
        // Fully random bytes: the packing is a permutation of bits, whatever they mean.
        let mut data = vec![0u8; dtype.row_bytes(cols).unwrap() * rows];
        rng.fill(&mut data[..]);
        let m = PackedMatrix::new(
            dtype,
            rows,
            cols,
            ferrum_core::Bytes::from_vec(data.clone()),
        )
        .unwrap();
        assert_eq!(m.layout(), Layout::X16, "{dtype}");
        assert_eq!(m.to_row_major(), data, "seed {seed}: {dtype} round trip");
        let mut row = vec![0f32; cols];
        let mut want = vec![0f32; cols];
        let rb = dtype.row_bytes(cols).unwrap();
        for r in [0, 7, 16, 47] {
            m.get_row(r, &mut row);
            ferrum_kernels::quant::dequantize_row(dtype, &data[r * rb..(r + 1) * rb], &mut want);
            let same = row
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "seed {seed}: {dtype} row {r}");
        }
    }
}

#[cfg(target_arch = "x86_64")]
const PACKED_TYPES: [DType; 6] = [
    DType::Q8_0,
    DType::Q5_0,
    DType::Q4_1,
    DType::Q4_K,
    DType::Q6_K,
    DType::IQ4_XS,
];

/// Every plan of [`PackedMatrix::matmul`] (packed GEMV for decode rows, row kernels over unpacked
/// groups for prompts, both in one call) gives the bits of the row-major path, which follows
/// llama.cpp's per-sequence orders: batches of one-token sequences, prompts, and mixes. With
/// `FERRUM_DOT_ORDER=blocks`, Q4_1, Q5_0 and Q8_0 give every token the block order instead,
/// checked against `vec_dot_blocks` one output at a time.
#[test]
#[cfg(target_arch = "x86_64")]
fn packed_matrix_equals_row_major_bit_for_bit() {
    use ferrum_kernels::matmul::{avx512, matmul_segments, Layout, Order, PackedMatrix};
    if !avx512::available() {
        eprintln!("skipped: this CPU has no AVX-512 VNNI");
        return;
    }
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let seg_sets: &[&[usize]] = &[
        &[1],
        &[2],
        &[3],
        &[1, 1, 1, 1, 1, 1, 1, 1],
        &[1; 16],
        &[1; 17],
        &[5],
        &[9],
        &[12, 1, 1, 1],
        &[1, 20, 1],
        &[33],
        &[4, 4],
        &[70],
    ];
    for &dtype in &PACKED_TYPES {
        let (rows, cols) = if dtype.block_size() == 256 {
            (48, 512)
        } else {
            (48, 96)
        };
        let data = random_weights(dtype, rows, cols, &mut rng);
        let w = WeightRef {
            dtype,
            rows,
            cols,
            data: &data,
        };
        let m = PackedMatrix::new(
            dtype,
            rows,
            cols,
            ferrum_core::Bytes::from_vec(data.clone()),
        )
        .unwrap();
        assert_eq!(m.layout(), Layout::X16);
        for segs in seg_sets {
            let t: usize = segs.iter().sum();
            let x: Vec<f32> = (0..t * cols).map(|_| rng.gen_range(-3.0..3.0)).collect();
            let mut want = vec![f32::NAN; t * rows];
            let blocks = ferrum_kernels::quant::has_blocks_order(dtype)
                && ferrum_kernels::matmul::block_order();
            if blocks {
                assert!(m.orders(segs).iter().all(|&o| o == Order::Blocks));
                let at = vec_dot_type(dtype);
                let mut act = vec![0u8; at.row_bytes(cols).unwrap()];
                let rb = dtype.row_bytes(cols).unwrap();
                for tok in 0..t {
                    quantize_row(at, &x[tok * cols..(tok + 1) * cols], &mut act);
                    for r in 0..rows {
                        want[tok * rows + r] = ferrum_kernels::quant::vec_dot_blocks(
                            dtype,
                            &data[r * rb..(r + 1) * rb],
                            &act,
                            cols,
                        );
                    }
                }
            } else {
                matmul_segments(&w, &x, &mut want, segs);
            }
            let mut got = vec![f32::NAN; t * rows];
            m.matmul(&x, &mut got, segs);
            for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                assert!(
                    a.is_finite() && a.to_bits() == b.to_bits(),
                    "seed {seed}: {dtype} segs {segs:?} token {} row {}: packed {a} vs reference {b} (blocks {blocks})",
                    i / rows,
                    i % rows
                );
            }
        }
    }
}

/// [`PackedMatrix::matmul_many`] (several matrices over one input in one parallel call, where
/// their layout and type allow) gives each matrix the bits of its own `matmul`: matrices of one
/// type with different row counts (each part's groups split over the threads with the
/// others'), of two types (one call each), decode batches and prompts.
#[test]
#[cfg(target_arch = "x86_64")]
fn matmul_many_equals_each_matrix_alone_bit_for_bit() {
    use ferrum_kernels::matmul::PackedMatrix;
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    let seg_sets: &[&[usize]] = &[&[1], &[1; 8], &[3], &[1; 17], &[40], &[2, 1, 1]];
    for &dtype in &PACKED_TYPES {
        let cols = if dtype.block_size() == 256 { 512 } else { 96 };
        let other = if dtype == DType::Q8_0 {
            DType::Q4_1
        } else {
            DType::Q8_0
        };
        for types in [[dtype; 3], [dtype, other, dtype]] {
            let mats: Vec<PackedMatrix> = types
                .iter()
                .zip([48, 16, 80])
                .map(|(&t, rows)| {
                    let data = random_weights(t, rows, cols, &mut rng);
                    PackedMatrix::new(t, rows, cols, ferrum_core::Bytes::from_vec(data)).unwrap()
                })
                .collect();
            let refs: Vec<&PackedMatrix> = mats.iter().collect();
            for segs in seg_sets {
                let t: usize = segs.iter().sum();
                let x: Vec<f32> = (0..t * cols).map(|_| rng.gen_range(-3.0..3.0)).collect();
                let mut got: Vec<Vec<f32>> =
                    mats.iter().map(|m| vec![f32::NAN; t * m.rows()]).collect();
                let mut ys: Vec<&mut [f32]> = got.iter_mut().map(|y| y.as_mut_slice()).collect();
                PackedMatrix::matmul_many(&refs, &x, &mut ys, segs);
                for (i, m) in mats.iter().enumerate() {
                    let mut want = vec![f32::NAN; t * m.rows()];
                    m.matmul(&x, &mut want, segs);
                    for (j, (a, b)) in got[i].iter().zip(&want).enumerate() {
                        assert!(
                            a.is_finite() && a.to_bits() == b.to_bits(),
                            "seed {seed}: {types:?} segs {segs:?} matrix {i} token {} row {}: together {a} vs alone {b}",
                            j / m.rows(),
                            j % m.rows()
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn k_quant_prompt_kernels_follow_llama_cpp_orders_bit_for_bit() {
    use ferrum_kernels::matmul::Order;
    use ferrum_kernels::quant::{
        vec_dot_q4k_gemm_order, vec_dot_q4k_repacked, vec_dot_q6k_tiled_order,
    };
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for &dtype in &[DType::Q4_K, DType::Q6_K] {
        for &(rows, cols, t) in &[
            (8, 256, 4),
            (16, 512, 5),
            (13, 256, 9),
            (24, 768, 13),
            (8, 256, 1),
            (17, 512, 1),
            (33, 768, 1),
            (24, 256, 2),
        ] {
            let data = random_weights(dtype, rows, cols, &mut rng);
            let w = WeightRef {
                dtype,
                rows,
                cols,
                data: &data,
            };
            let x: Vec<f32> = (0..t * cols).map(|_| rng.gen_range(-3.0..3.0)).collect();
            let mut y = vec![f32::NAN; t * rows];
            matmul(&w, &x, &mut y);
            let at = vec_dot_type(dtype);
            let ab = at.row_bytes(cols).unwrap();
            let rb = dtype.row_bytes(cols).unwrap();
            for tok in 0..t {
                let mut act = vec![0u8; ab];
                quantize_row(at, &x[tok * cols..(tok + 1) * cols], &mut act);
                let order = Order::of(dtype, rows, t, tok);
                for r in 0..rows {
                    let wr = &data[r * rb..(r + 1) * rb];
                    let want = match order {
                        Order::Q4kGemm => vec_dot_q4k_gemm_order(wr, &act, cols),
                        Order::Q4kGemv => vec_dot_q4k_repacked(wr, &act, cols),
                        Order::Q6kTiled => vec_dot_q6k_tiled_order(wr, &act, cols),
                        Order::Tiled => {
                            ferrum_kernels::quant::vec_dot_tiled_order(dtype, wr, &act, cols)
                        }
                        Order::Vec => vec_dot(dtype, wr, &act, cols),
                        Order::Blocks => {
                            ferrum_kernels::quant::vec_dot_blocks(dtype, wr, &act, cols)
                        }
                    };
                    let got = y[tok * rows + r];
                    assert!(
                        got.is_finite() && got.to_bits() == want.to_bits(),
                        "seed {seed}: {dtype} {rows}x{cols} t={t} token {tok} row {r} ({order:?}): {got} vs {want}"
                    );
                }
            }
        }
    }
}

#[test]
fn geglu_simd_equals_portable_bit_for_bit() {
    let seed = seed();
    let mut rng = StdRng::seed_from_u64(seed);
    for len in [1usize, 15, 16, 33, 2048, 100_003] {
        let mut g: Vec<f32> = (0..len)
            .map(|i| match i % 5 {
                0 => rng.gen_range(-30.0..30.0),
                1 => [-10.0, 10.0, -9.999, 9.999, 0.0, -0.0][i % 6],
                _ => rng.gen_range(-4.0..4.0),
            })
            .collect();
        let u: Vec<f32> = (0..len).map(|_| rng.gen_range(-3.0..3.0)).collect();
        let mut plain = g.clone();
        ferrum_kernels::ops::geglu_portable(&mut plain, &u);
        ferrum_kernels::ops::geglu(&mut g, &u);
        for (i, (a, b)) in g.iter().zip(&plain).enumerate() {
            assert!(
                !a.is_nan() && a.to_bits() == b.to_bits(),
                "seed {seed}: len {len} element {i}: SIMD {a} vs portable {b}"
            );
        }
    }
}

/// The AVX2 tier's packed layouts (whatever this process's tier): [`Layout::X4`] for every
/// "_0/_1" type and [`Layout::X8`] for Q5_0, Q4_1, Q8_0 and Q6_K, odd row counts; the packing
/// round-trips exactly (whole matrix, single rows,
/// embedding lookups), and products over it equal the row-major ones bit for bit (decode
/// batches of 1..16 one-token sequences, prompts, mixes). On the AVX2 tiers
/// (`FERRUM_NO_AVX512=1`) the products run the AVX2 tiles on the packed bytes in place; on the
/// others (`FERRUM_FORCE_SCALAR=1`: the portable kernels) rows unpacked from the groups.
#[test]
#[cfg(target_arch = "x86_64")]
fn avx2_layouts_round_trip_and_equal_row_major_bit_for_bit() {
    use ferrum_kernels::matmul::{matmul_segments, Layout, PackedMatrix};
    let seed = seed();
    eprintln!("seed {seed}");
    let mut rng = StdRng::seed_from_u64(seed);
    let cases = [
        (Layout::X4, 4, DType::Q4_0),
        (Layout::X4, 4, DType::Q4_1),
        (Layout::X4, 4, DType::Q5_0),
        (Layout::X4, 4, DType::Q5_1),
        (Layout::X4, 4, DType::Q8_0),
        (Layout::X8, 8, DType::Q5_0),
        (Layout::X8, 8, DType::Q4_1),
        (Layout::X8, 8, DType::Q8_0),
        (Layout::X8, 8, DType::Q6_K),
    ];
    let mut seg_sets: Vec<Vec<usize>> = (1..=16).map(|n| vec![1; n]).collect();
    seg_sets.extend([
        vec![2],
        vec![3],
        vec![5],
        vec![12, 1, 1, 1],
        vec![1, 20, 1],
        vec![33],
        vec![70],
    ]);
    for (layout, group, dtype) in cases {
        for rows in [1usize, 3, 5, 18, 37, 64] {
            let cols = dtype.block_size() * rng.gen_range(1..=10);
            let data = random_weights(dtype, rows, cols, &mut rng);
            let n = PackedMatrix::stored_len(dtype, rows, cols, layout).unwrap();
            assert_eq!(
                n,
                dtype.row_bytes(cols).unwrap() * rows.next_multiple_of(group)
            );
            let mut packed = vec![0u8; n];
            PackedMatrix::pack_into(dtype, rows, cols, layout, &data, &mut packed).unwrap();
            let m = PackedMatrix::from_parts(
                dtype,
                rows,
                cols,
                layout,
                ferrum_core::Bytes::from_vec(packed),
            )
            .unwrap();
            assert!(
                m.to_row_major() == data,
                "seed {seed}: {dtype} {rows}x{cols} {layout:?} round trip"
            );
            let rb = dtype.row_bytes(cols).unwrap();
            let (mut got, mut want) = (vec![0f32; cols], vec![0f32; cols]);
            for r in 0..rows {
                m.get_row(r, &mut got);
                ferrum_kernels::quant::dequantize_row(dtype, &data[r * rb..][..rb], &mut want);
                assert!(
                    got.iter()
                        .zip(&want)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "seed {seed}: {dtype} {layout:?} get_row {r}"
                );
            }
            let w = WeightRef {
                dtype,
                rows,
                cols,
                data: &data,
            };
            for segs in &seg_sets {
                let t: usize = segs.iter().sum();
                let x: Vec<f32> = (0..t * cols).map(|_| rng.gen_range(-3.0..3.0)).collect();
                let mut want = vec![f32::NAN; t * rows];
                matmul_segments(&w, &x, &mut want, segs);
                let mut got = vec![f32::NAN; t * rows];
                m.matmul(&x, &mut got, segs);
                for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        a.is_finite() && a.to_bits() == b.to_bits(),
                        "seed {seed}: {dtype} {rows}x{cols} segs {segs:?} token {} row {}: \
                         {layout:?} {a} vs row-major {b}",
                        i / rows,
                        i % rows
                    );
                }
            }
        }
    }
}
