//! `ai.onnx.preview.training.Gradient`, expanded at import into ordinary nodes by reverse-mode
//! differentiation of the graph between `xs` and `y` (Add, Sub, Mul, Neg, Identity so far; a
//! Gradient through anything else stays in place, and a session refuses it as an unsupported op).

use std::collections::HashMap;

use crate::proto::{AttributeProto, NodeProto, TensorProto};

const DOMAIN: &str = "ai.onnx.preview.training";

fn node(op: &str, inputs: &[&str], output: &str) -> NodeProto {
    NodeProto {
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: vec![output.to_string()],
        op_type: op.to_string(),
        name: output.to_string(),
        ..Default::default()
    }
}

/// `ConstantOfShape(Shape(like))` filled with `v` (float).
fn fill_like(like: &str, v: f32, out: &str, nodes: &mut Vec<NodeProto>) {
    let shape = format!("{out}__shape");
    nodes.push(node("Shape", &[like], &shape));
    let mut c = node("ConstantOfShape", &[&shape], out);
    c.attribute.push(AttributeProto {
        name: "value".into(),
        r#type: 4,
        t: Some(TensorProto {
            dims: vec![1],
            data_type: 1,
            float_data: vec![v],
            ..Default::default()
        }),
        ..Default::default()
    });
    nodes.push(c);
}

/// Replaces each differentiable Gradient node of `nodes` by the nodes computing it.
pub fn expand(nodes: &[NodeProto]) -> Vec<NodeProto> {
    let mut out = Vec::with_capacity(nodes.len());
    for (k, g) in nodes.iter().enumerate() {
        if g.op_type != "Gradient" || g.domain != DOMAIN {
            out.push(g.clone());
            continue;
        }
        match differentiate(nodes, g, k) {
            Some(body) => out.extend(body),
            None => out.push(g.clone()),
        }
    }
    out
}

fn differentiate(nodes: &[NodeProto], g: &NodeProto, k: usize) -> Option<Vec<NodeProto>> {
    let attr = |n: &str| g.attribute.iter().find(|a| a.name == n);
    let xs: Vec<String> = attr("xs")?
        .strings
        .iter()
        .map(|s| String::from_utf8_lossy(s).into_owned())
        .collect();
    let y = String::from_utf8_lossy(&attr("y")?.s).into_owned();
    let producer: HashMap<&str, &NodeProto> = nodes
        .iter()
        .flat_map(|n| n.output.iter().map(move |o| (o.as_str(), n)))
        .collect();
    // Nodes y depends on, in reverse topological order (depth-first from y).
    let mut order: Vec<&NodeProto> = Vec::new();
    let mut seen: Vec<&str> = Vec::new();
    fn visit<'a>(
        v: &'a str,
        producer: &HashMap<&'a str, &'a NodeProto>,
        seen: &mut Vec<&'a str>,
        order: &mut Vec<&'a NodeProto>,
        stop: &[String],
    ) {
        if seen.contains(&v) || stop.iter().any(|s| s == v) {
            return;
        }
        seen.push(v);
        if let Some(n) = producer.get(v) {
            for i in &n.input {
                visit(i, producer, seen, order, stop);
            }
            order.push(n);
        }
    }
    visit(&y, &producer, &mut seen, &mut order, &xs);
    let p = format!("__grad{k}_");
    let mut body = Vec::new();
    let mut grads: HashMap<String, Vec<String>> = HashMap::new();
    let seed = format!("{p}seed");
    fill_like(&y, 1.0, &seed, &mut body);
    grads.insert(y.clone(), vec![seed]);
    let mut fresh = 0;
    let mut name = |tag: &str| {
        fresh += 1;
        format!("{p}{tag}{fresh}")
    };
    for n in order.iter().rev() {
        let outs: Vec<&String> = n.output.iter().filter(|o| grads.contains_key(*o)).collect();
        if outs.is_empty() {
            continue;
        }
        let o = &n.output[0];
        let gs = grads.remove(o)?;
        let go = if gs.len() == 1 {
            gs[0].clone()
        } else {
            let s = name("sum");
            let refs: Vec<&str> = gs.iter().map(String::as_str).collect();
            body.push(node("Sum", &refs, &s));
            s
        };
        let mut push = |v: &str, g: String| grads.entry(v.to_string()).or_default().push(g);
        match (n.op_type.as_str(), n.input.as_slice()) {
            ("Add", [a, b]) => {
                push(a, go.clone());
                push(b, go);
            }
            ("Sub", [a, b]) => {
                let neg = name("neg");
                body.push(node("Neg", &[&go], &neg));
                push(a, go);
                push(b, neg);
            }
            ("Mul", [a, b]) => {
                let (ga, gb) = (name("mul"), name("mul"));
                body.push(node("Mul", &[&go, b], &ga));
                body.push(node("Mul", &[&go, a], &gb));
                push(a, ga);
                push(b, gb);
            }
            ("Neg", [a]) => {
                let neg = name("neg");
                body.push(node("Neg", &[&go], &neg));
                push(a, neg);
            }
            ("Identity", [a]) => push(a, go),
            _ => return None,
        }
    }
    for (x, out) in xs.iter().zip(&g.output) {
        if out.is_empty() {
            continue;
        }
        match grads.get(x) {
            Some(gs) => {
                let refs: Vec<&str> = gs.iter().map(String::as_str).collect();
                body.push(node(
                    if refs.len() == 1 { "Identity" } else { "Sum" },
                    &refs,
                    out,
                ));
            }
            None => fill_like(x, 0.0, out, &mut body),
        }
    }
    Some(body)
}
