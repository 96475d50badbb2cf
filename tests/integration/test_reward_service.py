"""A run whose only reward comes from a separate process: the example reward service
(examples/reward_service/service.py, plain confluent-kafka + the exported JSON Schemas),
started with plain python, next to the feeder, rollout and advantage roles of a run
configured with ``reward.scorer: none``, against the real embedded broker; and the same
contract for both example clients (service.py and service_kafka_python.py), each
feeding Tapioca's advantage processor from trajectories published directly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import orjson
import pytest

from tapioca.bus import (
    BusConfig,
    EventProducer,
    RoleRunner,
    TopicReader,
    consumer_lag,
    ensure_topics,
)
from tapioca.bus.dlq import original_payload
from tapioca.config.schema import (
    AdvantageConfig,
    ArchiveConfig,
    DatasetConfig,
    GenerationConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
)
from tapioca.ops.launcher import role_counts
from tapioca.runtime.builders import build_role
from tapioca.runtime.run import create_tiny_checkpoint
from tapioca.schemas import DlqRecord, RewardEvent, SampleEvent, TrajectoryEvent, topic
from tapioca.schemas.errors import ConfigError

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SERVICE_DIR = ROOT / "examples" / "reward_service"
SERVICE = SERVICE_DIR / "service.py"
SERVICES = {"confluent-kafka": SERVICE, "kafka-python": SERVICE_DIR / "service_kafka_python.py"}
SCORER = "length_penalty"
BUDGET = 4  # outputs are 1..3 tokens: rewards 0.75, 0.5, 0.25
WEIGHT = 2.0
GROUPS = 4


def test_service_uses_no_tapioca_code():
    for path in SERVICE_DIR.glob("*.py"):
        src = path.read_text()
        assert "import tapioca" not in src and "from tapioca" not in src, path
    assert "from jsonschema import" in (SERVICE_DIR / "reward_core.py").read_text()
    assert "from confluent_kafka import" in SERVICE.read_text()
    assert "from kafka import" in SERVICES["kafka-python"].read_text()


def test_scorer_none_runs_no_builtin_scorer_and_archive_adds_the_archiver():
    cfg = TrainConfig(reward=RewardConfig(scorer="none"), archive=ArchiveConfig(enabled=True))
    roles = dict(role_counts(cfg))
    assert "reward" not in roles and roles["archiver"] == 1
    assert "archiver" not in dict(role_counts(TrainConfig()))
    with pytest.raises(ConfigError, match="external service"):
        build_role("reward", cfg)


def _records(cfg: BusConfig, name: str) -> list:
    with TopicReader(cfg, name) as reader:
        return [r for r in reader.records(idle_s=0.5, timeout_s=30)]


def _service_dead_letters(cfg: BusConfig) -> list:
    group = f"{cfg.topic_prefix}.reward-service.{SCORER}.ext.run"  # the run's own group
    return [r.event for r in _records(cfg, "dlq")
            if r.event is not None and r.event.consumer_group == group]


def _wait(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def test_a_run_whose_only_reward_is_the_external_service(broker, tmp_path, one_torch_thread):
    bus = BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:12]}",
                    run_id="ext.run")
    ensure_topics(bus)
    cfg = TrainConfig(
        experiment_name="ext", trial_name="run", run_dir=str(tmp_path / "runs"), bus=bus,
        model=ModelConfig(path=str(create_tiny_checkpoint(tmp_path / "model"))),
        train_dataset=DatasetConfig(prompts_per_step=2),
        gconfig=GenerationConfig(n_samples=2, max_new_tokens=3),
        rollout=RolloutConfig(max_head_offpolicyness=1),
        reward=RewardConfig(scorer="none"),
        # The external source, weighted: a sample's reward is 2 x the service's.
        advantage=AdvantageConfig(reward_weights={SCORER: WEIGHT}))
    assert [r for r, _ in role_counts(cfg)] == ["trainer", "advantage", "rollout", "feeder"]

    env = {k: v for k, v in os.environ.items() if not k.startswith("TAPIOCA")}
    log_path = tmp_path / "service.log"
    with open(log_path, "wb") as log:
        service = subprocess.Popen(
            [sys.executable, str(SERVICE), "--bootstrap-server", broker.bootstrap,
             "--prefix", bus.topic_prefix, "--scorer", SCORER, "--budget-tokens", str(BUDGET),
             "--run-id", "ext.run"],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    runners = [RoleRunner(build_role(name, cfg), bus, member_id=f"{name}-0")
               for name in ("advantage", "rollout", "feeder")]
    errors: list[BaseException] = []

    def go(r: RoleRunner) -> None:
        try:
            r.run(max_seconds=240)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=go, args=(r,), daemon=True) for r in runners]
    for t in threads:
        t.start()
    try:
        _wait(lambda: len(_records(bus, "samples")) >= GROUPS or errors
              or service.poll() is not None, 180, f"{GROUPS} samples")
        assert service.poll() is None, log_path.read_text()
        assert not errors, errors

        # Bad input and a redelivery, as a producer bug or a crash would cause them.
        traj_topic = bus.topic(topic("trajectories"))
        first_traj = _records(bus, "trajectories")[0].event
        with EventProducer(bus, "test") as producer:
            producer.publish_raw(traj_topic, b"g-bad", b"{not json")
            producer.publish_raw(traj_topic, b"g-bad", orjson.dumps(
                {"type": "trajectory", "event_id": "x", "schema_version": 1,
                 "traj_id": "t-bad"}))  # valid JSON, missing required fields
            again = TrajectoryEvent(**{**first_traj.__dict__, "event_id": uuid.uuid4().hex})
            producer.publish(again)
        _wait(lambda: len(_service_dead_letters(bus)) >= 2, 60, "the service's dead letters")
        time.sleep(1.5)  # give a (wrong) second reward for the redelivery time to appear
    finally:
        for r in runners:
            r.stop()
        for t in threads:
            t.join(30)
        service.send_signal(signal.SIGTERM)
        try:
            service.wait(20)
        except subprocess.TimeoutExpired:
            service.kill()
            service.wait(5)
    assert not errors, errors
    assert service.returncode == 0, log_path.read_text()

    trajectories = {r.event.traj_id: r for r in _records(bus, "trajectories")
                    if r.event is not None}
    rewards = [r for r in _records(bus, "rewards")]
    # Every reward on rewards.v1 is the service's, valid for Tapioca's own decoder,
    # one per trajectory (the redelivered one was not scored twice).
    assert all(isinstance(r.event, RewardEvent) for r in rewards)
    assert {r.event.scorer for r in rewards} == {SCORER}
    assert sorted(r.event.traj_id for r in rewards) == sorted(trajectories)
    assert len(rewards) == 2 * GROUPS
    for r in rewards:
        t = trajectories[r.event.traj_id]
        assert r.event.reward == max(0.0, 1.0 - len(t.event.output_ids) / BUDGET)
        assert r.event.run_id == "ext.run" and r.event.group_id == t.event.group_id
        # Keyed by group_id with murmur2: the trajectory's partition number.
        assert r.source.key == t.event.group_id and r.source.partition == t.source.partition

    samples = [r.event for r in _records(bus, "samples")]
    assert len(samples) == GROUPS and all(isinstance(s, SampleEvent) for s in samples)
    by_traj = {r.event.traj_id: r.event.reward for r in rewards}
    for s in samples:
        assert not s.dropped_reason
        assert [q.reward for q in s.sequences] == [WEIGHT * by_traj[q.traj_id]
                                                   for q in s.sequences]

    # The advantage processor dead-letters the same two records in its own group.
    dead = _service_dead_letters(bus)
    assert len(dead) == 2 and all(isinstance(d, DlqRecord) for d in dead)
    assert {d.error_type for d in dead} == {"JSONDecodeError", "SchemaValidationError"}
    assert b"{not json" in {original_payload(d) for d in dead}
    assert all(d.source_topic == traj_topic and d.source_key == "g-bad" for d in dead)
    # The service's own counts: the redelivered trajectory was seen and skipped.
    counts = orjson.loads(log_path.read_text().split("stopped: ")[-1].splitlines()[0])
    assert counts == {"scored": 2 * GROUPS, "duplicates": 1, "dead_lettered": 2,
                      "other_runs": 0}


@pytest.mark.parametrize("client", sorted(SERVICES))
def test_service_started_before_its_topics_exist_waits_instead_of_crashing(client, broker,
                                                                          tmp_path):
    """Started before `tapioca topics create`: only 'unknown topic' errors arrive, so
    there is no offset to commit; the service keeps waiting (here: until idle) and
    exits cleanly, rather than dying on a commit of nothing."""
    pytest.importorskip("kafka" if client == "kafka-python" else "confluent_kafka")
    proc = subprocess.run(
        [sys.executable, str(SERVICES[client]), "--bootstrap-server", broker.bootstrap,
         "--prefix", f"nosuch{uuid.uuid4().hex[:8]}", "--exit-when-idle-s", "4", "--all-runs"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "stopped:" in proc.stderr + proc.stdout


def _stop_service(service: subprocess.Popen) -> None:
    service.send_signal(signal.SIGTERM)
    try:
        service.wait(30)
    except subprocess.TimeoutExpired:
        service.kill()
        service.wait(5)


@pytest.mark.parametrize("client", sorted(SERVICES))
def test_the_contract_holds_for_both_clients(client, broker, tmp_path):
    """Trajectories published directly (no model), then the client's service and
    Tapioca's advantage processor: one valid reward per trajectory on its group's
    partition, the redelivery skipped, bad input dead-lettered, and samples built from
    the service's rewards. Both services run the same flags and must agree exactly."""
    pytest.importorskip("kafka" if client == "kafka-python" else "confluent_kafka")
    bus = BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:12]}",
                    run_id="ext.run")
    ensure_topics(bus)
    cfg = TrainConfig(experiment_name="ext", trial_name="run", run_dir=str(tmp_path), bus=bus,
                      gconfig=GenerationConfig(n_samples=2), reward=RewardConfig(scorer="none"),
                      advantage=AdvantageConfig(reward_weights={SCORER: WEIGHT}))
    traj_topic = bus.topic(topic("trajectories"))
    with EventProducer(bus, "test") as producer:
        for g in range(GROUPS):
            for i in range(2):
                producer.publish(TrajectoryEvent(
                    traj_id=f"g{g}:{i}", group_id=f"g{g}", prompt_id=f"p{g}", sample_index=i,
                    group_size=2, prompt_ids=[1, 2], output_ids=[5] * (1 + (g + i) % 3),
                    output_logprobs=[-0.5] * (1 + (g + i) % 3),
                    output_versions=[0] * (1 + (g + i) % 3)))
        producer.publish_raw(traj_topic, b"g-bad", b"{not json")
        producer.publish_raw(traj_topic, b"g-bad", orjson.dumps(
            {"type": "trajectory", "event_id": "x", "schema_version": 1, "traj_id": "t-bad"}))
        # A redelivery (same trajectory, new event id) after the original on its partition.
        producer.publish(TrajectoryEvent(
            traj_id="g0:0", group_id="g0", prompt_id="p0", sample_index=0, group_size=2,
            prompt_ids=[1, 2], output_ids=[5], output_logprobs=[-0.5], output_versions=[0]))

    env = {k: v for k, v in os.environ.items() if not k.startswith("TAPIOCA")}
    log_path = tmp_path / "service.log"
    with open(log_path, "wb") as log:
        service = subprocess.Popen(
            [sys.executable, str(SERVICES[client]), "--bootstrap-server", broker.bootstrap,
             "--prefix", bus.topic_prefix, "--scorer", SCORER, "--budget-tokens", str(BUDGET),
             "--run-id", "ext.run"],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    runner = RoleRunner(build_role("advantage", cfg), bus, member_id="advantage-0")
    errors: list[BaseException] = []

    def go() -> None:
        try:
            runner.run(max_seconds=180)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=go, daemon=True)
    thread.start()
    try:
        _wait(lambda: len(_records(bus, "samples")) >= GROUPS or errors
              or service.poll() is not None, 120, f"{GROUPS} samples")
        _wait(lambda: len(_service_dead_letters(bus)) >= 2 or service.poll() is not None,
              60, "the service's dead letters")
        assert service.poll() is None, log_path.read_text()
    finally:
        runner.stop()
        thread.join(30)
        _stop_service(service)
    assert not errors, errors
    assert service.returncode == 0, log_path.read_text()

    trajectories = {r.event.traj_id: r for r in _records(bus, "trajectories")
                    if r.event is not None}
    rewards = _records(bus, "rewards")
    assert all(isinstance(r.event, RewardEvent) for r in rewards)
    assert sorted(r.event.traj_id for r in rewards) == sorted(trajectories)  # one each
    for r in rewards:
        t = trajectories[r.event.traj_id]
        assert r.event.scorer == SCORER and r.event.run_id == "ext.run"
        assert r.event.reward == max(0.0, 1.0 - len(t.event.output_ids) / BUDGET)
        assert r.source.key == t.event.group_id and r.source.partition == t.source.partition
    samples = [r.event for r in _records(bus, "samples")]
    assert len(samples) == GROUPS and not any(s.dropped_reason for s in samples)
    by_traj = {r.event.traj_id: r.event.reward for r in rewards}
    for s in samples:
        assert [q.reward for q in s.sequences] == [WEIGHT * by_traj[q.traj_id]
                                                   for q in s.sequences]
    dead = _service_dead_letters(bus)
    assert {d.error_type for d in dead} == {"JSONDecodeError", "SchemaValidationError"}
    assert all(d.source_topic == traj_topic and d.source_key == "g-bad" for d in dead)
    counts = orjson.loads(log_path.read_text().split("stopped: ")[-1].splitlines()[0])
    assert counts == {"scored": 2 * GROUPS, "duplicates": 1, "dead_lettered": 2,
                      "other_runs": 0}


def test_a_reward_without_run_id_is_dead_lettered_not_dropped(broker, tmp_path):
    """A named run's advantage processor dead-letters a reward that names no run (an
    outside service that forgot to copy the trajectory's run_id), with an error saying
    so; a reward of another run is still skipped and counted as foreign."""
    bus = BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:12]}",
                    run_id="ext.run")
    ensure_topics(bus)
    cfg = TrainConfig(experiment_name="ext", trial_name="run", run_dir=str(tmp_path), bus=bus,
                      gconfig=GenerationConfig(n_samples=2), reward=RewardConfig(scorer="none"))
    rewards_topic = bus.topic(topic("rewards"))
    no_run_id = orjson.dumps({"event_id": "r-no-run", "type": "reward", "schema_version": 1,
                              "traj_id": "g0:0", "group_id": "g0", "reward": 1.0,
                              "scorer": SCORER})
    with EventProducer(bus, "test") as producer:
        for i in range(2):
            producer.publish(TrajectoryEvent(
                traj_id=f"g0:{i}", group_id="g0", prompt_id="p0", sample_index=i, group_size=2,
                prompt_ids=[1], output_ids=[5], output_logprobs=[-0.5], output_versions=[0]))
        producer.publish_raw(rewards_topic, b"g0", no_run_id)
        producer.publish(RewardEvent(traj_id="g0:1", group_id="g0", reward=0.5,
                                     run_id="another.run"))
    runner = RoleRunner(build_role("advantage", cfg), bus, member_id="advantage-0")
    thread = threading.Thread(target=runner.run, kwargs={"max_seconds": 120}, daemon=True)
    thread.start()
    try:
        _wait(lambda: runner.stats.consumed >= 4, 60, "the advantage processor to read all 4")
    finally:
        runner.stop()
        thread.join(30)
    group = f"{bus.topic_prefix}.advantage"
    dead = [r.event for r in _records(bus, "dlq")
            if r.event is not None and r.event.consumer_group == group]
    assert len(dead) == 1, dead
    assert dead[0].error_type == "UnattributedEventError"
    assert "'ext.run'" in dead[0].error and "run_id" in dead[0].error
    assert dead[0].source_topic == rewards_topic and original_payload(dead[0]) == no_run_id
    assert runner.stats.foreign == 1 and runner.stats.dead_lettered == 1
    assert _records(bus, "samples") == []  # neither reward counted: the group is incomplete


@pytest.mark.parametrize("client", sorted(SERVICES))
def test_the_service_scores_only_its_run_on_a_broker_with_history(client, broker, tmp_path):
    """Issue 29: on a broker with history a service for every run scored every old
    trajectory before the new run's first (172k of them, 17 minutes at step 0). Without
    --run-id (or --all-runs) it now refuses to start; with it, it scores its run's
    trajectories, those of the run's later broker lifetimes (RUN@2) included, and skips
    the old run's and a run-less one, counted, in a consumer group of the run's own."""
    pytest.importorskip("kafka" if client == "kafka-python" else "confluent_kafka")
    bus = BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:12]}")
    ensure_topics(bus)
    runs = {"old.run": 3, "new.run": 2, "new.run@2": 1, "default": 1}
    with EventProducer(bus, "test") as producer:
        for run_id, count in runs.items():
            for i in range(count):
                gid = f"{run_id}-g{i}"
                producer.publish(TrajectoryEvent(
                    traj_id=f"{gid}:0", group_id=gid, prompt_id="p", sample_index=0,
                    group_size=1, prompt_ids=[1, 2], output_ids=[5], output_logprobs=[-0.5],
                    output_versions=[0], run_id=run_id))
    env = {k: v for k, v in os.environ.items() if not k.startswith("TAPIOCA")}
    base = [sys.executable, str(SERVICES[client]), "--bootstrap-server", broker.bootstrap,
            "--prefix", bus.topic_prefix, "--scorer", SCORER]
    refused = subprocess.run(base + ["--exit-when-idle-s", "4"], capture_output=True,
                             text=True, timeout=60, cwd=tmp_path, env=env)
    assert refused.returncode == 2, refused.stderr[-2000:]
    assert "--run-id RUN" in refused.stderr and "--all-runs" in refused.stderr
    assert _records(bus, "rewards") == []
    group = f"{bus.topic_prefix}.reward-service.{SCORER}.new.run"
    log_path = tmp_path / "service.log"
    with open(log_path, "wb") as log:
        service = subprocess.Popen(base + ["--run-id", "new.run"], stdout=log,
                                   stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        # The service commits every record it read, skipped ones too: all 7 are behind it
        # when its group's offsets (fresh topics start at 0) add up to 7.
        _wait(lambda: sum(row.committed or 0 for row in consumer_lag(bus, [group])
                          if row.topic == bus.topic(topic("trajectories"))) == 7
              or service.poll() is not None, 120, "the service to read every trajectory")
        assert service.poll() is None, log_path.read_text()
    finally:
        _stop_service(service)
    assert service.returncode == 0, log_path.read_text()
    rewards = [r.event for r in _records(bus, "rewards")]
    assert sorted(r.traj_id for r in rewards) == ["new.run-g0:0", "new.run-g1:0",
                                                  "new.run@2-g0:0"]
    assert {r.run_id for r in rewards} == {"new.run", "new.run@2"}
    text = log_path.read_text()
    counts = orjson.loads(text.split("stopped: ")[-1].splitlines()[0])
    assert counts == {"scored": 3, "duplicates": 0, "dead_lettered": 0, "other_runs": 4}
    assert f"for run new.run (group {group})" in text
