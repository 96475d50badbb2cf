"""The configuration of evaluation: `tapioca eval` and the evaluator role.

Three sections of :class:`~tapioca.config.schema.TrainConfig` (re-exported there), with
``valid_dataset`` (AReaL's name: the held-out prompts, a ``DatasetConfig``):

- ``eval`` (:class:`EvalConfig`): what is measured, ``eval.k`` sampled completions per
  prompt (pass@k, avg@k, maj@k; algorithms/eval_metrics.py) and a greedy one;
- ``eval_gconfig`` (:class:`EvalGenerationConfig`, AReaL's name): how they are sampled;
  an unset field takes the run's ``gconfig`` value;
- ``evaluator`` (:class:`EvaluatorConfig`, AReaL's names): when the evaluator role of
  `tapioca train` evaluates a new policy version.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..schemas.errors import require_config as _require


@dataclass(frozen=True, kw_only=True)
class EvalConfig:
    # Sampled completions per prompt (n of pass@k): pass@1, 2, 4, ..., k, avg@k, maj@k.
    k: int = 4
    # Also one greedy (temperature 0) completion per prompt: the greedy accuracy.
    greedy: bool = True
    # Evaluate the first this many prompts of the dataset (in file order; 0: all).
    max_prompts: int = 0
    # A completion is correct (pass@k, maj@k, greedy) when its reward reaches this; 1.0
    # is full credit (avg@k is the mean reward itself, partial credit included).
    correct_min_reward: float = 1.0
    # Processes scoring completions (math-verify is pure Python: a pool scores in
    # parallel, beside the engine); 0: this process.
    scoring_workers: int = 0

    def __post_init__(self) -> None:
        _require(self.k >= 1, "eval.k must be >= 1 (sampled completions per prompt)")
        _require(self.max_prompts >= 0, "eval.max_prompts must be >= 0 (0: every prompt)")
        _require(self.scoring_workers >= 0, "eval.scoring_workers must be >= 0 (0: this process)")
        _require(0 < self.correct_min_reward <= 1,
                 "eval.correct_min_reward must be in (0, 1] (rewards are in [0, 1]; 1 = full credit)")


@dataclass(frozen=True, kw_only=True)
class EvalGenerationConfig:
    """Sampling of the evaluation's ``eval.k`` completions; null fields take ``gconfig``'s."""

    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    max_new_tokens: Optional[int] = None

    def __post_init__(self) -> None:
        _require(self.temperature is None or self.temperature > 0,
                 "eval_gconfig.temperature must be > 0 (the greedy completion is eval.greedy)")
        _require(self.top_p is None or 0 < self.top_p <= 1, "eval_gconfig.top_p must be in (0, 1]")
        _require(self.top_k is None or self.top_k >= 0, "eval_gconfig.top_k must be >= 0 (0 = off)")
        _require(self.max_new_tokens is None or self.max_new_tokens >= 1,
                 "eval_gconfig.max_new_tokens must be >= 1")

    def resolve(self, gconfig: Any) -> dict[str, Any]:
        """The sampling fields, each from here or else from ``gconfig`` (stop strings
        always from ``gconfig``)."""
        own = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
               "max_new_tokens": self.max_new_tokens}
        out = {k: getattr(gconfig, k) if v is None else v for k, v in own.items()}
        if out["temperature"] == 0:  # gconfig's greedy rollouts: k copies of one answer
            out["temperature"] = 1.0
        return {**out, "stop": list(gconfig.stop)}


@dataclass(frozen=True, kw_only=True)
class EvaluatorConfig:
    """When the evaluator role evaluates a policy version on ``valid_dataset`` (AReaL's
    ``evaluator`` section). A version v is evaluated when any trigger that is set fires:
    ``freq_steps`` (v a multiple of it), ``freq_epochs`` (v ends such an epoch of
    ``train_dataset``), ``freq_secs`` (this long since the evaluator's last evaluation
    started); the last version (``total_train_steps``) always is, and version 0 with
    ``eval_before_train``. No trigger set: `tapioca train` starts no evaluator."""

    freq_steps: Optional[int] = None
    freq_epochs: Optional[int] = None
    freq_secs: Optional[float] = None
    eval_before_train: bool = False
    # Niceness added to the evaluator process (0-19): on CPUs it shares with the trainer
    # and the rollout workers it yields to them, so evaluating never slows training down.
    nice: int = 10

    def __post_init__(self) -> None:
        for name in ("freq_steps", "freq_epochs"):
            value = getattr(self, name)
            _require(value is None or value >= 1, f"evaluator.{name} must be >= 1 (or null: off)")
        _require(self.freq_secs is None or self.freq_secs > 0,
                 "evaluator.freq_secs must be > 0 (or null: off)")
        _require(0 <= self.nice <= 19, "evaluator.nice must be in 0..19 (0: the same priority)")

    @property
    def enabled(self) -> bool:
        """Some trigger is set: the evaluator role runs."""
        return (self.eval_before_train or self.freq_steps is not None
                or self.freq_epochs is not None or self.freq_secs is not None)
