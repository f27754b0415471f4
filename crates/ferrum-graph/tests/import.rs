//! ONNX decoding and import: both protobuf encodings of repeated numerics, and hostile files
//! that must give an error, never a panic.

use ferrum_graph::onnx::{load_model, load_model_bytes, tensor_from_proto};
use ferrum_graph::proto::build::{f32_tensor, i64_vector, model, node, value};
use ferrum_graph::proto::{decode, encode, AttributeProto, StringStringEntryProto, TensorProto};
use ferrum_graph::{Error, Session, Tensor};

fn varint(mut v: u64, out: &mut Vec<u8>) {
    loop {
        let b = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            out.push(b);
            return;
        }
        out.push(b | 0x80);
    }
}

/// A TensorProto with dims [2, 3], INT64 data [-1, 5, 300, 0, 7, -9], dims and int64_data either
/// one tag per element (unpacked) or one length-delimited blob (packed).
fn int64_tensor_bytes(packed: bool) -> Vec<u8> {
    let mut b = Vec::new();
    let field = |tag: u64, vals: &[i64], b: &mut Vec<u8>| {
        if packed {
            let mut blob = Vec::new();
            for &v in vals {
                varint(v as u64, &mut blob);
            }
            varint(tag << 3 | 2, b);
            varint(blob.len() as u64, b);
            b.extend(blob);
        } else {
            for &v in vals {
                varint(tag << 3, b);
                varint(v as u64, b);
            }
        }
    };
    field(1, &[2, 3], &mut b);
    varint(2 << 3, &mut b);
    varint(7, &mut b); // INT64
    field(7, &[-1, 5, 300, 0, 7, -9], &mut b);
    b
}

#[test]
fn repeated_numerics_decode_packed_and_unpacked() {
    for packed in [false, true] {
        let tp: TensorProto = decode(&int64_tensor_bytes(packed), "tensor").unwrap();
        assert_eq!(tp.dims, vec![2, 3], "packed = {packed}");
        let t = tensor_from_proto(&tp, None).unwrap();
        assert_eq!(t.shape(), &[2, 3]);
        assert_eq!(t.to_i64_vec().unwrap(), vec![-1, 5, 300, 0, 7, -9]);
    }
}

#[test]
fn attribute_floats_decode_packed_and_unpacked() {
    // AttributeProto.floats (field 7, fixed32): unpacked = tag 0x3d per element, packed = LEN.
    let vals = [1.5f32, -2.0];
    let mut unpacked = Vec::new();
    for v in vals {
        unpacked.push(7 << 3 | 5);
        unpacked.extend_from_slice(&v.to_le_bytes());
    }
    let mut packed = vec![7 << 3 | 2, 8];
    for v in vals {
        packed.extend_from_slice(&v.to_le_bytes());
    }
    for bytes in [unpacked, packed] {
        let a: AttributeProto = decode(&bytes, "attribute").unwrap();
        assert_eq!(a.floats, vals.to_vec());
    }
}

#[test]
fn raw_data_and_typed_fields_agree() {
    let typed = f32_tensor("t", &[3], &[1.0, -2.5, 3.25]);
    let raw = TensorProto {
        name: "t".into(),
        dims: vec![3],
        data_type: 1,
        raw_data: [1.0f32, -2.5, 3.25]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        ..Default::default()
    };
    assert_eq!(
        tensor_from_proto(&typed, None).unwrap(),
        tensor_from_proto(&raw, None).unwrap()
    );
}

fn add_model() -> ferrum_graph::proto::ModelProto {
    model(
        vec![node("Add", &["a", "b"], &["y"], vec![])],
        vec![
            value("a", 1, &[Some(2), Some(1), Some(3)]),
            value("b", 1, &[Some(4), Some(1)]),
        ],
        vec![value("y", 1, &[Some(2), Some(4), Some(3)])],
        vec![],
        17,
    )
}

#[test]
fn truncated_files_are_errors() {
    let bytes = encode(&add_model());
    for cut in [1, bytes.len() / 3, bytes.len() / 2, bytes.len() - 1] {
        match load_model_bytes(&bytes[..cut], None) {
            Err(Error::Format(_)) => {}
            other => panic!("cut at {cut}: expected a format error, got {other:?}"),
        }
    }
    assert!(load_model_bytes(b"\xff\xff\xff\xff\xff", None).is_err());
}

#[test]
fn absurd_dims_are_refused_before_allocating() {
    let t = TensorProto {
        name: "w".into(),
        dims: vec![1 << 40, 1 << 40],
        data_type: 1,
        raw_data: vec![0; 16].into(),
        ..Default::default()
    };
    assert!(matches!(tensor_from_proto(&t, None), Err(Error::Format(_))));
    let t = TensorProto {
        name: "w".into(),
        dims: vec![1 << 20, 1 << 10],
        data_type: 1,
        raw_data: vec![0; 16].into(),
        ..Default::default()
    };
    assert!(matches!(tensor_from_proto(&t, None), Err(Error::Format(_))));
    let t = TensorProto {
        name: "w".into(),
        dims: vec![-3],
        data_type: 1,
        ..Default::default()
    };
    assert!(tensor_from_proto(&t, None).is_err());
}

#[test]
fn external_data_may_not_escape_the_model_folder() {
    let dir = std::env::temp_dir().join(format!("ferrum-graph-ext-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("m")).unwrap();
    std::fs::write(dir.join("secret.bin"), [0u8; 12]).unwrap();
    std::fs::write(dir.join("m/w.bin"), 7f32.to_le_bytes().repeat(3)).unwrap();
    let ext = |loc: &str| TensorProto {
        name: "w".into(),
        dims: vec![3],
        data_type: 1,
        data_location: 1,
        external_data: vec![StringStringEntryProto {
            key: "location".into(),
            value: loc.into(),
        }],
        ..Default::default()
    };
    let m = dir.join("m");
    for bad in ["../secret.bin", "/etc/passwd", "sub/../../secret.bin", ""] {
        let r = tensor_from_proto(&ext(bad), Some(&m));
        assert!(
            matches!(r, Err(Error::Format(_))),
            "location {bad:?}: {r:?}"
        );
    }
    let ok = tensor_from_proto(&ext("w.bin"), Some(&m)).unwrap();
    assert_eq!(ok.to_f64_vec().unwrap(), vec![7.0; 3]);
    // A model file using it: loads through the file's folder.
    let mp = model(
        vec![node("Identity", &["w"], &["y"], vec![])],
        vec![],
        vec![value("y", 1, &[Some(3)])],
        vec![ext("w.bin")],
        17,
    );
    std::fs::write(m.join("model.onnx"), encode(&mp)).unwrap();
    assert!(load_model(&m.join("model.onnx")).is_ok());
    let mp = model(
        vec![node("Identity", &["w"], &["y"], vec![])],
        vec![],
        vec![value("y", 1, &[Some(3)])],
        vec![ext("../secret.bin")],
        17,
    );
    std::fs::write(m.join("bad.onnx"), encode(&mp)).unwrap();
    assert!(matches!(
        load_model(&m.join("bad.onnx")),
        Err(Error::Format(_))
    ));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn cycles_are_errors() {
    let mp = model(
        vec![
            node("Relu", &["b"], &["a"], vec![]),
            node("Relu", &["a"], &["b"], vec![]),
        ],
        vec![],
        vec![value("a", 1, &[Some(1)])],
        vec![],
        17,
    );
    match load_model_bytes(&encode(&mp), None) {
        Err(Error::Format(m)) => assert!(m.contains("cycle"), "{m}"),
        other => panic!("expected a cycle error, got {other:?}"),
    }
}

#[test]
fn dangling_inputs_and_duplicate_names_are_errors() {
    let mp = model(
        vec![node("Relu", &["nowhere"], &["y"], vec![])],
        vec![],
        vec![value("y", 1, &[Some(1)])],
        vec![],
        17,
    );
    match load_model_bytes(&encode(&mp), None) {
        Err(Error::Format(m)) => assert!(m.contains("nowhere"), "{m}"),
        other => panic!("expected a dangling-name error, got {other:?}"),
    }
    let mp = model(
        vec![
            node("Relu", &["x"], &["y"], vec![]),
            node("Relu", &["x"], &["y"], vec![]),
        ],
        vec![value("x", 1, &[Some(1)])],
        vec![value("y", 1, &[Some(1)])],
        vec![],
        17,
    );
    assert!(matches!(
        load_model_bytes(&encode(&mp), None),
        Err(Error::Format(_))
    ));
    let mp = model(
        vec![node("Relu", &["x"], &["y"], vec![])],
        vec![value("x", 1, &[Some(1)])],
        vec![value("missing", 1, &[Some(1)])],
        vec![],
        17,
    );
    assert!(matches!(
        load_model_bytes(&encode(&mp), None),
        Err(Error::Format(_))
    ));
}

#[test]
fn nodes_out_of_order_are_sorted() {
    let mp = model(
        vec![
            node("Neg", &["t"], &["y"], vec![]),
            node("Relu", &["x"], &["t"], vec![]),
        ],
        vec![value("x", 1, &[Some(2)])],
        vec![value("y", 1, &[Some(2)])],
        vec![],
        17,
    );
    let s = Session::from_bytes(&encode(&mp)).unwrap();
    let x = Tensor::from_vec(vec![2], vec![-1.0f32, 2.0]).unwrap();
    let out = s.run(vec![("x".into(), x.into())]).unwrap();
    assert_eq!(
        out[0].1.tensor().unwrap().to_f64_vec().unwrap(),
        vec![0.0, -2.0]
    );
}

#[test]
fn unsupported_ops_fail_at_load_naming_node_op_opset_and_dtype() {
    let mut n = node("NoSuchOp", &["x"], &["t"], vec![]);
    n.name = "mystery".into();
    let mut other = node("Frobnicate", &["t"], &["u"], vec![]);
    other.domain = "com.example".into();
    let mp = model(
        vec![n, other, node("Relu", &["u"], &["y"], vec![])],
        vec![value("x", 1, &[Some(1)])],
        vec![value("y", 1, &[Some(1)])],
        vec![],
        17,
    );
    // The session is refused before any run: every node's op is resolved when it is created.
    let err = match Session::from_bytes(&encode(&mp)) {
        Ok(_) => panic!("a model with unknown ops loaded"),
        Err(e) => e,
    };
    assert!(err.is_unsupported());
    let msg = err.to_string();
    for part in [
        "mystery",
        "NoSuchOp",
        "opset 17",
        "FLOAT",
        "1 more node",
        "com.example.Frobnicate",
    ] {
        assert!(msg.contains(part), "{msg} lacks {part}");
    }
}

#[test]
fn element_types_are_checked_at_load_naming_node_op_opset_and_dtype() {
    let to = |t: i64| AttributeProto {
        name: "to".into(),
        i: t,
        r#type: 2,
        ..Default::default()
    };
    let refused = |nodes: Vec<ferrum_graph::proto::NodeProto>, x_type: i32| {
        let mp = model(
            nodes,
            vec![value("x", x_type, &[Some(1), Some(1), Some(3), Some(3)])],
            vec![value("y", 1, &[])],
            vec![],
            17,
        );
        match Session::from_bytes(&encode(&mp)) {
            Ok(_) => panic!("a model with a node fed a type its op does not take loaded"),
            Err(e) => e,
        }
    };
    let named = |mut n: ferrum_graph::proto::NodeProto, name: &str| {
        n.name = name.into();
        n
    };
    // Sin on a declared int64 input: refused at load, naming node, op, opset, type and what
    // the op takes.
    let err = refused(vec![named(node("Sin", &["x"], &["y"], vec![]), "sine")], 7);
    assert!(err.is_unsupported(), "{err}");
    let msg = err.to_string();
    for part in ["sine", "Sin", "opset 17", "INT64", "FLOAT, FLOAT16, DOUBLE"] {
        assert!(msg.contains(part), "{msg} lacks {part}");
    }
    // The type flows: Cast's `to`, Shape's int64, then the op that cannot take it.
    let err = refused(
        vec![
            node("Cast", &["x"], &["i"], vec![to(6)]),
            named(node("Conv", &["i", "i"], &["y"], vec![]), "conv"),
        ],
        1,
    );
    assert!(err.is_unsupported(), "{err}");
    let msg = err.to_string();
    assert!(msg.contains("conv") && msg.contains("INT32"), "{msg}");
    let err = refused(
        vec![
            node("Shape", &["x"], &["s"], vec![]),
            named(node("Exp", &["s"], &["y"], vec![]), "exp"),
        ],
        1,
    );
    assert!(err.to_string().contains("exp") && err.to_string().contains("INT64"));
    // Inputs sharing a type parameter must agree.
    let err = refused(
        vec![
            node("Cast", &["x"], &["i"], vec![to(7)]),
            named(node("Add", &["x", "i"], &["y"], vec![]), "sum"),
        ],
        1,
    );
    let msg = err.to_string();
    assert!(
        msg.contains("sum") && msg.contains("FLOAT and INT64"),
        "{msg}"
    );
    // A branch's node reading an outer value of the wrong type refuses the model too.
    let mp = model(
        vec![node(
            "If",
            &["c"],
            &["y"],
            vec![
                AttributeProto {
                    name: "then_branch".into(),
                    r#type: 5,
                    g: Some(Box::new(ferrum_graph::proto::GraphProto {
                        node: vec![named(node("Sqrt", &["x"], &["t"], vec![]), "root")],
                        output: vec![value("t", 7, &[Some(1)])],
                        ..Default::default()
                    })),
                    ..Default::default()
                },
                AttributeProto {
                    name: "else_branch".into(),
                    r#type: 5,
                    g: Some(Box::new(ferrum_graph::proto::GraphProto {
                        node: vec![node("Neg", &["x"], &["e"], vec![])],
                        output: vec![value("e", 7, &[Some(1)])],
                        ..Default::default()
                    })),
                    ..Default::default()
                },
            ],
        )],
        vec![value("c", 9, &[]), value("x", 7, &[Some(1)])],
        vec![value("y", 7, &[Some(1)])],
        vec![],
        17,
    );
    let err = match Session::from_bytes(&encode(&mp)) {
        Ok(_) => panic!("a branch's Sqrt on int64 loaded"),
        Err(e) => e,
    };
    assert!(err.to_string().contains("root"), "{err}");
    // Types the op takes load and run: int64 through Cast, Add and Neg.
    let mp = model(
        vec![
            node("Cast", &["x"], &["i"], vec![to(7)]),
            node("Add", &["i", "i"], &["s"], vec![]),
            node("Neg", &["s"], &["y"], vec![]),
        ],
        vec![value("x", 1, &[Some(2)])],
        vec![value("y", 7, &[Some(2)])],
        vec![],
        17,
    );
    let s = Session::from_bytes(&encode(&mp)).unwrap();
    let x = Tensor::from_vec(vec![2], vec![1.0f32, -3.0]).unwrap();
    let out = s.run(vec![("x".into(), x.into())]).unwrap();
    assert_eq!(
        out[0].1.tensor().unwrap().to_f64_vec().unwrap(),
        vec![-2.0, 6.0]
    );
}

/// `If(c)` choosing between `then_op(x)` and `else_op(x)` (float [2]), both bodies reading the
/// outer `x`.
fn if_model(then_op: &str, else_op: &str) -> Vec<u8> {
    use ferrum_graph::proto::GraphProto;
    let branch = |name: &str, op: &str| AttributeProto {
        name: name.into(),
        r#type: 5,
        g: Some(Box::new(GraphProto {
            name: format!("{name}_body"),
            node: vec![{
                let mut n = node(op, &["x"], &[&format!("{name}_y")], vec![]);
                n.name = format!("{name}_node");
                n
            }],
            output: vec![value(&format!("{name}_y"), 1, &[Some(2)])],
            ..Default::default()
        })),
        ..Default::default()
    };
    let mp = model(
        vec![node(
            "If",
            &["c"],
            &["y"],
            vec![
                branch("then_branch", then_op),
                branch("else_branch", else_op),
            ],
        )],
        vec![value("c", 9, &[]), value("x", 1, &[Some(2)])],
        vec![value("y", 1, &[Some(2)])],
        vec![],
        17,
    );
    encode(&mp)
}

#[test]
fn subgraph_ops_are_resolved_at_load() {
    use ferrum_graph::ir::Attr;
    let s = Session::from_bytes(&if_model("Relu", "Neg")).unwrap();
    // Every node of the main graph and of the If's bodies has its kernel before any run.
    let g = &s.model().graph;
    assert_eq!(g.kernels.len(), g.nodes.len());
    let bodies: Vec<_> = g.nodes[0]
        .attrs
        .values()
        .filter_map(|a| match a {
            Attr::Graph(b) => Some(b.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(bodies.len(), 2);
    for b in &bodies {
        assert_eq!(b.kernels.len(), b.nodes.len());
    }
    let x = || {
        Tensor::from_vec(vec![2], vec![-1.5f32, 2.0])
            .unwrap()
            .into()
    };
    for (c, want) in [(true, [0.0, 2.0]), (false, [1.5, -2.0])] {
        let out = s
            .run(vec![
                ("c".into(), Tensor::scalar(c).into()),
                ("x".into(), x()),
            ])
            .unwrap();
        assert_eq!(out[0].1.tensor().unwrap().to_f64_vec().unwrap(), want);
    }
    // An op nothing implements in a branch refuses the model at load, though a run might
    // never take that branch.
    let err = match Session::from_bytes(&if_model("Relu", "NoSuchOp")) {
        Ok(_) => panic!("a model with an unknown op in a branch loaded"),
        Err(e) => e,
    };
    assert!(err.is_unsupported());
    let msg = err.to_string();
    for part in ["else_branch_node", "NoSuchOp", "opset 17"] {
        assert!(msg.contains(part), "{msg} lacks {part}");
    }
}

#[test]
fn unsupported_forms_name_node_op_opset_and_dtype_when_run() {
    // BitShift exists, but not with this direction: the kernel reports it when it meets it.
    let mut n = node(
        "BitShift",
        &["x", "s"],
        &["y"],
        vec![AttributeProto {
            name: "direction".into(),
            s: b"SIDEWAYS".to_vec(),
            r#type: 3,
            ..Default::default()
        }],
    );
    n.name = "shifty".into();
    let mp = model(
        vec![n],
        vec![value("x", 4, &[Some(1)]), value("s", 4, &[Some(1)])],
        vec![value("y", 4, &[Some(1)])],
        vec![],
        17,
    );
    let s = Session::from_bytes(&encode(&mp)).unwrap();
    let t = || Tensor::from_vec(vec![1], vec![1u16]).unwrap().into();
    let err = s
        .run(vec![("x".into(), t()), ("s".into(), t())])
        .unwrap_err();
    assert!(err.is_unsupported());
    let msg = err.to_string();
    for part in ["shifty", "BitShift", "opset 17", "UINT16", "SIDEWAYS"] {
        assert!(msg.contains(part), "{msg} lacks {part}");
    }
}

#[test]
fn wrong_inputs_are_errors() {
    let s = Session::from_bytes(&encode(&add_model())).unwrap();
    let a = Tensor::from_vec(vec![2, 1, 3], vec![0f32; 6]).unwrap();
    assert!(matches!(
        s.run(vec![("a".into(), a.clone().into())]),
        Err(Error::Input(_))
    ));
    let bad = Tensor::from_vec(vec![5], vec![0f32; 5]).unwrap();
    assert!(matches!(
        s.run(vec![("a".into(), a.into()), ("b".into(), bad.into())]),
        Err(Error::Input(_))
    ));
}

/// Flipped and truncated bytes of a small valid model: loading and running give results or
/// errors, never a panic.
#[test]
fn mutated_models_never_panic() {
    use ferrum_graph::proto::build::attr_int;
    let mp = model(
        vec![
            node("MatMul", &["x", "w"], &["xw"], vec![]),
            node("Softmax", &["xw"], &["s"], vec![attr_int("axis", -1)]),
            node("Reshape", &["s", "shape"], &["y"], vec![]),
        ],
        vec![value("x", 1, &[Some(2), Some(3)])],
        vec![value("y", 1, &[Some(4)])],
        vec![
            f32_tensor("w", &[3, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
            TensorProto {
                name: "shape".into(),
                dims: vec![1],
                data_type: 7,
                int64_data: vec![4],
                ..Default::default()
            },
        ],
        17,
    );
    let bytes = encode(&mp);
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    let x = Tensor::from_vec(vec![2, 3], vec![0.5f32; 6]).unwrap();
    for _ in 0..3000 {
        let mut b = bytes.clone();
        for _ in 0..1 + next() % 4 {
            let i = (next() as usize) % b.len();
            b[i] = next() as u8;
        }
        if next() % 8 == 0 {
            b.truncate((next() as usize) % b.len());
        }
        let r = std::panic::catch_unwind(|| match Session::from_bytes(&b) {
            Ok(s) => s
                .run(vec![("x".into(), x.clone().into())])
                .err()
                .map(|e| e.to_string()),
            Err(_) => None,
        });
        let msg = r
            .unwrap_or_else(|_| Some("panicked".into()))
            .unwrap_or_default();
        assert!(!msg.contains("panicked"), "mutated model {b:02x?}: {msg}");
    }
}

/// Static shape inference (each op's shape rule, kept beside its kernel) gives every value the
/// shape the kernels then produce: a model of the common ops on fresh random dims, every value
/// a graph output, its inferred shapes against a run's at level 0 (nothing rewritten). The
/// shape arithmetic PyTorch exports (Shape, Gather, Unsqueeze, Concat into Reshape) is followed
/// through its constant values.
#[test]
fn inferred_shapes_are_the_shapes_a_run_produces() {
    use ferrum_graph::proto::build::{attr_int, attr_ints};
    use rand::Rng;
    let mut rng = rand::thread_rng();
    for _ in 0..16 {
        let (n, c, h, w, m) = (
            rng.gen_range(1..3i64),
            rng.gen_range(1..5i64),
            rng.gen_range(5..12i64),
            rng.gen_range(5..12i64),
            rng.gen_range(1..6i64),
        );
        let (stride, pad, ceil) = (
            rng.gen_range(1..3i64),
            rng.gen_range(0..2i64),
            rng.gen_range(0..2i64),
        );
        eprintln!("x [{n}, {c}, {h}, {w}], {m} filters, stride {stride}, pad {pad}, ceil {ceil}");
        let filt = vec![0.5f32; (m * c * 9) as usize];
        let inits = vec![
            f32_tensor("wc", &[m, c, 3, 3], &filt),
            i64_vector("zero", &[0]),
            i64_vector("minus1", &[-1]),
            i64_vector("axes0", &[0]),
            i64_vector("starts", &[1]),
            i64_vector("ends", &[h - 1]),
            i64_vector("axes2", &[2]),
        ];
        let nodes = vec![
            node(
                "Conv",
                &["x", "wc"],
                &["conv"],
                vec![
                    attr_ints("strides", &[stride, stride]),
                    attr_ints("pads", &[pad, pad, pad, pad]),
                ],
            ),
            node(
                "MaxPool",
                &["conv"],
                &["pool"],
                vec![
                    attr_ints("kernel_shape", &[2, 2]),
                    attr_ints("strides", &[2, 2]),
                    attr_int("ceil_mode", ceil),
                ],
            ),
            node("Shape", &["pool"], &["shape"], vec![]),
            node(
                "Gather",
                &["shape", "zero"],
                &["batch"],
                vec![attr_int("axis", 0)],
            ),
            node(
                "Concat",
                &["batch", "minus1"],
                &["target"],
                vec![attr_int("axis", 0)],
            ),
            node("Reshape", &["pool", "target"], &["flat"], vec![]),
            node("Transpose", &["flat"], &["flat_t"], vec![]),
            node("MatMul", &["flat", "flat_t"], &["gram"], vec![]),
            node("Softmax", &["gram"], &["soft"], vec![attr_int("axis", -1)]),
            node(
                "Gemm",
                &["flat", "flat"],
                &["gemm"],
                vec![attr_int("transB", 1)],
            ),
            node("Add", &["gemm", "soft"], &["sum"], vec![]),
            node("Unsqueeze", &["sum", "axes0"], &["sum3"], vec![]),
            node(
                "Slice",
                &["x", "starts", "ends", "axes2"],
                &["sliced"],
                vec![],
            ),
            node(
                "Flatten",
                &["sliced"],
                &["sliced2"],
                vec![attr_int("axis", 2)],
            ),
            node("GlobalAveragePool", &["conv"], &["gap"], vec![]),
            node("Relu", &["gap"], &["relu"], vec![]),
        ];
        let names: Vec<String> = nodes.iter().map(|n| n.output[0].clone()).collect();
        let outs = names.iter().map(|o| value(o, 0, &[])).collect();
        let mut mp = model(
            nodes,
            vec![value("x", 1, &[Some(n), Some(c), Some(h), Some(w)])],
            outs,
            inits,
            17,
        );
        for o in &mut mp.graph.as_mut().unwrap().output {
            o.r#type = None;
        }
        let s = Session::from_bytes_with(
            &encode(&mp),
            &ferrum_graph::SessionOptions {
                opt_level: ferrum_graph::OptLevel::Disabled,
                ..Default::default()
            },
        )
        .unwrap();
        let len = (n * c * h * w) as usize;
        let x = Tensor::from_vec(
            vec![n as usize, c as usize, h as usize, w as usize],
            (0..len).map(|_| rng.gen_range(-1.0f32..1.0)).collect(),
        )
        .unwrap();
        let ran = s.run(vec![("x".into(), x.into())]).unwrap();
        let m = s.model();
        let shapes = ferrum_graph::infer::static_shapes(m);
        for node in &m.graph.nodes {
            let id = node.outputs[0].unwrap();
            let name = &m.value(id).name;
            let (_, v) = ran.iter().find(|(o, _)| o == name).unwrap();
            let got = v.tensor().unwrap().shape();
            assert_eq!(
                shapes.get(Some(id)).map(Vec::as_slice),
                Some(got),
                "{} ({})",
                name,
                node.op
            );
            if node.op == "Conv" {
                let flops = ferrum_graph::infer::node_flops(node, &shapes).unwrap();
                let outs: usize = got.iter().product();
                assert_eq!(flops, 2.0 * outs as f64 * (c * 9) as f64);
            }
        }
    }
}

/// Shape rules meet malformed nodes (which the kernels refuse when run) with "unknown", never a
/// panic: two -1s in a Reshape, a permutation out of range, a zero or negative stride, a
/// Concat axis past the rank, a Gather index past the end.
#[test]
fn shape_rules_give_unknown_for_malformed_nodes() {
    use ferrum_graph::proto::build::{attr_int, attr_ints};
    let inits = vec![
        f32_tensor("wc", &[2, 3, 3, 3], &[0.0; 54]),
        i64_vector("two_free", &[-1, -1]),
        i64_vector("far", &[9]),
    ];
    let nodes = vec![
        node("Reshape", &["x", "two_free"], &["r"], vec![]),
        node(
            "Transpose",
            &["x"],
            &["t"],
            vec![attr_ints("perm", &[0, 9, -3, 1])],
        ),
        node(
            "Conv",
            &["x", "wc"],
            &["c0"],
            vec![attr_ints("strides", &[0, -2])],
        ),
        node("Concat", &["x", "x"], &["cat"], vec![attr_int("axis", 7)]),
        node("Shape", &["x"], &["shape"], vec![]),
        node(
            "Gather",
            &["shape", "far"],
            &["g"],
            vec![attr_int("axis", 0)],
        ),
        node("Reshape", &["x", "g"], &["r2"], vec![]),
        node(
            "MaxPool",
            &["x"],
            &["p"],
            vec![attr_ints("kernel_shape", &[0, -4])],
        ),
    ];
    let outs = ["r", "t", "c0", "cat", "g", "r2", "p"]
        .iter()
        .map(|o| value(o, 0, &[]))
        .collect();
    let mut mp = model(
        nodes,
        vec![value("x", 1, &[Some(1), Some(3), Some(4), Some(4)])],
        outs,
        inits,
        17,
    );
    for o in &mut mp.graph.as_mut().unwrap().output {
        o.r#type = None;
    }
    let m = ferrum_graph::onnx::load_model_bytes(&encode(&mp), None).unwrap();
    let shapes = ferrum_graph::infer::static_shapes(&m);
    for n in &m.graph.nodes {
        let known = shapes.get(n.outputs[0]);
        match n.op.as_str() {
            "Shape" => assert_eq!(known, Some(&vec![4])),
            // A valid Gather of an index out of range: its dims, no values (r2 unknown).
            "Gather" => assert_eq!(known, Some(&vec![1])),
            // Strides of 0 and -2 are read as 1, as the kernel reads them.
            "Conv" => assert_eq!(known, Some(&vec![1, 2, 2, 2])),
            op => assert_eq!(known, None, "{op}"),
        }
    }
}

/// A convolution's window attributes are read once, when its op is resolved: an `auto_pad` the
/// kernels do not know refuses the session at load, naming the node, op, opset and type.
#[test]
fn window_attributes_are_parsed_at_load() {
    let mut n = node(
        "Conv",
        &["x", "w"],
        &["y"],
        vec![AttributeProto {
            name: "auto_pad".into(),
            s: b"SIDEWAYS".to_vec(),
            r#type: 3,
            ..Default::default()
        }],
    );
    n.name = "slanted".into();
    let mp = model(
        vec![n],
        vec![value("x", 1, &[Some(1), Some(1), Some(4), Some(4)])],
        vec![value("y", 1, &[])],
        vec![f32_tensor("w", &[1, 1, 3, 3], &[1.0; 9])],
        17,
    );
    let err = match Session::from_bytes(&encode(&mp)) {
        Ok(_) => panic!("a Conv with auto_pad SIDEWAYS loaded"),
        Err(e) => e,
    };
    assert!(err.is_unsupported(), "{err}");
    let msg = err.to_string();
    for part in [
        "slanted",
        "Conv",
        "opset 17",
        "FLOAT",
        "auto_pad 'SIDEWAYS'",
    ] {
        assert!(msg.contains(part), "{msg} lacks {part}");
    }
}
