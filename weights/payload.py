"""One version's weights on disk, whichever payload it carries: a full model's safetensors
file (:mod:`.files`) or a LoRA adapter's directory (:mod:`.adapter_files`).

Consumes a weights directory and a version (where to write or find it) or a path and
its announced sha256 (what to verify); emits paths and verified tensors. Keyed by
version. The readers and writers that handle both payloads go through here, so neither
payload's module imports the other's (an adapter directory's files are safetensors too).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .adapter_files import adapter_dir, check_adapter_dir, load_verified_adapter
from .files import check_file, load_verified_file, weights_file


def version_path(directory: str | os.PathLike, version: int, lora_name: str = "") -> Path:
    """Where ``version``'s weights live: its file, or (``lora_name``: a LoRA run) its
    adapter directory ``{lora_name}-v{version}``."""
    if lora_name:
        return adapter_dir(directory, lora_name, version)
    return weights_file(directory, version)


def check_weights_file(path: str | os.PathLike, sha256: str) -> None:
    """The checks of :func:`load_verified` without loading (a server reads the file or
    the adapter directory itself)."""
    if Path(path).is_dir():
        check_adapter_dir(path, sha256)
    else:
        check_file(path, sha256)


def load_verified(path: str | os.PathLike, sha256: str) -> dict[str, torch.Tensor]:
    """A version's tensors after checking its checksum: a weights file (read once,
    mapped, :func:`~.files.load_verified_file`) or a LoRA adapter's directory (its
    tensors)."""
    if Path(path).is_dir():
        return load_verified_adapter(path, sha256)[0]
    return load_verified_file(path, sha256)
