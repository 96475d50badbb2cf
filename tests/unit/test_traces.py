"""Trajectory traces (ops/traces.py) from hand-made events, exported through
OpenTelemetry's SDK with its in-memory exporter: one trajectory's spans, their order and
times, the trace id derived from its traj_id; and the step timeline reading the same
index (ops/lifecycle.py)."""

from __future__ import annotations

import hashlib

import pytest

from tapioca.ops.lifecycle import RunLog
from tapioca.ops.timeline import timelines_of
from tapioca.ops.traces import STAGES, TrajectoryTracer, trace_id_hex, trace_id_of, trajectory_spans
from tapioca.schemas.events import (
    MetricsEvent,
    ProgressEvent,
    PromptEvent,
    RewardEvent,
    SampleEvent,
    SampleSequence,
    TrajectoryEvent,
    WeightsEvent,
)

T = 1000.0  # an epoch second
RUN = "demo.t0"


def _events():
    """Group r-g0 (2 samples), prompted at T+0.050 and trained into version 1:
    version 0 published at T; the rollout gets it at T+0.010, has it loaded at T+0.030,
    submits the group at T+0.100; the trajectories are published at T+0.400 / T+0.500,
    rewarded at T+0.450 / T+0.520; the sample at T+0.540; the batch complete at T+0.560;
    version 1 published at T+0.860. Group r-g1 is rejected by the progress event at
    T+0.900 (its sample dropped by the advantage processor at T+0.700)."""
    switch = {"weights_version": 0.0, "weights_received_at": T + 0.010, "weights_loaded_at": T + 0.030}
    prompts = [PromptEvent(group_id=f"r-g{k}", prompt_id="p", group_index=k, n_samples=2, prompt_ids=[1],
                           produced_at=T + 0.050, run_id=RUN) for k in (0, 1)]
    trajs = [TrajectoryEvent(traj_id=f"r-g0:{i}", group_id="r-g0", prompt_id="p", sample_index=i, group_size=2,
                             prompt_ids=[1], output_ids=[2, 3], output_logprobs=[-1.0, -1.0],
                             output_versions=[0, 0], run_id=RUN, produced_at=T + t,
                             timings={**switch, "submitted_at": T + 0.100, "queued_s": 0.01, "generate_s": 0.25})
             for i, t in enumerate((0.400, 0.500))]
    trajs.append(TrajectoryEvent(traj_id="r-g1:0", group_id="r-g1", prompt_id="p", sample_index=0, group_size=1,
                                 prompt_ids=[1], output_ids=[2], output_logprobs=[-1.0], output_versions=[0],
                                 run_id=RUN, produced_at=T + 0.600, timings={"submitted_at": T + 0.550}))
    rewards = [RewardEvent(traj_id=f"r-g0:{i}", group_id="r-g0", reward=float(i), produced_at=T + t, run_id=RUN)
               for i, t in enumerate((0.450, 0.520))]
    rewards.append(RewardEvent(traj_id="r-g1:0", group_id="r-g1", reward=0.0, produced_at=T + 0.650, run_id=RUN))
    seqs = [SampleSequence(traj_id=f"r-g0:{i}", output_ids=[2, 3], behav_logprobs=[-1.0, -1.0],
                           output_versions=[0, 0], reward=float(i), advantage=a) for i, a in enumerate((-0.7, 0.7))]
    samples = [SampleEvent(group_id="r-g0", prompt_id="p", prompt_ids=[1], sequences=seqs, produced_at=T + 0.540,
                           run_id=RUN),
               SampleEvent(group_id="r-g1", prompt_id="p", prompt_ids=[1], sequences=[], produced_at=T + 0.700,
                           dropped_reason="filtered: no reward variance", run_id=RUN)]
    metrics = MetricsEvent(source="trainer-0", step=1, policy_version=1, produced_at=T + 0.861, run_id=RUN, metrics={
        "trainer/batch_ready_at": T + 0.560, "actor/step_time_s": 0.250})
    weights = [WeightsEvent(version=0, path="/w0", sha256="a", produced_at=T, run_id=RUN),
               WeightsEvent(version=1, path="/w1", sha256="b", produced_at=T + 0.860, run_id=RUN)]
    progress = [ProgressEvent(version=1, group_ids=["r-g0"], produced_at=T + 0.861, run_id=RUN),
                ProgressEvent(version=1, group_ids=["r-g0"], rejected_group_ids=["r-g1"], groups_rejected=1,
                              produced_at=T + 0.900, run_id=RUN)]
    other_run = TrajectoryEvent(traj_id="x-g0:0", group_id="x-g0", prompt_id="p", sample_index=0, group_size=1,
                                prompt_ids=[1], output_ids=[2], output_logprobs=[-1.0], output_versions=[0],
                                run_id="another.run")
    # Any order, with a redelivered trajectory (at-least-once): the first one counts.
    redelivered = TrajectoryEvent(**{**trajs[0].to_dict(), "produced_at": T + 3.0})
    return [*progress, metrics, *weights, *samples, *rewards, redelivered, *trajs, *prompts, other_run]


def _exported(events):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracer = TrajectoryTracer(exporter, batch=False, run_id=RUN)
    log = RunLog.of(events, run_id=RUN)
    tracer.export_all(t for t in log.trajectories() if t.done)
    tracer.shutdown()
    return log, exporter.get_finished_spans()


def test_one_trajectory_is_one_trace_of_its_stages_in_order():
    log, spans = _exported(_events())
    trace = trace_id_of("r-g0:1")
    mine = [s for s in spans if s.context.trace_id == trace]
    by_name = {s.name: s for s in mine}
    assert sorted(by_name) == sorted(("trajectory",) + STAGES)
    root = by_name["trajectory"]
    stages = sorted((s for s in mine if s is not root), key=lambda s: s.start_time)
    assert [s.name for s in stages] == list(STAGES)
    assert all(s.parent is not None and s.parent.span_id == root.context.span_id for s in stages)
    assert root.parent is None
    ms = {s.name: (round((s.start_time / 1e9 - T) * 1000), round((s.end_time / 1e9 - T) * 1000)) for s in mine}
    assert ms == {
        "trajectory": (50, 860),
        "prompt": (50, 100),       # the prompt event -> submitted
        "generation": (100, 500),  # submitted -> its trajectory event (its own, not its sibling's)
        "reward": (500, 520),      # -> its first reward
        "advantage": (520, 540),   # -> the group's sample
        "sample": (540, 560),      # -> the trainer's batch complete
        "train": (560, 860),       # -> version 1's weights event: trained in version 1
    }
    # One stage ends where the next begins: the trace covers the trajectory's whole life.
    assert all(a.end_time == b.start_time for a, b in zip(stages, stages[1:]))
    train = by_name["train"].attributes
    assert train["tapioca.policy_version"] == 1 and train["tapioca.staleness_versions"] == 0
    assert by_name["advantage"].attributes["tapioca.advantage"] == pytest.approx(0.7)
    assert by_name["reward"].attributes["tapioca.reward"] == 1.0
    assert by_name["generation"].attributes["tapioca.generate_s"] == pytest.approx(0.25)
    assert root.attributes["tapioca.traj_id"] == "r-g0:1"
    assert root.resource.attributes["service.name"] == "tapioca"


def test_the_trace_id_is_found_from_the_traj_id_alone():
    expected = hashlib.sha256(b"r-g0:1").hexdigest()[:32]
    assert trace_id_hex("r-g0:1") == expected
    _, spans = _exported(_events())
    assert {f"{s.context.trace_id:032x}" for s in spans} == {trace_id_hex(t) for t in ("r-g0:0", "r-g0:1", "r-g1:0")}
    # Exported again: the same trace and span ids (a backend de-duplicates a re-export).
    _, again = _exported(_events())
    assert {(s.context.trace_id, s.context.span_id) for s in spans} == \
        {(s.context.trace_id, s.context.span_id) for s in again}


def test_a_rejected_group_ends_in_an_error_span_and_other_runs_are_left_out():
    from opentelemetry.trace import StatusCode

    _, spans = _exported(_events())
    rejected = [s for s in spans if s.context.trace_id == trace_id_of("r-g1:0")]
    names = {s.name: s for s in rejected}
    assert "train" not in names and names["sample"].status.status_code == StatusCode.ERROR
    assert "no reward variance" in names["sample"].status.description
    assert names["trajectory"].attributes["tapioca.rejected"] is True
    assert not any(s.context.trace_id == trace_id_of("x-g0:0") for s in spans)


def test_an_unfinished_trajectory_has_the_spans_the_log_has_so_far():
    events = [e for e in _events() if not isinstance(e, (ProgressEvent, SampleEvent))]
    log = RunLog.of(events, run_id=RUN)
    t = log.trajectory("r-g0:0")
    assert not t.done
    assert [s.name for s in trajectory_spans(t)] == ["trajectory", "prompt", "generation", "reward"]


def test_the_step_timeline_reads_the_same_index():
    (row,) = timelines_of(RunLog.of(_events(), run_id=RUN))
    assert row.version == 1 and row.generated_under == 0
    assert row.generation_s == pytest.approx(0.400) and row.step_s == pytest.approx(0.300)
    assert row.sample_hop_s == pytest.approx(0.020) and row.cycle_s == pytest.approx(0.860)
