"""The trainer's ranks: who they are, how they start, and how rank 0 talks to them.

Consumes the ``fsdp`` config section and the process environment (torchrun's names:
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); emits
nothing on the bus. Only rank 0 is a Kafka client (the trainer role); ranks 1..N-1 are
its followers and hear from it over torch.distributed.

- :func:`start_ranks`: in rank 0 of a plain ``tapioca role trainer`` (no ``RANK`` in
  the environment) start ranks 1..N-1 as child processes with torchrun's environment
  on ``fsdp.master_addr`` (127.0.0.1) and a free port. They die with rank 0 (Linux
  parent-death signal), ignore SIGTERM/SIGINT (rank 0 stops them with a ``stop``
  message after its last checkpoint, which needs them) and log to
  ``<run>/logs/trainer-rank<r>.log``. Under torchrun (Slurm, several nodes) the
  environment is already there and nothing is started.
- :class:`Channel`: JSON messages (orjson, never pickle) over a gloo process group:
  rank 0 broadcasts a command, every rank answers with a gather. The training
  collectives (FSDP2) run on the default group (nccl on CUDA, gloo on the CPU).
"""

from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import torch

from ..config.distributed import FSDPConfig
from ..schemas.errors import ConfigError, TapiocaError

log = logging.getLogger(__name__)

RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class RankFailedError(TapiocaError):
    """A trainer rank died or a collective failed."""


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @property
    def leader(self) -> bool:
        return self.rank == 0


def rank_from_env(fsdp: FSDPConfig) -> RankInfo | None:
    """This process's rank from torchrun's environment, or None when none is set."""
    if "RANK" not in os.environ:
        return None
    try:
        info = RankInfo(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]),
                        int(os.environ.get("LOCAL_RANK", os.environ["RANK"])),
                        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    except (KeyError, ValueError) as exc:
        raise ConfigError(f"RANK is set but torchrun's environment is incomplete ({exc}); set "
                          f"{', '.join(RANK_ENV)} or none of them") from None
    if info.world_size != fsdp.world_size:
        raise ConfigError(f"WORLD_SIZE={info.world_size} in the environment but "
                          f"fsdp.world_size={fsdp.world_size}: start as many ranks as the config "
                          "says (torchrun --nproc_per_node x --nnodes)")
    return info


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the parent (rank 0) dies, however it dies."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: rank 0's stop message and its timeouts still end them
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def start_ranks(fsdp: FSDPConfig, command: list[str], log_dir: Path) -> tuple[RankInfo, list[subprocess.Popen]]:
    """Rank 0 of a plain ``tapioca role trainer``: start ranks 1..N-1 running ``command``
    (the same role with the same config) and return this process's RankInfo."""
    port = fsdp.master_port or free_port(fsdp.master_addr)
    info = RankInfo(0, fsdp.world_size, 0, fsdp.master_addr, port)
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for r in range(1, fsdp.world_size):
        env = {**os.environ, "RANK": str(r), "WORLD_SIZE": str(fsdp.world_size),
               "LOCAL_RANK": str(r), "MASTER_ADDR": fsdp.master_addr, "MASTER_PORT": str(port),
               "PYTHONUNBUFFERED": "1"}
        with open(log_dir / f"trainer-rank{r}.log", "ab") as out:
            procs.append(subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, env=env,
                                          preexec_fn=_die_with_parent, start_new_session=True))
    return info, procs


def rank_device(device: str, info: RankInfo) -> torch.device:
    """``actor.device`` for this rank: cuda -> cuda:LOCAL_RANK; cpu stays cpu."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if torch.cuda.device_count() <= info.local_rank:
            raise ConfigError(f"trainer rank {info.rank} needs GPU {info.local_rank} but this host "
                              f"has {torch.cuda.device_count()}: lower fsdp.world_size or run the "
                              "ranks across nodes with torchrun")
        dev = torch.device("cuda", info.local_rank)
        torch.cuda.set_device(dev)
    return dev


def init_process_groups(fsdp: FSDPConfig, info: RankInfo, device: torch.device):
    """The default group (FSDP2's collectives) and a gloo group for the control channel."""
    import torch.distributed as dist

    backend = fsdp.backend or ("nccl" if device.type == "cuda" else "gloo")
    if info.master_addr in ("127.0.0.1", "localhost"):
        # One host: gloo's sockets on the loopback interface, not the host name's address.
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    timeout = datetime.timedelta(seconds=fsdp.timeout_s)
    # Under torchrun its agent already serves the store on MASTER_PORT: join it (env://).
    init = ("env://" if "TORCHELASTIC_RUN_ID" in os.environ
            else f"tcp://{info.master_addr}:{info.master_port}")
    dist.init_process_group(backend, init_method=init,
                            rank=info.rank, world_size=info.world_size, timeout=timeout,
                            **({"device_id": device} if device.type == "cuda" else {}))
    control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else dist.group.WORLD
    return control


class Channel:
    """JSON messages between rank 0 and the other ranks over a gloo group."""

    def __init__(self, group, info: RankInfo) -> None:
        self.group = group
        self.info = info

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0 sends ``obj``; every rank returns it."""
        import torch.distributed as dist

        if self.info.leader:
            payload = torch.frombuffer(bytearray(orjson.dumps(obj)), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.group)
        if not self.info.leader:
            payload = torch.empty(int(size), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=self.group)
        return obj if self.info.leader else orjson.loads(payload.numpy().tobytes())

    def gather(self, obj: Any) -> list[Any]:
        """Every rank sends ``obj``; every rank gets the list in rank order."""
        import torch.distributed as dist

        payload = torch.frombuffer(bytearray(orjson.dumps(obj)), dtype=torch.uint8)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.info.world_size)]
        dist.all_gather(sizes, torch.tensor([payload.numel()], dtype=torch.int64), group=self.group)
        longest = int(max(sizes))
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: payload.numel()] = payload
        out = [torch.empty(longest, dtype=torch.uint8) for _ in sizes]
        dist.all_gather(out, padded, group=self.group)
        return [orjson.loads(t[: int(n)].numpy().tobytes()) for t, n in zip(out, sizes)]

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sum over ranks (float64)."""
        import torch.distributed as dist

        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.group)
        return t.tolist()


def command_line(config_path: Path, argv: list[str] | None = None) -> list[str]:
    """The follower ranks' command: this role with the written config."""
    return [sys.executable, "-m", "tapioca.ops.role_main", "trainer", "--config", str(config_path),
            *(argv or [])]
