//! The exceptions the package raises, and the mapping of ferrum's errors onto them.
//!
//! Names follow onnxruntime's (`InvalidArgument`, `NoSuchFile`, `InvalidGraph`,
//! `RuntimeException`), each a subclass of the Python built-in a caller would catch for it.

use std::panic::{catch_unwind, AssertUnwindSafe};

use pyo3::create_exception;
use pyo3::exceptions::{PyFileNotFoundError, PyRuntimeError, PyValueError};
use pyo3::prelude::*;

create_exception!(
    ferrum,
    FerrumError,
    PyRuntimeError,
    "Base class of ferrum's run-time failures."
);
create_exception!(
    ferrum,
    InvalidArgument,
    PyValueError,
    "A bad argument: an unknown input or output name, a wrong dtype or shape, a missing input."
);
create_exception!(
    ferrum,
    NoSuchFile,
    PyFileNotFoundError,
    "The model file does not exist or cannot be read."
);
create_exception!(
    ferrum,
    InvalidGraph,
    FerrumError,
    "The model is not a well-formed ONNX model."
);
create_exception!(
    ferrum,
    NotImplementedOp,
    FerrumError,
    "The model uses an operator, operator version or data type ferrum does not implement."
);
create_exception!(
    ferrum,
    RuntimeException,
    FerrumError,
    "A node failed while the model ran (the message names the node and its op)."
);

/// A Python exception for an error of the ONNX runtime.
pub fn graph_err(e: ferrum_graph::Error) -> PyErr {
    use ferrum_graph::Error as E;
    let msg = e.to_string();
    match e {
        E::Io { err, .. } if err.kind() == std::io::ErrorKind::NotFound => NoSuchFile::new_err(msg),
        E::Io { .. } => NoSuchFile::new_err(msg),
        E::Format(_) => InvalidGraph::new_err(msg),
        E::Unsupported(_) | E::UnsupportedType(_) | E::KernelUnsupported(_) => {
            NotImplementedOp::new_err(msg)
        }
        E::Input(_) => InvalidArgument::new_err(msg),
        E::Node { .. } | E::Kernel(_) => RuntimeException::new_err(msg),
    }
}

/// Runs `f`, turning a panic into a `FerrumError` (a bug in ferrum must not end the interpreter).
pub fn no_panic<T>(what: &str, f: impl FnOnce() -> PyResult<T>) -> PyResult<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(p) => {
            let detail = p
                .downcast_ref::<String>()
                .map(String::as_str)
                .or_else(|| p.downcast_ref::<&str>().copied())
                .unwrap_or("unknown panic");
            Err(FerrumError::new_err(format!(
                "internal error in {what}: {detail}"
            )))
        }
    }
}

/// Registers the exception classes on the module.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("FerrumError", py.get_type::<FerrumError>())?;
    m.add("InvalidArgument", py.get_type::<InvalidArgument>())?;
    m.add("NoSuchFile", py.get_type::<NoSuchFile>())?;
    m.add("InvalidGraph", py.get_type::<InvalidGraph>())?;
    m.add("NotImplementedOp", py.get_type::<NotImplementedOp>())?;
    m.add("RuntimeException", py.get_type::<RuntimeException>())?;
    Ok(())
}
