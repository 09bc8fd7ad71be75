"""``POST /v1/audio/speech`` (docs/protocol.md §7.2): text in, audio out.

Body: ``input`` (spoken as given; non-empty, at most ``max_input_chars``), ``voice`` (the
pipeline's own, or an OpenAI name its file maps to one), ``response_format`` (``mp3``, the
default as OpenAI's, ``opus``, ``aac``, ``flac``, ``wav``, ``pcm``: see
:mod:`omnirelay.serving.media.encoding`), ``speed`` (1.0 only), ``stream_format`` (``audio``, or
``sse``: OpenAI's ``speech.audio.delta`` / ``speech.audio.done`` events), ``stream: true``
(as ``stream_format: "audio"``), ``word_timestamps``, ``instructions`` (followed by the
voices that take them, 400 from those that do not: the prompt side's
``instructions_refusal``), ``language`` (one of the prompt side's ``languages``).

The audio leaves as it is made, in every format but ``wav``: the response starts with
the first encoded bytes (a request that fails before them gets a JSON error), then each
new piece of audio is encoded and sent at once. ``wav`` streams, with a header of unknown
length, only when ``stream`` or ``stream_format`` asks; otherwise it comes whole with
its sizes. ``X-Sample-Rate`` is the rate of the bytes sent (Opus: 48 kHz).

Checks, in this order: streaming with ``word_timestamps`` → 400 that points to the
WebSocket endpoint; ``word_timestamps`` on a pipeline without an aligner → 400.

With ``word_timestamps`` the response is whole (its header comes first): the audio body,
plus ``X-Word-Timestamps: <json>``
when the JSON is at most 4,096 bytes, else ``X-Word-Timestamps-Omitted: oversize;
bytes=N; limit=4096``. Timestamps are ``[{"word", "start_ms", "end_ms"}, ...]`` (``[]``:
silence; ``null``: the alignment failed); :func:`parse_timestamps` reads the aligner
stage's output.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import torch
from starlette.requests import Request
from starlette.responses import Response

from omnirelay.api import RequestOutput
from omnirelay.errors import RequestFailedError
from omnirelay.serving.errors import ApiError, request_failed, stream_error_body
from omnirelay.serving.frontend import STREAMED, WHOLE, Frontend, RequestStream
from omnirelay.serving.media.audio_out import AudioEmitter, AudioStreamError
from omnirelay.serving.media.encoding import FORMATS, AudioEncoder
from omnirelay.serving.protocol import SpeechRequest, check_request_id, parse, read_json_body
from omnirelay.serving.streaming import ClientGone, ClosingStreamingResponse, until_disconnect

__all__ = ["WS_PATH", "parse_timestamps", "speech", "speech_extras", "timestamps_header"]

WS_PATH = "/v1/audio/speech/stream"


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


def _mode(fe: Frontend, req: SpeechRequest) -> str:
    """How the audio leaves (``sse``, ``stream`` or ``whole``) after the checks of
    docs/protocol.md §7.2, in its order."""
    if req.stream_format not in (None, "audio", "sse"):
        raise ApiError(
            400,
            f"stream_format {req.stream_format!r} is not supported; use 'audio' or 'sse'",
            param="stream_format",
        )
    asked_to_stream = req.stream or req.stream_format is not None
    if asked_to_stream and req.word_timestamps:
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
            "(serve one with: omnirelay serve --pipeline qwen3-tts-tiny)",
            param="word_timestamps",
        )
    if "audio" not in fe.output_types:
        raise ApiError(400, f"model {fe.model_name!r} does not produce audio", param="model")
    if not req.input.strip():
        raise ApiError(400, "input is empty; pass the text to speak", param="input")
    fe.check_text(req.input, "input")
    if req.response_format not in FORMATS:
        raise ApiError(
            400,
            f"response_format {req.response_format!r} is not supported; supported: {list(FORMATS)}",
            param="response_format",
        )
    if req.speed != 1.0:
        raise ApiError(400, f"speed {req.speed} is not supported; only 1.0", param="speed")
    if req.stream_format == "sse":
        return "sse"
    if req.word_timestamps or (req.response_format == "wav" and not asked_to_stream):
        return "whole"  # the timestamps header, or a WAV header with its sizes, comes first
    return "stream"


async def speech(request: Request, fe: Frontend) -> Response:
    req = parse(SpeechRequest, await read_json_body(request, fe.config.max_body_bytes))
    fe.check_model(req.model)
    mode = _mode(fe, req)
    voice = fe.check_voice(req.voice)
    instructions, language = fe.check_speech_options(voice, req.instructions, req.language)
    rid = check_request_id(request.headers.get("x-request-id"), "speech")
    modalities = ["audio", "timestamps"] if req.word_timestamps else ["audio"]
    stream = fe.submit_speech(
        endpoint="speech",
        text=req.input,
        modalities=modalities,
        request_id=rid,
        extras=speech_extras(req.input, voice),
        voice=voice,
        instructions=instructions,
        language=language,
        delivery=WHOLE if mode == "whole" else STREAMED,
    )
    fmt = req.response_format
    emitter = AudioEmitter(require_sample_rate=fmt == "wav")
    encoder = AudioEncoder(fmt, is_streaming=mode != "whole")
    headers = {"X-Request-Id": rid}
    if mode == "whole":
        try:
            samples, timestamps, rate = await until_disconnect(request, _collect(stream, emitter))
        except ClientGone:
            return Response(status_code=499)
        finally:
            stream.close()
        encoder.push(samples, rate)
        data = encoder.finish(rate)
        headers["X-Sample-Rate"] = str(encoder.output_rate)
        if req.word_timestamps:
            headers.update(timestamps_header(timestamps, fe.config.max_timestamps_header_bytes))
        return Response(content=data, media_type=encoder.media_type, headers=headers)
    return await _streaming_response(request, stream, _encoded(stream, emitter, encoder), encoder, mode)


async def _streaming_response(
    request: Request,
    stream: RequestStream,
    body: AsyncGenerator[bytes, None],
    encoder: AudioEncoder,
    mode: str,
) -> Response:
    """The response once the first bytes are ready: a request that fails before any audio
    still gets a JSON error with its status; after that, failures end the stream."""
    try:
        first: bytes | None = await until_disconnect(request, _next(body, stream))
    except ClientGone:
        stream.close()
        return Response(status_code=499)
    except BaseException:
        stream.close()
        raise
    headers = {"X-Request-Id": stream.request_id, "X-Sample-Rate": str(encoder.output_rate)}
    if mode == "sse":
        content, media = _sse(stream, _resume(first, body)), "text/event-stream"
        headers["Cache-Control"] = "no-cache"
    else:
        content, media = _resume(first, body), encoder.media_type
    return ClosingStreamingResponse(content, on_close=stream.close, media_type=media, headers=headers)


async def _next(body: AsyncGenerator[bytes, None], stream: RequestStream) -> bytes | None:
    """``body``'s first bytes (None: it ended with none), failures as API errors."""
    try:
        return await anext(body)
    except StopAsyncIteration:
        return None
    except (RequestFailedError, AudioStreamError) as exc:
        raise _failure(exc, stream) from exc


async def _resume(first: bytes | None, body: AsyncGenerator[bytes, None]) -> AsyncIterator[bytes]:
    try:
        if first is None:
            return
        yield first
        async for data in body:
            yield data
    finally:
        await body.aclose()


def _failure(exc: RequestFailedError | AudioStreamError, stream: RequestStream) -> ApiError:
    """The API error of a request that failed before its response started."""
    if isinstance(exc, RequestFailedError):
        return request_failed(exc)  # a stage that is down: 503 stage_unavailable
    stream.abort("bad_audio")
    return ApiError(500, f"the audio could not be sent: {exc}", type="server_error")


async def _collect(
    stream: RequestStream, emitter: AudioEmitter
) -> tuple[torch.Tensor, list[Any] | None, int]:
    """The whole answer: its samples, word timestamps and sample rate."""
    pieces: list[torch.Tensor] = []
    timestamps: list[Any] | None = None
    try:
        async for out in stream:
            if out.restarted:  # it lost a replica and runs again from the start
                pieces, timestamps = [], None
                emitter = AudioEmitter(emitter.kind, require_sample_rate=emitter.require_sample_rate)
            elif out.modality == "audio":
                new = emitter.push(out.audio, out.sample_rate)
                if new is not None:
                    assert emitter.sample_rate is not None
                    stream.note_audio_sent(new.numel(), emitter.sample_rate)
                    pieces.append(new)
            elif out.modality == "timestamps" and out.stage_finished:
                timestamps = parse_timestamps(out)
    except (RequestFailedError, AudioStreamError) as exc:
        raise _failure(exc, stream) from exc
    rate = emitter.sample_rate or emitter.default_sample_rate
    return (torch.cat(pieces) if pieces else torch.zeros(0)), timestamps, rate


async def _encoded(
    stream: RequestStream, emitter: AudioEmitter, encoder: AudioEncoder
) -> AsyncGenerator[bytes, None]:
    """The encoded bytes as the audio arrives (only non-empty pieces), then the encoder's
    tail. A failure raises: before the first bytes it becomes the response's error;
    after them the connection is cut, so the client sees a broken body."""
    async for out in stream:
        if out.modality != "audio":
            continue
        new = emitter.push(out.audio, out.sample_rate)
        if new is None:
            continue
        rate = emitter.sample_rate
        assert rate is not None
        stream.note_audio_sent(new.numel(), rate)
        data = encoder.push(new, rate)
        if data:
            yield data
    tail = encoder.finish(emitter.default_sample_rate)
    if tail:
        yield tail


async def _sse(stream: RequestStream, body: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """OpenAI's speech events: ``speech.audio.delta`` (base64 of the encoded bytes), then
    ``speech.audio.done``, or an ``error`` event when the request fails mid-stream."""

    def event(payload: dict[str, Any]) -> bytes:
        return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"

    try:
        async for data in body:
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
