"""Image bytes in, checked :class:`~tapioca.schemas.events.ImageRef` out: the one
admission rule every image passes before its pixels are decoded.

Consumes encoded images from wherever a run gets them (a dataset's ``images`` column:
paths or bytes; an OpenAI ``image_url`` part: a ``data:`` URL; an event's reference:
inline bytes or the store's) and an :class:`~tapioca.media.store.ImageStore`; emits the
reference an event carries, after the bytes are stored under their SHA-256. Readers go
the other way with :func:`ref_bytes` (the inline copy, else the store), checking the hash.

The rule (:class:`ImageRule`, from ``vlm.max_image_pixels`` / ``vlm.max_image_bytes``) is
applied by :func:`admit_image` wherever bytes become pixels: the proxy (an ``image_url``
part), the feeder (a dataset row), the log's readers (the rollout worker's and the
trainer's :class:`~tapioca.models.vision.ImageLoader`, so a replayed or archived event
too) and the processor's decode itself (:func:`decoded_images`). Each failure is an
:class:`ImageError` (a bad request: the proxy answers 400, the feeder refuses the
dataset row, a role dead-letters the event) that says what to do:

* at most ``max_bytes`` encoded bytes (checked before an inline copy is base64-decoded
  and, for a directory store, before the blob is read);
* PNG, JPEG, WebP, GIF or BMP (first frame) by its header: PIL opens only those
  formats' parsers;
* ``width * height`` at most ``max_pixels``, read from the header (PIL opens lazily:
  nothing is decoded before the check, so a 20 KB PNG that would decode to 13000 x
  13000 costs nothing), and, for an event's reference, the size the reference claims
  (the placeholders were counted from it);
* decoded completely where it is decoded (a truncated file is refused, not padded);
* an ``image_url`` must be a ``data:`` URL: ``http(s)`` URLs are refused. Fetching
  would make a run depend on a third party's server (slow, changing or gone: replay
  and offline training could no longer reproduce the run), and the machines a run
  uses may have no network at all.

Memory. An admitted image still decodes to ``width * height`` pixels (a 4096 x 4096 RGBA
PNG of 73 KB is 64 MiB as RGBA, ~300 MiB through the processor). Where images decode
concurrently (the proxy's requests), a :class:`PixelBudget` (``vlm.max_decoding_pixels``)
bounds the pixels being decoded at once: a decode waits for room, then
:class:`ImageBusyError` (the proxy answers 503 with ``Retry-After``).
"""

from __future__ import annotations

import base64
import binascii
import io
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from ..schemas.errors import TapiocaError
from ..schemas.events import ImageRef
from .store import ImageStore, MissingImageError, sha256_hex

# Formats a model's processor can read, PIL's names -> MIME types.
MIME_BY_FORMAT = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp",
                  "GIF": "image/gif", "BMP": "image/bmp"}
DEFAULT_MAX_PIXELS = 4096 * 4096
# OpenAI's limit for one image (20 MB).
DEFAULT_MAX_BYTES = 20 * 1024 * 1024
DEFAULT_INLINE_MAX_BYTES = 4096


class ImageError(TapiocaError):
    """An image a client or dataset sent cannot be used (see the module docstring)."""


class ImageBusyError(TapiocaError):
    """No room in the :class:`PixelBudget` in time: nothing is wrong with the image; retry
    after ``retry_after_s`` (the proxy's 503)."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class ImageRule:
    """What an image must be to be decoded (the module docstring): ``max_pixels``
    (``vlm.max_image_pixels``) and ``max_bytes`` (``vlm.max_image_bytes``)."""

    max_pixels: int = DEFAULT_MAX_PIXELS
    max_bytes: int = DEFAULT_MAX_BYTES

    @classmethod
    def of(cls, vlm: Any) -> "ImageRule":
        """The rule of a run's ``vlm`` config section."""
        return cls(max_pixels=vlm.max_image_pixels, max_bytes=vlm.max_image_bytes)

    def check_size(self, nbytes: int) -> None:
        if nbytes > self.max_bytes:
            raise ImageError(f"the image is {nbytes:,} encoded bytes, over vlm.max_image_bytes="
                             f"{self.max_bytes:,}; compress or downscale it, or raise the limit")


@dataclass(frozen=True)
class ImageInfo:
    """An admitted image's format and size, read from its header."""

    mime: str
    width: int
    height: int

    @property
    def pixels(self) -> int:
        return self.width * self.height


def _open(data: bytes):
    """PIL's lazy image (header parsed, no pixel decoded) of an accepted format."""
    from PIL import Image

    return Image.open(io.BytesIO(data), formats=tuple(MIME_BY_FORMAT))


def _undecodable(exc: BaseException) -> ImageError:
    return ImageError(f"the image bytes cannot be decoded as PNG, JPEG, WebP, GIF or BMP (the formats "
                      f"accepted; {type(exc).__name__}: {exc}); send a complete file of one of them")


def _decode_errors() -> tuple[type[BaseException], ...]:
    from PIL import Image, UnidentifiedImageError

    return (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError, Image.DecompressionBombError)


def admit_image(data: bytes, rule: ImageRule = ImageRule(), *, expect: ImageRef | None = None) -> ImageInfo:
    """Check ``data`` against ``rule`` from its header alone (nothing is decoded); with
    ``expect`` (an event's reference), also that it is the size the reference says."""
    from PIL import Image

    if not data:
        raise ImageError("the image is empty (0 bytes)")
    rule.check_size(len(data))
    try:
        with _open(data) as im:
            fmt, (width, height) = im.format, im.size
    except Image.DecompressionBombError as exc:
        # PIL's own limit (2 x Image.MAX_IMAGE_PIXELS), past ours: the header said so.
        raise ImageError(f"the image is over vlm.max_image_pixels={rule.max_pixels:,} ({exc}); "
                         "downscale it") from None
    except _decode_errors() as exc:
        raise _undecodable(exc) from None
    if fmt not in MIME_BY_FORMAT:  # (only those formats' parsers were tried)
        raise ImageError(f"image format {fmt} is not accepted; send PNG, JPEG, WebP, GIF or BMP")
    if width < 1 or height < 1:
        raise ImageError(f"the image is {width} x {height} pixels; it needs at least one")
    if width * height > rule.max_pixels:
        raise ImageError(f"the image is {width} x {height} = {width * height:,} pixels, over "
                         f"vlm.max_image_pixels={rule.max_pixels:,}; downscale it or raise the limit")
    if expect is not None and (expect.width or expect.height) and (expect.width, expect.height) != (width, height):
        raise ImageError(f"image {expect.sha256}: the event says {expect.width} x {expect.height} but "
                         f"its bytes are {width} x {height}; the event was not written by Tapioca's "
                         "image checks (media/images.py): store the image again")
    return ImageInfo(MIME_BY_FORMAT[fmt], int(width), int(height))


class PixelBudget:
    """Pixels being decoded at once in one process, at most ``capacity``: :meth:`hold`
    waits up to ``wait_s`` for room, then raises :class:`ImageBusyError`.

    One hold is one acquisition (a request holding part of the budget never waits for
    more), and a hold larger than ``capacity`` waits for the whole budget, so nothing
    deadlocks. ``high_water`` is the most ever held at once (tests, metrics)."""

    def __init__(self, capacity: int, *, wait_s: float = 10.0, retry_after_s: int = 5) -> None:
        if capacity < 1:
            raise ValueError("a pixel budget needs a capacity >= 1")
        self.capacity = int(capacity)
        self.wait_s = float(wait_s)
        self.retry_after_s = int(retry_after_s)
        self.in_use = 0
        self.high_water = 0
        self.refused = 0
        self._cv = threading.Condition()

    @contextmanager
    def hold(self, pixels: int) -> Iterator[None]:
        need = max(0, min(int(pixels), self.capacity))
        deadline = time.monotonic() + self.wait_s
        with self._cv:
            while self.in_use + need > self.capacity:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.refused += 1
                    raise ImageBusyError(
                        f"{self.in_use:,} pixels of images are being decoded (vlm.max_decoding_pixels="
                        f"{self.capacity:,}) and this one needs {need:,} more; retry in "
                        f"{self.retry_after_s} s", self.retry_after_s)
                self._cv.wait(left)
            self.in_use += need
            self.high_water = max(self.high_water, self.in_use)
        try:
            yield
        finally:
            with self._cv:
                self.in_use -= need
                self._cv.notify_all()


@contextmanager
def _held(budget: PixelBudget | None, pixels: int) -> Iterator[None]:
    if budget is None:
        yield
    else:
        with budget.hold(pixels):
            yield


@contextmanager
def decoded_images(blobs: Sequence[bytes], rule: ImageRule = ImageRule(), *,
                   budget: PixelBudget | None = None) -> Iterator[list[Any]]:
    """The RGB PIL images of ``blobs``, each admitted from its header first; their
    pixels are held in ``budget`` while the ``with`` block runs (the processor's work)."""
    infos = [admit_image(data, rule) for data in blobs]
    with _held(budget, sum(i.pixels for i in infos)):
        images = []
        for data in blobs:
            try:
                with _open(data) as im:
                    images.append(im.convert("RGB"))
            except _decode_errors() as exc:
                # Stored bytes that are no image (a writer outside Tapioca): the event's fault.
                raise _undecodable(exc) from None
        yield images


def inspect_image(data: bytes, rule: ImageRule = ImageRule(), *,
                  budget: PixelBudget | None = None) -> tuple[str, int, int]:
    """``(mime, width, height)`` of encoded image ``data``: admitted, then fully decoded
    once (a truncated file fails here, not in a role), within ``budget``."""
    info = admit_image(data, rule)
    with _held(budget, info.pixels):
        try:
            with _open(data) as im:
                im.load()
        except _decode_errors() as exc:
            raise _undecodable(exc) from None
    return info.mime, info.width, info.height


class AdmittedImages(list):
    """The :class:`ImageRef` s of one request or dataset row, every image checked,
    none stored yet: :meth:`commit` stores them all. A request refused after its images
    were checked (a later image, its placeholders, its token limits) stores nothing.
    ``blobs``: sha256 -> bytes, for readers before the commit."""

    def __init__(self, refs: Sequence[ImageRef], blobs: dict[str, bytes], store: ImageStore) -> None:
        super().__init__(refs)
        self.blobs = blobs
        self.store = store
        self.committed = False

    def commit(self) -> None:
        for data in self.blobs.values():
            self.store.put(data)
        self.committed = True


def admit_images(blobs: Sequence[bytes], store: ImageStore, rule: ImageRule = ImageRule(), *,
                 inline_max_bytes: int = DEFAULT_INLINE_MAX_BYTES,
                 budget: PixelBudget | None = None) -> AdmittedImages:
    """Check every one of ``blobs`` (:func:`inspect_image`); their references, unstored."""
    refs, held = [], {}
    for i, data in enumerate(blobs):
        try:
            mime, width, height = inspect_image(data, rule, budget=budget)
        except ImageError as exc:
            raise ImageError(f"image {i + 1} of {len(blobs)}: {exc}" if len(blobs) > 1 else str(exc)) from None
        sha = sha256_hex(data)
        held[sha] = data
        inline = base64.b64encode(data).decode("ascii") if len(data) <= inline_max_bytes else ""
        refs.append(ImageRef(sha256=sha, mime=mime, width=width, height=height, data_b64=inline))
    return AdmittedImages(refs, held, store)


def store_image(data: bytes, store: ImageStore, rule: ImageRule = ImageRule(), *,
                inline_max_bytes: int = DEFAULT_INLINE_MAX_BYTES) -> ImageRef:
    """Check ``data``, store it, and return its reference (inline too when small)."""
    admitted = admit_images([data], store, rule, inline_max_bytes=inline_max_bytes)
    admitted.commit()
    return admitted[0]


def ref_bytes(ref: ImageRef, store: ImageStore | None, rule: ImageRule | None = None) -> bytes:
    """The bytes of ``ref``: its inline copy, else the store's; :class:`MissingImageError`
    when neither has them (or they do not hash to ``ref.sha256``). With ``rule``, bytes
    over its ``max_bytes`` are refused before they are decoded from base64 or read."""
    if ref.data_b64:
        if rule is not None:
            rule.check_size(len(ref.data_b64) // 4 * 3 - ref.data_b64[-2:].count("="))
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
    if rule is not None:
        size = store.size(ref.sha256)
        if size is not None:
            rule.check_size(size)
    data = store.get(ref.sha256)
    if rule is not None:
        rule.check_size(len(data))
    return data


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
        path = image_source_path(item, base_dir=base_dir)
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise ImageError(f"cannot read image {path}: {exc.strerror}; check the images column "
                             "(paths are relative to the dataset file)") from None
    raise ImageError(f"an images entry must be bytes, a path or {{bytes, path}}, not {type(item).__name__}")


def image_source_path(item: Any, *, base_dir: str | None = None) -> str | None:
    """The file that one entry of a dataset's ``images`` column names, as
    :func:`read_image_source` would open it (relative to ``base_dir``); None when the entry
    carries its bytes (raw, a ``{bytes, path}`` dict with bytes, a ``data:`` URL) or is not
    a path. Nothing is read: the start check stats these files (tasks/datasets.py)."""
    import os

    if isinstance(item, dict) and not item.get("bytes"):
        item = item.get("path")
    if not isinstance(item, str) or not item or item.startswith("data:"):
        return None
    return item if os.path.isabs(item) or base_dir is None else os.path.join(base_dir, item)
