"""OpenAI's GA Realtime interface beside the beta ``realtime=v1`` one: the shape translation.

The session speaks one of the two (:data:`BETA`, :data:`GA`), or, until it knows,
:data:`AUTO`. A client that sends ``OpenAI-Beta: realtime=v1`` speaks beta; any other
one is told by its first ``session.update``: one with GA's fields (``type``, ``audio``,
``output_modalities``, ``max_output_tokens``, ``tracing`` …) makes the session GA, one
with beta's (``modalities``, ``voice``, ``turn_detection`` …) beta. Until then events
carry beta's names and ``session.created`` carries both shapes (each client reads its
own fields and ignores the other's).

Inbound, GA's ``session.update`` and ``response.create`` are translated into beta's
(:func:`session_to_beta`, :func:`response_to_beta`), so one set of checks
(:mod:`omnirelay.serving.realtime.events`) decides what is honoured; an error names GA's
field (:func:`ga_error`). Outbound, :func:`server_events` renames the events and reshapes
items and responses (assistant content ``output_audio`` / ``output_text``; an item added
and then done: ``conversation.item.added`` / ``.done``), and :func:`session_object` is
GA's ``session``.

A GA field whose meaning omnirelay cannot honour is refused only where ignoring it would
change what the user hears or gets; ``semantic_vad`` is the server VAD with its
``eagerness`` as the silence that ends a turn, and ``tracing``, ``noise_reduction`` and
``parallel_tool_calls`` are accepted and ignored (docs/conformance.md lists each).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from omnirelay.serving.realtime.events import EventError, RealtimeSettings, choice_event, tool_event

__all__ = [
    "AUTO",
    "BETA",
    "GA",
    "ga_error",
    "metadata_of",
    "protocol_of",
    "response_to_beta",
    "server_events",
    "session_object",
    "session_to_beta",
    "shape_of",
]

BETA, GA, AUTO = "beta", "ga", "auto"
#: session fields only GA has, and only beta has (shared ones tell nothing)
GA_ONLY = {
    "type",
    "audio",
    "output_modalities",
    "max_output_tokens",
    "tracing",
    "include",
    "truncation",
    "prompt",
    "reasoning",
    "parallel_tool_calls",
}
BETA_ONLY = {
    "modalities",
    "voice",
    "input_audio_format",
    "output_audio_format",
    "turn_detection",
    "max_response_output_tokens",
    "input_audio_transcription",
    "input_audio_noise_reduction",
}
_SHARED = {"instructions", "tools", "tool_choice", "model", "temperature", "sample_rate"}
#: ``semantic_vad``'s eagerness as the server VAD's silence_duration_ms
EAGERNESS_SILENCE_MS = {"low": 1200, "medium": 800, "auto": 800, "high": 400}
PCM_TYPE = "audio/pcm"
#: OpenAI's bounds on ``metadata``
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512

#: beta's field → GA's, for errors (longest first when rewriting)
_GA_PARAMS = {
    "session.input_audio_transcription": "session.audio.input.transcription",
    "session.turn_detection": "session.audio.input.turn_detection",
    "session.input_audio_format": "session.audio.input.format",
    "session.output_audio_format": "session.audio.output.format",
    "session.voice": "session.audio.output.voice",
    "session.modalities": "session.output_modalities",
    "session.max_response_output_tokens": "session.max_output_tokens",
    "response.output_audio_format": "response.audio.output.format",
    "response.voice": "response.audio.output.voice",
    "response.modalities": "response.output_modalities",
    "response.max_response_output_tokens": "response.max_output_tokens",
}
_RENAMED = {
    "response.audio.delta": "response.output_audio.delta",
    "response.audio.done": "response.output_audio.done",
    "response.audio_transcript.delta": "response.output_audio_transcript.delta",
    "response.audio_transcript.done": "response.output_audio_transcript.done",
    "response.text.delta": "response.output_text.delta",
    "response.text.done": "response.output_text.done",
}
_ASSISTANT_PARTS = {"audio": "output_audio", "text": "output_text"}


def protocol_of(headers: Mapping[str, str]) -> str:
    """:data:`BETA` for a client that sends ``OpenAI-Beta: realtime=v1``, else :data:`AUTO`."""
    beta = headers.get("openai-beta") or ""
    return BETA if "realtime=v1" in beta.replace(" ", "").split(",") else AUTO


def shape_of(session: Any) -> str:
    """Which interface a ``session.update``'s ``session`` speaks (:data:`AUTO`: can't tell)."""
    if not isinstance(session, dict):
        return AUTO
    if GA_ONLY & session.keys():
        return GA
    return BETA if BETA_ONLY & session.keys() else AUTO


def ga_error(exc: EventError) -> EventError:
    """``exc`` with beta's field names (param and message) as GA's."""
    param, message = exc.param, exc.message
    for beta, ga in sorted(_GA_PARAMS.items(), key=lambda kv: -len(kv[0])):
        if param is not None and (param == beta or param.startswith(beta + ".")):
            param = ga + param[len(beta) :]
        message = message.replace(beta, ga)
    return EventError(message, code=exc.code, param=param, fatal=exc.fatal, type=exc.type)


def _object(value: Any, where: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise EventError(f"{where} must be an object or null", param=where)
    return value


def _refuse_unknown(obj: Mapping[str, Any], known: set[str], where: str) -> None:
    unknown = sorted(set(obj) - known)
    if unknown:
        raise EventError(
            f"{where}.{unknown[0]} is not supported by this server; supported: {sorted(known)}",
            code="unsupported_field",
            param=f"{where}.{unknown[0]}",
        )


def _format(value: Any, where: str, rate: int) -> None:
    """An ``audio.*.format``: pcm at the session's rate only (another would be misheard)."""
    fmt = _object(value, where)
    _refuse_unknown(fmt, {"type", "rate"}, where)
    kind = fmt.get("type", PCM_TYPE)
    if kind != PCM_TYPE:
        raise EventError(
            f"{where}.type {json.dumps(kind)[:40]} is not supported; this server takes and sends "
            f"'{PCM_TYPE}' at {rate} Hz",
            param=f"{where}.type",
        )
    if fmt.get("rate", rate) != rate:
        raise EventError(f"{where}.rate must be {rate} (pcm's, as OpenAI's)", param=f"{where}.rate")


def _modalities(value: Any) -> Any:
    """GA's ``output_modalities`` (``["audio"]``: audio with its transcript) as beta's."""
    if isinstance(value, list) and "audio" in value:
        return ["text", "audio"]
    return value


def _turn_detection(value: Any) -> Any:
    where = "session.audio.input.turn_detection"
    if value is None or not isinstance(value, dict):
        return value
    td = dict(value)
    if td.get("type") == "semantic_vad":
        _refuse_unknown(td, {"type", "eagerness", "create_response", "interrupt_response"}, where)
        eagerness = td.pop("eagerness", None) or "auto"
        if eagerness not in EAGERNESS_SILENCE_MS:
            raise EventError(
                f"{where}.eagerness must be one of {sorted(EAGERNESS_SILENCE_MS)}", param=f"{where}.eagerness"
            )
        td["type"] = "server_vad"
        td["silence_duration_ms"] = EAGERNESS_SILENCE_MS[eagerness]
    elif td.get("idle_timeout_ms") is not None:
        raise EventError(
            f"{where}.idle_timeout_ms: this server does not prompt a silent user; set it to null",
            code="unsupported_field",
            param=f"{where}.idle_timeout_ms",
        )
    td.pop("idle_timeout_ms", None)
    return td


def _audio_input(value: Any, out: dict[str, Any], rate: int) -> None:
    where = "session.audio.input"
    audio_in = _object(value, where)
    _refuse_unknown(audio_in, {"format", "noise_reduction", "transcription", "turn_detection"}, where)
    if "format" in audio_in:
        _format(audio_in["format"], f"{where}.format", rate)
    noise = _object(audio_in.get("noise_reduction"), f"{where}.noise_reduction")
    if noise.get("type") not in (None, "near_field", "far_field"):
        raise EventError(
            f"{where}.noise_reduction.type must be 'near_field' or 'far_field'",
            param=f"{where}.noise_reduction.type",
        )
    if "transcription" in audio_in:
        out["input_audio_transcription"] = audio_in["transcription"]
    if "turn_detection" in audio_in:
        out["turn_detection"] = _turn_detection(audio_in["turn_detection"])


def _audio_output(value: Any, out: dict[str, Any], rate: int, where: str) -> None:
    audio_out = _object(value, where)
    _refuse_unknown(audio_out, {"format", "voice", "speed"}, where)
    if "format" in audio_out:
        _format(audio_out["format"], f"{where}.format", rate)
    speed = audio_out.get("speed")
    if speed is not None and speed != 1.0:
        raise EventError(
            f"{where}.speed: this server speaks at the voice's own speed; set 1.0 or leave it out",
            param=f"{where}.speed",
        )
    voice = audio_out.get("voice")
    if isinstance(voice, dict) and isinstance(voice.get("id"), str):
        voice = voice["id"]  # a custom voice's id names one of the pipeline's voices
    if voice is not None:
        out["voice"] = voice


def session_to_beta(session: Any, rate: int) -> dict[str, Any]:
    """GA's ``session.update`` ``session`` as beta's, or :class:`EventError` (GA's names)."""
    if not isinstance(session, dict):
        raise EventError("session.update needs an object field 'session'", param="session")
    _refuse_unknown(session, GA_ONLY | _SHARED, "session")
    if session.get("type", "realtime") != "realtime":
        raise EventError(
            f"session.type {json.dumps(session.get('type'))[:40]} is not supported; this server runs "
            "'realtime' sessions (transcribe with /v1/audio/transcriptions)",
            param="session.type",
        )
    out = {key: session[key] for key in _SHARED if key in session}
    if "output_modalities" in session:
        out["modalities"] = _modalities(session["output_modalities"])
    if "max_output_tokens" in session:
        out["max_response_output_tokens"] = session["max_output_tokens"]
    audio = _object(session.get("audio"), "session.audio")
    _refuse_unknown(audio, {"input", "output"}, "session.audio")
    _audio_input(audio.get("input"), out, rate)
    _audio_output(audio.get("output"), out, rate, "session.audio.output")
    if session.get("include"):
        raise EventError(
            "session.include: this server gives no transcription logprobs", param="session.include"
        )
    if session.get("truncation") not in (None, "auto"):
        raise EventError(
            "session.truncation: only 'auto' (the oldest items are dropped at the conversation's bounds)",
            param="session.truncation",
        )
    for key in ("prompt", "reasoning"):
        if session.get(key) is not None:
            raise EventError(
                f"session.{key} is not supported by this server",
                code="unsupported_field",
                param=f"session.{key}",
            )
    return out  # tracing and parallel_tool_calls: accepted, nothing to do


def metadata_of(value: Any) -> dict[str, str] | None:
    """``response.metadata``: up to 16 string pairs, echoed in the response's events."""
    where = "response.metadata"
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        raise EventError(f"{where} must be an object of strings", param=where)
    if len(value) > MAX_METADATA_KEYS or any(
        len(k) > MAX_METADATA_KEY or len(v) > MAX_METADATA_VALUE for k, v in value.items()
    ):
        raise EventError(
            f"{where}: at most {MAX_METADATA_KEYS} pairs, keys of at most {MAX_METADATA_KEY} characters, "
            f"values of at most {MAX_METADATA_VALUE}",
            param=where,
        )
    return dict(value)


def response_to_beta(response: Any, rate: int) -> tuple[Any, dict[str, str] | None]:
    """GA's ``response.create`` ``response`` as beta's, and its ``metadata``."""
    if not isinstance(response, dict):
        return response, None  # beta's checks say what is wrong with it
    known = {
        "output_modalities",
        "instructions",
        "audio",
        "max_output_tokens",
        "metadata",
        "conversation",
        "tools",
        "tool_choice",
        "input",
        "prompt",
        "temperature",
    }
    _refuse_unknown(response, known, "response")
    out = {key: response[key] for key in ("instructions", "conversation", "temperature") if key in response}
    if "output_modalities" in response:
        out["modalities"] = _modalities(response["output_modalities"])
    if "max_output_tokens" in response:
        out["max_response_output_tokens"] = response["max_output_tokens"]
    audio = _object(response.get("audio"), "response.audio")
    _refuse_unknown(audio, {"output"}, "response.audio")
    _audio_output(audio.get("output"), out, rate, "response.audio.output")
    if response.get("tools"):
        raise EventError(
            "response.tools is not supported by this server; set the tools with session.update",
            param="response.tools",
        )
    if response.get("tool_choice") not in (None, "auto", "none"):
        raise EventError(
            "response.tool_choice is not supported by this server; set it with session.update",
            param="response.tool_choice",
        )
    if response.get("input"):
        raise EventError(
            "response.input is not supported; a response answers the session's conversation "
            "(add items with conversation.item.create)",
            code="unsupported_field",
            param="response.input",
        )
    if response.get("prompt") is not None:
        raise EventError(
            "response.prompt is not supported by this server",
            code="unsupported_field",
            param="response.prompt",
        )
    return out, metadata_of(response.get("metadata"))


def _pcm(rate: int) -> dict[str, Any]:
    return {"type": PCM_TYPE, "rate": rate}


def session_object(
    session_id: str, model: str, settings: RealtimeSettings, sample_rate: int, window: dict[str, Any]
) -> dict[str, Any]:
    """GA's ``session`` of ``session.created`` / ``session.updated`` (with omnirelay's
    ``sample_rate`` and ``conversation``, as beta's)."""
    td = settings.turn_detection
    transcription = settings.transcription
    return {
        "type": "realtime",
        "object": "realtime.session",
        "id": session_id,
        "model": model,
        "output_modalities": ["audio"] if "audio" in settings.modalities else ["text"],
        "instructions": settings.instructions,
        "audio": {
            "input": {
                "format": _pcm(sample_rate),
                "transcription": None if transcription is None else dict(transcription),
                "noise_reduction": None,
                "turn_detection": None if td is None else {**td.as_event(), "idle_timeout_ms": None},
            },
            "output": {"format": _pcm(sample_rate), "voice": settings.voice, "speed": 1.0},
        },
        "tools": [tool_event(t) for t in settings.tools],
        "tool_choice": choice_event(settings.tool_choice),
        "max_output_tokens": "inf" if settings.max_output_tokens is None else settings.max_output_tokens,
        "tracing": None,
        "truncation": "auto",
        "prompt": None,
        "include": None,
        "sample_rate": sample_rate,
        "conversation": window,
    }


def _item(item: dict[str, Any]) -> dict[str, Any]:
    """An item as GA's: an assistant's content parts are ``output_audio`` / ``output_text``."""
    if item.get("role") != "assistant":
        return item
    content = [{**p, "type": _ASSISTANT_PARTS.get(p.get("type"), p.get("type"))} for p in item["content"]]
    return {**item, "content": content}


def _response(body: dict[str, Any]) -> dict[str, Any]:
    out = {k: v for k, v in body.items() if k not in ("modalities", "voice", "output_audio_format")}
    out["output"] = [_item(item) for item in body.get("output", [])]
    out["output_modalities"] = ["audio"] if "audio" in body.get("modalities", ()) else ["text"]
    out["audio"] = {"output": {"format": {"type": PCM_TYPE}, "voice": body.get("voice")}}
    out["conversation_id"] = None
    return out


def server_events(kind: str, payload: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A server event as GA's: renamed, reshaped; one item event may become two."""
    if "item" in payload:
        item = _item(payload["item"])
        payload = {**payload, "item": item}
        if kind == "conversation.item.created":
            added = [("conversation.item.added", payload)]
            done = {"previous_item_id": payload.get("previous_item_id"), "item": item}
            return (
                added if item.get("status") == "in_progress" else [*added, ("conversation.item.done", done)]
            )
        if kind == "response.output_item.done":
            return [("conversation.item.done", {"item": item}), (kind, payload)]
    if "response" in payload:
        payload = {**payload, "response": _response(payload["response"])}
    return [(_RENAMED.get(kind, kind), payload)]
