"""`tapioca train`'s supervisor (ops/launcher.py) against the real embedded broker:
crashed roles are restarted with backoff within a budget and then end the run naming
the role and its log; the broker and roles die with a launcher killed with SIGKILL;
a broker that lost its topics is detected, the topics are re-created with the
registry's partitions and the roles restarted on a new bus run id; the stall alarm.

Most tests run the real Launcher with stand-in role processes (a few lines of Python
each, ``STANDIN`` below: no model, no torch) so that crashes can be scripted; the
kill -9 test runs the real `tapioca train`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from tapioca.bus.admin import admin_client, topic_partitions
from tapioca.bus.settings import BusConfig
from tapioca.config.schema import LauncherConfig, ModelConfig, TrainConfig
from tapioca.ops.launcher import Launcher, RoleFailedError, RoleOutOfMemoryError
from tapioca.schemas.registry import TOPICS

pytestmark = pytest.mark.integration

TAPIOCA = str(Path(sys.executable).parent / "tapioca")

# argv: ROLE MEMBER CONFIG. Reads <run dir>/standin/plan.json for what ROLE does, counts
# its starts in <run dir>/standin/ROLE-MEMBER.starts.
STANDIN = r"""
import json, os, sys, time
role, member, config = sys.argv[1], sys.argv[2], sys.argv[3]
state = os.path.join(os.path.dirname(config), "standin")
os.makedirs(state, exist_ok=True)
starts = os.path.join(state, f"{role}-{member}.starts")
n = (int(open(starts).read()) if os.path.exists(starts) else 0) + 1
open(starts, "w").write(str(n))
plan = json.load(open(os.path.join(state, "plan.json")))
what = plan.get(role, "sleep")
print(f"{role}-{member} start {n}: {what}", flush=True)
if what.startswith("crash-first:") and n <= int(what.split(":")[1]):
    print("boom", flush=True); sys.exit(1)
if what == "crash":
    print("boom: this role always fails", flush=True); sys.exit(1)
if what == "exit78":
    print("error: bad config", flush=True); sys.exit(78)
if what == "exit71":
    print("error: training step 2 ran out of memory: CUDA out of memory.", flush=True); sys.exit(71)
deadline = time.time() + 120
while time.time() < deadline:
    if what.startswith("done-when-file:") and os.path.exists(os.path.join(state, what.split(":", 1)[1])):
        sys.exit(0)
    if what.startswith("done-when-run-id:"):
        run_id = open(config).read().split("run_id: ", 1)[1].split()[0].strip("'\"")
        if run_id.endswith(what.split(":", 1)[1]):
            sys.exit(0)
    if what.startswith("done-after:") and time.time() > deadline - 120 + float(what.split(":")[1]):
        sys.exit(0)
    time.sleep(0.05)
"""


@pytest.fixture
def standin(tmp_path):
    path = tmp_path / "standin.py"
    path.write_text(STANDIN)
    return lambda role, member, config: [sys.executable, str(path), role, str(member), str(config)]


def make_launcher(tmp_path, standin, plan: dict, *, bootstrap: str = "", **launcher) -> Launcher:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)  # the stand-ins load no model
    cfg = TrainConfig(run_dir=str(tmp_path / "runs"), experiment_name="sup", trial_name="t0",
                      model=ModelConfig(path=str(model)),
                      bus=BusConfig(bootstrap_servers=bootstrap,
                                    topic_prefix=f"sup{uuid.uuid4().hex[:8]}"),
                      launcher=LauncherConfig(**{"restart_backoff_s": 0.1, **launcher}))
    state = Path(cfg.run_path) / "standin"
    state.mkdir(parents=True, exist_ok=True)
    (state / "plan.json").write_text(json.dumps(plan))
    return Launcher(cfg, command_for=standin)


def starts(launcher: Launcher, label: str) -> int:
    path = Path(launcher.cfg.run_path) / "standin" / f"{label}.starts"
    return int(path.read_text()) if path.exists() else 0


def test_crashed_role_is_restarted_with_backoff_and_shown(tmp_path, standin, broker):
    launcher = make_launcher(tmp_path, standin, {
        "rollout": "crash-first:2", "trainer": "done-when-file:go"}, bootstrap=broker.bootstrap,
        max_restarts=3)
    seen = []

    def tick():
        seen.append(launcher.health())
        if starts(launcher, "rollout-0") >= 3:
            (Path(launcher.cfg.run_path) / "standin" / "go").touch()

    launcher.on_tick = tick
    launcher.start()
    try:
        summary = launcher.wait(timeout_s=60)
    finally:
        launcher.stop()
    assert starts(launcher, "rollout-0") == 3 and starts(launcher, "feeder-0") == 1
    assert summary.restarts == {"rollout-0": 2}
    assert "restarts: rollout-0 x2" in summary.supervision_line()
    assert any(h["restarts"] == {"rollout-0": 1} for h in seen)  # shown while it happens
    assert any("rollout-0 exited with code 1; restart 2/3" in n for h in seen for n in h["notices"])


def test_role_that_exhausts_its_budget_ends_the_run_naming_it_and_its_log(tmp_path, standin, broker):
    launcher = make_launcher(tmp_path, standin, {"reward": "crash"}, bootstrap=broker.bootstrap,
                             max_restarts=2)
    launcher.start()
    try:
        with pytest.raises(RoleFailedError) as err:
            launcher.wait(timeout_s=60)
    finally:
        launcher.stop()
    message = str(err.value)
    assert "role reward-0 exited with code 1" in message
    assert "restarted 2 times" in message and "launcher.max_restarts=2" in message
    assert str(Path(launcher.cfg.run_path) / "logs" / "reward-0.log") in message
    assert "boom: this role always fails" in message
    assert starts(launcher, "reward-0") == 3


def test_a_config_error_is_not_retried(tmp_path, standin, broker):
    launcher = make_launcher(tmp_path, standin, {"advantage": "exit78"},
                             bootstrap=broker.bootstrap)
    launcher.start()
    try:
        with pytest.raises(RoleFailedError) as err:
            launcher.wait(timeout_s=60)
    finally:
        launcher.stop()
    assert starts(launcher, "advantage-0") == 1
    # One line: the role's own reason (its log's last "error:" line) and where its log is.
    log_path = Path(launcher.cfg.run_path) / "logs" / "advantage-0.log"
    assert str(err.value) == f"advantage-0: bad config (log: {log_path})"


def test_an_out_of_memory_step_is_not_restarted(tmp_path, standin, broker):
    """Issue 37: a trainer that ran out of memory was restarted and ran out again (the
    same step needs the same memory); EXIT_OOM (71) stops the run with the role's line."""
    launcher = make_launcher(tmp_path, standin, {"trainer": "exit71"}, bootstrap=broker.bootstrap)
    launcher.start()
    try:
        with pytest.raises(RoleOutOfMemoryError) as err:
            launcher.wait(timeout_s=60)
    finally:
        launcher.stop()
    assert starts(launcher, "trainer-0") == 1
    assert err.value.exit_code == 71
    assert err.value.why == "trainer-0: training step 2 ran out of memory: CUDA out of memory."
    assert "not restarted" in str(err.value)
    record = json.loads((Path(launcher.cfg.run_path) / "launcher.json").read_text())
    assert record["outcome"] == "out of memory"


def test_a_role_the_user_started_ends_with_the_run(tmp_path, standin, broker):
    """The drain warning tells the user to start `tapioca role NAME --config RUN/config.yaml`
    (a real process here, the feeder); when the run ends, that member is drained over
    control.v1 and exits 0, instead of running on after the run (issue 29, item 5)."""
    from tapioca.bus import read_events
    from tapioca.bus.fleet import read_fleet
    from tapioca.runtime.run import create_tiny_checkpoint
    from tapioca.schemas.events import ControlAckEvent

    create_tiny_checkpoint(tmp_path / "model")
    launcher = make_launcher(tmp_path, standin, {"trainer": "done-when-file:go"},
                             bootstrap=broker.bootstrap)
    env = {**os.environ, "TAPIOCA_HOME": str(tmp_path / "home")}
    env.pop("TAPIOCA_BOOTSTRAP", None)
    outsider = None
    launcher.start()
    try:
        with open(tmp_path / "outsider.log", "wb") as out:
            outsider = subprocess.Popen(
                [TAPIOCA, "role", "feeder", "--config", str(launcher.config_path), "--member", "1"],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 120
        while not any(m.live and m.event.member_id == "feeder-1" and m.event.pid == outsider.pid
                      for m in read_fleet(launcher.cfg.bus, window_s=60)):
            assert outsider.poll() is None, (tmp_path / "outsider.log").read_text()
            assert time.monotonic() < deadline, "the outside feeder never sent a heartbeat"
            time.sleep(0.5)
        (Path(launcher.cfg.run_path) / "standin" / "go").touch()  # the trainer finishes
        launcher.wait(timeout_s=60)
    finally:
        launcher.stop()
        try:
            # Before: it ran on, heartbeating into a finished run.
            assert outsider is not None and outsider.wait(60) == 0, \
                (tmp_path / "outsider.log").read_text()[-3000:]
        finally:
            if outsider is not None and outsider.poll() is None:
                os.killpg(outsider.pid, signal.SIGKILL)
    acks = [e for e in read_events(launcher.cfg.bus, "control")
            if isinstance(e, ControlAckEvent) and e.member_id == "feeder-1"]
    assert [a.ok for a in acks] == [True] and acks[0].message.startswith("draining")
    last = {m.event.member_id: m for m in read_fleet(launcher.cfg.bus, window_s=300)}
    assert last["feeder-1"].event.status == "stopped"


def test_a_taken_proxy_port_fails_the_run_at_once_with_its_reason(tmp_path):
    """The real `tapioca train` in agent mode with proxy.port taken: refused before any
    role (or the broker) starts, exit 78 with one line (issue 38 item 2; before, `tapioca
    proxy` exited 78 in its log and the launcher stopped the run, issue 29 item 6: that
    path stays as the proxy's defence)."""
    import socket

    examples = Path(__file__).resolve().parents[2] / "examples"
    env = {**os.environ, "TAPIOCA_HOME": str(tmp_path / "home")}
    env.pop("TAPIOCA_BOOTSTRAP", None)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [TAPIOCA, "train", "--config", str(examples / "agents" / "math_agent_cpu.yaml"),
             f"run_dir={tmp_path / 'runs'}", "trial_name=port", f"proxy.port={port}"],
            env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 78, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert errors[0].startswith(f"error: proxy.port={port} on 127.0.0.1 is taken")
    assert "set proxy.port to a free port (0 = any free port)" in errors[0]
    assert not (tmp_path / "runs" / "agent-math" / "port" / "logs").exists()  # no role, no broker


def _wrong_partitions(cfg: BusConfig) -> None:
    """What a broker restart plus an auto-creating client leave: control.v1 and dlq.v1
    gone, weights.v1 back with the broker's default of 4 partitions."""
    from confluent_kafka.admin import NewTopic

    admin = admin_client(cfg)
    names = [f"{cfg.topic_prefix}.{n}.v1" for n in ("control", "dlq", "weights")]
    for fut in admin.delete_topics(names, request_timeout=10).values():
        fut.result()
    deadline = time.monotonic() + 20
    while True:
        try:
            admin.create_topics([NewTopic(names[2], 4, 1)])[names[2]].result()
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_producers_never_auto_create_a_lost_topic(broker):
    """A produce to a topic the broker lost must not bring it back with the broker's
    defaults (4 partitions for weights.v1): it fails, naming the missing topic."""
    from tapioca.bus import EventProducer
    from tapioca.schemas.errors import BusError
    from tapioca.schemas.events import WeightsEvent

    cfg = BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix=f"lost{uuid.uuid4().hex[:8]}",
                    delivery_timeout_ms=1500)
    producer = EventProducer(cfg, "trainer", max_recreates=1)
    producer.publish(WeightsEvent(version=1, path="/w", sha256="0" * 64))
    with pytest.raises(BusError, match=r"weights\.v1 do not exist.*tapioca topics create"):
        producer.flush()
    assert topic_partitions(cfg) == {}


def registry_partitions(cfg: BusConfig) -> dict[str, int]:
    return {cfg.topic(t): t.partitions for t in TOPICS}


def test_lost_topics_are_recreated_and_roles_restarted_on_a_new_bus_run_id(tmp_path, standin,
                                                                          broker):
    launcher = make_launcher(tmp_path, standin, {"trainer": "done-when-run-id:@2"},
                             bootstrap=broker.bootstrap, topic_check_interval_s=0.5)
    launcher.start()
    try:
        assert launcher.cfg.bus.run_id == "sup.t0"
        _wrong_partitions(launcher.cfg.bus)
        summary = launcher.wait(timeout_s=60)
        assert topic_partitions(launcher.cfg.bus) == registry_partitions(launcher.cfg.bus)
    finally:
        launcher.stop()
    assert summary.log_recoveries == 1 and summary.bus_run_id == "sup.t0@2"
    written = yaml.safe_load(launcher.config_path.read_text())
    assert written["bus"]["run_id"] == "sup.t0@2"
    assert starts(launcher, "feeder-0") == 2 and starts(launcher, "trainer-0") == 2
    assert any("weights.v1 has 4 partitions, not 1" in n and "sup.t0@2" in n
               for n in launcher.notices)


def test_embedded_broker_death_is_detected_and_recovered(tmp_path, standin):
    launcher = make_launcher(tmp_path, standin, {"trainer": "done-when-run-id:@2"},
                             topic_check_interval_s=0.5)
    launcher.start()  # its own embedded broker
    try:
        port = launcher.broker.port
        os.kill(launcher.broker.proc.pid, signal.SIGKILL)
        summary = launcher.wait(timeout_s=60)
        assert launcher.broker.port == port and launcher.broker.proc.poll() is None
        assert topic_partitions(launcher.cfg.bus) == registry_partitions(launcher.cfg.bus)
    finally:
        launcher.stop()
    assert summary.bus_run_id == "sup.t0@2"
    assert any("embedded broker exited" in n for n in launcher.notices)


def test_stall_alarm_when_no_role_reports_or_moves(tmp_path, standin, broker):
    # Silence before any report is an alarm after 5 x stall_alarm_s (models load slowly).
    launcher = make_launcher(tmp_path, standin, {"trainer": "done-after:8"},
                             bootstrap=broker.bootstrap, stall_alarm_s=1.0)
    alarms = []
    launcher.on_tick = lambda: alarms.extend(launcher.health()["alarms"])
    launcher.start()
    try:
        launcher.wait(timeout_s=60)
        # Roles that report but neither handle nor produce anything, and are not paused.
        now = time.monotonic()
        for member in ("rollout-0", "trainer-0"):
            launcher._observe(member, 0, {"bus/handled": 5.0, "bus/produced": 2.0, "bus/paused": 0.0})
        launcher._progress = (launcher._progress[0], now - 5)
        launcher._check_stall(now)
    finally:
        launcher.stop()
    assert any("no role has reported on metrics.v1" in a for a in alarms)
    assert "no role handled or produced an event" in launcher.alarms.get("stall", "")


def test_status_raises_the_stall_alarm_when_every_running_member_is_idle(make_cfg, tmp_path,
                                                                         start_runner,
                                                                         wait_until):
    from tapioca.bus import Role
    from tapioca.bus.fleet import read_fleet

    class Idler(Role):
        name = "idler"
        group_inputs = ("prompts",)

        def init_state(self):
            return {}

        def handle(self, event, state, source):
            return ()

    cfg = make_cfg(fleet_heartbeat_interval_s=0.3)
    start_runner(Idler(), cfg, member_id="idler-0")
    wait_until(lambda: any(m.event.status == "running" and (m.event.detail.get("idle_s") or 0) >= 1.5
                           for m in read_fleet(cfg)), what="an idle running member")
    env = {**os.environ, "TAPIOCA_HOME": str(tmp_path / "home"), "COLUMNS": "150"}
    env.pop("TAPIOCA_BOOTSTRAP", None)
    base = [TAPIOCA, "--bootstrap-server", cfg.bootstrap_servers, "--prefix", cfg.topic_prefix]
    stalled = subprocess.run([*base, "status", "--stall-after", "1"], env=env,
                             capture_output=True, text=True, timeout=60)
    assert stalled.returncode == 4, stalled.stderr
    assert "ALARM: stalled: all 1 running member(s)" in stalled.stderr
    assert "idler-0" in stalled.stdout
    rows = json.loads(subprocess.run([*base, "status", "-o", "json", "--stall-after", "600"],
                                     env=env, capture_output=True, text=True, timeout=60).stdout)
    assert rows[0]["idle_s"] >= 1.0


# ---------------------------------------------------------------------- kill -9


def _descendants(pid: int) -> set[int]:
    """Every live (non-zombie) process whose parent chain leads to ``pid``."""
    parents: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if fields[0] != "Z":
                    parents[int(name)] = int(fields[1])
            except (OSError, IndexError):
                pass
    found, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux")
def test_kill_9_of_the_launcher_leaves_no_orphans(tmp_path):
    """The real `tapioca train` with its own embedded broker: SIGKILL it as soon as the
    broker and every role are up; they all go with it."""
    env = {**os.environ, "TAPIOCA_HOME": str(tmp_path / "home")}
    env.pop("TAPIOCA_BOOTSTRAP", None)
    proc = subprocess.Popen([TAPIOCA, "train", f"run_dir={tmp_path / 'runs'}", "trial_name=k9",
                             "total_train_steps=1000"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    children: set[int] = set()
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:  # broker + 5 roles (4 roles + archiver off)
            children = _descendants(proc.pid)
            if len([p for p in children if _alive(p)]) >= 6:
                break
            assert proc.poll() is None, "tapioca train exited early"
            time.sleep(0.2)
        else:
            pytest.fail(f"the launcher started only {len(children)} children")
        time.sleep(0.5)
        children = _descendants(proc.pid)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(_alive(p) for p in children):
            time.sleep(0.2)
        left = sorted(p for p in children if _alive(p))
        assert not left, f"orphans left after kill -9 of the launcher: {left}"
    finally:
        for p in children:  # never leak processes from a failing run
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
