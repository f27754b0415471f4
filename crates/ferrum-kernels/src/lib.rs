//! ferrum-kernels: CPU compute kernels.
//!
//! Every optimised kernel keeps a plain reference next to it and a randomized test against it.
//! - [`quant`]: block layouts of every GGML type, dequantization, activation quantizers, dot products.
//! - [`matmul`]: weight x activations products (quantized weights, on-the-fly activation quantization).
//! - [`gemm`]: blocked, packed f32 GEMM (AVX-512 / AVX2 microkernels) for the graph runtime.
//! - [`qgemm`]: 8-bit integer GEMM (AVX-512 VNNI) for the graph runtime's quantized products.
//! - [`ops`]: RMSNorm, RoPE, activations, softmax.
//! - [`attention`]: causal attention over an f16 KV cache.
//! - [`machine`]: measured ceilings (peak FMA, memory and cache bandwidth).
//! - [`profile`]: per-operator timing with FLOPs and bytes (`ferrum profile`).
//! - [`aligned`]: 64-byte aligned byte buffers for GEMM operands.
//! - [`pool`]: the thread pool every parallel kernel runs on (`--threads`).
//! - [`cpu`]: the CPU's features and kernel tier, read once (with the environment's overrides).

pub mod aligned;
#[cfg(target_arch = "x86_64")]
mod amx;
pub mod attention;
pub mod cpu;
pub mod depthwise;
pub mod direct;
pub mod gemm;
pub mod machine;
pub mod matmul;
pub mod ops;
pub mod pool;
pub mod profile;
pub mod qgemm;
pub mod quant;
pub mod winograd;
