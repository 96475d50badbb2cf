"""The run's blob store: bytes too large for an event, by content address, beside the log.

Consumes bytes (``put``) and hex SHA-256 names (``get``); emits the same bytes, checked
against their name on every read. Keyed by the SHA-256 of the bytes: a blob is written
once however many events name it, writes are idempotent, and a reader that has the name
can trust what it reads. An event carries the name in place of the bytes (e.g. a
trajectory's routed experts beyond ``rollout.routed_experts_inline_max_bytes``,
:mod:`tapioca.schemas.routes`); the producer writes the blob before it publishes the
event, so a reader never sees a name whose blob is not there yet.

Layout: ``<root>/<sha256[:2]>/<sha256>``, by default ``<run dir>/blobs`` (the writers and
readers of a run share its directory, as the weights files' transport does). A write
goes to a temporary name in the same directory and is renamed into place, so a reader
never sees half a blob.

A small generic store on purpose: the same API (``put`` / ``get`` / ``has``) as the
image store of the vision-language work, so the two can become one.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from ..schemas.errors import TapiocaError

BLOBS_DIR = "blobs"


class BlobError(TapiocaError):
    """A blob named by an event is absent from the store, or its bytes do not hash to its name."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


class BlobStore:
    """Bytes by their SHA-256 in a directory; see the module docstring."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def _path(self, sha256: str) -> Path:
        if not (len(sha256) == 64 and all(c in "0123456789abcdef" for c in sha256)):
            raise BlobError(f"{sha256[:80]!r} is not a blob name (64 lowercase hex digits)")
        return self.root / sha256[:2] / sha256

    def has(self, sha256: str) -> bool:
        return self._path(sha256).exists()

    def put(self, data: bytes) -> str:
        """Store ``data`` (nothing to do when present); its hex SHA-256."""
        name = sha256_hex(data)
        path = self._path(name)
        if path.exists():
            return name
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return name

    def get(self, sha256: str) -> bytes:
        """The bytes named ``sha256``; :class:`BlobError` when absent or corrupted."""
        path = self._path(sha256)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise BlobError(f"blob {sha256} is not in {self.root}: the event names bytes its "
                            "producer stored elsewhere; give this role the run directory of the "
                            "run that wrote it") from None
        if sha256_hex(data) != sha256:
            raise BlobError(f"blob {sha256} in {self.root} is corrupted (its bytes hash to "
                            f"{sha256_hex(data)}); delete it, the events naming it cannot be used")
        return data


def run_blob_store(run_dir: str | os.PathLike) -> BlobStore:
    """The blob store of the run in ``run_dir``."""
    return BlobStore(Path(run_dir) / BLOBS_DIR)
