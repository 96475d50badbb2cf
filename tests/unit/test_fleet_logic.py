"""Fleet control logic without a broker: which commands a member takes, what pause /
resume / drain do to its status, the acknowledgements, rates, target resolution and the
`tapioca plot` rendering."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tapioca.bus.fleet import (
    ControlError,
    MemberControl,
    MemberView,
    RateMeter,
    matches,
    policy_version_of,
    resolve_target,
)
from tapioca.bus.role import Role
from tapioca.bus.settings import BusConfig
from tapioca.ops.plot import load_steps, render
from tapioca.schemas.errors import ConfigError
from tapioca.schemas.events import ControlAckEvent, ControlEvent, FleetEvent


def cmd(command: str, target: str, *, cid: str = "", run_id: str = "default",
        produced_at: float | None = None) -> ControlEvent:
    ev = ControlEvent(command_id=cid or f"c-{command}-{target}-{time.monotonic_ns()}",
                      command=command, target=target, run_id=run_id)
    if produced_at is not None:
        ev.produced_at = produced_at
    return ev


@pytest.fixture
def member() -> MemberControl:
    return MemberControl("rollout-1", "rollout", started_at=time.time() - 5)


def test_matches_role_member_and_all():
    assert matches("rollout", "rollout", "rollout-1")
    assert matches("rollout-1", "rollout", "rollout-1")
    assert matches("all", "rollout", "rollout-1")
    assert not matches("trainer", "rollout", "rollout-1")
    assert not matches("rollout-0", "rollout", "rollout-1")
    assert not matches("roll", "rollout", "rollout-1")


def test_accepts_only_new_commands_for_this_member(member):
    assert member.accepts(cmd("pause", "rollout", cid="a"))
    assert not member.accepts(cmd("pause", "rollout", cid="a")), "a redelivered command ran twice"
    assert member.accepts(cmd("pause", "rollout-1"))
    assert member.accepts(cmd("pause", "all"))
    assert not member.accepts(cmd("pause", "trainer"))
    assert not member.accepts(cmd("pause", "rollout-0"))
    # History from before the member started is not an order for it; a few seconds of
    # slack allow for the CLI's clock being behind the member's.
    from tapioca.bus.fleet import CLOCK_SKEW_SLACK_S

    assert not member.accepts(cmd("drain", "rollout",
                                  produced_at=member.started_at - CLOCK_SKEW_SLACK_S - 1))
    assert member.accepts(cmd("drain", "rollout", produced_at=member.started_at - 1))
    # Acknowledgements share the topic and are never commands.
    assert not member.accepts(ControlAckEvent(command_id="x", target="rollout", member_id="m"))


def test_run_scoped_commands():
    m = MemberControl("trainer-0", "trainer", run_id="runA", started_at=0.0)
    assert m.accepts(cmd("pause", "trainer"))  # CLI default: any run
    assert m.accepts(cmd("pause", "trainer", run_id="runA"))
    assert not m.accepts(cmd("pause", "trainer", run_id="runB"))


def test_pause_resume_drain_transitions_and_acks(member):
    assert member.status == "running"
    ok, msg, change = member.apply(cmd("pause", "rollout"))
    assert (ok, change, member.status) == (True, "pause", "paused")
    ok, msg, change = member.apply(cmd("pause", "rollout"))
    assert (ok, change) == (True, None) and "already" in msg
    ok, msg, change = member.apply(cmd("resume", "rollout"))
    assert (ok, change, member.status) == (True, "resume", "running")
    ok, msg, change = member.apply(cmd("resume", "rollout"))
    assert (ok, change) == (True, None) and "not paused" in msg
    member.apply(cmd("pause", "rollout"))
    ok, msg, change = member.apply(cmd("drain", "rollout"))
    assert (ok, change, member.status) == (True, "drain", "draining")
    assert member.paused is False and "was paused" in msg
    ok, msg, change = member.apply(cmd("pause", "rollout"))
    assert ok is False and change is None and "draining" in msg
    ok, _, change = member.apply(cmd("drain", "rollout"))
    assert ok is True and change is None

    command = cmd("drain", "rollout", cid="c9")
    ack = member.ack(command, True, "draining")
    assert (ack.command_id, ack.target, ack.member_id, ack.ok, ack.message) == (
        "c9", "rollout", "rollout-1", True, "draining")


def test_role_default_hooks():
    class R(Role):
        name = "r"

    r = R()
    assert r.drained(None) is True
    assert list(r.on_drain(None)) == []
    ok, message, events = r.on_control(cmd("frobnicate", "r"), None)
    assert ok is False and "frobnicate" in message and list(events) == []


def test_rate_meter_and_policy_version():
    meter = RateMeter()
    assert meter.update(10.0, {"in": 0, "out": 0}) == {"in_per_s": 0.0, "out_per_s": 0.0}
    assert meter.update(12.0, {"in": 10, "out": 4}) == {"in_per_s": 5.0, "out_per_s": 2.0}
    assert policy_version_of({"version": 7, "x": 1}) == 7
    assert policy_version_of({"policy_version": 3, "version": 9}) == 3
    assert policy_version_of({"exhausted": True}) == 0


def view(member_id: str, role: str, *, status: str = "running", age_s: float = 0.5,
         interval_s: float = 2.0) -> MemberView:
    return MemberView(FleetEvent(member_id=member_id, role=role, status=status,
                                 detail={"interval_s": interval_s}), age_s)


def test_stale_and_live():
    assert view("a", "r").live
    stale = view("a", "r", age_s=7.0)
    assert stale.stale and not stale.live
    stopped = view("a", "r", status="stopped", age_s=100)
    assert not stopped.stale and not stopped.live
    assert view("a", "r", age_s=7.0, interval_s=10).live


def test_resolve_target():
    fleet = [view("rollout-0", "rollout"), view("rollout-1", "rollout"),
             view("trainer-0", "trainer"), view("reward-0", "reward", status="stopped")]
    assert [m.event.member_id for m in resolve_target(fleet, "rollout")] == ["rollout-0", "rollout-1"]
    assert [m.event.member_id for m in resolve_target(fleet, "trainer-0")] == ["trainer-0"]
    assert len(resolve_target(fleet, "all")) == 3
    with pytest.raises(ControlError) as err:
        resolve_target(fleet, "rollot")
    text = str(err.value)
    assert "'rollot'" in text and "rollout, trainer" in text and "rollout-0" in text
    with pytest.raises(ControlError, match=r"reward-0 \(stopped\): not live"):
        resolve_target(fleet, "reward")
    # A member busy in a long step is stale but still sent commands for a while.
    busy = view("trainer-1", "trainer", age_s=60)
    assert busy.stale and busy.targetable
    assert [m.event.member_id for m in resolve_target(fleet + [busy], "trainer")] == [
        "trainer-0", "trainer-1"]
    gone = view("trainer-2", "trainer", age_s=1000)
    with pytest.raises(ControlError, match=r"trainer-2 \(stale\): not live"):
        resolve_target([gone], "trainer-2")
    with pytest.raises(ControlError, match="no member has sent a heartbeat"):
        resolve_target([], "rollout")


def test_heartbeat_interval_must_be_positive():
    with pytest.raises(ConfigError, match="fleet_heartbeat_interval_s"):
        BusConfig(bootstrap_servers="x:1", fleet_heartbeat_interval_s=0)


def test_plot_writes_a_png(tmp_path):
    run = tmp_path / "run"
    (run / "metrics").mkdir(parents=True)
    lines = [json.dumps({"step": s, "time": 1000.0 + 2 * s, "reward/mean": s / 40,
                         "trainer/staleness_mean": 0.5, "trainer/staleness_max": 1.0,
                         "actor/tokens_per_s": 900.0 + s}) for s in range(1, 41)]
    lines.append(json.dumps({"step": 40, "time": 1100.0, "reward/mean": 0.99}))  # redone step
    (run / "metrics" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    rows = load_steps(run)
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert rows[-1]["reward/mean"] == 0.99
    out = render(rows, tmp_path / "out" / "curves.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_errors_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="no metrics file"):
        load_steps(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match="no step rows"):
        load_steps(tmp_path)


def test_run_summary_window_says_how_many_steps_it_averaged():
    """The closing line of `tapioca train` names the window it really used: 20 steps,
    or half the run when it is shorter (3 steps: the first vs the last single step)."""
    from pathlib import Path

    from tapioca.ops.launcher import RunSummary

    long_run = RunSummary(Path("."), rewards={s: float(s) for s in range(1, 51)})
    # first 20: mean of 1..20 = 10.5; last 20: mean of 31..50 = 40.5
    assert long_run.window_means() == (10.5, 40.5, 20)
    short = RunSummary(Path("."), rewards={1: 0.0, 2: 0.5, 3: 1.0})
    assert short.window_means() == (0.0, 1.0, 1)
    assert RunSummary(Path(".")).window_means() is None


def test_member_fleet_uses_only_the_runners_public_surface():
    """bus/fleet.py drives the runner through its public methods and attributes, never a
    private one (``runner._group`` and the like): the runner can change its insides."""
    import ast

    import tapioca.bus.fleet as fleet

    tree = ast.parse(Path(fleet.__file__).read_text())
    private = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")
                and not node.attr.startswith("__")):
            continue
        base = node.value
        if (isinstance(base, ast.Name) and base.id == "r") or (
                isinstance(base, ast.Attribute) and base.attr == "runner"):
            private.append(f"line {node.lineno}: .{node.attr}")
    assert not private, private
