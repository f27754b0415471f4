//! The float32 fast paths (GEMM-backed MatMul, Gemm and Conv; elementwise Add/Sub/Mul/Div,
//! Relu, Sqrt, Erf; MaxPool) against the reference kernels, which run when the same model is
//! fed float64 values: fresh random shapes and attributes every run.
//!
//! Tolerances: products and convolutions |f32 - f64| <= 1e-5 * (sum of |terms|) per output
//! (f32 accumulation of the products; the per-element sum of absolute terms is bounded here by
//! the output count times the max); elementwise Add/Sub/Mul/Div/Relu/Sqrt/MaxPool bit-identical
//! to the reference rounded to f32; Erf within 1 ulp; Softmax within 10 * 2^-24 relative.
//! NaN never passes (`err <= tol`). MatMulInteger on the integer GEMM (8-bit operands, every
//! zero-point form) equals a plain i64 product exactly.

use ferrum_graph::proto::build::{attr_int, attr_ints, model, node, value};
use ferrum_graph::proto::{encode, AttributeProto};
use ferrum_graph::{Session, Tensor, Value};
use rand::{Rng, SeedableRng};

type Rng64 = rand::rngs::StdRng;

fn rng() -> Rng64 {
    let seed: u64 = rand::random();
    eprintln!("seed {seed}");
    Rng64::seed_from_u64(seed)
}

/// Runs a one-node model on `inputs` (all f32 or all f64), returning the first output as f64.
fn run(
    op: &str,
    attrs: Vec<AttributeProto>,
    inputs: &[(Vec<usize>, Vec<f32>)],
    f64_inputs: bool,
    opset: i64,
) -> (Vec<usize>, Vec<f64>) {
    let names: Vec<String> = (0..inputs.len()).map(|i| format!("x{i}")).collect();
    let nr: Vec<&str> = names.iter().map(String::as_str).collect();
    let elem = if f64_inputs { 11 } else { 1 };
    let mut mp = model(
        vec![node(op, &nr, &["y"], attrs)],
        inputs
            .iter()
            .zip(&nr)
            .map(|((s, _), n)| {
                value(
                    n,
                    elem,
                    &s.iter().map(|&d| Some(d as i64)).collect::<Vec<_>>(),
                )
            })
            .collect(),
        vec![value("y", 0, &[])],
        vec![],
        opset,
    );
    mp.graph.as_mut().unwrap().output[0].r#type = None;
    let s = Session::from_bytes(&encode(&mp)).unwrap();
    let feeds = inputs
        .iter()
        .zip(&names)
        .map(|((s, v), n)| {
            let t = if f64_inputs {
                Tensor::from_vec(s.clone(), v.iter().map(|&x| x as f64).collect::<Vec<_>>())
            } else {
                Tensor::from_vec(s.clone(), v.clone())
            };
            (n.clone(), Value::Tensor(t.unwrap()))
        })
        .collect();
    let t = s.run(feeds).unwrap().remove(0).1.into_tensor().unwrap();
    (t.shape().to_vec(), t.to_f64_vec().unwrap())
}

/// f32 fast path vs f64 reference: shapes equal, every element within `tol(reference)`.
fn compare(
    what: &str,
    op: &str,
    attrs: Vec<AttributeProto>,
    inputs: &[(Vec<usize>, Vec<f32>)],
    opset: i64,
    tol: impl Fn(f64) -> f64,
) {
    let (s32, v32) = run(op, attrs.clone(), inputs, false, opset);
    let (s64, v64) = run(op, attrs, inputs, true, opset);
    assert_eq!(s32, s64, "{what}: shapes");
    for (i, (a, b)) in v32.iter().zip(&v64).enumerate() {
        let err = (a - b).abs();
        assert!(
            err <= tol(*b),
            "{what}: element {i}: f32 path {a}, reference {b} (err {err:e})"
        );
    }
}

fn randv(rng: &mut Rng64, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

#[test]
fn conv2d_matches_the_reference() {
    let mut rng = rng();
    for case in 0..40 {
        let n = rng.gen_range(1..3);
        let group = [1, 1, 2, 3][case % 4];
        let cg = rng.gen_range(1..5);
        let c = cg * group;
        let depthwise = case % 5 == 4;
        let (c, cg, group, m) = if depthwise {
            (c, 1, c, c)
        } else {
            (c, cg, group, group * rng.gen_range(1..5))
        };
        let kh = [1, 3, 5, 7][rng.gen_range(0..4)];
        let kw = [1, 2, 3][rng.gen_range(0..3)];
        // Depthwise cases also get wide rows (whole 16-output blocks) and column dilation.
        let d = [
            1 + (case % 7 == 6) as i64,
            1 + (depthwise && case % 3 == 0) as i64,
        ];
        let ekh = (kh - 1) * d[0] as usize + 1;
        let ekw = (kw - 1) * d[1] as usize + 1;
        let wide = if depthwise { 40 } else { 12 };
        let (ih, iw) = (rng.gen_range(ekh..ekh + 12), rng.gen_range(ekw..ekw + wide));
        let s = [rng.gen_range(1..3), rng.gen_range(1..3)];
        let pads = [
            rng.gen_range(0..3),
            rng.gen_range(0..2),
            rng.gen_range(0..3),
            rng.gen_range(0..2),
        ];
        let mut inputs = vec![
            (vec![n, c, ih, iw], randv(&mut rng, n * c * ih * iw)),
            (vec![m, cg, kh, kw], randv(&mut rng, m * cg * kh * kw)),
        ];
        if case % 2 == 0 {
            inputs.push((vec![m], randv(&mut rng, m)));
        }
        let attrs = vec![
            attr_int("group", group as i64),
            attr_ints("strides", &s),
            attr_ints("dilations", &d),
            attr_ints("pads", &pads),
        ];
        let terms = (cg * kh * kw + 1) as f64;
        compare(
            &format!(
                "Conv case {case}: x {:?} w {:?} s {s:?} d {d:?} pads {pads:?} group {group}",
                inputs[0].0, inputs[1].0
            ),
            "Conv",
            attrs,
            &inputs,
            17,
            |_| 1e-5 * terms,
        );
    }
}

/// Convolutions big enough that the GEMM reads their patches over several K blocks (K > 256),
/// splits them across threads, and computes the late-layer shapes transposed (few output
/// positions, many channels: the patches become the GEMM's left side, in the other panel width).
#[test]
fn conv_matches_the_reference_on_large_blocks() {
    let mut rng = rng();
    // (c, m, ih, iw, k, stride, pad, dilation)
    let cases = [
        (64, 48, 30, 31, 3, 1, 1, 1),
        (40, 70, 17, 23, 3, 2, 1, 1),
        (32, 160, 9, 9, 3, 1, 1, 1),
        (48, 96, 14, 14, 1, 2, 0, 1),
        (20, 24, 21, 19, 5, 1, 2, 2),
        (3, 16, 45, 45, 7, 2, 3, 1),
        // Stride-2 rows wide enough for whole 16-lane groups in the patch gather.
        (16, 24, 9, 75, 3, 2, 1, 1),
        (8, 16, 6, 70, 1, 2, 0, 1),
    ];
    for (case, &(c, m, ih, iw, k, s, pad, d)) in cases.iter().enumerate() {
        let inputs = vec![
            (vec![1, c, ih, iw], randv(&mut rng, c * ih * iw)),
            (vec![m, c, k, k], randv(&mut rng, m * c * k * k)),
            (vec![m], randv(&mut rng, m)),
        ];
        let attrs = vec![
            attr_ints("strides", &[s as i64; 2]),
            attr_ints("dilations", &[d as i64; 2]),
            attr_ints("pads", &[pad as i64; 4]),
        ];
        let terms = (c * k * k + 1) as f64;
        compare(
            &format!("large Conv case {case}: c {c} m {m} {ih}x{iw} k {k} s {s} pad {pad} d {d}"),
            "Conv",
            attrs,
            &inputs,
            17,
            |_| 1e-5 * terms,
        );
    }
}

/// A 1x1, stride-1 convolution whose end padding makes the output larger than the input must not
/// read the input as its own im2col matrix (it did once).
#[test]
fn pointwise_conv_with_end_padding() {
    let mut rng = rng();
    let inputs = [
        (vec![1, 2, 5, 8], randv(&mut rng, 80)),
        (vec![3, 2, 1, 1], randv(&mut rng, 6)),
    ];
    compare(
        "1x1 Conv, pads [0, 0, 2, 1]",
        "Conv",
        vec![attr_ints("pads", &[0, 0, 2, 1])],
        &inputs,
        17,
        |_| 1e-5 * 3.0,
    );
}

#[test]
fn matmul_and_gemm_match_the_reference() {
    let mut rng = rng();
    let shapes: Vec<(Vec<usize>, Vec<usize>)> = vec![
        (vec![7], vec![7, 5]),
        (vec![3, 7], vec![7]),
        (vec![2, 3, 17, 9], vec![9, 33]),
        (vec![2, 1, 5, 9], vec![3, 9, 4]),
        (vec![1, 4, 13, 64], vec![1, 4, 64, 13]),
        (vec![130, 70], vec![70, 129]),
    ];
    for (a, b) in shapes {
        let k = *a.last().unwrap() as f64;
        let na: usize = a.iter().product();
        let nb: usize = b.iter().product();
        let inputs = [
            (a.clone(), randv(&mut rng, na)),
            (b.clone(), randv(&mut rng, nb)),
        ];
        compare(
            &format!("MatMul {a:?} {b:?}"),
            "MatMul",
            vec![],
            &inputs,
            17,
            |_| 1e-5 * k,
        );
    }
    for case in 0..16 {
        // Cases 12..16 have one row (a classifier head: the matrix-vector path, its columns
        // split across threads in chunks of at least 64).
        let (m, n, k) = (
            if case >= 12 { 1 } else { rng.gen_range(1..40) },
            if case >= 12 {
                rng.gen_range(1..300)
            } else {
                rng.gen_range(1..40)
            },
            rng.gen_range(1..300),
        );
        let (ta, tb) = (case % 2 == 1, case % 4 >= 2);
        let ash = if ta { vec![k, m] } else { vec![m, k] };
        let bsh = if tb { vec![n, k] } else { vec![k, n] };
        let csh = [vec![m, n], vec![n], vec![1], vec![m, 1]][case % 4].clone();
        let nc: usize = csh.iter().product();
        let inputs = [
            (ash, randv(&mut rng, m * k)),
            (bsh, randv(&mut rng, n * k)),
            (csh, randv(&mut rng, nc)),
        ];
        let mut attrs = vec![attr_int("transA", ta as i64), attr_int("transB", tb as i64)];
        if case % 3 == 0 {
            attrs.push(AttributeProto {
                name: "alpha".into(),
                f: 0.5,
                r#type: 1,
                ..Default::default()
            });
            attrs.push(AttributeProto {
                name: "beta".into(),
                f: -2.0,
                r#type: 1,
                ..Default::default()
            });
        }
        compare(
            &format!("Gemm case {case} m{m} n{n} k{k} ta{ta} tb{tb}"),
            "Gemm",
            attrs,
            &inputs,
            13,
            |_| 1e-5 * (k as f64 + 2.0),
        );
    }
}

#[test]
fn elementwise_matches_the_reference_exactly() {
    let mut rng = rng();
    let pairs: Vec<(Vec<usize>, Vec<usize>)> = vec![
        (vec![2, 3, 4], vec![2, 3, 4]),
        (vec![2, 3, 4], vec![4]),
        (vec![2, 3, 4], vec![3, 1]),
        (vec![1, 3, 1], vec![2, 1, 5]),
        (vec![], vec![3, 2]),
        (vec![5, 1], vec![]),
        (vec![1, 12, 7, 7], vec![1, 1, 1, 7]),
        (vec![0, 3], vec![1, 3]),
    ];
    for (a, b) in pairs {
        let na: usize = a.iter().product();
        let nb: usize = b.iter().product();
        let mut bv = randv(&mut rng, nb);
        if nb > 1 {
            bv[0] = 0.0; // x / 0 and 0 / 0
        }
        let inputs = [(a.clone(), randv(&mut rng, na)), (b.clone(), bv)];
        for op in ["Add", "Sub", "Mul", "Div"] {
            let (s32, v32) = run(op, vec![], &inputs, false, 17);
            let (s64, v64) = run(op, vec![], &inputs, true, 17);
            assert_eq!(s32, s64, "{op} {a:?} {b:?}");
            for (x, y) in v32.iter().zip(&v64) {
                let y32 = *y as f32;
                assert!(
                    (*x as f32).to_bits() == y32.to_bits() || (x.is_nan() && y.is_nan()),
                    "{op} {a:?} {b:?}: {x} vs {y32}"
                );
            }
        }
    }
    let mut xs = randv(&mut rng, 60000);
    xs.iter_mut()
        .enumerate()
        .for_each(|(i, x)| *x *= [1e-6, 0.01, 0.3, 1.0, 3.0, 6.5][i % 6]);
    xs.extend([0.0, -0.0, 0.25, -0.25, 6.0, f32::NAN, f32::INFINITY, 1e-30]);
    let n = xs.len();
    let inputs = [(vec![n], xs.clone())];
    let clip_inputs = [
        (vec![n], xs.clone()),
        (vec![], vec![-0.5]),
        (vec![], vec![0.25]),
    ];
    for op in ["Relu", "Sqrt", "Erf", "Clip"] {
        let ins: &[(Vec<usize>, Vec<f32>)] = if op == "Clip" { &clip_inputs } else { &inputs };
        let (_, v32) = run(op, vec![], ins, false, 17);
        let (_, v64) = run(op, vec![], ins, true, 17);
        for (i, (x, y)) in v32.iter().zip(&v64).enumerate() {
            let (a, b) = (*x as f32, *y as f32);
            let ulps = (a.to_bits() as i64 - b.to_bits() as i64).abs();
            // -0 and +0 count as equal (the reference's Erf(-0) is +0).
            let ok = a == b || if op == "Erf" { ulps <= 1 } else { ulps == 0 };
            assert!(
                ok || (a.is_nan() && b.is_nan()),
                "{op}({}) = {a}, reference {b}",
                xs[i]
            );
        }
    }
}

#[test]
fn maxpool_matches_the_reference_exactly() {
    let mut rng = rng();
    for case in 0..20 {
        let k = [rng.gen_range(1..4), rng.gen_range(1..4)];
        let (h, w) = (rng.gen_range(k[0]..k[0] + 9), rng.gen_range(k[1]..k[1] + 9));
        let pads = [
            rng.gen_range(0..k[0] as i64),
            rng.gen_range(0..k[1] as i64),
            rng.gen_range(0..k[0] as i64),
            rng.gen_range(0..k[1] as i64),
        ];
        let s = [rng.gen_range(1..3), rng.gen_range(1..3)];
        let mut x = randv(&mut rng, 2 * 3 * h * w);
        match case {
            3 => x[5] = f32::NAN,
            // NaN in the last plane only (planes without NaN take another combination).
            7 => x[5 * h * w + rng.gen_range(0..h * w)] = f32::NAN,
            // Only zeros of both signs: the first of a window's equal values must win.
            5 | 11 => x
                .iter_mut()
                .for_each(|v| *v = if *v > 0.0 { 0.0 } else { -0.0 }),
            _ => {}
        }
        let attrs = vec![
            attr_ints("kernel_shape", &[k[0] as i64, k[1] as i64]),
            attr_ints("strides", &s),
            attr_ints("pads", &pads),
            attr_int("ceil_mode", (case % 3 == 0) as i64),
        ];
        let inputs = [(vec![2, 3, h, w], x)];
        let (s32, v32) = run("MaxPool", attrs.clone(), &inputs, false, 12);
        let (s64, v64) = run("MaxPool", attrs, &inputs, true, 12);
        assert_eq!(s32, s64);
        for (a, b) in v32.iter().zip(&v64) {
            assert!(
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                "MaxPool case {case}: {a} vs {b}"
            );
        }
    }
}

#[test]
fn transpose_softmax_where_match_the_reference_exactly() {
    let mut rng = rng();
    let exact = |what: &str, a: &[f64], b: &[f64]| {
        for (x, y) in a.iter().zip(b) {
            let (x, y) = (*x as f32, *y as f32);
            assert!(
                x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan()),
                "{what}: {x} vs {y}"
            );
        }
    };
    for (shape, perm) in [
        (vec![1, 5, 3, 4], vec![0, 2, 1, 3]),
        (vec![1, 5, 3, 4], vec![0, 2, 3, 1]),
        (vec![6, 7], vec![1, 0]),
        (vec![2, 3, 4, 5], vec![3, 1, 0, 2]),
        (vec![3], vec![0]),
    ] {
        let n: usize = shape.iter().product();
        let inputs = [(shape.clone(), randv(&mut rng, n))];
        let attrs = vec![attr_ints(
            "perm",
            &perm.iter().map(|&p| p as i64).collect::<Vec<_>>(),
        )];
        let (s32, v32) = run("Transpose", attrs.clone(), &inputs, false, 17);
        let (s64, v64) = run("Transpose", attrs, &inputs, true, 17);
        assert_eq!(s32, s64);
        exact(&format!("Transpose {shape:?} {perm:?}"), &v32, &v64);
    }
    for (shape, axis, opset) in [
        (vec![2, 3, 17], -1, 17),
        (vec![4, 1], -1, 13),
        (vec![2, 3, 5], 1, 11),
        (vec![2, 3, 5], 2, 11),
    ] {
        let n: usize = shape.iter().product();
        let mut x = randv(&mut rng, n);
        x.iter_mut().for_each(|v| *v *= 20.0);
        let inputs = [(shape.clone(), x)];
        let attrs = vec![attr_int("axis", axis)];
        let (s32, v32) = run("Softmax", attrs.clone(), &inputs, false, opset);
        let (s64, v64) = run("Softmax", attrs, &inputs, true, opset);
        assert_eq!(s32, s64);
        // e^x in float32 (within 2 ulp), an f64 sum, one rounding: 10 * 2^-24 relative, and
        // values below e^-87 may come out 0.
        for (x, y) in v32.iter().zip(&v64) {
            let (x, y) = (*x as f32 as f64, *y as f32 as f64);
            let err = (x - y).abs();
            assert!(
                err <= 10.0 * 2f64.powi(-24) * y.abs() + 1.7e-38,
                "Softmax {shape:?} axis {axis} opset {opset}: {x} vs {y}"
            );
        }
    }
}

#[test]
fn where_matches_the_reference_exactly() {
    use ferrum_graph::proto::build::value as val;
    let mut rng = rng();
    for (cs, xs, ys) in [
        (vec![1, 1, 1, 6], vec![], vec![1, 3, 5, 6]),
        (vec![2, 3], vec![2, 3], vec![2, 3]),
        (vec![3, 1], vec![1, 4], vec![]),
    ] {
        let nc: usize = cs.iter().product();
        let nx: usize = xs.iter().product();
        let ny: usize = ys.iter().product();
        let cond: Vec<bool> = (0..nc).map(|_| rng.gen()).collect();
        let (xv, yv) = (randv(&mut rng, nx), randv(&mut rng, ny));
        let mut outs = Vec::new();
        for f64_in in [false, true] {
            let elem = if f64_in { 11 } else { 1 };
            let dims = |s: &Vec<usize>| s.iter().map(|&d| Some(d as i64)).collect::<Vec<_>>();
            let mut mp = model(
                vec![node("Where", &["c", "x", "y"], &["o"], vec![])],
                vec![
                    val("c", 9, &dims(&cs)),
                    val("x", elem, &dims(&xs)),
                    val("y", elem, &dims(&ys)),
                ],
                vec![val("o", 0, &[])],
                vec![],
                17,
            );
            mp.graph.as_mut().unwrap().output[0].r#type = None;
            let s = Session::from_bytes(&encode(&mp)).unwrap();
            let t = |sh: &Vec<usize>, v: &Vec<f32>| -> Value {
                if f64_in {
                    Tensor::from_vec(sh.clone(), v.iter().map(|&a| a as f64).collect::<Vec<_>>())
                } else {
                    Tensor::from_vec(sh.clone(), v.clone())
                }
                .unwrap()
                .into()
            };
            let feeds = vec![
                (
                    "c".to_string(),
                    Tensor::from_vec(cs.clone(), cond.clone()).unwrap().into(),
                ),
                ("x".to_string(), t(&xs, &xv)),
                ("y".to_string(), t(&ys, &yv)),
            ];
            let o = s.run(feeds).unwrap().remove(0).1.into_tensor().unwrap();
            outs.push((o.shape().to_vec(), o.to_f64_vec().unwrap()));
        }
        assert_eq!(outs[0], outs[1], "Where {cs:?} {xs:?} {ys:?}");
    }
}

#[test]
fn layer_norm_matches_the_reference_exactly() {
    let mut rng = rng();
    for (shape, axis, bias) in [
        (vec![2, 5, 16], -1, true),
        (vec![3, 4, 6], 1, false),
        (vec![1, 197, 32], 2, true),
    ] {
        let n: usize = shape.iter().product();
        let a = if axis < 0 {
            shape.len() - 1
        } else {
            axis as usize
        };
        let tail = shape[a..].to_vec();
        let nt: usize = tail.iter().product();
        let mut inputs = vec![
            (shape.clone(), randv(&mut rng, n)),
            (tail.clone(), randv(&mut rng, nt)),
        ];
        if bias {
            inputs.push((tail.clone(), randv(&mut rng, nt)));
        }
        let attrs = vec![attr_int("axis", axis)];
        let (s32, v32) = run("LayerNormalization", attrs.clone(), &inputs, false, 17);
        let (s64, v64) = run("LayerNormalization", attrs, &inputs, true, 17);
        assert_eq!(s32, s64);
        for (x, y) in v32.iter().zip(&v64) {
            let (x, y) = (*x as f32, *y as f32);
            assert_eq!(
                x.to_bits(),
                y.to_bits(),
                "LayerNorm {shape:?} axis {axis}: {x} vs {y}"
            );
        }
    }
}

/// A random 8-bit tensor (as i64 values in its type's range) and its dtype.
fn int8_values(rng: &mut Rng64, len: usize, signed: bool) -> Vec<i64> {
    (0..len)
        .map(|_| {
            if signed {
                rng.gen_range(-128..128)
            } else {
                rng.gen_range(0..256)
            }
        })
        .collect()
}

fn int8_tensor(shape: &[usize], v: &[i64], signed: bool) -> Tensor {
    if signed {
        Tensor::from_vec(
            shape.to_vec(),
            v.iter().map(|&x| x as i8).collect::<Vec<_>>(),
        )
    } else {
        Tensor::from_vec(
            shape.to_vec(),
            v.iter().map(|&x| x as u8).collect::<Vec<_>>(),
        )
    }
    .unwrap()
}

#[test]
fn matmul_integer_matches_a_plain_integer_product() {
    let mut r = rng();
    for case in 0..40 {
        let (a_signed, b_signed) = (r.gen_bool(0.5), r.gen_bool(0.5));
        let (m, k, n) = (r.gen_range(1..20), r.gen_range(1..70), r.gen_range(1..50));
        // A as [m, k] or [2, m, k] (then per-tensor zero point only).
        let batched = case % 3 == 2;
        let a_shape = if batched { vec![2, m, k] } else { vec![m, k] };
        let rows = if batched { 2 * m } else { m };
        let a = int8_values(&mut r, rows * k, a_signed);
        let b = int8_values(&mut r, k * n, b_signed);
        let za = match (case % 4, batched) {
            (0, _) => None,
            (1, false) => Some(int8_values(&mut r, m, a_signed)),
            _ => Some(int8_values(&mut r, 1, a_signed)),
        };
        let zb = match case % 5 {
            0 => None,
            1 | 2 => Some(int8_values(&mut r, n, b_signed)),
            _ => Some(int8_values(&mut r, 1, b_signed)),
        };
        let mut want = vec![0i64; rows * n];
        for i in 0..rows {
            let zi = za
                .as_ref()
                .map_or(0, |z| z[if z.len() == 1 { 0 } else { i }]);
            for j in 0..n {
                let zj = zb
                    .as_ref()
                    .map_or(0, |z| z[if z.len() == 1 { 0 } else { j }]);
                want[i * n + j] = (0..k)
                    .map(|p| (a[i * k + p] - zi) * (b[p * n + j] - zj))
                    .sum();
            }
        }
        let mut inputs = vec![
            ("a", int8_tensor(&a_shape, &a, a_signed)),
            ("b", int8_tensor(&[k, n], &b, b_signed)),
        ];
        let zshape = |z: &Vec<i64>| if z.len() == 1 { vec![] } else { vec![z.len()] };
        inputs.push((
            "za",
            match &za {
                Some(z) => int8_tensor(&zshape(z), z, a_signed),
                None => int8_tensor(&[], &[0], a_signed),
            },
        ));
        inputs.push((
            "zb",
            match &zb {
                Some(z) => int8_tensor(&zshape(z), z, b_signed),
                None => int8_tensor(&[], &[0], b_signed),
            },
        ));
        let names = ["a", "b", "za", "zb"];
        let used = if za.is_none() && zb.is_none() { 2 } else { 4 };
        let elem = |s: bool| if s { 3 } else { 2 };
        let mut mp = model(
            vec![node("MatMulInteger", &names[..used], &["y"], vec![])],
            inputs[..used]
                .iter()
                .map(|(nm, t)| {
                    let signed = t.dtype() == ferrum_graph::DType::I8;
                    value(
                        nm,
                        elem(signed),
                        &t.shape()
                            .iter()
                            .map(|&d| Some(d as i64))
                            .collect::<Vec<_>>(),
                    )
                })
                .collect(),
            vec![value("y", 0, &[])],
            vec![],
            13,
        );
        mp.graph.as_mut().unwrap().output[0].r#type = None;
        let s = Session::from_bytes(&encode(&mp)).unwrap();
        let feeds = inputs[..used]
            .iter()
            .map(|(nm, t)| (nm.to_string(), Value::Tensor(t.clone())))
            .collect();
        let out = s.run(feeds).unwrap();
        let y = out[0].1.tensor().unwrap();
        let mut shape = a_shape.clone();
        *shape.last_mut().unwrap() = n;
        assert_eq!(y.shape(), &shape[..], "case {case}");
        let got: Vec<i64> = y
            .as_slice::<i32>()
            .unwrap()
            .iter()
            .map(|&v| v as i64)
            .collect();
        assert!(got == want, "case {case}: {m}x{k}x{n}, A signed {a_signed}, B signed {b_signed}, zero points {:?} / {:?}", za.as_ref().map(Vec::len), zb.as_ref().map(Vec::len));
    }
}

#[test]
fn qlinear_conv_matches_an_exact_reference() {
    // QLinearConv on the integer GEMM against the exact value in f64: every output must equal
    // `clamp(round_half_even(v) + y_zero_point)` of the exact `v = (sum (x - xz)(w - wz) + bias)
    // * x_scale * w_scale / y_scale`, or differ from it by one step where `v` lies within 1e-3
    // of a half (the kernel multiplies in float32).
    let mut r = rng();
    let mut near_half = 0;
    let mut total = 0;
    for case in 0..24 {
        let (x_signed, w_signed, y_signed) = (r.gen_bool(0.5), r.gen_bool(0.5), r.gen_bool(0.5));
        let n = if case % 6 == 5 { 2 } else { 1 };
        let (c, m) = (r.gen_range(1..20), r.gen_range(1..40));
        let (kh, kw) = *[(1, 1), (3, 3), (1, 3), (7, 7), (2, 2)]
            .get(case % 5)
            .unwrap();
        // Case 0 (and 5, 10, ... by chance): a 1x1 filter at stride 1, read in place.
        let (sy, sx) = if case == 0 {
            (1, 1)
        } else {
            (r.gen_range(1..3), r.gen_range(1..3))
        };
        let (dy, dx) = if case % 7 == 3 { (2, 1) } else { (1, 1) };
        let pads: Vec<usize> = (0..4).map(|_| r.gen_range(0..kh.max(kw))).collect();
        let (h, w) = (
            r.gen_range(kh * dy..kh * dy + 12),
            r.gen_range(kw * dx..kw * dx + 12),
        );
        let x = int8_values(&mut r, n * c * h * w, x_signed);
        let wv = int8_values(&mut r, m * c * kh * kw, w_signed);
        let xz = int8_values(&mut r, 1, x_signed)[0];
        let per_channel = case % 2 == 0;
        let nw = if per_channel { m } else { 1 };
        let wz = int8_values(&mut r, nw, w_signed);
        let ws: Vec<f32> = (0..nw).map(|_| r.gen_range(1e-3..2e-2)).collect();
        let xs: f32 = r.gen_range(1e-2..1e-1);
        let ys: f32 = r.gen_range(5e-2..1.0);
        let yz = int8_values(&mut r, 1, y_signed)[0];
        let bias: Option<Vec<i32>> =
            (case % 3 != 1).then(|| (0..m).map(|_| r.gen_range(-20000..20000)).collect());
        let oh = (h + pads[0] + pads[2] - ((kh - 1) * dy + 1)) / sy + 1;
        let ow = (w + pads[1] + pads[3] - ((kw - 1) * dx + 1)) / sx + 1;
        let (lo, hi) = if y_signed {
            (-128.0, 127.0)
        } else {
            (0.0, 255.0)
        };
        let mut want = Vec::new();
        let mut exact = Vec::new();
        for b in 0..n {
            for o in 0..m {
                let wzo = wz[if per_channel { o } else { 0 }];
                let s = xs as f64 * ws[if per_channel { o } else { 0 }] as f64 / ys as f64;
                for oy in 0..oh {
                    for ox in 0..ow {
                        let mut acc = bias.as_ref().map_or(0i64, |bv| bv[o] as i64);
                        for ci in 0..c {
                            for ky in 0..kh {
                                for kx in 0..kw {
                                    let iy = (oy * sy + ky * dy) as isize - pads[0] as isize;
                                    let ix = (ox * sx + kx * dx) as isize - pads[1] as isize;
                                    if iy < 0 || ix < 0 || iy >= h as isize || ix >= w as isize {
                                        continue;
                                    }
                                    let xv = x[((b * c + ci) * h + iy as usize) * w + ix as usize];
                                    let wq = wv[((o * c + ci) * kh + ky) * kw + kx];
                                    acc += (xv - xz) * (wq - wzo);
                                }
                            }
                        }
                        let v = acc as f64 * s;
                        exact.push(v);
                        want.push((v.round_ties_even() + yz as f64).clamp(lo, hi) as i64);
                    }
                }
            }
        }
        let t = |shape: &[usize], v: &[i64], signed: bool| int8_tensor(shape, v, signed);
        let scalar = |v: f32| Tensor::from_vec(vec![], vec![v]).unwrap();
        let zshape: Vec<usize> = if per_channel { vec![m] } else { vec![] };
        let mut inputs: Vec<(&str, Tensor)> = vec![
            ("x", t(&[n, c, h, w], &x, x_signed)),
            ("xs", scalar(xs)),
            ("xz", t(&[], &[xz], x_signed)),
            ("w", t(&[m, c, kh, kw], &wv, w_signed)),
            (
                "ws",
                Tensor::from_vec(if per_channel { vec![m] } else { vec![] }, ws.clone()).unwrap(),
            ),
            ("wz", t(&zshape, &wz, w_signed)),
            ("ys", scalar(ys)),
            ("yz", t(&[], &[yz], y_signed)),
        ];
        if let Some(bv) = &bias {
            inputs.push(("b", Tensor::from_vec(vec![m], bv.clone()).unwrap()));
        }
        let names: Vec<&str> = inputs.iter().map(|(nm, _)| *nm).collect();
        let elem = |t: &Tensor| match t.dtype() {
            ferrum_graph::DType::I8 => 3,
            ferrum_graph::DType::U8 => 2,
            ferrum_graph::DType::I32 => 6,
            _ => 1,
        };
        let mut mp = model(
            vec![node(
                "QLinearConv",
                &names,
                &["y"],
                vec![
                    attr_ints("kernel_shape", &[kh as i64, kw as i64]),
                    attr_ints("strides", &[sy as i64, sx as i64]),
                    attr_ints("dilations", &[dy as i64, dx as i64]),
                    attr_ints("pads", &pads.iter().map(|&p| p as i64).collect::<Vec<_>>()),
                ],
            )],
            inputs
                .iter()
                .map(|(nm, t)| {
                    let dims: Vec<Option<i64>> =
                        t.shape().iter().map(|&d| Some(d as i64)).collect();
                    value(nm, elem(t), &dims)
                })
                .collect(),
            vec![value("y", 0, &[])],
            vec![],
            13,
        );
        mp.graph.as_mut().unwrap().output[0].r#type = None;
        let s = Session::from_bytes(&encode(&mp)).unwrap();
        let feeds = inputs
            .iter()
            .map(|(nm, t)| (nm.to_string(), Value::Tensor(t.clone())))
            .collect();
        let out = s.run(feeds).unwrap();
        let y = out[0].1.tensor().unwrap();
        assert_eq!(y.shape(), &[n, m, oh, ow], "case {case}");
        let got: Vec<i64> = if y_signed {
            y.as_slice::<i8>()
                .unwrap()
                .iter()
                .map(|&v| v as i64)
                .collect()
        } else {
            y.as_slice::<u8>()
                .unwrap()
                .iter()
                .map(|&v| v as i64)
                .collect()
        };
        for (i, ((&g, &wnt), &v)) in got.iter().zip(&want).zip(&exact).enumerate() {
            total += 1;
            if g == wnt {
                continue;
            }
            let frac = v - v.floor();
            assert!(
                (g - wnt).abs() == 1 && (frac - 0.5).abs() < 1e-3,
                "case {case} ({c}->{m}, {kh}x{kw}, x/w/y signed {x_signed}/{w_signed}/{y_signed}, per channel {per_channel}) output {i}: {g}, exact {v} -> {wnt}"
            );
            near_half += 1;
        }
    }
    assert!(
        near_half * 1000 <= total,
        "{near_half} of {total} outputs off by one step"
    );
}

/// 3x3 stride-1 convolutions with constant filters large enough for the Winograd kernel
/// (prepacked filters, at least 4 x 4 tiles: outputs from 7 x 7, odd sizes ending in part
/// tiles), fused with bias, residual and Relu as the passes
/// fuse ResNet's blocks, against a direct f64 convolution: within 1e-5 of the sum of the
/// products' magnitudes (and the bias and residual), per output.
#[test]
fn winograd_convolutions_match_a_direct_sum() {
    use ferrum_graph::proto::build::f32_tensor;
    let mut rng = rng();
    for case in 0..8 {
        let (c, m) = (rng.gen_range(16..33), rng.gen_range(16..41));
        let n = rng.gen_range(1..3);
        let pad = rng.gen_range(0..2);
        let (ih, iw) = (rng.gen_range(9..40), rng.gen_range(9..40));
        let (oh, ow) = (ih + 2 * pad - 2, iw + 2 * pad - 2);
        let x = randv(&mut rng, n * c * ih * iw);
        let w = randv(&mut rng, m * c * 9);
        let b = randv(&mut rng, m);
        let z = randv(&mut rng, n * m * oh * ow);
        let dims = |d: &[usize]| d.iter().map(|&v| Some(v as i64)).collect::<Vec<_>>();
        let mp = model(
            vec![
                node(
                    "Conv",
                    &["x", "w", "b"],
                    &["c"],
                    vec![attr_ints("pads", &[pad as i64; 4])],
                ),
                node("Add", &["c", "z"], &["s"], vec![]),
                node("Relu", &["s"], &["y"], vec![]),
            ],
            vec![
                value("x", 1, &dims(&[n, c, ih, iw])),
                value("z", 1, &dims(&[n, m, oh, ow])),
            ],
            vec![value("y", 1, &dims(&[n, m, oh, ow]))],
            vec![
                f32_tensor("w", &[m as i64, c as i64, 3, 3], &w),
                f32_tensor("b", &[m as i64], &b),
            ],
            17,
        );
        let s = Session::from_bytes(&encode(&mp)).unwrap();
        let feeds = vec![
            (
                "x".to_string(),
                Value::Tensor(Tensor::from_vec(vec![n, c, ih, iw], x.clone()).unwrap()),
            ),
            (
                "z".to_string(),
                Value::Tensor(Tensor::from_vec(vec![n, m, oh, ow], z.clone()).unwrap()),
            ),
        ];
        let got = s.run(feeds).unwrap().remove(0).1.into_tensor().unwrap();
        assert_eq!(got.shape(), &[n, m, oh, ow]);
        let got = got.to_f64_vec().unwrap();
        for bi in 0..n {
            for o in 0..m {
                for oy in 0..oh {
                    for ox in 0..ow {
                        let at = ((bi * m + o) * oh + oy) * ow + ox;
                        let (mut sum, mut mag) = (b[o] as f64 + z[at] as f64, 0f64);
                        mag += (b[o] as f64).abs() + (z[at] as f64).abs();
                        for ci in 0..c {
                            for ky in 0..3 {
                                for kx in 0..3 {
                                    let (iy, ix) = (oy + ky, ox + kx);
                                    if iy < pad || ix < pad || iy - pad >= ih || ix - pad >= iw {
                                        continue;
                                    }
                                    let p = x[((bi * c + ci) * ih + iy - pad) * iw + ix - pad]
                                        as f64
                                        * w[((o * c + ci) * 3 + ky) * 3 + kx] as f64;
                                    sum += p;
                                    mag += p.abs();
                                }
                            }
                        }
                        let want = sum.max(0.0);
                        let err = (got[at] - want).abs();
                        assert!(
                            err <= 1e-5 * mag,
                            "case {case}: {c} -> {m}, {ih}x{iw} pad {pad} n {n}: output {at}: \
                             {} vs {want} (err {err:e}, bound {:e})",
                            got[at],
                            1e-5 * mag
                        );
                    }
                }
            }
        }
    }
}
