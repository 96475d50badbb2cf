"""Rollout routing replay (R3) through the real loop: a tiny random Qwen3-MoE, the feeder,
the paged engine's rollout worker, the reward scorer, the advantage processor, the
trainer and the archiver, each a RoleRunner thread built as the launcher builds it, on
the module's embedded broker (fp32, synchronous: eta 0, so the rollout's weights are
the trainer's pre-update weights at every step).

The CPU measure of issue 23: the trainer's own router picks the recorded experts on
100% of the replayed tokens (``actor/router_replay_agreement`` == 1.0), so the routes
the trainer replays are the rollout's, token for token and layer for layer. The routes
go through the blob store (``rollout.routed_experts_inline_max_bytes=0``), ride the
trajectories, the samples and the archive, and no sequence trains without them.
"""

from __future__ import annotations

import time

import pytest

from tapioca.bus.archive import iter_events
from tapioca.config.loader import load_config
from tapioca.config.schema import TrainConfig
from tapioca.media.store import run_blob_store
from tapioca.runtime.builders import build_role
from tapioca.runtime.run import create_tiny_checkpoint
from tapioca.schemas.events import SampleEvent, TrajectoryEvent
from tapioca.schemas.routes import decode_routes
from tapioca.trainers.trainer import read_metrics

pytestmark = pytest.mark.e2e

STEPS = 2


def test_r3_trainer_routes_equal_the_rollouts_on_every_token(broker, bus_cfg, fast_join, tmp_path, start_runner,
                                                             wait_until, one_torch_thread):
    ckpt = create_tiny_checkpoint(tmp_path / "model", "synthetic", arch="qwen3_moe", hidden_size=32,
                                  num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=64,
                                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16)
    cfg = load_config(TrainConfig, None, [
        f"run_dir={tmp_path}", "trial_name=t0", f"model.path={ckpt}", f"total_train_steps={STEPS}",
        "train_dataset.prompts_per_step=2", "gconfig.n_samples=3", "gconfig.max_new_tokens=4",
        "rollout.max_head_offpolicyness=0", "actor.mb_max_tokens=256", "actor.moe.router_replay=R3",
        "actor.moe.router_replay_missing=reject", "rollout.routed_experts_inline_max_bytes=0",
        f"archive.dir={tmp_path / 'archive'}", "archive.roll_interval_s=0.5",
        f"bus.bootstrap_servers={broker.bootstrap}", f"bus.topic_prefix={bus_cfg.topic_prefix}", *fast_join,
    ])
    roles = {name: build_role(name, cfg)
             for name in ("feeder", "rollout", "reward", "advantage", "trainer", "archiver")}
    assert type(roles["rollout"].engine).__name__ == "PagedEngine"
    runners = {name: start_runner(role, cfg.bus, max_seconds=300) for name, role in roles.items()}
    deadline = time.monotonic() + 300
    while runners["trainer"].thread.is_alive() and time.monotonic() < deadline:
        for name, rt in runners.items():
            assert rt.error is None, f"{name} failed: {rt.error!r}"
        time.sleep(0.2)
    rows = read_metrics(cfg.run_path)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1)), rows
    for r in rows:
        # 2 groups x 3 samples, prompt + 4 output tokens - 1 each: well over 30 tokens a step.
        assert r["actor/router_replay_tokens"] > 30
        assert r["actor/router_replay_agreement"] == 1.0, r
        assert r["trainer/routes_missing"] == 0.0
    # The archive holds the trajectories and samples with their routes' blobs, named by
    # SHA-256; the blobs decode to [prompt + output - 1, 2 MoE layers, top-2] ids < 8.
    store = run_blob_store(cfg.run_path)

    for name, rt in runners.items():
        if name != "archiver":
            rt.finish()
    time.sleep(1.5)  # the archiver reads the others' last events, then writes its files on stop
    runners["archiver"].finish()
    events = [e for _, e in iter_events(cfg.archive.dir) if isinstance(e, (TrajectoryEvent, SampleEvent))]
    trajs = [e for e in events if isinstance(e, TrajectoryEvent)]
    seqs = [(e, s) for e in events if isinstance(e, SampleEvent) for s in e.sequences]
    assert len(trajs) >= STEPS * 6 and len(seqs) >= STEPS * 6
    for t in trajs:
        r = t.routed_experts
        assert r.blob_sha256 and not r.data_b64 and (r.num_layers, r.top_k, r.dtype) == (2, 2, "uint8")
        ids = decode_routes(r, store)
        assert ids.shape == (len(t.prompt_ids) + len(t.output_ids) - 1, 2, 2) and int(ids.max()) < 8
    by_traj = {t.traj_id: t.routed_experts for t in trajs}
    assert all(s.routed_experts == by_traj[s.traj_id] for _, s in seqs)
