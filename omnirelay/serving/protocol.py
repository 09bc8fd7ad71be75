"""Request bodies of the OpenAI-compatible endpoints, and reading them safely.

* :func:`read_json_body` — the body of an HTTP request as a JSON object, capped at
  ``max_bytes`` while it is read (413 past it), malformed JSON → 400 that says where.
* :func:`parse` — a JSON object into one of the models below; the first validation error
  becomes a 400 naming the field (``messages[0].content: ...``).
* :class:`ChatCompletionRequest`, :class:`SpeechRequest` — the fields omnirelay honours.
  Unknown fields are ignored (clients send many); known fields are type-checked strictly
  (``"1"`` is not an int, ``true`` is not a number).
* :func:`check_request_id` — the client's ``X-Request-Id`` (untrusted) or a fresh one.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect, Request

from omnirelay.api import validate_request_id
from omnirelay.errors import InvalidRequestError
from omnirelay.serving.errors import ApiError

__all__ = [
    "AudioParams",
    "ChatCompletionRequest",
    "ChatMessage",
    "ContentPart",
    "SpeechRequest",
    "StreamOptions",
    "check_request_id",
    "parse",
    "read_json_body",
]

M = TypeVar("M", bound=BaseModel)


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class ContentPart(_Model):
    type: str
    text: str | None = None


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self, index: int) -> str:
        """The message's text; a part of another type (image, audio …) is a 400."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        pieces = []
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise ApiError(
                    400,
                    f"messages[{index}].content[{j}] has type {part.type!r}; only text parts "
                    "({'type': 'text', 'text': ...}) are supported",
                    param=f"messages[{index}].content",
                )
            pieces.append(part.text)
        return "".join(pieces)


class AudioParams(_Model):
    voice: str | None = None
    format: str | None = None


class StreamOptions(_Model):
    include_usage: bool = False


class ChatCompletionRequest(_Model):
    messages: list[ChatMessage] = Field(min_length=1)
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    modalities: Any = None  # checked against the pipeline (docs/protocol.md §7.1)
    audio: AudioParams | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=1)


class SpeechRequest(_Model):
    input: str
    model: str | None = None
    voice: str | None = None
    response_format: str = "mp3"  # as OpenAI's
    speed: float = 1.0
    stream: bool = False
    stream_format: str | None = None
    word_timestamps: bool = False
    instructions: str | None = None


async def read_json_body(request: Request, max_bytes: int) -> dict[str, Any]:
    """The request's JSON object body; 413 over ``max_bytes``, 400 when not a JSON object."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(int(declared), max_bytes)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise _too_large(size, max_bytes)
            chunks.append(chunk)
    except ClientDisconnect as exc:
        raise ApiError(400, "the client closed the connection while sending the body") from exc
    raw = b"".join(chunks)
    if not raw.strip():
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        value = json.loads(raw)
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not UTF-8 text: {exc.reason}") from exc
    except json.JSONDecodeError as exc:
        raise ApiError(
            400, f"the request body is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from exc
    if not isinstance(value, dict):
        raise ApiError(400, f"the request body must be a JSON object, got a JSON {type(value).__name__}")
    return value


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(
        413,
        f"the request body is {size} bytes or more; the limit is {limit} bytes",
        code="request_too_large",
    )


def _loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "list[ContentPart]", "list[str]", "function-after"):
            continue  # union branch names, not fields
        else:
            out += f".{part}" if out else str(part)
    return out


def parse(model: type[M], body: dict[str, Any]) -> M:
    """``body`` as ``model``; a 400 naming the first field that does not validate."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        where = _loc(tuple(err.get("loc", ())))
        msg = err.get("msg", "invalid value")
        if err.get("type") == "missing":
            raise ApiError(400, f"{where} is required", param=where) from exc
        given = err.get("input")
        shown = json.dumps(given)[:80] if _is_jsonable(given) else type(given).__name__
        raise ApiError(400, f"{where}: {msg} (got {shown})", param=where or None) from exc


def _is_jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def check_request_id(header: str | None, prefix: str) -> str:
    """The client's ``X-Request-Id`` when usable (400 otherwise), else ``prefix-<hex>``."""
    if header is None:
        return f"{prefix}-{uuid.uuid4().hex}"
    try:
        return validate_request_id(header)
    except InvalidRequestError as exc:
        raise ApiError(400, f"X-Request-Id: {exc}", param="X-Request-Id") from exc
