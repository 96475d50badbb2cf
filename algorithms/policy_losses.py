"""The policy-gradient losses of the actor: decoupled PPO, GSPO, SAPO and CISPO.

Consumes, per token and all of one shape ``[B, T]`` (B sequences, right padded):

* ``logprobs`` log pi_theta of the sampled tokens (the only input with a gradient),
* ``prox_logprobs`` log pi_prox (weights before this update, recomputed or
  approximated, see :mod:`tapioca.algorithms.prox_logp`),
* ``behav_logprobs`` log pi_behav (recorded by the rollout),
* ``advantages`` and the loss ``mask`` (True = the token is trained);
* optionally ``entropy`` of the current policy (for the entropy bonus).

Emits a scalar loss (aggregated by :mod:`tapioca.algorithms.aggregation`) and its
statistics (a dict of floats, or names + one device tensor for a trainer's loop).
One pipeline, every loss::

    w, keep = behaviour weight and filters          # rejection_sampling module
    r       = pi_theta / pi_prox                    # token or sequence level
    pg_t    = surrogate(r, A)                       # PPO clip | SAPO gate | CISPO
    loss_t  = w_t * pg_t   where keep, else 0
    loss    = aggregate(loss_t, mask, loss_agg_mode) - entropy_coeff * aggregate(H_t, mask)

Surrogates (config switches are AReaL's names):

* **Decoupled PPO** (default; AReaL arXiv:2505.24298, dual clip Ye et al. 2020
  arXiv:1912.09729, clip-higher DAPO arXiv:2503.14476)::

      pg = max(-A r, -A clip(r, 1 - eps_clip, 1 + eps_clip_higher))
      pg = min(pg, -A c_clip)   where A < 0            # c_clip set: dual clip

* **GSPO** (``importance_sampling_level: sequence``; Zheng et al. 2025,
  arXiv:2507.18071): the ratio of sequence i is the geometric mean of its token
  ratios, ``s_i = exp(mean_t(logp - prox))``, and its advantage the mean of its
  token advantages; both are broadcast to the sequence's tokens and go through
  the PPO clip above (so clipping is per sequence). Means run over the tokens
  that ``keep`` (rejection / M2PO / cap) leaves. With
  ``loss_agg_mode: seq-mean-token-mean`` this is exactly the paper's
  ``1/G sum_i min(s_i A_i, clip(s_i) A_i)``; with ``token-mean`` (AReaL's default)
  sequences weigh by length. Also applies to SAPO's ratio.
* **SAPO** (``use_sapo_loss``, ``sapo_tau_pos``, ``sapo_tau_neg``; Qwen team
  2025, "Soft Adaptive Policy Optimization", arXiv:2511.20347): a smooth gate
  instead of the hard clip, ``tau = sapo_tau_pos if A > 0 else sapo_tau_neg``::

      pg = -A * (4 / tau) * sigmoid(tau * (r - 1))

  whose gradient ``-A * 4 s (1 - s) r grad(log pi)`` (``s`` the sigmoid) equals
  the unclipped policy gradient at ``r = 1`` and decays smoothly away from it.
* **CISPO** (``use_cispo_loss``; MiniMax-M1, arXiv:2506.13585, Eq. 4-5): clip the
  importance weight, not the objective, and keep a gradient on every token::

      pg = -sg(clip(r, max(0, 1 - eps_clip), 1 + eps_clip_higher)) * A * grad-carrier
      grad-carrier = 1 + logp - sg(logp)      # value 1, gradient grad(log pi)

  Token level only; needs ``eps_clip_higher`` (MiniMax-M1 / AReaL recommend
  ``eps_clip: 1.0`` (no lower bound) and ``eps_clip_higher: 4.0``).

Tapioca's conventions (peers differ; each has a golden test):

* **Behaviour weight always applies** (``w = pi_prox / pi_behav``, detached) — to
  PPO, GSPO, SAPO and CISPO alike. AReaL multiplies by it only when
  ``rejection_sampling`` is set, and refuses SAPO with its decoupled loss; with
  ``actor.recompute_logprob: false`` (prox = behav, ``w = 1``) Tapioca's SAPO is
  AReaL's non-decoupled SAPO.
* **CISPO's loss value** is ``-w clip(r) A`` (the surrogate at theta); AReaL
  reports ``-clip(r) A logp``. The gradients are identical.
* **Denominators** are the loss mask: tokens dropped by the cap, rejection or
  M2PO count as zero loss, never shrink the denominator.
* **Log-ratio clamp**: ``logp - prox`` (token or sequence mean) is clamped to
  ``[-20, 20]`` before ``exp`` (verl's bound), so garbage log-probs give finite
  losses and gradients. Masked positions are selected away with ``torch.where``
  before any arithmetic, so padding (even NaN/inf) never reaches loss or grads.
* **Statistics** are over unmasked tokens and 0.0 when there are none:
  ``clip_ratio`` (PPO: the clipped term strictly active, AReaL's definition;
  CISPO: ``r`` outside the clip band; SAPO: 0), ``dual_clip_ratio``,
  ``importance_weight_mean``/``_max`` (``w`` before cap or clamp),
  ``behav_capped_ratio``, ``approx_kl`` (mean ``logp - prox``, unclamped),
  ``ratio_mean``; and, only when the feature is on, ``rejection_ratio``,
  ``m2po_masked_ratio``, ``sapo_gate_mean``, ``policy_entropy`` (aggregated).
"""

from __future__ import annotations

import torch

from .aggregation import aggregate_loss
from .errors import AlgorithmInputError
from .rejection_sampling import (
    LOG_RATIO_CLAMP,
    behaviour_weight,
    m2po_keep_mask,
)

#: Valid values of ``importance_sampling_level``.
IS_LEVELS: tuple[str, ...] = ("token", "sequence")


def sequence_log_ratio(log_ratio_BT: torch.Tensor, keep_BT: torch.Tensor) -> torch.Tensor:
    """GSPO: per-sequence mean of ``log_ratio`` over ``keep``, broadcast to ``[B, T]``
    (0 for a sequence with no kept token). Also GSPO's sequence advantage, the same
    mean of the token advantages."""
    masked = torch.where(keep_BT, log_ratio_BT, torch.zeros_like(log_ratio_BT))
    n_B1 = keep_BT.sum(-1, keepdim=True).clamp(min=1).to(log_ratio_BT.dtype)
    return (masked.sum(-1, keepdim=True) / n_B1).expand_as(log_ratio_BT)


def ppo_clip_surrogate(ratio_BT, adv_BT, eps_low: float, eps_high: float, c_clip: float | None):
    """``(pg_BT, clip_BT, dual_clip_BT)`` of the (dual-)clipped PPO objective."""
    pg1 = -adv_BT * ratio_BT
    pg2 = -adv_BT * ratio_BT.clamp(1.0 - eps_low, 1.0 + eps_high)
    clip = pg1.detach() < pg2.detach()
    pg = torch.maximum(pg1, pg2)
    if c_clip is None:
        return pg, clip, torch.zeros_like(clip)
    # Dual clip: for A < 0 the unclipped -A*r grows without bound in r; cap it at -A*c_clip.
    pg3 = -adv_BT * c_clip
    neg = adv_BT < 0
    dual = neg & (pg3 < pg.detach())
    return torch.where(neg, torch.minimum(pg, pg3), pg), clip, dual


def sapo_surrogate(ratio_BT, adv_BT, tau_pos: float, tau_neg: float):
    """``(pg_BT, gate_BT)``: SAPO's soft gate ``(4/tau) sigmoid(tau (r - 1))`` times ``-A``."""
    tau = torch.where(adv_BT > 0, torch.full_like(ratio_BT, tau_pos), torch.full_like(ratio_BT, tau_neg))
    gate = torch.sigmoid(tau * (ratio_BT - 1.0)) * (4.0 / tau)
    return -gate * adv_BT, gate


def cispo_surrogate(log_ratio_BT, ratio_BT, adv_BT, eps_low: float, eps_high: float):
    """``(pg_BT, out_of_band_BT)``: ``-sg(clip(r)) A`` with gradient ``grad(log pi)``."""
    lower = max(0.0, 1.0 - eps_low)
    weight = ratio_BT.detach().clamp(lower, 1.0 + eps_high)
    # 1 + x - sg(x) has value 1 and gradient grad(x) = grad(log pi_theta).
    carrier = 1.0 + log_ratio_BT - log_ratio_BT.detach()
    out = (ratio_BT.detach() < lower) | (ratio_BT.detach() > 1.0 + eps_high)
    return -weight * adv_BT * carrier, out


def _check(shape, named, *, eps_clip, eps_high, c_clip, importance_sampling_level,
           use_sapo_loss, sapo_tau_pos, sapo_tau_neg, use_cispo_loss, entropy_coeff):
    for name, t in named:
        if t is not None and t.shape != shape:
            raise AlgorithmInputError(
                f"policy_loss: {name} has shape {tuple(t.shape)}, logprobs has {tuple(shape)}; "
                "all per-token inputs must have the same shape.")
    if len(shape) != 2:
        raise AlgorithmInputError(f"policy_loss: inputs must be [B, T], got {tuple(shape)}.")
    if importance_sampling_level not in IS_LEVELS:
        raise AlgorithmInputError(
            f"policy_loss: importance_sampling_level={importance_sampling_level!r}; "
            "use token or sequence.")
    if use_sapo_loss and use_cispo_loss:
        raise AlgorithmInputError("policy_loss: use_sapo_loss and use_cispo_loss exclude each other.")
    upper_eps = 1.0 if use_cispo_loss else 1.0 - 1e-12
    if not 0.0 < eps_clip <= upper_eps:
        raise AlgorithmInputError(
            f"policy_loss: eps_clip={eps_clip!r} must be in (0, 1) (CISPO: (0, 1]).")
    if not eps_high > 0.0:
        raise AlgorithmInputError(f"policy_loss: eps_clip_higher={eps_high!r} must be > 0.")
    if c_clip is not None and not c_clip > 1.0:
        raise AlgorithmInputError(f"policy_loss: c_clip={c_clip!r} must be > 1 (or None to disable).")
    if use_sapo_loss and not (sapo_tau_pos > 0 and sapo_tau_neg > 0):
        raise AlgorithmInputError(
            f"policy_loss: SAPO temperatures must be > 0, got {sapo_tau_pos!r}, {sapo_tau_neg!r}.")
    if use_cispo_loss and importance_sampling_level != "token":
        raise AlgorithmInputError(
            "policy_loss: CISPO is token level only (no sequence-level surrogate).")
    if entropy_coeff < 0:
        raise AlgorithmInputError(f"policy_loss: entropy_coeff={entropy_coeff!r} must be >= 0.")


def policy_loss(*args, **kwargs) -> tuple[torch.Tensor, dict[str, float]]:
    """Policy loss and statistics as host floats (one device->host copy); the arguments
    are :func:`policy_loss_device_stats`'s."""
    loss, names, stats = policy_loss_device_stats(*args, **kwargs)
    return loss, dict(zip(names, stats.tolist()))


def policy_loss_device_stats(
    logprobs_BT: torch.Tensor,
    prox_logprobs_BT: torch.Tensor,
    behav_logprobs_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    eps_clip: float = 0.2,
    eps_clip_higher: float | None = None,
    c_clip: float | None = None,
    importance_sampling_level: str = "token",
    use_sapo_loss: bool = False,
    sapo_tau_pos: float = 1.0,
    sapo_tau_neg: float = 1.05,
    use_cispo_loss: bool = False,
    behav_imp_weight_cap: float | None = None,
    rejection_sampling=None,
    m2_threshold: float | None = None,
    keep_BT: torch.Tensor | None = None,
    entropy_BT: torch.Tensor | None = None,
    entropy_coeff: float = 0.0,
    agg_mode: str = "token-mean",
    max_tokens: int | None = None,
) -> tuple[torch.Tensor, tuple[str, ...], torch.Tensor]:
    """Policy loss, the statistics' names and their float64 values on the loss's device
    (no host sync: a trainer sums them over micro-batches and reads them once); see the
    module docstring.

    ``eps_clip_higher`` defaults to ``eps_clip``. ``rejection_sampling`` is a
    :class:`~tapioca.algorithms.rejection_sampling.RejectionSampling` (or any
    object with its attributes). ``m2_threshold`` applies M2PO over this call's
    tokens; ``keep_BT`` instead passes a precomputed filter (e.g. M2PO over a
    whole batch of micro-batches): False tokens get loss 0 but stay in the
    denominator. ``entropy_BT`` (with a gradient) is needed when
    ``entropy_coeff > 0``. ``max_tokens`` is for ``seq-mean-token-sum-norm``.
    """
    shape = logprobs_BT.shape
    eps_high = eps_clip if eps_clip_higher is None else eps_clip_higher
    _check(shape, (("prox_logprobs", prox_logprobs_BT), ("behav_logprobs", behav_logprobs_BT),
                   ("advantages", advantages_BT), ("mask", mask_BT), ("keep", keep_BT),
                   ("entropy", entropy_BT)),
           eps_clip=eps_clip, eps_high=eps_high, c_clip=c_clip,
           importance_sampling_level=importance_sampling_level, use_sapo_loss=use_sapo_loss,
           sapo_tau_pos=sapo_tau_pos, sapo_tau_neg=sapo_tau_neg, use_cispo_loss=use_cispo_loss,
           entropy_coeff=entropy_coeff)
    if use_cispo_loss and eps_clip_higher is None:
        raise AlgorithmInputError("policy_loss: CISPO needs eps_clip_higher (its upper clip), e.g. 4.0.")
    if m2_threshold is not None and keep_BT is not None:
        raise AlgorithmInputError("policy_loss: pass m2_threshold or a precomputed keep_BT, not both.")
    if entropy_coeff > 0 and entropy_BT is None:
        raise AlgorithmInputError("policy_loss: entropy_coeff > 0 needs entropy_BT.")

    mask = mask_BT.bool()
    zeros = torch.zeros_like(logprobs_BT)
    prox = prox_logprobs_BT.detach()
    adv = torch.where(mask, advantages_BT.detach(), zeros)

    bw = behaviour_weight(prox, behav_logprobs_BT, mask, behav_imp_weight_cap=behav_imp_weight_cap,
                          rejection_sampling=rejection_sampling)
    keep = bw.keep_BT
    m2_dropped = None
    if m2_threshold is not None:
        keep_BT = m2po_keep_mask(prox, behav_logprobs_BT, mask, m2_threshold)
    if keep_BT is not None:
        m2_dropped = mask & ~keep_BT.bool()
        keep = keep & keep_BT.bool()

    log_ratio = torch.where(mask, logprobs_BT - prox, zeros)
    if importance_sampling_level == "sequence":
        log_ratio_used = sequence_log_ratio(log_ratio, keep)
        adv = torch.where(mask, sequence_log_ratio(adv, keep), zeros)  # same per-sequence mean
    else:
        log_ratio_used = log_ratio
    ratio = torch.exp(log_ratio_used.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))

    extra: dict[str, torch.Tensor] = {}
    dual_mask = torch.zeros_like(mask)
    if use_sapo_loss:
        pg, gate = sapo_surrogate(ratio, adv, sapo_tau_pos, sapo_tau_neg)
        clip_mask = torch.zeros_like(mask)
        extra["sapo_gate_mean"] = torch.where(mask, gate.detach(), zeros).sum()
    elif use_cispo_loss:
        pg, clip_mask = cispo_surrogate(log_ratio, ratio, adv, eps_clip, eps_high)
    else:
        pg, clip_mask, dual_mask = ppo_clip_surrogate(ratio, adv, eps_clip, eps_high, c_clip)
    clip_mask = clip_mask & mask
    dual_mask = dual_mask & mask

    loss_BT = torch.where(keep, pg * bw.weight_BT, zeros)
    # Denominator: the loss mask, not `keep` (dropped tokens count as zero loss).
    loss = aggregate_loss(loss_BT, mask, agg_mode, max_tokens=max_tokens)
    if entropy_BT is not None and entropy_coeff > 0:
        ent = aggregate_loss(entropy_BT.to(loss.dtype), mask, agg_mode, max_tokens=max_tokens)
        loss = loss - entropy_coeff * ent
        extra["policy_entropy"] = ent.detach() * mask.sum()  # divided by n below

    with torch.no_grad():
        n = mask.sum().clamp(min=1).to(torch.float64)
        raw_w = bw.raw_weight_BT
        values = [
            clip_mask.sum() / n,
            dual_mask.sum() / n,
            raw_w.sum().double() / n,
            # w >= 0 and masked entries are 0: the max over all is the max over unmasked.
            raw_w.max().double() if raw_w.numel() else n.new_zeros(()),
            bw.capped_BT.sum() / n,
            torch.where(mask, logprobs_BT.detach() - prox, zeros).sum().double() / n,
            torch.where(mask, ratio.detach(), zeros).sum().double() / n,
        ]
        names = ["clip_ratio", "dual_clip_ratio", "importance_weight_mean", "importance_weight_max",
                 "behav_capped_ratio", "approx_kl", "ratio_mean"]
        if rejection_sampling is not None:
            names.append("rejection_ratio")
            values.append(bw.rejected_BT.sum() / n)
        if m2_dropped is not None:
            names.append("m2po_masked_ratio")
            values.append(m2_dropped.sum() / n)
        for k, v in extra.items():
            names.append(k)
            values.append(v.double() / n)
        stats_t = torch.stack([v.to(torch.float64) for v in values])
    return loss, tuple(names), stats_t
