"""Images in OpenAI chat messages: ``image_url`` parts in, stored references out.

Consumes a chat request's ``messages`` (content parts ``{"type": "image_url",
"image_url": {"url": "data:image/png;base64,..."}}``, one or several per message, in any
user / system / tool message) and the proxy's image handling
(:class:`~tapioca.models.vision.VisionPrompts`: the run's image store, the image rule,
the model's placeholders); emits the messages with each image part replaced by the
model's placeholder text (``<|vision_start|><|image_pad|><|vision_end|>``, rendered as
the tokenizer's special tokens, expanded after tokenisation) and the images'
:class:`~tapioca.schemas.events.ImageRef` (docs/vlm.md). The completions record the
references, so the trajectories carry them.

Every image of a request is admitted (media/images.py: format, ``vlm.max_image_bytes``,
``vlm.max_image_pixels`` from the header, then a decode) before any is stored, and they
are stored by sha256 only when the request is accepted, just before it is generated
(:meth:`~tapioca.producers.proxy.service.ProxyService.generate` commits them): a refused
request leaves nothing in the image store.

Refused with 400 (``invalid_image``, param ``messages``) and a message saying why: an
``http(s)`` URL (the proxy fetches nothing: a run must not depend on a third party's
server, and replay must see the same bytes), bytes that do not decode, an image over
the rule's limits, an image for a model without a vision tower
(``unsupported_content``), and placeholders that do not match the images given (a
literal ``<|image_pad|>`` in the text). 503 ``images_busy`` with ``Retry-After``: the
images being decoded already fill ``vlm.max_decoding_pixels`` (nothing wrong with this one).
"""

from __future__ import annotations

from typing import Any

from ...media.images import ImageBusyError, ImageError, parse_image_url
from ...models.vision import IMAGE_PAD, VISION_END, VISION_START
from .openai_errors import ApiError, bad_request

PLACEHOLDER_TEXT = VISION_START + IMAGE_PAD + VISION_END


def _is_image_part(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") in ("image_url", "input_image")


def has_images(messages: Any) -> bool:
    return isinstance(messages, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list) and any(map(_is_image_part, m["content"]))
        for m in messages)


def take_images(messages: Any, vision: Any) -> tuple[Any, list[Any]]:
    """``(messages with placeholder text, refs)``; ``vision`` None: the model reads no
    images (an image part is a 400)."""
    if not has_images(messages):
        return messages, []
    if vision is None:
        raise bad_request("this model has no vision tower, so messages cannot hold image_url parts; "
                          "send text only, or serve a vision-language model", "messages",
                          code="unsupported_content")
    out, blobs = [], []
    for i, m in enumerate(messages):
        content = m.get("content") if isinstance(m, dict) else None
        if not isinstance(content, list) or not any(map(_is_image_part, content)):
            out.append(m)
            continue
        parts = []
        for j, part in enumerate(content):
            if not _is_image_part(part):
                parts.append(part)
                continue
            where = f"messages[{i}].content[{j}]"
            url = part.get("image_url")
            url = url.get("url") if isinstance(url, dict) else url
            try:
                blobs.append(parse_image_url(url))
            except ImageError as exc:
                raise bad_request(f"{where}: {exc}", "messages", code="invalid_image") from None
            parts.append({"type": "text", "text": PLACEHOLDER_TEXT})
        out.append({**m, "content": parts})
    try:
        refs = vision.admit(blobs)  # checked, not stored: generate() commits them
    except ImageError as exc:
        raise bad_request(f"messages: {exc}", "messages", code="invalid_image") from None
    except ImageBusyError as exc:
        raise busy(exc) from None
    return out, refs


def busy(exc: ImageBusyError) -> ApiError:
    """503 with ``Retry-After``: no room to decode the images now (vlm.max_decoding_pixels)."""
    return ApiError(503, str(exc), param="messages", code="images_busy",
                    headers={"Retry-After": str(exc.retry_after_s)})


def expand(prompt_ids: list[int], refs: list[Any], vision: Any) -> list[int]:
    """``prompt_ids`` with each image's placeholder expanded (400 when they disagree)."""
    if vision is None:
        return prompt_ids
    try:
        return vision.expand(prompt_ids, refs)
    except ImageError as exc:
        raise bad_request(str(exc), "messages", code="invalid_image") from None
