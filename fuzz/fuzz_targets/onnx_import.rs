//! ONNX models: the protobuf reader, the import (typed nodes, shape and type inference) and the
//! graph passes at the default level (constant folding runs the kernels on constant inputs), then
//! the session's input and output lists. Malformed input must be an error, never a panic, a hang
//! or an allocation the file does not justify.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(session) = ferrum_graph::Session::from_bytes(data) else {
        return;
    };
    let _ = session.input_names();
    let _ = session.output_names();
    let _ = format!("{:?}", session.optimization_report());
});
