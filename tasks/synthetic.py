"""The built-in synthetic task of the embedded default: ``max(a,b)=`` -> the larger digit.

Pure code, no Kafka; scored by the built-in synthetic reward scorer. A tiny random model
(2 layers, width 64, this task's 30-token vocabulary) learns it by GRPO alone from a
reward of 0.00 to >= 0.8 in ~200 steps at 32 prompts x 8 samples (~300 at 16 x 8), with
lr 5e-4 and grad clipping; the measurements behind the choice are in the
``SyntheticTask`` docstring.

Records: all ``len(digits)**2`` operand pairs, once per epoch, shuffled by ``seed``;
``prompt_id`` is ``synthetic-{op}-{a}{b}`` whatever the seed or split. By default
nothing is held out (``test`` is the same set in file order); with ``holdout_pairs=n``
a fixed set of n pairs (chosen by a seed of its own, the same in every run) is the
``test`` split and is left out of ``train``: held-out prompts the evaluator can score
(the demo's ``valid_dataset``).
The completion must be the answer followed by ``<eos>``; ``reward`` reads the text
before the first ``<eos>`` (if the worker kept it), surrounding spaces ignored.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..models.tokenizer import DEFAULT_ALPHABET, EOS_TOKEN
from ..schemas.errors import ConfigError
from .base import Record, reference_of, register_task, user_messages

# The letters and brackets the prompts need, on top of the default tiny alphabet:
# 23 + 7 = 30 tokens.
SYNTHETIC_ALPHABET = DEFAULT_ALPHABET + "maxin()"

# The seed that picks the held-out pairs (holdout_pairs): fixed, not the run's seed.
HOLDOUT_SEED = 20261202

# op -> (prompt for operands a, b; reference answer)
OPS: dict[str, tuple[Callable[[int, int], str], Callable[[int, int], str]]] = {
    # the default: needs both operands and a comparison, but half the table is
    # "copy the first", so the reward climbs from the first hundred steps
    "max": (lambda a, b: f"max({a},{b})=", lambda a, b: str(max(a, b))),
    "min": (lambda a, b: f"min({a},{b})=", lambda a, b: str(min(a, b))),
    # docs/design.md#5b-the-embedded-default-task has the reference points: copy is the
    # easiest, add the one RL alone fails
    "copy": (lambda a, b: f"{a}+{b}=", lambda a, b: str(a)),
    "add": (lambda a, b: f"{a}+{b}=", lambda a, b: str(a + b)),
}


def completion_answer(completion_text: str) -> str:
    """The text before the first ``<eos>`` (if present), without surrounding spaces."""
    return completion_text.split(EOS_TOKEN, 1)[0].strip()


@dataclass
class SyntheticTask:
    """``op`` over one-digit operands ``0..max_digit``.

    Why ``max`` (measured with a plain in-process GRPO loop: Qwen2 2 layers x 64, this
    30-token vocabulary, temperature 1, max 4 new tokens, advantages (r - mean) / (std +
    1e-6) per group, token-mean loss, Adam, grad-norm clip 1.0, 8 samples a prompt;
    "steps" = optimizer steps until the 10-step mean reward first reaches 0.8):

    ==========  =======  =====  ===========================  ========================
    op          prompts  lr     seeds reaching 0.8 by 600    steps to 0.8
    ==========  =======  =====  ===========================  ========================
    max         32       5e-4   8 / 8                        184-242 (final 0.84-0.97)
    max         16       5e-4   8 / 8                        273-455 (final 0.79-0.93)
    max         32       1e-3   7 / 8 (2 end at 0.64, 0.71)  142-196
    max         16       1e-3   2 / 8 (collapse at ~0.5-0.6)
    max         32       3e-3   0 / 3 (collapse, 0.18-0.31)
    max         32       3e-3   0 / 4 (no clip: collapse)
    copy        32       1e-3   8 / 8                        126-164
    copy        16       1e-3   6 / 8                        169-332
    min         32       1e-3   1 / 4
    add         32       1e-3   0 / 2 after 1000 (0.16, 0.53)
    ==========  =======  =====  ===========================  ========================

    Reward starts at 0.00 for the random model. ``copy`` is easier but shows nothing
    beyond copying a token; ``max`` needs both operands and a comparison, and half the
    table ("the first is larger") gives an early foothold, so the climb is visible from
    step ~100. Use lr 5e-4 with grad clipping: at 1e-3 and above some prompts collapse to
    one wrong answer, where every sample of the group is equal and GRPO's advantage is 0.

    ``format_credit``: reward for a wrong answer that is still one well-formed number
    (0 by default: a pure correctness signal).
    """

    op: str = "max"
    max_digit: int = 9
    format_credit: float = 0.0
    # Operand pairs held out of ``train`` and served as ``test`` (0: none held out).
    holdout_pairs: int = 0
    name: str = "synthetic"
    alphabet: str | None = SYNTHETIC_ALPHABET

    def __post_init__(self) -> None:
        if self.op not in OPS:
            raise ConfigError(f"unknown synthetic op {self.op!r}; use one of {', '.join(OPS)}")
        if not 0 <= self.max_digit <= 9:
            raise ConfigError(f"max_digit must be in 0..9 (one-digit operands), got {self.max_digit}")
        if not 0.0 <= self.format_credit < 1.0:
            raise ConfigError(f"format_credit must be in [0, 1), got {self.format_credit}")
        pairs = (self.max_digit + 1) ** 2
        if not 0 <= self.holdout_pairs < pairs:
            raise ConfigError(f"holdout_pairs={self.holdout_pairs}: hold out 0..{pairs - 1} of "
                              f"the {pairs} operand pairs (some must stay for training)")

    def prompt(self, a: int, b: int) -> str:
        return OPS[self.op][0](a, b)

    def answer(self, a: int, b: int) -> str:
        return OPS[self.op][1](a, b)

    def held_out(self) -> set[tuple[int, int]]:
        """The ``holdout_pairs`` operand pairs of the ``test`` split: drawn by a fixed seed
        of their own, so every run (whatever its ``seed``) holds out the same ones."""
        pairs = [(a, b) for a in range(self.max_digit + 1) for b in range(self.max_digit + 1)]
        return set(random.Random(HOLDOUT_SEED).sample(pairs, self.holdout_pairs))

    def iter_records(self, split: str = "train", seed: int | None = 0) -> Iterator[Record]:
        """Every operand pair once (with ``holdout_pairs``: ``train`` without the held-out
        pairs, ``test`` / ``valid`` only those); shuffled by ``seed`` for ``train``
        (``None``: in order)."""
        pairs = [(a, b) for a in range(self.max_digit + 1) for b in range(self.max_digit + 1)]
        if self.holdout_pairs:
            held = self.held_out()
            pairs = [p for p in pairs if (p in held) == (split in ("test", "valid"))]
        if split == "train" and seed is not None:
            random.Random(seed).shuffle(pairs)
        for a, b in pairs:
            prompt = self.prompt(a, b)
            yield {
                "prompt_id": f"synthetic-{self.op}-{a}{b}",
                "task": self.name,
                "messages": user_messages(prompt),
                "prompt": prompt,
                "answer": self.answer(a, b),
            }

    def extract_answer(self, completion_text: str) -> str | None:
        """The answer :meth:`reward` compares (None: an empty completion)."""
        return completion_answer(completion_text) or None

    def reward(self, completion_text: str, record_or_answer: Mapping[str, Any] | str) -> float:
        got = completion_answer(completion_text)
        want = reference_of(record_or_answer)
        if got == want:
            return 1.0
        if self.format_credit and got.lstrip("-").isdigit():
            return self.format_credit
        return 0.0


register_task("synthetic", SyntheticTask)
