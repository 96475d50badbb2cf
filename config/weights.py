"""The ``weights`` section: how the trainer's policy versions reach the engines.

Read by the trainer's publisher (:class:`tapioca.weights.WeightPublisher`); a reader
(rollout worker, agent proxy) takes the transport from each ``WeightsEvent``, never from
this section (docs/weight-sync.md). These fields were ``actor.weight_*`` before
(``actor.weight_transport`` is ``weights.transport``, ...); the old names are still read
for one release, with a warning (:mod:`tapioca.config.loader`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..schemas.errors import require_config as _require

TRANSPORTS = ("file", "ipc", "nccl")


@dataclass(frozen=True, kw_only=True)
class WeightsConfig:
    # file: a safetensors file per version (separate machines, the fallback); ipc: a
    # shared buffer on this host (CUDA IPC handles, or a shared-memory file on CPU);
    # nccl: rollout workers pull each version over a 2-rank process group (nccl on GPU,
    # gloo on CPU) whose rendezvous the weights event announces. auto: ipc when the local
    # launcher runs the trainer and the in-process engines on this host's GPUs, else file
    # (config/device_defaults.py).
    transport: str = "auto"
    # Checksum (and nccl send) granularity of the flat weights buffer.
    bucket_bytes: int = 256 * 1024 * 1024
    # Buffers the trainer rotates through (ipc / nccl): with 2, a reader still copying
    # version v is not overwritten by v+1 (a torn read is detected and retried anyway).
    buffer_slots: int = 2
    # ipc / nccl: the durable safetensors file is written in the background for every
    # k-th version (0: none; rollback and `tapioca weights list` need them).
    file_every_versions: int = 1
    # The durable files of the last this many versions stay (rollback, `tapioca weights
    # list`, regeneration); older ones are deleted as new ones land (0: keep all).
    keep_versions: int = 8
    # nccl: the address rollout workers reach the trainer's rendezvous store at, and its
    # port (0: any free port; the weights event carries the one chosen).
    nccl_host: str = "127.0.0.1"
    nccl_port: int = 0
    # auto: nccl when the trainer is on a GPU, gloo on CPU.
    nccl_backend: str = "auto"
    # nccl: a worker that does not finish a transfer within this is dropped by the
    # trainer (it rejoins on its next version); a worker falls back to the file.
    transfer_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        _require(self.transport in TRANSPORTS + ("auto",),
                 f"weights.transport={self.transport!r}: use auto, file, ipc (trainer and engines on "
                 "one host) or nccl (engines on other GPUs or hosts)")
        _require(self.bucket_bytes >= 4096 and self.bucket_bytes % 4096 == 0,
                 f"weights.bucket_bytes={self.bucket_bytes}: use a multiple of 4096 "
                 "(e.g. 268435456 = 256 MiB)")
        _require(self.buffer_slots >= 1, "weights.buffer_slots must be >= 1 (2 = double buffering)")
        _require(self.file_every_versions >= 0,
                 "weights.file_every_versions must be >= 0 (0: no durable files)")
        _require(self.keep_versions >= 0, "weights.keep_versions must be >= 0 (0: keep every version's file)")
        _require(0 <= self.nccl_port <= 65535,
                 "weights.nccl_port must be in [0, 65535] (0 = any free port)")
        _require(self.nccl_backend in ("auto", "nccl", "gloo"),
                 f"weights.nccl_backend={self.nccl_backend!r}: use auto, nccl or gloo")
        _require(self.transfer_timeout_s > 0, "weights.transfer_timeout_s must be > 0")
