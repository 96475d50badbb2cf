"""Any agent harness, unmodified: the OpenAI Responses API (``client.responses.create``)
and the Anthropic Messages API (``client.messages.create``) through the agent proxy, and
AReaL's online-proxy routes (``/rl/start_session``, ``/rl/set_reward``,
``/rl/end_session``, ``/chat/completions``, ``/responses`` at the root).

The official ``openai`` and ``anthropic`` SDKs against a real proxy (uvicorn on
127.0.0.1, a tiny random Qwen2.5-VL with the printable alphabet in the in-process engine,
the real embedded broker): plain and streamed calls, ``previous_response_id``, an image
block, a session that mixes the dialects (its turns re-render to the model's own tokens,
so its concat trajectory holds every turn) in a group with sessions of each dialect
(published as one group), hostile requests answered in each dialect's error shape while
the proxy keeps serving, and the AReaL flow. The tiny random model cannot be made to write
a tool call, so the tool-call round trips use a proxy whose engine replays scripted
replies (conftest's ``start_scripted_proxy``); everything else there is the real thing.
The trajectories these make train in tests/e2e/test_agent_dialects.py.
"""

from __future__ import annotations

import base64
import hashlib
import json
import urllib.error
import urllib.request

import anthropic
import openai
import pytest

from tapioca.bus.reader import read_events
from tapioca.models.tokenizer import load_tokenizer
from tapioca.runtime.run import create_tiny_checkpoint
from tapioca.schemas.events import RewardEvent, TrajectoryEvent
from tapioca.tasks.visual import draw

pytestmark = pytest.mark.integration

ADMIN = "dialects-admin-key"
RESPONSES_TOOLS = [{"type": "function", "name": "calculator", "description": "Evaluate arithmetic",
                    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                                   "required": ["expression"]}}]
MESSAGES_TOOLS = [{"name": "calculator", "description": "Evaluate arithmetic",
                   "input_schema": RESPONSES_TOOLS[0]["parameters"]}]
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>'


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # The printable alphabet (chat text and tool JSON encode as themselves), a vision
    # tower (image blocks), and a context long enough for a tools block.
    return str(create_tiny_checkpoint(tmp_path_factory.mktemp("dialects") / "model", task="gsm8k",
                                      arch="qwen2_5_vl", vision={"depth": 1, "hidden_size": 32},
                                      max_position_embeddings=2048))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return load_tokenizer(model_dir)


@pytest.fixture(scope="module")
def proxy(start_proxy, model_dir, tmp_path_factory):
    # n_samples 1: a session started without a group_size is a group of its own (online mode).
    return start_proxy(model_dir, api_key=ADMIN, run_id="dialects.t0", gconfig__max_new_tokens=6,
                       gconfig__n_samples=1, train_dataset__prompts_per_step=1000, proxy__max_request_bytes=64 * 1024,
                       vlm__image_store=str(tmp_path_factory.mktemp("images")),
                       vlm__max_image_pixels=200 * 200)


def root(server) -> str:
    return server.base_url.removesuffix("/v1")


def post(url: str, body, headers: dict[str, str], raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def start(server, **body) -> dict:
    status, out = post(server.base_url + "/sessions", body, bearer(ADMIN))
    assert status == 200, out
    return out


def end(server, session: dict, mode: str = "concat") -> dict:
    status, out = post(f"{server.base_url}/sessions/{session['session_id']}/end", {"mode": mode},
                       bearer(session["api_key"]))
    assert status == 200, out
    return out


def reward(server, session: dict, value: float) -> None:
    status, out = post(f"{server.base_url}/sessions/{session['session_id']}/reward", {"reward": value},
                       bearer(session["api_key"]))
    assert status == 200, out


def openai_client(server, session: dict, base: str | None = None) -> openai.OpenAI:
    return openai.OpenAI(base_url=base or server.base_url, api_key=session["api_key"], max_retries=0)


def anthropic_client(server, session: dict, **kw) -> anthropic.Anthropic:
    kw = kw or {"api_key": session["api_key"]}
    return anthropic.Anthropic(base_url=root(server), max_retries=0, **kw)


def trajectories(bus, group_id: str, n: int, wait_until) -> list[TrajectoryEvent]:
    found: list[TrajectoryEvent] = []

    def ready() -> bool:
        nonlocal found
        found = [e for e in read_events(bus, "trajectories", idle_s=0.3)
                 if isinstance(e, TrajectoryEvent) and e.group_id == group_id]
        return len(found) >= n

    wait_until(ready, timeout_s=30, what=f"{n} trajectories of {group_id}")
    return sorted(found, key=lambda t: t.sample_index)


def png_b64(k: int = 1) -> str:
    return base64.b64encode(draw("color", k)[0]).decode()


# ---------------------------------------------------------------------- Responses API


def test_responses_plain_streamed_and_chained(proxy, tokenizer, wait_until):
    """A plain call (logprobs included), a streamed one chained by previous_response_id,
    the SDK's stream helper: the events arrive in the API's order and add up to the final
    response; the three turns are one concat trajectory whose model tokens are the ones
    the calls returned."""
    server, bus = proxy
    session = start(server, group_size=1)
    client = openai_client(server, session)
    first = client.responses.create(model="tapioca", instructions="Be terse.", input="2+3=",
                                    max_output_tokens=4, temperature=1.0,
                                    include=["message.output_text.logprobs"])
    assert first.object == "response" and first.status in ("completed", "incomplete")
    assert first.id.startswith("resp_") and first.model_extra["tapioca"]["completion_ids"] == [f"{first.id}:0"]
    [item] = first.output
    assert item.type == "message" and item.role == "assistant" and first.output_text == item.content[0].text
    assert 1 <= first.usage.output_tokens <= 4
    assert first.usage.total_tokens == first.usage.input_tokens + first.usage.output_tokens
    lps = item.content[0].logprobs
    assert len(lps) == first.usage.output_tokens and all(lp.logprob < 0 for lp in lps)
    if first.status == "incomplete":
        assert first.incomplete_details.reason == "max_output_tokens"

    events = list(client.responses.create(model="tapioca", instructions="Be terse.", input="again",
                                          previous_response_id=first.id, max_output_tokens=4, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    second = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == second.output_text
    assert second.previous_response_id == first.id

    # The SDK's stream helper checks the events' order as it accumulates them
    # (get_final_response() needs response.completed: a call cut at max_output_tokens
    # ends with response.incomplete, as OpenAI's does).
    with client.responses.stream(model="tapioca", instructions="Be terse.", input="once more",
                                 previous_response_id=second.id, max_output_tokens=4) as stream:
        third = list(stream)[-1].response
    assert third.output_text == third.output[0].content[0].text

    out = end(server, session)
    assert out["published"] and out["traj_ids"]
    [traj] = trajectories(bus, session["group_id"], 1, wait_until)
    assert len(traj.turn_boundaries) == 3
    assert sum(traj.loss_mask) == sum(r.usage.output_tokens for r in (first, second, third))
    text = tokenizer.decode(traj.prompt_ids + traj.output_ids)
    assert text.startswith("<bos>Be terse.2+3=") and "again" in text and "once more" in text


# ---------------------------------------------------------------------- Messages API


def test_messages_plain_streamed_and_an_image(proxy, wait_until):
    """Plain (the key as Bearer), streamed (the key as x-api-key: how the Anthropic SDK
    sends it), the stream helper, and an image block: its trajectory carries the image by
    sha256."""
    server, bus = proxy
    session = start(server, group_size=1)
    client = anthropic_client(server, session)
    first = client.messages.create(model="tapioca", max_tokens=4, system="Be terse.",
                                   messages=[{"role": "user", "content": "2+3="}])
    assert first.type == "message" and first.role == "assistant" and first.id.startswith("msg_")
    assert first.stop_reason in ("end_turn", "max_tokens") and first.content[0].type == "text"
    assert 1 <= first.usage.output_tokens <= 4 and first.usage.input_tokens > 0
    by_header = anthropic_client(server, session, api_key=None,
                                 default_headers={"x-api-key": session["api_key"]})
    convo = [{"role": "user", "content": "2+3="},
             {"role": "assistant", "content": [{"type": "text", "text": first.content[0].text}]},
             {"role": "user", "content": [{"type": "text", "text": "again"}]}]
    events = list(by_header.messages.create(model="tapioca", max_tokens=4, system="Be terse.", messages=convo,
                                            stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]  # (the SDK drops the ping)
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    streamed = "".join(e.delta.text for e in events if e.type == "content_block_delta")
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.delta.stop_reason in ("end_turn", "max_tokens") and 1 <= delta.usage.output_tokens <= 4
    with client.messages.stream(model="tapioca", max_tokens=4, system="Be terse.",
                                messages=convo + [{"role": "assistant", "content": streamed},
                                                  {"role": "user", "content": "once more"}]) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "text"
    out = end(server, session)
    [traj] = trajectories(bus, session["group_id"], 1, wait_until)
    assert out["published"] and len(traj.turn_boundaries) == 3

    pictured = start(server, group_size=1)
    data = png_b64(2)
    reply = anthropic_client(server, pictured).messages.create(model="tapioca", max_tokens=2, messages=[
        {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                   "data": data}},
                                     {"type": "text", "text": "color?"}]}])
    assert reply.content[0].type == "text"
    end(server, pictured)
    [traj] = trajectories(bus, pictured["group_id"], 1, wait_until)
    assert [i.sha256 for i in traj.images] == [hashlib.sha256(base64.b64decode(data)).hexdigest()]


# ---------------------------------------------------------------------- tool round trips


def test_tool_round_trips_with_both_sdks(start_scripted_proxy, tokenizer, bus_cfg, wait_until):
    """The model calls the calculator, the agent answers with its result, the model
    answers: with client.responses.create (function_call -> function_call_output) and
    client.messages.create (tool_use -> tool_result), plain and streamed. What the agents
    send back re-renders to the tokens the model wrote: each session is one concat
    trajectory of both turns."""
    # The model calls the tool, and answers once it has the tool's result.
    server, engine = start_scripted_proxy(tokenizer, ["Let me compute.\n" + CALL, "84"],
                                          lambda prompt: int("<tool_response>" in prompt), api_key=ADMIN)
    question = "What is 12*7?"

    oa = start(server, group_size=1)
    client = openai_client(server, oa)
    first = client.responses.create(model="tapioca", input=question, tools=RESPONSES_TOOLS)
    message, call = first.output
    assert message.content[0].text == "Let me compute." and call.type == "function_call"
    assert call.name == "calculator" and json.loads(call.arguments) == {"expression": "12*7"}
    second = client.responses.create(model="tapioca", tools=RESPONSES_TOOLS, input=[
        {"role": "user", "content": question}, *[o.model_dump(exclude_none=True) for o in first.output],
        {"type": "function_call_output", "call_id": call.call_id, "output": "84"}])
    assert second.output_text == "84" and second.status == "completed"
    events = list(client.responses.create(model="tapioca", input=question, tools=RESPONSES_TOOLS, stream=True))
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"expression": "12*7"}
    assert [e.type for e in events].count("response.output_item.done") == 2

    an = start(server, group_size=1)
    claude = anthropic_client(server, an)
    first_m = claude.messages.create(model="tapioca", max_tokens=64, tools=MESSAGES_TOOLS,
                                     messages=[{"role": "user", "content": question}])
    text, use = first_m.content
    assert first_m.stop_reason == "tool_use" and text.text == "Let me compute."
    assert use.type == "tool_use" and use.name == "calculator" and use.input == {"expression": "12*7"}
    second_m = claude.messages.create(model="tapioca", max_tokens=64, tools=MESSAGES_TOOLS, messages=[
        {"role": "user", "content": question},
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first_m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "84"}]}])
    assert second_m.content[0].text == "84" and second_m.stop_reason == "end_turn"
    events = list(claude.messages.create(model="tapioca", max_tokens=64, tools=MESSAGES_TOOLS, stream=True,
                                         messages=[{"role": "user", "content": question}]))
    starts = [e.content_block.type for e in events if e.type == "content_block_start"]
    assert starts == ["text", "tool_use"]
    partial = "".join(e.delta.partial_json for e in events
                      if e.type == "content_block_delta" and e.delta.type == "input_json_delta")
    assert json.loads(partial) == {"expression": "12*7"}
    assert next(e for e in events if e.type == "message_delta").delta.stop_reason == "tool_use"

    scripted = engine.replies
    for session, answer in ((oa, second.id), (an, second_m.id)):
        # The reward names the answer: the concat trajectory is the conversation that
        # led to it (not the streamed call after it).
        status, _ = post(f"{server.base_url}/sessions/{session['session_id']}/reward",
                         {"reward": 1.0, "completion_id": answer}, bearer(session["api_key"]))
        assert status == 200
        end(server, session)
        [traj] = trajectories(bus_cfg, session["group_id"], 1, wait_until)
        assert len(traj.turn_boundaries) == 2, session
        assert traj.output_ids[:len(scripted[0])] == scripted[0]
        assert sum(traj.loss_mask) == len(scripted[0]) + len(scripted[1])
        assert "<tool_response>\n84\n</tool_response>" in tokenizer.decode(traj.output_ids)


# ---------------------------------------------------------------------- mixed dialects


def test_a_session_mixes_dialects_and_a_group_mixes_sessions(proxy, tokenizer, wait_until):
    """One group of three sessions: one goes chat -> Messages -> Responses in one
    conversation (each turn re-renders to the tokens the model wrote: one concat
    trajectory of three turns), one speaks Responses, one Messages. The group is published
    whole, one shared prompt, each session's reward."""
    server, bus = proxy
    mixed = start(server, group_size=3, task="mixed", task_data={"answer": "5"})
    others = [start(server, group_id=mixed["group_id"], group_size=3) for _ in range(2)]
    ask = "2+3="
    chat = openai_client(server, mixed).chat.completions.create(
        model="tapioca", messages=[{"role": "user", "content": ask}], max_tokens=4)
    said = chat.choices[0].message.content
    msg = anthropic_client(server, mixed).messages.create(model="tapioca", max_tokens=4, messages=[
        {"role": "user", "content": ask}, {"role": "assistant", "content": said},
        {"role": "user", "content": "sure?"}])
    said2 = msg.content[0].text
    resp = openai_client(server, mixed).responses.create(model="tapioca", max_output_tokens=4, input=[
        {"role": "user", "content": ask}, {"role": "assistant", "content": said},
        {"role": "user", "content": "sure?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": said2}]},
        {"role": "user", "content": "final?"}])
    openai_client(server, others[0]).responses.create(model="tapioca", input=ask, max_output_tokens=4)
    anthropic_client(server, others[1]).messages.create(model="tapioca", max_tokens=4,
                                                        messages=[{"role": "user", "content": ask}])
    for s, r in zip([mixed, *others], (1.0, 0.5, 0.0)):
        reward(server, s, r)
    assert not end(server, mixed)["published"] and not end(server, others[0])["published"]
    assert end(server, others[1])["published"]
    trajs = trajectories(bus, mixed["group_id"], 3, wait_until)
    assert [t.group_size for t in trajs] == [3, 3, 3] and len({tuple(t.prompt_ids) for t in trajs}) == 1
    first = trajs[0]
    assert len(first.turn_boundaries) == 3
    assert sum(first.loss_mask) == (chat.usage.completion_tokens + msg.usage.output_tokens
                                    + resp.usage.output_tokens)
    assert "sure?" in tokenizer.decode(first.output_ids) and "final?" in tokenizer.decode(first.output_ids)
    rewards = {e.traj_id: e.reward for e in read_events(bus, "rewards", idle_s=0.3) if isinstance(e, RewardEvent)}
    assert [rewards[t.traj_id] for t in trajs] == [1.0, 0.5, 0.0]


# ---------------------------------------------------------------------- hostile requests


def openai_error(status: int, body: dict, expected: int) -> str:
    assert status == expected, body
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    return body["error"]["message"]


def anthropic_error(status: int, body: dict, expected: int, kind: str) -> str:
    assert status == expected, body
    assert set(body) == {"type", "error"} and body["type"] == "error", body
    assert set(body["error"]) == {"type", "message"} and body["error"]["type"] == kind, body
    assert body["error"]["message"]
    return body["error"]["message"]


def test_hostile_requests_get_their_dialects_error_and_the_proxy_keeps_serving(proxy):
    server, _ = proxy
    session = start(server, group_size=1)
    key = bearer(session["api_key"])
    responses, messages = server.base_url + "/responses", root(server) + "/v1/messages"
    huge = "x" * (70 * 1024)

    ok_input = {"model": "tapioca", "input": "1=", "max_output_tokens": 2}
    for bad, needle in (({"input": 7}, "input must be"),
                        ({"input": [1]}, "input[0] must be an object"),
                        ({"input": [{"type": "function_call", "name": "f"}]}, "call_id"),
                        ({"input": [{"type": "bogus"}]}, "'bogus' is not supported"),
                        ({"input": [{"role": "user", "content": [{"type": "video"}]}]}, "'video'"),
                        ({"input": [{"role": "robot", "content": "x"}]}, "role"),
                        ({"tools": [{"type": "web_search"}]}, "web_search"),
                        ({"text": {"format": {"type": "json_schema"}}}, "json_schema"),
                        ({"background": True}, "background"),
                        ({"top_logprobs": 3}, "top_logprobs=3"),
                        ({"max_output_tokens": 0}, "max_output_tokens"),
                        ({"temperature": 9}, "temperature")):
        message = openai_error(*post(responses, {**ok_input, **bad}, key), 400)
        assert needle in message, (bad, message)
    openai_error(*post(responses, {**ok_input, "previous_response_id": "resp_nobody"}, key), 404)
    openai_error(*post(responses, None, key, raw=b"{not json"), 400)
    openai_error(*post(responses, {**ok_input, "input": huge}, key), 413)
    openai_error(*post(responses, ok_input, bearer("tpk-nobody")), 401)
    openai_error(*post(responses, ok_input, bearer(ADMIN)), 403)
    openai_error(*post(responses, ok_input, {}), 401)

    ok = {"model": "tapioca", "max_tokens": 2, "messages": [{"role": "user", "content": "1="}]}
    user = {"role": "user", "content": "1="}
    for bad, needle in (({"messages": []}, "messages"),
                        ({"messages": "hi"}, "messages"),
                        ({"messages": [{"role": "system", "content": "x"}]}, "role user or assistant"),
                        ({"messages": [{"role": "user", "content": [{"type": "document"}]}]}, "'document'"),
                        ({"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a"}]}]},
                         "'tool_use' is not supported in a user turn"),
                        ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "tool_use_id"),
                        ({"messages": [user, {"role": "assistant", "content": [{"type": "thinking"}]}]},
                         "'thinking'"),
                        ({"messages": [{"role": "user", "content": [
                            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}]}]},
                         "not fetched"),
                        ({"messages": [{"role": "user", "content": [
                            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                         "data": "bm90IGFuIGltYWdl"}}]}]}, "cannot be decoded"),
                        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
                        ({"tool_choice": {"type": "sometimes"}}, "tool_choice"),
                        ({"temperature": 1.5}, "temperature"),
                        ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
                        ({"max_tokens": -1}, "max_tokens")):
        message = anthropic_error(*post(messages, {**ok, **bad}, key), 400, "invalid_request_error")
        assert needle in message, (bad, message)
    anthropic_error(*post(messages, None, key, raw=b"[1, 2"), 400, "invalid_request_error")
    anthropic_error(*post(messages, {**ok, "system": huge}, key), 413, "request_too_large")
    anthropic_error(*post(messages, ok, {"x-api-key": "tpk-nobody"}), 401, "authentication_error")
    anthropic_error(*post(messages, ok, {}), 401, "authentication_error")
    anthropic_error(*post(messages, ok, {"x-api-key": ADMIN}), 403, "permission_error")
    # Past the session's token budget: the chat route's 400, in Anthropic's shape.
    anthropic_error(*post(messages, {**ok, "max_tokens": 100_000}, key), 400, "invalid_request_error")

    # The SDKs raise their own errors, and the session still works after all of this.
    claude = anthropic_client(server, session)
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model="tapioca", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}]}])
    assert err.value.body["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError):
        openai_client(server, session).responses.create(model="tapioca", input=[{"type": "bogus"}])
    assert claude.messages.create(**ok).type == "message"
    assert openai_client(server, session).responses.create(**ok_input).object == "response"


# ---------------------------------------------------------------------- AReaL's routes


def test_areal_online_proxy_routes(proxy, wait_until):
    """A harness written for AReaL's online proxy, with only its base URL changed: start
    a session (admin key, task_id), chat at the root (/chat/completions, /responses),
    reward it (/rl/set_reward, session key; interaction_id a response id), end it
    (/rl/end_session); the trajectory is on the log with its reward."""
    server, bus = proxy
    base = root(server)
    status, started = post(base + "/rl/start_session", {"task_id": "areal-task-1"}, bearer(ADMIN))
    assert status == 200 and started["session_id"] and started["api_key"], started
    client = openai.OpenAI(base_url=base, api_key=started["api_key"], max_retries=0)
    chat = client.chat.completions.create(model="tapioca", messages=[{"role": "user", "content": "1+1="}],
                                          max_tokens=3)
    resp = client.responses.create(model="tapioca", input=[
        {"role": "user", "content": "1+1="}, {"role": "assistant", "content": chat.choices[0].message.content},
        {"role": "user", "content": "and 2+2="}], max_output_tokens=3)
    key = bearer(started["api_key"])
    status, out = post(base + "/rl/set_reward", {"reward": 0.5, "interaction_id": resp.id}, key)
    assert status == 200 and out["message"] == "success" and out["completion_ids"] == [f"{resp.id}:0"], out
    openai_error(*post(base + "/rl/set_reward", {"reward": float("inf")}, key), 400)
    openai_error(*post(base + "/rl/set_reward", {"reward": 1.0, "interaction_id": "nope"}, key), 404)
    openai_error(*post(base + "/rl/set_reward", {"reward": 1.0}, bearer(ADMIN)), 400)  # which session?
    status, out = post(base + "/rl/end_session", {}, key)
    assert status == 200 and out["message"] == "success" and out["interaction_count"] == 2, out
    assert out["published"] and out["rewards"] == [0.5]
    openai_error(*post(base + "/rl/end_session", {}, key), 401)  # the key stopped working
    [traj] = trajectories(bus, started["group_id"], 1, wait_until)
    assert traj.prompt_id == "areal-task-1" and len(traj.turn_boundaries) == 2

    # The admin key names the session; /rl/start_session refuses a session key.
    status, other = post(base + "/rl/start_session", {"task_id": "areal-task-2"}, bearer(ADMIN))
    openai_error(*post(base + "/rl/start_session", {"task_id": "x"}, bearer(other["api_key"])), 401)
    status, out = post(base + "/rl/end_session", {"session_id": other["session_id"]}, bearer(ADMIN))
    assert status == 200 and out["interaction_count"] == 0 and not out["published"], out
