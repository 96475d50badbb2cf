"""Aggregation of a per-token loss into one scalar.

Consumes a per-token loss ``loss_BT`` and a mask ``mask_BT`` (bool or 0/1; True =
the token counts), emits a scalar tensor differentiable in ``loss_BT``. Modes use
verl's / AReaL's names (``loss_agg_mode``):

* ``"token-mean"``: sum over unmasked tokens / number of unmasked tokens
  (DAPO's token-level loss). ``0`` when no token is unmasked.
* ``"seq-mean-token-sum"``: per sequence, sum over its unmasked tokens; then the
  mean over sequences.
* ``"seq-mean-token-mean"``: per sequence, mean over its unmasked tokens; then the
  mean over sequences (original GRPO).
* ``"seq-mean-token-sum-norm"``: per sequence, sum over its unmasked tokens
  divided by the constant ``max_tokens`` (the generation budget); then the mean
  over sequences (Dr. GRPO). ``max_tokens`` is required: defaulting it to ``T``
  would silently change the loss scale with each batch's padding.

Tapioca's conventions (peers differ):

* The "mean over sequences" counts only sequences with at least one unmasked
  token: a fully masked row is padding, not a sample, so it must not dilute the
  loss. It contributes exactly 0 (never NaN) and gets a zero gradient.
* Masked positions are selected away with ``torch.where``, not multiplied by 0,
  so a NaN/inf sitting in a masked position (e.g. padding) cannot leak into the
  loss or its gradient.
* Denominators are over this call's tensor only. A trainer that splits a batch
  into micro-batches scales each micro-batch's loss by
  ``agg_units(mask_mb, mode) / agg_units(mask_batch, mode)`` (tokens for
  ``token-mean``, non-empty sequences for the ``seq-mean-*`` modes, which never
  split a sequence): the summed gradients then equal the gradient of the
  full-batch aggregated loss.

Peers: verl's ``seq-mean-token-sum-norm`` divides by ``loss_scale_factor``
(default: the padded response length of the batch, which moves with padding);
AReaL's ``loss_aggregation`` names ``token_mean`` (= ``token-mean``),
``seq_mean`` (= ``seq-mean-token-mean``) and ``constant`` with a ``divisor``
(= ``seq-mean-token-sum-norm`` with ``max_tokens = divisor``).
"""

from __future__ import annotations

import torch

from .errors import AlgorithmInputError

#: Valid values of ``aggregate_loss(mode=...)``.
AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)


def aggregate_loss(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str = "token-mean",
    *,
    max_tokens: int | None = None,
) -> torch.Tensor:
    """Aggregate a ``[B, T]`` per-token loss into a scalar according to ``mode``."""
    if mode not in AGG_MODES:
        raise AlgorithmInputError(
            f"aggregate_loss: unknown mode {mode!r}; use one of {', '.join(AGG_MODES)}."
        )
    if loss_BT.dim() != 2 or loss_BT.shape != mask_BT.shape:
        raise AlgorithmInputError(
            f"aggregate_loss: need loss and mask of the same [B, T] shape, got "
            f"{tuple(loss_BT.shape)} and {tuple(mask_BT.shape)}."
        )
    if mode == "seq-mean-token-sum-norm" and (max_tokens is None or max_tokens <= 0):
        raise AlgorithmInputError(
            "aggregate_loss: mode 'seq-mean-token-sum-norm' needs max_tokens > 0 "
            "(the constant generation budget, e.g. max_new_tokens)."
        )
    mask = mask_BT.bool()
    masked = torch.where(mask, loss_BT, torch.zeros_like(loss_BT))
    # clamp(min=1) turns 0/0 into 0/1 = 0 for empty masks (no NaN, zero grad).
    if mode == "token-mean":
        return masked.sum() / mask.sum().clamp(min=1).to(masked.dtype)

    tokens_B = mask.sum(dim=-1)
    seq_sum_B = masked.sum(dim=-1)
    if mode == "seq-mean-token-sum":
        seq_loss_B = seq_sum_B
    elif mode == "seq-mean-token-mean":
        seq_loss_B = seq_sum_B / tokens_B.clamp(min=1).to(masked.dtype)
    else:  # seq-mean-token-sum-norm
        seq_loss_B = seq_sum_B / float(max_tokens)
    n_seqs = (tokens_B > 0).sum().clamp(min=1).to(masked.dtype)
    # Empty rows have seq_loss 0 already; they are only excluded from n_seqs.
    return seq_loss_B.sum() / n_seqs


def agg_units(mask_BT: torch.Tensor, mode: str = "token-mean") -> int:
    """What ``mode`` averages over in ``mask_BT``: unmasked tokens for ``token-mean``,
    sequences with at least one unmasked token otherwise (a host sync)."""
    if mode not in AGG_MODES:
        raise AlgorithmInputError(
            f"agg_units: unknown mode {mode!r}; use one of {', '.join(AGG_MODES)}."
        )
    mask = mask_BT.bool()
    if mode == "token-mean":
        return int(mask.sum())
    return int((mask.sum(dim=-1) > 0).sum())
