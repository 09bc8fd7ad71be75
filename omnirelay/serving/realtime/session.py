"""``WS /v1/realtime?model=…``: OpenAI's Realtime API, its audio-in / audio-out subset.

One WebSocket is one session: settings, an input audio buffer, a server voice activity
detector (:mod:`omnirelay.serving.realtime.vad`), a bounded conversation
(:mod:`omnirelay.serving.realtime.conversation`) and at most one response in flight, which is one
pipeline request. Events are JSON text frames with OpenAI's names and shapes; every
server event has an ``event_id`` and a ``type``. A session speaks OpenAI's beta
``realtime=v1`` event set or its GA one, as the client does; the names and shapes below
are beta's, and :mod:`omnirelay.serving.realtime.ga` translates GA's to them and back.

Client events: ``session.update``, ``input_audio_buffer.append`` (base64 pcm16 at 24 kHz,
OpenAI's rate, whatever the pipeline's own: the answer is resampled to it and the
speech from it) / ``commit`` / ``clear``,
``conversation.item.create`` (a text message, after ``previous_item_id``) / ``truncate``
/ ``delete`` / ``retrieve`` (:mod:`omnirelay.serving.realtime.items`),
``response.create``, ``response.cancel``.

Server events: ``session.created`` / ``session.updated``;
``input_audio_buffer.speech_started`` {audio_start_ms, item_id} / ``speech_stopped``
{audio_end_ms, item_id} / ``committed`` / ``cleared``; ``conversation.item.created`` /
``conversation.item.deleted`` / ``truncated`` / ``retrieved``; ``response.created``, ``response.output_item.added``,
``response.content_part.added``, ``response.audio.delta`` / ``response.audio_transcript.delta``
(audio answers) or ``response.text.delta`` (text-only answers), their ``.done`` events,
``response.output_item.done``, ``response.done`` {status: completed, cancelled, failed};
``conversation.item.input_audio_transcription.completed`` / ``failed`` (with
``input_audio_transcription`` set); ``error``.

* **Transcription.** ``input_audio_transcription: {model}`` (a pipeline with a recognizer
  stage: its recognizer transcribes, whatever model is named) says what each committed
  turn was heard as: the response that hears the turn reports its transcript, or, when no
  response follows the commit at once, a request for the transcript alone (it ends at
  the recognizer). The transcript becomes the item's; later responses read it instead of
  hearing the clip again.

* **Turns.** With ``turn_detection`` (server VAD, on by default), speech in the appended
  audio starts and ends a turn: ``speech_started``, then at the end ``speech_stopped``,
  the commit of the speech (from ``prefix_padding_ms`` before its onset) and, with
  ``create_response``, a response (one that ends while an answer still plays — with
  ``interrupt_response`` false — is answered once that answer is done). Without it the
  client commits and asks itself. A
  committed turn is a user item of ``input_audio``, resampled to the pipeline's input
  rate and heard the way chat's ``input_audio`` parts are
  (:mod:`omnirelay.serving.media.chat_turns`: a recognizer stage, or the Thinker's audio
  encoder); a pipeline that hears no audio answers the commit with an ``error``
  (``audio_input_unsupported``). The clip stays in the conversation (its transcript is
  the pipeline's, inside the request): later responses hear it again, within
  ``max_audio_input_s`` of audio in all (older items are dropped).
* **Barge-in.** Speech that starts while a response is in flight (``interrupt_response``)
  cancels it: the request is aborted through every stage, ``response.done`` with status
  ``cancelled`` follows ``speech_started`` at once, and no delta of that response comes
  after it. ``response.cancel`` does the same. The conversation keeps the cut answer: the
  text sent so far, item status ``incomplete``, until the client says with
  ``conversation.item.truncate`` how much of it was played.
* **Bounds.** Events of at most ``realtime_max_event_bytes``; at most
  ``realtime_max_buffer_s`` of buffered input (an append past it is refused, the buffer
  kept); at most ``realtime_max_items`` conversation items and ``max_input_chars`` of text
  (the oldest items are dropped: ``conversation.item.deleted`` each, then
  ``session.updated`` with ``conversation.num_dropped_items``); at most
  ``max_websockets`` open WebSockets, this session's counted among them from before its
  handshake is accepted until it closes (one more gets an ``error`` ``server_busy`` with
  ``retry_after_s`` and is closed with 1013 before any session starts); a response needs
  a request slot like any request (``error`` ``server_busy`` with ``retry_after_s``; the
  session goes on).
* **Errors.** A malformed frame — binary, too large, not a JSON object — gets an
  ``error`` event and the socket is closed with 1008. A well-formed event omnirelay cannot
  honour (an unknown type, a bad field, a value out of range) gets an ``error`` event
  that names the field; the session goes on and nothing it accepted is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from omnirelay.models.inputs import AUDIO_INPUT_RATE
from omnirelay.models.tools import ToolChoice
from omnirelay.serving.admission import BUSY_CLOSE_CODE, BUSY_CLOSE_REASON
from omnirelay.serving.errors import ApiError
from omnirelay.serving.frontend import Frontend
from omnirelay.serving.media import audio_in as audio_input
from omnirelay.serving.media.audio_out import wav_header
from omnirelay.serving.media.chat_turns import hears_audio
from omnirelay.serving.media.encoding import PCM_RATE
from omnirelay.serving.realtime import ga, items, tools
from omnirelay.serving.realtime.conversation import Conversation, Item
from omnirelay.serving.realtime.events import (
    EventError,
    RealtimeSettings,
    apply_session_update,
    decode_audio,
    decode_frame,
    new_id,
    response_overrides,
    session_object,
)
from omnirelay.serving.realtime.response import Response, ResponseRunner
from omnirelay.serving.realtime.vad import EnergyVad

__all__ = ["REALTIME_PATH", "serve_realtime"]

REALTIME_PATH = "/v1/realtime"
_POLICY = 1008  # close code: the client broke the protocol
_INTERNAL = 1011
#: the shortest commit OpenAI accepts
MIN_COMMIT_MS = 100

logger = logging.getLogger(__name__)


class InputBuffer:
    """The session's uncommitted input audio (int16 pieces, joined only when taken) and
    where it starts in the session's audio clock (samples appended since it began)."""

    def __init__(self) -> None:
        self.start = 0
        self._pieces: list[np.ndarray] = []
        self._size = 0

    @property
    def end(self) -> int:
        return self.start + self._size

    @property
    def num_samples(self) -> int:
        return self._size

    def append(self, samples: np.ndarray) -> None:
        if samples.size:
            self._pieces.append(samples)
            self._size += int(samples.size)

    def take(self, start: int, end: int) -> np.ndarray:
        """Samples ``[start, end)`` out of the buffer; everything before ``end`` goes."""
        self.drop_before(start)
        n = max(0, min(end, self.end) - self.start)
        joined = np.concatenate(self._pieces) if self._pieces else np.zeros(0, np.int16)
        out = joined[:n].copy()
        self._pieces = [joined[n:]] if joined.size > n else []
        self._size -= n
        self.start += n
        return out

    def drop_before(self, position: int) -> None:
        cut = min(max(0, position - self.start), self._size)
        self.start += cut
        self._size -= cut
        while cut:
            head = self._pieces[0]
            if head.size <= cut:
                self._pieces.pop(0)
                cut -= int(head.size)
            else:
                self._pieces[0] = head[cut:]
                cut = 0

    def clear(self) -> None:
        self.drop_before(self.end)


class Session:
    """One realtime session; see the module docstring."""

    def __init__(self, ws: WebSocket, fe: Frontend) -> None:
        self.ws = ws
        self.fe = fe
        self.cfg = fe.config
        #: the interface the client speaks (:mod:`omnirelay.serving.realtime.ga`)
        self.protocol = ga.protocol_of(ws.headers)
        #: the rate of pcm16 both ways (OpenAI's); the pipeline's own may differ
        self.rate = PCM_RATE
        self.id = new_id("sess")
        modalities = ("text", "audio") if "audio" in fe.output_types else ("text",)
        self.settings = RealtimeSettings(modalities=modalities, voice=fe.check_voice(None))
        self.conversation = Conversation(
            self.cfg.realtime_max_items,
            self.cfg.max_input_chars,
            max_audio_samples=round(self.cfg.max_audio_input_s * AUDIO_INPUT_RATE),
        )
        self.buffer = InputBuffer()
        self.vad: EnergyVad | None = None
        self._vad_origin = 0  # the session sample where the detector's clock starts
        self._speech: tuple[str, int] | None = None  # (item id, start sample) of the turn being spoken
        self._send_lock = asyncio.Lock()
        self.runner = ResponseRunner(self)
        self._reset_vad()

    # -- sending ------------------------------------------------------------------------

    async def send(
        self, kind: str, payload: dict[str, Any] | None = None, *, unless: Response | None = None
    ) -> None:
        """Send one server event. ``unless``: a response whose events stop once it is over
        (checked under the send lock, so nothing of it follows its ``response.done``)."""
        shaped = ga.server_events(kind, payload or {}) if self.protocol == ga.GA else [(kind, payload or {})]
        texts = [
            json.dumps({"event_id": new_id("event"), "type": k, **p}, separators=(",", ":"))
            for k, p in shaped
        ]
        async with self._send_lock:
            if unless is not None and unless.is_over:
                return
            for text in texts:
                await self.ws.send_text(text)

    async def send_error(self, exc: EventError, client_event_id: str | None = None) -> None:
        error: dict[str, Any] = {
            "type": exc.type,
            "code": exc.code,
            "message": exc.message,
            "param": exc.param,
        }
        error["event_id"] = client_event_id
        await self.send("error", {"error": error})

    async def send_session(self, kind: str = "session.updated") -> None:
        window = self.conversation.window()
        args = (self.id, self.fe.model_name, self.settings, self.rate, window)
        if self.protocol == ga.GA:
            session = ga.session_object(*args)
        elif self.protocol == ga.BETA:
            session = session_object(*args)
        else:  # not known yet: both shapes, each client reads its own
            session = {**ga.session_object(*args), **session_object(*args)}
            session["object"] = "realtime.session"
        await self.send(kind, {"session": session})

    async def add_item(self, item: Item, previous: str | None, *, after: str | None = None) -> None:
        """Add ``item`` to the conversation (after the item ``after``; None: at the end) and
        say so (``previous``: the item before it), and what the bounds dropped."""
        dropped = self.conversation.add(item, after)
        await self.send(
            "conversation.item.created", {"previous_item_id": previous, "item": item.event_item()}
        )
        await self.notify_dropped(dropped)

    async def notify_dropped(self, dropped: list[Item]) -> None:
        if not dropped:
            return
        for old in dropped:
            await self.send("conversation.item.deleted", {"item_id": old.id})
        await self.send_session()

    # -- the loop ---------------------------------------------------------------------

    async def run(self) -> None:
        await self.send_session("session.created")
        try:
            while True:
                try:
                    message = await asyncio.wait_for(self.ws.receive(), self.cfg.realtime_idle_timeout_s)
                except TimeoutError:
                    if self.runner.current is not None:
                        continue  # answering: the client is listening, not idle
                    await self._close_with(
                        EventError(
                            f"no client event within {self.cfg.realtime_idle_timeout_s:g} s; closing",
                            code="timeout",
                        ),
                        _POLICY,
                    )
                    return
                if message["type"] == "websocket.disconnect":
                    return
                if not await self._dispatch(message):
                    return
        finally:
            await self.runner.shutdown()

    async def _dispatch(self, message: Mapping[str, Any]) -> bool:
        """Handle one frame; False when the session is over."""
        client_id: str | None = None
        try:
            event = decode_frame(message, self.cfg.realtime_max_event_bytes)
            client_id = event.get("event_id")
            await self._handle(event)
        except EventError as exc:
            if exc.fatal:
                await self._close_with(exc, _POLICY)
                return False
            await self.send_error(exc, client_id)
        except (WebSocketDisconnect, OSError):
            raise
        except Exception as exc:  # a bug, not the client's: say so rather than vanish
            logger.exception("realtime session %s: unexpected error handling an event", self.id)
            await self._close_with(
                EventError(
                    f"internal error: {type(exc).__name__}", code="internal_error", type="server_error"
                ),
                _INTERNAL,
            )
            return False
        return True

    async def _close_with(self, exc: EventError, code: int) -> None:
        with contextlib.suppress(Exception):
            await self.send_error(exc)
            await self.ws.close(code=code)

    async def _handle(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "input_audio_buffer.append":
            await self._append(decode_audio(event.get("audio")))
        elif kind == "session.update":
            await self._update(event)
        elif kind == "input_audio_buffer.commit":
            await self._commit_all()
        elif kind == "input_audio_buffer.clear":
            self.buffer.clear()
            self._reset_vad()
            await self.send("input_audio_buffer.cleared")
        elif kind == "conversation.item.create":
            await items.create(self, event)
        elif kind == "response.create":
            await self.runner.start(self._response_settings(event))
        elif kind == "response.cancel":
            await self._cancel(event)
        elif kind == "conversation.item.truncate":
            await items.truncate(self, event)
        elif kind == "conversation.item.delete":
            await items.delete(self, event)
        elif kind == "conversation.item.retrieve":
            await items.retrieve(self, event)

    # -- settings ----------------------------------------------------------------------

    async def _update(self, event: dict[str, Any]) -> None:
        before = self.settings.turn_detection
        session = event.get("session")
        if self.protocol == ga.AUTO:  # the first update that tells says which interface
            self.protocol = ga.shape_of(session)
        is_ga = self.protocol == ga.GA
        if is_ga:
            session = ga.session_to_beta(session, self.rate)
        tooling: dict[str, Any] = {}
        if isinstance(session, dict):
            session, tooling = tools.read_tools(session, self.settings, self.fe)
        try:
            settings = apply_session_update(
                self.settings,
                session,
                check_voice=self.fe.check_voice,
                check_modalities=self.fe.chat_modalities,
                sample_rate=self.rate,
                can_transcribe=self.fe.pipeline.config.audio_entry_stage_id is not None,
            )
        except EventError as exc:
            raise ga.ga_error(exc) if is_ga else exc from None
        self.settings = replace(settings, **tooling)
        if self.settings.turn_detection != before:
            self._reset_vad()
        await self.send_session()

    def _response_settings(self, event: dict[str, Any]) -> RealtimeSettings:
        """``response.create``'s settings: its ``response`` (GA's or beta's) over the session's."""
        response, metadata = event.get("response"), None
        is_ga = self.protocol == ga.GA
        if is_ga:
            response, metadata = ga.response_to_beta(response, self.rate)
        try:
            settings = response_overrides(
                {**event, "response": response},
                self.settings,
                check_voice=self.fe.check_voice,
                check_modalities=self.fe.chat_modalities,
            )
        except EventError as exc:
            raise ga.ga_error(exc) if is_ga else exc from None
        if (
            is_ga
            and isinstance(event.get("response"), dict)
            and event["response"].get("tool_choice") == "none"
        ):
            settings = replace(settings, tool_choice=ToolChoice("none"))  # this response calls nothing
        return replace(settings, metadata=metadata)

    def _reset_vad(self) -> None:
        """A fresh detector from here on (turn detection changed, the buffer was cleared or
        committed by hand): a turn half heard is forgotten."""
        td = self.settings.turn_detection
        self.vad = None if td is None else EnergyVad(td.vad, self.rate)
        self._vad_origin = self.buffer.end
        self._speech = None

    def ms(self, sample: int) -> int:
        return round(sample * 1000 / self.rate)

    # -- input audio -------------------------------------------------------------------

    async def _append(self, samples: np.ndarray) -> None:
        limit = round(self.cfg.realtime_max_buffer_s * self.rate)
        if self.buffer.num_samples + samples.size > limit:
            raise EventError(
                f"the input audio buffer would hold {(self.buffer.num_samples + samples.size) / self.rate:.1f} s; "
                f"the limit is {self.cfg.realtime_max_buffer_s:g} s: commit or clear it (this append was not taken)",
                code="input_audio_buffer_full",
                param="audio",
            )
        self.buffer.append(samples)
        if self.vad is None:
            return
        td = self.settings.turn_detection
        assert td is not None
        for ev in self.vad.push(samples):
            if ev.kind == "start":
                await self._speech_started(
                    self._vad_origin + ev.sample, td.vad.prefix_padding_ms, td.interrupt_response
                )
            else:
                await self._speech_stopped(self._vad_origin + ev.at_sample, td.create_response)
        if self._speech is None:  # between turns only the prefix padding is kept
            self.buffer.drop_before(self.buffer.end - round(td.vad.prefix_padding_ms * self.rate / 1000))

    async def _speech_started(self, onset: int, padding_ms: int, interrupt: bool) -> None:
        start = max(self.buffer.start, onset - round(padding_ms * self.rate / 1000))
        item_id = new_id("item")
        self._speech = (item_id, start)
        await self.send(
            "input_audio_buffer.speech_started", {"audio_start_ms": self.ms(start), "item_id": item_id}
        )
        if interrupt:
            await self.runner.cancel("turn_detected")

    async def _speech_stopped(self, end: int, create_response: bool) -> None:
        assert self._speech is not None
        item_id, start = self._speech
        self._speech = None
        await self.send(
            "input_audio_buffer.speech_stopped", {"audio_end_ms": self.ms(end), "item_id": item_id}
        )
        audio = self.buffer.take(start, end)
        item = await self._commit(audio, item_id)
        if item is None:
            return
        if not create_response:
            self._transcribe(item)  # no response hears it: the transcript is asked alone
        elif self.runner.current is None:
            await self.runner.start(self.settings)
        else:  # an answer plays on (interrupt_response false): this turn's comes after it
            self.runner.answer_next = True

    async def _commit_all(self) -> None:
        item_id = self._speech[0] if self._speech is not None else new_id("item")
        audio = self.buffer.take(self.buffer.start, self.buffer.end)
        self._reset_vad()
        if audio.size * 1000 < MIN_COMMIT_MS * self.rate:
            raise EventError(
                f"the input audio buffer holds {self.ms(audio.size)} ms; a commit needs at least {MIN_COMMIT_MS} ms",
                code="input_audio_buffer_commit_empty",
            )
        item = await self._commit(audio, item_id)
        if item is not None:
            self._transcribe(item)

    def _transcribe(self, item: Item) -> None:
        """With ``input_audio_transcription`` on, what the recognizer hears in ``item``, as
        ``conversation.item.input_audio_transcription.completed`` (a response that hears the
        item first reports it instead)."""
        if self.settings.transcription is not None:
            self.runner.transcribe(item)

    async def _commit(self, audio: np.ndarray, item_id: str) -> Item | None:
        """Make committed speech a user turn; None (after an ``error``) when it cannot be."""
        if not hears_audio(self.fe):
            message = (
                f"the pipeline {self.fe.model_name!r} takes no audio input (no speech recognizer, no audio "
                "encoder): committed audio cannot become a user turn; send text with conversation.item.create"
            )
            await self.send_error(EventError(message, code="audio_input_unsupported"))
            return None
        # The pipeline hears at its own input rate: FFmpeg's resampler, off the event loop.
        clip = await asyncio.to_thread(_to_input_rate, audio, self.rate)
        previous = self.conversation.last_id
        await self.send("input_audio_buffer.committed", {"previous_item_id": previous, "item_id": item_id})
        item = Item(id=item_id, role="user", kind="input_audio", audio=clip)
        await self.add_item(item, previous)
        return item

    # -- items and responses -------------------------------------------------------------

    async def _cancel(self, event: dict[str, Any]) -> None:
        current = self.runner.current
        wanted = event.get("response_id")
        if current is None or (wanted is not None and wanted != current.id):
            raise EventError(
                "there is no response in progress to cancel"
                if current is None
                else f"response {wanted!r} is not the one in progress ({current.id!r})",
                code="response_cancel_not_active",
                param="response_id" if wanted is not None else None,
            )
        await self.runner.cancel("client_cancelled")


def _to_input_rate(audio: np.ndarray, rate: int) -> np.ndarray:
    """int16 PCM at the session's rate → float32 at the rate pipelines hear (16 kHz)."""
    wav = wav_header(rate, audio.size) + audio.astype("<i2").tobytes()
    limits = audio_input.AudioLimits(max_bytes=len(wav) + 1, max_duration_s=audio.size / rate + 1.0)
    return audio_input.decode_audio(wav, "wav", sample_rate=AUDIO_INPUT_RATE, limits=limits)


async def serve_realtime(ws: WebSocket, fe: Frontend) -> None:
    """Serve one ``/v1/realtime`` connection (see the module docstring). The socket holds a
    connection slot until it is closed, whichever way (client close, client gone, server
    error, shutdown); at the limit it is refused with 1013 before any session starts."""
    offered = ws.scope.get("subprotocols") or []
    # Browsers' OpenAI clients offer "realtime"; a server that names none fails their handshake.
    subprotocol = "realtime" if "realtime" in offered else None
    try:
        fe.check_model(ws.query_params.get("model"))
    except ApiError as exc:
        error = EventError(exc.message, code="model_not_found", param="model")
        await _refuse(ws, subprotocol, error, _POLICY)
        return
    try:
        slot = fe.open_websocket("realtime")
    except ApiError as exc:
        # Accepted only to say why: a browser sees a refused handshake as a bare 1006.
        error = EventError(exc.message, code=exc.code or "server_busy", type=exc.type)
        await _refuse(ws, subprotocol, error, BUSY_CLOSE_CODE, retry_after_s=fe.admission.retry_after_s)
        return
    try:
        await ws.accept(subprotocol=subprotocol)
        await Session(ws, fe).run()
    except (WebSocketDisconnect, OSError):
        pass
    finally:
        slot.release()
        if ws.application_state == WebSocketState.CONNECTED:
            with contextlib.suppress(Exception):
                await ws.close()


async def _refuse(
    ws: WebSocket, subprotocol: str | None, exc: EventError, code: int, *, retry_after_s: int | None = None
) -> None:
    """Accept the handshake only to send ``exc`` as an ``error`` event and close with ``code``."""
    error: dict[str, Any] = {
        "type": exc.type,
        "code": exc.code,
        "message": exc.message,
        "param": exc.param,
        "event_id": None,
    }
    if retry_after_s is not None:
        error["retry_after_s"] = retry_after_s
    with contextlib.suppress(Exception):
        await ws.accept(subprotocol=subprotocol)
        await ws.send_text(json.dumps({"event_id": new_id("event"), "type": "error", "error": error}))
        await ws.close(code=code, reason=BUSY_CLOSE_REASON if code == BUSY_CLOSE_CODE else None)
