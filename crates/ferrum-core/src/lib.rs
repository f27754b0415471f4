//! ferrum-core: the types every other ferrum crate shares.
//!
//! - [`DType`]: element and block-quantized storage types, with GGML's ids and block layouts.
//! - [`Bytes`]: an immutable, cheaply clonable byte buffer, either memory-mapped or owned.
//! - [`Error`]: the error type of the stack.

pub mod dtype;
pub mod error;
pub mod recycle;
pub mod storage;

pub use dtype::DType;
pub use error::{Error, Result};
pub use recycle::Buf;
pub use storage::{Bytes, HugeBuf};

/// IEEE binary16, re-exported so every crate converts the same way.
pub use half::{bf16, f16};
