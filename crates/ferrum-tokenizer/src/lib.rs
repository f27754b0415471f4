//! Tokenizers (work in progress).
