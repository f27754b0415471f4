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
    #[error("unsupported: {0}")]
    Unsupported(Box<UnsupportedOp>),
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

/// Where an unsupported op or type was met: the node, its op and opset, the input type.
#[derive(Debug)]
pub struct UnsupportedOp {
    pub node: String,
    pub op: String,
    /// `""` for the default domain, else the domain followed by a dot.
    pub domain: String,
    pub opset: i64,
    pub dtype: Option<String>,
    pub detail: String,
}

impl std::fmt::Display for UnsupportedOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "node '{}' ({}{}, opset {})",
            self.node, self.domain, self.op, self.opset
        )?;
        if let Some(d) = &self.dtype {
            write!(f, ", dtype {d}")?;
        }
        write!(f, ": {}", self.detail)
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
