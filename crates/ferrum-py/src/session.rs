//! `InferenceSession` and its companions, in the shape of onnxruntime's Python API.

use std::collections::HashMap;

use ferrum_graph::ir::{Dim, ValueType};
use ferrum_graph::{OptLevel, Session, Value};
use prost::Message;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};

use crate::convert::{from_value, ort_type_name, to_value};
use crate::errors::{graph_err, no_panic, FerrumError, InvalidArgument};

/// The one execution provider ferrum has.
pub const CPU_PROVIDER: &str = "CPUExecutionProvider";

/// onnxruntime's graph optimization levels. ferrum accepts every level; it runs the graph as
/// imported (its kernels fuse what they fuse at every level).
#[pyclass(module = "ferrum", eq, eq_int)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum GraphOptimizationLevel {
    ORT_DISABLE_ALL = 0,
    ORT_ENABLE_BASIC = 1,
    ORT_ENABLE_EXTENDED = 2,
    ORT_ENABLE_LAYOUT = 3,
    ORT_ENABLE_ALL = 99,
}

/// onnxruntime's execution modes (ferrum runs the nodes one after another in both).
#[pyclass(module = "ferrum", eq, eq_int)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[allow(non_camel_case_types)]
pub enum ExecutionMode {
    ORT_SEQUENTIAL = 0,
    ORT_PARALLEL = 1,
}

/// Options of an `InferenceSession`, as onnxruntime's `SessionOptions`.
///
/// `intra_op_num_threads`: threads the kernels use (0: every core). ferrum's kernel thread pool
/// is one per process, so the last session created with a non-zero value sets it for all.
#[pyclass(module = "ferrum")]
#[derive(Clone, Debug)]
pub struct SessionOptions {
    /// Threads the kernels use inside one node (0: every core).
    #[pyo3(get, set)]
    pub intra_op_num_threads: usize,
    /// Threads that run independent nodes at once (accepted; ferrum runs nodes in order).
    #[pyo3(get, set)]
    pub inter_op_num_threads: usize,
    /// Graph optimization level: `ORT_DISABLE_ALL` runs the graph as imported, `ORT_ENABLE_BASIC`
    /// folds constants and BatchNormalization, `ORT_ENABLE_EXTENDED` and above also fuse
    /// activations, biases, residual adds and GELU into the products (`ferrum run --opt-level`).
    #[pyo3(get, set)]
    pub graph_optimization_level: GraphOptimizationLevel,
    /// Sequential or parallel node execution (accepted; ferrum is sequential).
    #[pyo3(get, set)]
    pub execution_mode: ExecutionMode,
    /// Log severity (0 verbose .. 4 fatal; accepted, ferrum logs through FERRUM_LOG).
    #[pyo3(get, set)]
    pub log_severity_level: i32,
    /// Verbosity of verbose logs (accepted).
    #[pyo3(get, set)]
    pub log_verbosity_level: i32,
    /// A name for this session's logs (accepted).
    #[pyo3(get, set)]
    pub logid: String,
    /// Per-node profiling (accepted; use `ferrum run --repeat N --profile` for op timings).
    #[pyo3(get, set)]
    pub enable_profiling: bool,
}

#[pymethods]
impl SessionOptions {
    /// Default options: every core, all optimizations.
    #[new]
    fn new() -> Self {
        SessionOptions {
            intra_op_num_threads: 0,
            inter_op_num_threads: 0,
            graph_optimization_level: GraphOptimizationLevel::ORT_ENABLE_ALL,
            execution_mode: ExecutionMode::ORT_SEQUENTIAL,
            log_severity_level: 2,
            log_verbosity_level: 0,
            logid: String::new(),
            enable_profiling: false,
        }
    }

    fn __repr__(&self) -> String {
        format!(
            "SessionOptions(intra_op_num_threads={}, graph_optimization_level={:?})",
            self.intra_op_num_threads, self.graph_optimization_level
        )
    }
}

/// Options of one `run` call (accepted for compatibility; ferrum has none to set).
#[pyclass(module = "ferrum")]
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    /// A tag for this run's logs (accepted).
    #[pyo3(get, set)]
    pub logid: String,
    /// Log severity for this run (accepted).
    #[pyo3(get, set)]
    pub log_severity_level: i32,
}

#[pymethods]
impl RunOptions {
    /// Default run options.
    #[new]
    fn new() -> Self {
        RunOptions::default()
    }
}

#[derive(Clone, Debug)]
enum DimOut {
    Known(usize),
    Sym(String),
    Unknown,
}

/// An input or output of a model: `name`, `shape` (ints, symbolic dims as strings, `None` for
/// unnamed unknown dims) and `type` (`tensor(float)`, `seq(tensor(int64))`, ...).
#[pyclass(module = "ferrum", frozen)]
#[derive(Clone, Debug)]
pub struct NodeArg {
    /// The value's name in the graph.
    #[pyo3(get)]
    pub name: String,
    /// onnxruntime's type string, e.g. `tensor(float)`.
    #[pyo3(get, name = "type")]
    pub ty: String,
    dims: Vec<DimOut>,
}

#[pymethods]
impl NodeArg {
    /// The static shape: an int per known dim, the symbol's name for a symbolic dim, `None` for
    /// an unknown one (an empty list when even the rank is unknown).
    #[getter]
    fn shape<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let items: Vec<Py<PyAny>> = self
            .dims
            .iter()
            .map(|d| -> PyResult<Py<PyAny>> {
                Ok(match d {
                    DimOut::Known(k) => k.into_pyobject(py)?.into_any().unbind(),
                    DimOut::Sym(s) => PyString::new(py, s).into_any().unbind(),
                    DimOut::Unknown => py.None(),
                })
            })
            .collect::<PyResult<_>>()?;
        PyList::new(py, items)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!(
            "NodeArg(name='{}', type='{}', shape={})",
            self.name,
            self.ty,
            self.shape(py)?.repr()?
        ))
    }
}

fn node_arg(name: &str, ty: &ValueType) -> NodeArg {
    let shape_of = |t: &ValueType| match t {
        ValueType::Tensor {
            shape: Some(dims), ..
        } => dims
            .iter()
            .map(|d| match d {
                Dim::Known(k) => DimOut::Known(*k),
                Dim::Sym(s) => DimOut::Sym(s.clone()),
                Dim::Unknown => DimOut::Unknown,
            })
            .collect(),
        _ => Vec::new(),
    };
    NodeArg {
        name: name.to_string(),
        ty: ort_type_name(ty),
        dims: shape_of(ty),
    }
}

/// A model's metadata, as onnxruntime's `ModelMetadata`.
#[pyclass(module = "ferrum", frozen)]
#[derive(Clone, Debug, Default)]
pub struct ModelMetadata {
    /// `producer_name` of the model file.
    #[pyo3(get)]
    pub producer_name: String,
    /// The main graph's name.
    #[pyo3(get)]
    pub graph_name: String,
    /// The model's domain.
    #[pyo3(get)]
    pub domain: String,
    /// The model's `doc_string`.
    #[pyo3(get)]
    pub description: String,
    /// The main graph's `doc_string`.
    #[pyo3(get)]
    pub graph_description: String,
    /// `model_version`.
    #[pyo3(get)]
    pub version: i64,
    /// `metadata_props` as a dict.
    #[pyo3(get)]
    pub custom_metadata_map: HashMap<String, String>,
}

#[pymethods]
impl ModelMetadata {
    fn __repr__(&self) -> String {
        format!(
            "ModelMetadata(producer_name='{}', graph_name='{}', domain='{}', version={})",
            self.producer_name, self.graph_name, self.domain, self.version
        )
    }
}

/// The fields of `ModelProto` the metadata needs (prost skips the others, weights included).
#[derive(Clone, PartialEq, Message)]
struct MetaModel {
    #[prost(string, tag = "2")]
    producer_name: String,
    #[prost(string, tag = "4")]
    domain: String,
    #[prost(int64, tag = "5")]
    model_version: i64,
    #[prost(string, tag = "6")]
    doc_string: String,
    #[prost(message, optional, tag = "7")]
    graph: Option<MetaGraph>,
    #[prost(message, repeated, tag = "14")]
    metadata_props: Vec<MetaEntry>,
}

#[derive(Clone, PartialEq, Message)]
struct MetaGraph {
    #[prost(string, tag = "2")]
    name: String,
    #[prost(string, tag = "10")]
    doc_string: String,
}

#[derive(Clone, PartialEq, Message)]
struct MetaEntry {
    #[prost(string, tag = "1")]
    key: String,
    #[prost(string, tag = "2")]
    value: String,
}

fn metadata(bytes: &[u8]) -> ModelMetadata {
    // The model itself decoded already; a file whose metadata fields do not decode has none.
    let m = MetaModel::decode(bytes).unwrap_or_default();
    let g = m.graph.unwrap_or_default();
    ModelMetadata {
        producer_name: m.producer_name,
        graph_name: g.name,
        domain: m.domain,
        description: m.doc_string,
        graph_description: g.doc_string,
        version: m.model_version,
        custom_metadata_map: m
            .metadata_props
            .into_iter()
            .map(|e| (e.key, e.value))
            .collect(),
    }
}

/// Provider names from onnxruntime's `providers` argument (names, or `(name, options)` pairs).
fn providers(py: Python<'_>, p: Option<&Bound<'_, PyAny>>) -> PyResult<Vec<String>> {
    let Some(p) = p.filter(|p| !p.is_none()) else {
        return Ok(vec![CPU_PROVIDER.to_string()]);
    };
    if p.is_instance_of::<PyString>() {
        return Err(PyTypeError::new_err(
            "providers must be a list of provider names, e.g. ['CPUExecutionProvider']",
        ));
    }
    let mut names = Vec::new();
    for item in p.try_iter()? {
        let item = item?;
        let name: String = match item.extract::<String>() {
            Ok(s) => s,
            Err(_) => item.get_item(0)?.extract()?,
        };
        names.push(name);
    }
    let others: Vec<&String> = names.iter().filter(|n| *n != CPU_PROVIDER).collect();
    if !others.is_empty() {
        let warnings = py.import("warnings")?;
        warnings.call_method1(
            "warn",
            (format!(
                "ferrum runs on the CPU only: {} not available, using {CPU_PROVIDER}",
                others
                    .iter()
                    .map(|s| s.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),),
        )?;
    }
    Ok(vec![CPU_PROVIDER.to_string()])
}

/// An ONNX model loaded once and run many times, as onnxruntime's `InferenceSession`.
///
/// `InferenceSession(path_or_bytes, sess_options=None, providers=None)`: `path_or_bytes` is a
/// file path (str or os.PathLike; external data is read from its folder) or the serialized
/// model as `bytes`. The model runs with the GIL released, so Python threads run sessions (or one
/// session) in parallel.
#[pyclass(module = "ferrum", frozen)]
pub struct InferenceSession {
    session: Session,
    inputs: Vec<NodeArg>,
    overridable: Vec<NodeArg>,
    outputs: Vec<NodeArg>,
    /// Every input that may be fed (runtime inputs and initializer-backed ones), by name.
    input_types: HashMap<String, ValueType>,
    meta: ModelMetadata,
    options: SessionOptions,
    providers: Vec<String>,
}

enum RunFailure {
    Graph(ferrum_graph::Error),
    Panic(String),
}

#[pymethods]
impl InferenceSession {
    /// Loads a model from a path or from bytes (see the class's documentation).
    #[new]
    #[pyo3(signature = (path_or_bytes, sess_options=None, providers=None, provider_options=None, **kwargs))]
    fn new(
        py: Python<'_>,
        path_or_bytes: &Bound<'_, PyAny>,
        sess_options: Option<SessionOptions>,
        providers: Option<&Bound<'_, PyAny>>,
        provider_options: Option<&Bound<'_, PyAny>>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let _ = (provider_options, kwargs);
        let options = sess_options.unwrap_or_else(SessionOptions::new);
        let providers = self::providers(py, providers)?;
        if options.intra_op_num_threads > 0 {
            ferrum_kernels::pool::set_threads(Some(options.intra_op_num_threads));
        }
        let opts = ferrum_graph::SessionOptions {
            opt_level: match options.graph_optimization_level {
                GraphOptimizationLevel::ORT_DISABLE_ALL => OptLevel::Disabled,
                GraphOptimizationLevel::ORT_ENABLE_BASIC => OptLevel::Basic,
                GraphOptimizationLevel::ORT_ENABLE_EXTENDED => OptLevel::Extended,
                GraphOptimizationLevel::ORT_ENABLE_LAYOUT
                | GraphOptimizationLevel::ORT_ENABLE_ALL => OptLevel::All,
            },
            ..Default::default()
        };
        let loaded: Result<(Session, ModelMetadata), ferrum_graph::Error> = if let Ok(b) =
            path_or_bytes.cast::<PyBytes>()
        {
            let bytes = b.as_bytes().to_vec();
            py.detach(|| Session::from_bytes_with(&bytes, &opts).map(|s| (s, metadata(&bytes))))
        } else {
            let os = py.import("os")?;
            let path: std::path::PathBuf = os
                .call_method1("fspath", (path_or_bytes,))
                .map_err(|_| {
                    PyTypeError::new_err("path_or_bytes must be a path (str, os.PathLike) or bytes")
                })?
                .extract()?;
            py.detach(|| {
                let s = Session::from_file_with(&path, &opts)?;
                let meta = std::fs::read(&path)
                    .map(|b| metadata(&b))
                    .unwrap_or_default();
                Ok((s, meta))
            })
        };
        let (session, meta) = loaded.map_err(graph_err)?;
        let model = session.model();
        let g = &model.graph;
        let runtime = g.runtime_inputs();
        let mut inputs = Vec::new();
        let mut overridable = Vec::new();
        let mut input_types = HashMap::new();
        for id in &g.inputs {
            let v = model.value(*id);
            let arg = node_arg(&v.name, &v.ty);
            if runtime.contains(id) {
                inputs.push(arg);
            } else {
                overridable.push(arg);
            }
            input_types.insert(v.name.clone(), v.ty.clone());
        }
        let outputs = g
            .outputs
            .iter()
            .map(|id| {
                let v = model.value(*id);
                node_arg(&v.name, &v.ty)
            })
            .collect();
        Ok(InferenceSession {
            session,
            inputs,
            overridable,
            outputs,
            input_types,
            meta,
            options,
            providers,
        })
    }

    /// The inputs a caller feeds (initializer-backed inputs excluded), in graph order.
    fn get_inputs(&self) -> Vec<NodeArg> {
        self.inputs.clone()
    }

    /// The outputs, in graph order.
    fn get_outputs(&self) -> Vec<NodeArg> {
        self.outputs.clone()
    }

    /// Inputs that have an initializer as their default (they may be fed to override it).
    fn get_overridable_initializers(&self) -> Vec<NodeArg> {
        self.overridable.clone()
    }

    /// The model's metadata (producer, graph name, domain, doc strings, version, custom map).
    fn get_modelmeta(&self) -> ModelMetadata {
        self.meta.clone()
    }

    /// The providers this session uses: `['CPUExecutionProvider']`.
    fn get_providers(&self) -> Vec<String> {
        self.providers.clone()
    }

    /// Options per provider (none are set: an empty dict per provider).
    fn get_provider_options<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        for p in &self.providers {
            d.set_item(p, PyDict::new(py))?;
        }
        Ok(d)
    }

    /// A copy of the options the session was created with.
    fn get_session_options(&self) -> SessionOptions {
        self.options.clone()
    }

    /// Accepted for compatibility: ferrum has the CPU provider only.
    #[pyo3(signature = (providers=None, provider_options=None))]
    fn set_providers(
        &self,
        py: Python<'_>,
        providers: Option<&Bound<'_, PyAny>>,
        provider_options: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let _ = provider_options;
        self::providers(py, providers).map(|_| ())
    }

    /// Runs the model. `output_names`: the outputs to return, in that order (`None` or an empty
    /// list: all, in graph order). `input_feed`: `{name: numpy array}` (a list of arrays for a
    /// sequence input, `None` for an empty optional). Returns a list of numpy arrays.
    ///
    /// Raises `InvalidArgument` (a `ValueError`) for an unknown input or output name, a missing
    /// input, or a wrong dtype or shape; `RuntimeException` naming the node when a node fails;
    /// `NotImplementedOp` for an operator ferrum does not implement.
    #[pyo3(signature = (output_names, input_feed, run_options=None))]
    fn run(
        &self,
        py: Python<'_>,
        output_names: Option<Vec<String>>,
        input_feed: &Bound<'_, PyDict>,
        run_options: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<Py<PyAny>>> {
        let _ = run_options;
        let all_outputs = || {
            self.outputs
                .iter()
                .map(|o| o.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        };
        let picks: Option<Vec<usize>> = match &output_names {
            Some(names) if !names.is_empty() => Some(
                names
                    .iter()
                    .map(|n| {
                        self.outputs
                            .iter()
                            .position(|o| &o.name == n)
                            .ok_or_else(|| {
                                InvalidArgument::new_err(format!(
                                    "the model has no output named '{n}' (outputs: {})",
                                    all_outputs()
                                ))
                            })
                    })
                    .collect::<PyResult<_>>()?,
            ),
            _ => None,
        };
        let mut feeds: Vec<(String, Value)> = Vec::with_capacity(input_feed.len());
        for (k, v) in input_feed.iter() {
            let name: String = k.extract().map_err(|_| {
                InvalidArgument::new_err("input_feed keys must be input names (str)")
            })?;
            let ty = self.input_types.get(&name).ok_or_else(|| {
                InvalidArgument::new_err(format!(
                    "the model has no input named '{name}' (inputs: {})",
                    self.inputs
                        .iter()
                        .map(|i| i.name.as_str())
                        .collect::<Vec<_>>()
                        .join(", ")
                ))
            })?;
            feeds.push((name.clone(), to_value(py, &name, &v, ty)?));
        }
        let session = &self.session;
        let result = py.detach(move || {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| session.run(feeds)))
                .map_err(|p| {
                    RunFailure::Panic(
                        p.downcast_ref::<String>()
                            .cloned()
                            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                            .unwrap_or_else(|| "unknown panic".into()),
                    )
                })
                .and_then(|r| r.map_err(RunFailure::Graph))
        });
        let outs = match result {
            Ok(o) => o,
            Err(RunFailure::Graph(e)) => return Err(graph_err(e)),
            Err(RunFailure::Panic(p)) => {
                return Err(FerrumError::new_err(format!(
                    "internal error while running the model: {p}"
                )))
            }
        };
        no_panic("converting the outputs", || {
            let mut values: Vec<Option<Value>> = outs.into_iter().map(|(_, v)| Some(v)).collect();
            let order: Vec<usize> = picks.unwrap_or_else(|| (0..values.len()).collect());
            let mut res = Vec::with_capacity(order.len());
            for (j, &i) in order.iter().enumerate() {
                // An output asked for twice is converted again from a copy.
                let v = if order[j + 1..].contains(&i) {
                    values[i].clone()
                } else {
                    values[i].take()
                };
                let v = v.ok_or_else(|| FerrumError::new_err("output taken twice"))?;
                res.push(from_value(py, v)?);
            }
            Ok(res)
        })
    }

    fn __repr__(&self) -> String {
        format!(
            "InferenceSession(inputs=[{}], outputs=[{}])",
            self.inputs
                .iter()
                .map(|i| i.name.as_str())
                .collect::<Vec<_>>()
                .join(", "),
            self.outputs
                .iter()
                .map(|i| i.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        )
    }
}

/// `['CPUExecutionProvider']`, as onnxruntime's `get_available_providers`.
#[pyfunction]
pub fn get_available_providers() -> Vec<String> {
    vec![CPU_PROVIDER.to_string()]
}

/// `'CPU'`, as onnxruntime's `get_device`.
#[pyfunction]
pub fn get_device() -> String {
    "CPU".to_string()
}
