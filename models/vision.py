"""Vision-language models (Qwen2.5-VL, Qwen3-VL): placeholders, pixels, 3-D rotary positions.

Consumes a ``transformers`` VL model (its config and vision tower) and encoded image
bytes; emits what the engines and the trainer feed it: the processor's ``pixel_values``
/ ``image_grid_thw`` (recomputed from the bytes wherever needed, deterministically: the
slow PIL/numpy image processor, never torchvision, which does not import beside the CPU
torch build), the prompt's image placeholders expanded to one token per merged patch,
the multimodal rotary ("M-RoPE") positions of a token sequence, the vision tower's
embeddings (and Qwen3-VL's deepstack features) and the rotary cos / sin of 3-D positions.

Placeholders. A prompt holds ``<|vision_start|><|image_pad|><|vision_end|>`` per image;
:func:`expand_image_tokens` repeats each ``<|image_pad|>`` ``t*h*w / merge**2`` times
for its image's grid, so the token ids on the log are those the decoder sees. Which
``<|image_pad|>`` tokens are placeholders: every one the model did not generate
(:func:`placeholder_mask`: all of a prompt's, and an output's where its loss mask is 0);
one the model sampled is an ordinary token, embedded as such by the engines and the
trainer alike. The placeholders must come in one run of the right length per image, in
order (:class:`~tapioca.media.images.ImageError` otherwise).

Positions (the rule of ``get_rope_index`` in transformers 5.x, reimplemented so that the
engines, the packed trainer and every transformers version agree; tests hold it to
transformers' own): text tokens count up on all three axes; an image with merged grid
``(t, h, w)`` starting at position ``p`` gets ``(p + i, p + j, p + k)`` for its tokens in
row-major order, and the text after it continues at ``p + max(t, h, w)``. Decoding after
a prompt of ``L`` tokens uses position ``L + delta`` on all three axes, ``delta = max
position + 1 - L`` (:func:`mrope_positions`).

Rotary: each axis rotates its own section of the head's frequencies (``mrope_section``;
Qwen3-VL interleaves them). The model's own ``rotary_emb`` computes cos / sin from the
``[3, N]`` positions; where it returns the three axes unmerged (older transformers),
:func:`mrope_cos_sin` merges them by ``mrope_section``. For text positions the three axes
are equal and the result is plain 1-D RoPE, so a decode step needs no 3-D table.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from ..media.images import ImageError, ImageRule, PixelBudget, decoded_images
from .families import VisionSpec, read_config_json, vision_of

IMAGE_PAD = "<|image_pad|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
PREPROCESSOR_FILE = "preprocessor_config.json"


def vision_spec(config: Any) -> VisionSpec | None:
    """The :class:`VisionSpec` of a live model's config (``model.config``); None for a
    text-only model (or no config). The one such test on a live model: a role reads its
    run's ``PolicySpec.vision`` (config/policy.py), resolved from the model directory."""
    return None if config is None else vision_of(config.to_dict())


# ---------------------------------------------------------------------- placeholders


def expand_image_tokens(ids: Sequence[int], grids: Sequence[Sequence[int]], spec: VisionSpec) -> list[int]:
    """``ids`` with each ``<|image_pad|>`` repeated for its image (one per image, in order)."""
    pads = [i for i, t in enumerate(ids) if t == spec.image_token_id]
    if len(pads) != len(grids):
        raise ImageError(f"the prompt has {len(pads)} image placeholder(s) but {len(grids)} image(s) "
                         "were given; put one image part (or <image>) per image")
    out: list[int] = []
    start = 0
    for pos, grid in zip(pads, grids):
        out += list(ids[start:pos]) + [spec.image_token_id] * spec.tokens_for(grid)
        start = pos + 1
    return out + list(ids[start:])


def placeholder_mask(ids: Sequence[int], spec: VisionSpec, generated: Sequence[int] | None = None) -> np.ndarray:
    """``bool [L]``: the ``<|image_pad|>`` tokens that stand for image patches: all but
    the ones the model generated (``generated[t]`` true, e.g. loss mask 1)."""
    mask = np.asarray(ids, dtype=np.int64) == spec.image_token_id
    if generated is not None:
        gen = np.zeros(len(ids), dtype=bool)
        g = np.asarray(generated, dtype=bool)
        gen[len(ids) - len(g):] = g  # aligned to the end (an output's mask after its prompt)
        mask &= ~gen
    return mask


def image_runs(mask: np.ndarray, grids: Sequence[Sequence[int]], spec: VisionSpec) -> list[int]:
    """The start of each image's placeholder run; :class:`ImageError` unless the
    placeholders are one run of ``tokens_for(grid)`` per image, in order."""
    want = [spec.tokens_for(g) for g in grids]
    have = int(mask.sum())
    if have != sum(want):
        raise ImageError(f"the tokens hold {have} image placeholder token(s) but the {len(grids)} image(s) "
                         f"need {sum(want)} ({' + '.join(map(str, want)) or '0'}); the prompt's "
                         "placeholders must be expanded for exactly these images, in order")
    starts: list[int] = []
    positions = np.flatnonzero(mask)
    k = 0
    for need in want:
        i = int(positions[k])
        if not mask[i:i + need].all():
            raise ImageError("an image's placeholder tokens are not one contiguous run of "
                             f"{need}; expand each <|image_pad|> for its own image")
        starts.append(i)
        k += need
    return starts


def mrope_positions(ids: Sequence[int], mask: np.ndarray, grids: Sequence[Sequence[int]],
                    spec: VisionSpec) -> tuple[np.ndarray, int]:
    """``(positions_3L int64, delta)``: the 3-D rotary positions of ``ids`` whose image
    placeholders are ``mask`` (see the module docstring), and the decode offset."""
    n = len(ids)
    pos = np.empty((3, n), dtype=np.int64)
    starts = image_runs(mask, grids, spec)
    cur, i = 0, 0
    m = spec.merge_size
    for start, grid in zip(starts, grids):
        text = start - i
        pos[:, i:start] = cur + np.arange(text)
        cur += text
        t, h, w = int(grid[0]), int(grid[1]) // m, int(grid[2]) // m
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        end = start + t * h * w
        pos[0, start:end] = cur + tt.reshape(-1)
        pos[1, start:end] = cur + hh.reshape(-1)
        pos[2, start:end] = cur + ww.reshape(-1)
        cur += max(t, h, w)
        i = end
    pos[:, i:] = cur + np.arange(n - i)
    delta = int(pos.max()) + 1 - n if n else 0
    return pos, delta


# ---------------------------------------------------------------------- the processor


def _pil_processor_class():
    """transformers' PIL/numpy Qwen2-VL image processor (``Qwen2VLImageProcessorPil`` in
    transformers 5; ``Qwen2VLImageProcessor`` was that one in 4.x)."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return Qwen2VLImageProcessorPil
    except ImportError:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

        return Qwen2VLImageProcessor


class ImageProcessor:
    """Encoded image bytes -> ``(pixel_values [P, C*T*p*p] fp32, image_grid_thw [n, 3])``.

    The slow processor of transformers (PIL resize, numpy rescale / normalise /
    patchify): the same bytes give the same tensors on every machine, so the engines and
    the trainer may each compute them from the store instead of carrying pixels on the log.
    """

    def __init__(self, **settings: Any) -> None:
        self.settings = dict(settings)
        self._proc = _pil_processor_class()(**settings)

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "ImageProcessor":
        """From a model directory's ``preprocessor_config.json`` (its resize bounds, patch
        and merge sizes, mean and std)."""
        file = Path(path) / PREPROCESSOR_FILE
        if not file.is_file():
            raise ImageError(f"{path} has no {PREPROCESSOR_FILE}: a vision-language model directory "
                             "needs its image processor's settings (`tapioca model-init` writes them)")
        raw = json.loads(file.read_text())
        keep = ("min_pixels", "max_pixels", "patch_size", "merge_size", "temporal_patch_size",
                "image_mean", "image_std", "do_resize", "do_rescale", "do_normalize", "rescale_factor",
                "do_convert_rgb")
        settings = {k: raw[k] for k in keep if k in raw}
        size = raw.get("size") or {}
        settings.setdefault("min_pixels", size.get("shortest_edge", settings.get("min_pixels")))
        settings.setdefault("max_pixels", size.get("longest_edge", settings.get("max_pixels")))
        return cls(**{k: v for k, v in settings.items() if v is not None})

    def grid_for(self, width: int, height: int) -> tuple[int, int, int]:
        """The processor grid ``(t, h, w)`` of an image of ``width x height`` pixels
        (transformers' ``smart_resize``, without decoding the image)."""
        import importlib

        module = importlib.import_module(type(self._proc).__module__)
        p = self._proc
        patch, merge = int(p.patch_size), int(p.merge_size)
        size = getattr(p, "size", None) or {}
        lo = getattr(p, "min_pixels", None) or size.get("shortest_edge")
        hi = getattr(p, "max_pixels", None) or size.get("longest_edge")
        try:
            h, w = module.smart_resize(height, width, factor=patch * merge, min_pixels=lo, max_pixels=hi)
        except ValueError as exc:  # an aspect ratio over 200
            raise ImageError(f"the image is {width} x {height}: {exc}") from None
        return 1, h // patch, w // patch

    def __call__(self, blobs: Sequence[bytes], *, rule: ImageRule = ImageRule(),
                 budget: PixelBudget | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Each image admitted by ``rule`` from its header before it is decoded; its
        pixels held in ``budget`` while decoded and processed (media/images.py)."""
        with decoded_images(blobs, rule, budget=budget) as images:
            out = self._proc(images=images, return_tensors="pt")
        return out["pixel_values"].float(), out["image_grid_thw"].long()


def save_processor_config(path: str | os.PathLike, *, patch_size: int, merge_size: int,
                          temporal_patch_size: int, min_pixels: int, max_pixels: int,
                          image_mean: Sequence[float], image_std: Sequence[float]) -> None:
    """Write a model directory's ``preprocessor_config.json`` (both spellings of the
    resize bounds: transformers 4's min/max_pixels and 5's size)."""
    cfg = {"image_processor_type": "Qwen2VLImageProcessor", "patch_size": patch_size,
           "merge_size": merge_size, "temporal_patch_size": temporal_patch_size,
           "min_pixels": min_pixels, "max_pixels": max_pixels,
           "size": {"shortest_edge": min_pixels, "longest_edge": max_pixels},
           "image_mean": list(image_mean), "image_std": list(image_std),
           "do_resize": True, "do_rescale": True, "do_normalize": True, "do_convert_rgb": True}
    (Path(path) / PREPROCESSOR_FILE).write_text(json.dumps(cfg, indent=2) + "\n")


# ---------------------------------------------------------------------- model pieces


def vision_tower(model: torch.nn.Module) -> torch.nn.Module:
    body = getattr(model, "model", model)
    return body.visual


def vision_tower_params(model_path: str) -> int:
    """The parameters of the vision tower of the vision-language model at ``model_path``,
    counted on an empty (meta-device) copy built from its ``config.json`` (~1 s at 3B):
    what the memory and disk plans add to the decoder's (trainers/memory_plan.py)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(config)
    return sum(p.numel() for p in vision_tower(model).parameters())


def image_features(model: torch.nn.Module, pixel_values: torch.Tensor, grid_thw: torch.Tensor
                   ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """``(embeds [n_tokens, hidden], deepstack)``: the vision tower's merged features of
    every placeholder token of the images, in order; ``deepstack`` is Qwen3-VL's list of
    per-layer features added to the first decoder layers' outputs (None for Qwen2.5-VL).
    Handles the tower's return value across transformers versions (an output object with
    ``pooler_output`` in 5.x; a tensor, or ``(tensor, list)``, before)."""
    visual = vision_tower(model)
    dtype = next(visual.parameters()).dtype
    out = visual(pixel_values.to(dtype), grid_thw=grid_thw)
    deep = None
    if hasattr(out, "pooler_output"):
        embeds = out.pooler_output
        deep = getattr(out, "deepstack_features", None)
    elif isinstance(out, tuple):
        embeds, deep = out[0], (out[1] if len(out) > 1 else None)
    else:
        embeds = out
    if isinstance(embeds, (tuple, list)):
        embeds = torch.cat(list(embeds))
    if deep is not None:
        deep = [torch.cat(list(d)) if isinstance(d, (tuple, list)) else d for d in deep] or None
    return embeds, deep


def recompose_mrope(x_3ND: torch.Tensor, section: Sequence[int]) -> torch.Tensor:
    """``[3, N, D]`` per-axis cos or sin -> ``[N, D]``: frequency section i from axis i % 3
    (the contiguous layout of Qwen2/2.5-VL), in both halves."""
    sections = list(section) * 2
    parts = x_3ND.split(sections, dim=-1)
    return torch.cat([p[i % 3] for i, p in enumerate(parts)], dim=-1)


def mrope_cos_sin(rotary: torch.nn.Module, positions_3N: torch.Tensor, like: torch.Tensor,
                  mrope_section: Sequence[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos_ND, sin_ND)`` of 3-D positions from the model's own rotary embedding."""
    cos, sin = rotary(like, positions_3N[:, None, :])
    if cos.ndim == 4:  # [3, 1, N, D]: the axes are merged by the attention (older versions)
        if not mrope_section:
            raise ImageError("the model's rotary embedding returns per-axis tables but its config "
                             "has no mrope_section")
        return recompose_mrope(cos[:, 0], mrope_section), recompose_mrope(sin[:, 0], mrope_section)
    return cos[0], sin[0]


def mrope_section_of(config: Any) -> list[int] | None:
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(text, name, None) or {}
        if isinstance(params, dict) and params.get("mrope_section"):
            return list(params["mrope_section"])
    return None


# ---------------------------------------------------------------------- prompts with images


class VisionPrompts:
    """Prompts with images for a VL model directory: each image checked and stored
    (:func:`~tapioca.media.images.admit_images`), each placeholder expanded for its image.

    ``encode(row) -> (prompt_ids, prompt_text, refs)`` for a dataset row (``messages``
    with image parts, ``images`` their bytes); :meth:`admit` for the proxy (every image
    of a request checked, stored only by its ``commit``); :meth:`expand` for ids already
    rendered (the proxy's). ``max_pixels`` / ``max_bytes`` / ``inline_max_bytes``:
    ``vlm.max_image_pixels`` / ``vlm.max_image_bytes`` / ``vlm.inline_image_max_bytes``;
    ``budget``: the decoded pixels in flight (the proxy's, ``vlm.max_decoding_pixels``)."""

    def __init__(self, model_dir: str | os.PathLike, tokenizer: Any, store: Any, *,
                 max_pixels: int, inline_max_bytes: int, max_bytes: int | None = None,
                 budget: PixelBudget | None = None, spec: VisionSpec | None = None) -> None:
        """``spec``: the model's (its run's ``PolicySpec.vision``); None: read from
        ``model_dir``'s config.json."""
        doc = read_config_json(model_dir) if spec is None else {}
        spec = spec if spec is not None else vision_of(doc)
        if spec is None:
            raise ImageError(f"the model at {model_dir} ({doc.get('model_type', '?')}) has no vision tower, so "
                             "it cannot read images: use a vision-language model (model.arch qwen2_5_vl "
                             "or qwen3_vl, or a Qwen2.5-VL / Qwen3-VL directory)")
        self.spec = spec
        self.tokenizer = tokenizer
        self.store = store
        self.processor = ImageProcessor.from_dir(model_dir)
        self.rule = ImageRule(max_pixels=max_pixels, **({} if max_bytes is None else {"max_bytes": max_bytes}))
        self.inline_max_bytes = inline_max_bytes
        self.budget = budget

    @property
    def max_pixels(self) -> int:
        return self.rule.max_pixels

    def admit(self, blobs: Sequence[bytes]) -> Any:
        """Every one of ``blobs`` checked, none stored: an
        :class:`~tapioca.media.images.AdmittedImages` (its ``commit()`` stores them)."""
        from ..media.images import admit_images

        return admit_images(blobs, self.store, self.rule, inline_max_bytes=self.inline_max_bytes,
                            budget=self.budget)

    def refs(self, blobs: Sequence[bytes]) -> list[Any]:
        """Every one of ``blobs`` checked, then all stored (none when one is refused)."""
        admitted = self.admit(blobs)
        admitted.commit()
        return list(admitted)

    def expand(self, ids: Sequence[int], refs: Sequence[Any]) -> list[int]:
        grids = [self.processor.grid_for(r.width, r.height) for r in refs]
        return expand_image_tokens(ids, grids, self.spec)

    def encode(self, row: dict[str, Any]) -> tuple[list[int], str, list[Any]]:
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        admitted = self.admit(row.get("images") or [])
        expanded = self.expand(ids, admitted)  # placeholders that do not match: nothing stored
        admitted.commit()
        return expanded, text, list(admitted)


class ImageLoader:
    """Image references -> their bytes (from the store, checked) and the processor's
    tensors, keeping the tensors of the last ``cache_images`` images by sha256 (a group's
    samples, and a step's sequences, share their prompt's).

    Every image passes ``rule`` (``vlm.max_image_pixels`` / ``max_image_bytes``) before it
    is decoded, and must be the size its reference claims: an event's bomb is refused
    from its header (:class:`~tapioca.media.images.ImageError`; the role dead-letters the
    event). ``budget``: the decoded pixels in flight (the proxy's)."""

    def __init__(self, store: Any, processor: ImageProcessor, *, cache_images: int = 256,
                 rule: ImageRule = ImageRule(), budget: PixelBudget | None = None) -> None:
        from collections import OrderedDict

        self.store = store
        self.processor = processor
        self.cache_images = cache_images
        self.rule = rule
        self.budget = budget
        self._cache: "OrderedDict[str, tuple[torch.Tensor, tuple[int, int, int]]]" = OrderedDict()

    def admitted(self, refs: Sequence[Any], given: dict[str, bytes] | None = None) -> list[tuple[bytes, Any]]:
        """``(bytes, ImageInfo)`` of each of ``refs``: from ``given`` (sha256 -> bytes of
        images not stored yet), inline or the store, each admitted from its header."""
        from ..media.images import admit_image, ref_bytes

        out = []
        for ref in refs:
            data = given.get(ref.sha256) if given else None
            if data is None:
                data = ref_bytes(ref, self.store, self.rule)
            out.append((data, admit_image(data, self.rule, expect=ref)))
        return out

    def blobs(self, refs: Sequence[Any], given: dict[str, bytes] | None = None) -> list[bytes]:
        return [data for data, _ in self.admitted(refs, given)]

    def grids(self, refs: Sequence[Any], given: dict[str, bytes] | None = None
              ) -> tuple[list[tuple[int, int, int]], list[bytes]]:
        """``(grids, blobs)`` without decoding a pixel (a server engine decodes them)."""
        pairs = self.admitted(refs, given)
        return [self.processor.grid_for(info.width, info.height) for _, info in pairs], [d for d, _ in pairs]

    def pixels(self, refs: Sequence[Any], given: dict[str, bytes] | None = None
               ) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
        """``(pixel_values [P, D], grids)`` of ``refs`` in order (recomputed from the bytes)."""
        out = []
        for ref in refs:
            hit = self._cache.get(ref.sha256)
            if hit is None:
                pv, grid = self.processor(self.blobs([ref], given), rule=self.rule, budget=self.budget)
                hit = (pv, tuple(int(x) for x in grid[0].tolist()))
                self._cache[ref.sha256] = hit
                while len(self._cache) > self.cache_images:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(ref.sha256)
            out.append(hit)
        if not out:
            return torch.empty(0), []
        return torch.cat([pv for pv, _ in out]), [g for _, g in out]
