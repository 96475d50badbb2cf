"""Inference engines: token ids in; token ids, behaviour logprobs and versions out.

:mod:`tapioca.engines.base` is the one interface. In-process backends:
:class:`PagedEngine` (paged KV cache, shared prompts, CUDA-graph decode; Qwen2 / Qwen3 /
Llama; docs/engine.md) and :class:`TorchEngine` (any transformers causal LM, through
its own forward; the fallback).
:class:`VLLMEngine` and :class:`SGLangEngine` drive inference servers over HTTP (imported
from their modules: ``tapioca.engines.vllm_engine`` / ``tapioca.engines.sglang_engine``).
"""

from .base import GenRequest, GenResult, InferenceEngine, SamplingParams
from .paged_engine import PagedEngine
from .torch_engine import TorchEngine

__all__ = ["GenRequest", "GenResult", "InferenceEngine", "PagedEngine", "SamplingParams", "TorchEngine"]
