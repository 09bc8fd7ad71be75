"""``WS /v1/audio/speech/stream``: streaming speech over one WebSocket (docs/protocol.md §7.4).

Client messages (JSON text frames with a ``type``):

* ``session.config`` — first, and again whenever settings change (applies to the next
  utterance): ``model``, ``voice``, ``response_format`` (default ``pcm``; every format
  of ``/v1/audio/speech``: ``mp3``, ``opus``, ``aac``, ``flac``, ``wav``, ``pcm``, made
  by the same encoders, :mod:`omnirelay.serving.media.encoding`: ``pcm`` is 24 kHz,
  ``wav`` the voice's own rate), ``stream_audio`` (default true), ``word_timestamps``
  (needs an aligner, ``stream_audio: true`` and ``pcm``), ``split`` (``none`` |
  ``sentence`` | ``clause``), ``instructions`` and ``language`` (as
  ``/v1/audio/speech``'s; ``null`` clears them). At most 4 MiB; the first must come
  within 10 s.
* ``input.text`` {``text``} — at most 128 KiB a message; appended to the utterance.
* ``input.done`` — flush: synthesize what was buffered as one utterance; the socket stays.
* ``session.close`` — finish what is queued, answer ``session.done``, close.

Server messages, per sentence (one pipeline request each; ``split: none`` makes the
whole utterance one sentence):

* ``audio.start`` {utterance_index, sentence_index, sentence_text, format, sample_rate
  (of the bytes that follow: 24,000 for ``pcm``, 48,000 for ``opus``), word_timestamps};
* the audio: binary frames (``stream_audio``: the encoder's bytes as the audio is made,
  their concatenation a playable file — a WAV stream starts with its header of unknown
  length; else one frame at the end holding the whole file), or with ``word_timestamps`` JSON
  ``audio.chunk`` frames {chunk_id, chunk_start_ms, chunk_end_ms, sample_rate,
  audio_b64, timestamps: null} and **one trailing ``audio.chunk`` with empty audio** whose
  ``timestamps`` are sentence-relative (a list: aligned; ``[]``: silence; ``null``: failed);
* ``audio.done`` {utterance_index, sentence_index, total_bytes, error}.

Then ``session.done`` on ``session.close``; ``error`` {message, code} for anything wrong.
A **malformed** message — a binary frame, over the size limit, not a JSON object (or
nested more than 64 deep), a ``type`` missing or not one of the four, a field of the
wrong JSON type — gets an ``error`` frame and the socket is closed with 1008 (policy
violation). A well-formed message with a value to fix (an unknown voice, a
``split`` not offered, too much text, ``input.done`` with nothing buffered) gets an
``error`` frame and the session goes on. A sentence refused for capacity gets ``error``
{code: ``server_busy``, status: 429, retry_after_s} and its ``audio.done`` with the error.
A client that goes away aborts the sentence in flight through every stage. The session
closes after 30 s without a client message while nothing is being synthesized; a bug in
the server ends it with an ``error`` frame and close 1011.

An open socket holds one of the server's ``max_websockets`` connection slots until it
closes (:mod:`omnirelay.serving.admission`); each sentence still takes a request slot
while it is spoken. Past the limit a new socket gets one ``error`` frame {code:
``server_busy``, status: 429, retry_after_s} and close 1013 (try again later) before
its session starts.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from omnirelay.errors import RequestFailedError, StageUnavailableError
from omnirelay.serving.admission import BUSY_CLOSE_CODE, BUSY_CLOSE_REASON
from omnirelay.serving.errors import ApiError, request_failed
from omnirelay.serving.frontend import Frontend, RequestStream
from omnirelay.serving.media.audio_out import DEFAULT_SAMPLE_RATE, AudioEmitter, AudioStreamError
from omnirelay.serving.media.encoding import FORMATS as ENCODINGS
from omnirelay.serving.media.encoding import AudioEncoder
from omnirelay.serving.protocol import loads_object
from omnirelay.serving.routes.speech import parse_timestamps, speech_extras

__all__ = ["SessionSettings", "serve_session", "split_text"]

SPLITS = ("none", "sentence", "clause")
FORMATS = tuple(ENCODINGS)
_SENTENCE_END = r"[.!?。！？]+"
_CLAUSE_END = r"[.!?。！？,;:，；：]+"
_POLICY = 1008  # close code: the client broke the protocol
_INTERNAL = 1011  # close code: the server hit an unexpected condition

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class SessionSettings:
    voice: str
    response_format: str = "pcm"
    stream_audio: bool = True
    word_timestamps: bool = False
    split: str = "none"
    instructions: str | None = None
    language: str | None = None


def split_text(text: str, split: str, *, final: bool) -> tuple[list[str], str]:
    """``(complete sentences, rest)`` of ``text``; with ``final`` the rest is a sentence too."""
    if split == "none":
        return ([text.strip()] if final and text.strip() else []), ("" if final else text)
    end = _SENTENCE_END if split == "sentence" else _CLAUSE_END
    sentences = []
    pos = 0
    for m in re.finditer(rf"{end}(?=\s|$)", text):
        piece = text[pos : m.end()].strip()
        if piece:
            sentences.append(piece)
        pos = m.end()
    rest = text[pos:]
    if final:
        if rest.strip():
            sentences.append(rest.strip())
        rest = ""
    return sentences, rest


class _ProtocolError(Exception):
    def __init__(self, message: str, *, code: str = "invalid_message", fatal: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.fatal = fatal


@dataclass(slots=True)
class _Sent:
    """What one sentence sent so far."""

    start: dict[str, Any]
    has_started: bool = False
    total: int = 0  # audio bytes


@dataclass(frozen=True, slots=True)
class _Job:
    utterance_index: int
    sentence_index: int
    text: str
    settings: SessionSettings


class _Session:
    def __init__(self, ws: WebSocket, fe: Frontend) -> None:
        self.ws = ws
        self.fe = fe
        self.cfg = fe.config
        self.settings: SessionSettings | None = None
        self.buffer = ""
        self.utterance_index = 0
        self.sentence_index = 0
        self.jobs: asyncio.Queue[_Job | None] = asyncio.Queue()
        self.is_busy = False
        self.id = f"ws-{uuid.uuid4().hex}"
        self._send_lock = asyncio.Lock()

    # -- sending ------------------------------------------------------------------------

    async def send_json(self, payload: dict[str, Any]) -> None:
        async with self._send_lock:
            await self.ws.send_text(json.dumps(payload, separators=(",", ":")))

    async def send_bytes(self, data: bytes) -> None:
        async with self._send_lock:
            await self.ws.send_bytes(data)

    async def send_error(self, message: str, code: str, **extra: Any) -> None:
        await self.send_json({"type": "error", "message": message, "code": code, **extra})

    # -- run ----------------------------------------------------------------------------

    async def run(self) -> None:
        worker = asyncio.create_task(self._work())
        reader = asyncio.create_task(self._read())
        try:
            done, _ = await asyncio.wait({worker, reader}, return_when=asyncio.FIRST_COMPLETED)
            if reader in done and reader.exception() is None and not reader.result():
                # session.close: the worker finishes what is queued and ends the session;
                # a client gone meanwhile only ends it early (its request is aborted).
                await asyncio.wait({worker})
        finally:
            for task in (reader, worker):
                task.cancel()
            await asyncio.gather(reader, worker, return_exceptions=True)
            await self._report_failure(worker)
            if self.ws.application_state == WebSocketState.CONNECTED:
                with contextlib.suppress(Exception):
                    await self.ws.close()

    async def _report_failure(self, worker: asyncio.Task[None]) -> None:
        """A synthesis task that died of a bug (not of the client going away) is logged and
        said: an ``error`` frame, then close 1011."""
        if not worker.done() or worker.cancelled():
            return
        exc = worker.exception()
        if exc is None or isinstance(exc, WebSocketDisconnect | OSError | RuntimeError):
            return  # done, or the client is gone (sending to a closed socket)
        logger.error("websocket session %s: synthesis failed", self.id, exc_info=exc)
        await self._fail(f"internal error: {type(exc).__name__}", "internal_error", code=_INTERNAL)

    async def _read(self) -> bool:
        """Read client messages until ``session.close`` (False) or the socket ends (True)."""
        while True:
            timeout = (
                self.cfg.ws_first_config_timeout_s if self.settings is None else self.cfg.ws_idle_timeout_s
            )
            try:
                message = await asyncio.wait_for(self.ws.receive(), timeout)
            except TimeoutError:
                if self.settings is not None and (self.is_busy or not self.jobs.empty()):
                    continue  # synthesizing: the client is waiting, not idle
                what = "no session.config" if self.settings is None else "no message"
                await self._fail(f"{what} within {timeout:g} s; closing", "timeout")
                return True
            if message["type"] == "websocket.disconnect":
                return True
            try:
                if await self._handle(message):
                    await self.jobs.put(None)
                    return False
            except _ProtocolError as exc:
                if exc.fatal:
                    await self._fail(exc.message, exc.code)
                    return True
                await self.send_error(exc.message, exc.code)
            except (WebSocketDisconnect, OSError):
                raise
            except Exception as exc:  # a bug, not the client's: say so rather than vanish
                logger.exception("websocket session %s: unexpected error handling a message", self.id)
                await self._fail(f"internal error: {type(exc).__name__}", "internal_error", code=_INTERNAL)
                return True

    async def _fail(self, message: str, error_code: str, *, code: int = _POLICY) -> None:
        with contextlib.suppress(Exception):
            await self.send_error(message, error_code)
            await self.ws.close(code=code)

    async def _handle(self, message: Mapping[str, Any]) -> bool:
        """Apply one client message; True for ``session.close``. A malformed message (see
        :func:`_decode`) is fatal; a well-formed one with a value to fix is not."""
        msg = _decode(message, self.cfg.ws_max_config_bytes)
        kind = msg["type"]
        if kind == "session.config":
            self.settings = self._configure(msg)
            return False
        if self.settings is None:
            raise _ProtocolError(
                f"the first message must be session.config, got {kind!r}; send the session settings first",
                code="config_required",
                fatal=True,
            )
        if kind == "input.text":
            await self._input_text(msg)
        elif kind == "input.done":
            await self._flush(final=True)
            self.utterance_index += 1
            self.sentence_index = 0
        elif kind == "session.close":
            if self.buffer.strip():
                await self._flush(final=True)
            return True
        return False

    def _configure(self, msg: dict[str, Any]) -> SessionSettings:
        base = self.settings or SessionSettings(voice=self.fe.check_voice(None))
        try:
            self.fe.check_model(_opt(msg, "model", str))
            voice = _opt(msg, "voice", str)
            values: dict[str, Any] = {
                "voice": self.fe.check_voice(voice) if voice is not None else base.voice,
                "response_format": _opt(msg, "response_format", str, base.response_format),
                "stream_audio": _opt(msg, "stream_audio", bool, base.stream_audio),
                "word_timestamps": _opt(msg, "word_timestamps", bool, base.word_timestamps),
                "split": _opt(msg, "split", str, base.split),
            }
            # Given (null too) they replace the session's; absent they stay.
            instructions = _opt(msg, "instructions", str) if "instructions" in msg else base.instructions
            language = _opt(msg, "language", str) if "language" in msg else base.language
            values["instructions"], values["language"] = self.fe.check_speech_options(
                values["voice"], instructions, language
            )
        except _FieldTypeError as exc:
            raise _ProtocolError(f"session.config: {exc}", code="invalid_message", fatal=True) from exc
        except ApiError as exc:
            raise _ProtocolError(f"session.config: {exc.message}", code="invalid_config") from exc
        settings = replace(base, **values)
        if settings.response_format not in FORMATS:
            raise _ProtocolError(
                f"session.config: response_format {settings.response_format!r}; supported: {list(FORMATS)}",
                code="invalid_config",
            )
        if settings.split not in SPLITS:
            raise _ProtocolError(
                f"session.config: split {settings.split!r}; supported: {list(SPLITS)}", code="invalid_config"
            )
        if settings.word_timestamps:
            if not self.fe.has_aligner:
                raise _ProtocolError(
                    f"session.config: word_timestamps needs a pipeline with a forced aligner; "
                    f"{self.fe.model_name!r} has none (omnirelay serve --pipeline qwen3-tts-tiny)",
                    code="invalid_config",
                )
            if not settings.stream_audio or settings.response_format != "pcm":
                raise _ProtocolError(
                    "session.config: word_timestamps needs stream_audio: true and response_format: 'pcm'",
                    code="invalid_config",
                )
        return settings

    async def _input_text(self, msg: dict[str, Any]) -> None:
        text = msg.get("text")
        if not isinstance(text, str):
            raise _ProtocolError("input.text needs a string field 'text'", fatal=True)
        if len(text.encode()) > self.cfg.ws_max_text_bytes:
            raise _ProtocolError(
                f"input.text of {len(text.encode())} bytes; the limit is {self.cfg.ws_max_text_bytes} a message",
                code="message_too_large",
            )
        if len(self.buffer) + len(text) > self.cfg.ws_max_utterance_chars:
            raise _ProtocolError(
                f"the utterance would exceed {self.cfg.ws_max_utterance_chars} characters; send input.done first",
                code="input_too_long",
            )
        self.buffer += text
        await self._flush(final=False)

    async def _flush(self, *, final: bool) -> None:
        assert self.settings is not None
        sentences, self.buffer = split_text(self.buffer, self.settings.split, final=final)
        if final and not sentences and self.sentence_index == 0:
            raise _ProtocolError(
                "input.done with no text buffered; send input.text first", code="empty_input"
            )
        for text in sentences:
            await self.jobs.put(_Job(self.utterance_index, self.sentence_index, text, self.settings))
            self.sentence_index += 1

    # -- synthesis ----------------------------------------------------------------------

    async def _work(self) -> None:
        while True:
            job = await self.jobs.get()
            if job is None:
                await self.send_json({"type": "session.done", "num_utterances": self.utterance_index})
                await self.ws.close()
                return
            self.is_busy = True
            try:
                await self._synthesize(job)
            finally:
                self.is_busy = False

    async def _synthesize(self, job: _Job) -> None:
        s = job.settings
        ids = {"utterance_index": job.utterance_index, "sentence_index": job.sentence_index}
        start: dict[str, Any] = {
            "type": "audio.start",
            **ids,
            "sentence_text": job.text,
            "format": s.response_format,
            "word_timestamps": s.word_timestamps,
        }
        try:
            stream = self.fe.submit_speech(
                endpoint="speech_ws",
                text=job.text,
                modalities=["audio", "timestamps"] if s.word_timestamps else ["audio"],
                request_id=f"{self.id}-{job.utterance_index}-{job.sentence_index}",
                extras=speech_extras(job.text, s.voice),
                voice=s.voice,
                instructions=s.instructions,
                language=s.language,
            )
        except ApiError as exc:
            # Over capacity: the frame carries what an HTTP 429's Retry-After would.
            retry = exc.headers.get("Retry-After")
            extra = {"retry_after_s": int(retry)} if retry is not None and retry.isdigit() else {}
            await self.send_error(exc.message, exc.code or exc.type, status=exc.status, **extra)
            await self.send_json({"type": "audio.done", **ids, "total_bytes": 0, "error": exc.message})
            return
        sent = _Sent(start)
        error: str | None = None
        try:
            await self._send_audio(stream, s, sent)
        except RequestFailedError as exc:
            error = exc.reason
            if isinstance(exc, StageUnavailableError):  # the client may retry this sentence
                await self.send_error(request_failed(exc).message, StageUnavailableError.code)
        except AudioStreamError as exc:
            error = str(exc)
            stream.abort("bad_audio")
        finally:
            stream.close()
        await self._start_once(sent, None)
        await self.send_json({"type": "audio.done", **ids, "total_bytes": sent.total, "error": error})

    async def _start_once(self, sent: _Sent, rate: int | None) -> None:
        """``audio.start`` goes right before the first audio, so it names the real rate of
        the bytes (None: no audio was made; the format's own rate, else the default)."""
        if sent.has_started:
            return
        sent.has_started = True
        fmt = ENCODINGS[sent.start["format"]]
        sent.start["sample_rate"] = rate or fmt.fixed_rate or DEFAULT_SAMPLE_RATE
        await self.send_json(sent.start)

    async def _send_audio(self, stream: RequestStream, s: SessionSettings, sent: _Sent) -> None:
        """Send one sentence's audio the way ``s`` says (``sent.total``: audio bytes sent),
        encoded as ``/v1/audio/speech`` encodes it: a streaming encoder's bytes as the audio
        is made, or the whole file at the end."""
        emitter = AudioEmitter(require_sample_rate=s.response_format == "wav")
        encoder = AudioEncoder(s.response_format, is_streaming=s.stream_audio)
        chunks = _Chunks() if s.word_timestamps else None
        timestamps: list[Any] | None = None
        async for out in stream:
            if out.modality == "timestamps" and out.stage_finished:
                timestamps = parse_timestamps(out)
                continue
            if out.modality != "audio":
                continue
            new = emitter.push(out.audio, out.sample_rate)
            if new is None:
                continue
            rate = emitter.sample_rate
            assert rate is not None
            stream.note_audio_sent(new.numel(), rate)
            data = encoder.push(new, rate)
            await self._start_once(sent, encoder.output_rate)
            await self._send_encoded(sent, data, encoder, chunks)
        tail = encoder.finish(emitter.sample_rate or emitter.default_sample_rate)
        await self._start_once(sent, encoder.output_rate)
        if s.stream_audio:
            await self._send_encoded(sent, tail, encoder, chunks)
        else:  # one frame: the whole file, with its sizes
            sent.total = len(tail)
            await self.send_bytes(tail)
        if chunks is not None:
            # The sentence's timestamps, in one trailing chunk with empty audio.
            rate = encoder.output_rate or DEFAULT_SAMPLE_RATE
            await self.send_json(chunks.frame(sent.total, sent.total, rate, b"", timestamps))

    async def _send_encoded(
        self, sent: _Sent, data: bytes, encoder: AudioEncoder, chunks: _Chunks | None
    ) -> None:
        """Streamed bytes: a binary frame, or with word timestamps a JSON ``audio.chunk``."""
        if not data:
            return
        start = sent.total
        sent.total += len(data)
        if chunks is None:
            await self.send_bytes(data)
            return
        assert encoder.output_rate is not None  # Invariant: bytes come after the first audio
        await self.send_json(chunks.frame(start, sent.total, encoder.output_rate, data, None))


class _Chunks:
    """The ``audio.chunk`` frames of one sentence (word timestamps: 16-bit ``pcm`` only)."""

    def __init__(self) -> None:
        self.next_id = 0

    def frame(
        self, start: int, end: int, rate: int, data: bytes, timestamps: list[Any] | None
    ) -> dict[str, Any]:
        """The frame of audio bytes ``[start, end)`` of the sentence."""
        frame = {
            "type": "audio.chunk",
            "chunk_id": self.next_id,
            "chunk_start_ms": round(start / 2 / rate * 1000, 3),
            "chunk_end_ms": round(end / 2 / rate * 1000, 3),
            "sample_rate": rate,
            "audio_b64": base64.b64encode(data).decode("ascii"),
            "timestamps": timestamps,
        }
        self.next_id += 1
        return frame


class _FieldTypeError(ValueError):
    """A field of a client message has the wrong JSON type (the message is malformed)."""


_JSON_TYPES = {str: "string", bool: "boolean"}
_MESSAGE_TYPES = ("session.config", "input.text", "input.done", "session.close")


def _opt(msg: dict[str, Any], key: str, kind: type, default: Any = None) -> Any:
    value = msg.get(key, default)
    if value is None:
        return default
    if type(value) is not kind:
        raise _FieldTypeError(f"{key} must be a {_JSON_TYPES[kind]}, got {json.dumps(value)[:40]}")
    return value


def _decode(message: Mapping[str, Any], max_bytes: int) -> dict[str, Any]:
    """A client frame as a message with a known ``type``, or a fatal :class:`_ProtocolError`:
    a binary frame, more than ``max_bytes``, not a JSON object (or nested too deep), or a
    ``type`` that is missing or not one of the protocol's."""
    raw = message.get("text")
    if raw is None:
        raise _ProtocolError("binary frames are not accepted; send JSON text messages", fatal=True)
    size = len(raw.encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise _ProtocolError(
            f"message of {size} bytes; the limit is {max_bytes}", code="message_too_large", fatal=True
        )
    try:
        msg = loads_object(raw, "the message")
    except ValueError as exc:
        raise _ProtocolError(str(exc), fatal=True) from exc
    kind = msg.get("type")
    if kind not in _MESSAGE_TYPES:
        shown = json.dumps(kind)[:60]
        raise _ProtocolError(
            f"unknown message type {shown}; expected one of {', '.join(_MESSAGE_TYPES)}", fatal=True
        )
    return msg


async def serve_session(ws: WebSocket, fe: Frontend) -> None:
    """Serve one WebSocket connection (see the module docstring). The socket holds a
    connection slot until it is closed, whichever way (client close, client gone, server
    error, shutdown); at the server's limit it is refused before any session starts."""
    try:
        slot = fe.open_websocket("speech_ws")
    except ApiError as exc:
        await _refuse(ws, exc)
        return
    try:
        await ws.accept()
        await _Session(ws, fe).run()
    except WebSocketDisconnect:
        pass
    finally:
        slot.release()


async def _refuse(ws: WebSocket, exc: ApiError) -> None:
    """Accept the handshake only to say why (a browser sees a refused handshake as a bare
    1006): an ``error`` frame as a sentence refused for capacity gets, then close 1013."""
    retry = exc.headers.get("Retry-After")
    extra = {"retry_after_s": int(retry)} if retry is not None and retry.isdigit() else {}
    error = {"type": "error", "message": exc.message, "code": exc.code or exc.type, "status": exc.status}
    with contextlib.suppress(Exception):
        await ws.accept()
        await ws.send_text(json.dumps({**error, **extra}, separators=(",", ":")))
        await ws.close(code=BUSY_CLOSE_CODE, reason=BUSY_CLOSE_REASON)
