"""When a `tapioca train` run ends, the members of the run that its launcher did not start
end with it: a `tapioca role NAME --config RUN/config.yaml` that a user started (the drain
warning says to), or one on another host.

Consumes ``fleet.v1`` (the latest heartbeat of every member: who is live, in which run,
with which host and pid); emits on ``control.v1`` one signed ``drain`` command per such
member (``args.reason``: the run ended), stamped with the run's bus run id so that only
this run's members obey it (bus/fleet.py), then waits until each has reported
``stopped`` (or gone silent). A drained member finishes its in-flight work, commits and
exits 0, as after `tapioca drain`. The launcher's own children are told apart by host
and pid; they are stopped with signals (ops/launcher.py)."""

from __future__ import annotations

import logging
import socket
import time
from typing import Iterable

from ..bus.fleet import MemberView, read_fleet, send_command
from ..bus.settings import BusConfig
from ..schemas.errors import TapiocaError

log = logging.getLogger(__name__)

# Members heard from this recently are candidates (a live member heartbeats every 2 s).
FLEET_WINDOW_S = 120.0
REASON = "the run ended"


def outside_members(cfg: BusConfig, own_pids: Iterable[int]) -> list[MemberView]:
    """The live members of this run (``cfg.run_id``) that are not the launcher's
    children (``own_pids`` on this host); none when the fleet cannot be read (logged:
    the run is ending anyway)."""
    host, own = socket.gethostname(), set(own_pids)
    try:
        fleet = read_fleet(cfg, window_s=FLEET_WINDOW_S)
    except TapiocaError as exc:
        log.warning("could not read the fleet to end the run's other members: %s", exc)
        return []
    return [m for m in fleet if m.live and m.event.run_id == cfg.run_id
            and not (m.event.host == host and m.event.pid in own)]


def end_members(cfg: BusConfig, members: list[MemberView], timeout_s: float = 30.0) -> list[str]:
    """Drain ``members`` and wait up to ``timeout_s`` for them to stop; returns the ids of
    those still running then (logged: their drain takes longer, or they did not obey)."""
    if not members:
        return []
    waiting = {(m.event.member_id, m.event.pid) for m in members}
    try:
        for m in members:
            log.warning("the run ended: draining %s (pid %s on %s), which this launcher did "
                        "not start", m.event.member_id, m.event.pid, m.event.host)
            send_command(cfg, "drain", m.event.member_id, [m.event.member_id],
                         args={"reason": REASON}, timeout_s=min(5.0, timeout_s))
        deadline = time.monotonic() + timeout_s
        while waiting and time.monotonic() < deadline:
            time.sleep(0.5)
            latest = {m.event.member_id: m for m in read_fleet(cfg, window_s=FLEET_WINDOW_S)}
            waiting = {(mid, pid) for mid, pid in waiting
                       if (m := latest.get(mid)) is not None and m.live and m.event.pid == pid}
    except TapiocaError as exc:
        log.warning("could not drain the run's other members: %s", exc)
    left = sorted(mid for mid, _ in waiting)
    for mid in left:
        log.warning("%s did not stop within %.0f s of the drain; stop it yourself", mid,
                    timeout_s)
    return left
