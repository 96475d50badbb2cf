"""Approximate proximal log-probabilities from policy versions (``prox_logp_method``).

Consumes per-token behaviour logprobs ``behav_BT`` (from the rollout), the current
policy's logprobs ``logprobs_BT`` (the training forward, detached here), the
per-token policy versions ``versions_BT`` (-1 where not an output token) and the
trainer's ``policy_version``; emits ``prox_BT``, an estimate of log pi_prox that
replaces the proximal forward pass.

Where an approximation is needed at all: pi_prox is the policy before this update.
The trainer's micro-batches of the *first* minibatch run their training forward
before any optimizer step, so their detached log-probs are pi_prox exactly and
cost nothing extra; with the default ``actor.ppo_n_minibatches: 1`` that is every
micro-batch, and ``prox_logp_method`` changes nothing. Only micro-batches of later
minibatches train on weights that earlier minibatches already moved; for them
``actor.prox_logp_method`` (AReaL's name) picks:

* ``recompute`` (default): a no-grad forward with the pre-update weights, run
  before the first optimizer step; exact.
* ``loglinear``: no extra forward; interpolate in log space between the behaviour
  policy and the one being trained, by version (AReaL's
  ``compute_prox_logp_approximations``)::

      v       = policy_version            # weights before this update = pi_prox
      v_theta = v + 1                     # the policy being trained
      alpha   = clamp((v - v_behav) / (v_theta - v_behav), 0, 1)   # 0 if v_behav > v
      prox    = behav + alpha * (logp_theta - behav)

  A token sampled by the proximal weights (``v_behav = v``) gets exactly
  ``prox = behav``; a token ``s`` versions stale gets ``alpha = s / (s + 1)``.
* ``metrics``: train as ``recompute`` and report how far the formula above is from
  the exact pi_prox on every trained token (``actor/prox_loglinear_abs_err``, mean
  |approx - prox|), first minibatch included: a measure of the approximation
  before relying on it with several minibatches.

Where Tapioca differs from AReaL: AReaL calls the same formula with
``current_version`` = the engine's version during its update, which equals the
proximal version, and sets ``v_prox = current_version - 1``; it therefore
interpolates as if pi_prox were one version older than the weights it trains
from (a token from the current weights gets ``alpha = 0`` either way, but a token
one version stale gets ``alpha = 0`` in AReaL and ``1/2`` here). Tapioca's
``policy_version`` is the number of optimizer steps applied before this training
step (docs/design.md#3-policy-versions-and-the-staleness-window), i.e. the proximal
version itself.
"""

from __future__ import annotations

import torch

from .errors import AlgorithmInputError

#: Valid values of ``actor.prox_logp_method``.
PROX_LOGP_METHODS: tuple[str, ...] = ("recompute", "loglinear", "metrics")


def loglinear_alpha(versions_BT: torch.Tensor, policy_version: int) -> torch.Tensor:
    """Interpolation weight ``alpha`` per token (0 where ``versions_BT < 0``)."""
    v_b = versions_BT.to(torch.float64)
    v = float(policy_version)
    diff = v + 1.0 - v_b
    valid = (versions_BT >= 0) & (diff > 0)
    alpha = torch.where(valid, (v - v_b) / torch.where(valid, diff, torch.ones_like(diff)),
                        torch.zeros_like(v_b))
    return alpha.clamp(0.0, 1.0)


def loglinear_prox_logprobs(
    behav_BT: torch.Tensor,
    logprobs_BT: torch.Tensor,
    versions_BT: torch.Tensor,
    policy_version: int,
) -> torch.Tensor:
    """``behav + alpha * (logp - behav)``; detached; same dtype as ``behav_BT``."""
    if not behav_BT.shape == logprobs_BT.shape == versions_BT.shape:
        raise AlgorithmInputError(
            "loglinear_prox_logprobs: behav, logprobs and versions must have one shape, got "
            f"{tuple(behav_BT.shape)}, {tuple(logprobs_BT.shape)}, {tuple(versions_BT.shape)}.")
    if policy_version is None or policy_version < 0:
        raise AlgorithmInputError(
            f"loglinear_prox_logprobs: policy_version={policy_version!r}; pass the version of "
            "the weights before this update (>= 0).")
    alpha = loglinear_alpha(versions_BT, policy_version).to(behav_BT.dtype)
    behav = behav_BT.detach()
    return behav + alpha * (logprobs_BT.detach().to(behav.dtype) - behav)
