"""The behaviour weight of decoupled PPO and the token filters built on it.

Consumes per-token proximal and behaviour log-probabilities (``prox_BT``,
``behav_BT``, usually ``[B, T]``) and the loss mask; emits the detached
off-policy weight ``w``, a ``keep`` mask of tokens whose loss counts, and
statistics. Nothing here gets a gradient.

**Behaviour weight** (AReaL, "Decoupled PPO", arXiv:2505.24298)::

    log_w = prox_logp - behav_logp          w = exp(clamp(log_w, -20, 20))

It corrects for the rollout having sampled with pi_behav while the trust region
is around pi_prox. Tapioca always applies it (rollouts are asynchronous, so the
loss is always decoupled); with ``actor.recompute_logprob=false`` prox = behav and
``w = 1``.

**Rejection sampling** (``actor.rejection_sampling``, AReaL's
``RejectionSamplingConfig``: ``level``, ``action``, ``metric``, ``agg``,
``lower``, ``upper``). Per token, a divergence metric of pi_prox vs pi_behav:

* ``ratio``: ``w``; ``kl_k1``: ``log_w``; ``kl_k2``: ``log_w**2 / 2``;
  ``kl_k3``: ``exp(-log_w) - 1 + log_w`` (Schulman's estimators with
  ``logp = prox``, ``ref = behav``, as AReaL's ``KLEstimator``);
* ``binary_kl`` (KPop): with ``p = exp(prox)``, ``q = exp(behav)`` clamped to
  ``[1e-8, 1 - 1e-8]`` and ``kl(a||b) = a log(a/b) + (1-a) log((1-a)/(1-b))``,
  the metric is ``max(kl(p||q), kl(q||p))``.

A token is *in bounds* when ``metric <= upper`` and, if ``lower`` is set,
``metric >= lower``. ``level: sequence`` decides per sequence instead: the
metric is aggregated over the sequence's unmasked tokens with ``agg`` (``sum``,
``mean`` or ``max``; for ``ratio`` in log space, so ``mean`` is the geometric
mean), and with ``metric: ratio`` the weight itself becomes the sequence's
geometric mean ``exp(mean(log_w))`` for all its tokens (AReaL's choice).

* ``action: mask`` drops out-of-bounds tokens (or whole sequences): their loss is
  0. This gives **IcePop** (``level: token, action: mask, metric: ratio,
  lower: 0.5, upper: 5``, the published bounds) and **KPop** (``metric: binary_kl``).
* ``action: clamp`` (``metric: ratio`` only) keeps every token but clamps ``w``
  of out-of-bounds tokens to ``[lower or 0, upper]`` (truncated IS).

``behav_imp_weight_cap`` (Tapioca's older switch) is the same as
``rejection_sampling {level: token, action: mask, metric: ratio, upper: cap}``;
set one or the other.

**M2PO** (``actor.m2_threshold``; Zheng et al. 2025, "Prosperity before
Collapse: How Far Can Off-Policy RL Reach with Stale Data on LLMs?"): with
``m2 = log_w**2`` per unmasked token, drop the tokens with the largest ``m2``,
fewest first, until the mean ``m2`` of the remaining tokens is strictly below
``m2_threshold`` (AReaL's rule; if no suffix gets below it, all but the
smallest are dropped).

Tapioca's conventions (peers differ; each has a golden test):

* Dropped tokens (cap, ``action: mask``, M2PO) get loss 0 but **stay in the
  aggregation denominator**, so the loss scale does not move with how many are
  dropped. AReaL does the same for rejection sampling but takes the M2PO-masked
  count as its denominator; the M2PO paper normalises by all tokens, as Tapioca.
* Tapioca computes the M2PO mask over the whole training step (all
  micro-batches; AReaL per micro-batch), except under
  ``prox_logp_method: loglinear`` where prox depends on the training forward and
  the mask is per micro-batch.
* ``binary_kl`` is computed in float64: in float32 ``1 - 1e-8`` rounds to 1 and a
  token with probability ~1 would give ``0 * log 0 = NaN`` and be rejected.
* Ratio bounds are compared in log space (``log_w <= log(upper)``), so the
  decision does not depend on the ``[-20, 20]`` clamp.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .errors import AlgorithmInputError
from .kl import kl_estimate

#: Bound on |log-ratio| before exp (verl uses the same): e^20 ~ 4.9e8.
LOG_RATIO_CLAMP = 20.0
#: Probability clamp of the binary-KL metric (AReaL's eps).
BINARY_KL_EPS = 1e-8

RS_LEVELS = ("token", "sequence")
RS_ACTIONS = ("mask", "clamp")
RS_METRICS = ("ratio", "kl_k1", "kl_k2", "kl_k3", "binary_kl")
RS_AGGS = ("sum", "mean", "max")


@dataclass(frozen=True)
class RejectionSampling:
    """One rejection-sampling rule; field names and defaults are AReaL's.

    Any object with these attributes (e.g. the config's
    ``RejectionSamplingConfig``) is accepted where this is.
    """

    level: str = "token"
    action: str = "mask"
    metric: str = "ratio"
    agg: str = "mean"
    upper: float = 5.0
    lower: float | None = None

    def __post_init__(self) -> None:
        check_rejection_sampling(self)


def check_rejection_sampling(rs) -> None:
    """Raise :class:`AlgorithmInputError` unless ``rs`` is a usable rule (AReaL's checks)."""
    def bad(msg: str) -> AlgorithmInputError:
        return AlgorithmInputError(f"rejection_sampling: {msg}")

    if rs.level not in RS_LEVELS:
        raise bad(f"level={rs.level!r}; use one of {', '.join(RS_LEVELS)}.")
    if rs.action not in RS_ACTIONS:
        raise bad(f"action={rs.action!r}; use one of {', '.join(RS_ACTIONS)}.")
    if rs.metric not in RS_METRICS:
        raise bad(f"metric={rs.metric!r}; use one of {', '.join(RS_METRICS)}.")
    if rs.agg not in RS_AGGS:
        raise bad(f"agg={rs.agg!r}; use one of {', '.join(RS_AGGS)}.")
    if rs.lower is not None and rs.lower > rs.upper:
        raise bad(f"lower={rs.lower} > upper={rs.upper}; lower must be <= upper.")
    if rs.metric == "ratio":
        if not rs.upper > 1.0:
            raise bad(f"upper={rs.upper} must be > 1 for metric 'ratio' (else every "
                      "token whose pi_prox differs from pi_behav is dropped).")
        if rs.lower is not None and rs.lower < 0:
            raise bad(f"lower={rs.lower} must be >= 0 for metric 'ratio'.")
    elif not rs.upper > 0 and rs.metric != "kl_k1":
        raise bad(f"upper={rs.upper} must be > 0 for metric {rs.metric!r} (it is >= 0).")
    if rs.action == "clamp" and rs.metric != "ratio":
        raise bad(f"action 'clamp' truncates the weight and needs metric 'ratio', got "
                  f"{rs.metric!r}; use action 'mask' for KL metrics.")
    if rs.level == "token" and rs.agg != "mean":
        warnings.warn(f"rejection_sampling.agg={rs.agg!r} is ignored with level 'token'.",
                      UserWarning, stacklevel=3)


class BehaviourWeight(NamedTuple):
    """Result of :func:`behaviour_weight` (all ``[B, T]``, detached)."""

    weight_BT: torch.Tensor  # w to multiply the loss by (after a clamp action); 0 where masked
    raw_weight_BT: torch.Tensor  # w before cap / clamp (for statistics); 0 where masked
    keep_BT: torch.Tensor  # bool: unmasked and not dropped by the cap or a mask action
    capped_BT: torch.Tensor  # bool: dropped by behav_imp_weight_cap
    rejected_BT: torch.Tensor  # bool: masked or clamped by rejection_sampling


def binary_kl(log_p: torch.Tensor, log_q: torch.Tensor, eps: float = BINARY_KL_EPS) -> torch.Tensor:
    """``KL(Bern(p) || Bern(q))`` for ``p = exp(log_p)``, ``q = exp(log_q)``, in float64."""
    p = log_p.double().exp().clamp(eps, 1.0 - eps)
    q = log_q.double().exp().clamp(eps, 1.0 - eps)
    return p * (p / q).log() + (1.0 - p) * ((1.0 - p) / (1.0 - q)).log()


def _token_metric(rs, log_w: torch.Tensor, prox: torch.Tensor, behav: torch.Tensor) -> torch.Tensor:
    """Per-token metric; for ``ratio`` it is returned in log space (``log_w``)."""
    if rs.metric == "ratio":
        return log_w
    if rs.metric == "binary_kl":
        return torch.maximum(binary_kl(prox, behav), binary_kl(behav, prox)).to(log_w.dtype)
    return kl_estimate(prox, behav, rs.metric.removeprefix("kl_"))


def _in_bounds(rs, metric: torch.Tensor) -> torch.Tensor:
    if rs.metric == "ratio":  # metric is log w: compare against log bounds
        upper = math.log(rs.upper)
        lower = None if rs.lower is None else (-math.inf if rs.lower == 0 else math.log(rs.lower))
    else:
        upper, lower = rs.upper, rs.lower
    ok = metric <= upper
    if lower is not None:
        ok = ok & (metric >= lower)
    return ok


def behaviour_weight(
    prox_BT: torch.Tensor,
    behav_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    behav_imp_weight_cap: float | None = None,
    rejection_sampling=None,
) -> BehaviourWeight:
    """The detached behaviour weight, with the optional cap or rejection rule applied."""
    if behav_imp_weight_cap is not None and rejection_sampling is not None:
        raise AlgorithmInputError(
            "behaviour_weight: set behav_imp_weight_cap or rejection_sampling, not both "
            "(the cap is rejection_sampling {level: token, action: mask, metric: ratio, upper: cap}).")
    if behav_imp_weight_cap is not None and not behav_imp_weight_cap > 0.0:
        raise AlgorithmInputError(
            f"behaviour_weight: behav_imp_weight_cap={behav_imp_weight_cap!r} must be > 0 (or None).")
    mask = mask_BT.bool()
    zeros = torch.zeros_like(prox_BT)
    prox = torch.where(mask, prox_BT.detach(), zeros)
    behav = torch.where(mask, behav_BT.detach(), zeros)
    log_w = prox - behav
    w = torch.exp(log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    none = torch.zeros_like(mask)
    if rejection_sampling is None:
        keep = mask
        if behav_imp_weight_cap is not None:
            # Compare in log space so the decision does not depend on the clamp.
            keep = mask & (log_w <= math.log(behav_imp_weight_cap))
        w = torch.where(mask, w, zeros)
        return BehaviourWeight(w, w, keep, mask & ~keep, none)

    rs = rejection_sampling
    check_rejection_sampling(rs)
    metric = _token_metric(rs, log_w, prox, behav)
    if rs.level == "sequence":
        n_B1 = mask.sum(-1, keepdim=True)
        if rs.metric == "ratio":
            # The weight itself becomes the sequence's geometric mean (AReaL).
            seq_log_w = log_w.sum(-1, keepdim=True) / n_B1.clamp(min=1)
            w = torch.exp(seq_log_w.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).expand_as(log_w)
        masked_metric = torch.where(mask, metric, torch.zeros_like(metric))
        if rs.agg == "sum":
            seq_metric = masked_metric.sum(-1, keepdim=True)
        elif rs.agg == "mean":
            seq_metric = masked_metric.sum(-1, keepdim=True) / n_B1.clamp(min=1)
        else:
            neg_inf = torch.full_like(metric, -math.inf)
            seq_metric = torch.where(mask, metric, neg_inf).amax(-1, keepdim=True)
            seq_metric = torch.where(n_B1 > 0, seq_metric, torch.zeros_like(seq_metric))
        in_bounds = _in_bounds(rs, seq_metric).expand_as(mask)
    else:
        in_bounds = _in_bounds(rs, metric)
    w = torch.where(mask, w, zeros)
    if rs.action == "mask":
        keep = mask & in_bounds
        return BehaviourWeight(w, w, keep, none, mask & ~keep)
    lower = 0.0 if rs.lower is None else rs.lower
    clamped = torch.where(in_bounds, w, w.clamp(lower, rs.upper))
    return BehaviourWeight(clamped, w, mask, none, mask & (clamped != w))


def m2po_keep_flat(m2_N: torch.Tensor, m2_threshold: float) -> torch.Tensor:
    """M2PO on a flat vector of per-token ``m2 = (log w)^2``: bool keep mask.

    Drops the largest values until the mean of the rest is < ``m2_threshold``;
    keeps at least one token.
    """
    if not m2_threshold > 0:
        raise AlgorithmInputError(f"m2po: m2_threshold={m2_threshold!r} must be > 0.")
    n = m2_N.numel()
    if n == 0:
        return torch.ones_like(m2_N, dtype=torch.bool)
    # Stable sort: ties are dropped in index order, so the result is deterministic.
    sorted_m2, order = torch.sort(m2_N.double(), descending=True, stable=True)
    suffix_mean = sorted_m2.flip(0).cumsum(0).flip(0) / torch.arange(
        n, 0, -1, device=m2_N.device, dtype=torch.float64)
    below = torch.nonzero(suffix_mean < m2_threshold)
    n_drop = int(below[0]) if below.numel() else n - 1
    keep_sorted = torch.arange(n, device=m2_N.device) >= n_drop
    keep = torch.empty_like(keep_sorted)
    keep[order] = keep_sorted
    return keep


def m2po_keep_mask(prox_BT: torch.Tensor, behav_BT: torch.Tensor, mask_BT: torch.Tensor,
                   m2_threshold: float) -> torch.Tensor:
    """M2PO keep mask over all unmasked tokens of one ``[B, T]`` batch (False where masked)."""
    mask = mask_BT.bool()
    log_w = (prox_BT.detach() - behav_BT.detach())[mask]
    keep = torch.zeros_like(mask)
    keep[mask] = m2po_keep_flat(log_w.square(), m2_threshold)
    return keep
