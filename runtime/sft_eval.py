"""Held-out evaluation inside `tapioca sft`, and its stop rule (``stop_at_eval``).

Consumes the SFT run's config (``valid_dataset``, ``eval``, ``eval_gconfig``,
``evaluator``, ``rollout``: config/sections.py ``sft_eval_section``) and, at the steps its
``evaluator`` triggers pick, the trainer's current weights (a state dict, loaded into an
engine of ``rollout.*`` built once in this process as the evaluator role builds its own).
Emits what the RL run's evaluator writes, keyed by the step (= the version): each
evaluation's ``<run dir>/eval/v<step>/samples.jsonl`` + ``summary.json``
(producers/eval_run.py) and a row of ``<run dir>/eval/metrics.jsonl`` (``eval/pass@1``,
``eval/greedy``, ``eval/pass@1_stderr``, ...); no events (the supervised trainer
publishes its own metrics when a broker is configured).

When: version 0 with ``evaluator.eval_before_train``, every ``evaluator.freq_steps``-th
step, the first step after ``evaluator.freq_secs`` seconds of *training* since the last
evaluation ended (evaluating stops the trainer, so its own time does not count), and
always the last step. Stop: the first evaluation whose ``eval/<stop_at_eval_metric>``
reaches ``stop_at_eval`` ends training there (the loop saves that version and
``final/``).

The evaluation runs in the trainer's process (one GPU: the engine's KV cache beside the
trainer's memory) and stops training while it runs: its cost is the longest completion
of the held-out set, not the throughput; ``eval.max_prompts`` bounds it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..config.sections import sft_eval_section
from ..config.supervised import SFTConfig
from ..engines.base import SamplingParams
from ..producers.eval_run import EvalRun, Scorer, flat_metrics, validate_prompts
from ..producers.evaluator import EVAL_DIR, version_dir
from ..schemas.errors import ConfigError
from ..trainers.metrics_sink import MetricsSink
from .builders import build_eval_parts

log = logging.getLogger(__name__)


@dataclass
class HeldOutResult:
    step: int
    metrics: dict[str, float]  # the flat eval/... metrics, as in eval/metrics.jsonl
    wall_s: float  # the evaluation's own time


@dataclass
class SFTHeldOut:
    """The SFT loop's step hook (trainers/supervised/loop.py ``StepHook``): call it as
    ``hook(version, model, last)``; True means stop. ``on_result(result)`` is called after
    each evaluation (the CLI prints a line). :meth:`close` shuts the engine down."""

    cfg: SFTConfig
    on_result: Callable[[HeldOutResult], None] | None = None
    results: list[HeldOutResult] = field(default_factory=list)
    stopped_at: int | None = None  # the step whose evaluation reached stop_at_eval

    def __post_init__(self) -> None:
        self.sec = sft_eval_section(self.cfg)
        run_dir = Path(self.cfg.run_path)
        self.task, self.bundle, self.decode = build_eval_parts(self.sec, log_dir=str(run_dir / "logs"))
        self.sampling = SamplingParams.from_generation(self.sec.sampling)
        validate_prompts(self.task, self.bundle.engine, self.sampling)  # fail at start, not mid-run
        self.scorer = Scorer(self.task, self.sec.eval.scoring_workers)
        self.sink = MetricsSink(run_dir / EVAL_DIR)
        self._trained_since: float | None = None  # the end of the last evaluation (or the first call)

    def due(self, version: int, last: bool) -> bool:
        ev = self.sec.evaluator
        if version == 0:
            return ev.eval_before_train
        if last or (ev.freq_steps is not None and version % ev.freq_steps == 0):
            return True
        since = self._trained_since if self._trained_since is not None else time.monotonic()
        return ev.freq_secs is not None and time.monotonic() - since >= ev.freq_secs

    def __call__(self, version: int, model: torch.nn.Module, last: bool) -> bool:
        if self._trained_since is None:  # start-up (model, data, engine) is not training time
            self._trained_since = time.monotonic()
        if not self.due(version, last):
            return False
        result = self.evaluate(version, model)
        self._trained_since = time.monotonic()
        target, metric = self.cfg.stop_at_eval, self.cfg.stop_at_eval_metric
        if target is None:
            return False
        value = result.metrics.get(f"eval/{metric}")
        if value is None:
            have = ", ".join(k.removeprefix("eval/") for k in result.metrics if k.count("/") == 1)
            raise ConfigError(f"stop_at_eval_metric={metric}: the evaluation reports no such metric "
                              f"(it has {have}); pick one of those")
        if value >= target and self.stopped_at is None:
            self.stopped_at = version
            return True
        return False

    def evaluate(self, version: int, model: torch.nn.Module) -> HeldOutResult:
        """Score ``model``'s current weights as ``version``: written to the run's eval/."""
        t0 = time.monotonic()
        engine = self.bundle.engine
        with torch.no_grad():
            engine.update_weights(model.state_dict(), version=version)
        run = EvalRun(self.task, engine, self.sampling, k=self.sec.eval.k, greedy=self.sec.eval.greedy,
                      decode=self.decode, version=version,
                      correct_min_reward=self.sec.eval.correct_min_reward, scorer=self.scorer)
        run.start()
        while not run.done:
            if not run.poll():
                time.sleep(0.005)
        summary = run.write(version_dir(self.sec.run_dir, version), model=self.cfg.model.path,
                            run_dir=self.sec.run_dir, engine=type(engine).__name__)
        metrics = {**flat_metrics(summary["metrics"]), "eval/prompts_per_s": summary["prompts_per_s"],
                   "eval/wall_s": summary["wall_s"], "eval/scoring_errors": float(run.scoring_errors)}
        self.sink.write(version, metrics)
        result = HeldOutResult(version, metrics, time.monotonic() - t0)
        self.results.append(result)
        log.info("sft: step %d: held-out pass@1 %.3f, greedy %s (%.1f s)", version, metrics["eval/pass@1"],
                 f"{metrics['eval/greedy']:.3f}" if "eval/greedy" in metrics else "-", result.wall_s)
        if self.on_result is not None:
            self.on_result(result)
        return result

    def summary(self) -> dict[str, Any]:
        """What `tapioca sft -o json` adds: each evaluation and where it stopped."""
        return {"evaluations": [{"step": r.step, "wall_s": round(r.wall_s, 2), **r.metrics} for r in self.results],
                "stop_at_eval": self.cfg.stop_at_eval, "stop_at_eval_metric": self.cfg.stop_at_eval_metric,
                "stopped_at_step": self.stopped_at}

    def close(self) -> None:
        try:
            self.bundle.engine.shutdown()
        finally:
            self.scorer.close()
            self.sink.close()
