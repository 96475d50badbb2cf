"""Tensor, sequence and context parallelism of the packed forward (DTensor; NCCL or gloo).

Consumes a ``transformers`` Qwen2 / Qwen3 / Llama causal LM (its modules and weights,
split in place), a :class:`MeshDims` (the trainer's (dp, cp, tp) device mesh) and a
packed micro-batch whose token stream is a multiple of ``tp x cp`` long
(:func:`tapioca.trainers.packing.to_packed` with ``pad_to``); emits, on each rank, the
final hidden states of its context-parallel slice of the tokens, and from them the
logprobs (and entropy) of the micro-batch's scored tokens (:func:`parallel_token_logprobs`).
Keyed by nothing.

**Tensor + sequence parallel** (tp; AReaL's plan, areal/engine/fsdp_utils/parallel.py,
with the packed stream's sequence dimension 0 where AReaL's padded batches have 1):

- ``embed_tokens``: row-wise (vocabulary split), its output reduce-scattered over the
  sequence (``Shard(0)``);
- ``input_layernorm`` / ``post_attention_layernorm`` / the final ``norm``: sequence
  parallel (replicated weights, each tp rank normalises 1/tp of the tokens);
- ``q/k/v_proj`` and ``gate/up_proj``: column-wise (by output: each tp rank has heads / tp
  heads and intermediate / tp channels), on the hidden states all-gathered once per
  block (:meth:`ParallelDecoderLayer.forward`);
- ``o_proj`` / ``down_proj``: row-wise with sequence-sharded outputs (a reduce-scatter
  instead of an all-reduce), back to the sequence-parallel residual stream;
- Qwen3's ``q_norm`` / ``k_norm``: replicated weights on the local heads;
- the LM head: its weight split by vocabulary (``Shard(0)``, tied to the embedding when
  the model ties them); logprobs and entropy are vocabulary-parallel
  (:mod:`tapioca.models.vocab_parallel`): the ``[tokens, vocab]`` logits are never
  gathered.

**Context parallel** (cp): DeepSpeed-Ulysses. Each cp rank holds one contiguous slice
(N / cp tokens) of the packed stream for everything that is per token (embedding, norms,
projections, MLP, LM head); around attention, one all-to-all turns [N/cp tokens, all
local heads] into [N tokens, heads / cp] so attention runs unchanged (the same packed
varlen / sdpa kernel, the same cu_seqlens) on whole sequences, and one more turns it
back. Why Ulysses and not ring attention: it composes with the varlen kernel as it is
(ring attention needs per-step partial attention with log-sum-exp merging over the
packed sequence boundaries, and a zigzag split per sequence to balance causal work);
every rank does the same work by construction (N/cp tokens, heads / cp heads of every
sequence), so packing needs no per-rank balancing; its cost is heads divisible by
tp x cp (key/value heads are repeated when cp exceeds them), where ring attention has
no head limit. Communication: 4 all-to-alls of N/cp x heads x head_dim per layer and
direction.

The weights stay the HF model's parameters (now DTensors): state dicts keep their names,
FSDP2 shards them further over dp x cp (trainers/fsdp_actor.py), and DCP checkpoints
reshard across layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..schemas.errors import ConfigError
from .attention import PackedSeqs, attention
from .forward import decoder_body, head_matmul_dtype
from .packed import PackedCausalLM, PackedDecoderLayer


@dataclass(frozen=True)
class MeshDims:
    """The trainer's device mesh, as the forward needs it: ``mesh`` has dimensions
    ``("dp", "cp", "tp")``."""

    mesh: object  # torch.distributed.device_mesh.DeviceMesh
    tp: int
    cp: int

    @property
    def tp_mesh(self):
        return self.mesh["tp"]

    @property
    def tp_rank(self) -> int:
        return self.mesh.get_local_rank("tp")

    @property
    def cp_rank(self) -> int:
        return self.mesh.get_local_rank("cp")

    @property
    def cp_group(self):
        return self.mesh["cp"].get_group()


# ------------------------------------------------------------------ Ulysses all-to-all

def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """``x`` [cp, ...] -> out [cp, ...]: chunk j goes to rank j, chunk i comes from rank i."""
    import torch.distributed as dist

    x = x.contiguous()
    out = torch.empty_like(x)  # of x made contiguous: empty_like keeps a view's strides
    dist.all_to_all_single(out, x, group=group)
    return out


def _seq_to_heads(x_nXD: torch.Tensor, group, cp: int) -> torch.Tensor:
    """[N/cp, X, D] (this rank's tokens, all X heads) -> [N, X/cp, D] (all tokens, this
    rank's X/cp heads; tokens in rank order, i.e. the packed order)."""
    n, heads, dim = x_nXD.shape
    chunks = x_nXD.view(n, cp, heads // cp, dim).transpose(0, 1)  # [cp (head group), n, X/cp, D]
    return _all_to_all(chunks, group).reshape(cp * n, heads // cp, dim)


def _heads_to_seq(x_NXD: torch.Tensor, group, cp: int) -> torch.Tensor:
    """The inverse of :func:`_seq_to_heads`: [N, X/cp, D] -> [N/cp, X, D]."""
    total, heads, dim = x_NXD.shape
    n = total // cp
    got = _all_to_all(x_NXD.view(cp, n, heads, dim), group)  # [cp (head group), n, X/cp, D]
    return got.transpose(0, 1).reshape(n, cp * heads, dim)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, cp):
        ctx.group, ctx.cp = group, cp
        return _seq_to_heads(x, group, cp)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group, ctx.cp), None, None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, cp):
        ctx.group, ctx.cp = group, cp
        return _heads_to_seq(x, group, cp)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group, ctx.cp), None, None


class _GatherRows(torch.autograd.Function):
    """All-gather over cp of per-rank vectors of host-known ``counts`` (the scored rows of
    each rank's slice), in rank order. The loss downstream is computed identically on
    every cp rank, so each rank's backward takes only its own slice (no sum: that would
    count the loss cp times)."""

    @staticmethod
    def forward(ctx, x_m, group, counts, rank):
        import torch.distributed as dist

        longest = max(counts)
        padded = x_m.new_zeros(longest)
        padded[: x_m.shape[0]] = x_m
        out = [torch.empty_like(padded) for _ in counts]
        dist.all_gather(out, padded, group=group)
        ctx.start = sum(counts[:rank])
        ctx.count = counts[rank]
        return torch.cat([o[:c] for o, c in zip(out, counts)])

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.start: ctx.start + ctx.count], None, None, None


# ------------------------------------------------------------------ the plan


def apply_tensor_parallel(model: nn.Module, dims: MeshDims, device: torch.device) -> None:
    """Split ``model``'s weights over the tp mesh in place (the plan of the module
    docstring). The replicated weights (norms) are moved to ``device`` first: a
    replicated DTensor is made from the local tensor as it is, while the split ones
    move their own shard there."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    body = decoder_body(model)
    head = model.get_output_embeddings()
    tied = head.weight is body.embed_tokens.weight
    for module in body.modules():
        if "Norm" in type(module).__name__:
            module.to(device)
    plan = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0),
                                        use_local_output=False),
        "norm": SequenceParallel(sequence_dim=0),
        "layers.*.input_layernorm": SequenceParallel(sequence_dim=0),
        "layers.*.post_attention_layernorm": SequenceParallel(sequence_dim=0),
        "layers.*.self_attn.q_proj": ColwiseParallel(),
        "layers.*.self_attn.k_proj": ColwiseParallel(),
        "layers.*.self_attn.v_proj": ColwiseParallel(),
        "layers.*.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(0), use_local_output=False),
        "layers.*.mlp.gate_proj": ColwiseParallel(),
        "layers.*.mlp.up_proj": ColwiseParallel(),
        "layers.*.mlp.down_proj": RowwiseParallel(output_layouts=Shard(0), use_local_output=False),
    }
    if hasattr(body.layers[0].self_attn, "q_norm"):
        # Qwen3: RMSNorm over each local head ([N, heads / tp, D], heads on dim 1).
        plan["layers.*.self_attn.q_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
        plan["layers.*.self_attn.k_norm"] = SequenceParallel(sequence_dim=1, use_local_output=True)
    tp_mesh = dims.tp_mesh
    parallelize_module(body, tp_mesh, plan)
    embed = body.embed_tokens
    # padding_idx stays global: DTensor's backward of the row-wise embedding builds the
    # whole-vocabulary gradient (a partial sum; row padding_idx zeroed as in one process)
    # and reduce-scatters it to the vocabulary slices (a transient V x H per tp rank).
    if tied:
        head.weight = embed.weight  # one parameter, split by vocabulary like the embedding
    else:
        head.weight = nn.Parameter(distribute_tensor(head.weight.detach(), tp_mesh, [Shard(0)]))


# ------------------------------------------------------------------ the forward


class ParallelDecoderLayer(PackedDecoderLayer):
    """One decoder layer on this rank's part of the packed stream: ``h`` is [N/cp, H]
    (a DTensor sequence-split over tp when tp > 1), attention sees every token of the
    micro-batch for its heads."""

    def __init__(self, layer: PackedDecoderLayer, dims: MeshDims) -> None:
        super().__init__(layer.layer, layer.ops, layer.attn_backend, layer.attn_dtype, layer.recompute_swiglu)
        self.dims = dims
        self.heads_local = self.n_heads // dims.tp
        self.kv_local = self.n_kv_heads // dims.tp
        # Ulysses needs key/value heads divisible by cp: repeat each (grouped-query
        # attention keeps its query -> key grouping under repeat_interleave).
        self.kv_repeat = dims.cp // self.kv_local if self.kv_local % dims.cp else 1

    def _replicate(self, x):
        """The sequence-split hidden states of this cp slice, whole on every tp rank (one
        all-gather; its backward reduce-scatters the projections' partial gradients)."""
        if self.dims.tp == 1:
            return x
        from torch.distributed.tensor import Replicate

        return x.redistribute(self.dims.tp_mesh, [Replicate()])

    def forward(self, h_nH, cos_nD: torch.Tensor, sin_nD: torch.Tensor, seqs: PackedSeqs):
        layer, ops, dims = self.layer, self.ops, self.dims
        attn = layer.self_attn
        x = self._replicate(ops.rms_norm(h_nH, layer.input_layernorm))
        q = attn.q_proj(x).view(-1, self.heads_local, self.head_dim)
        k = attn.k_proj(x).view(-1, self.kv_local, self.head_dim)
        v = attn.v_proj(x).view(-1, self.kv_local, self.head_dim)
        if self.qk_norm:
            q, k = ops.rms_norm(q, attn.q_norm), ops.rms_norm(k, attn.k_norm)
        q, k = ops.rope(q, k, cos_nD, sin_nD)
        dtype = self.attn_dtype or v.dtype
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
        if dims.cp > 1:
            if self.kv_repeat > 1:
                k = k.repeat_interleave(self.kv_repeat, dim=1)
                v = v.repeat_interleave(self.kv_repeat, dim=1)
            group = dims.cp_group
            q, k, v = (_SeqToHeads.apply(t, group, dims.cp) for t in (q, k, v))
        o = attention(self.attn_backend, q, k, v, seqs, self.scaling)
        if dims.cp > 1:
            o = _HeadsToSeq.apply(o, dims.cp_group, dims.cp)
        attn_out = attn.o_proj(o.reshape(o.shape[0], -1))
        x, h_nH = ops.add_rms_norm(attn_out, h_nH, layer.post_attention_layernorm)
        return h_nH + ops.mlp(self._replicate(x), layer.mlp, self.recompute_swiglu)


class ParallelPackedCausalLM(PackedCausalLM):
    """The packed forward under tensor / context parallelism. ``forward`` returns the
    final hidden states of this rank's cp slice ([N/cp, H], plain tensors, whole over
    tp); :func:`parallel_token_logprobs` scores them."""

    def __init__(self, model: nn.Module, dims: MeshDims, device: torch.device, **kwargs) -> None:
        super().__init__(model, **kwargs)
        self.dims = dims
        if dims.tp > 1:
            apply_tensor_parallel(model, dims, device)
            self.lm_head = model.get_output_embeddings()
        self.layers = nn.ModuleList(ParallelDecoderLayer(layer, dims) for layer in self.layers)

    def describe(self) -> str:
        return f"{super().describe()} tp={self.dims.tp} cp={self.dims.cp}"

    def cp_slice(self, n_tokens: int) -> tuple[int, int]:
        n = n_tokens // self.dims.cp
        return self.dims.cp_rank * n, (self.dims.cp_rank + 1) * n

    def forward(self, input_ids_N: torch.Tensor, position_ids_N: torch.Tensor, seqs: PackedSeqs):
        dims = self.dims
        if input_ids_N.shape[0] % (dims.tp * dims.cp):
            raise ConfigError(f"a packed micro-batch of {input_ids_N.shape[0]} tokens does not split over "
                              f"tp x cp = {dims.tp * dims.cp} ranks: pack it with to_packed(pad_to=...)")
        lo, hi = self.cp_slice(input_ids_N.shape[0])
        h_nH = self.embed_tokens(input_ids_N[lo:hi])
        local = h_nH.to_local() if dims.tp > 1 else h_nH  # dtype and device only
        cos_1nD, sin_1nD = self.rotary_emb(local[None], position_ids_N[lo:hi][None])
        cos_nD, sin_nD = cos_1nD[0], sin_1nD[0]
        every = self.checkpoint_every_n_layers
        for i, layer in enumerate(self.layers):
            if every and i % every == 0 and torch.is_grad_enabled():
                h_nH = checkpoint(layer, h_nH, cos_nD, sin_nD, seqs, use_reentrant=False)
            else:
                h_nH = layer(h_nH, cos_nD, sin_nD, seqs)
        h_nH = self.ops.rms_norm(h_nH, self.norm)
        if dims.tp == 1:
            return h_nH
        from torch.distributed.tensor import Partial, Replicate

        # Whole over tp for the vocabulary-parallel head; each tp rank's gradient of it
        # covers its vocabulary slice only: a partial sum, reduce-scattered back.
        return h_nH.redistribute(dims.tp_mesh, [Replicate()]).to_local(grad_placements=[Partial()])


def parallel_token_logprobs(
    packed: ParallelPackedCausalLM,
    input_ids_N: torch.Tensor,
    position_ids_N: torch.Tensor,
    seqs: PackedSeqs,
    rows_M: torch.Tensor,
    labels_M: torch.Tensor,
    cp_rows: tuple[int, ...],
    *,
    temperature: float,
    chunk_tokens: int,
    compute_entropy: bool = False,
    kernel: str = "auto",
    keep_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`tapioca.models.forward.packed_token_logprobs` under tp / cp: the same
    ``(logprobs_M, entropy_M)`` of all ``M`` scored rows, on every rank. ``cp_rows``:
    host offsets into the M rows of each cp rank's token slice (``cp + 1`` of them,
    :func:`tapioca.trainers.packing.to_packed`), so no rank waits on the device to
    find its rows. Each cp rank scores its own rows; the results are gathered over cp
    (M floats)."""
    from ..algorithms.logprobs import gather_logprobs_entropy
    from .vocab_parallel import vocab_parallel_logprobs_entropy

    dims = packed.dims
    hidden_nH = packed(input_ids_N, position_ids_N, seqs)
    lo, _ = packed.cp_slice(input_ids_N.shape[0])
    r = dims.cp_rank
    m0, m1 = cp_rows[r], cp_rows[r + 1]
    h_mH = hidden_nH.index_select(0, rows_M[m0:m1] - lo)
    labels_m = labels_M[m0:m1]
    weight = packed.lm_head.weight
    if dims.tp > 1:
        w_local = weight.to_local()
        lp, ent = vocab_parallel_logprobs_entropy(
            h_mH, w_local, labels_m, vocab_start=dims.tp_rank * w_local.shape[0], group=dims.tp_mesh.get_group(),
            temperature=temperature, chunk_tokens=chunk_tokens, compute_entropy=compute_entropy,
            matmul_dtype=head_matmul_dtype(w_local))
    else:
        lp, ent = gather_logprobs_entropy(
            h_mH, weight, labels_m, temperature=temperature, chunk_tokens=chunk_tokens,
            compute_entropy=compute_entropy, kernel=kernel, matmul_dtype=head_matmul_dtype(weight),
            keep_logits=keep_logits)
    if dims.cp > 1:
        counts = [cp_rows[i + 1] - cp_rows[i] for i in range(dims.cp)]
        lp = _GatherRows.apply(lp, dims.cp_group, counts, r)
        ent = _GatherRows.apply(ent, dims.cp_group, counts, r) if ent is not None else None
    return lp, ent
