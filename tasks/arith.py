"""Chain arithmetic with shown work: a reasoning-like task with a long-tailed length.

Pure code, no Kafka; scored by this module's :meth:`ArithChainTask.reward` (the built-in
reward scorer dispatches on the record's ``task``, ``arith``). A problem is a chain of
``n`` additions / subtractions of small numbers (``1..max_operand``, 9 by default) to a
running value in 0..99, ``n`` drawn from a capped Pareto distribution, so the correct
solution's length grows with ``n`` and a few are 4-8x the median (the workload where a
synchronous step waits for its longest sample):

    prompt   "57+2-9+8="
    solution "57+2=59\\n59-9=50\\n50+8=58\\nanswer 58"

Every running value stays in 0..99 (the generator picks ``+b`` or ``-b`` so that it
does), so each line is one small addition or subtraction: a small model learns the
step; the whole answer is right only when all ``n`` steps are.

Records: ``train_size`` problems for ``train`` and ``test_size`` for ``test`` /
``valid``, from one stream fixed by ``data_seed`` (not the run's seed). A problem goes to
the held-out split when a hash of its prompt says so, so the splits never share a
prompt. ``iter_records(split, seed)`` yields a split once, shuffled by ``seed`` for
``train``; ``prompt_id`` is ``arith-{split}-{i}``; each record carries its ``solution``
(the supervised warm start's response) and ``steps`` (n).

The reward is 1 when the number after the last ``answer`` equals the reference, else 0
(a pure correctness signal; the work shown is not checked). Text after the first
end-of-turn token (``<eos>``, ``<|im_end|>``, ``<|endoftext|>``) is ignored.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ..models.tokenizer import DEFAULT_ALPHABET
from ..schemas.errors import ConfigError
from .base import Record, reference_of, register_task, user_messages

# The char tokenizer's alphabet (the CPU smoke's tiny model): digits, + - = and newline
# are in the default alphabet; "answer" adds its letters.
ARITH_ALPHABET = DEFAULT_ALPHABET + "answer"
END_OF_TURN = ("<eos>", "<|im_end|>", "<|endoftext|>")
_ANSWER_RE = re.compile(r"answer\s*(-?\d+)")


def chain_lengths(rng: random.Random, *, min_steps: int, max_steps: int, alpha: float) -> int:
    """One chain length: ``floor(min_steps * U ** (-1 / alpha))`` capped at ``max_steps``
    (a Pareto tail: with min 2, alpha 1.5 the median is 3, p90 9, and ~7% reach 12)."""
    u = 1.0 - rng.random()  # (0, 1]
    return min(max_steps, int(min_steps * u ** (-1.0 / alpha)))


def final_answer(text: str) -> str | None:
    """The number after the last ``answer`` before the first end-of-turn token (None: none)."""
    for eot in END_OF_TURN:
        text = text.split(eot, 1)[0]
    found = _ANSWER_RE.findall(text)
    return found[-1] if found else None


class GeneratedChainTask:
    """What the generated chain tasks (arith, longchain) share: two splits drawn once
    from ``problem(rng) -> (prompt, solution, answer, steps)`` with ``data_seed``
    (``train_size`` / ``test_size`` problems; one in ten prompts, by hash, is held out),
    their records, and the reward: the final ``answer N`` line against the reference."""

    name: str
    data_seed: int
    train_size: int
    test_size: int
    _splits: dict[str, list[tuple[str, str, str, int]]] | None

    def problem(self, rng: random.Random) -> tuple[str, str, str, int]:
        raise NotImplementedError

    def splits(self) -> dict[str, list[tuple[str, str, str, int]]]:
        """Both splits, generated once: a problem is held out when its prompt's hash
        says so (1 in 10), until each split is full; duplicates are skipped."""
        if self._splits is None:
            rng = random.Random(self.data_seed)
            out: dict[str, list] = {"train": [], "test": []}
            seen: set[str] = set()
            want = {"train": self.train_size, "test": self.test_size}
            while any(len(out[s]) < want[s] for s in out):
                p = self.problem(rng)
                if p[0] in seen:
                    continue
                split = "test" if hashlib.sha256(p[0].encode()).digest()[0] < 26 else "train"
                if len(out[split]) < want[split]:
                    seen.add(p[0])
                    out[split].append(p)
            self._splits = out
        return self._splits

    def iter_records(self, split: str = "train", seed: int | None = 0) -> Iterator[Record]:
        if split not in ("train", "test", "valid"):
            raise ConfigError(f"{self.name} has splits train, test (valid = test), not {split!r}")
        key = "train" if split == "train" else "test"
        problems = list(enumerate(self.splits()[key]))
        if key == "train" and seed is not None:
            random.Random(seed).shuffle(problems)
        for i, (prompt, solution, answer, n) in problems:
            yield {"prompt_id": f"{self.name}-{key}-{i}", "task": self.name, "messages": user_messages(prompt),
                   "prompt": prompt, "answer": answer, "solution": solution, "steps": n}

    def extract_answer(self, completion_text: str) -> str | None:
        return final_answer(completion_text)

    def reward(self, completion_text: str, record_or_answer: Mapping[str, Any] | str) -> float:
        return 1.0 if final_answer(completion_text) == reference_of(record_or_answer) else 0.0


@dataclass
class ArithChainTask(GeneratedChainTask):
    """Chains of ``min_steps..max_steps`` additions/subtractions of ``1..max_operand``
    to a running value in 0..99 (Pareto ``alpha``), ``train_size`` + ``test_size``
    problems from ``data_seed``."""

    train_size: int = 20000
    test_size: int = 200
    min_steps: int = 2
    max_steps: int = 24
    alpha: float = 1.5
    # The largest operand b of a step (the running value is always 0..99): 9 makes each
    # step "two digits +- one digit", which a small model learns in minutes; 99 is harder.
    max_operand: int = 9
    data_seed: int = 27
    name: str = "arith"
    alphabet: str | None = ARITH_ALPHABET

    def __post_init__(self) -> None:
        if not 1 <= self.min_steps <= self.max_steps:
            raise ConfigError(f"arith: need 1 <= min_steps <= max_steps, got {self.min_steps}, {self.max_steps}")
        if self.alpha <= 0:
            raise ConfigError(f"arith: alpha must be > 0 (the Pareto tail's index), got {self.alpha}")
        if not 1 <= self.max_operand <= 99:
            raise ConfigError(f"arith: max_operand must be in 1..99, got {self.max_operand}")
        if self.train_size < 1 or self.test_size < 1:
            raise ConfigError("arith: train_size and test_size must be >= 1")
        self._splits: dict[str, list[tuple[str, str, str, int]]] | None = None

    def problem(self, rng: random.Random) -> tuple[str, str, str, int]:
        """(prompt, solution, answer, n) of one chain drawn from ``rng``."""
        n = chain_lengths(rng, min_steps=self.min_steps, max_steps=self.max_steps, alpha=self.alpha)
        value = rng.randint(1, 99)
        prompt, lines = str(value), []
        for _ in range(n):
            # +b needs value + b <= 99, -b needs b <= value: pick a side that has room.
            plus = value <= 1 or (value < 98 and rng.random() < 0.5)
            room = 99 - value if plus else value
            b = rng.randint(1, min(self.max_operand, room))
            new = value + b if plus else value - b
            op = "+" if plus else "-"
            prompt += f"{op}{b}"
            lines.append(f"{value}{op}{b}={new}")
            value = new
        lines.append(f"answer {value}")
        return prompt + "=", "\n".join(lines), str(value), n

register_task("arith", ArithChainTask)
