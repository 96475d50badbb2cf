"""The step timeline (ops/timeline.py) on hand-made events whose timestamps are chosen so
that every stage has a distinct, hand-derived duration."""

from __future__ import annotations

import pytest

from tapioca.ops.timeline import format_table, step_timelines, summarize
from tapioca.schemas.events import MetricsEvent, RewardEvent, SampleEvent, SampleSequence, TrajectoryEvent, WeightsEvent

T = 1000.0  # an epoch second


def _events(eta0: bool = True):
    """Version 0 published at T; the rollout gets it at T+0.010 and has it loaded at
    T+0.030; group g1 (2 samples) is submitted at T+0.100 and its trajectories published
    at T+0.400 / T+0.500; rewards at T+0.450 / T+0.520; the sample at T+0.540; the trainer's
    batch is complete at T+0.560 and version 1 is published at T+0.860 (train 0.250 s)."""
    w0 = WeightsEvent(version=0, path="/w0", sha256="a", group_ids=[], produced_at=T)
    switch = {"weights_version": 0.0, "weights_received_at": T + 0.010, "weights_loaded_at": T + 0.030,
              "weights_switch_s": 0.015}
    trajs = [TrajectoryEvent(traj_id=f"g1:{i}", group_id="g1", prompt_id="p", sample_index=i, group_size=2,
                             prompt_ids=[1], output_ids=[2], output_logprobs=[-1.0], output_versions=[0],
                             timings={**switch, "submitted_at": T + 0.100, "queued_s": 0.0, "generate_s": 0.3},
                             produced_at=T + t) for i, t in enumerate((0.400, 0.500))]
    rewards = [RewardEvent(traj_id=f"g1:{i}", group_id="g1", reward=1.0, produced_at=T + t)
               for i, t in enumerate((0.450, 0.520))]
    sample = SampleEvent(group_id="g1", prompt_id="p", prompt_ids=[1], produced_at=T + 0.540, sequences=[
        SampleSequence(traj_id="g1:0", output_ids=[2], behav_logprobs=[-1.0], output_versions=[0], reward=1.0,
                       advantage=0.0)])
    m1 = MetricsEvent(source="trainer", step=1, policy_version=1, produced_at=T + 0.861, metrics={
        "trainer/batch_ready_at": T + 0.560, "actor/step_time_s": 0.250, "trainer/write_version_s": 0.040})
    w1 = WeightsEvent(version=1, path="/w1", sha256="b", group_ids=["g1"], produced_at=T + 0.860)
    again = WeightsEvent(version=1, path="/w1", sha256="b", group_ids=["g1"], produced_at=T + 5.0)  # re-announced
    return [again, m1, w1, sample, *rewards, *trajs, w0]


def test_each_stage_is_the_gap_between_its_two_timestamps():
    (row,) = step_timelines(_events())
    ms = {k: round(1000 * v) for k, v in vars(row).items() if isinstance(v, float)}
    assert row.version == 1 and row.generated_under == 0
    assert row.publish_s is None  # version 0 was not written by a training step
    assert ms == {
        "weights_hop_s": 10,    # T+0.010 - T
        "switch_s": 20,         # T+0.030 - T+0.010
        "prompt_wait_s": 70,    # T+0.100 - T+0.030
        "generation_s": 400,    # T+0.500 (last trajectory) - T+0.100
        "reward_s": 20,         # T+0.520 (last reward) - T+0.500
        "advantage_s": 20,      # T+0.540 - T+0.520
        "sample_hop_s": 20,     # T+0.560 - T+0.540
        "trainer_wait_s": 560,  # T+0.560 - T (version 0's first event, not a re-announcement)
        "step_s": 300,          # T+0.860 - T+0.560
        "train_s": 250,
        "cycle_s": 860,         # T+0.860 - T
    }
    # Hops: 10 + 70 + 20 + 20 + 20 = 140 ms of the 860 ms cycle.
    assert row.hops_s == pytest.approx(0.140)
    s = summarize([row])
    assert s["hops_share"] == pytest.approx(0.140 / 0.860)
    text = format_table([row])
    assert "560" in text and "860" in text


def test_steps_without_their_metrics_or_groups_are_left_out():
    events = [e for e in _events() if not isinstance(e, MetricsEvent)]
    assert step_timelines(events) == []
    # Missing rewards: the reward and advantage stages are unknown, the rest stands.
    (row,) = step_timelines([e for e in _events() if not isinstance(e, RewardEvent)])
    assert row.reward_s is None and row.advantage_s is None and row.hops_s is None
    assert row.cycle_s == pytest.approx(0.860)


def test_a_sample_that_waited_for_a_busy_trainer_is_not_counted_as_a_hop():
    """eta > 0: the sample was published at T+0.540 while the trainer was still in the
    step that published version 0 at T+0.700; its batch was complete at T+0.720: the hop
    is 20 ms (T+0.720 - T+0.700), the 160 ms before it were queueing."""
    events = _events()
    w0 = next(e for e in events if isinstance(e, WeightsEvent) and e.version == 0)
    w0.produced_at = T + 0.700
    m1 = next(e for e in events if isinstance(e, MetricsEvent))
    m1.metrics["trainer/batch_ready_at"] = T + 0.720
    (row,) = step_timelines(events)
    assert row.sample_hop_s == pytest.approx(0.020)
    assert row.trainer_wait_s == pytest.approx(0.020)


def test_the_groups_of_a_version_may_come_from_progress_events():
    """Trees with progress.v1 name a version's groups on a ProgressEvent (type
    "progress"), their weights events carry bytes only: the same row comes out."""
    from dataclasses import dataclass, field

    @dataclass
    class Progress:  # the fields of main's ProgressEvent the timeline reads
        version: int
        group_ids: list[str] = field(default_factory=list)
        TYPE = "progress"

    events = _events()
    for e in events:
        if isinstance(e, WeightsEvent):
            e.group_ids = []
    assert step_timelines(events) == []
    (row,) = step_timelines(events + [Progress(version=1, group_ids=["g1"])])
    assert row.cycle_s == pytest.approx(0.860) and row.generation_s == pytest.approx(0.400)
