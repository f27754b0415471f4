//! ferrum-graph: ONNX models imported into an IR of ferrum's own, and run on the CPU.
//!
//! - [`onnx`]: the protobuf reader (hand-declared `prost` messages in [`proto`]) and the import
//!   into the IR, with checks against malformed or hostile files.
//! - [`ir`]: [`Model`], [`Graph`], [`Node`]: values by id, nodes in execution order.
//! - [`tensor`]: [`Tensor`] (dtype, shape, contiguous data) and [`Value`] (tensor, sequence,
//!   optional).
//! - [`passes`]: graph rewrites run when a session is created (folding, fusion), by level.
//! - [`exec`]: the executor; `ops`: the kernels.
//! - [`Session`]: load a model once, run it many times.
//!
//! ```no_run
//! use ferrum_graph::{Session, Tensor};
//!
//! let session = Session::from_file("model.onnx")?;
//! let x = Tensor::from_vec(vec![1, 3], vec![1.0f32, 2.0, 3.0])?;
//! let outputs = session.run(vec![("x".to_string(), x.into())])?;
//! for (name, value) in &outputs {
//!     println!("{name}: {:?}", value.tensor()?.shape());
//! }
//! # Ok::<(), ferrum_graph::Error>(())
//! ```

mod arena;
mod codec;
pub mod error;
pub mod exec;
mod gradient;
pub mod infer;
pub mod ir;
pub mod onnx;
mod ops;
pub mod passes;
pub mod proto;
mod session;
pub mod small;
pub mod tensor;
pub mod types;

pub use error::{Error, Result};
pub use ir::{Graph, Model, Node, ValueId};
pub use ops::broadcast_shape;
pub use passes::{OptLevel, Precision};
pub use session::{fmt_dims, Session, SessionOptions};
pub use tensor::{DType, Data, SharedElems, Store, Tensor, Value};
