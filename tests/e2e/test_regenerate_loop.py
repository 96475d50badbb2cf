"""End to end: a real eta 2 run (feeder, rollout, reward, advantage and trainer as role
threads on the embedded broker, the paged engine on a CPU) logs a sampling seed on every
trajectory, and `tapioca regenerate` reproduces its trajectories bit for bit from the log:
the prompt, the seed and each logged version's weights file -- tokens, logprobs and the
per-token versions, a trajectory made across a weights switch included.

The rollout engine runs one row at a time with no prefix cache, so the regeneration (one
row) computes the very same logits: the batch a trajectory shared is the one thing the
log does not replay (docs/provenance.md; tests/unit/test_regenerate.py measures it)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tapioca.bus import read_events
from tapioca.config.loader import load_config, to_yaml
from tapioca.config.schema import TrainConfig
from tapioca.ops.cli import app
from tapioca.runtime.builders import build_role
from tapioca.runtime.regenerate import regenerate
from tapioca.runtime.run import create_tiny_checkpoint
from tapioca.schemas.events import PromptEvent, TrajectoryEvent
from tapioca.trainers.trainer import read_metrics

pytestmark = pytest.mark.e2e

STEPS = 4
ETA = 2


def _run_loop(cfg: TrainConfig, start_runner, timeout_s: float = 120.0) -> None:
    runners = {name: start_runner(build_role(name, cfg), cfg.bus, max_seconds=timeout_s)
               for name in ("feeder", "rollout", "reward", "advantage", "trainer")}
    deadline = time.monotonic() + timeout_s
    while runners["trainer"].thread.is_alive() and time.monotonic() < deadline:
        for name, rt in runners.items():
            assert rt.error is None, f"{name} failed: {rt.error!r}"
        time.sleep(0.2)
    for rt in runners.values():
        rt.finish()


def test_trajectories_of_an_eta_2_run_regenerate_bit_for_bit(broker, bus_cfg, fast_join, tmp_path, start_runner):
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tiny = create_tiny_checkpoint(tmp_path / "model")
    cfg = load_config(TrainConfig, None, [
        f"run_dir={tmp_path / 'runs'}", "experiment_name=regen", "trial_name=t0", f"model.path={tiny}",
        f"bus.bootstrap_servers={broker.bootstrap}", f"bus.topic_prefix={bus_cfg.topic_prefix}", *fast_join,
        f"total_train_steps={STEPS}", f"rollout.max_head_offpolicyness={ETA}",
        "train_dataset.prompts_per_step=2", "gconfig.n_samples=2", "gconfig.max_new_tokens=8",
        "rollout.max_batch_size=1", "rollout.prefix_caching=false", "actor.optimizer.lr=1e-2",
    ])
    _run_loop(cfg, start_runner)
    assert [r["step"] for r in read_metrics(cfg.run_path)] == list(range(1, STEPS + 1))
    run_dir = Path(cfg.run_path)
    (run_dir / "config.yaml").write_text(to_yaml(cfg))  # what `tapioca train` leaves

    trajs = [e for e in read_events(cfg.bus, "trajectories") if isinstance(e, TrajectoryEvent)]
    prompts = {e.group_id: dict(e.sampling) for e in read_events(cfg.bus, "prompts")
               if isinstance(e, PromptEvent)}
    assert trajs and all(t.sampling_seed is not None for t in trajs)
    assert len({t.sampling_seed for t in trajs}) == len(trajs)  # a seed per request
    assert max(v for t in trajs for v in t.output_versions) >= 1  # made by trained versions too
    spanning = 0
    for t in trajs:
        result, cmp = regenerate(cfg, t, prompts.get(t.group_id), run_dir=run_dir)
        assert cmp.identical, (t.traj_id, t.output_versions, cmp)
        assert result.output_ids == t.output_ids
        assert result.output_logprobs == t.output_logprobs, t.traj_id  # bit for bit
        assert result.output_versions == t.output_versions
        assert result.seed == t.sampling_seed
        spanning += len(set(t.output_versions)) > 1
    print(f"\n{len(trajs)} trajectories regenerated bit for bit, {spanning} across a weights switch")

    # The command: exit 0 and the verdict, from the run directory and the broker.
    pick = max(trajs, key=lambda t: (len(set(t.output_versions)), max(t.output_versions)))
    res = CliRunner().invoke(app, ["--bootstrap-server", broker.bootstrap, "regenerate",
                                   "--run-dir", str(run_dir), "--traj-id", pick.traj_id,
                                   "--exact-logprobs", "-o", "json"])
    assert res.exit_code == 0, (res.output, res.exception)
    report = json.loads(res.output.strip().splitlines()[-1])
    assert report["ok"] and report["identical"] and report["logprobs_identical"]
    assert report["versions"] == sorted(set(pick.output_versions))
