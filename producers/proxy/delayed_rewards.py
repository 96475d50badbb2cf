"""Rewards that come after a session ended (online mode, docs/online.md): the index of
ended sessions, rebuilt from the log, and the rule a late reward follows.

Consumes ``trajectories.v1`` (this run's proxy trajectories: ``session_id``, ``traj_id``,
``group_id``, ``delayed_reward_factor``, and ``produced_at``, when the session ended)
and ``rewards.v1`` (from any scorer: which trajectories have a reward). Both are read
from the beginning before the proxy serves (:meth:`SessionLog.catch_up`: the index is
complete, after a restart too) and then followed, so the sessions of another proxy of
the run and rewards from any service count. Emits ``RewardEvent`` (scorer
``"session"``, keyed by ``group_id``): a reward given to an ended session through
``POST /v1/sessions/{id}/reward`` or ``tapioca reward SESSION_ID VALUE`` (the signed
``reward`` control command to the role ``proxy-sessions``, :class:`RewardCommands`).

A late reward is refused with a status saying why: 404 unknown session (or one ended
before this log), 409 already rewarded (by anyone), not for training, or made no
completion, 410 past the reward window, 400 not a finite number within +-1e9
(algorithms/limits.py). The window is how long the advantage processor waits for it
(``advantage.reward_timeout_s``, else ``group_timeout_s``) less a margin, so a reward
accepted here is never one the processor already gave up on. Memory: one small entry
per ended session, forgotten two windows after its end.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable

from ...algorithms.limits import MAX_ABS_REWARD
from ...bus.reader import TopicReader
from ...bus.role import Role
from ...bus.settings import BusConfig
from ...config.schema import AdvantageConfig
from ...schemas.envelope import Event, run_reads
from ...schemas.errors import BusError
from ...schemas.events import RewardEvent, TrajectoryEvent
from .openai_errors import ApiError, bad_request

if TYPE_CHECKING:
    from ...schemas.events import ControlEvent

log = logging.getLogger(__name__)


def reward_window_s(advantage: AdvantageConfig) -> float:
    """How long after its end a session takes a reward: the advantage processor's wait
    less 10% (at most 60 s) for its lag behind the log."""
    wait = advantage.reward_timeout_s or advantage.group_timeout_s
    return wait - min(60.0, 0.1 * wait)


def check_reward(value: Any) -> float:
    """The reward of a request, or a 400 saying what is wrong with it."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise bad_request(f"reward must be a finite number, got {value!r}", "reward",
                          code="invalid_reward")
    if abs(value) > MAX_ABS_REWARD:
        raise bad_request(f"reward {value:g} is beyond +-{MAX_ABS_REWARD:g} (it would overflow "
                          "the training math); scale it", "reward", code="invalid_reward")
    return float(value)


@dataclass
class EndedSession:
    group_id: str
    # traj_id -> what a session reward is multiplied by for it
    factors: dict[str, float]
    ended_at: float  # wall clock
    rewarded: bool = False
    # Why it takes no reward ("" if it may), e.g. not for training.
    refusal: str = ""
    refusal_code: str = ""
    # The session's key, when this proxy served it (never on the log).
    api_key: str | None = None


@dataclass
class EndedSessions:
    """Thread-safe index: session id -> :class:`EndedSession`."""

    window_s: float
    clock: Callable[[], float] = time.time
    entries: dict[str, EndedSession] = field(default_factory=dict)
    _by_traj: dict[str, str] = field(default_factory=dict)
    _rewarded_trajs: set[str] = field(default_factory=set)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _pruned_at: float = 0.0

    def record(self, session_id: str, entry: EndedSession) -> None:
        """A session this proxy ended (its trajectories may not be back from the log yet)."""
        with self._lock:
            old = self.entries.get(session_id)
            if old is not None:  # read back from the log first: keep what it knew
                entry.rewarded |= old.rewarded
                entry.factors = {**old.factors, **entry.factors}
            self.entries[session_id] = entry
            self._index(session_id, entry)
            if self.clock() - self._pruned_at > 10.0:
                self._prune()

    def observe(self, event: Event) -> None:
        """A trajectory or reward read from the log."""
        with self._lock:
            if isinstance(event, TrajectoryEvent) and event.session_id:
                entry = self.entries.get(event.session_id)
                if entry is None:
                    entry = self.entries[event.session_id] = EndedSession(
                        event.group_id, {}, event.produced_at)
                entry.factors[event.traj_id] = event.delayed_reward_factor
                self._index(event.session_id, entry)
            elif isinstance(event, RewardEvent):
                self._rewarded_trajs.add(event.traj_id)
                sid = self._by_traj.get(event.traj_id)
                if sid is not None:
                    self.entries[sid].rewarded = True

    def _index(self, session_id: str, entry: EndedSession) -> None:
        for traj_id in entry.factors:
            self._by_traj[traj_id] = session_id
            entry.rewarded |= traj_id in self._rewarded_trajs

    def claim(self, session_id: str, key: str | None) -> EndedSession:
        """The entry a reward for ``session_id`` may go to, marked rewarded (call
        :meth:`release` if publishing fails); an :class:`ApiError` otherwise. ``key``:
        the caller's key (None: the admin key)."""
        with self._lock:
            self._prune()
            entry = self.entries.get(session_id)
            if entry is None:
                raise ApiError(404, f"no session {session_id!r} on this run's log (unknown, or "
                               "ended before the log's start)", code="session_not_found")
            if key is not None and key != entry.api_key:
                raise ApiError(403, "this key did not serve that session (after a proxy restart, "
                               "reward ended sessions with the admin key or `tapioca reward`)",
                               code="wrong_session")
            if entry.refusal:
                raise ApiError(409, f"session {session_id} {entry.refusal}", code=entry.refusal_code)
            if entry.rewarded:
                raise ApiError(409, f"session {session_id} already has its reward (a second one "
                               "would not change what trains)", code="already_rewarded")
            age = self.clock() - entry.ended_at
            if age > self.window_s:
                raise ApiError(410, f"session {session_id} ended {age:.0f} s ago, past the reward "
                               f"window of {self.window_s:.0f} s: the advantage processor no "
                               "longer waits for it (raise advantage.reward_timeout_s)",
                               code="reward_window_closed")
            entry.rewarded = True
            return entry

    def mark_rewarded(self, session_id: str) -> None:
        """Rewarded another way (with its group, before that was published)."""
        with self._lock:
            if session_id in self.entries:
                self.entries[session_id].rewarded = True

    def release(self, session_id: str) -> None:
        with self._lock:
            if session_id in self.entries:
                self.entries[session_id].rewarded = False

    def _prune(self) -> None:
        self._pruned_at = self.clock()
        horizon = self._pruned_at - 2 * self.window_s
        for sid in [s for s, e in self.entries.items() if e.ended_at < horizon]:
            for traj_id in self.entries.pop(sid).factors:
                self._by_traj.pop(traj_id, None)
                self._rewarded_trajs.discard(traj_id)

    def counts(self) -> dict[str, int]:
        """Ended sessions of the window: rewarded, and waiting for their reward."""
        with self._lock:
            now = self.clock()
            live = [e for e in self.entries.values()
                    if not e.refusal and now - e.ended_at <= self.window_s]
            return {"rewarded": sum(e.rewarded for e in live),
                    "rewards_pending": sum(not e.rewarded for e in live)}


def delayed_reward_events(group_id: str, factors: dict[str, float], reward: float,
                          session_id: str, ended_at: float) -> list[RewardEvent]:
    """One ``RewardEvent`` per trajectory of an ended session given ``reward``."""
    after = max(time.time() - ended_at, 0.0)
    return [RewardEvent(traj_id=traj_id, group_id=group_id, reward=reward * factor,
                        scorer="session", details={"session_id": session_id, "delayed": True,
                                                   "after_end_s": round(after, 3),
                                                   "session_reward": reward})
            for traj_id, factor in factors.items()]


class SessionLog:
    """Follows ``trajectories.v1`` and ``rewards.v1`` into an :class:`EndedSessions`:
    :meth:`catch_up` (blocking, at start) reads both to their end, then a thread follows."""

    def __init__(self, bus: BusConfig, index: EndedSessions, producer_prefix: str) -> None:
        self.bus = bus
        self.index = index
        self.prefix = producer_prefix
        self._readers: list[TopicReader] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _ours(self, event: Event | None) -> bool:
        if event is None or not run_reads(self.bus.run_id, event.run_id):
            return False
        return isinstance(event, RewardEvent) or (
            isinstance(event, TrajectoryEvent) and event.producer_id.startswith(self.prefix))

    def _read(self, idle_s: float, timeout_s: float | None) -> None:
        if not self._readers:
            self._readers = [TopicReader(self.bus, "trajectories"), TopicReader(self.bus, "rewards")]
        for reader in self._readers:
            for record in reader.records(idle_s=idle_s, timeout_s=timeout_s):
                if self._ours(record.event):
                    self.index.observe(record.event)

    def catch_up(self) -> None:
        self._read(idle_s=0.3, timeout_s=None)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._follow, name="proxy-session-log", daemon=True)
        self._thread.start()

    def _follow(self) -> None:
        while not self._stop.is_set():
            try:
                self._read(idle_s=0.1, timeout_s=0.5)
            except BusError as exc:  # the broker went away: read again from the start
                log.warning("following the session log: %s; reopening", exc)
                self._close()
                self._stop.wait(1.0)

    def _close(self) -> None:
        for reader in self._readers:
            try:
                reader.close()
            except Exception:  # closing after a broker loss must not mask anything
                pass
        self._readers = []

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        self._close()


class RewardCommands(Role[None]):
    """The proxy's member for ``tapioca reward`` (control command ``reward``, signed with
    the run's key like every command; args ``session_id``, ``reward``): applies
    ``reward(session_id, value)`` and acknowledges with its answer. Its status rows carry
    the proxy's session counts (``proxy-sessions/served`` ...: the live table's)."""

    name = "proxy-sessions"
    tick_interval_s = 0.5

    def __init__(self, reward: Callable[[str, Any], dict[str, Any]],
                 counts: Callable[[], dict[str, int]]) -> None:
        self.reward = reward
        self.counts = counts

    def init_state(self) -> None:
        return None

    def handle(self, event: Event, state: None, source: Any) -> Iterable[Event]:
        return ()

    def on_control(self, command: "ControlEvent", state: None) -> tuple[bool, str, Iterable[Event]]:
        if command.command != "reward":
            return super().on_control(command, state)
        sid = command.args.get("session_id")
        if not isinstance(sid, str) or not sid:
            return False, "400: args.session_id must be a session id (sess-...)", ()
        try:
            out = self.reward(sid, command.args.get("reward"))
        except ApiError as exc:
            return False, f"{exc.status} {exc.code}: {exc.message}", ()
        return True, (f"rewarded {len(out['traj_ids'])} trajectory(ies) of {sid} in group "
                      f"{out['group_id']}"), ()

    def describe(self, state: None) -> dict[str, Any]:
        return dict(self.counts())
