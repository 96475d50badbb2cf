"""The group advantage processor: trajectories + rewards in, training samples out.

Consumes ``trajectories.v1`` and ``rewards.v1`` in one consumer group. Both are keyed
by ``group_id`` with equal partition counts, so a group's events arrive on the same
partition number of both topics and one member sees the whole group.
Emits one ``SampleEvent`` per complete group on ``samples.v1`` keyed by ``group_id``:
rewards shaped (bias, scale, clip) and turned into advantages (GRPO, Dr.GRPO, RLOO).

State is only "groups seen but not yet complete". A group still incomplete
``group_timeout_s`` after its first event (a dead-lettered trajectory or reward, a
crashed scorer, a fragment of a group emitted before a restart) is emitted as dropped
(``dropped_reason``): the trainer counts it as rejected, the head gate frees its slot,
and the commit floor moves on. Offsets are committed only up to
the oldest event of an incomplete group, so after a crash the state is rebuilt by
reading the log again; a group that completes twice is emitted twice with the same
``group_id`` and the trainer de-duplicates it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from tapioca.algorithms.advantages import group_advantages, shape_reward
from tapioca.bus.dedup import SeenSet
from tapioca.bus.role import Role, Source
from tapioca.schemas.envelope import Event
from tapioca.schemas.events import RewardEvent, SampleEvent, SampleSequence, TrajectoryEvent


@dataclass
class _PendingGroup:
    group_size: int = 0  # known once a trajectory arrives (rewards may come first)
    trajectories: dict[str, TrajectoryEvent] = field(default_factory=dict)
    rewards: dict[str, float] = field(default_factory=dict)
    # Earliest offset of this group's events per (topic, partition): the commit floor.
    first_offsets: dict[tuple[str, int], int] = field(default_factory=dict)
    first_seen: float = field(default_factory=time.monotonic)

    def complete(self) -> bool:
        return (self.group_size > 0 and len(self.trajectories) >= self.group_size
                and all(t in self.rewards for t in self.trajectories))


@dataclass
class AdvantageState:
    pending: dict[str, _PendingGroup] = field(default_factory=dict)
    emitted: SeenSet = field(default_factory=SeenSet)
    groups_emitted: int = 0
    groups_dropped: int = 0


class AdvantageProcessor(Role[AdvantageState]):
    name = "advantage"
    group_inputs = ("trajectories", "rewards")

    def __init__(self, *, estimator: str = "grpo", reward_bias: float = 0.0,
                 reward_scaling: float = 1.0, reward_clip: float | None = None,
                 eps: float = 1e-6, std_unbiased: bool = False,
                 group_timeout_s: float = 600.0) -> None:
        self.estimator = estimator
        self.reward_bias = reward_bias
        self.reward_scaling = reward_scaling
        self.reward_clip = reward_clip
        self.eps = eps
        self.std_unbiased = std_unbiased
        self.group_timeout_s = group_timeout_s

    def init_state(self) -> AdvantageState:
        return AdvantageState()

    def handle(self, event: Event, state: AdvantageState, source: Source) -> Iterable[Event]:
        group_id = event.group_id  # type: ignore[attr-defined]
        if group_id in state.emitted:
            return ()
        if not isinstance(event, (TrajectoryEvent, RewardEvent)):
            return ()
        # Trajectories and rewards travel on different topics: either may come first.
        group = state.pending.setdefault(group_id, _PendingGroup())
        if isinstance(event, TrajectoryEvent):
            group.group_size = event.group_size
            group.trajectories.setdefault(event.traj_id, event)
        else:
            group.rewards.setdefault(event.traj_id, event.reward)
        tp = (source.topic, source.partition)
        group.first_offsets.setdefault(tp, source.offset)
        if not group.complete():
            return ()
        # Built before the group leaves state: if shaping raises, the bus's retry (then
        # dead letter) sees the same complete group instead of an already-emitted one.
        sample = self._sample(group)
        del state.pending[group_id]
        state.emitted.first(group_id)
        state.groups_emitted += 1
        return (sample,)

    def _sample(self, group: _PendingGroup) -> SampleEvent:
        trajs = sorted(group.trajectories.values(), key=lambda t: t.sample_index)
        shaped = [shape_reward(group.rewards[t.traj_id], bias=self.reward_bias,
                               scale=self.reward_scaling, clip=self.reward_clip) for t in trajs]
        advantages = group_advantages(shaped, estimator=self.estimator, eps=self.eps,
                                      std_unbiased=self.std_unbiased)
        versions = [v for t in trajs for v in t.output_versions] or [0]
        first = trajs[0]
        return SampleEvent(
            group_id=first.group_id,
            prompt_id=first.prompt_id,
            prompt_ids=list(first.prompt_ids),
            sequences=[
                SampleSequence(traj_id=t.traj_id, output_ids=t.output_ids,
                               behav_logprobs=t.output_logprobs, output_versions=t.output_versions,
                               reward=r, advantage=a, loss_mask=t.loss_mask,
                               finish_reason=t.finish_reason)
                for t, r, a in zip(trajs, shaped, advantages)
            ],
            group_index=first.group_index,
            min_version=min(versions),
            max_version=max(versions),
            estimator=self.estimator,
            task=first.task,
            run_id=first.run_id,
        )

    def on_tick(self, state: AdvantageState, now: float) -> Iterable[Event]:
        deadline = time.monotonic() - self.group_timeout_s
        out = []
        for gid in [g for g, grp in state.pending.items() if grp.first_seen < deadline]:
            group = state.pending.pop(gid)
            state.emitted.first(gid)
            state.groups_dropped += 1
            first = next(iter(group.trajectories.values()), None)
            out.append(SampleEvent(
                group_id=gid, prompt_id=first.prompt_id if first else "",
                prompt_ids=list(first.prompt_ids) if first else [], sequences=[],
                group_index=first.group_index if first else 0,
                run_id=first.run_id if first else "default",
                dropped_reason=(f"timeout after {self.group_timeout_s:.0f} s: "
                                f"{len(group.trajectories)} of {group.group_size or '?'} "
                                f"trajectories, {len(group.rewards)} rewards")))
        return out

    def committable(self, state: AdvantageState, topic: str, partition: int, next_offset: int) -> int:
        floors = [g.first_offsets[(topic, partition)] for g in state.pending.values()
                  if (topic, partition) in g.first_offsets]
        return min(floors + [next_offset])

    def on_revoke(self, state: AdvantageState, partitions: list[tuple[str, int]]) -> None:
        # The new owner rebuilds these groups from the committed offsets.
        revoked = set(partitions)
        for gid in [g for g, grp in state.pending.items() if revoked & set(grp.first_offsets)]:
            del state.pending[gid]

    def describe(self, state: AdvantageState) -> dict[str, Any]:
        return {"pending_groups": len(state.pending), "emitted": state.groups_emitted,
                "dropped": state.groups_dropped}
