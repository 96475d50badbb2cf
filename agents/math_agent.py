"""The multi-turn math agent: answer, hear "wrong, try again", retry, up to k turns.

Consumes a dataset record (``messages`` or ``prompt``, ``answer``, ``task``) and talks
to the proxy through the official ``openai`` SDK only (``chat.completions.create``, one
choice per call). Emits an :class:`~tapioca.agents.episode.Episode`: the last answer's
score (1 when correct; else the task's partial credit, normally 0) is set on the last
completion, and the session ends with ``discount = turn_discount``, so the proxy turns
it into ``score * turn_discount ** t`` for an episode whose last answer came at turn
``t`` (0-based): solving it at once is worth most, a later fix still beats giving up.
Ended in ``concat`` mode the session becomes one trajectory whose loss mask covers the
model's tokens of every turn, all trained with that return; in ``per_completion`` mode
an earlier (wrong) answer gets the return discounted once more per turn it is away.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ..schemas.errors import ConfigError
from .episode import Episode, RewardFn, task_reward_fn


@dataclass
class MathAgent:
    max_turns: int = 3
    turn_discount: float = 0.5
    feedback: str = "wrong, try again"
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    # None: each record's own task reward (``record["task"]``).
    reward_fn: RewardFn | None = None
    _rewards: dict[str, RewardFn] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.max_turns < 1:
            raise ConfigError("agent.max_turns must be >= 1")
        if not 0 < self.turn_discount <= 1:
            raise ConfigError("agent.turn_discount must be in (0, 1]")

    def _reward(self, record: Mapping[str, Any]) -> RewardFn:
        if self.reward_fn is not None:
            return self.reward_fn
        task = str(record.get("task", ""))
        if task not in self._rewards:
            self._rewards[task] = task_reward_fn(task)
        return self._rewards[task]

    async def run(self, client: Any, model: str, record: Mapping[str, Any]) -> Episode:
        reward_fn = self._reward(record)
        messages: list[dict[str, Any]] = [dict(m) for m in record.get("messages") or
                                          [{"role": "user", "content": record["prompt"]}]]
        score, turn = 0.0, 0
        for turn in range(self.max_turns):
            resp = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=self.max_tokens,
                temperature=self.temperature, top_p=self.top_p, n=1)
            text = resp.choices[0].message.content or ""
            messages.append({"role": "assistant", "content": text})
            score = float(reward_fn(text, record))
            if score >= 1.0 or turn + 1 == self.max_turns:
                break
            messages.append({"role": "user", "content": self.feedback})
        # None: the score goes on the session's last completion, i.e. this last answer.
        return Episode(score * self.turn_discount ** turn, turn + 1, [(None, score)],
                       discount=self.turn_discount, messages=messages,
                       info={"solved_at_turn": turn if score >= 1.0 else None})
