//! ferrum-kernels: CPU compute kernels.
//!
//! Every optimised kernel keeps a plain reference next to it and a randomized test against it.
//! - [`quant`]: block layouts of every GGML type, dequantization, activation quantizers, dot products.
//! - [`matmul`]: weight x activations products (quantized weights, on-the-fly activation quantization).
//! - [`ops`]: RMSNorm, RoPE, activations, softmax.
//! - [`attention`]: causal attention over an f16 KV cache.

pub mod attention;
pub mod matmul;
pub mod ops;
pub mod quant;
