"""End to end: groups made by the official ``openai`` SDK's Responses API and the
``anthropic`` SDK's Messages API through the proxy are trained.

``tapioca train``'s launcher with ``examples/online/online_cpu.yaml`` (the proxy, the
advantage processor and the trainer, each its own OS process, on a real embedded broker;
nothing feeds prompts) and a tiny model whose context holds a tools block. Three groups
of two sessions, one per SDK in each group: plain calls, streamed calls, then tools
declared with a tool result fed back (``function_call`` -> ``function_call_output``,
``tool_use`` -> ``tool_result``: the tiny random model never writes a tool call itself,
so the agent reports one; tests/integration/test_proxy_dialects.py covers the calls the
model writes), the last Responses session also taking a Messages turn of the same
conversation. Each session is rewarded (1 for the Responses one, 0 for the Messages one)
and ended; each group is one training step. Checked from the log: every group trained,
in a version of its own, with both dialects' trajectories.

Budget (the shared 2-core box): the launcher's ~15-25 s to start three processes and
load the model, ~10 HTTP calls, three steps of two short sequences.
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import anthropic
import openai
import pytest

from tapioca.bus import read_events
from tapioca.config.loader import load_config
from tapioca.config.schema import TrainConfig
from tapioca.ops.launcher import Launcher, role_counts
from tapioca.runtime.run import create_tiny_checkpoint
from tapioca.schemas import ProgressEvent, TrajectoryEvent

pytestmark = pytest.mark.e2e

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "online" / "online_cpu.yaml"
GROUPS = 3
TOOL = {"name": "calculator", "description": "Evaluate arithmetic",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}}}


def _post(base: str, path: str, body: dict, key: str) -> dict:
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), method="POST", headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _ready(base: str) -> bool:
    try:
        with urllib.request.urlopen(base.removesuffix("/v1") + "/health", timeout=10) as r:
            return bool(json.loads(r.read()).get("ready"))
    except (OSError, ValueError):
        return False


def responses_session(client: openai.OpenAI, k: int) -> None:
    ask = f"{k}+2="
    if k == 0:
        client.responses.create(model="tapioca", input=ask, max_output_tokens=4)
    elif k == 1:
        list(client.responses.create(model="tapioca", input=ask, max_output_tokens=4, stream=True))
    else:
        tools = [{"type": "function", **TOOL}]
        first = client.responses.create(model="tapioca", input=ask, tools=tools, max_output_tokens=4)
        client.responses.create(model="tapioca", tools=tools, max_output_tokens=4, input=[
            {"role": "user", "content": ask}, *[o.model_dump(exclude_none=True) for o in first.output],
            {"type": "function_call", "call_id": "agent_0", "name": "calculator",
             "arguments": json.dumps({"expression": ask[:-1]})},
            {"type": "function_call_output", "call_id": "agent_0", "output": str(k + 2)}])


def messages_session(client: anthropic.Anthropic, k: int) -> None:
    ask = f"{k}+3="
    if k == 0:
        client.messages.create(model="tapioca", max_tokens=4, messages=[{"role": "user", "content": ask}])
    elif k == 1:
        list(client.messages.create(model="tapioca", max_tokens=4, stream=True,
                                    messages=[{"role": "user", "content": ask}]))
    else:
        tools = [{"name": TOOL["name"], "description": TOOL["description"], "input_schema": TOOL["parameters"]}]
        first = client.messages.create(model="tapioca", max_tokens=4, tools=tools,
                                       messages=[{"role": "user", "content": ask}])
        client.messages.create(model="tapioca", max_tokens=4, tools=tools, messages=[
            {"role": "user", "content": ask},
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]
             + [{"type": "tool_use", "id": "agent_0", "name": "calculator", "input": {"expression": ask[:-1]}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "agent_0", "content": str(k + 3)}]}])


@pytest.fixture(scope="module")
def run(broker, tmp_path_factory, fast_join):
    model = create_tiny_checkpoint(tmp_path_factory.mktemp("model") / "tiny", task="gsm8k",
                                   max_position_embeddings=1024)
    cfg = load_config(TrainConfig, str(EXAMPLE), [
        f"run_dir={tmp_path_factory.mktemp('runs')}", "experiment_name=dialects-e2e", "trial_name=t0",
        f"total_train_steps={GROUPS}", f"bus.bootstrap_servers={broker.bootstrap}", *fast_join,
        f"bus.topic_prefix=dialects{uuid.uuid4().hex[:8]}", f"model.path={model}",
        "gconfig.max_new_tokens=4", "advantage.reward_timeout_s=600", "advantage.group_timeout_s=900",
    ])
    assert [r for r, _ in role_counts(cfg)] == ["trainer", "advantage", "proxy"]
    launcher = Launcher(cfg)
    groups: list[dict] = []
    started = time.monotonic()
    try:
        launcher.start()
        cfg = launcher.cfg
        base, admin = f"http://{cfg.proxy.host}:{cfg.proxy.port}/v1", cfg.proxy.admin_key()
        deadline = time.monotonic() + 300
        while not _ready(base):
            assert time.monotonic() < deadline, "the proxy did not become ready"
            time.sleep(0.5)
        for k in range(GROUPS):
            a = _post(base, "/sessions", {"group_size": 2, "task": "dialects"}, admin)
            b = _post(base, "/sessions", {"group_id": a["group_id"], "group_size": 2}, admin)
            responses_session(openai.OpenAI(base_url=base, api_key=a["api_key"], max_retries=0), k)
            claude = anthropic.Anthropic(base_url=base.removesuffix("/v1"), api_key=b["api_key"], max_retries=0)
            messages_session(claude, k)
            if k == GROUPS - 1:  # the Responses session takes a Messages turn too
                anthropic.Anthropic(base_url=base.removesuffix("/v1"), api_key=a["api_key"], max_retries=0) \
                    .messages.create(model="tapioca", max_tokens=4, messages=[{"role": "user", "content": "1+1="}])
            for s, reward in ((a, 1.0), (b, 0.0)):
                _post(base, f"/sessions/{s['session_id']}/reward", {"reward": reward}, s["api_key"])
                ended = _post(base, f"/sessions/{s['session_id']}/end", {"mode": "per_completion"}, s["api_key"])
            assert ended["published"] and ended["group_ended"], ended
            groups.append({"group_id": a["group_id"], "sessions": (a["session_id"], b["session_id"])})
        summary = launcher.wait(timeout_s=600)
    except BaseException:
        for child in launcher.children:
            print(f"--- {child.label} ---\n{child.log_tail(40)}")
        raise
    finally:
        launcher.stop()
    return cfg, summary, groups, time.monotonic() - started


def test_groups_of_both_sdks_train(run):
    cfg, summary, groups, wall = run
    print(f"\n{GROUPS} groups of the Responses + Messages SDKs trained in {summary.steps} steps, {wall:.0f} s")
    assert summary.steps == GROUPS
    ours = {g["group_id"] for g in groups}
    trained: dict[int, list[str]] = {}
    for e in read_events(cfg.bus, "progress"):
        if isinstance(e, ProgressEvent) and e.run_id == cfg.bus.run_id and e.group_ids:
            trained.setdefault(e.version, list(e.group_ids))
    assert sorted(g for gs in trained.values() for g in gs) == sorted(ours), trained
    trajs = [t for t in read_events(cfg.bus, "trajectories") if isinstance(t, TrajectoryEvent)
             and t.group_id in ours]
    for g in groups:
        mine = [t for t in trajs if t.group_id == g["group_id"]]
        # Both sessions (both dialects) are in the group; per_completion: one per call.
        assert {t.session_id for t in mine} == set(g["sessions"])
        assert all(sum(t.loss_mask) >= 1 and t.group_size == len(mine) for t in mine)
    last = [t for t in trajs if t.group_id == groups[-1]["group_id"]]
    assert len(last) == 5  # Responses: 2 calls + 1 Messages turn; Messages: 2 calls
