"""The synthetic visual task of the embedded VLM default: coloured squares drawn with PIL.

Pure code, no Kafka; scored by the built-in scorer (``reward.scorer: auto`` picks it by
the trajectory's ``task``, ``visual``). Every record's image is generated here, from the
record's own parameters, so the task needs no files and its answers are verifiable.

Ops (``train_dataset.task_options.op``):

* ``color`` (the default): one large square (half to three quarters of the side, at a
  random place) of one of three colours on white; the answer is the colour's number
  (1 red, 2 green, 3 blue). The prompt text is the same
  for every record, so only the image tells the answer: a policy that ignores it earns
  at most 1/3.
* ``count``: 1 to ``max_count`` (<= 4) small squares of one colour in distinct cells of a
  2 x 2 grid; the answer is how many.

Why ``color`` is the default (measured here with a plain in-process GRPO loop: tiny
random Qwen2.5-VL, text 2 layers x 64, vision tower 1 block x 32, 56 x 56 images = 4
placeholder tokens, 16 prompts x 8 samples, lr 1e-3, Adam, clip 1.0, 2 CPU threads):
``color`` went from 0.00 to 0.68 in 100 steps and 0.99 at 200; ``count`` (1-3) reached
0.32 at 200 steps, i.e. the text-only answer "2" (1/3), without reading the image yet.
The counting task needs a larger tower or many more steps than a CPU demo has.

Records: ``n_images`` records per epoch (default 96), each with its own seed; the
``prompt_id`` is ``visual-{op}-{index}``. ``images`` holds the PNG bytes (one per
record), ``messages`` an image part then the question, ``answer`` the digit. The
completion must be the answer followed by ``<eos>``.
"""

from __future__ import annotations

import io
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..models.tokenizer import DEFAULT_ALPHABET
from ..schemas.errors import ConfigError
from .base import Record, reference_of, register_task
from .synthetic import completion_answer

# What the prompts need on top of the default tiny alphabet.
VISUAL_ALPHABET = DEFAULT_ALPHABET + "colrhwmany?"
COLOURS = ((220, 40, 40), (40, 190, 40), (40, 70, 225))
QUESTIONS = {"color": "color?", "count": "how many?"}
CANVAS = 56


def draw(op: str, seed: int, *, max_count: int = 3, canvas: int = CANVAS) -> tuple[bytes, str]:
    """``(png bytes, answer)`` of the record drawn from ``seed``."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    im = Image.new("RGB", (canvas, canvas), (255, 255, 255))
    d = ImageDraw.Draw(im)
    if op == "color":
        k = rng.randrange(len(COLOURS))
        side = canvas // 2 + rng.randrange(canvas // 4)
        x, y = rng.randrange(canvas - side), rng.randrange(canvas - side)
        d.rectangle([x, y, x + side - 1, y + side - 1], fill=COLOURS[k])
        answer = str(k + 1)
    else:
        n = rng.randint(1, max_count)
        colour = COLOURS[rng.randrange(len(COLOURS))]
        half = canvas // 2
        for cell in rng.sample(range(4), n):
            x, y = (cell % 2) * half, (cell // 2) * half
            d.rectangle([x + half // 6, y + half // 6, x + half - 1 - half // 6, y + half - 1 - half // 6],
                        fill=colour)
        answer = str(n)
    buf = io.BytesIO()
    im.save(buf, format="PNG", optimize=True)
    return buf.getvalue(), answer


@dataclass
class VisualTask:
    """See the module docstring."""

    op: str = "color"
    n_images: int = 96
    max_count: int = 3
    name: str = "visual"
    alphabet: str | None = VISUAL_ALPHABET

    def __post_init__(self) -> None:
        if self.op not in QUESTIONS:
            raise ConfigError(f"unknown visual op {self.op!r}; use one of {', '.join(QUESTIONS)}")
        if self.n_images < 1:
            raise ConfigError(f"n_images must be >= 1, got {self.n_images}")
        if not 1 <= self.max_count <= 4:
            raise ConfigError(f"max_count must be in 1..4 (a 2 x 2 grid), got {self.max_count}")

    def iter_records(self, split: str = "train", seed: int | None = 0) -> Iterator[Record]:
        """``n_images`` records; ``test`` draws another set (seeds offset by 10**6)."""
        order = list(range(self.n_images))
        if split == "train" and seed is not None:
            random.Random(seed).shuffle(order)
        base = 0 if split == "train" else 10**6
        question = QUESTIONS[self.op]
        for i in order:
            png, answer = draw(self.op, base + i, max_count=self.max_count)
            yield {
                "prompt_id": f"visual-{self.op}-{base + i}",
                "task": self.name,
                "messages": [{"role": "user", "content": [{"type": "image"},
                                                          {"type": "text", "text": question}]}],
                "prompt": question,
                "images": [png],
                "answer": answer,
            }

    def reward(self, completion_text: str, record_or_answer: Mapping[str, Any] | str) -> float:
        return 1.0 if completion_answer(completion_text) == reference_of(record_or_answer) else 0.0


register_task("visual", VisualTask)
