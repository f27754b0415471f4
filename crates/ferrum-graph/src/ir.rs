//! ferrum's graph IR: values addressed by [`ValueId`], nodes in a `Vec` in execution order.
//!
//! An ONNX model is imported once into these types ([`crate::onnx`]); the executor and, later,
//! rewrite passes (constant folding, fusion, dead-code elimination, memory planning) work on them
//! and never on the protobuf. Subgraphs (If/Loop/Scan bodies) are [`Graph`]s held by their node's
//! attributes; they share the model's value table, so a body reads outer values by id.

use std::collections::BTreeMap;
use std::sync::Arc;

use crate::tensor::{DType, Tensor, Value};

/// Index of a value in [`Model::values`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(pub u32);

/// One dimension of a value's static shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Dim {
    Known(usize),
    /// A named symbol (`dim_param`): equal names are equal sizes across the model.
    Sym(String),
    Unknown,
}

/// What kind of value flows on an edge.
#[derive(Clone, Debug, PartialEq)]
pub enum ValueType {
    /// A tensor: element type (None when unknown) and shape (None when the rank is unknown).
    Tensor {
        dtype: Option<DType>,
        shape: Option<Vec<Dim>>,
    },
    Sequence(Box<ValueType>),
    Optional(Box<ValueType>),
    /// Maps, sparse tensors and other types ferrum does not run.
    Other(String),
    Unknown,
}

/// A named value and what is known of it statically.
#[derive(Clone, Debug)]
pub struct ValueInfo {
    pub name: String,
    pub ty: ValueType,
}

/// A node attribute, converted from ONNX's `AttributeProto`.
#[derive(Clone, Debug)]
pub enum Attr {
    Float(f32),
    Int(i64),
    Str(Vec<u8>),
    Tensor(Tensor),
    Graph(Arc<Graph>),
    Floats(Vec<f32>),
    Ints(Vec<i64>),
    Strings(Vec<Vec<u8>>),
    Tensors(Vec<Tensor>),
    Graphs(Vec<Arc<Graph>>),
    /// Type protos and sparse tensors: kept by name only.
    Other,
}

/// One operator application.
#[derive(Clone, Debug)]
pub struct Node {
    /// The node's name, or `op_type#index` when the file gives none.
    pub name: String,
    pub op: String,
    /// `""` for the default domain (`ai.onnx`).
    pub domain: String,
    /// The opset version imported for the node's domain.
    pub opset: i64,
    /// `None` for an omitted optional input.
    pub inputs: Vec<Option<ValueId>>,
    /// `None` for an omitted optional output.
    pub outputs: Vec<Option<ValueId>>,
    pub attrs: BTreeMap<String, Attr>,
    /// Outer values read by the node's subgraphs (kept alive until the node has run).
    pub implicit_inputs: Vec<ValueId>,
}

/// A graph: its nodes in a valid execution order and its interface.
#[derive(Clone, Debug, Default)]
pub struct Graph {
    pub name: String,
    pub nodes: Vec<Node>,
    /// Every declared input, including those with an initializer as default.
    pub inputs: Vec<ValueId>,
    pub outputs: Vec<ValueId>,
    /// Initializers: constants, or defaults for inputs of the same name (always tensors). Held
    /// as values so that a run reads them in place instead of copying them.
    pub initializers: Vec<(ValueId, Value)>,
    /// For each node, the values whose last reader it is (freed after it runs).
    pub frees: Vec<Vec<ValueId>>,
    /// Constant weights packed for the GEMM when the session was created.
    pub packed: crate::passes::PackedWeights,
    /// Each node's kernel, resolved once when the session was created ([`Graph::resolve`]);
    /// empty before (the executor then resolves the nodes when it runs the graph).
    pub kernels: Vec<crate::ops::Resolved>,
    /// The initializers' positions by value id, sorted (filled with [`Graph::kernels`]), so
    /// that a run finds a constant without building a map first.
    pub const_index: Vec<(ValueId, usize)>,
}

impl Graph {
    /// Inputs the caller must (or may) feed: declared inputs without an initializer.
    pub fn runtime_inputs(&self) -> Vec<ValueId> {
        self.inputs
            .iter()
            .copied()
            .filter(|v| !self.initializers.iter().any(|(i, _)| i == v))
            .collect()
    }

    /// Resolves every node's op to its kernel ([`Graph::kernels`]), in this graph and in the
    /// subgraphs its nodes hold, so that running it looks nothing up. Fails on the first node
    /// whose op ferrum does not implement, naming it (and counting the others).
    /// `values` are the model's value table: the element type an unsupported node's first input
    /// is declared with goes into the error.
    pub fn resolve(&mut self, values: &[ValueInfo]) -> crate::Result<()> {
        let mut kernels = Vec::with_capacity(self.nodes.len());
        let mut missing: Vec<crate::Error> = Vec::new();
        for node in &mut self.nodes {
            for attr in node.attrs.values_mut() {
                let graphs: &mut [Arc<Graph>] = match attr {
                    Attr::Graph(g) => std::slice::from_mut(g),
                    Attr::Graphs(gs) => gs,
                    _ => continue,
                };
                for g in graphs {
                    if let Err(e) = Arc::make_mut(g).resolve(values) {
                        missing.push(e);
                    }
                }
            }
            match crate::ops::resolve(node) {
                Ok(k) => kernels.push(k),
                Err(crate::Error::Unsupported(mut u)) => {
                    let first = node.inputs.first().copied().flatten();
                    if let Some(ValueType::Tensor {
                        dtype: Some(dt), ..
                    }) = first.and_then(|v| values.get(v.0 as usize)).map(|v| &v.ty)
                    {
                        u.dtype = Some(dt.to_string());
                    }
                    missing.push(crate::Error::Unsupported(u));
                }
                Err(e) => missing.push(e),
            }
        }
        let mut missing = missing.into_iter();
        match missing.next() {
            None => {
                self.kernels = kernels;
                self.const_index = crate::exec::const_index(&self.initializers);
                Ok(())
            }
            Some(crate::Error::Unsupported(mut first)) if missing.len() > 0 => {
                // The others by op, each once with its count.
                let mut others: BTreeMap<String, usize> = BTreeMap::new();
                for e in missing {
                    let key = match e {
                        crate::Error::Unsupported(u) => {
                            format!("{}{} (opset {})", u.domain, u.op, u.opset)
                        }
                        other => other.to_string(),
                    };
                    *others.entry(key).or_default() += 1;
                }
                let n: usize = others.values().sum();
                let list: Vec<String> = others
                    .into_iter()
                    .map(|(op, k)| if k > 1 { format!("{op} x{k}") } else { op })
                    .collect();
                first.detail = format!(
                    "{}; {n} more node(s) with ops not implemented: {}",
                    first.detail,
                    list.join(", ")
                );
                Err(crate::Error::Unsupported(first))
            }
            Some(e) => Err(e),
        }
    }

    /// Recomputes [`Graph::frees`] from the node order (call after changing nodes).
    pub fn plan_frees(&mut self) {
        let mut last: BTreeMap<ValueId, usize> = BTreeMap::new();
        for (i, n) in self.nodes.iter().enumerate() {
            for v in n.inputs.iter().flatten().chain(&n.implicit_inputs) {
                last.insert(*v, i);
            }
        }
        let mut frees = vec![Vec::new(); self.nodes.len()];
        for (v, i) in last {
            if !self.outputs.contains(&v) {
                frees[i].push(v);
            }
        }
        self.frees = frees;
    }
}

/// An imported model.
#[derive(Clone, Debug)]
pub struct Model {
    pub ir_version: i64,
    pub producer: String,
    /// Imported opsets by domain (`""` = ai.onnx).
    pub opsets: BTreeMap<String, i64>,
    /// Every value of the main graph and all subgraphs.
    pub values: Vec<ValueInfo>,
    pub graph: Graph,
}

impl Model {
    pub fn value(&self, id: ValueId) -> &ValueInfo {
        &self.values[id.0 as usize]
    }
}
