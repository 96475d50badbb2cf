"""The proxy's response text on real tokenizers: per-token stream pieces (incremental
decoding, multi-byte characters), streamed content of replies with tool calls, and the
chat choices a call becomes (tool calls parsed, or not for ``tool_choice: "none"``).

A tiny random model cannot be made to write a tool call, so the tool-call path of the
server is covered here, on the response builder it runs (``build_chat_choices``), with
the output ids a model would produce for such a reply.
"""

from __future__ import annotations

import json

import pytest

from tapioca.engines.base import GenResult
from tapioca.models.tokenizer import PRINTABLE_ALPHABET, build_char_tokenizer
from tapioca.producers.proxy.responses import ResponseText, build_chat_choices, build_text_choices

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12*7"}}\n</tool_call>'


@pytest.fixture(scope="module")
def char_text() -> ResponseText:
    return ResponseText(build_char_tokenizer(PRINTABLE_ALPHABET))


@pytest.fixture(scope="module")
def byte_text() -> ResponseText:
    """A byte-level BPE tokenizer without merges (GPT-2 / Qwen style: one token per
    byte), so a non-ASCII character spans several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    vocab["<eos>"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<eos>"])
    return ResponseText(PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>",
                                                clean_up_tokenization_spaces=False))


def ids_of(text: ResponseText, s: str, eos: bool = False) -> list[int]:
    ids = list(text.tokenizer(s, add_special_tokens=False)["input_ids"])
    return ids + [text.tokenizer.eos_token_id] if eos else ids


def result(ids: list[int], finish: str = "stop") -> GenResult:
    return GenResult("r", [1], ids, [-0.5] * len(ids), [3] * len(ids), finish, {"generate_s": 0.1})


def test_token_pieces_are_incremental_and_complete(char_text, byte_text):
    ids = ids_of(char_text, "a b\nc", eos=True)
    assert char_text.token_pieces(ids) == ["a", " ", "b", "\n", "c", "<eos>"]
    s = "héllo ✓ ok"
    ids = ids_of(byte_text, s)
    assert len(ids) == len(s.encode())  # one token per byte
    pieces = byte_text.token_pieces(ids)
    assert len(pieces) == len(ids) and "".join(pieces) == s
    # The first byte of "é" adds no character yet; the second one adds "é".
    assert pieces[1:3] == ["", "é"] and pieces[7:10] == ["", "", "✓"]
    # A reply cut in the middle of a character keeps the replacement character.
    assert "".join(byte_text.token_pieces(ids[:2])) == byte_text.decode(ids[:2])


def test_streamed_content_of_a_reply_with_a_tool_call(char_text, byte_text):
    for text in (char_text, byte_text):
        ids = ids_of(text, "Let me compute.\n" + CALL, eos=True)
        pieces = text.content_pieces(ids, "Let me compute.")
        assert "".join(pieces) == "Let me compute." and len(pieces) == len("Let me compute.")
    # Content that is not a prefix of the output (a call between two texts, stripped
    # whitespace) goes out as one piece; it used to be sliced from the raw tokens.
    ids = ids_of(char_text, "x" + CALL + "y")
    assert char_text.content_pieces(ids, "xy") == ["xy"]
    ids = ids_of(char_text, "  hi\n" + CALL)
    assert char_text.content_pieces(ids, "hi") == ["hi"]
    assert char_text.content_pieces(ids, None) == [] and char_text.content_pieces(ids, "") == []


def test_chat_choices_parse_tool_calls_unless_tool_choice_is_none(char_text):
    ids = ids_of(char_text, "Let me compute.\n" + CALL, eos=True)
    prompt = ids_of(char_text, "What is 12*7?")
    built = build_chat_choices(char_text, "chatcmpl-abc123", prompt, [result(ids)], (),
                               parse_tools=True, logprobs=True, stream=True)
    choice = built.choices[0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] == "Let me compute."
    assert choice["message"]["tool_calls"] == [{"id": "call_abc123_0_0", "type": "function", "function": {
        "name": "calculator", "arguments": json.dumps({"expression": "12*7"})}}]
    assert "".join(built.stream_pieces[0]) == "Let me compute."
    assert [t["token"] for t in choice["logprobs"]["content"]][-1] == "<eos>"
    assert len(choice["logprobs"]["content"]) == len(ids)
    # What the session records: the raw text (re-rendered when the agent sends the
    # call back), the tool-call id, and the completion with its tokens.
    assert built.raws == ["Let me compute.\n" + CALL] and built.tool_call_ids == [["call_abc123_0_0"]]
    comp = built.completions[0]
    assert (comp.completion_id, comp.prompt_ids, comp.output_ids, comp.finish_reason) == \
        ("chatcmpl-abc123:0", prompt, ids, "tool_calls")

    plain = build_chat_choices(char_text, "chatcmpl-abc123", prompt, [result(ids)], (),
                               parse_tools=False, logprobs=False, stream=True)
    msg = plain.choices[0]["message"]
    assert msg == {"role": "assistant", "content": "Let me compute.\n" + CALL}
    assert plain.choices[0]["finish_reason"] == "stop" and plain.tool_call_ids == [[]]
    assert "".join(plain.stream_pieces[0]) == msg["content"]


def test_text_choices_cut_at_stop_strings(char_text):
    ids = ids_of(char_text, "42 DONE more")
    built = build_text_choices(char_text, "cmpl-1", [1], [result(ids)], ("DONE",), stream=True)
    assert built.choices[0]["text"] == "42 " and "".join(built.stream_pieces[0]) == "42 "
    assert built.raws == ["42 DONE more"] and built.contents == [None]
