//! Quantized block formats (work in progress).
