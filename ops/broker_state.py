"""Where the CLI finds a broker: ``--bootstrap-server``, then ``$TAPIOCA_BOOTSTRAP``,
then the embedded broker started by ``tapioca broker up`` (its state file lives in
``$TAPIOCA_HOME``, default ``~/.tapioca``)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from ..bus.broker import EmbeddedBroker, port_open
from ..bus.settings import BOOTSTRAP_ENV
from ..schemas.errors import BusError, ConfigError

DEFAULT_PORT = 29092


def home() -> Path:
    path = Path(os.environ.get("TAPIOCA_HOME", Path.home() / ".tapioca"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def state_file() -> Path:
    return home() / "broker.json"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    # The detached broker's parent has exited, so once it dies it is a zombie until
    # PID 1 reaps it (late, or never in containers without an init): not running.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def read_state() -> dict | None:
    """The running embedded broker's record, or None (stale records are removed)."""
    path = state_file()
    if not path.exists():
        return None
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not _alive(state.get("pid", -1)):
        path.unlink(missing_ok=True)
        return None
    return state


def resolve_bootstrap(flag: str | None, configured: str | None = None) -> str:
    """``--bootstrap-server``, then ``$TAPIOCA_BOOTSTRAP``, then ``configured`` (a run
    config's ``bus.bootstrap_servers``), then the broker of `tapioca broker up`."""
    if flag:
        return flag
    env = os.environ.get(BOOTSTRAP_ENV)
    if env:
        return env
    if configured:
        return configured
    state = read_state()
    if state:
        return state["bootstrap"]
    raise ConfigError(
        "no broker configured: pass --bootstrap-server HOST:PORT, set "
        f"{BOOTSTRAP_ENV}, or start the embedded one with `tapioca broker up`"
    )


def broker_up_bootstrap() -> str | None:
    """The address of the broker `tapioca broker up` started, if it runs and answers
    (`tapioca train` then uses it rather than starting a private one)."""
    state = read_state()
    if not state:
        return None
    host, port = state["bootstrap"].rsplit(":", 1)
    return state["bootstrap"] if port_open(host, int(port)) else None


def train_bootstrap(flag: str | None) -> tuple[str | None, str]:
    """The broker a `tapioca train` with no ``bus.bootstrap_servers`` runs on, and what to
    say about it: ``--bootstrap-server`` / ``$TAPIOCA_BOOTSTRAP``, else the broker of
    `tapioca broker up` (so `tail`, `lag` and `status` see the run), else None (the
    launcher starts an embedded broker of the run's own)."""
    if flag:
        return flag, ""
    up = broker_up_bootstrap()
    if up is None:
        return None, ""
    return up, (f"using the broker of `tapioca broker up` at {up} (`tapioca broker down` "
                "first for a broker of the run's own)")


def broker_up(port: int, storage: str) -> dict:
    existing = read_state()
    if existing:
        if (existing["bootstrap"].rsplit(":", 1)[-1] == str(port)
                and existing.get("storage") == storage):
            # Idempotent, so `tapioca broker up && ...` works when it is up already.
            return {**existing, "already_running": True}
        raise BusError(f"an embedded broker is already running at {existing['bootstrap']} "
                       f"(pid {existing['pid']}, {existing.get('storage')}); `tapioca broker "
                       "down` stops it, or use that one")
    log_path = home() / "broker.log"
    broker = EmbeddedBroker(port=port, storage=storage, log_path=log_path)
    broker.start(detach=True)
    state = {"pid": broker.proc.pid, "bootstrap": broker.bootstrap, "storage": storage,
             "log": str(log_path), "started_at": time.time()}
    state_file().write_text(json.dumps(state))
    return state


def broker_down(timeout_s: float = 10.0) -> dict | None:
    state = read_state()
    if state is None:
        return None
    pid = state["pid"]
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        try:  # reap it if it is our child (tests start it in-process)
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.05)
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)
    state_file().unlink(missing_ok=True)
    return state


def broker_status() -> dict:
    state = read_state()
    if state is None:
        return {"running": False}
    host, port = state["bootstrap"].rsplit(":", 1)
    return {**state, "running": True, "answering": port_open(host, int(port))}
