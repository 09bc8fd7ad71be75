"""HTTP errors in OpenAI's shape: :class:`ApiError` and its JSON body.

``ApiError`` hangs under ``OmniRelayError`` (``OmniRelayError └── ApiError``): it is the
serving layer's translation of a client mistake or an overload into a status code and
a message that says what to fix. Handlers raise it; the app turns it into::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "modalities", "code": null}}

:func:`translate` maps the runtime's own errors (an invalid request id, a request id
already in flight, a shut-down pipeline) to the matching status.
"""

from __future__ import annotations

from typing import Any

from omnirelay.errors import InvalidRequestError, OmniRelayError, PipelineError

__all__ = ["ApiError", "error_body", "translate"]


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
    if isinstance(exc, InvalidRequestError):
        text = str(exc)
        if "already in flight" in text:
            return ApiError(409, text, code="request_id_in_use", param="X-Request-Id")
        return ApiError(400, text)
    if isinstance(exc, PipelineError):
        return ApiError(503, f"the pipeline cannot take requests: {exc}", type="server_error")
    return ApiError(500, f"internal error: {exc}", type="server_error")
