"""Expert parallelism for the packed MoE forward: each rank holds E / P of every MoE
layer's experts and the tokens go to them by all-to-all (``fsdp.expert_parallel_size`` P).

Consumes an MoE layer's routed tokens (``x_NH`` and the top-k expert ids ``ids_NK`` of
the rank's own micro-batch) and the rank's slice of the fused expert weights; emits the
experts' outputs for the rank's tokens ``[N, k, H]``, in the order of ``ids_NK``, as one
process computing all experts would. Keyed by the expert group: ranks ``r`` with the
same ``r // P`` in a ``(W / P, P)`` mesh (``edp`` x ``ep``) exchange tokens; expert
``e`` lives on EP rank ``e // (E / P)``.

Per MoE layer and forward (Megatron's all-to-all dispatcher, dropless):

1. the token-expert pairs sorted by expert (so by destination rank), their counts per
   expert exchanged (one all-to-all of ``E`` integers) and read on the host, once:
   the split sizes of the next two (the one host sync of the layer);
2. the pairs' hidden states dispatched by ``all_to_all_single`` (autograd: its backward
   is the reverse all-to-all), sorted by local expert, through the grouped SwiGLU
   (:class:`tapioca.models.moe._GroupedSwiGLU`), back to source order;
3. the outputs combined back by the reverse all-to-all.

The weights: :func:`shard_experts` turns each MoE layer's ``gate_up_proj`` / ``down_proj``
into DTensors on that mesh, sharded over ``ep`` on the expert dimension and replicated
over ``edp``, so whole-weight state dicts (publishing), sharded checkpoints (DCP) and
AdamW see them as any parameter (FSDP2 leaves them alone: ``ignored_params``). Their
gradients are each rank's own experts' sums over the tokens of its expert group:
:func:`reduce_expert_grads` sums them over ``edp`` and divides by the world size, the
average FSDP2's reduce-scatter takes of every other gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..schemas.errors import ConfigError
from .moe import _GroupedSwiGLU, _inverse, _use_grouped_mm


@dataclass
class ExpertParallel:
    """One rank's place in the expert group of its MoE layers."""

    group: object  # torch.distributed ProcessGroup of the ep mesh dimension
    size: int
    rank: int
    num_experts: int

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.size

    def experts(self, x_NH: torch.Tensor, w13_E2IH: torch.Tensor, w2_EHI: torch.Tensor,
                ids_NK: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """``[N, k, H]``: expert ``ids_NK[t, j]`` of token t's ``x_NH[t]``; ``w13`` / ``w2``
        are this rank's experts (``[E / P, 2I, H]``, ``[E / P, H, I]``); ``counts_E``:
        the pairs per expert (all E) of ``ids_NK``."""
        import torch.distributed as dist
        from torch.distributed.nn.functional import all_to_all_single

        n, k = ids_NK.shape
        n_local, size = self.local_experts, self.size
        _, order_P = torch.sort(ids_NK.reshape(-1), stable=True)
        # recv_SE[s, e]: pairs source rank s sends to this rank's local expert e.
        recv_SE = torch.empty_like(counts_E)
        dist.all_to_all_single(recv_SE, counts_E, group=self.group)
        # The layer's one host read: every split size below.
        host = torch.cat([counts_E, recv_SE]).tolist()
        send = [sum(host[r * n_local:(r + 1) * n_local]) for r in range(size)]
        recv_counts = host[self.num_experts:]
        recv = [sum(recv_counts[s * n_local:(s + 1) * n_local]) for s in range(size)]
        per_expert = [sum(recv_counts[s * n_local + e] for s in range(size)) for e in range(n_local)]
        xs_PH = x_NH.index_select(0, order_P // k)
        xr_RH = all_to_all_single(xs_PH.new_empty((sum(recv), x_NH.shape[1])), xs_PH,
                                  output_split_sizes=recv, input_split_sizes=send, group=self.group)
        # Received rows come by source rank, each source's by expert: order them by expert.
        local_R = torch.repeat_interleave(torch.arange(n_local, device=x_NH.device).repeat(size), recv_SE,
                                          output_size=sum(recv))
        _, perm_R = torch.sort(local_R, stable=True)
        offs_E = torch.tensor(per_expert, device=x_NH.device).cumsum(0).to(torch.int32)
        splits = None if _use_grouped_mm(xr_RH, w13_E2IH, w2_EHI) else per_expert
        y_RH = _GroupedSwiGLU.apply(xr_RH, w13_E2IH, w2_EHI, perm_R, 1, offs_E, splits)
        yr_RH = y_RH.index_select(0, _inverse(perm_R))
        ys_PH = all_to_all_single(yr_RH.new_empty((n * k, yr_RH.shape[1])), yr_RH,
                                  output_split_sizes=send, input_split_sizes=recv, group=self.group)
        return ys_PH.index_select(0, _inverse(order_P)).view(n, k, -1)


EXPERT_TENSORS = ("gate_up_proj", "down_proj")


def shard_experts(layers: list[nn.Module], expert_parallel_size: int, device: torch.device):
    """Shard the experts of every MoE layer among ``layers`` (packed decoder layers) over
    groups of ``expert_parallel_size`` ranks (see the module docstring); returns
    ``(expert parameters, the edp process group)``. Every rank must hold the same
    weights before (the model as loaded)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    world = dist.get_world_size()
    ep = expert_parallel_size
    moe = [layer for layer in layers if getattr(layer, "is_moe", False)]
    if not moe:
        raise ConfigError(f"fsdp.expert_parallel_size={ep} shards the experts of MoE layers, but the "
                          "model has none the packed forward runs: set fsdp.expert_parallel_size=1")
    num_experts = int(moe[0].layer.mlp.experts.gate_up_proj.shape[0])
    if num_experts % ep:
        raise ConfigError(f"fsdp.expert_parallel_size={ep} must divide the model's {num_experts} experts "
                          "per layer")
    mesh = init_device_mesh(device.type, (world // ep, ep), mesh_dim_names=("edp", "ep"))
    placements = [Replicate(), Shard(0)]
    params: set[nn.Parameter] = set()
    for layer in moe:
        experts = layer.layer.mlp.experts
        for name in EXPERT_TENSORS:
            p = getattr(experts, name)
            sharded = nn.Parameter(distribute_tensor(p.detach().to(device), mesh, placements),
                                   requires_grad=p.requires_grad)
            experts.register_parameter(name, sharded)
            params.add(sharded)
        layer.expert_parallel = ExpertParallel(group=mesh["ep"].get_group(), size=ep,
                                               rank=mesh["ep"].get_local_rank(), num_experts=num_experts)
    return params, mesh["edp"].get_group()


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (differentiably); a plain tensor as it is."""
    return t.to_local() if hasattr(t, "to_local") else t


@torch.no_grad()
def reduce_expert_grads(params, edp_group, world_size: int) -> None:
    """The expert gradients as FSDP2 would have averaged them (see the module docstring)."""
    import torch.distributed as dist

    for p in params:
        if p.grad is None:
            continue
        g = local(p.grad)
        if dist.get_world_size(edp_group) > 1:
            dist.all_reduce(g, group=edp_group)
        g.div_(world_size)
