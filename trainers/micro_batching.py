"""How an actor cuts a step's sequences into micro-batches: one builder, chosen once.

Consumes a step's :class:`~tapioca.trainers.batching.SeqItem` list; emits its
micro-batches of at most ``actor.mb_max_tokens`` tokens, whole sequences each, as the
forward the actor runs takes them. :func:`micro_batch_builder` picks the builder from the
config and the actor's modules when the actor is built (trainers/ppo_actor.py), so a
step never asks which features are on:

- :class:`PaddedMicroBatches`: right-padded (count x longest; ``packed_sequences``
  false, or a family the packed forward does not run), for the HF forward;
- :class:`PackedMicroBatches`: sequences concatenated without padding (real tokens), for
  the packed forward; with ``moe.router_replay`` R3 each carries its items' routes;
- :class:`TreeMicroBatches`: prefix trees (``enable_tree_training``, packed forward
  only), each shared prefix counted once (the config refuses R3 with trees);
- :class:`WithImages`: a vision-language policy's packed or padded micro-batches with
  their images recomputed from the bytes (trainers/vision_batch.py; refused with trees).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config.schema import ActorConfig
from .batching import SeqItem, TensorBatch, micro_batches, to_tensors
from .packing import packed_micro_batches, to_packed
from .prefix_packing import to_tree_packed, tree_micro_batches


@dataclass(frozen=True)
class PaddedMicroBatches:
    max_tokens: int
    pad_token_id: int
    device: torch.device

    def groups(self, items: list[SeqItem]) -> list[list[SeqItem]]:
        return micro_batches(items, self.max_tokens)

    def build(self, group: list[SeqItem]) -> TensorBatch:
        return to_tensors(group, self.pad_token_id, self.device)

    def __call__(self, items: list[SeqItem]) -> list[TensorBatch]:
        return [self.build(g) for g in self.groups(items)]


@dataclass(frozen=True)
class PackedMicroBatches(PaddedMicroBatches):
    # R3: (layers, top-k) of the routes each micro-batch replays; None: no replay.
    moe: tuple[int, int] | None = None

    def groups(self, items: list[SeqItem]) -> list[list[SeqItem]]:
        return packed_micro_batches(items, self.max_tokens)

    def build(self, group: list[SeqItem]) -> TensorBatch:
        return to_packed(group, self.device, self.moe)


@dataclass(frozen=True)
class TreeMicroBatches(PaddedMicroBatches):
    def groups(self, items: list[SeqItem]) -> list[list[SeqItem]]:
        return tree_micro_batches(items, self.max_tokens)

    def build(self, group: list[SeqItem]) -> TensorBatch:
        return to_tree_packed(group, self.device)


@dataclass(frozen=True)
class WithImages:
    """Another builder's micro-batches with their images (``images``: the policy's
    ``ImageLoader``, ``vision``: its ``VisionSpec``; models/vision.py)."""

    inner: PaddedMicroBatches
    images: object
    vision: object

    def __call__(self, items: list[SeqItem]) -> list[TensorBatch]:
        from .vision_batch import packed_images, padded_images

        attach = padded_images if type(self.inner) is PaddedMicroBatches else packed_images
        groups = self.inner.groups(items)
        out = [self.inner.build(g) for g in groups]
        for batch, group in zip(out, groups):
            batch.images = attach(group, self.images, self.vision, self.inner.device)
        return out


def micro_batch_builder(cfg: ActorConfig, *, packed, pad_token_id: int, device: torch.device,
                        images=None, vision=None):
    """The builder for ``cfg`` (``mb_max_tokens``, ``enable_tree_training``,
    ``moe.router_replay``) and the actor's modules: ``packed``, its packed forward (None: the
    padded HF forward); ``images`` / ``vision``: a vision-language policy's image loader
    and spec (None: a text policy)."""
    common = dict(max_tokens=cfg.mb_max_tokens, pad_token_id=pad_token_id, device=device)
    if packed is not None and cfg.enable_tree_training:
        return TreeMicroBatches(**common)
    if packed is not None:
        shape = packed.moe_shape if cfg.moe.router_replay == "R3" else None
        build = PackedMicroBatches(**common, moe=shape[:2] if shape is not None else None)
    else:
        build = PaddedMicroBatches(**common)
    return WithImages(build, images, vision) if images is not None else build
