"""The inference server a role launches (engines/server_launch.py) dies with the role,
whatever kills the role: its watchdog, signalled by the kernel when the role dies, stops
the server's whole process group (an API server and the engine process it forked, as
vLLM runs). Real processes: a parent standing for the role, a stand-in server that forks
a child of its own and sleeps."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tapioca.engines.server_launch import LaunchedServer, _spawn

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="the parent-death signal is Linux's")

# The stand-in server: forks an "engine process", writes both pids, then both sleep
# (or exits with code 3 at once, leaving its engine process behind, with "crash").
SERVER = """\
import os, sys, time
child = os.fork()
if child == 0:
    time.sleep(600)
    os._exit(0)
open(sys.argv[1], "w").write(f"{os.getpid()} {child}")
if sys.argv[2] == "crash":
    sys.exit(3)
time.sleep(600)
"""

# The role: spawns the server as a role does, says so, then waits to be killed.
ROLE = """\
import sys, time
from pathlib import Path
from tapioca.engines.server_launch import _spawn
proc = _spawn([sys.executable, "-c", sys.argv[1], sys.argv[2], "sleep"], {}, Path(sys.argv[3]))
print(proc.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s:.0f} s: {what}")


def _pids(path: Path) -> list[int]:
    _wait_for(lambda: path.exists() and path.read_text().count(" ") == 1, 60, "the server's pids")
    return [int(x) for x in path.read_text().split()]


def test_a_killed_role_takes_its_server_and_the_servers_children_with_it(tmp_path):
    pidfile = tmp_path / "pids"
    role = subprocess.Popen([sys.executable, "-c", ROLE, SERVER, str(pidfile),
                             str(tmp_path / "server.log")], stdout=subprocess.PIPE, text=True)
    try:
        watchdog = int(role.stdout.readline())
        server, engine = _pids(pidfile)
        assert all(_alive(p) for p in (watchdog, server, engine))
        role.send_signal(signal.SIGKILL)  # as a launcher's SIGKILL or the OOM killer would
        role.wait(10)
        # Before the watchdog, both stayed up, reparented to init (issue 29, item 5).
        _wait_for(lambda: not any(_alive(p) for p in (watchdog, server, engine)), 30,
                  "the server and its engine process to exit after their role was killed")
    finally:
        role.kill()
        for pid in (_pids(pidfile) if pidfile.exists() else []):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_servers_exit_code_shows_and_its_leftovers_are_killed(tmp_path):
    pidfile = tmp_path / "pids"
    proc = _spawn([sys.executable, "-c", SERVER, str(pidfile), "crash"], {},
                  tmp_path / "server.log")
    server, engine = _pids(pidfile)
    assert proc.wait(30) == 3  # the health monitor and wait_healthy report the server's code
    _wait_for(lambda: not _alive(engine), 30, "the crashed server's engine process to be killed")


def test_stop_ends_the_whole_group(tmp_path):
    pidfile = tmp_path / "pids"
    cmd = [sys.executable, "-c", SERVER, str(pidfile), "sleep"]
    launched = LaunchedServer("http://127.0.0.1:1", _spawn(cmd, {}, tmp_path / "s.log"),
                              tmp_path / "s.log", cmd, {})
    server, engine = _pids(pidfile)
    launched.stop(timeout_s=20)
    assert not launched.alive()
    _wait_for(lambda: not _alive(server) and not _alive(engine), 30, "the group to exit")
