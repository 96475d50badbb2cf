"""AdvantageProcessor as a plain function of events: joins, advantages, de-duplication,
the commit floor and revocation. No broker."""

from __future__ import annotations

import itertools
import random

import pytest

from tapioca.algorithms.advantages import group_advantages, shape_reward
from tapioca.bus.role import Source
from tapioca.consumers.advantage import AdvantageProcessor
from tapioca.schemas.events import RewardEvent, SampleEvent, TrajectoryEvent

TRAJ, REW = "t.trajectories.v1", "t.rewards.v1"


def traj(gid: str, i: int, n: int, versions: list[int] | None = None) -> TrajectoryEvent:
    versions = versions if versions is not None else [0, 0]
    return TrajectoryEvent(
        traj_id=f"{gid}:{i}", group_id=gid, prompt_id=f"p-{gid}", sample_index=i, group_size=n,
        prompt_ids=[1, 2], output_ids=[3 + i] * len(versions),
        output_logprobs=[-0.5] * len(versions), output_versions=versions, group_index=7)


def reward(gid: str, i: int, r: float) -> RewardEvent:
    return RewardEvent(traj_id=f"{gid}:{i}", group_id=gid, reward=r)


class Feed:
    """Hands events to the role with increasing offsets per topic-partition."""

    def __init__(self, role: AdvantageProcessor, partition: int = 0) -> None:
        self.role, self.state, self.partition = role, role.init_state(), partition
        self.next: dict[tuple[str, int], int] = {}
        self.sources: list[Source] = []

    def __call__(self, event, partition: int | None = None, offset: int | None = None) -> list:
        topic = TRAJ if isinstance(event, TrajectoryEvent) else REW
        partition = self.partition if partition is None else partition
        if offset is None:
            offset = self.next.get((topic, partition), 0)
            self.next[(topic, partition)] = offset + 1
        src = Source(topic=topic, partition=partition, offset=offset, key=event.group_id)
        self.sources.append(src)
        return list(self.role.handle(event, self.state, src))


def test_group_completes_only_with_all_trajectories_and_rewards():
    feed = Feed(AdvantageProcessor())
    rs = [1.0, 0.0, 0.5]
    for i in range(3):
        assert feed(traj("g", i, 3)) == []
    for i in range(2):
        assert feed(reward("g", i, rs[i])) == []
    out = feed(reward("g", 2, rs[2]))
    assert len(out) == 1 and isinstance(out[0], SampleEvent)
    assert [s.traj_id for s in out[0].sequences] == ["g:0", "g:1", "g:2"]
    assert "g" not in feed.state.pending


def test_rewards_for_all_but_one_trajectory_missing_is_incomplete():
    # All rewards known, one trajectory missing: the size comes from the trajectories.
    feed = Feed(AdvantageProcessor())
    for i in range(4):
        assert feed(reward("g", i, float(i))) == []
    for i in range(3):
        assert feed(traj("g", i, 4)) == []
    assert len(feed(traj("g", 3, 4))) == 1


@pytest.mark.parametrize("seed", range(6))
def test_any_arrival_order_gives_the_same_sample(seed):
    rs = [0.0, 1.0, 1.0, 0.25]
    events = [traj("g", i, 4) for i in range(4)] + [reward("g", i, r) for i, r in enumerate(rs)]
    random.Random(seed).shuffle(events)
    feed = Feed(AdvantageProcessor())
    outs = [feed(e) for e in events]
    assert all(o == [] for o in outs[:-1])
    (sample,) = outs[-1]
    assert [s.reward for s in sample.sequences] == rs
    assert [s.advantage for s in sample.sequences] == pytest.approx(group_advantages(rs))


def test_rewards_before_trajectories():
    feed = Feed(AdvantageProcessor())
    for i, r in enumerate([1.0, 0.0]):
        assert feed(reward("g", i, r)) == []
    assert feed(traj("g", 0, 2)) == []
    (sample,) = feed(traj("g", 1, 2))
    assert [s.advantage for s in sample.sequences] == pytest.approx(group_advantages([1.0, 0.0]))


def test_grpo_advantages_on_shaped_rewards_and_versions():
    role = AdvantageProcessor(estimator="grpo", reward_bias=-0.5, reward_scaling=4.0,
                              reward_clip=1.5)
    feed = Feed(role)
    raw = [1.0, 0.0, 0.6, 0.5]
    versions = [[2, 3], [4, 4, 5], [1], [3, 3]]
    for i in range(4):
        feed(traj("g", i, 4, versions[i]))
    out = []
    for i, r in enumerate(raw):
        out += feed(reward("g", i, r))
    (sample,) = out
    # (1-0.5)*4=2 -> clip 1.5; (0-0.5)*4=-2 -> -1.5; (0.6-0.5)*4=0.4; 0
    shaped = [1.5, -1.5, 0.4, 0.0]
    assert [s.reward for s in sample.sequences] == pytest.approx(shaped)
    assert shaped == pytest.approx([shape_reward(r, bias=-0.5, scale=4.0, clip=1.5) for r in raw])
    expected = group_advantages(shaped, estimator="grpo", eps=1e-6)
    assert [s.advantage for s in sample.sequences] == pytest.approx(expected)
    assert sample.min_version == 1 and sample.max_version == 5
    assert sample.group_id == "g" and sample.prompt_id == "p-g" and sample.group_index == 7
    assert sample.estimator == "grpo"
    assert [s.output_versions for s in sample.sequences] == versions


@pytest.mark.parametrize("estimator", ["rloo", "dr_grpo"])
def test_other_estimators(estimator):
    feed = Feed(AdvantageProcessor(estimator=estimator))
    rs = [1.0, 0.0, 0.0]
    for i, r in enumerate(rs):
        feed(traj("g", i, 3))
        out = feed(reward("g", i, r))
    (sample,) = out
    # mean 1/3: dr_grpo = r - mean; rloo = r - mean of the others = 3/2 (r - mean).
    hand = {"dr_grpo": [2 / 3, -1 / 3, -1 / 3], "rloo": [1.0, -0.5, -0.5]}[estimator]
    assert [s.advantage for s in sample.sequences] == pytest.approx(hand)
    assert sample.estimator == estimator


def test_redelivered_trajectory_or_reward_before_completion_changes_nothing():
    feed = Feed(AdvantageProcessor())
    feed(traj("g", 0, 2))
    feed(reward("g", 0, 1.0))
    assert feed(traj("g", 0, 2)) == []
    # A redelivered reward keeps the first value.
    assert feed(reward("g", 0, 99.0)) == []
    assert feed(reward("g", 1, 0.0)) == []
    assert len(feed.state.pending["g"].trajectories) == 1
    (sample,) = feed(traj("g", 1, 2))
    assert [s.reward for s in sample.sequences] == [1.0, 0.0]


def test_group_recompleted_after_emission_emits_nothing():
    feed = Feed(AdvantageProcessor())
    events = [traj("g", 0, 2), traj("g", 1, 2), reward("g", 0, 1.0), reward("g", 1, 0.0)]
    assert sum(len(feed(e)) for e in events) == 1
    # The whole group redelivered: no second sample, no pending state left behind.
    assert sum(len(feed(e)) for e in events) == 0
    assert feed.state.pending == {}
    assert feed.state.groups_emitted == 1


def test_committable_is_earliest_offset_of_incomplete_groups():
    role = AdvantageProcessor()
    feed = Feed(role)
    feed(traj("a", 0, 2), offset=10)
    feed(traj("b", 0, 2), offset=11)
    feed(reward("b", 0, 1.0), offset=20)
    feed(traj("b", 1, 2), offset=12)
    assert role.committable(feed.state, TRAJ, 0, 13) == 10
    assert role.committable(feed.state, REW, 0, 21) == 20
    # Another partition is unaffected.
    assert role.committable(feed.state, TRAJ, 1, 5) == 5
    # "a" completes: the floor moves to b's earliest trajectory offset.
    feed(traj("a", 1, 2), offset=13)
    feed(reward("a", 0, 1.0), offset=21)
    assert feed(reward("a", 1, 0.0), offset=22) != []
    assert role.committable(feed.state, TRAJ, 0, 14) == 11
    assert role.committable(feed.state, REW, 0, 23) == 20
    # "b" completes: nothing is held.
    assert feed(reward("b", 1, 0.0), offset=23) != []
    assert role.committable(feed.state, TRAJ, 0, 14) == 14
    assert role.committable(feed.state, REW, 0, 24) == 24


def test_on_revoke_drops_pending_groups_of_revoked_partitions():
    role = AdvantageProcessor()
    feed = Feed(role)
    feed(traj("p0", 0, 2), partition=0)
    feed(reward("p0", 0, 1.0), partition=0)
    feed(traj("p1", 0, 2), partition=1)
    role.on_revoke(feed.state, [(TRAJ, 0), (REW, 0)])
    assert set(feed.state.pending) == {"p1"}
    assert role.committable(feed.state, TRAJ, 0, 3) == 3
    assert role.committable(feed.state, TRAJ, 1, 3) == 0
    # The group of the kept partition still completes.
    feed(traj("p1", 1, 2), partition=1)
    feed(reward("p1", 0, 1.0), partition=1)
    assert len(feed(reward("p1", 1, 0.0), partition=1)) == 1


def test_single_reward_value_group_has_zero_advantages():
    feed = Feed(AdvantageProcessor())
    out = []
    for i in range(3):
        out += feed(traj("g", i, 3))
        out += feed(reward("g", i, 1.0))
    (sample,) = out
    assert [s.advantage for s in sample.sequences] == [0.0, 0.0, 0.0]


def test_permutations_of_two_groups_interleaved():
    # Two groups interleaved in every order still give exactly two samples.
    base = [traj("x", 0, 1), reward("x", 0, 1.0), traj("y", 0, 1), reward("y", 0, 0.0)]
    for perm in itertools.permutations(base):
        feed = Feed(AdvantageProcessor())
        out = [s for e in perm for s in feed(e)]
        assert sorted(s.group_id for s in out) == ["x", "y"]


def test_group_whose_shaping_fails_is_raised_again_on_retry():
    # A bad shaping config (clip < 0) raises when the group completes. The bus retries
    # the event, then dead-letters it: the retry must raise again (not find the group
    # "already emitted" and drop it silently) and the group keeps holding the commit.
    from tapioca.algorithms.errors import AlgorithmInputError

    role = AdvantageProcessor(reward_clip=-1.0)
    feed = Feed(role)
    feed(traj("g", 0, 2), offset=3)
    feed(traj("g", 1, 2), offset=4)
    feed(reward("g", 0, 1.0), offset=8)
    last = reward("g", 1, 0.0)
    for _ in range(2):
        with pytest.raises(AlgorithmInputError, match="clip"):
            feed(last, offset=9)
    assert "g" in feed.state.pending and "g" not in feed.state.emitted
    assert feed.state.groups_emitted == 0
    assert role.committable(feed.state, TRAJ, 0, 5) == 3
    assert role.committable(feed.state, REW, 0, 10) == 8


def test_group_incomplete_past_its_timeout_is_dropped_and_releases_the_commit_floor():
    import time as _time

    feed = Feed(AdvantageProcessor(group_timeout_s=0.05))
    feed(traj("g-lost", 0, 2))  # its second trajectory was dead-lettered upstream
    feed(reward("g-lost", 0, 1.0))
    assert feed.role.committable(feed.state, TRAJ, 0, 1) == 0
    assert list(feed.role.on_tick(feed.state, _time.time())) == []  # not yet timed out
    _time.sleep(0.06)
    (dropped,) = feed.role.on_tick(feed.state, _time.time())
    assert isinstance(dropped, SampleEvent) and dropped.group_id == "g-lost"
    assert dropped.sequences == [] and "1 of 2 trajectories" in dropped.dropped_reason
    assert feed.role.committable(feed.state, TRAJ, 0, 1) == 1
    # A late straggler of a dropped group changes nothing.
    assert feed(traj("g-lost", 1, 2)) == [] and feed(reward("g-lost", 1, 0.0)) == []
    assert feed.state.pending == {}
