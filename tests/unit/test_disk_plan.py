"""The disk plan (runtime/disk_plan.py) and the check `tapioca train` makes with it before
any role starts (ops/disk_check.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
from typer.testing import CliRunner

from tapioca.config.loader import load_config
from tapioca.config.schema import TrainConfig
from tapioca.ops import disk_check
from tapioca.runtime import disk_plan as dp
from tapioca.schemas.errors import EXIT_CONFIG, ConfigError
from tapioca.trainers import memory_plan as mp

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "gsm8k_grpo.yaml"
LORA_EXAMPLE = ROOT / "examples" / "lora" / "gsm8k_grpo_lora.yaml"
TAPIOCA = str(Path(sys.executable).parent / "tapioca")
GIB = dp.GIB
Q3 = mp.PRESETS["qwen2.5-3b"]
Usage = namedtuple("Usage", "total used free")


def qwen2_dir(root: Path, name: str, **dims) -> Path:
    """A Qwen2-shaped model directory (its config.json is all the plans read): Qwen2.5-3B's
    shape, or ``dims`` instead."""
    model = root / name
    model.mkdir(exist_ok=True)
    shape = {"vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 36, "num_attention_heads": 16,
             "num_key_value_heads": 2, "intermediate_size": 11008, "tie_word_embeddings": True, **dims}
    (model / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "max_position_embeddings": 32768, **shape}))
    return model


def test_a_bf16_checkpoint_is_14_bytes_a_parameter_and_is_rewritten_beside_the_last():
    # bf16 weights + fp32 masters + two fp32 Adam moments; the 3B example's was 43 GB on
    # the H100 (benchmarks/RESULTS.md, issue 37).
    cfg = load_config(TrainConfig, str(EXAMPLE), ["total_train_steps=20"])
    plan = dp.plan_disk(cfg, Q3)
    assert plan.checkpoint == 14 * Q3.params
    assert 42e9 < plan.checkpoint < 44e9
    assert plan.parts["checkpoint being rewritten"] == plan.checkpoint  # steps 10 and 20
    final = 2 * Q3.params
    assert plan.parts["final/"] == final
    # file_every_versions 10 of 20 steps: one file kept, the next beside it.
    assert plan.parts["weights files (1 kept + the next)"] == 2 * final
    # Checkpointing only at the end holds one copy.
    once = load_config(TrainConfig, str(EXAMPLE), ["total_train_steps=20", "actor.checkpoint_every_steps=20"])
    assert dp.checkpoints_written(once) == 1 and dp.checkpoints_written(cfg) == 2
    assert "checkpoint being rewritten" not in dp.plan_disk(once, Q3).parts
    assert dp.checkpoints_written(load_config(TrainConfig, str(EXAMPLE), ["total_train_steps=21"])) == 3


def test_the_weights_files_kept_are_weights_keep_versions_the_setting_the_trainer_reads(tmp_path):
    # The file transport writes every version: 8 kept of 20 (the default), 3, or all 20 (0).
    def files(*extra: str) -> dict:
        cfg = load_config(TrainConfig, str(EXAMPLE), ["total_train_steps=20", "weights.transport=file", *extra])
        return {k: v for k, v in dp.plan_disk(cfg, Q3).parts.items() if k.startswith("weights files")}

    version = 2 * Q3.params
    assert files() == {"weights files (8 kept + the next)": 9 * version}
    assert files("weights.keep_versions=3") == {"weights files (3 kept + the next)": 4 * version}
    assert files("weights.keep_versions=0") == {"weights files (20 kept)": 20 * version}
    with pytest.raises(ConfigError, match="weights.keep_versions must be >= 0"):
        load_config(TrainConfig, str(EXAMPLE), ["weights.keep_versions=-1"])
    # The trainer's publisher deletes by the same setting (weights/durable.py).
    from tapioca.weights.publisher import WeightPublisher

    cfg = load_config(TrainConfig, str(EXAMPLE), ["weights.transport=file", "weights.keep_versions=3"])
    publisher = WeightPublisher.from_config(cfg.weights, tmp_path, device="cpu", publish_dtype=None)
    assert publisher.writer.keep_versions == 3


def test_a_lora_runs_files_carry_the_adapter_only():
    cfg = load_config(TrainConfig, str(LORA_EXAMPLE), ["total_train_steps=20"])
    train = mp.train_shape(cfg.actor, cfg.fsdp, model=Q3)
    assert 0 < train.lora_params < Q3.params // 20
    plan = dp.plan_disk(cfg, Q3)
    assert plan.checkpoint == dp.checkpoint_bytes(cfg, Q3, train) < 16 * train.lora_params
    assert plan.parts["final/"] == mp.dtype_bytes(cfg.model.dtype) * train.lora_params
    assert plan.total < 2 * GIB  # 40 GiB and more for the full model
    # Under FSDP too: the sharded checkpoint holds the adapter's fp32 shards and moments.
    sharded = load_config(TrainConfig, str(LORA_EXAMPLE), ["total_train_steps=20", "fsdp.world_size=2"])
    assert dp.plan_disk(sharded, Q3).checkpoint == 12 * train.lora_params


def test_the_start_check_refuses_a_run_whose_checkpoints_will_not_fit_and_names_what_writes_less(
        tmp_path, monkeypatch):
    model = qwen2_dir(tmp_path, "qwen2.5-3b")
    cfg = load_config(TrainConfig, str(EXAMPLE), [f"model.path={model}", "total_train_steps=20",
                                                  f"run_dir={tmp_path / 'runs'}", "trial_name=t0"])
    # 70 GB free: 2 x 40 GiB of checkpoints do not fit, one does.
    monkeypatch.setattr(disk_check.shutil, "disk_usage", lambda _p: Usage(100e9, 30e9, 70e9))
    with pytest.raises(ConfigError) as err:
        disk_check.check_disk_at_start(cfg)
    line = str(err.value)
    assert "will not fit its disk" in line and "a checkpoint is 40.2 GiB" in line and "65.2 GiB free" in line
    assert "actor.checkpoint_every_steps=20" in line and "actor.lora.enabled=true" in line
    assert "launcher.check_disk=false" in line
    # What the line advises fits: one checkpoint, at the end.
    once = load_config(TrainConfig, str(EXAMPLE), [f"model.path={model}", "total_train_steps=20",
                                                   "actor.checkpoint_every_steps=20",
                                                   f"run_dir={tmp_path / 'runs'}", "trial_name=t0"])
    disk_check.check_disk_at_start(once)
    # A resumed run writes its next checkpoint beside the one it resumed from, and its own
    # files are already on the disk: they count as there.
    assert "checkpoint being rewritten" in dp.plan_disk(once, Q3, resumed=True).parts
    run = Path(cfg.run_path)
    (run / "checkpoints").mkdir(parents=True)
    ckpt = run / "checkpoints" / "trainer.safetensors"
    with open(ckpt, "wb") as f:
        f.truncate(int(40.3 * GIB))  # sparse: takes no disk here
    disk_check.check_disk_at_start(cfg)
    off = load_config(TrainConfig, str(EXAMPLE), [f"model.path={model}", "launcher.check_disk=false"])
    monkeypatch.setattr(disk_check.shutil, "disk_usage", lambda _p: Usage(1, 1, 0))
    disk_check.check_disk_at_start(off)  # skipped


def test_tapioca_plan_prints_the_disk_and_tapioca_train_refuses_before_any_role_starts(tmp_path):
    from tapioca.ops.cli import app

    js = CliRunner().invoke(app, ["plan", "--config", str(EXAMPLE), "--model", "qwen2.5-3b",
                                  "total_train_steps=20", "--gpu-gib", "80", "-o", "json"])
    assert js.exit_code == 0, js.output
    (row,) = json.loads(js.output)
    assert 40 < row["disk"]["checkpoint_gib"] < 40.5 and row["disk"]["total_gib"] > 80
    table = CliRunner().invoke(app, ["plan", "--config", str(EXAMPLE), "--model", "qwen2.5-3b",
                                     "total_train_steps=20", "--gpu-gib", "80"])
    assert "disk under run_dir at most" in table.output and "a checkpoint is 40.2 GiB" in table.output
    # A 72B-shaped model in float32, checkpointed at every step: 1.7 TB of checkpoints
    # while one is rewritten, more than this machine's disk; refused before any role starts.
    model = qwen2_dir(tmp_path, "qwen2.5-72b", vocab_size=152064, hidden_size=8192, num_hidden_layers=80,
                      num_attention_heads=64, num_key_value_heads=8, intermediate_size=29568,
                      tie_word_embeddings=False)
    run_dir = tmp_path / "runs"
    env = {**os.environ, "TAPIOCA_HOME": str(tmp_path / "home")}
    done = subprocess.run([TAPIOCA, "train", "--config", str(EXAMPLE), f"model.path={model}",
                           "launcher.check_memory=false", "actor.device=cpu", "rollout.device=cpu",
                           "weights.transport=file", "total_train_steps=100000", "actor.checkpoint_every_steps=1",
                           "model.dtype=float32", f"run_dir={run_dir}", "trial_name=t0"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == EXIT_CONFIG, done.stdout + done.stderr
    lines = [ln for ln in done.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: the run's files will not fit its disk"), lines
    assert not (run_dir / "gsm8k-grpo" / "t0" / "logs").exists()  # no role, no broker started
