"""The paged engine's fused ops: one API, Triton on CUDA, plain PyTorch elsewhere.

Consumes activations, the paged KV cache and per-forward metadata from the engine's model
runner; emits activations, attention outputs and sampled tokens. Each public function
picks the Triton kernel when its tensors are on CUDA and Triton imports, else the
reference (:mod:`tapioca.engines.kernels.reference`). ``TAPIOCA_KERNELS=reference`` or
``=triton`` forces one (tests run ``triton`` on CPU tensors under ``TRITON_INTERPRET=1``).

Layout (shared with the engine, /work/tools/ENGINE_SPEC.md): per layer ``k_cache`` /
``v_cache`` ``[num_blocks, block_size, num_kv_heads, head_dim]`` in the model dtype; a
token's slot is ``block * block_size + offset``, slot -1 = do not write;
``block_tables`` int32 ``[rows, max_blocks]`` padded with 0 (never read past the
context); ``context_lens`` int32 = tokens in the cache including this forward's. Padding
rows of a captured graph have context 0 and slot -1 and produce zeros. ``T`` = packed
tokens of a forward, ``H`` query heads, ``K`` KV heads, ``D`` head dim.

MoE layers: :func:`moe_route` (top-k routing) and :func:`fused_moe` (the experts).

Every op is CUDA-graph safe on both paths except :func:`paged_prefill_attention`, whose
reference reads the lengths on the host (prefill is never captured).
"""

from __future__ import annotations

import importlib
import os
import warnings
from types import ModuleType

import torch

from ...schemas.errors import ConfigError
from . import reference

__all__ = [
    "rms_norm", "rope_and_store_kv", "paged_decode_attention", "paged_prefill_attention",
    "silu_and_mul", "sample_tokens", "moe_route", "fused_moe", "backend",
]

_ENV = "TAPIOCA_KERNELS"
_MODULES = {
    "norm_act": "tapioca.engines.kernels.triton_norm_act",
    "rope": "tapioca.engines.kernels.triton_rope",
    "attention": "tapioca.engines.kernels.triton_attention",
    "sampling": "tapioca.engines.kernels.triton_sampling",
    "moe": "tapioca.engines.kernels.triton_moe",
}
_loaded: dict[str, ModuleType | None] = {}
_warned: list[str] = []


def _triton_module(family: str, required: bool) -> ModuleType | None:
    """The Triton module of an op family, or None when Triton does not import."""
    if family not in _loaded:
        try:
            _loaded[family] = importlib.import_module(_MODULES[family])
        except ImportError as exc:
            if required:
                raise ConfigError(
                    f"{_ENV}=triton but the Triton kernels do not import ({exc}): "
                    f"pip install triton, or unset {_ENV}") from exc
            _loaded[family] = None
    if _loaded[family] is None and required:
        raise ConfigError(f"{_ENV}=triton but Triton is not installed: pip install triton, or unset {_ENV}")
    return _loaded[family]


def backend(family: str, tensor: torch.Tensor) -> ModuleType:
    """The module that runs ``family``'s ops on ``tensor``: a ``triton_*`` one or ``reference``."""
    mode = os.environ.get(_ENV, "auto").strip().lower() or "auto"
    if mode == "reference":
        return reference
    if mode == "triton":
        return _triton_module(family, required=True)
    if mode != "auto":
        raise ConfigError(f"{_ENV}={mode!r}: use 'reference', 'triton' or leave it unset (auto)")
    if tensor.is_cuda:
        module = _triton_module(family, required=False)
        if module is not None:
            return module
        if not _warned:
            _warned.append(family)
            warnings.warn("Triton does not import: the fused kernels run on their PyTorch reference "
                          "(slow on a GPU); pip install triton", RuntimeWarning, stacklevel=3)
    return reference


def rms_norm(x_TD: torch.Tensor, weight_D: torch.Tensor, eps: float,
             residual_TD: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused residual add + RMSNorm: ``(rmsnorm(x + residual) * weight, x + residual)``.

    ``x_TD`` / ``residual_TD`` ``[..., D]`` (any leading shape: Qwen3's per-head norms pass
    ``[T * H, head_dim]``), ``weight_D`` ``[D]``; outputs in x's dtype. The add is in x's
    dtype; the norm in fp32, cast to x's dtype, then times the weight (HF's order).
    Without a residual returns ``(out, x)``.
    """
    return backend("norm_act", x_TD).rms_norm(x_TD, weight_D, eps, residual_TD)


def rope_and_store_kv(q_THD: torch.Tensor, k_TKD: torch.Tensor, v_TKD: torch.Tensor,
                      positions_T: torch.Tensor, cos_sin_PD: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping_T: torch.Tensor) -> None:
    """Rotary on q and k IN PLACE (HF ``rotate_half``), then k, v into the caches.

    ``q_THD`` ``[T, H, D]``, ``k_TKD`` / ``v_TKD`` ``[T, K, D]`` (strided views of a fused
    qkv output are fine; last dim contiguous); ``positions_T`` int ``[T]``;
    ``cos_sin_PD`` fp32 ``[max_positions, D]`` (``[:, :D/2]`` cos, ``[:, D/2:]`` sin);
    ``slot_mapping_T`` int ``[T]``, -1 = not written.
    """
    backend("rope", q_THD).rope_and_store_kv(q_THD, k_TKD, v_TKD, positions_T, cos_sin_PD,
                                             k_cache, v_cache, slot_mapping_T)


def paged_decode_attention(q_BHD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables_BM: torch.Tensor, context_lens_B: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """One query per row over its cached tokens (GQA, fp32 softmax): ``[B, H, D]``.

    ``block_tables_BM`` int32 ``[B, M]``, ``context_lens_B`` int32 ``[B]`` (0 = padding
    row: zeros out). Output in q's dtype.
    """
    return backend("attention", q_BHD).paged_decode_attention(
        q_BHD, k_cache, v_cache, block_tables_BM, context_lens_B, scale)


def paged_prefill_attention(q_THD: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables_SM: torch.Tensor, cu_seqlens_q_S1: torch.Tensor,
                            context_lens_S: torch.Tensor, scale: float,
                            max_q_len: int) -> torch.Tensor:
    """Packed variable-length causal attention over the cache (a cached prefix included).

    Sequence s owns queries ``cu_seqlens_q_S1[s]:cu_seqlens_q_S1[s+1]`` (int32 ``[S+1]``);
    query i sits at position ``context_lens_S[s] - q_len + i`` and sees every cached
    position <= its own. K/V are read from the cache (store them first with
    :func:`rope_and_store_kv`). ``max_q_len`` host int; returns ``[T, H, D]``.
    """
    return backend("attention", q_THD).paged_prefill_attention(
        q_THD, k_cache, v_cache, block_tables_SM, cu_seqlens_q_S1, context_lens_S, scale, max_q_len)


def silu_and_mul(x_TI2: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :I]) * x[..., I:]`` for the fused gate_up layout; ``[..., I]``."""
    return backend("norm_act", x_TI2).silu_and_mul(x_TI2)


def sample_tokens(logits_BV: torch.Tensor, temperature_B: torch.Tensor, seed: torch.Tensor,
                  offset: int | torch.Tensor = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass per row: Gumbel-max sample of ``softmax(logits / T)`` over the full vocab.

    ``logits_BV`` fp32/bf16 ``[B, V]``; ``temperature_B`` fp32 ``[B]`` (``<= 0`` = greedy,
    logprob at T = 1). The noise is counter-based, keyed one of two ways: ``seed`` int64
    ``[1]`` on the logits' device with ``offset`` a host int (the key is (seed, offset,
    row, vocab index); advance the seed inside the graph each step), or ``seed`` and
    ``offset`` int64 ``[B]`` device tensors (each row keyed by its own (seed, counter) and
    the vocab index, whatever the batch: the paged engine's request seed and token
    position, docs/provenance.md). Returns ``(tokens_B int64, logprobs_B fp32)``,
    ``logprobs_B = log_softmax(logits / T)[token]``. Graph safe and reproducible per
    backend (the reference and Triton draw different streams).
    """
    return backend("sampling", logits_BV).sample_tokens(logits_BV, temperature_B, seed, offset)


def moe_route(logits_TE: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing of an MoE layer: ``(weights_TK fp32, ids_TK int32)`` from the router
    logits ``[T, E]`` (softmax in fp32, the k largest, renormalised to sum 1 when
    ``norm_topk_prob``; HF's Qwen3-MoE router)."""
    return backend("moe", logits_TE).moe_route(logits_TE, top_k, norm_topk_prob)


def fused_moe(x_TH: torch.Tensor, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor,
              weights_TK: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
    """The experts of an MoE layer: ``sum_j weights[t, j] * expert_{ids[t, j]}(x[t])``.

    ``x_TH`` ``[T, H]``; ``w13_E2IH`` ``[E, 2I, H]`` (each expert's gate rows, then its up
    rows), ``w2_EHI`` ``[E, H, I]``; SwiGLU experts; ``weights_TK`` fp32, ``ids_TK`` int
    ``[T, k]``. Returns ``[T, H]`` in x's dtype. Graph safe (Triton: grouped GEMMs over
    pairs laid out by expert; reference: gathered weights on CUDA)."""
    return backend("moe", x_TH).fused_moe(x_TH, w13_E2IH, w2_EHI, weights_TK, ids_TK)
