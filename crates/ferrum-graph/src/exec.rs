//! The executor: runs a [`Graph`]'s nodes in order, freeing each value after its last reader.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use crate::error::UnsupportedOp;
use crate::ir::{Graph, Node, ValueId};
use crate::ops;
use crate::passes::PackedWeights;
use crate::tensor::{Tensor, Value};
use crate::{Error, Result};

/// The values visible while a graph runs: its own (computed values and fed inputs, then its
/// initializers, read in place), then those of the enclosing graphs.
pub struct Env<'a> {
    local: HashMap<ValueId, Value>,
    /// The running graph's initializers, read in place, and their positions by id (sorted).
    inits: &'a [(ValueId, Value)],
    consts: Cow<'a, [(ValueId, usize)]>,
    /// This graph's constant weights packed for the GEMM.
    packed: Option<&'a PackedWeights>,
    parent: Option<&'a Env<'a>>,
}

impl<'a> Env<'a> {
    pub fn new(parent: Option<&'a Env<'a>>) -> Env<'a> {
        Env {
            local: spare_map(),
            inits: &[],
            consts: Cow::Borrowed(&[]),
            packed: None,
            parent,
        }
    }

    /// The packed weights of the running graph (not of enclosing ones).
    pub fn packed(&self) -> Option<&'a PackedWeights> {
        self.packed
    }

    pub fn get(&self, id: ValueId) -> Option<&Value> {
        match self.local.get(&id) {
            Some(v) => Some(v),
            None => match self
                .consts
                .binary_search_by_key(&id, |&(v, _)| v)
                .ok()
                .and_then(|i| self.inits.get(self.consts[i].1))
            {
                Some((v, value)) if *v == id => Some(value),
                _ => self.parent.and_then(|p| p.get(id)),
            },
        }
    }

    pub fn set(&mut self, id: ValueId, v: Value) {
        self.local.insert(id, v);
    }
}

impl Drop for Env<'_> {
    /// The value map (emptied) goes back to this thread's spares for the next graph run.
    fn drop(&mut self) {
        let mut map = std::mem::take(&mut self.local);
        map.clear();
        if map.capacity() > 0 {
            let _ = SPARE_MAPS.try_with(|s| {
                if let Ok(mut s) = s.try_borrow_mut() {
                    if s.len() < 8 {
                        s.push(map);
                    }
                }
            });
        }
    }
}

thread_local! {
    /// Emptied value maps of finished graph runs (one per nesting level of subgraphs): a run
    /// reuses one instead of growing a new map value by value.
    static SPARE_MAPS: std::cell::RefCell<Vec<HashMap<ValueId, Value>>> =
        const { std::cell::RefCell::new(Vec::new()) };
}

/// An empty value map: a spare one of this thread (with its capacity), else a new one.
fn spare_map() -> HashMap<ValueId, Value> {
    SPARE_MAPS
        .try_with(|s| s.try_borrow_mut().ok().and_then(|mut s| s.pop()))
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// The positions of `inits` by id, sorted for lookup (what [`Graph::resolve`] keeps in
/// [`Graph::const_index`]).
pub(crate) fn const_index(inits: &[(ValueId, Value)]) -> Vec<(ValueId, usize)> {
    let mut index: Vec<(ValueId, usize)> = inits
        .iter()
        .enumerate()
        .map(|(i, (id, _))| (*id, i))
        .collect();
    index.sort_unstable();
    index
}

static PROFILING: AtomicBool = AtomicBool::new(false);
/// Per node (keyed by its address, stable while the graph lives): what [`node_profile`] returns.
static NODES: Mutex<BTreeMap<usize, NodeTime>> = Mutex::new(BTreeMap::new());

/// One node's share of the profiled runs (see [`set_op_profiling`]).
#[derive(Clone, Debug, Default)]
pub struct NodeTime {
    /// The node's name (or `op#index` when the file gives none).
    pub name: String,
    /// Its op type, fused nodes under their fused name.
    pub op: String,
    /// Its first input's shape and its first output's shape, as last run.
    pub input: Vec<usize>,
    pub output: Vec<usize>,
    /// Times it ran, and the seconds and floating-point operations (multiply-add = 2, from the
    /// shapes it ran with; 0 for ops without an estimate) over those runs.
    pub runs: usize,
    pub seconds: f64,
    pub flops: f64,
}

/// Turns per-op-type timing on or off (off by default; on, every node run is timed) and clears
/// what was recorded.
pub fn set_op_profiling(on: bool) {
    PROFILING.store(on, Ordering::Relaxed);
    NODES.lock().unwrap().clear();
}

/// Per node: its runs, time and operations since profiling was turned on, most expensive first.
pub fn node_profile() -> Vec<NodeTime> {
    let mut v: Vec<NodeTime> = NODES.lock().unwrap().values().cloned().collect();
    v.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
    v
}

/// Records one timed run of `node`, whose inputs are still in `env` and whose outputs are `outs`.
fn record(node: &Node, env: &Env, outs: &[Value], seconds: f64) {
    let shape = |v: Option<&Value>| match v {
        Some(Value::Tensor(t)) => Some(t.shape().to_vec()),
        _ => None,
    };
    let mut shapes = crate::infer::Shapes::default();
    for id in node.inputs.iter().flatten() {
        if let Some(s) = shape(env.get(*id)) {
            shapes.shapes.insert(*id, s);
        }
    }
    for (id, v) in node.outputs.iter().zip(outs) {
        if let (Some(id), Some(s)) = (id, shape(Some(v))) {
            shapes.shapes.insert(*id, s);
        }
    }
    let flops = crate::infer::node_flops(node, &shapes).unwrap_or(0.0);
    let first = |ids: &[Option<ValueId>]| {
        shapes
            .get(ids.first().copied().flatten())
            .cloned()
            .unwrap_or_default()
    };
    let mut nodes = NODES.lock().unwrap();
    let e = nodes
        .entry(node as *const Node as usize)
        .or_insert_with(|| NodeTime {
            name: node.name.clone(),
            op: node.op.clone(),
            ..Default::default()
        });
    e.input = first(&node.inputs);
    e.output = first(&node.outputs);
    e.runs += 1;
    e.seconds += seconds;
    e.flops += flops;
}

/// Per op type: nodes run and seconds spent, most expensive first (see [`set_op_profiling`]),
/// summed from the per-node records.
pub fn op_profile() -> Vec<(String, usize, f64)> {
    let mut by_op: BTreeMap<String, (usize, f64)> = BTreeMap::new();
    for n in NODES.lock().unwrap().values() {
        let e = by_op.entry(n.op.clone()).or_default();
        e.0 += n.runs;
        e.1 += n.seconds;
    }
    let mut v: Vec<(String, usize, f64)> = by_op.into_iter().map(|(k, (n, s))| (k, n, s)).collect();
    v.sort_by(|a, b| b.2.total_cmp(&a.2));
    v
}

/// Runs `graph` with `inputs` bound to its declared inputs in order (`None`: use the initializer
/// default), inside `parent` (the enclosing graph's values, for subgraphs). Returns the outputs.
pub fn run_graph<'a>(
    graph: &'a Graph,
    inputs: Vec<Option<Value>>,
    parent: Option<&'a Env<'a>>,
) -> Result<Vec<Value>> {
    let mut env = Env::new(parent);
    env.inits = &graph.initializers;
    env.consts = if graph.const_index.len() == graph.initializers.len() {
        Cow::Borrowed(&graph.const_index)
    } else {
        Cow::Owned(const_index(&graph.initializers))
    };
    env.packed = Some(&graph.packed);
    for (id, v) in graph.inputs.iter().zip(inputs) {
        if let Some(v) = v {
            env.set(*id, v);
        }
    }
    // A prepared graph's nodes were resolved when the session was created; one made since (a
    // subgraph run while folding constants at load) is resolved here.
    let resolved: Cow<[ops::Resolved]> = if graph.kernels.len() == graph.nodes.len() {
        Cow::Borrowed(&graph.kernels)
    } else {
        Cow::Owned(
            graph
                .nodes
                .iter()
                .map(ops::resolve)
                .collect::<Result<_>>()?,
        )
    };
    for ((node, frees), op) in graph.nodes.iter().zip(&graph.frees).zip(resolved.iter()) {
        let start = PROFILING.load(Ordering::Relaxed).then(Instant::now);
        let outs = match view_in_place(node, op, frees, &mut env)? {
            Some(v) => vec![v],
            None => match handed_over(node, op, frees, &mut env) {
                Some((reuse, at, t)) => run_node(node, op, Call::Into(reuse, at, t), &env)?,
                None => run_node(node, op, Call::Plain(op.kernel), &env)?,
            },
        };
        if let Some(t) = start {
            record(node, &env, &outs, t.elapsed().as_secs_f64());
        }
        for (slot, v) in node.outputs.iter().zip(outs) {
            match slot {
                Some(id) => env.set(*id, v),
                // An output the graph does not read (an optional one left out).
                None => crate::arena::recycle(v),
            }
        }
        for v in frees {
            if let Some(v) = env.local.remove(v) {
                crate::arena::recycle(v);
            }
        }
    }
    // The outputs move out of the graph's values (a copy only for one listed twice or read from
    // an initializer or an enclosing graph).
    let mut outs = Vec::with_capacity(graph.outputs.len());
    for (i, id) in graph.outputs.iter().enumerate() {
        let again = graph.outputs[i + 1..].contains(id);
        let v = match env.local.remove(id) {
            Some(v) if again => {
                let copy = v.clone();
                env.local.insert(*id, v);
                copy
            }
            Some(v) => v,
            None => env
                .get(*id)
                .cloned()
                .ok_or_else(|| Error::Format(format!("graph output #{} was not computed", id.0)))?,
        };
        outs.push(v);
    }
    Ok(outs)
}

/// A view op (Reshape, Flatten, Squeeze, Unsqueeze) whose input this node is the last to read:
/// the value is moved out and given its new shape, instead of copied as the op would. `None`
/// when the node is not such a view (it then runs as usual).
fn view_in_place(
    node: &Node,
    op: &ops::Resolved,
    frees: &[ValueId],
    env: &mut Env,
) -> Result<Option<Value>> {
    let (Some(view), Some(Some(x))) = (op.view, node.inputs.first().copied()) else {
        return Ok(None);
    };
    if !frees.contains(&x)
        || node.inputs[1..].contains(&Some(x))
        || !matches!(env.local.get(&x), Some(Value::Tensor(_)))
    {
        return Ok(None);
    }
    let dims = {
        let mut ins = Vec::with_capacity(node.inputs.len());
        for i in &node.inputs {
            ins.push(match i {
                None => None,
                Some(id) => match env.get(*id) {
                    Some(v) => Some(v),
                    None => return Ok(None),
                },
            });
        }
        // Under catch_unwind as `run_node`'s kernels are; errors (and a panic) come from the op
        // itself, run as usual, with the node attached.
        let dims = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            view(&ops::Ctx {
                node,
                ins: &ins,
                env,
                parsed: op.parsed.as_deref(),
            })
        }));
        match dims {
            Ok(Some(Ok(d))) => d,
            _ => return Ok(None),
        }
    };
    let Some(Value::Tensor(t)) = env.local.remove(&x) else {
        unreachable!("checked above")
    };
    Ok(Some(Value::Tensor(t.reshape(dims).map_err(|e| {
        Error::Node {
            node: node.name.clone(),
            op: node.op.clone(),
            msg: e.to_string(),
        }
    })?)))
}

/// For an op that can write its output into an input's memory ([`ops::Reuse`]): that input's
/// tensor, moved out of the values, when this node is its last reader, reads it through no
/// other input, and the tensor owns its memory. `None` otherwise (the node runs as usual).
fn handed_over(
    node: &Node,
    op: &ops::Resolved,
    frees: &[ValueId],
    env: &mut Env,
) -> Option<(ops::Reuse, usize, Tensor)> {
    let reuse = op.reuse?;
    // Of the inputs that may be handed over, the largest (a broadcast operand cannot hold the
    // output).
    let (at, x, _) = reuse
        .at
        .iter()
        .filter_map(|&at| {
            let x = node.inputs.get(at).copied().flatten()?;
            let once = node.inputs.iter().filter(|i| **i == Some(x)).count() == 1;
            match env.local.get(&x) {
                Some(Value::Tensor(t)) if once && !t.data().is_shared() && frees.contains(&x) => {
                    Some((at, x, t.len()))
                }
                _ => None,
            }
        })
        .max_by_key(|&(at, _, len)| (len, std::cmp::Reverse(at)))?;
    match env.local.remove(&x) {
        Some(Value::Tensor(t)) => Some((reuse, at, t)),
        _ => unreachable!("checked above"),
    }
}

/// How a node's kernel is called: on its inputs, or with one of them handed over by value.
enum Call {
    Plain(ops::Kernel),
    Into(ops::Reuse, usize, Tensor),
}

/// Runs one node on the given inputs, outside any graph (constant folding at load time). A
/// kernel panic becomes an error.
pub(crate) fn eval_node(node: &Node, ins: &[Option<&Value>]) -> Result<Vec<Value>> {
    let env = Env::new(None);
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| ops::run(node, ins, &env)))
        .unwrap_or_else(|_| Err(Error::Kernel("internal error: the kernel panicked".into())))
}

fn run_node(node: &Node, op: &ops::Resolved, call: Call, env: &Env) -> Result<Vec<Value>> {
    let handed = match &call {
        Call::Into(_, at, _) => Some(*at),
        Call::Plain(_) => None,
    };
    let mut ins = Vec::with_capacity(node.inputs.len());
    for (at, i) in node.inputs.iter().enumerate() {
        match i {
            None => ins.push(None),
            // Given to the kernel by value instead.
            Some(_) if handed == Some(at) => ins.push(None),
            Some(id) => ins.push(Some(env.get(*id).ok_or_else(|| Error::Node {
                node: node.name.clone(),
                op: node.op.clone(),
                msg: format!("input #{} has no value", id.0),
            })?)),
        }
    }
    // The first input's element type, for error messages (made only for one).
    let dtype = || {
        ins.iter()
            .flatten()
            .find_map(|v| v.tensor().ok().map(|t| t.dtype().to_string()))
    };
    // A kernel bug must not take the process down: a panic becomes this node's error.
    let cx = ops::Ctx {
        node,
        ins: &ins,
        env,
        parsed: op.parsed.as_deref(),
    };
    let mut slot = None;
    let outs = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match call {
        Call::Plain(kernel) => kernel(&cx),
        Call::Into(r, at, t) => {
            slot = Some(t);
            let outs = (r.kernel)(&cx, at, &mut slot);
            match slot.take() {
                // Not written in: its memory goes back to the pool, as when a value is freed.
                Some(t) => crate::arena::recycle(Value::Tensor(t)),
                None => crate::arena::note_in_place(),
            }
            outs
        }
    }))
    .unwrap_or_else(|_| Err(Error::Kernel("internal error: the kernel panicked".into())))
    .map_err(|e| wrap(e, node, dtype()))?;
    if outs.len()
        < node
            .outputs
            .iter()
            .rposition(|o| o.is_some())
            .map_or(0, |p| p + 1)
    {
        return Err(Error::Unsupported(Box::new(UnsupportedOp {
            node: node.name.clone(),
            op: node.op.clone(),
            domain: node.domain.clone(),
            opset: node.opset,
            dtype: dtype(),
            detail: format!(
                "produces {} outputs, {} requested",
                outs.len(),
                node.outputs.len()
            ),
        })));
    }
    Ok(outs)
}

/// Attaches the node (and the input dtype) to a kernel's error.
pub(crate) fn wrap(e: Error, node: &Node, dtype: Option<String>) -> Error {
    let unsupported = |detail: String, dtype: Option<String>| {
        Error::Unsupported(Box::new(UnsupportedOp {
            node: node.name.clone(),
            op: node.op.clone(),
            domain: if node.domain.is_empty() {
                String::new()
            } else {
                format!("{}.", node.domain)
            },
            opset: node.opset,
            dtype,
            detail,
        }))
    };
    match e {
        Error::Kernel(msg) => Error::Node {
            node: node.name.clone(),
            op: node.op.clone(),
            msg,
        },
        Error::KernelUnsupported(msg) => unsupported(msg, dtype),
        Error::UnsupportedType(t) => unsupported(format!("type {t} not implemented"), Some(t)),
        other => other,
    }
}
