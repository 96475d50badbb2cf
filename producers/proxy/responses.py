"""Generated token ids as OpenAI response text: content, tool calls, stream pieces, logprobs.

Consumes the engine's :class:`~tapioca.engines.base.GenResult` of one call and the
tokenizer; emits the choices of a chat or text completion, the
:class:`~tapioca.producers.proxy.sessions.Completion` records the session keeps, and
the text pieces a streamed response sends. Pure CPU work with no I/O: the server runs
it in a worker thread (``asyncio.to_thread``) so that decoding a long reply never
stalls the event loop that serves every other session.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...engines.base import GenResult
from .sessions import Completion
from .tool_calls import parse_tool_calls

# A byte-level tokenizer decodes an incomplete UTF-8 sequence to this character; the
# token's text is then sent with the token that completes it.
_INCOMPLETE = "\ufffd"


class ResponseText:
    """Decodes output ids the way the proxy returns them (see :meth:`texts`)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        eos = tokenizer.eos_token_id
        self.eos_ids = {eos} if isinstance(eos, int) else set(eos or ())

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def texts(self, output_ids: list[int], stops: tuple[str, ...]) -> tuple[str, str]:
        """(raw text the template re-renders, text returned to the client).

        Special tokens the model wrote are kept in the returned text (only the final
        end-of-turn token is dropped), so what the agent sends back re-tokenises to what
        the model generated; a stop string and what follows it are cut (OpenAI's rule).
        """
        raw = text = self.decode(self._without_eos(output_ids))
        cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=-1)
        return raw, (text[:cut] if cut >= 0 else text)

    def _without_eos(self, ids: list[int]) -> list[int]:
        return ids[:-1] if ids and ids[-1] in self.eos_ids else ids

    def token_pieces(self, output_ids: list[int]) -> list[str]:
        """The text each output token adds (one entry per token; "" for a token whose
        bytes only become a character with a later one).

        Incremental (vLLM's detokenizer scheme): each step decodes only the tokens since
        the previous emitted piece plus that piece, so a reply of n tokens costs O(n)
        decodes of a few tokens instead of n decodes of up to n tokens. The window keeps
        one emitted piece as context because some decoders (SentencePiece's leading
        space) render a token differently at the start of a sequence.
        """
        pieces: list[str] = []
        prefix = read = 0  # window start; end of the tokens already emitted
        prefix_text = ""
        n = len(output_ids)
        for j in range(n):
            text = self.decode(output_ids[prefix:j + 1])
            if len(text) > len(prefix_text) and not text.endswith(_INCOMPLETE):
                pieces.append(text[len(prefix_text):])
                prefix, read = read, j + 1
                prefix_text = self.decode(output_ids[prefix:read])
            else:
                pieces.append("")
        if read < n:  # trailing bytes that never completed a character
            pieces[-1] += self.decode(output_ids[prefix:])[len(prefix_text):]
        return pieces

    def content_pieces(self, output_ids: list[int], content: str | None) -> list[str]:
        """``content`` as per-token stream pieces when it is a prefix of the decoded
        output (plain text, text before a tool call, text cut at a stop string);
        otherwise (a tool call between two texts, stripped whitespace) as one piece."""
        if not content:
            return []
        pieces = self.token_pieces(output_ids)
        if not "".join(pieces).startswith(content):
            return [content]
        out, used = [], 0
        for p in pieces:
            if used >= len(content):
                break
            p = p[: len(content) - used]
            if p:
                out.append(p)
                used += len(p)
        return out

    def chat_logprobs(self, result: GenResult) -> dict[str, Any]:
        """Chat ``logprobs`` with ``top_logprobs: 0`` (the only value the proxy accepts:
        the engines return the sampled token's logprob, not the alternatives)."""
        pieces = self.token_pieces(result.output_ids)
        return {"content": [{"token": p, "logprob": float(lp), "bytes": list(p.encode()), "top_logprobs": []}
                            for p, lp in zip(pieces, result.output_logprobs)]}

    def text_logprobs(self, result: GenResult) -> dict[str, Any]:
        """Legacy completions ``logprobs`` for ``logprobs: 0``: each token's text, its
        logprob, its offset in the returned text, and ``top_logprobs`` holding the
        sampled token alone (OpenAI returns up to logprobs + 1 entries)."""
        pieces = self.token_pieces(result.output_ids)
        offsets, at = [], 0
        for p in pieces:
            offsets.append(at)
            at += len(p)
        lps = [float(lp) for lp in result.output_logprobs]
        return {"tokens": pieces, "token_logprobs": lps, "text_offset": offsets,
                "top_logprobs": [{p: lp} for p, lp in zip(pieces, lps)]}


@dataclass
class BuiltChoices:
    """What one call's results become: the response choices, the session's records
    (``Completion`` + raw text + returned content + tool-call ids per choice) and, for a
    streamed response, each choice's content pieces."""

    choices: list[dict[str, Any]] = field(default_factory=list)
    completions: list[Completion] = field(default_factory=list)
    raws: list[str] = field(default_factory=list)
    contents: list[str | None] = field(default_factory=list)
    tool_call_ids: list[list[str]] = field(default_factory=list)
    stream_pieces: list[list[str]] = field(default_factory=list)


def _completion(call_id: str, i: int, prompt_ids: list[int], r: GenResult, finish: str) -> Completion:
    return Completion(call_id, i, list(prompt_ids), list(r.output_ids),
                      [float(x) for x in r.output_logprobs], list(r.output_versions),
                      finish, timings=dict(r.timings))


def build_chat_choices(text: ResponseText, call_id: str, prompt_ids: list[int],
                       results: list[GenResult], stops: tuple[str, ...], *,
                       parse_tools: bool, logprobs: bool, stream: bool) -> BuiltChoices:
    """Chat choices of one call: content and Qwen-style tool calls (ids
    ``call_{hex}_{choice}_{k}``) when ``parse_tools``; finish_reason ``tool_calls``
    when a call was parsed."""
    out = BuiltChoices()
    for i, r in enumerate(results):
        raw, decoded = text.texts(r.output_ids, stops)
        content, calls = (parse_tool_calls(decoded, f"call_{call_id.split('-', 1)[-1]}_{i}")
                          if parse_tools else (decoded, []))
        finish = "tool_calls" if calls else r.finish_reason
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        out.choices.append({"index": i, "message": message, "finish_reason": finish,
                            "logprobs": text.chat_logprobs(r) if logprobs else None})
        out.completions.append(_completion(call_id, i, prompt_ids, r, finish))
        out.raws.append(raw)
        out.contents.append(content)
        out.tool_call_ids.append([c["id"] for c in calls])
        if stream:
            out.stream_pieces.append(text.content_pieces(r.output_ids, content))
    return out


def build_text_choices(text: ResponseText, call_id: str, prompt_ids: list[int],
                       results: list[GenResult], stops: tuple[str, ...], *, stream: bool,
                       logprobs: bool = False) -> BuiltChoices:
    """Choices of ``/v1/completions`` (plain text, never re-rendered from messages)."""
    out = BuiltChoices()
    for i, r in enumerate(results):
        raw, decoded = text.texts(r.output_ids, stops)
        out.choices.append({"index": i, "text": decoded, "finish_reason": r.finish_reason,
                            "logprobs": text.text_logprobs(r) if logprobs else None})
        out.completions.append(_completion(call_id, i, prompt_ids, r, r.finish_reason))
        out.raws.append(raw)
        out.contents.append(None)
        out.tool_call_ids.append([])
        if stream:
            out.stream_pieces.append(text.content_pieces(r.output_ids, decoded))
    return out
