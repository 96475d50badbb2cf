"""From sample events to padded tensors and token-balanced micro-batches.

A sequence is ``prompt_ids + output_ids``; position t predicts token t+1, so the
per-token tensors here are over ``T-1`` positions of the right-padded batch, with
``labels_BT[b, t] = input_ids[b, t+1]`` and ``mask_BT`` set only where t+1 is an
output token the loss trains on (loss mask 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..schemas.events import SampleEvent


@dataclass
class SeqItem:
    group_id: str
    input_ids: list[int]
    prompt_len: int
    behav_logprobs: list[float]
    versions: list[int]
    loss_mask: list[int]
    advantage: float
    reward: float
    # Per-output-token advantages (GAE, KL-in-reward, batch normalisation): when set
    # they replace the scalar ``advantage`` for every token.
    token_advantages: list[float] | None = None
    # Output-token offsets where turns start (turn-level GAE); empty: loss-mask runs.
    turn_boundaries: list[int] = field(default_factory=list)
    # Critic targets per output token, set with the advantages when a critic trains:
    # the value before the update and the GAE return.
    token_values: list[float] | None = None
    token_returns: list[float] | None = None
    # The sequence's images (ImageRef, placeholder order): trainers/vision_batch.py.
    images: list = field(default_factory=list)
    # The rollout's routed experts (routing replay R3): base64 of the token-major ids
    # [length - 1, MoE layers, top_k] in ``routes_dtype`` (the wire form of
    # schemas/routes.py, checked by the trainer); "" when the sequence has none.
    routes: str = ""
    routes_dtype: str = "uint8"

    @property
    def length(self) -> int:
        return len(self.input_ids)


def flatten_groups(samples: list[SampleEvent]) -> list[SeqItem]:
    items = []
    for s in samples:
        for seq in s.sequences:
            prompt = list(s.prompt_ids)
            out, lps, vers = list(seq.output_ids), list(seq.behav_logprobs), list(seq.output_versions)
            mask = list(seq.loss_mask) if seq.loss_mask else [1] * len(out)
            bounds = list(seq.turn_boundaries)
            if not prompt:
                # No shared prompt (an agent group whose sessions share no first token):
                # nothing predicts a sequence's first token, so it becomes its prompt and
                # position 0 predicts token 1 as usual.
                prompt, out, lps, vers, mask = out[:1], out[1:], lps[1:], vers[1:], mask[1:]
                bounds = sorted({max(b - 1, 0) for b in bounds})
            if not out:
                continue
            # Routes cover prompt + output tokens however the two are split above.
            routes = seq.routed_experts
            items.append(SeqItem(
                group_id=s.group_id,
                input_ids=prompt + out,
                prompt_len=len(prompt),
                behav_logprobs=lps,
                versions=vers,
                loss_mask=mask,
                advantage=seq.advantage,
                # The reward the estimator works on: after advantage.reward_norm if set.
                reward=seq.reward if seq.norm_reward is None else seq.norm_reward,
                turn_boundaries=bounds,
                images=list(seq.images),
                routes=routes.data_b64 if routes is not None else "",
                routes_dtype=routes.dtype if routes is not None else "uint8",
            ))
    return items


def pack(lengths: Sequence[int], max_tokens: int, *, padded: bool = True) -> list[list[int]]:
    """Indices packed greedily by padded size (count x longest) <= max_tokens, longest
    first; an item longer than the budget gets a micro-batch of its own. Shared by the
    RL trainer (:func:`micro_batches`) and the supervised trainers. ``padded=False``
    budgets the sum of lengths instead (packed micro-batches, no padding:
    :mod:`tapioca.trainers.packing`)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i], reverse=True)
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = lengths[current[0]] if current else lengths[i]
        size = (len(current) + 1) * longest if padded else sum(lengths[j] for j in current) + lengths[i]
        if current and size > max_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def micro_batches(items: list[SeqItem], max_tokens: int) -> list[list[SeqItem]]:
    """:func:`pack` over the items' lengths."""
    return [[items[i] for i in idx] for idx in pack([it.length for it in items], max_tokens)]


@dataclass
class TensorBatch:
    input_ids_BT: torch.Tensor  # [B, T] right padded
    attention_mask_BT: torch.Tensor
    labels_BT: torch.Tensor  # [B, T-1], -100 where not an output token
    mask_BT: torch.Tensor  # [B, T-1] bool, trained tokens
    behav_logprobs_BT: torch.Tensor  # [B, T-1]
    advantages_BT: torch.Tensor  # [B, T-1]
    versions_BT: torch.Tensor  # [B, T-1], -1 where not an output token
    # Only when every item carries them (a critic step): value before the update, return.
    old_values_BT: torch.Tensor | None = None  # [B, T-1]
    returns_BT: torch.Tensor | None = None  # [B, T-1]
    # The group of each row (a step whose loss is not finite names the groups it skips).
    group_ids: tuple[str, ...] = ()
    # A VL model's vision inputs (trainers/vision_batch.py): PackedImages / PaddedImages.
    images: Any = None

    @property
    def n_tokens(self) -> int:
        return int(self.mask_BT.sum())


def to_tensors(items: list[SeqItem], pad_token_id: int, device: torch.device | str) -> TensorBatch:
    B = len(items)
    T = max(it.length for it in items)
    input_ids = torch.full((B, T), pad_token_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    labels = torch.full((B, T - 1), -100, dtype=torch.long)
    mask = torch.zeros((B, T - 1), dtype=torch.bool)
    behav = torch.zeros((B, T - 1), dtype=torch.float32)
    adv = torch.zeros((B, T - 1), dtype=torch.float32)
    versions = torch.full((B, T - 1), -1, dtype=torch.long)
    for b, it in enumerate(items):
        L, P = it.length, it.prompt_len
        n = L - P
        input_ids[b, :L] = torch.tensor(it.input_ids)
        attn[b, :L] = 1
        # Output token j sits at position P+j and is predicted from position P+j-1.
        sl = slice(P - 1, P - 1 + n)
        labels[b, sl] = torch.tensor(it.input_ids[P:])
        mask[b, sl] = torch.tensor(it.loss_mask, dtype=torch.bool)
        behav[b, sl] = torch.tensor(it.behav_logprobs, dtype=torch.float32)
        if it.token_advantages is not None:
            adv[b, sl] = torch.tensor(it.token_advantages, dtype=torch.float32)
        else:
            adv[b, sl] = it.advantage
        versions[b, sl] = torch.tensor(it.versions)
    batch = TensorBatch(*(t.to(device) for t in (input_ids, attn, labels, mask, behav, adv, versions)),
                        group_ids=tuple(it.group_id for it in items))
    if all(it.token_values is not None and it.token_returns is not None for it in items):
        old_values = torch.zeros((B, T - 1), dtype=torch.float32)
        returns = torch.zeros((B, T - 1), dtype=torch.float32)
        for b, it in enumerate(items):
            sl = slice(it.prompt_len - 1, it.length - 1)
            old_values[b, sl] = torch.tensor(it.token_values, dtype=torch.float32)
            returns[b, sl] = torch.tensor(it.token_returns, dtype=torch.float32)
        batch.old_values_BT, batch.returns_BT = old_values.to(device), returns.to(device)
    return batch


def output_slice(item: SeqItem) -> slice:
    """Where an item's output tokens sit in the ``[B, T-1]`` per-token tensors."""
    return slice(item.prompt_len - 1, item.length - 1)
