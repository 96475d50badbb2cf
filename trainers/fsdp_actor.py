"""The data-parallel sharded actor: PPO steps over N ranks with PyTorch FSDP2.

Consumes, on rank 0, what :class:`~tapioca.trainers.ppo_actor.PPOActor` consumes (a
step's :class:`SeqItem` list and ``policy_version``, from the trainer role, the only
Kafka client); emits the same :class:`StepResult` (metrics over all ranks) and, on
request, the whole weights (publishing), whole-weight loads (rollback) and sharded
checkpoints (:mod:`tapioca.trainers.sharded_checkpoint`). Ranks 1..N-1 run
:meth:`ShardedActor.serve`: they obey rank 0's commands until ``stop``.

Sharding: ``fully_shard`` on every decoder layer and on a small root module whose
forward is the actor's logprob forward (so the embedding, the final norm and the tied
LM head are gathered for the whole of it), with ``MixedPrecisionPolicy``: parameters
gathered and computed in ``fsdp.param_dtype`` (bf16), the sharded parameters and
Adam's state (the master weights) in ``actor.param_dtype`` (fp32), gradients reduced
in ``fsdp.grad_reduce_dtype`` (fp32).

How a step is split (:func:`plan_shards`, on rank 0): the step's sequences are packed
into micro-batches of at most ``actor.mb_max_tokens`` (the actor's packer) and dealt
into ``ppo_n_minibatches`` minibatches as one process would; within each minibatch
the micro-batch count is raised to a multiple of N by halving the largest ones, and
each rank gets the same number K of micro-batches, balanced by tokens (longest first
to the least loaded rank). Equal K matters: FSDP2 gathers every layer in every forward,
so all ranks must run the same number of forwards and backwards. A step with fewer
sequences than needed gives a rank a one-token dummy micro-batch whose gradient is
zeroed (``actor/fsdp_dummy_micro_batches`` counts them).

Tensor / context parallelism (``fsdp.tensor_parallel_size`` / ``context_parallel_size``,
docs/distributed.md §4): the ranks form a (dp, cp, tp) mesh (:func:`build_mesh`); the
weights are split over tp first (models/parallel.py), then FSDP2 shards them over dp x cp;
the step is planned per data-parallel replica (its tp and cp ranks share its micro-batches,
each packed to a multiple of tp x cp tokens) and the logprobs come from the parallel
forward with the vocabulary-parallel head (:func:`parallel_batch_logprobs`). With
tp = cp = 1 none of it runs: one data-parallel dimension over every rank, as below.

Loss normalisation (why N ranks equal one process on the same batch): PPOActor scales
micro-batch i of minibatch m by ``units_i / U_m`` with ``U_m`` the units (trained
tokens for token-mean, sequences otherwise) of *its own* micro-batches. Each rank's
gradient is further scaled by ``N * U_m(rank) / U_m(all ranks)`` (applied to the
gradient of the logprobs, so loss values and metrics are untouched), and FSDP2's
reduce-scatter averages over N ranks: the sum is the gradient of the step's loss
normalised by the global unit count, exactly what one process computes. (Under tp / cp:
``dp x cp x U_m(replica) / U_m(all replicas)``, FSDP2 averaging over dp x cp.) Gradient
clipping sees the global norm (DTensor gradients).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, replace
from typing import Any

import torch

from ..algorithms.aggregation import agg_units
from ..config.distributed import FSDPConfig
from ..config.policy import PolicySpec
from ..config.schema import ActorConfig
from ..config.weights import WeightsConfig
from ..schemas.errors import ConfigError, FatalRoleError
from . import sharded_checkpoint
from .batching import SeqItem, TensorBatch, pack
from .fsdp_ranks import Channel
from .packing import PackedBatch, to_packed
from .ppo_actor import PPOActor, StepResult, _split

log = logging.getLogger(__name__)

DUMMY_GROUP = ""  # group_id of a dummy item (a rank with no sequence for a micro-batch)


def plan_shards(lengths: list[int], world_size: int, max_tokens: int,
                n_minibatches: int = 1) -> list[list[list[int]]]:
    """Per rank, its micro-batches as lists of item indices (``[]``: a dummy), every
    rank the same number of them, balanced by tokens.

    Minibatches are those of one process on the whole step (the packer's micro-batches
    dealt round-robin, PPOActor's ``_split``), and a rank's micro-batch j belongs to
    minibatch ``j % n`` as PPOActor splits it, so every optimizer step sees the same
    sequences as in one process."""
    groups = [list(g) for g in pack(lengths, max_tokens)] if lengths else []
    n = max(1, min(n_minibatches, len(groups)))
    per_mb = [_deal([i for g in groups[m::n] for i in g], lengths, world_size, max_tokens)
              for m in range(n)]
    k = max(len(plan[0]) for plan in per_mb)
    return [[(per_mb[m][r][j] if j < len(per_mb[m][r]) else []) for j in range(k) for m in range(n)]
            for r in range(world_size)]


def _deal(ids: list[int], lengths: list[int], world_size: int, max_tokens: int) -> list[list[list[int]]]:
    """One minibatch's items into the same number of micro-batches per rank."""
    groups = [[ids[i] for i in g] for g in pack([lengths[i] for i in ids], max_tokens)] if ids else []
    while len(groups) % world_size or not groups:
        splittable = [g for g in groups if len(g) > 1]
        if not splittable:
            groups.append([])  # a dummy: fewer sequences than ranks need
            continue
        big = max(splittable, key=lambda g: sum(lengths[i] for i in g))
        groups.remove(big)
        ordered = sorted(big, key=lambda i: lengths[i], reverse=True)
        groups += [ordered[0::2], ordered[1::2]]
    per_rank = len(groups) // world_size
    plan: list[list[list[int]]] = [[] for _ in range(world_size)]
    load = [0] * world_size
    # Longest first, each to the least loaded rank that still has room.
    for g in sorted(groups, key=lambda g: sum(lengths[i] for i in g), reverse=True):
        r = min((r for r in range(world_size) if len(plan[r]) < per_rank), key=lambda r: load[r])
        plan[r].append(g)
        load[r] += sum(lengths[i] for i in g)
    return plan


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


class _LogprobRoot(torch.nn.Module):
    """FSDP2's root unit: its forward is the actor's logprob forward, so the parameters
    outside the decoder layers (embedding, final norm, tied LM head) are gathered for
    all of it, including the LM head applied to hidden states in chunks."""

    def __init__(self, model: torch.nn.Module, actor: "ShardedActor") -> None:
        super().__init__()
        self.model = model
        self._actor = [actor]  # not a submodule

    def forward(self, batch: TensorBatch, entropy: bool):
        lp, ent = self._actor[0].root_logprobs(batch, entropy)
        # FSDP2 hooks the outputs for the backward; a view could lose that hook to an
        # in-place op downstream, so views are returned as copies ([B, T-1]: small).
        return (lp.clone() if lp._is_view() else lp,
                ent.clone() if ent is not None and ent._is_view() else ent)


def build_mesh(fsdp: FSDPConfig, device: torch.device):
    """The trainer's device mesh ``("dp", "cp", "tp")``, tp ranks adjacent (one host's
    fast links carry the most traffic)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (fsdp.dp, fsdp.cp, fsdp.tp), mesh_dim_names=("dp", "cp", "tp"))


def fsdp_mesh(mesh, fsdp: FSDPConfig):
    """The mesh FSDP2 shards over: dp, and cp too (cp ranks hold the same weights and see
    different tokens, so for the weights they are data parallel)."""
    return mesh["dp", "cp"]._flatten("dp_cp") if fsdp.cp > 1 else mesh["dp"]


def shard_model(model: torch.nn.Module, fsdp: FSDPConfig, device: torch.device,
                root: torch.nn.Module, layers: list[torch.nn.Module] | None = None,
                mesh=None):
    """FSDP2 units: each of ``layers`` (the modules called once per decoder layer: the
    packed forward's layers, which hold the HF layers, else the HF layers), then ``root``
    (everything else). A unit's parameters are gathered by its forward hooks, so the
    unit must be the module whose forward runs. ``mesh``: the (dp, cp, tp) mesh of the
    tensor / context-parallel trainer (its weights already split over tp); None: one
    data-parallel dimension over every rank. With ``fsdp.expert_parallel_size`` > 1 (data
    parallel only: MoE models are refused under tp / cp) the MoE layers' experts are
    sharded over expert groups first and left out of FSDP2 (models/expert_parallel.py);
    returns ``(expert parameters, edp group)`` then, else None."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    experts = None
    if fsdp.expert_parallel_size > 1:
        from ..models.expert_parallel import shard_experts

        if layers is None:
            raise ConfigError(f"fsdp.expert_parallel_size={fsdp.expert_parallel_size} needs the packed "
                              "forward's MoE layers: this model trains with the padded HF forward")
        experts = shard_experts(layers, fsdp.expert_parallel_size, device)
    if mesh is not None:
        mesh = fsdp_mesh(mesh, fsdp)
    else:
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy(param_dtype=getattr(torch, fsdp.param_dtype),
                              reduce_dtype=getattr(torch, fsdp.grad_reduce_dtype))
    for layer in model.get_decoder().layers if layers is None else layers:
        own = {p for p in layer.parameters() if experts is not None and p in experts[0]}
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=fsdp.reshard_after_forward,
                    **({"ignored_params": own} if own else {}))
    # The packed forward's layers live outside ``root``'s tree (root holds the HF model),
    # so root must be told that their (now sharded) parameters are not its own.
    ignored = {p for layer in layers for p in layer.parameters()} if layers is not None else None
    # The root's parameters are needed again right away by the backward: keep them.
    fully_shard(root, mesh=mesh, mp_policy=mp, reshard_after_forward=False, ignored_params=ignored)
    return experts


class ShardedActor(PPOActor):
    """PPOActor over N FSDP2 ranks; constructed on every rank after the process groups
    (:func:`tapioca.trainers.fsdp_ranks.init_process_groups`)."""

    def __init__(self, model: torch.nn.Module, cfg: ActorConfig, fsdp: FSDPConfig, *,
                 channel: Channel, temperature: float, pad_token_id: int,
                 device: torch.device, followers: list | None = None,
                 total_train_steps: int = 0, bucket_bytes: int | None = None,
                 policy: PolicySpec | None = None, lora_seed: int = 0) -> None:
        """``bucket_bytes``: how much of the whole weights a rank holds at a time when they
        are gathered for publishing (``weights.bucket_bytes``; None: that field's default).
        ``policy`` / ``lora_seed``: its adapter, a LoRA adapter on the frozen model (PPOActor)."""
        self.channel = channel
        self.bucket_bytes = WeightsConfig().bucket_bytes if bucket_bytes is None else bucket_bytes
        self.fsdp = fsdp
        self.world_size = channel.info.world_size
        self.followers = followers or []  # rank 0's child processes (ranks it started)
        self._grad_scale: dict[int, float] = {}
        self._aux_scale: dict[int, float] = {}
        self._planned: list[TensorBatch] | None = None
        self._closed = False
        self._experts = None  # (expert parameters, edp group) with expert parallelism
        self.root = _LogprobRoot(model, self)
        self.mesh = self.dims = None
        # This rank's data-parallel replica, and whether it reports for it (metrics).
        self.dp_rank, self.reports = self.channel.info.rank, True
        if fsdp.model_parallel:
            from ..config.distributed import check_parallel_switches
            from ..models.parallel import MeshDims
            from ..models.parallel_check import check_parallel_model

            check_parallel_switches(fsdp, cfg)
            check_parallel_model(model, fsdp)
            self.mesh = build_mesh(fsdp, device)
            self.dims = MeshDims(self.mesh, tp=fsdp.tp, cp=fsdp.cp)
            self.dp_rank = self.mesh.get_local_rank("dp")
            self.reports = self.dims.tp_rank == 0 and self.dims.cp_rank == 0

        def shard(layers) -> None:
            self._experts = shard_model(model, fsdp, device, self.root, layers, self.mesh)

        # On CUDA the attention kernel is chosen below, for the GPU and the compute dtype:
        # the model as loaded (host, fp32 masters) would only allow sdpa.
        built = replace(cfg, attention_backend="sdpa") if device.type == "cuda" else cfg
        super().__init__(model, built, temperature=temperature, pad_token_id=pad_token_id,
                         # The weights stay where they were loaded (the host on CUDA):
                         # fully_shard (and, under tp, distribute_tensor) moves each rank's
                         # shards to its device, so no GPU ever holds the whole model.
                         device=str(device), total_train_steps=total_train_steps,
                         parallel=self.dims, place_model=False, shard=shard, policy=policy,
                         lora_seed=lora_seed)
        self.cfg = cfg
        if self.packed is not None and device.type == "cuda":
            _resolve_attention(self.packed, cfg, fsdp, device)

    # ------------------------------------------------------------------ rank 0's calls

    def _command(self, cmd: dict[str, Any]) -> Any:
        """Rank 0: send ``cmd`` to every rank, then run it here too."""
        self._check_followers()
        self.channel.broadcast(cmd)
        return self._run(cmd)

    def train_step(self, items: list[SeqItem], *, policy_version: int | None = None) -> StepResult:
        t0 = time.perf_counter()
        trained = [it for it in items if any(it.loss_mask)]  # nothing to train otherwise
        # Per data-parallel replica: the tp and cp ranks of one replica share its sequences.
        plan = plan_shards([it.length for it in trained], self.fsdp.dp, self.cfg.mb_max_tokens,
                           self.cfg.ppo_n_minibatches)
        shards = [[[asdict(trained[i]) for i in group] for group in groups] for groups in plan]
        result = self._command({"op": "step", "shards": shards, "version": policy_version})
        elapsed = time.perf_counter() - t0
        result.metrics["actor/step_time_s"] = elapsed
        n_all = sum(it.length for it in items)
        result.metrics["actor/tokens_per_s"] = n_all / elapsed if elapsed > 0 else 0.0
        return result

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole weights on rank 0's host (the other ranks return an empty dict)."""
        return self._command({"op": "full_state_dict"})

    def publish_state_dict(self) -> dict[str, torch.Tensor]:
        if self.lora is None:
            return self.full_state_dict()
        return self._command({"op": "adapter_state_dict"})

    def load_publish_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """A LoRA run's rollback: the adapter, whole, onto every rank (Adam restarted)."""
        if self.lora is None:
            self.load_full_state_dict(tensors)
            return
        from ..models.lora import adapter_parameter_names

        names = adapter_parameter_names(self.model)
        unknown = sorted(set(tensors) - set(names))
        if unknown or len(tensors) != len(names):
            raise FatalRoleError(f"the adapter does not fit the model's LoRA layers (e.g. {unknown[:2]})")
        self.load_full_state_dict({names[k]: v for k, v in tensors.items()})

    def load_full_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Also restarts Adam's moments on every rank (its only use is a rollback, where
        the trainer restarts them)."""
        self._full_weights = dict(tensors)  # torch writes the distributed tensors into it
        try:
            self._command({"op": "load_full"})
        finally:
            self._full_weights = None

    def save_checkpoint(self, path, progress) -> None:
        self._command({"op": "save", "path": str(path), "version": progress.version,
                       "progress": progress.__dict__})

    def load_checkpoint(self, path):
        from .checkpoint import TrainerProgress

        record = sharded_checkpoint.read_record(path)
        if record is not None and bool(record.get("trainable_only")) != (self.lora is not None):
            self._command({"op": "noop"})
            raise ConfigError(f"the sharded checkpoint {path} was written with actor.lora.enabled="
                              f"{str(bool(record.get('trainable_only'))).lower()}: resume with that "
                              "setting, or start a new trial")
        if record is None:
            self._command({"op": "noop"})
            return None
        self._command({"op": "load", "path": str(path), "shards": record["shards"]})
        return TrainerProgress(**record["progress"])

    def close(self) -> None:
        """Rank 0: tell the other ranks to stop and wait for them."""
        if self._closed or not self.channel.info.leader:
            return
        self._closed = True
        try:
            if all(p.poll() is None for p in self.followers):
                self.channel.broadcast({"op": "stop"})
        except Exception as exc:  # a rank already gone: nothing to stop there
            log.warning("stopping the trainer ranks: %s", exc)
        for p in self.followers:
            try:
                p.wait(30)
            except Exception:
                p.kill()
        _destroy_groups()

    def _check_followers(self) -> None:
        dead = [(i + 1, p.returncode) for i, p in enumerate(self.followers) if p.poll() is not None]
        if dead:
            rank, code = dead[0]
            raise FatalRoleError(f"trainer rank {rank} exited with code {code} (see its log "
                                 f"logs/trainer-rank{rank}.log); the role restarts all ranks")

    # ------------------------------------------------------------------ every rank

    def serve(self) -> None:
        """Ranks 1..N-1: run rank 0's commands until it says stop."""
        while True:
            cmd = self.channel.broadcast()
            if cmd["op"] == "stop":
                break
            self._run(cmd)
        _destroy_groups()

    def _run(self, cmd: dict[str, Any]) -> Any:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        op = cmd["op"]
        if op == "step":
            groups = [[SeqItem(**d) for d in g] for g in cmd["shards"][self.dp_rank]]
            return self._local_step(groups, cmd["version"])
        if op == "full_state_dict":
            return gather_full_state_dict(self.model, self.bucket_bytes, self.channel.info.leader)
        if op == "adapter_state_dict":
            # The adapter only, gathered one tensor at a time (every rank, same order): the
            # frozen base is never all-gathered for a publish.
            from ..models.lora import adapter_state_dict

            out = {}
            for name, p in adapter_state_dict(self.model).items():
                full = p.full_tensor() if hasattr(p, "full_tensor") else p
                if self.channel.info.leader:
                    out[name] = full.detach().cpu()
            return out
        if op == "load_full":
            tensors = self._full_weights if self.channel.info.leader else {}
            set_model_state_dict(self.model, tensors, options=StateDictOptions(
                full_state_dict=True, broadcast_from_rank0=True, strict=False))
            self.optimizer.state.clear()
            return None
        if op == "save":
            from .checkpoint import TrainerProgress

            progress = TrainerProgress(**cmd["progress"]) if self.channel.info.leader else None
            sharded_checkpoint.save(cmd["path"], cmd["version"], self.model, self.optimizer,
                                    self.channel, progress, trainable_only=self.lora is not None)
            return None
        if op == "load":
            sharded_checkpoint.load(cmd["path"], cmd["shards"], self.model, self.optimizer,
                                    self.channel, trainable_only=self.lora is not None)
            return None
        if op == "noop":
            return None
        raise FatalRoleError(f"trainer rank {self.channel.info.rank}: unknown command {op!r}")

    def _local_step(self, groups: list[list[SeqItem]], version: int | None) -> StepResult:
        """This rank's part of a step: its K micro-batches, scaled to the global units."""
        n_dummy = sum(1 for g in groups if not g)
        mbs: list[TensorBatch] = []
        for g in groups:
            items = g or [self._dummy(version)]
            if self.dims is not None:  # whole micro-batch, its stream split over tp x cp
                mbs.append(to_packed(items, self.device, pad_to=self.fsdp.tp * self.fsdp.cp, cp=self.fsdp.cp))
                continue
            built = PPOActor.micro_batches(self, items)
            if len(built) != 1:
                raise FatalRoleError(f"the sharded step planned one micro-batch of {len(g)} "
                                     f"sequences but the actor packed {len(built)}")
            mbs += built
        mode = self.cfg.loss_agg_mode
        units = [agg_units(mb.mask_BT, mode) for mb in mbs]
        minibatches = _split(list(range(len(mbs))), self.cfg.ppo_n_minibatches)
        local = [sum(units[i] for i in ids) or 1 for ids in minibatches]
        real = [sum(units[i] for i in ids if groups[i]) for ids in minibatches]
        # Summed over every rank: each replica's units counted once per tp x cp rank of it.
        replicas = self.fsdp.tp * self.fsdp.cp
        # The router losses are token means: scaled to the step's tokens over all ranks
        # (MoE models train data parallel only, so no tp / cp replicas to count there).
        n_all = [mb.seqs.n_tokens if isinstance(mb, PackedBatch) else int(mb.input_ids_BT.numel()) for mb in mbs]
        local_all = [sum(n_all[i] for i in ids) or 1 for ids in minibatches]
        real_all = [sum(n_all[i] for i in ids if groups[i]) for ids in minibatches]
        sums = self.channel.sum([float(u) for u in real] + [float(n) for n in real_all])
        total = [t / replicas for t in sums[:len(real)]]
        total_all = sums[len(real):]
        # FSDP2 averages the gradients over its dp x cp ranks; the cp ranks of a replica
        # hold disjoint parts of one loss's gradient, which must add up: hence dp x cp.
        divisor = self.fsdp.dp * self.fsdp.cp
        self._grad_scale, self._aux_scale = {}, {}
        for m, ids in enumerate(minibatches):
            for i in ids:
                scale = divisor * local[m] / total[m] if groups[i] and total[m] else 0.0
                self._grad_scale[id(mbs[i])] = scale
                aux = self.world_size * local_all[m] / total_all[m] if groups[i] and total_all[m] else 0.0
                self._aux_scale[id(mbs[i])] = aux
        self._planned = mbs
        try:
            flat = [it for g in groups for it in g]
            result = super().train_step(flat, policy_version=version)
        finally:
            self._planned, self._grad_scale, self._aux_scale = None, {}, {}
        dummy_tokens = sum(mb.n_tokens for mb, g in zip(mbs, groups) if not g)
        return self._reduce_metrics(result, dummy_tokens, n_dummy, float(sum(real)))

    def _dummy(self, version: int | None) -> SeqItem:
        pad = self.pad_token_id
        return SeqItem(group_id=DUMMY_GROUP, input_ids=[pad, pad], prompt_len=1,
                       behav_logprobs=[0.0], versions=[version or 0], loss_mask=[1],
                       advantage=0.0, reward=0.0)

    def _reduce_metrics(self, result: StepResult, dummy_tokens: int, n_dummy: int,
                        units: float) -> StepResult:
        """Token-weighted means over ranks (the loss: weighted by aggregation units, which
        makes it the one-process value with one minibatch); counts summed."""
        m = result.metrics
        tokens = m.get("actor/trained_tokens", 0.0) - dummy_tokens
        rows = self.channel.gather({"metrics": m, "tokens": tokens, "units": units,
                                    "dummies": n_dummy, "applied": result.applied_minibatches,
                                    "skipped": result.skipped_minibatches,
                                    "skipped_groups": sorted(result.skipped_group_ids),
                                    "reports": self.reports})
        # One row per data-parallel replica (its tp / cp ranks computed the same loss).
        rows = [r for r in rows if r["reports"]]
        total = sum(r["tokens"] for r in rows)
        out: dict[str, float] = {}
        for key in sorted({k for r in rows for k in r["metrics"]}):
            weight = "units" if key == "actor/loss" else "tokens"
            vals = [(r["metrics"][key], r[weight]) for r in rows if key in r["metrics"]]
            if key == "actor/router_replay_agreement":  # a share of each rank's replayed tokens
                vals = [(r["metrics"][key], r["metrics"]["actor/router_replay_tokens"]) for r in rows
                        if key in r["metrics"]]
            if key in ("actor/trained_tokens", "actor/micro_batches", "actor/router_replay_tokens"):
                out[key] = float(sum(v for v, _ in vals))
            elif key in ("actor/step_time_s", "actor/rollout_train_abs_logprob_diff_max"):
                out[key] = float(max(v for v, _ in vals))
            else:
                w = sum(t for _, t in vals)
                out[key] = float(sum(v * t for v, t in vals) / w) if w else float(vals[0][0])
        out["actor/trained_tokens"] = float(total)
        out["actor/fsdp_dummy_micro_batches"] = float(sum(r["dummies"] for r in rows))
        out["actor/fsdp_world_size"] = float(self.world_size)
        # Every rank took the same skip decisions (_finite is collective); the groups of
        # the skipped minibatches are every rank's share of them.
        skipped_groups = {g for r in rows for g in r["skipped_groups"]} - {DUMMY_GROUP}
        return StepResult(out, int(total), skipped_minibatches=rows[0]["skipped"],
                          applied_minibatches=rows[0]["applied"], skipped_group_ids=skipped_groups)

    # ------------------------------------------------------------------ PPOActor hooks

    def micro_batches(self, items: list[SeqItem]) -> list[TensorBatch]:
        if self._planned is not None:
            return self._planned
        return super().micro_batches(items)

    def _finite(self, values: list[float]) -> bool:
        # One decision for all ranks: a rank that skipped a step the others applied would
        # leave the shards' optimizer states apart for good.
        ok = float(PPOActor._finite(self, values))
        return self.channel.sum([ok])[0] == self.world_size

    def _aux_weight(self, batch: TensorBatch) -> float:
        # N * (this rank's tokens) / (all ranks' tokens) of the minibatch, so that FSDP2's
        # average of the router losses' gradients is the token mean of one process (0 for
        # a dummy micro-batch).
        return self._aux_scale.get(id(batch), 1.0)

    def _sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        t = t.clone()
        dist.all_reduce(t)
        return t

    def _before_clip(self) -> None:
        if self._experts is not None:
            from ..models.expert_parallel import reduce_expert_grads

            reduce_expert_grads(*self._experts, self.world_size)

    def root_logprobs(self, batch: TensorBatch, entropy: bool):
        """The logprob forward inside FSDP2's root unit: PPOActor's, or under tensor /
        context parallelism the parallel forward and (vocabulary-parallel) head."""
        if self.dims is None:
            return PPOActor.logprobs(self, batch, entropy=entropy)
        return parallel_batch_logprobs(self, batch, entropy)

    def logprobs(self, batch: TensorBatch, *, entropy: bool = False):
        lp, ent = self.root(batch, entropy)
        scale = self._grad_scale.get(id(batch))
        if scale is not None and scale != 1.0 and torch.is_grad_enabled():
            lp = _ScaleGrad.apply(lp, scale)
            ent = _ScaleGrad.apply(ent, scale) if ent is not None else None
        return lp, ent


def parallel_batch_logprobs(actor: PPOActor, batch, entropy: bool):
    """``[B, T-1]`` logprobs (and entropy) of a packed micro-batch through the tensor /
    context-parallel forward (``actor.packed``: a ParallelPackedCausalLM)."""
    from ..models.forward import autocast_context
    from ..models.parallel import parallel_token_logprobs

    cfg = actor.cfg
    with autocast_context(actor.device, cfg.autocast_dtype):
        lp_M, ent_M = parallel_token_logprobs(
            actor.packed, batch.input_ids_N, batch.position_ids_N, batch.seqs, batch.rows_M,
            batch.labels_M, batch.cp_rows or (0, batch.rows_M.numel()), temperature=actor.temperature,
            chunk_tokens=cfg.logprob_chunk_tokens, compute_entropy=entropy, kernel=cfg.logprob_kernel,
            keep_logits=cfg.logprob_keep_logits)
    return batch.to_padded(lp_M), (batch.to_padded(ent_M) if entropy else None)


def _resolve_attention(packed, cfg: ActorConfig, fsdp: FSDPConfig, device: torch.device) -> None:
    """The attention kernel for the device and dtype the ranks compute in. The packed
    forward picked one from the model as loaded (on the host, fp32 master weights),
    which would be sdpa; FSDP2 computes in fsdp.param_dtype on the GPU (flash varlen)."""
    from ..models.attention import resolve_backend

    layer = packed.layers[0]
    split = fsdp.tp * fsdp.cp
    dtype = getattr(torch, cfg.autocast_dtype or fsdp.param_dtype)
    backend = resolve_backend(cfg.attention_backend, device, dtype, max(1, layer.n_heads // split),
                              max(1, layer.n_kv_heads // split), layer.head_dim)
    packed.attention_backend = backend
    for layer in packed.layers:
        layer.attn_backend = backend


def gather_full_state_dict(model: torch.nn.Module, bucket_bytes: int, leader: bool) -> dict[str, torch.Tensor]:
    """Collective: the whole weights (every key of the model's plain state dict), on the
    leader's host. Gathered bucket by bucket: at most ``bucket_bytes`` of whole tensors
    exist on a rank's device at a time before the leader copies them to the host (the
    other ranks drop them), so publishing a 72B model needs no 144 GB on one GPU. A tied
    weight is gathered once and appears under each of its names, as in the HF model."""
    state = model.state_dict(keep_vars=True)  # the parameters themselves: a tied one is one object
    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor] = {}
    bucket: list[tuple[str, int, torch.Tensor]] = []
    size = 0

    def flush() -> None:
        nonlocal size
        for name, key, full in bucket:
            if leader:
                done[key] = full.detach().to("cpu", copy=True)  # never the live parameter itself
                out[name] = done[key]
        bucket.clear()
        size = 0

    for name, t in state.items():
        key = id(t)
        if key in done or any(k == key for _, k, _ in bucket):
            flush()
            out[name] = done[key] if leader else None
            continue
        with torch.no_grad():
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
        bucket.append((name, key, full))
        size += full.numel() * full.element_size()
        if size >= bucket_bytes:
            flush()
    flush()
    return {k: v for k, v in out.items() if v is not None} if leader else {}


def _destroy_groups() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def build_sharded_actor(cfg, sec) -> ShardedActor:
    """The trainer role's actor when ``fsdp.world_size`` > 1 (runtime/builders.py).

    Rank 0 (a plain ``tapioca role trainer``) starts ranks 1..N-1 with the config it
    runs (written to ``<run>/logs/trainer-ranks.yaml``) and returns its actor; under
    torchrun every rank is started from outside. Ranks 1..N-1 never return: they serve
    rank 0 until it stops them, then exit (code 0; 1 after an error, which rank 0's next
    collective sees at once)."""
    import atexit
    import os
    from pathlib import Path

    from ..config.loader import to_yaml
    from ..models.factory import load_model_and_tokenizer
    from .fsdp_ranks import (
        command_line,
        init_process_groups,
        rank_device,
        rank_from_env,
        start_ranks,
    )

    info = rank_from_env(sec.fsdp)
    followers: list = []
    if info is None:
        logs = Path(sec.run_dir) / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        written = logs / "trainer-ranks.yaml"
        written.write_text(to_yaml(cfg))
        info, followers = start_ranks(sec.fsdp, command_line(written), logs)
    device = rank_device(sec.actor.device, info)
    log.info("trainer rank %d of %d on %s", info.rank, info.world_size, device)
    channel = Channel(init_process_groups(sec.fsdp, info, device), info)
    # On CUDA the model is loaded on the host: fully_shard moves only this rank's shard.
    model, tokenizer = load_model_and_tokenizer(
        sec.model.path, dtype=sec.actor.weights_dtype, device="cpu" if device.type == "cuda" else str(device))
    actor = ShardedActor(model, sec.actor, sec.fsdp, channel=channel, temperature=sec.temperature,
                         pad_token_id=tokenizer.pad_token_id or 0, device=device,
                         followers=followers, total_train_steps=sec.total_train_steps,
                         bucket_bytes=sec.weights.bucket_bytes, policy=sec.policy, lora_seed=sec.seed)
    if info.leader:
        atexit.register(actor.close)
        return actor
    try:
        actor.serve()
    except BaseException:  # noqa: BLE001 - any failure: die now so rank 0's collective fails fast
        log.exception("trainer rank %d failed", info.rank)
        logging.shutdown()
        os._exit(1)
    log.info("trainer rank %d stopped cleanly", info.rank)
    raise SystemExit(0)
