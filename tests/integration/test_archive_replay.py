"""Archive and replay against the real embedded broker.

One short real run per module (feeder, rollout, advantage processor and archiver built
as the launcher builds them, and a RewardScorer whose reward is a hash of the
trajectory id, so rewards and advantages vary; tiny model): 4 groups of 2 samples.
Then: the archive holds exactly the run's records and its offsets are committed;
replaying the archived trajectories and rewards through a fresh advantage processor
reproduces the recorded advantages exactly; `tapioca replay` republishes the archive or
a live topic range with filters and rate control; and
`tapioca train-offline` trains from the archive with the staleness gate off."""

from __future__ import annotations

import hashlib
import math
import threading
import time
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tapioca.bus import BusConfig, RoleRunner, TopicReader, consumer_lag, ensure_topics
from tapioca.bus.archive import iter_events, iter_records
from tapioca.config.loader import to_yaml
from tapioca.config.schema import (
    ArchiveConfig,
    DatasetConfig,
    GenerationConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
)
from tapioca.config.sections import RewardSection
from tapioca.consumers.reward_scorer import RewardScorer
from tapioca.ops.cli import app
from tapioca.runtime.builders import build_role
from tapioca.runtime.run import create_tiny_checkpoint
from tapioca.schemas import SampleEvent, topic
from tapioca.schemas.errors import ConfigError
from tapioca.weights.files import sha256_file

pytestmark = pytest.mark.integration

DATA_TOPICS = ("prompts", "trajectories", "rewards", "samples")
GROUPS = 4  # eta 1, B 2: the head gate admits (1 + 0 + 1) * 2 groups at version 0


def _wait(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")


def _read(cfg: BusConfig, name: str) -> list:
    with TopicReader(cfg, name) as reader:
        return [r for r in reader.records(idle_s=0.5, timeout_s=30)]


def hash_reward(event) -> float:
    digest = hashlib.sha256(event.traj_id.encode()).digest()
    return int.from_bytes(digest[:6], "big") / 2 ** 48


def group_rewards(archive) -> dict[str, list[float]]:
    groups: dict[str, list[float]] = {}
    for _, e in iter_events(archive, topic="rewards"):
        groups.setdefault(e.group_id, []).append(e.reward)
    return groups


class Run:
    def __init__(self, cfg: TrainConfig, archive: Path, truth: dict[str, list]) -> None:
        self.cfg = cfg
        self.bus = cfg.bus
        self.archive = archive
        self.truth = truth  # topic base name -> records read back from the broker


def _run_and_archive(broker, root: Path, run_id: str, *, trainer_steps: int = 0) -> Run:
    """A short real run through the module's broker, archived: feeder, rollout, advantage
    processor and archiver as the launcher builds them, the hash scorer, and (with
    ``trainer_steps``) the trainer, so that groups are made at several policy versions."""
    model = str(create_tiny_checkpoint(root / "model"))
    bus = BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix=f"t{uuid.uuid4().hex[:12]}",
                    run_id=run_id)
    ensure_topics(bus)
    archive = root / "archive"
    experiment, trial = run_id.split(".")
    cfg = TrainConfig(
        experiment_name=experiment, trial_name=trial, run_dir=str(root / "runs"), bus=bus,
        model=ModelConfig(path=model), train_dataset=DatasetConfig(prompts_per_step=2),
        gconfig=GenerationConfig(n_samples=2, max_new_tokens=3),
        rollout=RolloutConfig(max_head_offpolicyness=1),
        **({"total_train_steps": trainer_steps} if trainer_steps else {}),
        # Small files: both the size and the time roll happen in a run this short.
        archive=ArchiveConfig(enabled=True, dir=str(archive), roll_bytes=2048,
                              roll_interval_s=0.5))
    assert cfg.run_id == bus.run_id
    roles = ["archiver", "advantage", "reward", "rollout", "feeder"] + (
        ["trainer"] if trainer_steps else [])
    built = {name: build_role(name, cfg) for name in roles if name != "reward"}
    # The tiny untrained model almost never solves a task: the task's reward would be 0.0
    # everywhere, and the replay checks below would compare zeros. A deterministic
    # pseudo-random reward in [0, 1) makes every reward (and so every advantage) differ.
    built["reward"] = RewardScorer(RewardSection(reward=RewardConfig(scorer="hash")),
                                   reward_fn=hash_reward)
    runners = {name: RoleRunner(built[name], bus, member_id=f"{name}-0") for name in roles}
    errors: list[BaseException] = []

    def go(r: RoleRunner) -> None:
        try:
            r.run(max_seconds=240)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    def done() -> bool:
        if trainer_steps:  # the trainer has published its last version
            return any(r.event.version >= trainer_steps for r in _read(bus, "weights"))
        return len(_read(bus, "samples")) >= GROUPS

    threads = {n: threading.Thread(target=go, args=(r,), daemon=True) for n, r in runners.items()}
    for t in threads.values():
        t.start()
    try:
        _wait(lambda: done() or errors, 180, "the run")
        assert not errors, errors
        wanted = len(_read(bus, "samples"))
        _wait(lambda: len(list(iter_events(archive, topic="samples"))) >= wanted, 60,
              "the archiver to roll the samples into a file")
    finally:
        for name in roles[1:]:
            runners[name].stop()
        for name in roles[1:]:
            threads[name].join(30)
        time.sleep(1.5)  # the archiver reads the others' last status events
        runners["archiver"].stop()
        threads["archiver"].join(30)
    assert not errors, errors
    truth = {name: _read(bus, name) for name in DATA_TOPICS}
    return Run(cfg, archive, truth)


@pytest.fixture(scope="module")
def run(broker, tmp_path_factory, one_torch_thread) -> Run:
    return _run_and_archive(broker, tmp_path_factory.mktemp("archived"), "arch.run")


def test_archive_holds_every_record_and_commits_after_the_files(run):
    bus = run.bus
    for name in DATA_TOPICS:
        broker_side = {(r.source.topic, r.source.partition, r.source.offset): r.event.event_id
                       for r in run.truth[name]}
        archived = {(s.topic, s.partition, s.offset): e.event_id
                    for s, e in iter_events(run.archive, topic=name)}
        assert archived == broker_side, name
    counts = {name: len(run.truth[name]) for name in DATA_TOPICS}
    assert counts == {"prompts": GROUPS, "trajectories": 2 * GROUPS,
                      "rewards": 2 * GROUPS, "samples": GROUPS}
    # Status events of every role are archived too.
    assert any(e.source.startswith("rollout") for _, e in iter_events(run.archive, topic="metrics"))

    # After the stop, every archived partition is committed to one past its last record.
    last: dict[tuple[str, int], int] = {}
    for rec in iter_records(run.archive):
        last[(rec.topic, rec.partition)] = max(last.get((rec.topic, rec.partition), -1),
                                               rec.offset)
    committed = {(row.topic, row.partition): row.committed
                 for row in consumer_lag(bus, [f"{bus.topic_prefix}.archiver"])}
    for tp, off in last.items():
        if tp[0] in {bus.topic(topic(n)) for n in DATA_TOPICS}:
            assert committed.get(tp) == off + 1, tp

    # File names carry partition and offset bounds, and no temporary file is left.
    files = sorted(run.archive.rglob("*"))
    assert not [f for f in files if f.name.startswith(".")]
    traj_dir = run.archive / bus.topic(topic("trajectories"))
    assert all(f.name.startswith("part-") for f in traj_dir.iterdir())
    assert len(list(traj_dir.iterdir())) >= 2  # rolled by size (2 KiB) at least once

    pd = pytest.importorskip("pandas")
    df = pd.read_parquet(run.archive)
    assert len(df) == sum(1 for _ in iter_records(run.archive))
    rewards = df[df["type"] == "reward"].sort_values(["partition", "offset"])
    assert rewards["reward"].tolist() == [
        e.reward for _, e in iter_events(run.archive, topic="rewards")]


def test_replaying_the_log_through_the_advantage_processor_reproduces_advantages(run):
    recorded = {e.group_id: e for _, e in iter_events(run.archive, topic="samples")}
    assert len(recorded) == GROUPS
    fresh = build_role("advantage", run.cfg)
    state = fresh.init_state()
    replayed: dict[str, SampleEvent] = {}
    fed = 0
    # Archived order: trajectories and rewards merged by record time, as consumed.
    for source, event in iter_events(run.archive, topic=["trajectories", "rewards"],
                                     order="time"):
        fed += 1
        for out in fresh.handle(event, state, source):
            assert isinstance(out, SampleEvent) and out.group_id not in replayed
            replayed[out.group_id] = out
    assert fed == 4 * GROUPS
    assert set(replayed) == set(recorded)
    # Not a comparison of zeros: the recorded run has varied rewards and advantages.
    live_rewards = [q.reward for s in recorded.values() for q in s.sequences]
    live_advantages = [q.advantage for s in recorded.values() for q in s.sequences]
    assert len(set(live_rewards)) == len(live_rewards) == 2 * GROUPS, live_rewards
    assert len(set(live_advantages)) > 1 and any(a != 0.0 for a in live_advantages)
    for gid, live in recorded.items():
        again = replayed[gid]
        assert not live.dropped_reason and not again.dropped_reason
        # Exact float equality, not approx: the same inputs give the same bits.
        assert [(q.traj_id, q.reward, q.advantage) for q in again.sequences] == \
               [(q.traj_id, q.reward, q.advantage) for q in live.sequences]
        assert again.sequences == live.sequences
        assert (again.min_version, again.max_version, again.prompt_ids) == \
               (live.min_version, live.max_version, live.prompt_ids)


def _cli(*args: str):
    result = CliRunner().invoke(app, list(args), catch_exceptions=True)
    return result


def _json(result) -> dict:
    import orjson

    assert result.exit_code == 0, (result.output, result.exception)
    return orjson.loads(result.stdout.strip().splitlines()[-1])


def test_replay_archive_to_a_new_run_with_filters_and_rate(run):
    bus = run.bus
    new_prefix = f"r{uuid.uuid4().hex[:12]}"
    t0 = time.monotonic()
    stats = _json(_cli("-b", bus.bootstrap_servers, "--prefix", bus.topic_prefix, "replay",
                       str(run.archive), "--to-prefix", new_prefix, "--run-id", "replayed.run",
                       "--type", "trajectory", "--type", "reward", "--rate", "40", "-o", "json"))
    assert stats["published"] == 4 * GROUPS
    # 16 events at 40 / s: the last leaves 15 / 40 = 0.375 s after the first.
    assert stats["wall_s"] >= 0.37 and time.monotonic() - t0 >= 0.37
    dest = BusConfig(bootstrap_servers=bus.bootstrap_servers, topic_prefix=new_prefix)
    original = {r.event.traj_id: r for r in run.truth["trajectories"]}
    copied = _read(dest, "trajectories")
    assert sorted(r.event.traj_id for r in copied) == sorted(original)
    for r in copied:
        src = original[r.event.traj_id]
        assert r.event.run_id == "replayed.run"
        assert r.event.event_id == src.event.event_id
        assert r.event.output_logprobs == src.event.output_logprobs
        # Keyed by group_id again: the same partition as in the source run.
        assert (r.source.key, r.source.partition) == (src.source.key, src.source.partition)
    assert len(_read(dest, "rewards")) == 2 * GROUPS
    assert _read(dest, "samples") == [] and _read(dest, "prompts") == []

    # Filters, counted without publishing (no broker needed for an archive).
    groups = group_rewards(run.archive)
    rewards = [r for rs in groups.values() for r in rs]
    assert len(groups) == GROUPS and len(set(rewards)) == 2 * GROUPS

    def dry(*flags: str) -> int:
        return _json(_cli("--prefix", bus.topic_prefix, "replay", str(run.archive),
                          "--dry-run", "-o", "json", *flags))["published"]

    # Thresholds that keep some groups whole and drop others: the highest group
    # minimum keeps (at least) that group and drops the groups with a lower reward.
    lo = max(min(rs) for rs in groups.values())
    kept = sum(len(rs) for rs in groups.values() if min(rs) >= lo)
    assert 2 <= kept < 2 * GROUPS
    assert dry("--type", "reward", "--min-reward", repr(lo)) == kept
    # Per event: every reward above the bound, split groups and all.
    above = sum(r >= lo for r in rewards)
    assert dry("--type", "reward", "--min-reward", repr(lo), "--per-event") == above
    hi = min(max(rs) for rs in groups.values())
    kept = sum(len(rs) for rs in groups.values() if max(rs) <= hi)
    assert 2 <= kept < 2 * GROUPS
    assert dry("--type", "reward", "--max-reward", repr(hi)) == kept
    assert dry("--type", "reward", "--max-reward", repr(hi), "--per-event") == \
        sum(r <= hi for r in rewards)
    # A group kept by its rewards is kept whole: its trajectories and sample too.
    whole = dry("--type", "trajectory", "--type", "reward", "--type", "sample",
                "--max-reward", repr(hi))
    assert whole == kept // 2 * 5
    # Every token of this run was generated by version 0.
    assert dry("--type", "sample", "--min-version", "0", "--max-version", "0") == GROUPS
    assert dry("--type", "sample", "--min-version", "1") == 0
    assert dry("--topic", "prompts", "--limit", "3") == 3
    stamps = sorted(r.source.timestamp_ms for r in run.truth["prompts"])
    since = stamps[1] / 1000
    assert dry("--topic", "prompts", "--since", str(since)) == sum(
        s >= stamps[1] for s in stamps)
    until = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(stamps[0] / 1000 - 3600))
    assert dry("--topic", "prompts", "--until", until) == 0


def test_replay_a_live_topic_offset_range_and_refuse_replaying_onto_itself(run):
    bus = run.bus
    new_prefix = f"r{uuid.uuid4().hex[:12]}"
    stats = _json(_cli("-b", bus.bootstrap_servers, "--prefix", bus.topic_prefix, "replay",
                       "--from-topic", "trajectories", "--from-offset", "0", "--to-offset", "0",
                       "--to-prefix", new_prefix, "-o", "json"))
    expected = {r.event.event_id for r in run.truth["trajectories"] if r.source.offset == 0}
    assert stats["published"] == len(expected) >= 1
    dest = BusConfig(bootstrap_servers=bus.bootstrap_servers, topic_prefix=new_prefix)
    assert {r.event.event_id for r in _read(dest, "trajectories")} == expected

    # --partition: one partition's offset range (offsets are per partition).
    part = run.truth["trajectories"][0].source.partition
    one = _json(_cli("-b", bus.bootstrap_servers, "--prefix", bus.topic_prefix, "replay",
                     "--from-topic", "trajectories", "--partition", str(part),
                     "--from-offset", "0", "--to-offset", "1", "--dry-run", "-o", "json"))
    assert one["published"] == sum(r.source.partition == part and r.source.offset <= 1
                                   for r in run.truth["trajectories"]) >= 1
    # ... read from that partition alone (not the whole topic, then filtered).
    assert one["read"] == sum(r.source.partition == part for r in run.truth["trajectories"])
    late = _json(_cli("-b", bus.bootstrap_servers, "--prefix", bus.topic_prefix, "replay",
                      "--from-topic", "trajectories", "--partition", str(part),
                      "--from-offset", "1", "--dry-run", "-o", "json"))
    assert late["read"] == late["published"] == sum(
        r.source.partition == part and r.source.offset >= 1 for r in run.truth["trajectories"])
    # (tests/unit/test_archive.py checks --partition against records on two partitions;
    # here the 4 groups may all hash to one of the 4 partitions.)

    # Everything to one topic: the run's samples into another prefix's samples topic.
    other = f"r{uuid.uuid4().hex[:12]}"
    target = f"{other}.samples.v1"
    stats = _json(_cli("-b", bus.bootstrap_servers, "--prefix", bus.topic_prefix, "replay",
                       "--from-topic", "samples", "--to-topic", target, "-o", "json"))
    assert stats["published"] == GROUPS
    assert len(_read(BusConfig(bootstrap_servers=bus.bootstrap_servers, topic_prefix=other),
                     "samples")) == GROUPS

    onto_itself = _cli("-b", bus.bootstrap_servers, "--prefix", bus.topic_prefix, "replay",
                       "--from-topic", "trajectories")
    assert isinstance(onto_itself.exception, ConfigError)
    assert "onto itself" in str(onto_itself.exception)


def test_archive_command_archives_a_finished_run(run, tmp_path):
    bus = run.bus
    out = tmp_path / "again"
    result = _cli("-b", bus.bootstrap_servers, "--prefix", bus.topic_prefix, "archive", str(out),
                  "--topic", "prompts", "--topic", "samples", "--group", f"{bus.topic_prefix}.a2",
                  "--exit-when-idle-s", "2", "--max-seconds", "60")
    assert result.exit_code == 0, (result.output, result.exception)
    assert "archived 8 events" in result.output
    for name in ("prompts", "samples"):
        assert [e.event_id for _, e in iter_events(out, topic=name)] == \
               [e.event_id for _, e in iter_events(run.archive, topic=name)]
    assert list(iter_events(out, topic="trajectories")) == []


def test_train_offline_from_the_archive(run, tmp_path):
    bus = run.bus
    config = tmp_path / "run.yaml"
    # As a finished run's config.yaml: it names the run's own broker, now gone; the
    # CLI's --bootstrap-server (-b) must win over it.
    config.write_text(to_yaml(run.cfg).replace(bus.bootstrap_servers, "127.0.0.1:9"))
    assert "127.0.0.1:9" in config.read_text()
    prefix = f"o{uuid.uuid4().hex[:12]}"
    # eta 0 in the config: a live trainer at version 1 would reject the second batch
    # (staleness 1 - 0 = 1 > 0); offline the gate is off, so both batches train.
    result = _json(_cli("-b", bus.bootstrap_servers, "--prefix", prefix, "train-offline",
                        "--config", str(config), "--from-archive", str(run.archive),
                        "-o", "json", "rollout.max_head_offpolicyness=0",
                        f"run_dir={tmp_path / 'runs'}"))
    assert result["steps"] == 2 and result["groups_read"] == GROUPS
    assert result["final_version"] == 2
    assert all(math.isfinite(x) for x in result["losses"]) and len(result["losses"]) == 2
    dest = BusConfig(bootstrap_servers=bus.bootstrap_servers, topic_prefix=prefix)
    weights = [r.event for r in _read(dest, "weights")]
    assert [w.version for w in weights] == [0, 1, 2]
    # The default trial is the source's + "-offline": no two runs share a checkpoint.
    assert all(w.run_id == "arch.run-offline" for w in weights)
    for w in weights:
        assert Path(w.path).is_file() and sha256_file(w.path) == w.sha256
    assert Path(result["run_dir"]).name == "run-offline"

    # From trajectories + rewards through this config's advantage processor.
    again = _json(_cli("-b", bus.bootstrap_servers, "--prefix", prefix, "train-offline",
                       "--config", str(config), "--from-archive", str(run.archive),
                       "--source", "trajectories", "--trial", "offline2", "--max-steps", "1",
                       "-o", "json", f"run_dir={tmp_path / 'runs'}"))
    assert again["steps"] == 1 and math.isfinite(again["losses"][0])


TRAINED_STEPS = 4


@pytest.fixture(scope="module")
def trained_run(broker, tmp_path_factory, one_torch_thread) -> Run:
    """A run with its trainer (4 steps of B 2, eta 1): groups made at versions 0..3."""
    return _run_and_archive(broker, tmp_path_factory.mktemp("trained"), "arch.trained",
                            trainer_steps=TRAINED_STEPS)


def test_train_offline_from_an_archive_of_many_policy_versions(trained_run, tmp_path):
    """Issue 29: the offline trainer starts at version 0, but a real run's samples were
    made at the online trainer's versions 0..3; the arrival check refused the first one
    made at version 1 ("its staleness would be -1 ... forged weights event?")."""
    run = trained_run
    made_at = [e.min_version for _, e in iter_events(run.archive, topic="samples")]
    # eta 1 over 4 steps: the groups of step 3 (version 2 -> 3) were made at >= 1.
    assert len(made_at) >= 2 * TRAINED_STEPS and max(made_at) >= 1, made_at
    config = tmp_path / "config.yaml"
    config.write_text(to_yaml(run.cfg))
    common = ("-b", run.bus.bootstrap_servers, "--prefix", f"o{uuid.uuid4().hex[:12]}",
              "train-offline", "--config", str(config), "--from-archive", str(run.archive),
              "-o", "json")
    # The documented command as it is: every step of the config from the archive.
    result = _json(_cli(*common, f"run_dir={tmp_path / 'runs'}"))
    assert result["steps"] == TRAINED_STEPS and result["final_version"] == TRAINED_STEPS
    assert all(math.isfinite(x) for x in result["losses"])
    # One step over every archived group at once: the trainer is at version 0 while it
    # takes each of them, those made at versions >= 1 included.
    everything = _json(_cli(*common, "--trial", "all-at-once", f"run_dir={tmp_path / 'runs'}",
                            f"train_dataset.prompts_per_step={len(made_at)}",
                            "total_train_steps=1"))
    assert everything["steps"] == 1 and everything["groups_read"] == len(made_at)


def test_step_timeline_from_a_real_runs_archive(trained_run):
    """Issue 28: the step timeline (ops/timeline.py) reads a real run's archive: one row
    per trained version, every stage found, the clock order the roles' own timestamps
    imply (durations >= 0; prompt wait may be < 0 at eta 1: generated before the switch)."""
    from tapioca.ops.timeline import events_from_archive, format_table, step_timelines

    rows = step_timelines(events_from_archive(trained_run.archive))
    assert [r.version for r in rows] == list(range(1, TRAINED_STEPS + 1)), format_table(rows)
    for r in rows:
        for name in ("generation_s", "reward_s", "advantage_s", "sample_hop_s", "trainer_wait_s", "step_s",
                     "cycle_s"):
            value = getattr(r, name)
            assert value is not None and value >= 0, (name, format_table(rows))
        assert r.step_s >= r.train_s > 0
    switched = [r for r in rows if r.generated_under is not None and r.generated_under >= 1]
    assert switched, format_table(rows)  # the rollout worker loaded the trainer's versions
    for r in switched:
        assert r.weights_hop_s >= 0 and r.switch_s >= 0 and r.publish_s > 0, format_table(rows)
