"""A trial resumed on a broker that does not hold its log (the embedded memory broker
keeps nothing across restarts) gets a new bus run id (``demo.t0@2``): the feeder's
regenerated group ids cannot collide with the groups the checkpoint trained (before,
the trainer silently dropped them as duplicates), the trainer drops the old log's
offsets, and the head gate counts from the resume point. Resumed on the same log, the
run keeps its id. Real broker, real feeder and trainer built from the written config;
the launcher's children are stand-ins (only the config it writes matters here)."""

from __future__ import annotations

import dataclasses
import sys
import time
import uuid
from pathlib import Path

import pytest

from tapioca.bus import EventProducer, ensure_topics
from tapioca.bus.role import Source
from tapioca.bus.settings import BusConfig
from tapioca.config.loader import load_config
from tapioca.config.schema import TrainConfig
from tapioca.ops.launcher import Launcher
from tapioca.runtime.builders import build_role
from tapioca.runtime.run import create_tiny_checkpoint, resolve_bus_run_id
from tapioca.schemas.events import ProgressEvent, SampleEvent, SampleSequence

pytestmark = pytest.mark.integration

B = 2
ETA = 1


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(create_tiny_checkpoint(tmp_path_factory.mktemp("model") / "m"))


def sleeper(role, member, config):
    return [sys.executable, "-c", "import time; time.sleep(60)"]


def launch(cfg: TrainConfig) -> TrainConfig:
    """`tapioca train`'s start (topics, key, bus run id, config.yaml); returns the config
    the roles read."""
    launcher = Launcher(cfg, command_for=sleeper)
    launcher.start()
    launcher.stop(timeout_s=5)
    return load_config(TrainConfig, launcher.config_path)


def sample(gid: str, min_version: int) -> SampleEvent:
    seqs = [SampleSequence(traj_id=f"{gid}:{i}", output_ids=[3 + i, 4, 5],
                           behav_logprobs=[-2.0] * 3, output_versions=[min_version] * 3,
                           reward=float(i == 0), advantage=1.0 if i == 0 else -1.0)
            for i in range(2)]
    return SampleEvent(group_id=gid, prompt_id=f"p-{gid}", prompt_ids=[1, 2, 4], sequences=seqs,
                       min_version=min_version, max_version=min_version)


def admitted(feeder, state, progress: ProgressEvent) -> list[str]:
    feeder.handle(progress, state, Source("p", 0, 0, broadcast=True))
    return [e.group_id for e in feeder.on_tick(state, time.time())]


def test_resumed_on_a_fresh_broker_the_run_gets_a_new_bus_run_id_and_no_group_collides(
        broker, tmp_path, model_dir):
    cfg = load_config(TrainConfig, None, [
        f"run_dir={tmp_path}", "experiment_name=life", "trial_name=t0", f"model.path={model_dir}",
        f"bus.bootstrap_servers={broker.bootstrap}", f"bus.topic_prefix=a{uuid.uuid4().hex[:8]}",
        f"train_dataset.prompts_per_step={B}", "gconfig.n_samples=2",
        f"rollout.max_head_offpolicyness={ETA}", "actor.checkpoint_every_steps=1"])
    first = launch(cfg)
    assert first.bus.run_id == "life.t0"

    # Lifetime 1: the feeder admits groups, the trainer trains two steps and checkpoints.
    feeder = build_role("feeder", first)
    fs = feeder.init_state()
    ids1 = admitted(feeder, fs, ProgressEvent(version=0))
    assert len(ids1) == (ETA + 1) * B
    trainer = build_role("trainer", first)
    ts = trainer.init_state()
    for k, gid in enumerate(ids1):
        trainer.handle(sample(gid, min_version=k // B), ts, Source("a.samples.v1", 0, k))
    assert ts.progress.version == 2 and ts.trained == set(ids1)
    trainer.sink.close()

    # The same trial again on a broker that holds nothing of it (here: fresh topics).
    cfg = dataclasses.replace(cfg, bus=BusConfig(bootstrap_servers=broker.bootstrap,
                                                 topic_prefix=f"b{uuid.uuid4().hex[:8]}"))
    second = launch(cfg)
    assert second.bus.run_id == "life.t0@2"

    trainer2 = build_role("trainer", second)
    ts2 = trainer2.init_state()
    assert ts2.progress.version == 2 and ts2.progress.offsets == {}  # the old log's offsets
    (hello,) = [e for e in trainer2.on_tick(ts2, 0.0) if isinstance(e, ProgressEvent)]
    assert (hello.version, hello.base_steps, hello.base_rejected) == (2, 2, 0)
    feeder2 = build_role("feeder", second)
    ids2 = admitted(feeder2, feeder2.init_state(), hello)
    # Numbered from 0 again on the new log, under the new run id: nothing collides, and
    # the head gate admits one window, not the whole run's worth of steps.
    assert not set(ids2) & ts2.trained
    assert all(g.startswith("life.t0@2-g") for g in ids2) and len(ids2) == (ETA + 1) * B
    out = []
    for k, gid in enumerate(ids2[:B]):
        out += trainer2.handle(sample(gid, min_version=2), ts2, Source("b.samples.v1", 0, k))
    assert ts2.duplicates == 0 and ts2.progress.version == 3
    (w,) = [e for e in out if isinstance(e, ProgressEvent)]
    assert w.group_ids == ids2[:B] and w.base_steps == 2
    trainer2.sink.close()


def test_resumed_on_the_same_log_the_run_keeps_its_bus_run_id(broker, tmp_path, model_dir):
    cfg = load_config(TrainConfig, None, [
        f"run_dir={tmp_path}", "experiment_name=same", "trial_name=t0", f"model.path={model_dir}",
        f"bus.bootstrap_servers={broker.bootstrap}", f"bus.topic_prefix=s{uuid.uuid4().hex[:8]}",
        f"train_dataset.prompts_per_step={B}", "gconfig.n_samples=2"])
    first = launch(cfg)
    trainer = build_role("trainer", first)
    ts = trainer.init_state()
    for k in range(B):
        out = trainer.handle(sample(f"same.t0-g{k:08d}", 0), ts, Source("s.samples.v1", 0, k))
    trainer.checkpoints.save(ts)
    trainer.sink.close()
    ensure_topics(first.bus)
    with EventProducer(first.bus, "trainer") as producer:  # what the trainer published
        for e in out:
            producer.publish(e)
    assert resolve_bus_run_id(first) == "same.t0"
    again = launch(cfg)
    assert again.bus.run_id == "same.t0"
    assert Path(again.bus.signing_key_path).exists()
