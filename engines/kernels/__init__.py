"""The paged engine's ops behind one dispatcher API (docs/engine.md, "Ops").

STAND-IN written by the `engine` helper until the `kernels` helper's package lands:
every function is the plain-PyTorch reference (:mod:`.reference`), on CPU and CUDA.
Their package (reference + Triton, picked per call, ``TAPIOCA_KERNELS``) replaces this
file with the same signatures; the engine calls nothing else.
"""

from tapioca.engines.kernels.reference import (
    paged_decode_attention,
    paged_prefill_attention,
    rms_norm,
    rope_and_store_kv,
    sample_tokens,
    silu_and_mul,
)

__all__ = ["paged_decode_attention", "paged_prefill_attention", "rms_norm", "rope_and_store_kv",
           "sample_tokens", "silu_and_mul"]
