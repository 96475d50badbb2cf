"""Trainer checkpoints: model, optimizer, RNG state, policy version, the groups trained
and rejected, and the consumer offsets that go with them — one file, written
atomically. The offsets are committed to Kafka only after the file is on disk, and the
trained-group set makes "no group trained twice" hold even if that commit is lost.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch


@dataclass
class TrainerProgress:
    version: int = 0
    trained_groups: list[str] = field(default_factory=list)
    rejected_groups: list[str] = field(default_factory=list)
    # "topic:partition" -> next offset safe to commit
    offsets: dict[str, int] = field(default_factory=dict)
    weights_path: str = ""
    weights_sha256: str = ""
    # Groups of the step that made `version`, re-announced after a restart.
    last_group_ids: list[str] = field(default_factory=list)
    # Rejected groups named on the latest step's weights event, and those not yet named
    # on any: both are announced again after a restart (the event may not have made it).
    last_rejected_ids: list[str] = field(default_factory=list)
    unannounced_rejections: list[str] = field(default_factory=list)
    # Versions that were rollbacks (WeightsEvent.rollbacks).
    rollbacks: int = 0


def save_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, progress: TrainerProgress) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    blob: dict[str, Any] = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "progress": progress.__dict__,
        "rng": {
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "python": random.getstate(),
            "numpy": np.random.get_state(),
        },
    }
    tmp = path.with_suffix(".tmp")
    torch.save(blob, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer) -> TrainerProgress | None:
    path = Path(path)
    if not path.exists():
        return None
    blob = torch.load(path, map_location="cpu", weights_only=False)
    model.load_state_dict(blob["model"])
    optimizer.load_state_dict(blob["optimizer"])
    rng = blob["rng"]
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    return TrainerProgress(**blob["progress"])
