//! ONNX import: protobuf messages ([`crate::proto`]) to the IR ([`crate::ir`]), plus tensor
//! encoding and decoding for test data and outputs.
//!
//! Hostile input is expected: every element count is checked against the bytes that carry it
//! before anything is allocated, names must resolve, graphs must be acyclic, and external data
//! must stay inside the model's folder.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::ir::{Attr, Dim, Graph, Model, Node, ValueId, ValueInfo, ValueType};
use crate::proto::{self, type_proto, AttributeProto, GraphProto, ModelProto, TensorProto};
use crate::tensor::{numel, DType, Data, Tensor, Value};
use crate::{Error, Result};

use crate::codec::dims_of;
pub use crate::codec::{tensor_from_proto, tensor_to_proto, value_from_bytes, value_to_bytes};

/// The largest tensor ferrum will build from a file (elements), a guard against absurd dims.
pub const MAX_ELEMENTS: usize = 1 << 34;

fn bad(msg: impl Into<String>) -> Error {
    Error::Format(msg.into())
}

/// Decodes a model from bytes. `dir` is the model's folder, for external data (None: refuse it).
pub fn load_model_bytes(bytes: &[u8], dir: Option<&Path>) -> Result<Model> {
    let mp: ModelProto = proto::decode(bytes, "model")?;
    import_model(&mp, dir)
}

/// Reads and imports an `.onnx` file.
pub fn load_model(path: &Path) -> Result<Model> {
    let dir = path.parent().map(|p| {
        if p.as_os_str().is_empty() {
            PathBuf::from(".")
        } else {
            p.to_path_buf()
        }
    });
    // The file is mapped, not read: its pages come straight from the page cache, where a read
    // copies every byte into fresh memory first (BERT-base's 440 MB: decoding and importing
    // 470-580 -> 240-260 ms, the session 510-630 -> 445-470 ms) and holds no copy of the file
    // in its heap beside the converted weights. Decoded from that shared map, the initializers'
    // raw data are views of it until import converts them; the map is released with the
    // decoded message.
    if path.is_dir() {
        return Err(Error::Io {
            path: path.to_path_buf(),
            err: std::io::Error::other("a directory, not an .onnx file"),
        });
    }
    let map = ferrum_core::Bytes::map_file(path).map_err(|e| match e {
        ferrum_core::Error::Io { path, err } => Error::Io { path, err },
        other => Error::Format(other.to_string()),
    })?;
    // Every byte is read by the decoder and the conversions: mapped in one call.
    map.populate();
    let mp: ModelProto = proto::decode_shared(bytes::Bytes::from_owner(Mapped(map)), "model")?;
    import_model(&mp, dir.as_deref())
}

/// A file map as the owner of a [`bytes::Bytes`].
struct Mapped(ferrum_core::Bytes);

impl AsRef<[u8]> for Mapped {
    fn as_ref(&self) -> &[u8] {
        &self.0
    }
}

/// Imports a decoded model.
pub fn import_model(mp: &ModelProto, dir: Option<&Path>) -> Result<Model> {
    let mut opsets = BTreeMap::new();
    for o in &mp.opset_import {
        let d = if o.domain == "ai.onnx" {
            String::new()
        } else {
            o.domain.clone()
        };
        opsets.insert(d, o.version);
    }
    if mp.opset_import.is_empty() {
        // IR < 3 files have no opset imports; they mean opset 1.
        opsets.insert(String::new(), 1);
    }
    let gp = mp
        .graph
        .as_ref()
        .ok_or_else(|| bad("the model has no graph"))?;
    let mut imp = Importer {
        values: Vec::new(),
        opsets: opsets.clone(),
        dir: dir.map(Path::to_path_buf),
        functions: &mp.functions,
        node_counter: 0,
    };
    let mut scopes = Vec::new();
    let (graph, free) = imp.graph(gp, &mut scopes)?;
    if let Some(v) = free.first() {
        return Err(bad(format!(
            "value '{}' is used but never defined",
            imp.values[v.0 as usize].name
        )));
    }
    Ok(Model {
        ir_version: mp.ir_version,
        producer: format!("{} {}", mp.producer_name, mp.producer_version)
            .trim()
            .to_string(),
        opsets,
        values: imp.values,
        graph,
    })
}

struct Importer<'a> {
    values: Vec<ValueInfo>,
    opsets: BTreeMap<String, i64>,
    dir: Option<PathBuf>,
    functions: &'a [proto::FunctionProto],
    node_counter: usize,
}

type Scope = HashMap<String, ValueId>;

impl Importer<'_> {
    fn new_value(&mut self, name: &str, ty: ValueType) -> Result<ValueId> {
        if self.values.len() >= u32::MAX as usize {
            return Err(bad("too many values"));
        }
        self.values.push(ValueInfo {
            name: name.to_string(),
            ty,
        });
        Ok(ValueId(self.values.len() as u32 - 1))
    }

    fn define(&mut self, scope: &mut Scope, name: &str, ty: ValueType) -> Result<ValueId> {
        if name.is_empty() {
            return Err(bad("a value has an empty name"));
        }
        if scope.contains_key(name) {
            return Err(bad(format!("value '{name}' is defined twice")));
        }
        let id = self.new_value(name, ty)?;
        scope.insert(name.to_string(), id);
        Ok(id)
    }

    /// Imports `gp` with `outer` as the enclosing scopes (innermost last). Returns the graph and
    /// the outer values it reads (its free variables).
    fn graph(&mut self, gp: &GraphProto, outer: &mut Vec<Scope>) -> Result<(Graph, Vec<ValueId>)> {
        let nodes_p = crate::gradient::expand(&self.expand_functions(&gp.node, 0)?);
        let mut local = Scope::new();
        let mut g = Graph {
            name: gp.name.clone(),
            ..Default::default()
        };
        let mut inits: HashMap<&str, &TensorProto> = HashMap::new();
        for t in &gp.initializer {
            if inits.insert(t.name.as_str(), t).is_some() {
                return Err(bad(format!("initializer '{}' is defined twice", t.name)));
            }
        }
        for vi in &gp.input {
            let ty = value_type(vi.r#type.as_ref());
            let id = self.define(&mut local, &vi.name, ty)?;
            g.inputs.push(id);
        }
        for t in &gp.initializer {
            let id = match local.get(&t.name) {
                Some(&id) => id,
                None => {
                    let ty = ValueType::Tensor {
                        dtype: DType::from_onnx(t.data_type),
                        shape: Some(
                            t.dims
                                .iter()
                                .map(|&d| Dim::Known(d.max(0) as usize))
                                .collect(),
                        ),
                    };
                    self.define(&mut local, &t.name, ty)?
                }
            };
            let tensor = tensor_from_proto(t, self.dir.as_deref())
                .map_err(|e| bad(format!("initializer '{}': {e}", t.name)))?;
            g.initializers.push((id, Value::Tensor(tensor)));
        }
        for st in &gp.sparse_initializer {
            let (name, t) = sparse_to_dense(st)?;
            let id = self.define(&mut local, &name, ValueType::Unknown)?;
            g.initializers.push((id, Value::Tensor(t)));
        }
        let mut vinfo: HashMap<&str, ValueType> = HashMap::new();
        for vi in gp.value_info.iter().chain(&gp.output) {
            vinfo.insert(&vi.name, value_type(vi.r#type.as_ref()));
        }
        // Define every node output first: nodes may be listed out of order.
        let mut node_outs: Vec<Vec<Option<ValueId>>> = Vec::with_capacity(nodes_p.len());
        for n in &nodes_p {
            let mut outs = Vec::with_capacity(n.output.len());
            for o in &n.output {
                if o.is_empty() {
                    outs.push(None);
                } else {
                    let ty = vinfo.get(o.as_str()).cloned().unwrap_or(ValueType::Unknown);
                    outs.push(Some(self.define(&mut local, o, ty)?));
                }
            }
            node_outs.push(outs);
        }
        outer.push(local);
        let depth = outer.len() - 1;
        let mut free: Vec<ValueId> = Vec::new();
        let lookup = |name: &str, outer: &Vec<Scope>, free: &mut Vec<ValueId>| -> Option<ValueId> {
            for (lvl, s) in outer.iter().enumerate().rev() {
                if let Some(&id) = s.get(name) {
                    if lvl != depth && !free.contains(&id) {
                        free.push(id);
                    }
                    return Some(id);
                }
            }
            None
        };
        let result = (|| -> Result<()> {
            for (k, (n, outs)) in nodes_p.iter().zip(node_outs).enumerate() {
                let domain = if n.domain == "ai.onnx" {
                    String::new()
                } else {
                    n.domain.clone()
                };
                let name = if n.name.is_empty() {
                    self.node_counter += 1;
                    format!("{}#{}", n.op_type, k)
                } else {
                    n.name.clone()
                };
                let opset = self.opsets.get(&domain).copied().unwrap_or(0);
                let mut inputs = Vec::with_capacity(n.input.len());
                for i in &n.input {
                    if i.is_empty() {
                        inputs.push(None);
                    } else {
                        let id = lookup(i, outer, &mut free).ok_or_else(|| {
                            bad(format!(
                                "node '{name}' ({}) reads '{i}', which is never defined",
                                n.op_type
                            ))
                        })?;
                        inputs.push(Some(id));
                    }
                }
                let mut attrs = BTreeMap::new();
                let mut implicit: Vec<ValueId> = Vec::new();
                for a in &n.attribute {
                    let v = self
                        .attr(a, outer, &mut implicit)
                        .map_err(|e| bad(format!("node '{name}' attribute '{}': {e}", a.name)))?;
                    attrs.insert(a.name.clone(), v);
                }
                // Implicit inputs that are not ours are free variables of this graph too.
                for v in &implicit {
                    if !outer[depth].values().any(|x| x == v) && !free.contains(v) {
                        free.push(*v);
                    }
                }
                g.nodes.push(Node {
                    name,
                    op: n.op_type.clone(),
                    domain,
                    opset,
                    inputs,
                    outputs: outs,
                    attrs,
                    implicit_inputs: implicit,
                });
            }
            for vi in &gp.output {
                let id = lookup(&vi.name, outer, &mut free)
                    .ok_or_else(|| bad(format!("graph output '{}' is never defined", vi.name)))?;
                g.outputs.push(id);
            }
            Ok(())
        })();
        outer.pop();
        result?;
        toposort(&mut g)?;
        g.plan_frees();
        Ok((g, free))
    }

    fn attr(
        &mut self,
        a: &AttributeProto,
        outer: &mut Vec<Scope>,
        implicit: &mut Vec<ValueId>,
    ) -> Result<Attr> {
        let mut sub = |imp: &mut Self, gp: &GraphProto| -> Result<Arc<Graph>> {
            let (g, free) = imp.graph(gp, outer)?;
            for v in free {
                if !implicit.contains(&v) {
                    implicit.push(v);
                }
            }
            Ok(Arc::new(g))
        };
        let ty = if a.r#type != 0 {
            a.r#type
        } else {
            // IR 1 files carry no type: infer it from the populated field.
            if a.g.is_some() {
                5
            } else if a.t.is_some() {
                4
            } else if !a.floats.is_empty() {
                6
            } else if !a.ints.is_empty() {
                7
            } else if !a.strings.is_empty() {
                8
            } else if !a.s.is_empty() {
                3
            } else if a.f != 0.0 {
                1
            } else {
                2
            }
        };
        Ok(match ty {
            1 => Attr::Float(a.f),
            2 => Attr::Int(a.i),
            3 => Attr::Str(a.s.clone()),
            4 => Attr::Tensor(tensor_from_proto(
                a.t.as_ref()
                    .ok_or_else(|| bad("tensor attribute without a tensor"))?,
                self.dir.as_deref(),
            )?),
            5 => Attr::Graph(sub(
                self,
                a.g.as_deref()
                    .ok_or_else(|| bad("graph attribute without a graph"))?,
            )?),
            6 => Attr::Floats(a.floats.clone()),
            7 => Attr::Ints(a.ints.clone()),
            8 => Attr::Strings(a.strings.clone()),
            9 => Attr::Tensors(
                a.tensors
                    .iter()
                    .map(|t| tensor_from_proto(t, self.dir.as_deref()))
                    .collect::<Result<_>>()?,
            ),
            10 => {
                let mut gs = Vec::new();
                for gp in &a.graphs {
                    gs.push(sub(self, gp)?);
                }
                Attr::Graphs(gs)
            }
            11 => match &a.sparse_tensor {
                Some(st) => Attr::Tensor(sparse_to_dense(st)?.1),
                None => Attr::Other,
            },
            _ => Attr::Other,
        })
    }

    /// Replaces calls of model-local functions by their bodies (recursively, depth-limited).
    fn expand_functions(
        &mut self,
        nodes: &[proto::NodeProto],
        depth: usize,
    ) -> Result<Vec<proto::NodeProto>> {
        if self.functions.is_empty() {
            return Ok(nodes.to_vec());
        }
        if depth > 32 {
            return Err(bad("model-local functions nest too deeply (recursion?)"));
        }
        let mut out = Vec::new();
        for n in nodes {
            let f = self
                .functions
                .iter()
                .find(|f| f.name == n.op_type && f.domain == n.domain && f.overload == n.overload);
            let Some(f) = f else {
                out.push(n.clone());
                continue;
            };
            for o in &f.opset_import {
                let d = if o.domain == "ai.onnx" {
                    String::new()
                } else {
                    o.domain.clone()
                };
                self.opsets.entry(d).or_insert(o.version);
            }
            self.node_counter += 1;
            let tag = format!("__{}_{}", f.name, self.node_counter);
            let mut rename: HashMap<String, String> = HashMap::new();
            for (i, formal) in f.input.iter().enumerate() {
                rename.insert(formal.clone(), n.input.get(i).cloned().unwrap_or_default());
            }
            for (i, formal) in f.output.iter().enumerate() {
                let actual = n.output.get(i).cloned().unwrap_or_default();
                let actual = if actual.is_empty() {
                    format!("{formal}{tag}")
                } else {
                    actual
                };
                rename.insert(formal.clone(), actual);
            }
            let mut attrs: HashMap<&str, &AttributeProto> = HashMap::new();
            for a in &f.attribute_proto {
                attrs.insert(&a.name, a);
            }
            for a in &n.attribute {
                attrs.insert(&a.name, a);
            }
            let mut body = Vec::new();
            for b in &f.node {
                let mut b = b.clone();
                let map = |s: &String, rename: &mut HashMap<String, String>| -> String {
                    if s.is_empty() {
                        return String::new();
                    }
                    rename
                        .entry(s.clone())
                        .or_insert_with(|| format!("{s}{tag}"))
                        .clone()
                };
                b.input = b.input.iter().map(|s| map(s, &mut rename)).collect();
                b.output = b.output.iter().map(|s| map(s, &mut rename)).collect();
                b.name = format!("{}{tag}", b.name);
                let mut new_attrs = Vec::new();
                for a in b.attribute {
                    if a.ref_attr_name.is_empty() {
                        new_attrs.push(a);
                    } else if let Some(src) = attrs.get(a.ref_attr_name.as_str()) {
                        let mut c = (*src).clone();
                        c.name = a.name.clone();
                        new_attrs.push(c);
                    }
                }
                b.attribute = new_attrs;
                body.push(b);
            }
            out.extend(self.expand_functions(&body, depth + 1)?);
        }
        Ok(out)
    }
}

/// Orders nodes so each runs after the producers of its inputs; an error on a cycle.
fn toposort(g: &mut Graph) -> Result<()> {
    let n = g.nodes.len();
    let mut producer: HashMap<ValueId, usize> = HashMap::new();
    for (i, node) in g.nodes.iter().enumerate() {
        for o in node.outputs.iter().flatten() {
            producer.insert(*o, i);
        }
    }
    let mut indeg = vec![0usize; n];
    let mut users: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, node) in g.nodes.iter().enumerate() {
        for v in node.inputs.iter().flatten().chain(&node.implicit_inputs) {
            if let Some(&p) = producer.get(v) {
                indeg[i] += 1;
                users[p].push(i);
            }
        }
    }
    // Kahn's algorithm, always taking the lowest ready index: keeps the file's order when valid.
    let mut ready: std::collections::BTreeSet<usize> = (0..n).filter(|&i| indeg[i] == 0).collect();
    let mut order = Vec::with_capacity(n);
    while let Some(i) = ready.pop_first() {
        order.push(i);
        for &u in &users[i] {
            indeg[u] -= 1;
            if indeg[u] == 0 {
                ready.insert(u);
            }
        }
    }
    if order.len() != n {
        let stuck = (0..n).find(|&i| indeg[i] > 0).unwrap_or(0);
        let node = &g.nodes[stuck];
        return Err(bad(format!(
            "the graph has a cycle through node '{}' ({})",
            node.name, node.op
        )));
    }
    if order.iter().enumerate().any(|(k, &i)| k != i) {
        let mut old: Vec<Option<Node>> =
            std::mem::take(&mut g.nodes).into_iter().map(Some).collect();
        g.nodes = order
            .iter()
            .map(|&i| old[i].take().expect("each index once"))
            .collect();
    }
    Ok(())
}

fn value_type(tp: Option<&proto::TypeProto>) -> ValueType {
    let Some(tp) = tp else {
        return ValueType::Unknown;
    };
    match &tp.value {
        Some(type_proto::Value::TensorType(t)) => ValueType::Tensor {
            dtype: DType::from_onnx(t.elem_type),
            shape: t.shape.as_ref().map(|s| {
                s.dim
                    .iter()
                    .map(|d| match &d.value {
                        Some(proto::tensor_shape_proto::dimension::Value::DimValue(v))
                            if *v >= 0 =>
                        {
                            Dim::Known(*v as usize)
                        }
                        Some(proto::tensor_shape_proto::dimension::Value::DimParam(p)) => {
                            Dim::Sym(p.clone())
                        }
                        _ => Dim::Unknown,
                    })
                    .collect()
            }),
        },
        Some(type_proto::Value::SequenceType(s)) => {
            ValueType::Sequence(Box::new(value_type(s.elem_type.as_deref())))
        }
        Some(type_proto::Value::OptionalType(s)) => {
            ValueType::Optional(Box::new(value_type(s.elem_type.as_deref())))
        }
        Some(type_proto::Value::MapType(_)) => ValueType::Other("map".into()),
        Some(type_proto::Value::SparseTensorType(_)) => ValueType::Other("sparse tensor".into()),
        None => ValueType::Unknown,
    }
}

fn sparse_to_dense(st: &proto::SparseTensorProto) -> Result<(String, Tensor)> {
    let values = st
        .values
        .as_ref()
        .ok_or_else(|| bad("sparse tensor without values"))?;
    let indices = st
        .indices
        .as_ref()
        .ok_or_else(|| bad("sparse tensor without indices"))?;
    let vals = tensor_from_proto(values, None)?;
    let idx = tensor_from_proto(indices, None)?.to_i64_vec()?;
    let shape = dims_of(&st.dims)?;
    let n = numel(&shape)
        .filter(|&n| n <= MAX_ELEMENTS)
        .ok_or_else(|| bad("sparse tensor too large"))?;
    let nnz = vals.len();
    let rank = shape.len();
    let mut lin = Vec::with_capacity(nnz);
    if idx.len() == nnz {
        lin = idx.iter().map(|&i| i as usize).collect();
    } else if idx.len() == nnz * rank {
        for k in 0..nnz {
            let mut l = 0usize;
            for d in 0..rank {
                l = l * shape[d] + idx[k * rank + d] as usize;
            }
            lin.push(l);
        }
    } else {
        return Err(bad("sparse tensor indices do not match its values"));
    }
    if lin.iter().any(|&l| l >= n) {
        return Err(bad("sparse tensor index out of range"));
    }
    fn scatter<T: crate::tensor::Elem>(vals: &Tensor, lin: &[usize], n: usize) -> Result<Data> {
        let v = vals.as_slice::<T>()?;
        let mut out = vec![T::default(); n];
        for (k, &l) in lin.iter().enumerate() {
            out[l] = v[k].clone();
        }
        Ok(T::into_data(out))
    }
    let data = crate::dispatch!(vals.dtype(), all, scatter, &vals, &lin, n)?;
    Ok((values.name.clone(), Tensor::new(shape, data)?))
}
