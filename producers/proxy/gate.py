"""The proxy's head gate and its follower of ``weights.v1`` and ``progress.v1``.

Consumes ``weights.v1`` and ``progress.v1`` (broadcast, through a
:class:`~tapioca.bus.runner.RoleRunner` in a background thread): each new version on
``weights.v1`` is loaded into the proxy's engine; the gate's counts come from
``progress.v1`` only, each progress event moving the gate once the proxy's engine has
loaded its version (a later version's counts wait for its load). Which weights event is
loaded, refused or dead-lettered is the rule the rollout workers follow too
(weights/follow.py): versions only go forward, another claim of the loaded
version is refused, one that fails to load is retried, then dead-lettered, and the
proxy keeps its version. Emits nothing but dead letters and the runner's status metrics.

Gate (docs/design.md#3-policy-versions-and-the-staleness-window, the feeder's rule,
algorithms/head_gate.py): a session that starts
a new group waits until ``k - rejected - abandoned < (eta + v + 1) * B`` with k the
groups this proxy has admitted in the run, v (trained steps: version - rollbacks) and
``rejected`` from the latest progress event of a loaded version, eta =
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
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from ...algorithms.head_gate import head_gate_capacity, log_counts
from ...bus.reader import TopicReader
from ...bus.role import DeadLetter, Role, Source
from ...bus.settings import BusConfig
from ...schemas.envelope import Event, run_reads
from ...schemas.errors import BadEventError
from ...schemas.events import ProgressEvent, TrajectoryEvent, WeightsEvent
from ...weights.follow import WeightsFollow

PROXY_PRODUCER_PREFIX = "proxy"
# Progress events of versions not loaded yet, kept at most (the oldest are dropped).
MAX_PENDING_PROGRESS = 64

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


@dataclass
class ProxyFollow(WeightsFollow):
    """The proxy's following of ``weights.v1`` (:class:`WeightsFollow`) and of
    ``progress.v1``: the progress event that moved the gate last, and the later ones
    waiting for their version to load."""

    progress: ProgressEvent | None = None
    waiting: list[ProgressEvent] = field(default_factory=list)
    # Older progress events on the replayed broadcast topic are skipped up to this one.
    progress_skip_until: str = ""


class WeightsFollower(Role[ProxyFollow]):
    """Loads every new version into the engine (``load``) and moves the gate with the
    trainer's progress events of the versions loaded.

    Which weights event is loaded, refused or dead-lettered is :class:`WeightsFollow`'s
    rule, as for the rollout workers; the gate takes v and the counts of the newest
    progress event whose version the engine has loaded. The newest recovered version is
    loaded at start, before the gate opens; later ones on the tick."""

    name = "proxy-weights"
    broadcast_inputs = ("weights", "progress")
    recover_from = ("weights", "progress")

    def __init__(self, gate: HeadGate, load: Callable[[WeightsEvent], Any],
                 current_version: Callable[[], int]) -> None:
        self.gate = gate
        self.load = load
        self.current_version = current_version

    def init_state(self) -> ProxyFollow:
        return ProxyFollow("the agent proxy", loaded_version=self.current_version())

    def recover(self, state: ProxyFollow, latest: list[Event]) -> None:
        state.recover(latest)
        if state.head is not None:
            try:
                self._load_head(state)
            except BadEventError as exc:  # serve what the engine has; the tick retries it
                log.error("%s; serving version %d meanwhile", exc, state.loaded_version)
        progress = [e for e in latest if isinstance(e, ProgressEvent)]
        if progress:
            # The highest version (the latest of equals): a re-published old event must
            # not set the counts a restarted proxy starts with.
            newest = max(progress, key=lambda e: e.version)
            state.progress_skip_until = newest.event_id
            self._offer_progress(state, newest)
        self.gate.ready.set()

    def handle(self, event: Event, state: ProxyFollow, source: Source) -> Iterable[Event | DeadLetter]:
        if isinstance(event, ProgressEvent):
            if not self._progress_replayed(state, event):
                self._offer_progress(state, event)
            return ()
        if not isinstance(event, WeightsEvent) or state.replayed(event):
            return ()
        return state.offer(event, source)

    def on_tick(self, state: ProxyFollow, now: float) -> Iterable[Event | DeadLetter]:
        return self._load_head(state) if state.head is not None else ()

    def _load_head(self, state: ProxyFollow) -> list[DeadLetter]:
        # Loading waits for a decode-step boundary; requests queue meanwhile and
        # continue on the new weights (interruptible generation), none fails.
        out = state.load_head(self.load)
        self._move_gate(state)
        return out

    @staticmethod
    def _progress_replayed(state: ProxyFollow, event: ProgressEvent) -> bool:
        """True: a progress event at or before the recovered one on the replayed topic."""
        if not state.progress_skip_until:
            return False
        if event.event_id == state.progress_skip_until:
            state.progress_skip_until = ""
        return True

    def _offer_progress(self, state: ProxyFollow, event: ProgressEvent) -> None:
        # Versions never go back: an older progress event (re-published) moves nothing.
        if state.progress is not None and event.version < state.progress.version:
            return
        state.waiting.append(event)
        del state.waiting[:-MAX_PENDING_PROGRESS]
        self._move_gate(state)

    def _move_gate(self, state: ProxyFollow) -> None:
        """The newest waiting progress event of a loaded version (the highest version,
        the latest of equals) moves the gate."""
        ready = [e for e in state.waiting if e.version <= state.loaded_version]
        if not ready:
            return
        event = ready[0]
        for e in ready[1:]:
            if e.version >= event.version:
                event = e
        state.progress = event
        state.waiting = [e for e in state.waiting if e.version > state.loaded_version]
        rollbacks, rejected = log_counts(event.rollbacks, event.groups_rejected,
                                         event.base_steps, event.base_rejected)
        self.gate.update(event.version, rejected, rollbacks)

    def on_dead_letter(self, state: ProxyFollow, event: Event, error: BaseException) -> None:
        state.forget(event)  # the proxy keeps its version; the next candidate is tried

    def describe(self, state: ProxyFollow) -> dict[str, Any]:
        return {"version": self.gate.version, "admitted": self.gate.admitted,
                "open_slots": max(self.gate.capacity(), 0),
                "rejected": self.gate.rejected, "weight_loads": state.loads,
                "weight_load_failures": state.load_failures,
                "weights_dead_lettered": state.dead_lettered}
