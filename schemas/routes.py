"""The wire encoding of routed experts (:class:`~tapioca.schemas.events.RoutedExperts`).

Consumes the ids an engine recorded (an integer array ``[tokens, MoE layers, top_k]``)
or a :class:`RoutedExperts` read off the log; emits the one compact form both ends
agree on: the ids as one little-endian, token-major array of the narrowest dtype that
holds every expert id (uint8 up to 256 experts, uint16 up to 65,536), base64 on the
event, or in a blob store (:mod:`tapioca.media.store`) when larger than the writer's
inline limit. Keyed by nothing: pure functions (the store is passed in).
"""

from __future__ import annotations

import base64
import binascii
from typing import Protocol

import numpy as np

from .errors import SchemaError
from .events import RoutedExperts

_DTYPES = {"uint8": np.dtype("<u1"), "uint16": np.dtype("<u2")}


class BytesStore(Protocol):
    """What the encoding needs of a blob store: ``put(bytes) -> sha256``, ``get(sha256)``."""

    def put(self, data: bytes) -> str: ...

    def get(self, sha256: str) -> bytes: ...


def route_dtype(num_experts: int) -> str:
    """The wire dtype of a model with ``num_experts`` experts per layer."""
    if num_experts <= 256:
        return "uint8"
    if num_experts <= 65536:
        return "uint16"
    raise SchemaError(f"{num_experts} experts do not fit the routed_experts encoding (uint16: at most 65536)")


def encode_routes(ids_TLK: np.ndarray, *, inline_max_bytes: int, store: BytesStore | None = None,
                  num_experts: int | None = None) -> RoutedExperts:
    """``ids_TLK`` as a :class:`RoutedExperts`: inline when its bytes are at most
    ``inline_max_bytes`` (or there is no ``store``), else in ``store``. The dtype is the
    one of ``num_experts``; without it, an array's own uint8 / uint16, else the narrowest
    that holds its largest id."""
    ids = np.asarray(ids_TLK)
    if ids.ndim != 3:
        raise SchemaError(f"routed experts must be [tokens, layers, top_k], got shape {ids.shape}")
    if ids.size and (int(ids.min()) < 0 or (num_experts is not None and int(ids.max()) >= num_experts)):
        raise SchemaError(f"routed expert ids span [{int(ids.min())}, {int(ids.max())}], outside "
                          f"[0, {num_experts})")
    if num_experts is not None:
        dtype = route_dtype(num_experts)
    elif ids.dtype in (np.uint8, np.uint16):
        dtype = ids.dtype.name
    else:
        dtype = route_dtype(int(ids.max()) + 1 if ids.size else 1)
    raw = np.ascontiguousarray(ids, dtype=_DTYPES[dtype]).tobytes()
    t, n_layers, k = ids.shape
    if store is None or len(raw) <= inline_max_bytes or not raw:
        return RoutedExperts(num_tokens=t, num_layers=n_layers, top_k=k, dtype=dtype,
                             data_b64=base64.b64encode(raw).decode("ascii"))
    return RoutedExperts(num_tokens=t, num_layers=n_layers, top_k=k, dtype=dtype,
                         blob_sha256=store.put(raw))


def route_bytes(routes: RoutedExperts, store: BytesStore | None = None) -> bytes:
    """The raw ids of ``routes`` (from the event, or from ``store`` for a blob)."""
    if routes.blob_sha256:
        if store is None:
            raise SchemaError(f"routed_experts are in blob {routes.blob_sha256} but no blob store "
                              "was given to read them from")
        raw = store.get(routes.blob_sha256)
    else:
        try:
            raw = base64.b64decode(routes.data_b64, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise SchemaError(f"routed_experts.data_b64 is not base64: {exc}") from None
    if len(raw) != routes.num_bytes:
        raise SchemaError(f"routed_experts hold {len(raw)} bytes; {routes.num_tokens} tokens x "
                          f"{routes.num_layers} layers x top-{routes.top_k} in {routes.dtype} need "
                          f"{routes.num_bytes}")
    return raw


def decode_routes(routes: RoutedExperts, store: BytesStore | None = None) -> np.ndarray:
    """``[num_tokens, num_layers, top_k]`` ids (uint8 / uint16, read-only) of ``routes``."""
    raw = route_bytes(routes, store)
    return np.frombuffer(raw, dtype=_DTYPES[routes.dtype]).reshape(
        routes.num_tokens, routes.num_layers, routes.top_k)


def inline(routes: RoutedExperts, store: BytesStore | None = None) -> RoutedExperts:
    """``routes`` with its bytes on the event (a blob read from ``store``)."""
    if not routes.blob_sha256:
        return routes
    raw = route_bytes(routes, store)
    return RoutedExperts(num_tokens=routes.num_tokens, num_layers=routes.num_layers,
                         top_k=routes.top_k, dtype=routes.dtype,
                         data_b64=base64.b64encode(raw).decode("ascii"))
