"""The trainer's side of every transport: a state dict in, the fields of a
``WeightsEvent`` out.

Consumes the policy's ``state_dict()`` once per version; emits the transport fields of
the version's weights event (``transport``, ``transport_info``, ``tensors``,
``bucket_checksums``, ... or ``path`` + ``sha256`` for ``file``) and, later, the
durable files the background writer finished (:meth:`WeightPublisher.poll`), which the
trainer lists in its next event (``files``). Keyed by version.

Every transport starts the same way: the tensors are cast to the publish dtype and
packed into a slot of one flat buffer (weights/layout.py,
weights/slots.py; one copy kernel per tensor on the trainer's device); then

- ``file``: that buffer is written as a safetensors file, sha256 computed while
  writing, before the event (as before; now from one device-to-host copy);
- ``ipc``: the per-bucket checksums are computed on the device (the one host sync of a
  publish) and the event names the slot of a buffer the engines have mapped (a CUDA IPC
  handle created once, or a /dev/shm file on CPU);
- ``nccl``: the same checksums; rollout workers pull the slot over their process group
  (weights/nccl.py).

With ``ipc`` / ``nccl`` every ``file_every_versions``-th version is also written as a
file, in the background, after its event is out (:meth:`poll` starts the write).

A write that fails because of the disk (full, failing, read-only) raises StorageError
(from :meth:`publish` on ``file``, from :meth:`poll` / :meth:`finish` for a background
file) and leaves no temp file; a version is re-announced only with its own file.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Mapping

import torch

from ..schemas.errors import ConfigError
from .durable import AdapterFiles, DurableFile, DurableWriter
from .layout import Layout, bucket_checksums
from .payload import version_path
from .slots import SlotBuffer

log = logging.getLogger(__name__)


class WeightPublisher:
    def __init__(self, transport: str, directory: str | Path, *, device: str | torch.device,
                 publish_dtype: torch.dtype | None, bucket_bytes: int = 256 << 20,
                 buffer_slots: int = 2, file_every_versions: int = 1, keep_versions: int = 8,
                 nccl_host: str = "127.0.0.1", nccl_port: int = 0, nccl_backend: str = "auto",
                 transfer_timeout_s: float = 60.0, name: str = "weights",
                 adapter: AdapterFiles | None = None) -> None:
        """``adapter``: a LoRA run (the state dicts published are adapters); every
        version's file is then its PEFT adapter directory (weights/adapter_files.py)."""
        if transport not in ("file", "ipc", "nccl"):
            raise ValueError(f"unknown weight transport {transport!r}")
        self.transport = transport
        self.directory = Path(directory)
        self.device = torch.device(device)
        self.publish_dtype = publish_dtype
        self.bucket_bytes = bucket_bytes
        self.n_slots = 1 if transport == "file" else buffer_slots
        self.file_every_versions = file_every_versions
        self.nccl = dict(host=nccl_host, port=nccl_port, timeout_s=transfer_timeout_s,
                         backend=(("nccl" if self.device.type == "cuda" else "gloo")
                                  if nccl_backend == "auto" else nccl_backend))
        self.name = name
        self.adapter = adapter
        self.writer = DurableWriter(self.directory, keep_versions=keep_versions, adapter=adapter)
        self.slots: SlotBuffer | None = None
        self.server = None
        self._layout_key: tuple | None = None
        self._last: dict[int, dict[str, Any]] = {}
        self._due: tuple | None = None
        self._written: set[int] = set()  # versions handed to the writer

    @classmethod
    def from_config(cls, weights, directory: str | Path, *, device: str | torch.device,
                    publish_dtype: torch.dtype | None, name: str = "weights",
                    adapter: AdapterFiles | None = None) -> "WeightPublisher":
        """From the run's ``weights`` section (config/weights.py); ``device``: the
        trainer's (``actor.device``)."""
        # auto is resolved with the run's placement (config/device_defaults.py); a section
        # built without one (a tool, a test) knows no placement: the file, which always works.
        transport = "file" if weights.transport == "auto" else weights.transport
        return cls(transport, directory, device=device, publish_dtype=publish_dtype,
                   bucket_bytes=weights.bucket_bytes, buffer_slots=weights.buffer_slots,
                   file_every_versions=weights.file_every_versions, keep_versions=weights.keep_versions,
                   nccl_host=weights.nccl_host, nccl_port=weights.nccl_port,
                   nccl_backend=weights.nccl_backend,
                   transfer_timeout_s=weights.transfer_timeout_s, name=name, adapter=adapter)

    # ------------------------------------------------------------------ publishing

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> dict[str, Any]:
        """Pack ``state_dict`` as ``version``; returns the weights event's transport fields."""
        self._submit_due()  # the previous version's event is out by now
        layout, sources = Layout.from_state_dict(state_dict, self.publish_dtype)
        self._ensure_slots(layout)
        slots = self.slots
        s = slots.slot_for(version)
        slots.begin_write(s)
        buf = slots.slot(s)
        layout.pack(buf, sources)
        slots.end_write(s, version)
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        if self.transport == "file":
            if slots.kind != "cuda" and ready is not None:
                ready.synchronize()  # the pack's device-to-host copies have landed
            done = self.writer.write_now(version, layout, slots, s, ready)
            self._written.add(version)
            return {"transport": "file", "path": done.path, "sha256": done.sha256,
                    "num_bytes": done.num_bytes}
        # The one host sync of a publish: the checksums come back, and with them the
        # guarantee that the slot is packed and tagged before the event goes out.
        checksums = bucket_checksums(buf, layout.padded_bytes, self.bucket_bytes)
        if self.transport == "ipc":
            info = {**slots.descriptor(), "slot": s}
        else:
            self.server.padded_bytes = layout.padded_bytes
            info = self.server.info()
        fields = {"transport": self.transport, "path": "", "sha256": "",
                  "num_bytes": layout.data_bytes, "transport_info": info,
                  "tensors": layout.to_event(), "data_bytes": layout.data_bytes,
                  "bucket_bytes": self.bucket_bytes, "bucket_checksums": checksums}
        self._last = {v: f for v, f in self._last.items() if slots.holding(v) is not None}
        self._last[version] = fields
        if self.file_every_versions > 0 and version % self.file_every_versions == 0:
            self._due = (version, layout, slots, s, ready)
        return fields

    def announcement(self, version: int, path: str = "", sha256: str = "") -> dict[str, Any] | None:
        """The transport fields to re-announce ``version`` with (its file ``path`` /
        ``sha256`` when written), or None when it must be published again (a restarted
        trainer: nothing in the buffers; file: the file is gone, or ``path`` is not this
        version's file). A file is written only for a version not yet committed, so the
        file named for ``version`` holds its bytes; any other path (say the last file that
        was written before a write failed) would announce another version's weights."""
        mine = version_path(self.directory, version, self.adapter.name if self.adapter else "")
        own = bool(path) and Path(path).resolve() == mine.resolve()
        has_file = own and bool(sha256) and Path(path).exists()
        if self.transport == "file":
            return {"transport": "file", "path": path, "sha256": sha256} if has_file else None
        fields = self._last.get(version)
        if fields is None or self.slots is None or self.slots.holding(version) is None:
            return None
        out = dict(fields)
        if has_file:
            out.update(path=path, sha256=sha256)
        return out

    def poll(self) -> list[DurableFile]:
        """Start the durable write that is due (after its event went out); returns the
        files finished since the last call."""
        self._submit_due()
        return self.writer.completed()

    def _submit_due(self) -> None:
        if self._due is not None:
            self.writer.submit(*self._due)
            self._written.add(self._due[0])  # submitted: written, or skipped when behind
            self._due = None

    def finish(self, final_version: int | None = None, timeout_s: float = 600.0) -> list[DurableFile]:
        """Write the final version's file if it has none yet (offline use) and wait for
        the writer; returns the files finished since the last poll. Publishing and
        announcing still work afterwards."""
        done = self.poll()
        if (final_version is not None and self.transport != "file" and self.file_every_versions > 0
                and final_version not in self._written and self.slots is not None):
            self._written.add(final_version)
            s = self.slots.holding(final_version)
            fields = self._last.get(final_version)
            if s is not None and fields is not None:
                self.writer.submit(final_version, Layout.from_event(fields["tensors"]),
                                   self.slots, s)
        return done + self.writer.flush(timeout_s)

    def close(self, timeout_s: float = 600.0) -> list[DurableFile]:
        """Stop the writer (after its pending work), the nccl server, free the buffers."""
        done = self.writer.close(timeout_s)
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.slots is not None:
            self.slots.close()
            self.slots = None
        return done

    # ------------------------------------------------------------------ buffers

    def _ensure_slots(self, layout: Layout) -> None:
        key = (layout.padded_bytes, layout.fingerprint())
        if self.slots is not None and self._layout_key == key:
            return
        if self.slots is not None:
            log.warning("the model's weights layout changed: new %s buffers", self.transport)
            self.writer.flush()
            self.slots.close()
        gpu = self.device.type == "cuda"
        nccl_backend = self.transport == "nccl" and self.nccl["backend"] == "nccl"
        if nccl_backend and not gpu:
            raise ConfigError("weights.nccl_backend=nccl needs the trainer on a GPU "
                              "(actor.device=cuda); on CPU use gloo (or auto)")
        if (gpu and self.transport == "ipc") or nccl_backend:
            kind = "cuda"
        elif self.transport == "ipc":
            kind = "shm"
        else:  # file (and gloo): packed straight into host memory, pinned on a GPU trainer
            kind = "host"
        self.slots = SlotBuffer(kind, self.n_slots, layout.padded_bytes, self.device,
                                name=self.name, pin_memory=gpu and kind == "host")
        self._layout_key = key
        self._last.clear()
        if self.transport == "nccl":
            if self.server is None:
                from .nccl import NcclServer

                self.server = NcclServer(self.slots, host=self.nccl["host"], port=self.nccl["port"],
                                         backend=self.nccl["backend"],
                                         timeout_s=self.nccl["timeout_s"],
                                         bucket_bytes=self.bucket_bytes)
            else:
                self.server.slots = self.slots
