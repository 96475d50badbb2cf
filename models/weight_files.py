"""Policy weights as files: safetensors plus a sha256, written by the trainer and
verified by every reader before use (a torn or tampered file is never loaded)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch
from safetensors.torch import load_file, save

from tapioca.schemas.errors import TapiocaError


class WeightsChecksumError(TapiocaError):
    """A weights file does not match the checksum announced for it."""


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            h.update(chunk)
    return h.hexdigest()


def save_weights(state_dict: dict[str, torch.Tensor], path: str | os.PathLike, *,
                 dtype: torch.dtype | None = None) -> tuple[str, int]:
    """Write atomically (temp file + rename), cast to ``dtype`` if given; returns
    (sha256, size in bytes)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    # safetensors refuses shared storage (tied embeddings): store each tensor once. The
    # cast comes after this check: cast first, tied tensors are two copies (for
    # Qwen2-0.5B, 1,202 MiB instead of 942 MiB, and the time to hash and write them).
    tensors, seen = {}, {}
    for name, t in state_dict.items():
        key = (t.data_ptr(), t.shape, t.dtype) if t.numel() else None
        if key is not None and key in seen:
            continue
        if key is not None:
            seen[key] = name
        t = t.detach()
        tensors[name] = (t.to(dtype) if dtype is not None else t).contiguous().cpu()
    # Serialise once in memory, hash those bytes and write them: no second pass over
    # the file to hash it.
    blob = save(tensors)
    digest = hashlib.sha256(blob).hexdigest()
    with open(tmp, "wb") as f:
        f.write(blob)
    os.replace(tmp, path)
    return digest, len(blob)


def load_verified(path: str | os.PathLike, sha256: str) -> dict[str, torch.Tensor]:
    """Load a weights file after checking its checksum."""
    path = Path(path)
    if not path.exists():
        raise WeightsChecksumError(
            f"weights file {path} does not exist; is the run directory shared between "
            "the trainer and this process?")
    actual = sha256_file(path)
    if actual != sha256:
        raise WeightsChecksumError(
            f"weights file {path} has sha256 {actual[:12]}…, the event announced "
            f"{sha256[:12]}…; the file is torn or was replaced — do not load it")
    return load_file(str(path))
