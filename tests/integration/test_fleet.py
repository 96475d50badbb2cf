"""Fleet control against the real embedded broker: heartbeats on fleet.v1, commands and
acknowledgements on control.v1, `tapioca status|pause|resume|drain|weights|dlq` as a
person types them (the console script, as a subprocess), and the issue's check on a
running local loop: pause rollout -> no new trajectories; resume -> they flow again;
drain -> the rollout runner exits after finishing its in-flight generations."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import orjson
import pytest

from tapioca.bus import EventProducer, Role, TopicReader, read_events
from tapioca.bus.fleet import read_fleet, send_command
from tapioca.config.schema import (
    DatasetConfig,
    GenerationConfig,
    ModelConfig,
    RolloutConfig,
    TrainConfig,
)
from tapioca.runtime.builders import build_role
from tapioca.runtime.run import create_tiny_checkpoint
from tapioca.schemas import (
    FleetEvent,
    ProgressEvent,
    PromptEvent,
    RewardEvent,
    SampleEvent,
    SampleSequence,
    TrajectoryEvent,
    WeightsEvent,
)

pytestmark = pytest.mark.integration

TAPIOCA = str(Path(sys.executable).parent / "tapioca")


@pytest.fixture
def cfg(make_cfg):
    return make_cfg(fleet_heartbeat_interval_s=0.5, handler_backoff_s=0.01)


@pytest.fixture
def cli(cfg, tmp_path):
    """``cli(*args) -> CompletedProcess`` against this test's broker and topic prefix."""
    env = {**os.environ, "TAPIOCA_HOME": str(tmp_path / "home"), "COLUMNS": "120"}
    env.pop("TAPIOCA_BOOTSTRAP", None)

    def run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run([TAPIOCA, "--bootstrap-server", cfg.bootstrap_servers,
                               "--prefix", cfg.topic_prefix, *args],
                              env=env, capture_output=True, text=True, timeout=timeout)
    return run


def ok_json(proc: subprocess.CompletedProcess):
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr
    return orjson.loads(proc.stdout)


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode != 0, proc.stdout
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def publish(cfg, *events) -> None:
    with EventProducer(cfg, "test") as producer:
        for e in events:
            producer.publish(e)


def prompt(gid: str, i: int = 0) -> PromptEvent:
    return PromptEvent(group_id=gid, prompt_id=f"p-{gid}", group_index=i, n_samples=1,
                       prompt_ids=[1, 2])


def heartbeats(cfg, member_id: str) -> list[FleetEvent]:
    return [e for e in read_events(cfg, "fleet", idle_s=0.2)
            if isinstance(e, FleetEvent) and e.member_id == member_id]


class Worker(Role):
    """Each prompt is 'in flight' for ``work_s`` and then answered with a reward event
    (on a tick); ``drained`` once nothing is in flight. Counts its ticks and pauses."""

    name = "fleetworker"
    group_inputs = ("prompts",)

    def __init__(self, work_s: float = 0.0) -> None:
        self.work_s = work_s

    def init_state(self):
        return {"inflight": {}, "done": [], "ticks": 0, "pauses": [], "drain_started": False}

    def handle(self, event, state, source):
        state["inflight"][event.group_id] = time.monotonic() + self.work_s
        return ()

    def on_tick(self, state, now):
        state["ticks"] += 1
        ready = [g for g, t in state["inflight"].items() if time.monotonic() >= t]
        for g in ready:
            del state["inflight"][g]
            state["done"].append(g)
        return [RewardEvent(traj_id=f"{g}:0", group_id=g, reward=1.0) for g in ready]

    def on_pause(self, state, paused):
        state["pauses"].append(paused)

    def on_drain(self, state):
        state["drain_started"] = True
        return ()

    def drained(self, state):
        return not state["inflight"]

    def describe(self, state):
        return {"inflight": len(state["inflight"]), "version": 3}


def test_pause_resume_drain_of_a_runner(cfg, cli, start_runner, wait_until):
    rt = start_runner(Worker(work_s=1.5), cfg, member_id="fleetworker-0", max_seconds=90)
    member = "fleetworker-0"
    wait_until(lambda: any(e.status == "running" for e in heartbeats(cfg, member)),
               what="a running heartbeat")
    publish(cfg, prompt("g-before"))
    wait_until(lambda: rt.state is not None and "g-before" in rt.state["done"],
               what="the first prompt handled")

    # `tapioca status -o json` lists the live member with its numbers.
    rows = {r["member_id"]: r for r in ok_json(cli("status", "-o", "json"))}
    me = rows[member]
    assert me["role"] == "fleetworker" and me["live"] and not me["stale"]
    assert me["status"] == "running" and me["policy_version"] == 3 and me["pid"] == os.getpid()
    assert {"in_per_s", "out_per_s"} <= set(me["rates"]) and me["dead_lettered"] == 0
    table = cli("status")
    assert table.returncode == 0 and member in table.stdout and "running" in table.stdout

    # An unknown target is an error before anything is sent, naming what is alive.
    err = one_line_error(cli("pause", "no-such-role"))
    assert "no-such-role" in err and "fleetworker" in err and member in err

    report = ok_json(cli("pause", "fleetworker", "-o", "json"))
    assert [(a["member_id"], a["ok"]) for a in report["acks"]] == [(member, True)]
    assert rt.state["pauses"] == [True]
    ticks = rt.state["ticks"]
    publish(cfg, prompt("g-paused"))
    time.sleep(2.0)
    assert "g-paused" not in rt.state["inflight"] and "g-paused" not in rt.state["done"]
    assert rt.state["ticks"] == ticks, "a paused role was ticked"
    assert heartbeats(cfg, member)[-1].status == "paused"
    again = cli("pause", member)
    assert again.returncode == 0 and "already paused" in again.stdout

    ok_json(cli("resume", "all", "-o", "json"))
    wait_until(lambda: "g-paused" in rt.state["done"], what="the prompt sent while paused")

    # Drain with work in flight: the runner finishes it, then exits by itself.
    publish(cfg, prompt("g-inflight"))
    wait_until(lambda: "g-inflight" in rt.state["inflight"], what="work in flight")
    _cmd, acks = send_command(cfg, "drain", member, [member], timeout_s=10)
    assert acks[member].ok and acks[member].message == "draining"
    publish(cfg, prompt("g-after-drain"))
    rt.thread.join(20)
    assert not rt.thread.is_alive(), "the drained runner did not exit"
    assert rt.error is None
    assert rt.state["drain_started"] and "g-inflight" in rt.state["done"]
    assert "g-after-drain" not in rt.state["done"] + list(rt.state["inflight"])
    rewards = {e.group_id for e in read_events(cfg, "rewards", idle_s=0.2)}
    assert rewards == {"g-before", "g-paused", "g-inflight"}
    assert heartbeats(cfg, member)[-1].status == "stopped"
    # Nothing for it is live now: a command to it is an error.
    assert "not live" in one_line_error(cli("resume", member))

    # What it did not handle was left uncommitted: another member of the same consumer
    # group picks it up from the committed offset.
    rt2 = start_runner(Worker(), cfg, member_id="fleetworker-1", max_seconds=90)
    # state is None until the runner's thread has started it.
    wait_until(lambda: rt2.state is not None and "g-after-drain" in rt2.state["done"],
               timeout_s=45,
               what="the input the drained member left, handled by a second member")
    assert rt2.state["done"] == ["g-after-drain"], "a committed input was handled again"


def test_unacknowledged_role_command_and_refusal(cfg, cli, start_runner, wait_until):
    start_runner(Worker(), cfg, member_id="fleetworker-9", max_seconds=60)
    wait_until(lambda: heartbeats(cfg, "fleetworker-9"), what="a heartbeat")
    # A command the role does not handle is acknowledged with ok=False: the CLI fails.
    _cmd, acks = send_command(cfg, "frobnicate", "fleetworker", ["fleetworker-9"], timeout_s=10)
    assert acks["fleetworker-9"].ok is False and "frobnicate" in acks["fleetworker-9"].message
    members = read_fleet(cfg)
    assert [m.event.member_id for m in members if m.live] == ["fleetworker-9"]


# ---------------------------------------------------------------------- dead letters


class Flaky(Role):
    """Fails every prompt whose group id starts with 'bad' until ``fixed``."""

    name = "flaky"
    group_inputs = ("prompts",)
    fixed = False

    def init_state(self):
        return []

    def handle(self, event, state, source):
        if event.group_id.startswith("bad") and not self.fixed:
            raise RuntimeError(f"cannot handle {event.group_id}")
        state.append(event.group_id)
        return ()


def test_dlq_list_show_retry_round_trip(cfg, cli, start_runner, wait_until):
    role = Flaky()
    rt = start_runner(role, cfg, member_id="flaky-0")
    publish(cfg, prompt("ok-1"), prompt("bad-1"))
    wait_until(lambda: rt.runner.stats.dead_lettered == 1 and "ok-1" in rt.state,
               what="one dead letter")
    wait_until(lambda: any(e.detail.get("dead_lettered") == 1 for e in heartbeats(cfg, "flaky-0")),
               what="the DLQ count in a heartbeat")
    rows = ok_json(cli("dlq", "list", "-o", "json"))
    (row,) = rows
    assert row["source_topic"] == f"{cfg.topic_prefix}.prompts.v1"
    assert row["error_type"] == "RuntimeError" and "bad-1" in row["error"]
    assert row["consumer_group"] == f"{cfg.topic_prefix}.flaky" and row["attempts"] == 3
    assert ok_json(cli("dlq", "list", "--source", "trajectories", "-o", "json")) == []
    table = cli("dlq", "list")
    assert table.returncode == 0 and "RuntimeError" in table.stdout
    shown = cli("dlq", "show", str(row["offset"]))
    assert shown.returncode == 0 and "bad-1" in shown.stdout
    shown = ok_json(cli("dlq", "show", str(row["offset"]), "-o", "json"))
    assert shown["payload"]["group_id"] == "bad-1" and shown["payload"]["type"] == "prompt"
    assert "no dead letter at offset 99" in one_line_error(cli("dlq", "show", "99"))

    # A dead letter whose payload was truncated cannot be retried, and says so.
    from tapioca.schemas import DlqRecord

    publish(cfg, DlqRecord(source_topic=f"{cfg.topic_prefix}.prompts.v1", source_partition=0,
                           source_offset=12345, error="too big", error_type="SchemaError",
                           payload_b64="eyJh", payload_truncated=True))
    wait_until(lambda: len(ok_json(cli("dlq", "list", "-o", "json"))) == 2,
               what="the truncated dead letter")
    assert "choose what to retry" in cli("dlq", "retry").stderr

    role.fixed = True
    retried = ok_json(cli("dlq", "retry", "--offset", str(row["offset"]), "-o", "json"))
    assert retried == [{"offset": row["offset"], "source_topic": row["source_topic"],
                        "source_offset": row["source_offset"], "retried_before": False,
                        "retried": True, "reason": "republished"}]
    wait_until(lambda: "bad-1" in rt.state, what="the retried event handled")
    # Retrying again republishes again, with a warning naming the letter retried before.
    again = cli("dlq", "retry", "--source", "prompts")
    assert again.returncode != 0 and "Traceback" not in again.stderr
    warning, err = again.stderr.strip().splitlines()
    assert warning.startswith("warning: ") and f"[{row['offset']}]" in warning
    assert "retried before" in warning
    assert err.startswith("error: ") and "truncated" in err and "12345" in err
    assert rt.state.count("bad-1") >= 1 and rt.runner.stats.dead_lettered == 1


def test_dlq_retry_republishes_a_record_once_however_many_groups_dead_lettered_it(
        cfg, cli, start_runner, wait_until):
    """Issue 29: two consumer groups dead-lettered the same prompt (two letters with the
    same source topic, partition and offset), and `dlq retry --source prompts`
    republished it twice. Now once, for the first letter; the other says whose
    duplicate it is, and is no failure (exit 0)."""
    roles = [Flaky(), Flaky()]
    runners = [start_runner(role, cfg, member_id=f"flaky-{i}", group_id=f"{cfg.topic_prefix}.g{i}")
               for i, role in enumerate(roles)]
    publish(cfg, prompt("bad-2"))
    wait_until(lambda: all(rt.runner.stats.dead_lettered == 1 for rt in runners),
               what="each group's dead letter")
    letters = ok_json(cli("dlq", "list", "-o", "json"))
    assert len(letters) == 2 and len({d["consumer_group"] for d in letters}) == 2
    assert len({(d["source_topic"], d["source_partition"], d["source_offset"])
                for d in letters}) == 1
    for role in roles:
        role.fixed = True
    first, second = sorted(d["offset"] for d in letters)
    rows = ok_json(cli("dlq", "retry", "--source", "prompts", "-o", "json"))
    assert [(r["offset"], r["retried"], r.get("duplicate_of")) for r in rows] == [
        (first, True, None), (second, False, first)]
    wait_until(lambda: all("bad-2" in rt.state for rt in runners),
               what="the republished prompt handled by both groups")
    with TopicReader(cfg, "prompts") as reader:
        records = list(reader.records(idle_s=0.5))
    retried = [r for r in records if any(k == "tapioca.retry_of" for k, _ in r.headers)]
    assert len(records) == 2 and len(retried) == 1
    assert [rt.state.count("bad-2") for rt in runners] == [1, 1]


# ---------------------------------------------------------------------- weights


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> str:
    return str(create_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model"))


def train_cfg(bus, model_path: str, run_dir: Path, *, prompts_per_step: int = 1,
              n_samples: int = 2, steps: int = 1000) -> TrainConfig:
    return TrainConfig(
        run_dir=str(run_dir), bus=bus, model=ModelConfig(path=model_path),
        train_dataset=DatasetConfig(prompts_per_step=prompts_per_step),
        gconfig=GenerationConfig(n_samples=n_samples, max_new_tokens=3),
        rollout=RolloutConfig(max_head_offpolicyness=1), total_train_steps=steps,
    )


def sample(gid: str, version: int = 0) -> SampleEvent:
    seqs = [SampleSequence(traj_id=f"{gid}:{i}", output_ids=[5, 6], behav_logprobs=[-3.0, -3.0],
                           output_versions=[version] * 2, reward=float(i),
                           advantage=2.0 * i - 1.0) for i in range(2)]
    return SampleEvent(group_id=gid, prompt_id=f"p-{gid}", prompt_ids=[3, 4, 5], sequences=seqs,
                       min_version=version, max_version=version)


def test_weights_list_and_rollback_on_a_trainer(cfg, cli, tiny_ckpt, tmp_path, start_runner,
                                                wait_until):
    tcfg = train_cfg(cfg, tiny_ckpt, tmp_path / "run")
    start_runner(build_role("trainer", tcfg), cfg, member_id="trainer-0", max_seconds=90)

    def versions() -> dict[int, WeightsEvent]:
        return {e.version: e for e in read_events(cfg, "weights", idle_s=0.2)}

    def progress() -> dict[int, ProgressEvent]:
        return {e.version: e for e in read_events(cfg, "progress", idle_s=0.2)}

    publish(cfg, sample("ga"), sample("gb"))
    wait_until(lambda: 2 in versions(), timeout_s=40, what="versions 0..2")
    listed = ok_json(cli("weights", "list", "-o", "json"))
    assert [r["version"] for r in listed] == [0, 1, 2]
    assert all(r["on_disk"] and r["rollback_of"] is None and len(r["sha256"]) == 64 for r in listed)
    v1 = versions()[1]
    assert listed[1]["path"] == v1.path and listed[1]["sha256"] == v1.sha256

    report = ok_json(cli("weights", "rollback", "1", "-o", "json"))
    assert report["acks"][0]["ok"], report
    assert "version 3" in report["acks"][0]["message"]
    v3 = versions()[3]
    wait_until(lambda: 3 in progress(), timeout_s=20, what="progress of version 3")
    assert v3.rollback_of == 1 and progress()[3].group_ids == []
    # The same tensors as version 1, so the same bytes and checksum.
    assert v3.sha256 == v1.sha256 and Path(v3.path).name == "v000003.safetensors"
    listed = ok_json(cli("weights", "list", "-o", "json"))
    assert [(r["version"], r["rollback_of"]) for r in listed][-1] == (3, 1)
    table = cli("weights", "list")
    assert table.returncode == 0 and "v000003.safetensors" in table.stdout, table.stdout
    # ... and checkpointed (the trainer's run directory holds weights/ and checkpoints/).
    assert (Path(v3.path).parent.parent / "checkpoints" / "trainer.safetensors").exists()

    # Training goes on from the rolled-back weights as version 4 (staleness counts from 3).
    publish(cfg, sample("gc", version=3))
    wait_until(lambda: 4 in versions() and 4 in progress(), timeout_s=40,
               what="version 4 after the rollback")
    assert progress()[4].group_ids == ["gc"]
    # The gate counts trained steps: every version from the rollback on says it had one.
    assert [progress()[v].rollbacks for v in range(5)] == [0, 0, 0, 1, 1]

    # Weights files older than weights.keep_versions are deleted: rollback says so.
    Path(versions()[0].path).unlink()
    err = one_line_error(cli("weights", "rollback", "0"))
    assert "gone" in err and "weights.keep_versions" in err
    assert "no version 77" in one_line_error(cli("weights", "rollback", "77"))


# ---------------------------------------------------------------------- the loop


def test_fleet_control_on_a_running_loop(cfg, cli, tiny_ckpt, tmp_path, start_runner,
                                         wait_until, one_torch_thread):
    # A step budget the test cannot reach: on an idle 2-core box this loop trains ~8
    # steps a second (328 versions in a 40 s run), so a budget of 1,000 ended the
    # trainer cleanly mid-test on a fast CI machine ("trainer stopped", no error).
    tcfg = train_cfg(cfg, tiny_ckpt, tmp_path / "run", prompts_per_step=2, n_samples=2,
                     steps=10**9)
    runners = {name: start_runner(build_role(name, tcfg), cfg, member_id=f"{name}-0",
                                  max_seconds=300)
               for name in ("trainer", "advantage", "reward", "feeder", "rollout")}
    trajs = TopicReader(cfg, "trajectories")
    seen: list[TrajectoryEvent] = []

    def poll() -> list[TrajectoryEvent]:
        seen.extend(r.event for r in trajs.records(idle_s=0.1, timeout_s=3)
                    if isinstance(r.event, TrajectoryEvent))
        return seen

    try:
        wait_until(lambda: len(poll()) >= 8, timeout_s=60, what="trajectories flowing")
        status = {r["member_id"]: r for r in ok_json(cli("status", "-o", "json"))}
        assert {f"{n}-0" for n in runners} <= {m for m, r in status.items() if r["live"]}

        report = ok_json(cli("pause", "rollout", "-o", "json"))
        assert [(a["member_id"], a["ok"]) for a in report["acks"]] == [("rollout-0", True)]
        paused_at = report["acks"][0]["acked_at"]
        time.sleep(3.0)
        poll()
        late = [t.traj_id for t in seen if t.produced_at > paused_at]
        assert late == [], f"trajectories made after the pause: {late}"
        count = len(seen)

        ok_json(cli("resume", "rollout-0", "-o", "json"))
        wait_until(lambda: len(poll()) >= count + 4, timeout_s=30,
                   what="trajectories flowing again after resume")

        report = ok_json(cli("drain", "rollout", "-o", "json"))
        assert report["acks"][0]["ok"]
        rollout = runners["rollout"]
        rollout.thread.join(30)
        assert not rollout.thread.is_alive(), "the drained rollout runner did not exit"
        assert rollout.error is None
        assert not any(g.futures for g in rollout.state.inflight.values())
        time.sleep(0.5)
        poll()
        # Its in-flight work was finished: every group it started is complete on the log.
        sizes = Counter(t.group_id for t in seen)
        assert all(n == 2 for n in sizes.values()), sizes
        assert heartbeats(cfg, "rollout-0")[-1].status == "stopped"
        for name, rt in runners.items():
            if name != "rollout":
                assert rt.thread.is_alive(), (
                    f"{name} stopped: {rt.error!r}; finished: {rt.runner.role.finished(rt.state)}")
    finally:
        trajs.close()


# ---------------------------------------------------------------------- the launcher


def test_launcher_warns_when_the_last_member_of_a_role_exits(cfg, tmp_path, capfd):
    """A drained member's clean exit lets the run go on; the last member of a role
    leaving stalls it, and the launcher says so on stderr (the CLI logs only warnings)."""
    from tapioca.ops.launcher import Child, Launcher, RunSummary

    launcher = Launcher(TrainConfig(run_dir=str(tmp_path / "runs"), trial_name="t", bus=cfg))
    launcher.summary = RunSummary(tmp_path)
    log_path = tmp_path / "child.log"
    for role, member, cmd in (("rollout", 0, ["true"]), ("rollout", 1, ["sleep", "1"]),
                              ("trainer", 0, ["sleep", "3"])):
        launcher.children.append(Child(role, member, subprocess.Popen(cmd), log_path))
    summary = launcher.wait(timeout_s=30)
    assert summary.wall_s >= 2.5  # returned when the trainer exited, not before
    err = capfd.readouterr().err
    assert err.count("no rollout member left") == 1, err  # not when rollout-0 exited
    assert "the run cannot progress" in err
    assert f"tapioca role rollout --config {launcher.config_path}" in err


def test_read_fleet_reads_back_far_enough_for_a_quiet_member_of_a_big_fleet(cfg):
    """The tail read grows until it covers the time window: a member whose last
    heartbeat is 100 chatty heartbeats back is still found; one older than the window
    is not."""
    now = time.time()

    def hb(member: str, at: float) -> FleetEvent:
        ev = FleetEvent(member_id=member, role="rollout", detail={"interval_s": 600.0})
        ev.produced_at = at
        return ev

    busy = [hb(f"busy-{i % 10}", now - 100 + i) for i in range(100)]
    publish(cfg, hb("ancient-0", now - 5000), hb("quiet-0", now - 200), *busy[:-1])
    # The last record in a batch of its own: Tansu's high watermark is the last batch's
    # base offset + 1 (docs/kafka-clients.md), so only then does a tail read start at the tail.
    publish(cfg, busy[-1])
    members = {m.event.member_id for m in read_fleet(cfg, tail=8, window_s=900, now=now)}
    assert "quiet-0" in members and "ancient-0" not in members
    assert {f"busy-{i}" for i in range(10)} <= members
    # The first read of 8 records alone misses it: the growth is what finds it.
    from tapioca.bus.fleet import _read_heartbeats

    assert "quiet-0" not in _read_heartbeats(cfg, 8)[0]
    everything = {m.event.member_id for m in read_fleet(cfg, window_s=None, now=now)}
    assert {"quiet-0", "ancient-0"} <= everything


def test_status_keeps_every_number_whole_on_80_columns(cfg, tmp_path):
    """Heartbeats of a busy fleet (big rates, lag, dead letters) as `tapioca status` shows
    them on an 80-column terminal: nothing is cut (a member id that does not name its
    role, as an external service's may, is followed by it)."""
    now = time.time()
    publish(cfg, FleetEvent(member_id="advantage-0", role="advantage", status="running",
                            policy_version=12345, rates={"in_per_s": 12345.6, "out_per_s": 2345.6},
                            lag={"p0": 123000, "p1": 456}, produced_at=now,
                            detail={"interval_s": 600.0, "dead_lettered": 1234, "idle_s": 754.0,
                                    "metrics": {"trainer/staleness_mean": 12.25,
                                                "trainer/staleness_max": 16.0}}),
            FleetEvent(member_id="lenpen-svc-3", role="reward", status="draining",
                       policy_version=7, rates={"in_per_s": 0.5, "out_per_s": 3.25},
                       produced_at=now, detail={"interval_s": 600.0, "idle_s": 4000.0}))
    env = {**os.environ, "TAPIOCA_HOME": str(tmp_path / "home"), "COLUMNS": "80"}
    env.pop("TAPIOCA_BOOTSTRAP", None)
    proc = subprocess.run([TAPIOCA, "status", "--bootstrap-server", cfg.bootstrap_servers,
                           "--prefix", cfg.topic_prefix, "--stall-after", "86400"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    # By hand: 12345.6 -> 12k, 2345.6 -> 2.3k; lag 123000 + 456 = 123456 -> 123k; idle
    # 754 s -> 12m34s, 4000 s -> 1h06m; 0.5 and 3.25 per s -> 0.5/3.2.
    for cell in ("12345", "12k/2.3k", "123k", "12.25/16", "1.2k", "12m34s", "0.5/3.2", "1h06m",
                 "draining", "advantage-0", "lenpen-svc-3", "(reward)"):
        assert cell in text, f"{cell!r} cut or missing at 80 columns:\n{text}"
    assert "…" not in text and max(len(line) for line in text.splitlines()) <= 80, text


def test_weights_list_shows_the_newest_and_those_on_disk_unless_all(cfg, cli, tmp_path):
    """A long run's weights topic: 15 versions published, the files of versions 2 and 3
    still on disk (as if an old rollback target had been kept), the rest deleted."""
    files = {}
    for v in (2, 3):
        files[v] = tmp_path / f"v{v:06d}.safetensors"
        files[v].write_bytes(b"x")
    publish(cfg, *[WeightsEvent(version=v, run_id="long.t0", sha256=f"{v:064x}",
                                path=str(files.get(v, tmp_path / f"v{v:06d}.safetensors")))
                   for v in range(15)])
    default = ok_json(cli("weights", "list", "--last", "3", "-o", "json"))
    # By hand: the newest 3 (12, 13, 14) and the older ones on disk (2, 3).
    assert [r["version"] for r in default] == [2, 3, 12, 13, 14]
    assert [r["version"] for r in ok_json(cli("weights", "list", "-o", "json"))] == \
        [2, 3] + list(range(5, 15))
    assert [r["version"] for r in ok_json(cli("weights", "list", "--all", "-o", "json"))] == \
        list(range(15))
    table = cli("weights", "list", "--last", "3")
    assert table.returncode == 0, table.stderr
    assert "5 of 15 versions" in table.stdout and "--all" in table.stdout, table.stdout
