"""Sharded trainer checkpoints: every rank writes its own shards, nothing is pickled.

Consumes an FSDP2-sharded model and its optimizer on every rank, and the trainer's
:class:`~tapioca.trainers.checkpoint.TrainerProgress` on rank 0; emits files under the
checkpoint directory:

- ``sharded/v<version>-<random>/`` — torch.distributed.checkpoint (DCP) with its Hugging Face
  safetensors storage (``HuggingFaceStorageWriter(save_distributed=True)``): each rank
  writes ``shard-<rank>-model-00001-of-00001.safetensors`` holding its slices of the
  weights and of the Adam moments, with each slice's offsets as JSON in the safetensors
  header. DCP's default ``FileSystemWriter`` stores its ``.metadata`` with ``pickle``
  and its reader unpickles it; the safetensors reader rebuilds that metadata from the
  headers instead, so loading executes nothing from the files (the rule of
  trainers/checkpoint.py). It also reshards: a checkpoint of N ranks loads on M.
- ``sharded/v<version>-<random>/extra.json`` — what is not a tensor: the optimizer's
  param_groups (lr, betas, ... by parameter name) and every rank's RNG state.
- ``trainer-sharded.json`` — the progress (version, trained and rejected groups, the
  consumer offsets) and which ``sharded/v<version>-<random>`` holds the tensors. Every
  save writes a fresh directory; rank 0 replaces this file with an atomic rename after
  every rank finished writing (a barrier), so it only ever names a complete directory;
  the other directories are deleted only after it (a crash anywhere keeps the last
  checkpoint loadable).
"""

from __future__ import annotations

import base64
import json
import random
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..schemas.errors import ConfigError
from .checkpoint import TrainerProgress, durable_replace, fsync_path

PROGRESS_FILE = "trainer-sharded.json"
SHARDS_DIR = "sharded"
FORMAT = "tapioca-sharded-v1"


def progress_path(ckpt_path: Path) -> Path:
    """Where the sharded progress file lives beside the single-process checkpoint."""
    return Path(ckpt_path).parent / PROGRESS_FILE


def _flat_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool = False):
    """(tensors by flat name, the optimizer state dict) of this rank's shards.
    ``trainable_only``: the trainable parameters only (a LoRA run's adapter)."""
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    flat, seen = {}, set()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    for k, v in get_model_state_dict(model).items():
        if trainable_only and k not in trainable:
            continue  # the frozen base: model.path holds it
        local = v.to_local() if hasattr(v, "to_local") else v
        if local.numel() and local.data_ptr() in seen:
            continue  # a tied weight (the LM head is the embedding): stored once
        seen.add(local.data_ptr())
        flat[f"model.{k}"] = v
    osd = get_optimizer_state_dict(model, optimizer)
    for fqn, st in osd["state"].items():
        for key, value in st.items():
            if isinstance(value, torch.Tensor):
                flat[f"optim.{fqn}.{key}"] = value
    return flat, osd


def _rng_state() -> dict[str, Any]:
    def b64(t: torch.Tensor) -> str:
        return base64.b64encode(t.numpy().tobytes()).decode()

    state = {"torch": b64(torch.get_rng_state())}
    if torch.cuda.is_available():
        state["cuda"] = b64(torch.cuda.get_rng_state())
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    def tensor(s: str) -> torch.Tensor:
        return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)

    torch.set_rng_state(tensor(state["torch"]))
    if state.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensor(state["cuda"]))


def save(ckpt_path: Path, version: int, model, optimizer, channel,
         progress: TrainerProgress | None, *, trainable_only: bool = False) -> None:
    """Collective: every rank calls it; ``progress`` only matters on rank 0.

    Crash-safe: the tensors go to a directory no record names yet (a fresh one, even when
    this version was saved before); the record is replaced with one atomic rename; only
    then are the other directories deleted. Whenever it stops, the record names a
    complete directory: the new one, or the previous one, untouched."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    root = Path(ckpt_path).parent
    shards_root = root / SHARDS_DIR
    leader = channel.info.leader
    name = None
    if leader:
        shards_root.mkdir(parents=True, exist_ok=True)
        name = Path(tempfile.mkdtemp(prefix=f"v{version:06d}-", dir=shards_root)).name
    out = shards_root / channel.broadcast(name)  # the directory exists before anyone writes
    flat, osd = _flat_state(model, optimizer, trainable_only)
    dcp.save(flat, storage_writer=HuggingFaceStorageWriter(str(out), save_distributed=True))
    rngs = channel.gather(_rng_state())
    dist.barrier(group=channel.group)
    if not leader:
        return
    extra = {"format": FORMAT, "world_size": channel.info.world_size,
             "param_groups": osd["param_groups"], "rng": rngs,
             "python_rng": _python_rng(), "numpy_rng": _numpy_rng()}
    (out / "extra.json").write_text(json.dumps(extra))
    record = {"format": FORMAT, "shards": str(out.relative_to(root)),
              "world_size": channel.info.world_size, "progress": progress.__dict__,
              "trainable_only": trainable_only}
    path = progress_path(ckpt_path)
    tmp = path.with_suffix(".tmp")
    # Every rank's shard files, extra.json and the directory reach the disk before the
    # record names them (a power loss must not leave a record of unwritten data).
    for file in out.rglob("*"):
        if file.is_file():
            fsync_path(file)
    fsync_path(out)
    fsync_path(shards_root)
    tmp.write_text(json.dumps(record))
    durable_replace(tmp, path)
    # Every other directory: older checkpoints and half-written ones of failed saves.
    for old in shards_root.glob("v*"):
        if old != out:
            shutil.rmtree(old, ignore_errors=True)


def read_record(ckpt_path: Path) -> dict[str, Any] | None:
    """Rank 0: the progress record, or None for a fresh run; a :class:`ConfigError` that
    says what to do for a record this trainer cannot resume from."""
    path = progress_path(ckpt_path)
    if path.exists():
        move_away = (f"to start the run from scratch instead, move {path} and {path.parent / SHARDS_DIR} "
                     "out of the checkpoint directory")
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(
                f"the sharded trainer checkpoint record {path} cannot be read ({exc}); it is only "
                "ever replaced whole, so the file was edited or the disk is damaged: restore it "
                f"from a backup, or {move_away}") from exc
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            found = record.get("format") if isinstance(record, dict) else type(record).__name__
            raise ConfigError(
                f"{path} is not a Tapioca sharded checkpoint record (format {found!r}, expected "
                f"{FORMAT!r}): resume with the Tapioca version that wrote it, or {move_away}")
        shards = path.parent / str(record.get("shards", ""))
        if not record.get("shards") or not (shards / "extra.json").is_file():
            raise ConfigError(
                f"{path} names the shard directory {shards}, which is missing or incomplete (no "
                "extra.json): it was deleted or moved. Put it back, or "
                f"{move_away}")
        return record
    single = [p for p in Path(ckpt_path).parent.glob("trainer.*") if p.suffix != ".tmp"]
    if single:
        raise ConfigError(f"{single[0]} was written by the single-process trainer "
                          "(fsdp.world_size=1): resume this run with fsdp.world_size=1, or start "
                          "a new trial for the sharded trainer")
    return None


def load(ckpt_path: Path, shards: str, model, optimizer, channel, *, trainable_only: bool = False) -> None:
    """Collective: load ``shards`` (a directory under the checkpoint dir) on every rank."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    src = Path(ckpt_path).parent / shards
    flat, osd = _flat_state(model, optimizer, trainable_only)  # also creates the Adam state to load into
    dcp.load(flat, storage_reader=HuggingFaceStorageReader(str(src)))
    extra = json.loads((src / "extra.json").read_text())
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Not strict: a tied weight was stored under one of its names only.
    set_model_state_dict(model, {k[len("model."):]: v for k, v in flat.items() if k.startswith("model.")},
                         options=StateDictOptions(strict=False))
    for fqn, st in osd["state"].items():
        for key in st:
            if f"optim.{fqn}.{key}" in flat:
                st[key] = flat[f"optim.{fqn}.{key}"]
    osd["param_groups"] = extra["param_groups"]
    set_optimizer_state_dict(model, optimizer, osd)
    rank = channel.info.rank
    # A checkpoint of fewer ranks leaves the new ranks with their own seeds.
    if rank < len(extra["rng"]):
        _set_rng_state(extra["rng"][rank])
    if channel.info.leader:
        random.setstate(_tuples(extra["python_rng"]))
        kind, keys, pos, has_gauss, gauss = extra["numpy_rng"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))


def _python_rng() -> list:
    return list(random.getstate())


def _numpy_rng() -> list:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return [kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)]


def _tuples(state: list) -> tuple:
    version, internal, gauss = state
    return version, tuple(internal), gauss
