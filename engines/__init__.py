"""Inference engines: token ids in; token ids, behaviour logprobs and versions out.

:mod:`tapioca.engines.base` is the one interface; :class:`TorchEngine` the in-process
PyTorch backend (the embedded default, CPU and GPU); :class:`VLLMEngine` and
:class:`SGLangEngine` drive inference servers over HTTP (imported from their modules:
``tapioca.engines.vllm_engine`` / ``tapioca.engines.sglang_engine``).
"""

from tapioca.engines.base import GenRequest, GenResult, InferenceEngine, SamplingParams
from tapioca.engines.torch_engine import TorchEngine

__all__ = ["GenRequest", "GenResult", "InferenceEngine", "SamplingParams", "TorchEngine"]
