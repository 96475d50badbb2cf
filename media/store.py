"""The content-addressed store: bytes by their SHA-256, for images and routed experts.

Consumes bytes (``put``) and hex SHA-256 names (``get``); emits the same bytes, checked
against their name on every read. Keyed by the hex SHA-256 of the bytes, so a blob is
written once however many events name it, writes are idempotent, a reader that has the
name can trust what it reads, and two runs (or an archive and its run) can share a store.
The producer writes a blob before it publishes the event naming it, so a reader never
sees a name whose blob is not there yet.

Two kinds of contents use it (:class:`Contents`: the noun and the advice of its errors):

* images (:data:`IMAGES`): events never carry pixels, they carry
  :class:`~tapioca.schemas.events.ImageRef` (the sha256 plus mime and size), and every
  reader fetches the bytes here (docs/vlm.md). The store is ``vlm.image_store``
  (:func:`open_image_store`), by default ``<run dir>/images``;
* blobs (:data:`BLOBS`): bytes too large for an event, e.g. a trajectory's routed experts
  beyond ``rollout.routed_experts_inline_max_bytes`` (:mod:`tapioca.schemas.routes`), in
  ``<run dir>/blobs`` (:func:`run_blob_store`; the writers and readers of a run share its
  directory, as the weights files' transport does).

Backends:

* a directory (:class:`FileBlobStore`; a path or ``file://`` URL):
  ``<root>/<sha256[:2]>/<sha256>``. A write goes to a temporary name in the same
  directory and is renamed into place, so a reader never sees half a blob. A store
  written before images and routes shared this module has the same layout and reads as is;
* ``s3://bucket/prefix`` (:class:`S3BlobStore`): objects ``<prefix>/<sha256[:2]>/<sha256>``
  in any S3-compatible object store through ``boto3`` (the optional dependency ``pip
  install 'tapioca-rl[s3]'``); credentials and endpoint come from the usual AWS
  environment (``AWS_ENDPOINT_URL`` for MinIO, Ceph, ...).

Another object store is a subclass of :class:`BlobStore` with ``_read`` / ``_write`` /
``has`` (``register_scheme`` makes ``open_image_store`` build it for its URL scheme).
Errors: :class:`BlobStoreError` (the store cannot be read or written) and its
:class:`MissingBlobError` (a name the store does not hold, holds corrupted, or that is
no name); an image store raises :class:`MissingImageError`, its subclass.
"""

from __future__ import annotations

import abc
import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
from urllib.parse import unquote, urlparse

from ..schemas.errors import ConfigError, TapiocaError, storage_error

BLOBS_DIR = "blobs"


class BlobStoreError(TapiocaError):
    """A content-addressed store could not be read or written (not about one blob's content)."""


class MissingBlobError(BlobStoreError):
    """An event names a blob the store does not hold (or holds corrupted), or no blob name."""


class MissingImageError(MissingBlobError):
    """An event names an image the store does not hold (or holds corrupted)."""


# The image code's names for the same family (tests and callers catch them).
ImageStoreError = BlobStoreError


@dataclass(frozen=True)
class Contents:
    """What a store holds, for its messages: ``noun`` (``image``), the advice when a
    name is ``missing`` or its bytes ``corrupt``, the setting that names the store, and
    the error a missing blob raises."""

    noun: str
    missing: str
    corrupt: str
    setting: str
    error: type[MissingBlobError] = MissingBlobError


BLOBS = Contents(
    noun="blob", setting="store",
    missing="the event names bytes its producer stored elsewhere; give this role the run directory "
            "of the run that wrote it",
    corrupt="delete it, the events naming it cannot be used")
IMAGES = Contents(
    noun="image", setting="vlm.image_store", error=MissingImageError,
    missing="the event names an image that was never stored there: point vlm.image_store at the "
            "store the run used (an archive keeps its images in <archive dir>/images)",
    corrupt="delete the blob and store the image again")


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class BlobStore(abc.ABC):
    """Bytes by their SHA-256; see the module docstring."""

    url: str
    contents: Contents = BLOBS

    def _check_name(self, sha256: str) -> None:
        if not (len(sha256) == 64 and all(c in "0123456789abcdef" for c in sha256)):
            noun = self.contents.noun
            article = "an" if noun[:1] in "aeiou" else "a"
            raise self.contents.error(f"{sha256[:80]!r} is not {article} {noun} name (64 lowercase hex digits)")

    def put(self, data: bytes) -> str:
        """Store ``data`` (a no-op when present); its hex SHA-256."""
        name = sha256_hex(data)
        if not self.has(name):
            self._write(name, data)
        return name

    def get(self, sha256: str) -> bytes:
        """The bytes named ``sha256``; :class:`MissingBlobError` (the contents' error) if
        absent or corrupted."""
        self._check_name(sha256)
        c = self.contents
        data = self._read(sha256)
        if data is None:
            raise c.error(f"{c.noun} {sha256} is not in the {c.noun} store {self.url}; {c.missing}")
        if sha256_hex(data) != sha256:
            raise c.error(f"{c.noun} {sha256} in {self.url} is corrupted (its bytes hash to "
                          f"{sha256_hex(data)}); {c.corrupt}")
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


class FileBlobStore(BlobStore):
    """A directory: ``<root>/<sha256[:2]>/<sha256>``."""

    def __init__(self, root: str | os.PathLike, *, contents: Contents | None = None) -> None:
        self.root = Path(root)
        self.url = self.root.resolve().as_uri() if self.root.is_absolute() else str(self.root)
        self.contents = contents or type(self).contents

    def path(self, sha256: str) -> Path:
        return self.root / sha256[:2] / sha256

    def has(self, sha256: str) -> bool:
        self._check_name(sha256)
        return self.path(sha256).is_file()

    def size(self, sha256: str) -> int | None:
        self._check_name(sha256)
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
            raise BlobStoreError(f"cannot read {self.contents.noun} {sha256} from {self.url}: {exc}") from None

    def _write(self, sha256: str, data: bytes) -> None:
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
            raise storage_error(exc, path) or BlobStoreError(
                f"cannot write {self.contents.noun} {sha256} to {self.url}: {exc}") from None


class S3BlobStore(BlobStore):
    """``s3://bucket/prefix``: objects ``<prefix>/<sha256[:2]>/<sha256>`` (boto3)."""

    def __init__(self, url: str, *, client=None, contents: Contents | None = None) -> None:
        self.contents = contents or type(self).contents
        setting = self.contents.setting
        parsed = urlparse(url)
        if not parsed.netloc:
            raise ConfigError(f"{setting}={url!r}: an S3 store is s3://BUCKET/PREFIX")
        self.url = url
        self.bucket = parsed.netloc
        self.prefix = parsed.path.strip("/")
        if client is None:
            try:
                import boto3
            except ImportError:
                raise ConfigError(f"{setting}={url!r} needs boto3: pip install 'tapioca-rl[s3]' "
                                  "(or pip install boto3), or use a directory") from None
            client = boto3.client("s3")
        self.client = client

    def _key(self, sha256: str) -> str:
        return "/".join(p for p in (self.prefix, sha256[:2], sha256) if p)

    def has(self, sha256: str) -> bool:
        self._check_name(sha256)
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(sha256))
            return True
        except Exception as exc:  # botocore's ClientError: a 404 means absent
            if _s3_status(exc) == 404:
                return False
            raise BlobStoreError(f"cannot reach the {self.contents.noun} store {self.url}: {exc}") from None

    def _read(self, sha256: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(sha256))["Body"].read()
        except Exception as exc:
            if _s3_status(exc) == 404:
                return None
            raise BlobStoreError(f"cannot read {self.contents.noun} {sha256} from {self.url}: {exc}") from None

    def _write(self, sha256: str, data: bytes) -> None:
        # One PUT is atomic in S3: a reader sees the whole object or none.
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(sha256), Body=data)
        except Exception as exc:
            raise BlobStoreError(f"cannot write {self.contents.noun} {sha256} to {self.url}: {exc}") from None


def _s3_status(exc: BaseException) -> int | None:
    response = getattr(exc, "response", None) or {}
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return int(status) if status else None


# The image code's names: the same classes holding IMAGES (their messages name images
# and vlm.image_store); ImageStore is any store, for annotations.
ImageStore = BlobStore


class FileImageStore(FileBlobStore):
    """A directory of images: ``<root>/<sha256[:2]>/<sha256>``."""

    contents = IMAGES


class S3ImageStore(S3BlobStore):
    """``s3://bucket/prefix`` of images."""

    contents = IMAGES


def run_blob_store(run_dir: str | os.PathLike) -> FileBlobStore:
    """The blob store of the run in ``run_dir``: ``<run dir>/blobs``."""
    return FileBlobStore(Path(run_dir) / BLOBS_DIR)


_SCHEMES: dict[str, Callable[[str], BlobStore]] = {"s3": S3ImageStore}


def register_scheme(scheme: str, factory: Callable[[str], BlobStore]) -> None:
    """Make :func:`open_image_store` build ``factory(url)`` for ``scheme://`` URLs."""
    _SCHEMES[scheme] = factory


def open_image_store(url: str | os.PathLike) -> BlobStore:
    """The image store named by ``url``: a directory path, ``file:///abs/dir``, or a
    registered scheme (``s3://bucket/prefix``)."""
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
