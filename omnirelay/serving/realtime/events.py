"""The wire side of ``/v1/realtime``: client frames in, session settings, server event shapes.

Pure functions and value types, no I/O: :func:`decode_frame` (a frame → a client event,
or a fatal :class:`EventError`), :func:`apply_session_update` (``session.update`` →
new :class:`RealtimeSettings`, all or nothing), :func:`decode_audio` (base64 pcm16),
:func:`parse_text_item` and :func:`response_overrides`, and :func:`session_object` (the
``session`` of ``session.created`` / ``session.updated``).

Anything a client sends that omnirelay cannot honour is an :class:`EventError` naming
the field, never ignored.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from omnirelay.models.tools import ToolChoice, ToolSpec
from omnirelay.serving.protocol import loads_object
from omnirelay.serving.realtime.vad import VadParams

__all__ = [
    "CLIENT_EVENTS",
    "EventError",
    "RealtimeSettings",
    "TurnDetection",
    "apply_session_update",
    "decode_audio",
    "decode_frame",
    "new_id",
    "parse_text_item",
    "response_overrides",
    "session_object",
]

CLIENT_EVENTS = (
    "session.update",
    "input_audio_buffer.append",
    "input_audio_buffer.commit",
    "input_audio_buffer.clear",
    "conversation.item.create",
    "response.create",
    "response.cancel",
    "conversation.item.truncate",
    "conversation.item.delete",
    "conversation.item.retrieve",
)
AUDIO_FORMAT = "pcm16"
MAX_INSTRUCTIONS_CHARS = 16384
#: bounds of the turn detection durations a client may set, in ms
PADDING_MS = (0, 5000)
SILENCE_MS = (50, 10000)


class EventError(Exception):
    """A client event omnirelay refuses: an ``error`` event; ``fatal``: then close 1008."""

    def __init__(
        self,
        message: str,
        *,
        code: str = "invalid_value",
        param: str | None = None,
        fatal: bool = False,
        type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param
        self.fatal = fatal
        self.type = type


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:20]}"


@dataclass(frozen=True, slots=True)
class TurnDetection:
    """``turn_detection`` of type ``server_vad``: the detector's parameters, and what a
    detected turn does (commit and answer; cut a response in flight)."""

    vad: VadParams = field(default_factory=VadParams)
    create_response: bool = True
    interrupt_response: bool = True

    def as_event(self) -> dict[str, Any]:
        return {
            "type": "server_vad",
            "threshold": self.vad.threshold,
            "prefix_padding_ms": self.vad.prefix_padding_ms,
            "silence_duration_ms": self.vad.silence_duration_ms,
            "create_response": self.create_response,
            "interrupt_response": self.interrupt_response,
        }


@dataclass(frozen=True, slots=True)
class RealtimeSettings:
    modalities: tuple[str, ...]
    voice: str
    instructions: str = ""
    turn_detection: TurnDetection | None = field(default_factory=TurnDetection)
    temperature: float | None = None
    max_output_tokens: int | None = None  # None: "inf" (the pipeline's default)
    #: ``input_audio_transcription``: {model, language?} (the pipeline's recognizer
    #: transcribes), or None: off
    transcription: dict[str, Any] | None = None
    #: ``response.create``'s ``metadata`` (GA), echoed in that response's events
    metadata: dict[str, str] | None = None
    #: ``session.tools`` and ``tool_choice`` (:mod:`omnirelay.serving.realtime.tools`)
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice | None = None


def tool_event(spec: ToolSpec) -> dict[str, Any]:
    """A tool in Realtime's form (``session.tools``)."""
    out: dict[str, Any] = {"type": "function", "name": spec.name}
    if spec.description is not None:
        out["description"] = spec.description
    out["parameters"] = dict(spec.parameters) if spec.parameters is not None else {"type": "object"}
    return out


def choice_event(choice: ToolChoice | None, none: str = "auto") -> Any:
    """``tool_choice`` in Realtime's form (``none``: what a session without tools says)."""
    if choice is None or choice.mode == "none":
        return none if choice is None else "none"
    return {"type": "function", "name": choice.name} if choice.mode == "function" else choice.mode


def session_object(
    session_id: str, model: str, settings: RealtimeSettings, sample_rate: int, window: dict[str, Any]
) -> dict[str, Any]:
    """The ``session`` of ``session.created`` / ``session.updated``. ``sample_rate`` (pcm16's
    rate both ways: 24 kHz, OpenAI's) and ``conversation`` (the bounded history:
    ``max_items``, ``num_dropped_items`` …) are omnirelay's additions."""
    tokens: int | str = "inf" if settings.max_output_tokens is None else settings.max_output_tokens
    td = settings.turn_detection
    return {
        "id": session_id,
        "object": "realtime.session",
        "model": model,
        "modalities": list(settings.modalities),
        "instructions": settings.instructions,
        "voice": settings.voice,
        "input_audio_format": AUDIO_FORMAT,
        "output_audio_format": AUDIO_FORMAT,
        "input_audio_transcription": settings.transcription,
        "turn_detection": None if td is None else td.as_event(),
        "tools": [tool_event(t) for t in settings.tools],
        "tool_choice": choice_event(settings.tool_choice, "none"),
        "temperature": settings.temperature,
        "max_response_output_tokens": tokens,
        "sample_rate": sample_rate,
        "conversation": window,
    }


def decode_frame(message: Mapping[str, Any], max_bytes: int) -> dict[str, Any]:
    """A WebSocket frame as a client event. Fatal (error, then close 1008): a binary frame,
    more than ``max_bytes``, not a JSON object or nested too deep. Not fatal: a ``type``
    missing or unknown (the event is refused; the session goes on)."""
    raw = message.get("text")
    if raw is None:
        raise EventError(
            "binary frames are not accepted; send JSON text events", code="invalid_frame", fatal=True
        )
    size = len(raw.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise EventError(
            f"event of {size} bytes; the limit is {max_bytes}", code="event_too_large", fatal=True
        )
    try:
        event = loads_object(raw, "the event")
    except ValueError as exc:
        raise EventError(str(exc), code="invalid_json", fatal=True) from exc
    kind = event.get("type")
    if kind not in CLIENT_EVENTS:
        shown = json.dumps(kind)[:60]
        raise EventError(
            f"unknown or unsupported event type {shown}; supported: {', '.join(CLIENT_EVENTS)}",
            code="invalid_event_type",
            param="type",
        )
    event_id = event.get("event_id")
    if event_id is not None and not isinstance(event_id, str):
        raise EventError("event_id must be a string", param="event_id")
    return event


def _field(obj: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = obj.get(key)
    if value is None:
        return None
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # A JSON boolean is not a number here (Python's bool is an int).
    if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
        names = "/".join(_JSON_NAMES[k] for k in kinds)
        raise EventError(
            f"{where}.{key} must be a {names}, got {json.dumps(value)[:40]}", param=f"{where}.{key}"
        )
    return value


_JSON_NAMES = {str: "string", bool: "boolean", int: "integer", float: "number", list: "list", dict: "object"}
_SESSION_KEYS = {
    "modalities",
    "instructions",
    "voice",
    "input_audio_format",
    "output_audio_format",
    "turn_detection",
    "temperature",
    "max_response_output_tokens",
    "input_audio_transcription",
    "tools",
    "tool_choice",
    "model",
    "sample_rate",
}


def apply_session_update(
    settings: RealtimeSettings,
    session: Any,
    *,
    check_voice: Any,
    check_modalities: Any,
    sample_rate: int,
    can_transcribe: bool = False,
) -> RealtimeSettings:
    """``settings`` with ``session.update``'s ``session`` applied, or :class:`EventError`
    (nothing applied). ``check_voice`` / ``check_modalities``: the server's checks (they
    raise :class:`~omnirelay.serving.errors.ApiError`); ``can_transcribe``: the pipeline
    has a speech recognizer stage (``input_audio_transcription`` needs one)."""
    if not isinstance(session, dict):
        raise EventError("session.update needs an object field 'session'", param="session")
    unknown = sorted(set(session) - _SESSION_KEYS)
    if unknown:
        raise EventError(
            f"session.{unknown[0]} is not supported by this server; supported: {sorted(_SESSION_KEYS)}",
            code="unsupported_field",
            param=f"session.{unknown[0]}",
        )
    values: dict[str, Any] = {}
    for key in ("input_audio_format", "output_audio_format"):
        fmt = _field(session, key, str, "session")
        if fmt is not None and fmt != AUDIO_FORMAT:
            raise EventError(
                f"session.{key} {fmt!r} is not supported; this server takes and sends 'pcm16' at "
                f"{sample_rate} Hz",
                param=f"session.{key}",
            )
    rate = _field(session, "sample_rate", int, "session")
    if rate is not None and rate != sample_rate:
        raise EventError(
            f"session.sample_rate is {sample_rate} Hz (pcm16's, as OpenAI's); resample the audio to it",
            param="session.sample_rate",
        )
    if "tools" in session and session["tools"] not in (None, []):
        raise EventError("session.tools is not supported by this server", param="session.tools")
    if "input_audio_transcription" in session:
        values["transcription"] = _transcription(session["input_audio_transcription"], can_transcribe)
    if session.get("tool_choice") not in (None, "none", "auto"):
        raise EventError("session.tool_choice: this server has no tools", param="session.tool_choice")
    values.update(
        _common_overrides(session, "session", check_voice=check_voice, check_modalities=check_modalities)
    )
    if "turn_detection" in session:
        values["turn_detection"] = _turn_detection(session["turn_detection"], settings.turn_detection)
    return replace(settings, **values)


#: the languages the pipeline's recognizer hears (PocketSphinx's US English model)
_LANGUAGES = ("en", "en-us", "english")


def _transcription(value: Any, can_transcribe: bool) -> dict[str, Any] | None:
    """``session.input_audio_transcription``: null (off) or {model, language, prompt}."""
    where = "session.input_audio_transcription"
    if value is None:
        return None
    if not isinstance(value, dict):
        raise EventError(f"{where} must be an object or null", param=where)
    if not can_transcribe:
        raise EventError(
            f"{where}: this pipeline has no speech recognizer stage to transcribe with; set it to null",
            code="unsupported_field",
            param=where,
        )
    unknown = sorted(set(value) - {"model", "language", "prompt"})
    if unknown:
        raise EventError(
            f"{where}.{unknown[0]} is not supported", code="unsupported_field", param=f"{where}.{unknown[0]}"
        )
    model = _field(value, "model", str, where)
    language = _field(value, "language", str, where)
    if language is not None and language.lower() not in _LANGUAGES:
        raise EventError(
            f"{where}.language {language!r} is not supported; the recognizer hears English ('en')",
            param=f"{where}.language",
        )
    if _field(value, "prompt", str, where):
        raise EventError(f"{where}.prompt: the recognizer takes no prompt", param=f"{where}.prompt")
    return {"model": model, "language": language, "prompt": None}


def _common_overrides(
    obj: Mapping[str, Any], where: str, *, check_voice: Any, check_modalities: Any
) -> dict[str, Any]:
    """The fields ``session.update`` and ``response.create`` share."""
    from omnirelay.serving.errors import ApiError

    values: dict[str, Any] = {}
    try:
        modalities = _field(obj, "modalities", list, where)
        if modalities is not None:
            values["modalities"] = tuple(check_modalities(modalities))
        voice = _field(obj, "voice", str, where)
        if voice is not None:
            values["voice"] = check_voice(voice)
    except ApiError as exc:
        raise EventError(f"{where}: {exc.message}", param=f"{where}.{exc.param or ''}".rstrip(".")) from exc
    instructions = _field(obj, "instructions", str, where)
    if instructions is not None:
        if len(instructions) > MAX_INSTRUCTIONS_CHARS:
            raise EventError(
                f"{where}.instructions is {len(instructions)} characters; the limit is {MAX_INSTRUCTIONS_CHARS}",
                param=f"{where}.instructions",
            )
        values["instructions"] = instructions
    temperature = _field(obj, "temperature", (int, float), where)
    if temperature is not None:
        if not 0.0 <= float(temperature) <= 2.0:
            raise EventError(f"{where}.temperature must be in [0, 2]", param=f"{where}.temperature")
        values["temperature"] = float(temperature)
    tokens = _field(obj, "max_response_output_tokens", (int, str), where)
    if tokens is not None:
        if tokens == "inf":
            values["max_output_tokens"] = None
        elif isinstance(tokens, int) and 1 <= tokens <= 4096:
            values["max_output_tokens"] = tokens
        else:
            raise EventError(
                f"{where}.max_response_output_tokens must be an integer in 1..4096 or 'inf'",
                param=f"{where}.max_response_output_tokens",
            )
    return values


def _turn_detection(value: Any, current: TurnDetection | None) -> TurnDetection | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise EventError("session.turn_detection must be an object or null", param="session.turn_detection")
    where = "session.turn_detection"
    known = {
        "type",
        "threshold",
        "prefix_padding_ms",
        "silence_duration_ms",
        "create_response",
        "interrupt_response",
    }
    unknown = sorted(set(value) - known)
    if unknown:
        raise EventError(
            f"{where}.{unknown[0]} is not supported", code="unsupported_field", param=f"{where}.{unknown[0]}"
        )
    kind = value.get("type", "server_vad")
    if kind != "server_vad":
        raise EventError(
            f"{where}.type {kind!r} is not supported; this server detects turns with 'server_vad' (or null: off)",
            param=f"{where}.type",
        )
    base = current or TurnDetection()
    vad = base.vad
    threshold = _field(value, "threshold", (int, float), where)
    if threshold is not None:
        if not (math.isfinite(threshold) and 0.0 <= threshold <= 1.0):
            raise EventError(f"{where}.threshold must be in [0, 1]", param=f"{where}.threshold")
        vad = replace(vad, threshold=float(threshold))
    for key, (lo, hi) in (("prefix_padding_ms", PADDING_MS), ("silence_duration_ms", SILENCE_MS)):
        ms = _field(value, key, int, where)
        if ms is not None:
            if not lo <= ms <= hi:
                raise EventError(f"{where}.{key} must be in {lo}..{hi}", param=f"{where}.{key}")
            vad = replace(vad, **{key: ms})
    flags = {}
    for key in ("create_response", "interrupt_response"):
        flag = _field(value, key, bool, where)
        if flag is not None:
            flags[key] = flag
    return replace(base, vad=vad, **flags)


def decode_audio(value: Any) -> np.ndarray:
    """``input_audio_buffer.append``'s ``audio``: base64 of 16-bit little-endian mono PCM."""
    if not isinstance(value, str):
        raise EventError(
            "input_audio_buffer.append needs a string field 'audio' (base64 pcm16)", param="audio"
        )
    try:
        data = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise EventError(f"audio is not valid base64: {exc}", code="invalid_audio", param="audio") from exc
    if len(data) % 2:
        raise EventError(
            f"audio has {len(data)} bytes; pcm16 needs an even number", code="invalid_audio", param="audio"
        )
    return np.frombuffer(data, dtype="<i2").astype(np.int16)


_ITEM_ROLES = {"user": "input_text", "system": "input_text", "assistant": "text"}
#: the content types each role's text takes (GA names an assistant's ``output_text``)
_ITEM_PARTS = {"user": ("input_text",), "system": ("input_text",), "assistant": ("text", "output_text")}


def parse_text_item(event: Mapping[str, Any]) -> tuple[str | None, str, str]:
    """``conversation.item.create``'s item as ``(client item id, role, text)``: a
    ``message`` of one text part (``input_text`` for user and system, ``text`` or GA's
    ``output_text`` for assistant)."""
    item = event.get("item")
    if not isinstance(item, dict):
        raise EventError("conversation.item.create needs an object field 'item'", param="item")
    item_id = _field(item, "id", str, "item")
    if item_id is not None and not 1 <= len(item_id) <= 64:
        raise EventError("item.id must be 1..64 characters", param="item.id")
    if item.get("type", "message") != "message":
        raise EventError(
            f"item.type {item.get('type')!r} is not supported; this server takes 'message' items",
            param="item.type",
        )
    role = item.get("role")
    if role not in _ITEM_ROLES:
        raise EventError(
            f"item.role must be one of {sorted(_ITEM_ROLES)}, got {json.dumps(role)[:40]}", param="item.role"
        )
    content = item.get("content")
    if not isinstance(content, list) or len(content) != 1 or not isinstance(content[0], dict):
        raise EventError("item.content must be a list of one text part", param="item.content")
    part = content[0]
    want = _ITEM_ROLES[role]
    if part.get("type") not in _ITEM_PARTS[role]:
        raise EventError(
            f"item.content[0].type must be {want!r} for a {role} message, got {json.dumps(part.get('type'))[:40]}",
            param="item.content[0].type",
        )
    text = part.get("text")
    if not isinstance(text, str) or not text.strip():
        raise EventError("item.content[0].text must be a non-empty string", param="item.content[0].text")
    return item_id, role, text


def response_overrides(
    event: Mapping[str, Any], settings: RealtimeSettings, *, check_voice: Any, check_modalities: Any
) -> RealtimeSettings:
    """The settings of one response: ``response.create``'s ``response`` over the session's."""
    response = event.get("response")
    if response is None:
        return settings
    if not isinstance(response, dict):
        raise EventError("response must be an object", param="response")
    known = {
        "modalities",
        "instructions",
        "voice",
        "output_audio_format",
        "temperature",
        "max_response_output_tokens",
        "conversation",
    }
    unknown = sorted(set(response) - known)
    if unknown:
        raise EventError(
            f"response.{unknown[0]} is not supported by this server",
            code="unsupported_field",
            param=f"response.{unknown[0]}",
        )
    if response.get("conversation") not in (None, "auto"):
        raise EventError("response.conversation: only 'auto' is supported", param="response.conversation")
    fmt = response.get("output_audio_format")
    if fmt not in (None, AUDIO_FORMAT):
        raise EventError(
            f"response.output_audio_format {fmt!r} is not supported; 'pcm16' only",
            param="response.output_audio_format",
        )
    values = _common_overrides(
        response, "response", check_voice=check_voice, check_modalities=check_modalities
    )
    return replace(settings, **values)
