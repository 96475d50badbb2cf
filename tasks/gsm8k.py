"""GSM8K: grade-school math word problems, scored by :func:`tapioca.tasks.math_reward.math_reward`.

Reads the original jsonl files (``question``, ``answer`` ending in ``#### 42``); any of
JSONL / Parquet / a ``save_to_disk`` directory with those columns works. Records are
keyed ``gsm8k-{split}-{index}`` with ``index`` the row's position in the file, so the
id of a problem never depends on the shuffle seed.

Where the files are: ``path=`` (a file, or a folder holding ``{split}.jsonl``; relative:
from the working directory, else the repository root), else ``$TAPIOCA_DATA_DIR/gsm8k/``,
else the copy the repository ships, ``examples/data/gsm8k/`` (train and test, MIT
licensed: its LICENSE).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..models.tokenizer import PRINTABLE_ALPHABET
from ..schemas.errors import ConfigError, TapiocaError
from .base import Record, reference_of, register_task, user_messages
from .datasets import REPO_ROOT, data_path, read_records
from .math_reward import math_answer, math_reward

DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


def gsm8k_reference(answer_field: str) -> str:
    """The number after the last ``####`` of a GSM8K answer, commas removed (``"1,000"`` -> ``"1000"``)."""
    if "####" not in answer_field:
        raise TapiocaError(f"GSM8K answer has no '#### <number>' line: {answer_field[-80:]!r}")
    return answer_field.rsplit("####", 1)[1].strip().replace(",", "")


def default_data_dir() -> Path:
    env = os.environ.get("TAPIOCA_DATA_DIR")
    if env:
        return Path(env)
    return REPO_ROOT / "examples" / "data"  # GSM8K ships there (not in the wheel)


@dataclass
class GSM8KTask:
    """GSM8K from local files. ``instruction`` is appended to each question (``""``: none)."""

    path: str | None = None
    instruction: str = DEFAULT_INSTRUCTION
    name: str = "gsm8k"
    alphabet: str | None = PRINTABLE_ALPHABET

    def _rows(self, split: str) -> list[dict[str, Any]]:
        if self.path is None:
            p = default_data_dir() / "gsm8k" / f"{split}.jsonl"
            if not p.exists():
                raise ConfigError(f"no GSM8K file at {p}; pass path=... or set TAPIOCA_DATA_DIR")
            return list(read_records(p))
        p = data_path(self.path)
        if p.is_dir() and not ((p / "state.json").exists() or (p / "dataset_dict.json").exists()):
            p = p / f"{split}.jsonl"  # a folder of the original {split}.jsonl files
            return list(read_records(p))
        return list(read_records(p, split=split if p.is_dir() else None))

    def iter_records(self, split: str = "train", seed: int | None = 0) -> Iterator[Record]:
        """Each problem of ``split`` once; shuffled by ``seed`` (``None``: file order)."""
        rows = self._rows(split)
        order = list(range(len(rows)))
        if seed is not None:
            random.Random(seed).shuffle(order)
        for index in order:
            row = rows[index]
            question = row["question"].strip()
            prompt = f"{question}\n{self.instruction}" if self.instruction else question
            yield {
                "prompt_id": f"gsm8k-{split}-{index}",
                "task": self.name,
                "messages": user_messages(prompt),
                "prompt": prompt,
                "answer": gsm8k_reference(row["answer"]),
            }

    def extract_answer(self, completion_text: str) -> str | None:
        return math_answer(completion_text)

    def reward(self, completion_text: str, record_or_answer: Mapping[str, Any] | str) -> float:
        return math_reward(completion_text, reference_of(record_or_answer))


register_task("gsm8k", GSM8KTask)
