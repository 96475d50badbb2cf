"""The fleet of inference servers behind one server engine: which are up, which are
down, and when one is started again.

Consumes server handles (the URLs the engine speaks to, as :class:`Server` records, and
the server processes it launched: :class:`~tapioca.engines.server_launch.LaunchedServer`,
or anything with ``url``, ``alive()``, ``restart()``, ``stop()`` and ``restarts``), a
health probe (``probe(server) -> bool``: the engine's ``GET /health``) and the engine's
bring-up (``join(server, joining)``: check a server that answers for the first time, or
give one that comes back the current weights and version). Emits health and restart
decisions, keyed by server URL:

- ``mark_down``: a server that failed a request or a probe leaves the pool (counted in
  ``server_failures``; it holds unknown weights from then on);
- ``wait_for_first``: at start, the first server to answer is checked and used; the
  others join later, when they answer a probe;
- ``probe_all`` (every ``health_interval_s``, :meth:`ServerFleet.monitor`): a down server
  that answers again is brought up through ``join`` (``server_recoveries``); a launched
  server whose process exited, or that stayed unhealthy for ``startup_timeout_s`` (a dead
  engine behind a live API), is started again (``server_restarts``);
- ``describe``: the counts the engine's ``describe`` carries to ``fleet.v1``.

The engine (engines/server_engine.py) keeps requests, weights and adapters; this module
speaks no HTTP itself.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Sequence

from ..config.servers import InferenceServerConfig
from ..schemas.errors import EngineError

log = logging.getLogger(__name__)


class ServerDown(Exception):
    """A server did not answer (connection refused / reset, timeout) or answered 5xx."""


@dataclass
class Server:
    url: str
    up: bool = False
    inflight: int = 0
    # This engine's requests in flight there (a server may be shared with other workers:
    # an abort names only these).
    requests: set[str] = field(default_factory=set)
    failures: int = 0
    # The policy version its weights hold; None = unknown (restarted, missed an update).
    version: int | None = None
    last_error: str = ""
    down_since: float = 0.0
    # Its settings were checked (the engine's _check) and it holds no other run's weights.
    checked: bool = False
    # LoRA runs: the adapter names this engine loaded there, oldest first (at most
    # max_loaded_adapters; older ones are unloaded).
    adapters: list[str] = field(default_factory=list)


Probe = Callable[[Server], Awaitable[bool]]
# join(server, joining): joining = first contact (check it, then bring it up), else a
# server that comes back (bring it to the current weights). Raises ServerDown or
# EngineError when the server cannot be used.
Join = Callable[[Server, bool], Awaitable[None]]


class ServerFleet:
    """The servers of one engine and their health; see the module docstring.

    ``backend`` names the servers in messages (vllm, sglang); ``is_closing`` says the
    engine is shutting down (the probes stop)."""

    def __init__(self, urls: Sequence[str], *, config: InferenceServerConfig, backend: str,
                 probe: Probe, launched: Sequence[Any] = (),
                 is_closing: Callable[[], bool] = lambda: False) -> None:
        self.cfg = config
        self.backend = backend
        self.probe = probe
        self.launched = list(launched)
        self.servers = [Server(u.rstrip("/")) for u in urls]
        self.is_closing = is_closing
        self.failures = 0  # servers that went down (server_failures)
        self.recoveries = 0  # servers that came back and were brought up (server_recoveries)

    def live(self) -> list[Server]:
        return [s for s in self.servers if s.up]

    def any_up(self) -> bool:
        return any(s.up for s in self.servers)

    def errors(self) -> str:
        """Each server's last error, for a message that says why none can be used."""
        return "; ".join(f"{s.url}: {s.last_error}" for s in self.servers)

    def mark_down(self, server: Server, error: str) -> None:
        if server.up:
            log.warning("%s server %s is down: %s", self.backend, server.url, error)
            self.failures += 1
            server.down_since = time.monotonic()
        server.up = False
        server.failures += 1
        server.version = None  # a restarted server holds its start-up weights
        server.last_error = error[:500]

    # ------------------------------------------------------------------ start

    async def wait_for_first(self, first_contact: Callable[[Server], Awaitable[None]]) -> None:
        """Wait up to ``startup_timeout_s`` for the first server to answer ``/health`` and
        pass ``first_contact`` (whose EngineError, a misconfigured server, is raised as is);
        the others join when they answer (:meth:`monitor`)."""
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while not self.any_up() and time.monotonic() < deadline:
            for server in self.servers:
                if await self.probe(server):
                    await first_contact(server)
                else:
                    server.last_error = "no answer on /health"
            if not self.any_up():
                await asyncio.sleep(1.0)
        if not self.any_up():
            raise EngineError(f"no {self.backend} server answered within "
                              f"{self.cfg.startup_timeout_s:.0f} s ({self.errors()}); start one, fix "
                              "rollout.server.urls, or raise rollout.server.startup_timeout_s")
        for server in self.servers:
            if not server.up:
                log.warning("%s server %s does not answer yet; it is used once it does",
                            self.backend, server.url)

    # ------------------------------------------------------------------ health

    async def monitor(self, join: Join) -> None:
        """Probe every server each ``health_interval_s`` until the engine closes."""
        while not self.is_closing():
            await asyncio.sleep(self.cfg.health_interval_s)
            try:
                await self.probe_all(join)
            except Exception:  # the monitor must outlive any one bad probe
                log.exception("%s health monitor", self.backend)

    async def probe_all(self, join: Join) -> None:
        for server in self.servers:
            if self.is_closing():
                return
            healthy = await self.probe(server)
            if server.up and not healthy:
                self.mark_down(server, "failed its health check")
            if not healthy:
                await self.maybe_restart(server)
            elif not server.up and healthy:
                joining = not server.checked
                try:
                    await join(server, joining)
                    if not joining:
                        self.recoveries += 1
                    log.warning("%s server %s is %s (version %d)", self.backend, server.url,
                                "in use" if joining else "back", server.version)
                except (ServerDown, EngineError) as exc:
                    if joining and server.last_error != str(exc)[:500]:
                        log.error("%s server %s cannot be used: %s", self.backend, server.url, exc)
                    self.mark_down(server, f"{exc}")

    # ------------------------------------------------------------------ restart

    def should_restart(self, server: Server, now: float) -> bool:
        """Whether to start a server this engine launched again: its process exited, or it
        stayed unhealthy for startup_timeout_s (a dead engine behind a live API). A server
        someone else runs, or one never seen down, is left alone."""
        launched = self._launched_for(server)
        if launched is None or server.down_since == 0.0:
            return False
        hung = now - server.down_since > self.cfg.startup_timeout_s
        return not launched.alive() or hung

    async def maybe_restart(self, server: Server) -> None:
        if not self.should_restart(server, time.monotonic()):
            return
        await asyncio.to_thread(self._launched_for(server).restart)
        server.down_since = time.monotonic()  # give the new process its start-up time

    def _launched_for(self, server: Server):
        return next((p for p in self.launched if p.url == server.url), None)

    def stop_launched(self) -> None:
        for proc in self.launched:
            proc.stop()
        self.launched = []

    # ------------------------------------------------------------------ report

    def describe(self) -> dict[str, float]:
        up = len(self.live())
        out = {"servers_up": up, "servers_down": len(self.servers) - up,
               "server_failures": self.failures, "server_recoveries": self.recoveries,
               "server_restarts": sum(p.restarts for p in self.launched)}
        for i, s in enumerate(self.servers):
            out[f"server{i}_up"] = int(s.up)
        return out
