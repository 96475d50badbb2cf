"""The one inference-engine interface of Tapioca.

Consumes generation requests (token ids in) and emits generation results (token ids,
behaviour logprobs and per-token policy versions out). Rollout workers and the agent
proxy drive an engine through this interface only; backends are the in-process
PyTorch engine (:mod:`tapioca.engines.torch_engine`) and HTTP adapters for vLLM /
SGLang servers (:mod:`tapioca.engines.vllm_engine`, :mod:`tapioca.engines.sglang_engine`).
Results are keyed by the caller's ``request_id``.

Behaviour-logprob convention (every backend must follow it):
    ``output_logprobs[t]`` is the log-probability of the sampled token ``output_ids[t]``
    under ``softmax(logits / temperature)`` over the FULL vocabulary, computed in fp32
    from the logits of the weights that produced the token. Top-p / top-k filtering
    changes which tokens can be drawn but is NOT renormalised into the logprob, so the
    number is exactly what the trainer recomputes with the same temperature
    (:func:`tapioca.algorithms.logprobs`). For greedy decoding (``temperature == 0``)
    the logprob is taken at temperature 1.

Policy versions: ``output_versions[t]`` is the version of the weights whose forward
pass produced the logits ``output_ids[t]`` was sampled from
(docs/design.md#3-policy-versions-and-the-staleness-window). With
interruptible generation a sequence may span versions (``0, 0, 1, 1, ...``); the KV
cache of earlier tokens is kept, nothing is recomputed (as in AReaL).
"""

from __future__ import annotations

import abc
import concurrent.futures
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping, Sequence, Union

import torch

from ..models.lora import LoraAdapter
from ..schemas.errors import ConfigError, EngineError

FinishReason = Literal["stop", "length", "abort"]
Decode = Callable[[list[int]], str]
WeightsSource = Union[Mapping[str, torch.Tensor], str, os.PathLike]


@dataclass
class SamplingParams:
    """How to sample one completion.

    ``temperature == 0`` means greedy (argmax). ``top_k == 0`` and ``top_p == 1`` turn
    those filters off; when both are set, top-k is applied first and top-p on the
    renormalised top-k distribution (the HF / vLLM order). Generation stops at the
    first of: a token in ``stop_token_ids`` (or the engine's EOS), a ``stop_strings``
    match in the decoded output (needs an engine built with ``decode=``), or
    ``max_new_tokens`` tokens. The stop token / the token completing a stop string is
    kept in ``output_ids``.

    ``seed``: the request's sampling seed (0 <= seed < 2**63). The paged engine keys every
    draw of the request by (seed, position of the token sampled), so the same seed, prompt
    and weights give the same tokens whatever the request is batched with (up to the
    logits themselves, docs/provenance.md); None: the engine draws one and reports it on
    :attr:`GenResult.seed`. Engines that cannot key draws per request ignore it
    (TorchEngine, servers) and report None.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        self.stop_strings = tuple(self.stop_strings)
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ConfigError(f"temperature={self.temperature}: use a finite value >= 0 (0 = greedy)")
        if not (0 < self.top_p <= 1):
            raise ConfigError(f"top_p={self.top_p}: use a value in (0, 1] (1 = off)")
        if self.top_k < 0:
            raise ConfigError(f"top_k={self.top_k}: use an integer >= 0 (0 = off)")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens}: use an integer >= 1")
        if any(not s for s in self.stop_strings):
            raise ConfigError("stop_strings contains an empty string; remove it")
        if self.seed is not None and not (isinstance(self.seed, int) and 0 <= self.seed < 2**63):
            raise ConfigError(f"seed={self.seed!r}: use an integer in [0, 2**63) or None (the engine draws one)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filtered(self) -> bool:
        """Sampling from a top-p / top-k nucleus (greedy ignores both)."""
        return self.temperature > 0 and (self.top_p < 1 or self.top_k > 0)

    def with_overrides(self, overrides: Mapping[str, Any] | None) -> "SamplingParams":
        """These settings with a prompt's own (``PromptEvent.sampling``: temperature, top_p,
        top_k, max_new_tokens, stop_token_ids, stop_strings; other keys ignored)."""
        if not overrides:
            return self
        keys = ("temperature", "top_p", "top_k", "max_new_tokens", "stop_token_ids", "stop_strings")
        base = {k: getattr(self, k) for k in keys}
        base.update({k: v for k, v in overrides.items() if k in base})
        return SamplingParams(**base, seed=self.seed)

    @classmethod
    def from_generation(cls, gconfig: Any) -> "SamplingParams":
        """A run's sampling defaults from its ``gconfig`` section (the rollout workers'
        and the agent proxy's)."""
        g = gconfig
        return cls(temperature=g.temperature, top_p=g.top_p, top_k=g.top_k,
                   max_new_tokens=g.max_new_tokens, stop_strings=tuple(g.stop))


@dataclass
class RequestImages:
    """The images of a request's prompt, in the order of their placeholders
    (models/vision.py): ``pixel_values`` ``[patches, C*T*p*p]`` and ``grid_thw`` as the
    model's image processor made them from the bytes (None for an engine that sends the
    bytes instead: ``blobs``, ``(mime, bytes)`` each, for an inference server), and each
    image's ``sha256`` (the prefix cache and the servers key images by it)."""

    sha256: list[str]
    grid_thw: list[tuple[int, int, int]]
    pixel_values: torch.Tensor | None = None
    blobs: list[tuple[str, bytes]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.sha256)


@dataclass
class GenRequest:
    """One completion to generate from ``prompt_ids`` (and its ``images``, if any: their
    placeholder tokens are in ``prompt_ids``, expanded)."""

    request_id: str
    prompt_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    images: RequestImages | None = None


@dataclass
class GenResult:
    """One finished (or aborted) completion.

    ``output_ids``, ``output_logprobs`` and ``output_versions`` have equal lengths.
    ``timings``: ``queued_s`` (submit -> admitted into a batch) and ``generate_s``
    (admitted -> finished), in seconds. ``routed_experts``: with an engine recording
    routes (MoE models), the expert ids of every token it fed (prompt + output but the
    last sampled token) in every MoE layer, an integer array ``[tokens, MoE layers,
    top_k]``; None otherwise. ``seed``: the sampling seed the request was drawn with (an
    engine that keys draws per request, the paged engine; None otherwise).
    """

    request_id: str
    prompt_ids: list[int]
    output_ids: list[int]
    output_logprobs: list[float]
    output_versions: list[int]
    finish_reason: FinishReason
    timings: dict[str, float] = field(default_factory=dict)
    routed_experts: Any = None
    seed: int | None = None


class InferenceEngine(abc.ABC):
    """Token ids in, token ids + behaviour logprobs + versions out.

    Thread-safety: every method may be called from any thread. ``update_weights`` is
    applied between two decode steps; tokens sampled after it returns carry the new
    version.
    """

    @abc.abstractmethod
    def submit(self, request: GenRequest) -> concurrent.futures.Future[GenResult]:
        """Queue ``request``; the future resolves when it finishes (or is aborted)."""

    def submit_all(self, requests: Sequence[GenRequest]) -> list[concurrent.futures.Future[GenResult]]:
        """Queue ``requests`` together; futures in order. An engine may treat them as one
        unit (the paged engine prefills the shared prompt of a group's samples once)."""
        return [self.submit(r) for r in requests]

    def generate(self, requests: Sequence[GenRequest]) -> list[GenResult]:
        """Generate all ``requests`` (batched by the engine); blocks; results in order.

        Blocks while the engine is paused.
        """
        futures = [self.submit(r) for r in requests]
        return [f.result() for f in futures]

    def validate(self, request: GenRequest) -> None:
        """Raise EngineError if ``request`` could never be generated (empty or too long
        prompt, unknown token ids); lets callers reject it before queueing it."""

    @abc.abstractmethod
    def pause(self) -> None:
        """Stop decoding at the next step boundary (returns once no step is running)."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Continue decoding after :meth:`pause`."""

    @abc.abstractmethod
    def update_weights(self, weights: WeightsSource, version: int) -> None:
        """Load ``weights`` (a state dict, or a path to a safetensors file) as ``version``.

        Blocks until the new weights are in place. Checksum verification of files is
        the caller's job.
        """

    def update_adapter(self, adapter: LoraAdapter, version: int) -> None:
        """Serve LoRA ``adapter`` on the engine's base weights as ``version`` (like
        :meth:`update_weights`: at a step boundary; blocks until in place). An adapter the
        engine cannot serve raises EngineError before anything changes."""
        raise EngineError(f"{type(self).__name__} does not serve LoRA adapters; use the paged or "
                          "torch engine, or a vLLM / SGLang server")

    @property
    @abc.abstractmethod
    def version(self) -> int:
        """The policy version of the weights in use."""

    def describe(self) -> dict[str, float]:
        """Numbers about the engine's health for the role's status on ``fleet.v1`` (e.g.
        a server engine's ``servers_up`` / ``servers_down``); empty by default."""
        return {}

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Abort queued and in-flight requests (finish_reason "abort") and stop."""

    def __enter__(self) -> "InferenceEngine":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
