"""``POST /v1/audio/speech`` (docs/protocol.md §7.2): text in, audio out.

Body: ``input`` (spoken as given; non-empty, at most ``max_input_chars``), ``voice``,
``response_format`` (``wav`` | ``pcm``: 16-bit little-endian mono), ``speed`` (1.0 only),
``stream: true`` or ``stream_format: "audio"`` (the audio bytes as they are made,
chunked; a WAV stream starts with a header of unknown length), ``stream_format: "sse"``
(OpenAI's ``speech.audio.delta`` / ``speech.audio.done`` events), ``word_timestamps``.

Checks, in this order: streaming with ``word_timestamps`` → 400 that points to the
WebSocket endpoint; ``word_timestamps`` on a pipeline without an aligner → 400.

Non-streaming with ``word_timestamps``: the audio body, plus ``X-Word-Timestamps: <json>``
when the JSON is at most 4,096 bytes, else ``X-Word-Timestamps-Omitted: oversize;
bytes=N; limit=4096``. Timestamps are ``[{"word", "start_ms", "end_ms"}, ...]`` (``[]``:
silence; ``null``: the alignment failed); :func:`parse_timestamps` reads the aligner
stage's output.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

import torch
from starlette.requests import Request
from starlette.responses import Response

from omnirelay.errors import RequestFailedError
from omnirelay.orchestrator.router import RequestOutput
from omnirelay.serving.audio import AudioEmitter, AudioStreamError, pcm16, wav_bytes, wav_header
from omnirelay.serving.errors import ApiError, request_failed, stream_error_body
from omnirelay.serving.frontend import Frontend, RequestStream
from omnirelay.serving.protocol import SpeechRequest, check_request_id, parse, read_json_body
from omnirelay.serving.streaming import ClientGone, ClosingStreamingResponse, until_disconnect

__all__ = ["WS_PATH", "parse_timestamps", "speech", "speech_extras", "timestamps_header"]

WS_PATH = "/v1/audio/speech/stream"
RESPONSE_FORMATS = ("wav", "pcm")
MEDIA_TYPES = {"wav": "audio/wav", "pcm": "audio/pcm"}


def parse_timestamps(out: RequestOutput) -> list[dict[str, Any]] | None:
    """The word timestamps an aligner output carries (its ``text`` is their JSON);
    ``None`` when there are none or they do not parse."""
    if not out.text:
        return None
    try:
        value = json.loads(out.text)
    except ValueError:
        return None
    if not isinstance(value, list):
        return None
    words = []
    for item in value:
        if not isinstance(item, dict) or not {"word", "start_ms", "end_ms"} <= item.keys():
            return None
        words.append(
            {"word": str(item["word"]), "start_ms": int(item["start_ms"]), "end_ms": int(item["end_ms"])}
        )
    return words


def timestamps_header(timestamps: list[dict[str, Any]] | None, limit: int) -> dict[str, str]:
    """``X-Word-Timestamps`` when its JSON fits ``limit`` bytes, else the omitted header."""
    text = json.dumps(timestamps, separators=(",", ":"), ensure_ascii=True)
    size = len(text.encode("ascii"))
    if size <= limit:
        return {"X-Word-Timestamps": text}
    return {"X-Word-Timestamps-Omitted": f"oversize; bytes={size}; limit={limit}"}


def speech_extras(text: str, voice: str) -> dict[str, Any]:
    """What every stage may read of a speech request (the aligner reads the text)."""
    return {"voice": voice, "additional_information": {"text": text}}


def _check(fe: Frontend, req: SpeechRequest) -> tuple[bool, str]:
    """``(is_streaming, voice)`` after the checks of docs/protocol.md §7.2, in its order."""
    if req.stream_format not in (None, "audio", "sse"):
        raise ApiError(
            400,
            f"stream_format {req.stream_format!r} is not supported; use 'audio' or 'sse'",
            param="stream_format",
        )
    is_streaming = req.stream or req.stream_format is not None
    if is_streaming and req.word_timestamps:
        raise ApiError(
            400,
            "word_timestamps cannot be streamed over HTTP; use the WebSocket endpoint "
            f"{WS_PATH} with session.config {{stream_audio: true, response_format: 'pcm', "
            "word_timestamps: true}}, or drop stream for one response with an X-Word-Timestamps header",
            param="word_timestamps",
        )
    if req.word_timestamps and not fe.has_aligner:
        raise ApiError(
            400,
            f"word_timestamps needs a pipeline with a forced-aligner stage; {fe.model_name!r} has none "
            "(serve one with: omnirelay serve --pipeline qwen3-tts-aligner-tiny)",
            param="word_timestamps",
        )
    if "audio" not in fe.output_types:
        raise ApiError(400, f"model {fe.model_name!r} does not produce audio", param="model")
    if not req.input.strip():
        raise ApiError(400, "input is empty; pass the text to speak", param="input")
    fe.check_text(req.input, "input")
    if req.response_format not in RESPONSE_FORMATS:
        raise ApiError(
            400,
            f"response_format {req.response_format!r} is not supported; supported: {list(RESPONSE_FORMATS)}",
            param="response_format",
        )
    if req.speed != 1.0:
        raise ApiError(400, f"speed {req.speed} is not supported; only 1.0", param="speed")
    return is_streaming, fe.check_voice(req.voice)


async def speech(request: Request, fe: Frontend) -> Response:
    req = parse(SpeechRequest, await read_json_body(request, fe.config.max_body_bytes))
    fe.check_model(req.model)
    is_streaming, voice = _check(fe, req)
    rid = check_request_id(request.headers.get("x-request-id"), "speech")
    modalities = ["audio", "timestamps"] if req.word_timestamps else ["audio"]
    stream = fe.submit_speech(
        endpoint="speech",
        text=req.input,
        modalities=modalities,
        request_id=rid,
        extras=speech_extras(req.input, voice),
    )
    fmt = req.response_format
    headers = {"X-Request-Id": rid}
    emitter = AudioEmitter(require_sample_rate=fmt == "wav")
    if is_streaming:
        if req.stream_format == "sse":
            body = _sse(stream, emitter, fmt)
            media = "text/event-stream"
        else:
            body = _raw(stream, emitter, fmt)
            media = MEDIA_TYPES[fmt]
        return ClosingStreamingResponse(body, on_close=stream.close, media_type=media, headers=headers)
    try:
        samples, timestamps = await until_disconnect(request, _collect(stream, emitter))
    except ClientGone:
        return Response(status_code=499)
    finally:
        stream.close()
    rate = emitter.sample_rate or emitter.default_sample_rate
    headers["X-Sample-Rate"] = str(rate)
    if req.word_timestamps:
        headers.update(timestamps_header(timestamps, fe.config.max_timestamps_header_bytes))
    data = wav_bytes(samples, rate) if fmt == "wav" else pcm16(samples)
    return Response(content=data, media_type=MEDIA_TYPES[fmt], headers=headers)


async def _collect(stream: RequestStream, emitter: AudioEmitter) -> tuple[torch.Tensor, list[Any] | None]:
    pieces: list[torch.Tensor] = []
    timestamps: list[Any] | None = None
    try:
        async for out in stream:
            if out.modality == "audio":
                new = emitter.push(out.audio, out.sample_rate)
                if new is not None:
                    assert emitter.sample_rate is not None
                    stream.note_audio_sent(new.numel(), emitter.sample_rate)
                    pieces.append(new)
            elif out.modality == "timestamps" and out.stage_finished:
                timestamps = parse_timestamps(out)
    except RequestFailedError as exc:
        raise request_failed(exc) from exc
    except AudioStreamError as exc:
        stream.abort("bad_audio")
        raise ApiError(500, f"the audio could not be sent: {exc}", type="server_error") from exc
    return (torch.cat(pieces) if pieces else torch.zeros(0)), timestamps


async def _audio_bytes(stream: RequestStream, emitter: AudioEmitter, fmt: str) -> AsyncIterator[bytes]:
    """The encoded bytes of each new audio piece; a WAV stream starts with its header.
    A failure mid-stream raises (the connection is cut, so the client sees a broken body)."""
    has_header = False
    async for out in stream:
        if out.modality != "audio":
            continue
        new = emitter.push(out.audio, out.sample_rate)
        if new is None:
            continue
        rate = emitter.sample_rate
        assert rate is not None
        stream.note_audio_sent(new.numel(), rate)
        data = pcm16(new)
        if fmt == "wav" and not has_header:
            data = wav_header(rate) + data
            has_header = True
        yield data
    if fmt == "wav" and not has_header:  # no audio at all: still a valid (empty) WAV
        yield wav_header(emitter.default_sample_rate, 0)


async def _raw(stream: RequestStream, emitter: AudioEmitter, fmt: str) -> AsyncIterator[bytes]:
    async for data in _audio_bytes(stream, emitter, fmt):
        yield data


async def _sse(stream: RequestStream, emitter: AudioEmitter, fmt: str) -> AsyncIterator[bytes]:
    def event(payload: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

    try:
        async for data in _audio_bytes(stream, emitter, fmt):
            yield event({"type": "speech.audio.delta", "audio": base64.b64encode(data).decode("ascii")})
    except (RequestFailedError, AudioStreamError) as exc:
        if isinstance(exc, RequestFailedError):
            yield event({"type": "error", **stream_error_body(exc)})
        else:
            stream.abort("bad_audio")
            yield event({"type": "error", "error": {"message": f"the request failed mid-stream: {exc}"}})
        return
    yield event(
        {"type": "speech.audio.done", "usage": {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}}
    )
