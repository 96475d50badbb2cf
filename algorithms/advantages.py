"""Reward shaping and outcome (group) advantage estimators.

Consumes scalar rewards (one float per sample; a group is the ``n`` samples of one
prompt) and emits one float advantage per sample, in the same order. Used by the
group advantage processor, which keys groups by prompt; this module knows nothing
about keys, events or Kafka.

Plain Python on purpose: no torch, no numpy. The advantage processor is a light
consumer and groups are small (tens of samples), so exact ``math.fsum`` sums are
cheap and give the same numbers on every machine.

Tapioca's conventions (peers differ; each one has a golden test):

* **std**: population std (divide by ``n``) by default; ``std_unbiased=True``
  uses Bessel's correction (divide by ``n - 1``), which is what ``torch.std``
  (verl's GRPO) does by default.
* **eps**: added to the std, ``(r - mean) / (std + eps)``, default ``1e-6``.
  It is not under a square root and not ``max(std, eps)``.
* **singleton groups** (``n == 1``): advantage ``0.0`` for every estimator.
  No baseline exists, and Bessel's std and RLOO's leave-one-out mean are
  undefined; returning the raw reward instead would inject an un-baselined,
  un-normalised signal on a different scale from the rest of the batch.
* **all-equal rewards**: exactly ``0.0`` for every sample (checked explicitly, so
  float round-off in the mean can never leak a tiny non-zero advantage).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tapioca.algorithms.errors import AlgorithmInputError

#: Valid values of ``group_advantages(estimator=...)``.
ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo")


def shape_reward(
    reward: float,
    *,
    bias: float = 0.0,
    scale: float = 1.0,
    clip: float | None = None,
) -> float:
    """Return ``(reward + bias) * scale``, clipped to ``[-clip, clip]`` if ``clip`` is set.

    Mirrors AReaL's ``reward_bias`` / ``reward_scaling`` / ``reward_clip`` order:
    shift first, then scale, then clip the shaped value.
    """
    for name, value in (("reward", reward), ("bias", bias), ("scale", scale)):
        if not math.isfinite(value):
            raise AlgorithmInputError(
                f"shape_reward: {name}={value!r} is not finite; "
                "fix the reward function or the reward shaping config."
            )
    if clip is not None and not (clip >= 0 and math.isfinite(clip)):
        raise AlgorithmInputError(
            f"shape_reward: clip={clip!r} must be a finite number >= 0 or None."
        )
    shaped = (float(reward) + bias) * scale
    if clip is not None:
        shaped = min(max(shaped, -clip), clip)
    return shaped


def group_advantages(
    rewards: Sequence[float],
    *,
    estimator: str = "grpo",
    eps: float = 1e-6,
    std_unbiased: bool = False,
) -> list[float]:
    """Advantages of one group of samples of the same prompt.

    * ``"grpo"``: ``(r_i - mean) / (std + eps)`` (population std unless
      ``std_unbiased``).
    * ``"dr_grpo"``: ``r_i - mean`` (Dr. GRPO drops the std normalisation).
    * ``"rloo"``: ``r_i - mean(r_j, j != i) = n / (n - 1) * (r_i - mean)``.

    ``eps`` and ``std_unbiased`` only matter for ``"grpo"``. Singleton groups and
    all-equal groups give all zeros (see the module docstring).
    """
    if estimator not in ESTIMATORS:
        raise AlgorithmInputError(
            f"group_advantages: unknown estimator {estimator!r}; "
            f"use one of {', '.join(ESTIMATORS)}."
        )
    if not (eps >= 0 and math.isfinite(eps)):
        raise AlgorithmInputError(f"group_advantages: eps={eps!r} must be a finite number >= 0.")
    values = [float(r) for r in rewards]
    n = len(values)
    if n == 0:
        raise AlgorithmInputError("group_advantages: empty group; a group needs at least one reward.")
    bad = [r for r in values if not math.isfinite(r)]
    if bad:
        raise AlgorithmInputError(
            f"group_advantages: non-finite rewards {bad!r}; fix the reward function "
            "(or shape_reward) before computing advantages."
        )
    # Singleton and all-equal groups carry no relative signal: exact zeros.
    if n == 1 or max(values) == min(values):
        return [0.0] * n

    mean = math.fsum(values) / n
    centred = [r - mean for r in values]
    if estimator == "dr_grpo":
        return centred
    if estimator == "rloo":
        # Leave-one-out baseline: r_i - (sum - r_i)/(n-1) == n/(n-1) * (r_i - mean).
        factor = n / (n - 1)
        return [factor * c for c in centred]
    # grpo
    denom = n - 1 if std_unbiased else n
    std = math.sqrt(math.fsum(c * c for c in centred) / denom)
    return [c / (std + eps) for c in centred]
