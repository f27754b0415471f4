//! Graph optimisation: rewrites of the imported IR, run once when a session is created.
//!
//! Each pass is a small rewrite of the main graph that leaves its outputs unchanged (up to f32
//! rounding where weights are folded). The levels follow ONNX Runtime's:
//!
//! | level | passes |
//! |---|---|
//! | 0 `Disabled` | none: the graph runs as imported |
//! | 1 `Basic` | constant folding, Identity/Dropout elimination, common-subexpression elimination, dead-code elimination, Conv+BatchNormalization and Conv+Add(constant) folded into the weights, a constant Mul or Div after a MatMul by a constant matrix (and its bias Add) folded into the weights and bias; then constant weights packed for the GEMM ([`PackedWeights`]; in bf16 for the tile unit with [`Precision::Bf16`]) |
//! | 2 `Extended` | level 1, then LayerNormalization spelled out as ReduceMean, Sub, Pow, ReduceMean, Add, Sqrt, Div, Mul, Add (exports before opset 17) into one `LayerNormalization` (`norm`), the erf form of GELU into one node, multi-head attention (MatMul, scale, mask, Softmax, MatMul) into one `FusedAttention` node, a dynamically quantized MatMul's MatMulInteger + Cast + scale Mul (+ bias Add) into one MatMulIntegerToFloat, (before constant folding) a statically quantized model's QDQ groups into integer operators (Conv into QLinearConv, a residual Add into QLinearAdd, a Linear's Gemm into MatMulIntegerToFloat on the integer weights: `passes/qdq.rs`), and bias, residual Add and activation fused into the Conv, Gemm or MatMul (activation only: MatMulIntegerToFloat) that produces their input ([`crate::ops`]' `com.ferrum` ops) |
//! | 3 `All` | level 2, then chains of depthwise and pointwise convolutions moved to channels-last (`NhwcConv` on `[N, H, W, C]` tensors, transposes at the region's edges; squeeze-and-excitation pools and gates inside the region; f32 sessions; a large 1x1 expansion and the depthwise convolution that reads it as one `NhwcExpandDepthwise`), and chains of 8-bit QLinearConvs and QLinearAdds likewise (`NhwcQLinearConv`; a dequantized max pool between them as `NhwcMaxPool` on the bytes); a GlobalAveragePool reading a channels-last tensor through a transpose (and a per-tensor DequantizeLinear) reads it in place (`NhwcGlobalAveragePool`); a stem's convolution over an image's few channels and the max pool that alone reads it as one `ConvMaxPool` (`conv_pool`) |
//!
//! Fused nodes live in the `com.ferrum` domain: `FusedConv` (Conv's inputs, then an optional
//! residual `Z` added before the activation), `NhwcConv` (the same on channels-last tensors,
//! filter `[kh, kw, C/group, M]`; see `layout`), `NhwcExpandDepthwise` (a 1x1 expansion's X, W, bias, then a depthwise filter, its bias and a residual; the expansion's activation in `expand_activation`), `NhwcQLinearConv` (QLinearConv's inputs on
//! channels-last 8-bit tensors), `NhwcMaxPool` (MaxPool on channels-last bytes), `NhwcGlobalAveragePool` (GlobalAveragePool of a channels-last float32 tensor, output `[N, C, 1, 1]`), `ConvMaxPool` (a convolution's X, its filter `[kh, kw, C, M]` and bias, then a max pool: `pool_kernel_shape`, `pool_strides`, `pool_pads`, `pool_ceil_mode`), `FusedGemm`, `FusedMatMul` (A, B, an optional bias
//! along the last axis, an optional residual `Z` of the output's shape added after it), `FusedAttention` (see `attention`) and `Gelu`, each with an `activation` attribute (and
//! `activation_params`), and `MatMulIntegerToFloat` (A, B, a_scale, a_zero_point, b_scale,
//! b_zero_point, bias: ONNX Runtime's op of that name, with the same optional activation). Subgraphs (If/Loop/Scan bodies) are left as they are.

mod attention;
mod conv_pool;
mod fold;
mod fuse;
mod layout;
mod norm;
mod prepack;
mod qdq;

pub use prepack::{PackedWeights, Role};

use std::collections::{HashMap, HashSet};

pub use ferrum_kernels::gemm::Precision;

use crate::ir::{Attr, Graph, Model, Node, ValueId, ValueInfo, ValueType};
use crate::tensor::{DType, Tensor, Value};
use crate::Result;

/// The domain of ferrum's fused ops.
pub const DOMAIN: &str = "com.ferrum";

/// How much the graph is rewritten before it runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Default)]
pub enum OptLevel {
    Disabled = 0,
    Basic = 1,
    Extended = 2,
    #[default]
    All = 3,
}

impl OptLevel {
    /// The level for `0..=3` (larger numbers mean `All`).
    pub fn from_number(n: u32) -> OptLevel {
        match n {
            0 => OptLevel::Disabled,
            1 => OptLevel::Basic,
            2 => OptLevel::Extended,
            _ => OptLevel::All,
        }
    }
}

/// What the passes did.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub level: OptLevel,
    /// The arithmetic of the prepacked float products (bf16 only when asked for and the CPU
    /// runs it).
    pub precision: Precision,
    pub nodes_before: usize,
    pub nodes_after: usize,
    /// Per pass: its name and how many rewrites it made.
    pub passes: Vec<(&'static str, usize)>,
    /// One line per fusion: which nodes became which.
    pub fused: Vec<String>,
}

/// Rewrites `model`'s main graph at `level` and returns what was done. `precision` is that of
/// the float products whose constant operand is prepacked (level 1 and up); a caller asking for
/// [`Precision::Bf16`] checks [`ferrum_kernels::gemm::bf16_supported`] first.
pub fn optimize(model: &mut Model, level: OptLevel, precision: Precision) -> Result<Report> {
    let mut report = Report {
        level,
        precision: if level >= OptLevel::Basic {
            precision
        } else {
            Precision::F32
        },
        nodes_before: model.graph.nodes.len(),
        ..Default::default()
    };
    if level >= OptLevel::Extended {
        // Before constant folding, which would dequantize the weights it reads.
        run(&mut report, "qdq conv fusion", model, qdq::qdq_conv);
        run(&mut report, "qdq add fusion", model, qdq::qdq_add);
        run(&mut report, "qdq gemm fusion", model, qdq::qdq_gemm);
    }
    if level >= OptLevel::Basic {
        run(
            &mut report,
            "constant folding",
            model,
            fold::constant_folding,
        );
        run(
            &mut report,
            "identity elimination",
            model,
            fold::eliminate_identity,
        );
        run(
            &mut report,
            "common subexpressions",
            model,
            fold::common_subexpressions,
        );
        run(
            &mut report,
            "conv+batchnorm folding",
            model,
            fuse::conv_batchnorm,
        );
        run(&mut report, "conv+add folding", model, fuse::conv_add_bias);
        run(
            &mut report,
            "matmul+scale folding",
            model,
            fuse::matmul_scale,
        );
        run(&mut report, "dead-code elimination", model, fold::dead_code);
    }
    if level >= OptLevel::Extended {
        run(&mut report, "layernorm fusion", model, norm::layer_norm);
        run(&mut report, "gelu fusion", model, fuse::gelu);
        run(&mut report, "silu fusion", model, fuse::silu);
        run(&mut report, "attention fusion", model, attention::attention);
        run(
            &mut report,
            "integer matmul fusion",
            model,
            fuse::int_matmul_to_float,
        );
        run(&mut report, "activation fusion", model, fuse::activations);
        run(&mut report, "dead-code elimination", model, fold::dead_code);
    }
    if level >= OptLevel::All && report.precision == Precision::F32 {
        run(
            &mut report,
            "channels-last layout",
            model,
            layout::channels_last,
        );
        run(
            &mut report,
            "expansion+depthwise fusion",
            model,
            layout::expand_depthwise,
        );
        run(
            &mut report,
            "8-bit channels-last layout",
            model,
            layout::quantized_channels_last,
        );
        run(
            &mut report,
            "channels-last global pool",
            model,
            layout::channels_last_pool,
        );
        run(
            &mut report,
            "conv+maxpool fusion",
            model,
            conv_pool::conv_max_pool,
        );
        run(&mut report, "dead-code elimination", model, fold::dead_code);
    }
    model.graph.plan_frees();
    report.nodes_after = model.graph.nodes.len();
    if level >= OptLevel::Basic {
        let shapes = crate::infer::static_shapes(model);
        let n = prepack::prepack(&mut model.graph, precision, &shapes);
        tracing::debug!(operands = n, "weights prepacked");
        report.passes.push(("weight prepacking", n));
    }
    Ok(report)
}

fn run(
    report: &mut Report,
    name: &'static str,
    model: &mut Model,
    pass: fn(&mut Model, &mut Vec<String>) -> usize,
) {
    // Again while it rewrites something (one rewrite can expose the next, e.g. a Mul then an
    // Add folded into the same Conv), a few rounds at most.
    let mut total = 0;
    for _ in 0..8 {
        let n = pass(model, &mut report.fused);
        total += n;
        if n == 0 {
            break;
        }
    }
    tracing::debug!(pass = name, rewrites = total, "graph pass");
    report.passes.push((name, total));
}

/// What the passes ask of a graph: who produces and who reads each value.
pub(crate) struct Uses {
    /// Node index producing each value.
    pub producer: HashMap<ValueId, usize>,
    /// Readers of each value: node indices (once per input slot).
    pub readers: HashMap<ValueId, Vec<usize>>,
    /// Values that must keep their identity: graph outputs and values read by subgraphs.
    pub pinned: HashSet<ValueId>,
}

impl Uses {
    pub fn of(g: &Graph) -> Uses {
        let mut u = Uses {
            producer: HashMap::new(),
            readers: HashMap::new(),
            pinned: g.outputs.iter().copied().collect(),
        };
        for (i, n) in g.nodes.iter().enumerate() {
            for o in n.outputs.iter().flatten() {
                u.producer.insert(*o, i);
            }
            for v in n.inputs.iter().flatten() {
                u.readers.entry(*v).or_default().push(i);
            }
            u.pinned.extend(n.implicit_inputs.iter().copied());
        }
        u
    }

    /// The only node reading `v`, when exactly one does and `v` is not pinned.
    pub fn sole_reader(&self, v: ValueId) -> Option<usize> {
        if self.pinned.contains(&v) {
            return None;
        }
        match self.readers.get(&v).map(Vec::as_slice) {
            Some([i]) => Some(*i),
            _ => None,
        }
    }
}

/// The constant tensor behind `v`: an initializer that is not also an (overridable) input.
pub(crate) fn constant(g: &Graph, v: ValueId) -> Option<&Tensor> {
    if g.inputs.contains(&v) {
        return None;
    }
    g.initializers.iter().find_map(|(id, val)| match val {
        Value::Tensor(t) if *id == v => Some(t),
        _ => None,
    })
}

/// A float32 constant's values.
pub(crate) fn const_f32(g: &Graph, v: Option<ValueId>) -> Option<&[f32]> {
    let t = constant(g, v?)?;
    if t.dtype() != DType::F32 {
        return None;
    }
    t.as_slice::<f32>().ok()
}

/// A float32 constant holding one value (any shape with one element).
pub(crate) fn const_scalar(g: &Graph, v: Option<ValueId>) -> Option<f32> {
    match const_f32(g, v)? {
        [x] => Some(*x),
        _ => None,
    }
}

/// Adds a new initializer value named after `hint` and returns its id.
pub(crate) fn add_initializer(model: &mut Model, hint: &str, t: Tensor) -> ValueId {
    let id = ValueId(model.values.len() as u32);
    model.values.push(ValueInfo {
        name: format!("{hint}#{}", id.0),
        ty: ValueType::Tensor {
            dtype: Some(t.dtype()),
            shape: Some(
                t.shape()
                    .iter()
                    .map(|&d| crate::ir::Dim::Known(d))
                    .collect(),
            ),
        },
    });
    model.graph.initializers.push((id, Value::Tensor(t)));
    id
}

/// Removes the nodes whose index is in `dead`, keeping the order of the others.
pub(crate) fn remove_nodes(g: &mut Graph, dead: &HashSet<usize>) {
    if dead.is_empty() {
        return;
    }
    let nodes = std::mem::take(&mut g.nodes);
    g.nodes = nodes
        .into_iter()
        .enumerate()
        .filter(|(i, _)| !dead.contains(i))
        .map(|(_, n)| n)
        .collect();
}

/// A node's first output.
pub(crate) fn out(n: &Node) -> Option<ValueId> {
    n.outputs.first().copied().flatten()
}

/// The operand of a two-input node that is not `v` (`None` when both or neither are).
pub(crate) fn other_input(n: &Node, v: ValueId) -> Option<ValueId> {
    match n.inputs.as_slice() {
        [Some(a), Some(b)] if *a == v && *b != v => Some(*b),
        [Some(a), Some(b)] if *b == v && *a != v => Some(*a),
        _ => None,
    }
}

/// True for a node in the default ONNX domain with op `op`.
pub(crate) fn is_op(n: &Node, op: &str) -> bool {
    n.op == op && (n.domain.is_empty() || n.domain == "ai.onnx")
}

/// The value of a float attribute, or `default`.
pub(crate) fn attr_f(n: &Node, name: &str, default: f32) -> f32 {
    match n.attrs.get(name) {
        Some(Attr::Float(v)) => *v,
        Some(Attr::Int(v)) => *v as f32,
        _ => default,
    }
}

/// The value of an int attribute, or `default`.
pub(crate) fn attr_i(n: &Node, name: &str, default: i64) -> i64 {
    match n.attrs.get(name) {
        Some(Attr::Int(v)) => *v,
        _ => default,
    }
}
