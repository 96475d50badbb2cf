"""Character-level tokenizers, built locally with the `tokenizers` library.

Consumes nothing and emits nothing: a pure constructor used by every process that needs
the tiny test/demo model (rollout workers, trainer, prompt feeder). Each character of
the alphabet is one token; there are no merges, so token counts equal character counts
and a tiny model sees the arithmetic structure directly.

Layout of the vocabulary (ids are stable, tests rely on them):

    0 <pad>   1 <bos>   2 <eos>   3 <unk>   4.. the alphabet, in the order given

`<eos>` also ends an assistant turn. The chat template is deliberately minimal: a
`<bos>`, then the turns' contents back to back, each assistant turn followed by
`<eos>`. A generation prompt adds nothing, so the model answers right after the
user's text (``"3+4="`` -> the model writes ``"7<eos>"``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable

from ..schemas.errors import ConfigError

if TYPE_CHECKING:  # transformers is imported lazily: reward scorers use the constants only
    from transformers import PreTrainedTokenizerFast

PAD_TOKEN = "<pad>"
BOS_TOKEN = "<bos>"
EOS_TOKEN = "<eos>"
UNK_TOKEN = "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)

# Digits, arithmetic, the separators numbers are written with, space and newline:
# 19 characters + 4 specials = 23 tokens. Small on purpose: a random model's chance of
# emitting a well-formed answer (digits then <eos>) shrinks with every extra token.
DEFAULT_ALPHABET = "0123456789+-*=/., \n"

# Everything GSM8K-like text needs, for plumbing tests on real data (not for learning).
PRINTABLE_ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n"

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ message['content'] }}{{ eos_token }}"
    "{% else %}"
    "{{ message['content'] }}"
    "{% endif %}"
    "{% endfor %}"
)


# A vision-language model's template (models/vision.py): a message's content is a string
# or a list of parts; an image part ({"type": "image"}, or an OpenAI image_url part) is
# <|vision_start|><|image_pad|><|vision_end|>, its one placeholder expanded later.
VISION_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] in ['image', 'image_url'] %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)


def build_char_tokenizer(alphabet: str | None = None, *, vision: bool = False) -> "PreTrainedTokenizerFast":
    """A character-level fast tokenizer over ``alphabet`` (default: :data:`DEFAULT_ALPHABET`).

    Characters outside the alphabet encode to ``<unk>``. ``encode`` adds no special
    tokens; the chat template adds ``<bos>`` and the assistant's ``<eos>``. Round-trips
    through ``save_pretrained`` / ``AutoTokenizer.from_pretrained``. ``vision``: the
    vision special tokens (models/vision.py ``VISION_TOKENS``) are the last four ids,
    and the chat template renders image parts.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(DEFAULT_ALPHABET if alphabet is None else alphabet)
    if not chars:
        raise ConfigError("build_char_tokenizer: the alphabet is empty; pass at least one character")
    if len(set(chars)) != len(chars):
        dupes = sorted({c for c in chars if chars.count(c) > 1})
        raise ConfigError(f"build_char_tokenizer: alphabet repeats {dupes!r}; list each character once")

    extra: list[str] = []
    if vision:
        from .vision import VISION_TOKENS

        extra = list(VISION_TOKENS)
    vocab = {token: i for i, token in enumerate(list(SPECIAL_TOKENS) + chars + extra)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Oniguruma's (?m) makes '.' match '\n' too, so every character is its own piece.
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("(?m:.)"), behavior="isolated")
    # Fuse joins pieces with no separator (WordLevel's default decoding inserts spaces).
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(SPECIAL_TOKENS) + extra)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
    )
    tokenizer.chat_template = VISION_CHAT_TEMPLATE if vision else CHAT_TEMPLATE
    return tokenizer


def load_tokenizer(path: str | os.PathLike) -> "PreTrainedTokenizerFast":
    """Load the tokenizer of a local model directory (never the network).

    Why not plain ``AutoTokenizer``: transformers 5 picks the tokenizer class from the
    directory's ``config.json`` (``Qwen2Tokenizer`` for the tiny model), and that class
    replaces the saved pre-tokenizer with Qwen's byte-level one, so the char tokenizer
    silently drops spaces and newlines (``"a b\\nc"`` -> 3 tokens, measured). A
    tokenizer saved by :func:`build_char_tokenizer` (``tokenizer_class`` is the generic
    fast tokenizer) is therefore loaded as that generic class, with its own pipeline
    and chat template; any other tokenizer goes through ``AutoTokenizer``.
    """
    import json
    from pathlib import Path

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    config = Path(path) / "tokenizer_config.json"
    cls = ""
    if config.is_file():
        cls = json.loads(config.read_text()).get("tokenizer_class", "")
    if cls in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def prompt_encoder(tokenizer) -> Callable[[dict[str, Any]], tuple[list[int], str]]:
    """``encode(row) -> (prompt token ids, prompt text)`` for dataset rows (``messages``,
    or ``prompt`` as one user turn): the tokenizer's chat template with a generation
    prompt when it has one, else the contents joined by newlines. How the feeder encodes
    prompts (and the supervised trainers' data, so a fine-tuned model sees RL's layout)."""

    def encode(row: dict[str, Any]) -> tuple[list[int], str]:
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        else:
            text = "\n".join(m["content"] for m in messages)
        return tokenizer(text, add_special_tokens=False)["input_ids"], text

    return encode
