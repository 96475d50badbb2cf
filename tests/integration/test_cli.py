"""The `tapioca` CLI as a person types it: the installed console script, run as a
subprocess, against a broker it started itself with `tapioca broker up`.

Every command runs with ``TAPIOCA_HOME`` set to a temporary directory (so the broker
state file never touches ``~/.tapioca``) and ``TAPIOCA_BOOTSTRAP`` unset (so the CLI
finds the broker through that state file, as a user's would). Events are published
from the test process with the bus's own producer, then read back through the CLI.
"""

from __future__ import annotations

import gc
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import orjson
import pytest

from tapioca.bus import BusConfig, EventProducer, Role, RoleRunner, find_tansu, free_port
from tapioca.schemas import TOPICS, PromptEvent
from tapioca.schemas.errors import BusError

pytestmark = pytest.mark.integration

REGISTRY_TOPICS = {f"tapioca.{spec.name}.v{spec.version}" for spec in TOPICS}


def _tapioca_exe() -> str:
    # The script installed next to this interpreter is the one of the package under test.
    beside = Path(sys.executable).parent / "tapioca"
    if beside.exists():
        return str(beside)
    found = shutil.which("tapioca")
    if found is None:
        pytest.skip("the `tapioca` console script is not installed (pip install -e .)")
    return found


TAPIOCA = _tapioca_exe()


def _env(home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["TAPIOCA_HOME"] = str(home)
    env.pop("TAPIOCA_BOOTSTRAP", None)
    return env


def cli(env: dict[str, str], *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([TAPIOCA, *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def ok(env: dict[str, str], *args: str) -> str:
    """Run a command that must succeed; returns its stdout."""
    proc = cli(env, *args)
    assert proc.returncode == 0, (
        f"`tapioca {' '.join(args)}` exited {proc.returncode}\n"
        f"stdout: {proc.stdout}\nstderr: {proc.stderr}")
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stdout


def json_lines(stdout: str) -> list[dict]:
    return [orjson.loads(line) for line in stdout.splitlines() if line.strip()]


def assert_one_line_error(proc: subprocess.CompletedProcess, what: str) -> None:
    assert proc.returncode != 0, f"{what}: expected a failure, got exit 0\n{proc.stdout}"
    assert "Traceback" not in proc.stderr, f"{what}: stack trace on stderr\n{proc.stderr}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), (
        f"{what}: expected one `error: ...` line on stderr, got {proc.stderr!r}")


# ---------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tapioca_home")


@pytest.fixture(scope="module")
def env(home) -> dict[str, str]:
    return _env(home)


@pytest.fixture(scope="module")
def bootstrap(env) -> str:
    """`tapioca broker up --port <free>`; `tapioca broker down` afterwards."""
    try:
        find_tansu()
    except BusError as exc:
        pytest.skip(f"no embedded broker available: {exc}")
    port = free_port()
    state = orjson.loads(ok(env, "broker", "up", "--port", str(port), "-o", "json"))
    assert state["bootstrap"] == f"127.0.0.1:{port}"
    try:
        yield state["bootstrap"]
    finally:
        # Tansu's SIGTERM waits ~5 s for open client connections; EventProducer keeps its
        # librdkafka client (and connection) in a reference cycle until a GC pass.
        gc.collect()
        down = cli(env, "broker", "down")
        assert down.returncode == 0, down.stderr


@pytest.fixture(scope="module")
def created(env, bootstrap) -> list[str]:
    """The first `tapioca topics create` of the module: the topics it created."""
    return orjson.loads(ok(env, "topics", "create", "-o", "json"))["created"]


@pytest.fixture(scope="module")
def published(bootstrap, created) -> list[str]:
    """Group ids of the prompt events on tapioca.prompts.v1, in publish order (tests
    that publish more append here). Each is flushed and a few ms apart, so their Kafka
    timestamps order them across partitions."""
    cfg = BusConfig(bootstrap_servers=bootstrap)
    ids = []
    with EventProducer(cfg, "test-cli") as producer:
        for i in range(5):
            gid = f"cli-g{i}-{uuid.uuid4().hex[:6]}"
            producer.publish(PromptEvent(group_id=gid, prompt_id=f"p{i}", group_index=i,
                                         n_samples=2, prompt_ids=[1, 2, 3 + i]))
            producer.flush()
            ids.append(gid)
            time.sleep(0.01)
    return ids


# ---------------------------------------------------------------------- broker / topics


def test_broker_status_running(env, bootstrap):
    assert "running at" in ok(env, "broker", "status")
    status = orjson.loads(ok(env, "broker", "status", "-o", "json"))
    assert status["running"] is True
    assert status["answering"] is True
    assert status["bootstrap"] == bootstrap


def test_broker_up_is_idempotent_on_the_same_port(env, bootstrap):
    port = bootstrap.rsplit(":", 1)[1]
    assert "already up at" in ok(env, "broker", "up", "--port", port)
    again = orjson.loads(ok(env, "broker", "up", "--port", port, "-o", "json"))
    assert again["bootstrap"] == bootstrap and again["already_running"] is True
    other = cli(env, "broker", "up", "--port", str(free_port()))  # another broker: refused
    assert other.returncode != 0 and "already running at" in other.stderr


def test_topics_create_is_idempotent(env, created):
    assert set(created) == REGISTRY_TOPICS
    assert "already exist" in ok(env, "topics", "create")
    assert orjson.loads(ok(env, "topics", "create", "-o", "json")) == {"created": []}


def test_topics_list_has_every_registry_topic(env, created):
    listed = {t["name"]: t["partitions"] for t in orjson.loads(ok(env, "topics", "list",
                                                                   "-o", "json"))}
    assert REGISTRY_TOPICS <= set(listed)
    for spec in TOPICS:
        assert listed[f"tapioca.{spec.name}.v{spec.version}"] == spec.partitions


def test_topics_describe(env, created):
    info = orjson.loads(ok(env, "topics", "describe", "prompts", "-o", "json"))
    assert info["name"] == "tapioca.prompts.v1"
    assert [p["partition"] for p in info["partitions"]] == [0, 1, 2, 3]
    for p in info["partitions"]:
        assert {"low", "high", "leader"} <= set(p)
    assert "tapioca.prompts.v1" in ok(env, "topics", "describe", "prompts")


# ---------------------------------------------------------------------- tail


def test_tail_json_prints_the_latest_events_decoded(env, published):
    lines = json_lines(ok(env, "tail", "tapioca.prompts.v1", "-n", "2", "-o", "json"))
    assert len(lines) == 2
    for line in lines:
        assert line["type"] == "prompt"
        assert line["_topic"] == "tapioca.prompts.v1"
        assert line["_key"] == line["group_id"]
        assert line["producer_id"] == "test-cli"
    assert [line["group_id"] for line in lines] == published[-2:]


def test_tail_table_shows_group_ids(env, published):
    out = ok(env, "tail", "prompts", "-n", "5")
    assert "tapioca.prompts.v1" in out
    for gid in published[-5:]:
        assert gid in out


def test_tail_follow_prints_new_events(env, bootstrap, published):
    proc = subprocess.Popen([TAPIOCA, "tail", "prompts", "-n", "1", "-f", "-o", "json"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    lines: queue.Queue[str] = queue.Queue()
    pump = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout],
                            daemon=True)
    pump.start()

    def next_line(timeout_s: float) -> dict:
        try:
            return orjson.loads(lines.get(timeout=timeout_s))
        except queue.Empty:
            raise AssertionError(f"`tail -f` printed nothing within {timeout_s} s") from None

    try:
        # The backlog line means the reader is assigned: whatever comes next is new.
        assert next_line(15)["group_id"] == published[-1]
        gid = f"cli-follow-{uuid.uuid4().hex[:6]}"
        with EventProducer(BusConfig(bootstrap_servers=bootstrap), "test-cli") as producer:
            producer.publish(PromptEvent(group_id=gid, prompt_id="pf", group_index=99,
                                         n_samples=1, prompt_ids=[7]))
        published.append(gid)
        event = next_line(5)
        assert event["group_id"] == gid and event["type"] == "prompt"
    finally:
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        try:
            rc = proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
            raise AssertionError("`tail -f` did not exit within 10 s of SIGINT")
        stderr = proc.stderr.read()
        proc.stdout.close()
        proc.stderr.close()
    assert rc == 0, stderr
    assert "Traceback" not in stderr, stderr


# ---------------------------------------------------------------------- lag


class _Drain(Role):
    """Consumes prompts and does nothing: a consumer group with committed offsets."""

    name = f"cli-lag-{uuid.uuid4().hex[:6]}"
    group_inputs = ("prompts",)

    def init_state(self):
        return None

    def handle(self, event, state, source):
        return ()


def test_lag_lists_a_committed_group(env, bootstrap, published):
    runner = RoleRunner(_Drain(), BusConfig(bootstrap_servers=bootstrap))
    thread = threading.Thread(target=runner.run, kwargs={"max_seconds": 30}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while runner.stats.consumed < len(published) or runner.stats.commits < 1:
        assert thread.is_alive() and time.monotonic() < deadline, (
            f"role consumed {runner.stats.consumed}/{len(published)}, "
            f"commits {runner.stats.commits}")
        time.sleep(0.05)
    runner.stop()
    thread.join(15)
    assert not thread.is_alive()

    rows = [r for r in orjson.loads(ok(env, "lag", "-o", "json"))
            if r["group"] == runner.group_id]
    assert rows, f"group {runner.group_id} missing from `tapioca lag`"
    assert {r["topic"] for r in rows} == {"tapioca.prompts.v1"}
    # Committed offsets are exact on Tansu (only the end offsets are approximate).
    assert sum(r["committed"] or 0 for r in rows) == runner.stats.consumed
    only = orjson.loads(ok(env, "lag", "-g", runner.group_id, "-o", "json"))
    assert {r["group"] for r in only} == {runner.group_id}
    assert "approximate" in ok(env, "lag", "-g", runner.group_id)


# ---------------------------------------------------------------------- errors


def test_unreachable_broker_is_a_one_line_error(env):
    # Each waits out the 5 s reachability check; run them side by side.
    commands = [("topics", "list"), ("topics", "describe", "prompts"), ("tail", "prompts"),
                ("lag",)]
    procs = [(c, subprocess.Popen([TAPIOCA, "--bootstrap-server", "127.0.0.1:1", *c],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True)) for c in commands]
    for c, proc in procs:
        out, err = proc.communicate(timeout=30)
        assert_one_line_error(subprocess.CompletedProcess(proc.args, proc.returncode, out, err),
                              " ".join(c))


def test_tail_of_a_missing_topic_is_a_one_line_error(env, created):
    proc = cli(env, "tail", "no.such.topic.v1")
    assert_one_line_error(proc, "tail no.such.topic.v1")
    assert "no.such.topic.v1" in proc.stderr


def test_schemas_check(env):
    assert "compatible" in ok(env, "schemas", "check")


def test_broker_status_after_down(tmp_path):
    """A second broker of its own, so stopping it leaves the module's broker alone."""
    env = _env(tmp_path)
    ok(env, "broker", "up", "--port", str(free_port()))
    ok(env, "broker", "status")
    assert "stopped" in ok(env, "broker", "down")
    proc = cli(env, "broker", "status")
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    assert orjson.loads(cli(env, "broker", "status", "-o", "json").stdout) == {"running": False}


# `tapioca train` of the demo config, a step or two: without the evaluator (nothing here
# reads a held-out score, and it is one process fewer to start), with fast group joins.
TRAIN_SHRINK = ("train_dataset.prompts_per_step=2", "gconfig.n_samples=2", "evaluator.eval_before_train=false",
                "evaluator.freq_steps=null")


def test_train_uses_the_broker_of_broker_up_so_tail_and_lag_see_the_run(tmp_path, fast_join):
    """The command block of docs/cli.md as written: `broker up`, `topics create`, `train`,
    then `tail` and `lag` with no flags. `train` runs on that broker (before: a private one of its own, so
    `tail` showed nothing; issue 29, item 10). A broker of its own, as above."""
    env = _env(tmp_path / "home")
    examples = Path(__file__).resolve().parents[2] / "examples"
    ok(env, "broker", "up", "--port", str(free_port()))
    try:
        ok(env, "topics", "create")
        train = cli(env, "train", "--config", str(examples / "demo_cpu.yaml"),
                    f"run_dir={tmp_path / 'runs'}", "trial_name=cli", "total_train_steps=1",
                    *TRAIN_SHRINK, *fast_join, timeout=300)
        assert train.returncode == 0, train.stderr
        events = json_lines(ok(env, "tail", "tapioca.trajectories.v1", "-n", "1", "-o", "json"))
        assert [e["run_id"] for e in events] == ["demo.cli"]
        groups = {r["group"] for r in orjson.loads(ok(env, "lag", "-o", "json"))}
        assert any("trainer" in g for g in groups), groups
        assert "using the broker of `tapioca broker up`" in train.stdout
    finally:
        gc.collect()
        cli(env, "broker", "down")


def test_train_resume_continues_a_trial_whose_own_broker_is_gone(tmp_path, fast_join):
    """`tapioca train --resume RUN_DIR`: the run's own config.yaml (which names the first
    run's embedded broker, stopped with it), from its checkpoint, further than it went;
    `tapioca runs` then shows it finished at the new total (issue 29, item 12)."""
    env = _env(tmp_path / "home")  # no `broker up`: each run starts its own broker
    examples = Path(__file__).resolve().parents[2] / "examples"
    first = cli(env, "train", "--config", str(examples / "demo_cpu.yaml"),
                f"run_dir={tmp_path / 'runs'}", "trial_name=r", "total_train_steps=1",
                *TRAIN_SHRINK, *fast_join, timeout=300)
    assert first.returncode == 0, first.stderr
    run = tmp_path / "runs" / "demo" / "r"
    again = cli(env, "train", "--resume", str(run), "total_train_steps=2", timeout=300)
    assert again.returncode == 0, again.stderr
    assert "resuming trial r from step 1" in again.stdout
    # This invocation's steps, then where the trial stands (issue 38: not "2 steps")
    assert re.search(r"done: 1 step trained in \d+ s \(2 of 2 in all\)", again.stdout), again.stdout
    steps = [orjson.loads(line)["step"] for line in
             (run / "metrics" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # step 1 not trained again
    (row,) = orjson.loads(ok(env, "runs", str(tmp_path / "runs"), "-o", "json"))
    assert (row["state"], row["step"], row["total_steps"], row["final"]) == \
        ("finished", 2, 2, True)
    refused = cli(env, "train", "--resume", str(tmp_path / "runs" / "demo" / "nope"))
    assert_one_line_error(refused, "train --resume of a missing run")
    assert "tapioca runs" in refused.stderr
