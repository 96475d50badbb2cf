"""RewardScorer as a plain function of events: timeouts, failures and non-finite rewards
raise RewardError (never a silent 0); a normal reward is one RewardEvent; redelivery
is absorbed. No broker."""

from __future__ import annotations

import math
import time

import pytest

from tapioca.bus.role import Source
from tapioca.config.schema import RewardConfig
from tapioca.config.sections import RewardSection
from tapioca.consumers.reward_scorer import RewardScorer
from tapioca.schemas.errors import RewardError
from tapioca.schemas.events import RewardEvent, TrajectoryEvent

SRC = Source(topic="t.trajectories.v1", partition=0, offset=0)


def traj(i: int = 0, gid: str = "g1", text: str = "42") -> TrajectoryEvent:
    return TrajectoryEvent(traj_id=f"{gid}:{i}", group_id=gid, prompt_id="p", sample_index=i,
                           group_size=2, prompt_ids=[1], output_ids=[2, 3],
                           output_logprobs=[-0.1, -0.2], output_versions=[0, 0],
                           output_text=text, task_data={"answer": "42"}, run_id="run-x")


@pytest.fixture
def make():
    made: list[RewardScorer] = []

    def build(fn, threads: int = 4, **reward) -> RewardScorer:
        scorer = RewardScorer(RewardSection(reward=RewardConfig(**reward)), reward_fn=fn,
                              threads=threads)
        made.append(scorer)
        return scorer

    yield build
    for s in made:
        s.on_stop(s.init_state())


def test_slow_reward_fn_times_out(make):
    def slow(_):
        time.sleep(0.5)
        return 1.0

    scorer = make(slow, timeout_s=0.05)
    state = scorer.init_state()
    t0 = time.monotonic()
    with pytest.raises(RewardError, match="timed out"):
        list(scorer.handle(traj(), state, SRC))
    assert time.monotonic() - t0 < 0.4  # did not wait for the function
    assert state.count == 0
    # Not marked as scored: the bus's retry of the same event is scored again.
    assert "g1:0" not in state.scored


def test_raising_reward_fn(make):
    def broken(_):
        raise ZeroDivisionError("bad answer parse")

    scorer = make(broken)
    state = scorer.init_state()
    with pytest.raises(RewardError, match="ZeroDivisionError: bad answer parse"):
        list(scorer.handle(traj(), state, SRC))
    assert state.count == 0


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -math.inf])
def test_non_finite_reward(make, value):
    scorer = make(lambda _: value)
    with pytest.raises(RewardError, match="finite"):
        list(scorer.handle(traj(), scorer.init_state(), SRC))


@pytest.mark.parametrize("value", [None, "abc", [1.0], object()])
def test_non_number_reward(make, value):
    scorer = make(lambda _: value)
    with pytest.raises(RewardError, match="not a number"):
        list(scorer.handle(traj(), scorer.init_state(), SRC))


def test_normal_reward_is_one_event_with_ids(make):
    seen = []

    def fn(event: TrajectoryEvent) -> float:
        seen.append(event.traj_id)
        return 1.0 if event.output_text == event.task_data["answer"] else 0.0

    scorer = make(fn, scorer="exact")
    state = scorer.init_state()
    out = list(scorer.handle(traj(3, "g7"), state, SRC))
    assert len(out) == 1
    ev = out[0]
    assert isinstance(ev, RewardEvent)
    assert (ev.traj_id, ev.group_id, ev.reward, ev.scorer) == ("g7:3", "g7", 1.0, "exact")
    assert ev.run_id == "run-x"
    (wrong,) = scorer.handle(traj(4, "g7", text="41"), state, SRC)
    assert wrong.reward == 0.0 and wrong.traj_id == "g7:4"
    assert seen == ["g7:3", "g7:4"]
    assert scorer.describe(state) == {"scored": 2, "mean_reward": 0.5}


def test_same_traj_twice_scores_once(make):
    calls = []

    def fn(event):
        calls.append(event.traj_id)
        return 0.5

    scorer = make(fn)
    state = scorer.init_state()
    assert len(list(scorer.handle(traj(0), state, SRC))) == 1
    assert list(scorer.handle(traj(0), state, SRC)) == []
    assert calls == ["g1:0"]
    assert state.count == 1


def test_failure_then_retry_succeeds(make):
    # A transient failure raises; the bus's retry of the same event then scores it.
    attempts = []

    def flaky(_):
        attempts.append(1)
        if len(attempts) == 1:
            raise ConnectionError("sandbox busy")
        return 0.25

    scorer = make(flaky)
    state = scorer.init_state()
    with pytest.raises(RewardError):
        list(scorer.handle(traj(), state, SRC))
    (ev,) = scorer.handle(traj(), state, SRC)
    assert ev.reward == 0.25


def test_hung_scorer_threads_do_not_starve_later_trajectories(make):
    import threading

    release = threading.Event()

    def fn(event):
        if event.output_text == "hang":
            release.wait(10)  # never returns within the timeout
        return 1.0

    scorer = make(fn, timeout_s=0.2, threads=1)
    state = scorer.init_state()
    with pytest.raises(RewardError, match="timed out"):
        scorer.handle(traj(0, text="hang"), state, SRC)
    # With the only worker thread stuck, this would time out too without a fresh pool.
    (ev,) = scorer.handle(traj(1, text="42"), state, SRC)
    assert ev.reward == 1.0
    release.set()
