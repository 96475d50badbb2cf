"""Images through the archive, `tapioca replay` and `tapioca train-offline` (docs/vlm.md),
on the real embedded broker.

One short real run of the visual task (feeder, rollout with the paged engine, advantage
processor and archiver built as the launcher builds them; a reward hashed from the
trajectory id so advantages vary; a tiny random Qwen2.5-VL): 4 groups of 2 samples.
Then, with the run's image store DELETED (only the archive's copy left): the archive
holds every image its events name; `tapioca replay` republishes the trajectories with
their image references; replaying the archived trajectories and rewards through a
fresh advantage processor reproduces the recorded samples exactly, images included; and
`tapioca train-offline --from-archive` trains on them, reading the pixels from
``<archive>/images``."""

from __future__ import annotations

import hashlib
import math
import shutil
import threading
import time
import uuid

import orjson
import pytest
from typer.testing import CliRunner

from tapioca.bus import BusConfig, RoleRunner, TopicReader, ensure_topics
from tapioca.bus.archive import iter_events
from tapioca.bus.role import Source
from tapioca.config.loader import to_yaml
from tapioca.config.schema import (
    ArchiveConfig,
    DatasetConfig,
    GenerationConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
    VlmConfig,
)
from tapioca.config.sections import RewardSection
from tapioca.consumers.archiver import event_images
from tapioca.consumers.reward_scorer import RewardScorer
from tapioca.media.store import FileImageStore
from tapioca.ops.cli import app
from tapioca.runtime.builders import build_role
from tapioca.runtime.run import create_tiny_checkpoint
from tapioca.schemas import SampleEvent

pytestmark = pytest.mark.integration

GROUPS = 4


def _read(cfg: BusConfig, name: str) -> list:
    with TopicReader(cfg, name) as reader:
        return [r.event for r in reader.records(idle_s=0.5, timeout_s=30)]


def hash_reward(event) -> float:
    return int.from_bytes(hashlib.sha256(event.traj_id.encode()).digest()[:6], "big") / 2 ** 48


@pytest.fixture(scope="module")
def run(broker, tmp_path_factory, one_torch_thread):
    root = tmp_path_factory.mktemp("vlm-archived")
    model = str(create_tiny_checkpoint(root / "model", task="visual", arch="qwen2_5_vl"))
    bus = BusConfig(bootstrap_servers=broker.bootstrap, topic_prefix=f"v{uuid.uuid4().hex[:12]}",
                    run_id="vlmarch.run")
    ensure_topics(bus)
    archive = root / "archive"
    cfg = TrainConfig(
        experiment_name="vlmarch", trial_name="run", run_dir=str(root / "runs"), bus=bus,
        model=ModelConfig(path=model, arch="qwen2_5_vl"),
        train_dataset=DatasetConfig(type="visual", prompts_per_step=2, task_options={"n_images": 6}),
        gconfig=GenerationConfig(n_samples=2, max_new_tokens=2),
        rollout=RolloutConfig(max_head_offpolicyness=1),
        vlm=VlmConfig(image_store=str(root / "run-images"), inline_image_max_bytes=0),
        archive=ArchiveConfig(enabled=True, dir=str(archive), roll_bytes=2048, roll_interval_s=0.5))
    roles = ["archiver", "advantage", "reward", "rollout", "feeder"]
    built = {name: build_role(name, cfg) for name in roles if name != "reward"}
    built["reward"] = RewardScorer(RewardSection(reward=RewardConfig(scorer="hash")), reward_fn=hash_reward)
    runners = {name: RoleRunner(built[name], bus, member_id=f"{name}-0") for name in roles}
    errors: list[BaseException] = []

    def go(r: RoleRunner) -> None:
        try:
            r.run(max_seconds=240)
        except BaseException as exc:
            errors.append(exc)

    threads = {n: threading.Thread(target=go, args=(r,), daemon=True) for n, r in runners.items()}
    for t in threads.values():
        t.start()
    try:
        deadline = time.monotonic() + 180
        while len(list(iter_events(archive, topic="samples"))) < GROUPS and not errors:
            assert time.monotonic() < deadline, "timed out waiting for 4 archived samples"
            time.sleep(0.3)
        assert not errors, errors
    finally:
        for name in roles[1:]:
            runners[name].stop()
        for name in roles[1:]:
            threads[name].join(30)
        time.sleep(1.5)
        runners["archiver"].stop()
        threads["archiver"].join(30)
    assert not errors, errors
    shutil.rmtree(root / "run-images")  # from here on only the archive holds the images
    return cfg, archive


def test_the_archive_keeps_every_image_its_events_name(run):
    _, archive = run
    store = FileImageStore(archive / "images")
    named = {ref.sha256 for name in ("prompts", "trajectories", "samples")
             for _, e in iter_events(archive, topic=name) for ref in event_images(e)}
    assert named and all(store.get(sha) for sha in named)
    for _, t in iter_events(archive, topic="trajectories"):
        assert len(t.images) == 1 and t.images[0].data_b64 == ""  # by reference only


def test_replay_and_the_advantage_processor_reproduce_the_samples_exactly(run):
    cfg, archive = run
    recorded = {e.group_id: e for _, e in iter_events(archive, topic="samples")}
    assert len(recorded) == GROUPS
    # `tapioca replay` republishes the trajectories and rewards with their images.
    prefix = f"r{uuid.uuid4().hex[:12]}"
    result = CliRunner().invoke(app, ["-b", cfg.bus.bootstrap_servers, "--prefix", cfg.bus.topic_prefix,
                                      "replay", str(archive), "--to-prefix", prefix, "--type", "trajectory",
                                      "--type", "reward", "-o", "json"])
    assert result.exit_code == 0, (result.output, result.exception)
    assert orjson.loads(result.stdout.strip().splitlines()[-1])["published"] == 4 * GROUPS
    dest = BusConfig(bootstrap_servers=cfg.bus.bootstrap_servers, topic_prefix=prefix)
    archived = {e.traj_id: e for _, e in iter_events(archive, topic="trajectories")}
    replayed = _read(dest, "trajectories")
    assert sorted(e.traj_id for e in replayed) == sorted(archived)
    assert all(e.images == archived[e.traj_id].images for e in replayed)
    # The replayed events through a fresh advantage processor: the same samples, bit for bit.
    fresh = build_role("advantage", cfg)
    state = fresh.init_state()
    again: dict[str, SampleEvent] = {}
    events = sorted(replayed + _read(dest, "rewards"), key=lambda e: (e.TYPE != "trajectory", e.produced_at))
    for i, event in enumerate(events):
        for out in fresh.handle(event, state, Source("replayed", 0, i)):
            again[out.group_id] = out
    assert set(again) == set(recorded)
    assert len({q.advantage for s in recorded.values() for q in s.sequences}) > 1  # not all zeros
    for gid, live in recorded.items():
        assert again[gid].sequences == live.sequences  # ids, logprobs, rewards, advantages, images
        assert again[gid].prompt_ids == live.prompt_ids


def test_train_offline_from_the_archive_reads_its_images(run, tmp_path):
    cfg, archive = run
    config = tmp_path / "run.yaml"
    config.write_text(to_yaml(cfg))  # names the deleted run store: the archive's copy wins
    prefix = f"o{uuid.uuid4().hex[:12]}"
    result = CliRunner().invoke(app, [
        "-b", cfg.bus.bootstrap_servers, "--prefix", prefix, "train-offline", "--config", str(config),
        "--from-archive", str(archive), "-o", "json", f"run_dir={tmp_path / 'runs'}", "actor.optimizer.lr=1e-2"])
    assert result.exit_code == 0, (result.output, result.exception)
    out = orjson.loads(result.stdout.strip().splitlines()[-1])
    assert out["steps"] == 2 and out["groups_read"] == GROUPS
    assert all(math.isfinite(x) for x in out["losses"])
