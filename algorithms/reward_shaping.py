"""Reward shaping before normalisation: weighted reward sources and DAPO's overlong penalty.

Consumes per-trajectory scalars (rewards from one or more scorers, a response length
in tokens) and returns one float reward per trajectory. Pure Python, no torch; the
advantage processor applies these in this order, then ``shape_reward`` (bias, scale,
clip), then, if set, the reward normalisation, then the estimator's group levels
(both in :mod:`tapioca.algorithms.advantages`)::

    r      = sum_s w_s * r_s                                  (weighted_reward)
    r     += min(-(L - (L_max - L_cache)) / L_cache * f, 0)   (overlong_penalty)
    r      = clip((r + bias) * scale, -clip, clip)            (shape_reward)
    r'     = (r - b) / (std + eps) per group                  (normalize_rewards, reward_norm)

This is AReaL's order (``reward_overlong_penalty`` runs before
``reward_bias``/``reward_scaling``/``reward_clip``, and ``reward_norm`` after them,
before the KL-to-reference token rewards are added and before GAE).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from .errors import AlgorithmInputError


def weighted_reward(rewards: Mapping[str, float], weights: Mapping[str, float]) -> float:
    """``sum_s weights[s] * rewards[s]`` over the weighted sources.

    Every weighted source must be present in ``rewards`` (the processor fills missing
    ones with 0.0 only under ``missing_reward: zero``); sources without a weight are
    not summed. Terms are added with ``math.fsum`` in sorted source order, so the
    result does not depend on the order rewards arrived in.
    """
    missing = sorted(s for s in weights if s not in rewards)
    if missing:
        raise AlgorithmInputError(
            f"weighted_reward: no reward from {', '.join(missing)}; every source in "
            "advantage.reward_weights must score the trajectory."
        )
    terms = []
    for source in sorted(weights):
        w, r = float(weights[source]), float(rewards[source])
        if not (math.isfinite(w) and math.isfinite(r)):
            raise AlgorithmInputError(
                f"weighted_reward: source {source!r} has weight {w!r} and reward {r!r}; "
                "both must be finite."
            )
        terms.append(w * r)
    total = math.fsum(terms)
    if not math.isfinite(total):
        raise AlgorithmInputError(f"weighted_reward: the weighted sum overflowed ({total!r}).")
    return total


def overlong_penalty(
    length_tokens: int,
    *,
    max_new_tokens: int,
    overlong_tokens: int,
    overlong_penalty_factor: float,
) -> float:
    """DAPO's soft overlong punishment of a response of ``length_tokens`` tokens.

    ``0`` up to ``max_new_tokens - overlong_tokens`` tokens, then falling linearly to
    ``-overlong_penalty_factor`` at ``max_new_tokens``::

        min(-(L - (max_new_tokens - overlong_tokens)) / overlong_tokens * factor, 0)

    Like AReaL (``reward_overlong_penalty``), a length past ``max_new_tokens`` is not
    floored: it keeps falling linearly.
    """
    if not (isinstance(max_new_tokens, int) and max_new_tokens >= 1):
        raise AlgorithmInputError(
            f"overlong_penalty: max_new_tokens={max_new_tokens!r} must be an int >= 1.")
    if not (isinstance(overlong_tokens, int) and 1 <= overlong_tokens <= max_new_tokens):
        raise AlgorithmInputError(
            f"overlong_penalty: overlong_tokens={overlong_tokens!r} must be an int in "
            f"[1, max_new_tokens={max_new_tokens}].")
    if not (math.isfinite(overlong_penalty_factor) and overlong_penalty_factor >= 0):
        raise AlgorithmInputError(
            f"overlong_penalty: overlong_penalty_factor={overlong_penalty_factor!r} must "
            "be a finite number >= 0.")
    if length_tokens < 0:
        raise AlgorithmInputError(f"overlong_penalty: length_tokens={length_tokens} < 0.")
    expected = max_new_tokens - overlong_tokens
    exceed = length_tokens - expected
    if exceed <= 0:
        return 0.0  # not -0.0
    return 0.0 - exceed / overlong_tokens * overlong_penalty_factor
