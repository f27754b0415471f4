"""ferrum from Python.

Two halves, each in the shape of the library people already use:

- ONNX models with onnxruntime's API: ``ferrum.InferenceSession(path_or_bytes, sess_options=None,
  providers=None)``, ``get_inputs()`` / ``get_outputs()`` / ``get_modelmeta()``,
  ``run(output_names, input_feed)`` returning a list of numpy arrays; ``SessionOptions`` with
  ``intra_op_num_threads`` and ``graph_optimization_level``. A drop-in for
  ``import onnxruntime as ort`` in most scripts: ``import ferrum as ort``.
- LLMs with vLLM's API: ``ferrum.LLM(model)``, ``ferrum.SamplingParams(...)``,
  ``llm.generate(prompts, params)`` (one continuous batch through the same engine as
  ``ferrum serve``), ``llm.chat(messages, params)``, ``llm.stream(prompt, params)``,
  ``llm.get_tokenizer().encode/decode``.

Models run with the GIL released: Python threads run sessions in parallel.
"""

from ferrum._ferrum import (
    ExecutionMode,
    FerrumError,
    GraphOptimizationLevel,
    InferenceSession,
    InvalidArgument,
    InvalidGraph,
    ModelMetadata,
    NodeArg,
    NoSuchFile,
    NotImplementedOp,
    RunOptions,
    RuntimeException,
    SessionOptions,
    Tokenizer,
    __version__,
    get_available_providers,
    get_device,
)
from ferrum.llm import (
    LLM,
    CompletionOutput,
    Logprob,
    RequestOutput,
    SamplingParams,
    StreamChunk,
)

__all__ = [
    "LLM",
    "CompletionOutput",
    "ExecutionMode",
    "FerrumError",
    "GraphOptimizationLevel",
    "InferenceSession",
    "InvalidArgument",
    "InvalidGraph",
    "Logprob",
    "ModelMetadata",
    "NoSuchFile",
    "NodeArg",
    "NotImplementedOp",
    "RequestOutput",
    "RunOptions",
    "RuntimeException",
    "SamplingParams",
    "SessionOptions",
    "StreamChunk",
    "Tokenizer",
    "__version__",
    "get_available_providers",
    "get_device",
]
