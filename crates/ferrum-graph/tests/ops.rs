//! Kernels against hand-computed values, through one-node models.

use ferrum_graph::proto::build::{attr_int, attr_ints, f32_tensor, model, node, value};
use ferrum_graph::proto::{encode, AttributeProto, TensorProto};
use ferrum_graph::{broadcast_shape, Session, Tensor, Value};

/// Runs a one-node model on named f32 inputs; returns the first output.
fn run1(
    op: &str,
    attrs: Vec<AttributeProto>,
    inputs: &[(&str, Vec<usize>, Vec<f32>)],
    inits: Vec<TensorProto>,
    opset: i64,
) -> Tensor {
    let names: Vec<&str> = inputs
        .iter()
        .map(|i| i.0)
        .chain(inits.iter().map(|t| t.name.as_str()))
        .collect();
    let mp = model(
        vec![node(op, &names, &["y"], attrs)],
        inputs
            .iter()
            .map(|(n, s, _)| value(n, 1, &s.iter().map(|&d| Some(d as i64)).collect::<Vec<_>>()))
            .collect(),
        vec![value("y", 0, &[])],
        inits,
        opset,
    );
    let mut mp = mp;
    mp.graph.as_mut().unwrap().output[0].r#type = None;
    let s = Session::from_bytes(&encode(&mp)).unwrap();
    let feeds = inputs
        .iter()
        .map(|(n, s, v)| {
            (
                n.to_string(),
                Value::Tensor(Tensor::from_vec(s.clone(), v.clone()).unwrap()),
            )
        })
        .collect();
    s.run(feeds).unwrap().remove(0).1.into_tensor().unwrap()
}

fn close(a: &[f64], b: &[f64]) {
    assert_eq!(a.len(), b.len(), "{a:?} vs {b:?}");
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() <= 1e-5 + 1e-5 * y.abs(), "{a:?} vs {b:?}");
    }
}

#[test]
fn broadcast_shapes() {
    assert_eq!(broadcast_shape(&[2, 1, 3], &[4, 1]).unwrap(), vec![2, 4, 3]);
    assert_eq!(broadcast_shape(&[], &[5]).unwrap(), vec![5]);
    assert_eq!(broadcast_shape(&[0, 1], &[1, 7]).unwrap(), vec![0, 7]);
    assert!(broadcast_shape(&[2, 3], &[4]).is_err());
}

#[test]
fn add_broadcasts_both_ways() {
    let y = run1(
        "Add",
        vec![],
        &[
            ("a", vec![2, 1], vec![10.0, 20.0]),
            ("b", vec![3], vec![1.0, 2.0, 3.0]),
        ],
        vec![],
        17,
    );
    assert_eq!(y.shape(), &[2, 3]);
    close(
        &y.to_f64_vec().unwrap(),
        &[11.0, 12.0, 13.0, 21.0, 22.0, 23.0],
    );
}

#[test]
fn matmul_batched_and_vector() {
    // [2,2] x [2] -> [2]
    let y = run1(
        "MatMul",
        vec![],
        &[
            ("a", vec![2, 2], vec![1.0, 2.0, 3.0, 4.0]),
            ("b", vec![2], vec![5.0, 6.0]),
        ],
        vec![],
        13,
    );
    assert_eq!(y.shape(), &[2]);
    close(&y.to_f64_vec().unwrap(), &[17.0, 39.0]);
    // batch broadcast: [2,1,2] x [2,1] -> [2,1,1]
    let y = run1(
        "MatMul",
        vec![],
        &[
            ("a", vec![2, 1, 2], vec![1.0, 2.0, 3.0, 4.0]),
            ("b", vec![2, 1], vec![1.0, 1.0]),
        ],
        vec![],
        13,
    );
    assert_eq!(y.shape(), &[2, 1, 1]);
    close(&y.to_f64_vec().unwrap(), &[3.0, 7.0]);
}

#[test]
fn softmax_new_and_legacy_axes() {
    let x = vec![1.0, 2.0, 3.0, 1.0, 1.0, 1.0];
    let y = run1(
        "Softmax",
        vec![],
        &[("x", vec![2, 3], x.clone())],
        vec![],
        13,
    );
    let e: Vec<f64> = [1.0f64, 2.0, 3.0].iter().map(|v| v.exp()).collect();
    let s: f64 = e.iter().sum();
    close(
        &y.to_f64_vec().unwrap(),
        &[
            e[0] / s,
            e[1] / s,
            e[2] / s,
            1.0 / 3.0,
            1.0 / 3.0,
            1.0 / 3.0,
        ],
    );
    // opset 11, axis 0: the whole tensor is one row
    let y = run1(
        "Softmax",
        vec![attr_int("axis", 0)],
        &[("x", vec![2, 3], x)],
        vec![],
        11,
    );
    let total: f64 = y.to_f64_vec().unwrap().iter().sum();
    assert!((total - 1.0).abs() < 1e-6);
}

#[test]
fn conv_with_padding() {
    // 3x3 input 1..9, 2x2 kernel of ones, pads 1: corner sums.
    let x: Vec<f32> = (1..=9).map(|v| v as f32).collect();
    let w = f32_tensor("w", &[1, 1, 2, 2], &[1.0; 4]);
    let y = run1(
        "Conv",
        vec![attr_ints("pads", &[1, 1, 1, 1])],
        &[("x", vec![1, 1, 3, 3], x)],
        vec![w],
        13,
    );
    assert_eq!(y.shape(), &[1, 1, 4, 4]);
    close(
        &y.to_f64_vec().unwrap(),
        &[
            1.0, 3.0, 5.0, 3.0, 5.0, 12.0, 16.0, 9.0, 11.0, 24.0, 28.0, 15.0, 7.0, 15.0, 17.0, 9.0,
        ],
    );
}

#[test]
fn gather_negative_indices_and_transpose() {
    let idx = TensorProto {
        name: "i".into(),
        dims: vec![2],
        data_type: 7,
        int64_data: vec![-1, 0],
        ..Default::default()
    };
    let y = run1(
        "Gather",
        vec![attr_int("axis", 1)],
        &[("x", vec![2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0])],
        vec![idx],
        13,
    );
    assert_eq!(y.shape(), &[2, 2]);
    close(&y.to_f64_vec().unwrap(), &[3.0, 1.0, 6.0, 4.0]);
    let y = run1(
        "Transpose",
        vec![],
        &[("x", vec![2, 3], vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0])],
        vec![],
        13,
    );
    assert_eq!(y.shape(), &[3, 2]);
    close(&y.to_f64_vec().unwrap(), &[1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
}

#[test]
fn reduce_mean_keepdims_and_axes_input() {
    let axes = TensorProto {
        name: "axes".into(),
        dims: vec![1],
        data_type: 7,
        int64_data: vec![1],
        ..Default::default()
    };
    let y = run1(
        "ReduceMean",
        vec![attr_int("keepdims", 0)],
        &[("x", vec![2, 2], vec![1.0, 3.0, 5.0, 9.0])],
        vec![axes],
        18,
    );
    assert_eq!(y.shape(), &[2]);
    close(&y.to_f64_vec().unwrap(), &[2.0, 7.0]);
}

/// Random shapes, values and attributes for many kernels: each returns a result or an error,
/// never panics (a hostile model can put any of these in front of a kernel).
#[test]
fn kernels_never_panic_on_random_inputs() {
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    // (op, number of float inputs, integer inputs as (count), attributes to randomize)
    let ops: &[(&str, usize, usize, &[&str])] = &[
        ("Softmax", 1, 0, &["axis"]),
        ("LogSoftmax", 1, 0, &["axis"]),
        ("Concat", 2, 0, &["axis"]),
        ("Split", 1, 0, &["axis"]),
        ("Transpose", 1, 0, &[]),
        ("Flatten", 1, 0, &["axis"]),
        ("ReduceSum", 1, 1, &["keepdims"]),
        ("ReduceMax", 1, 1, &["keepdims"]),
        ("ArgMax", 1, 0, &["axis", "keepdims"]),
        ("Gather", 1, 1, &["axis"]),
        ("GatherElements", 1, 1, &["axis"]),
        ("GatherND", 1, 1, &["batch_dims"]),
        ("ScatterElements", 1, 1, &["axis"]),
        ("Reshape", 1, 1, &[]),
        ("Expand", 1, 1, &[]),
        ("Tile", 1, 1, &[]),
        ("Unsqueeze", 1, 1, &[]),
        ("Squeeze", 1, 1, &[]),
        ("Slice", 1, 2, &[]),
        ("Pad", 1, 1, &[]),
        ("TopK", 1, 1, &["axis"]),
        ("CumSum", 1, 1, &[]),
        ("OneHot", 0, 3, &["axis"]),
        ("MatMul", 2, 0, &[]),
        ("Add", 2, 0, &[]),
        ("Where", 2, 0, &[]),
        ("Conv", 2, 0, &["group"]),
        ("MaxPool", 1, 0, &[]),
        ("Einsum", 2, 0, &[]),
        ("Trilu", 1, 1, &["upper"]),
        ("DepthToSpace", 1, 0, &["blocksize"]),
        ("Resize", 1, 0, &[]),
        ("LayerNormalization", 2, 0, &["axis"]),
    ];
    for round in 0..400 {
        for &(op, nf, ni, attrs) in ops {
            let mut inputs = Vec::new();
            let mut feeds = Vec::new();
            let mut names = Vec::new();
            for k in 0..nf + ni {
                let rank = (next() % 4) as usize;
                let shape: Vec<usize> = (0..rank).map(|_| (next() % 4) as usize).collect();
                let n: usize = shape.iter().product();
                let name = format!("i{k}");
                let t = if k < nf {
                    Tensor::from_vec(
                        shape.clone(),
                        (0..n).map(|_| (next() % 7) as f32 - 3.0).collect(),
                    )
                    .unwrap()
                } else {
                    Tensor::from_vec(
                        shape.clone(),
                        (0..n).map(|_| (next() % 9) as i64 - 4).collect(),
                    )
                    .unwrap()
                };
                let elem = if k < nf { 1 } else { 7 };
                inputs.push(value(
                    &name,
                    elem,
                    &shape.iter().map(|&d| Some(d as i64)).collect::<Vec<_>>(),
                ));
                feeds.push((name.clone(), Value::Tensor(t)));
                names.push(name);
            }
            if op == "Where" {
                // a bool condition first
                let c = Tensor::from_vec(vec![2], vec![true, false]).unwrap();
                inputs.insert(0, value("c", 9, &[Some(2)]));
                feeds.insert(0, ("c".into(), Value::Tensor(c)));
                names.insert(0, "c".into());
            }
            let mut node_attrs: Vec<AttributeProto> = attrs
                .iter()
                .map(|a| attr_int(a, (next() % 9) as i64 - 4))
                .collect();
            match op {
                "MaxPool" => node_attrs.push(attr_ints("kernel_shape", &[(next() % 3) as i64 + 1])),
                "Einsum" => node_attrs.push(AttributeProto {
                    name: "equation".into(),
                    s: ["ij,jk->ik", "i,i", "...i,...i->...", "ii->i", "ab,bc"]
                        [(next() % 5) as usize]
                        .into(),
                    r#type: 3,
                    ..Default::default()
                }),
                "Resize" => node_attrs.push(AttributeProto {
                    name: "mode".into(),
                    s: ["nearest", "linear", "cubic"][(next() % 3) as usize].into(),
                    r#type: 3,
                    ..Default::default()
                }),
                _ => {}
            }
            let refs: Vec<&str> = names.iter().map(String::as_str).collect();
            let mut refs = refs;
            if op == "Resize" {
                refs.extend(["", "scales"]);
                inputs.push(value("scales", 1, &[Some(2)]));
                feeds.push((
                    "scales".into(),
                    Value::Tensor(Tensor::from_vec(vec![2], vec![1.5f32, 0.5]).unwrap()),
                ));
            }
            let mut mp = model(
                vec![node(op, &refs, &["y"], node_attrs)],
                inputs,
                vec![value("y", 1, &[])],
                vec![],
                18,
            );
            mp.graph.as_mut().unwrap().output[0].r#type = None;
            let bytes = encode(&mp);
            // The executor turns a kernel panic into an "internal error"; none may occur.
            let r = std::panic::catch_unwind(|| match Session::from_bytes(&bytes) {
                Ok(s) => s.run(feeds.clone()).err().map(|e| e.to_string()),
                Err(_) => None,
            });
            let msg = r
                .unwrap_or_else(|_| Some("panicked".into()))
                .unwrap_or_default();
            assert!(
                !msg.contains("panicked"),
                "round {round}: {op} panicked on {feeds:?}: {msg}"
            );
        }
    }
}

#[test]
fn view_ops_move_a_last_read_value_and_copy_one_read_again() {
    // y = Relu(x) is read by Reshape and again by the Add after it (so it must survive the
    // reshape); r = Reshape(y) is read only by Unsqueeze, whose result only by Squeeze, and x
    // itself is a graph output reshaped by Flatten (an output is never moved away).
    let shape = TensorProto {
        name: "shape".into(),
        dims: vec![2],
        data_type: 7,
        int64_data: vec![3, -1],
        ..Default::default()
    };
    let mp = model(
        vec![
            node("Relu", &["x"], &["y"], vec![]),
            node("Reshape", &["y", "shape"], &["r"], vec![]),
            node("Unsqueeze", &["r"], &["u"], vec![attr_ints("axes", &[0])]),
            node("Squeeze", &["u"], &["s"], vec![attr_ints("axes", &[0])]),
            node("Add", &["y", "y"], &["d"], vec![]),
            node("Flatten", &["x"], &["f"], vec![attr_int("axis", 0)]),
        ],
        vec![value("x", 1, &[Some(2), Some(3)])],
        ["s", "d", "f", "x"]
            .iter()
            .map(|n| {
                let mut v = value(n, 1, &[]);
                v.r#type = None;
                v
            })
            .collect(),
        vec![shape],
        11,
    );
    let x = vec![-1.0f32, 2.0, -3.0, 4.0, 5.0, -6.0];
    let relu: Vec<f32> = x.iter().map(|v| v.max(0.0)).collect();
    let s = Session::from_bytes(&encode(&mp)).unwrap();
    for _ in 0..2 {
        let out = s
            .run(vec![(
                "x".into(),
                Value::Tensor(Tensor::from_vec(vec![2, 3], x.clone()).unwrap()),
            )])
            .unwrap();
        let t = |i: usize| out[i].1.tensor().unwrap().clone();
        assert_eq!(t(0).shape(), &[3, 2]);
        assert_eq!(t(0).as_slice::<f32>().unwrap(), &relu[..]);
        let doubled: Vec<f32> = relu.iter().map(|v| v + v).collect();
        assert_eq!(t(1).as_slice::<f32>().unwrap(), &doubled[..]);
        assert_eq!(t(2).shape(), &[1, 6]);
        assert_eq!(t(2).as_slice::<f32>().unwrap(), &x[..]);
        assert_eq!(t(3).shape(), &[2, 3]);
        assert_eq!(t(3).as_slice::<f32>().unwrap(), &x[..]);
    }
}

#[test]
fn transposes_that_keep_memory_order_are_views_and_others_move_elements() {
    // At batch 1, PyTorch's batch-first / sequence-first swaps (perm [1, 0, 2] on 1 x 2 x 3)
    // keep every element where it is: the executor moves the value under its new shape when
    // the Transpose is its last reader (a), and copies it otherwise (d, read again by c's
    // real transpose, [0, 2, 1]).
    let mp = model(
        vec![
            node("Relu", &["x"], &["y"], vec![]),
            node(
                "Transpose",
                &["y"],
                &["d"],
                vec![attr_ints("perm", &[1, 0, 2])],
            ),
            node(
                "Transpose",
                &["y"],
                &["c"],
                vec![attr_ints("perm", &[0, 2, 1])],
            ),
            node(
                "Transpose",
                &["y"],
                &["a"],
                vec![attr_ints("perm", &[1, 0, 2])],
            ),
            node("Neg", &["a"], &["b"], vec![]),
        ],
        vec![value("x", 1, &[Some(1), Some(2), Some(3)])],
        ["d", "b", "c"]
            .iter()
            .map(|n| {
                let mut v = value(n, 1, &[]);
                v.r#type = None;
                v
            })
            .collect(),
        vec![],
        13,
    );
    let x = vec![-1.0f32, 2.0, -3.0, 4.0, 5.0, -6.0];
    let relu: Vec<f32> = x.iter().map(|v| v.max(0.0)).collect();
    let s = Session::from_bytes(&encode(&mp)).unwrap();
    for _ in 0..2 {
        let out = s
            .run(vec![(
                "x".into(),
                Value::Tensor(Tensor::from_vec(vec![1, 2, 3], x.clone()).unwrap()),
            )])
            .unwrap();
        let t = |i: usize| out[i].1.tensor().unwrap().clone();
        assert_eq!(t(0).shape(), &[2, 1, 3]);
        assert_eq!(t(0).as_slice::<f32>().unwrap(), &relu[..]);
        assert_eq!(t(1).shape(), &[2, 1, 3]);
        let neg: Vec<f32> = relu.iter().map(|v| -v).collect();
        assert_eq!(t(1).as_slice::<f32>().unwrap(), &neg[..]);
        assert_eq!(t(2).shape(), &[1, 3, 2]);
        let want: Vec<f32> = [0, 3, 1, 4, 2, 5].iter().map(|&i| relu[i]).collect();
        assert_eq!(t(2).as_slice::<f32>().unwrap(), &want[..]);
    }
}

/// Slice (the run-copying path for step-1 inner dims and the element gather for the rest) and
/// ReduceSum / ReduceMean / ReduceMax over random axes, against plain index arithmetic in the
/// test, on fresh random shapes and values each run (the seed is in every failure).
#[test]
fn slice_and_reduce_match_plain_index_arithmetic() {
    use ferrum_graph::proto::build::i64_vector;
    use rand::{Rng, SeedableRng};
    let seed: u64 = rand::random();
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    for case in 0..200 {
        let rank = r.gen_range(1..=4);
        let shape: Vec<usize> = (0..rank).map(|_| r.gen_range(1..=24)).collect();
        let n: usize = shape.iter().product();
        let x: Vec<f32> = (0..n).map(|_| r.gen_range(-4.0f32..4.0)).collect();
        let st: Vec<usize> = (0..rank).map(|d| shape[d + 1..].iter().product()).collect();
        // Slice: every axis, mostly step 1 (the run path), sometimes other steps.
        let (mut starts, mut ends, mut steps, mut axes) = (vec![], vec![], vec![], vec![]);
        for (d, &len) in shape.iter().enumerate() {
            if r.gen_bool(0.3) {
                continue;
            }
            let step: i64 = if r.gen_bool(0.8) {
                1
            } else {
                [-2i64, -1, 2, 3][r.gen_range(0..4)]
            };
            let l = len as i64;
            starts.push(r.gen_range(-l - 2..=l + 2));
            ends.push(r.gen_range(-l - 2..=l + 2));
            steps.push(step);
            axes.push(if r.gen_bool(0.5) {
                d as i64
            } else {
                d as i64 - rank as i64
            });
        }
        let picks: Vec<Vec<usize>> = (0..rank)
            .map(|d| {
                match axes
                    .iter()
                    .position(|&a| (a + rank as i64) as usize % rank == d)
                {
                    None => (0..shape[d]).collect(),
                    Some(k) => {
                        let (l, step) = (shape[d] as i64, steps[k]);
                        let fix = |v: i64| if v < 0 { v + l } else { v };
                        let (s, e) = (fix(starts[k]), fix(ends[k]));
                        let mut v = vec![];
                        if step > 0 {
                            let mut i = s.clamp(0, l);
                            while i < e.clamp(0, l) {
                                v.push(i as usize);
                                i += step;
                            }
                        } else {
                            let mut i = s.clamp(0, l - 1);
                            while i > e.clamp(-1, l - 1) {
                                v.push(i as usize);
                                i += step;
                            }
                        }
                        v
                    }
                }
            })
            .collect();
        let out_shape: Vec<usize> = picks.iter().map(|p| p.len()).collect();
        let mut want = vec![];
        let total: usize = out_shape.iter().product();
        for o in 0..total {
            let mut rem = o;
            let mut at = 0;
            for d in (0..rank).rev() {
                at += picks[d][rem % out_shape[d]] * st[d];
                rem /= out_shape[d];
            }
            want.push(x[at]);
        }
        let got = run1(
            "Slice",
            vec![],
            &[("x", shape.clone(), x.clone())],
            vec![
                i64_vector("starts", &starts),
                i64_vector("ends", &ends),
                i64_vector("axes", &axes),
                i64_vector("steps", &steps),
            ],
            13,
        );
        assert_eq!(
            got.shape(),
            &out_shape[..],
            "seed {seed} case {case}: {shape:?}"
        );
        let g = got.as_slice::<f32>().unwrap();
        assert!(
            g.iter().zip(&want).all(|(a, b)| a.to_bits() == b.to_bits()),
            "seed {seed} case {case}: slice of {shape:?} starts {starts:?} ends {ends:?} axes \
             {axes:?} steps {steps:?}"
        );

        // Reductions over a random non-empty set of axes, kept dims.
        let red: Vec<usize> = (0..rank).filter(|_| r.gen_bool(0.5)).collect();
        let red = if red.is_empty() {
            vec![r.gen_range(0..rank)]
        } else {
            red
        };
        let kept: Vec<usize> = (0..rank)
            .map(|d| if red.contains(&d) { 1 } else { shape[d] })
            .collect();
        let m: usize = kept.iter().product();
        let (mut sum, mut max) = (vec![0f64; m], vec![f32::NEG_INFINITY; m]);
        for (i, &v) in x.iter().enumerate() {
            let mut o = 0;
            let mut mul = 1;
            for d in (0..rank).rev() {
                let c = if red.contains(&d) {
                    0
                } else {
                    i / st[d] % shape[d]
                };
                o += c * mul;
                mul *= kept[d];
            }
            sum[o] += v as f64;
            max[o] = max[o].max(v);
        }
        let count = (n / m) as f64;
        let axes_t = i64_vector("axes", &red.iter().map(|&a| a as i64).collect::<Vec<_>>());
        for (op, want) in [
            (
                "ReduceSum",
                sum.iter().map(|&s| s as f32).collect::<Vec<_>>(),
            ),
            (
                "ReduceMean",
                sum.iter().map(|&s| (s / count) as f32).collect(),
            ),
            ("ReduceMax", max.clone()),
        ] {
            let got = run1(
                op,
                vec![],
                &[("x", shape.clone(), x.clone())],
                vec![axes_t.clone()],
                18,
            );
            assert_eq!(got.shape(), &kept[..], "seed {seed} case {case}: {op}");
            let g = got.as_slice::<f32>().unwrap();
            for (a, b) in g.iter().zip(&want) {
                assert!(
                    a.is_finite() && (a - b).abs() <= 1e-6 * (1.0 + b.abs()),
                    "seed {seed} case {case}: {op} over {red:?} of {shape:?}: {a} vs {b}"
                );
            }
        }
    }
}

/// Inference BatchNormalization and 2-D AveragePool on float32 (their fast paths) against
/// plain f64 formulas in the test, on fresh random shapes, parameters, pads, strides and
/// `count_include_pad` each run (the seed is in every failure).
#[test]
fn batch_norm_and_average_pool_match_f64_formulas() {
    use rand::{Rng, SeedableRng};
    let seed: u64 = rand::random();
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    for case in 0..60 {
        let (n, c, h, w) = (
            r.gen_range(1..=2),
            r.gen_range(1..=6),
            r.gen_range(1..=13),
            r.gen_range(1..=13),
        );
        let len = n * c * h * w;
        let x: Vec<f32> = (0..len).map(|_| r.gen_range(-5.0f32..5.0)).collect();
        let p = |r: &mut rand::rngs::StdRng, lo: f32, hi: f32| -> Vec<f32> {
            (0..c).map(|_| r.gen_range(lo..hi)).collect()
        };
        let (scale, bias, mean, var) = (
            p(&mut r, -2.0, 2.0),
            p(&mut r, -2.0, 2.0),
            p(&mut r, -1.0, 1.0),
            p(&mut r, 0.01, 3.0),
        );
        let eps = 1e-5f32;
        let got = run1(
            "BatchNormalization",
            vec![],
            &[("x", vec![n, c, h, w], x.clone())],
            vec![
                f32_tensor("s", &[c as i64], &scale),
                f32_tensor("b", &[c as i64], &bias),
                f32_tensor("m", &[c as i64], &mean),
                f32_tensor("v", &[c as i64], &var),
            ],
            15,
        );
        let g = got.as_slice::<f32>().unwrap();
        for (i, (&a, &xv)) in g.iter().zip(&x).enumerate() {
            let ch = i / (h * w) % c;
            let inv = 1.0 / (var[ch] as f64 + eps as f64).sqrt();
            let want = (xv as f64 - mean[ch] as f64) * inv * scale[ch] as f64 + bias[ch] as f64;
            // Two f32 roundings of terms up to |x - mean| |a| and |b|.
            let mag = (xv as f64 - mean[ch] as f64).abs() * inv * (scale[ch] as f64).abs()
                + (bias[ch] as f64).abs();
            assert!(
                a.is_finite() && (a as f64 - want).abs() <= 3e-7 * mag + 1e-30,
                "seed {seed} case {case}: BatchNormalization element {i}: {a} vs {want}"
            );
        }

        let (kh, kw) = (r.gen_range(1..=h.min(4)), r.gen_range(1..=w.min(4)));
        let (sh, sw) = (r.gen_range(1..=3), r.gen_range(1..=3));
        let pads: Vec<usize> = vec![
            r.gen_range(0..kh),
            r.gen_range(0..kw),
            r.gen_range(0..kh),
            r.gen_range(0..kw),
        ];
        let include = r.gen_bool(0.5);
        let got = run1(
            "AveragePool",
            vec![
                attr_ints("kernel_shape", &[kh as i64, kw as i64]),
                attr_ints("strides", &[sh as i64, sw as i64]),
                attr_ints("pads", &pads.iter().map(|&v| v as i64).collect::<Vec<_>>()),
                attr_int("count_include_pad", include as i64),
            ],
            &[("x", vec![n, c, h, w], x.clone())],
            vec![],
            11,
        );
        let oh = (h + pads[0] + pads[2] - kh) / sh + 1;
        let ow = (w + pads[1] + pads[3] - kw) / sw + 1;
        assert_eq!(got.shape(), &[n, c, oh, ow], "seed {seed} case {case}");
        let g = got.as_slice::<f32>().unwrap();
        for pl in 0..n * c {
            for oy in 0..oh {
                for ox in 0..ow {
                    let (mut sum, mut inside) = (0f64, 0usize);
                    for ky in 0..kh {
                        for kx in 0..kw {
                            let y = (oy * sh + ky) as isize - pads[0] as isize;
                            let xx = (ox * sw + kx) as isize - pads[1] as isize;
                            if y >= 0 && y < h as isize && xx >= 0 && xx < w as isize {
                                sum += x[pl * h * w + y as usize * w + xx as usize] as f64;
                                inside += 1;
                            }
                        }
                    }
                    let count = if include { kh * kw } else { inside.max(1) };
                    let want = (sum / count as f64) as f32;
                    let a = g[(pl * oh + oy) * ow + ox];
                    assert!(
                        a.to_bits() == want.to_bits(),
                        "seed {seed} case {case}: AveragePool k {kh}x{kw} s {sh}x{sw} pads \
                         {pads:?} include {include}, plane {pl} ({oy}, {ox}): {a} vs {want}"
                    );
                }
            }
        }
    }
}
