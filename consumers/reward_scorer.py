"""The built-in reward scorer: trajectories in, rewards out.

Consumes ``trajectories.v1`` (consumer group). Emits ``RewardEvent`` on
``rewards.v1`` keyed by ``group_id`` (the group's partition), one per ``traj_id``.

The reward function runs with a timeout. A timeout, an exception or a non-finite
reward raises :class:`RewardError`: the bus retries the event, then dead-letters it.
A failing scorer never turns into a silent reward of 0.

External scorers follow the same contract with any Kafka client (docs/).
"""

from __future__ import annotations

import concurrent.futures
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ..bus.dedup import SeenSet
from ..bus.role import Role, Source
from ..config.sections import RewardSection
from ..schemas.envelope import Event
from ..schemas.errors import RewardError
from ..schemas.events import RewardEvent, TrajectoryEvent

RewardFn = Callable[[TrajectoryEvent], float]


@dataclass
class ScorerState:
    scored: SeenSet = field(default_factory=SeenSet)
    count: int = 0
    total: float = 0.0


class RewardScorer(Role[ScorerState]):
    name = "reward"
    group_inputs = ("trajectories",)

    def __init__(self, section: RewardSection, *, reward_fn: RewardFn, threads: int = 4) -> None:
        """``section``: ``reward.timeout_s``, and ``reward.scorer``, the name its rewards
        carry (``RewardEvent.scorer``, what ``advantage.reward_weights`` keys by).
        ``reward_fn(trajectory)``: the score (runtime/builders.py picks the task's)."""
        self.reward_fn = reward_fn
        self.scorer = section.reward.scorer
        self.timeout_s = section.reward.timeout_s
        self.threads = threads
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="reward")

    def init_state(self) -> ScorerState:
        return ScorerState()

    def handle(self, event: Event, state: ScorerState, source: Source) -> Iterable[Event]:
        assert isinstance(event, TrajectoryEvent)
        if event.traj_id in state.scored:
            return ()
        reward = self.score(event)
        state.scored.first(event.traj_id)
        state.count += 1
        state.total += reward
        return (RewardEvent(traj_id=event.traj_id, group_id=event.group_id, reward=reward,
                            scorer=self.scorer, run_id=event.run_id),)

    def score(self, event: TrajectoryEvent) -> float:
        future = self._pool.submit(self.reward_fn, event)
        try:
            value = future.result(timeout=self.timeout_s)
        except concurrent.futures.TimeoutError:
            # A running thread cannot be stopped; a fresh pool keeps a hung scorer from
            # starving every later trajectory (the stuck thread is abandoned).
            if not future.cancel():
                self._pool.shutdown(wait=False, cancel_futures=True)
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    self.threads, thread_name_prefix="reward")
            raise RewardError(f"reward for {event.traj_id} timed out after {self.timeout_s} s "
                              "(raise reward.timeout_s if the scorer is slow)") from None
        except Exception as exc:
            raise RewardError(f"reward for {event.traj_id} failed: {type(exc).__name__}: {exc}") from exc
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise RewardError(f"reward for {event.traj_id} is not a number: {value!r}") from None
        if not math.isfinite(value):
            raise RewardError(f"reward for {event.traj_id} is {value}; rewards must be finite")
        return value

    def on_stop(self, state: ScorerState) -> Iterable[Event]:
        self._pool.shutdown(wait=False, cancel_futures=True)
        return ()

    def describe(self, state: ScorerState) -> dict[str, Any]:
        return {"scored": state.count,
                "mean_reward": state.total / state.count if state.count else 0.0}
