"""Token-level RL math for the trainer: GAE, discounted returns, the clipped value
loss, masked batch normalisation and the KL penalty in the reward.

Consumes right-padded per-token tensors ``[B, T]`` (rewards, values, log-probs) and a
mask ``mask_BT`` (bool or 0/1; True = an output token the loss trains on); emits
tensors of the same shape or scalars. No config classes, no events.

Conventions (each has a golden test in ``tests/unit/test_golden_gae.py``):

* **Timesteps are the trained tokens.** Masked positions (prompt, padding, tool /
  user tokens inside an output) are not steps: the recursion jumps over them, as in
  AReaL. Their rewards are ignored and their outputs are exactly 0.
* **Terminal.** Every sequence ends at its last trained token with ``V = 0`` after
  it: the reward is complete when the trainer sees it, truncated or not (AReaL
  bootstraps from the last value only when a row fills the whole padded batch, which
  makes the result depend on padding; Tapioca does not).
* **Turn-level GAE** (``gae_timestep_unit="turn"``): a turn's reward is the sum of its
  tokens' rewards, its value the value at its first trained token; discount and lambda
  apply once per turn and every token of a turn gets the turn's advantage and return.
* **Batch normalisation** is over the trained tokens of the whole batch (every token
  counts once, so long sequences weigh more, as in AReaL / OpenRLHF); ``eps`` is added
  to the std, population std unless ``unbiased``, the std around the subtracted
  baseline; edge cases as the advantage processor's group levels (exact zeros for
  one or all-equal values, no std step without spread).
* **KL penalty**: ``r_t = -kl_ctl * clamp(KL_t, -10, 10)`` on trained tokens, the
  clamp being AReaL's (``KLEstimator(apply_clamp=True)``).
"""

from __future__ import annotations

import torch

from .errors import AlgorithmInputError
from .kl import kl_estimate

#: AReaL clamps every per-token KL estimate to [-KL_CLAMP, KL_CLAMP].
KL_CLAMP = 10.0


def _check(name: str, mask_BT: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
    if mask_BT.dim() != 2:
        raise AlgorithmInputError(f"{name}: mask must be [B, T], got shape {tuple(mask_BT.shape)}.")
    for t in tensors:
        if t.shape != mask_BT.shape:
            raise AlgorithmInputError(
                f"{name}: shapes differ, {tuple(t.shape)} vs mask {tuple(mask_BT.shape)}.")
    return mask_BT.bool()


def _check_discount(name: str, discount: float, gae_lambda: float = 1.0) -> None:
    if not 0.0 <= discount <= 1.0:
        raise AlgorithmInputError(f"{name}: discount={discount!r} must be in [0, 1].")
    if not 0.0 <= gae_lambda <= 1.0:
        raise AlgorithmInputError(f"{name}: gae_lambda={gae_lambda!r} must be in [0, 1].")


def gae_advantages(rewards_BT: torch.Tensor, values_BT: torch.Tensor, mask_BT: torch.Tensor, *,
                   discount: float, gae_lambda: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-level GAE. Returns ``(advantages_BT, returns_BT)``, 0 off the mask.

    Over the trained positions ``t_1 < ... < t_n`` of a row:
    ``delta_k = r_k + discount * V_{k+1} - V_k`` (``V_{n+1} = 0``),
    ``A_k = delta_k + discount * gae_lambda * A_{k+1}``, ``R_k = A_k + V_k``.
    """
    mask = _check("gae_advantages", mask_BT, rewards_BT, values_BT)
    _check_discount("gae_advantages", discount, gae_lambda)
    rewards = rewards_BT.float()
    values = values_BT.float()
    B, T = mask.shape
    adv = torch.zeros(B, T, dtype=torch.float32, device=rewards.device)
    last_gae = torch.zeros(B, dtype=torch.float32, device=rewards.device)
    next_value = torch.zeros(B, dtype=torch.float32, device=rewards.device)
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = rewards[:, t] + discount * next_value - values[:, t]
        new_gae = delta + discount * gae_lambda * last_gae
        # Masked positions are not steps: carry the recursion over them unchanged.
        last_gae = torch.where(m, new_gae, last_gae)
        next_value = torch.where(m, values[:, t], next_value)
        adv[:, t] = torch.where(m, new_gae, torch.zeros_like(new_gae))
    returns = torch.where(mask, adv + values, torch.zeros_like(adv))
    return adv, returns


def discounted_returns(rewards_BT: torch.Tensor, mask_BT: torch.Tensor, *,
                       discount: float) -> torch.Tensor:
    """``G_k = sum_{j >= k} discount^(j-k) r_j`` over the trained positions (0 off the mask).

    The REINFORCE / REINFORCE++ return; equal to GAE with ``V = 0`` and lambda 1.
    """
    mask = _check("discounted_returns", mask_BT, rewards_BT)
    _check_discount("discounted_returns", discount)
    zeros = torch.zeros_like(rewards_BT, dtype=torch.float32)
    adv, _ = gae_advantages(rewards_BT, zeros, mask, discount=discount, gae_lambda=1.0)
    return adv


def turn_gae_advantages(rewards_BT: torch.Tensor, values_BT: torch.Tensor, mask_BT: torch.Tensor,
                        turn_ids_BT: torch.Tensor, *, discount: float,
                        gae_lambda: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn-level GAE: one timestep per turn. Returns ``(advantages_BT, returns_BT)``.

    ``turn_ids_BT`` numbers the turns of each row (any non-decreasing integers on the
    trained positions; ignored off the mask). Turn k: ``r_k`` = sum of its tokens'
    rewards, ``V_k`` = value at its first trained token; then the GAE recursion of
    :func:`gae_advantages` over turns, and each trained token gets its turn's values.
    """
    mask = _check("turn_gae_advantages", mask_BT, rewards_BT, values_BT, turn_ids_BT)
    _check_discount("turn_gae_advantages", discount, gae_lambda)
    rewards = rewards_BT.float()
    values = values_BT.float()
    adv = torch.zeros_like(rewards)
    returns = torch.zeros_like(rewards)
    for b in range(mask.shape[0]):
        pos = mask[b].nonzero().flatten()
        if pos.numel() == 0:
            continue
        ids = turn_ids_BT[b, pos]
        if bool((ids[1:] < ids[:-1]).any()):
            raise AlgorithmInputError(
                f"turn_gae_advantages: turn ids of row {b} decrease along the sequence; "
                "turns must be numbered in order.")
        turns, first, counts = _runs(ids)
        turn_r = torch.stack([rewards[b, pos[s:s + c]].sum() for s, c in zip(first, counts)])
        turn_v = values[b, pos[first]]
        n = len(turns)
        turn_adv = torch.zeros(n, dtype=torch.float32, device=rewards.device)
        last_gae, next_value = 0.0, 0.0
        for k in reversed(range(n)):
            delta = turn_r[k] + discount * next_value - turn_v[k]
            last_gae = delta + discount * gae_lambda * last_gae
            turn_adv[k] = last_gae
            next_value = turn_v[k]
        for k, (s, c) in enumerate(zip(first, counts)):
            adv[b, pos[s:s + c]] = turn_adv[k]
            returns[b, pos[s:s + c]] = turn_adv[k] + turn_v[k]
    return adv, returns


def _runs(ids: torch.Tensor) -> tuple[list[int], list[int], list[int]]:
    """(turn id, first index, length) of each run of equal ids in a 1-D tensor."""
    turns, first, counts = [], [], []
    for i, v in enumerate(ids.tolist()):
        if turns and turns[-1] == v:
            counts[-1] += 1
        else:
            turns.append(v)
            first.append(i)
            counts.append(1)
    return turns, first, counts


def clipped_value_loss(values_BT: torch.Tensor, old_values_BT: torch.Tensor,
                       returns_BT: torch.Tensor, mask_BT: torch.Tensor, *,
                       eps_clip: float) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped value loss (AReaL ``ppo_critic_loss_fn``, verl ``cliprange_value``).

    ``V_clip = V_old + clamp(V - V_old, -eps_clip, eps_clip)``; per token
    ``0.5 * max((V - R)^2, (V_clip - R)^2)``; token mean over the mask (0 when the
    mask is empty). Stats: ``value_loss``, ``value_clip_frac`` (share of trained tokens
    where the clipped term is the larger one).
    """
    mask = _check("clipped_value_loss", mask_BT, values_BT, old_values_BT, returns_BT)
    if not eps_clip > 0:
        raise AlgorithmInputError(f"clipped_value_loss: eps_clip={eps_clip!r} must be > 0.")
    values = values_BT.float()
    old = old_values_BT.float().detach()
    target = returns_BT.float().detach()
    clipped = old + (values - old).clamp(-eps_clip, eps_clip)
    loss_orig = 0.5 * (values - target).square()
    loss_clip = 0.5 * (clipped - target).square()
    per_token = torch.maximum(loss_orig, loss_clip)
    n = int(mask.sum())
    loss = torch.where(mask, per_token, torch.zeros_like(per_token)).sum() / max(n, 1)
    with torch.no_grad():
        clip_frac = float(((loss_clip > loss_orig) & mask).sum()) / max(n, 1)
    return loss, {"value_loss": float(loss.detach()), "value_clip_frac": clip_frac}


def masked_batch_normalize(x_BT: torch.Tensor, mask_BT: torch.Tensor, *, center: bool = True,
                           scale: bool = True, leave1out: bool = False, eps: float = 1e-6,
                           unbiased: bool = False) -> torch.Tensor:
    """The ``batch`` levels of AReaL's normalisation over the trained tokens of a batch.

    ``c = x - mean`` (``center``; with ``leave1out`` the mean of the other tokens,
    ``n/(n-1) * (x - mean)``), else ``c = x``; then ``c / (std + eps)`` (``scale``) with
    ``std = sqrt(sum c^2 / d)``, ``d = n - 1`` if ``unbiased`` else ``n``: the std is
    around the baseline that was subtracted (0 without ``center``, which is LitePPO's
    "group mean, batch std" when ``x`` was centred per group). The same edge cases as
    :func:`tapioca.algorithms.advantages.normalize_batch`, which does this per value:
    centring one token or all-equal tokens gives exact zeros; the std step is skipped
    when ``d`` is 0 or every ``c`` is 0. 0 off the mask; all 0 for an empty mask.
    """
    mask = _check("masked_batch_normalize", mask_BT, x_BT)
    if not (eps >= 0 and eps < float("inf")):
        raise AlgorithmInputError(f"masked_batch_normalize: eps={eps!r} must be a finite number >= 0.")
    x = x_BT.double()
    zeros = torch.zeros_like(x)
    n = int(mask.sum())
    if n == 0:
        return zeros.float()
    vals = x[mask]
    c = vals
    if center:
        if n == 1 or bool((vals == vals[0]).all()):
            return zeros.float()
        c = vals - vals.sum() / n
        if leave1out:  # x - (sum - x)/(n-1) == n/(n-1) * (x - mean)
            c = c * (n / (n - 1))
    if scale:
        d = n - 1 if unbiased else n
        peak = float(c.abs().max())
        if d > 0 and peak > 0:
            # Scaled by the peak first so squares of huge values cannot overflow.
            std = peak * torch.sqrt(((c / peak).square()).sum() / d)
            c = c / (std + eps)
    out = zeros.clone()
    out[mask] = c
    return out.float()


def kl_penalty_rewards(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, mask_BT: torch.Tensor, *,
                       kl_ctl: float, kind: str = "k1") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token KL penalty ``-kl_ctl * clamp(KL_t, -10, 10)``, 0 off the mask.

    Returns ``(rewards_BT, kl_BT)``; ``kl_BT`` is the clamped estimate (for metrics).
    """
    mask = _check("kl_penalty_rewards", mask_BT, logp_BT, ref_logp_BT)
    if not kl_ctl >= 0:
        raise AlgorithmInputError(f"kl_penalty_rewards: kl_ctl={kl_ctl!r} must be >= 0.")
    kl = kl_estimate(logp_BT.float(), ref_logp_BT.float(), kind).clamp(-KL_CLAMP, KL_CLAMP)
    kl = torch.where(mask, kl, torch.zeros_like(kl))
    return -kl_ctl * kl, kl


def terminal_rewards(scalar_B: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """A ``[B, T]`` tensor with ``scalar_B[b]`` at the last trained token of row b, 0 elsewhere
    (all 0 for a fully masked row)."""
    mask = _check("terminal_rewards", mask_BT)
    if scalar_B.shape != (mask.shape[0],):
        raise AlgorithmInputError(
            f"terminal_rewards: scalar shape {tuple(scalar_B.shape)} != ({mask.shape[0]},).")
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    T = mask.shape[1]
    has = mask.any(dim=1)
    # Index of the last True per row: T-1 minus the first True of the reversed row.
    last = T - 1 - mask.flip(1).int().argmax(dim=1)
    rows = has.nonzero().flatten()
    out[rows, last[rows]] = scalar_B.float()[rows]
    return out


def explained_variance(values_BT: torch.Tensor, returns_BT: torch.Tensor,
                       mask_BT: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` over the trained tokens (population variances);
    ``nan`` when no token is trained or ``Var(R) < 1e-10`` (returns constant up to
    rounding, e.g. every reward 0: the ratio would be rounding noise over ~0)."""
    mask = _check("explained_variance", mask_BT, values_BT, returns_BT)
    if int(mask.sum()) == 0:
        return float("nan")
    r = returns_BT.double()[mask]
    v = values_BT.double()[mask]
    var_r = float(r.var(unbiased=False))
    if var_r < 1e-10:
        return float("nan")
    return 1.0 - float((r - v).var(unbiased=False)) / var_r
