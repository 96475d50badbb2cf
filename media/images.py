"""Image bytes in, checked :class:`~tapioca.schemas.events.ImageRef` out.

Consumes encoded images from wherever a run gets them (a dataset's ``images`` column:
paths or bytes; an OpenAI ``image_url`` part: a ``data:`` URL) and an
:class:`~tapioca.media.store.ImageStore`; emits the reference an event carries, after
the bytes are stored under their SHA-256. Readers go the other way with
:func:`ref_bytes` (the inline copy, else the store), checking the hash.

Checks, each an :class:`ImageError` (a bad request: the proxy answers 400, the feeder
refuses the dataset row, a role dead-letters the event) that says what to do:

* the bytes must decode as PNG, JPEG, WebP, GIF or BMP (first frame), completely (a
  truncated file is refused, not padded);
* ``width * height`` at most ``max_pixels`` (``vlm.max_image_pixels``), read from the
  header before any pixel is decoded (a decompression bomb costs nothing);
* an ``image_url`` must be a ``data:`` URL: ``http(s)`` URLs are refused. Fetching
  would make a run depend on a third party's server (slow, changing or gone: replay
  and offline training could no longer reproduce the run), and the machines a run
  uses may have no network at all.
"""

from __future__ import annotations

import base64
import binascii
import io
from typing import Any

from ..schemas.errors import TapiocaError
from ..schemas.events import ImageRef
from .store import ImageStore, MissingImageError, sha256_hex

# Formats a model's processor can read, PIL's names -> MIME types.
MIME_BY_FORMAT = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp",
                  "GIF": "image/gif", "BMP": "image/bmp"}
DEFAULT_MAX_PIXELS = 4096 * 4096
DEFAULT_INLINE_MAX_BYTES = 4096


class ImageError(TapiocaError):
    """An image a client or dataset sent cannot be used (see the module docstring)."""


def inspect_image(data: bytes, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[str, int, int]:
    """``(mime, width, height)`` of encoded image ``data``, fully decoded once."""
    from PIL import Image, UnidentifiedImageError

    if not data:
        raise ImageError("the image is empty (0 bytes)")
    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt, (width, height) = im.format, im.size
            if fmt not in MIME_BY_FORMAT:
                raise ImageError(f"image format {fmt} is not accepted; send PNG, JPEG, WebP, GIF or BMP")
            if width < 1 or height < 1:
                raise ImageError(f"the image is {width} x {height} pixels; it needs at least one")
            if width * height > max_pixels:
                raise ImageError(f"the image is {width} x {height} = {width * height:,} pixels, over "
                                 f"vlm.max_image_pixels={max_pixels:,}; downscale it or raise the limit")
            im.load()  # decode every pixel now: a truncated file fails here, not in a role
    except ImageError:
        raise
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, Image.DecompressionBombError) as exc:
        raise ImageError(f"the image bytes cannot be decoded ({type(exc).__name__}: {exc}); send a "
                         "complete PNG, JPEG, WebP, GIF or BMP file") from None
    return MIME_BY_FORMAT[fmt], int(width), int(height)


def store_image(data: bytes, store: ImageStore, *, max_pixels: int = DEFAULT_MAX_PIXELS,
                inline_max_bytes: int = DEFAULT_INLINE_MAX_BYTES) -> ImageRef:
    """Check ``data``, store it, and return its reference (inline too when small)."""
    mime, width, height = inspect_image(data, max_pixels=max_pixels)
    sha = store.put(data)
    inline = base64.b64encode(data).decode("ascii") if len(data) <= inline_max_bytes else ""
    return ImageRef(sha256=sha, mime=mime, width=width, height=height, data_b64=inline)


def ref_bytes(ref: ImageRef, store: ImageStore | None) -> bytes:
    """The bytes of ``ref``: its inline copy, else the store's; :class:`MissingImageError`
    when neither has them (or they do not hash to ``ref.sha256``)."""
    if ref.data_b64:
        try:
            data = base64.b64decode(ref.data_b64, validate=True)
        except (binascii.Error, ValueError):
            raise MissingImageError(f"image {ref.sha256}: data_b64 is not valid base64") from None
        if sha256_hex(data) != ref.sha256:
            raise MissingImageError(f"image {ref.sha256}: its inline bytes hash to {sha256_hex(data)}")
        return data
    if store is None:
        raise MissingImageError(f"image {ref.sha256} is not inline and no image store is configured "
                                "(vlm.image_store)")
    return store.get(ref.sha256)


def data_url(data: bytes, mime: str) -> str:
    """``data:<mime>;base64,...`` (what the OpenAI API and vLLM take)."""
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def parse_image_url(url: Any) -> bytes:
    """The bytes of an OpenAI ``image_url.url``: a base64 ``data:`` URL only."""
    if not isinstance(url, str) or not url:
        raise ImageError("image_url.url must be a non-empty string (a data: URL)")
    lowered = url[:16].lower()
    if lowered.startswith(("http://", "https://")):
        raise ImageError("image_url with an http(s) URL is not fetched: a run must not depend on a third "
                         "party's server (replay and offline training must see the same bytes) and may "
                         "have no network. Send the image inline as data:image/png;base64,...")
    if not lowered.startswith("data:"):
        raise ImageError(f"image_url.url must be a data: URL (data:image/png;base64,...), got "
                         f"{url[:24]!r}...")
    header, sep, payload = url.partition(",")
    if not sep or not header.lower().endswith(";base64"):
        raise ImageError("image_url data: URL must be base64 encoded: data:<mime>;base64,<data>")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("image_url data: URL holds invalid base64") from None


def read_image_source(item: Any, *, base_dir: str | None = None) -> bytes:
    """The bytes of one entry of a dataset's ``images`` column: raw bytes, a path (relative
    to ``base_dir``), or a Hugging Face ``datasets`` image dict ``{"bytes", "path"}``."""
    import os

    if isinstance(item, (bytes, bytearray, memoryview)):
        return bytes(item)
    if isinstance(item, dict):
        if item.get("bytes"):
            return bytes(item["bytes"])
        if item.get("path"):
            return read_image_source(item["path"], base_dir=base_dir)
        raise ImageError("an images entry {bytes, path} has neither bytes nor a path")
    if isinstance(item, str) and item:
        if item.startswith("data:"):
            return parse_image_url(item)
        path = item if os.path.isabs(item) or base_dir is None else os.path.join(base_dir, item)
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise ImageError(f"cannot read image {path}: {exc.strerror}; check the images column "
                             "(paths are relative to the dataset file)") from None
    raise ImageError(f"an images entry must be bytes, a path or {{bytes, path}}, not {type(item).__name__}")
