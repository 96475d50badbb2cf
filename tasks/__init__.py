"""tasks: datasets and reward functions as pure code (no Kafka).

``get_task(name, **kwargs)`` returns a task with ``iter_records(split, seed)`` and
``reward(completion_text, record_or_answer)``; see :mod:`tapioca.tasks.base`.
"""

from . import arith, gsm8k, longchain, synthetic, visual  # noqa: F401  (the built-ins register themselves)
from .base import Task, get_task, register_task, task_names, task_reward

__all__ = ["Task", "get_task", "register_task", "task_names", "task_reward"]
