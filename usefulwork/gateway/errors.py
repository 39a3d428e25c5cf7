"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``.

Status codes: 400 malformed JSON, 401 bad API key, 404 unknown model or path, 413 body too large,
422 a field missing / wrongly typed / out of range, 502 no replica answered, 503 no healthy
replica, 504 upstream timed out. Never a stack trace.
"""

from __future__ import annotations

from typing import Any

import orjson

JSON_HEADERS = [(b"content-type", b"application/json")]

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class GatewayError(Exception):
    """An error the client should see, with the status code that fits it."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: list[tuple[bytes, bytes]] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers or []

    def body(self) -> bytes:
        return error_body(self.status, self.message, param=self.param, code=self.code)


def model_not_found(model: str) -> GatewayError:
    """A model no pool serves and one the caller's tenant may not call get the same answer, in OpenAI's
    words: nothing for a key to probe."""
    return GatewayError(404, f"The model '{model}' does not exist or you do not have access to it",
                        param="model", code="model_not_found")


def error_body(status: int, message: str, *, param: str | None = None, code: str | None = None,
               type_: str | None = None) -> bytes:
    err: dict[str, Any] = {
        "message": message,
        "type": type_ or _TYPES.get(status, "invalid_request_error"),
        "param": param,
        "code": code,
    }
    return orjson.dumps({"error": err})


async def send_json(send, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    """Send a complete JSON response on a raw ASGI channel."""
    hdrs = [*JSON_HEADERS, (b"content-length", str(len(body)).encode())]
    if headers:
        hdrs.extend(headers)
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})


async def send_error(send, err: GatewayError, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    await send_json(send, err.status, err.body(), [*err.headers, *(headers or [])])
