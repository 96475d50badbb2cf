"""Many rollout workers and the sharded trainer, end to end under the local launcher:
4 rollout members in the rollout consumer group (prompts.v1 has 4 partitions) and the
trainer as 2 FSDP2 ranks on gloo (``fsdp.world_size=2``: `tapioca role trainer` starts
its second rank itself), real embedded broker, tiny model, CPU.

Checked from the events on the topics: every member took a share of the prompt
partitions and generated; the head gate held for every admitted group; every member
followed the weights (its last trajectories carry recent versions); the tail gate
held; every version was published once, with its own groups (none trained twice), across
a kill -9 of the trainer's rank 0 mid-run (its rank 1 dies with it; both restart from
the sharded checkpoint and its consumer offsets); and the second rank stopped cleanly
with rank 0 at the end.
"""

from __future__ import annotations

import time
import uuid
from collections import defaultdict
from pathlib import Path

import pytest

from tapioca.bus import read_events
from tapioca.config.loader import load_config
from tapioca.config.schema import TrainConfig
from tapioca.ops.launcher import Launcher
from tapioca.trainers.trainer import read_metrics

pytestmark = pytest.mark.e2e

WORKERS = 4
ETA = 1
B = 8
N = 4
STEPS = 16
KILL_AT_STEP = 6


@pytest.fixture(scope="module")
def run(broker, tmp_path_factory, fast_join):
    cfg = load_config(TrainConfig, None, [
        f"run_dir={tmp_path_factory.mktemp('runs')}", "experiment_name=many", "trial_name=t0",
        f"total_train_steps={STEPS}", f"bus.bootstrap_servers={broker.bootstrap}", *fast_join,
        f"bus.topic_prefix=many{uuid.uuid4().hex[:8]}",
        "train_dataset.task_options.op=copy", "train_dataset.task_options.max_digit=3",
        f"train_dataset.prompts_per_step={B}", f"gconfig.n_samples={N}", "gconfig.max_new_tokens=2",
        f"rollout.max_head_offpolicyness={ETA}", f"rollout.workers={WORKERS}",
        "actor.optimizer.lr=3e-3", "fsdp.world_size=2", "fsdp.param_dtype=float32",
    ])
    launcher = Launcher(cfg)
    started = time.monotonic()
    launcher.start()
    try:
        # kill -9 rank 0 mid-run: rank 1 dies with it (parent-death signal); the new rank 0
        # starts a new rank 1 and both resume from the sharded checkpoint and its offsets.
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            rows = read_metrics(cfg.run_path)
            if rows and rows[-1]["step"] >= KILL_AT_STEP:
                break
            dead = [c for c in launcher.children if c.proc.poll() is not None]
            assert not dead, f"{dead[0].label} died:\n{dead[0].log_tail()}"
            time.sleep(0.3)
        else:
            pytest.fail("the trainer did not reach the kill point in time")
        launcher.restart("trainer")
        summary = launcher.wait(timeout_s=900)
    finally:
        launcher.stop()
    print(f"\n{WORKERS} rollout members + 2 trainer ranks: {STEPS} steps in "
          f"{time.monotonic() - started:.0f} s")
    return cfg, summary


def test_every_rollout_member_generated(run):
    cfg, _ = run
    by_member = defaultdict(int)
    for ev in read_events(cfg.bus, "trajectories"):
        by_member[ev.producer_id] += 1
    assert sorted(by_member) == [f"rollout-{i}" for i in range(WORKERS)], dict(by_member)
    assert all(n > 0 for n in by_member.values())


def test_head_gate_held_for_every_admitted_group(run):
    cfg, _ = run
    progress = read_events(cfg.bus, "progress")
    freed = max((ev.groups_rejected for ev in progress), default=0)
    prompts = read_events(cfg.bus, "prompts")
    assert prompts
    for ev in prompts:
        assert ev.group_index < (ETA + ev.admitted_at_version + 1) * B + freed, ev.group_id


def test_every_member_followed_the_weights(run):
    cfg, _ = run
    latest: dict[str, int] = defaultdict(int)
    for ev in read_events(cfg.bus, "trajectories"):
        latest[ev.producer_id] = max(latest[ev.producer_id], max(ev.output_versions))
    # Admission runs eta versions ahead of the trainer, and each member loads every new
    # version before its next tokens: the last tokens of each carry a recent version.
    for member, version in latest.items():
        assert version >= STEPS - ETA - 2, (member, dict(latest))


def test_each_version_names_one_group_set_and_groups_trained_once_within_eta(run):
    cfg, _ = run
    samples = {e.group_id: e for e in read_events(cfg.bus, "samples")}
    sets: dict[int, set[frozenset]] = defaultdict(set)
    for ev in read_events(cfg.bus, "progress"):
        if ev.group_ids:
            sets[ev.version].add(frozenset(ev.group_ids))
    assert sorted(sets) == list(range(1, STEPS + 1))
    assert all(len(v) == 1 for v in sets.values()), "a version was trained twice"
    trained = [g for v in sets.values() for g in next(iter(v))]
    assert len(trained) == len(set(trained)) == STEPS * B
    for version, v in sets.items():
        for gid in next(iter(v)):
            assert 0 <= (version - 1) - samples[gid].min_version <= ETA


def test_second_rank_restarted_with_the_trainer_and_stopped_cleanly_with_a_sharded_checkpoint(run):
    cfg, _ = run
    logs = Path(cfg.run_path) / "logs"
    text = (logs / "trainer-rank1.log").read_text()
    assert text.count("trainer rank 1 of 2") == 2, "rank 1 was not started again after the kill"
    assert "trainer rank 1 stopped cleanly" in text
    assert (Path(cfg.run_path) / "checkpoints" / "trainer-sharded.json").exists()
