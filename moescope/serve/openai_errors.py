"""The OpenAI error object: every error response is ``{"error": {"message", "type", "param", "code"}}``."""

from __future__ import annotations


class APIError(Exception):
    """An error a handler answers with (4xx for the client's mistakes; never a traceback in the log).

    Args:
        status: HTTP status.
        message: one sentence saying what was wrong and, where it helps, what is allowed.
        type: OpenAI's error type (``invalid_request_error``, ``not_found_error``, ``rate_limit_error``, ...).
        param: the request field at fault, if one is.
        code: a stable machine-readable code (``context_length_exceeded``, ``model_not_found``, ...).
        headers: extra response headers (``Retry-After`` on 429).
    """

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def http_error(status: int, detail: str) -> APIError:
    """Starlette's own errors (unknown path 404, wrong method 405) in the OpenAI shape."""
    kind = {404: "not_found_error", 405: "invalid_request_error"}.get(status, "invalid_request_error")
    return APIError(status, detail, type=kind, code={404: "not_found", 405: "method_not_allowed"}.get(status))
