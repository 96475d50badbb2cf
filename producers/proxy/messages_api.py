"""The Anthropic Messages API on the proxy: ``POST /v1/messages``.

Consumes a Messages request of a session key (``client.messages.create`` of the Anthropic
SDK, Claude-Code-style agents; the key as ``x-api-key`` or a Bearer token) and translates
it to the one internal chat request
(:class:`~tapioca.producers.proxy.chat_call.ChatRequest`): the same chat template,
session lifecycle, head gate, images and trajectory as ``/v1/chat/completions``, so a
session may mix dialects. Emits a ``message`` (or its stream of events) built from the
choice the chat pipeline generated. Every refusal is Anthropic's shape, ``{"type":
"error", "error": {"type", "message"}}``, with the status the chat route gives the same
case (:class:`AnthropicErrors`).

The request, field by field:
    ``system``: a string or text blocks, the first (system) message. ``messages``: user
    and assistant turns, ``content`` a string or blocks: ``text``; ``image`` (``source``
    ``{"type": "base64", "media_type", "data"}``, stored by sha256 like the chat route's
    image parts; a ``url`` source is refused there, the proxy fetches nothing);
    ``tool_use`` (assistant: a tool call, ``input`` an object); ``tool_result`` (user:
    ``tool_use_id``, ``content`` a string or text / image blocks; ``is_error: true`` is
    rendered as ``Error: `` before the content), each a tool message, in the block order.
    Other block types (``document``, ``thinking``, server-tool blocks) are a 400 naming
    the block. An assistant turn sent back as the proxy returned it re-renders to the
    tokens the model generated. ``tools``: ``{"name", "description", "input_schema"}``
    (client tools; a server tool's ``type`` is a 400). ``tool_choice``: ``auto``, ``any``
    (OpenAI's "required"), ``tool`` + ``name``, ``none``. ``max_tokens`` (the run's
    ``gconfig.max_new_tokens`` when left out), ``temperature`` in [0, 1], ``top_p``,
    ``top_k``, ``stop_sequences`` (up to 4), ``stream``. ``model``, ``metadata``,
    ``service_tier`` and ``thinking`` change nothing here (the model thinks as its chat
    template has it; no thinking blocks are returned) and are accepted.

The reply: ``content`` a ``text`` block when the model wrote text, then a ``tool_use``
block per tool call parsed from it (the chat route's parser; its id is the chat route's
tool-call id, ``input`` the arguments object); ``stop_reason`` ``tool_use``,
``max_tokens``, ``stop_sequence`` (with ``stop_sequence``: which of the request's) or
``end_turn``; ``usage`` ``input_tokens`` / ``output_tokens``; ``tapioca``:
``completion_ids`` (a reward names the message id) and ``policy_versions``.
``stream: true``: ``message_start``, ``ping``, per block ``content_block_start``,
``content_block_delta`` (``text_delta`` per token piece, or one ``input_json_delta``),
``content_block_stop``, then ``message_delta`` (stop reason, output tokens) and
``message_stop``. The engine delivers a completion whole, so the events leave together
once it is done.
"""

from __future__ import annotations

import json
import logging
import secrets
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from .chat_call import ChatCall, ChatRequest, run_chat
from .http_requests import json_response, read_body, session_of
from .openai_errors import ApiError
from .service import MAX_STOP, ProxyService, float_field
from .tool_calls import validate_tool_choice, validate_tools

log = logging.getLogger(__name__)

# Anthropic's error types by status (its API has no 409 / 410: those are invalid requests).
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "invalid_request_error", 410: "invalid_request_error",
          413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def invalid(message: str) -> ApiError:
    return ApiError(400, message)


def error_body(status: int, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": _TYPES.get(status, "api_error"), "message": message}}


class AnthropicErrors(APIRoute):
    """Routes whose every refusal (and internal error) is Anthropic's error shape."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except ApiError as exc:
                response = json_response(error_body(exc.status, exc.message), exc.status)
                response.headers.update(exc.headers)
                return response
            except StarletteHTTPException as exc:
                return json_response(error_body(exc.status_code, str(exc.detail)), exc.status_code)
            except Exception as exc:
                log.exception("proxy request failed")
                return json_response(error_body(500, f"internal error: {exc!r}"), 500)

        return route


# ---------------------------------------------------------------------- request -> chat


@dataclass(frozen=True)
class Translated:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: Any
    sampling_fields: dict[str, Any]
    stream: bool
    stop_sequences: tuple[str, ...]


def translate_request(body: dict[str, Any]) -> Translated:
    """``body`` as chat messages, tools and sampling fields; a 400 naming the field otherwise."""
    messages: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        text = system if isinstance(system, str) else _text_blocks(system, "system")
        if text:
            messages.append({"role": "system", "content": text})
    turns = body.get("messages")
    if not isinstance(turns, list) or not turns:
        raise invalid("messages: a non-empty list of {role, content} turns is required")
    for i, turn in enumerate(turns):
        messages += _turn(turn, f"messages.{i}")
    tools = [_tool(t, f"tools.{i}") for i, t in enumerate(_list(body, "tools"))] or None
    if tools:
        validate_tools(tools)
    tool_choice = _tool_choice(body.get("tool_choice"))
    fields: dict[str, Any] = {}
    max_tokens = body.get("max_tokens")
    if max_tokens is not None:
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise invalid("max_tokens: must be an integer >= 1")
        fields["max_tokens"] = max_tokens
    if body.get("temperature") is not None:
        fields["temperature"] = float_field(body, "temperature", 1.0, 0.0, 1.0)
    for key in ("top_p", "top_k"):
        if body.get(key) is not None:
            fields[key] = body[key]
    stops = _list(body, "stop_sequences")
    if len(stops) > MAX_STOP or not all(isinstance(s, str) and s for s in stops):
        raise invalid(f"stop_sequences: up to {MAX_STOP} non-empty strings")
    if stops:
        fields["stop"] = stops
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise invalid("stream: must be true, false or null")
    return Translated(messages, tools, tool_choice, fields, bool(stream), tuple(stops))


def _list(body: dict[str, Any], key: str) -> list[Any]:
    value = body.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise invalid(f"{key}: must be a list")
    return value


def _text_blocks(blocks: Any, where: str) -> str:
    if not isinstance(blocks, list):
        raise invalid(f"{where}: must be a string or a list of text blocks")
    out = []
    for j, b in enumerate(blocks):
        if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
            raise invalid(f"{where}.{j}: only text blocks are allowed here")
        out.append(b["text"])
    return "\n".join(out)


def _image(block: dict[str, Any], where: str) -> dict[str, Any]:
    """An image block as the chat route's image_url part (a data URL)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str) and isinstance(source.get("media_type"), str):
        return {"type": "image_url", "image_url": {"url": f"data:{source['media_type']};base64,{source['data']}"}}
    if kind == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}  # refused there: no fetching
    raise invalid(f"{where}: an image needs source {{\"type\": \"base64\", \"media_type\", \"data\"}}")


def _user_parts(blocks: list[Any], where: str) -> list[dict[str, Any]]:
    """A user turn's blocks as chat messages: runs of text / image blocks one user
    message each, each tool_result a tool message, in order."""
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for j, b in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            parts.append({"type": "text", "text": b["text"]})
        elif kind == "image":
            parts.append(_image(b, at))
        elif kind == "tool_result":
            if parts:
                out.append({"role": "user", "content": parts})
                parts = []
            if not isinstance(b.get("tool_use_id"), str):
                raise invalid(f"{at}: a tool_result needs a string tool_use_id")
            content = b.get("content")
            if content is None or isinstance(content, str):
                result: Any = content or ""
            elif isinstance(content, list):
                result = []
                for k, c in enumerate(content):
                    kk = c.get("type") if isinstance(c, dict) else None
                    if kk == "text" and isinstance(c.get("text"), str):
                        result.append({"type": "text", "text": c["text"]})
                    elif kk == "image":
                        result.append(_image(c, f"{at}.content.{k}"))
                    else:
                        raise invalid(f"{at}.content.{k}: a tool_result holds text and image blocks, "
                                      f"not {kk!r}")
            else:
                raise invalid(f"{at}: tool_result content must be a string or a list of blocks")
            if b.get("is_error"):
                result = ("Error: " + result if isinstance(result, str)
                          else [{"type": "text", "text": "Error: "}] + result)
            out.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": result})
        else:
            raise invalid(f"{at}: block type {kind!r} is not supported in a user turn (text, image, "
                          "tool_result)")
    if parts:
        out.append({"role": "user", "content": parts})
    return out


def _assistant(blocks: list[Any], where: str) -> dict[str, Any]:
    texts, calls = [], []
    for j, b in enumerate(blocks):
        at = f"{where}.content.{j}"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "tool_use":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str) \
                    or not isinstance(b.get("input"), dict):
                raise invalid(f"{at}: a tool_use needs a string id and name and an input object")
            calls.append({"id": b["id"], "type": "function",
                          "function": {"name": b["name"], "arguments": json.dumps(b["input"], ensure_ascii=False)}})
        else:
            raise invalid(f"{at}: block type {kind!r} is not supported in an assistant turn (text, "
                          "tool_use)")
    msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) if texts else None}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _turn(turn: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(turn, dict) or turn.get("role") not in ("user", "assistant"):
        raise invalid(f"{where}: a turn needs role user or assistant")
    content = turn.get("content")
    if isinstance(content, str):
        return [{"role": turn["role"], "content": content}]
    if not isinstance(content, list):
        raise invalid(f"{where}.content: must be a string or a list of blocks")
    if turn["role"] == "assistant":
        return [_assistant(content, where)]
    return _user_parts(content, where)


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "custom") not in ("custom", None):
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise invalid(f"{where}: tool type {kind!r} is not supported; the proxy serves client tools "
                      "({\"name\", \"description\", \"input_schema\"})")
    schema = tool.get("input_schema", {"type": "object"})
    if not isinstance(schema, dict):
        raise invalid(f"{where}.input_schema: must be a JSON Schema object")
    fn: dict[str, Any] = {"name": tool.get("name"), "parameters": schema}
    if tool.get("description") is not None:
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def _tool_choice(choice: Any) -> Any:
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "tool" and isinstance(choice.get("name"), str):
        return validate_tool_choice({"type": "function", "function": {"name": choice["name"]}})
    mapped = {"auto": "auto", "any": "required", "none": "none"}.get(kind)
    if mapped is None:
        raise invalid("tool_choice: {\"type\": \"auto\" | \"any\" | \"none\"} or {\"type\": \"tool\", "
                      "\"name\": ...}")
    return mapped


# ---------------------------------------------------------------------- chat -> message


def message_object(done: ChatCall, req: Translated, *, model: str, raw_text: str) -> dict[str, Any]:
    """The ``message`` of one call (its only choice); ``raw_text``: the decoded output, to
    tell which stop sequence ended it."""
    choice = done.built.choices[0]
    msg = choice["message"]
    calls = msg.get("tool_calls") or []
    content: list[dict[str, Any]] = []
    if msg.get("content") is not None or not calls:
        content.append({"type": "text", "text": msg.get("content") or ""})
    for call in calls:
        try:
            args = json.loads(call["function"]["arguments"])
        except json.JSONDecodeError:
            args = call["function"]["arguments"]
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        # input must be an object: arguments the model wrote as another
                        # JSON value are kept under "arguments".
                        "input": args if isinstance(args, dict) else {"arguments": args}})
    stop_sequence = None
    if calls:
        stop_reason = "tool_use"
    elif choice["finish_reason"] == "length":
        stop_reason = "max_tokens"
    else:
        hits = [(raw_text.find(s), s) for s in req.stop_sequences if s in raw_text]
        stop_sequence = min(hits)[1] if hits else None
        stop_reason = "stop_sequence" if stop_sequence else "end_turn"
    return {"id": done.call_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": done.usage["prompt_tokens"],
                      "output_tokens": done.usage["completion_tokens"],
                      "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0},
            "tapioca": done.extra}


def stream_events(message: dict[str, Any], pieces: list[str]) -> list[bytes]:
    """The Messages stream of a finished ``message`` (``pieces``: its text's token pieces)."""
    out: list[bytes] = []

    def event(kind: str, **fields: Any) -> None:
        out.append(b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n")

    usage = message["usage"]
    event("message_start", message={**message, "content": [], "stop_reason": None, "stop_sequence": None,
                                    "usage": {**usage, "output_tokens": 0}})
    event("ping")
    for index, block in enumerate(message["content"]):
        if block["type"] == "text":
            event("content_block_start", index=index, content_block={"type": "text", "text": ""})
            for piece in pieces or ([block["text"]] if block["text"] else []):
                event("content_block_delta", index=index, delta={"type": "text_delta", "text": piece})
        else:
            event("content_block_start", index=index, content_block={**block, "input": {}})
            event("content_block_delta", index=index,
                  delta={"type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)})
        event("content_block_stop", index=index)
    event("message_delta", delta={"stop_reason": message["stop_reason"], "stop_sequence": message["stop_sequence"]},
          usage={"output_tokens": usage["output_tokens"]})
    event("message_stop")
    return out


# ---------------------------------------------------------------------- the route


def messages_router(svc: ProxyService) -> APIRouter:
    router = APIRouter(route_class=AnthropicErrors)

    @router.post("/v1/messages")
    async def create_message(request: Request) -> Response:
        session = session_of(svc, request)
        body = await read_body(svc, request)
        req = translate_request(body)
        sampling, _ = svc.sampling_from(req.sampling_fields)
        done = await run_chat(svc, session, ChatRequest(req.messages, req.tools, req.tool_choice, sampling,
                                                        1, False, req.stream),
                              f"msg_{secrets.token_hex(12)}")
        message = message_object(done, req, model=svc.served_model_name, raw_text=done.built.raws[0])
        if not req.stream:
            return json_response(message)
        events = stream_events(message, done.built.stream_pieces[0])

        async def send() -> AsyncIterator[bytes]:
            for e in events:
                yield e

        return StreamingResponse(send(), media_type="text/event-stream")

    return router
