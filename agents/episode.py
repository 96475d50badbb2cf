"""What every agent workflow shares: the episode result, the agent contract and the
task reward lookup.

No Kafka and no HTTP of its own: an agent gets an ``openai.AsyncOpenAI`` client whose
``base_url`` is the proxy and whose ``api_key`` is one session's key, plays one episode
for one dataset record, and returns an :class:`Episode`. The runner
(:mod:`tapioca.agents.runner`) posts the episode's rewards and ends the session.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol

RewardFn = Callable[[str, Mapping[str, Any]], float]


@dataclass
class Episode:
    """One finished episode. ``rewards`` are ``(completion_id, reward)`` pairs to post on
    the session (``completion_id`` None: the session's last completion); ``discount``
    is the turn discount the proxy applies when the session ends (None: the proxy's
    ``proxy.turn_discount``); ``reward`` is the episode's discounted return (what the
    runner reports; the proxy computes the trained one from the posted rewards)."""

    reward: float
    turns: int
    rewards: list[tuple[str | None, float]] = field(default_factory=list)
    discount: float | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


class Agent(Protocol):
    async def run(self, client: Any, model: str, record: Mapping[str, Any]) -> Episode:
        """Play one episode of ``record`` with ``client`` (an ``openai.AsyncOpenAI``)."""
        ...


def task_reward_fn(task: str) -> RewardFn:
    """The reward of a task by name, as the built-in reward scorer computes it
    (``synthetic``, ``gsm8k``, or ``math`` for file datasets): :func:`tapioca.tasks.base.task_reward`
    (raises ConfigError for an unknown task)."""
    from ..tasks.base import task_reward

    return task_reward(task)


def message_dict(message: Any) -> dict[str, Any]:
    """An assistant message of a chat completion as the dict to send back next turn
    (content and tool calls only: the fields every OpenAI-compatible server accepts)."""
    out: dict[str, Any] = {"role": "assistant", "content": message.content or ""}
    if getattr(message, "tool_calls", None):
        out["tool_calls"] = [{"id": c.id, "type": "function",
                              "function": {"name": c.function.name,
                                           "arguments": c.function.arguments}}
                             for c in message.tool_calls]
    return out
