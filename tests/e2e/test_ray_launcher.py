"""`tapioca train --launcher ray` end to end: a private local Ray cluster on 127.0.0.1,
every role a Ray actor, the real embedded broker, the tiny model on the CPU.

One run serves every assertion: it learns as the local launcher does on the same
config, and killing the trainer's Ray actor mid-run is survived (Ray restarts it, it
resumes from its checkpoint and the log, the launcher reports the restart, no version
is lost or trained twice). Ray is shut down in the teardown whatever happens.

Calibration (this 2-core box, loaded): the same config under the local launcher took
the reward from 0.03 to 0.96 in 40 steps (88 s); the Ray run's start-up (the cluster)
adds ~15-30 s. Generous timeouts: Ray's start-up is slow on 2 shared cores.
"""

from __future__ import annotations

import time
import uuid
from collections import defaultdict

import pytest

from tapioca.bus import read_events
from tapioca.config.loader import load_config
from tapioca.config.schema import TrainConfig
from tapioca.trainers.trainer import read_metrics

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.e2e

STEPS = 40
B = 16
KILL_AT_STEP = 12


@pytest.fixture(scope="module")
def ray_run(broker, tmp_path_factory, fast_join):
    from tapioca.ops.ray_launcher import RayLauncher

    cfg = load_config(TrainConfig, None, [
        f"run_dir={tmp_path_factory.mktemp('runs')}", "experiment_name=ray", "trial_name=t0",
        f"total_train_steps={STEPS}", f"bus.bootstrap_servers={broker.bootstrap}", *fast_join,
        f"bus.topic_prefix=ray{uuid.uuid4().hex[:8]}",
        # Copy the first of two operands 0..3, one new token: learnt in ~40 steps.
        "train_dataset.task_options.op=copy", "train_dataset.task_options.max_digit=3",
        f"train_dataset.prompts_per_step={B}", "gconfig.n_samples=8", "gconfig.max_new_tokens=1",
        "rollout.max_head_offpolicyness=2", "actor.optimizer.lr=3e-3", "actor.checkpoint_every_steps=1",
        "scheduler.type=ray", "scheduler.max_restarts=3",
    ])
    launcher = RayLauncher(cfg)
    started = time.monotonic()
    try:
        launcher.start()
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            rows = read_metrics(cfg.run_path)
            if rows and rows[-1]["step"] >= KILL_AT_STEP:
                break
            dead = [c for c in launcher.children if c.proc.poll() not in (None, 0)]
            assert not dead, f"{dead[0].label} died:\n{dead[0].log_tail()}"
            time.sleep(0.5)
        else:
            pytest.fail("the trainer did not reach the kill point in time")
        launcher.restart("trainer")  # ray.kill: the actor and its process die; Ray restarts it
        summary = launcher.wait(timeout_s=900)
    finally:
        launcher.stop()
    wall = time.monotonic() - started
    print(f"\nray launcher run: {STEPS} steps in {wall:.0f} s (start to stop); "
          f"restarts {launcher.restart_counts}")
    return cfg, summary, launcher


def test_ray_is_shut_down_after_the_run(ray_run):
    assert not ray.is_initialized()


def test_learns_the_copy_task_to_the_local_launchers_calibrated_bar(ray_run):
    cfg, summary, _ = ray_run
    by_step = {r["step"]: r["reward/mean"] for r in read_metrics(cfg.run_path)}
    steps = sorted(by_step)
    first = sum(by_step[s] for s in steps[:5]) / 5
    last = sum(by_step[s] for s in steps[-5:]) / 5
    print(f"\nmean reward: first 5 steps {first:.3f} -> last 5 steps {last:.3f}")
    assert steps[-1] == STEPS
    assert first < 0.25
    assert last >= 0.6


def test_killed_trainer_actor_is_restarted_and_reported(ray_run):
    cfg, summary, launcher = ray_run
    assert launcher.restart_counts.get("trainer-0", 0) >= 1
    assert any("trainer-0 restarted by Ray" in n for n in launcher.notices)
    # Every version 1..STEPS published, none trained twice, no group in two versions.
    sets: dict[int, set[frozenset]] = defaultdict(set)
    for ev in read_events(cfg.bus, "progress"):
        if ev.group_ids:
            sets[ev.version].add(frozenset(ev.group_ids))
    assert sorted(sets) == list(range(1, STEPS + 1))
    assert all(len(v) == 1 for v in sets.values()), "a version was trained twice"
    trained = [g for v in sets.values() for g in next(iter(v))]
    assert len(trained) == len(set(trained)) == STEPS * B


def test_a_ray_node_that_fails_to_start_is_one_line_naming_the_local_launcher(tmp_path):
    """Ray's own exception (here its node's temp dir is a file, so the node cannot start)
    is said in one line: what failed, why, where Ray's logs are, and the local launcher
    (before: a 60-line traceback; issue 29, item 7)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    env = {**os.environ, "TAPIOCA_HOME": str(tmp_path / "home"), "RAY_TMPDIR": str(not_a_dir)}
    env.pop("TAPIOCA_BOOTSTRAP", None)
    done = subprocess.run([str(Path(sys.executable).parent / "tapioca"), "train", "--launcher",
                           "ray", f"run_dir={tmp_path / 'runs'}"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: Ray could not start its local node"), \
        done.stderr
    assert "NotADirectoryError" in lines[0] and "drop --launcher ray" in lines[0]
