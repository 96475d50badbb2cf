"""`tapioca train`: one run, every role its own OS process, all meeting on the log.

Starts the embedded broker when no bootstrap server is configured, creates topics,
creates the tiny model when ``model.path`` is empty, writes the resolved config to
the run directory, launches the roles (``tapioca role NAME``), follows ``metrics.v1``
for a live display, and stops every child cleanly when the trainer finishes, on
Ctrl-C, or when a role dies (then exits non-zero with that role's error).

Agent mode (``agent.enabled``): the proxy (``tapioca proxy``) and the agent runners
(``python -m tapioca.agents.runner``) replace the feeder, rollout workers and reward
scorers; the launcher fixes the proxy's port and admin key in the written config so
both sides read the same ones.
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

from tapioca.bus.broker import EmbeddedBroker
from tapioca.bus.settings import BOOTSTRAP_ENV
from tapioca.config.loader import to_yaml
from tapioca.config.schema import TrainConfig, name_trial
from tapioca.schemas.errors import TapiocaError

log = logging.getLogger(__name__)


# After the other roles stopped, how long the archiver may read their last events
# (it polls continuously, so its lag is well under this) before it is stopped.
ARCHIVER_CATCH_UP_S = 2.0


class RoleFailedError(TapiocaError):
    """A role process exited with an error."""


@dataclass
class Child:
    role: str
    member: int
    proc: subprocess.Popen
    log_path: Path

    @property
    def label(self) -> str:
        return f"{self.role}-{self.member}"

    def log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


@dataclass
class RunSummary:
    run_dir: Path
    steps: int = 0
    wall_s: float = 0.0
    rewards: dict[int, float] = field(default_factory=dict)  # step -> mean reward
    history: list[dict] = field(default_factory=list)

    def window_means(self, window: int = 20) -> tuple[float, float, int] | None:
        """``(first, last, w)``: the mean reward of the first and of the last ``w`` steps,
        ``w`` = ``window`` or half the steps if fewer (single steps are noisy: a step is
        only B groups)."""
        if not self.rewards:
            return None
        values = [self.rewards[s] for s in sorted(self.rewards)]
        w = max(1, min(window, len(values) // 2 or 1))
        return sum(values[:w]) / w, sum(values[-w:]) / w, w


def prepare_run(cfg: TrainConfig) -> Path:
    """Resolve the run directory and the model; write the resolved config there."""
    name_trial(cfg)
    cfg.run_dir = str(Path(cfg.run_dir).resolve())
    run_dir = Path(cfg.run_path)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not cfg.model.path:
        from transformers.utils import logging as hf_logging

        from tapioca.models.factory import create_tiny_checkpoint

        hf_logging.disable_progress_bar()
        task = "synthetic" if cfg.train_dataset.type == "synthetic" else "gsm8k"
        m = cfg.model
        cfg.model.path = str(create_tiny_checkpoint(
            run_dir / "model", task=task, arch=m.arch, hidden_size=m.hidden_size,
            num_layers=m.num_layers, num_heads=m.num_heads, num_kv_heads=m.num_kv_heads,
            intermediate_size=m.intermediate_size, seed=m.init_seed,
            tie_word_embeddings=m.tie_word_embeddings).resolve())
    cfg.bus.run_id = cfg.run_id
    return run_dir


def role_counts(cfg: TrainConfig) -> list[tuple[str, int]]:
    # reward.scorer none: rewards come from an external service, no built-in scorer.
    reward = 0 if cfg.reward.scorer == "none" else cfg.reward.workers
    archiver = 1 if cfg.archive.enabled else 0
    counts = [("archiver", archiver), ("trainer", 1), ("advantage", 1), ("reward", reward),
              ("rollout", cfg.rollout.workers), ("feeder", 1)]
    if cfg.agent.enabled:
        # Agent mode: the proxy generates and publishes trajectories + session rewards;
        # agent runners play the dataset's prompts through it (no feeder/rollout/reward).
        counts = [("archiver", archiver), ("trainer", 1), ("advantage", 1), ("proxy", 1),
                  ("agent", cfg.agent.workers)]
    return [(role, n) for role, n in counts if n > 0]


def role_command(role: str, member: int, config_path: Path) -> list[str]:
    """The command line of one child process."""
    if role == "proxy":
        return [sys.executable, "-m", "tapioca.ops.cli", "proxy", "--config", str(config_path)]
    if role == "agent":
        return [sys.executable, "-m", "tapioca.agents.runner", "--config", str(config_path),
                "--member", str(member)]
    return [sys.executable, "-m", "tapioca.ops.role_main", role, "--config", str(config_path),
            "--member", str(member)]


def resolve_proxy_endpoint(cfg: TrainConfig) -> None:
    """Agent mode: fix the proxy's port and admin key before the config is written, so
    the proxy and the agent runners read the same ones (port 0 / an empty key would
    otherwise be chosen by the proxy alone)."""
    import secrets
    import socket

    if not cfg.proxy.api_key:
        cfg.proxy.api_key = "tapioca-admin-" + secrets.token_hex(16)
    if cfg.proxy.port == 0:
        with socket.socket() as s:
            s.bind((cfg.proxy.host, 0))
            cfg.proxy.port = s.getsockname()[1]


def last_member_warning(role: str, config_path: Path) -> str:
    """What to tell the user when the last live member of ``role`` exited cleanly (a
    drain): on stderr, since the CLI logs only warnings and the run does not stop."""
    if role == "archiver":
        return (f"warning: no archiver member left: the run goes on but is no longer "
                f"archived; start one with `tapioca role archiver --config {config_path}`\n")
    if role == "agent":
        start = f"python -m tapioca.agents.runner --config {config_path}"
    elif role == "proxy":
        start = f"tapioca proxy --config {config_path}"
    else:
        start = f"tapioca role {role} --config {config_path}"
    return (f"warning: no {role} member left: the run cannot progress; start one with "
            f"`{start}` or stop the run (Ctrl-C)\n")


class Launcher:
    def __init__(self, cfg: TrainConfig, *, on_metrics: Callable[[dict], None] | None = None) -> None:
        self.cfg = cfg
        self.on_metrics = on_metrics
        self.children: list[Child] = []
        self.broker: EmbeddedBroker | None = None
        self.summary: RunSummary | None = None

    def start(self) -> None:
        from tapioca.bus.admin import ensure_topics

        run_dir = prepare_run(self.cfg)
        self.summary = RunSummary(run_dir)
        if not self.cfg.bus.bootstrap_servers:
            self.broker = EmbeddedBroker(log_path=run_dir / "logs" / "broker.log")
            (run_dir / "logs").mkdir(exist_ok=True)
            # Its own session: a Ctrl-C in the terminal must not kill the broker before
            # the roles have flushed and committed through it.
            self.broker.start(detach=True)
            self.cfg.bus.bootstrap_servers = self.broker.bootstrap
        ensure_topics(self.cfg.bus)
        if self.cfg.agent.enabled:
            resolve_proxy_endpoint(self.cfg)
        config_path = self.config_path
        config_path.write_text(to_yaml(self.cfg))
        (run_dir / "logs").mkdir(exist_ok=True)
        for role, count in role_counts(self.cfg):
            for member in range(count):
                self._spawn(role, member, config_path)

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
        self.children.remove(old)
        return self._spawn(role, member, self.config_path)

    def _spawn(self, role: str, member: int, config_path: Path) -> Child:
        log_path = Path(self.cfg.run_path) / "logs" / f"{role}-{member}.log"
        env = {**os.environ, BOOTSTRAP_ENV: self.cfg.bus.bootstrap_servers,
               "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        cmd = role_command(role, member, config_path)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        child = Child(role, member, proc, log_path)
        self.children.append(child)
        return child

    def wait(self, timeout_s: float | None = None) -> RunSummary:
        """Follow metrics until the trainer exits; raise RoleFailedError if a role dies."""
        from tapioca.bus.reader import TopicReader

        start = time.monotonic()
        assert self.summary is not None
        with TopicReader(self.cfg.bus, "metrics") as reader:
            while True:
                for record in reader.records(idle_s=0.2, timeout_s=0.5):
                    ev = record.event
                    if ev is None or ev.run_id != self.cfg.run_id:
                        continue
                    self._observe(ev.source, ev.step, ev.metrics)
                self.summary.wall_s = time.monotonic() - start
                for child in list(self.children):
                    code = child.proc.poll()
                    if code is None:
                        continue
                    if child.role == "trainer" and code == 0:
                        # Its last step's metrics may still be in flight: read to the end.
                        for record in reader.records(idle_s=0.5, timeout_s=3.0):
                            ev = record.event
                            if ev is not None and ev.run_id == self.cfg.run_id:
                                self._observe(ev.source, ev.step, ev.metrics)
                        return self.summary
                    if code == 0:
                        # A clean exit of another role is a `tapioca drain`: the run goes on
                        # (its work is committed; the rest of the group takes over) -- unless
                        # it was the role's last member, which the user must hear about.
                        log.info("role %s exited cleanly (drained)", child.label)
                        self.children.remove(child)
                        if not any(c.role == child.role and c.proc.poll() is None
                                   for c in self.children):
                            sys.stderr.write(last_member_warning(child.role, self.config_path))
                            sys.stderr.flush()
                        continue
                    raise RoleFailedError(
                        f"role {child.label} exited with code {code}; last lines of "
                        f"{child.log_path}:\n{child.log_tail()}")
                if timeout_s is not None and time.monotonic() - start > timeout_s:
                    raise RoleFailedError(f"the run did not finish within {timeout_s:.0f} s")

    def _observe(self, source: str, step: int, metrics: dict) -> None:
        s = self.summary
        row = {"source": source, "step": step, **metrics}
        if source.startswith("trainer") and "reward/mean" in metrics:
            s.history.append(row)
            s.steps = step
            r = metrics.get("reward/mean")
            if r is not None:
                s.rewards[step] = r
        if self.on_metrics:
            self.on_metrics(row)

    def stop(self, timeout_s: float = 15.0) -> None:
        """SIGTERM every role (its whole process group), wait, then kill what is left;
        agent runners first, the archiver after the others (so it reads their last
        events), the broker last."""
        # A second Ctrl-C / SIGTERM (or `timeout`'s) while stopping must not abandon
        # half-stopped roles and the broker as orphans.
        with _interrupts_ignored():
            self._stop_all(timeout_s)

    def _stop_all(self, timeout_s: float) -> None:
        archivers = [c for c in self.children if c.role == "archiver"]
        # Agent runners before the proxy they talk to (else every open episode logs a
        # connection error on the way down).
        self._stop_children([c for c in self.children if c.role == "agent"], timeout_s)
        self._stop_children([c for c in self.children if c.role not in ("archiver", "agent")],
                            timeout_s)
        if any(c.proc.poll() is None for c in archivers):
            time.sleep(ARCHIVER_CATCH_UP_S)
        self._stop_children(archivers, timeout_s)
        if self.broker is not None:
            self.broker.stop()
            self.broker = None

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
