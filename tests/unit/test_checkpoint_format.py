"""Checkpoints are safetensors + JSON: nothing is unpickled, so a planted checkpoint
cannot run code; old pickle checkpoints get a clear error and a migration that reads
them with torch.load(weights_only=True). No broker."""

from __future__ import annotations

import os
import pickle
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tapioca.config.optimizer import OptimizerConfig
from tapioca.config.schema import ActorConfig, ModelConfig
from tapioca.config.sections import TrainerSection
from tapioca.models.factory import build_tiny_model
from tapioca.trainers.checkpoint import (
    CheckpointFormatError,
    TrainerProgress,
    load_checkpoint,
    migrate_legacy,
    read_progress,
    save_checkpoint,
)
from tapioca.trainers.ppo_actor import PPOActor
from tapioca.trainers.trainer import Trainer


def make_trainer(run_dir: Path, seed: int = 0) -> Trainer:
    model = build_tiny_model(16, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64, max_position_embeddings=64, seed=seed)
    actor_cfg = ActorConfig(optimizer=OptimizerConfig(lr=1e-2))
    actor = PPOActor(model, actor_cfg, temperature=1.0, pad_token_id=0)
    section = TrainerSection(actor=actor_cfg, model=ModelConfig(), max_head_offpolicyness=1,
                             prompts_per_step=2, total_train_steps=100, temperature=1.0,
                             run_dir=str(run_dir), seed=0, stop_at_reward=None)
    return Trainer(section, actor=actor)


class _Payload:
    """What an attacker plants: unpickling it runs a command."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def plant(path: Path, marker: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        pickle.dump({"model": _Payload(marker), "optimizer": {}, "progress": {}}, f)


def take_steps(model, optimizer, n=2):
    for _ in range(n):
        loss = sum((p.float() ** 2).sum() for p in model.parameters())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def test_planted_pickle_trainer_pt_does_not_run_code(tmp_path):
    marker = tmp_path / "pwned"
    plant(tmp_path / "checkpoints" / "trainer.pt", marker)
    trainer = make_trainer(tmp_path)
    with pytest.raises(CheckpointFormatError, match="old pickle format.*tapioca checkpoint migrate"):
        trainer.init_state()
    assert not marker.exists()
    # The migration path reads with weights_only=True: it refuses the payload, never runs it.
    with pytest.raises(CheckpointFormatError, match="could not be read safely"):
        migrate_legacy(tmp_path / "checkpoints" / "trainer.pt")
    assert not marker.exists()
    trainer.sink.close()


def test_planted_pickle_critic_checkpoint_does_not_run_code(tmp_path):
    marker = tmp_path / "pwned"
    plant(tmp_path / "checkpoints" / "critic_v000003.pt", marker)
    trainer = make_trainer(tmp_path)
    with pytest.raises(CheckpointFormatError, match="old pickle format"):
        trainer.checkpoints.load_critic(3)
    assert not marker.exists()
    trainer.sink.close()


def test_round_trip_restores_model_optimizer_rng_and_progress(tmp_path):
    model = build_tiny_model(16, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64, max_position_embeddings=64, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    take_steps(model, optimizer)
    progress = TrainerProgress(version=7, trained_groups=[f"g{i}" for i in range(5000)],
                               offsets={"t.samples.v1:0": 12}, bus_run_id="demo.t0")
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, model, optimizer, progress)
    with open(path, "rb") as f:  # a safetensors file: 8-byte header length, then JSON
        header_len = int.from_bytes(f.read(8), "little")
        assert f.read(1) == b"{" and header_len < 1_000_000
    expected = (torch.rand(3), random.random(), np.random.rand())

    model2 = build_tiny_model(16, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                              intermediate_size=64, max_position_embeddings=64, seed=5)
    optimizer2 = torch.optim.AdamW(model2.parameters(), lr=1e-3)
    torch.manual_seed(99), random.seed(99), np.random.seed(99)
    restored = load_checkpoint(path, model2, optimizer2)
    assert restored == progress
    assert read_progress(path) == progress
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), k
    s1, s2 = optimizer.state_dict(), optimizer2.state_dict()
    assert s2["param_groups"][0]["betas"] == (0.9, 0.95) and s2["param_groups"][0]["lr"] == 1e-2
    for i in s1["state"]:
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(s1["state"][i][key], s2["state"][i][key])
    assert torch.equal(torch.rand(3), expected[0])
    assert (random.random(), np.random.rand()) == expected[1:]
    # Training goes on identically from memory and from the file.
    take_steps(model, optimizer, 1)
    take_steps(model2, optimizer2, 1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


def _legacy_save(path: Path, model, optimizer, progress: TrainerProgress) -> None:
    """What Tapioca wrote before: one torch.save pickle (trainers/checkpoint.py at 8ffd99f)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "progress": progress.__dict__,
                "rng": {"torch": torch.get_rng_state(), "cuda": None,
                        "python": random.getstate(), "numpy": np.random.get_state()}}, path)


def test_old_checkpoint_migrates_safely_and_resumes(tmp_path):
    t1 = make_trainer(tmp_path, seed=0)
    take_steps(t1.actor.model, t1.actor.optimizer)
    legacy = tmp_path / "checkpoints" / "trainer.pt"
    _legacy_save(legacy, t1.actor.model, t1.actor.optimizer,
                 TrainerProgress(version=4, trained_groups=["g0", "g1"]))
    target = migrate_legacy(legacy)
    assert target.name == "trainer.safetensors" and legacy.exists()
    t2 = make_trainer(tmp_path, seed=1)
    state = t2.init_state()
    assert state.progress.version == 4 and state.trained == {"g0", "g1"}
    for a, b in zip(t1.actor.model.parameters(), t2.actor.model.parameters()):
        assert torch.equal(a, b)
    t1.sink.close()
    t2.sink.close()


def test_checkpoint_migrate_command(tmp_path):
    from typer.testing import CliRunner

    from tapioca.ops.cli import app

    model = build_tiny_model(16, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                             intermediate_size=64, max_position_embeddings=64, seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _legacy_save(tmp_path / "checkpoints" / "sft.pt", model, optimizer, TrainerProgress(version=3))
    result = CliRunner().invoke(app, ["checkpoint", "migrate", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert read_progress(tmp_path / "checkpoints" / "sft.safetensors").version == 3
