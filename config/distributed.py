"""Configuration for running beyond one process: the sharded trainer (``fsdp``), the
cluster's shape (``cluster``, AReaL's names) and where roles are placed (``scheduler``).

``fsdp.world_size`` > 1 makes ``tapioca role trainer`` an FSDP2 trainer of that many
ranks (trainers/fsdp_actor.py, docs/distributed.md); 1 is the single-process trainer.
The ranks form a device mesh (dp, cp, tp): ``fsdp.tensor_parallel_size`` (tp: DTensor
tensor + sequence parallel, models/parallel.py), ``fsdp.context_parallel_size`` (cp:
Ulysses context parallel) and the data-parallel rest, dp = world_size / (tp x cp).
AReaL's allocation string ``actor.backend: "fsdp:d2t2c2"`` says the same
(:func:`parse_allocation`; TrainConfig fills ``fsdp`` from it). ``scheduler.type`` picks
the launcher of ``tapioca train``: ``local`` (every role a child process of this host, the
default) or ``ray`` (every role a Ray actor, ops/ray_launcher.py). Defaults live here only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from ..models.parallel_check import check_model_parallel
from ..schemas.errors import ConfigError
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
    # Tensor parallel ranks (tp, AReaL's name): every linear layer split over tp ranks
    # (q/k/v/gate/up by output, o/down by input), norms and activations split over the
    # sequence, the LM head and its logprobs over the vocabulary. Needs heads, kv heads,
    # intermediate size and vocabulary divisible by it.
    tensor_parallel_size: int = 1
    # Context parallel ranks (cp, AReaL's name): each packed micro-batch is split into cp
    # equal token slices; attention runs on all tokens for heads / cp heads (Ulysses
    # all-to-all). Needs packed sequences and heads divisible by tp x cp.
    context_parallel_size: int = 1

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
        tp, cp = self.tensor_parallel_size, self.context_parallel_size
        _require(tp >= 1 and cp >= 1,
                 "fsdp.tensor_parallel_size and fsdp.context_parallel_size must be >= 1 (1: off)")
        _require(self.world_size % (tp * cp) == 0,
                 f"fsdp.world_size={self.world_size} is not dp x tp x cp for "
                 f"tensor_parallel_size={tp} and context_parallel_size={cp}: set world_size to a "
                 f"multiple of {tp * cp} (e.g. {tp * cp} for dp 1)")

    @property
    def tp(self) -> int:
        return self.tensor_parallel_size

    @property
    def cp(self) -> int:
        return self.context_parallel_size

    @property
    def dp(self) -> int:
        """Data-parallel replicas: the ranks that see different sequences."""
        return self.world_size // (self.tp * self.cp)

    @property
    def model_parallel(self) -> bool:
        """Whether tensor or context parallelism is on (False: the data-parallel trainer)."""
        return self.tp > 1 or self.cp > 1

    def describe(self) -> str:
        return f"dp={self.dp} tp={self.tp} cp={self.cp} (world {self.world_size})"


# AReaL's allocation grammar for one trainer (areal/api/alloc_mode.py): a backend, an
# optional [name], then dimensions d/t/c/p/e followed by a size >= 1, in any order.
_ALLOC = re.compile(r"^(?P<backend>[a-z]+)(\[(?P<name>[A-Za-z_][A-Za-z0-9_]*)\])?:(?P<dims>[a-z0-9 ]+)$")
_DIM = re.compile(r"([a-z])([1-9][0-9]*)")


@dataclass(frozen=True)
class Allocation:
    """A parsed ``actor.backend`` string."""

    dp: int = 1
    tp: int = 1
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.cp


def parse_allocation(spec: str) -> Allocation:
    """``"fsdp:d2t2c2"`` -> dp 2, tp 2, cp 2 (AReaL's ``ModelAllocation.from_str`` for an
    FSDP trainer). Pipeline (``p``) and expert (``e``) parallelism, other backends, and
    AReaL's combined ``sglang:...+fsdp:...`` strings are refused, each saying what to write."""
    text = spec.strip()
    hint = 'write it as "fsdp:" followed by d<N>, t<N>, c<N>, e.g. actor.backend="fsdp:d2t2c2"'
    if "+" in text or "|" in text:
        raise ConfigError(f"actor.backend={spec!r} holds several allocations; the trainer's own is "
                          f"one component ({hint}); the rollout servers take "
                          "rollout.server.tensor_parallel_size")
    m = _ALLOC.match(text)
    if not m:
        raise ConfigError(f"actor.backend={spec!r} is not an allocation string: {hint}")
    if m["backend"] != "fsdp":
        raise ConfigError(f"actor.backend={spec!r}: Tapioca's trainer is FSDP2 only (no "
                          f"{m['backend']} backend): {hint}")
    dims_text = m["dims"].replace(" ", "")
    dims = _DIM.findall(dims_text)
    if "".join(k + n for k, n in dims) != dims_text:
        raise ConfigError(f"actor.backend={spec!r}: bad dimensions {dims_text!r}: {hint}")
    sizes: dict[str, int] = {}
    for kind, n in dims:
        if kind in ("p", "e"):
            if int(n) > 1:
                what = "pipeline" if kind == "p" else "expert"
                raise ConfigError(f"actor.backend={spec!r}: the FSDP2 trainer has no {what} "
                                  f"parallelism ({kind}{n}): use d, t and c only")
            continue
        if kind not in ("d", "t", "c"):
            raise ConfigError(f"actor.backend={spec!r}: unknown dimension {kind!r}: {hint}")
        sizes[kind] = int(n)  # a repeated dimension: the last one counts, as in AReaL
    return Allocation(dp=sizes.get("d", 1), tp=sizes.get("t", 1), cp=sizes.get("c", 1))


def fsdp_from_allocation(fsdp: FSDPConfig, spec: str) -> FSDPConfig:
    """``fsdp`` with the mesh of ``actor.backend``; a conflicting explicit value is refused."""
    alloc = parse_allocation(spec)
    default = FSDPConfig()
    for name, value in (("world_size", alloc.world_size), ("tensor_parallel_size", alloc.tp),
                        ("context_parallel_size", alloc.cp)):
        given = getattr(fsdp, name)
        _require(given in (value, getattr(default, name)),
                 f"actor.backend={spec!r} means fsdp.{name}={value} but fsdp.{name}={given} is "
                 f"set too: remove one of them")
    return replace(fsdp, world_size=alloc.world_size, tensor_parallel_size=alloc.tp,
                   context_parallel_size=alloc.cp)


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
    if cfg.fsdp.model_parallel:
        check_parallel_switches(cfg.fsdp, cfg.actor)
        if not cfg.model.path:  # the tiny model: its shape is in the config
            m = cfg.model
            check_model_parallel(cfg.fsdp, n_heads=m.num_heads, n_kv_heads=m.num_kv_heads,
                                 intermediate_size=m.intermediate_size, vocab_size=None,
                                 where="the tiny model (model.*)")


def check_parallel_switches(fsdp: FSDPConfig, actor) -> None:
    """The actor switches that apply under tensor / context parallelism; the others are
    refused, each with the way out (``actor`` is an ActorConfig)."""
    mesh = f"({fsdp.describe()})"
    _require(actor.packed_sequences,
             f"tensor / context parallelism {mesh} runs the packed forward: set "
             "actor.packed_sequences=true")
    _require(not actor.compile_layers,
             f"actor.compile_layers is not supported with tensor / context parallelism {mesh} "
             "(the layers' collectives are not compiled): set compile_layers=false")
    if fsdp.tp > 1:
        refused = {
            "liger_kernels": "liger's kernels take plain tensors, the tensor-parallel norms "
                             "hold DTensor weights",
            "recompute_swiglu": "it reads the down projection's whole weight, which tensor "
                                "parallelism splits",
            "logprob_keep_logits": "it keeps Triton logits, and the vocabulary-parallel logprobs "
                                   "run in PyTorch",
        }
        for name, why in refused.items():
            _require(not getattr(actor, name),
                     f"actor.{name} does not apply with fsdp.tensor_parallel_size={fsdp.tp}: {why}; "
                     f"set actor.{name}=false")
        _require(actor.logprob_kernel != "triton",
                 f"actor.logprob_kernel=triton does not apply with fsdp.tensor_parallel_size="
                 f"{fsdp.tp}: the vocabulary-parallel logprobs all-reduce between the max and the "
                 "sum, which the fused kernel does in one pass; set actor.logprob_kernel=auto")
