"""LLM generation with vLLM's offline API, through ferrum's serving engine.

``LLM`` loads a model once and starts the engine the server runs (``ferrum serve``): one thread
that schedules every request into a continuous batch, one forward pass per step over all running
sequences, KV caches in one paged pool with prefix sharing. ``generate`` submits all its prompts
at once, so they are decoded together.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Mapping, Optional, Sequence, Union

from ferrum._ferrum import Engine as _Engine
from ferrum._ferrum import Tokenizer

__all__ = [
    "LLM",
    "CompletionOutput",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StreamChunk",
]

DEFAULT_MODEL = "SmolLM2-135M-Instruct.Q4_1.gguf"

Message = Mapping[str, Any]
PromptType = Union[str, Mapping[str, Any]]


@dataclass
class SamplingParams:
    """How to sample a completion, as vLLM's ``SamplingParams``.

    The sampler applies llama.cpp's chain: penalties, top-k, top-p, min-p, temperature, draw.

    Attributes:
        temperature: 0 is greedy (always the most likely token).
        top_p: keep the smallest set of tokens whose probability adds up to ``top_p`` (1: off).
        top_k: keep the ``top_k`` most likely tokens (0 or -1: off).
        min_p: drop tokens less likely than ``min_p`` times the most likely one (0: off).
        max_tokens: most tokens to generate (``None``: up to the context size).
        stop: a string or strings that end the completion (not included in the text).
        seed: seed of the random draw (``None``: a fresh one); the same seed, prompt and settings
            give the same tokens. With ``n`` > 1 sample ``j`` uses ``seed + j``.
        logprobs: report each generated token's log-probability and this many most likely
            alternatives (``None``: none; 0: only the sampled token's).
        n: completions per prompt.
        presence_penalty: subtracted once from the logit of every token seen in the window.
        frequency_penalty: subtracted from a token's logit per occurrence in the window.
        repetition_penalty: logits of seen tokens are divided (positive) or multiplied
            (negative) by this (1: off).
        penalty_last_n: how many recent tokens the penalties look at (llama.cpp's window).
        ignore_eos: keep generating past end-of-generation tokens.
        min_tokens: end-of-generation tokens cannot be drawn before this many tokens.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: Optional[int] = 16
    stop: Optional[Union[str, List[str]]] = None
    seed: Optional[int] = None
    logprobs: Optional[int] = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    penalty_last_n: int = 64
    ignore_eos: bool = False
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {self.logprobs}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens is larger than max_tokens")
        if self.penalty_last_n < 0:
            raise ValueError(f"penalty_last_n must be >= 0, got {self.penalty_last_n}")


@dataclass
class Logprob:
    """One token's log-probability at a position, as vLLM's ``Logprob``.

    Attributes:
        logprob: natural-log probability under the model (before temperature and penalties).
        rank: 1 for the most likely token; ``None`` for a sampled token outside the top list.
        decoded_token: the token's text (a piece of UTF-8, possibly not a whole character).
    """

    logprob: float
    rank: Optional[int]
    decoded_token: str


@dataclass
class CompletionOutput:
    """One completion of a prompt, as vLLM's ``CompletionOutput``.

    Attributes:
        index: which of the prompt's ``n`` completions this is.
        text: the generated text (stop strings not included).
        token_ids: the generated token ids (an end-of-generation token that ended it is not
            included, as it adds no text).
        cumulative_logprob: sum of the sampled tokens' logprobs (when logprobs were asked for).
        logprobs: per generated token, ``{token_id: Logprob}`` for the sampled token and the
            ``logprobs`` most likely ones (``None`` unless ``SamplingParams.logprobs`` was set).
        finish_reason: ``"stop"`` (end of generation or a stop string) or ``"length"``.
    """

    index: int
    text: str
    token_ids: List[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[List[Dict[int, Logprob]]]
    finish_reason: Optional[str]

    def finished(self) -> bool:
        """Whether the completion has ended."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The result for one prompt, as vLLM's ``RequestOutput``.

    Attributes:
        request_id: this output's id (its position in the call, as a string).
        prompt: the prompt text (the rendered chat for ``chat``; ``None`` for token prompts).
        prompt_token_ids: the prompt's tokens as the model saw them.
        outputs: the ``n`` completions.
        finished: always true for ``generate`` and ``chat``.
        num_cached_tokens: prompt tokens found in the engine's prefix cache.
        metrics: ``{"time_to_first_token": seconds}``.
    """

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]
    finished: bool = True
    num_cached_tokens: int = 0
    metrics: Dict[str, float] = field(default_factory=dict)


@dataclass
class StreamChunk:
    """One step of ``LLM.stream``: the new text and token, or the end.

    Attributes:
        text: text that became final with this token (may be empty: a stop string may still
            be forming, or the token ends inside a character).
        token_ids: the token drawn (empty for the held-back text given out at the end).
        logprobs: ``[{token_id: Logprob}]`` for the token when logprobs were asked for.
        finish_reason: ``None`` until the last chunk, then ``"stop"`` or ``"length"``.
    """

    text: str
    token_ids: List[int]
    logprobs: Optional[List[Dict[int, Logprob]]] = None
    finish_reason: Optional[str] = None


def _logprob_dict(raw: Any, sampled: Optional[int]) -> Dict[int, Logprob]:
    """``(logprob, text, [(id, text, logprob), ...])`` from the engine as vLLM's position dict."""
    lp, text, top = raw
    out: Dict[int, Logprob] = {}
    sampled_rank: Optional[int] = None
    for rank, (tid, ttext, tlp) in enumerate(top, start=1):
        if tid == sampled:
            sampled_rank = rank
        if tid >= 0 and tid not in out:
            out[tid] = Logprob(logprob=tlp, rank=rank, decoded_token=ttext)
    if sampled is not None:
        out[sampled] = Logprob(logprob=lp, rank=sampled_rank, decoded_token=text)
    return out


def _default_model() -> str:
    base = os.environ.get("FERRUM_MODELS_DIR", "models")
    return os.path.join(base, DEFAULT_MODEL)


class LLM:
    """A model loaded once, generating with vLLM's offline API.

    Args:
        model: a GGUF file or a Hugging Face model folder (default: SmolLM2-135M-Instruct Q4_1
            in ``$FERRUM_MODELS_DIR`` or ``./models``).
        n_threads: kernel threads (default: every core; process-wide).
        ctx_size: most tokens (prompt + completion) of one request.
        max_num_seqs: sequences decoded together at most.
        max_num_batched_tokens: tokens per engine step (decode tokens plus prompt chunks).
        kv_cache_memory: bytes of the KV-cache pool (default: ``max_num_seqs`` full contexts,
            at most a quarter of the available memory).
        block_size: positions per KV block (a power of two).
        enable_prefix_caching: share KV blocks of common prompt prefixes between requests.
        kv_cache_dtype: ``"f16"`` (default), ``"f32"``, ``"q8_0"`` or ``"q4_0"``.

    Raises:
        FileNotFoundError (``ferrum.NoSuchFile``): the model does not exist.
        ValueError: a bad setting.
    """

    def __init__(
        self,
        model: Optional[Union[str, "os.PathLike[str]"]] = None,
        n_threads: Optional[int] = None,
        ctx_size: int = 4096,
        max_num_seqs: int = 16,
        max_num_batched_tokens: int = 512,
        kv_cache_memory: Optional[int] = None,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        kv_cache_dtype: str = "f16",
    ) -> None:
        path = os.fspath(model) if model is not None else _default_model()
        self._engine = _Engine(
            path,
            n_threads,
            ctx_size,
            max_num_seqs,
            max_num_batched_tokens,
            kv_cache_memory,
            block_size,
            enable_prefix_caching,
            kv_cache_dtype,
        )
        self.model = path

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer."""
        return self._engine.tokenizer

    def get_tokenizer(self) -> Tokenizer:
        """The model's tokenizer (vLLM's accessor)."""
        return self._engine.tokenizer

    @property
    def name(self) -> str:
        """The model's name (GGUF ``general.name`` or the file name)."""
        return self._engine.name

    @property
    def ctx_size(self) -> int:
        """Most tokens (prompt + completion) of one request."""
        return self._engine.ctx_size

    def _prompt_ids(self, prompt: PromptType) -> List[int]:
        if isinstance(prompt, str):
            return list(self._engine.encode_prompt(prompt))
        if isinstance(prompt, Mapping):
            if "prompt_token_ids" in prompt:
                return [int(t) for t in prompt["prompt_token_ids"]]
            if "prompt" in prompt:
                return list(self._engine.encode_prompt(str(prompt["prompt"])))
        raise TypeError(
            "a prompt is a str, {'prompt': str} or {'prompt_token_ids': [int, ...]}, "
            f"not {type(prompt).__name__}"
        )

    def _run(
        self,
        texts: Sequence[Optional[str]],
        ids: List[List[int]],
        sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]],
    ) -> List[RequestOutput]:
        if sampling_params is None:
            params: List[SamplingParams] = [SamplingParams()] * len(ids)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(ids)
        else:
            params = list(sampling_params)
            if len(params) != len(ids):
                raise ValueError(
                    f"{len(params)} SamplingParams for {len(ids)} prompts: give one, or one per prompt"
                )
        results = self._engine.generate(ids, params)
        outs = []
        for i, (text, prompt_ids, p, comps) in enumerate(zip(texts, ids, params, results)):
            completions = []
            for c in comps:
                lps = None
                cum = None
                if c["logprobs"] is not None:
                    lps = [
                        _logprob_dict(raw, tid)
                        for raw, tid in zip(c["logprobs"], c["token_ids"])
                    ]
                    cum = float(sum(raw[0] for raw in c["logprobs"]))
                completions.append(
                    CompletionOutput(
                        index=c["index"],
                        text=c["text"],
                        token_ids=list(c["token_ids"]),
                        cumulative_logprob=cum,
                        logprobs=lps,
                        finish_reason=c["finish_reason"],
                    )
                )
            first = comps[0]
            outs.append(
                RequestOutput(
                    request_id=str(i),
                    prompt=text,
                    prompt_token_ids=prompt_ids,
                    outputs=completions,
                    finished=True,
                    num_cached_tokens=first["cached_tokens"],
                    metrics={"time_to_first_token": first["ttft"]},
                )
            )
        return outs

    def generate(
        self,
        prompts: Union[PromptType, Sequence[PromptType]],
        sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
        use_tqdm: bool = False,
    ) -> List[RequestOutput]:
        """Completes every prompt, all in one continuous batch; returns one output per prompt.

        Args:
            prompts: a prompt or a list of them: raw text (tokenized as the server's completions
                endpoint does: BOS as the model wants it, special-token text not parsed), or
                ``{"prompt_token_ids": [...]}``.
            sampling_params: one for all prompts, or one per prompt (default:
                ``SamplingParams()``, vLLM's defaults).
            use_tqdm: accepted for vLLM compatibility (no progress bar).

        Raises:
            ValueError (``ferrum.InvalidArgument``): an empty prompt, a token outside the
                vocabulary, or prompt + ``max_tokens`` beyond ``ctx_size``.
        """
        del use_tqdm
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        plist = list(prompts)
        ids = [self._prompt_ids(p) for p in plist]
        texts = [
            p if isinstance(p, str) else (p.get("prompt") if isinstance(p, Mapping) else None)
            for p in plist
        ]
        return self._run(texts, ids, sampling_params)

    def render_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        chat_template_kwargs: Optional[Mapping[str, Any]] = None,
        tools: Optional[Sequence[Mapping[str, Any]]] = None,
    ) -> str:
        """The prompt text the model's chat template makes of ``messages``, as the server's chat
        endpoint renders it (roles checked, ``developer`` taken as ``system``, text parts joined).
        """
        return self._engine.render_chat(
            json.dumps(list(messages)),
            add_generation_prompt,
            json.dumps(list(tools)) if tools is not None else None,
            json.dumps(dict(chat_template_kwargs)) if chat_template_kwargs is not None else None,
        )

    def chat(
        self,
        messages: Union[Sequence[Message], Sequence[Sequence[Message]]],
        sampling_params: Optional[Union[SamplingParams, Sequence[SamplingParams]]] = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        chat_template_kwargs: Optional[Mapping[str, Any]] = None,
        tools: Optional[Sequence[Mapping[str, Any]]] = None,
    ) -> List[RequestOutput]:
        """Replies to a conversation (a list of ``{"role", "content"}`` dicts), or to each of a
        list of conversations (one batch), through the model's chat template.

        The prompt is rendered and tokenized exactly as ``ferrum serve``'s
        ``/v1/chat/completions`` does; ``RequestOutput.prompt`` holds the rendered text.
        """
        del use_tqdm
        msgs = list(messages)
        batch: List[Sequence[Message]]
        if msgs and isinstance(msgs[0], Mapping):
            batch = [msgs]  # type: ignore[list-item]
        else:
            batch = msgs  # type: ignore[assignment]
        texts = [
            self.render_chat(conv, add_generation_prompt, chat_template_kwargs, tools)
            for conv in batch
        ]
        ids = [list(self._engine.encode_chat(t)) for t in texts]
        return self._run(texts, ids, sampling_params)

    def stream(
        self,
        prompt: PromptType,
        sampling_params: Optional[SamplingParams] = None,
    ) -> Iterator[StreamChunk]:
        """Generates one prompt, yielding a ``StreamChunk`` per token as the engine draws it
        (other requests may share its batch); the last chunk has ``finish_reason`` set.
        Leaving the loop early cancels the request.
        """
        params = sampling_params if sampling_params is not None else SamplingParams()
        stream = self._engine.stream(self._prompt_ids(prompt), params)
        want = params.logprobs is not None
        try:
            for ev in stream:
                if ev[0] == "token":
                    _, text, tid, raw = ev
                    lps = None
                    if want and raw is not None and tid is not None:
                        lps = [_logprob_dict(self._engine._logprobs_of(raw), tid)]
                    yield StreamChunk(
                        text=text, token_ids=[tid] if tid is not None else [], logprobs=lps
                    )
                else:
                    yield StreamChunk(text="", token_ids=[], finish_reason=ev[1])
                    return
        finally:
            stream.close()

    def stats(self) -> Dict[str, int]:
        """The engine's counters: requests running and waiting, prompt and generated tokens."""
        return dict(self._engine.stats())

    def shutdown(self) -> None:
        """Stops the engine thread (after the requests it holds); the LLM is unusable after."""
        self._engine.shutdown()

    def __repr__(self) -> str:
        return f"LLM(model={self.model!r}, ctx_size={self.ctx_size})"
