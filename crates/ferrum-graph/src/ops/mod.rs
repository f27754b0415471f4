//! Operator kernels and the dispatch from an ONNX op type to them.
//!
//! Each kernel reads its inputs and attributes through [`Ctx`] and returns its outputs. Kernels
//! are plain reference loops written once over generic element types ([`crate::tensor::Num`]);
//! float math runs in f64 and rounds once to the output type. Speed comes in later issues.

mod attention;
mod control;
pub(crate) mod conv;
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

use crate::exec::Env;
use crate::ir::{Attr, Node};
use crate::tensor::{Tensor, Value};
use crate::{kbail, Error, Result};
use ferrum_kernels::gemm::{PackedA, PackedB};

/// What a kernel sees: its node (attributes), its inputs and the enclosing values (subgraphs).
pub struct Ctx<'a> {
    pub node: &'a Node,
    pub ins: &'a [Option<&'a Value>],
    pub env: &'a Env<'a>,
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
        match self.attr(name) {
            Some(Attr::Int(v)) => *v,
            _ => default,
        }
    }
    pub fn af(&self, name: &str, default: f32) -> f32 {
        match self.attr(name) {
            Some(Attr::Float(v)) => *v,
            Some(Attr::Int(v)) => *v as f32,
            _ => default,
        }
    }
    pub fn astr(&self, name: &str, default: &str) -> String {
        match self.attr(name) {
            Some(Attr::Str(v)) => String::from_utf8_lossy(v).into_owned(),
            _ => default.to_string(),
        }
    }
    pub fn aints(&self, name: &str) -> Option<Vec<i64>> {
        match self.attr(name) {
            Some(Attr::Ints(v)) => Some(v.clone()),
            Some(Attr::Int(v)) => Some(vec![*v]),
            _ => None,
        }
    }
    /// A FLOATS attribute, widened to f64.
    pub fn afloats_vec(&self, name: &str) -> Option<Vec<f64>> {
        match self.attr(name) {
            Some(Attr::Floats(v)) => Some(v.iter().map(|&x| x as f64).collect()),
            _ => None,
        }
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

/// The output dims of a default-domain view op (Reshape, Flatten, Squeeze, Unsqueeze) on these
/// inputs, `None` for any other node: its output is input 0's elements, unchanged, under these
/// dims.
pub fn view_dims(node: &Node, ins: &[Option<&Value>], env: &Env) -> Option<Result<Vec<usize>>> {
    if !(node.domain.is_empty() || node.domain == "ai.onnx") {
        return None;
    }
    shape::view_dims(&Ctx { node, ins, env })
}

/// Runs one node.
pub fn run(node: &Node, ins: &[Option<&Value>], env: &Env) -> Result<Vec<Value>> {
    let cx = Ctx { node, ins, env };
    if node.domain == "ai.onnx.preview.training" && node.op != "Gradient" {
        return training::run(&cx);
    }
    if node.domain == crate::passes::DOMAIN {
        return fused::run(&cx);
    }
    if node.domain == "ai.onnx.ml" {
        return ml::run(&cx);
    }
    if node.domain == "ai.onnx.preview" && node.op == "FlexAttention" {
        return attention::flex_attention(&cx);
    }
    if !(node.domain.is_empty() || node.domain == "ai.onnx") {
        return Err(unsupported(format!(
            "domain '{}' is not implemented",
            node.domain
        )));
    }
    let one = |t: Tensor| Ok(vec![Value::Tensor(t)]);
    if let Some(r) = elementwise::run(&cx)? {
        return one(r);
    }
    if let Some(r) = shape::run(&cx)? {
        return Ok(r);
    }
    if let Some(r) = gather::run(&cx)? {
        return Ok(r);
    }
    if let Some(r) = conv::run(&cx)? {
        return Ok(r);
    }
    if let Some(r) = quant::run(&cx)? {
        return Ok(r);
    }
    if let Some(r) = reduce::run(&cx)? {
        return Ok(r);
    }
    if let Some(r) = nn::run(&cx)? {
        return Ok(r);
    }
    if node.op == "Resize" || node.op == "Upsample" {
        return one(resize::resize(&cx)?);
    }
    if node.op == "GridSample" {
        return one(grid::grid_sample(&cx)?);
    }
    if node.op == "AffineGrid" {
        return one(grid::affine_grid(&cx)?);
    }
    if node.op == "Attention" {
        return attention::attention(&cx);
    }
    if let Some(r) = sequence_models::run(&cx)? {
        return Ok(r);
    }
    if let Some(r) = dsp::run(&cx)? {
        return Ok(r);
    }
    if let Some(r) = misc::run(&cx)? {
        return Ok(r);
    }
    if let Some(r) = rnn::run(&cx)? {
        return Ok(r);
    }
    if let Some(r) = text::run(&cx)? {
        return Ok(r);
    }
    if let Some(r) = control::run(&cx)? {
        return Ok(r);
    }
    Err(unsupported("op not implemented"))
}
