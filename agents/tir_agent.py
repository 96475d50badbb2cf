"""Tool-integrated reasoning: the model may call a Python executor and a calculator
before it answers.

Consumes a dataset record (``messages`` or ``prompt``, ``answer``, ``task``). Each turn
is one ``chat.completions.create`` with ``tools=`` the toolbox's specs (every round, the
last one with ``tool_choice="none"``) through the official ``openai`` SDK; the proxy parses the model's Qwen-style
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks into ``tool_calls``.
The agent runs each call (:mod:`tapioca.agents.tools`, in a worker thread so the event
loop keeps serving the other episodes) and sends the result back as a ``tool`` message
with the call's id. The first reply without tool calls is the final answer, scored by
the task's reward; ``tool_error_penalty`` is subtracted once per call that failed (an
unknown tool, bad arguments, code that raised or timed out), and the episode ends with
reward 0 if the forced last round still produced no answer.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Mapping

from ..schemas.errors import ConfigError
from .episode import Episode, RewardFn, message_dict, task_reward_fn
from .tools import Calculator, PythonExecutor, Toolbox

SYSTEM_PROMPT = ("You can call tools to compute. Think step by step, call the python or "
                 "calculator tool when arithmetic is involved, then give the final answer "
                 "as \\boxed{...}.")


def default_toolbox(timeout_s: float = 5.0, memory_mb: int = 512, max_processes: int = 32,
                    sandbox: str = "namespace") -> Toolbox:
    return Toolbox.of(PythonExecutor(timeout_s=timeout_s, memory_mb=memory_mb, max_processes=max_processes,
                                     sandbox=sandbox), Calculator())


@dataclass
class TIRAgent:
    toolbox: Toolbox = field(default_factory=default_toolbox)
    max_tool_rounds: int = 4
    system_prompt: str = SYSTEM_PROMPT
    max_tokens: int = 512
    temperature: float = 1.0
    top_p: float = 1.0
    tool_error_penalty: float = 0.0
    reward_fn: RewardFn | None = None

    def __post_init__(self) -> None:
        if self.max_tool_rounds < 0:
            raise ConfigError("agent.max_tool_rounds must be >= 0")
        if not self.toolbox.tools:
            raise ConfigError("TIRAgent needs at least one tool")

    async def run(self, client: Any, model: str, record: Mapping[str, Any]) -> Episode:
        reward_fn = self.reward_fn or task_reward_fn(str(record.get("task", "")))
        messages: list[dict[str, Any]] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages += [dict(m) for m in record.get("messages") or
                     [{"role": "user", "content": record["prompt"]}]]
        calls = failed = 0
        for round_ in range(self.max_tool_rounds + 1):
            # Every round sends the same tools, so the rendered system prompt (which
            # lists them) stays a prefix of the next turn's and the concat trajectory
            # keeps every turn; the last round says tool_choice="none": the model must
            # answer (the proxy renders the tools but parses no calls).
            kwargs: dict[str, Any] = {"tools": self.toolbox.specs()}
            if round_ == self.max_tool_rounds:
                kwargs["tool_choice"] = "none"
            resp = await client.chat.completions.create(
                model=model, messages=messages, max_tokens=self.max_tokens,
                temperature=self.temperature, top_p=self.top_p, n=1, **kwargs)
            message = resp.choices[0].message
            messages.append(message_dict(message))
            if not message.tool_calls:
                score = float(reward_fn(message.content or "", record))
                reward = score - self.tool_error_penalty * failed
                return Episode(reward, round_ + 1, [(None, reward)], messages=messages,
                               info={"tool_calls": calls, "tool_errors": failed, "correct": score})
            for call in message.tool_calls:
                result = await asyncio.to_thread(self.toolbox.call, call.function.name,
                                                 call.function.arguments)
                calls += 1
                failed += 0 if result.ok else 1
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": result.output})
        reward = -self.tool_error_penalty * failed
        return Episode(reward, self.max_tool_rounds + 1, [(None, reward)], messages=messages,
                       info={"tool_calls": calls, "tool_errors": failed, "correct": 0.0})
