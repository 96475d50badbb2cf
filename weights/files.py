"""Policy weights as files: safetensors plus a sha256, written by the trainer and
verified by every reader before use (a torn or tampered file is never loaded); and the
errors of every weight transport (weights/). Every file of weights or of a
checkpoint is written through :func:`atomic_write`: a temp file renamed into place, which a
failed write (a full disk) removes, raising ``StorageError`` with the one-line reason."""

from __future__ import annotations

import hashlib
import json
import mmap
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors.torch import save

from ..schemas.errors import TapiocaError, storage_error


class WeightsChecksumError(TapiocaError):
    """A weights file does not match the checksum announced for it."""


class WeightsTransferError(WeightsChecksumError):
    """Bytes received over a fast transport (ipc, nccl) do not match the checksums the
    trainer computed: the engine must not load them (dead-lettered; the worker keeps
    its version)."""


class WeightsRefusedError(TapiocaError):
    """This member cannot serve the event's weights, whatever is retried: a LoRA adapter
    for another base model, other target modules or a rank over the engine's maximum,
    an adapter for a full-weights member or whole weights for a LoRA one. The event is
    dead-lettered at once and the member keeps the version it serves."""


class WeightsUnavailableError(TapiocaError):
    """A fast transport could not deliver this version (the buffer was overwritten by a
    newer one, the trainer is unreachable or gone, a transfer timed out). Not
    corruption: the worker keeps its version and takes the next event (or the file)."""


# A run's weights files: <run dir>/weights/vNNNNNN.safetensors, one per version. The one
# home of the name (the RL trainer, the supervised trainers and the durable writer of the
# fast transports all write there; `tapioca weights list` and rollback read it).
WEIGHTS_DIR = "weights"


def weights_file(directory: str | os.PathLike, version: int) -> Path:
    """The weights file of ``version`` in ``directory`` (a run's ``weights/``)."""
    return Path(directory) / f"v{version:06d}.safetensors"


def saved_versions(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(version, path)`` of every weights file in ``directory``, oldest first."""
    out = []
    for f in Path(directory).glob("v*.safetensors"):
        if f.stem[1:].isdigit():
            out.append((int(f.stem[1:]), f))
    return sorted(out)


@contextmanager
def atomic_write(path: str | os.PathLike,
                 replace: Callable[[Path, Path], None] = os.replace) -> Iterator[Path]:
    """Write ``path`` atomically: yields its temp file ``<path>.tmp`` to write, then moves it
    over ``path`` with ``replace`` (trainers/checkpoint.py passes its fsyncing one). On any
    failure the temp file is removed, so a full disk leaves no ``.tmp`` behind, and an
    OSError of the disk (ENOSPC, EIO, EROFS, ...) is raised as StorageError naming ``path``
    (fatal to the role: bus/runner.py does not retry it)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        yield tmp
        replace(tmp, path)
    except BaseException as exc:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:  # the disk may refuse even that; the cause is what matters
            pass
        error = storage_error(exc, path)
        if error is not None and error is not exc:
            raise error from exc
        raise


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
    with atomic_write(path) as tmp, open(tmp, "wb") as f:
        f.write(blob)
    return digest, len(blob)


_ST_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32,
              "F64": torch.float64, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32,
              "I64": torch.int64, "U8": torch.uint8, "BOOL": torch.bool}


def _existing(path: str | os.PathLike) -> Path:
    path = Path(path)
    if not path.exists():
        raise WeightsChecksumError(
            f"weights file {path} does not exist; is the run directory shared between "
            "the trainer and this process (and the inference server)?")
    return path


def _mismatch(path: Path, actual: str, announced: str) -> None:
    raise WeightsChecksumError(
        f"weights file {path} has sha256 {actual[:12]}…, the event announced "
        f"{(announced or '(none)')[:12]}…; the file is torn or was replaced — do not load it")


def check_file(path: str | os.PathLike, sha256: str) -> None:
    """The checks of :func:`load_verified_file` without loading (a server reads the file
    itself)."""
    path = _existing(path)
    actual = sha256_file(path)
    if actual != sha256:
        _mismatch(path, actual, sha256)


def load_verified_file(path: str | os.PathLike, sha256: str, *,
                       prefix: bytes = b"") -> dict[str, torch.Tensor]:
    """Load one safetensors file after checking that its bytes, after ``prefix``, hash to
    ``sha256`` (an adapter directory's digest covers its config first), reading it once:
    the file is mapped (copy-on-write), hashed, and the tensors are views of the same
    pages (they stay valid after the file is replaced or deleted: writers rename a new
    file in)."""
    path = _existing(path)
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    h = hashlib.sha256(prefix)
    h.update(mm)
    actual = h.hexdigest()
    if actual != sha256:
        mm.close()
        _mismatch(path.parent if prefix else path, actual, sha256)
    n = int.from_bytes(mm[:8], "little")
    header = json.loads(mm[8:8 + n])
    header.pop("__metadata__", None)
    data = torch.frombuffer(mm, dtype=torch.uint8, offset=8 + n, count=len(mm) - 8 - n) \
        if len(mm) > 8 + n else torch.empty(0, dtype=torch.uint8)
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        dtype = _ST_DTYPES.get(info["dtype"])
        if dtype is None:
            raise WeightsChecksumError(f"weights file {path}: tensor {name} has dtype "
                                       f"{info['dtype']}, which this reader does not load")
        raw = data[begin:end]
        if begin % dtype.itemsize:  # a writer that did not align tensors: copy this one
            raw = raw.clone()
        out[name] = raw.view(dtype).view(info["shape"])
    return out
