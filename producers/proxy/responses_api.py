"""The OpenAI Responses API on the proxy: ``POST /v1/responses`` (and AReaL's ``/responses``).

Consumes a Responses request of a session key (``client.responses.create``: Codex-style
agents, the OpenAI Agents SDK) and translates it to the one internal chat request
(:class:`~tapioca.producers.proxy.chat_call.ChatRequest`): the same chat template, session
lifecycle, head gate, images and trajectory as ``/v1/chat/completions``, so a session may
mix the two. Emits a ``response`` object (or its stream of events) built from the
choice the chat pipeline generated. Errors: OpenAI's ``{"error": {...}}``.

The request, field by field:
    ``input``: a string (one user message) or items: messages (``role`` user / system /
    developer / assistant; ``content`` a string or parts ``input_text``, ``output_text``,
    ``refusal``, ``input_image`` with a data URL), ``function_call`` (an assistant turn's
    tool call; consecutive ones join the assistant message before them) and
    ``function_call_output`` (a tool message). Items sent back as the proxy returned them
    re-render to the tokens the model generated (tool-call ids, returned text).
    ``instructions``: a system message first (not carried over by
    ``previous_response_id``, as the API says). ``previous_response_id``: a response of
    this session; its input and output come before ``input`` (404
    ``previous_response_not_found`` otherwise; kept while the session is open).
    ``tools``: function tools (``{"type": "function", "name", "description",
    "parameters"}``), rendered as the chat route renders them; another tool type is a 400.
    ``tool_choice``: "none" / "auto" / "required" / ``{"type": "function", "name"}``.
    ``max_output_tokens``, ``temperature``, ``top_p``, ``stream``. ``include``:
    ``"message.output_text.logprobs"`` returns each token's logprob (``top_logprobs`` > 0
    is a 400: the engines give no alternatives); other includes name nothing the proxy
    makes (no reasoning items) and are accepted. Refused (400 ``unsupported_value``):
    ``background: true``, ``conversation`` (use ``previous_response_id``), a ``text.format``
    other than text (structured output is not enforced). ``model``, ``store``,
    ``metadata``, ``parallel_tool_calls``, ``reasoning``, ``truncation``, ``user`` and the
    like change nothing here and are accepted.

The reply: ``output`` holds a ``message`` item (``output_text``) when the model wrote
text, then a ``function_call`` item per tool call parsed from it (the chat route's
parser; ``call_id`` is the chat route's tool-call id); ``status`` ``incomplete`` with
``incomplete_details.reason: max_output_tokens`` when the budget ran out. ``tapioca``:
``completion_ids`` (a reward names the response id, or ``{id}:0``) and
``policy_versions``. ``stream: true``: ``response.created``, ``response.in_progress``,
per item ``response.output_item.added`` ... (``response.output_text.delta`` per token
piece, or ``response.function_call_arguments.delta``) ... ``response.output_item.done``,
then ``response.completed`` (``response.incomplete``). The engine delivers a completion
whole, so the events leave together once it is done.
"""

from __future__ import annotations

import secrets
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from .chat_call import ChatCall, ChatRequest, run_chat
from .http_requests import json_response, read_body, session_of
from .openai_errors import ApiError, bad_request
from .service import ProxyService, int_field
from .sessions import Session
from .tool_calls import validate_tool_choice, validate_tools

LOGPROBS_INCLUDE = "message.output_text.logprobs"
MAX_TOP_LOGPROBS = 20
# Responses kept for previous_response_id, over all open sessions (oldest forgotten first);
# each holds only its own new messages (at most one request body, proxy.max_request_bytes).
MAX_KEPT_RESPONSES = 10_000
# Every this many responses, those of sessions no longer open are forgotten.
PRUNE_EVERY = 256


def unsupported(message: str, param: str) -> ApiError:
    return bad_request(message, param, code="unsupported_value")


# ---------------------------------------------------------------------- request -> chat


@dataclass(frozen=True)
class Translated:
    """A Responses request as the chat pipeline takes it (``sampling_fields``: what
    :meth:`ProxyService.sampling_from` reads)."""

    messages: list[dict[str, Any]]
    # The messages of ``input`` alone (a later previous_response_id brings them back).
    new_messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: Any
    sampling_fields: dict[str, Any]
    stream: bool
    logprobs: bool
    previous_response_id: str | None


def translate_request(body: dict[str, Any], history: list[dict[str, Any]] | None = None) -> Translated:
    """``body`` as chat messages, tools and sampling fields (``history``: the messages of
    ``previous_response_id``, found by the caller); a 400 naming the field otherwise."""
    if body.get("background"):
        raise unsupported("background responses are not supported: the proxy answers each call "
                          "while the session waits", "background")
    if body.get("conversation") is not None:
        raise unsupported("conversation objects are not supported; chain calls with "
                          "previous_response_id or send the whole input", "conversation")
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(fmt, dict) and fmt.get("type", "text") != "text":
        raise unsupported(f"text.format {fmt.get('type')!r} is not supported: the proxy does not "
                          "constrain the model's output to a schema; use {\"type\": \"text\"}", "text")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("instructions must be a string or null", "instructions")
    inp = body.get("input")
    if isinstance(inp, str):
        items: list[Any] = [{"role": "user", "content": inp}]
    elif isinstance(inp, list):
        items = inp
    else:
        raise bad_request("input must be a string or a list of items", "input")
    new = input_messages(items)
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + list(history or []) + new
    if not messages:
        raise bad_request("input is empty: send a message", "input")
    tools = [function_tool(t, f"tools[{i}]") for i, t in enumerate(_list(body, "tools"))] or None
    if tools:
        validate_tools(tools)
    tool_choice = translate_tool_choice(body.get("tool_choice"))
    include = _list(body, "include")
    if not all(isinstance(x, str) for x in include):
        raise bad_request("include must be a list of strings", "include")
    logprobs = LOGPROBS_INCLUDE in include
    top = int_field(body, "top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
    if top:
        raise unsupported(f"top_logprobs={top} is not supported: the proxy's engines return the sampled "
                          f"token's logprob only; include {LOGPROBS_INCLUDE!r} for it", "top_logprobs")
    fields: dict[str, Any] = {k: body[k] for k in ("temperature", "top_p") if body.get(k) is not None}
    max_out = body.get("max_output_tokens")
    if max_out is not None:
        if not isinstance(max_out, int) or isinstance(max_out, bool) or max_out < 1:
            raise bad_request("max_output_tokens must be an integer >= 1", "max_output_tokens")
        fields["max_tokens"] = max_out
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("stream must be true, false or null", "stream")
    prev = body.get("previous_response_id")
    if prev is not None and not isinstance(prev, str):
        raise bad_request("previous_response_id must be a string or null", "previous_response_id")
    return Translated(messages, new, tools, tool_choice, fields, bool(stream), logprobs, prev)


def _list(body: dict[str, Any], key: str) -> list[Any]:
    value = body.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_request(f"{key} must be a list", key)
    return value


def function_tool(tool: Any, where: str) -> dict[str, Any]:
    """A Responses function tool as a chat tool."""
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise unsupported(f"{where}: tool type {kind!r} is not supported; the proxy serves function "
                          "tools ({\"type\": \"function\", \"name\", \"parameters\"})", "tools")
    fn = {"name": tool.get("name")}
    for key in ("description", "parameters"):
        if tool.get(key) is not None:
            fn[key] = tool[key]
    return {"type": "function", "function": fn}


def translate_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise unsupported('tool_choice must be "none", "auto", "required" or {"type": "function", '
                              '"name": ...}', "tool_choice")
        return validate_tool_choice({"type": "function", "function": {"name": choice["name"]}})
    return validate_tool_choice(choice)


def _parts(content: Any, where: str) -> str | list[dict[str, Any]]:
    """Responses content (a string or parts) as chat content."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of parts", "input")
    out: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        at = f"{where}.content[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text") and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            out.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise unsupported(f"{at}: an input_image needs image_url (a data: URL); file ids are "
                                  "not supported", "input")
            out.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "input_file":
            raise unsupported(f"{at}: input_file parts are not supported; send the text", "input")
        else:
            raise bad_request(f"{at}: part type {kind!r} is not supported (input_text, output_text, "
                              "refusal, input_image)", "input")
    return out


def input_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Responses input items as chat messages (see the module docstring)."""
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object (a message or a function_call item)", "input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role must be user, system, developer or assistant", "input")
            out.append({"role": role, "content": _parts(item.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise bad_request(f"{where}: a function_call needs string call_id, name and arguments",
                                  "input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}: a function_call_output needs a string call_id", "input")
            output = item.get("output")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": _parts(output if output is not None else "", where)})
        elif kind in ("reasoning", "item_reference"):
            raise unsupported(f"{where}: {kind} items are not supported (the proxy makes no reasoning "
                              "items and stores no items by reference); send messages and "
                              "function calls", "input")
        else:
            raise bad_request(f"{where}: item type {kind!r} is not supported (message, function_call, "
                              "function_call_output)", "input")
    return out


# ---------------------------------------------------------------------- chat -> response


def response_object(done: ChatCall, body: dict[str, Any], req: Translated, *, model: str,
                    created: float) -> dict[str, Any]:
    """The ``response`` of one call (its first and only choice)."""
    choice = done.built.choices[0]
    msg = choice["message"]
    incomplete = choice["finish_reason"] == "length"
    status = "incomplete" if incomplete else "completed"
    output: list[dict[str, Any]] = []
    calls = msg.get("tool_calls") or []
    if msg.get("content") is not None or not calls:
        text = {"type": "output_text", "text": msg.get("content") or "", "annotations": []}
        if req.logprobs:
            text["logprobs"] = choice["logprobs"]["content"]
        output.append({"id": f"msg_{secrets.token_hex(12)}", "type": "message", "role": "assistant",
                       "status": status, "content": [text]})
    for call in calls:
        output.append({"id": f"fc_{secrets.token_hex(12)}", "type": "function_call", "status": "completed",
                       "call_id": call["id"], "name": call["function"]["name"],
                       "arguments": call["function"]["arguments"]})
    usage = done.usage
    s = done.results[0]
    return {
        "id": done.call_id, "object": "response", "created_at": created, "status": status,
        "completed_at": time.time(), "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
        "model": model, "output": output, "parallel_tool_calls": True,
        "previous_response_id": req.previous_response_id,
        "temperature": body.get("temperature"), "top_p": body.get("top_p"),
        "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
        "text": {"format": {"type": "text"}}, "truncation": "disabled",
        "metadata": body.get("metadata") or {}, "store": True,
        "usage": {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                  "total_tokens": usage["total_tokens"],
                  "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                  "output_tokens_details": {"reasoning_tokens": 0}},
        "tapioca": {**done.extra, "finish_reason": s.finish_reason},
    }


def assistant_message(response: dict[str, Any]) -> dict[str, Any]:
    """The chat message a response's output is in the next call's history."""
    text = None
    calls = []
    for item in response["output"]:
        if item["type"] == "message":
            text = item["content"][0]["text"]
        else:
            calls.append({"id": item["call_id"], "type": "function",
                          "function": {"name": item["name"], "arguments": item["arguments"]}})
    return {"role": "assistant", "content": text, **({"tool_calls": calls} if calls else {})}


def stream_events(response: dict[str, Any], pieces: list[str]) -> list[bytes]:
    """The Responses stream of a finished ``response`` (``pieces``: its text's token pieces)."""
    out: list[bytes] = []

    def event(kind: str, **fields: Any) -> None:
        out.append(b"event: " + kind.encode() + b"\ndata: "
                   + orjson.dumps({"type": kind, "sequence_number": len(out), **fields}) + b"\n\n")

    start = {**response, "status": "in_progress", "output": [], "usage": None, "completed_at": None,
             "incomplete_details": None}
    event("response.created", response=start)
    event("response.in_progress", response=start)
    for index, item in enumerate(response["output"]):
        at = {"item_id": item["id"], "output_index": index}
        if item["type"] == "message":
            part = item["content"][0]
            event("response.output_item.added", output_index=index,
                  item={**item, "status": "in_progress", "content": []})
            event("response.content_part.added", **at, content_index=0,
                  part={"type": "output_text", "text": "", "annotations": []})
            for piece in pieces or ([part["text"]] if part["text"] else []):
                event("response.output_text.delta", **at, content_index=0, delta=piece, logprobs=[])
            event("response.output_text.done", **at, content_index=0, text=part["text"],
                  logprobs=part.get("logprobs") or [])
            event("response.content_part.done", **at, content_index=0, part=part)
        else:
            event("response.output_item.added", output_index=index,
                  item={**item, "status": "in_progress", "arguments": ""})
            event("response.function_call_arguments.delta", **at, delta=item["arguments"])
            event("response.function_call_arguments.done", **at, name=item["name"],
                  arguments=item["arguments"])
        event("response.output_item.done", output_index=index, item=item)
    event("response.incomplete" if response["status"] == "incomplete" else "response.completed",
          response=response)
    return out


# ---------------------------------------------------------------------- history


class ResponseHistory:
    """What ``previous_response_id`` refers to, per open session: each response's new
    messages (its input and its output) and its parent, so a chain of n calls is kept
    in O(n) messages. Forgotten when the session is no longer open (checked every
    :data:`PRUNE_EVERY` responses) or past :data:`MAX_KEPT_RESPONSES`, oldest first."""

    def __init__(self, max_kept: int = MAX_KEPT_RESPONSES, prune_every: int = PRUNE_EVERY) -> None:
        self.max_kept = max_kept
        self.prune_every = prune_every
        self._added = 0
        self._lock = threading.Lock()
        # response id -> (session id, parent response id, its messages)
        self._kept: dict[str, tuple[str, str | None, list[dict[str, Any]]]] = {}

    def messages(self, session: Session, response_id: str) -> list[dict[str, Any]]:
        chain: list[list[dict[str, Any]]] = []
        with self._lock:
            rid: str | None = response_id
            while rid is not None:
                entry = self._kept.get(rid)
                if entry is None or entry[0] != session.session_id:
                    raise ApiError(404, f"previous response {response_id!r} was not found in this "
                                   "session (responses are kept while their session is open)",
                                   param="previous_response_id", code="previous_response_not_found")
                chain.append(entry[2])
                rid = entry[1]
        return [m for part in reversed(chain) for m in part]

    def keep(self, session: Session, response_id: str, parent: str | None,
             messages: list[dict[str, Any]], is_open) -> None:
        with self._lock:
            self._kept[response_id] = (session.session_id, parent, messages)
            self._added += 1
            if len(self._kept) > self.max_kept or self._added % self.prune_every == 0:
                for rid in [r for r, e in self._kept.items() if not is_open(e[0])]:
                    del self._kept[rid]
                while len(self._kept) > self.max_kept:
                    del self._kept[next(iter(self._kept))]


# ---------------------------------------------------------------------- the route


def responses_router(svc: ProxyService) -> APIRouter:
    router = APIRouter()
    history = ResponseHistory()

    @router.post("/v1/responses")
    @router.post("/responses")  # AReaL's online proxy serves it at the root
    async def create_response(request: Request) -> Response:
        session = session_of(svc, request)
        body = await read_body(svc, request)
        prev = body.get("previous_response_id")
        past = history.messages(session, prev) if isinstance(prev, str) else None
        req = translate_request(body, past)
        sampling, _ = svc.sampling_from(req.sampling_fields)
        created = time.time()
        done = await run_chat(svc, session, ChatRequest(req.messages, req.tools, req.tool_choice, sampling,
                                                        1, req.logprobs, req.stream),
                              f"resp_{secrets.token_hex(12)}")
        response = response_object(done, body, req, model=svc.served_model_name, created=created)
        history.keep(session, done.call_id, req.previous_response_id,
                     req.new_messages + [assistant_message(response)],
                     lambda sid: svc.store.open_session(sid) is not None)
        if not req.stream:
            return json_response(response)
        events = stream_events(response, done.built.stream_pieces[0])

        async def send() -> AsyncIterator[bytes]:
            for e in events:
                yield e

        return StreamingResponse(send(), media_type="text/event-stream")

    return router
