"""The proxy's dialects as pure translations (no server): Responses API and Messages API
requests become the chat route's messages, tools and sampling fields; a generated choice
becomes a ``response`` / ``message`` and their event streams; ``previous_response_id``
chains stay within their session. The servers' side, with the real SDKs, is
tests/integration/test_proxy_dialects.py."""

from __future__ import annotations

import json

import orjson
import pytest

from tapioca.engines.base import GenResult
from tapioca.models.tokenizer import PRINTABLE_ALPHABET, build_char_tokenizer
from tapioca.producers.proxy import messages_api, responses_api
from tapioca.producers.proxy.chat_call import ChatCall, usage
from tapioca.producers.proxy.openai_errors import ApiError
from tapioca.producers.proxy.responses import ResponseText, build_chat_choices

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>'


@pytest.fixture(scope="module")
def text() -> ResponseText:
    return ResponseText(build_char_tokenizer(PRINTABLE_ALPHABET))


def call_of(text: ResponseText, reply: str, call_id: str, finish: str = "stop", *,
            logprobs: bool = False) -> ChatCall:
    ids = list(text.tokenizer(reply, add_special_tokens=False)["input_ids"])
    result = GenResult(f"{call_id}:0", [1, 2], ids, [-0.5] * len(ids), [3] * len(ids), finish)
    built = build_chat_choices(text, call_id, [1, 2], [result], (), parse_tools=True, logprobs=logprobs,
                               stream=True)
    return ChatCall(call_id, [1, 2], [result], built, usage([1, 2], [result]),
                    {"completion_ids": [f"{call_id}:0"], "policy_versions": [3]})


def events(stream: list[bytes]) -> list[dict]:
    out = []
    for raw in stream:
        head, data = raw.decode().rstrip("\n").split("\n")
        assert head.startswith("event: ") and data.startswith("data: ")
        out.append(orjson.loads(data[len("data: "):]))
        assert out[-1]["type"] == head[len("event: "):]
    return out


# ---------------------------------------------------------------------- Responses API


def test_responses_input_items_become_chat_messages():
    call = {"type": "function_call", "call_id": "c1", "name": "calc", "arguments": "{}"}
    req = responses_api.translate_request({
        "instructions": "Be terse.", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "q"},
                                         {"type": "input_image", "image_url": "data:image/png;base64,AA=="}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "hm"}]},
            call, {**call, "call_id": "c2"},
            {"type": "function_call_output", "call_id": "c1", "output": "84"},
            call,  # after a tool message: an assistant message of its own
        ],
        "tools": [{"type": "function", "name": "calc", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "calc"}, "max_output_tokens": 7, "top_p": 0.5,
        "include": ["message.output_text.logprobs", "reasoning.encrypted_content"], "stream": True,
        "store": False, "metadata": {"k": "v"}, "reasoning": {"effort": "low"}})
    roles = [m["role"] for m in req.messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    assert req.messages[1]["content"][1] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    assert req.messages[2]["content"] == [{"type": "text", "text": "hm"}]
    assert [c["id"] for c in req.messages[2]["tool_calls"]] == ["c1", "c2"]
    assert req.messages[4] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}]}
    assert req.new_messages == req.messages[1:]  # instructions are not carried over
    assert req.tools == [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]
    assert req.tool_choice == {"type": "function", "function": {"name": "calc"}}
    assert req.sampling_fields == {"top_p": 0.5, "max_tokens": 7} and req.stream and req.logprobs
    chained = responses_api.translate_request({"input": "next"}, history=[{"role": "user", "content": "q"}])
    assert chained.messages == [{"role": "user", "content": "q"}, {"role": "user", "content": "next"}]
    assert chained.new_messages == [{"role": "user", "content": "next"}]


@pytest.mark.parametrize("body, param", [
    ({"input": None}, "input"), ({"input": [{"type": "reasoning"}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file"}]}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "input"),
    ({"input": "x", "tools": [{"type": "file_search"}]}, "tools"),
    ({"input": "x", "tools": {"type": "function"}}, "tools"),
    ({"input": "x", "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ({"input": "x", "include": [1]}, "include"), ({"input": "x", "conversation": "c"}, "conversation"),
    ({"input": "x", "stream": "yes"}, "stream"), ({"input": "x", "instructions": 3}, "instructions"),
    ({"input": "x", "previous_response_id": 3}, "previous_response_id"),
])
def test_responses_bad_requests_name_the_field(body, param):
    with pytest.raises(ApiError) as err:
        responses_api.translate_request(body)
    assert err.value.status == 400 and err.value.param == param, err.value.message


def test_a_response_and_its_stream(text):
    done = call_of(text, "Let me compute.\n" + CALL, "resp_abc", logprobs=True)
    req = responses_api.translate_request({"input": "q", "include": [responses_api.LOGPROBS_INCLUDE]})
    resp = responses_api.response_object(done, {"input": "q"}, req, model="tapioca", created=1.0)
    message, fc = resp["output"]
    assert resp["status"] == "completed" and resp["id"] == "resp_abc" and resp["object"] == "response"
    assert message["content"][0]["text"] == "Let me compute."
    assert len(message["content"][0]["logprobs"]) == len(done.results[0].output_ids)
    assert fc["type"] == "function_call" and fc["name"] == "calculator" and fc["call_id"].startswith("call_")
    assert json.loads(fc["arguments"]) == {"expression": "12*7"}
    assert resp["usage"]["output_tokens"] == len(done.results[0].output_ids)
    assert responses_api.assistant_message(resp) == {
        "role": "assistant", "content": "Let me compute.",
        "tool_calls": [{"id": fc["call_id"], "type": "function",
                        "function": {"name": "calculator", "arguments": fc["arguments"]}}]}
    evs = events(responses_api.stream_events(resp, done.built.stream_pieces[0]))
    assert [e["sequence_number"] for e in evs] == list(range(len(evs)))
    assert [e["type"] for e in evs if "delta" not in e["type"]] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta") == "Let me compute."
    assert evs[0]["response"]["status"] == "in_progress" and evs[0]["response"]["output"] == []
    assert evs[-1]["response"] == resp

    cut = call_of(text, "12", "resp_cut", finish="length")
    resp = responses_api.response_object(cut, {}, responses_api.translate_request({"input": "q"}),
                                         model="tapioca", created=1.0)
    assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events(responses_api.stream_events(resp, ["1", "2"]))[-1]["type"] == "response.incomplete"


def test_previous_response_chains_stay_in_their_session():
    class S:
        def __init__(self, sid):
            self.session_id = sid

    a, b = S("a"), S("b")
    history = responses_api.ResponseHistory(max_kept=3)
    history.keep(a, "r1", None, [{"role": "user", "content": "1"}], lambda sid: True)
    history.keep(a, "r2", "r1", [{"role": "user", "content": "2"}], lambda sid: True)
    assert [m["content"] for m in history.messages(a, "r2")] == ["1", "2"]
    with pytest.raises(ApiError) as err:
        history.messages(b, "r2")
    assert err.value.status == 404 and err.value.code == "previous_response_not_found"
    # Past max_kept: responses of sessions no longer open go first, then the oldest.
    history.keep(b, "r3", None, [], lambda sid: True)
    history.keep(b, "r4", "r3", [], lambda sid: sid != "a")
    assert history.messages(b, "r4") == [] and len(history._kept) == 2
    with pytest.raises(ApiError):
        history.messages(a, "r1")


# ---------------------------------------------------------------------- Messages API


def test_messages_blocks_become_chat_messages():
    req = messages_api.translate_request({
        "model": "claude-x", "system": [{"type": "text", "text": "Be"}, {"type": "text", "text": "terse."}],
        "max_tokens": 9, "temperature": 0.5, "top_k": 5, "stop_sequences": ["###"], "stream": True,
        "thinking": {"type": "enabled", "budget_tokens": 1024}, "metadata": {"user_id": "u"},
        "tools": [{"name": "calc", "description": "d", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "any"},
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "q", "cache_control": {"type": "ephemeral"}},
                                         {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                      "data": "AA=="}}]},
            {"role": "assistant", "content": [{"type": "text", "text": "hm"},
                                              {"type": "tool_use", "id": "t1", "name": "calc", "input": {"x": 1}},
                                              {"type": "tool_use", "id": "t2", "name": "calc", "input": {}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "84"},
                {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
                 "content": [{"type": "text", "text": "boom"}]},
                {"type": "text", "text": "go on"}]},
        ]})
    assert [m["role"] for m in req.messages] == ["system", "user", "assistant", "tool", "tool", "user"]
    assert req.messages[0]["content"] == "Be\nterse."
    assert req.messages[1]["content"][1] == {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}
    assert req.messages[2]["content"] == "hm"
    assert [(c["id"], json.loads(c["function"]["arguments"])) for c in req.messages[2]["tool_calls"]] == [
        ("t1", {"x": 1}), ("t2", {})]
    assert req.messages[3] == {"role": "tool", "tool_call_id": "t1", "content": "84"}
    assert req.messages[4]["content"] == [{"type": "text", "text": "Error: "}, {"type": "text", "text": "boom"}]
    assert req.tools == [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"},
                                                            "description": "d"}}]
    assert req.tool_choice == "required" and req.stream and req.stop_sequences == ("###",)
    assert req.sampling_fields == {"max_tokens": 9, "temperature": 0.5, "top_k": 5, "stop": ["###"]}


@pytest.mark.parametrize("body", [
    {"messages": [{"role": "user", "content": 3}]},
    {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "n", "input": []}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": 5}]}]},
    {"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a",
                                                "content": [{"type": "document"}]}]}]},
    {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file", "file_id": "f"}}]}]},
    {"messages": [{"role": "user", "content": "q"}], "system": [{"type": "image"}]},
    {"messages": [{"role": "user", "content": "q"}], "tools": [{"name": "n", "input_schema": "x"}]},
    {"messages": [{"role": "user", "content": "q"}], "stop_sequences": [""]},
])
def test_messages_bad_requests_are_400(body):
    with pytest.raises(ApiError) as err:
        messages_api.translate_request(body)
    assert err.value.status == 400


def test_a_message_its_stop_reason_and_its_stream(text):
    tool = call_of(text, "Let me compute.\n" + CALL, "msg_a")
    req = messages_api.translate_request({"messages": [{"role": "user", "content": "q"}]})
    msg = messages_api.message_object(tool, req, model="tapioca", raw_text=tool.built.raws[0])
    assert msg["stop_reason"] == "tool_use" and [b["type"] for b in msg["content"]] == ["text", "tool_use"]
    assert msg["content"][1]["input"] == {"expression": "12*7"}
    evs = events(messages_api.stream_events(msg, tool.built.stream_pieces[0]))
    assert [e["type"] for e in evs if e["type"] != "content_block_delta"] == [
        "message_start", "ping", "content_block_start", "content_block_stop", "content_block_start",
        "content_block_stop", "message_delta", "message_stop"]
    assert evs[0]["message"]["content"] == [] and evs[0]["message"]["stop_reason"] is None
    partial = [e["delta"]["partial_json"] for e in evs if e["type"] == "content_block_delta"
               and e["delta"]["type"] == "input_json_delta"]
    assert [json.loads(p) for p in partial] == [{"expression": "12*7"}]
    assert evs[-2]["delta"]["stop_reason"] == "tool_use" and evs[-2]["usage"]["output_tokens"] == len(
        tool.results[0].output_ids)

    stops = messages_api.translate_request({"messages": [{"role": "user", "content": "q"}],
                                            "stop_sequences": ["!!", "##"]})
    hit = call_of(text, "42##", "msg_b")
    assert messages_api.message_object(hit, stops, model="t", raw_text="42##")["stop_reason"] == "stop_sequence"
    assert messages_api.message_object(hit, stops, model="t", raw_text="42##")["stop_sequence"] == "##"
    plain = call_of(text, "42", "msg_c")
    assert messages_api.message_object(plain, stops, model="t", raw_text="42")["stop_reason"] == "end_turn"
    cut = call_of(text, "42", "msg_d", finish="length")
    assert messages_api.message_object(cut, stops, model="t", raw_text="42")["stop_reason"] == "max_tokens"


def test_anthropic_error_shape():
    assert messages_api.error_body(413, "too big") == {
        "type": "error", "error": {"type": "request_too_large", "message": "too big"}}
    assert messages_api.error_body(409, "x")["error"]["type"] == "invalid_request_error"
    assert messages_api.error_body(418, "x")["error"]["type"] == "api_error"
