"""The whole loop (feeder, rollout, reward, advantage, trainer as processes on the
module's embedded broker, CPU, tiny model) under a fuzzer that publishes well-formed bad
events of every kind issue 10 lists, plus garbage bytes, onto the topics, as a client
without the run's signing key (benchmarks/fuzz_loop.py, which this test runs). Everything is checked from the log:
the run finishes with the reward still rising, every bad event is on dlq.v1 and no
genuine one, nothing good is lost or trained twice, staleness stays within eta, and fake
rejections do not open the head gate. `pytest -s` prints the figures."""

from __future__ import annotations

import importlib.util
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "fuzz_loop.py"
STEPS = 60
ETA = 1
ROUNDS = 8


def _fuzz_loop():
    spec = importlib.util.spec_from_file_location("fuzz_loop", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules["fuzz_loop"] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fuzzed(broker, tmp_path_factory):
    fl = _fuzz_loop()
    # The rounds go out by the trainer's versions, by half the run (fuzz_loop.plan_rounds):
    # 60 steps took 25 s to 2:30 on this box, and a round sent near the end was never
    # read (the trainer had stopped) or moved the feeder past the last version.
    res = fl.run_fuzz_loop(str(tmp_path_factory.mktemp("fuzz")), steps=STEPS, rounds=ROUNDS,
                           bootstrap=broker.bootstrap, prefix=f"fz{uuid.uuid4().hex[:8]}",
                           timeout_s=480)
    print("\n" + res.table())
    return fl, res


def test_run_finishes_and_the_reward_still_rises(fuzzed):
    _, res = fuzzed
    assert res.steps == STEPS and res.versions_contiguous
    # The copy task from a random model: ~0.01 over the first 10 steps; by tens of steps
    # 0.01, 0.02, 0.04, 0.05, 0.08, 0.10 in runs written on this box (0.08-0.10 over the
    # last 10 of 60). Each window is 2,560 completions, so its noise is ~0.006: the
    # margins below leave room for a slower run (one on a box at load ~8, 2026-12-02:
    # 0.0066 -> 0.0355; +0.02 is still over 3 of those windows' noise).
    assert res.reward_first < 0.05
    assert res.reward_last > max(res.reward_first + 0.02, 2 * res.reward_first)


def test_every_bad_event_is_dead_lettered_and_no_good_one(fuzzed):
    fl, res = fuzzed
    # Every round went out well before the end, so the roles read all of it.
    assert len(res.round_versions) == ROUNDS, res.round_versions
    assert max(res.round_versions) <= STEPS * 3 // 4, res.round_versions
    for kind, expected in fl.KINDS.items():
        assert res.sent.get(kind, 0) > 0, f"the fuzzer sent no {kind}"
    assert res.missed == {}, f"bad events not on dlq.v1: {res.missed}"
    assert res.genuine_dead_lettered == [], res.genuine_dead_lettered


def test_nothing_good_lost_or_trained_twice_and_staleness_within_eta(fuzzed):
    _, res = fuzzed
    assert res.trained_twice == 0 and res.fuzz_groups_trained == []
    assert res.trained_groups == STEPS * 32
    assert res.lost_groups == 0
    assert 0 <= res.staleness_min and res.staleness_max <= ETA


def test_fake_rejections_do_not_open_the_head_gate(fuzzed):
    _, res = fuzzed
    # Fake dropped samples and wrongly keyed rewards were rejected by the trainer; the
    # feeder counted none of them (they are not its groups). Forged next versions failed
    # the signature check; the two signed with the run's key (a key holder's broken
    # event) were overtaken by the trainer long before its last version.
    assert res.feeder_ignored_rejections >= res.sent["sample_fake_dropped"]
    assert res.admitted_groups <= res.gate_bound
