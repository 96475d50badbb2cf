"""FlashAttention-4 (the flash-attn project's CuTe-DSL kernels) as a packed varlen backend.

Consumes packed ``q_NHD`` / ``k_KKD`` / ``v_KKD`` with ``cu_seqlens`` for queries and
keys (the same layout as ``torch.nn.attention.varlen``); emits ``out_NHD``, causal per
sequence (bottom-right aligned when a sequence has more keys than queries, as in
FA2). Keyed by nothing.

Optional: ``pip install flash-attn-4`` (imports as ``flash_attn.cute``; needs
``nvidia-cutlass-dsl``) on a Hopper or Blackwell GPU, bf16 / fp16. Nothing here is
imported until a trainer asks for ``actor.attention_backend: fa4`` or ``auto``
(importing the CuTe DSL takes seconds). On H200, fwd + bwd per layer measured 1.6-2.1x
``torch.nn.attention.varlen`` (FA2) at the 0.5B-3B shapes (issue 28); the whole trainer
step 1.04-1.07x (``benchmarks/trainer_step.py --only fa4``): attention is ~14 % of it.
"""

from __future__ import annotations

import functools

import torch

_fa4_varlen_func = None  # flash_attn.cute.flash_attn_varlen_func once loaded


@functools.lru_cache(maxsize=1)
def fa4_import_error() -> str:
    """Why FA4 cannot be imported here ("" when it can; the import is tried once)."""
    global _fa4_varlen_func
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception as exc:  # ImportError, or the CuTe DSL failing to load its libraries
        return f"{type(exc).__name__}: {exc}"
    _fa4_varlen_func = flash_attn_varlen_func
    return ""


def fa4_available(device: torch.device | str, dtype: torch.dtype) -> bool:
    """FA4 can run here: CUDA, compute capability 9.x or 10.x, bf16 / fp16, importable."""
    device = torch.device(device)
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16) or not torch.cuda.is_available():
        return False
    if torch.cuda.get_device_capability(device)[0] not in (9, 10):
        return False
    return not fa4_import_error()


def fa4_varlen(q_NHD: torch.Tensor, k_KKD: torch.Tensor, v_KKD: torch.Tensor, cu_q_S1: torch.Tensor,
               cu_k_S1: torch.Tensor, max_q: int, max_k: int, scale: float) -> torch.Tensor:
    """Causal varlen attention through FA4 (grouped-query K/V as they are)."""
    if _fa4_varlen_func is None and fa4_import_error():
        from ..schemas.errors import ConfigError

        raise ConfigError(f"attention_backend=fa4: flash_attn.cute does not import ({fa4_import_error()}); "
                          "pip install flash-attn-4, or use attention_backend=varlen / sdpa / auto")
    out = _fa4_varlen_func(q_NHD.contiguous(), k_KKD.contiguous(), v_KKD.contiguous(), cu_seqlens_q=cu_q_S1,
                           cu_seqlens_k=cu_k_S1, max_seqlen_q=max_q, max_seqlen_k=max_k,
                           softmax_scale=scale, causal=True)
    return out[0] if isinstance(out, tuple) else out  # some versions return (out, lse)
