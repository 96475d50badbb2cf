"""The agent workflows' control flow, against a scripted chat client that returns real
``openai`` response objects: the math agent retries after feedback and discounts its
reward per turn; the TIR agent runs the tools the model calls and sends the results back
as tool messages with the call ids; the command agent runs a program with the session's
OpenAI settings in its environment. (The same agents against the real proxy: the e2e
test ``tests/e2e/test_agent_rl.py``.)"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from typing import Any

import pytest
from openai.types.chat import ChatCompletion

from tapioca.agents.command_agent import AgentCommandError, CommandAgent
from tapioca.agents.math_agent import MathAgent
from tapioca.agents.tir_agent import TIRAgent
from tapioca.agents.tools import Calculator, PythonExecutor, Toolbox
from tapioca.schemas.errors import ConfigError


def completion(i: int, content: str | None, tool_calls: list[dict] | None = None) -> ChatCompletion:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if tool_calls:
        message["tool_calls"] = [{"id": f"call_{i}_{j}", "type": "function",
                                  "function": {"name": c["name"],
                                               "arguments": json.dumps(c["arguments"])}}
                                 for j, c in enumerate(tool_calls)]
    return ChatCompletion.model_validate({
        "id": f"chatcmpl-{i}", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "finish_reason": "tool_calls" if tool_calls else "stop",
                     "message": message}]})


class ScriptedClient:
    """``client.chat.completions.create(**kw)`` returns the next scripted reply and keeps
    a copy of every request."""

    def __init__(self, replies: list[ChatCompletion]) -> None:
        self.replies = list(replies)
        self.requests: list[dict[str, Any]] = []
        self.chat = self
        self.completions = self

    async def create(self, **kwargs: Any) -> ChatCompletion:
        self.requests.append(json.loads(json.dumps(kwargs)))
        return self.replies.pop(0)


RECORD = {"task": "synthetic", "prompt": "max(3,7)=", "answer": "7",
          "messages": [{"role": "user", "content": "max(3,7)="}]}


def test_math_agent_retries_after_feedback_and_discounts():
    client = ScriptedClient([completion(0, "3"), completion(1, "7")])
    agent = MathAgent(max_turns=3, turn_discount=0.5, feedback="wrong, try again")
    ep = asyncio.run(agent.run(client, "m", RECORD))
    assert ep.turns == 2 and ep.reward == 0.5
    # the raw score goes on the last completion; the proxy discounts it by turns
    assert ep.rewards == [(None, 1.0)] and ep.discount == 0.5
    second = client.requests[1]["messages"]
    assert second == [{"role": "user", "content": "max(3,7)="},
                      {"role": "assistant", "content": "3"},
                      {"role": "user", "content": "wrong, try again"}]
    assert all(r["n"] == 1 for r in client.requests)


def test_math_agent_first_try_and_give_up():
    ep = asyncio.run(MathAgent(max_turns=2).run(ScriptedClient([completion(0, "7")]), "m", RECORD))
    assert (ep.turns, ep.reward) == (1, 1.0)
    client = ScriptedClient([completion(0, "1"), completion(1, "2")])
    ep = asyncio.run(MathAgent(max_turns=2).run(client, "m", RECORD))
    assert (ep.turns, ep.reward, ep.rewards) == (2, 0.0, [(None, 0.0)])
    # no feedback after the last attempt
    assert [m["role"] for m in ep.messages] == ["user", "assistant", "user", "assistant"]


def test_math_agent_rejects_bad_settings():
    with pytest.raises(ConfigError):
        MathAgent(max_turns=0)
    with pytest.raises(ConfigError):
        MathAgent(turn_discount=0.0)


def test_tir_agent_runs_tools_and_returns_results_as_tool_messages():
    client = ScriptedClient([
        completion(0, "let me compute", [{"name": "calculator", "arguments": {"expression": "6*7"}},
                                         {"name": "python", "arguments": {"code": "print(2**5)"}}]),
        completion(1, None, [{"name": "calculator", "arguments": {"expression": "import os"}}]),
        completion(2, "The answer is \\boxed{42}."),
    ])
    agent = TIRAgent(toolbox=Toolbox.of(Calculator(), PythonExecutor(timeout_s=3, memory_mb=256)),
                     max_tool_rounds=3, tool_error_penalty=0.1)
    ep = asyncio.run(agent.run(client, "m", {"task": "math", "prompt": "6 times 7?", "answer": "42"}))
    assert ep.info == {"tool_calls": 3, "tool_errors": 1, "correct": 1.0}
    assert ep.reward == pytest.approx(0.9) and ep.turns == 3
    # every request offers the tools; only the last round forbids calls
    assert [t["function"]["name"] for t in client.requests[0]["tools"]] == ["calculator", "python"]
    second = client.requests[1]["messages"]
    assert second[0]["role"] == "system"
    assert second[2]["role"] == "assistant" and second[2]["tool_calls"][0]["id"] == "call_0_0"
    assert second[3] == {"role": "tool", "tool_call_id": "call_0_0", "content": "42"}
    assert second[4] == {"role": "tool", "tool_call_id": "call_0_1", "content": "32"}
    third = client.requests[2]["messages"]
    assert third[-1]["tool_call_id"] == "call_1_0" and third[-1]["content"].startswith("Error:")


def test_tir_agent_forces_an_answer_after_max_rounds():
    call = [{"name": "calculator", "arguments": {"expression": "1+1"}}]
    client = ScriptedClient([completion(0, None, call), completion(1, "2")])
    ep = asyncio.run(TIRAgent(toolbox=Toolbox.of(Calculator()), max_tool_rounds=1,
                              reward_fn=lambda text, rec: float(text == "2")).run(client, "m", RECORD))
    # the forced last round keeps the same tools (same rendered system prompt, so the
    # concat trajectory keeps turn 1) and only forbids calls
    assert client.requests[1]["tools"] == client.requests[0]["tools"]
    assert "tool_choice" not in client.requests[0] and client.requests[1]["tool_choice"] == "none"
    assert ep.reward == 1.0 and ep.turns == 2


class FakeSessionClient:
    base_url = "http://127.0.0.1:9/v1/"
    api_key = "sess-key-123"


def test_command_agent_runs_the_program_with_the_session_settings(tmp_path):
    script = tmp_path / "agent.py"
    script.write_text("import os, sys\n"
                      "assert os.environ['OPENAI_API_KEY'] == 'sess-key-123'\n"
                      "assert os.environ['OPENAI_BASE_URL'] == 'http://127.0.0.1:9/v1'\n"
                      "print(sys.argv[-1].split(',')[1].rstrip(')='))\n")
    agent = CommandAgent(command=f"{sys.executable} {script}")
    ep = asyncio.run(agent.run(FakeSessionClient(), "m", RECORD))
    assert ep.info["answer"] == "7" and ep.reward == 1.0 and ep.rewards == [(None, 1.0)]
    bad = CommandAgent(command=f"{sys.executable} -c 'raise SystemExit(3)'")
    with pytest.raises(AgentCommandError, match="exited with 3"):
        asyncio.run(bad.run(FakeSessionClient(), "m", RECORD))
    with pytest.raises(ConfigError):
        CommandAgent(command=" ")


def test_command_agent_runs_python_with_this_interpreter():
    agent = CommandAgent(command="python -c 'import sys; print(sys.executable)'",
                         reward_fn=lambda text, rec: 0.0)
    assert agent.argv()[0] == sys.executable
    ep = asyncio.run(agent.run(FakeSessionClient(), "m", RECORD))
    assert ep.info["answer"] == sys.executable


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (killed, not yet reaped by its reaper) counts as dead
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _spawning_agent(tmp_path, timeout_s: float) -> tuple[CommandAgent, Any]:
    """An agent program that forks a child (recording its pid) and hangs."""
    pidfile = tmp_path / "child.pid"
    script = tmp_path / "hang.py"
    script.write_text("import subprocess, sys, time\n"
                      "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                      f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
                      "time.sleep(60)\n")
    return CommandAgent(command=f"python {script}", timeout_s=timeout_s), pidfile


def _wait_dead(pid: int, within_s: float = 5.0) -> bool:
    import time

    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_command_agent_timeout_kills_the_whole_process_group(tmp_path):
    agent, pidfile = _spawning_agent(tmp_path, timeout_s=1.5)
    with pytest.raises(AgentCommandError, match="ran longer than"):
        asyncio.run(agent.run(FakeSessionClient(), "m", RECORD))
    assert _wait_dead(int(pidfile.read_text())), "the agent's child survived the timeout"


def test_command_agent_cancellation_kills_the_whole_process_group(tmp_path):
    agent, pidfile = _spawning_agent(tmp_path, timeout_s=60)

    async def cancel_after_start():
        task = asyncio.create_task(agent.run(FakeSessionClient(), "m", RECORD))
        for _ in range(200):
            await asyncio.sleep(0.05)
            if pidfile.exists() and pidfile.read_text():
                break
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_after_start())
    assert _wait_dead(int(pidfile.read_text())), "the agent's child survived the cancellation"


def test_session_start_waits_at_the_head_gate_without_a_read_timeout():
    """POST /sessions is held by the proxy while the head gate is shut (possibly longer
    than agent.request_timeout_s): only the connect phase is timed; other calls keep
    the client's timeout. The pool is the openai SDK's own client class."""
    import openai

    from tapioca.agents.runner import SessionClient, httpx

    class Recorder:
        def __init__(self):
            self.calls = []

        async def post(self, url, **kw):
            self.calls.append((url, kw))
            return httpx.Response(200, json={"session_id": "s", "api_key": "k"})

    http = Recorder()
    sessions = SessionClient(http, "http://proxy/v1", "admin")
    asyncio.run(sessions.start(group_id="g", group_size=2, sample_index=0, task="t", task_data={}))
    asyncio.run(sessions.end("s", "k"))
    (url, kw), (_, end_kw) = http.calls
    assert url == "http://proxy/v1/sessions"
    assert kw["timeout"].read is None and kw["timeout"].connect == 30.0
    assert "timeout" not in end_kw
    assert isinstance(openai.DefaultAsyncHttpxClient(), httpx.AsyncClient)


def test_agent_config_and_agent_mode_roles(tmp_path):
    from tapioca.config.schema import AgentConfig, ProxyConfig, TrainConfig
    from tapioca.ops.launcher import role_command, role_counts
    from tapioca.runtime.run import resolve_run

    for bad in ({"workflow": "chat"}, {"workers": -1}, {"max_turns": 0}, {"turn_discount": 0.0},
                {"end_mode": "split"}, {"workflow": "command", "command": ""},
                {"max_consecutive_failures": -1}):
        with pytest.raises(ConfigError):
            AgentConfig(**bad)
    cfg = TrainConfig()
    assert [r for r, _ in role_counts(cfg)] == ["trainer", "advantage", "reward", "rollout", "feeder"]
    cfg = TrainConfig(agent=AgentConfig(enabled=True, workers=2))
    assert role_counts(cfg) == [("trainer", 1), ("advantage", 1), ("proxy", 1), ("agent", 2)]
    assert role_command("agent", 1, "run.yaml")[1:] == ["-m", "tapioca.agents.runner", "--config",
                                                       "run.yaml", "--member", "1"]
    assert role_command("proxy", 0, "run.yaml")[1:4] == ["-m", "tapioca.ops.cli", "proxy"]
    cfg = TrainConfig(agent=cfg.agent, proxy=ProxyConfig(port=0, api_key=""), run_dir=str(tmp_path))
    cfg = resolve_run(cfg, proxy_endpoint=True)  # both sides must read the same port and key
    assert cfg.proxy.port > 0 and len(cfg.proxy.admin_key()) > 20


def test_proxy_admin_key_is_in_an_owner_only_file_not_in_the_run_config(tmp_path):
    """The run's config.yaml is not secret: it names the key's file, which only the
    run's user can read."""
    import stat

    from tapioca.config.loader import load_config, to_yaml
    from tapioca.config.schema import AgentConfig, ProxyConfig, TrainConfig
    from tapioca.runtime.run import resolve_run
    from tapioca.schemas.errors import ConfigError

    cfg = TrainConfig(run_dir=str(tmp_path), trial_name="t", agent=AgentConfig(enabled=True))
    cfg = resolve_run(cfg, proxy_endpoint=True)
    key = cfg.proxy.admin_key()
    written = to_yaml(cfg)
    assert key and key not in written
    key_file = cfg.proxy.api_key_file
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(key_file)).st_mode) == 0o700
    (tmp_path / "run.yaml").write_text(written)
    assert load_config(TrainConfig, tmp_path / "run.yaml").proxy.admin_key() == key
    os.chmod(key_file, 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        ProxyConfig(api_key_file=key_file).admin_key()
    with pytest.raises(ConfigError, match="not both"):
        ProxyConfig(api_key="k", api_key_file=key_file)
