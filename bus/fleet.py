"""Fleet control on the log: heartbeats on ``fleet.v1`` and commands on ``control.v1``.

Member side (:class:`MemberFleet`, which :class:`~tapioca.bus.runner.RoleRunner`
delegates to; :class:`MemberControl` is its pure state): every member emits a
:class:`FleetEvent` on ``fleet.v1`` (keyed by ``member_id``) every
``bus.fleet_heartbeat_interval_s`` and on each status change, and consumes
:class:`ControlEvent` from ``control.v1`` (read from the end, never history). A command
whose ``target`` is the member's role name, its member id or ``"all"``, and whose
signature verifies under the run's key when one is configured (bus/signing.py; a
command that does not verify is dead-lettered and ignored; one stamped with another
run's id is that run's, skipped and counted as ``foreign`` without a check), is applied
(``pause`` / ``resume`` / ``drain`` by the runner, anything else by ``Role.on_control``)
and answered with a :class:`ControlAckEvent` on ``control.v1`` (keyed by ``target``).

Operator side (used by the CLI): :func:`read_fleet` (the latest heartbeat of every
member), :func:`resolve_target` (which live members a target names; an unknown target
is an error before anything is sent) and :func:`send_command` (publish, then collect the
acknowledgements).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Iterable, Optional, Protocol

from confluent_kafka import OFFSET_END, Consumer, KafkaError, TopicPartition

from ..schemas.envelope import ANY_RUN, Event, decode_event, of_another_run, run_addresses, run_reads
from ..schemas.errors import FatalRoleError, SchemaError, TapiocaError
from ..schemas.events import ControlAckEvent, ControlEvent, FleetEvent
from ..schemas.registry import topic
from .role import DeadLetter, Role, Source
from .settings import BusConfig
from .signing import SignatureError

log = logging.getLogger(__name__)

#: fetch.wait.max.ms of the control.v1 consumer (see MemberFleet.open).
CONTROL_FETCH_WAIT_MS = 500

RUNNER_COMMANDS = ("pause", "resume", "drain")
ALL = "all"
# A member is stale when its last heartbeat is older than this many of its intervals.
STALE_AFTER_INTERVALS = 3.0
DEFAULT_INTERVAL_S = 2.0
# A stale member (e.g. busy in a long training step, which blocks its loop) is still sent
# commands while its last heartbeat is at most this old; it acknowledges when it is free.
TARGETABLE_STALE_S = 300.0
# Commands produced up to this long before a member started are still its own: hosts'
# clocks differ by a little (NTP keeps them within well under a second; containers and
# VMs sometimes drift by more), and a command the CLI sent to "rollout" a moment before a
# new rollout member came up is meant for it too. A redelivered one still runs once
# (command ids are remembered).
CLOCK_SKEW_SLACK_S = 5.0


class ControlError(TapiocaError):
    """A fleet command could not be sent or was not acknowledged as asked."""


def matches(target: str, role: str, member_id: str) -> bool:
    """Whether a command addressed to ``target`` is for this member."""
    return target in (ALL, role, member_id)


# ---------------------------------------------------------------------- member side


@dataclass
class MemberControl:
    """The runner-level control state of one member: which commands are its own, and
    what pause / resume / drain do to its status. Pure logic; the runner does the I/O."""

    member_id: str
    role: str
    run_id: str = ANY_RUN
    # Commands produced before the member started are history, not orders for it: the
    # control topic's end offset may be reported too low (docs/kafka-clients.md), so older
    # commands can be read again at start and are skipped by time (with
    # CLOCK_SKEW_SLACK_S of slack: the CLI's clock is not the member's).
    started_at: float = field(default_factory=time.time)
    paused: bool = False
    draining: bool = False
    _seen: set[str] = field(default_factory=set)

    @property
    def status(self) -> str:
        return "draining" if self.draining else "paused" if self.paused else "running"

    def accepts(self, event: Any) -> bool:
        """True (once per command id) when ``event`` is a command for this member."""
        if not isinstance(event, ControlEvent):
            return False  # acknowledgements share the topic
        if not matches(event.target, self.role, self.member_id):
            return False
        # CLI commands carry ANY_RUN (every run); a command stamped with a run id is only
        # for that run's members.
        if not run_addresses(self.run_id, event.run_id):
            return False
        if (event.produced_at < self.started_at - CLOCK_SKEW_SLACK_S
                or event.command_id in self._seen):
            return False
        self._seen.add(event.command_id)
        return True

    def apply(self, command: ControlEvent) -> tuple[bool, str, Optional[str]]:
        """Apply a runner command; returns (ok, message, change) where ``change`` is the
        transition the runner must carry out ("pause", "resume", "drain") or None."""
        name = command.command
        if name not in RUNNER_COMMANDS:
            raise ValueError(f"{name!r} is not a runner command")
        if self.draining:
            if name == "drain":
                return True, "already draining", None
            return False, (f"cannot {name}: the member is draining and exits once its "
                           "in-flight work is done"), None
        if name == "pause":
            if self.paused:
                return True, "already paused", None
            self.paused = True
            return True, "paused", "pause"
        if name == "resume":
            if not self.paused:
                return True, "not paused; nothing to resume", None
            self.paused = False
            return True, "resumed", "resume"
        was_paused, self.paused, self.draining = self.paused, False, True
        return True, ("draining" + (" (was paused: resumed to finish in-flight work)"
                                    if was_paused else "")), "drain"

    def ack(self, command: ControlEvent, ok: bool, message: str) -> ControlAckEvent:
        return ControlAckEvent(command_id=command.command_id, target=command.target,
                               member_id=self.member_id, ok=ok, message=message[:2000])


class RateMeter:
    """Per-second rates of monotonically growing counters between two calls."""

    def __init__(self) -> None:
        self._last: tuple[float, dict[str, float]] | None = None

    def update(self, now: float, counters: dict[str, float]) -> dict[str, float]:
        last, self._last = self._last, (now, dict(counters))
        if last is None or now <= last[0]:
            return {f"{k}_per_s": 0.0 for k in counters}
        dt = now - last[0]
        return {f"{k}_per_s": round((v - last[1].get(k, 0.0)) / dt, 3) for k, v in counters.items()}


def policy_version_of(described: dict[str, Any]) -> int:
    """The policy version a role reports in ``describe()`` (``version`` or
    ``policy_version``), else 0."""
    for key in ("policy_version", "version"):
        value = described.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return int(value)
    return 0


def numeric(values: dict[str, Any], limit: int = 64) -> dict[str, float]:
    """The int / float / bool entries of a dict as floats (at most ``limit``)."""
    out: dict[str, float] = {}
    for k, v in values.items():
        if isinstance(v, (int, float)):
            out[str(k)] = float(v)
            if len(out) >= limit:
                break
    return out


class FleetRunner(Protocol):
    """What :class:`MemberFleet` drives: the runner's public surface (bus/runner.py
    RoleRunner, which imports this module; this one names it structurally)."""

    member_id: str
    group_id: str
    role: Role
    state: Any
    cfg: BusConfig
    stats: Any  # RunnerStats: the member's counters
    producer: Any  # EventProducer

    def publish_outputs(self, events: Iterable[Event | DeadLetter] | None) -> None: ...

    def publish_own(self, event: Event) -> None: ...

    def dead_letter(self, raw: bytes | None, source: Source, exc: BaseException, *,
                    attempts: int) -> None: ...

    def set_intake(self, *, group: bool, broadcast: bool) -> None: ...

    def input_lag(self) -> dict[str, int]: ...


class MemberFleet:
    """The member side of fleet control for one :class:`RoleRunner`: reads its commands
    from ``control.v1``, carries out pause / resume / drain on the runner's consumers and
    role, hands other commands to ``Role.on_control``, acknowledges every command, and
    publishes the member's heartbeats. The runner owns the consumers, the state and the
    producer; this class drives them through the runner's public surface only
    (``publish_outputs``, ``publish_own``, ``dead_letter``, ``set_intake``,
    ``input_lag``, and its ``role``, ``state``, ``cfg``, ``stats`` and ``producer``)."""

    def __init__(self, runner: FleetRunner) -> None:
        self.runner = runner
        self.control = MemberControl(runner.member_id, runner.role.name,
                                     run_id=runner.cfg.run_id)
        self.consumer: Consumer | None = None
        self.rates = RateMeter()
        self.next_heartbeat = 0.0
        self.role_paused = False
        # The role's last MetricsEvent (e.g. staleness), shown in heartbeats.
        self.last_role_metrics: dict[str, float] = {}
        self._forged: set[str] = set()  # command ids already dead-lettered
        # When the member last consumed or produced anything: `tapioca status` raises a
        # stall alarm when every running member has been idle for long.
        self._activity: tuple[int, int, float] = (-1, -1, time.time())

    def open(self) -> None:
        """Read control.v1 from its end: commands sent before this member existed are not
        for it (and ``MemberControl`` skips any that an undercounted end lets through).
        The end is looked up now, not left to the first fetch, so a command sent right
        after the first heartbeat cannot fall before the resolved position."""
        r = self.runner
        full = r.cfg.topic(topic("control"))
        # Commands are rare and a half-second reaction is plenty: a long fetch wait keeps
        # one idle control consumer per member from costing the broker ~100 fetches/s
        # (the data-path default of 10 ms made Tansu burn ~40% of a core in the demo).
        self.consumer = Consumer(
            {**r.cfg.consumer_conf(f"{r.group_id}.{r.member_id}.control"),
             "fetch.wait.max.ms": CONTROL_FETCH_WAIT_MS})
        md = self.consumer.list_topics(full, timeout=10).topics.get(full)
        if md is None or md.error is not None or not md.partitions:
            log.warning("topic %s does not exist: fleet control is off for %s "
                        "(`tapioca topics create` creates it)", full, r.member_id)
            self.consumer.close()
            self.consumer = None
            return
        assignment = []
        for p in sorted(md.partitions):
            _low, high = self.consumer.get_watermark_offsets(TopicPartition(full, p), timeout=10)
            assignment.append(TopicPartition(full, p, high if high >= 0 else OFFSET_END))
        self.consumer.assign(assignment)

    def close(self) -> None:
        if self.consumer is not None:
            try:
                self.consumer.close()
            except Exception:  # closing after a broker loss must not mask the cause
                pass

    def serve(self) -> None:
        """Apply the commands on control.v1 addressed to this member, and ack each."""
        if self.consumer is None:
            return
        r = self.runner
        for msg in self.consumer.consume(16, timeout=0):
            if msg.error() is not None:
                if msg.error().code() != KafkaError._PARTITION_EOF:
                    log.warning("control consumer error (will retry): %s", msg.error().str())
                continue
            try:
                event = decode_event(msg.value(), allowed_types=(ControlEvent,),
                                     max_bytes=r.cfg.max_message_bytes)
            except SchemaError:
                continue  # acknowledgements (and anything else) share the topic
            if not self.authentic(msg, event):
                continue
            if not self.control.accepts(event):
                continue
            log.info("%s: control command %s (%s) from %s", r.member_id, event.command,
                     event.command_id, event.producer_id)
            outputs: list = []
            if event.command in RUNNER_COMMANDS:
                ok, message, change = self.control.apply(event)
                if change is not None:
                    outputs = self.transition(change)
            else:
                try:
                    ok, message, events = r.role.on_control(event, r.state)
                    outputs = list(events or ())
                except FatalRoleError as exc:  # e.g. a rollback that could not write (a full disk)
                    r.publish_own(self.control.ack(event, False, f"{exc}; {r.member_id} stopped"))
                    raise
                except TapiocaError as exc:
                    ok, message = False, str(exc)
                except Exception as exc:  # a failed command must not stop the member
                    log.exception("%s: command %s failed", r.member_id, event.command)
                    ok, message = False, f"{type(exc).__name__}: {exc}"
            r.publish_outputs(outputs)
            r.publish_own(self.control.ack(event, ok, message))
            self.heartbeat()  # the new status (and e.g. a new version) is visible at once

    def authentic(self, msg: Any, event: ControlEvent) -> bool:
        """A command for this member whose signature does not verify under the run's key
        (bus/signing.py) is dead-lettered, once, and not obeyed; commands for other
        members are left to them, and so are another run's (signed with its own key: no
        forgery), counted as foreign."""
        r = self.runner
        if not matches(event.target, self.control.role, self.control.member_id):
            return False
        if of_another_run(self.control.run_id, event.run_id):
            r.stats.foreign += 1
            return False
        try:
            r.cfg.verify(topic("control"), msg.value(), msg.headers())
            return True
        except SignatureError as exc:
            if event.command_id not in self._forged:
                self._forged.add(event.command_id)
                source = Source.of(msg)
                log.warning("%s: refused control command %s (%s) from %s: %s", r.member_id,
                            event.command, event.command_id, event.producer_id, exc)
                r.dead_letter(msg.value(), source, exc, attempts=1)
            return False

    def transition(self, change: str) -> list:
        r = self.runner
        if change == "pause":
            r.set_intake(group=False, broadcast=False)
            r.role.on_pause(r.state, True)
            self.role_paused = True
            return []
        if change == "resume":
            r.set_intake(group=True, broadcast=True)
            r.role.on_pause(r.state, False)
            self.role_paused = False
            return []
        # drain: group input stays stopped; broadcasts and ticks go on to finish in-flight work.
        r.set_intake(group=False, broadcast=True)
        if self.role_paused:  # a paused member that is drained finishes its work first
            r.role.on_pause(r.state, False)
            self.role_paused = False
        return list(r.role.on_drain(r.state) or ())

    def heartbeat(self, status: str | None = None) -> None:
        r = self.runner
        s = r.stats
        now = time.monotonic()
        described = r.role.describe(r.state) if r.state is not None else {}
        rates = self.rates.update(now, {"in": s.consumed, "out": s.produced,
                                        "handled": s.handled})
        consumed, produced, active_at = self._activity
        if (s.consumed, s.produced) != (consumed, produced):
            self._activity = (s.consumed, s.produced, time.time())
        detail = {
            "interval_s": r.cfg.fleet_heartbeat_interval_s,
            "group_id": r.group_id, "consumed": s.consumed, "handled": s.handled,
            "produced": s.produced, "dead_lettered": s.dead_lettered, "retries": s.retries,
            # Events of other runs on these topics, skipped (bus/runner.py).
            "foreign": s.foreign,
            "started_at": self.control.started_at, "lag_approximate": True,
            "idle_s": round(time.time() - self._activity[2], 1),
            "describe": numeric(described), "metrics": self.last_role_metrics,
            # Which key this member verifies commands with (its id, never the key), so
            # the CLI can say when it lacks the run's key instead of timing out.
            "signing_key_id": key.key_id if (key := r.cfg.signing_key()) else None,
        }
        r.publish_own(FleetEvent(
            member_id=r.member_id, role=r.role.name,
            status=status or self.control.status, host=socket.gethostname(),
            pid=os.getpid(), policy_version=policy_version_of(described), rates=rates,
            lag=r.input_lag(), detail=detail))
        self.next_heartbeat = now + r.cfg.fleet_heartbeat_interval_s

    def heartbeat_failed(self, exc: BaseException) -> None:
        """Best effort: tell the fleet this member failed (the broker may be the cause)."""
        r = self.runner
        if r.producer is None:
            return
        try:
            event = FleetEvent(member_id=r.member_id, role=r.role.name, status="failed",
                               host=socket.gethostname(), pid=os.getpid(),
                               detail={"error": f"{type(exc).__name__}: {exc}"[:2000],
                                       "interval_s": r.cfg.fleet_heartbeat_interval_s})
            r.producer.publish(event)
            r.producer.flush(timeout_s=2.0)
        except Exception:  # never mask the original error
            pass


def pause_partitions(consumer: Consumer | None, pause: bool) -> None:
    """Pause (or resume) every partition assigned to ``consumer``."""
    if consumer is None:
        return
    try:
        assignment = consumer.assignment()
        if assignment:
            (consumer.pause if pause else consumer.resume)(assignment)
    except Exception as exc:  # e.g. mid-rebalance; records fetched meanwhile are held
        log.warning("could not %s partitions: %s", "pause" if pause else "resume", exc)


# ---------------------------------------------------------------------- operator side


@dataclass
class MemberView:
    """The latest heartbeat of one member, as of ``now``."""

    event: FleetEvent
    age_s: float

    @property
    def interval_s(self) -> float:
        return float(self.event.detail.get("interval_s", DEFAULT_INTERVAL_S))

    @property
    def stale(self) -> bool:
        return (self.event.status not in ("stopped", "failed")
                and self.age_s > STALE_AFTER_INTERVALS * self.interval_s)

    @property
    def live(self) -> bool:
        return not self.stale and self.event.status not in ("stopped", "failed")

    @property
    def targetable(self) -> bool:
        return self.event.status not in ("stopped", "failed") and (
            self.live or self.age_s <= TARGETABLE_STALE_S)

    def to_json(self) -> dict[str, Any]:
        e = self.event
        metrics = e.detail.get("metrics", {})
        return {
            "member_id": e.member_id, "role": e.role, "status": e.status,
            "stale": self.stale, "live": self.live, "age_s": round(self.age_s, 2),
            "run_id": e.run_id, "host": e.host, "pid": e.pid,
            "policy_version": e.policy_version, "rates": e.rates, "lag": e.lag,
            "lag_total": sum(e.lag.values()) if e.lag else None,
            "dead_lettered": int(e.detail.get("dead_lettered", 0)),
            "foreign": int(e.detail.get("foreign", 0)),
            "idle_s": e.detail.get("idle_s"),
            "staleness_mean": metrics.get("trainer/staleness_mean"),
            "staleness_max": metrics.get("trainer/staleness_max"),
            "detail": e.detail,
        }


def read_fleet(cfg: BusConfig, *, window_s: float | None = 900.0, tail: int = 4096,
               now: float | None = None, run_id: str = ANY_RUN) -> list[MemberView]:
    """The latest heartbeat of every member heard from in the last ``window_s`` seconds
    (None: the whole topic), sorted by role and member id; only the members of
    ``run_id`` when it names a run (runs before it on the same prefix reuse member ids).

    Reads by time without ``offsets_for_times`` (not dependable on Tansu, docs/kafka-clients.md):
    the last ``tail`` records per partition first, and while a partition's oldest
    record read is still inside the window, four times as many -- so the read grows with
    the number of members (each heartbeats every interval) instead of missing the quiet
    ones of a large fleet."""
    now = time.time() if now is None else now
    cutoff = None if window_s is None else now - window_s
    while True:
        latest, oldest, counts = _read_heartbeats(cfg, None if cutoff is None else tail, run_id)
        if cutoff is None or tail >= 1 << 24 or not any(
                counts[p] >= tail and oldest[p] > cutoff for p in counts):
            break
        tail *= 4
    if cutoff is not None:
        latest = {m: ev for m, ev in latest.items() if ev.produced_at >= cutoff}
    views = [MemberView(ev, max(now - ev.produced_at, 0.0)) for ev in latest.values()]
    return sorted(views, key=lambda m: (m.event.role, m.event.member_id))


def _read_heartbeats(cfg: BusConfig, tail: int | None, run_id: str = ANY_RUN
                     ) -> tuple[dict[str, FleetEvent], dict[int, float], dict[int, int]]:
    """The latest heartbeat per member of ``run_id`` (:func:`run_reads`) in the last
    ``tail`` records of each partition (None: all), and per partition the oldest record
    time and the record count (of every run: they bound the read)."""
    from .reader import TopicReader

    latest: dict[str, FleetEvent] = {}
    oldest: dict[int, float] = {}
    counts: dict[int, int] = {}
    with TopicReader(cfg, "fleet", tail=tail) as reader:
        for record in reader.records(idle_s=0.3, timeout_s=30):
            p = record.source.partition
            counts[p] = counts.get(p, 0) + 1
            ev = record.event
            if isinstance(ev, FleetEvent):
                oldest[p] = min(oldest.get(p, ev.produced_at), ev.produced_at)
                if not run_reads(run_id, ev.run_id):
                    continue
                prev = latest.get(ev.member_id)
                if prev is None or ev.produced_at >= prev.produced_at:
                    latest[ev.member_id] = ev
    for p in counts:
        oldest.setdefault(p, float("inf"))  # nothing decodable: no reason to read further
    return latest, oldest, counts


def stall(members: Iterable[MemberView], stall_after_s: float) -> str | None:
    """An alarm when every live running member has been idle (consumed and produced
    nothing) for ``stall_after_s`` or longer: a fleet that claims to run but does not
    move (e.g. its broker lost the topics). None when some member moves."""
    running = [m for m in members if m.live and m.event.status == "running"]
    idle = [m for m in running if isinstance(m.event.detail.get("idle_s"), (int, float))]
    if not running or len(idle) < len(running):
        return None
    least = min(float(m.event.detail["idle_s"]) + m.age_s for m in idle)
    if least < stall_after_s:
        return None
    return (f"stalled: all {len(running)} running member(s) have consumed and produced "
            f"nothing for at least {least:.0f} s; is the broker healthy (`tapioca topics "
            "list`: every topic there, with its partitions)? are inputs flowing?")


def resolve_target(members: Iterable[MemberView], target: str) -> list[MemberView]:
    """The members a target (role name, member id or "all") names among those that are
    live or only recently stale; a target that names none is an error listing what is
    alive."""
    members = list(members)
    reachable = [m for m in members if m.targetable]
    chosen = [m for m in reachable if matches(target, m.event.role, m.event.member_id)]
    if chosen:
        return chosen
    down = [f"{m.event.member_id} ({'stale' if m.stale else m.event.status})" for m in members
            if not m.targetable and matches(target, m.event.role, m.event.member_id)]
    hint = f" ({', '.join(down)}: not live)" if down else ""
    if not reachable:
        raise ControlError(
            f"no live member matches {target!r}{hint}: no member has sent a heartbeat on "
            "fleet.v1 recently (are the roles running, and is --prefix the run's topic prefix?)")
    roles = sorted({m.event.role for m in reachable})
    ids = sorted(m.event.member_id for m in reachable)
    raise ControlError(f"no live member matches {target!r}{hint}; live roles: "
                       f"{', '.join(roles)}; live members: {', '.join(ids)}; or use 'all'")


def check_signing(cfg: BusConfig, members: Iterable[MemberView]) -> None:
    """Refuse to send a command the members would dead-letter: they verify with a key
    (their heartbeats name its id) that this config lacks or does not match."""
    ids = {m.event.detail.get("signing_key_id") for m in members} - {None}
    if not ids:
        return
    key = cfg.signing_key()
    if key is None:
        raise ControlError(
            f"the members verify signed commands (key id {', '.join(sorted(ids))}) and no key "
            "is given: pass --run-dir RUN_DIR (the run's directory, whose secrets/bus.key "
            "signs its commands) or --key-file PATH, or set $TAPIOCA_SIGNING_KEY_FILE")
    if key.key_id not in ids:
        raise ControlError(
            f"the key {key.path} (id {key.key_id}) is not the one the members verify with "
            f"({', '.join(sorted(ids))}): is it another run's? pass that run's --run-dir")


def send_command(cfg: BusConfig, command: str, target: str, expect: Iterable[str], *,
                 args: dict[str, Any] | None = None, timeout_s: float = 10.0,
                 run_id: str | None = None) -> tuple[ControlEvent, dict[str, ControlAckEvent]]:
    """Publish a command and wait up to ``timeout_s`` for the acknowledgement of every
    member in ``expect``; returns the command and the acks that arrived (by member)."""
    from .producer import EventProducer
    from .reader import TopicReader

    expected = set(expect)
    event = ControlEvent(command_id=uuid.uuid4().hex, command=command, target=target,
                         args=dict(args or {}))
    if run_id:
        event.run_id = run_id
    acks: dict[str, ControlAckEvent] = {}
    # Positioned at the end before publishing, so no acknowledgement can be missed.
    with TopicReader(cfg, "control", tail=0) as reader:
        with EventProducer(cfg, f"tapioca-cli-{cfg.client_id}") as producer:
            producer.publish(event)
        deadline = time.monotonic() + timeout_s
        while expected - set(acks) and time.monotonic() < deadline:
            for record in reader.records(follow=True, timeout_s=min(0.5, timeout_s)):
                ev = record.event
                if isinstance(ev, ControlAckEvent) and ev.command_id == event.command_id:
                    acks[ev.member_id] = ev
                    if not expected - set(acks):
                        break
    return event, acks
