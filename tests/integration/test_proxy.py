"""The agent proxy over loopback: the official `openai` SDK against a real proxy server
(uvicorn on 127.0.0.1, the tiny model in the in-process engine, the real embedded
broker). Checks chat (plain, streaming, n > 1, tools), session isolation and limits,
the trajectories a multi-turn group publishes (loss masks, token alignment with a
re-tokenised conversation, discounted rewards) and the head gate holding a session
until a weights event frees a slot. The proxies come from conftest's ``start_proxy``.

The tiny random model cannot be made to write a tool call, so the tool-call replies of
``test_tool_call_replies_streamed_and_not`` come from a scripted engine (an
``InferenceEngine`` that replays fixed output ids); everything else there (HTTP, SSE,
the SDK, sessions, the broker) is the real thing.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from tapioca.bus.producer import EventProducer
from tapioca.bus.reader import read_events
from tapioca.config.schema import GenerationConfig, ProxyConfig
from tapioca.config.sections import ProxySection
from tapioca.engines.base import GenRequest, GenResult, InferenceEngine
from tapioca.models.tokenizer import load_tokenizer
from tapioca.producers.proxy import ProxyServer, ProxyService
from tapioca.runtime.run import create_tiny_checkpoint
from tapioca.schemas.events import ProgressEvent, RewardEvent, TrajectoryEvent, WeightsEvent
from tapioca.weights.files import save_weights

pytestmark = pytest.mark.integration

ADMIN = "test-admin-key"
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # The printable alphabet, so tool JSON and chat text encode as themselves, and a
    # context long enough for a tools block.
    return str(create_tiny_checkpoint(tmp_path_factory.mktemp("proxy") / "model", task="gsm8k",
                                      max_position_embeddings=2048))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def proxy(start_proxy, model_dir):
    return start_proxy(model_dir, api_key=ADMIN, gconfig__n_samples=2, gconfig__max_new_tokens=6,
                       train_dataset__prompts_per_step=1000, proxy__max_request_bytes=64 * 1024,
                       proxy__max_tokens_per_request=1500, proxy__max_tokens_per_session=3000)


def _post(base_url: str, path: str, body, key: str | None, raw: bytes | None = None):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(base_url + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _session(server, **body):
    status, out = _post(server.base_url, "/sessions", body, ADMIN)
    assert status == 200, out
    return out


def _client(server, session) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=session["api_key"], max_retries=0)


def _assert_openai_error(status, body, expected_status):
    assert status == expected_status, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]


def test_models_and_chat(proxy):
    server, _ = proxy
    client = _client(server, _session(server, group_size=1))
    assert [m.id for m in client.models.list().data] == ["tapioca"]
    assert client.models.retrieve("tapioca").id == "tapioca"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    out = client.chat.completions.create(model="tapioca", messages=[{"role": "user", "content": "2+3="}],
                                         max_tokens=5, temperature=1.0)
    assert out.object == "chat.completion" and len(out.choices) == 1
    choice = out.choices[0]
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens == len("<bos>2+3=") - 4  # <bos> is one token
    assert 1 <= out.usage.completion_tokens <= 5
    # Timed for the status row (tapioca_proxy_call_latency_seconds): every call within the
    # largest bucket, the sum positive.
    counts = server.svc.session_counts()
    assert counts["calls"] >= 1 and counts["call_latency_le_120"] == counts["calls"]
    assert counts["call_latency_sum_s"] > 0


def test_session_wrapper_with_a_wrong_admin_key_is_a_one_line_error(proxy):
    """examples/agents/session_wrapper.py against the real proxy with a key it refuses:
    one line that says what to pass, no stack trace."""
    import subprocess
    import sys
    from pathlib import Path

    server, _ = proxy
    wrapper = Path(__file__).resolve().parents[2] / "examples" / "agents" / "session_wrapper.py"
    proc = subprocess.run([sys.executable, str(wrapper), "--proxy", server.base_url, "--admin-key",
                           "not-the-key", "--question", "max(3,7)=", "--answer", "7", "--wait-s",
                           "30", "--", sys.executable, "-c", "print(7)"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: the proxy at {server.base_url} refused /models (HTTP 401"), \
        lines[0]
    assert "--admin-key or $TAPIOCA_PROXY_KEY" in lines[0] and "proxy-admin.key" in lines[0]


def test_streaming_and_n(proxy):
    server, _ = proxy
    client = _client(server, _session(server, group_size=1))
    chunks = list(client.chat.completions.create(
        model="tapioca", messages=[{"role": "user", "content": "7*6="}], max_tokens=5, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals and finals[-1] in ("stop", "length")
    assert chunks[-1].usage is not None and 1 <= chunks[-1].usage.completion_tokens <= 5
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert len(streamed) <= 5  # one character per token at most (char tokenizer)

    many = client.chat.completions.create(model="tapioca", messages=[{"role": "user", "content": "1+1="}],
                                          n=3, max_tokens=4, logprobs=True)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert sum(len(c.logprobs.content) for c in many.choices) == many.usage.completion_tokens
    assert all(t.logprob < 0 for c in many.choices for t in c.logprobs.content)
    assert many.usage.completion_tokens <= 12
    text = client.completions.create(model="tapioca", prompt="9-4=", max_tokens=3, n=2)
    assert len(text.choices) == 2 and all(isinstance(c.text, str) for c in text.choices)


def test_tools_are_rendered_into_the_prompt(proxy, tokenizer, wait_until):
    server, bus = proxy
    session = _session(server, group_size=1, task="calc")
    client = _client(server, session)
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "What is 12*7?"}]
    first = client.chat.completions.create(model="tapioca", messages=messages, tools=TOOLS, max_tokens=4)
    # The agent reports a tool call it made itself (not one the proxy generated): it is
    # rendered Qwen-style, and the tool's result comes back as a <tool_response>.
    messages += [{"role": "assistant", "content": None, "tool_calls": [{
                     "id": "call_agent_0", "type": "function",
                     "function": {"name": "calculator", "arguments": '{"expression": "12*7"}'}}]},
                 {"role": "tool", "tool_call_id": "call_agent_0", "content": "84"}]
    client.chat.completions.create(model="tapioca", messages=messages, tools=TOOLS, max_tokens=4)
    status, ended = _post(server.base_url, f"/sessions/{session['session_id']}/end",
                          {"mode": "per_completion"}, session["api_key"])
    assert status == 200 and ended["published"] and len(ended["traj_ids"]) == 2
    trajs = _wait_trajectories(bus, session["group_id"], 2, wait_until)
    rendered = [tokenizer.decode(t.prompt_ids + t.output_ids[:t.loss_mask.index(1)]) for t in trajs]
    for text in rendered:
        assert text.startswith("<bos>You are terse.\n\n# Tools")
        assert '"name": "calculator"' in text and "<tool_call></tool_call>" in text
    assert '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call><eos>' \
        "<tool_response>\n84\n</tool_response>" in rendered[1]
    assert first.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_session_isolation_and_bad_requests(proxy):
    server, _ = proxy
    a, b = _session(server, group_size=1), _session(server, group_size=1)
    _client(server, a).chat.completions.create(model="tapioca", messages=[{"role": "user", "content": "1="}],
                                               max_tokens=2)
    # A's key cannot touch B's session; unknown keys are 401.
    _assert_openai_error(*_post(server.base_url, f"/sessions/{b['session_id']}/reward", {"reward": 1.0},
                                a["api_key"]), 403)
    _assert_openai_error(*_post(server.base_url, f"/sessions/{b['session_id']}/end", {}, a["api_key"]), 403)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url, api_key="tpk-nope", max_retries=0).models.list()
    _assert_openai_error(*_post(server.base_url, "/sessions", {}, a["api_key"]), 401)  # not the admin key
    _assert_openai_error(*_post(server.base_url, "/chat/completions", {}, None), 401)
    # Malformed and oversized bodies.
    _assert_openai_error(*_post(server.base_url, "/chat/completions", None, a["api_key"], raw=b"{not json"), 400)
    _assert_openai_error(*_post(server.base_url, "/chat/completions", {"messages": "hi"}, a["api_key"]), 400)
    huge = {"messages": [{"role": "user", "content": "x" * (70 * 1024)}]}
    _assert_openai_error(*_post(server.base_url, "/chat/completions", huge, a["api_key"]), 413)
    client = _client(server, a)
    with pytest.raises(openai.BadRequestError) as err:  # prompt + 2 x 760 > 1500
        client.chat.completions.create(model="tapioca", messages=[{"role": "user", "content": "1="}],
                                       n=2, max_tokens=760)
    assert err.value.code == "request_token_limit"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tapioca", messages=[{"role": "user", "content": "1="}],
                                       temperature=-1)
    # An ended session's key stops working.
    assert _post(server.base_url, f"/sessions/{a['session_id']}/end", {}, a["api_key"])[0] == 200
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def _wait_trajectories(bus, group_id, n, wait_until):
    found: list[TrajectoryEvent] = []

    def ready():
        nonlocal found
        found = [e for e in read_events(bus, "trajectories", idle_s=0.3)
                 if isinstance(e, TrajectoryEvent) and e.group_id == group_id]
        return len(found) >= n

    wait_until(ready, timeout_s=20, what=f"{n} trajectories of {group_id}")
    return sorted(found, key=lambda t: t.sample_index)


def test_multi_turn_group_trajectories(proxy, tokenizer, wait_until):
    """Two sessions of one group, two turns each: one ends concat, one per_completion."""
    server, bus = proxy
    first = _session(server, group_size=2, task="max", task_data={"answer": "4"})
    second = _session(server, group_id=first["group_id"], group_size=2)
    assert second["group_id"] == first["group_id"] and second["sample_index"] == 1
    conversations, usages = [], []
    for s in (first, second):
        client = _client(server, s)
        messages = [{"role": "user", "content": "max(3,4)="}]
        used = []
        for follow_up in ("Try again: ", None):
            out = client.chat.completions.create(model="tapioca", messages=messages, max_tokens=6)
            messages.append({"role": "assistant", "content": out.choices[0].message.content})
            used.append((out.usage.completion_tokens, out.choices[0].finish_reason))
            if follow_up:
                messages.append({"role": "user", "content": follow_up})
        conversations.append(messages)
        usages.append(used)
        if s is first:  # before the end the last reward wins, and the reply says what it replaced
            status, early = _post(server.base_url, f"/sessions/{s['session_id']}/reward", {"reward": 0.3},
                                  s["api_key"])
            assert status == 200 and early["replaced"] == {}, early
        status, rewarded = _post(server.base_url, f"/sessions/{s['session_id']}/reward", {"reward": 1.0},
                                 s["api_key"])
        assert status == 200
        if s is first:
            assert rewarded["replaced"] == {rewarded["completion_ids"][0]: 0.3}, rewarded
    status, end1 = _post(server.base_url, f"/sessions/{first['session_id']}/end",
                         {"mode": "concat", "discount": 0.5}, first["api_key"])
    assert status == 200 and end1["rewards"] == [0.5] and not end1["published"]
    # The ended session (its group still open) takes no more rewards, not even by the admin.
    _assert_openai_error(*_post(server.base_url, f"/sessions/{first['session_id']}/reward",
                                {"reward": 2.0}, ADMIN), 409)
    status, end2 = _post(server.base_url, f"/sessions/{second['session_id']}/end",
                         {"mode": "per_completion", "discount": 0.5}, ADMIN)
    assert status == 200 and end2["rewards"] == [0.5, 1.0] and end2["published"]

    trajs = _wait_trajectories(bus, first["group_id"], 3, wait_until)
    assert [t.traj_id for t in trajs] == end1["traj_ids"] + end2["traj_ids"]
    assert all(t.group_size == 3 and t.task == "max" for t in trajs)
    assert len({tuple(t.prompt_ids) for t in trajs}) == 1  # one shared prompt for the group

    concat = trajs[0]
    # Re-tokenising the conversation with the chat template reproduces the recorded ids.
    text = tokenizer.apply_chat_template(conversations[0], tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    recorded = concat.prompt_ids + concat.output_ids
    last_tokens, last_finish = usages[0][-1]
    # The template closes the last turn with <eos>; a length-capped turn never generated it.
    assert recorded == (ids[:-1] if last_finish == "length" else ids)
    assert sum(concat.loss_mask) == sum(n for n, _ in usages[0])
    b0, b1 = concat.turn_boundaries
    n0 = usages[0][0][0]
    assert b0 == 0 and concat.loss_mask[:n0] == [1] * n0
    assert concat.loss_mask[b1:] == [1] * last_tokens and b1 + last_tokens == len(concat.output_ids)
    between = concat.output_ids[n0:b1]
    assert set(concat.loss_mask[n0:b1]) == {0}
    assert tokenizer.decode(between).endswith("Try again: ")
    assert all(concat.output_logprobs[i] == 0.0 for i in range(n0, b1))
    assert all(concat.output_logprobs[i] < 0 for i, m in enumerate(concat.loss_mask) if m)
    assert len(concat.output_versions) == len(concat.output_ids)

    # per_completion: the second turn's context moved into the output, masked.
    p1, p2 = trajs[1], trajs[2]
    assert sum(p1.loss_mask) == len(p1.output_ids) == usages[1][0][0]
    assert sum(p2.loss_mask) == usages[1][1][0] and p2.loss_mask[-1] == 1
    assert tokenizer.decode(p2.output_ids[:p2.loss_mask.index(1)]).endswith("Try again: ")

    rewards = {e.traj_id: e for e in read_events(bus, "rewards", idle_s=0.3) if isinstance(e, RewardEvent)}
    assert [rewards[t.traj_id].reward for t in trajs] == [0.5, 0.5, 1.0]
    assert {rewards[t.traj_id].scorer for t in trajs} == {"session"}


def test_head_gate_holds_a_session_until_weights_free_a_slot(start_proxy, model_dir, tmp_path, wait_until):
    # eta = 0, B = 1: one group per version. The TTL stays long (a loaded CI box must not
    # expire a key mid-test); it is shortened only for the expiry check at the end.
    server, bus = start_proxy(model_dir, api_key=ADMIN, gconfig__max_new_tokens=6,
                              train_dataset__prompts_per_step=1, rollout__max_head_offpolicyness=0)
    try:
        first = _session(server, group_size=1)
        client = _client(server, first)
        result: dict = {}

        def start_second():
            result["t0"] = time.monotonic()
            result["out"] = _post(server.base_url, "/sessions", {"group_size": 1}, ADMIN)
            result["t1"] = time.monotonic()

        waiter = threading.Thread(target=start_second, daemon=True)
        waiter.start()
        time.sleep(1.0)
        assert waiter.is_alive(), "the second group was admitted past the head gate"
        # Requests keep being served while a new version is loaded; the gate opens (the
        # trainer's version 1: its bytes on weights.v1, its counts on progress.v1).
        engine = server.svc.engine
        model_weights = (engine.decoder.hf_state_dict() if hasattr(engine, "decoder")
                         else engine.model.state_dict())
        sha, size = save_weights({k: v.clone() for k, v in model_weights.items()}, tmp_path / "v1.safetensors")
        with EventProducer(bus) as producer:
            producer.publish(WeightsEvent(version=1, path=str(tmp_path / "v1.safetensors"), sha256=sha,
                                          num_bytes=size))
            producer.publish(ProgressEvent(version=1))
        out = client.chat.completions.create(model="tapioca", messages=[{"role": "user", "content": "5="}],
                                             max_tokens=3)
        assert out.choices[0].finish_reason in ("stop", "length")
        waiter.join(20)
        status, second = result["out"]
        assert status == 200 and result["t1"] - result["t0"] >= 1.0, second
        assert second["group_id"] != first["group_id"]
        wait_until(lambda: server.svc.engine.version == 1, what="version 1 loaded")
        later = client.chat.completions.create(model="tapioca", messages=[{"role": "user", "content": "5="}],
                                               max_tokens=3)
        assert set(later.model_extra["tapioca"]["policy_versions"]) == {1}
        # Past the model's context (max_position_embeddings 2048): refused as such.
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model="tapioca", prompt=[5] * 2000, max_tokens=100)
        assert err.value.code == "context_length_exceeded"
        # An idle key expires.
        server.svc.store.ttl_s = 0.5
        time.sleep(1.0)
        with pytest.raises(openai.AuthenticationError) as err:
            client.chat.completions.create(model="tapioca", messages=[{"role": "user", "content": "5="}],
                                           max_tokens=2)
        assert "expired" in str(err.value)
    finally:
        server.stop()


def test_tool_choice_none_keeps_every_turn_in_the_concat_trajectory(proxy, wait_until):
    """tool_choice "none" still renders the tools, so turn 2's prompt extends turn 1's
    tokens and the concat chain holds both turns (it used to drop the tools block)."""
    server, bus = proxy
    session = _session(server, group_size=1, task="calc")
    client = _client(server, session)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "12*7?"}]
    first = client.chat.completions.create(model="tapioca", messages=messages, tools=TOOLS, max_tokens=4)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Answer without tools."}]
    second = client.chat.completions.create(model="tapioca", messages=messages, tools=TOOLS,
                                            tool_choice="none", max_tokens=4)
    assert second.choices[0].message.tool_calls is None
    status, ended = _post(server.base_url, f"/sessions/{session['session_id']}/end", {"mode": "concat"},
                          session["api_key"])
    assert status == 200 and ended["published"]
    [traj] = _wait_trajectories(bus, session["group_id"], 1, wait_until)
    assert len(traj.turn_boundaries) == 2
    assert sum(traj.loss_mask) == first.usage.completion_tokens + second.usage.completion_tokens
    rewards = [e for e in read_events(bus, "rewards", idle_s=0.3)
               if isinstance(e, RewardEvent) and e.traj_id == traj.traj_id]
    assert rewards[0].details["completion_ids"] == [first.model_extra["tapioca"]["completion_ids"][0],
                                                   second.model_extra["tapioca"]["completion_ids"][0]]


def test_malformed_requests_and_token_limits(proxy):
    server, _ = proxy
    s = _session(server, group_size=1)
    key = s["api_key"]
    user = {"role": "user", "content": "q"}
    fn = {"name": "calculator", "arguments": "{}"}
    for calls in ([1], [{"function": "x"}], [{"id": ["unhashable"], "type": "function", "function": fn}],
                  [{"id": "c0", "type": "function", "function": {"name": "calculator", "arguments": 7}}]):
        body = {"messages": [user, {"role": "assistant", "content": None, "tool_calls": calls}]}
        _assert_openai_error(*_post(server.base_url, "/chat/completions", body, key), 400)
    for extra in ({"stream": True, "stream_options": [1]}, {"stream_options": {"include_usage": "yes"}},
                  {"tool_choice": "sometimes"}, {"stream": "yes"}, {"logprobs": 1}):
        status, body = _post(server.base_url, "/chat/completions", {"messages": [user], **extra}, key)
        _assert_openai_error(status, body, 400)
        assert body["error"]["type"] == "invalid_request_error"
    # Token ids the model does not have: a bad request, not a context-length error.
    status, body = _post(server.base_url, "/completions", {"prompt": [99999], "max_tokens": 2}, key)
    _assert_openai_error(status, body, 400)
    assert body["error"]["code"] == "invalid_prompt"
    # proxy.max_tokens_per_session=3000 counts prompt tokens too: a third call with a
    # 1001-token prompt exceeds it although the calls generate at most 6 tokens.
    client = _client(server, _session(server, group_size=1))
    long = [{"role": "user", "content": "1+" * 500}]
    for _ in range(2):
        out = client.chat.completions.create(model="tapioca", messages=long, max_tokens=2)
        assert out.usage.prompt_tokens == 1001
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tapioca", messages=long, max_tokens=2)
    assert err.value.code == "session_token_limit"
    client.chat.completions.create(model="tapioca", messages=[{"role": "user", "content": "1"}], max_tokens=2)


def test_top_logprobs_is_checked_never_silently_empty(proxy):
    """top_logprobs: an integer in [0, 20] (OpenAI's range), > 0 only with logprobs;
    the engines give no alternatives, so > 0 is a 400 that says so, never 200 with [].
    Legacy completions' logprobs (OpenAI: [0, 5]) likewise; 0 returns each token's
    logprob. Streams carry the logprobs they were asked for on each choice's last chunk."""
    server, _ = proxy
    key = _session(server, group_size=1)["api_key"]
    ask = {"messages": [{"role": "user", "content": "2+2="}], "max_tokens": 3}
    for bad in (1e9, -3, 21, "2", True, 2.5):
        status, body = _post(server.base_url, "/chat/completions", {**ask, "logprobs": True, "top_logprobs": bad}, key)
        _assert_openai_error(status, body, 400)
        assert body["error"]["param"] == "top_logprobs" and "[0, 20]" in body["error"]["message"], body
    status, body = _post(server.base_url, "/chat/completions", {**ask, "top_logprobs": 2}, key)
    _assert_openai_error(status, body, 400)
    assert "logprobs: true" in body["error"]["message"]
    for k in (1, 5, 20):
        status, body = _post(server.base_url, "/chat/completions", {**ask, "logprobs": True, "top_logprobs": k}, key)
        _assert_openai_error(status, body, 400)
        assert body["error"]["code"] == "unsupported_value" and "not supported" in body["error"]["message"]

    client = _client(server, _session(server, group_size=1))
    out = client.chat.completions.create(model="tapioca", logprobs=True, top_logprobs=0, **ask)
    tokens = out.choices[0].logprobs.content
    assert len(tokens) == out.usage.completion_tokens and all(t.top_logprobs == [] and t.logprob < 0 for t in tokens)
    chunks = list(client.chat.completions.create(model="tapioca", logprobs=True, stream=True, **ask))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert 1 <= len(streamed) <= 3 and all(t.logprob < 0 for t in streamed)

    for bad in (6, -1, 1e9, 3):
        status, body = _post(server.base_url, "/completions", {"prompt": "2+2=", "max_tokens": 3, "logprobs": bad}, key)
        _assert_openai_error(status, body, 400)
        assert body["error"]["param"] == "logprobs", body
    text = client.completions.create(model="tapioca", prompt="2+2=", max_tokens=3, logprobs=0)
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == text.usage.completion_tokens
    assert lp.text_offset[0] == 0 and all(x < 0 for x in lp.token_logprobs)
    assert lp.top_logprobs == [{t: x} for t, x in zip(lp.tokens, lp.token_logprobs)]


HEADER_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def http_proxy(start_proxy, model_dir):
    # Short HTTP timeouts and a cap of 3 connections (this module's other proxy keeps
    # the defaults).
    server, _ = start_proxy(model_dir, api_key=ADMIN, run_id="proxytest.http",
                            proxy__header_timeout_s=HEADER_TIMEOUT_S, proxy__keep_alive_timeout_s=2.0,
                            proxy__max_connections=3)
    return server


def _until_closed(sock, limit_s: float = 60.0) -> tuple[bytes, float]:
    """Read ``sock`` until the server closes it; (what it sent, time.monotonic() then)."""
    sock.settimeout(limit_s)
    data = b""
    while True:
        chunk = sock.recv(4096)
        if not chunk:
            return data, time.monotonic()
        data += chunk


def _connect(server):
    import socket

    return socket.create_connection((server.host, server.port), timeout=30)


def test_half_sent_requests_are_closed_after_the_header_timeout(http_proxy):
    """Half a request line, a request line with unfinished headers, nothing at all, and
    a half second request on a kept-alive connection: each gets 408 and is closed
    within proxy.header_timeout_s (never before it; at most the read limit after it on a
    loaded box). Before the fix they stayed open for good."""
    first = _connect(http_proxy)
    first.sendall(b"GET /health HTTP/1.1\r\nHost: proxy\r\n\r\n")
    reply = first.recv(65536)
    assert reply.startswith(b"HTTP/1.1 200"), reply
    began = []  # when each one's deadline started, at the latest
    socks = []
    for head in (b"POST /v1/chat/compl", b"POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: appl"):
        socks.append(_connect(http_proxy))
        began.append(time.monotonic())
        socks[-1].sendall(head)
    first.sendall(b"GET /hea")  # the kept-alive connection starts a second request
    began.append(time.monotonic())
    silent = _connect(http_proxy)
    began.append(time.monotonic())
    try:
        for sock, start in zip((*socks, first, silent), began):
            data, closed = _until_closed(sock)  # (first: the rest of its 200 comes before)
            assert b"HTTP/1.1 408 Request Timeout\r\n" in data, data
            assert data.endswith(b"\r\n\r\nthe request line and headers took too long"), data
            # A lower bound only (the close is seen when read, which may be later).
            assert closed - start >= HEADER_TIMEOUT_S * 0.9
    finally:
        for sock in (*socks, first, silent):
            sock.close()


def test_idle_kept_alive_connections_close_and_the_connection_cap_holds(http_proxy):
    """proxy.keep_alive_timeout_s closes a connection idle after its response;
    proxy.max_connections (3) answers 503 while the open connections reach it, and the
    header timeout frees those slots."""
    sock = _connect(http_proxy)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: proxy\r\n\r\n")
    data, _ = _until_closed(sock)  # after proxy.keep_alive_timeout_s (2 s) idle; 60 s read limit
    assert data.startswith(b"HTTP/1.1 200") and b"408" not in data, data
    sock.close()

    holders = [_connect(http_proxy) for _ in range(2)]
    try:
        time.sleep(0.5)  # the server has accepted them
        status, _ = _get_health(http_proxy)
        assert status == 503
        for h in holders:  # freed by the header timeout
            _until_closed(h)
        status, body = _get_health(http_proxy)
        assert status == 200 and body["ok"], body
    finally:
        for h in holders:
            h.close()


def _get_health(server) -> tuple[int, dict]:
    base = server.base_url.removesuffix("/v1")
    try:
        with urllib.request.urlopen(base + "/health", timeout=60) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {}


CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>'


class ScriptedEngine(InferenceEngine):
    """Answers every request with the same output ids (logprob -0.25, version 0): the
    one part of this test that is not the real thing (see the module docstring)."""

    def __init__(self, output_ids: list[int]) -> None:
        self.output_ids = output_ids
        self.request_ids: list[str] = []

    def submit(self, request: GenRequest) -> concurrent.futures.Future[GenResult]:
        self.request_ids.append(request.request_id)
        n = len(self.output_ids)
        future: concurrent.futures.Future[GenResult] = concurrent.futures.Future()
        future.set_result(GenResult(request.request_id, list(request.prompt_ids), list(self.output_ids),
                                    [-0.25] * n, [0] * n, "stop", {"generate_s": 0.0}))
        return future

    def pause(self) -> None: ...

    def resume(self) -> None: ...

    def update_weights(self, weights, version: int) -> None: ...

    @property
    def version(self) -> int:
        return 0

    def shutdown(self) -> None: ...


def _scripted_server(engine: InferenceEngine, tokenizer, bus_cfg, run_id: str) -> ProxyServer:
    section = ProxySection(
        proxy=ProxyConfig(api_key=ADMIN, served_model_name="tapioca", max_tokens_per_request=4096,
                          max_tokens_per_session=100_000, max_request_bytes=1 << 20,
                          session_ttl_s=600.0),
        gconfig=GenerationConfig(n_samples=1, max_new_tokens=128), max_head_offpolicyness=0,
        prompts_per_step=100, run_id=run_id, seed=0)
    return ProxyServer(ProxyService(section, engine=engine, tokenizer=tokenizer, bus=bus_cfg,
                                    load_weights=lambda e: None))


def test_tool_call_replies_streamed_and_not(bus_cfg, tokenizer, wait_until):
    reply = "Let me compute.\n" + CALL
    engine = ScriptedEngine(list(tokenizer(reply, add_special_tokens=False)["input_ids"])
                            + [tokenizer.eos_token_id])
    with _scripted_server(engine, tokenizer, bus_cfg, "scripted") as server:
        session = _session(server, group_size=1)
        client = _client(server, session)
        messages = [{"role": "user", "content": "What is 12*7?"}]
        whole = client.chat.completions.create(model="tapioca", messages=messages, tools=TOOLS)
        msg = whole.choices[0].message
        assert whole.choices[0].finish_reason == "tool_calls" and msg.content == "Let me compute."
        [call] = msg.tool_calls
        assert call.function.name == "calculator" and json.loads(call.function.arguments) == {"expression": "12*7"}

        chunks = list(client.chat.completions.create(model="tapioca", messages=messages, tools=TOOLS,
                                                     stream=True))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        content_pieces = [d.content for d in deltas if d.content]
        assert "".join(content_pieces) == "Let me compute." and len(content_pieces) == len("Let me compute.")
        [streamed] = [tc for d in deltas for tc in (d.tool_calls or [])]
        assert streamed.function.name == "calculator" and streamed.id.startswith("call_")
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"

        # The agent runs the streamed call and answers; tool_choice "none": not parsed.
        messages += [{"role": "assistant", "content": "Let me compute.", "tool_calls": [{
                         "id": streamed.id, "type": "function",
                         "function": {"name": "calculator", "arguments": streamed.function.arguments}}]},
                     {"role": "tool", "tool_call_id": streamed.id, "content": "84"}]
        last = client.chat.completions.create(model="tapioca", messages=messages, tools=TOOLS,
                                              tool_choice="none")
        assert last.choices[0].message.content == reply and last.choices[0].finish_reason == "stop"
        assert len(set(engine.request_ids)) == 3  # unique engine request ids per call

        status, ended = _post(server.base_url, f"/sessions/{session['session_id']}/end", {"mode": "concat"},
                              session["api_key"])
        assert status == 200 and ended["published"]
        [traj] = _wait_trajectories(bus_cfg, session["group_id"], 1, wait_until)
        # The streamed call's raw text was re-rendered: the chain holds both turns.
        assert len(traj.turn_boundaries) == 2 and sum(traj.loss_mask) == 2 * len(engine.output_ids)
        assert traj.output_ids[:len(engine.output_ids)] == engine.output_ids
        assert "<tool_response>\n84\n</tool_response>" in tokenizer.decode(traj.output_ids)


def test_tool_turns_then_raw_completions_train_as_one_group(bus_cfg, tokenizer, wait_until):
    """Issue 22's bug as a new user meets it, with the openai SDK: one session (group_size
    1) makes a chat call with tools, a tool-result turn and a /v1/completions call, and
    ends per_completion. The chat template's prompts and the raw prompt share no first
    token: the group was dropped (``published: false``) and a run waiting for it never
    finished. It is published with an empty shared prompt, every context in its output
    with loss mask 0, one trajectory per completion, each with its session reward."""
    engine = ScriptedEngine(list(tokenizer(CALL, add_special_tokens=False)["input_ids"])
                            + [tokenizer.eos_token_id])
    with _scripted_server(engine, tokenizer, bus_cfg, "issue22") as server:
        session = _session(server, group_size=1)
        client = _client(server, session)
        messages = [{"role": "user", "content": "What is 12*7?"}]
        first = client.chat.completions.create(model="tapioca", messages=messages, tools=TOOLS)
        [call] = first.choices[0].message.tool_calls
        messages += [{"role": "assistant", "content": None, "tool_calls": [{
                         "id": call.id, "type": "function",
                         "function": {"name": "calculator", "arguments": call.function.arguments}}]},
                     {"role": "tool", "tool_call_id": call.id, "content": "84"}]
        client.chat.completions.create(model="tapioca", messages=messages, tools=TOOLS)
        client.completions.create(model="tapioca", prompt="12*7=", max_tokens=8)
        status, _ = _post(server.base_url, f"/sessions/{session['session_id']}/reward",
                          {"reward": 1.0}, session["api_key"])
        assert status == 200
        status, ended = _post(server.base_url, f"/sessions/{session['session_id']}/end",
                              {"mode": "per_completion"}, session["api_key"])
        assert status == 200 and ended["published"] and ended["reason"] == "", ended
        trajs = _wait_trajectories(bus_cfg, session["group_id"], 3, wait_until)
    assert [t.prompt_ids for t in trajs] == [[], [], []]
    assert [t.group_size for t in trajs] == [3, 3, 3]
    raw = list(tokenizer("12*7=", add_special_tokens=False)["input_ids"])
    third = trajs[2]
    assert third.output_ids[:len(raw)] == raw and third.loss_mask[:len(raw)] == [0] * len(raw)
    assert third.output_ids[len(raw):] == engine.output_ids  # (the script ignores max_tokens)
    for t in trajs:  # the context is masked, the model's tokens are trained
        assert t.loss_mask[0] == 0 and t.loss_mask[-1] == 1 and t.session_id == session["session_id"]
    rewards = {e.traj_id: e.reward for e in read_events(bus_cfg, "rewards", idle_s=0.3)
               if isinstance(e, RewardEvent) and e.group_id == session["group_id"]}
    assert sorted(rewards) == sorted(t.traj_id for t in trajs)
