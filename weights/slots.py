"""The trainer's send buffers: ``n`` slots of one flat weights buffer each, plus a tag
word per slot saying which version the slot holds (-1 while it is being written), in
one allocation that a reader can map.

Kinds: ``cuda`` (device memory; shared with other processes by one CUDA IPC handle,
created once), ``shm`` (a file in /dev/shm mapped by the trainer and every reader on
the host: the CPU twin of ``cuda``, so CI runs the same protocol without a GPU), and
``host`` (plain CPU memory, for the file and gloo transports).

Writing version v into slot s: tag[s] = -1, pack, tag[s] = v, all in stream order on
the trainer's device; a reader that copies the slot and then still reads tag[s] == v
got v's bytes (it also checks their checksums). ``gen[s]`` counts writes into slot s
inside the trainer process, for its own background readers (nccl senders, the durable
writer) to detect that a slot was rewritten under them.
"""

from __future__ import annotations

import base64
import os
import tempfile
import uuid
import weakref
from pathlib import Path
from typing import Any

import torch

from ..schemas.errors import TapiocaError
from .files import WeightsUnavailableError
from .layout import ALIGN_BYTES

# The first 4 KiB hold the tags (int64 per slot), so slots start 4 KiB aligned.
HEADER_BYTES = ALIGN_BYTES
MAX_SLOTS = HEADER_BYTES // 8


def shm_dir() -> Path:
    """Where shared-memory slot files go: /dev/shm when it exists (RAM-backed), else
    the temp directory ($TAPIOCA_SHM_DIR overrides)."""
    env = os.environ.get("TAPIOCA_SHM_DIR")
    if env:
        return Path(env)
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())


class SlotBuffer:
    """The trainer side: owns the memory; ``slot(s)`` is a uint8 view of slot s."""

    def __init__(self, kind: str, n_slots: int, slot_bytes: int, device: torch.device,
                 *, name: str = "weights", pin_memory: bool = False) -> None:
        if not 1 <= n_slots <= MAX_SLOTS:
            raise TapiocaError(f"{n_slots} weight buffer slots: use 1..{MAX_SLOTS}")
        if slot_bytes % ALIGN_BYTES:
            raise TapiocaError(f"slot size {slot_bytes} is not a multiple of {ALIGN_BYTES}")
        self.kind, self.n_slots, self.slot_bytes = kind, n_slots, slot_bytes
        self.total_bytes = HEADER_BYTES + n_slots * slot_bytes
        self.gen = [0] * n_slots
        self.versions = [-1] * n_slots  # host mirror of the tags
        self.path: Path | None = None
        if kind == "cuda":
            self.device = device
            self.buf = torch.zeros(self.total_bytes, dtype=torch.uint8, device=device)
        elif kind == "shm":
            self.device = torch.device("cpu")
            self.path = shm_dir() / f"tapioca-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}.slots"
            with open(self.path, "wb") as f:  # sparse zeros; the mapping below shares it
                f.truncate(self.total_bytes)
            self.buf = torch.from_file(str(self.path), shared=True, size=self.total_bytes,
                                       dtype=torch.uint8)
            # Unlinked at close, or when this object is collected / the process exits.
            self._unlink = weakref.finalize(self, _unlink, str(self.path))
        elif kind == "host":  # pinned: a GPU trainer's device-to-host copies run async
            self.device = torch.device("cpu")
            self.buf = torch.zeros(self.total_bytes, dtype=torch.uint8, pin_memory=pin_memory)
        else:
            raise TapiocaError(f"unknown slot kind {kind!r}: use cuda, shm or host")
        self.tags = self.buf[:HEADER_BYTES].view(torch.int64)[:n_slots]
        self.tags.fill_(-1)
        self._descriptor: dict[str, Any] | None = None

    def slot(self, s: int) -> torch.Tensor:
        start = HEADER_BYTES + s * self.slot_bytes
        return self.buf[start:start + self.slot_bytes]

    def slot_for(self, version: int) -> int:
        return version % self.n_slots

    def begin_write(self, s: int) -> None:
        self.gen[s] += 1
        self.versions[s] = -1
        self.tags[s].fill_(-1)  # stream-ordered before the pack's kernels

    def end_write(self, s: int, version: int) -> None:
        self.tags[s].fill_(version)  # stream-ordered after them
        self.versions[s] = version

    def holding(self, version: int) -> int | None:
        """The slot that holds ``version`` (host mirror), or None."""
        for s, v in enumerate(self.versions):
            if v == version:
                return s
        return None

    def descriptor(self) -> dict[str, Any]:
        """What a reader on this host needs to map the buffer (created once)."""
        if self._descriptor is None:
            d: dict[str, Any] = {"kind": self.kind, "n_slots": self.n_slots,
                                 "slot_bytes": self.slot_bytes, "total_bytes": self.total_bytes}
            if self.kind == "shm":
                d["shm_path"] = str(self.path)
            elif self.kind == "cuda":
                d.update(_cuda_ipc_handle(self.buf))
            self._descriptor = d
        return self._descriptor

    def close(self) -> None:
        self.buf = self.tags = None  # type: ignore[assignment]
        if self.path is not None:
            self._unlink()
            self.path = None


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _cuda_ipc_handle(buf: torch.Tensor) -> dict[str, Any]:
    """The CUDA IPC handle of ``buf``'s allocation, as plain JSON fields (never a
    pickle: a reader rebuilds the tensor from these numbers and bytes only)."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buf)
    (_cls, _size, _stride, tensor_offset, _scls, _dtype, device, handle, storage_bytes,
     storage_offset, _grad, ref_handle, ref_offset, event_handle, event_sync) = args
    b64 = lambda b: base64.b64encode(b).decode() if b else ""  # noqa: E731
    return {"device_uuid": str(torch.cuda.get_device_properties(device).uuid),
            "tensor_offset": int(tensor_offset), "handle": b64(handle),
            "storage_bytes": int(storage_bytes), "storage_offset": int(storage_offset),
            "ref_counter_handle": b64(ref_handle), "ref_counter_offset": int(ref_offset),
            "event_handle": b64(event_handle), "event_sync": bool(event_sync)}


class MappedSlots:
    """A reader's mapping of a trainer's SlotBuffer (same host): ``tags`` and
    ``slot(s)`` as in :class:`SlotBuffer`."""

    def __init__(self, desc: dict[str, Any]) -> None:
        self.kind = desc.get("kind")
        self.n_slots, self.slot_bytes = int(desc["n_slots"]), int(desc["slot_bytes"])
        total = int(desc["total_bytes"])
        if self.kind == "shm":
            path = str(desc["shm_path"])
            if not os.path.exists(path):
                raise WeightsUnavailableError(
                    f"the trainer's shared-memory weights buffer {path} is not on this host "
                    "(weights.transport=ipc needs trainer and engines on one machine; "
                    "use nccl or file across machines)")
            if os.path.getsize(path) < total:
                raise WeightsUnavailableError(f"shared-memory weights buffer {path} is shorter "
                                              "than announced; the trainer is restarting?")
            self.buf = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        elif self.kind == "cuda":
            self.buf = _open_cuda_ipc(desc, total)
        else:
            raise WeightsUnavailableError(f"weights buffer of kind {self.kind!r} cannot be mapped "
                                          "by a reader; the trainer must use cuda or shm slots")
        self.tags = self.buf[:HEADER_BYTES].view(torch.int64)[:self.n_slots]

    def slot(self, s: int) -> torch.Tensor:
        start = HEADER_BYTES + s * self.slot_bytes
        return self.buf[start:start + self.slot_bytes]


def _open_cuda_ipc(desc: dict[str, Any], total: int) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if not torch.cuda.is_available():
        raise WeightsUnavailableError("the weights buffer is in CUDA memory but this process "
                                      "has no CUDA device; run the engine on a GPU of the "
                                      "trainer's host, or use weights.transport=nccl/file")
    want = desc.get("device_uuid", "")
    local = [i for i in range(torch.cuda.device_count())
             if str(torch.cuda.get_device_properties(i).uuid) == want]
    if not local:
        raise WeightsUnavailableError(
            f"the trainer's GPU {want} is not visible to this process (CUDA_VISIBLE_DEVICES?); "
            "CUDA IPC needs it visible, or use weights.transport=nccl")
    unb64 = lambda s: base64.b64decode(s) if s else b""  # noqa: E731
    try:
        return rebuild_cuda_tensor(
            torch.Tensor, (total,), (1,), int(desc["tensor_offset"]), torch.storage.TypedStorage,
            torch.uint8, local[0], unb64(desc["handle"]), int(desc["storage_bytes"]),
            int(desc["storage_offset"]), False, unb64(desc["ref_counter_handle"]),
            int(desc["ref_counter_offset"]), unb64(desc["event_handle"]), bool(desc["event_sync"]))
    except RuntimeError as exc:  # e.g. the trainer process is gone
        raise WeightsUnavailableError(f"cannot open the trainer's CUDA IPC weights buffer: "
                                      f"{exc}") from exc
