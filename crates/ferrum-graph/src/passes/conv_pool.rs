//! Convolution + max pool (level 3): a network's stem, a dense convolution over an image's few
//! channels (at most [`direct::MAX_CIN`]) whose output only a 2-D MaxPool reads, becomes one
//! `com.ferrum.ConvMaxPool` node ([`crate::ops`]' `conv_pool`): the direct kernel makes the
//! convolution's rows as the pool needs them and pools them in cache, instead of writing the
//! whole output (ResNet-50: 64 x 112 x 112, 3.2 MB, more than a core's L2) and reading it back.
//!
//! Taken: `Conv` or `FusedConv` (no residual; an activation the kernel applies in registers),
//! float32, one group, a constant filter (stored `[kh, kw, C, M]` for the direct kernel) and
//! bias, explicit padding, static shapes; a MaxPool with one output (no indices), a 2-D window
//! without dilation, explicit padding. Needs the direct kernel on this CPU (AVX-512 or AVX2).
//! `FERRUM_NO_CONV_POOL=1` turns the pass off.

use std::collections::{BTreeMap, HashSet};

use ferrum_kernels::direct;

use super::layout::oihw_to_hwio;
use super::{add_initializer, attr_i, const_f32, constant, is_op, out, remove_nodes, Uses, DOMAIN};
use crate::infer::static_shapes;
use crate::ir::{Attr, Model, Node, ValueType};
use crate::tensor::DType;

/// True when `name` is absent or holds only ones.
fn ones(n: &Node, name: &str) -> bool {
    match n.attrs.get(name) {
        None => true,
        Some(Attr::Ints(v)) => v.iter().all(|&x| x == 1),
        _ => false,
    }
}

/// True when `auto_pad` is absent or `NOTSET`.
fn explicit_pads(n: &Node) -> bool {
    match n.attrs.get("auto_pad") {
        None => true,
        Some(Attr::Str(p)) => p.as_slice() == b"NOTSET",
        _ => false,
    }
}

/// The pass: see the module's documentation. Returns the number of pairs fused.
pub fn conv_max_pool(model: &mut Model, log: &mut Vec<String>) -> usize {
    if std::env::var("FERRUM_NO_CONV_POOL").is_ok_and(|v| v != "0") {
        return 0;
    }
    let shapes = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| static_shapes(model)))
        .unwrap_or_default();
    let g = &model.graph;
    let uses = Uses::of(g);
    // (convolution, pool, fused node without its filter, filter [M, C, kh, kw])
    let mut found = Vec::new();
    for (ci, n) in g.nodes.iter().enumerate() {
        let fused = n.domain == DOMAIN && n.op == "FusedConv";
        if !(is_op(n, "Conv") || fused) || n.outputs.len() != 1 {
            continue;
        }
        if n.inputs.get(3).copied().flatten().is_some() || n.inputs.len() > 4 {
            continue;
        }
        let (Some(x), Some(wv), Some(y)) = (
            n.inputs.first().copied().flatten(),
            n.inputs.get(1).copied().flatten(),
            out(n),
        ) else {
            continue;
        };
        let Some(w) = constant(g, wv).filter(|w| w.dtype() == DType::F32 && w.rank() == 4) else {
            continue;
        };
        let [m, c, kh, kw] = [w.shape()[0], w.shape()[1], w.shape()[2], w.shape()[3]];
        let bias = n.inputs.get(2).copied().flatten();
        if bias.is_some_and(|b| const_f32(g, Some(b)).is_none_or(|b| b.len() != m)) {
            continue;
        }
        let xs = shapes.get(Some(x)).filter(|s| s.len() == 4);
        if attr_i(n, "group", 1) != 1
            || !explicit_pads(n)
            || kh * kw <= 1
            || xs.is_none_or(|s| s[1] != c || s.contains(&0))
            || !direct::worthwhile(c)
        {
            continue;
        }
        if let ValueType::Tensor { dtype: Some(t), .. } = &model.value(x).ty {
            if *t != DType::F32 {
                continue;
            }
        }
        // An activation the kernel applies as it stores (a MaxPool of a later one would not
        // commute with it in general).
        if fused && !crate::ops::act_in_registers(n, "activation") {
            continue;
        }
        let Some(pi) = uses.sole_reader(y) else {
            continue;
        };
        let p = &g.nodes[pi];
        let pooled = out(p);
        let pk = match p.attrs.get("kernel_shape") {
            Some(Attr::Ints(k)) if k.len() == 2 && k.iter().all(|&v| v > 0) => k.clone(),
            _ => continue,
        };
        if !is_op(p, "MaxPool")
            || p.inputs.len() != 1
            || p.outputs.iter().skip(1).any(Option::is_some)
            || !explicit_pads(p)
            || !ones(p, "dilations")
            || shapes.get(pooled).is_none_or(|s| s.len() != 4)
        {
            continue;
        }
        let mut attrs: BTreeMap<String, Attr> = n
            .attrs
            .iter()
            .filter(|(k, _)| {
                matches!(
                    k.as_str(),
                    "strides" | "pads" | "dilations" | "activation" | "activation_params"
                )
            })
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect();
        attrs.insert("pool_kernel_shape".into(), Attr::Ints(pk));
        for name in ["strides", "pads"] {
            if let Some(v) = p.attrs.get(name) {
                attrs.insert(format!("pool_{name}"), v.clone());
            }
        }
        attrs.insert(
            "pool_ceil_mode".into(),
            Attr::Int(attr_i(p, "ceil_mode", 0)),
        );
        let node = Node {
            name: format!("{}+{}", n.name, p.name),
            op: "ConvMaxPool".into(),
            domain: DOMAIN.into(),
            opset: 1,
            inputs: vec![Some(x), None, bias],
            outputs: vec![pooled],
            attrs,
            implicit_inputs: vec![],
        };
        found.push((ci, pi, node, w.clone()));
    }
    let mut count = 0;
    let mut dead = HashSet::new();
    for (ci, pi, mut node, w) in found {
        let Some(hwio) = oihw_to_hwio(&w) else {
            continue;
        };
        let hint = format!("{}_hwio", node.name);
        node.inputs[1] = Some(add_initializer(model, &hint, hwio));
        log.push(format!(
            "{} + {} -> ConvMaxPool",
            model.graph.nodes[ci].name, model.graph.nodes[pi].name
        ));
        // In the pool's place: every input of the convolution comes before it.
        model.graph.nodes[pi] = node;
        dead.insert(ci);
        count += 1;
    }
    remove_nodes(&mut model.graph, &dead);
    count
}
