"""What a role is: a typed function of events, ``handle(event, state, source) -> events``.

Business logic subclasses :class:`Role` and never sees a Kafka client; the
:class:`~tapioca.bus.runner.RoleRunner` does the polling, decoding, dead letters,
retries, publishing and commits around it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Iterable, TypeVar

from ..schemas.envelope import Event

if TYPE_CHECKING:
    from ..schemas.events import ControlEvent

S = TypeVar("S")


@dataclass(frozen=True)
class Source:
    """Where an event was read from."""

    topic: str
    partition: int
    offset: int
    key: str | None = None
    timestamp_ms: int = 0
    broadcast: bool = False

    @classmethod
    def of(cls, msg, broadcast: bool = False) -> "Source":
        """Where a consumed Kafka record (a confluent-kafka ``Message``) was read from."""
        key = msg.key()
        return cls(topic=msg.topic(), partition=msg.partition(), offset=msg.offset(),
                   key=key.decode(errors="replace") if key is not None else None,
                   timestamp_ms=msg.timestamp()[1], broadcast=broadcast)


@dataclass(frozen=True)
class DeadLetter:
    """An output of a role that is not an event: "this event, read earlier, turned out
    bad" (a fault found late, e.g. a training step whose loss is not finite). The runner
    puts ``event`` on ``dlq.v1`` with ``error`` and its ``source`` (where it was read, if
    known; else the topic it belongs on, partition and offset -1)."""

    event: Event
    error: BaseException
    source: Source | None = None


class Role(Generic[S]):
    """Base of every role. Override ``init_state`` and ``handle``; the rest are hooks.

    ``group_inputs`` are topic base names read as one consumer group (each event goes
    to one member; offsets are committed). ``broadcast_inputs`` are read in full by
    every member from the beginning (e.g. ``weights``), never committed.
    """

    name: str = "role"
    group_inputs: tuple[str, ...] = ()
    broadcast_inputs: tuple[str, ...] = ()
    # Topics whose latest events (per partition) are handed to ``recover`` at start,
    # so a role rebuilds counters from the log rather than from memory.
    recover_from: tuple[str, ...] = ()
    # Group inputs whose events must name this run when the run has a run id: there an
    # event stamped ``default`` (or without run_id) is dead-lettered, not skipped as
    # foreign, so an outside writer that forgets the run id finds its events on dlq.v1.
    attributed_inputs: tuple[str, ...] = ()
    # How often on_tick runs when no event arrives.
    tick_interval_s: float = 0.05

    def init_state(self) -> S:
        raise NotImplementedError

    def handle(self, event: Event, state: S, source: Source) -> Iterable[Event | DeadLetter]:
        """Outputs to publish. Raise ``BadEventError`` for an event that can never be
        used (dead-lettered at once); anything else is retried, then dead-lettered."""
        raise NotImplementedError

    def recover(self, state: S, latest: list[Event]) -> None:
        """Called once after ``init_state`` with the latest events of ``recover_from``
        topics belonging to this run (oldest first)."""

    def on_tick(self, state: S, now: float) -> Iterable[Event | DeadLetter]:
        """Called every loop turn; returns events to publish (timers, async results).
        A fault of one earlier event found here: raise ``BadEventError(event=...)``
        (retried with backoff when ``retryable``, then dead-lettered and passed to
        ``on_dead_letter``); ticks pause during the backoff, events keep flowing."""
        return ()

    def on_dead_letter(self, state: S, event: Event, error: BaseException) -> None:
        """The runner gave up on ``event`` (named by a ``BadEventError`` from ``on_tick``)
        and dead-lettered it: forget it and go on (e.g. keep the current weights)."""

    def committable(self, state: S, topic: str, partition: int, next_offset: int) -> int:
        """The offset safe to commit for a partition whose events up to ``next_offset``
        have been handled. Hold it back to keep events that state still depends on
        (incomplete groups, un-checkpointed training) in the replay window."""
        return next_offset

    def on_assign(self, state: S, partitions: list[tuple[str, int]]) -> None:
        pass

    def on_revoke(self, state: S, partitions: list[tuple[str, int]]) -> None:
        pass

    def on_stop(self, state: S) -> Iterable[Event]:
        return ()

    def finished(self, state: S) -> bool:
        """True when the role has nothing more to do and the runner should exit."""
        return False

    def describe(self, state: S) -> dict[str, Any]:
        """Numbers about the role for status events and fleet heartbeats; a ``version``
        (or ``policy_version``) entry is shown as the member's policy version."""
        return {}

    # ------------------------------------------------------------------ fleet control
    # The runner handles `pause`, `resume` and `drain` from control.v1 itself (bus/fleet.py)
    # and calls these hooks; any other command goes to ``on_control``.

    def on_pause(self, state: S, paused: bool) -> None:
        """Called when the member is paused (``paused=True``: no events and no ticks reach
        the role until resumed) and when it resumes. E.g. pause an inference engine."""

    def on_drain(self, state: S) -> Iterable[Event]:
        """Called once when a drain starts: no new group input arrives from now on; ticks
        and broadcast inputs go on. Stop starting new work; returns events to publish."""
        return ()

    def drained(self, state: S) -> bool:
        """While draining: True once in-flight work is finished (or safely left
        uncommitted for another member); the runner then stops cleanly and exits."""
        return True

    def on_control(self, command: "ControlEvent", state: S) -> tuple[bool, str, Iterable[Event]]:
        """A role-specific command (anything but pause / resume / drain) addressed to this
        member: returns (ok, message for the acknowledgement, events to publish)."""
        return (False, f"role {self.name!r} does not handle the command {command.command!r} "
                       "(every role handles pause, resume and drain)", ())
