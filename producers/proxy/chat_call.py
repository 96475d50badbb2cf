"""One chat call, whatever the dialect it came in: messages in, generated choices recorded.

Consumes a :class:`ChatRequest` (the one internal request: OpenAI chat ``messages``,
``tools`` in the chat format, ``tool_choice``, sampling, ``n``) that a dialect's router
built from its own body (``/v1/chat/completions`` as is, ``/v1/responses`` in
:mod:`.responses_api`, ``/v1/messages`` in :mod:`.messages_api`), and the caller's open
session; emits a :class:`ChatCall`: the rendered prompt ids, the engine's results, the
choices (content and tool calls parsed by :mod:`.tool_calls`), the usage, and the
completions recorded in the session (so every dialect makes the same token-faithful
trajectory: the exact tokens generated, their logprobs and versions).

The steps, each the same for every dialect: image parts are stored by sha256 and become
placeholders (:mod:`.images`); the messages are rendered with the chat template (an
assistant turn the proxy recognises is re-rendered from the model's raw text); the
engine generates (:meth:`ProxyService.generate`: token limits, the session's budget);
the choices are decoded in a worker thread; the session records them.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from ...engines.base import GenResult, SamplingParams
from .images import expand as expand_images
from .images import take_images
from .responses import BuiltChoices, build_chat_choices
from .service import ProxyService
from .sessions import Session
from .tool_calls import prepare_messages


@dataclass(frozen=True)
class ChatRequest:
    """A chat call as the chat route takes it (the dialects translate to this)."""

    messages: Any
    tools: list[dict[str, Any]] | None
    tool_choice: Any
    sampling: SamplingParams
    n: int = 1
    logprobs: bool = False
    stream: bool = False


@dataclass
class ChatCall:
    call_id: str
    prompt_ids: list[int]
    results: list[GenResult]
    built: BuiltChoices
    usage: dict[str, int]
    # Returned under "tapioca" by every dialect: the completion ids a reward may name,
    # and the policy version of each choice's last token.
    extra: dict[str, Any]


async def run_chat(svc: ProxyService, session: Session, req: ChatRequest, call_id: str) -> ChatCall:
    """Render, generate, decode and record one call (see the module docstring)."""
    # Rendering (a Jinja template + tokenising a long conversation) and decoding are CPU
    # work: worker threads, so the event loop keeps serving other sessions.
    messages, image_refs = await asyncio.to_thread(take_images, req.messages, svc.vision)
    prompt_ids = await asyncio.to_thread(_render_chat, svc, session, messages, req.tools)
    prompt_ids = expand_images(prompt_ids, image_refs, svc.vision)
    results = await svc.generate(session, call_id, prompt_ids, req.sampling, req.n, image_refs)
    built = await asyncio.to_thread(
        build_chat_choices, svc.text, call_id, prompt_ids, results, req.sampling.stop_strings,
        parse_tools=req.tools is not None and req.tool_choice != "none", logprobs=req.logprobs,
        stream=req.stream)
    for completion in built.completions:
        completion.images = list(image_refs)
    svc.store.record(session, built.completions, built.raws, built.contents, built.tool_call_ids)
    extra = {"completion_ids": [c.completion_id for c in built.completions],
             "policy_versions": [r.output_versions[-1] if r.output_versions else svc.engine.version
                                 for r in results]}
    return ChatCall(call_id, prompt_ids, results, built, usage(prompt_ids, results), extra)


def usage(prompt_ids: list[int], results: list[GenResult]) -> dict[str, int]:
    out = sum(len(r.output_ids) for r in results)
    return {"prompt_tokens": len(prompt_ids), "completion_tokens": out,
            "total_tokens": len(prompt_ids) + out}


def _render_chat(svc: ProxyService, session: Session, messages: Any,
                 tools: list[dict[str, Any]] | None) -> list[int]:
    templated = prepare_messages(messages, tools, template_has_tools=svc.template_has_tools,
                                 raw_by_tool_call_id=session.raw_by_tool_call_id,
                                 raw_by_content=session.raw_by_content)
    return svc.render(templated, tools)
