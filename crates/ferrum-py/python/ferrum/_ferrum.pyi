"""Type stubs of ferrum's native module (ferrum._ferrum); `import ferrum` re-exports the public
names. The classes mirror onnxruntime's Python API (InferenceSession and companions)."""

from __future__ import annotations

import os
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

__version__: str

class FerrumError(RuntimeError):
    """Base class of ferrum's run-time failures."""

class InvalidArgument(ValueError):
    """A bad argument: an unknown input or output name, a wrong dtype or shape, a missing input."""

class NoSuchFile(FileNotFoundError):
    """The model file does not exist or cannot be read."""

class InvalidGraph(FerrumError):
    """The model is not a well-formed ONNX model."""

class NotImplementedOp(FerrumError):
    """The model uses an operator, operator version or data type ferrum does not implement."""

class RuntimeException(FerrumError):
    """A node failed while the model ran (the message names the node and its op)."""

class GraphOptimizationLevel:
    """onnxruntime's graph optimization levels (accepted; ferrum runs the graph as imported)."""

    ORT_DISABLE_ALL: GraphOptimizationLevel
    ORT_ENABLE_BASIC: GraphOptimizationLevel
    ORT_ENABLE_EXTENDED: GraphOptimizationLevel
    ORT_ENABLE_LAYOUT: GraphOptimizationLevel
    ORT_ENABLE_ALL: GraphOptimizationLevel
    def __int__(self) -> int:
        """The level's number (0, 1, 2, 3, 99)."""

class ExecutionMode:
    """onnxruntime's execution modes (ferrum runs nodes in order in both)."""

    ORT_SEQUENTIAL: ExecutionMode
    ORT_PARALLEL: ExecutionMode
    def __int__(self) -> int:
        """The mode's number."""

class SessionOptions:
    """Options of an InferenceSession, as onnxruntime's SessionOptions.

    ``intra_op_num_threads`` sets the kernels' thread count (0: every core). ferrum's kernel
    thread pool is one per process: the last session made with a non-zero value sets it.
    """

    intra_op_num_threads: int
    inter_op_num_threads: int
    graph_optimization_level: GraphOptimizationLevel
    execution_mode: ExecutionMode
    log_severity_level: int
    log_verbosity_level: int
    logid: str
    enable_profiling: bool
    def __init__(self) -> None:
        """Default options: every core, all optimizations."""

class RunOptions:
    """Options of one run call (accepted for compatibility)."""

    logid: str
    log_severity_level: int
    def __init__(self) -> None:
        """Default run options."""

class NodeArg:
    """An input or output of a model."""

    @property
    def name(self) -> str:
        """The value's name in the graph."""
    @property
    def type(self) -> str:
        """onnxruntime's type string: ``tensor(float)``, ``seq(tensor(int64))``, ..."""
    @property
    def shape(self) -> List[Union[int, str, None]]:
        """Static shape: ints, symbolic dims as their names, None for unknown dims."""

class ModelMetadata:
    """A model's metadata, as onnxruntime's ModelMetadata."""

    @property
    def producer_name(self) -> str:
        """The model file's producer_name."""
    @property
    def graph_name(self) -> str:
        """The main graph's name."""
    @property
    def domain(self) -> str:
        """The model's domain."""
    @property
    def description(self) -> str:
        """The model's doc_string."""
    @property
    def graph_description(self) -> str:
        """The main graph's doc_string."""
    @property
    def version(self) -> int:
        """model_version."""
    @property
    def custom_metadata_map(self) -> Dict[str, str]:
        """metadata_props as a dict."""

InputValue = Union[np.ndarray, Sequence[np.ndarray], None, Any]

class InferenceSession:
    """An ONNX model loaded once and run many times, as onnxruntime's InferenceSession.

    The model runs with the GIL released: Python threads run sessions in parallel.
    """

    def __init__(
        self,
        path_or_bytes: Union[str, bytes, os.PathLike[str]],
        sess_options: Optional[SessionOptions] = None,
        providers: Optional[Sequence[Union[str, Tuple[str, Dict[str, Any]]]]] = None,
        provider_options: Optional[Sequence[Dict[str, Any]]] = None,
        **kwargs: Any,
    ) -> None:
        """Loads a model from a file path (external data read from its folder) or from bytes.

        Raises NoSuchFile (FileNotFoundError) for a missing file, InvalidGraph for a malformed
        model, NotImplementedOp for an operator ferrum lacks.
        """
    def get_inputs(self) -> List[NodeArg]:
        """The inputs a caller feeds (initializer-backed inputs excluded), in graph order."""
    def get_outputs(self) -> List[NodeArg]:
        """The outputs, in graph order."""
    def get_overridable_initializers(self) -> List[NodeArg]:
        """Inputs with an initializer as their default."""
    def get_modelmeta(self) -> ModelMetadata:
        """The model's metadata."""
    def get_providers(self) -> List[str]:
        """``['CPUExecutionProvider']``."""
    def get_provider_options(self) -> Dict[str, Dict[str, Any]]:
        """Options per provider (none are set)."""
    def get_session_options(self) -> SessionOptions:
        """A copy of the options the session was created with."""
    def set_providers(
        self,
        providers: Optional[Sequence[Union[str, Tuple[str, Dict[str, Any]]]]] = None,
        provider_options: Optional[Sequence[Dict[str, Any]]] = None,
    ) -> None:
        """Accepted for compatibility: ferrum has the CPU provider only."""
    def run(
        self,
        output_names: Optional[Sequence[str]],
        input_feed: Dict[str, InputValue],
        run_options: Optional[RunOptions] = None,
    ) -> List[Any]:
        """Runs the model; returns the outputs asked for (None or []: all) as numpy arrays
        (lists of arrays for sequence outputs, None for empty optionals).

        Raises InvalidArgument (ValueError) for an unknown input or output name, a missing
        input, a wrong dtype or shape; RuntimeException naming the node when a node fails.
        """

def get_available_providers() -> List[str]:
    """``['CPUExecutionProvider']``."""

def get_device() -> str:
    """``'CPU'``."""

class Tokenizer:
    """The tokenizer of an LLM."""

    def encode(self, text: str, add_special_tokens: bool = True, parse_special: bool = False) -> List[int]:
        """Token ids of ``text``: BOS/EOS added as the model asks with ``add_special_tokens``;
        special-token text such as ``<|im_start|>`` read as those tokens with ``parse_special``."""
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of ``token_ids`` (ValueError for an id outside the vocabulary)."""
    def convert_ids_to_tokens(self, token_ids: Sequence[int]) -> List[str]:
        """The vocabulary's text form of each token."""
    @property
    def vocab_size(self) -> int:
        """Number of tokens in the vocabulary."""
    @property
    def bos_token_id(self) -> Optional[int]:
        """The beginning-of-sequence token id, if any."""
    @property
    def eos_token_id(self) -> Optional[int]:
        """The end-of-sequence token id, if any."""
    @property
    def eog_token_ids(self) -> List[int]:
        """Every token id that ends a generation."""
    def __len__(self) -> int:
        """The vocabulary size."""

class RawLogprobs:
    """A generated token's log-probabilities, held for ferrum.llm."""

# ("token", text, token_id | None, RawLogprobs | None) or
# ("done", finish_reason, prompt_tokens, completion_tokens)
StreamEvent = Tuple[Any, ...]

class TokenStream(Iterator[StreamEvent]):
    """The events of one streamed request (used by ``LLM.stream``)."""

    def __iter__(self) -> TokenStream:
        """Itself."""
    def __next__(self) -> StreamEvent:
        """``("token", text, token_id, logprobs)``, finally ``("done", finish_reason,
        prompt_tokens, completion_tokens)``."""
    def close(self) -> None:
        """Cancels the request."""

class Engine:
    """The engine thread and the model it runs (made by ``ferrum.LLM``)."""

    def __init__(
        self,
        model: Union[str, os.PathLike[str]],
        n_threads: Optional[int],
        ctx_size: int,
        max_num_seqs: int,
        max_batch_tokens: int,
        kv_cache_memory: Optional[int],
        block_size: int,
        enable_prefix_caching: bool,
        kv_cache_dtype: str,
    ) -> None:
        """Loads the model and starts the engine thread."""
    @property
    def name(self) -> str:
        """The model's name."""
    @property
    def ctx_size(self) -> int:
        """Context size in tokens."""
    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer."""
    def encode_prompt(self, text: str) -> List[int]:
        """Tokens of a text prompt, as the server's completions endpoint makes them."""
    def render_chat(
        self,
        messages_json: str,
        add_generation_prompt: bool,
        tools_json: Optional[str] = None,
        kwargs_json: Optional[str] = None,
    ) -> str:
        """A chat rendered with the model's template, as the server renders it."""
    def encode_chat(self, rendered: str) -> List[int]:
        """Tokens of a rendered chat."""
    def generate(self, prompts: Sequence[Sequence[int]], params: Sequence[Any]) -> List[List[Dict[str, Any]]]:
        """Runs the prompts as one continuous batch; per prompt, a dict per completion."""
    def stream(self, prompt: Sequence[int], params: Any) -> TokenStream:
        """Submits one prompt; its events."""
    def _logprobs_of(self, raw: RawLogprobs) -> Tuple[float, str, List[Tuple[int, str, float]]]:
        """The logprobs held by a stream event."""
    def stats(self) -> Mapping[str, int]:
        """Engine counters."""
    def shutdown(self) -> None:
        """Stops the engine thread."""
