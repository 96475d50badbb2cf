"""AReaL's decoupled PPO actor loss (the default policy loss).

``decoupled_ppo_loss`` is :func:`tapioca.algorithms.policy_losses.policy_loss`
with the PPO surrogate; that module also has GSPO, SAPO, CISPO, M2PO, the
entropy bonus and the pipeline they share, and
:mod:`tapioca.algorithms.rejection_sampling` the behaviour weight, its cap and
``rejection_sampling`` (IcePop, KPop).

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

Config (``actor.*``, AReaL's names): ``eps_clip`` (0.2), ``eps_clip_higher``
(null = ``eps_clip``; DAPO's clip-higher, e.g. 0.28), ``c_clip`` (null = off;
dual clip, > 1), ``behav_imp_weight_cap`` (null = off), ``loss_agg_mode``
(``token-mean``: DAPO's token-level loss).

Tapioca's conventions (peers differ; each has a golden test):

* **Behaviour weight** ``w`` always applies (every rollout is asynchronous);
  AReaL multiplies by it only when ``rejection_sampling`` is set.
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

import torch

from tapioca.algorithms.errors import AlgorithmInputError
from tapioca.algorithms.policy_losses import policy_loss
from tapioca.algorithms.rejection_sampling import LOG_RATIO_CLAMP

__all__ = ["LOG_RATIO_CLAMP", "decoupled_ppo_loss"]


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
    **kwargs,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO loss and its statistics; see the module docstring.

    ``eps_clip_higher`` (DAPO's clip-higher) defaults to ``eps_clip``. ``c_clip``
    must be > 1. ``max_tokens`` is passed to ``aggregate_loss`` (needed only by
    ``"seq-mean-token-sum-norm"``). Other keyword arguments (GSPO's
    ``importance_sampling_level``, ``rejection_sampling``, ``m2_threshold``,
    ``entropy_BT``/``entropy_coeff`` ...) go to
    :func:`~tapioca.algorithms.policy_losses.policy_loss`.
    """
    if kwargs.get("use_sapo_loss") or kwargs.get("use_cispo_loss"):
        raise AlgorithmInputError(
            "decoupled_ppo_loss is the PPO surrogate; call policy_loss for SAPO or CISPO.")
    return policy_loss(
        logprobs_BT, prox_logprobs_BT, behav_logprobs_BT, advantages_BT, mask_BT,
        eps_clip=eps_clip, eps_clip_higher=eps_clip_higher, c_clip=c_clip,
        behav_imp_weight_cap=behav_imp_weight_cap, agg_mode=agg_mode, max_tokens=max_tokens,
        **kwargs)
