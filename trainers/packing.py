"""Packed micro-batches: a step's sequences concatenated without padding.

Consumes :class:`~tapioca.trainers.batching.SeqItem` lists; emits :class:`PackedBatch`:
the token stream the packed forward reads (``input_ids_N``, ``position_ids_N``
restarting at 0 per sequence, the sequence offsets) plus the per-token tensors the
loss reads, in the same right-padded ``[B, T-1]`` layout as
:func:`~tapioca.trainers.batching.to_tensors` builds (the tests hold both to the same
tensors). The LM head runs only on the ``M``
rows that predict an output token; :meth:`PackedBatch.to_padded` puts its ``[M]``
results into the ``[B, T-1]`` layout (differentiably), so the policy losses, their
sequence-level modes and the M2PO masks are unchanged.

Micro-batches are :func:`~tapioca.trainers.batching.pack` with ``padded=False``: the
budget ``mb_max_tokens`` counts real tokens only.

Routing replay (R3): with ``moe_shape`` given, the items' recorded routes become
``replay_topk_LNK`` ``[MoE layers, N, k]`` in packed token order, -1 (route live) on the
tokens without one: each sequence's last token (never fed to the engine; its hidden
state scores nothing) and every token of a sequence that came without routes.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from ..algorithms.errors import AlgorithmInputError
from ..models.attention import PackedSeqs, packed_seqs, position_ids
from .batching import SeqItem, TensorBatch, pack


@dataclass
class PackedBatch(TensorBatch):
    """A :class:`TensorBatch` (per-token ``[B, T-1]`` tensors; ``input_ids_BT`` and
    ``attention_mask_BT`` are left empty) plus the packed token stream."""

    input_ids_N: torch.Tensor | None = None  # [N] all sequences back to back
    position_ids_N: torch.Tensor | None = None  # [N] 0..L_i-1 per sequence
    seqs: PackedSeqs | None = None
    # The hidden state at packed position rows_M[m] predicts labels_M[m], which sits at
    # flat index padded_index_M[m] of the [B, T-1] tensors.
    rows_M: torch.Tensor | None = None
    labels_M: torch.Tensor | None = None
    padded_index_M: torch.Tensor | None = None
    # Routing replay: the experts of each packed token per MoE layer ([L, N, k] int64,
    # -1: route live); None: the router routes every token (see the module docstring).
    replay_topk_LNK: torch.Tensor | None = None
    # Context parallel (to_packed's cp > 1): the scored rows of cp rank r's token slice
    # are rows_M[cp_rows[r]:cp_rows[r + 1]] (host offsets; empty without cp).
    cp_rows: tuple[int, ...] = ()

    def to_padded(self, values_M: torch.Tensor) -> torch.Tensor:
        """``[M]`` per-row values -> ``[B, T-1]`` (0 where nothing is scored)."""
        shape = self.labels_BT.shape
        flat = values_M.new_zeros(shape.numel()).index_copy(0, self.padded_index_M, values_M)
        return flat.view(shape)


def to_packed(items: list[SeqItem], device: torch.device | str,
              moe_shape: tuple[int, int] | None = None, *, pad_to: int = 1,
              cp: int = 1) -> PackedBatch:
    """Pack ``items`` (in order) into one :class:`PackedBatch` on ``device``; with
    ``moe_shape`` ``(MoE layers, top_k)``, their routes for replay (module docstring).

    Host work is one list concatenation and one tensor per field for the whole
    micro-batch (no per-item tensors: this runs before the GPU has work, every step),
    then vector ops and one copy per tensor. The ``[B, T-1]`` tensors hold exactly what
    :func:`~tapioca.trainers.batching.to_tensors` puts there (tested).

    Tensor / context parallel (models/parallel.py): ``pad_to`` (tp x cp) pads the token
    stream to a multiple of it with one sequence of pad tokens of its own (attending to
    nothing else, scored nowhere), so every cp rank gets the same number of tokens and
    every tp rank the same share of those: the split is balanced by construction.
    ``cp`` > 1 also records which scored rows fall in each rank's slice (``cp_rows``)."""
    if not items:
        raise AlgorithmInputError("to_packed: no sequences to pack")
    lengths, prompts, outs = [], [], []
    ids: list[int] = []
    behav: list[float] = []
    versions: list[int] = []
    mask: list[int] = []
    adv: list[float] = []
    for it in items:
        n = it.length - it.prompt_len
        if it.prompt_len < 1 or n < 1 or not (len(it.behav_logprobs) == len(it.versions)
                                                == len(it.loss_mask) == n):
            raise AlgorithmInputError(
                f"to_packed: item of group {it.group_id} has prompt_len {it.prompt_len}, {n} output "
                f"tokens, {len(it.behav_logprobs)} logprobs, {len(it.versions)} versions, "
                f"{len(it.loss_mask)} mask entries; need prompt_len >= 1 and one of each per output token")
        lengths.append(it.length)
        prompts.append(it.prompt_len)
        outs.append(n)
        ids.extend(it.input_ids)
        behav.extend(it.behav_logprobs)
        versions.extend(it.versions)
        mask.extend(it.loss_mask)
        adv.extend(it.token_advantages if it.token_advantages is not None else [it.advantage] * n)
    B, T1 = len(items), max(lengths) - 1
    lengths_B = torch.tensor(lengths)
    outs_B = torch.tensor(outs)
    offsets_B = torch.cumsum(lengths_B, 0) - lengths_B
    out_start_B = torch.cumsum(outs_B, 0) - outs_B
    b_M = torch.repeat_interleave(torch.arange(B), outs_B)
    # Output token j of sequence b sits at position P_b + j, predicted from P_b - 1 + j.
    t_M = torch.tensor(prompts)[b_M] - 1 + (torch.arange(b_M.numel()) - out_start_B[b_M])
    rows_M = offsets_B[b_M] + t_M
    ids_N = _tensor("q", ids)
    labels_M = ids_N[rows_M + 1]
    padded_index_M = b_M * T1 + t_M
    n_pad = -len(ids) % pad_to
    stream_lengths = lengths + [n_pad] if n_pad else lengths
    if n_pad:
        ids_N = torch.cat([ids_N, torch.zeros(n_pad, dtype=ids_N.dtype)])
    cp_rows: tuple[int, ...] = ()
    if cp > 1:
        bounds = torch.arange(cp + 1) * (ids_N.numel() // cp)
        cp_rows = tuple(int(i) for i in torch.searchsorted(rows_M, bounds))  # host tensors: no sync

    def padded(values_M: torch.Tensor, fill) -> torch.Tensor:
        out = torch.full((B * T1,), fill, dtype=values_M.dtype)
        out[padded_index_M] = values_M
        return out.view(B, T1).to(device)

    extra = {}
    if all(it.token_values is not None and it.token_returns is not None for it in items):
        extra["old_values_BT"] = padded(_tensor("f", [v for it in items for v in it.token_values]), 0.0)
        extra["returns_BT"] = padded(_tensor("f", [v for it in items for v in it.token_returns]), 0.0)
    if moe_shape is not None and any(it.routes for it in items):
        extra["replay_topk_LNK"] = replay_routes(items, moe_shape).to(device)
    empty = torch.empty(0, dtype=torch.long, device=device)
    return PackedBatch(
        input_ids_BT=empty, attention_mask_BT=empty,
        labels_BT=padded(labels_M, -100),
        mask_BT=padded(_tensor("b", mask) != 0, False),
        behav_logprobs_BT=padded(_tensor("f", behav), 0.0),
        advantages_BT=padded(_tensor("f", adv), 0.0),
        versions_BT=padded(_tensor("q", versions), -1),
        **extra,
        input_ids_N=ids_N.to(device),
        position_ids_N=position_ids(stream_lengths).to(device),
        seqs=packed_seqs(stream_lengths, device),
        rows_M=rows_M.to(device),
        labels_M=labels_M.to(device),
        padded_index_M=padded_index_M.to(device),
        group_ids=tuple(it.group_id for it in items),
        cp_rows=cp_rows,
    )


def replay_routes(items: list[SeqItem], moe_shape: tuple[int, int]) -> torch.Tensor:
    """int64 ``[MoE layers, N, k]`` of ``items`` packed in order (-1: route live). One
    array per sequence, not per token."""
    import base64

    import numpy as np

    n_layers, k = moe_shape
    parts = []
    for it in items:
        part = np.full((it.length, n_layers, k), -1, dtype=np.int64)
        if it.routes:
            ids = np.frombuffer(base64.b64decode(it.routes), dtype=np.dtype(it.routes_dtype).newbyteorder("<"))
            part[:-1] = ids.reshape(it.length - 1, n_layers, k)
        parts.append(part)
    return torch.from_numpy(np.concatenate(parts)).permute(1, 0, 2).contiguous()


_DTYPES = {"q": torch.int64, "f": torch.float32, "b": torch.int8}


def _tensor(typecode: str, values: list) -> torch.Tensor:
    """A CPU tensor from a Python list through ``array`` (~10x faster than
    ``torch.tensor(list)``, which inspects every element)."""
    buf = array(typecode, values)
    if not buf:
        return torch.empty(0, dtype=_DTYPES[typecode])
    return torch.frombuffer(buf, dtype=_DTYPES[typecode])


def packed_micro_batches(items: list[SeqItem], max_tokens: int) -> list[list[SeqItem]]:
    """Micro-batches of at most ``max_tokens`` real tokens (an item longer than that
    gets one of its own)."""
    return [[items[i] for i in idx]
            for idx in pack([it.length for it in items], max_tokens, padded=False)]
