"""The one exception hierarchy of Tapioca.

Every error a user can see derives from :class:`TapiocaError`; messages say what to do.
A process that ends with one exits with its ``exit_code``: 1, or :data:`EXIT_CONFIG` for an
error no restart can fix (a bad config or usage, a missing key file, a port taken), which
the launcher does not retry and reports as that error's one line; :data:`EXIT_STORAGE`
(a disk) and :data:`EXIT_OOM` (device memory) are not retried either.
"""

import errno
import os

# sysexits.h EX_CONFIG: a config or usage error. `tapioca` exits with it for such errors,
# and `tapioca train`'s supervisor never restarts a role that did (ops/launcher.py).
EXIT_CONFIG = 78
# sysexits.h EX_IOERR: a disk full, failing or read-only (StorageError): the run stops,
# saying which file could not be written, until a person frees space.
EXIT_STORAGE = 74
# A device ran out of memory (DeviceMemoryError; sysexits.h's EX_OSERR number): not
# restarted, since the same step would need the same memory; the run stops naming the
# settings that lower it.
EXIT_OOM = 71


class TapiocaError(Exception):
    """Base of every Tapioca error."""

    exit_code = 1


class ConfigError(TapiocaError):
    """A configuration value is missing or invalid."""

    exit_code = EXIT_CONFIG


class CannotRegenerateError(TapiocaError):
    """A logged trajectory cannot be regenerated (`tapioca regenerate`): not found, no
    sampling seed recorded, a version's weights no longer on disk, an engine that does not
    key its draws per request. Exit code 2: 0 and 1 are the command's verdicts
    (identical / differs)."""

    exit_code = 2


class SchemaError(TapiocaError):
    """An event failed to encode, decode or validate."""


class UnattributedEventError(SchemaError):
    """An event without a run id (or stamped ``default``) read by a role of a named run,
    on an input where that run's events must say so (``Role.attributed_inputs``)."""


class BusError(TapiocaError):
    """Kafka plumbing failed (broker unreachable, delivery failed, ...)."""


class BrokerUnavailableError(BusError):
    """No broker answered at the configured bootstrap servers."""


class EngineError(TapiocaError):
    """An inference engine failed."""


class RewardError(TapiocaError):
    """A reward function or service failed."""


class BadEventError(TapiocaError):
    """One event this role cannot use, for a reason in the event itself: a token id
    outside the model's vocabulary, a sample made for another estimator, a weights file
    that is missing or fails its checksum, a version older than the one followed. The
    bus dead-letters the event with this message and the role goes on.

    Raised by ``Role.handle`` it is about the event being handled. Raised by
    ``Role.on_tick`` (a fault found late) it must name the event at fault: ``event``,
    with ``source`` (a :class:`~tapioca.bus.role.Source`) where known. ``retryable``:
    something outside the event may still change (a file not there yet), so the bus
    retries with backoff before dead-lettering it; otherwise it dead-letters at once."""

    def __init__(self, message: str, *, event: object = None, source: object = None,
                 retryable: bool = False) -> None:
        super().__init__(message)
        self.event = event
        self.source = source
        self.retryable = retryable


class FatalRoleError(TapiocaError):
    """Raised by a role when retrying or dead-lettering cannot help (a bad config, a
    failed training step, lost model files): the role stops and reports it."""


class StorageError(FatalRoleError):
    """A file could not be written because of its disk: full (``ENOSPC``, ``EDQUOT``,
    or a file size limit, ``EFBIG``), failing (``EIO``) or read-only (``EROFS``). No retry
    fixes it, so it stops the role; the message is one line, ``<strerror> writing <path>``
    (e.g. ``No space left on device writing runs/x/weights/v000028.safetensors``)."""

    exit_code = EXIT_STORAGE


class DeviceMemoryError(FatalRoleError):
    """A step ran out of device memory (``torch.OutOfMemoryError``, or a CUDA error that
    says "out of memory"). No restart fixes it: the same step needs the same memory."""

    exit_code = EXIT_OOM


def out_of_memory_error(exc: BaseException, what: str = "") -> "DeviceMemoryError | None":
    """``exc`` (or an error it was raised from) as a :class:`DeviceMemoryError` when it
    is an out-of-memory error, its message cut to the first sentences (torch's goes on
    about the allocator) and prefixed by ``what``; else None."""
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, DeviceMemoryError):
            return e
        text = str(e)
        if type(e).__name__ == "OutOfMemoryError" or (isinstance(e, RuntimeError)
                                                       and "out of memory" in text.lower()):
            return DeviceMemoryError(f"{what}{_first_sentences(text)}")
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _first_sentences(text: str, limit: int = 240) -> str:
    """Up to the sentence that says what is free (torch: "CUDA out of memory. Tried to
    allocate 2.32 GiB. GPU 0 has a total capacity of 79.19 GiB of which 1.05 GiB is
    free."), on one line."""
    text = " ".join(text.split())
    end = text.find(" is free.")
    if 0 <= end < 400:
        return text[:end + len(" is free.")]
    return text if len(text) <= limit else text[:limit].rsplit(" ", 1)[0] + " ..."


# The OSError numbers :func:`storage_error` turns into a StorageError.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EROFS})


def storage_error(exc: BaseException, path: object = None) -> "StorageError | None":
    """``exc`` as a :class:`StorageError` naming ``path`` (default: the error's own file
    name) when it is an OSError of the disk (``STORAGE_ERRNOS``); else None."""
    if isinstance(exc, StorageError):
        return exc
    if not isinstance(exc, OSError) or exc.errno not in STORAGE_ERRNOS:
        return None
    where = path if path is not None else (exc.filename or "a file")
    return StorageError(f"{os.strerror(exc.errno)} writing {where}")


def require_config(cond: bool, message: str) -> None:
    """Raise :class:`ConfigError` with ``message`` (which says what to change) unless
    ``cond``: the one check every config dataclass's ``__post_init__`` uses."""
    if not cond:
        raise ConfigError(message)
