"""The flat weights buffer every transport moves: each tensor of a state dict, cast to
the publish dtype, back to back in one byte buffer, plus per-bucket checksums computed
where the bytes are (GPU or CPU).

Consumes a state dict (the trainer) or a weights event's ``tensors`` (a reader); emits
the layout (name, dtype, shape, byte offset), views into a buffer, packed bytes, and
checksums. Keyed by tensor name (the model's own ``state_dict()`` names).

The byte order is the safetensors data section's (no gaps: tensors sorted by element
size, largest first, so every offset is aligned to its element size), so the durable
writer writes a buffer to a valid safetensors file as is (:mod:`.durable`). The
buffer is padded with zeros to a multiple of ``ALIGN_BYTES``; checksums cover the
padding too.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Mapping

import torch

from ..schemas.errors import TapiocaError
from ..schemas.events import WeightTensor

# Buffers are padded to this; the checksum reads 4 KiB rows of 512 int64 words.
ALIGN_BYTES = 4096
_ROW_WORDS = ALIGN_BYTES // 8

_DTYPES = {name: getattr(torch, name) for name in (
    "bfloat16", "float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8",
    "bool")}
_SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32",
                       "float64": "F64", "int8": "I8", "int16": "I16", "int32": "I32",
                       "int64": "I64", "uint8": "U8", "bool": "BOOL"}


class LayoutError(TapiocaError):
    """A weights buffer's layout does not fit the model or the event."""


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise LayoutError(f"weights of dtype {dtype} cannot be published; use a float, "
                          "integer or bool dtype")
    return name


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.torch_dtype.itemsize


class Layout:
    """Where each tensor lives in the flat buffer."""

    def __init__(self, entries: list[Entry]) -> None:
        self.entries = entries
        end = 0
        for e in entries:  # contiguous, in order: the safetensors data-section rule
            if e.offset != end:
                raise LayoutError(f"tensor {e.name} starts at byte {e.offset}, expected {end}: "
                                  "the layout has a gap or an overlap")
            end += e.nbytes
        self.data_bytes = end
        self.padded_bytes = max(round_up(end, ALIGN_BYTES), ALIGN_BYTES)

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, torch.Tensor],
                        dtype: torch.dtype | None) -> tuple["Layout", list[torch.Tensor]]:
        """The layout of ``state_dict`` with floating tensors cast to ``dtype`` (None: as
        they are), and the source tensor of each entry. Tied tensors (one storage under
        two names, e.g. embeddings and lm_head) are stored once, under the first name:
        an engine copying into one of them sets both."""
        picked: list[tuple[str, torch.Tensor, torch.dtype]] = []
        seen: set[tuple] = set()
        for name, t in state_dict.items():
            key = (t.data_ptr(), tuple(t.shape), t.dtype) if t.numel() else None
            if key is not None and key in seen:
                continue
            if key is not None:
                seen.add(key)
            out = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
            picked.append((name, t.detach(), out))
        # Largest element first: every offset is then a multiple of its element size.
        picked.sort(key=lambda p: -p[2].itemsize)  # stable: state_dict order within a size
        entries, sources, offset = [], [], 0
        for name, t, out in picked:
            e = Entry(name, dtype_name(out), tuple(t.shape), offset)
            entries.append(e)
            sources.append(t)
            offset += e.nbytes
        return cls(entries), sources

    @classmethod
    def from_event(cls, tensors: list[WeightTensor]) -> "Layout":
        for t in tensors:
            if t.dtype not in _DTYPES:
                raise LayoutError(f"tensor {t.name} has dtype {t.dtype!r}, which this reader "
                                  "does not know")
        return cls([Entry(t.name, t.dtype, tuple(t.shape), t.offset) for t in tensors])

    def to_event(self) -> list[WeightTensor]:
        return [WeightTensor(name=e.name, dtype=e.dtype, shape=list(e.shape), offset=e.offset)
                for e in self.entries]

    def fingerprint(self) -> str:
        """Identifies the layout (names, dtypes, shapes, offsets): a reader's cached
        buffers fit a new event only when the fingerprints agree."""
        desc = [(e.name, e.dtype, e.shape, e.offset) for e in self.entries]
        return hashlib.sha256(json.dumps(desc).encode()).hexdigest()[:16]

    def views(self, buf_u8: torch.Tensor) -> dict[str, torch.Tensor]:
        """Typed views of each tensor inside ``buf_u8`` (no copy)."""
        if buf_u8.numel() < self.data_bytes:
            raise LayoutError(f"buffer of {buf_u8.numel()} bytes is smaller than the layout's "
                              f"{self.data_bytes}")
        return {e.name: buf_u8[e.offset:e.offset + e.nbytes].view(e.torch_dtype).view(e.shape)
                for e in self.entries}

    def pack(self, buf_u8: torch.Tensor, sources: list[torch.Tensor]) -> None:
        """Cast and copy ``sources`` into ``buf_u8`` (enqueued on the current stream; no
        host sync: one small copy kernel per tensor)."""
        views = self.views(buf_u8)
        with torch.no_grad():
            for e, src in zip(self.entries, sources):
                views[e.name].copy_(src, non_blocking=True)

    def safetensors_header(self, metadata: Mapping[str, str] | None = None) -> bytes:
        """The 8-byte length + JSON header of a safetensors file whose data section is
        this buffer's first ``data_bytes`` bytes (padded with spaces to 8 bytes, as the
        format asks)."""
        header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
        for e in self.entries:
            header[e.name] = {"dtype": _SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                              "data_offsets": [e.offset, e.offset + e.nbytes]}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        return len(raw).to_bytes(8, "little") + raw

    def check_fits(self, own: Mapping[str, torch.Tensor]) -> None:
        """Raise LayoutError when a tensor is unknown to ``own`` (a model's state dict)
        or has another shape there."""
        for e in self.entries:
            if e.name not in own:
                raise LayoutError(f"the weights name {e.name}, which the model does not have; "
                                  "was the model changed?")
            if tuple(own[e.name].shape) != e.shape:
                raise LayoutError(f"{e.name} has shape {e.shape} in the weights, "
                                  f"{tuple(own[e.name].shape)} in the model")


# ---------------------------------------------------------------------- checksums

_INDEX_CACHE: dict[tuple[str, int], torch.Tensor] = {}


def _row_index(device: torch.device, rows: int) -> torch.Tensor:
    key = (str(device), rows)
    idx = _INDEX_CACHE.get(key)
    if idx is None:
        idx = torch.arange(1, rows + 1, dtype=torch.int64, device=device)
        _INDEX_CACHE[key] = idx
    return idx


def bucket_checksums(buf_u8: torch.Tensor, padded_bytes: int, bucket_bytes: int) -> list[str]:
    """One 128-bit checksum per ``bucket_bytes`` of ``buf_u8[:padded_bytes]``, computed on
    the buffer's device without copying it: the bytes are read as int64 words in 4 KiB
    rows; ``s1`` = the sum of all words, ``s2`` = sum over rows of (row number x row
    sum), both modulo 2**64 (integer sums wrap identically on every device and in any
    reduction order, so the trainer's GPU and a reader's GPU or CPU agree bit for bit).
    ``s1`` catches any changed word; ``s2`` catches rows swapped or shifted (a torn or
    misplaced copy). A permutation of words inside one 4 KiB row goes unnoticed: copies
    do not fail that way. One host sync (the ``tolist``) for all buckets."""
    if padded_bytes % ALIGN_BYTES or bucket_bytes % ALIGN_BYTES:
        raise LayoutError(f"checksummed sizes must be multiples of {ALIGN_BYTES} bytes")
    words = buf_u8[:padded_bytes].view(torch.int64).view(-1, _ROW_WORDS)
    rows_per_bucket = bucket_bytes // ALIGN_BYTES
    sums = []
    for start in range(0, words.shape[0], rows_per_bucket):
        row_sums = words[start:start + rows_per_bucket].sum(dim=1)
        idx = _row_index(words.device, row_sums.shape[0])
        sums.append(torch.stack([row_sums.sum(), (row_sums * idx).sum()]))
    values = torch.stack(sums).tolist()  # the one sync
    mask = (1 << 64) - 1
    return [f"{s1 & mask:016x}{s2 & mask:016x}" for s1, s2 in values]


def mismatched_buckets(expected: list[str], actual: list[str]) -> list[int]:
    if len(expected) != len(actual):
        return list(range(max(len(expected), len(actual))))
    return [i for i, (a, b) in enumerate(zip(expected, actual)) if a != b]
