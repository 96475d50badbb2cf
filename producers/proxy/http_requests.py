"""What every route of the agent proxy does first: read the body, find the key, the session.

Consumes an HTTP request (a Starlette ``Request``) and the proxy's
:class:`~tapioca.producers.proxy.service.ProxyService`; emits the parsed JSON body, the
caller's key, and the open :class:`~tapioca.producers.proxy.sessions.Session` it names,
or an :class:`~tapioca.producers.proxy.openai_errors.ApiError` saying what is wrong.
Every dialect's router (chat, Responses, Messages, sessions) uses these, so a key, a body
limit and a refusal mean the same thing on every route; each router renders the refusal
in its own dialect's error shape.

A key comes as ``Authorization: Bearer <key>`` (the OpenAI SDK, AReaL's clients) or as
``x-api-key: <key>`` (the Anthropic SDK); the Bearer header wins when both are sent.
"""

from __future__ import annotations

import secrets
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response

from .openai_errors import ApiError, bad_request
from .service import ProxyService
from .sessions import Session


def json_response(obj: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json")


async def read_body(svc: ProxyService, request: Request) -> dict[str, Any]:
    """The request's JSON object; 413 past ``proxy.max_request_bytes`` (read in chunks,
    so a huge body is refused without being held), 400 when it is not a JSON object."""
    limit = svc.max_request_bytes
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"request body of {length} bytes exceeds proxy.max_request_bytes={limit}",
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body exceeds proxy.max_request_bytes={limit}",
                           code="request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw:
        return {}
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise bad_request("the body must be a JSON object", code="invalid_json")
    return obj


def request_key(request: Request) -> str:
    """The caller's key: ``Authorization: Bearer <key>``, else ``x-api-key``; 401 if none."""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        return key.strip()
    key = request.headers.get("x-api-key", "").strip()
    if key:
        return key
    raise ApiError(401, "missing API key: send Authorization: Bearer <key> (or x-api-key: <key>)",
                   code="invalid_api_key")


def is_admin(svc: ProxyService, key: str) -> bool:
    return secrets.compare_digest(key.encode(), svc.api_key.encode())


def session_of(svc: ProxyService, request: Request) -> Session:
    """The open session of the caller's session key (completions: never the admin key)."""
    key = request_key(request)
    if is_admin(svc, key):
        raise ApiError(403, "completions need a session key: start a session with POST "
                       "/v1/sessions and use its api_key", code="session_key_required")
    return svc.store.by_api_key(key)


def own_session(svc: ProxyService, request: Request, session_id: str) -> Session:
    """Session ``session_id``, for its own key or the admin key (403 for another's key)."""
    key = request_key(request)
    if is_admin(svc, key):
        return svc.store.get(session_id)
    session = svc.store.by_api_key(key)
    if session.session_id != session_id:
        raise ApiError(403, "this API key belongs to another session", code="wrong_session")
    return session
