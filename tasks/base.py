"""The task contract (a dataset + a reward function) and the task registry.

Pure code, no Kafka. The prompt feeder calls ``iter_records`` and publishes each record;
rollout workers apply the chat template to ``messages``; reward scorers call ``reward``
with the completion text and the record (or just its reference answer), which the
trajectory event carries. Records are plain JSON-able dicts keyed by ``prompt_id``:

    {"prompt_id": "synthetic-train-37",          # stable across runs, seeds and epochs
     "task": "synthetic",                       # which reward function scores it
     "messages": [{"role": "user", "content": "3+7="}],
     "prompt": "3+7=",                          # the same text without chat structure
     "answer": "7"}                             # the reference the reward compares to

``iter_records(split, seed)`` yields each record of the split exactly once (one epoch),
in an order fixed by ``seed``; epochs and resume positions are the feeder's business.
``reward`` returns a float in [0, 1]; it raises (never returns 0) when it cannot score.
``extract_answer(completion_text)`` (optional) returns the answer ``reward`` compares, as
a string equal answers share, or None: the majority vote of `tapioca eval`'s maj@k
(:func:`task_answer`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol, runtime_checkable

from ..schemas.errors import ConfigError

Record = dict[str, Any]


@runtime_checkable
class Task(Protocol):
    """What every task provides. ``alphabet`` is the character set a char tokenizer for
    this task needs (``None``: the default tiny alphabet of
    :mod:`tapioca.models.tokenizer`)."""

    name: str
    alphabet: str | None

    def iter_records(self, split: str = "train", seed: int = 0) -> Iterator[Record]: ...

    def reward(self, completion_text: str, record_or_answer: Mapping[str, Any] | str) -> float: ...


def reference_of(record_or_answer: Mapping[str, Any] | str) -> str:
    """The reference answer, given a record (its ``answer``) or the answer itself."""
    if isinstance(record_or_answer, str):
        return record_or_answer
    if isinstance(record_or_answer, Mapping) and "answer" in record_or_answer:
        return str(record_or_answer["answer"])
    raise ConfigError(
        f"cannot find a reference answer in {type(record_or_answer).__name__}; "
        "pass the record dict (with an 'answer' key) or the answer string"
    )


def user_messages(text: str) -> list[dict[str, str]]:
    """A one-turn chat with ``text`` as the user's message."""
    return [{"role": "user", "content": text}]


_REGISTRY: dict[str, Callable[..., Task]] = {}


def register_task(name: str, factory: Callable[..., Task]) -> None:
    """Make ``get_task(name, **kwargs)`` call ``factory(**kwargs)``."""
    _REGISTRY[name] = factory


# The built-in tasks register themselves when the package is imported (tasks/__init__.py),
# which always runs before this module: base.py imports none of them, so no import circle.


def task_names() -> list[str]:
    return sorted(_REGISTRY)


def get_task(name: str, **kwargs: Any) -> Task:
    """The task registered under ``name`` (built-ins: ``synthetic``, ``gsm8k``, ...)."""
    if name not in _REGISTRY:
        raise ConfigError(f"unknown task {name!r}; known tasks: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name](**kwargs)


RewardOf = Callable[[str, "Mapping[str, Any] | str"], float]

# The task of rows read from a dataset file (train_dataset.type jsonl / parquet /
# hf_disk): math problems, scored by math-verify against their answer.
MATH_TASK = "math"


def task_reward(task: str, **options: Any) -> RewardOf:
    """``reward(completion_text, record_or_answer)`` of the task named ``task``: the one
    home of task -> reward dispatch (the built-in reward scorer, the agent workflows and
    the agent runner all ask here). ``math`` (or no name: a dataset file's rows) is
    math-verify against the reference answer; any other name is that registered task's
    ``reward`` with ``options`` (its keyword arguments, e.g. the synthetic task's
    ``format_credit``). An unknown name raises :class:`ConfigError`."""
    if not task or task == MATH_TASK:
        from .math_reward import math_reward

        def math(text: str, record_or_answer: Mapping[str, Any] | str) -> float:
            answer = (record_or_answer if isinstance(record_or_answer, str)
                      else str(record_or_answer.get("answer", "")))
            return math_reward(text, answer)

        return math
    impl = get_task(task, **options)
    return lambda text, record_or_answer: float(impl.reward(text, record_or_answer))


def task_answer(task: str, **options: Any) -> Callable[[str], "str | None"]:
    """``extract(completion_text) -> answer | None`` of the task named ``task`` (the
    dispatch of :func:`task_reward`): ``math`` (or no name) is
    :func:`~tapioca.tasks.math_reward.math_answer`, a registered task its
    ``extract_answer``. A task without one raises :class:`ConfigError` (maj@k needs it)."""
    if not task or task == MATH_TASK:
        from .math_reward import math_answer

        return math_answer
    impl = get_task(task, **options)
    extract = getattr(impl, "extract_answer", None)
    if extract is None:
        raise ConfigError(f"task {task!r} has no extract_answer(completion_text), which maj@k "
                          "votes with; add one to the task")
    return extract
