"""The proxy's head gate and its follower of ``weights.v1``.

Consumes ``weights.v1`` (broadcast, through a :class:`~tapioca.bus.runner.RoleRunner`
in a background thread): each new version is loaded into the proxy's engine and its
``version`` / ``groups_rejected`` move the gate once loaded. Which weights event is
loaded, refused or dead-lettered is the rule the rollout workers follow too
(producers/weights_follow.py): versions only go forward, another claim of the loaded
version is refused, one that fails to load is retried, then dead-lettered, and the
proxy keeps its version. Emits nothing but dead letters and the runner's status metrics.

Gate (docs/design.md#3-policy-versions-and-the-staleness-window, the feeder's rule,
algorithms/head_gate.py): a session that starts
a new group waits until ``k - rejected - abandoned < (eta + v + 1) * B`` with k the
groups this proxy has admitted in the run, v (trained steps: version - rollbacks) and
``rejected`` from the latest weights event, eta =
``rollout.max_head_offpolicyness`` and B = ``train_dataset.prompts_per_step``.
``abandoned`` counts admitted groups that ended without a trajectory (every session
expired): the trainer never sees them, so nothing else would free their slot.
k is recovered at start from this run's latest proxy trajectories on
``trajectories.v1`` (highest ``group_index`` + 1), so a restarted proxy does not
re-admit a full window; groups admitted but unpublished before a crash are not
counted (the gate is then looser by at most those).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterable

from ...algorithms.head_gate import head_gate_capacity, log_counts
from ...bus.reader import TopicReader
from ...bus.role import DeadLetter, Role, Source
from ...bus.settings import BusConfig
from ...schemas.envelope import Event, run_reads
from ...schemas.errors import BadEventError
from ...schemas.events import TrajectoryEvent, WeightsEvent
from ..weights_follow import WeightsFollow

PROXY_PRODUCER_PREFIX = "proxy"

log = logging.getLogger(__name__)


class HeadGate:
    """Thread-safe admission counter; ``ready`` once the latest weights are known."""

    def __init__(self, eta: int, prompts_per_step: int, admitted: int = 0) -> None:
        self.eta = eta
        self.B = prompts_per_step
        self.admitted = admitted
        self.abandoned = 0
        self.version = 0
        self.rejected = 0
        self.rollbacks = 0
        self.ready = threading.Event()
        self._lock = threading.Lock()

    def capacity(self) -> int:
        """Groups that may still be admitted now."""
        with self._lock:
            return self._capacity()

    def _capacity(self) -> int:
        return head_gate_capacity(self.admitted, self.version, self.eta, self.B,
                                  freed=self.rejected + self.abandoned, rollbacks=self.rollbacks)

    def try_admit(self) -> int | None:
        """The new group's index k, or None while the gate is closed."""
        if not self.ready.is_set():
            return None
        with self._lock:
            if self._capacity() > 0:
                k = self.admitted
                self.admitted += 1
                return k
            return None

    def update(self, version: int, rejected: int, rollbacks: int = 0) -> None:
        with self._lock:
            self.version = version
            self.rejected = rejected
            self.rollbacks = rollbacks

    def abandon(self) -> None:
        with self._lock:
            self.abandoned += 1


def recover_admitted(cfg: BusConfig, per_partition: int = 256) -> int:
    """Highest ``group_index`` + 1 of this run's proxy trajectories (0 if none)."""
    k = 0
    with TopicReader(cfg, "trajectories", tail=per_partition) as reader:
        for r in reader.records(idle_s=0.3, timeout_s=30):
            e = r.event
            if (isinstance(e, TrajectoryEvent) and e.producer_id.startswith(PROXY_PRODUCER_PREFIX)
                    and run_reads(cfg.run_id, e.run_id)):
                k = max(k, e.group_index + 1)
    return k


class WeightsFollower(Role[WeightsFollow]):
    """Loads every new version into the engine (``load``) and moves the gate once loaded.

    Which event is loaded, refused or dead-lettered is :class:`WeightsFollow`'s rule, as
    for the rollout workers; the gate takes v and the counts of the version loaded (or of
    its re-announcements). The newest recovered version is loaded at start, before the
    gate opens; later ones on the tick."""

    name = "proxy-weights"
    broadcast_inputs = ("weights",)
    recover_from = ("weights",)

    def __init__(self, gate: HeadGate, load: Callable[[WeightsEvent], Any],
                 current_version: Callable[[], int]) -> None:
        self.gate = gate
        self.load = load
        self.current_version = current_version

    def init_state(self) -> WeightsFollow:
        return WeightsFollow("the agent proxy", loaded_version=self.current_version())

    def recover(self, state: WeightsFollow, latest: list[Event]) -> None:
        newest = state.recover(latest)
        if state.head is not None:
            try:
                self._load_head(state)
            except BadEventError as exc:  # serve what the engine has; the tick retries it
                log.error("%s; serving version %d meanwhile", exc, state.loaded_version)
        elif newest is not None and newest.version == state.loaded_version:
            self._move_gate(newest)
        self.gate.ready.set()

    def handle(self, event: Event, state: WeightsFollow, source: Source) -> Iterable[Event | DeadLetter]:
        if not isinstance(event, WeightsEvent) or state.replayed(event):
            return ()
        out = state.offer(event, source)
        if event.version == state.loaded_version:  # a re-announcement: the counts move
            self._move_gate(event)
        return out

    def on_tick(self, state: WeightsFollow, now: float) -> Iterable[Event | DeadLetter]:
        return self._load_head(state) if state.head is not None else ()

    def _load_head(self, state: WeightsFollow) -> list[DeadLetter]:
        # Loading waits for a decode-step boundary; requests queue meanwhile and
        # continue on the new weights (interruptible generation), none fails.
        event = state.head
        out = state.load_head(self.load)
        if state.loaded_version == event.version:
            self._move_gate(event)
        return out

    def _move_gate(self, event: WeightsEvent) -> None:
        rollbacks, rejected = log_counts(event.rollbacks, event.groups_rejected,
                                         event.base_steps, event.base_rejected)
        self.gate.update(event.version, rejected, rollbacks)

    def on_dead_letter(self, state: WeightsFollow, event: Event, error: BaseException) -> None:
        state.forget(event)  # the proxy keeps its version; the next candidate is tried

    def describe(self, state: WeightsFollow) -> dict[str, Any]:
        return {"version": self.gate.version, "admitted": self.gate.admitted,
                "rejected": self.gate.rejected, "weight_loads": state.loads,
                "weight_load_failures": state.load_failures,
                "weights_dead_lettered": state.dead_lettered}
