"""The evaluator role as a plain function of events (no broker), on the tiny synthetic
model with the engine the builder picks: which versions it evaluates, what it publishes
(equal to a recomputation from its samples.jsonl), skipping when slow or when a file is
gone, and a restart that rebuilds its evaluated versions from its own metrics events."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest

from tapioca.algorithms.eval_metrics import summarize
from tapioca.bus.role import DeadLetter, Source
from tapioca.config.loader import load_config
from tapioca.config.schema import TrainConfig
from tapioca.models.factory import load_model_and_tokenizer
from tapioca.producers.eval_run import flat_metrics, read_samples
from tapioca.producers.evaluator import MARKER_KEY, RESULT_KEY, version_dir
from tapioca.runtime.builders import build_evaluator
from tapioca.runtime.run import create_tiny_checkpoint
from tapioca.schemas.events import MetricsEvent, WeightsEvent
from tapioca.weights.files import save_weights, weights_file

K = 2
HELD_OUT = 4
SRC = Source("t.metrics.v1", 0, 0, broadcast=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return create_tiny_checkpoint(tmp_path_factory.mktemp("model") / "m", "synthetic", seed=0)


@pytest.fixture(scope="module")
def weights(tiny_dir, tmp_path_factory):
    """Weights files of versions 10..40 (the initial weights: an evaluator does not care)."""
    model, _ = load_model_and_tokenizer(str(tiny_dir))
    wdir = tmp_path_factory.mktemp("weights")
    events = {}
    for v in (10, 20, 30, 40):
        path = weights_file(wdir, v)
        sha, _ = save_weights(model.state_dict(), path)
        events[v] = WeightsEvent(version=v, path=str(path), sha256=sha)
    return events


class Harness:
    def __init__(self, run_dir: Path, tiny_dir: Path, *overrides: str) -> None:
        self.cfg = load_config(TrainConfig, None, [
            f"run_dir={run_dir}", f"model.path={tiny_dir}", "total_train_steps=100",
            "valid_dataset.type=synthetic", "valid_dataset.split=test",
            f"valid_dataset.task_options.holdout_pairs={HELD_OUT}", f"eval.k={K}",
            "gconfig.max_new_tokens=3", "evaluator.freq_steps=10", *overrides])
        self.role = build_evaluator(self.cfg, renice=False)
        self.state = self.role.init_state()
        self.published: list[MetricsEvent] = []
        self.dead: list[DeadLetter] = []

    def feed(self, *events) -> None:
        for e in events:
            self.dead += [x for x in self.role.handle(e, self.state, SRC) or () if isinstance(x, DeadLetter)]

    def tick(self) -> list:
        out = list(self.role.on_tick(self.state, time.time()))
        self.dead += [x for x in out if isinstance(x, DeadLetter)]
        results = [e for e in out if isinstance(e, MetricsEvent) and RESULT_KEY in e.metrics]
        self.published += results
        return out

    def catch_up(self) -> None:
        """The first tick publishes the marker; reading it back (as from metrics.v1) means
        every earlier event has been read."""
        marker = self.tick()[0]
        assert isinstance(marker, MetricsEvent) and MARKER_KEY in marker.metrics
        self.feed(marker)

    def evaluations(self, n: int, timeout_s: float = 60.0) -> list[MetricsEvent]:
        deadline = time.monotonic() + timeout_s
        while len(self.published) < n:
            assert time.monotonic() < deadline, f"{len(self.published)} of {n} evaluations"
            self.tick()
            time.sleep(0.005)
        return self.published

    def close(self) -> None:
        self.role.on_stop(self.state)


@pytest.fixture
def harness(tmp_path, tiny_dir):
    made: list[Harness] = []

    def make(*overrides: str) -> Harness:
        made.append(Harness(tmp_path / "runs", tiny_dir, *overrides))
        return made[-1]

    yield make
    for h in made:
        h.close()


def test_evaluates_nothing_before_reading_back_its_marker(harness, weights):
    h = harness()
    h.feed(weights[10])
    for _ in range(20):
        out = h.tick()
        assert all(MARKER_KEY in e.metrics for e in out)
    assert h.state.run is None and not h.published
    h.feed(MetricsEvent(source="evaluator-0", step=0, metrics={MARKER_KEY: 1.0}))  # someone else's
    h.tick()
    assert h.state.run is None, "a marker that is not its own must not end the recovery"


def test_published_numbers_equal_a_recomputation_from_the_jsonl(harness, weights):
    h = harness()
    h.catch_up()
    h.feed(weights[10])
    (event,) = h.evaluations(1)
    assert (event.step, event.policy_version, event.source) == (10, 10, "evaluator-0")
    out = version_dir(h.cfg.run_path, 10)
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == HELD_OUT * (K + 1)  # k samples + the greedy one per prompt
    assert {"prompt_id", "output_text", "reward", "extracted_answer"} <= set(rows[0])
    recomputed = flat_metrics(summarize(read_samples(out), K))
    assert {k: v for k, v in event.metrics.items() if k in recomputed} == recomputed
    assert json.loads((out / "summary.json").read_text())["metrics"]["total"]["pass@1"] == \
        event.metrics["eval/pass@1"]
    # ... and the local sinks: eval/metrics.jsonl (and TensorBoard beside it), written once
    # the result is read back from the log: the files mirror the log
    jsonl = Path(h.cfg.run_path) / "eval" / "metrics.jsonl"
    assert not jsonl.exists() or not jsonl.read_text().strip()
    h.feed(event)
    h.feed(event)  # a redelivery writes nothing more
    (line,) = [json.loads(x) for x in jsonl.read_text().splitlines()]
    assert line["step"] == 10 and line["eval/pass@1"] == event.metrics["eval/pass@1"]


def test_a_restarted_evaluator_mirrors_each_logged_result_once(harness, weights):
    # Before the restart: version 10 evaluated, published and mirrored; version 20's result
    # was written nowhere (the process died before publishing it).
    h = harness("trial_name=restart")
    h.catch_up()
    h.feed(weights[10])
    (event,) = h.evaluations(1)
    h.feed(event)
    h.close()
    # The restart reads the log from the start: version 10's result again, no 20
    again = harness("trial_name=restart")
    assert again.cfg.run_path == h.cfg.run_path
    again.feed(event)
    again.catch_up()
    rows = [json.loads(x)["step"] for x in
            (Path(again.cfg.run_path) / "eval" / "metrics.jsonl").read_text().splitlines()]
    assert rows == [10] and again.state.evaluated == {10}


def test_eval_before_train_evaluates_version_0_first(harness, weights):
    h = harness("evaluator.eval_before_train=true")
    h.catch_up()
    h.feed(weights[10])
    assert [e.policy_version for e in h.evaluations(2)] == [0, 10]


def test_only_matching_versions_and_a_slow_evaluator_skips_to_the_newest(harness, weights, caplog):
    h = harness("evaluator.freq_steps=20")
    h.feed(weights[10], weights[20], weights[30], weights[40])  # read while catching up
    with caplog.at_level(logging.WARNING, logger="tapioca.producers.evaluator"):
        h.catch_up()
        (event,) = h.evaluations(1)
    # 10 and 30 are no evaluation points; 20 is one, but 40 is newer: 20 is skipped
    assert event.policy_version == 40
    assert event.metrics["eval/skipped_versions"] == 1
    assert "skipping version(s) [20] to evaluate the newest, 40" in caplog.text
    for _ in range(10):
        h.tick()
    assert len(h.published) == 1 and not h.dead


def test_a_version_whose_file_is_gone_is_skipped_not_dead_lettered(harness, weights):
    h = harness()
    h.catch_up()
    gone = WeightsEvent(version=10, path=str(Path(weights[10].path).with_name("v999999.safetensors")),
                        sha256=weights[10].sha256)
    h.feed(gone)
    for _ in range(10):
        h.tick()
    assert h.state.run is None and not h.published and not h.dead
    h.feed(weights[20])
    (event,) = h.evaluations(1)
    assert event.policy_version == 20 and event.metrics["eval/skipped_versions"] == 1


def test_a_restarted_evaluator_does_not_evaluate_a_version_again(harness, weights):
    first = harness()
    first.catch_up()
    first.feed(weights[10])
    (result,) = first.evaluations(1)
    # A restart: a fresh process reads metrics.v1 from the start (its result, then its new
    # marker) and weights.v1 from the start (10, then 20).
    second = harness()
    second.feed(result, weights[10])
    second.catch_up()
    for _ in range(20):
        second.tick()
    assert second.state.run is None and not second.published
    second.feed(weights[20])
    (event,) = second.evaluations(1)
    assert event.policy_version == 20 and event.metrics["eval/skipped_versions"] == 0


def test_a_trial_resumed_on_a_new_log_does_not_evaluate_again_what_its_files_hold(harness, weights):
    """Issue 38: resumed where the broker had lost the old log, the evaluator found no
    result on metrics.v1 and scored version 0 again (the live line showed the initial
    model's score). The local eval/metrics.jsonl, written only from results read back
    from the log, tells which versions were done."""
    first = harness("trial_name=resumed", "evaluator.eval_before_train=true")
    first.catch_up()
    first.feed(weights[10])
    results = first.evaluations(2)
    assert [e.policy_version for e in results] == [0, 10]
    first.feed(*results)  # read back from the log: mirrored into eval/metrics.jsonl
    first.close()
    # The resume, on a new log: none of those results on it, only the new marker.
    second = harness("trial_name=resumed", "evaluator.eval_before_train=true")
    second.catch_up()
    for _ in range(20):
        second.tick()
    assert second.state.run is None and not second.published
    second.feed(weights[10], weights[20])
    (event,) = second.evaluations(1)
    # 10 was evaluated before the resume: not skipped, not evaluated again
    assert event.policy_version == 20 and event.metrics["eval/skipped_versions"] == 0


def test_an_evaluation_the_engine_aborts_is_dropped_and_said(harness, weights, caplog):
    h = harness()
    h.catch_up()
    h.feed(weights[10])
    h.role.engine.pause()  # nothing is generated before the shutdown below
    h.tick()  # loads version 10 and starts its evaluation
    assert h.state.run is not None
    h.role.engine.shutdown()  # every queued completion ends as "abort"
    with caplog.at_level(logging.WARNING, logger="tapioca.producers.evaluator"):
        for _ in range(50):
            h.tick()
            if h.state.run is None:
                break
            time.sleep(0.01)
    assert h.state.run is None and not h.published
    assert "the evaluation of version 10 failed, it is skipped" in caplog.text
