"""Decode attention for grouped-query models without materialising repeated KV heads.

Consumes what a ``transformers`` attention layer hands its attention function (query
``[B, Hq, Q, D]``, the cache's keys / values ``[B, Hkv, K, D]``, the engine's 4-D bool
mask); emits the attention output ``[B, Q, Hq, D]``. Used by :class:`TorchEngine` only.

Why: with a padding mask, transformers' ``sdpa`` path (5.17 on the GPU box) runs
``repeat_kv`` -- copying every layer's whole KV cache ``Hq / Hkv`` times per decode
step -- because SDPA's ``enable_gqa`` used to fall back to the math kernel with a mask.
On an H200 with PyTorch 2.11 it does not: for Qwen2-0.5B's decode shape (256 rows, 14
query / 2 KV heads, 256 keys out of a larger cache buffer) one layer call took 339 us
with ``repeat_kv`` and 82 us with ``enable_gqa`` (benchmarks/gqa_attention.py); in the
engine the copies were 41 % of its GPU kernel time. Newer transformers (5.24) avoid
them for one query token themselves. Prefill (Q > 1) and anything unusual go to
transformers' own ``sdpa`` function.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "tapioca_decode_sdpa"


def decode_sdpa_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                        value: torch.Tensor, attention_mask: torch.Tensor | None,
                        dropout: float = 0.0, scaling: float | None = None,
                        is_causal: bool | None = None, **kwargs):
    groups = getattr(module, "num_key_value_groups", 1)
    plain = (query.shape[2] == 1 and groups > 1 and dropout == 0.0
             and kwargs.get("position_bias") is None and kwargs.get("softcap") is None
             and (attention_mask is None or attention_mask.dtype == torch.bool))
    if not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, is_causal=is_causal, **kwargs)
    out_BHQD = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True)
    return out_BHQD.transpose(1, 2).contiguous(), None


def use_decode_attention(model: torch.nn.Module) -> bool:
    """Switch an ``sdpa`` grouped-query model to :func:`decode_sdpa_forward` (True, also
    when it already uses it); False (and no change) for other attention
    implementations or models without GQA."""
    config = model.config
    impl = getattr(config, "_attn_implementation", None)
    if impl == NAME:
        return True
    heads = getattr(config, "num_attention_heads", 0)
    kv_heads = getattr(config, "num_key_value_heads", heads) or heads
    if impl != "sdpa" or kv_heads >= heads:
        return False
    AttentionInterface.register(NAME, decode_sdpa_forward)
    model.set_attn_implementation(NAME)
    return True
