//! [`Session`]: a loaded model, run with named inputs.

use std::path::Path;

use crate::exec::run_graph;
use crate::ir::{Dim, Model, ValueType};
use crate::passes::{optimize, OptLevel, Precision, Report};
use crate::tensor::Value;
use crate::{Error, Result};

/// How a session is prepared.
#[derive(Clone, Debug, Default)]
pub struct SessionOptions {
    /// Which graph passes run when the session is created (default: all).
    pub opt_level: OptLevel,
    /// The arithmetic of the float products with a constant operand (MatMul, Gemm, Conv
    /// weights): f32 (the default), or bf16 on the AMX tile unit or AVX512-BF16 (opt-in: both
    /// operands rounded to bf16, sums in f32). Where the CPU has neither the session warns and
    /// runs f32 ([`Report::precision`] says which ran). Needs `opt_level` 1 or more (prepacking).
    pub precision: Precision,
}

/// A model ready to run.
pub struct Session {
    model: Model,
    report: Report,
    /// The tensor memory runs reuse ([`crate::arena`]).
    arena: crate::arena::Arena,
}

impl Session {
    /// Loads and imports an `.onnx` file (external data is read from its folder), then optimises
    /// it at the default level.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Session> {
        Session::from_file_with(path, &SessionOptions::default())
    }

    /// [`Session::from_file`] with options.
    pub fn from_file_with(path: impl AsRef<Path>, opts: &SessionOptions) -> Result<Session> {
        let t = std::time::Instant::now();
        let model = crate::onnx::load_model(path.as_ref())?;
        tracing::debug!(
            ms = t.elapsed().as_secs_f64() * 1e3,
            "model decoded and imported"
        );
        Ok(Session::prepare(model, opts)?)
    }

    /// Imports a model from memory (external data is refused), optimised at the default level.
    pub fn from_bytes(bytes: &[u8]) -> Result<Session> {
        Session::from_bytes_with(bytes, &SessionOptions::default())
    }

    /// [`Session::from_bytes`] with options.
    pub fn from_bytes_with(bytes: &[u8], opts: &SessionOptions) -> Result<Session> {
        Ok(Session::prepare(
            crate::onnx::load_model_bytes(bytes, None)?,
            opts,
        )?)
    }

    /// A model after the graph passes, for tools that show a graph (`ferrum inspect`) whether
    /// or not ferrum runs all of it: the model, what the passes did, and the error
    /// [`Session::from_file_with`] gives for its unsupported ops (`None` when every op has a
    /// kernel).
    pub fn inspect_file_with(
        path: impl AsRef<Path>,
        opts: &SessionOptions,
    ) -> Result<(Model, Report, Option<Error>)> {
        let model = crate::onnx::load_model(path.as_ref())?;
        match Session::prepare(model, opts) {
            Ok(s) => Ok((s.model, s.report, None)),
            Err(PrepareError::Unsupported(u)) => {
                let (model, report, e) = *u;
                Ok((model, report, Some(e)))
            }
            Err(PrepareError::Other(e)) => Err(e),
        }
    }

    fn prepare(mut model: Model, opts: &SessionOptions) -> Result<Session, PrepareError> {
        let mut precision = opts.precision;
        if precision == Precision::Bf16 && !ferrum_kernels::gemm::bf16_supported() {
            tracing::warn!(
                "bf16 asked for, but the CPU has neither AMX-BF16 nor AVX512-BF16 (or they are \
                 switched off by FERRUM_NO_AMX / FERRUM_NO_AVX512): running f32"
            );
            precision = Precision::F32;
        }
        if let Err(e) = crate::types::check(&model) {
            return Err(match e {
                e @ Error::Unsupported(_) => {
                    PrepareError::Unsupported(Box::new((model, Report::default(), e)))
                }
                e => PrepareError::Other(e),
            });
        }
        let t = std::time::Instant::now();
        let report =
            optimize(&mut model, opts.opt_level, precision).map_err(PrepareError::Other)?;
        tracing::debug!(
            ms = t.elapsed().as_secs_f64() * 1e3,
            "graph passes and weight prepacking"
        );
        match model.graph.resolve(&model.values) {
            Ok(()) => Ok(Session {
                model,
                report,
                arena: Default::default(),
            }),
            Err(e) => Err(PrepareError::Unsupported(Box::new((model, report, e)))),
        }
    }

    /// The model as it runs (after the graph passes).
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// What the graph passes did when the session was created.
    pub fn optimization_report(&self) -> &Report {
        &self.report
    }

    /// Names of the inputs a caller feeds, in graph order (initializer-backed inputs excluded).
    pub fn input_names(&self) -> Vec<String> {
        self.model
            .graph
            .runtime_inputs()
            .iter()
            .map(|&id| self.model.value(id).name.clone())
            .collect()
    }

    pub fn output_names(&self) -> Vec<String> {
        self.model
            .graph
            .outputs
            .iter()
            .map(|&id| self.model.value(id).name.clone())
            .collect()
    }

    /// Runs the model. Every non-initializer input must be given by name; inputs that have an
    /// initializer may be given to override it. Returns the outputs in graph order.
    pub fn run(&self, inputs: Vec<(String, Value)>) -> Result<Vec<(String, Value)>> {
        let g = &self.model.graph;
        let mut slots: Vec<Option<Value>> = vec![None; g.inputs.len()];
        for (name, v) in inputs {
            let pos = g
                .inputs
                .iter()
                .position(|&id| self.model.value(id).name == name)
                .ok_or_else(|| Error::Input(format!("the model has no input named '{name}'")))?;
            self.check_input(pos, &v)?;
            slots[pos] = Some(v);
        }
        for (pos, id) in g.inputs.iter().enumerate() {
            let has_default = g.initializers.iter().any(|(i, _)| i == id);
            if slots[pos].is_none() && !has_default {
                return Err(Error::Input(format!(
                    "input '{}' is required",
                    self.model.value(*id).name
                )));
            }
        }
        let outs = {
            let _pool = self.arena.install();
            run_graph(g, slots, None)?
        };
        Ok(self.output_names().into_iter().zip(outs).collect())
    }

    /// The tensor memory the last finished run used: requests served by memory an earlier
    /// value freed, requests that allocated, and the bytes kept for the next run.
    pub fn memory(&self) -> ferrum_core::recycle::PoolRun {
        self.arena.last_run()
    }

    /// How many outputs the last finished run wrote into the memory of an input they were the
    /// last to read (a fused convolution's residual) instead of a buffer of their own.
    pub fn outputs_in_place(&self) -> usize {
        self.arena.last_in_place()
    }

    fn check_input(&self, pos: usize, v: &Value) -> Result<()> {
        let info = self.model.value(self.model.graph.inputs[pos]);
        if let (ValueType::Tensor { dtype, shape }, Value::Tensor(t)) = (&info.ty, v) {
            if let Some(dt) = dtype {
                if *dt != t.dtype() {
                    return Err(Error::Input(format!(
                        "input '{}' must be {dt}, got {}",
                        info.name,
                        t.dtype()
                    )));
                }
            }
            if let Some(dims) = shape {
                let ok = dims.len() == t.rank()
                    && dims.iter().zip(t.shape()).all(|(d, &s)| match d {
                        Dim::Known(k) => *k == s,
                        _ => true,
                    });
                if !ok {
                    return Err(Error::Input(format!(
                        "input '{}' must have shape {}, got {:?}",
                        info.name,
                        fmt_dims(dims),
                        t.shape()
                    )));
                }
            }
        }
        Ok(())
    }
}

/// `[1, N, 3]`-style rendering of a static shape.
pub fn fmt_dims(dims: &[Dim]) -> String {
    let parts: Vec<String> = dims
        .iter()
        .map(|d| match d {
            Dim::Known(k) => k.to_string(),
            Dim::Sym(s) => s.clone(),
            Dim::Unknown => "?".into(),
        })
        .collect();
    format!("[{}]", parts.join(", "))
}

/// Why [`Session::prepare`] failed: ops without a kernel (the prepared model kept for
/// [`Session::inspect_file_with`]) or anything else.
enum PrepareError {
    Unsupported(Box<(Model, Report, Error)>),
    Other(Error),
}

impl From<PrepareError> for Error {
    fn from(e: PrepareError) -> Error {
        match e {
            PrepareError::Unsupported(u) => u.2,
            PrepareError::Other(e) => e,
        }
    }
}
