//! ferrum-llm: large language models on ferrum's kernels.
