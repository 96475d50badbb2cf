"""The timestamps of every trajectory's life, from the events' own fields: the one
derivation that the step timeline (ops/timeline.py) and the trajectory traces
(ops/traces.py) share.

Consumes a run's events, in any order and with repeats (at-least-once): ``prompts.v1``
(the prompt's ``produced_at``), ``trajectories.v1`` (``produced_at``; ``timings``:
``submitted_at``, ``queued_s``, ``generate_s``, and the weights switch the group was
generated after: ``weights_version``, ``weights_received_at``, ``weights_loaded_at``),
``rewards.v1`` (the first reward of each trajectory), ``samples.v1`` (the first sample
of each group, with each trajectory's advantage), ``progress.v1`` (the groups trained
into each version, and those rejected), ``weights.v1`` (each version's publish: its
first event that is not a rollback) and ``metrics.v1`` (the trainer's step rows:
``trainer/batch_ready_at`` ...). Trees before ``progress.v1`` named a version's groups on
its weights event (``group_ids``); they still count.

Keyed by ``traj_id`` (trajectories, rewards), ``group_id`` (prompts, samples, verdicts)
and version (weights, trainer steps). :class:`RunLog` keeps only timestamps and a few
numbers per event, never token arrays, so a follower can hold a long run's unfinished
trajectories; :meth:`RunLog.forget` drops a group once it is exported. Emits
:class:`TrajectoryTimes`. Clocks: every timestamp is a ``time.time()`` of the process
that wrote it (several hosts: several clocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Optional

from ..schemas.envelope import ANY_RUN, run_reads
from ..schemas.events import (
    MetricsEvent,
    PromptEvent,
    RewardEvent,
    SampleEvent,
    TrajectoryEvent,
    WeightsEvent,
)


@dataclass
class _Traj:
    """What the log says of one trajectory event (no token arrays)."""

    traj_id: str
    group_id: str
    run_id: str
    produced_at: float
    timings: dict[str, float]
    output_tokens: int
    finish_reason: str
    min_version: Optional[int]
    max_version: Optional[int]


@dataclass
class _Sample:
    produced_at: float
    advantages: dict[str, float]
    dropped_reason: str
    min_version: int


@dataclass(frozen=True)
class TrajectoryTimes:
    """One trajectory's life in epoch seconds (None: not on the log yet, or never)."""

    traj_id: str
    group_id: str
    run_id: str
    published_at: float                  # its trajectories.v1 event
    prompt_at: Optional[float] = None    # its prompt's prompts.v1 event (none for the proxy's)
    submitted_at: Optional[float] = None  # the rollout worker handed it to its engine
    queued_s: Optional[float] = None
    generate_s: Optional[float] = None
    # The weights switch the worker made before generating it (its version, when the
    # event arrived, when it was loaded).
    weights_version: Optional[int] = None
    weights_received_at: Optional[float] = None
    weights_loaded_at: Optional[float] = None
    reward_at: Optional[float] = None    # its first rewards.v1 event
    reward: Optional[float] = None
    scorer: Optional[str] = None
    sample_at: Optional[float] = None    # its group's first samples.v1 event
    advantage: Optional[float] = None
    dropped_reason: str = ""             # the advantage processor gave its group up
    trained_version: Optional[int] = None  # the version its group was trained into
    batch_ready_at: Optional[float] = None  # that step's batch was complete (the trainer)
    version_at: Optional[float] = None   # that version's weights event
    rejected_at: Optional[float] = None  # a progress event named its group rejected
    output_tokens: int = 0
    finish_reason: str = ""
    min_version: Optional[int] = None    # of its tokens
    max_version: Optional[int] = None
    group_min_version: Optional[int] = None  # of its group's tokens (the tail gate's)

    @property
    def done(self) -> bool:
        """Its group's fate is on the log: trained into a published version, or rejected."""
        return self.rejected_at is not None or (
            self.trained_version is not None and self.version_at is not None)

    @property
    def staleness(self) -> Optional[int]:
        """Versions between its group's oldest token and the trainer's version when it
        trained the group (the tail gate's ``v - min(output_versions)``)."""
        if self.trained_version is None or self.group_min_version is None:
            return None
        return self.trained_version - 1 - self.group_min_version


def _float(value: Any) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


@dataclass
class RunLog:
    """The index of a run's timestamps; :meth:`add` events, then ask for trajectories
    (:meth:`trajectory`, :meth:`trajectories`) or a version's groups. ``run_id``: only
    that run's events (ANY_RUN: every one)."""

    run_id: str = ANY_RUN
    weights_at: dict[int, float] = field(default_factory=dict)  # version -> first publish
    trained: dict[int, list[str]] = field(default_factory=dict)  # version -> its groups
    version_of: dict[str, int] = field(default_factory=dict)    # group -> trained into
    trainer_steps: dict[int, dict[str, float]] = field(default_factory=dict)
    trajs: dict[str, dict[str, _Traj]] = field(default_factory=dict)  # group -> traj_id ->
    prompts_at: dict[str, float] = field(default_factory=dict)
    rewards: dict[str, tuple[float, float, str]] = field(default_factory=dict)  # traj -> first
    samples: dict[str, _Sample] = field(default_factory=dict)
    rejected_at: dict[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, events: Iterable[Any], run_id: str = ANY_RUN) -> "RunLog":
        log = cls(run_id=run_id)
        for e in events:
            log.add(e)
        return log

    def add(self, e: Any) -> None:
        """Index one event (others, and other runs' events, are ignored)."""
        if not run_reads(self.run_id, getattr(e, "run_id", ANY_RUN)):
            return
        if getattr(e, "TYPE", "") == "progress":
            # Trees with progress.v1 name a version's groups there (weights.v1: bytes only).
            if e.group_ids:
                self._trained(e.version, e.group_ids)
            for gid in getattr(e, "rejected_group_ids", ()) or ():
                self.rejected_at[gid] = min(e.produced_at, self.rejected_at.get(gid, e.produced_at))
        elif isinstance(e, WeightsEvent):
            if e.rollback_of is not None:
                return
            # The first event of a version is its publish (re-announcements come later).
            if e.version not in self.weights_at or e.produced_at < self.weights_at[e.version]:
                self.weights_at[e.version] = e.produced_at
            if e.group_ids:  # trees before progress.v1
                self._trained(e.version, e.group_ids)
        elif isinstance(e, MetricsEvent):
            if "trainer/batch_ready_at" in e.metrics:
                self.trainer_steps[e.step] = dict(e.metrics)
        elif isinstance(e, TrajectoryEvent):
            group = self.trajs.setdefault(e.group_id, {})
            seen = group.get(e.traj_id)
            if seen is None or e.produced_at < seen.produced_at:  # a redelivery: the first counts
                versions = e.output_versions
                group[e.traj_id] = _Traj(
                    e.traj_id, e.group_id, e.run_id, e.produced_at,
                    {k: float(v) for k, v in e.timings.items() if _float(v) is not None},
                    len(e.output_ids), e.finish_reason, min(versions, default=None),
                    max(versions, default=None))
        elif isinstance(e, RewardEvent):
            seen = self.rewards.get(e.traj_id)
            if seen is None or e.produced_at < seen[0]:
                self.rewards[e.traj_id] = (e.produced_at, e.reward, e.scorer)
        elif isinstance(e, SampleEvent):
            seen = self.samples.get(e.group_id)
            if seen is None or e.produced_at < seen.produced_at:
                self.samples[e.group_id] = _Sample(
                    e.produced_at, {s.traj_id: s.advantage for s in e.sequences},
                    e.dropped_reason, e.min_version)
        elif isinstance(e, PromptEvent):
            self.prompts_at[e.group_id] = min(e.produced_at, self.prompts_at.get(e.group_id, e.produced_at))

    def _trained(self, version: int, group_ids: Iterable[str]) -> None:
        if version in self.trained:
            return  # every progress event of a version names the same groups
        self.trained[version] = list(group_ids)
        for gid in self.trained[version]:
            self.version_of.setdefault(gid, version)

    # ---------------------------------------------------------------- queries

    def group_trajectories(self, group_id: str) -> list[TrajectoryTimes]:
        """The group's trajectories on the log, in the order they were added."""
        return [self._times(t) for t in self.trajs.get(group_id, {}).values()]

    def trajectory(self, traj_id: str) -> Optional[TrajectoryTimes]:
        group_id = traj_id.rpartition(":")[0]
        t = self.trajs.get(group_id, {}).get(traj_id)
        if t is None:  # an id not of the form group:index
            t = next((g[traj_id] for g in self.trajs.values() if traj_id in g), None)
        return None if t is None else self._times(t)

    def trajectories(self) -> Iterator[TrajectoryTimes]:
        for group_id in list(self.trajs):
            yield from self.group_trajectories(group_id)

    def forget(self, group_id: str) -> None:
        """Drop a group's trajectories, rewards, sample and prompt (a follower that
        exported it); versions and trainer steps stay (other groups share them)."""
        for traj_id in self.trajs.pop(group_id, {}):
            self.rewards.pop(traj_id, None)
        self.samples.pop(group_id, None)
        self.prompts_at.pop(group_id, None)
        self.rejected_at.pop(group_id, None)

    def _times(self, t: _Traj) -> TrajectoryTimes:
        timings = t.timings
        reward = self.rewards.get(t.traj_id)
        sample = self.samples.get(t.group_id)
        version = self.version_of.get(t.group_id)
        step = self.trainer_steps.get(version) if version is not None else None
        under = timings.get("weights_version")
        group = self.trajs.get(t.group_id, {}).values()
        mins = [x.min_version for x in group if x.min_version is not None]
        return TrajectoryTimes(
            traj_id=t.traj_id, group_id=t.group_id, run_id=t.run_id, published_at=t.produced_at,
            prompt_at=self.prompts_at.get(t.group_id),
            submitted_at=timings.get("submitted_at"), queued_s=timings.get("queued_s"),
            generate_s=timings.get("generate_s"),
            weights_version=None if under is None else int(under),
            weights_received_at=timings.get("weights_received_at"),
            weights_loaded_at=timings.get("weights_loaded_at"),
            reward_at=reward[0] if reward else None, reward=reward[1] if reward else None,
            scorer=reward[2] if reward else None,
            sample_at=sample.produced_at if sample else None,
            advantage=sample.advantages.get(t.traj_id) if sample else None,
            dropped_reason=sample.dropped_reason if sample else "",
            trained_version=version,
            batch_ready_at=_float(step.get("trainer/batch_ready_at")) if step else None,
            version_at=self.weights_at.get(version) if version is not None else None,
            rejected_at=self.rejected_at.get(t.group_id),
            output_tokens=t.output_tokens, finish_reason=t.finish_reason,
            min_version=t.min_version, max_version=t.max_version,
            group_min_version=(sample.min_version if sample else min(mins) if mins else None))
