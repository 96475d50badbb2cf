"""OpenAI-style error responses of the agent proxy.

Consumes nothing and emits nothing: every refusal of the proxy is an
:class:`ApiError`, rendered as the body the official clients parse,
``{"error": {"message", "type", "param", "code"}}``, with the HTTP status the
OpenAI API uses for the same case (400 bad request, 401 bad key, 403 wrong session,
404 unknown session, 410 too late, 413 too large, 429 rate limited (with
``Retry-After``), 503 shutting down).
"""

from __future__ import annotations

from typing import Any

from ...schemas.errors import TapiocaError

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 409: "invalid_request_error", 410: "invalid_request_error",
          413: "invalid_request_error",
          429: "rate_limit_error", 503: "server_error"}


class ApiError(TapiocaError):
    """A request the proxy refuses; ``status`` is the HTTP status code."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        # Extra response headers, e.g. Retry-After on a 429.
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def error_body(status: int, message: str, *, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)
