"""The images of a training micro-batch, recomputed from the bytes (docs/vlm.md).

Consumes :class:`~tapioca.trainers.batching.SeqItem` lists whose ``images`` are
:class:`~tapioca.schemas.events.ImageRef` (copied from the sample event) and an
:class:`~tapioca.models.vision.ImageLoader` (the run's image store and the model's
processor); emits the vision inputs of a packed micro-batch
(:class:`~tapioca.models.packed.PackedImages`) or of a right-padded one
(:class:`PaddedImages`): the processor's ``pixel_values`` / ``image_grid_thw`` of every
image in sequence order, which tokens are placeholders, and the 3-D rotary positions.

Placeholders are the ``<|image_pad|>`` tokens the model did not generate: the prompt's,
and an output's where its loss mask is 0 (models/vision.py ``placeholder_mask``), the
rule the engines follow, so the trainer sees the sequence the rollout saw.
:func:`check_images` runs at a sample's arrival: a sample whose images cannot be used
(a blob missing from the store, corrupt, placeholders that do not match) is
dead-lettered there, never in the middle of a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..media.images import ImageError
from ..media.store import ImageStoreError
from ..models.packed import PackedImages
from ..models.vision import ImageLoader, VisionSpec, mrope_positions, placeholder_mask
from ..schemas.errors import BadEventError
from ..schemas.events import SampleEvent
from .batching import SeqItem


@dataclass
class PaddedImages:
    """A right-padded micro-batch's images (models/forward.py ``last_hidden``)."""

    pixel_values: torch.Tensor
    grid_thw: torch.Tensor
    mask_BT: torch.Tensor  # bool: placeholder tokens
    positions_3BT: torch.Tensor  # int64 (0 on padding)


def _item_positions(item: SeqItem, spec: VisionSpec, grids) -> tuple[np.ndarray, np.ndarray]:
    generated = [0] * item.prompt_len + [int(m != 0) for m in item.loss_mask]
    mask = placeholder_mask(item.input_ids, spec, generated)
    pos, _ = mrope_positions(item.input_ids, mask, grids, spec)
    return mask, pos


def _pixels(items: list[SeqItem], loader: ImageLoader):
    pixels, grids_per = [], []
    for it in items:
        pv, grids = loader.pixels(it.images)
        if grids:
            pixels.append(pv)
        grids_per.append(grids)
    return pixels, grids_per


def packed_images(items: list[SeqItem], loader: ImageLoader, spec: VisionSpec,
                  device: torch.device | str) -> PackedImages | None:
    """The :class:`PackedImages` of ``items`` packed in order (None: no item has images).
    Text items get 1-D positions on all three axes."""
    pixels, grids_per = _pixels(items, loader)
    if not pixels:
        return None
    index, positions, offset = [], [], 0
    for it, grids in zip(items, grids_per):
        mask, pos = _item_positions(it, spec, grids)
        index.append(np.flatnonzero(mask) + offset)
        positions.append(pos)
        offset += it.length
    grid = [g for grids in grids_per for g in grids]
    return PackedImages(
        pixel_values=torch.cat(pixels).to(device),
        grid_thw=torch.tensor(grid, dtype=torch.long, device=device),
        index_I=torch.from_numpy(np.concatenate(index)).to(device),
        positions_3N=torch.from_numpy(np.concatenate(positions, axis=1)).to(device))


def padded_images(items: list[SeqItem], loader: ImageLoader, spec: VisionSpec,
                  device: torch.device | str) -> PaddedImages | None:
    """The :class:`PaddedImages` of ``items`` right-padded to the longest (None: no images)."""
    pixels, grids_per = _pixels(items, loader)
    if not pixels:
        return None
    T = max(it.length for it in items)
    mask_BT = np.zeros((len(items), T), dtype=bool)
    pos_3BT = np.zeros((3, len(items), T), dtype=np.int64)
    for b, (it, grids) in enumerate(zip(items, grids_per)):
        mask, pos = _item_positions(it, spec, grids)
        mask_BT[b, :it.length] = mask
        pos_3BT[:, b, :it.length] = pos
    grid = [g for grids in grids_per for g in grids]
    return PaddedImages(pixel_values=torch.cat(pixels).to(device),
                        grid_thw=torch.tensor(grid, dtype=torch.long, device=device),
                        mask_BT=torch.from_numpy(mask_BT).to(device),
                        positions_3BT=torch.from_numpy(pos_3BT).to(device))


def check_images(event: SampleEvent, loader: ImageLoader | None, spec: VisionSpec | None) -> None:
    """Raise BadEventError for a sample whose images this trainer cannot use (see the
    module docstring); the processor's tensors it computes stay in the loader's cache
    for the step."""
    from .batching import flatten_groups

    if not any(s.images for s in event.sequences):
        if spec is None:
            return
    elif loader is None or spec is None:
        raise BadEventError(f"group {event.group_id} has images but the policy has no vision tower; "
                            "train a vision-language model on it (docs/vlm.md)")
    try:
        for item in flatten_groups([event]):
            _, grids = loader.pixels(item.images)
            _item_positions(item, spec, grids)  # raises when placeholders and images disagree
    except (ImageError, ImageStoreError) as exc:
        raise BadEventError(f"group {event.group_id}: {exc}") from None
