"""HTTP errors in OpenAI's shape: :class:`ApiError` and its JSON body.

``ApiError`` hangs under ``OmniRelayError`` (``OmniRelayError └── ApiError``): it is the
serving layer's translation of a client mistake or an overload into a status code and
a message that says what to fix. Handlers raise it; the app turns it into::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "modalities", "code": null}}

:func:`translate` maps the runtime's own errors (an invalid request id, a request id
already in flight, a shut-down pipeline, a stage that is down) to the matching status;
:func:`request_failed` a request that failed after it was admitted (503
``stage_unavailable`` with ``Retry-After`` when a stage it needs went down, docs/protocol.md
§7.6, else 500);
:func:`stream_error_body` the same failure as a stream's ``error`` event.
"""

from __future__ import annotations

import math
from typing import Any

from omnirelay.errors import (
    InvalidRequestError,
    OmniRelayError,
    PipelineError,
    RequestFailedError,
    StageUnavailableError,
)

__all__ = ["ApiError", "error_body", "request_failed", "stream_error_body", "translate"]


class ApiError(OmniRelayError):
    """A request the server refuses: ``status`` (4xx/5xx), a message, and OpenAI's fields."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        # ``code`` is always a string: the specific one, else the error's kind.
        return error_body(self.message, type=self.type, param=self.param, code=self.code or self.type)


def error_body(
    message: str, *, type: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def translate(exc: OmniRelayError) -> ApiError:
    """The HTTP error for a runtime error raised while admitting a request."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, StageUnavailableError):
        return _stage_unavailable(exc)
    if isinstance(exc, InvalidRequestError):
        text = str(exc)
        if "already in flight" in text:
            return ApiError(409, text, code="request_id_in_use", param="X-Request-Id")
        return ApiError(400, text)
    if isinstance(exc, PipelineError):
        return ApiError(503, f"the pipeline cannot take requests: {exc}", type="server_error")
    return ApiError(500, f"internal error: {exc}", type="server_error")


def _stage_unavailable(exc: StageUnavailableError) -> ApiError:
    """503: a stage the request needs is down. ``Retry-After`` when it is coming back
    (whole seconds, at least 1); none when the server gave up restarting it."""
    headers = {}
    message = f"a stage this request needs is unavailable: {exc.reason}"
    if exc.retry_after_s is not None:
        seconds = max(1, math.ceil(exc.retry_after_s))
        headers["Retry-After"] = str(seconds)
        message += f"; retry after {seconds} s"
    return ApiError(503, message, type="server_error", code=StageUnavailableError.code, headers=headers)


def request_failed(exc: RequestFailedError) -> ApiError:
    """The HTTP error of a request the pipeline failed after admitting it."""
    if isinstance(exc, StageUnavailableError):
        return _stage_unavailable(exc)
    return ApiError(500, f"the pipeline failed the request: {exc.reason}", type="server_error")


def stream_error_body(exc: RequestFailedError) -> dict[str, Any]:
    """The ``error`` event of a stream (SSE) whose request the pipeline failed mid-stream."""
    if isinstance(exc, StageUnavailableError):
        body = _stage_unavailable(exc).body()
        if exc.retry_after_s is not None:
            body["error"]["retry_after"] = max(1, math.ceil(exc.retry_after_s))
        return body
    return error_body(f"the request failed mid-stream: {exc.reason}", type="server_error")
