"""Qwen-style tool use: tools rendered into the prompt, ``<tool_call>`` blocks parsed out.

Consumes OpenAI chat ``messages`` / ``tools`` and generated text; emits template-ready
messages and OpenAI ``tool_calls``. Pure functions, no I/O.

The format is Qwen2.5's (its chat template's tools block, verbatim in structure):
the model writes ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` and
tool results come back wrapped in ``<tool_response>...</tool_response>``. A chat
template that handles ``tools`` itself (it mentions ``tools``, as Qwen's does) gets
them passed through; for one that does not (the char tokenizer's), the proxy renders
the tools block into the system message and tool turns as text, so any template can
serve a tool-using agent.

Token alignment: an assistant message the client sends back is re-rendered from the
model's own raw text when the proxy recognises it (one of its tool-call ids, or the
exact content it returned), so the tokens the next call sees are the tokens the model
generated, not a reformatted JSON.
"""

from __future__ import annotations

import json
import re
from typing import Any, Mapping

from .openai_errors import bad_request

TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def render_tools_prompt(tools: list[Mapping[str, Any]]) -> str:
    """The tools block of Qwen2.5's template: one JSON line per tool."""
    lines = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
    return TOOLS_HEADER + lines + TOOLS_FOOTER


def validate_tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of {type: function, function: {...}}", "tools")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}] needs a function with a name", f"tools[{i}]")
    return tools


def validate_tool_choice(choice: Any) -> Any:
    """OpenAI's ``tool_choice``: null, "none", "auto", "required" or
    ``{"type": "function", "function": {"name": str}}`` (the last two are accepted but
    not enforced: the model decides; "none" stops parsing tool calls)."""
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request('tool_choice must be "none", "auto", "required" or '
                          '{"type": "function", "function": {"name": ...}}', "tool_choice")
    return choice


def validate_tool_call(call: Any, where: str) -> None:
    """An assistant message's tool call as the OpenAI API defines it: ``{"id": str,
    "type": "function", "function": {"name": str, "arguments": str | object}}``."""
    if not isinstance(call, dict):
        raise bad_request(f"{where} must be an object with id, type and function", where)
    if not isinstance(call.get("id"), str):
        raise bad_request(f"{where}.id must be a string", where)
    if call.get("type", "function") != "function":
        raise bad_request(f"{where}.type must be \"function\"", where)
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"{where}.function must be an object with a string name", where)
    if not isinstance(fn.get("arguments", "{}"), (str, dict)):
        raise bad_request(f"{where}.function.arguments must be a JSON string or an object", where)


def parse_tool_calls(text: str, id_prefix: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split generated ``text`` into (content, OpenAI tool_calls).

    Each well-formed ``<tool_call>{"name": str, "arguments": obj}</tool_call>`` block
    becomes a tool call with id ``{id_prefix}_{i}`` (arguments as a JSON string, as the
    OpenAI API sends them) and is removed from the content. A block that is not valid
    JSON with a string ``name`` is left in the content: the agent sees what the model
    wrote rather than a silently dropped call.
    """
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for m in TOOL_CALL_RE.finditer(text):
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        kept.append(text[pos:m.start()])
        pos = m.end()
        calls.append({
            "id": f"{id_prefix}_{len(calls)}",
            "type": "function",
            "function": {"name": obj["name"],
                         "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)},
        })
    if not calls:
        return text, []
    kept.append(text[pos:])
    return "".join(kept).strip() or None, calls


def message_text(content: Any, where: str) -> str:
    """OpenAI content (a string, null, or a list of text parts) as one string."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}: only text content parts are supported", where)
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request(f"{where}: content must be a string, null or a list of text parts", where)


def _tool_call_text(call: Mapping[str, Any]) -> str:
    fn = call.get("function") or {}
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        pass
    return "<tool_call>\n" + json.dumps({"name": fn.get("name", ""), "arguments": args},
                                        ensure_ascii=False) + "\n</tool_call>"


def prepare_messages(
    messages: Any,
    tools: list[dict[str, Any]] | None,
    *,
    template_has_tools: bool,
    raw_by_tool_call_id: Mapping[str, str],
    raw_by_content: Mapping[str, str],
) -> list[dict[str, Any]]:
    """OpenAI ``messages`` as messages the chat template renders (see module docstring)."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages must be a non-empty list", "messages")
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("system", "developer", "user", "assistant", "tool"):
            raise bad_request(f"{where} needs a role: system, developer, user, assistant or tool", where)
        role = "system" if m["role"] == "developer" else m["role"]
        text = message_text(m.get("content"), where)
        if role == "assistant":
            calls = m.get("tool_calls") or []
            if not isinstance(calls, list):
                raise bad_request(f"{where}.tool_calls must be a list", where)
            for j, c in enumerate(calls):
                validate_tool_call(c, f"{where}.tool_calls[{j}]")
            ids = [c["id"] for c in calls]
            if (calls and all(i in raw_by_tool_call_id for i in ids)
                    and len(set(raw_by_tool_call_id[i] for i in ids)) == 1):
                out.append({"role": "assistant", "content": raw_by_tool_call_id[ids[0]]})
            elif not calls and text in raw_by_content:
                out.append({"role": "assistant", "content": raw_by_content[text]})
            elif calls and template_has_tools:
                out.append({"role": "assistant", "content": text, "tool_calls": [
                    {"type": "function", "function": {
                        "name": c["function"]["name"],
                        "arguments": _parse_args(c["function"].get("arguments", "{}"))}}
                    for c in calls]})
            else:
                blocks = [_tool_call_text(c) for c in calls]
                out.append({"role": "assistant", "content": "\n".join(([text] if text else []) + blocks)})
        elif role == "tool":
            if not isinstance(m.get("tool_call_id", ""), str):
                raise bad_request(f"{where}.tool_call_id must be a string", where)
            if template_has_tools:
                out.append({"role": "tool", "content": text})
            else:
                out.append({"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"})
        else:
            out.append({"role": role, "content": text})
    if tools and not template_has_tools:
        block = render_tools_prompt(tools)
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _parse_args(args: Any) -> Any:
    if isinstance(args, str):
        try:
            return json.loads(args)
        except json.JSONDecodeError:
            return args
    return args
