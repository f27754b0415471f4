//! The graph passes: each rewrite fires on the pattern PyTorch exports (the graph after the
//! passes has the expected nodes) and leaves the outputs unchanged (the same model at level 0,
//! on fresh random inputs). Tolerance: |optimised - unoptimised| <= 1e-5 * (1 + max |output|)
//! for rewrites that change float rounding (weights folded, f32 epilogues), exact equality for
//! the others. NaN never passes.

use ferrum_graph::proto::build::{attr_int, attr_ints, f32_tensor, model, node, value};
use ferrum_graph::proto::{encode, AttributeProto, ModelProto, NodeProto, TensorProto};
use ferrum_graph::{OptLevel, Precision, Session, SessionOptions, Tensor, Value};
use rand::{Rng, SeedableRng};

type Rng64 = rand::rngs::StdRng;

fn rng() -> Rng64 {
    let seed: u64 = rand::random();
    eprintln!("seed {seed}");
    Rng64::seed_from_u64(seed)
}

fn randv(rng: &mut Rng64, n: usize) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
}

fn attr_f(name: &str, f: f32) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        f,
        r#type: 1,
        ..Default::default()
    }
}

fn attr_s(name: &str, s: &str) -> AttributeProto {
    AttributeProto {
        name: name.into(),
        s: s.as_bytes().to_vec(),
        r#type: 3,
        ..Default::default()
    }
}

fn constant(out: &str, dims: &[i64], v: &[f32]) -> NodeProto {
    node(
        "Constant",
        &[],
        &[out],
        vec![AttributeProto {
            name: "value".into(),
            t: Some(f32_tensor("", dims, v)),
            r#type: 4,
            ..Default::default()
        }],
    )
}

fn session(mp: &ModelProto, level: OptLevel) -> Session {
    Session::from_bytes_with(
        &encode(mp),
        &SessionOptions {
            opt_level: level,
            ..Default::default()
        },
    )
    .unwrap()
}

/// The optimised graph's ops, `domain.op` for fused ones.
fn ops(s: &Session) -> Vec<String> {
    s.model()
        .graph
        .nodes
        .iter()
        .map(|n| {
            if n.domain.is_empty() {
                n.op.clone()
            } else {
                format!("{}.{}", n.domain, n.op)
            }
        })
        .collect()
}

fn outputs(s: &Session, feeds: &[(&str, Vec<usize>, Vec<f32>)]) -> Vec<Vec<f32>> {
    let feeds = feeds
        .iter()
        .map(|(n, s, v)| {
            (
                n.to_string(),
                Value::Tensor(Tensor::from_vec(s.clone(), v.clone()).unwrap()),
            )
        })
        .collect();
    s.run(feeds)
        .unwrap()
        .into_iter()
        .map(|(_, v)| v.tensor().unwrap().as_slice::<f32>().unwrap().to_vec())
        .collect()
}

/// Runs `mp` at level 0 and at `level`, checks the optimised graph's ops and that the outputs
/// agree (exactly when `tol` is 0).
fn check(
    mp: &ModelProto,
    level: OptLevel,
    feeds: &[(&str, Vec<usize>, Vec<f32>)],
    want_ops: &[&str],
    tol: f32,
) {
    let plain = session(mp, OptLevel::Disabled);
    let opt = session(mp, level);
    assert_eq!(ops(&opt), want_ops, "graph after the passes");
    let (a, b) = (outputs(&plain, feeds), outputs(&opt, feeds));
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.len(), y.len());
        let scale = 1.0 + x.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (i, (u, v)) in x.iter().zip(y).enumerate() {
            let err = (u - v).abs();
            assert!(
                if tol == 0.0 {
                    u.to_bits() == v.to_bits()
                } else {
                    err <= tol * scale
                },
                "output element {i}: unoptimised {u}, optimised {v}"
            );
        }
    }
}

fn f32_in(name: &str, dims: &[i64]) -> ferrum_graph::proto::ValueInfoProto {
    value(name, 1, &dims.iter().map(|&d| Some(d)).collect::<Vec<_>>())
}

fn f32_out(name: &str) -> ferrum_graph::proto::ValueInfoProto {
    let mut v = value(name, 1, &[]);
    v.r#type = None;
    v
}

fn init(name: &str, dims: &[i64], v: Vec<f32>) -> TensorProto {
    f32_tensor(name, dims, &v)
}

#[test]
fn level_zero_leaves_the_graph_as_imported() {
    let mp = model(
        vec![
            constant("c", &[1], &[2.0]),
            node("Identity", &["x"], &["i"], vec![]),
            node("Mul", &["i", "c"], &["y"], vec![]),
        ],
        vec![f32_in("x", &[4])],
        vec![f32_out("y")],
        vec![],
        17,
    );
    let s = session(&mp, OptLevel::Disabled);
    assert_eq!(ops(&s), ["Constant", "Identity", "Mul"]);
    assert_eq!(s.optimization_report().nodes_after, 3);
}

#[test]
fn constants_fold_and_identities_and_dead_nodes_go() {
    let mut r = rng();
    // y = Relu(Identity(x) * (c1 + c2)); an unused Sigmoid(x) branch; z = Identity(x) is a graph
    // output and stays.
    let mp = model(
        vec![
            constant("c1", &[3], &[1.0, 2.0, 3.0]),
            constant("c2", &[3], &[0.5, -4.0, 0.25]),
            node("Add", &["c1", "c2"], &["c"], vec![]),
            node("Identity", &["x"], &["i"], vec![]),
            node("Mul", &["i", "c"], &["m"], vec![]),
            node("Sigmoid", &["x"], &["unused"], vec![]),
            node("Dropout", &["m"], &["d"], vec![]),
            node("Relu", &["d"], &["y"], vec![]),
            node("Identity", &["x"], &["z"], vec![]),
        ],
        vec![f32_in("x", &[2, 3])],
        vec![f32_out("y"), f32_out("z")],
        vec![],
        17,
    );
    let feeds = [("x", vec![2, 3], randv(&mut r, 6))];
    check(
        &mp,
        OptLevel::Basic,
        &feeds,
        &["Mul", "Relu", "Identity"],
        0.0,
    );
}

#[test]
fn dropout_in_training_mode_stays() {
    let mp = model(
        vec![node("Dropout", &["x", "r", "t"], &["y"], vec![])],
        vec![f32_in("x", &[8]), f32_in("r", &[]), value("t", 9, &[])],
        vec![f32_out("y")],
        vec![],
        17,
    );
    assert_eq!(ops(&session(&mp, OptLevel::All)), ["Dropout"]);
}

/// A Conv's nodes and initializers: x [1, c, h, w] -> name's output, 3x3 pad 1.
fn conv(
    r: &mut Rng64,
    name: &str,
    x: &str,
    out: &str,
    (c, m): (usize, usize),
    bias: bool,
    inits: &mut Vec<TensorProto>,
) -> NodeProto {
    let w = format!("{name}.w");
    let b = format!("{name}.b");
    inits.push(init(&w, &[m as i64, c as i64, 3, 3], randv(r, m * c * 9)));
    let mut ins = vec![x.to_string(), w];
    if bias {
        inits.push(init(&b, &[m as i64], randv(r, m)));
        ins.push(b);
    }
    let ins: Vec<&str> = ins.iter().map(String::as_str).collect();
    node(
        "Conv",
        &ins,
        &[out],
        vec![ferrum_graph::proto::build::attr_ints("pads", &[1, 1, 1, 1])],
    )
}

#[test]
fn batch_norm_and_channel_constants_fold_into_the_conv() {
    let mut r = rng();
    let (c, m) = (3, 5);
    let mut inits = Vec::new();
    let bias = r.gen_bool(0.5);
    let cv = conv(&mut r, "c0", "x", "a", (c, m), bias, &mut inits);
    inits.push(init("s", &[m as i64], randv(&mut r, m)));
    inits.push(init("bb", &[m as i64], randv(&mut r, m)));
    inits.push(init("mean", &[m as i64], randv(&mut r, m)));
    inits.push(init(
        "var",
        &[m as i64],
        (0..m).map(|_| r.gen_range(0.1f32..2.0)).collect(),
    ));
    inits.push(init("k", &[m as i64, 1, 1], randv(&mut r, m)));
    inits.push(init("q", &[1, m as i64, 1, 1], randv(&mut r, m)));
    let mp = model(
        vec![
            cv,
            node(
                "BatchNormalization",
                &["a", "s", "bb", "mean", "var"],
                &["n"],
                vec![attr_f("epsilon", 1e-3)],
            ),
            node("Mul", &["n", "k"], &["p"], vec![]),
            node("Add", &["q", "p"], &["y"], vec![]),
        ],
        vec![f32_in("x", &[1, c as i64, 6, 7])],
        vec![f32_out("y")],
        inits,
        17,
    );
    let feeds = [("x", vec![1, c, 6, 7], randv(&mut r, c * 42))];
    check(&mp, OptLevel::Basic, &feeds, &["Conv"], 1e-5);
}

#[test]
fn residual_add_and_relu_fuse_into_the_conv_as_in_resnet() {
    let mut r = rng();
    let c = 4;
    let mut inits = Vec::new();
    // a = Relu(conv1(x)); b = conv2(a); y = Relu(b + x)   (the residual exists before conv2)
    // d = conv3(x) computed after e = conv4(x): f = Relu(d + e)  (the residual comes later)
    let nodes = vec![
        conv(&mut r, "c1", "x", "a0", (c, c), true, &mut inits),
        node("Relu", &["a0"], &["a"], vec![]),
        conv(&mut r, "c2", "a", "b", (c, c), false, &mut inits),
        node("Add", &["b", "x"], &["s"], vec![]),
        node("Relu", &["s"], &["y"], vec![]),
        conv(&mut r, "c3", "y", "d", (c, c), true, &mut inits),
        conv(&mut r, "c4", "y", "e", (c, c), true, &mut inits),
        node("Add", &["e", "d"], &["f0"], vec![]),
        node("Relu", &["f0"], &["f"], vec![]),
    ];
    let mp = model(
        nodes,
        vec![f32_in("x", &[1, c as i64, 5, 6])],
        vec![f32_out("f")],
        inits,
        17,
    );
    let feeds = [("x", vec![1, c, 5, 6], randv(&mut r, c * 30))];
    let fc = "com.ferrum.FusedConv";
    // c4 stays a Conv: the Add it feeds went to c3, which moves after it.
    check(&mp, OptLevel::Extended, &feeds, &[fc, fc, "Conv", fc], 1e-5);
    // The fusions record what they absorbed.
    let s = session(&mp, OptLevel::All);
    let log = &s.optimization_report().fused;
    assert!(
        log.iter().any(|l| l.contains("residual add + Relu")),
        "{log:?}"
    );
    // At level 1 nothing fuses.
    let s = session(&mp, OptLevel::Basic);
    assert_eq!(ops(&s).iter().filter(|o| o.as_str() == "Conv").count(), 4);
}

/// A FusedConv that is the last to read its residual writes its output in the residual's
/// memory (`Session::outputs_in_place`), with the bits it gives when the residual is read on
/// afterwards (a graph output too, so not handed over): a 1x1 product of depth 800 (past one
/// block of K), and a depthwise one, which reads the residual as usual. Outputs within 1e-5 of
/// the unfused graph's.
#[test]
fn a_conv_last_to_read_its_residual_writes_into_it_with_the_same_bits() {
    let mut r = rng();
    let (c, m, deep) = (6usize, 8usize, 800usize);
    let pointwise = |r: &mut Rng64, name: &str, x: &str, out: &str, (ci, co), group: usize| {
        let w = init(
            &format!("{name}.w"),
            &[co as i64, (ci / group) as i64, 1, 1],
            randv(r, co * ci / group),
        );
        let b = init(&format!("{name}.b"), &[co as i64], randv(r, co));
        let attrs = vec![ferrum_graph::proto::build::attr_int("group", group as i64)];
        let n = node("Conv", &[x, &w.name, &b.name], &[out], attrs);
        (n, [w, b])
    };
    for depthwise in [false, true] {
        let mut inits = Vec::new();
        // a = Relu(conv(x)); h = conv1x1(a) to `deep` channels (or a depthwise conv); b =
        // conv1x1(h) back to m; y = Relu(b + a).
        let mut nodes = vec![
            conv(&mut r, "c1", "x", "a0", (c, m), true, &mut inits),
            node("Relu", &["a0"], &["a"], vec![]),
        ];
        let (n2, w2) = if depthwise {
            pointwise(&mut r, "c2", "a", "h", (m, m), 1)
        } else {
            pointwise(&mut r, "c2", "a", "h", (m, deep), 1)
        };
        let (n3, w3) = if depthwise {
            pointwise(&mut r, "c3", "h", "b", (m, m), m)
        } else {
            pointwise(&mut r, "c3", "h", "b", (deep, m), 1)
        };
        nodes.extend([n2, n3]);
        inits.extend(w2.into_iter().chain(w3));
        nodes.push(node("Add", &["b", "a"], &["s"], vec![]));
        nodes.push(node("Relu", &["s"], &["y"], vec![]));
        let x = ("x", vec![1, c, 6, 7], randv(&mut r, c * 42));
        let mut runs = Vec::new();
        for also_a in [false, true] {
            let outs = if also_a {
                vec![f32_out("y"), f32_out("a")]
            } else {
                vec![f32_out("y")]
            };
            let mp = model(
                nodes.clone(),
                vec![f32_in("x", &[1, c as i64, 6, 7])],
                outs,
                inits.clone(),
                17,
            );
            let fc = "com.ferrum.FusedConv";
            check(
                &mp,
                OptLevel::Extended,
                std::slice::from_ref(&x),
                &[fc, "Conv", fc],
                1e-5,
            );
            let s = session(&mp, OptLevel::Extended);
            let y = outputs(&s, std::slice::from_ref(&x)).remove(0);
            runs.push((y, s.outputs_in_place()));
        }
        let (handed, kept) = (&runs[0], &runs[1]);
        let written_in = usize::from(!depthwise);
        assert_eq!(
            handed.1, written_in,
            "outputs written in place, depthwise {depthwise}"
        );
        assert_eq!(kept.1, 0, "the residual is an output too: not handed over");
        assert_eq!(handed.0.len(), kept.0.len());
        for (i, (u, v)) in handed.0.iter().zip(&kept.0).enumerate() {
            assert!(
                u.to_bits() == v.to_bits() && u.is_finite(),
                "depthwise {depthwise}: element {i}: {u} written in the residual, {v} apart"
            );
        }
    }
}

/// Elementwise ops write into the memory of an operand they are the last to read (of the
/// output's shape; a broadcast operand is read as usual), with the bits of writing a buffer of
/// their own: the same chain with every intermediate also a graph output (so none is handed
/// over) gives the same bits, on fresh random shapes (odd widths; some large enough to split
/// over the threads). Checked also against f64 arithmetic (Erf within 1e-6).
#[test]
fn elementwise_ops_write_into_an_operand_they_read_last_with_the_same_bits() {
    let mut r = rng();
    for case in 0..4 {
        let (c, h, w) = if case == 3 {
            (3usize, 300usize, 701usize)
        } else {
            (r.gen_range(1..5), r.gen_range(1..9), r.gen_range(1..150))
        };
        let n = c * h * w;
        let pos = |r: &mut Rng64, k: usize| -> Vec<f32> {
            (0..k).map(|_| r.gen_range(0.5f32..1.5)).collect()
        };
        let (bv, dv) = (pos(&mut r, c), pos(&mut r, w));
        let inits = vec![
            init("b", &[1, c as i64, 1, 1], bv.clone()),
            init("d", &[w as i64], dv.clone()),
        ];
        // t1 = Relu(x + y); t2 = b t1; t3 = sqrt(t2); t4 = t3 / d; t5 = b - t4; t6 = erf(t5);
        // out = t6 + x.
        let chain = [
            ("Add", vec!["x", "y"], "t0"),
            ("Relu", vec!["t0"], "t1"),
            ("Mul", vec!["b", "t1"], "t2"),
            ("Sqrt", vec!["t2"], "t3"),
            ("Div", vec!["t3", "d"], "t4"),
            ("Sub", vec!["b", "t4"], "t5"),
            ("Erf", vec!["t5"], "t6"),
            ("Add", vec!["t6", "x"], "out"),
        ];
        let nodes: Vec<NodeProto> = chain
            .iter()
            .map(|(op, ins, out)| node(op, ins, &[out], vec![]))
            .collect();
        let dims = [1, c as i64, h as i64, w as i64];
        let xs = (randv(&mut r, n), randv(&mut r, n));
        let feeds = [
            ("x", vec![1, c, h, w], xs.0.clone()),
            ("y", vec![1, c, h, w], xs.1.clone()),
        ];
        let mut runs = Vec::new();
        for all in [false, true] {
            let outs = chain
                .iter()
                .filter(|(_, _, o)| all || *o == "out")
                .map(|(_, _, o)| f32_out(o))
                .collect();
            let mp = model(
                nodes.clone(),
                vec![f32_in("x", &dims), f32_in("y", &dims)],
                outs,
                inits.clone(),
                17,
            );
            let s = session(&mp, OptLevel::Disabled);
            let y = outputs(&s, &feeds).pop().unwrap();
            runs.push((y, s.outputs_in_place()));
        }
        let ((handed, k_handed), (kept, k_kept)) = (&runs[0], &runs[1]);
        // Every node writes in place; with the intermediates kept as outputs, only the two whose
        // operand is a graph input it reads last (x + y into y, t6 + x into x).
        assert_eq!(
            (*k_handed, *k_kept),
            (8, 2),
            "[1, {c}, {h}, {w}]: outputs written in place"
        );
        for (i, (u, v)) in handed.iter().zip(kept).enumerate() {
            assert!(
                u.to_bits() == v.to_bits() && u.is_finite(),
                "[1, {c}, {h}, {w}] element {i}: {u} written in place, {v} apart"
            );
            let (ci, wi) = ((i / (h * w)) % c, i % w);
            let (x, y, b, d) = (xs.0[i] as f64, xs.1[i] as f64, bv[ci] as f64, dv[wi] as f64);
            let t5 = b - (b * (x + y).max(0.0)).sqrt() / d;
            let want = erf64(t5) + x;
            assert!(
                (u - want as f32).abs() <= 1e-6,
                "element {i}: {u}, f64 {want}"
            );
        }
    }
}

/// erf in f64 (Abramowitz-Stegun 7.1.26 is too coarse: a series / continued fraction).
fn erf64(x: f64) -> f64 {
    // The Taylor series converges fast for |x| <= 3; beyond, erf is 1 to f32 precision.
    if x.abs() > 3.0 {
        return x.signum();
    }
    let (mut term, mut sum, x2) = (x, x, x * x);
    for k in 1..200 {
        term *= -x2 / k as f64;
        let add = term / (2 * k + 1) as f64;
        sum += add;
        if add.abs() < 1e-17 {
            break;
        }
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

#[test]
fn every_activation_fuses_into_conv_and_gemm() {
    let mut r = rng();
    let c = 3;
    let acts: Vec<(Vec<NodeProto>, Vec<TensorProto>)> = vec![
        (
            vec![node("Clip", &["a", "lo", "hi"], &["y"], vec![])],
            vec![init("lo", &[], vec![0.0]), init("hi", &[], vec![0.3])],
        ),
        (
            vec![node("Clip", &["a", "", "hi"], &["y"], vec![])],
            vec![init("hi", &[], vec![0.1])],
        ),
        (
            vec![node(
                "LeakyRelu",
                &["a"],
                &["y"],
                vec![attr_f("alpha", 0.2)],
            )],
            vec![],
        ),
        (vec![node("Sigmoid", &["a"], &["y"], vec![])], vec![]),
        (
            vec![node(
                "HardSigmoid",
                &["a"],
                &["y"],
                vec![attr_f("alpha", 0.3)],
            )],
            vec![],
        ),
        (vec![node("HardSwish", &["a"], &["y"], vec![])], vec![]),
        (vec![node("Tanh", &["a"], &["y"], vec![])], vec![]),
        (vec![node("Relu", &["a"], &["y"], vec![])], vec![]),
        // SiLU as PyTorch exports it, both operand orders of the Mul.
        (
            vec![
                node("Sigmoid", &["a"], &["s"], vec![]),
                node("Mul", &["a", "s"], &["y"], vec![]),
            ],
            vec![],
        ),
        (
            vec![
                node("Sigmoid", &["a"], &["s"], vec![]),
                node("Mul", &["s", "a"], &["y"], vec![]),
            ],
            vec![],
        ),
    ];
    for (act, extra) in acts {
        let op = act[0].op_type.clone();
        // Conv
        let mut inits = extra.clone();
        let mut nodes = vec![conv(&mut r, "c", "x", "a", (c, 4), true, &mut inits)];
        nodes.extend(act.clone());
        let mp = model(
            nodes,
            vec![f32_in("x", &[2, c as i64, 4, 5])],
            vec![f32_out("y")],
            inits,
            17,
        );
        let feeds = [("x", vec![2, c, 4, 5], randv(&mut r, 2 * c * 20))];
        eprintln!("Conv + {op}");
        check(&mp, OptLevel::All, &feeds, &["com.ferrum.FusedConv"], 1e-5);
        // Gemm (transB, with C)
        let mut inits = extra.clone();
        inits.push(init("w", &[6, 5], randv(&mut r, 30)));
        inits.push(init("cc", &[6], randv(&mut r, 6)));
        let mut nodes = vec![node(
            "Gemm",
            &["x", "w", "cc"],
            &["a"],
            vec![attr_int("transB", 1)],
        )];
        nodes.extend(act);
        let mp = model(
            nodes,
            vec![f32_in("x", &[3, 5])],
            vec![f32_out("y")],
            inits,
            17,
        );
        let feeds = [("x", vec![3, 5], randv(&mut r, 15))];
        eprintln!("Gemm + {op}");
        check(&mp, OptLevel::All, &feeds, &["com.ferrum.FusedGemm"], 1e-5);
    }
}

/// SiLU, `Mul(x, Sigmoid(x))`, becomes one `Silu` where no product computes x (here an Add of
/// two inputs), with the same values within rounding; a Sigmoid read by another node too, or a
/// Mul of the Sigmoid by something else than its input, is left alone.
#[test]
fn silu_becomes_one_node_and_only_on_its_pattern() {
    let mut r = rng();
    let dims = [2i64, 3, 7, 5];
    let n = 2 * 3 * 7 * 5;
    let feeds = [
        (
            "x",
            vec![2, 3, 7, 5],
            randv(&mut r, n).iter().map(|v| v * 30.0).collect(),
        ),
        ("z", vec![2, 3, 7, 5], randv(&mut r, n)),
    ];
    let ins = || vec![f32_in("x", &dims), f32_in("z", &dims)];
    let mp = model(
        vec![
            node("Add", &["x", "z"], &["a"], vec![]),
            node("Sigmoid", &["a"], &["s"], vec![]),
            node("Mul", &["s", "a"], &["y"], vec![]),
        ],
        ins(),
        vec![f32_out("y")],
        vec![],
        17,
    );
    check(
        &mp,
        OptLevel::All,
        &feeds,
        &["Add", "com.ferrum.Silu"],
        1e-6,
    );
    // The Sigmoid's output is also a graph output: both stay.
    let mp = model(
        vec![
            node("Add", &["x", "z"], &["a"], vec![]),
            node("Sigmoid", &["a"], &["s"], vec![]),
            node("Mul", &["a", "s"], &["y"], vec![]),
        ],
        ins(),
        vec![f32_out("y"), f32_out("s")],
        vec![],
        17,
    );
    check(&mp, OptLevel::All, &feeds, &["Add", "Sigmoid", "Mul"], 1e-6);
    // Sigmoid(a) * z is a gate, not SiLU.
    let mp = model(
        vec![
            node("Add", &["x", "z"], &["a"], vec![]),
            node("Sigmoid", &["a"], &["s"], vec![]),
            node("Mul", &["s", "z"], &["y"], vec![]),
        ],
        ins(),
        vec![f32_out("y")],
        vec![],
        17,
    );
    check(&mp, OptLevel::All, &feeds, &["Add", "Sigmoid", "Mul"], 1e-6);
}

/// BERT's feed-forward as PyTorch exports it: MatMul, bias Add, then the erf GELU in one of its
/// three arrangements.
/// A projection scaled after it, as exported decoders write `q_proj(x) * scaling`: MatMul by a
/// constant matrix, an optional bias Add (either operand order), then a Mul (either side) or Div
/// by a constant along the last axis. The scale goes into the weights (and bias) at level 1.
#[test]
fn a_constant_scale_after_a_matmul_folds_into_its_weights() {
    let mut r = rng();
    let (k, n) = (12, 10);
    for form in 0..4 {
        let mut inits = vec![init("w", &[k as i64, n as i64], randv(&mut r, k * n))];
        let mut nodes = vec![node("MatMul", &["x", "w"], &["mm"], vec![])];
        let mut want = vec!["MatMul"];
        let scaled = if form == 0 {
            "mm"
        } else {
            inits.push(init("b", &[n as i64], randv(&mut r, n)));
            nodes.push(node("Add", &["b", "mm"], &["h"], vec![]));
            want.push("Add");
            "h"
        };
        match form {
            // A scale per output column, the constant first.
            0 | 1 => {
                inits.push(init("c", &[1, n as i64], randv(&mut r, n)));
                nodes.push(node("Mul", &["c", scaled], &["y"], vec![]));
            }
            // One value, after.
            2 => {
                inits.push(init("c", &[], vec![0.125]));
                nodes.push(node("Mul", &[scaled, "c"], &["y"], vec![]));
            }
            // Divided by the square root of a head size.
            _ => {
                inits.push(init("c", &[1], vec![8f32.sqrt()]));
                nodes.push(node("Div", &[scaled, "c"], &["y"], vec![]));
            }
        }
        let mp = model(
            nodes,
            vec![f32_in("x", &[2, 5, k as i64])],
            vec![f32_out("y")],
            inits,
            17,
        );
        let feeds = [("x", vec![2, 5, k], randv(&mut r, 10 * k))];
        eprintln!("form {form}");
        check(&mp, OptLevel::Basic, &feeds, &want, 1e-5);
        // At level 2 the bias joins the product: one node.
        let fused: &[&str] = if form == 0 {
            &["MatMul"]
        } else {
            &["com.ferrum.FusedMatMul"]
        };
        check(&mp, OptLevel::Extended, &feeds, fused, 1e-5);
    }
}

/// Where the scale cannot go into the weights, the graph keeps it: the weight read by a second
/// product, the product read twice, a scale varying along another axis, a constant divided by
/// the product, a zero divisor, a weight that is an input.
#[test]
fn a_scale_that_cannot_fold_into_the_weights_stays() {
    let mut r = rng();
    let (k, n, m) = (6, 4, 3);
    let cases: Vec<(&str, Vec<NodeProto>, Vec<TensorProto>)> = vec![
        (
            "shared weight",
            vec![
                node("MatMul", &["x", "w"], &["mm"], vec![]),
                node("Mul", &["mm", "c"], &["y0"], vec![]),
                node("Relu", &["x"], &["rx"], vec![]),
                node("MatMul", &["rx", "w"], &["mm2"], vec![]),
                node("Add", &["y0", "mm2"], &["y"], vec![]),
            ],
            vec![init("c", &[], vec![0.5])],
        ),
        (
            "product read twice",
            vec![
                node("MatMul", &["x", "w"], &["mm"], vec![]),
                node("Mul", &["mm", "c"], &["y0"], vec![]),
                node("Add", &["y0", "mm"], &["y"], vec![]),
            ],
            vec![init("c", &[], vec![0.5])],
        ),
        (
            "scale along rows",
            vec![
                node("MatMul", &["x", "w"], &["mm"], vec![]),
                node("Mul", &["mm", "c"], &["y"], vec![]),
            ],
            vec![init("c", &[m as i64, 1], randv(&mut r, m))],
        ),
        (
            "constant over the product",
            vec![
                node("MatMul", &["x", "w"], &["mm"], vec![]),
                node("Div", &["c", "mm"], &["y"], vec![]),
            ],
            vec![init("c", &[], vec![2.0])],
        ),
        (
            "zero divisor",
            vec![
                node("MatMul", &["x", "w"], &["mm"], vec![]),
                node("Div", &["mm", "c"], &["y"], vec![]),
            ],
            vec![init("c", &[n as i64], vec![1.0, 0.0, 2.0, 3.0])],
        ),
    ];
    for (what, nodes, mut inits) in cases {
        inits.push(init("w", &[k as i64, n as i64], randv(&mut r, k * n)));
        let want: Vec<String> = nodes.iter().map(|nd| nd.op_type.clone()).collect();
        let mp = model(
            nodes,
            vec![f32_in("x", &[m as i64, k as i64])],
            vec![f32_out("y")],
            inits,
            17,
        );
        let s = session(&mp, OptLevel::Basic);
        assert_eq!(ops(&s), want, "{what}");
        let feeds = [("x", vec![m, k], randv(&mut r, m * k))];
        let want: Vec<&str> = want.iter().map(String::as_str).collect();
        check(&mp, OptLevel::Basic, &feeds, &want, 0.0);
    }
    // The weight a graph input (overridable), not a constant.
    let mp = model(
        vec![
            node("MatMul", &["x", "w"], &["mm"], vec![]),
            node("Mul", &["mm", "c"], &["y"], vec![]),
        ],
        vec![
            f32_in("x", &[m as i64, k as i64]),
            f32_in("w", &[k as i64, n as i64]),
        ],
        vec![f32_out("y")],
        vec![
            init("c", &[], vec![0.5]),
            init("w", &[k as i64, n as i64], randv(&mut r, k * n)),
        ],
        17,
    );
    assert_eq!(ops(&session(&mp, OptLevel::Basic)), ["MatMul", "Mul"]);
    // A vector times the matrix ([K] -> [N]): a scale of shape [1, N] widens the output to
    // [1, N], so it stays; one of shape [N] folds.
    for (dims, folds) in [(vec![1, n as i64], false), (vec![n as i64], true)] {
        let mp = model(
            vec![
                node("MatMul", &["x", "w"], &["mm"], vec![]),
                node("Mul", &["mm", "c"], &["y"], vec![]),
            ],
            vec![f32_in("x", &[k as i64])],
            vec![f32_out("y")],
            vec![
                init("c", &dims, randv(&mut r, n)),
                init("w", &[k as i64, n as i64], randv(&mut r, k * n)),
            ],
            17,
        );
        let s = session(&mp, OptLevel::Basic);
        let want: &[&str] = if folds {
            &["MatMul"]
        } else {
            &["MatMul", "Mul"]
        };
        assert_eq!(ops(&s), want, "scale of shape {dims:?}");
        let x = Tensor::from_vec(vec![k], randv(&mut r, k)).unwrap();
        let out = s.run(vec![("x".to_string(), Value::Tensor(x))]).unwrap();
        let shape: Vec<usize> = dims.iter().map(|&d| d as usize).collect();
        assert_eq!(out[0].1.tensor().unwrap().shape(), &shape[..]);
    }
}

#[test]
fn matmul_bias_and_erf_gelu_fuse_as_in_bert() {
    let mut r = rng();
    let (k, n) = (16, 24);
    for form in 0..3 {
        let mut inits = vec![
            init("w", &[k as i64, n as i64], randv(&mut r, k * n)),
            init("b", &[n as i64], randv(&mut r, n)),
            init("sqrt2", &[], vec![std::f32::consts::SQRT_2]),
            init("one", &[], vec![1.0]),
            init("half", &[], vec![0.5]),
        ];
        let mut nodes = vec![
            node("MatMul", &["x", "w"], &["mm"], vec![]),
            node("Add", &["b", "mm"], &["h"], vec![]),
        ];
        if form == 1 {
            inits.push(init("rsqrt2", &[], vec![std::f32::consts::FRAC_1_SQRT_2]));
            nodes.push(node("Mul", &["h", "rsqrt2"], &["d"], vec![]));
        } else {
            nodes.push(node("Div", &["h", "sqrt2"], &["d"], vec![]));
        }
        nodes.push(node("Erf", &["d"], &["e"], vec![]));
        nodes.push(node("Add", &["e", "one"], &["p"], vec![]));
        match form {
            0 | 1 => {
                nodes.push(node("Mul", &["h", "p"], &["q"], vec![]));
                nodes.push(node("Mul", &["q", "half"], &["y"], vec![]));
            }
            _ => {
                nodes.push(node("Mul", &["h", "half"], &["hh"], vec![]));
                nodes.push(node("Mul", &["hh", "p"], &["y"], vec![]));
            }
        }
        let mp = model(
            nodes,
            vec![f32_in("x", &[2, 7, k as i64])],
            vec![f32_out("y")],
            inits,
            17,
        );
        let feeds = [("x", vec![2, 7, k], randv(&mut r, 14 * k))];
        eprintln!("form {form}");
        check(
            &mp,
            OptLevel::All,
            &feeds,
            &["com.ferrum.FusedMatMul"],
            1e-5,
        );
        // Level 1 keeps the chain.
        assert_eq!(session(&mp, OptLevel::Basic).model().graph.nodes.len(), 7);
    }
}

/// BERT's attention and feed-forward outputs as PyTorch exports them: MatMul, bias Add, then the
/// residual Add of the block's input (either operand order), then LayerNormalization; a residual
/// without a bias; a bias, a residual and an activation. The residual joins the FusedMatMul
/// (added as the GEMM writes each tile); one that broadcasts is left to its Add.
#[test]
fn matmul_bias_and_residual_fuse_as_in_bert() {
    let mut r = rng();
    let (k, n) = (16, 24);
    /// Bias?, residual first in the Add?, residual shape, activation?, expected ops.
    type Case = (bool, bool, Vec<i64>, bool, &'static [&'static str]);
    let cases: [Case; 5] = [
        (
            true,
            false,
            vec![2, 7, n as i64],
            false,
            &["com.ferrum.FusedMatMul", "LayerNormalization"],
        ),
        (
            true,
            true,
            vec![2, 7, n as i64],
            false,
            &["com.ferrum.FusedMatMul", "LayerNormalization"],
        ),
        (
            false,
            false,
            vec![2, 7, n as i64],
            false,
            &["com.ferrum.FusedMatMul", "LayerNormalization"],
        ),
        (
            true,
            false,
            vec![2, 7, n as i64],
            true,
            &["com.ferrum.FusedMatMul", "LayerNormalization"],
        ),
        // Broadcast over the rows: the bias fuses, the Add stays.
        (
            true,
            false,
            vec![1, 1, n as i64],
            false,
            &["com.ferrum.FusedMatMul", "Add", "LayerNormalization"],
        ),
    ];
    for (case, (bias, z_first, zshape, relu, want)) in cases.into_iter().enumerate() {
        let mut inits = vec![
            init("w", &[k as i64, n as i64], randv(&mut r, k * n)),
            init("b", &[n as i64], randv(&mut r, n)),
            init("gamma", &[n as i64], randv(&mut r, n)),
            init("beta", &[n as i64], randv(&mut r, n)),
        ];
        if !bias {
            inits.truncate(1);
            inits.push(init("gamma", &[n as i64], randv(&mut r, n)));
            inits.push(init("beta", &[n as i64], randv(&mut r, n)));
        }
        let mut nodes = vec![node("MatMul", &["x", "w"], &["mm"], vec![])];
        let mut h = "mm";
        if bias {
            nodes.push(node("Add", &["mm", "b"], &["h"], vec![]));
            h = "h";
        }
        let add = if z_first { ["z", h] } else { [h, "z"] };
        nodes.push(node("Add", &add, &["s"], vec![]));
        let mut last = "s";
        if relu {
            nodes.push(node("Relu", &["s"], &["sr"], vec![]));
            last = "sr";
        }
        nodes.push(node(
            "LayerNormalization",
            &[last, "gamma", "beta"],
            &["y"],
            vec![attr_int("axis", -1), attr_f("epsilon", 1e-5)],
        ));
        let mp = model(
            nodes,
            vec![f32_in("x", &[2, 7, k as i64]), f32_in("z", &zshape)],
            vec![f32_out("y")],
            inits,
            17,
        );
        let zlen = zshape.iter().product::<i64>() as usize;
        let feeds = [
            ("x", vec![2, 7, k], randv(&mut r, 14 * k)),
            (
                "z",
                zshape.iter().map(|&d| d as usize).collect(),
                randv(&mut r, zlen),
            ),
        ];
        eprintln!("case {case}");
        check(&mp, OptLevel::All, &feeds, want, 1e-5);
        // With bf16 products (whose kernels take no residual) the same graph runs, the
        // residual added after the product.
        let bf = Session::from_bytes_with(
            &encode(&mp),
            &SessionOptions {
                opt_level: OptLevel::All,
                precision: Precision::Bf16,
            },
        )
        .unwrap();
        assert_eq!(ops(&bf), want, "bf16 graph");
        let (a, b) = (
            outputs(&session(&mp, OptLevel::Disabled), &feeds),
            outputs(&bf, &feeds),
        );
        for (u, v) in a[0].iter().zip(&b[0]) {
            assert!((u - v).abs() <= 0.1, "bf16 {u} vs f32 {v}");
        }
    }
}

#[test]
fn a_product_read_twice_or_a_standalone_gelu_is_not_fused_wrongly() {
    let mut r = rng();
    let c = 2;
    let mut inits = vec![
        init("sqrt2", &[], vec![std::f32::consts::SQRT_2]),
        init("one", &[], vec![1.0]),
        init("half", &[], vec![0.5]),
    ];
    // The conv's output is a graph output as well as the Relu's input: no fusion.
    let nodes = vec![
        conv(&mut r, "c", "x", "a", (c, c), true, &mut inits),
        node("Relu", &["a"], &["y"], vec![]),
        // A GELU of a graph input: becomes one Gelu node.
        node("Div", &["x", "sqrt2"], &["d"], vec![]),
        node("Erf", &["d"], &["e"], vec![]),
        node("Add", &["one", "e"], &["p"], vec![]),
        node("Mul", &["x", "p"], &["q"], vec![]),
        node("Mul", &["half", "q"], &["g"], vec![]),
    ];
    let mp = model(
        nodes,
        vec![f32_in("x", &[1, c as i64, 3, 3])],
        vec![f32_out("a"), f32_out("y"), f32_out("g")],
        inits,
        17,
    );
    let feeds = [("x", vec![1, c, 3, 3], randv(&mut r, c * 9))];
    check(
        &mp,
        OptLevel::All,
        &feeds,
        &["Conv", "Relu", "com.ferrum.Gelu"],
        1e-5,
    );
}

/// The standard Gelu op (opset 20), tanh form, fuses with its MatMul and bias too.
#[test]
fn opset20_gelu_fuses_into_the_matmul() {
    let mut r = rng();
    let (k, n) = (8, 12);
    let mp = model(
        vec![
            node("MatMul", &["x", "w"], &["mm"], vec![]),
            node("Add", &["mm", "b"], &["h"], vec![]),
            node("Gelu", &["h"], &["y"], vec![attr_s("approximate", "tanh")]),
        ],
        vec![f32_in("x", &[5, k as i64])],
        vec![f32_out("y")],
        vec![
            init("w", &[k as i64, n as i64], randv(&mut r, k * n)),
            init("b", &[1, n as i64], randv(&mut r, n)),
        ],
        20,
    );
    let feeds = [("x", vec![5, k], randv(&mut r, 5 * k))];
    check(
        &mp,
        OptLevel::All,
        &feeds,
        &["com.ferrum.FusedMatMul"],
        1e-5,
    );
}

#[test]
fn constant_weights_are_prepacked_and_give_the_same_outputs() {
    let mut r = rng();
    // A MatMul and a Gemm (transB) on constant weights, a Conv on a constant filter, and a
    // MatMul whose weight is an overridable input default (not packed: a run may replace it).
    // k and the filter's 40 x 3 x 3 span more than one of the GEMM's K blocks.
    let (m, k, n, n2) = (5usize, 300usize, 40usize, 30usize);
    let inits = vec![
        init("w1", &[k as i64, n as i64], randv(&mut r, k * n)),
        init("w2", &[n2 as i64, n as i64], randv(&mut r, n2 * n)),
        init("w3", &[8, 40, 3, 3], randv(&mut r, 8 * 40 * 9)),
        init("wo", &[k as i64, 7], randv(&mut r, k * 7)),
    ];
    let pads = AttributeProto {
        name: "pads".into(),
        ints: vec![1, 1, 1, 1],
        r#type: 7,
        ..Default::default()
    };
    let mp = model(
        vec![
            node("MatMul", &["x", "w1"], &["h"], vec![]),
            node("Gemm", &["h", "w2"], &["y"], vec![attr_int("transB", 1)]),
            node("Conv", &["img", "w3"], &["c"], vec![pads]),
            node("MatMul", &["x", "wo"], &["o"], vec![]),
        ],
        vec![
            f32_in("x", &[m as i64, k as i64]),
            f32_in("img", &[1, 40, 9, 9]),
            f32_in("wo", &[k as i64, 7]),
        ],
        vec![f32_out("y"), f32_out("c"), f32_out("o")],
        inits,
        17,
    );
    let feeds = [
        ("x", vec![m, k], randv(&mut r, m * k)),
        ("img", vec![1, 40, 9, 9], randv(&mut r, 40 * 81)),
    ];
    // Level 1 keeps the same nodes (nothing to fuse without bias or activation), so the only
    // difference is where the products read their weights: the outputs agree bit for bit.
    check(
        &mp,
        OptLevel::Basic,
        &feeds,
        &["MatMul", "Gemm", "Conv", "MatMul"],
        0.0,
    );
    let s = session(&mp, OptLevel::Basic);
    assert_eq!(s.model().graph.packed.len(), 3, "w1, w2 and w3, not wo");
    assert!(s
        .optimization_report()
        .passes
        .contains(&("weight prepacking", 3)));
    assert!(session(&mp, OptLevel::Disabled)
        .model()
        .graph
        .packed
        .is_empty());
    // Overriding the input default takes effect (zeros in, zeros out).
    let mut with_wo = feeds.to_vec();
    with_wo.push(("wo", vec![k, 7], vec![0.0; k * 7]));
    let out = outputs(&s, &with_wo);
    assert!(out[2].iter().all(|&v| v == 0.0), "the fed wo is used");
}

/// `x` rounded to bf16 (nearest even; the inputs here are finite).
fn bf16(x: f32) -> f64 {
    let u = x.to_bits();
    f32::from_bits((u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) << 16) as f64
}

#[test]
fn bf16_precision_rounds_both_operands_of_the_prepacked_products() {
    let mut r = rng();
    // A MatMul, a Gemm (transB) and a Conv with constant weights: with `Precision::Bf16` each
    // must equal the f64 product of the bf16-rounded operands within f32 summation error
    // (1e-5 of the absolute sum), which the f32 products miss by far (bf16 rounding is ~4e-3
    // relative per operand). On a CPU with neither AMX-BF16 nor AVX512-BF16 the session runs f32
    // and says so.
    let (m, k, n) = (37usize, 70usize, 45usize);
    let (c, hw, oc) = (6usize, 7usize, 20usize);
    let (w1, w2, w3) = (
        randv(&mut r, k * n),
        randv(&mut r, n * k),
        randv(&mut r, oc * c * 9),
    );
    let pads = ferrum_graph::proto::build::attr_ints("pads", &[1, 1, 1, 1]);
    let mp = model(
        vec![
            node("MatMul", &["x", "w1"], &["y1"], vec![]),
            node("Gemm", &["x", "w2"], &["y2"], vec![attr_int("transB", 1)]),
            node("Conv", &["img", "w3"], &["y3"], vec![pads]),
        ],
        vec![
            f32_in("x", &[m as i64, k as i64]),
            f32_in("img", &[1, c as i64, hw as i64, hw as i64]),
        ],
        vec![f32_out("y1"), f32_out("y2"), f32_out("y3")],
        vec![
            init("w1", &[k as i64, n as i64], w1.clone()),
            init("w2", &[n as i64, k as i64], w2.clone()),
            init("w3", &[oc as i64, c as i64, 3, 3], w3.clone()),
        ],
        17,
    );
    let (x, img) = (randv(&mut r, m * k), randv(&mut r, c * hw * hw));
    let feeds = [
        ("x", vec![m, k], x.clone()),
        ("img", vec![1, c, hw, hw], img.clone()),
    ];
    // The references over rounded operands: (value, absolute sum) per output element.
    let mut want: Vec<Vec<(f64, f64)>> = vec![Vec::new(); 3];
    for i in 0..m {
        for j in 0..n {
            let (mut s1, mut a1, mut s2, mut a2) = (0.0, 0.0, 0.0, 0.0);
            for p in 0..k {
                let t1 = bf16(x[i * k + p]) * bf16(w1[p * n + j]);
                let t2 = bf16(x[i * k + p]) * bf16(w2[j * k + p]);
                (s1, a1, s2, a2) = (s1 + t1, a1 + t1.abs(), s2 + t2, a2 + t2.abs());
            }
            want[0].push((s1, a1));
            want[1].push((s2, a2));
        }
    }
    for o in 0..oc {
        for y in 0..hw {
            for xx in 0..hw {
                let (mut s, mut a) = (0.0, 0.0);
                for ch in 0..c {
                    for dy in 0..3 {
                        for dx in 0..3 {
                            let (iy, ix) = (y + dy, xx + dx);
                            if iy < 1 || ix < 1 || iy > hw || ix > hw {
                                continue;
                            }
                            let t = bf16(img[(ch * hw + iy - 1) * hw + ix - 1])
                                * bf16(w3[((o * c + ch) * 3 + dy) * 3 + dx]);
                            (s, a) = (s + t, a + t.abs());
                        }
                    }
                }
                want[2].push((s, a));
            }
        }
    }
    let within = |got: &[Vec<f32>]| {
        got.iter().zip(&want).all(|(g, w)| {
            g.len() == w.len()
                && g.iter()
                    .zip(w)
                    .all(|(&g, &(v, a))| (g as f64 - v).abs() <= 1e-5 * a + 1e-30)
        })
    };
    let opts = |precision| SessionOptions {
        opt_level: OptLevel::All,
        precision,
    };
    let f32s = Session::from_bytes_with(&encode(&mp), &opts(Precision::F32)).unwrap();
    let bf = Session::from_bytes_with(&encode(&mp), &opts(Precision::Bf16)).unwrap();
    let (plain, got) = (outputs(&f32s, &feeds), outputs(&bf, &feeds));
    assert!(
        !within(&plain),
        "the f32 products match the rounded reference: a weak test"
    );
    if ferrum_kernels::gemm::bf16_supported() {
        assert_eq!(bf.optimization_report().precision, Precision::Bf16);
        assert!(within(&got), "bf16 products against the rounded reference");
    } else {
        eprintln!("no bf16 unit here: checking the f32 fallback");
        assert_eq!(bf.optimization_report().precision, Precision::F32);
        assert_eq!(got, plain);
    }
}

/// An 8-bit initializer (ONNX type 3 = int8, 2 = uint8) from raw bytes.
fn int8_init(name: &str, dims: &[i64], signed: bool, v: Vec<u8>) -> TensorProto {
    TensorProto {
        name: name.into(),
        dims: dims.to_vec(),
        data_type: if signed { 3 } else { 2 },
        raw_data: v.into(),
        ..Default::default()
    }
}

#[test]
fn dynamically_quantized_matmuls_fuse_into_matmul_integer_to_float() {
    // What onnxruntime.quantization.quantize_dynamic writes for two MatMuls reading one input
    // (BERT's query and key): one DynamicQuantizeLinear, then per MatMul the scales' Mul,
    // MatMulInteger, Cast to float, Mul, and (first one) the bias Add. The first has a signed
    // weight with one scale and zero point; the second an unsigned one with per-column scales
    // and zero points. The fused graph must give the same bits.
    let mut r = rng();
    let (k, n1, n2) = (37, 40, 19);
    let bytes = |r: &mut Rng64, len: usize| (0..len).map(|_| r.gen::<u8>()).collect::<Vec<_>>();
    let w1: Vec<u8> = (0..k * n1)
        .map(|_| r.gen_range(-127i8..=127) as u8)
        .collect();
    let mp = model(
        vec![
            node("DynamicQuantizeLinear", &["x"], &["xq", "xs", "xz"], vec![]),
            node("Mul", &["xs", "w1_scale"], &["s1"], vec![]),
            node(
                "MatMulInteger",
                &["xq", "w1", "xz", "w1_zp"],
                &["i1"],
                vec![],
            ),
            node("Cast", &["i1"], &["c1"], vec![attr_int("to", 1)]),
            node("Mul", &["c1", "s1"], &["m1"], vec![]),
            node("Add", &["b1", "m1"], &["y1"], vec![]),
            node("Mul", &["w2_scale", "xs"], &["s2"], vec![]),
            node(
                "MatMulInteger",
                &["xq", "w2", "xz", "w2_zp"],
                &["i2"],
                vec![],
            ),
            node("Cast", &["i2"], &["c2"], vec![attr_int("to", 1)]),
            node("Mul", &["s2", "c2"], &["y2"], vec![]),
        ],
        vec![f32_in("x", &[2, 7, k as i64])],
        vec![f32_out("y1"), f32_out("y2")],
        vec![
            int8_init("w1", &[k as i64, n1 as i64], true, w1),
            init("w1_scale", &[], vec![0.0123]),
            int8_init("w1_zp", &[], true, vec![0]),
            init("b1", &[n1 as i64], randv(&mut r, n1)),
            int8_init("w2", &[k as i64, n2 as i64], false, bytes(&mut r, k * n2)),
            init(
                "w2_scale",
                &[n2 as i64],
                (0..n2).map(|_| r.gen_range(1e-3..1e-1)).collect(),
            ),
            int8_init("w2_zp", &[n2 as i64], false, bytes(&mut r, n2)),
        ],
        17,
    );
    for _ in 0..3 {
        let x: Vec<f32> = randv(&mut r, 14 * k).iter().map(|v| v * 3.0).collect();
        check(
            &mp,
            OptLevel::All,
            &[("x", vec![2, 7, k], x)],
            &[
                "DynamicQuantizeLinear",
                "com.ferrum.MatMulIntegerToFloat",
                "com.ferrum.MatMulIntegerToFloat",
            ],
            0.0,
        );
    }
    // Level 1 keeps the chain.
    assert_eq!(session(&mp, OptLevel::Basic).model().graph.nodes.len(), 10);
}

#[test]
fn an_activation_after_matmul_integer_to_float_fuses_into_it() {
    // BERT's intermediate dense layer as quantize_dynamic writes it, then the erf GELU and a
    // Relu on a second product: both activations end in the MatMulIntegerToFloat nodes.
    let mut r = rng();
    let (k, n) = (24, 32);
    let w: Vec<u8> = (0..k * n)
        .map(|_| r.gen_range(-127i8..=127) as u8)
        .collect();
    let mut inits = vec![
        int8_init("w", &[k as i64, n as i64], true, w.clone()),
        init("w_scale", &[], vec![0.02]),
        int8_init("w_zp", &[], true, vec![0]),
        init("b", &[n as i64], randv(&mut r, n)),
        int8_init("v", &[k as i64, n as i64], true, w),
        init("sqrt2", &[], vec![std::f32::consts::SQRT_2]),
        init("one", &[], vec![1.0]),
        init("half", &[], vec![0.5]),
    ];
    inits.push(init("v_scale", &[], vec![0.01]));
    let mp = model(
        vec![
            node("DynamicQuantizeLinear", &["x"], &["xq", "xs", "xz"], vec![]),
            node("Mul", &["xs", "w_scale"], &["s"], vec![]),
            node("MatMulInteger", &["xq", "w", "xz", "w_zp"], &["i"], vec![]),
            node("Cast", &["i"], &["c"], vec![attr_int("to", 1)]),
            node("Mul", &["c", "s"], &["m"], vec![]),
            node("Add", &["b", "m"], &["h"], vec![]),
            node("Div", &["h", "sqrt2"], &["d"], vec![]),
            node("Erf", &["d"], &["e"], vec![]),
            node("Add", &["e", "one"], &["p"], vec![]),
            node("Mul", &["h", "p"], &["q"], vec![]),
            node("Mul", &["q", "half"], &["y"], vec![]),
            node("Mul", &["xs", "v_scale"], &["s2"], vec![]),
            node("MatMulInteger", &["xq", "v", "xz"], &["i2"], vec![]),
            node("Cast", &["i2"], &["c2"], vec![attr_int("to", 1)]),
            node("Mul", &["c2", "s2"], &["m2"], vec![]),
            node("Relu", &["m2"], &["y2"], vec![]),
        ],
        vec![f32_in("x", &[5, k as i64])],
        vec![f32_out("y"), f32_out("y2")],
        inits,
        17,
    );
    let x: Vec<f32> = randv(&mut r, 5 * k).iter().map(|v| v * 2.0).collect();
    // The GELU's erf differs from the Erf op's by up to 2^-22: the chain's tolerance.
    check(
        &mp,
        OptLevel::All,
        &[("x", vec![5, k], x)],
        &[
            "DynamicQuantizeLinear",
            "com.ferrum.MatMulIntegerToFloat",
            "com.ferrum.MatMulIntegerToFloat",
        ],
        1e-5,
    );
    let s = session(&mp, OptLevel::All);
    let acts: Vec<String> = s
        .model()
        .graph
        .nodes
        .iter()
        .filter_map(|n| match n.attrs.get("activation") {
            Some(ferrum_graph::ir::Attr::Str(v)) => Some(String::from_utf8_lossy(v).into_owned()),
            _ => None,
        })
        .collect();
    assert_eq!(acts, ["Gelu", "Relu"]);
}

#[test]
fn matmul_integer_chain_with_a_non_constant_weight_or_other_cast_is_not_fused() {
    let mut r = rng();
    let k = 8;
    let mp = model(
        vec![
            node("DynamicQuantizeLinear", &["x"], &["xq", "xs", "xz"], vec![]),
            node("DynamicQuantizeLinear", &["w"], &["wq", "ws", "wz"], vec![]),
            node("Mul", &["xs", "ws"], &["s"], vec![]),
            node("MatMulInteger", &["xq", "wq", "xz", "wz"], &["i"], vec![]),
            node("Cast", &["i"], &["c"], vec![attr_int("to", 1)]),
            node("Mul", &["c", "s"], &["y"], vec![]),
        ],
        vec![f32_in("x", &[3, k as i64]), f32_in("w", &[k as i64, 5])],
        vec![f32_out("y")],
        vec![],
        17,
    );
    let feeds = [
        ("x", vec![3, k], randv(&mut r, 3 * k)),
        ("w", vec![k, 5], randv(&mut r, 5 * k)),
    ];
    check(
        &mp,
        OptLevel::All,
        &feeds,
        &[
            "DynamicQuantizeLinear",
            "DynamicQuantizeLinear",
            "Mul",
            "MatMulInteger",
            "Cast",
            "Mul",
        ],
        0.0,
    );
}

/// An int32 initializer.
fn i32_init(name: &str, dims: &[i64], v: &[i32]) -> TensorProto {
    TensorProto {
        name: name.into(),
        dims: dims.to_vec(),
        data_type: 6,
        raw_data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        ..Default::default()
    }
}

#[test]
fn statically_quantized_convs_fuse_into_qlinear_conv() {
    // What onnxruntime.quantization.quantize_static writes in QDQ form for two convolutions
    // (ResNet's 3x3 then 1x1, the second reading the first's quantized output twice: through
    // its own DequantizeLinear and through a residual Add): X's Q/DQ per tensor (uint8), the
    // weights' DQ per output channel (int8, axis 0) or per tensor, the bias int32 with scale
    // x_scale * w_scale, each Conv's output quantized. Both Convs must become QLinearConv and
    // every output stay within one quantization step of level 0 (float convolutions on
    // dequantized weights; the integer form differs only where a value rounds at a half).
    let mut r = rng();
    let (c, m, h, w) = (5usize, 6usize, 9usize, 7usize);
    let xs = 0.02f32;
    let (y1s, y2s) = (0.05f32, 0.07f32);
    let w1: Vec<u8> = (0..m * c * 9)
        .map(|_| r.gen_range(-127i8..=127) as u8)
        .collect();
    let w1s: Vec<f32> = (0..m).map(|_| r.gen_range(1e-3..1e-2)).collect();
    let b1: Vec<i32> = (0..m).map(|_| r.gen_range(-3000..3000)).collect();
    let b1s: Vec<f32> = w1s.iter().map(|&s| xs * s).collect();
    let w2: Vec<u8> = (0..m * m)
        .map(|_| r.gen_range(-127i8..=127) as u8)
        .collect();
    let w2s = 0.004f32;
    let b2: Vec<i32> = (0..m).map(|_| r.gen_range(-3000..3000)).collect();
    let q = |x: &str, s: &str, z: &str, y: &str| node("QuantizeLinear", &[x, s, z], &[y], vec![]);
    let dq = |x: &str, s: &str, z: &str, y: &str, axis: Option<i64>| {
        let ins: Vec<&str> = if z.is_empty() {
            vec![x, s]
        } else {
            vec![x, s, z]
        };
        node(
            "DequantizeLinear",
            &ins,
            &[y],
            axis.map(|a| attr_int("axis", a)).into_iter().collect(),
        )
    };
    let pad1 = ferrum_graph::proto::build::attr_ints("pads", &[1, 1, 1, 1]);
    let mp = model(
        vec![
            q("x", "xs", "xz", "xq"),
            dq("xq", "xs", "xz", "xd", None),
            dq("w1", "w1s", "w1z", "w1d", Some(0)),
            dq("b1", "b1s", "", "b1d", Some(0)),
            node("Conv", &["xd", "w1d", "b1d"], &["c1"], vec![pad1]),
            q("c1", "y1s", "y1z", "c1q"),
            dq("c1q", "y1s", "y1z", "c1d", None),
            dq("w2", "w2s", "", "w2d", None),
            dq("b2", "b2s", "", "b2d", None),
            node("Conv", &["c1d", "w2d", "b2d"], &["c2"], vec![]),
            q("c2", "y2s", "y2z", "c2q"),
            dq("c2q", "y2s", "y2z", "c2d", None),
            node("Add", &["c2d", "c1d"], &["y"], vec![]),
        ],
        vec![f32_in("x", &[1, c as i64, h as i64, w as i64])],
        vec![f32_out("y"), f32_out("c2d")],
        vec![
            init("xs", &[], vec![xs]),
            int8_init("xz", &[], false, vec![128]),
            int8_init("w1", &[m as i64, c as i64, 3, 3], true, w1),
            init("w1s", &[m as i64], w1s),
            int8_init("w1z", &[m as i64], true, vec![0; m]),
            i32_init("b1", &[m as i64], &b1),
            init("b1s", &[m as i64], b1s),
            init("y1s", &[], vec![y1s]),
            int8_init("y1z", &[], false, vec![100]),
            int8_init("w2", &[m as i64, m as i64, 1, 1], true, w2),
            init("w2s", &[], vec![w2s]),
            i32_init("b2", &[m as i64], &b2),
            init("b2s", &[], vec![y1s * w2s]),
            init("y2s", &[], vec![y2s]),
            int8_init("y2z", &[], false, vec![90]),
        ],
        17,
    );
    let plain = session(&mp, OptLevel::Disabled);
    // Level 2, where the QDQ fusions run (level 3 may also move them to channels-last).
    let opt = session(&mp, OptLevel::Extended);
    let got_ops = ops(&opt);
    assert_eq!(
        got_ops.iter().filter(|o| *o == "QLinearConv").count(),
        2,
        "{got_ops:?}"
    );
    assert!(!got_ops.iter().any(|o| o == "Conv"), "{got_ops:?}");
    for _ in 0..3 {
        let x: Vec<f32> = randv(&mut r, c * h * w);
        let feeds = [("x", vec![1, c, h, w], x)];
        let (a, b) = (outputs(&plain, &feeds), outputs(&opt, &feeds));
        // y = c2d + c1d: one step of each at most; c2d: one step.
        for (o, (u, v)) in a.iter().zip(&b).enumerate() {
            let tol = if o == 0 { y1s + y2s } else { y2s } * 1.001;
            let mut off = 0;
            for (i, (p, q)) in u.iter().zip(v).enumerate() {
                assert!(
                    (p - q).abs() <= tol,
                    "output {o} element {i}: level 0 {p}, fused {q}"
                );
                off += (p != q) as usize;
            }
            assert!(
                off * 20 <= u.len(),
                "output {o}: {off} of {} differ",
                u.len()
            );
        }
    }
    // Level 1 keeps the float convolutions (on folded weights).
    let basic = ops(&session(&mp, OptLevel::Basic));
    assert_eq!(
        basic.iter().filter(|o| *o == "Conv").count(),
        2,
        "{basic:?}"
    );
}

#[test]
fn statically_quantized_linear_layers_fuse_into_integer_products() {
    // A classifier head as quantize_static writes it in QDQ form (ResNet-50's fc): X's Q/DQ per
    // tensor (uint8), the Gemm (transB = 1) on the weights' DQ per output row (int8, axis 0) or
    // per tensor, an int32 bias with scale x_scale * w_scale (or none), the output quantized and
    // dequantized. The Gemm must become MatMulIntegerToFloat on the transposed integer weights,
    // and the outputs stay within one quantization step of level 0 (a float product on the
    // dequantized weights), most of them equal.
    let mut r = rng();
    for (rows, k, n, per_row, with_bias) in [(1, 70, 33, true, true), (3, 48, 20, false, false)] {
        let xs = 0.03f32;
        let ys = 0.08f32;
        let w: Vec<u8> = (0..n * k)
            .map(|_| r.gen_range(-127i8..=127) as u8)
            .collect();
        let ws: Vec<f32> = (0..if per_row { n } else { 1 })
            .map(|_| r.gen_range(1e-3..1e-2))
            .collect();
        let b: Vec<i32> = (0..n).map(|_| r.gen_range(-3000..3000)).collect();
        let bs: Vec<f32> = (0..n)
            .map(|j| xs * ws[if per_row { j } else { 0 }])
            .collect();
        let axis = per_row
            .then(|| attr_int("axis", 0))
            .into_iter()
            .collect::<Vec<_>>();
        let mut nodes = vec![
            node("QuantizeLinear", &["x", "xs", "xz"], &["xq"], vec![]),
            node("DequantizeLinear", &["xq", "xs", "xz"], &["xd"], vec![]),
            node("DequantizeLinear", &["w", "ws", "wz"], &["wd"], axis),
        ];
        let mut gemm_in = vec!["xd", "wd"];
        if with_bias {
            nodes.push(node(
                "DequantizeLinear",
                &["b", "bs"],
                &["bd"],
                vec![attr_int("axis", 0)],
            ));
            gemm_in.push("bd");
        }
        nodes.extend([
            node("Gemm", &gemm_in, &["g"], vec![attr_int("transB", 1)]),
            node("QuantizeLinear", &["g", "ys", "yz"], &["gq"], vec![]),
            node("DequantizeLinear", &["gq", "ys", "yz"], &["y"], vec![]),
        ]);
        let nw = ws.len() as i64;
        let mp = model(
            nodes,
            vec![f32_in("x", &[rows as i64, k as i64])],
            vec![f32_out("y")],
            vec![
                init("xs", &[], vec![xs]),
                int8_init("xz", &[], false, vec![120]),
                int8_init("w", &[n as i64, k as i64], true, w),
                init("ws", &[nw], ws),
                int8_init("wz", &[nw], true, vec![0; nw as usize]),
                i32_init("b", &[n as i64], &b),
                init("bs", &[n as i64], bs),
                init("ys", &[], vec![ys]),
                int8_init("yz", &[], false, vec![128]),
            ],
            17,
        );
        let plain = session(&mp, OptLevel::Disabled);
        let opt = session(&mp, OptLevel::Extended);
        let got_ops = ops(&opt);
        assert!(
            got_ops
                .iter()
                .any(|o| o == "com.ferrum.MatMulIntegerToFloat")
                && !got_ops.iter().any(|o| o == "Gemm"),
            "{got_ops:?}"
        );
        for _ in 0..3 {
            let x: Vec<f32> = randv(&mut r, rows * k).iter().map(|v| v * 2.0).collect();
            let feeds = [("x", vec![rows, k], x)];
            let (a, o) = (outputs(&plain, &feeds), outputs(&opt, &feeds));
            let mut off = 0;
            for (i, (p, q)) in a[0].iter().zip(&o[0]).enumerate() {
                assert!(
                    (p - q).abs() <= ys * 1.001,
                    "element {i}: level 0 {p}, fused {q}"
                );
                off += (p != q) as usize;
            }
            assert!(off * 10 <= a[0].len(), "{off} of {} differ", a[0].len());
        }
    }
}

/// Two bottleneck blocks of a statically quantized ResNet in QDQ form (as
/// `onnxruntime.quantization.quantize_static` writes them): 1x1, 3x3 and 1x1 convolutions, the
/// second block with stride 2 and a strided 1x1 shortcut, each block's residual added and
/// quantized; activations unsigned except the second block's 3x3 output (signed).
///
/// With `stem`, first a 3x3 stride-2 convolution (signed output) and a 3x3 stride-2 max pool
/// on its dequantized values, quantized again with the same parameters (ResNet's stem).
fn quantized_bottlenecks(
    r: &mut Rng64,
    c0: usize,
    mid: usize,
    c2: usize,
    stem: bool,
) -> ModelProto {
    let mut nodes: Vec<NodeProto> = Vec::new();
    let mut inits: Vec<TensorProto> = Vec::new();
    let dq = |x: &str, s: &str, z: &str, y: &str| {
        let ins: Vec<&str> = if z.is_empty() {
            vec![x, s]
        } else {
            vec![x, s, z]
        };
        node("DequantizeLinear", &ins, &[y], vec![])
    };
    // One quantized activation: its scale and zero point.
    inits.push(init("xq_s", &[], vec![0.02]));
    inits.push(int8_init("xq_z", &[], false, vec![128]));
    nodes.push(node(
        "QuantizeLinear",
        &["x", "xq_s", "xq_z"],
        &["xq"],
        vec![],
    ));
    // A quantized convolution reading the 8-bit `src` (scale `src_s`), writing `dst` (8-bit).
    let mut conv = |src: &str,
                    dst: &str,
                    (cin, cout, k, stride): (usize, usize, usize, i64),
                    (ys, yz, signed): (f32, u8, bool),
                    nodes: &mut Vec<NodeProto>,
                    inits: &mut Vec<TensorProto>,
                    src_scale: f32| {
        let w: Vec<u8> = (0..cout * cin * k * k)
            .map(|_| r.gen_range(-127i8..=127) as u8)
            .collect();
        let ws: Vec<f32> = (0..cout).map(|_| r.gen_range(2e-3..2e-2)).collect();
        let b: Vec<i32> = (0..cout).map(|_| r.gen_range(-2000..2000)).collect();
        let bs: Vec<f32> = ws.iter().map(|&s| s * src_scale).collect();
        let dims = [cout as i64, cin as i64, k as i64, k as i64];
        inits.push(int8_init(&format!("{dst}_w"), &dims, true, w));
        inits.push(init(&format!("{dst}_ws"), &[cout as i64], ws));
        inits.push(int8_init(
            &format!("{dst}_wz"),
            &[cout as i64],
            true,
            vec![0; cout],
        ));
        inits.push(i32_init(&format!("{dst}_b"), &[cout as i64], &b));
        inits.push(init(&format!("{dst}_bs"), &[cout as i64], bs));
        inits.push(init(&format!("{dst}_s"), &[], vec![ys]));
        inits.push(int8_init(&format!("{dst}_z"), &[], signed, vec![yz]));
        let p = (k / 2) as i64;
        let (xd, wd, bd, y) = (
            format!("{dst}_xd"),
            format!("{dst}_wd"),
            format!("{dst}_bd"),
            format!("{dst}_f"),
        );
        nodes.push(dq(src, &format!("{src}_s"), &format!("{src}_z"), &xd));
        let mut wdq = dq(
            &format!("{dst}_w"),
            &format!("{dst}_ws"),
            &format!("{dst}_wz"),
            &wd,
        );
        wdq.attribute.push(attr_int("axis", 0));
        nodes.push(wdq);
        let mut bdq = dq(&format!("{dst}_b"), &format!("{dst}_bs"), "", &bd);
        bdq.attribute.push(attr_int("axis", 0));
        nodes.push(bdq);
        nodes.push(node(
            "Conv",
            &[&xd, &wd, &bd],
            &[&y],
            vec![
                attr_ints("pads", &[p, p, p, p]),
                attr_ints("strides", &[stride, stride]),
            ],
        ));
        nodes.push(node(
            "QuantizeLinear",
            &[&y, &format!("{dst}_s"), &format!("{dst}_z")],
            &[dst],
            vec![],
        ));
    };
    let add = |a: &str, b: &str, dst: &str, nodes: &mut Vec<NodeProto>| {
        let (ad, bd, sum) = (format!("{dst}_ad"), format!("{dst}_bd"), format!("{dst}_f"));
        nodes.push(dq(a, &format!("{a}_s"), &format!("{a}_z"), &ad));
        nodes.push(dq(b, &format!("{b}_s"), &format!("{b}_z"), &bd));
        nodes.push(node("Add", &[&ad, &bd], &[&sum], vec![]));
        nodes.push(node(
            "QuantizeLinear",
            &[&sum, &format!("{dst}_s"), &format!("{dst}_z")],
            &[dst],
            vec![],
        ));
    };
    let (src, src_scale) = if stem {
        conv(
            "xq",
            "st",
            (c0, c0, 3, 2),
            (0.04, (-5i8) as u8, true),
            &mut nodes,
            &mut inits,
            0.02,
        );
        nodes.push(dq("st", "st_s", "st_z", "st_d"));
        nodes.push(node(
            "MaxPool",
            &["st_d"],
            &["mp_f"],
            vec![
                attr_ints("kernel_shape", &[3, 3]),
                attr_ints("strides", &[2, 2]),
                attr_ints("pads", &[1, 1, 1, 1]),
            ],
        ));
        nodes.push(node(
            "QuantizeLinear",
            &["mp_f", "st_s", "st_z"],
            &["mp"],
            vec![],
        ));
        inits.push(init("mp_s", &[], vec![0.04]));
        inits.push(int8_init("mp_z", &[], true, vec![(-5i8) as u8]));
        ("mp", 0.04)
    } else {
        ("xq", 0.02)
    };
    // Block 1: identity shortcut.
    conv(
        src,
        "a1",
        (c0, mid, 1, 1),
        (0.05, 3, false),
        &mut nodes,
        &mut inits,
        src_scale,
    );
    conv(
        "a1",
        "a2",
        (mid, mid, 3, 1),
        (0.06, 5, false),
        &mut nodes,
        &mut inits,
        0.05,
    );
    conv(
        "a2",
        "a3",
        (mid, c0, 1, 1),
        (0.07, 120, false),
        &mut nodes,
        &mut inits,
        0.06,
    );
    inits.push(init("o1_s", &[], vec![0.08]));
    inits.push(int8_init("o1_z", &[], false, vec![7]));
    add("a3", src, "o1", &mut nodes);
    // Block 2: stride 2, a signed 3x3 output, a strided 1x1 shortcut.
    conv(
        "o1",
        "b1",
        (c0, mid, 1, 1),
        (0.05, 2, false),
        &mut nodes,
        &mut inits,
        0.08,
    );
    conv(
        "b1",
        "b2",
        (mid, mid, 3, 2),
        (0.06, (-3i8) as u8, true),
        &mut nodes,
        &mut inits,
        0.05,
    );
    conv(
        "b2",
        "b3",
        (mid, c2, 1, 1),
        (0.07, 110, false),
        &mut nodes,
        &mut inits,
        0.06,
    );
    conv(
        "o1",
        "sc",
        (c0, c2, 1, 2),
        (0.07, 125, false),
        &mut nodes,
        &mut inits,
        0.08,
    );
    inits.push(init("o2_s", &[], vec![0.09]));
    inits.push(int8_init("o2_z", &[], false, vec![9]));
    add("b3", "sc", "o2", &mut nodes);
    nodes.push(dq("o2", "o2_s", "o2_z", "y"));
    // Block 1's output is also a graph output (leaves the region in the middle).
    nodes.push(dq("o1", "o1_s", "o1_z", "y1"));
    model(
        nodes,
        vec![f32_in("x", &[1, c0 as i64, 11, 9])],
        vec![f32_out("y"), f32_out("y1")],
        inits,
        17,
    )
}

#[test]
fn quantized_bottlenecks_run_channels_last() {
    // Level 3 keeps the 8-bit activations channels-last across the blocks: every QLinearConv
    // becomes NhwcQLinearConv, the QLinearAdds read and write channels-last bytes, one
    // transpose where the quantized input enters and one per value read in NCHW (the two
    // outputs). The integer products are the same, so the outputs equal level 2's bit for bit,
    // on every kernel the CPU runs (64 and 128 channels: the GEMM reads a 1x1 convolution's
    // input in place; 8 and 24: it pads the rows).
    let mut r = rng();
    for (c0, mid, c2) in [(8, 4, 24), (64, 64, 128)] {
        let mp = quantized_bottlenecks(&mut r, c0, mid, c2, false);
        let two = session(&mp, OptLevel::Extended);
        let three = session(&mp, OptLevel::All);
        let conv = "com.ferrum.NhwcQLinearConv";
        let add = "com.ferrum.QLinearAdd";
        assert_eq!(
            ops(&three),
            [
                "QuantizeLinear",
                "Transpose",
                conv,
                conv,
                conv,
                add,
                "Transpose",
                conv,
                conv,
                conv,
                conv,
                add,
                "Transpose",
                "DequantizeLinear",
                "DequantizeLinear"
            ],
            "{c0} -> {mid} -> {c2}"
        );
        let log = &three.optimization_report().fused;
        assert!(
            log.iter()
                .any(|l| l == "8-bit channels-last: 9 nodes, 1 transposes in, 2 out"),
            "{log:?}"
        );
        for _ in 0..2 {
            let x: Vec<f32> = randv(&mut r, c0 * 11 * 9).iter().map(|v| v * 3.0).collect();
            let feeds = [("x", vec![1, c0, 11, 9], x)];
            assert_eq!(
                outputs(&two, &feeds),
                outputs(&three, &feeds),
                "{c0} channels"
            );
        }
    }
}

#[test]
fn a_quantized_stem_and_max_pool_run_channels_last() {
    // ResNet's stem in QDQ form: its convolution's (signed) output dequantized, max-pooled and
    // quantized with the same parameters. The three become one max pool on the channels-last
    // bytes inside the region (so the stem joins it too); the outputs equal level 2's (the
    // float max pool between dequantize and quantize) bit for bit.
    let mut r = rng();
    for c0 in [8, 64] {
        let mp = quantized_bottlenecks(&mut r, c0, 16, 32, true);
        let two = session(&mp, OptLevel::Extended);
        let three = session(&mp, OptLevel::All);
        let conv = "com.ferrum.NhwcQLinearConv";
        let add = "com.ferrum.QLinearAdd";
        assert_eq!(
            ops(&three),
            [
                "QuantizeLinear",
                "Transpose",
                conv,
                "com.ferrum.NhwcMaxPool",
                conv,
                conv,
                conv,
                add,
                "Transpose",
                conv,
                conv,
                conv,
                conv,
                add,
                "Transpose",
                "DequantizeLinear",
                "DequantizeLinear"
            ]
        );
        for _ in 0..2 {
            let x: Vec<f32> = randv(&mut r, c0 * 11 * 9).iter().map(|v| v * 3.0).collect();
            let feeds = [("x", vec![1, c0, 11, 9], x)];
            assert_eq!(
                outputs(&two, &feeds),
                outputs(&three, &feeds),
                "{c0} channels"
            );
        }
    }
}

#[test]
fn a_global_pool_behind_a_transpose_from_channels_last_reads_it_in_place() {
    // A channels-last image turned to NCHW and pooled (a channels-last region's exit, or a model
    // from a channels-last framework): the pool reads the channels-last tensor and the transpose
    // goes, the same bits as level 0. With a per-tensor DequantizeLinear between the two (an
    // 8-bit region's exit), the dequantize moves before the transpose. A transpose read
    // elsewhere too stays. Some inputs hold +-2^60, which absorb the small values they meet in
    // a partial sum: a different summation order would show.
    let mut r = rng();
    let (h, w, c) = (7i64, 5i64, 70i64);
    let perm = || vec![attr_ints("perm", &[0, 3, 1, 2])];
    let mut feeds = || {
        let mut x = randv(&mut r, (h * w * c) as usize);
        for v in x.iter_mut() {
            if v.abs() > 0.8 {
                *v = v.signum() * 2f32.powi(60);
            }
        }
        [("x", vec![1, h as usize, w as usize, c as usize], x)]
    };
    let mp = model(
        vec![
            node("Transpose", &["x"], &["t"], perm()),
            node("GlobalAveragePool", &["t"], &["y"], vec![]),
        ],
        vec![f32_in("x", &[1, h, w, c])],
        vec![f32_out("y")],
        vec![],
        17,
    );
    for _ in 0..3 {
        check(
            &mp,
            OptLevel::All,
            &feeds(),
            &["com.ferrum.NhwcGlobalAveragePool"],
            0.0,
        );
    }
    let quantized = model(
        vec![
            node("QuantizeLinear", &["x", "s", "z"], &["q"], vec![]),
            node("Transpose", &["q"], &["t"], perm()),
            node("DequantizeLinear", &["t", "s", "z"], &["d"], vec![]),
            node("GlobalAveragePool", &["d"], &["y"], vec![]),
        ],
        vec![f32_in("x", &[1, h, w, c])],
        vec![f32_out("y")],
        vec![
            init("s", &[], vec![0.05]),
            int8_init("z", &[], false, vec![131]),
        ],
        17,
    );
    for _ in 0..3 {
        let mut x = feeds();
        x[0].2.iter_mut().for_each(|v| *v = v.clamp(-6.0, 6.0));
        check(
            &quantized,
            OptLevel::All,
            &x,
            &[
                "QuantizeLinear",
                "DequantizeLinear",
                "com.ferrum.NhwcGlobalAveragePool",
            ],
            0.0,
        );
    }
    let read_twice = model(
        vec![
            node("Transpose", &["x"], &["t"], perm()),
            node("GlobalAveragePool", &["t"], &["y"], vec![]),
        ],
        vec![f32_in("x", &[1, h, w, c])],
        vec![f32_out("y"), f32_out("t")],
        vec![],
        17,
    );
    check(
        &read_twice,
        OptLevel::All,
        &feeds(),
        &["Transpose", "GlobalAveragePool"],
        0.0,
    );
}

#[test]
fn a_lone_quantized_convolution_stays_nchw() {
    // One QLinearConv between a QuantizeLinear and a DequantizeLinear: transposes around it
    // would move as many bytes as the kernel turns around itself, so it is left as it is.
    let mut r = rng();
    let mp = quantized_bottlenecks(&mut r, 8, 4, 8, false);
    let mut mp1 = mp.clone();
    let g = mp1.graph.as_mut().unwrap();
    // Keep the first convolution only: its output dequantized is the graph's output.
    let keep = g
        .node
        .iter()
        .position(|n| n.op_type == "QuantizeLinear" && n.output[0] == "a1")
        .unwrap();
    g.node.truncate(keep + 1);
    g.node.push(node(
        "DequantizeLinear",
        &["a1", "a1_s", "a1_z"],
        &["y"],
        vec![],
    ));
    g.output.truncate(1);
    let three = session(&mp1, OptLevel::All);
    assert_eq!(
        ops(&three),
        ["QuantizeLinear", "QLinearConv", "DequantizeLinear"]
    );
}

#[test]
fn qdq_conv_with_an_unquantized_output_or_a_float_bias_is_not_fused() {
    // The Conv's output read by something besides its QuantizeLinear, and a float32 bias: both
    // stay float convolutions (on weights dequantized by constant folding).
    let mut r = rng();
    let (c, m) = (3usize, 4usize);
    let w: Vec<u8> = (0..m * c)
        .map(|_| r.gen_range(-127i8..=127) as u8)
        .collect();
    let mp = model(
        vec![
            node("QuantizeLinear", &["x", "xs", "xz"], &["xq"], vec![]),
            node("DequantizeLinear", &["xq", "xs", "xz"], &["xd"], vec![]),
            node("DequantizeLinear", &["w", "ws"], &["wd"], vec![]),
            node("Conv", &["xd", "wd"], &["c1"], vec![]),
            node("QuantizeLinear", &["c1", "ys", "yz"], &["c1q"], vec![]),
            node("DequantizeLinear", &["c1q", "ys", "yz"], &["y1"], vec![]),
            node("Conv", &["xd", "wd", "fb"], &["c2"], vec![]),
            node("QuantizeLinear", &["c2", "ys", "yz"], &["c2q"], vec![]),
            node("DequantizeLinear", &["c2q", "ys", "yz"], &["y2"], vec![]),
        ],
        vec![f32_in("x", &[1, c as i64, 4, 4])],
        vec![f32_out("y1"), f32_out("y2"), f32_out("c1")],
        vec![
            init("xs", &[], vec![0.02]),
            int8_init("xz", &[], false, vec![128]),
            int8_init("w", &[m as i64, c as i64, 1, 1], true, w),
            init("ws", &[], vec![0.01]),
            init("fb", &[m as i64], randv(&mut r, m)),
            init("ys", &[], vec![0.05]),
            int8_init("yz", &[], false, vec![128]),
        ],
        17,
    );
    let o = ops(&session(&mp, OptLevel::All));
    assert!(!o.iter().any(|x| x == "QLinearConv"), "{o:?}");
    let x = randv(&mut r, c * 16);
    check(
        &mp,
        OptLevel::All,
        &[("x", vec![1, c, 4, 4], x)],
        &o.iter().map(String::as_str).collect::<Vec<_>>(),
        1e-6,
    );
}

#[test]
fn quantized_residual_adds_fuse_into_qlinear_add() {
    // ResNet's residual in QDQ form: two dequantized 8-bit tensors added, the sum quantized.
    // Here one unsigned, one signed and broadcast per channel, into an unsigned sum: one
    // com.ferrum.QLinearAdd with the chain's own float32 operations, so the same bits. A second
    // Add whose sum is also read unquantized stays as it is.
    // Then both unsigned and of one shape (a quantized ResNet's residual: the vector kernel).
    let mut r = rng();
    let (c, h, w) = (3usize, 5usize, 4usize);
    for (x2_hw, z2) in [((1usize, 1usize), (-9i8) as u8), ((h, w), 77u8)] {
        let signed = x2_hw == (1, 1);
        let mp = model(
            vec![
                node("QuantizeLinear", &["x1", "s1", "z1"], &["q1"], vec![]),
                node("DequantizeLinear", &["q1", "s1", "z1"], &["d1"], vec![]),
                node("QuantizeLinear", &["x2", "s2", "z2"], &["q2"], vec![]),
                node("DequantizeLinear", &["q2", "s2", "z2"], &["d2"], vec![]),
                node("Add", &["d1", "d2"], &["sum"], vec![]),
                node("QuantizeLinear", &["sum", "s3", "z3"], &["q3"], vec![]),
                node("DequantizeLinear", &["q3", "s3", "z3"], &["y"], vec![]),
                node("Add", &["d2", "d1"], &["sum2"], vec![]),
                node("QuantizeLinear", &["sum2", "s3", "z3"], &["q4"], vec![]),
                node("DequantizeLinear", &["q4", "s3", "z3"], &["y2"], vec![]),
            ],
            vec![
                f32_in("x1", &[1, c as i64, h as i64, w as i64]),
                f32_in("x2", &[1, c as i64, x2_hw.0 as i64, x2_hw.1 as i64]),
            ],
            vec![f32_out("y"), f32_out("y2"), f32_out("sum2")],
            vec![
                init("s1", &[], vec![0.031]),
                int8_init("z1", &[], false, vec![117]),
                init("s2", &[], vec![0.017]),
                int8_init("z2", &[], signed, vec![z2]),
                init("s3", &[], vec![0.043]),
                int8_init("z3", &[], false, vec![131]),
            ],
            17,
        );
        let ops_all = ops(&session(&mp, OptLevel::All));
        assert_eq!(
            ops_all
                .iter()
                .filter(|o| *o == "com.ferrum.QLinearAdd")
                .count(),
            1,
            "{ops_all:?}"
        );
        for _ in 0..3 {
            let x1: Vec<f32> = randv(&mut r, c * h * w).iter().map(|v| v * 4.0).collect();
            let n2 = c * x2_hw.0 * x2_hw.1;
            let x2: Vec<f32> = randv(&mut r, n2).iter().map(|v| v * 2.0).collect();
            check(
                &mp,
                OptLevel::All,
                &[
                    ("x1", vec![1, c, h, w], x1),
                    ("x2", vec![1, c, x2_hw.0, x2_hw.1], x2),
                ],
                &ops_all.iter().map(String::as_str).collect::<Vec<_>>(),
                0.0,
            );
        }
    }
}

/// Random values with `-inf` at the masked positions: batch 0 masks its last two keys, batch 1
/// masks every key (its rows come out NaN from Softmax; `Where(IsNaN)` makes them 0).
fn additive_mask(b: usize, sk: usize) -> Vec<f32> {
    (0..b * sk)
        .map(|i| match (i / sk, i % sk) {
            (0, j) if j + 2 >= sk => f32::NEG_INFINITY,
            (1, _) => f32::NEG_INFINITY,
            _ => 0.0,
        })
        .collect()
}

/// BERT's self-attention as `torch.onnx.export` writes `scaled_dot_product_attention` (opset 17):
/// heads split by Transpose, Q and K^T each times sqrt(1/sqrt(d)), the additive mask,
/// Softmax, `Where(IsNaN(p), 0, p)`, the product with V, heads merged again. With static input
/// shapes the head transposes are read through (strided operands, the output written in the
/// merged layout); with symbolic dims they stay.
#[test]
fn sdpa_attention_fuses_as_pytorch_exports_it() {
    let mut r = rng();
    let (b, s, h, d) = (3, 7, 2, 8);
    let half_scale = (1.0 / (d as f32).sqrt()).sqrt();
    for static_dims in [true, false] {
        let dims = |v: &[usize]| {
            v.iter()
                .map(|&x| static_dims.then_some(x as i64))
                .collect::<Vec<_>>()
        };
        let mp = model(
            vec![
                node(
                    "Transpose",
                    &["q"],
                    &["qt"],
                    vec![attr_ints("perm", &[0, 2, 1, 3])],
                ),
                node(
                    "Transpose",
                    &["k"],
                    &["kt"],
                    vec![attr_ints("perm", &[0, 2, 3, 1])],
                ),
                node(
                    "Transpose",
                    &["v"],
                    &["vt"],
                    vec![attr_ints("perm", &[0, 2, 1, 3])],
                ),
                node("Mul", &["qt", "c1"], &["qs"], vec![]),
                node("Mul", &["kt", "c2"], &["ks"], vec![]),
                node("MatMul", &["qs", "ks"], &["scores"], vec![]),
                node("Add", &["scores", "mask"], &["masked"], vec![]),
                node("Softmax", &["masked"], &["p"], vec![attr_int("axis", -1)]),
                node("IsNaN", &["p"], &["nan"], vec![]),
                node("Where", &["nan", "zero", "p"], &["pz"], vec![]),
                node("MatMul", &["pz", "vt"], &["o"], vec![]),
                node(
                    "Transpose",
                    &["o"],
                    &["y"],
                    vec![attr_ints("perm", &[0, 2, 1, 3])],
                ),
            ],
            vec![
                value("q", 1, &dims(&[b, s, h, d])),
                value("k", 1, &dims(&[b, s, h, d])),
                value("v", 1, &dims(&[b, s, h, d])),
                value("mask", 1, &dims(&[b, 1, 1, s])),
            ],
            vec![f32_out("y")],
            vec![
                init("c1", &[], vec![half_scale]),
                init("c2", &[], vec![half_scale]),
                init("zero", &[1], vec![0.0]),
            ],
            17,
        );
        let n = b * s * h * d;
        let feeds = [
            ("q", vec![b, s, h, d], randv(&mut r, n)),
            ("k", vec![b, s, h, d], randv(&mut r, n)),
            ("v", vec![b, s, h, d], randv(&mut r, n)),
            ("mask", vec![b, 1, 1, s], additive_mask(b, s)),
        ];
        let want: &[&str] = if static_dims {
            &["com.ferrum.FusedAttention"]
        } else {
            &[
                "Transpose",
                "Transpose",
                "Transpose",
                "com.ferrum.FusedAttention",
                "Transpose",
            ]
        };
        eprintln!("static dims: {static_dims}");
        check(&mp, OptLevel::All, &feeds, want, 1e-5);
        // Level 1 keeps the chain.
        assert_eq!(session(&mp, OptLevel::Basic).model().graph.nodes.len(), 12);
    }
}

/// ViT's whole self-attention block as torchvision's `nn.MultiheadAttention` exports it, in
/// small: one QKV projection output split into heads by Reshape, Transpose and three Gathers,
/// the scale computed from the head size through Shape, K^T by Transpose, and the heads merged
/// by Transpose and Reshape. With static shapes the shape arithmetic folds and every split and
/// merge is read through: one node is left.
#[test]
fn vit_attention_reads_its_head_splits_and_merge_as_views() {
    let mut r = rng();
    let (s, h, d) = (11, 3, 4);
    let e = h * d;
    let i64_init = |name: &str, v: &[i64]| {
        let mut t = init(name, &[v.len() as i64], vec![]);
        t.data_type = 7;
        t.int64_data = v.to_vec();
        t
    };
    let scalar_idx = |name: &str, v: i64| {
        let mut t = i64_init(name, &[v]);
        t.dims.clear();
        t
    };
    let inits = vec![
        i64_init("shape4", &[s as i64, 3, h as i64, d as i64]),
        i64_init("merged", &[s as i64, e as i64]),
        scalar_idx("i0", 0),
        scalar_idx("i1", 1),
        scalar_idx("i2", 2),
        scalar_idx("last", -1),
        init("one", &[], vec![1.0]),
    ];
    let mp = model(
        vec![
            node("Reshape", &["qkv", "shape4"], &["split"], vec![]),
            node(
                "Transpose",
                &["split"],
                &["heads"],
                vec![attr_ints("perm", &[1, 2, 0, 3])],
            ),
            node(
                "Gather",
                &["heads", "i0"],
                &["q"],
                vec![attr_int("axis", 0)],
            ),
            node(
                "Gather",
                &["heads", "i1"],
                &["k"],
                vec![attr_int("axis", 0)],
            ),
            node(
                "Gather",
                &["heads", "i2"],
                &["v"],
                vec![attr_int("axis", 0)],
            ),
            node("Shape", &["q"], &["qshape"], vec![]),
            node(
                "Gather",
                &["qshape", "last"],
                &["dim"],
                vec![attr_int("axis", 0)],
            ),
            node("Cast", &["dim"], &["dimf"], vec![attr_int("to", 1)]),
            node("Sqrt", &["dimf"], &["root"], vec![]),
            node("Div", &["one", "root"], &["inv"], vec![]),
            node("Sqrt", &["inv"], &["scale"], vec![]),
            node(
                "Transpose",
                &["k"],
                &["kt"],
                vec![attr_ints("perm", &[0, 2, 1])],
            ),
            node("Mul", &["q", "scale"], &["qs"], vec![]),
            node("Mul", &["kt", "scale"], &["ks"], vec![]),
            node("MatMul", &["qs", "ks"], &["scores"], vec![]),
            node("Softmax", &["scores"], &["p"], vec![attr_int("axis", -1)]),
            node("MatMul", &["p", "v"], &["o"], vec![]),
            node(
                "Transpose",
                &["o"],
                &["oh"],
                vec![attr_ints("perm", &[1, 0, 2])],
            ),
            node("Reshape", &["oh", "merged"], &["y"], vec![]),
        ],
        vec![f32_in("qkv", &[s as i64, 3 * e as i64])],
        vec![f32_out("y")],
        inits,
        17,
    );
    let feeds = [("qkv", vec![s, 3 * e], randv(&mut r, s * 3 * e))];
    check(
        &mp,
        OptLevel::All,
        &feeds,
        &["com.ferrum.FusedAttention"],
        1e-5,
    );
}

/// Shape arithmetic on a static shape folds: `x * float(shape(x)[1])` is one Mul by a constant.
#[test]
fn shapes_of_static_values_fold_as_constants() {
    let mut r = rng();
    let mut idx = f32_tensor("one_idx", &[], &[]);
    idx.data_type = 7;
    idx.int64_data = vec![1];
    let mp = model(
        vec![
            node("Relu", &["x"], &["rx"], vec![]),
            node("Shape", &["rx"], &["sh"], vec![]),
            node(
                "Gather",
                &["sh", "one_idx"],
                &["n"],
                vec![attr_int("axis", 0)],
            ),
            node("Cast", &["n"], &["nf"], vec![attr_int("to", 1)]),
            node("Mul", &["rx", "nf"], &["y"], vec![]),
        ],
        vec![f32_in("x", &[2, 5])],
        vec![f32_out("y")],
        vec![idx],
        17,
    );
    let feeds = [("x", vec![2, 5], randv(&mut r, 10))];
    check(&mp, OptLevel::Basic, &feeds, &["Relu", "Mul"], 0.0);
}

/// ViT's attention (torchvision's `nn.MultiheadAttention` export): the scale computed at run
/// time from the head size, K transposed by its last two dims, no mask; and the older form that
/// divides the scores by a constant and adds a broadcast mask.
#[test]
fn attention_with_a_run_time_scale_or_a_divided_score_fuses() {
    let mut r = rng();
    let (h, s, d) = (3, 70, 16);
    let mp = model(
        vec![
            node("Sqrt", &["scale_sq"], &["scale"], vec![]),
            node(
                "Transpose",
                &["k"],
                &["kt"],
                vec![attr_ints("perm", &[0, 1, 3, 2])],
            ),
            node("Mul", &["q", "scale"], &["qs"], vec![]),
            node("Mul", &["kt", "scale"], &["ks"], vec![]),
            node("MatMul", &["qs", "ks"], &["scores"], vec![]),
            node("Softmax", &["scores"], &["p"], vec![attr_int("axis", -1)]),
            node("MatMul", &["p", "v"], &["y"], vec![]),
        ],
        vec![
            f32_in("scale_sq", &[1]),
            f32_in("q", &[1, h as i64, s as i64, d as i64]),
            f32_in("k", &[1, h as i64, s as i64, d as i64]),
            f32_in("v", &[1, h as i64, s as i64, d as i64]),
        ],
        vec![f32_out("y")],
        vec![],
        17,
    );
    let n = h * s * d;
    let feeds = [
        ("scale_sq", vec![1], vec![0.25]),
        ("q", vec![1, h, s, d], randv(&mut r, n)),
        ("k", vec![1, h, s, d], randv(&mut r, n)),
        ("v", vec![1, h, s, d], randv(&mut r, n)),
    ];
    check(
        &mp,
        OptLevel::All,
        &feeds,
        &["Sqrt", "com.ferrum.FusedAttention"],
        1e-5,
    );

    let mp = model(
        vec![
            node("MatMul", &["q", "kt"], &["scores"], vec![]),
            node("Div", &["scores", "root_d"], &["scaled"], vec![]),
            node("Add", &["mask", "scaled"], &["masked"], vec![]),
            node("Softmax", &["masked"], &["y0"], vec![]),
            node("MatMul", &["y0", "v"], &["y"], vec![]),
        ],
        vec![
            f32_in("q", &[2, h as i64, s as i64, d as i64]),
            f32_in("kt", &[2, h as i64, d as i64, s as i64]),
            f32_in("v", &[2, h as i64, s as i64, 5]),
            f32_in("mask", &[2, 1, 1, s as i64]),
        ],
        vec![f32_out("y")],
        vec![init("root_d", &[], vec![(d as f32).sqrt()])],
        17,
    );
    let feeds = [
        ("q", vec![2, h, s, d], randv(&mut r, 2 * n)),
        ("kt", vec![2, h, d, s], randv(&mut r, 2 * n)),
        ("v", vec![2, h, s, 5], randv(&mut r, 2 * h * s * 5)),
        (
            "mask",
            vec![2, 1, 1, s],
            (0..2 * s)
                .map(|i| if i % 3 == 0 { -1e4 } else { 0.0 })
                .collect(),
        ),
    ];
    check(
        &mp,
        OptLevel::All,
        &feeds,
        &["com.ferrum.FusedAttention"],
        1e-5,
    );
}

/// Chains that must stay: probabilities that are also a graph output, a Softmax over another
/// axis, and a product with a constant (a weight, not attention).
#[test]
fn attention_is_not_fused_where_the_chain_is_needed_or_is_not_attention() {
    let mut r = rng();
    let (s, d) = (6, 4);
    let feeds = [
        ("q", vec![2, s, d], randv(&mut r, 2 * s * d)),
        ("kt", vec![2, d, s], randv(&mut r, 2 * s * d)),
        ("v", vec![2, s, d], randv(&mut r, 2 * s * d)),
    ];
    let ins = || {
        vec![
            f32_in("q", &[2, s as i64, d as i64]),
            f32_in("kt", &[2, d as i64, s as i64]),
            f32_in("v", &[2, s as i64, d as i64]),
        ]
    };
    // P is an output too.
    let mp = model(
        vec![
            node("MatMul", &["q", "kt"], &["scores"], vec![]),
            node("Softmax", &["scores"], &["p"], vec![]),
            node("MatMul", &["p", "v"], &["y"], vec![]),
        ],
        ins(),
        vec![f32_out("y"), f32_out("p")],
        vec![],
        17,
    );
    check(
        &mp,
        OptLevel::All,
        &feeds,
        &["MatMul", "Softmax", "MatMul"],
        0.0,
    );
    // Softmax along the queries.
    let mp = model(
        vec![
            node("MatMul", &["q", "kt"], &["scores"], vec![]),
            node("Softmax", &["scores"], &["p"], vec![attr_int("axis", 1)]),
            node("MatMul", &["p", "v"], &["y"], vec![]),
        ],
        ins(),
        vec![f32_out("y")],
        vec![],
        17,
    );
    check(
        &mp,
        OptLevel::All,
        &feeds,
        &["MatMul", "Softmax", "MatMul"],
        0.0,
    );
}

/// A MobileNetV2-style convolution: `x` `[n, c, h, w]` -> `out` with filter `[m, c/group, k,
/// k]` and a bias, its initializers pushed to `inits`.
#[allow(clippy::too_many_arguments)]
fn mobile_conv(
    r: &mut Rng64,
    name: &str,
    (x, out): (&str, &str),
    (c, m, k, group): (usize, usize, usize, usize),
    (stride, pad, dil): (i64, i64, i64),
    inits: &mut Vec<TensorProto>,
) -> NodeProto {
    let (w, b) = (format!("{name}.w"), format!("{name}.b"));
    let cg = c / group;
    inits.push(init(
        &w,
        &[m as i64, cg as i64, k as i64, k as i64],
        randv(r, m * cg * k * k),
    ));
    inits.push(init(&b, &[m as i64], randv(r, m)));
    node(
        "Conv",
        &[x, &w, &b],
        &[out],
        vec![
            attr_int("group", group as i64),
            attr_ints("strides", &[stride, stride]),
            attr_ints("pads", &[pad; 4]),
            attr_ints("dilations", &[dil, dil]),
        ],
    )
}

#[test]
fn depthwise_separable_chains_run_channels_last_as_in_mobilenet() {
    let mut r = rng();
    let mut inits = Vec::new();
    inits.push(init("lo", &[], vec![0.0]));
    inits.push(init("hi", &[], vec![6.0]));
    // A stem (3x3 stride 2, 3 -> 8). Block 1 (inverted residual): expand 8 -> 48 + Clip,
    // depthwise 3x3 + Clip, project 48 -> 8 + the stem's output. Block 2: expand 8 -> 32 +
    // Relu, depthwise 3x3 stride 2 dilation 2 + Relu, project 32 -> 16. The result is a graph
    // output and read by a Sigmoid.
    let nodes = vec![
        mobile_conv(
            &mut r,
            "st",
            ("x", "x0"),
            (3, 8, 3, 1),
            (2, 1, 1),
            &mut inits,
        ),
        mobile_conv(
            &mut r,
            "e1",
            ("x0", "e1"),
            (8, 48, 1, 1),
            (1, 0, 1),
            &mut inits,
        ),
        node("Clip", &["e1", "lo", "hi"], &["e1c"], vec![]),
        mobile_conv(
            &mut r,
            "d1",
            ("e1c", "d1"),
            (48, 48, 3, 48),
            (1, 1, 1),
            &mut inits,
        ),
        node("Clip", &["d1", "lo", "hi"], &["d1c"], vec![]),
        mobile_conv(
            &mut r,
            "p1",
            ("d1c", "p1"),
            (48, 8, 1, 1),
            (1, 0, 1),
            &mut inits,
        ),
        node("Add", &["p1", "x0"], &["b1"], vec![]),
        mobile_conv(
            &mut r,
            "e2",
            ("b1", "e2"),
            (8, 32, 1, 1),
            (1, 0, 1),
            &mut inits,
        ),
        node("Relu", &["e2"], &["e2r"], vec![]),
        mobile_conv(
            &mut r,
            "d2",
            ("e2r", "d2"),
            (32, 32, 3, 32),
            (2, 2, 2),
            &mut inits,
        ),
        node("Relu", &["d2"], &["d2r"], vec![]),
        mobile_conv(
            &mut r,
            "p2",
            ("d2r", "y"),
            (32, 16, 1, 1),
            (1, 0, 1),
            &mut inits,
        ),
        node("Sigmoid", &["y"], &["s"], vec![]),
    ];
    let mp = model(
        nodes,
        vec![f32_in("x", &[2, 3, 23, 26])],
        vec![f32_out("y"), f32_out("s")],
        inits,
        17,
    );
    let feeds = [("x", vec![2, 3, 23, 26], randv(&mut r, 2 * 3 * 23 * 26))];
    let nhwc = "com.ferrum.NhwcConv";
    // One transpose out (y), and one in (x) unless the stem's direct kernel reads the image's
    // planes where they lie.
    let planes = ferrum_kernels::direct::worthwhile(3);
    let mut want = vec![nhwc; 7];
    want.extend(["Transpose", "Sigmoid"]);
    if !planes {
        want.insert(0, "Transpose");
    }
    check(&mp, OptLevel::All, &feeds, &want, 1e-5);
    let s = session(&mp, OptLevel::All);
    let log = &s.optimization_report().fused;
    let line = format!(
        "7 convolutions, {} transposes in, 1 out",
        usize::from(!planes)
    );
    assert!(log.iter().any(|l| l.contains(&line)), "{log:?}");
    // Block 1's projection, the last to read the stem's output (its residual), writes into
    // it (the GEMM accumulating into the residual gives the bits of adding it in the epilogue:
    // `gemm::tests::a_residual_in_the_epilogue_gives_the_bits_of_accumulating_into_it`, with
    // these operand forms); the outputs are those checked against level 0 above.
    let y = outputs(&s, &feeds).remove(0);
    assert_eq!(s.outputs_in_place(), 1);
    assert!(y.iter().all(|v| v.is_finite()));
    // Level 2 keeps NCHW.
    assert!(!ops(&session(&mp, OptLevel::Extended))
        .iter()
        .any(|o| o == nhwc));
}

#[test]
fn squeeze_and_excitation_blocks_stay_channels_last_as_in_efficientnet() {
    // Two blocks with squeeze-and-excitation gates, batch 2 (a gate per image): the pool reads
    // the depthwise output channels-last, the gate (Sigmoid, then HardSigmoid, each fused into
    // its 1x1 convolution on `[2, C, 1, 1]`) multiplies it in place, the gate on either side
    // of the Mul; block 2 also takes a constant per-channel scale `[1, C, 1, 1]`. The head
    // pools the output, which is also a graph output. No transposes but the two outputs'
    // (block 2's scaled tensor is one too).
    let mut r = rng();
    let mut inits = Vec::new();
    let mut nodes = Vec::new();
    let mut conv = |name: &str, io: (&str, &str), shape, geo, nodes: &mut Vec<NodeProto>| {
        nodes.push(mobile_conv(&mut r, name, io, shape, geo, &mut inits));
    };
    conv("st", ("x", "x0"), (3, 8, 3, 1), (2, 1, 1), &mut nodes);
    conv("e1", ("x0", "e1"), (8, 96, 1, 1), (1, 0, 1), &mut nodes);
    nodes.push(node("Relu", &["e1"], &["e1r"], vec![]));
    conv("d1", ("e1r", "d1"), (96, 96, 3, 96), (1, 1, 1), &mut nodes);
    nodes.push(node("Relu", &["d1"], &["d1r"], vec![]));
    nodes.push(node("GlobalAveragePool", &["d1r"], &["g1"], vec![]));
    conv("f1", ("g1", "f1"), (96, 8, 1, 1), (1, 0, 1), &mut nodes);
    nodes.push(node("Relu", &["f1"], &["f1r"], vec![]));
    conv("h1", ("f1r", "h1"), (8, 96, 1, 1), (1, 0, 1), &mut nodes);
    nodes.push(node("Sigmoid", &["h1"], &["s1"], vec![]));
    nodes.push(node("Mul", &["d1r", "s1"], &["m1"], vec![]));
    conv("p1", ("m1", "p1"), (96, 8, 1, 1), (1, 0, 1), &mut nodes);
    nodes.push(node("Add", &["p1", "x0"], &["b1"], vec![]));
    conv("e2", ("b1", "e2"), (8, 96, 1, 1), (1, 0, 1), &mut nodes);
    nodes.push(node("Relu", &["e2"], &["e2r"], vec![]));
    conv("d2", ("e2r", "d2"), (96, 96, 3, 96), (2, 1, 1), &mut nodes);
    nodes.push(node("Relu", &["d2"], &["d2r"], vec![]));
    nodes.push(node("GlobalAveragePool", &["d2r"], &["g2"], vec![]));
    conv("f2", ("g2", "f2"), (96, 8, 1, 1), (1, 0, 1), &mut nodes);
    nodes.push(node("Relu", &["f2"], &["f2r"], vec![]));
    conv("h2", ("f2r", "h2"), (8, 96, 1, 1), (1, 0, 1), &mut nodes);
    nodes.push(node("HardSigmoid", &["h2"], &["s2"], vec![]));
    nodes.push(node("Mul", &["s2", "d2r"], &["m2"], vec![]));
    nodes.push(node("Mul", &["m2", "k"], &["m3"], vec![]));
    conv("p2", ("m3", "y"), (96, 16, 1, 1), (1, 0, 1), &mut nodes);
    nodes.push(node("GlobalAveragePool", &["y"], &["gy"], vec![]));
    inits.push(init("k", &[1, 96, 1, 1], randv(&mut r, 96)));
    let mp = model(
        nodes,
        vec![f32_in("x", &[2, 3, 41, 38])],
        vec![f32_out("y"), f32_out("gy"), f32_out("m3")],
        inits,
        17,
    );
    let feeds = [("x", vec![2, 3, 41, 38], randv(&mut r, 2 * 3 * 41 * 38))];
    let (nhwc, fused, pool) = (
        "com.ferrum.NhwcConv",
        "com.ferrum.FusedConv",
        "com.ferrum.NhwcGlobalAveragePool",
    );
    let mut want = vec![nhwc, nhwc, nhwc, pool, fused, fused, "Reshape", "Mul", nhwc];
    want.extend([
        nhwc,
        nhwc,
        pool,
        fused,
        fused,
        "Reshape",
        "Mul",
        "Mul",
        "Transpose",
        nhwc,
    ]);
    want.extend(["Transpose", pool]);
    if !ferrum_kernels::direct::worthwhile(3) {
        want.insert(0, "Transpose");
    }
    check(&mp, OptLevel::All, &feeds, &want, 1e-5);
    let s = session(&mp, OptLevel::All);
    let log = &s.optimization_report().fused;
    let line = "7 convolutions, {} transposes in, 2 out, 6 pools and gates";
    let line = line.replace("{}", if want[0] == "Transpose" { "1" } else { "0" });
    assert!(log.iter().any(|l| l.ends_with(&line)), "{log:?}");
}

#[test]
fn large_expansions_are_made_inside_their_depthwise_convolution() {
    // Three inverted residual blocks, channels-last: the first two expand 8 -> 72 channels of
    // 64 x 64 (1.2 MB, more than an L2 cache keeps: fused into NhwcExpandDepthwise, stride 1
    // with ReLU6 and a residual, then stride 2 with SiLU after the expansion and Relu after the
    // depthwise convolution); the third expands to 32 x 32 x 32
    // (131 kB) and keeps its two nodes.
    let mut r = rng();
    let mut inits = Vec::new();
    inits.push(init("lo", &[], vec![0.0]));
    inits.push(init("hi", &[], vec![6.0]));
    let mut nodes = Vec::new();
    let mut conv = |name: &str, io: (&str, &str), shape, geo, nodes: &mut Vec<NodeProto>| {
        nodes.push(mobile_conv(&mut r, name, io, shape, geo, &mut inits));
    };
    conv("e1", ("x", "e1"), (8, 72, 1, 1), (1, 0, 1), &mut nodes);
    nodes.push(node("Clip", &["e1", "lo", "hi"], &["e1c"], vec![]));
    conv("d1", ("e1c", "d1"), (72, 72, 3, 72), (1, 1, 1), &mut nodes);
    nodes.push(node("Clip", &["d1", "lo", "hi"], &["d1c"], vec![]));
    conv("p1", ("d1c", "p1"), (72, 8, 1, 1), (1, 0, 1), &mut nodes);
    nodes.push(node("Add", &["p1", "x"], &["b1"], vec![]));
    conv("e2", ("b1", "e2"), (8, 72, 1, 1), (1, 0, 1), &mut nodes);
    nodes.push(node("Sigmoid", &["e2"], &["e2s"], vec![]));
    nodes.push(node("Mul", &["e2", "e2s"], &["e2r"], vec![]));
    conv("d2", ("e2r", "d2"), (72, 72, 3, 72), (2, 1, 1), &mut nodes);
    nodes.push(node("Relu", &["d2"], &["d2r"], vec![]));
    conv("p2", ("d2r", "b2"), (72, 16, 1, 1), (1, 0, 1), &mut nodes);
    conv("e3", ("b2", "e3"), (16, 32, 1, 1), (1, 0, 1), &mut nodes);
    nodes.push(node("Relu", &["e3"], &["e3r"], vec![]));
    conv("d3", ("e3r", "d3"), (32, 32, 3, 32), (1, 1, 1), &mut nodes);
    nodes.push(node("Relu", &["d3"], &["d3r"], vec![]));
    conv("p3", ("d3r", "y"), (32, 16, 1, 1), (1, 0, 1), &mut nodes);
    let mp = model(
        nodes,
        vec![f32_in("x", &[1, 8, 64, 64])],
        vec![f32_out("y")],
        inits,
        17,
    );
    let feeds = [("x", vec![1, 8, 64, 64], randv(&mut r, 8 * 64 * 64))];
    let (nhwc, fused) = ("com.ferrum.NhwcConv", "com.ferrum.NhwcExpandDepthwise");
    check(
        &mp,
        OptLevel::All,
        &feeds,
        &[
            "Transpose",
            fused,
            nhwc,
            fused,
            nhwc,
            nhwc,
            nhwc,
            nhwc,
            "Transpose",
        ],
        1e-5,
    );
    let s = session(&mp, OptLevel::All);
    let log = &s.optimization_report().fused;
    assert_eq!(
        log.iter()
            .filter(|l| l.ends_with("-> NhwcExpandDepthwise"))
            .count(),
        2,
        "{log:?}"
    );
}

#[test]
fn a_lone_depthwise_convolution_stays_nchw() {
    // Its two transposes would move as many elements as the convolution reads.
    let mut r = rng();
    let mut inits = Vec::new();
    let nodes = vec![mobile_conv(
        &mut r,
        "d",
        ("x", "y"),
        (16, 16, 3, 16),
        (1, 1, 1),
        &mut inits,
    )];
    let mp = model(
        nodes,
        vec![f32_in("x", &[1, 16, 9, 9])],
        vec![f32_out("y")],
        inits,
        17,
    );
    let feeds = [("x", vec![1, 16, 9, 9], randv(&mut r, 16 * 81))];
    check(&mp, OptLevel::All, &feeds, &["Conv"], 1e-5);
}

#[test]
fn a_channels_last_convolution_given_planes_it_cannot_read_turns_them_first() {
    // NhwcConv with `nchw_input` and a 1x1 filter (the direct kernel takes wider windows
    // only): the op turns X `[1, 2, 5, 6]` channels-last itself. Against the sums written out.
    let mut r = rng();
    let (c, m, h, w) = (2, 4, 5, 6);
    let (x, wt, b) = (
        randv(&mut r, c * h * w),
        randv(&mut r, c * m),
        randv(&mut r, m),
    );
    let mut conv = node(
        "NhwcConv",
        &["x", "w", "b"],
        &["y"],
        vec![attr_int("nchw_input", 1)],
    );
    conv.domain = "com.ferrum".into();
    let mp = model(
        vec![conv],
        vec![f32_in("x", &[1, c as i64, h as i64, w as i64])],
        vec![f32_out("y")],
        vec![
            init("w", &[1, 1, c as i64, m as i64], wt.clone()),
            init("b", &[m as i64], b.clone()),
        ],
        17,
    );
    let got = outputs(
        &session(&mp, OptLevel::Disabled),
        &[("x", vec![1, c, h, w], x.clone())],
    );
    let mut want = Vec::new();
    for p in 0..h * w {
        for o in 0..m {
            let dot: f64 = (0..c)
                .map(|ci| x[ci * h * w + p] as f64 * wt[ci * m + o] as f64)
                .sum();
            want.push(dot + b[o] as f64);
        }
    }
    assert_eq!(got[0].len(), want.len());
    for (i, (g, w)) in got[0].iter().zip(&want).enumerate() {
        assert!((*g as f64 - w).abs() <= 1e-5, "at {i}: {g} vs {w}");
    }
}

/// LayerNormalization spelled out as exporters wrote it before opset 17: `y = (x - mean) /
/// sqrt(mean((x - mean)^2) + eps) * gamma + beta` over the last axis.
#[allow(clippy::too_many_arguments)]
fn spelled_out_layer_norm(
    r: &mut Rng64,
    c: usize,
    opset: i64,
    axes: i64,
    square_by_mul: bool,
    with_bias: bool,
    gamma_dims: &[i64],
    eps: f32,
    d_is_output: bool,
) -> ModelProto {
    let mut inits = vec![
        init("gamma", gamma_dims, randv(r, c)),
        init("beta", &[c as i64], randv(r, c)),
        init("two", &[], vec![2.0]),
        init("eps", &[], vec![eps]),
    ];
    let mean = |i: &str, o: &str| {
        if opset >= 18 {
            node("ReduceMean", &[i, "axes"], &[o], vec![])
        } else {
            node("ReduceMean", &[i], &[o], vec![attr_ints("axes", &[axes])])
        }
    };
    if opset >= 18 {
        inits.push(TensorProto {
            name: "axes".into(),
            dims: vec![1],
            data_type: 7,
            int64_data: vec![axes],
            ..Default::default()
        });
    }
    let mut nodes = vec![
        mean("x", "mean"),
        node("Sub", &["x", "mean"], &["d"], vec![]),
        if square_by_mul {
            node("Mul", &["d", "d"], &["sq"], vec![])
        } else {
            node("Pow", &["d", "two"], &["sq"], vec![])
        },
        mean("sq", "var"),
        node("Add", &["var", "eps"], &["ve"], vec![]),
        node("Sqrt", &["ve"], &["s"], vec![]),
        node("Div", &["d", "s"], &["n"], vec![]),
    ];
    if with_bias {
        nodes.push(node("Mul", &["n", "gamma"], &["m"], vec![]));
        nodes.push(node("Add", &["m", "beta"], &["y"], vec![]));
    } else {
        nodes.push(node("Mul", &["gamma", "n"], &["y"], vec![]));
    }
    let mut outs = vec![f32_out("y")];
    if d_is_output {
        outs.push(f32_out("d"));
    }
    model(
        nodes,
        vec![f32_in("x", &[2, 5, c as i64])],
        outs,
        inits,
        opset,
    )
}

#[test]
fn spelled_out_layer_norm_fuses_into_one_node() {
    let mut r = rng();
    let c = 24;
    let feeds = |r: &mut Rng64| {
        let x: Vec<f32> = randv(r, 10 * c).iter().map(|v| 3.0 * v + 0.5).collect();
        [("x", vec![2, 5, c], x)]
    };
    // PyTorch at opset 14, the opset 18 axes input, a positive axis, a square by Mul without a
    // bias, a scale of shape [1, 1, C] with BERT's epsilon, an epsilon large enough to matter.
    for (opset, axes, by_mul, bias, gdims, eps) in [
        (14, -1, false, true, vec![c as i64], 1e-5),
        (18, -1, false, true, vec![c as i64], 1e-5),
        (14, 2, false, true, vec![c as i64], 1e-6),
        (13, -1, true, false, vec![c as i64], 1e-5),
        (14, -1, false, true, vec![1, 1, c as i64], 1e-12),
        (17, -1, false, true, vec![c as i64], 0.5),
    ] {
        eprintln!(
            "opset {opset}, axes {axes}, square by Mul {by_mul}, bias {bias}, gamma {gdims:?}"
        );
        let mp = spelled_out_layer_norm(&mut r, c, opset, axes, by_mul, bias, &gdims, eps, false);
        check(
            &mp,
            OptLevel::All,
            &feeds(&mut r),
            &["LayerNormalization"],
            1e-5,
        );
        // Level 1 keeps the chain.
        let n = if bias { 9 } else { 8 };
        assert_eq!(session(&mp, OptLevel::Basic).model().graph.nodes.len(), n);
    }
}

#[test]
fn layer_norm_chains_that_differ_are_not_fused() {
    let mut r = rng();
    let c = 8;
    let chain = [
        "ReduceMean",
        "Sub",
        "Pow",
        "ReduceMean",
        "Add",
        "Sqrt",
        "Div",
        "Mul",
        "Add",
    ];
    let x: Vec<f32> = randv(&mut r, 10 * c);
    let feeds = [("x", vec![2, 5, c], x)];
    // The centred input is also a graph output; the mean is over the middle axis; the scale
    // has more dims than the input (its product broadcasts to rank 4).
    for (axes, d_out, gdims) in [
        (-1, true, vec![c as i64]),
        (1, false, vec![c as i64]),
        (-1, false, vec![1, 1, 1, c as i64]),
    ] {
        let mp = spelled_out_layer_norm(&mut r, c, 14, axes, false, true, &gdims, 1e-5, d_out);
        check(&mp, OptLevel::All, &feeds, &chain, 0.0);
    }
}

#[test]
fn repeated_computations_are_made_once() {
    let mut r = rng();
    let c = 6;
    let mp = model(
        vec![
            node("Relu", &["x"], &["a"], vec![]),
            node("Relu", &["x"], &["b"], vec![]),
            // Equal once `b` reads as `a`: goes in the same pass.
            node("Mul", &["a", "two"], &["c"], vec![]),
            node("Mul", &["b", "two"], &["d"], vec![]),
            // Another attribute value: a different computation.
            node("LeakyRelu", &["x"], &["e"], vec![attr_f("alpha", 0.1)]),
            node("LeakyRelu", &["x"], &["f"], vec![attr_f("alpha", 0.2)]),
            node("Add", &["c", "d"], &["s"], vec![]),
            node("Add", &["e", "f"], &["t"], vec![]),
            node("Sum", &["s", "t"], &["y"], vec![]),
            // The same as `a`, but a graph output itself: stays.
            node("Relu", &["x"], &["z"], vec![]),
        ],
        vec![f32_in("x", &[2, c as i64])],
        vec![f32_out("y"), f32_out("z")],
        vec![init("two", &[], vec![2.0])],
        17,
    );
    let feeds = [("x", vec![2, c], randv(&mut r, 2 * c))];
    check(
        &mp,
        OptLevel::All,
        &feeds,
        &[
            "Relu",
            "Mul",
            "LeakyRelu",
            "LeakyRelu",
            "Add",
            "Add",
            "Sum",
            "Relu",
        ],
        0.0,
    );
    // Random draws (here training-mode Dropout) are never merged.
    let dropout = |o: &str| {
        node(
            "Dropout",
            &["x", "ratio", "train"],
            &[o],
            vec![attr_int("seed", 3)],
        )
    };
    let mp = model(
        vec![
            dropout("a"),
            dropout("b"),
            node("Add", &["a", "b"], &["y"], vec![]),
        ],
        vec![f32_in("x", &[2, c as i64])],
        vec![f32_out("y")],
        vec![
            init("ratio", &[], vec![0.5]),
            TensorProto {
                name: "train".into(),
                data_type: 9,
                int32_data: vec![1],
                ..Default::default()
            },
        ],
        17,
    );
    assert_eq!(
        ops(&session(&mp, OptLevel::All)),
        ["Dropout", "Dropout", "Add"]
    );
}

/// A stem: Conv (3 input channels, bias) + Relu, then a MaxPool reading only its output, with
/// fresh random geometry (ResNet's 7x7/2 and 3x3/2, pad 1 in the first case); `pool_out` the
/// pool's output name, `extra` more outputs of the graph.
fn stem(
    r: &mut Rng64,
    (h, w): (usize, usize),
    m: usize,
    (k, s, pad): (usize, usize, usize),
    (pk, ps, pp, ceil): (usize, usize, usize, bool),
    extra: &[&str],
) -> ModelProto {
    let c = 3;
    let inits = vec![
        init(
            "w",
            &[m as i64, c, k as i64, k as i64],
            randv(r, m * 3 * k * k),
        ),
        init("b", &[m as i64], randv(r, m)),
    ];
    let (k, s, pad) = (k as i64, s as i64, pad as i64);
    let (pk, ps, pp) = (pk as i64, ps as i64, pp as i64);
    let nodes = vec![
        node(
            "Conv",
            &["x", "w", "b"],
            &["a"],
            vec![
                attr_ints("kernel_shape", &[k, k]),
                attr_ints("strides", &[s, s]),
                attr_ints("pads", &[pad, pad, pad, pad]),
            ],
        ),
        node("Relu", &["a"], &["r"], vec![]),
        node(
            "MaxPool",
            &["r"],
            &["y"],
            vec![
                attr_ints("kernel_shape", &[pk, pk]),
                attr_ints("strides", &[ps, ps]),
                attr_ints("pads", &[pp, pp, pp, pp]),
                attr_int("ceil_mode", ceil as i64),
            ],
        ),
    ];
    let mut outs = vec![f32_out("y")];
    outs.extend(extra.iter().map(|&e| f32_out(e)));
    model(
        nodes,
        vec![f32_in("x", &[1, c, h as i64, w as i64])],
        outs,
        inits,
        17,
    )
}

#[test]
fn a_stem_convolution_and_its_max_pool_become_one_node_as_in_resnet() {
    // Level 3 makes the convolution's rows as the pool needs them (`ConvMaxPool`, on CPUs with
    // the direct kernel); outputs within 1e-5 of level 0's (the direct kernel sums in its own
    // order), every element written. Not when the convolution's output is read elsewhere.
    let mut r = rng();
    let fused = ferrum_kernels::direct::worthwhile(3);
    for case in 0..6 {
        let (h, w) = if case == 0 {
            (64, 56)
        } else {
            (r.gen_range(8..40), r.gen_range(8..40))
        };
        let m = if case == 0 { 64 } else { r.gen_range(1..70) };
        let conv = if case == 0 {
            (7, 2, 3)
        } else {
            let k = [3, 5, 7][r.gen_range(0..3)];
            (k, r.gen_range(1..3), r.gen_range(0..k / 2 + 1))
        };
        let pool = if case == 0 {
            (3, 2, 1, false)
        } else {
            let pk = r.gen_range(2..4);
            (pk, r.gen_range(1..3), r.gen_range(0..pk), r.gen_bool(0.5))
        };
        let mp = stem(&mut r, (h, w), m, conv, pool, &[]);
        let want: &[&str] = if fused {
            &["com.ferrum.ConvMaxPool"]
        } else {
            &["com.ferrum.FusedConv", "MaxPool"]
        };
        let feeds = [("x", vec![1, 3, h, w], randv(&mut r, 3 * h * w))];
        check(&mp, OptLevel::All, &feeds, want, 1e-5);
        if fused {
            let s = session(&mp, OptLevel::All);
            let log = &s.optimization_report().fused;
            assert!(log.iter().any(|l| l.ends_with("-> ConvMaxPool")), "{log:?}");
        }
    }
    // The activation also a graph output: the pool's input must exist, nothing fuses.
    let mp = stem(&mut r, (20, 20), 8, (3, 1, 1), (3, 2, 1, false), &["r"]);
    let feeds = [("x", vec![1, 3, 20, 20], randv(&mut r, 1200))];
    check(
        &mp,
        OptLevel::All,
        &feeds,
        &["com.ferrum.FusedConv", "MaxPool"],
        1e-5,
    );
}
