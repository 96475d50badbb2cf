"""What a run writes to its run directory's disk at most at once (`tapioca plan`, and the
check `tapioca train` makes before any role starts).

Consumes a resolved :class:`~tapioca.config.schema.TrainConfig` and the policy's
:class:`~tapioca.trainers.memory_plan.ModelShape`; emits a :class:`DiskPlan`: the bytes of
each kind of file the trainer keeps under ``run_dir``, at the moment it holds the most.
Pure arithmetic: no torch.

* **The checkpoint** (trainers/checkpoint.py, one safetensors file): the policy's
  weights in ``actor.weights_dtype``, its fp32 masters (bf16 / fp16 weights with
  ``actor.fp32_master_weights``) and Adam's two fp32 moments -- 14 bytes a parameter for
  bf16 with masters (43 GB at 3B: measured on the H100, benchmarks/RESULTS.md issue 37);
  a LoRA run's checkpoint carries the adapter only; a critic (``gae``) adds its weights
  and moments. It is rewritten atomically (a new file beside the old, then a rename), so
  a run that checkpoints more than once (or resumes from one) holds **two** while the next
  one is written; a stop right after a step's checkpoint does not write it again.
* **The durable weights files** (weights/durable.py): one per ``weights.
  file_every_versions`` versions (every version with ``weights.transport=file``), in
  ``model.dtype``; the trainer keeps the last ``weights.keep_versions`` versions'
  files, and the next one beside them until the oldest goes.
* **final/** (trainers/final_model.py): the trained weights in ``model.dtype``, or the
  adapter.

Not planned: the archive (``archive.enabled``: the trajectories, small beside these),
logs, the broker's log segments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..trainers import memory_plan as mp

GIB = mp.GIB


@dataclass
class DiskPlan:
    checkpoint: float  # bytes of one checkpoint file (policy + critic)
    parts: dict[str, float] = field(default_factory=dict)  # what is on disk at the worst moment

    @property
    def total(self) -> float:
        return sum(self.parts.values())

    def summary(self) -> str:
        return ", ".join(f"{what} {b / GIB:.1f}" for what, b in self.parts.items() if b) + " GiB"


def checkpoints_written(cfg: Any) -> int:
    """How many times the trainer writes its checkpoint in a run of ``total_train_steps``
    (every ``actor.checkpoint_every_steps`` versions, and the last)."""
    steps, every = cfg.total_train_steps, cfg.actor.checkpoint_every_steps
    return steps // every + (0 if steps % every == 0 else 1)


def checkpoint_bytes(cfg: Any, shape: mp.ModelShape, train: mp.TrainShape) -> float:
    """One checkpoint file's bytes: the policy's weights, fp32 masters and Adam moments
    (the adapter's only, for LoRA; fp32 shards and moments, under FSDP), and a critic's."""
    w = mp.dtype_bytes(cfg.actor.weights_dtype)
    if train.sharded:
        # Every rank's fp32 shard and moments, in all (a LoRA run's: the adapter's).
        policy = (4 + 8) * (train.lora_params or shape.params)
    else:
        masters = 4 if (w < 4 and train.fp32_master_weights) else 0
        # Every weight (the adapter's only, for LoRA); masters and moments of the trained ones
        # (not of a frozen vision tower).
        weights = train.lora_params or shape.params
        policy = w * weights + (masters + 8) * train.trained_params(shape)
    critic = (w + 8) * shape.params if cfg.advantage.estimator == "gae" else 0.0
    return float(policy + critic)


def plan_disk(cfg: Any, shape: mp.ModelShape, *, resumed: bool = False) -> DiskPlan:
    """The most the run holds under ``run_dir`` at once (see the module docstring).
    ``resumed``: a checkpoint is there already, so the next one is written beside it."""
    train = mp.train_shape(cfg.actor, cfg.fsdp, model=shape, freeze_vision=cfg.vlm.freeze_vision_encoder)
    ckpt = checkpoint_bytes(cfg, shape, train)
    plan = DiskPlan(ckpt)
    plan.parts["checkpoint"] = ckpt
    if resumed or checkpoints_written(cfg) > 1:  # the next one is written beside the last
        plan.parts["checkpoint being rewritten"] = ckpt
    version_bytes = mp.dtype_bytes(cfg.model.dtype) * (train.lora_params or shape.params)
    every = 1 if cfg.weights.transport == "file" else cfg.weights.file_every_versions
    written = cfg.total_train_steps // every if every > 0 else 0
    if written:
        keep = cfg.weights.keep_versions  # versions, not files (weights/durable.py); 0: all
        kept = min(math.ceil(keep / every), written) if keep > 0 else written
        beside = 1 if written > kept else 0  # the next one is written before the oldest goes
        plan.parts[f"weights files ({kept} kept{' + the next' if beside else ''})"] = (kept + beside) * version_bytes
    plan.parts["final/"] = version_bytes
    return plan


def advice(cfg: Any, plan: DiskPlan) -> str:
    """The settings that lower what the run writes, in one line."""
    tips = []
    if "checkpoint being rewritten" in plan.parts:
        tips.append(f"actor.checkpoint_every_steps={cfg.total_train_steps} (one checkpoint, at the end: "
                    "no second copy while it is rewritten)")
    if not cfg.actor.lora.enabled:
        tips.append("actor.lora.enabled=true (checkpoints, weights files and final/ carry the adapter only)")
    if cfg.weights.transport != "file" and cfg.weights.file_every_versions:
        tips.append("a larger weights.file_every_versions")
    return "; ".join(tips)
