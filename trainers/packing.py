"""Packed micro-batches: a step's sequences concatenated without padding.

Consumes :class:`~tapioca.trainers.batching.SeqItem` lists; emits :class:`PackedBatch`:
the token stream the packed forward reads (``input_ids_N``, ``position_ids_N``
restarting at 0 per sequence, the sequence offsets) plus the per-token tensors the
loss reads, in the same right-padded ``[B, T-1]`` layout as
:func:`~tapioca.trainers.batching.to_tensors` builds (they are built BY it, so both paths
agree on which positions are scored and trained). The LM head runs only on the ``M``
rows that predict an output token; :meth:`PackedBatch.to_padded` puts its ``[M]``
results into the ``[B, T-1]`` layout (differentiably), so the policy losses, their
sequence-level modes and the M2PO masks are unchanged.

Micro-batches are :func:`~tapioca.trainers.batching.pack` with ``padded=False``: the
budget ``mb_max_tokens`` counts real tokens only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from tapioca.models.attention import PackedSeqs, packed_seqs, position_ids
from tapioca.trainers.batching import SeqItem, TensorBatch, pack, to_tensors


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

    def to_padded(self, values_M: torch.Tensor) -> torch.Tensor:
        """``[M]`` per-row values -> ``[B, T-1]`` (0 where nothing is scored)."""
        shape = self.labels_BT.shape
        flat = values_M.new_zeros(shape.numel()).index_copy(0, self.padded_index_M, values_M)
        return flat.view(shape)


def to_packed(items: list[SeqItem], device: torch.device | str) -> PackedBatch:
    """Pack ``items`` (in order) into one :class:`PackedBatch` on ``device``. Host work
    only, then one copy per tensor."""
    per_token = to_tensors(items, 0, "cpu")
    lengths = [it.length for it in items]
    offsets = torch.zeros(len(items), dtype=torch.long)
    offsets[1:] = torch.cumsum(torch.tensor(lengths[:-1], dtype=torch.long), 0)
    # Scored positions (b, t): position t of sequence b predicts its token t+1.
    scored = per_token.labels_BT != -100
    b_M, t_M = scored.nonzero(as_tuple=True)
    rows_M = offsets[b_M] + t_M
    labels_M = per_token.labels_BT[b_M, t_M]
    padded_index_M = b_M * per_token.labels_BT.shape[1] + t_M
    ids_N = torch.tensor([tok for it in items for tok in it.input_ids], dtype=torch.long)
    moved = {f.name: (getattr(per_token, f.name).to(device)
                      if f.name not in ("input_ids_BT", "attention_mask_BT") and getattr(per_token, f.name) is not None
                      else None)
             for f in dataclasses.fields(TensorBatch)}
    moved["input_ids_BT"] = moved["attention_mask_BT"] = torch.empty(0, dtype=torch.long, device=device)
    return PackedBatch(
        **moved,
        input_ids_N=ids_N.to(device),
        position_ids_N=position_ids(lengths).to(device),
        seqs=packed_seqs(lengths, device),
        rows_M=rows_M.to(device),
        labels_M=labels_M.to(device),
        padded_index_M=padded_index_M.to(device),
    )


def packed_micro_batches(items: list[SeqItem], max_tokens: int) -> list[list[SeqItem]]:
    """Micro-batches of at most ``max_tokens`` real tokens (an item longer than that
    gets one of its own)."""
    return [[items[i] for i in idx]
            for idx in pack([it.length for it in items], max_tokens, padded=False)]
