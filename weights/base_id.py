"""The identity of a base model: what a LoRA weights event names, so that a reader on
another base refuses the adapter instead of serving it on the wrong weights.

Consumes a local Hugging Face directory (``model.path``); emits a hex digest. The
trainer computes it for the base it trains on and puts it in every adapter event
(``WeightsEvent.adapter.base_id``); every reader computes it for its own ``model.path``
(an in-process engine, or the files a vLLM / SGLang server loaded) and compares.

The digest is a sha256 over each ``*.safetensors`` file of the directory, in name order:
its header (every tensor's name, dtype, shape and offsets) and a checksum of its data
section, the word sums of :func:`tapioca.weights.layout.bucket_checksums` (int64 words in
4 KiB rows: the sum, and the row-weighted sum, modulo 2**64) computed by torch over the
mapped file, so a 15 GB base costs one pass at memory speed (a second or two once the
file is in the page cache), not a sha256 of every byte. Two directories holding the
same files get the same identity; a file with any changed tensor (another fine-tune of
the same architecture) or another dtype gets another. A directory without safetensors
files has no identity (LoRA needs the base as safetensors).
"""

from __future__ import annotations

import hashlib
import mmap
import os
from pathlib import Path

import torch

from ..schemas.errors import ConfigError
from .layout import ALIGN_BYTES, bucket_checksums

_CACHE: dict[tuple, str] = {}
# Checksum granularity of the data section (one host sync per bucket).
_BUCKET_BYTES = 1 << 30


def _file_digest(path: Path, h) -> None:
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ConfigError(f"{path} is not a safetensors file (only {size} bytes)")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)  # writable for torch, never written
    try:
        n = int.from_bytes(mm[:8], "little")
        h.update(mm[:8 + n])  # the header: names, dtypes, shapes, offsets
        start = 8 + n
        data = size - start
        whole = data - data % ALIGN_BYTES
        if start % 8:  # a writer that did not pad its header: int64 views need alignment
            h.update(hashlib.sha256(mm[start:]).digest())
            whole = data
        elif whole:
            view = torch.frombuffer(mm, dtype=torch.uint8, offset=start, count=whole)
            for s in bucket_checksums(view, whole, min(_BUCKET_BYTES, whole)):
                h.update(s.encode())
            del view
        h.update(mm[start + whole:])  # the tail, shorter than a row: its bytes
    finally:
        try:
            mm.close()
        except BufferError:  # a view outlived its use (freed with the array): the GC closes it
            pass


def base_identity(model_path: str | os.PathLike) -> str:
    """The identity of the base weights at ``model_path`` (cached per file set, by size
    and modification time)."""
    root = Path(model_path)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{root} holds no *.safetensors file: a LoRA run needs its base model "
                          "in safetensors (save it with save_pretrained(safe_serialization=True))")
    key = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if key in _CACHE:
        return _CACHE[key]
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0")
        _file_digest(f, h)
    _CACHE[key] = digest = h.hexdigest()
    return digest
