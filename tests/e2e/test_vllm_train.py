"""End to end with a REAL vLLM server: `tapioca train` (every role its own process, the
embedded broker) whose rollout worker generates through the session's vLLM server
(``rollout.engine=vllm``, ``rollout.server.urls``), loading each new version from the
trainer's weights files. Checked from the events: every trajectory carries vLLM's
tokens, logprobs and per-token versions; later versions were generated after reloads;
with eta = 0 the trainer's importance weight pi_prox / pi_behav is 1 (vLLM's behaviour
logprobs equal the trainer's own forward); the rollout member reports its server on
fleet.v1."""

from __future__ import annotations

import math
import uuid

import pytest

from tapioca.bus import read_events
from tapioca.config.loader import load_config
from tapioca.config.schema import TrainConfig
from tapioca.ops.launcher import Launcher
from tapioca.schemas import FleetEvent, TrajectoryEvent
from tapioca.trainers.trainer import read_metrics

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

STEPS = 3


def test_tapioca_train_rollout_through_vllm(broker, vllm_server, tmp_path):
    cfg = load_config(TrainConfig, None, [
        f"run_dir={tmp_path}", "experiment_name=vllm", "trial_name=t0",
        f"total_train_steps={STEPS}", f"bus.bootstrap_servers={broker.bootstrap}",
        f"bus.topic_prefix=v{uuid.uuid4().hex[:8]}",
        f"model.path={vllm_server.model_dir}",
        "train_dataset.prompts_per_step=4", "gconfig.n_samples=4", "gconfig.max_new_tokens=6",
        "rollout.max_head_offpolicyness=0", "actor.optimizer.lr=1e-3",
        "rollout.engine=vllm", f"rollout.server.urls=[{vllm_server.url}]",
        "rollout.server.health_interval_s=1.0",
    ])
    launcher = Launcher(cfg)
    launcher.start()
    cfg = launcher.cfg  # resolved (runtime/run.py): the run's bus run id
    try:
        summary = launcher.wait(timeout_s=240)
    finally:
        launcher.stop()
    assert summary.steps == STEPS

    trajs = [e for e in read_events(cfg.bus, "trajectories") if isinstance(e, TrajectoryEvent)]
    assert len({t.group_id for t in trajs}) >= STEPS * 4
    for t in trajs:
        assert 1 <= len(t.output_ids) <= 6
        assert len(t.output_logprobs) == len(t.output_ids) == len(t.output_versions)
        assert all(math.isfinite(x) and x <= 0 for x in t.output_logprobs)
    versions = {v for t in trajs for v in t.output_versions}
    assert versions >= set(range(STEPS)), f"versions on tokens: {sorted(versions)}"

    rows = [r for r in read_metrics(cfg.run_path) if "actor/importance_weight_mean" in r]
    assert len(rows) == STEPS
    for r in rows:  # eta = 0: behaviour (vLLM) and proximal (trainer) policies are one
        assert r["trainer/staleness_max"] == 0
        assert abs(r["actor/importance_weight_mean"] - 1.0) < 1e-3, r

    beats = [e for e in read_events(cfg.bus, "fleet") if isinstance(e, FleetEvent)
             and e.role == "rollout" and "servers_up" in e.detail.get("describe", {})]
    assert beats and beats[-1].detail["describe"]["servers_up"] == 1
