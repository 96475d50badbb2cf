"""Reward shaping and outcome advantage estimators, with AReaL's normalisation levels.

Consumes scalar rewards (one float per sample; a group is the ``n`` samples of one
prompt) and emits one float advantage per sample, in the same order. Used by the
group advantage processor (group-level parts, one group at a time) and as the
pure-Python reference of the trainer's batch-level parts; this module knows nothing
about keys, events or Kafka.

Plain Python on purpose: no torch, no numpy. The advantage processor is a light
consumer and groups are small (tens of samples), so exact ``math.fsum`` sums are
cheap and give the same numbers on every machine.

Normalisation (AReaL's ``NormConfig`` names)::

    b_i = mean_j r_j                       mean_level "group"/"batch"
        = (sum_j r_j - r_i) / (n - 1)      ... with mean_leave1out
        = 0                                mean_level "none"
    c_i = r_i - b_i
    s   = sqrt(sum_i c_i^2 / d),  d = n - 1 if std_unbiased else n
    A_i = c_i / (s + eps)                  std_level "group"/"batch"
        = c_i                              std_level "none"

Reward normalisation (AReaL's ``reward_norm``, :func:`normalize_rewards`) is the same
formula applied to the shaped rewards *before* the estimator, ``group`` and ``none``
levels only (the processor sees one group at a time); the estimator then works on the
normalised rewards.

The std is taken around the baseline that was subtracted (AReaL's convention): with
``mean_level="none"`` it is the root mean square, and with a group mean followed by a
batch std it is the spread of the group-centred values over the batch.

Tapioca's conventions (peers differ; each one has a golden test):

* **std**: population std (divide by ``n``) by default; ``std_unbiased=True``
  uses Bessel's correction (divide by ``n - 1``), which is what ``torch.std``
  (verl's GRPO) and AReaL (since v0.3.4) do by default.
* **eps**: added to the std, ``(r - mean) / (std + eps)``, default ``1e-6``
  (AReaL 1e-5). It is not under a square root and not ``max(std, eps)``.
* **singleton groups** (``n == 1``): advantage ``0.0`` whenever a group mean is
  subtracted (leave-one-out included; AReaL's leave-one-out keeps the raw reward).
  No baseline exists, and returning the raw reward would inject an un-baselined
  signal on a different scale from the rest of the batch. A group std of one
  sample is undefined, so it is skipped (the value is left as is).
* **all-equal rewards**: exactly ``0.0`` for every sample whenever a group mean is
  subtracted (checked explicitly, so float round-off in the mean can never leak a
  tiny non-zero advantage).
* **extreme values**: the std is computed on values scaled by their largest
  magnitude, so rewards near 1e300 do not overflow to an infinite std.
* **group unit**: one value per sample (the GRPO paper's, verl's, TRL's); with
  ``group_unit="token"`` every trained token of the group is one element (AReaL's
  ``Normalization`` over the loss mask, :func:`_normalize_tokens`), so a sample weighs
  its trained tokens. docs/algorithms.md says why the default is per sample.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from .errors import AlgorithmInputError

#: Values of ``mean_level`` / ``std_level``.
LEVELS: tuple[str, ...] = ("group", "batch", "none")

#: Values of ``group_unit``: what one element of a group's mean and std is. ``sequence``
#: (the default; the GRPO paper's, verl's and TRL's): one value per sample. ``token``
#: (AReaL's ``Normalization`` over the loss mask): every trained token of a sample
#: counts once, so a sample of n trained tokens weighs n.
GROUP_UNITS: tuple[str, ...] = ("sequence", "token")

#: Each estimator (``advantage.estimator``) as a normalisation preset. The processor
#: applies the ``group`` parts; the trainer applies the ``batch`` parts over each
#: training batch. ``gae``: the processor passes shaped rewards with advantage 0, the
#: trainer computes GAE with its critic and then applies the batch levels.
ESTIMATOR_NORMS: dict[str, dict[str, Any]] = {
    "grpo": {"mean_level": "group", "std_level": "group", "mean_leave1out": False},
    "dr_grpo": {"mean_level": "group", "std_level": "none", "mean_leave1out": False},
    "lite_ppo": {"mean_level": "group", "std_level": "batch", "mean_leave1out": False},
    "rloo": {"mean_level": "group", "std_level": "none", "mean_leave1out": True},
    "reinforce_pp": {"mean_level": "batch", "std_level": "batch", "mean_leave1out": False},
    "reinforce_pp_baseline": {"mean_level": "group", "std_level": "batch",
                              "mean_leave1out": False},
    "gae": {"mean_level": "batch", "std_level": "batch", "mean_leave1out": False},
}

#: Valid values of ``group_advantages(estimator=...)``.
ESTIMATORS: tuple[str, ...] = tuple(ESTIMATOR_NORMS)

#: Estimators whose group-level part subtracts a group mean: singleton and all-equal
#: groups give exact zeros for these.
GROUP_BASELINE_ESTIMATORS: tuple[str, ...] = tuple(
    e for e, n in ESTIMATOR_NORMS.items() if n["mean_level"] == "group")


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


def estimator_norm(estimator: str, *, eps: float = 1e-6,
                   std_unbiased: bool = False) -> dict[str, Any]:
    """The full normalisation (keyword arguments of :func:`normalize_group` /
    :func:`normalize_batch`) of an estimator preset."""
    if estimator not in ESTIMATOR_NORMS:
        raise AlgorithmInputError(
            f"unknown estimator {estimator!r}; use one of {', '.join(ESTIMATORS)}."
        )
    return {**ESTIMATOR_NORMS[estimator], "std_unbiased": std_unbiased, "eps": eps}


def check_norm(*, mean_level: str, std_level: str, mean_leave1out: bool = False,
               std_unbiased: bool = False, eps: float = 1e-6, group_unit: str = "sequence") -> None:
    """Raise :class:`AlgorithmInputError` unless the normalisation is one Tapioca can run."""
    if group_unit not in GROUP_UNITS:
        raise AlgorithmInputError(f"group_unit={group_unit!r}: use one of {', '.join(GROUP_UNITS)}.")
    for name, level in (("mean_level", mean_level), ("std_level", std_level)):
        if level not in LEVELS:
            raise AlgorithmInputError(
                f"{name}={level!r}: use one of {', '.join(LEVELS)} (or null for none)."
            )
    if mean_level == "batch" and std_level == "group":
        # The processor sees one group and cannot know the batch mean its std needs.
        raise AlgorithmInputError(
            "mean_level=batch with std_level=group is not supported: the group std "
            "would need the batch mean. Use std_level batch or none."
        )
    if mean_leave1out and mean_level == "none":
        raise AlgorithmInputError("mean_leave1out needs mean_level group or batch.")
    if not (eps >= 0 and math.isfinite(eps)):
        raise AlgorithmInputError(f"eps={eps!r} must be a finite number >= 0.")


def check_reward_norm(*, mean_level: str, std_level: str, mean_leave1out: bool = False,
                      std_unbiased: bool = False, eps: float = 1e-6, group_unit: str = "sequence") -> None:
    """Raise :class:`AlgorithmInputError` unless the reward normalisation is one the
    advantage processor can apply: a valid norm with ``group`` or ``none`` levels, one
    value per sequence."""
    if group_unit != "sequence":
        # AReaL's reward_norm normalises the [batch] reward scores: one per sequence.
        raise AlgorithmInputError(
            f"group_unit={group_unit!r} is not supported for reward_norm: a reward is one value per "
            "sequence (as AReaL's reward_norm). Token weighting is an adv_norm switch.")
    batch = [name for name, level in (("mean_level", mean_level), ("std_level", std_level))
             if level == "batch"]
    if batch:
        # A batch-wide reward statistic would need every group of the training batch
        # before any advantage is computed, but groups leave the processor one by one.
        raise AlgorithmInputError(
            f"{' and '.join(batch)}=batch is not supported for reward_norm: rewards are "
            "normalised in the advantage processor, one group at a time. Use group or "
            "none here, and advantage.adv_norm batch levels (applied by the trainer over "
            "the training batch, e.g. {mean_level: batch, std_level: batch}) for "
            "batch-wide normalisation.")
    check_norm(mean_level=mean_level, std_level=std_level, mean_leave1out=mean_leave1out,
               std_unbiased=std_unbiased, eps=eps)


def _finite_values(values: Sequence[float], who: str) -> list[float]:
    out = [float(v) for v in values]
    if not out:
        raise AlgorithmInputError(f"{who}: empty input; a group needs at least one reward.")
    bad = [v for v in out if not math.isfinite(v)]
    if bad:
        raise AlgorithmInputError(
            f"{who}: non-finite values {bad!r}; fix the reward function "
            "(or shape_reward) before computing advantages."
        )
    return out


def _centre(values: list[float], leave1out: bool) -> list[float]:
    n = len(values)
    total = math.fsum(values)
    if leave1out:
        # r_i - (sum - r_i)/(n-1) == n/(n-1) * (r_i - mean); the product form keeps
        # the exact zeros of the plain centring.
        mean = total / n
        factor = n / (n - 1)
        return [factor * (v - mean) for v in values]
    mean = total / n
    return [v - mean for v in values]


def _scale(centred: list[float], *, std_unbiased: bool, eps: float) -> list[float]:
    n = len(centred)
    denom = n - 1 if std_unbiased else n
    peak = max(abs(c) for c in centred)
    if n == 1 or peak == 0.0:
        # One value (no spread defined) or nothing to scale: left as is.
        return centred
    # Scale by the largest magnitude first so squares of huge values cannot overflow.
    std = peak * math.sqrt(math.fsum((c / peak) ** 2 for c in centred) / denom)
    return [c / (std + eps) for c in centred]


def _normalize(values: list[float], *, level: str, mean_level: str, std_level: str,
               mean_leave1out: bool, std_unbiased: bool, eps: float) -> list[float]:
    n = len(values)
    centred = values
    if mean_level == level:
        # Singleton and all-equal: no relative signal, exact zeros.
        if n == 1 or max(values) == min(values):
            return [0.0] * n
        centred = _centre(values, mean_leave1out)
    if std_level == level:
        return _scale(centred, std_unbiased=std_unbiased, eps=eps)
    return list(centred)


def _normalize_tokens(values: list[float], weights: list[int], *, mean_level: str, std_level: str,
                      mean_leave1out: bool, std_unbiased: bool, eps: float) -> list[float]:
    """The group levels with every trained token one element (AReaL's masked
    normalisation when a sample's tokens share its value): sample i stands for
    ``w_i`` copies of ``r_i``, ``N = sum w``. ``b = sum_i w_i r_i / N`` (leave-one-out
    leaves out one *token*: ``(N r_i - S) / (N - 1)`` after centring), ``s = sqrt(sum_i
    w_i c_i^2 / d)``, ``d = N - 1`` if ``std_unbiased`` else ``N``. Samples without a
    trained token (``w = 0``) count in nothing and get 0. The edge cases are the
    per-sequence ones with N for n: one token, or all trained samples equal, give zeros
    when a mean is subtracted; no std step without spread or with ``d = 0``."""
    n = len(values)
    live = [i for i in range(n) if weights[i] > 0]
    out = [0.0] * n
    total = sum(weights[i] for i in live)
    if not live:
        return out
    vals = [values[i] for i in live]
    ws = [weights[i] for i in live]
    centred = vals
    if mean_level == "group":
        if total == 1 or max(vals) == min(vals):
            return out
        mean = math.fsum(w * v for w, v in zip(ws, vals)) / total
        factor = total / (total - 1) if mean_leave1out else 1.0
        centred = [factor * (v - mean) for v in vals]
    if std_level == "group":
        d = total - 1 if std_unbiased else total
        peak = max(abs(c) for c in centred)
        if d > 0 and peak > 0.0:
            std = peak * math.sqrt(math.fsum(w * (c / peak) ** 2 for w, c in zip(ws, centred)) / d)
            centred = [c / (std + eps) for c in centred]
    for i, c in zip(live, centred):
        out[i] = c
    return out


def normalize_group(
    rewards: Sequence[float],
    *,
    mean_level: str = "group",
    std_level: str = "group",
    mean_leave1out: bool = False,
    std_unbiased: bool = False,
    eps: float = 1e-6,
    group_unit: str = "sequence",
    token_counts: Sequence[int] | None = None,
) -> list[float]:
    """The group-level parts of a normalisation, applied to one group's rewards.

    Only levels equal to ``"group"`` act here; ``"batch"`` levels are the trainer's
    (:func:`normalize_batch` over a training batch) and ``"none"`` does nothing.
    See the module docstring for the formula and the edge-case conventions.
    ``group_unit="token"`` weighs each sample by its trained tokens (``token_counts``,
    required then; AReaL's convention, :func:`_normalize_tokens`).
    """
    check_norm(mean_level=mean_level, std_level=std_level, mean_leave1out=mean_leave1out,
               std_unbiased=std_unbiased, eps=eps, group_unit=group_unit)
    values = _finite_values(rewards, "normalize_group")
    if group_unit == "token" and "group" in (mean_level, std_level):
        if token_counts is None or len(token_counts) != len(values):
            raise AlgorithmInputError(
                f"normalize_group: group_unit=token needs one token count per reward, got "
                f"{None if token_counts is None else len(token_counts)} for {len(values)}.")
        counts = [int(c) for c in token_counts]
        if any(c < 0 for c in counts):
            raise AlgorithmInputError(f"normalize_group: token counts must be >= 0, got {counts}.")
        return _normalize_tokens(values, counts, mean_level=mean_level, std_level=std_level,
                                 mean_leave1out=mean_leave1out, std_unbiased=std_unbiased, eps=eps)
    return _normalize(values, level="group", mean_level=mean_level, std_level=std_level,
                      mean_leave1out=mean_leave1out, std_unbiased=std_unbiased, eps=eps)


def normalize_batch(
    values: Sequence[float],
    *,
    mean_level: str = "batch",
    std_level: str = "batch",
    mean_leave1out: bool = False,
    std_unbiased: bool = False,
    eps: float = 1e-6,
    group_unit: str = "sequence",
) -> list[float]:
    """The batch-level parts of a normalisation, over one training batch.

    ``values`` are the elements being normalised: one per sequence (the results of
    :func:`normalize_group`) or, as the trainer does it (AReaL's masked
    normalisation), one per trained token, so longer sequences weigh more. Only
    ``"batch"`` levels act. When the group level subtracted a mean, the batch std is
    the spread of the centred values around 0 (their batch mean is 0 for complete
    groups when taken per sequence).
    """
    check_norm(mean_level=mean_level, std_level=std_level, mean_leave1out=mean_leave1out,
               std_unbiased=std_unbiased, eps=eps, group_unit=group_unit)
    vals = _finite_values(values, "normalize_batch")
    return _normalize(vals, level="batch", mean_level=mean_level, std_level=std_level,
                      mean_leave1out=mean_leave1out, std_unbiased=std_unbiased, eps=eps)


def normalize_rewards(
    rewards: Sequence[float],
    *,
    mean_level: str = "group",
    std_level: str = "group",
    mean_leave1out: bool = False,
    std_unbiased: bool = False,
    eps: float = 1e-6,
    group_unit: str = "sequence",
) -> list[float]:
    """AReaL's ``reward_norm`` on one group's shaped rewards, before the estimator.

    The formula and edge cases of :func:`normalize_group` (singleton and all-equal
    groups give exact zeros when a group mean is subtracted); only ``group`` and
    ``none`` levels are accepted (:func:`check_reward_norm`).
    """
    check_reward_norm(mean_level=mean_level, std_level=std_level,
                      mean_leave1out=mean_leave1out, std_unbiased=std_unbiased, eps=eps,
                      group_unit=group_unit)
    values = _finite_values(rewards, "normalize_rewards")
    return _normalize(values, level="group", mean_level=mean_level, std_level=std_level,
                      mean_leave1out=mean_leave1out, std_unbiased=std_unbiased, eps=eps)


def group_advantages(
    rewards: Sequence[float],
    *,
    estimator: str = "grpo",
    eps: float = 1e-6,
    std_unbiased: bool = False,
) -> list[float]:
    """Group-level advantages of one group of samples of the same prompt.

    * ``"grpo"``: ``(r_i - mean) / (std + eps)``.
    * ``"dr_grpo"``: ``r_i - mean`` (Dr. GRPO drops the std normalisation).
    * ``"lite_ppo"``, ``"reinforce_pp_baseline"``: ``r_i - mean``; the trainer
      divides by the batch std.
    * ``"rloo"``: ``r_i - mean(r_j, j != i) = n / (n - 1) * (r_i - mean)``.
    * ``"reinforce_pp"``: ``r_i`` (no group baseline; batch mean and std in the trainer).
    * ``"gae"``: ``0.0`` (the trainer computes GAE with its critic).
    """
    norm = estimator_norm(estimator, eps=eps, std_unbiased=std_unbiased)
    check_norm(**norm)
    values = _finite_values(rewards, "group_advantages")
    if estimator == "gae":
        return [0.0] * len(values)
    return normalize_group(values, **norm)
