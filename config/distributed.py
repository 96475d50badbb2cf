"""Configuration for running beyond one process: the sharded trainer (``fsdp``), the
cluster's shape (``cluster``, AReaL's names) and where roles are placed (``scheduler``).

``fsdp.world_size`` > 1 makes ``tapioca role trainer`` a data-parallel FSDP2 trainer of
that many ranks (trainers/fsdp_actor.py, docs/distributed.md); 1 is the single-process
trainer. ``scheduler.type`` picks the launcher of ``tapioca train``: ``local`` (every
role a child process of this host, the default) or ``ray`` (every role a Ray actor,
ops/ray_launcher.py). Defaults live here only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..schemas.errors import require_config as _require

_DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, kw_only=True)
class FSDPConfig:
    """The trainer's data-parallel ranks (PyTorch FSDP2, ``fully_shard``)."""

    # Trainer ranks. 1: one process (CPU or one GPU). N > 1: `tapioca role trainer`
    # starts ranks 1..N-1 itself (torchrun-style env on fsdp.master_addr), unless it
    # already runs under torchrun (RANK / WORLD_SIZE set, e.g. Slurm across nodes).
    world_size: int = 1
    # Collective backend of the training ranks: "" picks nccl on CUDA, gloo on the CPU.
    # The control messages (rank 0 -> ranks: the step's sequences) always go over gloo.
    backend: str = ""
    master_addr: str = "127.0.0.1"
    # 0: a free port, chosen by rank 0 when it starts the other ranks itself.
    master_port: int = 0
    # Mixed precision: parameters are all-gathered and computed in param_dtype; the
    # sharded parameters and the optimizer state (the master weights) stay in
    # actor.param_dtype (float32); gradients are reduced in grad_reduce_dtype (AReaL's name).
    param_dtype: str = "bfloat16"
    grad_reduce_dtype: str = "float32"
    # Free each decoder layer's gathered parameters after its forward (less memory, one
    # more all-gather per layer in the backward).
    reshard_after_forward: bool = True
    # A collective that waits longer than this (a dead or stuck rank) fails the step.
    timeout_s: float = 600.0
    # Expert parallelism (Megatron's expert_model_parallel_size): each MoE layer's experts
    # are split over groups of this many ranks and the tokens reach them by all-to-all
    # (models/expert_parallel.py); it must divide world_size and the experts per layer.
    # 1: every rank holds every expert (FSDP2 shards them like the other weights).
    expert_parallel_size: int = 1

    def __post_init__(self) -> None:
        _require(self.world_size >= 1, "fsdp.world_size must be >= 1 (1: the single-process trainer)")
        _require(self.backend in ("", "nccl", "gloo"),
                 f"fsdp.backend={self.backend!r}: use nccl, gloo, or empty (nccl on CUDA, gloo on CPU)")
        _require(0 <= self.master_port <= 65535, "fsdp.master_port must be in [0, 65535] (0: a free port)")
        for name in ("param_dtype", "grad_reduce_dtype"):
            _require(getattr(self, name) in _DTYPES,
                     f"fsdp.{name}={getattr(self, name)!r}: use one of {', '.join(_DTYPES)}")
        _require(self.timeout_s > 0, "fsdp.timeout_s must be > 0")
        _require(self.expert_parallel_size >= 1 and self.world_size % self.expert_parallel_size == 0,
                 f"fsdp.expert_parallel_size={self.expert_parallel_size} must be >= 1 and divide "
                 f"fsdp.world_size={self.world_size}")


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """The machines of a run (AReaL's ``cluster`` names): what the Ray launcher asks for
    and the Slurm example documents. The local launcher uses one host."""

    n_nodes: int = 1
    n_gpus_per_node: int = 0

    def __post_init__(self) -> None:
        _require(self.n_nodes >= 1, "cluster.n_nodes must be >= 1")
        _require(self.n_gpus_per_node >= 0, "cluster.n_gpus_per_node must be >= 0")


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """How `tapioca train` places the roles (``scheduler.type``, AReaL's name)."""

    # local: child processes of this host. ray: one Ray actor per role member.
    type: str = "local"
    # Ray: "" starts a private local Ray cluster on 127.0.0.1 (stopped with the run);
    # "auto" or "HOST:PORT" joins a running one (`ray start --head` / a Ray cluster).
    ray_address: str = ""
    # Ray restarts a role member whose process died this many times (-1: forever); its
    # log and checkpoint make the restart safe.
    max_restarts: int = 3
    # Logical CPUs each role member reserves on the Ray cluster (the trainer: per rank).
    num_cpus_per_role: float = 1.0
    # GPUs per rollout member when rollout.device is cuda (the trainer takes one per rank).
    rollout_num_gpus: float = 1.0
    # Seconds to wait for a private Ray cluster to start.
    start_timeout_s: float = 180.0
    extra_env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _require(self.type in ("local", "ray"),
                 f"scheduler.type={self.type!r}: use local (child processes) or ray")
        _require(self.max_restarts >= -1, "scheduler.max_restarts must be >= -1 (-1: forever)")
        _require(self.num_cpus_per_role >= 0, "scheduler.num_cpus_per_role must be >= 0")
        _require(self.rollout_num_gpus >= 0, "scheduler.rollout_num_gpus must be >= 0")
        _require(self.start_timeout_s > 0, "scheduler.start_timeout_s must be > 0")


def check_sharded_trainer(cfg) -> None:
    """What the sharded trainer (``fsdp.world_size`` > 1) does not do yet, refused with
    the way out (``cfg`` is a TrainConfig)."""
    n = cfg.fsdp.world_size
    _require(cfg.actor.m2_threshold is None,
             f"actor.m2_threshold (M2PO) masks tokens over the whole step, which the sharded "
             f"trainer (fsdp.world_size={n}) does not gather across ranks yet: set "
             "fsdp.world_size=1 or remove actor.m2_threshold")
    _require(cfg.advantage.estimator != "gae",
             f"advantage.estimator gae trains a critic, which the sharded trainer "
             f"(fsdp.world_size={n}) does not shard yet: set fsdp.world_size=1 or use an "
             "estimator without a critic (grpo, rloo, ...)")
    _require(cfg.fsdp.expert_parallel_size == 1 or cfg.actor.packed_sequences,
             f"fsdp.expert_parallel_size={cfg.fsdp.expert_parallel_size} runs in the packed MoE "
             "forward: set actor.packed_sequences=true")
    _require(cfg.actor.kl_ctl == 0 or bool(cfg.ref.path),
             f"actor.kl_ctl > 0 with an empty ref.path copies the policy as the reference, "
             f"which a sharded policy (fsdp.world_size={n}) cannot: set ref.path to the "
             "initial model's directory (model.path) or fsdp.world_size=1")
