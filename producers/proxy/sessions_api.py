"""The session routes of the agent proxy, and AReaL's online-proxy names for them.

Consumes the HTTP requests of a harness (its admin key or a session key): session starts,
rewards and ends. Emits, through :class:`~tapioca.producers.proxy.service.ProxyService`,
the finished groups' ``TrajectoryEvent`` / ``RewardEvent`` batches (keyed by
``group_id``) and a reward given after the end. The API is in
:mod:`tapioca.producers.proxy.server`'s docstring; errors are OpenAI's shape.

AReaL's online proxy (``areal/experimental/openai/proxy``) names the same steps
``/rl/start_session``, ``/rl/set_reward`` and ``/rl/end_session``, at the server's root;
they are served here with AReaL's bodies, so a harness written for it needs only a new
base URL (docs/agents.md has the table):

- ``POST /rl/start_session`` (admin key) ``{"task_id": str, "api_key": str|null}``:
  ``POST /v1/sessions`` with ``task_data.prompt_id = task_id`` (AReaL's task id is the
  prompt's); any field of ``/v1/sessions`` may be added. Reply: ``/v1/sessions``'s.
- ``POST /rl/set_reward`` (the session's key) ``{"reward": float, "interaction_id":
  str|null}``: the reward of that completion (a response id, ``{id}:{choice}``), or of
  the last one; with the admin key, name the session: ``"session_id"`` (a reward after
  the end goes to the whole session). Reply: ``{"message": "success", ...}`` + the
  reward route's.
- ``POST /rl/end_session`` (the session's key, or the admin key and ``"session_id"``)
  ``{"mode", "discount"}`` optional: ``end``. Reply: ``{"message": "success",
  "interaction_count": completions made, ...}`` + ``end``'s.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from .delayed_rewards import check_reward
from .http_requests import is_admin, json_response, own_session, read_body, request_key
from .openai_errors import ApiError, bad_request
from .service import ProxyService, float_field, int_field


def sessions_router(svc: ProxyService) -> APIRouter:
    router = APIRouter()

    def require_admin(request: Request) -> None:
        if not is_admin(svc, request_key(request)):
            raise ApiError(401, "starting a session needs the proxy's admin key (proxy.api_key)",
                           code="invalid_api_key")

    @router.post("/v1/sessions")
    async def start_session(request: Request) -> Response:
        require_admin(request)
        return await _start(svc, request, await read_body(svc, request))

    @router.post("/rl/start_session")
    async def rl_start_session(request: Request) -> Response:
        require_admin(request)
        body = await read_body(svc, request)
        task_id = body.pop("task_id", None)
        if task_id is not None:
            if not isinstance(task_id, str) or not task_id:
                raise bad_request("task_id must be a non-empty string", "task_id")
            task_data = body.get("task_data") or {}
            if not isinstance(task_data, dict):
                raise bad_request("task_data must be an object", "task_data")
            body["task_data"] = {"prompt_id": task_id, **task_data}
        return await _start(svc, request, body)

    @router.post("/v1/sessions/{session_id}/reward")
    async def set_reward(session_id: str, request: Request) -> Response:
        key = request_key(request)
        body = await read_body(svc, request)
        return json_response(await _reward(svc, session_id, key, body, body.get("completion_id"),
                                           "completion_id"))

    @router.post("/rl/set_reward")
    async def rl_set_reward(request: Request) -> Response:
        key = request_key(request)
        body = await read_body(svc, request)
        session_id = _named_session(svc, key, body)
        out = await _reward(svc, session_id, key, body, body.get("interaction_id"), "interaction_id")
        return json_response({"message": "success", **out})

    @router.post("/v1/sessions/{session_id}/end")
    async def end_session(session_id: str, request: Request) -> Response:
        session = own_session(svc, request, session_id)
        return json_response(await _end(svc, session, await read_body(svc, request)))

    @router.post("/rl/end_session")
    async def rl_end_session(request: Request) -> Response:
        key = request_key(request)
        body = await read_body(svc, request)
        session = svc.store.get(_named_session(svc, key, body))
        count = len(session.completions)
        out = await _end(svc, session, body)
        return json_response({"message": "success", "interaction_count": count, **out})

    return router


def _named_session(svc: ProxyService, key: str, body: dict[str, Any]) -> str:
    """The session an AReaL route acts on: the session key's own (AReaL's rule), or, with
    the admin key, ``session_id`` of the body."""
    if not is_admin(svc, key):
        return svc.store.by_api_key(key).session_id
    session_id = body.get("session_id")
    if not isinstance(session_id, str) or not session_id:
        raise bad_request("with the admin key, name the session: \"session_id\" (or send the "
                          "session's own key)", "session_id")
    return session_id


async def _start(svc: ProxyService, request: Request, body: dict[str, Any]) -> Response:
    group_id = body.get("group_id")
    if group_id is not None and (not isinstance(group_id, str) or not group_id):
        raise bad_request("group_id must be a non-empty string or null", "group_id")
    group_size = int_field(body, "group_size", svc.default_group_size, 1, 4096)
    sample_index = body.get("sample_index")
    if sample_index is not None:
        sample_index = int_field(body, "sample_index", 0, 0, 4095)
    task = body.get("task", "")
    task_data = body.get("task_data") or {}
    if not isinstance(task, str) or not isinstance(task_data, dict):
        raise bad_request("task must be a string and task_data an object", "task_data")
    api_key = _client_key(svc, body.get("api_key"))
    previous = None
    if api_key is not None:  # a fixed key: its open episode ends (and is published) first
        prev = svc.store.end_previous(api_key)
        if prev is not None:
            previous = await svc.finish(*prev)
    start = dict(group_id=group_id, group_size=group_size, sample_index=sample_index,
                 task=task, task_data=task_data, api_key=api_key)
    while True:
        session = svc.store.start(**start, policy_version=svc.engine.version,
                                  admit=svc.gate.try_admit)
        if session is not None:
            break
        if svc._stop.is_set():
            raise ApiError(503, "the proxy is shutting down", code="shutting_down")
        # Held by the head gate (proxy.admission): wait until a weights event frees a
        # slot, or answer now (a live user is never left without an answer).
        if svc.admission != "wait" and not svc.gate.ready.is_set():
            svc.refused_starts += 1
            raise ApiError(503, "the proxy is still loading the run's latest weights; retry",
                           code="not_ready", headers={"Retry-After": str(svc.retry_after_s)})
        if svc.admission == "reject":
            svc.refused_starts += 1
            raise ApiError(
                429, f"the trainer is {svc.gate.eta} versions behind the sessions already "
                "admitted (rollout.max_head_offpolicyness): a new one could not train within "
                f"the staleness bound; retry after {svc.retry_after_s} s",
                code="staleness_bound", headers={"Retry-After": str(svc.retry_after_s)})
        if svc.admission == "serve_untrained":
            session = svc.store.start(
                **start, policy_version=svc.engine.version, admit=svc.gate.try_admit,
                untrained="served past the staleness bound (proxy.admission=serve_untrained)")
            break
        if await request.is_disconnected():
            return Response(status_code=499)
        await asyncio.sleep(0.05)
    return json_response({"session_id": session.session_id, "api_key": session.api_key,
                          "policy_version": session.policy_version,
                          "group_id": session.group.group_id,
                          "sample_index": session.sample_index,
                          "group_size": session.group.group_size,
                          "for_training": not session.group.untrained,
                          "previous": previous})


async def _reward(svc: ProxyService, session_id: str, key: str, body: dict[str, Any],
                  completion_id: Any, param: str) -> dict[str, Any]:
    admin = is_admin(svc, key)
    reward = check_reward(body.get("reward"))
    if completion_id is not None and not isinstance(completion_id, str):
        raise bad_request(f"{param} must be a string or null", param)
    session = svc.store.open_session(session_id)
    if session is None:  # ended: the session's reward, now or later (delayed_rewards.py)
        if completion_id is not None:
            raise bad_request("after end a reward goes to the whole session (its last "
                              f"completion, AReaL's rule); leave {param} out", param)
        return await asyncio.to_thread(svc.reward_after_end, session_id, reward, None if admin else key)
    if not admin and svc.store.by_api_key(key) is not session:
        raise ApiError(403, "this API key belongs to another session", code="wrong_session")
    ids = svc.store.set_reward(session, reward, completion_id)
    # Before the end the last reward wins; the rewards it replaced are reported.
    return {"session_id": session_id, "completion_ids": ids, "reward": reward, "replaced": ids.replaced}


async def _end(svc: ProxyService, session: Any, body: dict[str, Any]) -> dict[str, Any]:
    mode = body.get("mode")
    if mode not in (None, "concat", "per_completion"):
        raise bad_request("mode must be concat, per_completion or null", "mode")
    discount = body.get("discount")
    if discount is not None:
        discount = float_field(body, "discount", 1.0, 0.0, 1.0)
    ended = svc.store.end(session, mode, discount)
    return await svc.finish(session, ended)


def _client_key(svc: ProxyService, value: Any) -> str | None:
    """A session's own key chosen by its client (a fixed key across episodes), or None."""
    if value is None:
        return None
    if (not isinstance(value, str) or not 16 <= len(value) <= 256 or not value.isprintable()
            or " " in value):
        raise bad_request("api_key must be 16 to 256 printable characters without spaces (or "
                          "null: the proxy makes one)", "api_key")
    if value.startswith("tpk-") or is_admin(svc, value):
        raise bad_request("api_key must not be the admin key nor start with tpk- (the proxy's "
                          "own keys)", "api_key")
    return value
