"""AdvantageProcessor as a plain function of events: joins, advantages, de-duplication,
the commit floor and revocation. No broker."""

from __future__ import annotations

import itertools
import random

import pytest

from tapioca.algorithms.advantages import group_advantages, shape_reward
from tapioca.bus.role import Source
from tapioca.config.schema import AdvantageConfig, NormConfig, RewardNormConfig
from tapioca.config.sections import AdvantageSection, advantage_section
from tapioca.consumers.advantage import AdvantageProcessor
from tapioca.schemas.errors import BadEventError, ConfigError
from tapioca.schemas.events import RewardEvent, SampleEvent, TrajectoryEvent

TRAJ, REW = "t.trajectories.v1", "t.rewards.v1"


def processor(*, clock=None, max_new_tokens: int = 8, n_samples: int = 4, adv_norm=None,
              reward_norm=None, **advantage) -> AdvantageProcessor:
    """The processor of an ``advantage`` section with these fields (the norms as keyword
    dicts). A ``reward_clip`` below 0, which the config refuses, is set on the frozen
    section anyway: the role must survive a shaping config that raises (dead-letter)."""
    if adv_norm is not None:
        advantage["adv_norm"] = NormConfig(**adv_norm)
    if reward_norm is not None:
        advantage["reward_norm"] = RewardNormConfig(**reward_norm)
    clip = advantage.get("reward_clip")
    unchecked = clip is not None and clip < 0
    if unchecked:
        del advantage["reward_clip"]
    cfg = AdvantageConfig(**advantage)
    if unchecked:
        object.__setattr__(cfg, "reward_clip", clip)
    section = AdvantageSection(advantage=cfg, max_new_tokens=max_new_tokens, n_samples=n_samples)
    return AdvantageProcessor(section) if clock is None else AdvantageProcessor(section, clock=clock)


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
    feed = Feed(processor())
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
    feed = Feed(processor())
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
    feed = Feed(processor())
    outs = [feed(e) for e in events]
    assert all(o == [] for o in outs[:-1])
    (sample,) = outs[-1]
    assert [s.reward for s in sample.sequences] == rs
    assert [s.advantage for s in sample.sequences] == pytest.approx(group_advantages(rs))


def test_rewards_before_trajectories():
    feed = Feed(processor())
    for i, r in enumerate([1.0, 0.0]):
        assert feed(reward("g", i, r)) == []
    assert feed(traj("g", 0, 2)) == []
    (sample,) = feed(traj("g", 1, 2))
    assert [s.advantage for s in sample.sequences] == pytest.approx(group_advantages([1.0, 0.0]))


def test_grpo_advantages_on_shaped_rewards_and_versions():
    role = processor(estimator="grpo", reward_bias=-0.5, reward_scaling=4.0,
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
    feed = Feed(processor(estimator=estimator))
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
    feed = Feed(processor())
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
    feed = Feed(processor())
    events = [traj("g", 0, 2), traj("g", 1, 2), reward("g", 0, 1.0), reward("g", 1, 0.0)]
    assert sum(len(feed(e)) for e in events) == 1
    # The whole group redelivered: no second sample, no pending state left behind.
    assert sum(len(feed(e)) for e in events) == 0
    assert feed.state.pending == {}
    assert feed.state.groups_emitted == 1


def test_committable_is_earliest_offset_of_incomplete_groups():
    role = processor()
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
    role = processor()
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
    feed = Feed(processor())
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
        feed = Feed(processor())
        out = [s for e in perm for s in feed(e)]
        assert sorted(s.group_id for s in out) == ["x", "y"]


def test_group_whose_shaping_fails_is_raised_again_on_retry():
    # A bad shaping config (clip < 0) raises when the group completes. The bus dead-
    # letters the event (BadEventError: no retry fixes it); a redelivery must raise again
    # (not find the group "already emitted" and drop it silently) and the group keeps
    # holding the commit until the reward timeout drops it.
    from tapioca.schemas.errors import BadEventError

    role = processor(reward_clip=-1.0)
    feed = Feed(role)
    feed(traj("g", 0, 2), offset=3)
    feed(traj("g", 1, 2), offset=4)
    feed(reward("g", 0, 1.0), offset=8)
    last = reward("g", 1, 0.0)
    for _ in range(2):
        with pytest.raises(BadEventError, match="group g cannot be built: .*clip"):
            feed(last, offset=9)
    assert "g" in feed.state.pending and "g" not in feed.state.emitted
    assert feed.state.groups_emitted == 0
    assert role.committable(feed.state, TRAJ, 0, 5) == 3
    assert role.committable(feed.state, REW, 0, 10) == 8


def test_group_incomplete_past_its_timeout_is_dropped_and_releases_the_commit_floor():
    import time as _time

    feed = Feed(processor(group_timeout_s=0.05))
    feed(traj("g-lost", 0, 2))  # its second trajectory was dead-lettered upstream
    feed(reward("g-lost", 0, 1.0))
    assert feed.role.committable(feed.state, TRAJ, 0, 1) == 0
    assert list(feed.role.on_tick(feed.state, _time.time())) == []  # not yet timed out
    _time.sleep(0.06)
    (dropped,) = feed.role.on_tick(feed.state, _time.time())
    assert isinstance(dropped, SampleEvent) and dropped.group_id == "g-lost"
    assert dropped.sequences == [] and "1 of 2 trajectories" in dropped.dropped_reason
    assert feed.role.committable(feed.state, TRAJ, 0, 1) == 1
    # A late straggler of a dropped group changes nothing; its reward came too late to
    # train, which the dead letter says (issue 22: nothing dropped silently).
    assert feed(traj("g-lost", 1, 2)) == []
    with pytest.raises(BadEventError, match="g-lost was dropped .timeout after 0 s"):
        feed(reward("g-lost", 1, 0.0))
    assert feed.state.pending == {}


# ------------------------------------------------ estimators, DAPO and reward sources


class Clock:
    """A hand-advanced monotonic clock for the timeout tests."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def sreward(gid: str, i: int, r: float, scorer: str) -> RewardEvent:
    return RewardEvent(traj_id=f"{gid}:{i}", group_id=gid, reward=r, scorer=scorer)


def feed_group(feed: Feed, gid: str, rewards: list[float], **traj_kw) -> list:
    out = []
    for i, r in enumerate(rewards):
        out += feed(traj(gid, i, len(rewards), **traj_kw))
        out += feed(reward(gid, i, r))
    return out


def test_dynamic_sampling_filters_zero_variance_groups_with_a_reason():
    feed = Feed(processor(dynamic_sampling=True))
    (filtered,) = feed_group(feed, "same", [1.0, 1.0, 1.0])
    assert filtered.dropped_reason == "filtered: zero reward variance (all 1.0)"
    # It stays in the log with its data: rewards kept, advantages 0.
    assert [s.reward for s in filtered.sequences] == [1.0, 1.0, 1.0]
    assert [s.advantage for s in filtered.sequences] == [0.0, 0.0, 0.0]
    from tapioca.schemas.envelope import decode_event, encode_event

    again = decode_event(encode_event(filtered))  # a valid event on samples.v1
    assert again.dropped_reason == filtered.dropped_reason and len(again.sequences) == 3
    (kept,) = feed_group(feed, "mixed", [1.0, 0.0, 1.0])
    assert kept.dropped_reason == "" and kept.sequences[0].advantage > 0
    d = feed.role.describe(feed.state)
    assert (d["filtered"], d["emitted"], d["dropped"], d["pending_groups"]) == (1, 1, 0, 0)
    # A redelivered reward of the filtered group is late and changes nothing.
    assert feed(reward("same", 0, 0.0)) == []
    assert feed.role.describe(feed.state)["late_rewards"] == 1


def test_dynamic_sampling_compares_shaped_rewards():
    # Raw [2, 5] differ, but clip 1 makes both 1.0 after shaping: filtered.
    feed = Feed(processor(dynamic_sampling=True, reward_clip=1.0))
    (sample,) = feed_group(feed, "g", [2.0, 5.0])
    assert sample.dropped_reason.startswith("filtered:")


def test_weighted_sources_complete_only_when_every_source_scored_every_trajectory():
    feed = Feed(processor(estimator="dr_grpo",
                                   reward_weights={"acc": 1.0, "judge": 0.5}))
    for i in range(2):
        assert feed(traj("g", i, 2)) == []
        assert feed(sreward("g", i, 1.0, "acc")) == []
    assert feed(sreward("g", 0, 0.2, "judge")) == []
    # Not weighted: ignored (and not needed for completion).
    assert feed(sreward("g", 1, 5.0, "style")) == []
    # Same (traj, scorer) again: the first value wins.
    assert feed(sreward("g", 0, 0.9, "judge")) == []
    (sample,) = feed(sreward("g", 1, 0.6, "judge"))
    # traj0: 1 + 0.5*0.2 = 1.1 ; traj1: 1 + 0.5*0.6 = 1.3 ; dr_grpo: mean 1.2 -> -+0.1.
    assert [s.reward for s in sample.sequences] == pytest.approx([1.1, 1.3])
    assert [s.advantage for s in sample.sequences] == pytest.approx([-0.1, 0.1])
    d = feed.role.describe(feed.state)
    assert (d["ignored_rewards"], d["duplicate_rewards"], d["emitted"]) == (1, 1, 1)


def test_without_weights_the_first_reward_from_any_scorer_wins():
    feed = Feed(processor())
    feed(traj("g", 0, 2))
    feed(traj("g", 1, 2))
    assert feed(sreward("g", 0, 1.0, "a")) == []
    assert feed(sreward("g", 0, 0.0, "b")) == []  # a second reward for traj 0: duplicate
    (sample,) = feed(sreward("g", 1, 0.0, "b"))
    assert [s.reward for s in sample.sequences] == [1.0, 0.0]
    assert feed.role.describe(feed.state)["duplicate_rewards"] == 1


def _timeout_feed(policy: str) -> tuple[Feed, Clock]:
    clock = Clock()
    role = processor(estimator="dr_grpo", reward_weights={"acc": 1.0, "judge": 1.0},
                              reward_timeout_s=30.0, missing_reward=policy, clock=clock)
    feed = Feed(role)
    feed(traj("g", 0, 2))
    clock.t += 100.0  # time before all trajectories are present does not count
    feed(traj("g", 1, 2))
    for i in range(2):
        feed(sreward("g", i, float(i), "acc"))
    feed(sreward("g", 0, 1.0, "judge"))  # judge never scores traj 1
    clock.t += 29.0
    assert list(role.on_tick(feed.state, 0.0)) == []
    clock.t += 1.0
    return feed, clock


def test_reward_timeout_drop_names_the_missing_sources():
    feed, _ = _timeout_feed("drop")
    (dropped,) = feed.role.on_tick(feed.state, 0.0)
    assert dropped.sequences == []
    assert dropped.dropped_reason == ("reward timeout after 30 s: "
                                      "missing judge for 1 of 2 trajectories")
    assert feed.state.pending == {} and feed.role.committable(feed.state, TRAJ, 0, 2) == 2
    # The missing reward arrives after all: too late, dead-lettered with the drop reason.
    with pytest.raises(BadEventError, match="reward timeout after 30 s: missing judge"):
        feed(sreward("g", 1, 1.0, "judge"))
    d = feed.role.describe(feed.state)
    assert (d["dropped"], d["late_rewards"], d["emitted"]) == (1, 1, 0)


def test_reward_timeout_zero_counts_missing_sources_as_zero():
    feed, _ = _timeout_feed("zero")
    (sample,) = feed.role.on_tick(feed.state, 0.0)
    # traj0: acc 0 + judge 1 = 1 ; traj1: acc 1 + judge missing -> 0 = 1. dr_grpo: 0, 0.
    assert sample.dropped_reason == ""
    assert [s.reward for s in sample.sequences] == [1.0, 1.0]
    assert [s.advantage for s in sample.sequences] == [0.0, 0.0]
    d = feed.role.describe(feed.state)
    assert (d["zero_filled"], d["emitted"]) == (1, 1)


def test_reward_timeout_without_weights_counts_trajectories_without_a_reward():
    clock = Clock()
    role = processor(reward_timeout_s=5.0, clock=clock)
    feed = Feed(role)
    for i in range(3):
        feed(traj("g", i, 3))
    feed(reward("g", 0, 1.0))
    clock.t += 5.0
    (dropped,) = role.on_tick(feed.state, 0.0)
    assert dropped.dropped_reason == ("reward timeout after 5 s: "
                                      "missing rewards for 2 of 3 trajectories")


def test_complete_groups_waiting_for_rewards_are_warned_about(caplog):
    """A dead reward service: groups are complete but no reward comes. Without a reward
    timeout nothing is dropped for group_timeout_s (600 s); the processor says so after
    30 s, names the scorer that is missing, and repeats at most once a minute."""
    clock = Clock()
    role = processor(reward_weights={"judge": 1.0}, clock=clock)
    feed = Feed(role)
    for i in range(2):
        feed(traj("g", i, 2))
    with caplog.at_level("WARNING", logger="tapioca.consumers.advantage"):
        clock.t += 29.0
        assert list(role.on_tick(feed.state, 0.0)) == [] and not caplog.records
        clock.t += 1.0
        role.on_tick(feed.state, 0.0)
        assert len(caplog.records) == 1
        msg = caplog.records[0].getMessage()
        assert "1 complete group(s)" in msg and "2 from 'judge'" in msg
        assert "group_timeout_s=600" in msg
        assert role.describe(feed.state)["waiting_for_rewards"] == 1
        clock.t += 30.0
        role.on_tick(feed.state, 0.0)
        assert len(caplog.records) == 1  # not again within a minute
        clock.t += 30.0
        role.on_tick(feed.state, 0.0)
        assert len(caplog.records) == 2
    for i in range(2):
        feed(RewardEvent(traj_id=f"g:{i}", group_id="g", reward=1.0, scorer="judge"))
    role.on_tick(feed.state, 0.0)
    assert role.describe(feed.state)["waiting_for_rewards"] == 0


def test_group_timeout_still_drops_groups_with_missing_trajectories():
    clock = Clock()
    role = processor(reward_timeout_s=5.0, group_timeout_s=60.0, clock=clock)
    feed = Feed(role)
    feed(traj("g", 0, 2))
    feed(reward("g", 0, 1.0))
    clock.t += 59.0
    assert list(role.on_tick(feed.state, 0.0)) == []  # the reward timeout never started
    clock.t += 2.0
    (dropped,) = role.on_tick(feed.state, 0.0)
    assert "1 of 2 trajectories" in dropped.dropped_reason


def test_overlong_penalty_is_applied_before_shaping_and_normalisation():
    # max_new 8, tail 4: lengths 3 and 6 (loss-mask ones) -> penalties 0 and -(6-4)/4 = -0.5.
    role = processor(estimator="dr_grpo", overlong_reward_penalty=True,
                              overlong_tokens=4, overlong_penalty_factor=1.0, max_new_tokens=8,
                              reward_scaling=2.0)
    feed = Feed(role)
    t0 = traj("g", 0, 2, versions=[0, 0, 0])
    t1 = traj("g", 1, 2, versions=[0] * 7)
    t1.loss_mask = [1, 1, 1, 1, 1, 1, 0]  # a tool token is not counted: length 6
    feed(t0)
    feed(t1)
    feed(reward("g", 0, 1.0))
    (sample,) = feed(reward("g", 1, 1.0))
    # shaped: (1 + 0) * 2 = 2.0 ; (1 - 0.5) * 2 = 1.0 ; dr_grpo: mean 1.5 -> [0.5, -0.5].
    assert [s.reward for s in sample.sequences] == pytest.approx([2.0, 1.0])
    assert [s.advantage for s in sample.sequences] == pytest.approx([0.5, -0.5])


@pytest.mark.parametrize("estimator, expected", [
    ("reinforce_pp", [1.0, 0.0, 0.5]),  # no group baseline: the shaped reward
    ("gae", [0.0, 0.0, 0.0]),           # the trainer computes GAE
    ("lite_ppo", [0.5, -0.5, 0.0]),     # group mean 0.5; batch std in the trainer
])
def test_estimators_without_a_group_std(estimator, expected):
    feed = Feed(processor(estimator=estimator))
    (sample,) = feed_group(feed, "g", [1.0, 0.0, 0.5])
    assert [s.reward for s in sample.sequences] == [1.0, 0.0, 0.5]
    assert [s.advantage for s in sample.sequences] == pytest.approx(expected)
    assert sample.estimator == estimator


def test_explicit_adv_norm_overrides_the_preset():
    # estimator grpo, but adv_norm says leave-one-out mean and no std: RLOO numbers.
    role = processor(estimator="grpo", adv_norm={
        "mean_level": "group", "std_level": "none", "mean_leave1out": True,
        "std_unbiased": False, "eps": 1e-6})
    (sample,) = feed_group(Feed(role), "g", [1.0, 0.0, 0.0])
    # r=1: 1 - 0 = 1 ; r=0: 0 - (1+0)/2 = -0.5.
    assert [s.advantage for s in sample.sequences] == pytest.approx([1.0, -0.5, -0.5])


def test_processor_from_config_section():
    from tapioca.config.loader import load_config
    from tapioca.config.schema import TrainConfig
    from tapioca.config.sections import advantage_section

    cfg = load_config(TrainConfig, None, [
        "advantage.estimator=rloo", "advantage.dynamic_sampling=true",
        "advantage.overlong_reward_penalty=true", "advantage.overlong_tokens=2",
        "advantage.overlong_penalty_factor=1.0", "gconfig.max_new_tokens=6",
        "advantage.reward_weights.acc=1.0", "advantage.reward_timeout_s=9",
        "advantage.missing_reward=zero"])
    sec = advantage_section(cfg)
    assert sec.max_new_tokens == 6
    role = AdvantageProcessor(sec)
    assert role.norm["mean_leave1out"] and role.norm["std_level"] == "none"
    assert role.overlong == (6, 2, 1.0) and role.sources == ("acc",)
    assert role.dynamic_sampling and role.missing_reward == "zero"


def test_config_errors_say_what_to_change():
    from tapioca.config.loader import load_config
    from tapioca.config.schema import TrainConfig
    from tapioca.schemas.errors import ConfigError

    bad = [
        (["advantage.estimator=ppo"], "reinforce_pp_baseline"),
        (["advantage.adv_norm.mean_level=batch", "advantage.adv_norm.std_level=group"],
         "batch mean"),
        (["advantage.estimator=gae", "advantage.adv_norm.mean_level=group",
          "advantage.adv_norm.std_level=batch"], "gae"),
        (["advantage.overlong_reward_penalty=true"], "overlong_tokens"),
        (["advantage.missing_reward=wait"], "drop or zero"),
        (["advantage.reward_weights.judge=0"], "non-zero"),
        (["advantage.reward_timeout_s=0"], "reward_timeout_s"),
        (["advantage.reward_timeout_s=600"], "lower reward_timeout_s or raise group_timeout_s"),
        (["advantage.reward_timeout_s=90", "advantage.group_timeout_s=60"],
         r"reward_timeout_s=90 must be less than advantage.group_timeout_s=60"),
    ]
    for overrides, words in bad:
        with pytest.raises(ConfigError, match=words):
            load_config(TrainConfig, None, overrides)
    # Cross-section (checked once, by TrainConfig): the penalised tail must fit the
    # generation limit.
    with pytest.raises(ConfigError, match="max_new_tokens"):
        load_config(TrainConfig, None, [
            "advantage.overlong_reward_penalty=true", "advantage.overlong_tokens=9",
            "advantage.overlong_penalty_factor=1.0", "gconfig.max_new_tokens=8"])
    with pytest.raises(ConfigError, match="n_samples"):
        load_config(TrainConfig, None, ["advantage.dynamic_sampling=true", "gconfig.n_samples=1"])
    # AReaL writes "no normalisation" as null.
    cfg = load_config(TrainConfig, None, ["advantage.adv_norm.mean_level=group",
                                          "advantage.adv_norm.std_level=null"])
    assert cfg.advantage.norm().std_level == "none"


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_reward_from_an_external_service_fails_validation(literal):
    # What Python's json.dumps writes for a NaN reward: not JSON, so decode raises
    # SchemaError and the runner dead-letters the event (it never reaches handle()).
    import orjson

    from tapioca.schemas.envelope import decode_event, encode_event
    from tapioca.schemas.errors import SchemaError

    raw = encode_event(RewardEvent(traj_id="g:0", group_id="g", reward=0.5, scorer="judge"))
    bad = raw.replace(orjson.dumps(0.5), literal.encode())
    assert bad != raw
    with pytest.raises(SchemaError):
        decode_event(bad)


def test_reward_timeout_drops_a_complete_group_that_cannot_be_built():
    # clip < 0 makes shaping raise in handle() (dead-lettered by the bus); the reward
    # timeout then drops the group with the reason instead of holding it.
    from tapioca.schemas.errors import BadEventError

    clock = Clock()
    role = processor(reward_clip=-1.0, reward_timeout_s=5.0, clock=clock)
    feed = Feed(role)
    feed(traj("g", 0, 1))
    with pytest.raises(BadEventError):
        feed(reward("g", 0, 1.0))
    clock.t += 5.0
    (dropped,) = role.on_tick(feed.state, 0.0)
    assert dropped.dropped_reason.startswith("reward timeout: cannot build the group")
    assert "clip" in dropped.dropped_reason and feed.state.pending == {}


def test_paused_time_does_not_count_towards_the_timeouts():
    clock = Clock()
    role = processor(reward_timeout_s=5.0, group_timeout_s=60.0, clock=clock)
    feed = Feed(role)
    feed(traj("waiting", 0, 2))          # group timeout running
    for i in range(2):
        feed(traj("scoring", i, 2))      # reward timeout running
    clock.t += 3.0
    role.on_pause(feed.state, True)
    clock.t += 1000.0                    # paused far past both timeouts: its events wait in Kafka
    role.on_pause(feed.state, False)
    assert list(role.on_tick(feed.state, 0.0)) == []
    assert set(feed.state.pending) == {"waiting", "scoring"}
    # After the resume the timers go on from where they stopped (3 s used).
    (sample,) = feed(reward("scoring", 0, 1.0)) + feed(reward("scoring", 1, 0.0))
    assert sample.dropped_reason == ""
    clock.t += 56.0
    assert list(role.on_tick(feed.state, 0.0)) == []
    clock.t += 2.0
    (dropped,) = role.on_tick(feed.state, 0.0)
    assert dropped.group_id == "waiting" and dropped.dropped_reason.startswith("timeout after 60 s")
    # A second pause without a resume in between does not restart the pause clock.
    feed(traj("late", 0, 2))
    role.on_pause(feed.state, True)
    clock.t += 10.0
    role.on_pause(feed.state, True)
    clock.t += 10.0
    role.on_pause(feed.state, False)
    clock.t += 59.0
    assert list(role.on_tick(feed.state, 0.0)) == []


def test_reward_timeout_still_fires_after_a_pause_shorter_than_it():
    clock = Clock()
    role = processor(reward_timeout_s=5.0, clock=clock)
    feed = Feed(role)
    for i in range(2):
        feed(traj("g", i, 2))
    clock.t += 4.0
    role.on_pause(feed.state, True)
    clock.t += 2.0
    role.on_pause(feed.state, False)
    assert list(role.on_tick(feed.state, 0.0)) == []
    clock.t += 1.0
    (dropped,) = role.on_tick(feed.state, 0.0)
    assert dropped.dropped_reason.startswith("reward timeout after 5 s")


def test_rewards_from_two_scorers_without_weights_warn_once_and_are_counted(caplog):
    feed = Feed(processor())
    feed(traj("g", 0, 2))
    feed(traj("g", 1, 2))
    with caplog.at_level("WARNING", logger="tapioca.consumers.advantage"):
        feed(sreward("g", 0, 1.0, "builtin"))
        assert feed.role.describe(feed.state)["mixed_scorers"] == 0
        feed(sreward("g", 0, 0.0, "judge"))
        feed(sreward("g", 1, 0.0, "judge"))
        feed(traj("h", 0, 1))
        feed(sreward("h", 0, 0.5, "judge"))
    warnings = [r for r in caplog.records if "reward_weights" in r.getMessage()]
    assert len(warnings) == 1
    assert "'builtin', 'judge'" in warnings[0].getMessage()
    assert feed.role.describe(feed.state)["mixed_scorers"] == 3
    # With weights the sources are explicit: no warning, no count.
    weighted = Feed(processor(reward_weights={"builtin": 1.0, "judge": 1.0}))
    weighted(traj("g", 0, 1))
    weighted(sreward("g", 0, 1.0, "builtin"))
    weighted(sreward("g", 0, 1.0, "judge"))
    assert weighted.role.describe(weighted.state)["mixed_scorers"] == 0


# ------------------------------------------------------------------ reward_norm
# advantage.reward_norm (AReaL's): each group's shaped rewards are normalised before the
# estimator. R = [3, 1, 0, 0]: mean 1, c = [2, 0, -1, -1], population std sqrt(6/4) =
# 1.2247449, so with eps 0 r' = c/s = [1.6329932, 0, -0.8164966, -0.8164966].
RN_R = [3.0, 1.0, 0.0, 0.0]
RN_NORMED = [1.6329932, 0.0, -0.8164966, -0.8164966]
GROUP_GROUP = {"mean_level": "group", "std_level": "group", "mean_leave1out": False,
               "std_unbiased": False, "eps": 0.0}


def test_reward_norm_is_off_by_default():
    (sample,) = feed_group(Feed(processor()), "g", RN_R)
    assert sample.reward_norm == "none"
    assert [s.norm_reward for s in sample.sequences] == [None] * 4
    assert [s.reward for s in sample.sequences] == RN_R
    assert [s.advantage for s in sample.sequences] == pytest.approx(group_advantages(RN_R))


def test_reward_norm_feeds_the_estimator_and_keeps_the_raw_reward():
    # Shaping first (bias -1, scale 2: [4, 0, -2, -2], the same c/s after centring:
    # c = [4, 0, -2, -2] - 0 -> s = sqrt(24/4) = 2.4494897 -> r' = RN_NORMED), then
    # reward_norm, then dr_grpo's group mean on r' (mean 0): A = r'.
    role = processor(estimator="dr_grpo", reward_bias=-1.0, reward_scaling=2.0,
                              reward_norm=GROUP_GROUP)
    (sample,) = feed_group(Feed(role), "g", RN_R)
    assert [s.reward for s in sample.sequences] == [4.0, 0.0, -2.0, -2.0]  # shaped, raw
    assert [s.norm_reward for s in sample.sequences] == pytest.approx(RN_NORMED, abs=1e-7)
    assert [s.advantage for s in sample.sequences] == pytest.approx(RN_NORMED, abs=1e-7)
    assert sample.reward_norm == "mean=group std=group leave1out=0 unbiased=0 eps=0"


def test_reward_norm_leave_one_out_and_singleton_through_the_processor():
    loo = dict(GROUP_GROUP, std_level="none", mean_leave1out=True)
    role = processor(estimator="reinforce_pp", reward_norm=loo)
    feed = Feed(role)
    # r_i - mean of the others: 3 - 1/3, 1 - 3/3, 0 - 4/3: reinforce_pp passes r' on.
    (sample,) = feed_group(feed, "g", RN_R)
    assert [s.advantage for s in sample.sequences] == pytest.approx(
        [2.6666667, 0.0, -1.3333333, -1.3333333], abs=1e-7)
    # A group of one has no baseline: exactly 0, while its reward stays as scored.
    (one,) = feed_group(feed, "h", [5.0])
    assert (one.sequences[0].reward, one.sequences[0].norm_reward) == (5.0, 0.0)
    assert one.sequences[0].advantage == 0.0


def test_reward_norm_all_equal_group_and_dynamic_sampling():
    # All equal: r' exactly 0; dynamic sampling still names the shaped reward.
    (plain,) = feed_group(Feed(processor(reward_norm=GROUP_GROUP)), "g", [1.0] * 3)
    assert [s.norm_reward for s in plain.sequences] == [0.0] * 3
    assert [s.advantage for s in plain.sequences] == [0.0] * 3 and not plain.dropped_reason
    role = processor(reward_norm=GROUP_GROUP, dynamic_sampling=True)
    (filtered,) = feed_group(Feed(role), "g", [1.0] * 3)
    assert filtered.dropped_reason == "filtered: zero reward variance (all 1.0)"


def test_reward_norm_both_levels_none_is_off():
    none = dict(GROUP_GROUP, mean_level="none", std_level="none")
    (sample,) = feed_group(Feed(processor(reward_norm=none)), "g", RN_R)
    assert sample.reward_norm == "none" and sample.sequences[0].norm_reward is None


def test_reward_norm_batch_levels_are_config_errors():
    from tapioca.config.loader import load_config
    from tapioca.config.schema import TrainConfig
    from tapioca.schemas.errors import ConfigError

    for level in ("mean_level", "std_level"):
        with pytest.raises(ConfigError, match=f"advantage.reward_norm: {level}=batch is not "
                           "supported.*advantage.adv_norm batch levels"):
            load_config(TrainConfig, None, [f"advantage.reward_norm.{level}=batch"])
        with pytest.raises(ConfigError, match="adv_norm batch levels"):
            processor(reward_norm=dict(GROUP_GROUP, **{level: "batch"}))
    with pytest.raises(ConfigError, match="advantage.reward_norm: mean_level='prompt'"):
        load_config(TrainConfig, None, ["advantage.reward_norm.mean_level=prompt"])
    assert load_config(TrainConfig).advantage.reward_norm is None


def test_areal_style_reward_norm_yaml_loads(tmp_path):
    # AReaL's GRPO example: reward_norm group/group, adv_norm batch/batch, each with
    # group_size: ${gconfig.n_samples}.
    from tapioca.config.loader import load_config
    from tapioca.config.schema import TrainConfig
    from tapioca.schemas.errors import ConfigError

    path = tmp_path / "areal.yaml"
    path.write_text("gconfig:\n  n_samples: 4\nadvantage:\n"
                    "  reward_norm:\n    mean_level: group\n    std_level: group\n"
                    "    group_size: ${gconfig.n_samples}\n"
                    "  adv_norm:\n    mean_level: batch\n    std_level: batch\n"
                    "    group_size: ${gconfig.n_samples}\n")
    cfg = load_config(TrainConfig, str(path), ["advantage.reward_norm.eps=0"])
    assert cfg.advantage.reward_norm.group_size == 4
    role = AdvantageProcessor(advantage_section(cfg))
    (sample,) = feed_group(Feed(role), "g", RN_R)
    # Group levels of adv_norm: none, so the processor's advantage is r' itself; the
    # batch levels are the trainer's.
    assert [s.advantage for s in sample.sequences] == pytest.approx(RN_NORMED, abs=1e-7)
    with pytest.raises(ConfigError, match="reward_norm.group_size=3 differs from "
                       "gconfig.n_samples=4"):
        load_config(TrainConfig, str(path), ["advantage.reward_norm.group_size=3"])
    with pytest.raises(ConfigError, match="advantage.adv_norm.group_size=0 must be >= 1"):
        load_config(TrainConfig, str(path), ["advantage.adv_norm.group_size=0"])


def _tiny_trainer(run_dir, advantage, **actor_kw):
    from tapioca.config.optimizer import OptimizerConfig
    from tapioca.config.schema import ActorConfig, ModelConfig
    from tapioca.config.sections import TrainerSection
    from tapioca.models.factory import build_tiny_model
    from tapioca.runtime.builders import build_token_models
    from tapioca.trainers.ppo_actor import PPOActor
    from tapioca.trainers.trainer import Trainer

    model = build_tiny_model(16, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64, max_position_embeddings=64, seed=0)
    actor_cfg = ActorConfig(optimizer=OptimizerConfig(lr=1e-2), **actor_kw)
    actor = PPOActor(model, actor_cfg, temperature=1.0, pad_token_id=0)
    section = TrainerSection(actor=actor_cfg, model=ModelConfig(), max_head_offpolicyness=1,
                             prompts_per_step=2, total_train_steps=100, temperature=1.0,
                             run_dir=str(run_dir), seed=0, stop_at_reward=None,
                             advantage=advantage)
    return Trainer(section, actor=actor, **build_token_models(section, actor))


def test_reward_norm_feeds_gae_in_the_trainer(tmp_path):
    # estimator gae, reward_norm group/group (eps 0), no advantage normalisation;
    # gamma 0.5, lambda 1, three trained tokens per sequence. The fresh critic's value
    # head is zero-initialised, so V = 0 and delta_t = r_t: the terminal reward r' on
    # the last token gives A = [0.25 r', 0.5 r', r'] (A_t = sum_k (gamma lambda)^k r_{t+k}).
    # r' = RN_NORMED: seq 0 -> [0.4082483, 0.8164966, 1.6329932], seq 1 -> 0,
    # seqs 2, 3 -> [-0.2041241, -0.4082483, -0.8164966].
    from tapioca.config.schema import AdvantageConfig, NormConfig, RewardNormConfig
    from tapioca.config.sections import AdvantageSection
    from tapioca.trainers.batching import flatten_groups

    adv = AdvantageConfig(estimator="gae", adv_norm=NormConfig(mean_level="none",
                                                               std_level="none"),
                          reward_norm=RewardNormConfig(eps=0.0))
    role = AdvantageProcessor(AdvantageSection(advantage=adv, max_new_tokens=8, n_samples=4))
    (sample,) = feed_group(Feed(role), "g", RN_R, versions=[0, 0, 0])
    assert [s.advantage for s in sample.sequences] == [0.0] * 4  # GAE is the trainer's
    assert [s.reward for s in sample.sequences] == RN_R
    trainer = _tiny_trainer(tmp_path, adv, discount=0.5, gae_lambda=1.0)
    try:
        items = flatten_groups([sample])
        trainer.token_adv.compute(items)
        assert all(v == 0.0 for it in items for v in it.token_values)
        expected = [[0.4082483, 0.8164966, 1.6329932], [0.0, 0.0, 0.0],
                    [-0.2041241, -0.4082483, -0.8164966], [-0.2041241, -0.4082483, -0.8164966]]
        for it, exp in zip(items, expected):
            assert it.token_advantages == pytest.approx(exp, abs=1e-6)
            assert it.token_returns == pytest.approx(exp, abs=1e-6)  # R = A + V, V = 0
    finally:
        trainer.sink.close()


def test_trainer_refuses_samples_with_another_reward_norm(tmp_path):
    from tapioca.bus.role import Source
    from tapioca.config.schema import AdvantageConfig, RewardNormConfig
    from tapioca.schemas.envelope import decode_event, encode_event
    from tapioca.schemas.errors import BadEventError

    on = Feed(processor(reward_norm=GROUP_GROUP))
    off = Feed(processor())
    (normed,) = feed_group(on, "a", RN_R)
    (normed2,) = feed_group(on, "b", [1.0, 0.0, 0.0, 0.0])
    (plain,) = feed_group(off, "c", RN_R)
    # The spec and the normalised reward survive the wire.
    assert decode_event(encode_event(normed)) == normed
    src = [Source(topic="t.samples.v1", partition=0, offset=k) for k in range(5)]

    t_off = _tiny_trainer(tmp_path / "off", AdvantageConfig())
    try:
        state = t_off.init_state()
        with pytest.raises(BadEventError, match="rewards normalised as 'mean=group std=group "
                           "leave1out=0 unbiased=0 eps=0'.*gives 'none'.*same "
                           "advantage.reward_norm and restart"):
            t_off.handle(normed, state, src[0])
    finally:
        t_off.sink.close()

    t_on = _tiny_trainer(tmp_path / "on", AdvantageConfig(reward_norm=RewardNormConfig(eps=0.0)))
    try:
        state = t_on.init_state()
        with pytest.raises(BadEventError, match="normalised as 'none'.*gives 'mean=group"):
            t_on.handle(plain, state, src[0])
        # Matching spec trains; an event from before the field ("") is not compared.
        older = decode_event(encode_event(normed2))
        older.reward_norm = ""
        t_on.handle(normed, state, src[1])
        t_on.handle(older, state, src[2])
        assert state.progress.version == 1 and state.trained == {"a", "b"}
        # The reward metrics read the raw (shaped) reward, not r': (4 + 1) / 8.
        assert state.last_reward == pytest.approx(0.625)
    finally:
        t_on.sink.close()


def test_overflowing_reward_is_dead_lettered_and_its_group_dropped_at_the_timeout():
    """A reward of 1.5e308 overflowed the group statistics (OverflowError in handle and
    again in every tick). Now it is refused with the reason (dead-lettered by the bus),
    the rest of the group is kept, and the reward timeout drops the group."""
    from tapioca.schemas.errors import BadEventError

    clock = Clock()
    role = processor(reward_timeout_s=5.0, clock=clock)
    feed = Feed(role)
    feed(traj("g", 0, 2))
    feed(traj("g", 1, 2))
    feed(reward("g", 0, 1.0))
    with pytest.raises(BadEventError, match=r"reward 1.5e\+308 for trajectory g:1 .*beyond"):
        feed(reward("g", 1, 1.5e308))
    assert list(role.on_tick(feed.state, 0.0)) == []
    clock.t += 5.0
    (dropped,) = role.on_tick(feed.state, 0.0)
    assert dropped.group_id == "g" and "missing rewards for 1 of 2" in dropped.dropped_reason
    # Large but safe rewards still make a group.
    (ok,) = feed_group(feed, "big", [1e9, -1e9])
    assert ok.dropped_reason == "" and [s.advantage for s in ok.sequences] == pytest.approx([1, -1], abs=1e-6)


def test_shaped_rewards_that_overflow_cannot_be_built():
    """Within the per-reward bound, a shaping config can still overflow (here a scale of
    1e300): the completing event is dead-lettered instead of an OverflowError escaping."""
    from tapioca.schemas.errors import BadEventError

    feed = Feed(processor(reward_scaling=1e300))
    feed(traj("g", 0, 2))
    feed(traj("g", 1, 2))
    feed(reward("g", 0, 1e9))
    with pytest.raises(BadEventError, match="group g cannot be built"):
        feed(reward("g", 1, -1e9))
    assert "g" in feed.state.pending


def test_a_group_without_a_shared_prompt_is_built_and_trained(tmp_path):
    """Issue 22: the proxy publishes a group whose completions share no prompt token with
    ``prompt_ids=[]`` (each context in the output, loss mask 0). The processor builds its
    sample as it is and the trainer trains it (its first context token as the prompt)."""
    from tapioca.producers.proxy.sessions import Completion, SessionStore

    store = SessionStore(ttl_s=60, max_sessions=10, max_tokens_per_session=1000, run_tag="r",
                         decode=lambda ids: "")
    admit = iter(range(10)).__next__
    events = []
    for g in range(2):  # the trainer's step is 2 groups
        s = store.start(group_id=None, group_size=1, sample_index=None, task="", task_data={},
                        policy_version=0, admit=admit)
        for call, prompt, out in (("c", [1, 2, 3], [10, 11]), ("r", [7, 8], [12, 13])):
            store.record(s, [Completion(call, 0, prompt, out, [-0.5] * 2, [0, 0], "stop")],
                         ["x"], ["x"], [[]])
        store.set_reward(s, float(g), None)
        events += store.end(s, "per_completion", 1.0).events
    adv = AdvantageConfig(adv_norm=NormConfig(mean_level="none", std_level="none"))
    feed = Feed(AdvantageProcessor(AdvantageSection(advantage=adv, max_new_tokens=8,
                                                    n_samples=1)))
    samples = [out for e in events for out in feed(e)]
    assert len(samples) == 2 and all(s.prompt_ids == [] for s in samples)
    assert samples[0].sequences[1].output_ids == [7, 8, 12, 13]
    assert samples[0].sequences[1].loss_mask == [0, 0, 1, 1]
    assert [q.advantage for q in samples[1].sequences] == [1.0, 1.0]  # no normalisation
    trainer = _tiny_trainer(tmp_path, adv)
    try:
        state = trainer.init_state()
        list(trainer.on_tick(state, 0.0))
        out = []
        for i, sample in enumerate(samples):
            out += trainer.handle(sample, state, Source("t.samples.v1", 0, i))
        # The version's verdict (WeightsEvent here; ProgressEvent once on progress.v1).
        (verdict,) = {tuple(e.group_ids) for e in out if getattr(e, "group_ids", None)}
        assert sorted(verdict) == sorted(s.group_id for s in samples)
    finally:
        trainer.sink.close()


def test_adv_norm_group_unit_token_weighs_samples_by_trained_tokens_and_names_itself():
    # AReaL's convention: rewards 1 (1 trained token) and 0 (3: one more is a tool token,
    # loss mask 0) -> mean over tokens 1/4 -> 0.75, -0.25 (per sequence: 0.5, -0.5).
    role = processor(estimator="grpo", n_samples=2, adv_norm={
        "mean_level": "group", "std_level": "none", "group_unit": "token"})
    feed = Feed(role)
    feed(TrajectoryEvent(traj_id="g:0", group_id="g", prompt_id="p-g", sample_index=0, group_size=2,
                         prompt_ids=[1, 2], output_ids=[3], output_logprobs=[-0.5], output_versions=[0]))
    feed(TrajectoryEvent(traj_id="g:1", group_id="g", prompt_id="p-g", sample_index=1, group_size=2,
                         prompt_ids=[1, 2], output_ids=[4, 5, 6, 7], output_logprobs=[-0.5] * 4,
                         output_versions=[0] * 4, loss_mask=[1, 0, 1, 1]))
    feed(reward("g", 0, 1.0))
    (sample,) = feed(reward("g", 1, 0.0))
    assert [s.advantage for s in sample.sequences] == pytest.approx([0.75, -0.25])
    assert sample.adv_norm.endswith(" unit=token")
    # The default unit keeps the spec of events written before the switch.
    assert " unit=" not in NormConfig().spec()
    with pytest.raises(ConfigError, match="group_unit"):
        RewardNormConfig(group_unit="token")
    with pytest.raises(ConfigError, match="group_unit"):
        NormConfig(group_unit="tokens")
