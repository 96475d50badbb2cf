"""The ``nccl`` transport's wire protocol: rollout workers pull versions from the
trainer over one 2-rank process group per worker (nccl between GPUs, gloo on CPU; the
same code).

Consumes the trainer's send buffer (weights/slots.py); emits nothing on the
bus itself: the trainer announces the rendezvous (``transport_info["store"]``, a
TCPStore the trainer hosts) in every weights event. Keyed by worker index (the order
workers joined).

Rendezvous, on the store: a worker takes an index ``i = add("joined", 1) - 1``, writes
``join/i`` (its member name) and builds rank 1 of a group over ``PrefixStore("pg/i")``;
the trainer's accept thread sees ``join/i`` and builds rank 0 in a sender thread for i.

Per version (pull, so a worker that joins late, or missed versions, asks for the
current one): the worker writes ``req/i/n`` = the version it wants, then receives, all
as broadcasts from rank 0: a header ``[version or -1, buffer bytes, bucket bytes]``
(-1: the trainer no longer holds that version), the buffer bucket by bucket, and a
trailer ``[1]`` if the slot was not rewritten during the send (else ``[0]``: the worker
treats the bytes as superseded, not corrupt). The worker then checks its bytes against
the event's checksums (weights/receiver.py).

A dead or slow worker never blocks the trainer: sends run in the worker's own sender
thread, every wait has the transfer timeout, a failed sender drops its group (the worker
rejoins on its next version), and the trainer's next version goes into another slot.
"""

from __future__ import annotations

import datetime as dt
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

import torch

from .files import WeightsUnavailableError
from .slots import SlotBuffer

log = logging.getLogger(__name__)

class VersionGone(WeightsUnavailableError):
    """The trainer answered cleanly that it no longer holds the version asked for (or
    rewrote it during the send): the connection is fine, the next version will come."""


def _td(seconds: float) -> dt.timedelta:
    return dt.timedelta(seconds=seconds)


def _store_timeout(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "timeout" in text or "timed out" in text or "wait timeout" in text


def local_address_towards(host: str, port: int) -> str:
    """The address of this machine's interface that reaches ``host`` (gloo must bind to
    it); 127.0.0.1 for loopback."""
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))  # no packet is sent for UDP
        return s.getsockname()[0]


def make_group(store, rank: int, backend: str, timeout_s: float, hostname: str,
               device: torch.device):
    """A 2-rank process group over ``store`` (prefixed by the caller), without the
    global default group."""
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        opts = ProcessGroupGloo._Options()
        opts._timeout = _td(timeout_s)
        opts._devices = [ProcessGroupGloo.create_device(hostname=hostname)]
        return ProcessGroupGloo(store, rank, 2, opts)
    from torch.distributed import ProcessGroupNCCL

    # A dead peer must not tear the trainer down: abort the communicator, keep the process
    # (PyTorch's default for this variable kills the process on a timed-out collective).
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")
    opts = ProcessGroupNCCL.Options()
    opts._timeout = _td(timeout_s)
    index = torch.device(device).index  # "cuda" names no index: the current device
    torch.cuda.set_device(torch.cuda.current_device() if index is None else index)
    return ProcessGroupNCCL(store, rank, 2, opts)


def _broadcast(pg, tensor: torch.Tensor, backend: str, timeout_s: float) -> None:
    from torch.distributed import BroadcastOptions

    opts = BroadcastOptions()
    opts.rootRank = 0
    opts.rootTensor = 0
    work = pg.broadcast([tensor], opts)
    if backend == "gloo":
        work.wait()  # bounded by the group's timeout
        return
    # NCCL: wait() only orders streams; poll for completion so this thread can time out.
    deadline = time.monotonic() + timeout_s
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TimeoutError(f"nccl broadcast did not complete in {timeout_s:.0f} s")
        time.sleep(1e-4)


def _abort(pg) -> None:
    for name in ("abort", "shutdown"):
        fn = getattr(pg, name, None)
        if fn is not None:
            try:
                fn()
            except Exception:  # already broken: nothing more to free
                pass
            return


class NcclServer:
    """The trainer's side: hosts the store, accepts workers, serves their pulls.

    Every thread blocks on its own store connection (a TCPStore client serialises
    requests, so threads sharing one would wait on each other); :meth:`close` wakes each
    by writing the key it waits for."""

    _STOP = b"__stop__"
    _IDLE_S = 24 * 3600.0  # a wait with nothing to do; re-armed when it expires

    def __init__(self, slots: SlotBuffer, *, host: str, port: int, backend: str,
                 timeout_s: float, bucket_bytes: int) -> None:
        from torch.distributed import TCPStore

        self.slots, self.backend, self.timeout_s = slots, backend, timeout_s
        self.bucket_bytes = bucket_bytes
        self.padded_bytes = 0  # set per publish
        self.host = host
        self.store = TCPStore(host, port, is_master=True, wait_for_workers=False,
                              timeout=_td(timeout_s))
        self.port = self.store.port
        self.session = uuid.uuid4().hex[:12]
        self.served = 0
        self.dropped = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._members: dict[str, threading.Event] = {}  # member -> its sender's stop flag
        self._waiting: dict[threading.Event, str] = {}  # a thread's stop flag -> its key
        self._threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._accept_loop, name="weights-nccl-accept",
                                        daemon=True)
        self._accept.start()

    def info(self) -> dict[str, Any]:
        return {"store": f"{self.host}:{self.port}", "backend": self.backend,
                "session": self.session, "timeout_s": self.timeout_s}

    def close(self, timeout_s: float = 10.0) -> None:
        self._stop.set()
        with self._lock:
            waiting = list(self._waiting.values())
        for key in waiting:  # wake every blocked wait
            try:
                self.store.set(key, self._STOP)
            except Exception:
                pass
        deadline = time.monotonic() + timeout_s
        for t in [self._accept, *self._threads]:
            t.join(timeout=max(0.0, deadline - time.monotonic()))

    def _client(self):
        from torch.distributed import TCPStore

        return TCPStore(self.host, self.port, is_master=False, timeout=_td(self.timeout_s))

    def _wait_for(self, store, key: str, stop: threading.Event) -> bytes | None:
        """The value of ``key`` once set; None when stopping."""
        with self._lock:
            self._waiting[stop] = key
        try:
            while not (stop.is_set() or self._stop.is_set()):
                try:
                    store.wait([key], _td(self._IDLE_S))
                except Exception as exc:
                    if _store_timeout(exc):
                        continue
                    raise
                value = store.get(key)
                return None if value == self._STOP else value
            return None
        finally:
            with self._lock:
                self._waiting.pop(stop, None)

    def _accept_loop(self) -> None:
        store = self._client()
        seen = 0
        while True:
            value = self._wait_for(store, f"join/{seen}", self._stop)
            if value is None:
                return
            member = value.decode(errors="replace")
            stop = threading.Event()
            with self._lock:  # a member that rejoins replaces its old sender
                old = self._members.get(member)
                self._members[member] = stop
                old_key = None
                if old is not None:
                    old.set()
                    old_key = self._waiting.get(old)
            if old_key is not None:
                store.set(old_key, self._STOP)
            t = threading.Thread(target=self._serve, args=(seen, member, stop),
                                 name=f"weights-nccl-send-{seen}", daemon=True)
            self._threads = [x for x in self._threads if x.is_alive()] + [t]
            t.start()
            seen += 1

    def _serve(self, index: int, member: str, stop: threading.Event) -> None:
        from torch.distributed import PrefixStore

        pg = None
        try:
            store = self._client()
            pg = make_group(PrefixStore(f"pg/{index}", store), 0, self.backend,
                            self.timeout_s, self.host, self.slots.device)
            log.info("weights: worker %s joined (index %d)", member, index)
            n = 0
            while True:
                n += 1
                key = f"req/{index}/{n}"
                value = self._wait_for(store, key, stop)
                if value is None:
                    return
                store.delete_key(key)
                self._send(pg, int(value))
        except Exception as exc:
            self.dropped += 1
            log.warning("weights: dropped worker %s (index %d): %s; it rejoins on its next "
                        "version", member, index, exc)
        finally:
            if pg is not None and self.backend == "nccl":
                _abort(pg)  # frees the communicator (gloo's sockets close with the object)
            with self._lock:
                if self._members.get(member) is stop:
                    del self._members[member]

    def _send(self, pg, version: int) -> None:
        slots, dev = self.slots, self.slots.device
        s = slots.holding(version)
        gen = slots.gen[s] if s is not None else -1
        padded = self.padded_bytes
        header = torch.tensor([version if s is not None else -1, padded, self.bucket_bytes],
                              dtype=torch.int64, device=dev)
        _broadcast(pg, header, self.backend, self.timeout_s)
        if s is None:
            return
        data = slots.slot(s)
        for start in range(0, padded, self.bucket_bytes):
            _broadcast(pg, data[start:min(start + self.bucket_bytes, padded)], self.backend,
                       self.timeout_s)
        intact = slots.gen[s] == gen and slots.versions[s] == version
        _broadcast(pg, torch.tensor([int(intact)], dtype=torch.int64, device=dev),
                   self.backend, self.timeout_s)
        self.served += 1


class NcclClient:
    """A worker's side: one connection to one trainer session."""

    def __init__(self, info: dict[str, Any], *, member: str, device: torch.device,
                 connect_timeout_s: float = 30.0) -> None:
        from torch.distributed import PrefixStore, TCPStore

        host, _, port = str(info["store"]).rpartition(":")
        self.backend = str(info.get("backend", "gloo"))
        self.timeout_s = float(info.get("timeout_s", 60.0))
        self.session = str(info.get("session", ""))
        self.device = device if self.backend == "nccl" else torch.device("cpu")
        timeout = min(self.timeout_s, connect_timeout_s)
        try:
            self.store = TCPStore(host, int(port), is_master=False, timeout=_td(timeout))
            self.index = self.store.add("joined", 1) - 1
            self.store.set(f"join/{self.index}", member)
            self.pg = make_group(PrefixStore(f"pg/{self.index}", self.store), 1, self.backend,
                                 self.timeout_s, local_address_towards(host, int(port)),
                                 self.device)
        except Exception as exc:
            raise WeightsUnavailableError(f"cannot join the trainer's weights group at "
                                          f"{info.get('store')}: {exc}") from exc
        self.n = 0

    def fetch(self, version: int, padded_bytes: int, bucket_bytes: int,
              buf: torch.Tensor) -> None:
        """Receive ``version`` into ``buf[:padded_bytes]`` (on :attr:`device`)."""
        try:
            self.n += 1
            self.store.set(f"req/{self.index}/{self.n}", str(version))
            header = torch.zeros(3, dtype=torch.int64, device=self.device)
            _broadcast(self.pg, header, self.backend, self.timeout_s)
            got, size, bucket = header.tolist()
        except Exception as exc:
            raise WeightsUnavailableError(f"weights transfer of version {version} failed: "
                                          f"{exc}") from exc
        if got != version:
            raise VersionGone(f"the trainer no longer holds version {version} "
                              "(a newer one replaced it); taking the next event")
        if size != padded_bytes or bucket != bucket_bytes:
            raise WeightsUnavailableError(
                f"the trainer sends {size} bytes in buckets of {bucket}, the event announced "
                f"{padded_bytes} in {bucket_bytes}; the trainer restarted with another model?")
        try:
            for start in range(0, padded_bytes, bucket_bytes):
                _broadcast(self.pg, buf[start:min(start + bucket_bytes, padded_bytes)],
                           self.backend, self.timeout_s)
            trailer = torch.zeros(1, dtype=torch.int64, device=self.device)
            _broadcast(self.pg, trailer, self.backend, self.timeout_s)
        except Exception as exc:
            raise WeightsUnavailableError(f"weights transfer of version {version} failed: "
                                          f"{exc}") from exc
        if int(trailer.item()) != 1:
            raise VersionGone(f"version {version} was overwritten by a newer one while it was "
                              "sent; taking the next event")

    def close(self) -> None:
        if self.backend == "nccl":
            _abort(self.pg)
        self.pg = None
        self.store = None
