"""The server fleet's health and restart decisions (engines/server_fleet.py), without HTTP:
a probe and a bring-up stand in for the engine's; the engine over stub servers is tested
in tests/unit/test_engine_server_failover.py."""

from __future__ import annotations

import asyncio

import pytest

from tapioca.config.servers import InferenceServerConfig
from tapioca.engines.server_fleet import ServerDown, ServerFleet
from tapioca.schemas.errors import EngineError


class Process:
    """Stands for a LaunchedServer."""

    def __init__(self, url: str, alive: bool = True) -> None:
        self.url, self._alive, self.restarts, self.stopped = url, alive, 0, False

    def alive(self) -> bool:
        return self._alive

    def restart(self) -> None:
        self.restarts += 1
        self._alive = True

    def stop(self) -> None:
        self.stopped = True


def fleet(urls=("http://a/", "http://b"), healthy=(), launched=(), startup_timeout_s=60.0):
    healthy = set(healthy)

    async def probe(server) -> bool:
        return server.url in healthy

    cfg = InferenceServerConfig(startup_timeout_s=startup_timeout_s, health_interval_s=0.01)
    return ServerFleet(list(urls), config=cfg, backend="vllm", probe=probe, launched=launched), healthy


def test_a_server_marked_down_is_counted_once_and_holds_unknown_weights():
    f, _ = fleet()
    a = f.servers[0]
    assert a.url == "http://a"  # the trailing slash goes
    a.up, a.version = True, 3
    f.mark_down(a, "refused")
    f.mark_down(a, "refused again")  # already down: not a second failure of the fleet
    assert (a.up, a.version, a.failures, a.last_error) == (False, None, 2, "refused again")
    assert f.describe() == {"servers_up": 0, "servers_down": 2, "server_failures": 1,
                            "server_recoveries": 0, "server_restarts": 0, "server0_up": 0, "server1_up": 0}


def test_only_a_launched_server_that_died_or_hung_is_restarted():
    dead, hung = Process("http://a", alive=False), Process("http://b", alive=True)
    f, _ = fleet(launched=[dead, hung], startup_timeout_s=60.0)
    a, b = f.servers
    assert not f.should_restart(a, 100.0)  # never seen down
    a.down_since = b.down_since = 100.0
    assert f.should_restart(a, 100.0)  # its process exited
    assert not f.should_restart(b, 159.0)  # alive, and down for less than startup_timeout_s
    assert f.should_restart(b, 161.0)  # a dead engine behind a live API
    other, _ = fleet(urls=("http://c",))
    other.servers[0].down_since = 1.0
    assert not other.should_restart(other.servers[0], 1e9)  # someone else's server
    asyncio.run(f.maybe_restart(a))
    assert dead.restarts == 1 and f.describe()["server_restarts"] == 1
    f.stop_launched()
    assert dead.stopped and hung.stopped and f.launched == []


def test_a_probe_brings_up_a_new_server_and_a_returning_one_through_the_engine():
    f, healthy = fleet(healthy={"http://a", "http://b"})
    a, b = f.servers
    b.checked = True  # b passed its first contact before and went down
    joins = []

    async def join(server, joining: bool) -> None:
        joins.append((server.url, joining))
        server.up, server.checked, server.version = True, True, 7

    asyncio.run(f.probe_all(join))
    assert joins == [("http://a", True), ("http://b", False)]
    assert f.describe()["servers_up"] == 2 and f.recoveries == 1
    healthy.discard("http://a")
    asyncio.run(f.probe_all(join))  # a fails its probe: down, not restarted (not launched)
    assert not a.up and a.last_error == "failed its health check" and f.failures == 1


@pytest.mark.parametrize("error", [ServerDown("reset"), EngineError("wrong --logprobs-mode")])
def test_a_server_that_fails_its_bring_up_stays_down(error):
    f, _ = fleet(healthy={"http://a"}, urls=("http://a",))

    async def join(server, joining: bool) -> None:
        raise error

    asyncio.run(f.probe_all(join))
    assert not f.servers[0].up and f.servers[0].last_error == str(error) and f.recoveries == 0


def test_no_server_at_start_is_refused_with_what_to_do():
    f, _ = fleet(startup_timeout_s=0.01)

    async def first_contact(server) -> None:
        raise AssertionError("no server answered")

    with pytest.raises(EngineError, match="raise rollout.server.startup_timeout_s"):
        asyncio.run(f.wait_for_first(first_contact))
    assert all(s.last_error == "no answer on /health" for s in f.servers)
