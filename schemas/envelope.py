"""The event envelope, encoding, and validation on decode.

Every event on every topic is one JSON object (orjson): the envelope fields
(`event_id`, `type`, `schema_version`, `run_id`, `produced_at`, `producer_id`)
followed by the typed payload fields of its class, all at the top level so a
service in any language reads `event["traj_id"]` directly. Arrays (token ids,
logprobs, versions) are plain JSON arrays.

Validation runs on decode (and before encode): field types, finite numbers,
equal lengths where a class declares them (`_same_length`), and a size limit.
A failure raises :class:`SchemaError` with a message naming the field; the bus
turns that into a dead-letter record.
"""

from __future__ import annotations

import dataclasses
import math
import time
import types
import typing
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Literal, Union

import orjson

from .errors import SchemaError

# Kafka's default broker limit is ~1 MB; ours is raised (docker-compose.yml sets the
# broker to match) because a sample event carries whole groups of long sequences.
DEFAULT_MAX_EVENT_BYTES = 32 * 1024 * 1024


class UnknownEventTypeError(SchemaError):
    """The `type` field names no known event class."""


class UnsupportedSchemaVersionError(SchemaError):
    """The event's `schema_version` is newer (or other) than this code understands."""


class EventTooLargeError(SchemaError):
    """The encoded event exceeds the configured size limit."""


_EVENT_TYPES: dict[str, type["Event"]] = {}

# The run id of an event (or a bus client) that names no run in particular: a CLI
# command for every run, an external service that did not copy the run id, a member
# started without a run. The one home of this rule; everything else asks the helpers.
ANY_RUN = "default"


def names_a_run(run_id: str) -> bool:
    """Whether ``run_id`` names one run (not :data:`ANY_RUN`)."""
    return run_id != ANY_RUN


def run_reads(own_run_id: str, event_run_id: str) -> bool:
    """Whether a member of run ``own_run_id`` reads an event of ``event_run_id``: a
    member of no particular run reads every run's events, a run's member only its own."""
    return not names_a_run(own_run_id) or event_run_id == own_run_id


def of_another_run(own_run_id: str, event_run_id: str) -> bool:
    """Whether an event names a run other than ``own_run_id`` (which names one): an
    earlier or neighbouring run's on the same topics, skipped by this run's members, and
    signed (if at all) under that run's key, so its signature is not this run's to check;
    one that claims this run's id (or none) is."""
    return names_a_run(own_run_id) and names_a_run(event_run_id) and event_run_id != own_run_id


def run_addresses(own_run_id: str, event_run_id: str) -> bool:
    """Whether an event of ``event_run_id`` is meant for a member of ``own_run_id``:
    :func:`run_reads`, or the event names no run (a command for every run)."""
    return run_reads(own_run_id, event_run_id) or not names_a_run(event_run_id)


@dataclass(kw_only=True)
class Event:
    """Envelope shared by every event; subclasses add the payload.

    Subclasses set the class attributes ``TYPE`` (the wire name) and
    ``SCHEMA_VERSION`` (bumped when fields are added; fields are only ever added,
    with defaults). ``_same_length`` lists array fields that must have equal
    lengths (empty optional arrays are exempt when listed in ``_optional_arrays``).
    """

    TYPE: ClassVar[str] = ""
    SCHEMA_VERSION: ClassVar[int] = 1
    _same_length: ClassVar[tuple[str, ...]] = ()
    _optional_arrays: ClassVar[tuple[str, ...]] = ()

    event_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    type: str = ""
    schema_version: int = 0
    run_id: str = ANY_RUN
    produced_at: float = field(default_factory=time.time)
    producer_id: str = ""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.TYPE:
            if cls.TYPE in _EVENT_TYPES and _EVENT_TYPES[cls.TYPE] is not cls:
                raise TypeError(f"event type {cls.TYPE!r} registered twice")
            _EVENT_TYPES[cls.TYPE] = cls

    def __post_init__(self) -> None:
        self.type = self.TYPE
        if not self.schema_version:
            self.schema_version = self.SCHEMA_VERSION

    def validate(self) -> None:
        """Raise SchemaError if any field has the wrong type, a non-finite number,
        or declared arrays differ in length."""
        for name, check, _required in _field_checks(type(self)):
            check(getattr(self, name), name)
        _check_equal_lengths(self, self.TYPE)

    def to_dict(self) -> dict[str, Any]:
        return orjson.loads(orjson.dumps(self))


def event_types() -> dict[str, type[Event]]:
    """All registered event classes by wire name."""
    return dict(_EVENT_TYPES)


def _check_equal_lengths(obj: Any, label: str) -> None:
    names = getattr(obj, "_same_length", ())
    if not names:
        return
    optional = getattr(obj, "_optional_arrays", ())
    lengths = {}
    for name in names:
        seq = getattr(obj, name)
        if name in optional and len(seq) == 0:
            continue
        lengths[name] = len(seq)
    if len(set(lengths.values())) > 1:
        raise SchemaError(
            f"{label}: arrays must have equal lengths, got "
            + ", ".join(f"{k}={v}" for k, v in lengths.items())
        )


# ---------------------------------------------------------------------------
# Field checkers, compiled once per class from the type hints.

Checker = Callable[[Any, str], None]


def _fail(path: str, expected: str, value: Any) -> None:
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    raise SchemaError(f"field {path!r}: expected {expected}, got {type(value).__name__} {shown}")


def _check_int(v: Any, path: str) -> None:
    if type(v) is not int:
        _fail(path, "integer", v)


def _check_float(v: Any, path: str) -> None:
    if type(v) is float:
        if not math.isfinite(v):
            raise SchemaError(f"field {path!r}: expected a finite number, got {v}")
    elif type(v) is not int:
        _fail(path, "number", v)


def _check_str(v: Any, path: str) -> None:
    if type(v) is not str:
        _fail(path, "string", v)


def _check_bool(v: Any, path: str) -> None:
    if type(v) is not bool:
        _fail(path, "boolean", v)


def _check_any(v: Any, path: str) -> None:
    # Recurse: orjson would silently write a nested NaN / inf as null.
    if isinstance(v, float):
        if not math.isfinite(v):
            raise SchemaError(f"field {path!r}: expected a finite number, got {v}")
    elif type(v) is list:
        for i, x in enumerate(v):
            _check_any(x, f"{path}[{i}]")
    elif type(v) is dict:
        for k, x in v.items():
            _check_any(x, f"{path}.{k}")


def _check_int_list(v: Any, path: str) -> None:
    if type(v) is not list:
        _fail(path, "array of integers", v)
    for i, x in enumerate(v):
        if type(x) is not int:
            _fail(f"{path}[{i}]", "integer", x)


def _check_float_list(v: Any, path: str) -> None:
    if type(v) is not list:
        _fail(path, "array of numbers", v)
    isfinite = math.isfinite
    for i, x in enumerate(v):
        tx = type(x)
        if tx is float:
            if not isfinite(x):
                raise SchemaError(f"field {path}[{i}]: expected a finite number, got {x}")
        elif tx is not int:
            _fail(f"{path}[{i}]", "number", x)


def _compile(tp: Any) -> Checker:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is int:
        return _check_int
    if tp is float:
        return _check_float
    if tp is str:
        return _check_str
    if tp is bool:
        return _check_bool
    if tp is Any:
        return _check_any
    if origin is list:
        (item,) = args
        if item is int:
            return _check_int_list
        if item is float:
            return _check_float_list
        inner = _compile(item)

        def check_list(v: Any, path: str) -> None:
            if type(v) is not list:
                _fail(path, "array", v)
            for i, x in enumerate(v):
                inner(x, f"{path}[{i}]")

        return check_list
    if origin is dict:
        key_t, val_t = args
        if key_t is not str:
            raise TypeError("event dict fields must have str keys")
        inner = _compile(val_t)

        def check_dict(v: Any, path: str) -> None:
            if type(v) is not dict:
                _fail(path, "object", v)
            for k, x in v.items():
                inner(x, f"{path}.{k}")

        return check_dict
    if origin is Literal:
        allowed = args

        def check_literal(v: Any, path: str) -> None:
            if v not in allowed:
                raise SchemaError(f"field {path!r}: expected one of {list(allowed)}, got {v!r}")

        return check_literal
    if origin in (Union, types.UnionType):
        non_none = [a for a in args if a is not type(None)]
        if len(non_none) == 1 and len(args) == 2:
            inner = _compile(non_none[0])

            def check_optional(v: Any, path: str) -> None:
                if v is not None:
                    inner(v, path)

            return check_optional
        raise TypeError(f"unsupported union in event schema: {tp}")
    if dataclasses.is_dataclass(tp):
        checks = _field_checks(tp)

        def check_nested(v: Any, path: str) -> None:
            if not isinstance(v, tp):
                _fail(path, tp.__name__, v)
            for name, check, _ in checks:
                check(getattr(v, name), f"{path}.{name}")
            _check_equal_lengths(v, path)

        return check_nested
    raise TypeError(f"unsupported type in event schema: {tp}")


_CHECKS_CACHE: dict[type, list[tuple[str, Checker, bool]]] = {}
_HINTS_CACHE: dict[type, dict[str, Any]] = {}


def field_types(cls: type) -> dict[str, Any]:
    """Resolved type hints of a dataclass's fields (cached)."""
    hints = _HINTS_CACHE.get(cls)
    if hints is None:
        all_hints = typing.get_type_hints(cls)
        hints = {f.name: all_hints[f.name] for f in dataclasses.fields(cls)}
        _HINTS_CACHE[cls] = hints
    return hints


def _field_checks(cls: type) -> list[tuple[str, Checker, bool]]:
    checks = _CHECKS_CACHE.get(cls)
    if checks is None:
        hints = field_types(cls)
        checks = []
        for f in dataclasses.fields(cls):
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            checks.append((f.name, _compile(hints[f.name]), required))
        _CHECKS_CACHE[cls] = checks
    return checks


# ---------------------------------------------------------------------------
# Encoding and decoding.


def encode_event(event: Event, *, max_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> bytes:
    """Validate and serialise an event; raises SchemaError before anything is sent."""
    if not isinstance(event, Event) or not event.TYPE:
        raise SchemaError(f"only typed Tapioca events can be encoded, got {type(event).__name__}")
    event.validate()
    try:
        raw = orjson.dumps(event)
    except orjson.JSONEncodeError as exc:  # e.g. an int beyond 64 bits, a non-str dict key
        raise SchemaError(f"{event.TYPE} event cannot be encoded as JSON: {exc}") from None
    if len(raw) > max_bytes:
        raise EventTooLargeError(
            f"{event.TYPE} event is {len(raw):,} bytes, over the limit of {max_bytes:,}; "
            "shorten the sequences / group, or raise bus.max_message_bytes "
            "(and the broker's message.max.bytes) to match"
        )
    return raw


def _build(cls: type[Event] | type, data: dict[str, Any], path: str) -> Any:
    """Construct a dataclass from decoded JSON, recursing into nested dataclasses.
    Unknown fields are ignored (a newer producer may have added fields)."""
    hints = field_types(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if required:
                raise SchemaError(f"{path}: missing required field {f.name!r}")
            continue
        if not f.init:
            continue
        kwargs[f.name] = _convert(hints[f.name], data[f.name], f"{path}.{f.name}")
    return cls(**kwargs)


def _convert(tp: Any, value: Any, path: str) -> Any:
    if dataclasses.is_dataclass(tp):
        if type(value) is not dict:
            _fail(path, "object", value)
        return _build(tp, value, path)
    origin = typing.get_origin(tp)
    if origin is list:
        (item,) = typing.get_args(tp)
        if dataclasses.is_dataclass(item) and type(value) is list:
            return [_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin in (Union, types.UnionType) and value is not None:
        non_none = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(non_none) == 1:
            return _convert(non_none[0], value, path)
    return value


def decode_event(
    raw: bytes,
    *,
    allowed_types: tuple[type[Event], ...] | None = None,
    max_bytes: int = DEFAULT_MAX_EVENT_BYTES,
) -> Event:
    """Parse and validate one event. Raises SchemaError (or a subclass) with the reason."""
    if raw is None:
        raise SchemaError("empty message value (tombstone); events always carry a body")
    if len(raw) > max_bytes:
        raise EventTooLargeError(
            f"message is {len(raw):,} bytes, over the limit of {max_bytes:,}; "
            "raise bus.max_message_bytes if such events are expected"
        )
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise SchemaError(f"not valid JSON: {exc}") from None
    if type(data) is not dict:
        raise SchemaError(f"an event must be a JSON object, got {type(data).__name__}")
    type_name = data.get("type")
    cls = _EVENT_TYPES.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise UnknownEventTypeError(
            f"unknown event type {type_name!r}; known: {sorted(_EVENT_TYPES)}"
        )
    if allowed_types is not None and cls not in allowed_types:
        raise SchemaError(
            f"event type {type_name!r} does not belong on this topic "
            f"(expected {[c.TYPE for c in allowed_types]})"
        )
    version = data.get("schema_version")
    if type(version) is not int or not 1 <= version <= cls.SCHEMA_VERSION:
        raise UnsupportedSchemaVersionError(
            f"{type_name} schema_version {version!r} is not supported (this code reads 1.."
            f"{cls.SCHEMA_VERSION}); upgrade this consumer or publish a supported version"
        )
    # The envelope default would invent a fresh id on every decode, defeating de-duplication.
    if type(data.get("event_id")) is not str or not data["event_id"]:
        raise SchemaError(f"{type_name}: missing required field 'event_id' (a non-empty string)")
    data.pop("type")
    event = _build(cls, data, type_name)
    event.validate()
    return event
