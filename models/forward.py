"""Forward passes of causal LMs that never build ``[B, T, V]`` logits.

Consumes a ``transformers`` causal LM (Qwen2 / Qwen3 / Llama: a decoder body plus an
LM head) and right-padded token batches (``input_ids_BT``, ``attention_mask_BT``,
``labels_BT`` over the ``T-1`` predicting positions, -100 where not scored); emits
per-token log-probabilities (and entropy) of the labels. Every trainer that scores
tokens goes through here: the PPO actor, the frozen reference / teacher, the supervised
trainers (SFT, DPO, distillation); the critic shares :func:`autocast_context`.

The packed (padding-free) variant, :func:`packed_token_logprobs`, takes a
:class:`~tapioca.models.packed.PackedCausalLM` and concatenated sequences, and applies
the LM head only to the rows that predict a scored token.

Model plumbing only: the chunked log-softmax math is
:func:`tapioca.algorithms.logprobs.gather_logprobs_entropy`.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, ContextManager

import torch

from ..algorithms.logprobs import gather_logprobs_entropy

if TYPE_CHECKING:
    from .attention import PackedSeqs


def autocast_context(device: str | torch.device, autocast_dtype: str) -> ContextManager:
    """``torch.autocast`` on ``device``'s type in ``autocast_dtype`` (``bfloat16`` /
    ``float16``); a no-op context when ``autocast_dtype`` is empty (off)."""
    if not autocast_dtype:
        return contextlib.nullcontext()
    return torch.autocast(torch.device(device).type, dtype=getattr(torch, autocast_dtype))


def decoder_body(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack of a causal LM, without its LM head."""
    return model.get_decoder() if hasattr(model, "get_decoder") else model.model


def last_hidden(model: torch.nn.Module, input_ids_BT: torch.Tensor,
                attention_mask_BT: torch.Tensor, images=None) -> torch.Tensor:
    """``hidden_BTH``: the decoder's last hidden states (the LM head is not applied).
    No KV cache: scoring and training never decode further (a config's ``use_cache``
    would otherwise keep every layer's keys and values for nothing). ``images`` (a VL
    model's :class:`~tapioca.trainers.vision_batch.PaddedImages`): the vision tower's
    embeddings replace the placeholders', with 3-D positions (models/vision.py)."""
    if images is not None:
        from .vision import image_features

        embeds_BTH = model.get_input_embeddings()(input_ids_BT)
        feats_ID, deep = image_features(model, images.pixel_values, images.grid_thw)
        mask_BT = images.mask_BT
        embeds_BTH = embeds_BTH.masked_scatter(mask_BT[..., None], feats_ID.to(embeds_BTH.dtype))
        extra = {"visual_pos_masks": mask_BT, "deepstack_visual_embeds": deep} if deep else {}
        return decoder_body(model)(inputs_embeds=embeds_BTH, attention_mask=attention_mask_BT,
                                   position_ids=images.positions_3BT, use_cache=False,
                                   **extra).last_hidden_state
    return decoder_body(model)(input_ids=input_ids_BT, attention_mask=attention_mask_BT,
                               use_cache=False).last_hidden_state


def causal_token_logprobs(
    model: torch.nn.Module,
    input_ids_BT: torch.Tensor,
    attention_mask_BT: torch.Tensor,
    labels_BT: torch.Tensor,
    *,
    temperature: float,
    chunk_tokens: int,
    compute_entropy: bool = False,
    kernel: str = "auto",
    images=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logprobs_BT, entropy_BT)`` of ``labels_BT`` (``[B, T-1]``: position t predicts
    token t+1; 0 where the label is -100) at softmax ``temperature``, chunked over
    ``chunk_tokens`` tokens. ``entropy_BT`` is None unless ``compute_entropy``.
    Differentiable; the caller picks ``no_grad`` and autocast. ``kernel``: see
    :func:`~tapioca.algorithms.logprobs.gather_logprobs_entropy`. ``images``: see
    :func:`last_hidden`."""
    hidden_BTH = last_hidden(model, input_ids_BT, attention_mask_BT, images)
    weight_VH = model.get_output_embeddings().weight
    return gather_logprobs_entropy(
        hidden_BTH[:, :-1], weight_VH, labels_BT, temperature=temperature,
        chunk_tokens=chunk_tokens, compute_entropy=compute_entropy, kernel=kernel,
        matmul_dtype=head_matmul_dtype(weight_VH))


def head_matmul_dtype(weight_VH: torch.Tensor) -> torch.dtype | None:
    """The LM-head matmul dtype outside autocast: a bf16 / fp16 model's own (as its HF
    forward would compute it), else None (autocast's dtype, or fp32)."""
    if torch.is_autocast_enabled(weight_VH.device.type):
        return None
    return weight_VH.dtype if weight_VH.dtype in (torch.bfloat16, torch.float16) else None


def packed_token_logprobs(
    packed: torch.nn.Module,  # a models/packed.py PackedCausalLM (which imports this module)
    input_ids_N: torch.Tensor,
    position_ids_N: torch.Tensor,
    seqs: "PackedSeqs",
    rows_M: torch.Tensor,
    labels_M: torch.Tensor,
    *,
    temperature: float,
    chunk_tokens: int,
    compute_entropy: bool = False,
    kernel: str = "auto",
    keep_logits: bool = False,
    images=None,
    replay_topk_LNK: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logprobs_M, entropy_M)`` of ``labels_M`` predicted at packed positions
    ``rows_M`` (the hidden state of packed token ``rows_M[m]`` scores ``labels_M[m]``).
    Only those ``M`` rows go through the LM head: prompt positions and the last token
    of each sequence cost nothing there. Differentiable; the caller picks ``no_grad``
    and autocast. ``replay_topk_LNK``: routes for the MoE layers (routing replay).
    ``images``: a VL micro-batch's :class:`~tapioca.models.packed.PackedImages`."""
    extra = {k: v for k, v in (("images", images), ("replay_topk_LNK", replay_topk_LNK)) if v is not None}
    hidden_NH = packed(input_ids_N, position_ids_N, seqs, **extra)
    weight_VH = packed.lm_head.weight
    return gather_logprobs_entropy(
        hidden_NH.index_select(0, rows_M), weight_VH, labels_M, temperature=temperature,
        chunk_tokens=chunk_tokens, compute_entropy=compute_entropy, kernel=kernel,
        matmul_dtype=head_matmul_dtype(weight_VH), keep_logits=keep_logits)
