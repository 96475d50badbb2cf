"""The proxy's HTTP/1.1 protocol: uvicorn's, plus a deadline for a request's head.

Consumes bytes from one TCP connection; emits nothing of its own but, when a client
has not finished a request line and its headers within ``header_timeout_s`` of opening
the connection (or of sending the first byte of a later request on a kept-alive one),
a ``408 Request Timeout`` and the close of that connection. uvicorn closes an idle
kept-alive connection after ``timeout_keep_alive``, but has no such deadline for a
request that has begun: a client that sends half a request line (or nothing at all)
holds a connection, and a slot of ``limit_concurrency``, forever.

Works on uvicorn's own protocol classes (h11 or httptools, whichever uvicorn picks),
through what both share: ``connection_made``, ``data_received``, ``connection_lost``,
``transport``, ``loop``, and ``cycle`` (the request/response in progress, set once a
request's headers are complete).
"""

from __future__ import annotations

import asyncio
from typing import Any

_TIMEOUT_BODY = b"the request line and headers took too long"
_TIMEOUT_RESPONSE = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
                     b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_TIMEOUT_BODY), _TIMEOUT_BODY))


def with_header_timeout(base: type[asyncio.Protocol], header_timeout_s: float) -> type[asyncio.Protocol]:
    """A subclass of uvicorn's protocol class ``base`` that closes a connection whose
    request head is not complete ``header_timeout_s`` seconds after it began."""

    class HeaderTimeoutProtocol(base):  # type: ignore[valid-type, misc]
        _head_timer: asyncio.TimerHandle | None = None

        def _waiting_for_head(self) -> bool:
            cycle = getattr(self, "cycle", None)
            return cycle is None or cycle.response_complete

        def _arm(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(header_timeout_s, self._head_timed_out)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timed_out(self) -> None:
            self._head_timer = None
            if self._waiting_for_head() and not self.transport.is_closing():
                self.transport.write(_TIMEOUT_RESPONSE)
                self.transport.close()

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()  # a connection that never sends a byte is closed too

        def data_received(self, data: bytes) -> None:
            if self._waiting_for_head():
                self._arm()  # the first byte of a request on a kept-alive connection
            super().data_received(data)
            if not self._waiting_for_head():
                # The head is complete: the app reads the body. After the response, an
                # idle kept-alive connection is uvicorn's timeout_keep_alive's to close.
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    HeaderTimeoutProtocol.__name__ = HeaderTimeoutProtocol.__qualname__ = f"HeaderTimeout{base.__name__}"
    return HeaderTimeoutProtocol
