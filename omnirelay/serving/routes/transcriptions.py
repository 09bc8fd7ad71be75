"""``POST /v1/audio/transcriptions`` (docs/protocol.md §7.2a): an audio file in, its words out.

OpenAI's request, as ``multipart/form-data``: ``file`` (the audio; its format named by the
file name's extension: wav, mp3/mpeg/mpga, flac, ogg/oga/opus, webm, mp4/m4a), ``model``,
``response_format`` (``json``, the default, ``text``, ``verbose_json``, ``srt``, ``vtt``),
``timestamp_granularities[]`` (``segment``, ``word``: with ``verbose_json``), ``language``
(the recognizer's own: ``en``), ``temperature`` (0: the recognizer is deterministic).
What the recognizer cannot do is refused with a 400 naming the field, never ignored: a
``prompt``, another language, a temperature above 0, streaming, ``include[]``,
``chunking_strategy``, speaker names.

The pipeline must have a speech recognizer stage (``entry_input: audio``: ``voice-cpu``'s
PocketSphinx); the request enters there and ends there (the ``transcript`` modality,
docs/protocol.md §2.2): no text model or voice runs. The file is decoded and resampled
within the server's audio limits before anything is admitted, as chat's ``input_audio``.

Words are lower case without punctuation (the recognizer's dictionary). ``verbose_json``
has the file's ``duration``, ``words`` [{word, start, end}] in seconds, and ``segments``:
the words cut at pauses of :data:`SEGMENT_GAP_MS` or more, which ``srt`` and ``vtt`` make
their cues of. A segment's ``avg_logprob``, ``compression_ratio`` and ``no_speech_prob``
are not measured by this recognizer: they are 0.0, 1.0 and 0.0.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from starlette.datastructures import FormData, UploadFile
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from omnirelay.api import TRANSCRIPT
from omnirelay.errors import RequestFailedError
from omnirelay.models.inputs import AUDIO_INPUT_RATE, audio_inputs
from omnirelay.serving.errors import ApiError, request_failed
from omnirelay.serving.frontend import WHOLE, Frontend
from omnirelay.serving.media.audio_in import (
    FILE_EXTENSIONS,
    FILE_FORMATS,
    AudioInputError,
    AudioLimits,
    decode_audio,
)
from omnirelay.serving.protocol import check_request_id, read_body
from omnirelay.serving.streaming import ClientGone, until_disconnect

__all__ = ["RESPONSE_FORMATS", "SEGMENT_GAP_MS", "TimedWord", "Transcript", "segments", "transcriptions"]

RESPONSE_FORMATS = ("json", "text", "verbose_json", "srt", "vtt")
GRANULARITIES = ("segment", "word")
#: A pause this long between two words starts a new segment (a subtitle cue).
SEGMENT_GAP_MS = 400
#: The languages the recognizer hears (PocketSphinx's bundled US English model).
LANGUAGES = {"en": "english", "en-us": "english", "english": "english"}
#: the inputs key of a request whose words the recognizer times (its contract)
_WORD_TIMESTAMPS = "word_timestamps"
_REFUSED = {
    "prompt": "the recognizer takes no prompt",
    "stream": "streaming transcription is not supported; omit stream",
    "include[]": "log probabilities are not supported",
    "include": "log probabilities are not supported",
    "chunking_strategy": "the recognizer hears the whole file; omit chunking_strategy",
    "known_speaker_names[]": "speaker diarization is not supported",
    "known_speaker_references[]": "speaker diarization is not supported",
}
#: the form's multipart overhead allowed beyond the file itself
_FORM_OVERHEAD_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class TimedWord:
    word: str
    start_ms: int
    end_ms: int


@dataclass(frozen=True, slots=True)
class Transcript:
    """What the recognizer heard in one file."""

    words: list[TimedWord]
    duration_s: float

    @property
    def text(self) -> str:
        return " ".join(w.word for w in self.words)


def segments(words: list[TimedWord], gap_ms: int = SEGMENT_GAP_MS) -> list[list[TimedWord]]:
    """``words`` cut where a pause of ``gap_ms`` or more falls between two of them."""
    out: list[list[TimedWord]] = []
    for w in words:
        if out and w.start_ms - out[-1][-1].end_ms < gap_ms:
            out[-1].append(w)
        else:
            out.append([w])
    return out


async def transcriptions(request: Request, fe: Frontend) -> Response:
    entry = fe.pipeline.config.audio_entry_stage_id
    if entry is None:
        raise ApiError(
            400,
            f"model {fe.model_name!r} has no speech recognizer stage; transcriptions need one "
            "(serve one with: omnirelay serve --pipeline voice-cpu)",
            param="model",
        )
    form = await _read_form(request, fe)
    try:
        fe.check_model(_text(form, "model"))
        fmt, granularities = _options(form)
        audio, param = _file(form)
        raw = await audio.read()
    finally:
        await form.close()
    clip = await asyncio.to_thread(_decode, fe, raw, param)
    rid = check_request_id(request.headers.get("x-request-id"), "transcription")
    stream = fe.submit(
        endpoint="transcriptions",
        prompt_token_ids=[0],  # a generation stage's prompt: its input is the audio
        modalities=[TRANSCRIPT],
        request_id=rid,
        inputs={**audio_inputs([clip]), _WORD_TIMESTAMPS: True},
        entry_stage_id=entry,
        delivery=WHOLE,  # the transcript is sent whole: a lost replica runs it again
    )
    try:
        heard = await until_disconnect(request, _heard(stream))
    except ClientGone:
        return Response(status_code=499)
    finally:
        stream.close()
    transcript = Transcript(_parse_words(heard), clip.size / AUDIO_INPUT_RATE)
    headers = {"X-Request-Id": rid}
    return _render(transcript, fmt, granularities, headers)


async def _read_form(request: Request, fe: Frontend) -> FormData:
    content_type = request.headers.get("content-type", "")
    if content_type.partition(";")[0].strip().lower() != "multipart/form-data":
        shown = repr(content_type[:100]) if content_type else "none"
        raise ApiError(
            415,
            f"the request must be multipart/form-data with the audio as its 'file' field (got {shown})",
            code="unsupported_media_type",
        )
    limit = fe.config.max_audio_input_bytes + _FORM_OVERHEAD_BYTES
    body = await read_body(request, limit)
    replay = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return replay.pop() if replay else {"type": "http.disconnect"}

    try:
        return await Request(request.scope, receive).form(max_files=1, max_fields=64)
    except Exception as exc:  # starlette's MultiPartException and the parser's own errors
        raise ApiError(400, f"the multipart body cannot be read: {exc}") from exc


def _text(form: FormData, key: str) -> str | None:
    value = form.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ApiError(400, f"{key} must be a text field, not a file", param=key)
    return value


def _options(form: FormData) -> tuple[str, tuple[str, ...]]:
    """The response format and timestamp granularities; 400 for what cannot be honoured."""
    for key, why in _REFUSED.items():
        value = form.get(key)
        if value is not None and value not in ("", "false"):
            name = key.removesuffix("[]")
            raise ApiError(400, f"{name}: {why}", param=name, code="unsupported_parameter")
    fmt = _text(form, "response_format") or "json"
    if fmt not in RESPONSE_FORMATS:
        raise ApiError(
            400,
            f"response_format {fmt!r} is not supported; supported: {list(RESPONSE_FORMATS)}",
            param="response_format",
        )
    language = _text(form, "language")
    if language is not None and language.lower() not in LANGUAGES:
        raise ApiError(
            400,
            f"language {language!r} is not supported; the recognizer hears English ('en')",
            param="language",
            code="unsupported_parameter",
        )
    temperature = _text(form, "temperature")
    if temperature is not None:
        try:
            degrees = float(temperature)
        except ValueError:
            raise ApiError(
                400, f"temperature must be a number, got {temperature[:40]!r}", param="temperature"
            ) from None
        if degrees != 0.0:
            raise ApiError(
                400,
                f"temperature {degrees:g} is not supported; the recognizer is deterministic (0)",
                param="temperature",
                code="unsupported_parameter",
            )
    asked = form.getlist("timestamp_granularities[]") + form.getlist("timestamp_granularities")
    granularities: list[str] = []
    for g in asked:
        if not isinstance(g, str) or g not in GRANULARITIES:
            raise ApiError(
                400,
                f"timestamp_granularities {g!r} is not one of {list(GRANULARITIES)}",
                param="timestamp_granularities",
            )
        granularities.append(g)
    if granularities and fmt != "verbose_json":
        raise ApiError(
            400,
            "timestamp_granularities needs response_format 'verbose_json'",
            param="timestamp_granularities",
        )
    return fmt, tuple(dict.fromkeys(granularities or ["segment"]))


def _file(form: FormData) -> tuple[UploadFile, str]:
    audio = form.get("file")
    if audio is None:
        raise ApiError(400, "file is required: the audio to transcribe, as a form file field", param="file")
    if not isinstance(audio, UploadFile):
        raise ApiError(400, "file must be a file field (multipart), not text", param="file")
    name = audio.filename or ""
    ext = name.rpartition(".")[2].lower() if "." in name else ""
    if ext not in FILE_EXTENSIONS:
        raise ApiError(
            400,
            f"file {name[:100]!r}: the audio format is named by the file name's extension; supported: "
            f"{sorted(FILE_EXTENSIONS)}",
            param="file",
        )
    return audio, FILE_EXTENSIONS[ext]


def _decode(fe: Frontend, raw: bytes, fmt: str) -> Any:
    limits = AudioLimits(
        max_bytes=fe.config.max_audio_input_bytes, max_duration_s=fe.config.max_audio_input_s
    )
    try:
        return decode_audio(
            raw, fmt, sample_rate=AUDIO_INPUT_RATE, limits=limits, param="file", formats=FILE_FORMATS
        )
    except AudioInputError as exc:
        raise ApiError(400, str(exc), param="file") from exc


async def _heard(stream: Any) -> str:
    text = ""
    try:
        async for out in stream:
            if out.restarted:  # it lost a replica and runs again from the start
                text = ""
            elif out.modality == TRANSCRIPT and out.text:
                text = out.text
    except RequestFailedError as exc:
        raise request_failed(exc) from exc
    return text


def _parse_words(text: str) -> list[TimedWord]:
    """The recognizer's timed words (its contract: a JSON list, one entry per clip)."""
    if not text:
        return []
    try:
        clips = json.loads(text)
        return [
            TimedWord(str(w["word"]), int(w["start_ms"]), int(w["end_ms"])) for c in clips for w in c["words"]
        ]
    except (ValueError, KeyError, TypeError) as exc:
        raise ApiError(500, f"the recognizer's output could not be read: {exc}", type="server_error") from exc


def _render(t: Transcript, fmt: str, granularities: tuple[str, ...], headers: dict[str, str]) -> Response:
    usage = {"type": "duration", "seconds": max(1, round(t.duration_s))}
    if fmt == "json":
        return JSONResponse({"text": t.text, "usage": usage}, headers=headers)
    if fmt == "text":
        return PlainTextResponse(t.text + "\n", headers=headers)
    cut = segments(t.words)
    if fmt == "verbose_json":
        body: dict[str, Any] = {
            "task": "transcribe",
            "language": "english",
            "duration": round(t.duration_s, 3),
            "text": t.text,
            "usage": usage,
        }
        if "word" in granularities:
            body["words"] = [
                {"word": w.word, "start": w.start_ms / 1000, "end": w.end_ms / 1000} for w in t.words
            ]
        if "segment" in granularities:
            body["segments"] = [_segment(i, seg) for i, seg in enumerate(cut)]
        return JSONResponse(body, headers=headers)
    cues = [(seg[0].start_ms, seg[-1].end_ms, " ".join(w.word for w in seg)) for seg in cut]
    if fmt == "srt":
        blocks = [
            f"{i}\n{_clock(a, ',')} --> {_clock(b, ',')}\n{text}\n" for i, (a, b, text) in enumerate(cues, 1)
        ]
        return PlainTextResponse("\n".join(blocks), media_type="application/x-subrip", headers=headers)
    blocks = [f"{_clock(a, '.')} --> {_clock(b, '.')}\n{text}\n" for a, b, text in cues]
    return PlainTextResponse("WEBVTT\n\n" + "\n".join(blocks), media_type="text/vtt", headers=headers)


def _segment(i: int, seg: list[TimedWord]) -> dict[str, Any]:
    return {
        "id": i,
        "seek": 0,
        "start": seg[0].start_ms / 1000,
        "end": seg[-1].end_ms / 1000,
        "text": " ".join(w.word for w in seg),
        "tokens": [],
        "temperature": 0.0,
        "avg_logprob": 0.0,
        "compression_ratio": 1.0,
        "no_speech_prob": 0.0,
    }


def _clock(ms: int, sep: str) -> str:
    """``HH:MM:SS,mmm`` (SRT) or ``HH:MM:SS.mmm`` (WebVTT)."""
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    seconds, millis = divmod(rest, 1000)
    return f"{hours:02d}:{minutes:02d}:{seconds:02d}{sep}{millis:03d}"
