"""Evaluation metrics of sampled completions: pass@k, avg@k, maj@k and greedy accuracy.

Consumes, per prompt, its sampled completions in sample order (each a reward, whether it
is correct, and the task's extracted answer) and optionally its greedy completion; emits
plain floats, over all prompts and per subset. No torch, no I/O, no config: `tapioca
eval` and the evaluator role compute their numbers here, and so does anyone recomputing
them from an evaluation's ``samples.jsonl`` (:func:`prompts_from_rows`).

Definitions (n = sampled completions of a prompt, c = the correct ones among them; every
metric is the mean over prompts of the per-prompt value below):

* **pass@k** -- the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language
  Models Trained on Code", eq. 1): ``1 - C(n - c, k) / C(n, k)``, the chance that at
  least one of k completions drawn without replacement from the n is correct. Computed
  as ``1 - prod_{i = n - c + 1}^{n} (1 - k / i)`` (the paper's numerically stable form);
  ``1`` when ``n - c < k``. With k = n it is 1 if any completion is correct, else 0;
  with k = 1 it is c / n. It needs ``n >= k``.
* **avg@k** -- the mean *reward* of the first k completions (rewards may be partial
  credit; the others count correctness).
* **maj@k** -- majority vote over the extracted answers of the first k completions:
  completions whose answer could not be extracted (``None``) do not vote; the answer
  with the most votes wins and the prompt scores the fraction of that answer's voters
  that are correct (1 or 0 whenever the task's answer extraction agrees with its reward,
  as the built-in tasks' do). **Ties**: among answers with equal votes, the one whose
  first vote came earliest (the lowest sample index) wins, the rule of
  ``collections.Counter.most_common`` and of lm-evaluation-harness. No votes at all:
  the prompt scores 0.
* **greedy** -- the fraction of prompts whose greedy (temperature 0) completion is
  correct; prompts without one are left out of it.

A completion is *correct* when its reward reaches ``correct_min_reward`` (1.0 by
default: full credit), decided by the caller and stored with each sample.

**Version proof** (AReaL #1479's rule): a score is attributed to policy version v only
when every scored token carries v (:func:`attributed_version`; the tokens with loss mask
1 where a mask is given, every output token otherwise). A completion whose tokens do
not all prove v (mixed versions, after a weights switch mid-generation, or another
version) is dropped and counted; a prompt with a dropped completion is left out whole
(its pass@k needs all its samples): rows marked ``dropped`` in ``samples.jsonl`` make
:func:`prompts_from_rows` leave their prompt out, so a recomputation agrees.
:func:`live_scores` applies the same rule to rewarded live traffic (online mode).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import AlgorithmInputError


@dataclass(frozen=True)
class Sample:
    """One scored completion of a prompt."""

    reward: float
    correct: bool
    answer: str | None = None


@dataclass
class PromptSamples:
    """One prompt's sampled completions (in sample order) and its greedy one, if any."""

    prompt_id: str
    samples: list[Sample] = field(default_factory=list)
    greedy: Sample | None = None
    subset: str = ""


def _need(n: int, k: int, what: str, prompt_id: str = "") -> None:
    if k < 1:
        raise AlgorithmInputError(f"{what}: k={k}; use k >= 1")
    if n < k:
        where = f" prompt {prompt_id!r}" if prompt_id else " a prompt"
        raise AlgorithmInputError(
            f"{what} needs {k} sampled completions per prompt, but{where} has {n}: ask for "
            f"k <= {n}, or evaluate again with eval.k >= {k} (the samples generated per prompt)")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al.'s unbiased pass@k of one prompt with ``n`` samples, ``c`` correct."""
    _need(n, k, f"pass@{k}")
    if not 0 <= c <= n:
        raise AlgorithmInputError(f"pass@k: c={c} correct of n={n}; need 0 <= c <= n")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def avg_at_k(samples: Sequence[Sample], k: int) -> float:
    """Mean reward of the first ``k`` samples."""
    _need(len(samples), k, f"avg@{k}")
    return math.fsum(s.reward for s in samples[:k]) / k


def majority_answer(samples: Sequence[Sample]) -> str | None:
    """The answer most samples give (``None`` never votes); ties go to the answer voted
    first (lowest sample index). None when no sample has an answer."""
    votes: dict[str, int] = {}  # insertion order = order of first vote
    for s in samples:
        if s.answer is not None:
            votes[s.answer] = votes.get(s.answer, 0) + 1
    if not votes:
        return None
    best = max(votes.values())
    return next(a for a, v in votes.items() if v == best)


def maj_at_k(samples: Sequence[Sample], k: int) -> float:
    """maj@k of one prompt: the share of the majority answer's voters (among the first
    ``k`` samples) that are correct; 0 when none of them has an answer."""
    _need(len(samples), k, f"maj@{k}")
    first = samples[:k]
    winner = majority_answer(first)
    if winner is None:
        return 0.0
    voters = [s for s in first if s.answer == winner]
    return sum(1 for s in voters if s.correct) / len(voters)


def default_pass_ks(k: int) -> list[int]:
    """The pass@ values reported for ``k`` samples per prompt: 1, the powers of two
    below k, and k (``[1, 2, 4, 8]`` for 8; ``[1, 2, 4, 6]`` for 6)."""
    ks, p = [], 1
    while p < k:
        ks.append(p)
        p *= 2
    return ks + [k]


def prompt_metrics(prompts: Sequence[PromptSamples], k: int,
                   pass_ks: Sequence[int] | None = None) -> dict[str, float]:
    """The metrics of ``prompts`` (means over prompts): ``pass@j`` for j in ``pass_ks``
    (default :func:`default_pass_ks`), ``avg@k``, ``maj@k``, ``greedy`` (when some prompt
    has a greedy sample), the standard errors ``pass@1_stderr`` and ``greedy_stderr`` (2
    prompts or more: :func:`stderr_of_mean`), and the counts ``prompts``, ``samples`` and
    ``greedy_prompts``.
    Raises AlgorithmInputError when there are no prompts or a prompt has fewer than the
    largest k asked for."""
    if not prompts:
        raise AlgorithmInputError("no prompts to evaluate: the dataset is empty (check "
                                  "valid_dataset / --data and eval.max_prompts)")
    ks = sorted(set(pass_ks or default_pass_ks(k)))
    need = max(ks + [k])
    what = f"pass@{need}" if need > k else f"pass@{k} / avg@{k} / maj@{k}"
    for p in prompts:
        _need(len(p.samples), need, what, p.prompt_id)
    n_prompts = len(prompts)
    out: dict[str, float] = {"prompts": float(n_prompts),
                             "samples": float(sum(len(p.samples) for p in prompts))}
    for j in ks:
        per_prompt = [pass_at_k(len(p.samples), sum(s.correct for s in p.samples), j) for p in prompts]
        out[f"pass@{j}"] = math.fsum(per_prompt) / n_prompts
        if j == 1 and n_prompts > 1:
            out["pass@1_stderr"] = stderr_of_mean(per_prompt)
    out[f"avg@{k}"] = math.fsum(avg_at_k(p.samples, k) for p in prompts) / n_prompts
    out[f"maj@{k}"] = math.fsum(maj_at_k(p.samples, k) for p in prompts) / n_prompts
    greedy = [p.greedy for p in prompts if p.greedy is not None]
    out["greedy_prompts"] = float(len(greedy))
    if greedy:
        out["greedy"] = sum(1 for g in greedy if g.correct) / len(greedy)
        if len(greedy) > 1:
            out["greedy_stderr"] = stderr_of_mean([float(g.correct) for g in greedy])
    return out


def stderr_of_mean(values: Sequence[float]) -> float:
    """The standard error of the mean of ``values`` over prompts: the sample standard
    deviation (n - 1) over sqrt(n), as lm-evaluation-harness reports ``_stderr``. It is
    the spread of the score over draws of the held-out set; with k samples per prompt it
    holds the sampling noise too. Needs 2 values or more."""
    n = len(values)
    if n < 2:
        raise AlgorithmInputError("a standard error needs 2 prompts or more")
    mean = math.fsum(values) / n
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1) / n)


def summarize(prompts: Sequence[PromptSamples], k: int,
              pass_ks: Sequence[int] | None = None) -> dict[str, Any]:
    """``{"total": metrics, "subsets": {subset: metrics}}`` (:func:`prompt_metrics`);
    ``subsets`` is empty unless some prompt names a subset (prompts without one are
    grouped under ``""`` then)."""
    subsets: dict[str, list[PromptSamples]] = {}
    for p in prompts:
        subsets.setdefault(p.subset, []).append(p)
    by_subset = {} if set(subsets) <= {""} else {
        name: prompt_metrics(ps, k, pass_ks) for name, ps in sorted(subsets.items())}
    return {"total": prompt_metrics(prompts, k, pass_ks), "subsets": by_subset}


def attributed_version(versions: Sequence[int], loss_mask: Sequence[int] | None = None) -> int | None:
    """The policy version every scored token carries, or None when they differ or no
    token is scored. Scored: the tokens whose ``loss_mask`` is 1 when a mask is given (a
    multi-turn trajectory's tool and user tokens are not the policy's), else all."""
    scored = set(versions) if not loss_mask else {v for v, m in zip(versions, loss_mask) if m}
    return next(iter(scored)) if len(scored) == 1 else None


def dropped_prompts(rows: Iterable[Mapping[str, Any]]) -> set[str]:
    """The prompts with a row marked ``dropped`` (a completion whose score could not be
    attributed to the evaluated version): their scores are left out whole."""
    return {str(r["prompt_id"]) for r in rows if r.get("dropped")}


def prompts_from_rows(rows: Iterable[Mapping[str, Any]]) -> list[PromptSamples]:
    """Regroup per-sample rows (an evaluation's ``samples.jsonl``: ``prompt_id``,
    ``sample_index`` (-1 for the greedy completion), ``reward``, ``correct``,
    ``extracted_answer``, ``subset``) into prompts, samples in ``sample_index`` order,
    prompts in order of first appearance. Prompts with a ``dropped`` row are left out
    (the version proof, :func:`dropped_prompts`)."""
    rows = list(rows)
    out = dropped_prompts(rows)
    by_id: dict[str, PromptSamples] = {}
    indexed: dict[str, list[tuple[int, Sample]]] = {}
    for row in rows:
        if str(row["prompt_id"]) in out:
            continue
        pid = str(row["prompt_id"])
        p = by_id.setdefault(pid, PromptSamples(pid, subset=str(row.get("subset") or "")))
        answer = row.get("extracted_answer")
        sample = Sample(float(row["reward"]), bool(row["correct"]),
                        None if answer is None else str(answer))
        index = int(row["sample_index"])
        if index < 0:
            p.greedy = sample
        else:
            indexed.setdefault(pid, []).append((index, sample))
    for pid, samples in indexed.items():
        by_id[pid].samples = [s for _, s in sorted(samples, key=lambda x: x[0])]
    return list(by_id.values())


@dataclass
class VersionScore:
    """The live traffic one version served alone: its rewarded trajectories and their rewards."""

    version: int
    trajectories: int = 0
    reward_sum: float = 0.0

    @property
    def mean_reward(self) -> float:
        return self.reward_sum / self.trajectories if self.trajectories else 0.0


def live_scores(items: Iterable[tuple[Sequence[int], Sequence[int], float]]) -> tuple[dict[int, VersionScore], int]:
    """Per-version scores of rewarded live traffic (online mode) under the version proof:
    ``items`` are ``(output_versions, loss_mask, reward)`` of each rewarded trajectory; a
    trajectory counts for version v only when every loss-bearing token carries v
    (:func:`attributed_version`). Returns ``({version: VersionScore}, dropped)``,
    ``dropped`` the trajectories whose tokens prove no single version (mixed versions:
    a session that spanned a weights switch)."""
    scores: dict[int, VersionScore] = {}
    dropped = 0
    for versions, mask, reward in items:
        v = attributed_version(versions, mask)
        if v is None:
            dropped += 1
            continue
        score = scores.setdefault(v, VersionScore(v))
        score.trajectories += 1
        score.reward_sum += float(reward)
    return dict(sorted(scores.items())), dropped
