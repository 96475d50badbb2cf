"""The evaluator: policy versions in, held-out scores out, beside training.

Consumes ``weights.v1`` (broadcast: every version the trainer publishes) and
``metrics.v1`` (broadcast, from the start: its own earlier results). Emits
``MetricsEvent`` on ``metrics.v1`` (keyed by ``run_id``): one per evaluated version, with
``step`` and ``policy_version`` the version and ``eval/...`` metrics (pass@k, avg@k,
maj@k, greedy; per subset as ``eval/<subset>/...``; producers/eval_run.py), scored only
from completions whose every token carries that version (the version proof: others are
dropped and counted, ``eval/mixed_version_samples``, ``eval/prompts_dropped``). The same
numbers go to ``<run dir>/eval/metrics.jsonl`` and TensorBoard (``eval/tensorboard``)
once the result is read back from the log (the files mirror the log: a result lost with a
killed process is in neither), and each version's completions to ``<run dir>/eval/v<version>/samples.jsonl`` with its
``summary.json``.

Which versions (``evaluator`` config, AReaL's names; config/evaluation.py): version 0
with ``eval_before_train`` (the engine's initial weights), and a version matching
``freq_steps`` / ``freq_epochs`` / ``freq_secs`` or the last one. It follows
``weights.v1`` by the rule of weights/follow.py (versions only go forward,
conflicting claims dead-lettered), keeping only the versions it would evaluate.

- It never makes the trainer wait: it is a reader of the log with its own engine; the
  trainer neither knows nor waits for it (the process runs at a lower CPU priority,
  ``evaluator.nice``).
- A slow evaluator skips to the newest matching version and says so (a warning, and
  ``eval/skipped_versions``); a version whose weights file the trainer has already
  deleted is skipped the same way.
- A restarted evaluator does not evaluate a version again: it reads ``metrics.v1`` from
  the start and rebuilds the set of versions it has published, and it starts nothing
  before it has read back a marker event it published at start (everything it wrote
  before is then read: one partition, in order; no watermark is trusted). A trial resumed
  on a new log (the broker lost the old one) has no results there: the versions in
  ``<run dir>/eval/metrics.jsonl`` (written only from the log) count as evaluated too, so
  version 0 is not scored again, nor are the versions before the resume called skipped.

Paused, its engine pauses; drained or stopped, an evaluation in flight is dropped
(nothing was published; after a restart the version is evaluated if still wanted).
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from ..bus.role import DeadLetter, Role, Source
from ..config.sections import EvalSection
from ..engines.base import InferenceEngine, SamplingParams
from ..schemas.envelope import Event
from ..schemas.errors import EngineError
from ..schemas.events import MetricsEvent, WeightsEvent
from ..weights.files import WeightsUnavailableError
from ..weights.follow import WeightsFollow
from .eval_run import EvalRun, EvalTask, Scorer, flat_metrics, validate_prompts

log = logging.getLogger(__name__)

# The metric every result event carries (what a restarted evaluator recognises).
RESULT_KEY = "eval/prompts"
MARKER_KEY = "evaluator/recovering"
EVAL_DIR = "eval"


def version_dir(run_dir: str | Path, version: int) -> Path:
    """Where the evaluator writes version ``version``'s samples and summary."""
    return Path(run_dir) / EVAL_DIR / f"v{version:06d}"


@dataclass
class EvaluatorState:
    weights: WeightsFollow
    # The marker published at start; once read back, every earlier result has been read.
    marker_id: str = ""
    caught_up: bool = False
    evaluated: set[int] = field(default_factory=set)  # versions with a result on the log
    mirrored: set[int] = field(default_factory=set)  # versions already in the local sink
    run: EvalRun | None = None
    last_started: float = 0.0  # wall clock of the last evaluation's start (freq_secs)
    skipped: int = 0  # wanted versions never evaluated (too slow, or their file gone)
    evaluations: int = 0


class Evaluator(Role[EvaluatorState]):
    name = "evaluator"
    broadcast_inputs = ("weights", "metrics")

    def __init__(self, section: EvalSection, *, engine: InferenceEngine,
                 load_weights: Callable[[WeightsEvent], Any], task: EvalTask,
                 decode: Callable[[list[int]], str], sink: Any = None,
                 member_id: str = "evaluator-0", train_prompts: int | None = None) -> None:
        """``engine`` / ``load_weights``: the evaluator's own engine (runtime/builders.py
        build_engine); ``task``: the held-out prompts with their reward
        (eval_run.load_eval_task); ``sink``: the local metric sinks of ``<run dir>/eval``
        (``write(step, metrics)``, ``close()``: the trainer's MetricsSink, JSONL and
        TensorBoard; None: none); ``train_prompts``: train_dataset's size, which
        ``freq_epochs`` needs."""
        self.sec = section
        self.ev = section.evaluator
        self.engine = engine
        self.load_weights = load_weights
        self.task = task
        self.decode = decode
        self.member_id = member_id
        self.train_prompts = train_prompts
        self.sampling = SamplingParams.from_generation(section.sampling)
        validate_prompts(task, engine, self.sampling)  # a bad dataset fails the start, not a version
        self.scorer = Scorer(task, section.eval.scoring_workers)
        self.sink = sink

    def init_state(self) -> EvaluatorState:
        # The local mirror holds only results read back from a log: after a resume on a
        # new log (the broker lost the old one) it is what tells which versions were done.
        mirrored = self._mirrored_versions()
        return EvaluatorState(WeightsFollow("the evaluator", loaded_version=self.engine.version),
                              mirrored=mirrored, evaluated=set(mirrored))

    def _mirrored_versions(self) -> set[int]:
        """The versions the local JSONL already holds (written before a restart)."""
        path = Path(getattr(self.sink, "dir", "")) / "metrics.jsonl"
        if self.sink is None or not path.is_file():
            return set()
        out = set()
        for line in path.read_text().splitlines():
            try:
                out.add(int(json.loads(line)["step"]))
            except (ValueError, KeyError, TypeError):
                continue  # a line cut short by a kill: its version is written again
        return out

    # ------------------------------------------------------------------ which versions

    def _ends_epoch(self, version: int) -> bool:
        n, b = self.train_prompts or 0, self.sec.prompts_per_step
        if not n or version < 1:
            return False
        epochs, before = version * b // n, (version - 1) * b // n
        return epochs > before and epochs % self.ev.freq_epochs == 0

    def scheduled(self, version: int) -> bool:
        """Whether ``version`` is an evaluation point by count: a multiple of
        ``freq_steps``, the end of every ``freq_epochs``-th epoch, or the last version."""
        ev = self.ev
        return version >= 1 and (
            version >= self.sec.total_train_steps
            or (ev.freq_steps is not None and version % ev.freq_steps == 0)
            or (ev.freq_epochs is not None and self._ends_epoch(version)))

    def wanted(self, version: int, state: EvaluatorState, now: float) -> bool:
        """Whether ``version`` is one to evaluate now: scheduled, or any version once
        ``freq_secs`` have passed since the last evaluation started; never twice."""
        if version in state.evaluated or version < 1:
            return False
        secs = self.ev.freq_secs
        return self.scheduled(version) or (secs is not None and now - state.last_started >= secs)

    # ------------------------------------------------------------------ events

    def handle(self, event: Event, state: EvaluatorState, source: Source) -> Iterable[Event | DeadLetter]:
        if isinstance(event, WeightsEvent):
            return state.weights.offer(event, source)
        if isinstance(event, MetricsEvent):
            if event.event_id == state.marker_id:
                state.caught_up = True
                log.info("evaluator: read back its marker; versions already evaluated: %s",
                         sorted(state.evaluated) or "none")
            elif event.source.startswith(self.name) and RESULT_KEY in event.metrics:
                # One of its results (before a restart, or just now): never again.
                state.evaluated.add(event.policy_version)
                state.last_started = max(state.last_started, event.produced_at)
                state.skipped = max(state.skipped, int(event.metrics.get("eval/skipped_versions", 0)))
                # The local files mirror the log: written once the result is on it, so a
                # result lost with a killed process (written, never published) is in neither.
                if self.sink is not None and event.policy_version not in state.mirrored:
                    state.mirrored.add(event.policy_version)
                    self.sink.write(event.policy_version, dict(event.metrics))
        return ()

    def on_tick(self, state: EvaluatorState, now: float) -> Iterable[Event | DeadLetter]:
        if not state.marker_id:
            marker = MetricsEvent(source=self.member_id, step=0, metrics={MARKER_KEY: 1.0})
            state.marker_id = marker.event_id
            return [marker]
        if not state.caught_up:
            return ()
        if state.run is not None:
            return self._collect(state)
        if not state.last_started:
            state.last_started = now  # freq_secs counts from the evaluator's first start
        if self.ev.eval_before_train and 0 not in state.evaluated and state.weights.loaded_version == 0:
            self._start(state, 0, now)
            return ()
        return self._next_version(state, now)

    def _next_version(self, state: EvaluatorState, now: float) -> list[Event | DeadLetter]:
        follow = state.weights
        follow.keep(lambda e: self.wanted(e.version, state, now))
        head = follow.head
        if head is None:
            return []
        out = follow.load_head(self._load)  # a failure: retried, then dead-lettered by the bus
        if follow.loaded_version == head.version:
            self._start(state, head.version, now)
        # else its weights were gone (WeightsFollow dropped it, logged why): counted as
        # skipped once a later version is evaluated.
        return out

    def _load(self, event: WeightsEvent) -> None:
        if event.transport == "file" and event.path and not os.path.exists(event.path):
            raise WeightsUnavailableError(
                f"the weights file {event.path} of version {event.version} is gone (the trainer "
                "keeps only its last versions' files): the evaluator skips it")
        self.load_weights(event)

    def _start(self, state: EvaluatorState, version: int, now: float) -> None:
        # Scheduled versions between the last evaluated one and this one: skipped, because
        # evaluation is slower than training or their weights were gone.
        last = max(state.evaluated, default=0)
        skipped = [v for v in range(last + 1, version) if self.scheduled(v)]
        if skipped:
            state.skipped += len(skipped)
            log.warning("evaluator: skipping version(s) %s%s to evaluate the newest, %d (evaluation "
                        "is slower than training, or their weights files were gone; %d skipped "
                        "so far)", skipped[:8], " ..." if len(skipped) > 8 else "", version,
                        state.skipped)
        state.run = EvalRun(self.task, self.engine, self.sampling, k=self.sec.eval.k,
                            greedy=self.sec.eval.greedy, decode=self.decode, version=version,
                            correct_min_reward=self.sec.eval.correct_min_reward, scorer=self.scorer)
        state.last_started = now
        log.info("evaluator: evaluating version %d on %d prompts", version, len(self.task.prompts))
        state.run.start()

    def _collect(self, state: EvaluatorState) -> list[Event]:
        run = state.run
        assert run is not None
        try:
            run.poll()
        except EngineError as exc:  # e.g. its server went away: this version is not evaluated
            state.run = None
            log.warning("evaluator: the evaluation of version %d failed, it is skipped: %s",
                        run.version, exc)
            return []
        if not run.done:
            return []
        state.run = None
        summary = run.write(version_dir(self.sec.run_dir, run.version))
        metrics = {**flat_metrics(summary["metrics"]),
                   "eval/prompts_per_s": summary["prompts_per_s"], "eval/wall_s": summary["wall_s"],
                   "eval/scoring_errors": float(run.scoring_errors),
                   "eval/skipped_versions": float(state.skipped),
                   # The version proof: completions not all of this version, their prompts.
                   "eval/mixed_version_samples": float(summary["mixed_version_samples"]),
                   "eval/prompts_dropped": float(summary["prompts_dropped"])}
        state.evaluated.add(run.version)
        state.evaluations += 1
        total = summary["metrics"]["total"]
        log.info("evaluator: version %d: pass@1 %s, greedy %s (%.1f prompts/s; %d completion(s) not "
                 "all of this version dropped)", run.version,
                 f"{total['pass@1']:.3f}" if "pass@1" in total else "-",
                 f"{total['greedy']:.3f}" if "greedy" in total else "-",
                 summary["prompts_per_s"], summary["mixed_version_samples"])
        return [MetricsEvent(source=self.member_id, step=run.version, policy_version=run.version,
                             metrics=metrics)]

    def on_dead_letter(self, state: EvaluatorState, event: Event, error: BaseException) -> None:
        state.weights.forget(event)

    # ------------------------------------------------------------------ fleet control

    def on_pause(self, state: EvaluatorState, paused: bool) -> None:
        (self.engine.pause if paused else self.engine.resume)()

    def on_stop(self, state: EvaluatorState) -> Iterable[Event]:
        try:
            self.engine.shutdown()
        finally:
            self.scorer.close()
            if self.sink is not None:
                self.sink.close()
        return ()

    def describe(self, state: EvaluatorState) -> dict[str, Any]:
        return {"version": state.weights.loaded_version, "evaluations": state.evaluations,
                "evaluating": float(state.run is not None), "skipped_versions": state.skipped,
                "last_evaluated": max(state.evaluated, default=-1)}
