"""Inference engines: token ids in; token ids, behaviour logprobs and versions out.

:mod:`tapioca.engines.base` is the one interface; :class:`TorchEngine` the in-process
PyTorch backend (the embedded default, CPU and GPU).
"""

from tapioca.engines.base import GenRequest, GenResult, InferenceEngine, SamplingParams
from tapioca.engines.torch_engine import TorchEngine

__all__ = ["GenRequest", "GenResult", "InferenceEngine", "SamplingParams", "TorchEngine"]
