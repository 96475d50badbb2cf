"""Trainer checkpoints: model, optimizer, RNG state, policy version, the groups trained
and rejected, and the consumer offsets that go with them — one safetensors file,
written atomically. The offsets are committed to Kafka only after the file is on disk,
and the trained-group set makes "no group trained twice" hold even if that commit is
lost.

Format (``FORMAT`` in the safetensors header metadata): every tensor is a safetensors
tensor (``model/<name>``, ``optimizer/<param index>/<key>``, ``rng/torch``,
``rng/cuda/<i>``), and everything else (progress, optimizer hyper-parameters, Python
and NumPy RNG state, tied-weight aliases) is one UTF-8 JSON document stored as the
uint8 tensor ``meta/json`` (a tensor, not header metadata: a long run's trained-group
list can outgrow the header's size limit). Nothing is unpickled on load, so a
checkpoint file cannot run code. :func:`read_meta` reads the JSON without the tensors.

Checkpoints of earlier versions (``*.pt``, written with ``torch.save``) are refused
with a message naming :func:`migrate_legacy` (``tapioca checkpoint migrate RUN_DIR``),
which reads them with ``torch.load(weights_only=True)`` -- that unpickler builds only
tensors and plain containers (plus NumPy's array reconstructor for the RNG state) and
refuses anything else, so a planted file cannot run code through it either.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ..schemas.errors import EXIT_CONFIG, TapiocaError
from ..weights.files import atomic_write

FORMAT = "tapioca-checkpoint-v1"
SUFFIX = ".safetensors"
LEGACY_SUFFIX = ".pt"


class CheckpointFormatError(TapiocaError):
    """A checkpoint is in a format Tapioca will not load (an old pickle) or is damaged."""

    exit_code = EXIT_CONFIG  # no restart can fix it


def fsync_path(path: Path) -> None:
    """Flush a file's bytes, or a directory's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable_replace(tmp: Path, path: Path) -> None:
    """``os.replace(tmp, path)`` that survives a power loss, not only a crash: the bytes
    reach the disk before the rename, and the rename before this returns."""
    fsync_path(tmp)
    os.replace(tmp, path)
    fsync_path(Path(path).parent)


# safetensors' dtype names (the inverse of weights/files.py's reader table).
_ST_NAMES = {torch.float64: "F64", torch.float32: "F32", torch.bfloat16: "BF16",
             torch.float16: "F16", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
             torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


def write_tensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor]) -> None:
    """``tensors`` (contiguous, on the CPU) as a safetensors file with this module's
    ``FORMAT``, atomically and durably (:func:`durable_replace`). Written here rather than
    by ``safetensors.torch.save_file``, whose Rust writer reports a full disk as a
    SafetensorError string: Python's writes raise the OSError (ENOSPC, EIO, ...) that
    ``atomic_write`` turns into StorageError, removing the temp file. Tensors are laid out
    widest dtype first, so each is aligned to its element size."""
    order = sorted(tensors, key=lambda k: (-tensors[k].element_size(), k))
    header: dict[str, Any] = {"__metadata__": {"format": FORMAT}}
    offset = 0
    for name in order:
        t = tensors[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors pads
    with atomic_write(path, durable_replace) as tmp, open(tmp, "wb") as f:
        f.write(len(blob).to_bytes(8, "little"))
        f.write(blob)
        for name in order:
            if tensors[name].numel():
                f.write(memoryview(tensors[name].reshape(-1).view(torch.uint8).numpy()))


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
    # Rejected groups named on the latest step's progress event, and those not yet named
    # on any: both are announced again after a restart (the event may not have made it).
    last_rejected_ids: list[str] = field(default_factory=list)
    unannounced_rejections: list[str] = field(default_factory=list)
    # Versions that were rollbacks (ProgressEvent.rollbacks).
    rollbacks: int = 0
    # The bus run id (one per broker lifetime, ops/launcher.py) the offsets above belong
    # to; "" for checkpoints written before it was recorded.
    bus_run_id: str = ""
    # Trained steps and rejected groups when this bus run id's log began: the head gate
    # counts only what happened on this log (ProgressEvent.base_steps / base_rejected).
    base_steps: int = 0
    base_rejected: int = 0
    # Groups trained or rejected when this log began: the launcher counts the groups a
    # lost log dropped from the trainer's count of this log's (Trainer.describe).
    base_groups: int = 0

    @property
    def trained_steps(self) -> int:
        """The versions that were trained steps: a rollback (an operator's, or a trainer
        resumed below the log's highest version) republishes earlier weights."""
        return self.version - self.rollbacks

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TrainerProgress":
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


# ---------------------------------------------------------------------- JSON of Python values


def _jsonable(value: Any) -> Any:
    """Tuples are kept apart from lists (optimizers check ``betas`` is a tuple)."""
    if isinstance(value, tuple):
        return {"__tuple__": [_jsonable(v) for v in value]}
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    return value


def _from_jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__tuple__"}:
            return tuple(_from_jsonable(v) for v in value["__tuple__"])
        return {k: _from_jsonable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_from_jsonable(v) for v in value]
    return value


# ---------------------------------------------------------------------- model + optimizer


def _model_tensors(state_dict: dict[str, torch.Tensor], prefix: str,
                   tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """Add a module's tensors under ``prefix``; tied tensors (shared storage, which
    safetensors refuses) are stored once. Returns {alias: stored name}."""
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in state_dict.items():
        key = (t.data_ptr(), tuple(t.shape), t.dtype, t.stride()) if t.numel() else None
        if key is not None and key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        tensors[prefix + name] = t.detach().contiguous().cpu()
    return aliases


def _optimizer_parts(state: dict[str, Any], prefix: str,
                     tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    for idx, entries in state["state"].items():
        plain = {}
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{prefix}{idx}/{key}"] = value.detach().contiguous().cpu()
            else:
                plain[key] = value
        values[str(idx)] = plain
    return {"state": values, "param_groups": state["param_groups"]}


def _optimizer_state(meta: dict[str, Any], prefix: str,
                     tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    state: dict[int, dict[str, Any]] = {int(i): dict(v) for i, v in meta["state"].items()}
    for name, t in tensors.items():
        if name.startswith(prefix):
            idx, _, key = name[len(prefix):].partition("/")
            state.setdefault(int(idx), {})[key] = t
    return {"state": state, "param_groups": meta["param_groups"]}


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters of ``model`` (a LoRA run: the adapter) by state-dict name."""
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def save_state(path: str | os.PathLike, *, model: torch.nn.Module | None = None,
               optimizer: torch.optim.Optimizer | None = None,
               meta: dict[str, Any] | None = None, rng: bool = False,
               trainable_only: bool = False) -> None:
    """Write a module (and its optimizer) with a JSON document, atomically; a full disk
    raises StorageError and leaves the previous file (and no temp file).
    ``trainable_only``: the module's trainable parameters only (a LoRA run's adapter;
    the frozen base is ``model.path``, never copied into a checkpoint)."""
    path = Path(path)
    tensors: dict[str, torch.Tensor] = {}
    doc: dict[str, Any] = {"meta": meta or {}}
    if model is not None:
        sd = trainable_state_dict(model) if trainable_only else model.state_dict()
        doc["model_aliases"] = _model_tensors(sd, "model/", tensors)
        doc["trainable_only"] = trainable_only
    if optimizer is not None:
        doc["optimizer"] = _optimizer_parts(optimizer.state_dict(), "optimizer/", tensors)
    if rng:
        tensors["rng/torch"] = torch.get_rng_state()
        if torch.cuda.is_available():
            for i, s in enumerate(torch.cuda.get_rng_state_all()):
                tensors[f"rng/cuda/{i}"] = s
        kind, keys, pos, has_gauss, gauss = np.random.get_state()
        doc["rng"] = {"python": random.getstate(),
                      "numpy": [kind, [int(k) for k in keys], pos, has_gauss, gauss]}
    blob = json.dumps(_jsonable(doc)).encode()
    tensors["meta/json"] = torch.frombuffer(bytearray(blob), dtype=torch.uint8) if blob else \
        torch.zeros(0, dtype=torch.uint8)
    write_tensors(path, tensors)


def _check_format(path: Path) -> None:
    if not path.exists():
        return
    try:
        with safe_open(str(path), framework="pt") as f:
            fmt = (f.metadata() or {}).get("format")
    except Exception as exc:  # not a safetensors file at all
        raise CheckpointFormatError(
            f"{path} is not a Tapioca checkpoint ({type(exc).__name__}: {exc}); move it away "
            "to start this run from scratch") from None
    if fmt != FORMAT:
        raise CheckpointFormatError(f"{path} has format {fmt!r}, not {FORMAT!r}: it was not "
                                    "written by this version of Tapioca")


def read_meta(path: str | os.PathLike) -> dict[str, Any] | None:
    """The JSON document of a checkpoint (no model tensors are read); None if absent."""
    path = Path(path)
    refuse_legacy(path)
    if not path.exists():
        return None
    _check_format(path)
    with safe_open(str(path), framework="pt") as f:
        blob = f.get_tensor("meta/json")
    return _from_jsonable(json.loads(bytes(blob.numpy()).decode() or "{}"))


def load_state(path: str | os.PathLike, *, model: torch.nn.Module | None = None,
               optimizer: torch.optim.Optimizer | None = None,
               rng: bool = False, trainable_only: bool = False) -> dict[str, Any] | None:
    """Load what :func:`save_state` wrote into ``model`` / ``optimizer`` (and the RNGs);
    returns the ``meta`` document, or None when there is no checkpoint.
    ``trainable_only``: the file holds the trainable parameters only (and must)."""
    path = Path(path)
    refuse_legacy(path)
    if not path.exists():
        return None
    _check_format(path)
    tensors = load_file(str(path))
    doc = _from_jsonable(json.loads(bytes(tensors.pop("meta/json").numpy()).decode() or "{}"))
    if model is not None:
        sd = {k[len("model/"):]: v for k, v in tensors.items() if k.startswith("model/")}
        for alias, stored in doc.get("model_aliases", {}).items():
            sd[alias] = sd[stored]
        if bool(doc.get("trainable_only", False)) != trainable_only:
            raise CheckpointFormatError(
                f"{path} holds {'only the adapter' if doc.get('trainable_only') else 'every weight'} "
                f"but this run trains {'an adapter' if trainable_only else 'every weight'}: it was "
                "written with another actor.lora.enabled; resume with that setting, or start a new trial")
        if trainable_only:
            own = trainable_state_dict(model)
            if set(sd) != set(own):
                raise CheckpointFormatError(
                    f"{path}'s adapter does not fit this model's (e.g. "
                    f"{sorted(set(sd) ^ set(own))[:2]}): resume with the actor.lora.target_modules "
                    "and actor.lora.rank it was written with, or start a new trial")
            model.load_state_dict(sd, strict=False)
        else:
            model.load_state_dict(sd)
    if optimizer is not None and "optimizer" in doc:
        optimizer.load_state_dict(_optimizer_state(doc["optimizer"], "optimizer/", tensors))
    if rng and "rng" in doc:
        torch.set_rng_state(tensors["rng/torch"])
        cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("rng/cuda/")),
                                           key=lambda k: int(k.rsplit("/", 1)[1]))]
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda)
        py = doc["rng"]["python"]
        random.setstate((py[0], tuple(py[1]), py[2]))
        kind, keys, pos, has_gauss, gauss = doc["rng"]["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, gauss))
    return doc.get("meta", {})


# ---------------------------------------------------------------------- trainer checkpoints


def save_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, progress: TrainerProgress, *,
                    trainable_only: bool = False) -> None:
    save_state(path, model=model, optimizer=optimizer, meta={"progress": progress.__dict__},
               rng=True, trainable_only=trainable_only)


def load_checkpoint(path: str | os.PathLike, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, *,
                    trainable_only: bool = False) -> TrainerProgress | None:
    meta = load_state(path, model=model, optimizer=optimizer, rng=True, trainable_only=trainable_only)
    if meta is None:
        return None
    return TrainerProgress.from_json(meta.get("progress", {}))


def read_progress(path: str | os.PathLike) -> TrainerProgress | None:
    """A checkpoint's progress (version, groups, offsets, bus run id) without its tensors."""
    meta = read_meta(path)
    return None if meta is None else TrainerProgress.from_json(meta.get("meta", {}).get("progress", {}))


# ---------------------------------------------------------------------- legacy pickles


def legacy_path(path: str | os.PathLike) -> Path:
    path = Path(path)
    return path.with_name(path.name[: -len(SUFFIX)] + LEGACY_SUFFIX) if path.name.endswith(SUFFIX) \
        else path


def refuse_legacy(path: Path) -> None:
    """An old pickle checkpoint where a new one would be: refuse, saying how to go on."""
    old = legacy_path(path)
    if old != path and old.exists() and not path.exists():
        raise CheckpointFormatError(
            f"{old} is a checkpoint in the old pickle format (torch.save), which Tapioca no "
            "longer loads: unpickling a file can run any code in it. If the file is your own, "
            f"convert it with `tapioca checkpoint migrate {old.parent.parent}` (it reads the "
            "file with torch.load(weights_only=True), which refuses code); otherwise delete "
            "it to start this run from scratch")


def migrate_legacy(path: str | os.PathLike) -> Path:
    """Convert one old ``*.pt`` checkpoint (a trainer's, a supervised trainer's or a
    critic's) to the safetensors format beside it; the old file is kept. Reads it with
    ``torch.load(weights_only=True)``: a file that needs anything but tensors, plain
    containers and NumPy arrays is refused, never executed."""
    path = Path(path)
    allowed = [np.ndarray, np.dtype, np.dtypes.UInt32DType]
    reconstruct = getattr(getattr(np, "_core", np.core), "multiarray")._reconstruct
    allowed.append(reconstruct)
    try:
        with torch.serialization.safe_globals(allowed):
            blob = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointFormatError(
            f"{path} could not be read safely (weights_only=True): {str(exc).splitlines()[0]}; "
            "it may hold code (do not load it) or another kind of object") from None
    target = path.with_suffix(SUFFIX)
    if not isinstance(blob, dict) or "model" not in blob or "optimizer" not in blob:
        raise CheckpointFormatError(f"{path} is not a Tapioca checkpoint (no model and optimizer)")
    tensors: dict[str, torch.Tensor] = {}
    doc: dict[str, Any] = {"model_aliases": _model_tensors(blob["model"], "model/", tensors),
                           "optimizer": _optimizer_parts(blob["optimizer"], "optimizer/", tensors),
                           "meta": {}}
    if "progress" in blob:
        doc["meta"]["progress"] = blob["progress"]
    rng = blob.get("rng")
    if rng:
        tensors["rng/torch"] = rng["torch"]
        for i, s in enumerate(rng.get("cuda") or []):
            tensors[f"rng/cuda/{i}"] = s
        kind, keys, pos, has_gauss, gauss = rng["numpy"]
        doc["rng"] = {"python": rng["python"],
                      "numpy": [kind, [int(k) for k in keys], pos, has_gauss, gauss]}
    blob_json = json.dumps(_jsonable(doc)).encode()
    tensors["meta/json"] = torch.frombuffer(bytearray(blob_json), dtype=torch.uint8)
    write_tensors(target, tensors)
    return target
