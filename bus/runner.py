"""The consume → handle → produce → commit loop shared by every role.

Consumes the role's ``group_inputs`` as one consumer group and its
``broadcast_inputs`` in full; decodes each record against its topic's event types;
calls ``role.handle``; publishes what it returns; and, once those outputs are
delivered, commits offsets (as far as ``role.committable`` allows).

Events stamped with another run's ``run_id`` are skipped and counted (``bus/foreign``
in the member's status metrics, ``foreign`` in its heartbeat), before their signature
is checked: a run before this one on the same broker and prefix signed its weights and
commands with its own key, and they are no forgeries (one that claims this run's id is
checked, and dead-lettered when it fails). One that names no run (``default``) on an
input the role lists in ``attributed_inputs`` is dead-lettered instead, when the run
has an id.

A record that cannot be decoded or validated, or a record of a signed topic (control,
weights) whose signature does not verify under the run's key (bus/signing.py), goes to
``dlq.v1`` at once, and so does
one whose handler raises ``BadEventError`` (a fault in the event no retry fixes). A
handler that raises anything else is retried ``bus.handler_max_attempts`` times with
backoff, then its event is dead-lettered. Backoff never blocks the loop: the failed
record's partition is parked (bus/retry.py) while other partitions, ticks, heartbeats
and control go on; commits never pass the parked record, and a partition's records are
handled in order. Faults found late are dead-lettered too: a role's outputs may include
``DeadLetter`` items, and an ``on_tick`` that raises ``BadEventError(event=...)`` is
retried with backoff (ticks wait, events flow), then that event is dead-lettered and
handed to ``role.on_dead_letter``. Either way the loop goes on and nothing else is lost.
Two kinds of failure stop the member instead, raised from ``run``: ``FatalRoleError``
(the role says no retry can help) and an OSError of the disk (full, failing, read-only:
``StorageError`` with the one-line reason, e.g. ``No space left on device writing <path>``).

SIGTERM / SIGINT (when run in the main thread) or ``stop()`` end the loop after the
current batch: outputs are flushed, offsets committed, the group left cleanly.

Fleet control (``MemberFleet`` in bus/fleet.py, to which the runner delegates): the
member heartbeats on ``fleet.v1`` and obeys commands on ``control.v1``. Paused, its
input partitions are paused and the role gets neither events nor ticks (so it publishes
nothing) until resumed; draining, group input stops, ticks and broadcast inputs go on,
and the loop ends once ``role.drained(state)``. Other commands go to
``role.on_control``. Every command it takes is acknowledged. MemberFleet uses only the
runner's public surface: ``publish_outputs``, ``publish_own``, ``dead_letter``,
``set_intake`` and ``input_lag``.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, Message, TopicPartition

from ..schemas.envelope import (
    Event,
    decode_event,
    encode_event,
    names_a_run,
    of_another_run,
    run_reads,
)
from ..schemas.errors import (
    BadEventError,
    FatalRoleError,
    SchemaError,
    TapiocaError,
    UnattributedEventError,
    storage_error,
)
from ..schemas.events import MetricsEvent
from ..schemas.registry import TopicSpec, topic, topic_for
from .dlq import dead_letter as dead_letter_record
from .fleet import MemberFleet, pause_partitions
from .producer import EventProducer
from .retry import ParkedPartitions, backoff_s
from .role import DeadLetter, Role, Source
from .settings import BusConfig

log = logging.getLogger(__name__)


@dataclass
class RunnerStats:
    consumed: int = 0
    handled: int = 0
    produced: int = 0
    dead_lettered: int = 0
    retries: int = 0
    commits: int = 0
    foreign: int = 0
    tick_failures: int = 0
    started_at: float = field(default_factory=time.time)
    # Dead letters by error type (e.g. BadEventError, SchemaError): shown in status.
    dead_lettered_by_type: Counter = field(default_factory=Counter)


def _raise_storage_error(exc: Exception) -> None:
    """A full, failing or read-only disk (ENOSPC, EIO, EROFS, ...) is no fault of the event
    at hand: a retry would fail the same way or, worse, run a handler a second time on
    state it half changed; dead-lettering would throw the event away. It stops the role
    with the one-line reason (StorageError) instead."""
    error = storage_error(exc)
    if error is not None:
        raise error from exc


def _consume_some(consumer: Consumer, most: int, wait_s: float) -> list[Message]:
    """What ``consumer`` holds now, up to ``most`` records, after waiting up to ``wait_s``
    for the first one."""
    first = consumer.consume(1, timeout=wait_s)
    if first and most > 1:
        first += consumer.consume(most - 1, timeout=0)
    return first


class RoleRunner:
    """Runs one member of a role until stopped or ``role.finished(state)``."""

    def __init__(
        self,
        role: Role,
        cfg: BusConfig,
        *,
        member_id: str | None = None,
        group_id: str | None = None,
        batch_size: int = 64,
        poll_timeout_s: float = 0.05,
        status_interval_s: float = 1.0,
    ) -> None:
        self.role = role
        self.cfg = cfg
        self.member_id = member_id or f"{role.name}-{cfg.client_id}"
        self.group_id = group_id or f"{cfg.topic_prefix}.{role.name}"
        self.batch_size = batch_size
        self.poll_timeout_s = poll_timeout_s
        self.status_interval_s = status_interval_s
        self._next_status = 0.0
        self.stats = RunnerStats()
        self.state: Any = None
        self._stop = threading.Event()
        self._types: dict[str, TopicSpec] = {}
        self._next: dict[tuple[str, int], int] = {}  # handled position per group partition
        self._committed: dict[tuple[str, int], int] = {}
        self.producer: EventProducer | None = None
        self._group: Consumer | None = None
        self._bcast: Consumer | None = None
        self._unconfirmed = False
        self._assigned: set[tuple[str, int]] = set()
        # Fleet control: heartbeats, commands and their acknowledgements.
        self.fleet = MemberFleet(self)
        self.control = self.fleet.control
        self._held: list[tuple[Message, bool]] = []  # fetched while paused / draining
        self._repause = False
        # Failed records waiting for their retry, with their partitions' later records.
        self._parked: ParkedPartitions[tuple[Message, bool]] = ParkedPartitions(
            cfg.handler_backoff_s)
        # Tick faults: failures so far per event at fault (None: no event named), and
        # when ticks may run again after one.
        self._tick_failures: dict[str | None, int] = {}
        self._ticks_resume_at = 0.0

    # ------------------------------------------------------------------ lifecycle

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def _install_signals(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self.stop())

    def run(self, *, max_seconds: float | None = None) -> Any:
        """Run the loop; returns the role's final state."""
        self._install_signals()
        # A configured key that is missing or unreadable stops the member here, saying how
        # to fix it (bus/signing.py).
        if self.cfg.signing_key() is None:
            log.warning("%s: no bus.signing_key_path: control commands and weights events are "
                        "neither signed nor verified (anyone who can write to the bus can "
                        "command this member); `tapioca train` sets one", self.member_id)
        self.state = self.role.init_state()
        if self.role.recover_from:
            self.role.recover(self.state, self._latest_events(self.role.recover_from))
        self.producer = EventProducer(self.cfg, self.member_id)
        self.control.started_at = time.time()
        self._open_consumers()
        deadline = time.monotonic() + max_seconds if max_seconds else None
        next_tick = 0.0
        try:
            self.fleet.heartbeat("starting")
            while not self._stop.is_set():
                if deadline and time.monotonic() > deadline:
                    break
                self.fleet.serve()
                handled_any = self._poll_once()
                handled_any |= self._retry_parked()
                now = time.monotonic()
                # Paused: no ticks either, so no timer or async result is published.
                if (not self.control.paused and (handled_any or now >= next_tick)
                        and now >= self._ticks_resume_at):
                    self._tick(now)
                    next_tick = now + self.role.tick_interval_s
                if now >= self._next_status:
                    self.publish_own(self._status())
                    self._next_status = now + self.status_interval_s
                if now >= self.fleet.next_heartbeat:
                    self.fleet.heartbeat()
                self._confirm_and_commit()
                if self.role.finished(self.state):
                    break
                if self.control.draining and self.role.drained(self.state):
                    log.info("%s drained: stopping", self.member_id)
                    break
            self.publish_outputs(self.role.on_stop(self.state))
            self._confirm_and_commit()
            self.fleet.heartbeat("stopped")
            self._confirm_and_commit()
        except Exception as exc:
            self.fleet.heartbeat_failed(exc)
            raise
        finally:
            self._close()
        return self.state

    def _latest_events(self, names: tuple[str, ...], per_partition: int = 64) -> list[Event]:
        from .reader import TopicReader

        events: list[Event] = []
        for name in names:
            with TopicReader(self.cfg, name, tail=per_partition) as reader:
                events += [r.event for r in reader.records(idle_s=0.3, timeout_s=30)
                           if r.event is not None and self._ours(r.event)]
        events.sort(key=lambda e: e.produced_at)
        return events

    def _ours(self, event: Event) -> bool:
        """One run per topic prefix is the rule; events stamped with another run id are
        someone else's (a replay, a neighbour run) and are skipped, not dead-lettered."""
        return run_reads(self.cfg.run_id, event.run_id)

    def _unattributed(self, event: Event, spec: TopicSpec) -> bool:
        """An event that names no run, where this role requires its run's id. Broadcast
        inputs are re-read from the start by every member and never qualify."""
        return not names_a_run(event.run_id) and spec.name in self.role.attributed_inputs

    def _open_consumers(self) -> None:
        for name in self.role.group_inputs + self.role.broadcast_inputs:
            spec = topic(name)
            self._types[self.cfg.topic(spec)] = spec
        if self.role.group_inputs:
            self._group = Consumer({**self.cfg.consumer_conf(self.group_id)})
            self._group.subscribe(
                [self.cfg.topic(topic(n)) for n in self.role.group_inputs],
                on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_revoke,
            )
        if self.role.broadcast_inputs:
            self._bcast = Consumer(
                {**self.cfg.consumer_conf(f"{self.group_id}.{self.member_id}.bcast")})
            assignment = []
            for name in self.role.broadcast_inputs:
                full = self.cfg.topic(topic(name))
                md = self._bcast.list_topics(full, timeout=10).topics.get(full)
                if md is None or md.error is not None or not md.partitions:
                    raise FatalRoleError(
                        f"topic {full} does not exist; run `tapioca topics create` first")
                assignment += [TopicPartition(full, p, OFFSET_BEGINNING) for p in md.partitions]
            self._bcast.assign(assignment)
        self.fleet.open()

    def _close(self) -> None:
        try:
            if self.producer is not None:
                self.producer.close()
        finally:
            for consumer in (self._group, self._bcast):
                if consumer is not None:
                    try:
                        consumer.close()
                    except Exception:  # closing after a broker loss must not mask the cause
                        pass
            self.fleet.close()

    # ------------------------------------------------------------------ rebalance

    def _on_assign(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._assigned.update((p.topic, p.partition) for p in partitions)
        # Partitions cannot be paused before the assignment takes effect; the next loop
        # turn pauses them (records fetched meanwhile are held, not handled).
        self._repause = True
        self.role.on_assign(self.state, [(p.topic, p.partition) for p in partitions])

    def _on_revoke(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Commit what is safe before another member takes these partitions over.
        try:
            self._confirm_and_commit()
        except TapiocaError as exc:
            log.warning("commit on revoke failed: %s", exc)
        tps = [(p.topic, p.partition) for p in partitions]
        self._assigned.difference_update(tps)
        self._held = [(m, b) for m, b in self._held if b or (m.topic(), m.partition()) not in tps]
        self._parked.drop(tps)  # uncommitted: the new owner reads them again
        self.role.on_revoke(self.state, tps)
        for tp in tps:
            self._next.pop(tp, None)
            self._committed.pop(tp, None)

    # ------------------------------------------------------------------ the loop

    def _poll_once(self) -> bool:
        if self.control.paused or self.control.draining:
            return self._poll_stopped_intake()
        if self._held:  # fetched while paused: handled first, in order, after a resume
            messages, self._held = self._held, []
            return self._handle_messages(messages)
        messages: list[tuple[Message, bool]] = []
        # consume(n, t) waits for n records or t: wait for one, then take what is already
        # there, so a sparse stream is not delayed by the poll timeout.
        wait_s = min(self.poll_timeout_s, self.role.tick_interval_s)
        if self._bcast is not None:
            # Broadcast only (the feeder): block here; else the group wait below does.
            messages += [(m, True) for m in _consume_some(
                self._bcast, self.batch_size, 0 if self._group is not None else wait_s)]
        if self._group is not None:
            # Beside a broadcast input, wait in short slices, so a weights event that
            # arrives meanwhile is handled within a slice, not after the whole timeout.
            if messages:
                wait_s = 0
            elif self._bcast is not None:
                wait_s = min(self.poll_timeout_s, self.cfg.broadcast_wait_slice_ms / 1000)
            else:
                wait_s = self.poll_timeout_s
            messages += [(m, False) for m in _consume_some(self._group, self.batch_size, wait_s)]
        elif self._bcast is None:  # no inputs: a timer-driven role
            time.sleep(wait_s)
        return self._handle_messages(messages)

    def _poll_stopped_intake(self) -> bool:
        """Paused or draining: input partitions are paused, but the group consumer is
        still polled (rebalance callbacks, and staying in the group); whatever was
        already fetched is held for after a resume. Draining still handles broadcasts."""
        if self._repause and self._group is not None:
            self._repause = False
            pause_partitions(self._group, True)
        handled = False
        if self._bcast is not None:
            got = [(m, True) for m in self._bcast.consume(self.batch_size, timeout=0)]
            if self.control.draining:
                # In-flight work may wait for a broadcast (the weights it was admitted under).
                held = [x for x in self._held if x[1]]
                self._held = [x for x in self._held if not x[1]]
                handled = self._handle_messages(held + got)
            else:
                self._held += got
        if self._group is not None:
            self._held += [(m, False) for m in self._group.consume(
                self.batch_size, timeout=self.poll_timeout_s)]
        else:
            time.sleep(min(self.poll_timeout_s, self.role.tick_interval_s))
        return handled

    def _handle_messages(self, messages: list[tuple[Message, bool]]) -> bool:
        handled = False
        for msg, broadcast in messages:
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    continue
                if err.fatal():
                    raise FatalRoleError(f"consumer failed: {err.str()}")
                log.warning("consumer error (will retry): %s", err.str())
                continue
            tp = (msg.topic(), msg.partition())
            if not broadcast and tp not in self._assigned:
                # Fetched before a rebalance took the partition away: its new owner
                # reads it from the committed offset; handling it here would race.
                continue
            if tp in self._parked:  # waits behind a failed record of its partition
                self._parked.hold(tp, (msg, broadcast))
                continue
            handled |= self._attempt(msg, broadcast, failures=0)
        return handled

    def _attempt(self, msg: Message, broadcast: bool, failures: int,
                 behind: list[tuple[Message, bool]] | None = None) -> bool:
        """Handle (or dead-letter) one record; if it fails and may be retried, park its
        partition, with ``behind`` (records already waiting) after it. True if done."""
        if self._handle_message(msg, broadcast, attempt=failures + 1):
            return True
        tp = (msg.topic(), msg.partition())
        self._parked.park(tp, (msg, broadcast), failures + 1, time.monotonic(), behind or ())
        self._pause_partition(tp, broadcast, True)
        return False

    def _retry_parked(self) -> bool:
        """Try again every parked record whose backoff has passed, then the records of
        its partition that waited behind it (in order). Paused: nothing; draining: only
        broadcast records (no new group input is started)."""
        if not len(self._parked) or self.control.paused:
            return False
        handled = False
        for tp in self._parked.due(time.monotonic()):
            (msg, broadcast), failures, behind = self._parked.take(tp)
            if self.control.draining and not broadcast:
                self._parked.park(tp, (msg, broadcast), failures, time.monotonic(), behind)
                continue
            self._pause_partition(tp, broadcast, False)
            if self._attempt(msg, broadcast, failures, behind):
                handled = True
                handled |= self._handle_messages(behind)
        return handled

    def _pause_partition(self, tp: tuple[str, int], broadcast: bool, pause: bool) -> None:
        """Stop fetching a parked partition (its later records would only pile up in
        memory), or fetch again. Best effort: records fetched anyway wait in order."""
        consumer = self._bcast if broadcast else self._group
        if consumer is None:
            return
        try:
            (consumer.pause if pause else consumer.resume)([TopicPartition(*tp)])
        except Exception as exc:  # e.g. mid-rebalance
            log.debug("could not %s %s: %s", "pause" if pause else "resume", tp, exc)

    def _handle_message(self, msg: Message, broadcast: bool, attempt: int = 1) -> bool:
        """Handle or dead-letter one record; False when it failed and waits for a retry
        (or, while stopping, for redelivery)."""
        source = Source.of(msg, broadcast)
        if attempt == 1:
            self.stats.consumed += 1
        raw = msg.value()
        spec = self._types[source.topic]
        try:
            event = decode_event(raw, allowed_types=spec.value_types,
                                 max_bytes=self.cfg.max_message_bytes)
            # Signed topics: a forged or unsigned record is a dead letter (bus/signing.py);
            # another run's is skipped unread below, whatever key it was signed with.
            if not of_another_run(self.cfg.run_id, event.run_id):
                self.cfg.verify(spec, raw, msg.headers())
        except SchemaError as exc:
            self.dead_letter(raw, source, exc, attempts=1)
        else:
            if not self._ours(event):
                if not broadcast and self._unattributed(event, spec):
                    self.dead_letter(raw, source, UnattributedEventError(
                        f"{event.type} event on {source.topic} has run_id {event.run_id!r} "
                        f"(or none), but this {self.role.name} belongs to run "
                        f"{self.cfg.run_id!r}: stamp it with the run_id of the events it "
                        "answers (a reward: its trajectory's)"), attempts=1)
                else:
                    self.stats.foreign += 1
            elif not self._try_handle(event, raw, source, attempt):
                return False
        if not broadcast:
            self._next[(source.topic, source.partition)] = source.offset + 1
        return True

    def _try_handle(self, event: Event, raw: bytes, source: Source, attempt: int) -> bool:
        """One attempt at ``role.handle``; True when done (handled or dead-lettered),
        False when it should be tried again later."""
        try:
            # Publishing is inside: an output that cannot be encoded (too large,
            # invalid) dead-letters its input instead of stopping the role.
            self.publish_outputs(list(self.role.handle(event, self.state, source) or ()))
        except FatalRoleError:
            raise
        except (SchemaError, BadEventError) as exc:
            if isinstance(exc, SchemaError) or not exc.retryable:  # no retry can fix it
                self.dead_letter(raw, source, exc, attempts=attempt)
                return True
            return self._failed(exc, raw, source, attempt)
        except Exception as exc:
            _raise_storage_error(exc)
            return self._failed(exc, raw, source, attempt)
        self.stats.handled += 1
        return True

    def _failed(self, exc: BaseException, raw: bytes, source: Source, attempt: int) -> bool:
        if self._stop.is_set():
            log.warning("stopping during a failing %s; left for redelivery: %s",
                        self.role.name, exc)
            return False
        if attempt >= self.cfg.handler_max_attempts:
            log.error("handler of %s failed %d times, dead-lettering: %s",
                      self.role.name, attempt, exc)
            self.dead_letter(raw, source, exc, attempts=attempt)
            return True
        self.stats.retries += 1
        log.warning("handler of %s failed on %s[%d]@%d (attempt %d of %d), retried in %.2f s; "
                    "the partition waits, the rest goes on: %s", self.role.name, source.topic,
                    source.partition, source.offset, attempt, self.cfg.handler_max_attempts,
                    backoff_s(self.cfg.handler_backoff_s, attempt), exc)
        return False

    def _tick(self, now: float) -> None:
        """``role.on_tick``; a fault is retried with backoff (ticks wait, events and
        control go on), then the event it names is dead-lettered and handed to
        ``role.on_dead_letter``. A fault that names no event is raised after its
        retries: the role cannot go on, its supervisor restarts it."""
        try:
            out = list(self.role.on_tick(self.state, time.time()) or ())
        except FatalRoleError:
            raise
        except Exception as exc:
            _raise_storage_error(exc)
            self._tick_failed(exc, now)
            return
        self._tick_failures.clear()
        self.publish_outputs(out)

    def _tick_failed(self, exc: Exception, now: float) -> None:
        event = exc.event if isinstance(exc, BadEventError) else None
        key = event.event_id if isinstance(event, Event) else None
        failures = self._tick_failures[key] = self._tick_failures.get(key, 0) + 1
        self.stats.tick_failures += 1
        if self._stop.is_set():
            log.warning("stopping during a failing tick of %s: %s", self.role.name, exc)
            return
        retryable = event is None or exc.retryable
        if retryable and failures < self.cfg.handler_max_attempts:
            self.stats.retries += 1
            delay = backoff_s(self.cfg.handler_backoff_s, failures)
            self._ticks_resume_at = now + delay
            log.warning("tick of %s failed (attempt %d of %d), ticks resume in %.2f s, events "
                        "keep flowing: %s", self.role.name, failures,
                        self.cfg.handler_max_attempts, delay, exc)
            return
        del self._tick_failures[key]
        if event is None:
            raise exc
        log.error("tick of %s failed %d times on a %s event, dead-lettering it and going on: %s",
                  self.role.name, failures, getattr(event, "type", "?"), exc)
        self._dead_letter_event(event, exc.source, exc, attempts=failures)
        self.role.on_dead_letter(self.state, event, exc)

    def _status(self) -> MetricsEvent:
        """The member's counters and the role's own numbers (``describe``), so tools can
        follow progress and backlogs from the log."""
        s = self.stats
        metrics = {"bus/consumed": s.consumed, "bus/handled": s.handled, "bus/produced": s.produced,
                   "bus/dead_lettered": s.dead_lettered, "bus/retries": s.retries,
                   "bus/foreign": s.foreign,
                   # A paused member is idle on purpose (the launcher's stall alarm).
                   "bus/paused": self.control.paused,
                   "bus/tick_failures": s.tick_failures, "bus/parked": self._parked.waiting()}
        for error_type, n in s.dead_lettered_by_type.items():
            metrics[f"bus/dead_lettered/{error_type}"] = n
        for key, value in self.role.describe(self.state).items():
            if isinstance(value, (int, float)):  # bools too
                metrics[f"{self.role.name}/{key}"] = value
        return MetricsEvent(source=self.member_id, step=s.handled,
                            metrics={k: float(v) for k, v in metrics.items()})

    def dead_letter(self, raw: bytes | None, source: Source, exc: BaseException,
                    *, attempts: int) -> None:
        """Publish ``raw`` (the record as read at ``source``) to ``dlq.v1`` with the error
        and the number of ``attempts``, counted by error type in the member's status;
        confirmed before the next commit. MemberFleet dead-letters forged commands here."""
        record, headers = dead_letter_record(raw, source, exc, consumer_group=self.group_id,
                                             attempts=attempts)
        log.warning("dead-lettered %s[%d]@%d: %s", source.topic, source.partition,
                    source.offset, exc)
        self.producer.publish(record, headers=headers)
        self._unconfirmed = True
        self.stats.dead_lettered += 1
        self.stats.dead_lettered_by_type[type(exc).__name__] += 1

    def _dead_letter_event(self, event: Event, source: Source | None, exc: BaseException,
                           *, attempts: int) -> None:
        """Dead-letter an event read earlier (its bytes re-encoded: same fields, same
        event_id, so `tapioca dlq retry` republishes it as it was)."""
        try:
            raw = encode_event(event, max_bytes=self.cfg.max_message_bytes)
        except SchemaError:
            raw = b""
        if not isinstance(source, Source):
            spec = topic_for(event)
            source = Source(topic=self.cfg.topic(spec), partition=-1, offset=-1,
                            key=spec.key_of(event))
        self.dead_letter(raw, source, exc, attempts=attempts)

    def publish_outputs(self, events: Iterable[Event | DeadLetter] | None) -> None:
        """Publish a role's outputs (from ``handle``, ``on_tick``, ``on_control``, ...):
        counted as produced, and confirmed on the log before the inputs that led to them
        are committed; a ``DeadLetter`` item dead-letters the event it names."""
        for event in events or ():
            if isinstance(event, DeadLetter):
                self._dead_letter_event(event.event, event.source, event.error, attempts=1)
                continue
            self.producer.publish(event)
            self._unconfirmed = True
            self.stats.produced += 1
            if isinstance(event, MetricsEvent):  # shown in heartbeats (e.g. staleness)
                self.fleet.last_role_metrics = dict(list(event.metrics.items())[:64])

    def publish_own(self, event: Event) -> None:
        """The runner's own events (status, heartbeats, acks): not counted as outputs."""
        self.producer.publish(event)
        self._unconfirmed = True

    def set_intake(self, *, group: bool, broadcast: bool) -> None:
        """Fetch (True) or stop fetching (False) every assigned partition of the group
        inputs and of the broadcast inputs: pause stops both, resume starts both, drain
        stops group input while broadcasts go on. Records fetched meanwhile are held
        (see ``_poll_stopped_intake``), never lost."""
        pause_partitions(self._group, not group)
        if self._bcast is not None:
            pause_partitions(self._bcast, not broadcast)

    def input_lag(self) -> dict[str, int]:
        """Approximate lag per assigned group partition (``"<topic name>/<partition>"``):
        the last high watermark seen in a fetch (no broker round trip) minus our position.
        Tansu undercounts watermarks (docs/kafka-clients.md), so this is a hint for
        heartbeats, never an input to logic."""
        if self._group is None or not self._assigned:
            return {}
        lag: dict[str, int] = {}
        try:
            tps = [TopicPartition(t, p) for t, p in sorted(self._assigned)]
            for tp in self._group.position(tps):
                if tp.offset < 0:
                    continue  # nothing fetched yet
                _low, high = self._group.get_watermark_offsets(tp, cached=True)
                if high >= 0:
                    lag[f"{self._types[tp.topic].name}/{tp.partition}"] = max(high - tp.offset, 0)
        except Exception as exc:  # lag is informational
            log.debug("lag unavailable: %s", exc)
        return lag

    def _confirm_and_commit(self) -> None:
        """Flush outputs, then commit every partition whose safe offset advanced."""
        if self.producer is None:
            return
        if self._unconfirmed:
            # At-least-once: outputs must be on the log before inputs are marked done.
            self.producer.flush()
            self._unconfirmed = False
        if self._group is None or not self._next:
            return
        offsets = []
        for (name, partition), next_offset in self._next.items():
            safe = self.role.committable(self.state, name, partition, next_offset)
            if safe > self._committed.get((name, partition), -1):
                offsets.append(TopicPartition(name, partition, safe))
        if not offsets:
            return
        try:
            self._group.commit(offsets=offsets, asynchronous=False)
        except Exception as exc:  # e.g. a rebalance in progress; redelivery is harmless
            log.warning("offset commit failed (events may be redelivered): %s", exc)
            return
        self.stats.commits += 1
        for tp in offsets:
            self._committed[(tp.topic, tp.partition)] = tp.offset

