"""Train an existing agent program, unmodified: run it as a subprocess pointed at the
proxy, score what it prints.

Consumes a dataset record; runs ``command`` (a shell-style string, split with
:func:`shlex.split`) with the record's prompt text as its last argument and the
environment every OpenAI client reads: ``OPENAI_BASE_URL`` (the proxy's ``/v1``),
``OPENAI_API_KEY`` (this episode's session key) and ``OPENAI_MODEL``. Whatever chat
calls the program makes land in the session; its stdout is the answer the task's reward
scores. A leading ``python``/``python3`` runs with this interpreter; the program
runs in its own session, and a timeout or a cancelled episode kills its whole process
group. The program needs no Tapioca code: changing the base URL and the key is the
whole integration (``examples/agents/openai_agent.py`` is such a program).
"""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
import sys
from dataclasses import dataclass
from typing import Any, Mapping

from ..schemas.errors import ConfigError
from .episode import Episode, RewardFn, task_reward_fn


class AgentCommandError(ConfigError):
    """The agent program could not run or exited with an error."""


@dataclass
class CommandAgent:
    command: str
    timeout_s: float = 600.0
    reward_fn: RewardFn | None = None

    def __post_init__(self) -> None:
        if not self.command.strip():
            raise ConfigError("agent.command is empty; set it to the agent program to run, "
                              "e.g. 'python examples/agents/openai_agent.py'")

    def argv(self) -> list[str]:
        """The command split shell-style; a leading ``python`` / ``python3`` becomes this
        interpreter (``sys.executable``), so the program sees the same environment."""
        argv = shlex.split(self.command)
        if argv and argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        return argv

    async def run(self, client: Any, model: str, record: Mapping[str, Any]) -> Episode:
        reward_fn = self.reward_fn or task_reward_fn(str(record.get("task", "")))
        prompt = record.get("prompt") or record["messages"][-1]["content"]
        env = {**os.environ, "OPENAI_BASE_URL": str(client.base_url).rstrip("/"),
               "OPENAI_API_KEY": client.api_key, "OPENAI_MODEL": model}
        try:
            # Its own session: a timeout or a cancelled episode kills everything it started.
            proc = await asyncio.create_subprocess_exec(
                *self.argv(), str(prompt), env=env, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                start_new_session=True)
        except OSError as exc:
            raise AgentCommandError(f"cannot run agent.command {self.command!r}: {exc}") from None
        try:
            out, err = await asyncio.wait_for(proc.communicate(), self.timeout_s)
        except asyncio.TimeoutError:
            raise AgentCommandError(f"{self.command!r} ran longer than {self.timeout_s:g} s") from None
        finally:
            # Normally a no-op (the program exited); after a timeout or a cancellation
            # it kills the program and anything it forked.
            _kill_group(proc.pid)
            if proc.returncode is None:
                try:
                    await asyncio.wait_for(asyncio.shield(proc.wait()), 5.0)
                except (asyncio.TimeoutError, asyncio.CancelledError):
                    pass
        if proc.returncode != 0:
            raise AgentCommandError(f"{self.command!r} exited with {proc.returncode}: "
                                    f"{err.decode(errors='replace')[-500:]}")
        answer = out.decode(errors="replace").strip()
        reward = float(reward_fn(answer, record))
        # The program's completions are all in the session; the reward goes on the last.
        return Episode(reward, 1, [(None, reward)], info={"answer": answer})


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
