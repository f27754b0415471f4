//! Operator kernels, and the resolution of a node's domain and op type to its kernel.
//!
//! Each kernel reads its inputs and attributes through [`Ctx`] and returns its outputs. Each
//! module maps its op types to kernels (its `kernel` function); [`resolve`] picks the module
//! once per node, when a session is created, so a run looks nothing up. The reference kernels
//! are plain loops written once over generic element types ([`crate::tensor::Num`]); float math
//! runs in f64 and rounds once to the output type. float32 fast paths (`fast`, `linear`,
//! `conv`, `nhwc`, `attention`) sit beside them, in the same kernel.
//!
//! Each module also gives its ops' static rules ([`Rules`]: the output's shape from what is known
//! of the inputs, and a FLOP estimate), resolved with the kernel; [`crate::infer`] walks a graph
//! with them.

mod attention;
mod control;
pub(crate) mod conv;
mod conv_pool;
mod dsp;
mod elementwise;
mod fast;
mod fused;
mod gather;
mod grid;
mod linear;
mod misc;
mod ml;
mod nhwc;
mod nn;
mod quant;
mod reduce;
mod resize;
mod rnn;
mod sequence_models;
mod shape;
mod text;
mod training;
mod vecmath;

pub use elementwise::broadcast_shape;
pub use shape::strides;

/// Whether the activation a fused node names by its attribute `name` (absent: identity) is one
/// the kernels apply in registers as they store (all but Tanh and GeluTanh).
pub(crate) fn act_in_registers(node: &Node, name: &str) -> bool {
    fused::Act::of(node, name).is_ok_and(|a| linear::split_act(a).1 == fused::Act::Identity)
}

use std::sync::Arc;

use crate::exec::Env;
use crate::ir::{Attr, Node};
use crate::tensor::{Tensor, Value};
use crate::{kbail, Error, Result};
use ferrum_kernels::gemm::{PackedA, PackedB};

/// What a kernel sees: its node (attributes, and those parsed when it was resolved), its inputs
/// and the enclosing values (subgraphs).
pub struct Ctx<'a> {
    pub node: &'a Node,
    pub ins: &'a [Option<&'a Value>],
    pub env: &'a Env<'a>,
    pub parsed: Option<&'a Parsed>,
}

impl<'a> Ctx<'a> {
    pub fn opset(&self) -> i64 {
        self.node.opset
    }
    /// The number of inputs given (omitted trailing inputs do not count).
    pub fn n_in(&self) -> usize {
        self.ins.len()
    }
    pub fn value(&self, i: usize) -> Option<&'a Value> {
        self.ins.get(i).copied().flatten()
    }
    /// A required tensor input.
    pub fn t(&self, i: usize) -> Result<&'a Tensor> {
        match self.value(i) {
            Some(v) => v.tensor(),
            None => kbail!("input {i} is required"),
        }
    }
    /// An optional tensor input (`None` when omitted).
    pub fn opt(&self, i: usize) -> Option<&'a Tensor> {
        self.value(i).and_then(|v| v.tensor().ok())
    }
    /// Input `i` packed ahead as a GEMM's B read as `role`, when the session packed it.
    pub fn packed_b(&self, i: usize, role: crate::passes::Role) -> Option<&'a PackedB> {
        let v = self.node.inputs.get(i).copied().flatten()?;
        self.env.packed()?.b(v, role)
    }
    /// Input `i` (a Conv filter) packed ahead as a GEMM's A, when the session packed it.
    pub fn packed_a(&self, i: usize) -> Option<&'a PackedA> {
        let v = self.node.inputs.get(i).copied().flatten()?;
        self.env.packed()?.a(v)
    }
    /// Input `i` (a 3x3 filter) transformed ahead for the Winograd convolution.
    pub fn packed_winograd(
        &self,
        i: usize,
    ) -> Option<&'a ferrum_kernels::winograd::WinogradFilter> {
        let v = self.node.inputs.get(i).copied().flatten()?;
        self.env.packed()?.winograd(v)
    }
    /// Input `i` (an 8-bit constant) packed ahead as an integer product's B.
    pub fn packed_int_b(&self, i: usize) -> Option<&'a ferrum_kernels::qgemm::PackedI8> {
        let v = self.node.inputs.get(i).copied().flatten()?;
        self.env.packed()?.int_b(v)
    }
    /// Input `i` (QLinearConv's 8-bit filter) packed ahead as the B of `col(X)^T W^T`.
    pub fn packed_int_filter(&self, i: usize) -> Option<&'a ferrum_kernels::qgemm::PackedI8> {
        let v = self.node.inputs.get(i).copied().flatten()?;
        self.env.packed()?.int_filter(v)
    }
    pub fn attr(&self, name: &str) -> Option<&'a Attr> {
        self.node.attrs.get(name)
    }
    pub fn ai(&self, name: &str, default: i64) -> i64 {
        attr_int(self.node, name, default)
    }
    pub fn af(&self, name: &str, default: f32) -> f32 {
        match self.attr(name) {
            Some(Attr::Float(v)) => *v,
            Some(Attr::Int(v)) => *v as f32,
            _ => default,
        }
    }
    pub fn astr(&self, name: &str, default: &str) -> String {
        attr_str(self.node, name, default)
    }
    pub fn aints(&self, name: &str) -> Option<Vec<i64>> {
        attr_ints(self.node, name)
    }
    /// A FLOATS attribute, widened to f64.
    pub fn afloats_vec(&self, name: &str) -> Option<Vec<f64>> {
        match self.attr(name) {
            Some(Attr::Floats(v)) => Some(v.iter().map(|&x| x as f64).collect()),
            _ => None,
        }
    }
}

/// `node`'s INT attribute `name`, else `default`.
pub fn attr_int(node: &Node, name: &str, default: i64) -> i64 {
    match node.attrs.get(name) {
        Some(Attr::Int(v)) => *v,
        _ => default,
    }
}

/// `node`'s STRING attribute `name` (lossy UTF-8), else `default`.
pub fn attr_str(node: &Node, name: &str, default: &str) -> String {
    match node.attrs.get(name) {
        Some(Attr::Str(v)) => String::from_utf8_lossy(v).into_owned(),
        _ => default.to_string(),
    }
}

/// `node`'s INTS attribute `name` (an INT as one value).
pub fn attr_ints(node: &Node, name: &str) -> Option<Vec<i64>> {
    match node.attrs.get(name) {
        Some(Attr::Ints(v)) => Some(v.clone()),
        Some(Attr::Int(v)) => Some(vec![*v]),
        _ => None,
    }
}

/// An error for an attribute value or form a kernel does not implement.
pub fn unsupported(msg: impl Into<String>) -> Error {
    Error::KernelUnsupported(msg.into())
}

/// Normalizes a possibly negative axis against `rank`.
pub fn axis(a: i64, rank: usize) -> Result<usize> {
    let r = rank as i64;
    if a < -r || a >= r {
        kbail!("axis {a} is out of range for rank {rank}");
    }
    Ok(if a < 0 { (a + r) as usize } else { a as usize })
}

/// A node's kernel: reads the node's inputs and attributes through [`Ctx`] and returns its
/// outputs. Chosen once per node from its domain and op type ([`resolve`]) when a graph is
/// prepared, so a run calls it without looking the op up.
pub type Kernel = fn(&Ctx) -> Result<Vec<Value>>;

/// For the view ops (Reshape, Flatten, Squeeze, Unsqueeze and an order-keeping Transpose): the
/// output dims on these inputs (its elements are input 0's, unchanged), `None` when this run's
/// form is not such a view.
pub type ViewDims = fn(&Ctx) -> Option<Result<Vec<usize>>>;

/// A kernel that may write its output into the memory of one of its inputs (`at`, one of
/// [`Reuse::at`]): it finds that input in the slot it is given (its place in [`Ctx::ins`] is
/// empty), takes it when it writes there, and else reads it from the slot as it would from
/// `ins` ([`with_slot`]).
pub type IntoKernel = fn(&Ctx, usize, &mut Option<Tensor>) -> Result<Vec<Value>>;

/// For an op whose output can take over an input's memory (a fused convolution's residual, an
/// elementwise op's operand of the output's shape): the executor runs [`Reuse::kernel`] with one
/// of the inputs [`Reuse::at`] moved in when the node is that value's last reader and the value
/// owns its memory (the largest such), instead of [`Resolved::kernel`] writing a fresh buffer.
/// Same outputs, bit for bit: the kernel decides from the input's shape and type whether it
/// writes there.
#[derive(Clone, Copy)]
pub struct Reuse {
    pub at: &'static [usize],
    pub kernel: IntoKernel,
}

/// Runs `kernel` with the tensor in `slot` back at input `at`, for an [`IntoKernel`] that does
/// not write into it; the tensor stays in the slot.
pub(crate) fn with_slot(
    cx: &Ctx,
    at: usize,
    slot: &mut Option<Tensor>,
    kernel: Kernel,
) -> Result<Vec<Value>> {
    let Some(t) = slot.take() else {
        return kernel(cx);
    };
    let v = Value::Tensor(t);
    let mut ins = cx.ins.to_vec();
    if ins.len() <= at {
        ins.resize(at + 1, None);
    }
    ins[at] = Some(&v);
    let outs = kernel(&Ctx {
        node: cx.node,
        ins: &ins,
        env: cx.env,
        parsed: cx.parsed,
    });
    if let Value::Tensor(t) = v {
        *slot = Some(t);
    }
    outs
}

/// What static shape inference knows at a node ([`crate::infer::static_shapes`]): its
/// attributes, its inputs' dims where known, and the values of its small constant integer
/// inputs (the shape vectors that Reshape, Expand or Slice read).
pub struct Known<'a> {
    pub node: &'a Node,
    pub dims: Vec<Option<&'a [usize]>>,
    pub ints: Vec<Option<&'a [i64]>>,
}

impl<'a> Known<'a> {
    /// Input `i`'s dims, when known.
    pub fn dims(&self, i: usize) -> Option<&'a [usize]> {
        self.dims.get(i).copied().flatten()
    }
    /// Input `i`'s values, when it is a known small integer vector.
    pub fn ints(&self, i: usize) -> Option<&'a [i64]> {
        self.ints.get(i).copied().flatten()
    }
    /// Whether input `i` is given (not omitted).
    pub fn given(&self, i: usize) -> bool {
        matches!(self.node.inputs.get(i), Some(Some(_)))
    }
    pub fn n_in(&self) -> usize {
        self.node.inputs.len()
    }
    pub fn ai(&self, name: &str, default: i64) -> i64 {
        attr_int(self.node, name, default)
    }
    pub fn aints(&self, name: &str) -> Option<&'a [i64]> {
        match self.node.attrs.get(name) {
            Some(Attr::Ints(v)) => Some(v),
            _ => None,
        }
    }
}

/// A node's output 0 as static shape inference sees it: its dims and, when it is a small
/// integer vector computed from constants (a shape), its values.
pub struct Inferred {
    pub dims: Vec<usize>,
    pub ints: Option<Vec<i64>>,
}

impl Inferred {
    pub fn dims(dims: Vec<usize>) -> Inferred {
        Inferred { dims, ints: None }
    }
}

/// An op's shape rule: output 0 from what is known of the inputs, `None` when that is not
/// enough (or the node is malformed: the kernel reports it when it runs).
pub type Infer = fn(&Known) -> Option<Inferred>;

/// An op's cost rule: its floating-point operations (a multiply-add counts 2) from its inputs'
/// known dims and output 0's dims.
pub type Flops = fn(&Known, &[usize]) -> Option<f64>;

/// An op's static rules, kept beside its kernel: the shape rule, and the cost rule where the op
/// has one worth reporting.
#[derive(Clone, Copy)]
pub struct Rules {
    pub shape: Infer,
    pub flops: Option<Flops>,
}

impl Rules {
    pub const fn shape(shape: Infer) -> Rules {
        Rules { shape, flops: None }
    }
    pub const fn with(shape: Infer, flops: Flops) -> Rules {
        Rules {
            shape,
            flops: Some(flops),
        }
    }
}

/// The shape rule of the ops whose output has input 0's shape.
pub fn same_shape(k: &Known) -> Option<Inferred> {
    Some(Inferred::dims(k.dims(0)?.to_vec()))
}

/// A small integer tensor's values (at most 64: a shape vector), for shape inference.
pub fn small_ints(t: &Tensor) -> Option<Vec<i64>> {
    if t.len() <= 64 && t.dtype().is_int() {
        t.to_i64_vec().ok()
    } else {
        None
    }
}

/// The elements of a shape, as a float (for cost estimates).
pub fn numel(dims: &[usize]) -> f64 {
    dims.iter().map(|&d| d as f64).product()
}

/// The cost rule of one operation per output element.
pub fn per_output(_: &Known, out: &[usize]) -> Option<f64> {
    Some(numel(out))
}

/// The cost rule of one operation per element of input 0.
pub fn per_input(k: &Known, _: &[usize]) -> Option<f64> {
    Some(numel(k.dims(0)?))
}

/// The cost rule of a normalization (about 5 operations per element of input 0).
pub fn per_input_5(k: &Known, _: &[usize]) -> Option<f64> {
    Some(5.0 * numel(k.dims(0)?))
}

/// A node's attributes read once, when its op is resolved, for the kernels met at every layer
/// of a network (convolutions, pools, fused products): the window geometry and the fused
/// activations. A kernel finds them in [`Ctx::parsed`] (and reads its node itself where they
/// are absent: a node resolved during a run, as in constant folding).
#[derive(Clone, Debug, Default)]
pub struct Parsed {
    pub window: Option<conv::Window>,
    pub act: Option<fused::Act>,
    /// NhwcExpandDepthwise's expansion activation.
    pub expand_act: Option<fused::Act>,
}

/// The attributes of `node` worth parsing ahead ([`Parsed`]); `None` for other ops. An error
/// for values the kernel would refuse (an unknown activation or `auto_pad`, absurd sizes).
fn parse(node: &Node) -> Result<Option<Arc<Parsed>>> {
    let ferrum = node.domain == crate::passes::DOMAIN;
    let standard = node.domain.is_empty() || node.domain == "ai.onnx";
    let op = node.op.as_str();
    let window = match op {
        "Conv" | "QLinearConv" | "MaxPool" | "AveragePool" => standard,
        "FusedConv"
        | "NhwcConv"
        | "NhwcExpandDepthwise"
        | "NhwcQLinearConv"
        | "NhwcMaxPool"
        | "ConvMaxPool" => ferrum,
        _ => false,
    };
    let act = ferrum
        && matches!(
            op,
            "FusedConv"
                | "ConvMaxPool"
                | "NhwcConv"
                | "NhwcExpandDepthwise"
                | "FusedGemm"
                | "FusedMatMul"
                | "MatMulIntegerToFloat"
        );
    if !window && !act {
        return Ok(None);
    }
    Ok(Some(Arc::new(Parsed {
        window: window.then(|| conv::Window::of(node)).transpose()?,
        act: act
            .then(|| fused::Act::of(node, "activation"))
            .transpose()?,
        expand_act: (ferrum && op == "NhwcExpandDepthwise")
            .then(|| fused::Act::of(node, "expand_activation"))
            .transpose()?,
    })))
}

/// What a node runs, resolved from its domain and op type.
#[derive(Clone)]
pub struct Resolved {
    pub kernel: Kernel,
    /// Its attributes parsed once, for the ops that have them parsed ahead.
    pub parsed: Option<Arc<Parsed>>,
    /// Its static shape and cost rules, for the ops that have them.
    pub rules: Option<Rules>,
    /// Set for the view ops: the executor then moves input 0 into the output when the node is
    /// its last reader, instead of running the kernel's copy.
    pub view: Option<ViewDims>,
    /// Set for the ops that can write their output into an input's memory.
    pub reuse: Option<Reuse>,
}

impl std::fmt::Debug for Resolved {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Resolved")
            .field("view", &self.view.is_some())
            .field("reuse", &self.reuse.map(|r| r.at))
            .finish_non_exhaustive()
    }
}

/// A kernel's one tensor output.
pub(crate) fn one(t: Tensor) -> Result<Vec<Value>> {
    Ok(vec![Value::Tensor(t)])
}

/// The kernel of `node`'s op, or an [`Error::Unsupported`] naming the node, its domain, op and
/// opset when ferrum does not implement it. Forms a kernel does not run (an attribute value, a
/// data type) are reported by the kernel when it meets them.
pub fn resolve(node: &Node) -> Result<Resolved> {
    let default = node.domain.is_empty() || node.domain == "ai.onnx";
    let kernel = match node.domain.as_str() {
        "ai.onnx.preview.training" if node.op != "Gradient" => training::kernel(&node.op),
        crate::passes::DOMAIN => fused::kernel(&node.op),
        "ai.onnx.ml" => ml::kernel(&node.op),
        "ai.onnx.preview" if node.op == "FlexAttention" => {
            Some(attention::flex_attention as Kernel)
        }
        _ if default => default_domain(&node.op),
        _ => None,
    };
    match kernel {
        Some(kernel) => Ok(Resolved {
            kernel,
            parsed: parse(node).map_err(|e| crate::exec::wrap(e, node, None))?,
            rules: rules(node),
            view: if default { shape::view(&node.op) } else { None },
            reuse: match node.domain.as_str() {
                crate::passes::DOMAIN => fused::reuse(&node.op),
                _ if default => elementwise::reuse(&node.op),
                _ => None,
            },
        }),
        None => Err(Error::Unsupported(Box::new(crate::error::UnsupportedOp {
            node: node.name.clone(),
            op: node.op.clone(),
            domain: if default {
                String::new()
            } else {
                format!("{}.", node.domain)
            },
            opset: node.opset,
            dtype: None,
            detail: if default {
                "op not implemented".into()
            } else {
                format!("op not implemented in domain '{}'", node.domain)
            },
        }))),
    }
}

/// The default domain's (`ai.onnx`) kernel for `op`.
fn default_domain(op: &str) -> Option<Kernel> {
    let here: Kernel = match op {
        "Resize" | "Upsample" => |cx| one(resize::resize(cx)?),
        "GridSample" => |cx| one(grid::grid_sample(cx)?),
        "AffineGrid" => |cx| one(grid::affine_grid(cx)?),
        "Attention" => attention::attention,
        _ => {
            return elementwise::kernel(op)
                .or_else(|| shape::kernel(op))
                .or_else(|| gather::kernel(op))
                .or_else(|| conv::kernel(op))
                .or_else(|| quant::kernel(op))
                .or_else(|| reduce::kernel(op))
                .or_else(|| nn::kernel(op))
                .or_else(|| sequence_models::kernel(op))
                .or_else(|| dsp::kernel(op))
                .or_else(|| misc::kernel(op))
                .or_else(|| rnn::kernel(op))
                .or_else(|| text::kernel(op))
                .or_else(|| control::kernel(op))
        }
    };
    Some(here)
}

/// `node`'s static rules (shape and cost), from the module that holds its op's kernel; `None`
/// for ops without them. Looked up alone (no kernel, no attributes parsed) by shape inference.
pub fn rules(node: &Node) -> Option<Rules> {
    match node.domain.as_str() {
        crate::passes::DOMAIN => fused::rules(&node.op),
        "" | "ai.onnx" => default_rules(&node.op, node.opset),
        _ => None,
    }
}

/// The default domain's static rules for `op`, from the module that holds its kernel.
fn default_rules(op: &str, opset: i64) -> Option<Rules> {
    elementwise::rules(op)
        .or_else(|| shape::rules(op, opset))
        .or_else(|| gather::rules(op))
        .or_else(|| conv::rules(op))
        .or_else(|| quant::rules(op))
        .or_else(|| reduce::rules(op))
        .or_else(|| nn::rules(op))
}

/// Resolves and runs one node (constant folding at load, graphs not prepared ahead).
pub fn run(node: &Node, ins: &[Option<&Value>], env: &Env) -> Result<Vec<Value>> {
    let r = resolve(node)?;
    (r.kernel)(&Ctx {
        node,
        ins,
        env,
        parsed: r.parsed.as_deref(),
    })
}
