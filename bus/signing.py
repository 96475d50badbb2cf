"""Signed events: who may command the fleet and publish policy versions.

Topics whose registry entry says ``signed`` (``control.v1``, ``weights.v1``) carry an
HMAC-SHA256 of each record's value (the encoded event, byte for byte) under the run's
key, in the Kafka header ``tapioca.sig``::

    tapioca.sig = b"hmac-sha256:<key id>:<64 hex digits>"

The key id is the first 12 hex digits of sha256(key): it names the key without
revealing it, so an error can say "signed with another run's key". The producer signs
(:meth:`EventProducer.publish`), and every reader verifies before a role sees the event
(the runner dead-letters a record that fails; :class:`TopicReader` returns it as an
error); roles never see either. An event stamped with another run's id is not checked:
the runner skips it (a run before this one on the prefix signed with its own key). A
resent copy of a signed record still verifies: the roles' own de-duplication (command
ids, monotonic versions) handles replays.

The key: 32 random bytes as 64 hex digits in a file readable by its owner only (0600),
``<run dir>/secrets/bus.key``, created by ``tapioca train`` (or ``tapioca keygen PATH``)
and named by ``bus.signing_key_path``. With no key configured nothing is signed or
verified (a single trusted user's bus; every role says so once at start).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ..schemas.errors import ConfigError, SchemaError

log = logging.getLogger(__name__)

SIGNATURE_HEADER = "tapioca.sig"
SCHEME = b"hmac-sha256"
KEY_BYTES = 32
# Where `tapioca train` keeps a run's secrets (mode 0700), relative to the run directory.
SECRETS_DIR = "secrets"
KEY_FILE_NAME = "bus.key"
KEY_FILE_ENV = "TAPIOCA_SIGNING_KEY_FILE"

Headers = Iterable[tuple[str, bytes | None]]


class SignatureError(SchemaError):
    """A record of a signed topic has no valid signature under the run's key: it is
    dead-lettered, never handed to a role."""


@dataclass(frozen=True)
class SigningKey:
    secret: bytes
    path: str = ""

    @property
    def key_id(self) -> str:
        return hashlib.sha256(self.secret).hexdigest()[:12]

    def __repr__(self) -> str:  # never print the secret
        return f"SigningKey(id={self.key_id}, path={self.path!r})"

    def mac(self, value: bytes) -> str:
        return hmac.new(self.secret, value, hashlib.sha256).hexdigest()

    def sign(self, value: bytes) -> bytes:
        """The ``tapioca.sig`` header value for a record value."""
        return b":".join((SCHEME, self.key_id.encode(), self.mac(value).encode()))

    def verify(self, value: bytes | None, headers: Headers | None) -> None:
        """Raise :class:`SignatureError` unless ``headers`` hold a valid signature of
        ``value`` under this key."""
        found = [v for k, v in (headers or ()) if k == SIGNATURE_HEADER]
        if not found or found[-1] is None:
            raise SignatureError(
                f"unsigned record on a signed topic (no {SIGNATURE_HEADER} header): only "
                "holders of the run's key (bus.signing_key_path) may publish here")
        parts = found[-1].split(b":")
        if len(parts) != 3 or parts[0] != SCHEME:
            raise SignatureError(f"malformed {SIGNATURE_HEADER} header")
        key_id, mac = parts[1].decode(errors="replace"), parts[2]
        if key_id != self.key_id:
            raise SignatureError(
                f"record signed with key {key_id}, but this run's key is {self.key_id}: "
                "published by another run (or a forger)")
        if not hmac.compare_digest(mac, self.mac(value or b"").encode()):
            raise SignatureError("bad signature: the record was altered or forged")


def key_path_of_run(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / SECRETS_DIR / KEY_FILE_NAME


def create_key_file(path: str | os.PathLike) -> SigningKey:
    """A new key at ``path`` (0600; its directory created 0700), or the key already
    there: a resumed run keeps its key, so its earlier signed events still verify."""
    path = Path(path)
    if path.exists():
        return load_key_file(path)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    secret = secrets.token_bytes(KEY_BYTES)
    write_secret_file(path, secret.hex() + "\n")
    return SigningKey(secret, str(path))


def write_secret_file(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to a new file readable by its owner only (created 0600 from the
    start, so it is never world-readable, whatever the umask)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def read_secret_file(path: str | os.PathLike, what: str) -> str:
    """The stripped text of a secret file; a clear error when it is missing or readable
    by others (as ssh refuses such a key)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(f"{what} {path} is readable by other users (mode "
                          f"{stat.S_IMODE(mode):04o}): `chmod 600 {path}`")
    return path.read_text().strip()


def load_key_file(path: str | os.PathLike) -> SigningKey:
    try:
        text = read_secret_file(path, "the bus signing key file")
    except ConfigError as exc:
        raise ConfigError(
            f"{exc}. `tapioca train` creates it as <run dir>/{SECRETS_DIR}/{KEY_FILE_NAME}; "
            "point bus.signing_key_path (or --run-dir / --key-file for the CLI) at the run's "
            "key, or make one with `tapioca keygen PATH`") from None
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        secret = b""
    if len(secret) < 16:
        raise ConfigError(f"the bus signing key file {path} does not hold a key (at least 32 "
                          "hex digits); make one with `tapioca keygen PATH`")
    return SigningKey(secret, str(path))


_cache: dict[tuple[str, int], SigningKey] = {}


def cached_key(path: str) -> SigningKey:
    """The key at ``path``, read once per file version (its mtime)."""
    try:
        mtime = os.stat(path).st_mtime_ns
    except OSError:
        mtime = -1
    key = _cache.get((path, mtime))
    if key is None:
        key = load_key_file(path)
        _cache[(path, mtime)] = key
    return key
