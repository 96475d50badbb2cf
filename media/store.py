"""The image store: encoded image bytes by content address, beside the run.

Consumes image bytes (``put``) and SHA-256 names (``get``); emits the same bytes, checked
against their name on every read. Keyed by the hex SHA-256 of the bytes, so a blob is
written once however many prompts, trajectories or samples name it, writes are
idempotent, and two runs (or an archive and its run) can share a store.

Events never carry pixels: they carry :class:`~tapioca.schemas.events.ImageRef` (the
sha256 plus mime and size), and every reader fetches the bytes here (docs/vlm.md).

Backends, chosen by :func:`open_image_store` from ``vlm.image_store``:

* a path or ``file://`` URL: a directory, ``<root>/<sha256[:2]>/<sha256>`` (the default is
  ``<run dir>/images``). A write goes to a temporary name in the same directory and is
  renamed into place, so a reader never sees half a blob;
* ``s3://bucket/prefix``: any S3-compatible object store through ``boto3`` (the optional
  dependency ``pip install 'tapioca-rl[s3]'``); credentials and endpoint come from the
  usual AWS environment (``AWS_ENDPOINT_URL`` for MinIO, Ceph, ...).

Another object store is a subclass of :class:`ImageStore` with ``_read`` / ``_write`` /
``has`` (``register_scheme`` makes ``open_image_store`` build it for its URL scheme).
"""

from __future__ import annotations

import abc
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Callable
from urllib.parse import unquote, urlparse

from ..schemas.errors import ConfigError, TapiocaError


class ImageStoreError(TapiocaError):
    """An image store could not be read or written (not about one image's content)."""


class MissingImageError(ImageStoreError):
    """An event names an image the store does not hold (or holds corrupted)."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _check_name(sha256: str) -> None:
    if not (len(sha256) == 64 and all(c in "0123456789abcdef" for c in sha256)):
        raise MissingImageError(f"{sha256[:80]!r} is not an image name (64 lowercase hex digits)")


class ImageStore(abc.ABC):
    """Bytes by their SHA-256; see the module docstring."""

    url: str

    def put(self, data: bytes) -> str:
        """Store ``data`` (a no-op when present); its hex SHA-256."""
        name = sha256_hex(data)
        if not self.has(name):
            self._write(name, data)
        return name

    def get(self, sha256: str) -> bytes:
        """The bytes named ``sha256``; :class:`MissingImageError` if absent or corrupted."""
        _check_name(sha256)
        data = self._read(sha256)
        if data is None:
            raise MissingImageError(
                f"image {sha256} is not in the image store {self.url}; the event names an image "
                "that was never stored there: point vlm.image_store at the store the run used (an "
                "archive keeps its images in <archive dir>/images)")
        if sha256_hex(data) != sha256:
            raise MissingImageError(f"image {sha256} in {self.url} is corrupted (its bytes hash to "
                                    f"{sha256_hex(data)}); delete the blob and store the image again")
        return data

    @abc.abstractmethod
    def has(self, sha256: str) -> bool:
        """Whether a blob of that name is stored."""

    def size(self, sha256: str) -> int | None:
        """The stored blob's size in bytes without reading it, where the backend can tell
        cheaply (None: unknown or absent); lets a reader refuse an oversized blob unread."""
        return None

    @abc.abstractmethod
    def _read(self, sha256: str) -> bytes | None:
        """The stored bytes, or None."""

    @abc.abstractmethod
    def _write(self, sha256: str, data: bytes) -> None:
        """Store ``data`` under its name (atomically: a reader sees all of it or nothing)."""


class FileImageStore(ImageStore):
    """A directory: ``<root>/<sha256[:2]>/<sha256>``."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)
        self.url = self.root.resolve().as_uri() if self.root.is_absolute() else str(self.root)

    def path(self, sha256: str) -> Path:
        return self.root / sha256[:2] / sha256

    def has(self, sha256: str) -> bool:
        _check_name(sha256)
        return self.path(sha256).is_file()

    def size(self, sha256: str) -> int | None:
        _check_name(sha256)
        try:
            return self.path(sha256).stat().st_size
        except OSError:
            return None

    def _read(self, sha256: str) -> bytes | None:
        try:
            return self.path(sha256).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ImageStoreError(f"cannot read image {sha256} from {self.url}: {exc}") from None

    def _write(self, sha256: str, data: bytes) -> None:
        from ..schemas.errors import storage_error

        path = self.path(sha256)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{sha256[:8]}.", dir=path.parent)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as exc:
            raise storage_error(exc, path) or ImageStoreError(
                f"cannot write image {sha256} to {self.url}: {exc}") from None


class S3ImageStore(ImageStore):
    """``s3://bucket/prefix``: objects ``<prefix>/<sha256[:2]>/<sha256>`` (boto3)."""

    def __init__(self, url: str, *, client=None) -> None:
        parsed = urlparse(url)
        if not parsed.netloc:
            raise ConfigError(f"vlm.image_store={url!r}: an S3 store is s3://BUCKET/PREFIX")
        self.url = url
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        if client is None:
            try:
                import boto3
            except ImportError:
                raise ConfigError(f"vlm.image_store={url!r} needs boto3: pip install 'tapioca-rl[s3]' "
                                  "(or pip install boto3), or use a directory") from None
            client = boto3.client("s3")
        self.client = client

    def _key(self, sha256: str) -> str:
        return "/".join(p for p in (self.prefix, sha256[:2], sha256) if p)

    def has(self, sha256: str) -> bool:
        _check_name(sha256)
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(sha256))
            return True
        except Exception as exc:  # botocore's ClientError: a 404 means absent
            if _s3_status(exc) == 404:
                return False
            raise ImageStoreError(f"cannot reach the image store {self.url}: {exc}") from None

    def _read(self, sha256: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(sha256))["Body"].read()
        except Exception as exc:
            if _s3_status(exc) == 404:
                return None
            raise ImageStoreError(f"cannot read image {sha256} from {self.url}: {exc}") from None

    def _write(self, sha256: str, data: bytes) -> None:
        # One PUT is atomic in S3: a reader sees the whole object or none.
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(sha256), Body=data)
        except Exception as exc:
            raise ImageStoreError(f"cannot write image {sha256} to {self.url}: {exc}") from None


def _s3_status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None) or {}
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return int(status) if status else None


_SCHEMES: dict[str, Callable[[str], ImageStore]] = {"s3": S3ImageStore}


def register_scheme(scheme: str, factory: Callable[[str], ImageStore]) -> None:
    """Make :func:`open_image_store` build ``factory(url)`` for ``scheme://`` URLs."""
    _SCHEMES[scheme] = factory


def open_image_store(url: str | os.PathLike) -> ImageStore:
    """The store named by ``url``: a directory path, ``file:///abs/dir``, or a registered
    scheme (``s3://bucket/prefix``)."""
    url = str(url)
    if not url:
        raise ConfigError("no image store given: set vlm.image_store to a directory or a URL "
                          "(s3://bucket/prefix); `tapioca train` defaults it to <run dir>/images")
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ConfigError(f"vlm.image_store={url!r}: a file URL names a local directory, "
                              "file:///abs/path")
        return FileImageStore(unquote(parsed.path))
    if parsed.scheme in _SCHEMES:
        return _SCHEMES[parsed.scheme](url)
    if parsed.scheme and len(parsed.scheme) > 1:  # not a Windows drive letter
        raise ConfigError(f"vlm.image_store={url!r}: unknown scheme {parsed.scheme!r}; use a "
                          f"directory, file://, or one of {', '.join(sorted(_SCHEMES))}://")
    return FileImageStore(url)
