"""LoRA versions as files: one PEFT adapter directory per version, with one sha256.

Consumes a packed adapter buffer (the trainer's weights layout of the adapter tensors,
weights/layout.py) and its ``adapter_config.json``; emits ``<weights dir>/{name}-v{version}/``
holding ``adapter_model.safetensors`` and ``adapter_config.json`` (what
``PeftModel.from_pretrained``, vLLM's ``/v1/load_lora_adapter`` and SGLang's
``/load_lora_adapter`` load), and reads one back verified. Keyed by version; ``name``
is ``gconfig.lora_name`` (AReaL's ``{lora_name}-v{version}``).

The directory's sha256 (``WeightsEvent.sha256``) is the sha256 of
``adapter_config.json``'s bytes followed by ``adapter_model.safetensors``'s: one digest
over everything a server reads, computed while the files are written (one pass) and
verified by a reader before anything is loaded. The directory is written under a
temporary name and renamed into place, so a reader never sees half of one; a failed
write (a full disk) removes it and raises ``StorageError``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch

from ..models.lora import ADAPTER_CONFIG_FILE, ADAPTER_MODEL_FILE
from ..schemas.errors import storage_error
from .files import WeightsChecksumError, load_verified_file
from .layout import Layout

_CHUNK_BYTES = 64 << 20


def adapter_name(lora_name: str, version: int) -> str:
    """Version ``version``'s adapter name (a directory and a server adapter go by it)."""
    return f"{lora_name}-v{version}"


def adapter_dir(directory: str | os.PathLike, lora_name: str, version: int) -> Path:
    return Path(directory) / adapter_name(lora_name, version)


def saved_adapters(directory: str | os.PathLike, lora_name: str) -> list[tuple[int, Path]]:
    """``(version, directory)`` of every complete adapter of ``lora_name``, oldest first."""
    pattern = re.compile(re.escape(lora_name) + r"-v(\d+)")
    out = []
    for d in Path(directory).glob(f"{lora_name}-v*"):
        m = pattern.fullmatch(d.name)
        if m and (d / ADAPTER_MODEL_FILE).is_file():
            out.append((int(m.group(1)), d))
    return sorted(out)


def write_adapter(path: Path, config_bytes: bytes, layout: Layout, data_u8: torch.Tensor) -> tuple[str, int]:
    """Write adapter directory ``path`` from ``data_u8[:layout.data_bytes]`` (CPU memory),
    hashing as it writes. Returns (sha256, bytes written)."""
    tmp = path.with_name(path.name + ".tmp")
    header = layout.safetensors_header()
    h = hashlib.sha256(config_bytes)
    h.update(header)
    data = memoryview(data_u8[:layout.data_bytes].numpy())
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / ADAPTER_CONFIG_FILE).write_bytes(config_bytes)
        with open(tmp / ADAPTER_MODEL_FILE, "wb") as f:
            f.write(header)
            for start in range(0, layout.data_bytes, _CHUNK_BYTES):
                chunk = data[start:start + _CHUNK_BYTES]
                h.update(chunk)
                f.write(chunk)
        if path.exists():  # a version written again (a restarted trainer): the new bytes win
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        error = storage_error(exc, path)
        if error is not None and error is not exc:
            raise error from exc
        raise
    return h.hexdigest(), len(config_bytes) + len(header) + layout.data_bytes


def write_adapter_tensors(path: Path, config_bytes: bytes, tensors: dict[str, torch.Tensor], *,
                          dtype: torch.dtype | None = None) -> tuple[str, int]:
    """:func:`write_adapter` from a state dict (``final/``, tests)."""
    layout, sources = Layout.from_state_dict(tensors, dtype)
    buf = torch.zeros(layout.padded_bytes, dtype=torch.uint8)
    layout.pack(buf, [s.cpu() for s in sources])
    return write_adapter(path, config_bytes, layout, buf)


def adapter_sha256(path: str | os.PathLike) -> str:
    path = Path(path)
    h = hashlib.sha256((path / ADAPTER_CONFIG_FILE).read_bytes())
    with open(path / ADAPTER_MODEL_FILE, "rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            h.update(chunk)
    return h.hexdigest()


def _existing(path: Path) -> None:
    for name in (ADAPTER_CONFIG_FILE, ADAPTER_MODEL_FILE):
        if not (path / name).is_file():
            raise WeightsChecksumError(
                f"adapter directory {path} has no {name}; is the run directory shared between "
                "the trainer and this process (and the inference server)?")


def check_adapter_dir(path: str | os.PathLike, sha256: str) -> None:
    """The checks of :func:`load_verified_adapter` without loading (a server reads it)."""
    path = Path(path)
    _existing(path)
    actual = adapter_sha256(path)
    if actual != sha256:
        raise WeightsChecksumError(
            f"adapter directory {path} has sha256 {actual[:12]}…, the event announced "
            f"{(sha256 or '(none)')[:12]}…; its files are torn or were replaced — do not load it")


def load_verified_adapter(path: str | os.PathLike, sha256: str) -> tuple[dict[str, torch.Tensor], dict]:
    """``(tensors, adapter_config)`` of an adapter directory whose sha256 is ``sha256``
    (config and tensor file read once each; the tensors map the file's pages)."""
    path = Path(path)
    _existing(path)
    config_bytes = (path / ADAPTER_CONFIG_FILE).read_bytes()
    tensors = load_verified_file(path / ADAPTER_MODEL_FILE, sha256, prefix=config_bytes)
    try:
        config = json.loads(config_bytes)
    except ValueError as exc:
        raise WeightsChecksumError(f"{path / ADAPTER_CONFIG_FILE} is not JSON: {exc}") from None
    return tensors, config
