"""The server's error answers: `APIError` and the OpenAI error body it is sent as.

Every 4xx/5xx the server sends is `{"error": {"message", "type", "param", "code"}}` (OpenAI's shape):
`message` says what is wrong and what is allowed, `param` names the request field at fault (or is
null when the fault is the body as a whole), `code` is a machine-readable reason or null.
`ErrorResponse` declares that body for /openapi.json.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec


class APIError(Exception):
    """An error answered to the client as `{"error": {message, type, param, code}}` with `status`."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: Mapping[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = dict(headers) if headers else None  # extra HTTP headers (e.g. Retry-After)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def show(v: object) -> str:
    """`repr(v)`, cut to 60 characters, for quoting a client's value in an error message."""
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def bad_request(param: str | None, message: str, code: str | None = None) -> APIError:
    """A 400 `invalid_request_error` naming `param`."""
    return APIError(400, message, param=param, code=code)


class ErrorDetail(msgspec.Struct, kw_only=True):
    """What went wrong: `param` is the request field at fault (null: the body as a whole)."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    """The body of every error answer (OpenAI's shape)."""

    error: ErrorDetail
