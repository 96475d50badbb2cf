"""Qwen-style tool calls: parsing generated text, rendering tools and tool turns."""

from __future__ import annotations

import json

import pytest

from tapioca.producers.proxy.openai_errors import ApiError
from tapioca.producers.proxy.tool_calls import (
    parse_tool_calls,
    prepare_messages,
    render_tools_prompt,
    validate_tool_choice,
)

TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}}}}]


def test_parse_one_and_several_tool_calls():
    text = 'Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>'
    content, calls = parse_tool_calls(text, "call_x")
    assert content == "Let me compute."
    assert calls == [{"id": "call_x_0", "type": "function",
                      "function": {"name": "calculator", "arguments": '{"expression": "2*3"}'}}]
    two = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
           '<tool_call>{"name": "b", "arguments": "{\\"k\\": 1}"}</tool_call>')
    content, calls = parse_tool_calls(two, "c")
    assert content is None
    assert [c["function"]["name"] for c in calls] == ["a", "b"]
    assert [c["id"] for c in calls] == ["c_0", "c_1"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"k": 1}  # a string stays a string


def test_malformed_tool_calls_stay_in_the_content():
    for text in ['<tool_call>{"name": calc</tool_call>', '<tool_call>[1, 2]</tool_call>',
                 '<tool_call>{"arguments": {}}</tool_call>', "<tool_call>{\"name\": \"x\"}", "plain text"]:
        content, calls = parse_tool_calls(text, "c")
        assert calls == [] and content == text


def test_tools_block_is_rendered_into_the_system_message():
    msgs = prepare_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                            TOOLS, template_has_tools=False, raw_by_tool_call_id={}, raw_by_content={})
    system = msgs[0]["content"]
    assert system.startswith("Be brief.\n\n# Tools") and system.endswith("</tool_call>")
    assert json.dumps(TOOLS[0]) in system and "<tools>" in system
    assert render_tools_prompt(TOOLS) in system
    no_system = prepare_messages([{"role": "user", "content": "hi"}], TOOLS, template_has_tools=False,
                                 raw_by_tool_call_id={}, raw_by_content={})
    assert no_system[0] == {"role": "system", "content": render_tools_prompt(TOOLS)}
    # A template that renders tools itself gets the messages unchanged.
    native = prepare_messages([{"role": "user", "content": "hi"}], TOOLS, template_has_tools=True,
                              raw_by_tool_call_id={}, raw_by_content={})
    assert native == [{"role": "user", "content": "hi"}]


def test_tool_turns_render_as_text_or_from_the_raw_generation():
    call = {"id": "call_7_0", "type": "function",
            "function": {"name": "calculator", "arguments": '{"expression": "1+1"}'}}
    history = [{"role": "user", "content": "q"},
               {"role": "assistant", "content": "", "tool_calls": [call]},
               {"role": "tool", "tool_call_id": "call_7_0", "content": "2"}]
    # Unknown id: rendered Qwen-style from the call.
    msgs = prepare_messages(history, None, template_has_tools=False, raw_by_tool_call_id={},
                            raw_by_content={})
    assert msgs[1] == {"role": "assistant", "content":
                       '<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>'}
    assert msgs[2] == {"role": "user", "content": "<tool_response>\n2\n</tool_response>"}
    # The proxy's own call id: the model's raw text comes back verbatim.
    raw = '<tool_call>{"name":"calculator","arguments":{"expression":"1+1"}}</tool_call>'
    msgs = prepare_messages(history, None, template_has_tools=False,
                            raw_by_tool_call_id={"call_7_0": raw}, raw_by_content={})
    assert msgs[1] == {"role": "assistant", "content": raw}
    # Plain content the proxy returned (e.g. cut at a stop string) maps to the raw text.
    msgs = prepare_messages([{"role": "assistant", "content": "4"}], None, template_has_tools=False,
                            raw_by_tool_call_id={}, raw_by_content={"4": "4 STOP"})
    assert msgs == [{"role": "assistant", "content": "4 STOP"}]


def test_content_parts_and_bad_messages():
    msgs = prepare_messages([{"role": "developer", "content": [{"type": "text", "text": "a"},
                                                               {"type": "text", "text": "b"}]}],
                            None, template_has_tools=False, raw_by_tool_call_id={}, raw_by_content={})
    assert msgs == [{"role": "system", "content": "ab"}]
    for bad in ([], "hi", [{"role": "robot", "content": "x"}],
                [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                [{"role": "user", "content": 5}]):
        with pytest.raises(ApiError) as err:
            prepare_messages(bad, None, template_has_tools=False, raw_by_tool_call_id={}, raw_by_content={})
        assert err.value.status == 400 and err.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("calls", [
    [1],
    [{"function": "x"}],
    [{"id": "c0", "type": "function", "function": "calculator"}],
    [{"id": ["unhashable"], "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    [{"id": {"a": 1}, "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    [{"id": "c0", "type": "function", "function": {"name": 3, "arguments": "{}"}}],
    [{"id": "c0", "type": "function", "function": {"name": "f", "arguments": [1]}}],
    [{"id": "c0", "type": "retrieval", "function": {"name": "f", "arguments": "{}"}}],
    "not a list",
])
def test_malformed_assistant_tool_calls_are_400(calls):
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": calls}]
    for native in (False, True):
        with pytest.raises(ApiError) as err:
            prepare_messages(msgs, None, template_has_tools=native, raw_by_tool_call_id={"c0": "raw"},
                             raw_by_content={})
        assert err.value.status == 400 and err.value.param.startswith("messages[1]")


def test_tool_choice_and_tool_message_fields():
    for ok in (None, "none", "auto", "required", {"type": "function", "function": {"name": "f"}}):
        assert validate_tool_choice(ok) == ok
    for bad in ("sometimes", 1, {"type": "function"}, ["auto"]):
        with pytest.raises(ApiError) as err:
            validate_tool_choice(bad)
        assert err.value.status == 400 and err.value.param == "tool_choice"
    with pytest.raises(ApiError):
        prepare_messages([{"role": "tool", "tool_call_id": [1], "content": "2"}], None,
                         template_has_tools=False, raw_by_tool_call_id={}, raw_by_content={})
