"""AReaL's decoupled PPO actor loss.

Consumes, per token and all of one shape (usually ``[B, T]``):

* ``logprobs``: log pi_theta of the sampled tokens (the only input that gets a
  gradient),
* ``prox_logprobs``: log pi_prox, the proximal policy (the weights before this
  update, recomputed by the trainer or approximated),
* ``behav_logprobs``: log pi_behav, recorded by the rollout that sampled them,
* ``advantages`` and a loss ``mask`` (bool or 0/1; True = the token is trained).

Emits a scalar loss (aggregated by ``tapioca.algorithms.aggregation``) and a dict
of float statistics for metrics.

The loss per token (AReaL, "Decoupled PPO", arXiv:2505.24298)::

    r      = exp(logp - prox_logp)                   # trust region vs pi_prox
    pg     = max(-A * r, -A * clip(r, 1 - eps_clip, 1 + eps_clip_higher))
    pg     = min(pg, -A * c_clip)            if c_clip and A < 0   # dual clip
    w      = exp(prox_logp - behav_logp)             # detached off-policy weight
    loss_t = w * pg

Tapioca's conventions (peers differ; each has a golden test):

* **Behaviour-weight cap**: with ``behav_imp_weight_cap`` set, tokens with
  ``w > cap`` get loss 0 but stay in the aggregation denominator (AReaL's
  choice), so the loss scale does not move with how many tokens the cap drops.
  ``behav_capped_ratio`` reports how many were dropped.
* **Log-ratio clamp**: both log-ratios are clamped to ``[-20, 20]`` (verl's
  bound) before ``exp``, so extreme or garbage log-probs give finite losses and
  gradients instead of inf/NaN. A token beyond the bound is far outside any trust
  region; the clamp only zeroes a gradient that would otherwise be inf.
* **Masked positions** are selected away with ``torch.where`` before any
  arithmetic, so padding values (even NaN/inf) never reach the loss or grads.
* **Statistics** are over unmasked tokens: ``clip_ratio`` counts tokens whose
  clipped term is strictly the active one (``-A*clip(r) > -A*r``, AReaL's
  definition); ``dual_clip_ratio`` counts tokens where the dual clip is strictly
  active (those have ``-A*r > -A*clip(r)``, so the two sets are disjoint);
  ``importance_weight_*`` describe ``w`` before the
  cap; ``approx_kl`` is the mean of ``logp - prox_logp`` (k1 of pi_theta vs
  pi_prox, unclamped). All are 0.0 when no token is unmasked.
"""

from __future__ import annotations

import math

import torch

from tapioca.algorithms.aggregation import aggregate_loss
from tapioca.algorithms.errors import AlgorithmInputError

#: Bound on |log-ratio| before exp (verl uses the same): e^20 ~ 4.9e8.
LOG_RATIO_CLAMP = 20.0


def decoupled_ppo_loss(
    logprobs_BT: torch.Tensor,
    prox_logprobs_BT: torch.Tensor,
    behav_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    behav_imp_weight_cap: float | None = None,
    agg_mode: str = "token-mean",
    max_tokens: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO loss and its statistics; see the module docstring.

    ``eps_clip_higher`` (DAPO's clip-higher) defaults to ``eps_clip``. ``c_clip``
    must be > 1. ``max_tokens`` is passed to ``aggregate_loss`` (needed only by
    ``"seq-mean-token-sum-norm"``).
    """
    shape = logprobs_BT.shape
    for name, t in (
        ("prox_logprobs", prox_logprobs_BT),
        ("behav_logprobs", behav_logprobs_BT),
        ("advantages", advantages_BT),
        ("mask", mask_BT),
    ):
        if t.shape != shape:
            raise AlgorithmInputError(
                f"decoupled_ppo_loss: {name} has shape {tuple(t.shape)}, logprobs has {tuple(shape)}; "
                "all per-token inputs must have the same shape."
            )
    if not 0.0 < eps_clip < 1.0:
        raise AlgorithmInputError(f"decoupled_ppo_loss: eps_clip={eps_clip!r} must be in (0, 1).")
    eps_high = eps_clip if eps_clip_higher is None else eps_clip_higher
    if not eps_high > 0.0:
        raise AlgorithmInputError(f"decoupled_ppo_loss: eps_clip_higher={eps_clip_higher!r} must be > 0.")
    if c_clip is not None and not c_clip > 1.0:
        raise AlgorithmInputError(f"decoupled_ppo_loss: c_clip={c_clip!r} must be > 1 (or None to disable).")
    if behav_imp_weight_cap is not None and not behav_imp_weight_cap > 0.0:
        raise AlgorithmInputError(
            f"decoupled_ppo_loss: behav_imp_weight_cap={behav_imp_weight_cap!r} must be > 0 (or None)."
        )

    mask = mask_BT.bool()
    zeros = torch.zeros_like(logprobs_BT)
    prox = prox_logprobs_BT.detach()
    adv = torch.where(mask, advantages_BT.detach(), zeros)

    # Trust-region ratio pi_theta / pi_prox.
    log_ratio = torch.where(mask, logprobs_BT - prox, zeros)
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    clipped_ratio = ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    pg1 = -adv * ratio
    pg2 = -adv * clipped_ratio
    clip_mask = (pg1.detach() < pg2.detach()) & mask
    pg = torch.maximum(pg1, pg2)

    if c_clip is not None:
        # Dual clip (Ye et al. 2020): for A < 0 the unclipped -A*r grows without
        # bound in r; cap it at -A*c_clip.
        pg3 = -adv * c_clip
        neg = adv < 0
        dual_clip_mask = neg & (pg3 < pg.detach()) & mask
        pg = torch.where(neg, torch.minimum(pg, pg3), pg)
    else:
        dual_clip_mask = torch.zeros_like(mask)

    # Off-policy correction pi_prox / pi_behav: a constant weight, no gradient.
    log_w = torch.where(mask, prox - behav_logprobs_BT.detach(), zeros)
    w = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    keep = mask
    if behav_imp_weight_cap is not None:
        # Compare in log space so the decision does not depend on the clamp.
        keep = mask & (log_w <= math.log(behav_imp_weight_cap))
    loss_BT = torch.where(keep, pg * w, zeros)

    # Denominator: the loss mask, not `keep` (capped tokens count as zero loss).
    loss = aggregate_loss(loss_BT, mask, agg_mode, max_tokens=max_tokens)

    with torch.no_grad():
        n = mask.sum().clamp(min=1).to(torch.float64)
        w_valid = torch.where(mask, w, zeros)
        stats_t = torch.stack(
            [
                clip_mask.sum() / n,
                dual_clip_mask.sum() / n,
                w_valid.sum().double() / n,
                # w > 0 and masked entries are 0, so the max over all is the
                # max over unmasked tokens (0 when none); no host sync needed.
                w_valid.max().double() if w_valid.numel() else n.new_zeros(()),
                (mask & ~keep).sum() / n,
                torch.where(mask, logprobs_BT.detach() - prox, zeros).sum().double() / n,
                torch.where(mask, ratio.detach(), zeros).sum().double() / n,
            ]
        )
    # One device->host copy for all statistics.
    values = stats_t.tolist()
    names = (
        "clip_ratio",
        "dual_clip_ratio",
        "importance_weight_mean",
        "importance_weight_max",
        "behav_capped_ratio",
        "approx_kl",
        "ratio_mean",
    )
    return loss, dict(zip(names, values))
