"""The one image-admission rule (media/images.py ``ImageRule``) and the proxy's bound on
decoded pixels (``PixelBudget``): an image bomb (a ~20 KB PNG that decodes to 13000 x
13000) is refused from its header with nothing decoded; the encoded size is checked
before an inline copy is base64-decoded or a stored blob read; an event's reference must
be the size its bytes are; every image of a request or dataset row is checked before any
is stored (a refusal stores nothing); the budget's high-water mark never passes its
capacity under concurrent decodes, and a decode with no room in time is a 503 with
``Retry-After`` at the proxy."""

from __future__ import annotations

import base64
import io
import struct
import threading
import zlib

import pytest

from tapioca.media.images import (
    AdmittedImages,
    ImageBusyError,
    ImageError,
    ImageRule,
    PixelBudget,
    admit_image,
    admit_images,
    decoded_images,
    ref_bytes,
)
from tapioca.media.store import FileImageStore, sha256_hex
from tapioca.schemas.events import ImageRef


def bomb_png(width: int = 13000, height: int = 13000) -> bytes:
    """A valid 1-bit PNG of ``width x height`` black pixels: ~20 KB of bytes that decode
    to 21 MB in PIL's mode 1 and 507 MB as RGB (what the processor converts to)."""
    def chunk(tag: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    row = b"\0" * (1 + (width + 7) // 8)  # filter byte + packed bits
    z = zlib.compressobj(9)
    body = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", body) + chunk(b"IEND", b""))


def png(width: int = 8, height: int = 6, colour=(200, 10, 10)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), colour).save(buf, format="PNG")
    return buf.getvalue()


def spy_decodes(monkeypatch) -> list[tuple[int, int]]:
    """The size of every image PIL decodes from now on (``ImageFile.load``, which
    ``convert`` and the processor go through), while the test runs."""
    from PIL import ImageFile

    seen: list[tuple[int, int]] = []
    load = ImageFile.ImageFile.load

    def spy(self):
        seen.append(tuple(self.size))
        return load(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", spy)
    return seen


# PIL warns on opening a header past 89 M pixels; the refusal is the point here.
@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_a_bomb_is_refused_from_its_header_with_nothing_decoded(monkeypatch):
    decodes = spy_decodes(monkeypatch)
    bomb = bomb_png()
    assert len(bomb) < 64 * 1024  # small on the wire, 169 M pixels once decoded
    with pytest.raises(ImageError, match=r"13000 x 13000 = 169,000,000 pixels, over vlm.max_image_pixels=16,777,216"):
        admit_image(bomb)
    with pytest.raises(ImageError, match="over vlm.max_image_pixels"):
        with decoded_images([png(), bomb]):  # the processor's decode: the whole call refused first
            pass
    # Past PIL's own bomb limit (2 x 89 M pixels) the message is still the rule's.
    with pytest.raises(ImageError, match="over vlm.max_image_pixels=16,777,216"):
        admit_image(bomb_png(30000, 30000))
    assert decodes == []
    assert admit_image(png(8, 6)).pixels == 48 and decodes == []  # admission alone decodes nothing
    with decoded_images([png(8, 6)]) as images:
        assert [im.size for im in images] == [(8, 6)] and set(decodes) == {(8, 6)}


def test_encoded_size_and_the_references_claimed_size():
    data = png(8, 6)
    tight = ImageRule(max_bytes=len(data) - 1)
    with pytest.raises(ImageError, match=f"is {len(data)} encoded bytes, over vlm.max_image_bytes={len(data) - 1}"):
        admit_image(data, tight)
    ref = ImageRef(sha256=sha256_hex(data), width=8, height=6, data_b64=base64.b64encode(data).decode())
    # An inline copy over the limit is refused before it is base64-decoded.
    with pytest.raises(ImageError, match=f"is {len(data)} encoded bytes, over"):
        ref_bytes(ref, None, tight)
    assert ref_bytes(ref, None, ImageRule(max_bytes=len(data))) == data


def test_a_stored_blob_over_the_size_limit_is_refused_unread(tmp_path, monkeypatch):
    store = FileImageStore(tmp_path)
    data = png(8, 6)
    ref = ImageRef(sha256=store.put(data), width=8, height=6)
    read = []
    monkeypatch.setattr(FileImageStore, "_read", lambda self, sha: read.append(sha))
    with pytest.raises(ImageError, match="over vlm.max_image_bytes=10"):
        ref_bytes(ref, store, ImageRule(max_bytes=10))
    assert read == []


def test_an_events_reference_must_be_the_size_of_its_bytes(tmp_path):
    from tapioca.models.vision import ImageLoader, ImageProcessor

    data = png(8, 6)
    forged = ImageRef(sha256=sha256_hex(data), width=56, height=56, data_b64=base64.b64encode(data).decode())
    loader = ImageLoader(FileImageStore(tmp_path), ImageProcessor(min_pixels=56 * 56, max_pixels=112 * 112,
                                                                  patch_size=14, merge_size=2,
                                                                  temporal_patch_size=2))
    with pytest.raises(ImageError, match="the event says 56 x 56 but its bytes are 8 x 6"):
        loader.blobs([forged])
    honest = ImageRef(sha256=forged.sha256, width=8, height=6, data_b64=forged.data_b64)
    assert loader.blobs([honest]) == [data]


def test_every_image_is_checked_before_any_is_stored(tmp_path):
    store = FileImageStore(tmp_path / "images")
    good = [png(8, 6, (k, 0, 0)) for k in range(3)]
    with pytest.raises(ImageError, match="image 4 of 4: .*over vlm.max_image_pixels"):
        admit_images(good + [png(40, 40)], store, ImageRule(max_pixels=1000))
    assert not (tmp_path / "images").exists()  # nothing stored
    admitted = admit_images(good, store, ImageRule(max_pixels=1000), inline_max_bytes=0)
    assert isinstance(admitted, AdmittedImages) and not any(store.has(r.sha256) for r in admitted)
    assert sorted(admitted.blobs) == sorted(r.sha256 for r in admitted)
    admitted.commit()
    assert all(store.get(r.sha256) == admitted.blobs[r.sha256] for r in admitted)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_the_proxy_refuses_a_request_with_one_bad_image_storing_nothing(tmp_path):
    from tapioca.producers.proxy.images import take_images
    from tapioca.producers.proxy.openai_errors import ApiError

    class Vision:  # VisionPrompts' admission, without a model directory
        def admit(self, blobs):
            return admit_images(blobs, FileImageStore(tmp_path / "images"), ImageRule(max_pixels=1000))

    def part(data: bytes) -> dict:
        return {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(data).decode()}}

    messages = [{"role": "user", "content": [part(png(8, 6, (k, 1, 1))) for k in range(250)]
                 + [part(bomb_png()), {"type": "text", "text": "?"}]}]
    with pytest.raises(ApiError) as err:
        take_images(messages, Vision())
    assert err.value.status == 400 and err.value.code == "invalid_image"
    assert "image 251 of 251" in err.value.message and "13000 x 13000" in err.value.message
    assert not (tmp_path / "images").exists()
    _, refs = take_images([{"role": "user", "content": [part(png())]}], Vision())
    assert len(refs) == 1 and not (tmp_path / "images").exists()  # admitted; stored by generate()


def test_pixel_budget_bounds_concurrent_decodes_and_says_when_to_retry():
    image = 4096 * 4096
    budget = PixelBudget(2 * image, wait_s=30.0)
    inside, most, lock = [0], [0], threading.Lock()
    release = threading.Event()

    def decode() -> None:
        with budget.hold(image):
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
                if inside[0] == 2:
                    release.set()
            release.wait(30)  # the first two overlap for sure; the rest wait for room
            with lock:
                inside[0] -= 1

    threads = [threading.Thread(target=decode) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert budget.high_water == 2 * image and most[0] == 2 and budget.in_use == 0
    # A hold over the capacity takes the whole budget (never deadlocks)...
    with budget.hold(10 * image):
        assert budget.in_use == budget.capacity
        # ... and a decode that finds no room in time is told when to retry.
        hurried = PixelBudget(image, wait_s=0.0, retry_after_s=7)
        with hurried.hold(image):
            with pytest.raises(ImageBusyError, match="retry in 7 s") as err:
                with hurried.hold(1):
                    pass
    assert err.value.retry_after_s == 7 and hurried.refused == 1


def test_the_proxy_answers_503_with_retry_after_when_the_budget_is_full(tmp_path):
    from tapioca.producers.proxy.images import take_images
    from tapioca.producers.proxy.openai_errors import ApiError

    budget = PixelBudget(100, wait_s=0.0, retry_after_s=3)

    class Vision:
        def admit(self, blobs):
            return admit_images(blobs, FileImageStore(tmp_path), ImageRule(max_pixels=100), budget=budget)

    url = "data:image/png;base64," + base64.b64encode(png(8, 6)).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]
    with budget.hold(100):
        with pytest.raises(ApiError) as err:
            take_images(messages, Vision())
    assert (err.value.status, err.value.code, err.value.headers) == (503, "images_busy", {"Retry-After": "3"})
    assert len(take_images(messages, Vision())[1]) == 1  # room again
