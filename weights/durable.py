"""The durable copy: a flat weights buffer written as a safetensors file (a LoRA run: a
PEFT adapter directory, weights/adapter_files.py), hashed once (sha256) while it is
written, and read back verified.

Consumes a slot of the trainer's send buffer (weights/slots.py) and its
layout; emits ``weights/vNNNNNN.safetensors`` files and :class:`DurableFile` records
(version, path, sha256, bytes), which the trainer announces on ``weights.v1``
(``WeightsEvent.files``). Keyed by version.

:class:`DurableWriter` runs the write in a background thread, after the fast transport
has published the version: one device-to-host copy of the slot (a side CUDA stream on
GPU), then header + bytes to a temporary file with the sha256 computed on the same
pass, then an atomic rename. If the trainer publishes faster than files can be written,
the writer keeps only the newest waiting version (older ones get no file; counted in
``skipped``). A write that fails because of the disk (full, failing, read-only) leaves no
temp file and is raised by :meth:`DurableWriter.completed` (the trainer stops on it). A
reader verifies the sha256 while reading the file once
(:func:`tapioca.weights.payload.load_verified`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..schemas.errors import StorageError
from .adapter_files import adapter_dir, saved_adapters, write_adapter
from .files import atomic_write, saved_versions, weights_file
from .layout import Layout
from .slots import SlotBuffer

log = logging.getLogger(__name__)

_CHUNK_BYTES = 64 << 20


@dataclass(frozen=True)
class AdapterFiles:
    """A LoRA run's files (weights/adapter_files.py): each version is the adapter
    directory ``{name}-v{version}`` with this ``adapter_config.json``."""

    name: str
    config_bytes: bytes


@dataclass(frozen=True)
class DurableFile:
    version: int
    path: str
    sha256: str
    num_bytes: int


def write_safetensors(path: Path, layout: Layout, data_u8: torch.Tensor) -> tuple[str, int]:
    """Write ``data_u8[:layout.data_bytes]`` (CPU memory) as a safetensors file,
    atomically (temp file + rename), hashing the bytes as they are written. Returns
    (sha256, file size)."""
    header = layout.safetensors_header()
    h = hashlib.sha256(header)
    data = memoryview(data_u8[:layout.data_bytes].numpy())
    # A failed write (a full disk) removes the temp file and raises StorageError.
    with atomic_write(path) as tmp, open(tmp, "wb") as f:
        f.write(header)
        for start in range(0, layout.data_bytes, _CHUNK_BYTES):
            chunk = data[start:start + _CHUNK_BYTES]
            h.update(chunk)  # hashlib and write release the GIL on large buffers
            f.write(chunk)
    return h.hexdigest(), len(header) + layout.data_bytes


class DurableWriter:
    """Background writer of one file per submitted version (see the module docstring)."""

    def __init__(self, directory: str | os.PathLike, *, keep_versions: int = 8,
                 adapter: AdapterFiles | None = None) -> None:
        self.directory = Path(directory)
        self.keep_versions = keep_versions
        self.adapter = adapter
        self.skipped = 0
        self.last_write_s = 0.0  # wall time of the last file (copy out, hash, write)
        self._cv = threading.Condition()
        self._waiting: tuple | None = None
        self._busy = False
        self._done: list[DurableFile] = []
        self._closed = False
        # A write that failed because of the disk (full, failing, read-only): raised by
        # completed(), so the trainer stops on it (on_tick), as on the file transport.
        self.error: StorageError | None = None
        self._host: torch.Tensor | None = None
        self._stream = None
        self._thread = threading.Thread(target=self._run, name="weights-durable-writer",
                                        daemon=True)
        self._thread.start()

    def submit(self, version: int, layout: Layout, slots: SlotBuffer, slot: int,
               ready=None) -> None:
        """Write slot ``slot`` (holding ``version``) in the background. ``ready``: a CUDA
        event recorded after the slot was packed (the copy waits for it on the GPU)."""
        with self._cv:
            if self._waiting is not None and self._waiting[0] != version:
                self.skipped += 1
                log.info("durable writer is behind: version %d gets no file",
                         self._waiting[0])
            self._waiting = (version, layout, slots, slot, slots.gen[slot], ready)
            self._cv.notify_all()

    def write_now(self, version: int, layout: Layout, slots: SlotBuffer, slot: int,
                  ready=None) -> DurableFile | None:
        """Write synchronously in the caller's thread (the file transport)."""
        return self._write(version, layout, slots, slot, slots.gen[slot], ready)

    def completed(self) -> list[DurableFile]:
        """Files finished since the last call; raises the StorageError of a write that
        failed because of the disk."""
        with self._cv:
            done, self._done = self._done, []
        if self.error is not None:
            raise self.error
        return done

    def flush(self, timeout_s: float = 600.0) -> list[DurableFile]:
        """Wait until nothing is waiting or being written; returns :meth:`completed`."""
        with self._cv:
            self._cv.wait_for(lambda: self._waiting is None and not self._busy, timeout=timeout_s)
        return self.completed()

    def close(self, timeout_s: float = 600.0) -> list[DurableFile]:
        done = self.flush(timeout_s)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5.0)
        return done

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._waiting is not None or self._closed)
                if self._waiting is None:
                    return
                job, self._waiting = self._waiting, None
                self._busy = True
            try:
                done = self._write(*job)
                if done is not None:
                    with self._cv:
                        self._done.append(done)
            except StorageError as exc:
                log.error("durable write of version %d failed: %s", job[0], exc)
                self.error = self.error or exc
            except Exception:  # a fault of this one file: the fast path goes on
                log.exception("durable write of version %d failed", job[0])
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _write(self, version: int, layout: Layout, slots: SlotBuffer, slot: int,
               gen: int, ready=None) -> DurableFile | None:
        t0 = time.perf_counter()
        src = slots.slot(slot)[:layout.data_bytes]
        if slots.kind == "cuda":
            if self._host is None or self._host.numel() < layout.data_bytes:
                self._host = torch.empty(layout.data_bytes, dtype=torch.uint8, pin_memory=True)
                self._stream = torch.cuda.Stream(device=slots.device)
            host = self._host[:layout.data_bytes]
            # A side stream keeps the copy off the trainer's stream; it starts once the
            # pack (on the trainer's stream) is done.
            with torch.cuda.stream(self._stream):
                if ready is not None:
                    self._stream.wait_event(ready)
                host.copy_(src, non_blocking=True)
            self._stream.synchronize()
        else:
            host = src  # host / shm memory: written from the slot directly, checked below
        if self.adapter is None:
            path = weights_file(self.directory, version)
            sha, size = write_safetensors(path, layout, host)
        else:
            path = adapter_dir(self.directory, self.adapter.name, version)
            sha, size = write_adapter(path, self.adapter.config_bytes, layout, host)
        if slots.gen[slot] != gen:  # the slot was rewritten while we read it: torn file
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            path.unlink(missing_ok=True)
            self.skipped += 1
            log.warning("version %d's buffer was overwritten before its file was written "
                        "(the trainer publishes faster than files are written); no file", version)
            return None
        self._delete_old(version)
        self.last_write_s = time.perf_counter() - t0
        return DurableFile(version, str(path.resolve()), sha, size)

    def _delete_old(self, version: int) -> None:
        if self.keep_versions <= 0:
            return
        if self.adapter is not None:
            for v, d in saved_adapters(self.directory, self.adapter.name):
                if v <= version - self.keep_versions:
                    shutil.rmtree(d, ignore_errors=True)
            return
        for v, f in saved_versions(self.directory):
            if v <= version - self.keep_versions:
                f.unlink(missing_ok=True)
