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
