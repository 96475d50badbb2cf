"""Long chains with shown work: a reasoning-like task whose correct solutions are long
(median ~570 tokens) with a long tail (p99 ~4,300-4,500, at most 6,502).

Pure code, no Kafka; scored by :meth:`LongChainTask.reward` (the built-in reward scorer
dispatches on the record's ``task``, ``longchain``). A problem asks for ``x + n*b`` mod
100 the long way: ``n`` additions of ``b`` to a running value in 0..99, one line each,
numbered down from ``n`` (the lines left), the wrap-around shown, then ``answer``:

    prompt   "97+9x25="            (start at 97, add 9, 25 times, mod 100)
    solution "25: 97+9=106-100=6\\n24: 6+9=15\\n23: 15+9=24\\n...\\n1: 14+9=23\\nanswer 23"

Why this shape (benchmarks/learn_async.py, issue 42): a synchronous RL step waits for the
longest sample of its batch, so the workload that shows what asynchrony buys is long
generations with a long tail. ``n`` is drawn from a Pareto distribution
(``floor(min_steps * U ** (-1 / alpha))``, capped at ``max_steps``): with the defaults
(24, 1.9, 300) the median chain is 34 lines, p90 81, p99 260, and 0.7 % are at the cap.
Every line depends only on the line above it (its label minus one, its result, its
``b``; the first line copies ``n``, the start and ``b`` from the prompt), and the line
labelled 1 is the last, so a small model learns the step by SFT from random init however
long the chain (no counting against a number far back); the answer is right only when
all ``n`` lines are, so sampling noise compounds over the chain and RL has something to
sharpen.

Token counts: with the char tokenizer (:mod:`tapioca.models.tokenizer`) a token is a
character (+1 for ``<eos>``); Qwen2's BPE splits digits one by one, so it counts within
1 % of that (measured on 8,000 problems: median 567 vs 572, p99 4,301 vs 4,306).

Records: ``train_size`` problems for ``train`` and ``test_size`` for ``test`` /
``valid``, from one stream fixed by ``data_seed`` (not the run's seed); a problem is
held out when a hash of its prompt says so, so the splits never share a prompt.
``iter_records(split, seed)`` yields a split once, shuffled by ``seed`` for ``train``;
``prompt_id`` is ``longchain-{split}-{i}``; each record carries its ``solution`` (the
warm start's response) and ``steps`` (n). The reward is 1 when the number after the last
``answer`` (before the first end-of-turn token) is the reference, else 0; the work shown
is not checked.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from ..models.tokenizer import DEFAULT_ALPHABET
from ..schemas.errors import ConfigError
from .arith import GeneratedChainTask, chain_lengths
from .base import register_task

# The char tokenizer's alphabet: digits, + - = space and newline are in the default one;
# "x" (times, in the prompt), ":" (after a line's number) and the letters of "answer".
LONGCHAIN_ALPHABET = DEFAULT_ALPHABET + "answerx:"
MODULUS = 100


def solve(start: int, addend: int, steps: int) -> tuple[str, int]:
    """The shown work of ``start + steps * addend`` mod 100 and the answer. Lines count
    down (``steps``, ..., 1): the label after 1 is the answer, so the stop is local too."""
    value, lines = start, []
    for k in range(steps, 0, -1):
        total = value + addend
        if total >= MODULUS:
            lines.append(f"{k}: {value}+{addend}={total}-{MODULUS}={total - MODULUS}")
            value = total - MODULUS
        else:
            lines.append(f"{k}: {value}+{addend}={total}")
            value = total
    lines.append(f"answer {value}")
    return "\n".join(lines), value


@dataclass
class LongChainTask(GeneratedChainTask):
    """``n`` numbered additions of ``b`` (1..``max_addend``) mod 100, ``n`` Pareto
    (``min_steps``, ``alpha``) capped at ``max_steps``; ``train_size`` + ``test_size``
    problems from ``data_seed``."""

    train_size: int = 20000
    test_size: int = 500
    min_steps: int = 24
    max_steps: int = 300
    alpha: float = 1.9
    max_addend: int = 99
    data_seed: int = 42
    name: str = "longchain"
    alphabet: str | None = LONGCHAIN_ALPHABET

    def __post_init__(self) -> None:
        if not 1 <= self.min_steps <= self.max_steps:
            raise ConfigError(f"longchain: need 1 <= min_steps <= max_steps, got {self.min_steps}, "
                              f"{self.max_steps}")
        if self.alpha <= 0:
            raise ConfigError(f"longchain: alpha must be > 0 (the Pareto tail's index), got {self.alpha}")
        if not 1 <= self.max_addend <= MODULUS - 1:
            raise ConfigError(f"longchain: max_addend must be in 1..{MODULUS - 1}, got {self.max_addend}")
        if self.train_size < 1 or self.test_size < 1:
            raise ConfigError("longchain: train_size and test_size must be >= 1")
        self._splits: dict[str, list[tuple[str, str, str, int]]] | None = None

    def problem(self, rng: random.Random) -> tuple[str, str, str, int]:
        """(prompt, solution, answer, n) of one problem drawn from ``rng``."""
        n = chain_lengths(rng, min_steps=self.min_steps, max_steps=self.max_steps, alpha=self.alpha)
        start, addend = rng.randint(0, MODULUS - 1), rng.randint(1, self.max_addend)
        solution, answer = solve(start, addend, n)
        return f"{start}+{addend}x{n}=", solution, str(answer), n


register_task("longchain", LongChainTask)
