"""The reader's side of every transport: a weights event in, verified tensors out.

Consumes ``WeightsEvent`` (the transport is read from the event, never from local
config: the event is the one source of truth). Emits a mapping of tensor name -> tensor
ready for ``InferenceEngine.update_weights``: for ``ipc`` and ``nccl``, views into this
receiver's own buffer on the engine's device, valid until the next :meth:`fetch`; for
``file``, the file's tensors (sha256 verified).

Fast paths copy the bytes into the receiver's buffer first and check them (the tag of
the trainer's slot before and after the copy, then the per-bucket checksums, on the
engine's device) before the engine touches its parameters, so a failed or corrupt
transfer leaves the engine on its old version: corrupt bytes raise
:class:`WeightsTransferError` (the worker dead-letters the event); a version the
transport can no longer deliver raises :class:`WeightsUnavailableError`, unless the
event names a verified file for it, which is then loaded instead.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any, Callable, Mapping

import torch

from ..config.lora import LoraSpec
from ..models.lora import LoraAdapter
from ..schemas.errors import ConfigError
from ..schemas.events import WeightsEvent
from .adapter_check import AdapterGate
from .files import WeightsTransferError, WeightsUnavailableError
from .layout import Layout, bucket_checksums, mismatched_buckets
from .payload import check_weights_file, load_verified
from .slots import MappedSlots

log = logging.getLogger(__name__)


class WeightReceiver:
    """One per engine. ``device``: where the engine's parameters live."""

    def __init__(self, device: str | torch.device = "cpu", *, member: str = "") -> None:
        self.device = torch.device(device)
        self.member = member or f"reader-{uuid.uuid4().hex[:8]}"
        self._buf: torch.Tensor | None = None
        self._mapped: tuple[str, MappedSlots] | None = None
        self._client = None  # NcclClient of the current trainer session
        self._retry_after: dict[str, float] = {}
        # Our own CUDA stream: on the engine's (default) stream, the copy and the checks
        # would queue behind its decode steps, and a device-wide sync would wait for them.
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.fast_loads = 0
        self.file_loads = 0

    # ------------------------------------------------------------------ public

    def fetch(self, event: WeightsEvent) -> Mapping[str, torch.Tensor]:
        if event.transport == "file":
            self.file_loads += 1
            return load_verified(event.path, event.sha256)
        try:
            out = self._fetch_fast(event)
            self.fast_loads += 1
            return out
        except WeightsUnavailableError as exc:
            if event.path and event.sha256:
                log.warning("%s; loading version %d from its file instead", exc, event.version)
                self.file_loads += 1
                return load_verified(event.path, event.sha256)
            raise

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
        self._client = self._mapped = self._buf = None

    # ------------------------------------------------------------------ fast paths

    def _fetch_fast(self, event: WeightsEvent) -> Mapping[str, torch.Tensor]:
        if self._stream is None:
            return self._fetch_fast_on_stream(event)
        with torch.cuda.stream(self._stream):
            return self._fetch_fast_on_stream(event)

    def _fetch_fast_on_stream(self, event: WeightsEvent) -> Mapping[str, torch.Tensor]:
        layout = Layout.from_event(event.tensors)
        if layout.data_bytes != event.data_bytes or not event.bucket_checksums:
            raise WeightsTransferError(
                f"weights event of version {event.version} is inconsistent: its tensors "
                f"take {layout.data_bytes} bytes, it announces {event.data_bytes}, with "
                f"{len(event.bucket_checksums)} checksums; not loading it")
        padded = layout.padded_bytes
        buf = self._buffer(padded)
        if event.transport == "ipc":
            self._copy_ipc(event, buf, padded)
        elif event.transport == "nccl":
            self._receive_nccl(event, buf, padded)
        else:
            raise WeightsUnavailableError(f"unknown weights transport {event.transport!r}")
        actual = bucket_checksums(buf, padded, event.bucket_bytes)  # syncs this stream
        bad = mismatched_buckets(event.bucket_checksums, actual)
        if bad:
            raise WeightsTransferError(
                f"version {event.version} arrived corrupt over {event.transport}: bucket(s) "
                f"{bad[:8]} of {len(actual)} ({event.bucket_bytes} bytes each) do not match the "
                "trainer's checksums; the engine keeps its weights (see docs/weight-sync.md)")
        return layout.views(buf)

    def _buffer(self, nbytes: int) -> torch.Tensor:
        if self._buf is None or self._buf.numel() != nbytes:
            self._buf = None  # free the old one first (a 7B buffer is 15 GB)
            self._buf = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        return self._buf

    def _copy_ipc(self, event: WeightsEvent, buf: torch.Tensor, padded: int) -> None:
        info = event.transport_info
        key = str(info.get("shm_path") or info.get("handle"))
        if self._mapped is None or self._mapped[0] != key:
            self._mapped = None  # a new trainer buffer: drop the old mapping
            self._mapped = (key, MappedSlots(info))
        slots = self._mapped[1]
        s = int(info["slot"])
        if not 0 <= s < slots.n_slots or padded > slots.slot_bytes:
            raise WeightsTransferError(f"weights event of version {event.version} names slot "
                                       f"{s} / {padded} bytes, outside the trainer's buffer")
        self._check_tag(slots, s, event.version, "before")
        src = slots.slot(s)[:padded]
        buf.copy_(src, non_blocking=True)
        if self._stream is not None:
            self._stream.synchronize()  # the copy is done before the tag is read again
        self._check_tag(slots, s, event.version, "while")

    @staticmethod
    def _check_tag(slots: MappedSlots, s: int, version: int, when: str) -> None:
        tag = int(slots.tags[s].item())
        if tag != version:
            what = ("is being rewritten" if tag < 0 else f"holds version {tag}")
            raise WeightsUnavailableError(
                f"the trainer's buffer slot {s} {what} ({when} copying version {version}): a "
                "newer version replaced it; taking the next event")

    def _receive_nccl(self, event: WeightsEvent, buf: torch.Tensor, padded: int) -> None:
        from .nccl import NcclClient, VersionGone

        info = event.transport_info
        session = str(info.get("session", ""))
        now = time.monotonic()
        if now < self._retry_after.get(session, 0.0):
            raise WeightsUnavailableError(f"the trainer's weights group {info.get('store')} "
                                          "failed recently; not retrying yet")
        try:
            if self._client is None or self._client.session != session:
                if self._client is not None:
                    self._client.close()
                self._client = None
                self._client = NcclClient(info, member=self.member, device=self.device)
            client = self._client
            recv = buf if client.device == buf.device else self._staging_for(client.device, padded)
            client.fetch(event.version, padded, event.bucket_bytes, recv)
            if recv is not buf:
                buf.copy_(recv)
        except VersionGone:
            raise  # a clean answer: the connection stays
        except WeightsUnavailableError:
            # Rejoin on the next version; back off so an unreachable trainer does not cost
            # a timeout per event.
            if self._client is not None:
                self._client.close()
            self._client = None
            self._retry_after[session] = time.monotonic() + min(
                10.0, float(info.get("timeout_s", 10.0)))
            raise

    def _staging_for(self, device: torch.device, nbytes: int) -> torch.Tensor:
        cached = getattr(self, "_recv_host", None)
        if cached is None or cached.numel() != nbytes or cached.device != device:
            cached = torch.zeros(nbytes, dtype=torch.uint8, device=device)
            self._recv_host = cached
        return cached


def make_weight_loader(engine, device: str | torch.device, *, member: str = "",
                       lora: LoraSpec | None = None,
                       model_path: str = "") -> Callable[[WeightsEvent], Any]:
    """The ``load_weights`` callable of a rollout worker or the agent proxy: fetch the
    event's version over its transport, verified, then copy it into ``engine`` at a
    step boundary (``InferenceEngine.update_weights``; generation goes on during the
    fetch and stops only for that copy). ``lora``: the member serves LoRA adapters on
    ``model_path`` (checked first, weights/adapter_check.py; then
    ``InferenceEngine.update_adapter``)."""
    receiver = WeightReceiver(device, member=member)
    gate = AdapterGate(lora, model_path)

    def load_weights(event: WeightsEvent) -> None:
        gate.check(event)
        if event.adapter is None:
            engine.update_weights(receiver.fetch(event), event.version)
            return
        if event.transport == "file":
            gate.check_directory(event)
        tensors = receiver.fetch(event)
        gate.check_tensors(event, tensors)
        a = event.adapter
        engine.update_adapter(LoraAdapter(name=a.name, rank=a.rank, alpha=a.alpha,
                                            target_modules=list(a.target_modules), tensors=tensors,
                                            path=event.path), event.version)

    load_weights.receiver = receiver  # type: ignore[attr-defined]
    return load_weights


def make_server_weight_loader(engine, engine_name: str, *, lora: LoraSpec | None = None,
                              model_path: str = "") -> Callable[[WeightsEvent], Any]:
    """The ``load_weights`` callable for an inference-server adapter (vLLM, SGLang): the
    server reads the version's safetensors file (a LoRA run: its adapter directory)
    itself, after it is checked here (its sha256), as the in-process path checks what it
    loads. Fast transports are refused with what to set instead."""
    gate = AdapterGate(lora, model_path)

    def load_server_weights(event: WeightsEvent) -> None:
        if event.transport != "file" or not event.path:  # defence: config/features.py's servers_x_fast_transport
            raise ConfigError(
                f"weights version {event.version} comes over {event.transport!r}; the "
                f"{engine_name} adapter reloads safetensors files only (device-to-device "
                "updates to servers are not wired yet): set weights.transport=file")
        gate.check(event)
        check_weights_file(event.path, event.sha256)
        if event.adapter is None:
            engine.update_weights(event.path, event.version)
            return
        gate.check_directory(event)
        a = event.adapter
        engine.update_adapter(LoraAdapter(name=a.name, rank=a.rank, alpha=a.alpha,
                                            target_modules=list(a.target_modules), path=event.path),
                              event.version)

    return load_server_weights
