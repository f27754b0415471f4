//! ferrum's Python package, `ferrum` (this is its native part, `ferrum._ferrum`).
//!
//! - [`session`]: `InferenceSession` with onnxruntime's API over `ferrum-graph`;
//!   [`convert`]: NumPy arrays to and from ferrum's values.
//! - [`llm`]: the engine behind `ferrum.LLM` (the server's continuous-batching engine on its
//!   own thread) and the tokenizer; the vLLM-shaped classes are Python, in `python/ferrum`.
//! - [`errors`]: the exception classes, and panics turned into exceptions at the boundary.
//!
//! Every call that runs a model releases the GIL.

mod convert;
mod errors;
mod llm;
mod session;

use pyo3::prelude::*;

/// The native module `ferrum._ferrum`; `import ferrum` re-exports its public names.
#[pymodule]
fn _ferrum(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::register(m)?;
    m.add_class::<session::InferenceSession>()?;
    m.add_class::<session::SessionOptions>()?;
    m.add_class::<session::RunOptions>()?;
    m.add_class::<session::NodeArg>()?;
    m.add_class::<session::ModelMetadata>()?;
    m.add_class::<session::GraphOptimizationLevel>()?;
    m.add_class::<session::ExecutionMode>()?;
    m.add_function(wrap_pyfunction!(session::get_available_providers, m)?)?;
    m.add_function(wrap_pyfunction!(session::get_device, m)?)?;
    m.add_class::<llm::Engine>()?;
    m.add_class::<llm::TokenStream>()?;
    m.add_class::<llm::RawLogprobs>()?;
    m.add_class::<llm::PyTokenizer>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
