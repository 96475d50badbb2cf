"""Offline RL: the trainer role trained from a Parquet log instead of a live topic.

Consumes archived events (:func:`tapioca.bus.archive.iter_events`): either the
``samples`` the advantage processor emitted during the run, or the raw
``trajectories`` + ``rewards``, turned into samples by an advantage processor running
in this process (passed in by the caller: roles never import each other). Emits what
the trainer emits after every step, a ``WeightsEvent`` (keyed by ``run_id``) and a
``MetricsEvent``, through a ``publish`` callback (``tapioca train-offline`` publishes
them to ``weights.v1`` / ``metrics.v1`` when a broker is configured).

Roles are pure functions of events, so no runner is needed: each event goes straight
to ``role.handle(event, state, source)`` and ``on_tick`` runs after each, as the
:class:`~tapioca.bus.runner.RoleRunner` would do.

Why the staleness gate is disabled (``max_head_offpolicyness`` = :data:`OFFLINE_ETA`):
the recorded ``output_versions`` count the *online* trainer's steps, while the offline
trainer counts its own from its checkpoint (usually 0). ``v - min_version`` then
measures nothing (it is even negative), and a real gate would reject most of a log
that was off-policy by construction. For the same reason the trainer's arrival check
(trainers/sample_checks.py) accepts versions ahead of its own here: online they mean a
forged weights event, offline every group made after the online trainer's first step
has one. Off-policyness is instead corrected the way the
decoupled objective always corrects it: the recorded behaviour logprobs
(``behav_logprobs``, from the rollout that sampled each token) weight every token by
``w = pi_prox / pi_behav``, with ``pi_prox`` recomputed from the current weights
before each update (``actor.recompute_logprob``), and the PPO ratio ``pi_theta /
pi_prox`` is clipped as usual. Set ``actor.behav_imp_weight_cap`` to drop tokens the
current policy has moved far away from (AReaL's cap), which matters more offline than
online because the gap grows with every offline step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator

from ..bus.role import Role, Source
from ..schemas.envelope import Event
from ..schemas.errors import BadEventError
from ..schemas.events import (
    MetricsEvent,
    RewardEvent,
    SampleEvent,
    TrajectoryEvent,
    WeightsEvent,
)

log = logging.getLogger(__name__)

#: The trainer's eta offline: larger than any version gap a log can hold (see above).
OFFLINE_ETA = 10**12

Publish = Callable[[Event], None]


@dataclass
class OfflineResult:
    steps: int = 0
    groups_read: int = 0
    losses: list[float] = field(default_factory=list)
    rewards: list[float] = field(default_factory=list)
    weights: list[WeightsEvent] = field(default_factory=list)
    final_version: int = 0
    # The trainer's version when the run began (its checkpoint's), and whether it had
    # nothing left to train then (total_train_steps reached by an earlier run).
    start_version: int = 0
    already_complete: bool = False
    # Samples the trainer refused (BadEventError: a live run dead-letters them), skipped
    # with skip_refused.
    refused: int = 0


def samples_from_log(events: Iterable[tuple[Source, Event]], advantage: Role | None = None
                     ) -> Iterator[tuple[Source, SampleEvent]]:
    """The training samples of a log: its ``SampleEvent`` s as they are, or (with an
    ``advantage`` role) the samples that role emits from the log's trajectories and
    rewards, fed in the order given (use ``iter_events(..., order="time")``)."""
    if advantage is None:
        for source, event in events:
            if isinstance(event, SampleEvent):
                yield source, event
        return
    state = advantage.init_state()
    emitted = 0
    for source, event in events:
        if not isinstance(event, (TrajectoryEvent, RewardEvent)):
            continue
        for out in advantage.handle(event, state, source) or ():
            if isinstance(out, SampleEvent):
                # The sample exists only here: number it on a topic of its own.
                yield Source("offline.samples", 0, emitted), out
                emitted += 1


class OfflineTrainer:
    """Drives a trainer role (built with ``max_head_offpolicyness = OFFLINE_ETA``)
    over samples from a log, publishing its outputs."""

    def __init__(self, trainer: Role, *, publish: Publish | None = None,
                 max_steps: int | None = None,
                 progress: Callable[[OfflineResult], None] | None = None,
                 skip_refused: bool = False) -> None:
        """``skip_refused``: a sample the trainer refuses (what a live run dead-letters:
        an image over the limits, tokens the model does not have) is skipped and
        counted (``refused``) instead of stopping the run."""
        self.trainer = trainer
        self.publish = publish or (lambda _event: None)
        self.max_steps = max_steps
        self.skip_refused = skip_refused
        # Called with the result so far after each group (a CLI's progress bar).
        self.progress = progress or (lambda _result: None)

    def _emit(self, events: Iterable[Event] | None, result: OfflineResult) -> None:
        for event in events or ():
            if isinstance(event, WeightsEvent):
                result.weights.append(event)
                result.final_version = max(result.final_version, event.version)
            elif isinstance(event, MetricsEvent) and "actor/loss" in event.metrics:
                result.steps += 1
                result.losses.append(event.metrics["actor/loss"])
                result.rewards.append(event.metrics.get("reward/mean", 0.0))
            self.publish(event)

    def run(self, samples: Iterable[tuple[Source, SampleEvent]]) -> OfflineResult:
        role, result = self.trainer, OfflineResult()
        state = role.init_state()
        result.start_version = int(role.describe(state).get("version", 0))
        result.already_complete = role.finished(state)
        try:
            self._emit(role.on_tick(state, 0.0), result)
            self.progress(result)
            for source, sample in samples:
                if role.finished(state) or (self.max_steps is not None
                                            and result.steps >= self.max_steps):
                    break
                result.groups_read += 1
                try:
                    self._emit(role.handle(sample, state, source), result)
                except BadEventError as exc:
                    if not self.skip_refused:
                        raise
                    result.refused += 1
                    log.warning("skipped (--skip-damaged) a sample the trainer refused: %s", exc)
                self._emit(role.on_tick(state, 0.0), result)
                self.progress(result)
        finally:
            self._emit(role.on_stop(state), result)
        return result
