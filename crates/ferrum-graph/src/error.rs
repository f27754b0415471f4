//! The errors of loading and running a graph. Each names what failed and where.

use std::path::PathBuf;

/// Everything that can go wrong between an `.onnx` file and its outputs.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{}: {err}", path.display())]
    Io { path: PathBuf, err: std::io::Error },
    /// The file is not a well-formed model (bad protobuf, dangling names, cycles, bad tensors).
    #[error("invalid model: {0}")]
    Format(String),
    /// A node whose op (or op version, or data type) ferrum does not implement.
    #[error("unsupported: node '{node}' ({domain}{op}, opset {opset}){}: {detail}", dtype.as_ref().map(|d| format!(", dtype {d}")).unwrap_or_default())]
    Unsupported {
        node: String,
        op: String,
        domain: String,
        opset: i64,
        dtype: Option<String>,
        detail: String,
    },
    /// A data type ferrum cannot hold (float8, int4...), outside any node.
    #[error("unsupported data type {0}")]
    UnsupportedType(String),
    /// A node failed at run time (bad shapes, out-of-range indices...).
    #[error("node '{node}' ({op}): {msg}")]
    Node {
        node: String,
        op: String,
        msg: String,
    },
    /// Wrong inputs given to [`crate::Session::run`].
    #[error("{0}")]
    Input(String),
    /// An error raised inside a kernel before the node is known; wrapped into [`Error::Node`].
    #[error("{0}")]
    Kernel(String),
    /// A kernel met an attribute value or input form it does not implement; wrapped into
    /// [`Error::Unsupported`].
    #[error("{0}")]
    KernelUnsupported(String),
}

impl Error {
    /// True for unsupported ops and types (the CLI exits with status 3 for these).
    pub fn is_unsupported(&self) -> bool {
        matches!(self, Error::Unsupported { .. } | Error::UnsupportedType(_))
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// `kerr!("...")` builds an [`Error::Kernel`] from a format string.
#[macro_export]
macro_rules! kerr {
    ($($t:tt)*) => { $crate::Error::Kernel(format!($($t)*)) };
}

/// Early return with a kernel error.
#[macro_export]
macro_rules! kbail {
    ($($t:tt)*) => { return Err($crate::kerr!($($t)*)) };
}
