//! One error type for the stack. Messages name the object, the problem and, where it helps, the fix.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The I/O error is part of the message, not a chained source, so it prints once.
    #[error("{}: {err}", path.display())]
    Io { path: PathBuf, err: std::io::Error },
    /// A file in a known format that is malformed; `offset` is the byte where the problem was found.
    #[error("{format} parse error at byte {offset}: {msg}")]
    Parse {
        format: &'static str,
        offset: u64,
        msg: String,
    },
    #[error("unsupported: {0}")]
    Unsupported(String),
    #[error("shape mismatch: {0}")]
    Shape(String),
    #[error("{0}")]
    Msg(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn msg(m: impl Into<String>) -> Self {
        Error::Msg(m.into())
    }
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            err: source,
        }
    }
}

/// `bail!("...")`-style early return with a formatted [`Error::Msg`].
#[macro_export]
macro_rules! bail {
    ($($arg:tt)*) => { return Err($crate::Error::Msg(format!($($arg)*))) };
}
