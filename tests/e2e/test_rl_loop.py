"""End to end: the whole loop (feeder, rollout, reward, advantage, trainer as separate
processes) on a real embedded broker, CPU, tiny model. One run serves every assertion:
learning, the staleness bound, no group lost or trained twice, and a trainer killed
mid-run (kill -9) resuming from its checkpoint with nothing repeated. Everything is
checked from the events on the topics, not from the processes' memory."""

from __future__ import annotations

import time
import uuid
from collections import defaultdict

import pytest

from tapioca.bus import read_events
from tapioca.config.loader import load_config
from tapioca.config.schema import TrainConfig
from tapioca.ops.launcher import Launcher
from tapioca.schemas import ProgressEvent, SampleEvent
from tapioca.schemas import topic as topic_spec
from tapioca.trainers.trainer import read_metrics

pytestmark = pytest.mark.e2e

ETA = 1
B = 32
# Operands 0..3 (16 pairs): the reward passes 0.5 by ~step 70 (0.68 at steps 76-80,
# 2026-12-06), where operands 0..9 took ~105 steps of 200.
STEPS = 100
KILL_AT_VERSION = 25


@pytest.fixture(scope="module")
def run(broker, tmp_path_factory, fast_join):
    prefix = f"e2e{uuid.uuid4().hex[:8]}"
    cfg = load_config(TrainConfig, None, [
        f"run_dir={tmp_path_factory.mktemp('runs')}", "experiment_name=e2e", "trial_name=t0",
        f"total_train_steps={STEPS}", f"bus.bootstrap_servers={broker.bootstrap}",
        f"bus.topic_prefix={prefix}",
        # copy-the-first-operand: the synthetic op a tiny model learns fastest
        "train_dataset.task_options.op=copy", "train_dataset.task_options.max_digit=3",
        f"train_dataset.prompts_per_step={B}", "gconfig.n_samples=8", "gconfig.max_new_tokens=3",
        f"rollout.max_head_offpolicyness={ETA}", "actor.optimizer.lr=1e-3", "actor.checkpoint_every_steps=1",
        *fast_join,  # also: the killed trainer's session expires in 2 s, not 6
    ])
    launcher = Launcher(cfg)
    launcher.start()
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            rows = read_metrics(cfg.run_path)
            if rows and rows[-1]["step"] >= KILL_AT_VERSION:
                break
            dead = [c for c in launcher.children if c.proc.poll() is not None]
            assert not dead, f"{dead[0].label} died:\n{dead[0].log_tail()}"
            time.sleep(0.5)
        else:
            pytest.fail("the trainer did not reach the kill point in time")
        killed_at = time.time()
        launcher.restart("trainer")
        summary = launcher.wait(timeout_s=600)
    finally:
        launcher.stop()
    return cfg, summary, killed_at


def _latest_per_version(cfg) -> dict[int, ProgressEvent]:
    latest: dict[int, ProgressEvent] = {}
    for ev in read_events(cfg.bus, "progress"):
        if ev.group_ids and (ev.version not in latest or ev.produced_at > latest[ev.version].produced_at):
            latest[ev.version] = ev
    return latest


def test_reward_rises(run):
    cfg, summary, _ = run
    rows = [r for r in read_metrics(cfg.run_path)]
    by_step = {}
    for r in rows:  # after the restart a step may be redone; the last write wins
        by_step[r["step"]] = r["reward/mean"]
    steps = sorted(by_step)
    first = sum(by_step[s] for s in steps[:5]) / 5
    last = sum(by_step[s] for s in steps[-5:]) / 5
    print(f"\nmean reward: first 5 steps {first:.3f} -> last 5 steps {last:.3f} "
          f"({len(steps)} steps, {summary.wall_s:.0f} s)")
    assert steps[-1] == STEPS
    assert first < 0.1
    assert last >= 0.5


def test_every_trained_group_within_staleness_bound(run):
    cfg, _, _ = run
    samples = {e.group_id: e for e in read_events(cfg.bus, "samples")}
    checked = 0
    for version, ev in _latest_per_version(cfg).items():
        trainer_version = version - 1  # version v is made by training at version v-1
        for gid in ev.group_ids:
            staleness = trainer_version - samples[gid].min_version
            assert 0 <= staleness <= ETA, (gid, version, staleness)
            checked += 1
    assert checked == STEPS * B


def test_no_group_trained_twice_or_lost(run):
    cfg, _, _ = run
    latest = _latest_per_version(cfg)
    assert sorted(latest) == list(range(1, STEPS + 1)), "versions are not contiguous"
    # A version announced twice (the restart's re-announcement) must name the same
    # groups: a redone step would show up here as a different set.
    sets: dict[int, set[frozenset]] = defaultdict(set)
    for ev in read_events(cfg.bus, "progress"):
        if ev.group_ids:
            sets[ev.version].add(frozenset(ev.group_ids))
    assert all(len(v) == 1 for v in sets.values()), "a version was trained twice"
    trained = [g for ev in latest.values() for g in ev.group_ids]
    assert len(trained) == len(set(trained)) == STEPS * B
    # Lost: a group the trainer read (below its committed offset, which is exact) that
    # is neither trained in some version nor named as rejected on a progress event.
    progress = read_events(cfg.bus, "progress")
    rejected = {g for ev in progress for g in ev.rejected_group_ids}
    trained_set = set(trained)
    assert not rejected & trained_set
    assert len(rejected) == max(ev.groups_rejected for ev in progress)
    first_offset: dict[str, tuple[int, int]] = {}
    from tapioca.bus import TopicReader, consumer_lag

    with TopicReader(cfg.bus, "samples") as reader:
        for rec in reader.records(idle_s=0.5):
            if isinstance(rec.event, SampleEvent):
                first_offset.setdefault(rec.event.group_id, (rec.source.partition, rec.source.offset))
    samples_topic = cfg.bus.topic(topic_spec("samples"))
    committed = {row.partition: row.committed for row in
                 consumer_lag(cfg.bus, [f"{cfg.bus.topic_prefix}.trainer"])
                 if row.topic == samples_topic and row.committed is not None}
    assert committed, "the trainer committed nothing"
    read = {gid for gid, (p, off) in first_offset.items() if off < committed.get(p, 0)}
    assert trained_set | rejected <= set(first_offset)
    assert read - trained_set - rejected == set(), "groups read by the trainer were lost"
    print(f"\n{len(trained_set)} groups trained, {len(rejected)} rejected, "
          f"{len(first_offset) - len(read)} not yet read when the run ended")


def test_trainer_killed_mid_run_resumes_without_repeating(run):
    cfg, _, killed_at = run
    weights = [e for e in read_events(cfg.bus, "progress") if e.group_ids]
    before = [e for e in weights if e.produced_at < killed_at]
    after = [e for e in weights if e.produced_at >= killed_at]
    assert before and after, "the kill must fall in the middle of the run"
    # The restarted trainer first re-announces the version of its checkpoint.
    resumed_from = min(e.version for e in after)
    # A checkpoint is written every step, before the step's progress event: no published
    # version is older than the checkpoint it resumes from.
    assert resumed_from >= max(e.version for e in before)
    trained_up_to_checkpoint = {g for e in before + after if e.version <= resumed_from
                                for g in e.group_ids}
    trained_after = {g for e in after if e.version > resumed_from for g in e.group_ids}
    assert trained_after, "the restarted trainer trained nothing"
    assert not trained_up_to_checkpoint & trained_after, "a group was trained again after the restart"
