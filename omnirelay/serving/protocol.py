"""Request bodies of the OpenAI-compatible endpoints, and reading them safely.

* :func:`read_json_body` — the body of an HTTP request as a JSON object: only with
  ``Content-Type: application/json`` (415 otherwise: a browser may send any other type
  cross-site without asking first), capped at ``max_bytes`` while it is read (413 past
  it), malformed JSON → 400 that says where; :func:`loads_object` (the WebSocket's too)
  refuses nesting deeper than :data:`MAX_JSON_DEPTH` with a 400, never a crash.
* :func:`parse` — a JSON object into one of the models below; the first validation error
  becomes a 400 naming the field (``messages[0].content: ...``).
* :class:`ChatCompletionRequest`, :class:`SpeechRequest` — the fields omnirelay honours.
  Unknown fields are ignored (clients send many); known fields are type-checked strictly
  (``"1"`` is not an int, ``true`` is not a number).
* :func:`check_request_id` — the client's ``X-Request-Id`` (untrusted) or a fresh one.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.requests import ClientDisconnect, Request

from omnirelay.api import validate_request_id
from omnirelay.errors import InvalidRequestError
from omnirelay.serving.errors import ApiError

__all__ = [
    "MAX_JSON_DEPTH",
    "AudioParams",
    "AudioPart",
    "ChatCompletionRequest",
    "ChatMessage",
    "ContentPart",
    "ImagePart",
    "InputAudio",
    "SpeechRequest",
    "StreamOptions",
    "Turn",
    "check_request_id",
    "loads_object",
    "parse",
    "read_body",
    "read_json_body",
]

M = TypeVar("M", bound=BaseModel)

#: The deepest nesting of JSON arrays and objects accepted: OpenAI's bodies nest a few
#: levels; far deeper input only exhausts the parser's stack.
MAX_JSON_DEPTH = 64


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", frozen=True)


class InputAudio(_Model):
    data: str
    format: str


class ImageUrl(_Model):
    url: str
    #: OpenAI's resolution hint; the model's processor decides the resolution here
    detail: str | None = None


class ContentPart(_Model):
    type: str
    text: str | None = None
    input_audio: InputAudio | None = None
    image_url: ImageUrl | None = None


@dataclass(frozen=True, slots=True)
class AudioPart:
    """An ``input_audio`` part as the client sent it (decoded later, with the limits);
    ``param`` names it in errors (``messages[0].content[1].input_audio``)."""

    data: str
    format: str
    param: str


@dataclass(frozen=True, slots=True)
class ImagePart:
    """An ``image_url`` part as the client sent it (decoded later, with the limits);
    ``param`` names it in errors (``messages[0].content[1].image_url``)."""

    url: str
    param: str


#: One message as the pipeline takes it: its role and its parts in order.
Turn = tuple[str, list[str | AudioPart | ImagePart]]


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    #: an assistant turn's calls, a tool turn's answered call (read by
    #: :mod:`omnirelay.serving.tools`)
    tool_calls: Any = None
    tool_call_id: str | None = None
    #: refused when present (the deprecated function calling: use tools)
    function_call: Any = None

    def text(self, index: int) -> str:
        """The message's text; a part of another type (image, audio …), a function call,
        or a missing content on anything but an assistant turn is a 400."""
        pieces = self.parts(index, takes_audio=False)
        return "".join(p for p in pieces if isinstance(p, str))

    def parts(
        self, index: int, *, takes_audio: bool, takes_images: bool = False, image_refusal: str | None = None
    ) -> list[str | AudioPart | ImagePart]:
        """The message's text, ``input_audio`` and ``image_url`` parts, in order
        (docs/protocol.md §7.1). A 400 for a deprecated function call, a missing content on
        anything but an assistant turn, audio or an image outside a user turn or on a model
        that takes none (``takes_audio``, ``takes_images``; ``image_refusal`` says why it
        takes none), and every other part type."""
        where = f"messages[{index}]"
        if self.function_call is not None:
            raise ApiError(
                400,
                f"{where}.function_call: the deprecated function calls are not supported; use tool_calls",
                param=f"{where}.function_call",
            )
        if self.content is None:
            if self.role == "assistant":
                return [""]
            raise ApiError(
                400,
                f"{where}.content is null; a {self.role} message needs its text as a string or text parts",
                param=f"{where}.content",
            )
        if isinstance(self.content, str):
            return [self.content]
        pieces: list[str | AudioPart | ImagePart] = []
        takes = "text parts ({'type': 'text', 'text': ...})"
        if takes_audio:
            takes += ", input_audio parts ({'type': 'input_audio', 'input_audio': {'data', 'format'}})"
        if takes_images:
            takes += (
                ", image_url parts ({'type': 'image_url', 'image_url': {'url': 'data:image/png;base64,...'}})"
            )
        if not (takes_audio or takes_images):
            takes = "only " + takes
        for j, part in enumerate(self.content):
            here = f"{where}.content[{j}]"
            if part.type == "text" and part.text is not None:
                pieces.append(part.text)
            elif (
                part.type in ("input_audio", "image_url")
                and self.role != "user"
                and (takes_audio if part.type == "input_audio" else takes_images)
            ):
                kind = "audio" if part.type == "input_audio" else "image"
                raise ApiError(
                    400, f"{here}: {kind} input is taken in user messages only, not {self.role}", param=here
                )
            elif part.type == "input_audio" and takes_audio:
                if part.input_audio is None:
                    raise ApiError(400, f"{here}.input_audio is required", param=f"{here}.input_audio")
                audio = part.input_audio
                pieces.append(AudioPart(audio.data, audio.format, f"{here}.input_audio"))
            elif part.type == "image_url" and takes_images:
                if part.image_url is None:
                    raise ApiError(400, f"{here}.image_url is required", param=f"{here}.image_url")
                pieces.append(ImagePart(part.image_url.url, f"{here}.image_url"))
            else:
                kind = "this part is not supported"
                if part.type == "image_url":
                    kind = image_refusal or "this model takes no image input"
                raise ApiError(
                    400,
                    f"{here} has type {part.type!r}; {kind}: this model takes {takes}",
                    param=f"{where}.content",
                )
        return pieces


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
    n: int = Field(default=1, ge=1)
    #: OpenAI's key for requests that share a prompt prefix; here: the conversation a
    #: replicated stage keeps on one replica (docs/design.md §11)
    prompt_cache_key: str | None = Field(default=None, min_length=1, max_length=256)
    #: function tools, read by :mod:`omnirelay.serving.tools` (400 on a model whose chat
    #: template takes none)
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # OpenAI's fields that omnirelay cannot honour: refused by unsupported() when they ask
    # for something, rather than ignored (a client would silently get another answer).
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    logprobs: Any = None
    top_logprobs: Any = None
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    prediction: Any = None
    web_search_options: Any = None

    def unsupported(self) -> None:
        """A 400 naming the first field that asks for something omnirelay does not do."""
        if self.functions:
            _refuse_field("functions", "the deprecated function calling is not supported; use tools")
        if self.function_call not in (None, "none"):
            _refuse_field(
                "function_call", "the deprecated function calling is not supported; use tool_choice"
            )
        if self.n != 1:
            _refuse_field("n", f"n is {self.n}; one choice per request is supported (n: 1)")
        fmt = self.response_format
        if fmt is not None and fmt != {"type": "text"}:
            kind = fmt.get("type") if isinstance(fmt, dict) else None
            shown = repr(kind) if isinstance(kind, str) else json.dumps(fmt)[:60]
            _refuse_field(
                "response_format", f"response_format {shown} is not supported; only {{'type': 'text'}}"
            )
        if self.logprobs not in (None, False) or self.top_logprobs not in (None, 0):
            _refuse_field("logprobs", "log probabilities are not supported")
        if self.logit_bias:
            _refuse_field("logit_bias", "logit_bias is not supported")
        for key in ("presence_penalty", "frequency_penalty"):
            if getattr(self, key) not in (None, 0):
                _refuse_field(key, f"{key} is not supported; omit it or pass 0")
        for key in ("prediction", "web_search_options"):
            if getattr(self, key) is not None:
                _refuse_field(key, f"{key} is not supported")


def _refuse_field(param: str, message: str) -> None:
    raise ApiError(400, message, param=param, code="unsupported_parameter")


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
    #: the language to speak (a model that is told one: Qwen3-TTS); an extension of OpenAI's API
    language: str | None = None


async def read_json_body(request: Request, max_bytes: int) -> dict[str, Any]:
    """The request's JSON object body; 415 unless ``application/json``, 413 over
    ``max_bytes``, 400 when not a JSON object (see the module docstring)."""
    content_type = request.headers.get("content-type", "")
    if content_type.partition(";")[0].strip().lower() != "application/json":
        shown = repr(content_type[:100]) if content_type else "none"
        raise ApiError(
            415,
            f"the request body must be JSON sent with 'Content-Type: application/json' (got {shown})",
            code="unsupported_media_type",
        )
    raw = await read_body(request, max_bytes)
    if not raw.strip():
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        return loads_object(raw, "the request body")
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The request's body, read with a cap: 413 past ``max_bytes`` (declared or sent), 400
    when the client leaves while sending it."""
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
    return b"".join(chunks)


def loads_object(raw: str | bytes, what: str) -> dict[str, Any]:
    """``raw`` as a JSON object of at most :data:`MAX_JSON_DEPTH` levels; ValueError that
    says what is wrong (``what`` names the input) otherwise. The depth is measured on the
    text before parsing, so the parser never recurses past the limit."""
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if _deeper_than(data, MAX_JSON_DEPTH):
        raise ValueError(_too_deep(what))
    try:
        value = json.loads(raw)
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} is not UTF-8 text: {exc.reason}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{what} is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}"
        ) from exc
    except RecursionError as exc:  # unbalanced and deep: the parser gave up first
        raise ValueError(_too_deep(what)) from exc
    if not isinstance(value, dict):
        raise ValueError(f"{what} must be a JSON object, got a JSON {_json_kind(value)}")
    if _SURROGATE_ESCAPE.search(data) is not None and _has_lone_surrogate(value):
        # "\ud800" alone parses to a str that no UTF-8 encoder (tokenizer, log, header) takes.
        raise ValueError(f"{what} has a \\u escape of an unpaired UTF-16 surrogate; it is not text")
    return value


def _has_lone_surrogate(value: object) -> bool:
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _too_deep(what: str) -> str:
    return f"{what} nests arrays and objects more than {MAX_JSON_DEPTH} levels deep"


def _json_kind(value: object) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if value is None:
        return "null"
    return "boolean" if isinstance(value, bool) else "number"


_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_A_BRACKET = re.compile(rb"[^\[\]{}]+")
_INNERMOST_PAIR = re.compile(rb"\[\]|\{\}")
#: a \u escape in the surrogate range (D800-DFFF): paired ones are fine, so look closer
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _deeper_than(text: bytes, limit: int) -> bool:
    """Whether JSON ``text`` nests brackets more than ``limit`` deep: strings dropped, only
    brackets kept, then each pass removes the innermost pairs (one level), all in C."""
    brackets = _NOT_A_BRACKET.sub(b"", _JSON_STRING.sub(b"", text))
    for _ in range(limit):
        if not brackets:
            return False
        brackets, removed = _INNERMOST_PAIR.subn(b"", brackets)
        if not removed:
            return False  # unbalanced: the parser says where
    return bool(brackets)


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
