"""What a `tapioca train` launcher says about itself in its run directory,
``<run dir>/launcher.json``: its pid and host, when it started, the broker it used and
whether that broker was its own (an embedded one that stopped with it), and how it ended
(finished, interrupted, failed).

Written by the launcher (ops/launcher.py) at start and at stop; read by `tapioca runs`
(is the trial running?) and by `tapioca train --resume` (was the broker in the run's
config.yaml the launcher's own, so gone now?). Consumes and emits nothing on the bus.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any

RECORD = "launcher.json"


def _path(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / RECORD


def write_start(run_dir: str | os.PathLike, *, bootstrap: str, own_broker: bool,
                bus_run_id: str) -> None:
    _write(run_dir, {"pid": os.getpid(), "host": socket.gethostname(), "started_at": time.time(),
                     "bootstrap": bootstrap, "own_broker": own_broker, "bus_run_id": bus_run_id})


def write_end(run_dir: str | os.PathLike, outcome: str) -> None:
    """``outcome``: finished | interrupted | failed (a run that was never recorded as
    started is left alone)."""
    record = read_record(run_dir)
    if record is not None and record.get("pid") == os.getpid():
        _write(run_dir, {**record, "ended_at": time.time(), "outcome": outcome})


def _write(run_dir: str | os.PathLike, record: dict[str, Any]) -> None:
    path = _path(run_dir)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)


def read_record(run_dir: str | os.PathLike) -> dict[str, Any] | None:
    try:
        return json.loads(_path(run_dir).read_text())
    except (OSError, ValueError):
        return None


def running(record: dict[str, Any] | None) -> bool:
    """Whether the launcher of ``record`` still runs: no end recorded, and its pid alive on
    this host (a launcher killed with SIGKILL records no end). Another host's: unknown,
    so True while no end is recorded."""
    if not record or "ended_at" in record:
        return False
    if record.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(record["pid"]), 0)
    except (OSError, KeyError, ValueError):
        return False
    started = _process_start(int(record["pid"]))
    # A zombie is not running; a pid whose process started after the record was written
    # was reused (e.g. after a reboot) and is not the launcher.
    return started is not None and started <= float(record.get("started_at", 0)) + 1.0


def _process_start(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), None if it is gone or a
    zombie; elsewhere than Linux, 0 (no way to tell a reused pid)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open("/proc/stat") as f:
            boot = next(float(line.split()[1]) for line in f if line.startswith("btime"))
    except FileNotFoundError:
        return None if os.path.isdir("/proc") else 0.0
    except (OSError, IndexError, StopIteration, ValueError):
        return 0.0
    if fields[0] in ("Z", "X"):
        return None
    return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")
