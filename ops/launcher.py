"""`tapioca train`: one run, every role its own OS process, all meeting on the log.

Checks the run's memory plan against its GPUs before anything starts (a run that will not
fit is refused with the settings that make it fit: ops/memory_check.py), starts the
embedded broker when no bootstrap server is configured, creates topics,
creates the tiny model when ``model.path`` is empty, writes the run's signing key
(``secrets/bus.key``, bus/signing.py) and the resolved config to the run directory,
launches the roles (``tapioca role NAME``), follows ``metrics.v1`` for a live display,
and stops every child cleanly when the trainer finishes or on Ctrl-C.

Supervision (``launcher`` config section):

- a role that crashes (non-zero exit) is restarted after a backoff that doubles per
  restart, up to ``launcher.max_restarts`` within ``launcher.restart_window_s``; then
  the run stops with an error naming the role and its log. Exit code 78 (a config or
  file problem, ``EXIT_NO_RESTART``) is never retried: the run stops at once with the
  role's one-line reason; nor is 74 (``EXIT_STORAGE``: a disk full, failing or
  read-only), which stops the run with the role's one-line reason, nor 71 (``EXIT_OOM``:
  a step ran out of device memory; its line names the settings that lower the memory,
  ops/memory_check.py). Restarting is safe:
  every role resumes from the log and its checkpoint. A clean exit (0) of a role is a
  drain.
- each role gets the write end of a pipe (``$TAPIOCA_REASON_FD``) for the one line that
  says why it failed (ops/role_main.py): its log may be on the disk that is full.
- children die with the launcher even when it is killed with SIGKILL: each arms
  PR_SET_PDEATHSIG before it starts (ops/parent_death.py); each role leads its own
  process group, which the launcher signals when it stops. Members of the run that the
  launcher did not start (`tapioca role NAME --config RUN/config.yaml`) are drained over
  control.v1 when the run ends (ops/run_end.py).
- the broker is watched every ``launcher.topic_check_interval_s``: when the embedded
  broker died it is started again on its port; when topics are missing or have the
  wrong partition count (a broker that lost its data; clients may auto-create them
  with its defaults) they are re-created from the registry, and since the log is gone,
  the run moves to a new bus run id and every role is restarted on it.
- stall alarm: no role handled or produced anything for ``launcher.stall_alarm_s``
  although some run unpaused (or none reported at all): shown in the display. Online
  mode raises only the second (no traffic is no stall).

Bus run ids (one per broker lifetime): a run resumed on a broker that does not hold its
log (the embedded memory broker keeps nothing across restarts) would number its groups
from 0 again and collide with the groups its checkpoint trained. So the launcher gives
it a new run id on the bus, ``<experiment>.<trial>@<n>`` (config/schema.py), written to
``bus.run_id``: group ids carry it, the trainer drops the old log's offsets, and the head
gate counts from there (docs/design-choices.md).

Agent mode (``agent.enabled``): the proxy (``tapioca proxy``) and the agent runners
(``python -m tapioca.agents.runner``) replace the feeder, rollout workers and reward
scorers; the launcher fixes the proxy's port and admin key (a 0600 file beside the
signing key) in the written config so both sides read the same ones. Online mode
(``agent.mode: online``, docs/online.md): the proxy, the advantage processor and the
trainer, no agent runner; live clients' sessions are the data.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..bus.broker import EmbeddedBroker
from ..bus.retry import backoff_s
from ..bus.settings import BOOTSTRAP_ENV
from ..config.loader import to_yaml
from ..config.schema import TrainConfig, next_bus_run_id
from ..runtime.run import check_dataset_files, check_proxy_port, resolve_bus_run_id, resolve_run
from ..schemas.errors import EXIT_CONFIG, EXIT_OOM, EXIT_STORAGE, BusError, TapiocaError
from . import run_record
from .disk_check import check_disk_at_start
from .memory_check import check_at_start
from .parent_death import guarded
from .run_end import end_members, outside_members

# The launcher's parts, re-exported: callers and tests import them from here.
from .run_setup import last_member_warning, role_command, role_counts  # noqa: F401

log = logging.getLogger(__name__)

# Said at start by an online run on a broker of its own (docs/online.md, "Where rewards
# wait, and restarts"): its log lives in that broker's memory and dies with the run.
ONLINE_ON_OWN_BROKER = (
    "online mode on the run's own embedded broker, which keeps the log in memory: stopping "
    "or restarting `tapioca train` loses every session still waiting for its reward (its "
    "trajectories, the ended-session index; a later reward gets 404 session_not_found). For "
    "rewards that survive a restart of the service, start the broker first with `tapioca "
    "broker up` (it outlives the run; the log is lost only when the broker stops) or run on "
    "Apache Kafka (bus.bootstrap_servers)")


# After the other roles stopped, how long the archiver may read their last events
# (it polls continuously, so its lag is well under this) before it is stopped.
ARCHIVER_CATCH_UP_S = 2.0


# A role exits with this code for an error no restart can fix (a bad config, a missing
# key file, an old checkpoint format, a port taken): the supervisor does not retry it and
# says the role's one-line reason (schemas/errors.py EXIT_CONFIG, EX_CONFIG); and with
# EXIT_STORAGE when a disk is full, failing or read-only (StorageError, EX_IOERR).
EXIT_NO_RESTART = EXIT_CONFIG
# The environment variable naming a role's inherited pipe for its one-line failure reason.
REASON_FD_ENV = "TAPIOCA_REASON_FD"


class RoleFailedError(TapiocaError):
    """A role process exited with an error (and was not, or no longer, restarted).
    ``why``: the one-line reason the closing line gives (default: the first line)."""

    def __init__(self, message: str, *, why: str = "") -> None:
        super().__init__(message)
        self.why = why or message.splitlines()[0]


class RoleOutOfMemoryError(RoleFailedError):
    """A role ran out of device memory (EXIT_OOM): not restarted, the run stops with the
    role's line, which names the settings that lower the memory."""

    exit_code = EXIT_OOM


@dataclass
class Child:
    role: str
    member: int
    proc: subprocess.Popen
    log_path: Path
    started_at: float = field(default_factory=time.monotonic)
    # Read end of the pipe the role writes its failure reason to (-1: none).
    reason_fd: int = -1
    _reason: str | None = None

    @property
    def label(self) -> str:
        return f"{self.role}-{self.member}"

    def exit_reason(self) -> str:
        """The last line the role wrote to its reason pipe ("" if none); closes the pipe.
        Read after the role exited: what it wrote is in the pipe whatever its disk does."""
        if self._reason is None:
            data = b""
            if self.reason_fd >= 0:
                try:
                    while chunk := os.read(self.reason_fd, 65536):
                        data += chunk
                except OSError:  # EAGAIN: a process the role started still holds it open
                    pass
            self.close_reason()
            lines = [ln for ln in data.decode(errors="replace").splitlines() if ln.strip()]
            self._reason = lines[-1].strip() if lines else ""
        return self._reason

    def close_reason(self) -> None:
        if self.reason_fd >= 0:
            os.close(self.reason_fd)
            self.reason_fd = -1

    def error_line(self) -> str | None:
        """The role's reason for a config or usage error: the last ``error: ...`` line of
        its log (role_main, `tapioca proxy` and the agent runner end with one)."""
        for line in reversed(self.log_tail(200).splitlines()):
            if line.startswith("error: "):
                return line[len("error: "):].strip()
        return None

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class Restarts:
    """One member's crash history, for the restart budget and the display."""

    times: list[float] = field(default_factory=list)  # monotonic time of each crash
    last_code: int = 0

    @property
    def count(self) -> int:
        return len(self.times)

    def recent(self, now: float, window_s: float) -> int:
        return sum(1 for t in self.times if now - t < window_s)


@dataclass
class PendingRestart:
    role: str
    member: int
    due: float


@dataclass
class RunSummary:
    run_dir: Path
    steps: int = 0
    wall_s: float = 0.0
    rewards: dict[int, float] = field(default_factory=dict)  # step -> mean reward
    held_out: dict[int, float] = field(default_factory=dict)  # version -> evaluator's pass@1
    history: list[dict] = field(default_factory=list)
    restarts: dict[str, int] = field(default_factory=dict)  # member -> restarts
    # Times the broker lost the run's log and the roles moved to a new bus run id.
    log_recoveries: int = 0
    bus_run_id: str = ""
    # What the lost logs took with them, from the members' last status before each loss:
    # groups admitted but not yet trained or rejected (in prompts, trajectories, rewards,
    # samples or the trainer's buffer), and trained steps that no checkpoint held (the
    # trainer's last version minus the one it resumed at). None: not known (no feeder or
    # trainer had reported on that log, or the trainer had not reported since).
    groups_dropped: int | None = None
    steps_dropped: int | None = None
    # The version of the checkpoint the trainer resumed from (0: a new trial). On a log
    # kept across invocations (an external broker), the trainer's rows up to it are an
    # earlier invocation's: read back, not counted as this one's steps.
    resumed_version: int = 0

    def supervision_line(self) -> str:
        """What the closing line says about restarts and recoveries ("" if none)."""
        parts = []
        if self.restarts:
            parts.append("restarts: " + ", ".join(
                f"{m} x{n}" for m, n in sorted(self.restarts.items())))
        if self.log_recoveries:
            lost = [f"{n} {what}{'' if n == 1 else 's'}" for n, what in (
                (self.groups_dropped, "in-flight group"), (self.steps_dropped, "trained step"))
                if n is not None]
            dropped = f"; dropped with it: {' and '.join(lost)}" if lost else ""
            parts.append(f"broker lost the log {self.log_recoveries}x (now bus run id "
                         f"{self.bus_run_id}{dropped})")
        return "; ".join(parts)

    def window_means(self, window: int = 20) -> tuple[float, float, int] | None:
        """``(first, last, w)``: the mean reward of the first and of the last ``w`` steps,
        ``w`` = ``window`` or half the steps if fewer (single steps are noisy: a step is
        only B groups)."""
        if not self.rewards:
            return None
        values = [self.rewards[s] for s in sorted(self.rewards)]
        w = max(1, min(window, len(values) // 2 or 1))
        return sum(values[:w]) / w, sum(values[-w:]) / w, w


def resumed_version(run_dir: Path) -> int:
    """The version of the trial's trainer checkpoint at start (0: none, a new trial)."""
    from .train_view import trainer_checkpoint

    ckpt = trainer_checkpoint(run_dir)
    return ckpt.version if ckpt is not None else 0


class Launcher:
    def __init__(self, cfg: TrainConfig, *, on_metrics: Callable[[dict], None] | None = None,
                 command_for: Callable[[str, int, Path], list[str]] = role_command) -> None:
        self.cfg = cfg
        self.on_metrics = on_metrics
        # Called once per turn of the supervision loop (e.g. to redraw a display).
        self.on_tick: Callable[[], None] | None = None
        self.command_for = command_for
        self.children: list[Child] = []
        self.broker: EmbeddedBroker | None = None
        self.summary: RunSummary | None = None
        self.restarts: dict[str, Restarts] = {}
        self.pending: list[PendingRestart] = []
        # Current alarms (shown until they clear) and past notices, newest last.
        self.alarms: dict[str, str] = {}
        self.notices: list[str] = []
        self.expected_topics: dict[str, int] = {}
        self._next_topic_check = 0.0
        self._status: dict[str, dict] = {}  # member -> its latest bus status metrics
        # The trainer's last version on a log that was lost, until it reports on the new one.
        self._version_at_loss: float | None = None
        self._progress = (None, time.monotonic())  # (sum of counters, when it last changed)
        self._last_report = time.monotonic()
        self._reported = False
        self._reader = None
        self._spawned_pids: set[int] = set()  # every child process started, for run_end
        self._outcome = "stopped"  # how the run ended, for the run record

    # ------------------------------------------------------------------ start

    def start(self) -> None:
        from ..bus.admin import ensure_topics, topic_partitions

        # The run directory, the model; the run's key, which signs control commands and
        # weights events (bus/signing.py; a resumed run keeps its key; only the path goes
        # into config.yaml). runtime/run.py resolve_run is the one place the config changes.
        check_dataset_files(self.cfg)  # first: a refused run leaves no run directory behind
        self.cfg = resolve_run(self.cfg, prepare=True, signing_key=True)
        # Before any role starts: a run that will not fit its GPUs is refused with the
        # settings that make it fit, or gets the KV cache that fits (ops/memory_check.py).
        self.cfg = check_at_start(self.cfg)
        check_disk_at_start(self.cfg)  # a checkpoint that will not fit its disk (ops/disk_check.py)
        check_proxy_port(self.cfg)  # the agent proxy's fixed port, free before any role binds it
        for warning in self.cfg.singleton_warnings():  # e.g. online mode's n_samples 1
            log.warning("%s", warning)
        run_dir = Path(self.cfg.run_path)
        self.summary = RunSummary(run_dir, resumed_version=resumed_version(run_dir))
        (run_dir / "logs").mkdir(exist_ok=True)
        if not self.cfg.bus.bootstrap_servers:
            self._start_broker()
            self.cfg = resolve_run(self.cfg, bootstrap=self.broker.bootstrap)
            if self.cfg.agent.online:
                log.warning("%s", ONLINE_ON_OWN_BROKER)
        ensure_topics(self.cfg.bus)
        self.expected_topics = topic_partitions(self.cfg.bus)
        self.cfg = resolve_run(self.cfg, bus_run_id=resolve_bus_run_id(self.cfg),
                               proxy_endpoint=self.cfg.agent.enabled)
        self.summary.bus_run_id = self.cfg.bus.run_id
        self._write_config()
        # For `tapioca runs` and `tapioca train --resume` (ops/run_record.py).
        run_record.write_start(run_dir, bootstrap=self.cfg.bus.bootstrap_servers,
                               own_broker=self.broker is not None, bus_run_id=self.cfg.bus.run_id)
        self._spawn_all()
        self._progress = (None, time.monotonic())
        self._last_report = time.monotonic()
        self._next_topic_check = time.monotonic() + self.cfg.launcher.topic_check_interval_s

    def _start_broker(self, port: int | None = None) -> None:
        run_dir = Path(self.cfg.run_path)
        # SIGKILL when the launcher dies: a memory broker has nothing to flush.
        self.broker = EmbeddedBroker(port=port, log_path=run_dir / "logs" / "broker.log",
                                     wrap=lambda cmd: guarded(cmd, signal.SIGKILL))
        # Its own session: a Ctrl-C in the terminal must not kill the broker before
        # the roles have flushed and committed through it.
        self.broker.start(detach=True)

    def _write_config(self) -> None:
        self.config_path.write_text(to_yaml(self.cfg))

    def _spawn_all(self) -> None:
        for role, count in role_counts(self.cfg):
            for member in range(count):
                self._spawn(role, member, self.config_path)

    @property
    def config_path(self) -> Path:
        return Path(self.cfg.run_path) / "config.yaml"

    def restart(self, role: str, member: int = 0, *, kill: bool = True) -> Child:
        """Replace a member (kill -9 first, as a crash would): the new process resumes
        from the log and its checkpoint."""
        old = next(c for c in self.children if c.role == role and c.member == member)
        if kill and old.proc.poll() is None:
            old.proc.kill()
        old.proc.wait(10)
        old.close_reason()
        self.children.remove(old)
        return self._spawn(role, member, self.config_path)

    def _spawn(self, role: str, member: int, config_path: Path) -> Child:
        log_path = Path(self.cfg.run_path) / "logs" / f"{role}-{member}.log"
        env = {**os.environ, BOOTSTRAP_ENV: self.cfg.bus.bootstrap_servers,
               "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        # The role dies with the launcher (ops/parent_death.py): SIGTERM (flush, commit)
        # when the broker outlives us, SIGKILL when it is ours and dies too (nothing to
        # flush to; the roles are crash-safe).
        sig = signal.SIGKILL if self.broker is not None else signal.SIGTERM
        cmd = guarded(self.command_for(role, member, config_path), sig)
        # The role's failure reason comes back through a pipe (kernel memory), not its log.
        reason_r, reason_w = os.pipe()
        os.set_blocking(reason_r, False)
        env[REASON_FD_ENV] = str(reason_w)
        try:
            with open(log_path, "ab") as log_file:
                proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=env, start_new_session=True,
                                        pass_fds=(reason_w,))
        except BaseException:
            os.close(reason_r)
            raise
        finally:
            os.close(reason_w)
        child = Child(role, member, proc, log_path, reason_fd=reason_r)
        self.children.append(child)
        self._spawned_pids.add(proc.pid)
        return child

    # ------------------------------------------------------------------ supervision

    def wait(self, timeout_s: float | None = None) -> RunSummary:
        """Follow metrics and supervise until the trainer exits cleanly; raise
        RoleFailedError when a role fails for good (or after ``timeout_s``)."""
        start = time.monotonic()
        assert self.summary is not None
        try:
            while True:
                self._read_metrics(idle_s=0.2, timeout_s=0.5)
                now = time.monotonic()
                self.summary.wall_s = now - start
                self._check_broker(now)
                if self._check_children(now):
                    # Its last step's metrics may still be in flight: read to the end.
                    self._read_metrics(idle_s=0.5, timeout_s=3.0)
                    self._outcome = "finished"
                    return self.summary
                self._start_due(now)
                self._check_stall(now)
                if self.on_tick is not None:
                    self.on_tick()
                if timeout_s is not None and now - start > timeout_s:
                    raise RoleFailedError(f"the run did not finish within {timeout_s:.0f} s")
        except KeyboardInterrupt:
            self._outcome = "interrupted"
            raise
        except RoleOutOfMemoryError:
            self._outcome = "out of memory"
            raise
        except BaseException:
            self._outcome = "failed"
            raise
        finally:
            self._close_reader()

    def _read_metrics(self, *, idle_s: float, timeout_s: float) -> None:
        from ..bus.reader import TopicReader

        try:
            if self._reader is None:
                self._reader = TopicReader(self.cfg.bus, "metrics")
            for record in self._reader.records(idle_s=idle_s, timeout_s=timeout_s):
                ev = record.event
                if ev is None or ev.run_id != self.cfg.bus.run_id:
                    continue
                self._observe(ev.source, ev.step, ev.metrics)
        except BusError as exc:  # the broker is down or lost the topic: checked below
            log.debug("metrics reader: %s", exc)
            self._close_reader()
            time.sleep(timeout_s)

    def _close_reader(self) -> None:
        if self._reader is not None:
            try:
                self._reader.close()
            except Exception:  # closing after a broker loss must not mask anything
                pass
            self._reader = None

    def _check_children(self, now: float) -> bool:
        """True when the trainer finished; restarts or fails on crashes."""
        for child in list(self.children):
            code = child.proc.poll()
            if code is None:
                continue
            if child.role == "trainer" and code == 0:
                return True
            self.children.remove(child)
            if code == 0:
                child.close_reason()
                # A clean exit of another role is a `tapioca drain`: the run goes on
                # (its work is committed; the rest of the group takes over) -- unless
                # it was the role's last member, which the user must hear about.
                log.info("role %s exited cleanly (drained)", child.label)
                if not any(c.role == child.role and c.proc.poll() is None for c in self.children) \
                        and not any(p.role == child.role for p in self.pending):
                    sys.stderr.write(last_member_warning(child.role, self.config_path))
                    sys.stderr.flush()
                continue
            self._crashed(child, code, now)
        return False

    def _crashed(self, child: Child, code: int, now: float) -> None:
        lc = self.cfg.launcher
        record = self.restarts.setdefault(child.label, Restarts())
        recent = record.recent(now, lc.restart_window_s)
        reason = child.exit_reason()
        tail = f"last lines of {child.log_path}:\n{child.log_tail()}"
        if code == EXIT_STORAGE:
            # One line, the reason first: the log may be on the disk that is full.
            why = f"role {child.label} stopped: {reason or 'a disk was full, failing or read-only'}"
            raise RoleFailedError(
                f"{why}; free space on that disk (or fix it) and run the same command again: the run "
                f"resumes from its last checkpoint (log: {child.log_path})", why=why)
        if code == EXIT_OOM:
            # Not restarted: the same step would need the same memory again.
            why = f"{child.label}: {reason or child.error_line() or 'ran out of device memory'}"
            raise RoleOutOfMemoryError(f"{why} (not restarted: the same step needs the same memory; "
                                       f"log: {child.log_path})", why=why)
        if reason:
            tail = f"{reason}; {tail}"
        if code == EXIT_NO_RESTART:
            # The pipe's line, or the log's last "error:" line (`tapioca proxy` and the agent
            # runner have no pipe).
            reason = reason or child.error_line()
            if reason:  # one line, as the role said it (not restarted, so no alarm either)
                raise RoleFailedError(f"{child.label}: {reason} (log: {child.log_path})",
                                      why=f"{child.label}: {reason}")
            raise RoleFailedError(f"role {child.label} exited with code {code}: a config or "
                                  f"file problem that a restart cannot fix; {tail}")
        if recent >= lc.max_restarts:
            budget = (f"it was restarted {recent} times within {lc.restart_window_s:.0f} s "
                      f"(launcher.max_restarts={lc.max_restarts})" if lc.max_restarts
                      else "restarts are off (launcher.max_restarts=0)")
            raise RoleFailedError(f"role {child.label} exited with code {code} and {budget}; "
                                  f"{tail}", why=f"role {child.label} failed and {budget}"
                                  + (f" (last: {reason})" if reason else ""))
        delay = min(backoff_s(lc.restart_backoff_s, recent + 1), lc.restart_backoff_max_s)
        record.times.append(now)
        record.last_code = code
        self.summary.restarts[child.label] = record.count
        self.pending.append(PendingRestart(child.role, child.member, now + delay))
        said = f" ({reason})" if reason else ""
        self._notice(f"{child.label} exited with code {code}{said}; restart "
                     f"{recent + 1}/{lc.max_restarts} in {delay:.1f} s (log: {child.log_path})")

    def _start_due(self, now: float) -> None:
        for pending in [p for p in self.pending if p.due <= now]:
            self.pending.remove(pending)
            self._spawn(pending.role, pending.member, self.config_path)
            log.warning("restarted %s-%d", pending.role, pending.member)

    def _notice(self, text: str) -> None:
        stamped = f"{time.strftime('%H:%M:%S')} {text}"
        log.warning("%s", text)
        self.notices = (self.notices + [stamped])[-20:]

    # ------------------------------------------------------------------ the broker

    def _check_broker(self, now: float) -> None:
        from ..bus.admin import topic_partitions

        if now < self._next_topic_check:
            return
        self._next_topic_check = now + self.cfg.launcher.topic_check_interval_s
        if self.broker is not None and self.broker.proc is not None \
                and self.broker.proc.poll() is not None:
            code = self.broker.proc.returncode
            port = self.broker.port
            self._notice(f"the embedded broker exited (code {code}); starting it again on "
                         f"port {port}")
            self._start_broker(port)
            self._recover_lost_log("the embedded broker restarted: its memory storage lost "
                                   "the run's log")
            return
        try:
            actual = topic_partitions(self.cfg.bus)
        except BusError as exc:
            self.alarms.setdefault(
                "broker", f"{time.strftime('%H:%M:%S')} the broker at "
                f"{self.cfg.bus.bootstrap_servers} does not answer ({str(exc).split(';')[0]})")
            return
        self.alarms.pop("broker", None)
        missing = [n for n in self.expected_topics if n not in actual]
        wrong = [f"{n} has {actual[n]} partitions, not {want}"
                 for n, want in self.expected_topics.items() if n in actual and actual[n] != want]
        if missing or wrong:
            what = "; ".join(([f"missing: {', '.join(missing)}"] if missing else []) + wrong)
            self._recover_lost_log(f"the broker lost the run's topics ({what})")

    def _recover_lost_log(self, reason: str) -> None:
        """The broker no longer holds the run's log: re-create the topics from the
        registry, move to a new bus run id, restart every role on it."""
        from ..bus.admin import repair_topics

        lc = self.cfg.launcher
        now = time.monotonic()
        record = self.restarts.setdefault("broker", Restarts())
        if record.recent(now, lc.restart_window_s) >= max(lc.max_restarts, 1):
            raise RoleFailedError(f"{reason}, again: {record.count} times within "
                                  f"{lc.restart_window_s:.0f} s; stopping the run")
        record.times.append(now)
        self._count_dropped()
        created, recreated = repair_topics(self.cfg.bus, self.expected_topics)
        self._close_reader()
        self._stop_children(list(self.children), timeout_s=5.0)
        self.children.clear()
        self.pending.clear()
        old = self.cfg.bus.run_id
        self.cfg = resolve_run(self.cfg, bus_run_id=next_bus_run_id(old))
        self.summary.bus_run_id = self.cfg.bus.run_id
        self.summary.log_recoveries += 1
        self._write_config()
        self._status.clear()
        self._spawn_all()
        self._progress = (None, time.monotonic())
        self._last_report = time.monotonic()
        fixed = ", ".join(([f"created {len(created)}"] if created else [])
                          + ([f"re-created {len(recreated)} with the right partitions"]
                             if recreated else [])) or "topics fine"
        self._notice(f"{reason}: topics {fixed}; every role restarted on bus run id "
                     f"{self.cfg.bus.run_id} (was {old})")

    def _count_dropped(self) -> None:
        """What the log being lost drops, from the members' last status on it: the groups
        the feeder (or the agent proxy) admitted that the trainer had not trained or
        rejected; and, once the restarted trainer reports, the steps it lost."""
        status = self._status.values()

        def total(*keys: str) -> float | None:
            found = [row[k] for row in status for k in keys if k in row]
            return sum(found) if found else None

        admitted = total("feeder/groups", "proxy-weights/admitted")
        done = total("trainer/groups_done_on_log")
        s = self.summary
        if admitted is not None and done is not None:
            s.groups_dropped = (s.groups_dropped or 0) + int(max(admitted - done, 0))
        self._version_at_loss = total("trainer/version")

    # ------------------------------------------------------------------ stall alarm

    def _check_stall(self, now: float) -> None:
        lc = self.cfg.launcher
        alive = [c for c in self.children if c.proc.poll() is None]
        if not alive:
            self.alarms.pop("stall", None)
            return
        total, since = self._progress
        running = [m for m, st in self._status.items() if not st.get("bus/paused")]
        # Before any role has reported, loading a large model may take a while: wait
        # five periods before calling silence a stall.
        quiet_limit = lc.stall_alarm_s * (1 if self._reported else 5)
        if now - self._last_report > quiet_limit:
            self.alarms["stall"] = (f"no role has reported on metrics.v1 for "
                                    f"{now - self._last_report:.0f} s although {len(alive)} "
                                    "are alive (is the broker up? `tapioca topics list`)")
        elif running and now - since > lc.stall_alarm_s and not self.cfg.agent.online:
            # (Online, a quiet log is a quiet hour of traffic, not a stall.)
            self.alarms["stall"] = (f"stalled: no role handled or produced an event for "
                                    f"{now - since:.0f} s although {len(running)} report "
                                    "running (`tapioca status`; `tapioca topics list`)")
        else:
            self.alarms.pop("stall", None)

    def _observe(self, source: str, step: int, metrics: dict) -> None:
        s = self.summary
        row = {"source": source, "step": step, **metrics}
        now = time.monotonic()
        self._last_report = now
        self._reported = True
        # The evaluator reads metrics.v1, where every member reports each second: its
        # counters move even while the run is stalled, so they are no sign of progress.
        if "bus/handled" in metrics and not source.startswith("evaluator"):
            self._status[source] = metrics
            if self._version_at_loss is not None and "trainer/version" in metrics:
                # The restarted trainer's first report on the new log: its resumed version.
                lost = max(self._version_at_loss - metrics["trainer/version"], 0)
                s.steps_dropped = (s.steps_dropped or 0) + int(lost)
                self._version_at_loss = None
            total = sum(m.get("bus/handled", 0.0) + m.get("bus/produced", 0.0)
                        for m in self._status.values())
            if total != self._progress[0]:
                self._progress = (total, now)
        if source.startswith("evaluator") and "eval/pass@1" in metrics:
            s.held_out[step] = metrics["eval/pass@1"]
        if source.startswith("trainer") and "reward/mean" in metrics:
            if step <= s.resumed_version:  # an earlier invocation's step, read back
                return
            s.history.append(row)
            s.steps = step
            r = metrics.get("reward/mean")
            if r is not None:
                s.rewards[step] = r
        if self.on_metrics:
            self.on_metrics(row)

    def health(self) -> dict:
        """What the display shows about supervision: restarts per member, pending
        restarts, current alarms and recent notices."""
        return {"restarts": {m: r.count for m, r in self.restarts.items() if m != "broker"},
                "pending": [f"{p.role}-{p.member}" for p in self.pending],
                "alarms": list(self.alarms.values()), "notices": list(self.notices[-3:]),
                "bus_run_id": self.cfg.bus.run_id}

    # ------------------------------------------------------------------ stop

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every role (its whole process group), wait, then kill what is left;
        agent runners first, the archiver after the others (so it reads their last
        events), the broker last."""
        # A second Ctrl-C / SIGTERM (or `timeout`'s) while stopping must not abandon
        # half-stopped roles and the broker as orphans.
        with _interrupts_ignored():
            self._stop_all(timeout_s)

    def _stop_all(self, timeout_s: float) -> None:
        self.pending.clear()
        self._close_reader()
        archivers = [c for c in self.children if c.role == "archiver"]
        # Members of the run that this launcher did not start (a `tapioca role` a user
        # started, e.g. after the drain warning) end with the run too (ops/run_end.py).
        outside = self._outside_members()
        # Agent runners before the proxy they talk to (else every open episode logs a
        # connection error on the way down).
        self._stop_children([c for c in self.children if c.role == "agent"], timeout_s)
        self._stop_children([c for c in self.children if c.role not in ("archiver", "agent")],
                            timeout_s)
        end_members(self.cfg.bus, [m for m in outside if m.event.role != "archiver"])
        if any(c.proc.poll() is None for c in archivers) or outside:
            time.sleep(ARCHIVER_CATCH_UP_S)
        end_members(self.cfg.bus, [m for m in outside if m.event.role == "archiver"])
        self._stop_children(archivers, timeout_s)
        if self.broker is not None:
            self.broker.stop()
            self.broker = None
        if self.summary is not None:
            run_record.write_end(self.summary.run_dir, self._outcome)

    def _outside_members(self) -> list:
        """This run's live members that are not this launcher's children (none when its
        own broker is down, or the run never reached a broker: nothing could reach them)."""
        if not self.expected_topics or (self.broker is not None and (
                self.broker.proc is None or self.broker.proc.poll() is not None)):
            return []
        own = self._spawned_pids | {c.proc.pid for c in self.children}
        return outside_members(self.cfg.bus, own)

    def _stop_children(self, children: list[Child], timeout_s: float) -> None:
        for child in children:
            if child.proc.poll() is None:
                _signal_group(child.proc, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for child in children:
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(child.proc, signal.SIGKILL)
                child.proc.wait(5)
            child.close_reason()

    def __enter__(self) -> "Launcher":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@contextlib.contextmanager
def _interrupts_ignored():
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    # Each role leads its own session, so its pid is its process group id.
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass
