"""The tensor-parallel trainer end to end under the local launcher: `tapioca role trainer`
with AReaL's ``actor.backend: fsdp:t2`` (2 tp ranks on gloo; rank 0 starts the second
itself), one rollout worker, the real embedded broker, tiny model, CPU.

Checked from the topics and the run directory: the run trains its steps; every version
is published once, as a file of every weight whole (gathered from the tp shards), which
the rollout worker loaded (its later tokens carry the new versions); no group is trained
twice; the second rank served rank 0 (the only Kafka client of the trainer) and stopped
cleanly with it, after the sharded checkpoint.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from tapioca.bus import read_events
from tapioca.config.loader import load_config
from tapioca.config.schema import TrainConfig
from tapioca.ops.launcher import Launcher
from tapioca.trainers.trainer import read_metrics

pytestmark = pytest.mark.e2e

STEPS = 4


@pytest.fixture(scope="module")
def run(broker, tmp_path_factory, fast_join):
    cfg = load_config(TrainConfig, None, [
        f"run_dir={tmp_path_factory.mktemp('runs')}", "experiment_name=tp", "trial_name=t0",
        f"total_train_steps={STEPS}", f"bus.bootstrap_servers={broker.bootstrap}", *fast_join,
        f"bus.topic_prefix=tp{uuid.uuid4().hex[:8]}",
        "train_dataset.task_options.op=copy", "train_dataset.task_options.max_digit=3",
        "train_dataset.prompts_per_step=4", "gconfig.n_samples=4", "gconfig.max_new_tokens=2",
        "rollout.max_head_offpolicyness=1", "actor.backend=fsdp:t2", "fsdp.param_dtype=float32",
    ])
    assert (cfg.fsdp.world_size, cfg.fsdp.tp) == (2, 2)
    launcher = Launcher(cfg)
    launcher.start()
    try:
        summary = launcher.wait(timeout_s=900)  # generous: a loaded 2-core box
    finally:
        launcher.stop()
    return launcher.cfg, summary  # resolved: the model directory the launcher created


def test_the_tensor_parallel_trainer_trains_and_publishes_every_version(run):
    cfg, _ = run
    rows = read_metrics(cfg.run_path)
    assert rows and rows[-1]["step"] == STEPS
    weights = read_events(cfg.bus, "weights")
    assert sorted({w.version for w in weights}) == list(range(0, STEPS + 1))  # 0: the initial weights
    from safetensors.torch import load_file

    from tapioca.models.factory import load_model_and_tokenizer

    model, _ = load_model_and_tokenizer(cfg.model.path)
    published = load_file(max(weights, key=lambda w: w.version).path)
    # Every weight, whole (a tied LM head is stored once, under one of its names).
    own = model.state_dict()
    for name, value in own.items():
        if name in published:
            assert published[name].shape == value.shape, name
    assert set(own) - set(published) <= {"lm_head.weight"}
    # The rollout worker loaded them: its later tokens carry the new versions.
    latest = max(max(ev.output_versions) for ev in read_events(cfg.bus, "trajectories"))
    assert latest >= STEPS - 2


def test_each_version_names_one_group_set_and_no_group_is_trained_twice(run):
    cfg, _ = run
    sets: dict[int, set[frozenset]] = {}
    for ev in read_events(cfg.bus, "progress"):  # each version's groups (progress.v1)
        if ev.group_ids:
            sets.setdefault(ev.version, set()).add(frozenset(ev.group_ids))
    assert sorted(sets) == list(range(1, STEPS + 1))
    assert all(len(v) == 1 for v in sets.values()), "a version was published twice"
    trained = [g for v in sets.values() for g in next(iter(v))]
    assert len(trained) == len(set(trained))


def test_the_second_rank_served_rank_0_and_stopped_cleanly(run):
    cfg, _ = run
    text = (Path(cfg.run_path) / "logs" / "trainer-rank1.log").read_text()
    assert "trainer rank 1 of 2" in text and "trainer rank 1 stopped cleanly" in text
    assert (Path(cfg.run_path) / "checkpoints" / "trainer-sharded.json").exists()
