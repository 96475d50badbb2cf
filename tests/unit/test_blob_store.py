"""The one content-addressed store (media/store.py) that routes and images share: a
blob written by the layout of the stores it replaced (a plain file at
``<root>/<sha256[:2]>/<sha256>``, as bus/blobs.py and the image store wrote them) still
reads, for a route and an image; one name check, one error family with each contents'
words, one atomic write."""

from __future__ import annotations

import errno
import hashlib
import io
import os

import numpy as np
import pytest

from tapioca.media.images import ref_bytes
from tapioca.media.store import (
    BlobStoreError,
    FileBlobStore,
    ImageStoreError,
    MissingBlobError,
    MissingImageError,
    open_image_store,
    run_blob_store,
)
from tapioca.schemas.events import ImageRef, RoutedExperts
from tapioca.schemas.routes import decode_routes


def old_layout(root, data: bytes) -> str:
    """``data`` written as the stores before this one left it: a file at its path."""
    name = hashlib.sha256(data).hexdigest()
    (root / name[:2]).mkdir(parents=True, exist_ok=True)
    (root / name[:2] / name).write_bytes(data)
    return name


def test_a_route_blob_of_the_old_layout_replays(tmp_path):
    ids = np.arange(2 * 3 * 2, dtype=np.uint8).reshape(2, 3, 2)
    name = old_layout(tmp_path / "run" / "blobs", ids.tobytes())
    routes = RoutedExperts(num_tokens=2, num_layers=3, top_k=2, dtype="uint8", blob_sha256=name)
    store = run_blob_store(tmp_path / "run")
    assert store.has(name) and np.array_equal(decode_routes(routes, store), ids)


def test_an_image_of_the_old_layout_replays(tmp_path):
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (4, 3), (1, 2, 3)).save(buf, format="PNG")
    data = buf.getvalue()
    name = old_layout(tmp_path / "images", data)
    store = open_image_store(tmp_path / "images")
    assert store.has(name) and store.size(name) == len(data)
    assert ref_bytes(ImageRef(sha256=name, mime="image/png", width=4, height=3), store) == data


def test_one_error_family_in_each_contents_words(tmp_path):
    assert ImageStoreError is BlobStoreError and issubclass(MissingImageError, MissingBlobError)
    blobs, images = run_blob_store(tmp_path), open_image_store(tmp_path / "images")
    absent = hashlib.sha256(b"absent").hexdigest()
    with pytest.raises(MissingBlobError, match="blob .* is not in the blob store .*run directory") as e:
        blobs.get(absent)
    assert not isinstance(e.value, MissingImageError)
    with pytest.raises(MissingImageError, match="image .* is not in the image store .*vlm.image_store"):
        images.get(absent)
    with pytest.raises(MissingBlobError, match="not a blob name"):
        blobs.has("../x")
    with pytest.raises(MissingImageError, match="not an image name"):
        images.has("../x")


def test_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    store = FileBlobStore(tmp_path)
    name = store.put(b"kept")
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [name]

    def refuse(src, dst):
        raise OSError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(BlobStoreError, match="cannot write blob"):
        store.put(b"lost")
    assert [p.name for p in tmp_path.rglob("*") if p.is_file()] == [name]
